"""Tests of mmalign.data.prompt_samplers: registry, uniform epochs, VADE posterior/decay/Thompson picks, checkpoints."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from mmalign.data import prompt_samplers as samplers
from mmalign.data.prompt_samplers import (
    UniformSampler,
    VadeSampler,
    beta_sample,
    build_sampler,
    group_successes,
    success_from_rewards,
)
from mmalign.registry import RegistryError


def roundtrip(obj, tmp_dir=None):
    """Through the checkpoint format (`rundir.save_state` / `load_state`: torch.load with weights_only=True)."""
    import tempfile

    from mmalign.training import rundir

    with tempfile.TemporaryDirectory() as d:
        path = rundir.save_state(obj, Path(d) / "state.pt")
        return rundir.load_state(path)


def simulate(sampler, truth, rounds, n, *, group=8, seed=0, truth_after=None, switch=None):
    """Run `rounds` of next_indices/observe against Bernoulli prompts; returns the list of picks per round."""
    gen = torch.Generator().manual_seed(1234 + seed)
    history = []
    for r in range(rounds):
        p = truth if switch is None or r < switch else truth_after
        idx = sampler.next_indices(n)
        history.append(idx)
        succ = [float((torch.rand(group, generator=gen) < p[i]).double().mean()) for i in idx]
        sampler.observe(idx, succ, [group] * len(idx))
    return history


# ---------------------------------------------------------------------------- registry
def test_registry_and_unknown_options():
    assert samplers.names() == ["spo", "uniform", "vade"]
    assert isinstance(build_sampler("uniform", 5, seed=1), UniformSampler)
    assert isinstance(build_sampler("vade", 5, seed=1, explore=0.5), VadeSampler)
    with pytest.raises(TypeError, match=r"prompt sampler 'vade'.*'gama_fast'"):
        build_sampler("vade", 5, 0, gama_fast=0.5)
    with pytest.raises(TypeError, match=r"prompt sampler 'uniform'.*'explore'"):
        build_sampler("uniform", 5, 0, explore=0.1)
    with pytest.raises(RegistryError, match="vade"):
        build_sampler("vad", 5, 0)
    with pytest.raises(ValueError, match="gamma_slow"):
        build_sampler("vade", 5, 0, gamma_slow=1.5)
    with pytest.raises(ValueError, match="at least one row"):
        build_sampler("vade", 0, 0)


# ---------------------------------------------------------------------------- success rates
def test_success_from_rewards():
    assert success_from_rewards(torch.tensor([1.0, 0.0, 1.0, 0.0]), 0.5) == 0.5
    assert success_from_rewards([0.2, 0.9, float("nan")], 0.5) == 0.5  # NaN left out
    assert success_from_rewards([0.5, 0.5], 0.5) == 0.0  # strictly greater
    assert success_from_rewards([0.2, 0.4], None) == pytest.approx(0.3)
    assert success_from_rewards([2.0, 3.0], None) == 1.0  # clamped
    assert math.isnan(success_from_rewards([float("nan")] * 3, 0.5))
    ids, rates, counts = group_successes(
        torch.tensor([1.0, 0.0, 1.0, 1.0, float("nan"), 0.0]), torch.tensor([7, 7, 3, 3, 3, 9]), 0.5
    )
    assert ids == [3, 7, 9] and rates == [1.0, 0.5, 0.0] and counts == [2.0, 2.0, 1.0]


def test_beta_sample_moments_and_generator_determinism():
    g = torch.Generator().manual_seed(0)
    for a, b in [(2.0, 5.0), (0.3, 0.3), (40.0, 10.0)]:
        x = beta_sample(torch.full((40_000,), a), torch.full((40_000,), b), g)
        mean, var = a / (a + b), a * b / ((a + b) ** 2 * (a + b + 1))
        assert float(x.mean()) == pytest.approx(mean, abs=0.01)
        assert float(x.var()) == pytest.approx(var, rel=0.05)
        assert bool(((x >= 0) & (x <= 1)).all())
    x1 = beta_sample(
        torch.tensor([1.0, 2.0, 0.5]), torch.tensor([1.0, 3.0, 0.2]), torch.Generator().manual_seed(5)
    )
    x2 = beta_sample(
        torch.tensor([1.0, 2.0, 0.5]), torch.tensor([1.0, 3.0, 0.2]), torch.Generator().manual_seed(5)
    )
    assert torch.equal(x1, x2)


# ---------------------------------------------------------------------------- uniform
def test_uniform_covers_each_row_once_per_epoch_and_stays_distinct():
    s = UniformSampler(10, seed=3)
    calls = [s.next_indices(4) for _ in range(10)]  # 40 draws = 4 epochs; 4 does not divide 10
    for c in calls:
        assert len(set(c)) == 4
    flat = [i for c in calls for i in c]
    for e in range(4):
        assert sorted(flat[10 * e : 10 * (e + 1)]) == list(range(10))
    assert s.last_stats() == {"sampler/epoch": 3.0}


def _legacy_order(num_rows: int, seed: int, epoch: int) -> list[int]:
    """One epoch of the former `mmalign.data.rows.PromptSampler`: the order `UniformSampler` keeps."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**64)
    return torch.randperm(num_rows, generator=g).tolist()


def test_uniform_keeps_the_legacy_order_and_loads_its_state():
    ours = UniformSampler(12, seed=7)
    legacy = [i for epoch in range(3) for i in _legacy_order(12, 7, epoch)]
    assert [i for _ in range(9) for i in ours.next_indices(4)] == legacy  # 4 divides 12: no deferral
    fresh = UniformSampler(12, seed=7)
    # a legacy state dict (no name / deferred): epoch 3, 3 rows taken
    fresh.load_state_dict({"epoch": 3, "position": 3, "seed": 7, "num_rows": 12})
    assert fresh.next_indices(5) == _legacy_order(12, 7, 3)[3:8]
    ordered = UniformSampler(4, shuffle=False)
    assert ordered.next_indices(3) == [0, 1, 2] and ordered.next_indices(3) == [3, 0, 1]


def test_uniform_cycles_when_n_exceeds_rows():
    s = UniformSampler(3, seed=0)
    out = s.next_indices(7)
    assert Counter(Counter(out).values()) == Counter({2: 2, 3: 1})
    assert sorted(out[:3]) == sorted(out[3:6]) == [0, 1, 2]


def test_uniform_state_roundtrip():
    s = UniformSampler(11, seed=2)
    for _ in range(3):
        s.next_indices(4)
    t = UniformSampler(11, seed=2)
    t.load_state_dict(roundtrip(s.state_dict()))
    assert [t.next_indices(4) for _ in range(6)] == [s.next_indices(4) for _ in range(6)]
    with pytest.raises(ValueError, match="saw 11 rows but the data now has 12"):
        UniformSampler(12).load_state_dict(s.state_dict())


# ---------------------------------------------------------------------------- VADE: posterior and decay
def test_vade_posterior_update_by_hand():
    s = VadeSampler(4, alpha0=1.0, beta0=2.0, evidence_weight=0.5, gamma_fast=1.0, gamma_slow=1.0)
    s.observe([2, 0], [0.75, 0.0], [8, 4])
    # alpha = alpha0 + w*s*G, beta = beta0 + w*(1-s)*G
    assert s.alpha.tolist() == [1.0, 1.0, 1.0 + 0.5 * 0.75 * 8, 1.0]
    assert s.beta.tolist() == [2.0 + 0.5 * 4, 2.0, 2.0 + 0.5 * 0.25 * 8, 2.0]
    assert s.visits.tolist() == [1, 0, 1, 0]
    s.observe([1], [float("nan")])  # NaN: no evidence, no visit
    assert s.visits.tolist() == [1, 0, 1, 0] and s.alpha[1] == 1.0
    d = VadeSampler(2, samples_per_prompt=5.0, gamma_fast=1.0, gamma_slow=1.0)
    d.observe([1], [0.4])  # counts default to samples_per_prompt
    assert d.alpha.tolist() == [1.0, 3.0] and d.beta.tolist() == [1.0, 4.0]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        s.observe([0], [1.5])
    with pytest.raises(ValueError, match="indices"):
        s.observe([4], [0.5])


def test_vade_two_time_scale_decay_by_hand():
    gf, gs = 0.5, 0.9
    s = VadeSampler(3, alpha0=1.0, beta0=1.0, gamma_fast=gf, gamma_slow=gs)
    s.observe([0, 1], [1.0, 0.25], [4, 4])  # evidence a=[4,1,0], b=[0,3,0] (decay of zeros is zero)
    assert s.alpha.tolist() == [5.0, 2.0, 1.0] and s.beta.tolist() == [1.0, 4.0, 1.0]
    s.observe([0], [0.0], [2])
    # prompt 0: slow then fast decay of its old evidence, then the new evidence
    # prompt 1: slow decay only (not observed); prompt 2: still at the prior
    a = [4 * gs * gf + 0.0, 1 * gs, 0.0]
    b = [0 * gs * gf + 2.0, 3 * gs, 0.0]
    assert s.alpha.tolist() == pytest.approx([1 + x for x in a], abs=1e-12)
    assert s.beta.tolist() == pytest.approx([1 + x for x in b], abs=1e-12)
    for _ in range(200):  # long unobserved: back to the prior
        s.observe([], [])
    assert s.alpha.tolist() == pytest.approx([1.0, 1.0, 1.0], abs=1e-6)
    assert s.steps == 202


# ---------------------------------------------------------------------------- VADE: picking
TRUTH = torch.tensor([1.0] * 10 + [0.0] * 10 + [0.5] * 10)  # rows 20..29 are the informative ones


def test_vade_prefers_informative_prompts_over_uniform():
    rounds, n = 40, 6
    shares = {}
    for name in ("uniform", "vade"):
        hist = simulate(build_sampler(name, 30, seed=0), TRUTH, rounds, n)
        late = [i for idx in hist[10:] for i in idx]
        shares[name] = sum(i >= 20 for i in late) / len(late)
    assert shares["uniform"] == pytest.approx(1 / 3, abs=0.05)
    assert shares["vade"] > 0.8  # ~0.95 in practice; uniform gets 1/3
    assert shares["vade"] > shares["uniform"] + 0.4


def test_vade_follows_a_changing_policy():
    # after round 30 the 0.5 prompts become solved and the never-solved ones become 0.5
    after = torch.tensor([1.0] * 10 + [0.5] * 10 + [1.0] * 10)
    shares = []
    for options in ({}, {"gamma_fast": 1.0, "gamma_slow": 1.0}):  # default decays vs no decay at all
        hist = simulate(
            build_sampler("vade", 30, seed=1, **options), TRUTH, 70, 6, truth_after=after, switch=30
        )
        late = [i for idx in hist[55:] for i in idx]
        shares.append(sum(10 <= i < 20 for i in late) / len(late))
    assert shares[0] > 0.85  # ~0.95 over seeds; without decay 0.5-0.9
    assert shares[0] > shares[1] + 0.1


def test_vade_distinct_indices_and_stats():
    s = build_sampler("vade", 30, seed=4, explore=0.34)
    for idx in simulate(s, TRUTH, 20, 9):
        assert len(idx) == 9 and len(set(idx)) == 9 and all(0 <= i < 30 for i in idx)
    stats = s.last_stats()
    assert set(stats) == {
        "sampler/picked_p",
        "sampler/picked_info",
        "sampler/picked_unseen_frac",
        "sampler/seen_frac",
        "sampler/all_info",
    }
    assert stats["sampler/seen_frac"] == 1.0 and 0.0 <= stats["sampler/picked_info"] <= 0.25


def test_vade_explore_picks_least_visited_first():
    s = VadeSampler(10, seed=0, explore=0.5)
    s.observe(list(range(7)), [0.5] * 7, [8] * 7)  # rows 7, 8, 9 never seen
    idx = s.next_indices(6)
    assert set(idx[3:]) == {7, 8, 9}  # 3 exploration picks come last
    assert s.last_stats()["sampler/picked_unseen_frac"] == pytest.approx(0.5)


def test_vade_ties_broken_by_index(monkeypatch):
    p_hat = torch.tensor([0.5, 0.25, 0.5, 0.75, 0.5, 0.5], dtype=torch.float64)
    monkeypatch.setattr(samplers, "beta_sample", lambda a, b, g: p_hat.clone())
    s = VadeSampler(6, seed=0)
    assert s.next_indices(3) == [0, 2, 4]  # four prompts tie at 0.25: smaller indices first
    assert s.next_indices(6) == [0, 2, 4, 5, 1, 3]  # 0.25 * 0.75 == 0.75 * 0.25 exactly


def test_vade_cycles_when_n_exceeds_rows():
    s = VadeSampler(4, seed=0)
    out = s.next_indices(10)
    assert len(out) == 10 and out[:4] == out[4:8] and out[8:] == out[:2]
    assert sorted(out[:4]) == [0, 1, 2, 3]
    assert s.next_indices(0) == []


def test_vade_state_roundtrip_gives_identical_draws():
    s = build_sampler("vade", 30, seed=9, explore=0.2)
    simulate(s, TRUTH, 7, 5)
    state = roundtrip(s.state_dict())
    t = build_sampler("vade", 30, seed=9, explore=0.2)
    t.load_state_dict(state)
    assert torch.equal(t.a, s.a) and torch.equal(t.b, s.b) and torch.equal(t.visits, s.visits)
    assert simulate(t, TRUTH, 8, 5, seed=3) == simulate(s, TRUTH, 8, 5, seed=3)
    assert torch.equal(t.a, s.a)
    other = build_sampler("vade", 30, seed=9, explore=0.2)  # not loaded: different draws
    assert simulate(other, TRUTH, 8, 5, seed=3) != simulate(s, TRUTH, 8, 5, seed=3)
    with pytest.raises(ValueError, match="'uniform'"):
        t.load_state_dict(UniformSampler(30).state_dict())


# ---------------------------------------------------------------------------- SPO
def test_spo_weights_follow_the_formula_and_the_tracker_update_by_hand():
    s = build_sampler("spo", 4, seed=0)
    # unseen rows: Beta(0.5, 0.5), p = 0.5 -> weight sqrt(0.25) + 0.05 = 0.55
    assert s.weights().tolist() == pytest.approx([0.55] * 4)
    # row 1: 3 of 4 samples correct: alpha = 0.96 * 0.5 + 3 = 3.48, beta = 0.48 + 1 = 1.48
    s.observe([1, 2], [0.75, float("nan")], [4, 4])
    assert s.tracker.posterior(1) == pytest.approx((3.48, 1.48))
    assert 2 not in s.tracker  # NaN: no evidence
    p = 3.48 / 4.96
    assert s.weights()[1].item() == pytest.approx(math.sqrt(p * (1 - p)) + 0.05)
    # a prompt always solved drifts toward weight epsilon
    for _ in range(200):
        s.observe([3], [1.0], [8])
    assert s.weights()[3].item() == pytest.approx(0.05, abs=0.02)


def test_spo_draw_frequencies_match_the_weights():
    s = build_sampler("spo", 5, seed=3)
    for row, rate in enumerate([0.5, 0.9, 1.0, 0.1, 0.5]):
        s.tracker.set(row, 1 + 20 * rate, 1 + 20 * (1 - rate), 1)
    w = s.weights()
    counts = Counter()
    n = 6000
    for _ in range(n):
        counts[s.next_indices(1)[0]] += 1
    for row in range(5):
        assert counts[row] / n == pytest.approx(float(w[row] / w.sum()), abs=0.02), row
    picks = s.next_indices(5)
    assert sorted(picks) == list(range(5))  # without replacement
    assert len(s.next_indices(12)) == 12 and set(s.next_indices(12)) == set(range(5))  # cycles
    assert set(s.last_stats()) == {"sampler/picked_p", "sampler/picked_weight", "sampler/seen_frac"}


def test_spo_attached_to_the_estimator_tracker():
    from mmalign.algorithms import advantages as adv

    state = adv.make_state("spo")
    s = build_sampler("spo", 3, seed=0)
    s.attach(state)
    ctx = adv.EstimatorContext(prompt_ids=torch.tensor([2, 2]))
    adv.spo(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), context=ctx, state=state, rho_mode="constant")
    assert s.tracker is state and 2 in state
    before = state.state_dict()
    s.observe([2], [0.0], [2])  # the estimator owns the updates
    assert torch.equal(state.state_dict()["alpha"], before["alpha"])
    p = state.p_hat(2)
    assert s.weights()[2].item() == pytest.approx(math.sqrt(p * (1 - p)) + 0.05)
    assert s.state_dict()["tracker"] is None and s.state_dict()["attached"] is True
    with pytest.raises(TypeError, match="SPOTracker"):
        s.attach({})


def test_spo_state_roundtrip_gives_identical_draws():
    a = build_sampler("spo", 7, seed=5)
    simulate(a, [0.1, 0.5, 0.9, 0.3, 0.7, 0.5, 0.2], rounds=5, n=3)
    state = roundtrip(a.state_dict())
    b = build_sampler("spo", 7, seed=5)
    b.load_state_dict(state)
    for _ in range(4):
        assert a.next_indices(3) == b.next_indices(3)
        a.observe([0, 1], [0.5, 1.0], [4, 4])
        b.observe([0, 1], [0.5, 1.0], [4, 4])
    with pytest.raises(ValueError, match="'vade' but this run uses 'spo'"):
        b.load_state_dict(roundtrip(build_sampler("vade", 7).state_dict()))
