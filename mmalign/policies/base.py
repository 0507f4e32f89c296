"""The interface every policy (model family) implements; see docs/architecture.md, "Policies"."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from mmalign.batch import Rollout


@dataclass
class ActionStats:
    """What `Policy.evaluate` returns for a minibatch: per-action quantities, with grad on `logp`."""

    logp: Tensor
    """Float[B,T] log-probs of the stored actions under the current policy (carries grad)."""
    entropy: Tensor | None = None
    """Float[B,T] per-action entropy where cheap to compute (no grad needed)."""
    kl: Tensor | None = None
    """Float[B,T] KL to the reference computed by the policy itself (diffusion: mean difference)."""


@runtime_checkable
class Policy(Protocol):
    """A model family that can sample groups and re-score its own samples."""

    model: torch.nn.Module

    def rollout(self, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool) -> Rollout:
        """Sample `group_size` outputs for each row's prompt without grad.

        `rows` are dataset rows (dicts) that carry at least a ``prompt``; every column reaches the
        rewards through `Rollout.columns`. `compute_logp` asks for `logp_old` (needed when a rollout
        is reused for more than one optimizer step)."""
        ...

    def evaluate(self, rollout: Rollout) -> ActionStats:
        """Recompute per-action log-probs of `rollout` with grad."""
        ...

    def reference_logprobs(self, rollout: Rollout) -> Tensor:
        """Per-action log-probs under the reference model (no grad)."""
        ...

    def trainable_parameters(self) -> list[torch.nn.Parameter]: ...

    def trainable_state_dict(self) -> dict[str, Tensor]: ...

    def load_trainable_state_dict(self, state: dict[str, Tensor]) -> None: ...

    def save(self, path: str | Path) -> None:
        """Export for use outside mmalign (`from_pretrained`-loadable; adapters for LoRA)."""
        ...
