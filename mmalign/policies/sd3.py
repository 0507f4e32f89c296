"""`SD3Policy`: Stable Diffusion 3 / 3.5 (and the tiny single-CLIP layout) as a flow-matching GRPO policy.

Only the SD3 parts live here: the components (`mmalign.policies.sd3_components`), the prompt encoding (prompt
states + pooled projections, as diffusers' ``StableDiffusion3Pipeline``) and the transformer call. Sampling,
schedule (``set_timesteps(num_steps)``, as the SD3 pipeline), CFG, steps, LoRA and saving are
`mmalign.policies.flow_matching.FlowMatchingPolicy`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.policies.flow_matching import FlowMatchingPolicy
from mmalign.policies.sd3_components import T5_MAX_LENGTH, SD3Components, load_sd3_components

__all__ = ["LORA_TARGETS", "SD3Policy"]

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
"""Attention projections of SD3 joint blocks (the usual Flow-GRPO LoRA targets)."""


class SD3Policy(FlowMatchingPolicy):
    """An SD3-style ``SD3Transformer2DModel`` pipeline as a GRPO policy."""

    components: SD3Components
    constructor_takes_parts = True
    lora_targets = LORA_TARGETS
    load_options = ("load_t5",)

    def __init__(
        self,
        transformer: torch.nn.Module,
        vae: torch.nn.Module,
        scheduler: Any,
        text_encoder: torch.nn.Module,
        tokenizer: Any,
        *,
        text_encoder_2: torch.nn.Module | None = None,
        tokenizer_2: Any = None,
        text_encoder_3: torch.nn.Module | None = None,
        tokenizer_3: Any = None,
        max_sequence_length: int = T5_MAX_LENGTH,
        **kwargs: Any,
    ) -> None:
        """The parts of an SD3 folder (`SD3Components`); ``max_sequence_length``: the T5 length. Other kwargs
        (sampler settings, ``latent_size``, ``need_reference``, ``lora``) as `FlowMatchingPolicy`."""
        self.max_sequence_length = max_sequence_length
        components = SD3Components(
            transformer,
            vae,
            scheduler,
            text_encoder,
            tokenizer,
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer_2,
            text_encoder_3=text_encoder_3,
            tokenizer_3=tokenizer_3,
        )
        super().__init__(components, **kwargs)

    @classmethod
    def load_components(
        cls, name_or_path: str | Path, *, dtype: torch.dtype, load_t5: bool = True, **options: Any
    ) -> SD3Components:
        """`load_sd3_components` (``load_t5=False`` skips the T5; its prompt states are then zeros)."""
        return load_sd3_components(name_or_path, dtype=dtype, load_t5=load_t5)

    def encode_conditioning(self, prompts: list[str]) -> dict[str, Tensor]:
        pe, po = self.components.encode_prompt(
            prompts, self.device, max_sequence_length=self.max_sequence_length
        )
        return {"prompt_embeds": pe, "pooled_embeds": po}

    def velocity(
        self, model: torch.nn.Module, latents: Tensor, sched: dict[str, Tensor], cond: dict[str, Tensor]
    ) -> Tensor:
        """``SD3Transformer2DModel`` at timestep sigma * num_train_timesteps."""
        dtype = next(model.parameters()).dtype
        t = sched["sigmas"] * float(self.scheduler.config.num_train_timesteps)
        return model(
            hidden_states=latents.to(dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            pooled_projections=cond["pooled_embeds"].to(dtype),
            timestep=t.to(dtype),
            return_dict=False,
        )[0]
