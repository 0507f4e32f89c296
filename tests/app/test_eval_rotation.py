"""Issue 33 (item 10): `mmalign eval` racing a run that rotates its checkpoints away. The checkpoint resolved
before the base half can be gone when its weights are loaded: the newest checkpoint that verifies is taken
instead (once, with a warning), and a trained half that fails keeps the base half in the report file."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import accelerate.utils
import pytest
import torch

import pipelines
from mmalign.app.evaluation import evaluate_run
from mmalign.errors import CheckpointError
from mmalign.training import rundir
from tests.training.test_trainer import VARIED, make_cfg, make_trainer

SECTIONS = {
    "trainer": {"steps": 2, "save_every": 1, "keep_checkpoints": 3, "lr": 1e-2, "progress_bar": False},
    "eval": {"group_size": 2, "max_rows": 2, "prompts_per_batch": 2},
}


@pytest.fixture(scope="module")
def trained(random_text_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with checkpoints step_000001 and step_000002."""
    out = tmp_path_factory.mktemp("rotation") / "run"
    make_trainer(make_cfg(random_text_model_dir, out, rewards=VARIED, **SECTIONS)).train()
    assert [p.name for p in rundir.checkpoints(out)] == ["step_000001", "step_000002"]
    return out


def fresh(model: Path, trained: Path, tmp_path: Path) -> tuple[Any, Any, Path]:
    """(cfg, freshly built components, a copy of the trained run that the test may damage)."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    cfg = make_cfg(model, run, rewards=VARIED, **SECTIONS)
    return cfg, pipelines.get(cfg.pipeline)(cfg), run


def on_first_rollout(policy: Any, action: Any) -> None:
    """Run `action` when the base half starts generating (as a training run would rotate meanwhile)."""
    real = policy.rollout
    done: list[bool] = []

    def rollout(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(True)
            action()
        return real(*args, **kwargs)

    policy.rollout = rollout


def test_a_checkpoint_rotated_away_during_the_base_half_is_replaced_by_the_newest(
    random_text_model_dir: Path, trained: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from safetensors.torch import load_file

    cfg, comps, run = fresh(random_text_model_dir, trained, tmp_path)
    one, two = rundir.checkpoint_dir(run, 1), rundir.checkpoint_dir(run, 2)
    on_first_rollout(comps.policy, lambda: shutil.rmtree(one))
    with caplog.at_level(logging.WARNING):
        report = evaluate_run(cfg, comps, checkpoint=one, progress=False)
    assert report["checkpoint"] == str(two) and report["checkpoint_requested"] == str(one)
    assert report["base"]["all"]["samples"] == report["trained"]["all"]["samples"] == 4
    assert f"checkpoint {one} was removed before its weights were loaded" in caplog.text
    expected = load_file(str(two / rundir.TRAINABLE_FILE))  # step 2's weights are the ones evaluated
    loaded = comps.policy.trainable_state_dict()
    assert set(loaded) == set(expected) and all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_a_failed_trained_half_keeps_the_base_half_in_the_report(
    random_text_model_dir: Path, trained: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg, comps, run = fresh(random_text_model_dir, trained, tmp_path)
    two = rundir.checkpoint_dir(run, 2)
    on_first_rollout(
        comps.policy, lambda: shutil.rmtree(run / rundir.CHECKPOINTS_DIR)
    )  # nothing to fall back to
    out = tmp_path / "eval.json"
    with caplog.at_level(logging.ERROR), pytest.raises(CheckpointError) as err:
        evaluate_run(cfg, comps, checkpoint=two, progress=False, report_path=out)
    assert f"checkpoint {two} was removed before its weights were loaded" in str(err.value)
    assert "no other checkpoint that verifies" in str(err.value)
    report = json.loads(out.read_text())
    assert report["base"]["all"]["samples"] == 4 and "trained" not in report
    assert report["trained_error"] == f"CheckpointError: {err.value}"
    assert f"the base half is in {out}" in caplog.text
    # a complete evaluation writes the whole report there
    cfg, comps, run = fresh(random_text_model_dir, trained, tmp_path / "again")
    report = evaluate_run(
        cfg, comps, checkpoint=rundir.checkpoint_dir(run, 2), progress=False, report_path=out
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report)) and "trained" in report


def test_processes_that_load_different_checkpoints_stop_together(
    random_text_model_dir: Path, trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On several processes the loaded checkpoints are compared before any generation (a rotation could
    make one process fall back to another checkpoint): every process raises, none evaluates other weights."""
    cfg, comps, run = fresh(random_text_model_dir, trained, tmp_path)
    two = rundir.checkpoint_dir(run, 2)
    other: list[Any] = [(1, str(rundir.checkpoint_dir(run, 3)), None)]
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda mine: list(mine) + other)
    with pytest.raises(
        CheckpointError, match=r"the processes loaded different checkpoints \(.*step_000002, "
    ):
        evaluate_run(cfg, comps, checkpoint=two, compare_base=False, progress=False, rank=0, world=2)
    other[:] = [(1, None, "CheckpointError: the weights hold NaN/inf")]
    with pytest.raises(
        CheckpointError, match="failed on another process: process 1: CheckpointError: the weig"
    ):
        evaluate_run(cfg, comps, checkpoint=two, compare_base=False, progress=False, rank=0, world=2)


def test_cli_eval_keeps_the_base_half_when_the_checkpoint_is_rotated_away(
    random_text_model_dir: Path,
    trained: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`mmalign eval` whose checkpoints all vanish during the base half: rc 1, the error names the checkpoint,
    and eval.json holds the base half (needs `cmd_eval` to pass ``report_path``)."""
    import yaml

    import mmalign.app.evaluation as evaluation
    from mmalign.app.cli import main

    cfg, _, run = fresh(random_text_model_dir, trained, tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    real = evaluation.generate_chunks
    calls: list[int] = []

    def generate_chunks(*args: Any, **kwargs: Any) -> Any:
        if not calls:
            shutil.rmtree(run / rundir.CHECKPOINTS_DIR)  # the run rotated (and then its folder was cleared)
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluation, "generate_chunks", generate_chunks)
    assert main(["eval", str(config)]) == 1
    err = capsys.readouterr().err
    assert f"mmalign: error: checkpoint {rundir.checkpoint_dir(run, 2)} was removed before its weights" in err
    report = json.loads((run / "eval.json").read_text())
    assert report["base"]["all"]["samples"] == 4 and "trained" not in report and "trained_error" in report
