"""`mmalign plan` for Z-Image-Turbo and Qwen-Image-Edit-2509 (configs/z_image.yaml, configs/image_edit-qwen-plus.yaml):
their architectures in the table build at the published sizes, the planned shapes are hand-worked from the
pipelines, and both real configs fit one H100."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmalign.app import plan as plan_mod
from mmalign.app.plan_models import build_meta, param_numel, resolve_model

REPO = Path(__file__).resolve().parents[2]


def _real(name: str, *overrides: str) -> object:
    import pipelines
    from mmalign.config import load_config

    return load_config(str(REPO / "configs" / name), list(overrides), pipeline_finder=pipelines.find)


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("Tongyi-MAI/Z-Image-Turbo", 6e9),  # model card: "an efficient 6B-parameter" single-stream DiT
        ("Qwen/Qwen-Image-Edit-2509", 20e9),  # the 20B Qwen-Image MMDiT
    ],
)
def test_table_entries_have_the_published_sizes(name: str, published: float) -> None:
    spec = resolve_model(name)
    assert spec.origin == "table" and spec.kind == "diffusers"
    n = param_numel(build_meta(spec.components[spec.denoiser], torch.bfloat16))
    assert abs(n / published - 1) <= 0.10, n
    if "Z-Image" in name:
        enc = param_numel(build_meta(spec.components["text_encoder"], torch.bfloat16))
        assert abs(enc / 4.0e9 - 1) <= 0.10, enc  # Qwen3-4B without its LM head (tied embeddings)


def test_z_image_shapes_and_fit() -> None:
    """512 px, FLUX.1's VAE (factor 8), 2 x 2 patches: 32 x 32 = 1024 image tokens; the prompt states are
    ``max_sequence_length`` long; no CFG branch at guidance 1 (two at guidance > 1)."""
    cfg = _real("z_image.yaml")
    spec = resolve_model(cfg.model.name_or_path)
    sh = plan_mod.diffusion_shapes(cfg, spec)
    assert sh.latent == (16, 64, 64) and sh.image_tokens == 1024 and sh.text_tokens == 256
    assert sh.rollout_branches == 1 and sh.trained_steps == 1
    guided = plan_mod.diffusion_shapes(_real("z_image.yaml", "options.guidance_scale=3.0"), spec)
    assert guided.rollout_branches == 2
    assert plan_mod.denoiser_family(cfg, spec).family.name == "z_image"
    assert "feed_forward.w2" in plan_mod.denoiser_family(cfg, spec).lora_targets  # the policy's lora_targets


def test_qwen_image_edit_plus_shapes_and_fit() -> None:
    """One picture per row: its 1024 packed tokens follow the 1024 noisy ones (512 px); the prompt states hold the
    picture's vision tokens at the pipeline's 384 x 384 condition size (the Qwen2.5-VL processor rounds 384 to
    392 px: 28 x 28 patches merged 2 x 2 = 196 tokens), its "Picture 1: " label and the instruction."""
    from mmalign.policies.family_plans import PLUS_LABEL_TOKENS

    cfg = _real("image_edit-qwen-plus.yaml")
    spec = resolve_model(cfg.model.name_or_path)
    sh = plan_mod.diffusion_shapes(cfg, spec)
    assert sh.reference_tokens == 1024 and sh.image_tokens == 2048
    assert sh.text_tokens == cfg.options.max_sequence_length + 196 + PLUS_LABEL_TOKENS
    assert plan_mod.denoiser_family(cfg, spec).family.name == "qwen_image_edit_plus"
    plain = _real("image_edit-qwen.yaml")
    assert (
        plan_mod.denoiser_family(plain, resolve_model(plain.model.name_or_path)).family.name
        == "qwen_image_edit"
    )


@pytest.mark.slow
@pytest.mark.parametrize("config", ["z_image.yaml", "image_edit-qwen-plus.yaml"])
def test_the_real_configs_fit_one_h100(config: str) -> None:
    """The whole plan (meta-device forward and backward of the 6B / 20B denoiser; 25-75 s on 2 CPU cores): the
    configs' own settings fit one H100 80GB (planned 21.7 / 24.9 GiB and 58.3 / 64.0 GiB train / rollout)."""
    p = plan_mod.plan(_real(config), plan_mod.Hardware(plan_mod.DEVICES["h100"]))
    assert p.fits


def test_flux1_plans_true_cfg_as_two_branches() -> None:
    """FLUX.1's ``guidance_scale`` is its distilled guidance input (one forward per step); true CFG
    (``true_cfg_scale`` > 1, diffusers' ``FluxPipeline``) runs a negative branch too, so the plan counts two
    branches in the rollout and, as `FluxPolicy` trains with guidance, in training. An SD3 config's branches
    still follow ``guidance_scale``."""
    flux = ("model.name_or_path=black-forest-labs/FLUX.1-dev", "options.guidance_scale=3.5")
    cfg = _real("text_to_image.yaml", *flux)
    spec = resolve_model(cfg.model.name_or_path)
    assert not plan_mod.denoiser_family(cfg, spec).two_branch_cfg
    one = plan_mod.diffusion_shapes(cfg, spec)
    assert (one.rollout_branches, one.train_branches) == (1, 1)
    true_cfg = plan_mod.diffusion_shapes(
        _real("text_to_image.yaml", *flux, "options.true_cfg_scale=2.0", "options.negative_prompt=blurry"),
        spec,
    )
    assert (true_cfg.rollout_branches, true_cfg.train_branches) == (2, 2)
    sd3 = _real("text_to_image.yaml")
    assert plan_mod.diffusion_shapes(sd3, resolve_model(sd3.model.name_or_path)).rollout_branches == 2
