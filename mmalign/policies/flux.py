"""`FluxPolicy`: FLUX.1 (dev / schnell) as a flow-matching GRPO policy.

Only the Flux parts live here: the components (`mmalign.policies.flux_components`), the prompt encoding (T5
states + pooled CLIP, as diffusers' ``FluxPipeline``) and the transformer call on 2x2-packed latents (the
policy's state keeps the unpacked [B, C, h, w] layout; ``latent_size`` must be even), with the timestep as
sigma and FLUX.1-dev's distilled ``guidance`` input instead of two-branch CFG (``train_guidance`` is stored
as True). True CFG as diffusers' ``FluxPipeline`` (``true_cfg_scale`` > 1 with ``negative_prompt``): two
branches, each with the distilled guidance, v = v_neg + s (v_pos - v_neg). Sigmas: linspace(1, 1/n, n) shifted
by mu of the packed token count. The rest is `mmalign.policies.flow_matching.FlowMatchingPolicy`'s; the math is
in docs/algorithms.md.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmalign.policies.denoising import SamplerSettings
from mmalign.policies.flow_matching import FlowMatchingPolicy, calculate_mu
from mmalign.policies.flux_components import FluxComponents, load_flux_components

__all__ = [
    "FLUX_LORA_TARGETS",
    "FluxPolicy",
    "calculate_mu",
    "latent_image_ids",
    "pack_latents",
    "unpack_latents",
]

FLUX_LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
)
"""Attention projections of Flux's transformer blocks (the LoRA targets of ``target_modules: all-linear``)."""


def pack_latents(x: Tensor) -> Tensor:
    """[B, C, h, w] -> [B, (h/2)(w/2), 4C]: each 2x2 patch becomes one token (channel-major inside it)."""
    b, c, h, w = x.shape
    if h % 2 or w % 2:
        raise ValueError(
            f"Flux packs 2x2 latent patches: the latent height and width must be even, got {h}x{w}"
        )
    return (
        x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), 4 * c)
    )


def unpack_latents(tokens: Tensor, h: int, w: int) -> Tensor:
    """The inverse of `pack_latents`: [B, (h/2)(w/2), 4C] -> [B, C, h, w]."""
    b, _, d = tokens.shape
    return tokens.reshape(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h, w)


def latent_image_ids(
    rows: int, cols: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Tensor:
    """Float[rows * cols, 3]: the position id (0, row, column) of every packed token, row-major."""
    r = torch.arange(rows).repeat_interleave(cols)
    c = torch.arange(cols).repeat(rows)
    return torch.stack([torch.zeros_like(r), r, c], dim=1).to(device=device, dtype=dtype)


class FluxPolicy(FlowMatchingPolicy):
    """A ``FluxTransformer2DModel`` pipeline as a GRPO policy (see the module docstring)."""

    components: FluxComponents
    constructor_takes_parts = True
    lora_targets = FLUX_LORA_TARGETS
    load_options = ("load_t5",)
    two_branch_cfg = False
    default_max_shift = 1.15

    def __init__(
        self,
        transformer: torch.nn.Module,
        vae: torch.nn.Module,
        scheduler: Any,
        text_encoder: torch.nn.Module,
        tokenizer: Any,
        text_encoder_2: torch.nn.Module,
        tokenizer_2: Any,
        *,
        sampler: SamplerSettings | None = None,
        latent_size: int | None = None,
        max_sequence_length: int = 512,
        need_reference: bool = False,
        lora: bool = False,
        **sampler_kwargs: Any,
    ) -> None:
        """CLIP (`text_encoder`) and T5 (`text_encoder_2`) with their tokenizers. ``latent_size`` defaults to
        the VAE's ``sample_size`` over its downsampling and must be even; ``guidance_scale`` defaults to 3.5."""
        if latent_size is None:
            factor = 2 ** (len(vae.config.block_out_channels) - 1)
            latent_size = int(vae.config.sample_size) // factor
        if latent_size % 2:
            raise ValueError(f"Flux packs 2x2 latent patches: latent_size must be even, got {latent_size}")
        sampler = self._settings(sampler, sampler_kwargs, guidance_scale=3.5)
        sampler = dataclasses.replace(sampler, train_guidance=True)  # no CFG branches to choose between
        self.max_sequence_length = max_sequence_length
        components = FluxComponents(
            transformer, vae, scheduler, text_encoder, tokenizer, text_encoder_2, tokenizer_2
        )
        super().__init__(
            components, sampler=sampler, latent_size=latent_size, need_reference=need_reference, lora=lora
        )
        self.text_encoder_2 = text_encoder_2
        self.tokenizer_2 = tokenizer_2

    @classmethod
    def load_components(
        cls, name_or_path: str | Path, *, dtype: torch.dtype, load_t5: bool = True, **options: Any
    ) -> FluxComponents:
        """`load_flux_components`; ``load_t5`` is ignored (Flux's prompt states are T5's)."""
        return load_flux_components(name_or_path, dtype=dtype)

    def encode_conditioning(self, prompts: list[str]) -> dict[str, Tensor]:
        pe, po = self.components.encode_prompt(
            prompts, self.device, max_sequence_length=self.max_sequence_length
        )
        return {"prompt_embeds": pe, "pooled_embeds": po}

    # ------------------------------------------------------------------ sigmas and shapes
    def image_seq_len(self) -> int:
        """Packed image tokens of one sample: (latent_size / 2)^2."""
        if self.latent_size % 2:
            raise ValueError(
                f"Flux packs 2x2 latent patches: latent_size must be even, got {self.latent_size}"
            )
        return (self.latent_size // 2) ** 2

    def base_sigmas(self) -> np.ndarray:
        """linspace(1, 1/num_steps, num_steps), as ``FluxPipeline``."""
        return np.linspace(1.0, 1.0 / self.num_steps, self.num_steps)

    def latent_shape(self) -> tuple[int, ...]:
        """(C, h, w) unpacked, C = ``in_channels / 4`` (h = w = ``latent_size``, even)."""
        self.image_seq_len()  # checks that latent_size is even
        return (int(self.model.config.in_channels) // 4, self.latent_size, self.latent_size)

    # ------------------------------------------------------------------ model
    def velocity(
        self, model: torch.nn.Module, latents: Tensor, sched: dict[str, Tensor], cond: dict[str, Tensor]
    ) -> Tensor:
        """One Flux forward on the packed latents (``guidance`` = ``guidance_scale`` with a guidance
        embedding), unpacked to [B, C, h, w]."""
        dtype = next(model.parameters()).dtype
        b, _, h, w = latents.shape
        pe = cond["prompt_embeds"]
        guidance = None
        if self.model.config.guidance_embeds:  # self.model: `model` may be a DDP wrapper
            guidance = torch.full(
                (b,), float(self.guidance_scale), device=latents.device, dtype=torch.float32
            )
        out = model(
            hidden_states=pack_latents(latents).to(dtype),
            timestep=sched["sigmas"].to(dtype),
            guidance=guidance,
            pooled_projections=cond["pooled_embeds"].to(dtype),
            encoder_hidden_states=pe.to(dtype),
            txt_ids=torch.zeros((pe.shape[1], 3), device=latents.device, dtype=dtype),
            img_ids=latent_image_ids(h // 2, w // 2, latents.device, dtype),
            return_dict=False,
        )[0]
        return unpack_latents(out.float(), h, w)
