"""FSDP2 (`mmalign.training.distributed.apply_fsdp2`, ``fully_shard`` on a CPU device mesh over gloo) under the trainer.

The slow tests launch ``tests/scripts/dist_fsdp2.py`` with torchrun (2 processes) and once in a single process
(see that script): the sharded update equals the single-process update on the same global batch, the rollout
engine receives full weights, and sharded (DCP) checkpoints resume exactly. The fast tests check the block
defaults against the installed libraries and the checks that need no process group.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from mmalign.training import distributed

SCRIPT = Path(__file__).parents[1] / "scripts" / "dist_fsdp2.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not on PATH")
    out = tmp_path_factory.mktemp("fsdp2")
    cmd = [torchrun, "--standalone", "--nproc_per_node=2", str(SCRIPT), str(out), "fsdp"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "reference"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert ref.returncode == 0, ref.stderr[-4000:]
    return {
        "out": out,
        "ranks": [json.loads((out / f"fsdp_rank{r}.json").read_text()) for r in (0, 1)],
        "reference": json.loads((out / "reference.json").read_text()),
    }


@pytest.mark.slow
def test_sharded_update_equals_single_process_update(runs: dict[str, Any]) -> None:
    r0, r1 = runs["ranks"]
    for r in (r0, r1):
        assert r["world_size"] == 2
        assert r["distributed_type"] == "MULTI_CPU"
    out = runs["out"]
    before = torch.load(out / "fsdp_before.pt")
    fsdp, ref = torch.load(out / "fsdp_after.pt"), torch.load(out / "reference_after.pt")
    assert runs["reference"]["samples"] == 4 * 4  # the global batch: 4 prompts x 4 samples, 8 on each rank
    assert sorted(fsdp) == sorted(ref)
    moved = max(float((ref[n] - before[n]).abs().max()) for n in ref)
    assert moved > 1e-3  # the update did change the weights (lr 1e-2, two passes)
    for name in ref:
        torch.testing.assert_close(fsdp[name], ref[name], rtol=1e-4, atol=2e-5, msg=name)
    # the gradient norm is global (over all shards): the same on both ranks and equal to the 1-process norm
    assert r0["update"]["grad_norm"] == r1["update"]["grad_norm"]
    assert r0["update"]["grad_norm"] == pytest.approx(runs["reference"]["update"]["grad_norm"], rel=1e-5)
    assert r0["moved"] == pytest.approx(sum(float((fsdp[n] - before[n]).abs().sum()) for n in fsdp), rel=1e-6)


@pytest.mark.slow
def test_engine_sync_receives_full_weights(runs: dict[str, Any]) -> None:
    for r in runs["ranks"]:
        e = r["engine"]
        assert e["synced_version"] == 2  # the first rollout's sync, then the one after the update
        assert e["names_equal"] and e["shapes_equal"]
        assert e["max_abs_diff"] == 0.0
        assert e["local_numel"] < 0.6 * e["full_numel"]  # each rank holds about half of the weights


@pytest.mark.slow
def test_lora_weights_for_the_engine_are_gathered(runs: dict[str, Any]) -> None:
    for r in runs["ranks"]:
        lora = r["lora_sync"]
        assert lora["sharded"] and lora["merged_names_equal"] and lora["adapter_names_equal"]
        assert lora["delta_abs_max"] > 1e-3  # the merged weights differ from the base ones
        assert lora["merged_max_abs_diff"] < 1e-6
        assert lora["adapter_max_abs_diff"] == 0.0
        # its sharded checkpoint: adapter weights and optimizer moments only, restored exactly
        assert lora["ckpt_restored"] and lora["ckpt_moments_restored"]
        assert lora["ckpt_lora_keys"] == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
        # of the frozen base weights, DCP keeps only the tied output embedding (one tensor with the input one)
        assert lora["ckpt_frozen_keys"] == ["model.base_model.model.lm_head.weight"]


@pytest.mark.slow
def test_sharded_checkpoint_resumes_exactly(runs: dict[str, Any]) -> None:
    for r in runs["ranks"]:
        res = r["resume"]
        assert [m["step"] for m in res["resumed"]] == [3, 4]
        assert res["resumed"] == res["straight"]
        assert res["weights_max_abs_diff"] == 0.0
        assert res["moved"] > 1e-3
    assert runs["ranks"][0]["final_dir_max_abs_diff"] == 0.0  # final/: the gathered weights, from_pretrained


# ----------------------------------------------------------------------------- no process group needed


@pytest.mark.parametrize(
    ("module", "cls_name", "blocks"),
    [
        ("transformers.models.qwen2.modeling_qwen2", "Qwen2ForCausalLM", "qwen2"),
        ("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VLForConditionalGeneration", "qwen2_vl"),
        (
            "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
            "Qwen2_5_VLForConditionalGeneration",
            "qwen2_5_vl",
        ),
        ("diffusers.models.transformers.transformer_sd3", "SD3Transformer2DModel", "sd3"),
        ("diffusers.models.transformers.transformer_flux", "FluxTransformer2DModel", "flux"),
        ("diffusers.models.transformers.transformer_wan", "WanTransformer3DModel", "wan"),
    ],
)
def test_default_blocks_are_the_installed_no_split_modules(module: str, cls_name: str, blocks: str) -> None:
    mod = importlib.import_module(module)
    names = distributed.DEFAULT_BLOCKS[blocks]
    assert set(getattr(mod, cls_name)._no_split_modules) == set(names)
    for name in names:
        assert isinstance(getattr(mod, name), type), name


def _tiny_qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return Qwen2ForCausalLM(cfg)


def test_find_blocks_defaults_to_no_split_modules() -> None:
    model = _tiny_qwen2()
    blocks = distributed.find_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["Qwen2DecoderLayer"] * 3
    assert blocks == list(model.model.layers)
    assert distributed.find_blocks(model, [type(model.model.layers[0])]) == blocks
    with pytest.raises(ValueError, match="no module of Qwen2ForCausalLM is one of the block classes"):
        distributed.find_blocks(model, ["NotABlock"])
    with pytest.raises(ValueError, match="declares no _no_split_modules; pass block_classes"):
        distributed.find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_find_blocks_of_a_peft_model_uses_the_base_model() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny_qwen2(), LoraConfig(r=2, target_modules=["q_proj"]))
    assert distributed.default_block_classes(model) == ["Qwen2DecoderLayer"]
    assert len(distributed.find_blocks(model)) == 3


def test_plain_models_are_not_fsdp2_and_need_a_process_group() -> None:
    model = _tiny_qwen2()
    assert not distributed.is_fsdp2(model)
    assert not distributed.is_dtensor(next(model.parameters()))
    full = distributed.gather_full_state_dict(model, trainable_only=True)
    assert sorted(full) == sorted(n for n, _ in model.named_parameters())
    name, p = next(iter(model.named_parameters()))
    assert torch.equal(full[name], p.detach()) and full[name].data_ptr() != p.data_ptr()  # a copy
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="needs an initialised process group"):
            distributed.apply_fsdp2(model)


def test_load_sharded_names_a_folder_that_is_not_a_dcp_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a sharded .* checkpoint: no .metadata"):
        distributed.load_sharded(tmp_path, _tiny_qwen2(), None)


def test_a_sharded_checkpoint_is_refused_by_a_non_sharded_run(
    random_text_model_dir: Path, tmp_path: Path
) -> None:
    import pipelines
    from mmalign.config import ConfigError, config_from_dict
    from mmalign.training.rundir import latest_checkpoint
    from mmalign.training.trainer import GroupTrainer

    cfg = {
        "pipeline": "text_reasoning",
        "output_dir": str(tmp_path / "run"),
        "model": {"name_or_path": str(random_text_model_dir)},
        "data": {
            "train": str(Path(__file__).resolve().parents[2] / "assets/text_reasoning/train.jsonl"),
            "prompt_template": "Q: {question} = ?\nA:",
        },
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4},
        "rewards": [{"name": "format", "kwargs": {"tags": ["answer"]}}],
        "trainer": {"steps": 1, "progress_bar": False, "save_every": 1},
    }
    first = config_from_dict(cfg, "test")
    trainer = GroupTrainer(first, pipelines.get("text_reasoning")(first))
    assert not trainer.sharded
    trainer.train()
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt is not None and (ckpt / "trainable.safetensors").is_file()
    (ckpt / distributed.SHARDED_DIR).mkdir()  # as an FSDP2 run writes it
    again = config_from_dict(cfg, "test")
    with pytest.raises(
        ConfigError, match=r"written by a sharded \(FSDP2\) run; resume it with the model sharded"
    ):
        GroupTrainer(again, pipelines.get("text_reasoning")(again), resume=True)
