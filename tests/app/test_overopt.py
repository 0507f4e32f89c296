"""The over-optimisation watchdog (`mmalign.app.overopt`, ``eval.watchdog``): image statistics against
hand-worked values, the divergence rule, and real tiny text-to-image runs: the watchdog leaves training
unchanged, resumes exactly, keeps ``best/``, stops after the step's checkpoint; the hacked config (slow)
shows it flagging a real reward hack."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from mmalign.app import overopt
from mmalign.app.overopt import (
    Evaluation,
    OverOptimisationStop,
    WatchdogState,
    background_uniformity,
    colour_entropy,
    high_frequency_energy,
    image_statistics,
    ratio_bias,
    saturation,
)
from mmalign.app.run import build_trainer
from mmalign.config import WatchdogConfig, load_config
from mmalign.training import rundir

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "text_to_image-tiny.yaml"
HACKED = REPO / "configs" / "text_to_image-hacked-tiny.yaml"
ASSETS = REPO / "assets" / "text_to_image"
MODEL = REPO / "assets" / "models" / "text_to_image-tiny"

# ----------------------------------------------------------------------------- image statistics


def test_saturation_hand_worked() -> None:
    # pixels (1, .5, .5): S = .5; black: 0; white: 0; (.2, .1, 0): (.2 - 0) / .2 = 1  -> mean .375
    img = torch.tensor(
        [[[1.0, 0.0], [1.0, 0.2]], [[0.5, 0.0], [1.0, 0.1]], [[0.5, 0.0], [1.0, 0.0]]]
    ).unsqueeze(0)
    assert saturation(img).tolist() == pytest.approx([0.375])


def test_colour_entropy_hand_worked() -> None:
    one = torch.ones(1, 3, 2, 2)
    two = one.clone()
    two[0, :, 0, :] = 0.0  # half black, half white: 1 bit
    four = torch.zeros(1, 3, 2, 2)  # four distinct colours with 2 levels: 2 bits
    four[0, 0, 0, 1] = 1.0
    four[0, 1, 1, 0] = 1.0
    four[0, 2, 1, 1] = 1.0
    assert colour_entropy(torch.cat([one, two, four]), levels=2).tolist() == pytest.approx([0.0, 1.0, 2.0])
    # 4 levels: 0.2 -> floor(0.8) = bin 0, 0.3 -> floor(1.2) = bin 1: two bins, one pixel each -> 1 bit
    near = torch.full((1, 3, 1, 2), 0.2)
    near[0, :, 0, 1] = 0.3
    assert colour_entropy(near, levels=4).tolist() == pytest.approx([1.0])


def test_high_frequency_energy_hand_worked() -> None:
    n = 16
    x = torch.arange(n, dtype=torch.float64)
    low = torch.cos(2 * math.pi * x / n)[None, :].expand(n, n)  # frequency 1/16 < 0.25
    checker = (-1.0) ** (x[:, None] + x[None, :])  # frequency (1/2, 1/2): radius 0.707 > 0.25
    # power: the cosine a cos puts (N^2 a / 2)^2 in each of two bins, the checkerboard (N^2 b)^2 in one:
    # high share = b^2 / (b^2 + a^2 / 2); a = 0.2, b = 0.1 -> 1/3
    y = 0.5 + 0.2 * low + 0.1 * checker
    img = y.float()[None, None].expand(1, 3, n, n)  # grey: the luminance is y itself
    flat = torch.full((1, 3, n, n), 0.4)
    only_low = (0.5 + 0.2 * low).float()[None, None].expand(1, 3, n, n)
    out = high_frequency_energy(torch.cat([img, flat, only_low]))
    assert out.tolist() == pytest.approx([1 / 3, 0.0, 0.0], abs=1e-5)


def test_background_uniformity_hand_worked() -> None:
    white = torch.ones(1, 3, 8, 8)
    assert background_uniformity(white).tolist() == pytest.approx([1.0])
    img = white.clone()
    img[0, :, 3:5, 3:5] = 0.0  # an object in the middle does not count
    assert background_uniformity(img).tolist() == pytest.approx([1.0])
    img[0, :, 0, :] = 0.0  # top and bottom rows black: 16 of the 28 ring pixels (ring width round(8/8) = 1)
    img[0, :, 7, :] = 0.0
    p = 16 / 28
    assert background_uniformity(img).tolist() == pytest.approx([1 - 2 * math.sqrt(p * (1 - p))], abs=1e-6)


def test_image_statistics_of_clips_average_the_frames() -> None:
    a, b = torch.rand(2, 3, 8, 8), torch.rand(2, 3, 8, 8)
    clip = torch.stack([a, b], dim=1)  # [B=2, F=2, 3, H, W]
    stats = image_statistics(clip)
    assert set(stats) == set(overopt.IMAGE_STATS)
    for name, fn in overopt.IMAGE_STATS.items():
        want = (fn(a) + fn(b)) / 2
        assert torch.allclose(stats[name], want, atol=1e-6), name


def test_ratio_bias_matches_a_plain_loop() -> None:
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(4, 3, generator=g) * 0.1, torch.randn(4, 3, generator=g) * 0.1
    mask = torch.tensor([[1, 1, 1], [1, 0, 1], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    steps = torch.tensor([[0, 3, 7], [3, 7, 9], [0, 7, 9], [0, 3, 9]])
    got = ratio_bias(logp, old, mask, steps)
    want: dict[int, list[float]] = {}
    for i in range(4):
        for t in range(3):
            if mask[i, t]:
                want.setdefault(int(steps[i, t]), []).append(math.exp(float(logp[i, t] - old[i, t])) - 1)
    assert sorted(got) == sorted(want)
    for k, values in want.items():
        assert got[k][1] == len(values)
        assert got[k][0] == pytest.approx(sum(values))


# ----------------------------------------------------------------------------- the divergence rule


def ev(step: int, gold: float, train: float, sat: float = 0.1) -> Evaluation:
    return Evaluation(
        step=step,
        gold={"g": gold},
        gold_total=gold,
        train_total=train,
        stats={"saturation": sat},
        stats_std={"saturation": 0.04},
    )


def test_divergence_needs_patience_and_a_holding_training_reward() -> None:
    state = WatchdogState(patience=2, tolerance=0.05)
    seq = [
        ev(0, 0.50, 0.10),
        ev(2, 0.60, 0.12),  # best
        ev(4, 0.52, 0.20),  # within tolerance? 0.60 - 0.05 = 0.55 > 0.52: below, train held -> 1
        ev(6, 0.58, 0.25),  # back within tolerance: the run of falls ends
        ev(8, 0.50, 0.30),  # below (1)
        ev(10, 0.40, 0.35, sat=0.3),  # below (2): divergence began at 8
        ev(12, 0.30, 0.40),  # still diverging, no second warning
    ]
    records = [state.observe(e) for e in seq]
    assert [r["diverging"] for r in records] == [False, False, False, False, False, True, True]
    assert [r["best_step"] for r in records] == [0, 2, 2, 2, 2, 2, 2]
    assert records[5]["diverged_since"] == 8
    warnings = [r["warning"] for r in records if r["warning"]]
    assert len(warnings) == 1
    assert "divergence began at step 8" in warnings[0]
    assert "fell from 0.6000 (step 2) to 0.4000 (step 10)" in warnings[0]
    # saturation 0.1 -> 0.3 with base std 0.04: +0.2, +4.0 base std (0.2 / (0.04 + 0.01))
    assert "saturation 0.100 -> 0.300 (+0.200, +4.0 base std)" in warnings[0]
    # a gold fall while the training reward falls too is not over-optimisation
    other = WatchdogState(patience=1, tolerance=0.0)
    other.observe(ev(0, 0.5, 0.5))
    assert not other.observe(ev(1, 0.4, 0.4))["diverging"]
    # replay of the log rebuilds the same state
    again = WatchdogState.replay(records[:6], WatchdogConfig(patience=2, tolerance=0.05))
    assert (again.best.step, again.diverged_since, again.below) == (2, 8, [8, 10])


def test_record_metrics_gap_and_drift() -> None:
    state = WatchdogState(patience=1, tolerance=0.0)
    state.observe(ev(0, 0.5, 0.1, sat=0.1))
    rec = state.observe(ev(3, 0.4, 0.3, sat=0.2))
    m = overopt.record_metrics(rec, state.base)
    assert m["watchdog/gap"] == pytest.approx((0.3 - 0.1) - (0.4 - 0.5))
    assert m["watchdog/drift/saturation"] == pytest.approx(0.1)
    assert m["watchdog/drift_z/saturation"] == pytest.approx(0.1 / 0.05)
    assert m["watchdog/diverging"] == 1.0 and m["watchdog/diverged_since"] == 3.0


# ----------------------------------------------------------------------------- real tiny runs


SMALL = [
    f"model.name_or_path={MODEL}",
    f"data.train={ASSETS / 'train.jsonl'}",
    f"data.eval={ASSETS / 'eval.jsonl'}",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "options.num_steps=3",
    "trainer.sample_every=2",
    "trainer.progress_bar=false",
]
GOLD = ["eval.rewards=[{name: shapes_compositional}]"]


def tiny_cfg(out: Path, *extra: str) -> Any:
    return load_config(TINY, [f"output_dir={out}", *SMALL, *extra])


def train(cfg: Any, *, resume: bool = False) -> list[dict[str, Any]]:
    import pipelines
    from mmalign.training.seeding import set_seed

    set_seed(cfg.seed)
    trainer = build_trainer(cfg, pipelines.get(cfg.pipeline)(cfg), resume=resume)
    return trainer.train()


def training_numbers(run: Path) -> list[dict[str, Any]]:
    """metrics.jsonl without timings and the watchdog's own numbers."""
    return [
        {k: v for k, v in row.items() if not k.startswith(("time/", "watchdog/"))}
        for row in rundir.read_metrics(run)
    ]


@pytest.mark.parametrize(
    "policy_seed", ["null", "7"]
)  # the noise from the global RNG / the policy's generator
def test_watchdog_leaves_training_unchanged_and_keeps_best(tmp_path: Path, policy_seed: str) -> None:
    on, off = tmp_path / "on", tmp_path / "off"
    # two updates per rollout: logp_old, so the ratio bias is measured too
    common = ["trainer.steps=4", "trainer.num_iterations=2", f"options.seed={policy_seed}"]
    train(tiny_cfg(off, *common))
    train(tiny_cfg(on, *common, *GOLD, "eval.watchdog.every=2", "eval.watchdog.prompts=3"))
    assert training_numbers(on) == training_numbers(off)
    from safetensors.torch import load_file

    a = load_file(str(on / "checkpoints" / "step_000004" / rundir.TRAINABLE_FILE))
    b = load_file(str(off / "checkpoints" / "step_000004" / rundir.TRAINABLE_FILE))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the watchdog's numbers at steps 2 and 4 (not at 1 and 3), its log with the base evaluation at step 0
    rows = {r["step"]: r for r in rundir.read_metrics(on)}
    assert "watchdog/gold" not in rows[1] and "watchdog/gold" in rows[2] and "watchdog/gold" in rows[4]
    for key in ("watchdog/train_reward", "watchdog/drift/saturation", "watchdog/stat/background_uniformity"):
        assert math.isfinite(rows[4][key]), key
    bias = [k for k in rows[4] if k.startswith("watchdog/ratio_bias/step_")]
    assert bias and all(math.isfinite(rows[4][k]) for k in bias)
    log = overopt.read_log(on)
    assert [r["step"] for r in log] == [0, 2, 4]
    assert log[0]["stats"]["saturation"] >= 0 and log[0]["gold"]["shapes_compositional"] >= 0
    # best/: the policy's save of the best evaluation, its step named inside
    info = json.loads((on / overopt.BEST_DIR / overopt.BEST_INFO).read_text())
    best = max(log, key=lambda r: (r["gold_total"], -r["step"]))
    assert info["step"] == best["step"] and info["gold"] == pytest.approx(best["gold_total"])
    assert (on / overopt.BEST_DIR / "transformer").is_dir()


def test_resume_replays_the_log_exactly(tmp_path: Path) -> None:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    args = [
        "trainer.steps=4",
        "trainer.save_every=2",
        *GOLD,
        "eval.watchdog.every=1",
        "eval.watchdog.prompts=2",
    ]
    train(tiny_cfg(whole, *args))
    train(tiny_cfg(cut, *args))
    shutil.rmtree(
        cut / "checkpoints" / "step_000004"
    )  # killed after step 4 was logged, before its checkpoint
    train(tiny_cfg(cut, *args), resume=True)
    assert overopt.read_log(cut) == overopt.read_log(whole)
    assert training_numbers(cut) == training_numbers(whole)


def test_stop_ends_the_run_after_the_step_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scripted gold curve (the measurement replaced, the trainer real): best at step 1, below it at 2 and
    3 while the training reward rises -> the warning at step 3 and the stop after step 3's checkpoint."""
    script = {0: (0.5, 0.1), 1: (0.6, 0.2), 2: (0.4, 0.3), 3: (0.3, 0.4)}

    def measure(self: Any, trainer: Any, step: int) -> Evaluation:
        gold, train_r = script[step]
        return Evaluation(
            step=step, gold={"shapes_compositional": gold}, gold_total=gold, train_total=train_r
        )

    monkeypatch.setattr(overopt.OverOptMonitor, "_measure", measure)
    out = tmp_path / "run"
    cfg = tiny_cfg(
        out,
        "trainer.steps=6",
        "trainer.save_every=5",
        *GOLD,
        "eval.watchdog.every=1",
        "eval.watchdog.stop=true",
    )
    with pytest.raises(
        OverOptimisationStop, match=r"stopped after step 3.*divergence began at step 2"
    ) as err:
        train(cfg)
    assert "checkpoints/step_000003" in str(err.value)
    assert rundir.latest_checkpoint(out).name == "step_000003"
    assert [r["step"] for r in rundir.read_metrics(out)] == [1, 2, 3]
    assert rundir.read_metrics(out)[-1]["watchdog/diverged_since"] == 2
    assert not (out / rundir.FINAL_DIR).exists()
    assert json.loads((out / overopt.BEST_DIR / overopt.BEST_INFO).read_text())["step"] == 1
    assert cfg.trainer.steps == 6  # the config is given back as it was


def test_watchdog_needs_gold_rewards(tmp_path: Path) -> None:
    from mmalign.config import ConfigError

    with pytest.raises(ConfigError, match=r"eval\.watchdog\.every.*eval\.rewards"):
        tiny_cfg(tmp_path, "eval.watchdog.every=2")


@pytest.mark.slow
def test_hacked_config_flags_divergence_while_gold_falls(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """configs/text_to_image-hacked-tiny.yaml as shipped (30 steps on `saturation`, gold
    `shapes_compositional`): the proxy rises, the gold reward falls, the watchdog warns and stops the run."""
    out = tmp_path / "hacked"
    cfg = load_config(HACKED, [f"output_dir={out}", "trainer.progress_bar=false"])
    with caplog.at_level("WARNING", logger="mmalign.app.overopt"), pytest.raises(OverOptimisationStop) as err:
        train(cfg)
    log = overopt.read_log(out)
    flagged = [r for r in log if r["warning"]]
    assert len(flagged) == 1 and str(flagged[0]["warning"]) in str(err.value)
    at = flagged[0]
    best = next(r for r in log if r["step"] == at["best_step"])
    assert at["gold_total"] < best["gold_total"] - cfg.eval.watchdog.tolerance  # the gold reward fell
    assert at["train_total"] > best["train_total"] > log[0]["train_total"]  # while saturation rose
    assert at["stats"]["saturation"] > log[0]["stats"]["saturation"]
    assert any("[watchdog] over-optimisation" in r.getMessage() for r in caplog.records)
    assert rundir.latest_checkpoint(out).name == rundir.step_name(at["step"])
    assert json.loads((out / overopt.BEST_DIR / overopt.BEST_INFO).read_text())["step"] == at["best_step"]
    print(
        "\n".join(
            f"step {r['step']:>2}: gold {r['gold_total']:.4f} saturation {r['train_total']:.4f}" for r in log
        )
    )
    print(at["warning"])


def test_standard_monitors_add_the_watchdog_last_with_the_held_out_rows(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from mmalign.app.run import standard_monitors

    rows = [{"prompt": f"p{i}"} for i in range(5)]
    parts = SimpleNamespace(eval_data=rows, data=[{"prompt": "train"}])
    cfg = tiny_cfg(tmp_path, *GOLD, "eval.watchdog.every=2", "eval.watchdog.prompts=3")
    monitors = standard_monitors(cfg, components=parts)
    assert isinstance(monitors[-1], overopt.OverOptMonitor) and monitors[-1].rows == rows[:3]
    no_eval = standard_monitors(cfg, components=SimpleNamespace(eval_data=[], data=rows[:1]))
    assert no_eval[-1].rows == rows[:1]  # no data.eval: the training rows
    assert not any(
        isinstance(m, overopt.OverOptMonitor) for m in standard_monitors(tiny_cfg(tmp_path), components=parts)
    )
    assert not any(isinstance(m, overopt.OverOptMonitor) for m in standard_monitors(cfg))  # no components


def test_watchdog_leaves_a_text_run_unchanged(tmp_path: Path) -> None:
    """The token policy: sampling reseeds the global RNGs and the policy's ``engine_seed``; both are given back.
    Text has no image statistics and no ratio bias (one update per rollout)."""
    text = REPO / "configs" / "text_reasoning-tiny.yaml"
    common = [
        f"model.name_or_path={REPO / 'assets' / 'models' / 'text_reasoning-tiny'}",
        f"data.train={REPO / 'assets' / 'text_reasoning' / 'train.jsonl'}",
        "trainer.steps=3",
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "trainer.progress_bar=false",
    ]
    gold = "eval.rewards=[{name: answer_accuracy, kwargs: {extract: last_number, mode: numeric}}]"
    on, off = tmp_path / "on", tmp_path / "off"
    train(load_config(text, [f"output_dir={off}", *common]))
    train(
        load_config(
            text, [f"output_dir={on}", *common, gold, "eval.watchdog.every=1", "eval.watchdog.prompts=2"]
        )
    )
    assert training_numbers(on) == training_numbers(off)
    log = overopt.read_log(on)
    assert [r["step"] for r in log] == [0, 1, 2, 3]
    assert all(r["stats"] == {} and r["ratio_bias"] == {} for r in log)
    assert all(0.0 <= r["gold"]["answer_accuracy"] <= 1.0 for r in log)
