"""Helpers for running `mmalign` on N CPU processes through the real CLI, shared by
tests/e2e/test_every_config_two_processes.py and benchmarks/two_process_runs.py.

- `launch_cmd(nproc, command, *args)`: ``torchrun --standalone --nproc_per_node N -m mmalign.app.cli ...`` (the
  plain interpreter for N = 1).
- `failure(proc)`: a failed launch's ``mmalign: error`` lines and the end of its stderr (an assertion message).
- `kill_launch(proc)`: SIGKILL a launcher started with ``start_new_session=True`` AND its workers (torchrun starts
  each worker in a session of its own, so killing the launcher's process group alone leaves them running).
- `check_advantages(run_dir)`: recompute every written step's advantages in this one process with the run's
  estimator (`mmalign.algorithms.advantages.get`) on the gathered rewards and groups of ``samples/step_N.jsonl``, and return
  the largest absolute difference to the advantages the run wrote.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from mmalign.training.rundir import DISTRIBUTED_FILE  # what `mmalign train` records of its launch

REPO = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    """The environment of a launched run: offline, one thread per process."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def launch_cmd(nproc: int, command: str, *args: str) -> list[str]:
    """The command line of ``mmalign COMMAND ARGS`` on `nproc` processes (torchrun, gloo on CPU)."""
    if nproc == 1:
        return [sys.executable, "-m", "mmalign.app.cli", command, *args]
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        raise FileNotFoundError("torchrun is not on PATH (it comes with torch)")
    return [torchrun, "--standalone", f"--nproc_per_node={nproc}", "-m", "mmalign.app.cli", command, *args]


def train_args(
    config: str | Path, out: Path, steps: int | None, save_every: int | None, *extra: str
) -> list[str]:
    """``mmalign train`` arguments: every step's samples and metrics written, no progress bar. `config` is a
    config file, or the name of one in ``configs/``."""
    path = Path(config) if Path(config).is_file() else REPO / "configs" / str(config)
    args = [
        str(path.resolve()),
        f"output_dir={out}",
        "trainer.sample_every=1",
        "trainer.log_every=1",
    ]
    if steps is not None:
        args.append(f"trainer.steps={steps}")
    if save_every is not None:
        args.append(f"trainer.save_every={save_every}")
    return [*args, "trainer.progress_bar=false", *extra]


def failure(proc: subprocess.CompletedProcess, tail: int = 3000) -> str:
    """What a failed launch said, for an assertion message: every process's ``mmalign: error`` line (wherever it
    is in the output: the first failure is often far above the launcher's summary) and the end of stderr."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mmalign: error")]
    return "\n".join([*errors, "--- end of stderr:", proc.stderr[-tail:]])


def kill_launch(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher `proc` (started with ``start_new_session=True``) and every process below it."""
    import psutil

    try:
        below = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    for p in below:  # workers first: they are the ones that write into the run directory
        try:
            os.killpg(os.getpgid(p.pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    # the workers' new parent may not reap them: a zombie counts as gone
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in below):
        time.sleep(0.05)


def _alive(p: Any) -> bool:
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def metrics(run: Path, *, drop_time: bool = True) -> list[dict[str, Any]]:
    """The rows of ``run/metrics.jsonl`` (without ``time/*`` keys when `drop_time`)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    if drop_time:
        rows = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in rows]
    return rows


def distributed(run: Path) -> dict[str, Any]:
    """How the run was launched: ``{"distributed_type": ..., "num_processes": ...}`` (written by `mmalign train`)."""
    path = run / DISTRIBUTED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not written (a one-process run writes none)")
    return json.loads(path.read_text())


def _run_config(run: Path) -> dict[str, Any]:
    return yaml.safe_load((run / "config.yaml").read_text())


def _reward_weights(cfg: dict[str, Any]) -> tuple[list[str], list[float]]:
    """Column names and outcome weights of the run's rewards, as `rewards.RewardSet` has them (no reward is
    built, only resolved: a per-step reward's outcome weight is 0; its weight is already in ``step_rewards``)."""
    from rewards.base import resolve

    names, weights = [], []
    for spec in cfg["rewards"]:
        spec = {"name": spec} if isinstance(spec, str) else spec
        names.append(str(spec.get("alias") or spec["name"]))
        try:
            per_step = bool(getattr(resolve(str(spec["name"])), "per_step", False))
        except (
            KeyError,
            ImportError,
            AttributeError,
        ):  # a name this process cannot resolve: an outcome reward
            per_step = False
        weights.append(0.0 if per_step else float(spec.get("weight", 1.0)))
    return names, weights


def check_advantages(run: Path) -> dict[str, Any]:
    """Recompute the advantages of every ``samples/step_N.jsonl`` of `run` in one process and compare.

    For each step: the rewards (Float[B, K], None read as NaN) and group ids of ALL samples the processes wrote
    (gathered by the trainer into one file), the run's estimator with ``weights`` (the configured reward
    weights), ``algorithm.estimator_kwargs`` and ``algorithm.adv_clip``; an estimator that takes numbers of
    actions gets each sample's ``num_actions``, one that takes process rewards its ``step_rewards`` (by action
    position, None where no action), and the per-action advantages are compared by their mean over each
    sample's actions, as the samples hold them. Returns ``{"steps": n, "samples": m, "max_abs_diff": d}``.
    Raises ValueError for a file whose groups are not whole."""
    import torch

    from mmalign.algorithms import advantages

    cfg = _run_config(run)
    a = cfg["algorithm"]
    name = a["estimator"]
    columns, weights = _reward_weights(cfg)
    group_size = int(cfg["rollout"]["group_size"]) + advantages.extra_samples(name)
    fn = advantages.get(name)
    files = sorted((run / "samples").glob("step_*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{run / 'samples'}: no step_N.jsonl")
    worst, total = 0.0, 0
    for f in files:
        rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        if list(rows[0]["rewards"]) != columns:
            raise ValueError(f"{f}: reward columns {list(rows[0]['rewards'])}, the config has {columns}")
        rewards = torch.tensor(
            [[math.nan if r["rewards"][c] is None else float(r["rewards"][c]) for c in columns] for r in rows]
        )
        group = torch.tensor([int(r["group"]) for r in rows])
        sizes = torch.bincount(group)
        if bool(((sizes != 0) & (sizes != group_size)).any()):
            raise ValueError(
                f"{f}: groups of {sorted(set(sizes.tolist()) - {0})} samples, expected {group_size}"
            )
        opts = dict(a.get("estimator_kwargs") or {})
        opts.setdefault("weights", weights)
        if advantages.accepts_num_actions(name):
            opts["num_actions"] = torch.tensor([int(r["num_actions"]) for r in rows])
        step_mask = None
        if advantages.accepts_step_rewards(name):
            width = max(len(r["step_rewards"]) for r in rows)
            cells = [[*r["step_rewards"], *[None] * (width - len(r["step_rewards"]))] for r in rows]
            step_mask = torch.tensor([[v is not None for v in row] for row in cells])
            opts["step_rewards"] = torch.tensor(
                [[math.nan if v is None else float(v) for v in row] for row in cells]
            )
            opts["step_mask"] = step_mask
        expected = advantages.clip_advantages(fn(rewards, group, **opts), a.get("adv_clip"))
        if expected.dim() == 2:  # per action: the sample's mean over its actions, as the trainer writes it
            m = step_mask.to(expected.dtype)
            expected = (expected * m).sum(1) / m.sum(1).clamp(min=1)
        written = torch.tensor([math.nan if r["advantage"] is None else float(r["advantage"]) for r in rows])
        if bool(torch.isnan(written).any()):
            raise ValueError(f"{f}: a sample without an advantage")
        worst = max(worst, float((expected.float() - written).abs().max()))
        total += len(rows)
    return {"steps": len(files), "samples": total, "max_abs_diff": worst}
