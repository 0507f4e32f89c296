"""The tester's probes of issue 23 on the tiny text model: damaged checkpoints are named and skipped for the
newest one that verifies, torn metrics survive, nothing is unpickled, NaN stops point at a checkpoint written
before the NaN, a full disk names the file and the last complete checkpoint."""

from __future__ import annotations

import ast
import errno
import logging
import math
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from mmalign.app.evaluation import load_weights, resolve_checkpoint
from mmalign.config import ConfigError
from mmalign.errors import CheckpointError, MmalignError, RunWriteError
from mmalign.training import rundir
from mmalign.training.trainer import NonFiniteError, TrainingError
from rewards import Reward, RewardBatch
from tests.training.test_trainer import VARIED, make_cfg, make_trainer, read_metrics, strip_time

REPO = Path(__file__).resolve().parents[2]
STEPS = {"trainer": {"steps": 4, "save_every": 2, "keep_checkpoints": 3, "lr": 1e-3, "progress_bar": False}}


@pytest.fixture(scope="module")
def full_run(random_text_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The uninterrupted run's metrics (4 steps)."""
    out = tmp_path_factory.mktemp("full") / "run"
    make_trainer(make_cfg(random_text_model_dir, out, rewards=VARIED, **STEPS)).train()
    return read_metrics(out)


def run_four(model: Path, out: Path) -> Path:
    make_trainer(make_cfg(model, out, rewards=VARIED, **STEPS)).train()
    assert [p.name for p in rundir.checkpoints(out)] == ["step_000002", "step_000004"]
    return out


def resume(model: Path, out: Path):
    return make_trainer(make_cfg(model, out, rewards=VARIED, **STEPS), resume=True)


def zero_inside(path: Path, n: int = 64 * 1024) -> None:
    data = bytearray(path.read_bytes())
    n = min(n, len(data) // 2)
    start = (len(data) - n) // 2
    data[start : start + n] = bytes(n)
    path.write_bytes(bytes(data))


def test_corrupted_weights_are_skipped_for_the_older_checkpoint(
    random_text_model_dir: Path, tmp_path: Path, full_run: list[dict], caplog: pytest.LogCaptureFixture
) -> None:
    out = run_four(random_text_model_dir, tmp_path / "run")
    zero_inside(out / "checkpoints" / "step_000004" / rundir.TRAINABLE_FILE)
    with caplog.at_level(logging.WARNING):
        trainer = resume(random_text_model_dir, out)
    assert trainer.step == 2
    assert "skipping checkpoint step_000004" in caplog.text
    assert "trainable.safetensors: sha256 differs from manifest.json (the file is corrupted)" in caplog.text
    assert "using checkpoint" in caplog.text and "step_000002" in caplog.text
    trainer.train()
    assert [strip_time(m) for m in read_metrics(out)] == [strip_time(m) for m in full_run]  # exact resume


def test_truncated_file_is_named(
    random_text_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = run_four(random_text_model_dir, tmp_path / "run")
    opt = out / "checkpoints" / "step_000004" / rundir.OPTIMIZER_FILE
    opt.write_bytes(opt.read_bytes()[:1000])
    with caplog.at_level(logging.WARNING):
        assert resume(random_text_model_dir, out).step == 2
    assert f"{opt}: 1000 bytes, manifest.json says" in caplog.text
    # both damaged: the error names each file and why
    weights = out / "checkpoints" / "step_000002" / rundir.TRAINABLE_FILE
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError) as err:
        resume(random_text_model_dir, out)
    msg = str(err.value)
    assert "no usable checkpoint" in msg and f"{opt}: 1000 bytes" in msg and f"{weights}: 100 bytes" in msg


def test_old_checkpoint_without_manifest(
    random_text_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Written before manifests (pickle-era .pt files, NumPy state as an array): loaded with a warning; a
    truncated file in it is named when loading fails, and the older one is used."""
    import numpy as np

    out = run_four(random_text_model_dir, tmp_path / "run")
    for step in (2, 4):
        ckpt = out / "checkpoints" / f"step_{step:06d}"
        (ckpt / rundir.MANIFEST_FILE).unlink()
        rng = rundir.load_state(ckpt / "rng_0.pt")
        assert isinstance(rng["rng"]["numpy"][1], np.ndarray)
        torch.save(rng, ckpt / "rng_0.pt")  # as torch.save wrote it before: the array pickled
    with caplog.at_level(logging.WARNING):
        assert resume(random_text_model_dir, out).step == 4
    assert "has no manifest.json (written by an older version of mmalign)" in caplog.text
    weights = out / "checkpoints" / "step_000004" / rundir.TRAINABLE_FILE
    weights.write_bytes(weights.read_bytes()[:-10])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert resume(random_text_model_dir, out).step == 2
    assert f"skipping checkpoint step_000004: {weights}: unreadable" in caplog.text


def test_torn_metrics_line_resumes_with_a_warning(
    random_text_model_dir: Path, tmp_path: Path, full_run: list[dict], caplog: pytest.LogCaptureFixture
) -> None:
    out = run_four(random_text_model_dir, tmp_path / "run")
    metrics = out / rundir.METRICS_FILE
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:3]) + "\n" + lines[3][:300])  # killed while writing step 4's row,
    import shutil

    shutil.rmtree(out / "checkpoints" / "step_000004")  # before step 4's checkpoint
    with caplog.at_level(logging.WARNING):
        trainer = resume(random_text_model_dir, out)
    assert trainer.step == 2 and "dropped its last line 4" in caplog.text
    trainer.train()
    assert [strip_time(m) for m in read_metrics(out)] == [strip_time(m) for m in full_run]


# ----------------------------------------------------------------------------- no pickle


def test_no_pickle_load_in_the_package() -> None:
    """Every torch.load in mmalign/ passes weights_only=True; nothing calls pickle's loaders."""
    calls = []
    for path in sorted((REPO / "mmalign").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            if name.endswith("torch.load") or name == "load" and "torch" in where:
                calls.append(where)
                kw = {k.arg: k.value for k in node.keywords}
                ok = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
                assert ok, f"{where}: torch.load without weights_only=True"
            assert name not in ("pickle.load", "pickle.loads", "pickle.Unpickler", "dill.load"), where
    assert calls  # the state files are read with torch.load


def test_resume_and_sample_unpickle_nothing(
    random_text_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = run_four(random_text_model_dir, tmp_path / "run")
    seen = []
    real_load = torch.load

    def spy(*args, **kwargs):
        seen.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    def no_pickle(*args, **kwargs):
        raise AssertionError("pickle used while loading a checkpoint")

    monkeypatch.setattr(torch, "load", spy)
    monkeypatch.setattr(pickle, "Unpickler", no_pickle)
    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    trainer = resume(random_text_model_dir, out)
    assert trainer.step == 4 and seen and all(w is True for w in seen)
    ckpt = resolve_checkpoint(out, "latest")  # mmalign sample/eval --checkpoint latest
    assert ckpt == out / "checkpoints" / "step_000004"
    load_weights(trainer.policy, ckpt)


def test_sample_checkpoint_is_verified(
    random_text_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = run_four(random_text_model_dir, tmp_path / "run")
    newest = out / "checkpoints" / "step_000004"
    zero_inside(newest / rundir.TRAINABLE_FILE)
    with caplog.at_level(logging.WARNING):
        assert resolve_checkpoint(out, "latest") == out / "checkpoints" / "step_000002"
        assert resolve_checkpoint(str(out), str(out)) == out / "checkpoints" / "step_000002"
    assert "skipping checkpoint step_000004" in caplog.text
    with pytest.raises(
        CheckpointError, match=r"step_000004 fails verification: .*trainable\.safetensors: sha256"
    ):
        resolve_checkpoint(out, str(newest))
    trainer = resume(random_text_model_dir, out)
    with pytest.raises(CheckpointError, match=r"trainable\.safetensors: sha256"):
        load_weights(trainer.policy, newest)


# ----------------------------------------------------------------------------- NaN


class AlwaysNaN(Reward):
    def __call__(self, batch: RewardBatch) -> list[float]:
        return [float("nan")] * len(batch)


def test_all_nan_reward_stops_the_run(random_text_model_dir: Path, tmp_path: Path) -> None:
    rewards = [*VARIED, {"name": f"{__name__}:AlwaysNaN", "alias": "broken"}]
    cfg = make_cfg(
        random_text_model_dir, tmp_path / "run", rewards=rewards, trainer={"steps": 6, "save_every": 1}
    )
    with pytest.raises(TrainingError) as err:
        make_trainer(cfg).train()
    msg = str(err.value)
    assert "training stopped at step 3" in msg
    assert "reward 'broken' was NaN for every sample in 3 consecutive steps (1..3)" in msg
    assert "trainer.nan_reward_steps=3" in msg
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]

    only = [{"name": f"{__name__}:AlwaysNaN", "alias": "broken"}]
    cfg = make_cfg(
        random_text_model_dir, tmp_path / "off", rewards=only, trainer={"steps": 3, "nan_reward_steps": 0}
    )
    assert len(make_trainer(cfg).train()) == 3  # 0: never stops


def test_nan_counter_survives_resume(random_text_model_dir: Path, tmp_path: Path) -> None:
    rewards = [*VARIED, {"name": f"{__name__}:AlwaysNaN", "alias": "broken"}]
    opts = {"steps": 2, "save_every": 2, "nan_reward_steps": 4}
    make_trainer(make_cfg(random_text_model_dir, tmp_path / "run", rewards=rewards, trainer=opts)).train()
    trainer = make_trainer(
        make_cfg(random_text_model_dir, tmp_path / "run", rewards=rewards, trainer={**opts, "steps": 9}),
        resume=True,
    )
    with pytest.raises(TrainingError, match=r"in 4 consecutive steps \(1\.\.4\)"):
        trainer.train()


def test_nan_loss_points_at_the_checkpoint_before_it(random_text_model_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(
        random_text_model_dir, tmp_path / "run", rewards=VARIED, trainer={"steps": 6, "save_every": 2}
    )
    trainer = make_trainer(cfg)
    update = trainer.update
    trainer.update = lambda batch: (
        {**update(batch), "loss": float("nan")} if trainer.step == 4 else update(batch)
    )
    with pytest.raises(NonFiniteError) as err:
        trainer.train()
    msg = str(err.value)
    assert "training stopped at step 5: the update's loss is nan" in msg
    assert (
        f"the last checkpoint written before the NaN: {tmp_path / 'run' / 'checkpoints' / 'step_000004'}"
        in msg
    )
    assert "(continue with --resume)" not in msg and "meets the same NaN at step 5" in msg


def test_nan_weights_are_never_checkpointed(random_text_model_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(
        random_text_model_dir, tmp_path / "run", rewards=VARIED, trainer={"steps": 6, "save_every": 2}
    )
    trainer = make_trainer(cfg)

    class Poison:
        def on_step_end(self, trainer, step, metrics):
            if step == 4:
                with torch.no_grad():
                    next(iter(trainer.policy.trainable_parameters())).fill_(float("nan"))

    trainer.callbacks.append(Poison())
    with pytest.raises(NonFiniteError) as err:
        trainer.train()
    msg = str(err.value)
    assert "training stopped after step 4: the weights after step 4 hold NaN/inf" in msg
    assert "step_000002" in msg and [p.name for p in rundir.checkpoints(tmp_path / "run")] == ["step_000002"]
    assert not rundir.pending_checkpoint_dir(tmp_path / "run", 4).exists()


def test_checkpoint_with_nan_weights_is_skipped(
    random_text_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint of an older version holding NaN weights (no manifest to fail): skipped when loaded."""
    from safetensors.torch import load_file, save_file

    out = run_four(random_text_model_dir, tmp_path / "run")
    ckpt = out / "checkpoints" / "step_000004"
    weights = load_file(str(ckpt / rundir.TRAINABLE_FILE))
    next(iter(weights.values())).fill_(float("nan"))
    save_file(weights, str(ckpt / rundir.TRAINABLE_FILE))
    (ckpt / rundir.MANIFEST_FILE).unlink()
    with caplog.at_level(logging.WARNING):
        assert resume(random_text_model_dir, out).step == 2
    assert "trainable.safetensors: the weights hold NaN/inf" in caplog.text


# ----------------------------------------------------------------------------- full disk


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_enospc_in_a_checkpoint_names_the_file_and_the_last_checkpoint(
    random_text_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    trainer = make_trainer(make_cfg(random_text_model_dir, out, rewards=VARIED, **STEPS))
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if trainer.step == 4 and Path(path).name == rundir.OPTIMIZER_FILE:
            enospc()
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(TrainingError) as err:
        trainer.train()
    msg = str(err.value)
    pending = rundir.pending_checkpoint_dir(out, 4)
    assert f"training stopped after step 4: could not write {pending / rundir.OPTIMIZER_FILE}" in msg
    assert "[Errno 28] No space left on device" in msg
    assert (
        f"the last complete checkpoint: {out / 'checkpoints' / 'step_000002'} (continue with --resume)" in msg
    )
    assert isinstance(err.value, MmalignError) and isinstance(err.value.__cause__, RunWriteError)
    assert not pending.exists() and rundir.checkpoint_problem(out / "checkpoints" / "step_000002") is None
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]


def test_a_bad_row_says_fix_the_row_not_resume_blindly(
    random_text_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row that fails while a step reads it (an image that does not decode) stops the run naming the row;
    the advice is to fix or skip that row first, since --resume alone would read the same row again."""
    from mmalign.data.rows import DataError

    out = tmp_path / "run"
    trainer = make_trainer(make_cfg(random_text_model_dir, out, rewards=VARIED, **STEPS))
    real = trainer.make_rollout

    def make_rollout():
        if trainer.step == 2:  # steps 1 and 2 are done: step 3 reads the bad row
            raise DataError("data.jsonl:5: image 'a.png' does not decode (image file is truncated)")
        return real()

    monkeypatch.setattr(trainer, "make_rollout", make_rollout)
    with pytest.raises(TrainingError) as err:
        trainer.train()
    msg = str(err.value)
    assert "training stopped at step 3: data.jsonl:5: image 'a.png' does not decode" in msg
    assert f"the last complete checkpoint: {out / 'checkpoints' / 'step_000002'}" in msg
    assert "fix or remove that row (or set options.on_bad_row: skip), then continue with --resume" in msg
    assert "(continue with --resume)" not in msg


def test_enospc_in_samples_and_metrics(
    random_text_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    trainer = make_trainer(make_cfg(random_text_model_dir, out, rewards=VARIED, **STEPS))
    monkeypatch.setattr(os, "replace", enospc)  # the samples file of step 1 is written atomically
    with pytest.raises(TrainingError) as err:
        trainer.train()
    assert (
        f"training stopped after step 1: could not write {out / 'samples' / 'step_000001.jsonl'}: [Errno 28]"
        in str(err.value)
    )
    assert "no checkpoint yet" in str(err.value)
    monkeypatch.undo()

    out2 = tmp_path / "run2"
    trainer = make_trainer(make_cfg(random_text_model_dir, out2, rewards=VARIED, **STEPS))
    real_fsync = os.fsync
    metrics_fd: list[int] = []
    real_open = Path.open

    def track_open(self, *args, **kwargs):
        f = real_open(self, *args, **kwargs)
        if self.name == rundir.METRICS_FILE and args[:1] == ("a",):
            metrics_fd.append(f.fileno())
        return f

    def fsync(fd):
        if fd in metrics_fd and trainer.step == 3:
            enospc()
        return real_fsync(fd)

    monkeypatch.setattr(Path, "open", track_open)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(TrainingError) as err:
        trainer.train()
    msg = str(err.value)
    assert f"could not write {out2 / rundir.METRICS_FILE}: [Errno 28]" in msg
    assert f"the last complete checkpoint: {out2 / 'checkpoints' / 'step_000002'}" in msg


# ----------------------------------------------------------------------------- resume with a changed config


def test_resume_trains_at_a_changed_lr_and_schedule(random_text_model_dir: Path, tmp_path: Path) -> None:
    """Issue 33 item 4: the restored optimizer and scheduler held the saved learning rate, so a changed
    trainer.lr was written into config.yaml but not trained with. Now the new rate and schedule apply from the
    step the run resumes at."""
    out = tmp_path / "run"
    saved = {"steps": 2, "save_every": 2, "lr": 1e-3, "progress_bar": False}
    make_trainer(make_cfg(random_text_model_dir, out, rewards=VARIED, trainer=saved)).train()
    assert [m["lr"] for m in read_metrics(out)] == [1e-3, 1e-3]

    changed = {**saved, "steps": 4, "lr": 3e-3, "lr_scheduler": "cosine"}
    trainer = make_trainer(make_cfg(random_text_model_dir, out, rewards=VARIED, trainer=changed), resume=True)
    assert trainer.step == 2 and trainer.resumed_from == out / "checkpoints" / "step_000002"
    assert [(c.key, c.old, c.new) for c in trainer.config_changes] == [
        ("trainer.steps", 2, 4),
        ("trainer.lr", 1e-3, 3e-3),
        ("trainer.lr_scheduler", "constant", "cosine"),
    ]
    assert all(c.how for c in trainer.config_changes)
    # cosine over 4 steps at step 2: 3e-3 * 0.5 * (1 + cos(pi * 2 / 4)) = 1.5e-3 for step 3 (was 1e-3)
    group = trainer.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(1.5e-3) and group["initial_lr"] == 3e-3
    assert trainer.scheduler.base_lrs == [3e-3]
    trainer.train()
    # each row's lr is the rate after its step (the next step's): cos at steps 3 and 4 of 4
    lrs = [m["lr"] for m in read_metrics(out)]
    assert lrs[:2] == [1e-3, 1e-3]
    assert lrs[2] == pytest.approx(3e-3 * 0.5 * (1 + math.cos(math.pi * 3 / 4)))
    assert lrs[3] == pytest.approx(0.0, abs=1e-12)
    assert "lr: 0.003" in (out / rundir.CONFIG_FILE).read_text()


def test_resume_refuses_a_change_it_cannot_apply(random_text_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    saved = {"steps": 2, "save_every": 2, "progress_bar": False}
    make_trainer(make_cfg(random_text_model_dir, out, rewards=VARIED, trainer=saved)).train()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    cfg = make_cfg(
        random_text_model_dir,
        out,
        rewards=VARIED,
        seed=1,
        rollout={"group_size": 2},
        trainer={**saved, "steps": 4},
    )
    with pytest.raises(ConfigError) as err:
        make_trainer(cfg, resume=True)
    msg = str(err.value)
    assert msg.startswith("--resume: seed: 0 -> 1; rollout.group_size: 4 -> 2 (the run's ")
    assert (
        "these keys cannot change when a run is resumed" in msg and "trainer.steps" not in msg.split("(")[0]
    )
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # config.yaml kept


def test_config_changes_against_an_older_saved_config(tmp_path: Path) -> None:
    """A key the saved config.yaml lacks (written before the key existed) is no change when it holds its
    default; a reward list of another length is one change of the whole list."""
    import yaml

    from mmalign.training.resume import ABSENT, config_changes, resume_rule

    cfg = make_cfg(tmp_path / "model", tmp_path / "run", rewards=VARIED)
    saved = yaml.safe_load(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    assert config_changes(saved, cfg) == []
    del saved["trainer"]["tracker_media"], saved["model"]["lora"]
    assert config_changes(saved, cfg) == []
    saved["trainer"].pop("lr")
    saved["rewards"] = saved["rewards"][:1]
    changes = {c.key: (c.old, c.new) for c in config_changes(saved, cfg)}
    assert changes.keys() == {"trainer.lr", "rewards"}
    assert changes["trainer.lr"] == (ABSENT, 3e-4)
    assert resume_rule("eval.rewards[0].weight") and resume_rule("trainer.tracker_kwargs.wandb.mode")
    assert resume_rule("rewards") is None and resume_rule("trainer.lr_schedulers") is None
