"""`mmalign plan` of HunyuanVideo 1.5 image to video (`family_plans.HUNYUAN_VIDEO15_I2V_PLAN`): the context gains the
first frame's SigLIP tokens (hand-worked from the image encoder's config), and the planned forward + backward peak
of the denoiser on those inputs is checked against torch's CPU profiler on a real model of that architecture."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mmalign.app import plan as plan_mod
from mmalign.app.plan_models import param_bytes, resolve_model, spec_from_folder
from mmalign.config import config_from_dict
from mmalign.policies.families import PlanRequest, plan_family
from tests.app.test_plan_families import HUNYUAN_SMALL, HUNYUAN_VAE

REPO = Path(__file__).resolve().parents[2]
TRANSFORMER = {**HUNYUAN_SMALL, "task_type": "i2v"}
"""The 2-block text-to-video test transformer of test_plan_families as the image-to-video task."""
VAE = HUNYUAN_VAE
SIGLIP = {"_class_name": "SiglipVisionModel", "model_type": "siglip_vision_model", "hidden_size": 16}
OPTIONS = {"num_frames": 9, "height": 64, "width": 64, "max_sequence_length": 40, "glyph_max_length": 16}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An I2V folder's configs: the transformer, the VAE and a SigLIP of 64 px in 16 px patches (16 tokens)."""
    root = tmp_path_factory.mktemp("models") / "hunyuan-i2v-small"
    parts = {
        "transformer": TRANSFORMER,
        "vae": VAE,
        "image_encoder": {**SIGLIP, "image_size": 64, "patch_size": 16},
    }
    for name, config in parts.items():
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text(json.dumps(config))
    (root / "model_index.json").write_text(json.dumps({"_class_name": "HunyuanVideo15ImageToVideoPipeline"}))
    return root


def _request(folder: Path) -> tuple[Any, PlanRequest]:
    spec = spec_from_folder(folder, str(folder))
    family = plan_family(folder, spec.components[spec.denoiser].cls, "video")
    components = {k: v.config for k, v in spec.components.items()}
    return family, PlanRequest(OPTIONS, components, spec.denoiser, family.task)


def test_shapes_add_the_siglip_tokens(folder: Path) -> None:
    """9 frames at 64 x 64: 5 latent frames of 16 x 16 = 1280 video tokens; the context is 40 prompt + 16 glyph +
    (64 / 16)^2 = 16 image tokens; without an image encoder config, the pipeline's 729."""
    family, req = _request(folder)
    assert family.name == "hunyuan_video15_i2v"
    sh = family.plan_spec().shapes(req)
    assert sh.latent == (4, 5, 16, 16) and sh.image_tokens == 1280 and sh.pixels == (9, 3, 64, 64)
    assert sh.text_parts == (40, 16, 16) and sh.text_tokens == 72
    bare = PlanRequest(
        OPTIONS, {k: v for k, v in req.components.items() if k != "image_encoder"}, "transformer", "video"
    )
    assert family.plan_spec().shapes(bare).text_parts == (40, 16, 729)
    inputs = family.plan_spec().inputs(req.config, sh, 2, torch.float32)
    assert inputs["image_embeds"].shape == (2, 16, 16) and inputs["encoder_hidden_states"].shape == (
        2,
        40,
        32,
    )
    assert inputs["hidden_states"].shape == (2, 9, 5, 16, 16)


def test_planned_peak_within_15_percent(folder: Path) -> None:
    """The planner's recording of one forward + backward (full fine-tuning, fp32, the family's inputs: 16 valid
    image tokens) against torch's CPU profiler on a real model with random non-zero image states: the peak bytes
    beyond the weights within 15% (as the text-to-video check), and the same parameter bytes."""
    from diffusers import HunyuanVideo15Transformer3DModel

    cfg = config_from_dict(
        {
            "pipeline": "image_to_video",
            "output_dir": str(folder.parent / "run"),
            "model": {"name_or_path": str(folder), "dtype": "float32", "lora": {"enabled": False}},
            "data": {"train": str(REPO / "assets/image_to_video/train.jsonl")},
            "rollout": {"group_size": 2, "prompts_per_step": 1},
            "rewards": [{"name": "flicker"}],
            "trainer": {"steps": 1, "cpu": True},
            "options": {k: v for k, v in OPTIONS.items() if k != "glyph_max_length"} | {"num_steps": 2},
        },
        "test_plan_hunyuan_video15_i2v",
    )
    spec = resolve_model(str(folder))
    den = plan_mod.denoiser_family(cfg, spec)
    assert den.family.name == "hunyuan_video15_i2v"
    sample = plan_mod.diffusion_shapes(cfg, spec).sample
    config = spec.components[spec.denoiser].config
    meta = plan_mod.diffusion_model(cfg, spec, torch.float32)
    rec, _flops, _kept = plan_mod.denoiser_pass(
        meta, config, den, sample, 1, torch.float32, grad=True, steps=1
    )
    planned = rec.peaks["train"].total

    torch.manual_seed(0)
    real = HunyuanVideo15Transformer3DModel.from_config(config).float().train()
    g = torch.Generator().manual_seed(0)
    x: dict[str, Any] = {}
    for k, v in den.plan.inputs(config, sample, 1, torch.float32).items():
        if not isinstance(v, torch.Tensor):
            x[k] = v
        elif k == "timestep":
            x[k] = torch.full(v.shape, 500.0)
        elif "mask" in k:
            x[k] = torch.ones(v.shape)
        else:  # latents, prompt states and the (non-zero) image states
            x[k] = torch.randn(v.shape, generator=g)

    def step() -> None:
        real(**x)[0].float().mean().backward()

    step()  # warm-up: lazily built buffers (rotary tables) and the first gradients
    real.zero_grad(set_to_none=True)
    gc.collect()
    measured = plan_mod.profiled_alloc_peak(step)
    assert abs(planned / measured - 1) <= 0.15, (planned / 2**20, measured / 2**20)
    assert param_bytes(meta) == sum(p.numel() * p.element_size() for p in real.parameters())


def test_real_config_plans_from_the_table() -> None:
    """configs/image_to_video-hunyuan.yaml plans offline: the table's I2V transformer builds at the published 8.3B
    parameters; 33 frames at 480 x 848 give 9 latent frames of 30 x 53 (14,310 tokens); the context is 1000 prompt
    + 256 glyph + (384 / 14)^2 = 729 SigLIP tokens; guidance 6 runs two CFG branches."""
    import pipelines
    from mmalign.app.plan_models import build_meta, param_numel
    from mmalign.config import load_config

    cfg = load_config(str(REPO / "configs/image_to_video-hunyuan.yaml"), [], pipeline_finder=pipelines.find)
    spec = resolve_model(cfg.model.name_or_path)
    assert spec.origin == "table" and "image_encoder" in spec.components
    n = param_numel(build_meta(spec.components[spec.denoiser], torch.bfloat16))
    assert abs(n / 8.3e9 - 1) <= 0.05, n
    sh = plan_mod.diffusion_shapes(cfg, spec)
    assert sh.latent == (32, 9, 30, 53) and sh.image_tokens == 9 * 30 * 53
    assert sh.sample.text_parts == (1000, 256, 729) and sh.text_tokens == 1985
    assert sh.rollout_branches == 2
