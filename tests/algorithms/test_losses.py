"""Tests of mmalign.algorithms.losses against independent plain-Python references (nested lists, math)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mmalign.algorithms import losses as L
from mmalign.registry import RegistryError

ALL_LOSSES = {"ppo_clip", "dual_clip", "gspo", "cispo", "sapo"}
ALL_AGGREGATIONS = {"token_mean", "seq_mean_token_mean", "seq_sum_norm"}
ALL_KL = {"k1", "k2", "k3"}


# =========================================================================== plain-Python references
# logp, old: B x T lists of floats; adv: list of B floats or B x T lists; mask: B x T lists of bools.
# Each reference returns (per_token, clipped, ratio, grad), grad[b][t] = d(sum_bt c_bt * loss_bt)/d logp_bt
# for the upstream weights c (hand-derived derivatives, written out per loss).


def clamp(x, lo, hi):
    return max(lo, min(hi, x))


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def adv_at(adv, b, t):
    return adv[b][t] if isinstance(adv[b], list) else adv[b]


def empty(rows, cols, value):
    return [[value] * cols for _ in range(rows)]


def ref_ppo_clip(logp, old, adv, mask, c, eps_low=0.2, eps_high=0.2, dual_c=None):
    B, T = len(logp), len(logp[0])
    loss, clipped, ratio, grad = empty(B, T, 0.0), empty(B, T, False), empty(B, T, 1.0), empty(B, T, 0.0)
    for b in range(B):
        for t in range(T):
            if not mask[b][t]:
                continue
            a = adv_at(adv, b, t)
            rho = math.exp(clamp(logp[b][t] - old[b][t], -20, 20))
            s1, s2 = rho * a, clamp(rho, 1 - eps_low, 1 + eps_high) * a
            value, cut = -min(s1, s2), s2 < s1
            if dual_c is not None and a < 0 and value > -a * dual_c:
                value, cut = -a * dual_c, True
            loss[b][t], clipped[b][t], ratio[b][t] = value, cut, rho
            grad[b][t] = 0.0 if cut else c[b][t] * (-rho * a)  # d(-rho a)/dlogp = -rho a
    return loss, clipped, ratio, grad


def ref_dual_clip(logp, old, adv, mask, c, eps_low=0.2, eps_high=0.2, c_dual=3.0):
    return ref_ppo_clip(logp, old, adv, mask, c, eps_low, eps_high, dual_c=c_dual)


def ref_gspo(logp, old, adv, mask, c, eps_low=3e-4, eps_high=4e-4):
    """s_i = exp(mean of valid log-ratios). Per-sample advantages: ds_i/dlogp_t = s_i / n_i, so every
    unclipped token's -A c feeds every token of the row. Per-token advantages (GSPO-token,
    s_it = sg(s_i) pi_t / sg(pi_t)): ds_it/dlogp_t = s_i and ds_it'/dlogp_t = 0 for t' != t.
    Both forms: a row whose mean log-ratio lies outside the clamp band [-20, 20] has s_i = exp(+-20)
    and no gradient (the clamp's derivative is 0 there)."""
    B, T = len(logp), len(logp[0])
    loss, clipped, ratio, grad = empty(B, T, 0.0), empty(B, T, False), empty(B, T, 1.0), empty(B, T, 0.0)
    for b in range(B):
        valid = [t for t in range(T) if mask[b][t]]
        mean_lr = sum(logp[b][t] - old[b][t] for t in valid) / len(valid) if valid else 0.0
        s = math.exp(clamp(mean_lr, -20, 20))
        ds = s if -20 <= mean_lr <= 20 else 0.0  # d exp(clamp(x))/dx
        for t in range(T):
            ratio[b][t] = s
        row_grad = 0.0  # d(sum_t c_t loss_t)/d s
        for t in valid:
            a = adv_at(adv, b, t)
            s1, s2 = s * a, clamp(s, 1 - eps_low, 1 + eps_high) * a
            loss[b][t], clipped[b][t] = -min(s1, s2), s2 < s1
            if not clipped[b][t]:
                row_grad += c[b][t] * (-a)
        for t in valid:
            if isinstance(adv[b], list):  # GSPO-token
                grad[b][t] = 0.0 if clipped[b][t] else c[b][t] * (-adv[b][t]) * ds
            else:
                grad[b][t] = row_grad * ds / len(valid)
    return loss, clipped, ratio, grad


def ref_cispo(logp, old, adv, mask, c, eps_max=4.0):
    B, T = len(logp), len(logp[0])
    loss, clipped, ratio, grad = empty(B, T, 0.0), empty(B, T, False), empty(B, T, 1.0), empty(B, T, 0.0)
    for b in range(B):
        for t in range(T):
            if not mask[b][t]:
                continue
            a = adv_at(adv, b, t)
            rho = math.exp(clamp(logp[b][t] - old[b][t], -20, 20))
            w = min(rho, eps_max)
            loss[b][t], clipped[b][t], ratio[b][t] = -w * a * logp[b][t], rho > eps_max, rho
            grad[b][t] = c[b][t] * (-w * a)  # the weight is detached: gradient is -sg(w) A
    return loss, clipped, ratio, grad


def ref_sapo(logp, old, adv, mask, c, tau_pos=1.0, tau_neg=1.05):
    B, T = len(logp), len(logp[0])
    loss, clipped, ratio, grad = empty(B, T, 0.0), empty(B, T, False), empty(B, T, 1.0), empty(B, T, 0.0)
    for b in range(B):
        for t in range(T):
            if not mask[b][t]:
                continue
            a = adv_at(adv, b, t)
            rho = math.exp(clamp(logp[b][t] - old[b][t], -20, 20))
            tau = tau_pos if a > 0 else tau_neg
            sg = sigmoid(tau * (rho - 1))
            loss[b][t], ratio[b][t] = -(4 / tau) * sg * a, rho
            # d/dlogp of -(4/tau) sigmoid(tau (rho - 1)) a = -(4/tau) * sg (1 - sg) * tau * rho * a
            grad[b][t] = c[b][t] * (-4 * sg * (1 - sg) * rho * a)
    return loss, clipped, ratio, grad


REFERENCES = {
    "ppo_clip": ref_ppo_clip,
    "dual_clip": lambda *args, c_dual=3.0, **o: ref_dual_clip(*args, c_dual=c_dual, **o),
    "gspo": ref_gspo,
    "cispo": ref_cispo,
    "sapo": ref_sapo,
}
OPTION_SETS = {  # (options for the module, options for the reference)
    "ppo_clip": [({}, {}), ({"eps_low": 0.1, "eps_high": 0.28}, {"eps_low": 0.1, "eps_high": 0.28})],
    "dual_clip": [({}, {}), ({"c": 1.5, "eps_high": 0.3}, {"c_dual": 1.5, "eps_high": 0.3})],
    "gspo": [({}, {}), ({"eps_low": 0.2, "eps_high": 0.3}, {"eps_low": 0.2, "eps_high": 0.3})],
    "cispo": [({}, {}), ({"eps_max": 1.2}, {"eps_max": 1.2})],
    "sapo": [({}, {}), ({"tau_pos": 0.5, "tau_neg": 2.0}, {"tau_pos": 0.5, "tau_neg": 2.0})],
}


def random_inputs(rng: random.Random, per_token_adv: bool):
    B, T = rng.randint(1, 5), rng.randint(1, 6)
    logp = [[-abs(rng.gauss(0, 2)) - 0.01 for _ in range(T)] for _ in range(B)]
    old = [[x + rng.gauss(0, 0.35) for x in row] for row in logp]
    if per_token_adv:
        adv = [[rng.gauss(0, 1.5) for _ in range(T)] for _ in range(B)]
    else:
        adv = [rng.gauss(0, 1.5) for _ in range(B)]
    mask = [[rng.random() < 0.75 for _ in range(T)] for _ in range(B)]
    if B > 1 and rng.random() < 0.4:
        mask[rng.randrange(B)] = [False] * T  # a fully masked row
    c = [[rng.uniform(0.5, 2.0) for _ in range(T)] for _ in range(B)]  # upstream gradient weights
    return logp, old, adv, mask, c


def run_loss(name, logp, old, adv, mask, upstream, **opts):
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    out = L.get(name)(
        lp,
        torch.tensor(old, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        torch.tensor(mask),
        **opts,
    )
    (grad,) = torch.autograd.grad((out.per_token * torch.tensor(upstream, dtype=torch.float64)).sum(), lp)
    return out, grad


def assert_matches(name, got, grad, want):
    w_loss, w_clipped, w_ratio, w_grad = want
    f64 = torch.float64
    torch.testing.assert_close(
        got.per_token.detach(), torch.tensor(w_loss, dtype=f64), rtol=1e-10, atol=1e-12
    )
    assert got.clipped.tolist() == w_clipped, name
    assert got.clipped.dtype == torch.bool
    torch.testing.assert_close(got.ratio.detach(), torch.tensor(w_ratio, dtype=f64), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, torch.tensor(w_grad, dtype=f64), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", sorted(ALL_LOSSES))
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_loss_matches_plain_python_reference(name, per_token_adv):
    rng = random.Random(sorted(ALL_LOSSES).index(name) * 2 + per_token_adv)
    for _ in range(25):
        logp, old, adv, mask, c = random_inputs(rng, per_token_adv)
        for opts, ref_opts in OPTION_SETS[name]:
            got, grad = run_loss(name, logp, old, adv, mask, c, **opts)
            want = REFERENCES[name](logp, old, adv, mask, c, **ref_opts)
            assert_matches(name, got, grad, want)


# Finite differences check autograd against the loss VALUE, which is the right target wherever no
# stop-gradient is involved. CISPO's weight sg(min(rho, eps_max)) is a stop-gradient: perturbing logp
# and logp_old together keeps rho (hence the weight) fixed, so the finite difference is exactly the
# intended gradient -sg(w) A. GSPO-token (per-token advantages) is a stop-gradient construction too;
# its gradient is checked against the hand-derived reference above and the GSPO equivalence below.
FD_CASES = [(name, False) for name in sorted(ALL_LOSSES)] + [
    (name, True) for name in sorted(ALL_LOSSES) if name != "gspo"
]


@pytest.mark.parametrize(("name", "per_token_adv"), FD_CASES)
def test_loss_gradient_matches_finite_differences(name, per_token_adv):
    rng = random.Random(100 + sorted(ALL_LOSSES).index(name))
    h = 1e-6
    move_old = name == "cispo"
    opts = {"eps_low": 0.2, "eps_high": 0.3} if name == "gspo" else {}
    for _ in range(4):
        logp, old, adv, mask, c = random_inputs(rng, per_token_adv)
        _, grad = run_loss(name, logp, old, adv, mask, c, **opts)

        def objective(b, t, delta, logp=logp, old=old, adv=adv, mask=mask, c=c):
            lp = [row[:] for row in logp]
            od = [row[:] for row in old]
            lp[b][t] += delta
            if move_old:
                od[b][t] += delta
            out = L.get(name)(
                torch.tensor(lp, dtype=torch.float64),
                torch.tensor(od, dtype=torch.float64),
                torch.tensor(adv, dtype=torch.float64),
                torch.tensor(mask),
                **opts,
            )
            return (out.per_token * torch.tensor(c, dtype=torch.float64)).sum().item()

        fd = [
            [(objective(b, t, h) - objective(b, t, -h)) / (2 * h) for t in range(len(logp[0]))]
            for b in range(len(logp))
        ]
        torch.testing.assert_close(grad, torch.tensor(fd, dtype=torch.float64), rtol=1e-5, atol=1e-6)


def push_out_of_band(rng: random.Random, logp, old, mask):
    """Shift logp_old of random rows by +-25 or +-60 so their mean log-ratio leaves the clamp band [-20, 20]
    (a stale or corrupted logp_old), keeping other rows in the band."""
    old = [row[:] for row in old]
    for b in range(len(logp)):
        if any(mask[b]) and rng.random() < 0.5:
            shift = rng.choice([25.0, -25.0, 60.0, -60.0])
            old[b] = [x + shift for x in old[b]]
    return old


@pytest.mark.parametrize("per_token_adv", [False, True])
def test_gspo_matches_reference_outside_the_clamp_band(per_token_adv):
    """Rows with a mean log-ratio beyond +-20: value exp(+-20), zero gradient, in both advantage forms."""
    rng = random.Random(17 + per_token_adv)
    seen_out = 0
    for _ in range(25):
        logp, old, adv, mask, c = random_inputs(rng, per_token_adv)
        old = push_out_of_band(rng, logp, old, mask)
        seen_out += sum(
            abs(sum(logp[b][t] - old[b][t] for t in range(len(mask[b])) if mask[b][t])) > 20 * sum(mask[b])
            for b in range(len(logp))
        )
        for opts, ref_opts in OPTION_SETS["gspo"]:
            got, grad = run_loss("gspo", logp, old, adv, mask, c, **opts)
            assert_matches("gspo", got, grad, ref_gspo(logp, old, adv, mask, c, **ref_opts))
    assert seen_out > 5  # the band edge really was crossed


def test_gspo_gradient_is_zero_outside_the_clamp_band_hand_worked():
    """One row, 4 tokens, logp_old = 0, logp = 25, A = -1, seq_mean_token_mean (issue 33 item 11).

    Mean log-ratio 25 > 20, so s = exp(20) = 485165195.4. A = -1: -min(-s, -(1 + 4e-4)) = s per token
    (the unclipped term wins), row mean s, one row: loss = 4.8517e8. The clamp is active, so the
    gradient is 0 for every token, with Float[B] and with the same constant as Float[B, T] advantages.
    Just inside the band (logp = 19): loss exp(19) and gradient -A * s / n = exp(19) / 4 per token.
    """
    mask = torch.ones(1, 4, dtype=torch.bool)
    old = torch.zeros(1, 4, dtype=torch.float64)
    for value, want_loss, want_grad in ((25.0, math.exp(20), 0.0), (19.0, math.exp(19), math.exp(19) / 4)):
        for adv in (torch.tensor([-1.0]), torch.full((1, 4), -1.0)):
            lp = torch.full((1, 4), value, dtype=torch.float64, requires_grad=True)
            out = L.gspo(lp, old, adv.to(torch.float64), mask)
            loss = L.aggregate(out.per_token, mask, "seq_mean_token_mean")
            assert loss.item() == pytest.approx(want_loss, rel=1e-12), (value, adv.shape)
            (g,) = torch.autograd.grad(loss, lp)
            torch.testing.assert_close(
                g, torch.full((1, 4), want_grad, dtype=torch.float64), rtol=1e-12, atol=0
            )


def test_gspo_token_matches_gspo_for_constant_advantages():
    """GSPO-token (per-token advantages) and GSPO agree (loss and gradient) when A is constant per sample,
    also for rows whose mean log-ratio lies outside the clamp band."""
    rng = random.Random(5)
    for i in range(10):
        logp, old, adv, mask, _c = random_inputs(rng, per_token_adv=False)
        if i % 2:
            old = push_out_of_band(rng, logp, old, mask)
        T = len(logp[0])
        for mode in sorted(ALL_AGGREGATIONS):
            results = []
            for a in (adv, [[x] * T for x in adv]):
                lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
                out = L.gspo(
                    lp,
                    torch.tensor(old, dtype=torch.float64),
                    torch.tensor(a, dtype=torch.float64),
                    torch.tensor(mask),
                    eps_low=0.2,
                    eps_high=0.3,
                )
                loss = L.aggregate(out.per_token, torch.tensor(mask), mode)
                results.append((loss.detach(), torch.autograd.grad(loss, lp)[0]))
            torch.testing.assert_close(results[0][0], results[1][0])
            torch.testing.assert_close(results[0][1], results[1][1])


# =========================================================================== hand-worked numbers


def one_token(name, ratio, a, logp=-1.0, **opts):
    """One action: logp, logp_old = logp - ln(ratio), advantage a -> (loss, clipped, dloss/dlogp)."""
    lp = torch.tensor([[logp]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[logp - math.log(ratio)]], dtype=torch.float64)
    out = L.get(name)(lp, old, torch.tensor([a], dtype=torch.float64), torch.tensor([[True]]), **opts)
    (g,) = torch.autograd.grad(out.per_token.sum(), lp)
    return out.per_token.item(), bool(out.clipped.item()), g.item()


def test_ppo_clip_hand_worked_values_and_gradients():
    # rho 1.5, A = 1: -min(1.5, 1.2) = -1.2; clipped -> gradient 0
    assert one_token("ppo_clip", 1.5, 1.0) == pytest.approx((-1.2, True, 0.0))
    # rho 1.1, A = 1: inside the band: loss -1.1, d(-rho A)/dlogp = -rho A = -1.1
    assert one_token("ppo_clip", 1.1, 1.0) == pytest.approx((-1.1, False, -1.1))
    # rho 0.5, A = 1: -min(0.5, 0.8) = -0.5, unclipped (the min picks rho A): gradient -0.5
    assert one_token("ppo_clip", 0.5, 1.0) == pytest.approx((-0.5, False, -0.5))
    # rho 0.5, A = -1: -min(-0.5, -0.8) = 0.8, clipped -> gradient 0
    assert one_token("ppo_clip", 0.5, -1.0) == pytest.approx((0.8, True, 0.0))
    # rho 1.5, A = -1: -min(-1.5, -1.2) = 1.5, unclipped: gradient -rho A = 1.5
    assert one_token("ppo_clip", 1.5, -1.0) == pytest.approx((1.5, False, 1.5))
    # clip-higher: eps_high 0.28 keeps rho 1.25 unclipped for A > 0: loss -1.25, gradient -1.25
    assert one_token("ppo_clip", 1.25, 1.0, eps_high=0.28) == pytest.approx((-1.25, False, -1.25))


def test_dual_clip_hand_worked():
    # rho 5, A = -1, c = 3: min(max(5, 1.2), 3) = 3, capped -> gradient 0
    assert one_token("dual_clip", 5.0, -1.0) == pytest.approx((3.0, True, 0.0))
    # rho 2, A = -1: max(2, 1.2) = 2 < 3: loss 2, gradient -rho A = 2
    assert one_token("dual_clip", 2.0, -1.0) == pytest.approx((2.0, False, 2.0))
    # A > 0 is plain PPO: rho 5, A = 1 -> -1.2, clipped
    assert one_token("dual_clip", 5.0, 1.0) == pytest.approx((-1.2, True, 0.0))


def test_gspo_hand_worked():
    # one sample, log-ratios [0.1, 0.3] (+ one masked token): s = exp(0.2) = 1.221403
    lp = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.1, -2.3, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    # A = -1: -min(-1.221403, -(1 + 4e-4)) = 1.221403 per valid token, unclipped;
    # d(sum_t loss_t)/dlogp_t = sum_t' (-A) ds/dlogp_t = 2 * s / 2 = 1.221403 for each valid token
    out = L.gspo(lp, old, torch.tensor([-1.0], dtype=torch.float64), mask)
    want = torch.tensor([[1.221403, 1.221403, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(out.per_token.detach(), want, atol=1e-6, rtol=0)
    assert out.clipped.tolist() == [[False, False, False]]
    (g,) = torch.autograd.grad(out.per_token.sum(), lp)
    torch.testing.assert_close(g, want, atol=1e-6, rtol=0)
    # A = +1: s > 1 + 4e-4, clipped: loss -(1.0004) per token, gradient 0
    out = L.gspo(lp, old, torch.tensor([1.0], dtype=torch.float64), mask)
    torch.testing.assert_close(
        out.per_token.detach(), torch.tensor([[-1.0004, -1.0004, 0.0]], dtype=torch.float64)
    )
    assert out.clipped.tolist() == [[True, True, False]]
    (g,) = torch.autograd.grad(out.per_token.sum(), lp)
    assert g.abs().sum() == 0


def test_cispo_hand_worked():
    # rho 5 > eps_max 4: w = 4; A = 2, logp = -1: loss = -4 * 2 * (-1) = 8; gradient -sg(w) A = -8
    assert one_token("cispo", 5.0, 2.0, logp=-1.0) == pytest.approx((8.0, True, -8.0))
    # rho 0.5: w = 0.5 (no lower bound); A = 2: gradient -1; loss -0.5 * 2 * (-3) = 3
    assert one_token("cispo", 0.5, 2.0, logp=-3.0) == pytest.approx((3.0, False, -1.0))
    # unlike PPO, a "clipped" token still has a gradient (PPO would give 0 here)
    assert one_token("cispo", 5.0, 1.0)[2] == pytest.approx(-4.0)
    assert one_token("ppo_clip", 5.0, 1.0)[2] == 0.0


def test_sapo_hand_worked():
    # rho 1: sigmoid(0) = 0.5 -> A = 1 (tau 1): loss -(4/1) 0.5 = -2, gradient -4 * .25 * 1 * 1 = -1
    assert one_token("sapo", 1.0, 1.0) == pytest.approx((-2.0, False, -1.0))
    # A = -1 (tau 1.05): loss (4/1.05) 0.5 = 1.904762, gradient +1 (= -A, like the unclipped PG)
    assert one_token("sapo", 1.0, -1.0) == pytest.approx((1.904762, False, 1.0), abs=1e-6)
    # rho 2, A = 1: sigmoid(1) = 0.731059: loss -2.924234; gradient -4 * .731059 * .268941 * 2 = -1.572895
    assert one_token("sapo", 2.0, 1.0) == pytest.approx((-2.924234, False, -1.572895), abs=1e-6)


# =========================================================================== aggregation


def ref_aggregate(per_token, mask, mode, num_tokens=None, num_seqs=None, max_len=None):
    B, T = len(per_token), len(per_token[0])
    total = sum(per_token[b][t] for b in range(B) for t in range(T) if mask[b][t])
    if mode == "token_mean":
        n = sum(mask[b][t] for b in range(B) for t in range(T)) if num_tokens is None else num_tokens
        return total / n if n > 0 else 0.0
    if mode == "seq_mean_token_mean":
        acc = 0.0
        for b in range(B):
            n = sum(mask[b])
            if n:
                acc += sum(per_token[b][t] for t in range(T) if mask[b][t]) / n
        return acc / (B if num_seqs is None else num_seqs)
    if mode == "seq_sum_norm":
        return total / ((B if num_seqs is None else num_seqs) * (T if max_len is None else max_len))
    raise AssertionError(mode)


@pytest.mark.parametrize("mode", sorted(ALL_AGGREGATIONS))
def test_aggregation_matches_reference(mode):
    rng = random.Random(sorted(ALL_AGGREGATIONS).index(mode))
    for _ in range(30):
        B, T = rng.randint(1, 5), rng.randint(1, 6)
        per_token = [[rng.gauss(0, 1) for _ in range(T)] for _ in range(B)]
        mask = [[rng.random() < 0.7 for _ in range(T)] for _ in range(B)]
        if rng.random() < 0.3:
            mask[0] = [False] * T
        x = torch.tensor(per_token, dtype=torch.float64)
        m = torch.tensor(mask)
        got = L.aggregate(x, m, mode)
        assert got.dim() == 0
        assert got.item() == pytest.approx(ref_aggregate(per_token, mask, mode), rel=1e-12, abs=1e-12)
        overrides = {"num_tokens": 17, "num_seqs": 9, "max_len": 11}
        got = L.aggregate(x, m, mode, **overrides)
        assert got.item() == pytest.approx(
            ref_aggregate(per_token, mask, mode, **overrides), rel=1e-12, abs=1e-12
        )


def test_aggregation_hand_worked():
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, 99.0, 99.0]])
    m = torch.tensor([[True, True, False], [True, False, False]])
    assert L.aggregate(x, m, "token_mean").item() == pytest.approx(2.0)  # (1 + 2 + 3) / 3
    assert L.aggregate(x, m, "seq_mean_token_mean").item() == pytest.approx(2.25)  # (1.5 + 3) / 2
    assert L.aggregate(x, m, "seq_sum_norm").item() == pytest.approx(1.0)  # 6 / (2 * 3)


def test_global_counts_make_minibatches_add_up():
    """Summing per-minibatch losses normalised by global counts equals the full-batch loss."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    m = torch.rand(6, 5, generator=gen) < 0.6
    m[2] = False
    for mode in ALL_AGGREGATIONS:
        full = L.aggregate(x, m, mode)
        parts = sum(
            L.aggregate(x[s], m[s], mode, num_tokens=m.sum(), num_seqs=6, max_len=5)
            for s in (slice(0, 2), slice(2, 3), slice(3, 6))
        )
        torch.testing.assert_close(parts, full)


def test_lengths_let_column_chunks_add_up_to_the_whole_rows():
    """A row's actions aggregated in column chunks (the trainer's `Policy.action_chunks`) with the whole rows'
    counts (`lengths`, num_tokens, num_seqs, max_len) add up to the whole; hand-worked for seq_mean_token_mean:
    row 0 = (1 + 2) / 2, row 1 = 3 / 1, mean 2.25 = chunk [0] ((1 / 2 + 3 / 1) / 2) + chunk [1, 2] ((2 / 2) / 2)."""
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, 99.0, 99.0]])
    m = torch.tensor([[True, True, False], [True, False, False]])
    lengths = m.sum(1)
    first = L.aggregate(x[:, :1], m[:, :1], "seq_mean_token_mean", lengths=lengths)
    rest = L.aggregate(x[:, 1:], m[:, 1:], "seq_mean_token_mean", lengths=lengths)
    assert first.item() == pytest.approx(1.75) and rest.item() == pytest.approx(0.5)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    m = torch.rand(6, 5, generator=gen) < 0.6
    m[2] = False
    for mode in ALL_AGGREGATIONS:
        full = L.aggregate(x, m, mode)
        chunks = [[0], [1, 2], [3, 4]]
        parts = sum(
            L.aggregate(x[:, c], m[:, c], mode, num_tokens=m.sum(), num_seqs=6, max_len=5, lengths=m.sum(1))
            for c in chunks
        )
        torch.testing.assert_close(parts, full)
        if mode == "seq_mean_token_mean":  # without the whole rows' counts the chunks do not add up
            wrong = sum(L.aggregate(x[:, c], m[:, c], mode, num_seqs=6) for c in chunks)
            assert not torch.allclose(wrong, full)


def test_gspo_couples_a_samples_actions():
    assert L.couples_actions("gspo")
    assert not any(L.couples_actions(n) for n in ("ppo_clip", "dual_clip", "cispo", "sapo"))


def test_aggregation_of_empty_mask_is_zero_not_nan():
    x = torch.full((2, 3), float("nan"))
    m = torch.zeros(2, 3, dtype=torch.bool)
    for mode in ALL_AGGREGATIONS:
        assert L.aggregate(x, m, mode).item() == 0.0
    assert (
        L.aggregate(torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool), "token_mean", num_tokens=0).item()
        == 0.0
    )


# =========================================================================== KL and diagnostics


def ref_kl(lp, ref, estimator):
    d = lp - ref
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    x = clamp(ref - lp, -20, 20)
    return math.exp(x) - x - 1


@pytest.mark.parametrize("estimator", sorted(ALL_KL))
def test_kl_matches_reference(estimator):
    rng = random.Random(sorted(ALL_KL).index(estimator))
    lp = [[-abs(rng.gauss(0, 2)) for _ in range(4)] for _ in range(3)]
    ref = [[x + rng.gauss(0, 0.5) for x in row] for row in lp]
    lp[0][0], ref[0][0] = -1.0, -40.0  # log-ratio beyond the +-20 clamp
    got = L.kl(torch.tensor(lp, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64), estimator)
    want = [
        [ref_kl(a, b, estimator) for a, b in zip(r1, r2, strict=True)] for r1, r2 in zip(lp, ref, strict=True)
    ]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_kl_hand_worked_and_mask():
    lp, ref = torch.tensor([[-1.0]]), torch.tensor([[-2.0]])
    assert L.kl(lp, ref, "k1").item() == pytest.approx(1.0)
    assert L.kl(lp, ref, "k2").item() == pytest.approx(0.5)
    assert L.kl(lp, ref).item() == pytest.approx(math.exp(-1.0))  # k3: e^-1 - (-1) - 1 = 0.367879
    # masked positions are 0 even with -inf padding, and the gradient stays finite
    lp = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    out = L.kl(lp, torch.tensor([[-2.0, -3.0]]), "k3", mask=torch.tensor([[True, False]]))
    assert out[0, 1].item() == 0.0
    (g,) = torch.autograd.grad(out.sum(), lp)
    assert torch.isfinite(g).all()
    with pytest.raises(RegistryError):
        L.kl(lp, lp, "k4")


def test_approx_kl_and_masked_mean():
    lp = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, 0.0, 0.0]])
    old = torch.tensor([[-1.5, -1.0, -1.0], [-0.5, 0.0, 0.0]])
    m = torch.tensor([[True, True, False], [True, False, False]])
    # deltas [0.5, -1.0, 0.0] on valid actions: 1/2 * (0.25 + 1 + 0) / 3 = 0.208333
    assert L.approx_kl(lp, old, m).item() == pytest.approx(0.2083333, abs=1e-6)
    assert L.masked_mean(lp, m).item() == pytest.approx((-1.0 - 2.0 - 0.5) / 3)
    assert L.masked_mean(lp, torch.zeros_like(m)).item() == 0.0
    # plain-Python reference on random inputs
    rng = random.Random(9)
    for _ in range(10):
        B, T = rng.randint(1, 4), rng.randint(1, 5)
        a = [[rng.gauss(0, 1) for _ in range(T)] for _ in range(B)]
        b = [[rng.gauss(0, 1) for _ in range(T)] for _ in range(B)]
        mk = [[rng.random() < 0.6 for _ in range(T)] for _ in range(B)]
        sel = [(i, j) for i in range(B) for j in range(T) if mk[i][j]]
        want = 0.5 * sum((a[i][j] - b[i][j]) ** 2 for i, j in sel) / len(sel) if sel else 0.0
        got = L.approx_kl(
            torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64), torch.tensor(mk)
        )
        assert got.item() == pytest.approx(want, rel=1e-12, abs=1e-12)


# =========================================================================== API, errors, robustness


def test_registry_names():
    assert set(L.names()) == ALL_LOSSES | {
        "d3s",
        "etr",
        "hapo",
        "reg_grpo",
        "target_entropy",
    }  # the seed-paper losses (tests/algorithms/test_losses_seed_papers.py, test_seed_losses.py)
    assert set(L.aggregation_names()) == ALL_AGGREGATIONS
    assert set(L.kl_names()) == ALL_KL
    for name in L.names():
        assert L.describe(name)


def test_unknown_names():
    with pytest.raises(RegistryError, match="ppo_clipp"):
        L.get("ppo_clipp")
    with pytest.raises(KeyError):
        L.aggregate(torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), "token_sum")


@pytest.mark.parametrize("name", sorted(ALL_LOSSES))
def test_unknown_option_raises_type_error(name):
    z = torch.zeros(1, 2)
    with pytest.raises(TypeError, match=rf"{name}.*clip_eps"):
        L.get(name)(z, z, torch.zeros(1), torch.ones(1, 2, dtype=torch.bool), clip_eps=0.2)


def test_bad_values_and_shapes():
    z, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError):
        L.ppo_clip(z, z, torch.zeros(2), m, eps_low=1.5)
    with pytest.raises(ValueError):
        L.dual_clip(z, z, torch.zeros(2), m, c=0.5)
    with pytest.raises(ValueError):
        L.ppo_clip(z, z, torch.zeros(3), m)
    with pytest.raises(ValueError):
        L.ppo_clip(z, torch.zeros(2, 4), torch.zeros(2), m)
    assert L.options("gspo") == {"eps_low": 3e-4, "eps_high": 4e-4}
    assert L.options("cispo") == {"eps_max": 4.0}


@pytest.mark.parametrize("name", sorted(ALL_LOSSES))
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_fully_masked_rows_and_padding_never_nan(name, per_token_adv):
    logp = torch.tensor(
        [[-1.0, float("-inf"), float("nan")], [float("nan"), float("-inf"), -3.0]], requires_grad=True
    )
    old = torch.tensor([[-1.2, float("nan"), -1.0], [-1.0, float("inf"), -1.0]])
    mask = torch.tensor([[True, False, False], [False, False, False]])
    adv = (
        torch.tensor([[1.0, float("nan"), 2.0], [-1.0, 0.0, 1.0]])
        if per_token_adv
        else torch.tensor([1.0, -1.0])
    )
    out = L.get(name)(logp, old, adv, mask)
    assert torch.isfinite(out.per_token).all() and torch.isfinite(out.ratio).all()
    assert out.per_token[~mask].abs().sum() == 0 and not out.clipped[~mask].any()
    (g,) = torch.autograd.grad(out.per_token.sum(), logp)
    assert torch.isfinite(g).all() and g[~mask].abs().sum() == 0
    for mode in ALL_AGGREGATIONS:
        assert torch.isfinite(L.aggregate(out.per_token, mask, mode))


@pytest.mark.parametrize("name", sorted(ALL_LOSSES))
def test_extreme_log_ratio_is_clamped(name):
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-500.0, -1.0]])  # log-ratio 500 -> clamped to 20 before exp
    out = L.get(name)(logp, old, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool))
    assert torch.isfinite(out.per_token).all() and out.ratio.max().item() <= math.exp(20) * (1 + 1e-6)
    (g,) = torch.autograd.grad(out.per_token.sum(), logp)
    assert torch.isfinite(g).all()


def test_logp_old_gets_no_gradient_and_advantages_detached():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.1]], requires_grad=True)
    a = torch.tensor([0.5], requires_grad=True)
    out = L.ppo_clip(lp, old, a, torch.ones(1, 2, dtype=torch.bool))
    out.per_token.sum().backward()
    assert lp.grad is not None and old.grad is None and a.grad is None
