"""The accelerate configs in configs/accelerate/: each parses, accelerate's launcher accepts it and builds the plugin
it names; a GPU smoke test trains one step through ``accelerate launch --config_file`` with each (skipped without
CUDA). DeepSpeed is not supported: no config ships, and a GPU test checks that a DeepSpeed launch stops at once
pointing at FSDP2 (skipped without CUDA or the ``deepspeed`` package; `mmalign.training.distributed.check_launch`'s refusal
itself is tested on CPU in tests/training/test_distributed.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "accelerate"
NAMES = ["ddp", "fsdp2"]
EXPECTED_TYPE = {"ddp": "MULTI_GPU", "fsdp2": "FSDP"}


def test_the_folder_holds_exactly_the_documented_configs() -> None:
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(NAMES)
    doc = (REPO / "docs" / "distributed.md").read_text()
    for name in NAMES:
        assert f"configs/accelerate/{name}.yaml" in doc, name
    assert "configs/accelerate/deepspeed" not in doc
    assert "DeepSpeed is not supported" in doc


def _launch_args(name: str) -> tuple[Any, Any]:
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    argv = ["--config_file", str(CONFIGS / f"{name}.yaml"), "--num_processes", "1"]
    args = launch_command_parser().parse_args([*argv, "-m", "mmalign.app.cli", "train", "x.yaml"])
    args, defaults, _ = _validate_launch_command(args)
    return args, defaults


@pytest.mark.parametrize("name", NAMES)
def test_accelerate_loads_the_config(name: str) -> None:
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    raw = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    cfg = load_config_from_file(str(CONFIGS / f"{name}.yaml"))  # unknown keys are an error here
    assert isinstance(cfg, ClusterConfig)
    assert cfg.distributed_type.value == raw["distributed_type"] == EXPECTED_TYPE[name]
    assert cfg.mixed_precision == "no"  # precision comes from trainer.mixed_precision
    assert not cfg.use_cpu


def test_fsdp2_config_builds_an_fsdp2_plugin_that_wraps_no_split_modules() -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env
    from torch.distributed.fsdp import StateDictType

    args, _ = _launch_args("fsdp2")
    assert args.use_fsdp and not args.use_deepspeed
    env = prepare_multi_gpu_env(args)
    with mock.patch.dict(os.environ, env):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"
    assert plugin.transformer_cls_names_to_wrap is None  # left to the model's _no_split_modules
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert plugin.reshard_after_forward is True


def test_ddp_config_is_a_plain_multi_gpu_launch() -> None:
    args, _ = _launch_args("ddp")
    assert args.multi_gpu and not args.use_fsdp and not args.use_deepspeed


# ----------------------------------------------------------------------------- GPU smoke tests


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_accelerate_launch_trains_one_step(name: str, tmp_path: Path) -> None:
    """TRL-style: ``accelerate launch --config_file X --num_processes 1`` trains the tiny text config for one step
    (one process: with several, TextPolicy's ``generate`` would need ``synced_gpus`` under FSDP2)."""
    if not torch.cuda.is_available():
        pytest.skip(f"{name}.yaml needs CUDA (accelerate turns FSDP into DDP on CPU)")
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", "trainer.steps=1", "trainer.save_every=1", "trainer.progress_bar=false"]
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / f"{name}.yaml"),
        "--num_processes", "1", "-m", "mmalign.app.cli", "train", "configs/text_reasoning-tiny.yaml", *overrides,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]
    ckpt = out / "checkpoints"
    steps = sorted(ckpt.iterdir())
    assert len(steps) == 1
    if name == "fsdp2":  # accelerate sharded the model: the checkpoint is a DCP folder
        assert (steps[0] / "sharded" / ".metadata").is_file()
    else:
        assert (steps[0] / "trainable.safetensors").is_file()


DEEPSPEED_ZERO2 = {  # what configs/accelerate/deepspeed_zero2.yaml held before DeepSpeed was refused
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "DEEPSPEED",
    "num_processes": 1,
    "num_machines": 1,
    "machine_rank": 0,
    "gpu_ids": "all",
    "mixed_precision": "no",
    "rdzv_backend": "static",
    "same_network": True,
    "main_training_function": "main",
    "use_cpu": False,
    "deepspeed_config": {
        "zero_stage": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "offload_optimizer_device": "none",
        "offload_param_device": "none",
        "zero3_init_flag": False,
    },
}


@pytest.mark.gpu
@pytest.mark.slow
def test_a_deepspeed_launch_is_refused(tmp_path: Path) -> None:
    """``accelerate launch`` with a DeepSpeed config stops before any training, saying to use FSDP2."""
    if not torch.cuda.is_available():
        pytest.skip("a DeepSpeed launch needs CUDA (accelerate disables DeepSpeed on CPU)")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("accelerate sets up DeepSpeed only with the deepspeed package (pip install deepspeed)")
    config = tmp_path / "deepspeed_zero2.yaml"
    config.write_text(yaml.safe_dump(DEEPSPEED_ZERO2))
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "1",
        "-m", "mmalign.app.cli", "train", "configs/text_reasoning-tiny.yaml", f"output_dir={out}",
        "trainer.steps=1", "trainer.progress_bar=false",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode != 0
    assert "DeepSpeed is not supported" in proc.stderr and "configs/accelerate/fsdp2.yaml" in proc.stderr
    assert not (out / "metrics.jsonl").exists()
