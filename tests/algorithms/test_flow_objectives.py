"""The forward-process objectives (`mmalign.algorithms.flow_objectives`): DiffusionNFT and AWM against per-sample loops written
from the authors' formulas (NVlabs/DiffusionNFT scripts/train_nft_sd3.py; Flow-Factory trainers/awm.py), hand-worked
cases, the reward normalisation, the timestep strategies against re-implementations, and the registry."""

from __future__ import annotations

import math

import pytest
import torch

from mmalign.algorithms import flow_objectives as fo
from mmalign.algorithms import losses
from mmalign.registry import RegistryError

F64 = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-9}  # float64: far inside the required 1e-6


def _inputs(b=3, k=2, latent=(2, 3, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (b, k, *latent)
    v = torch.randn(shape, generator=g, dtype=F64).requires_grad_(True)
    v_old = (v.detach() + 0.3 * torch.randn(shape, generator=g, dtype=F64)).requires_grad_(True)
    noise = torch.randn(shape, generator=g, dtype=F64)
    x0 = torch.randn((b, 1, *latent), generator=g, dtype=F64).expand(shape)
    t = torch.rand((b, k), generator=g, dtype=F64) * 0.9 + 0.05
    adv = torch.tensor([2.0, -7.0, 0.4], dtype=F64)[:b] * 1.5
    return v, v_old, noise, x0, t, adv


# ----------------------------------------------------------------------------- DiffusionNFT


def nft_reference(v, v_old, noise, x0, t, adv, *, beta, clip, adv_mode="all", adaptive=True):
    """A plain loop over samples and sigmas, from scripts/train_nft_sd3.py's training step."""
    out = torch.zeros(t.shape, dtype=v.dtype)
    for i in range(t.shape[0]):
        a = min(max(float(adv[i]), -clip), clip)
        if adv_mode == "positive_only":
            a = max(a, 0.0)
        elif adv_mode == "negative_only":
            a = min(a, 0.0)
        elif adv_mode == "one_only":
            a = 1.0 if a > 0 else 0.0
        elif adv_mode == "binary":
            a = float((a > 0) - (a < 0))
        r = min(max(a / clip / 2.0 + 0.5, 0.0), 1.0)
        for j in range(t.shape[1]):
            s = float(t[i, j])
            xt = (1 - s) * x0[i, j] + s * noise[i, j]
            vo = v_old[i, j].detach()
            vp = beta * v[i, j] + (1 - beta) * vo
            vn = (1 + beta) * vo - beta * v[i, j]
            x0p, x0n = xt - s * vp, xt - s * vn
            wp = max(float((x0p - x0[i, j]).detach().abs().mean()), 1e-5) if adaptive else 1.0
            wn = max(float((x0n - x0[i, j]).detach().abs().mean()), 1e-5) if adaptive else 1.0
            lp = ((x0p - x0[i, j]) ** 2 / wp).mean()
            ln = ((x0n - x0[i, j]) ** 2 / wn).mean()
            out[i, j] = clip * (r * lp + (1 - r) * ln) / beta
    return out


@pytest.mark.parametrize(
    "beta,clip,mode,adaptive",
    [(1.0, 5.0, "all", True), (0.1, 5.0, "all", True), (0.5, 2.0, "binary", True), (1.0, 5.0, "all", False)]
    + [(0.3, 3.0, m, True) for m in ("positive_only", "negative_only", "one_only")],
)
def test_nft_matches_loop_loss_and_gradient(beta, clip, mode, adaptive):
    v, v_old, noise, x0, t, adv = _inputs()
    out = fo.diffusion_nft(
        v, v_old, noise, x0, t, adv, beta=beta, adv_clip_max=clip, adv_mode=mode, adaptive_weight=adaptive
    )
    (g,) = torch.autograd.grad(out.per_action.sum(), v)
    ref = nft_reference(v, v_old, noise, x0, t, adv, beta=beta, clip=clip, adv_mode=mode, adaptive=adaptive)
    (g_ref,) = torch.autograd.grad(ref.sum(), v)
    torch.testing.assert_close(out.per_action, ref, **TOL)
    torch.testing.assert_close(g, g_ref, **TOL)
    assert not out.clipped.any() and out.ratio is None
    # the old policy is a target: no gradient reaches it
    assert torch.autograd.grad(out.per_action.sum(), v_old, allow_unused=True)[0] is None


def test_nft_gradient_closed_form():
    """dL/dv = c (-2t/D) [r (x0+ - x0) / w+ - (1 - r) (x0- - x0) / w-] (beta cancels), D = latent size."""
    v, v_old, noise, x0, t, adv = _inputs(seed=3)
    beta, clip = 0.7, 5.0
    out = fo.diffusion_nft(v, v_old, noise, x0, t, adv, beta=beta, adv_clip_max=clip)
    (g,) = torch.autograd.grad(out.per_action.sum(), v)
    d = v[0, 0].numel()
    r = (adv.clamp(-clip, clip) / clip / 2 + 0.5).clamp(0, 1)
    for i in range(t.shape[0]):
        for j in range(t.shape[1]):
            s = float(t[i, j])
            xt = (1 - s) * x0[i, j] + s * noise[i, j]
            ep = xt - s * (beta * v[i, j] + (1 - beta) * v_old[i, j]) - x0[i, j]
            en = xt - s * ((1 + beta) * v_old[i, j] - beta * v[i, j]) - x0[i, j]
            wp, wn = ep.abs().mean().clamp(min=1e-5), en.abs().mean().clamp(min=1e-5)
            expected = clip * (-2 * s / d) * (r[i] * ep / wp - (1 - r[i]) * en / wn)
            torch.testing.assert_close(g[i, j], expected.detach(), **TOL)


def test_nft_hand_worked():
    """x0 = [1, -1], eps = 0, t = 1/2, v = [1, 0], v_old = 0, beta = 1, A = 2.5 (r = 3/4):
    v+ = [1, 0], v- = [-1, 0]; x0+ = [0, -1/2], L+ = (1 + 1/4)/2 / (3/4) = 5/6; x0- = [1, -1/2],
    L- = (1/4)/2 / (1/4) = 1/2; loss = 5 (3/4 * 5/6 + 1/4 * 1/2) = 3.75, dL/dv = [2.5, 0]."""
    v = torch.tensor([[1.0, 0.0]], dtype=F64, requires_grad=True)
    out = fo.diffusion_nft(
        v,
        torch.zeros(1, 2, dtype=F64),
        torch.zeros(1, 2, dtype=F64),
        torch.tensor([[1.0, -1.0]], dtype=F64),
        torch.tensor([0.5], dtype=F64),
        torch.tensor([2.5], dtype=F64),
    )
    assert float(out.per_action.detach()[0]) == pytest.approx(3.75, abs=1e-12)
    assert float(out.stats["positive_loss"][0]) == pytest.approx(5 / 6, abs=1e-12)
    assert float(out.stats["negative_loss"][0]) == pytest.approx(0.5, abs=1e-12)
    (g,) = torch.autograd.grad(out.per_action.sum(), v)
    torch.testing.assert_close(g, torch.tensor([[2.5, 0.0]], dtype=F64), rtol=0, atol=1e-12)


def test_nft_on_policy_is_signed_advantage_weighted_matching():
    """With v_old = sg(v) both implicit policies equal v, so the gradient is (2r - 1) c d/dv [mean((x_t - t v -
    x0)^2) / w]: positive r pulls v to the sample's velocity, negative pushes it away, r = 1/2 does nothing."""
    v, _, noise, x0, t, adv = _inputs(seed=5)
    adv = torch.tensor([5.0, -5.0, 0.0], dtype=F64)
    out = fo.diffusion_nft(v, v.detach(), noise, x0, t, adv)
    (g,) = torch.autograd.grad(out.per_action.sum(), v)
    target = noise - x0
    for i, sign in enumerate((1.0, -1.0, 0.0)):
        for j in range(t.shape[1]):
            s = float(t[i, j])
            err = -s * (v[i, j] - target[i, j])  # x0_pred - x0
            w = err.abs().mean()
            expected = sign * 5.0 * (-2 * s / err.numel()) * err / w
            torch.testing.assert_close(g[i, j], expected.detach(), **TOL)


def test_nft_optimality_modes():
    a = torch.tensor([-9.0, -2.5, 0.0, 1.0, 7.0], dtype=F64)
    expect = {
        "all": [0.0, 0.25, 0.5, 0.6, 1.0],
        "positive_only": [0.5, 0.5, 0.5, 0.6, 1.0],
        "negative_only": [0.0, 0.25, 0.5, 0.5, 0.5],
        "one_only": [0.5, 0.5, 0.5, 0.6, 0.6],
        "binary": [0.4, 0.4, 0.5, 0.6, 0.6],
    }
    for mode, want in expect.items():
        got = fo.nft_optimality(a, adv_clip_max=5.0, adv_mode=mode)
        torch.testing.assert_close(got, torch.tensor(want, dtype=F64), rtol=0, atol=1e-12, msg=mode)
    with pytest.raises(ValueError, match="adv_mode must be one of"):
        fo.nft_optimality(a, adv_mode="both")
    with pytest.raises(ValueError, match="adv_clip_max must be > 0"):
        fo.nft_optimality(a, adv_clip_max=0)


# ----------------------------------------------------------------------------- AWM


def awm_reference(v, v_old, noise, x0, t, adv, *, weighting, p, clip, adv_clip):
    """A plain loop from Flow-Factory's AWMTrainer (compute_weighted_log_prob and the PPO-clipped loss)."""
    out = torch.zeros(t.shape, dtype=v.dtype)
    eps = 1e-10

    def logp(vel, tgt, s):
        loss = ((vel - tgt) ** 2).mean()
        if weighting == "uniform":
            w = loss
        elif weighting == "t":
            w = s * loss
        elif weighting == "t**2":
            w = s * s * loss
        elif weighting == "huber":
            w = s * (torch.sqrt(loss + eps) - math.sqrt(eps))
        else:
            w = s / p * ((loss + eps) ** p - eps**p)
        return -w

    for i in range(t.shape[0]):
        a = min(max(float(adv[i]), -adv_clip), adv_clip)
        for j in range(t.shape[1]):
            s = float(t[i, j])
            tgt = noise[i, j] - x0[i, j]
            rho = torch.exp(logp(v[i, j], tgt, s) - logp(v_old[i, j].detach(), tgt, s))
            out[i, j] = torch.maximum(-a * rho, -a * rho.clamp(1 - clip, 1 + clip))
    return out


@pytest.mark.parametrize("weighting", ["uniform", "Uniform", "t", "t**2", "huber", "ghuber"])
@pytest.mark.parametrize("clip", [1e-4, 0.5])
def test_awm_matches_loop_loss_and_gradient(weighting, clip):
    v, v_old, noise, x0, t, adv = _inputs(seed=1)
    kw = {"weighting": weighting, "ghuber_power": 0.25, "clip_range": clip, "adv_clip_range": 5.0}
    out = fo.awm(v, v_old, noise, x0, t, adv, **kw)
    (g,) = torch.autograd.grad(out.per_action.sum(), v)
    ref = awm_reference(
        v, v_old, noise, x0, t, adv, weighting=weighting.lower(), p=0.25, clip=clip, adv_clip=5.0
    )
    (g_ref,) = torch.autograd.grad(ref.sum(), v)
    torch.testing.assert_close(out.per_action, ref, **TOL)
    torch.testing.assert_close(g, g_ref, **TOL)
    if clip == 1e-4:  # v_old is far from v: every ratio leaves [1 - 1e-4, 1 + 1e-4] on one side or the other
        assert out.clipped.any()


def test_awm_equals_ppo_clip_on_its_log_prob():
    """AWM is mmalign's ppo_clip with log pi = -w(l, t) (Flow-Factory's compute_weighted_log_prob)."""
    v, v_old, noise, x0, t, adv = _inputs(seed=2)
    out = fo.awm(v, v_old, noise, x0, t, adv, weighting="ghuber", clip_range=0.05, adv_clip_range=4.0)
    lp = fo.awm_log_prob(v, noise - x0, t, weighting="ghuber")
    lp_old = fo.awm_log_prob(v_old.detach(), noise - x0, t, weighting="ghuber")
    ppo = losses.ppo_clip(
        lp, lp_old, adv.clamp(-4, 4), torch.ones_like(t, dtype=torch.bool), eps_low=0.05, eps_high=0.05
    )
    torch.testing.assert_close(out.per_action, ppo.per_token, **TOL)
    assert torch.equal(out.clipped, ppo.clipped)


def test_awm_hand_worked():
    """x0 = [1, -1], eps = 0: target = [-1, 1]. v = target, v_old = 0: log pi = 0, log pi_old = -1, rho = e;
    A = 1, clip 1e-4: loss = max(-e, -(1 + 1e-4)) = -1.0001, clipped, no gradient. v = v_old = 0: rho = 1,
    d(log pi)/dv = -2 (v - target) / 2 = [-1, 1], dL/dv = -A rho d(log pi)/dv = [1, -1] (descent moves v to the
    target)."""
    x0 = torch.tensor([[1.0, -1.0]], dtype=F64)
    eps = torch.zeros(1, 2, dtype=F64)
    t, a = torch.tensor([0.5], dtype=F64), torch.tensor([1.0], dtype=F64)
    v = torch.tensor([[-1.0, 1.0]], dtype=F64, requires_grad=True)
    out = fo.awm(v, torch.zeros(1, 2, dtype=F64), eps, x0, t, a)
    assert float(out.ratio.detach()[0]) == pytest.approx(math.e, abs=1e-12)
    assert float(out.per_action.detach()[0]) == pytest.approx(-1.0001, abs=1e-12) and bool(out.clipped[0])
    (g,) = torch.autograd.grad(out.per_action.sum(), v)
    assert float(g.abs().max()) == 0.0
    v = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    out = fo.awm(v, v.detach(), eps, x0, t, a)
    assert float(out.per_action.detach()[0]) == pytest.approx(-1.0, abs=1e-12)
    (g,) = torch.autograd.grad(out.per_action.sum(), v)
    torch.testing.assert_close(g, torch.tensor([[1.0, -1.0]], dtype=F64), rtol=0, atol=1e-12)


def test_awm_options_are_validated():
    v, v_old, noise, x0, t, adv = _inputs()
    with pytest.raises(ValueError, match="weighting must be one of"):
        fo.awm(v, v_old, noise, x0, t, adv, weighting="cubic")
    with pytest.raises(ValueError, match="clip_range must satisfy lo <= 0 <= hi"):
        fo.awm(v, v_old, noise, x0, t, adv, clip_range=[0.1, 0.2])
    out = fo.awm(v, v_old, noise, x0, t, adv, clip_range=[-0.2, 0.1])  # asymmetric (lo, hi) as Flow-Factory's
    ref = awm_reference(v, v_old, noise, x0, t, adv, weighting="uniform", p=0.25, clip=0.2, adv_clip=5.0)
    hi = fo.awm(v, v_old, noise, x0, t, adv, clip_range=0.2)
    torch.testing.assert_close(hi.per_action, ref, **TOL)
    assert not torch.equal(out.per_action, hi.per_action)


def flow_factory_awm_step_loss(v, v_old, v_ema, noise, x0, t, adv, *, clip, adv_clip, ema_kl_beta):
    """Flow-Factory's AWMTrainer.optimize for one training timestep j (trainers/awm.py, steps 3 and 5):
    loss_j = mean_i max(-A rho, -A clip(rho)) + ema_kl_beta * mean_i mean((v - v_ema)^2), the EMA prediction
    under no_grad. Returns the mean over the K timesteps (one backward each, so the summed gradient / K)."""
    total = 0.0
    for j in range(t.shape[1]):
        policy = 0.0
        kl = 0.0
        for i in range(t.shape[0]):
            a = min(max(float(adv[i]), -adv_clip), adv_clip)
            tgt = noise[i, j] - x0[i, j]
            lp = -((v[i, j] - tgt) ** 2).mean()
            lp_old = -((v_old[i, j].detach() - tgt) ** 2).mean()
            rho = torch.exp(lp - lp_old)
            policy = policy + torch.maximum(-a * rho, -a * rho.clamp(1 - clip, 1 + clip))
            kl = kl + ((v[i, j] - v_ema[i, j].detach()) ** 2).mean()
        total = total + policy / t.shape[0] + ema_kl_beta * kl / t.shape[0]
    return total / t.shape[1]


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_awm_ema_kl_matches_flow_factory(beta):
    v, v_old, noise, x0, t, adv = _inputs(seed=7)
    g = torch.Generator().manual_seed(8)
    v_ema = (v.detach() + 0.2 * torch.randn(v.shape, generator=g, dtype=F64)).requires_grad_(True)
    out = fo.awm(v, v_old, noise, x0, t, adv, clip_range=0.3, ema_kl_beta=beta, v_ema=v_ema)
    mean = out.per_action.mean()
    (g_v,) = torch.autograd.grad(mean, v, retain_graph=True)
    assert v_ema.grad is None and not torch.autograd.grad(mean, v_ema, allow_unused=True)[0]  # a fixed target
    ref = flow_factory_awm_step_loss(
        v, v_old, v_ema, noise, x0, t, adv, clip=0.3, adv_clip=5.0, ema_kl_beta=beta
    )
    (g_ref,) = torch.autograd.grad(ref, v)
    torch.testing.assert_close(mean, ref, **TOL)
    torch.testing.assert_close(g_v, g_ref, **TOL)
    plain = fo.awm(v, v_old, noise, x0, t, adv, clip_range=0.3)  # beta 0 (the default): no term
    kl = ((v.detach() - v_ema.detach()) ** 2).mean(dim=(2, 3, 4))
    torch.testing.assert_close(out.per_action - plain.per_action, beta * kl, **TOL)
    torch.testing.assert_close(out.stats["ema_kl"], kl, **TOL)


def test_awm_ema_kl_hand_worked_and_validated():
    """v = [1, 3], v_ema = [0, 1]: mean((v - v_ema)^2) = (1 + 4) / 2 = 2.5; the term's gradient is
    beta * 2 (v - v_ema) / 2 = beta * [1, 2]. With v = v_old the PPO term is -A (rho = 1) and its gradient
    -A d(log pi)/dv = A (v - target) = A ([1, 3] - [-1, 1]) = [2, 2] for A = 1."""
    x0 = torch.tensor([[1.0, -1.0]], dtype=F64)
    eps = torch.zeros(1, 2, dtype=F64)
    t, a = torch.tensor([0.5], dtype=F64), torch.tensor([1.0], dtype=F64)
    v = torch.tensor([[1.0, 3.0]], dtype=F64, requires_grad=True)
    v_ema = torch.tensor([[0.0, 1.0]], dtype=F64)
    out = fo.awm(v, v.detach(), eps, x0, t, a, ema_kl_beta=0.5, v_ema=v_ema)
    assert float(out.per_action.detach()[0]) == pytest.approx(-1.0 + 0.5 * 2.5, abs=1e-12)
    (g,) = torch.autograd.grad(out.per_action.sum(), v)
    torch.testing.assert_close(g, torch.tensor([[2.0 + 0.5, 2.0 + 1.0]], dtype=F64), rtol=0, atol=1e-12)
    vv, v_old, noise, x0s, ts, adv = _inputs()
    with pytest.raises(ValueError, match="ema_kl_beta > 0 needs v_ema"):
        fo.awm(vv, v_old, noise, x0s, ts, adv, ema_kl_beta=0.1)
    with pytest.raises(ValueError, match="ema_kl_beta must be a finite number >= 0"):
        fo.awm(vv, v_old, noise, x0s, ts, adv, ema_kl_beta=-1.0, v_ema=vv.detach())
    assert fo.options("awm")["ema_kl_beta"] == 0.0 and "v_ema" not in fo.options("awm")
    assert fo.inputs("awm") == ("v_ema",) and fo.inputs("diffusion_nft") == ()


# ----------------------------------------------------------------------------- shared contract


@pytest.mark.parametrize("name", ["diffusion_nft", "awm"])
def test_mask_zeroes_loss_and_gradient_even_with_nan(name):
    v, v_old, noise, x0, t, adv = _inputs(seed=4)
    mask = torch.tensor([[True, False], [True, True], [False, False]])
    poisoned = v.detach().clone()
    poisoned[~mask] = float("nan")
    vv = poisoned.requires_grad_(True)
    out = fo.get(name)(vv, v_old, noise, x0, t, adv, mask)
    assert torch.isfinite(out.per_action).all() and (out.per_action[~mask] == 0).all()
    (g,) = torch.autograd.grad(out.per_action.sum(), vv)
    assert torch.isfinite(g).all() and (g[~mask] == 0).all()
    full = fo.get(name)(v.detach(), v_old, noise, x0, t, adv)
    torch.testing.assert_close(out.per_action[mask], full.per_action[mask], **TOL)


@pytest.mark.parametrize("name", ["diffusion_nft", "awm"])
def test_per_sample_and_per_action_shapes(name):
    """t Float[B] (one sigma per sample) gives a Float[B] loss equal to the K = 1 slice of the [B, K] form;
    advantages may be per action too."""
    v, v_old, noise, x0, t, adv = _inputs(seed=6)
    fn = fo.get(name)
    flat = fn(v[:, 0], v_old[:, 0], noise[:, 0], x0[:, 0], t[:, 0], adv)
    full = fn(v, v_old, noise, x0, t, adv[:, None].expand(t.shape))
    assert flat.per_action.shape == (3,) and full.per_action.shape == (3, 2)
    torch.testing.assert_close(flat.per_action, full.per_action[:, 0], **TOL)
    with pytest.raises(ValueError, match="advantages must be"):
        fn(v, v_old, noise, x0, t, adv[:2])
    with pytest.raises(ValueError, match="must start with the action shape"):
        fn(v, v_old, noise, x0, t[:, :1], adv)


def test_velocity_kl_and_noised():
    v = torch.tensor([[[1.0, 2.0], [0.0, 0.0]]], dtype=F64)  # [B=1, K=2, D=2]
    ref = torch.tensor([[[0.0, 0.0], [1.0, -1.0]]], dtype=F64)
    torch.testing.assert_close(fo.velocity_kl(v, ref, 2), torch.tensor([[2.5, 1.0]], dtype=F64))
    x0, eps = torch.tensor([[2.0, 4.0]]), torch.tensor([[0.0, -4.0]])
    torch.testing.assert_close(fo.noised(x0, eps, torch.tensor([0.25])), torch.tensor([[1.5, 2.0]]))


def test_registry():
    assert {"diffusion_nft", "awm"} <= set(fo.names())
    assert fo.options("diffusion_nft") == {
        "beta": 1.0,
        "adv_clip_max": 5.0,
        "adv_mode": "all",
        "adaptive_weight": True,
    }
    assert fo.options("awm")["clip_range"] == 1e-4 and fo.options("awm")["weighting"] == "uniform"
    assert fo.timestep_defaults("diffusion_nft") == {"strategy": "schedule_subset", "timestep_range": 0.99}
    assert fo.timestep_defaults("awm") == {"strategy": "discrete", "timestep_range": 0.9}
    assert "DiffusionNFT" in fo.REGISTRY.describe("diffusion_nft") and "AWM" in fo.REGISTRY.describe("awm")
    v, v_old, noise, x0, t, adv = _inputs()
    with pytest.raises(TypeError, match="flow objective 'diffusion_nft' got unknown option"):
        fo.get("diffusion_nft")(v, v_old, noise, x0, t, adv, None, bta=1.0)
    with pytest.raises(RegistryError, match="Did you mean 'awm'"):
        fo.get("awn")


# ----------------------------------------------------------------------------- timesteps

SIGMAS = torch.tensor(
    [1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.45, 0.3, 0.2, 0.1]
)  # 10 steps, sigma' = 0 after the last


def test_num_train_timesteps():
    assert fo.num_train_timesteps(10, timestep_range=0.99) == 9  # DiffusionNFT: int(10 * 0.99)
    assert fo.num_train_timesteps(14, timestep_range=0.9) == 12  # Flow-Factory: int(14 * 0.9)
    assert fo.num_train_timesteps(14, timestep_range=[0.2, 0.5]) == 4
    assert fo.num_train_timesteps(1, timestep_range=0.3) == 1
    assert fo.num_train_timesteps(10, num_timesteps=2) == 2
    with pytest.raises(ValueError, match="timestep_range must satisfy"):
        fo.num_train_timesteps(10, timestep_range=1.5)


def test_schedule_subset_is_the_authors_per_sample_permutation():
    """scripts/train_nft_sd3.py: per sample randperm(num_steps), the first int(num_steps * 0.99) kept."""
    draw = fo.sample_timesteps(SIGMAS, 4, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    expected = torch.stack([torch.randperm(10, generator=g)[:9] for _ in range(4)])
    assert torch.equal(draw.index, expected)
    torch.testing.assert_close(draw.t, SIGMAS[expected])
    assert all(len(set(row.tolist())) == 9 for row in draw.index)
    # the range sets K only: a last sigma below 1 - 0.99 is still drawn, as in the authors' script
    tiny = fo.sample_timesteps(
        torch.tensor([1.0, 0.5, 0.005]), 50, generator=torch.Generator().manual_seed(0)
    )
    assert tiny.index.shape == (50, 2) and 2 in tiny.index.flatten().tolist()
    cand = fo.sample_timesteps(SIGMAS, 3, num_timesteps=2, candidates=[1, 2, 3], generator=torch.Generator())
    assert set(cand.index.flatten().tolist()) <= {1, 2, 3}
    with pytest.raises(ValueError, match="exceeds the 3 schedule steps"):
        fo.sample_timesteps(SIGMAS, 1, num_timesteps=4, candidates=[1, 2, 3])


def _ff_stratified(k, start, end, g):
    bounds = torch.linspace(start, end, k + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    return lower + (torch.rand(k, generator=g) * (upper - lower)).long()


@pytest.mark.parametrize("strategy", ["discrete", "discrete_with_init", "discrete_wo_init"])
def test_discrete_strategies_match_flow_factory(strategy):
    """Flow-Factory's TimeSampler.discrete on timestep_range 0.75: the steps with sigma >= 0.25 are 0..7."""
    draw = fo.sample_timesteps(
        SIGMAS,
        2,
        strategy=strategy,
        timestep_range=0.75,
        num_timesteps=3,
        generator=torch.Generator().manual_seed(1),
    )
    g = torch.Generator().manual_seed(1)
    if strategy == "discrete":
        idx = _ff_stratified(3, 0, 7, g)
    elif strategy == "discrete_wo_init":
        idx = _ff_stratified(3, 1, 7, g)
    else:
        idx = torch.cat([torch.tensor([0]), _ff_stratified(2, 1, 7, g)])
    assert torch.equal(draw.index, idx.expand(2, 3))
    torch.testing.assert_close(draw.t, SIGMAS[idx].expand(2, 3))
    if strategy == "discrete_with_init":
        assert (draw.index[:, 0] == 0).all()


def test_continuous_strategies_match_flow_factory():
    lo, hi, k, s = 0.1, 0.9, 4, 3.0
    draw = fo.sample_timesteps(
        SIGMAS, 2, strategy="uniform", timestep_range=[lo, hi], num_timesteps=k, time_shift=s,
        generator=torch.Generator().manual_seed(2),
    )  # fmt: skip
    g = torch.Generator().manual_seed(2)
    u = torch.rand(k, generator=g)
    f = lo + (torch.arange(k) + u) / k * (hi - lo)
    f = f[torch.randperm(k, generator=g)]
    f = s * f / (1 + (s - 1) * f)
    assert draw.index is None
    torch.testing.assert_close(draw.t, (1 - f).expand(2, k))
    draw = fo.sample_timesteps(
        SIGMAS, 2, strategy="logit_normal", timestep_range=[lo, hi], num_timesteps=k, time_shift=s,
        generator=torch.Generator().manual_seed(3),
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    u = torch.rand(k, generator=g)
    q = ((torch.arange(k) + u) / k).clamp(1e-7, 1 - 1e-7)
    z = torch.tensor([math.sqrt(2) * torch.erfinv(torch.tensor(2 * float(x) - 1)).item() for x in q])
    z = z[torch.randperm(k, generator=g)]
    raw = torch.sigmoid(z)
    raw = (s * raw / (1 + (s - 1) * raw)).clamp(0.01, 1 - 1e-6)
    torch.testing.assert_close(draw.t, (1 - (lo + raw * (hi - lo))).expand(2, k), rtol=1e-5, atol=1e-6)
    assert ((draw.t >= 1 - hi - 1e-6) & (draw.t <= 1 - lo + 1e-6)).all()
    with pytest.raises(ValueError, match="timestep strategy must be one of"):
        fo.sample_timesteps(SIGMAS, 1, strategy="cosine")


def test_nft_weight_floor():
    """The adaptive weight is max(mean|x0± - x0|, 1e-5): an error of 1e-6 everywhere gives L± = 1e-12 / 1e-5."""
    x0 = torch.zeros(1, 4, dtype=F64)
    v = torch.full((1, 4), -2e-6, dtype=F64)  # t = 1/2, eps = 0: x0± = -t v = 1e-6
    out = fo.diffusion_nft(
        v, v, torch.zeros(1, 4, dtype=F64), x0, torch.tensor([0.5], dtype=F64), torch.zeros(1)
    )
    assert float(out.stats["positive_loss"][0]) == pytest.approx(1e-7, rel=1e-9)
    assert float(out.per_action.detach()[0]) == pytest.approx(5.0 * 1e-7, rel=1e-9)


def test_awm_log_prob_hand_values():
    """l = mean((v - target)^2) = 4 at t = 1/2: uniform -4, t -2, t**2 -1, huber -(1/2)(sqrt(4 + 1e-10) - 1e-5),
    ghuber(p = 1/2) -(1/2)/(1/2) ((4 + 1e-10)^(1/2) - 1e-5)."""
    v, target, t = (
        torch.tensor([[2.0, -2.0]], dtype=F64),
        torch.zeros(1, 2, dtype=F64),
        torch.tensor([0.5], dtype=F64),
    )
    huber = -0.5 * (math.sqrt(4 + 1e-10) - 1e-5)
    ghuber = -(math.sqrt(4 + 1e-10) - 1e-5)
    for w, want in {"uniform": -4.0, "t": -2.0, "t**2": -1.0, "huber": huber, "ghuber": ghuber}.items():
        got = fo.awm_log_prob(v, target, t, weighting=w, ghuber_power=0.5)
        assert float(got[0]) == pytest.approx(want, abs=1e-12), w
