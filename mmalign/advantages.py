"""Group-relative advantage estimators (see docs/algorithms.md, "Advantage estimators").

Every estimator is a plain, vectorised tensor function registered by name::

    fn(rewards: Tensor, group: Tensor, **options) -> Tensor   # Float[B]

- ``rewards`` is Float[B] or Float[B, K] (K reward components). With K components the
  option ``weights`` (a sequence of K floats, default all 1) combines them:
  r_i = nansum_k w_k r_{i,k} (see :func:`combine_rewards`).
- ``group`` is Long[B]: arbitrary group ids (any integers, not necessarily contiguous,
  sorted or starting at 0). Samples sharing an id are the G samples of one prompt.

Conventions shared by all estimators:

- NaN means "not applicable". A sample whose reward components are ALL NaN has reward NaN
  (only the components with a non-zero weight count, unless every weight is 0: see
  :func:`combine_rewards`); such a sample is left out of its group's statistics and gets
  advantage 0. A combined reward of +-inf (a broken reward plugin) is treated the same way, so
  no estimator returns NaN or inf.
- A group with fewer than 2 valid samples gets advantage 0 for all its samples (its std is
  undefined).
- Computation is in float32, or float64 when ``rewards`` is float64. The result has that dtype
  and the device of ``rewards``.
- Options are keyword-only. An unknown option raises ``TypeError`` naming the estimator and the
  option; a bad value raises ``ValueError``.

Per-sample action counts: an estimator that takes the keyword ``num_actions`` (Long/Float[B], each
sample's number of valid actions: response tokens for text, trained denoising steps for diffusion)
gets it from the trainer (``num_actions = rollout.mask.sum(1)`` of the same, global, batch).
:func:`accepts_num_actions` tells which estimators take it (only ``reinforce_pp``, which uses it
with ``whiten_over="tokens"``); it is a per-batch input, not a config option, so :func:`options`
does not list it.

Step rewards: an estimator registered with ``step_rewards=True`` (:func:`accepts_step_rewards`;
only ``grpo_process``) also takes the keywords ``step_rewards`` (Float[B, T], the weighted process
rewards ``rollout.step_rewards`` written by ``rewards.RewardSet``) and ``step_mask`` (Bool[B, T],
``rollout.mask``), both of the same, global, batch, and returns Float[B, T]: one advantage per
action, 0 where ``step_mask`` is False. Like ``num_actions`` they are per-batch inputs, not config
options. Every other estimator returns Float[B] and rejects these keywords.

Registry metadata: ``extra_samples`` (how many samples per prompt the rollout must draw on top of
G, read with :func:`extra_samples`) and ``loss_sample_mask`` (a function with the estimator's
signature returning Bool[B], False for samples that must not enter the loss; read with
:func:`loss_sample_mask`). Only ``mc_grpo`` uses them. ``step_rewards`` (bool, read with
:func:`accepts_step_rewards`): the estimator takes ``step_rewards`` / ``step_mask``.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from mmalign.registry import Registry, option_checked

Estimator = Callable[..., Tensor]
Weights = Sequence[float] | Tensor | None

REGISTRY: Registry[Estimator] = Registry("advantage estimator")

# Keyword inputs an estimator may take that are per-batch data supplied by the trainer, not config options.
_BATCH_INPUTS = frozenset({"num_actions", "step_rewards", "step_mask"})

# reinforce_pp: what the batch whitening runs over
_WHITEN_OVER = ("samples", "tokens")

# |A| at or below this counts as zero when mc_grpo rescales the non-zero advantages of a group
# (the reference implementation uses torch.isclose(A, 0, atol=1e-6)).
_MC_ZERO_ATOL = 1e-6


# --------------------------------------------------------------------------- registry API


def register(name: str, **meta: Any) -> Callable[[Estimator], Estimator]:
    """Decorator registering ``fn(rewards, group, **options) -> Float[B]`` under ``name``.

    The registered (and returned) function rejects unknown options with a TypeError. With
    ``step_rewards=True`` the estimator takes the keywords ``step_rewards`` and ``step_mask`` and
    returns Float[B, T] (see the module docstring).
    """

    def deco(fn: Estimator) -> Estimator:
        checked = option_checked(REGISTRY.kind, name, fn, n_positional=2)

        @functools.wraps(checked)
        def in_float64(rewards: Tensor, group: Tensor, **options: Any) -> Tensor:
            # Group statistics are taken in float64: float32 sums of equal rewards can miss the
            # mean by ~1e-8, which eps = 1e-4 would blow up into spurious advantages of ~1e-4
            # for groups whose rewards are all equal.
            r = torch.as_tensor(rewards)
            out_dtype = torch.float64 if r.dtype == torch.float64 else torch.float32
            return checked(r.to(torch.float64), group, **options).to(out_dtype)

        return REGISTRY.register(name, **meta)(in_float64)

    return deco


def get(name: str) -> Estimator:
    """The estimator registered under ``name`` (``RegistryError``, a KeyError, if unknown)."""
    return REGISTRY.get(name)


def names() -> list[str]:
    """Sorted names of the registered estimators."""
    return REGISTRY.names()


def describe(name: str) -> str:
    """One-line summary of an estimator (first line of its docstring)."""
    return REGISTRY.describe(name)


def options(name: str) -> dict[str, Any]:
    """The options an estimator accepts, with their defaults (for config validation).

    Per-batch inputs the trainer supplies (``num_actions``, ``step_rewards``, ``step_mask``) are not
    config options and are not listed.
    """
    fn = inspect.unwrap(REGISTRY.get(name))
    params = list(inspect.signature(fn).parameters.values())[2:]
    return {
        p.name: p.default
        for p in params
        if p.kind is not inspect.Parameter.VAR_KEYWORD and p.name not in _BATCH_INPUTS
    }


def accepts_num_actions(name: str) -> bool:
    """True when the estimator registered under ``name`` takes the keyword ``num_actions``.

    The trainer passes ``num_actions`` (each sample's number of valid actions) only to these
    estimators, and with the same options to :func:`loss_sample_mask`.
    """
    return "num_actions" in _options_of(REGISTRY.get(name))


def accepts_step_rewards(name: str) -> bool:
    """True when the estimator registered under ``name`` takes ``step_rewards`` and ``step_mask``.

    Registry metadata ``step_rewards=True``. The trainer passes ``step_rewards`` (Float[B, T]) and
    ``step_mask`` (Bool[B, T]) of the global batch only to these estimators, and with the same
    options to :func:`loss_sample_mask`; their result is Float[B, T].
    """
    return bool(REGISTRY.meta(name).get("step_rewards", False))


def extra_samples(name: str) -> int:
    """How many samples per prompt the rollout must draw on top of G (0 unless the estimator says so)."""
    return int(REGISTRY.meta(name).get("extra_samples", 0))


def loss_sample_mask(name: str, rewards: Tensor, group: Tensor, **options: Any) -> Tensor:
    """Bool[B]: which samples take part in the loss (all True unless the estimator drops some).

    ``options`` are the estimator's options; unknown ones raise TypeError as for the estimator.
    """
    fn = REGISTRY.get(name)
    mask_fn = REGISTRY.meta(name).get("loss_sample_mask")
    if mask_fn is None:
        allowed = _options_of(fn)
        bad = sorted(set(options) - set(allowed))
        if bad:
            raise TypeError(
                f"{REGISTRY.kind} {name!r} got unknown option(s) {', '.join(map(repr, bad))}; "
                f"valid options: {', '.join(sorted(allowed)) or 'none'}"
            )
        r = torch.as_tensor(rewards)
        return torch.ones(r.shape[0], dtype=torch.bool, device=r.device)
    return option_checked(REGISTRY.kind, name, mask_fn, n_positional=2)(rewards, group, **options)


def _options_of(fn: Callable[..., Any]) -> list[str]:
    params = list(inspect.signature(inspect.unwrap(fn)).parameters.values())[2:]
    return [p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]


# --------------------------------------------------------------------------- public helpers


def clip_advantages(adv: Tensor, limit: float | None) -> Tensor:
    """Clamp advantages (Float[B] or Float[B, T]) to [-limit, limit]; ``None`` returns ``adv`` unchanged."""
    if limit is None:
        return adv
    if not limit > 0:
        raise ValueError(f"advantage clip limit must be > 0 or None, got {limit!r}")
    return adv.clamp(-float(limit), float(limit))


def combine_rewards(rewards: Tensor, weights: Weights = None) -> Tensor:
    """Float[B] total reward: r_i = nansum_k w_k r_{i,k}; NaN where every weighted component is NaN.

    ``rewards`` is Float[B] (returned as float, weighted by ``weights[0]`` if given) or
    Float[B, K]; ``weights`` has K entries (default all 1). Computed in float32 (float64 for
    float64 input).

    r_i is NaN ("not applicable") when every component k with w_k != 0 is NaN for sample i: a
    component of weight 0 (e.g. the column of a per-step reward, whose outcome weight is 0 in
    ``RewardSet.weights``) neither adds to the total nor makes a sample applicable. When every
    weight is 0, r_i is 0 where some component is not NaN and NaN where all are.
    """
    r = _as_float(rewards)
    if r.dim() == 1:
        r2 = r[:, None]
    elif r.dim() == 2:
        r2 = r
    else:
        raise ValueError(f"rewards must be Float[B] or Float[B, K], got shape {tuple(r.shape)}")
    w = _weights(weights, r2.shape[1], r2)
    nan = torch.isnan(r2)
    total = torch.where(nan, torch.zeros_like(r2), r2 * w).sum(dim=1)
    weighted = w != 0
    absent = (nan | ~weighted).all(dim=1) if bool(weighted.any()) else nan.all(dim=1)
    return torch.where(absent, torch.full_like(total, float("nan")), total)


# --------------------------------------------------------------------------- internals


def _as_float(x: Tensor) -> Tensor:
    x = torch.as_tensor(x)
    return x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)


def _weights(weights: Weights, k: int, like: Tensor) -> Tensor:
    if weights is None:
        return torch.ones(k, dtype=like.dtype, device=like.device)
    w = torch.as_tensor(weights, dtype=like.dtype, device=like.device).reshape(-1)
    if w.numel() != k:
        raise ValueError(f"weights has {w.numel()} entries but rewards have {k} component(s)")
    if not torch.isfinite(w).all():
        raise ValueError("weights must be finite")
    return w


def _group_index(group: Tensor, batch: int, device: torch.device) -> tuple[Tensor, int]:
    """Map arbitrary group ids to 0..G-1 (ordered by id); returns (gid Long[B], G)."""
    g = torch.as_tensor(group, device=device)
    if g.dim() != 1 or g.shape[0] != batch:
        raise ValueError(f"group must be Long[B] with B={batch}, got shape {tuple(g.shape)}")
    if g.dtype.is_floating_point or g.dtype.is_complex or g.dtype == torch.bool:
        raise TypeError(f"group ids must be an integer tensor, got {g.dtype}")
    uniq, gid = torch.unique(g, return_inverse=True)
    return gid, int(uniq.numel())


def _prepare(rewards: Tensor, group: Tensor, weights: Weights) -> tuple[Tensor, Tensor, Tensor, int]:
    """Combined reward r Float[B], valid Bool[B], gid Long[B], number of groups G."""
    r = combine_rewards(rewards, weights)
    gid, n_groups = _group_index(group, r.shape[0], r.device)
    return r, torch.isfinite(r), gid, n_groups


def _seg_sum(x: Tensor, gid: Tensor, n_groups: int) -> Tensor:
    """Per-group sums of x (Float[B] or Float[B, K]) -> Float[G] or Float[G, K]."""
    out = torch.zeros((n_groups, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out.index_add_(0, gid, x)


def _group_stats(r: Tensor, valid: Tensor, gid: Tensor, n_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per group over valid samples: count n, mean, unbiased std (0 where n < 2). Works for [B] or [B, K]."""
    zero = torch.zeros_like(r)
    n = _seg_sum(valid.to(r.dtype), gid, n_groups)
    mean = _seg_sum(torch.where(valid, r, zero), gid, n_groups) / n.clamp(min=1)
    # a group whose valid rewards are all equal gets its mean exactly (no rounding residue)
    idx = gid.view(-1, *([1] * (r.dim() - 1))).expand_as(r)
    shape = (n_groups, *r.shape[1:])
    gmax = torch.full(shape, float("-inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, idx, torch.where(valid, r, torch.full_like(r, float("-inf"))), reduce="amax"
    )
    gmin = torch.full(shape, float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, idx, torch.where(valid, r, torch.full_like(r, float("inf"))), reduce="amin"
    )
    mean = torch.where((gmax == gmin) & (n > 0), gmax, mean)
    dev = torch.where(valid, r - mean[gid], zero)
    var = _seg_sum(dev * dev, gid, n_groups) / (n - 1).clamp(min=1)
    return n, mean, var.sqrt()


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """num / den where den > 0, else 0 (never NaN/inf from a zero denominator)."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def _whiten(x: Tensor, sel: Tensor, eps: float, count: Tensor | None = None) -> Tensor:
    """(x - mean) / (std + eps) over the selected entries (unbiased std); 0 elsewhere or if < 2 selected.

    With ``count`` (Float[B], >= 0) entry i counts ``count_i`` times, as if repeated once per action:
    N = sum_sel count_i, mean = sum_sel count_i x_i / N, var = sum_sel count_i (x_i - mean)^2 / (N - 1);
    entries with count 0 get 0, and everything is 0 when N < 2.
    """
    zero = torch.zeros_like(x)
    if count is None:
        cnt = sel.sum().to(x.dtype)
        mu = torch.where(sel, x, zero).sum() / cnt.clamp(min=1)
        dev = torch.where(sel, x - mu, zero)
        sd = ((dev * dev).sum() / (cnt - 1).clamp(min=1)).sqrt()
    else:
        w = torch.where(sel, count, zero)
        sel = sel & (w > 0)
        cnt = w.sum()
        mu = (w * x).sum() / cnt.clamp(min=1)
        dev = torch.where(sel, x - mu, zero)
        sd = ((w * dev * dev).sum() / (cnt - 1).clamp(min=1)).sqrt()
    out = _safe_div(x - mu, (sd + eps).expand_as(x))
    return torch.where(sel & (cnt >= 2), out, zero)


def _group_lower_median(x: Tensor, sel: Tensor, gid: Tensor, n_groups: int) -> tuple[Tensor, Tensor]:
    """Per-group lower median of the selected entries: the ((n-1)//2)-th order statistic.

    Returns (median Float[G] (0 for groups with no selected entry), n Long[G]). Vectorised: one
    stable sort by value, then a stable sort by group, so each group is a contiguous sorted run.
    """
    key = torch.where(sel, x, torch.full_like(x, float("inf")))  # unselected sort last in their group
    by_value = torch.argsort(key, stable=True)
    order = by_value[torch.argsort(gid[by_value], stable=True)]
    size = torch.bincount(gid, minlength=n_groups)
    start = torch.cumsum(size, 0) - size
    n = _seg_sum(sel.long(), gid, n_groups)
    pos = start + (n - 1).clamp(min=0) // 2
    med = key[order][pos]
    return torch.where(n > 0, med, torch.zeros_like(med)), n


def _num_actions(name: str, num_actions: Tensor | Sequence[float], like: Tensor) -> Tensor:
    """Validated per-sample action counts as Float[B] in ``like``'s dtype and device."""
    n = torch.as_tensor(num_actions, device=like.device)
    if n.dtype == torch.bool or n.dtype.is_complex:
        raise ValueError(f"{name}: num_actions must be a Long or Float tensor of counts, got {n.dtype}")
    if n.dim() != 1 or n.shape[0] != like.shape[0]:
        raise ValueError(
            f"{name}: num_actions must be Long/Float[B] with B={like.shape[0]} (one count per sample), "
            f"got shape {tuple(n.shape)}"
        )
    n = n.to(like.dtype)
    if not torch.isfinite(n).all():
        raise ValueError(f"{name}: num_actions must be finite")
    if (n < 0).any():
        raise ValueError(
            f"{name}: num_actions must be >= 0 (counts of valid actions), got {n.min().item()!r}"
        )
    return n


def _check_eps(name: str, eps: float) -> float:
    if not eps >= 0:
        raise ValueError(f"{name}: eps must be >= 0, got {eps!r}")
    return float(eps)


# --------------------------------------------------------------------------- estimators


@register("grpo")
def grpo(
    rewards: Tensor, group: Tensor, *, weights: Weights = None, std: str = "group", eps: float = 1e-4
) -> Tensor:
    """GRPO: A_i = (r_i - mean_g r) / (std + eps), std per group (unbiased), over the batch, or none.

    ``std="group"`` (default): unbiased std of the group; ``"batch"``: unbiased std of all valid
    rewards in the batch (the mean stays per group); ``"none"``: no division.
    """
    if std not in ("group", "batch", "none"):
        raise ValueError(f"grpo: std must be 'group', 'batch' or 'none', got {std!r}")
    eps = _check_eps("grpo", eps)
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    n, mean, sd = _group_stats(r, valid, gid, n_groups)
    eligible = valid & (n[gid] >= 2)
    centered = torch.where(eligible, r - mean[gid], torch.zeros_like(r))
    if std == "group":
        adv = _safe_div(centered, sd[gid] + eps)
    elif std == "batch":
        _, _, batch_sd = _group_stats(r, valid, torch.zeros_like(gid), 1)
        adv = _safe_div(centered, (batch_sd + eps).expand_as(r))
    else:
        adv = centered
    return torch.where(eligible, adv, torch.zeros_like(adv))


@register("dr_grpo")
def dr_grpo(rewards: Tensor, group: Tensor, *, weights: Weights = None) -> Tensor:
    """Dr. GRPO: A_i = r_i - mean_g r, no std division (pair with aggregation ``seq_sum_norm``)."""
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    n, mean, _ = _group_stats(r, valid, gid, n_groups)
    eligible = valid & (n[gid] >= 2)
    return torch.where(eligible, r - mean[gid], torch.zeros_like(r))


@register("rloo")
def rloo(rewards: Tensor, group: Tensor, *, weights: Weights = None) -> Tensor:
    """RLOO: A_i = r_i - mean of the other valid samples of the group, (1/(n-1)) sum_{j!=i} r_j."""
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    n, mean, _ = _group_stats(r, valid, gid, n_groups)
    ng = n[gid]
    eligible = valid & (ng >= 2)
    # r_i - (S - r_i)/(n-1) = n/(n-1) * (r_i - mean)
    adv = ng / (ng - 1).clamp(min=1) * (r - mean[gid])
    return torch.where(eligible, adv, torch.zeros_like(r))


@register("reinforce_pp")
def reinforce_pp(
    rewards: Tensor,
    group: Tensor,
    *,
    weights: Weights = None,
    eps: float = 1e-4,
    whiten_over: str = "samples",
    num_actions: Tensor | None = None,
) -> Tensor:
    """REINFORCE++ (baseline): whiten over the batch the group-centred rewards r_i - mean_g r.

    x_i = r_i - mean_g r for the eligible samples E: valid reward and >= 2 valid samples in the group
    (mean_g over the group's valid samples). Every other sample gets 0. Then, over E:

    - ``whiten_over="samples"`` (default): each sample counts once. With M = |E|,
      mu = sum_E x_i / M, var = sum_E (x_i - mu)^2 / (M - 1), A_i = (x_i - mu) / (sqrt(var) + eps);
      all 0 when M < 2.
    - ``whiten_over="tokens"`` (verl's REINFORCE++-baseline): each sample counts once per valid
      action, so longer answers weigh more in the mean and the variance. Needs ``num_actions``
      (Long/Float[B], n_i >= 0; the trainer passes it). With N = sum_E n_i,
      mu = sum_E n_i x_i / N, var = sum_E n_i (x_i - mu)^2 / (N - 1) (Bessel over the action
      count), A_i = (x_i - mu) / (sqrt(var) + eps); samples with n_i = 0 get 0 (they still enter
      their group's mean), and all are 0 when N < 2. The result is still Float[B]: A_i is the
      constant advantage of every action of sample i, as in verl's per-token tensor.

    Differences from verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage``: the
    division is by sqrt(var) + eps (the convention of every estimator here) instead of
    rsqrt(var + 1e-8), and singleton / NaN-reward samples get 0 and stay out of the statistics
    (verl keeps a singleton group's raw score and counts its tokens). With all n_i = n the two modes
    differ only in the Bessel factor: for eps = 0, A_tokens = A_samples * sqrt((n M - 1) / (n (M - 1))).

    ``num_actions`` is validated (shape [B], finite, >= 0) whenever given, and ignored by
    ``whiten_over="samples"``.
    """
    eps = _check_eps("reinforce_pp", eps)
    if whiten_over not in _WHITEN_OVER:
        raise ValueError(
            f"reinforce_pp: whiten_over must be {' or '.join(map(repr, _WHITEN_OVER))}, got {whiten_over!r}"
        )
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    count = None if num_actions is None else _num_actions("reinforce_pp", num_actions, r)
    if whiten_over == "tokens" and count is None:
        raise ValueError(
            "reinforce_pp with whiten_over='tokens' needs num_actions (each sample's number of valid "
            "actions); the trainer passes it"
        )
    n, mean, _ = _group_stats(r, valid, gid, n_groups)
    eligible = valid & (n[gid] >= 2)
    x = torch.where(eligible, r - mean[gid], torch.zeros_like(r))
    return _whiten(x, eligible, eps, count if whiten_over == "tokens" else None)


@register("gdpo")
def gdpo(rewards: Tensor, group: Tensor, *, weights: Weights = None, eps: float = 1e-4) -> Tensor:
    """GDPO: normalise each reward component within its group, weighted-sum them, then whiten over the batch.

    A_hat_{i,k} = (r_{i,k} - mean_g r_{.,k}) / (std_g r_{.,k} + eps) over the samples whose component
    k is not NaN (a NaN component contributes 0 to its sample's sum; a component with < 2 valid
    values in a group contributes 0); A_pre_i = sum_k w_k A_hat_{i,k}; A = (A_pre - mean) /
    (std + eps) over the batch's valid samples in groups with >= 2 valid samples (unbiased stds).
    """
    eps = _check_eps("gdpo", eps)
    r2 = _as_float(rewards)
    if r2.dim() == 1:
        r2 = r2[:, None]
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    w = _weights(weights, r2.shape[1], r2)
    comp_valid = torch.isfinite(r2) & valid[:, None]
    n_k, mean_k, sd_k = _group_stats(r2, comp_valid, gid, n_groups)
    comp_ok = comp_valid & (n_k[gid] >= 2)
    centered = torch.where(comp_ok, r2 - mean_k[gid], torch.zeros_like(r2))
    a_hat = torch.where(comp_ok, _safe_div(centered, sd_k[gid] + eps), torch.zeros_like(r2))
    a_pre = (a_hat * w).sum(dim=1)
    n, _, _ = _group_stats(r, valid, gid, n_groups)
    eligible = valid & (n[gid] >= 2)
    return _whiten(a_pre, eligible, eps)


def _mc_grpo_core(rewards: Tensor, group: Tensor, weights: Weights, mad_eps: float) -> tuple[Tensor, Tensor]:
    """Shared by mc_grpo and its loss mask: (advantages Float[B], keep Bool[B])."""
    if not mad_eps > 0:
        raise ValueError(f"mc_grpo: mad_eps must be > 0, got {mad_eps!r}")
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    batch = r.shape[0]
    zero = torch.zeros_like(r)
    med, n = _group_lower_median(r, valid, gid, n_groups)
    dev = torch.where(valid, (r - med[gid]).abs(), zero)
    mad, _ = _group_lower_median(dev, valid, gid, n_groups)
    mad = mad + mad_eps
    ng = n[gid]
    eligible = valid & (ng >= 2)
    adv = torch.where(eligible, (r - med[gid]) / mad[gid], zero)
    # rescale the non-zero advantages of each group by (#valid samples) / (#non-zero advantages)
    nonzero = adv.abs() > _MC_ZERO_ATOL
    nnz = _seg_sum(nonzero.long(), gid, n_groups)
    scale = n.to(r.dtype) / nnz.clamp(min=1).to(r.dtype)
    adv = torch.where(nonzero, adv * scale[gid], adv)
    # pivot: lowest-index valid sample whose reward equals the median; for a group without valid
    # samples, its lowest-index sample (so that every group drops exactly one sample)
    idx = torch.arange(batch, device=r.device)
    sentinel = torch.full((n_groups,), batch, dtype=torch.long, device=r.device)
    at_median = valid & (r == med[gid])
    pivot = sentinel.scatter_reduce(0, gid, torch.where(at_median, idx, batch), "amin")
    first = sentinel.scatter_reduce(0, gid, idx, "amin")
    pivot = torch.where(pivot == batch, first, pivot)
    keep = torch.ones(batch, dtype=torch.bool, device=r.device)
    keep[pivot] = False
    return adv, keep


def _mc_grpo_loss_mask(
    rewards: Tensor, group: Tensor, *, weights: Weights = None, mad_eps: float = 1e-3
) -> Tensor:
    """Bool[B]: False for the one pivot (median) sample of each group, True elsewhere."""
    return _mc_grpo_core(rewards, group, weights, mad_eps)[1]


@register("mc_grpo", extra_samples=1, loss_sample_mask=_mc_grpo_loss_mask)
def mc_grpo(rewards: Tensor, group: Tensor, *, weights: Weights = None, mad_eps: float = 1e-3) -> Tensor:
    """MC-GRPO: median-centred, MAD-scaled advantages on G+1 samples; the median (pivot) sample is dropped.

    Per group, over its n valid samples (normally n = G+1, odd):
    m = median r; MAD = median |r - m| + mad_eps (1e-3); A_i = (r_i - m) / MAD; then every
    non-zero advantage (|A| > 1e-6) is multiplied by n / #non-zero, i.e. (G+1)/#non-zero for a
    full group. The pivot, exactly one sample per group, is excluded from the loss via the
    registry metadata ``loss_sample_mask`` (see :func:`loss_sample_mask`); the rollout draws
    ``extra_samples=1`` sample per prompt on top of G.

    Details (as in the authors' code, lotusroot-kim/MC-GRPO, which uses ``torch.median``):

    - "median" is the LOWER median, the ((n-1)//2)-th smallest value. For odd n it is the usual
      median; for even n it is the smaller of the two middle values (not their average), so the
      median is always an actual sample's reward and the pivot has advantage exactly 0. The MAD
      uses the lower median too.
    - The rescale counts the pivot among the n samples (n / #non-zero, computed before the pivot
      is dropped), as the reference code does. Samples tied with the median also have A = 0 and
      stay in the loss with zero advantage.
    - The pivot is the lowest-index sample whose reward equals the median. A group with no valid
      sample drops its lowest-index sample; all its advantages are 0.
    - NaN-reward samples and groups with < 2 valid samples get 0 (the shared convention).
    - With binary rewards the MAD is usually 0, so MAD = mad_eps and |A| is ~1/mad_eps (1000) times
      the rescale: faithful to the reference (Adam is nearly invariant to that global scale), but
      consider ``adv_clip`` or a larger ``mad_eps`` with other optimizers.
    """
    return _mc_grpo_core(rewards, group, weights, mad_eps)[0]


@register("ngrpo")
def ngrpo(
    rewards: Tensor,
    group: Tensor,
    *,
    weights: Weights = None,
    k: int = 1,
    r_max: float = 1.0,
    eps: float = 1e-6,
) -> Tensor:
    """NGRPO: GRPO statistics over the group plus k virtual samples of reward r_max (all-wrong groups < 0).

    mu' and sigma' are the mean and unbiased std of the n valid rewards together with k copies of
    ``r_max`` (as ``torch.std`` in the authors' code); A_i = (r_i - mu') / (sigma' + eps), eps = 1e-6.
    Pair with asymmetric clipping (eps_low 0.16, eps_high 0.24). Groups with < 2 real valid
    samples still get 0, like every estimator here.
    """
    if isinstance(k, bool) or int(k) != k or k < 0:
        raise ValueError(f"ngrpo: k must be an integer >= 0, got {k!r}")
    eps = _check_eps("ngrpo", eps)
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    zero = torch.zeros_like(r)
    n = _seg_sum(valid.to(r.dtype), gid, n_groups)
    total = _seg_sum(torch.where(valid, r, zero), gid, n_groups)
    n_aug = n + k
    mean = (total + k * r_max) / n_aug.clamp(min=1)
    dev = torch.where(valid, r - mean[gid], zero)
    ss = _seg_sum(dev * dev, gid, n_groups) + k * (r_max - mean) ** 2
    sd = (ss / (n_aug - 1).clamp(min=1)).sqrt()
    eligible = valid & (n[gid] >= 2)
    adv = _safe_div(r - mean[gid], sd[gid] + eps)
    return torch.where(eligible, adv, zero)


@register("pass_at_k")
def pass_at_k(
    rewards: Tensor, group: Tensor, *, weights: Weights = None, normalize: bool = False, eps: float = 1e-4
) -> Tensor:
    """Pass@k: only the group's best sample gets (its reward - the second-best reward); all others get 0.

    If the two best rewards of a group are equal (a tie for first) every sample of the group gets
    0. ``normalize=True`` divides by the group's unbiased std + eps.
    """
    eps = _check_eps("pass_at_k", eps)
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    zero = torch.zeros_like(r)
    neg_inf = torch.full_like(r, float("-inf"))
    init = torch.full((n_groups,), float("-inf"), dtype=r.dtype, device=r.device)
    top = init.scatter_reduce(0, gid, torch.where(valid, r, neg_inf), "amax")
    at_top = valid & (r == top[gid])
    n_top = _seg_sum(at_top.long(), gid, n_groups)
    second = init.scatter_reduce(0, gid, torch.where(valid & ~at_top, r, neg_inf), "amax")
    n, _, sd = _group_stats(r, valid, gid, n_groups)
    best = at_top & (n_top[gid] == 1) & (n[gid] >= 2)
    gap = torch.where(best, top[gid] - torch.where(best, second[gid], zero), zero)
    if normalize:
        gap = _safe_div(gap, sd[gid] + eps)
    return torch.where(best, gap, zero)


@register("a_grae")
def a_grae(
    rewards: Tensor,
    group: Tensor,
    *,
    weights: Weights = None,
    progress: float = 0.0,
    beta_pos_start: float = 0.6,
    beta_pos_end: float = 0.9,
    difficulty_strength: float = 0.5,
    eps: float = 1e-4,
) -> Tensor:
    """A-GRAE (our design from the paper's description): GRPO, damped positives, easy->hard group weights.

    Our design from the description in "Unveiling Implicit Advantage Symmetry" (A-GRAE); the paper's
    exact schedule is not reproduced. With p = ``progress`` in [0, 1] (fraction of training done):

    1. A = grpo advantages (group std, ``eps``).
    2. Asymmetric suppression: positive advantages are multiplied by
       beta_pos(p) = beta_pos_start + (beta_pos_end - beta_pos_start) * p (each in (0, 1]).
    3. Difficulty weight per group: e_g = the group's mean valid reward, min-max normalised over the
       groups of the batch that have >= 2 valid samples (e_g = 0.5 when they all have the same mean);
       e_g = 1 is the easiest group. w_g = 1 + s * (1 - 2p) * (2 e_g - 1), s = ``difficulty_strength``
       in [0, 1]: at p = 0 easy groups weigh 1 + s and hard ones 1 - s, at p = 0.5 all weigh 1,
       at p = 1 hard groups weigh 1 + s and easy ones 1 - s.

    A_i = w_g * (beta_pos(p) if A_i > 0 else 1) * A_i.
    """
    if not 0.0 <= progress <= 1.0:
        raise ValueError(f"a_grae: progress must be in [0, 1], got {progress!r}")
    for label, beta in (("beta_pos_start", beta_pos_start), ("beta_pos_end", beta_pos_end)):
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"a_grae: {label} must be in (0, 1], got {beta!r}")
    if not 0.0 <= difficulty_strength <= 1.0:
        raise ValueError(f"a_grae: difficulty_strength must be in [0, 1], got {difficulty_strength!r}")
    base = grpo(rewards, group, weights=weights, std="group", eps=eps)
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    n, mean, _ = _group_stats(r, valid, gid, n_groups)
    ok = n >= 2
    inf = torch.full_like(mean, float("inf"))
    sentinel = mean.new_full((1,), float("inf"))  # keeps min/max defined for an empty batch
    lo = torch.cat([torch.where(ok, mean, inf), sentinel]).min()
    hi = torch.cat([torch.where(ok, mean, -inf), -sentinel]).max()
    span = hi - lo
    has_span = ok.any() & (span > 0)
    easiness = torch.where(has_span, (mean - lo) / torch.where(has_span, span, torch.ones_like(span)), 0.5)
    easiness = torch.where(ok, easiness, torch.full_like(easiness, 0.5))
    weight = 1.0 + difficulty_strength * (1.0 - 2.0 * progress) * (2.0 * easiness - 1.0)
    beta_pos = beta_pos_start + (beta_pos_end - beta_pos_start) * progress
    adv = torch.where(base > 0, base * beta_pos, base) * weight[gid]
    return torch.where(valid & (n[gid] >= 2), adv, torch.zeros_like(adv))


def _step_inputs(
    name: str, step_rewards: Tensor | None, step_mask: Tensor | None, like: Tensor
) -> tuple[Tensor, Tensor]:
    """Validated (step rewards Float[B, T] in ``like``'s dtype and device, step mask Bool[B, T])."""
    if step_rewards is None:
        raise ValueError(f"{name} needs step rewards: no reward in the config declares per_step")
    batch = like.shape[0]
    s = torch.as_tensor(step_rewards, device=like.device)
    if s.dtype == torch.bool or s.dtype.is_complex:
        raise ValueError(f"{name}: step_rewards must be a real Float[B, T] tensor, got {s.dtype}")
    if s.dim() != 2 or s.shape[0] != batch:
        raise ValueError(
            f"{name}: step_rewards must be Float[B, T] with B={batch} (one row per sample), "
            f"got shape {tuple(s.shape)}"
        )
    if step_mask is None:
        raise ValueError(
            f"{name} needs step_mask (Bool[B, T], rollout.mask: the valid actions) with step_rewards"
        )
    m = torch.as_tensor(step_mask, device=like.device)
    if m.dtype.is_floating_point or m.dtype.is_complex:
        raise ValueError(f"{name}: step_mask must be a Bool[B, T] tensor, got {m.dtype}")
    if m.shape != s.shape:
        raise ValueError(
            f"{name}: step_mask {tuple(m.shape)} and step_rewards {tuple(s.shape)} differ in shape"
        )
    return s.to(like.dtype), m.bool()


@register("grpo_process", step_rewards=True)
def grpo_process(
    rewards: Tensor,
    group: Tensor,
    *,
    step_rewards: Tensor | None = None,
    step_mask: Tensor | None = None,
    weights: Weights = None,
    std: str = "group",
    eps: float = 1e-4,
    process_coef: float = 1.0,
) -> Tensor:
    """Dual-reward GRPO: outcome GRPO advantage + process_coef * step reward z-scored per (group, step).

    Returns Float[B, T], one advantage per action. With s = ``step_rewards`` (Float[B, T], the
    weighted process rewards), M = ``step_mask`` (Bool[B, T]) and c = ``process_coef`` (1.0):

        A_{i,t} = A^out_i + c * A^proc_{i,t}    where M_{i,t}, and 0 where M_{i,t} is False

    - A^out_i is exactly ``grpo`` on the outcome rewards (``weights``, ``std``, ``eps`` as there:
      (r_i - mean_g r) / (unbiased std_g + eps) by default), the same for every action of sample i;
      0 for a NaN outcome reward or a group with < 2 valid outcome rewards.
    - A^proc_{i,t} = (s_{i,t} - mean_{g,t}) / (sd_{g,t} + eps): mean_{g,t} and sd_{g,t} are the mean
      and unbiased std of s_{j,t} over the samples j of i's group g that are valid at step t
      (M_{j,t} True and s_{j,t} finite). A^proc is 0 where s_{i,t} is not valid, and for a
      (group, step) cell with fewer than 2 valid samples or zero std.

    Source of the idea: the Dual-Reward GRPO of Euphonium (Zhong et al., "Euphonium: Steering Video
    Flow Matching via Process Reward Gradient Guided Stochastic Dynamics", arXiv:2602.04928): an
    outcome advantage normalised per group plus a process advantage normalised per group and
    denoising step. (our design): the unbiased std and the eps (those of ``grpo``; ``std`` applies
    to the outcome part only), the coefficient c, and the handling of masked / non-finite cells and
    small cells. Step t is the column index of the action tensors: for text the token position; for
    diffusion the t-th trained step of each sample, which is the same denoising timestep for every
    sample only when all samples train the same steps (``window_size`` windows or all steps, not
    ``train_fraction`` < 1).

    Raises ValueError without ``step_rewards`` (no reward in the config declares ``per_step``) or
    without ``step_mask``.
    """
    eps = _check_eps("grpo_process", eps)
    if not math.isfinite(process_coef) or process_coef < 0:
        raise ValueError(f"grpo_process: process_coef must be a finite number >= 0, got {process_coef!r}")
    r = _as_float(rewards)
    s, m = _step_inputs("grpo_process", step_rewards, step_mask, r)
    outcome = grpo(r, group, weights=weights, std=std, eps=eps).to(s.dtype)
    gid, n_groups = _group_index(group, r.shape[0], r.device)
    valid = m & torch.isfinite(s)
    zero = torch.zeros_like(s)
    s0 = torch.where(valid, s, zero)
    n, mean, sd = _group_stats(s0, valid, gid, n_groups)  # per (group, step): Float[G, T]
    ok = valid & (n[gid] >= 2)
    proc = torch.where(ok, _safe_div(s0 - mean[gid], sd[gid] + eps), zero)
    adv = outcome[:, None] + float(process_coef) * proc
    return torch.where(m, adv, zero)
