"""Tests of mmalign.advantages against independent plain-Python references (lists, math, statistics)."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from mmalign import advantages as adv
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
    assert set(adv.names()) == ALL_ESTIMATORS | STEP_ESTIMATORS
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
