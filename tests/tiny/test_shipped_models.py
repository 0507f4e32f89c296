"""The tiny models shipped in ``assets/models/`` (so a fresh clone reaches step 1 in seconds): every tiny config's
model and reward-model folders are there, each records the builder the config names with that builder's
default arguments (``mmalign_tiny.json``), and each loads through its pipeline's own ``from_pretrained`` path.
``mmalign tiny build NAME`` rebuilds one."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import yaml

from mmalign import tiny
from mmalign.app.cli import tiny_model_paths
from mmalign.config import load_config

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIGS = sorted((REPO / "configs").glob("*-tiny.yaml"))


def _shipped() -> dict[str, str]:
    import os

    here = Path.cwd()
    os.chdir(REPO)
    try:
        return tiny_model_paths()
    finally:
        os.chdir(here)


def test_every_tiny_config_has_its_models_shipped() -> None:
    paths = _shipped()
    assert len(TINY_CONFIGS) >= 9 and len(paths) >= 9
    for config in TINY_CONFIGS:
        model = (yaml.safe_load(config.read_text()) or {})["model"]
        assert (
            model["name_or_path"] == paths[model["tiny_builder"]] or (REPO / model["name_or_path"]).is_dir()
        ), config.name
    for builder, path in paths.items():
        folder = REPO / path
        assert folder.is_dir(), f"{path} (builder {builder}) is not shipped: mmalign tiny build {builder}"


@pytest.mark.parametrize("builder", sorted(_shipped()))
def test_a_shipped_model_records_its_builder_and_its_default_arguments(builder: str) -> None:
    folder = REPO / _shipped()[builder]
    meta = json.loads((folder / "mmalign_tiny.json").read_text())
    assert meta["builder"] == builder
    registered = tiny.get_builder(builder)
    # a registered builder may be a thin wrapper calling the module's `build_<name>(path, **defaults)`
    full = getattr(inspect.getmodule(registered), f"build_{builder}", registered)
    params = inspect.signature(full).parameters
    compared = 0
    for name, p in params.items():
        if name in meta and p.default is not inspect.Parameter.empty:
            value = list(p.default) if isinstance(p.default, tuple) else p.default
            assert meta[name] == value, (
                f"{folder.name}: {name} = {meta[name]!r}, the builder's default {value!r}"
            )
            compared += 1
    options = meta.get("options")
    assert compared > 0 or options == {}, f"{folder.name} records none of its builder's arguments"


@pytest.mark.parametrize("config", [c.name for c in TINY_CONFIGS])
def test_a_tiny_config_loads_its_shipped_model_without_building(
    config: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipelines

    def refuse(*args, **kwargs):
        raise AssertionError("a shipped tiny model was rebuilt")

    monkeypatch.setattr(tiny, "build", refuse)
    monkeypatch.chdir(REPO)
    cfg = load_config(f"configs/{config}")
    setup = pipelines.get(cfg.pipeline)(cfg)
    assert setup.policy.trainable_parameters()
