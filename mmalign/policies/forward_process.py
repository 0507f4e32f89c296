"""The policy side of the forward-process objectives (`mmalign.algorithms.flow_objectives`: ``diffusion_nft``, ``awm``,
``flow_dpo``).

Written against the public API of `mmalign.policies.flow_matching.FlowMatchingPolicy` (every family: SD3,
FLUX.1, Wan), without changing it:

- `sample_clean`: a rollout that keeps only what these objectives train on -- the clean latents
  (``payload["clean_latents"]``, also ``outputs["latents"]`` for the rewards) and the conditioning -- sampled
  with any solver: ``euler`` (the flow ODE), ``dpm2`` (DiffusionNFT's default: deterministic second-order
  multistep DPM-Solver in x0 form) or ``sde`` (the policy's own `rollout` with its ``sde_kind``). Its ``mask``
  is Bool[B, K]: one action per training sigma;
- `draw_forward` / `flow_predictions`: for a rollout (or a microbatch of it), draw K training sigmas and the
  noise (seeded), build x_t = (1 - t) x0 + t eps and return the current policy's velocity (with grad), the
  old policy's and optionally the reference's (no grad), for all K sigmas or a chunk of them;
- `share_pair_draw` / `pair_rows`: a pairwise objective's draw (``flow_dpo``: each pair's loser noised like its
  winner) and the paired rows it scores;
- `OldPolicy`: DiffusionNFT's old policy, a copy of the trainable parameters pulled towards the current ones
  after every training step (``old <- d old + (1 - d) current``, d from the authors' decay presets), swapped
  into the model for the old velocity (and, as in the authors' script, for sampling);
- `WeightEMA`: the slower EMA of the trained weights that DiffusionNFT evaluates and saves with (Flow-Factory's
  one EMA, which AWM's ``ema_kl_beta`` regularises towards), checkpointed; `checkpoint_ema_weights` reads it
  back from a checkpoint folder.

The formulas are in docs/algorithms.md, "Forward-process objectives".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.algorithms import flow_objectives as fo
from mmalign.data.batch import Rollout, group_fields

__all__ = [
    "CLEAN_KEY",
    "DECAY_PRESETS",
    "EMA_PRESETS",
    "EMA_SCHEDULES",
    "SOLVERS",
    "FlowPredictions",
    "ForwardDraw",
    "OldPolicy",
    "WeightEMA",
    "checkpoint_ema_weights",
    "dpm2_update",
    "draw_forward",
    "flow_predictions",
    "sample_clean",
    "schedule_at",
    "pair_rows",
    "share_pair_draw",
    "training_steps",
]

CLEAN_KEY = "clean_latents"
"""The payload key of the final (clean) latents x0 a forward-process objective trains on."""
SOLVERS = ("euler", "dpm2", "sde")
"""How `sample_clean` integrates: the Euler flow ODE, DiffusionNFT's ``dpm2`` or the policy's own SDE."""
DECAY_PRESETS: dict[int, tuple[int, float, float]] = {
    0: (0, 0.0, 0.0),
    1: (0, 0.001, 0.5),
    2: (75, 0.0075, 0.999),
}
"""DiffusionNFT's ``decay_type`` presets (flat steps, ramp per step, cap) of the old policy's EMA decay
(scripts/train_nft_sd3.py ``return_decay``; its configs use 1, the OCR config 2)."""


# --------------------------------------------------------------------------- the old policy


def ema_step(ema: Sequence[Tensor], current: Sequence[Tensor], decay: float) -> None:
    """In place, for each pair: ema <- decay * ema + (1 - decay) * current (the old policy's and the evaluation
    EMA's update)."""
    for p, q in zip(current, ema, strict=True):
        q.mul_(decay).add_(p.detach().to(q.dtype), alpha=1.0 - decay)


@contextmanager
def swapped_in(params: Sequence[torch.nn.Parameter], values: Sequence[Tensor]) -> Iterator[None]:
    """The parameters hold `values` inside the block (their ``.data`` swapped, no copy) and their own tensors
    again on exit, also on an error."""
    held = [p.data for p in params]
    with torch.no_grad():
        for p, q in zip(params, values, strict=True):
            p.data = q
    try:
        yield
    finally:
        with torch.no_grad():
            for p, h in zip(params, held, strict=True):
                p.data = h


class OldPolicy:
    """DiffusionNFT's old policy: a copy of `policy`'s trainable parameters, moved after each training step by
    ``old <- d old + (1 - d) current`` with d = 0 before ``flat`` steps, then min((step - flat) ramp, cap).

    `applied()` swaps the copy into the model (the parameter tensors are exchanged, not copied) and back;
    the copy is made from the current weights on first use. It is also a trainer callback: `on_step_end`
    updates it with the trainer's step and logs ``nft/old_decay``, `state_dict` / `load_state_dict` put it in
    checkpoints. The authors count optimizer steps; with one optimizer step per training step (mmalign's
    default) the trainer's step is the same number. Under LoRA the copy is the adapter's weights (the
    authors' second adapter, ``old``); under full fine-tuning it doubles the trainable weights in memory.
    Not for FSDP2-sharded models."""

    def __init__(
        self,
        policy: Any,
        *,
        decay_type: int | None = 1,
        flat: int | None = None,
        ramp: float | None = None,
        cap: float | None = None,
    ) -> None:
        """`decay_type`: a `DECAY_PRESETS` key (the authors' default 1); `flat` / `ramp` / `cap` override
        its values (``decay_type=None`` needs all three)."""
        if decay_type is None:
            if flat is None or ramp is None or cap is None:
                raise ValueError("OldPolicy: decay_type null needs flat, ramp and cap")
            preset = (flat, ramp, cap)
        elif decay_type not in DECAY_PRESETS:
            raise ValueError(
                f"OldPolicy: decay_type must be one of {sorted(DECAY_PRESETS)}, got {decay_type!r}"
            )
        else:
            preset = DECAY_PRESETS[decay_type]
        self.flat = int(preset[0] if flat is None else flat)
        self.ramp = float(preset[1] if ramp is None else ramp)
        self.cap = float(preset[2] if cap is None else cap)
        if self.flat < 0 or self.ramp < 0 or not 0 <= self.cap < 1:
            raise ValueError(
                f"OldPolicy: need flat >= 0, ramp >= 0 and 0 <= cap < 1, got {self.flat}, {self.ramp}, {self.cap}"
            )
        self.policy = policy
        self.params: list[Tensor] | None = None
        """The old values of ``policy.trainable_parameters()`` (in that order), None until first used."""

    @classmethod
    def check(cls, **options: Any) -> None:
        """The TypeError or ValueError the constructor raises for `options`, without a policy (config
        validation before any model loads)."""
        cls(None, **options)

    def decay(self, step: int) -> float:
        """d at `step` (finished optimizer steps): 0 before ``flat``, then min((step - flat) ramp, cap)."""
        return 0.0 if step < self.flat else min((step - self.flat) * self.ramp, self.cap)

    def _current(self) -> list[Tensor]:
        params = list(self.policy.trainable_parameters())
        if self.params is not None and [p.shape for p in params] != [q.shape for q in self.params]:
            raise RuntimeError(
                "OldPolicy: the policy's trainable parameters changed shape since the copy was made"
            )
        return params

    @torch.no_grad()
    def ensure(self) -> None:
        """Make the copy from the current weights if there is none yet."""
        if self.params is None:
            self.params = [p.detach().clone() for p in self.policy.trainable_parameters()]

    @torch.no_grad()
    def update(self, step: int) -> float:
        """Move the copy towards the current weights with d = `decay` (`step`); returns d."""
        self.ensure()
        d = self.decay(step)
        assert self.params is not None
        ema_step(self.params, self._current(), d)
        return d

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The model runs with the old weights inside the block (no grad should flow: the old policy is a
        target). The current weights are back on exit, also on an error."""
        self.ensure()
        assert self.params is not None
        with swapped_in(self._current(), self.params):
            yield

    # trainer-callback face
    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        """After a training step: `update` with the trainer's step (the authors' per-epoch update)."""
        metrics["nft/old_decay"] = self.update(step)

    def state_dict(self) -> dict[str, Any]:
        return {"params": [q.detach().cpu() for q in self.params] if self.params is not None else []}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = list(state.get("params") or [])
        if not saved:
            self.params = None
            return
        params = list(self.policy.trainable_parameters())
        if [tuple(s.shape) for s in saved] != [tuple(p.shape) for p in params]:
            raise ValueError(
                "OldPolicy: the checkpoint's old weights do not match the policy's trainable parameters"
            )
        self.params = [s.to(p.device, p.dtype).clone() for s, p in zip(saved, params, strict=True)]


EMA_SCHEDULES = ("constant", "power", "linear", "piecewise_linear")
"""How `WeightEMA`'s decay follows the step count s (Flow-Factory's ``ema_decay_schedule`` names)."""
EMA_PRESETS: dict[str, dict[str, Any]] = {
    "diffusion_nft": {"decay": 0.9, "schedule": "power", "warmup_steps": 10, "every": 1, "count_from": 1},
    "flow_factory": {"decay": 0.995, "schedule": "power", "warmup_steps": 10, "every": 10, "count_from": 0},
}
"""`WeightEMA` defaults: DiffusionNFT's evaluation EMA (scripts/train_nft_sd3.py: ``EMAModuleWrapper(decay=0.9,
update_step_interval=1)``, stepped with the number of finished optimizer steps) and Flow-Factory's
``TrainingArguments`` (``ema_decay`` 0.995, ``ema_update_interval`` 10, ``ema_decay_schedule`` power, warm-up 10,
stepped with the 0-based index of the epoch just trained)."""
EMA_STATE_KIND = "weight_ema"
"""The ``kind`` tag of a `WeightEMA` state in a checkpoint's callback states (`checkpoint_ema_weights`)."""


class WeightEMA:
    """An EMA of the trainable weights for evaluation and export (DiffusionNFT's ``ema``; Flow-Factory's
    ``ema_wrapper``, the target of AWM's ``ema_kl_beta``), apart from the old policy the loss reads.

    After training step n (n finished steps) the authors' step count is s = n - 1 + ``count_from``; when
    (s + 1) % ``every`` == 0 the copy moves by ``ema <- d ema + (1 - d) current`` with d = `decay` (s):
    ``constant`` d_max; ``power`` min(d_max, (1 + s) / (warmup + s)) (d_max when warmup is 0); ``linear``
    d0 + (d_max - d0) min(s / warmup, 1); ``piecewise_linear`` 0 before ``flat_steps``, then
    min((s - flat) ramp, d_max). The copy is made from the current weights by `ensure` (the policy calls it at
    set-up, before the first step); `applied` swaps it into the model; as a trainer callback it updates after
    every step (logging ``ema/decay`` when it moves) and is checkpointed with the parameter names of
    `Policy.trainable_state_dict`, so `checkpoint_ema_weights` can load it into a policy for evaluation. Not for
    FSDP2-sharded models."""

    def __init__(
        self,
        policy: Any,
        *,
        preset: str = "diffusion_nft",
        decay: float | None = None,
        schedule: str | None = None,
        warmup_steps: int | None = None,
        initial_decay: float | None = None,
        flat_steps: int | None = None,
        ramp_rate: float | None = None,
        every: int | None = None,
        count_from: int | None = None,
    ) -> None:
        """`preset`: an `EMA_PRESETS` key whose values the other keywords override (``initial_decay`` 0,
        ``flat_steps`` 0 and ``ramp_rate`` 0.001 by default, as Flow-Factory's ``create_decay_fn``)."""
        if preset not in EMA_PRESETS:
            raise ValueError(f"eval_ema: preset must be one of {', '.join(EMA_PRESETS)}, got {preset!r}")
        base = EMA_PRESETS[preset]
        self.preset = preset
        self.max_decay = float(base["decay"] if decay is None else decay)
        self.schedule = str(base["schedule"] if schedule is None else schedule)
        self.warmup_steps = int(base["warmup_steps"] if warmup_steps is None else warmup_steps)
        self.initial_decay = float(0.0 if initial_decay is None else initial_decay)
        self.flat_steps = int(0 if flat_steps is None else flat_steps)
        self.ramp_rate = float(0.001 if ramp_rate is None else ramp_rate)
        self.every = int(base["every"] if every is None else every)
        self.count_from = int(base["count_from"] if count_from is None else count_from)
        if self.schedule not in EMA_SCHEDULES:
            raise ValueError(
                f"eval_ema: schedule must be one of {', '.join(EMA_SCHEDULES)}, got {self.schedule!r}"
            )
        if not 0 <= self.max_decay <= 1 or not 0 <= self.initial_decay <= 1:
            raise ValueError(
                f"eval_ema: decay and initial_decay must lie in [0, 1], got {self.max_decay}, {self.initial_decay}"
            )
        if self.warmup_steps < 0 or self.flat_steps < 0 or self.ramp_rate < 0:
            raise ValueError("eval_ema: warmup_steps, flat_steps and ramp_rate must be >= 0")
        if self.schedule == "linear" and self.warmup_steps == 0:
            raise ValueError("eval_ema: the linear schedule needs warmup_steps > 0")
        if self.every < 1 or self.count_from not in (0, 1):
            raise ValueError(
                f"eval_ema: need every >= 1 and count_from 0 or 1, got {self.every}, {self.count_from}"
            )
        self.policy = policy
        self.params: list[Tensor] | None = None
        """The EMA values of ``policy.trainable_parameters()`` (in that order), None until `ensure`."""
        self.updates = 0
        """How many times the copy moved."""

    @classmethod
    def check(cls, **options: Any) -> None:
        """The TypeError or ValueError the constructor raises for `options`, without a policy (config
        validation before any model loads)."""
        cls(None, **options)

    def decay(self, s: int) -> float:
        """d at the authors' step count `s` (see the class docstring)."""
        d = self.max_decay
        if self.schedule == "power":
            return d if self.warmup_steps == 0 else min(d, (1 + s) / (self.warmup_steps + s))
        if self.schedule == "linear":
            return self.initial_decay + (d - self.initial_decay) * min(s / self.warmup_steps, 1.0)
        if self.schedule == "piecewise_linear":
            return 0.0 if s < self.flat_steps else min((s - self.flat_steps) * self.ramp_rate, d)
        return d

    def _current(self) -> list[Tensor]:
        params = list(self.policy.trainable_parameters())
        if self.params is not None and [p.shape for p in params] != [q.shape for q in self.params]:
            raise RuntimeError(
                "WeightEMA: the policy's trainable parameters changed shape since the copy was made"
            )
        return params

    def names(self) -> list[str]:
        """The `Policy.trainable_state_dict` name of each trainable parameter, in `params` order."""
        by_id = {id(p): n for n, p in self.policy.model.named_parameters()}
        return [by_id[id(p)] for p in self.policy.trainable_parameters()]

    @torch.no_grad()
    def ensure(self) -> None:
        """Make the copy from the current weights if there is none yet."""
        if self.params is None:
            self.params = [p.detach().clone() for p in self.policy.trainable_parameters()]

    @torch.no_grad()
    def update(self, step: int) -> float | None:
        """After training step `step` (finished steps): move the copy when the interval says so; returns the d
        used, None when it did not move."""
        s = step - 1 + self.count_from
        if (s + 1) % self.every != 0:
            return None
        self.ensure()
        assert self.params is not None
        d = self.decay(s)
        ema_step(self.params, self._current(), d)
        self.updates += 1
        return d

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The model runs with the EMA weights inside the block (no grad should flow through them); the
        current weights are back on exit, also on an error."""
        self.ensure()
        assert self.params is not None
        with swapped_in(self._current(), self.params):
            yield

    # trainer-callback face
    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        """After a training step: `update` with the trainer's step; logs ``ema/decay`` when the copy moved."""
        d = self.update(step)
        if d is not None:
            metrics["ema/decay"] = d

    def state_dict(self) -> dict[str, Any]:
        weights = {}
        if self.params is not None:
            weights = {n: q.detach().cpu().clone() for n, q in zip(self.names(), self.params, strict=True)}
        return {"kind": EMA_STATE_KIND, "weights": weights, "updates": self.updates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = dict(state.get("weights") or {})
        self.updates = int(state.get("updates", 0))
        if not saved:
            self.params = None
            return
        params, names = list(self.policy.trainable_parameters()), self.names()
        if sorted(saved) != sorted(names) or any(
            tuple(saved[n].shape) != tuple(p.shape) for n, p in zip(names, params, strict=True)
        ):
            raise ValueError(
                "WeightEMA: the checkpoint's EMA weights do not match the policy's trainable parameters"
            )
        self.params = [saved[n].to(p.device, p.dtype).clone() for n, p in zip(names, params, strict=True)]


def checkpoint_ema_weights(checkpoint: str | Path) -> dict[str, Tensor] | None:
    """The `WeightEMA` weights a checkpoint folder holds (name -> tensor, the keys of its
    ``trainable.safetensors``), read from its trainer state with ``weights_only`` loading; None when the run
    kept no EMA. For `mmalign eval` / `mmalign sample`: load these in place of the trained weights."""
    from mmalign.training import rundir

    path = Path(checkpoint)
    legacy = not (path / rundir.MANIFEST_FILE).is_file()
    state = rundir.load_state(path / rundir.TRAINER_STATE_FILE, legacy=legacy)
    for cb in state.get("callbacks") or []:
        if isinstance(cb, Mapping) and cb.get("kind") == EMA_STATE_KIND and cb.get("weights"):
            return dict(cb["weights"])
    return None


# --------------------------------------------------------------------------- schedule of a training sigma


def training_steps(policy: Any) -> list[int]:
    """The schedule steps training sigmas may be drawn from: every step a rollout runs, or, for a two-expert
    Wan model training one expert (``train_expert`` high / low), that expert's steps."""
    n = int(policy.num_denoising_steps())
    want = {"high": 0, "low": 1}.get(getattr(policy, "train_expert", "both"))
    if want is None:
        return list(range(n))
    experts = policy.schedule()["expert"]
    return [i for i in range(n) if int(experts[i]) == want]


def schedule_at(policy: Any, t: Tensor, index: Tensor | None = None) -> dict[str, Tensor]:
    """The ``sched`` dict `FlowMatchingPolicy.predict` takes for training sigmas `t` Float[B]: every
    ``schedule_keys`` value of the schedule step `index` Long[B] with ``sigmas`` = `t`, and ``step_index``.
    Without `index` (continuous sigmas) the other values are the nearest step's, except Wan's ``expert``,
    which follows ``WanPipeline``'s rule at t itself (high-noise expert while t >= ``boundary_ratio``)."""
    table = policy.schedule()
    sig = table["sigmas"].to("cpu", torch.float32)
    t_cpu = t.detach().to("cpu", torch.float32)
    exact = index is not None
    idx = index.to("cpu") if exact else (t_cpu[:, None] - sig[None, :]).abs().argmin(dim=1)
    dev = policy.device
    sched: dict[str, Tensor] = {}
    for k, v in table.items():
        sched[k] = (v.expand(len(t_cpu)) if v.ndim == 0 else v[idx]).to(dev)
    if "expert" in table and not exact:
        boundary = getattr(policy, "boundary_ratio", None)
        expert = (t_cpu < boundary).long() if boundary is not None else torch.zeros_like(idx)
        sched["expert"] = expert.to(dev)
    sched["sigmas"] = t.detach().to(dev, torch.float32)
    sched["step_index"] = idx.to(dev)
    return sched


# --------------------------------------------------------------------------- sampling clean latents


def dpm2_update(
    x: Tensor, x0: Tensor, x0_prev: Tensor | None, sigma_prev: float | None, sigma: float, sigma_next: float
) -> Tensor:
    """One step of DiffusionNFT's ``dpm2`` sampler (its flow_grpo/diffusers_patch/solver.py), x at `sigma`
    -> `sigma_next`, from the x0 predictions at this step (`x0`) and the previous one (`x0_prev`, None at
    the first step). The first step and the step to sigma' = 0 are DDIM steps x' = (1 - s') x0 + s' eps_hat
    (eps_hat = (x - (1 - s) x0) / s); the others the second-order multistep DPM-Solver++ update with
    lambda = log((1 - s) / s): x' = (s'/s) x - (1 - s')(e^-h - 1)(D0 + D1/2), h = lambda' - lambda,
    D0 = x0, D1 = (x0 - x0_prev) h / (lambda - lambda_prev)."""
    if x0_prev is None or sigma_prev is None or sigma_next == 0:
        eps = (x - (1 - sigma) * x0) / sigma
        return (1 - sigma_next) * x0 + sigma_next * eps
    lam = torch.tensor([sigma_prev, sigma, sigma_next], dtype=torch.float64)
    lam = torch.log(1 - lam) - torch.log(lam)
    h, h0 = lam[2] - lam[1], lam[1] - lam[0]
    d1 = (x0 - x0_prev) * float(h / h0)  # h0 = inf (the first sigma is 1): D1 = 0, a first-order step
    coef = (1 - sigma_next) * float(torch.expm1(-h))
    return (sigma_next / sigma) * x - coef * x0 - 0.5 * coef * d1


def _drop_trajectory(rollout: Rollout, policy: Any, num_actions: int) -> Rollout:
    """A policy rollout reduced to the clean latents and the conditioning, with a Bool[B, K] mask."""
    keys = (*policy.conditioning_keys, *policy.row_conditioning_keys)
    clean = rollout.outputs["latents"]
    payload = {k: rollout.payload[k] for k in keys}
    payload[CLEAN_KEY] = clean
    outputs = {k: v for k, v in rollout.outputs.items()}
    return Rollout(
        group=rollout.group,
        mask=torch.ones((len(rollout), num_actions), dtype=torch.bool),
        prompts=rollout.prompts,
        columns=rollout.columns,
        outputs=outputs,
        payload=payload,
    )


@torch.no_grad()
def sample_clean(
    policy: Any,
    rows: list[dict[str, Any]],
    group_size: int,
    *,
    num_actions: int,
    solver: str = "euler",
    weights: OldPolicy | None = None,
    sde_rollout: Callable[..., Rollout] | None = None,
) -> Rollout:
    """Sample `group_size` clean latents per row with `solver` (`SOLVERS`) and keep no trajectory: the
    payload holds the conditioning (``conditioning_keys`` and ``row_conditioning_keys``) and
    ``clean_latents``; ``mask`` is Bool[B, `num_actions`] (one action per training sigma). ``euler`` and
    ``dpm2`` run every step deterministically from the policy's initial latents (its seeded generator), with
    the guidance the rollout uses; ``sde`` is the policy's own `rollout` (``sde_kind``), or `sde_rollout`
    (``rows, group_size, compute_logp=False``) when given: a policy whose `rollout` comes here passes its SDE
    path's. With `weights` the old policy samples (DiffusionNFT samples with its old adapter)."""
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {', '.join(SOLVERS)}; got {solver!r}")
    if num_actions < 1:
        raise ValueError(f"num_actions must be >= 1, got {num_actions}")
    ctx = weights.applied() if weights is not None else nullcontext()
    with ctx:
        if solver == "sde":
            sample = policy.rollout if sde_rollout is None else sde_rollout
            return _drop_trajectory(sample(rows, group_size, compute_logp=False), policy, num_actions)
        prompts, group, columns = group_fields(rows, group_size)
        b, dev = len(prompts), policy.device
        cond = policy.conditioning(prompts)
        cond.update(policy.row_conditioning(columns, group))
        table = {k: v.to(dev) for k, v in policy.schedule().items()}
        x = policy.initial_latents(group, cond, columns)
        was_training = policy.model.training
        policy.model.eval()
        x0_prev: Tensor | None = None
        sigma_prev: float | None = None
        try:
            for i in range(policy.num_denoising_steps()):
                sched = {k: (v[i] if v.ndim else v).expand(b) for k, v in table.items()}
                sched["step_index"] = torch.full((b,), i, dtype=torch.long, device=dev)
                pred = policy.predict(policy.model, x, sched, cond, guided=True)[0]
                if solver == "euler":
                    x = policy.ode_step(pred, x, sched)
                    continue
                s, s_next = float(table["sigmas"][i]), float(table["sigmas_next"][i])
                x0 = x - s * pred
                x = dpm2_update(x, x0, x0_prev, sigma_prev, s, s_next)
                x0_prev, sigma_prev = x0, s
        finally:
            if was_training:
                policy.model.train()
    clean = x.cpu()
    payload: dict[str, Any] = {k: v.cpu() for k, v in cond.items()}
    payload[CLEAN_KEY] = clean
    rollout = Rollout(
        group=group,
        mask=torch.ones((b, num_actions), dtype=torch.bool),
        prompts=prompts,
        columns=columns,
        outputs={"latents": clean},
        payload=payload,
    )
    policy.rollout_outputs(rollout)
    return rollout


# --------------------------------------------------------------------------- predictions on the forward process


@dataclass
class FlowPredictions:
    """What a forward-process objective takes, for B samples and K training sigmas each."""

    v: Tensor
    """Float[B, K, *latent] the current policy's velocity at x_t (carries grad)."""
    v_old: Tensor
    """Float[B, K, *latent] the old policy's velocity at the same x_t (no grad)."""
    v_ref: Tensor | None
    """Float[B, K, *latent] the reference's (adapter off / frozen copy), when asked for (no grad)."""
    noise: Tensor
    """Float[B, K, *latent] eps."""
    x0: Tensor
    """Float[B, K, *latent] the clean latents (an expanded view of Float[B, 1, *latent])."""
    t: Tensor
    """Float[B, K] the training sigmas."""
    index: Tensor | None
    """Long[B, K] their schedule steps (None for continuous strategies)."""
    mask: Tensor
    """Bool[B, K] the rollout's mask."""
    v_ema: Tensor | None = None
    """Float[B, K, *latent] the `WeightEMA` weights' velocity, when asked for (no grad)."""

    def objective(self, name: str, advantages: Tensor, **options: Any) -> fo.FlowObjectiveOutput:
        """The registered objective `name` on these predictions (with ``v_ema`` / ``v_ref`` when it takes those
        inputs; other inputs, e.g. ``flow_dpo``'s ``pairs``, come in `options`)."""
        takes = fo.inputs(name)
        extra = {k: getattr(self, k) for k in ("v_ema", "v_ref") if k in takes}
        return fo.get(name)(
            self.v, self.v_old, self.noise, self.x0, self.t, advantages, self.mask, **options, **extra
        )


@dataclass
class ForwardDraw:
    """The random part of the forward process of B samples: K training sigmas each and their noise."""

    t: Tensor
    """Float[B, K] the training sigmas (CPU)."""
    index: Tensor | None
    """Long[B, K] their schedule steps (None for continuous strategies)."""
    noise: Tensor
    """Float[B, K, *latent] eps (CPU)."""
    pairs: Tensor | None = None
    """Long[P, 2] (winner row, loser row) of a pairwise objective (``flow_dpo``), whose loser rows carry their
    winner's sigmas and noise (`share_pair_draw`); None otherwise."""


def share_pair_draw(draw: ForwardDraw, pairs: Tensor) -> ForwardDraw:
    """A copy of `draw` in which each pair's loser row (``pairs[:, 1]``) takes its winner's (``pairs[:, 0]``)
    sigmas, schedule steps and noise, as Diffusion-DPO noises both images of a pair alike; ``pairs`` is kept
    on the result."""
    pairs = pairs.to("cpu", torch.long).reshape(-1, 2)
    win, lose = pairs[:, 0], pairs[:, 1]
    t, noise = draw.t.clone(), draw.noise.clone()
    t[lose], noise[lose] = t[win], noise[win]
    index = None
    if draw.index is not None:
        index = draw.index.clone()
        index[lose] = index[win]
    return ForwardDraw(t=t, index=index, noise=noise, pairs=pairs)


def pair_rows(draw: ForwardDraw) -> tuple[Tensor, ForwardDraw]:
    """The rows of `draw`'s pairs (Long[R], ascending; a pairwise objective scores only these) and the draw of
    those rows alone, its ``pairs`` renumbered to positions among them. Without pairs: row 0 alone and no pair
    (the loss is then 0 with a graph, so a backward still runs)."""
    pairs = draw.pairs if draw.pairs is not None else torch.zeros(0, 2, dtype=torch.long)
    rows = torch.unique(pairs.reshape(-1)) if pairs.numel() else torch.zeros(1, dtype=torch.long)
    where = {int(r): i for i, r in enumerate(rows.tolist())}
    local = torch.tensor([[where[int(a)], where[int(b)]] for a, b in pairs.tolist()], dtype=torch.long)
    sub = ForwardDraw(
        t=draw.t[rows],
        index=None if draw.index is None else draw.index[rows],
        noise=draw.noise[rows],
        pairs=local.reshape(-1, 2),
    )
    return rows, sub


def draw_forward(
    policy: Any,
    rollout: Rollout,
    *,
    timesteps: Mapping[str, Any] | None = None,
    generator: torch.Generator | None = None,
) -> ForwardDraw:
    """K = ``rollout.mask.shape[1]`` training sigmas per sample by `mmalign.algorithms.flow_objectives.sample_timesteps` with
    `timesteps` (its keywords: ``strategy``, ``timestep_range``, ...; the schedule is the policy's
    ``schedule()["sigmas"]``, the candidates `training_steps`), then the noise Float[B, K, *latent]; both on
    the CPU from `generator` (None: torch's global RNG)."""
    if CLEAN_KEY not in rollout.payload:
        raise KeyError(
            f"the rollout has no payload[{CLEAN_KEY!r}]: sample it with mmalign.policies.forward_process.sample_clean"
        )
    b, k = rollout.mask.shape
    opts = dict(timesteps or {})
    opts.setdefault("candidates", training_steps(policy))
    opts["num_timesteps"] = k
    draw = fo.sample_timesteps(policy.schedule()["sigmas"], b, generator=generator, **opts)
    noise = torch.randn((b, k, *rollout.payload[CLEAN_KEY].shape[1:]), generator=generator)
    return ForwardDraw(t=draw.t, index=draw.index, noise=noise)


def flow_predictions(
    policy: Any,
    rollout: Rollout,
    *,
    timesteps: Mapping[str, Any] | None = None,
    draw: ForwardDraw | None = None,
    actions: Tensor | None = None,
    old: OldPolicy | None = None,
    reference: bool = False,
    ema: WeightEMA | None = None,
    generator: torch.Generator | None = None,
    model: torch.nn.Module | None = None,
) -> FlowPredictions:
    """Velocities on the forward process of `rollout`'s clean latents (``payload["clean_latents"]``).

    `draw` (default: `draw_forward` with `timesteps` and `generator`) gives the sigmas and noise; `actions`
    Long[k] selects columns of it (default: all K), so a microbatch can be scored one chunk of sigmas at a
    time with one draw. For every column: x_t = (1 - t) x0 + t eps, the old velocity under `old` (None: the
    current weights, detached -- the old policy of an on-policy update), the reference's when `reference`
    (the adapter-disabled model under LoRA, else the frozen copy), the EMA weights' under `ema`, all without
    grad and before the current one, which runs `model` (default ``policy.forward_model``) with grad. Every call is `predict` with
    ``guided=policy.train_guidance``."""
    if draw is None:
        draw = draw_forward(policy, rollout, timesteps=timesteps, generator=generator)
    dev = policy.device
    x0 = rollout.payload[CLEAN_KEY].to(dev, torch.float32)
    cols = torch.arange(draw.t.shape[1]) if actions is None else actions.to("cpu", torch.long)
    t = draw.t[:, cols].to(dev)
    index = None if draw.index is None else draw.index[:, cols]
    noise = draw.noise[:, cols].to(dev)
    k = len(cols)
    cond = {
        key: rollout.payload[key].to(dev)
        for key in (*policy.conditioning_keys, *policy.row_conditioning_keys)
    }
    guided = bool(policy.train_guidance)
    scheds = [schedule_at(policy, t[:, j], None if index is None else index[:, j]) for j in range(k)]
    x_ts = [fo.noised(x0, noise[:, j], t[:, j]) for j in range(k)]

    def run(net: torch.nn.Module, j: int) -> Tensor:
        return policy.predict(net, x_ts[j], scheds[j], cond, guided=guided)[0]

    v_old = v_ref = v_ema = None
    with torch.no_grad():
        if old is not None:
            with old.applied():
                v_old = torch.stack([run(policy.model, j) for j in range(k)], dim=1)
        if reference:
            with policy.reference_network() as ref:
                v_ref = torch.stack([run(ref, j) for j in range(k)], dim=1)
        if ema is not None:
            with ema.applied():
                v_ema = torch.stack([run(policy.model, j) for j in range(k)], dim=1)
    net = policy.forward_model if model is None else model
    v = torch.stack([run(net, j) for j in range(k)], dim=1)
    if v_old is None:
        v_old = v.detach()
    return FlowPredictions(
        v=v,
        v_old=v_old,
        v_ref=v_ref,
        noise=noise,
        x0=x0[:, None].expand_as(v),
        t=t,
        index=index,
        mask=rollout.mask[:, cols].to(dev),
        v_ema=v_ema,
    )
