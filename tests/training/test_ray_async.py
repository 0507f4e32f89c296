"""Rollout and reward workers as Ray actors (`trainer.async.backend: ray`, `mmalign.training.ray_workers`) on a local Ray
instance: two CPU actors train the tiny text task and its reward rises; killing an actor mid-run stops the run with a
clear error within a bounded time; reward actors (`trainer.async.reward_workers`) give the rewards of in-process
scoring bit for bit (K = 0 and K = 1), and a silent or dead reward actor stops the run naming it. Skipped without
Ray (``pip install "mmalign[ray]"``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import pipelines
from mmalign.config import load_config
from mmalign.training.trainer import GroupTrainer, TrainingError
from rewards.base import Reward, RewardBatch
from tests.training.test_async import Recorder, make_cfg, strip

ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "mmalign[ray]")')

REPO = Path(__file__).resolve().parents[2]
TRAIN_JSONL = REPO / "assets" / "text_reasoning" / "train.jsonl"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield
    ray.shutdown()


def tiny_cfg(model_dir: Path, out: Path, *extra: str):
    return load_config(
        REPO / "configs" / "text_reasoning-tiny.yaml",
        [
            f"model.name_or_path={model_dir}",
            f"output_dir={out}",
            "trainer.progress_bar=false",
            "trainer.save_every=1000",
            f"data.train={TRAIN_JSONL}",
            "trainer.async={max_staleness: 1, backend: ray, num_workers: 2, worker_resources: {num_cpus: 1}}",
            *extra,
        ],
    )


def test_two_ray_workers_train_the_tiny_task(
    local_ray: None, tiny_text_model_dir: Path, tmp_path: Path
) -> None:
    # the actors also score the rewards (the reward set is sent to them through the object store)
    cfg = tiny_cfg(
        tiny_text_model_dir, tmp_path / "run", "trainer.steps=60", "trainer.async.score_in_worker=true"
    )
    trainer = GroupTrainer(cfg, pipelines.get(cfg.pipeline)(cfg))
    history = trainer.train()
    acc = [m["reward/answer_accuracy/mean"] for m in history]
    first, last = sum(acc[:10]) / 10, sum(acc[-10:]) / 10
    assert last > first + 0.25, (first, last)
    assert max(m["async/staleness_max"] for m in history) == 1
    assert all(m["async/reward_s"] > 0 for m in history)  # measured in the actors
    (tmp_path / "curve.tsv").write_text("\n".join(f"{i + 1}\t{a:.4f}" for i, a in enumerate(acc)))
    print("ray curve", [round(a, 3) for a in acc])


class KillActor:
    def __init__(self) -> None:
        self.killed_at: float | None = None

    def on_step_end(self, trainer: GroupTrainer, step: int, metrics: dict[str, Any]) -> None:
        if step == 2:
            os.kill(trainer.rounds.source.workers[1].pid, signal.SIGKILL)
            self.killed_at = time.perf_counter()


def test_killed_ray_worker_stops_the_run(
    local_ray: None, random_text_model_dir: Path, tmp_path: Path
) -> None:
    cfg = tiny_cfg(
        random_text_model_dir,
        tmp_path / "kill",
        "trainer.steps=6",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "trainer.async.timeout_s=120",
    )
    killer = KillActor()
    trainer = GroupTrainer(cfg, pipelines.get(cfg.pipeline)(cfg), monitors=(killer,))
    with pytest.raises(TrainingError, match="rollout actor 1 died"):
        trainer.train()
    assert killer.killed_at is not None
    assert time.perf_counter() - killer.killed_at < 30  # noticed, not the 120 s timeout


# ----------------------------------------------------------------------------- reward actors


def _rewarded_run(
    model_dir: Path, out: Path, async_: dict[str, Any] | None, **trainer: Any
) -> tuple[list, Recorder]:
    """The tiny random-model task of test_async (a length-mod-3 reward that varies and a format reward), 3 steps;
    `async_`: ``trainer.async`` (None: synchronous). Returns the metrics and each step's batch."""
    t: dict[str, Any] = {"steps": 3, **trainer}
    if async_ is not None:
        t["async"] = async_
    cfg = make_cfg(model_dir, out, trainer=t)
    rec = Recorder()
    rec.scored_by = []  # the reward actors' round-robin position at each step's end (None: no actors)
    on_step_end = rec.on_step_end

    def record(trainer: GroupTrainer, step: int, metrics: dict[str, Any]) -> None:
        actors = trainer.rounds.source.reward_actors if trainer.rounds.source is not None else None
        rec.scored_by.append(None if actors is None else (len(actors.actors), actors._next))
        on_step_end(trainer, step, metrics)

    rec.on_step_end = record
    return GroupTrainer(cfg, pipelines.get(cfg.pipeline)(cfg), monitors=(rec,)).train(), rec


def _same_rewards(a: Recorder, b: Recorder) -> None:
    for step in a.batches:
        ra, rb = a.batches[step].rewards, b.batches[step].rewards
        assert ra.dtype == rb.dtype and torch.equal(ra, rb), step
        assert a.batches[step].outputs["texts"] == b.batches[step].outputs["texts"]


REWARD_ACTORS = {"reward_workers": 2, "reward_resources": {"num_cpus": 0.5}}


def test_reward_actors_score_as_in_process(
    local_ray: None, random_text_model_dir: Path, tmp_path: Path
) -> None:
    """Two reward actors score every round (rounds alternate between them); K = 0 gives the synchronous
    trainer's run, rewards and metrics bit for bit, and K = 1 the run of the same rollout actor with the rewards
    scored in the trainer's process."""
    ray_k0 = {"max_staleness": 0, "backend": "ray", "worker_resources": {"num_cpus": 1}}
    sync_hist, sync_rec = _rewarded_run(random_text_model_dir, tmp_path / "sync", None)
    k0_hist, k0_rec = _rewarded_run(random_text_model_dir, tmp_path / "k0", {**ray_k0, **REWARD_ACTORS})
    assert [strip(m) for m in k0_hist] == [strip(m) for m in sync_hist]
    _same_rewards(k0_rec, sync_rec)
    assert all(m["async/reward_s"] > 0 for m in k0_hist)  # measured in the reward actors
    assert k0_rec.scored_by == [(2, 1), (2, 0), (2, 1)]  # one round per step, alternating actors
    assert len({float(r.rewards.sum()) for r in sync_rec.batches.values()}) > 1  # the rewards vary

    ray_k1 = {**ray_k0, "max_staleness": 1}
    here_hist, here_rec = _rewarded_run(random_text_model_dir, tmp_path / "k1", ray_k1)
    actors_hist, actors_rec = _rewarded_run(
        random_text_model_dir, tmp_path / "k1r", {**ray_k1, **REWARD_ACTORS}
    )
    assert [m["async/staleness_max"] for m in actors_hist] == [0, 1, 1]
    assert here_rec.scored_by == [None] * 3 and actors_rec.scored_by[-1] == (2, 1)
    assert [strip(m) for m in actors_hist] == [strip(m) for m in here_hist]
    _same_rewards(actors_rec, here_rec)


class SilentInActor(Reward):
    """0 in the process that built it; in any other process (a reward actor) it sleeps first, past the
    timeout."""

    def __init__(self, sleep_s: float = 300.0) -> None:
        self.home = os.getpid()
        self.sleep_s = sleep_s

    def __call__(self, batch: RewardBatch) -> list[float]:
        if os.getpid() != self.home:
            time.sleep(self.sleep_s)
        return [0.0] * len(batch.texts)


def test_silent_reward_actor_fails_naming_it(
    local_ray: None, random_text_model_dir: Path, tmp_path: Path
) -> None:
    cfg = make_cfg(
        random_text_model_dir,
        tmp_path / "silent",
        rewards=[{"name": "tests.training.test_ray_async:SilentInActor"}],
        trainer={
            "steps": 3,
            "async": {
                "max_staleness": 1,
                "backend": "ray",
                "timeout_s": 20,  # also bounds the actors' start on a loaded machine
                "worker_resources": {"num_cpus": 1},
                "reward_workers": 1,
                "reward_resources": {"num_cpus": 0.5},
            },
        },
    )
    trainer = GroupTrainer(cfg, pipelines.get(cfg.pipeline)(cfg))
    t0 = time.perf_counter()
    with pytest.raises(TrainingError, match=r"reward actor 0\b.*step 1 round 0.*trainer.async.timeout_s=20"):
        trainer.train()
    assert time.perf_counter() - t0 < 90  # bounded by timeout_s, not the 300 s sleep


class KillRewardActor:
    def __init__(self) -> None:
        self.killed_at: float | None = None

    def on_step_end(self, trainer: GroupTrainer, step: int, metrics: dict[str, Any]) -> None:
        if step == 2:
            os.kill(trainer.rounds.source.reward_actors.pids()[1], signal.SIGKILL)
            self.killed_at = time.perf_counter()


def test_killed_reward_actor_stops_the_run(
    local_ray: None, random_text_model_dir: Path, tmp_path: Path
) -> None:
    cfg = make_cfg(
        random_text_model_dir,
        tmp_path / "killr",
        trainer={
            "steps": 6,
            "async": {
                "max_staleness": 1,
                "backend": "ray",
                "timeout_s": 120,
                "worker_resources": {"num_cpus": 1},
                **REWARD_ACTORS,
            },
        },
    )
    killer = KillRewardActor()
    trainer = GroupTrainer(cfg, pipelines.get(cfg.pipeline)(cfg), monitors=(killer,))
    with pytest.raises(TrainingError, match=r"reward actor 1 died"):
        trainer.train()
    assert killer.killed_at is not None
    assert time.perf_counter() - killer.killed_at < 30  # noticed, not the 120 s timeout
