"""`mmalign plan CONFIG`: will a config fit, how long will a step take, and what to change if it does not fit.

    mmalign plan configs/text_reasoning.yaml [key.sub=value ...] [--gpus N] [--gpu h100|h200|a100|...]
        [--gpu-memory 80GiB] [--strategy ddp|fsdp2] [--offload] [--mfu 0.4] [--prompt-tokens 256]

Nothing is allocated and nothing is downloaded. The model's architecture (the model folder, the local hub cache,
or the table of public configs, `mmalign.app.plan_models`) is built on the meta device with the config's LoRA
(``model.lora``), dtype (``model.dtype``) and gradient checkpointing, and the work of one training step is run
on it the way the policy runs it (token policies: the plain or shared-prefix forward and the policy's own output
head; diffusion policies: the denoiser forwards of the trained steps kept for one backward, two branches under
classifier-free guidance), under a recorder that counts every tensor a real device would hold and the FLOPs of
every operator (`plan_models.Recorder`, with ``torch.utils.flop_counter``'s formulas). What scales with the run
(optimizer state, microbatches and processes, FSDP2 sharding and CPU offload, the KV cache of generation) is
added from the config (`StepPlan`): the peak per device of the training step and of the rollout, split into
weights, gradients, optimizer state, activations and caches; the FLOPs per step and the time at a stated
model-FLOPs utilisation; and, when the peak exceeds the device, the smallest changes that make it fit
(`suggest_fixes`). The bytes of that table are the peak allocated by torch (``torch.cuda.max_memory_allocated`` on
a GPU); for a CPU run (``--gpu cpu``) the report adds what the process holds (`ProcessMemory`, its RSS increase:
that peak, the freed heap blocks glibc keeps, the model load, the library pages and interpreter objects of a
run). docs/plan.md describes the model and what it leaves out.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mmalign.app.plan_models import (
    HEAP_LIMIT,
    ComponentSpec,
    ModelSpec,
    Recorder,
    block_param_bytes,
    buffer_bytes,
    build_meta,
    heap_bytes,
    largest_param_bytes,
    param_bytes,
    param_numel,
    recording,
    resolve_model,
)
from mmalign.config import Config, ConfigError
from mmalign.policies.families import TASKS as FAMILY_TASKS
from mmalign.policies.families import Family, PlanRequest, PlanShapes, PlanSpec, plan_family

GiB = 1024**3
DEFAULT_PROMPT_TOKENS = 256
"""Text tokens per prompt when neither ``--prompt-tokens`` nor the data and tokenizer say."""


# ----------------------------------------------------------------------------- hardware
@dataclass(frozen=True)
class Device:
    """One accelerator: usable memory, dense peak FLOP/s (bf16/fp16 tensor cores; fp32 without TF32) and
    memory bandwidth. ``kind`` is ``cuda`` (fused attention, multi-tensor AdamW) or ``cpu`` (what a CPU run of
    mmalign does: single-tensor AdamW), used to check the planner against a CPU run."""

    name: str
    memory: int
    flops_bf16: float
    flops_fp32: float
    bandwidth: float
    kind: str = "cuda"


DEVICES: dict[str, Device] = {
    # memory: what `torch.cuda.get_device_properties(i).total_memory` reports; FLOP/s: vendor data sheets
    # (dense, no sparsity); bandwidth: HBM / GDDR bytes per second.
    "h100": Device("NVIDIA H100 80GB SXM", 81559 * 2**20, 989e12, 67e12, 3.35e12),
    "h100-pcie": Device("NVIDIA H100 80GB PCIe", 81559 * 2**20, 756e12, 51e12, 2.0e12),
    "h200": Device("NVIDIA H200 141GB", 143771 * 2**20, 989e12, 67e12, 4.8e12),
    "b200": Device("NVIDIA B200 180GB", 183359 * 2**20, 2250e12, 80e12, 8.0e12),
    "a100": Device("NVIDIA A100 80GB", 81051 * 2**20, 312e12, 19.5e12, 2.04e12),
    "a100-40gb": Device("NVIDIA A100 40GB", 40370 * 2**20, 312e12, 19.5e12, 1.56e12),
    "l40s": Device("NVIDIA L40S 48GB", 45589 * 2**20, 362e12, 91.6e12, 0.864e12),
    "a10": Device("NVIDIA A10 24GB", 22731 * 2**20, 125e12, 31.2e12, 0.6e12),
    "rtx4090": Device("NVIDIA RTX 4090 24GB", 24217 * 2**20, 165e12, 82.6e12, 1.0e12),
    "cpu": Device("CPU (planner check)", 24 * GiB, 1e12, 1e12, 50e9, kind="cpu"),
}


def parse_memory(text: str) -> int:
    """Bytes of ``80GiB`` / ``80GB`` / ``80G`` / ``81920MiB`` / a plain number of bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", text, flags=re.I)
    if not m:
        raise ConfigError(f"--gpu-memory {text!r}: expected a size such as 80GiB, 80GB or 81920MiB")
    value, unit, binary = float(m.group(1)), m.group(2).upper(), bool(m.group(3))
    power = "KMGT".index(unit) + 1 if unit else 0
    return int(value * (1024 if binary or not unit else 1000) ** power)


@dataclass(frozen=True)
class Hardware:
    """Where the step runs: the device, the number of processes (one per device), the strategy (``ddp``:
    a full replica per device; ``fsdp2``: weights, gradients and optimizer state sharded over all
    processes) and FSDP2's CPU offload of parameters, gradients and optimizer state."""

    device: Device
    gpus: int = 1
    strategy: str = "ddp"
    offload: bool = False
    mfu: float = 0.4

    @property
    def shards(self) -> int:
        return self.gpus if self.strategy == "fsdp2" else 1


# ----------------------------------------------------------------------------- results
@dataclass
class Memory:
    """Bytes per device, by kind. ``activations`` holds what the forward keeps for the backward plus the
    temporaries live at the peak; ``caches`` the KV cache (generation) or the stored rollout tensors."""

    weights: int = 0
    frozen: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    caches: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.frozen + self.gradients + self.optimizer + self.activations + self.caches


@dataclass
class Moment:
    """One candidate peak of a step, for what a CPU process holds (`process_memory`): the bytes allocated by
    torch then (``total``), how many of them are in heap blocks (below `plan_models.HEAP_LIMIT`: ``heap``), and
    the most heap-block bytes live at any time of the work around it (``heap_high``, at least ``heap``)."""

    name: str
    total: int
    heap: int
    heap_high: int = 0


@dataclass
class Phase:
    """The peak of one phase (``train``: one step's forwards, backwards and optimizer step; ``rollout``:
    sampling), where in the phase it happens, the FLOPs and time of the phase, and its candidate peaks
    (`Moment`) for the process-memory estimate."""

    name: str
    memory: Memory
    where: str
    flops: float = 0.0
    seconds: float = 0.0
    moments: list[Moment] = field(default_factory=list)


@dataclass
class ProcessMemory:
    """What a one-process CPU run holds at its peak (the RSS increase over the process with its libraries
    imported), by part; `process_memory` computes it, docs/plan.md ("What a CPU process holds") derives it.

    ``allocated``: the step's peak of bytes allocated by torch (what the table shows). ``heap_kept``: freed heap
    blocks (below `plan_models.HEAP_LIMIT`) that glibc still holds at the step's worst moment: the heap keeps the
    high-water of heap blocks reached earlier in the step (small activations, small gradients), while blocks of
    `HEAP_LIMIT` and more go back to the system when freed. ``load``: the model load's peak (weights, plus the
    checkpoint's pages mapped while from_pretrained converts them to ``model.dtype``). ``libraries`` and
    ``objects``: what every run of the family adds (library pages it touches, interpreter objects: modules,
    tokenizers, data rows), measured (`RUN_OVERHEAD`)."""

    allocated: int
    heap_kept: int
    load: int
    libraries: int
    objects: int

    @property
    def step(self) -> int:
        """The training step's worst moment: torch's bytes plus the heap blocks glibc keeps then."""
        return self.allocated + self.heap_kept

    @property
    def rss(self) -> int:
        """The process's peak RSS increase: the larger of the step and the load, plus the run's overhead."""
        return max(self.step, self.load) + self.libraries + self.objects


@dataclass
class StepPlan:
    """What `plan` predicts for one config on one hardware setting."""

    config: str
    model: str
    origin: str
    hardware: Hardware
    params_total: int
    params_trainable: int
    shapes: dict[str, Any]
    train: Phase
    rollout: Phase
    notes: list[str] = field(default_factory=list)
    process: ProcessMemory | None = None
    """What the process holds (CPU, one process only); None on a GPU."""

    @property
    def peak(self) -> int:
        return max(self.train.memory.total, self.rollout.memory.total)

    @property
    def fits(self) -> bool:
        return self.peak <= self.hardware.device.memory

    @property
    def seconds(self) -> float:
        return self.train.seconds + self.rollout.seconds


# ----------------------------------------------------------------------------- the workload
def profiled_alloc_peak(fn: Any) -> int:
    """Bytes at the peak of what `fn()` allocates on the CPU beyond what was live before it: the running sum of
    torch's profiler memory events, in time order. What the planner's CPU predictions are checked against
    (tests/app/test_plan.py, benchmarks/bench_denoiser_memory.py, benchmarks/gpu_acceptance.py)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return peak


def _opt(cfg: Config, name: str, default: Any = None) -> Any:
    opts = cfg.options
    if opts is None:
        return default
    if isinstance(opts, dict):
        return opts.get(name, default)
    return getattr(opts, name, default)


@dataclass
class Batching:
    """Per-process sample counts of one training step (as `GroupTrainer._set_batching` computes them)."""

    local_prompts: int
    samples_per_group: int
    local_batch: int
    minibatch: int
    microbatch: int
    micro_per_minibatch: int
    updates_per_pass: int
    iterations: int
    shuffled: bool
    need_logp_old: bool

    @property
    def forwards_with_grad(self) -> int:
        """Microbatch forward+backward passes per step."""
        return self.iterations * math.ceil(self.local_batch / self.microbatch)


def batching(cfg: Config, gpus: int) -> Batching:
    """`Batching` of `cfg` on `gpus` processes (errors name the keys, as the trainer's would)."""
    from mmalign.algorithms import advantages

    r, t = cfg.rollout, cfg.trainer
    if r.prompts_per_step % gpus:
        raise ConfigError(
            f"{cfg.source}: key 'rollout.prompts_per_step' ({r.prompts_per_step}) must be divisible by the "
            f"number of processes ({gpus})"
        )
    local_prompts = r.prompts_per_step // gpus
    try:
        extra = advantages.extra_samples(cfg.algorithm.estimator)
    except Exception:  # an estimator from a plugin that is not importable here: no extra samples
        extra = 0
    spg = r.group_size + extra
    local = local_prompts * spg
    mini = (t.minibatch_size // gpus) if t.minibatch_size else None
    micro = t.microbatch_size or mini or local
    micro = min(micro, mini or local)
    updates = math.ceil(local / mini) if mini else 1
    size = mini or local
    shuffled = t.shuffle_minibatches and t.num_iterations * math.ceil(local / size) > 1
    need_old = t.num_iterations > 1 or updates > 1 or cfg.algorithm.filter == "replay" or r.engine != "hf"
    return Batching(
        local_prompts=local_prompts,
        samples_per_group=spg,
        local_batch=local,
        minibatch=size,
        microbatch=micro,
        micro_per_minibatch=math.ceil(size / micro),
        updates_per_pass=updates,
        iterations=t.num_iterations,
        shuffled=shuffled,
        need_logp_old=need_old,
    )


def _torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _compute_dtype(cfg: Config) -> torch.dtype:
    """The dtype activations are computed in: the weights' dtype, or the mixed-precision dtype for fp32 weights
    (autocast is modelled as half-precision activations)."""
    dtype = _torch_dtype(cfg.model.dtype)
    mp = cfg.trainer.mixed_precision
    if dtype == torch.float32 and mp in ("bf16", "fp16"):
        return torch.bfloat16 if mp == "bf16" else torch.float16
    return dtype


# ----------------------------------------------------------------------------- optimizer and sharding
@dataclass
class Static:
    """Bytes per device that do not depend on the batch: weights (trainable module, frozen parts), AdamW state,
    the optimizer step's temporaries and gradients (all sharded under FSDP2, on the host with CPU offload),
    DDP's gradient buckets, what FSDP2 gathers at once (two blocks' weights with prefetch, one block's
    gradients before the reduce-scatter), and the divisor of gradients recorded unsharded."""

    weights: int
    frozen: int
    gradients: int
    optimizer: int
    step_temp: int
    buckets: int = 0
    block: int = 0
    block_grad: int = 0
    grad_divisor: int = 1
    heap_grads: int = 0
    """Gradient bytes of the trained parameters below `plan_models.HEAP_LIMIT` (heap blocks on a CPU) ..."""
    heap_optimizer: int = 0
    """... their AdamW moments ..."""
    heap_step_temp: int = 0
    """... and the single-tensor AdamW step's temporaries while it updates the largest of them."""


def _heap_parts(model: torch.nn.Module) -> dict[str, int]:
    """`Static`'s heap fields of `model`: its trained parameters below `HEAP_LIMIT` bytes (each tensor once)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        n = p.numel() * p.element_size()
        if p.requires_grad and n < HEAP_LIMIT:
            seen[id(p)] = n
    small = sum(seen.values())
    return dict(heap_grads=small, heap_optimizer=2 * small, heap_step_temp=2 * max(seen.values(), default=0))


def _static(model: torch.nn.Module, frozen_bytes: int, hw: Hardware) -> Static:
    """`Static` of `model` (meta, trainable flags set) on `hw`. AdamW keeps two moments per trainable value in
    the parameter's dtype; its step needs one more copy of all of them (multi-tensor ``_foreach_sqrt``, CUDA)
    or two copies of the largest parameter (single-tensor, CPU)."""
    train_b = param_bytes(model, trainable=True)
    weights = param_bytes(model) + buffer_bytes(model)
    grads, opt = train_b, 2 * train_b
    step_temp = 2 * largest_param_bytes(model) if hw.device.kind == "cpu" else train_b
    n = hw.shards
    if hw.strategy == "fsdp2" and (n > 1 or hw.offload):
        block = block_param_bytes(model)
        block_grad = int(block * train_b / max(1, weights))
        if hw.offload:
            return Static(0, frozen_bytes, 0, 0, 0, 0, 2 * block, block_grad, grad_divisor=10**9)
        return Static(
            weights // n, frozen_bytes, grads // n, opt // n, step_temp // n, 0, 2 * block, block_grad, n
        )
    buckets = train_b if hw.gpus > 1 else 0
    return Static(weights, frozen_bytes, grads, opt, step_temp, buckets, **_heap_parts(model))


def _train_candidates(st: Static, peak: int, grads_at_peak: int) -> tuple[Memory, Memory]:
    """The training step's two candidate peaks: the steady-state microbatch's recorded forward/backward (``peak``
    bytes allocated, ``grads_at_peak`` of them parameter gradients, recorded unsharded) and the optimizer step."""
    grads = grads_at_peak // st.grad_divisor + st.block_grad + st.buckets
    fb = Memory(st.weights + st.block, st.frozen, grads, st.optimizer, peak - grads_at_peak)
    step = Memory(st.weights, st.frozen, st.gradients + st.buckets, st.optimizer, st.step_temp)
    return fb, step


def _train_memory(st: Static, peak: int, grads_at_peak: int) -> tuple[Memory, str]:
    """The training step's peak (`Memory`, where): the larger of `_train_candidates`."""
    fb, step = _train_candidates(st, peak, grads_at_peak)
    if step.total > fb.total:
        return step, "optimizer step (AdamW temporaries)"
    return fb, "forward/backward of a microbatch"


def _train_moments(st: Static, fb: Memory, step: Memory, fb_heap: int, fb_heap_high: int) -> list[Moment]:
    """The training step's `Moment` s: the forward/backward (`fb`, with `fb_heap` / `fb_heap_high` heap bytes of
    what was recorded) and the optimizer step (`step`: the small parameters' gradients, moments and the
    single-tensor step's temporaries are heap blocks); AdamW's moments are live in both."""
    return [
        Moment("forward/backward", fb.total, st.heap_optimizer + fb_heap, st.heap_optimizer + fb_heap_high),
        Moment("optimizer step", step.total, st.heap_grads + st.heap_optimizer + st.heap_step_temp),
    ]


def _rollout_moment(name: str, mem: Memory, st: Static) -> Moment:
    """A rollout `Moment`: its temporaries and caches taken as heap blocks (on a CPU a rollout's tensors are rarely
    32 MiB each), besides the small parameters' AdamW moments."""
    heap = st.heap_optimizer + mem.activations + mem.caches
    return Moment(name, mem.total, heap, heap)


# ----------------------------------------------------------------------------- token policies
@dataclass
class TokenShapes:
    prompt: int
    completion: int
    image_tokens: int
    patches: int
    generation_batch: int


def estimate_prompt_tokens(cfg: Config, rows: int = 256) -> int | None:
    """The longest prompt, in tokens, among the first `rows` training rows, when the data file and the model
    folder's tokenizer are both here (with the chat template and system prompt when the config uses them);
    None otherwise. Images are not counted (see `token_shapes`)."""
    from pathlib import Path

    src, folder = cfg.data.train, Path(cfg.model.name_or_path)
    if (
        not src
        or src.startswith("hf:")
        or not Path(src).is_file()
        or not (folder / "tokenizer_config.json").is_file()
    ):
        return None
    try:
        from transformers import AutoTokenizer

        from mmalign.data.rows import load_rows

        tok = AutoTokenizer.from_pretrained(str(folder))
        texts = [str(r.get("prompt", "")) for r in load_rows(src, cfg.data.prompt_template, max_rows=rows)]
    except Exception:  # unreadable rows or tokenizer: the planner falls back to --prompt-tokens
        return None
    if not texts:
        return None
    if cfg.model.use_chat_template and getattr(tok, "chat_template", None):

        def render(t: str) -> str:
            msgs = [{"role": "system", "content": cfg.model.system_prompt}] if cfg.model.system_prompt else []
            return tok.apply_chat_template(
                [*msgs, {"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
            )

        texts = [render(t) for t in texts]
    return max(len(tok(t)["input_ids"]) for t in texts)


def token_shapes(cfg: Config, spec: ModelSpec, b: Batching, prompt_tokens: int) -> TokenShapes:
    """Prompt and completion lengths of a token policy: ``prompt_tokens`` of text (plus, for a VLM, the image
    tokens of one image at ``options.max_pixels``), the completion region of the rollout loop (multi-turn: its
    cap with inserted turns)."""
    r = cfg.rollout
    completion = r.max_new_tokens
    if r.loop == "multi_turn":
        kw = r.loop_kwargs
        turns = int(kw.get("max_turns", 4))
        per_turn = int(kw.get("max_tokens_per_turn") or r.max_new_tokens)
        insert = int(kw.get("max_insert_tokens", 512))
        completion = int(kw.get("max_completion_tokens") or turns * per_turn + (turns - 1) * insert)
    image_tokens = patches = 0
    if spec.kind == "vlm":
        vis = spec.components["model"].config.get("vision_config", {})
        patch = int(vis.get("patch_size", 14))
        merge = int(vis.get("spatial_merge_size", 2))
        max_pixels = _opt(cfg, "root_max_pixels") or _opt(cfg, "max_pixels") or 12845056
        patches = max(4, int(max_pixels) // (patch * patch) // (merge * merge) * merge * merge)
        image_tokens = patches // (merge * merge)
    gen = r.batch_size or b.local_batch
    return TokenShapes(
        prompt_tokens + image_tokens, completion, image_tokens, patches, min(gen, b.local_batch)
    )


def _lora_targets_for(spec: ModelSpec, targets: list[str] | str) -> list[str] | str:
    if spec.kind == "vlm":
        from mmalign.policies.vlm import language_model_lora_targets

        return language_model_lora_targets(targets)
    return targets


def token_model(cfg: Config, spec: ModelSpec, dtype: torch.dtype) -> torch.nn.Module:
    """The policy's model on the meta device: `dtype` weights, gradient checkpointing and the LoRA adapter as
    `mmalign.policies.loading.load_token_policy` sets them; a VLM's vision tower frozen under
    ``options.freeze_vision``."""
    model = build_meta(spec.components["model"], dtype)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    lora = cfg.model.lora
    if lora.enabled:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        peft_cfg = PeftLoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=_lora_targets_for(spec, lora.target_modules),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, peft_cfg)
    elif spec.kind == "vlm" and _opt(cfg, "freeze_vision", False):
        for name, p in model.named_parameters():
            if "visual" in name:
                p.requires_grad_(False)
    model.train()
    return model


def _mask4d(b: int, q: int, k: int, device: str = "meta") -> torch.Tensor:
    """A boolean [B, 1, q, k] attention mask (rollouts are left-padded, so the model gets an explicit mask)."""
    return torch.ones((b, 1, q, k), dtype=torch.bool, device=device)


def _text_inputs(
    spec: ModelSpec, model: torch.nn.Module, b: int, length: int, dtype: torch.dtype, device: str = "meta"
) -> dict[str, Any]:
    """Forward inputs of `b` sequences of `length`: token ids, or for a VLM the merged embeddings and 3-D
    M-RoPE positions (the vision tower's output is an input here; the tower is planned separately)."""
    if spec.kind == "vlm":
        hidden = int(_text_config(spec)["hidden_size"])
        return dict(
            inputs_embeds=torch.empty((b, length, hidden), dtype=dtype, device=device),
            position_ids=torch.zeros((3, b, length), dtype=torch.long, device=device),
            attention_mask=_mask4d(b, length, length, device),
            use_cache=False,
        )
    return dict(
        input_ids=torch.zeros((b, length), dtype=torch.long, device=device),
        position_ids=torch.zeros((b, length), dtype=torch.long, device=device),
        attention_mask=_mask4d(b, length, length, device),
        use_cache=False,
    )


def _text_config(spec: ModelSpec) -> dict[str, Any]:
    cfg = spec.components["model"].config
    return {**cfg, **cfg.get("text_config", {})}


def _score(
    model: torch.nn.Module,
    spec: ModelSpec,
    sh: TokenShapes,
    b: int,
    *,
    dtype: torch.dtype,
    chunk: int | None,
    grad: bool,
    shared: bool,
    unique: int,
    temperature: float,
    cfg_model: Any = None,
    device: str = "meta",
) -> torch.Tensor:
    """The policy's log-probs of `b` completions on the meta device: `mmalign.policies.token_scoring.TokenScorer`'s
    plain or shared-prefix forward and the chunked (`mmalign.algorithms.logprobs`) or full-logits head, every completion
    token valid (the worst case). Returns Float[B, T] log-probs."""
    from mmalign.policies.token_scoring import TokenScorer

    p, t = sh.prompt, sh.completion
    ids = torch.zeros((b, t), dtype=torch.long, device=device)
    mask = torch.ones((b, t), dtype=torch.bool, device=device)
    with torch.set_grad_enabled(grad):
        if shared and spec.kind == "causal_lm":
            prefix = dict(
                input_ids=torch.zeros((unique, p), dtype=torch.long, device=device),
                attention_mask=_mask4d(unique, p, p, device),
                position_ids=torch.zeros((unique, p), dtype=torch.long, device=device),
            )
            completion = dict(
                input_ids=ids,
                attention_mask=_mask4d(b, t, p + t, device),
                position_ids=torch.zeros((b, t), dtype=torch.long, device=device),
            )
            inverse = torch.zeros(b, dtype=torch.long, device=device)
            features = TokenScorer.shared_prefix_features(
                model, prefix, completion, inverse, hidden=chunk is not None, grad=grad
            )
        else:
            inputs = _text_inputs(spec, model, b, p + t, dtype, device)
            features = TokenScorer.plain_features(model, inputs, t, hidden=chunk is not None, grad=grad)
        logp, _entropy = TokenScorer.score_features(
            model,
            features,
            ids,
            mask,
            scoring_options(cfg_model, temperature, chunk, shared),
            chunked=chunk is not None,
            with_entropy=grad,
        )
    return logp


def scoring_options(model_cfg: Any, temperature: float, chunk: Any, shared: bool) -> Any:
    """The policy's `ScoringOptions` for ``model.*`` (only the fields the installed scorer has)."""
    import dataclasses

    from mmalign.policies.token_scoring import ScoringOptions

    values = dict(
        temperature=temperature,
        chunk_size=chunk,
        shared_prefix=shared,
        memory_mb=getattr(model_cfg, "logprob_memory_mb", None),
    )
    names = {f.name for f in dataclasses.fields(ScoringOptions)}
    return ScoringOptions(**{k: v for k, v in values.items() if k in names and v is not None})


def _flops(rec: Recorder, attn: Any) -> float:
    """FLOPs of a recorded run: the recorder's operators plus the attention stand-in's."""
    return float(rec.flops + attn.forward_flops + attn.backward_flops)


def _vision_bytes(
    spec: ModelSpec, patches: int, images: int, dtype: torch.dtype, *, grad: bool
) -> tuple[int, float]:
    """(bytes, FLOPs) of the vision tower on `images` images of `patches` patches each: frozen, the no-grad
    forward's largest block temporaries; trained, every block's saved activations (estimated per patch as
    for a decoder layer: 6 hidden + 4 MLP values). FLOPs: 2 per parameter per patch (times 3 with grad)."""
    vis = spec.components["model"].config.get("vision_config", {})
    h, f, depth = (
        int(vis.get("embed_dim") or vis.get("hidden_size", 1280)),
        int(
            vis.get("intermediate_size")
            or int(vis.get("embed_dim") or vis.get("hidden_size", 1280)) * vis.get("mlp_ratio", 4)
        ),
        int(vis.get("depth", 32)),
    )
    s = torch.finfo(dtype).bits // 8
    n = patches * images
    per_block = n * (6 * h + 4 * f) * s
    params = depth * (4 * h * h + 3 * h * f)
    flops = 2.0 * params * n * (3 if grad else 1)
    return (per_block * depth if grad else n * (3 * h + 3 * f) * s), flops


@dataclass
class _TokenRun:
    """What the three phases of a token plan share: the config, the model on the meta device and its shapes."""

    cfg: Config
    spec: ModelSpec
    model: torch.nn.Module
    b: Any
    sh: Any
    dtype: torch.dtype
    chunk: Any
    shared: bool

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    def score(self, batch: int, *, grad: bool, unique: int) -> torch.Tensor:
        return _score(
            self.model,
            self.spec,
            self.sh,
            batch,
            dtype=self.dtype,
            chunk=self.chunk,
            grad=grad,
            shared=self.shared,
            unique=unique,
            temperature=self.cfg.rollout.temperature,
            cfg_model=self.cfg.model,
        )


def plan_token(
    cfg: Config, spec: ModelSpec, hw: Hardware, prompt_tokens: int
) -> tuple[Phase, Phase, dict[str, Any], int, int, list[str], int]:
    """The training and rollout phases of a text or VLM policy (and the load's `_conversion_bytes`)."""
    notes: list[str] = []
    b = batching(cfg, hw.gpus)
    sh = token_shapes(cfg, spec, b, prompt_tokens)
    dtype = _torch_dtype(cfg.model.dtype)
    lora = cfg.model.lora
    model = _memo(
        (
            "token_model",
            cfg.model.name_or_path,
            spec.origin,
            str(dtype),
            cfg.model.gradient_checkpointing,
            (lora.enabled, lora.r, lora.alpha, str(lora.target_modules)),
            bool(_opt(cfg, "freeze_vision", False)),
        ),
        lambda: token_model(cfg, spec, dtype),
    )
    chunk = cfg.model.logprob_chunk_size
    if hw.strategy == "fsdp2" and hw.gpus > 1 and chunk:
        chunk = None
        notes.append("FSDP2: the chunked log-prob head is off (full [B, T, V] logits), as the policies do")
    shared = cfg.model.shared_prefix and not cfg.model.gradient_checkpointing
    run = _TokenRun(cfg, spec, model, b, sh, dtype, chunk, shared)

    frozen = 0
    if cfg.algorithm.kl_coef > 0 and not cfg.model.lora.enabled:
        frozen += param_bytes(model)
        notes.append("algorithm.kl_coef > 0 without LoRA: a frozen reference copy of the model is kept")
    st = _static(model, frozen, hw)
    train_mem, where, train_moments, train_flops_micro = _token_train(run, st)
    nograd_peak, nograd_flops = _token_scoring(run)
    roll_mem, roll_where, roll_moments, gen_flops, t_gen = _token_rollout(run, st, hw, nograd_peak)
    notes.append(
        "rollout time: the larger of FLOPs at the MFU and one read of the weights and the KV cache per "
        "generated token (decoding is bandwidth-bound)"
    )
    train_flops = train_flops_micro * b.forwards_with_grad + nograd_flops
    s = torch.finfo(dtype).bits // 8
    t_train = train_flops / (hw.mfu * (hw.device.flops_bf16 if s == 2 else hw.device.flops_fp32))
    shapes = dict(
        prompt_tokens=sh.prompt,
        image_tokens=sh.image_tokens,
        completion_tokens=sh.completion,
        microbatch=b.microbatch,
        microbatches_per_step=b.forwards_with_grad,
        generation_batch=sh.generation_batch,
        logprob_head=f"chunked ({chunk} tokens)" if chunk else "full logits",
        shared_prefix=shared,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
    )
    train = Phase("train", train_mem, where, train_flops, t_train, train_moments)
    roll = Phase("rollout", roll_mem, roll_where, gen_flops, t_gen, roll_moments)
    converted = _conversion_bytes(spec.components["model"], model, dtype)
    trainable = param_numel(model, trainable=True)
    return train, roll, shapes, param_numel(model), trainable, notes, converted


def _token_train(run: _TokenRun, st: Static) -> tuple[Memory, str, Any, float]:
    """The train step of a token plan: microbatches' forward + backward on the meta device, recorded; the second
    (when a minibatch has more than one) starts with the first one's gradients in place (the steady state).
    Returns (memory, where, moments, FLOPs of one microbatch)."""
    cfg, spec, b, sh, dtype = run.cfg, run.spec, run.b, run.sh, run.dtype
    mb = b.microbatch
    unique = (
        mb
        if b.shuffled
        else min(mb, math.ceil(mb / b.samples_per_group) + (1 if mb % b.samples_per_group else 0))
    )
    params = run.params
    trainable = [p for p in params if p.requires_grad]
    n_sim = 2 if b.micro_per_minibatch > 1 else 1
    with recording(params) as (rec, attn):
        rec.watch_grads(trainable)
        for i in range(n_sim):
            with rec.phase(f"micro{i + 1}"):
                logp = run.score(mb, grad=True, unique=unique)
                logp.sum().backward()
                del logp
        train_flops_micro = _flops(rec, attn) / n_sim
    peak = rec.peaks[f"micro{n_sim}"]
    for p in trainable:
        p.grad = None
    total, grads_at_peak = peak.total, peak.grads
    if spec.kind == "vlm":
        vlm_train_vision = not cfg.model.lora.enabled and not _opt(cfg, "freeze_vision", False)
        vb, vf = _vision_bytes(spec, sh.patches, mb, dtype, grad=vlm_train_vision)
        embeds = (
            mb
            * (sh.prompt + sh.completion)
            * int(_text_config(spec)["hidden_size"])
            * (torch.finfo(dtype).bits // 8)
        )
        total += vb + embeds
        train_flops_micro += vf
    train_mem, where = _train_memory(st, total, grads_at_peak)
    vision = total - peak.total  # a VLM's vision tower and merged embeddings: taken as heap blocks
    train_moments = _train_moments(
        st, *_train_candidates(st, total, grads_at_peak), peak.heap + vision, peak.heap_high + vision
    )
    return train_mem, where, train_moments, train_flops_micro


def _token_scoring(run: _TokenRun) -> tuple[int, float]:
    """(peak bytes, FLOPs) of the no-grad scoring of the whole local batch (``logp_old``, the reference
    log-probs); (0, 0) when the config needs neither."""
    cfg, b, sh = run.cfg, run.b, run.sh
    if not (b.need_logp_old or cfg.algorithm.kl_coef > 0):
        return 0, 0.0

    def score_all() -> tuple[int, float]:
        with recording(run.params) as (rec2, attn2):
            with rec2.phase("score"):
                run.score(b.local_batch, grad=False, unique=b.local_prompts)
            return rec2.peaks["score"].total, _flops(rec2, attn2)

    temp = cfg.rollout.temperature
    key = (
        id(run.model),
        "score",
        b.local_batch,
        sh.prompt,
        sh.completion,
        run.chunk,
        run.shared,
        b.local_prompts,
        temp,
    )
    nograd_peak, nograd_flops = _memo(key, score_all)
    passes = int(b.need_logp_old) + int(cfg.algorithm.kl_coef > 0)
    return nograd_peak, nograd_flops * passes


def _token_rollout(
    run: _TokenRun, st: Static, hw: Hardware, nograd_peak: int
) -> tuple[Memory, str, Any, float, float]:
    """The rollout of a token plan: the KV cache of the generation batch at full length plus the prefill's
    temporaries, against the no-grad scoring's peak. Returns (memory, where, moments, FLOPs, seconds)."""
    cfg, spec, b, sh, dtype, model = run.cfg, run.spec, run.b, run.sh, run.dtype, run.model
    tc = _text_config(spec)
    layers = int(tc["num_hidden_layers"])
    heads = int(tc["num_attention_heads"])
    kv_heads = int(tc.get("num_key_value_heads") or heads)
    head_dim = int(tc.get("head_dim") or int(tc["hidden_size"]) // heads)
    vocab = int(tc["vocab_size"])
    s = torch.finfo(dtype).bits // 8
    g = sh.generation_batch
    kv = 2 * layers * kv_heads * head_dim * s * g * (sh.prompt + sh.completion)
    kv_grow = 2 * kv_heads * head_dim * s * g * (sh.prompt + sh.completion)  # one layer's copy while it grows
    sample = g * vocab * 4 * (4 if cfg.rollout.top_p < 1.0 or cfg.rollout.top_k else 2)
    prefill_batch = min(g, math.ceil(g / b.samples_per_group) + 1)

    def prefill() -> tuple[int, float]:
        with recording(run.params) as (rec3, attn3):
            with rec3.phase("prefill"), torch.no_grad():
                model(**_text_inputs(spec, model, prefill_batch, sh.prompt, dtype), logits_to_keep=1)
            return rec3.peaks["prefill"].total, _flops(rec3, attn3)

    prefill_peak, prefill_flops = _memo((id(model), "prefill", prefill_batch, sh.prompt), prefill)
    rollout_weights = st.weights + (st.block if hw.shards > 1 else 0)
    if hw.offload:
        rollout_weights = st.block
    vis_roll = (
        _vision_bytes(spec, sh.patches, prefill_batch, dtype, grad=False) if spec.kind == "vlm" else (0, 0.0)
    )
    gen_mem = Memory(rollout_weights, st.frozen, 0, st.optimizer, sample + kv_grow + vis_roll[0], kv)
    prefill_mem = Memory(rollout_weights, st.frozen, 0, st.optimizer, prefill_peak + vis_roll[0], 0)
    score_mem = Memory(rollout_weights, st.frozen, 0, st.optimizer, nograd_peak, 0)
    candidates = [(gen_mem, "generation (KV cache at full length)"), (prefill_mem, "prefill")]
    if nograd_peak:
        candidates.append((score_mem, f"log-probs of the {b.local_batch} rollout samples (no grad)"))
    roll_mem, roll_where = max(candidates, key=lambda x: x[0].total)
    roll_moments = [_rollout_moment(w, m, st) for m, w in candidates]

    # FLOPs and time: decoding is bandwidth-bound
    non_embed = param_numel(model) - vocab * int(tc["hidden_size"]) * (
        1 if tc.get("tie_word_embeddings") else 2
    )
    ctx = sh.prompt + sh.completion / 2
    decode_flops = (
        g
        * sh.completion
        * (2 * non_embed + 2 * vocab * int(tc["hidden_size"]) + 4 * layers * heads * head_dim * ctx)
    )
    n_gen_batches = math.ceil(b.local_batch / g)
    gen_flops = n_gen_batches * (prefill_flops * math.ceil(g / prefill_batch) + decode_flops) + (
        vis_roll[1] * b.local_prompts / max(1, prefill_batch)
    )
    peak_flops = hw.device.flops_bf16 if s == 2 else hw.device.flops_fp32
    decode_bytes = n_gen_batches * sh.completion * (param_bytes(model) + kv / 2)
    t_gen = max(gen_flops / (hw.mfu * peak_flops), decode_bytes / hw.device.bandwidth)
    return roll_mem, roll_where, roll_moments, gen_flops, t_gen


# ----------------------------------------------------------------------------- diffusion policies
@dataclass
class DiffusionShapes:
    """One sample of a diffusion config as planned: the family's `PlanShapes` (`sample`, its fields copied) plus
    the denoising steps, the trained steps and the CFG branches of training and rollout."""

    latent: tuple[int, ...]
    text_tokens: int
    image_tokens: int
    trained_steps: int
    num_steps: int
    train_branches: int
    rollout_branches: int
    pixels: tuple[int, ...]
    reference_tokens: int = 0
    """Packed tokens of a reference image the denoiser attends to besides the latents (FLUX.1 Kontext's source)."""
    sample: PlanShapes | None = None
    """One sample as the family's `PlanSpec` describes it (what its ``inputs`` take)."""


@dataclass(frozen=True)
class Denoiser:
    """The family `mmalign plan` simulates a diffusion model as (`families.plan_family`): its `PlanSpec`, the
    ``all-linear`` LoRA targets and whether CFG runs two branches (the policy class's ``lora_targets`` and
    ``two_branch_cfg``)."""

    family: Family
    plan: PlanSpec
    lora_targets: tuple[str, ...]
    two_branch_cfg: bool


def denoiser_family(cfg: Config, spec: ModelSpec) -> Denoiser:
    """The `Denoiser` of a diffusion config: its model's family for the pipeline's task (``text_to_image`` and
    ``image_edit`` pipelines are tasks of their own name; any other pipeline: the family that names the
    denoiser class)."""
    cls = spec.components[spec.denoiser].cls
    task = cfg.pipeline if cfg.pipeline in FAMILY_TASKS else None
    family = plan_family(cfg.model.name_or_path, cls, task)
    plan_spec = family.plan_spec()
    policy = family.policy_class()
    targets = getattr(policy, "lora_targets", None) or plan_spec.lora_targets or ()
    return Denoiser(family, plan_spec, tuple(targets), bool(getattr(policy, "two_branch_cfg", True)))


class _Options(Mapping[str, Any]):
    """The config's ``options`` section (a mapping or the pipeline's typed options) as a read-only mapping."""

    _MISSING = object()

    def __init__(self, cfg: Config) -> None:
        self._cfg = cfg

    def __getitem__(self, name: str) -> Any:
        value = _opt(self._cfg, name, self._MISSING)
        if value is self._MISSING:
            raise KeyError(name)
        return value

    def __iter__(self) -> Iterator[str]:
        opts = self._cfg.options
        return iter(opts if isinstance(opts, dict) else (vars(opts) if opts is not None else {}))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def plan_request(cfg: Config, spec: ModelSpec, task: str) -> PlanRequest:
    """What a `PlanSpec` is asked with: the config's options and the component configs of `spec`."""
    components = {name: comp.config for name, comp in spec.components.items()}
    return PlanRequest(_Options(cfg), components, spec.denoiser, task)


def diffusion_shapes(cfg: Config, spec: ModelSpec) -> DiffusionShapes:
    """Latent shape of one sample, tokens (the family's `PlanSpec.shapes`), trained steps per sample and CFG
    branches of a diffusion config."""
    den = denoiser_family(cfg, spec)
    sample = den.plan.shapes(plan_request(cfg, spec, den.family.task))
    num_steps = int(_opt(cfg, "num_steps", 10))
    # the two-branch CFG scale, as `FlowMatchingPolicy._cfg_scale`: a family whose guidance_scale is a distilled
    # guidance input (FLUX.1) runs two branches only for true CFG (``true_cfg_scale`` > 1)
    guidance = float(_opt(cfg, "guidance_scale" if den.two_branch_cfg else "true_cfg_scale", 1.0))
    window = _opt(cfg, "window_size")
    n_trainable = num_steps - (1 if _opt(cfg, "sde_kind", "flow_sde") == "cps" else 0)
    trained = (
        int(window) if window else max(1, math.ceil(float(_opt(cfg, "train_fraction", 1.0)) * n_trainable))
    )
    two = guidance > 1.0
    train_two = two and bool(_opt(cfg, "train_guidance", True))
    return DiffusionShapes(
        sample.latent,
        sample.text_tokens,
        sample.image_tokens,
        trained,
        num_steps,
        2 if train_two else 1,
        2 if two else 1,
        sample.pixels,
        sample.reference_tokens,
        sample,
    )


def steps_kept_per_backward(cfg: Config, steps: int) -> int:
    """Trained steps whose graphs are alive at once: ``options.steps_per_backward`` (one backward per chunk of
    that many steps, `DenoisingPolicy.action_chunks`) unless the loss couples a sample's actions (then, as
    without the option, all of them)."""
    per = _opt(cfg, "steps_per_backward")
    if per is None:
        return steps
    try:
        from mmalign.algorithms.losses import couples_actions

        if couples_actions(cfg.algorithm.loss):
            return steps
    except (ImportError, KeyError):
        pass
    return max(1, min(steps, int(per)))


def diffusion_model(cfg: Config, spec: ModelSpec, dtype: torch.dtype) -> torch.nn.Module:
    """The denoiser on the meta device with the config's LoRA (`mmalign.policies.denoising.add_lora`)."""
    from mmalign.policies.denoising import add_lora

    model = build_meta(spec.components[spec.denoiser], dtype)
    if not add_lora(model, cfg.model.lora, denoiser_family(cfg, spec).lora_targets):
        model.requires_grad_(True)
    if cfg.model.gradient_checkpointing and getattr(model, "_supports_gradient_checkpointing", False):
        model.enable_gradient_checkpointing()  # as `DenoisingPolicy.set_gradient_checkpointing`
    model.train()
    return model


def rollout_chunk(cfg: Config, local_batch: int) -> int:
    """Samples a diffusion rollout denoises at once: ``rollout.batch_size`` rounded down to whole groups (at
    least one), as `mmalign.policies.denoising.DenoisingPolicy.rollout`; null: all local samples."""
    k = cfg.rollout.batch_size
    if k is None or local_batch <= k:
        return local_batch
    g = cfg.rollout.group_size
    return min(local_batch, max(1, k // g) * g)


def vae_decode_rows(cfg: Config, spec: ModelSpec, local_batch: int) -> int:
    """Samples the VAE decodes at once in the rollout (``options.vae_decode_batch``, as
    `mmalign.policies.denoising.DenoisingPolicy.decode_chunk`: ``auto`` is 1 video clip or 8 images; null: all
    local samples)."""
    from mmalign.policies.denoising import AUTO_DECODE_IMAGES, AUTO_DECODE_VIDEOS

    k = _opt(cfg, "vae_decode_batch", "auto")
    if k == "auto":
        k = AUTO_DECODE_VIDEOS if denoiser_family(cfg, spec).plan.video else AUTO_DECODE_IMAGES
    return local_batch if k is None else max(1, min(int(k), local_batch))


def _frozen_components(
    cfg: Config, spec: ModelSpec, dtype: torch.dtype
) -> tuple[int, torch.nn.Module | None, int]:
    """Bytes of the frozen components (text encoders, VAE; SD3's T5 only with ``options.load_t5``), the VAE
    on the meta device, and the largest `_conversion_bytes` among them. A VAE loads in fp32 where the family
    says so (`PlanSpec.vae_fp32`: Wan, Qwen-Image), as its component loader does."""
    total, vae, converted = 0, None, 0
    vae_fp32 = denoiser_family(cfg, spec).plan.vae_fp32
    for name, comp in spec.components.items():
        if name == spec.denoiser or name in ("scheduler", "tokenizer", "geometry"):
            continue
        if name == "text_encoder_3" and not _opt(cfg, "load_t5", True):
            continue
        fp32 = name == "vae" and vae_fp32
        try:
            module = build_meta(comp, torch.float32 if fp32 else dtype)
        except Exception:  # an auxiliary folder that is not a model class we can build: not counted
            continue
        total += param_bytes(module) + buffer_bytes(module)
        converted = max(converted, _conversion_bytes(comp, module, torch.float32 if fp32 else dtype))
        if name == "vae":
            vae = module
    return total, vae, converted


def _vae_decode_bytes(vae: torch.nn.Module | None, latent: tuple[int, ...]) -> tuple[int, float]:
    """(peak bytes, FLOPs) of decoding one sample's VAE `latent` (no grad), recorded on the meta device; 0 when
    the VAE cannot be run there."""
    if vae is None:
        return 0, 0.0
    dt = next(vae.parameters()).dtype
    try:
        with recording(list(vae.parameters())) as (rec, attn), torch.no_grad(), rec.phase("vae"):
            z = torch.empty((1, *latent), dtype=dt, device="meta")
            vae.decode(z, return_dict=False)
        return rec.peaks["vae"].total, _flops(rec, attn)
    except Exception:
        return 0, 0.0


_MEMO: dict[tuple, Any] = {}
"""Results of the meta-device runs, by what they depend on: the fix search plans many variants of one config,
most of which change only what is added from the config (microbatch, devices, strategy)."""


def _memo(key: tuple, make: Any) -> Any:
    if key not in _MEMO:
        _MEMO[key] = make()
    return _MEMO[key]


def denoiser_pass(
    model: torch.nn.Module,
    config: Mapping[str, Any],
    den: Denoiser,
    sample: PlanShapes,
    batch: int,
    dtype: torch.dtype,
    *,
    grad: bool,
    steps: int,
) -> tuple[Recorder, float, list[int]]:
    """Record `steps` forwards of the meta denoiser `model` (`config`: its config.json values) on `batch` rows of
    `sample` (inputs: the family's `PlanSpec.inputs`) kept for one backward (with `grad`), then the backward;
    returns (recorder, FLOPs, bytes live after each forward)."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    with recording(params, known_values=den.plan.meta_values) as (rec, attn):
        rec.watch_grads(trainable)
        with rec.phase("train"), torch.set_grad_enabled(grad):
            outs, kept = [], []
            for _ in range(steps):
                out = model(**den.plan.inputs(config, sample, batch, dtype))[0]
                if isinstance(out, list):  # per-sample outputs (Z-Image)
                    out = torch.stack(out)
                outs.append(out.float().mean())
                kept.append(rec.current)
            if grad:
                torch.stack(outs).sum().backward()
        flops = _flops(rec, attn)
    for p in trainable:
        p.grad = None
    return rec, flops, kept


def plan_diffusion(
    cfg: Config, spec: ModelSpec, hw: Hardware
) -> tuple[Phase, Phase, dict[str, Any], int, int, list[str], int]:
    """The training and rollout phases of a diffusion policy: every trained step of every sample of a
    microbatch keeps its denoiser activations until the microbatch's one backward
    (`mmalign.policies.denoising.DenoisingPolicy._score`); the rollout runs all local samples at once."""
    notes: list[str] = []
    b = batching(cfg, hw.gpus)
    den = denoiser_family(cfg, spec)
    den_config = spec.components[spec.denoiser].config
    sh = diffusion_shapes(cfg, spec)
    dtype = _torch_dtype(cfg.model.dtype)
    cdtype = _compute_dtype(cfg)
    lora = cfg.model.lora
    lora_key = (lora.enabled, lora.r, lora.alpha, str(lora.target_modules)) if lora.enabled else (False,)
    base_key = (cfg.model.name_or_path, spec.origin, lora_key, bool(cfg.model.gradient_checkpointing))
    model = _memo(("model", *base_key, str(dtype)), lambda: diffusion_model(cfg, spec, dtype))
    frozen, vae, converted = _memo(
        ("frozen", cfg.model.name_or_path, str(dtype), bool(_opt(cfg, "load_t5", True))),
        lambda: _frozen_components(cfg, spec, dtype),
    )
    notes.append("frozen text encoders and VAE are counted on the device")
    ref_copy = cfg.algorithm.kl_coef > 0 and not cfg.model.lora.enabled
    if ref_copy:
        frozen += param_bytes(model)
        notes.append("algorithm.kl_coef > 0 without LoRA: a frozen reference copy of the denoiser is kept")
    st = _static(model, frozen, hw)
    sim = (
        model
        if cdtype == dtype
        else _memo(("model", *base_key, str(cdtype)), lambda: diffusion_model(cfg, spec, cdtype))
    )
    if cdtype != dtype:
        notes.append(
            f"model.dtype float32 with trainer.mixed_precision {cfg.trainer.mixed_precision}: activations modelled "
            f"in {str(cdtype).removeprefix('torch.')} plus half-precision copies of the matmul weights"
        )
    mb = b.microbatch
    # two-branch CFG with ``detach_uncond`` (the default): the unconditional branch runs without a graph, so the
    # backward keeps one branch per sample (`FlowMatchingPolicy.predict`, `DDIMPolicy.predict`)
    detach = sh.train_branches == 2 and bool(_opt(cfg, "detach_uncond", True))
    rows = mb * (1 if detach else sh.train_branches)
    # two trained steps of one row, kept for one backward: what one more step keeps is the difference
    shape_key = (*base_key, str(cdtype), sh.latent, sh.text_tokens, sh.reference_tokens, cfg.pipeline)
    rec, f2, kept = _memo(
        ("train", *shape_key),
        lambda: denoiser_pass(sim, den_config, den, sh.sample, 1, cdtype, grad=True, steps=2),
    )
    per_step = kept[1] - kept[0]
    peak = rec.peaks["train"]
    row_peak = peak.total - peak.grads  # one row, two steps, at the peak of the backward
    steps = sh.trained_steps
    kept_steps = steps_kept_per_backward(cfg, steps)
    act = rows * (row_peak + (kept_steps - 2) * per_step)
    if cdtype != dtype:  # autocast's half-precision copies of the weights, kept for the backward
        act += sum(
            m.weight.numel() * 2 for m in model.modules() if isinstance(m, torch.nn.Linear | torch.nn.Conv2d)
        )
    grads = peak.grads if b.micro_per_minibatch == 1 else param_bytes(model, trainable=True)
    train_mem, where = _train_memory(st, act + grads, grads)
    where += f"; {kept_steps} of {steps} trained step(s) x {rows} rows kept for one backward"
    # heap blocks of the activations: the recorded row's blocks, each `rows` times larger in the batched run
    share = heap_bytes(peak.buckets, rows) / (rows * peak.total) if peak.total else 1.0
    fb_heap = int(act * share) + min(grads, st.heap_grads)
    train_moments = _train_moments(st, *_train_candidates(st, act + grads, grads), fb_heap, fb_heap)
    f1 = f2 / 2
    train_flops = f1 * rows * steps * b.forwards_with_grad
    # rollout: the local samples in chunks of whole groups (rollout.batch_size), every denoising step, no grad
    chunk = rollout_chunk(cfg, b.local_batch)
    roll_rows = chunk * sh.rollout_branches
    rec_r, f_r, _ = _memo(
        ("rollout", *shape_key),
        lambda: denoiser_pass(sim, den_config, den, sh.sample, 1, cdtype, grad=False, steps=1),
    )
    if detach:  # the unconditional branch's forward without grad
        train_flops += f_r * mb * steps * b.forwards_with_grad
    if cfg.algorithm.kl_coef > 0:  # the reference forward of each trained step (no grad, both CFG branches)
        train_flops += f_r * mb * sh.train_branches * steps * b.forwards_with_grad
    fwd_row = rec_r.peaks["train"].total
    latent_bytes = math.prod(sh.latent) * 4
    stored = b.local_batch * latent_bytes * (2 * sh.trained_steps + 2)
    vae_latent = den.plan.vae_latent(sh.sample) if den.plan.vae_latent else sh.latent
    vae_peak, vae_flops = _memo(
        ("vae", cfg.model.name_or_path, vae_latent), lambda: _vae_decode_bytes(vae, vae_latent)
    )
    decode_rows = vae_decode_rows(cfg, spec, b.local_batch)
    rollout_weights = st.weights + (st.block if hw.shards > 1 else 0)
    if hw.offload:
        rollout_weights = st.block
    denoise = Memory(rollout_weights, st.frozen, 0, st.optimizer, roll_rows * fwd_row, stored)
    decode = Memory(rollout_weights, st.frozen, 0, st.optimizer, decode_rows * vae_peak, stored)
    roll_mem, roll_where = max(
        [
            (
                denoise,
                f"denoiser forward on {roll_rows} rows ({'all' if chunk == b.local_batch else chunk} of "
                f"{b.local_batch} local samples{' x 2 CFG branches' if sh.rollout_branches == 2 else ''})",
            ),
            (decode, f"VAE decode of {decode_rows} of {b.local_batch} samples at once"),
        ],
        key=lambda x: x[0].total,
    )
    roll_moments = [
        _rollout_moment("denoiser forward", denoise, st),
        _rollout_moment("VAE decode", decode, st),
    ]
    roll_flops = f_r * b.local_batch * sh.rollout_branches * sh.num_steps + vae_flops * b.local_batch
    s = torch.finfo(cdtype).bits // 8
    peak_flops = hw.device.flops_bf16 if s == 2 else hw.device.flops_fp32
    t_train = train_flops / (hw.mfu * peak_flops)
    t_roll = roll_flops / (hw.mfu * peak_flops)
    shapes = dict(
        latent=sh.latent,
        image_tokens=sh.image_tokens,
        text_tokens=sh.text_tokens,
        denoising_steps=sh.num_steps,
        trained_steps=sh.trained_steps,
        steps_per_backward=kept_steps,
        cfg_branches_train=sh.train_branches,
        cfg_branches_kept=rows // mb,
        microbatch=mb,
        microbatches_per_step=b.forwards_with_grad,
        rollout_rows=roll_rows,
        rollout_batch=chunk,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        vae_decode_batch=decode_rows,
    )
    train = Phase("train", train_mem, where, train_flops, t_train, train_moments)
    roll = Phase("rollout", roll_mem, roll_where, roll_flops, t_roll, roll_moments)
    converted = max(converted, _conversion_bytes(spec.components[spec.denoiser], model, dtype))
    return train, roll, shapes, param_numel(model), param_numel(model, trainable=True), notes, converted


# ----------------------------------------------------------------------------- what a CPU process holds
MiB = 2**20
RUN_OVERHEAD: dict[str, tuple[int, int]] = {
    # (library pages, interpreter objects) a run adds over the process with its libraries imported, measured on
    # the tiny configs (torch 2.14.1 CPU, transformers 5.25, diffusers 0.42, glibc 2.36; docs/plan.md, "What a
    # CPU process holds"): library pages = the growth of RssFile (file-backed pages: the code and data of the
    # libraries' functions the run calls for the first time) less the model files still mapped; interpreter
    # objects = the growth of RssAnon while the trainer is built, less the weights (modules, tokenizers, data
    # rows, the reward's state). Text: the same on the four text settings measured (25.7-26.2 MiB of pages,
    # 2.5-5.6 MiB of objects); VLM (vlm_reasoning-tiny: the image processor's and the vision tower's code too):
    # 35.3 and 4.0 MiB; diffusion (text_to_image-tiny): 40.5 and 38.1 MiB.
    "token": (26 * MiB, 4 * MiB),
    "vlm": (35 * MiB, 4 * MiB),
    "diffusion": (40 * MiB, 38 * MiB),
}
"""Per policy family: (library pages, interpreter objects) a CPU run holds besides its tensors."""
LIBRARIES_IMPORTED = 796 * MiB
"""RSS of a Python process once torch, transformers, diffusers, peft, accelerate and mmalign's trainer, pipelines,
rewards and policies are imported (measured as `RUN_OVERHEAD`): the base the process RSS increase adds to."""


def _checkpoint_dtype(comp: ComponentSpec) -> torch.dtype | None:
    """The dtype `comp`'s weights are stored in, as its config.json says (transformers writes ``dtype``, older
    releases ``torch_dtype``; diffusers writes neither): None when it does not say."""
    name = comp.config.get("dtype") or comp.config.get("torch_dtype")
    return _DTYPES.get(name) if isinstance(name, str) else None


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _conversion_bytes(comp: ComponentSpec, module: torch.nn.Module, loaded: torch.dtype) -> int:
    """Bytes of `comp`'s checkpoint that ``from_pretrained`` has mapped while it converts the weights to
    `loaded` (`module`: the component on the meta device; LoRA parameters are not in the checkpoint): the
    whole file when the stored dtype differs, else 0 (the weights are then the file's pages themselves,
    already counted as weights). 0 when the stored dtype is unknown."""
    stored = _checkpoint_dtype(comp)
    if stored is None or stored == loaded:
        return 0
    numel = sum(p.numel() for n, p in module.named_parameters() if "lora_" not in n)
    return numel * torch.finfo(stored).bits // 8


def process_memory(moments: list[Moment], load: int, family: str) -> ProcessMemory:
    """`ProcessMemory` of a one-process CPU run from the candidate peaks of its step (`moments`), the model
    load's peak (`load`: weights, frozen parts and `_conversion_bytes`) and its family (``token``, ``vlm`` or
    ``diffusion``, for `RUN_OVERHEAD`).

    glibc gives a tensor of `HEAP_LIMIT` bytes or more its own mapping and unmaps it when it is freed; a
    smaller one comes from the heap, which keeps a freed block for later allocations but rarely returns it
    to the system. In the steady state (every step does the same work) the heap therefore holds, at every
    moment, at least the most heap-block bytes any moment of the step needs (``heap_high``), so a moment m
    holds ``m.total + max(0, max_heap_high - m.heap)``; the step's RSS is the largest of these."""
    high = max((max(m.heap, m.heap_high) for m in moments), default=0)
    allocated = max((m.total for m in moments), default=0)
    step = max((m.total + max(0, high - m.heap) for m in moments), default=0)
    libraries, objects = RUN_OVERHEAD[family]
    return ProcessMemory(allocated, step - allocated, load, libraries, objects)


# ----------------------------------------------------------------------------- plan and fixes
def plan(cfg: Config, hw: Hardware, *, prompt_tokens: int | None = None) -> StepPlan:
    """`StepPlan` of `cfg` on `hw` (see the module docstring). `prompt_tokens`: text tokens per prompt of a
    token policy (None: the longest of the training rows when the data and the tokenizer are here, else
    `DEFAULT_PROMPT_TOKENS`)."""
    if not cfg.model.name_or_path:
        raise ConfigError(f"{cfg.source}: key 'model.name_or_path' is empty")
    if cfg.model.tiny_builder:  # a tiny config's model is built on first use, as `mmalign train` does
        from mmalign.app.fixtures import check_fixtures_available

        check_fixtures_available(cfg)  # a wheel install has no builders: one error line naming the config
        from mmalign.tiny import ensure_model

        ensure_model(cfg.model.name_or_path, cfg.model.tiny_builder)
    spec = resolve_model(cfg.model.name_or_path)
    if spec.kind in ("causal_lm", "vlm"):
        source = "--prompt-tokens"
        if prompt_tokens is None:
            prompt_tokens, source = estimate_prompt_tokens(cfg), "the longest of the first 256 training rows"
            if prompt_tokens is None:
                prompt_tokens, source = DEFAULT_PROMPT_TOKENS, "the default (no data file or tokenizer here)"
        train, roll, shapes, total, trainable, notes, converted = plan_token(cfg, spec, hw, prompt_tokens)
        notes.insert(0, f"text tokens per prompt: {prompt_tokens}, from {source}")
    else:
        train, roll, shapes, total, trainable, notes, converted = plan_diffusion(cfg, spec, hw)
    if cfg.rollout.engine == "vllm":
        notes.append("rollout.engine vllm: the engine's own memory (gpu_memory_utilization) is not included")
    process = None
    if hw.device.kind == "cpu" and hw.gpus == 1 and not hw.offload:
        family = {"diffusers": "diffusion", "vlm": "vlm"}.get(spec.kind, "token")
        load = train.memory.weights + train.memory.frozen + converted
        process = process_memory(train.moments + roll.moments, load, family)
        notes.append(
            f"process RSS: on top of the interpreter with its libraries imported ({gib(LIBRARIES_IMPORTED)} "
            "measured with torch, transformers, diffusers, peft and mmalign; docs/plan.md)"
        )
        if spec.origin == "table":
            notes.append(
                "the checkpoint's dtype is not in the architecture table: a dtype conversion at load is "
                "not counted in the process RSS"
            )
    return StepPlan(
        cfg.source,
        cfg.model.name_or_path,
        spec.origin,
        hw,
        total,
        trainable,
        shapes,
        train,
        roll,
        notes,
        process,
    )


@dataclass
class Fix:
    """One change to the config or the launch (``overrides`` for the config; ``hardware`` for the launch) and
    the peak it gives."""

    description: str
    overrides: list[str]
    hardware: Hardware
    peak: int


def _with(cfg: Config, **changes: Any) -> Config:
    """A copy of `cfg` with dotted keys changed (``trainer.microbatch_size=2``)."""
    import copy

    new = copy.deepcopy(cfg)
    for key, value in changes.items():
        section, _, name = key.partition("__")
        target = getattr(new, section)
        if isinstance(target, dict):
            target[name] = value
        elif section == "options":
            setattr(target, name, value)
        else:
            setattr(target, name, value)
    return new


def _generation_batches(current: int, unit: int) -> list[int]:
    """Smaller ``rollout.batch_size`` values to try: halvings of `current`, as multiples of `unit` (a diffusion
    rollout is chunked by whole groups), largest first."""
    out = sorted({max(unit, (current // 2**k) // unit * unit) for k in range(1, 6)}, reverse=True)
    return [g for g in out if 1 <= g < current]


def _axes(
    cfg: Config, hw: Hardware, *, train: bool = True, rollout: bool = True
) -> list[list[tuple[str, list[str], Config, Hardware]]]:
    """Candidate changes, one list per axis, smallest change first: (description, overrides, config, hardware);
    those that only help the training step (`train`) or the rollout (`rollout`) only when that phase is over."""
    import copy

    spec = resolve_model(cfg.model.name_or_path)
    diffusion = spec.kind == "diffusers"
    b = batching(cfg, hw.gpus)
    axes: list[list[tuple[str, list[str], Config, Hardware]]] = []
    mb = b.microbatch
    axes.append(
        []
        if not train
        else [
            (
                f"trainer.microbatch_size {mb} -> {m}",
                [f"trainer.microbatch_size={m}"],
                _with(cfg, trainer__microbatch_size=m),
                hw,
            )
            for m in (mb // 2**k for k in range(1, 8))
            if m >= 1 and (m == 1 or m < mb)
        ]
    )
    if train and not cfg.model.gradient_checkpointing:
        axes.append(
            [
                (
                    "gradient checkpointing on",
                    ["model.gradient_checkpointing=true"],
                    _with(cfg, model__gradient_checkpointing=True),
                    hw,
                )
            ]
        )
    if rollout:
        gb = cfg.rollout.batch_size or b.local_batch
        axes.append(
            [
                (
                    f"rollout.batch_size -> {g}",
                    [f"rollout.batch_size={g}"],
                    _with(cfg, rollout__batch_size=g),
                    hw,
                )
                for g in _generation_batches(gb, cfg.rollout.group_size if diffusion else 1)
            ]
        )
    if diffusion and rollout:
        k = vae_decode_rows(cfg, spec, b.local_batch)
        axes.append(
            [
                (
                    f"options.vae_decode_batch {k} -> {n}",
                    [f"options.vae_decode_batch={n}"],
                    _with(cfg, options__vae_decode_batch=n),
                    hw,
                )
                for n in (k // 2**j for j in range(1, 5))
                if n >= 1
            ]
        )
    if diffusion and train:
        steps = diffusion_shapes(cfg, spec).trained_steps
        axes.append(
            [
                (
                    f"options.window_size -> {w} (trained steps per sample, was {steps})",
                    [f"options.window_size={w}"],
                    _with(cfg, options__window_size=w),
                    hw,
                )
                for w in range(steps - 1, 0, -1)
            ]
        )
    if diffusion:
        frames = _opt(cfg, "num_frames")
        if frames:
            axes.append(
                [
                    (
                        f"options.num_frames {frames} -> {f}",
                        [f"options.num_frames={f}"],
                        _with(cfg, options__num_frames=f),
                        hw,
                    )
                    for f in range(frames - 4, 4, -4)  # at least 5 frames (2 latent frames)
                ]
            )
    more = [n for n in (2, 4, 8, 16, 32, 64) if n > hw.gpus and cfg.rollout.prompts_per_step % n == 0]
    axes.append([(f"{n} devices ({hw.strategy})", [f"--gpus {n}"], cfg, replace(hw, gpus=n)) for n in more])
    if hw.strategy != "fsdp2":
        axes.append(
            [
                (
                    f"FSDP2 over {n} devices",
                    [f"--gpus {n} --strategy fsdp2"],
                    cfg,
                    replace(hw, gpus=n, strategy="fsdp2"),
                )
                for n in [hw.gpus] + more
                if n > 1
            ]
        )
    if not hw.offload:
        axes.append(
            [
                (
                    "FSDP2 with CPU offload",
                    ["--strategy fsdp2 --offload"],
                    cfg,
                    replace(hw, strategy="fsdp2", offload=True),
                )
            ]
        )
    lora = cfg.model.lora
    if lora.enabled and train:
        ranks = []
        for r in (lora.r // 2**k for k in range(1, 4)):
            if r >= 4:
                new = copy.deepcopy(cfg)
                new.model.lora.r = r
                ranks.append((f"model.lora.r {lora.r} -> {r}", [f"model.lora.r={r}"], new, hw))
        axes.append(ranks)
    return [a for a in axes if a]


def suggest_fixes(
    cfg: Config, hw: Hardware, *, prompt_tokens: int | None = None, limit: int = 6, depth: int = 10
) -> list[Fix]:
    """Changes that bring the peak under the device memory. Along each axis (the microbatch, gradient
    checkpointing, the generation batch, the trained window, the frames, more devices, FSDP2, CPU offload, the
    LoRA rank) the smallest change that fits, each planned again; when no single change fits, the changes are
    combined greedily (each time the smallest step of the axis that lowers the peak most, up to `depth` steps)
    and the combination is returned if it fits."""
    cap = hw.device.memory

    def peak_of(c: Config, h: Hardware) -> int | None:
        try:
            return plan(c, h, prompt_tokens=prompt_tokens).peak
        except (ConfigError, ValueError):
            return None

    base = plan(cfg, hw, prompt_tokens=prompt_tokens)
    over = {"train": base.train.memory.total > cap, "rollout": base.rollout.memory.total > cap}
    fixes: list[Fix] = []
    for axis in _axes(cfg, hw, **over):
        for desc, overrides, c, h in axis:
            peak = peak_of(c, h)
            if peak is not None and peak <= cap:
                fixes.append(Fix(desc, overrides, h, peak))
                break
    if fixes:
        fixes.sort(key=lambda f: -f.peak)
        return fixes[:limit]
    # no single change fits: combine the smallest step of each axis greedily (the one that lowers the peak most)
    steps: dict[str, tuple[str, list[str]]] = {}
    c, h, peak = cfg, hw, base.peak
    for _ in range(depth):
        options = []
        for axis in _axes(c, h, **over):
            desc, overrides, c2, h2 = axis[0]
            p2 = peak_of(c2, h2)
            if p2 is not None and p2 < peak:
                options.append((p2, desc, overrides, c2, h2))
        if not options:
            return []
        peak, desc, overrides, c, h = min(options, key=lambda o: o[0])
        key = overrides[0].split("=")[0].split(" ")[0]
        first = steps.get(key, (desc, overrides))[0]
        start = first.split(" -> ")[0]
        steps[key] = (f"{start} -> {desc.split(' -> ')[-1]}" if " -> " in desc else desc, overrides)
        if peak <= cap:
            descs = [d for d, _ in steps.values()]
            over = [o for _, os_ in steps.values() for o in os_]
            return [Fix(" + ".join(descs), over, h, peak)]
    return []


# ----------------------------------------------------------------------------- rendering
def gib(n: float) -> str:
    """Bytes in GiB (MiB below one GiB)."""
    return f"{n / GiB:.2f} GiB" if n >= GiB or n == 0 else f"{n / 2**20:.1f} MiB"


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def _measure(hw: Hardware) -> str:
    """What the table's bytes are on `hw`: the peak of the bytes torch's allocator has handed out."""
    if hw.device.kind == "cpu":
        return (
            "peak allocated by torch (the CPU allocator's live tensor bytes, as torch's profiler counts them)"
        )
    return "peak allocated by torch (`torch.cuda.max_memory_allocated`; the CUDA context and the caching allocator's reserve come on top)"


def render(p: StepPlan, fixes: list[Fix] | None = None) -> str:
    """A Markdown report of `p` (and the fixes, when it does not fit). Every number says what it is: the table's
    bytes are the peak allocated by torch per device; on a CPU a second table gives what the process holds
    (its RSS increase, `ProcessMemory`)."""
    hw = p.hardware
    strat = f"{hw.strategy}{' + CPU offload' if hw.offload else ''}"
    lines = [
        f"### {p.config}",
        "",
        f"model `{p.model}` ({p.origin}); {_count(p.params_total)} parameters, {_count(p.params_trainable)} trained; "
        f"{hw.gpus} x {hw.device.name} ({gib(hw.device.memory)}), {strat}",
        "",
        "shapes: " + ", ".join(f"{k} {v}" for k, v in p.shapes.items()),
        "",
        f"bytes per device: {_measure(hw)}",
        "",
        "| allocated by torch, per device | train step | rollout |",
        "|---|---:|---:|",
    ]
    rows = [
        ("weights (trained module)", "weights"),
        ("frozen (encoders, VAE, reference)", "frozen"),
        ("gradients", "gradients"),
        ("optimizer state (AdamW)", "optimizer"),
        ("activations / temporaries", "activations"),
        ("caches (KV cache, stored rollout)", "caches"),
    ]
    for label, key in rows:
        lines.append(
            f"| {label} | {gib(getattr(p.train.memory, key))} | {gib(getattr(p.rollout.memory, key))} |"
        )
    lines.append(
        f"| **peak allocated by torch** | **{gib(p.train.memory.total)}** | **{gib(p.rollout.memory.total)}** |"
    )
    lines.append(f"| where | {p.train.where} | {p.rollout.where} |")
    lines.append(f"| FLOPs per step | {_count(p.train.flops)} | {_count(p.rollout.flops)} |")
    lines.append(
        f"| time at {hw.mfu:.0%} MFU | {_seconds(p.train.seconds)} | {_seconds(p.rollout.seconds)} |"
    )
    lines.append("")
    if p.process is not None:
        pm = p.process
        lines += [
            "| process RSS increase (CPU): what the process holds beyond its imported libraries | |",
            "|---|---:|",
            f"| peak allocated by torch (step) | {gib(pm.allocated)} |",
            f"| + freed heap blocks glibc keeps at the step's worst moment | {gib(pm.heap_kept)} |",
            f"| model load: weights (+ the checkpoint's pages while converting its dtype) | {gib(pm.load)} |",
            f"| the larger of step and load | {gib(max(pm.step, pm.load))} |",
            f"| + library pages a run touches (measured) | {gib(pm.libraries)} |",
            f"| + interpreter objects: modules, tokenizers, data (measured) | {gib(pm.objects)} |",
            f"| **process RSS increase** | **{gib(pm.rss)}** |",
            "",
        ]
    verdict = "fits" if p.fits else "does NOT fit"
    rss = f"; process RSS increase {gib(p.process.rss)}" if p.process is not None else ""
    lines.append(
        f"**{verdict}**: peak allocated by torch {gib(p.peak)} of {gib(hw.device.memory)}{rss}; step about "
        f"{_seconds(p.seconds)}"
    )
    if not p.fits:
        lines.append("")
        if fixes:
            lines.append(
                "changes that make it fit (each line on its own; `+` joins changes needed together):"
            )
            for f in fixes:
                lines.append(
                    f"- {f.description}: peak allocated by torch {gib(f.peak)} (`{' '.join(f.overrides)}`)"
                )
        else:
            lines.append("no single change tried makes it fit (see docs/plan.md)")
    for n in p.notes:
        lines.append(f"- note: {n}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- command line
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``plan`` to the ``mmalign`` subcommands (`mmalign.app.cli.build_parser`)."""
    p = subparsers.add_parser(
        "plan", help="predict the peak memory per device and the time of a training step, without a GPU"
    )
    p.add_argument("config", help="path to a YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.microbatch_size=2")
    p.add_argument("--gpus", type=int, default=1, help="number of devices = processes (default 1)")
    p.add_argument("--gpu", default="h100", choices=sorted(DEVICES), help="device type (default h100)")
    p.add_argument(
        "--gpu-memory", default=None, help="usable memory per device, e.g. 80GiB (default: the device's)"
    )
    p.add_argument(
        "--strategy",
        default="ddp",
        choices=["ddp", "fsdp2"],
        help="ddp (default) or fsdp2 (configs/accelerate/)",
    )
    p.add_argument(
        "--offload", action="store_true", help="FSDP2 CPU offload of parameters, gradients, optimizer state"
    )
    p.add_argument(
        "--mfu", type=float, default=0.4, help="model-FLOPs utilisation for the time estimate (default 0.4)"
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="text tokens per prompt (token policies; default: the longest training prompt when the data and "
        f"the tokenizer are here, else {DEFAULT_PROMPT_TOKENS})",
    )
    p.add_argument("--no-fixes", action="store_true", help="do not search for changes when it does not fit")
    p.set_defaults(func=main)
    return p


def hardware_from_args(args: argparse.Namespace) -> Hardware:
    device = DEVICES[args.gpu]
    if args.gpu_memory:
        device = replace(device, memory=parse_memory(args.gpu_memory))
    if args.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {args.gpus}")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu must be in (0, 1], got {args.mfu}")
    strategy = "fsdp2" if args.offload else args.strategy
    return Hardware(device, args.gpus, strategy, args.offload, args.mfu)


def main(args: argparse.Namespace) -> int:
    """``mmalign plan``: print the plan of the config (and the fixes when it does not fit); 0 if it fits, 2 if
    it does not."""
    import pipelines
    from mmalign.config import load_config

    cfg = load_config(args.config, args.overrides, pipeline_finder=pipelines.find)
    hw = hardware_from_args(args)
    result = plan(cfg, hw, prompt_tokens=args.prompt_tokens)
    fixes = None if result.fits or args.no_fixes else suggest_fixes(cfg, hw, prompt_tokens=args.prompt_tokens)
    sys.stdout.write(render(result, fixes))
    return 0 if result.fits else 2


def _standalone(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmalign")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_standalone())
