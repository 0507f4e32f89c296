"""Steps that change a round after its rewards and before the estimator, chosen by the algorithm config.

A round hook sees one process's round (rollout, rewards, each sample's prompt id) and may re-roll or replace
samples; the trainer runs every hook `build_round_hooks` returns, in order, knowing only this interface. The
one built in is ``algorithm.group_refill`` (`mmalign.algorithms.group_refill.GroupRefill`: hints and replay
for all-fail groups). A hook's name is its key in a checkpoint (`state_dict` / `load_state_dict`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torch import Tensor

from mmalign.algorithms.group_refill import GroupRefill
from mmalign.config import Config
from mmalign.data.batch import Rollout
from mmalign.errors import ConfigError

__all__ = ["RoundHook", "RoundServices", "build_round_hooks"]


class RoundServices(Protocol):
    """What a hook may ask of the trainer: fresh scored samples and the current policy's log-probs."""

    def regenerate(self, rows: list[dict[str, Any]], size: int) -> tuple[Rollout, Tensor]: ...
    def current_logprobs(self, rollout: Rollout) -> Tensor: ...


class RoundHook(Protocol):
    """One step between the rewards and the estimator (see the module docstring)."""

    needs_logp_old: bool
    """The hook's samples need ``logp_old`` (e.g. replayed samples are importance-weighted)."""

    def after_rewards(
        self,
        rollout: Rollout,
        rewards: Tensor,
        prompt_ids: Sequence[int],
        rows: Sequence[dict[str, Any]],
        services: RoundServices,
    ) -> tuple[Rollout, Tensor, dict[str, float]]: ...

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _group_refill(cfg: Config, weights: list[float]) -> GroupRefill | None:
    opts = cfg.algorithm.group_refill
    if not opts:
        return None
    try:
        return GroupRefill(**opts, success_threshold=cfg.data.success_threshold, weights=weights)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{cfg.source}: key 'algorithm.group_refill': {e}") from None


HOOKS: dict[str, Callable[[Config, list[float]], RoundHook | None]] = {"group_refill": _group_refill}
"""Checkpoint name -> factory from (config, reward weights); None when the config leaves the hook off."""


def build_round_hooks(cfg: Config, weights: list[float]) -> dict[str, RoundHook]:
    """The hooks `cfg` turns on, by name, in the order they run (a `ConfigError` names a bad key)."""
    built = {name: make(cfg, weights) for name, make in HOOKS.items()}
    return {name: hook for name, hook in built.items() if hook is not None}
