"""The rollout-engine interface: something that samples completions for token-id prompts.

A rollout engine is an optional, faster sampler for text and VLM policies (vLLM in production, `FakeEngine`
in tests) that holds its own copy of the weights. `RolloutEngine` declares ``generate`` (``n`` samples per
prompt, prompt-major, with the sampled tokens' log-probs of ``log_softmax(logits / T)`` and a finish reason),
``sync_weights`` (full or LoRA-adapter weights; never hangs: `WeightSyncError` past ``timeout_s``, after which
the engine refuses to generate until a sync succeeds) and ``sleep`` / ``wake``; `MultimodalPrompt` carries a
VLM's images. The engine-vs-trainer log-prob gap is corrected by `mmalign.algorithms.is_correction`. The
contract in detail: docs/architecture.md, "Rollout engines".
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

WeightState = Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]


class WeightSyncError(RuntimeError):
    """A weight sync did not complete (timed out or failed); the message names engine, timeout and step."""


class EngineStateError(RuntimeError):
    """The engine cannot generate: its last weight sync failed, so its weights are in an unknown state."""


@dataclass
class SamplingSpec:
    """How an engine samples. ``top_k = 0`` and ``top_p = 1`` disable truncation; ``temperature = 0`` is greedy.

    ``seed``: seeds this call (prompt ``i`` uses ``seed + i``); the same seed, prompts and weights
    reproduce the call on the same engine. Pass a different seed each step (e.g. ``base_seed + step``);
    ``None`` draws fresh randomness. ``stop_token_ids``: tokens that end a completion (EOS ids);
    they are included in the completion. ``stop``: stop strings; the completion ends with the token
    that completes a stop string (needs a tokenizer in the engine).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    suppress_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingSpec.temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingSpec.top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"SamplingSpec.top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingSpec.max_new_tokens must be >= 1, got {self.max_new_tokens!r}")


@dataclass
class EngineOutput:
    """One sampled completion: token ids, the engine's log-prob of each, and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    prompt_index: int = 0
    text: str | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"EngineOutput: {len(self.token_ids)} token ids but {len(self.logprobs)} log-probs"
            )


@dataclass
class MultimodalPrompt:
    """A vision-language prompt for an engine with ``supports_images``: ``token_ids`` of the chat-templated
    text with ONE image placeholder token per image (the engine expands each into the image's patch tokens,
    as vLLM does), and ``images`` (PIL images, in the order of their placeholders)."""

    token_ids: list[int]
    images: list[Any] = field(default_factory=list)


EnginePrompt = list[int] | MultimodalPrompt


def _token_ids(prompt: EnginePrompt) -> list[int]:
    return prompt.token_ids if isinstance(prompt, MultimodalPrompt) else prompt


def outputs_to_tensors(outputs: list[EngineOutput], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded ``completion_ids`` Long[B,T], ``logp_engine`` Float[B,T] (0 on padding) and
    ``lengths`` Long[B] from engine outputs (T = the longest completion, at least 1)."""
    b = len(outputs)
    t = max([len(o.token_ids) for o in outputs] + [1])
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    logp = torch.zeros((b, t), dtype=torch.float32)
    lengths = torch.zeros(b, dtype=torch.long)
    for i, o in enumerate(outputs):
        k = len(o.token_ids)
        lengths[i] = k
        if k:
            ids[i, :k] = torch.tensor(o.token_ids, dtype=torch.long)
            logp[i, :k] = torch.tensor(o.logprobs, dtype=torch.float32)
    return ids, logp, lengths


# ----------------------------------------------------------------------------- weights to push


def is_peft(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def full_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """The weights to push to an engine with ``lora=False``, Hugging Face checkpoint names.

    A plain model: its ``state_dict()`` (detached, same device). A peft model: the merged weights
    (`merged_state_dict`). Unwrap DDP / accelerate wrappers before calling. An FSDP2-sharded model (DTensor
    parameters): the full, unsharded tensors under the same names, gathered on every rank (a collective:
    every rank must call it).
    """
    if is_peft(model):
        return merged_state_dict(model)
    if _is_sharded(model):
        from mmalign.training.distributed import gather_full_state_dict

        return gather_full_state_dict(model, cpu=False)
    return {k: v.detach() for k, v in model.state_dict().items()}


def _is_sharded(model: torch.nn.Module) -> bool:
    from mmalign.training.distributed import is_dtensor

    return any(is_dtensor(p) for p in model.parameters())


@torch.no_grad()
def merged_state_dict(peft_model: torch.nn.Module, adapter: str | None = None) -> dict[str, Tensor]:
    """The base model's weights with the LoRA adapter merged in, under the base model's names.

    The trainer model is not modified and not copied: for every LoRA layer the merged weight is
    ``base.weight + layer.get_delta_weight(adapter)`` computed into a new tensor (the same result
    as `merge_and_unload` on a copy). Names lose the ``base_model.model.`` prefix and the
    ``.base_layer`` infix; adapter tensors are dropped; for ``modules_to_save`` the trained copy
    is pushed under the original name. FSDP2-sharded (DTensor) parameters are gathered first, so the result
    holds full tensors on every rank (a collective: every rank must call it).
    """
    if _is_sharded(peft_model):
        from mmalign.training.distributed import full_parameters, gather_full_state_dict

        base = peft_model.get_base_model()
        with full_parameters(base):  # the LoRA deltas are computed from the gathered factors
            return _merged(peft_model, adapter, gather_full_state_dict(base, cpu=False))
    return _merged(peft_model, adapter, None)


def _merged(
    peft_model: torch.nn.Module, adapter: str | None, full: dict[str, Tensor] | None
) -> dict[str, Tensor]:
    """`merged_state_dict`; ``full``: the base model's state dict, already gathered (sharded models)."""
    from peft.tuners.lora import LoraLayer

    adapter = adapter or getattr(peft_model, "active_adapter", "default")
    if isinstance(adapter, list | tuple):
        if len(adapter) != 1:
            raise ValueError(f"merged_state_dict: exactly one active adapter is supported, got {adapter}")
        adapter = adapter[0]
    base = peft_model.get_base_model()
    deltas: dict[str, Tensor] = {}
    for mod_name, mod in base.named_modules():
        if (
            isinstance(mod, LoraLayer)
            and adapter in getattr(mod, "lora_A", {})
            and not getattr(mod, "merged", False)
        ):
            deltas[f"{mod_name}.base_layer.weight" if mod_name else "base_layer.weight"] = (
                mod.get_delta_weight(adapter)
            )
    out: dict[str, Tensor] = {}
    for name, value in (full if full is not None else base.state_dict()).items():
        if ".lora_" in name or ".original_module." in name:
            continue
        if ".modules_to_save." in name:
            prefix, rest = name.split(".modules_to_save.", 1)
            which, _, tail = rest.partition(".")
            if which != adapter:
                continue
            out[f"{prefix}.{tail}"] = value.detach()
            continue
        v = value.detach()
        if name in deltas:
            v = v + deltas[name].to(v.dtype)
        out[name.replace(".base_layer.", ".")] = v
    return out


def adapter_state_dict(peft_model: torch.nn.Module, adapter: str | None = None) -> dict[str, Tensor]:
    """The LoRA adapter tensors (peft names, as saved in ``adapter_model.safetensors``), for ``lora=True``.
    FSDP2-sharded (DTensor) tensors are gathered to full ones on every rank (a collective)."""
    from peft import get_peft_model_state_dict

    adapter = adapter or getattr(peft_model, "active_adapter", "default")
    full = None
    if _is_sharded(peft_model):
        from mmalign.training.distributed import gather_full_state_dict

        full = gather_full_state_dict(peft_model, cpu=False)
    state = get_peft_model_state_dict(peft_model, state_dict=full, adapter_name=adapter)
    return {k: v.detach() for k, v in state.items()}


def iter_state(state: WeightState) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` pairs of a mapping or an iterable of pairs."""
    if isinstance(state, Mapping):
        yield from state.items()
    else:
        yield from state


# ----------------------------------------------------------------------------- the interface


class RolloutEngine(ABC):
    """A sampler with its own copy of the weights. See the module docstring for the contract."""

    name: str = "engine"
    supports_lora_adapters: bool = False
    """Whether ``sync_weights(..., lora=True)`` (adapter loading) is supported."""
    supports_images: bool = False
    """Whether `generate` takes `MultimodalPrompt` items (a vision-language model with its processor)."""

    def __init__(self) -> None:
        self.weight_version = 0
        """Number of successful syncs (0: the weights the engine was built with)."""
        self.last_synced_step: int | None = None
        self.last_sync_s: float | None = None
        self._sync_lock = threading.Lock()
        self._running_sync: threading.Thread | None = None
        self._broken: str | None = None
        self.asleep = False
        """The engine has released its memory (`sleep`); `wake` takes it back."""

    # ------------------------------------------------------------------ sampling
    @abstractmethod
    def _generate(
        self, prompt_token_ids: list[EnginePrompt], n: int, sampling: SamplingSpec
    ) -> list[EngineOutput]:
        """Engine-specific sampling (see `generate`); `MultimodalPrompt` items only if ``supports_images``."""

    def generate(
        self, prompt_token_ids: list[EnginePrompt], n: int, sampling: SamplingSpec
    ) -> list[EngineOutput]:
        """``n`` completions per prompt, flattened prompt-major (output ``i*n + j``), see the module docstring.
        A prompt is a list of token ids, or a `MultimodalPrompt` for an engine that ``supports_images``."""
        if self._broken is not None:
            raise EngineStateError(
                f"{self.name} engine: the last weight sync failed ({self._broken}); its weights are in an "
                "unknown state, so it will not sample until a sync succeeds"
            )
        if n < 1:
            raise ValueError(f"{self.name} engine: n must be >= 1, got {n}")
        if not prompt_token_ids:
            return []
        self.wake()  # an asleep engine has no weights / KV cache to sample with
        prompts: list[EnginePrompt] = []
        for p in prompt_token_ids:
            if isinstance(p, MultimodalPrompt):
                if not self.supports_images:
                    raise ValueError(
                        f"{self.name} engine: it takes no images (a MultimodalPrompt was given); a vision-language "
                        f"policy needs an engine that supports images (vllm, or fake with a processor)"
                    )
                prompts.append(MultimodalPrompt(list(map(int, p.token_ids)), list(p.images)))
            else:
                prompts.append(list(map(int, p)))
        if any(len(_token_ids(p)) == 0 for p in prompts):
            raise ValueError(f"{self.name} engine: every prompt needs at least one token")
        return self._generate(prompts, n, sampling)

    # ------------------------------------------------------------------ weights
    @abstractmethod
    def _load_weights(self, state: WeightState, *, lora: bool) -> None:
        """Engine-specific weight loading; runs in a worker thread (see `sync_weights`)."""

    def sync_weights(
        self,
        state: WeightState,
        *,
        lora: bool = False,
        timeout_s: float = 600.0,
        step: int | None = None,
    ) -> None:
        """Load ``state`` into the engine, or raise `WeightSyncError` within about ``timeout_s``.

        The load runs in a daemon worker thread while this thread waits with a timeout. A load that
        overruns cannot be killed (Python threads cannot be), so it is left to finish on its own;
        the engine is marked broken (``generate`` raises) and a new sync is refused while that load
        is still running. A load that raises surfaces as `WeightSyncError` with the exception as
        its ``__cause__``.
        """
        where = f" at step {step}" if step is not None else ""
        if lora and not self.supports_lora_adapters:
            raise WeightSyncError(
                f"{self.name} engine{where}: LoRA adapter loading (lora=True) is not supported by this engine; "
                "push merged weights instead (mmalign.engines.merged_state_dict, lora=False)"
            )
        if timeout_s <= 0:
            raise ValueError(f"{self.name} engine: timeout_s must be > 0, got {timeout_s!r}")
        self.wake()  # never load into memory a sleeping engine gave back
        with self._sync_lock:
            if self._running_sync is not None and self._running_sync.is_alive():
                raise WeightSyncError(
                    f"{self.name} engine{where}: a previous weight sync that timed out is still running; "
                    "the engine cannot be synced until it ends"
                )
            result: dict[str, BaseException] = {}

            def work() -> None:
                try:
                    self._load_weights(state, lora=lora)
                except BaseException as e:  # surfaced in the caller's thread
                    result["error"] = e

            t0 = time.perf_counter()
            thread = threading.Thread(target=work, name=f"mmalign-{self.name}-weight-sync", daemon=True)
            self._running_sync = thread
            thread.start()
            thread.join(timeout_s)
            elapsed = time.perf_counter() - t0
            if thread.is_alive():
                self._broken = f"timed out after {timeout_s:g} s{where}"
                raise WeightSyncError(
                    f"{self.name} engine: weight sync{where} did not complete within timeout_s={timeout_s:g} s; "
                    "the engine's weights are in an unknown state (raise the timeout, or check the engine)"
                )
            self._running_sync = None
            if "error" in result:
                err = result["error"]
                self._broken = f"failed{where}: {type(err).__name__}: {err}"
                raise WeightSyncError(
                    f"{self.name} engine: weight sync{where} failed after {elapsed:.2f} s "
                    f"(timeout_s={timeout_s:g}): {type(err).__name__}: {err}"
                ) from err
            self._broken = None
            self.weight_version += 1
            self.last_synced_step = step
            self.last_sync_s = elapsed

    # ------------------------------------------------------------------ memory
    @property
    def sleep_enabled(self) -> bool:
        """Whether `sleep` releases memory (False: `sleep` and `wake` are no-ops). Engines with a sleep mode
        override this (their ``enable_sleep_mode`` option)."""
        return False

    def sleep(self) -> None:
        """Release accelerator memory while the trainer updates (colocated engines): `_sleep`, where
        ``sleep_enabled`` and the engine is awake; a no-op otherwise."""
        if self.sleep_enabled and not self.asleep:
            self._sleep()
            self.asleep = True

    def wake(self) -> None:
        """Reclaim the memory `sleep` released (`_wake`); a no-op when the engine is awake."""
        if self.asleep:
            self._wake()
            self.asleep = False

    def _sleep(self) -> None:  # noqa: B027 - optional hook
        """Engine-specific: release the memory (see `sleep`)."""

    def _wake(self) -> None:  # noqa: B027 - optional hook
        """Engine-specific: take the memory back (see `wake`)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free the engine's resources. No-op by default."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(weight_version={self.weight_version})"
