"""mmalign.training.rundir: atomic rewrites (a kill inside one leaves the history), torn metrics lines, pickle-free state
files, checkpoint manifests."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from mmalign.errors import CheckpointError, MetricsError, MmalignError, RunWriteError
from mmalign.training import rundir

REPO = Path(__file__).resolve().parents[2]


def write_rows(out: Path, steps: range, tail: str = "") -> list[dict]:
    rows = [{"step": s, "loss": s / 10, "note": "x" * 50} for s in steps]
    out.mkdir(parents=True, exist_ok=True)
    (out / rundir.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return rows


# ----------------------------------------------------------------------------- metrics


def test_torn_last_line_is_dropped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rows = write_rows(tmp_path, range(1, 4), tail='{"step": 4, "loss": 0.')
    with caplog.at_level(logging.WARNING):
        assert rundir.read_metrics(tmp_path) == rows
    assert "dropped its last line 4" in caplog.text and "metrics.jsonl" in caplog.text
    rundir.truncate_metrics(tmp_path, 2)
    assert rundir.read_metrics(tmp_path) == rows[:2]
    assert (tmp_path / rundir.METRICS_FILE).read_text().endswith("}\n")


def test_torn_line_elsewhere_names_file_and_line(tmp_path: Path) -> None:
    write_rows(tmp_path, range(1, 3))
    with (tmp_path / rundir.METRICS_FILE).open("a") as f:
        f.write('{"step": 3, "lo\n{"step": 4}\n')
    with pytest.raises(MetricsError, match=r"metrics\.jsonl: line 3 is not a metrics row") as err:
        rundir.truncate_metrics(tmp_path, 10)
    assert isinstance(err.value, MmalignError)


def test_truncate_is_atomic_and_leaves_no_temp_file(tmp_path: Path) -> None:
    rows = write_rows(tmp_path, range(1, 6))
    rundir.truncate_metrics(tmp_path, 3)
    assert rundir.read_metrics(tmp_path) == rows[:3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [rundir.METRICS_FILE]


KILL_BETWEEN_WRITE_AND_REPLACE = """
import os, signal, sys
from mmalign.training import rundir

def die(*args, **kwargs):  # the new file is written and fsynced; the kill comes before it replaces the old
    os.kill(os.getpid(), signal.SIGKILL)

os.replace = die
rundir.truncate_metrics(sys.argv[1], 3)
"""


def test_kill_inside_the_metrics_rewrite_keeps_the_history(tmp_path: Path) -> None:
    rows = write_rows(tmp_path, range(1, 9))
    proc = subprocess.run(
        [sys.executable, "-c", KILL_BETWEEN_WRITE_AND_REPLACE, str(tmp_path)], cwd=REPO, capture_output=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert rundir.read_metrics(tmp_path) == rows  # the whole history, not the truncated or an empty file
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != rundir.METRICS_FILE]
    assert all(name.startswith(".metrics.jsonl.tmp-") for name in leftovers)
    rundir.truncate_metrics(tmp_path, 3)  # the next resume succeeds
    assert rundir.read_metrics(tmp_path) == rows[:3]


def test_kill_while_truncating_a_large_file_keeps_the_history(tmp_path: Path) -> None:
    """The process is killed at a random moment of a long rewrite (no monkeypatching): old or new file."""
    rows = write_rows(tmp_path, range(1, 200_001))
    size = (tmp_path / rundir.METRICS_FILE).stat().st_size
    code = "import sys; from mmalign.training import rundir; print('go', flush=True); rundir.truncate_metrics(sys.argv[1], 100000)"
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"go\n"
    time.sleep(0.5)  # inside the parse or the write of the 20 MB file
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = rundir.read_metrics(tmp_path)
    assert kept in (rows, rows[:100000]), (len(kept), size)


def test_write_atomic_names_the_path_on_enospc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "config.yaml"
    target.write_text("old")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(
        RunWriteError, match=r"could not write .*config\.yaml: \[Errno 28\] No space left"
    ) as err:
        rundir.write_atomic(target, "new")
    assert isinstance(err.value, MmalignError) and isinstance(err.value, OSError)
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


# ----------------------------------------------------------------------------- state files


def test_state_round_trips_without_pickle(tmp_path: Path) -> None:
    np.random.seed(3)
    np.random.rand(5)
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "nested": OrderedDict(a=[1, (2.5, float("nan")), {3: None}], b={"s"}),
        "frozen": frozenset({1, 2}),
        "scalars": [np.float64(1.5), np.int32(-4), np.bool_(True)],
        "arrays": [np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros((0,), dtype=np.int64)],
        "bytes": b"\x00\x01",
        "dtype": torch.bfloat16,
    }
    path = rundir.save_state(state, tmp_path / "s.pt")
    back = rundir.load_state(path)
    assert back["python"] == state["python"] and isinstance(back["python"], tuple)
    random.setstate(back["python"])
    np.random.set_state(back["numpy"])
    assert np.random.rand() == (np.random.seed(3), np.random.rand(5), np.random.rand())[2]
    assert torch.equal(back["torch"], state["torch"])
    assert type(back["nested"]) is OrderedDict and back["nested"]["a"][2] == {3: None}
    assert np.isnan(back["nested"]["a"][1][1]) and back["nested"]["b"] == {"s"}
    assert back["frozen"] == frozenset({1, 2}) and type(back["frozen"]) is frozenset
    assert [type(x) for x in back["scalars"]] == [np.float64, np.int32, np.bool_]
    assert back["scalars"] == state["scalars"]
    for got, want in zip(back["arrays"], state["arrays"], strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    assert back["bytes"] == b"\x00\x01" and back["dtype"] is torch.bfloat16


class Opaque:
    pass


def test_state_that_needs_pickle_is_refused_when_saved(tmp_path: Path) -> None:
    with pytest.raises(
        TypeError, match=r"s\.pt\['cb'\]\[0\].*Opaque cannot be saved in a checkpoint without pickle"
    ):
        rundir.save_state({"cb": [Opaque()]}, tmp_path / "s.pt")


def test_pickled_objects_are_not_loaded(tmp_path: Path) -> None:
    torch.save({"x": Opaque()}, tmp_path / "old.pt")  # what a pickle-based writer made
    with pytest.raises(CheckpointError, match=r"old\.pt: holds objects that only full unpickling could load"):
        rundir.load_state(tmp_path / "old.pt", legacy=True)
    (tmp_path / "short.pt").write_bytes(rundir.save_state({"a": 1}, tmp_path / "ok.pt").read_bytes()[:40])
    with pytest.raises(CheckpointError, match=r"short\.pt: unreadable"):
        rundir.load_state(tmp_path / "short.pt")


def test_legacy_numpy_rng_state_loads(tmp_path: Path) -> None:
    """rng_<rank>.pt of a checkpoint written before this format: NumPy's state pickled as an array."""
    torch.save({"numpy": np.random.get_state()}, tmp_path / "rng_0.pt")
    with pytest.raises(CheckpointError):
        rundir.load_state(tmp_path / "rng_0.pt")  # a new checkpoint never needs it
    back = rundir.load_state(tmp_path / "rng_0.pt", legacy=True)
    np.random.set_state(back["numpy"])


# ----------------------------------------------------------------------------- manifests


def make_checkpoint(out: Path, step: int) -> Path:
    tmp = rundir.pending_checkpoint_dir(out, step)
    (tmp / "sub").mkdir(parents=True)
    (tmp / "a.bin").write_bytes(os.urandom(1000))
    (tmp / "sub" / "b.bin").write_bytes(b"b" * 10)
    return rundir.finish_checkpoint(out, step, keep=5)


def test_manifest_lists_every_file_and_catches_damage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old, new = make_checkpoint(tmp_path, 1), make_checkpoint(tmp_path, 2)
    manifest = json.loads((new / rundir.MANIFEST_FILE).read_text())
    assert manifest["format"] == rundir.MANIFEST_FORMAT and manifest["step"] == 2
    assert set(manifest["files"]) == {"a.bin", "sub/b.bin"}
    assert manifest["files"]["sub/b.bin"]["size"] == 10 and len(manifest["files"]["a.bin"]["sha256"]) == 64
    assert rundir.checkpoint_problem(new) is None

    data = bytearray((new / "a.bin").read_bytes())
    data[100:200] = bytes(100)
    (new / "a.bin").write_bytes(bytes(data))
    assert "a.bin: sha256 differs" in rundir.checkpoint_problem(new)
    with caplog.at_level(logging.WARNING):
        assert rundir.verified_checkpoint(tmp_path) == old
    assert "skipping checkpoint step_000002" in caplog.text and "a.bin: sha256 differs" in caplog.text

    (old / "sub" / "b.bin").write_bytes(b"b" * 5)
    with pytest.raises(CheckpointError, match=r"step_000002: .*a\.bin.*\n  step_000001: .*b\.bin: 5 bytes"):
        rundir.verified_checkpoint(tmp_path)
    (old / "sub" / "b.bin").unlink()
    assert "b.bin: missing" in rundir.checkpoint_problem(old)


def test_checkpoint_without_manifest_is_accepted_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = make_checkpoint(tmp_path, 1)
    (ckpt / rundir.MANIFEST_FILE).unlink()
    with caplog.at_level(logging.WARNING):
        assert rundir.verified_checkpoint(tmp_path) == ckpt
    assert "no manifest.json (written by an older version" in caplog.text
    (ckpt / rundir.MANIFEST_FILE).write_text("{not json")
    assert "unreadable manifest" in rundir.checkpoint_problem(ckpt)


def test_a_checkpoint_removed_after_it_was_listed_is_not_taken_for_an_old_one(tmp_path: Path) -> None:
    """A run still training rotates a listed checkpoint away while a reader verifies it: without its manifest (or
    its whole folder) it is a problem, not "written by an older version" (a reader then falls back, or says so)."""
    ckpt = make_checkpoint(tmp_path, 1)
    (ckpt / rundir.MANIFEST_FILE).unlink()
    assert rundir.checkpoint_problem(ckpt) is None  # an old checkpoint: complete, no manifest
    (ckpt / rundir.COMPLETE_MARK).unlink()  # rmtree half-way
    assert "removed while it was being read" in rundir.checkpoint_problem(ckpt)
    shutil.rmtree(ckpt)
    assert "removed while it was being read" in rundir.checkpoint_problem(ckpt)


def test_a_half_written_checkpoint_is_never_taken(tmp_path: Path) -> None:
    """A kill inside a checkpoint write leaves ``.tmp_step_N/`` or a folder without ``COMPLETE``: neither counts."""
    done = rundir.pending_checkpoint_dir(tmp_path, 2)
    done.mkdir(parents=True)
    (done / "trainable.safetensors").write_bytes(b"x")
    rundir.finish_checkpoint(tmp_path, 2, keep=5)
    half = rundir.pending_checkpoint_dir(tmp_path, 4)  # killed before the rename
    half.mkdir()
    (half / "trainable.safetensors").write_bytes(b"y")
    unmarked = rundir.checkpoint_dir(tmp_path, 6)  # renamed by hand, never marked complete
    unmarked.mkdir()
    (unmarked / "trainable.safetensors").write_bytes(b"z")
    assert rundir.checkpoints(tmp_path) == [rundir.checkpoint_dir(tmp_path, 2)]
    assert rundir.verified_checkpoint(tmp_path) == rundir.checkpoint_dir(tmp_path, 2)
