"""Run GroupTrainer.make_rollout on deterministic fake rollouts, in 1 or N processes.

Used by tests/training/test_distributed.py:
    python tests/scripts/dist_advantages.py OUT.json ESTIMATOR
    torchrun --standalone --nproc_per_node 2 tests/scripts/dist_advantages.py OUT.json ESTIMATOR
Rank 0 writes, for 3 steps, every sample's (step, prompt, output, group, advantage) to OUT.json, with the
number of processes and accelerate's distributed type (asserted here: MULTI_CPU with WORLD_SIZE processes).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object

from mmalign.config import config_from_dict
from mmalign.data.batch import Rollout
from mmalign.policies.base import ActionStats, Policy
from mmalign.training.trainer import GroupTrainer
from pipelines import TrainingSetup
from rewards import RewardSet


class FakePolicy(Policy):
    """Outputs depend only on (prompt, sample index): the same rollouts in any process layout. Only sampling
    is used (the script calls `make_rollout`); the rest of the contract is not needed here."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(2, 1)
        self.forward_model = self.model

    def rollout(self, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool) -> Rollout:
        prompts, texts = [], []
        for r in rows:
            q = int(r["question"])
            for j in range(group_size):
                prompts.append(r["prompt"])
                texts.append(f"<answer>{(q * 7 + j * j * 3) % 4}</answer>" + ("!" * ((q + j) % 3)))
        b = len(prompts)
        return Rollout(
            group=torch.arange(len(rows)).repeat_interleave(group_size),
            mask=torch.ones(b, 3, dtype=torch.bool),
            prompts=prompts,
            logp_old=torch.zeros(b, 3) if compute_logp else None,
            columns={k: [r[k] for r in rows for _ in range(group_size)] for k in rows[0]},
            outputs={"texts": texts, "num_tokens": torch.full((b,), 3)},
        )

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    def action_stats(self, rollout: Rollout) -> ActionStats:
        raise NotImplementedError("the script only samples")

    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        raise NotImplementedError("the script only samples")

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    def save(self, path: Any) -> None:
        raise NotImplementedError("the script only samples")


def main() -> None:
    out_path, estimator = sys.argv[1], sys.argv[2]
    cfg = config_from_dict(
        {
            "pipeline": "fake",
            "output_dir": out_path + ".run",
            "overwrite": True,
            "rollout": {"group_size": 5, "prompts_per_step": 6},
            "rewards": [
                {"name": "answer_accuracy", "kwargs": {"extract": "tag"}},
                {"name": "format", "weight": 0.5, "kwargs": {"tags": ["answer"], "strict": True}},
            ],
            "algorithm": {"estimator": estimator},
            "trainer": {"cpu": True, "progress_bar": False},
        },
        "dist_advantages",
    )
    rows = [{"question": str(i), "answer": str(i % 4), "prompt": f"q{i}"} for i in range(18)]
    comps = TrainingSetup(policy=FakePolicy(), rewards=RewardSet(cfg.rewards), data=rows)
    trainer = GroupTrainer(cfg, comps, accelerator=Accelerator(cpu=True))
    acc = trainer.accelerator
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    assert acc.num_processes == launched, (acc.num_processes, launched)
    if launched > 1:  # really N gloo processes, not N copies of a one-process run
        assert acc.distributed_type == DistributedType.MULTI_CPU, acc.distributed_type
    records = []
    for step in range(3):
        trainer.timers = {"rollout": 0.0, "reward": 0.0}
        batch, _ = trainer.make_rollout()
        for i in range(len(batch)):
            records.append(
                {
                    "step": step,
                    "prompt": batch.prompts[i],
                    "output": batch.outputs["texts"][i],
                    "group": int(batch.group[i]),
                    "advantage": float(batch.advantages[i]),
                    "in_loss": bool(batch.mask[i].any()),
                }
            )
    everything = gather_object(records)
    if trainer.is_main:
        with open(out_path, "w") as f:
            json.dump(
                {
                    "world_size": trainer.world,
                    "distributed_type": str(acc.distributed_type.value),
                    "records": everything,
                },
                f,
            )
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()  # destroys the process group: a clean exit for torchrun


if __name__ == "__main__":
    main()
    # Skip interpreter teardown: under load, gloo's threads occasionally abort the process there
    # ("terminate called without an active exception") after all work is done and written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
