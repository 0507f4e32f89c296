"""The accelerate configs in configs/accelerate/: each parses, accelerate's launcher accepts it and builds the plugin
it names; a GPU smoke test trains one step through ``accelerate launch --config_file`` with each (skipped without
CUDA, and for DeepSpeed without the ``deepspeed`` package)."""

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
NAMES = ["ddp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3"]
EXPECTED_TYPE = {
    "ddp": "MULTI_GPU",
    "fsdp2": "FSDP",
    "deepspeed_zero2": "DEEPSPEED",
    "deepspeed_zero3": "DEEPSPEED",
}


def test_the_folder_holds_exactly_the_documented_configs() -> None:
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(NAMES)
    doc = (REPO / "docs" / "distributed.md").read_text()
    for name in NAMES:
        assert f"configs/accelerate/{name}.yaml" in doc, name


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


@pytest.mark.parametrize(("name", "stage"), [("deepspeed_zero2", 2), ("deepspeed_zero3", 3)])
def test_deepspeed_configs_build_their_zero_stage(name: str, stage: int) -> None:
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args, defaults = _launch_args(name)
    assert args.use_deepspeed and not args.use_fsdp
    args.deepspeed_fields_from_accelerate_config = list(
        defaults.deepspeed_config
    )  # as `accelerate launch` sets
    _, env = prepare_deepspeed_cmd_env(args)
    with mock.patch.dict(os.environ, env):
        plugin = DeepSpeedPlugin()
    zero = plugin.deepspeed_config["zero_optimization"]
    assert plugin.zero_stage == zero["stage"] == stage
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "none"
    assert zero["stage3_gather_16bit_weights_on_model_save"] is (stage == 3)


# ----------------------------------------------------------------------------- GPU smoke tests


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_accelerate_launch_trains_one_step(name: str, tmp_path: Path) -> None:
    """TRL-style: ``accelerate launch --config_file X --num_processes 1`` trains the tiny text config for one step
    (one process: with several, TextPolicy's ``generate`` would need ``synced_gpus`` under FSDP2 / ZeRO-3)."""
    if not torch.cuda.is_available():
        pytest.skip(f"{name}.yaml needs CUDA (accelerate turns FSDP into DDP and disables DeepSpeed on CPU)")
    if name.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip(f"{name}.yaml needs the deepspeed package (pip install deepspeed)")
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
