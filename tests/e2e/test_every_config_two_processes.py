"""Every tiny config on two CPU processes (gloo, ``torchrun --standalone --nproc_per_node 2``) through the real
``mmalign`` command:

- the run finishes and records that it ran as accelerate's ``MULTI_CPU`` with 2 processes (``distributed.json``
  and the ``distributed: ...`` line of its output);
- the advantages it wrote for every step equal the estimator applied in ONE process to the gathered rewards and
  groups (`tests/scripts/two_process.py`, ``check_advantages``), to 1e-5;
- a run killed with SIGKILL (launcher and workers) right after its first checkpoint and resumed with ``--resume``
  logs the same metrics (all but ``time/*``) as the uninterrupted two-process run;
- ``mmalign sample`` and ``mmalign eval`` on 2 processes write what they write on 1.

The per-config tests are slow (``python -m pytest -m slow tests/e2e/test_every_config_two_processes.py``); one
text_reasoning-tiny run of 2 steps is not, so the default run covers the two-process CLI path.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from PIL import Image

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import two_process as tp  # noqa: E402

REPO = tp.REPO
TINY_CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*-tiny.yaml"))
STEPS, SAVE_EVERY = 3, 2
TIMEOUT = 3600

pytestmark = pytest.mark.skipif(
    shutil.which("torchrun") is None, reason="torchrun (from torch) is not on PATH"
)


def _train(config: str, out: Path, steps: int = STEPS, *extra: str) -> subprocess.CompletedProcess:
    cmd = tp.launch_cmd(2, "train", *tp.train_args(config, out, steps, SAVE_EVERY, *extra))
    proc = subprocess.run(cmd, cwd=REPO, env=tp.env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{tp.failure(proc)}"
    return proc


def _check_launch_record(out: Path, stdout: str) -> None:
    assert tp.distributed(out) == {"distributed_type": "MULTI_CPU", "num_processes": 2}
    assert "distributed: MULTI_CPU, 2 processes" in stdout


def _check_prompts_per_step(config: str) -> None:
    pps = yaml.safe_load((REPO / "configs" / config).read_text())["rollout"]["prompts_per_step"]
    assert pps % 2 == 0, f"{config}: rollout.prompts_per_step {pps} is not divisible by 2 processes"


def test_every_tiny_config_is_listed() -> None:
    assert len(TINY_CONFIGS) >= 9 and "text_reasoning-tiny.yaml" in TINY_CONFIGS


def test_text_reasoning_two_steps_on_two_processes(tmp_path: Path) -> None:
    """The default run's two-process check: 2 steps of text_reasoning-tiny, launch record and advantages."""
    out = tmp_path / "run"
    proc = _train("text_reasoning-tiny.yaml", out, 2)
    _check_launch_record(out, proc.stdout)
    assert [m["step"] for m in tp.metrics(out)] == [1, 2]
    checked = tp.check_advantages(out)
    assert checked["steps"] == 2 and checked["samples"] == 2 * 16 * 8
    assert checked["max_abs_diff"] < 1e-5


def test_advantage_check_can_fail(tmp_path: Path) -> None:
    """Guard for the check above: a written advantage that is off by 1e-3 is caught."""
    out = tmp_path / "run"
    (out / "samples").mkdir(parents=True)
    cfg = {
        "algorithm": {"estimator": "grpo"},
        "rollout": {"group_size": 2},
        "rewards": [{"name": "a", "weight": 1.0}, {"name": "b", "weight": 0.5}],
    }
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    # group 0: totals 1.0 and 0.5 -> grpo: +-0.25 / (std 0.35355 + 1e-4) = +-0.70691; group 1: equal -> 0
    rows = [
        {"group": 0, "rewards": {"a": 1.0, "b": 0.0}, "advantage": 0.70691},
        {"group": 0, "rewards": {"a": 0.0, "b": 1.0}, "advantage": -0.70691},
        {"group": 1, "rewards": {"a": 1.0, "b": None}, "advantage": 0.0},
        {"group": 1, "rewards": {"a": 1.0, "b": None}, "advantage": 0.0},
    ]
    path = out / "samples" / "step_000001.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert tp.check_advantages(out)["max_abs_diff"] < 1e-4
    rows[1]["advantage"] += 1e-3
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert tp.check_advantages(out)["max_abs_diff"] == pytest.approx(1e-3, abs=1e-5)


# ----------------------------------------------------------------------------- every config (slow)

_FULL: dict[str, tuple[Path, str]] = {}


def _full_run(config: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The uninterrupted 2-process run of `config` (STEPS steps), made once per config for the tests below."""
    if config not in _FULL:
        _check_prompts_per_step(config)
        out = tmp_path_factory.mktemp(config.removesuffix(".yaml")) / "full"
        _FULL[config] = (out, _train(config, out).stdout)
    return _FULL[config]


@pytest.mark.slow
@pytest.mark.parametrize("config", TINY_CONFIGS)
def test_trains_on_two_processes(config: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    out, stdout = _full_run(config, tmp_path_factory)
    _check_launch_record(out, stdout)
    assert [m["step"] for m in tp.metrics(out)] == list(range(1, STEPS + 1))
    assert all(math.isfinite(m["reward/mean"]) for m in tp.metrics(out))


@pytest.mark.slow
@pytest.mark.parametrize("config", TINY_CONFIGS)
def test_advantages_equal_one_process(config: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    out, _ = _full_run(config, tmp_path_factory)
    checked = tp.check_advantages(out)
    assert checked["steps"] == STEPS
    assert checked["max_abs_diff"] < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("config", TINY_CONFIGS)
def test_kill_after_checkpoint_then_resume_on_two_processes(
    config: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    full, _ = _full_run(config, tmp_path_factory)
    expected = tp.metrics(full)
    part = full.parent / "part"
    cmd = tp.launch_cmd(2, "train", *tp.train_args(config, part, STEPS, SAVE_EVERY))
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=tp.env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    marker = part / "checkpoints" / f"step_{SAVE_EVERY:06d}" / "COMPLETE"
    deadline = time.monotonic() + TIMEOUT
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    tp.kill_launch(proc)
    assert marker.exists(), "the run ended before its first checkpoint"
    assert len(tp.metrics(part)) < STEPS, "the run finished before it could be killed"

    resume = tp.launch_cmd(2, "train", *tp.train_args(config, part, STEPS, SAVE_EVERY), "--resume")
    resumed = subprocess.run(resume, cwd=REPO, env=tp.env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert resumed.returncode == 0, tp.failure(resumed)
    _check_launch_record(part, resumed.stdout)
    assert tp.metrics(part) == expected


# ----------------------------------------------------------------------------- sample and eval (slow)


def _cli(nproc: int, command: str, *args: str) -> str:
    cmd = tp.launch_cmd(nproc, command, *args)
    proc = subprocess.run(cmd, cwd=REPO, env=tp.env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{tp.failure(proc)}"
    assert ("distributed: MULTI_CPU, 2 processes" in proc.stdout) == (nproc == 2)
    return proc.stdout


def _close(a: Any, b: Any) -> bool:
    """Equal JSON values, numbers to 1e-5 (NaN equal to NaN)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, float) or isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-5
    return a == b


# eval.prompts_per_batch makes several chunks of prompts, an odd number of them, so the two processes get
# different numbers of chunks
SAMPLE_EVAL_CASES = {
    "text_reasoning-tiny.yaml": ["eval.max_rows=10", "eval.prompts_per_batch=2", "eval.group_size=3"],
    "text_to_image-tiny.yaml": ["eval.max_rows=6", "eval.prompts_per_batch=2", "eval.group_size=2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(SAMPLE_EVAL_CASES))
def test_eval_on_two_processes_equals_one(config: str, tmp_path: Path) -> None:
    overrides = [str(REPO / "configs" / config), f"output_dir={tmp_path / 'run'}", *SAMPLE_EVAL_CASES[config]]
    reports = []
    for nproc in (1, 2):
        _cli(nproc, "eval", *overrides, "--checkpoint", "base", "--out", str(tmp_path / f"eval{nproc}.json"))
        reports.append(json.loads((tmp_path / f"eval{nproc}.json").read_text()))
    one, two = reports
    assert (one["distributed_type"], one["num_processes"]) == ("NO", 1)
    assert (two["distributed_type"], two["num_processes"]) == ("MULTI_CPU", 2)
    assert one["base"]["all"]["samples"] == one["prompts"] * one["samples_per_prompt"]
    assert _close(one["base"], two["base"]), (one["base"], two["base"])


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(SAMPLE_EVAL_CASES))
def test_sample_on_two_processes_equals_one(config: str, tmp_path: Path) -> None:
    args = [str(REPO / "configs" / config), f"output_dir={tmp_path / 'run'}", "eval.prompts_per_batch=2"]
    outs = [tmp_path / f"s{n}" for n in (1, 2)]
    for nproc, out in zip((1, 2), outs, strict=True):
        _cli(
            nproc, "sample", *args, "--checkpoint", "base", "-n", "2", "--max-prompts", "5", "--out", str(out)
        )
    rows = [[json.loads(x) for x in (o / "samples.jsonl").read_text().splitlines()] for o in outs]
    assert len(rows[0]) == 10 and rows[0] == rows[1]
    assert len({r.get("text", r.get("image")) for r in rows[0]}) > 1  # not all the same sample
    for r in rows[0]:
        if "image" in r:  # the same pixels
            a, b = (np.asarray(Image.open(o / r["image"])) for o in outs)
            assert np.array_equal(a, b), r["image"]
    grids = [o / "grid.png" for o in outs if (o / "grid.png").exists()]
    if grids:
        assert len(grids) == 2
        assert np.array_equal(*(np.asarray(Image.open(g)) for g in grids))
