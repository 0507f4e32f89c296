"""Tests of the seed-paper losses of mmalign.algorithms.losses (ETR, Reg-GRPO, the D³S token mask) against plain-loop references."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mmalign.algorithms import losses as L
from mmalign.algorithms import losses as X


def random_inputs(seed: int, b: int = 4, t: int = 5, token_adv: bool = False):
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(b, t, generator=g, dtype=torch.float64) * 0.5 - 1.0).requires_grad_(True)
    logp_old = logp.detach() + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    mask = torch.rand(b, t, generator=g) < 0.8
    mask[0, 0] = True
    mask[-1] = False  # a row without valid actions
    adv = (
        torch.randn(b, t, generator=g, dtype=torch.float64)
        if token_adv
        else torch.randn(b, generator=g, dtype=torch.float64)
    )
    return logp, logp_old, adv, mask


def test_registered_in_the_losses_registry():
    assert {"etr", "reg_grpo"} <= set(L.names())
    assert L.options("etr") == {
        "eps_low": 0.2,
        "eps_high": 0.2,
        "micro_scale": 0.5,
        "macro_scale": 0.5,
        "std_ref": 0.5,
        "group_std": None,
    }
    assert L.options("reg_grpo") == {"beta": 5.0}
    assert L.describe("etr") and L.describe("reg_grpo")


# ---------------------------------------------------------------------------- ETR
def ref_etr(logp, logp_old, adv, mask, group_std, eps_low, eps_high, micro, macro, std_ref):
    b, t = len(logp), len(logp[0])
    per, clip = [[0.0] * t for _ in range(b)], [[False] * t for _ in range(b)]
    for i in range(b):
        valid = [j for j in range(t) if mask[i][j]]
        a_row = adv[i] if isinstance(adv[i], list) else [adv[i]] * t
        mean_abs = sum(abs(a_row[j]) for j in valid) / len(valid) if valid else 0.0
        m = 1 + micro * math.tanh(mean_abs)
        big_m = 1 + macro * (2 * min(group_std[i] / std_ref, 1.0) - 1) if macro > 0 else 1.0
        lo, hi = 1 - eps_low * m * big_m, 1 + eps_high * m * big_m
        for j in valid:
            rho = math.exp(logp[i][j] - logp_old[i][j])
            a = a_row[j]
            unclipped, clipped = rho * a, min(max(rho, lo), hi) * a
            per[i][j] = -min(unclipped, clipped)
            clip[i][j] = clipped < unclipped
    return per, clip


@pytest.mark.parametrize("token_adv", [False, True])
def test_etr_matches_plain_loop(token_adv):
    rng = random.Random(0)
    for seed in range(10):
        logp, logp_old, adv, mask = random_inputs(seed, token_adv=token_adv)
        group_std = [rng.choice([0.0, 0.2, 0.5, 0.7]) for _ in range(len(logp))]
        for micro, macro in ((0.5, 0.5), (1.0, 0.0), (0.0, 0.9)):
            out = X.etr(
                logp,
                logp_old,
                adv,
                mask,
                micro_scale=micro,
                macro_scale=macro,
                group_std=torch.tensor(group_std, dtype=torch.float64),
            )
            per, clip = ref_etr(
                logp.tolist(),
                logp_old.tolist(),
                adv.tolist(),
                mask.tolist(),
                group_std,
                0.2,
                0.2,
                micro,
                macro,
                0.5,
            )
            torch.testing.assert_close(
                out.per_token, torch.tensor(per, dtype=torch.float64), rtol=1e-10, atol=1e-12
            )
            assert out.clipped.tolist() == clip


def test_etr_reduces_to_ppo_clip_and_its_gradient_stops_outside_the_elastic_range():
    logp, logp_old, adv, mask = random_inputs(3)
    a = X.etr(logp, logp_old, adv, mask, micro_scale=0.0, macro_scale=0.0)
    b = L.get("ppo_clip")(logp, logp_old, adv, mask)
    torch.testing.assert_close(a.per_token, b.per_token)
    assert torch.equal(a.clipped, b.clipped)
    # hand-worked: A = 1, |A| = 1 -> m = 1 + 0.5 tanh(1) = 1.3808; group std 0.5 -> M = 1.5; eps = 0.2 * 2.0712
    lp = torch.tensor([[math.log(1.35)]], requires_grad=True)
    out = X.etr(
        lp,
        torch.zeros(1, 1),
        torch.tensor([1.0]),
        torch.ones(1, 1, dtype=torch.bool),
        group_std=torch.tensor([0.5]),
    )
    assert not out.clipped.any()  # 1.35 < 1 + 0.414: inside the widened range (PPO would clip at 1.2)
    out.per_token.sum().backward()
    assert lp.grad.item() == pytest.approx(-1.35)
    lp2 = torch.tensor([[math.log(1.5)]], requires_grad=True)
    out2 = X.etr(
        lp2,
        torch.zeros(1, 1),
        torch.tensor([1.0]),
        torch.ones(1, 1, dtype=torch.bool),
        group_std=torch.tensor([0.5]),
    )
    assert out2.clipped.all()
    out2.per_token.sum().backward()
    assert lp2.grad.item() == 0.0
    with pytest.raises(ValueError, match="needs group_std"):
        X.etr(logp, logp_old, adv, mask)
    with pytest.raises(ValueError, match="group_std must be Float"):
        X.etr(logp, logp_old, adv, mask, group_std=torch.ones(2))
    with pytest.raises(ValueError, match="macro_scale must be < 1"):
        X.etr(logp, logp_old, adv, mask, macro_scale=1.0)


# ---------------------------------------------------------------------------- Reg-GRPO
def test_reg_grpo_value_and_gradient_by_hand():
    logp, logp_old, adv, mask = random_inputs(5, token_adv=False)
    beta = 5.0
    out = X.reg_grpo(logp, logp_old, adv, mask, beta=beta)
    lp, lo, m, a = logp.tolist(), logp_old.tolist(), mask.tolist(), adv.tolist()
    total = 0.0
    for i in range(len(lp)):
        valid = [j for j in range(len(lp[0])) if m[i][j]]
        if not valid:
            assert out.per_token[i].abs().sum() == 0
            continue
        pred = beta * sum(lp[i][j] - lo[i][j] for j in valid) / len(valid)
        loss = (pred - a[i]) ** 2
        for j in range(len(lp[0])):
            assert out.per_token[i, j].item() == pytest.approx(loss if m[i][j] else 0.0, rel=1e-10)
        total += loss * len(valid)
    assert not out.clipped.any()
    out.per_token.sum().backward()
    # d/dlogp_{i,t} of sum_i n_i (beta mean_t lr - A_i)^2 = 2 beta (beta mean lr - A_i) on valid actions
    for i in range(len(lp)):
        valid = [j for j in range(len(lp[0])) if m[i][j]]
        pred = beta * sum(lp[i][j] - lo[i][j] for j in valid) / max(len(valid), 1)
        for j in range(len(lp[0])):
            want = 2 * beta * (pred - a[i]) if m[i][j] else 0.0
            assert logp.grad[i, j].item() == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_reg_grpo_at_ratio_one_follows_the_policy_gradient():
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    out = X.reg_grpo(logp, logp.detach(), torch.tensor([1.0, -0.5]), mask, beta=2.0)
    out.per_token.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-4.0] * 3, [2.0] * 3]))  # -2 beta A
    with pytest.raises(ValueError, match="beta"):
        X.reg_grpo(logp, logp.detach(), torch.ones(2), mask, beta=0.0)


# ---------------------------------------------------------------------------- D³S token mask
def test_d3s_token_mask_matches_plain_loop():
    rng = random.Random(1)
    for _ in range(30):
        b, t = rng.randint(1, 4), rng.randint(1, 6)
        mask = [[rng.random() < 0.7 for _ in range(t)] for _ in range(b)]
        ent = [[rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in range(t)] for _ in range(b)]
        adv = [rng.gauss(0, 1) for _ in range(b)]
        frac = rng.choice([0.1, 0.5, 1.0])
        got = X.d3s_token_mask(torch.tensor(adv), torch.tensor(ent), torch.tensor(mask), frac)
        cells = [(abs(adv[i]) * ent[i][j], i * t + j) for i in range(b) for j in range(t) if mask[i][j]]
        k = math.ceil(frac * len(cells) - 1e-9)
        chosen = {pos for _, pos in sorted(cells, key=lambda c: (-c[0], c[1]))[:k]}
        want = [[(i * t + j) in chosen for j in range(t)] for i in range(b)]
        assert got.tolist() == want
    with pytest.raises(ValueError, match="keep_frac"):
        X.d3s_token_mask(torch.ones(1), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool), 0.0)


# ---------------------------------------------------------------------------- D³S token loss
def ref_d3s_loss(logp, logp_old, adv, mask, ent, frac, eps_low, eps_high):
    """Plain loop from the formula: keep the top ceil(frac * n) |A| * H (ties by position), PPO clip on
    them scaled by n / k, 0 elsewhere."""
    b, t = len(mask), len(mask[0])
    a = [[adv[i][j] if isinstance(adv[i], list) else adv[i] for j in range(t)] for i in range(b)]
    cells = [(abs(a[i][j]) * ent[i][j], i * t + j) for i in range(b) for j in range(t) if mask[i][j]]
    n = len(cells)
    k = math.ceil(frac * n - 1e-9)
    kept = {pos for _, pos in sorted(cells, key=lambda c: (-c[0], c[1]))[:k]}
    out = [[0.0] * t for _ in range(b)]
    for i in range(b):
        for j in range(t):
            if i * t + j in kept:
                rho = math.exp(logp[i][j] - logp_old[i][j])
                clipped = min(max(rho, 1 - eps_low), 1 + eps_high)
                out[i][j] = -min(rho * a[i][j], clipped * a[i][j]) * n / k
    return out


@pytest.mark.parametrize("token_adv", [False, True])
def test_d3s_loss_matches_plain_loop_and_relaxes_with_progress(token_adv):
    assert "d3s" in L.names()
    worst = 0.0
    for seed in range(6):
        logp, logp_old, adv, mask = random_inputs(seed, token_adv=token_adv)
        g = torch.Generator().manual_seed(100 + seed)
        ent = torch.rand(logp.shape, generator=g, dtype=torch.float64) * 2.0
        for step, total in ((0, 10), (5, 10), (10, 10), (None, None)):
            out = L.get("d3s")(logp, logp_old, adv, mask, entropy=ent, step=step, total_steps=total)
            p = 0.0 if step is None else step / total
            frac = 0.2 + 0.8 * min(1.0, p / 1.0)  # the documented defaults
            want = ref_d3s_loss(
                logp.tolist(), logp_old.tolist(), adv.tolist(), mask.tolist(), ent.tolist(), frac, 0.2, 0.2
            )
            diff = (out.per_token.detach() - torch.tensor(want, dtype=torch.float64)).abs().max().item()
            worst = max(worst, diff)
            assert diff < 1e-12, (seed, step, diff)
    print(f"d3s loss (token_adv={token_adv}) max abs diff vs plain loop: {worst:.3e}")
    # at keep 1.0 (end of training) it is exactly ppo_clip
    out = L.get("d3s")(logp, logp_old, adv, mask, entropy=ent, step=10, total_steps=10)
    torch.testing.assert_close(out.per_token, L.get("ppo_clip")(logp, logp_old, adv, mask).per_token)


def test_d3s_loss_hand_worked_and_errors():
    # 4 valid tokens, |A| * H = 2*0.1, 2*0.9, 1*0.5, 1*0.3 -> keep_start 0.5 keeps tokens 1 and 2; n / k = 2
    logp = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    ent = torch.tensor([[0.1, 0.9], [0.5, 0.3]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    out = L.get("d3s")(logp, logp.detach(), torch.tensor([2.0, -1.0]), mask, entropy=ent, keep_start=0.5)
    assert out.per_token.tolist() == [[0.0, -4.0], [2.0, 0.0]]
    with pytest.raises(ValueError, match="entropy"):
        L.get("d3s")(logp, logp.detach(), torch.ones(2), mask)
    with pytest.raises(ValueError, match="keep_start"):
        L.get("d3s")(logp, logp.detach(), torch.ones(2), mask, entropy=ent, keep_start=0.0)
    with pytest.raises(TypeError):
        L.get("d3s")(logp, logp.detach(), torch.ones(2), mask, entropy=ent, frac=0.5)
