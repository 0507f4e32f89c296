"""Truncated importance sampling (TIS) for the rollout-engine / trainer mismatch.

When an engine (vLLM) or an asynchronous rollout worker samples, the behaviour policy is not the trainer's
pi_old even with identical weights. The PPO ratio is taken against the trainer's own recomputed ``logp_old``,
and the gap is corrected by a detached, truncated weight per token (``level="token"``) or per sample
(``"sequence"``), w = min(exp(logp_old - logp_behaviour), C) with C = ``cap``, exactly 0 on masked positions
and overflow-free. Formulas, references and metrics: docs/algorithms.md, "Importance-sampling correction for
rollout engines".
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0
Level = Literal["token", "sequence"]


def _check(logp_trainer_old: Tensor, logp_engine: Tensor, mask: Tensor, level: str, cap: float) -> Tensor:
    if logp_trainer_old.dim() != 2:
        raise ValueError(f"logp_trainer_old must be Float[B, T], got shape {tuple(logp_trainer_old.shape)}")
    if logp_engine.shape != logp_trainer_old.shape or mask.shape != logp_trainer_old.shape:
        raise ValueError(
            f"logp_trainer_old {tuple(logp_trainer_old.shape)}, logp_engine {tuple(logp_engine.shape)} and "
            f"mask {tuple(mask.shape)} must have the same shape"
        )
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"cap must be a finite number > 0, got {cap!r}")
    return mask.to(device=logp_trainer_old.device, dtype=torch.bool)


def log_ratio(logp_trainer_old: Tensor, logp_engine: Tensor, mask: Tensor) -> Tensor:
    """Float[B,T] logp_trainer_old − logp_engine (at least fp32, detached), 0 where ``mask`` is False."""
    mask = mask.to(device=logp_trainer_old.device, dtype=torch.bool)
    dtype = torch.promote_types(torch.promote_types(logp_trainer_old.dtype, logp_engine.dtype), torch.float32)
    diff = logp_trainer_old.detach().to(dtype) - logp_engine.detach().to(
        device=logp_trainer_old.device, dtype=dtype
    )
    return torch.where(mask, diff, torch.zeros_like(diff))


def tis_weights(
    logp_trainer_old: Tensor,
    logp_engine: Tensor,
    mask: Tensor,
    *,
    level: Level = "token",
    cap: float = 2.0,
) -> Tensor:
    """Truncated importance weights Float[B,T] (see the module docstring); detached, 0 where masked.

    ``logp_trainer_old``: the trainer's log-probs of the sampled tokens under the weights that
    sampled them; ``logp_engine``: the engine's log-probs of the same tokens; ``mask``: valid tokens.
    ``level="token"``: one weight per token; ``"sequence"``: one weight per sample from the summed
    log-ratio, broadcast over its valid tokens. Returned in the dtype of ``logp_trainer_old``.
    """
    mask = _check(logp_trainer_old, logp_engine, mask, level, cap)
    diff = log_ratio(logp_trainer_old, logp_engine, mask)
    log_cap = math.log(cap)
    if level == "token":
        w = torch.exp(diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).clamp(max=log_cap))
    else:
        seq = diff.sum(dim=1, keepdim=True)
        w = torch.exp(seq.clamp(max=log_cap)).expand_as(diff)
    w = torch.where(mask, w, torch.zeros_like(w))
    return w.to(logp_trainer_old.dtype).detach()


def apply_is_weights(per_token_loss: Tensor, weights: Tensor) -> Tensor:
    """``per_token_loss * weights`` with the weights detached (the loss keeps its own gradient).

    Multiply the policy loss *before* aggregation (``losses.aggregate``); the KL penalty is usually
    left unweighted. Masked positions stay 0 (the weights are 0 there)."""
    if weights.shape != per_token_loss.shape:
        raise ValueError(
            f"weights {tuple(weights.shape)} and per_token_loss {tuple(per_token_loss.shape)} must have the same shape"
        )
    return per_token_loss * weights.detach().to(device=per_token_loss.device, dtype=per_token_loss.dtype)


@torch.no_grad()
def is_metrics(
    logp_trainer_old: Tensor,
    logp_engine: Tensor,
    mask: Tensor,
    *,
    level: Level = "token",
    cap: float = 2.0,
    weights: Tensor | None = None,
) -> dict[str, float]:
    """Logging for the engine/trainer mismatch, over valid tokens (``prefix is/``):

    - ``is/weight_mean``: mean truncated weight
    - ``is/capped_frac``: share of valid tokens whose untruncated weight exceeds ``cap``
      (level="sequence": share of samples with at least one valid token)
    - ``is/abs_dlogp_mean``: mean |logp_trainer_old − logp_engine| (0 when engine and trainer agree)
    - ``is/abs_dlogp_max``: the largest |Δlogp|
    """
    mask = _check(logp_trainer_old, logp_engine, mask, level, cap)
    if weights is None:
        weights = tis_weights(logp_trainer_old, logp_engine, mask, level=level, cap=cap)
    diff = log_ratio(logp_trainer_old, logp_engine, mask)
    n_tok = int(mask.sum())
    if n_tok == 0:
        return {
            "is/weight_mean": 0.0,
            "is/capped_frac": 0.0,
            "is/abs_dlogp_mean": 0.0,
            "is/abs_dlogp_max": 0.0,
        }
    log_cap = math.log(cap)
    if level == "token":
        capped_frac = float((diff > log_cap)[mask].float().mean())
    else:
        has = mask.any(dim=1)
        capped_frac = float((diff.sum(dim=1) > log_cap)[has].float().mean())
    return {
        "is/weight_mean": float(weights.float()[mask].mean()),
        "is/capped_frac": capped_frac,
        "is/abs_dlogp_mean": float(diff.abs()[mask].mean()),
        "is/abs_dlogp_max": float(diff.abs()[mask].max()),
    }
