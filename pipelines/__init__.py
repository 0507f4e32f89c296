"""Domain pipelines: each module registers `build(cfg) -> TrainingSetup` under its name.

A pipeline owns what is special to its domain (policy construction, reward plugins, data, callbacks such as
curricula, the typed ``options:`` section) and nothing else: the training loop is
`mmalign.training.trainer.GroupTrainer`. It registers where it is defined, with
``@register_pipeline("my_pipeline", options=MyOptions)``. `DISCOVERY` finds pipelines lazily in this package's
modules and domain subpackages and in entry points of group ``mmalign.pipelines``; ``import pipelines``
imports nothing, `get` / `find` import only what a name needs, `names` everything, `refresh` forgets the
cache. Details: docs/architecture.md, "Pipelines"; a third-party pipeline: docs/extending.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mmalign import registry as _registry
from mmalign.registry import Discovery, PluginError, Registry

REGISTRY: Registry[Callable[..., Any]] = Registry("pipeline")

ENTRY_POINT_GROUP = "mmalign.pipelines"

DISCOVERY = Discovery(REGISTRY, __name__, ENTRY_POINT_GROUP)


@dataclass
class TrainingSetup:
    """What a pipeline hands to the trainer."""

    policy: Any
    rewards: Any
    """A `rewards.RewardSet`."""
    data: list[dict[str, Any]]
    """Training rows; each has a ``prompt`` and any other columns (all reach the rewards)."""
    callbacks: list[Any] = field(default_factory=list)
    """Objects with optional `on_step_end(trainer, step, metrics)`, `state_dict()`, `load_state_dict()`."""
    eval_data: list[dict[str, Any]] | None = None
    sample_columns: list[str] = field(default_factory=list)
    """Dataset columns written beside each sample in the run directory (e.g. the reference answer)."""


def register_pipeline(
    name: str, *, options: type | None = None, **meta: Any
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering ``build(cfg) -> TrainingSetup`` as pipeline `name`.

    `options`: the dataclass that validates the ``options:`` section of the pipeline's configs (its
    instance is ``cfg.options``); None: the pipeline takes no options section. Other keyword arguments are
    free metadata (`REGISTRY.meta(name)`)."""
    if options is not None and not (isinstance(options, type) and dataclasses.is_dataclass(options)):
        raise TypeError(f"@register_pipeline({name!r}): options must be a dataclass, got {options!r}")
    return REGISTRY.register(name, options=options, **meta)


def find(name: str) -> Mapping[str, Any] | None:
    """The registration metadata of pipeline `name` (``options``: its options class or None), importing only
    what is needed to find it; None if no source registers it. A broken entry point raises `PluginError`."""
    return REGISTRY.meta(name) if DISCOVERY.find(name) else None


def options_class(name: str) -> type | None:
    """The options dataclass pipeline `name` registered (None: none); `RegistryError` if unknown."""
    DISCOVERY.get(name)
    return REGISTRY.meta(name).get("options")


def get(name: str) -> Callable[..., Any]:
    """The ``build`` function of pipeline `name`, seeded: it seeds Python, NumPy and torch with ``cfg.seed``
    before building, so the random parts of model construction (a LoRA adapter's initial matrices) are the same
    in every process and every run of a config, whoever builds it (the CLI did this alone before). An unknown
    name raises `RegistryError` (a KeyError) listing close matches, the registered names and any entry point
    that failed to load."""
    build = DISCOVERY.get(name)

    @functools.wraps(build)
    def seeded_build(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        from mmalign.training.seeding import set_seed

        set_seed(int(getattr(cfg, "seed", 0)))
        return build(cfg, *args, **kwargs)

    return seeded_build


def names() -> list[str]:
    """Every pipeline name, from this package's modules and the ``mmalign.pipelines`` entry points
    (a broken entry point is skipped: see `load_errors`)."""
    return DISCOVERY.names()


def describe(name: str) -> str:
    DISCOVERY.get(name)
    return REGISTRY.describe(name)


def origin(name: str) -> str | None:
    """Where pipeline `name` came from when an entry point registered it (None: this package)."""
    return DISCOVERY.origins.get(name)


def load_errors() -> list[PluginError]:
    """The ``mmalign.pipelines`` entry points that failed to load so far."""
    return DISCOVERY.errors


def refresh() -> None:
    """Forget what discovery cached (entry-point list, which modules were scanned); the registry stays."""
    DISCOVERY.clear()


_registry.set_pipeline_finder(find)


def __getattr__(name: str) -> Any:
    """``pipelines.Components``, the former name of `TrainingSetup`, still resolves (with a DeprecationWarning)
    for third-party pipelines written against it."""
    if name == "Components":
        import warnings

        warnings.warn("pipelines.Components is now pipelines.TrainingSetup", DeprecationWarning, stacklevel=2)
        return TrainingSetup
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
