"""Fixtures of the tool tests: `no_model` makes every way a command builds or loads a model raise."""

from __future__ import annotations

from typing import Any

import diffusers
import pytest
import transformers

import pipelines.safe_diffusion
import pipelines.text_reasoning
import pipelines.text_to_image
import pipelines.vlm_reasoning
import rewards.image
from mmalign import tiny


def _refuse(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a model was built or loaded, but the error should have been reported before")


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way a command builds or loads a model raises (so a test passes only if the error comes first)."""
    monkeypatch.setattr(tiny, "build", _refuse)
    monkeypatch.setattr(pipelines.text_reasoning, "build_text_policy", _refuse)
    monkeypatch.setattr(pipelines.vlm_reasoning, "build_vlm_policy", _refuse)
    monkeypatch.setattr(pipelines.text_to_image, "build_flow_policy", _refuse)
    monkeypatch.setattr(pipelines.safe_diffusion, "build_policy", _refuse)
    monkeypatch.setattr(rewards.image.CLIPEmbedder, "__init__", _refuse)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(_refuse))
    monkeypatch.setattr(diffusers.ModelMixin, "from_pretrained", classmethod(_refuse))
