"""Domain pipelines: each module registers `build(cfg) -> Components` under its name.

A pipeline owns what is special to its domain (policy construction, reward plugins, data,
callbacks such as curricula) and nothing else: the training loop is `mmalign.trainer.GroupTrainer`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mmalign.registry import Registry

REGISTRY: Registry[Callable[..., Any]] = Registry("pipeline")

# Modules that register pipelines; imported lazily so `import pipelines` stays cheap.
_MODULES = [
    "pipelines.text_reasoning",
    "pipelines.vlm_reasoning",
    "pipelines.safe_diffusion",
    "pipelines.text_to_image",
]


@dataclass
class Components:
    """What a pipeline hands to the trainer."""

    policy: Any
    rewards: Any
    """A `rewards.RewardSet`."""
    data: list[dict[str, Any]]
    """Training rows; each has a ``prompt`` and any other columns (all reach the rewards)."""
    callbacks: list[Any] = field(default_factory=list)
    """Objects with optional `on_step_end(trainer, step, metrics)`, `state_dict()`, `load_state_dict()`."""
    eval_data: list[dict[str, Any]] | None = None


def register_pipeline(name: str, **meta: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return REGISTRY.register(name, **meta)


def _load_all() -> None:
    for mod in _MODULES:
        importlib.import_module(mod)


def get(name: str) -> Callable[..., Any]:
    _load_all()
    return REGISTRY.get(name)


def names() -> list[str]:
    _load_all()
    return REGISTRY.names()


def describe(name: str) -> str:
    _load_all()
    return REGISTRY.describe(name)
