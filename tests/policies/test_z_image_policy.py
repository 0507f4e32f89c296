"""ZImagePolicy on a tiny offline Z-Image folder (`mmalign.tiny.z_image`): the folder round trip through diffusers'
``ZImagePipeline``, the prompt states against the pipeline's, the whole deterministic sampler (ODE, with and
without CFG) against the pipeline from the same initial noise, decoding, ratio 1 on re-scoring, LoRA (reference
= adapter off, save / reload), the family registry choosing the policy, and size errors."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from mmalign import tiny
from mmalign.config import LoraConfig
from mmalign.policies.families import family_for, policy_class_for
from mmalign.policies.z_image import ZImagePolicy
from mmalign.policies.z_image_components import load_z_image_components

ROWS = [{"prompt": "two red squares on the left"}, {"prompt": "one blue square at the top"}]
SEQ = 32
"""Prompt tokens per prompt in the tests (template included; the tiny captions are shorter)."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build("z_image_tiny", tmp_path_factory.mktemp("zimage") / "tiny", announce=False)


def make(path: Path, **kw) -> ZImagePolicy:
    for k, v in {"num_steps": 4, "seed": 0, "latent_size": 16, "max_sequence_length": SEQ}.items():
        kw.setdefault(k, v)
    return ZImagePolicy.from_pretrained(path, **kw)


def z_pipe(pol: ZImagePolicy):
    from diffusers import ZImagePipeline

    return ZImagePipeline(
        scheduler=copy.deepcopy(pol.scheduler),
        vae=pol.vae,
        text_encoder=pol.text_encoder,
        tokenizer=pol.tokenizer,
        transformer=pol.model,
    )


# ----------------------------------------------------------------------------- folder and prompts


def test_folder_loads_in_diffusers_and_the_registry_picks_the_policy(folder: Path) -> None:
    from diffusers import ZImagePipeline

    assert "z_image_tiny" in tiny.load_builders()
    pipe = ZImagePipeline.from_pretrained(folder)
    assert type(pipe.transformer).__name__ == "ZImageTransformer2DModel"
    assert type(pipe.text_encoder).__name__ == "Qwen3Model"
    assert pipe.scheduler.config.shift == 3.0 and not pipe.scheduler.config.use_dynamic_shifting
    c = load_z_image_components(folder)
    assert type(c.vae).__name__ == "AutoencoderKL" and type(c.tokenizer).__name__ == "Qwen2Tokenizer"
    assert policy_class_for(folder, "text_to_image") is ZImagePolicy
    assert family_for("Tongyi-MAI/Z-Image-Turbo", "text_to_image").name == "z_image"
    assert family_for(folder / "transformer" / "..", "text_to_image").name == "z_image"


def test_prompt_states_equal_the_pipeline(folder: Path) -> None:
    pol = make(folder)
    prompts = ["two red squares on the left", "", "four yellow squares at the bottom"]
    embeds, mask = pol.encode_prompt(prompts)
    with torch.no_grad():
        theirs, _ = z_pipe(pol).encode_prompt(
            list(prompts), device="cpu", do_classifier_free_guidance=False, max_sequence_length=SEQ
        )
    assert embeds.shape == (3, SEQ, 32)
    for i, t in enumerate(theirs):  # the pipeline's ragged list: the valid tokens' states
        n = t.shape[0]
        assert int(mask[i].sum()) == n and bool(mask[i, :n].all())
        torch.testing.assert_close(embeds[i, :n], t.float(), rtol=0, atol=0)
        assert float(embeds[i, n:].abs().sum()) == 0
    # truncation at max_sequence_length, as the pipeline
    short, short_mask = make(folder, max_sequence_length=6).encode_prompt(prompts[:1])
    assert short.shape == (1, 6, 32) and bool(short_mask.all())


def test_padding_does_not_change_the_velocity(folder: Path) -> None:
    a_pol, b_pol = make(folder, max_sequence_length=SEQ), make(folder, max_sequence_length=3 * SEQ)
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    sched = {"sigmas": torch.tensor([0.7, 0.3])}
    prompts = [r["prompt"] for r in ROWS]
    with torch.no_grad():
        a = a_pol.velocity(a_pol.model, x, sched, a_pol.conditioning(prompts))
        b = b_pol.velocity(b_pol.model, x, sched, b_pol.conditioning(prompts))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- sampler parity


@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_ode_sampler_equals_z_image_pipeline(folder: Path, cfg: float) -> None:
    """Same initial noise, 4 steps: a deterministic rollout (noise_level 0: every step the Euler ODE step) ends at
    the pipeline's latents. mmalign's guidance w is the pipeline's g + 1 (w = 1: the pipeline's g = 0, no CFG;
    the empty negative prompt either way). Max relative difference printed; measured 0 without CFG and ~1e-7
    with it (fp32)."""
    pol = make(folder, guidance_scale=cfg, noise_level=0.0)
    assert pol.sampler.deterministic
    prompts = [r["prompt"] for r in ROWS]
    pol.generator.manual_seed(7)
    noise = pol._initial_noise(torch.arange(2))
    pol.generator.manual_seed(7)
    r = pol.rollout(ROWS, 1, compute_logp=False)
    assert r.num_actions == 0
    ours = r.outputs["latents"]
    with torch.no_grad():
        theirs = z_pipe(pol)(
            prompt=prompts,
            height=32,
            width=32,
            num_inference_steps=4,
            guidance_scale=cfg - 1.0,
            latents=noise.clone(),
            max_sequence_length=SEQ,
            output_type="latent",
        ).images
    rel = float((ours - theirs).abs().max() / theirs.abs().max())
    print(f"Z-Image ODE parity (guidance {cfg}): max relative difference {rel:.2e}")
    assert rel < 1e-5, rel


def test_decode_equals_the_pipeline(folder: Path) -> None:
    pol = make(folder)
    z = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(2))
    ours = pol.decode_latents(z)
    with torch.no_grad():
        theirs = z_pipe(pol)(
            prompt=["a", "b"],
            height=32,
            width=32,
            num_inference_steps=1,
            guidance_scale=0.0,
            max_sequence_length=SEQ,
            output_type="pt",
            callback_on_step_end=lambda p, i, t, kw: {"latents": z},
        ).images
    assert ours.shape == (2, 3, 32, 32)
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("kind", ["flow_sde", "cps"])
def test_ratio_is_one_and_gradients_reach_the_transformer(folder: Path, kind: str) -> None:
    pol = make(folder, sde_kind=kind, noise_level=0.5, guidance_scale=2.0, window_size=2)
    r = pol.rollout(ROWS, 2)
    assert r.num_actions == 2 and r.payload["prompt_mask"].shape == (4, SEQ)
    stats = pol.action_stats(r)
    torch.testing.assert_close(torch.exp(stats.logp - r.logp_old), torch.ones(4, 2), rtol=0, atol=1e-5)
    stats.logp.sum().backward()
    grads = {n: p.grad for n, p in pol.model.named_parameters() if p.requires_grad}
    assert (
        grads["all_x_embedder.2-1.weight"] is not None and grads["layers.0.attention.to_q.weight"] is not None
    )
    assert not any(p.requires_grad for p in pol.text_encoder.parameters())
    # a subset re-scores with its own stored states
    sub = r[torch.tensor([3, 0])]
    torch.testing.assert_close(pol.action_stats(sub).logp.detach(), r.logp_old[[3, 0]], atol=1e-5, rtol=0)
    pol.decode(r)
    assert r.outputs["images"].shape == (4, 3, 32, 32)


def test_lora_targets_reference_and_save_reload(folder: Path, tmp_path: Path) -> None:
    from diffusers import ZImagePipeline

    pol = make(folder, lora=LoraConfig(enabled=True, r=2, alpha=4), need_reference=True, noise_level=0.5)
    trainable = [n for n, p in pol.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)
    adapted = {n.split(".lora_")[0] for n in trainable}
    for block in ("layers.0", "noise_refiner.0", "context_refiner.0"):
        for m in ("attention.to_q", "attention.to_out.0", "feed_forward.w1", "feed_forward.w3"):
            assert f"{block}.{m}" in adapted
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
    assert isinstance(ZImagePipeline.from_pretrained(tmp_path / "saved"), ZImagePipeline)


def test_sizes_are_checked(folder: Path) -> None:
    with pytest.raises(ValueError, match="latent_size must be even"):
        make(folder, latent_size=15)
    with pytest.raises(ValueError, match="max_sequence_length"):
        make(folder, max_sequence_length=0)
    assert make(folder, latent_size=None).latent_size == 512  # 1024 px over the tiny VAE's factor 2
