"""Group-relative methods side by side on the tiny text task: GRPO, SPO, the unlikeliness reward, D³S, hints.

Every variant trains ``--config`` (default ``configs/text_reasoning-tiny.yaml``; also
``configs/vlm_reasoning-tiny.yaml``) from the same seeds with the same number of samples per step (the
config's prompts x group size; SPO: that many prompts x 1 sample, its single-stream setting) for ``--steps``
steps (default: the config's). The JSON holds the training reward (``reward/mean``) averaged over the first
and the last 10% of the steps and over all steps, the answer accuracy, and the seconds per step (CPU;
``OMP_NUM_THREADS=1`` recommended), per seed and averaged over the seeds.

- ``grpo``: the config as it is (``grpo`` + ``ppo_clip``).
- ``spo``: ``estimator: spo`` (``rho_mode: constant``: the trainer does not yet supply the KL-adaptive
  ``policy_shift``), ``data.sampler: spo``, group size 1.
- ``unlikeliness``: ``grpo`` with ``reward_transforms: [{name: unlikeliness, column: answer_accuracy}]``.
- ``d3s``: ``loss: d3s`` (token level). The trainer does not pass ``entropy`` / ``step`` to the loss yet, so
  this script wraps the policy's ``action_stats`` to hand the loss the entropy (benchmark only; the trainer
  change is in the integrator's hunk).
- ``hints``: ``grpo`` with `mmalign.group_refill.GroupRefill` (hints from prefixes of the reference answer)
  wrapped around the policy's rollout (benchmark only). Its row reports the reward of the UNHINTED samples
  (what the policy does without help), plus ``hints/groups`` and ``hints/success`` per step.

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
        "algorithm.estimator_kwargs={rho_mode: constant}",
        "data.sampler=spo",
        "rollout.group_size=1",  # and prompts_per_step = the config's prompts x group size (run_variant)
    ],
    "unlikeliness": ["algorithm.reward_transforms=[{name: unlikeliness, column: answer_accuracy}]"],
    "d3s": ["algorithm.loss=d3s"],
    "hints": [],
}


def wire_d3s(trainer: Any) -> None:
    """Hand the d3s loss the entropy of the last action_stats call, and the step (what the trainer hunk does)."""
    from mmalign import losses

    box: dict[str, Any] = {}
    stats_fn = trainer.policy.action_stats

    def action_stats(rollout: Any, **kw: Any) -> Any:
        stats = stats_fn(rollout, **kw)
        box["entropy"] = stats.entropy
        return stats

    d3s = losses.get("d3s")

    def loss(logp: Any, logp_old: Any, adv: Any, mask: Any, **kw: Any) -> Any:
        return d3s(
            logp,
            logp_old,
            adv,
            mask,
            entropy=box["entropy"],
            step=trainer.step,
            total_steps=trainer.cfg.trainer.steps,
            **kw,
        )

    trainer.policy.action_stats = action_stats
    trainer.loss_fn = loss


def wire_hints(trainer: Any, log: list[dict[str, float]]) -> None:
    """Refill all-fail groups with hints inside the policy's rollout (what the trainer hunk does in make_rollout)."""
    from mmalign.group_refill import GroupRefill

    refill = GroupRefill(
        hints=True,
        hint_template="Hint: {hint}\n{prompt}",
        success_threshold=trainer.cfg.data.success_threshold,
        weights=trainer.reward_set.weights.tolist(),
    )
    index = {id(r): i for i, r in enumerate(trainer.rows)}
    rollout_fn = trainer.policy.rollout
    needs = trainer.reward_set.needs

    def scored(rows: list[dict[str, Any]], size: int, compute_logp: bool) -> tuple[Any, Any]:
        ro = rollout_fn(rows, size, compute_logp=compute_logp)
        trainer.policy.materialize(ro, needs)
        return ro, trainer.reward_set(ro)

    def rollout(rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool) -> Any:
        ro, rewards = scored(rows, group_size, compute_logp)
        pids = [index[id(row)] for row in rows for _ in range(group_size)]
        out, _, metrics = refill.refill(
            ro, rewards, ro.group, pids, trainer.rows, lambda r, s: scored(r, s, compute_logp)
        )
        from mmalign.advantages import combine_rewards

        metrics["reward_unhinted"] = float(combine_rewards(rewards, refill.weights).nanmean())
        log.append(metrics)
        return out

    trainer.policy.rollout = rollout


def run_variant(name: str, steps: int, config: Path, out_root: Path, seed: int) -> dict[str, Any]:
    from mmalign.app.cli import _load
    from mmalign.app.run import build_trainer

    rollout = yaml.safe_load(config.read_text())["rollout"]
    budget = int(rollout["prompts_per_step"]) * int(rollout["group_size"])
    extra = [f"rollout.prompts_per_step={budget}"] if name == "spo" else []
    overrides = [
        *VARIANTS[name],
        *extra,
        f"output_dir={out_root / f'{name}-seed{seed}'}",
        f"seed={seed}",
        f"trainer.steps={steps}",
        f"trainer.save_every={steps}",
        f"trainer.sample_every={steps}",
    ]
    cfg, components = _load(Namespace(config=str(config), overrides=overrides), resume=False)
    trainer = build_trainer(cfg, components)
    hint_log: list[dict[str, float]] = []
    if name == "d3s":
        wire_d3s(trainer)
    if name == "hints":
        wire_hints(trainer, hint_log)
    t0 = time.perf_counter()
    history = trainer.train()
    wall = time.perf_counter() - t0
    rows = [h for h in history if "reward/mean" in h]
    rewards = [float(h["reward/mean"]) for h in rows]
    if name == "hints":
        rewards = [m["reward_unhinted"] for m in hint_log][: len(rows)]
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
    if hint_log:
        out["hints_groups_mean"] = statistics.fmean(m["hints/groups"] for m in hint_log)
        out["hints_success_mean"] = statistics.fmean(m["hints/success"] for m in hint_log)
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
