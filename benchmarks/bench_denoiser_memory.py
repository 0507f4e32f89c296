"""Memory of a diffusion training step with and without denoiser activation checkpointing, measured on CPU,
against `mmalign plan`'s prediction.

The denoiser is SD3.5-medium's transformer architecture (widths from `mmalign/app/architectures.json`: 24 heads
of 64, caption projection 1536, RMS qk-norm, a dual-attention first block) with 2 of its 24 joint blocks, in the
tiny three-encoder SD3 folder (`mmalign.tiny.sd3.build_tiny_sd3`: its CLIPs, T5 and VAE; the transformer's text
and pooled widths follow them), saved with ``save_pretrained`` and loaded through the text_to_image pipeline as
any model folder. One `GroupTrainer.update` of a recorded rollout is measured with torch's profiler
(``profile_memory``: every allocation and free of the CPU allocator; the peak of their running sum, plus the
live weights and AdamW state, is what ``torch.cuda.max_memory_allocated`` reports on a GPU), with
``model.gradient_checkpointing`` off and on, and compared with `mmalign.app.plan.plan` on the ``cpu`` device.

    OMP_NUM_THREADS=1 python benchmarks/bench_denoiser_memory.py            # writes benchmarks/results/denoiser_memory_cpu.json
    OMP_NUM_THREADS=1 python benchmarks/bench_denoiser_memory.py --latent 48 --microbatch 4

`tests/app/test_plan.py` runs the same harness at a small size (prediction within 15 %).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
SD35M = "stabilityai/stable-diffusion-3.5-medium"
PROMPTS = ["a red square on the left", "two blue circles", "a green triangle at the top", "one yellow star"]


def build_folder(path: Path, *, latent: int, layers: int = 2) -> Path:
    """The tiny three-encoder SD3 folder at `path` with SD3.5-medium's transformer widths, `layers` joint blocks
    (the first with dual attention, as SD3.5's first 13) and `latent` x `latent` latents."""
    from diffusers import SD3Transformer2DModel

    from mmalign.app.plan_models import load_table
    from mmalign.tiny.sd3 import build_tiny_sd3

    if (path / "transformer" / "config.json").exists():
        return path
    build_tiny_sd3(path, text_encoders=3, sample_size=latent)
    tiny = json.loads((path / "transformer" / "config.json").read_text())
    real = dict(load_table()["models"][SD35M]["components"]["transformer"]["config"])
    real.update(
        num_layers=layers,
        dual_attention_layers=[0],
        sample_size=latent,
        pos_embed_max_size=max(latent, 96),
        in_channels=tiny["in_channels"],
        out_channels=tiny["out_channels"],
        joint_attention_dim=tiny["joint_attention_dim"],
        pooled_projection_dim=tiny["pooled_projection_dim"],
    )
    torch.manual_seed(0)
    SD3Transformer2DModel(**real).save_pretrained(path / "transformer")
    return path


def make_config(
    folder: Path, out: Path, *, ckpt: bool, lora: bool, micro: int, group: int, steps: int
) -> Any:
    """A text_to_image config of `folder` on CPU: one prompt x `group` samples, `steps` denoising steps (all
    trained, one backward per step), CFG 4.5 with the unconditional branch detached, ``micro`` samples per
    microbatch."""
    from mmalign.config import config_from_dict

    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return config_from_dict(
        {
            "pipeline": "text_to_image",
            "output_dir": str(out / "run"),
            "overwrite": True,
            "model": {
                "name_or_path": str(folder),
                "gradient_checkpointing": ckpt,
                "lora": {"enabled": lora, "r": 16, "alpha": 32},
            },
            "data": {"train": str(prompts)},
            "options": {"num_steps": steps, "guidance_scale": 4.5, "max_sequence_length": 16, "seed": 0},
            "rollout": {"group_size": group, "prompts_per_step": 1},
            "rewards": [{"name": "jpeg_compressibility"}],
            "trainer": {"steps": 1, "lr": 1e-4, "cpu": True, "progress_bar": False, "microbatch_size": micro},
        },
        "bench_denoiser_memory",
    )


def _held_bytes(policy: Any, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every parameter and buffer the policy holds (denoiser, VAE, text encoders) and of AdamW's state."""
    seen: dict[int, torch.Tensor] = {}
    modules = [v for v in vars(policy).values() if isinstance(v, torch.nn.Module)]
    comps = getattr(policy, "components", None)
    if comps is not None:
        modules += [v for v in vars(comps).values() if isinstance(v, torch.nn.Module)]
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            seen.setdefault(id(t), t)
    held = sum(t.numel() * t.element_size() for t in seen.values())
    held += sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    return held


def measured_step_peak(cfg: Any) -> int:
    """Bytes at the peak of the second `GroupTrainer.update` of one recorded rollout (AdamW's state exists from
    the first): the weights and optimizer state held, plus the peak of the profiler's running allocation sum."""
    import pipelines
    from mmalign.app.plan import profiled_alloc_peak
    from mmalign.policies.base import RunInfo
    from mmalign.training.trainer import GroupTrainer

    trainer = GroupTrainer(cfg, pipelines.get("text_to_image")(cfg))
    policy = trainer.policy
    # as the trainer does: applies model.gradient_checkpointing and rollout.batch_size
    policy.setup(RunInfo(cfg=cfg, accelerator=None))
    policy.model.train()
    torch.manual_seed(0)
    batch = policy.rollout([{"prompt": PROMPTS[0]}], cfg.rollout.group_size, compute_logp=True)
    batch.advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(0))
    batch.rewards = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(1))
    trainer.update(batch)
    gc.collect()
    base = _held_bytes(policy, trainer.optimizer)
    peak = profiled_alloc_peak(lambda: trainer.update(batch))
    return base + peak


def planned_step_peak(cfg: Any) -> int:
    from mmalign.app import plan as plan_mod

    return plan_mod.plan(cfg, plan_mod.Hardware(plan_mod.DEVICES["cpu"])).train.memory.total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latent", type=int, default=32, help="latent side (tokens: (latent / 2)^2)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--microbatch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_denoiser_memory"))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/denoiser_memory_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    folder = build_folder(
        args.work / f"sd35m-{args.layers}l-{args.latent}", latent=args.latent, layers=args.layers
    )
    rows = []
    for ckpt in (False, True):
        cfg = make_config(
            folder,
            args.work / f"run-{ckpt}",
            ckpt=ckpt,
            lora=not args.full,
            micro=args.microbatch,
            group=args.group,
            steps=args.steps,
        )
        t = time.perf_counter()
        measured = measured_step_peak(cfg)
        seconds = time.perf_counter() - t
        planned = planned_step_peak(cfg)
        rows.append(
            {
                "gradient_checkpointing": ckpt,
                "measured_MiB": round(measured / 2**20, 1),
                "planned_MiB": round(planned / 2**20, 1),
                "error": round(planned / measured - 1, 4),
                "seconds_two_updates": round(seconds, 1),
            }
        )
        print(rows[-1], flush=True)
    saved = rows[0]["measured_MiB"] - rows[1]["measured_MiB"]
    result = {
        "what": "peak CPU memory of one GroupTrainer.update (SD3.5-medium transformer widths, 2 joint blocks)",
        "latent": args.latent,
        "image_tokens": (args.latent // 2) ** 2,
        "layers": args.layers,
        "group": args.group,
        "microbatch": args.microbatch,
        "denoising_steps": args.steps,
        "lora": not args.full,
        "rows": rows,
        "saved_MiB": round(saved, 1),
        "saved_share": round(saved / rows[0]["measured_MiB"], 3),
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
