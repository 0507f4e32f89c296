"""Issue 33 (items 5 and 10): a checkpoint manifest cannot be bypassed (empty, not a file, entries outside the
folder, unlisted files), sizes are compared before anything is hashed, only folders named exactly
``step_XXXXXX`` are checkpoints, and a full disk (safetensors' write, the metrics append) is a clean error
naming the file, the space left and the last complete checkpoint."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
import types
from pathlib import Path
from typing import Any

import pytest
from safetensors import SafetensorError

from mmalign.errors import CheckpointError, MmalignError, RunWriteError
from mmalign.training import rundir
from mmalign.training.trainer import TrainingError
from tests.training.test_trainer import VARIED, make_cfg, make_trainer

STEPS = {"trainer": {"steps": 4, "save_every": 2, "keep_checkpoints": 3, "lr": 1e-3, "progress_bar": False}}
SAFETENSORS_ENOSPC = "Error while serializing: I/O error: No space left on device (os error 28)"
"""What safetensors 0.8 raises (a `SafetensorError`, not an OSError) when the disk fills during save_file."""


def make_checkpoint(out: Path, step: int) -> Path:
    tmp = rundir.pending_checkpoint_dir(out, step)
    (tmp / "sub").mkdir(parents=True)
    (tmp / "a.bin").write_bytes(os.urandom(1000))
    (tmp / "sub" / "b.bin").write_bytes(b"b" * 10)
    return rundir.finish_checkpoint(out, step, keep=5)


def set_files(ckpt: Path, files: dict[str, Any]) -> None:
    manifest = json.loads((ckpt / rundir.MANIFEST_FILE).read_text())
    manifest["files"] = files
    (ckpt / rundir.MANIFEST_FILE).write_text(json.dumps(manifest))


def entry(path: Path) -> dict[str, Any]:
    """A manifest entry that `path` matches (size and sha256)."""
    import hashlib

    data = path.read_bytes()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def refuse_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on, any sha256 computed by `rundir` fails the test (and nothing hashed earlier is reused)."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a file was hashed")

    monkeypatch.setattr(rundir, "hashlib", types.SimpleNamespace(sha256=refuse))
    monkeypatch.setattr(rundir, "_HASHED", {})


def test_entries_are_relative_paths_joined_with_slashes(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path, 1)
    files = json.loads((ckpt / rundir.MANIFEST_FILE).read_text())["files"]
    assert set(files) == {"a.bin", "sub/b.bin"} == set(rundir.manifest_entries(ckpt))
    assert files["a.bin"] == entry(ckpt / "a.bin") and rundir.checkpoint_problem(ckpt) is None


# ----------------------------------------------------------------------------- manifests that bypass the check


def test_an_empty_files_list_does_not_let_damaged_weights_through(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old, new = make_checkpoint(tmp_path, 1), make_checkpoint(tmp_path, 2)
    (new / "a.bin").write_bytes(bytes(1000))  # damaged, and the manifest no longer lists anything
    set_files(new, {})
    problem = rundir.checkpoint_problem(new)
    assert problem is not None and f"{new / 'a.bin'} (and 1 more): not listed in manifest.json" in problem
    with caplog.at_level(logging.WARNING):
        assert rundir.verified_checkpoint(tmp_path) == old
    assert "skipping checkpoint step_000002" in caplog.text
    # a manifest that leaves out one file (the others intact) fails the same way
    set_files(new, {"a.bin": entry(new / "a.bin")})
    assert f"{new / 'sub' / 'b.bin'}: not listed in manifest.json" in rundir.checkpoint_problem(new)
    # and so does a file added after the checkpoint was written
    (old / "extra.pt").write_bytes(b"x")
    assert f"{old / 'extra.pt'}: not listed" in rundir.checkpoint_problem(old)


@pytest.mark.parametrize("kind", ["folder", "dangling symlink", "symlink to a good manifest"])
def test_a_manifest_that_is_not_a_regular_file_is_corrupt(tmp_path: Path, kind: str) -> None:
    old, new = make_checkpoint(tmp_path, 1), make_checkpoint(tmp_path, 2)
    manifest = new / rundir.MANIFEST_FILE
    (new / "a.bin").write_bytes(bytes(1000))
    elsewhere = tmp_path / "elsewhere.json"
    if kind == "folder":
        manifest.unlink()
        manifest.mkdir()
    elif kind == "dangling symlink":
        manifest.unlink()
        manifest.symlink_to(tmp_path / "gone.json")
    else:  # a manifest that matches the damaged file, reached through a symlink
        set_files(new, {"a.bin": entry(new / "a.bin"), "sub/b.bin": entry(new / "sub" / "b.bin")})
        elsewhere.write_bytes(manifest.read_bytes())
        manifest.unlink()
        manifest.symlink_to(elsewhere)
    problem = rundir.checkpoint_problem(new)
    assert problem is not None and problem.startswith(f"{manifest}: unreadable manifest")
    assert ("a folder" if kind == "folder" else "a symlink") in problem
    assert rundir.verified_checkpoint(tmp_path) == old


def test_manifest_entries_must_be_plain_relative_paths(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path, 1)
    good = {"a.bin": entry(ckpt / "a.bin"), "sub/b.bin": entry(ckpt / "sub" / "b.bin")}
    for name, why in [
        ("", "an empty name"),
        ("/etc/passwd", "an absolute path"),
        ("sub/../a.bin", "'.' or '..' part"),
        ("./a.bin", "'.' or '..' part"),
        ("sub//b.bin", "an empty"),
        ("manifest.json", "the manifest itself"),
    ]:
        set_files(ckpt, {**good, name: {"size": 1, "sha256": "0" * 64}})
        problem = rundir.checkpoint_problem(ckpt)
        assert problem is not None and "unreadable manifest" in problem and why in problem, (name, problem)
    for bad in [{"size": "1000", "sha256": "0" * 64}, {"size": -1, "sha256": "0" * 64}, {"size": 1}, 7]:
        set_files(ckpt, {**good, "a.bin": bad})
        assert "is not {'size': bytes, 'sha256': 64 hex digits}" in rundir.checkpoint_problem(ckpt)
    a = json.dumps(good["a.bin"])
    (ckpt / rundir.MANIFEST_FILE).write_text(
        f'{{"format": "{rundir.MANIFEST_FORMAT}", "step": 1, "files": {{"a.bin": {a}, "a.bin": {a}}}}}'
    )
    assert "appears twice" in rundir.checkpoint_problem(ckpt)


def test_entries_outside_the_folder_are_refused_without_reading_or_leaking_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = make_checkpoint(tmp_path / "run", 1)
    refuse_hashing(monkeypatch)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s" * 12345)
    good = {"a.bin": entry(ckpt / "a.bin"), "sub/b.bin": entry(ckpt / "sub" / "b.bin")}
    manifest = ckpt / rundir.MANIFEST_FILE
    leaks = ("12345", "bytes", "sha256", "missing")  # nothing about the file outside
    for name in ["../../../secret.bin", str(secret), "sub/../../../../secret.bin"]:  # sizes right: 12345
        set_files(ckpt, {**good, name: {"size": 12345, "sha256": "0" * 64}})
        problem = rundir.checkpoint_problem(ckpt)
        assert problem is not None and problem.startswith(f"{manifest}: unreadable manifest"), problem
        assert not any(leak in problem for leak in leaks), problem
    # a symlink inside the folder that leads out: named as the entry, nothing said about its target
    (ckpt / "link.bin").symlink_to(secret)
    set_files(ckpt, {**good, "link.bin": {"size": 12345, "sha256": "0" * 64}})
    problem = rundir.checkpoint_problem(ckpt)
    assert problem == f"{manifest}: entry 'link.bin' leads outside the checkpoint folder (through a symlink)"
    (ckpt / "link.bin").unlink()
    (ckpt / "sub" / "b.bin").unlink()
    (ckpt / "sub").rmdir()
    (ckpt / "sub").symlink_to(tmp_path)  # a symlinked folder that leads out
    set_files(ckpt, {"a.bin": good["a.bin"], "sub/secret.bin": {"size": 12345, "sha256": "0" * 64}})
    problem = rundir.checkpoint_problem(ckpt)
    assert problem is not None and "entry 'sub/secret.bin' leads outside the checkpoint folder" in problem
    assert rundir.file_problem(ckpt, "../../../secret.bin", {"size": 12345, "sha256": "0" * 64}) == (
        f"{manifest}: entry '../../../secret.bin' is a path with an empty, '.' or '..' part (entries stay inside "
        "the checkpoint folder)"
    )


def test_a_huge_file_outside_is_never_hashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry of a 64 GiB file (sparse, size right) outside the folder: refused at once, nothing read."""
    ckpt = make_checkpoint(tmp_path / "run", 1)
    refuse_hashing(monkeypatch)
    huge = tmp_path / "huge.img"
    with open(huge, "wb") as f:
        f.truncate(64 << 30)
    good = {"a.bin": entry(ckpt / "a.bin"), "sub/b.bin": entry(ckpt / "sub" / "b.bin")}
    set_files(ckpt, {**good, str(huge): {"size": 64 << 30, "sha256": "0" * 64}})
    problem = rundir.checkpoint_problem(ckpt)
    assert problem is not None and "an absolute path" in problem and str(64 << 30) not in problem


def test_a_size_mismatch_is_found_before_any_file_is_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = make_checkpoint(tmp_path, 1)
    refuse_hashing(monkeypatch)
    (ckpt / "sub" / "b.bin").write_bytes(b"b" * 11)  # a.bin comes first and is intact: it is not hashed
    assert rundir.checkpoint_problem(ckpt) == (
        f"{ckpt / 'sub' / 'b.bin'}: 11 bytes, manifest.json says 10 (truncated or overwritten)"
    )
    assert rundir.file_problem(ckpt, "sub/b.bin", {"size": 10, "sha256": "0" * 64}) == (
        f"{ckpt / 'sub' / 'b.bin'}: 11 bytes, manifest.json says 10 (truncated or overwritten)"
    )


def test_a_fifo_or_folder_in_place_of_a_file_does_not_hang(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path, 1)
    (ckpt / "sub" / "b.bin").unlink()
    os.mkfifo(ckpt / "sub" / "b.bin")  # opening it for reading would block
    assert rundir.checkpoint_problem(ckpt) == (
        f"{ckpt / 'sub' / 'b.bin'}: a special file (FIFO, socket or device), not a regular file (listed in "
        "manifest.json as a file)"
    )
    (ckpt / "sub" / "b.bin").unlink()
    (ckpt / "sub" / "b.bin").mkdir()
    assert "b.bin: a folder, not a file" in rundir.checkpoint_problem(ckpt)


# ----------------------------------------------------------------------------- checkpoint folder names


def test_only_exact_step_names_are_checkpoints_and_others_are_never_rotated(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 2)
    four = make_checkpoint(tmp_path, 4)
    root = tmp_path / rundir.CHECKPOINTS_DIR
    for name in ("step_000004.bak", "step_4", "step_0000004", "step_00000x"):
        shutil.copytree(four, root / name)
    (root / "step_000009").symlink_to(four)  # a symlink is not a checkpoint (rotation cannot remove it)
    assert rundir.checkpoints(tmp_path) == [rundir.checkpoint_dir(tmp_path, 2), four]
    assert rundir.latest_checkpoint(tmp_path) == four == rundir.verified_checkpoint(tmp_path)
    assert rundir.checkpoint_step(four) == 4
    with pytest.raises(CheckpointError, match=r"step_000004\.bak: not a checkpoint folder name"):
        rundir.checkpoint_step(root / "step_000004.bak")
    tmp = rundir.pending_checkpoint_dir(tmp_path, 10)
    tmp.mkdir()
    (tmp / "a.bin").write_bytes(b"a")
    rundir.finish_checkpoint(tmp_path, 10, keep=1)  # rotates step_000002 and step_000004 away, nothing else
    assert {p.name for p in root.iterdir()} == {
        "step_000004.bak",
        "step_4",
        "step_0000004",
        "step_00000x",
        "step_000009",
        "step_000010",
    }
    assert rundir.checkpoints(tmp_path) == [rundir.checkpoint_dir(tmp_path, 10)]


# ----------------------------------------------------------------------------- a full disk


def test_a_safetensors_write_error_names_the_file_and_the_space_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1536))
    target = tmp_path / "ckpt" / "trainable.safetensors"
    with pytest.raises(RunWriteError) as err, rundir.writing(target):
        raise SafetensorError(SAFETENSORS_ENOSPC)
    assert str(err.value) == (
        f"could not write {target}: {SAFETENSORS_ENOSPC}; 1.5 KiB left on the filesystem of {tmp_path} (free "
        "space there to continue)"
    )
    assert err.value.cause_errno == errno.ENOSPC and isinstance(err.value, MmalignError)
    with pytest.raises(RunWriteError, match=r"\[Errno 28\] .*; 1\.5 KiB left on the filesystem of"):
        with rundir.writing(tmp_path / "x"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with (
        pytest.raises(RunWriteError) as err,
        rundir.writing(tmp_path / "x"),
    ):  # not a full disk: no free space
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    assert str(err.value) == f"could not write {tmp_path / 'x'}: [Errno 13] Permission denied"
    with pytest.raises(SafetensorError, match="shared"), rundir.writing(target):  # not an I/O error: a bug
        raise SafetensorError("tensors are shared")
    assert rundir.format_bytes(0) == "0 B" and rundir.format_bytes(3 << 30) == "3.0 GiB"


def test_enospc_in_the_weights_of_a_checkpoint_is_a_clean_error(
    random_text_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors.torch

    out = tmp_path / "run"
    trainer = make_trainer(make_cfg(random_text_model_dir, out, rewards=VARIED, **STEPS))
    real_save_file = safetensors.torch.save_file

    def save_file(tensors: Any, filename: str, *args: Any, **kwargs: Any) -> None:
        if trainer.step == 4:
            raise SafetensorError(SAFETENSORS_ENOSPC)
        real_save_file(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, 1 << 30, 0))
    with pytest.raises(TrainingError) as err:
        trainer.train()
    msg = str(err.value)
    pending = rundir.pending_checkpoint_dir(out, 4)
    assert f"training stopped after step 4: could not write {pending / rundir.TRAINABLE_FILE}: " in msg
    assert "No space left on device (os error 28); 0 B left on the filesystem of" in msg
    assert (
        f"the last complete checkpoint: {out / 'checkpoints' / 'step_000002'} (continue with --resume)" in msg
    )
    assert isinstance(err.value.__cause__, RunWriteError) and not pending.exists()


class FullDisk(io.RawIOBase):
    """A file whose writes fail with ENOSPC while `full()` (a disk that fills up)."""

    def __init__(self, real: Any, full: Any) -> None:
        self.real, self.full = real, full

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        if self.full():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.real.write(b)

    def fileno(self) -> int:
        return self.real.fileno()

    @property
    def name(self) -> str:
        return self.real.name

    def close(self) -> None:
        self.real.close()
        super().close()


def test_enospc_while_appending_metrics_names_the_file_and_the_last_checkpoint(
    random_text_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The append fails in the flush (data left in the buffer): the error that ends the run is the one that
    names the file, not a bare ``[Errno 28]`` from closing the file."""
    out = tmp_path / "run"
    trainer = make_trainer(make_cfg(random_text_model_dir, out, rewards=VARIED, **STEPS))
    real_open = Path.open

    def open_(self: Path, mode: str = "r", buffering: int = -1, *args: Any, **kwargs: Any) -> Any:
        if self.name != rundir.METRICS_FILE or "a" not in mode:
            return real_open(self, mode, buffering, *args, **kwargs)
        raw = FullDisk(real_open(self, "ab", buffering=0), lambda: trainer.step >= 3)
        if "b" in mode and buffering == 0:
            return raw
        buffered = io.BufferedWriter(raw)
        return buffered if "b" in mode else io.TextIOWrapper(buffered, encoding="utf-8")

    monkeypatch.setattr(Path, "open", open_)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, 1 << 30, 0))
    with pytest.raises(TrainingError) as err:
        trainer.train()
    msg = str(err.value)
    assert f"training stopped after step 3: could not write {out / rundir.METRICS_FILE}: [Errno 28]" in msg
    assert f"0 B left on the filesystem of {out}" in msg
    assert f"the last complete checkpoint: {out / 'checkpoints' / 'step_000002'}" in msg


# ----------------------------------------------------------------------------- through the trainer


def test_resume_skips_a_checkpoint_with_an_emptied_manifest_and_ignores_copies(
    random_text_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from safetensors.torch import load_file, save_file

    out = tmp_path / "run"
    make_trainer(make_cfg(random_text_model_dir, out, rewards=VARIED, **STEPS)).train()
    ckpt = out / "checkpoints" / "step_000004"
    shutil.copytree(out / "checkpoints" / "step_000002", out / "checkpoints" / "step_000002.bak")
    weights = load_file(str(ckpt / rundir.TRAINABLE_FILE))
    for v in weights.values():
        v.add_(1.0)  # finite, loadable, and wrong
    save_file(weights, str(ckpt / rundir.TRAINABLE_FILE))
    set_files(ckpt, {})
    keep_one = {"trainer": {**STEPS["trainer"], "keep_checkpoints": 1}}
    with caplog.at_level(logging.WARNING):
        trainer = make_trainer(make_cfg(random_text_model_dir, out, rewards=VARIED, **keep_one), resume=True)
    assert trainer.step == 2
    assert "skipping checkpoint step_000004" in caplog.text and "not listed in manifest.json" in caplog.text
    trainer.train()  # writes step 4 again and rotates step 2 away: the copy is neither loaded nor removed
    assert rundir.checkpoints(out) == [ckpt] and rundir.checkpoint_problem(ckpt) is None
    assert (out / "checkpoints" / "step_000002.bak" / rundir.TRAINABLE_FILE).is_file()
