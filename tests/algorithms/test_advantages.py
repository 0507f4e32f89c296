"""Tests of mmalign.algorithms.advantages against independent plain-Python references (lists, math, statistics)."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from mmalign.algorithms import advantages as adv
from mmalign.algorithms.advantages import EstimatorContext, SPOTracker
from mmalign.registry import RegistryError

NAN = math.nan
ALL_ESTIMATORS = {
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_pp",
    "gdpo",
    "mc_grpo",
    "ngrpo",
    "pass_at_k",
    "a_grae",
}
# estimators that take step rewards (registry metadata step_rewards=True) and return Float[B, T]
STEP_ESTIMATORS = {"grpo_process"}
# estimators that need an EstimatorContext, state or num_actions: tested in their own section below
# (hapo, adora, riskpo: tested in tests/algorithms/test_hapo.py, test_adora.py, test_riskpo.py)
CONTEXT_ESTIMATORS = {"spo", "gigpo", "hgpo", "factorized", "ace", "canon", "drpo", "hapo", "adora", "riskpo"}
# the seed-paper estimators of mmalign/algorithms/seed_estimators.py: tests/algorithms/test_seed_estimators.py
SEED_ESTIMATORS = {"dcpo", "copo", "hardness_weighted"}


# =========================================================================== plain-Python references
# Inputs: rows = B lists of K floats (NaN = not applicable), gids = list of B ints, weights = K floats.


def ref_combine(row, weights):
    terms = [w * x for w, x in zip(weights, row, strict=True) if not math.isnan(x)]
    # components of weight 0 do not make a sample applicable (unless every weight is 0)
    applicable = [x for w, x in zip(weights, row, strict=True) if w != 0 or not any(weights)]
    if all(math.isnan(x) for x in applicable):
        return NAN
    return sum(terms)


def ref_totals(rows, weights):
    return [ref_combine(row, weights) for row in rows]


def ref_groups(gids):
    groups = {}
    for i, g in enumerate(gids):
        groups.setdefault(g, []).append(i)
    return groups


def ref_valid_members(r, idxs):
    return [i for i in idxs if not math.isnan(r[i])]


def ref_whiten(values, selected, eps):
    """(x - mean)/(stdev + eps) over selected indices, 0 elsewhere; all 0 if fewer than 2 selected."""
    out = [0.0] * len(values)
    if len(selected) < 2:
        return out
    xs = [values[i] for i in selected]
    mu, sd = statistics.fmean(xs), statistics.stdev(xs)
    for i in selected:
        out[i] = (values[i] - mu) / (sd + eps) if sd + eps > 0 else 0.0
    return out


def ref_grpo(rows, gids, weights, std="group", eps=1e-4):
    r = ref_totals(rows, weights)
    out = [0.0] * len(r)
    all_valid = [x for x in r if not math.isnan(x)]
    batch_sd = statistics.stdev(all_valid) if len(all_valid) >= 2 else 0.0
    for idxs in ref_groups(gids).values():
        members = ref_valid_members(r, idxs)
        if len(members) < 2:
            continue
        vals = [r[i] for i in members]
        mean, sd = statistics.fmean(vals), statistics.stdev(vals)
        scale = {"group": sd + eps, "batch": batch_sd + eps, "none": 1.0}[std]
        for i in members:
            out[i] = (r[i] - mean) / scale if scale > 0 else 0.0
    return out


def ref_dr_grpo(rows, gids, weights):
    return ref_grpo(rows, gids, weights, std="none")


def ref_rloo(rows, gids, weights):
    r = ref_totals(rows, weights)
    out = [0.0] * len(r)
    for idxs in ref_groups(gids).values():
        members = ref_valid_members(r, idxs)
        if len(members) < 2:
            continue
        for i in members:
            others = [r[j] for j in members if j != i]
            out[i] = r[i] - sum(others) / len(others)
    return out


def ref_centred(rows, gids, weights):
    """(x, selected): x_i = r_i - group mean for samples of groups with >= 2 valid samples."""
    r = ref_totals(rows, weights)
    x = [0.0] * len(r)
    selected = []
    for idxs in ref_groups(gids).values():
        members = ref_valid_members(r, idxs)
        if len(members) < 2:
            continue
        mean = statistics.fmean(r[i] for i in members)
        for i in members:
            x[i] = r[i] - mean
            selected.append(i)
    return x, sorted(selected)


def ref_reinforce_pp(rows, gids, weights, eps=1e-4, whiten_over="samples"):
    assert whiten_over == "samples"
    x, selected = ref_centred(rows, gids, weights)
    return ref_whiten(x, selected, eps)


def ref_reinforce_pp_tokens(rows, gids, weights, counts, eps=1e-4):
    """Weighted plain loop from the formula: sample i counts counts[i] times (N = sum, Bessel N - 1)."""
    x, selected = ref_centred(rows, gids, weights)
    out = [0.0] * len(x)
    total = 0.0
    for i in selected:
        total += counts[i]
    if total < 2:
        return out
    mu = 0.0
    for i in selected:
        mu += counts[i] * x[i]
    mu /= total
    ss = 0.0
    for i in selected:
        ss += counts[i] * (x[i] - mu) ** 2
    sd = math.sqrt(ss / (total - 1))
    for i in selected:
        if counts[i] > 0 and sd + eps > 0:
            out[i] = (x[i] - mu) / (sd + eps)
    return out


def ref_reinforce_pp_verl_tokens(rows, gids, weights, counts, eps=1e-4):
    """verl's construction for integer counts: broadcast x_i to each of its counts[i] tokens, whiten the
    flat token list (statistics.stdev = Bessel over the token count), read back one value per sample."""
    x, selected = ref_centred(rows, gids, weights)
    tokens = [x[i] for i in selected for _ in range(counts[i])]
    out = [0.0] * len(x)
    if len(tokens) < 2:
        return out
    mu, sd = statistics.fmean(tokens), statistics.stdev(tokens)
    for i in selected:
        if counts[i] > 0 and sd + eps > 0:
            out[i] = (x[i] - mu) / (sd + eps)
    return out


def ref_gdpo(rows, gids, weights, eps=1e-4):
    r = ref_totals(rows, weights)
    n, k_count = len(rows), len(weights)
    a_pre = [0.0] * n
    selected = []
    for idxs in ref_groups(gids).values():
        members = ref_valid_members(r, idxs)
        if len(members) < 2:
            continue
        selected.extend(members)
        for k in range(k_count):
            comp_members = [i for i in members if not math.isnan(rows[i][k])]
            if len(comp_members) < 2:
                continue
            vals = [rows[i][k] for i in comp_members]
            mean, sd = statistics.fmean(vals), statistics.stdev(vals)
            for i in comp_members:
                a_pre[i] += weights[k] * (rows[i][k] - mean) / (sd + eps)
    return ref_whiten(a_pre, sorted(selected), eps)


def ref_lower_median(values):
    s = sorted(values)
    return s[(len(s) - 1) // 2]


def ref_mc_grpo(rows, gids, weights, mad_eps=1e-3):
    """Returns (advantages, keep-mask)."""
    r = ref_totals(rows, weights)
    out = [0.0] * len(r)
    keep = [True] * len(r)
    for idxs in ref_groups(gids).values():
        members = ref_valid_members(r, idxs)
        if not members:
            keep[min(idxs)] = False
            continue
        m = ref_lower_median([r[i] for i in members])
        keep[min(i for i in members if r[i] == m)] = False
        if len(members) < 2:
            continue
        mad = ref_lower_median([abs(r[i] - m) for i in members]) + mad_eps
        a = {i: (r[i] - m) / mad for i in members}
        nonzero = [i for i in members if abs(a[i]) > 1e-6]
        for i in members:
            out[i] = a[i] * len(members) / len(nonzero) if i in nonzero else a[i]
    return out, keep


def ref_ngrpo(rows, gids, weights, k=1, r_max=1.0, eps=1e-6):
    r = ref_totals(rows, weights)
    out = [0.0] * len(r)
    for idxs in ref_groups(gids).values():
        members = ref_valid_members(r, idxs)
        if len(members) < 2:
            continue
        aug = [r[i] for i in members] + [r_max] * k
        mean, sd = statistics.fmean(aug), statistics.stdev(aug)
        for i in members:
            out[i] = (r[i] - mean) / (sd + eps)
    return out


def ref_pass_at_k(rows, gids, weights, normalize=False, eps=1e-4):
    r = ref_totals(rows, weights)
    out = [0.0] * len(r)
    for idxs in ref_groups(gids).values():
        members = ref_valid_members(r, idxs)
        if len(members) < 2:
            continue
        vals = sorted((r[i] for i in members), reverse=True)
        if vals[0] == vals[1]:
            continue
        best = next(i for i in members if r[i] == vals[0])
        gap = vals[0] - vals[1]
        if normalize:
            gap /= statistics.stdev(vals) + eps
        out[best] = gap
    return out


def ref_a_grae(
    rows, gids, weights, progress=0.0, beta_pos_start=0.6, beta_pos_end=0.9, difficulty_strength=0.5, eps=1e-4
):
    base = ref_grpo(rows, gids, weights, std="group", eps=eps)
    r = ref_totals(rows, weights)
    means = {}
    for g, idxs in ref_groups(gids).items():
        members = ref_valid_members(r, idxs)
        if len(members) >= 2:
            means[g] = statistics.fmean(r[i] for i in members)
    lo, hi = (min(means.values()), max(means.values())) if means else (0.0, 0.0)
    beta = beta_pos_start + (beta_pos_end - beta_pos_start) * progress
    out = [0.0] * len(r)
    for i, g in enumerate(gids):
        if g not in means or math.isnan(r[i]):
            continue
        easiness = (means[g] - lo) / (hi - lo) if hi > lo else 0.5
        w = 1 + difficulty_strength * (1 - 2 * progress) * (2 * easiness - 1)
        a = base[i] * beta if base[i] > 0 else base[i]
        out[i] = w * a
    return out


REFERENCES = {
    "grpo": ref_grpo,
    "dr_grpo": ref_dr_grpo,
    "rloo": ref_rloo,
    "reinforce_pp": ref_reinforce_pp,
    "gdpo": ref_gdpo,
    "mc_grpo": lambda rows, gids, weights, **o: ref_mc_grpo(rows, gids, weights, **o)[0],
    "ngrpo": ref_ngrpo,
    "pass_at_k": ref_pass_at_k,
    "a_grae": ref_a_grae,
}

# option sets each estimator is checked with (besides weights)
OPTION_SETS = {
    "grpo": [{}, {"std": "batch"}, {"std": "none"}, {"eps": 0.0}],
    "dr_grpo": [{}],
    "rloo": [{}],
    "reinforce_pp": [{}, {"eps": 1e-2}, {"whiten_over": "samples"}],
    "gdpo": [{}, {"eps": 1e-3}],
    "mc_grpo": [{}, {"mad_eps": 0.05}],
    "ngrpo": [{}, {"k": 2, "r_max": 2.0}, {"k": 0}],
    "pass_at_k": [{}, {"normalize": True}],
    "a_grae": [{}, {"progress": 1.0}, {"progress": 0.3, "beta_pos_start": 0.5, "difficulty_strength": 1.0}],
}


# =========================================================================== random inputs


def random_batch(rng: random.Random, k: int, discrete: bool, nan_frac: float = 0.15):
    """Random group sizes, unsorted arbitrary group ids (some negative), K components, some NaNs."""
    num_groups = rng.randint(1, 6)
    ids = rng.sample(range(-40, 1000), num_groups)
    gids = [g for g in ids for _ in range(rng.randint(1, 7))]
    rng.shuffle(gids)

    def value():
        if rng.random() < nan_frac:
            return NAN
        return rng.choice([0.0, 0.5, 1.0]) if discrete else rng.gauss(0.3, 1.0)

    rows = [[value() for _ in range(k)] for _ in gids]
    if rng.random() < 0.3:  # a whole group with every reward NaN
        bad = rng.choice(ids)
        rows = [[NAN] * k if g == bad else row for row, g in zip(rows, gids, strict=True)]
    weights = [rng.choice([1.0, 0.5, 2.0, -0.5]) for _ in range(k)]
    return rows, gids, weights


def to_tensors(rows, gids, k_dim: bool, dtype=torch.float64):
    r = torch.tensor(rows, dtype=dtype)
    if not k_dim:
        r = r[:, 0]
    return r, torch.tensor(gids, dtype=torch.long)


def random_cases(seed: int, n: int):
    rng = random.Random(seed)
    for case in range(n):
        k = rng.choice([1, 1, 2, 3])
        discrete = case % 2 == 0
        rows, gids, weights = random_batch(rng, k, discrete)
        yield rows, gids, weights, k


@pytest.mark.parametrize("name", sorted(ALL_ESTIMATORS))
def test_matches_plain_python_reference(name):
    fn = adv.get(name)
    ref = REFERENCES[name]
    for case_idx, (rows, gids, weights, k) in enumerate(
        random_cases(seed=1 + sorted(ALL_ESTIMATORS).index(name), n=40)
    ):
        for opts in OPTION_SETS[name]:
            # K = 1 sometimes passed as Float[B] (weights then default to 1)
            as_vector = k == 1 and case_idx % 3 == 0
            w = [1.0] if as_vector else weights
            r, g = to_tensors(rows, gids, k_dim=not as_vector)
            call_opts = dict(opts) if as_vector else {**opts, "weights": weights}
            got = fn(r, g, **call_opts)
            want = ref(rows, gids, w, **opts)
            assert got.dtype == torch.float64 and got.shape == (len(gids),)
            assert torch.isfinite(got).all(), (name, opts, rows, gids)
            torch.testing.assert_close(
                got,
                torch.tensor(want, dtype=torch.float64),
                rtol=1e-9,
                atol=1e-9,
                msg=lambda m, rows=rows, gids=gids, opts=opts: f"{name} {opts}\n{rows}\n{gids}\n{m}",
            )


@pytest.mark.parametrize("name", sorted(ALL_ESTIMATORS))
def test_float32_path_close_to_reference(name):
    fn = adv.get(name)
    for rows, gids, weights, _k in random_cases(seed=7, n=10):
        r, g = to_tensors(rows, gids, k_dim=True, dtype=torch.float32)
        got = fn(r, g, weights=weights)
        assert got.dtype == torch.float32
        want = torch.tensor(REFERENCES[name](rows, gids, weights), dtype=torch.float32)
        if name == "mc_grpo":  # MAD can be ~1e-3: amplifies float32 rounding of the rewards
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-2)
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(ALL_ESTIMATORS))
def test_permutation_and_relabelling_equivariant(name):
    """Shuffling the batch shuffles the advantages; renaming group ids changes nothing."""
    fn = adv.get(name)
    rng = random.Random(3)
    rows, gids, weights = random_batch(rng, 2, discrete=False, nan_frac=0.1)
    # ties are resolved by index (mc_grpo pivot, pass_at_k): use distinct continuous rewards
    r, g = to_tensors(rows, gids, k_dim=True)
    base = fn(r, g, weights=weights)
    perm = torch.randperm(len(gids), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fn(r[perm], g[perm], weights=weights), base[perm])
    torch.testing.assert_close(fn(r, g * 7 - 1000, weights=weights), base)


# =========================================================================== hand-worked numbers


def test_grpo_hand_worked():
    # one group [1, 0, 0, 1]: mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std 0.57735
    # A = +-0.5 / (0.57735 + 1e-4) = +-0.86588
    a = adv.grpo(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([3, 3, 3, 3]))
    torch.testing.assert_close(a, torch.tensor([0.86588, -0.86588, -0.86588, 0.86588]), atol=1e-4, rtol=0)
    # std="none": +-0.5; std="batch" with a second group [2, 2]:
    # batch rewards [1,0,0,1,2,2]: mean 1, dev^2 sum = 0+1+1+0+1+1 = 4, var 4/5 = 0.8, std 0.894427
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    torch.testing.assert_close(adv.grpo(r, g, std="none")[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    a = adv.grpo(r, g, std="batch")
    torch.testing.assert_close(
        a, torch.tensor([0.55896, -0.55896, -0.55896, 0.55896, 0.0, 0.0]), atol=1e-4, rtol=0
    )


def test_grpo_weights_and_nan_components_hand_worked():
    # K = 2, weights [1, 0.5]; rows: [1, 2] -> 2; [0, NaN] -> 0; [NaN, NaN] -> NaN (excluded, A = 0);
    # [1, 0] -> 1. Valid group rewards [2, 0, 1]: mean 1, unbiased std 1 -> A = [1, -1, 0, 0] / 1.0001
    r = torch.tensor([[1.0, 2.0], [0.0, NAN], [NAN, NAN], [1.0, 0.0]])
    a = adv.grpo(r, torch.tensor([5, 5, 5, 5]), weights=[1.0, 0.5])
    torch.testing.assert_close(a, torch.tensor([0.9999, -0.9999, 0.0, 0.0]), atol=1e-4, rtol=0)
    tot = adv.combine_rewards(r, [1.0, 0.5])
    assert tot[0] == 2.0 and tot[1] == 0.0 and math.isnan(tot[2]) and tot[3] == 1.0


def test_dr_grpo_and_rloo_hand_worked():
    r, g = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long)
    torch.testing.assert_close(adv.dr_grpo(r, g), torch.tensor([0.5, -0.5, -0.5, 0.5]))
    # rloo: A_0 = 1 - (0 + 0 + 1)/3 = 2/3 ; A_1 = 0 - (1 + 0 + 1)/3 = -2/3
    torch.testing.assert_close(adv.rloo(r, g), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))


def test_reinforce_pp_hand_worked():
    # groups [1, 0] and [2, 2]: centred x = [0.5, -0.5, 0, 0]; batch mean 0,
    # unbiased std sqrt(0.5 / 3) = 0.408248 -> A = +-0.5 / 0.408348 = +-1.224446
    a = adv.reinforce_pp(torch.tensor([1.0, 0.0, 2.0, 2.0]), torch.tensor([9, 9, 4, 4]))
    torch.testing.assert_close(a, torch.tensor([1.224446, -1.224446, 0.0, 0.0]), atol=1e-5, rtol=0)


def test_reinforce_pp_tokens_hand_worked():
    # groups [1, 0] and [3, 1] with lengths [1, 3, 2, 2]: centred x = [0.5, -0.5, 1, -1]
    # N = 1 + 3 + 2 + 2 = 8; token mean mu = (0.5*1 - 0.5*3 + 1*2 - 1*2) / 8 = -1/8 = -0.125
    # x - mu = [0.625, -0.375, 1.125, -0.875]; squares [0.390625, 0.140625, 1.265625, 0.765625]
    # sum n (x - mu)^2 = 0.390625 + 3*0.140625 + 2*1.265625 + 2*0.765625 = 4.875
    # var = 4.875 / (8 - 1) = 0.6964285714, std = 0.8345229603
    # A = (x - mu) / (0.8345229603 + 1e-4) = [0.7488, -0.4493, 1.3479, -1.0484]
    r, g = torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.tensor([0, 0, 1, 1])
    n = torch.tensor([1, 3, 2, 2])
    sd = math.sqrt(4.875 / 7)
    assert abs(sd - 0.8345229603) < 1e-9
    want = torch.tensor([0.625, -0.375, 1.125, -0.875]) / (sd + 1e-4)
    torch.testing.assert_close(want, torch.tensor([0.74883, -0.44930, 1.34790, -1.04836]), atol=1e-4, rtol=0)
    a = adv.reinforce_pp(r, g, whiten_over="tokens", num_actions=n)
    torch.testing.assert_close(a, want, atol=1e-6, rtol=0)
    # the same batch whitened over samples: mu = 0, var = (0.25 + 0.25 + 1 + 1) / 3 = 5/6, std 0.9128709
    # A = [0.5, -0.5, 1, -1] / (0.9128709 + 1e-4) = [0.54766, -0.54766, 1.09533, -1.09533]
    s = adv.reinforce_pp(r, g, num_actions=n)  # num_actions is ignored by the default "samples"
    torch.testing.assert_close(s, torch.tensor([0.54766, -0.54766, 1.09533, -1.09533]), atol=1e-4, rtol=0)
    torch.testing.assert_close(adv.reinforce_pp(r, g), s, atol=0, rtol=0)


def test_gdpo_hand_worked():
    # one group, comp1 [1,0,0], comp2 [0,0,1]: each has mean 1/3, unbiased std 0.57735;
    # A_hat1 = [0.6667, -0.3333, -0.3333] / 0.57745 = [1.15450, -0.57725, -0.57725], A_hat2 mirrored;
    # A_pre = [0.57725, -1.15450, 0.57725] = a * [1, -2, 1]; batch std = a * sqrt(3) = 0.99983
    # A = A_pre / (0.99983 + 1e-4) = [0.57729, -1.15459, 0.57729]
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
    a = adv.gdpo(r, torch.tensor([1, 1, 1]))
    torch.testing.assert_close(a, torch.tensor([0.57729, -1.15459, 0.57729]), atol=1e-4, rtol=0)


def test_mc_grpo_hand_worked():
    # G + 1 = 5 rewards [0.2, 1.0, 0.5, 0.5, 0.0]: sorted [0, .2, .5, .5, 1] -> median 0.5;
    # |r - m| = [.3, .5, 0, 0, .5] -> sorted [0, 0, .3, .5, .5] -> MAD = 0.3 + 1e-3 = 0.301
    # A = [-.3, .5, 0, 0, -.5] / .301 = [-0.99668, 1.66113, 0, 0, -1.66113]
    # 3 non-zero -> x 5/3: [-1.66113, 2.76855, 0, 0, -2.76855]; pivot = index 2 (lowest at the median)
    r, g = torch.tensor([0.2, 1.0, 0.5, 0.5, 0.0]), torch.zeros(5, dtype=torch.long)
    a = adv.mc_grpo(r, g)
    torch.testing.assert_close(a, torch.tensor([-1.66113, 2.76855, 0.0, 0.0, -2.76855]), atol=1e-4, rtol=0)
    keep = adv.loss_sample_mask("mc_grpo", r, g)
    assert keep.tolist() == [True, True, False, True, True]
    # even count (lower median): [3, 1, 2, 4] -> median 2 (not 2.5), |dev| [1, 1, 0, 2] -> MAD 1 + 1e-3
    # A = [1, -1, 0, 2] / 1.001, 3 non-zero -> x 4/3 = [1.33200, -1.33200, 0, 2.66400]; pivot index 2
    r = torch.tensor([3.0, 1.0, 2.0, 4.0])
    torch.testing.assert_close(
        adv.mc_grpo(r, torch.zeros(4, dtype=torch.long)), torch.tensor([1.332001, -1.332001, 0.0, 2.664002])
    )
    assert adv.loss_sample_mask("mc_grpo", r, torch.zeros(4, dtype=torch.long)).tolist() == [
        True,
        True,
        False,
        True,
    ]


def test_ngrpo_hand_worked():
    # all-wrong group [0, 0, 0] + one virtual 1: mean 0.25, unbiased var (3 * 0.0625 + 0.5625)/3 = 0.25,
    # std 0.5 -> A = -0.25 / (0.5 + 1e-6) = -0.4999990 (GRPO would give 0)
    a = adv.ngrpo(torch.tensor([0.0, 0.0, 0.0]), torch.zeros(3, dtype=torch.long))
    torch.testing.assert_close(a, torch.full((3,), -0.499999), atol=1e-6, rtol=0)
    # the NGRPO paper's case study: 8 samples, one correct -> A(correct) = 1.76, A(wrong) = -0.50
    r = torch.tensor([1.0] + [0.0] * 7)
    a = adv.ngrpo(r, torch.zeros(8, dtype=torch.long))
    assert round(a[0].item(), 2) == 1.76 and round(a[1].item(), 2) == -0.50


def test_pass_at_k_hand_worked():
    g = torch.zeros(3, dtype=torch.long)
    # [0.2, 0.9, 0.5]: best is index 1, gap 0.9 - 0.5 = 0.4
    torch.testing.assert_close(adv.pass_at_k(torch.tensor([0.2, 0.9, 0.5]), g), torch.tensor([0.0, 0.4, 0.0]))
    # normalize: unbiased std of [.2, .9, .5] = sqrt(0.246667 / 2) = 0.351188 -> 0.4 / 0.351288 = 1.138667
    a = adv.pass_at_k(torch.tensor([0.2, 0.9, 0.5]), g, normalize=True)
    torch.testing.assert_close(a, torch.tensor([0.0, 1.138667, 0.0]), atol=1e-5, rtol=0)
    # tie for first -> everyone 0
    assert adv.pass_at_k(torch.tensor([1.0, 1.0, 0.0]), g).abs().sum() == 0


def test_a_grae_hand_worked():
    # group 0 (easy) [1, 1, 1, 0]: mean .75, unbiased std .5 -> grpo [.25, .25, .25, -.75] / .5001
    #   = [0.49990, 0.49990, 0.49990, -1.49970]
    # group 1 (hard) [0, 0, 0, 1]: mean .25 -> grpo [-0.49990, -0.49990, -0.49990, 1.49970]
    # progress 0: beta_pos = 0.6; easiness 1 and 0 -> weights 1 + .5 * 1 * (+1) = 1.5 and 0.5:
    #   easy: [.4999 * .6 * 1.5, ..., -1.4997 * 1.5] = [0.44991, ..., -2.24955]
    #   hard: [-.4999 * .5, ..., 1.4997 * .6 * .5] = [-0.24995, ..., 0.44991]
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    a = adv.a_grae(r, g, progress=0.0)
    want = [0.44991] * 3 + [-2.24955] + [-0.24995] * 3 + [0.44991]
    torch.testing.assert_close(a, torch.tensor(want), atol=1e-4, rtol=0)
    # progress 1: beta_pos = 0.9; the weights swap (hard group 1.5, easy 0.5)
    #   easy: [.4999 * .9 * .5, ..., -1.4997 * .5] = [0.22496, ..., -0.74985]
    #   hard: [-.4999 * 1.5, ..., 1.4997 * .9 * 1.5] = [-0.74985, ..., 2.02460]
    a = adv.a_grae(r, g, progress=1.0)
    want = [0.22496] * 3 + [-0.74985] + [-0.74985] * 3 + [2.02460]
    torch.testing.assert_close(a, torch.tensor(want), atol=1e-4, rtol=0)
    assert "our design" in adv.describe("a_grae")


# =========================================================================== reinforce_pp whiten_over="tokens"


def _random_counts(rng: random.Random, b: int) -> list[int]:
    return [rng.choice([0, 1, 2, 5, 17, 40]) if rng.random() < 0.15 else rng.randint(1, 60) for _ in range(b)]


def test_reinforce_pp_tokens_matches_plain_python_references():
    rng = random.Random(21)
    for case_idx, (rows, gids, weights, _k) in enumerate(random_cases(seed=23, n=60)):
        counts = _random_counts(rng, len(gids))
        r, g = to_tensors(rows, gids, k_dim=True)
        for eps in (1e-4, 1e-2, 0.0):
            n = torch.tensor(counts, dtype=torch.long if case_idx % 2 else torch.float64)
            got = adv.reinforce_pp(r, g, weights=weights, eps=eps, whiten_over="tokens", num_actions=n)
            want = ref_reinforce_pp_tokens(rows, gids, weights, counts, eps=eps)
            verl = ref_reinforce_pp_verl_tokens(rows, gids, weights, counts, eps=eps)
            assert got.dtype == torch.float64 and torch.isfinite(got).all()
            torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(got, torch.tensor(verl, dtype=torch.float64), rtol=1e-9, atol=1e-9)
            # samples mode ignores num_actions and matches its own reference
            got_s = adv.reinforce_pp(r, g, weights=weights, eps=eps, whiten_over="samples", num_actions=n)
            want_s = ref_reinforce_pp(rows, gids, weights, eps=eps)
            torch.testing.assert_close(got_s, torch.tensor(want_s, dtype=torch.float64), rtol=1e-9, atol=1e-9)


def test_reinforce_pp_tokens_nan_reward_singleton_group_and_zero_counts():
    # group 7: [1, NaN, 0, 1] (NaN excluded); group 3: singleton [5] (ineligible); group 2: [2, 0] where
    # the 0-reward sample has no actions: it still sets the group mean (1) but gets 0 and no weight.
    rows = [[1.0], [NAN], [0.0], [1.0], [5.0], [2.0], [0.0]]
    gids = [7, 7, 7, 7, 3, 2, 2]
    counts = [4, 9, 1, 6, 30, 3, 0]
    r, g = to_tensors(rows, gids, k_dim=False)
    for eps in (1e-4, 0.0):
        a = adv.reinforce_pp(r, g, eps=eps, whiten_over="tokens", num_actions=torch.tensor(counts))
        want = ref_reinforce_pp_tokens(rows, gids, [1.0], counts, eps=eps)
        verl = ref_reinforce_pp_verl_tokens(rows, gids, [1.0], counts, eps=eps)
        assert all(abs(u - v) < 1e-12 for u, v in zip(want, verl, strict=True))
        torch.testing.assert_close(a, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)
        assert a[1] == 0 and a[4] == 0 and a[6] == 0 and (a[[0, 2, 3, 5]] != 0).all()
    # float32 input: float32 output, close to the float64 reference
    a32 = adv.reinforce_pp(r.float(), g, whiten_over="tokens", num_actions=torch.tensor(counts))
    assert a32.dtype == torch.float32
    torch.testing.assert_close(
        a32, torch.tensor(ref_reinforce_pp_tokens(rows, gids, [1.0], counts), dtype=torch.float32)
    )
    # fewer than 2 actions in the eligible samples (N < 2): all 0; one eligible sample with actions: 0
    two = torch.tensor([1.0, 0.0])
    zero2 = torch.zeros(2)
    assert torch.equal(
        adv.reinforce_pp(two, torch.tensor([0, 0]), whiten_over="tokens", num_actions=[1, 0]), zero2
    )
    assert torch.equal(
        adv.reinforce_pp(two, torch.tensor([0, 0]), whiten_over="tokens", num_actions=[5, 0]), zero2
    )
    assert torch.equal(
        adv.reinforce_pp(two, torch.tensor([0, 0]), whiten_over="tokens", num_actions=[0, 0]), zero2
    )
    # an empty batch
    e = adv.reinforce_pp(
        torch.zeros(0), torch.zeros(0, dtype=torch.long), whiten_over="tokens", num_actions=[]
    )
    assert e.shape == (0,)


def test_reinforce_pp_tokens_with_equal_counts_vs_samples():
    """All n_i = n, M eligible samples: same mean; var_tokens = n * S / (n M - 1), var_samples = S / (M - 1)
    with S = sum (x_i - mu)^2. So n = 1 gives exactly the samples result (any eps), and for eps = 0
    A_tokens = A_samples * sqrt((n M - 1) / (n (M - 1))), which tends to sqrt(M / (M - 1)) (whitening by
    the population std) as n grows."""
    rng = random.Random(5)
    for rows, gids, weights, _k in random_cases(seed=31, n=30):
        r, g = to_tensors(rows, gids, k_dim=True)
        _x, selected = ref_centred(rows, gids, weights)
        m = len(selected)
        for eps in (1e-4, 0.0):
            samples = adv.reinforce_pp(r, g, weights=weights, eps=eps)
            ones = adv.reinforce_pp(
                r, g, weights=weights, eps=eps, whiten_over="tokens", num_actions=torch.ones(len(gids))
            )
            torch.testing.assert_close(ones, samples, rtol=1e-12, atol=1e-12)
        if m < 2:
            continue
        n = rng.randint(2, 50)
        samples = adv.reinforce_pp(r, g, weights=weights, eps=0.0)
        tokens = adv.reinforce_pp(
            r, g, weights=weights, eps=0.0, whiten_over="tokens", num_actions=torch.full((len(gids),), n)
        )
        factor = math.sqrt((n * m - 1) / (n * (m - 1)))
        assert factor > 1
        torch.testing.assert_close(tokens, samples * factor, rtol=1e-9, atol=1e-9)


def test_reinforce_pp_tokens_permutation_equivariant():
    rng = random.Random(8)
    rows, gids, weights = random_batch(rng, 2, discrete=False, nan_frac=0.1)
    counts = torch.tensor(_random_counts(rng, len(gids)))
    r, g = to_tensors(rows, gids, k_dim=True)
    base = adv.reinforce_pp(r, g, weights=weights, whiten_over="tokens", num_actions=counts)
    perm = torch.randperm(len(gids), generator=torch.Generator().manual_seed(1))
    got = adv.reinforce_pp(r[perm], g[perm], weights=weights, whiten_over="tokens", num_actions=counts[perm])
    torch.testing.assert_close(got, base[perm])


def test_reinforce_pp_whiten_over_errors():
    r, g = torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 0, 0])
    with pytest.raises(ValueError, match=r"whiten_over must be 'samples' or 'tokens', got 'token'"):
        adv.reinforce_pp(r, g, whiten_over="token")
    with pytest.raises(
        ValueError,
        match=r"reinforce_pp with whiten_over='tokens' needs num_actions \(each sample's number of valid "
        r"actions\); the trainer passes it",
    ):
        adv.reinforce_pp(r, g, whiten_over="tokens")
    with pytest.raises(ValueError, match=r"num_actions must be Long/Float\[B\] with B=3.*\(2,\)"):
        adv.reinforce_pp(r, g, whiten_over="tokens", num_actions=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"num_actions must be Long/Float\[B\].*\(3, 1\)"):
        adv.reinforce_pp(r, g, whiten_over="tokens", num_actions=torch.ones(3, 1))
    with pytest.raises(ValueError, match="num_actions must be >= 0"):
        adv.reinforce_pp(r, g, whiten_over="tokens", num_actions=torch.tensor([3, -1, 2]))
    with pytest.raises(ValueError, match="num_actions must be finite"):
        adv.reinforce_pp(r, g, whiten_over="tokens", num_actions=torch.tensor([3.0, NAN, 2.0]))
    with pytest.raises(ValueError, match="num_actions must be a Long or Float"):
        adv.reinforce_pp(r, g, whiten_over="tokens", num_actions=torch.tensor([True, False, True]))
    # num_actions is validated even when whiten_over="samples" ignores it
    with pytest.raises(ValueError, match="num_actions must be >= 0"):
        adv.reinforce_pp(r, g, num_actions=torch.tensor([3, -1, 2]))


def test_accepts_num_actions_and_trainer_call_paths():
    assert adv.accepts_num_actions("reinforce_pp") is True
    assert adv.accepts_num_actions("grpo") is False
    assert {name for name in ALL_ESTIMATORS if adv.accepts_num_actions(name)} == {"reinforce_pp"}
    with pytest.raises(RegistryError):
        adv.accepts_num_actions("grpoo")
    # num_actions is a per-batch input, not a config option
    assert adv.options("reinforce_pp") == {"weights": None, "eps": 1e-4, "whiten_over": "samples"}
    # the trainer's calls: estimator(rewards, group, **opts) and loss_sample_mask(name, rewards, group, **opts)
    r, g = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]), torch.tensor([0, 0, 0])
    opts = {"weights": [1.0, 2.0], "whiten_over": "tokens", "num_actions": torch.tensor([3, 1, 2])}
    assert adv.get("reinforce_pp")(r, g, **opts).shape == (3,)
    keep = adv.loss_sample_mask("reinforce_pp", r, g, **opts)
    assert keep.dtype == torch.bool and keep.all()
    # estimators that do not take it reject it (so the trainer must ask accepts_num_actions first)
    with pytest.raises(TypeError, match="grpo.*num_actions"):
        adv.get("grpo")(r, g, num_actions=torch.tensor([3, 1, 2]))
    with pytest.raises(TypeError, match="mc_grpo.*num_actions"):
        adv.loss_sample_mask("mc_grpo", r, g, num_actions=torch.tensor([3, 1, 2]))


# =========================================================================== API, errors, invariants


def test_registry_names_and_descriptions():
    assert set(adv.names()) == ALL_ESTIMATORS | STEP_ESTIMATORS | CONTEXT_ESTIMATORS | SEED_ESTIMATORS
    assert adv.names() == sorted(adv.names())
    for name in adv.names():
        line = adv.describe(name)
        assert line and "\n" not in line
        assert callable(adv.get(name))


def test_unknown_estimator_name():
    with pytest.raises(RegistryError, match="grpoo") as info:
        adv.get("grpoo")
    assert isinstance(info.value, KeyError)
    assert "grpo" in str(info.value)  # close-match hint


@pytest.mark.parametrize("name", sorted(ALL_ESTIMATORS))
def test_unknown_option_raises_type_error(name):
    r, g = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    with pytest.raises(TypeError, match=rf"{name}.*bogus_opt"):
        adv.get(name)(r, g, bogus_opt=1)
    with pytest.raises(TypeError, match=rf"{name}.*bogus_opt"):
        adv.loss_sample_mask(name, r, g, bogus_opt=1)


def test_bad_option_values():
    r, g = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    with pytest.raises(ValueError, match="std"):
        adv.grpo(r, g, std="global")
    with pytest.raises(ValueError, match="weights"):
        adv.grpo(torch.ones(2, 3), g, weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="progress"):
        adv.a_grae(r, g, progress=1.5)
    with pytest.raises(ValueError, match="group"):
        adv.grpo(r, torch.tensor([0, 0, 0]))
    with pytest.raises(TypeError, match="integer"):
        adv.grpo(r, torch.tensor([0.0, 0.0]))


def test_options_listing():
    assert adv.options("grpo") == {"weights": None, "std": "group", "eps": 1e-4}
    assert adv.options("ngrpo")["k"] == 1 and adv.options("ngrpo")["r_max"] == 1.0


def test_extra_samples_and_loss_masks():
    assert adv.extra_samples("mc_grpo") == 1
    for name in ALL_ESTIMATORS - {"mc_grpo"}:
        assert adv.extra_samples(name) == 0
        mask = adv.loss_sample_mask(name, torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 0, 1]))
        assert mask.dtype == torch.bool and mask.all()


def test_mc_grpo_pivot_mask_one_false_per_group():
    for rows, gids, weights, _k in random_cases(seed=11, n=60):
        r, g = to_tensors(rows, gids, k_dim=True)
        keep = adv.loss_sample_mask("mc_grpo", r, g, weights=weights)
        _, want_keep = ref_mc_grpo(rows, gids, weights)
        assert keep.tolist() == want_keep
        for gid in set(gids):
            in_group = [i for i, x in enumerate(gids) if x == gid]
            assert sum(not keep[i] for i in in_group) == 1
        # the pivot has advantage exactly 0
        a = adv.mc_grpo(r, g, weights=weights)
        assert (a[~keep] == 0).all()


@pytest.mark.parametrize("name", sorted(ALL_ESTIMATORS))
def test_never_nan_with_all_nan_groups(name):
    fn = adv.get(name)
    r = torch.tensor(
        [[NAN, NAN], [NAN, NAN], [1.0, NAN], [NAN, 0.0], [0.3, 0.1], [NAN, NAN], [float("inf"), 0.0]]
    )
    g = torch.tensor([4, 4, 2, 2, 2, 8, 2])
    a = fn(r, g)
    assert torch.isfinite(a).all()
    assert a[[0, 1, 5, 6]].abs().sum() == 0  # all-NaN samples / groups and the inf sample get 0
    # an entirely NaN batch, a single sample, and groups of one
    assert torch.equal(fn(torch.full((3,), NAN), torch.tensor([0, 0, 1])), torch.zeros(3))
    assert torch.equal(fn(torch.tensor([0.7]), torch.tensor([0])), torch.zeros(1))
    assert torch.equal(fn(torch.tensor([0.7, 0.1]), torch.tensor([0, 1])), torch.zeros(2))
    # an empty batch
    assert fn(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)
    # a constant group: finite (zero for the centred estimators)
    assert torch.isfinite(fn(torch.ones(4), torch.zeros(4, dtype=torch.long))).all()


def test_dtypes():
    g = torch.tensor([0, 0, 1, 1])
    assert adv.grpo(torch.tensor([1, 0, 1, 1]), g).dtype == torch.float32  # integer rewards
    assert adv.grpo(torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float16), g).dtype == torch.float32
    assert adv.grpo(torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64), g).dtype == torch.float64
    assert adv.combine_rewards(torch.tensor([[1, 2]])).dtype == torch.float32


def test_clip_advantages():
    a = torch.tensor([-7.0, -1.0, 0.0, 2.0, 9.0])
    assert adv.clip_advantages(a, None) is a
    torch.testing.assert_close(adv.clip_advantages(a, 5.0), torch.tensor([-5.0, -1.0, 0.0, 2.0, 5.0]))
    with pytest.raises(ValueError):
        adv.clip_advantages(a, 0.0)


def test_combine_rewards_matches_reference():
    for rows, _gids, weights, _k in random_cases(seed=5, n=20):
        got = adv.combine_rewards(torch.tensor(rows, dtype=torch.float64), weights)
        want = torch.tensor(ref_totals(rows, weights), dtype=torch.float64)
        torch.testing.assert_close(got, want, equal_nan=True)
    # Float[B] passes through as float
    torch.testing.assert_close(
        adv.combine_rewards(torch.tensor([1.0, NAN])), torch.tensor([1.0, NAN]), equal_nan=True
    )


def test_register_custom_estimator_rejects_unknown_options():
    @adv.register("_test_constant")
    def constant(rewards, group, *, value: float = 1.0):
        """Test-only estimator."""
        return torch.full(rewards.shape[:1], value)

    try:
        assert (
            adv.get("_test_constant")(torch.zeros(2), torch.zeros(2, dtype=torch.long), value=2.0)[0] == 2.0
        )
        with pytest.raises(TypeError, match="_test_constant.*nope"):
            constant(torch.zeros(2), torch.zeros(2, dtype=torch.long), nope=1)
    finally:  # keep the global registry clean for other tests
        adv.REGISTRY._items.pop("_test_constant", None)
        adv.REGISTRY._meta.pop("_test_constant", None)


def test_equal_rewards_give_exactly_zero_advantage_despite_rounding():
    # 1.0 * 0 + 0.2 * 1 = 0.2 for every sample; float rounding of the group mean must not leak
    # through eps = 1e-4 into advantages of ~1e-4 (seen in a real run before the fix).
    r = torch.tensor([[0.0, 1.0]] * 8)
    g = torch.zeros(8, dtype=torch.long)
    for name in ("grpo", "dr_grpo", "rloo"):
        assert torch.equal(adv.get(name)(r, g, weights=[1.0, 0.2]), torch.zeros(8)), name


# =========================================================================== step rewards: grpo_process


def ref_grpo_process(rows, gids, weights, steps, mask, std="group", eps=1e-4, process_coef=1.0):
    """Plain-Python grpo_process: ref_grpo per sample + c * (s - mean) / (stdev + eps) per (group, step)."""
    outcome = ref_grpo(rows, gids, weights, std=std, eps=eps)
    n_steps = len(steps[0]) if steps else 0
    out = [[0.0] * n_steps for _ in steps]
    for idxs in ref_groups(gids).values():
        for t in range(n_steps):
            members = [i for i in idxs if mask[i][t] and math.isfinite(steps[i][t])]
            if len(members) >= 2:
                vals = [steps[i][t] for i in members]
                mean, sd = statistics.fmean(vals), statistics.stdev(vals)
            for i in idxs:
                if not mask[i][t]:
                    continue  # masked actions get 0
                proc = 0.0
                if i in members and len(members) >= 2 and sd + eps > 0:
                    proc = (steps[i][t] - mean) / (sd + eps)
                out[i][t] = outcome[i] + process_coef * proc
    return out


def random_steps(rng: random.Random, b: int, discrete: bool):
    """(steps B x T with some NaN, mask B x T with a random number of valid leading actions)."""
    n_steps = rng.randint(1, 5)

    def value():
        if rng.random() < 0.1:
            return NAN
        return rng.choice([0.0, 0.5, 1.0]) if discrete else rng.gauss(0.0, 1.0)

    steps = [[value() for _ in range(n_steps)] for _ in range(b)]
    lengths = [rng.randint(0, n_steps) for _ in range(b)]
    mask = [[t < n for t in range(n_steps)] for n in lengths]
    return steps, mask


def test_grpo_process_hand_worked():
    # Two groups (ids 7 and 3) x 3 samples x T = 2 steps. Outcome rewards: K = 2 columns laid out as
    # RewardSet builds them (column 0 an outcome reward, column 1 the per-step reward's mean, whose
    # outcome weight is 0). eps = 0, process_coef c = 0.5.
    #
    # Outcome (= grpo, unbiased group std):
    #   group 7: r = [0, 1, 2]    mean 1, sd sqrt((1 + 0 + 1) / 2) = 1          -> A_out = [-1, 0, 1]
    #   group 3: r = [1, 3, NaN]  mean 2, sd sqrt((1 + 1) / 1) = sqrt(2)        -> A_out = [-1/sqrt2, 1/sqrt2, 0]
    # Process, per (group, step) over the samples valid there:
    #   group 7, t=0: s = [1, 3, 5]  mean 3, sd sqrt((4 + 0 + 4) / 2) = 2       -> [-1, 0, 1]
    #   group 7, t=1: s = [2, 2, 2]  zero std                                   -> [0, 0, 0]
    #   group 3, t=0: s = [0, 6, 6]  mean 4, sd sqrt((16 + 4 + 4) / 2) = 2 sqrt3 -> [-2/sqrt3, 1/sqrt3, 1/sqrt3]
    #   group 3, t=1: sample 5 masked (its 100 ignored), sample 4 NaN: 1 valid   -> [0, 0, -]
    # A = A_out + 0.5 * A_proc at valid actions, 0 at masked ones:
    r2, r3 = 1 / math.sqrt(2), 1 / math.sqrt(3)
    expected = [
        [-1.0 - 0.5, -1.0],
        [0.0, 0.0],
        [1.0 + 0.5, 1.0],
        [-r2 - 0.5 * 2 * r3, -r2],  # -1.284457, -0.707107
        [r2 + 0.5 * r3, r2],  # 0.995782, 0.707107 (its own step reward is NaN: process part 0)
        [0.5 * r3, 0.0],  # NaN outcome -> 0, then + 0.288675; step 1 masked -> 0
    ]
    rewards = torch.tensor([[0.0, 9.0], [1.0, 9.0], [2.0, 9.0], [1.0, 9.0], [3.0, 9.0], [NAN, 9.0]])
    group = torch.tensor([7, 7, 7, 3, 3, 3])
    steps = torch.tensor([[1.0, 2.0], [3.0, 2.0], [5.0, 2.0], [0.0, 2.0], [6.0, NAN], [6.0, 100.0]])
    mask = torch.tensor([[True, True]] * 5 + [[True, False]])
    got = adv.grpo_process(
        rewards, group, step_rewards=steps, step_mask=mask, weights=[1.0, 0.0], eps=0.0, process_coef=0.5
    )
    assert got.dtype == torch.float32 and got.shape == (6, 2)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-6, atol=1e-6)
    # the independent plain-Python reference agrees on the same example
    want = ref_grpo_process(
        rewards.tolist(), group.tolist(), [1.0, 0.0], steps.tolist(), mask.tolist(), eps=0.0, process_coef=0.5
    )
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-6)


def test_grpo_process_matches_plain_python_reference():
    rng = random.Random(21)
    option_sets = [
        {},
        {"process_coef": 0.3},
        {"std": "batch"},
        {"std": "none", "process_coef": 2.0},
        {"eps": 0.0},
    ]
    for case, (rows, gids, weights, _k) in enumerate(random_cases(seed=17, n=30)):
        steps, mask = random_steps(rng, len(gids), discrete=case % 2 == 0)
        for opts in option_sets:
            got = adv.get("grpo_process")(
                torch.tensor(rows, dtype=torch.float64),
                torch.tensor(gids),
                step_rewards=torch.tensor(steps, dtype=torch.float64),
                step_mask=torch.tensor(mask),
                weights=weights,
                **opts,
            )
            want = ref_grpo_process(rows, gids, weights, steps, mask, **opts)
            assert got.dtype == torch.float64 and got.shape == (len(gids), len(steps[0]))
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)


def test_grpo_process_outcome_part_is_grpo_broadcast():
    rng = random.Random(5)
    for rows, gids, weights, _k in random_cases(seed=9, n=10):
        steps, mask = random_steps(rng, len(gids), discrete=False)
        r, g = to_tensors(rows, gids, k_dim=True)
        m = torch.tensor(mask)
        base = adv.grpo(r, g, weights=weights, std="batch")
        # process_coef = 0, or step rewards that are equal within every (group, step): A = grpo at valid actions
        for s, c in ((torch.tensor(steps, dtype=torch.float64), 0.0), (torch.ones(m.shape), 1.0)):
            got = adv.grpo_process(
                r, g, step_rewards=s, step_mask=m, weights=weights, std="batch", process_coef=c
            )
            torch.testing.assert_close(
                got, torch.where(m, base[:, None], torch.zeros(m.shape, dtype=base.dtype))
            )


def test_grpo_process_needs_step_rewards_and_validates():
    r, g = torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 0, 0])
    s, m = torch.zeros(3, 2), torch.ones(3, 2, dtype=torch.bool)
    with pytest.raises(ValueError) as info:
        adv.get("grpo_process")(r, g)
    assert str(info.value) == "grpo_process needs step rewards: no reward in the config declares per_step"
    with pytest.raises(ValueError, match="grpo_process needs step_mask"):
        adv.grpo_process(r, g, step_rewards=s)
    with pytest.raises(ValueError, match=r"step_rewards must be Float\[B, T\] with B=3.*\(2, 2\)"):
        adv.grpo_process(r, g, step_rewards=torch.zeros(2, 2), step_mask=m)
    with pytest.raises(ValueError, match=r"step_rewards must be Float\[B, T\].*\(3,\)"):
        adv.grpo_process(r, g, step_rewards=torch.zeros(3), step_mask=m)
    with pytest.raises(ValueError, match=r"step_mask \(3, 1\) and step_rewards \(3, 2\) differ"):
        adv.grpo_process(r, g, step_rewards=s, step_mask=m[:, :1])
    with pytest.raises(ValueError, match="step_mask must be a Bool"):
        adv.grpo_process(r, g, step_rewards=s, step_mask=torch.ones(3, 2))
    with pytest.raises(ValueError, match="process_coef"):
        adv.grpo_process(r, g, step_rewards=s, step_mask=m, process_coef=-1.0)
    with pytest.raises(ValueError, match="std"):
        adv.grpo_process(r, g, step_rewards=s, step_mask=m, std="global")
    with pytest.raises(TypeError, match="grpo_process.*bogus"):
        adv.grpo_process(r, g, step_rewards=s, step_mask=m, bogus=1)
    # empty batch and T = 0
    assert adv.grpo_process(
        torch.zeros(0),
        torch.zeros(0, dtype=torch.long),
        step_rewards=torch.zeros(0, 4),
        step_mask=torch.zeros(0, 4, dtype=torch.bool),
    ).shape == (0, 4)
    assert adv.grpo_process(
        r, g, step_rewards=torch.zeros(3, 0), step_mask=torch.zeros(3, 0, dtype=torch.bool)
    ).shape == (3, 0)


def test_accepts_step_rewards_and_trainer_call_paths():
    assert adv.accepts_step_rewards("grpo_process") is True
    assert {name for name in adv.names() if adv.accepts_step_rewards(name)} == STEP_ESTIMATORS
    assert not adv.accepts_num_actions("grpo_process")
    with pytest.raises(RegistryError):
        adv.accepts_step_rewards("grpoo")
    # step_rewards / step_mask are per-batch inputs, not config options
    assert adv.options("grpo_process") == {"weights": None, "std": "group", "eps": 1e-4, "process_coef": 1.0}
    # the trainer's calls: estimator, loss_sample_mask and clip_advantages with the same opts
    r = torch.tensor([[1.0, 0.2], [0.0, 0.4], [0.5, 0.9], [1.0, 0.0]])
    g = torch.tensor([0, 0, 0, 1])
    s = torch.tensor([[1.0, 0.0, 5.0], [0.0, 0.0, 0.0], [0.5, 3.0, 0.0], [2.0, 2.0, 2.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    opts = {"weights": [1.0, 0.0], "step_rewards": s, "step_mask": m, "process_coef": 10.0}
    a = adv.get("grpo_process")(r, g, **opts)
    assert a.shape == (4, 3) and a.dtype == torch.float32
    assert (a[~m] == 0).all() and (a[3] == 0).all()  # masked actions, and a group of one sample
    keep = adv.loss_sample_mask("grpo_process", r, g, **opts)
    assert keep.dtype == torch.bool and keep.shape == (4,) and keep.all()
    clipped = adv.clip_advantages(a, 2.0)
    assert clipped.shape == (4, 3)
    torch.testing.assert_close(clipped, a.clamp(-2.0, 2.0))
    assert clipped.abs().max() == 2.0  # |c * A_proc| reaches 10 * 1/sqrt(2) > 2 in group 0, step 0
    # estimators without the metadata reject the keywords (the trainer must ask accepts_step_rewards)
    for name in ALL_ESTIMATORS:
        assert adv.accepts_step_rewards(name) is False
        with pytest.raises(TypeError, match=rf"{name}.*step_mask.*step_rewards"):
            adv.get(name)(r, g, step_rewards=s, step_mask=m)


def test_grpo_unchanged_regression():
    # r = [0, 1, 2] in one group, [5, 5] in another: mean 1, unbiased sd 1 -> (r - 1) / (1 + 1e-4);
    # the constant group gets exactly 0. One advantage per sample, Float[B].
    a = adv.grpo(torch.tensor([0.0, 1.0, 2.0, 5.0, 5.0]), torch.tensor([0, 0, 0, 1, 1]))
    assert a.shape == (5,) and a.dtype == torch.float32
    torch.testing.assert_close(a, torch.tensor([-1 / 1.0001, 0.0, 1 / 1.0001, 0.0, 0.0]))
    # every outcome estimator still returns Float[B]
    r, g = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]), torch.tensor([0, 0, 0])
    for name in ALL_ESTIMATORS:
        assert adv.get(name)(r, g).shape == (3,), name


def test_grpo_process_permutation_and_relabelling_equivariant():
    rng = random.Random(8)
    rows, gids, weights = random_batch(rng, 2, discrete=False, nan_frac=0.1)
    steps, mask = random_steps(rng, len(gids), discrete=False)
    r, g = to_tensors(rows, gids, k_dim=True)
    s, m = torch.tensor(steps, dtype=torch.float64), torch.tensor(mask)
    base = adv.grpo_process(r, g, step_rewards=s, step_mask=m, weights=weights)
    perm = torch.randperm(len(gids), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        adv.grpo_process(r[perm], g[perm], step_rewards=s[perm], step_mask=m[perm], weights=weights),
        base[perm],
    )
    torch.testing.assert_close(
        adv.grpo_process(r, g * 7 - 1000, step_rewards=s, step_mask=m, weights=weights), base
    )


def test_combine_rewards_zero_weight_columns_do_not_make_a_sample_applicable():
    # columns: outcome a (w 2), outcome b (w 1), per-step mean p (outcome weight 0, as in RewardSet.weights)
    r = torch.tensor(
        [
            [1.0, 3.0, 7.0],  # 2*1 + 3 = 5 (p adds 0)
            [NAN, 3.0, 7.0],  # 3
            [NAN, NAN, 7.0],  # every weighted column NaN -> NaN (p does not make it applicable)
            [NAN, NAN, NAN],  # NaN
        ]
    )
    torch.testing.assert_close(
        adv.combine_rewards(r, [2.0, 1.0, 0.0]), torch.tensor([5.0, 3.0, NAN, NAN]), equal_nan=True
    )
    # every weight 0 (a config whose rewards are all per-step): total 0, NaN only where all are NaN
    torch.testing.assert_close(
        adv.combine_rewards(r, [0.0, 0.0, 0.0]), torch.tensor([0.0, 0.0, 0.0, NAN]), equal_nan=True
    )
    # grpo skips the sample whose weighted columns are all NaN: group [5, 3, NaN] -> mean 4,
    # unbiased sd sqrt(2), A = [1/sqrt2, -1/sqrt2, 0] (eps = 0)
    a = adv.grpo(r[:3], torch.tensor([0, 0, 0]), weights=[2.0, 1.0, 0.0], eps=0.0)
    torch.testing.assert_close(a, torch.tensor([1 / math.sqrt(2), -1 / math.sqrt(2), 0.0]))


# =========================================================================== estimators with a context
# Plain-Python references written from each method's formula (lists, dicts, statistics), and
# hand-worked numbers. The registry, validation and state protocol are in test_estimator_context.py.


def test_context_estimators_declared():
    assert adv.accepts_num_actions("drpo") and adv.accepts_num_actions("canon")
    assert not adv.accepts_num_actions("spo") and not adv.accepts_num_actions("gigpo")
    assert adv.make_state("spo") is not None


# ----------------------------------------------------------------------- SPO
def ref_spo_run(batches, rho_mode="kl", rho=0.96, rho_min=0.875, rho_max=0.96, d_half=0.06, eps=1e-8):
    """SPO from the formula over a sequence of batches: tracker dict pid -> [alpha, beta, visits]."""
    table = {}
    outs = []
    for r, pids, shifts in batches:
        p_hat = []
        for x in pids:
            a, b, _ = table.get(x, [0.5, 0.5, 0])
            p_hat.append(a / (a + b))
        raw = [0.0 if math.isnan(ri) else ri - p for ri, p in zip(r, p_hat, strict=True)]
        valid = [i for i, ri in enumerate(r) if not math.isnan(ri)]
        outs.append(ref_whiten(raw, valid, eps))
        for x in sorted({pids[i] for i in valid}):
            members = [i for i in valid if pids[i] == x]
            a, b, v = table.get(x, [0.5, 0.5, 0])
            if rho_mode == "constant":
                rx = rho
            elif v == 0:
                rx = min(max(1.0, rho_min), rho_max)
            else:
                d = statistics.fmean(shifts[i] for i in members)
                rx = min(max(2 ** (-d / d_half), rho_min), rho_max)
            clamped = [min(max(r[i], 0.0), 1.0) for i in members]
            table[x] = [rx * a + sum(clamped), rx * b + sum(1 - c for c in clamped), v + 1]
        outs[-1] = outs[-1]
    return outs, table


def random_spo_batches(rng, steps, continuous=False):
    batches = []
    for _ in range(steps):
        pids, r, shifts, gids = [], [], [], []
        for k, x in enumerate(rng.sample(range(10), rng.randint(1, 5))):
            d = rng.random() * 0.3
            for _ in range(rng.randint(1, 4)):
                pids.append(x)
                gids.append(k)
                if rng.random() < 0.1:
                    r.append(NAN)
                else:
                    r.append(rng.uniform(-0.5, 1.5) if continuous else float(rng.random() < 0.4))
                shifts.append(d)
        batches.append((r, pids, shifts, gids))
    return batches


@pytest.mark.parametrize("rho_mode", ["kl", "constant"])
@pytest.mark.parametrize("continuous", [False, True])
def test_spo_matches_plain_python_reference(rho_mode, continuous):
    rng = random.Random(5 + continuous)
    batches = random_spo_batches(rng, 12, continuous)
    want, table = ref_spo_run([(r, p, s) for r, p, s, _ in batches], rho_mode=rho_mode)
    state = SPOTracker()
    for (r, pids, shifts, gids), w in zip(batches, want, strict=True):
        ctx = EstimatorContext(
            prompt_ids=torch.tensor(pids), policy_shift=torch.tensor(shifts, dtype=torch.float64)
        )
        got = adv.spo(
            torch.tensor(r, dtype=torch.float64),
            torch.tensor(gids),
            context=ctx,
            state=state,
            rho_mode=rho_mode,
        )
        torch.testing.assert_close(got, torch.tensor(w, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    for x, (a, b, v) in table.items():
        assert state.posterior(x) == pytest.approx((a, b), abs=1e-12) and state.visits(x) == v


def test_spo_hand_worked():
    # prompt 4 seen before: Beta(3, 1) -> p_hat 0.75; prompt 9 new: Beta(0.5, 0.5) -> 0.5
    state = SPOTracker()
    state.set(4, 3.0, 1.0, 2)
    r = torch.tensor([1.0, 0.0, 1.0])
    ctx = EstimatorContext(prompt_ids=torch.tensor([4, 4, 9]), policy_shift=torch.tensor([0.06, 0.06, 0.0]))
    a = adv.spo(r, torch.tensor([0, 0, 1]), context=ctx, state=state, normalize=False)
    torch.testing.assert_close(a, torch.tensor([0.25, -0.75, 0.5]))
    # D = 0.06 = d_half -> rho = 2^-1 = 0.5, clipped to rho_min 0.875: alpha = 0.875 * 3 + 1, beta = 0.875 + 1
    assert state.posterior(4) == pytest.approx((3.625, 1.875))
    # first visit: rho = rho_max = 0.96: alpha = 0.48 + 1, beta = 0.48
    assert state.posterior(9) == pytest.approx((1.48, 0.48))
    # normalised: z-score of [0.25, -0.75, 0.5]: mean 0, unbiased sd sqrt((1/16 + 9/16 + 1/4) / 2)
    state2 = SPOTracker()
    state2.set(4, 3.0, 1.0, 2)
    z = adv.spo(r, torch.tensor([0, 0, 1]), context=ctx, state=state2)
    sd = math.sqrt((0.0625 + 0.5625 + 0.25) / 2)
    torch.testing.assert_close(z, torch.tensor([0.25, -0.75, 0.5]) / (sd + 1e-8))


def test_spo_groups_of_one_and_validation():
    # group-free: a single sample per prompt still gets a signal (unlike every group-relative estimator)
    state = SPOTracker()
    ctx = EstimatorContext(prompt_ids=torch.tensor([0, 1, 2]))
    a = adv.spo(
        torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 1, 2]), context=ctx, state=state, rho_mode="constant"
    )
    assert (a != 0).all()
    with pytest.raises(ValueError, match="rho_mode"):
        adv.spo(torch.ones(3), torch.tensor([0, 1, 2]), context=ctx, state=state, rho_mode="ema")
    with pytest.raises(ValueError, match="rho_min"):
        adv.spo(torch.ones(3), torch.tensor([0, 1, 2]), context=ctx, state=state, rho_min=0.99)
    bad = EstimatorContext(prompt_ids=torch.tensor([0, 1, 2]), policy_shift=torch.tensor([0.0, -1.0, 0.0]))
    with pytest.raises(adv.ContextError, match="policy_shift"):
        adv.spo(torch.ones(3), torch.tensor([0, 1, 2]), context=bad, state=state)


# ----------------------------------------------------------------------- GiGPO
def ref_gigpo(
    r, gids, turn_index, turn_state, turn_rewards, gamma=0.95, omega=1.0, mode="mean_std_norm", eps=1e-6
):
    b = len(r)
    n_turns = [max([t for t in row if t >= 0], default=-1) + 1 for row in turn_index]
    per_turn_r, returns, episode = [], [], []
    for i in range(b):
        rr = []
        for k in range(n_turns[i]):
            x = 0.0 if turn_rewards is None else turn_rewards[i][k]
            rr.append(0.0 if math.isnan(x) else x)
        if n_turns[i]:
            rr[-1] += 0.0 if math.isnan(r[i]) else r[i]
        per_turn_r.append(rr)
        g = []
        for k in range(n_turns[i]):
            g.append(sum(gamma ** (kk - k) * rr[kk] for kk in range(k, n_turns[i])))
        returns.append(g)
        episode.append(sum(rr) if n_turns[i] else (0.0 if math.isnan(r[i]) else r[i]))
    valid = [not math.isnan(x) for x in r]

    def norm(xs):
        if len(xs) < 2:
            return [0.0] * len(xs)
        mu, sd = statistics.fmean(xs), statistics.stdev(xs)
        return [(x - mu) if mode == "mean_norm" else (x - mu) / (sd + eps) for x in xs]

    a_ep = [0.0] * b
    for idxs in ref_groups(gids).values():
        members = [i for i in idxs if valid[i]]
        for i, v in zip(members, norm([episode[i] for i in members]), strict=True):
            a_ep[i] = v
    cells = {}
    for i in range(b):
        if valid[i]:
            for k in range(n_turns[i]):
                cells.setdefault((gids[i], turn_state[i][k]), []).append((i, k))
    a_step = {}
    for members in cells.values():
        for (i, k), v in zip(members, norm([returns[i][k] for i, k in members]), strict=True):
            a_step[(i, k)] = v
    out = []
    for i in range(b):
        row = []
        for t in turn_index[i]:
            row.append(a_ep[i] + omega * a_step[(i, t)] if (t >= 0 and valid[i]) else 0.0)
        out.append(row)
    return out


def test_gigpo_hand_worked():
    # three trajectories of one group, gamma 0.5, eps 0 (worked in the comments of each line):
    # A: states s0, s1; outcome 1 -> R = [0, 1], G = [0.5, 1], E = 1
    # B: states s0, s2; outcome 0 -> R = [0, 0], G = [0, 0], E = 0
    # C: states s0, s1, s1; outcome 1, turn rewards [0, -0.5, 0] -> R = [0, -0.5, 1], G = [0, 0, 1], E = 0.5
    # episode: mean 0.5, sd 0.5 -> A_E = [1, -1, 0]
    # cell s0: G = [0.5, 0, 0] -> mean 1/6, sd sqrt(1/12) -> [1.1547, -0.57735, -0.57735]
    # cell s1: G = [1 (A), 0 (C1), 1 (C2)] -> mean 2/3, sd sqrt(1/3) -> [0.57735, -1.1547, 0.57735]; s2: alone -> 0
    turn_index = torch.tensor([[0, 0, 1, -1, -1], [0, 1, 1, -1, -1], [0, -1, 1, 2, 2]])
    turn_state = torch.tensor([[0, 1, 7], [0, 2, 7], [0, 1, 1]])
    ctx = EstimatorContext(
        turn_index=turn_index,
        turn_state=turn_state,
        turn_rewards=torch.tensor([[0.0, 0, 0], [0, 0, 0], [0, -0.5, 0]]),
    )
    a = adv.gigpo(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 0]), context=ctx, gamma=0.5, eps=0.0)
    s3 = 1 / math.sqrt(3)
    want = torch.tensor(
        [
            [1 + 2 * s3, 1 + 2 * s3, 1 + s3, 0, 0],
            [-1 - s3, -1, -1, 0, 0],
            [-s3, 0, -2 * s3, s3, s3],
        ]
    )
    torch.testing.assert_close(a, want, atol=1e-5, rtol=0)
    # step_weight 0: the episode advantage broadcast over the actions
    a0 = adv.gigpo(
        torch.tensor([1.0, 0.0, 1.0]),
        torch.tensor([0, 0, 0]),
        context=ctx,
        gamma=0.5,
        eps=0.0,
        step_weight=0.0,
    )
    torch.testing.assert_close(a0, torch.where(turn_index >= 0, torch.tensor([1.0, -1.0, 0.0])[:, None], 0.0))


@pytest.mark.parametrize("mode", ["mean_std_norm", "mean_norm"])
def test_gigpo_matches_plain_python_reference(mode):
    rng = random.Random(11)
    for case in range(25):
        b, width, t = rng.randint(2, 9), rng.randint(1, 4), rng.randint(1, 10)
        gids = [rng.choice([3, -1, 8]) for _ in range(b)]
        r = [NAN if rng.random() < 0.1 else float(rng.choice([0, 1, 0.5])) for _ in range(b)]
        turn_index = []
        for _ in range(b):
            n = rng.randint(0, min(width, t))
            cuts = sorted(rng.sample(range(t), n)) if n else []
            row = [-1] * t
            for k, c in enumerate(cuts):
                end = cuts[k + 1] if k + 1 < n else t
                for j in range(c, end):
                    if rng.random() < 0.7 or j == c:
                        row[j] = k
            turn_index.append(row)
        turn_state = [[rng.randint(0, 2) for _ in range(width)] for _ in range(b)]
        tr = [
            [NAN if rng.random() < 0.1 else rng.choice([0.0, -0.1, 0.3]) for _ in range(width)]
            for _ in range(b)
        ]
        use_tr = case % 2 == 0
        ctx = EstimatorContext(
            turn_index=torch.tensor(turn_index),
            turn_state=torch.tensor(turn_state),
            turn_rewards=torch.tensor(tr, dtype=torch.float64) if use_tr else None,
        )
        got = adv.gigpo(torch.tensor(r, dtype=torch.float64), torch.tensor(gids), context=ctx, mode=mode)
        want = ref_gigpo(r, gids, turn_index, turn_state, tr if use_tr else None, mode=mode)
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)


def test_gigpo_validation_and_permutation():
    ctx = EstimatorContext(turn_index=torch.tensor([[0, 1, 2]]), turn_state=torch.tensor([[0, 1]]))
    with pytest.raises(adv.ContextError, match="3 turns but context.turn_state has 2 columns"):
        adv.gigpo(torch.tensor([1.0]), torch.tensor([0]), context=ctx)
    with pytest.raises(ValueError, match="mode"):
        adv.gigpo(torch.tensor([1.0]), torch.tensor([0]), context=ctx, mode="std")
    turn_index = torch.tensor([[0, 0, 1], [0, 1, 1], [0, -1, 1], [0, 0, 0]])
    keys = torch.tensor([[5, 6], [5, 6], [5, 7], [5, 0]])
    r, g = torch.tensor([1.0, 0.0, 0.3, 0.7]), torch.tensor([1, 1, 1, 1])
    base = adv.gigpo(r, g, context=EstimatorContext(turn_index=turn_index, turn_state=keys))
    perm = torch.tensor([2, 0, 3, 1])
    got = adv.gigpo(
        r[perm], g[perm] * 5, context=EstimatorContext(turn_index=turn_index[perm], turn_state=keys[perm])
    )
    torch.testing.assert_close(got, base[perm])


# ----------------------------------------------------------------------- ACE
def test_ace_matches_reference_and_hand_worked():
    rng = random.Random(2)
    for _ in range(20):
        rows, gids, weights = random_batch(rng, 1, discrete=True)
        b = len(gids)
        old = [rng.gauss(-20, 5) for _ in range(b)]
        ref = [rng.gauss(-21, 5) for _ in range(b)]
        ctx = EstimatorContext(
            logp_old_sum=torch.tensor(old, dtype=torch.float64),
            logp_ref_sum=torch.tensor(ref, dtype=torch.float64),
        )
        r, g = to_tensors(rows, gids, k_dim=False)
        for a_coef in (1.0, 0.3):
            base = ref_grpo(rows, gids, [1.0])
            want = [
                x * (1 + a_coef * math.log1p(math.exp(o - f))) if x < 0 else x
                for x, o, f in zip(base, old, ref, strict=True)
            ]
            got = adv.ace(r, g, context=ctx, alpha=a_coef)
            torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    # hand-worked: group [1, 0]: grpo = +-0.5 / (0.70711 + 1e-4); c = [3, 0]: the wrong one has c = 0,
    # softplus(0) = ln 2 -> A = -0.70701 * (1 + ln 2)
    ctx = EstimatorContext(
        logp_old_sum=torch.tensor([-10.0, -12.0]), logp_ref_sum=torch.tensor([-13.0, -12.0])
    )
    a = adv.ace(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), context=ctx)
    s = 0.5 / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(a, torch.tensor([s, -s * (1 + math.log(2))]))
    # another base, with its options
    b = adv.ace(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), context=ctx, base="dr_grpo")
    torch.testing.assert_close(b, torch.tensor([0.5, -0.5 * (1 + math.log(2))]))
    with pytest.raises(ValueError, match="base"):
        adv.ace(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), context=ctx, base="grpo_process")


# ----------------------------------------------------------------------- CANON
def ref_canon(r, gids, metric, inter_weight=1.0, std="group", eps=1e-4):
    out = [0.0] * len(r)
    for idxs in ref_groups(gids).values():
        members = [i for i in idxs if not math.isnan(r[i]) and not math.isnan(metric[i])]
        if len(members) < 2:
            continue
        vals = [r[i] for i in members]
        mean, sd = statistics.fmean(vals), statistics.stdev(vals)
        med = sorted(metric[i] for i in members)[(len(members) - 1) // 2]
        high = [i for i in members if metric[i] > med]
        low = [i for i in members if metric[i] <= med]
        for i in members:
            if high and low:
                own, other = (high, low) if i in high else (low, high)
                mu_s, mu_o = statistics.fmean(r[j] for j in own), statistics.fmean(r[j] for j in other)
                x = (r[i] - mu_s) + inter_weight * (mu_s - mu_o)
            else:
                x = r[i] - mean
            out[i] = x / (sd + eps) if std == "group" else x
    return out


def test_canon_matches_reference_and_hand_worked():
    rng = random.Random(4)
    for case in range(30):
        rows, gids, _ = random_batch(rng, 1, discrete=case % 2 == 0)
        r = [row[0] for row in rows]
        ent = [rng.choice([0.1, 0.5, 0.9, 1.3]) for _ in r]
        lengths = [rng.randint(1, 30) for _ in r]
        ctx = EstimatorContext(entropy_mean=torch.tensor(ent, dtype=torch.float64))
        rt_, g = torch.tensor(r, dtype=torch.float64), torch.tensor(gids)
        for opts in ({}, {"inter_weight": 0.5}, {"std": "none"}):
            got = adv.canon(rt_, g, context=ctx, **opts)
            torch.testing.assert_close(
                got, torch.tensor(ref_canon(r, gids, ent, **opts), dtype=torch.float64)
            )
        got = adv.canon(rt_, g, num_actions=torch.tensor(lengths), metric="length")
        torch.testing.assert_close(
            got, torch.tensor(ref_canon(r, gids, [float(x) for x in lengths]), dtype=torch.float64)
        )
    # hand-worked, one group, std none: entropy [0.1, 0.2, 0.8, 0.9] -> lower median 0.2: L = {0, 1}, H = {2, 3};
    # r = [1, 1, 0, 1]: mean_L 1, mean_H 0.5 -> A = r - mean of the other subgroup = [0.5, 0.5, -1, 0]
    ctx = EstimatorContext(entropy_mean=torch.tensor([0.1, 0.2, 0.8, 0.9]))
    a = adv.canon(
        torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long), context=ctx, std="none"
    )
    torch.testing.assert_close(a, torch.tensor([0.5, 0.5, -1.0, 0.0]))
    with pytest.raises(ValueError, match="num_actions"):
        adv.canon(torch.ones(2), torch.zeros(2, dtype=torch.long), metric="length")


# ----------------------------------------------------------------------- DRPO
def ref_drpo(r, gids, lengths, threshold=0.5, length_weight=0.5, eps=1e-4):
    base = ref_grpo([[x] for x in r], gids, [1.0], eps=eps)
    out = [0.0] * len(r)
    for idxs in ref_groups(gids).values():
        members = [i for i in idxs if not math.isnan(r[i])]
        if len(members) < 2:
            continue
        pos = [i for i in members if r[i] > threshold]
        for i in members:
            z = 0.0
            if i in pos and len(pos) >= 2:
                ls = [lengths[j] for j in pos]
                z = -(lengths[i] - statistics.fmean(ls)) / (statistics.stdev(ls) + eps)
            out[i] = base[i] + length_weight * z
    return out


def test_drpo_matches_reference_and_shields_correct_answers():
    rng = random.Random(6)
    for _ in range(30):
        rows, gids, _ = random_batch(rng, 1, discrete=True)
        r = [row[0] for row in rows]
        lengths = [rng.randint(1, 50) for _ in r]
        got = adv.drpo(
            torch.tensor(r, dtype=torch.float64), torch.tensor(gids), num_actions=torch.tensor(lengths)
        )
        torch.testing.assert_close(got, torch.tensor(ref_drpo(r, gids, lengths), dtype=torch.float64))
    # a group of 2 correct (lengths 10, 30) and 2 wrong: the wrong ones keep GRPO's advantage, the correct
    # ones differ by the length term only (normalised among the correct: z = +-0.7071)
    a = adv.drpo(
        torch.tensor([1.0, 1.0, 0.0, 0.0]),
        torch.zeros(4, dtype=torch.long),
        num_actions=torch.tensor([10, 30, 5, 80]),
    )
    g = adv.grpo(torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long))
    z = 10 / (math.sqrt(200) + 1e-4)
    torch.testing.assert_close(a, g + 0.5 * torch.tensor([z, -z, 0.0, 0.0]))
    with pytest.raises(ValueError, match="num_actions"):
        adv.drpo(torch.ones(2), torch.zeros(2, dtype=torch.long))


# ----------------------------------------------------------------------- HGPO
def ref_hgpo(
    r,
    gids,
    turn_index,
    turn_state,
    turn_rewards,
    gamma=0.95,
    history=2,
    alpha=1.0,
    base=False,
    mode="mean_std_norm",
    eps=1e-6,
):
    b = len(r)
    valid = [not math.isnan(x) for x in r]
    n_turns = [max([t for t in row if t >= 0], default=-1) + 1 for row in turn_index]
    returns, episode = [], []
    for i in range(b):
        rr = [
            0.0 if turn_rewards is None or math.isnan(turn_rewards[i][k]) else turn_rewards[i][k]
            for k in range(n_turns[i])
        ]
        if n_turns[i]:
            rr[-1] += r[i] if valid[i] else 0.0
        returns.append(
            [sum(gamma ** (j - k) * rr[j] for j in range(k, n_turns[i])) for k in range(n_turns[i])]
        )
        episode.append(sum(rr) if n_turns[i] else (r[i] if valid[i] else 0.0))
    a_ep = [0.0] * b
    if base:
        for idxs in ref_groups(gids).values():
            members = [i for i in idxs if valid[i]]
            if len(members) >= 2:
                xs = [episode[i] for i in members]
                mu, sd = statistics.fmean(xs), statistics.stdev(xs)
                for i in members:
                    a_ep[i] = episode[i] - mu if mode == "mean_norm" else (episode[i] - mu) / (sd + eps)
    clusters = {}
    for i in range(b):
        if not valid[i]:
            continue
        for k in range(n_turns[i]):
            for d in range(1, min(history + 1, k + 1) + 1):
                clusters.setdefault((gids[i], d, tuple(turn_state[i][k - d + 1 : k + 1])), []).append((i, k))
    items = {}
    for (_, d, _), members in clusters.items():
        if len(members) < 2:
            continue
        xs = [returns[i][k] for i, k in members]
        mu, sd = statistics.fmean(xs), statistics.pstdev(xs)
        for (i, k), x in zip(members, xs, strict=True):
            items.setdefault((i, k), []).append((d, x - mu if mode == "mean_norm" else (x - mu) / (sd + eps)))
    out = []
    for i in range(b):
        row = []
        for t in turn_index[i]:
            if t < 0 or not valid[i]:
                row.append(0.0)
                continue
            its = ([(0, a_ep[i])] if base else []) + items.get((i, t), [])
            its = [(d, a) for d, a in its if a != 0]
            ws = [(d + 1) ** alpha for d, _ in its]
            row.append(
                sum(w * a for w, (_, a) in zip(ws, its, strict=True)) / (sum(ws) + eps) if its else 0.0
            )
        out.append(row)
    return out


def test_hgpo_hand_worked():
    # two trajectories of one group, one action per turn, gamma 1, history_length 1, eps 0, alpha 1:
    # A: states [a, b], outcome 1 -> G = [1, 1];  B: states [c, b], outcome 0 -> G = [0, 0]
    # depth 1 at turn 1: {A1, B1} share state b: pop. std 0.5 -> A1: +1, B1: -1; depth 2 differs (a,b vs c,b)
    # turn 0: states a / c alone -> no item -> 0. Weights: only depth 1 -> w = 2 / 2 = 1.
    ctx = EstimatorContext(
        turn_index=torch.tensor([[0, 1], [0, 1]]), turn_state=torch.tensor([[1, 2], [3, 2]])
    )
    a = adv.hgpo(
        torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), context=ctx, gamma=1.0, history_length=1, eps=0.0
    )
    torch.testing.assert_close(a, torch.tensor([[0.0, 1.0], [0.0, -1.0]]))
    # same states a, b in both: depth 1 and depth 2 both give +-1 -> (2 * 1 + 3 * 1) / 5 = 1
    ctx = EstimatorContext(
        turn_index=torch.tensor([[0, 1], [0, 1]]), turn_state=torch.tensor([[1, 2], [1, 2]])
    )
    a = adv.hgpo(
        torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), context=ctx, gamma=1.0, history_length=1, eps=0.0
    )
    torch.testing.assert_close(a, torch.tensor([[1.0, 1.0], [-1.0, -1.0]]))


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"history_length": 0},
        {"length_weight_alpha": 0.0, "base_group": True},
        {"mode": "mean_norm", "history_length": 4},
    ],
)
def test_hgpo_matches_plain_python_reference(opts):
    rng = random.Random(13)
    for _ in range(25):
        b, width, t = rng.randint(2, 8), rng.randint(1, 4), rng.randint(1, 8)
        gids = [rng.choice([0, 1]) for _ in range(b)]
        r = [NAN if rng.random() < 0.1 else float(rng.choice([0, 1])) for _ in range(b)]
        turn_index = []
        for _ in range(b):
            n = rng.randint(0, min(width, t))
            row = [-1] * t
            starts = sorted(rng.sample(range(t), n)) if n else []
            for k, c in enumerate(starts):
                end = starts[k + 1] if k + 1 < n else t
                for j in range(c, end):
                    row[j] = k
            turn_index.append(row)
        turn_state = [[rng.randint(0, 1) for _ in range(width)] for _ in range(b)]
        tr = [[rng.choice([0.0, 0.0, -0.2, 0.5]) for _ in range(width)] for _ in range(b)]
        ctx = EstimatorContext(
            turn_index=torch.tensor(turn_index),
            turn_state=torch.tensor(turn_state),
            turn_rewards=torch.tensor(tr, dtype=torch.float64),
        )
        got = adv.hgpo(torch.tensor(r, dtype=torch.float64), torch.tensor(gids), context=ctx, **opts)
        ref_opts = {
            "history": opts.get("history_length", 2),
            "alpha": opts.get("length_weight_alpha", 1.0),
            "base": opts.get("base_group", False),
            "mode": opts.get("mode", "mean_std_norm"),
        }
        want = ref_hgpo(r, gids, turn_index, turn_state, tr, **ref_opts)
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------- F-GRPO (factorized)
def test_factorized_matches_per_phase_grpo():
    rng = random.Random(9)
    for _ in range(20):
        rows, gids, weights = random_batch(rng, 3, discrete=True)
        b, t = len(gids), 6
        phase = [[rng.choice([-1, 0, 1]) for _ in range(t)] for _ in range(b)]
        comps = [[0], [1, 2]]
        ctx = EstimatorContext(phase_index=torch.tensor(phase))
        r, g = to_tensors(rows, gids, k_dim=True)
        got = adv.factorized(r, g, context=ctx, weights=weights, phase_components=comps)
        per_phase = [
            ref_grpo(rows, gids, [w if k in c else 0.0 for k, w in enumerate(weights)]) for c in comps
        ]
        want = [[0.0 if p < 0 else per_phase[p][i] for p in phase[i]] for i in range(b)]
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    ctx = EstimatorContext(phase_index=torch.tensor([[0, 2]]))
    with pytest.raises(adv.ContextError, match="phase 2"):
        adv.factorized(torch.ones(1, 2), torch.tensor([0]), context=ctx, phase_components=[[0], [1]])
    with pytest.raises(ValueError, match="phase_components"):
        adv.factorized(torch.ones(1, 2), torch.tensor([0]), context=ctx)


# ---------------------------------------------------------------------------- SPO policy shift (rho_mode kl)
def _fake_logp(tokens, version):
    """A stand-in policy at `version`: the log-prob of token k is -(1 + k % 5) * (1 + 0.07 * version)."""
    return [-(1 + k % 5) * (1 + 0.07 * version) for k in tokens]


def test_policy_shift_memory_feeds_spo_like_a_plain_loop():
    rng = random.Random(11)
    memory, state = adv.PolicyShiftMemory(), SPOTracker()
    plain: dict[int, tuple[list[int], list[float]]] = {}  # prompt -> (tokens, log-probs then)
    batches, got_all = [], []
    width = 6
    for version in range(8):
        pids, r, gids, tokens = [], [], [], []
        for k, x in enumerate(rng.sample(range(6), rng.randint(1, 4))):
            for _ in range(rng.randint(1, 3)):
                pids.append(x)
                gids.append(k)
                r.append(float(rng.random() < 0.5))
                tokens.append([rng.randrange(50) for _ in range(rng.randint(1, width))])
        # plain loop: D(x) = mean |log pi_now - log pi_then| over the stored response's tokens
        shifts = []
        for x in pids:
            if x in plain:
                toks, then = plain[x]
                now = _fake_logp(toks, version)
                shifts.append(sum(abs(a - b) for a, b in zip(now, then, strict=True)) / len(toks))
            else:
                shifts.append(0.0)
        for i, x in enumerate(pids):
            if x not in {pids[j] for j in range(i)}:
                plain[x] = (tokens[i], _fake_logp(tokens[i], version))
        batches.append((r, pids, shifts))
        # the memory: items are token lists, score pads to the stored width
        got_shift = memory.shift(
            pids,
            lambda toks, v=version: torch.tensor(
                _fake_logp(toks, v) + [0.0] * (width - len(toks)), dtype=torch.float64
            ),
        )
        assert (got_shift - torch.tensor(shifts, dtype=torch.float64)).abs().max().item() < 1e-12
        ctx = EstimatorContext(prompt_ids=torch.tensor(pids), policy_shift=got_shift)
        got_all.append(adv.spo(torch.tensor(r), torch.tensor(gids), context=ctx, state=state, rho_mode="kl"))
        logp = torch.zeros(len(pids), width, dtype=torch.float64)
        mask = torch.zeros(len(pids), width, dtype=torch.bool)
        for i, toks in enumerate(tokens):
            logp[i, : len(toks)] = torch.tensor(_fake_logp(toks, version), dtype=torch.float64)
            mask[i, : len(toks)] = True
        memory.record(pids, tokens, logp, mask)
    want, table = ref_spo_run(batches, rho_mode="kl")
    diff = max(
        (g - torch.tensor(w, dtype=g.dtype)).abs().max().item() for g, w in zip(got_all, want, strict=True)
    )
    print(f"spo rho_mode kl with PolicyShiftMemory max abs diff vs plain loop: {diff:.3e}")
    assert diff < 1e-9
    assert any(s > 0 for _, _, sh in batches for s in sh)  # the decay did adapt
    for x, (a, b, v) in table.items():
        assert state.posterior(x) == pytest.approx((a, b), abs=1e-12) and state.visits(x) == v


def test_policy_shift_memory_hand_worked_and_errors():
    memory = adv.PolicyShiftMemory()
    memory.record(
        [3, 3],
        ["a", "b"],
        torch.tensor([[-1.0, -2.0, 0.0], [-9.0, -9.0, -9.0]]),
        torch.tensor([[True, True, False], [True, True, True]]),
    )
    # stored: prompt 3 -> "a" with (-1, -2); now (-1.5, -1.0): D = (0.5 + 1.0) / 2 = 0.75
    d = memory.shift([3, 7, 3], lambda item: torch.tensor([-1.5, -1.0, 5.0]) if item == "a" else None)
    assert d.tolist() == [0.75, 0.0, 0.75]
    with pytest.raises(ValueError, match="stored response"):
        memory.shift([3], lambda item: torch.zeros(2))
