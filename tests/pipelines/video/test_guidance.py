"""pipelines.video.guidance (Euphonium process-reward guidance) against independent references: hand-computed
numbers, plain loops, analytic gradients and ``mmalign.algorithms.sde.flow_sde`` itself."""

from __future__ import annotations

import math

import pytest
import torch

from mmalign.algorithms import sde
from pipelines.video.guidance import (
    autograd_gradient,
    drift_distillation_loss,
    flow_sde_velocity_for_mean,
    guidance_scale,
    guided_mean,
    guided_velocity,
    normalized_direction,
    spsa_gradient,
)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


# ---------------------------------------------------------------------------------- normalized_direction


def test_normalized_direction_hand_values_and_degenerate_samples():
    grad = torch.tensor([[3.0, 4.0], [0.0, -2.0], [0.0, 0.0], [float("nan"), 1.0], [float("inf"), 1.0]])
    d = normalized_direction(grad)
    expected = torch.tensor([[0.6, 0.8], [0.0, -1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    assert torch.allclose(d, expected, atol=1e-7)
    assert torch.isfinite(d).all()


def test_normalized_direction_norm_over_all_non_batch_dims():
    g = torch.randn(3, 2, 4, 5, generator=torch.Generator().manual_seed(0))
    d = normalized_direction(g)
    norms = torch.sqrt((d**2).sum(dim=(1, 2, 3)))
    assert torch.allclose(norms, torch.ones(3), atol=1e-6)
    # same direction as g, sample by sample
    for b in range(3):
        assert _cos(d[b], g[b]) == pytest.approx(1.0, abs=1e-6)


# ------------------------------------------------------------------------------------- guidance_scale


def test_guidance_scale_kl_form_hand_value_and_fixed():
    std = torch.tensor([0.3, 0.2]).view(2, 1, 1)
    s = guidance_scale(std, beta=0.5)
    assert s.shape == (2, 1, 1)
    assert torch.allclose(s.flatten(), torch.tensor([0.09, 0.04]), atol=1e-7)  # 0.3^2/(2*0.5), 0.2^2/1
    assert float(guidance_scale(0.4, beta=2.0)) == pytest.approx(0.16 / 4.0)
    fixed = guidance_scale(std, scale=0.25)
    assert fixed.ndim == 0 and float(fixed) == 0.25


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({}, "exactly one"),
        ({"scale": 0.1, "beta": 1.0}, "exactly one"),
        ({"beta": 0.0}, "beta"),
        ({"beta": -1.0}, "beta"),
        ({"scale": -0.1}, "scale"),
    ],
)
def test_guidance_scale_errors(kwargs, word):
    with pytest.raises(ValueError, match=word):
        guidance_scale(torch.tensor(0.3), **kwargs)


# ---------------------------------------------------------------------------------------- guided_mean


def test_guided_mean_moves_by_s_along_unit_direction_hand_checked():
    mean = torch.tensor([[1.0, 1.0], [2.0, -1.0]])
    grad = torch.tensor([[3.0, 4.0], [0.0, -2.0]])
    s = torch.tensor([2.0, 0.5])
    out = guided_mean(mean, grad, s)
    expected = torch.tensor([[1.0 + 2.0 * 0.6, 1.0 + 2.0 * 0.8], [2.0, -1.0 - 0.5]])
    assert torch.allclose(out, expected, atol=1e-6)
    assert torch.allclose((out - mean).norm(dim=1), s, atol=1e-6)


def test_guided_mean_step_norm_equals_s_per_sample_on_latents():
    gen = torch.Generator().manual_seed(1)
    mean, grad = torch.randn(3, 2, 4, 4, generator=gen), torch.randn(3, 2, 4, 4, generator=gen)
    s = torch.tensor([0.1, 0.7, 1.3]).view(3, 1, 1, 1)
    diff = guided_mean(mean, grad, s) - mean
    assert torch.allclose(diff.flatten(1).norm(dim=1), s.flatten(), atol=1e-5)
    for b in range(3):
        assert _cos(diff[b], grad[b]) == pytest.approx(1.0, abs=1e-5)


def test_guided_mean_zero_scale_and_zero_gradient_are_exact_identity():
    mean = torch.randn(2, 3, generator=torch.Generator().manual_seed(2))
    grad = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    assert torch.equal(guided_mean(mean, grad, 0.0), mean)
    assert torch.equal(guided_mean(mean, grad, torch.tensor(0.0)), mean)
    mixed = guided_mean(mean, grad, torch.tensor([0.0, 1.0]))
    assert torch.equal(mixed[0], mean[0])  # s = 0 for sample 0
    assert torch.equal(mixed[1], mean[1])  # zero gradient for sample 1


def test_guided_mean_scale_zero_leaves_flow_sde_step_bit_exact():
    gen = torch.Generator().manual_seed(3)
    v, x = torch.randn(2, 3, 4, 4, generator=gen), torch.randn(2, 3, 4, 4, generator=gen)
    grad = torch.randn(2, 3, 4, 4, generator=gen)
    kw = dict(noise_level=0.7, sigma_max_fallback=0.9)
    sigma, sigma_next = torch.tensor([1.0, 0.6]), torch.tensor([0.9, 0.45])
    for s in (0.0, torch.tensor(0.0), torch.zeros(2)):

        def shift(m, _std, s=s):
            return guided_mean(m, grad, s)

        plain = sde.flow_sde(v, x, sigma, sigma_next, generator=torch.Generator().manual_seed(7), **kw)
        guided = sde.flow_sde(
            v, x, sigma, sigma_next, generator=torch.Generator().manual_seed(7), shift_mean=shift, **kw
        )
        for name in ("sample", "log_prob", "mean", "std"):
            assert torch.equal(getattr(plain, name), getattr(guided, name)), name
        rescored = sde.flow_sde(v, x, sigma, sigma_next, prev_sample=plain.sample, shift_mean=shift, **kw)
        assert torch.equal(rescored.log_prob, plain.log_prob)
        assert torch.equal(rescored.mean, plain.mean)


def test_guided_mean_in_flow_sde_shifts_mean_and_log_prob_uses_it():
    gen = torch.Generator().manual_seed(4)
    v, x, grad = (torch.randn(2, 5, generator=gen) for _ in range(3))
    kw = dict(noise_level=0.5)
    scale = 0.3
    plain = sde.flow_sde(v, x, 0.7, 0.5, noise=torch.zeros(2, 5), **kw)
    guided = sde.flow_sde(
        v, x, 0.7, 0.5, noise=torch.zeros(2, 5), shift_mean=lambda m, std: guided_mean(m, grad, scale), **kw
    )
    unit = grad / grad.norm(dim=1, keepdim=True)
    assert torch.allclose(guided.mean, plain.mean + scale * unit, atol=1e-6)
    # zero noise: the sample is the guided mean itself; its log-prob is the peak of N(mu', std^2)
    assert torch.allclose(guided.sample, guided.mean)
    peak = -torch.log(plain.std) - 0.5 * math.log(2 * math.pi)
    assert torch.allclose(guided.log_prob, peak.expand(2), atol=1e-6)


# ------------------------------------------------------------------------------------------ spsa_gradient


def test_spsa_quadratic_cosine_with_true_gradient():
    gen = torch.Generator().manual_seed(5)
    x, t = torch.randn(2, 3, 2, generator=gen), torch.randn(2, 3, 2, generator=gen)

    def f(z):  # per-sample target: row r is a perturbation of sample r % B (documented)
        return -((z - t.repeat(z.shape[0] // 2, 1, 1)) ** 2).flatten(1).sum(1)

    g = spsa_gradient(f, x, num_samples=256, generator=torch.Generator().manual_seed(0))
    true = -2 * (x - t)
    assert g.shape == x.shape
    for b in range(2):
        assert _cos(g[b], true[b]) > 0.9


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_spsa_linear_reward_recovers_gradient(distribution):
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]])

    def f(z):
        return (z * w.repeat(z.shape[0] // 2, 1)).sum(1)

    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(6))
    g = spsa_gradient(
        f, x, num_samples=8192, generator=torch.Generator().manual_seed(1), distribution=distribution
    )
    # off-diagonal noise per entry ~ ||w|| / sqrt(K) ~ 0.035
    assert torch.allclose(g, w, atol=0.15)


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_spsa_matches_plain_loop_with_same_draws(distribution):
    x = torch.randn(2, 2, 3, generator=torch.Generator().manual_seed(8))
    c, k = 0.01, 3

    def f(z):
        return torch.sin(z).flatten(1).sum(1) + (z**3).flatten(1).mean(1)

    got = spsa_gradient(
        f, x, c=c, num_samples=k, generator=torch.Generator().manual_seed(9), distribution=distribution
    )
    # independent loop: the documented draw order (one (K, *x.shape) tensor), one sample at a time
    gen = torch.Generator().manual_seed(9)
    if distribution == "rademacher":
        u = torch.randint(0, 2, (k, *x.shape), generator=gen).float() * 2 - 1
    else:
        u = torch.randn((k, *x.shape), generator=gen)
    expected = torch.zeros_like(x)
    for j in range(k):
        for b in range(x.shape[0]):
            plus = f((x[b] + c * u[j, b]).unsqueeze(0))[0]
            minus = f((x[b] - c * u[j, b]).unsqueeze(0))[0]
            expected[b] += (plus - minus) / (2 * c) * u[j, b] / k
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_spsa_one_batched_call_chunking_and_no_grad():
    calls = []
    gen = torch.Generator().manual_seed(10)
    t = torch.randn(3, 4, generator=gen)

    def f(z):
        calls.append(z.shape[0])
        assert not torch.is_grad_enabled()
        return -((z - t.repeat(z.shape[0] // 3, 1)) ** 2).sum(1)

    x = torch.randn(3, 4, generator=gen, requires_grad=True)
    g1 = spsa_gradient(f, x, num_samples=4, generator=torch.Generator().manual_seed(2))
    assert calls == [2 * 4 * 3]  # one call with all 2 K B perturbations
    assert not g1.requires_grad
    calls.clear()
    # batch_size 7 -> chunks of 2 whole copies of the batch (6 rows), so row r is still sample r % B
    g2 = spsa_gradient(f, x, num_samples=4, generator=torch.Generator().manual_seed(2), batch_size=7)
    assert calls == [6, 6, 6, 6]
    assert torch.allclose(g1, g2)
    calls.clear()
    g3 = spsa_gradient(f, x, num_samples=4, generator=torch.Generator().manual_seed(2), batch_size=1)
    assert calls == [3] * 8
    assert torch.allclose(g1, g3)


@pytest.mark.parametrize(
    "kwargs, word",
    [({"c": 0.0}, "c"), ({"num_samples": 0}, "num_samples"), ({"distribution": "uniform"}, "distribution")],
)
def test_spsa_validation(kwargs, word):
    with pytest.raises(ValueError, match=word):
        spsa_gradient(lambda z: z.sum(1), torch.zeros(2, 3), **kwargs)


def test_spsa_rejects_reward_with_wrong_shape():
    with pytest.raises(ValueError, match="one score per sample"):
        spsa_gradient(lambda z: z, torch.zeros(2, 3))


# -------------------------------------------------------------------------------------- autograd_gradient


def test_autograd_gradient_analytic_and_under_no_grad():
    gen = torch.Generator().manual_seed(11)
    x, t = torch.randn(2, 3, 2, generator=gen), torch.randn(2, 3, 2, generator=gen)
    lin = torch.nn.Linear(2, 1)

    def f(z):
        return -((z - t) ** 2).flatten(1).sum(1) + 0 * lin(z).flatten(1).sum(1)

    with torch.no_grad():
        g = autograd_gradient(f, x)
    assert torch.allclose(g, -2 * (x - t), atol=1e-6)
    assert not g.requires_grad
    assert lin.weight.grad is None  # no parameter .grad touched
    assert autograd_gradient(lambda z: torch.ones(z.shape[0]), x).abs().sum() == 0


# ---------------------------------------------------------------------------------- velocity for a mean


def _ref_flow_mean(v, x, s, sn, a, fallback=None):
    """Plain-float flow_sde mean (docs/algorithms.md)."""
    std_t = a * math.sqrt(s / (1 - (fallback if s == 1 else s)))
    dt = sn - s
    return x + (v + std_t**2 / (2 * s) * (x + (1 - s) * v)) * dt


def test_velocity_for_mean_reproduces_target_through_flow_sde():
    gen = torch.Generator().manual_seed(12)
    x, target = torch.randn(3, 2, 4, 4, generator=gen), torch.randn(3, 2, 4, 4, generator=gen)
    sigma, sigma_next = torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.9, 0.45, 0.0])
    kw = dict(noise_level=0.7, sigma_max_fallback=0.9)
    v_star = flow_sde_velocity_for_mean(target, x, sigma, sigma_next, **kw)
    out = sde.flow_sde(v_star, x, sigma, sigma_next, noise=torch.zeros_like(x), **kw)
    assert torch.allclose(out.mean, target, atol=1e-5, rtol=1e-5)
    # one element against the plain-float formula (sigma == 1, fallback row)
    ref = _ref_flow_mean(float(v_star[0, 0, 0, 0]), float(x[0, 0, 0, 0]), 1.0, 0.9, 0.7, fallback=0.9)
    assert ref == pytest.approx(float(target[0, 0, 0, 0]), abs=1e-5)


def test_velocity_for_mean_needs_fallback_at_sigma_one():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="sigma_max_fallback"):
        flow_sde_velocity_for_mean(x, x, torch.tensor([1.0, 0.5]), torch.tensor([0.8, 0.3]), noise_level=0.7)


def test_guided_velocity_gives_mean_plus_shift():
    gen = torch.Generator().manual_seed(13)
    v, x, grad = (torch.randn(2, 3, 4, generator=gen) for _ in range(3))
    sigma, sigma_next = torch.tensor([1.0, 0.5]), torch.tensor([0.8, 0.3])
    kw = dict(noise_level=0.9, sigma_max_fallback=0.8)
    plain = sde.flow_sde(v, x, sigma, sigma_next, noise=torch.zeros_like(x), **kw)
    shift = guided_mean(plain.mean, grad, torch.tensor([0.2, 0.4])) - plain.mean
    v_g = guided_velocity(v, x, sigma, sigma_next, shift, **kw)
    moved = sde.flow_sde(v_g, x, sigma, sigma_next, noise=torch.zeros_like(x), **kw)
    assert torch.allclose(moved.mean, plain.mean + shift, atol=1e-5)
    v_star = flow_sde_velocity_for_mean(plain.mean + shift, x, sigma, sigma_next, **kw)
    assert torch.allclose(v_g, v_star, atol=1e-4)
    # hand check of the velocity correction on one element: shift / ((1 + k (1 - sigma)) dt), sigma = 0.5
    k = (0.9**2 * 0.5 / 0.5) / (2 * 0.5)
    corr = float(shift[1, 0, 0]) / ((1 + k * 0.5) * (0.3 - 0.5))
    assert float(v_g[1, 0, 0] - v[1, 0, 0]) == pytest.approx(corr, rel=1e-4, abs=1e-6)


# -------------------------------------------------------------------------------- distillation loss


def test_drift_distillation_loss_hand_values_and_detached_target():
    v_pred = torch.tensor([[1.0, 2.0], [3.0, 5.0], [0.0, 1.0]], requires_grad=True)
    v_target = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]], requires_grad=True)
    # per sample: (1 + 4) / 2 = 2.5, (9 + 25) / 2 = 17, 1 / 2 = 0.5
    assert drift_distillation_loss(v_pred, v_target).item() == pytest.approx(20.0 / 3)
    loss = drift_distillation_loss(v_pred, v_target, weight=torch.tensor([1.0, 0.0, 3.0]))
    assert loss.item() == pytest.approx((2.5 + 3 * 0.5) / 4.0)
    loss.backward()
    assert v_target.grad is None
    # d/dv_pred = w_b / sum(w) * 2 (v_pred - v_target) / D, D = 2
    expected = torch.tensor([[0.25, 0.5], [0.0, 0.0], [0.0, 0.75]])
    assert torch.allclose(v_pred.grad, expected)


def test_drift_distillation_loss_all_zero_weight_is_zero_and_attached():
    v_pred = torch.ones(2, 3, requires_grad=True)
    loss = drift_distillation_loss(v_pred, torch.zeros(2, 3), weight=torch.zeros(2))
    assert loss.item() == 0.0 and loss.requires_grad
