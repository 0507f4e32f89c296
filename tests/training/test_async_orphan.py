"""mmalign/training/asynchronous.py: a forked rollout worker (``trainer.async.backend: process``) ends within seconds
when its trainer is killed (SIGKILL or SIGTERM), idle or in the middle of a job, through the kernel's
parent-death signal on Linux and through its own polling of ``os.getppid()`` without it. Was: it lived on
for good, reparented to init."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "async_orphan_parent.py"
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the process backend forks")


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie left for init to reap counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.mark.parametrize(
    ("sig", "options"),
    [
        (signal.SIGKILL, []),
        (signal.SIGTERM, ["--busy"]),
        (signal.SIGKILL, ["--busy", "--no-pdeathsig"]),  # the portable fallback alone
    ],
    ids=["sigkill-idle", "sigterm-busy", "sigkill-busy-polling-only"],
)
def test_the_worker_exits_when_its_trainer_is_killed(tmp_path: Path, sig: int, options: list[str]) -> None:
    started = tmp_path / "started"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(started), *options], stdout=subprocess.PIPE, cwd=REPO, env=env
    )
    worker = None
    try:
        line = parent.stdout.readline().decode() if parent.stdout else ""
        assert line.strip().isdigit(), f"the parent printed {line!r}, not the worker's pid"
        worker = int(line)
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:  # idle, or inside its job
            time.sleep(0.05)
        assert started.exists() and alive(worker)
        time.sleep(0.2)  # past the worker's start-up
        parent.send_signal(sig)
        parent.wait(timeout=10)
        killed = time.monotonic()
        while alive(worker) and time.monotonic() - killed < 10:
            time.sleep(0.05)
        assert not alive(worker), f"rollout worker {worker} still runs 10 s after its trainer was killed"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if worker is not None and alive(worker):
            os.kill(worker, signal.SIGKILL)  # never leave an orphan behind, even when the test fails
