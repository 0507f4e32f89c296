"""Optional rollout engines for text policies (see `mmalign.engines.base` for the contract).

``get_engine(name, **kwargs)``:

- ``"hf"``: ``None``; the policy samples with Hugging Face ``generate`` itself (the default)
- ``"fake"``: `FakeEngine(**kwargs)`, a CPU engine on an in-process HF model (tests)
- ``"vllm"``: `VLLMEngine(**kwargs)`, vLLM colocated with training (``pip install "mmalign[vllm]"``)

Importing this package never imports vLLM.
"""

from __future__ import annotations

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
from mmalign.engines.client import ENGINE_NAMES, EngineClient, get_engine

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
