"""A frozen worker stops a two-process run in bounded time (issue 23, item 3).

``torchrun --standalone --nproc_per_node 2 -m mmalign.app.cli train text_reasoning-tiny.yaml`` on CPU (gloo) with
``trainer.dist_timeout_s=20``; once step 1 and its checkpoint are written, rank 1 gets SIGSTOP (its threads stop
too, the heartbeat's included). Rank 0's heartbeat monitor (`mmalign.training.heartbeat`) must notice within about the bound, name
rank 1 and the last complete checkpoint, SIGKILL the stopped rank 1 (same machine) and exit, so that torchrun
exits non-zero well within 60 s (before the heartbeat monitor, the run hung for the process group's default timeout, about
30 minutes). The heartbeat monitor's logic on fake heartbeats is tests/training/test_heartbeat.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import two_process as tp  # noqa: E402

from mmalign.training import rundir

TIMEOUT_S = 20
BOUND_S = 60

pytestmark = pytest.mark.skipif(
    shutil.which("torchrun") is None, reason="torchrun (from torch) is not on PATH"
)


def _worker(launcher: subprocess.Popen, rank: int, deadline: float):
    """The worker process of `rank` (a child of torchrun, recognised by its ``RANK``)."""
    import psutil

    while time.monotonic() < deadline:
        for p in psutil.Process(launcher.pid).children():
            try:
                if p.environ().get("RANK") == str(rank):
                    return p
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.2)
    raise AssertionError(f"no worker of rank {rank} under torchrun")


def test_a_stopped_worker_ends_the_run_within_the_bound(tmp_path: Path, random_text_model_dir: Path) -> None:
    out = tmp_path / "run"
    args = tp.train_args(
        "text_reasoning-tiny.yaml",
        out,
        1000,  # far more steps than run before the stop
        1,  # a checkpoint every step: the report names the last complete one
        f"model.name_or_path={random_text_model_dir}",
        "model.tiny_builder=null",
        f"trainer.dist_timeout_s={TIMEOUT_S}",
    )
    log = tmp_path / "output.txt"
    stopped = None
    with log.open("w") as f:
        launcher = subprocess.Popen(
            tp.launch_cmd(2, "train", *args),
            cwd=tp.REPO,
            env=tp.env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 600
        while rundir.latest_checkpoint(out) is None:  # step 1 trained and saved
            assert launcher.poll() is None, f"the run ended early:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no checkpoint after 600 s:\n{log.read_text()[-4000:]}"
            time.sleep(0.2)
        stopped = _worker(launcher, 1, deadline)
        stopped.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            rc = launcher.wait(timeout=3 * BOUND_S)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - t0
        text = log.read_text()
        assert rc is not None, (
            f"torchrun still running {3 * BOUND_S} s after rank 1 was stopped:\n{text[-4000:]}"
        )
        assert rc != 0
        assert took < BOUND_S, f"torchrun exited {took:.0f} s after rank 1 was stopped:\n{text[-4000:]}"
        assert "mmalign heartbeat (rank 0): rank 1 has sent no heartbeat" in text, text[-4000:]
        assert "the last complete checkpoint is" in text and str(out / "checkpoints") in text
        assert not stopped.is_running() or stopped.status() == "zombie"  # killed by rank 0, not left stopped
    finally:
        if stopped is not None:
            try:
                os.kill(stopped.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        tp.kill_launch(launcher)
