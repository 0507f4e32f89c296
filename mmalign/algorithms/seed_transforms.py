"""Reward transforms from the seed papers (docs/seeds.md), registered into `mmalign.algorithms.reward_transforms`:
``transform:grpo_s``. Formulas: docs/algorithms.md.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mmalign.algorithms import reward_transforms as rt_lib
from mmalign.algorithms.advantages import group_index

__all__ = ["grpo_s"]


@rt_lib.register("grpo_s", columnwise=False)
def grpo_s(rewards: Tensor, group: Tensor, *, beta: float = 1.0) -> Tensor:
    """GRPO-S (DR-IRL) model-level responsiveness scaling: rewards of unresponsive prompts are scaled up.

    "Inverse Reinforcement Learning with Dynamic Reward Scaling for LLM Alignment" (DR-IRL, GRPO-S); (our
    design) from the abstract ("model-level responsiveness measured by reward gaps"): with gap_q = max - min of
    prompt q's valid rewards and gap_max the largest gap of the batch, r'_i = (1 + beta (1 - gap_q /
    gap_max)) r_i (all gaps 0: factor 1 + beta). The data-level hardness (CLIP similarity of the prompt to its
    category) is a dataset column, which transforms do not see: not built. NaN stays NaN.
    """
    if not (math.isfinite(beta) and beta >= 0):
        raise ValueError(f"grpo_s: beta must be >= 0, got {beta!r}")
    valid = torch.isfinite(rewards)
    gid, n_groups = group_index(group, rewards.shape[0], rewards.device)
    neg = torch.full((n_groups,), -math.inf, dtype=rewards.dtype, device=rewards.device)
    hi = neg.scatter_reduce(0, gid, torch.where(valid, rewards, torch.full_like(rewards, -math.inf)), "amax")
    lo = (-neg).scatter_reduce(
        0, gid, torch.where(valid, rewards, torch.full_like(rewards, math.inf)), "amin"
    )
    gap = torch.where(torch.isfinite(hi) & torch.isfinite(lo), hi - lo, torch.zeros_like(hi))
    top = float(gap.max()) if gap.numel() else 0.0
    scale = 1.0 + beta * (1.0 - (gap / top if top > 0 else torch.zeros_like(gap)))
    return torch.where(valid, rewards * scale[gid], rewards)
