"""`QwenImagePolicy`: Qwen-Image (``QwenImagePipeline``) as a flow-matching GRPO policy.

Only the Qwen-Image parts live here: the components and prompt encoding
(`mmalign.policies.qwen_image_components`: Qwen2.5-VL last hidden states of the templated prompt, padded to
``max_sequence_length`` with a mask), the transformer call on 2x2-packed latents (`qwen_image_velocity`: the
timestep is sigma, the text padding is masked), true CFG with the pipeline's norm rescaling (`_guide`:
the guided velocity of every packed token is rescaled to the norm of its conditional velocity), the sigmas
(linspace(1, 1/n, n) shifted by mu of the packed token count, the folder scheduler's exponential shift and
``shift_terminal``), and decoding through the Qwen VAE as a one-frame video. The policy's state keeps the
unpacked [B, z, h, w] layout (``latent_size`` must be even). Sampling, steps, LoRA and saving are
`mmalign.policies.flow_matching.FlowMatchingPolicy`'s; the math is in docs/algorithms.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmalign.policies.denoising import SamplerSettings
from mmalign.policies.flow_matching import FlowMatchingPolicy
from mmalign.policies.flux import pack_latents, unpack_latents
from mmalign.policies.qwen_image_components import (
    QWEN_IMAGE_MAX_SEQUENCE_LENGTH,
    QwenImageComponents,
    load_qwen_image_components,
    vae_scale_factor,
)
from mmalign.policies.wan_components import decode_video

__all__ = [
    "DEFAULT_RESOLUTION",
    "QWEN_IMAGE_LORA_TARGETS",
    "QwenImagePolicy",
    "cfg_norm_rescale",
    "qwen_image_velocity",
]

QWEN_IMAGE_LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)
"""The joint blocks' attention projections and feed-forward layers (``target_modules: all-linear``)."""
DEFAULT_RESOLUTION = 1024
"""Image side in pixels when no ``latent_size`` is given (``QwenImagePipeline``'s default 1024 x 1024)."""


def qwen_image_velocity(
    model: torch.nn.Module,
    latents: Tensor,
    sigmas: Tensor,
    embeds: Tensor,
    mask: Tensor,
    num_train_timesteps: int,
    *,
    source: Tensor | None = None,
) -> Tensor:
    """Float[B, z, h, w]: one ``QwenImageTransformer2DModel`` call on unpacked latents [B, z, h, w] (any float
    dtype; packed 2x2 before the call, unpacked after) at noise levels `sigmas` Float[B], with prompt states
    `embeds` [B, L, D] and their 0/1 `mask` [B, L]. The timestep is ``sigma * num_train_timesteps / 1000`` (the
    pipeline's scheduler timestep over 1000), ``img_shapes`` one frame of (h/2) x (w/2) tokens. With `source`
    [B, z, hs, ws] (Qwen-Image-Edit's source latents) its packed tokens follow the noisy ones in the sequence,
    ``img_shapes`` gets a second frame (hs/2) x (ws/2), and only the noisy tokens' output is kept, as
    ``QwenImageEditPipeline``."""
    dtype = next(model.parameters()).dtype
    b, _, h, w = latents.shape
    tokens = pack_latents(latents)
    shapes = [(1, h // 2, w // 2)]
    if source is not None:
        tokens = torch.cat([tokens, pack_latents(source.to(tokens.dtype))], dim=1)
        shapes.append((1, source.shape[-2] // 2, source.shape[-1] // 2))
    out = model(
        hidden_states=tokens.to(dtype),
        timestep=(sigmas.float() * float(num_train_timesteps) / 1000).to(dtype),
        encoder_hidden_states=embeds.to(dtype),
        encoder_hidden_states_mask=mask.bool(),
        img_shapes=[shapes] * b,
        return_dict=False,
    )[0]
    return unpack_latents(out[:, : (h // 2) * (w // 2)].float(), h, w)


def cfg_norm_rescale(guided: Tensor, cond: Tensor) -> Tensor:
    """`guided` Float[B, z, h, w] with each packed token's vector (the 4 z values of a 2x2 patch) rescaled to the
    norm of the same token of `cond`: ``QwenImagePipeline``'s ``comb * (||cond|| / ||comb||)`` on the packed
    latents' last dim."""
    h, w = guided.shape[-2:]
    g, c = pack_latents(guided), pack_latents(cond)
    return unpack_latents(g * (c.norm(dim=-1, keepdim=True) / g.norm(dim=-1, keepdim=True)), h, w)


class QwenImagePolicy(FlowMatchingPolicy):
    """A ``QwenImageTransformer2DModel`` pipeline as a GRPO policy (see the module docstring)."""

    components: QwenImageComponents
    conditioning_keys = ("prompt_embeds", "prompt_mask")
    constructor_takes_parts = True
    lora_targets = QWEN_IMAGE_LORA_TARGETS
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
        max_sequence_length: int = QWEN_IMAGE_MAX_SEQUENCE_LENGTH,
        need_reference: bool = False,
        lora: bool = False,
        **sampler_kwargs: Any,
    ) -> None:
        """The parts of a Qwen-Image folder (`QwenImageComponents`). ``latent_size`` defaults to
        `DEFAULT_RESOLUTION` pixels over the VAE's factor and must be even; ``max_sequence_length`` (1..1024):
        the prompt states every prompt is padded / truncated to; ``guidance_scale`` (true CFG with the empty
        negative prompt) defaults to 4.0 as the pipeline's ``true_cfg_scale``. Other keywords as
        `FlowMatchingPolicy`."""
        if latent_size is None:
            latent_size = DEFAULT_RESOLUTION // vae_scale_factor(vae)
        if latent_size % 2:
            raise ValueError(
                f"Qwen-Image packs 2x2 latent patches: latent_size must be even, got {latent_size}"
            )
        if not 1 <= max_sequence_length <= 1024:
            raise ValueError(f"max_sequence_length must be in [1, 1024], got {max_sequence_length}")
        self.max_sequence_length = max_sequence_length
        sampler = self._settings(sampler, sampler_kwargs, guidance_scale=4.0)
        components = QwenImageComponents(transformer, vae, scheduler, text_encoder, tokenizer)
        super().__init__(
            components, sampler=sampler, latent_size=latent_size, need_reference=need_reference, lora=lora
        )

    @classmethod
    def load_components(
        cls, name_or_path: str | Path, *, dtype: torch.dtype, load_t5: bool = True, **options: Any
    ) -> QwenImageComponents:
        """`load_qwen_image_components` (``load_t5`` is ignored: Qwen-Image has no T5)."""
        return load_qwen_image_components(name_or_path, dtype=dtype)

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent along a side (`vae_scale_factor` of the VAE config)."""
        return vae_scale_factor(self.vae)

    def encode_conditioning(self, prompts: list[str]) -> dict[str, Tensor]:
        pe, mask = self.components.encode_prompt(
            prompts, self.device, max_sequence_length=self.max_sequence_length
        )
        return {"prompt_embeds": pe, "prompt_mask": mask}

    # ------------------------------------------------------------------ sigmas and shapes
    def image_seq_len(self) -> int:
        """Packed image tokens of one sample: (latent_size / 2)^2 (mu of the dynamic shift)."""
        return (self.latent_size // 2) ** 2

    def base_sigmas(self) -> np.ndarray:
        """linspace(1, 1/num_steps, num_steps), as ``QwenImagePipeline``."""
        return np.linspace(1.0, 1.0 / self.num_steps, self.num_steps)

    def latent_shape(self) -> tuple[int, ...]:
        """(z_dim, h, w) unpacked (h = w = ``latent_size``, even)."""
        if self.latent_size % 2:
            raise ValueError(
                f"Qwen-Image packs 2x2 latent patches: latent_size must be even, got {self.latent_size}"
            )
        return (int(self.model.config.in_channels) // 4, self.latent_size, self.latent_size)

    # ------------------------------------------------------------------ model
    def velocity(
        self, model: torch.nn.Module, latents: Tensor, sched: dict[str, Tensor], cond: dict[str, Tensor]
    ) -> Tensor:
        """`qwen_image_velocity` with the policy's prompt states and mask."""
        n_train = int(self.scheduler.config.num_train_timesteps)
        return qwen_image_velocity(
            model, latents, sched["sigmas"], cond["prompt_embeds"], cond["prompt_mask"], n_train
        )

    def _guide(self, u: Tensor, c: Tensor) -> Tensor:
        """u + w (c - u) rescaled per packed token to the norm of c: ``QwenImagePipeline``'s true CFG (used by
        sampling and by the training forward alike)."""
        return cfg_norm_rescale(super()._guide(u, c), c)

    # ------------------------------------------------------------------ decoding
    def decode_latents(self, z: Tensor) -> Tensor:
        """Float[B, 3, H, W] in [0, 1] on the CPU: the latents as one-frame videos through the Qwen VAE,
        un-normalised with ``latents_mean`` / ``latents_std`` as ``QwenImagePipeline``."""
        return decode_video(self.vae, z[:, :, None])[:, 0]
