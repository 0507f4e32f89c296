"""Tests of mmalign.algorithms.reward_transforms against plain-Python references written from each paper's formula."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from mmalign.algorithms import advantages as adv
from mmalign.algorithms import reward_transforms as rt
from mmalign.algorithms.advantages import ContextError, EstimatorContext
from mmalign.registry import RegistryError

NAN = math.nan


def test_registry():
    # grpo_s: mmalign/algorithms/seed_transforms.py (tests/algorithms/test_seed_estimators.py)
    assert rt.names() == ["grpo_s", "noisy_verifier", "self_aligned", "set_diversity", "unlikeliness"]
    for name in rt.names():
        line = rt.describe(name)
        assert line and "\n" not in line
    assert rt.options("unlikeliness") == {"beta": 0.25}
    assert rt.options("noisy_verifier") == {"fp_rate": 0.0, "fn_rate": 0.0}
    with pytest.raises(RegistryError, match="unlikeliness"):
        rt.get("unlikelyness")
    with pytest.raises(TypeError, match=r"'noisy_verifier'.*'rho0'"):
        rt.get("noisy_verifier")(torch.ones(2), torch.zeros(2, dtype=torch.long), rho0=0.1)


# ---------------------------------------------------------------------------- noisy verifier
def test_noisy_verifier_is_unbiased_for_the_clean_reward():
    """E[r_hat | clean] = clean, computed exactly over the channel's two outcomes, and by simulation."""
    fp, fn = 0.1, 0.25
    f = rt.get("noisy_verifier")
    g = torch.zeros(2, dtype=torch.long)
    hat = f(torch.tensor([1.0, 0.0]), g, fp_rate=fp, fn_rate=fn)  # r_hat of an observed 1 and an observed 0
    assert hat.tolist() == pytest.approx([(1 - fp) / (1 - fp - fn), -fp / (1 - fp - fn)])
    # clean 1: observed 1 w.p. 1 - fn; clean 0: observed 1 w.p. fp
    assert (1 - fn) * hat[0] + fn * hat[1] == pytest.approx(1.0)
    assert fp * hat[0] + (1 - fp) * hat[1] == pytest.approx(0.0)
    # simulation: a policy whose clean success rate is 0.3
    gen = torch.Generator().manual_seed(0)
    clean = (torch.rand(200_000, generator=gen) < 0.3).double()
    flip = torch.rand(200_000, generator=gen)
    observed = torch.where(clean == 1, (flip >= fn).double(), (flip < fp).double())
    corrected = f(observed, torch.zeros(200_000, dtype=torch.long), fp_rate=fp, fn_rate=fn)
    assert float(corrected.mean()) == pytest.approx(0.3, abs=0.01)
    assert float(observed.mean()) == pytest.approx(0.3 * (1 - fn) + 0.7 * fp, abs=0.01)
    # NaN stays NaN; bad rates
    assert math.isnan(f(torch.tensor([NAN, 1.0]), g, fp_rate=0.1)[0])
    with pytest.raises(ValueError, match="must be < 1"):
        f(torch.ones(2), g, fp_rate=0.5, fn_rate=0.5)
    with pytest.raises(ValueError, match="fn_rate"):
        f(torch.ones(2), g, fn_rate=-0.1)


# ---------------------------------------------------------------------------- unlikeliness
def ref_unlikeliness(r, gids, lp, beta):
    out = list(r)
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(gids):
        groups.setdefault(g, []).append(i)
    for idxs in groups.values():
        members = [i for i in idxs if not math.isnan(r[i])]
        ordered = sorted(members, key=lambda i: (lp[i], i))  # ascending likelihood, ties by position
        for rank, i in enumerate(ordered):
            out[i] = r[i] * (1 - beta * rank / len(members))
    return out


def test_unlikeliness_matches_reference_and_hand_worked():
    rng = random.Random(0)
    for _ in range(30):
        b = rng.randint(1, 12)
        gids = [rng.choice([2, 5, -3]) for _ in range(b)]
        r = [NAN if rng.random() < 0.15 else float(rng.random() < 0.6) for _ in range(b)]
        lp = [rng.choice([-0.5, -1.0, -1.5, rng.gauss(-1, 0.3)]) for _ in range(b)]
        for beta in (0.25, 1.0):
            ctx = EstimatorContext(logp_old_mean=torch.tensor(lp, dtype=torch.float64))
            got = rt.get("unlikeliness")(
                torch.tensor(r, dtype=torch.float64), torch.tensor(gids), context=ctx, beta=beta
            )
            want = torch.tensor(ref_unlikeliness(r, gids, lp, beta), dtype=torch.float64)
            torch.testing.assert_close(got, want, equal_nan=True)
    # hand-worked (the authors' rank: argsort of argsort of the mean log-prob; rank / G):
    # log-probs [-0.2, -3.0, -1.0, -0.5] -> ranks [3, 0, 1, 2]; beta 0.25, G = 4 -> factors 1 - 0.25 rank / 4
    ctx = EstimatorContext(logp_old_mean=torch.tensor([-0.2, -3.0, -1.0, -0.5]))
    got = rt.get("unlikeliness")(torch.ones(4), torch.zeros(4, dtype=torch.long), context=ctx)
    torch.testing.assert_close(got, torch.tensor([1 - 0.1875, 1.0, 1 - 0.0625, 1 - 0.125]))
    # with GRPO: the least likely correct answer gets the largest advantage
    r = torch.tensor([1.0, 1.0, 0.0, 0.0])
    ctx = EstimatorContext(logp_old_mean=torch.tensor([-0.1, -2.0, -1.0, -1.0]))
    a = adv.grpo(
        rt.get("unlikeliness")(r, torch.zeros(4, dtype=torch.long), context=ctx),
        torch.zeros(4, dtype=torch.long),
    )
    assert a[1] > a[0] > 0 > a[2]
    with pytest.raises(ContextError, match="logp_old_mean"):
        rt.get("unlikeliness")(r, torch.zeros(4, dtype=torch.long))
    bad = EstimatorContext(logp_old_mean=torch.tensor([NAN, -2.0, -1.0, -1.0]))
    with pytest.raises(ContextError, match="finite"):
        rt.get("unlikeliness")(r, torch.zeros(4, dtype=torch.long), context=bad)


# ---------------------------------------------------------------------------- set diversity
def ref_set_diversity(r, gids, sets, feats, weight, metric):
    def dist(a, b):
        if metric == "cosine":
            na = math.sqrt(sum(x * x for x in a))
            nb = math.sqrt(sum(x * x for x in b))
            return max(0.0, 1 - sum(x * y for x, y in zip(a, b, strict=True)) / (na * nb))
        return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)))

    def diversity(members):
        pairs = list(itertools.combinations(members, 2))
        return sum(dist(feats[i], feats[j]) for i, j in pairs) / len(pairs) if pairs else 0.0

    out = list(r)
    cells: dict[tuple[int, int], list[int]] = {}
    for i, (g, s) in enumerate(zip(gids, sets, strict=True)):
        cells.setdefault((g, s), []).append(i)
    for members in cells.values():
        if len(members) < 2:
            continue
        d = diversity(members)
        contrib = {i: d - diversity([j for j in members if j != i]) for i in members}
        mean_c = sum(contrib.values()) / len(members)
        for i in members:
            if not math.isnan(r[i]):
                out[i] = r[i] + weight * (d + contrib[i] - mean_c)
    return out


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_set_diversity_matches_reference(metric):
    rng = random.Random(3)
    for case in range(20):
        b = rng.randint(1, 10)
        gids = [rng.choice([0, 1]) for _ in range(b)]
        sets = [rng.choice([0, 1, 2]) for _ in range(b)]
        feats = [[rng.gauss(0, 1) for _ in range(3)] for _ in range(b)]
        r = [NAN if rng.random() < 0.1 else rng.random() for _ in range(b)]
        use_sets = case % 2 == 0
        ctx = EstimatorContext(
            features=torch.tensor(feats, dtype=torch.float64),
            set_ids=torch.tensor(sets) if use_sets else None,
        )
        got = rt.get("set_diversity")(
            torch.tensor(r, dtype=torch.float64), torch.tensor(gids), context=ctx, weight=0.7, metric=metric
        )
        want = ref_set_diversity(r, gids, sets if use_sets else [0] * b, feats, 0.7, metric)
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), equal_nan=True)


def test_set_diversity_hand_worked():
    # one set of three: two identical samples and a distinct one (euclidean, on a line: 0, 0, 3)
    # D = (0 + 3 + 3) / 3 = 2; without sample 0 or 1: D = 3 -> c = -1; without 2: 0 -> c = 2; mean c = 0
    # credit = D + c - mean c = [1, 1, 4]: the distinct sample earns the most
    ctx = EstimatorContext(features=torch.tensor([[0.0], [0.0], [3.0]]))
    got = rt.get("set_diversity")(
        torch.zeros(3), torch.zeros(3, dtype=torch.long), context=ctx, metric="euclidean", weight=1.0
    )
    torch.testing.assert_close(got, torch.tensor([1.0, 1.0, 4.0]))


# ---------------------------------------------------------------------------- self-aligned reward
def test_self_aligned_reward_formula():
    lp_c = [-0.5, -1.0, -2.0]
    lp_u = [-1.5, -1.0, -1.0]
    ctx = EstimatorContext(logp_old_mean=torch.tensor(lp_c), logp_uncond_mean=torch.tensor(lp_u))
    got = rt.get("self_aligned")(
        torch.tensor([1.0, 0.0, NAN]), torch.zeros(3, dtype=torch.long), context=ctx, weight=0.5
    )
    ppl = [(math.exp(-u) - math.exp(-c)) / math.exp(-u) for c, u in zip(lp_c, lp_u, strict=True)]
    assert got[0].item() == pytest.approx(1 + 0.5 * ppl[0], rel=1e-6)
    assert got[1].item() == pytest.approx(0.0)  # the query does not help: SAR = 0
    assert math.isnan(got[2])


# ---------------------------------------------------------------------------- apply / check_specs
def test_apply_runs_specs_in_order_on_columns():
    r = torch.tensor([[1.0, 0.5], [0.0, 0.2], [1.0, NAN]])
    g = torch.zeros(3, dtype=torch.long)
    ctx = EstimatorContext(logp_old_mean=torch.tensor([-0.1, -2.0, -1.0]))
    specs = [
        {"name": "noisy_verifier", "column": "acc", "fp_rate": 0.1, "fn_rate": 0.1},
        {"name": "unlikeliness", "beta": 0.5},
    ]
    got = rt.apply(specs, r, g, context=ctx, reward_names=["acc", "fmt"])
    step1 = r.clone()
    step1[:, 0] = (r[:, 0] - 0.1) / 0.8
    ranks = torch.tensor(
        [2.0, 0.0, 1.0]
    )  # by log-prob ascending, among the samples with a reward in the column
    want = step1.clone()
    want[:, 0] = step1[:, 0] * (1 - 0.5 * ranks / 3)
    want[:2, 1] = step1[:2, 1] * (1 - 0.5 * torch.tensor([1.0, 0.0]) / 2)  # column 2: sample 2 is NaN
    torch.testing.assert_close(got, want, equal_nan=True)
    assert torch.equal(r[:, 0], torch.tensor([1.0, 0.0, 1.0]))  # the input is left alone
    # 1-D rewards; column by index; errors
    torch.testing.assert_close(
        rt.apply([{"name": "noisy_verifier", "fp_rate": 0.2}], r[:, 0], g), (r[:, 0] - 0.2) / 0.8
    )
    with pytest.raises(ValueError, match="applies to one reward: set 'column'"):
        rt.apply([{"name": "noisy_verifier"}], r, g)
    with pytest.raises(ValueError, match="'fmtt' is not a reward name"):
        rt.apply([{"name": "noisy_verifier", "column": "fmtt"}], r, g, reward_names=["acc", "fmt"])
    with pytest.raises(ValueError, match="index < 2"):
        rt.apply([{"name": "noisy_verifier", "column": 2}], r, g)


def test_check_specs():
    rt.check_specs([{"name": "unlikeliness", "beta": 0.1}], ["acc", "fmt"])
    rt.check_specs([{"name": "noisy_verifier", "column": "acc", "fp_rate": 0.1}], ["acc", "fmt"])
    with pytest.raises(RegistryError):
        rt.check_specs([{"name": "noisy"}])
    with pytest.raises(TypeError, match=r"'unlikeliness'.*'betta'"):
        rt.check_specs([{"name": "unlikeliness", "betta": 0.1}])
    with pytest.raises(ValueError, match="set 'column'"):
        rt.check_specs([{"name": "set_diversity"}], ["acc", "fmt"])
    with pytest.raises(ValueError, match="mapping with a 'name'"):
        rt.check_specs([{"beta": 0.1}])
