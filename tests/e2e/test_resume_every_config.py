"""Exact resume for every tiny config: a run killed with SIGKILL right after a checkpoint and resumed with
``--resume`` logs the same metrics (all but ``time/*``) as an uninterrupted run of the same config.

Slow (each config trains twice through the real ``mmalign train`` command, and the first use of a tiny
config builds its model): ``python -m pytest -m slow tests/e2e/test_resume_every_config.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*-tiny.yaml"))
STEPS, SAVE_EVERY = 5, 2


def _cmd(config: str, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mmalign.app.cli",
        "train",
        f"configs/{config}",
        f"output_dir={out}",
        f"trainer.steps={STEPS}",
        f"trainer.save_every={SAVE_EVERY}",
        "trainer.progress_bar=false",
        *extra,
    ]


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in rows]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def test_every_tiny_config_is_listed() -> None:
    assert {
        "text_reasoning-tiny.yaml",
        "vlm_reasoning-tiny.yaml",
        "text_to_image-tiny.yaml",
        "safe_diffusion-tiny.yaml",
    } <= set(TINY_CONFIGS)


@pytest.mark.slow
@pytest.mark.parametrize("config", TINY_CONFIGS)
def test_kill_after_checkpoint_then_resume_matches_uninterrupted(config: str, tmp_path: Path) -> None:
    full, part = tmp_path / "full", tmp_path / "part"
    subprocess.run(_cmd(config, full), cwd=REPO, env=_env(), check=True, capture_output=True, timeout=3600)
    expected = _metrics(full)
    assert [m["step"] for m in expected] == list(range(1, STEPS + 1))

    # the same run, killed with SIGKILL as soon as its first checkpoint is complete
    proc = subprocess.Popen(
        _cmd(config, part),
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    marker = part / "checkpoints" / f"step_{SAVE_EVERY:06d}" / "COMPLETE"
    deadline = time.monotonic() + 3600
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists(), "the run ended before its first checkpoint"
    assert len(_metrics(part)) < STEPS, "the run finished before it could be killed"

    resumed = subprocess.run(
        [*_cmd(config, part), "--resume"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=3600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _metrics(part) == expected
