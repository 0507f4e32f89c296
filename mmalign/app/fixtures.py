"""The tiny models a config names, built once by the app layer before its pipeline runs.

A config may name a tiny builder for its policy (``model.tiny_builder``) and for reward models
(``options.reward_models``: folder -> builder, in the pipelines that score with a model). `ensure_fixtures` builds
each missing folder with `mmalign.tiny.ensure_model` (once, under a lock, for every process of a launch), so
pipelines load every model through ``from_pretrained`` alone and never import the fixture floor.
"""

from __future__ import annotations

from typing import Any

from mmalign.config import Config

__all__ = ["ensure_fixtures", "fixture_models"]


def fixture_models(cfg: Config) -> list[tuple[str, str]]:
    """(folder, builder) of every tiny model `cfg` names: the policy's, then the reward models'."""
    out = []
    if cfg.model.tiny_builder:
        out.append((str(cfg.model.name_or_path), str(cfg.model.tiny_builder)))
    reward_models: Any = getattr(cfg.options, "reward_models", None)
    if reward_models is None and isinstance(cfg.options, dict):
        reward_models = cfg.options.get("reward_models")
    for path, builder in dict(reward_models or {}).items():
        if builder:
            out.append((str(path), str(builder)))
    return out


def ensure_fixtures(cfg: Config) -> None:
    """Build every missing tiny model `cfg` names (`fixture_models`); an existing folder is used as it is."""
    if not fixture_models(cfg):
        return
    from mmalign.tiny import ensure_model

    for path, builder in fixture_models(cfg):
        ensure_model(path, builder)
