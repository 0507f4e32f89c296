"""VGGRPO (`video_geometry`) and Euphonium (`euphonium`) pipelines on a random tiny Wan text-to-video folder with a
random `TinyLatentGeometry`: the geometry rewards never decode, a training step runs through the shared trainer,
and Euphonium's guided sampler (strength 0 = the plain policy exactly; the mean shift has the set length; the
recorded process rewards and distillation targets agree with an independent recomputation; the distillation
term is the MSE of the re-scored velocities against the targets; SPSA guidance runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmalign.config import load_config
from pipelines import get as get_pipeline
from rewards.geometry_model import TinyLatentGeometry

REPO = Path(__file__).resolve().parents[3]
PROMPTS = REPO / "assets" / "video_geometry" / "train.jsonl"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a random tiny Wan t2v folder, a random TinyLatentGeometry folder)."""
    from mmalign.tiny.wan import build_tiny_wan

    root = tmp_path_factory.mktemp("video_geometry")
    build_tiny_wan(root / "wan", text_hidden=32)
    torch.manual_seed(0)
    TinyLatentGeometry(latent_channels=4, hidden=8).save_pretrained(root / "geometry")
    return root / "wan", root / "geometry"


def _config(name: str, folders: tuple[Path, Path], tmp_path: Path, *extra: str):
    wan, geometry = folders
    overrides = [
        f"output_dir={tmp_path / 'run'}",
        f"model.name_or_path={wan}",
        "model.tiny_builder=null",
        f"data.train={PROMPTS}",
        "data.eval=null",
        "data.max_rows=4",
        "options.num_steps=3",
        "rollout.group_size=2",
        "rollout.prompts_per_step=2",
        "trainer.steps=1",
        "trainer.progress_bar=false",
        "trainer.sample_every=1",
        "trainer.save_every=100",
        *(f"rewards.{i}.kwargs.geometry_model={geometry}" for i in range(3)),
        *([f"options.geometry_model={geometry}"] if name == "euphonium" else []),
        *extra,
    ]
    return load_config(REPO / "configs" / f"{name}-tiny.yaml", overrides)


def _forbid_decoding(policy, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the VAE decoder was called")

    monkeypatch.setattr(policy.vae, "decode", refuse)
    monkeypatch.setattr(policy.vae, "_decode", refuse)
    monkeypatch.setattr(policy.vae.decoder, "forward", refuse)


@pytest.mark.parametrize("name", ["video_geometry", "euphonium"])
def test_a_training_step_never_decodes(name: str, folders, tmp_path: Path, monkeypatch) -> None:
    from mmalign.training.trainer import GroupTrainer

    cfg = _config(name, folders, tmp_path)
    comp = get_pipeline(name)(cfg)
    assert comp.rewards.needs <= {"latents", "process_rewards"}, comp.rewards.needs
    _forbid_decoding(comp.policy, monkeypatch)
    trainer = GroupTrainer(cfg, comp)
    trainer.train()
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(m for m in metrics if m.get("step") == 1)
    for reward in ("camera_smoothness", "reprojection_consistency", "motion_guard"):
        value = step[f"reward/{reward}/mean"]
        assert 0 < value <= 1, (reward, value)
    if name == "euphonium":
        assert step["aux/drift_distill"] > 0
        assert (
            step["reward/sampler_process_reward/mean"] == step["reward/sampler_process_reward/mean"]
        )  # not NaN


def _policies(folders, tmp_path: Path, *extra: str):
    cfg = _config("euphonium", folders, tmp_path, "options.seed=3", *extra)
    comp = get_pipeline("euphonium")(cfg)
    return comp, cfg


ROWS = [{"prompt": "a red box in a grey room, camera pans left"}, {"prompt": "a blue box in a white room"}]


def test_strength_zero_equals_the_plain_policy(folders, tmp_path: Path) -> None:
    from mmalign.policies.wan import WanPolicy
    from pipelines.common import options
    from pipelines.video.euphonium import EuphoniumOptions
    from pipelines.video.wan import build_wan_policy

    comp, cfg = _policies(folders, tmp_path, "options.guidance_strength=0.0")
    guided = comp.policy
    guided.on_train_step(0)  # guiding as in training
    plain = build_wan_policy(cfg, options(cfg, EuphoniumOptions), policy_class=WanPolicy)
    plain.load_trainable_state_dict(guided.trainable_state_dict())
    a = guided.rollout(ROWS, 2, compute_logp=True)
    b = plain.rollout(ROWS, 2, compute_logp=True)
    assert torch.equal(a.outputs["latents"], b.outputs["latents"])
    assert torch.equal(a.logp_old, b.logp_old)
    assert torch.equal(a.payload["next_latents"], b.payload["next_latents"])
    assert torch.count_nonzero(a.payload["mean_shift"]) == 0
    with torch.no_grad():
        assert torch.equal(guided.action_stats(a).logp, plain.action_stats(b).logp)


def test_guided_shift_length_records_and_distillation(folders, tmp_path: Path) -> None:
    from mmalign.algorithms import sde
    from pipelines.video.guidance import guided_velocity

    comp, cfg = _policies(folders, tmp_path, "options.guidance_strength=0.5")
    policy = comp.policy
    policy.on_train_step(0)
    r = policy.rollout(ROWS, 2, compute_logp=True)
    shift = r.payload["mean_shift"]  # [B, T, C, F, h, w]
    norms = shift.flatten(2).norm(dim=2)
    assert torch.allclose(norms, torch.full_like(norms, 0.5), atol=1e-4)
    # the stored log-prob is that of the shifted Gaussian, re-scoring reproduces it
    with torch.no_grad():
        assert torch.allclose(policy.action_stats(r).logp, r.logp_old, atol=1e-6)
    # recorded process rewards and targets, recomputed from the stored transitions step by step
    p = r.payload
    reward_fn = policy.reward_fn
    for j in range(r.num_actions):
        x = p["latents"][:, j]
        sched = {k: p[k][:, j] if p[k].ndim == 2 else p[k] for k in policy.schedule_keys}
        sched["step_index"] = p["step_index"][:, j]
        with torch.no_grad():
            v = policy.predict(policy.model, x, sched, {"prompt_embeds": p["prompt_embeds"]}, guided=True)[0]
        sigma = sched["sigmas"].view(-1, 1, 1, 1, 1)
        with torch.no_grad():
            expected_reward = reward_fn(x - sigma * v)
        assert torch.allclose(r.outputs["process_rewards"][:, j], expected_reward, atol=1e-5)
        target = guided_velocity(
            v,
            x,
            sched["sigmas"],
            sched["sigmas_next"],
            shift[:, j],
            noise_level=policy.noise_level,
            sigma_max_fallback=sched["sigma_max_fallback"],
        )
        assert torch.allclose(p["guided_velocity"][:, j], target, atol=1e-5)
        # and the target's flow_sde mean is the guided mean
        plain = sde.flow_sde(
            v,
            x,
            sched["sigmas"],
            sched["sigmas_next"],
            noise_level=policy.noise_level,
            sigma_max_fallback=sched["sigma_max_fallback"],
            prev_sample=x,
        ).mean
        moved = sde.flow_sde(
            target,
            x,
            sched["sigmas"],
            sched["sigmas_next"],
            noise_level=policy.noise_level,
            sigma_max_fallback=sched["sigma_max_fallback"],
            prev_sample=x,
        ).mean
        assert torch.allclose(moved - plain, shift[:, j], atol=1e-4)
    # the distillation term: mean over steps and elements of (v_theta - target)^2, with the weights unchanged
    stats = policy.action_stats(r)
    term = stats.aux_losses["drift_distill"]
    expected = torch.stack(
        [
            (
                policy.predict(
                    policy.model,
                    p["latents"][:, j],
                    {
                        **{k: p[k][:, j] if p[k].ndim == 2 else p[k] for k in policy.schedule_keys},
                        "step_index": p["step_index"][:, j],
                    },
                    {"prompt_embeds": p["prompt_embeds"]},
                    guided=True,
                )[0]
                - p["guided_velocity"][:, j]
            )
            .pow(2)
            .mean()
            for j in range(r.num_actions)
        ]
    ).mean()
    assert torch.allclose(term, expected, atol=1e-6)
    term.backward()
    assert any(q.grad is not None and q.grad.abs().sum() > 0 for q in policy.trainable_parameters())


def test_spsa_guidance_and_plain_sampling_outside_training(folders, tmp_path: Path) -> None:
    comp, _ = _policies(folders, tmp_path, "options.reward_gradient=spsa", "options.spsa_samples=2")
    policy = comp.policy
    r = policy.rollout(ROWS, 2, compute_logp=False)  # not a training rollout: unguided (sample / eval)
    assert torch.count_nonzero(r.payload["mean_shift"]) == 0
    policy.on_train_step(0)
    r = policy.rollout(ROWS, 2, compute_logp=False)
    norms = r.payload["mean_shift"].flatten(2).norm(dim=2)
    assert torch.allclose(
        norms, torch.ones_like(norms), atol=1e-4
    )  # guidance_strength 1.0 of the tiny config


def test_options_errors(folders, tmp_path: Path) -> None:
    with pytest.raises(Exception, match="spsa_c"):
        _config("euphonium", folders, tmp_path, "options.spsa_c=0")
    cfg = _config("euphonium", folders, tmp_path, "options.guidance_strength=null")
    with pytest.raises(ValueError, match="exactly one of guidance_strength"):
        get_pipeline("euphonium")(cfg)
    cfg = _config("euphonium", folders, tmp_path, "options.geometry_model=''")
    with pytest.raises(ValueError, match="options.geometry_model is required"):
        get_pipeline("euphonium")(cfg)
