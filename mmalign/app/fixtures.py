"""The tiny models a config names, built once by the app layer before its pipeline runs.

A config may name a tiny builder for its policy (``model.tiny_builder``) and for reward models
(``options.reward_models``: folder -> builder, in the pipelines that score with a model). `ensure_fixtures` builds
each missing folder with `mmalign.tiny.ensure_model` (once, under a lock, for every process of a launch), so
pipelines load every model through ``from_pretrained`` alone and never import the fixture floor.

The builders (the `mmalign.tiny` package, with the shapes world and its rewards) come with a source checkout
(``pip install -e .``) and are left out of the built wheel (pyproject.toml); on a wheel install a config that
names one is a `FixturesUnavailableError` saying so (`check_fixtures_available`), before anything is built.
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

from mmalign.config import Config
from mmalign.errors import MmalignError

__all__ = [
    "FixturesUnavailableError",
    "check_fixtures_available",
    "ensure_fixtures",
    "fixture_models",
    "fixtures_installed",
    "require_fixtures",
]

FIXTURES_PACKAGE = "mmalign.tiny"


class FixturesUnavailableError(MmalignError, ImportError):
    """A config names a tiny builder, but the offline fixtures (`mmalign.tiny`) are not installed: the wheel
    leaves them out; a source checkout has them. An ImportError too (the CLI prints it as one line)."""


def fixture_models(cfg: Config) -> list[tuple[str, str]]:
    """(folder, builder) of every tiny model `cfg` names: the policy's, then the reward models'."""
    out = []
    if cfg.model.tiny_builder:
        out.append((str(cfg.model.name_or_path), str(cfg.model.tiny_builder)))
    for path, builder in _reward_models(cfg).items():
        if builder:
            out.append((str(path), str(builder)))
    return out


def _reward_models(cfg: Config) -> dict[str, Any]:
    reward_models: Any = getattr(cfg.options, "reward_models", None)
    if reward_models is None and isinstance(cfg.options, dict):
        reward_models = cfg.options.get("reward_models")
    return dict(reward_models or {})


def check_fixtures_available(cfg: Config) -> None:
    """Nothing when `cfg` names no tiny builder or `mmalign.tiny` can be imported; else a
    `FixturesUnavailableError` naming the config file, the keys that name builders and what to do."""
    if fixture_models(cfg) and not fixtures_installed():
        raise FixturesUnavailableError(_unavailable_message(cfg))


def fixtures_installed() -> bool:
    """Whether `mmalign.tiny` can be imported (a source checkout) or not (the wheel)."""
    try:
        return find_spec(FIXTURES_PACKAGE) is not None
    except ModuleNotFoundError:  # pragma: no cover - mmalign itself is importable here
        return False


def require_fixtures(command: str) -> None:
    """Nothing on a source checkout; on a wheel install (no `mmalign.tiny`) a `FixturesUnavailableError` saying
    that `command` needs the offline fixtures of a source checkout."""
    if not fixtures_installed():
        raise FixturesUnavailableError(
            f"{command} needs the offline fixtures ({FIXTURES_PACKAGE}: the tiny model builders), which come "
            "only with a source checkout, not with the mmalign wheel installed here: install from a clone of the "
            "repository (`pip install -e .` in it)"
        )


def _unavailable_message(cfg: Config) -> str:
    keys = []
    if cfg.model.tiny_builder:
        keys.append(f"model.tiny_builder ({cfg.model.tiny_builder!r})")
    if any(_reward_models(cfg).values()):
        keys.append("options.reward_models")
    return (
        f"{cfg.source}: {' and '.join(keys)} {'names a tiny model' if len(keys) == 1 else 'name tiny models'} "
        f"built by the offline fixtures ({FIXTURES_PACKAGE}: the tiny model builders, the shapes world and its "
        "rewards), which come only with a source checkout, not with the mmalign wheel installed here: install "
        "from a clone of the repository (`pip install -e .` in it), or point model.name_or_path at a real model "
        "folder or hub id and remove model.tiny_builder"
    )


def ensure_fixtures(cfg: Config) -> None:
    """Build every missing tiny model `cfg` names (`fixture_models`); an existing folder is used as it is.
    Without `mmalign.tiny` (a wheel install): `FixturesUnavailableError` (`check_fixtures_available`)."""
    if not fixture_models(cfg):
        return
    check_fixtures_available(cfg)
    from mmalign.tiny import ensure_model

    for path, builder in fixture_models(cfg):
        ensure_model(path, builder)
