"""The denoising policies through the loops `DenoisingPolicy` owns, parametrised over SD3Policy (a tiny SD3
folder), FluxPolicy (a tiny FLUX.1-dev folder) and DDIMPolicy (a tiny SD 1.5 folder): shapes, ratio = 1,
gradients, initial noise, windows, KL and reference, LoRA, save / load, the trainer and checkpointed
randomness. Then a video-like toy subclass (5-D latents), the `shift_step_mean` hook and `SamplerSettings`.
Policy-specific behaviour is in test_sd3_policy.py, test_flux_policy.py and test_ddim_policy.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mmalign.algorithms import sde
from mmalign.config import LoraConfig
from mmalign.policies.ddim import DDIMPolicy
from mmalign.policies.denoising import DenoisingPolicy, SamplerSettings
from mmalign.policies.flux import FluxPolicy
from mmalign.policies.sd3 import SD3Policy
from mmalign.training import rundir

ROWS = [{"prompt": "a red cat", "label": 1}, {"prompt": "a blue dog", "label": 2}]
SEQ = 8
"""T5 length of the Flux policy (small: fast)."""


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmalign.tiny.sd3 import build_tiny_sd3

    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3") / "sd3")


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmalign import tiny

    return tiny.build("flux_tiny", tmp_path_factory.mktemp("flux") / "dev")


@pytest.fixture(scope="module")
def schnell_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmalign.tiny.flux import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("flux") / "schnell", guidance_embeds=False)


@pytest.fixture(scope="module")
def sd15_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmalign.tiny.sd15 import build_tiny_sd15

    return build_tiny_sd15(tmp_path_factory.mktemp("tiny_sd15") / "sd15")


@dataclass
class Case:
    """One denoising policy on its tiny folder."""

    name: str
    cls: type
    path: Path
    defaults: dict[str, Any]
    factor: int
    """Image pixels per latent (the VAE's downsampling)."""
    lora_dir: str
    changed_param: str
    """A denoiser parameter a save / load round trip must carry."""
    merged_tol: dict[str, float] = field(default_factory=lambda: {"atol": 1e-5, "rtol": 0.0})

    def make(self, folder: Path | None = None, cls: type | None = None, **kw: Any) -> Any:
        return (cls or self.cls).from_pretrained(folder or self.path, **{**self.defaults, **kw})

    def load(self, folder: Path) -> Any:
        """A policy of a saved folder (no seed)."""
        return self.make(folder, seed=None)


CASES = ("flow", "flux", "ddim")


def get_case(request: pytest.FixtureRequest, name: str) -> Case:
    if name == "flow":
        return Case(
            "flow",
            SD3Policy,
            request.getfixturevalue("sd3_dir"),
            {"num_steps": 4, "seed": 0},
            1,
            "transformer_lora",
            "proj_out.bias",
        )
    if name == "flux":
        return Case(
            "flux",
            FluxPolicy,
            request.getfixturevalue("flux_dir"),
            {"num_steps": 3, "seed": 0, "max_sequence_length": SEQ},
            2,
            "transformer_lora",
            "proj_out.bias",
        )
    return Case(
        "ddim",
        DDIMPolicy,
        request.getfixturevalue("sd15_dir"),
        {"num_steps": 4, "seed": 0},
        2,
        "unet_lora",
        "conv_out.bias",
        {"atol": 1e-4, "rtol": 1e-5},
    )


@pytest.fixture(params=CASES)
def case(request: pytest.FixtureRequest) -> Case:
    return get_case(request, request.param)


def frozen_modules(pol: Any) -> list[torch.nn.Module]:
    """The VAE and every text encoder: never trained."""
    encoders = [
        getattr(pol, n) for n in ("text_encoder", "text_encoder_2") if getattr(pol, n, None) is not None
    ]
    return [pol.vae, *encoders]


# ---------------------------------------------------------------------------- the shared loops


def test_rollout_shapes_and_decode(case: Case) -> None:
    pol = case.make()
    r = pol.rollout(ROWS, 3, compute_logp=True)
    b, t, s = 6, pol.num_steps, pol.latent_size
    c = pol.model.config.in_channels // (4 if case.name == "flux" else 1)
    assert pol.latent_shape() == (c, s, s)
    assert r.mask.shape == (b, t) and r.mask.all()
    assert r.logp_old.shape == (b, t) and torch.isfinite(r.logp_old).all()
    assert r.outputs["latents"].shape == (b, c, s, s)
    assert r.payload["latents"].shape == (b, t, c, s, s)
    if case.name == "ddim":
        assert r.payload["timesteps"][0].tolist() == [751, 501, 251, 1]
    assert r.group.tolist() == [0, 0, 0, 1, 1, 1]
    assert r.columns["label"] == [1, 1, 1, 2, 2, 2]
    img = pol.decode(r)
    assert img.shape == (b, 3, case.factor * s, case.factor * s) and img.min() >= 0 and img.max() <= 1
    assert r.outputs["images"] is img
    # consecutive trained transitions chain: x_{t+1} of step j is x_t of step j+1; the last is the output
    assert torch.equal(r.payload["next_latents"][:, 0], r.payload["latents"][:, 1])
    assert torch.equal(r.payload["next_latents"][:, -1], r.outputs["latents"])


@pytest.mark.parametrize(
    ("policy", "opts"),
    [
        ("flow", {}),
        ("flow", {"guidance_scale": 3.0}),
        ("flow", {"window_size": 2}),
        ("flow", {"train_fraction": 0.5}),
        ("flux", {}),
        ("flux", {"_folder": "schnell"}),
        ("flux", {"window_size": 2, "need_reference": True}),
        ("flux", {"sde_kind": "cps"}),
        ("ddim", {}),
        ("ddim", {"guidance_scale": 3.0}),
        ("ddim", {"window_size": 2}),
        ("ddim", {"train_fraction": 0.5}),
        ("ddim", {"same_initial_noise": True}),
        ("ddim", {"guidance_scale": 2.0, "window_size": 1, "eta": 0.5}),
        ("ddim", {"guidance_scale": 3.0, "train_guidance": False, "need_reference": True}),
    ],
)
def test_reevaluate_ratio_is_one(request: pytest.FixtureRequest, policy: str, opts: dict) -> None:
    case = get_case(request, policy)
    opts = dict(opts)
    folder = opts.pop("_folder", None)
    pol = case.make(request.getfixturevalue(f"{folder}_dir") if folder else None, **opts)
    r = pol.rollout(ROWS, 2, compute_logp=True)
    t = opts.get("window_size") or math.ceil(opts.get("train_fraction", 1.0) * pol._num_trainable_steps())
    assert r.logp_old.shape == (4, t) and torch.isfinite(r.logp_old).all()
    shape = pol.latent_shape()
    assert r.outputs["latents"].shape == (4, *shape) and r.payload["latents"].shape == (4, t, *shape)
    if policy == "flux":
        assert shape == (4, 8, 8)
        assert r.payload["prompt_embeds"].shape == (4, SEQ, 32) and r.payload["pooled_embeds"].shape == (
            4,
            16,
        )
    stats = pol.action_stats(r)
    ratio = torch.exp(stats.logp - r.logp_old)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    sub = r[[1, 2]]  # also on a minibatch slice
    torch.testing.assert_close(pol.action_stats(sub).logp.detach(), sub.logp_old, atol=1e-5, rtol=0)
    if opts.get("need_reference"):
        if "window_size" in opts:
            assert (r.payload["step_index"][:, 1] - r.payload["step_index"][:, 0] == 1).all()
        torch.testing.assert_close(stats.kl.detach(), torch.zeros_like(stats.kl), atol=1e-8, rtol=0)
    if policy == "flux":
        img = pol.decode(r)
        assert img.shape == (4, 3, 16, 16) and 0 <= img.min() and img.max() <= 1


def test_gradients_reach_the_denoiser(case: Case) -> None:
    pol = case.make(**({"guidance_scale": 2.0} if case.name == "ddim" else {}))
    r = pol.rollout(ROWS, 2, compute_logp=True)
    pol.action_stats(r).logp.sum().backward()
    grads = [p.grad for p in pol.trainable_parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    assert all(p.grad is None for m in frozen_modules(pol) for p in m.parameters())


def test_same_initial_noise(case: Case) -> None:
    pol = case.make(same_initial_noise=True)
    r = pol.rollout(ROWS, 3, compute_logp=False)
    x0 = r.payload["latents"][:, 0]
    assert torch.equal(x0[0], x0[1]) and torch.equal(x0[0], x0[2])
    assert not torch.equal(x0[0], x0[3])
    assert r.logp_old is None
    assert not torch.equal(r.outputs["latents"][0], r.outputs["latents"][1])  # step noise differs


def test_window_trains_exactly_window_size_steps(case: Case) -> None:
    pol = case.make(num_steps=6, window_size=2, window_range=(1, 3))
    r = pol.rollout(ROWS, 2, compute_logp=True)
    assert r.mask.shape == (4, 2) and r.logp_old.shape == (4, 2)
    idx = r.payload["step_index"]
    assert (idx[:, 1] - idx[:, 0] == 1).all() and 1 <= int(idx[0, 0]) <= 3
    assert (idx == idx[0]).all()


def test_sliding_window_trains_the_scheduled_steps(case: Case) -> None:
    from mmalign.algorithms.schedules import SlidingWindow

    pol = case.make(num_steps=5, window_size=2, window_mode="sliding", window_shift_every=2)
    sched = SlidingWindow(num_steps=5, window_size=2, shift_every=2)
    assert pol.window_schedule is not None and pol.window_schedule.positions == sched.positions == [
        0,
        1,
        2,
        3,
    ]
    for step in (0, 1, 2, 5, 7, 8):
        pol.on_train_step(step)
        r = pol.rollout(ROWS, 2)
        assert (r.payload["step_index"] == torch.tensor(sched.steps_at(step))).all(), step
    assert sched.steps_at(8) == [0, 1]  # wrapped after the last start (3)
    pol.on_train_step(4)
    r = pol.rollout(ROWS, 2)
    assert r.payload["step_index"][0].tolist() == [2, 3]
    ratio = torch.exp(pol.action_stats(r).logp - r.logp_old)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    # window_range bounds the slide; the stride moves it by more than one step
    pol = case.make(
        num_steps=6,
        window_size=2,
        window_range=(1, 3),
        window_mode="sliding",
        window_shift_every=1,
        window_stride=2,
    )
    starts = []
    for step in range(3):
        pol.on_train_step(step)
        starts.append(int(pol.rollout(ROWS[:1], 1).payload["step_index"][0, 0]))
    assert starts == [1, 3, 1]


def test_kl_zero_at_start_and_save_load(case: Case, tmp_path: Path) -> None:
    pol = case.make(need_reference=True)
    r = pol.rollout(ROWS, 2, compute_logp=True)
    t = pol.num_steps
    stats = pol.action_stats(r)
    assert stats.kl is not None and stats.kl.shape == (4, t)
    torch.testing.assert_close(stats.kl.detach(), torch.zeros(4, t), atol=1e-8, rtol=0)
    torch.testing.assert_close(pol.reference_logprobs(r), r.logp_old, atol=1e-5, rtol=0)
    state = pol.trainable_state_dict()
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(0.01)
    assert (pol.action_stats(r).kl.detach() > 0).any()
    pol.load_trainable_state_dict(state)
    with torch.no_grad():
        pol.model.get_parameter(case.changed_param).add_(0.1)  # a change the saved folder must carry
    pol.save(tmp_path / "out")
    again = case.load(tmp_path / "out")
    for (n, p), (_, q) in zip(pol.model.named_parameters(), again.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    expected = pol.action_stats(r).logp.detach()
    torch.testing.assert_close(again.action_stats(r).logp.detach(), expected, atol=1e-6, rtol=0)


def test_lora_reference_is_disabled_adapter(case: Case, tmp_path: Path) -> None:
    pol = case.make(need_reference=True, lora=LoraConfig(enabled=True, r=4))
    names = [n for n, p in pol.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    r = pol.rollout(ROWS, 2, compute_logp=True)
    t = pol.num_steps
    stats = pol.action_stats(r)
    torch.testing.assert_close(stats.kl.detach(), torch.zeros(4, t), atol=1e-8, rtol=0)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                p.add_(0.5)
    stats = pol.action_stats(r)
    assert (stats.kl.detach() > 0).any()
    torch.testing.assert_close(pol.reference_logprobs(r), r.logp_old, atol=1e-5, rtol=0)  # adapter off = base
    assert not torch.allclose(stats.logp.detach(), r.logp_old, atol=1e-4)
    stats.logp.sum().backward()
    assert all(p.grad is not None for p in pol.trainable_parameters())
    assert all(p.grad is None for n, p in pol.model.named_parameters() if "lora_" not in n)
    pol.save(tmp_path / "merged")
    assert (tmp_path / "merged" / case.lora_dir).is_dir()
    merged = case.load(tmp_path / "merged")
    torch.testing.assert_close(merged.action_stats(r).logp.detach(), stats.logp.detach(), **case.merged_tol)
    base = case.make()
    assert not torch.allclose(base.action_stats(r).logp.detach(), stats.logp.detach(), atol=1e-6)


def test_group_trainer_runs_the_policy(case: Case, tmp_path: Path) -> None:
    """The shared loop drives denoising steps as actions: pixels are decoded only because the reward
    needs them, the policy's own step-mean KL is used, and the denoiser's weights move."""
    from mmalign.config import config_from_dict
    from mmalign.training.trainer import GroupTrainer
    from pipelines import TrainingSetup
    from rewards import RewardSet

    cfg = config_from_dict(
        {
            "pipeline": f"{case.name}_test",
            "output_dir": str(tmp_path / "run"),
            "rollout": {"group_size": 4, "prompts_per_step": 2},
            "rewards": [{"name": "jpeg_incompressibility"}],
            "algorithm": {"kl_coef": 0.01},
            "trainer": {"steps": 2, "lr": 1e-3, "progress_bar": False, "save_every": 1},
        },
        "test",
    )
    pol = case.make(num_steps=4 if case.name == "flow" else 3, need_reference=True)
    rows = [{"prompt": "a red square"}, {"prompt": "two blue circles"}, {"prompt": "green"}]
    before = {k: v.clone() for k, v in pol.trainable_state_dict().items()}
    trainer = GroupTrainer(cfg, TrainingSetup(policy=pol, rewards=RewardSet(cfg.rewards), data=rows))
    history = trainer.train()
    assert [m["step"] for m in history] == [1, 2]
    assert "images" in trainer._last_batch.outputs and trainer._last_batch.logp_ref is None
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-8) and history[1]["kl"] > 0
    after = pol.trainable_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_policy_generator_round_trips_through_checkpoints(case: Case, tmp_path: Path) -> None:
    """A seeded policy draws its noise from a private generator: its state is saved per process in each
    checkpoint and restored on resume, so the next rollout after a resume is the uninterrupted one's."""
    from mmalign.config import config_from_dict
    from mmalign.training.trainer import GroupTrainer
    from pipelines import TrainingSetup
    from rewards import RewardSet

    cfg = config_from_dict(
        {
            "pipeline": f"{case.name}_test",
            "output_dir": str(tmp_path / "run"),
            "rollout": {"group_size": 2, "prompts_per_step": 1},
            "rewards": [{"name": "jpeg_incompressibility"}],
            "trainer": {"steps": 1, "lr": 1e-3, "progress_bar": False, "save_every": 1},
        },
        "test",
    )
    rows = [{"prompt": "a red square"}]

    def trainer(resume: bool) -> GroupTrainer:
        pol = case.make(num_steps=3, seed=123)
        return GroupTrainer(
            cfg, TrainingSetup(policy=pol, rewards=RewardSet(cfg.rewards), data=rows), resume=resume
        )

    first = trainer(False)
    first.train()
    assert "policy" in rundir.load_state(tmp_path / "run" / "checkpoints" / "step_000001" / "rng_0.pt")
    state = first.policy.generator.get_state()
    expected = first.policy.rollout(rows, 2).outputs["latents"]
    resumed = trainer(True)
    assert resumed.step == 1
    assert torch.equal(resumed.policy.generator.get_state(), state)  # not the freshly seeded state
    assert not torch.equal(
        resumed.policy.generator.get_state(), torch.Generator().manual_seed(123).get_state()
    )
    torch.testing.assert_close(resumed.policy.rollout(rows, 2).outputs["latents"], expected, atol=0, rtol=0)


# ---------------------------------------------------------------------------- shift_step_mean


@pytest.mark.parametrize(
    ("kind", "coefs", "opts"),
    [
        ("flow_sde", (1.0, 0.6), {"noise_level": 0.7, "sigma_max_fallback": 0.6}),
        ("cps", (0.8, 0.5), {"noise_level": 0.5}),
        ("dance", (0.8, 0.5), {"eta": 0.3}),
        ("ddim", (0.5, 0.7), {"eta": 1.0}),
    ],
)
def test_sde_shift_mean_moves_the_gaussian(kind: str, coefs: tuple, opts: dict) -> None:
    """`mmalign.algorithms.sde`'s ``shift_mean``: the sample is drawn around the shifted mean, the log-prob is that of the
    shifted Gaussian, and re-scoring with the same shift reproduces it exactly."""
    g = torch.Generator().manual_seed(0)
    pred, x, noise = (torch.randn(3, 2, 4, 4, generator=g) for _ in range(3))
    plain = sde.step(kind, pred, x, *coefs, noise=noise, **opts)
    seen = []

    def shift(mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        seen.append(std)
        return mean + 0.1

    moved = sde.step(kind, pred, x, *coefs, noise=noise, shift_mean=shift, **opts)
    assert torch.equal(seen[0], plain.std)
    torch.testing.assert_close(moved.mean, plain.mean + 0.1, atol=1e-6, rtol=0)
    torch.testing.assert_close(moved.sample, plain.sample + 0.1, atol=1e-6, rtol=0)
    torch.testing.assert_close(moved.log_prob, plain.log_prob, atol=1e-5, rtol=0)  # the same residual
    again = sde.step(kind, pred, x, *coefs, prev_sample=moved.sample, shift_mean=lambda m, s: m + 0.1, **opts)
    assert torch.equal(again.log_prob, moved.log_prob)
    with pytest.raises(ValueError, match="shift_mean returned shape"):
        sde.step(kind, pred, x, *coefs, noise=noise, shift_mean=lambda m, s: m[:1], **opts)


def shifted(cls: type, shift: float) -> type:
    """`cls` whose step mean is moved by the constant `shift` before x_{t+1} is drawn."""

    def shift_step_mean(
        self: Any, mean: torch.Tensor, latents: torch.Tensor, t_index: int, ctx: Any
    ) -> torch.Tensor:
        assert ctx.prediction.shape == mean.shape == latents.shape and ctx.std.ndim == mean.ndim
        assert int(ctx.sched["step_index"][0]) == t_index and len(ctx.prompts) == mean.shape[0]
        return mean + torch.full_like(mean, shift)

    return type(f"Shifted{cls.__name__}", (cls,), {"shift_step_mean": shift_step_mean})


def test_zero_mean_shift_is_the_plain_path(case: Case) -> None:
    plain, zero = case.make(), case.make(cls=shifted(case.cls, 0.0))
    rp, rz = plain.rollout(ROWS, 2), zero.rollout(ROWS, 2)
    assert "mean_shift" not in rp.payload and torch.equal(
        rz.payload["mean_shift"], torch.zeros_like(rp.payload["latents"])
    )
    for key in ("latents", "next_latents"):
        assert torch.equal(rp.payload[key], rz.payload[key]), key
    assert torch.equal(rp.outputs["latents"], rz.outputs["latents"]) and torch.equal(rp.logp_old, rz.logp_old)
    assert torch.equal(plain.action_stats(rp).logp, zero.action_stats(rz).logp)


def test_constant_mean_shift_is_sampled_scored_and_rescored(case: Case) -> None:
    """x_{t+1} is drawn around mu + c; logp_old is log N(x_{t+1}; mu + c, std^2) averaged over the latent dims
    (written out here); re-scoring adds the stored shift again, so the ratio is 1 and the KL 0."""
    c = 0.05
    plain = case.make()
    pol = case.make(cls=shifted(case.cls, c), need_reference=True)
    rp, r = plain.rollout(ROWS, 2), pol.rollout(ROWS, 2)
    # the same noise and the same first mean: the first sample moved by c
    torch.testing.assert_close(
        r.payload["next_latents"][:, 0] - rp.payload["next_latents"][:, 0],
        torch.full_like(r.payload["next_latents"][:, 0], c),
        atol=1e-5,
        rtol=0,
    )
    torch.testing.assert_close(
        r.payload["mean_shift"], torch.full_like(r.payload["mean_shift"], c), atol=1e-6, rtol=0
    )
    p = r.payload
    cond = {k: p[k] for k in pol.conditioning_keys}
    for j in range(r.num_actions):
        x, x_next = p["latents"][:, j], p["next_latents"][:, j]
        sched = {k: p[k][:, j] if p[k].ndim == 2 else p[k] for k in pol.schedule_keys}
        with torch.no_grad():
            step = pol.step(pol.predict(pol.model, x, sched, cond)[0], x, sched, prev_sample=x_next)
        mu, std = step.mean + c, step.std.expand_as(x)
        density = -((x_next - mu) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
        torch.testing.assert_close(r.logp_old[:, j], density.flatten(1).mean(1), atol=1e-4, rtol=1e-5)
    stats = pol.action_stats(r)
    torch.testing.assert_close(
        torch.exp(stats.logp - r.logp_old), torch.ones_like(r.logp_old), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(stats.kl.detach(), torch.zeros_like(stats.kl), atol=1e-8, rtol=0)
    torch.testing.assert_close(pol.reference_logprobs(r), r.logp_old, atol=1e-5, rtol=0)
    sub = r[[0, 3]]
    torch.testing.assert_close(pol.action_stats(sub).logp.detach(), sub.logp_old, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- 5-D latents (video-like)


class TinyVideoDenoiser(torch.nn.Module):
    """A conv3d over [B, C, F, h, w] plus a per-sample bias from the prompt embedding and sigma."""

    def __init__(self, channels: int, dim: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv3d(channels, channels, 3, padding=1)
        self.text = torch.nn.Linear(dim, channels)
        self.time = torch.nn.Linear(1, channels)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return self.conv(x) + (self.text(emb) + self.time(sigma[:, None]))[:, :, None, None, None]


class FrameVAE(torch.nn.Module):
    """Decodes one frame [N, C, h, w] to [N, 3, 2h, 2w] (the shape a VAE decoder gives)."""

    config = SimpleNamespace(scaling_factor=0.5, shift_factor=None)

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.up = torch.nn.ConvTranspose2d(channels, 3, 2, stride=2)

    def decode(self, z: torch.Tensor, return_dict: bool = False) -> tuple[torch.Tensor]:
        return (torch.tanh(self.up(z)),)


class ToyVideoPolicy(DenoisingPolicy):
    """A flow-matching video policy written as hook overrides only: latents [B, C, F, h, w]."""

    conditioning_keys = ("prompt_embeds",)
    schedule_keys = ("sigmas", "sigmas_next", "sigma_max_fallback")

    def __init__(
        self, *, channels: int = 2, frames: int = 3, size: int = 4, need_reference: bool = False, **kw: Any
    ):
        torch.manual_seed(0)
        sampler = self._settings(None, kw, num_steps=4, seed=0)
        model = TinyVideoDenoiser(channels, 4)
        self._init_denoising(
            model, FrameVAE(channels), sampler, latent_size=size, need_reference=need_reference, lora=False
        )
        self.channels, self.frames = channels, frames
        self._init_trained_steps()

    def latent_shape(self) -> tuple[int, ...]:
        return (self.channels, self.frames, self.latent_size, self.latent_size)

    def encode_conditioning(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        feats = [[len(p) / 10, sum(p.encode()) % 17 / 17, p.count(" ") / 3, 1.0] for p in prompts]
        return {"prompt_embeds": torch.tensor(feats)}

    def schedule(self) -> dict[str, torch.Tensor]:
        sig = torch.linspace(1, 0, self.num_steps + 1)
        return {"sigmas": sig[:-1], "sigmas_next": sig[1:], "sigma_max_fallback": sig[1].clone()}

    def _num_trainable_steps(self) -> int:
        return self.num_steps

    def predict(
        self, model: Any, latents: torch.Tensor, sched: dict, cond: dict, *, guided: bool = True
    ) -> tuple:
        v = model(latents, sched["sigmas"], cond["prompt_embeds"])
        return v, v

    def step(self, prediction: torch.Tensor, latents: torch.Tensor, sched: dict, **kw: Any) -> sde.StepOutput:
        return sde.step(
            "flow_sde",
            prediction,
            latents,
            sched["sigmas"],
            sched["sigmas_next"],
            noise_level=self.noise_level,
            sigma_max_fallback=sched["sigma_max_fallback"],
            **kw,
        )

    def ode_step(self, prediction: torch.Tensor, latents: torch.Tensor, sched: dict) -> torch.Tensor:
        return latents + prediction * (sched["sigmas_next"] - sched["sigmas"]).view(-1, 1, 1, 1, 1)

    def save(self, path: Any) -> None:
        torch.save(self.model.state_dict(), Path(path) / "model.pt")


@pytest.mark.parametrize(
    "opts", [{}, {"window_size": 2, "same_initial_noise": True}, {"train_fraction": 0.5}]
)
def test_video_latents_rollout_evaluate_and_decode(opts: dict) -> None:
    pol = ToyVideoPolicy(need_reference=True, **opts)
    r = pol.rollout(ROWS, 2, compute_logp=True)
    t = opts.get("window_size") or math.ceil(opts.get("train_fraction", 1.0) * 4)
    assert r.outputs["latents"].shape == (4, 2, 3, 4, 4) and r.payload["latents"].shape == (4, t, 2, 3, 4, 4)
    if opts.get("same_initial_noise"):
        x0 = pol._initial_noise(r.group)
        assert x0.shape == (4, 2, 3, 4, 4) and torch.equal(x0[0], x0[1]) and not torch.equal(x0[0], x0[2])
    stats = pol.action_stats(r)
    ratio = torch.exp(stats.logp - r.logp_old)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    torch.testing.assert_close(stats.kl.detach(), torch.zeros_like(stats.kl), atol=1e-8, rtol=0)
    sub = r[[1, 2]]
    torch.testing.assert_close(pol.action_stats(sub).logp.detach(), sub.logp_old, atol=1e-5, rtol=0)
    stats.logp.sum().backward()
    assert pol.model.conv.weight.grad is not None and pol.model.conv.weight.grad.abs().sum() > 0
    # decoded frame by frame: videos [B, F, 3, H, W]
    pol.materialize(r, {"videos"})
    videos = r.outputs["videos"]
    assert (
        videos.shape == (4, 3, 3, 8, 8)
        and 0 <= videos.min()
        and videos.max() <= 1
        and "images" not in r.outputs
    )
    frame = pol.decode_latents(r.outputs["latents"][:, :, 1])
    torch.testing.assert_close(videos[:, 1], frame, atol=1e-6, rtol=0)
    assert pol.sample_view(r)[0]["video"].shape == (3, 3, 8, 8)


# ---------------------------------------------------------------------------- settings


def test_sampler_settings_are_validated_once_and_taken_by_the_policies(sd3_dir: Path, sd15_dir: Path) -> None:
    from pipelines.safe_diffusion import SafeDiffusionOptions
    from pipelines.text_to_image import FlowOptions

    assert issubclass(FlowOptions, SamplerSettings) and issubclass(SafeDiffusionOptions, SamplerSettings)
    for bad, message in [
        ({"num_steps": 0}, "num_steps must be >= 1"),
        ({"sde_kind": "ddpm"}, "sde_kind must be one of flow_sde, cps, dance, ddim"),
        (
            {"sde_kind": "ddim", "noise_level": -0.5},
            r"eta \(the noise_level of sde_kind ddim\) must be in \(0, 1\], or 0",
        ),
        ({"sde_kind": "ddim", "noise_level": 1.5}, "eta"),
        ({"sde_kind": "cps", "eval_noise_level": 2.0}, r"eval_noise_level must be in \(0, 1\], or 0"),
        ({"true_cfg_scale": 0.5}, "true_cfg_scale must be >= 1"),
        ({"steps_per_backward": 0}, "steps_per_backward must be >= 1"),
        ({"sde_kind": "ddim", "guard_ratio_norm": True}, "GRPO-Guard"),
        ({"guidance_scale": 0.5}, "guidance_scale must be >= 1"),
        ({"train_fraction": 0.0}, "train_fraction"),
        ({"window_size": 2, "window_range": [3, 1]}, "window_range must be"),
        ({"window_shift_every": 0}, "window_shift_every"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplerSettings(**bad)
    s = SamplerSettings(num_steps=3, noise_level=0.5, seed=0)
    flow = SD3Policy.from_pretrained(sd3_dir, sampler=s)
    assert (
        flow.sampler is s and flow.num_steps == 3 and flow.noise_level == 0.5 and flow.generator is not None
    )
    with pytest.raises(TypeError, match="not both"):
        SD3Policy.from_pretrained(sd3_dir, sampler=s, num_steps=4)
    with pytest.raises(ValueError, match="window_size must be in"):
        flow.window_size = 9  # setting a policy's sampler attribute validates the new settings
    with pytest.raises(ValueError, match="sde_kind must be 'ddim'"):
        DDIMPolicy.from_pretrained(sd15_dir, sampler=s)
    ddim = DDIMPolicy.from_pretrained(
        sd15_dir, sampler=SamplerSettings(num_steps=3, sde_kind="ddim", noise_level=0.5)
    )
    assert ddim.eta == 0.5 and ddim.sde_kind == "ddim" and ddim.generator is None
    assert DDIMPolicy.from_pretrained(sd15_dir, num_steps=3, eta=0.25).sampler == SamplerSettings(
        num_steps=3, sde_kind="ddim", noise_level=0.25
    )
