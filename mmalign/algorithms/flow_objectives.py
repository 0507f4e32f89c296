"""Forward-process objectives of flow-matching policies: DiffusionNFT, Advantage Weighted Matching and
Flow-DPO (Diffusion-DPO on best-vs-worst pairs of each group).

These train on the *forward* (noising) process of clean samples, so a rollout may use any solver (an ODE
included) and stores neither a trajectory nor per-step log-probs. For a clean sample x0, noise eps and a
sigma t in (0, 1] the noised latent is ``x_t = (1 - t) x0 + t eps`` and the flow-matching velocity target
is ``eps - x0`` (``x0 = x_t - t v``). The formulas (with the functions that implement them) are in
docs/algorithms.md, "Forward-process objectives".

The registry contract and the helpers: docs/algorithms.md, "mmalign.algorithms.flow_objectives".
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mmalign.registry import Registry, option_checked

__all__ = [
    "ADV_MODES",
    "AWM_WEIGHTINGS",
    "REGISTRY",
    "TIMESTEP_STRATEGIES",
    "FlowObjectiveOutput",
    "TimestepDraw",
    "awm",
    "awm_log_prob",
    "best_worst_pairs",
    "diffusion_nft",
    "flow_dpo",
    "get",
    "inputs",
    "names",
    "nft_optimality",
    "noised",
    "num_train_timesteps",
    "register",
    "sample_timesteps",
    "timestep_defaults",
    "velocity_kl",
]

LOG_RATIO_CLAMP = 20.0
"""AWM's log-ratio is clamped to [-20, 20] before exp (as `mmalign.algorithms.losses`); it only bites on garbage."""
ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")
"""DiffusionNFT's ``adv_mode`` options (its training script's ``config.train.adv_mode``)."""
AWM_WEIGHTINGS = ("uniform", "t", "t**2", "huber", "ghuber")
"""Flow-Factory's ``awm_weighting`` options (matched case-insensitively: its default is spelt ``Uniform``)."""
TIMESTEP_STRATEGIES = (
    "schedule_subset",
    "discrete",
    "discrete_with_init",
    "discrete_wo_init",
    "uniform",
    "logit_normal",
)
"""How training sigmas are drawn (`sample_timesteps`)."""
WEIGHT_FLOOR = 1e-5
"""DiffusionNFT's adaptive weight is clipped below at this value."""
GHUBER_EPS = 1e-10
"""Flow-Factory's epsilon inside the (generalised) Huber weightings."""


@dataclass
class FlowObjectiveOutput:
    """What a forward-process objective returns, per action (shape ``L`` of its ``t``)."""

    per_action: Tensor
    """Float[*L] loss of each action (carries grad), exactly 0 where the mask is False."""
    clipped: Tensor
    """Bool[*L] where a clip cut the gradient (AWM's ratio clip; all False for DiffusionNFT)."""
    ratio: Tensor | None = None
    """Float[*L] importance ratio (AWM), 1 where masked; None for objectives without one."""
    stats: dict[str, Tensor] = field(default_factory=dict)
    """Detached per-action diagnostics (Float[*L]) worth logging as their masked mean."""


FlowObjective = Callable[..., FlowObjectiveOutput]
REGISTRY: Registry[FlowObjective] = Registry("flow objective")


def register(name: str, **meta: Any) -> Callable[[FlowObjective], FlowObjective]:
    """Decorator registering ``fn(v, v_old, noise, x0, t, advantages, mask, **options)``. ``meta`` may
    carry ``timesteps``: the keyword defaults of `sample_timesteps` the objective's paper uses,
    ``inputs``: keyword tensors the caller passes (not options; see `inputs`), and ``ema_preset``: the
    `mmalign.policies.forward_process.EMA_PRESETS` entry of the authors' EMA of the weights."""

    def deco(fn: FlowObjective) -> FlowObjective:
        return REGISTRY.register(name, **meta)(option_checked(REGISTRY.kind, name, fn, n_positional=7))

    return deco


def get(name: str) -> FlowObjective:
    """The objective registered under ``name`` (``RegistryError``, a KeyError, if unknown)."""
    return REGISTRY.get(name)


def names() -> list[str]:
    """Sorted names of the registered forward-process objectives."""
    return REGISTRY.names()


def inputs(name: str) -> tuple[str, ...]:
    """Keyword tensors beyond the seven positional ones that the caller supplies (registry metadata
    ``inputs``, e.g. AWM's ``v_ema``); they are not config options."""
    return tuple(REGISTRY.meta(name).get("inputs", ()))


def options(name: str) -> dict[str, Any]:
    """The options an objective accepts, with their defaults (for config validation; `inputs` excluded)."""
    params = list(inspect.signature(inspect.unwrap(REGISTRY.get(name))).parameters.values())[7:]
    skip = set(inputs(name))
    return {
        p.name: p.default
        for p in params
        if p.kind is not inspect.Parameter.VAR_KEYWORD and p.name not in skip
    }


def timestep_defaults(name: str) -> dict[str, Any]:
    """The `sample_timesteps` keywords the objective's authors train with (registry metadata)."""
    return dict(REGISTRY.meta(name).get("timesteps", {}))


# --------------------------------------------------------------------------- forward process


def _broadcast(x: Tensor, like: Tensor) -> Tensor:
    """`x` Float[*L] viewed as [*L, 1, ..., 1] against `like` Float[*L, *latent]."""
    return x.reshape(*x.shape, *([1] * (like.ndim - x.ndim)))


def noised(x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
    """x_t = (1 - t) x0 + t eps, with t Float[*L] broadcast over the latent dims of `x0` / `noise`."""
    tt = _broadcast(t.to(noise.dtype), noise)
    return (1 - tt) * x0 + tt * noise


def velocity_kl(v: Tensor, v_ref: Tensor, action_ndim: int) -> Tensor:
    """Float[*L]: mean over the latent dims of (v - v_ref)^2, the v-space KL of DiffusionNFT's and
    Flow-Factory's training scripts (``v_ref`` detached; `action_ndim` = len(L))."""
    d = (v - v_ref.detach()) ** 2
    return d.mean(dim=tuple(range(action_ndim, d.ndim))) if d.ndim > action_ndim else d


def _latent_mean(x: Tensor, action_ndim: int, *, keepdim: bool = False) -> Tensor:
    dims = tuple(range(action_ndim, x.ndim))
    return x.mean(dim=dims, keepdim=keepdim) if dims else x


def _prepare(
    v: Tensor, v_old: Tensor, noise: Tensor, x0: Tensor, t: Tensor, advantages: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Check shapes; return (v, v_old, noise, x0, advantages Float[*L], mask Bool[*L], t) on `v`'s device,
    with every masked action's tensors replaced by 0 (so NaN or inf there never enters the arithmetic)."""
    lead = tuple(t.shape)
    n = len(lead)
    if n == 0 or tuple(v.shape[:n]) != lead:
        raise ValueError(f"v {tuple(v.shape)} must start with the action shape of t {lead}")
    if v_old.shape != v.shape or noise.shape != v.shape:
        raise ValueError(
            f"v {tuple(v.shape)}, v_old {tuple(v_old.shape)} and noise {tuple(noise.shape)} must match"
        )
    x0 = x0.to(v.device, v.dtype).expand_as(v)
    adv = advantages.detach().to(v.device, v.dtype)
    if adv.ndim == 1 and n == 2 and adv.shape[0] == lead[0]:
        adv = adv[:, None].expand(lead)
    elif tuple(adv.shape) != lead:
        raise ValueError(f"advantages must be Float[B] or Float{list(lead)}, got {tuple(adv.shape)}")
    if mask is None:
        mask = torch.ones(lead, dtype=torch.bool, device=v.device)
    elif tuple(mask.shape) != lead:
        raise ValueError(f"mask {tuple(mask.shape)} must have the action shape of t {lead}")
    mask = mask.to(device=v.device, dtype=torch.bool)
    m = _broadcast(mask, v)
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    t = torch.where(mask, t.to(v.device, v.dtype), zero)
    v, v_old = torch.where(m, v, zero), torch.where(m, v_old.to(v.dtype), zero)
    noise, x0 = torch.where(m, noise.to(v.dtype), zero), torch.where(m, x0, zero)
    return v, v_old, noise, x0, torch.where(mask, adv, zero), mask, t


def _zero_masked(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros_like(x))


# --------------------------------------------------------------------------- DiffusionNFT


def nft_optimality(advantages: Tensor, *, adv_clip_max: float = 5.0, adv_mode: str = "all") -> Tensor:
    """DiffusionNFT's optimality probability r in [0, 1] of each advantage: clip A to
    [-adv_clip_max, adv_clip_max] (``adv_mode`` first reshapes it: ``positive_only`` / ``negative_only``
    keep one sign, ``one_only`` maps A > 0 to 1 and the rest to 0, ``binary`` takes sign(A)), then
    r = clamp(A / adv_clip_max / 2 + 1/2, 0, 1) (NVlabs/DiffusionNFT, scripts/train_nft_sd3.py)."""
    if not adv_clip_max > 0:
        raise ValueError(f"diffusion_nft: adv_clip_max must be > 0, got {adv_clip_max!r}")
    if adv_mode not in ADV_MODES:
        raise ValueError(f"diffusion_nft: adv_mode must be one of {', '.join(ADV_MODES)}; got {adv_mode!r}")
    a = advantages.clamp(-adv_clip_max, adv_clip_max)
    if adv_mode == "positive_only":
        a = a.clamp(0, adv_clip_max)
    elif adv_mode == "negative_only":
        a = a.clamp(-adv_clip_max, 0)
    elif adv_mode == "one_only":
        a = (a > 0).to(a.dtype)
    elif adv_mode == "binary":
        a = torch.sign(a)
    return (a / adv_clip_max / 2.0 + 0.5).clamp(0, 1)


def _adaptive_x0_loss(x0_pred: Tensor, x0: Tensor, n: int) -> Tensor:
    """mean((x0_pred - x0)^2) / sg(max(mean|x0_pred - x0|, 1e-5)) over the latent dims (the weight in
    float64, as the authors' code computes it)."""
    err = x0_pred - x0
    with torch.no_grad():
        w = _latent_mean(err.detach().double().abs(), n, keepdim=True).clamp(min=WEIGHT_FLOOR)
    return _latent_mean(err**2 / w.to(err.dtype), n)


@register(
    "diffusion_nft",
    timesteps={"strategy": "schedule_subset", "timestep_range": 0.99},
    ema_preset="diffusion_nft",
)
def diffusion_nft(
    v: Tensor,
    v_old: Tensor,
    noise: Tensor,
    x0: Tensor,
    t: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    beta: float = 1.0,
    adv_clip_max: float = 5.0,
    adv_mode: str = "all",
    adaptive_weight: bool = True,
) -> FlowObjectiveOutput:
    """DiffusionNFT (Zheng et al. 2025, "Online Diffusion Reinforcement with Forward Process"): the
    negative-aware flow-matching loss on clean samples.

    Implicit policies v+ = beta v + (1 - beta) sg(v_old) and v- = (1 + beta) sg(v_old) - beta v; each
    predicts x0± = x_t - t v±; with the adaptive weight w± = sg(max(mean|x0± - x0|, 1e-5)) the losses are
    L± = mean((x0± - x0)^2) / w±; r = `nft_optimality` (A); per action
    ``adv_clip_max * (r L+ + (1 - r) L-) / beta`` (the authors' scaling, scripts/train_nft_sd3.py).
    Defaults are the paper's released config: beta 1 (0.1 for its OCR and multi-reward runs),
    adv_clip_max 5, adv_mode ``all``; ``adaptive_weight: false`` drops w± (plain squared error)."""
    if not beta > 0:
        raise ValueError(f"diffusion_nft: beta must be > 0, got {beta!r}")
    v, v_old, noise, x0, adv, mask, t = _prepare(v, v_old, noise, x0, t, advantages, mask)
    n = t.ndim
    r = nft_optimality(adv, adv_clip_max=adv_clip_max, adv_mode=adv_mode)
    old = v_old.detach()
    x_t = noised(x0, noise, t)
    tt = _broadcast(t, v)
    pos = x_t - tt * (beta * v + (1.0 - beta) * old)
    neg = x_t - tt * ((1.0 + beta) * old - beta * v)
    if adaptive_weight:
        loss_pos, loss_neg = _adaptive_x0_loss(pos, x0, n), _adaptive_x0_loss(neg, x0, n)
    else:
        loss_pos, loss_neg = _latent_mean((pos - x0) ** 2, n), _latent_mean((neg - x0) ** 2, n)
    per_action = adv_clip_max * (r * loss_pos + (1.0 - r) * loss_neg) / beta
    stats = {
        "positive_loss": loss_pos.detach(),
        "negative_loss": loss_neg.detach(),
        "old_deviate": _latent_mean((v.detach() - old) ** 2, n),
        "r": r,
    }
    return FlowObjectiveOutput(
        per_action=_zero_masked(per_action, mask),
        clipped=torch.zeros_like(mask),
        ratio=None,
        stats={k: _zero_masked(s, mask) for k, s in stats.items()},
    )


# --------------------------------------------------------------------------- AWM


def _clip_pair(value: float | Sequence[float], name: str) -> tuple[float, float]:
    """Flow-Factory's (lo, hi) convention: a scalar c means (-c, c)."""
    if isinstance(value, (int, float)):
        lo, hi = -abs(float(value)), abs(float(value))
    else:
        if len(value) != 2:
            raise ValueError(f"awm: {name} must be a number or [lo, hi], got {value!r}")
        lo, hi = float(value[0]), float(value[1])
    if not lo <= 0 <= hi:
        raise ValueError(f"awm: {name} must satisfy lo <= 0 <= hi, got {value!r}")
    return lo, hi


def awm_log_prob(
    v: Tensor, target: Tensor, t: Tensor, *, weighting: str = "uniform", ghuber_power: float = 0.25
) -> Tensor:
    """Float[*L]: AWM's surrogate log-prob -w(l, t) of the matching loss l = mean((v - target)^2) over the
    latent dims (target = eps - x0), computed in float64 and returned in `v`'s dtype. Flow-Factory's
    weightings: ``uniform`` l, ``t`` t l, ``t**2`` t^2 l, ``huber`` t (sqrt(l + e) - sqrt(e)),
    ``ghuber`` t / p ((l + e)^p - e^p), with e = 1e-10 and p = `ghuber_power`."""
    kind = weighting.lower()
    if kind not in AWM_WEIGHTINGS:
        raise ValueError(f"awm: weighting must be one of {', '.join(AWM_WEIGHTINGS)}; got {weighting!r}")
    if kind == "ghuber" and not ghuber_power > 0:
        raise ValueError(f"awm: ghuber_power must be > 0, got {ghuber_power!r}")
    n = t.ndim
    loss = _latent_mean((v.double() - target.double()) ** 2, n)
    tt = t.double()
    if kind == "uniform":
        w = loss
    elif kind == "t":
        w = tt * loss
    elif kind == "t**2":
        w = tt**2 * loss
    elif kind == "huber":
        w = tt * (torch.sqrt(loss + GHUBER_EPS) - math.sqrt(GHUBER_EPS))
    else:
        p = ghuber_power
        w = tt / p * ((loss + GHUBER_EPS) ** p - GHUBER_EPS**p)
    return (-w).to(v.dtype)


@register(
    "awm",
    timesteps={"strategy": "discrete", "timestep_range": 0.9},
    inputs=("v_ema",),
    ema_preset="flow_factory",
)
def awm(
    v: Tensor,
    v_old: Tensor,
    noise: Tensor,
    x0: Tensor,
    t: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    weighting: str = "uniform",
    ghuber_power: float = 0.25,
    clip_range: float | Sequence[float] = 1e-4,
    adv_clip_range: float | Sequence[float] = 5.0,
    ema_kl_beta: float = 0.0,
    v_ema: Tensor | None = None,
) -> FlowObjectiveOutput:
    """AWM (Xue et al. 2025, "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion
    Models"), as Flow-Factory implements it (trainers/awm.py): a PPO-clipped advantage-weighted
    flow-matching loss.

    log pi = `awm_log_prob` (v), log pi_old = the same of sg(v_old) (same x_t, eps, t); rho =
    exp(log pi - log pi_old); A clamped to `adv_clip_range`; per action max(-A rho, -A clip(rho, 1 + lo,
    1 + hi)) with (lo, hi) = `clip_range`, plus ``ema_kl_beta * mean((v - sg(v_ema))^2)`` over the latent
    dims (Flow-Factory's EMA KL: `velocity_kl` to the velocity `v_ema` of an EMA of the weights, an input the
    caller supplies, needed when ``ema_kl_beta`` > 0). Defaults are Flow-Factory's AWMTrainingArguments:
    weighting ``uniform`` (its example config: ``ghuber`` with power 0.25), clip_range 1e-4, adv_clip_range 5,
    ema_kl_beta 0 (its guide recommends 0.1, its SD3.5 example 1)."""
    c_lo, c_hi = _clip_pair(clip_range, "clip_range")
    a_lo, a_hi = _clip_pair(adv_clip_range, "adv_clip_range")
    if not (math.isfinite(ema_kl_beta) and ema_kl_beta >= 0):
        raise ValueError(f"awm: ema_kl_beta must be a finite number >= 0, got {ema_kl_beta!r}")
    if ema_kl_beta > 0 and v_ema is None:
        raise ValueError("awm: ema_kl_beta > 0 needs v_ema, the velocity of the EMA of the weights")
    if v_ema is not None and v_ema.shape != v.shape:
        raise ValueError(f"awm: v_ema {tuple(v_ema.shape)} must match v {tuple(v.shape)}")
    v, v_old, noise, x0, adv, mask, t = _prepare(v, v_old, noise, x0, t, advantages, mask)
    target = noise - x0
    logp = awm_log_prob(v, target, t, weighting=weighting, ghuber_power=ghuber_power)
    with torch.no_grad():
        logp_old = awm_log_prob(v_old.detach(), target, t, weighting=weighting, ghuber_power=ghuber_power)
    zero = torch.zeros_like(logp)
    log_ratio = torch.where(mask, logp - logp_old, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    a = adv.clamp(a_lo, a_hi)
    unclipped = -a * ratio
    clipped_loss = -a * ratio.clamp(1.0 + c_lo, 1.0 + c_hi)
    clipped = mask & (clipped_loss > unclipped)
    per_action = torch.where(clipped, clipped_loss, unclipped)
    stats = {"log_prob": _zero_masked(logp.detach(), mask)}
    if v_ema is not None:
        zero_v = torch.zeros((), dtype=v.dtype, device=v.device)
        kl = velocity_kl(v, torch.where(_broadcast(mask, v), v_ema.to(v.device, v.dtype), zero_v), t.ndim)
        if ema_kl_beta > 0:
            per_action = per_action + ema_kl_beta * kl
        stats["ema_kl"] = _zero_masked(kl.detach(), mask)
    return FlowObjectiveOutput(
        per_action=_zero_masked(per_action, mask),
        clipped=clipped,
        ratio=ratio,
        stats=stats,
    )


# --------------------------------------------------------------------------- Flow-DPO


def best_worst_pairs(scores: Tensor, group: Tensor, valid: Tensor | None = None) -> Tensor:
    """Long[P, 2]: one (winner row, loser row) pair per group, as D3PO and Flow-Factory's online DPO choose them:
    among the group's rows that are `valid` (Bool[B], default all) and whose score is not NaN, the row with the
    highest `scores` (Float[B]: rewards, or advantages that keep their order within a group) against the row
    with the lowest (ties: the first such row). A group with fewer than two such rows, or whose scores are all
    equal, gives no pair. Pairs follow the groups' order of first appearance in `group` (Long[B])."""
    s = scores.detach().reshape(-1).to("cpu", torch.float64)
    g = group.detach().reshape(-1).to("cpu")
    if s.shape != g.shape:
        raise ValueError(
            f"best_worst_pairs: scores {tuple(scores.shape)} and group {tuple(group.shape)} must be [B]"
        )
    ok = ~torch.isnan(s)
    if valid is not None:
        v = valid.detach().reshape(-1).to("cpu", torch.bool)
        if v.shape != g.shape:
            raise ValueError(f"best_worst_pairs: valid {tuple(valid.shape)} must be Bool[{len(g)}]")
        ok &= v
    pairs: list[tuple[int, int]] = []
    for gid in dict.fromkeys(g.tolist()):
        rows = torch.nonzero((g == gid) & ok).flatten()
        if len(rows) < 2:
            continue
        vals = s[rows]
        hi, lo = int(torch.argmax(vals)), int(torch.argmin(vals))
        if vals[hi] > vals[lo]:
            pairs.append((int(rows[hi]), int(rows[lo])))
    return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)


def _check_pairs(pairs: Tensor, b: int) -> tuple[Tensor, Tensor]:
    """(winner, loser) Long[P] rows of `pairs` Long[P, 2], checked: in [0, b), winner != loser, each row in at
    most one pair."""
    if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"flow_dpo: pairs must be Long[P, 2] (winner row, loser row), got {tuple(pairs.shape)}"
        )
    flat = pairs.reshape(-1).tolist()
    if any(not 0 <= r < b for r in flat):
        raise ValueError(f"flow_dpo: pair rows must index the {b} samples, got {flat}")
    if len(set(flat)) != len(flat):
        raise ValueError(
            f"flow_dpo: a sample may be in at most one pair (and never paired with itself), got {flat}"
        )
    return pairs[:, 0].long(), pairs[:, 1].long()


@register(
    "flow_dpo",
    timesteps={"strategy": "logit_normal", "timestep_range": 0.99, "time_shift": 1.0, "num_timesteps": 1},
    inputs=("v_ref", "pairs"),
)
def flow_dpo(
    v: Tensor,
    v_old: Tensor,
    noise: Tensor,
    x0: Tensor,
    t: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    beta: float = 2000.0,
    v_ref: Tensor | None = None,
    pairs: Tensor | None = None,
) -> FlowObjectiveOutput:
    """Flow-DPO: Diffusion-DPO (Wallace et al. 2023, "Diffusion Model Alignment Using Direct Preference
    Optimization") on the flow-matching velocity, online on each group's best-vs-worst pair (D3PO's choice).

    For a pair (w, l) (input `pairs` Long[P, 2]) sharing t and eps at an action column, with target
    v* = eps - x0 and e(u) = mean over the latent dims of (u - v*)^2: logit = -beta/2 [(e_w(v) - e_w(v_ref))
    - (e_l(v) - e_l(v_ref))] and the pair's loss -log sigmoid(logit) (the authors' train.py and flow_grpo's /
    Flow-Factory's flow version: a latent *mean*, beta/2). Half of it is put on each member's action, so the
    per-action losses sum to the pairs' losses; unpaired samples carry 0. `v_ref` (input, required) is the
    reference's velocity (detached); `advantages` are unused (they chose the pairs). A pair's action is
    dropped where either member's is masked. Default beta 2000 (Flow-Factory's; the authors' SD1.5 script
    5000); ``v_old`` is unused (the objective is on-policy against a fixed reference)."""
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"flow_dpo: beta must be a finite number > 0, got {beta!r}")
    if v_ref is None:
        raise ValueError("flow_dpo: needs v_ref, the reference's velocity at the same x_t")
    if pairs is None:
        raise ValueError("flow_dpo: needs pairs Long[P, 2] (e.g. best_worst_pairs of the rewards and groups)")
    if v_ref.shape != v.shape:
        raise ValueError(f"flow_dpo: v_ref {tuple(v_ref.shape)} must match v {tuple(v.shape)}")
    v, _, noise, x0, _, mask, t = _prepare(v, v_old, noise, x0, t, advantages, mask)
    n = t.ndim
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    ref = torch.where(_broadcast(mask, v), v_ref.detach().to(v.device, v.dtype), zero)
    win, lose = (x.to(v.device) for x in _check_pairs(pairs, v.shape[0]))
    target = noise - x0
    err = _latent_mean((v - target) ** 2, n)
    ref_err = _latent_mean((ref - target) ** 2, n)
    pm = mask[win] & mask[lose]
    pmv = _broadcast(pm, v)
    if not (
        torch.equal(torch.where(pm, t[win], zero), torch.where(pm, t[lose], zero))
        and torch.equal(torch.where(pmv, noise[win], zero), torch.where(pmv, noise[lose], zero))
    ):
        raise ValueError("flow_dpo: the two samples of a pair must share t and the noise eps")
    logit = -0.5 * beta * ((err[win] - ref_err[win]) - (err[lose] - ref_err[lose]))
    pair_loss = torch.where(pm, -torch.nn.functional.logsigmoid(logit), torch.zeros_like(logit))

    def spread(x: Tensor, half: bool) -> Tensor:  # a per-pair value onto both members' rows
        x = x * 0.5 if half else x
        out = torch.zeros_like(err)
        return out.index_add(0, win, x).index_add(0, lose, x)

    # 0 * err keeps the graph (and a zero gradient) when no pair is left
    per_action = spread(pair_loss, True) + 0.0 * err
    with torch.no_grad():
        stats = {
            "paired": spread(pm.to(v.dtype), False),
            "logit": spread(torch.where(pm, logit.detach(), torch.zeros_like(logit)), False),
            "implicit_acc": spread((pm & (logit.detach() > 0)).to(v.dtype), False),
            "policy_err": err.detach(),
            "ref_err": ref_err,
        }
    return FlowObjectiveOutput(
        per_action=_zero_masked(per_action, mask),
        clipped=torch.zeros_like(mask),
        ratio=None,
        stats={k: _zero_masked(s, mask) for k, s in stats.items()},
    )


# --------------------------------------------------------------------------- timestep sampling


@dataclass
class TimestepDraw:
    """Training sigmas of a batch: ``t`` Float[B, K] in (0, 1], and ``index`` Long[B, K], the position of each
    sigma in the rollout's schedule (None for continuous strategies)."""

    t: Tensor
    index: Tensor | None


def _range(timestep_range: float | Sequence[float]) -> tuple[float, float]:
    """Flow-Factory's ``timestep_range``: a fraction along the denoising axis (0: sigma 1, 1: sigma 0); a
    scalar x means (0, x)."""
    lo, hi = (0.0, float(timestep_range)) if isinstance(timestep_range, (int, float)) else timestep_range
    lo, hi = float(lo), float(hi)
    if not 0 <= lo < hi <= 1:
        raise ValueError(f"timestep_range must satisfy 0 <= lo < hi <= 1, got {timestep_range!r}")
    return lo, hi


def num_train_timesteps(
    num_steps: int, *, timestep_range: float | Sequence[float] = 0.99, num_timesteps: int | None = None
) -> int:
    """K, the training sigmas per sample: `num_timesteps`, or max(1, int(num_steps * (hi - lo))) (DiffusionNFT:
    int(num_steps * timestep_fraction); Flow-Factory: the same over its ``timestep_range``)."""
    if num_timesteps is not None:
        if num_timesteps < 1:
            raise ValueError(f"num_train_timesteps must be >= 1, got {num_timesteps}")
        return int(num_timesteps)
    lo, hi = _range(timestep_range)
    return max(1, int(num_steps * (hi - lo)))


def _stratified_indices(k: int, start: int, end: int, generator: torch.Generator | None) -> Tensor:
    """Flow-Factory's stratified draw of k indices from [start, end]: k equal strata of linspace(start, end),
    one uniform integer in each (truncating towards the stratum's lower edge)."""
    bounds = torch.linspace(start, end, k + 1, dtype=torch.float32)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    u = torch.rand(k, generator=generator)
    return lower + (u * (upper - lower)).long()


def sample_timesteps(
    sigmas: Tensor,
    batch: int,
    *,
    strategy: str = "schedule_subset",
    timestep_range: float | Sequence[float] = 0.99,
    num_timesteps: int | None = None,
    candidates: Sequence[int] | None = None,
    time_shift: float = 3.0,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    generator: torch.Generator | None = None,
) -> TimestepDraw:
    """Draw K = `num_train_timesteps` training sigmas per sample (on the CPU, from `generator` or torch's
    global RNG). `sigmas` Float[n]: the sigmas the rollout's n steps start from (descending, 1 -> small).

    - ``schedule_subset`` (DiffusionNFT's script): per sample, a random permutation of the schedule's steps
      (of `candidates` when given), the first K kept -- K distinct steps each; `timestep_range` only sets K;
    - ``discrete`` / ``discrete_with_init`` / ``discrete_wo_init`` (Flow-Factory): K stratified schedule
      indices among those whose sigma lies in [1 - hi, 1 - lo], the same for the whole batch; ``wo_init``
      skips the first such index, ``with_init`` always takes it (its others from the rest);
    - ``uniform`` (Flow-Factory): K stratified fractions f in [lo, hi], warped f <- s f / (1 + (s - 1) f) by
      `time_shift` s (unless 1), sigma = 1 - f, the same for the whole batch;
    - ``logit_normal`` (Flow-Factory): K stratified standard-normal quantiles, sigmoid(mean + std z), warped by
      the shift, clamped to [0.01, 1 - 1e-6], mapped into [lo, hi], sigma = 1 - f, the same for the batch.
    """
    if strategy not in TIMESTEP_STRATEGIES:
        raise ValueError(
            f"timestep strategy must be one of {', '.join(TIMESTEP_STRATEGIES)}; got {strategy!r}"
        )
    sig = sigmas.detach().to("cpu", torch.float32).reshape(-1)
    n = sig.numel()
    lo, hi = _range(timestep_range)
    k = num_train_timesteps(n, timestep_range=(lo, hi), num_timesteps=num_timesteps)
    if strategy in ("uniform", "logit_normal"):
        if not time_shift > 0:
            raise ValueError(f"time_shift must be > 0, got {time_shift!r}")
        if strategy == "uniform":
            u = torch.rand(k, generator=generator)
            f = lo + (torch.arange(k) + u) / k * (hi - lo)
            f = f[torch.randperm(k, generator=generator)]
            if abs(time_shift - 1.0) > 1e-6:
                f = time_shift * f / (1 + (time_shift - 1) * f)
        else:
            u = torch.rand(k, generator=generator)
            base = ((torch.arange(k) + u) / k).clamp(1e-7, 1 - 1e-7)
            z = torch.distributions.Normal(0.0, 1.0).icdf(base)
            z = z[torch.randperm(k, generator=generator)]
            raw = torch.sigmoid(z * logit_std + logit_mean)
            raw = (time_shift * raw / (1 + (time_shift - 1) * raw)).clamp(0.01, 1.0 - 1e-6)
            f = lo + raw * (hi - lo)
        return TimestepDraw(t=(1.0 - f).expand(batch, k).clone(), index=None)
    allowed = sorted(set(range(n) if candidates is None else (int(c) for c in candidates)))
    if any(not 0 <= c < n for c in allowed):
        raise ValueError(f"candidates must index the {n} schedule steps, got {list(allowed)}")
    if strategy == "schedule_subset":  # the authors' script draws from every step; the range sets K only
        in_range = allowed
    else:
        in_range = [i for i in allowed if 1.0 - hi - 1e-6 <= float(sig[i]) <= 1.0 - lo + 1e-6]
    if not in_range:
        raise ValueError(
            f"no schedule step has its sigma in timestep_range {(lo, hi)} (sigmas {[round(float(s), 4) for s in sig]})"
        )
    if strategy == "schedule_subset":
        pool = torch.tensor(in_range)
        if k > len(in_range):
            raise ValueError(
                f"num_train_timesteps {k} exceeds the {len(in_range)} schedule steps it draws from without "
                "replacement (lower num_train_timesteps or widen timestep_range)"
            )
        rows = [pool[torch.randperm(len(in_range), generator=generator)[:k]] for _ in range(batch)]
        index = torch.stack(rows)
    else:
        first, last = in_range[0], in_range[-1]
        if strategy == "discrete_with_init":
            head = torch.tensor([first])
            rest = _stratified_indices(k - 1, first + 1, last, generator) if k > 1 else head[:0]
            idx = torch.cat([head, rest])
        else:
            start = first if strategy == "discrete" else first + 1
            idx = _stratified_indices(k, start, last, generator)
        index = idx.clamp(0, n - 1).expand(batch, k).clone()
    return TimestepDraw(t=sig[index], index=index)
