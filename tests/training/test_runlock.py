"""The run lock (`mmalign.training.runlock`, issue 33 item 3): a second writer of a run directory is refused with the
holder's pid, host and command; a killed holder (SIGKILL) leaves no stale lock, nor does a child it forked;
the trainer holds the lock while it sets up and trains."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mmalign.training import runlock
from tests.training.test_trainer import make_cfg, make_trainer

HOLD = """
import os, sys, time
from mmalign.training import runlock
lock = runlock.acquire(sys.argv[1], command="mmalign train held.yaml")
child = 0
if sys.argv[2] == "fork":
    child = os.fork()
    if child == 0:  # a forked child (as the asynchronous rollout worker) that outlives its parent
        time.sleep(120)
        os._exit(0)
print(os.getpid(), child, flush=True)
time.sleep(120)
"""


class Holder:
    """A separate process holding the lock of `out` (optionally with a forked child)."""

    def __init__(self, out: Path, fork: bool = False) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(out), "fork" if fork else "-"],
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline().split()  # (printed once the lock is taken)
        assert line, "the holder did not start"
        self.pid, self.child = int(line[0]), int(line[1])

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def close(self) -> None:
        for pid in (self.pid, self.child):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc.wait(timeout=30)


def can_lock_elsewhere(out: Path) -> bool:
    """Whether another process can take the lock of `out` now (it releases it at once)."""
    code = "import sys; from mmalign.training import runlock\ntry:\n    runlock.acquire(sys.argv[1]).release()\nexcept runlock.RunLockedError:\n    sys.exit(3)"
    return subprocess.run([sys.executable, "-c", code, str(out)], timeout=60).returncode == 0


def test_second_writer_is_refused_naming_the_holder(tmp_path: Path) -> None:
    out = tmp_path / "run"
    holder = Holder(out)
    try:
        with pytest.raises(runlock.RunLockedError) as info:
            runlock.acquire(out)
        msg = str(info.value)
        assert f"output_dir {out} is being written by another run: pid {holder.pid} on host " in msg
        assert socket.gethostname() in msg and "mmalign train held.yaml" in msg and "started " in msg
        assert f"kill {holder.pid}" in msg and str(out / runlock.LOCK_FILE) in msg
        assert info.value.holder is not None and info.value.holder.pid == holder.pid
        assert runlock.read_holder(out).pid == holder.pid
    finally:
        holder.close()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    out = tmp_path / "run"
    holder = Holder(out)
    holder.kill()  # SIGKILL: no cleanup runs; its lock file (with its details) stays
    assert runlock.read_holder(out).pid == holder.pid
    with runlock.acquire(out, command="mmalign train again.yaml") as lock:
        assert lock.locked
        details = runlock.read_holder(out)
        assert details.pid == os.getpid() and details.command == "mmalign train again.yaml"
    assert not (out / runlock.LOCK_FILE).exists()  # a released lock removes its file
    assert out.is_dir()  # (the folder was there before: it stays)


def test_a_forked_child_does_not_keep_the_lock(tmp_path: Path) -> None:
    """A flock belongs to the open file, which a forked child shares: without closing it in the child, a
    rollout worker outliving its killed trainer would keep the run locked."""
    out = tmp_path / "run"
    holder = Holder(out, fork=True)
    try:
        holder.kill()
        os.kill(holder.child, 0)  # the child still runs
        assert can_lock_elsewhere(out)
    finally:
        holder.close()


def test_reentrant_within_a_process(tmp_path: Path) -> None:
    import gc

    gc.collect()  # trainers other tests dropped without training release their locks when collected
    out = tmp_path / "new" / "run"
    first = runlock.acquire(out)
    second = runlock.acquire(out)  # the CLI, then the trainer, in one process
    assert out.is_dir() and runlock.held_paths() == [os.path.realpath(out / runlock.LOCK_FILE)]
    first.release()
    first.release()  # (twice: harmless)
    assert not can_lock_elsewhere(out)  # still held by `second`
    second.release()
    assert runlock.held_paths() == []
    assert not out.exists()  # created by the lock, empty again: removed
    assert can_lock_elsewhere(out)
    third = runlock.acquire(out)
    del third  # garbage-collected: released
    assert runlock.held_paths() == [] and can_lock_elsewhere(out)


def test_a_lock_file_replaced_meanwhile_is_not_held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between opening the lock file and locking it, its holder may release it (removing the file) and a third
    process create a new one: the lock taken on the removed file guards nothing, so `acquire` locks the file
    the path names now."""
    out = tmp_path / "run"
    out.mkdir()
    real_flock = runlock.fcntl.flock
    calls = []

    def flock(fd: int, op: int) -> None:
        if not calls:  # the first attempt: the file is replaced after it was opened
            (out / runlock.LOCK_FILE).unlink()
            (out / runlock.LOCK_FILE).write_text("")
        calls.append(fd)
        real_flock(fd, op)

    monkeypatch.setattr(runlock.fcntl, "flock", flock)
    with runlock.acquire(out):
        assert len(calls) == 2
        held = runlock._HELD[os.path.realpath(out / runlock.LOCK_FILE)]
        assert os.path.samestat(os.fstat(held.fd), os.stat(out / runlock.LOCK_FILE))


def test_the_trainer_holds_the_lock_while_it_trains(random_text_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = make_cfg(random_text_model_dir, out, trainer={"steps": 1, "save_every": 1})
    trainer = make_trainer(cfg)  # set-up writes the run directory: the lock is taken
    assert not can_lock_elsewhere(out)
    trainer.train()
    assert not (out / runlock.LOCK_FILE).exists() and can_lock_elsewhere(out)  # released when train ends

    holder = Holder(out)
    try:  # a second writer is refused at set-up, before it changes anything
        before = (out / "metrics.jsonl").read_bytes()
        with pytest.raises(runlock.RunLockedError, match=f"pid {holder.pid} "):
            make_trainer(make_cfg(random_text_model_dir, out, trainer={"steps": 2}), resume=True)
        assert (out / "metrics.jsonl").read_bytes() == before
    finally:
        holder.close()
