"""Trainer hooks the grounding pipelines stand on: numbers a reward reports (``last_metrics``), callbacks
that see the gathered rewards (``on_rewards``) and add to the step's metrics (``on_step_end``), the run
monitors' hooks (`mmalign.training.callbacks.TrainerCallback`), the multi-turn environment's per-sample state
(``outputs["env_state"]``) and over-turn masking (``outputs["exclude_from_loss"]``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mmalign.data.rollout_loops import Done, Insert, TurnContext
from rewards import Reward, RewardBatch
from tests.training.test_trainer import make_cfg, make_trainer, read_metrics


class CountsOddLengths(Reward):
    """len(text) % 2, reporting the share of odd lengths as an extra metric."""

    def __call__(self, batch: RewardBatch) -> list[float]:
        odd = [float(len(t) % 2) for t in batch.texts]
        self.last_metrics = {"odd_frac": sum(odd) / len(odd)}
        return odd


class Recorder:
    """A callback recording what the trainer hands it, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def on_rewards(self, trainer: Any, rewards: torch.Tensor, group: torch.Tensor, names: list[str]) -> None:
        self.events.append(("rewards", (rewards.clone(), group.clone(), list(names))))

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        self.events.append(("step_end", step))
        metrics["recorder/steps_seen"] = float(step)


class MonitorRecorder:
    """A run monitor recording every hook of the trainer's `TrainerCallback` protocol it is called with."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def accelerator_kwargs(self) -> dict[str, Any]:
        self.events.append(("accelerator_kwargs",))
        return {}

    def on_init(self, trainer: Any) -> None:
        self.events.append(("init", trainer.accelerator is not None))

    def on_train_start(self, trainer: Any, step: int) -> None:
        self.events.append(("train_start", step))

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        self.events.append(("step_end", step, metrics.get("recorder/steps_seen")))

    def on_log(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        self.events.append(("log", step))

    def on_samples(self, trainer: Any, step: int, rows: list[Any], views: list[Any]) -> None:
        self.events.append(("samples", step, len(rows), len(views)))

    def on_train_end(self, trainer: Any) -> None:
        self.events.append(("train_end",))


def test_reward_metrics_and_callbacks_reach_metrics_jsonl(
    random_text_model_dir: Path, tmp_path: Path
) -> None:
    import pipelines

    cfg = make_cfg(
        random_text_model_dir,
        tmp_path / "run",
        rewards=[{"name": f"{__name__}:CountsOddLengths", "alias": "odd"}],
        trainer={"steps": 2, "progress_bar": False, "save_every": 100, "sample_every": 100},
    )
    components = pipelines.get(cfg.pipeline)(cfg)
    recorder = Recorder()
    components.callbacks.append(recorder)
    from mmalign.training.trainer import GroupTrainer

    monitor = MonitorRecorder()
    history = GroupTrainer(cfg, components, monitors=[monitor]).train()
    assert [e[0] for e in recorder.events] == ["rewards", "step_end", "rewards", "step_end"]
    # monitors: after the callbacks (they see the callbacks' numbers); samples at step 1, every step logged
    assert monitor.events == [
        ("accelerator_kwargs",),
        ("init", True),
        ("train_start", 0),
        ("step_end", 1, 1.0),
        ("log", 1),
        ("samples", 1, 16, 16),
        ("step_end", 2, 2.0),
        ("log", 2),
        ("train_end",),
    ]
    rewards, group, names = recorder.events[0][1]
    assert names == ["odd"] and rewards.shape == (16, 1) and group.tolist() == sorted(group.tolist())
    # the reported share is the mean of the reward column itself (an independent count of the same thing)
    for m in history:
        assert abs(m["reward/odd/odd_frac"] - m["reward/odd/mean"]) < 1e-9
    written = read_metrics(tmp_path / "run")
    assert [m["recorder/steps_seen"] for m in written] == [1.0, 2.0]
    assert "reward/odd/odd_frac" in written[0]


def _zoom_env(ctx: TurnContext) -> Done | Insert:
    """Records every turn in the sample's state; asks for a second turn on even samples only."""
    ctx.state.setdefault("turns_seen", []).append(ctx.turn)
    if ctx.sample_index % 2 == 0 and ctx.turn == 0:
        return Insert(text=" more:", role=None)
    return Done()


def _always_more(ctx: TurnContext) -> Insert:
    ctx.state["calls"] = ctx.state.get("calls", 0) + 1
    return Insert(text=" more:", role=None)


def test_env_state_is_per_sample_and_reaches_the_samples(random_text_model_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(
        random_text_model_dir,
        tmp_path / "run",
        rollout={
            "loop": "multi_turn",
            "loop_kwargs": {"environment": f"{__name__}:_zoom_env", "max_turns": 3},
        },
        trainer={"steps": 1, "progress_bar": False, "save_every": 100, "sample_every": 1},
    )
    trainer = make_trainer(cfg)
    batch, _ = trainer.make_rollout()
    states = batch.outputs["env_state"]
    assert len(states) == len(batch)
    for i, state in enumerate(states):  # sample i of the rollout: even ones had two turns
        assert state["turns_seen"] == ([0, 1] if i % 2 == 0 else [0])
    trainer.train()
    rows = [
        json.loads(x) for x in (tmp_path / "run" / "samples" / "step_000001.jsonl").read_text().splitlines()
    ]
    assert all("turns_seen" in r["env_state"] for r in rows)


def test_over_turn_samples_count_in_the_group_but_not_in_the_loss(
    random_text_model_dir: Path, tmp_path: Path
) -> None:
    loop = {"environment": f"{__name__}:_always_more", "max_turns": 2, "mask_over_turn": True}
    cfg = make_cfg(
        random_text_model_dir,
        tmp_path / "run",
        rollout={"loop": "multi_turn", "loop_kwargs": loop},
        rewards=[{"name": "tests.training.test_trainer:LengthMod3", "alias": "length_mod3"}],
    )
    trainer = make_trainer(cfg)
    batch, metrics = trainer.make_rollout()
    assert batch.outputs["exclude_from_loss"].all()  # every sample hit the turn cap
    assert not batch.mask.any()  # ... so none is in the loss
    assert metrics["over_turn_frac"] == 1.0 and metrics["tool_call_rate"] == 1.0
    # the advantages were computed with them: a plain per-group standardisation of the rewards
    r = batch.rewards[:, 0]
    for g in batch.group.unique():
        sel = batch.group == g
        x = r[sel]
        expected = (x - x.mean()) / (x.std() + 1e-4) if x.std() > 0 else torch.zeros_like(x)
        assert torch.allclose(batch.advantages[sel], expected, atol=1e-3)

    loop["mask_over_turn"] = False
    cfg = make_cfg(
        random_text_model_dir, tmp_path / "run2", rollout={"loop": "multi_turn", "loop_kwargs": loop}
    )
    batch, _ = make_trainer(cfg).make_rollout()
    assert "exclude_from_loss" not in batch.outputs and batch.mask.any()


class StopAt:
    """A monitor that asks the trainer to stop after step `at`."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if step == self.at:
            trainer.request_stop("test")


def test_request_stop_ends_the_run_after_the_step_written_as_the_last(
    random_text_model_dir: Path, tmp_path: Path
) -> None:
    cfg = make_cfg(
        random_text_model_dir,
        tmp_path / "run",
        trainer={"steps": 5, "log_every": 10, "save_every": 10, "sample_every": 10},
    )
    import pipelines
    from mmalign.training import rundir
    from mmalign.training.trainer import GroupTrainer

    trainer = GroupTrainer(cfg, pipelines.get(cfg.pipeline)(cfg), monitors=[StopAt(2)])
    history = trainer.train()
    assert trainer.step == 2 and len(history) == 2 and cfg.trainer.steps == 5
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [2]  # written as the last step
    assert rundir.latest_checkpoint(tmp_path / "run").name == rundir.step_name(2)
