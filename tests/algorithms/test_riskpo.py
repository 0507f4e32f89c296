"""RiskPO (estimator:riskpo) against a plain-loop reference written from the formula, and a hand-worked batch."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from mmalign.algorithms import advantages as adv

NAN = float("nan")


def quantile(xs, q):
    """Linear interpolation between order statistics (numpy's default)."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (pos - lo) * (s[hi] - s[lo])


def ref_riskpo(r, gids, bundle=5, qd=0.2, qu=0.9, w=1.5, credit="std", normalize=True, eps=1e-6):
    out = [0.0] * len(r)
    questions = {}
    for i, g in enumerate(gids):
        if not math.isnan(r[i]):
            questions.setdefault(g, []).append(i)
    order = sorted(set(gids))
    for b in range(0, len(order), bundle):
        qs = [questions.get(g, []) for g in order[b : b + bundle]]
        n = min(len(q) for q in qs)
        if n < 2:
            continue
        papers = [[q[k] for q in qs] for k in range(n)]
        scores = [sum(r[i] for i in p) for p in papers]
        d, u = quantile(scores, qd), quantile(scores, qu)
        sd = statistics.stdev(scores)
        for p, s in zip(papers, scores, strict=True):
            rvar = (max(s - d, 0) - max(s - u, 0) + d - u) / (qu - qd + eps)
            cvar = -max(d - s, 0) / (qd + eps)
            a = (w * cvar + rvar) / (w + 1)
            if normalize:
                a /= sd + eps
            for i in p:
                if credit == "std":
                    vals = [r[j] for j in questions[gids[i]]]
                    s_q = statistics.stdev(vals) if len(vals) >= 2 else 0.0
                    a_i = a / ((s_q if s_q > 1e-3 else 1.0) + eps)
                else:
                    a_i = a
                out[i] = a_i
    return out


def test_riskpo_matches_plain_loop():
    rng = random.Random(3)
    worst = 0.0
    for trial in range(60):
        gids = [g for g in rng.sample(range(-10, 60), rng.randint(1, 9)) for _ in range(rng.randint(1, 6))]
        rng.shuffle(gids)
        r = [NAN if rng.random() < 0.08 else rng.choice([0.0, 1.0, 0.5, rng.random()]) for _ in gids]
        opts = [
            {},
            {"bundle_size": 1, "credit": "uniform"},
            {"bundle_size": 2, "quantile_down": 0.1, "quantile_up": 0.5, "w_mix": 0.0, "normalize": False},
        ][trial % 3]
        got = adv.riskpo(torch.tensor(r, dtype=torch.float64), torch.tensor(gids), **opts)
        ref_opts = {
            "bundle": opts.get("bundle_size", 5),
            "qd": opts.get("quantile_down", 0.2),
            "qu": opts.get("quantile_up", 0.9),
            "w": opts.get("w_mix", 1.5),
            "credit": opts.get("credit", "std"),
            "normalize": opts.get("normalize", True),
        }
        want = torch.tensor(ref_riskpo(r, gids, **ref_opts), dtype=torch.float64)
        diff = (got - want).abs().max().item()
        worst = max(worst, diff)
        assert diff < 1e-9, (trial, diff)
    print(f"estimator riskpo max abs diff vs plain loop: {worst:.3e}")


def test_riskpo_hand_worked_and_errors():
    # two questions in one bundle, rewards [1, 0, 1, 0] and [1, 1, 0, 0]: paper scores [2, 1, 1, 0]
    # q_0.2 = 0.6, q_0.9 = 1.7; score 1: RVaR = (0.4 - 0 + 0.6 - 1.7) / 0.7 = -1, CVaR = 0 -> A = -1 / 2.5
    # score 0: RVaR = (0.6 - 1.7) / 0.7, CVaR = -0.6 / 0.2 = -3; score 2: RVaR = (1.4 - 0.3 - 1.1) / 0.7 = 0
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    e = 1e-6
    sd = math.sqrt(2 / 3)
    a1 = (-0.7 / (0.7 + e)) / 2.5
    a0 = (1.5 * (-0.6 / (0.2 + e)) + (-1.1 / (0.7 + e))) / 2.5
    want = torch.tensor([0.0, a1, a1, a0, 0.0, a1, a1, a0], dtype=torch.float64) / (sd + e)
    torch.testing.assert_close(adv.riskpo(r, g, bundle_size=2, credit="uniform"), want)
    q_sd = math.sqrt(1 / 3)  # unbiased std of [1, 0, 1, 0]
    torch.testing.assert_close(adv.riskpo(r, g, bundle_size=2), want / (q_sd + e))
    # a bundle of one question whose rewards are all equal: every paper sits at both quantiles -> 0
    assert adv.riskpo(torch.ones(4), torch.zeros(4, dtype=torch.long)).abs().sum() == 0
    assert adv.options("riskpo")["bundle_size"] == 5
    with pytest.raises(ValueError, match="quantile_down < quantile_up"):
        adv.riskpo(r, g, quantile_down=0.9, quantile_up=0.2)
    with pytest.raises(ValueError, match="credit"):
        adv.riskpo(r, g, credit="score")
