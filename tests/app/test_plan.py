"""`mmalign plan`: the predicted peak memory of a training step against a measured one, the architecture table
against the published model sizes, the FLOPs against the 6 N D rule, the fixes, and every tiny config.

The measured counterpart on CPU is torch's profiler with ``profile_memory=True``: it records every allocation
and free of the CPU allocator (the tensors of C++ kernels' internals included), and the running sum of those
events over one `GroupTrainer.update` is the step's peak of allocated tensor bytes, the quantity
``torch.cuda.max_memory_allocated`` reports on a GPU. The planner never sees it: it runs the architecture on
the meta device under its own dispatch-level recorder.
"""

from __future__ import annotations

import argparse
import gc
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mmalign.app import plan as plan_mod
from mmalign.app.plan_models import build_meta, load_table, param_numel, resolve_model
from mmalign.config import ConfigError, config_from_dict
from mmalign.data.batch import Rollout

REPO = Path(__file__).resolve().parents[2]
QWEN = "Qwen/Qwen2.5-0.5B-Instruct"


# ----------------------------------------------------------------------------- a real architecture on CPU
@pytest.fixture(scope="module")
def qwen05_two_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2.5-0.5B-Instruct's architecture from the table (width 896, 14 query / 2 KV heads, MLP 4864, the
    151,936-token tied vocabulary), 2 of its 24 decoder layers, random weights, saved with ``save_pretrained``
    beside a small tokenizer and loaded back by the pipeline as any model folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mmalign import tiny

    torch.manual_seed(0)
    cfg = dict(load_table()["models"][QWEN]["components"]["model"]["config"])
    cfg.pop("model_type")
    cfg["num_hidden_layers"] = 2
    path = tmp_path_factory.mktemp("models") / "qwen05-2layers"
    Qwen2ForCausalLM(Qwen2Config(**cfg)).save_pretrained(path)
    tiny.train_bpe_tokenizer(["Q: 1 + 2 = ?\nA: <answer>3</answer>"] * 8, vocab_size=300).save_pretrained(
        path
    )
    return path


def _config(model: Path, out: Path, *, lora: bool, ckpt: bool, micro: int, completion: int) -> object:
    return config_from_dict(
        {
            "pipeline": "text_reasoning",
            "output_dir": str(out),
            "overwrite": True,
            "model": {
                "name_or_path": str(model),
                "gradient_checkpointing": ckpt,
                "lora": {"enabled": lora, "r": 16, "alpha": 32},
            },
            "data": {
                "train": str(REPO / "assets/text_reasoning/train.jsonl"),
                "prompt_template": "Q: {question} = ?\nA:",
            },
            "rollout": {"group_size": 4, "prompts_per_step": 1, "max_new_tokens": completion},
            "rewards": [{"name": "format", "kwargs": {"pattern": r"[^e]*", "search": False}}],
            "trainer": {"steps": 1, "lr": 1e-4, "cpu": True, "progress_bar": False, "microbatch_size": micro},
        },
        "test_plan",
    )


def _rollout(b: int, prompt: int, completion: int) -> Rollout:
    """A recorded rollout of `b` samples: left-padded prompts (so the model gets an attention mask), every
    completion token valid (the planner's worst case)."""
    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.ones(b, prompt, dtype=torch.long)
    prompt_mask[:, 0] = 0
    return Rollout(
        group=torch.arange(b) // 4,
        mask=torch.ones(b, completion, dtype=torch.bool),
        prompts=["p"] * b,
        payload={
            "prompt_ids": torch.randint(0, 300, (b, prompt), generator=g),
            "prompt_mask": prompt_mask,
            "completion_ids": torch.randint(0, 300, (b, completion), generator=g),
            "completion_attention_mask": torch.ones(b, completion, dtype=torch.long),
        },
        advantages=torch.randn(b, generator=g),
        rewards=torch.randn(b, 1, generator=g),
    )


def _measured_step_peak(cfg: object, prompt: int, completion: int) -> int:
    """Bytes at the peak of the second `GroupTrainer.update` (AdamW's state exists from the first): the live
    parameters and optimizer state plus the running sum of the profiler's allocation events."""
    import pipelines
    from mmalign.app.plan import profiled_alloc_peak
    from mmalign.training.trainer import GroupTrainer

    trainer = GroupTrainer(cfg, pipelines.get("text_reasoning")(cfg))
    trainer.policy.model.train()  # as `GroupTrainer.train` does before its first step
    batch = _rollout(4, prompt, completion)
    trainer.update(batch)
    gc.collect()
    params = {id(p): p for p in trainer.policy.model.parameters()}.values()
    base = sum(p.numel() * p.element_size() for p in params)
    base += sum(
        v.numel() * v.element_size()
        for s in trainer.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    peak = profiled_alloc_peak(lambda: trainer.update(batch))
    return base + peak


CASES = [
    # (LoRA, checkpointing, microbatch, prompt, completion)
    pytest.param(True, False, 4, 48, 32, id="lora-short"),
    pytest.param(False, False, 4, 48, 32, id="full-short"),
]
SLOW_CASES = [
    pytest.param(True, False, 4, 160, 96, id="lora-long"),
    pytest.param(False, False, 2, 120, 64, id="full-two-microbatches"),
    pytest.param(True, True, 2, 400, 200, id="lora-checkpointing-long"),
    pytest.param(False, True, 4, 400, 200, id="full-checkpointing-long"),
]


def _check_peak(
    model: Path, tmp_path: Path, lora: bool, ckpt: bool, micro: int, prompt: int, completion: int
) -> None:
    cfg = _config(model, tmp_path / "run", lora=lora, ckpt=ckpt, micro=micro, completion=completion)
    measured = _measured_step_peak(cfg, prompt, completion)
    predicted = plan_mod.plan(
        cfg, plan_mod.Hardware(plan_mod.DEVICES["cpu"]), prompt_tokens=prompt
    ).train.memory.total
    assert abs(predicted / measured - 1) <= 0.15, (predicted / 2**20, measured / 2**20)


@pytest.mark.parametrize(("lora", "ckpt", "micro", "prompt", "completion"), CASES)
def test_cpu_step_peak_within_15_percent(
    qwen05_two_layers: Path, tmp_path: Path, lora: bool, ckpt: bool, micro: int, prompt: int, completion: int
) -> None:
    _check_peak(qwen05_two_layers, tmp_path, lora, ckpt, micro, prompt, completion)


@pytest.mark.slow
@pytest.mark.parametrize(("lora", "ckpt", "micro", "prompt", "completion"), SLOW_CASES)
def test_cpu_step_peak_within_15_percent_long(
    qwen05_two_layers: Path, tmp_path: Path, lora: bool, ckpt: bool, micro: int, prompt: int, completion: int
) -> None:
    _check_peak(qwen05_two_layers, tmp_path, lora, ckpt, micro, prompt, completion)


@pytest.mark.gpu
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_gpu_step_peak_within_10_percent(tmp_path: Path, lora: bool) -> None:
    """The whole Qwen2.5-0.5B architecture (24 layers) in bf16 with bf16 mixed precision on one GPU:
    ``torch.cuda.max_memory_allocated`` over the second update against the plan for the same GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import pipelines
    from mmalign import tiny
    from mmalign.training.trainer import GroupTrainer

    cfg_kw = dict(load_table()["models"][QWEN]["components"]["model"]["config"])
    cfg_kw.pop("model_type")
    path = tmp_path / "qwen05"
    Qwen2ForCausalLM(Qwen2Config(**cfg_kw)).to(torch.bfloat16).save_pretrained(path)
    tiny.train_bpe_tokenizer(["hello world"] * 8, vocab_size=300).save_pretrained(path)
    prompt, completion = 256, 512
    cfg = _config(path, tmp_path / "run", lora=lora, ckpt=True, micro=4, completion=completion)
    cfg.model.dtype = "bfloat16"
    cfg.trainer.mixed_precision = "bf16"
    cfg.trainer.cpu = False
    trainer = GroupTrainer(cfg, pipelines.get("text_reasoning")(cfg))
    trainer.policy.model.train()  # as `GroupTrainer.train` does before its first step
    batch = _rollout(4, prompt, completion)
    trainer.update(batch)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    trainer.update(batch)
    measured = torch.cuda.max_memory_allocated()
    name = "h200" if torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else "h100"
    predicted = plan_mod.plan(
        cfg, plan_mod.Hardware(plan_mod.DEVICES[name]), prompt_tokens=prompt
    ).train.memory.total
    assert abs(predicted / measured - 1) <= 0.10, (predicted / 2**20, measured / 2**20)


# ----------------------------------------------------------------------------- the architecture table
PUBLISHED_PARAMETERS = {
    # model card / paper sizes of the trained module (transformers: the whole model; diffusers: the denoiser)
    "Qwen/Qwen2.5-0.5B-Instruct": 0.49e9,  # model card: "Number of Parameters: 0.49B"
    "Qwen/Qwen2.5-VL-3B-Instruct": 3.75e9,  # safetensors total of the release
    "Qwen/Qwen2.5-VL-7B-Instruct": 8.29e9,  # safetensors total of the release
    "stabilityai/stable-diffusion-3.5-large": 8.1e9,  # model card: 8.1 billion parameters (MMDiT)
    "black-forest-labs/FLUX.1-dev": 12e9,  # model card: 12 billion parameter rectified flow transformer
    "black-forest-labs/FLUX.1-Kontext-dev": 12e9,  # model card: 12 billion parameter rectified flow transformer
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": 1.3e9,  # the model's name
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": 14e9,  # the model's name
    "Qwen/Qwen-Image": 20e9,  # model card: 20B MMDiT
    "Qwen/Qwen-Image-Edit": 20e9,  # model card: built on the 20B Qwen-Image
    "stable-diffusion-v1-5/stable-diffusion-v1-5": 0.86e9,  # SD paper / model card: 860M UNet
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_table_matches_published_sizes(name: str) -> None:
    """Every typed-in architecture builds on the meta device and has its model card's size (within 10%)."""
    spec = resolve_model(name)
    assert spec.origin == "table"
    key = "model" if spec.kind != "diffusers" else spec.denoiser
    n = param_numel(build_meta(spec.components[key], torch.bfloat16))
    assert abs(n / PUBLISHED_PARAMETERS[name] - 1) <= 0.10, n


def test_every_real_config_names_a_known_model() -> None:
    """The model of every non-tiny config is in the table (so `mmalign plan` works offline for all of them)."""
    import yaml

    known = set(load_table()["models"])
    for path in sorted((REPO / "configs").glob("*.yaml")):
        if path.name.endswith("-tiny.yaml"):
            continue
        name = (yaml.safe_load(path.read_text()).get("model") or {}).get("name_or_path")
        assert name in known, f"{path.name}: {name}"


def test_a_family_without_a_plan_spec_is_refused_naming_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """A registered family that describes no denoiser for the planner (``Family.plan`` None) is a `ConfigError`
    naming the family and what to register, not a crash inside the simulation."""
    from mmalign.policies import families

    monkeypatch.setattr(families, "_FAMILIES", dict(families._FAMILIES))
    families.register_family(replace(families._FAMILIES["sd3"], plan=None))
    cfg = _real("text_to_image.yaml")
    with pytest.raises(ConfigError, match="family 'sd3' .* registers no planner description"):
        plan_mod.plan(cfg, plan_mod.Hardware(plan_mod.DEVICES["h100"]))


def test_unknown_model_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.name_or_path"):
        resolve_model("nobody/no-such-model")


# ----------------------------------------------------------------------------- FLOPs
def test_train_flops_follow_the_6nd_rule() -> None:
    """The recorded FLOPs of one microbatch of Qwen2.5-0.5B (plain forward, full logits, no checkpointing)
    against the textbook count: 6 x (non-embedding parameters) per token, 6 V H per scored token for the head,
    and 4 L^2 d per layer and head for attention, 3.5 times with its backward."""
    cfg = config_from_dict(
        {
            "pipeline": "text_reasoning",
            "output_dir": "runs/unused",
            "model": {"name_or_path": QWEN, "shared_prefix": False, "logprob_chunk_size": None},
            "data": {"train": "unused.jsonl"},
            "rollout": {"group_size": 4, "prompts_per_step": 1, "max_new_tokens": 256},
            "rewards": [{"name": "format"}],
            "trainer": {"microbatch_size": 4},
        },
        "test_plan",
    )
    p = plan_mod.plan(cfg, plan_mod.Hardware(plan_mod.DEVICES["h100"]), prompt_tokens=256)
    c = load_table()["models"][QWEN]["components"]["model"]["config"]
    h, f, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    d = h // heads
    per_layer = h * h * 2 + 2 * h * kv * d + 3 * h * f  # q, o; k, v; gate, up, down
    b, length, scored = 4, 512, 256
    expected = (
        6 * layers * per_layer * b * length
        + 6 * vocab * h * b * scored
        + 3.5 * 4 * layers * heads * d * length**2 * b
    )
    assert p.train.flops == pytest.approx(expected, rel=0.10)


# ----------------------------------------------------------------------------- fixes, tiny configs, the command
def test_fixes_make_it_fit() -> None:
    """A config that does not fit in a small device gets changes, each of which fits when planned again."""
    import pipelines
    from mmalign.config import load_config

    cfg = load_config(str(REPO / "configs/text_reasoning-tiny.yaml"), [], pipeline_finder=pipelines.find)
    full = plan_mod.plan(cfg, plan_mod.Hardware(plan_mod.DEVICES["h100"]))
    small = plan_mod.replace(plan_mod.DEVICES["h100"], memory=int(full.peak * 0.6))
    hw = plan_mod.Hardware(small)
    assert not plan_mod.plan(cfg, hw).fits
    fixes = plan_mod.suggest_fixes(cfg, hw)
    assert fixes
    for fix in fixes:
        assert fix.peak <= small.memory
    assert any("microbatch" in f.description for f in fixes)


def test_parse_memory() -> None:
    assert plan_mod.parse_memory("80GiB") == 80 * 2**30
    assert plan_mod.parse_memory("80GB") == 80 * 10**9
    assert plan_mod.parse_memory("81920MiB") == 80 * 2**30
    with pytest.raises(ConfigError):
        plan_mod.parse_memory("lots")


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="mmalign")
    plan_mod.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    rc = args.func(args)
    return rc, capsys.readouterr().out


TINY = sorted(p.name for p in (REPO / "configs").glob("*-tiny.yaml"))


@pytest.mark.parametrize("name", TINY)
def test_every_tiny_config_plans(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mmalign plan configs/<x>-tiny.yaml` prints the table; a tiny config fits one H100."""
    monkeypatch.chdir(REPO)
    rc, out = _run([f"configs/{name}", "--no-fixes"], capsys)
    assert rc == 0, out
    assert "| **peak allocated by torch** |" in out and "FLOPs per step" in out
    assert "process RSS" not in out  # an H100 plan: the GPU's allocator only
    assert "**fits**" in out


def test_command_reports_a_misfit_with_fixes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipelines
    from mmalign.config import load_config

    monkeypatch.chdir(REPO)
    cfg = load_config("configs/text_reasoning-tiny.yaml", [], pipeline_finder=pipelines.find)
    peak = plan_mod.plan(cfg, plan_mod.Hardware(plan_mod.DEVICES["h100"])).peak
    rc, out = _run(["configs/text_reasoning-tiny.yaml", "--gpu-memory", str(int(peak * 0.7))], capsys)
    assert rc == 2
    assert "does NOT fit" in out and "changes that make it fit" in out


def test_real_config_plans_from_the_table(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real config plans offline from the architecture table (Qwen2.5-0.5B, GSM8K shapes) and fits an H100."""
    monkeypatch.chdir(REPO)
    rc, out = _run(["configs/text_reasoning.yaml", "--no-fixes"], capsys)
    assert rc == 0, out
    assert "(table)" in out
    assert math.isfinite(float(out.split("**fits**: peak allocated by torch ")[1].split(" ")[0]))


# ----------------------------------------------------------------------------- diffusion: checkpointing, VAE decode
def _bench() -> object:
    """`benchmarks/bench_denoiser_memory.py` (the harness: an SD3.5-medium-width transformer in the tiny SD3
    folder, one `GroupTrainer.update` measured with torch's CPU memory profiler)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_denoiser_memory", REPO / "benchmarks/bench_denoiser_memory.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sd35m_two_blocks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SD3.5-medium's transformer widths (24 x 64 heads, dual attention in the first block), 2 joint blocks,
    32 x 32 latents (256 image tokens), in the tiny three-encoder SD3 folder."""
    return _bench().build_folder(tmp_path_factory.mktemp("models") / "sd35m-2blocks", latent=32)


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointing"])
def test_cpu_diffusion_step_peak_within_15_percent(
    sd35m_two_blocks: Path, tmp_path: Path, ckpt: bool
) -> None:
    """The planner's training-step peak of a diffusion config (LoRA, CFG 4.5 with the unconditional branch
    detached, 2 of 4 samples per microbatch, one backward per trained step) against torch's CPU profiler over
    one `GroupTrainer.update`, with and without the denoiser's activation checkpointing."""
    bench = _bench()
    cfg = bench.make_config(sd35m_two_blocks, tmp_path, ckpt=ckpt, lora=True, micro=2, group=4, steps=2)
    measured = bench.measured_step_peak(cfg)
    predicted = bench.planned_step_peak(cfg)
    print(f"checkpointing={ckpt}: measured {measured / 2**20:.1f} MiB, planned {predicted / 2**20:.1f} MiB")
    assert abs(predicted / measured - 1) <= 0.15, (predicted / 2**20, measured / 2**20)


def _real(name: str, *overrides: str) -> object:
    import pipelines
    from mmalign.config import load_config

    return load_config(str(REPO / "configs" / name), list(overrides), pipeline_finder=pipelines.find)


def test_denoiser_checkpointing_lowers_the_planned_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.gradient_checkpointing`` on a diffusion config keeps less for the backward (SD3.5-medium at 512 px:
    by more than half) and adds the recomputed forward to the FLOPs."""
    monkeypatch.chdir(REPO)
    hw = plan_mod.Hardware(plan_mod.DEVICES["h100"])
    plain = plan_mod.plan(_real("text_to_image.yaml", "model.gradient_checkpointing=false"), hw)
    ckpt = plan_mod.plan(_real("text_to_image.yaml", "model.gradient_checkpointing=true"), hw)
    assert ckpt.shapes["gradient_checkpointing"] and not plain.shapes["gradient_checkpointing"]
    assert ckpt.train.memory.activations < 0.5 * plain.train.memory.activations
    assert ckpt.train.memory.weights == plain.train.memory.weights
    assert plain.train.flops < ckpt.train.flops < 2 * plain.train.flops
    assert ckpt.rollout.memory.total == plain.rollout.memory.total  # the rollout has no grad


def test_vae_decode_batch_sets_the_planned_decode() -> None:
    """``options.vae_decode_batch``: the rollout decodes that many samples at once (auto: 8 images, 1 clip;
    null: all), so the decode's temporaries scale with it."""
    spec = plan_mod.resolve_model("stabilityai/stable-diffusion-3.5-medium")
    video = plan_mod.resolve_model("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    cfg = _real("text_rendering.yaml")
    assert plan_mod.vae_decode_rows(cfg, spec, 256) == 8
    assert plan_mod.vae_decode_rows(cfg, video, 16) == 1
    assert (
        plan_mod.vae_decode_rows(_real("text_rendering.yaml", "options.vae_decode_batch=null"), spec, 256)
        == 256
    )
    assert plan_mod.vae_decode_rows(_real("text_rendering.yaml", "options.vae_decode_batch=4"), spec, 2) == 2
    hw = plan_mod.Hardware(plan_mod.DEVICES["h100"])
    at_once = plan_mod.plan(_real("text_rendering.yaml", "options.vae_decode_batch=null"), hw)
    chunked = plan_mod.plan(_real("text_rendering.yaml", "options.vae_decode_batch=1"), hw)
    assert "VAE decode of 256 of 256 samples" in at_once.rollout.where
    assert "VAE decode" not in chunked.rollout.where  # the denoiser's forward is the rollout's peak now
    assert chunked.rollout.memory.activations < at_once.rollout.memory.activations / 3
    assert chunked.rollout.flops == pytest.approx(at_once.rollout.flops)


def test_fixes_of_a_diffusion_config_include_checkpointing_and_decode_chunks() -> None:
    """A diffusion config that does not fit a small device is offered denoiser checkpointing (training) and
    smaller VAE decode chunks (rollout), each planned again under the device memory."""
    cfg = _real("safe_diffusion.yaml", "options.vae_decode_batch=null")
    full = plan_mod.plan(cfg, plan_mod.Hardware(plan_mod.DEVICES["h100"]))
    small = plan_mod.replace(plan_mod.DEVICES["h100"], memory=int(full.train.memory.total * 0.8))
    hw = plan_mod.Hardware(small)
    descriptions = [d for axis in plan_mod._axes(cfg, hw) for d, *_ in axis]
    assert "gradient checkpointing on" in descriptions
    assert any(d.startswith("options.vae_decode_batch 128 -> 64") for d in descriptions)
    fixes = plan_mod.suggest_fixes(cfg, hw)
    assert fixes and all(f.peak <= small.memory for f in fixes)


def test_diffusion_rollout_batch_is_whole_groups() -> None:
    """``rollout.batch_size`` of a diffusion config: the rollout denoises that many samples at once, rounded down to
    whole groups (at least one), as `DenoisingPolicy.rollout`; the FLOPs are those of every sample."""
    cfg = _real("text_to_image.yaml", "rollout.batch_size=40")  # group_size 16: 2 groups at a time
    assert plan_mod.rollout_chunk(cfg, 768) == 32
    assert plan_mod.rollout_chunk(_real("text_to_image.yaml", "rollout.batch_size=3"), 768) == 16
    assert plan_mod.rollout_chunk(_real("text_to_image.yaml", "rollout.batch_size=null"), 768) == 768
    assert plan_mod.rollout_chunk(cfg, 24) == 24
    hw = plan_mod.Hardware(plan_mod.DEVICES["h100"])
    whole = plan_mod.plan(_real("text_to_image.yaml", "rollout.batch_size=null"), hw)
    chunked = plan_mod.plan(cfg, hw)
    assert whole.shapes["rollout_rows"] == 1536 and chunked.shapes["rollout_rows"] == 64
    assert chunked.rollout.memory.total < whole.rollout.memory.total
    assert chunked.rollout.flops == pytest.approx(whole.rollout.flops)
    assert plan_mod._generation_batches(768, 16) == [384, 192, 96, 48, 16]


@pytest.mark.parametrize("config", ["image_edit.yaml", "image_edit-qwen.yaml"])
def test_image_edit_plans_the_source_tokens(config: str) -> None:
    """An editing denoiser attends to the source image's packed tokens too (FLUX.1 Kontext, Qwen-Image-Edit);
    Qwen-Image-Edit's prompt states also carry the source's vision tokens (512 px -> 504 px, 36 x 36 patches
    merged 2 x 2 = 324 tokens, as its Qwen2.5-VL processor resizes it)."""
    cfg = _real(config)
    spec = resolve_model(cfg.model.name_or_path)
    sh = plan_mod.diffusion_shapes(cfg, spec)
    noisy = (512 // 8 // 2) ** 2  # 512 px, VAE factor 8, 2 x 2 patches: 1024 tokens
    assert sh.reference_tokens == noisy and sh.image_tokens == 2 * noisy
    if "qwen" in config:
        assert sh.text_tokens == cfg.options.max_sequence_length + 324
    assert plan_mod.plan(cfg, plan_mod.Hardware(plan_mod.DEVICES["h100"])).fits


# ----------------------------------------------------------------------------- what a CPU process holds (RSS)
MiB = 2**20


def test_process_memory_formula() -> None:
    """Hand-worked: glibc keeps the step's heap high-water (40 MiB, at the forward/backward), so the optimizer step,
    with 120 MiB allocated but only 10 MiB of it heap, holds 120 + (40 - 10) = 150 MiB; the forward/backward
    100 + (40 - 30) = 110; the rollout 50 + (40 - 20) = 70. The run's measured overhead comes on top."""
    moments = [
        plan_mod.Moment("forward/backward", 100 * MiB, 30 * MiB, 40 * MiB),
        plan_mod.Moment("optimizer step", 120 * MiB, 10 * MiB, 10 * MiB),
        plan_mod.Moment("rollout", 50 * MiB, 20 * MiB, 20 * MiB),
    ]
    libraries, objects = plan_mod.RUN_OVERHEAD["token"]
    pm = plan_mod.process_memory(moments, 90 * MiB, "token")
    assert (pm.allocated, pm.heap_kept, pm.load) == (120 * MiB, 30 * MiB, 90 * MiB)
    assert pm.rss == 150 * MiB + libraries + objects
    # a load that converts the checkpoint (its pages mapped besides the converted weights) can be the peak
    assert plan_mod.process_memory(moments, 200 * MiB, "token").rss == 200 * MiB + libraries + objects
    # without heap blocks (every tensor 32 MiB or more, returned to the system when freed) nothing is kept
    big = [plan_mod.Moment("a", 100 * MiB, 0), plan_mod.Moment("b", 120 * MiB, 0)]
    assert plan_mod.process_memory(big, 0, "diffusion").heap_kept == 0


def test_heap_blocks_by_size() -> None:
    """Blocks under 32 MiB (glibc's largest mmap threshold) are heap blocks: counted by the recorder and, for a
    recording of one row standing for `scale` rows, by their size times `scale`."""
    from mmalign.app.plan_models import HEAP_LIMIT, heap_bytes, recording, size_bucket

    assert HEAP_LIMIT == 32 * MiB
    buckets = [0] * 64
    for n in (1 * MiB, 16 * MiB, 40 * MiB):
        buckets[size_bucket(n)] += n
    assert heap_bytes(buckets) == 17 * MiB
    assert heap_bytes(buckets, scale=2) == 2 * MiB  # 16 MiB x 2 = 32 MiB: no longer a heap block
    with recording([]) as (rec, _), rec.phase("x"):
        small = torch.empty(MiB // 4, device="meta")  # 1 MiB of float32
        other = torch.empty(MiB // 2, device="meta")  # 2 MiB: 3 MiB of heap blocks live
        del small, other
        large = torch.empty(10 * MiB, device="meta")  # 40 MiB: the peak, with no heap block live
    peak = rec.peaks["x"]
    assert (peak.total, peak.heap, peak.heap_high) == (40 * MiB, 0, 3 * MiB)
    del large


def test_load_conversion_counts_the_checkpoint_pages() -> None:
    """A checkpoint stored in float32 and loaded as bfloat16 has its 4-byte file mapped while the 2-byte weights
    are made; loaded in its own dtype (or of unknown dtype) the weights are the file's pages: nothing more."""
    from mmalign.app.plan_models import ComponentSpec

    with torch.device("meta"):
        module = torch.nn.Linear(1000, 100)  # 100,100 parameters
    stored = ComponentSpec("transformers", "X", {"dtype": "float32"}, "config.json")
    assert plan_mod._conversion_bytes(stored, module, torch.bfloat16) == 100_100 * 4
    assert plan_mod._conversion_bytes(stored, module, torch.float32) == 0
    old = ComponentSpec("transformers", "X", {"torch_dtype": "bfloat16"}, "config.json")
    assert plan_mod._conversion_bytes(old, module, torch.float32) == 100_100 * 2
    assert plan_mod._conversion_bytes(ComponentSpec("diffusers", "X", {}, "c"), module, torch.bfloat16) == 0


def test_cpu_plan_prints_what_each_number_is(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU the report says that the table is torch's allocator and adds the process RSS increase."""
    monkeypatch.chdir(REPO)
    rc, out = _run(["configs/text_reasoning-tiny.yaml", "--gpu", "cpu", "--no-fixes"], capsys)
    assert rc == 0, out
    assert "bytes per device: peak allocated by torch" in out
    assert "| **process RSS increase** |" in out and "process RSS increase" in out.split("**fits**")[1]


_RSS_SCRIPT = r"""
import gc, json, sys

def rss_kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

# the libraries a run imports (the base the planner's process RSS increase adds to)
import torch, transformers, diffusers, peft, accelerate, tokenizers, safetensors  # noqa: E401
import pipelines, rewards  # noqa: E401
import mmalign.policies.text, mmalign.policies.loading, mmalign.policies.sd3  # noqa: E401
import mmalign.policies.flow_matching, mmalign.policies.denoising  # noqa: E401
from mmalign.config import config_from_dict
from mmalign.training.trainer import GroupTrainer

torch.set_num_threads(1)
cfg = config_from_dict(json.loads(sys.argv[1]), "rss")
gc.collect()
base = rss_kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:  # the peak RSS (VmHWM) starts again from the current RSS
    f.write("5")
trainer = GroupTrainer(cfg, pipelines.get(cfg.pipeline)(cfg))
for _ in range(2):  # the second step is the steady state (AdamW's moments exist)
    trainer.train_step()
print(json.dumps({"increase": (rss_kib("VmHWM") - base) * 1024}))
"""


def measured_rss_increase(cfg: object) -> int:
    """The peak RSS increase of a fresh process that builds the trainer of `cfg` and runs two training steps, over
    the same process with the libraries imported (`_RSS_SCRIPT`): the kernel's own count of the resident pages,
    the peak (VmHWM) reset to the current RSS just before the model is loaded."""
    import json
    import os
    import subprocess
    import sys

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, json.dumps(cfg.to_dict())],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return int(json.loads(out.stdout.strip().splitlines()[-1])["increase"])


def _tiny_text_config(tmp_path: Path) -> object:
    import pipelines
    from mmalign.config import load_config
    from mmalign.tiny import ensure_model

    cfg = load_config(
        str(REPO / "configs/text_reasoning-tiny.yaml"),
        [
            f"output_dir={tmp_path / 'run'}",
            "overwrite=true",
            "trainer.progress_bar=false",
            "trainer.cpu=true",
        ],
        pipeline_finder=pipelines.find,
    )
    cfg.model.name_or_path = str(REPO / cfg.model.name_or_path)
    cfg.data.train = str(REPO / cfg.data.train)
    ensure_model(cfg.model.name_or_path, cfg.model.tiny_builder)
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["text_reasoning-tiny", "qwen05-2layers-lora"])
def test_cpu_process_rss_within_15_percent(
    setting: str, tmp_path: Path, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    """The planner's process RSS increase against a real CPU run's (`measured_rss_increase`): the quickstart
    (116k parameters: the run's library pages and objects are most of it) and Qwen2.5-0.5B's widths with 2
    layers under LoRA r 16 (the 633 MiB of weights, mapped from the checkpoint, are most of it)."""
    if setting == "text_reasoning-tiny":
        cfg = _tiny_text_config(tmp_path)
    else:
        model = request.getfixturevalue("qwen05_two_layers")
        cfg = _config(model, tmp_path / "run", lora=True, ckpt=False, micro=4, completion=32)
        cfg.trainer.steps = 2
    measured = measured_rss_increase(cfg)
    planned = plan_mod.plan(cfg, plan_mod.Hardware(plan_mod.DEVICES["cpu"]))
    predicted = planned.process.rss
    with capsys.disabled():
        print(
            f"\n{setting}: measured {measured / MiB:.1f} MiB, process RSS planned {predicted / MiB:.1f} MiB "
            f"({predicted / measured - 1:+.1%}), allocated by torch {planned.peak / MiB:.1f} MiB"
        )
    assert abs(predicted / measured - 1) <= 0.15, (predicted / MiB, measured / MiB)
