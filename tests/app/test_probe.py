"""`mmalign probe` (mmalign/app/probe.py): the zero-spread share against a hand-worked example and a brute-force
enumeration, the box-convention detection on answers written in a known convention, the statistics against
NumPy, the recommendation rules, the parse rates, the command end to end on the tiny text and grounding configs,
and its user errors (one `mmalign: error:` line, before any model is built)."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from mmalign.app.cli import main
from mmalign.app.probe import (
    box_convention_scores,
    distribution,
    histogram,
    parse_rates,
    raw_box,
    recommend,
    zero_spread_share,
    zero_spread_table,
)
from rewards import RewardBatch, RewardSet
from rewards.boxes import from_absolute

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------ zero spread
def test_zero_spread_share_hand_worked() -> None:
    # rewards 1, 1, 1, 0 of one prompt; groups of 2 drawn from the 4: 6 pairs, the 3 pairs of ones are flat
    assert zero_spread_share([1, 1, 1, 0], 2) == pytest.approx(3 / 6)
    # groups of 3: 4 triples, only {1, 1, 1} is flat
    assert zero_spread_share([1, 1, 1, 0], 3) == pytest.approx(1 / 4)
    # the whole group (G = N): flat only if every value is equal
    assert zero_spread_share([1, 1, 1, 0], 4) == 0.0
    assert zero_spread_share([0.5, 0.5, 0.5], 3) == 1.0
    # NaN: pairs of [1, NaN, 0, 0]: {1,NaN} flat (one value), {1,0} x2 not, {NaN,0} x2 flat, {0,0} flat -> 4 / 6
    assert zero_spread_share([1, math.nan, 0, 0], 2) == pytest.approx(4 / 6)
    with pytest.raises(ValueError):
        zero_spread_share([1, 0], 3)


def _brute_force(values: list[float], g: int) -> float:
    """Share of all g-subsets whose non-NaN values are all equal (fewer than two counting as flat)."""
    flat = total = 0
    for sub in itertools.combinations(values, g):
        finite = {v for v in sub if not math.isnan(v)}
        flat += len(finite) <= 1
        total += 1
    return flat / total


def test_zero_spread_share_matches_enumeration() -> None:
    rng = random.Random(0)
    for _ in range(30):
        n = rng.randint(2, 9)
        values = [rng.choice([0.0, 0.5, 1.0, math.nan]) for _ in range(n)]
        for g in range(1, n + 1):
            assert zero_spread_share(values, g) == pytest.approx(_brute_force(values, g)), (values, g)


def test_zero_spread_table_averages_prompts() -> None:
    values = torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    group = torch.tensor([0, 0, 0, 0, 5, 5, 5, 5])
    table = zero_spread_table(values, group, [2, 4])
    assert table[2] == pytest.approx((0.5 + 1.0) / 2)
    assert table[4] == pytest.approx((0.0 + 1.0) / 2)


# ------------------------------------------------------------------------------------------ statistics
def test_distribution_and_histogram() -> None:
    x = torch.tensor([0.0, 1.0, 2.0, 3.0, 10.0, math.nan])
    d = distribution(x)
    finite = np.array([0.0, 1.0, 2.0, 3.0, 10.0])
    assert d["count"] == 5 and d["nan_rate"] == pytest.approx(1 / 6)
    assert d["mean"] == pytest.approx(finite.mean()) and d["std"] == pytest.approx(finite.std())
    for q in (10, 25, 50, 75, 90):
        assert d[f"q{q}"] == pytest.approx(np.quantile(finite, q / 100))
    lines = histogram(torch.tensor([0.0, 0.0, 1.0]))
    assert lines[0].split()[0] == "0" and lines[0].split()[-1] == "2" and lines[1].split()[-1] == "1"
    many = histogram(torch.arange(100, dtype=torch.float32), bins=4)
    assert [int(s.split()[-1]) for s in many] == [25, 25, 25, 25]


def test_recommend_rules() -> None:
    zero = {4: 0.8, 8: 0.6, 16: 0.3, 32: 0.1}
    advice = recommend(zero, 8, informative=0.5, mean_total=0.1, solved=0.0, unsolved=0.5)
    assert "16 is the smallest" in advice[0] and "raise rollout.group_size to 16" in advice[0]
    assert "dynamic_sampling" in advice[1] and "max_rounds: 3" in advice[1]  # ceil(1 / 0.4)
    assert "never solved" in advice[2]
    calm = recommend({4: 0.05, 8: 0.0}, 8, informative=0.5)
    assert "keep it" in calm[0] and "no filter needed" in calm[1] and "no curriculum" in calm[2]


# ------------------------------------------------------------------------------------------ parse rates
def test_parse_rates_from_rewards() -> None:
    rset = RewardSet(
        [
            {"name": "answer_accuracy", "kwargs": {"extract": "tag"}},
            {"name": "box_iou"},
            {"name": "format", "kwargs": {"tags": ["answer"]}},
        ]
    )
    texts = ["<answer>3</answer>", "3", "<answer>[1, 2, 5, 6]</answer>", "nothing"]
    batch = RewardBatch(
        prompts=["p"] * 4,
        outputs={"texts": texts},
        columns={"answer": ["3"] * 4, "boxes": [[1, 2, 5, 6]] * 4},
    )
    rset(batch)
    rates = parse_rates(rset, texts)
    assert rates["answer_accuracy"] == pytest.approx(2 / 4)  # two completions have an <answer> tag
    assert rates["box_iou"] == pytest.approx(1 / 4)  # one box among the four ("3" is not a box)
    assert rates["format"] is None


# ------------------------------------------------------------------------------------------ box conventions
def _write(box: tuple[float, ...], fmt: str, digits: int) -> str:
    x1, y1, x2, y2 = box
    vals = (x1, y1, x2, y2) if fmt == "xyxy" else (x1, y1, x2 - x1, y2 - y1)
    return "<answer>[" + ", ".join(f"{v:.{digits}f}" for v in vals) + "]</answer>"


@pytest.mark.parametrize("convention", ["absolute", "resized", "norm1000", "norm1"])
@pytest.mark.parametrize("fmt", ["xyxy", "xywh"])
def test_box_convention_detected(convention: str, fmt: str) -> None:
    rng = random.Random(1)
    original, resized = (200.0, 100.0), (112.0, 56.0)
    texts, refs = [], []
    for _ in range(12):
        x1, y1 = rng.uniform(10, 120), rng.uniform(5, 50)
        ref = (x1, y1, x1 + rng.uniform(20, 70), y1 + rng.uniform(10, 40))
        written = from_absolute(ref, convention, original, resized)
        texts.append(_write(written, fmt, 5 if convention == "norm1" else 2))
        refs.append([list(ref)])
    rows = box_convention_scores(texts, refs, [original] * 12, [resized] * 12)
    best = rows[0]
    assert (best["convention"], best["format"]) == (convention, fmt)
    assert best["mean_iou"] > 0.97 and best["hit_rate"] == 1.0 and best["scored"] == 12
    others = [r["mean_iou"] for r in rows[1:]]
    assert max(others) < best["mean_iou"] - 0.05


def test_box_convention_needs_sizes() -> None:
    rows = box_convention_scores(["<answer>[1, 2, 3, 4]</answer>"], [[1, 2, 3, 4]], [None])
    by = {(r["convention"], r["format"]): r for r in rows}
    assert by[("absolute", "xyxy")]["mean_iou"] == pytest.approx(1.0)
    assert by[("norm1000", "xyxy")]["missing"] == "no original image size"


def test_raw_box_keeps_written_order() -> None:
    # an xywh box whose width is smaller than x: parse_box would reorder the corners, raw_box must not
    assert raw_box("<answer>[40, 30, 10, 5]</answer>") == (40.0, 30.0, 10.0, 5.0)
    assert raw_box('{"bbox_2d": [1, 2, 3, 4]} then [5, 6, 7, 8]') == (5.0, 6.0, 7.0, 8.0)
    assert raw_box("no box") is None


# ------------------------------------------------------------------------------------------ end to end
def test_probe_text_tiny_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    out = tmp_path / "probe.json"
    rc = main(
        ["probe", "configs/text_reasoning-tiny.yaml", "-n", "3", "--group-sizes", "2,4", "--json", str(out)]
    )
    text = capsys.readouterr().out
    assert rc == 0
    for heading in ("# mmalign probe", "## Rewards", "## Zero reward spread", "## Recommendation"):
        assert heading in text
    report = json.loads(out.read_text())
    assert report["prompts"] == 3 and report["samples_per_prompt"] == 8  # the config's G = 8 is the largest
    assert report["group_sizes"] == [2, 4, 8]
    assert set(report["rewards"]) == {"answer_accuracy", "format"}
    acc = report["rewards"]["answer_accuracy"]
    assert acc["parse_rate"] is not None and 0 <= acc["parse_rate"] <= 1
    assert acc["count"] == 24 and acc["nan_rate"] == 0
    for entry in [*report["rewards"].values(), report["total"]]:
        shares = [entry["zero_spread"][str(g)] for g in (2, 4, 8)]
        assert all(0 <= s <= 1 for s in shares)
        assert shares[0] >= shares[1] >= shares[2]  # a larger group is flat less often
    assert report["recommendations"] and "box_conventions" not in report


def test_probe_grounding_tiny_detects_resized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    out = tmp_path / "probe.json"
    rc = main(["probe", "configs/medloc-tiny.yaml", "-n", "2", "--group-sizes", "4", "--json", str(out)])
    assert rc == 0
    assert "## Box coordinate conventions" in capsys.readouterr().out
    report = json.loads(out.read_text())
    check = report["box_conventions"][0]
    assert check["configured"] == "resized"
    # the tiny MedLoc model was warm-started to answer in pixels of its 56 x 56 input
    assert check["best"] == "resized/xyxy" and check["matches_config"]
    assert {(r["convention"], r["format"]) for r in check["conventions"]} == {
        (c, f) for c in ("absolute", "resized", "norm1000", "norm1") for f in ("xyxy", "xywh")
    }


def test_probe_diffusion_tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    from mmalign.app.probe import load_setup, probe, render

    monkeypatch.chdir(ROOT)
    cfg, components = load_setup("configs/text_to_image-tiny.yaml", [], need_rewards=True, command="probe")
    report = probe(cfg, components, prompts=1, group_sizes=[2])
    assert report["samples_per_prompt"] == 16 and report["group_sizes"] == [2, 16]
    d = report["rewards"]["shapes_compositional"]
    assert d["count"] == 16 and d["parse_rate"] is None and 0 <= d["mean"] <= 1
    assert "shapes_compositional" in render(report)


# ------------------------------------------------------------------------------------------ user errors
def test_probe_bad_config_path(no_model: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "does/not/exist.yaml"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mmalign: error: config file not found: does/not/exist.yaml"]


def test_probe_config_without_rewards(
    tmp_path: Path, no_model: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    data = yaml.safe_load((ROOT / "configs" / "text_reasoning-tiny.yaml").read_text())
    data["rewards"] = []
    path = tmp_path / "norewards.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["probe", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmalign: error:") and "'rewards'" in err[0]
