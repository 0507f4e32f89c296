"""ADORA (estimator:adora) against a plain-loop reference written from the authors' two functions, and
hand-worked numbers for each rule (the release's, the default, and the early one)."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from mmalign.algorithms import advantages as adv
from mmalign.algorithms.names import check_names
from mmalign.config import ConfigError, config_from_dict

NAN = float("nan")


def ref_adora(
    r, gids, lengths, rule="release", threshold=0.5, weight=0.1, max_length_threshold=3900, eps=1e-6
):
    """The release (ShadeCloak/ADORA c518485, compute_grpo_outcome_advantage_ADORA) and the early rule
    (commit 8f046a3, compute_grpo_outcome_advantage_length_weight), written as the authors' loops."""
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
        pos = [lengths[i] for i in members if r[i] > threshold]
        if rule == "release":
            neg = [lengths[i] for i in members if r[i] <= threshold and lengths[i] < max_length_threshold]
            max_pos = max(pos) if pos else -math.inf
            mean_neg = statistics.fmean(neg) if neg else -math.inf
            w = 1.0 if max_pos > mean_neg else weight
        else:
            neg = [lengths[i] for i in members if r[i] <= threshold]
            mean_neg = statistics.fmean(neg) if neg else math.inf
            w = 1.0 if not pos or max(pos) > mean_neg else weight
        for i in members:
            out[i] = w * ((r[i] - mean) / (sd + eps) if sd + eps > 0 else 0.0)
    return out


@pytest.mark.parametrize("rule", ["release", "early"])
def test_adora_matches_plain_loop(rule):
    rng = random.Random(5 + (rule == "early"))
    worst = 0.0
    for trial in range(80):
        gids = [g for g in rng.sample(range(100), rng.randint(1, 5)) for _ in range(rng.randint(1, 6))]
        rng.shuffle(gids)
        r = [NAN if rng.random() < 0.1 else rng.choice([0.0, 1.0, 0.3, 0.8]) for _ in gids]
        lengths = [rng.randint(0, 60) for _ in gids]
        threshold, weight, cut = (0.5, 0.1, 40) if trial % 2 else (0.7, 0.25, 25)
        got = adv.adora(
            torch.tensor(r, dtype=torch.float64),
            torch.tensor(gids),
            num_actions=torch.tensor(lengths),
            rule=rule,
            threshold=threshold,
            weight=weight,
            max_length_threshold=cut,
        )
        want = torch.tensor(ref_adora(r, gids, lengths, rule, threshold, weight, cut), dtype=torch.float64)
        diff = (got - want).abs().max().item()
        worst = max(worst, diff)
        assert diff < 1e-12, (trial, diff)
    print(f"estimator adora ({rule}) max abs diff vs plain loop: {worst:.3e}")


def test_adora_release_worked_example():
    """Issue 33 item 12: rewards [0, 1, 0, 1], lengths [4000, 300, 100, 200], one group.

    GRPO: mean 0.5, unbiased std sqrt(((0.5^2) * 4) / 3) = sqrt(1/3) = 0.57735, A = +-0.5 / 0.57735 = +-0.8660.
    Release: the wrong answer of length 4000 >= 3900 is left out, mean wrong length = 100;
             longest correct 300 > 100 -> full weight: +-0.866.
    Early:   mean wrong length = (4000 + 100) / 2 = 2050; longest correct 300 <= 2050 -> x 0.1: +-0.0866.
    """
    r = torch.tensor([0.0, 1.0, 0.0, 1.0])
    g = torch.zeros(4, dtype=torch.long)
    lengths = [4000, 300, 100, 200]
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert a == pytest.approx(0.8660, abs=1e-4)
    full = torch.tensor([-a, a, -a, a])
    torch.testing.assert_close(adv.adora(r, g, num_actions=lengths), full)
    torch.testing.assert_close(adv.adora(r, g, num_actions=lengths, rule="release"), full)
    torch.testing.assert_close(adv.adora(r, g, num_actions=lengths, rule="early"), 0.1 * full)
    # the cut is an option: at 5000 the long wrong answer counts again (mean 2050) -> x 0.1
    torch.testing.assert_close(adv.adora(r, g, num_actions=lengths, max_length_threshold=5000), 0.1 * full)


def test_adora_release_no_correct_and_all_correct_groups():
    """The two group kinds the early rule treats the other way round (partial-credit rewards, so the GRPO
    advantages are not 0). threshold 0.5: rewards 0.2 / 0.4 are wrong, 0.8 / 1.0 correct."""
    # group 0: no correct answer. GRPO: mean 0.3, std sqrt(2 * 0.1^2 / 1) = 0.141421, A = +-0.1 / 0.141421 = +-0.7071
    # group 1: all correct: mean 0.9, same std, A = +-0.7071
    r = torch.tensor([0.2, 0.4, 0.8, 1.0])
    g = torch.tensor([0, 0, 1, 1])
    lengths = [10, 20, 30, 40]
    a = 0.1 / (math.sqrt(0.02) + 1e-6)
    assert a == pytest.approx(0.7071, abs=1e-4)
    # release: no correct answer -> x 0.1; all correct -> full weight
    want_release = torch.tensor([-0.1 * a, 0.1 * a, -a, a])
    torch.testing.assert_close(adv.adora(r, g, num_actions=lengths), want_release)
    # early: no correct answer -> full weight; all correct (mean of no wrong answer = +inf) -> x 0.1
    want_early = torch.tensor([-a, a, -0.1 * a, 0.1 * a])
    torch.testing.assert_close(adv.adora(r, g, num_actions=lengths, rule="early"), want_early)


def test_adora_hand_worked_shared_rule_and_errors():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0])
    g = torch.tensor([0, 0, 1, 1])
    a = 1 / (math.sqrt(0.5) + 1e-6)  # GRPO: (1 - 0.5) / stdev([1, 0])
    # both rules: group 0: correct answer 40 tokens > wrong 20 -> full weight; group 1: correct 5 <= wrong 30 -> 0.1
    for rule in ("release", "early"):
        got = adv.adora(r, g, num_actions=[40, 20, 5, 30], rule=rule)
        torch.testing.assert_close(got, torch.tensor([a * 0.5, -a * 0.5, 0.05 * a, -0.05 * a]))
    assert adv.accepts_num_actions("adora")
    assert adv.options("adora") == {
        "weights": None,
        "rule": "release",
        "threshold": 0.5,
        "weight": 0.1,
        "max_length_threshold": 3900.0,
        "eps": 1e-6,
    }
    with pytest.raises(ValueError, match="num_actions"):
        adv.adora(r, g)
    with pytest.raises(ValueError, match="weight"):
        adv.adora(r, g, num_actions=[1, 1, 1, 1], weight=-1.0)
    with pytest.raises(ValueError, match="rule"):
        adv.adora(r, g, num_actions=[1, 1, 1, 1], rule="paper")
    with pytest.raises(ValueError, match="max_length_threshold"):
        adv.adora(r, g, num_actions=[1, 1, 1, 1], max_length_threshold=0)


def test_adora_rule_is_checked_with_the_config(tmp_path) -> None:
    def cfg(**kwargs):
        return config_from_dict(
            {
                "pipeline": "text_reasoning",
                "output_dir": str(tmp_path),
                "model": {"name_or_path": "x"},
                "rewards": [{"name": "format"}],
                "algorithm": {"estimator": "adora", "estimator_kwargs": kwargs},
            }
        )

    for ok in ({}, {"rule": "release"}, {"rule": "early", "weight": 0.2}):
        check_names(cfg(**ok))
    with pytest.raises(ConfigError, match=r"algorithm\.estimator_kwargs\.rule.*'release', 'early'.*'relase'"):
        check_names(cfg(rule="relase"))
