"""The sampling side of asynchronous rollouts, whatever runs it (a forked process, `mmalign.training.asynchronous`, or a
Ray actor, `mmalign.training.ray_workers`): a job (`RolloutJob`), its result (`RolloutResult`), the worker that turns one
into the other (`RolloutWorker`) and the reward scoring of a result (`score_rollout`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from mmalign.data.batch import Rollout
from mmalign.errors import MmalignError
from mmalign.training.seeding import set_worker_rng_state, worker_rng_state

Key = tuple[int, int]
"""(step, round): the trainer's ``step`` (finished training steps) when the rollout is trained, and the
sampling round within that step."""

__all__ = ["AsyncWorkerError", "Key", "RolloutJob", "RolloutResult", "RolloutWorker", "score_rollout"]


class AsyncWorkerError(MmalignError, RuntimeError):
    """A rollout worker died, failed or did not answer within ``trainer.async.timeout_s``."""


@dataclass
class RolloutJob:
    """What a rollout worker is asked to sample."""

    key: Key
    indices: list[int]
    """The dataset row indices of the whole step (every process's), as the prompt sampler drew them."""
    rows: list[dict[str, Any]]
    """This process's rows."""
    group_size: int
    version: int
    """The weight version (finished training steps) the worker must hold."""
    needs: tuple[str, ...] = ()
    """What the rewards need materialised (`Policy.materialize`)."""
    rng: dict[str, Any] | None = None
    """The worker's random state to restore before sampling (the first job of a worker); None: continue."""
    score: bool = False
    """Score the rewards in the worker (``trainer.async.score_in_worker``)."""
    compute_logp: bool = True
    """Record the log-probs of the sampled actions (``Policy.rollout(compute_logp=...)``): the behaviour log-probs
    with ``max_staleness > 0``; with 0 what the synchronous trainer asks for (``GroupTrainer.need_logp_old``)."""
    sampled_logp: bool = False
    """Let a token policy take them from its decode loop instead of a scoring pass (its ``sampled_logp``
    attribute, `mmalign.policies.token_sampling.TokenSampling.sampled_logp`); on with ``max_staleness > 0``."""


@dataclass
class RolloutResult:
    """A sampled round: the rollout with the behaviour log-probs in ``logp_old`` (and an engine's in
    ``logp_sampler``), the weight version it was sampled with, the worker's random state after it, timings, and
    (filled in the trainer process as it arrives) the rewards."""

    key: Key
    rollout: Rollout
    version: int
    rng: dict[str, Any]
    worker: int = 0
    sample_s: float = 0.0
    sample_cpu_s: float = 0.0
    """CPU time of the worker's process while sampling (all its threads)."""
    worker_idle_s: float = 0.0
    rewards: Tensor | None = None
    reward_metrics: dict[str, float] = field(default_factory=dict)
    reward_s: float = 0.0


def score_rollout(reward_set: Any, rollout: Rollout) -> dict[str, Any]:
    """Score one sampled round with `reward_set`, wherever it runs (the trainer's receiving thread, a rollout
    worker, a reward actor): the `RolloutResult` fields ``rewards``, ``reward_metrics`` and ``reward_s``."""
    t0 = time.perf_counter()
    rewards = reward_set(rollout)
    return {
        "rewards": rewards,
        "reward_metrics": dict(getattr(reward_set, "last_metrics", {}) or {}),
        "reward_s": time.perf_counter() - t0,
    }


class RolloutWorker:
    """The sampling side, wherever it runs: a policy copy, its weight version, `run` for one job."""

    def __init__(self, policy: Any, version: int, index: int = 0, reward_set: Any = None) -> None:
        self.policy = policy
        self.version = version
        self.index = index
        self.reward_set = reward_set
        """The rewards, when the worker scores them (``trainer.async.score_in_worker``)."""

    def load_weights(self, version: int, state: dict[str, Tensor]) -> None:
        """Load the trainer's trainable weights of `version`; a policy with an engine re-syncs it before the
        next sampling (`Policy.after_optimizer_step`)."""
        self.policy.load_trainable_state_dict(state)
        self.policy.after_optimizer_step()
        self.version = version

    def run(self, job: RolloutJob, idle_s: float = 0.0) -> RolloutResult:
        if job.version != self.version:
            raise AsyncWorkerError(
                f"rollout worker {self.index}: job {job.key} needs weight version {job.version}, it holds "
                f"{self.version}"
            )
        if job.rng is not None:
            set_worker_rng_state(self.policy, job.rng)
        t0, c0 = time.perf_counter(), time.process_time()
        self.policy.on_train_step(job.key[0])
        if hasattr(self.policy, "sampled_logp"):  # a token policy: log-probs from its decode loop
            self.policy.sampled_logp = job.sampled_logp
        rollout = self.policy.rollout(job.rows, job.group_size, compute_logp=job.compute_logp)
        self.policy.materialize(rollout, job.needs)
        if job.compute_logp and rollout.logp_old is None:
            raise AsyncWorkerError(
                f"{type(self.policy).__name__}.rollout(compute_logp=True) recorded no log-probs; asynchronous "
                "rollouts need the behaviour log-probs"
            )
        sample_s, sample_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        scored: dict[str, Any] = {}
        if job.score:
            if self.reward_set is None:
                raise AsyncWorkerError(f"rollout worker {self.index} holds no reward set to score with")
            scored = score_rollout(self.reward_set, rollout)
        return RolloutResult(
            key=job.key,
            rollout=rollout,
            version=self.version,
            rng=worker_rng_state(self.policy),
            worker=self.index,
            sample_s=sample_s,
            sample_cpu_s=sample_cpu_s,
            worker_idle_s=idle_s,
            **scored,
        )


# ----------------------------------------------------------------------------- the process backend
