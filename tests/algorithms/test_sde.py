"""mmalign.algorithms.sde: each step against an independent plain-float reference of its docs/algorithms.md formula."""

from __future__ import annotations

import math

import pytest
import torch

from mmalign.algorithms import sde
from mmalign.registry import RegistryError

# ------------------------------------------------------------- independent references (plain floats + math)


def ref_flow(v, x, s, sn, a, fallback=None):
    std_t = a * math.sqrt(s / (1 - (fallback if s == 1 else s)))
    dt = sn - s
    mean = x + (v + std_t**2 / (2 * s) * (x + (1 - s) * v)) * dt
    return mean, std_t * math.sqrt(-dt)


def ref_cps(v, x, s, sn, a):
    std_t = sn * math.sin(a * math.pi / 2)
    x0, x1 = x - s * v, x + (1 - s) * v
    return (1 - sn) * x0 + math.sqrt(sn**2 - std_t**2) * x1, std_t


def ref_dance(v, x, s, sn, eta):
    ds = sn - s
    x0 = x - s * v
    score = -(x - (1 - s) * x0) / s**2
    return x + ds * v - 0.5 * eta**2 * score * ds, eta * math.sqrt(s - sn)


def ref_ddim(eps, x, ab_t, ab_p, eta):
    x0 = (x - math.sqrt(1 - ab_t) * eps) / math.sqrt(ab_t)
    std_t = eta * math.sqrt((1 - ab_p) / (1 - ab_t)) * math.sqrt(1 - ab_t / ab_p)
    return math.sqrt(ab_p) * x0 + math.sqrt(1 - ab_p - std_t**2) * eps, std_t


def ref_log_normal(y, mean, std):
    return -((y - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)


# (kind, kwargs besides the two latents, reference, reference scalar args)
CASES = [
    ("flow_sde", dict(sigma=0.7, sigma_next=0.55, noise_level=0.7), ref_flow, (0.7, 0.55, 0.7)),
    (
        "cps",
        dict(sigma=0.7, sigma_next=0.55, noise_level=0.5, log_prob_form="gaussian"),
        ref_cps,
        (0.7, 0.55, 0.5),
    ),
    ("dance", dict(sigma=0.7, sigma_next=0.55, eta=0.3), ref_dance, (0.7, 0.55, 0.3)),
    ("ddim", dict(alpha_bar_t=0.64, alpha_bar_prev=0.81, eta=1.0), ref_ddim, (0.64, 0.81, 1.0)),
]
IDS = [c[0] for c in CASES]


def _latents(kind, a, b):
    return {"eps_pred": a, "x": b} if kind == "ddim" else {"v": a, "x": b}


def _inputs(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


# ------------------------------------------------------------------------------------- hand-worked numbers


def test_hand_worked_numbers():
    one = torch.ones(1, 1)
    # flow_sde, sigma=.5, sigma'=.4, a=.7, x=1, v=.5: s_t = .7*sqrt(.5/.5) = .7, dt = -.1,
    # mu = 1 + [.5 + .49/1 * (1 + .5*.5)] * (-.1) = 1 - .11125 = .88875; std = .7*sqrt(.1) = .2213594
    out = sde.flow_sde(0.5 * one, one, 0.5, 0.4, noise_level=0.7, noise=torch.zeros(1, 1))
    assert out.mean.item() == pytest.approx(0.88875, abs=1e-6)
    assert out.std.item() == pytest.approx(0.2213594, abs=1e-6)
    assert out.sample.item() == pytest.approx(0.88875, abs=1e-6)  # zero noise -> the mean
    # log N(mu; mu, std) = -log(.2213594) - .5 log(2 pi) = 1.5079 - .9189385 = .5889998
    assert out.log_prob.item() == pytest.approx(-math.log(0.7 * math.sqrt(0.1)) - 0.9189385, abs=1e-5)
    # cps, a=.5: s_t = .4 sin(pi/4) = .2828427; x0 = .75, x1 = 1.25;
    # mu = .6*.75 + sqrt(.16 - .08)*1.25 = .45 + .3535534 = .8035534
    out = sde.cps(0.5 * one, one, 0.5, 0.4, noise_level=0.5, noise=torch.zeros(1, 1))
    assert (out.mean.item(), out.std.item()) == pytest.approx((0.8035534, 0.2828427), abs=1e-6)
    # dance, eta=.3: x0 = .75, score = -(1 - .5*.75)/.25 = -2.5, dsigma = -.1;
    # mu = 1 - .05 - .5*.09*(-2.5)*(-.1) = .93875; std = .3*sqrt(.1) = .0948683
    out = sde.dance(0.5 * one, one, 0.5, 0.4, eta=0.3, noise=torch.zeros(1, 1))
    assert (out.mean.item(), out.std.item()) == pytest.approx((0.93875, 0.0948683), abs=1e-6)
    # ddim, ab_t=.64, ab_prev=.81, eta=1, x=1, eps=.5: x0 = (1 - .6*.5)/.8 = .875;
    # s_t^2 = (.19/.36)*(1 - .64/.81) = .1107682 -> s_t = .3328185;
    # mu = .9*.875 + sqrt(.19 - .1107682)*.5 = .7875 + .1407407 = .9282407
    out = sde.ddim(0.5 * one, one, 0.64, 0.81, eta=1.0, noise=torch.zeros(1, 1))
    assert (out.mean.item(), out.std.item()) == pytest.approx((0.9282407, 0.3328185), abs=1e-6)


def test_kl_std_leaves_out_the_sqrt_dt_factor():
    """kl_std is the sigma_t the KL on step means divides by (Flow-GRPO's std_dev_t), not the step's std."""
    one = torch.ones(1, 1)
    # flow_sde, sigma=.5, a=.7: s_t = .7 * sqrt(.5 / .5) = .7 (std = .7 * sqrt(.1) = .2213594)
    assert sde.flow_sde(0.5 * one, one, 0.5, 0.4, noise_level=0.7).kl_std.item() == pytest.approx(
        0.7, abs=1e-7
    )
    # dance: eta = .3 (std = .3 * sqrt(.1))
    assert sde.dance(0.5 * one, one, 0.5, 0.4, eta=0.3).kl_std.item() == pytest.approx(0.3, abs=1e-7)
    # cps and ddim have no dt factor: kl_std = std (.4 sin(pi/4) = .2828427; .3328185 as above)
    assert sde.cps(0.5 * one, one, 0.5, 0.4, noise_level=0.5).kl_std.item() == pytest.approx(
        0.2828427, abs=1e-6
    )
    assert sde.ddim(0.5 * one, one, 0.64, 0.81, eta=1.0).kl_std.item() == pytest.approx(0.3328185, abs=1e-6)


def test_flow_kl_on_step_means_hand_worked():
    """KL of two flow_sde steps from the same x with velocities .5 and .3 (sigma .5 -> .4, a = .7).

    The mean's velocity coefficient is (1 + s_t^2 (1 - sigma) / (2 sigma)) dt = (1 + .49 * .5) * (-.1) = -.1245,
    so mu1 - mu2 = -.1245 * .2 = -.0249 and KL = .0249^2 / (2 * .7^2) = .00062001 / .98 = 6.32663e-4
    (dividing by the step's full variance .049 instead would give 10x that: 1 / |dt|).
    """
    from mmalign.policies.denoising import mean_kl

    one = torch.ones(1, 1)
    a = sde.flow_sde(0.5 * one, one, 0.5, 0.4, noise_level=0.7)
    b = sde.flow_sde(0.3 * one, one, 0.5, 0.4, noise_level=0.7)
    assert (a.mean - b.mean).item() == pytest.approx(-0.0249, abs=1e-7)
    assert mean_kl(a.mean, b.mean, a.kl_std).item() == pytest.approx(6.32663e-4, rel=1e-5)
    # per-sample sigma_t ([B]-shaped coefficient): the same number for each sample
    two = torch.ones(2, 3)
    a2 = sde.flow_sde(0.5 * two, two, torch.tensor([0.5, 0.5]), torch.tensor([0.4, 0.4]), noise_level=0.7)
    b2 = sde.flow_sde(0.3 * two, two, torch.tensor([0.5, 0.5]), torch.tensor([0.4, 0.4]), noise_level=0.7)
    torch.testing.assert_close(
        mean_kl(a2.mean, b2.mean, a2.kl_std), torch.full((2,), 6.32663e-4), rtol=1e-5, atol=0
    )


def test_cps_default_log_prob_is_flow_grpo_squared_error():
    """Flow-GRPO scores a CPS step with -mean((x' - mu)^2): no 1/(2 s_t^2) factor, no constants."""
    one = torch.ones(1, 1)
    # mu = .8035534 (hand-worked above); x' = mu + .1 -> log p = -.01
    out = sde.cps(0.5 * one, one, 0.5, 0.4, noise_level=0.5, prev_sample=torch.full((1, 1), 0.9035534))
    assert out.log_prob.item() == pytest.approx(-0.01, abs=1e-6)
    # the Gaussian option on the same transition: -.01 / (2 * .08) - log(.2828427) - .5 log(2 pi) = .2565
    gauss = sde.cps(
        0.5 * one,
        one,
        0.5,
        0.4,
        noise_level=0.5,
        prev_sample=torch.full((1, 1), 0.9035534),
        log_prob_form="gaussian",
    )
    assert gauss.log_prob.item() == pytest.approx(-0.0625 + 1.2628643 - 0.9189385, abs=1e-5)
    # plain loop over elements on random inputs
    a, b = _inputs((2, 3, 2, 2), seed=5)
    noise = torch.randn((2, 3, 2, 2), generator=torch.Generator().manual_seed(6))
    out = sde.cps(a, b, 0.7, 0.55, noise_level=0.5, noise=noise)
    for i in range(2):
        sq = []
        for j in range(a[i].numel()):
            mean_r, _ = ref_cps(a[i].flatten()[j].item(), b[i].flatten()[j].item(), 0.7, 0.55, 0.5)
            sq.append((out.sample[i].flatten()[j].item() - mean_r) ** 2)
        assert out.log_prob[i].item() == pytest.approx(-sum(sq) / len(sq), rel=1e-5, abs=1e-7)
    with pytest.raises(ValueError, match="log_prob_form must be one of squared_error, gaussian"):
        sde.cps(a, b, 0.7, 0.55, noise_level=0.5, log_prob_form="full")


# ------------------------------------------------------------------------------- against the references


@pytest.mark.parametrize("kind,kw,ref,args", CASES, ids=IDS)
def test_matches_reference_elementwise(kind, kw, ref, args):
    a, b = _inputs((2, 3, 2, 2), seed=1)
    noise = torch.randn((2, 3, 2, 2), generator=torch.Generator().manual_seed(2))
    out = sde.step(kind, **_latents(kind, a, b), **kw, noise=noise)
    assert out.sample.shape == out.mean.shape == a.shape and out.log_prob.shape == (2,)
    std = out.std.expand_as(out.mean)
    for idx in [(0, 0, 0, 0), (0, 2, 1, 0), (1, 1, 0, 1), (1, 2, 1, 1)]:
        mean_r, std_r = ref(a[idx].item(), b[idx].item(), *args)
        assert out.mean[idx].item() == pytest.approx(mean_r, rel=1e-5, abs=1e-6)
        assert std[idx].item() == pytest.approx(std_r, rel=1e-5)
        assert out.sample[idx].item() == pytest.approx(mean_r + std_r * noise[idx].item(), rel=1e-5, abs=1e-5)
    # per-sample log-prob: plain-float average of the element log-densities
    for i in range(2):
        vals = [
            ref_log_normal(
                out.sample[i].flatten()[j].item(),
                *ref(a[i].flatten()[j].item(), b[i].flatten()[j].item(), *args),
            )
            for j in range(a[i].numel())
        ]
        assert out.log_prob[i].item() == pytest.approx(sum(vals) / len(vals), rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("kind,kw,ref,args", CASES, ids=IDS)
def test_log_prob_is_torch_normal(kind, kw, ref, args):
    a, b = _inputs((3, 4, 5, 5), seed=3)
    out = sde.step(kind, **_latents(kind, a, b), **kw, generator=torch.Generator().manual_seed(0))
    expected = torch.distributions.Normal(out.mean, out.std).log_prob(out.sample).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob, expected, rtol=1e-5, atol=1e-5)
    assert bool((out.std > 0).all())


def test_flow_sigma_one_uses_fallback():
    a, b = _inputs((2, 4), seed=4)
    out = sde.flow_sde(a, b, 1.0, 0.9, noise_level=0.7, sigma_max_fallback=0.95, noise=torch.zeros(2, 4))
    mean_r, std_r = ref_flow(a[1, 2].item(), b[1, 2].item(), 1.0, 0.9, 0.7, fallback=0.95)
    assert out.mean[1, 2].item() == pytest.approx(mean_r, rel=1e-5, abs=1e-6)
    assert out.std.item() == pytest.approx(std_r, rel=1e-5)  # .7*sqrt(1/.05)*sqrt(.1) = .9899495
    assert out.std.item() == pytest.approx(0.9899495, rel=1e-6)
    with pytest.raises(ValueError, match="sigma_max_fallback"):
        sde.flow_sde(a, b, 1.0, 0.9, noise_level=0.7)


def test_per_batch_coefficients():
    a, b = _inputs((2, 3, 4), seed=5)
    sig, nxt = torch.tensor([0.9, 0.5]), torch.tensor([0.8, 0.3])
    out = sde.flow_sde(a, b, sig, nxt, noise_level=0.7, noise=torch.zeros(2, 3, 4))
    assert out.std.shape == (2, 1, 1)
    for i in range(2):
        mean_r, std_r = ref_flow(a[i, 1, 2].item(), b[i, 1, 2].item(), sig[i].item(), nxt[i].item(), 0.7)
        assert out.mean[i, 1, 2].item() == pytest.approx(mean_r, rel=1e-5, abs=1e-6)
        assert out.std[i].item() == pytest.approx(std_r, rel=1e-5)
    abt, abp = torch.tensor([0.3, 0.6], dtype=torch.float64), torch.tensor([0.5, 0.9], dtype=torch.float64)
    out = sde.ddim(a, b, abt, abp, eta=torch.tensor([1.0, 0.5]), noise=torch.zeros(2, 3, 4))
    mean_r, std_r = ref_ddim(a[1, 0, 3].item(), b[1, 0, 3].item(), 0.6, 0.9, 0.5)
    assert out.mean[1, 0, 3].item() == pytest.approx(mean_r, rel=1e-5, abs=1e-6)
    assert out.std[1].item() == pytest.approx(std_r, rel=1e-5)


# ---------------------------------------------------------------------- re-scoring, dtypes, determinism


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("kind,kw,ref,args", CASES, ids=IDS)
def test_rescoring_stored_transition_gives_ratio_one(kind, kw, ref, args, dtype):
    a, b = _inputs((2, 3, 4, 4), seed=6, dtype=dtype)
    drawn = sde.step(kind, **_latents(kind, a, b), **kw, generator=torch.Generator().manual_seed(7))
    for t in (drawn.sample, drawn.mean, drawn.std, drawn.log_prob):
        assert t.dtype == torch.float32
    rescored = sde.step(kind, **_latents(kind, a, b), **kw, prev_sample=drawn.sample)
    torch.testing.assert_close(rescored.log_prob, drawn.log_prob, rtol=0, atol=1e-6)
    ratio = torch.exp(rescored.log_prob - drawn.log_prob)
    torch.testing.assert_close(ratio, torch.ones(2), rtol=0, atol=1e-6)
    assert torch.equal(rescored.sample, drawn.sample)


def test_rescoring_keeps_gradient_through_mean():
    a, b = _inputs((2, 3, 4), seed=8)
    v = a.clone().requires_grad_(True)
    with torch.no_grad():
        drawn = sde.flow_sde(v, b, 0.8, 0.7, noise_level=0.7, generator=torch.Generator().manual_seed(0))
    out = sde.flow_sde(v, b, 0.8, 0.7, noise_level=0.7, prev_sample=drawn.sample)
    out.log_prob.sum().backward()
    assert v.grad is not None and bool(v.grad.abs().sum() > 0)


@pytest.mark.parametrize("kind,kw,ref,args", CASES, ids=IDS)
def test_seeded_generator_is_deterministic(kind, kw, ref, args):
    a, b = _inputs((2, 3, 4, 4), seed=9)
    o1 = sde.step(kind, **_latents(kind, a, b), **kw, generator=torch.Generator().manual_seed(123))
    o2 = sde.step(kind, **_latents(kind, a, b), **kw, generator=torch.Generator().manual_seed(123))
    o3 = sde.step(kind, **_latents(kind, a, b), **kw, generator=torch.Generator().manual_seed(124))
    assert torch.equal(o1.sample, o2.sample) and torch.equal(o1.log_prob, o2.log_prob)
    assert not torch.equal(o1.sample, o3.sample)


@pytest.mark.parametrize("shape", [(2, 4, 8, 8), (2, 3, 4, 8, 8)], ids=["image", "video"])
@pytest.mark.parametrize("kind,kw,ref,args", CASES, ids=IDS)
def test_image_and_video_shapes(kind, kw, ref, args, shape):
    a, b = _inputs(shape, seed=10)
    out = sde.step(kind, **_latents(kind, a, b), **kw, generator=torch.Generator().manual_seed(0))
    assert out.sample.shape == shape and out.mean.shape == shape and out.log_prob.shape == (2,)
    dims = tuple(range(1, len(shape)))
    expected = torch.distributions.Normal(out.mean, out.std).log_prob(out.sample).mean(dim=dims)
    torch.testing.assert_close(out.log_prob, expected, rtol=1e-5, atol=1e-5)
    assert bool(torch.isfinite(out.log_prob).all()) and bool((out.std > 0).all())


# --------------------------------------------------------------------------------- dispatcher and errors


def test_registry_and_dispatch():
    assert sde.names() == ["cps", "dance", "ddim", "flow_sde"]
    assert sde.get("cps") is sde.cps
    with pytest.raises(RegistryError, match="Registered: cps, dance, ddim, flow_sde"):
        sde.step("flow_ode", v=torch.zeros(1, 2))
    with pytest.raises(TypeError, match="bogus"):
        sde.step(
            "dance", v=torch.zeros(1, 2), x=torch.zeros(1, 2), sigma=0.5, sigma_next=0.4, eta=0.3, bogus=1
        )


@pytest.mark.parametrize("kind", ["flow_sde", "cps", "dance"])
def test_invalid_sigmas_raise(kind):
    x = torch.zeros(1, 2)
    noise_kw = {"eta": 0.3} if kind == "dance" else {"noise_level": 0.5}
    with pytest.raises(ValueError, match="sigma_next must be < sigma"):
        sde.step(kind, v=x, x=x, sigma=0.4, sigma_next=0.5, **noise_kw)
    with pytest.raises(ValueError, match="sigma_next must be < sigma"):
        sde.step(kind, v=x, x=x, sigma=0.4, sigma_next=0.4, **noise_kw)
    with pytest.raises(ValueError, match="sigma must be in"):
        sde.step(kind, v=x, x=x, sigma=1.5, sigma_next=0.4, **noise_kw)
    with pytest.raises(ValueError, match="sigma_next must be >= 0"):
        sde.step(kind, v=x, x=x, sigma=0.5, sigma_next=-0.1, **noise_kw)


def test_invalid_noise_levels_and_zero_std_raise():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="eta must be >= 0"):
        sde.ddim(x, x, 0.5, 0.7, eta=-0.1)
    with pytest.raises(ValueError, match="eta must be > 0"):
        sde.dance(x, x, 0.5, 0.4, eta=-0.1)
    with pytest.raises(ValueError, match="noise_level must be > 0"):
        sde.flow_sde(x, x, 0.5, 0.4, noise_level=-0.5)
    with pytest.raises(ValueError, match="std must be > 0"):
        sde.ddim(x, x, 0.5, 0.7, eta=0.0)  # deterministic DDIM has no density
    with pytest.raises(ValueError, match="std must be > 0"):
        sde.cps(x, x, 0.5, 0.0, noise_level=0.5)  # final step to a clean sample
    with pytest.raises(ValueError, match="alpha_bar_prev"):
        sde.ddim(x, x, 0.7, 0.5, eta=1.0)
    with pytest.raises(ValueError, match="too large"):
        sde.ddim(x, x, 0.1, 0.9, eta=5.0)
    with pytest.raises(ValueError, match="not both"):
        sde.cps(x, x, 0.5, 0.4, noise_level=0.5, noise=x, prev_sample=x)
    with pytest.raises(ValueError, match="shape"):
        sde.cps(x, x, 0.5, 0.4, noise_level=0.5, noise=torch.zeros(1, 3))


def test_ratio_norm_score_is_grpo_guards_normalised_log_ratio():
    """GRPO-Guard's RatioNorm (verl-omni's GRPOGuardLoss): (log p_new - log p_old + mean((mu_new - mu_old)^2) /
    (2 s^2)) * s with Gaussian log-densities of std s, written out here from that formula, equals the
    difference of two `ratio_norm_score`s; and a hand-worked 1-D case: s = 0.5, mu_old = 0, x' = 0.25 (eps =
    0.5), mu_new = 0.1 gives 0.1 * 0.5 = 0.05."""
    g = torch.Generator().manual_seed(0)
    x_next, mu_old = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    mu_new = mu_old + 0.1 * torch.randn(3, 4, 5, generator=g)
    s = torch.tensor([0.3, 0.05, 1.2]).view(3, 1, 1)

    def gauss(mean):
        lp = -((x_next - mean) ** 2) / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)
        return lp.flatten(1).mean(1)

    bias = (mu_new - mu_old).pow(2).flatten(1).mean(1) / (2 * s.flatten() ** 2)
    expected = (gauss(mu_new) - gauss(mu_old) + bias) * s.flatten()
    got = sde.ratio_norm_score(x_next, mu_new, mu_old, s) - sde.ratio_norm_score(x_next, mu_old, mu_old, s)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    one = sde.ratio_norm_score(
        torch.tensor([[0.25]]), torch.tensor([[0.1]]), torch.tensor([[0.0]]), torch.tensor(0.5)
    )
    assert float(one) == pytest.approx(0.1 * 0.5)
    mean = mu_new.clone().requires_grad_(True)  # the gradient flows through the new mean only
    sde.ratio_norm_score(x_next, mean, mu_old, s).sum().backward()
    torch.testing.assert_close(mean.grad, (x_next - mu_old) / s / 20)
