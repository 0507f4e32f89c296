"""`mmalign.app.fixtures`: the tiny models a config names are built by the app layer, once, before the pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmalign.app import fixtures
from mmalign.config import config_from_dict


def test_the_policy_and_reward_models_a_config_names_are_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config_from_dict(
        {
            "pipeline": "safe_diffusion",
            "output_dir": str(tmp_path / "run"),
            "model": {"name_or_path": str(tmp_path / "policy"), "tiny_builder": "safe_diffusion"},
            "options": {"reward_models": {str(tmp_path / "clip"): "clip_tiny", str(tmp_path / "kept"): ""}},
            "rewards": [{"name": "format"}],
        }
    )
    assert fixtures.fixture_models(cfg) == [
        (str(tmp_path / "policy"), "safe_diffusion"),
        (str(tmp_path / "clip"), "clip_tiny"),
    ]
    built = []
    monkeypatch.setattr("mmalign.tiny.ensure_model", lambda path, builder: built.append((path, builder)))
    fixtures.ensure_fixtures(cfg)
    assert built == fixtures.fixture_models(cfg)


def test_a_config_without_tiny_models_builds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config_from_dict(
        {"pipeline": "text_reasoning", "output_dir": "runs/x", "rewards": [{"name": "format"}]}
    )
    monkeypatch.setattr("mmalign.tiny.ensure_model", lambda *a: pytest.fail("nothing to build"))
    assert fixtures.fixture_models(cfg) == []
    fixtures.ensure_fixtures(cfg)
