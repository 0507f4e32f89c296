"""Rollout engines (mmalign.engines) and the truncated-IS correction (mmalign.algorithms.is_correction)."""

from __future__ import annotations

import copy
import importlib.util
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from mmalign.algorithms import is_correction as isc
from mmalign.engines import (
    EngineStateError,
    SamplingSpec,
    WeightSyncError,
    adapter_state_dict,
    full_state_dict,
    get_engine,
    merged_state_dict,
    outputs_to_tensors,
)
from mmalign.engines.fake import FakeEngine, filter_logits

PROMPTS_TEXT = ["Q: 3 + 4 = ?\nA:", "hello world, the"]
REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def model_dir(random_text_model_dir: Path) -> Path:
    """The random tiny Qwen2 LM + BPE tokenizer of tests/conftest.py (offline, instant)."""
    return random_text_model_dir


def load(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompt_ids(path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [tok(p)["input_ids"] for p in PROMPTS_TEXT]


@torch.no_grad()
def direct_logp(
    model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T) of each completion token from one plain forward over prompt + completion."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def max_gap(
    engine: FakeEngine, model: torch.nn.Module, prompts: list[list[int]], spec: SamplingSpec, n: int = 2
) -> float:
    outs = engine.generate(prompts, n, spec)
    gap = 0.0
    for o in outs:
        ref = direct_logp(model, prompts[o.prompt_index], o.token_ids, spec.temperature)
        gap = max(gap, float((torch.tensor(o.logprobs) - ref).abs().max()))
    return gap


def perturb(model: torch.nn.Module, scale: float = 0.5, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp(min=1e-3))


SPEC = SamplingSpec(temperature=0.8, top_k=50, top_p=0.95, max_new_tokens=12, seed=123)


# ----------------------------------------------------------------------------- FakeEngine sampling


def test_fake_engine_logprobs_match_hf_forward(model_dir: Path) -> None:
    engine = FakeEngine.from_pretrained(model_dir)
    prompts = prompt_ids(model_dir)
    outs = engine.generate(prompts, 3, SPEC)
    assert [o.prompt_index for o in outs] == [0, 0, 0, 1, 1, 1]
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert all(len(o.token_ids) == len(o.logprobs) >= 1 for o in outs)
    assert all(len(o.token_ids) == 12 for o in outs if o.finish_reason == "length")
    for o in outs:
        ref = direct_logp(engine.model, prompts[o.prompt_index], o.token_ids, SPEC.temperature)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=2e-5, rtol=0)
    # same seed, same weights: same samples; samples within a group differ
    again = engine.generate(prompts, 3, SPEC)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1
    ids, logp, lengths = outputs_to_tensors(outs, pad_id=0)
    assert ids.shape == logp.shape == (6, int(lengths.max()))
    assert float(logp[0, : lengths[0]].sum()) == pytest.approx(sum(outs[0].logprobs), abs=1e-5)


def test_fake_engine_stop_tokens_and_greedy(model_dir: Path) -> None:
    engine = FakeEngine.from_pretrained(model_dir)
    prompts = prompt_ids(model_dir)[:1]
    greedy = engine.generate(prompts, 2, SamplingSpec(temperature=0.0, max_new_tokens=5))
    assert greedy[0].token_ids == greedy[1].token_ids  # greedy is deterministic
    first = greedy[0].token_ids[0]
    stopped = engine.generate(
        prompts, 1, SamplingSpec(temperature=0.0, max_new_tokens=5, stop_token_ids=[first])
    )
    assert stopped[0].token_ids == [first] and stopped[0].finish_reason == "stop"
    text = engine.tokenizer.decode(greedy[0].token_ids[:2])
    by_string = engine.generate(prompts, 1, SamplingSpec(temperature=0.0, max_new_tokens=5, stop=[text]))
    assert by_string[0].finish_reason == "stop" and len(by_string[0].token_ids) <= 2


def test_filter_logits_top_k_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.1)).tolist() == [[False, True, True, True]]


# ----------------------------------------------------------------------------- weight sync


def test_full_weight_sync_restores_agreement(model_dir: Path) -> None:
    trainer = load(model_dir)
    engine = FakeEngine.from_pretrained(model_dir)
    prompts = prompt_ids(model_dir)
    assert max_gap(engine, trainer, prompts, SPEC) < 2e-5  # same weights
    perturb(trainer)  # an "optimizer step" on the trainer side
    assert max_gap(engine, trainer, prompts, SPEC) > 1e-2  # engine is stale
    engine.sync_weights(full_state_dict(trainer), lora=False, timeout_s=30, step=1)
    assert engine.weight_version == 1 and engine.last_synced_step == 1
    assert max_gap(engine, trainer, prompts, SPEC) < 2e-5
    # an iterable of (name, tensor) pairs works too
    perturb(trainer, seed=2)
    engine.sync_weights(((n, p.detach()) for n, p in trainer.named_parameters()), lora=False, timeout_s=30)
    assert max_gap(engine, trainer, prompts, SPEC) < 2e-5


def _peft_trainer(model_dir: Path, init_lora_weights: bool = False) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=init_lora_weights
    )
    return get_peft_model(load(model_dir), cfg).eval()


def test_lora_merge_and_push(model_dir: Path) -> None:
    trainer = _peft_trainer(model_dir)  # non-zero LoRA B: the adapted model differs from the base
    engine = FakeEngine.from_pretrained(model_dir)
    prompts = prompt_ids(model_dir)
    assert max_gap(engine, trainer, prompts, SPEC) > 1e-3
    merged = merged_state_dict(trainer)
    reference = copy.deepcopy(trainer).merge_and_unload().state_dict()
    assert set(merged) == set(reference)
    for k in reference:
        torch.testing.assert_close(merged[k], reference[k], atol=1e-6, rtol=0)
    assert any(p.requires_grad for p in trainer.parameters())  # the trainer model is untouched
    assert full_state_dict(trainer).keys() == merged.keys()
    engine.sync_weights(merged, lora=False, timeout_s=30, step=4)
    assert max_gap(engine, trainer, prompts, SPEC) < 2e-5


def test_lora_adapter_sync(model_dir: Path) -> None:
    trainer = _peft_trainer(model_dir)
    cfg = trainer.peft_config["default"]
    fresh_cfg = copy.deepcopy(cfg)
    fresh_cfg.init_lora_weights = True  # the engine's adapter starts as a no-op
    engine = FakeEngine(load(model_dir), peft_config=fresh_cfg)
    prompts = prompt_ids(model_dir)
    assert max_gap(engine, trainer, prompts, SPEC) > 1e-3
    engine.sync_weights(adapter_state_dict(trainer), lora=True, timeout_s=30)
    assert max_gap(engine, trainer, prompts, SPEC) < 2e-5


def test_sync_timeout_raises_quickly(model_dir: Path) -> None:
    engine = FakeEngine.from_pretrained(model_dir, sync_delay_s=60.0)
    state = full_state_dict(load(model_dir))
    t0 = time.perf_counter()
    with pytest.raises(WeightSyncError, match=r"fake engine.*step 7.*timeout_s=0\.2"):
        engine.sync_weights(state, lora=False, timeout_s=0.2, step=7)
    # it did not wait for the 60 s load (a loose bound: this is not a timing test, and CI may be loaded)
    assert time.perf_counter() - t0 < 30.0
    with pytest.raises(EngineStateError, match="unknown state"):
        engine.generate(prompt_ids(model_dir), 1, SPEC)
    with pytest.raises(WeightSyncError, match="still running"):
        engine.sync_weights(state, lora=False, timeout_s=0.2)
    engine.close()  # lets the stuck load end
    engine._running_sync.join(2.0)  # type: ignore[union-attr]
    engine.sync_delay_s = 0.0
    engine.sync_weights(state, lora=False, timeout_s=5)
    assert len(engine.generate(prompt_ids(model_dir), 1, SPEC)) == 2
    assert time.perf_counter() - t0 < 30.0  # close() ended the stuck 60 s load


def test_sync_error_surfaces_with_cause(model_dir: Path) -> None:
    engine = FakeEngine.from_pretrained(model_dir, sync_error=RuntimeError("NCCL broadcast failed"))
    state = full_state_dict(load(model_dir))
    with pytest.raises(WeightSyncError, match="NCCL broadcast failed") as info:
        engine.sync_weights(state, lora=False, timeout_s=5, step=2)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "step 2" in str(info.value)
    engine.sync_error = None
    with pytest.raises(WeightSyncError) as info2:  # a name the engine's model does not have
        engine.sync_weights({"not.a.weight": torch.zeros(1)}, lora=False, timeout_s=5)
    assert isinstance(info2.value.__cause__, KeyError)
    engine.sync_weights(state, lora=False, timeout_s=5)
    assert engine.generate(prompt_ids(model_dir), 1, SPEC)


def test_lora_true_unsupported_engine_raises(model_dir: Path) -> None:
    engine = FakeEngine.from_pretrained(model_dir)  # no adapter configured
    with pytest.raises(WeightSyncError, match="needs an adapter"):
        engine.sync_weights({}, lora=True, timeout_s=5)


# ----------------------------------------------------------------------------- registry / vLLM


def test_get_engine(model_dir: Path) -> None:
    assert get_engine("hf") is None
    assert isinstance(get_engine("fake", model=load(model_dir)), FakeEngine)
    with pytest.raises(ValueError, match="hf, fake, vllm"):
        get_engine("sglang")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_engine_without_vllm_names_the_extra() -> None:
    import mmalign.engines.vllm as vmod  # importing never needs vLLM

    with pytest.raises(ImportError, match=r"mmalign\[vllm\]"):
        vmod.VLLMEngine()
    with pytest.raises(ImportError, match=r"mmalign\[vllm\]"):
        get_engine("vllm", model="unused")


@pytest.mark.gpu
def test_vllm_rollout_and_sync_on_tiny_model(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mmalign import tiny
    from mmalign.engines.vllm import VLLMEngine

    torch.manual_seed(0)
    texts = [f"Q: {a} + {b} = ?\nA: {a + b} hello world, the end." for a in range(10) for b in range(10)]
    tok = tiny.train_bpe_tokenizer(texts, vocab_size=300)
    # head_dim 64: vLLM's attention backends do not support very small heads
    model = tiny.tiny_causal_lm(
        tok,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    engine = VLLMEngine(
        tmp_path / "m",
        dtype="float32",
        gpu_memory_utilization=0.2,
        enforce_eager=True,
        max_model_len=128,
        enable_sleep_mode=False,
    )
    prompts = [tok(p)["input_ids"] for p in PROMPTS_TEXT]
    spec = SamplingSpec(temperature=1.0, max_new_tokens=8, seed=0)
    outs = engine.generate(prompts, 4, spec)
    assert len(outs) == 8 and [o.prompt_index for o in outs] == [0] * 4 + [1] * 4
    gap = max(
        float(
            (torch.tensor(o.logprobs) - direct_logp(model, prompts[o.prompt_index], o.token_ids, 1.0))
            .abs()
            .max()
        )
        for o in outs
    )
    assert gap < 1e-2
    perturb(model)
    engine.sync_weights(full_state_dict(model), lora=False, timeout_s=120, step=1)
    outs = engine.generate(prompts, 4, spec)
    gap = max(
        float(
            (torch.tensor(o.logprobs) - direct_logp(model, prompts[o.prompt_index], o.token_ids, 1.0))
            .abs()
            .max()
        )
        for o in outs
    )
    assert gap < 1e-2


# ----------------------------------------------------------------------------- truncated IS


def loop_tis(
    old: list[list[float]], eng: list[list[float]], mask: list[list[bool]], level: str, cap: float
) -> list[list[float]]:
    out = []
    for o_row, e_row, m_row in zip(old, eng, mask):
        if level == "token":
            out.append([min(math.exp(o - e), cap) if m else 0.0 for o, e, m in zip(o_row, e_row, m_row)])
        else:
            s = sum(o - e for o, e, m in zip(o_row, e_row, m_row) if m)
            w = min(math.exp(s), cap)
            out.append([w if m else 0.0 for m in m_row])
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("cap", [1.2, 2.0, 5.0])
def test_tis_weights_match_loop_reference(level: str, cap: float) -> None:
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    eng = old + torch.randn(5, 7, generator=g, dtype=torch.float64) * 0.4
    mask = torch.rand(5, 7, generator=g) > 0.3
    mask[2] = False  # an empty row
    w = isc.tis_weights(old, eng, mask, level=level, cap=cap)
    ref = torch.tensor(loop_tis(old.tolist(), eng.tolist(), mask.tolist(), level, cap), dtype=torch.float64)
    torch.testing.assert_close(w, ref, atol=1e-12, rtol=1e-12)
    assert not w.requires_grad


def test_tis_hand_worked_numbers() -> None:
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
    eng = torch.tensor([[-1.5, -1.0, float("nan")], [-1.5, -1.5, -0.5]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    w = isc.tis_weights(old, eng, mask, level="token", cap=2.0)
    # diffs: row 0 = 0.5, -1.0, (masked); row 1 = 1.0, 1.0, 0.0
    expected = torch.tensor([[math.exp(0.5), math.exp(-1.0), 0.0], [2.0, 2.0, 1.0]])
    torch.testing.assert_close(w, expected)
    ws = isc.tis_weights(old, eng, mask, level="sequence", cap=2.0)
    # sums: row 0 = -0.5 -> 0.6065; row 1 = 2.0 -> e^2 = 7.39 capped at 2
    torch.testing.assert_close(ws, torch.tensor([[math.exp(-0.5), math.exp(-0.5), 0.0], [2.0, 2.0, 2.0]]))
    m = isc.is_metrics(old, eng, mask, level="token", cap=2.0)
    assert m["is/weight_mean"] == pytest.approx((math.exp(0.5) + math.exp(-1.0) + 2.0 + 2.0 + 1.0) / 5)
    assert m["is/capped_frac"] == pytest.approx(2 / 5)
    assert m["is/abs_dlogp_mean"] == pytest.approx((0.5 + 1.0 + 1.0 + 1.0 + 0.0) / 5)
    assert m["is/abs_dlogp_max"] == pytest.approx(1.0)
    ms = isc.is_metrics(old, eng, mask, level="sequence", cap=2.0)
    assert ms["is/capped_frac"] == pytest.approx(0.5)


def test_tis_identical_logprobs_give_ones_and_bad_inputs_raise() -> None:
    lp = -torch.rand(3, 4)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[0, 3] = False
    w = isc.tis_weights(lp, lp.clone(), mask, level="token", cap=2.0)
    assert torch.equal(w, mask.float())
    huge = isc.tis_weights(lp, lp - 1e4, mask, level="sequence", cap=3.0)  # no overflow
    assert torch.isfinite(huge).all() and float(huge.max()) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="level"):
        isc.tis_weights(lp, lp, mask, level="tok")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cap"):
        isc.tis_weights(lp, lp, mask, cap=0.0)
    with pytest.raises(ValueError, match="same shape"):
        isc.tis_weights(lp, lp[:, :2], mask)
    assert isc.is_metrics(lp, lp, torch.zeros_like(mask))["is/weight_mean"] == 0.0


def test_apply_is_weights_scales_loss_and_gradient() -> None:
    from mmalign.algorithms import losses

    logp = (-torch.rand(2, 3)).requires_grad_(True)
    logp_old = logp.detach() + 0.05
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    weights = torch.tensor([[0.5, 2.0, 0.0], [1.0, 1.5, 0.2]], requires_grad=True)
    out = losses.get("ppo_clip")(logp, logp_old, adv, mask)
    weighted = isc.apply_is_weights(out.per_token, weights)
    torch.testing.assert_close(weighted, out.per_token * weights.detach())
    weighted.sum().backward()
    assert weights.grad is None  # no gradient into the weights
    assert logp.grad is not None and float(logp.grad[0, 2]) == 0.0


# ----------------------------------------------------------------------------- sleep / wake


def test_sleep_wake_contract(model_dir: Path) -> None:
    """`sleep` acts only where the sleep mode is on; an asleep engine wakes by itself before it samples or
    loads weights (the fake engine raises on either while asleep, so a missing wake would fail here)."""
    trainer = load(model_dir)
    engine = FakeEngine(trainer)
    prompts = prompt_ids(model_dir)
    engine.sleep()
    engine.sleep()  # idempotent
    assert engine.asleep and engine.calls == [("sleep", None)]
    engine.sync_weights(full_state_dict(trainer), timeout_s=30, step=1)
    engine.sleep()
    engine.generate(prompts, 1, SPEC)
    assert [c[0] for c in engine.calls] == ["sleep", "wake", "sync", "sleep", "wake", "generate"]
    off = FakeEngine(trainer, enable_sleep_mode=False)
    off.sleep()
    assert not off.asleep and off.calls == []  # a no-op without sleep mode
    off.generate(prompts, 1, SPEC)


def _tiny_cli_run(tmp_path: Path, *overrides: str) -> list[FakeEngine]:
    """`mmalign train configs/text_reasoning-tiny.yaml` for 3 small steps with ``rollout.engine: fake``; every
    update (`TextPolicy.action_stats` with gradients) is recorded in the engine's ``calls`` with its state."""
    from mmalign.app.cli import main
    from mmalign.policies.text import TextPolicy

    engines: list[FakeEngine] = []
    init, stats = FakeEngine.__init__, TextPolicy.action_stats

    def keep(self: FakeEngine, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        engines.append(self)

    def recorded(self: TextPolicy, rollout: Any) -> Any:
        self.engine.calls.append(("update", self.engine.asleep))
        return stats(self, rollout)

    args = [
        "train",
        "configs/text_reasoning-tiny.yaml",
        f"output_dir={tmp_path / 'run'}",
        "rollout.engine=fake",
        "rollout.group_size=2",
        "rollout.prompts_per_step=2",
        "rollout.max_new_tokens=4",
        "trainer.steps=3",
        "trainer.save_every=1000",
        "trainer.sample_every=1000",
        "trainer.progress_bar=false",
        *overrides,
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FakeEngine, "__init__", keep)
        mp.setattr(TextPolicy, "action_stats", recorded)
        mp.chdir(REPO)
        assert main(args) == 0
    return engines


def test_engine_sleeps_during_the_update_in_a_real_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny training run through the CLI with ``rollout.engine: fake``: each step the engine wakes, takes the
    new weights, samples, and sleeps before the update (which runs while it is asleep); with
    ``enable_sleep_mode: false`` it never sleeps."""
    (engine,) = _tiny_cli_run(tmp_path / "on")
    step = [("wake", None), ("sync", None), ("generate", 2), ("sleep", None), ("update", True)]
    first = step[1:]  # built awake
    calls = [(name, None if name == "sync" else detail) for name, detail in engine.calls]
    assert calls == first + step + step, engine.calls
    assert [d for n, d in engine.calls if n == "sync"] == [0, 1, 2]
    (awake,) = _tiny_cli_run(tmp_path / "off", "rollout.engine_kwargs.enable_sleep_mode=false")
    assert [n for n, _ in awake.calls] == ["sync", "generate", "update"] * 3
    assert [d for n, d in awake.calls if n == "update"] == [False] * 3


# ----------------------------------------------------------------------------- multi-turn runs with an engine


def tool_env(ctx: Any) -> Any:
    """Even samples get a tool answer after their first turn, then a second turn; odd ones stop at once."""
    from mmalign.data.rollout_loops import DONE, Insert

    return Insert(text=" Tool: 7.", role=None) if ctx.turn == 0 and ctx.group_index % 2 == 0 else DONE


def length_mod3(batch: Any) -> list[float]:
    """len(text) % 3: varies on a random model's gibberish, so advantages are not all zero."""
    return [float(len(t) % 3) for t in batch.texts]


def multi_turn_cfg(model_dir: Path, out: Path, *, engine: str, steps: int, **engine_kwargs: Any) -> Any:
    """A text_reasoning run with the multi_turn loop (`tool_env`) sampling through `engine`."""
    from mmalign.config import config_from_dict

    return config_from_dict(
        {
            "pipeline": "text_reasoning",
            "output_dir": str(out),
            "seed": 0,
            "model": {"name_or_path": str(model_dir)},
            "data": {
                "train": str(REPO / "assets" / "text_reasoning" / "train.jsonl"),
                "prompt_template": "Q: {question} = ?\nA:",
            },
            "rollout": {
                "group_size": 4,
                "prompts_per_step": 2,
                "max_new_tokens": 6,
                "temperature": 0.9,
                "engine": engine,
                "engine_kwargs": engine_kwargs,
                "is_correction": "token",
                "loop": "multi_turn",
                "loop_kwargs": {"environment": f"{__name__}:tool_env", "max_turns": 2},
            },
            "rewards": [{"name": f"{__name__}:length_mod3"}],
            "trainer": {"steps": steps, "lr": 1e-2, "progress_bar": False, "save_every": 1000},
        },
        "test",
    )


def test_multi_turn_run_engine_matches_trainer_after_every_step(model_dir: Path, tmp_path: Path) -> None:
    """The multi_turn loop with ``rollout.engine: fake``: every turn is sampled by the engine, the trainer
    pushes its weights before each step's rollout, so the engine's log-prob of each generated token equals the
    trainer's re-scoring after every optimizer step (1e-5: the same fp32 weights, another kernel order);
    inserted tokens are in the sequences but not in the comparison (``mask``). Without the sync it drifts."""
    import pipelines
    from mmalign.training.trainer import GroupTrainer

    cfg = multi_turn_cfg(model_dir, tmp_path / "run", engine="fake", steps=3)
    trainer = GroupTrainer(cfg, pipelines.get(cfg.pipeline)(cfg))
    engine = trainer.policy.engine
    history = trainer.train()
    assert len(history) == 3
    for m in history:
        assert m["is/abs_dlogp_max"] < 1e-5, m
        assert m["num_turns/mean"] == 1.5 and m["inserted_len/mean"] > 0, m  # the tool answers are there
    assert [d for n, d in engine.calls if n == "sync"] == [0, 1, 2]
    assert [n for n, _ in engine.calls].count("generate") == 6  # two turns per step
    trainer.policy.sync_engine = lambda step=0: None  # type: ignore[method-assign]
    trainer.cfg.trainer.steps = 5
    assert (
        trainer.train()[-1]["is/abs_dlogp_max"] > 1e-3
    )  # the check above can fail: a stale engine is caught
