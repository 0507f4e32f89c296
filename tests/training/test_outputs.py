"""mmalign.training.outputs: the output directory's set-up in a multi-process run. Every process checks the
folder before the processes meet (after the meeting the main process writes ``config.yaml`` through a temp
file, which a process checking the folder then took for a foreign file: CI's "Connection closed by peer"), and a
problem any process finds is raised on every process, with the main process's run lock released."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import accelerate.utils
import pytest

from mmalign.errors import ConfigError
from mmalign.training import outputs, rundir, runlock


class FakeTrainer(SimpleNamespace):
    """What `outputs.prepare_output_dir` reads of a `GroupTrainer` (rank `rank` of 2 processes)."""

    def release_run_lock(self) -> None:
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None


def fake_trainer(out: Path, rank: int, events: list[str]) -> FakeTrainer:
    cfg = SimpleNamespace(
        output_dir=str(out), overwrite=False, source="run.yaml", to_dict=lambda: {"seed": 1}
    )
    acc = SimpleNamespace(wait_for_everyone=lambda: events.append("barrier"))
    return FakeTrainer(cfg=cfg, out=out, is_main=rank == 0, world=2, run_lock=None, accelerator=acc)


def watch(monkeypatch: pytest.MonkeyPatch, events: list[str], peer: Any, on_meet: Any = None) -> None:
    """Record the folder checks and the meeting (a gather whose other process answers `peer`); `on_meet` runs at
    the meeting (what the other process does once it is past it)."""
    check = rundir.check_output_dir

    def recorded_check(cfg: Any, resume: bool) -> None:
        events.append("check")
        check(cfg, resume)

    def gather(objects: list[Any]) -> list[Any]:
        events.append("gather")
        if on_meet is not None:
            on_meet()
        return [*objects, peer]

    monkeypatch.setattr(rundir, "check_output_dir", recorded_check)
    monkeypatch.setattr(accelerate.utils, "gather_object", gather)


def test_a_process_checks_the_folder_before_the_main_process_writes_in_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1: the main process, once past the meeting, creates ``.lock`` and is writing ``config.yaml``
    (its temp file, ``.config.yaml.tmp-PID``, and a file of its own beside it); rank 1 checked before and
    goes on to the barrier."""
    out, events = tmp_path / "run", []

    def main_writes() -> None:
        out.mkdir()
        (out / ".config.yaml.tmp-999").write_text(rundir.CONFIG_HEADER)
        (out / "partial").write_text("x")  # anything else the main process writes then

    watch(monkeypatch, events, peer=None, on_meet=main_writes)
    t = fake_trainer(out, rank=1, events=events)
    outputs.prepare_output_dir(t, resume=False)
    assert events == ["check", "gather", "barrier"]
    assert not (out / rundir.CONFIG_FILE).exists()  # rank 1 writes nothing


def test_the_main_process_writes_the_config_after_the_meeting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, events = tmp_path / "run", []
    watch(monkeypatch, events, peer=None)
    t = fake_trainer(out, rank=0, events=events)
    outputs.prepare_output_dir(t, resume=False)
    try:
        assert events == ["check", "gather", "barrier"]
        assert rundir.holds_run(out) and isinstance(t.run_lock, runlock.RunLock)
    finally:
        t.release_run_lock()


def test_a_problem_one_process_finds_stops_every_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 finds nothing wrong; rank 1's check failed (its view of the folder): rank 0 raises rank 1's
    `ConfigError`, writes nothing and gives its run lock back."""
    out, events = tmp_path / "run", []
    watch(monkeypatch, events, peer=("config", "run.yaml: key 'output_dir': seen from rank 1"))
    t = fake_trainer(out, rank=0, events=events)
    with pytest.raises(ConfigError, match="seen from rank 1"):
        outputs.prepare_output_dir(t, resume=False)
    assert events == ["check", "gather"]
    assert t.run_lock is None and not (out / rundir.CONFIG_FILE).exists()
    runlock.acquire(out).release()  # free: nobody holds it

    events.clear()  # rank 1 finds nothing wrong; rank 0 did (here: it could not take the run lock)
    t1 = fake_trainer(out, rank=1, events=events)
    monkeypatch.setattr(
        accelerate.utils, "gather_object", lambda objects: [("lock", "held by pid 7"), *objects]
    )
    with pytest.raises(runlock.RunLockedError, match="held by pid 7"):
        outputs.prepare_output_dir(t1, resume=False)
    assert not (out / rundir.CONFIG_FILE).exists()
