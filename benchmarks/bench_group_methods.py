"""Group-relative methods side by side on the tiny text task: GRPO, SPO, the unlikeliness reward, D³S, hints.

Every variant trains ``--config`` (default ``configs/text_reasoning-tiny.yaml``; also
``configs/vlm_reasoning-tiny.yaml``) from the same seeds with the same number of samples per step (the
config's prompts x group size; SPO: that many prompts x 1 sample, its single-stream setting) for ``--steps``
steps (default: the config's). The JSON holds the training reward (``reward/mean``) averaged over the first
and the last 10% of the steps and over all steps, the answer accuracy, and the seconds per step (CPU;
``OMP_NUM_THREADS=1`` recommended), per seed and averaged over the seeds.

- ``grpo``: the config as it is (``grpo`` + ``ppo_clip``).
- ``spo``: ``estimator: spo`` (its KL-adaptive decay, ``rho_mode: kl``, the default), ``data.sampler: spo``,
  group size 1.
- ``unlikeliness``: ``grpo`` with ``reward_transforms: [{name: unlikeliness, column: answer_accuracy}]``.
- ``d3s``: ``loss: d3s`` (token level: the trainer hands the loss the entropy and the training progress).
- ``hints``: ``grpo`` with ``algorithm.group_refill: {hints: true}`` (hints from prefixes of the reference
  answer). Its row reports the reward of the round BEFORE the refill (``refill/reward_before``: what the
  policy does without help), plus ``hints/groups`` and ``hints/success`` per step.

    OMP_NUM_THREADS=1 python benchmarks/bench_group_methods.py --seeds 0 1 2          # all variants, text task
    OMP_NUM_THREADS=1 python benchmarks/bench_group_methods.py --config configs/vlm_reasoning-tiny.yaml --seeds 0 1 2
    OMP_NUM_THREADS=1 python benchmarks/bench_group_methods.py --variants grpo d3s --steps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS: dict[str, list[str]] = {
    "grpo": [],
    "spo": [
        "algorithm.estimator=spo",
        "data.sampler=spo",
        "rollout.group_size=1",  # and prompts_per_step = the config's prompts x group size (run_variant)
    ],
    "unlikeliness": ["algorithm.reward_transforms=[{name: unlikeliness, column: answer_accuracy}]"],
    "d3s": ["algorithm.loss=d3s"],
    "hints": ['algorithm.group_refill={hints: true, hint_template: "Hint: {hint}\\n{prompt}"}'],
}


def run_variant(name: str, steps: int, config: Path, out_root: Path, seed: int) -> dict[str, Any]:
    from mmalign.app.cli import load_components
    from mmalign.app.run import build_trainer

    rollout = yaml.safe_load(config.read_text())["rollout"]
    budget = int(rollout["prompts_per_step"]) * int(rollout["group_size"])
    extra = [f"rollout.prompts_per_step={budget}"] if name == "spo" else []
    overrides = [
        *VARIANTS[name],
        *extra,
        f"output_dir={out_root / f'{name}-seed{seed}'}",
        f"seed={seed}",
        "overwrite=true",  # the benchmark's own run folders, replaced on a rerun
        f"trainer.steps={steps}",
        f"trainer.save_every={steps}",
        f"trainer.sample_every={steps}",
    ]
    cfg, components = load_components(Namespace(config=str(config), overrides=overrides), resume=False)
    trainer = build_trainer(cfg, components)
    t0 = time.perf_counter()
    history = trainer.train()
    wall = time.perf_counter() - t0
    rows = [h for h in history if "reward/mean" in h]
    rewards = [float(h["reward/mean"]) for h in rows]
    if name == "hints":
        rewards = [float(h["refill/reward_before"]) for h in rows]
    k = max(1, len(rewards) // 10)
    acc = [float(h.get("reward/answer_accuracy/mean", float("nan"))) for h in rows]
    out = {
        "steps": len(rows),
        "samples_per_step": cfg.rollout.prompts_per_step * cfg.rollout.group_size,
        "reward_first10": statistics.fmean(rewards[:k]),
        "reward_last10": statistics.fmean(rewards[-k:]),
        "reward_mean_all_steps": statistics.fmean(rewards),
        "accuracy_first10": statistics.fmean(acc[:k]),
        "accuracy_last10": statistics.fmean(acc[-k:]),
        "step_s": wall / max(1, len(rows)),
        "overrides": VARIANTS[name] + extra,
    }
    if name == "hints":
        out["hints_groups_mean"] = statistics.fmean(float(h["hints/groups"]) for h in rows)
        out["hints_success_mean"] = statistics.fmean(float(h["hints/success"]) for h in rows)
        out["note"] = (
            "reward_* = the unhinted samples' reward; accuracy_* = the trained batch's (hinted groups included)"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "text_reasoning-tiny.yaml"))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument(
        "--steps", type=int, default=None, help="training steps (default: the config's trainer.steps)"
    )
    ap.add_argument("--out", default=None, help="default benchmarks/results/group_methods_<config stem>.json")
    ap.add_argument("--runs", default=str(REPO / "runs" / "bench_group_methods"))
    args = ap.parse_args()
    config = Path(args.config)
    stem = config.stem.replace("-", "_")
    steps = args.steps or int(yaml.safe_load(config.read_text())["trainer"]["steps"])
    out_path = Path(args.out or REPO / "benchmarks" / "results" / f"group_methods_{stem}.json")
    results = json.loads(out_path.read_text()) if out_path.is_file() else {}
    results["config"] = str(config.resolve().relative_to(REPO))
    results["steps"] = steps
    results["seeds"] = args.seeds
    results.setdefault("variants", {})
    for name in args.variants:
        per_seed = {}
        for seed in args.seeds:
            r = run_variant(name, steps, config, Path(args.runs) / stem, seed)
            per_seed[str(seed)] = r
            print(
                f"{name:13s} seed {seed}  reward {r['reward_first10']:.3f} -> {r['reward_last10']:.3f}  "
                f"acc {r['accuracy_first10']:.3f} -> {r['accuracy_last10']:.3f}  {r['step_s']:.2f} s/step",
                flush=True,
            )
        keys = (
            "reward_first10",
            "reward_last10",
            "reward_mean_all_steps",
            "accuracy_first10",
            "accuracy_last10",
            "step_s",
        )
        summary = {k: statistics.fmean(r[k] for r in per_seed.values()) for k in keys}
        results["variants"][name] = {"mean_over_seeds": summary, "seeds": per_seed}
        out_path.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
