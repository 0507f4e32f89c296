"""Asynchronous rollouts (`trainer.async`, `mmalign.training.asynchronous`) on the tiny text task: K = 0 is the synchronous
trainer bit for bit; with K = 1 the behaviour log-probs the worker recorded are those of the weights it had, the
loss's pi_old those of the trained weights; exact resume; a killed worker stops the run within a bounded time."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import pipelines
from mmalign.config import ConfigError, config_from_dict
from mmalign.training.trainer import GroupTrainer, TrainingError

REPO = Path(__file__).resolve().parents[2]
TRAIN_JSONL = REPO / "assets" / "text_reasoning" / "train.jsonl"

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the process backend forks")


class LengthMod3:
    """Imported by name through the reward registry (``tests.training.test_async:LengthMod3``)."""


def make_cfg(model_dir: Path, out: Path, **sections: Any):
    data: dict[str, Any] = {
        "pipeline": "text_reasoning",
        "output_dir": str(out),
        "seed": 0,
        "model": {"name_or_path": str(model_dir)},
        "data": {"train": str(TRAIN_JSONL), "prompt_template": "Q: {question} = ?\nA:"},
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 8},
        "rewards": [
            {"name": "tests.training.test_trainer:LengthMod3", "alias": "length_mod3"},
            {"name": "format", "kwargs": {"tags": ["answer"]}},
        ],
        "trainer": {"steps": 4, "lr": 1e-3, "progress_bar": False, "save_every": 100, "sample_every": 100},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return config_from_dict(data, "test")


def make_trainer(cfg, resume: bool = False, monitors: tuple[Any, ...] = ()) -> GroupTrainer:
    return GroupTrainer(cfg, pipelines.get(cfg.pipeline)(cfg), resume=resume, monitors=monitors)


def strip(m: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in m.items() if not k.startswith(("time/", "async/"))}


def test_config_key_and_validation(random_text_model_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(random_text_model_dir, tmp_path / "r", trainer={"async": {"max_staleness": 2}})
    assert cfg.trainer.async_ is not None and cfg.trainer.async_.max_staleness == 2
    assert cfg.to_dict()["trainer"]["async"]["max_staleness"] == 2
    assert make_cfg(random_text_model_dir, tmp_path / "r").trainer.async_ is None  # off by default
    with pytest.raises(ConfigError, match="trainer.async.max_staleness"):
        make_cfg(random_text_model_dir, tmp_path / "r", trainer={"async": {"max_staleness": -1}})
    with pytest.raises(ConfigError, match="rollout.is_correction"):
        make_cfg(
            random_text_model_dir,
            tmp_path / "r",
            trainer={"async": {"max_staleness": 1}},
            rollout={"is_correction": "none"},
        )
    with pytest.raises(ConfigError, match="unknown key 'trainer.async.staleness'"):
        make_cfg(random_text_model_dir, tmp_path / "r", trainer={"async": {"staleness": 1}})
    ray_rewards = {
        "max_staleness": 1,
        "backend": "ray",
        "reward_workers": 2,
        "reward_resources": {"num_gpus": 1},
    }
    cfg = make_cfg(random_text_model_dir, tmp_path / "r", trainer={"async": ray_rewards})
    assert cfg.trainer.async_.reward_workers == 2 and cfg.trainer.async_.reward_resources == {"num_gpus": 1}
    for bad, key in (
        ({"reward_workers": 1}, "needs trainer.async.backend 'ray'"),  # the process backend
        ({**ray_rewards, "reward_workers": -1}, "trainer.async.reward_workers"),
        ({**ray_rewards, "score_in_worker": True}, "both say where to score"),
        ({**ray_rewards, "reward_workers": 0}, "trainer.async.reward_resources"),
        ({**ray_rewards, "reward_resources": {"num_cpus": -1}}, r"reward_resources.num_cpus.*>= 0"),
    ):
        with pytest.raises(ConfigError, match=key):
            make_cfg(random_text_model_dir, tmp_path / "r", trainer={"async": bad})
    with pytest.raises(ConfigError, match="algorithm.group_refill"):  # hints re-roll in the trainer's process
        make_cfg(
            random_text_model_dir,
            tmp_path / "r",
            trainer={"async": {"max_staleness": 1}},
            algorithm={"group_refill": {"hints": True}},
        )


def test_k0_equals_the_synchronous_trainer_bit_for_bit(random_text_model_dir: Path, tmp_path: Path) -> None:
    sync = make_trainer(make_cfg(random_text_model_dir, tmp_path / "sync"))
    sync_hist = sync.train()
    cfg = make_cfg(random_text_model_dir, tmp_path / "async", trainer={"async": {"max_staleness": 0}})
    trainer = make_trainer(cfg)
    hist = trainer.train()
    assert [strip(m) for m in hist] == [strip(m) for m in sync_hist]
    assert all(m["async/staleness_max"] == 0 for m in hist)
    a, b = sync.policy.trainable_state_dict(), trainer.policy.trainable_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the samples too (the rollout ran in the worker process)
    assert sync._last_batch.outputs["texts"] == trainer._last_batch.outputs["texts"]
    # the rewards scored by the worker itself instead of the trainer's receiving thread: the same run
    cfg = make_cfg(
        random_text_model_dir,
        tmp_path / "scored",
        trainer={"async": {"max_staleness": 0, "score_in_worker": True}},
    )
    assert [strip(m) for m in make_trainer(cfg).train()] == [strip(m) for m in sync_hist]


class Recorder:
    """A monitor keeping each step's batch and the trained weights after it."""

    def __init__(self) -> None:
        self.batches: dict[int, Any] = {}
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_start(self, trainer: GroupTrainer, step: int) -> None:
        self.weights[step] = trainer.policy.trainable_state_dict()

    def on_step_end(self, trainer: GroupTrainer, step: int, metrics: dict[str, Any]) -> None:
        self.batches[step] = trainer._last_batch
        self.weights[step] = trainer.policy.trainable_state_dict()


def _behaviour_check(
    tmp_path: Path, model_dir: Path, **trainer: Any
) -> tuple[Recorder, list[dict[str, Any]], Any]:
    cfg = make_cfg(model_dir, tmp_path, trainer={"async": {"max_staleness": 1}, **trainer})
    rec = Recorder()
    hist = make_trainer(cfg, monitors=(rec,)).train()
    assert [m["async/staleness_max"] for m in hist] == [0, 1, 1, 1]
    # an independent scorer: a fresh policy loaded with the weights of a given version
    scorer = pipelines.get(cfg.pipeline)(cfg).policy
    scorer.model.train()

    def logprobs(version: int, batch: Any) -> torch.Tensor:
        scorer.load_trainable_state_dict(rec.weights[version])
        with torch.no_grad():
            return scorer.action_stats(batch).logp.masked_fill(~batch.mask, 0.0)

    for step in (2, 3, 4):
        batch = rec.batches[step]
        version = int(batch.outputs["policy_version"][0])
        assert version == step - 2  # sampled with the weights after step - 2 (one step stale)
        mask = batch.mask
        behaviour = logprobs(version, batch)
        assert torch.allclose(batch.logp_sampler[mask], behaviour[mask], atol=1e-5)
        pi_old = logprobs(step - 1, batch)  # the weights the update started from
        assert (pi_old - behaviour)[mask].abs().max() > 1e-4  # the weights did move
        # the IS diagnostics the loss logged compare pi_old with the behaviour log-probs
        dlogp = (pi_old - behaviour)[mask].abs()
        assert hist[step - 1]["is/abs_dlogp_mean"] == pytest.approx(float(dlogp.mean()), rel=1e-3, abs=1e-6)
        w = torch.exp(pi_old - behaviour)[mask].clamp(max=cfg.rollout.is_cap)
        assert hist[step - 1]["is/weight_mean"] == pytest.approx(float(w.mean()), rel=1e-4)
        if batch.logp_old is not None:  # recomputed pi_old (several updates per rollout)
            assert torch.allclose(batch.logp_old[mask], pi_old[mask], atol=1e-5)
    assert hist[0]["is/abs_dlogp_mean"] < 1e-5  # step 1: sampled with the weights it trains
    return rec, hist, cfg


def test_k1_behaviour_logprobs_are_those_of_the_workers_weights(
    random_text_model_dir: Path, tmp_path: Path
) -> None:
    rec, _, _ = _behaviour_check(tmp_path / "k1", random_text_model_dir)
    assert rec.batches[2].logp_old is None  # one optimizer step: pi_old is the update's own forward


def test_worker_takes_behaviour_logprobs_from_the_decode_loop(
    random_text_model_dir: Path, tmp_path: Path
) -> None:
    """The rollout worker of a K > 0 run records the behaviour log-probs without a scoring pass (the text
    policy's decode loop gives them, `TokenSampling.sampled_logp`); a K = 0 job asks for what the synchronous
    trainer asks for, through the scoring pass (here: nothing)."""
    from mmalign.training.rollout_worker import RolloutJob, RolloutWorker

    cfg = make_cfg(random_text_model_dir, tmp_path / "w")
    policy = pipelines.get(cfg.pipeline)(cfg).policy
    calls = [0]
    score = policy._logprobs

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return score(*args, **kwargs)

    policy._logprobs = counted
    worker = RolloutWorker(policy, version=0)
    rows = [{"prompt": "Q: 1 + 2 = ?\nA:"}, {"prompt": "Q: 4 + 4 = ?\nA:"}]
    stale = worker.run(RolloutJob((0, 0), [0, 1], rows, 3, 0, compute_logp=True, sampled_logp=True))
    assert calls[0] == 0 and stale.rollout.logp_old is not None
    mask = stale.rollout.mask
    rescored = score(policy.model, stale.rollout, grad=False)
    assert (stale.rollout.logp_old - rescored)[mask].abs().max() <= 1e-5
    k0 = worker.run(RolloutJob((1, 0), [0, 1], rows, 3, 0, compute_logp=False))
    assert calls[0] == 0 and k0.rollout.logp_old is None and not policy.sampled_logp
    worker.run(RolloutJob((2, 0), [0, 1], rows, 3, 0, compute_logp=True))  # K = 0 with two passes
    assert calls[0] == 1


def test_k1_with_two_passes_recomputes_pi_old(random_text_model_dir: Path, tmp_path: Path) -> None:
    rec, hist, _ = _behaviour_check(tmp_path / "k1mu", random_text_model_dir, num_iterations=2)
    assert rec.batches[3].logp_old is not None


def test_k1_resume_is_exact(random_text_model_dir: Path, tmp_path: Path) -> None:
    steps = {"steps": 6, "save_every": 3, "lr": 1e-3, "progress_bar": False, "async": {"max_staleness": 1}}
    full = make_trainer(make_cfg(random_text_model_dir, tmp_path / "full", trainer=steps)).train()
    part_cfg = make_cfg(random_text_model_dir, tmp_path / "part", trainer=steps)
    part_cfg.trainer.steps = 4
    make_trainer(part_cfg).train()
    (tmp_path / "part" / "checkpoints" / "step_000004").rename(tmp_path / "part" / "gone")
    trainer = make_trainer(make_cfg(random_text_model_dir, tmp_path / "part", trainer=steps), resume=True)
    assert trainer.step == 3
    resumed = trainer.train()
    assert [strip(m) for m in resumed] == [strip(m) for m in full[3:]]
    # the barrier: step 4 (after the checkpoint at 3) was sampled fresh, the others one step stale
    assert [m["async/staleness_max"] for m in full] == [0, 1, 1, 0, 1, 1]


class Killer:
    """Kills the rollout worker process at the end of step 2."""

    def __init__(self) -> None:
        self.killed_at: float | None = None

    def on_step_end(self, trainer: GroupTrainer, step: int, metrics: dict[str, Any]) -> None:
        if step == 2:
            os.kill(trainer.rounds.source.workers[0].pid, signal.SIGKILL)
            self.killed_at = time.perf_counter()


def test_killed_worker_stops_the_run_with_a_clear_error(random_text_model_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(
        random_text_model_dir, tmp_path / "kill", trainer={"async": {"max_staleness": 1, "timeout_s": 60}}
    )
    killer = Killer()
    trainer = make_trainer(cfg, monitors=(killer,))
    with pytest.raises(TrainingError, match=r"rollout worker process \(pid \d+\) died with exit code -9"):
        trainer.train()
    assert killer.killed_at is not None
    assert time.perf_counter() - killer.killed_at < 10  # not the 60 s timeout: the death is noticed


def test_engine_is_built_by_the_worker_and_corrected(random_text_model_dir: Path, tmp_path: Path) -> None:
    """With a rollout engine the trainer's process builds none (it never samples); the worker's copy builds its
    own, syncs it with the weights it receives, and its log-probs are the behaviour log-probs."""
    cfg = make_cfg(
        random_text_model_dir,
        tmp_path / "eng",
        trainer={"async": {"max_staleness": 1}, "steps": 3},
        rollout={"engine": "fake"},
    )
    rec = Recorder()
    trainer = make_trainer(cfg, monitors=(rec,))
    hist = trainer.train()
    assert trainer.policy.engine is None and trainer.policy.engine_client.deferred is not None
    assert [m["async/staleness_max"] for m in hist] == [0, 1, 1]
    scorer = pipelines.get(cfg.pipeline)(cfg).policy
    scorer.model.train()
    batch = rec.batches[3]
    scorer.load_trainable_state_dict(rec.weights[1])  # the weights the worker's engine was synced to
    with torch.no_grad():
        behaviour = scorer.action_stats(batch).logp
    mask = batch.mask
    assert torch.allclose(batch.logp_sampler[mask], behaviour[mask], atol=1e-4)


VLM_MODEL = REPO / "assets" / "models" / "vlm_reasoning-tiny"


@pytest.mark.skipif(
    not VLM_MODEL.is_dir(), reason=f"{VLM_MODEL} is not built (mmalign tiny build vlm_reasoning)"
)
def test_vlm_policy_runs_asynchronously(tmp_path: Path) -> None:
    """The VLM policy through the same worker: K = 0 gives the synchronous run's metrics, K = 1 one-step-stale
    batches with the behaviour log-probs of the weights the worker had."""
    from mmalign.config import load_config

    def cfg_of(out: str, *extra: str):
        return load_config(
            REPO / "configs" / "vlm_reasoning-tiny.yaml",
            [
                f"model.name_or_path={VLM_MODEL}",
                f"output_dir={tmp_path / out}",
                "trainer.progress_bar=false",
                "trainer.save_every=1000",
                "trainer.sample_every=1000",
                "rollout.prompts_per_step=2",
                "rollout.group_size=4",
                "rollout.max_new_tokens=6",
                "trainer.steps=3",
                *extra,
            ],
        )

    cfg = cfg_of("sync")
    expected = make_trainer(cfg).train()
    got = make_trainer(cfg_of("k0", "trainer.async={max_staleness: 0}")).train()
    assert [strip(m) for m in got] == [strip(m) for m in expected]
    cfg = cfg_of("k1", "trainer.async={max_staleness: 1}")
    rec = Recorder()
    hist = make_trainer(cfg, monitors=(rec,)).train()
    assert [m["async/staleness_max"] for m in hist] == [0, 1, 1]
    scorer = pipelines.get(cfg.pipeline)(cfg).policy
    scorer.model.train()
    batch = rec.batches[3]
    scorer.load_trainable_state_dict(rec.weights[1])
    with torch.no_grad():
        behaviour = scorer.action_stats(batch).logp
    assert torch.allclose(batch.logp_sampler[batch.mask], behaviour[batch.mask], atol=1e-4)
