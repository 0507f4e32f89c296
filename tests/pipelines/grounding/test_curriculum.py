"""MedLoc-R1 IoU-threshold curriculum (pipelines/grounding/curriculum.py).

Expected values are worked out by hand in the comments (window statistics, step sizes, the group
counts at which tau is raised), never with the module's own helpers.
"""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from pipelines.grounding.curriculum import (
    CurriculumCallback,
    IoUThresholdCurriculum,
    gates_for,
    piecewise_step,
)

NAN = float("nan")


def feed_one_per_step(c: IoUThresholdCurriculum, hits, ious) -> list[dict]:
    """One group per training step; returns the transitions."""
    out = []
    for h, i in zip(hits, ious, strict=True):
        t = c.observe([h], [i])
        if t is not None:
            out.append(t)
    return out


def perfect(n: int) -> tuple[list[float], list[float]]:
    return [1.0] * n, [1.0] * n


# ---------------------------------------------------------------------------------------- raise schedule
def test_perfect_groups_raise_at_expected_group_counts_and_stop_at_max():
    c = IoUThresholdCurriculum()
    ts = feed_one_per_step(c, *perfect(200))
    # first raise when the window of 30 fills; after it 15 entries are kept, so 15 new groups each time
    assert [t["step"] for t in ts] == [30, 45, 60, 75]
    assert [t["groups"] for t in ts] == [30, 45, 60, 75]
    assert [t["old"] for t in ts] == [0.3, 0.45, 0.6, 0.7]
    assert [t["new"] for t in ts] == [0.45, 0.6, 0.7, 0.8]
    assert all(t["direction"] == "raise" for t in ts)
    assert c.tau == 0.8
    assert len(c.entries) == 30  # full again, but tau is at the maximum: no raise
    t0 = ts[0]
    assert (t0["window_len"], t0["hit_rate"], t0["reward_std"], t0["mean_iou"]) == (30, 1.0, 0.0, 1.0)
    assert (t0["P"], t0["S"]) == (0.80, 0.20)
    assert (ts[2]["P"], ts[2]["S"]) == (0.75, 0.35)  # decided at tau = 0.6


def test_window_counts_groups_not_steps():
    c = IoUThresholdCurriculum()
    steps = []
    for step in range(1, 13):
        t = c.observe([1.0] * 8, [1.0] * 8)  # 8 groups per step
        if t is not None:
            steps.append((step, t["new"]))
    # 32 groups at step 4 (window full) -> raise, keep 15; +8 = 23 at step 5; 31 -> 30 at step 6 -> raise ...
    assert steps == [(4, 0.45), (6, 0.6), (8, 0.7), (10, 0.8)]


def test_tau_rounding_makes_the_gate_switch_exact():
    c = IoUThresholdCurriculum()
    feed_one_per_step(c, *perfect(45))
    assert c.tau == 0.6  # 0.3 + 0.15 + 0.15 in floats is 0.6000000000000001
    assert c.gates() == (0.75, 0.35)


def test_keep_after_raise_controls_groups_to_next_raise():
    c = IoUThresholdCurriculum(window=10, keep_after_raise=0.25)
    ts = feed_one_per_step(c, *perfect(40))
    # keep ceil(10 * 0.25) = 3 -> 7 new groups per raise: 10, 17, 24, 31
    assert [t["step"] for t in ts] == [10, 17, 24, 31]
    c = IoUThresholdCurriculum(window=10, keep_after_raise=0.0)
    assert [t["step"] for t in feed_one_per_step(c, *perfect(40))] == [10, 20, 30, 40]


def test_start_at_max_never_raises():
    c = IoUThresholdCurriculum(start=0.8, max_threshold=0.8)
    assert feed_one_per_step(c, *perfect(100)) == []
    assert c.tau == 0.8


# ---------------------------------------------------------------------------------------- each gate alone
def test_window_not_full_blocks():
    c = IoUThresholdCurriculum()
    assert feed_one_per_step(c, *perfect(29)) == []
    assert c.tau == 0.3
    assert c.observe([1.0], [1.0])["new"] == 0.45


@pytest.mark.parametrize(("hit", "raised"), [(0.79, False), (0.8, True)])
def test_hit_rate_gate(hit, raised):
    # std 0 (<= 0.2), mean IoU 0.9 - 0.3 = 0.6 (>= 0.1): only the hit rate (P = 0.8 at tau 0.3) decides
    c = IoUThresholdCurriculum()
    ts = feed_one_per_step(c, [hit] * 30, [0.9] * 30)
    assert bool(ts) is raised
    assert c.tau == (0.45 if raised else 0.3)


def test_std_gate():
    # 20 x 1.0 + 10 x 0.4: mean 24/30 = 0.8; var = 2/3 * 0.2^2 + 1/3 * 0.4^2 = 0.08 -> std 0.2828 > 0.2
    c = IoUThresholdCurriculum()
    hits = [1.0, 1.0, 0.4] * 10
    assert feed_one_per_step(c, hits, [0.9] * 30) == []
    hit, std, iou = c.window_stats()
    assert hit == pytest.approx(0.8)
    assert std == pytest.approx(math.sqrt(0.08))
    assert iou == pytest.approx(0.9)
    # 15 x 1.0 + 15 x 0.6: mean 0.8, std 0.2 exactly -> passes (<= S)
    c = IoUThresholdCurriculum()
    ts = feed_one_per_step(c, [1.0, 0.6] * 15, [0.9] * 30)
    assert len(ts) == 1
    assert ts[0]["reward_std"] == pytest.approx(0.2)
    assert ts[0]["hit_rate"] == pytest.approx(0.8)


@pytest.mark.parametrize(("iou", "raised"), [(0.39, False), (0.40, True)])
def test_iou_margin_gate(iou, raised):
    # hits perfect; 0.39 - 0.3 = 0.09 < 0.10 blocks; 0.40 - 0.3 = 0.10 passes
    c = IoUThresholdCurriculum()
    ts = feed_one_per_step(c, [1.0] * 30, [iou] * 30)
    assert bool(ts) is raised


def test_iou_margin_float_edge_at_0_6():
    # 0.7 - 0.6 is 0.09999999999999998 in floats: must still count as a margin of 0.10
    c = IoUThresholdCurriculum(start=0.6)
    assert feed_one_per_step(c, [1.0] * 30, [0.7] * 30)[0]["new"] == 0.7


def test_margin_option():
    c = IoUThresholdCurriculum(margin=0.3)
    assert feed_one_per_step(c, [1.0] * 30, [0.55] * 30) == []  # 0.25 < 0.3
    c = IoUThresholdCurriculum(margin=0.3)
    assert len(feed_one_per_step(c, [1.0] * 30, [0.6] * 30)) == 1


# ---------------------------------------------------------------------------------------- (P, S) switch
def test_gate_table():
    assert gates_for(0.3) == (0.80, 0.20)
    assert gates_for(0.5999) == (0.80, 0.20)
    assert gates_for(0.6) == (0.75, 0.35)
    assert gates_for(0.3 + 0.15 + 0.15) == (0.75, 0.35)
    assert gates_for(0.7499) == (0.75, 0.35)
    assert gates_for(0.75) == (0.55, 0.40)
    assert gates_for(0.8) == (0.55, 0.40)


@pytest.mark.parametrize(("start", "raised"), [(0.55, False), (0.6, True)])
def test_p_switch_at_0_6(start, raised):
    # hit 0.76: below P = 0.80 (tau < 0.6), above P = 0.75 (tau >= 0.6)
    c = IoUThresholdCurriculum(start=start)
    assert bool(feed_one_per_step(c, [0.76] * 30, [0.95] * 30)) is raised


@pytest.mark.parametrize(("start", "raised"), [(0.55, False), (0.6, True)])
def test_s_switch_at_0_6(start, raised):
    # mean 0.8 passes both P; std 0.2828 fails S = 0.20, passes S = 0.35
    c = IoUThresholdCurriculum(start=start)
    assert bool(feed_one_per_step(c, [1.0, 1.0, 0.4] * 10, [0.95] * 30)) is raised


@pytest.mark.parametrize(("start", "raised"), [(0.7, False), (0.75, True)])
def test_switch_at_0_75(start, raised):
    # 15 x 0.9 + 15 x 0.22: mean 0.56, std 0.34 -> P fails at 0.75 (tau 0.7), passes 0.55 (tau 0.75);
    # S 0.35 / 0.40 both pass
    c = IoUThresholdCurriculum(start=start)
    ts = feed_one_per_step(c, [0.9, 0.22] * 15, [0.95] * 30)
    assert bool(ts) is raised
    if raised:
        assert ts[0]["new"] == 0.8  # 0.75 + 0.05
        assert ts[0]["reward_std"] == pytest.approx(0.34)
        assert (ts[0]["P"], ts[0]["S"]) == (0.55, 0.40)


# ---------------------------------------------------------------------------------------- step sizes
def test_piecewise_steps():
    assert piecewise_step(0.3) == 0.15
    assert piecewise_step(0.5499) == 0.15
    assert piecewise_step(0.55) == 0.10
    assert piecewise_step(0.7) == 0.10
    assert piecewise_step(0.75) == 0.05


def test_linear_steps():
    c = IoUThresholdCurriculum(step_mode="linear")
    # f = (tau - 0.3) / 0.5: tau 0.3 -> 0.15; tau 0.45 -> f 0.3 -> 0.15 - 0.03 = 0.12; 0.55 -> f 0.5 -> 0.10
    assert c.step_size(0.3) == pytest.approx(0.15)
    assert c.step_size(0.45) == pytest.approx(0.12)
    assert c.step_size(0.55) == pytest.approx(0.10)
    assert c.step_size(0.8) == pytest.approx(0.05)
    ts = feed_one_per_step(c, *perfect(60))
    # 0.3 -> 0.45 -> 0.57 -> (f = 0.54: 0.15 - 0.054 = 0.096) 0.666
    assert [t["new"] for t in ts] == [pytest.approx(0.45), pytest.approx(0.57), pytest.approx(0.666)]


def test_cosine_steps():
    c = IoUThresholdCurriculum(step_mode="cosine")
    # 0.05 + 0.05 * (1 + cos(pi f)): f 0 -> 0.15; f 0.5 -> 0.10; f 1 -> 0.05;
    # f 0.3: cos(0.3 pi) = 0.587785 -> 0.05 + 0.05 * 1.587785 = 0.129389
    assert c.step_size(0.3) == pytest.approx(0.15)
    assert c.step_size(0.55) == pytest.approx(0.10)
    assert c.step_size(0.8) == pytest.approx(0.05)
    assert c.step_size(0.45) == pytest.approx(0.129389, abs=1e-6)
    ts = feed_one_per_step(c, *perfect(45))
    assert [t["new"] for t in ts] == [pytest.approx(0.45), pytest.approx(0.579389, abs=1e-6)]


# ---------------------------------------------------------------------------------------- step back
def test_step_back_on():
    c = IoUThresholdCurriculum(step_back=True)
    feed_one_per_step(c, *perfect(30))
    assert c.tau == 0.45 and len(c.entries) == 15
    # after k misses (k >= 15) the window holds 30 - k hits: mean (30 - k) / 30 < 0.2 first at k = 25
    ts = feed_one_per_step(c, [0.0] * 40, [0.0] * 40)
    assert len(ts) == 1
    t = ts[0]
    assert (t["step"], t["old"], t["new"], t["direction"]) == (55, 0.45, 0.3, "back")
    assert t["hit_rate"] == pytest.approx(5 / 30)
    # newest half kept after the step back (15), then 15 more misses: 30 misses, but tau is at the minimum
    assert c.tau == 0.3
    assert len(c.entries) == 30
    # mastering again raises 0.3 -> 0.45 as before
    ts = feed_one_per_step(c, *perfect(30))
    assert [t["new"] for t in ts] == [0.45]


def test_step_back_off_by_default():
    c = IoUThresholdCurriculum()
    feed_one_per_step(c, *perfect(30))
    assert feed_one_per_step(c, [0.0] * 100, [0.0] * 100) == []
    assert c.tau == 0.45


def test_step_back_floor():
    # no raise yet: the step back is the step tau would take (0.15), clamped at min_threshold
    c = IoUThresholdCurriculum(step_back=True, min_threshold=0.2)
    ts = feed_one_per_step(c, [0.0] * 30, [0.0] * 30)
    assert [(t["old"], t["new"]) for t in ts] == [(0.3, 0.2)]
    c = IoUThresholdCurriculum(step_back=True)  # min_threshold = start: nothing to go back to
    assert feed_one_per_step(c, [0.0] * 60, [0.0] * 60) == []


# ---------------------------------------------------------------------------------------- misc rule
def test_nan_groups_are_skipped():
    c = IoUThresholdCurriculum()
    assert c.observe([NAN, 1.0, 0.5], [0.2, 1.0, NAN]) is None
    assert list(c.entries) == [(1.0, 1.0)]
    assert c.groups == 1 and c.steps == 1


def test_metrics():
    c = IoUThresholdCurriculum()
    m = c.metrics()
    assert m["curriculum/tau"] == 0.3 and m["curriculum/window_fill"] == 0.0
    assert math.isnan(m["curriculum/window_hit_rate"]) and math.isnan(m["curriculum/window_mean_iou"])
    c.observe([1.0, 0.0, 1.0], [0.9, 0.3, 0.6])
    m = c.metrics()
    # 3 of 30 entries; hits 1,0,1: mean 2/3, std sqrt(2/9) = 0.4714; IoU mean 0.6
    assert m == {
        "curriculum/tau": 0.3,
        "curriculum/window_fill": pytest.approx(0.1),
        "curriculum/window_hit_rate": pytest.approx(2 / 3),
        "curriculum/window_reward_std": pytest.approx(math.sqrt(2 / 9)),
        "curriculum/window_mean_iou": pytest.approx(0.6),
        "curriculum/transitions": 0.0,
    }


@pytest.mark.parametrize(
    "kwargs",
    [
        {"start": -0.1},
        {"start": 0.5, "max_threshold": 0.4},
        {"max_threshold": 1.2},
        {"window": 0},
        {"window": 2.5},
        {"step_mode": "exp"},
        {"keep_after_raise": 1.5},
        {"step_back": "yes"},
        {"step_back_hit_rate": -1},
        {"min_threshold": 0.5},
        {"margin": float("nan")},
    ],
)
def test_bad_options(kwargs):
    key = next(iter(kwargs))
    with pytest.raises(ValueError, match=key):
        IoUThresholdCurriculum(**kwargs)


def test_observe_length_mismatch():
    with pytest.raises(ValueError, match="one of each per group"):
        IoUThresholdCurriculum().observe([1.0], [1.0, 1.0])


# ---------------------------------------------------------------------------------------- resume
def _scripted_steps(n_steps: int, seed: int = 0) -> list[tuple[list[float], list[float]]]:
    rng = random.Random(seed)
    steps = []
    for s in range(n_steps):
        good = (s // 40) % 3 != 2  # stretches of success, then a stretch of failure
        hits = [rng.choice([1.0, 1.0, 0.75] if good else [0.0, 0.0, 0.25]) for _ in range(4)]
        ious = [0.5 + 0.5 * rng.random() if good else 0.1 * rng.random() for _ in range(4)]
        if s % 7 == 0:
            hits[1] = NAN
        steps.append((hits, ious))
    return steps


def test_state_dict_round_trip_gives_identical_future():
    script = _scripted_steps(240)
    opts = {"step_back": True, "window": 12}
    full = IoUThresholdCurriculum(**opts)
    full_ts = [t for h, i in script if (t := full.observe(h, i)) is not None]
    assert {t["direction"] for t in full_ts} == {"raise", "back"}  # the script exercises both

    first = IoUThresholdCurriculum(**opts)
    for h, i in script[:97]:
        first.observe(h, i)
    state = json.loads(json.dumps(first.state_dict()))  # plain JSON-able types
    assert state == first.state_dict()
    resumed = IoUThresholdCurriculum(**opts)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == first.state_dict()
    for h, i in script[97:]:
        resumed.observe(h, i)
    assert resumed.transitions == full_ts
    assert resumed.state_dict() == full.state_dict()


# ---------------------------------------------------------------------------------------- callback
def fake_reward_set(threshold: float = 0.5):
    hit = SimpleNamespace(threshold=threshold)
    return SimpleNamespace(names=["format", "iou_at", "box_iou"], rewards=[object(), hit, object()]), hit


def test_callback_sets_threshold_only_at_step_end(tmp_path):
    rs, hit = fake_reward_set()
    cb = CurriculumCallback(IoUThresholdCurriculum(window=2), rs)
    assert hit.threshold == 0.3  # applied at construction
    trainer = SimpleNamespace(out=tmp_path, is_main=True)
    names = ["format", "iou_at", "box_iou"]
    rewards = torch.tensor(
        [[1.0, 1.0, 0.9], [1.0, 1.0, 0.8], [1.0, 1.0, NAN], [1.0, NAN, 0.7]], dtype=torch.float32
    )
    cb.on_rewards(trainer, rewards, torch.tensor([3, 3, 5, 5]), names)
    assert hit.threshold == 0.3
    metrics: dict = {"loss": 1.0}
    cb.on_step_end(trainer, 7, metrics)
    # groups: 3 -> hit 1, IoU 0.85; 5 -> hit 1 (NaN ignored), IoU 0.7 (NaN ignored): window full,
    # hit 1 >= 0.8, std 0, IoU 0.775 - 0.3 >= 0.1 -> raise to 0.45, keep ceil(2 * 0.5) = 1
    assert hit.threshold == 0.45
    assert metrics["loss"] == 1.0
    assert metrics["curriculum/tau"] == 0.45
    assert metrics["curriculum/window_fill"] == 0.5
    assert metrics["curriculum/window_mean_iou"] == pytest.approx(0.7)  # group 5 kept
    assert metrics["curriculum/transitions"] == 1.0
    lines = (tmp_path / "curriculum.jsonl").read_text().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert (rec["step"], rec["old"], rec["new"], rec["direction"]) == (7, 0.3, 0.45, "raise")
    assert rec["mean_iou"] == pytest.approx(0.775)
    # a step without a transition: metrics filled, nothing written
    misses = torch.tensor([[1.0, 0.0, 0.2], [1.0, 0.0, 0.3]])
    cb.on_rewards(trainer, misses, torch.tensor([0, 0]), names)
    m2: dict = {}
    cb.on_step_end(trainer, 8, m2)
    assert m2["curriculum/tau"] == 0.45 and hit.threshold == 0.45
    assert len((tmp_path / "curriculum.jsonl").read_text().splitlines()) == 1


def test_callback_split_rounds_equal_one_round(tmp_path):
    names = ["format", "iou_at", "box_iou"]
    g = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    r = torch.tensor(
        [[1.0, float(k % 3 != 0), 0.25 * (k % 4)] for k in range(8)],
        dtype=torch.float32,
    )
    trainer = SimpleNamespace(out=tmp_path, is_main=False)
    cbs = []
    for splits in ([8], [4, 4], [3, 3, 2]):
        rs, _ = fake_reward_set()
        cb = CurriculumCallback(IoUThresholdCurriculum(window=3), rs)
        lo = 0
        for n in splits:
            cb.on_rewards(trainer, r[lo : lo + n], g[lo : lo + n], names)
            lo += n
        cb.on_step_end(trainer, 1, {})
        cbs.append(cb.state_dict())
    assert cbs[0] == cbs[1] == cbs[2]
    # rows k: hit = (k % 3 != 0), IoU = 0.25 * (k % 4); per group (hit, IoU): 0 -> (0.5, 0.125),
    # 1 -> (0.5, 0.625), 2 -> (1, 0.125), 3 -> (0.5, 0.625); newest 3 kept, mean hit 2/3 < 0.8: no raise
    assert cbs[0]["curriculum"]["entries"] == [[0.5, 0.625], [1.0, 0.125], [0.5, 0.625]]
    assert cbs[0]["curriculum"]["tau"] == 0.3
    assert not (tmp_path / "curriculum.jsonl").exists()


def test_callback_not_main_writes_nothing(tmp_path):
    rs, hit = fake_reward_set()
    cb = CurriculumCallback(IoUThresholdCurriculum(window=1), rs)
    trainer = SimpleNamespace(out=tmp_path, is_main=False)
    cb.on_rewards(
        trainer, torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([0]), ["format", "iou_at", "box_iou"]
    )
    cb.on_step_end(trainer, 1, {})
    assert hit.threshold == 0.45
    assert not (tmp_path / "curriculum.jsonl").exists()


def test_callback_state_dict_reapplies_tau():
    rs, hit = fake_reward_set()
    cb = CurriculumCallback(IoUThresholdCurriculum(window=1), rs)
    trainer = SimpleNamespace(out=None, is_main=False)
    cb.on_rewards(
        trainer, torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([0]), ["format", "iou_at", "box_iou"]
    )
    cb.on_step_end(trainer, 1, {})
    state = cb.state_dict()
    rs2, hit2 = fake_reward_set()
    cb2 = CurriculumCallback(IoUThresholdCurriculum(window=1), rs2)
    assert hit2.threshold == 0.3
    cb2.load_state_dict(state)
    assert hit2.threshold == 0.45 == hit.threshold
    assert cb2.state_dict() == state


def test_callback_bad_columns():
    rs, _ = fake_reward_set()
    with pytest.raises(ValueError, match=r"'iou_hit'.*\['format', 'iou_at', 'box_iou'\]"):
        CurriculumCallback(IoUThresholdCurriculum(), rs, hit_reward="iou_hit")
    with pytest.raises(ValueError, match="iou_reward"):
        CurriculumCallback(IoUThresholdCurriculum(), rs, iou_reward="giou")
    with pytest.raises(ValueError, match="no `threshold` attribute"):
        CurriculumCallback(IoUThresholdCurriculum(), rs, hit_reward="format")


def test_resume_rewrites_the_transition_log_to_the_checkpoint(tmp_path):
    rs, _ = fake_reward_set()
    names = ["format", "iou_at", "box_iou"]
    trainer = SimpleNamespace(out=tmp_path, is_main=True)
    good = torch.tensor([[1.0, 1.0, 0.9], [1.0, 1.0, 0.9]])
    cb = CurriculumCallback(IoUThresholdCurriculum(window=2), rs)
    cb.on_rewards(trainer, good, torch.tensor([0, 1]), names)
    cb.on_step_end(trainer, 1, {})  # raise 0.3 -> 0.45
    saved = cb.state_dict()
    cb.on_rewards(trainer, good, torch.tensor([0, 1]), names)
    cb.on_step_end(trainer, 2, {})  # raise 0.45 -> 0.6, after the "checkpoint"
    assert len((tmp_path / "curriculum.jsonl").read_text().splitlines()) == 2
    # resume from the state saved after step 1: the log keeps only the first transition, then goes on
    rs2, hit2 = fake_reward_set()
    cb2 = CurriculumCallback(IoUThresholdCurriculum(window=2), rs2)
    cb2.load_state_dict(saved)
    assert hit2.threshold == 0.45
    cb2.on_rewards(trainer, good, torch.tensor([0, 1]), names)
    cb2.on_step_end(trainer, 2, {})
    lines = [json.loads(x) for x in (tmp_path / "curriculum.jsonl").read_text().splitlines()]
    assert [(x["step"], x["old"], x["new"]) for x in lines] == [(1, 0.3, 0.45), (2, 0.45, 0.6)]
