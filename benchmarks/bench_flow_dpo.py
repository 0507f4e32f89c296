"""Flow-DPO vs Flow-GRPO vs DiffusionNFT on the tiny text-to-image task, each for the same wall-clock budget.

The harness of benchmarks/bench_flow_algorithms.py (same model, seed, prompts and reward; training step by step
through `build_trainer` until the budget is spent) with configs/text_to_image-dpo-tiny.yaml added. Reported per
algorithm: steps run, seconds per step, and the mean training reward of the first and of the last 10% of its
steps. Run single-threaded for comparable times:

    OMP_NUM_THREADS=1 python benchmarks/bench_flow_dpo.py --budget-s 240

Writes benchmarks/results/flow_dpo.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import bench_flow_algorithms as flow  # noqa: E402

ALGORITHMS: dict[str, list[str]] = {
    "flow_grpo": flow.ALGORITHMS["flow_grpo"],
    "diffusion_nft": flow.ALGORITHMS["diffusion_nft"],
    "flow_dpo": ["--config", "configs/text_to_image-dpo-tiny.yaml"],
}
"""Overrides of configs/text_to_image-tiny.yaml per algorithm (``--config`` swaps the base file)."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=240.0, help="training seconds per algorithm")
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "flow_dpo.json")
    args = p.parse_args()
    flow.ALGORITHMS.update(ALGORITHMS)  # `flow.run` looks the overrides up there
    results: dict[str, Any] = {
        "budget_s": args.budget_s,
        "threads": torch.get_num_threads(),
        "machine": platform.platform(),
        "algorithms": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.algorithms:
            torch.manual_seed(0)  # the LoRA adapter's random A is drawn before the trainer seeds
            results["algorithms"][name] = flow.run(name, args.budget_s, Path(tmp))
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
