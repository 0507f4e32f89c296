"""The run directory: its layout, checkpoints, and samples written and read by kind.

One module owns the folder a run writes (``output_dir``: ``config.yaml``, ``metrics.jsonl``, ``samples/``,
``checkpoints/step_XXXXXX/``, ``final/``); the trainer, `mmalign.app.evaluation`, the CLI and the sample
browser read and write it only through these functions. Rewritten files are replaced atomically
(`write_atomic`), state files hold plain values and tensors (`save_state`, read with ``weights_only=True``),
every checkpoint has a ``manifest.json`` and a ``COMPLETE`` marker, and `verified_checkpoint` picks the newest
that passes; write errors are `RunWriteError`. Layout, sample kinds and the checks: docs/architecture.md, "Run
directory" and "Checkpoints and exact resume"; docs/guarantees.md.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import stat
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmalign.config import Config, ConfigError
from mmalign.data.media import save_frame_strip, save_image, save_video
from mmalign.errors import CheckpointError, MetricsError, RunWriteError
from mmalign.training.runlock import LOCK_FILE

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SAMPLES_DIR = "samples"
CHECKPOINTS_DIR = "checkpoints"
FINAL_DIR = "final"
CHECKPOINT_PREFIX = "step_"
COMPLETE_MARK = "COMPLETE"
TRAINABLE_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
TRAINER_STATE_FILE = "trainer_state.pt"
MANIFEST_FILE = "manifest.json"
"""Each file of a checkpoint folder (path relative to it) with its size and sha256; written after them."""
MANIFEST_FORMAT = "mmalign-checkpoint/1"
DISTRIBUTED_FILE = "distributed.json"
"""How `mmalign train` was launched (``distributed_type`` as accelerate names it, ``num_processes``); written
by multi-process runs, removed by a one-process run in the same folder."""
RUN_OUTPUTS = (METRICS_FILE, SAMPLES_DIR, CHECKPOINTS_DIR, FINAL_DIR, DISTRIBUTED_FILE)
"""What ``overwrite=true`` clears from an existing run directory."""
EVAL_FILE = "eval.json"
"""Where `mmalign eval` writes its report by default."""
CLI_SAMPLES_DIR = "samples_cli"
"""Where `mmalign sample` writes by default (one folder per checkpoint)."""
READER_OUTPUTS = (EVAL_FILE, CLI_SAMPLES_DIR, LOCK_FILE)
"""What the readers (and the lock) put in a run's folder, before a run may exist there (``eval --checkpoint base``
first is the README's before/after): a folder holding only these counts as empty for a new run."""
WRITE_TEST_PREFIX = ".mmalign-write-test-"
"""The name prefix of the temp file the validation pass writes and removes to check that ``output_dir`` is
writable (`mmalign.app.preflight.check_output_writable`)."""
CONFIG_HEADER = "# mmalign run: the resolved config of this run, written by `mmalign train`\n"
"""The first line of the ``config.yaml`` a run writes: what marks a folder as a run's (`holds_run`)."""


def step_name(step: int) -> str:
    """``step_XXXXXX``: the name of a step's checkpoint folder, sample file and media folder."""
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def rng_file(rank: int) -> str:
    return f"rng_{rank}.pt"


# ----------------------------------------------------------------------------- the folder


def check_output_dir(cfg: Config, resume: bool) -> None:
    """Raise the `ConfigError` the trainer would raise for ``cfg.output_dir``, without touching it.

    With `resume`, the folder must hold a complete checkpoint; without, it must not hold a run
    (a non-empty ``metrics.jsonl``) unless ``overwrite`` is set."""
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{cfg.source}: key 'output_dir': {out} is a file, not a folder")
    if resume:
        if latest_checkpoint(out) is None:
            raise ConfigError(
                f"--resume: no complete checkpoint in {out / CHECKPOINTS_DIR}; run without --resume"
            )
        return
    foreign = foreign_problem(out)
    if foreign:
        raise ConfigError(f"{cfg.source}: key 'output_dir': {foreign}")
    metrics = out / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0 and not cfg.overwrite:
        raise ConfigError(
            f"output_dir {out} already holds a run ({METRICS_FILE}). Continue it with --resume, "
            f"choose another output_dir=..., or pass overwrite=true to replace it"
        )


def holds_run(output_dir: str | Path) -> bool:
    """Whether the folder holds an mmalign run: a ``config.yaml`` that begins with `CONFIG_HEADER`, or (a run
    written before the header) a ``metrics.jsonl`` whose first line is a step's row, or a complete checkpoint."""
    out = Path(output_dir)
    if _first_line(out / CONFIG_FILE) == CONFIG_HEADER.rstrip("\n"):
        return True
    first = _first_line(out / METRICS_FILE)
    if first:
        with contextlib.suppress(ValueError):
            row = json.loads(first)
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                return True
    return latest_checkpoint(out) is not None


def _first_line(path: Path, limit: int = 65536) -> str | None:
    """The first line of a regular file (at most `limit` bytes read), or None."""
    if path.is_symlink() or not path.is_file():
        return None
    try:
        with path.open("rb") as f:
            head = f.read(limit)
    except OSError:
        return None
    return head.split(b"\n", 1)[0].decode("utf-8", "replace").rstrip("\r")


def foreign_problem(output_dir: str | Path) -> str | None:
    """Why a run may not write into `output_dir` (None when it may): the folder is not empty (`READER_OUTPUTS`
    aside) and holds no mmalign run (`holds_run`). A run writes ``config.yaml``, ``metrics.jsonl``,
    ``samples/``, ``checkpoints/`` and ``final/`` there and ``overwrite=true`` removes those names, so a folder of
    other files (a home folder, a dataset, a link to ``/etc``) is refused, with or without ``overwrite``."""
    out = Path(output_dir)
    if not out.is_dir():
        return None
    try:
        names = sorted(
            p.name for p in out.iterdir() if p.name not in READER_OUTPUTS and not _write_leftover(p.name)
        )
    except OSError as e:
        return f"{out} cannot be listed ({e.strerror or e})"
    if not names or holds_run(out):
        return None
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (
        f"{out} is not empty and holds no mmalign run (it has {shown}). A run writes config.yaml, "
        f"{METRICS_FILE}, {SAMPLES_DIR}/, {CHECKPOINTS_DIR}/ and {FINAL_DIR}/ into its output_dir (and "
        "overwrite=true removes them), so it needs a new or empty folder, or one a run wrote: choose another "
        "output_dir=..."
    )


def _write_leftover(name: str) -> bool:
    """`name` is a temp file mmalign writes in a run's folder: a `write_atomic` of a run's or a reader's own file
    (``.config.yaml.tmp-PID``, ``.eval.json.tmp-PID``), written now or left by a kill, or the probe of
    `WRITE_TEST_PREFIX`; not a sign of a folder of other files (another process of the launch may be writing it)."""
    if name.startswith(WRITE_TEST_PREFIX):
        return True
    match = re.fullmatch(r"\.(.+)\.tmp-\d+", name)
    return match is not None and match.group(1) in (CONFIG_FILE, EVAL_FILE, *RUN_OUTPUTS)


def clear_run(output_dir: str | Path) -> None:
    """Remove what a previous run wrote (`RUN_OUTPUTS`); other files in the folder stay. Refuses (`ConfigError`)
    a folder of other files (`foreign_problem`); a link among those names is removed, not followed."""
    out = Path(output_dir)
    problem = foreign_problem(out)
    if problem:
        raise ConfigError(f"overwrite=true removes nothing: {problem}")
    for name in RUN_OUTPUTS:
        p = out / name
        if p.is_symlink():
            p.unlink()
        elif p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def truncate_metrics(output_dir: str | Path, last_step: int) -> None:
    """Drop the metrics of steps after `last_step` (a resumed run writes them again), and a torn last line
    (with a warning). The file is replaced atomically: a kill during the rewrite leaves the old one."""
    metrics = Path(output_dir) / METRICS_FILE
    if metrics.exists():
        kept = [row for row in parse_metrics(metrics) if row["step"] <= last_step]
        write_atomic(metrics, "".join(json.dumps(row) + "\n" for row in kept))


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl`` (empty when the run logged nothing yet); a torn last line (a run killed
    while writing it) is dropped with a warning."""
    metrics = Path(output_dir) / METRICS_FILE
    if not metrics.is_file():
        return []
    return parse_metrics(metrics)


def parse_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics file. A last line that is not a JSON object with a ``step`` (torn by a kill
    during the append) is dropped with a warning; such a line anywhere else is a `MetricsError` naming the
    file and the line."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        raise MetricsError(f"cannot read {path}: {e}") from None
    lines = [(n, ln) for n, ln in enumerate(text.split("\n"), 1) if ln.strip()]
    rows: list[dict[str, Any]] = []
    for k, (n, ln) in enumerate(lines):
        problem = _metrics_line_problem(ln)
        if problem is None:
            rows.append(json.loads(ln))
        elif k == len(lines) - 1:
            shown = ln if len(ln) <= 80 else f"{ln[:60]}...{ln[-15:]}"
            log.warning(
                "%s: dropped its last line %d (%d characters, %s; torn by a kill while it was written?): %s",
                path,
                n,
                len(ln),
                problem,
                shown,
            )
        else:
            raise MetricsError(
                f"{path}: line {n} is not a metrics row ({problem}); only a torn last line is dropped. Fix or "
                f"remove that line"
            )
    return rows


def _metrics_line_problem(line: str) -> str | None:
    try:
        row = json.loads(line)
    except ValueError as e:
        return f"not JSON: {e}"
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
        return "not a JSON object with an integer 'step'"
    return None


# ----------------------------------------------------------------------------- safe writes


_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
_OS_ERROR_TEXT = re.compile(r"\(os error (\d+)\)")
"""How safetensors (Rust) names the errno of an I/O error: ``... No space left on device (os error 28)``."""


@contextlib.contextmanager
def writing(path: str | Path, *, runtime: bool = True) -> Iterator[None]:
    """Turn an error while writing `path` into a `RunWriteError` naming it: an ``OSError`` (disk full,
    permissions), safetensors' I/O error (``SafetensorError``, which is not an ``OSError``) and, with
    `runtime`, a plain ``RuntimeError`` (torch's ``unexpected pos`` of a full disk). A full disk's error also
    says how much space is left on the filesystem (`free_space_note`)."""
    try:
        yield
    except RunWriteError:
        raise
    except Exception as e:
        if not (isinstance(e, OSError) or (runtime and type(e) is RuntimeError) or _safetensors_io_error(e)):
            raise
        code = getattr(e, "errno", None)
        if not isinstance(code, int):
            found = _OS_ERROR_TEXT.search(str(e))
            code = int(found.group(1)) if found else None
        full = code in _DISK_FULL or "unexpected pos" in str(e)
        raise RunWriteError(path, e, detail=free_space_note(path) if full else "", errno=code) from e


def _safetensors_io_error(e: BaseException) -> bool:
    """Whether `e` is safetensors' error for a failed write (its type is not an ``OSError``)."""
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - safetensors is a dependency
        return False
    return isinstance(e, SafetensorError) and ("I/O error" in str(e) or bool(_OS_ERROR_TEXT.search(str(e))))


def free_space_note(path: str | Path) -> str:
    """``"; 1.5 MiB left on the filesystem of FOLDER"`` for the nearest existing folder of `path` (what a
    disk-full error adds to its message); empty when the filesystem cannot be asked."""
    folder = Path(path)
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    return f"; {format_bytes(free)} left on the filesystem of {folder} (free space there to continue)"


def format_bytes(n: int) -> str:
    """`n` bytes for a message: ``"512 B"``, ``"1.5 KiB"``, ``"3.0 GiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Replace `path` with `data` atomically: a temp file in the same folder, fsync, ``os.replace``, fsync of
    the folder. A kill at any point leaves the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    raw = data.encode() if isinstance(data, str) else data
    with writing(path):
        try:
            with open(tmp, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_dir(path.parent)
    return path


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a folder be opened
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR / step_name(step)


def pending_checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """Where a checkpoint is written before `finish_checkpoint` renames it into place."""
    return Path(output_dir) / CHECKPOINTS_DIR / f".tmp_{step_name(step)}"


_STEP_NAME = re.compile(r"step_([0-9]{6,})", re.ASCII)


def parse_step_name(name: str) -> int | None:
    """The step of `name` when it is exactly `step_name` (step), e.g. ``step_000004`` -> 4; None for any other
    name (``step_000004.bak``, ``step_4``, ``step_0000004``)."""
    found = _STEP_NAME.fullmatch(name)
    if found is None:
        return None
    step = int(found.group(1))
    return step if step_name(step) == name else None


def _step_folders(output_dir: str | Path) -> list[Path]:
    """The folders of ``checkpoints/`` named exactly ``step_XXXXXX`` (complete or not), oldest first. Other
    names (a copy ``step_000004.bak``, ``.tmp_step_000004``) and symlinks are not checkpoints: they are
    never listed, loaded or rotated away."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        step = parse_step_name(p.name)
        if step is not None and not p.is_symlink() and p.is_dir():
            found.append((step, p))
    return [p for _, p in sorted(found)]


def checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete checkpoint folders of a run (named exactly ``step_XXXXXX``, holding ``COMPLETE``),
    oldest first."""
    return [p for p in _step_folders(output_dir) if (p / COMPLETE_MARK).exists()]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder in `output_dir/checkpoints`, or None."""
    done = checkpoints(output_dir)
    return done[-1] if done else None


def finish_checkpoint(output_dir: str | Path, step: int, keep: int) -> Path:
    """Write the manifest of the pending checkpoint of `step`, mark it complete, move it into place, keep the
    newest `keep`."""
    tmp, final = pending_checkpoint_dir(output_dir, step), checkpoint_dir(output_dir, step)
    write_manifest(tmp, step)
    write_atomic(tmp / COMPLETE_MARK, str(step))
    with writing(final):
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(final.parent)
    every = _step_folders(output_dir)  # (only step_XXXXXX folders: a copy such as step_000004.bak stays)
    for old in every[: max(0, len(every) - keep)]:
        shutil.rmtree(old)
    return final


def checkpoint_step(path: str | Path) -> int:
    """The step of a checkpoint folder (from its name, exactly ``step_XXXXXX``); another name is a
    `CheckpointError`."""
    step = parse_step_name(Path(path).name)
    if step is None:
        raise CheckpointError(
            f"{path}: not a checkpoint folder name (checkpoint folders are named {step_name(4)} for step 4)"
        )
    return step


# -- the manifest: what a reader checks before loading
#
# An entry of ``files`` names a file by its path relative to the checkpoint folder, folders joined with "/"
# (``trainable.safetensors``, ``sharded/__0_0.distcp``): never absolute, no "", "." or ".." part. The
# manifest lists every file under the folder (every entry that is not a folder, symlinks included, found
# without following symlinks), except the folder's own ``manifest.json`` and ``COMPLETE`` mark (written
# after the manifest; its content is never read).

MANIFEST_MAX_BYTES = 64 << 20
"""A larger ``manifest.json`` is not read (one of a real checkpoint is a few hundred bytes per file)."""
_SHA256_HEX = re.compile(r"[0-9a-f]{64}", re.ASCII)
_HASHED: dict[tuple[int, ...], str] = {}
"""sha256 of files already hashed by this process, by (device, inode, size, mtime, ctime): a checkpoint
verified by `resolve_checkpoint` is not hashed again by `load_weights`."""


def _open_regular(path: Path) -> tuple[int, os.stat_result]:
    """An fd of `path` (symlinks followed) and its fstat; an ``OSError`` (``EINVAL``) when it is not a regular
    file. Opened without blocking, so a FIFO put in place of a file cannot hang the reader."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        what = (
            "a folder, not a file" if stat.S_ISDIR(st.st_mode) else "a special file (FIFO, socket or device)"
        )
        raise OSError(errno.EINVAL, f"{what}, not a regular file" if "FIFO" in what else what, str(path))
    return fd, st


def _sha256_fd(fd: int, st: os.stat_result, *, sync: bool = False) -> str:
    """The sha256 of the first ``st.st_size`` bytes of the open file `fd`: never more, so the time is bounded
    by the size checked before (a file growing meanwhile is not followed; one shrinking gives another sum)."""
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key in _HASHED and not sync:
        return _HASHED[key]
    h = hashlib.sha256()
    left = st.st_size
    while left > 0:
        block = os.read(fd, min(left, 1 << 20))
        if not block:
            break
        h.update(block)
        left -= len(block)
    if sync:
        os.fsync(fd)
    _HASHED[key] = h.hexdigest()
    return _HASHED[key]


def file_sha256(path: Path, *, sync: bool = False) -> str:
    """The sha256 of the regular file `path` (hex); with `sync`, the file is also fsynced (the writer's last
    step). Reads the size the open file has, no more."""
    return _size_sha256(Path(path), sync=sync)[1]


def _size_sha256(path: Path, *, sync: bool = False) -> tuple[int, str]:
    fd, st = _open_regular(path)
    try:
        return st.st_size, _sha256_fd(fd, st, sync=sync)
    finally:
        os.close(fd)


def manifest_entries(folder: str | Path) -> list[str]:
    """The names a complete manifest of `folder` lists: every entry under it that is not a folder (regular
    files, symlinks, anything else; found without following symlinks) as its "/"-joined path relative to
    `folder`, sorted; the folder's own ``manifest.json`` and ``COMPLETE`` are left out."""
    folder = Path(folder)
    names: list[str] = []
    pending = [("", folder)]
    while pending:
        prefix, current = pending.pop()
        with os.scandir(current) as it:
            for entry in it:
                name = prefix + entry.name
                if entry.is_dir(follow_symlinks=False):
                    pending.append((name + "/", Path(entry.path)))
                elif name not in (MANIFEST_FILE, COMPLETE_MARK):
                    names.append(name)
    return sorted(names)


def write_manifest(folder: str | Path, step: int) -> Path:
    """``manifest.json`` of a checkpoint folder: every file under it (`manifest_entries`), by path relative to
    it, with its size and sha256. Each file is fsynced first."""
    folder = Path(folder)
    files = {}
    for name in manifest_entries(folder):
        with writing(folder / name):
            size, sha256 = _size_sha256(folder / name, sync=True)
        files[name] = {"size": size, "sha256": sha256}
    manifest = {"format": MANIFEST_FORMAT, "step": step, "files": files}
    return write_atomic(folder / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")


def entry_name_problem(name: str) -> str | None:
    """Why `name` cannot be an entry of a manifest (None: it can): it must be a path relative to the
    checkpoint folder, "/"-joined, without an empty, "." or ".." part, and not the manifest itself."""
    if not name:
        return "an empty name"
    if "\0" in name:
        return "a name holding a NUL character"
    if name.startswith("/"):
        return "an absolute path (entries are paths relative to the checkpoint folder)"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "a path with an empty, '.' or '..' part (entries stay inside the checkpoint folder)"
    if name == MANIFEST_FILE:
        return "the manifest itself"
    return None


def _shown(name: str) -> str:
    """`name` (from a manifest) for a message: quoted, at most 80 characters."""
    return repr(name) if len(name) <= 80 else repr(f"{name[:60]}...{name[-15:]}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {_shown(key)} appears twice")
        out[key] = value
    return out


def read_manifest(folder: str | Path) -> dict[str, dict[str, Any]] | None:
    """The files a checkpoint's manifest lists: ``{name: {"size": int, "sha256": str}}`` (None: there is no
    manifest at all, a checkpoint of an older version). Raises `CheckpointError` when the manifest is there but
    cannot be trusted: not a regular file (a folder, a symlink, dangling or not), over `MANIFEST_MAX_BYTES`,
    not JSON of the manifest format, or an entry whose name is not a plain relative path
    (`entry_name_problem`) or whose size or sha256 is not one."""
    path = Path(folder) / MANIFEST_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        why = "a symlink; a checkpoint's manifest is a regular file" if e.errno == errno.ELOOP else e.strerror
        raise CheckpointError(f"{path}: unreadable manifest ({why})") from None
    try:
        try:  # (what it is, checked on the open file before anything is read)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                what = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
                raise ValueError(f"{what}; a checkpoint's manifest is a regular file")
            if st.st_size > MANIFEST_MAX_BYTES:
                raise ValueError(f"{st.st_size} bytes, more than a manifest holds ({MANIFEST_MAX_BYTES})")
            raw = b""
            while len(raw) < st.st_size:  # (at most its size: a file still growing is not followed)
                block = os.read(fd, st.st_size - len(raw))
                if not block:
                    break
                raw += block
        finally:
            os.close(fd)
        manifest = json.loads(raw, object_pairs_hook=_unique_keys)
        if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
            found = manifest.get("format") if isinstance(manifest, dict) else None
            raise ValueError(f"format {found!r}, expected {MANIFEST_FORMAT!r}")
        files = manifest.get("files")
        if not isinstance(files, dict):
            raise ValueError("'files' is not an object")
        out: dict[str, dict[str, Any]] = {}
        for name, entry in files.items():
            problem = entry_name_problem(name)
            if problem is not None:
                raise ValueError(f"entry {_shown(name)} is {problem}")
            size = entry.get("size") if isinstance(entry, dict) else None
            sha256 = entry.get("sha256") if isinstance(entry, dict) else None
            if (
                type(size) is not int
                or size < 0
                or not isinstance(sha256, str)
                or not _SHA256_HEX.fullmatch(sha256)
            ):
                raise ValueError(f"entry {_shown(name)} is not {{'size': bytes, 'sha256': 64 hex digits}}")
            out[name] = {"size": size, "sha256": sha256}
        return out
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({type(e).__name__}: {e})") from None


def _outside_problem(base: Path, folder: Path, name: str) -> str | None:
    """Why the entry `name` does not stay inside the checkpoint folder once symlinks are resolved (`base`:
    the folder resolved); the message says nothing about what lies outside."""
    try:
        target = (folder / name).resolve()
    except (OSError, RuntimeError):
        return "cannot be resolved (a symlink loop?)"
    if not target.is_relative_to(base):
        return "leads outside the checkpoint folder (through a symlink)"
    return None


def file_problem(folder: str | Path, relative: str, entry: dict[str, Any]) -> str | None:
    """Why the file `relative` of a checkpoint does not match its manifest `entry` (None: it matches): a name
    that leaves the folder (nothing outside it is opened), missing, not a regular file, another size (compared
    on the open file before anything is read: a file of the wrong size is never hashed), another sha256."""
    folder = Path(folder)
    manifest = folder / MANIFEST_FILE
    problem = entry_name_problem(relative)
    if problem is not None:
        return f"{manifest}: entry {_shown(relative)} is {problem}"
    try:
        base = folder.resolve(strict=True)
    except (OSError, RuntimeError):
        return f"{folder}: the checkpoint folder cannot be read"
    problem = _outside_problem(base, folder, relative)
    if problem is not None:
        return f"{manifest}: entry {_shown(relative)} {problem}"
    path = folder / relative
    try:
        fd, st = _open_regular(path)
    except FileNotFoundError:
        return f"{path}: missing (listed in {MANIFEST_FILE})"
    except OSError as e:
        return f"{path}: {e.strerror} (listed in {MANIFEST_FILE} as a file)"
    try:
        if st.st_size != entry["size"]:
            return (
                f"{path}: {st.st_size} bytes, {MANIFEST_FILE} says {entry['size']} (truncated or overwritten)"
            )
        if _sha256_fd(fd, st) != entry["sha256"]:
            return f"{path}: sha256 differs from {MANIFEST_FILE} (the file is corrupted)"
    except OSError as e:
        return f"{path}: unreadable ({e.strerror})"
    finally:
        os.close(fd)
    return None


def checkpoint_problem(folder: str | Path, *, only: tuple[str, ...] | None = None) -> str | None:
    """Why the checkpoint `folder` cannot be trusted, naming it and the reason (None: it can). In order, each
    check cheap before the next: the manifest is readable (`read_manifest`); every entry stays inside the
    folder, symlinks resolved; every file in the folder is listed (`manifest_entries`: an empty ``files``
    does not pass); every listed file (of `only`, when given) has its size; then their sha256. A checkpoint
    without any manifest (written by an older version) is accepted with a warning, unless it is gone (the folder,
    or in a run's ``checkpoints/`` its ``COMPLETE`` mark: removed since it was listed, not an old checkpoint)."""
    folder = Path(folder)
    try:
        files = read_manifest(folder)
    except CheckpointError as e:
        return str(e)
    if files is None:
        # a folder listed complete and removed since (rotated away while being read) is not an old checkpoint
        in_run = folder.parent.name == CHECKPOINTS_DIR
        if not folder.is_dir() or (in_run and not (folder / COMPLETE_MARK).is_file()):
            return (
                f"{folder}: the checkpoint was removed while it was being read (rotated away by a run still "
                "training?)"
            )
        log.warning(
            "checkpoint %s has no %s (written by an older version of mmalign): its files are not verified",
            folder,
            MANIFEST_FILE,
        )
        return None
    manifest = folder / MANIFEST_FILE
    try:
        base = folder.resolve(strict=True)
        present = manifest_entries(folder)
    except (OSError, RuntimeError) as e:
        return f"{folder}: the checkpoint folder cannot be read ({type(e).__name__})"
    for name in files:
        problem = _outside_problem(base, folder, name)
        if problem is not None:
            return f"{manifest}: entry {_shown(name)} {problem}"
    unlisted = [name for name in present if name not in files]
    if unlisted:
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        return (
            f"{folder / unlisted[0]}{more}: not listed in {MANIFEST_FILE}, which lists every file of a checkpoint "
            "(added after it was written, or the manifest was replaced)"
        )
    checked = [(name, entry) for name, entry in files.items() if only is None or name in only]
    for name, entry in checked:  # sizes first: a file of the wrong size is never hashed
        path = folder / name
        try:
            st = path.stat()
        except FileNotFoundError:
            return f"{path}: missing (listed in {MANIFEST_FILE})"
        except OSError:
            continue  # (file_problem says why)
        if stat.S_ISREG(st.st_mode) and st.st_size != entry["size"]:
            return (
                f"{path}: {st.st_size} bytes, {MANIFEST_FILE} says {entry['size']} (truncated or overwritten)"
            )
    for name, entry in checked:
        problem = file_problem(folder, name, entry)
        if problem is not None:
            return problem
    return None


def verified_checkpoint(output_dir: str | Path, *, load: Callable[[Path], None] | None = None) -> Path | None:
    """The newest complete checkpoint of a run that verifies (`checkpoint_problem`) and, with `load`, that
    `load` accepts (it raises `CheckpointError` for one it cannot read); each one skipped is logged with the
    reason. None when the run has no checkpoint; `CheckpointError` listing every reason when none is usable."""
    done = checkpoints(output_dir)
    skipped: list[str] = []
    for path in reversed(done):
        problem = checkpoint_problem(path)
        if problem is None and load is not None:
            try:
                load(path)
            except CheckpointError as e:
                problem = str(e)
        if problem is None:
            if skipped:
                log.warning("using checkpoint %s (the newest that verifies)", path)
            return path
        log.warning("skipping checkpoint %s: %s", path.name, problem)
        skipped.append(f"{path.name}: {problem}")
    if not done:
        return None
    raise CheckpointError(
        f"no usable checkpoint in {Path(output_dir) / CHECKPOINTS_DIR}:\n  " + "\n  ".join(skipped)
    )


# -- state files: plain values and tensors, read without unpickling

_TAG = "__mmalign_state__"
_LEGACY_GLOBALS: list[Any] = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
with contextlib.suppress(AttributeError):  # NumPy 2 (np._core) or 1 (np.core)
    _LEGACY_GLOBALS.append(np._core.multiarray._reconstruct)  # type: ignore[attr-defined]
with contextlib.suppress(AttributeError):
    _LEGACY_GLOBALS.append(np.core.multiarray._reconstruct)  # type: ignore[attr-defined]


def _encode(obj: Any, where: str) -> Any:
    """`obj` with what ``torch.load(weights_only=True)`` cannot read (NumPy arrays and scalars, frozensets)
    replaced by tagged dicts; anything else that is not a plain value, container or tensor is an error."""
    if isinstance(obj, np.generic):  # (before float: np.float64 is a float)
        return {_TAG: "numpy_scalar", "dtype": obj.dtype.str, "value": obj.item()}
    if obj is None or isinstance(
        obj, bool | int | float | str | bytes | torch.dtype | torch.device | torch.Size
    ):
        return obj
    if isinstance(obj, Tensor):
        return obj.detach()
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError(f"{where}: a NumPy array of Python objects cannot be saved without pickle")
        raw = torch.from_numpy(np.frombuffer(np.ascontiguousarray(obj).tobytes(), dtype=np.uint8).copy())
        return {_TAG: "ndarray", "dtype": obj.dtype.str, "shape": list(obj.shape), "data": raw}
    if type(obj) in (dict, OrderedDict):
        out = {_encode(k, f"{where} key"): _encode(v, f"{where}[{k!r}]") for k, v in obj.items()}
        return OrderedDict(out) if type(obj) is OrderedDict else out
    if type(obj) in (list, tuple, set):
        return type(obj)(_encode(v, f"{where}[{i}]") for i, v in enumerate(obj))
    if type(obj) is frozenset:
        return {_TAG: "frozenset", "items": [_encode(v, f"{where} item") for v in obj]}
    raise TypeError(
        f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be saved in a checkpoint without "
        "pickle (state_dict() must return plain Python values, containers, tensors and NumPy arrays)"
    )


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        tag = obj.get(_TAG) if all(isinstance(k, str) for k in obj) else None
        if tag == "numpy_scalar":
            return np.dtype(obj["dtype"]).type(obj["value"])
        if tag == "ndarray":
            raw = obj["data"].numpy().tobytes()
            return np.frombuffer(raw, dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
        if tag == "frozenset":
            return frozenset(_decode(v) for v in obj["items"])
        out = {k: _decode(v) for k, v in obj.items()}
        return OrderedDict(out) if isinstance(obj, OrderedDict) else out
    if type(obj) in (list, tuple, set):
        return type(obj)(_decode(v) for v in obj)
    return obj


def save_state(obj: Any, path: str | Path) -> Path:
    """Write a state (optimizer, scheduler, trainer, RNG) with ``torch.save`` in a form that
    ``torch.load(weights_only=True)`` reads back exactly (`load_state`): plain values, containers and tensors
    (NumPy arrays as tagged tensors). A value of another type is a `TypeError` naming where it is; an I/O
    error is a `RunWriteError` naming `path`."""
    path = Path(path)
    encoded = _encode(obj, path.name)
    with writing(path):
        torch.save(encoded, path)
    return path


def load_state(path: str | Path, *, legacy: bool = False) -> Any:
    """Read what `save_state` wrote, with ``torch.load(weights_only=True)`` (no unpickling of arbitrary
    objects). `legacy`: a file of a checkpoint written before `save_state` existed (no manifest), whose NumPy
    RNG state was pickled as an array: NumPy's array reconstruction is allowed, nothing else. Any failure is a
    `CheckpointError` naming the file."""
    path = Path(path)
    try:
        if legacy:
            with torch.serialization.safe_globals(_LEGACY_GLOBALS):
                raw = torch.load(path, map_location="cpu", weights_only=True)
        else:
            raw = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "Weights only load failed" in str(e):
            raise CheckpointError(
                f"{path}: holds objects that only full unpickling could load (written by another program or an "
                f"older mmalign?); mmalign reads checkpoints with torch.load(weights_only=True) only"
            ) from None
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {first})") from None
    return _decode(raw)


def store_media(
    view: dict[str, Any], folder: str | Path, name: str, relative_to: str | Path
) -> dict[str, Any]:
    """`view` (one sample's kinds) with its ``image`` / ``video`` tensors written into `folder` as
    ``<name>.png`` / ``<name>.mp4`` and replaced by paths relative to `relative_to`; a video also gets
    ``video_frames`` (a PNG strip). Text and boxes are returned as they are (boxes as plain lists)."""
    folder, base = Path(folder), Path(relative_to)
    out: dict[str, Any] = {}
    for kind, value in view.items():
        if kind == "image" and isinstance(value, Tensor):
            out[kind] = save_image(value, folder / f"{name}.png").relative_to(base).as_posix()
        elif kind == "video" and isinstance(value, Tensor):
            out[kind] = save_video(value, folder / f"{name}.mp4").relative_to(base).as_posix()
            strip = save_frame_strip(value, folder / f"{name}_frames.png")
            out["video_frames"] = strip.relative_to(base).as_posix()
        elif isinstance(value, Tensor):
            out[kind] = value.tolist()
        else:
            out[kind] = value
    return out


# ----------------------------------------------------------------------------- samples


def samples_file(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / SAMPLES_DIR / f"{step_name(step)}.jsonl"


def store_sample_media(
    output_dir: str | Path, step: int, views: list[dict[str, Any]], *, rank: int = 0, world: int = 1
) -> list[dict[str, Any]]:
    """Write the media of one process's samples of `step` into ``samples/step_XXXXXX/`` (``IIII.*``;
    ``rR_IIII.*`` with several processes) and return the views with paths relative to ``samples/``."""
    root = Path(output_dir) / SAMPLES_DIR
    folder = root / step_name(step)
    prefix = f"r{rank}_" if world > 1 else ""
    return [store_media(v, folder, f"{prefix}{i:04d}", root) for i, v in enumerate(views)]


def write_samples(output_dir: str | Path, step: int, rows: list[dict[str, Any]]) -> Path:
    """Write ``samples/step_XXXXXX.jsonl`` (rows whose media are already stored; NaN -> null)."""
    path = samples_file(output_dir, step)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, "".join(json.dumps(jsonable(row)) + "\n" for row in rows))


def sample_steps(output_dir: str | Path) -> list[int]:
    """The steps that have a samples file, in order."""
    root = Path(output_dir) / SAMPLES_DIR
    if not root.is_dir():
        return []
    steps = []
    for p in root.glob(f"{CHECKPOINT_PREFIX}*.jsonl"):
        tail = p.stem[len(CHECKPOINT_PREFIX) :]
        if tail.isdigit():
            steps.append(int(tail))
    return sorted(steps)


def read_samples(output_dir: str | Path, step: int, *, resolve: bool = True) -> list[dict[str, Any]]:
    """The rows of a step's samples file; with `resolve`, media paths (``image``, ``video``,
    ``video_frames``) become absolute `Path`s inside the run directory."""
    path = samples_file(output_dir, step)
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    if resolve:
        root = Path(output_dir) / SAMPLES_DIR
        for row in rows:
            for key in ("image", "video", "video_frames"):
                if isinstance(row.get(key), str):
                    row[key] = root / row[key]
    return rows


def jsonable(obj: Any) -> Any:
    """`obj` with tensors as lists and NaN / inf as None, ready for `json.dumps`."""
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, Tensor):
        return jsonable(obj.tolist())
    return obj
