"""Advantage estimators and reward transforms from the seed papers (docs/seeds.md), registered into the core
registry: ``estimator:dcpo``, ``estimator:copo``, ``estimator:hardness_weighted`` (the reward transform
``grpo_s`` is in `mmalign.algorithms.seed_transforms`). Formulas: docs/algorithms.md; each docstring says where its formula comes from.

They follow the conventions of `mmalign.algorithms.advantages` (NaN / non-finite rewards are "not applicable" and get
advantage 0, groups with fewer than 2 valid samples get 0, float64 inside, keyword-only options).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mmalign.algorithms import advantages as adv_lib
from mmalign.algorithms.advantages import EstimatorContext, Weights

__all__ = ["copo", "dcpo", "hardness_weighted"]


def _group_mean_count(r: Tensor, valid: Tensor, gid: Tensor, n_groups: int) -> tuple[Tensor, Tensor]:
    """Per group: the mean of the valid rewards (0 with none) and their count."""
    zero = torch.zeros(n_groups, dtype=r.dtype, device=r.device)
    n = zero.index_add(0, gid, valid.to(r.dtype))
    s = zero.index_add(0, gid, torch.where(valid, r, torch.zeros_like(r)))
    return s / n.clamp(min=1), n


def _check_finite(name: str, key: str, value: float, *, low: float | None = None) -> float:
    if not math.isfinite(value) or (low is not None and value < low):
        raise ValueError(
            f"{name}: {key} must be finite{'' if low is None else f' and >= {low}'}, got {value!r}"
        )
    return float(value)


@adv_lib.register("dcpo", context=("entropy_mean", "logp_old_mean"), context_optional=("lengths",))
def dcpo(
    rewards: Tensor,
    group: Tensor,
    *,
    context: EstimatorContext | None = None,
    weights: Weights = None,
    entropy_base: float = 0.5,
    max_delta: float = 0.1,
    threshold: float = 0.05,
    temp_low_entropy: float = 1.2,
    temp_high_entropy: float = 0.8,
    eps: float = 1e-6,
) -> Tensor:
    """DCPO: GRPO advantages blended with a temperature-reweighted push toward correct samples (entropy control).

    "Distribution-Centric Policy Optimization Dominates Exploration-Exploitation Trade-off"; from the authors'
    code (597358816/DCPO, verl/trainer/ray_trainer.py, ``alg == "DCPO"``; entropy_base 0.5 as their script).
    With H the batch's token-mean entropy (``entropy_mean`` weighted by ``lengths`` when given), T =
    ``temp_low_entropy`` if H <= entropy_base else ``temp_high_entropy``, b_i = 1[r_i > threshold], rho the
    share of the batch's valid samples with b_i = 1, a = min(|entropy_base - H|, max_delta) / rho and
    alpha = a / (a + 1):  A_i = (1 - alpha) A_grpo_i + alpha b_i f_i.  The authors' f is the per-token ratio
    pi_T(y_t) / pi(y_t) of the sampled token under temperature T; (our design) f_i = exp((1/T - 1) (mean log
    pi_old(y_i) + mean H_i)), its first-order expansion in 1/T with per-sample means, so it needs no second
    scoring pass (log pi_T(y) - log pi(y) ~ (1/T - 1)(log pi(y) + H)). rho = 0: A = A_grpo.
    """
    name = "dcpo"
    for key, value in (("entropy_base", entropy_base), ("max_delta", max_delta), ("threshold", threshold)):
        _check_finite(name, key, value)
    for key, value in (("temp_low_entropy", temp_low_entropy), ("temp_high_entropy", temp_high_entropy)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"dcpo: {key} must be > 0, got {value!r}")
    if max_delta < 0:
        raise ValueError(f"dcpo: max_delta must be >= 0, got {max_delta!r}")
    base = adv_lib.get("grpo")(rewards, group, weights=weights, eps=_check_finite(name, "eps", eps, low=0.0))
    r = adv_lib.combine_rewards(torch.as_tensor(rewards).to(torch.float64), weights)
    valid = torch.isfinite(r)
    ent = adv_lib.require_field(name, context, "entropy_mean").to(r)
    lp = adv_lib.require_field(name, context, "logp_old_mean").to(r)
    lengths = None if context is None or context.lengths is None else torch.as_tensor(context.lengths).to(r)
    w = valid.to(r.dtype) if lengths is None else torch.where(valid, lengths, torch.zeros_like(r))
    ent_ok = torch.where(w > 0, ent, torch.zeros_like(ent))
    h = float((w * ent_ok).sum() / w.sum()) if float(w.sum()) > 0 else entropy_base
    temp = temp_low_entropy if h <= entropy_base else temp_high_entropy
    b = valid & (r > threshold)
    n_valid = int(valid.sum())
    rho = float(b.sum()) / n_valid if n_valid else 0.0
    if rho == 0.0:
        return base.to(torch.float64)
    a = min(abs(entropy_base - h), max_delta) / rho
    alpha = a / (a + 1.0)
    lp_ok = torch.where(b, lp, torch.zeros_like(lp))
    f = torch.exp(((1.0 / temp - 1.0) * (lp_ok + torch.where(b, ent, torch.zeros_like(ent)))).clamp(-20, 20))
    out = (1.0 - alpha) * base.to(torch.float64) + alpha * b.to(torch.float64) * f
    return torch.where(valid, out, torch.zeros_like(out))


def _binary_entropy(p: Tensor) -> Tensor:
    """H(p) / log 2 in [0, 1] (0 at p = 0 or 1)."""
    q = p.clamp(0.0, 1.0)
    h = -(torch.xlogy(q, q) + torch.xlogy(1.0 - q, 1.0 - q))
    return h / math.log(2.0)


@adv_lib.register("copo")
def copo(
    rewards: Tensor,
    group: Tensor,
    *,
    weights: Weights = None,
    threshold: float = 0.5,
    eps: float = 1e-4,
) -> Tensor:
    """COPO: local GRPO advantages blended with a global, consistency-based advantage by the group's entropy.

    "COPO: Consistency-Aware Policy Optimization" (arXiv:2508.04138); (our reading) of the abstract, the
    authors' code (hijih/copo-code) being unavailable here. Per prompt q: p_q = the share of its valid samples
    with r > ``threshold`` (its outcome consistency), the global reward R_q = p_q, the global advantage
    A_glob_q = (R_q - mean_q' R) / (std_q' R + eps) over the batch's prompts (unbiased std; 0 with < 2
    prompts), the blend weight w_q = H(p_q) / log 2 (binary entropy: 1 for a split group, 0 for a unanimous
    one). A_i = w_q A_grpo_i + (1 - w_q) A_glob_q: unanimous groups (zero GRPO advantage) still learn from
    the global term, split groups mostly from the local one.
    """
    _check_finite("copo", "threshold", threshold)
    eps = _check_finite("copo", "eps", eps, low=0.0)
    local = adv_lib.get("grpo")(rewards, group, weights=weights, eps=eps).to(torch.float64)
    r = adv_lib.combine_rewards(torch.as_tensor(rewards).to(torch.float64), weights)
    valid = torch.isfinite(r)
    gid, n_groups = adv_lib.group_index(group, r.shape[0], r.device)
    correct = torch.where(valid, (r > threshold).to(r.dtype), torch.zeros_like(r))
    p, n = _group_mean_count(correct, valid, gid, n_groups)
    live = n >= 2
    k = int(live.sum())
    if k >= 2:
        mu = p[live].mean()
        sd = p[live].std(unbiased=True)
        den = sd + eps
        glob = torch.where(live & (den > 0), (p - mu) / den.clamp(min=1e-300), torch.zeros_like(p))
    else:
        glob = torch.zeros_like(p)
    w = _binary_entropy(p)
    out = w[gid] * local + (1.0 - w[gid]) * glob[gid]
    return torch.where(valid & live[gid], out, torch.zeros_like(out))


@adv_lib.register("hardness_weighted")
def hardness_weighted(
    rewards: Tensor,
    group: Tensor,
    *,
    weights: Weights = None,
    alpha: float = 1.0,
    threshold: float = 0.5,
    eps: float = 1e-4,
) -> Tensor:
    """Confucius3-Math's policy-specific hardness weighting: GRPO advantages scaled up on prompts the policy fails.

    "Confucius3-Math" (arXiv:2506.18330), Policy-Specific Hardness Weighting; (our design) the weight
    function, the report's exact one and code being unavailable here: with p_q the share of prompt q's valid
    samples with r > ``threshold`` (the current policy's pass rate), A_i = (1 + alpha (1 - p_q)) A_grpo_i.
    """
    if not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"hardness_weighted: alpha must be >= 0, got {alpha!r}")
    _check_finite("hardness_weighted", "threshold", threshold)
    base = adv_lib.get("grpo")(rewards, group, weights=weights, eps=eps).to(torch.float64)
    r = adv_lib.combine_rewards(torch.as_tensor(rewards).to(torch.float64), weights)
    valid = torch.isfinite(r)
    gid, n_groups = adv_lib.group_index(group, r.shape[0], r.device)
    correct = torch.where(valid, (r > threshold).to(r.dtype), torch.zeros_like(r))
    p, _ = _group_mean_count(correct, valid, gid, n_groups)
    return base * (1.0 + alpha * (1.0 - p[gid]))
