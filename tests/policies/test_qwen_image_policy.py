"""QwenImagePolicy on tiny offline Qwen-Image folders (`mmalign.tiny.qwen_image`): the folder round trip through
diffusers' ``QwenImagePipeline``, prompt states against the pipeline's, the whole deterministic sampler (ODE, true
CFG with norm rescaling) against the pipeline from the same initial noise, decoding, ratio 1 on re-scoring, LoRA
(reference = adapter off, KL 0, save / reload) and the text_to_image pipeline choosing the policy."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import Tensor

from mmalign import tiny
from mmalign.config import LoraConfig
from mmalign.policies.flux import pack_latents, unpack_latents
from mmalign.policies.qwen_image import QwenImagePolicy, cfg_norm_rescale
from mmalign.policies.qwen_image_components import (
    PROMPT_DROP,
    PROMPT_TEMPLATE,
    is_qwen_image_folder,
    load_qwen_image_components,
)

ROWS = [{"prompt": "two red squares on the left"}, {"prompt": "one blue square at the top"}]
SEQ = 24
"""Prompt states per prompt in the tests (the tiny captions are shorter)."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build("qwen_image_tiny", tmp_path_factory.mktemp("qwen") / "tiny", announce=False)


def make(path: Path, **kw) -> QwenImagePolicy:
    for k, v in {"num_steps": 4, "seed": 0, "latent_size": 16, "max_sequence_length": SEQ}.items():
        kw.setdefault(k, v)
    return QwenImagePolicy.from_pretrained(path, **kw)


def qwen_pipe(pol: QwenImagePolicy):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline(
        scheduler=copy.deepcopy(pol.scheduler),
        vae=pol.vae,
        text_encoder=pol.text_encoder,
        tokenizer=pol.tokenizer,
        transformer=pol.model,
    )


# ----------------------------------------------------------------------------- folder and prompts


def test_folder_loads_in_diffusers_and_matches_the_pipeline_template(folder: Path) -> None:
    from diffusers import QwenImagePipeline

    assert "qwen_image_tiny" in tiny.load_builders() and "qwen_image" in tiny.load_builders()
    pipe = QwenImagePipeline.from_pretrained(folder)
    assert pipe.prompt_template_encode == PROMPT_TEMPLATE
    assert pipe.prompt_template_encode_start_idx == PROMPT_DROP
    # the tiny tokenizer splits the template's system part into exactly the tokens the pipeline drops
    assert len(pipe.tokenizer(PROMPT_TEMPLATE.split("{}")[0]).input_ids) == PROMPT_DROP
    c = load_qwen_image_components(folder)
    assert type(c.transformer).__name__ == "QwenImageTransformer2DModel"
    assert type(c.text_encoder).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert is_qwen_image_folder(folder) and is_qwen_image_folder("Qwen/Qwen-Image")
    assert not is_qwen_image_folder("stabilityai/stable-diffusion-3.5-medium")


def test_prompt_states_equal_the_pipeline(folder: Path) -> None:
    pol = make(folder)
    pipe = qwen_pipe(pol)
    prompts = ["two red squares on the left", "", "four yellow squares at the bottom"]
    embeds, mask = pol.encode_prompt(prompts)
    with torch.no_grad():
        theirs, their_mask = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=SEQ)
    n = theirs.shape[1]  # the pipeline pads to the batch's longest prompt, the policy to max_sequence_length
    assert embeds.shape == (3, SEQ, 32) and n < SEQ
    torch.testing.assert_close(embeds[:, :n], theirs.float(), rtol=0, atol=0)
    torch.testing.assert_close(mask[:, :n], their_mask.float(), rtol=0, atol=0)
    assert float(mask[:, n:].abs().sum()) == 0 and float(embeds[:, n:].abs().sum()) == 0
    assert int(mask[1].sum()) == 5  # "" leaves the template's tail: <|im_end|> \n <|im_start|> assistant \n


def test_padding_does_not_change_the_velocity(folder: Path) -> None:
    short, long = make(folder, max_sequence_length=SEQ), make(folder, max_sequence_length=3 * SEQ)
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    sched = {"sigmas": torch.tensor([0.7, 0.3])}
    prompts = [r["prompt"] for r in ROWS]
    with torch.no_grad():
        a = short.velocity(short.model, x, sched, short.conditioning(prompts))
        b = long.velocity(long.model, x, sched, long.conditioning(prompts))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- sampler parity


def _ode_rollout(pol: QwenImagePolicy, noise: Tensor, prompts: list[str]) -> Tensor:
    """The policy's deterministic sampler from `noise` (noise_level 0: every step the ODE step)."""
    pol.noise_level = 0.0
    assert pol.sampler.deterministic
    pol.generator.manual_seed(7)
    torch.testing.assert_close(pol._initial_noise(torch.arange(len(prompts))), noise)
    pol.generator.manual_seed(7)
    r = pol.rollout([{"prompt": p} for p in prompts], 1, compute_logp=False)
    assert r.num_actions == 0
    return r.outputs["latents"]


@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_ode_sampler_equals_qwen_image_pipeline(folder: Path, cfg: float) -> None:
    """Same initial noise, 4 steps, true CFG with the empty negative prompt: the policy's final latents are the
    pipeline's (max relative difference printed; measured 1.5e-7 in fp32)."""
    pol = make(folder, guidance_scale=cfg)
    prompts = [r["prompt"] for r in ROWS]
    noise = torch.randn((2, 4, 16, 16), generator=torch.Generator().manual_seed(7))
    ours = _ode_rollout(pol, noise, prompts)
    kw = {"negative_prompt": ["", ""], "true_cfg_scale": cfg} if cfg > 1 else {"true_cfg_scale": 1.0}
    theirs = qwen_pipe(pol)(
        prompt=prompts,
        height=32,
        width=32,
        num_inference_steps=4,
        latents=pack_latents(noise),
        max_sequence_length=SEQ,
        output_type="latent",
        **kw,
    ).images
    theirs = unpack_latents(theirs.float(), 16, 16)
    rel = float((ours - theirs).abs().max() / theirs.abs().max())
    print(f"Qwen-Image ODE parity (true_cfg_scale {cfg}): max relative difference {rel:.2e}")
    assert rel < 1e-5


def test_cfg_norm_rescale_by_hand() -> None:
    g = torch.randn(1, 4, 2, 2, generator=torch.Generator().manual_seed(0))
    c = torch.randn(1, 4, 2, 2, generator=torch.Generator().manual_seed(1))
    out = cfg_norm_rescale(g, c)
    # one 2x2 patch = one token: its 16 values (4 channels x 4 pixels) rescaled together
    expected = g * (c.flatten().norm() / g.flatten().norm())
    torch.testing.assert_close(out, expected)


def test_decode_equals_the_pipeline(folder: Path) -> None:
    pol = make(folder)
    z = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(2))
    ours = pol.decode_latents(z)
    theirs = qwen_pipe(pol)(
        prompt=["a", "b"],
        height=32,
        width=32,
        num_inference_steps=1,
        true_cfg_scale=1.0,
        max_sequence_length=SEQ,
        output_type="pt",
        callback_on_step_end=lambda p, i, t, kw: {"latents": pack_latents(z)},
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
    assert all(
        g is not None
        for n, g in grads.items()
        if n.startswith(("img_in", "proj_out", "transformer_blocks.0"))
    )
    assert not any(p.requires_grad for p in pol.text_encoder.parameters())
    pol.decode(r)
    assert r.outputs["images"].shape == (4, 3, 32, 32)


def test_lora_reference_kl_and_save_reload(folder: Path, tmp_path: Path) -> None:
    from diffusers import QwenImagePipeline

    pol = make(folder, lora=LoraConfig(enabled=True, r=2, alpha=4), need_reference=True)
    trainable = [n for n, p in pol.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)
    r = pol.rollout(ROWS, 1)
    stats = pol.action_stats(r)
    torch.testing.assert_close(pol.reference_logprobs(r), r.logp_old, rtol=0, atol=1e-5)
    assert float(stats.kl.detach().abs().max()) < 1e-8
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(0.05)
    pol.save(tmp_path / "saved")
    assert (tmp_path / "saved" / "transformer_lora").is_dir()
    again = make(tmp_path / "saved")
    x = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    sched, cond = {"sigmas": torch.tensor([0.5])}, pol.conditioning(["a"])
    with torch.no_grad():
        torch.testing.assert_close(
            again.velocity(again.model, x, sched, cond),
            pol.velocity(pol.model, x, sched, cond),
            atol=1e-5,
            rtol=0,
        )
    assert isinstance(QwenImagePipeline.from_pretrained(tmp_path / "saved"), QwenImagePipeline)


def test_sizes_are_checked(folder: Path) -> None:
    with pytest.raises(ValueError, match="latent_size must be even"):
        make(folder, latent_size=15)
    with pytest.raises(ValueError, match="max_sequence_length"):
        make(folder, max_sequence_length=2000)
    assert make(folder, latent_size=None).latent_size == 512  # 1024 px over the tiny VAE's factor 2
