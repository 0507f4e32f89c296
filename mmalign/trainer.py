"""GroupTrainer: rollout -> reward -> advantage -> filter -> update, on accelerate.

One loop serves every policy (any model family): the policy turns prompts into a `Rollout`
of actions with log-probs, the reward set scores the samples, an estimator from
`mmalign.advantages` turns rewards into group-relative advantages, a filter from
`mmalign.filters` keeps informative groups, and a loss from `mmalign.losses` updates the policy.

Distributed runs: every process samples its own share of the prompts (whole groups, never
split), rewards are gathered from all processes before advantages are computed, so N processes
give the same advantages as one. Loss normalisers (token counts, sequence counts) are global. A model
sharded with FSDP2 before the trainer is built (`mmalign.distributed.apply_fsdp2`, or accelerate's FSDP2
plugin) is not wrapped in DDP; its checkpoints are sharded (DCP) folders that every rank writes and reads
(``docs/distributed.md``).

Run directory (``output_dir``): ``config.yaml``, ``metrics.jsonl`` (one JSON object per step),
``samples/`` (what `Policy.sample_view` shows of each sample, its rewards and advantage), ``checkpoints/``
(trainable weights, optimizer, scheduler, RNG of each process -- the global ones and the policy's own
generators -- sampler and filter state) and ``final/`` (the trained model or adapter); `mmalign.rundir`
owns that layout. The main process holds the run lock (`mmalign.runlock`: one writer per run directory) from
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
import json
import logging
import math
import os
import shutil
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import yaml
from torch import Tensor
from tqdm.auto import tqdm

from mmalign import advantages as adv_lib
from mmalign import distributed as dist_lib
from mmalign import filters as filter_lib
from mmalign import group_refill as refill_lib
from mmalign import losses as loss_lib
from mmalign import prompt_samplers as sampler_lib
from mmalign import reward_transforms as rt_lib
from mmalign import rundir, runlock
from mmalign.algorithms.composition import LossComposer, MicroLoss, Tally
from mmalign.batch import Rollout
from mmalign.config import GUARD_ADV_CLIP, Config, ConfigError, check_names
from mmalign.data import DataError
from mmalign.distributed import is_fsdp2
from mmalign.errors import CheckpointError, MmalignError, RunWriteError
from mmalign.policies.base import RunInfo
from mmalign.training.resume import ConfigChange, resume_changes
from mmalign.training.seeding import (
    rng_state,
    set_rng_state,
    set_seed,
    set_worker_rng_state,
    worker_rng_state,
)

log = logging.getLogger(__name__)


class TrainingError(MmalignError, RuntimeError):
    """Training stopped; the message says at which step and what was kept."""


class NonFiniteError(TrainingError):
    """A NaN or infinity in the loss, the gradient norm or the weights: the run stops rather than train on
    garbage, and no checkpoint with non-finite weights is written."""


class TrainerCallback(Protocol):
    """What `GroupTrainer` calls on its callbacks (the pipeline's ``TrainingSetup.callbacks``) and monitors (the
    ``monitors`` argument: the app's live doctor and trackers). Every method is optional; the trainer calls
    only those an object has, callbacks first, each in list order, on every process (a hook that should act
    on the main process only checks ``trainer.is_main``).

    - ``accelerator_kwargs()``: keyword arguments for the ``Accelerator`` the trainer builds (monitors only;
      unused when an accelerator is passed in);
    - ``on_init(trainer)``: the accelerator exists (``trainer.accelerator``), nothing else is set up yet;
    - ``on_train_start(trainer, step)``: `GroupTrainer.train` starts, continuing after `step`;
    - ``on_rewards(trainer, rewards, group, names)``: the gathered rewards of a sampling round;
    - ``on_step_end(trainer, step, metrics)``: every step's metrics, which it may add to;
    - ``on_log(trainer, step, metrics)``: the steps written to ``metrics.jsonl``;
    - ``on_samples(trainer, step, rows, views)``: the steps whose samples are written: this process's rows (as
      the run directory stores them) and `Policy.sample_view`'s views of them;
    - ``on_train_end(trainer)``: `train` ends, also when it fails;
    - any hook may call ``trainer.request_stop(reason)`` to end the run after the current step (written as the
      last step: metrics, samples, a checkpoint);
    - ``state_dict()`` / ``load_state_dict(state)``: saved in and restored from checkpoints (callbacks only).

    (Every hook being optional, the protocol declares none; it names the contract.)
    """


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
        self._emit("on_init")
        self.world = acc.num_processes
        self.rank = acc.process_index
        self.is_main = acc.is_main_process
        self.out = Path(cfg.output_dir)
        r = cfg.rollout

        self._check_names()
        if r.prompts_per_step % self.world:
            raise ConfigError(
                f"{cfg.source}: key 'rollout.prompts_per_step' ({r.prompts_per_step}) must be divisible by "
                f"the number of processes ({self.world})"
            )
        self._set_algorithm()
        updates_per_pass = self._set_batching()
        self._set_optimization(updates_per_pass)
        self._set_prompt_sampler()
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 7919)
        self.step = 0
        self._nan_reward_run: dict[str, int] = {}
        """Per reward: the consecutive steps (up to now) in which it was NaN for every sample."""
        self.history: list[dict[str, Any]] = []
        self._timers: dict[str, float] = defaultdict(float)
        self.async_cfg = cfg.trainer.async_
        """``trainer.async`` (None: synchronous rollouts)."""
        self._async: Any = None
        self._stop_reason: str | None = None
        """Set by `request_stop`: the loop ends after the current step."""
        """The rollout workers of an asynchronous run (`mmalign.asynchronous.AsyncRollouts`), started by the first
        `train_step`."""
        self._async_rngs: list[Any] | None = None
        """The rollout workers' random states read from the checkpoint resumed from (None: start fresh)."""
        self._async_step: dict[str, float] = defaultdict(float)
        set_seed(cfg.seed + 1000 * self.rank)
        self._run_lock: runlock.RunLock | None = None
        """The main process's hold on the run lock (`mmalign.runlock`), from set-up until `train` ends."""
        self.resumed_from: Path | None = None
        """The checkpoint a resume loaded (None: a new run)."""
        self.config_changes: list[ConfigChange] = []
        """A resume's changed config keys, each applied (`mmalign.training.resume.RESUME_APPLIES`)."""
        self._prepare_output_dir(resume)

    # ----------------------------------------------------------------- set-up
    def _set_algorithm(self) -> None:
        """The estimator, loss and group filter of ``algorithm``, with the checks that need the rewards."""
        cfg, a = self.cfg, self.cfg.algorithm
        self.estimator = adv_lib.get(a.estimator)
        self.estimator_takes_lengths = adv_lib.accepts_num_actions(a.estimator)
        """The estimator weighs samples by their number of actions (e.g. reinforce_pp over tokens)."""
        self.estimator_takes_steps = adv_lib.accepts_step_rewards(a.estimator)
        """The estimator turns per-step process rewards into Float[B,T] advantages (e.g. grpo_process)."""
        per_step = list(getattr(self.reward_set, "per_step_names", []))
        if per_step and not self.estimator_takes_steps:
            raise ConfigError(
                f"{cfg.source}: key 'algorithm.estimator': the rewards {per_step} give per-step (process) "
                f"rewards, which {a.estimator!r} ignores; use an estimator that takes them "
                f"({', '.join(n for n in adv_lib.names() if adv_lib.accepts_step_rewards(n))})"
            )
        # a rollout loop may write the step rewards itself (igpo: the policy's information gain per turn)
        loop_steps = bool(getattr(getattr(self.policy, "loop", None), "gives_step_rewards", False))
        if self.estimator_takes_steps and not per_step and not loop_steps:
            raise ConfigError(
                f"{cfg.source}: key 'algorithm.estimator': {a.estimator!r} turns per-step (process) rewards into "
                f"advantages, but no reward in 'rewards' declares per_step"
            )
        self.extra_samples = adv_lib.extra_samples(a.estimator)
        self.estimator_state = adv_lib.make_state(a.estimator)
        """What the estimator keeps across steps (spo's per-prompt tracker; None if stateless): updated from the
        global batch, saved in checkpoints."""
        self.reward_transforms = [dict(spec) for spec in a.reward_transforms]
        try:
            rt_lib.check_specs(self.reward_transforms, list(self.reward_set.names))
        except (TypeError, ValueError, KeyError) as e:
            raise ConfigError(f"{cfg.source}: key 'algorithm.reward_transforms': {e}") from None
        self.context_fields = set(adv_lib.context_fields(a.estimator)) | {
            f for spec in self.reward_transforms for f in rt_lib.context_fields(str(spec["name"]))
        }
        """The `EstimatorContext` fields this run fills (the estimator's and the reward transforms')."""
        self.policy_shift = (
            adv_lib.PolicyShiftMemory()
            if "policy_shift" in self.context_fields and a.estimator_kwargs.get("rho_mode", "kl") == "kl"
            else None
        )
        """SPO's KL-adaptive decay: each prompt's last response, re-scored at its next visit (policy_shift)."""
        self.adv_clip = a.adv_clip
        """The advantage clamp: ``algorithm.adv_clip``, or `GUARD_ADV_CLIP` when it is null and the policy
        scores with GRPO-Guard's RatioNorm (``options.guard_ratio_norm``), as verl-omni's GRPO-Guard loss."""
        if self.adv_clip is None and getattr(self.policy, "guard_ratio_norm", False):
            self.adv_clip = GUARD_ADV_CLIP
            if self.is_main:
                log.warning(
                    "algorithm.adv_clip is null and options.guard_ratio_norm is on: advantages are clamped to "
                    "[-%g, %g], as verl-omni's GRPO-Guard loss (adv_clip_max); set algorithm.adv_clip to "
                    "choose another bound",
                    GUARD_ADV_CLIP,
                    GUARD_ADV_CLIP,
                )
        self.composer = LossComposer(cfg, world=self.world, policy_name=type(self.policy).__name__)
        """The microbatch loss (`mmalign.algorithms.composition`)."""
        try:
            self.group_refill = (
                refill_lib.GroupRefill(
                    **a.group_refill,
                    success_threshold=cfg.data.success_threshold,
                    weights=self.reward_set.weights.tolist(),
                )
                if a.group_refill
                else None
            )
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{cfg.source}: key 'algorithm.group_refill': {e}") from None
        """Hints / R³ replay for all-fail groups (`mmalign.group_refill`); None when off."""
        self._refill_stats: dict[str, float] = {}
        self.chunkable_loss = a.objective is not None or not loss_lib.couples_actions(a.loss)
        """The loss can be evaluated on a part of a sample's actions (`Policy.action_chunks` is honoured)."""
        try:
            self.group_filter = filter_lib.build_filter(a.filter, **a.filter_kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{cfg.source}: key 'algorithm.filter_kwargs': {e}") from None

    def _set_batching(self) -> int:
        """Prompts, minibatches and microbatches per process; returns the optimizer updates per pass over a rollout."""
        cfg, r, t = self.cfg, self.cfg.rollout, self.cfg.trainer
        self.local_prompts = r.prompts_per_step // self.world
        self.samples_per_group = r.group_size + self.extra_samples
        local_batch = self.local_prompts * self.samples_per_group
        self.minibatch = (t.minibatch_size // self.world) if t.minibatch_size else None
        self.microbatch = t.microbatch_size or self.minibatch or local_batch
        if t.minibatch_size and t.minibatch_size % self.world:
            raise ConfigError(
                f"{cfg.source}: key 'trainer.minibatch_size' must be divisible by the number of processes"
            )
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
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_lambda)
        if is_fsdp2(self.policy.model) and acc.distributed_type != DistributedType.FSDP:
            # sharded before the trainer was built (`mmalign.distributed.apply_fsdp2`): FSDP2 syncs the
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
            or bool(self.context_fields & {"logp_old_mean", "logp_old_sum"})
            or self.policy_shift is not None
            or bool(a.group_refill.get("replay"))
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

    def _check_names(self) -> None:
        """Registry names of the config, checked up front with the config key in the message."""
        check_names(self.cfg)

    def _emit(self, hook: str, *args: Any) -> None:
        """Call `hook` (a `TrainerCallback` method) on every callback, then every monitor, that has it."""
        for target in (*self.callbacks, *self.monitors):
            fn = getattr(target, hook, None)
            if fn is not None:
                fn(self, *args)

    def _lr_lambda(self, step: int) -> float:
        t = self.cfg.trainer
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.lr_scheduler == "constant":
            return 1.0
        span = max(1, t.steps - t.warmup_steps)
        frac = min(1.0, (step - t.warmup_steps) / span)
        if t.lr_scheduler == "linear":
            return 1.0 - frac
        return 0.5 * (1.0 + math.cos(math.pi * frac))

    def _prepare_output_dir(self, resume: bool) -> None:
        """Take the run lock (`mmalign.runlock`; the main process), check the output directory, then, resuming:
        refuse a config change a resume cannot apply (`resume_changes`, before anything is loaded), load the
        newest checkpoint that verifies and drop the metrics of later steps; with ``overwrite``: remove the
        previous run, saying what (a warning). Then write ``config.yaml``. A failure releases the lock."""
        self._take_run_lock()
        try:
            self._set_up_output_dir(resume)
        except BaseException:
            self.release_run_lock()
            raise

    def _set_up_output_dir(self, resume: bool) -> None:
        rundir.check_output_dir(self.cfg, resume)  # (the CLI made the same check before building the model)
        if resume:
            changes = resume_changes(self.out, self.cfg)
            # the newest checkpoint whose files match its manifest and load; the ones skipped are logged
            ckpt = rundir.verified_checkpoint(self.out, load=self.load_checkpoint)
            assert ckpt is not None
            self.resumed_from, self.config_changes = ckpt, changes
            log.info("resuming from step %d (checkpoint %s)", self.step, ckpt)
            for change in changes:
                log.info("resume: %s (applied: %s)", change.describe(), change.how)
            if self.is_main:  # drop metrics of steps after the checkpoint (and a torn last line)
                rundir.truncate_metrics(self.out, self.step)
        elif self.is_main and self.cfg.overwrite:
            self._clear_previous_run()
        if self.is_main:
            with rundir.writing(self.out):
                self.out.mkdir(parents=True, exist_ok=True)
            resolved = yaml.safe_dump(self.cfg.to_dict(), sort_keys=False)
            rundir.write_atomic(self.out / rundir.CONFIG_FILE, resolved)
        self.accelerator.wait_for_everyone()

    def _clear_previous_run(self) -> None:
        """``overwrite=true``: remove what the previous run in the output directory wrote (`rundir.clear_run`),
        with a warning that names it."""
        found = []
        for name in rundir.RUN_OUTPUTS:
            path = self.out / name
            if not path.exists():
                continue
            if name == rundir.METRICS_FILE:
                with contextlib.suppress(OSError), path.open("rb") as f:
                    name += f" ({sum(1 for line in f if line.strip())} rows)"
            elif name == rundir.CHECKPOINTS_DIR:
                done = [c.name for c in rundir.checkpoints(self.out)]
                name += f"/ ({', '.join(done) if done else 'no complete checkpoint'})"
            elif path.is_dir():
                name += "/"
            found.append(name)
        if found:
            log.warning("overwrite=true: removing the previous run in %s: %s", self.out, ", ".join(found))
        rundir.clear_run(self.out)

    def _take_run_lock(self) -> None:
        """The main process takes the run lock (`mmalign.runlock.acquire`, re-entrant: `mmalign train` took it
        before the model loaded) unless it holds it; a `RunLockedError` is raised on every process."""
        problem: str | None = None
        if self.is_main and self._run_lock is None:
            try:
                self._run_lock = runlock.acquire(self.out)
            except runlock.RunLockedError as e:
                problem = str(e)
        if self.world > 1:
            from accelerate.utils import gather_object

            problem = gather_object([problem])[0]  # the main process's answer, on every process
        if problem is not None:
            raise runlock.RunLockedError(problem)

    def release_run_lock(self) -> None:
        """Give up this trainer's hold on the run lock (`train` does when it ends; it takes it again to train
        more)."""
        if self._run_lock is not None:
            self._run_lock.release()
            self._run_lock = None

    # ----------------------------------------------------------------- rollout
    def _gather(self, x: Tensor) -> Tensor:
        return self.accelerator.gather(x.contiguous()) if self.world > 1 else x

    def _gather_padded(self, x: Tensor) -> Tensor:
        """Gather a Float[B,T] tensor whose T may differ between processes (padded with 0 on dim 1)."""
        if self.world == 1:
            return x
        return self._gather(self.accelerator.pad_across_processes(x.contiguous(), dim=1, pad_index=0))

    def _generate_round(self) -> tuple[Rollout, Tensor, Tensor, Tensor, Tensor]:
        """One round of sampling on this process; returns (local rollout, global rewards, global groups, global
        numbers of valid actions per sample, global prompt ids: each sample's dataset row index)."""
        pps = self.cfg.rollout.prompts_per_step
        key = (self.step, self._round)
        prefetched = self._async is not None and self._async.has(key)
        # the prompts of a round the rollout worker sampled ahead were drawn when it was submitted
        idx = self._async.indices(key) if prefetched else self.sampler.next_indices(pps)
        round_base = self._round * pps
        rows = self._rows_of(idx)
        if self._async is None:
            # schedules of the policy, weight syncs of its sampler; resume-safe
            self.policy.on_train_step(self.step)
            rollout = self.policy.rollout(rows, self.samples_per_group, compute_logp=self.need_logp_old)
        else:  # sampled by the rollout worker (ahead of time, or now), its rewards scored as it arrived
            if not prefetched:
                self._async_submit(key, idx)
            rollout, rewards = self._async_take(key)
        # global group ids: position of the prompt in this step's global list, offset per round
        offset = self._round * self.cfg.rollout.prompts_per_step + self.rank * self.local_prompts
        rollout.group = rollout.group + offset
        self._round += 1
        if self._async is None:
            t0 = time.perf_counter()
            # outputs that cost time (such as pixels from latents) are made only when a reward needs them
            self.policy.materialize(rollout, self.reward_set.needs)
            self._timers["materialize"] = self._timers.get("materialize", 0.0) + time.perf_counter() - t0
            rewards = self.reward_set(rollout)
            self._timers["reward"] += time.perf_counter() - t0
            self._reward_extra = dict(getattr(self.reward_set, "last_metrics", {}) or {})
        rewards = rewards.to(rollout.group.device)
        rollout.rewards = rewards
        rollout.reward_names = list(self.reward_set.names)
        if self.group_refill is not None:  # hints / replay for this process's all-fail groups
            pids = [idx[int(g) - round_base] for g in rollout.group.tolist()]
            rollout, rewards, self._refill_stats = self.group_refill.refill(
                rollout, rewards, rollout.group, pids, self.rows, self._regenerate, self._current_logprobs
            )
            rollout.reward_names = list(self.reward_set.names)
        g_rewards, g_group = self._gather(rewards), self._gather(rollout.group)
        # callbacks that follow the rewards (curricula): the GLOBAL batch in global group order, so their
        # decisions are the same on every process and for any number of processes
        self._emit("on_rewards", g_rewards, g_group, list(self.reward_set.names))
        g_actions = self._gather(rollout.mask.sum(dim=1).to(rollout.group.device))
        # feedback for adaptive prompt samplers, from the GLOBAL batch so every rank's sampler agrees
        total = adv_lib.combine_rewards(g_rewards, self.reward_set.weights.tolist())
        ids, rates, counts = sampler_lib.group_successes(total, g_group, self.cfg.data.success_threshold)
        self.sampler.observe([idx[int(g) - round_base] for g in ids], rates, counts)
        g_prompt = torch.tensor([idx[int(g) - round_base] for g in g_group.tolist()], dtype=torch.long)
        return rollout, g_rewards, g_group, g_actions, g_prompt

    def _regenerate(self, rows: list[dict[str, Any]], size: int) -> tuple[Rollout, Tensor]:
        """`size` fresh samples of each of `rows` with the current weights, scored by the reward set (the
        hinted re-rolls of `mmalign.group_refill`)."""
        rollout = self.policy.rollout(rows, size, compute_logp=self.need_logp_old)
        self.policy.materialize(rollout, self.reward_set.needs)
        return rollout, self.reward_set(rollout).to(rollout.group.device)

    def _rows_of(self, idx: list[int]) -> list[dict[str, Any]]:
        """This process's dataset rows of a round's global prompt indices."""
        return [
            self.rows[i] for i in idx[self.rank * self.local_prompts : (self.rank + 1) * self.local_prompts]
        ]

    # ----------------------------------------------------------------- asynchronous rollouts
    def _async_start(self) -> None:
        """Start the rollout workers of ``trainer.async`` (`mmalign.asynchronous`): they hold this process's
        policy as it is now (weight version = finished steps) and, when resuming, the random states of the
        checkpoint's workers."""
        from mmalign.asynchronous import AsyncRollouts

        self._async = AsyncRollouts(
            self.policy,
            self.reward_set,
            self.async_cfg,
            version=self.step,
            seed=self.cfg.seed + 1000 * self.rank,
            worker_rngs=self._async_rngs,
        )

    def _async_close(self) -> None:
        if self._async is not None:
            self._async.close()
            self._async = None

    def _async_submit(
        self, key: tuple[int, int], idx: list[int], rows: list[dict[str, Any]] | None = None
    ) -> None:
        """Submit the round `key` with the prompts `idx` (this process's dataset rows of them, or `rows`: e.g. rows
        rewritten for a re-roll), sampled with the current weights (version ``step``)."""
        self._async.submit(
            key,
            idx,
            self._rows_of(idx) if rows is None else rows,
            self.samples_per_group,
            self.step,
            self.policy.trainable_state_dict,
            needs=tuple(self.reward_set.needs),
            # K = 0: one random stream, as in the synchronous trainer (the worker continues this process's)
            rng=worker_rng_state(self.policy) if self.async_cfg.max_staleness == 0 else None,
            # K = 0: the log-probs the synchronous trainer records; K > 0: always (the behaviour log-probs)
            compute_logp=self.need_logp_old,
        )

    def _async_prefetch(self) -> None:
        """Before the update of step ``step + 1``: submit the first round of the next ``max_staleness`` steps
        with the current weights. Nothing is submitted past a step that writes a checkpoint (a barrier: no work
        is in flight at a checkpoint, so a resumed run samples what the uninterrupted one did)."""
        t, k = self.cfg.trainer, self.async_cfg.max_staleness
        now = self.step + 1  # the step being run (1-based)
        for ahead in range(1, k + 1):
            target = now + ahead
            if target > t.steps or any(s % t.save_every == 0 or s == t.steps for s in range(now, target)):
                break
            key = (target - 1, 0)
            if not self._async.has(key):
                self._async_submit(key, self.sampler.next_indices(self.cfg.rollout.prompts_per_step))

    def _async_take(self, key: tuple[int, int]) -> tuple[Rollout, Tensor]:
        """The worker's rollout of round `key` with its behaviour / pi_old log-probs set for the loss
        (`mmalign.asynchronous.behaviour_fields`) and its rewards; records staleness and idle times."""
        from mmalign.asynchronous import behaviour_fields

        result, waited = self._async.take(key)
        if self.async_cfg.max_staleness == 0:  # continue the stream where the worker's sampling left it
            set_worker_rng_state(self.policy, result.rng)
        staleness = self.step - result.version
        rollout = behaviour_fields(
            result.rollout,
            staleness=staleness,
            max_staleness=self.async_cfg.max_staleness,
            need_logp_old=self.need_logp_old,
            current_logprobs=self._current_logprobs,
            recompute=self.need_logp_old or self.cfg.rollout.is_correction == "sequence",
        )
        rollout.outputs["staleness"] = torch.full((len(rollout),), staleness, dtype=torch.long)
        rollout.outputs["policy_version"] = torch.full((len(rollout),), result.version, dtype=torch.long)
        self._reward_extra = dict(result.reward_metrics)
        a = self._async_step
        a["trainer_wait_s"] += waited
        a["worker_idle_s"] += result.worker_idle_s
        a["worker_sample_s"] += result.sample_s
        a["worker_sample_cpu_s"] += result.sample_cpu_s
        a["reward_s"] += result.reward_s
        a["staleness_sum"] += staleness * len(rollout)
        a["samples"] += len(rollout)
        a["staleness_max"] = max(a["staleness_max"], staleness)
        assert result.rewards is not None
        return rollout, result.rewards

    @torch.no_grad()
    def _current_logprobs(self, rollout: Rollout) -> Tensor:
        """Float[B,T]: the log-probs of a rollout's actions under the trainer's current weights (pi_old of a stale
        rollout), in microbatches, in training mode as the update scores them."""
        self.policy.model.train()
        parts = []
        for start in range(0, len(rollout), self.microbatch):
            with torch.no_grad():  # numbers only: no graph to build
                stats = self.policy.action_stats(
                    rollout[list(range(start, min(start + self.microbatch, len(rollout))))]
                )
            if stats.logp is None:
                raise TrainingError(
                    f"{type(self.policy).__name__}.action_stats gives no log-probs: trainer.async.max_staleness > 0 "
                    "needs them for the importance weights"
                )
            parts.append(stats.logp.detach().float())
        logp = torch.cat(parts).to(rollout.mask.device)
        if logp.shape != rollout.mask.shape:
            raise TrainingError(
                f"pi_old log-probs of shape {tuple(logp.shape)} for a mask of {tuple(rollout.mask.shape)}"
            )
        return logp.masked_fill(~rollout.mask, 0.0)

    def _async_metrics(self) -> dict[str, float]:
        """``async/*``: the step's mean and largest staleness (training steps between the behaviour weights and
        the trained ones), the trainer's wait for rollouts, the worker's idle and sampling time, reward time."""
        a, self._async_step = self._async_step, defaultdict(float)
        return {
            "async/staleness_mean": a["staleness_sum"] / max(a["samples"], 1.0),
            "async/staleness_max": a["staleness_max"],
            "async/trainer_wait_s": a["trainer_wait_s"],
            "async/worker_idle_s": a["worker_idle_s"],
            "async/worker_sample_s": a["worker_sample_s"],
            "async/worker_sample_cpu_s": a["worker_sample_cpu_s"],
            "async/reward_s": a["reward_s"],
        }

    def _estimator_context(
        self, rollout: Rollout, g_group: Tensor, g_actions: Tensor, g_prompt: Tensor
    ) -> adv_lib.EstimatorContext | None:
        """The `EstimatorContext` of the GLOBAL batch with the fields this run needs (None if none)."""
        need = self.context_fields
        if not need:
            return None
        fields: dict[str, Any] = {}
        mask = rollout.mask

        def reduce(x: Tensor) -> tuple[Tensor, Tensor]:
            x = torch.where(mask, x.to(mask.device).double(), torch.zeros((), dtype=torch.float64))
            total = x.sum(dim=1)
            return self._gather(total / mask.sum(dim=1).clamp(min=1)), self._gather(total)

        if "prompt_ids" in need:
            fields["prompt_ids"] = g_prompt
        if need & {"step", "total_steps"}:
            fields["step"], fields["total_steps"] = self.step, self.cfg.trainer.steps
        if "policy_shift" in need and self.policy_shift is not None:
            # this process's samples re-score their prompts' stored responses; exact with one process (with
            # several, a prompt drawn by another process than at its last visit gets D = 0)
            local = self._local_slice(g_prompt, len(rollout))
            fields["policy_shift"] = self._gather(
                self.policy_shift.shift(local, lambda item: self._current_logprobs(item)[0]).to(mask.device)
            ).cpu()
        if "lengths" in need:
            fields["lengths"] = g_actions.double()
        if need & {"logp_old_mean", "logp_old_sum"}:
            fields["logp_old_mean"], fields["logp_old_sum"] = reduce(rollout.logp_old)
        if need & {"logp_ref_mean", "logp_ref_sum"}:
            if rollout.logp_ref is None:  # computed once here; update() reuses it for the KL term
                try:
                    rollout.logp_ref = self.policy.reference_logprobs(rollout).detach()
                except RuntimeError as e:  # the pipeline built the policy without a reference
                    raise ConfigError(
                        f"{self.cfg.source}: key 'algorithm.estimator': reading reference log-probs failed "
                        f"({e}); the pipeline must build the policy with "
                        "need_reference=cfg.algorithm.needs_reference()"
                    ) from e
            fields["logp_ref_mean"], fields["logp_ref_sum"] = reduce(rollout.logp_ref)
        if "action_mask" in need:
            fields["action_mask"] = self._gather_padded(mask.to(torch.uint8)).bool()
        if "turn_index" in need:  # padded with 0 after the +1: -1 (no action) again after the -1
            fields["turn_index"] = self._gather_padded(adv_lib.turns_from_mask(mask) + 1) - 1
        # written by the environment into its per-sample state, under the keys "turn_states" / "turn_rewards"
        for name, key in (("turn_state", "turn_states"), ("turn_rewards", "turn_rewards")):
            if name in need:
                rows = [list(s.get(key, [])) for s in rollout.outputs.get("env_state", [{}] * len(rollout))]
                width = max([len(r) for r in rows] + [1])
                dtype = torch.long if name == "turn_state" else torch.float64
                local = torch.zeros(len(rows), width, dtype=dtype)
                for i, r in enumerate(rows):
                    local[i, : len(r)] = torch.tensor(r, dtype=dtype)
                fields[name] = self._gather_padded(local)
        missing = [
            f for f in adv_lib.required_context_fields(self.cfg.algorithm.estimator) if f not in fields
        ]
        if missing:
            raise ConfigError(
                f"{self.cfg.source}: key 'algorithm.estimator': {self.cfg.algorithm.estimator!r} needs "
                f"{', '.join(missing)}, which this trainer does not supply yet"
            )
        return adv_lib.EstimatorContext(**fields)

    def compute_advantages(
        self,
        rewards: Tensor,
        group: Tensor,
        num_actions: Tensor | None = None,
        step_rewards: Tensor | None = None,
        step_mask: Tensor | None = None,
        context: adv_lib.EstimatorContext | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Advantages (Float[B], or Float[B,T] from an estimator that takes step rewards) and loss-sample mask
        of the GLOBAL batch (identical on every process). `num_actions` (Long[B], valid actions per sample)
        reaches estimators that take it (`accepts_num_actions`); `step_rewards` / `step_mask` (Float[B,T] /
        Bool[B,T]) those that take process rewards (`accepts_step_rewards`)."""
        a = self.cfg.algorithm
        weights = self.reward_set.weights.tolist()
        opts = dict(a.estimator_kwargs)
        if rewards.dim() == 2:
            opts.setdefault("weights", weights)
        if self.estimator_takes_lengths and num_actions is not None:
            opts["num_actions"] = num_actions
        if step_rewards is not None and not self.estimator_takes_steps:
            raise ConfigError(
                f"{self.cfg.source}: key 'algorithm.estimator': the rewards {self.reward_set.per_step_names} give "
                f"per-step (process) rewards, which {a.estimator!r} ignores; use an estimator that takes them "
                f"({', '.join(n for n in adv_lib.names() if adv_lib.accepts_step_rewards(n))})"
            )
        if self.estimator_takes_steps:
            opts["step_rewards"], opts["step_mask"] = step_rewards, step_mask
        if adv_lib.accepts_context(a.estimator):
            opts["context"] = context
        if self.estimator_state is not None:
            opts["state"] = self.estimator_state
        if self.reward_transforms:
            rewards = rt_lib.apply(
                self.reward_transforms,
                rewards,
                group,
                context=context,
                reward_names=list(self.reward_set.names),
            )
        try:
            adv = self.estimator(rewards, group, **opts)
            keep = adv_lib.loss_sample_mask(a.estimator, rewards, group, **opts)
        except TypeError as e:
            raise ConfigError(f"{self.cfg.source}: key 'algorithm.estimator_kwargs': {e}") from None
        return adv_lib.clip_advantages(adv, self.adv_clip), keep

    def _local_slice(self, x: Tensor, n_local: int) -> Tensor:
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
            self._timers["rollout"] += time.perf_counter() - t0
            g_steps = g_step_mask = None
            if rollout.step_rewards is not None:
                g_steps = self._gather_padded(rollout.step_rewards.float())
                g_step_mask = self._gather_padded(rollout.mask.to(torch.uint8)).bool()
            context = self._estimator_context(rollout, g_group, g_actions, g_prompt)
            adv, keep = self.compute_advantages(g_rewards, g_group, g_actions, g_steps, g_step_mask, context)
            n_local = len(rollout)
            if self.policy_shift is not None:  # each prompt's first sample, for its next visit's policy_shift
                local = self._local_slice(g_prompt, n_local).tolist()
                first = list({x: i for i, x in reversed(list(enumerate(local)))}.values())
                self.policy_shift.record(
                    [local[i] for i in first],
                    [rollout[[i]] for i in first],
                    rollout.logp_old[first],
                    rollout.mask[first],
                )
            if (
                "group_std" in self.composer.needs
            ):  # etr: each sample's group reward std, for its macro trust region
                total = adv_lib.combine_rewards(g_rewards, self.reward_set.weights.tolist())
                ids, stds = filter_lib.group_std(total, g_group)
                pos = {int(g): k for k, g in enumerate(ids.tolist())}
                per_sample = torch.stack([stds[pos[int(g)]] for g in g_group.tolist()]).double()
                rollout.outputs["group_std"] = self._local_slice(per_sample, n_local)
            adv = self._local_slice(adv, n_local)
            if adv.dim() == 2:  # per-step advantages: back to this process's number of actions
                adv = adv[:, : rollout.mask.shape[1]]
            rollout.advantages = adv.to(rollout.mask.device)
            # the actions the advantages were computed over, before samples are left out of the loss below
            rollout.outputs["advantage_mask"] = rollout.mask.clone()
            excluded = rollout.outputs.get("exclude_from_loss")
            if isinstance(excluded, Tensor) and bool(excluded.any()):
                # e.g. over-turn masking: these samples counted in their group's statistics, not in the loss
                rollout.mask = rollout.mask & ~excluded[:, None].to(rollout.mask.device)
            keep_local = self._local_slice(keep, n_local)
            if not bool(keep_local.all()):
                rollout.mask = rollout.mask & keep_local[:, None].to(rollout.mask.device)
            scores = adv_lib.combine_rewards(rollout.rewards, self.reward_set.weights.tolist())
            if not first_stats:
                self._check_nan_rewards(g_rewards)
                first_stats = self._reward_metrics(g_rewards, g_group, rollout)
            all_rewards.append(g_rewards)
            all_groups.append(g_group)
            all_prompts.extend(rollout.prompts)
            kept.append(f(rollout, scores))
            n_groups = sum(len(k.group_ids()) for k in kept)
            counts = self._gather(torch.tensor([n_groups]))
            if int(counts.min()) >= self.local_prompts:
                break
        batch = Rollout.cat(kept)
        # every process trains on the same number of groups (DDP needs matching backward calls)
        n_groups = len(batch.group_ids())
        n_min = int(self._gather(torch.tensor([n_groups])).min())
        n_use = min(n_min, self.local_prompts)
        if n_use < n_groups:
            batch = batch.select_groups(batch.group_ids()[:n_use])
        stats = dict(first_stats)
        stats.update({k: float(v) for k, v in f.last_stats().items()})
        stats.update({k: float(v) for k, v in self.sampler.last_stats().items()})
        stats.update(self._refill_stats)  # hints/groups, hints/success, replay/injected (the last round's)
        stats["filter/rounds"] = float(self._round)
        stats["filter/groups_used"] = float(n_use * self.world)
        return batch, stats

    def _check_nan_rewards(self, g_rewards: Tensor) -> None:
        """Count, per reward, the consecutive steps in which it is NaN for every sample of the (global) batch;
        stop the run when one reaches ``trainer.nan_reward_steps`` (0: never)."""
        limit = self.cfg.trainer.nan_reward_steps
        values = g_rewards.detach().float().cpu()
        if values.dim() == 1:
            values = values[:, None]
        nan = torch.isnan(values).all(dim=0).tolist() if values.shape[0] else []
        for name, all_nan in zip(self.reward_set.names, nan, strict=False):
            self._nan_reward_run[name] = self._nan_reward_run.get(name, 0) + 1 if all_nan else 0
            run = self._nan_reward_run[name]
            if limit and run >= limit:
                raise TrainingError(
                    f"reward {name!r} was NaN for every sample in {run} consecutive steps "
                    f"({self.step + 2 - run}..{self.step + 1}): it scores nothing (check its inputs, the dataset "
                    f"columns it reads, its log), so the run stops (trainer.nan_reward_steps={limit}; 0 never stops)"
                )

    def _reward_metrics(self, g_rewards: Tensor, g_group: Tensor, rollout: Rollout) -> dict[str, float]:
        weights = self.reward_set.weights.tolist()
        total = adv_lib.combine_rewards(g_rewards, weights)
        finite = total[~torch.isnan(total)]
        m: dict[str, float] = {
            "reward/mean": float(finite.mean()) if finite.numel() else float("nan"),
            "reward/std": float(finite.std(unbiased=False)) if finite.numel() else float("nan"),
        }
        m.update(self.reward_set.stats(g_rewards))
        m.update(self._mean_over_processes(getattr(self, "_reward_extra", {})))
        _, stds = filter_lib.group_std(total, g_group)
        m["zero_std_frac"] = float((stds == 0).float().mean())
        nan_groups = self.reward_set.nan_groups(g_rewards, g_group)
        m["reward/nan_groups"] = float(len(nan_groups))
        if nan_groups and self.is_main:
            local = {int(g): p for g, p in zip(rollout.group.tolist(), rollout.prompts, strict=True)}
            for name, gid in nan_groups[:5]:
                prompt = local.get(int(gid), "<prompt on another process>")
                msg = (
                    f"step {self.step + 1}: reward {name!r} returned NaN (not applicable) for every sample of "
                    f"group {gid} (prompt: {prompt[:80]!r}); that reward is left out of these samples' total"
                )
                tqdm.write(f"warning: {msg}", file=sys.stderr)
            if len(nan_groups) > 5:
                tqdm.write(
                    f"warning: ... and {len(nan_groups) - 5} more all-NaN (reward, group) pairs",
                    file=sys.stderr,
                )
        for name, values in self.policy.rollout_stats(rollout).items():
            m[name] = float(self._gather(values.float().mean().reshape(1)).mean())
        return m

    def _mean_over_processes(self, values: dict[str, float]) -> dict[str, float]:
        """Each key's mean over the processes that report it (keys may differ between processes)."""
        if self.world == 1:
            return dict(values)
        from accelerate.utils import gather_object

        merged: dict[str, list[float]] = defaultdict(list)
        for part in gather_object([values]):
            for key, value in part.items():
                merged[key].append(float(value))
        return {key: sum(v) / len(v) for key, v in sorted(merged.items())}

    # ----------------------------------------------------------------- update
    def _global_sum(self, x: float) -> float:
        if self.world == 1:
            return x
        return float(self._gather(torch.tensor([x], dtype=torch.float64)).sum())

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
            vec = self._gather(torch.tensor([m[k] for k in sorted(m)], dtype=torch.float64).reshape(1, -1))
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

    def _nonfinite_weights(self) -> list[str]:
        """Names of the trainable parameters (this process's shards) holding NaN or inf."""
        named = getattr(self.policy.model, "named_parameters", None)
        if named is None:
            return []
        bad = []
        with torch.no_grad():
            for name, p in named():
                if p.requires_grad and p.is_floating_point():
                    local = p.to_local() if hasattr(p, "to_local") else p
                    if not bool(torch.isfinite(local).all()):
                        bad.append(name)
        return bad

    # ----------------------------------------------------------------- one step
    def train_step(self) -> dict[str, Any]:
        self._timers: dict[str, float] = defaultdict(float)
        if self.async_cfg is not None and self._async is None:
            self._async_start()
        t0 = time.perf_counter()
        batch, metrics = self.make_rollout()
        if self._async is not None:  # the worker samples the next steps while this one updates
            self._async_prefetch()
        t1 = time.perf_counter()
        self.policy.model.train()
        if len(batch):
            metrics.update(self.update(batch))
            self._check_finite_update(metrics)
            adv = _per_sample(batch.advantages, batch.mask)
            metrics["adv/abs_mean"] = float(self._gather(adv.abs().mean().reshape(1)).mean())
        else:
            tqdm.write(f"step {self.step + 1}: no informative group after filtering; the update is skipped")
        with warnings.catch_warnings():  # a skipped update still advances the per-step LR schedule
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
            self.scheduler.step()
        self.step += 1
        t2 = time.perf_counter()
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        metrics["time/rollout_s"] = self._timers["rollout"] - self._timers["reward"]
        metrics["time/reward_s"] = self._timers["reward"]
        if self._timers["materialize"] >= 1e-3:  # part of time/reward_s (e.g. latents -> pixels)
            metrics["time/materialize_s"] = self._timers["materialize"]
        metrics["time/update_s"] = t2 - t1
        metrics["time/step_s"] = t2 - t0
        if self._async is not None:
            metrics.update(self._async_metrics())
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
            self._emit("on_train_start", self.step)
            while self.step < t.steps:
                try:
                    m = self.train_step()
                except Exception as e:
                    raise self._stopped(e, self.step + 1) from e
                # callbacks may add their numbers to `m` (a curriculum's threshold); monitors see them
                self._emit("on_step_end", self.step, m)
                self.history.append(m)
                last = self.step == t.steps or self._stop_reason is not None  # written as the run's last step
                try:  # what the step writes: an I/O error names the file and the last complete checkpoint
                    if self.step % t.log_every == 0 or last:
                        if metrics_f is not None:
                            with rundir.writing(metrics_f.name):
                                metrics_f.write(json.dumps(rundir.jsonable(m)) + "\n")
                                metrics_f.flush()
                                os.fsync(metrics_f.fileno())
                        self._emit("on_log", self.step, m)
                    if self.step % t.sample_every == 0 or self.step == 1:
                        with rundir.writing(
                            rundir.samples_file(self.out, self.step).with_suffix(""), runtime=False
                        ):
                            self.dump_samples(self._last_batch)
                    if self.step % t.save_every == 0 or last:
                        self.save_checkpoint()
                except (RunWriteError, NonFiniteError) as e:
                    raise self._stopped(e, self.step, after=True) from e
                bar.set_postfix(
                    reward=f"{m.get('reward/mean', float('nan')):.3f}", step_s=f"{m['time/step_s']:.2f}"
                )
                bar.update(1)
                if self._stop_reason is not None:
                    break
        finally:
            bar.close()
            self._async_close()
            if metrics_f is not None:
                with contextlib.suppress(OSError):  # a full disk: the failed append has said which file
                    metrics_f.close()
            self._emit("on_train_end")
        try:
            with rundir.writing(self.out / rundir.FINAL_DIR, runtime=False):
                if self.sharded:
                    self._save_final_sharded(self.out / rundir.FINAL_DIR)
                elif self.is_main:
                    self.policy.save(self.out / "final")
        except RunWriteError as e:
            raise self._stopped(e, self.step, after=True) from e
        self.accelerator.wait_for_everyone()
        return self.history

    def _stopped(self, e: BaseException, step: int, *, after: bool = False) -> TrainingError:
        """The `TrainingError` that ends the run when `e` stops it at `step` (`after`: while writing what the
        step produced): what happened, what is kept, where to continue from. A NaN / inf (in the update, or
        found in the weights when another error stops the run) points at the last checkpoint written before
        it, not at ``--resume`` blindly: a resumed run is exact and meets the same NaN unless the config
        changes."""
        nonfinite = isinstance(e, NonFiniteError)
        if not nonfinite and not isinstance(e, RunWriteError):
            with contextlib.suppress(Exception):  # (local check: no collective in an error path)
                bad = self._nonfinite_weights()
                if bad:
                    nonfinite = True
                    e = NonFiniteError(
                        f"{e} (the weights hold NaN/inf: {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''})"
                    )
        done = rundir.checkpoints(self.out)
        newest = done[-1] if done else None
        finished = step if after else step - 1
        kept = (
            f"metrics of steps 1..{finished} in {self.out / rundir.METRICS_FILE}"
            if finished
            else "no step finished"
        )
        head = f"training stopped {'after' if after else 'at'} step {step}: {e}"
        if nonfinite:
            before = [c for c in done if rundir.checkpoint_step(c) < step]
            if not before:
                return NonFiniteError(f"{head}\n  kept: {kept}; no checkpoint written before the NaN")
            good = before[-1]
            newer = [c.name for c in done if rundir.checkpoint_step(c) > rundir.checkpoint_step(good)]
            how = (
                f"remove the newer {', '.join(newer)} first (--resume loads the newest), then "
                if newer
                else ""
            )
            return NonFiniteError(
                f"{head}\n  kept: {kept}; the last checkpoint written before the NaN: {good}\n"
                f"  to continue from it, {how}change what made the NaN (e.g. a lower trainer.lr, "
                f"trainer.max_grad_norm) and run with --resume: a resumed run is exact, so unchanged it meets the "
                f"same NaN at step {step}"
            )
        where = f"the last complete checkpoint: {newest}" if newest else "no checkpoint yet"
        if isinstance(e, DataError):  # --resume alone would meet the same row again
            return TrainingError(
                f"{head}\n  kept: {kept}; {where}; fix or remove that row (or set options.on_bad_row: skip), "
                "then continue with --resume"
            )
        return TrainingError(
            f"{head}\n  kept: {kept}; {where}" + (" (continue with --resume)" if newest else "")
        )

    def _save_final_sharded(self, path: Path) -> None:
        """``final/`` of an FSDP2 run: the full weights are gathered on every rank (a collective), then the main
        process writes them with ``save_pretrained(state_dict=...)`` (and the policy's tokenizer or processor),
        the layout `Policy.save` gives a text or VLM policy."""
        model = self.policy.model
        full = dist_lib.gather_full_state_dict(model)
        if not self.is_main:
            return
        if not hasattr(model, "save_pretrained"):
            raise TrainingError(
                f"cannot write {path}: {type(model).__name__} has no save_pretrained (FSDP2 runs save the gathered "
                "weights with it)"
            )
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(path, state_dict=full)
        extras = [getattr(self.policy, a, None) for a in ("tokenizer", "processor")]
        extras = [e for e in extras if e is not None and hasattr(e, "save_pretrained")]
        for extra in extras:
            extra.save_pretrained(path)
        if not extras:
            log.warning(
                "FSDP2 run: %s holds the trained %s only (save_pretrained of the gathered weights), not the "
                "layout of %s.save",
                path,
                type(model).__name__,
                type(self.policy).__name__,
            )

    # ----------------------------------------------------------------- samples
    def dump_samples(self, batch: Rollout) -> None:
        """Write this step's samples into the run directory (`mmalign.rundir`): what `Policy.sample_view`
        shows of each sample, its rewards and advantage, and the pipeline's `sample_columns`."""
        from accelerate.utils import gather_object

        if not len(batch):
            return
        shown = self.policy.sample_view(batch)
        views = rundir.store_sample_media(self.out, self.step, shown, rank=self.rank, world=self.world)
        rows = []
        mask = batch.outputs.get("advantage_mask", batch.mask).bool().cpu()  # before loss exclusions
        adv = _per_sample(batch.advantages, mask) if batch.advantages is not None else None
        in_loss = batch.mask.bool().cpu().any(dim=1)
        steps = batch.step_rewards.float().cpu() if batch.step_rewards is not None else None
        for i in range(len(batch)):
            row: dict[str, Any] = {
                "group": int(batch.group[i]),
                "prompt": batch.prompts[i],
                "advantage": float(adv[i]) if adv is not None else None,
                "rewards": {n: _num(batch.rewards[i, k]) for k, n in enumerate(batch.reward_names)},
                "num_actions": int(mask[i].sum()),
                "in_loss": bool(in_loss[i]),
                **views[i],
            }
            if steps is not None:  # the weighted process rewards by action position (None: not an action)
                last = int(mask[i].nonzero().max()) + 1 if bool(mask[i].any()) else 0
                row["step_rewards"] = [_num(steps[i, t]) if mask[i, t] else None for t in range(last)]
            for key in self.sample_columns:
                if key in batch.columns:
                    row[key] = batch.columns[key][i]
            state = batch.outputs.get("env_state")
            if isinstance(state, list) and len(state) == len(batch) and state[i]:
                row["env_state"] = state[i]  # what a multi-turn environment recorded (views, tool calls)
            rows.append(row)
        self._emit("on_samples", self.step, rows, shown)  # this process's samples
        if self.world > 1:
            rows = gather_object(rows)
        if self.is_main:
            rundir.write_samples(self.out, self.step, rows)

    # ----------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        """Write `checkpoints/step_N/` atomically (a temp folder renamed when complete) with its manifest. The
        state files hold plain values and tensors only (`rundir.save_state`); weights holding NaN / inf are not
        written (`NonFiniteError`). An I/O error removes the temp folder and raises `RunWriteError`."""
        tmp = rundir.pending_checkpoint_dir(self.out, self.step)
        try:
            return self._write_checkpoint(tmp)
        except BaseException:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)  # frees the space a full disk needs
            raise

    def _write_checkpoint(self, tmp: Path) -> Path:
        from safetensors.torch import save_file

        if self.is_main:
            with rundir.writing(tmp):
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        rng = {
            "rng": rng_state(),
            "shuffle_gen": self.shuffle_gen.get_state(),
            "policy": self.policy.rng_state(),
        }
        if self._async is not None:  # nothing is in flight at a checkpoint (`_async_prefetch`)
            if self._async.in_flight():
                raise TrainingError(f"{self._async.in_flight()} rollout job(s) in flight at a checkpoint")
            rng["async_workers"] = list(self._async.last_rng)
        elif self._async_rngs is not None:
            rng["async_workers"] = list(self._async_rngs)
        rundir.save_state(rng, tmp / rundir.rng_file(self.rank))
        if self.sharded:  # every rank writes its shards of the weights and optimizer state (DCP)
            with rundir.writing(tmp / dist_lib.SHARDED_DIR):
                dist_lib.save_sharded(tmp / dist_lib.SHARDED_DIR, self.policy.model, self.optimizer)
        if self.is_main:
            if not self.sharded:
                state = self.policy.trainable_state_dict()
                bad = [
                    k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())
                ]
                if bad:
                    raise NonFiniteError(
                        f"the weights after step {self.step} hold NaN/inf ({', '.join(bad[:3])}"
                        f"{' ...' if len(bad) > 3 else ''}); checkpoint {rundir.step_name(self.step)} not written"
                    )
                with rundir.writing(tmp / rundir.TRAINABLE_FILE):
                    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / rundir.TRAINABLE_FILE))
                rundir.save_state(self.optimizer.state_dict(), tmp / rundir.OPTIMIZER_FILE)
            rundir.save_state(self.scheduler.state_dict(), tmp / rundir.SCHEDULER_FILE)
            rundir.save_state(
                {
                    "step": self.step,
                    "sampler": self.sampler.state_dict(),
                    "filter": self.group_filter.state_dict(),
                    "estimator": None if self.estimator_state is None else self.estimator_state.state_dict(),
                    "group_refill": None if self.group_refill is None else self.group_refill.state_dict(),
                    "policy_shift": None if self.policy_shift is None else self.policy_shift.state_dict(),
                    "callbacks": [
                        cb.state_dict() if hasattr(cb, "state_dict") else None for cb in self.callbacks
                    ],
                    "world_size": self.world,
                    "nan_reward_run": dict(self._nan_reward_run),
                },
                tmp / rundir.TRAINER_STATE_FILE,
            )
        self.accelerator.wait_for_everyone()
        final = rundir.checkpoint_dir(self.out, self.step)
        if self.is_main:  # the manifest (every rank's files), the COMPLETE mark, the rename
            rundir.finish_checkpoint(self.out, self.step, keep=self.cfg.trainer.keep_checkpoints)
        self.accelerator.wait_for_everyone()
        return final

    def load_checkpoint(self, path: Path) -> None:
        """Restore the run from the checkpoint folder `path`. Every file is read (``weights_only`` loads, no
        unpickling) and checked before anything is restored: an unreadable file, or weights holding NaN / inf,
        raise `CheckpointError` naming the file and leave the trainer as it was. A checkpoint of another
        number of processes, or of another sharding, is a `ConfigError`. (Callers check the manifest first:
        `rundir.verified_checkpoint`.)"""
        from safetensors.torch import load_file

        legacy = not (path / rundir.MANIFEST_FILE).is_file()  # written before manifests and tagged state
        state = rundir.load_state(path / rundir.TRAINER_STATE_FILE, legacy=legacy)
        if state["world_size"] != self.world:
            raise ConfigError(
                f"checkpoint {path} was written by {state['world_size']} process(es); resume with the same number "
                f"(now {self.world})"
            )
        sharded = (path / dist_lib.SHARDED_DIR).is_dir()
        if sharded != self.sharded:
            raise ConfigError(
                f"checkpoint {path} was written by a {'sharded (FSDP2)' if sharded else 'non-sharded'} run; resume "
                f"it with the model {'sharded' if sharded else 'not sharded'} (this run's is "
                f"{'sharded' if self.sharded else 'not'})"
            )
        rng = rundir.load_state(path / rundir.rng_file(self.rank), legacy=legacy)
        scheduler = rundir.load_state(path / rundir.SCHEDULER_FILE, legacy=legacy)
        if not sharded:
            file = path / rundir.TRAINABLE_FILE
            try:
                weights = load_file(str(file))
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise CheckpointError(f"{file}: unreadable ({type(e).__name__}: {e})") from None
            bad = [
                k for k, v in weights.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())
            ]
            if bad:
                raise CheckpointError(f"{file}: the weights hold NaN/inf ({', '.join(bad[:3])})")
            optimizer = rundir.load_state(path / rundir.OPTIMIZER_FILE, legacy=legacy)
        # everything is read: restore
        if sharded:  # every rank reads its shards
            dist_lib.load_sharded(path / dist_lib.SHARDED_DIR, self.policy.model, self.optimizer)
        else:
            self.policy.load_trainable_state_dict(weights)
            self.optimizer.load_state_dict(optimizer)
        self.scheduler.load_state_dict(scheduler)
        self.step = state["step"]
        self._nan_reward_run = dict(state.get("nan_reward_run", {}))
        self.sampler.load_state_dict(state["sampler"])
        self.group_filter.load_state_dict(state["filter"])
        if self.estimator_state is not None and state.get("estimator") is not None:
            self.estimator_state.load_state_dict(state["estimator"])
        if self.group_refill is not None and state.get("group_refill") is not None:
            self.group_refill.load_state_dict(state["group_refill"])
        if self.policy_shift is not None and state.get("policy_shift") is not None:
            self.policy_shift.load_state_dict(state["policy_shift"])
        for cb, s in zip(self.callbacks, state["callbacks"], strict=False):
            if s is not None and hasattr(cb, "load_state_dict"):
                cb.load_state_dict(s)
        set_rng_state(rng["rng"])
        self.shuffle_gen.set_state(rng["shuffle_gen"])
        self.policy.load_rng_state(rng.get("policy", {}))
        # an asynchronous run's rollout workers continue their random streams (None: a synchronous run's
        # checkpoint; the workers start from this process's restored state)
        self._async_rngs = rng.get("async_workers")
        self._apply_optimizer_config()

    def _apply_optimizer_config(self) -> None:
        """After a checkpoint is loaded: the optimizer's and the LR schedule's hyperparameters from the config
        (their state_dicts restored the values the run was saved with). Every param group's ``initial_lr``,
        ``weight_decay``, ``betas``, ``eps``, the scheduler's ``base_lrs`` = ``trainer.lr``, and the current
        ``lr`` = ``trainer.lr`` x the schedule (`_lr_lambda`) at the current step, as ``LambdaLR`` computes it.
        With the saved config every value is the one restored (the resume stays exact); with a changed
        ``trainer.lr``, schedule, ``trainer.steps`` or AdamW setting the run trains with the new one."""
        t = self.cfg.trainer
        groups = self.optimizer.param_groups
        for group in groups:
            group["initial_lr"] = t.lr
            group["weight_decay"] = t.weight_decay
            group["betas"] = tuple(t.betas)
            group["eps"] = t.adam_eps
        self.scheduler.base_lrs = [t.lr for _ in groups]
        factor = self._lr_lambda(self.scheduler.last_epoch)
        for group in groups:
            group["lr"] = t.lr * factor
        self.scheduler._last_lr = [group["lr"] for group in groups]  # (what get_last_lr returns)


def _per_sample(adv: Tensor, mask: Tensor) -> Tensor:
    """Float[B]: the advantage of each sample (per-step advantages: their mean over the sample's actions)."""
    if adv.dim() == 1:
        return adv
    m = mask.to(adv.device, adv.dtype)
    return (adv * m).sum(1) / m.sum(1).clamp(min=1)


def _num(x: Tensor) -> float | None:
    v = float(x)
    return None if math.isnan(v) else v
