"""Reward transforms: functions of a batch's rewards applied before the advantage estimator (docs/algorithms.md).

`apply` runs a list of transform specs; registered: ``noisy_verifier``, ``unlikeliness``, ``set_diversity``,
``self_aligned`` (``names()``).

The contract: docs/algorithms.md, "mmalign.algorithms.reward_transforms"; the formulas: "Reward transforms".
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from mmalign.algorithms.advantages import (
    CONTEXT_FIELDS,
    ContextError,
    EstimatorContext,
    check_context_fields,
    group_index,
    require_field,
)
from mmalign.registry import Registry, option_checked

__all__ = [
    "TRANSFORMS",
    "apply",
    "check_specs",
    "context_fields",
    "describe",
    "get",
    "names",
    "options",
    "register",
    "required_context_fields",
]

Transform = Callable[..., Tensor]
TRANSFORMS: Registry[Transform] = Registry("reward transform")


def register(
    name: str, *, context: Sequence[str] = (), context_optional: Sequence[str] = (), columnwise: bool = True
) -> Callable[[Transform], Transform]:
    """Decorator registering ``fn(rewards Float[B], group Long[B], **options) -> Float[B]`` as ``name``.

    ``context`` / ``context_optional``: the context fields needed / read when present (as for
    estimators). ``columnwise=False``: the transform is meant for one reward column, so `apply` needs
    ``column`` when the rewards have several.
    """
    needed, optional = tuple(context), tuple(context_optional)
    for f in needed + optional:
        if f not in CONTEXT_FIELDS:
            raise ValueError(f"reward transform {name!r} declares an unknown context field {f!r}")

    def deco(fn: Transform) -> Transform:
        checked = option_checked(TRANSFORMS.kind, name, fn, n_positional=2)
        takes = "context" in inspect.signature(fn).parameters

        @functools.wraps(checked)
        def wrapper(rewards: Tensor, group: Tensor, **opts: Any) -> Tensor:
            r = torch.as_tensor(rewards)
            if r.dim() != 1:
                raise ValueError(f"reward transform {name!r}: rewards must be Float[B], got {tuple(r.shape)}")
            group_index(group, r.shape[0], r.device)
            if takes:
                check_context_fields(name, opts.get("context"), needed, r.shape[0])
            out_dtype = r.dtype if r.is_floating_point() else torch.float32
            return checked(r.to(torch.float64), group, **opts).to(out_dtype)

        return TRANSFORMS.register(name, context=needed, context_optional=optional, columnwise=columnwise)(
            wrapper
        )

    return deco


def get(name: str) -> Transform:
    """The transform registered as ``name`` (``RegistryError``, a KeyError, if unknown)."""
    return TRANSFORMS.get(name)


def names() -> list[str]:
    """The names of the registered reward transforms, sorted."""
    return TRANSFORMS.names()


def describe(name: str) -> str:
    """One-line summary of a transform."""
    return TRANSFORMS.describe(name)


def options(name: str) -> dict[str, Any]:
    """The options a transform accepts, with their defaults (``context`` is a per-batch input, not listed)."""
    params = list(inspect.signature(inspect.unwrap(get(name))).parameters.values())[2:]
    return {p.name: p.default for p in params if p.name != "context"}


def context_fields(name: str) -> tuple[str, ...]:
    """Every context field the transform reads: the needed ones, then the optional ones."""
    meta = TRANSFORMS.meta(name)
    return tuple(meta["context"]) + tuple(meta["context_optional"])


def required_context_fields(name: str) -> tuple[str, ...]:
    """The context fields without which the transform raises ContextError."""
    return tuple(TRANSFORMS.meta(name)["context"])


def _column(spec_column: Any, k: int, reward_names: Sequence[str] | None, name: str) -> int:
    if isinstance(spec_column, str):
        if reward_names is None or spec_column not in reward_names:
            raise ValueError(
                f"reward transform {name!r}: column {spec_column!r} is not a reward name "
                f"({', '.join(reward_names or []) or 'no names given'})"
            )
        return list(reward_names).index(spec_column)
    if isinstance(spec_column, bool) or not isinstance(spec_column, int) or not -k <= spec_column < k:
        raise ValueError(
            f"reward transform {name!r}: column must be a reward name or an index < {k}, got {spec_column!r}"
        )
    return spec_column % k


def check_specs(specs: Sequence[Mapping[str, Any]], reward_names: Sequence[str] | None = None) -> None:
    """Validate a list of transform specs before training: names, options and columns (ValueError / KeyError)."""
    for i, spec in enumerate(specs):
        if not isinstance(spec, Mapping) or "name" not in spec:
            raise ValueError(f"reward transform spec {i} must be a mapping with a 'name', got {spec!r}")
        name = str(spec["name"])
        allowed = set(options(name)) | {"name", "column"}
        bad = sorted(set(spec) - allowed)
        if bad:
            raise TypeError(
                f"reward transform {name!r} got unknown option(s) {', '.join(map(repr, bad))}; "
                f"valid options: {', '.join(sorted(allowed - {'name'}))}"
            )
        column = spec.get("column")
        if reward_names is not None:
            k = len(reward_names)
            if column is not None:
                _column(column, k, reward_names, name)
            elif k > 1 and not TRANSFORMS.meta(name)["columnwise"]:
                raise ValueError(
                    f"reward transform {name!r} applies to one reward: set 'column' (one of {list(reward_names)})"
                )


def apply(
    specs: Sequence[Mapping[str, Any]],
    rewards: Tensor,
    group: Tensor,
    *,
    context: EstimatorContext | None = None,
    reward_names: Sequence[str] | None = None,
) -> Tensor:
    """Run the transform specs in order on Float[B] or Float[B, K] rewards; returns a new tensor (same shape).

    Each spec is ``{"name": ..., "column": <reward name | index | None>, **options}``; ``column`` None
    transforms every column (refused for a ``columnwise=False`` transform when K > 1).
    """
    r = torch.as_tensor(rewards)
    out = r.clone() if r.is_floating_point() else r.to(torch.float32)
    for spec in specs:
        opts = dict(spec)
        name = str(opts.pop("name"))
        column = opts.pop("column", None)
        fn = get(name)
        if "context" in inspect.signature(inspect.unwrap(fn)).parameters:
            opts["context"] = context
        if out.dim() == 1:
            if column is not None:
                _column(column, 1, reward_names, name)  # index 0 / -1, or the one reward's name
            out = fn(out, group, **opts)
            continue
        k = out.shape[1]
        if column is None:
            if k > 1 and not TRANSFORMS.meta(name)["columnwise"]:
                raise ValueError(
                    f"reward transform {name!r} applies to one reward: set 'column' (rewards have {k})"
                )
            cols = list(range(k))
        else:
            cols = [_column(column, k, reward_names, name)]
        out = out.clone()
        for c in cols:
            out[:, c] = fn(out[:, c], group, **opts)
    return out


# ---------------------------------------------------------------------------- helpers


def _valid(r: Tensor) -> Tensor:
    return torch.isfinite(r)


def _gids(group: Tensor, r: Tensor) -> Tensor:
    gid, _ = group_index(group, r.shape[0], r.device)
    return gid


# ---------------------------------------------------------------------------- transforms


@register("noisy_verifier", columnwise=False)
def noisy_verifier(rewards: Tensor, group: Tensor, *, fp_rate: float = 0.0, fn_rate: float = 0.0) -> Tensor:
    """Backward noise correction of a binary verifier: r_hat = (r - rho0) / (1 - rho0 - rho1).

    "Reinforcement Learning with Verifiable yet Noisy Rewards under Imperfect Verifiers": the verifier
    is a noisy channel with false-positive rate rho0 = ``fp_rate`` (P(r = 1 | wrong)) and false-negative
    rate rho1 = ``fn_rate`` (P(r = 0 | correct)); E[r_hat | clean reward] equals the clean reward, so the
    policy gradient is unbiased. Needs rho0 + rho1 < 1. The rates are options (estimate them offline, or
    by re-checking a sample of negatives as the paper's appeal verifier does). The paper's forward
    correction is not implemented.
    """
    for key, value in (("fp_rate", fp_rate), ("fn_rate", fn_rate)):
        if not (math.isfinite(value) and 0.0 <= value < 1.0):
            raise ValueError(f"noisy_verifier: {key} must be in [0, 1), got {value!r}")
    if not fp_rate + fn_rate < 1.0:
        raise ValueError(f"noisy_verifier: fp_rate + fn_rate must be < 1, got {fp_rate + fn_rate!r}")
    return (rewards - fp_rate) / (1.0 - fp_rate - fn_rate)


@register("unlikeliness", context=("logp_old_mean",))
def unlikeliness(
    rewards: Tensor, group: Tensor, *, context: EstimatorContext | None = None, beta: float = 0.25
) -> Tensor:
    """Rewarding the Unlikely: r_i (1 - beta rank_i / G), rank of the mean token log-prob under pi_old in the group.

    He et al., "Rewarding the Unlikely: Lifting GRPO Beyond Distribution Sharpening" (arXiv:2506.02355);
    as in the authors' code (AndreHe02/rewarding-unlikely-release): within each group, rank_i is the
    position of sample i when the G valid samples are sorted by ``context.logp_old_mean`` ascending
    (0 = the least likely, G - 1 = the most likely; ties by batch order), so the most likely correct
    answers lose up to beta (``beta`` = 0.25, their ``rank_penalty``) of their reward. Use it with
    ``grpo`` (the authors: eps 1e-6) and, as they do, more than one update per batch. NaN rewards are
    left out of the ranking and stay NaN.
    """
    if not (math.isfinite(beta) and 0.0 <= beta <= 1.0):
        raise ValueError(f"unlikeliness: beta must be in [0, 1], got {beta!r}")
    lp = require_field("unlikeliness", context, "logp_old_mean").to(rewards)
    valid = _valid(rewards)
    if bool((valid & ~torch.isfinite(lp)).any()):
        raise ContextError(
            "unlikeliness: context field 'logp_old_mean' must be finite for samples with a reward"
        )
    gid = _gids(group, rewards)
    idx = torch.arange(rewards.shape[0], device=rewards.device)
    same = (gid[:, None] == gid[None, :]) & valid[:, None] & valid[None, :]
    below = (lp[None, :] < lp[:, None]) | ((lp[None, :] == lp[:, None]) & (idx[None, :] < idx[:, None]))
    rank = (same & below).sum(dim=1).to(rewards.dtype)
    size = same.sum(dim=1).to(rewards.dtype).clamp(min=1)
    return torch.where(valid, rewards * (1.0 - beta * rank / size), rewards)


def _pairwise(features: Tensor, metric: str) -> Tensor:
    if metric == "cosine":
        unit = torch.nn.functional.normalize(features, dim=1)
        return (1.0 - unit @ unit.T).clamp(min=0.0)
    return torch.cdist(features, features)


@register("set_diversity", context=("features",), context_optional=("set_ids",), columnwise=False)
def set_diversity(
    rewards: Tensor,
    group: Tensor,
    *,
    context: EstimatorContext | None = None,
    weight: float = 0.5,
    metric: str = "cosine",
) -> Tensor:
    """SGRPO-style set diversity: r_i + weight (D(S_i) + c_i - mean_{j in S_i} c_j), c_i = D(S_i) - D(S_i minus i).

    "Pushing Biomolecular Utility-Diversity Frontiers with Supergroup Relative Policy Optimization"
    (SGRPO): diversity is a property of a set, so each group (one condition) holds candidate sets
    (``context.set_ids``; the whole group is one set without them) and a set's diversity reward is
    redistributed to its members through their leave-one-out contributions. D(S) is the mean pairwise
    distance of the members' ``context.features`` (``metric``: ``cosine`` 1 - cos, or ``euclidean``); 0
    for fewer than 2 members. The credit of member i keeps the set's mean at D(S), so sets are compared
    within the group (the supergroup) while members are ranked by what they add. (our design): this
    additive credit and weight 0.5 (the authors' code offers several hierarchies and a softmax credit);
    features are whatever embedding the pipeline supplies. NaN rewards stay NaN.
    """
    if metric not in ("cosine", "euclidean"):
        raise ValueError(f"set_diversity: metric must be 'cosine' or 'euclidean', got {metric!r}")
    if not math.isfinite(weight):
        raise ValueError(f"set_diversity: weight must be finite, got {weight!r}")
    feats = require_field("set_diversity", context, "features").to(rewards)
    if not bool(torch.isfinite(feats).all()):
        raise ContextError("set_diversity: context field 'features' must be finite")
    gid = _gids(group, rewards)
    sets = (
        torch.zeros_like(gid)
        if context is None or context.set_ids is None
        else torch.as_tensor(context.set_ids).to(gid)
    )
    _, cell = torch.unique(torch.stack([gid, sets], dim=1), dim=0, return_inverse=True)
    dist = _pairwise(feats, metric)
    credit = torch.zeros_like(rewards)
    for c in torch.unique(cell).tolist():
        members = (cell == c).nonzero().flatten()
        m = int(members.numel())
        if m < 2:
            continue
        sub = dist[members][:, members]
        total = sub.sum() / 2.0
        d_set = total / (m * (m - 1) / 2.0)
        if m - 1 >= 2:
            without = (total - sub.sum(dim=1)) / ((m - 1) * (m - 2) / 2.0)
        else:
            without = torch.zeros(m, dtype=rewards.dtype, device=rewards.device)
        contrib = d_set - without
        credit[members] = d_set + contrib - contrib.mean()
    return torch.where(_valid(rewards), rewards + weight * credit, rewards)


@register("self_aligned", context=("logp_old_mean", "logp_uncond_mean"), columnwise=False)
def self_aligned(
    rewards: Tensor, group: Tensor, *, context: EstimatorContext | None = None, weight: float = 1.0
) -> Tensor:
    """Self-aligned reward: r_i + weight (ppl(y) - ppl(y|x)) / ppl(y) = r_i + weight (1 - exp(lp_u - lp_c)).

    "Self-Aligned Reward: Towards Effective and Efficient Reasoners" (SAR): ppl(y|x) = exp(-lp_c) with
    lp_c = ``logp_old_mean`` (mean token log-prob of the response given the query) and ppl(y) =
    exp(-lp_u) with lp_u = ``logp_uncond_mean`` (the same response scored without the query: a second
    scoring pass the trainer must make). SAR favours responses the query makes likely (concise and
    specific). (our design): weight 1.0 (the abstract gives no coefficient). NaN rewards stay NaN.
    """
    if not math.isfinite(weight):
        raise ValueError(f"self_aligned: weight must be finite, got {weight!r}")
    lp_c = require_field("self_aligned", context, "logp_old_mean").to(rewards)
    lp_u = require_field("self_aligned", context, "logp_uncond_mean").to(rewards)
    valid = _valid(rewards)
    if bool((valid & ~(torch.isfinite(lp_c) & torch.isfinite(lp_u))).any()):
        raise ContextError("self_aligned: log-probs must be finite for samples with a reward")
    sar = 1.0 - torch.exp((lp_u - lp_c).clamp(max=50.0))
    return torch.where(valid, rewards + weight * sar, rewards)
