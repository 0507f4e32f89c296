"""ADORA (estimator:adora) against a plain-loop reference written from the formula, and hand-worked numbers."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from mmalign import advantages as adv

NAN = float("nan")


def ref_adora(r, gids, lengths, threshold=0.5, weight=0.1, eps=1e-6):
    out = [0.0] * len(r)
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(gids):
        groups.setdefault(g, []).append(i)
    for idxs in groups.values():
        members = [i for i in idxs if not math.isnan(r[i])]
        if len(members) < 2:
            continue
        vals = [r[i] for i in members]
        mean, sd = statistics.fmean(vals), statistics.stdev(vals)
        if max(vals) == min(vals):  # the shared convention: equal rewards have mean exactly and std 0
            mean, sd = vals[0], 0.0
        high = [lengths[i] for i in members if r[i] > threshold]
        low = [lengths[i] for i in members if r[i] <= threshold]
        mean_low = statistics.fmean(low) if low else math.inf
        w = 1.0 if not high or max(high) > mean_low else weight
        for i in members:
            out[i] = w * ((r[i] - mean) / (sd + eps) if sd + eps > 0 else 0.0)
    return out


def test_adora_matches_plain_loop():
    rng = random.Random(5)
    worst = 0.0
    for trial in range(80):
        gids = [g for g in rng.sample(range(100), rng.randint(1, 5)) for _ in range(rng.randint(1, 6))]
        rng.shuffle(gids)
        r = [NAN if rng.random() < 0.1 else rng.choice([0.0, 1.0, 0.3, 0.8]) for _ in gids]
        lengths = [rng.randint(0, 60) for _ in gids]
        threshold, weight = (0.5, 0.1) if trial % 2 else (0.7, 0.25)
        got = adv.adora(
            torch.tensor(r, dtype=torch.float64),
            torch.tensor(gids),
            num_actions=torch.tensor(lengths),
            threshold=threshold,
            weight=weight,
        )
        want = torch.tensor(ref_adora(r, gids, lengths, threshold, weight), dtype=torch.float64)
        diff = (got - want).abs().max().item()
        worst = max(worst, diff)
        assert diff < 1e-12, (trial, diff)
    print(f"estimator adora max abs diff vs plain loop: {worst:.3e}")


def test_adora_hand_worked_and_errors():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0])
    g = torch.tensor([0, 0, 1, 1])
    a = 1 / (math.sqrt(0.5) + 1e-6)  # GRPO: (1 - 0.5) / stdev([1, 0])
    # group 0: correct answer 40 tokens > wrong 20 -> full weight; group 1: correct 5 <= wrong 30 -> 0.1
    got = adv.adora(r, g, num_actions=[40, 20, 5, 30])
    torch.testing.assert_close(got, torch.tensor([a * 0.5, -a * 0.5, 0.05 * a, -0.05 * a]))
    assert adv.accepts_num_actions("adora")
    assert adv.options("adora") == {"weights": None, "threshold": 0.5, "weight": 0.1, "eps": 1e-6}
    with pytest.raises(ValueError, match="num_actions"):
        adv.adora(r, g)
    with pytest.raises(ValueError, match="weight"):
        adv.adora(r, g, num_actions=[1, 1, 1, 1], weight=-1.0)
