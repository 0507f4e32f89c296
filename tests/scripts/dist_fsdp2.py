"""FSDP2 (``fully_shard`` on a CPU device mesh, gloo) under the trainer; used by tests/training/test_fsdp2.py.

    torchrun --standalone --nproc_per_node 2 tests/scripts/dist_fsdp2.py OUT_DIR fsdp
    python tests/scripts/dist_fsdp2.py OUT_DIR reference

``fsdp`` (2 processes): the tiny text model of dist_train_sync.py is sharded with `apply_fsdp2`; rollouts are
sampled by a `FakeEngine` (its own plain copy of the weights, synced from the sharded model every step).
1. Each rank makes one rollout, saves it (``batch_rank{r}.pt``) and runs `GroupTrainer.update` on it; the
   gathered full weights after the update go to ``fsdp_after.pt``, the metrics to ``fsdp_rank{r}.json``.
2. Engine sync: the engine's weights after the next sync equal the gathered weights (``fsdp_rank{r}.json``).
3. LoRA: `merged_state_dict` / `adapter_state_dict` of a sharded peft model equal the unsharded ones.
4. Sharded checkpoints: a fresh run trains 4 steps (checkpoints at 2 and 4); another fresh run resumes from
   step 2 and trains to 4; both runs' metrics of steps 3-4 and final weights go to ``fsdp_rank{r}.json``.
``reference`` (1 process, no sharding): `GroupTrainer.update` on the two saved rollouts concatenated (the
global batch), from the same initial weights; weights to ``reference_after.pt``, metrics to
``reference.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

import pipelines
from mmalign import tiny
from mmalign.config import config_from_dict
from mmalign.data.batch import Rollout
from mmalign.engines.fake import FakeEngine
from mmalign.training import rundir
from mmalign.training.distributed import (
    SHARDED_DIR,
    apply_fsdp2,
    gather_full_state_dict,
    is_fsdp2,
    load_sharded,
    save_sharded,
)
from mmalign.training.trainer import GroupTrainer

REPO = Path(__file__).resolve().parents[2]


def make_cfg(out: Path, run: str, **trainer: Any) -> Any:
    return config_from_dict(
        {
            "pipeline": "text_reasoning",
            "output_dir": str(out / run),
            "overwrite": True,
            "model": {"name_or_path": str(out / "model")},
            "data": {
                "train": str(REPO / "assets/text_reasoning/train.jsonl"),
                "prompt_template": "Q: {question} = ?\nA:",
            },
            "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 6},
            "rewards": [{"name": "format", "kwargs": {"pattern": r"[^e]*", "search": False}}],
            "trainer": {
                "steps": 4,
                "lr": 1e-2,
                "cpu": True,
                "progress_bar": False,
                "save_every": 100,
                "num_iterations": 2,
                "microbatch_size": 4,
                "max_grad_norm": 0.5,
                **trainer,
            },
        },
        "dist_fsdp2",
    )


def build(cfg: Any, acc: Accelerator, *, shard: bool, resume: bool = False) -> GroupTrainer:
    components = pipelines.get("text_reasoning")(cfg)
    policy = components.policy
    policy.engine = FakeEngine(policy.model, policy.tokenizer)  # a plain copy, built before sharding
    if shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        apply_fsdp2(policy.model, init_device_mesh("cpu", (acc.num_processes,)))
        for name, p in policy.model.named_parameters():
            assert isinstance(p, DTensor), name
            assert tuple(p.placements) == (Shard(0),), (name, p.placements)
            local, full = p.to_local().numel(), p.numel()
            assert abs(local - full / acc.num_processes) <= p.shape[1:].numel(), (name, local, full)
    trainer = GroupTrainer(cfg, components, accelerator=acc, resume=resume)
    if shard:
        assert trainer.sharded and is_fsdp2(trainer.policy.forward_model)
        assert trainer.policy.forward_model is policy.model  # not wrapped in DDP
        assert policy._sampling_kwargs().get("synced_gpus") is True  # generate runs lock-stepped
        assert not policy._use_chunked(policy.model)  # the full-logits path under FSDP2
    return trainer


def metrics(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in history]


def left_pad_prompts(rollouts: list[Rollout]) -> None:
    """Give every rollout the same prompt width, padding on the left (as the policy pads prompts)."""
    width = max(r.payload["prompt_ids"].shape[1] for r in rollouts)
    for r in rollouts:
        ids, mask = r.payload["prompt_ids"], r.payload["prompt_mask"]
        extra = width - ids.shape[1]
        if extra:
            r.payload["prompt_ids"] = torch.cat([ids.new_zeros(ids.shape[0], extra), ids], dim=1)
            r.payload["prompt_mask"] = torch.cat([mask.new_zeros(mask.shape[0], extra), mask], dim=1)


def run_fsdp(out: Path) -> None:
    from accelerate.utils import DistributedType

    acc = Accelerator(cpu=True)
    assert acc.distributed_type == DistributedType.MULTI_CPU, acc.distributed_type
    assert acc.num_processes == 2, acc.num_processes
    rank = acc.process_index
    if acc.is_main_process:
        torch.manual_seed(0)
        texts = [f"Q: {a} + {b} = ?\nA: <answer>{a + b}</answer>" for a in range(10) for b in range(10)]
        tok = tiny.train_bpe_tokenizer(texts, 300)
        tiny.tiny_causal_lm(tok, hidden_size=32, intermediate_size=64).save_pretrained(out / "model")
        tok.save_pretrained(out / "model")
    acc.wait_for_everyone()
    result: dict[str, Any] = {"world_size": acc.num_processes, "distributed_type": acc.distributed_type.value}

    # 1. one update on a recorded batch
    trainer = build(make_cfg(out, "update"), acc, shard=True)
    before = gather_full_state_dict(trainer.policy.model, trainable_only=True)
    batch, _ = trainer.make_rollout()
    torch.save(batch, out / f"batch_rank{rank}.pt")
    trainer.policy.model.train()
    result["update"] = trainer.update(batch)
    after = gather_full_state_dict(trainer.policy.model, trainable_only=True)
    result["moved"] = sum(float((after[n] - before[n]).abs().sum()) for n in after)
    if acc.is_main_process:
        torch.save(before, out / "fsdp_before.pt")
        torch.save(after, out / "fsdp_after.pt")

    # 2. the engine receives the full, gathered weights
    trainer.policy.after_optimizer_step()  # weights changed: the next step syncs the engine
    trainer.policy.on_train_step(1)
    engine_state = trainer.policy.engine.model.state_dict()
    full = gather_full_state_dict(trainer.policy.model)
    result["engine"] = {
        "synced_version": trainer.policy.engine.weight_version,
        "names_equal": sorted(engine_state) == sorted(full),
        "shapes_equal": all(tuple(engine_state[n].shape) == tuple(v.shape) for n, v in full.items()),
        "max_abs_diff": max(float((engine_state[n] - v).abs().max()) for n, v in full.items()),
        "local_numel": sum(p.to_local().numel() for p in trainer.policy.model.parameters()),
        "full_numel": sum(p.numel() for p in trainer.policy.model.parameters()),
    }
    del trainer
    result["lora_sync"] = lora_sync(out)  # 3. LoRA weights for the engine

    # 4. sharded checkpoints resume exactly
    cfg = make_cfg(out, "resume", save_every=2, keep_checkpoints=5)
    straight = build(cfg, acc, shard=True)
    history = straight.train()
    straight_final = gather_full_state_dict(straight.policy.model, trainable_only=True)
    del straight
    if acc.is_main_process:
        step2 = rundir.checkpoint_dir(out / "resume", 2)
        assert (step2 / SHARDED_DIR / ".metadata").is_file(), sorted(p.name for p in step2.iterdir())
        assert not (step2 / rundir.TRAINABLE_FILE).exists() and not (step2 / rundir.OPTIMIZER_FILE).exists()
        shutil.rmtree(rundir.checkpoint_dir(out / "resume", 4))
        final = out / "resume" / "final"
        from transformers import AutoModelForCausalLM

        saved = AutoModelForCausalLM.from_pretrained(final).state_dict()
        result["final_dir_max_abs_diff"] = max(
            float((saved[n] - v).abs().max()) for n, v in straight_final.items()
        )
    acc.wait_for_everyone()
    resumed = build(make_cfg(out, "resume", save_every=2, keep_checkpoints=5), acc, shard=True, resume=True)
    assert resumed.step == 2, resumed.step
    resumed_history = resumed.train()
    resumed_final = gather_full_state_dict(resumed.policy.model, trainable_only=True)
    result["resume"] = {
        "straight": metrics(history[2:]),
        "resumed": metrics(resumed_history),
        "weights_max_abs_diff": max(
            float((resumed_final[n] - v).abs().max()) for n, v in straight_final.items()
        ),
        "moved": sum(float((straight_final[n] - before[n]).abs().sum()) for n in before),
    }
    (out / f"fsdp_rank{rank}.json").write_text(json.dumps(result))
    acc.wait_for_everyone()
    acc.end_training()


def lora_sync(out: Path) -> dict[str, Any]:
    """merged_state_dict / adapter_state_dict of a sharded peft model equal those of the same model unsharded."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from mmalign.engines import adapter_state_dict, merged_state_dict

    torch.manual_seed(1)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(out / "model"),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: a non-zero delta makes the merge visible
                p.normal_(0, 0.1)
    plain_merged, plain_adapter = merged_state_dict(model), adapter_state_dict(model)
    apply_fsdp2(model)
    merged, adapter = merged_state_dict(model), adapter_state_dict(model)

    # a sharded checkpoint of a LoRA model holds the trainable tensors and optimizer state only, and restores them
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(input_ids=torch.arange(1, 9).reshape(2, 4)).logits.square().mean().backward()
    opt.step()
    saved_at = out / "lora_ckpt"
    save_sharded(saved_at, model, opt)
    trained = gather_full_state_dict(model, trainable_only=True)
    moments = {k: v["exp_avg"].full_tensor().clone() for k, v in enumerate(opt.state.values())}
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(1.0)
        for state in opt.state.values():
            state["exp_avg"].to_local().zero_()
    load_sharded(saved_at, model, opt)
    restored = gather_full_state_dict(model, trainable_only=True)
    import torch.distributed.checkpoint as dcp

    keys = list(dcp.FileSystemReader(str(saved_at)).read_metadata().state_dict_metadata)
    return {
        "ckpt_restored": all(torch.equal(restored[n], v) for n, v in trained.items()),
        "ckpt_moments_restored": all(
            torch.equal(v["exp_avg"].full_tensor(), moments[k]) for k, v in enumerate(opt.state.values())
        ),
        "ckpt_frozen_keys": [k for k in keys if k.startswith("model.") and "lora_" not in k],
        "ckpt_lora_keys": sum(1 for k in keys if k.startswith("model.") and "lora_" in k),
        "merged_names_equal": sorted(merged) == sorted(plain_merged),
        "adapter_names_equal": sorted(adapter) == sorted(plain_adapter),
        "merged_max_abs_diff": max(float((merged[n] - v).abs().max()) for n, v in plain_merged.items()),
        "adapter_max_abs_diff": max(float((adapter[n] - v).abs().max()) for n, v in plain_adapter.items()),
        "delta_abs_max": max(
            float((plain_merged[n] - v).abs().max())
            for n, v in AutoModelForCausalLM.from_pretrained(out / "model").state_dict().items()
            if n in plain_merged
        ),
        "sharded": is_fsdp2(model),
    }


def run_reference(out: Path) -> None:
    acc = Accelerator(cpu=True)
    assert acc.num_processes == 1
    trainer = build(make_cfg(out, "reference"), acc, shard=False)
    start = trainer.policy.trainable_state_dict()
    before = torch.load(out / "fsdp_before.pt")
    assert all(torch.equal(start[n], before[n]) for n in before)  # same initial weights
    parts = [torch.load(out / f"batch_rank{r}.pt", weights_only=False) for r in (0, 1)]
    left_pad_prompts(parts)
    batch = Rollout.cat(parts)
    trainer.policy.model.train()
    m = trainer.update(batch)
    torch.save(trainer.policy.trainable_state_dict(), out / "reference_after.pt")
    (out / "reference.json").write_text(json.dumps({"update": m, "samples": len(batch)}))


if __name__ == "__main__":
    target, mode = Path(sys.argv[1]), sys.argv[2]
    run_fsdp(target) if mode == "fsdp" else run_reference(target)
    # Skip interpreter teardown: under load, gloo's threads occasionally abort the process there
    # ("terminate called without an active exception") after all work is done and written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
