"""The family registry (`mmalign.policies.families`): which policy class a folder or hub id gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmalign.errors import ConfigError
from mmalign.policies import families
from mmalign.policies.families import Family, family_for, policy_class_for, register_family


def _folder(root: Path, pipeline: str | None = None, transformer: str | None = None) -> Path:
    root.mkdir(parents=True)
    if pipeline:
        (root / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    if transformer:
        (root / "transformer").mkdir()
        (root / "transformer" / "config.json").write_text(json.dumps({"_class_name": transformer}))
    return root


def test_pipeline_class_decides_and_another_task_is_refused(tmp_path: Path) -> None:
    flux = _folder(tmp_path / "f", "FluxPipeline", "FluxTransformer2DModel")
    kontext = _folder(tmp_path / "k", "FluxKontextPipeline", "FluxTransformer2DModel")
    assert family_for(flux, "text_to_image").name == "flux"
    assert family_for(kontext, "image_edit").name == "flux_kontext"
    with pytest.raises(ConfigError, match="FluxKontextPipeline model .*image_edit"):
        family_for(kontext, "text_to_image")
    unknown = _folder(tmp_path / "u", "SomeNewPipeline")
    with pytest.raises(ConfigError, match="model_index.json names SomeNewPipeline.*register_family"):
        family_for(unknown, "text_to_image")


def test_transformer_class_then_hub_hints_then_default(tmp_path: Path) -> None:
    qwen = _folder(tmp_path / "q", transformer="QwenImageTransformer2DModel")
    assert family_for(qwen, "text_to_image").name == "qwen_image"
    assert family_for(qwen, "image_edit").name == "qwen_image_edit"
    # the longest hint wins: an edit id is not Qwen-Image, a Kontext id is not FLUX.1
    assert family_for("Qwen/Qwen-Image-Edit", "image_edit").name == "qwen_image_edit"
    assert family_for("black-forest-labs/FLUX.1-Kontext-dev", "image_edit").name == "flux_kontext"
    assert family_for("black-forest-labs/FLUX.1-dev", "text_to_image").name == "flux"
    assert family_for("stabilityai/stable-diffusion-3.5-medium", "text_to_image").name == "sd3"
    assert family_for("someone/unnamed-model", "text_to_image").name == "sd3"  # the task's default
    with pytest.raises(ConfigError, match="trained by the image_edit task"):
        family_for("Qwen/Qwen-Image-Edit", "text_to_image")


def test_a_third_party_family_is_one_registration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(families, "_FAMILIES", dict(families._FAMILIES))
    register_family(
        Family(
            "toy",
            "text_to_image",
            "mmalign.policies.sd3:SD3Policy",
            pipelines=("ToyPipeline",),
            hints=("toy",),
        )
    )
    folder = _folder(tmp_path / "t", "ToyPipeline")
    assert family_for(folder, "text_to_image").name == "toy"
    assert policy_class_for("org/toy-model", "text_to_image").__name__ == "SD3Policy"
    with pytest.raises(ValueError, match="already the default"):
        register_family(Family("toy2", "text_to_image", "x:Y", default=True))
    with pytest.raises(ValueError, match="task 'audio'"):
        register_family(Family("toy3", "audio", "x:Y"))


def test_a_hub_id_is_decided_by_its_cached_model_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached = tmp_path / "model_index.json"
    cached.write_text(json.dumps({"_class_name": "QwenImagePipeline"}))

    def fake_cache(repo_id: str, filename: str) -> str | None:
        return str(cached) if (repo_id, filename) == ("org/plain-name", "model_index.json") else None

    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", fake_cache)
    assert family_for("org/plain-name", "text_to_image").name == "qwen_image"
