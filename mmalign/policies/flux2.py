"""`Flux2Policy` (FLUX.2 [dev], ``Flux2Pipeline``) and `Flux2KleinPolicy` (FLUX.2 [klein], ``Flux2KleinPipeline``)
as flow-matching GRPO policies.

Details: docs/algorithms.md, "mmalign.policies.flux2".
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmalign.policies.denoising import SamplerSettings
from mmalign.policies.flow_matching import FlowMatchingPolicy
from mmalign.policies.flux2_components import Flux2Components, load_flux2_components

__all__ = [
    "FLUX2_LORA_TARGETS",
    "Flux2KleinPolicy",
    "Flux2Policy",
    "Flux2PolicyBase",
    "empirical_mu",
    "image_ids",
    "pack_grid",
    "patchify",
    "text_ids",
    "unpack_grid",
    "unpatchify",
]

FLUX2_LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "to_qkv_mlp_proj",
    "attn.to_out",
)
"""The double-stream blocks' attention projections (FLUX.1's targets) and the single-stream blocks' fused
QKV+MLP input projection and output projection ``attn.to_out`` (``target_modules: all-linear``). In the double
blocks ``attn.to_out`` is a module list, which `denoising.adaptable_targets` leaves out (its ``to_out.0`` is a
target already)."""


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """The FLUX.2 time shift mu for `image_seq_len` tokens and `num_steps` steps (diffusers'
    ``compute_empirical_mu``, from BFL's flux2 sampling code)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    return float(compute_empirical_mu(image_seq_len=image_seq_len, num_steps=num_steps))


def patchify(z: Tensor) -> Tensor:
    """[B, c, H, W] VAE latents -> [B, 4c, H/2, W/2]: each 2x2 patch's values become channels (channel-major)."""
    b, c, h, w = z.shape
    return z.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, 4 * c, h // 2, w // 2)


def unpatchify(x: Tensor) -> Tensor:
    """The inverse of `patchify`: [B, 4c, h, w] -> [B, c, 2h, 2w]."""
    b, c4, h, w = x.shape
    return x.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, 2 * h, 2 * w)


def pack_grid(x: Tensor) -> Tensor:
    """[B, C, h, w] -> [B, h*w, C] (row-major tokens)."""
    return x.flatten(2).transpose(1, 2)


def unpack_grid(tokens: Tensor, h: int, w: int) -> Tensor:
    """The inverse of `pack_grid`: [B, h*w, C] -> [B, C, h, w]."""
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], h, w)


def image_ids(h: int, w: int, device: torch.device | str = "cpu") -> Tensor:
    """Long[h*w, 4]: the (time 0, row, column, layer 0) RoPE id of every token, row-major."""
    r = torch.arange(h, device=device).repeat_interleave(w)
    c = torch.arange(w, device=device).repeat(h)
    zero = torch.zeros_like(r)
    return torch.stack([zero, r, c, zero], dim=1)


def text_ids(length: int, device: torch.device | str = "cpu") -> Tensor:
    """Long[length, 4]: the (0, 0, 0, position) RoPE id of every prompt token."""
    pos = torch.arange(length, device=device)
    zero = torch.zeros_like(pos)
    return torch.stack([zero, zero, zero, pos], dim=1)


class Flux2PolicyBase(FlowMatchingPolicy):
    """What FLUX.2 [dev] and [klein] share (see the module docstring); the subclasses set the guidance."""

    components: Flux2Components
    conditioning_keys = ("prompt_embeds",)
    lora_targets = FLUX2_LORA_TARGETS
    load_options = ("load_t5",)
    default_resolution = 1024
    """Image side in pixels when no ``latent_size`` is given (the pipelines' default 1024 x 1024)."""

    def __init__(
        self,
        components: Flux2Components,
        *,
        sampler: SamplerSettings | None = None,
        latent_size: int | None = None,
        max_sequence_length: int = 512,
        text_encoder_out_layers: tuple[int, ...] | list[int] | None = None,
        need_reference: bool = False,
        lora: bool = False,
        **sampler_kwargs: Any,
    ) -> None:
        """`components`: a loaded FLUX.2 folder. ``latent_size`` (the VAE latent side, even) defaults to
        `default_resolution` over the VAE's factor; ``max_sequence_length``: the prompt tokens every prompt is
        padded / truncated to (diffusers' default 512); ``text_encoder_out_layers``: the encoder layers whose
        states are stacked (None: the pipeline's default, which the encoder must be deep enough for)."""
        factor = 2 ** (len(components.vae.config.block_out_channels) - 1)
        if latent_size is None:
            latent_size = self.default_resolution // factor
        self._check_even(latent_size)
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
        layers = tuple(int(k) for k in (text_encoder_out_layers or components.default_layers()))
        depth = int(components.text_encoder.config.get_text_config().num_hidden_layers)
        if not layers or max(layers) > depth or min(layers) < 0:
            raise ValueError(
                f"text_encoder_out_layers {list(layers)} must index the text encoder's hidden states 0..{depth} "
                f"(it has {depth} layers); pass text_encoder_out_layers for a shallower encoder"
            )
        self.max_sequence_length = max_sequence_length
        self.text_encoder_out_layers = layers
        sampler = self._settings(sampler, sampler_kwargs, guidance_scale=4.0)
        sampler = self._adjust_sampler(sampler, components)
        super().__init__(
            components, sampler=sampler, latent_size=latent_size, need_reference=need_reference, lora=lora
        )

    def _adjust_sampler(self, sampler: SamplerSettings, components: Flux2Components) -> SamplerSettings:
        """The family's changes to the sampler settings (default: none)."""
        return sampler

    @staticmethod
    def _check_even(latent_size: int) -> None:
        if latent_size % 2:
            raise ValueError(
                f"FLUX.2 patchifies 2x2 latent patches: latent_size (resolution / the VAE's factor) must be even, "
                f"got {latent_size}"
            )

    @classmethod
    def load_components(
        cls, name_or_path: str | Path, *, dtype: torch.dtype, load_t5: bool = True, **options: Any
    ) -> Flux2Components:
        """`load_flux2_components` (``load_t5`` is ignored: FLUX.2 has no T5)."""
        return load_flux2_components(name_or_path, dtype=dtype)

    def encode_conditioning(self, prompts: list[str]) -> dict[str, Tensor]:
        pe = self.components.encode_prompt(
            prompts,
            self.device,
            max_sequence_length=self.max_sequence_length,
            hidden_layers=self.text_encoder_out_layers,
        )
        return {"prompt_embeds": pe}

    # ------------------------------------------------------------------ sigmas and shapes
    def image_seq_len(self) -> int:
        """Tokens of one sample: (latent_size / 2)^2."""
        self._check_even(self.latent_size)
        return (self.latent_size // 2) ** 2

    def base_sigmas(self) -> np.ndarray:
        """linspace(1, 1/num_steps, num_steps), as the pipelines."""
        return np.linspace(1.0, 1.0 / self.num_steps, self.num_steps)

    def full_sigmas(self) -> Tensor:
        """Float[num_steps + 1]: the scheduler's sigmas for `base_sigmas` with mu = `empirical_mu` (the
        pipelines' schedule; fp32, CPU)."""
        mu = empirical_mu(self.image_seq_len(), self.num_steps)
        self.scheduler.set_timesteps(sigmas=self.base_sigmas(), mu=mu)
        return self.scheduler.sigmas.detach().to("cpu", torch.float32)

    def latent_shape(self) -> tuple[int, ...]:
        """(in_channels, latent_size / 2, latent_size / 2): the patchified grid."""
        n = self.latent_size // 2
        self._check_even(self.latent_size)
        return (int(self.model.config.in_channels), n, n)

    # ------------------------------------------------------------------ model
    def guidance_input(self, batch: int, device: torch.device) -> Tensor | None:
        """The transformer's ``guidance`` input (default None)."""
        return None

    def velocity(
        self, model: torch.nn.Module, latents: Tensor, sched: dict[str, Tensor], cond: dict[str, Tensor]
    ) -> Tensor:
        """One ``Flux2Transformer2DModel`` call on the grid `latents` [B, C, h, w] at ``sched["sigmas"]``:
        Float[B, C, h, w]. The timestep is sigma * num_train_timesteps / 1000 (the pipeline's scheduler
        timestep over 1000)."""
        dtype = next(model.parameters()).dtype
        b, _, h, w = latents.shape
        pe = cond["prompt_embeds"]
        n_train = float(self.scheduler.config.num_train_timesteps)
        out = model(
            hidden_states=pack_grid(latents).to(dtype),
            timestep=(sched["sigmas"].float() * n_train / 1000).to(dtype),
            guidance=self.guidance_input(b, latents.device),
            encoder_hidden_states=pe.to(dtype),
            txt_ids=text_ids(pe.shape[1], latents.device),
            img_ids=image_ids(h, w, latents.device),
            return_dict=False,
        )[0]
        return unpack_grid(out[:, : h * w].float(), h, w)

    # ------------------------------------------------------------------ decoding
    def decode_latents(self, z: Tensor) -> Tensor:
        """Float[B, 3, H, W] in [0, 1] on the CPU: `z` un-normalised with the VAE's batch-norm statistics
        (x sqrt(running_var + eps) + running_mean), un-patchified, decoded, as the pipelines."""
        vae = self.vae
        dt = next(vae.parameters()).dtype
        bn = vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
        img = vae.decode(unpatchify(z * std + mean).to(dt), return_dict=False)[0].float()
        return (img / 2 + 0.5).clamp(0, 1).cpu()


class Flux2Policy(Flux2PolicyBase):
    """FLUX.2 [dev] (``Flux2Pipeline``): distilled guidance, one forward per step (see the module docstring)."""

    two_branch_cfg = False

    def _adjust_sampler(self, sampler: SamplerSettings, components: Flux2Components) -> SamplerSettings:
        if sampler.true_cfg_scale != 1:
            raise ValueError(
                f"FLUX.2 [dev] has no true CFG (Flux2Pipeline guides with the distilled guidance_scale only); "
                f"got true_cfg_scale={sampler.true_cfg_scale}"
            )
        return dataclasses.replace(sampler, train_guidance=True)  # no CFG branches to choose between

    def guidance_input(self, batch: int, device: torch.device) -> Tensor | None:
        """Float[B] of ``guidance_scale`` when the transformer has a guidance embedding, else None."""
        if not self.model.config.guidance_embeds:
            return None
        return torch.full((batch,), float(self.guidance_scale), device=device, dtype=torch.float32)


class Flux2KleinPolicy(Flux2PolicyBase):
    """FLUX.2 [klein] (``Flux2KleinPipeline``): two-branch CFG against the empty prompt, off for the
    step-distilled checkpoints (see the module docstring)."""

    two_branch_cfg = True

    def _cfg_scale(self) -> float:
        """``guidance_scale``, or 1 (no CFG) for a step-distilled checkpoint, whose pipeline ignores it."""
        return 1.0 if self.components.is_distilled else float(self.guidance_scale)
