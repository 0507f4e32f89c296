"""How a `mmalign.policies.flow_matching.FlowMatchingPolicy` trains: one strategy object the policy holds.

The policy's `setup` picks the strategy once (`training_for`) and its training methods (`rollout`,
`action_stats`, `action_chunks`, `callbacks`, `export_weights`) hand over to it:

- `PolicyGradientTraining` (no ``algorithm.objective``): Flow-GRPO's path, `DenoisingPolicy`'s own methods --
  SDE rollouts that record every trained step's log-prob, re-scored with grad;
- `ForwardProcessTraining` (``algorithm.objective``: a `mmalign.algorithms.flow_objectives` entry such as
  ``diffusion_nft``, ``awm``, ``flow_dpo``): rollouts keep only clean latents, the loss is the objective's on the
  forward process of those latents (`mmalign.policies.forward_process`). A new objective is a registry entry
  there; its metadata (``inputs``, ``timesteps``, ``ema_preset``) is all this strategy reads.

`ObjectiveSettings.from_config` reads and checks the objective's ``algorithm`` keys from the config alone; the
command line's validation (`mmalign.app.preflight`) runs it before any model loads, and the strategy reads its
settings through it. What needs the loaded scheduler (the training sigmas against the schedule) is checked in
`ForwardProcessTraining.setup`.
"""

from __future__ import annotations

import abc
import copy
import difflib
import functools
import math
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmalign.algorithms import flow_objectives as fo
from mmalign.algorithms.names import check_options, declared_options
from mmalign.config import ConfigError
from mmalign.data.batch import Rollout
from mmalign.policies import forward_process as fp
from mmalign.policies.base import ActionStats, RunInfo
from mmalign.policies.denoising import DenoisingPolicy

__all__ = [
    "DRAW_KEY",
    "FlowTraining",
    "ForwardProcessTraining",
    "ObjectiveSettings",
    "PolicyGradientTraining",
    "training_for",
]

DRAW_KEY = "_forward_draw"
"""The payload key of a microbatch's forward-process draw (sigmas and noise), shared by its chunks."""


class FlowTraining(abc.ABC):
    """The training half of a flow-matching policy: each method takes the policy and does what the policy's
    method of the same name promises."""

    objective: str | None = None
    """The forward-process objective this strategy trains with (None: none, the policy-gradient path)."""

    @abc.abstractmethod
    def setup(self, policy: Any, run: RunInfo) -> None:
        """Prepare `policy` for the run (`Policy.setup`'s contract)."""

    @abc.abstractmethod
    def rollout(
        self, policy: Any, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool
    ) -> Rollout:
        """`group_size` samples per row (`Policy.rollout`'s contract)."""

    @abc.abstractmethod
    def action_stats(self, policy: Any, rollout: Rollout, *, actions: Tensor | None) -> ActionStats:
        """The per-action statistics of `rollout` with grad (`Policy.action_stats`' contract)."""

    @abc.abstractmethod
    def action_chunks(self, policy: Any, rollout: Rollout) -> list[Tensor] | None:
        """The action columns scored per backward (None: all at once)."""

    def callbacks(self) -> list[Any]:
        """Trainer callbacks the strategy keeps (updated after every step, checkpointed); default none."""
        return []

    def export_weights(self) -> AbstractContextManager[None]:
        """The weights `save` writes, swapped in for the block (default: the trained ones)."""
        return nullcontext()


class PolicyGradientTraining(FlowTraining):
    """Flow-GRPO's path: `DenoisingPolicy`'s set-up (which refuses ``noise_level`` 0), SDE rollouts with
    per-step log-probs, their re-scoring and chunks. Holds no state: one instance serves every policy."""

    def setup(self, policy: Any, run: RunInfo) -> None:
        DenoisingPolicy.setup(policy, run)

    def rollout(
        self, policy: Any, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool
    ) -> Rollout:
        return DenoisingPolicy.rollout(policy, rows, group_size, compute_logp=compute_logp)

    def action_stats(self, policy: Any, rollout: Rollout, *, actions: Tensor | None) -> ActionStats:
        return DenoisingPolicy.action_stats(policy, rollout, actions=actions)

    def action_chunks(self, policy: Any, rollout: Rollout) -> list[Tensor] | None:
        return DenoisingPolicy.action_chunks(policy, rollout)


POLICY_GRADIENT = PolicyGradientTraining()
"""The stateless policy-gradient strategy a flow-matching policy holds until `setup` picks one."""


# ----------------------------------------------------------------------------- settings from the config


def _one_of(src: str, key: str, value: Any, allowed: tuple[str, ...]) -> None:
    """A ConfigError naming `key` (with a close match) unless `value` is one of `allowed`."""
    if value in allowed:
        return
    close = difflib.get_close_matches(str(value), allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"{src}: key '{key}' must be one of {', '.join(allowed)}, got {value!r}{hint}")


def _mapping(src: str, key: str, value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{src}: key '{key}': must be a mapping of {what} options, got {value!r}")
    return dict(value)


def _class_options(src: str, key: str, value: Any, cls: type, what: str, **fixed: Any) -> dict[str, Any]:
    """`value` (the config's `key`) as the options of `cls`: a mapping of names `cls` declares, with values its
    ``check`` accepts (with `fixed` added); a `ConfigError` naming the key otherwise."""
    options = _mapping(src, key, value, cls.__name__)
    check_options(src, key, what, options, declared_options(cls.__init__, 2))
    try:
        cls.check(**{**fixed, **options})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{src}: key '{key}': {e}") from None
    return options


def _check_timesteps(src: str, timesteps: dict[str, Any]) -> None:
    """The ``algorithm.timesteps`` values a config alone decides (the schedule is checked at set-up)."""
    strategy = timesteps.get("strategy", "schedule_subset")
    _one_of(src, "algorithm.timesteps.strategy", strategy, fo.TIMESTEP_STRATEGIES)
    num = timesteps.get("num_timesteps")
    if num is not None and (isinstance(num, bool) or not isinstance(num, int) or num < 1):
        raise ConfigError(
            f"{src}: key 'algorithm.timesteps.num_timesteps' must be an integer >= 1 (or null: from "
            f"timestep_range), got {num!r}"
        )
    try:
        fo.num_train_timesteps(1, timestep_range=timesteps.get("timestep_range", 0.99))
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"{src}: key 'algorithm.timesteps.timestep_range': {e} (a fraction x, meaning (0, x), or a pair "
            "[lo, hi])"
        ) from None
    shift = timesteps.get("time_shift", 3.0)
    if strategy in ("uniform", "logit_normal") and not shift > 0:
        raise ConfigError(f"{src}: key 'algorithm.timesteps.time_shift' must be > 0, got {shift!r}")


def _check_whole_groups(cfg: Any, objective: str, world: int) -> None:
    """A pairwise objective (``flow_dpo``) pairs samples of one group inside a microbatch: every process's
    minibatch and microbatch must hold whole groups and the rows must not be shuffled across microbatches."""
    from mmalign.algorithms import advantages as adv_lib

    t = cfg.trainer
    g = cfg.rollout.group_size + adv_lib.extra_samples(cfg.algorithm.estimator)
    local = (cfg.rollout.prompts_per_step // max(world, 1)) * g
    mini = t.minibatch_size // max(world, 1) if t.minibatch_size else local
    micro = t.microbatch_size or mini
    for key, size in (("trainer.minibatch_size", mini), ("trainer.microbatch_size", micro)):
        if size % g:
            raise ConfigError(
                f"{cfg.source}: key '{key}': algorithm.objective {objective!r} pairs the samples of a group, "
                f"so each process's share ({size}) must be a multiple of the {g} samples of a group"
            )
    shuffled = t.shuffle_minibatches and t.num_iterations * math.ceil(local / mini) > 1
    if shuffled and micro < local:
        raise ConfigError(
            f"{cfg.source}: key 'trainer.shuffle_minibatches': algorithm.objective {objective!r} pairs the "
            "samples of a group inside a microbatch; shuffling splits groups: set it to false"
        )


@dataclass(frozen=True)
class ObjectiveSettings:
    """The ``algorithm`` keys of a forward-process objective, read and checked from the config alone."""

    objective: str
    """The `flow_objectives` registry name (``algorithm.objective``)."""
    objective_kwargs: dict[str, Any]
    """Its options (``algorithm.objective_kwargs``)."""
    timesteps: dict[str, Any]
    """`flow_objectives.sample_timesteps` keywords: ``algorithm.timesteps`` over the objective's defaults."""
    old_policy: dict[str, Any] | None
    """`forward_process.OldPolicy` keywords (``algorithm.old_policy``), None: the current weights, detached."""
    eval_ema: dict[str, Any] | None
    """`forward_process.WeightEMA` keywords over ``ema_preset`` (``algorithm.eval_ema``), None when unset."""
    ema_preset: str
    """The objective's `forward_process.EMA_PRESETS` entry (registry metadata ``ema_preset``)."""
    ema_kl_beta: float
    """The weight of the objective's pull towards the EMA weights (AWM's ``ema_kl_beta``; 0: none)."""
    sample_with_old: bool
    """Rollouts sample with the old policy's weights (``algorithm.sample_with_old``)."""
    solver: str
    """How rollouts integrate (``algorithm.solver``, `forward_process.SOLVERS`)."""

    @property
    def inputs(self) -> tuple[str, ...]:
        """The objective's extra inputs (`flow_objectives.inputs`: ``v_ema``, ``v_ref``, ``pairs``)."""
        return fo.inputs(self.objective)

    @classmethod
    def from_config(cls, cfg: Any, *, world: int = 1) -> ObjectiveSettings | None:
        """The settings of ``cfg.algorithm.objective`` (None when unset), or a ConfigError naming the config
        file and key: ``algorithm.solver`` (``sde`` needs ``options.noise_level`` > 0), ``algorithm.timesteps``
        (known keys, their types and values), ``algorithm.old_policy`` and ``algorithm.eval_ema`` (known keys
        and valid values), ``algorithm.objective_kwargs.ema_kl_beta`` (a number), and for a pairwise objective
        batches of whole groups over `world` processes (``trainer.minibatch_size``, ``trainer.microbatch_size``,
        ``trainer.shuffle_minibatches``). The objective's name and option names are `check_names`' checks."""
        a = cfg.algorithm
        objective = getattr(a, "objective", None)
        if objective is None:
            return None
        src = cfg.source
        solver = getattr(a, "solver", "euler")
        _one_of(src, "algorithm.solver", solver, fp.SOLVERS)
        if solver == "sde" and getattr(getattr(cfg, "options", None), "noise_level", None) == 0:
            raise ConfigError(
                f"{src}: key 'algorithm.solver': 'sde' samples with the policy's SDE, but "
                f"'{DenoisingPolicy.noise_level_key}' is 0; choose 'euler' or 'dpm2', or a noise level > 0"
            )
        given = _mapping(src, "algorithm.timesteps", getattr(a, "timesteps", None) or {}, "timestep")
        # the options of `sample_timesteps` but those the policy supplies (schedule, batch, candidates, generator)
        declared = declared_options(fo.sample_timesteps, 2, frozenset({"candidates", "generator"}))
        check_options(src, "algorithm.timesteps", "the timestep draw", given, declared)
        timesteps = {**fo.timestep_defaults(objective), **given}
        _check_timesteps(src, timesteps)
        old = getattr(a, "old_policy", None)
        if old is not None:
            old = _class_options(src, "algorithm.old_policy", old, fp.OldPolicy, "the old policy")
        kwargs = dict(getattr(a, "objective_kwargs", None) or {})
        beta = kwargs.get("ema_kl_beta", 0.0) if "v_ema" in fo.inputs(objective) else 0.0
        if isinstance(beta, bool) or not isinstance(beta, int | float):
            raise ConfigError(
                f"{src}: key 'algorithm.objective_kwargs.ema_kl_beta': must be a number, got {beta!r}"
            )
        preset = str(fo.REGISTRY.meta(objective).get("ema_preset", "diffusion_nft"))
        ema = getattr(a, "eval_ema", None)
        if ema is not None:
            ema = _class_options(
                src, "algorithm.eval_ema", ema, fp.WeightEMA, "the EMA of the weights", preset=preset
            )
        if "pairs" in fo.inputs(objective):
            _check_whole_groups(cfg, objective, world)
        return cls(
            objective=objective,
            objective_kwargs=kwargs,
            timesteps=timesteps,
            old_policy=old,
            eval_ema=ema,
            ema_preset=preset,
            ema_kl_beta=float(beta),
            sample_with_old=bool(getattr(a, "sample_with_old", False)),
            solver=solver,
        )


def training_for(cfg: Any, *, world: int = 1) -> FlowTraining:
    """The strategy a run's config asks for: `ForwardProcessTraining` with ``algorithm.objective``, else the
    policy-gradient path (`ObjectiveSettings.from_config`'s ConfigErrors for a bad objective config)."""
    settings = ObjectiveSettings.from_config(cfg, world=world)
    return POLICY_GRADIENT if settings is None else ForwardProcessTraining(settings)


# ----------------------------------------------------------------------------- forward-process objectives


class ForwardProcessTraining(FlowTraining):
    """A forward-process objective (DiffusionNFT, AWM, Flow-DPO, any `flow_objectives` entry): rollouts keep only
    clean latents (`forward_process.sample_clean` with the settings' ``solver``; ``euler`` and ``dpm2`` need no
    noise, so ``noise_level`` 0 is allowed), one action per training sigma (``timesteps``), the old-policy EMA
    (``old_policy``) and the EMA of the weights (``eval_ema``, also built when the objective reads the EMA's
    velocity, AWM's ``ema_kl_beta`` > 0) as checkpointed trainer callbacks; the EMA of the weights is what
    `save` exports. The objective's registry metadata decides the rest: ``v_ref`` keeps a reference (a frozen
    copy under full fine-tuning), ``pairs`` scores each group's best-vs-worst pair under one shared draw."""

    def __init__(self, settings: ObjectiveSettings) -> None:
        self.settings = settings
        self.objective = settings.objective
        self.num_actions = 0
        """K: the training sigmas (actions) per sample, set by `setup`."""
        self.old_policy: fp.OldPolicy | None = None
        self.eval_ema: fp.WeightEMA | None = None
        self.ema_in_loss = settings.ema_kl_beta > 0
        """The objective reads the EMA weights' velocity (AWM's ``ema_kl_beta`` > 0)."""

    def setup(self, policy: Any, run: RunInfo) -> None:
        """The run settings every strategy applies (`FlowMatchingPolicy.setup_common`), K from the timestep
        settings and the policy's schedule (a ConfigError naming ``algorithm.timesteps`` when the schedule
        cannot give them: more sigmas than steps, or no step in ``timestep_range``: this needs the loaded
        scheduler), the old policy, the EMA of the weights (copied from the starting weights) and, for an
        objective reading the reference under full fine-tuning, its frozen copy."""
        policy.setup_common(run)
        s = self.settings
        try:
            k = fo.num_train_timesteps(
                policy.num_denoising_steps(),
                timestep_range=s.timesteps.get("timestep_range", 0.99),
                num_timesteps=s.timesteps.get("num_timesteps"),
            )
            probe = {**s.timesteps, "num_timesteps": k, "candidates": fp.training_steps(policy)}
            fo.sample_timesteps(
                policy.schedule()["sigmas"], 1, generator=torch.Generator().manual_seed(0), **probe
            )
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{run.cfg.source}: key 'algorithm.timesteps': {e}") from None
        self.num_actions = k
        self.old_policy = fp.OldPolicy(policy, **s.old_policy) if s.old_policy is not None else None
        self.eval_ema = None
        if s.eval_ema is not None or self.ema_in_loss:
            self.eval_ema = fp.WeightEMA(policy, **{"preset": s.ema_preset, **(s.eval_ema or {})})
            self.eval_ema.ensure()
        # the v-space KL comes from `action_stats` (when a reference is kept)
        policy.kl_in_action_stats = True
        if "v_ref" in s.inputs and not policy.lora and policy.ref_model is None:
            policy.ref_model = copy.deepcopy(policy.model).eval().requires_grad_(False)

    def callbacks(self) -> list[Any]:
        """The old-policy EMA and the EMA of the weights, those that are set."""
        return [cb for cb in (self.old_policy, self.eval_ema) if cb is not None]

    def export_weights(self) -> AbstractContextManager[None]:
        """The EMA of the weights when one is kept (DiffusionNFT and Flow-Factory save their EMA)."""
        return self.eval_ema.applied() if self.eval_ema is not None else nullcontext()

    def rollout(
        self, policy: Any, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool
    ) -> Rollout:
        """Clean latents only (`forward_process.sample_clean`; nothing to score, `compute_logp` is ignored), in
        chunks of whole groups of at most ``policy.rollout_batch_size`` samples; the ``sde`` solver runs the
        policy-gradient path's rollout (`DenoisingPolicy.rollout`)."""
        s = self.settings
        k = getattr(policy, "rollout_batch_size", None)
        per = len(rows) if k is None else max(1, k // group_size)  # whole groups, as the SDE path
        parts = []
        for start in range(0, len(rows), per):
            part = fp.sample_clean(
                policy,
                rows[start : start + per],
                group_size,
                num_actions=self.num_actions,
                solver=s.solver,
                weights=self.old_policy if s.sample_with_old else None,
                sde_rollout=functools.partial(DenoisingPolicy.rollout, policy),
            )
            part.group = part.group + start
            parts.append(part)
        return Rollout.cat(parts)

    def action_stats(self, policy: Any, rollout: Rollout, *, actions: Tensor | None) -> ActionStats:
        """The objective's per-action loss on the forward process of the clean latents: one draw of sigmas and
        noise per microbatch (kept in its payload under `DRAW_KEY`, so its chunks share it; a new pass slices a
        new microbatch and draws again), the old policy's velocity under its EMA (or the current weights,
        detached), the v-space KL to the reference when one is kept."""
        s = self.settings
        takes = s.inputs
        draw = rollout.payload.get(DRAW_KEY)
        if draw is None:
            draw = fp.draw_forward(policy, rollout, timesteps=s.timesteps, generator=policy.generator)
            if "pairs" in takes:  # each group's best vs worst sample, noised alike
                pairs = fo.best_worst_pairs(rollout.advantages, rollout.group, valid=rollout.mask.any(dim=1))
                draw = fp.share_pair_draw(draw, pairs)
            rollout.payload[DRAW_KEY] = draw
        rows, scored = None, rollout
        if "pairs" in takes:  # only the paired samples are scored; the others' loss is 0
            rows, draw = fp.pair_rows(draw)
            scored = rollout[rows.tolist()]
        p = fp.flow_predictions(
            policy,
            scored,
            draw=draw,
            actions=actions,
            old=self.old_policy,
            reference=policy.need_reference or "v_ref" in takes,
            ema=self.eval_ema if self.ema_in_loss else None,
        )
        inputs = {"pairs": draw.pairs} if "pairs" in takes else {}
        out = p.objective(s.objective, scored.advantages.to(p.v.device), **s.objective_kwargs, **inputs)
        kl = fo.velocity_kl(p.v, p.v_ref, 2) if p.v_ref is not None else None
        metrics = {f"objective/{k}": v for k, v in out.stats.items()}
        if out.ratio is not None:
            metrics["objective/ratio"] = out.ratio.detach()
        loss, clipped = out.per_action, out.clipped
        if rows is not None:  # back onto every sample of the microbatch (0 where unscored)
            b, dev = len(rollout), loss.device
            idx = rows.to(dev)

            def full(x: Tensor) -> Tensor:
                return torch.zeros((b, *x.shape[1:]), dtype=x.dtype, device=dev).index_copy(0, idx, x)

            loss, clipped = full(loss), full(clipped)
            kl = full(kl) if kl is not None else None
            metrics = {k: full(v) for k, v in metrics.items()}
        return ActionStats(logp=None, loss=loss, clipped=clipped, kl=kl, metrics=metrics)

    def action_chunks(self, policy: Any, rollout: Rollout) -> list[Tensor] | None:
        """One training sigma per backward (the objectives couple no actions, so the accumulated gradient is
        the one-piece gradient)."""
        k = rollout.num_actions
        return [torch.tensor([j]) for j in range(k)] if k > 1 else None
