"""`mmalign parity` (mmalign/app/parity.py): the log-ratio and ratio statistics against hand-worked numbers, fp32
re-scoring of a text rollout giving error 0 and deliberately perturbed settings (bf16 autocast, changed weights)
giving a non-zero error, the engine-vs-trainer comparison with the fake engine, a denoising policy per step, and
the command end to end and its user errors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from mmalign.app.cli import main
from mmalign.app.parity import Setting, compare, parity, render, score_rollout, settings_for
from mmalign.app.probe import load_setup

ROOT = Path(__file__).resolve().parents[2]


def test_compare_hand_worked() -> None:
    logp_old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    logp = torch.tensor([[-1.0, -1.9, -3.0], [-1.3, -1.0, 5.0]])  # the 5.0 sits on a masked action
    mask = torch.tensor([[True, True, True], [True, True, False]])
    out = compare(logp, logp_old, mask, tol=0.15, eps_low=0.2, eps_high=0.2)
    d = [0.0, 0.1, 0.0, -0.3, 0.0]  # the valid actions' log-ratios, by hand
    ratios = [math.exp(x) for x in d]
    mean = sum(ratios) / 5
    assert out["max_abs"] == pytest.approx(0.3)
    assert out["mean_abs"] == pytest.approx(0.4 / 5)
    assert out["per_action"] == pytest.approx([0.3, 0.1, 0.0])
    assert out["breaking"] == [0]  # only action 0 exceeds 0.15
    assert out["ratio"]["mean"] == pytest.approx(mean)
    assert out["ratio"]["std"] == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in ratios) / 5))
    assert out["ratio"]["min"] == pytest.approx(math.exp(-0.3)) and out["ratio"]["max"] == pytest.approx(
        math.exp(0.1)
    )
    assert out["ratio"]["clip_frac"] == pytest.approx(1 / 5)  # exp(-0.3) = 0.741 < 0.8
    assert out["actions"] == 5 and not out["ok"]
    assert compare(logp_old, logp_old, mask, tol=1e-9)["ok"]


@pytest.fixture(scope="module")
def text_setup() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        yield load_setup("configs/text_reasoning-tiny.yaml", [], need_rewards=False, command="parity")


def test_text_fp32_error_zero_bf16_not(text_setup: Any) -> None:
    cfg, components = text_setup
    report = parity(
        cfg, components, prompts=2, group_size=4, microbatches=[1, 3], precisions=["fp32", "bf16"]
    )
    names = [s["name"] for s in report["settings"]]
    assert names[0].startswith("trainer (microbatch 8, fp32")
    fp32 = [s for s in report["settings"] if s["precision"] == "fp32"]
    assert len(fp32) >= 3  # the trainer's, microbatch 1 and 3, eval mode
    # the trainer's own setting re-scores exactly as the rollout did: the same numbers; another micro-batch size
    # or eval mode may reorder fp32 sums with several BLAS threads (~1e-6), far inside the tolerance
    assert fp32[0]["max_abs"] == 0.0 and fp32[0]["ratio"]["std"] == 0.0 and fp32[0]["ratio"]["mean"] == 1.0
    for s in fp32:
        assert s["max_abs"] <= 1e-5 and s["ok"]
    bf16 = next(s for s in report["settings"] if s["precision"] == "bf16")
    assert bf16["max_abs"] > 1e-5  # the deliberately perturbed setting: bf16 autocast changes the log-probs
    assert report["first_update"]["name"] == names[0] and report["first_update"]["ok"]
    strict = parity(cfg, components, prompts=2, group_size=4, microbatches=[], precisions=["bf16"], tol=1e-7)
    assert any(n.startswith("bf16") for n in strict["breaking_settings"])


def test_changed_weights_break_ratio(text_setup: Any) -> None:
    cfg, components = text_setup
    policy = components.policy
    with torch.no_grad():
        rollout = policy.rollout(components.data[:2], 3, compute_logp=True)
    setting = Setting("fp32", microbatch=6)
    same = score_rollout(policy, rollout, setting)
    assert same is not None and compare(same, rollout.logp_old, rollout.mask, tol=1e-9)["max_abs"] == 0.0
    state = {k: v.clone() for k, v in policy.model.state_dict().items()}
    try:
        with torch.no_grad():
            head = policy.model.get_output_embeddings().weight
            head.add_(0.05 * torch.randn_like(head))
        moved = score_rollout(policy, rollout, setting)
    finally:
        policy.model.load_state_dict(state)
    out = compare(moved, rollout.logp_old, rollout.mask, tol=1e-3)
    assert out["max_abs"] > 1e-3 and not out["ok"] and out["breaking"]


def test_settings_follow_the_config(text_setup: Any) -> None:
    cfg, _ = text_setup
    s = settings_for(cfg, 16, [1, 2, 99], ["fp32", "bf16"], chunked=True)
    assert s[0].microbatch == 16 and s[0].precision == "fp32" and s[0].train_mode
    assert [x.microbatch for x in s if x.name.startswith("microbatch")] == [1, 2]  # 99 -> 16, the trainer's
    assert any(not x.train_mode for x in s) and any(not x.chunked for x in s)


def test_fake_engine_against_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    cfg, components = load_setup(
        "configs/text_reasoning-tiny.yaml", ["rollout.engine=fake"], need_rewards=False, command="parity"
    )
    report = parity(cfg, components, prompts=2, group_size=2, microbatches=[], precisions=["fp32"])
    engine = report["engine_vs_trainer"]
    assert engine["actions"] == report["valid_actions"] > 0
    assert engine["max_abs"] < 1e-4 and engine["ok"]  # the fake engine holds the same weights


def test_parity_cli_text_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    out = tmp_path / "parity.json"
    args = ["parity", "configs/text_reasoning-tiny.yaml", "-n", "1", "--group-size", "4"]
    rc = main(
        [*args, "--microbatch-sizes", "2", "--precisions", "fp32,bf16", "--tol", "1e-7", "--json", str(out)]
    )
    text = capsys.readouterr().out
    assert rc == 0  # the trainer's own setting (fp32) keeps ratio = 1
    assert "# mmalign parity" in text and "## Max abs error per token" in text and "bf16 autocast" in text
    report = json.loads(out.read_text())
    assert report["samples"] == 4 and report["action"] == "token"
    assert report["first_update"]["ok"] and report["breaking_settings"]


def test_parity_denoising_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    cfg, components = load_setup("configs/text_to_image-tiny.yaml", [], need_rewards=False, command="parity")
    report = parity(cfg, components, prompts=1, group_size=2, microbatches=[1], precisions=["fp32", "bf16"])
    assert report["action"] == "denoising step" and report["actions_per_sample"] == 10
    first = report["first_update"]
    assert first["ok"] and len(first["per_action"]) == 10 and first["max_abs"] < 1e-5
    bf16 = next(s for s in report["settings"] if s["precision"] == "bf16")
    assert bf16["max_abs"] > 0 and len(bf16["per_action"]) == 10


def test_parity_vlm_grounding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    cfg, components = load_setup("configs/medloc-tiny.yaml", [], need_rewards=False, command="parity")
    report = parity(cfg, components, prompts=1, group_size=2, microbatches=[1], precisions=["fp32"])
    assert report["policy"] == "VLMPolicy" and report["action"] == "token"
    assert report["first_update"]["ok"] and not report["breaking_settings"]


def test_parity_forward_process_has_no_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    cfg, components = load_setup(
        "configs/text_to_image-nft-tiny.yaml", [], need_rewards=False, command="parity"
    )
    report = parity(cfg, components, prompts=1, group_size=2, microbatches=[], precisions=["fp32"])
    assert "no log-prob ratio" in report["no_logp"] and report["first_update"] is None
    assert "no log-prob ratio" in render(report)


def test_parity_bad_config_path(no_model: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["parity", "nope.yaml"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "mmalign: error: config file not found: nope.yaml"
    ]


def test_parity_cli_says_each_long_phase(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The slow phases (building the pipeline, the rollout, each re-scoring) each print a start and an end
    line on stderr, so a minute-long parity run is never silent; the report itself stays on stdout."""
    monkeypatch.chdir(ROOT)
    args = ["parity", "configs/text_reasoning-tiny.yaml", "-n", "1", "--group-size", "2"]
    assert main([*args, "--microbatch-sizes", "1", "--precisions", "fp32"]) == 0
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.startswith("mmalign parity: ")]
    phases = [line.removeprefix("mmalign parity: ").split(" ...")[0] for line in err]
    assert phases[0].startswith("building the text_reasoning pipeline of configs/text_reasoning-tiny.yaml")
    assert (
        phases[1].startswith("built in ")
        and phases[2] == "rollout: 1 prompt(s) x 2 samples from the base policy"
    )
    assert phases[3].startswith("rollout: done in ")
    rescoring = [line.removeprefix("mmalign parity: ") for line in err[4:]]
    starts = [line for line in rescoring if line.startswith("re-scoring ") and line.endswith(" ...")]
    ends = [line for line in rescoring if line.startswith("re-scoring ") and " done in " in line]
    assert len(starts) == len(ends) >= 1 and len(rescoring) == 2 * len(starts)
    assert not any(line.startswith("mmalign parity: ") for line in captured.out.splitlines())
    assert "# mmalign parity" in captured.out
