"""Deterministic sampling (``noise_level: 0``): the denoising policies run the ODE, and from the same initial
noise their samples are the diffusers pipelines' on the same tiny components -- SD3 (CFG), FLUX.1-dev
(distilled guidance, and true CFG with a negative prompt), SD 1.5 DDIM (eta = 0, CFG). Training with it is
refused naming the config key; `evaluation_sampler` switches a training policy to ``eval_noise_level``."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from mmalign.config import ConfigError, config_from_dict
from mmalign.policies.ddim import DDIMPolicy
from mmalign.policies.flux import FluxPolicy, pack_latents, unpack_latents
from mmalign.policies.sd3 import SD3Policy
from mmalign.tiny.flux import build_tiny_flux
from mmalign.tiny.sd3 import build_tiny_sd3
from mmalign.tiny.sd15 import build_tiny_sd15

PROMPTS = ["a red cat", "Two blue dogs, left!"]
ROWS = [{"prompt": p} for p in PROMPTS]
SEQ = 8


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_sd3(tmp_path_factory.mktemp("ode_sd3") / "sd3", text_encoders=3)


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_flux(tmp_path_factory.mktemp("ode_flux") / "dev")


@pytest.fixture(scope="module")
def sd15_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_sd15(tmp_path_factory.mktemp("ode_sd15") / "sd15")


def ode_rollout(pol, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """(initial noise, final latents) of a deterministic rollout of ROWS (one sample each)."""
    pol.generator.manual_seed(seed)
    noise = pol._initial_noise(torch.arange(len(ROWS)))
    pol.generator.manual_seed(seed)
    r = pol.rollout(ROWS, 1, compute_logp=True)
    assert r.mask.shape == (len(ROWS), 0) and r.logp_old.shape == (len(ROWS), 0)  # no action to train
    return noise, r.outputs["latents"]


def test_sd3_ode_is_the_sd3_pipeline(sd3_dir: Path) -> None:
    from diffusers import StableDiffusion3Pipeline

    pol = SD3Policy.from_pretrained(
        sd3_dir, num_steps=4, guidance_scale=3.0, noise_level=0, max_sequence_length=SEQ, seed=0
    )
    noise, ours = ode_rollout(pol)
    c = pol.components
    pipe = StableDiffusion3Pipeline(
        transformer=c.transformer,
        scheduler=copy.deepcopy(c.scheduler),
        vae=c.vae,
        text_encoder=c.text_encoder,
        tokenizer=c.tokenizer,
        text_encoder_2=c.text_encoder_2,
        tokenizer_2=c.tokenizer_2,
        text_encoder_3=c.text_encoder_3,
        tokenizer_3=c.tokenizer_3,
    )
    side = pol.latent_size * pipe.vae_scale_factor
    ref = pipe(
        PROMPTS,
        num_inference_steps=4,
        guidance_scale=3.0,
        height=side,
        width=side,
        max_sequence_length=SEQ,
        latents=noise.clone(),
        output_type="latent",
    ).images
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours, noise, atol=1e-2)  # it did denoise


def flux_pipe(pol: FluxPolicy):
    from diffusers import FluxPipeline

    return FluxPipeline(
        scheduler=copy.deepcopy(pol.scheduler),
        vae=pol.vae,
        text_encoder=pol.text_encoder,
        tokenizer=pol.tokenizer,
        text_encoder_2=pol.text_encoder_2,
        tokenizer_2=pol.tokenizer_2,
        transformer=pol.model,
    )


@pytest.mark.parametrize(
    "cfg",
    [
        {"guidance_scale": 3.5},  # distilled guidance only
        {
            "guidance_scale": 3.5,
            "true_cfg_scale": 2.5,
            "negative_prompt": "blurry",
        },  # true CFG, as FluxPipeline
        {"guidance_scale": 3.5, "true_cfg_scale": 2.0},  # true CFG with the empty negative prompt
    ],
)
def test_flux_ode_is_the_flux_pipeline(flux_dir: Path, cfg: dict) -> None:
    pol = FluxPolicy.from_pretrained(
        flux_dir, num_steps=3, noise_level=0, max_sequence_length=SEQ, seed=0, **cfg
    )
    noise, ours = ode_rollout(pol)
    size = pol.latent_size * 2  # the tiny VAE down-samples 2x
    ref = flux_pipe(pol)(
        prompt=PROMPTS,
        negative_prompt=cfg.get("negative_prompt", "") if "true_cfg_scale" in cfg else None,
        true_cfg_scale=cfg.get("true_cfg_scale", 1.0),
        guidance_scale=cfg["guidance_scale"],
        height=size,
        width=size,
        num_inference_steps=3,
        max_sequence_length=SEQ,
        latents=pack_latents(noise),
        output_type="latent",
    ).images
    torch.testing.assert_close(
        ours, unpack_latents(ref, pol.latent_size, pol.latent_size), atol=1e-5, rtol=1e-5
    )
    if "true_cfg_scale" in cfg:  # true CFG changes the samples
        plain = FluxPolicy.from_pretrained(
            flux_dir, num_steps=3, noise_level=0, max_sequence_length=SEQ, seed=0, guidance_scale=3.5
        )
        assert not torch.allclose(ode_rollout(plain)[1], ours, atol=1e-4)


def test_true_cfg_is_flux_only(sd3_dir: Path) -> None:
    with pytest.raises(ValueError, match="true_cfg_scale is FLUX"):
        SD3Policy.from_pretrained(sd3_dir, num_steps=2, true_cfg_scale=2.0, max_sequence_length=SEQ)


def test_ddim_eta_zero_is_the_sd_pipeline(sd15_dir: Path) -> None:
    from diffusers import StableDiffusionPipeline

    pol = DDIMPolicy.from_pretrained(sd15_dir, num_steps=4, eta=0.0, guidance_scale=3.0, seed=0)
    noise, ours = ode_rollout(pol)
    pipe = StableDiffusionPipeline(
        vae=pol.vae,
        text_encoder=pol.text_encoder,
        tokenizer=pol.tokenizer,
        unet=pol.model,
        scheduler=copy.deepcopy(pol.scheduler),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    side = pol.latent_size * pipe.vae_scale_factor
    ref = pipe(
        PROMPTS,
        num_inference_steps=4,
        guidance_scale=3.0,
        eta=0.0,
        height=side,
        width=side,
        latents=noise.clone(),
        output_type="latent",
    ).images
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_evaluation_sampler_runs_the_ode_and_restores_the_training_sampler(sd3_dir: Path) -> None:
    pol = SD3Policy.from_pretrained(
        sd3_dir, num_steps=3, noise_level=0.7, guidance_scale=2.0, max_sequence_length=SEQ, seed=0
    )
    ode = SD3Policy.from_pretrained(
        sd3_dir, num_steps=3, noise_level=0, guidance_scale=2.0, max_sequence_length=SEQ, seed=0
    )
    with pol.evaluation_sampler() as how:
        assert how == {"sampler": "ode", "num_steps": 3} and pol.noise_level == 0
        _, evaluated = ode_rollout(pol)
    assert pol.noise_level == 0.7 and pol.sampler.eval_noise_level == 0
    torch.testing.assert_close(evaluated, ode_rollout(ode)[1], atol=0, rtol=0)
    sde_run = pol.rollout(ROWS, 1, compute_logp=True)
    assert sde_run.mask.shape == (2, 3)  # training sampling is untouched
    pol.sampler = pol.sampler.sampler_settings(eval_noise_level=None)  # evaluate at the training noise
    with pol.evaluation_sampler() as how:
        assert how == {"sampler": "sde", "sde_kind": "flow_sde", "noise_level": 0.7, "num_steps": 3}


@pytest.mark.parametrize(("family", "key"), [("sd3", "options.noise_level"), ("ddim", "options.eta")])
def test_training_with_the_ode_is_refused_naming_the_key(
    family: str, key: str, sd3_dir: Path, sd15_dir: Path, tmp_path: Path
) -> None:
    from mmalign.training.trainer import GroupTrainer
    from pipelines import TrainingSetup
    from rewards import RewardSet

    if family == "sd3":
        pol = SD3Policy.from_pretrained(sd3_dir, num_steps=2, noise_level=0, max_sequence_length=SEQ)
    else:
        pol = DDIMPolicy.from_pretrained(sd15_dir, num_steps=2, eta=0.0)
    cfg = config_from_dict(
        {
            "pipeline": "ode_test",
            "output_dir": str(tmp_path / "run"),
            "rewards": [{"name": "jpeg_compressibility"}],
            "trainer": {"steps": 1, "progress_bar": False},
        }
    )
    with pytest.raises(ConfigError, match=f"key '{key}': 0 samples the deterministic ODE"):
        GroupTrainer(cfg, TrainingSetup(policy=pol, rewards=RewardSet(cfg.rewards), data=ROWS))
