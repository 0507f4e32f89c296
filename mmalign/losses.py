"""Policy losses, aggregation modes and KL estimators (see docs/algorithms.md, "Policy losses").

Three registries:

- ``REGISTRY`` (policy losses; ``get``/``names``/``register`` act on it)::

      fn(logp, logp_old, advantages, mask, **options) -> PolicyLossOutput

  ``logp`` Float[B, T] carries grad; ``logp_old`` Float[B, T] does not (it is detached here
  anyway); ``advantages`` is Float[B] (one per sample, broadcast over its actions) or Float[B, T];
  ``mask`` Bool[B, T] marks valid actions. The output's ``per_token`` is the loss per action,
  exactly 0 where ``mask`` is False, ``clipped`` marks where a clip is active (for clip_frac
  logging) and ``ratio`` is the importance ratio.
- ``AGGREGATIONS`` (``aggregate(per_token, mask, mode, ...)`` reduces per-action losses to a scalar).

A loss registered with ``couples_actions=True`` (``gspo``: one ratio per sample from all its actions) cannot be
evaluated on a part of a sample's actions; the trainer then scores a microbatch's actions in one piece even
when the policy offers chunks (`mmalign.policies.base.Policy.action_chunks`).
- ``KL_ESTIMATORS`` (``kl(logp, logp_ref, estimator)`` gives a per-action KL estimate).

Numerical safety: wherever a log-ratio is exponentiated it is first clamped to [-20, 20]
(exp(20) ~ 4.9e8), so a stale or corrupted log-prob cannot overflow to inf; outside that band
the gradient through the clamp is 0. Masked-out positions never contribute, even if their
log-probs are NaN or -inf: they are replaced by 0 before any arithmetic, so fully masked rows give
0 loss and 0 gradient, never NaN.

Options are keyword-only; an unknown option raises TypeError naming the loss and the option.
"""

from __future__ import annotations

import inspect
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


# the losses of mmalign/losses_extra.py register themselves into REGISTRY (etr, reg_grpo)
from mmalign import losses_extra as _losses_extra  # noqa: E402, F401
