"""Seed-paper estimators and transforms (mmalign/algorithms/seed_estimators.py) against plain-loop references."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from mmalign.algorithms import advantages, reward_transforms, seed_estimators, seed_transforms  # noqa: F401  (register them)
from mmalign.algorithms.advantages import ContextError, EstimatorContext

REWARDS = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.2, 0.9, 0.4, 0.7]
GROUPS = [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4


def grpo_loop(r: list[float], g: list[int], eps: float) -> list[float]:
    """GRPO written from its formula: (r - group mean) / (unbiased group std + eps)."""
    out = []
    for i, ri in enumerate(r):
        members = [r[j] for j in range(len(r)) if g[j] == g[i]]
        mu = sum(members) / len(members)
        sd = statistics.stdev(members)
        out.append((ri - mu) / (sd + eps))
    return out


def test_dcpo_matches_the_authors_blend_rule():
    """A = (1 - alpha) A_grpo + alpha b f, alpha from |H_base - H| / share of positives (DCPO's trainer code)."""
    r, g = REWARDS, GROUPS
    ent = [0.2 + 0.05 * i for i in range(16)]
    lp = [-0.1 * (i % 5) - 0.3 for i in range(16)]
    lengths = [10.0 + i for i in range(16)]
    ctx = EstimatorContext(
        entropy_mean=torch.tensor(ent), logp_old_mean=torch.tensor(lp), lengths=torch.tensor(lengths)
    )
    got = advantages.get("dcpo")(torch.tensor(r), torch.tensor(g), context=ctx).double()
    h = sum(e * n for e, n in zip(ent, lengths)) / sum(lengths)
    temp = 1.2 if h <= 0.5 else 0.8
    b = [1.0 if x > 0.05 else 0.0 for x in r]
    a = min(abs(0.5 - h), 0.1) / (sum(b) / len(b))
    alpha = a / (a + 1)
    base = grpo_loop(r, g, 1e-6)
    want = [
        (1 - alpha) * base[i] + alpha * b[i] * math.exp((1 / temp - 1) * (lp[i] + ent[i])) for i in range(16)
    ]
    assert got.tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert h > 0.5 and temp == 0.8  # the high-entropy branch: correct samples' factor depends on T


def test_dcpo_low_entropy_branch_and_no_positive_samples():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0])
    g = torch.tensor([0, 0, 1, 1])
    ctx = EstimatorContext(entropy_mean=torch.full((4,), 0.1), logp_old_mean=torch.full((4,), -1.0))
    got = advantages.get("dcpo")(r, g, context=ctx).double()
    alpha = (0.1 / 0.5) / (0.1 / 0.5 + 1)
    f = math.exp((1 / 1.2 - 1) * (-1.0 + 0.1))
    base = grpo_loop(r.tolist(), g.tolist(), 1e-6)
    assert got.tolist() == pytest.approx(
        [(1 - alpha) * base[i] + alpha * (r[i].item()) * f for i in range(4)], rel=1e-5
    )
    zero = advantages.get("dcpo")(torch.zeros(4), g, context=ctx)
    assert zero.abs().max() == 0
    with pytest.raises(ContextError, match="entropy_mean"):
        advantages.get("dcpo")(r, g)


def test_copo_blends_local_and_global_by_group_entropy():
    r, g = REWARDS, GROUPS
    got = advantages.get("copo")(torch.tensor(r), torch.tensor(g)).double().tolist()
    local = grpo_loop(r, g, 1e-4)
    p = {k: sum(1.0 for j in range(16) if g[j] == k and r[j] > 0.5) / 4 for k in range(4)}
    mu = sum(p.values()) / 4
    sd = statistics.stdev(p.values())
    want = []
    for i in range(16):
        q = p[g[i]]
        w = 0.0 if q in (0.0, 1.0) else -(q * math.log(q) + (1 - q) * math.log(1 - q)) / math.log(2)
        want.append(w * local[i] + (1 - w) * (q - mu) / (sd + 1e-4))
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    # a unanimous group still gets a signal: all-correct up, all-wrong down
    assert got[8] > 0 and got[4] < 0


def test_hardness_weighted_scales_grpo_by_the_pass_rate():
    r, g = REWARDS, GROUPS
    got = advantages.get("hardness_weighted")(torch.tensor(r), torch.tensor(g), alpha=2.0).double().tolist()
    local = grpo_loop(r, g, 1e-4)
    p = {k: sum(1.0 for j in range(16) if g[j] == k and r[j] > 0.5) / 4 for k in range(4)}
    assert got == pytest.approx([local[i] * (1 + 2.0 * (1 - p[g[i]])) for i in range(16)], rel=1e-5, abs=1e-6)


def test_grpo_s_scales_rewards_by_the_group_gap():
    r = [1.0, 0.0, 0.5, 0.5, 0.2, float("nan"), 0.9, 0.1, 0.3]
    g = [0, 0, 1, 1, 2, 2, 3, 3, 3]
    got = reward_transforms.get("grpo_s")(torch.tensor(r, dtype=torch.float64), torch.tensor(g), beta=0.5)
    gaps = {}
    for k in set(g):
        vals = [r[j] for j in range(len(r)) if g[j] == k and not math.isnan(r[j])]
        gaps[k] = max(vals) - min(vals)
    top = max(gaps.values())
    for i, ri in enumerate(r):
        if math.isnan(ri):
            assert math.isnan(got[i])
        else:
            assert got[i].item() == pytest.approx(ri * (1 + 0.5 * (1 - gaps[g[i]] / top)))


def test_the_entries_are_listed_with_their_options():
    assert {"dcpo", "copo", "hardness_weighted"} <= set(advantages.names())
    assert advantages.required_context_fields("dcpo") == ("entropy_mean", "logp_old_mean")
    assert "grpo_s" in reward_transforms.names()
    with pytest.raises(TypeError, match="copo"):
        advantages.get("copo")(torch.zeros(2), torch.zeros(2, dtype=torch.long), bogus=1)
