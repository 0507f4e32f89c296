"""DDIMPolicy on a tiny offline SD 1.5-style pipeline: round trip, prediction types, an independent log-prob,
the deterministic final step and its options (what every denoising policy shares is in
test_denoising_policies.py)."""

from __future__ import annotations

import pytest
import torch

from mmalign.policies.ddim import DDIMPolicy
from mmalign.policies.sd15_components import encode_prompt, load_sd15_components
from mmalign.tiny.sd15 import SD15_SCHEDULER, build_tiny_sd15

ROWS = [{"prompt": "a red cat", "label": 1}, {"prompt": "a blue dog", "label": 2}]


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_sd15(tmp_path_factory.mktemp("tiny_sd15") / "sd15")


def make(pipe_dir, **kw) -> DDIMPolicy:
    kw.setdefault("num_steps", 4)
    kw.setdefault("seed", 0)
    return DDIMPolicy.from_pretrained(pipe_dir, **kw)


def with_scheduler(pipe_dir, **sched_overrides) -> tuple:
    """Components of the tiny folder with a DDIM scheduler whose config is changed by `sched_overrides`."""
    from diffusers import DDIMScheduler

    c = load_sd15_components(pipe_dir)
    sched = DDIMScheduler.from_config(c.scheduler.config, **sched_overrides)
    return c.unet, c.vae, sched, c.text_encoder, c.tokenizer


def test_tiny_pipeline_round_trip(pipe_dir, tmp_path):
    from diffusers import DDIMScheduler, PNDMScheduler

    for sub in ("unet", "vae", "scheduler", "text_encoder", "tokenizer"):
        assert (pipe_dir / sub).is_dir()
    c = load_sd15_components(pipe_dir)
    assert isinstance(c.scheduler, DDIMScheduler) and c.scheduler.config.clip_sample is False
    pe = encode_prompt(c.text_encoder, c.tokenizer, ["a red cat", ""])
    assert pe.shape == (2, c.tokenizer.model_max_length, c.unet.config.cross_attention_dim)
    c2 = load_sd15_components(pipe_dir)
    for (n, p), (_, q) in zip(c.unet.named_parameters(), c2.unet.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    # a real SD 1.5 folder ships a PNDM scheduler config: it loads as DDIM with the same schedule
    PNDMScheduler(
        **{k: v for k, v in SD15_SCHEDULER.items() if k != "clip_sample"}, skip_prk_steps=True
    ).save_pretrained(tmp_path / "scheduler")
    s = DDIMScheduler.from_pretrained(tmp_path, subfolder="scheduler")
    assert isinstance(s, DDIMScheduler) and s.config.steps_offset == 1
    torch.testing.assert_close(s.alphas_cumprod, c.scheduler.alphas_cumprod)


@pytest.mark.parametrize("prediction_type", ["v_prediction", "sample"])
def test_other_prediction_types_ratio_is_one(pipe_dir, prediction_type):
    pol = DDIMPolicy(*with_scheduler(pipe_dir, prediction_type=prediction_type), num_steps=3, seed=0)
    r = pol.rollout(ROWS, 2, compute_logp=True)
    torch.testing.assert_close(pol.action_stats(r).logp.detach(), r.logp_old, atol=1e-5, rtol=0)


def test_logprob_matches_an_independent_computation(pipe_dir):
    """Stored log-probs of the first and the last step equal Normal(mu, std).log_prob(x') computed here
    from the scheduler's alphas, and mu is what diffusers' DDIMScheduler.step computes."""
    eta = 0.8
    pol = make(pipe_dir, eta=eta)
    r = pol.rollout(ROWS, 2, compute_logp=True)
    sched = load_sd15_components(pipe_dir).scheduler
    sched.set_timesteps(4)
    acp = sched.alphas_cumprod.double()
    pe = encode_prompt(pol.text_encoder, pol.tokenizer, r.prompts)
    for j, t, t_prev in [(0, 751, 501), (3, 1, None)]:
        x = r.payload["latents"][:, j]
        x_next = r.payload["next_latents"][:, j]
        a_t = acp[t]
        # set_alpha_to_one=False: the final alpha is alpha_bar_0
        a_p = acp[t_prev] if t_prev is not None else acp[0]
        with torch.no_grad():
            eps = pol.model(x, torch.full((4,), t), encoder_hidden_states=pe).sample.double()
        x0 = (x.double() - (1 - a_t).sqrt() * eps) / a_t.sqrt()
        std = eta * ((1 - a_p) / (1 - a_t)).sqrt() * (1 - a_t / a_p).sqrt()
        mean = a_p.sqrt() * x0 + (1 - a_p - std**2).sqrt() * eps
        expected = torch.distributions.Normal(mean, std).log_prob(x_next.double()).mean(dim=(1, 2, 3))
        torch.testing.assert_close(r.logp_old[:, j].double(), expected, atol=1e-4, rtol=0)
        noise = (x_next.double() - mean) / std
        ref = sched.step(eps.float(), t, x, eta=eta, variance_noise=noise.float()).prev_sample
        torch.testing.assert_close(ref, x_next, atol=1e-4, rtol=1e-4)


def test_final_step_to_clean_sample_is_deterministic(pipe_dir):
    """With set_alpha_to_one the last step ends at alpha-bar 1 (std 0): it runs as an eta=0 DDIM update
    and is never trained; windows stay within the stochastic steps."""
    comps = with_scheduler(pipe_dir, set_alpha_to_one=True)
    pol = DDIMPolicy(*comps, num_steps=4, seed=0)
    assert pol.num_sde_steps == 3
    r = pol.rollout(ROWS, 2, compute_logp=True)
    assert r.mask.shape == (4, 3) and r.payload["step_index"][0].tolist() == [0, 1, 2]
    assert (r.payload["alpha_bar_prev"] < 1).all()
    torch.testing.assert_close(pol.action_stats(r).logp.detach(), r.logp_old, atol=1e-5, rtol=0)
    # the output is the eta=0 step from the last stored x_{t-1}: x0_hat = (x - sqrt(1-ab) eps) / sqrt(ab)
    x = r.payload["next_latents"][:, -1]
    ab = float(pol.scheduler.alphas_cumprod[1])
    with torch.no_grad():
        eps = pol.model(x, torch.full((4,), 1), encoder_hidden_states=r.payload["prompt_embeds"]).sample
    x0_hat = (x - (1 - ab) ** 0.5 * eps) / ab**0.5
    torch.testing.assert_close(r.outputs["latents"], x0_hat, atol=1e-4, rtol=1e-4)
    win = DDIMPolicy(*comps, num_steps=4, seed=0, window_size=3).rollout(ROWS, 1)
    assert win.payload["step_index"][0].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="window_size"):
        DDIMPolicy(*comps, num_steps=4, window_size=4)
    with pytest.raises(ValueError, match="nothing to train"):
        DDIMPolicy(*comps, num_steps=1)


def test_invalid_options_are_refused(pipe_dir):
    with pytest.raises(ValueError, match="eta"):
        DDIMPolicy(*with_scheduler(pipe_dir), eta=-0.5)
    with pytest.raises(ValueError, match="clip_sample"):
        DDIMPolicy(*with_scheduler(pipe_dir, clip_sample=True))
    with pytest.raises(ValueError, match="prediction_type"):
        DDIMPolicy(*with_scheduler(pipe_dir, prediction_type="flow"))
