"""`mmalign plan` asks the model's family (`mmalign.policies.families.PlanSpec`) for its shapes and denoiser inputs:
a family registered at test time is planned with no edit of the app; HunyuanVideo 1.5, whose forward reads the
values of its constant inputs, is simulated on the meta device with those values tracked (`plan_models.KnownValues`)
and its planned forward + backward peak is checked against torch's CPU profiler on a real model; FLUX.2's rollout
plans its VAE decode."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mmalign.app import plan as plan_mod
from mmalign.app.plan_models import (
    KnownValues,
    build_meta,
    param_bytes,
    param_numel,
    resolve_model,
    spec_from_folder,
)
from mmalign.config import config_from_dict
from mmalign.policies import families
from mmalign.policies.families import Family, PlanRequest, PlanShapes, PlanSpec, plan_family, register_family

REPO = Path(__file__).resolve().parents[2]


def _write(folder: Path, parts: dict[str, dict[str, Any]]) -> Path:
    for name, config in parts.items():
        target = folder / name if name != "model_index" else folder
        target.mkdir(parents=True, exist_ok=True)
        (target / ("model_index.json" if name == "model_index" else "config.json")).write_text(
            json.dumps(config)
        )
    return folder


def _diffusion_config(folder: Path, out: Path, pipeline: str, options: dict[str, Any]) -> Any:
    return config_from_dict(
        {
            "pipeline": pipeline,
            "output_dir": str(out),
            "model": {"name_or_path": str(folder), "dtype": "float32", "lora": {"enabled": False}},
            "data": {"train": str(REPO / "assets/text_to_image/train.jsonl")},
            "rollout": {"group_size": 2, "prompts_per_step": 1},
            "rewards": [{"name": "format"}],
            "trainer": {"steps": 1, "cpu": True},
            "options": options,
        },
        "test_plan_families",
    )


# ----------------------------------------------------------------------------- a third-party family
SD3_SMALL = {
    "_class_name": "SD3Transformer2DModel",
    "sample_size": 16,
    "patch_size": 2,
    "in_channels": 4,
    "out_channels": 4,
    "num_layers": 1,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "joint_attention_dim": 16,
    "caption_projection_dim": 16,
    "pooled_projection_dim": 8,
}


def test_a_third_party_family_is_planned_without_editing_the_app(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A family registered here (its own pipeline class, its own `PlanSpec`: 12 x 12 latents and 5 prompt tokens,
    unlike anything the SD3 transformer it reuses would give) is found by `plan_family`, and `plan` takes its
    shapes, calls its inputs and uses its policy's ``two_branch_cfg``."""
    monkeypatch.setattr(families, "_FAMILIES", dict(families._FAMILIES))
    calls: list[int] = []

    def shapes(req: PlanRequest) -> PlanShapes:
        assert (
            req.config["sample_size"] == 16 and req.option("num_steps") == 2
        )  # the folder's and the config's
        return PlanShapes((4, 12, 12), 5, 36, (3, 96, 96))

    def inputs(c: dict[str, Any], sh: PlanShapes, batch: int, dtype: torch.dtype) -> dict[str, Any]:
        calls.append(batch)
        e = lambda *s: torch.empty(s, dtype=dtype, device="meta")  # noqa: E731
        return dict(
            hidden_states=e(batch, *sh.latent),
            encoder_hidden_states=e(batch, sh.text_tokens, c["joint_attention_dim"]),
            pooled_projections=e(batch, c["pooled_projection_dim"]),
            timestep=e(batch),
            return_dict=False,
        )

    register_family(
        Family(
            "toy",
            "text_to_image",
            "mmalign.policies.sd3:SD3Policy",
            pipelines=("ToyPipeline",),
            plan=PlanSpec(shapes, inputs),
        )
    )
    folder = _write(
        tmp_path / "toy", {"model_index": {"_class_name": "ToyPipeline"}, "transformer": SD3_SMALL}
    )
    assert plan_family(folder, "SD3Transformer2DModel", "text_to_image").name == "toy"
    cfg = _diffusion_config(
        folder, tmp_path / "run", "text_to_image", {"num_steps": 2, "guidance_scale": 3.0}
    )
    p = plan_mod.plan(cfg, plan_mod.Hardware(plan_mod.DEVICES["h100"]))
    assert (
        p.shapes["latent"] == (4, 12, 12) and p.shapes["text_tokens"] == 5 and p.shapes["image_tokens"] == 36
    )
    assert p.shapes["cfg_branches_train"] == 2  # SD3Policy.two_branch_cfg at guidance 3
    assert calls and p.train.memory.activations > 0


# ----------------------------------------------------------------------------- constant meta tensors
def test_known_values_take_the_branch_a_real_run_takes() -> None:
    """Under `KnownValues` a branch on ``torch.all(x == 0)`` of a meta ``torch.zeros`` and boolean-mask indexing by
    a meta ``torch.ones`` / ``torch.zeros`` mask give what the same code gives on real CPU tensors."""

    def code(dev: str) -> tuple[bool, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        image = torch.zeros(2, 1, 4, device=dev)
        x = torch.empty(2, 7, 4, device=dev)
        mask = torch.ones(2, 7, device=dev).bool()
        off = torch.zeros(2, 1, device=dev).bool()
        rows = [t[m] for t, m in zip(x, mask, strict=True)]
        return (
            bool(torch.all(image == 0)),
            tuple(x[mask].shape),
            tuple(image[off].shape),
            tuple(rows[0].shape),
        )

    with KnownValues():
        meta = code("meta")
    assert meta == code("cpu") == (True, (14, 4), (0, 4), (7, 4))
    with pytest.raises(RuntimeError):  # without the mode a meta tensor has no value to branch on
        code("meta")


# ----------------------------------------------------------------------------- HunyuanVideo 1.5
HUNYUAN_SMALL = {
    "_class_name": "HunyuanVideo15Transformer3DModel",
    "in_channels": 9,
    "out_channels": 4,
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "num_layers": 2,
    "num_refiner_layers": 1,
    "mlp_ratio": 2.0,
    "patch_size": 1,
    "patch_size_t": 1,
    "qk_norm": "rms_norm",
    "text_embed_dim": 32,
    "text_embed_2_dim": 16,
    "image_embed_dim": 16,
    "rope_theta": 256.0,
    "rope_axes_dim": [8, 12, 12],
    "target_size": 64,
    "task_type": "t2v",
}
HUNYUAN_VAE = {
    "_class_name": "AutoencoderKLHunyuanVideo15",
    "latent_channels": 4,
    "block_out_channels": [8, 8, 16],
    "spatial_compression_ratio": 4,
    "temporal_compression_ratio": 2,
}


@pytest.fixture(scope="module")
def hunyuan_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A HunyuanVideo 1.5 folder's configs (128 wide, 2 dual-stream blocks; a VAE with 4x spatial, 2x temporal
    compression): all the planner reads."""
    return _write(
        tmp_path_factory.mktemp("models") / "hunyuan-small",
        {
            "model_index": {"_class_name": "HunyuanVideo15Pipeline"},
            "transformer": HUNYUAN_SMALL,
            "vae": HUNYUAN_VAE,
        },
    )


OPTIONS = {"num_frames": 9, "height": 64, "width": 64, "max_sequence_length": 40, "glyph_max_length": 16}


def test_hunyuan_video15_shapes_are_hand_worked(hunyuan_folder: Path) -> None:
    """9 frames at 64 x 64 through 2x temporal and 4x spatial compression: 5 latent frames of 16 x 16 = 1280 video
    tokens (patch 1); the context is the 40 prompt tokens then the 16 glyph tokens."""
    spec = spec_from_folder(hunyuan_folder, str(hunyuan_folder))
    family = plan_family(hunyuan_folder, spec.components[spec.denoiser].cls)
    components = {k: v.config for k, v in spec.components.items()}
    sh = family.plan_spec().shapes(PlanRequest(OPTIONS, components, spec.denoiser, family.task))
    assert family.name == "hunyuan_video15"
    assert sh.latent == (4, 5, 16, 16) and sh.image_tokens == 1280
    assert sh.text_tokens == 56 and sh.text_parts == (40, 16) and sh.pixels == (9, 3, 64, 64)


def _real_inputs(meta: dict[str, Any]) -> dict[str, Any]:
    """CPU inputs of the meta inputs' shapes as `hunyuan_video15_velocity` passes them: random latents and
    states, timestep 500, all-valid masks, all-zero image states (text to video)."""
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for k, v in meta.items():
        if not isinstance(v, torch.Tensor):
            out[k] = v
        elif k == "timestep":
            out[k] = torch.full(v.shape, 500.0)
        elif "mask" in k:
            out[k] = torch.ones(v.shape)
        elif k == "image_embeds":
            out[k] = torch.zeros(v.shape)
        else:
            out[k] = torch.randn(v.shape, generator=g)
    return out


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointing"])
def test_hunyuan_video15_planned_peak_within_15_percent(hunyuan_folder: Path, ckpt: bool) -> None:
    """The planner's recording of one forward + backward of the denoiser (full fine-tuning, fp32, the family's own
    inputs) against torch's CPU profiler over the same forward + backward of a real model of that architecture:
    the peak bytes beyond the weights within 15% (as the other families' checks), and the same parameter bytes."""
    from diffusers import HunyuanVideo15Transformer3DModel

    options = {k: v for k, v in OPTIONS.items() if k != "glyph_max_length"}  # the policy's 256 glyph tokens
    cfg = _diffusion_config(
        hunyuan_folder, hunyuan_folder.parent / "run", "video_geometry", {**options, "num_steps": 2}
    )
    spec = resolve_model(str(hunyuan_folder))
    den = plan_mod.denoiser_family(cfg, spec)
    sample = plan_mod.diffusion_shapes(cfg, spec).sample
    config = spec.components[spec.denoiser].config
    meta = plan_mod.diffusion_model(cfg, spec, torch.float32)
    if ckpt:
        meta.enable_gradient_checkpointing()
    rec, _flops, _kept = plan_mod.denoiser_pass(
        meta, config, den, sample, 1, torch.float32, grad=True, steps=1
    )
    planned = rec.peaks["train"].total

    torch.manual_seed(0)
    real = HunyuanVideo15Transformer3DModel.from_config(config).float().train()
    if ckpt:
        real.enable_gradient_checkpointing()
    x = _real_inputs(den.plan.inputs(config, sample, 1, torch.float32))

    def step() -> None:
        real(**x)[0].float().mean().backward()

    step()  # warm-up: lazily built buffers (rotary tables) and the first gradients
    real.zero_grad(set_to_none=True)
    gc.collect()
    measured = plan_mod.profiled_alloc_peak(step)
    assert abs(planned / measured - 1) <= 0.15, (planned / 2**20, measured / 2**20)
    assert param_bytes(meta) == sum(p.numel() * p.element_size() for p in real.parameters())


def test_hunyuan_video15_real_config_plans_from_the_table() -> None:
    """configs/hunyuan_video15.yaml plans offline: the table's transformer builds at the published 8.3B parameters,
    33 frames at 480 x 848 give 9 latent frames of 30 x 53 (14,310 tokens), 1000 prompt + 256 glyph tokens."""
    import pipelines
    from mmalign.config import load_config

    cfg = load_config(str(REPO / "configs/hunyuan_video15.yaml"), [], pipeline_finder=pipelines.find)
    spec = resolve_model(cfg.model.name_or_path)
    assert spec.origin == "table"
    n = param_numel(build_meta(spec.components[spec.denoiser], torch.bfloat16))
    assert abs(n / 8.3e9 - 1) <= 0.05, n
    sh = plan_mod.diffusion_shapes(cfg, spec)
    assert sh.latent == (32, 9, 30, 53) and sh.image_tokens == 9 * 30 * 53 and sh.text_tokens == 1256
    assert sh.rollout_branches == 2  # guidance 6, HunyuanVideo15Policy.two_branch_cfg


# ----------------------------------------------------------------------------- FLUX.2's VAE decode
def test_flux2_rollout_plans_its_vae_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLUX.2's denoiser takes 2 x 2-packed latents; the VAE decodes the unpacked ones (`PlanSpec.vae_latent`), so
    the rollout's VAE-decode moment holds more than the weights and stored latents."""
    import pipelines
    from mmalign.config import load_config

    monkeypatch.chdir(REPO)
    cfg = load_config("configs/flux2-tiny.yaml", [], pipeline_finder=pipelines.find)
    p = plan_mod.plan(cfg, plan_mod.Hardware(plan_mod.DEVICES["h100"]))
    decode = next(m for m in p.rollout.moments if m.name == "VAE decode")
    held = p.rollout.memory.total - p.rollout.memory.activations  # weights, frozen, optimizer, stored latents
    assert decode.total > held
