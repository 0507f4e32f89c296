"""Loading a token policy (text or VLM) from a hub id or local folder, with LoRA through peft."""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from mmalign.config import LoraConfig
from mmalign.policies.base import torch_dtype
from mmalign.policies.token_sampling import neutralize_shaping_settings

log = logging.getLogger(__name__)

P = TypeVar("P")


def load_token_policy(
    cls: type[P],
    name_or_path: str,
    *,
    dtype: str = "float32",
    lora: LoraConfig | None = None,
    gradient_checkpointing: bool = False,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    need_reference: bool = False,
    **kwargs: Any,
) -> P:
    """`cls(model, tokenizer_or_processor, ...)` from `cls._load_pretrained`; LoRA on `cls._lora_targets`."""
    load_kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype), "trust_remote_code": trust_remote_code}
    if attn_implementation:
        load_kwargs["attn_implementation"] = attn_implementation
    try:
        tokenizer, model = cls._load_pretrained(name_or_path, load_kwargs)  # type: ignore[attr-defined]
    except OSError as e:
        raise OSError(f"cannot load the model {name_or_path!r} (config key model.name_or_path): {e}") from e
    reset = neutralize_shaping_settings(getattr(model, "generation_config", None))
    if reset:
        log.warning(
            "%s: its generation_config reshapes sampling (%s); reset to neutral so the rollouts are sampled from "
            "the distribution the loss scores (softmax(logits / rollout.temperature), rollout.top_k / top_p)",
            name_or_path,
            ", ".join(reset),
        )
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    use_lora = bool(lora and lora.enabled)
    if use_lora:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        assert lora is not None
        peft_cfg = PeftLoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=cls._lora_targets(lora.target_modules),  # type: ignore[attr-defined]
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, peft_cfg)
    return cls(model, tokenizer, need_reference=need_reference, lora=use_lora, **kwargs)
