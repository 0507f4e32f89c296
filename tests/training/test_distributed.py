"""Two CPU processes (gloo, launched with torchrun) compute the same advantages as one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmalign.algorithms import advantages

SCRIPT = Path(__file__).parents[1] / "scripts" / "dist_advantages.py"


def _run(tmp_path: Path, estimator: str, nproc: int) -> list[tuple]:
    out = tmp_path / f"{estimator}_{nproc}.json"
    if nproc == 1:
        cmd = [sys.executable, str(SCRIPT), str(out), estimator]
    else:
        torchrun = shutil.which("torchrun")
        if torchrun is None:
            pytest.skip("torchrun not on PATH")
        cmd = [torchrun, "--standalone", f"--nproc_per_node={nproc}", str(SCRIPT), str(out), estimator]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["world_size"] == nproc
    assert data["distributed_type"] == ("MULTI_CPU" if nproc > 1 else "NO")
    return sorted(
        (r["step"], r["group"], r["prompt"], r["output"], round(r["advantage"], 6), r["in_loss"])
        for r in data["records"]
    )


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_pp", "mc_grpo"])
def test_two_processes_match_one(tmp_path: Path, estimator: str) -> None:
    one = _run(tmp_path, estimator, 1)
    two = _run(tmp_path, estimator, 2)
    assert len(one) == 3 * 6 * (5 + advantages.extra_samples(estimator))
    assert any(abs(r[4]) > 0 for r in one)  # the comparison is not between all-zero advantages
    assert two == one


def test_batch_whitening_needs_the_gathered_batch() -> None:
    """Guard for the test above: computing reinforce_pp per process would give other numbers."""
    torch.manual_seed(0)
    rewards = torch.rand(12).round()
    group = torch.arange(4).repeat_interleave(3)
    full = advantages.get("reinforce_pp")(rewards, group)
    halves = torch.cat(
        [
            advantages.get("reinforce_pp")(rewards[:6], group[:6]),
            advantages.get("reinforce_pp")(rewards[6:], group[6:]),
        ]
    )
    assert not torch.allclose(full, halves)


SYNC_SCRIPT = Path(__file__).parents[1] / "scripts" / "dist_train_sync.py"


@pytest.mark.parametrize("mode", ["shared", "plain"])
def test_ddp_replicas_stay_identical(tmp_path: Path, mode: str) -> None:
    """Two processes train on different samples; DDP must keep their weights equal (the shared-prefix
    forward runs the prompt through the inner module, outside the DDP wrapper)."""
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not on PATH")
    cmd = [torchrun, "--standalone", "--nproc_per_node=2", str(SYNC_SCRIPT), str(tmp_path), mode]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1))
    for r in (r0, r1):
        assert (r["distributed_type"], r["world_size"]) == ("MULTI_CPU", 2)
    assert r0["moved"] > 1e-3  # the weights did change
    assert r0["after"] == r1["after"]


# ----------------------------------------------------------------------------- check_launch


def test_check_launch_refuses_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed is not supported (optimizer step per backward, partitioned optimizer state, ZeRO-3 weights):
    the launch stops at once, pointing at FSDP2, on one process or several."""
    from accelerate.utils import DistributedType

    from mmalign.config import ConfigError
    from mmalign.training.distributed import check_launch

    for world, processes in (("1", 1), ("2", 2)):
        monkeypatch.setenv("WORLD_SIZE", world)
        with pytest.raises(ConfigError, match="DeepSpeed is not supported") as err:
            check_launch(DistributedType.DEEPSPEED, processes)
        assert "configs/accelerate/fsdp2.yaml" in str(err.value)
    check_launch(DistributedType.MULTI_CPU, 2)  # what the other launches are told: nothing
    check_launch(DistributedType.FSDP, 2)
