"""HunyuanVideo15ImageToVideoPolicy on a tiny offline HunyuanVideo 1.5 image-to-video folder
(`mmalign.tiny.hunyuan_video15`, ``hunyuan_video15_i2v_tiny``): the folder round trip through diffusers'
``HunyuanVideo15ImageToVideoPipeline``, the first-frame latents / condition channels and SigLIP states against the
pipeline's, the whole deterministic sampler (ODE, with and without CFG) against the pipeline from the same initial
noise with a different first frame per row, the rollout contract (shapes, payload, ratio 1 on re-scoring, gradients,
frozen encoders), save / reload, the first-frame crop, and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmalign import tiny
from mmalign.policies.families import family_for, policy_class_for
from mmalign.policies.hunyuan_video15 import (
    HunyuanVideo15ImageToVideoPolicy,
    HunyuanVideo15Policy,
    read_first_frame,
)
from mmalign.policies.hunyuan_video15_components import GLYPH_MAX_LENGTH, MAX_SEQUENCE_LENGTH
from tests.policies.test_hunyuan_video15_policy import set_pipe

SEQ, GLYPH = 40, 16
SIZE = {"num_frames": 9, "height": 32, "width": 32}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build("hunyuan_video15_i2v_tiny", tmp_path_factory.mktemp("hv15i2v") / "tiny", announce=False)


@pytest.fixture(scope="module")
def pipe(folder: Path):
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    return HunyuanVideo15ImageToVideoPipeline.from_pretrained(folder)


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Two rows, each with its own random 32 x 32 first frame (PNG)."""
    root = tmp_path_factory.mktemp("frames")
    rng = np.random.default_rng(0)
    out = []
    for i, prompt in enumerate(['a red square with a sign saying "hi"', "two blue circles move left"]):
        path = root / f"frame_{i}.png"
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(path)
        out.append({"prompt": prompt, "image": str(path)})
    return out


def make(path: Path, **kw) -> HunyuanVideo15ImageToVideoPolicy:
    for k, v in {
        **SIZE,
        "num_steps": 4,
        "seed": 0,
        "max_sequence_length": SEQ,
        "glyph_max_length": GLYPH,
    }.items():
        kw.setdefault(k, v)
    return HunyuanVideo15ImageToVideoPolicy.from_pretrained(path, **kw)


def columns(rows: list[dict], repeat: int = 1) -> dict[str, list]:
    return {"image": [r["image"] for r in rows for _ in range(repeat)]}


# ----------------------------------------------------------------------------- folder and registry


def test_folder_loads_in_diffusers_and_the_registry_picks_the_policy(folder: Path, pipe) -> None:
    assert "hunyuan_video15_i2v_tiny" in tiny.load_builders()
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "HunyuanVideo15ImageToVideoPipeline"
    assert index["image_encoder"] == ["transformers", "SiglipVisionModel"]
    assert index["feature_extractor"] == ["transformers", "SiglipImageProcessor"]
    assert type(pipe.image_encoder).__name__ == "SiglipVisionModel"
    assert policy_class_for(folder, "video") is HunyuanVideo15ImageToVideoPolicy
    i2v = family_for("hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v", "video")
    assert i2v.name == "hunyuan_video15_i2v"
    assert family_for("hunyuanvideo-community/HunyuanVideo-1.5-720p_i2v_step_distilled", "video") is i2v
    assert family_for("hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v", "video").name == "hunyuan_video15"
    t2v = tiny.build("hunyuan_video15_tiny", folder.parent / "t2v", announce=False)
    assert policy_class_for(t2v, "video") is HunyuanVideo15Policy


def test_image_conditioning_equals_the_pipeline(folder: Path, pipe, rows: list[dict]) -> None:
    """Per row: the stored first-frame latents are the pipeline's condition latents on latent frame 0 (its other
    frames zero, the mask one there only), the SigLIP states the pipeline's image embeds."""
    pol = make(folder)
    cond = pol.row_conditioning(columns(rows, 2), torch.tensor([0, 0, 1, 1]))
    assert cond["image_latents"].shape == (4, 4, 1, 8, 8) and cond["image_embeds"].shape == (4, 16, 16)
    torch.testing.assert_close(cond["image_latents"][0], cond["image_latents"][1], rtol=0, atol=0)
    assert not torch.allclose(cond["image_latents"][0], cond["image_latents"][2])
    latents = torch.zeros(1, 4, 5, 8, 8)
    for i, row in enumerate(rows):
        img = Image.open(row["image"]).convert("RGB")
        with torch.no_grad():
            c, m = pipe.prepare_cond_latents_and_mask(latents, img, 1, 32, 32, torch.float32, "cpu")
            emb = pipe.encode_image(img, 1, "cpu", torch.float32)
        assert (
            float(c[:, :, 1:].abs().sum()) == 0
            and float(m[:, :, 0].min()) == 1
            and float(m[:, :, 1:].max()) == 0
        )
        torch.testing.assert_close(cond["image_latents"][2 * i], c[0, :, :1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cond["image_embeds"][2 * i], emb[0], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- sampler parity


@pytest.mark.parametrize(
    ("cfg", "seq", "glyph"), [(1.0, SEQ, GLYPH), (3.0, MAX_SEQUENCE_LENGTH, GLYPH_MAX_LENGTH)]
)
def test_ode_sampler_equals_the_pipeline(
    folder: Path, pipe, rows: list[dict], cfg: float, seq: int, glyph: int
) -> None:
    """Same initial noise, 4 steps: a deterministic rollout of both rows (noise_level 0: the Euler ODE) ends at the
    pipeline's latents for each row's own first frame, without CFG and with it (the pipeline's own prompt lengths;
    the empty negative prompt, the image conditions in both branches). Measured ~1e-7 relative (fp32)."""
    pol = make(folder, guidance_scale=cfg, noise_level=0.0, max_sequence_length=seq, glyph_max_length=glyph)
    assert pol.sampler.deterministic
    pol.generator.manual_seed(7)
    noise = pol._initial_noise(torch.arange(len(rows)))
    pol.generator.manual_seed(7)
    r = pol.rollout(rows, 1, compute_logp=False)
    ours = r.outputs["latents"]
    set_pipe(pipe, seq=seq, glyph=glyph, guidance=cfg)
    for i, row in enumerate(rows):
        with torch.no_grad():
            theirs = pipe(
                image=Image.open(row["image"]).convert("RGB"),
                prompt=[row["prompt"]],
                num_frames=9,
                num_inference_steps=4,
                latents=noise[i : i + 1].clone(),
                output_type="latent",
            ).frames
        assert theirs.shape == (1, 4, 5, 8, 8)
        rel = float((ours[i : i + 1] - theirs).abs().max() / theirs.abs().max())
        print(f"HunyuanVideo 1.5 I2V ODE parity (guidance {cfg}, row {i}): max relative difference {rel:.2e}")
        assert rel < 1e-5, rel


# ----------------------------------------------------------------------------- training contract


def test_rollout_contract_ratio_one_and_gradients(folder: Path, rows: list[dict], tmp_path: Path) -> None:
    pol = make(folder, noise_level=0.5, guidance_scale=2.0, window_size=2)
    r = pol.rollout(rows, 2)
    assert r.num_actions == 2 and r.outputs["latents"].shape == (4, 4, 5, 8, 8)
    assert r.payload["image_latents"].shape == (4, 4, 1, 8, 8) and r.payload["image_embeds"].shape == (
        4,
        16,
        16,
    )
    stats = pol.action_stats(r)
    torch.testing.assert_close(torch.exp(stats.logp - r.logp_old), torch.ones(4, 2), rtol=0, atol=1e-5)
    stats.logp.sum().backward()
    grads = {n: p.grad for n, p in pol.model.named_parameters() if p.requires_grad}
    assert float(grads["x_embedder.proj.weight"].abs().sum()) > 0
    assert float(grads["image_embedder.linear_1.weight"].abs().sum()) > 0  # the SigLIP states reach the model
    # DDP needs a gradient for every trainable parameter: the last block's text-stream output (dropped by the
    # transformer) is frozen, everything else trainable gets one
    missing = [n for n, p in pol.model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing
    last = len(pol.model.transformer_blocks) - 1
    assert not pol.model.transformer_blocks[last].attn.to_add_out.weight.requires_grad
    frozen = (pol.text_encoder, pol.text_encoder_2, pol.image_encoder)
    assert not any(p.requires_grad for enc in frozen for p in enc.parameters())
    sub = r[torch.tensor([3, 0])]  # a subset re-scores with its own stored image conditions
    torch.testing.assert_close(pol.action_stats(sub).logp.detach(), r.logp_old[[3, 0]], atol=1e-5, rtol=0)
    pol.decode(r)
    assert r.outputs["videos"].shape == (4, 9, 3, 32, 32)
    # the stored conditions are what re-scoring uses: another first frame changes the log-probs
    other = r[torch.arange(4)]
    other.payload["image_embeds"] = other.payload["image_embeds"].flip(0)
    other.payload["image_latents"] = other.payload["image_latents"].flip(0)
    assert not torch.allclose(pol.action_stats(other).logp.detach(), r.logp_old, atol=1e-4)

    pol.save(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "model_index.json").read_text())["_class_name"] == (
        "HunyuanVideo15ImageToVideoPipeline"
    )
    again = make(tmp_path / "saved", noise_level=0.5, guidance_scale=2.0, window_size=2)
    torch.testing.assert_close(again.action_stats(r).logp.detach(), stats.logp.detach(), atol=1e-5, rtol=0)


def test_velocity_reads_a_wrapped_model_through_its_module(folder: Path, rows: list[dict]) -> None:
    """Under DDP the network is a wrapper whose attributes live on ``.module``: the velocity through a wrapper
    equals the velocity of the bare transformer."""
    from mmalign.policies.hunyuan_video15_components import hunyuan_video15_velocity

    class Wrapper(torch.nn.Module):
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, **kw):
            return self.module(**kw)

    pol = make(folder)
    cond = {**pol.conditioning([r["prompt"] for r in rows])}
    cond.update(pol.row_conditioning(columns(rows), torch.arange(2)))
    x = torch.randn(2, 4, 5, 8, 8, generator=torch.Generator().manual_seed(3))
    sigmas = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        a = hunyuan_video15_velocity(pol.model, x, sigmas, cond, 1000)
        b = hunyuan_video15_velocity(Wrapper(pol.model), x, sigmas, cond, 1000)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_first_frame_is_cropped_to_the_policy_size(tmp_path: Path) -> None:
    """Hand-worked: a 32 x 64 image (red | green | blue columns of 16 | 32 | 16 px) covers 32 x 32 at scale 1, so
    the centre crop is the green band; a 16 x 16 image is scaled 2x and kept whole."""
    arr = np.zeros((32, 64, 3), dtype=np.uint8)
    arr[:, :16, 0], arr[:, 16:48, 1], arr[:, 48:, 2] = 255, 255, 255
    Image.fromarray(arr).save(tmp_path / "wide.png")
    out = read_first_frame(tmp_path / "wide.png", 32, 32)
    assert out.shape == (3, 32, 32)
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0, 0.0])[:, None, None].expand(3, 32, 32))
    Image.fromarray(np.full((16, 16, 3), 128, dtype=np.uint8)).save(tmp_path / "small.png")
    torch.testing.assert_close(
        read_first_frame(tmp_path / "small.png", 32, 32), torch.full((3, 32, 32), 128 / 255)
    )


def test_errors_name_what_is_missing(folder: Path, rows: list[dict]) -> None:
    pol = make(folder)
    with pytest.raises(ValueError, match="needs an image in every row"):
        pol.row_conditioning({"image": [rows[0]["image"], None]}, torch.tensor([0, 1]))
    from mmalign.tiny.hunyuan_video15 import tiny_hunyuan_video15_components

    with pytest.raises(ValueError, match="image_encoder/"):
        HunyuanVideo15ImageToVideoPolicy.from_components(tiny_hunyuan_video15_components(), **SIZE)
