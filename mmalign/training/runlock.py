"""The run lock: one process at a time writes a run directory.

`mmalign train` takes the lock before the model loads and holds it until the command ends;
`mmalign.training.trainer.GroupTrainer` takes it too (re-entrantly), on the main process only. A second writer
into the same ``output_dir`` is refused at once with `RunLockedError`, naming the holder (pid, host, start time,
command); readers (``eval``, ``sample``, ``doctor``, ``demo``) take no lock. Mechanism: a non-blocking
``fcntl.flock`` on ``OUTPUT_DIR/.lock``, which the kernel drops when the holder ends in any way, so a lock is
never stale; without flock support the run proceeds after a warning. Details and limits: docs/guarantees.md,
"One writer per run directory".
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shlex
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from mmalign.errors import MmalignError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
"""The lock file in the run directory; it holds the holder's details as JSON while the run is alive."""


class RunLockedError(MmalignError, RuntimeError):
    """Another process holds the run directory's lock; the message names it (`holder`: its details, None
    when it had not written them yet)."""

    def __init__(self, message: str, holder: LockHolder | None = None) -> None:
        super().__init__(message)
        self.holder = holder


@dataclass(frozen=True)
class LockHolder:
    """Who holds a run lock, as it wrote itself into the lock file."""

    pid: int
    host: str
    started: str
    """When it took the lock: ISO 8601, UTC."""
    command: str

    @classmethod
    def parse(cls, text: str) -> LockHolder | None:
        """The details a lock file holds; None when they are missing or malformed."""
        try:
            data = json.loads(text)
            return cls(int(data["pid"]), str(data["host"]), str(data["started"]), str(data["command"]))
        except (ValueError, TypeError, KeyError):
            return None

    def describe(self) -> str:
        """``pid 4242 on host gpu-3, started 2025-01-02 10:00:00 UTC (3 min ago): mmalign train cfg.yaml``."""
        when = self.started
        with contextlib.suppress(ValueError):
            start = datetime.fromisoformat(self.started)
            ago = max(0.0, time.time() - start.timestamp())
            when = f"{start.strftime('%Y-%m-%d %H:%M:%S %Z').strip()} ({_duration(ago)} ago)"
        return f"pid {self.pid} on host {self.host}, started {when}: {self.command}"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{int(seconds)} s"
    if seconds < 90 * 60:
        return f"{int(seconds // 60)} min"
    return f"{seconds / 3600:.1f} h"


@dataclass
class _Held:
    """The open, locked lock file of this process for one run directory."""

    fd: int
    path: Path
    handles: int
    created_dir: bool
    """The run directory did not exist before the lock was taken (removed again if empty on release)."""


_REGISTRY_LOCK = threading.Lock()
_HELD: dict[str, _Held] = {}
"""The run locks this process holds, by the real path of the lock file."""
_PENDING: list[tuple[str, _Held]] = []
"""Holds given up by a finalizer that could not take `_REGISTRY_LOCK` at once (dropped by the next call)."""
_WARNED: set[str] = set()


def _forget_in_child() -> None:
    """In a forked child: close the inherited lock descriptors (without unlocking: the lock is the parent's)."""
    global _REGISTRY_LOCK
    _REGISTRY_LOCK = threading.Lock()  # (another thread may have held it at the fork)
    for held in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(held.fd)
    _HELD.clear()
    _PENDING.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class RunLock:
    """This process's hold on a run directory's lock (from `acquire`). `release` (or leaving a ``with``
    block, or the object being garbage-collected) gives it up; the file is unlocked and removed when the
    last hold of the process is released. Releasing twice is harmless."""

    def __init__(self, path: Path, held: _Held | None, key: str) -> None:
        self.path = path
        self._key = key
        self._held = held
        self._released = False

    @property
    def locked(self) -> bool:
        """Whether this hold is active and backed by an OS lock (False where locking is unavailable)."""
        return not self._released and self._held is not None

    def release(self) -> None:
        with _REGISTRY_LOCK:
            _drop_pending()
            self._drop()

    def _drop(self) -> None:
        """Give up this hold (the caller holds `_REGISTRY_LOCK`)."""
        if self._released:
            return
        self._released = True
        if self._held is not None:
            _drop_hold(self._key, self._held)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        # (a finalizer may run inside `acquire` or `release` of this thread: never wait for the lock here)
        if self._released or self._held is None:
            return
        if _REGISTRY_LOCK.acquire(blocking=False):
            try:
                self._drop()
            finally:
                _REGISTRY_LOCK.release()
        else:
            self._released = True
            _PENDING.append((self._key, self._held))


def _drop_hold(key: str, held: _Held) -> None:
    """One hold of `held` fewer; the last one unlocks and removes the file (the caller holds the lock)."""
    if _HELD.get(key) is not held:  # a forked child's copy, or already gone
        return
    held.handles -= 1
    if held.handles > 0:
        return
    del _HELD[key]
    with contextlib.suppress(OSError):
        if os.path.samestat(os.fstat(held.fd), os.stat(held.path)):
            os.unlink(held.path)  # while still locked: see the module docstring
    with contextlib.suppress(OSError):
        os.close(held.fd)  # closing the last descriptor releases the flock
    if held.created_dir:
        with contextlib.suppress(OSError):
            held.path.parent.rmdir()  # only when empty


def _drop_pending() -> None:
    """The holds whose `RunLock` was garbage-collected while the registry was busy (caller holds the lock)."""
    while _PENDING:
        _drop_hold(*_PENDING.pop())


def default_command() -> str:
    """The command line of this process, as the holder's details show it."""
    argv = list(sys.argv) or ["python"]
    name = Path(argv[0]).name
    if name in ("__main__.py", "cli.py"):
        name = "mmalign"
    return shlex.join([name, *argv[1:]])


def acquire(output_dir: str | Path, *, command: str | None = None) -> RunLock:
    """Take the lock of run directory `output_dir` (created if missing) for this process, or raise
    `RunLockedError` naming the process that holds it. Re-entrant: a process that holds it gets another
    hold on the same lock. `command` is recorded for the message another writer gets (default: this
    process's command line)."""
    out = Path(output_dir)
    path = out / LOCK_FILE
    with _REGISTRY_LOCK:
        _drop_pending()
        key = os.path.realpath(path)
        held = _HELD.get(key)
        if held is not None:
            held.handles += 1
            return RunLock(path, held, key)
        if fcntl is None:  # pragma: no cover - Windows
            _warn_once(key, f"cannot lock {path}: no fcntl on this platform; nothing stops a second writer")
            return RunLock(path, None, key)
        for _ in range(20):  # (more than one turn only while other processes remove and re-create the file)
            created = not out.exists()
            out.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            except FileNotFoundError:  # the folder was removed meanwhile by a holder that created it
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise RunLockedError(_locked_message(out, path, holder), holder) from None
            except OSError as e:  # a filesystem without flock (ENOLCK, EOPNOTSUPP, ENOSYS)
                os.close(fd)
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                _warn_once(key, f"cannot lock {path} ({e.strerror}); nothing stops a second writer")
                return RunLock(path, None, key)
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if not same:  # locked a file its holder removed (or replaced) meanwhile: try the new one
                os.close(fd)
                continue
            _write_holder(fd, command if command is not None else default_command())
            held = _Held(fd=fd, path=path, handles=1, created_dir=created)
            _HELD[key] = held
            return RunLock(path, held, key)
    raise RunLockedError(f"could not take the lock {path}: it was removed and re-created 20 times meanwhile")


def _write_holder(fd: int, command: str) -> None:
    details = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }
    data = (json.dumps(details) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    with contextlib.suppress(OSError):
        os.fsync(fd)


def _read_holder(fd: int) -> LockHolder | None:
    """The details in the locked file `fd`; the holder writes them right after taking the lock, so an empty
    file is read again a few times (for up to about 0.2 s)."""
    for attempt in range(5):
        holder = LockHolder.parse(os.pread(fd, 1 << 16, 0).decode("utf-8", errors="replace"))
        if holder is not None:
            return holder
        if attempt < 4:
            time.sleep(0.05)
    return None


def read_holder(output_dir: str | Path) -> LockHolder | None:
    """The details recorded in the lock file of `output_dir` (None without one), whether or not a process still
    holds it: a killed run's details stay until the next run takes the lock. For diagnostics."""
    try:
        return LockHolder.parse((Path(output_dir) / LOCK_FILE).read_text(encoding="utf-8"))
    except OSError:
        return None


def _locked_message(out: Path, path: Path, holder: LockHolder | None) -> str:
    if holder is None:
        who = "another process (it has not recorded its details yet)"
        stop = "wait for it to end or stop it"
    else:
        who = holder.describe()
        here = holder.host == socket.gethostname()
        if here and not _alive(holder.pid):
            who += f" (pid {holder.pid} has ended: a process it started still holds the lock)"
        stop = f"wait for it to end or stop it (kill {holder.pid}{'' if here else ' on ' + holder.host})"
    return (
        f"output_dir {out} is being written by another run: {who}. Two writers would interleave its metrics "
        f"and checkpoints, so this one stops; {stop}: a stopped or killed run releases the lock {path} by itself"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (exists, owned by someone else)
        return True
    return True


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message)


def held_paths() -> list[str]:
    """The lock files this process holds (real paths): for tests and diagnostics."""
    with _REGISTRY_LOCK:
        return sorted(_HELD)
