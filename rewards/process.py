"""`sampler_process_reward`: the per-step process rewards a guided sampler recorded while sampling.

A policy that evaluates a process reward at every denoising step anyway (Euphonium's guided SDE,
`pipelines.video.euphonium.GuidedWanPolicy`) stores the values in ``rollout.outputs["process_rewards"]``, Float[B, T]
with one column per trained action (NaN where no value was recorded). This reward hands them to the trainer as a
process reward (``per_step = True``), so that an estimator taking step rewards (``grpo_process``: the outcome
advantage per group plus the process advantage per group and step) uses them, without evaluating the reward
model a second time.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Reward, RewardBatch, register_reward

__all__ = ["SamplerProcessReward"]


@register_reward("sampler_process_reward")
class SamplerProcessReward(Reward):
    """Per-step process rewards recorded by the sampler (``outputs["process_rewards"]``, Float[B, T])."""

    needs = {"process_rewards"}
    per_step = True

    def __init__(self, *, scale: float = 1.0) -> None:
        self.scale = float(scale)
        self.last_metrics: dict[str, float] = {}

    def __call__(self, batch: RewardBatch) -> Tensor:
        if "process_rewards" not in batch.outputs:
            raise KeyError(
                "reward 'sampler_process_reward' needs outputs['process_rewards'] (Float[B, T]), which only a "
                "policy that records process rewards while sampling provides (pipeline euphonium); outputs: "
                f"{sorted(batch.outputs) or 'none'}"
            )
        values = torch.as_tensor(batch.outputs["process_rewards"], dtype=torch.float32)
        n = len(batch)
        t = batch.mask.shape[1] if batch.mask is not None else values.shape[-1]
        if values.shape != (n, t):
            raise ValueError(f"outputs['process_rewards'] must be Float[{n}, {t}], got {tuple(values.shape)}")
        finite = values[torch.isfinite(values)]
        self.last_metrics = {"recorded_frac": float(finite.numel() / max(1, values.numel()))}
        return values * self.scale
