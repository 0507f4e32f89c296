"""Every tiny config (``configs/*-tiny.yaml``) trained on 2 CPU processes through the real command.

For each config it runs ``torchrun --standalone --nproc_per_node 2 -m mmalign.app.cli train CONFIG`` (every step's
samples written: ``trainer.sample_every=1``), then reads the run directory: the distributed type and number of
processes the run recorded (``distributed.json``), the total reward (``reward/mean``) over the first and the last
10% of the steps (as ``benchmarks/learning.py``), the largest difference between the advantages the run wrote and
the run's estimator applied in one process to the gathered rewards and groups of every step
(``tests/scripts/two_process.py``; "n/a" for an estimator that takes per-step rewards, which the samples do not
hold), and the wall time of the launch. It prints a table and writes the numbers to
``benchmarks/results/two_process_runs.json`` (``--out``).

    python benchmarks/two_process_runs.py                        # every tiny config, its own number of steps
    python benchmarks/two_process_runs.py --steps 3               # a quick check of every config
    python benchmarks/two_process_runs.py --configs configs/text_reasoning-tiny.yaml --nproc 2

The tiny models must be built (a one-process ``mmalign train`` of the config builds them on first use).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "scripts"))
sys.path.insert(0, str(REPO / "benchmarks"))

import two_process as tp  # noqa: E402
from learning import summarise  # noqa: E402


def run_config(config: Path, nproc: int, steps: int | None, root: Path) -> dict[str, Any]:
    """Train `config` on `nproc` processes into ``root/<config name>`` and summarise the run."""
    out = root / config.stem
    args = tp.train_args(config, out, steps, None, "overwrite=true")
    cmd = tp.launch_cmd(nproc, "train", *args)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=tp.env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {
        "config": config.name,
        "run_dir": str(out),
        "wall_s": wall,
        "returncode": proc.returncode,
    }
    if proc.returncode != 0:
        row["error"] = proc.stderr[-3000:]
        return row
    try:
        row.update(tp.distributed(out))
    except FileNotFoundError:
        row.update({"distributed_type": "NO", "num_processes": 1})
    learned = summarise(out)
    row.update({k: learned[k] for k in ("steps", "reward_first", "reward_last", "step_s")})
    checked = tp.check_advantages(out)
    row["adv_max_abs_diff"] = checked["max_abs_diff"]
    row["adv_samples_checked"] = checked["samples"]
    return row


def _fmt(x: Any, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of `rows` (failed runs say so)."""
    lines = [
        "| config | distributed type | processes | steps | reward first 10% -> last 10% | adv. max abs diff | wall (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["returncode"] != 0:
            lines.append(f"| {r['config']} | failed (exit {r['returncode']}) | | | | | {r['wall_s']:.0f} |")
            continue
        lines.append(
            f"| {r['config']} | {r['distributed_type']} | {r['num_processes']} | {r['steps']} | "
            f"{_fmt(r['reward_first'], '.3f')} -> {_fmt(r['reward_last'], '.3f')} | "
            f"{_fmt(r['adv_max_abs_diff'], '.1e')} | {r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", type=Path, help="configs to run (default: configs/*-tiny.yaml)")
    p.add_argument("--steps", type=int, default=None, help="trainer.steps (default: each config's own)")
    p.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    p.add_argument("--runs", type=Path, default=REPO / "runs" / "two_process", help="where the runs go")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "two_process_runs.json")
    args = p.parse_args(argv)
    if args.nproc < 1 or (args.steps is not None and args.steps < 1):
        p.error("--nproc and --steps must be >= 1")
    configs = args.configs or sorted((REPO / "configs").glob("*-tiny.yaml"))
    missing = [str(c) for c in configs if not c.is_file()]
    if missing:
        p.error(f"no such config: {', '.join(missing)}")
    rows = []
    for config in configs:
        print(f"{config.name}: training on {args.nproc} processes ...", flush=True)
        rows.append(run_config(config, args.nproc, args.steps, args.runs))
        if rows[-1]["returncode"] != 0:
            print(f"{config.name}: failed\n{rows[-1]['error']}", file=sys.stderr, flush=True)
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"nproc": args.nproc, "steps": args.steps, "launcher": "torchrun --standalone (gloo on CPU)"}
    args.out.write_text(json.dumps({"settings": meta, "runs": rows}, indent=2) + "\n")
    print(f"written: {args.out}")
    return 0 if all(r["returncode"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
