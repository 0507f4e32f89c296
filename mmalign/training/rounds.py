"""Where a sampling round's samples come from: the trainer's own policy now (`SyncRounds`) or rollout workers
that sample ahead with older weights (`AsyncRounds`, ``trainer.async``; `mmalign.training.asynchronous`).

A round source gives the trainer, for a round key ``(step, round)``, the round's global prompt indices, this
process's `Rollout` and its rewards Float[B] or Float[B, K] (`next_round`); it is told when an update is about to
start (`before_update`), adds its metrics to the step's (`metrics`), and is closed when training ends. The
trainer does not know which one it holds.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from mmalign.data.batch import Rollout

__all__ = ["AsyncRounds", "SyncRounds", "round_source"]


class SyncRounds:
    """Rounds sampled now by the trainer's policy, with the current weights, and scored by its reward set."""

    source: Any = None
    """The rollout workers (None: none)."""

    def __init__(self, trainer: Any) -> None:
        self.t = weakref.proxy(
            trainer
        )  # no cycle: a dropped trainer is freed (and its run lock released) at once

    def next_round(self, key: tuple[int, int]) -> tuple[list[int], Rollout, Tensor]:
        """The round `key`: its prompt indices, this process's rollout and its rewards (times in ``t.timers``)."""
        t = self.t
        idx = t.sampler.next_indices(t.cfg.rollout.prompts_per_step)
        t.policy.on_train_step(t.step)  # schedules of the policy, weight syncs of its sampler; resume-safe
        rollout = t.policy.rollout(t.rows_of(idx), t.samples_per_group, compute_logp=t.need_logp_old)
        t0 = time.perf_counter()
        # outputs that cost time (such as pixels from latents) are made only when a reward needs them
        t.policy.materialize(rollout, t.reward_set.needs)
        t.timers["materialize"] = t.timers.get("materialize", 0.0) + time.perf_counter() - t0
        rewards = t.reward_set(rollout)
        t.timers["reward"] += time.perf_counter() - t0
        t.reward_extra = dict(getattr(t.reward_set, "last_metrics", {}) or {})
        return idx, rollout, rewards

    def before_update(self) -> None:
        """Nothing to start: the next round is sampled when it is asked for."""

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Nothing to stop."""


class AsyncRounds:
    """Rounds sampled by rollout workers (`mmalign.training.asynchronous.AsyncRollouts`) with weights up to
    ``trainer.async.max_staleness`` steps old; the workers start at the first round, holding the policy as it is
    then and, when resuming, the random states of the checkpoint's workers (``t.async_rngs``)."""

    def __init__(self, trainer: Any) -> None:
        self.t = weakref.proxy(
            trainer
        )  # no cycle: a dropped trainer is freed (and its run lock released) at once
        self.cfg = trainer.cfg.trainer.async_
        self.source: Any = None
        """The running `AsyncRollouts` (None until the first round and after `close`)."""
        self.step_sums: dict[str, float] = defaultdict(float)

    def _start(self) -> None:
        from mmalign.training.asynchronous import AsyncRollouts

        t = self.t
        self.source = AsyncRollouts(
            t.policy,
            t.reward_set,
            self.cfg,
            version=t.step,
            seed=t.cfg.seed + 1000 * t.rank,
            worker_rngs=t.async_rngs,
        )

    def submit(self, key: tuple[int, int], idx: list[int], rows: list[dict[str, Any]] | None = None) -> None:
        """Submit the round `key` with the prompts `idx` (this process's dataset rows of them, or `rows`: e.g. rows
        rewritten for a re-roll), sampled with the current weights (version ``step``)."""
        from mmalign.training.seeding import worker_rng_state

        t = self.t
        self.source.submit(
            key,
            idx,
            t.rows_of(idx) if rows is None else rows,
            t.samples_per_group,
            t.step,
            t.policy.trainable_state_dict,
            needs=tuple(t.reward_set.needs),
            # K = 0: one random stream, as in the synchronous trainer (the worker continues this process's)
            rng=worker_rng_state(t.policy) if self.cfg.max_staleness == 0 else None,
            # K = 0: the log-probs the synchronous trainer records; K > 0: always (the behaviour log-probs)
            compute_logp=t.need_logp_old,
        )

    def next_round(self, key: tuple[int, int]) -> tuple[list[int], Rollout, Tensor]:
        """The round `key` (sampled ahead by `before_update`, or submitted now) with its behaviour / pi_old
        log-probs set for the loss (`mmalign.training.asynchronous.behaviour_fields`) and its rewards; records staleness
        and idle times."""
        from mmalign.training.asynchronous import behaviour_fields
        from mmalign.training.seeding import set_worker_rng_state

        t = self.t
        if self.source is None:
            self._start()
        if self.source.has(key):  # the prompts of a round sampled ahead were drawn when it was submitted
            idx = self.source.indices(key)
        else:
            idx = t.sampler.next_indices(t.cfg.rollout.prompts_per_step)
            self.submit(key, idx)
        result, waited = self.source.take(key)
        if self.cfg.max_staleness == 0:  # continue the stream where the worker's sampling left it
            set_worker_rng_state(t.policy, result.rng)
        staleness = t.step - result.version
        rollout = behaviour_fields(
            result.rollout,
            staleness=staleness,
            max_staleness=self.cfg.max_staleness,
            need_logp_old=t.need_logp_old,
            current_logprobs=t.current_logprobs,
            recompute=t.need_logp_old or t.cfg.rollout.is_correction == "sequence",
        )
        rollout.outputs["staleness"] = torch.full((len(rollout),), staleness, dtype=torch.long)
        rollout.outputs["policy_version"] = torch.full((len(rollout),), result.version, dtype=torch.long)
        t.reward_extra = dict(result.reward_metrics)
        a = self.step_sums
        a["trainer_wait_s"] += waited
        a["worker_idle_s"] += result.worker_idle_s
        a["worker_sample_s"] += result.sample_s
        a["worker_sample_cpu_s"] += result.sample_cpu_s
        a["reward_s"] += result.reward_s
        a["staleness_sum"] += staleness * len(rollout)
        a["samples"] += len(rollout)
        a["staleness_max"] = max(a["staleness_max"], staleness)
        assert result.rewards is not None
        return idx, rollout, result.rewards

    def before_update(self) -> None:
        """Before the update of step ``step + 1``: submit the first round of the next ``max_staleness`` steps
        with the current weights. Nothing is submitted past a step that writes a checkpoint (a barrier: no work
        is in flight at a checkpoint, so a resumed run samples what the uninterrupted one did)."""
        t = self.t
        c, k = t.cfg.trainer, self.cfg.max_staleness
        now = t.step + 1  # the step being run (1-based)
        for ahead in range(1, k + 1):
            target = now + ahead
            if target > c.steps or any(s % c.save_every == 0 or s == c.steps for s in range(now, target)):
                break
            key = (target - 1, 0)
            if not self.source.has(key):
                self.submit(key, t.sampler.next_indices(t.cfg.rollout.prompts_per_step))

    def metrics(self) -> dict[str, float]:
        """``async/*``: the step's mean and largest staleness (training steps between the behaviour weights and
        the trained ones), the trainer's wait for rollouts, the worker's idle and sampling time, reward time."""
        a, self.step_sums = self.step_sums, defaultdict(float)
        return {
            "async/staleness_mean": a["staleness_sum"] / max(a["samples"], 1.0),
            "async/staleness_max": a["staleness_max"],
            "async/trainer_wait_s": a["trainer_wait_s"],
            "async/worker_idle_s": a["worker_idle_s"],
            "async/worker_sample_s": a["worker_sample_s"],
            "async/worker_sample_cpu_s": a["worker_sample_cpu_s"],
            "async/reward_s": a["reward_s"],
        }

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
            self.source = None


def round_source(trainer: Any) -> SyncRounds | AsyncRounds:
    """`AsyncRounds` when the config sets ``trainer.async``, else `SyncRounds`."""
    return AsyncRounds(trainer) if trainer.cfg.trainer.async_ is not None else SyncRounds(trainer)
