"""The `vlm_reasoning` pipeline and the shared pipeline helpers it uses (`pipelines.common`): `build(cfg)` with
a random tiny Qwen2-VL, the image-size options reaching the policy, and the typed options accessor."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from mmalign.config import load_config
from mmalign.policies.vlm import VLMPolicy
from pipelines.common import VLMOptions, options
from pipelines.vlm_reasoning import build

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "vlm_reasoning-tiny.yaml"


def test_build_gives_a_vlm_policy_with_the_configured_pixel_bounds(random_vlm_model_dir: Path) -> None:
    cfg = load_config(
        CONFIG,
        [
            f"model.name_or_path={random_vlm_model_dir}",
            "model.tiny_builder=null",
            "options.min_pixels=3136",
            "options.max_pixels=12544",
        ],
    )
    built = build(cfg)
    assert isinstance(built.policy, VLMPolicy)
    size = built.policy.processor.image_processor.size
    assert (size["shortest_edge"], size["longest_edge"]) == (3136, 12544)
    assert built.data and all(r["images"] and Path(r["images"][0]).is_file() for r in built.data)
    assert built.rewards.names == [r.alias or r.name for r in cfg.rewards]


def test_options_returns_the_validated_section_defaults_or_a_type_error() -> None:
    cfg = load_config(CONFIG, ["options.max_pixels=999"])
    assert isinstance(cfg.options, VLMOptions)
    assert options(cfg, VLMOptions) is cfg.options and options(cfg, VLMOptions).max_pixels == 999
    cfg.options = None
    assert options(cfg, VLMOptions) == VLMOptions()

    @dataclass
    class Other:
        x: int = 1

    cfg.options = Other()
    with pytest.raises(TypeError, match="VLMOptions"):
        options(cfg, VLMOptions)
