"""The heartbeat monitor (`mmalign.training.heartbeat`) on fake heartbeats: an in-memory store (`torch.distributed.HashStore`)
and a fake clock, no launched processes; its thread and its exit in a child interpreter; the app's
`HeartbeatMonitor` (process-group timeout, only in multi-process runs). The frozen worker of a real two-process
run is tests/e2e/test_frozen_worker.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from mmalign.training import rundir
from mmalign.training.heartbeat import EXIT_CODE, Heartbeat, Silence, default_interval, machine_id


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _pair(timeout_s: float = 10.0, **kw):
    store, clock, seen = dist.HashStore(), Clock(), []
    dogs = [
        Heartbeat(store, r, 2, timeout_s, interval_s=1.0, clock=clock, on_silent=seen.append, **kw)
        for r in (0, 1)
    ]
    return store, clock, dogs, seen


def test_a_peer_that_keeps_beating_is_never_silent() -> None:
    _, clock, (a, b), _ = _pair()
    for _ in range(100):  # 100 s of 1 s rounds, ten timeouts
        clock.now += 1.0
        assert b.poll() == []
        assert a.poll() == []


def test_a_peer_that_stops_beating_is_silent_after_the_timeout() -> None:
    _, clock, (a, b), _ = _pair(timeout_s=10.0)
    b.poll(), a.poll()
    for _ in range(10):  # b is frozen from here on
        clock.now += 1.0
        assert a.poll() == []  # not yet: 10 s is the limit
    clock.now += 1.0
    assert a.poll() == [Silence(1, 11.0)]
    assert b.check() == []  # a kept beating


def test_a_peer_that_never_beats_is_silent_a_timeout_after_the_start() -> None:
    _, clock, (a, _), _ = _pair(timeout_s=5.0)
    clock.now += 5.0
    assert a.poll() == []
    clock.now += 0.5
    assert a.poll() == [Silence(1, 5.5)]


def test_a_peer_that_is_done_is_ignored() -> None:
    _, clock, (a, b), seen = _pair(timeout_s=5.0)
    b.poll(), a.poll()
    b.stop()  # b's train() ended (its thread was never started)
    clock.now += 60.0
    assert a.poll() == [] and seen == []


def test_stop_reports_a_peer_silent_for_half_the_timeout() -> None:
    """The collective timed out before the heartbeat monitor fired: `stop` (the end of `train`) still names the rank."""
    _, clock, (a, b), seen = _pair(timeout_s=10.0)
    b.poll(), a.poll()
    clock.now += 6.0
    a.stop()
    assert seen == [[Silence(1, 6.0)]]


def test_stop_in_a_healthy_end_reports_nothing() -> None:
    _, clock, (a, b), seen = _pair(timeout_s=10.0)
    b.poll(), a.poll()
    clock.now += 4.0
    b.poll()
    a.stop()
    b.stop()
    assert seen == []


def test_a_store_that_does_not_answer_is_silent_after_the_timeout() -> None:
    class Broken:
        def add(self, key: str, amount: int) -> int:
            raise RuntimeError("Socket Timeout")

    clock = Clock()
    dog = Heartbeat(Broken(), 0, 2, 10.0, interval_s=1.0, clock=clock, on_silent=lambda s: None)
    clock.now += 10.0
    assert dog.poll() == []
    clock.now += 1.0
    assert dog.poll() == [Silence(None, 11.0)]


def test_the_report_names_the_rank_and_the_last_complete_checkpoint(tmp_path: Path) -> None:
    _, _, (a, _), _ = _pair(output_dir=tmp_path)
    text = a.report([Silence(1, 21.4)])
    assert "rank 1 has sent no heartbeat for 21 s" in text and "no complete checkpoint yet" in text
    rundir.pending_checkpoint_dir(tmp_path, 2).mkdir(parents=True)
    rundir.finish_checkpoint(tmp_path, 2, keep=3)
    rundir.pending_checkpoint_dir(tmp_path, 4).mkdir(parents=True)  # not complete
    text = a.report([Silence(1, 21.4)])
    assert str(rundir.checkpoint_dir(tmp_path, 2)) in text and "--resume" in text
    assert "rendezvous store" in a.report([Silence(None, 30.0)])


def test_the_default_interval_is_a_tenth_of_the_timeout_at_most_5_s() -> None:
    assert default_interval(20) == 2.0 and default_interval(300) == 5.0 and default_interval(0.1) == 0.05


def test_silent_peers_on_this_machine_are_killed() -> None:
    store, _, (a, b), _ = _pair()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        b.store.set(b._key("where", 1), json.dumps({"machine": machine_id(), "pid": sleeper.pid}))
        assert a.kill_silent_peers([Silence(1, 30.0), Silence(None, 30.0)]) == [1]
        assert sleeper.wait(timeout=10) == -9
        b.store.set(b._key("where", 1), '{"machine": "elsewhere/0", "pid": 1}')
        assert a.kill_silent_peers([Silence(1, 30.0)]) == []
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_thread_fires_on_a_silent_peer_and_stops_cleanly() -> None:
    store = dist.HashStore()
    fired = threading.Event()
    found: list[list[Silence]] = []

    def on_silent(silent: list[Silence]) -> None:
        found.append(silent)
        fired.set()

    alive = [Heartbeat(store, r, 3, 0.6, interval_s=0.05, on_silent=on_silent) for r in (0, 1)]
    for dog in alive:
        dog.start()
    time.sleep(1.5)  # rank 2 never beats; ranks 0 and 1 beat from their threads
    assert fired.is_set()
    assert {s.rank for silent in found for s in silent} == {2}
    for dog in alive:
        dog.stop()
        assert dog._thread is None


def test_healthy_threads_do_not_fire_and_stop_cleanly() -> None:
    store, found = dist.HashStore(), []
    dogs = [Heartbeat(store, r, 2, 0.5, interval_s=0.05, on_silent=found.append).start() for r in (0, 1)]
    time.sleep(1.5)  # three timeouts
    for dog in dogs:
        dog.stop()
    assert found == []
    assert not any(t.name.startswith("mmalign-heartbeat") for t in threading.enumerate())


def test_abort_exits_the_process_with_the_report(tmp_path: Path) -> None:
    """A peer that never beats: the child interpreter (main thread asleep, as if in a collective) leaves with
    `EXIT_CODE` and the report on stderr within about the timeout."""
    code = textwrap.dedent(
        f"""
        import time, torch.distributed as dist
        from mmalign.training.heartbeat import Heartbeat
        Heartbeat(dist.HashStore(), 0, 2, 1.0, output_dir={str(tmp_path)!r}).start()
        time.sleep(60)
        """
    )
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_CODE, proc.stderr[-2000:]
    assert "mmalign heartbeat (rank 0): rank 1 has sent no heartbeat" in proc.stderr
    assert time.monotonic() - t0 < 50  # the interpreter's start (torch) and 1 s


# ----------------------------------------------------------------------------- the app's monitor


def _config(tmp_path: Path, *overrides: str):
    from mmalign.config import load_config

    repo = Path(__file__).resolve().parents[2]
    return load_config(repo / "configs" / "text_reasoning-tiny.yaml", [f"output_dir={tmp_path}", *overrides])


def test_the_monitor_sets_the_process_group_timeout(tmp_path: Path) -> None:
    from accelerate.utils import InitProcessGroupKwargs

    from mmalign.app.run import HeartbeatMonitor

    cfg = _config(tmp_path, "trainer.dist_timeout_s=42")
    (handler,) = HeartbeatMonitor(cfg).accelerator_kwargs()["kwargs_handlers"]
    assert isinstance(handler, InitProcessGroupKwargs) and handler.timeout == timedelta(seconds=42)


@pytest.mark.parametrize(("world", "watched"), [("1", False), ("2", True)])
def test_standard_monitors_watch_multi_process_runs_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, world: str, watched: bool
) -> None:
    from mmalign.app.run import HeartbeatMonitor, standard_monitors

    monkeypatch.setenv("WORLD_SIZE", world)
    cfg = _config(tmp_path)
    assert any(isinstance(m, HeartbeatMonitor) for m in standard_monitors(cfg)) is watched


def test_the_monitor_starts_nothing_in_one_process(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from mmalign.app.run import HeartbeatMonitor

    monitor = HeartbeatMonitor(_config(tmp_path))
    trainer = SimpleNamespace(rank=0, world=1)
    monitor.on_train_start(trainer, 0)
    assert monitor.heartbeat is None
    monitor.on_train_end(trainer)
