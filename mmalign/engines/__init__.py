"""Optional rollout engines for text policies (see `mmalign.engines.base` for the contract).

``get_engine(name, **kwargs)``:

- ``"hf"``: ``None``; the policy samples with Hugging Face ``generate`` itself (the default)
- ``"fake"``: `FakeEngine(**kwargs)`, a CPU engine on an in-process HF model (tests)
- ``"vllm"``: `VLLMEngine(**kwargs)`, vLLM colocated with training (``pip install "mmalign[vllm]"``)

Importing this package never imports vLLM.
"""

from __future__ import annotations

from typing import Any

from mmalign.engines.base import (
    EngineOutput,
    EnginePrompt,
    EngineStateError,
    MultimodalPrompt,
    RolloutEngine,
    SamplingSpec,
    WeightSyncError,
    adapter_state_dict,
    full_state_dict,
    merged_state_dict,
    outputs_to_tensors,
)
from mmalign.engines.client import EngineClient

ENGINE_NAMES = ("hf", "fake", "vllm")


def get_engine(name: str, **kwargs: Any) -> RolloutEngine | None:
    """The engine called ``name`` built with ``kwargs`` (``None`` for ``"hf"``)."""
    if name == "hf":
        if kwargs:
            raise TypeError(f"engine 'hf' takes no options, got {sorted(kwargs)}")
        return None
    if name == "fake":
        from mmalign.engines.fake import FakeEngine

        return FakeEngine(**kwargs)
    if name == "vllm":
        from mmalign.engines.vllm import VLLMEngine

        return VLLMEngine(**kwargs)
    raise ValueError(f"unknown rollout engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")


__all__ = [
    "ENGINE_NAMES",
    "EngineClient",
    "EngineOutput",
    "EnginePrompt",
    "EngineStateError",
    "MultimodalPrompt",
    "RolloutEngine",
    "SamplingSpec",
    "WeightSyncError",
    "adapter_state_dict",
    "full_state_dict",
    "get_engine",
    "merged_state_dict",
    "outputs_to_tensors",
]
