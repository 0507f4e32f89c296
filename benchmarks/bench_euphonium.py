"""Euphonium (process-reward-guided SDE + dual-reward GRPO + drift distillation) against plain Flow-GRPO on the
same tiny task, model, prompts, seed and number of steps: steps to reach an outcome-reward threshold.

The two runs:

- **Flow-GRPO**: ``configs/video_geometry-tiny.yaml`` (VGGRPO's tiny run: the flow SDE, the three latent
  geometry rewards, ``estimator: grpo``);
- **Euphonium**: ``configs/euphonium-tiny.yaml`` (the same model, prompts, rewards, seed, steps and group sizes;
  guided steps, ``grpo_process`` whose outcome part is ``grpo``, the distillation term).

The outcome reward compared is the sum of the three geometry rewards (``camera_smoothness``,
``reprojection_consistency``, ``motion_guard``; the ``reward/mean`` of Flow-GRPO, and the same three columns of
the Euphonium run, whose ``reward/mean`` excludes the per-step process reward anyway). It is smoothed with a
moving average of ``--window`` steps; the threshold is ``--threshold`` (absolute) or the first smoothed value
plus ``--rise`` (default). Note that Euphonium's training samples are *guided*, so its training reward
includes the guidance's direct effect (it starts above the threshold); ``mmalign eval`` of both runs (the
plain, unguided samples of the base model and of the final checkpoint, same prompts and seeds) is the fair
after-training comparison and is reported with ``--eval`` (an ``eval.json`` already in a run is reused).

    python benchmarks/bench_euphonium.py                          # trains both (about 2 x 10 min on 2 cores)
    python benchmarks/bench_euphonium.py --runs runs/video_geometry-tiny runs/euphonium-tiny   # existing runs

Writes ``benchmarks/results/euphonium_vs_flow_grpo_cpu.json`` (``--json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GEOMETRY = ("camera_smoothness", "reprojection_consistency", "motion_guard")
CONFIGS = {"flow_grpo": "configs/video_geometry-tiny.yaml", "euphonium": "configs/euphonium-tiny.yaml"}


def outcome_curve(run: Path) -> list[tuple[int, float]]:
    """(step, sum of the three geometry rewards' means) for every training step of `run`'s metrics.jsonl."""
    curve = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "step" in m and all(f"reward/{k}/mean" in m for k in GEOMETRY):
            curve.append((int(m["step"]), sum(float(m[f"reward/{k}/mean"]) for k in GEOMETRY)))
    if not curve:
        raise SystemExit(f"{run / 'metrics.jsonl'}: no step with the rewards {', '.join(GEOMETRY)}")
    return curve


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first window - 1 values average what exists so far)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def steps_to(curve: list[tuple[int, float]], threshold: float, window: int) -> int | None:
    """The first step whose smoothed outcome reward reaches `threshold` (None: never)."""
    smoothed = smooth([v for _, v in curve], window)
    for (step, _), v in zip(curve, smoothed, strict=True):
        if v >= threshold:
            return step
    return None


def train(name: str, out: Path, steps: int | None) -> Path:
    run = out / name
    cmd = [
        sys.executable,
        "-m",
        "mmalign.app.cli",
        "train",
        CONFIGS[name],
        f"output_dir={run}",
        "overwrite=true",
    ]
    if steps is not None:
        cmd.append(f"trainer.steps={steps}")
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)
    return run


def evaluate(run: Path, config: str) -> dict[str, Any]:
    """`mmalign eval` of `run` (unguided samples of the base model and the final checkpoint); an ``eval.json``
    already in the run is read instead of evaluating again."""
    if (run / "eval.json").is_file():
        return json.loads((run / "eval.json").read_text())
    cmd = [sys.executable, "-m", "mmalign.app.cli", "eval", config, f"output_dir={run}"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)
    return json.loads((run / "eval.json").read_text())


def _eval_lines(report: dict[str, Any]) -> list[str]:
    """``eval <reward>: base -> trained`` over all held-out samples of an eval.json (``base`` / ``trained``
    -> subset ``all`` -> reward)."""
    base, trained = report.get("base", {}).get("all", {}), report.get("trained", {}).get("all", {})
    return [f"eval {k}: {base[k]:.4f} -> {trained[k]:.4f}" for k in GEOMETRY if k in base and k in trained]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--runs", nargs=2, metavar=("FLOW_GRPO_RUN", "EUPHONIUM_RUN"), help="use existing run dirs"
    )
    ap.add_argument("--out", default="runs/bench_euphonium", help="where new runs go")
    ap.add_argument("--steps", type=int, default=None, help="override trainer.steps of both configs")
    ap.add_argument("--window", type=int, default=5, help="moving-average window (steps)")
    ap.add_argument("--rise", type=float, default=0.05, help="threshold = first smoothed value + rise")
    ap.add_argument("--threshold", type=float, default=None, help="absolute threshold (overrides --rise)")
    ap.add_argument("--eval", action="store_true", help="also run mmalign eval on both runs")
    ap.add_argument(
        "--json", default=str(REPO / "benchmarks" / "results" / "euphonium_vs_flow_grpo_cpu.json")
    )
    args = ap.parse_args(argv)

    if args.runs:
        runs = {"flow_grpo": Path(args.runs[0]), "euphonium": Path(args.runs[1])}
    else:
        runs = {name: train(name, Path(args.out), args.steps) for name in CONFIGS}
    curves = {name: outcome_curve(run) for name, run in runs.items()}
    start = smooth([v for _, v in curves["flow_grpo"]], args.window)[0]
    threshold = args.threshold if args.threshold is not None else start + args.rise
    result: dict[str, Any] = {
        "what": "steps until the smoothed sum of the geometry rewards reaches the threshold",
        "threshold": threshold,
        "window": args.window,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "runs": {},
    }
    print(f"\nthreshold {threshold:.4f} (smoothed over {args.window} steps)")
    print(f"{'run':<10} {'steps':>5} {'first 10%':>10} {'last 10%':>10} {'steps to threshold':>19}")
    for name, curve in curves.items():
        values = [v for _, v in curve]
        k = max(1, len(values) // 10)
        first, last = sum(values[:k]) / k, sum(values[-k:]) / k
        reached = steps_to(curve, threshold, args.window)
        result["runs"][name] = {
            "run": str(runs[name]),
            "config": CONFIGS[name],
            "steps": len(values),
            "outcome_first_10pct": first,
            "outcome_last_10pct": last,
            "steps_to_threshold": reached,
            "curve": curve,
        }
        print(f"{name:<10} {len(values):>5} {first:>10.4f} {last:>10.4f} {str(reached):>19}")
        if args.eval:
            report = evaluate(runs[name], CONFIGS[name])
            result["runs"][name]["eval"] = report
            for line in _eval_lines(report):
                print(f"{'':<10} {line}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
