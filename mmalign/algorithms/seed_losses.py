"""Policy losses from the seed papers (docs/seeds.md), registered into `mmalign.algorithms.losses`: ``loss:target_entropy``.

Formulas: docs/algorithms.md; each docstring says where its formula comes from.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mmalign.algorithms import losses as loss_lib
from mmalign.algorithms.losses import PolicyLossOutput

__all__ = ["entropy_surrogate", "target_entropy"]


def entropy_surrogate(logp: Tensor, entropy: Tensor, mask: Tensor) -> Tensor:
    """Float[B,T]: (log pi(y_t) + H_t) log pi(y_t) with the first factor detached, 0 where ``mask`` is False.

    For an action sampled from pi its gradient is an unbiased estimate of -grad H (score function with the
    baseline -H: E_a[(log pi_a + H) grad log pi_a] = grad sum_a pi_a log pi_a), so minimising it raises the
    entropy and minimising its negative lowers it.
    """
    m = mask.bool()
    zero = torch.zeros_like(logp)
    lp = torch.where(m, logp, zero)
    h = torch.where(m, entropy.detach().to(logp), zero)
    return torch.where(m, (lp.detach() + h) * lp, zero)


@loss_lib.register("target_entropy")
def target_entropy(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    target: float = 0.5,
    coef: float = 0.01,
    entropy: Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clip plus Confucius3-Math's targeted entropy regularisation: entropy pushed toward ``target``.

    "Confucius3-Math" (arXiv:2506.18330), Targeted Entropy Regularization; (our design) the form, the
    report's formula and code being unavailable here: with Hbar the mean entropy of this call's valid actions
    (``entropy``: Float[B,T], the per-action entropy the trainer passes from ``ActionStats.entropy``) and
    s = sign(target - Hbar), loss_t = ppo_clip_t + coef s (log pi(y_t) + H_t) log pi(y_t) (the first factor
    detached; `entropy_surrogate`): below the target the entropy is raised, above it lowered, at it left
    alone. The regulariser is on-policy (no importance ratio). Without ``entropy`` it is a ValueError.
    """
    if not (math.isfinite(coef) and coef >= 0):
        raise ValueError(f"target_entropy: coef must be >= 0, got {coef!r}")
    if not (math.isfinite(target) and target >= 0):
        raise ValueError(f"target_entropy: target must be >= 0, got {target!r}")
    if entropy is None:
        raise ValueError(
            "target_entropy: needs entropy (Float[B,T], the per-action entropy the policy's action_stats "
            "returns), which the trainer passes; this policy gives none"
        )
    out = loss_lib.get("ppo_clip")(logp, logp_old, advantages, mask, eps_low=eps_low, eps_high=eps_high)
    m = mask.bool()
    h = torch.as_tensor(entropy).detach().to(device=logp.device, dtype=logp.dtype)
    if h.shape != logp.shape:
        raise ValueError(
            f"target_entropy: entropy must be Float[B,T] like logp {tuple(logp.shape)}, got {tuple(h.shape)}"
        )
    n = int(m.sum())
    if n == 0 or coef == 0:
        return out
    mean_h = float(torch.where(m, h, torch.zeros_like(h)).sum()) / n
    sign = (target > mean_h) - (target < mean_h)
    per_token = out.per_token + coef * sign * entropy_surrogate(logp, h, m)
    return PolicyLossOutput(per_token=per_token, clipped=out.clipped, ratio=out.ratio)
