"""DDIMPolicy on a tiny offline SD 1.5-style pipeline: round trip, shapes, ratio = 1, an independent
log-prob, gradients, the deterministic final step, LoRA reference, save/load and the shared trainer."""

from __future__ import annotations

import pytest
import torch

from mmalign.policies.ddim import DDIMPolicy
from mmalign.tiny_ddim import SD15_SCHEDULER, build_tiny_sd15, encode_prompt, load_sd15_components

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


def test_rollout_shapes_and_decode(pipe_dir):
    pol = make(pipe_dir)
    r = pol.rollout(ROWS, 3, compute_logp=True)
    b, c, s = 6, pol.model.config.in_channels, pol.latent_size
    assert r.mask.shape == (b, 4) and r.mask.all()
    assert r.logp_old.shape == (b, 4) and torch.isfinite(r.logp_old).all()
    assert r.outputs["latents"].shape == (b, c, s, s)
    assert r.payload["latents"].shape == (b, 4, c, s, s)
    assert r.payload["timesteps"][0].tolist() == [751, 501, 251, 1]
    assert r.group.tolist() == [0, 0, 0, 1, 1, 1]
    assert r.columns["label"] == [1, 1, 1, 2, 2, 2]
    img = pol.decode(r)
    assert img.shape == (b, 3, 2 * s, 2 * s) and img.min() >= 0 and img.max() <= 1
    assert r.outputs["images"] is img
    # consecutive trained transitions chain: x_{t-1} of step j is x_t of step j+1; the last is the output
    assert torch.equal(r.payload["next_latents"][:, 0], r.payload["latents"][:, 1])
    assert torch.equal(r.payload["next_latents"][:, -1], r.outputs["latents"])


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"guidance_scale": 3.0},
        {"window_size": 2},
        {"train_fraction": 0.5},
        {"same_initial_noise": True},
        {"guidance_scale": 2.0, "window_size": 1, "eta": 0.5},
    ],
)
def test_reevaluate_ratio_is_one(pipe_dir, opts):
    pol = make(pipe_dir, **opts)
    r = pol.rollout(ROWS, 2, compute_logp=True)
    stats = pol.evaluate(r)
    ratio = torch.exp(stats.logp - r.logp_old)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    sub = r[[1, 2]]  # also on a minibatch slice
    torch.testing.assert_close(pol.evaluate(sub).logp.detach(), sub.logp_old, atol=1e-5, rtol=0)


@pytest.mark.parametrize("prediction_type", ["v_prediction", "sample"])
def test_other_prediction_types_ratio_is_one(pipe_dir, prediction_type):
    pol = DDIMPolicy(*with_scheduler(pipe_dir, prediction_type=prediction_type), num_steps=3, seed=0)
    r = pol.rollout(ROWS, 2, compute_logp=True)
    torch.testing.assert_close(pol.evaluate(r).logp.detach(), r.logp_old, atol=1e-5, rtol=0)


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
    torch.testing.assert_close(pol.evaluate(r).logp.detach(), r.logp_old, atol=1e-5, rtol=0)
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
        DDIMPolicy(*with_scheduler(pipe_dir), eta=0.0)
    with pytest.raises(ValueError, match="clip_sample"):
        DDIMPolicy(*with_scheduler(pipe_dir, clip_sample=True))
    with pytest.raises(ValueError, match="prediction_type"):
        DDIMPolicy(*with_scheduler(pipe_dir, prediction_type="flow"))


def test_gradients_reach_unet(pipe_dir):
    pol = make(pipe_dir, guidance_scale=2.0)
    r = pol.rollout(ROWS, 2, compute_logp=True)
    pol.evaluate(r).logp.sum().backward()
    grads = [p.grad for p in pol.trainable_parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    assert all(p.grad is None for p in pol.vae.parameters())
    assert all(p.grad is None for p in pol.text_encoder.parameters())


def test_same_initial_noise_and_window(pipe_dir):
    pol = make(pipe_dir, same_initial_noise=True)
    r = pol.rollout(ROWS, 3, compute_logp=False)
    x0 = r.payload["latents"][:, 0]
    assert torch.equal(x0[0], x0[1]) and torch.equal(x0[0], x0[2])
    assert not torch.equal(x0[0], x0[3])
    assert r.logp_old is None
    assert not torch.equal(r.outputs["latents"][0], r.outputs["latents"][1])  # step noise differs
    pol = make(pipe_dir, num_steps=6, window_size=2, window_range=(1, 3))
    r = pol.rollout(ROWS, 2, compute_logp=True)
    assert r.mask.shape == (4, 2) and r.logp_old.shape == (4, 2)
    idx = r.payload["step_index"]
    assert (idx[:, 1] - idx[:, 0] == 1).all() and 1 <= int(idx[0, 0]) <= 3
    assert (idx == idx[0]).all()


def test_kl_zero_at_start_and_save_load(pipe_dir, tmp_path):
    pol = make(pipe_dir, need_reference=True)
    r = pol.rollout(ROWS, 2, compute_logp=True)
    stats = pol.evaluate(r)
    assert stats.kl is not None and stats.kl.shape == (4, 4)
    torch.testing.assert_close(stats.kl.detach(), torch.zeros(4, 4), atol=1e-8, rtol=0)
    torch.testing.assert_close(pol.reference_logprobs(r), r.logp_old, atol=1e-5, rtol=0)
    state = pol.trainable_state_dict()
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(0.01)
    assert (pol.evaluate(r).kl.detach() > 0).any()
    pol.load_trainable_state_dict(state)
    with torch.no_grad():
        pol.model.conv_out.bias.add_(0.1)  # a change the saved folder must carry
    pol.save(tmp_path / "out")
    again = DDIMPolicy.from_pretrained(tmp_path / "out", num_steps=4)
    for (n, p), (_, q) in zip(pol.model.named_parameters(), again.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    expected = pol.evaluate(r).logp.detach()
    torch.testing.assert_close(again.evaluate(r).logp.detach(), expected, atol=1e-6, rtol=0)


def test_lora_reference_is_disabled_adapter(pipe_dir, tmp_path):
    from mmalign.config import LoraConfig

    pol = make(pipe_dir, need_reference=True, lora=LoraConfig(enabled=True, r=4))
    names = [n for n, p in pol.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    r = pol.rollout(ROWS, 2, compute_logp=True)
    stats = pol.evaluate(r)
    torch.testing.assert_close(stats.kl.detach(), torch.zeros(4, 4), atol=1e-8, rtol=0)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                p.add_(0.5)
    stats = pol.evaluate(r)
    assert (stats.kl.detach() > 0).any()
    torch.testing.assert_close(pol.reference_logprobs(r), r.logp_old, atol=1e-5, rtol=0)  # adapter off = base
    assert not torch.allclose(stats.logp.detach(), r.logp_old, atol=1e-4)
    stats.logp.sum().backward()
    assert all(p.grad is not None for p in pol.trainable_parameters())
    assert all(p.grad is None for n, p in pol.model.named_parameters() if "lora_" not in n)
    pol.save(tmp_path / "merged")
    assert (tmp_path / "merged" / "unet_lora").is_dir()
    merged = DDIMPolicy.from_pretrained(tmp_path / "merged", num_steps=4)
    torch.testing.assert_close(merged.evaluate(r).logp.detach(), stats.logp.detach(), atol=1e-4, rtol=1e-5)


def test_group_trainer_runs_the_ddim_policy(pipe_dir, tmp_path):
    """The shared loop drives DDIM steps as actions: pixels are decoded only because the reward needs
    them, the policy's own step-mean KL is used, and the UNet's weights move."""
    from mmalign.config import config_from_dict
    from mmalign.trainer import GroupTrainer
    from pipelines import Components
    from rewards import RewardSet

    cfg = config_from_dict(
        {
            "pipeline": "ddim_test",
            "output_dir": str(tmp_path / "run"),
            "rollout": {"group_size": 4, "prompts_per_step": 2},
            "rewards": [{"name": "jpeg_incompressibility"}],
            "algorithm": {"kl_coef": 0.01},
            "trainer": {"steps": 2, "lr": 1e-3, "progress_bar": False, "save_every": 1},
        },
        "test",
    )
    pol = make(pipe_dir, num_steps=3, need_reference=True)
    rows = [{"prompt": "a red square"}, {"prompt": "two blue circles"}, {"prompt": "green"}]
    before = {k: v.clone() for k, v in pol.trainable_state_dict().items()}
    trainer = GroupTrainer(cfg, Components(policy=pol, rewards=RewardSet(cfg.rewards), data=rows))
    history = trainer.train()
    assert [m["step"] for m in history] == [1, 2]
    assert "images" in trainer._last_batch.outputs and trainer._last_batch.logp_ref is None
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-8) and history[1]["kl"] > 0
    after = pol.trainable_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
