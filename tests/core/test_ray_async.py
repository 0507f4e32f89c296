"""Rollout workers as Ray actors (`trainer.async.backend: ray`, `mmalign.ray_workers`) on a local Ray instance:
two CPU actors train the tiny text task and its reward rises; killing an actor mid-run stops the run with a
clear error within a bounded time. Skipped without Ray (``pip install "mmalign[ray]"``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import pipelines
from mmalign.config import load_config
from mmalign.trainer import GroupTrainer, TrainingError

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
            os.kill(trainer._async.workers[1].pid, signal.SIGKILL)
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
