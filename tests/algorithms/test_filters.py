"""Tests of mmalign.algorithms.filters: group statistics, dynamic sampling, range filter and the replay buffer."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest
import torch

from mmalign.algorithms import filters
from mmalign.algorithms.filters import build_filter, group_std
from mmalign.data.batch import Rollout
from mmalign.training import rundir

NAN = float("nan")


def make_rollout(rewards, ids=None, *, T=2, adv=None, prefix="p", token_adv=False):
    """One row per reward; `rewards` is a list of groups (lists of floats) unless `ids` is given."""
    if ids is None:
        flat, ids = [], []
        for g, rs in enumerate(rewards):
            flat.extend(rs)
            ids.extend([g] * len(rs))
    else:
        flat = list(rewards)
    b = len(flat)
    group = torch.tensor(ids, dtype=torch.long)
    mask = torch.ones(b, T, dtype=torch.bool)
    mask[::2, -1] = False  # some rows with fewer valid actions
    r = torch.tensor(flat, dtype=torch.float32)
    if adv is None:  # simple per-group centred rewards (NaN -> 0), distinct per row
        adv = torch.zeros(b)
        for gid in set(ids):
            rows = [i for i, g in enumerate(ids) if g == gid]
            vals = [flat[i] for i in rows if not math.isnan(flat[i])]
            m = sum(vals) / len(vals) if vals else 0.0
            for i in rows:
                adv[i] = 0.0 if math.isnan(flat[i]) else flat[i] - m
    adv = torch.as_tensor(adv, dtype=torch.float32)
    if token_adv:
        adv = adv[:, None].repeat(1, T)
    return Rollout(
        group=group,
        mask=mask,
        prompts=[f"{prefix}{g}" for g in ids],
        logp_old=torch.arange(b * T, dtype=torch.float32).reshape(b, T) / 10,
        columns={"answer": [f"{prefix}a{i}" for i in range(b)]},
        outputs={"texts": [f"{prefix}out{i}" for i in range(b)]},
        payload={"ids": torch.arange(b * T).reshape(b, T), "row": list(range(b))},
        rewards=r[:, None].clone(),
        reward_names=["acc"],
        advantages=adv,
    )


def scores_of(rollout):
    return rollout.rewards[:, 0].clone()


def assert_rows_match(out, src, src_rows):
    """Rows of `out` equal rows `src_rows` of `src` in every field."""
    idx = torch.tensor(src_rows)
    assert out.prompts == [src.prompts[i] for i in src_rows]
    assert out.columns["answer"] == [src.columns["answer"][i] for i in src_rows]
    assert out.outputs["texts"] == [src.outputs["texts"][i] for i in src_rows]
    assert out.payload["row"] == [src.payload["row"][i] for i in src_rows]
    assert torch.equal(out.mask, src.mask[idx])
    assert torch.equal(out.logp_old, src.logp_old[idx])
    assert torch.equal(out.payload["ids"], src.payload["ids"][idx])
    assert torch.equal(out.advantages, src.advantages[idx])
    assert torch.equal(out.rewards, src.rewards[idx])


# ------------------------------------------------------------------ registry and helpers
def test_registry_names_docs_and_options():
    assert filters.names() == ["d3s", "dynamic_sampling", "none", "range", "replay"]
    for name in filters.names():
        assert filters.FILTERS.describe(name), name
        assert issubclass(filters.get(name), filters.GroupFilter)
    with pytest.raises(KeyError, match="dynamic_sampling"):
        filters.get("dynamic_sampler")
    with pytest.raises(TypeError, match=r"'range'.*'lo'"):
        build_filter("range", lo=0.1)
    with pytest.raises(TypeError, match=r"'none'.*'max_rounds'"):
        build_filter("none", max_rounds=2)
    ds = build_filter("dynamic_sampling")
    assert ds.resample is True and ds.max_rounds == 3
    assert build_filter("dynamic_sampling", max_rounds=5).max_rounds == 5
    rf = build_filter("range")
    assert rf.resample is False and (rf.low, rf.high) == (0.01, 0.99)
    assert build_filter("range", resample=True).resample is True
    assert build_filter("none").resample is False
    with pytest.raises(ValueError):
        build_filter("range", low=0.5, high=0.5)
    with pytest.raises(ValueError):
        build_filter("dynamic_sampling", max_rounds=0)


def test_group_std_matches_statistics_with_nans_and_interleaved_ids():
    scores = torch.tensor([0.1, 5.0, 0.1, NAN, 0.1, 2.0, 3.0, NAN, 7.0, 1.0, NAN])
    group = torch.tensor([7, 3, 7, 3, 7, 3, 9, 9, 3, 4, 4])
    ids, std = group_std(scores, group)
    assert ids.tolist() == [7, 3, 9, 4]  # order of first appearance
    assert ids.dtype == torch.long and std.dtype == torch.float32
    assert std[0].item() == 0.0  # 0.1 three times: exactly zero, no rounding residue
    assert std[1].item() == pytest.approx(statistics.stdev([5.0, 2.0, 7.0]), rel=1e-6)
    assert std[2].item() == 0.0  # one valid score
    assert std[3].item() == 0.0  # one valid score
    # float64 scores where a two-pass mean leaves rounding residue: still exactly zero
    for v in (0.1, 0.7, 1 / 3):
        ids, std = group_std(torch.tensor([v] * 7, dtype=torch.float64), torch.zeros(7, dtype=torch.long))
        assert std.dtype == torch.float64 and std.tolist() == [0.0], v
    ids, std = group_std(torch.tensor([NAN, NAN]), torch.tensor([1, 1]))
    assert ids.tolist() == [1] and std.tolist() == [0.0]
    ids, std = group_std(torch.empty(0), torch.empty(0, dtype=torch.long))
    assert ids.numel() == 0 and std.numel() == 0


# ------------------------------------------------------------------ none / dynamic sampling
def test_none_keeps_everything():
    ro = make_rollout([[1, 1, 1], [0, 1, 0]])
    flt = build_filter("none")
    assert flt.last_stats() == {}
    out = flt(ro, scores_of(ro))
    assert out.group.tolist() == ro.group.tolist()
    assert_rows_match(out, ro, list(range(6)))
    assert flt.last_stats()["filter/groups_kept"] == 2
    assert flt.last_stats()["filter/zero_std_frac"] == 0.5


def test_dynamic_sampling_keeps_nonzero_std_groups_in_order_with_consistent_fields():
    ro = make_rollout([[1, 1, 1], [0, 1, 0], [0, 0, 0], [1, 0.5, 1]], T=2)
    flt = build_filter("dynamic_sampling")
    out = flt(ro, scores_of(ro))
    assert out.group_ids() == [1, 3]
    assert out.group.tolist() == [1, 1, 1, 3, 3, 3]
    assert_rows_match(out, ro, [3, 4, 5, 9, 10, 11])
    st = flt.last_stats()
    assert st["filter/groups_in"] == 4 and st["filter/groups_kept"] == 2
    assert st["filter/zero_std_frac"] == 0.5
    assert st["filter/samples_out"] == 6


def test_dynamic_sampling_interleaved_groups_preserve_batch_order():
    rewards = [1, 0, 1, 1, 0, 1, 0, 1]
    ids = [5, 2, 5, 2, 9, 2, 9, 5]  # group 2 has rewards 0,1,1 ; 5: 1,1,1 ; 9: 0,0
    ids_rewards = list(zip(ids, rewards))
    ro = make_rollout(rewards, ids)
    # group 5 = [1,1,1] -> dropped; group 2 = [0,1,1] kept; group 9 = [0,0] dropped
    assert [r for g, r in ids_rewards if g == 5] == [1, 1, 1]
    out = build_filter("dynamic_sampling")(ro, scores_of(ro))
    assert_rows_match(out, ro, [1, 3, 5])
    ro2 = make_rollout([0, 1, 1, 0, 0, 1], [4, 8, 4, 8, 3, 3])
    out2 = build_filter("dynamic_sampling")(ro2, scores_of(ro2))
    assert out2.group.tolist() == [4, 8, 4, 8, 3, 3]  # all kept, order untouched


def test_dynamic_sampling_nan_handling():
    ro = make_rollout([[1, NAN, 0], [1, NAN, NAN], [NAN, NAN, NAN], [0, 0, NAN], [NAN, 0.2, 0.3]])
    flt = build_filter("dynamic_sampling")
    out = flt(ro, scores_of(ro))
    assert out.group_ids() == [0, 4]
    assert flt.last_stats()["filter/zero_std_frac"] == pytest.approx(3 / 5)


def test_scores_shape_is_checked():
    ro = make_rollout([[1, 0], [0, 0]])
    with pytest.raises(ValueError, match="Float\\[B\\]"):
        build_filter("dynamic_sampling")(ro, torch.zeros(3))


# ------------------------------------------------------------------ range filter
def test_range_filter_boundaries_are_exclusive():
    ro = make_rollout(
        [[0, 0.25, 0.5], [0.5, 0.75, 1.0], [0.25, 0.5, 0.75], [0.25, 0.25, 0.25], [0.7, 0.7, 0.7]]
    )
    flt = build_filter("range", low=0.25, high=0.75)
    out = flt(ro, scores_of(ro))
    assert out.group_ids() == [2, 4]  # means .25 and .75 dropped; .5 and .7 kept
    assert_rows_match(out, ro, [6, 7, 8, 12, 13, 14])


def test_range_filter_defaults_and_nans():
    ro = make_rollout(
        [[0.01] * 3, [0.99] * 3, [0.0, 0.0, 1.0], [1, 1, 1], [0, 0, 0], [NAN, NAN, NAN], [NAN, 1, 0]]
    )
    flt = build_filter("range")
    out = flt(ro, scores_of(ro))
    assert out.group_ids() == [2, 6]  # mean exactly 0.01 (float32) and 0.99 dropped, all-NaN dropped
    assert flt.last_stats()["filter/groups_kept"] == 2


# ------------------------------------------------------------------ replay
def replay_score(rewards, adv):
    """Plain-Python Σ|A_i| · std_g with NaN rewards ignored."""
    vals = [r for r in rewards if not math.isnan(r)]
    return sum(abs(a) for a in adv) * statistics.stdev(vals)


def test_replay_buffers_informative_groups_and_replaces_zero_variance():
    flt = build_filter("replay")
    first = make_rollout([[1, 0, 0], [1, 1, 1], [0, 1, 1], [0, 0, 0]], prefix="a")
    out = flt(first, scores_of(first))
    # empty buffer before this call: zero-variance groups are dropped, not replaced by this call's groups
    assert out.group_ids() == [0, 2]
    assert_rows_match(out, first, [0, 1, 2, 6, 7, 8])
    entries = flt.buffer_entries()
    assert [e["group"] for e in entries] == [0, 2]
    adv = first.advantages.tolist()
    assert entries[0]["score"] == pytest.approx(replay_score([1, 0, 0], adv[0:3]), rel=1e-6)
    assert entries[1]["score"] == pytest.approx(replay_score([0, 1, 1], adv[6:9]), rel=1e-6)
    assert flt.last_stats()["filter/groups_replayed"] == 0
    assert flt.last_stats()["filter/groups_dropped"] == 2

    second = make_rollout([[1, 0, 1], [1, 1, 1]], prefix="b")
    second.group = torch.tensor([4, 4, 4, 1, 1, 1])
    out = flt(second, scores_of(second))
    assert out.group_ids() == [4, 5]  # fresh id max(4, 1) + 1
    assert_rows_match(out[[0, 1, 2]], second, [0, 1, 2])
    replayed = out[[3, 4, 5]]
    src = 0 if replayed.prompts[0] == "a0" else 2
    assert_rows_match(replayed, first, list(range(3 * src, 3 * src + 3)))
    assert out.group.tolist() == [4, 4, 4, 5, 5, 5]
    st = flt.last_stats()
    assert st["filter/groups_replayed"] == 1 and st["filter/groups_dropped"] == 0
    assert st["filter/groups_out"] == 2
    assert len(flt) == 3  # two old entries (reuse_limit 2) + group 4 of this call


def test_replay_drops_what_the_buffer_cannot_fill_and_ids_do_not_collide():
    flt = build_filter("replay", reuse_limit=1)
    seed = make_rollout([[1, 0]], prefix="s")
    flt(seed, scores_of(seed))
    ro = make_rollout([[0, 0], [1, 1], [0, 1], [1, 1]], prefix="c")
    ro.group = torch.tensor([3, 3, 0, 0, 10, 10, 7, 7])
    out = flt(ro, scores_of(ro))
    assert out.group.tolist() == [10, 10, 11, 11]
    assert out.prompts == ["c2", "c2", "s0", "s0"]
    assert flt.last_stats()["filter/groups_dropped"] == 2
    assert [e["group"] for e in flt.buffer_entries()] == [10]  # the replayed one was spent


def test_replay_token_level_advantages_use_masked_mean():
    ro = make_rollout([[1, 0, 0]], token_adv=True, T=3)
    ro.advantages[:, 2] = 100.0
    ro.mask[:, 2] = False  # masked actions must not count
    ro.advantages[0, 1] = 100.0
    ro.mask[0, 1] = False
    flt = build_filter("replay")
    flt(ro, scores_of(ro))
    a = ro.advantages[:, 0].tolist()
    assert flt.buffer_entries()[0]["score"] == pytest.approx(replay_score([1, 0, 0], a), rel=1e-6)


def test_replay_needs_advantages_and_stores_detached_cpu_copies():
    ro = make_rollout([[1, 0]])
    ro.advantages = None
    with pytest.raises(ValueError, match="advantages"):
        build_filter("replay")(ro, scores_of(ro))
    ro = make_rollout([[1, 0]])
    ro.logp_old.requires_grad_(True)
    flt = build_filter("replay")
    flt(ro, scores_of(ro))
    stored = flt._buffer[0]["rollout"]
    assert not stored.logp_old.requires_grad and stored.logp_old.device.type == "cpu"
    ro.advantages.mul_(0)  # later in-place edits of the rollout do not reach the buffer
    assert stored.advantages.abs().sum() > 0
    z = make_rollout([[1, 1]])
    out = flt(z, scores_of(z))
    out.advantages.add_(5)  # nor do in-place edits of a replayed copy
    assert torch.equal(flt._buffer[0]["rollout"].advantages, stored.advantages)
    assert not out.logp_old.requires_grad


def two_entry_replay(scores=(1.0, 3.0), **opts):
    """A replay filter whose buffer holds groups 'w0', 'w1' with exactly the given scores."""
    flt = build_filter("replay", **opts)
    s = 1 / math.sqrt(2)  # std of [0, 1]
    groups = [[0, 1]] * len(scores)
    adv = []
    for sc in scores:
        a = sc / (2 * s)
        adv.extend([-a, a])
    ro = make_rollout(groups, adv=adv, prefix="w")
    flt(ro, scores_of(ro))
    return flt


def zero_variance(n=1):
    return make_rollout([[1, 1]] * n, prefix="z")


def test_replay_draws_proportional_to_score():
    flt = two_entry_replay(reuse_limit=10**9, seed=0)
    entries = flt.buffer_entries()
    assert [e["score"] for e in entries] == pytest.approx([1.0, 3.0])
    total = sum(e["score"] for e in entries)
    probs = [e["score"] / total for e in entries]  # plain-Python probabilities
    n = 1000
    z = zero_variance()
    counts = {"w0": 0, "w1": 0}
    for _ in range(n):
        out = flt(z, scores_of(z))
        counts[out.prompts[0]] += 1
    assert counts["w0"] / n == pytest.approx(probs[0], abs=0.05)
    assert counts["w1"] / n == pytest.approx(probs[1], abs=0.05)


def test_replay_without_replacement_inclusion_probabilities():
    w = [1.0, 2.0, 5.0]
    flt = two_entry_replay(scores=w, reuse_limit=10**9, seed=3)
    tot = sum(w)
    # P(first = i, second = j) = w_i / W · w_j / (W − w_i); P(i excluded) = Σ over pairs without i
    excl = [
        sum(
            w[a] / tot * w[b] / (tot - w[a]) for a in range(3) for b in range(3) if a != b and i not in (a, b)
        )
        for i in range(3)
    ]
    z = zero_variance(2)
    n = 800
    counts = [0, 0, 0]
    for _ in range(n):
        out = flt(z, scores_of(z))
        picked = out.group_ids()
        assert len(picked) == 2
        names = {out.prompts[i] for i in range(len(out))}
        assert len(names) == 2  # without replacement
        for i in range(3):
            counts[i] += f"w{i}" not in names
    for i in range(3):
        assert counts[i] / n == pytest.approx(excl[i], abs=0.05)


@pytest.mark.parametrize("evict", ["lowest_score", "oldest"])
def test_replay_capacity_bound(evict):
    flt = build_filter("replay", capacity=2, evict=evict)
    for sc in [2.0, 5.0, 1.0, 3.0]:
        s = 1 / math.sqrt(2)
        ro = make_rollout([[0, 1]], adv=[-sc / (2 * s), sc / (2 * s)], prefix=f"x{sc}")
        flt(ro, scores_of(ro))
        assert len(flt) <= 2
    scores = sorted(e["score"] for e in flt.buffer_entries())
    expected = [3.0, 5.0] if evict == "lowest_score" else [1.0, 3.0]
    assert scores == pytest.approx(expected)


def test_replay_reuse_limit():
    flt = two_entry_replay(scores=(1.0,), reuse_limit=2)
    z = zero_variance()
    for expected in (["w0", "w0"], ["w0", "w0"], []):
        out = flt(z, scores_of(z))
        assert out.prompts == expected
    assert len(flt) == 0


def test_replay_state_dict_round_trip_gives_same_draws(tmp_path):
    flt = two_entry_replay(scores=(1.0, 2.0, 3.0, 4.0), reuse_limit=3, seed=11)
    z = zero_variance(2)
    flt(z, scores_of(z))  # advance the generator and the use counts
    buf = tmp_path / "filter.pt"
    rundir.save_state(flt.state_dict(), buf)

    def draws(f):
        seq = []
        for _ in range(8):
            out = f(z, scores_of(z))
            seq.append(out.prompts[::2])
        return seq

    expected = draws(flt)
    assert any(expected) and not all(expected)  # drew something, then the buffer ran dry
    state = rundir.load_state(buf)
    flt.load_state_dict(state)  # restore in place
    assert draws(flt) == expected
    fresh = build_filter("replay", reuse_limit=3, seed=999)  # another seed: the state decides
    fresh.load_state_dict(rundir.load_state(buf))
    assert draws(fresh) == expected


def test_stateless_filters_state_dict(tmp_path):
    for name in ("none", "dynamic_sampling", "range"):
        f = build_filter(name)
        path = rundir.save_state(f.state_dict(), tmp_path / f"{name}.pt")
        f.load_state_dict(rundir.load_state(path))


# ------------------------------------------------------------------ D³S
def brute_force_max_variance(values, k):
    """The best k-subset by exhaustive search (unbiased variance); the largest variance found."""
    best = -1.0
    for combo in itertools.combinations(range(len(values)), k):
        xs = [values[i] for i in combo]
        var = statistics.variance(xs) if k > 1 else 0.0
        best = max(best, var)
    return best


def test_max_variance_subset_matches_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        values = [rng.choice([rng.gauss(0, 1), 0.0, 1.0, -1.0]) for _ in range(n)]
        k = rng.randint(1, n)
        pick = filters.max_variance_subset(torch.tensor(values, dtype=torch.float64), k).tolist()
        assert len(pick) == k and pick == sorted(set(pick))
        got = statistics.variance([values[i] for i in pick]) if k > 1 else 0.0
        assert got == pytest.approx(brute_force_max_variance(values, k), abs=1e-12)
    assert filters.max_variance_subset(torch.tensor([3.0, 1.0]), 5).tolist() == [0, 1]
    assert filters.max_variance_subset(torch.tensor([3.0, 1.0]), 0).tolist() == []


def test_d3s_keeps_the_extremes_of_each_group_on_a_schedule(tmp_path):
    # two groups of 6; advantages are the rewards centred per group (make_rollout)
    rewards = [[0.0, 0.1, 0.5, 0.6, 0.9, 1.0], [1.0, 1.0, 0.0, 0.2, 0.3, 0.8]]
    ro = make_rollout(rewards)
    f = build_filter("d3s", start_frac=0.5, end_frac=1.0, schedule_steps=4, min_keep=2)
    assert [f.keep_fraction(t) for t in range(6)] == [0.5, 0.625, 0.75, 0.875, 1.0, 1.0]
    out = f(ro, scores_of(ro))
    # step 0: k = 3 per group; group 0: {0.0, 0.1, 1.0} vs {0.0, 0.9, 1.0}: equal spread -> fewer from the top
    # group 1 (advantages 0.45, 0.45, -0.55, -0.35, -0.25, 0.25): {-0.55, 0.45, 0.45} is the widest
    keep = [0, 1, 5, 6, 7, 8]
    assert_rows_match(out, ro, keep)
    stats = f.last_stats()
    assert (
        stats["filter/samples_out"] == 6
        and stats["filter/samples_dropped"] == 6
        and stats["filter/keep_frac"] == 0.5
    )
    assert out.group.tolist() == [0, 0, 0, 1, 1, 1]
    # variance of the kept advantages is the best possible (brute force)
    for g in (0, 1):
        kept = [float(out.advantages[i]) for i in range(len(out)) if out.group[i] == g]
        full = [float(ro.advantages[i]) for i in range(len(ro)) if ro.group[i] == g]
        assert statistics.variance(kept) == pytest.approx(brute_force_max_variance(full, 3))
    # the clock is in the state: a restored filter continues the schedule
    saved = rundir.load_state(rundir.save_state(f.state_dict(), tmp_path / "f.pt"))
    g2 = build_filter("d3s", start_frac=0.5, end_frac=1.0, schedule_steps=4)
    g2.load_state_dict(saved)
    assert (
        g2.calls == 1 and len(g2(ro, scores_of(ro))) == len(f(ro, scores_of(ro))) == 8
    )  # ceil(0.625 * 6) = 4
    for _ in range(3):
        out = f(ro, scores_of(ro))
    assert len(out) == 12 and out is ro  # fully relaxed: everything kept


def test_d3s_token_level_advantages_and_errors():
    ro = make_rollout([[0.0, 1.0, 0.5, 0.2]], token_adv=True)
    out = build_filter("d3s", start_frac=0.5)(ro, scores_of(ro))
    assert sorted(out.columns["answer"]) == ["pa0", "pa1"]  # A = -0.425, 0.575: the two extremes
    with pytest.raises(ValueError, match="start_frac"):
        build_filter("d3s", start_frac=0.0)
    with pytest.raises(TypeError, match=r"'d3s'.*'frac'"):
        build_filter("d3s", frac=0.5)
    ro.advantages = None
    with pytest.raises(ValueError, match="needs rollout.advantages"):
        build_filter("d3s")(ro, scores_of(ro))
