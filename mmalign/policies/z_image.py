"""`ZImagePolicy`: Z-Image (``ZImagePipeline``, e.g. ``Tongyi-MAI/Z-Image-Turbo``) as a flow-matching GRPO policy.

Details: docs/algorithms.md, "Z-Image" (guidance) and "mmalign.policies.z_image".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmalign.policies.denoising import SamplerSettings
from mmalign.policies.flow_matching import FlowMatchingPolicy
from mmalign.policies.z_image_components import (
    Z_IMAGE_MAX_SEQUENCE_LENGTH,
    ZImageComponents,
    load_z_image_components,
    z_image_velocity,
)

__all__ = ["DEFAULT_RESOLUTION", "Z_IMAGE_LORA_TARGETS", "ZImagePolicy"]

Z_IMAGE_LORA_TARGETS = (
    "attention.to_q",
    "attention.to_k",
    "attention.to_v",
    "attention.to_out.0",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)
"""Every block's attention projections and SwiGLU feed-forward layers (the main layers' and the noise / context
refiners'), Flow-Factory's default Z-Image targets (``target_modules: all-linear``)."""
DEFAULT_RESOLUTION = 1024
"""Image side in pixels when no ``latent_size`` is given (``ZImagePipeline``'s default 1024 x 1024)."""
PATCH = 2
"""The transformer's spatial patch (``all_patch_size`` of the published models)."""


class ZImagePolicy(FlowMatchingPolicy):
    """A ``ZImageTransformer2DModel`` pipeline as a GRPO policy (see the module docstring)."""

    components: ZImageComponents
    conditioning_keys = ("prompt_embeds", "prompt_mask")
    constructor_takes_parts = True
    lora_targets = Z_IMAGE_LORA_TARGETS
    load_options = ("load_t5",)
    default_max_shift = 1.15

    def __init__(
        self,
        transformer: torch.nn.Module,
        vae: torch.nn.Module,
        scheduler: Any,
        text_encoder: torch.nn.Module,
        tokenizer: Any,
        *,
        sampler: SamplerSettings | None = None,
        latent_size: int | None = None,
        max_sequence_length: int = Z_IMAGE_MAX_SEQUENCE_LENGTH,
        need_reference: bool = False,
        lora: bool = False,
        **sampler_kwargs: Any,
    ) -> None:
        """The parts of a Z-Image folder (`ZImageComponents`). ``latent_size`` defaults to `DEFAULT_RESOLUTION`
        pixels over the VAE's factor and must be even; ``max_sequence_length``: the prompt tokens (template
        included) every prompt is padded / truncated to; ``guidance_scale`` w (1: no CFG, as Z-Image-Turbo's
        pipeline guidance 0; otherwise the pipeline's guidance g = w - 1) defaults to 1. Other keywords as
        `FlowMatchingPolicy`."""
        factor = 2 ** (len(vae.config.block_out_channels) - 1)
        if latent_size is None:
            latent_size = DEFAULT_RESOLUTION // factor
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
        self.max_sequence_length = max_sequence_length
        sampler = self._settings(sampler, sampler_kwargs)
        components = ZImageComponents(transformer, vae, scheduler, text_encoder, tokenizer)
        super().__init__(
            components, sampler=sampler, latent_size=latent_size, need_reference=need_reference, lora=lora
        )

    @classmethod
    def load_components(
        cls, name_or_path: str | Path, *, dtype: torch.dtype, load_t5: bool = True, **options: Any
    ) -> ZImageComponents:
        """`load_z_image_components` (``load_t5`` is ignored: Z-Image has no T5)."""
        return load_z_image_components(name_or_path, dtype=dtype)

    @property
    def latent_size(self) -> int:
        """Latent side (h = w); must be even (2 x 2 patches), checked whenever it is set."""
        return self._latent_size

    @latent_size.setter
    def latent_size(self, value: int) -> None:
        if int(value) % PATCH:
            raise ValueError(
                f"Z-Image patches 2x2 latents: latent_size must be even (options.resolution / the VAE's factor), "
                f"got {value}"
            )
        self._latent_size = int(value)

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent along a side, ``2 ** (len(block_out_channels) - 1)`` as the pipeline."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    def encode_conditioning(self, prompts: list[str]) -> dict[str, Tensor]:
        pe, mask = self.components.encode_prompt(
            prompts, self.device, max_sequence_length=self.max_sequence_length
        )
        return {"prompt_embeds": pe, "prompt_mask": mask}

    # ------------------------------------------------------------------ sigmas and shapes
    def image_seq_len(self) -> int:
        """Image patches of one sample, (latent_size / 2)^2 (mu of a dynamic shift)."""
        return (self.latent_size // PATCH) ** 2

    def base_sigmas(self) -> np.ndarray:
        """linspace(1, 1/num_steps, num_steps) computed in fp32 as ``get_default_z_image_sigmas``."""
        return np.array(torch.linspace(1.0, 1 / self.num_steps, self.num_steps).tolist())

    def latent_shape(self) -> tuple[int, ...]:
        """(in_channels, h, w) with h = w = ``latent_size`` (even)."""
        return (int(self.model.config.in_channels), self.latent_size, self.latent_size)

    # ------------------------------------------------------------------ model
    def velocity(
        self, model: torch.nn.Module, latents: Tensor, sched: dict[str, Tensor], cond: dict[str, Tensor]
    ) -> Tensor:
        """`z_image_velocity` with the policy's prompt states and mask."""
        n_train = int(self.scheduler.config.num_train_timesteps)
        return z_image_velocity(
            model, latents, sched["sigmas"], cond["prompt_embeds"], cond["prompt_mask"], n_train
        )
