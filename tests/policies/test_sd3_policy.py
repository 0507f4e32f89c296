"""SD3Policy on a tiny offline SD3-style pipeline: round trip, the KL's sigma_t, step kinds, options, CFG-free
training, the SD3 layout and schedule (what every denoising policy shares is in test_denoising_policies.py)."""

from __future__ import annotations

import pytest
import torch

from mmalign.policies.sd3 import SD3Policy
from mmalign.policies.sd3_components import encode_prompt, load_sd3_components
from mmalign.tiny.sd3 import build_tiny_sd3

ROWS = [{"prompt": "a red cat", "label": 1}, {"prompt": "a blue dog", "label": 2}]


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3") / "sd3")


def make(pipe_dir, **kw) -> SD3Policy:
    kw.setdefault("num_steps", 4)
    kw.setdefault("seed", 0)
    return SD3Policy.from_pretrained(pipe_dir, **kw)


def test_tiny_pipeline_round_trip(pipe_dir):
    for sub in ("transformer", "vae", "scheduler", "text_encoder", "tokenizer"):
        assert (pipe_dir / sub).is_dir()
    c = load_sd3_components(pipe_dir)
    pe, po = encode_prompt(c.text_encoder, c.tokenizer, ["a red cat", ""])
    assert pe.shape[0] == 2 and pe.shape[2] == c.transformer.config.joint_attention_dim
    assert po.shape == (2, c.transformer.config.pooled_projection_dim)
    c2 = load_sd3_components(pipe_dir)
    for (n, p), (_, q) in zip(
        c.transformer.named_parameters(), c2.transformer.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("kind,level", [("flow_sde", 0.7), ("dance", 0.3), ("cps", 0.5)])
def test_kl_divides_by_sigma_t_without_sqrt_dt(pipe_dir, kind, level):
    """evaluate's KL equals ||mu - mu_ref||^2 / (2 sigma_t^2), sigma_t written here from the formula:
    flow_sde a sqrt(sigma / (1 - sigma)), dance eta, cps sigma' sin(a pi / 2) (Flow-GRPO's std_dev_t)."""
    import math

    from mmalign.algorithms import sde

    pol = make(pipe_dir, need_reference=True, sde_kind=kind, noise_level=level)
    r = pol.rollout(ROWS, 2, compute_logp=True)
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        kl = pol.action_stats(r).kl
        pay = r.payload
        fallback = float(pay["sigma_max_fallback"][0])
        for j in range(r.num_actions):
            x, s, sn = pay["latents"][:, j], pay["sigmas"][:, j], pay["sigmas_next"][:, j]
            opts = (
                {"noise_level": level, "sigma_max_fallback": fallback}
                if kind == "flow_sde"
                else ({"eta": level} if kind == "dance" else {"noise_level": level})
            )
            sched = {"sigmas": s}
            cond = {"prompt_embeds": pay["prompt_embeds"], "pooled_embeds": pay["pooled_embeds"]}
            v = pol.predict(pol.model, x, sched, cond, guided=pol.train_guidance)[0]
            v_ref = pol.predict(pol.ref_model, x, sched, cond, guided=pol.train_guidance)[0]
            mu = sde.step(kind, v, x, s, sn, **opts).mean
            mu_ref = sde.step(kind, v_ref, x, s, sn, **opts).mean
            for i in range(len(r)):
                sig, sig_n = float(s[i]), float(sn[i])
                if kind == "flow_sde":
                    sigma_t = level * math.sqrt(sig / (1 - (fallback if sig == 1 else sig)))
                elif kind == "dance":
                    sigma_t = level
                else:
                    sigma_t = sig_n * math.sin(level * math.pi / 2)
                expected = float(((mu[i] - mu_ref[i]) ** 2).mean()) / (2 * sigma_t**2)
                assert float(kl[i, j]) == pytest.approx(expected, rel=1e-4), (i, j)
    assert float(kl.max()) > 0


# ---------------------------------------------------------------------------- step kinds


@pytest.mark.parametrize("kind", ["flow_sde", "cps", "dance"])
def test_step_kinds_ratio_one(pipe_dir, kind):
    pol = make(pipe_dir, sde_kind=kind, noise_level=0.5, need_reference=True)
    r = pol.rollout(ROWS, 2, compute_logp=True)
    assert torch.isfinite(r.logp_old).all() and torch.isfinite(r.outputs["latents"]).all()
    # CPS's final step to sigma' = 0 has std 0: an ODE step, never trained
    expected = [0, 1, 2] if kind == "cps" else [0, 1, 2, 3]
    assert pol.stochastic_steps == expected and (r.payload["step_index"] == torch.tensor(expected)).all()
    stats = pol.action_stats(r)
    torch.testing.assert_close(
        torch.exp(stats.logp - r.logp_old), torch.ones_like(r.logp_old), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(stats.kl.detach(), torch.zeros_like(stats.kl), atol=1e-8, rtol=0)


def test_cps_log_prob_option(pipe_dir):
    """cps_log_prob: squared_error (default, Flow-GRPO) vs gaussian on the same transitions (same seed):
    gaussian = squared_error / (2 sigma_t^2) - log sigma_t - log sqrt(2 pi), sigma_t = sigma' sin(a pi / 2)."""
    import math

    sq = make(pipe_dir, sde_kind="cps", noise_level=0.5).rollout(ROWS, 2)
    gauss_pol = make(pipe_dir, sde_kind="cps", noise_level=0.5, cps_log_prob="gaussian")
    gauss = gauss_pol.rollout(ROWS, 2)
    assert torch.equal(sq.payload["next_latents"], gauss.payload["next_latents"])
    sigma_t = sq.payload["sigmas_next"] * math.sin(0.5 * math.pi / 2)
    expected = sq.logp_old / (2 * sigma_t**2) - torch.log(sigma_t) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(gauss.logp_old, expected, rtol=1e-4, atol=1e-4)
    assert bool((sq.logp_old <= 0).all())  # -mean((x' - mu)^2)
    ratio = torch.exp(gauss_pol.action_stats(gauss).logp - gauss.logp_old)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="cps_log_prob must be one of squared_error, gaussian"):
        make(pipe_dir, sde_kind="cps", noise_level=0.5, cps_log_prob="full")


def test_step_kind_options_are_validated(pipe_dir):
    with pytest.raises(ValueError, match="flow_sde, cps, dance"):
        make(pipe_dir, sde_kind="ddim")
    with pytest.raises(ValueError, match=r"noise level a of cps.*\(0, 1\]"):
        make(pipe_dir, sde_kind="cps", noise_level=1.5)
    with pytest.raises(ValueError, match="eta of dance"):
        make(pipe_dir, sde_kind="dance", noise_level=-0.1)
    with pytest.raises(ValueError, match=r"window_size must be in \[1, 3\].*std 0"):
        make(pipe_dir, sde_kind="cps", window_size=4)
    with pytest.raises(ValueError, match="window_mode sliding needs window_size"):
        make(pipe_dir, window_mode="sliding")
    with pytest.raises(ValueError, match="window_mode"):
        make(pipe_dir, window_size=2, window_mode="forward")


def test_cps_windows_and_subsets_avoid_the_zero_std_step(pipe_dir):
    pol = make(pipe_dir, sde_kind="cps", window_size=1)
    starts = {int(pol.rollout(ROWS[:1], 1).payload["step_index"][0, 0]) for _ in range(8)}
    assert starts <= {0, 1, 2} and len(starts) > 1
    pol = make(pipe_dir, sde_kind="cps", train_fraction=0.5)
    r = pol.rollout(ROWS, 3)
    assert r.payload["step_index"].shape == (6, 2) and int(r.payload["step_index"].max()) <= 2


# ---------------------------------------------------------------------------- CFG-free training


def test_cfg_free_training_scores_the_conditional_branch(pipe_dir):
    cfg = make(pipe_dir, guidance_scale=4.0, need_reference=True)
    free = make(pipe_dir, guidance_scale=4.0, need_reference=True, train_guidance=False)
    r_cfg = cfg.rollout(ROWS, 2)
    r_free = free.rollout(ROWS, 2)
    # the same seed draws the same CFG samples; only the recorded log-probs differ (conditional branch)
    torch.testing.assert_close(
        r_free.payload["next_latents"], r_cfg.payload["next_latents"], atol=1e-6, rtol=0
    )
    assert not torch.allclose(r_free.logp_old, r_cfg.logp_old, atol=1e-4)
    stats = free.action_stats(r_free)
    torch.testing.assert_close(torch.exp(stats.logp - r_free.logp_old), torch.ones(4, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(stats.kl.detach(), torch.zeros(4, 4), atol=1e-8, rtol=0)
    # scoring the CFG rollout's transitions conditionally gives the CFG-free rollout's log-probs
    torch.testing.assert_close(free.action_stats(r_cfg).logp.detach(), r_free.logp_old, atol=1e-5, rtol=0)
    # ... and a guidance-free policy (guidance_scale 1) scores them the same way
    plain = make(pipe_dir)
    torch.testing.assert_close(plain.action_stats(r_cfg).logp.detach(), r_free.logp_old, atol=1e-5, rtol=0)
    stats.logp.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in free.trainable_parameters())


# ---------------------------------------------------------------------------- SD3 layout: 2 CLIPs + T5


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3_3enc") / "sd3", text_encoders=3)


def _diffusers_pipe(c, **override):
    from diffusers import StableDiffusion3Pipeline

    parts = {
        k: getattr(c, k)
        for k in (
            "transformer",
            "scheduler",
            "vae",
            "text_encoder",
            "tokenizer",
            "text_encoder_2",
            "tokenizer_2",
            "text_encoder_3",
            "tokenizer_3",
        )
    }
    return StableDiffusion3Pipeline(**{**parts, **override})


def test_three_encoder_prompt_embeds_match_diffusers(sd3_dir):
    c = load_sd3_components(sd3_dir)
    assert c.is_sd3_layout and c.text_encoder_3 is not None and c.tokenizer_3 is not None
    tr = c.transformer.config
    assert c.text_encoder_3.config.d_model == tr.joint_attention_dim
    assert (
        c.text_encoder.config.projection_dim + c.text_encoder_2.config.projection_dim
        == tr.pooled_projection_dim
    )
    prompts = ["a red cat", "", "Two blue dogs, left!"]
    for max_len, pipe, comps in [
        (256, _diffusers_pipe(c), c),
        (32, _diffusers_pipe(c), c),
        (
            256,
            _diffusers_pipe(c, text_encoder_3=None, tokenizer_3=None),
            load_sd3_components(sd3_dir, load_t5=False),
        ),
    ]:
        with torch.no_grad():  # (T5's attention kernel differs in grad mode by ~1e-6)
            pe, _, po, _ = pipe.encode_prompt(
                prompts,
                prompts,
                prompts,
                device="cpu",
                do_classifier_free_guidance=False,
                max_sequence_length=max_len,
            )
            ours_pe, ours_po = comps.encode_prompt(prompts, max_sequence_length=max_len)
        assert ours_pe.shape == (3, 16 + max_len, tr.joint_attention_dim) and ours_po.shape == (
            3,
            tr.pooled_projection_dim,
        )
        assert torch.equal(ours_pe, pe) and torch.equal(ours_po, po)


def test_flow_policy_on_the_three_encoder_folder(sd3_dir, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    pol = SD3Policy.from_pretrained(sd3_dir, num_steps=3, seed=0, max_sequence_length=8, guidance_scale=2.0)
    pe, po = pol.encode_prompt(["a red cat"])
    assert pe.shape == (1, 16 + 8, 32) and po.shape == (1, 16)
    r = pol.rollout(ROWS, 2)
    ratio = torch.exp(pol.action_stats(r).logp - r.logp_old)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    pol.save(tmp_path / "out")
    for sub in (
        "transformer",
        "vae",
        "scheduler",
        "text_encoder",
        "tokenizer",
        "text_encoder_2",
        "tokenizer_2",
        "text_encoder_3",
        "tokenizer_3",
        "model_index.json",
    ):
        assert (tmp_path / "out" / sub).exists(), sub
    again = SD3Policy.from_pretrained(
        tmp_path / "out", num_steps=3, max_sequence_length=8, guidance_scale=2.0
    )
    torch.testing.assert_close(again.action_stats(r).logp.detach(), r.logp_old, atol=1e-5, rtol=0)
    pipe = StableDiffusion3Pipeline.from_pretrained(tmp_path / "out")  # the layout diffusers reads
    assert pipe.text_encoder_3 is not None and pipe.tokenizer_3 is not None


@pytest.mark.parametrize("shift", [None, 3.0])
def test_sd3_sigmas_are_the_sd3_pipelines(sd3_dir, shift):
    """SD3Policy's schedule for an SD3 folder is the one diffusers' StableDiffusion3Pipeline runs: the
    timesteps its transformer is called with, for 10 steps (and with SD3.5's shift 3)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    c = load_sd3_components(sd3_dir)
    if shift is not None:
        c.scheduler = FlowMatchEulerDiscreteScheduler.from_config(c.scheduler.config, shift=shift)
    pol = SD3Policy(
        c.transformer,
        c.vae,
        c.scheduler,
        c.text_encoder,
        c.tokenizer,
        num_steps=10,
        text_encoder_2=c.text_encoder_2,
        tokenizer_2=c.tokenizer_2,
        text_encoder_3=c.text_encoder_3,
        tokenizer_3=c.tokenizer_3,
    )
    ours = pol.sigmas()
    seen: list[torch.Tensor] = []
    hook = c.transformer.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs["timestep"][0].clone()), with_kwargs=True
    )
    sched = FlowMatchEulerDiscreteScheduler.from_config(c.scheduler.config)
    pipe = _diffusers_pipe(c, scheduler=sched)
    try:
        side = pol.latent_size * pipe.vae_scale_factor
        pipe(
            "a red cat",
            num_inference_steps=10,
            guidance_scale=1.0,
            height=side,
            width=side,
            max_sequence_length=8,
            output_type="latent",
        )
    finally:
        hook.remove()
    assert len(seen) == 10
    torch.testing.assert_close(torch.stack(seen).float() / 1000, ours[:-1], atol=1e-6, rtol=0)
    assert float(ours[0]) == 1.0 and float(ours[-1]) == 0.0
    if shift == 3.0:  # the numbers of the issue: the last stochastic step runs 0.0089 -> 0, not 0.25 -> 0
        assert float(ours[-2]) == pytest.approx(0.008929, abs=2e-6)


# ---------------------------------------------------------------------------- trainer: window and images


def test_group_trainer_drives_the_window_and_saves_images(pipe_dir, tmp_path):
    import json

    from PIL import Image

    from mmalign.config import config_from_dict
    from mmalign.training.trainer import GroupTrainer
    from pipelines import TrainingSetup
    from rewards import RewardSet

    cfg = config_from_dict(
        {
            "pipeline": "flow_test",
            "output_dir": str(tmp_path / "run"),
            "rollout": {"group_size": 2, "prompts_per_step": 2},
            "rewards": [{"name": "jpeg_compressibility"}],
            "trainer": {"steps": 2, "lr": 1e-3, "progress_bar": False, "sample_every": 1, "save_every": 10},
        },
        "test",
    )
    pol = make(pipe_dir, num_steps=4, window_size=2, window_mode="sliding", window_shift_every=1)
    rows = [{"prompt": "a red square"}, {"prompt": "two blue circles"}]
    trainer = GroupTrainer(cfg, TrainingSetup(policy=pol, rewards=RewardSet(cfg.rewards), data=rows))
    trainer.train()
    assert pol.train_step == 1 and trainer._last_batch.payload["step_index"][0].tolist() == [1, 2]
    samples = tmp_path / "run" / "samples"
    for step in (1, 2):
        lines = [json.loads(x) for x in (samples / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert [row["image"] for row in lines] == [f"step_{step:06d}/{i:04d}.png" for i in range(4)]
        with Image.open(samples / lines[0]["image"]) as im:
            assert im.size == (pol.latent_size, pol.latent_size) and im.mode == "RGB"
