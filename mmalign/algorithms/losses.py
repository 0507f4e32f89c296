"""Policy losses, aggregation modes and KL estimators (see docs/algorithms.md, "Policy losses").

Three registries: ``REGISTRY`` (policy losses, ``fn(logp, logp_old, advantages, mask, **options) ->
PolicyLossOutput`` with ``per_token`` exactly 0 where ``mask`` is False, ``clipped`` and ``ratio``),
``AGGREGATIONS`` (``aggregate`` reduces per-action losses to a scalar) and ``KL_ESTIMATORS`` (``kl``, a per-action
KL estimate). Log-ratios are clamped to [-20, 20] before ``exp`` and masked positions never contribute (no NaN
from them); a loss registered with ``couples_actions=True`` (``gspo``) is evaluated in one piece. Options are
keyword-only (unknown: TypeError naming the loss and the option).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmalign.registry import Registry, option_checked

LOG_RATIO_CLAMP = 20.0


@dataclass
class PolicyLossOutput:
    """What a policy loss returns: per-action loss, where a clip is active, and the ratio."""

    per_token: Tensor  # Float[B, T], 0 where mask is False
    clipped: Tensor  # Bool[B, T], False where mask is False
    ratio: Tensor  # Float[B, T] (1 where mask is False)


PolicyLoss = Callable[..., PolicyLossOutput]
Aggregation = Callable[..., Tensor]
KLEstimator = Callable[[Tensor, Tensor], Tensor]
Count = int | float | Tensor | None

REGISTRY: Registry[PolicyLoss] = Registry("policy loss")
AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation")
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


# --------------------------------------------------------------------------- registry API


def register(name: str, **meta: Any) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator registering a policy loss ``fn(logp, logp_old, advantages, mask, **options)``."""

    def deco(fn: PolicyLoss) -> PolicyLoss:
        return REGISTRY.register(name, **meta)(option_checked(REGISTRY.kind, name, fn, n_positional=4))

    return deco


def get(name: str) -> PolicyLoss:
    """The policy loss registered under ``name`` (``RegistryError``, a KeyError, if unknown)."""
    return REGISTRY.get(name)


def names() -> list[str]:
    """Sorted names of the registered policy losses."""
    return REGISTRY.names()


def describe(name: str) -> str:
    """One-line summary of a policy loss."""
    return REGISTRY.describe(name)


def options(name: str) -> dict[str, Any]:
    """The options a policy loss accepts, with their defaults (for config validation)."""
    params = list(inspect.signature(inspect.unwrap(REGISTRY.get(name))).parameters.values())[4:]
    return {p.name: p.default for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}


def couples_actions(name: str) -> bool:
    """Whether the loss `name` ties the actions of a sample together (registered with ``couples_actions=True``),
    so it needs all of them at once."""
    return bool(REGISTRY.meta(name).get("couples_actions", False))


def aggregation_names() -> list[str]:
    """Sorted names of the aggregation modes."""
    return AGGREGATIONS.names()


def kl_names() -> list[str]:
    """Sorted names of the KL estimators."""
    return KL_ESTIMATORS.names()


# --------------------------------------------------------------------------- shared pieces


def _prepare(
    logp: Tensor, logp_old: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Validate shapes; return (mask Bool[B,T], advantages Float[B,1] or [B,T], log-ratio Float[B,T]).

    The log-ratio is 0 (ratio 1) where the mask is False, so padding values never reach exp().
    """
    if logp.dim() != 2:
        raise ValueError(f"logp must be Float[B, T], got shape {tuple(logp.shape)}")
    if logp_old.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, logp_old {tuple(logp_old.shape)} and mask {tuple(mask.shape)} "
            "must have the same shape"
        )
    mask = mask.to(torch.bool)
    adv = advantages.detach().to(dtype=logp.dtype, device=logp.device)
    if adv.dim() == 1 and adv.shape[0] == logp.shape[0]:
        adv = adv[:, None]
    elif adv.shape != logp.shape:
        raise ValueError(f"advantages must be Float[B] or Float[B, T], got shape {tuple(adv.shape)}")
    zero = torch.zeros_like(logp)
    adv = torch.where(mask, adv, zero)
    log_ratio = torch.where(mask, logp - logp_old.detach(), zero)
    return mask, adv, log_ratio


def _exp_clamped(log_ratio: Tensor) -> Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _check_clip(name: str, eps_low: float, eps_high: float) -> None:
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"{name}: eps_low must be in [0, 1), got {eps_low!r}")
    if not eps_high >= 0.0:
        raise ValueError(f"{name}: eps_high must be >= 0, got {eps_high!r}")


def _clipped_surrogate(
    ratio: Tensor, adv: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor]:
    """PPO: loss = -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A); clipped where the clipped term wins."""
    unclipped = ratio * adv
    clipped_term = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    clipped = mask & (clipped_term < unclipped)
    loss = -torch.where(clipped, clipped_term, unclipped)
    return torch.where(mask, loss, torch.zeros_like(loss)), clipped


# --------------------------------------------------------------------------- policy losses


@register("ppo_clip")
def ppo_clip(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> PolicyLossOutput:
    """PPO clipped surrogate: -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A), per action.

    eps_low and eps_high are separate (DAPO "clip-higher" sets eps_high ~ 0.28; NGRPO uses
    0.16 / 0.24). ``clipped`` is where the clipped term is the smaller one (its gradient is 0).
    """
    _check_clip("ppo_clip", eps_low, eps_high)
    mask, adv, log_ratio = _prepare(logp, logp_old, advantages, mask)
    ratio = _exp_clamped(log_ratio)
    per_token, clipped = _clipped_surrogate(ratio, adv, mask, eps_low, eps_high)
    return PolicyLossOutput(per_token=per_token, clipped=clipped, ratio=ratio)


@register("dual_clip")
def dual_clip(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    c: float = 3.0,
) -> PolicyLossOutput:
    """Dual-clip PPO: as ppo_clip, but for A < 0 the loss is also capped at -A*c (c = 3).

    For A < 0: loss = min(max(-A rho, -A clip(rho)), -A c). ``clipped`` is True where either
    clip is active (both cut the gradient to 0).
    """
    _check_clip("dual_clip", eps_low, eps_high)
    if not c > 1.0:
        raise ValueError(f"dual_clip: c must be > 1, got {c!r}")
    mask, adv, log_ratio = _prepare(logp, logp_old, advantages, mask)
    ratio = _exp_clamped(log_ratio)
    ppo_loss, clipped = _clipped_surrogate(ratio, adv, mask, eps_low, eps_high)
    cap = -adv * c
    dual = mask & (adv < 0) & (ppo_loss > cap)
    per_token = torch.where(dual, cap, ppo_loss)
    return PolicyLossOutput(per_token=per_token, clipped=clipped | dual, ratio=ratio)


@register("gspo", couples_actions=True)
def gspo(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> PolicyLossOutput:
    """GSPO: PPO clip on the sequence-level ratio s_i = exp(mean_t (logp - logp_old)), one per sample.

    s_i uses the masked mean over the sample's valid actions (a row with no valid action has
    s_i = 1 and zero loss); the mean log-ratio is clamped to [-20, 20] before exp. s_i is broadcast
    over the valid actions and the gradient flows through s_i (to every action of the sample).
    Defaults eps_low = 3e-4, eps_high = 4e-4 are the GSPO paper's clipping ranges (sequence-level
    ratios sit much closer to 1 than token-level ones).

    With per-sample advantages (Float[B]) this is GSPO exactly. With per-token advantages
    (Float[B, T]) it is GSPO-token: s_{i,t} = exp(clamp(sg(log s_i) + logp_t - sg(logp_t), -20, 20))
    has the value s_i but sends each action's gradient with its own advantage (as verl's
    ``compute_policy_loss_gspo``). The clamp acts on that whole exponent, whose value is the mean
    log-ratio, so in both forms a sample whose mean log-ratio lies outside [-20, 20] gets zero
    gradient. For advantages constant within a sample both forms give the same loss and gradient
    under every aggregation mode here.
    """
    _check_clip("gspo", eps_low, eps_high)
    per_sample_adv = advantages.dim() == 1
    mask, adv, log_ratio = _prepare(logp, logp_old, advantages, mask)
    n = mask.sum(dim=1).to(logp.dtype)
    seq_log_ratio = log_ratio.sum(dim=1, keepdim=True) / n.clamp(min=1)[:, None]
    if per_sample_adv:
        ratio = _exp_clamped(seq_log_ratio).expand_as(logp)
    else:
        safe_logp = torch.where(mask, logp, torch.zeros_like(logp))  # padding may be -inf or NaN
        ratio = _exp_clamped(seq_log_ratio.detach() + (safe_logp - safe_logp.detach()))
    per_token, clipped = _clipped_surrogate(ratio, adv, mask, eps_low, eps_high)
    return PolicyLossOutput(per_token=per_token, clipped=clipped, ratio=ratio)


@register("cispo")
def cispo(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_max: float = 4.0,
) -> PolicyLossOutput:
    """CISPO: -sg(min(rho, eps_max)) * A * logp; the IS weight is capped and detached, no token is dropped.

    ``eps_max`` caps the ratio itself (docs/algorithms.md writes min(rho, eps_max), i.e. the MiniMax-M1
    upper bound 1 + eps_high^IS); there is no lower bound, as in MiniMax-M1, which does not publish
    its eps_high^IS. The default 4.0 follows ScaleRL / Tinker's CISPO default (NeMo-RL's recipe uses
    6, Trinity-RFT 1.28). The gradient w.r.t. logp is exactly -sg(min(rho, eps_max)) * A.

    Note: ``per_token`` is -w * A * logp, a REINFORCE-style value, not a surrogate ratio objective;
    its magnitude depends on logp and is not comparable with the other losses' values (only its
    gradient is meaningful). ``ratio`` is rho; ``clipped`` is where rho > eps_max.
    """
    if not eps_max > 0:
        raise ValueError(f"cispo: eps_max must be > 0, got {eps_max!r}")
    mask, adv, log_ratio = _prepare(logp, logp_old, advantages, mask)
    ratio = _exp_clamped(log_ratio)
    weight = ratio.clamp(max=eps_max).detach()
    zero = torch.zeros_like(logp)
    safe_logp = torch.where(mask, logp, zero)
    per_token = torch.where(mask, -weight * adv * safe_logp, zero)
    clipped = mask & (ratio > eps_max)
    return PolicyLossOutput(per_token=per_token, clipped=clipped, ratio=ratio)


@register("sapo")
def sapo(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> PolicyLossOutput:
    """SAPO: soft gate -(4/tau) sigmoid(tau (rho - 1)) A, tau = tau_pos if A > 0 else tau_neg (1.0 / 1.05).

    At rho = 1 the gradient equals the unclipped policy gradient (-A dlogp); away from 1 it decays
    smoothly instead of being cut. There is no hard clip, so ``clipped`` is all False.
    """
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"sapo: tau_pos and tau_neg must be > 0, got {tau_pos!r}, {tau_neg!r}")
    mask, adv, log_ratio = _prepare(logp, logp_old, advantages, mask)
    ratio = _exp_clamped(log_ratio)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    loss = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv
    per_token = torch.where(mask, loss, torch.zeros_like(loss))
    return PolicyLossOutput(per_token=per_token, clipped=torch.zeros_like(mask), ratio=ratio)


# --------------------------------------------------------------------------- aggregation


def _denominator(value: Count, default: Tensor, like: Tensor) -> Tensor:
    den = default if value is None else value
    return torch.as_tensor(den, dtype=like.dtype, device=like.device)


def _divide(num: Tensor, den: Tensor) -> Tensor:
    """num / den, or 0 (keeping the graph) when den <= 0."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), num * 0.0)


def _masked(per_token: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    if per_token.shape != mask.shape or per_token.dim() != 2:
        raise ValueError(
            f"per_token {tuple(per_token.shape)} and mask {tuple(mask.shape)} must both be [B, T]"
        )
    mask = mask.to(torch.bool)
    return torch.where(mask, per_token, torch.zeros_like(per_token)), mask


@AGGREGATIONS.register("token_mean")
def token_mean(
    per_token: Tensor,
    mask: Tensor,
    *,
    num_tokens: Count = None,
    num_seqs: Count = None,
    max_len: Count = None,
    lengths: Tensor | None = None,
) -> Tensor:
    """DAPO token mean: sum of the loss over valid actions / num_tokens (default mask.sum())."""
    x, mask = _masked(per_token, mask)
    return _divide(x.sum(), _denominator(num_tokens, mask.sum(), x))


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(
    per_token: Tensor,
    mask: Tensor,
    *,
    num_tokens: Count = None,
    num_seqs: Count = None,
    max_len: Count = None,
    lengths: Tensor | None = None,
) -> Tensor:
    """Original GRPO: sum_i (sum_t loss / |o_i|) / num_seqs (default B); rows with no valid action give 0.
    |o_i| is ``lengths`` (Float[B]) when given, else the row's valid actions (``mask.sum(1)``)."""
    x, mask = _masked(per_token, mask)
    counts = mask.sum(dim=1) if lengths is None else lengths.to(device=x.device)
    row_mean = _divide(x.sum(dim=1), counts.to(x.dtype))
    return _divide(row_mean.sum(), _denominator(num_seqs, torch.tensor(x.shape[0]), x))


@AGGREGATIONS.register("seq_sum_norm")
def seq_sum_norm(
    per_token: Tensor,
    mask: Tensor,
    *,
    num_tokens: Count = None,
    num_seqs: Count = None,
    max_len: Count = None,
    lengths: Tensor | None = None,
) -> Tensor:
    """Dr. GRPO: sum of the loss over valid actions / (num_seqs * max_len) (defaults B and T)."""
    x, mask = _masked(per_token, mask)
    seqs = _denominator(num_seqs, torch.tensor(x.shape[0]), x)
    length = _denominator(max_len, torch.tensor(x.shape[1]), x)
    return _divide(x.sum(), seqs * length)


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: Count = None,
    num_seqs: Count = None,
    max_len: Count = None,
    lengths: Tensor | None = None,
) -> Tensor:
    """Reduce per-action losses Float[B, T] to a scalar with the aggregation ``mode``.

    - ``token_mean``: sum(loss * mask) / num_tokens (default mask.sum()).
    - ``seq_mean_token_mean``: sum_i (sum_t loss * mask / |o_i|) / num_seqs (default B).
    - ``seq_sum_norm``: sum(loss * mask) / (num_seqs * max_len) (defaults B and T).

    The overrides let the trainer normalise by GLOBAL counts: when one optimizer step covers
    several minibatches (gradient accumulation) and/or processes, pass the counts over the whole
    step (all minibatches, all processes; for DDP, which averages gradients over N processes,
    pass the global count divided by N), so that summing the per-minibatch losses gives exactly
    the full-batch loss. A zero or negative denominator gives 0, not NaN.

    ``lengths`` (Float[B], ``seq_mean_token_mean``'s |o_i|) lets a part of each row's actions be aggregated
    as its share of the whole row: the trainer passes the whole rows' counts when a microbatch is scored in
    chunks of its actions, so the chunks' losses add up to the loss of the whole rows. It is passed on only
    when given (an aggregation registered elsewhere need not accept it unless chunks are used).
    """
    fn = AGGREGATIONS.get(mode)
    extra = {} if lengths is None else {"lengths": lengths}
    return fn(per_token, mask, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len, **extra)


# --------------------------------------------------------------------------- KL to a reference


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """k1 = logp - logp_ref (unbiased, can be negative)."""
    return logp - logp_ref


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """k2 = 1/2 (logp - logp_ref)^2."""
    return 0.5 * (logp - logp_ref) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """k3 = exp(d) - d - 1 with d = logp_ref - logp clamped to [-20, 20] (non-negative, low variance)."""
    d = (logp_ref - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1.0


def kl(logp: Tensor, logp_ref: Tensor, estimator: str = "k3", *, mask: Tensor | None = None) -> Tensor:
    """Per-action KL(pi || pi_ref) estimate Float[B, T] with estimator k1, k2 or k3 (docs/algorithms.md).

    ``logp_ref`` is detached. With ``mask``, masked-out positions are 0 (and their log-probs,
    even NaN/-inf padding, never enter the arithmetic).
    """
    fn = KL_ESTIMATORS.get(estimator)
    ref = logp_ref.detach()
    if mask is None:
        return fn(logp, ref)
    mask = mask.to(torch.bool)
    zero = torch.zeros_like(logp)
    out = fn(torch.where(mask, logp, zero), torch.where(mask, ref, zero))
    return torch.where(mask, out, zero)


# --------------------------------------------------------------------------- diagnostics


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over the positions where mask is True (0 if there are none; masked NaNs ignored)."""
    mask = mask.to(torch.bool)
    total = torch.where(mask, x, torch.zeros_like(x)).sum()
    return _divide(total, mask.sum().to(total.dtype))


def approx_kl(logp: Tensor, logp_old: Tensor, mask: Tensor) -> Tensor:
    """Diagnostic: 1/2 * masked mean of (logp - logp_old)^2 (no grad)."""
    with torch.no_grad():
        mask = mask.to(torch.bool)
        zero = torch.zeros_like(logp)
        delta = torch.where(mask, logp - logp_old, zero)
        return 0.5 * masked_mean(delta * delta, mask)


# ----------------------------------------------------------------------------- seed-paper losses
# etr (Elastic Trust Regions), reg_grpo (Reg-GRPO, DeepVideo-R1), d3s (D³S token level), hapo (HAPO)


def _per_sample(name: str, x: Tensor | None, batch: int, like: Tensor, what: str) -> Tensor | None:
    if x is None:
        return None
    t = torch.as_tensor(x).to(dtype=like.dtype, device=like.device)
    if t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(f"{name}: {what} must be Float[B] with B={batch}, got shape {tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise ValueError(f"{name}: {what} must be finite and >= 0")
    return t


@register("etr")
def etr(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    micro_scale: float = 0.5,
    macro_scale: float = 0.5,
    std_ref: float = 0.5,
    group_std: Tensor | None = None,
) -> PolicyLossOutput:
    """ETR: PPO clip with per-sample ranges eps_i = eps * (1 + micro tanh|A_i|) * (1 + macro (2 s_g / s_ref - 1)).

    "ETR: Outcome-Guided Elastic Trust Regions for Policy Optimization": the trust region follows the
    signal's quality. Micro level: a larger |A_i| (a high-confidence path) widens sample i's clip
    range, m_i = 1 + ``micro_scale`` * tanh(|A_i|) in [1, 1 + micro_scale] (|A_i| is the mean |A| over
    the sample's valid actions for Float[B,T] advantages). Macro level: groups whose rewards vary most
    (the optimal learning zone, p near 1/2 for 0/1 rewards) get a larger budget, M_g = 1 +
    ``macro_scale`` * (2 min(s_g / s_ref, 1) - 1) in [1 - macro, 1 + macro], s_g the group's reward std
    (``group_std``, Float[B]: the std of sample i's group; a per-batch input the trainer supplies),
    s_ref = ``std_ref`` = 0.5 (the largest std of a reward in [0, 1]). Then for every action of i:

        loss = -min(rho A, clip(rho, 1 - eps_low m_i M_g, 1 + eps_high m_i M_g) A)

    (our design): these two bounded factors and their defaults; the abstract gives no formula and no
    code is public. ``macro_scale=0`` needs no ``group_std`` (micro elasticity only); with
    ``macro_scale > 0`` a missing ``group_std`` is a ValueError.
    """
    _check_clip("etr", eps_low, eps_high)
    for key, value in (("micro_scale", micro_scale), ("macro_scale", macro_scale)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"etr: {key} must be a finite number >= 0, got {value!r}")
    if macro_scale >= 1.0:
        raise ValueError(
            f"etr: macro_scale must be < 1 (the macro factor must stay > 0), got {macro_scale!r}"
        )
    if not (math.isfinite(std_ref) and std_ref > 0):
        raise ValueError(f"etr: std_ref must be > 0, got {std_ref!r}")
    m, adv, log_ratio = _prepare(logp, logp_old, advantages, mask)
    batch = logp.shape[0]
    counts = m.sum(dim=1).to(logp.dtype)
    abs_a = adv.abs().expand_as(logp)
    mean_abs = torch.where(m, abs_a, torch.zeros_like(abs_a)).sum(dim=1) / counts.clamp(min=1)
    micro = 1.0 + micro_scale * torch.tanh(mean_abs)
    macro = torch.ones_like(micro)
    if macro_scale > 0:
        s = _per_sample("etr", group_std, batch, logp, "group_std")
        if s is None:
            raise ValueError(
                "etr: macro_scale > 0 needs group_std (Float[B], the reward std of each sample's group), "
                "which the trainer supplies; set loss_kwargs.macro_scale: 0 for micro elasticity only"
            )
        macro = 1.0 + macro_scale * (2.0 * (s / std_ref).clamp(max=1.0) - 1.0)
    scale = (micro * macro).detach()[:, None]
    ratio = _exp_clamped(log_ratio)
    low = 1.0 - (eps_low * scale).clamp(max=1.0 - 1e-6)
    high = 1.0 + eps_high * scale
    unclipped = ratio * adv
    clipped_term = torch.minimum(torch.maximum(ratio, low), high) * adv
    clipped = m & (clipped_term < unclipped)
    loss = -torch.where(clipped, clipped_term, unclipped)
    per_token = torch.where(m, loss, torch.zeros_like(loss))
    return PolicyLossOutput(per_token=per_token, clipped=clipped, ratio=ratio)


@register("reg_grpo")
def reg_grpo(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    beta: float = 5.0,
) -> PolicyLossOutput:
    """Reg-GRPO (DeepVideo-R1): (A_hat_i - A_i)^2 with A_hat_i = beta * mean_t log(pi / pi_old); no clip, no min.

    "DeepVideo-R1: Video Reinforcement Fine-Tuning via Difficulty-aware Regressive GRPO": the GRPO
    objective recast as regression of the advantage predicted by the policy's own log-ratio, which
    removes the safeguards (clip, min). A_hat_i uses the masked mean log-ratio over sample i's valid
    actions (a row without one has loss 0). At rho = 1 the gradient is -2 beta A_i grad(mean logp), the
    policy gradient's direction; it vanishes when the policy has moved by A_i / beta. With Float[B,T]
    advantages the target of sample i is their masked mean. ``per_token`` carries the sample's loss on
    each of its valid actions (so aggregation weighs samples as for the other losses).

    (our design): the per-sample (not group-normalised) prediction and beta = 5, which puts the target
    mean log-ratio of |A| = 1 at 0.2, the size of PPO's usual trust region; the paper's exact
    parameterisation is not public. ``clipped`` is all False.
    """
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"reg_grpo: beta must be > 0, got {beta!r}")
    m, adv, log_ratio = _prepare(logp, logp_old, advantages, mask)
    counts = m.sum(dim=1).to(logp.dtype)
    target = torch.where(m, adv.expand_as(logp), torch.zeros_like(logp)).sum(dim=1) / counts.clamp(min=1)
    predicted = beta * log_ratio.sum(dim=1) / counts.clamp(min=1)
    sample_loss = (predicted - target) ** 2
    per_token = torch.where(m, sample_loss[:, None].expand_as(logp), torch.zeros_like(logp))
    return PolicyLossOutput(per_token=per_token, clipped=torch.zeros_like(m), ratio=_exp_clamped(log_ratio))


def d3s_token_mask(advantages: Tensor, entropy: Tensor, mask: Tensor, keep_frac: float) -> Tensor:
    """Bool[B,T]: the valid actions whose |A_{i,t}| * H_{i,t} is among the top ``keep_frac`` of the batch (D³S).

    The token level of D³S ("Learning More with Less"): train on the tokens where the policy is both
    uncertain (entropy H) and impactful (|A|). ``advantages`` is Float[B] or Float[B,T]; ``entropy`` and
    ``mask`` are [B,T]. k = ceil(keep_frac * number of valid actions) tokens are kept (ties by position).
    A loss uses it as ``mask & d3s_token_mask(...)`` (with the entropy of the rollout's actions).
    """
    if not 0.0 < keep_frac <= 1.0:
        raise ValueError(f"d3s_token_mask: keep_frac must be in (0, 1], got {keep_frac!r}")
    m = torch.as_tensor(mask).bool()
    h = torch.as_tensor(entropy).to(torch.float64)
    a = torch.as_tensor(advantages).to(torch.float64)
    if a.dim() == 1:
        a = a[:, None].expand_as(h)
    if h.shape != m.shape or a.shape != m.shape:
        raise ValueError(
            f"d3s_token_mask: advantages, entropy and mask must be [B,T] alike, got {a.shape}, {h.shape}"
        )
    score = torch.where(m, (a.abs() * h).nan_to_num(nan=0.0), torch.full_like(h, -math.inf)).flatten()
    n_valid = int(m.sum())
    k = math.ceil(keep_frac * n_valid - 1e-9)
    keep = torch.zeros(score.numel(), dtype=torch.bool)
    if k > 0:
        order = torch.sort(score, descending=True, stable=True).indices[:k]
        keep[order] = True
    return keep.view_as(m) & m


def d3s_keep_fraction(
    step: int | None, total_steps: int | None, keep_start: float, keep_end: float, ramp: float
) -> float:
    """The D³S token keep fraction at training progress p = step / total_steps (0 without both).

    f(p) = keep_start + (keep_end - keep_start) * min(1, p / ramp); ``ramp`` = 0 gives keep_end at once.
    """
    p = 0.0 if step is None or not total_steps else min(1.0, max(0.0, step / total_steps))
    ramp_pos = 1.0 if ramp == 0 else min(1.0, p / ramp)
    return keep_start + (keep_end - keep_start) * ramp_pos


@register("d3s")
def d3s(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    keep_start: float = 0.2,
    keep_end: float = 1.0,
    ramp: float = 1.0,
    entropy: Tensor | None = None,
    step: int | None = None,
    total_steps: int | None = None,
) -> PolicyLossOutput:
    """D³S token level: the PPO clipped surrogate on only the tokens with the top ``f`` share of |A_t| * H_t.

    "Learning More with Less: A Dynamic Dual-Level Down-Sampling Framework for Efficient Policy
    Optimization" (D³S): at the token level, train on the tokens where the policy is both uncertain
    (entropy H_t) and impactful (|A_t|). With k = ceil(f * n) of the n valid actions of this call kept
    (`d3s_token_mask`, ties by position) and K the kept set:

        loss_t = (n / k) * -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t)   for t in K, 0 else

    so that a ``token_mean`` over the valid actions equals the mean over the kept ones. The fraction
    relaxes over training: f = `d3s_keep_fraction` (keep_start + (keep_end - keep_start) *
    min(1, (step / total_steps) / ramp)). ``entropy`` (Float[B,T], the policy's per-action entropy,
    detached; the trainer passes ``ActionStats.entropy``), ``step`` and ``total_steps`` (the trainer's
    step and ``trainer.steps``) are per-call inputs the trainer supplies; without ``entropy`` it is a
    ValueError (without step / total_steps f = keep_start).

    (our design): keep_start 0.2, keep_end 1.0 over the whole run (ramp 1.0), the linear schedule, the
    n / k rescaling, and the selection within one loss call (a microbatch, or one action chunk of it);
    the paper's constants are not in its abstract and no code is public. ``clipped`` covers kept
    tokens only.
    """
    _check_clip("d3s", eps_low, eps_high)
    for key, value in (("keep_start", keep_start), ("keep_end", keep_end)):
        if not (math.isfinite(value) and 0.0 < value <= 1.0):
            raise ValueError(f"d3s: {key} must be in (0, 1], got {value!r}")
    if not (math.isfinite(ramp) and 0.0 <= ramp <= 1.0):
        raise ValueError(f"d3s: ramp must be in [0, 1] (a fraction of the run), got {ramp!r}")
    if entropy is None:
        raise ValueError(
            "d3s: needs entropy (Float[B,T], the per-action entropy the policy's action_stats returns), "
            "which the trainer passes; this policy gives none"
        )
    m, adv, log_ratio = _prepare(logp, logp_old, advantages, mask)
    h = torch.as_tensor(entropy).detach().to(device=logp.device, dtype=logp.dtype)
    if h.shape != logp.shape:
        raise ValueError(
            f"d3s: entropy must be Float[B,T] like logp {tuple(logp.shape)}, got {tuple(h.shape)}"
        )
    frac = d3s_keep_fraction(step, total_steps, keep_start, keep_end, ramp)
    keep = d3s_token_mask(adv, h, m, frac).to(m.device)
    n_valid, n_kept = int(m.sum()), int(keep.sum())
    scale = n_valid / n_kept if n_kept else 0.0
    ratio = _exp_clamped(log_ratio)
    per_token, clipped = _clipped_surrogate(ratio, adv, keep, eps_low, eps_high)
    return PolicyLossOutput(per_token=per_token * scale, clipped=clipped, ratio=ratio)


def hapo_entropy_score(entropy: Tensor, mask: Tensor, pivot: float = 0.8, eps: float = 1e-8) -> Tensor:
    """Float[B,T] HAPO entropy score h_hat in [-1, 1] of every valid action (0 at masked ones).

    Over the n valid actions of the call: l = log(max(H, eps)), m = the ``pivot`` quantile of l (the
    element of rank round(pivot * (n - 1)) in ascending order, Python rounding), d = (l - m) / s with
    s = sqrt(max(mean(d0^2), eps)) and d0 = l - m; then h_hat = d / max(d) where d > 0 and
    h_hat = d / |min(d)| where d <= 0 (each extreme floored at eps). Positive: more uncertain than the
    pivot token; negative: more confident.
    """
    if not (math.isfinite(pivot) and 0.0 <= pivot <= 1.0):
        raise ValueError(f"hapo: entropy_pivot must be in [0, 1], got {pivot!r}")
    m = torch.as_tensor(mask).bool()
    h = torch.as_tensor(entropy).detach().to(torch.float64)
    if h.shape != m.shape:
        raise ValueError(
            f"hapo: entropy must be Float[B,T] like the mask {tuple(m.shape)}, got {tuple(h.shape)}"
        )
    out = torch.zeros_like(h)
    n = int(m.sum())
    if n == 0:
        return out
    logh = torch.log(torch.nan_to_num(h, nan=eps).clamp(min=eps))
    vals = torch.sort(logh[m]).values
    med = vals[round(pivot * (n - 1))]
    d = torch.where(m, logh - med, out)
    d = d / (d.pow(2).sum() / n).clamp(min=eps).sqrt()
    pos_max = torch.where(m & (d > 0), d, out).max().clamp(min=eps)
    neg_mag = torch.where(m & (d < 0), -d, out).max().clamp(min=eps)
    return torch.where(m, torch.where(d > 0, d / pos_max, d / neg_mag), out)


@register("hapo")
def hapo(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    c: float = 10.0,
    entropy_pivot: float = 0.8,
    clip_alpha: float = 1.0,
    adv_beta: float = 1.0,
    entropy: Tensor | None = None,
) -> PolicyLossOutput:
    """HAPO loss: dual-clip PPO with entropy-adaptive asymmetric clip bounds and advantage redistribution.

    "From Uniform to Heterogeneous: Tailoring Policy Optimization to Every Token's Nature" (HAPO,
    arXiv:2509.16591); facts and defaults from the authors' verl code and Qwen2.5-Math script
    (clip 0.2 / 0.2, clip_ratio_c 10, entropy_pivot 0.8, clip_alpha 1, adv_beta 1). With h the
    `hapo_entropy_score` of each action (``entropy``: Float[B,T], the policy's per-action entropy, which
    the trainer passes from ``ActionStats.entropy``; statistics over the valid actions of this call):

    - Asymmetric Adaptive Clipping: eps_lo = eps_low (1 - alpha h) where h <= 0 (confident tokens may be
      pushed down further), eps_hi = eps_high (1 + alpha h) where h > 0 (uncertain tokens may rise
      further); the other bound stays.
    - Differential Advantage Redistribution: A_h = A (1 + beta h); with the neutral zone
      1 - eps_lo / 2 < rho < 1 + eps_hi / 2, an uncertain token (h > 0) takes A inside and A_h outside it,
      a confident one (h <= 0) A_h inside and A outside (``adv_beta=0`` turns it off).
    - loss = max(-rho A', -clip(rho, 1 - eps_lo, 1 + eps_hi) A'), and for A' < 0 at most -c A' (dual clip).

    (our reading): the authors' code scales negative scores by 1 / min(d) (a negative number), which
    makes every score >= 0 and disables the low-entropy branch; we follow the paper (h in [-1, 1]).
    Without ``entropy`` it is a ValueError. ``clipped`` marks either clip.
    """
    _check_clip("hapo", eps_low, eps_high)
    if not c > 1.0:
        raise ValueError(f"hapo: c must be > 1, got {c!r}")
    for key, value in (("clip_alpha", clip_alpha), ("adv_beta", adv_beta)):
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ValueError(f"hapo: {key} must be in [0, 1], got {value!r}")
    if entropy is None:
        raise ValueError(
            "hapo: needs entropy (Float[B,T], the per-action entropy the policy's action_stats returns), "
            "which the trainer passes; this policy gives none"
        )
    m, adv, log_ratio = _prepare(logp, logp_old, advantages, mask)
    score = hapo_entropy_score(entropy, m, entropy_pivot).to(device=logp.device, dtype=logp.dtype)
    ratio = _exp_clamped(log_ratio)
    high = score > 0
    e_lo = eps_low * torch.where(high, torch.ones_like(score), 1.0 - clip_alpha * score)
    e_hi = eps_high * torch.where(high, 1.0 + clip_alpha * score, torch.ones_like(score))
    adv = adv.expand_as(logp)
    adv_h = adv * (1.0 + adv_beta * score)
    r = ratio.detach()
    neutral = (r > 1.0 - e_lo / 2) & (r < 1.0 + e_hi / 2)
    adv = torch.where(high, torch.where(neutral, adv, adv_h), torch.where(neutral, adv_h, adv))
    adv = torch.where(m, adv, torch.zeros_like(adv))
    unclipped = ratio * adv
    clipped_term = torch.minimum(torch.maximum(ratio, 1.0 - e_lo), 1.0 + e_hi) * adv
    clipped = m & (clipped_term < unclipped)
    ppo_loss = -torch.where(clipped, clipped_term, unclipped)
    cap = -adv * c
    dual = m & (adv < 0) & (ppo_loss > cap)
    loss = torch.where(dual, cap, ppo_loss)
    per_token = torch.where(m, loss, torch.zeros_like(loss))
    return PolicyLossOutput(per_token=per_token, clipped=clipped | dual, ratio=ratio)
