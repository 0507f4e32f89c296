"""A heartbeat monitor for multi-process runs: a frozen or unreachable peer stops every process in bounded time.

A collective waits for every rank, so a frozen process (SIGSTOP, a hung driver) would stall the others.
`Heartbeat` runs one daemon thread per process that beats a counter in the launch's rendezvous store
(`connect_store`, its own client connection) and watches its peers' counters: a peer silent for ``timeout_s``
of this process's clock makes it report the rank and the last checkpoint, SIGKILL a same-machine silent peer
and leave with `os._exit` (`EXIT_CODE`). `stop` marks the rank done. Details: docs/distributed_runs.md, "A
frozen or lost process".
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

EXIT_CODE = 3
"""The exit status of a process that the heartbeat monitor stops."""

KEY_PREFIX = "mmalign/heartbeat"
"""The store keys of the heartbeats: ``{KEY_PREFIX}/{namespace}/beat/{rank}``, ``.../done/{rank}``,
``.../where/{rank}``."""

_starts = 0  # heartbeats started by this process: every rank starts as many, so it is part of the namespace


def default_interval(timeout_s: float) -> float:
    """Seconds between beats (and checks): a tenth of the timeout, at most 5 s."""
    return max(0.05, min(5.0, timeout_s / 10))


def machine_id() -> str:
    """This machine: host name and boot id (two containers may share a host name, never a boot id and one)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class Silence:
    """What `Heartbeat.check` found: `rank` (None: the store itself) has been silent for `seconds`."""

    rank: int | None
    seconds: float


class Heartbeat:
    """The heartbeat of rank `rank` of `world_size` and the watch over its peers (see the module docstring).

    `store`: a `torch.distributed.Store` (``add``, ``set``, ``check``, ``get``), used by this object only.
    `on_silent(silences)`: called from the thread (or `stop`) when a peer or the store is silent; the default,
    `abort`, reports and leaves the process. `output_dir`: the run directory whose last complete checkpoint the
    report names. `clock`: seconds, monotonic (tests pass a fake one)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout_s: float,
        *,
        interval_s: float | None = None,
        namespace: str = "0",
        output_dir: str | Path | None = None,
        on_silent: Callable[[list[Silence]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"Heartbeat: timeout_s must be > 0, got {timeout_s}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.interval_s = default_interval(timeout_s) if interval_s is None else float(interval_s)
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.on_silent = on_silent or self.abort
        self.clock = clock
        self._prefix = f"{KEY_PREFIX}/{namespace}"
        self.peers = [r for r in range(world_size) if r != rank]
        now = clock()
        self._count: dict[int, int] = {p: 0 for p in self.peers}  # a key never written reads 0
        self._changed: dict[int, float] = {p: now for p in self.peers}  # a peer that never beat: since start
        self._done: set[int] = set()
        self._store_ok = now
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _key(self, kind: str, rank: int) -> str:
        return f"{self._prefix}/{kind}/{rank}"

    # ------------------------------------------------------------------ one round
    def beat(self) -> None:
        """Record that this process is alive (one more on its counter)."""
        self.store.add(self._key("beat", self.rank), 1)

    def check(self, limit_s: float | None = None) -> list[Silence]:
        """Read the peers' counters; the peers (not done) whose counter has not changed for more than `limit_s`
        seconds (default `timeout_s`)."""
        limit = self.timeout_s if limit_s is None else limit_s
        now = self.clock()
        silent = []
        for peer in self.peers:
            if peer in self._done:
                continue
            if self.store.add(self._key("done", peer), 0):
                self._done.add(peer)
                continue
            count = self.store.add(self._key("beat", peer), 0)
            if count != self._count[peer]:
                self._count[peer], self._changed[peer] = count, now
            elif now - self._changed[peer] > limit:
                silent.append(Silence(peer, now - self._changed[peer]))
        return silent

    def poll(self) -> list[Silence]:
        """One round: `beat`, then `check`. A store that does not answer is silent itself once it has not
        answered for `timeout_s` (``Silence(None, seconds)``); until then the round finds nothing."""
        try:
            self.beat()
            silent = self.check()
        except Exception:  # noqa: BLE001 - a store client raises RuntimeError / DistStoreError on a timeout
            gone = self.clock() - self._store_ok
            return [Silence(None, gone)] if gone > self.timeout_s else []
        self._store_ok = self.clock()
        return silent

    # ------------------------------------------------------------------ thread
    def start(self) -> Heartbeat:
        """Beat once, record where this process runs, and start the daemon thread."""
        self.beat()
        self.store.set(
            self._key("where", self.rank), json.dumps({"machine": machine_id(), "pid": os.getpid()})
        )
        self._thread = threading.Thread(target=self._run, name=f"mmalign-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            silent = self.poll()
            if silent and not self._stop.is_set():
                self.on_silent(silent)
                return

    def stop(self) -> None:
        """End the watch: end the thread, check once more with half the timeout (a peer silent that long is not
        merely slow), then mark this rank done. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + self.timeout_s)  # a round waits for the store at most
        self._thread = None
        try:
            silent = self.check(self.timeout_s / 2)
        except Exception:  # noqa: BLE001 - the store is gone: nothing left to watch
            silent = []
        if silent:
            self.on_silent(silent)
        try:
            self.store.add(self._key("done", self.rank), 1)
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ the end
    def report(self, silent: list[Silence]) -> str:
        """The error `abort` writes: who is silent, for how long, and the last complete checkpoint."""
        from mmalign.training import rundir

        who = []
        for s in silent:
            if s.rank is None:
                who.append(f"the rendezvous store has not answered for {s.seconds:.0f} s")
            else:
                who.append(f"rank {s.rank} has sent no heartbeat for {s.seconds:.0f} s")
        ckpt = rundir.latest_checkpoint(self.output_dir) if self.output_dir is not None else None
        where = (
            f"the last complete checkpoint is {ckpt} (continue with --resume)"
            if ckpt is not None
            else "no complete checkpoint yet"
        )
        return (
            f"mmalign heartbeat (rank {self.rank}): {'; '.join(who)} (trainer.dist_timeout_s = {self.timeout_s:g}): "
            f"frozen, stopped or unreachable. Stopping this process (exit code {EXIT_CODE}); {where}\n"
        )

    def kill_silent_peers(self, silent: list[Silence]) -> list[int]:
        """SIGKILL the silent peers that run on this machine (a stopped process cannot exit by itself); their
        ranks."""
        here = machine_id()
        killed = []
        for s in silent:
            if s.rank is None:
                continue
            key = self._key("where", s.rank)
            try:
                if not self.store.check([key]):
                    continue  # it never started
                value = self.store.get(key)
                where = json.loads(value.decode() if isinstance(value, bytes) else value)
            except Exception:  # noqa: BLE001 - the store or the record is gone
                continue
            if where.get("machine") == here and int(where.get("pid", 0)) > 0:
                try:
                    os.kill(int(where["pid"]), signal.SIGKILL)
                    killed.append(s.rank)
                except OSError:
                    pass
        return killed

    def abort(self, silent: list[Silence]) -> None:
        """Write `report` to stderr (without Python's locks: another thread may hold them), SIGKILL the silent
        peers on this machine and leave with `EXIT_CODE`."""
        try:
            os.write(2, self.report(silent).encode())
        except Exception:  # noqa: BLE001 - leave anyway
            pass
        self.kill_silent_peers(silent)
        os._exit(EXIT_CODE)


# ----------------------------------------------------------------------------- launched runs


def connect_store(timeout_s: float) -> Any | None:
    """A client connection of its own to the launch's rendezvous store (``MASTER_ADDR:MASTER_PORT``), None when
    the environment names none. Its operations give up after `timeout_s`."""
    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    return dist.TCPStore(
        host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def start_heartbeat(
    rank: int, world_size: int, timeout_s: float, *, output_dir: str | Path | None = None
) -> Heartbeat | None:
    """Start a `Heartbeat` for this process of a launched multi-process run (torchrun / accelerate launch);
    None for one process, or when the launch gives no rendezvous store (``MASTER_ADDR`` / ``MASTER_PORT``).
    Every rank must start one, as often as the others (the count is part of the keys)."""
    global _starts
    if world_size <= 1:
        return None
    interval = default_interval(timeout_s)
    store = connect_store(max(2 * interval, min(timeout_s, 10.0)))
    if store is None:
        return None
    _starts += 1
    namespace = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_starts}"
    return Heartbeat(
        store, rank, world_size, timeout_s, interval_s=interval, namespace=namespace, output_dir=output_dir
    ).start()
