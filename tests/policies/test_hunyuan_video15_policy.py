"""HunyuanVideo15Policy on a tiny offline HunyuanVideo 1.5 folder (`mmalign.tiny.hunyuan_video15`): the folder
round trip through diffusers' ``HunyuanVideo15Pipeline``, the prompt and glyph states against the pipeline's, the
padding trim against the untrimmed call, the whole deterministic sampler (ODE, with and without CFG) against the
pipeline from the same initial noise, decoding, ratio 1 on re-scoring, LoRA (reference = adapter off, save /
reload), the family registry choosing the policy, and size errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmalign import tiny
from mmalign.config import LoraConfig
from mmalign.policies.families import family_for, policy_class_for
from mmalign.policies.hunyuan_video15 import HunyuanVideo15Policy
from mmalign.policies.hunyuan_video15_components import (
    GLYPH_MAX_LENGTH,
    IMAGE_TOKENS,
    MAX_SEQUENCE_LENGTH,
    glyph_text,
    hunyuan_video15_velocity,
)

ROWS = [{"prompt": 'a red square with a sign saying "hi"'}, {"prompt": "two blue circles at the top"}]
SEQ, GLYPH = 40, 16
"""Prompt / glyph tokens in most tests (the pipeline's 1000 / 256 in the parity test with CFG)."""
SIZE = {"num_frames": 9, "height": 32, "width": 32}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build("hunyuan_video15_tiny", tmp_path_factory.mktemp("hv15") / "tiny", announce=False)


@pytest.fixture(scope="module")
def pipe(folder: Path):
    from diffusers import HunyuanVideo15Pipeline

    return HunyuanVideo15Pipeline.from_pretrained(folder)


def make(path: Path, **kw) -> HunyuanVideo15Policy:
    for k, v in {
        **SIZE,
        "num_steps": 4,
        "seed": 0,
        "max_sequence_length": SEQ,
        "glyph_max_length": GLYPH,
    }.items():
        kw.setdefault(k, v)
    return HunyuanVideo15Policy.from_pretrained(path, **kw)


def set_pipe(pipe, *, seq: int, glyph: int, guidance: float) -> None:
    """The pipeline's prompt / glyph lengths (plain attributes) and its guider's scale."""
    pipe.tokenizer_max_length, pipe.tokenizer_2_max_length = seq, glyph
    pipe.guider.guidance_scale = guidance


# ----------------------------------------------------------------------------- folder and prompts


def test_folder_loads_in_diffusers_and_the_registry_picks_the_policy(folder: Path, pipe) -> None:
    import json

    assert "hunyuan_video15_tiny" in tiny.load_builders()
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "HunyuanVideo15Pipeline"
    assert set(index) >= {
        "transformer",
        "vae",
        "scheduler",
        "text_encoder",
        "tokenizer",
        "text_encoder_2",
        "guider",
    }
    assert type(pipe.transformer).__name__ == "HunyuanVideo15Transformer3DModel"
    assert type(pipe.text_encoder).__name__ == "Qwen2_5_VLTextModel"
    assert type(pipe.guider).__name__ == "ClassifierFreeGuidance"
    assert pipe.scheduler.config.shift == 5.0
    assert policy_class_for(folder, "video") is HunyuanVideo15Policy
    assert family_for("hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v", "video").name == "hunyuan_video15"
    assert family_for(folder / "transformer" / "..", "video").name == "hunyuan_video15"
    assert family_for("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "video").name == "wan"


def test_glyph_text_follows_the_quotes() -> None:
    assert glyph_text("a cat") is None
    assert glyph_text('a sign "OPEN" and “OPEN” and "bar"') == 'Text "OPEN". Text "bar". '
    assert glyph_text('one "x"') == 'Text "x". '


def test_prompt_and_glyph_states_equal_the_pipeline(folder: Path, pipe) -> None:
    pol = make(folder)
    prompts = [ROWS[0]["prompt"], "", "two blue circles at the top"]
    ours = pol.conditioning(prompts)
    set_pipe(pipe, seq=SEQ, glyph=GLYPH, guidance=1.0)
    with torch.no_grad():
        pe, pm, ge, gm = pipe.encode_prompt(prompts, device="cpu", dtype=torch.float32, batch_size=3)
    assert ours["prompt_embeds"].shape == (3, SEQ, 32) and ours["glyph_embeds"].shape == (3, GLYPH, 16)
    torch.testing.assert_close(ours["prompt_embeds"], pe, rtol=0, atol=0)
    torch.testing.assert_close(ours["prompt_mask"].float(), pm, rtol=0, atol=0)
    torch.testing.assert_close(ours["glyph_embeds"], ge, rtol=0, atol=0)
    torch.testing.assert_close(ours["glyph_mask"].float(), gm, rtol=0, atol=0)
    assert int(gm[0].sum()) > 0 and float(gm[1:].abs().sum()) == 0  # only the quoted prompt has glyphs


def test_trimmed_padding_gives_the_untrimmed_velocity(folder: Path) -> None:
    """The pipeline's full lengths (1000 prompt, 256 glyph, 729 image tokens, untrimmed) and the policy's call
    (short lengths, trimmed, one image token) give the same velocity."""
    full = make(folder, max_sequence_length=MAX_SEQUENCE_LENGTH, glyph_max_length=GLYPH_MAX_LENGTH)
    short = make(folder)
    x = torch.randn(2, 4, 5, 8, 8, generator=torch.Generator().manual_seed(1))
    sigmas = torch.tensor([0.7, 0.3])
    prompts = [r["prompt"] for r in ROWS]
    n = int(full.scheduler.config.num_train_timesteps)
    with torch.no_grad():
        a = hunyuan_video15_velocity(
            full.model, x, sigmas, full.conditioning(prompts), n, image_tokens=IMAGE_TOKENS, trim=False
        )
        b = short.velocity(short.model, x, {"sigmas": sigmas}, short.conditioning(prompts))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- sampler parity


def _ode(pol: HunyuanVideo15Policy, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """(initial noise, final latents) of the policy's deterministic sampler, one sample per row of `ROWS`."""
    assert pol.sampler.deterministic
    pol.generator.manual_seed(seed)
    noise = pol._initial_noise(torch.arange(len(ROWS)))
    pol.generator.manual_seed(seed)
    r = pol.rollout(ROWS, 1, compute_logp=False)
    assert r.num_actions == 0
    return noise, r.outputs["latents"]


@pytest.mark.parametrize(
    ("cfg", "seq", "glyph"), [(1.0, SEQ, GLYPH), (3.0, MAX_SEQUENCE_LENGTH, GLYPH_MAX_LENGTH)]
)
def test_ode_sampler_equals_the_pipeline(folder: Path, pipe, cfg: float, seq: int, glyph: int) -> None:
    """Same initial noise, 4 steps: a deterministic rollout (noise_level 0: every step the Euler ODE step) ends at
    the pipeline's latents, without CFG and with it (the pipeline's own prompt lengths and 729 image tokens; the
    empty negative prompt either way). Max relative difference printed; measured ~2e-7 (fp32)."""
    pol = make(folder, guidance_scale=cfg, noise_level=0.0, max_sequence_length=seq, glyph_max_length=glyph)
    noise, ours = _ode(pol)
    set_pipe(pipe, seq=seq, glyph=glyph, guidance=cfg)
    with torch.no_grad():
        theirs = pipe(
            prompt=[r["prompt"] for r in ROWS],
            height=32,
            width=32,
            num_frames=9,
            num_inference_steps=4,
            latents=noise.clone(),
            output_type="latent",
        ).frames
    assert ours.shape == theirs.shape == (2, 4, 5, 8, 8)
    rel = float((ours - theirs).abs().max() / theirs.abs().max())
    print(f"HunyuanVideo 1.5 ODE parity (guidance {cfg}): max relative difference {rel:.2e}")
    assert rel < 1e-5, rel


def test_decode_equals_the_pipeline(folder: Path, pipe) -> None:
    """The policy's decode of the pipeline's final latents equals the pipeline's own pixels (output_type pt)."""
    pol = make(folder)
    set_pipe(pipe, seq=SEQ, glyph=GLYPH, guidance=1.0)
    noise = torch.randn(1, 4, 5, 8, 8, generator=torch.Generator().manual_seed(2))
    kw = dict(prompt=["a"], height=32, width=32, num_frames=9, num_inference_steps=1)
    with torch.no_grad():
        z = pipe(**kw, latents=noise.clone(), output_type="latent").frames
        theirs = pipe(**kw, latents=noise.clone(), output_type="pt").frames
    ours = pol.decode_latents(z)
    assert ours.shape == (1, 9, 3, 32, 32) and tuple(theirs.shape) == (1, 9, 3, 32, 32)
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("kind", ["flow_sde", "cps"])
def test_ratio_is_one_and_gradients_reach_the_transformer(folder: Path, kind: str) -> None:
    pol = make(folder, sde_kind=kind, noise_level=0.5, guidance_scale=2.0, window_size=2)
    r = pol.rollout(ROWS, 2)
    assert r.num_actions == 2 and r.payload["glyph_mask"].shape == (4, GLYPH)
    assert r.outputs["latents"].shape == (4, 4, 5, 8, 8)
    stats = pol.action_stats(r)
    torch.testing.assert_close(torch.exp(stats.logp - r.logp_old), torch.ones(4, 2), rtol=0, atol=1e-5)
    stats.logp.sum().backward()
    grads = {n: p.grad for n, p in pol.model.named_parameters() if p.requires_grad}
    assert (
        grads["x_embedder.proj.weight"] is not None
        and grads["transformer_blocks.0.attn.to_q.weight"] is not None
    )
    assert float(grads["transformer_blocks.0.attn.add_k_proj.weight"].abs().sum()) > 0
    assert not any(
        p.requires_grad for enc in (pol.text_encoder, pol.text_encoder_2) for p in enc.parameters()
    )
    sub = r[torch.tensor([3, 0])]  # a subset re-scores with its own stored states
    torch.testing.assert_close(pol.action_stats(sub).logp.detach(), r.logp_old[[3, 0]], atol=1e-5, rtol=0)
    pol.decode(r)
    assert r.outputs["videos"].shape == (4, 9, 3, 32, 32)


def test_lora_targets_reference_and_save_reload(folder: Path, tmp_path: Path) -> None:
    from diffusers import HunyuanVideo15Pipeline

    pol = make(folder, lora=LoraConfig(enabled=True, r=2, alpha=4), need_reference=True, noise_level=0.5)
    trainable = [n for n, p in pol.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)
    adapted = {n.split(".lora_")[0] for n, _ in pol.model.named_parameters() if ".lora_" in n}
    # the last (here the only) block's text-stream output never reaches the velocity: its adapters stay frozen
    assert not any(".to_add_out." in n or ".ff_context." in n for n in trainable)
    for m in (
        "attn.to_q",
        "attn.add_k_proj",
        "attn.to_add_out",
        "attn.to_out.0",
        "ff.net.2",
        "ff_context.net.0.proj",
    ):
        assert f"transformer_blocks.0.{m}" in adapted
    assert "proj_out" not in adapted and "x_embedder.proj" not in adapted
    r = pol.rollout(ROWS, 1)
    torch.testing.assert_close(pol.reference_logprobs(r), r.logp_old, rtol=0, atol=1e-5)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                p.add_(0.05)
    stats = pol.action_stats(r)
    assert (stats.kl.detach() > 0).any()
    pol.save(tmp_path / "saved")
    assert (tmp_path / "saved" / "transformer_lora").is_dir()
    again = make(tmp_path / "saved", noise_level=0.5)
    torch.testing.assert_close(again.action_stats(r).logp.detach(), stats.logp.detach(), atol=1e-5, rtol=0)
    assert isinstance(HunyuanVideo15Pipeline.from_pretrained(tmp_path / "saved"), HunyuanVideo15Pipeline)


def test_sizes_and_options_are_checked(folder: Path) -> None:
    with pytest.raises(ValueError, match="num_frames must be 1 \\+ a multiple"):
        make(folder, num_frames=8)
    with pytest.raises(ValueError, match="multiples of 4"):
        make(folder, height=30)
    with pytest.raises(ValueError, match="glyph_max_length"):
        make(folder, glyph_max_length=0)
    with pytest.raises(ValueError, match="one transformer"):
        make(folder, train_expert="high")
    default = make(folder, height=None, width=None)  # the pipeline's 16:9 bucket of target_size 32
    assert (default.height, default.width) == HunyuanVideo15Policy.default_size(default.model, 4)
    assert default.height < default.width and default.latent_shape()[2:] == (
        default.height // 4,
        default.width // 4,
    )
