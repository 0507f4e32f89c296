"""GroupTrainer: rollout -> reward -> advantage -> filter -> update, on accelerate.

One loop serves every policy (any model family): the policy turns prompts into a `Rollout`
of actions with log-probs, the reward set scores the samples, an estimator from
`mmalign.algorithms.advantages` turns rewards into group-relative advantages, a filter from
`mmalign.algorithms.filters` keeps informative groups, and a loss from `mmalign.algorithms.losses` updates the policy.

Distributed runs: every process samples its own share of the prompts (whole groups, never
split), rewards are gathered from all processes before advantages are computed, so N processes
give the same advantages as one. Loss normalisers (token counts, sequence counts) are global. A model
sharded with FSDP2 before the trainer is built (`mmalign.training.distributed.apply_fsdp2`, or accelerate's FSDP2
plugin) is not wrapped in DDP; its checkpoints are sharded (DCP) folders that every rank writes and reads
(``docs/distributed.md``).

Run directory (``output_dir``): ``config.yaml``, ``metrics.jsonl`` (one JSON object per step),
``samples/`` (what `Policy.sample_view` shows of each sample, its rewards and advantage), ``checkpoints/``
(trainable weights, optimizer, scheduler, RNG of each process -- the global ones and the policy's own
generators -- sampler and filter state) and ``final/`` (the trained model or adapter); `mmalign.training.rundir`
owns that layout. The main process holds the run lock (`mmalign.training.runlock`: one writer per run directory) from
set-up until `train` ends. A resume compares the config with the run's saved one: the changes listed in
`mmalign.training.resume.RESUME_APPLIES` (learning rate, schedule, clipping, steps, intervals, ...) are applied, any other is refused.

The trainer knows no modality: what is special to a model family sits behind the hooks of
`mmalign.policies.base.Policy` (sampling, materialising outputs for the rewards, what a sample looks
like in the run directory), what is special to a domain in the pipeline's `TrainingSetup`. It knows no tool
either: live diagnostics and experiment trackers reach it as monitors (`TrainerCallback`), which the app
layer passes in (`mmalign.app.run.build_trainer`); without them it trains, writes the run directory and
logs nothing else.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from mmalign.algorithms import advantages as adv_lib
from mmalign.algorithms import filters as filter_lib
from mmalign.algorithms import losses as loss_lib
from mmalign.algorithms.composition import LossComposer, MicroLoss, Tally
from mmalign.algorithms.estimation import Estimation, Round
from mmalign.algorithms.names import check_names
from mmalign.algorithms.round_hooks import build_round_hooks
from mmalign.config import Config, ConfigError
from mmalign.data import prompt_samplers as sampler_lib
from mmalign.data.batch import Rollout
from mmalign.errors import NonFiniteError, RunWriteError, TrainingError
from mmalign.policies.base import RunInfo
from mmalign.training import checkpoint, outputs, rundir, runlock
from mmalign.training import distributed as dist_lib
from mmalign.training.callbacks import TrainerCallback
from mmalign.training.distributed import check_batches, is_fsdp2
from mmalign.training.resume import ConfigChange
from mmalign.training.rounds import round_source
from mmalign.training.seeding import (
    set_seed,
)

log = logging.getLogger(__name__)


class GroupTrainer:
    """The training loop shared by every pipeline. See the module docstring."""

    sharded: bool = False
    """The model is FSDP2-sharded (set in `__init__`)."""
    monitors: Sequence[TrainerCallback] = ()
    """Run monitors (`TrainerCallback`): live diagnostics, experiment trackers. Not checkpointed."""

    def __init__(
        self,
        cfg: Config,
        components: Any,
        *,
        resume: bool = False,
        accelerator: Any = None,
        monitors: Sequence[TrainerCallback] = (),
    ) -> None:
        from accelerate import Accelerator

        self.monitors = list(monitors)
        self.cfg = cfg
        self.policy = components.policy
        self.reward_set = components.rewards
        self.rows = components.data
        self.callbacks = list(components.callbacks)
        self.sample_columns = list(getattr(components, "sample_columns", ()))
        """Dataset columns written beside each sample in the run directory (the pipeline's choice)."""
        acc_kwargs: dict[str, Any] = {}
        for monitor in self.monitors:
            if hasattr(monitor, "accelerator_kwargs"):
                acc_kwargs.update(monitor.accelerator_kwargs())
        self.accelerator = accelerator or Accelerator(
            cpu=cfg.trainer.cpu, mixed_precision=cfg.trainer.mixed_precision, **acc_kwargs
        )
        acc = self.accelerator
        dist_lib.check_launch(acc.distributed_type, acc.num_processes)  # N launched processes, N set up
        self.emit("on_init")
        self.world = acc.num_processes
        self.rank = acc.process_index
        self.is_main = acc.is_main_process
        self.out = Path(cfg.output_dir)

        check_names(self.cfg)  # registry names, checked up front with the config key in the message
        check_batches(cfg, self.world)
        self._set_algorithm()
        updates_per_pass = self._set_batching()
        self._set_optimization(updates_per_pass)
        self._set_prompt_sampler()
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 7919)
        self.step = 0
        self.nan_reward_run: dict[str, int] = {}
        """Per reward: the consecutive steps (up to now) in which it was NaN for every sample."""
        self.history: list[dict[str, Any]] = []
        self.timers: dict[str, float] = defaultdict(float)
        self.reward_extra: dict[str, float] = {}
        """The reward set's own metrics of the last round (``last_metrics``)."""
        self.rounds = round_source(self)
        """Where rounds are sampled (`mmalign.training.rounds`: now, or by asynchronous rollout workers)."""
        self._stop_reason: str | None = None
        """Set by `request_stop`: the loop ends after the current step."""
        self.async_rngs: list[Any] | None = None
        """The rollout workers' random states read from the checkpoint resumed from (None: start fresh)."""
        set_seed(cfg.seed + 1000 * self.rank)
        self.run_lock: runlock.RunLock | None = None
        """The main process's hold on the run lock (`mmalign.training.runlock`), from set-up until `train` ends."""
        self.resumed_from: Path | None = None
        """The checkpoint a resume loaded (None: a new run)."""
        self.config_changes: list[ConfigChange] = []
        """A resume's changed config keys, each applied (`mmalign.training.resume.RESUME_APPLIES`)."""
        self._prepare_output_dir(resume)

    # ----------------------------------------------------------------- set-up
    def _set_algorithm(self) -> None:
        """The estimator, loss and group filter of ``algorithm``, with the checks that need the rewards."""
        cfg, a = self.cfg, self.cfg.algorithm
        self.composer = LossComposer(cfg, world=self.world, policy_name=type(self.policy).__name__)
        """The microbatch loss (`mmalign.algorithms.composition`)."""
        self.estimation = Estimation(
            cfg, self.reward_set, self.policy, loss_needs=self.composer.needs, main=self.is_main
        )
        """Rewards to advantages, with the context its parts declare (`mmalign.algorithms.estimation`)."""
        self.estimator_state = self.estimation.state
        self.round_hooks = build_round_hooks(cfg, self.reward_set.weights.tolist())
        """Steps between a round's rewards and the estimator (`mmalign.algorithms.round_hooks`), by name."""
        self._hook_stats: dict[str, float] = {}
        self.chunkable_loss = a.objective is not None or not loss_lib.couples_actions(a.loss)
        """The loss can be evaluated on a part of a sample's actions (`Policy.action_chunks` is honoured)."""
        try:
            self.group_filter = filter_lib.build_filter(a.filter, **a.filter_kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{cfg.source}: key 'algorithm.filter_kwargs': {e}") from None

    def _set_batching(self) -> int:
        """Prompts, minibatches and microbatches per process; returns the optimizer updates per pass over a rollout."""
        r, t = self.cfg.rollout, self.cfg.trainer
        self.local_prompts = r.prompts_per_step // self.world
        self.samples_per_group = r.group_size + self.estimation.extra_samples
        local_batch = self.local_prompts * self.samples_per_group
        self.minibatch = (t.minibatch_size // self.world) if t.minibatch_size else None
        self.microbatch = t.microbatch_size or self.minibatch or local_batch
        updates_per_pass = math.ceil(local_batch / self.minibatch) if self.minibatch else 1
        return updates_per_pass

    def _set_optimization(self, updates_per_pass: int) -> None:
        """AdamW and the LR schedule on the trainable parameters, accelerate's preparation, the policy's `setup`."""
        from accelerate.utils import DistributedType

        cfg, acc, a, t = self.cfg, self.accelerator, self.cfg.algorithm, self.cfg.trainer
        params = self.policy.trainable_parameters()
        if not params:
            raise ConfigError(f"{cfg.source}: the policy has no trainable parameters (check model.lora)")
        self.optimizer = torch.optim.AdamW(
            params, lr=t.lr, betas=tuple(t.betas), eps=t.adam_eps, weight_decay=t.weight_decay
        )
        # a function of the config, not a bound method: no cycle, so a dropped trainer frees its run lock at once
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, functools.partial(lr_factor, t))
        if is_fsdp2(self.policy.model) and acc.distributed_type != DistributedType.FSDP:
            # sharded before the trainer was built (`mmalign.training.distributed.apply_fsdp2`): FSDP2 syncs the
            # gradients; accelerate's MULTI_CPU / MULTI_GPU prepare would wrap the model in DDP
            self.policy.forward_model, self.optimizer = self.policy.model, acc.prepare(self.optimizer)
        else:
            self.policy.forward_model, self.optimizer = acc.prepare(self.policy.model, self.optimizer)
        self.sharded = is_fsdp2(self.policy.forward_model)
        """The model is FSDP2-sharded (DTensor parameters): gradient sync by FSDP, sharded (DCP) checkpoints."""
        self.policy.setup(RunInfo(cfg=cfg, accelerator=acc, rank=self.rank, world=self.world))
        self.callbacks.extend(self.policy.callbacks())  # checkpointed after the pipeline's, in this order
        # logp_old is needed when the weights change between updates on one rollout, and when the policy
        # samples elsewhere (that sampler's own log-probs then only enter the importance-sampling correction)
        self.need_logp_old = (
            t.num_iterations > 1
            or updates_per_pass > 1
            or a.filter == "replay"
            or self.policy.needs_logp_old
            or self.estimation.needs_logp_old
            or any(h.needs_logp_old for h in self.round_hooks.values())
        )

    def _set_prompt_sampler(self) -> None:
        """The prompt sampler of ``data.sampler`` over the training rows."""
        cfg = self.cfg
        opts = dict(cfg.data.sampler_kwargs)
        if cfg.data.sampler == "uniform":
            opts.setdefault("shuffle", cfg.data.shuffle)
        try:
            self.sampler = sampler_lib.build_sampler(cfg.data.sampler, len(self.rows), cfg.seed, **opts)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{cfg.source}: key 'data.sampler_kwargs': {e}") from None
        if isinstance(self.sampler, sampler_lib.SpoSampler) and isinstance(
            self.estimator_state, adv_lib.SPOTracker
        ):
            self.sampler.attach(self.estimator_state)  # SPO: the sampler reads the estimator's tracker

    def emit(self, hook: str, *args: Any) -> None:
        """Call `hook` (a `TrainerCallback` method) on every callback, then every monitor, that has it."""
        for target in (*self.callbacks, *self.monitors):
            fn = getattr(target, hook, None)
            if fn is not None:
                fn(self, *args)

    def lr_factor(self, step: int) -> float:
        """The learning-rate multiplier at `step` (`lr_factor`)."""
        return lr_factor(self.cfg.trainer, step)

    def _prepare_output_dir(self, resume: bool) -> None:
        outputs.prepare_output_dir(self, resume)

    def _take_run_lock(self) -> None:
        outputs.take_run_lock(self)

    def release_run_lock(self) -> None:
        """Give up this trainer's hold on the run lock (`train` does when it ends; it takes it again to train
        more)."""
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None

    # ----------------------------------------------------------------- rollout
    def gather(self, x: Tensor) -> Tensor:
        return self.accelerator.gather(x.contiguous()) if self.world > 1 else x

    def gather_padded(self, x: Tensor) -> Tensor:
        """Gather a Float[B,T] tensor whose T may differ between processes (padded with 0 on dim 1)."""
        if self.world == 1:
            return x
        return self.gather(self.accelerator.pad_across_processes(x.contiguous(), dim=1, pad_index=0))

    def _generate_round(self) -> tuple[Rollout, Tensor, Tensor, Tensor, Tensor]:
        """One round of sampling on this process; returns (local rollout, global rewards, global groups, global
        numbers of valid actions per sample, global prompt ids: each sample's dataset row index)."""
        pps = self.cfg.rollout.prompts_per_step
        idx, rollout, rewards = self.rounds.next_round((self.step, self._round))
        round_base = self._round * pps
        # global group ids: position of the prompt in this step's global list, offset per round
        offset = self._round * pps + self.rank * self.local_prompts
        rollout.group = rollout.group + offset
        self._round += 1
        rewards = rewards.to(rollout.group.device)
        rollout.rewards = rewards
        rollout.reward_names = list(self.reward_set.names)
        if self.round_hooks:  # e.g. hints / replay for this process's all-fail groups
            pids = [idx[int(g) - round_base] for g in rollout.group.tolist()]
            self._hook_stats = {}
            for hook in self.round_hooks.values():
                rollout, rewards, stats = hook.after_rewards(rollout, rewards, pids, self.rows, self)
                self._hook_stats.update(stats)
            rollout.reward_names = list(self.reward_set.names)
        g_rewards, g_group = self.gather(rewards), self.gather(rollout.group)
        # callbacks that follow the rewards (curricula): the GLOBAL batch in global group order, so their
        # decisions are the same on every process and for any number of processes
        self.emit("on_rewards", g_rewards, g_group, list(self.reward_set.names))
        g_actions = self.gather(rollout.mask.sum(dim=1).to(rollout.group.device))
        # feedback for adaptive prompt samplers, from the GLOBAL batch so every rank's sampler agrees
        total = adv_lib.combine_rewards(g_rewards, self.reward_set.weights.tolist())
        ids, rates, counts = sampler_lib.group_successes(total, g_group, self.cfg.data.success_threshold)
        self.sampler.observe([idx[int(g) - round_base] for g in ids], rates, counts)
        g_prompt = torch.tensor([idx[int(g) - round_base] for g in g_group.tolist()], dtype=torch.long)
        return rollout, g_rewards, g_group, g_actions, g_prompt

    def regenerate(self, rows: list[dict[str, Any]], size: int) -> tuple[Rollout, Tensor]:
        """`size` fresh samples of each of `rows` with the current weights, scored by the reward set (for the
        round hooks, `mmalign.algorithms.round_hooks`: e.g. hinted re-rolls)."""
        rollout = self.policy.rollout(rows, size, compute_logp=self.need_logp_old)
        self.policy.materialize(rollout, self.reward_set.needs)
        return rollout, self.reward_set(rollout).to(rollout.group.device)

    def rows_of(self, idx: list[int]) -> list[dict[str, Any]]:
        """This process's dataset rows of a round's global prompt indices."""
        return [
            self.rows[i] for i in idx[self.rank * self.local_prompts : (self.rank + 1) * self.local_prompts]
        ]

    @torch.no_grad()
    def current_logprobs(self, rollout: Rollout) -> Tensor:
        """Float[B,T]: the log-probs of a rollout's actions under the trainer's current weights (pi_old of a stale
        rollout), in microbatches, in training mode as the update scores them."""
        return self._current(
            rollout, "logp", "trainer.async.max_staleness > 0 needs them for the importance weights"
        )

    @torch.no_grad()
    def current_entropy(self, rollout: Rollout) -> Tensor:
        """Float[B,T]: the policy's per-action entropy on a rollout under the current weights (for estimators that
        read ``entropy_mean``), scored as `current_logprobs`."""
        return self._current(
            rollout, "entropy", f"algorithm.estimator {self.cfg.algorithm.estimator!r} reads it"
        )

    def _current(self, rollout: Rollout, what: str, why: str) -> Tensor:
        self.policy.model.train()
        parts = []
        for start in range(0, len(rollout), self.microbatch):
            with torch.no_grad():  # numbers only: no graph to build
                stats = self.policy.action_stats(
                    rollout[list(range(start, min(start + self.microbatch, len(rollout))))]
                )
            value = getattr(stats, what)
            if value is None:
                raise TrainingError(f"{type(self.policy).__name__}.action_stats gives no {what}: {why}")
            parts.append(value.detach().float())
        out = torch.cat(parts).to(rollout.mask.device)
        if out.shape != rollout.mask.shape:
            raise TrainingError(
                f"current {what} of shape {tuple(out.shape)} for a mask of {tuple(rollout.mask.shape)}"
            )
        return out.masked_fill(~rollout.mask, 0.0)

    def compute_advantages(
        self,
        rewards: Tensor,
        group: Tensor,
        num_actions: Tensor | None = None,
        step_rewards: Tensor | None = None,
        step_mask: Tensor | None = None,
        context: adv_lib.EstimatorContext | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Advantages and loss-sample mask of the GLOBAL batch (`Estimation.compute`)."""
        return self.estimation.compute(rewards, group, num_actions, step_rewards, step_mask, context)

    def local_slice(self, x: Tensor, n_local: int) -> Tensor:
        return x[self.rank * n_local : (self.rank + 1) * n_local]

    def make_rollout(self) -> tuple[Rollout, dict[str, float]]:
        """Sample, score, compute advantages and filter until the batch is full (or rounds run out)."""
        self._round = 0
        f = self.group_filter
        rounds = f.max_rounds if f.resample else 1
        kept: list[Rollout] = []
        first_stats: dict[str, float] = {}
        all_rewards, all_groups, all_prompts = [], [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            rollout, g_rewards, g_group, g_actions, g_prompt = self._generate_round()
            self.timers["rollout"] += time.perf_counter() - t0
            g_steps = g_step_mask = None
            if rollout.step_rewards is not None:
                g_steps = self.gather_padded(rollout.step_rewards.float())
                g_step_mask = self.gather_padded(rollout.mask.to(torch.uint8)).bool()
            rnd = Round(rollout, g_rewards, g_group, g_actions, g_prompt)
            context = self.estimation.context(rnd, self, self.policy)
            adv, keep = self.compute_advantages(g_rewards, g_group, g_actions, g_steps, g_step_mask, context)
            self.estimation.record(rnd, self)  # what the algorithm's declared needs keep from this round
            n_local = len(rollout)
            adv = self.local_slice(adv, n_local)
            if adv.dim() == 2:  # per-step advantages: back to this process's number of actions
                adv = adv[:, : rollout.mask.shape[1]]
            rollout.advantages = adv.to(rollout.mask.device)
            # the actions the advantages were computed over, before samples are left out of the loss below
            rollout.outputs["advantage_mask"] = rollout.mask.clone()
            excluded = rollout.outputs.get("exclude_from_loss")
            if isinstance(excluded, Tensor) and bool(excluded.any()):
                # e.g. over-turn masking: these samples counted in their group's statistics, not in the loss
                rollout.mask = rollout.mask & ~excluded[:, None].to(rollout.mask.device)
            keep_local = self.local_slice(keep, n_local)
            if not bool(keep_local.all()):
                rollout.mask = rollout.mask & keep_local[:, None].to(rollout.mask.device)
            scores = adv_lib.combine_rewards(rollout.rewards, self.reward_set.weights.tolist())
            if not first_stats:
                outputs.check_nan_rewards(self, g_rewards)
                first_stats = outputs.reward_metrics(self, g_rewards, g_group, rollout)
            all_rewards.append(g_rewards)
            all_groups.append(g_group)
            all_prompts.extend(rollout.prompts)
            kept.append(f(rollout, scores))
            n_groups = sum(len(k.group_ids()) for k in kept)
            counts = self.gather(torch.tensor([n_groups]))
            if int(counts.min()) >= self.local_prompts:
                break
        batch = Rollout.cat(kept)
        # every process trains on the same number of groups (DDP needs matching backward calls)
        n_groups = len(batch.group_ids())
        n_min = int(self.gather(torch.tensor([n_groups])).min())
        n_use = min(n_min, self.local_prompts)
        if n_use < n_groups:
            batch = batch.select_groups(batch.group_ids()[:n_use])
        stats = dict(first_stats)
        stats.update({k: float(v) for k, v in f.last_stats().items()})
        stats.update({k: float(v) for k, v in self.sampler.last_stats().items()})
        stats.update(self._hook_stats)  # e.g. hints/groups, replay/injected (the last round's)
        stats["filter/rounds"] = float(self._round)
        stats["filter/groups_used"] = float(n_use * self.world)
        return batch, stats

    # ----------------------------------------------------------------- update
    def _global_sum(self, x: float) -> float:
        if self.world == 1:
            return x
        return float(self.gather(torch.tensor([x], dtype=torch.float64)).sum())

    def update(self, batch: Rollout) -> dict[str, float]:
        """`trainer.num_iterations` passes over `batch`, one optimizer step per minibatch, whose gradient is
        accumulated over microbatches; returns the update's metrics."""
        if self.cfg.algorithm.kl_coef > 0 and not self.policy.kl_in_action_stats:
            batch.logp_ref = self.policy.reference_logprobs(batch).detach()
        tally = Tally()
        for _epoch in range(self.cfg.trainer.num_iterations):
            for mb in self._minibatches(batch):
                n_tok, n_seq = self._global_sum(float(mb.mask.sum())), self._global_sum(float(len(mb)))
                starts = range(0, len(mb), self.microbatch)
                for start in starts:
                    mu = mb[list(range(start, min(start + self.microbatch, len(mb))))]
                    self._microbatch_backward(mu, n_tok, n_seq, tally, last=start == starts[-1])
                tally.add_optimizer_step(self._optimizer_step())
        return self._update_metrics(tally)

    def _microbatch_backward(
        self, mu: Rollout, n_tok: float, n_seq: float, tally: Tally, *, last: bool
    ) -> None:
        """Forward and backward of microbatch `mu`: in one piece, or in the chunks of its actions the policy
        names (`Policy.action_chunks`), one `action_stats` and one backward per chunk, each chunk's loss
        aggregated with the whole microbatch's normalisers so the accumulated gradient is the one-piece
        gradient while only one chunk's graph is alive. Gradients are synced across processes on the last
        backward of the minibatch (`last`: `mu` is its last microbatch)."""
        chunks = self.policy.action_chunks(mu) if self.chunkable_loss else None
        if not chunks or len(chunks) == 1:
            with self._grad_sync(last=last):
                micro = self._microbatch_loss(mu, n_tok, n_seq)
                self.accelerator.backward(micro.total)
            tally.add_microbatch(micro, self.world)
            return
        for k, idx in enumerate(chunks):
            with self._grad_sync(last=last and k == len(chunks) - 1):
                micro = self._microbatch_loss(mu, n_tok, n_seq, actions=idx, measure_is=k == 0)
                self.accelerator.backward(micro.total)
            tally.add_microbatch(micro, self.world)

    def _minibatches(self, batch: Rollout) -> Iterator[Rollout]:
        """One pass over `batch` in minibatches of this process's share of `trainer.minibatch_size` (the whole
        batch when unset), reshuffled (`shuffle_gen`) when `trainer.shuffle_minibatches` and the update makes
        more than one optimizer step."""
        t, n = self.cfg.trainer, len(batch)
        size = self.minibatch or n
        shuffle = t.shuffle_minibatches and t.num_iterations * math.ceil(n / size) > 1
        order = torch.randperm(n, generator=self.shuffle_gen).tolist() if shuffle else list(range(n))
        for start in range(0, n, size):
            yield batch[order[start : start + size]]

    def _grad_sync(self, *, last: bool) -> contextlib.AbstractContextManager[Any]:
        """The context of a microbatch's backward: gradients are synced across processes on the last one only."""
        if last:
            return contextlib.nullcontext()
        if self.sharded:
            return dist_lib.no_grad_sync(self.policy.forward_model)
        return self.accelerator.no_sync(self.policy.forward_model)

    def _microbatch_loss(
        self,
        mu: Rollout,
        n_tok: float,
        n_seq: float,
        *,
        actions: Tensor | None = None,
        measure_is: bool = True,
    ) -> MicroLoss:
        """The policy's `action_stats` of microbatch `mu` (of its chunk `actions`) turned into its loss by the
        `LossComposer`."""
        stats = (
            self.policy.action_stats(mu) if actions is None else self.policy.action_stats(mu, actions=actions)
        )
        return self.composer(
            stats,
            mu,
            n_tok,
            n_seq,
            actions=actions,
            measure_is=measure_is,
            step=self.step,
            max_actions=self.policy.max_actions,
        )

    def _optimizer_step(self) -> float | None:
        """Clip the accumulated gradients (`trainer.max_grad_norm`), step the optimizer, clear the gradients;
        returns the gradient norm before clipping (None without clipping)."""
        max_norm, grad_norm = self.cfg.trainer.max_grad_norm, None
        if max_norm is not None:
            if self.sharded:  # the global norm over all shards, as a plain tensor
                grad_norm = float(dist_lib.clip_grad_norm_(self.policy.trainable_parameters(), max_norm))
            else:
                grad_norm = float(
                    self.accelerator.clip_grad_norm_(self.policy.trainable_parameters(), max_norm)
                )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.policy.after_optimizer_step()
        return grad_norm

    def _update_metrics(self, tally: Tally) -> dict[str, float]:
        """The update's metrics: this process's (`Tally.metrics`), averaged over processes; the loss, of which
        each process holds its share, summed."""
        m = tally.metrics(kl=self.cfg.algorithm.kl_coef > 0)
        if self.world > 1:
            vec = self.gather(torch.tensor([m[k] for k in sorted(m)], dtype=torch.float64).reshape(1, -1))
            m = dict(zip(sorted(m), vec.mean(0).tolist(), strict=True))
            m["loss"] *= self.world
        return m

    def _check_finite_update(self, metrics: dict[str, float]) -> None:
        """Stop (`NonFiniteError`) when the update's loss or gradient norm is NaN or infinite. Under fp16 an
        infinite gradient is the loss scaler's business (it skips the step), so only the weights are checked
        there (when a checkpoint is written)."""
        if self.cfg.trainer.mixed_precision == "fp16":
            return
        for key in ("loss", "grad_norm"):
            value = metrics.get(key)
            if value is not None and not math.isfinite(value):
                raise NonFiniteError(f"the update's {key} is {value}")

    # ----------------------------------------------------------------- one step
    def train_step(self) -> dict[str, Any]:
        self.timers: dict[str, float] = defaultdict(float)
        t0 = time.perf_counter()
        batch, metrics = self.make_rollout()
        self.rounds.before_update()  # asynchronous workers sample the next steps while this one updates
        t1 = time.perf_counter()
        self.policy.model.train()
        if len(batch):
            metrics.update(self.update(batch))
            self._check_finite_update(metrics)
            adv = outputs.per_sample(batch.advantages, batch.mask)
            metrics["adv/abs_mean"] = float(self.gather(adv.abs().mean().reshape(1)).mean())
        else:
            tqdm.write(f"step {self.step + 1}: no informative group after filtering; the update is skipped")
        with warnings.catch_warnings():  # a skipped update still advances the per-step LR schedule
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
            self.scheduler.step()
        self.step += 1
        t2 = time.perf_counter()
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        metrics["time/rollout_s"] = self.timers["rollout"] - self.timers["reward"]
        metrics["time/reward_s"] = self.timers["reward"]
        if self.timers["materialize"] >= 1e-3:  # part of time/reward_s (e.g. latents -> pixels)
            metrics["time/materialize_s"] = self.timers["materialize"]
        metrics["time/update_s"] = t2 - t1
        metrics["time/step_s"] = t2 - t0
        metrics.update(self.rounds.metrics())
        self._last_batch = batch
        return {"step": self.step, **metrics}

    # ----------------------------------------------------------------- run
    def request_stop(self, reason: str) -> None:
        """For callbacks and monitors (e.g. in ``on_step_end``): end `train` after the current step, with that
        step's metrics, samples and a checkpoint written as for the last step. `train` returns normally; a caller
        that wants the run to fail raises its own error (e.g. from ``on_train_end``)."""
        self._stop_reason = reason

    def train(self) -> list[dict[str, Any]]:
        """Train until `trainer.steps`; returns the metrics of the steps run now. The run lock is held while it
        runs (taken again when an earlier `train` released it) and released when it returns or fails."""
        self._take_run_lock()
        try:
            return self._train()
        finally:
            self.release_run_lock()

    def _train(self) -> list[dict[str, Any]]:
        t = self.cfg.trainer
        bar = tqdm(
            total=t.steps,
            initial=self.step,
            desc="train",
            disable=not (self.is_main and t.progress_bar),
            dynamic_ncols=True,
        )
        metrics_f = None
        if self.is_main:
            with rundir.writing(self.out / rundir.METRICS_FILE):
                metrics_f = (self.out / rundir.METRICS_FILE).open("a")
        try:
            self._stop_reason = None
            self.emit("on_train_start", self.step)
            while self.step < t.steps:
                try:
                    m = self.train_step()
                except Exception as e:
                    raise outputs.stop_error(self, e, self.step + 1) from e
                # callbacks may add their numbers to `m` (a curriculum's threshold); monitors see them
                self.emit("on_step_end", self.step, m)
                self.history.append(m)
                last = self.step == t.steps or self._stop_reason is not None  # written as the run's last step
                try:  # what the step writes: an I/O error names the file and the last complete checkpoint
                    if self.step % t.log_every == 0 or last:
                        if metrics_f is not None:
                            with rundir.writing(metrics_f.name):
                                metrics_f.write(json.dumps(rundir.jsonable(m)) + "\n")
                                metrics_f.flush()
                                os.fsync(metrics_f.fileno())
                        self.emit("on_log", self.step, m)
                    if self.step % t.sample_every == 0 or self.step == 1:
                        with rundir.writing(
                            rundir.samples_file(self.out, self.step).with_suffix(""), runtime=False
                        ):
                            self.dump_samples(self._last_batch)
                    if self.step % t.save_every == 0 or last:
                        self.save_checkpoint()
                except (RunWriteError, NonFiniteError) as e:
                    raise outputs.stop_error(self, e, self.step, after=True) from e
                bar.set_postfix(
                    reward=f"{m.get('reward/mean', float('nan')):.3f}", step_s=f"{m['time/step_s']:.2f}"
                )
                bar.update(1)
                if self._stop_reason is not None:
                    break
        finally:
            bar.close()
            self.rounds.close()
            if metrics_f is not None:
                with contextlib.suppress(OSError):  # a full disk: the failed append has said which file
                    metrics_f.close()
            self.emit("on_train_end")
        try:
            with rundir.writing(self.out / rundir.FINAL_DIR, runtime=False):
                if self.sharded:
                    checkpoint.save_final_sharded(self, self.out / rundir.FINAL_DIR)
                elif self.is_main:
                    self.policy.save(self.out / "final")
        except RunWriteError as e:
            raise outputs.stop_error(self, e, self.step, after=True) from e
        self.accelerator.wait_for_everyone()
        return self.history

    # ----------------------------------------------------------------- samples
    def dump_samples(self, batch: Rollout) -> None:
        """Write this step's samples into the run directory (`mmalign.training.outputs.dump_samples`)."""
        outputs.dump_samples(self, batch)

    # ----------------------------------------------------------------- checkpoints
    def state_parts(self) -> dict[str, Any]:
        """The stateful parts a checkpoint saves by name (`state_dict` / `load_state_dict`; None: not in this
        run): the prompt sampler, the group filter and what the algorithm's parts keep across steps."""
        return {
            "sampler": self.sampler,
            "filter": self.group_filter,
            **self.estimation.state_parts(),
            **self.round_hooks,
        }

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_N/`` (`mmalign.training.checkpoint.save_checkpoint`)."""
        return checkpoint.save_checkpoint(self)

    def load_checkpoint(self, path: Path) -> None:
        """Restore the run from the checkpoint folder `path` (`mmalign.training.checkpoint.load_checkpoint`)."""
        checkpoint.load_checkpoint(self, path)


def lr_factor(t: Any, step: int) -> float:
    """``trainer.lr``'s multiplier at `step` (config `t`): warm-up, then constant, linear or cosine decay."""
    if t.warmup_steps and step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.lr_scheduler == "constant":
        return 1.0
    span = max(1, t.steps - t.warmup_steps)
    frac = min(1.0, (step - t.warmup_steps) / span)
    if t.lr_scheduler == "linear":
        return 1.0 - frac
    return 0.5 * (1.0 + math.cos(math.pi * frac))
