"""Learning report: run every tiny config (``configs/*-tiny.yaml``) and tabulate reward before and after.

For each config it runs ``mmalign train CONFIG`` (building the tiny model first if it is missing; that time is
reported apart), then reads the run's ``metrics.jsonl``: the total reward (``reward/mean``) and every reward
component, averaged over the first and the last 10% of the steps, and the training wall time. With
``--from-runs`` nothing is trained: the runs already in each config's ``output_dir`` are read (their wall time
is then taken from the metrics' ``time/step_s``). It writes a Markdown table (``--out``, default
``benchmarks/results/learning.md``) and the same numbers as JSON beside it.

    python benchmarks/learning.py                                  # every tiny config, from scratch (long)
    python benchmarks/learning.py --from-runs                      # tabulate the runs already in runs/
    python benchmarks/learning.py --configs configs/medloc-tiny.yaml configs/geovis-tiny.yaml

"Before" and "after" are training-time rewards (the policy's own samples while it trains); ``mmalign eval``
gives the held-out before/after per pipeline and is not repeated here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


def summarise(run: Path) -> dict[str, Any]:
    """First-10% / last-10% means of reward/mean and of each reward component of `run`'s metrics.jsonl."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics (train the config first, or drop --from-runs)")
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "step" in r and "reward/mean" in r]
    if not rows:
        raise ValueError(f"{path}: no training step with reward/mean")
    k = max(1, len(rows) // 10)

    def mean(values: list[float]) -> float | None:
        values = [v for v in values if v is not None and v == v]
        return sum(values) / len(values) if values else None

    names = sorted(
        {
            key.split("/")[1]
            for r in rows
            for key in r
            if key.startswith("reward/") and key.endswith("/mean") and key.count("/") == 2
        }
    )
    out: dict[str, Any] = {
        "steps": len(rows),
        "reward_first": mean([r["reward/mean"] for r in rows[:k]]),
        "reward_last": mean([r["reward/mean"] for r in rows[-k:]]),
        "step_s": mean([r.get("time/step_s") for r in rows]),
        "components": {},
    }
    for name in names:
        key = f"reward/{name}/mean"
        out["components"][name] = {
            "first": mean([r.get(key) for r in rows[:k]]),
            "last": mean([r.get(key) for r in rows[-k:]]),
        }
    return out


def output_dir(config: Path) -> Path:
    data = yaml.safe_load(config.read_text())
    return REPO / str(data["output_dir"])


def run_config(config: Path, overrides: list[str]) -> dict[str, float]:
    """Train `config` (its tiny model is built first if missing); wall times of the build and of training."""
    data = yaml.safe_load(config.read_text())
    times: dict[str, float] = {"build_s": 0.0}
    model = data.get("model", {})
    if model.get("tiny_builder") and not (REPO / str(model["name_or_path"])).exists():
        t0 = time.perf_counter()
        code = "import sys; from mmalign.tiny import ensure_model; ensure_model(sys.argv[1], sys.argv[2])"
        subprocess.run(
            [sys.executable, "-c", code, model["name_or_path"], model["tiny_builder"]], cwd=REPO, check=True
        )
        times["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "mmalign.app.cli", "train", str(config), "overwrite=true", *overrides]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)
    times["train_s"] = time.perf_counter() - t0
    return times


def fmt(x: float | None, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| config | steps | reward, first 10% | reward, last 10% | change | components (first → last) | training time |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| `{name}` | — | — | — | — | {r['error']} | — |")
            continue
        comps = "; ".join(f"{c} {fmt(v['first'])} → {fmt(v['last'])}" for c, v in r["components"].items())
        change = (
            None
            if r["reward_first"] is None or r["reward_last"] is None
            else r["reward_last"] - r["reward_first"]
        )
        train_s = r.get("train_s") or (r["step_s"] * r["steps"] if r.get("step_s") else None)
        wall = "—" if train_s is None else f"{train_s / 60:.1f} min"
        lines.append(
            f"| `{name}` | {r['steps']} | {fmt(r['reward_first'])} | {fmt(r['reward_last'])} | "
            f"{'—' if change is None else f'{change:+.3f}'} | {comps} | {wall} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="*", help="tiny configs to run (default: every configs/*-tiny.yaml)")
    ap.add_argument("--from-runs", action="store_true", help="read existing runs instead of training")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "learning.md"))
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. trainer.steps=20")
    args = ap.parse_args(argv)
    configs = (
        [Path(c) for c in args.configs] if args.configs else sorted((REPO / "configs").glob("*-tiny.yaml"))
    )
    results: dict[str, dict[str, Any]] = {}
    for config in configs:
        name = config.name.removesuffix(".yaml")
        try:
            times = {} if args.from_runs else run_config(config, args.overrides)
            results[name] = {**summarise(output_dir(config)), **times}
        except (FileNotFoundError, ValueError, subprocess.CalledProcessError) as e:
            results[name] = {"error": str(e).splitlines()[0]}
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "components"}), flush=True)
    text = table(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    print(text)
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
