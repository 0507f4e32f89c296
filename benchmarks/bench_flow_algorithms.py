"""Flow-GRPO vs DiffusionNFT vs AWM on the tiny text-to-image task, each for the same wall-clock budget.

Every algorithm starts from the shipped tiny model (assets/models/text_to_image-tiny), with the same seed,
prompts and reward (configs/text_to_image-tiny.yaml), and trains step by step through `build_trainer`
until its budget is spent. Reported per algorithm: steps run, seconds per step, and the mean reward of the
first and of the last 10% of its steps. Run single-threaded for comparable times:

    OMP_NUM_THREADS=1 python benchmarks/bench_flow_algorithms.py --budget-s 360

Writes benchmarks/results/flow_algorithms.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import pipelines
from mmalign.app.run import build_trainer
from mmalign.config import load_config

REPO = Path(__file__).resolve().parents[1]
ALGORITHMS: dict[str, list[str]] = {
    "flow_grpo": [],  # the quickstart config as it is
    "diffusion_nft": ["--config", "configs/text_to_image-nft-tiny.yaml"],
    "awm": [
        "algorithm.objective=awm",
        "algorithm.objective_kwargs={weighting: ghuber, ghuber_power: 0.25}",
        "algorithm.timesteps={strategy: discrete, timestep_range: 0.9}",
        "algorithm.solver=euler",
        "options.noise_level=0.0",
        "options.seed=0",
    ],
}
"""Overrides of configs/text_to_image-tiny.yaml per algorithm (``--config`` swaps the base file)."""


def run(name: str, budget_s: float, out_dir: Path) -> dict[str, Any]:
    """Train `name` until `budget_s` seconds of training have passed; its steps' rewards and times."""
    extra = list(ALGORITHMS[name])
    base = REPO / "configs" / "text_to_image-tiny.yaml"
    if extra[:1] == ["--config"]:
        base, extra = REPO / extra[1], extra[2:]
    cfg = load_config(
        base,
        [
            f"model.name_or_path={REPO / 'assets' / 'models' / 'text_to_image-tiny'}",
            f"data.train={REPO / 'assets' / 'text_to_image' / 'train.jsonl'}",
            f"data.eval={REPO / 'assets' / 'text_to_image' / 'eval.jsonl'}",
            f"output_dir={out_dir / name}",
            "trainer.steps=100000",
            "trainer.progress_bar=false",
            *extra,
        ],
    )
    trainer = build_trainer(cfg, pipelines.get(cfg.pipeline)(cfg))
    rewards, times = [], []
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s:
        m = trainer.train_step()
        trainer.emit("on_step_end", trainer.step, m)  # what train() does after a step (the old-policy EMA)
        rewards.append(float(m["reward/mean"]))
        times.append(float(m["time/step_s"]))
        print(f"{name} step {trainer.step}: reward {rewards[-1]:.3f} ({times[-1]:.1f} s)", flush=True)
    k = max(1, math.ceil(len(rewards) / 10))
    return {
        "steps": len(rewards),
        "s_per_step": sum(times) / len(times),
        "reward_first_10pct": sum(rewards[:k]) / k,
        "reward_last_10pct": sum(rewards[-k:]) / k,
        "rewards": rewards,
        "overrides": ALGORITHMS[name],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=360.0, help="training seconds per algorithm")
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "flow_algorithms.json")
    args = p.parse_args()
    results: dict[str, Any] = {
        "budget_s": args.budget_s,
        "threads": torch.get_num_threads(),
        "machine": platform.platform(),
        "algorithms": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.algorithms:
            results["algorithms"][name] = run(name, args.budget_s, Path(tmp))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))
    print(f"{'algorithm':<14} {'steps':>5} {'s/step':>7} {'reward first 10%':>17} {'last 10%':>9}")
    for name, r in results["algorithms"].items():
        print(
            f"{name:<14} {r['steps']:>5} {r['s_per_step']:>7.1f} {r['reward_first_10pct']:>17.3f} "
            f"{r['reward_last_10pct']:>9.3f}"
        )


if __name__ == "__main__":
    main()
