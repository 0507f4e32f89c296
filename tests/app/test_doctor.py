"""`mmalign.app.doctor`: each learning check on synthetic metrics, the `mmalign doctor` command, the live warnings
(rate-limited) and the trainer's hook."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from mmalign.app import doctor
from mmalign.app.doctor import (
    CHECKS,
    DoctorMonitor,
    Finding,
    LiveDoctor,
    diagnose,
    doctor_main,
    format_report,
    format_steps,
)
from mmalign.training.rounds import SyncRounds

N = 20


def config(**sections: dict[str, Any]) -> dict[str, Any]:
    """A resolved config.yaml (the sections the checks read), on-policy, multi-turn, KL on."""
    cfg: dict[str, Any] = {
        "rollout": {
            "group_size": 8,
            "prompts_per_step": 16,
            "max_new_tokens": 32,
            "loop": "multi_turn",
            "loop_kwargs": {"max_turns": 3},
        },
        "trainer": {"num_iterations": 1, "minibatch_size": None},
        "algorithm": {"estimator": "grpo", "kl_coef": 0.04, "filter": "none"},
        "rewards": [{"name": "answer_accuracy", "weight": 1.0}, {"name": "format", "weight": 0.2}],
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def healthy(n: int = N) -> list[dict[str, Any]]:
    """A run that learns: rewards rise and vary, few zero-std groups, entropy and tool use steady, KL small."""
    rows = []
    for s in range(1, n + 1):
        rows.append(
            {
                "step": s,
                "reward/mean": 0.3 + 0.02 * s,
                "reward/std": 0.4,
                "reward/answer_accuracy/mean": 0.3 + 0.02 * s,
                "reward/answer_accuracy/std": 0.45,
                "reward/answer_accuracy/nan_frac": 0.0,
                "reward/format/mean": 0.8 + 0.005 * s,
                "reward/format/std": 0.2,
                "reward/format/nan_frac": 0.0,
                "zero_std_frac": 0.1 + 0.01 * (s % 3),
                "reward/nan_groups": 0.0,
                "completion_len/mean": 30.0 + 0.2 * s,
                "truncated_frac": 0.02,
                "num_turns/mean": 2.1,
                "tool_call_rate": 0.6 + 0.01 * (s % 4),
                "over_turn_frac": 0.05,
                "loss": 0.002 * (-1) ** s,
                "clip_frac": 0.0,
                "approx_kl": 0.0,
                "kl": 0.002 + 0.0005 * (s % 3),
                "entropy": 1.5 - 0.002 * s,
                "grad_norm": 0.4,
                "adv/abs_mean": 0.7,
                "lr": 1e-5,
            }
        )
    return rows


def with_values(rows: list[dict[str, Any]], key: str, values: dict[int, Any]) -> list[dict[str, Any]]:
    """`rows` with `key` set at the given steps."""
    out = [dict(r) for r in rows]
    for r in out:
        if r["step"] in values:
            r[key] = values[r["step"]]
    return out


def by(findings: list[Finding], check: str, level: str | None = None) -> list[Finding]:
    return [f for f in findings if f.check == check and (level is None or f.level == level)]


def levels(findings: list[Finding]) -> set[str]:
    return {f.level for f in findings}


def run_all(rows: list[dict[str, Any]], cfg: dict[str, Any] | None) -> list[Finding]:
    return doctor.run_checks(rows, cfg)


def write_run(path: Path, rows: list[dict[str, Any]], cfg: dict[str, Any] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    with (path / "metrics.jsonl").open("w") as f:
        for r in rows:  # as the trainer writes them: NaN -> null
            f.write(
                json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()})
            )
            f.write("\n")
    if cfg is not None:
        (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    return path


# ----------------------------------------------------------------------------- helpers and the healthy run


def test_format_steps_is_compact() -> None:
    assert format_steps([7, 1, 2, 3, 5, 8]) == "1-3, 5, 7-8"
    assert format_steps([4]) == "4"
    assert format_steps(range(0, 40, 2), max_ranges=3).endswith("... (20 steps)")


def test_healthy_run_has_no_warning() -> None:
    findings = run_all(healthy(), config())
    assert levels(findings) <= {"ok", "info"}, format_report(findings)
    assert {f.check for f in findings} == set(CHECKS)  # every check reports something
    assert by(findings, "tool_use", "ok") and by(findings, "length_cap", "ok") and by(findings, "kl", "ok")
    assert by(findings, "entropy", "ok")


def test_every_check_copes_with_no_metrics_and_no_config() -> None:
    for name, check in CHECKS.items():
        found = check([], None)
        assert found and all(f.level in ("ok", "info") for f in found), name
        found = check([{"step": 1}], None)
        assert found and all(f.level in ("ok", "info") for f in found), name


# ----------------------------------------------------------------------------- one test per condition


def test_zero_std_share_high_warns_with_its_steps() -> None:
    rows = with_values(healthy(), "zero_std_frac", {s: 0.8 for s in range(5, 13)})
    (f,) = by(run_all(rows, config()), "zero_std")
    assert f.level == "warn" and f.steps == list(range(5, 13))
    assert "5-12" in f.message and "80%" in f.message
    assert "advantage" in f.advice and "dynamic_sampling" in f.advice and "group_size" in f.advice


def test_zero_std_is_info_with_a_filter_and_error_when_every_group_is_flat() -> None:
    rows = with_values(healthy(), "zero_std_frac", {s: 0.8 for s in range(5, 13)})
    (f,) = by(run_all(rows, config(algorithm={"filter": "dynamic_sampling"})), "zero_std")
    assert f.level == "info" and f.steps == list(range(5, 13))
    flat = with_values(healthy(6), "zero_std_frac", {s: 1.0 for s in range(1, 7)})
    (f,) = by(run_all(flat, config()), "zero_std")
    assert f.level == "error" and f.steps == list(range(1, 7)) and "learns nothing" in f.message
    one_step = with_values(healthy(), "zero_std_frac", {9: 0.9})  # a single step is not a finding
    assert by(run_all(one_step, config()), "zero_std")[0].level == "ok"


def test_on_policy_ratio_one_is_explained_as_info_not_warned() -> None:
    for cfg in (config(), None):
        findings = by(run_all(healthy(), cfg), "ratio")
        assert [f.level for f in findings] == ["info"]
        assert "expected" in findings[0].message and "ratio = 1" in findings[0].message
        assert "not a sign that nothing is learned" in findings[0].advice


def test_high_clip_fraction_warns_off_policy() -> None:
    cfg = config(trainer={"num_iterations": 2})
    rows = with_values(healthy(), "clip_frac", {s: 0.05 for s in range(1, N + 1)})
    rows = with_values(rows, "approx_kl", {s: 0.004 for s in range(1, N + 1)})
    rows = with_values(rows, "clip_frac", {8: 0.35, 9: 0.4, 10: 0.3})
    (f,) = by(run_all(rows, cfg), "ratio")
    assert f.level == "warn" and f.steps == [8, 9, 10] and "clip_frac" in f.message and "8-10" in f.message
    calm = with_values(healthy(), "clip_frac", {s: 0.05 for s in range(1, N + 1)})
    assert by(run_all(calm, cfg), "ratio")[0].level == "ok"
    # minibatches make it off-policy too; a ratio far from 1 (approx_kl) is its own warning
    far = with_values(calm, "approx_kl", {s: 0.05 for s in range(15, 21)})
    (f,) = by(run_all(far, config(trainer={"minibatch_size": 32})), "ratio")
    assert f.level == "warn" and f.steps == list(range(15, 21)) and "far from 1" in f.message


def test_ratio_not_one_in_an_on_policy_config_warns() -> None:
    rows = with_values(healthy(), "approx_kl", {s: 0.01 for s in range(1, N + 1)})
    (f,) = by(run_all(rows, config()), "ratio")
    assert f.level == "warn" and f.steps == list(range(1, N + 1))


def collapsed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` with the entropy at 2.0 for steps 1-5 and 0.2 (a tenth, below `ENTROPY_COLLAPSE_FRAC`) from step 12."""
    rows = with_values(rows, "entropy", {s: 2.0 for s in range(1, 6)})
    return with_values(rows, "entropy", {s: 0.2 for s in range(12, N + 1)})


def test_entropy_collapse_with_a_flat_reward_warns() -> None:
    """Entropy collapsed while reward/mean stayed at its start: a problem (warn), with what to try."""
    rows = with_values(
        collapsed(healthy()), "reward/mean", {s: 0.5 + 0.01 * (-1) ** s for s in range(1, N + 1)}
    )
    (f,) = by(run_all(rows, config()), "entropy")
    assert f.level == "warn" and f.steps == list(range(12, N + 1))
    assert "entropy collapsed while the reward is flat or falling" in f.message and "a problem" in f.message
    assert "trainer.lr" in f.advice and "algorithm.kl_coef" in f.advice
    # hand-worked: the first 3 steps average (0.49 + 0.51 + 0.49) / 3 = 0.4967; steps 12-20 alternate
    # 0.51 / 0.49 starting with 0.51 (5 x 0.51 + 4 x 0.49) / 9 = 0.50111
    assert f.details["reward_start"] == pytest.approx(1.49 / 3)
    assert f.details["reward_at_flagged"] == pytest.approx(4.51 / 9)
    falling = with_values(collapsed(healthy()), "reward/mean", {s: 0.9 - 0.02 * s for s in range(1, N + 1)})
    (f,) = by(run_all(falling, config()), "entropy")
    assert f.level == "warn" and "flat or falling" in f.message


def test_entropy_falling_as_the_reward_rises_is_expected() -> None:
    """The same collapse while reward/mean rises (0.3 + 0.02 s: 0.34 over steps 1-3, 0.62 over steps 12-20, a rise
    of 0.28 > 0.25 x reward/std 0.4) is what learning a task with one right answer looks like: info, not warn."""
    (f,) = by(run_all(collapsed(healthy()), config()), "entropy")
    assert f.level == "info" and f.steps == list(range(12, N + 1))
    assert (
        "entropy fell as the reward rose" in f.message
        and "expected on tasks with one right answer" in f.message
    )
    assert f.details["reward_start"] == pytest.approx(0.34)
    assert f.details["reward_at_flagged"] == pytest.approx(0.62)
    # a rise below ENTROPY_REWARD_RISE reward stds counts as flat: 0.004 per step gives 0.364 - 0.308 = 0.056 < 0.1
    slow = with_values(collapsed(healthy()), "reward/mean", {s: 0.3 + 0.004 * s for s in range(1, N + 1)})
    (f,) = by(run_all(slow, config()), "entropy")
    assert f.level == "warn" and "flat or falling" in f.message


def test_entropy_collapse_without_reward_says_it_cannot_tell() -> None:
    rows = [{k: v for k, v in r.items() if k != "reward/mean"} for r in collapsed(healthy())]
    (f,) = by(run_all(rows, config()), "entropy")
    assert f.level == "warn" and "cannot be told" in f.message


def test_missing_entropy_is_not_logged() -> None:
    missing = [{k: v for k, v in r.items() if k != "entropy"} for r in healthy()]
    (f,) = by(run_all(missing, config()), "entropy")
    assert f.level == "info" and "not logged" in f.message


def test_live_doctor_entropy_warns_only_when_the_reward_does_not_rise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Mid-run (the quickstart's case): a collapse while the reward rises is not warned about; a collapse with a flat
    reward is, and the warning says so."""
    caplog.set_level(logging.WARNING, logger="mmalign.app.doctor")
    rising = LiveDoctor(config(), checks=["entropy"])
    for r in collapsed(healthy()):
        assert rising.observe(r) == []
    assert not live_warnings(caplog)
    flat = LiveDoctor(config(), checks=["entropy"])
    rows = with_values(collapsed(healthy()), "reward/mean", {s: 0.5 for s in range(1, N + 1)})
    warned = [r["step"] for r in rows if flat.observe(r)]
    assert warned == [14]  # collapsed from step 12, persistent (3 steps) at 14, then rate-limited
    (record,) = live_warnings(caplog)
    assert "[doctor/entropy] entropy collapsed while the reward is flat or falling" in record.getMessage()


def test_constant_reward_component_warns() -> None:
    rows = with_values(healthy(), "reward/format/std", {s: 0.0 for s in range(1, N + 1)})
    rows = with_values(rows, "reward/format/mean", {s: 1.0 for s in range(1, N + 1)})
    (f,) = by(run_all(rows, config()), "constant_reward")
    assert f.level == "warn" and f.details["reward"] == "format" and f.steps == list(range(1, N + 1))
    assert "never varies" in f.message and "always 1" in f.message
    zero_weight = config(rewards=[{"name": "answer_accuracy"}, {"name": "format", "weight": 0.0}])
    assert by(run_all(rows, zero_weight), "constant_reward")[0].level == "info"
    # the same batch mean at every step, though the reward varies within a batch
    same_mean = with_values(healthy(), "reward/answer_accuracy/mean", {s: 0.5 for s in range(1, N + 1)})
    (f,) = by(run_all(same_mean, config()), "constant_reward")
    assert f.level == "warn" and f.details == {
        "reward": "answer_accuracy",
        "kind": "constant_mean",
        "value": 0.5,
    }


def test_nan_and_unparsed_rewards_are_reported_with_their_steps() -> None:
    rows = with_values(healthy(), "reward/answer_accuracy/nan_frac", {3: 0.25, 4: 0.5})
    rows = with_values(rows, "reward/nan_groups", {4: 2.0})
    rows = with_values(rows, "reward/box_iou/unparsed_frac", {s: 0.0 for s in range(1, N + 1)})
    rows = with_values(rows, "reward/box_iou/unparsed_frac", {2: 0.5, 3: 0.25, 4: 0.125})
    found = by(run_all(rows, config()), "nan")
    nan = [f for f in found if f.details.get("kind") == "nan"]
    unparsed = [f for f in found if f.details.get("kind") == "unparsed"]
    assert len(nan) == 1 and nan[0].level == "warn" and nan[0].steps == [3, 4]
    assert "answer_accuracy" in nan[0].message and "50%" in nan[0].message and "2 all-NaN" in nan[0].message
    assert len(unparsed) == 1 and unparsed[0].level == "warn" and unparsed[0].steps == [2, 3, 4]
    assert unparsed[0].details["reward"] == "box_iou" and "50%" in unparsed[0].message
    # a NaN total reward (null in metrics.jsonl) and a NaN loss are errors
    broken = with_values(healthy(), "reward/mean", {7: None})
    broken = with_values(broken, "loss", {9: float("nan")})
    errors = by(run_all(broken, config()), "nan", "error")
    assert sorted(f.steps[0] for f in errors) == [7, 9]


def test_nan_finding_quotes_an_example_sample(tmp_path: Path) -> None:
    from mmalign.training import rundir

    rows = with_values(healthy(), "reward/answer_accuracy/nan_frac", {10: 0.25})
    run = write_run(tmp_path / "run", rows, config())
    rundir.write_samples(
        run,
        10,
        [
            {"group": 0, "prompt": "ok", "rewards": {"answer_accuracy": 1.0}, "text": "a"},
            {"group": 0, "prompt": "Q: 2 + 2 = ?", "rewards": {"answer_accuracy": None}, "text": "<answer>4"},
        ],
    )
    (f,) = [f for f in diagnose(run, ["nan"]) if f.details.get("kind") == "nan"]
    assert f.steps == [10] and "step 10 sample 1" in f.message and "Q: 2 + 2 = ?" in f.message


def test_tool_use_collapse_warns() -> None:
    rows = with_values(healthy(), "tool_call_rate", {s: 0.02 for s in range(9, N + 1)})
    rows = with_values(rows, "num_turns/mean", {s: 1.0 for s in range(9, N + 1)})
    (f,) = by(run_all(rows, config()), "tool_use")
    assert f.level == "warn" and f.steps == list(range(9, N + 1)) and "collapsed" in f.message
    assert "num_turns/mean 1" in f.message
    never = with_values(healthy(), "tool_call_rate", {s: 0.0 for s in range(1, N + 1)})
    (f,) = by(run_all(never, config()), "tool_use")
    assert f.level == "warn" and "never used" in f.message
    single = [{k: v for k, v in r.items() if k != "tool_call_rate"} for r in healthy()]
    (f,) = by(run_all(single, config(rollout={"loop": "single_turn"})), "tool_use")
    assert f.level == "info" and "not a multi-turn run" in f.message


def test_completion_length_drifting_to_the_cap_warns() -> None:
    cfg = config(rollout={"loop": "single_turn", "max_new_tokens": 64})
    rows = healthy()
    for r in rows:  # 30 -> 63.25 tokens, truncation rising with it
        r["completion_len/mean"] = 30.0 + 1.75 * (r["step"] - 1)
        r["truncated_frac"] = 0.02 if r["step"] < 17 else 0.6
    (f,) = by(run_all(rows, cfg), "length_cap")
    near = [s for s in range(1, N + 1) if 30.0 + 1.75 * (s - 1) >= 0.9 * 64]
    assert f.level == "warn" and f.steps == sorted(set(near) | set(range(17, N + 1)))
    assert "of the cap 64" in f.message and "truncated_frac" in f.message
    # multi-turn: the cap is max_turns x max_new_tokens (3 x 32)
    assert by(run_all(rows, config()), "length_cap")[0].details["cap"] == 96


def test_kl_growth_and_kl_above_threshold_warn() -> None:
    growing = with_values(healthy(), "kl", {s: 0.002 * s for s in range(1, N + 1)})  # 0.002 .. 0.04
    (f,) = by(run_all(growing, config()), "kl")
    assert f.level == "warn" and "still growing" in f.message and f.steps == list(range(N // 2, N + 1))
    high = with_values(healthy(), "kl", {10: 0.2, 11: 0.3, 12: 0.25})
    (f,) = by(run_all(high, config()), "kl")
    assert f.level == "warn" and f.steps == [10, 11, 12] and "above" in f.message
    no_kl = [{k: v for k, v in r.items() if k != "kl"} for r in healthy()]
    (f,) = by(run_all(no_kl, config(algorithm={"kl_coef": 0.0})), "kl")
    assert f.level == "info"


def test_overoptimisation_warns_with_the_step_divergence_began() -> None:
    rows = healthy(12)
    gold = {3: 0.50, 6: 0.62, 9: 0.45, 12: 0.40}
    train = {3: 0.10, 6: 0.15, 9: 0.30, 12: 0.40}
    for r in rows:
        s = r["step"]
        if s in gold:
            r.update({"watchdog/gold": gold[s], "watchdog/train_reward": train[s], "watchdog/best_step": 6.0})
            r["watchdog/diverging"] = 1.0 if s == 12 else 0.0
            r["watchdog/drift_z/saturation"] = 0.5 * s
    rows[-1]["watchdog/diverged_since"] = 9.0
    found = by(run_all(rows, config()), "overoptimisation")
    assert [f.level for f in found] == ["warn"] and found[0].steps == [12]
    assert "divergence began at step 9" in found[0].message
    assert "best 0.62 (step 6) -> 0.4 (step 12)" in found[0].message
    assert "saturation +6.0 base std" in found[0].message
    assert found[0].details["diverged_since"] == 9
    # the same curve without the divergence flag is reported, not warned
    calm = [{k: v for k, v in r.items() if k != "watchdog/diverging"} for r in rows]
    assert [f.level for f in by(run_all(calm, config()), "overoptimisation")] == ["ok"]
    # no watchdog: info naming the key
    off = by(run_all(healthy(), config()), "overoptimisation")
    assert off[0].level == "info" and "eval.watchdog.every is 0" in off[0].message


def test_diagnose_reads_the_watchdog_log(tmp_path: Path) -> None:
    """`mmalign doctor` takes the watchdog's own log (every evaluation, with its warning text), also when the
    evaluation steps were not logged in metrics.jsonl."""
    from mmalign.app import overopt
    from mmalign.app.overopt import Evaluation, WatchdogState

    run = write_run(tmp_path / "run", healthy(), config())
    state = WatchdogState(patience=1, tolerance=0.01)
    with (run / overopt.LOG_FILE).open("w") as f:
        for step, gold, train in [(0, 0.5, 0.1), (4, 0.6, 0.2), (8, 0.3, 0.5)]:
            rec = state.observe(Evaluation(step=step, gold={"g": gold}, gold_total=gold, train_total=train))
            f.write(json.dumps(rec) + "\n")
    found = by(doctor.diagnose(run), "overoptimisation")
    assert [f.level for f in found] == ["warn"]
    assert found[0].message.startswith(
        "over-optimisation: the gold reward fell from 0.6000 (step 4) to 0.3000"
    )
    assert "divergence began at step 8" in found[0].message and found[0].steps == [8]


def test_a_failing_check_becomes_an_error_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(metrics: list[dict[str, Any]], cfg: dict[str, Any] | None) -> list[Finding]:
        raise RuntimeError("boom")

    monkeypatch.setitem(CHECKS, "kl", broken)
    (f,) = by(run_all(healthy(), config()), "kl")
    assert f.level == "error" and "boom" in f.message


# ----------------------------------------------------------------------------- the command


def test_doctor_main_exit_codes_report_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write_run(tmp_path / "good", healthy(), config())
    assert doctor_main([str(good)]) == 0
    out = capsys.readouterr().out
    assert "mmalign doctor" in out and "0 error(s), 0 warning(s)" in out and "expected" in out

    warned = write_run(tmp_path / "warned", with_values(healthy(), "zero_std_frac", {5: 0.9, 6: 0.9, 7: 0.9}))
    assert doctor_main([str(warned)]) == 0  # warnings do not fail
    assert "WARN  zero_std" in capsys.readouterr().out

    bad_rows = with_values(healthy(), "reward/mean", {4: None})
    bad = write_run(tmp_path / "bad", bad_rows, config())
    assert doctor_main([str(bad), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["error"] == 1 and doc["logged_steps"] == N
    (err,) = [f for f in doc["findings"] if f["level"] == "error"]
    assert err["check"] == "nan" and err["steps"] == [4]

    assert doctor_main([str(good), "--checks", "kl,ratio", "--json"]) == 0
    assert {f["check"] for f in json.loads(capsys.readouterr().out)["findings"]} == {"kl", "ratio"}
    with pytest.raises(SystemExit) as e:
        doctor_main([str(good), "--checks", "kl,nope"])
    assert e.value.code == 2 and "nope" in capsys.readouterr().err


def test_doctor_main_names_the_missing_metrics_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    assert doctor_main([str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "empty" / "metrics.jsonl") in err and "error" in err
    assert doctor_main([str(tmp_path / "absent")]) == 1
    assert str(tmp_path / "absent" / "metrics.jsonl") in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        diagnose(tmp_path / "empty")


def test_a_partly_written_metrics_file_is_read(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", healthy(5), config())
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "reward/me')  # the trainer is writing this line
    findings = diagnose(run)
    assert levels(findings) <= {"ok", "info"}


# ----------------------------------------------------------------------------- live warnings


def live_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "mmalign.app.doctor" and r.levelno == logging.WARNING]


def test_live_doctor_warns_at_most_once_per_n_steps_per_check(caplog: pytest.LogCaptureFixture) -> None:
    live = LiveDoctor(config(), every=50)
    caplog.set_level(logging.WARNING, logger="mmalign.app.doctor")
    warned_steps = []
    for r in healthy(120):
        r = {**r, "reward/format/std": 0.0, "reward/format/mean": 1.0}  # constant at every step
        if live.observe(r):
            warned_steps.append(r["step"])
    records = live_warnings(caplog)
    assert len(records) == len(warned_steps) == 3
    assert warned_steps == [3, 53, 103]  # from the 3rd step (LIVE_MIN_STEPS), then every 50
    assert all("doctor/constant_reward" in r.getMessage() and "'format'" in r.getMessage() for r in records)


def test_live_doctor_is_quiet_on_a_healthy_run_and_never_raises(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG, logger="mmalign.app.doctor")
    live = LiveDoctor(config())
    for r in healthy(60):
        assert live.observe(r) == []
    assert not live_warnings(caplog)
    assert live.observe(None) == []  # type: ignore[arg-type]
    monkeypatch.setitem(CHECKS, "kl", lambda m, c: 1 / 0)
    broken = LiveDoctor(config(), checks=["kl"])
    assert [broken.observe(r) for r in healthy(3)] == [[], [], []]
    assert not live_warnings(caplog)
    assert any("ZeroDivisionError" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)


def test_live_doctor_warns_each_check_separately(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="mmalign.app.doctor")
    live = LiveDoctor(config(), every=10)
    rows = with_values(healthy(30), "tool_call_rate", {s: 0.0 for s in range(9, 31)})
    rows = with_values(rows, "reward/answer_accuracy/nan_frac", {15: 0.5})
    for r in rows:
        live.observe(r)
    msgs = [r.getMessage() for r in live_warnings(caplog)]
    # the collapse is reported once it persists (3 steps: 9-11), then at most every 10 steps
    assert [m.split(":")[0] for m in msgs if "doctor/tool_use" in m] == ["step 11", "step 21"]
    assert [m.split(":")[0] for m in msgs if "doctor/nan" in m] == ["step 15"]


def test_trainer_feeds_every_step_to_the_live_doctor(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`GroupTrainer.train` hands each step's metrics to its `DoctorMonitor`'s `LiveDoctor` (main process), whose
    warnings reach the log, and a doctor failure does not stop training. The loop runs with stubs in place of
    the model."""
    from types import SimpleNamespace

    from mmalign.config import config_from_dict
    from mmalign.training.trainer import GroupTrainer

    steps = 6
    cfg = config_from_dict(
        {
            "pipeline": "text_reasoning",
            "output_dir": str(tmp_path / "run"),
            "rewards": [{"name": "answer_accuracy"}, {"name": "format", "weight": 0.2}],
            "trainer": {"steps": steps, "progress_bar": False, "save_every": 100, "sample_every": 100},
        },
        "test",
    )
    rows = with_values(healthy(steps), "reward/format/std", {s: 0.0 for s in range(1, steps + 1)})
    trainer = GroupTrainer.__new__(GroupTrainer)  # no model: train()'s loop only
    trainer.cfg, trainer.out, trainer.step, trainer.history, trainer.callbacks = (
        cfg,
        tmp_path / "run",
        0,
        [],
        [],
    )
    trainer.is_main, trainer._last_batch = True, None
    trainer.world, trainer.run_lock = 1, None  # one process; train() takes the run lock in tmp_path
    trainer.rounds = SyncRounds(
        trainer
    )  # synchronous rollouts (trainer.async unset), as `GroupTrainer.__init__`
    trainer.monitors = [DoctorMonitor()]  # as `mmalign.app.run.build_trainer` gives it
    trainer.policy = SimpleNamespace(save=lambda path: None)
    trainer.accelerator = SimpleNamespace(wait_for_everyone=lambda: None)
    trainer.dump_samples = lambda batch: None
    trainer.save_checkpoint = lambda: None

    def train_step() -> dict[str, Any]:
        trainer.step += 1
        return {**rows[trainer.step - 1], "time/step_s": 0.1}

    trainer.train_step = train_step
    (tmp_path / "run").mkdir()
    caplog.set_level(logging.WARNING, logger="mmalign.app.doctor")
    assert len(trainer.train()) == steps
    msgs = [r.getMessage() for r in live_warnings(caplog)]
    assert len(msgs) == 1 and msgs[0].startswith("step 3: [doctor/constant_reward]") and "'format'" in msgs[0]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == steps

    def boom(self: Any, metrics: dict[str, Any]) -> list[Finding]:
        raise RuntimeError("broken doctor")

    monkeypatch.setattr(LiveDoctor, "_observe", boom)
    trainer.step, trainer.history = 0, []
    (tmp_path / "run" / "metrics.jsonl").unlink()
    assert len(trainer.train()) == steps  # training goes on


def test_interleaved_writers_are_an_error_naming_the_steps() -> None:
    """Two runs appending to one metrics.jsonl log 1, 1, 2, 2, 3, 3: the doctor says so (it said nothing)."""
    from mmalign.app.doctor import check_step_order

    rows = [{"step": s, "reward/mean": 0.5} for s in (1, 1, 2, 2, 3, 3)]
    (f,) = check_step_order(rows, None)
    assert f.level == "error" and f.steps == [1, 2, 3]
    assert f.details == {"out_of_order": [1, 2, 3], "repeated": [1, 2, 3]}
    assert "Two runs wrote into this output_dir" in f.advice
    (ok,) = check_step_order([{"step": s} for s in (1, 2, 3, 5)], None)  # a gap (log_every) is fine
    assert ok.level == "ok"
