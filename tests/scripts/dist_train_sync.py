"""Train 3 steps of the text pipeline in N processes; every rank writes a digest of its weights.

    torchrun --standalone --nproc_per_node 2 tests/scripts/dist_train_sync.py OUT_DIR [shared_prefix]
Asserts that accelerate set up MULTI_CPU with WORLD_SIZE processes (and writes both into the rank files).
DDP must keep the replicas identical (the shared-prefix forward runs part of the model outside
the DDP wrapper, so this checks that gradients of every parameter are still all-reduced).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

import pipelines
from mmalign import tiny
from mmalign.config import config_from_dict
from mmalign.training.trainer import GroupTrainer

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    out = Path(sys.argv[1])
    shared = len(sys.argv) < 3 or sys.argv[2] != "plain"
    acc = Accelerator(cpu=True)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    assert acc.num_processes == launched, (acc.num_processes, launched)
    if launched > 1:  # really N gloo processes, not N copies of a one-process run
        assert acc.distributed_type == DistributedType.MULTI_CPU, acc.distributed_type
    model_dir = out / "model"
    if acc.is_main_process:  # (transformers' save_pretrained writes nothing on other ranks)
        torch.manual_seed(0)
        texts = [f"Q: {a} + {b} = ?\nA: <answer>{a + b}</answer>" for a in range(10) for b in range(10)]
        tok = tiny.train_bpe_tokenizer(texts, 300)
        tiny.tiny_causal_lm(tok, hidden_size=32, intermediate_size=64).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    acc.wait_for_everyone()
    cfg = config_from_dict(
        {
            "pipeline": "text_reasoning",
            "output_dir": str(out / "run"),
            "overwrite": True,
            "model": {"name_or_path": str(model_dir), "shared_prefix": shared},
            "data": {
                "train": str(REPO / "assets/text_reasoning/train.jsonl"),
                "prompt_template": "Q: {question} = ?\nA:",
            },
            "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 6},
            "rewards": [{"name": "format", "kwargs": {"pattern": r"[^e]*", "search": False}}],
            "trainer": {"steps": 3, "lr": 1e-2, "cpu": True, "progress_bar": False, "save_every": 100},
        },
        "dist_train_sync",
    )
    trainer = GroupTrainer(cfg, pipelines.get("text_reasoning")(cfg), accelerator=acc)
    before = [p.detach().clone() for p in trainer.policy.model.parameters()]
    history = trainer.train()
    moved = sum(
        float((p.detach() - b).abs().sum()) for p, b in zip(trainer.policy.model.parameters(), before)
    )
    after = {n: float(p.detach().double().sum()) for n, p in trainer.policy.model.named_parameters()}
    (out / f"rank{acc.process_index}.json").write_text(
        json.dumps(
            {
                "moved": moved,
                "after": after,
                "losses": [m.get("loss") for m in history],
                "world_size": acc.num_processes,
                "distributed_type": str(acc.distributed_type.value),
            }
        )
    )
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main()
    # Skip interpreter teardown: under load, gloo's threads occasionally abort the process there
    # ("terminate called without an active exception") after all work is done and written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
