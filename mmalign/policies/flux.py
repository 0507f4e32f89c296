"""FLUX.1 (dev / schnell) as a flow-matching GRPO policy: `FluxPolicy`, a `FlowPolicy` for
``FluxTransformer2DModel``.

Everything that does not depend on the network is inherited unchanged from `mmalign.policies.flow`: the
step kinds (``flow_sde``, ``cps``, ``dance``), the trained-step selection (``train_fraction``, random and
sliding windows), the payload, the re-scoring in `action_stats`, the KL on step means, LoRA and the reference.
What differs for Flux:

- **Packed latents.** The policy's state x keeps the unpacked VAE layout [B, C, h, w] everywhere (the
  SDE steps, the payload, the final ``outputs["latents"]`` and `decode` see the same shapes as for SD3).
  Only around the velocity call, `predict` packs x into 2x2 patches [B, (h/2)(w/2), 4C]
  (`pack_latents`, the layout of diffusers' ``FluxPipeline._pack_latents``), passes the position ids
  FluxPipeline passes -- ``img_ids`` [(h/2)(w/2), 3] with (0, row, column) per patch
  (`latent_image_ids`) and ``txt_ids`` zeros [L, 3] -- and unpacks the velocity (`unpack_latents`).
  ``latent_size`` (h = w) must therefore be even; `latent_shape` (the initial noise) has ``in_channels / 4``
  channels.
- **Timestep.** Flux's transformer takes t in [0, 1] (it multiplies by 1000 itself), so the sigma of the
  step is passed as is (FluxPipeline passes ``timesteps / 1000``, the same value up to rounding).
- **Prompt encoding**, exactly as diffusers' ``FluxPipeline.encode_prompt`` (see
  `mmalign.policies.flux_components.FluxComponents.encode_prompt`): the T5 states of the prompt
  (``max_sequence_length`` tokens, default 512 as in diffusers; FLUX.1-schnell was trained with 256) are the
  ``encoder_hidden_states``, the CLIP ``pooler_output`` the ``pooled_projections``. Each distinct prompt
  is encoded once (`DenoisingPolicy.conditioning`'s cache).
- **Guidance.** FLUX.1-dev (``transformer.config.guidance_embeds``) is guidance-distilled: ``guidance_scale``
  is fed to the transformer as its ``guidance`` input, one forward per velocity -- in sampling, in
  `action_stats`, for the reference and for ``logp_old`` alike, so the log-probs are those of the sampling
  policy. FLUX.1-schnell (no guidance embedding) gets no guidance and ignores ``guidance_scale``.
  Two-branch classifier-free guidance (negative prompt) is never used for Flux, so ``train_guidance``
  (FlowPolicy's "CFG-free training") has nothing to choose: it is accepted, ignored and stored as True.
- **Sigmas.** ``use_dynamic_shifting`` schedulers (Flux's) shift the sigmas by the image's token count,
  as FluxPipeline does: mu = `calculate_mu` of (latent_size / 2)^2 packed tokens, interpolated linearly
  between the scheduler config's (``base_image_seq_len``, ``base_shift``) and (``max_image_seq_len``,
  ``max_shift``), is passed to ``set_timesteps`` with the base sigmas linspace(1, 1 / num_steps,
  num_steps). A scheduler without dynamic shifting uses its static ``shift`` as for SD3.
- **Decoding**: Flux's VAE decodes ``z / scaling_factor + shift_factor``, which `DenoisingPolicy.decode`
  already does.
- **Loading and saving**: `from_pretrained` reads a diffusers FLUX.1 folder (``transformer/``, ``vae/``,
  ``scheduler/``, ``text_encoder/`` + ``tokenizer/`` (CLIP), ``text_encoder_2/`` + ``tokenizer_2/`` (T5));
  `save` writes the same layout plus a ``model_index.json`` (under LoRA the adapter merged, and also
  saved alone in ``transformer_lora/``). LoRA targets the attention projections of the double-stream
  blocks (``to_q``, ``to_k``, ``to_v``, ``to_out.0``, ``add_q_proj``, ``add_k_proj``, ``add_v_proj``,
  ``to_add_out``; the single-stream blocks' ``to_q``/``to_k``/``to_v`` match too).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmalign.config import LoraConfig
from mmalign.policies.base import torch_dtype
from mmalign.policies.denoising import SamplerSettings, add_lora
from mmalign.policies.flow import FlowPolicy, calculate_mu

__all__ = [
    "FLUX_LORA_TARGETS",
    "FluxPolicy",
    "flow_policy_class",
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


class FluxPolicy(FlowPolicy):
    """A FLUX.1 transformer as a GRPO policy (see the module docstring); FlowPolicy's options otherwise."""

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
        """`text_encoder`/`tokenizer`: CLIP; `text_encoder_2`/`tokenizer_2`: T5. ``latent_size`` defaults to
        the VAE's ``sample_size`` over its downsampling factor (128 for FLUX.1: 1024 px images) and must
        be even. The sampler settings as for `FlowPolicy` (``guidance_scale`` defaults to 3.5);
        ``train_guidance`` is ignored and stored as True (no CFG branches)."""
        from mmalign.policies.flux_components import FluxComponents

        if latent_size is None:
            factor = 2 ** (len(vae.config.block_out_channels) - 1)
            latent_size = int(vae.config.sample_size) // factor
        if latent_size % 2:
            raise ValueError(f"Flux packs 2x2 latent patches: latent_size must be even, got {latent_size}")
        sampler = self._settings(sampler, sampler_kwargs, guidance_scale=3.5)
        # no CFG branches to choose between: the scored velocity is the sampled one
        sampler = dataclasses.replace(sampler, train_guidance=True)
        super().__init__(
            transformer,
            vae,
            scheduler,
            text_encoder,
            tokenizer,
            sampler=sampler,
            latent_size=latent_size,
            max_sequence_length=max_sequence_length,
            need_reference=need_reference,
            lora=lora,
        )
        self.components = FluxComponents(  # type: ignore[assignment]
            transformer, self.vae, scheduler, text_encoder, tokenizer, text_encoder_2, tokenizer_2
        )
        text_encoder_2.eval().requires_grad_(False)
        self.text_encoder_2 = text_encoder_2
        self.tokenizer_2 = tokenizer_2

    # ------------------------------------------------------------------ building
    @classmethod
    def from_pretrained(  # type: ignore[override]
        cls,
        name_or_path: str | Path,
        *,
        dtype: str = "float32",
        lora: LoraConfig | None = None,
        load_t5: bool = True,
        **kwargs: Any,
    ) -> FluxPolicy:
        """Load a diffusers FLUX.1 folder (or hub id; see
        `mmalign.policies.flux_components.load_flux_components`). With ``lora.enabled`` the transformer
        gets a peft LoRA adapter (``add_adapter``; ``target_modules: all-linear`` means
        `FLUX_LORA_TARGETS`) and only the adapter trains; the reference is then the transformer with the
        adapter disabled. ``load_t5`` is ignored (Flux's prompt states are T5's, so the T5 is always
        loaded). Other kwargs go to the constructor."""
        from mmalign.policies.flux_components import load_flux_components

        del load_t5
        c = load_flux_components(name_or_path, dtype=torch_dtype(dtype))
        use_lora = add_lora(c.transformer, lora, FLUX_LORA_TARGETS)
        return cls(
            c.transformer,
            c.vae,
            c.scheduler,
            c.text_encoder,
            c.tokenizer,
            c.text_encoder_2,
            c.tokenizer_2,
            lora=use_lora,
            **kwargs,
        )

    # ------------------------------------------------------------------ sigmas and noise
    def image_seq_len(self) -> int:
        """Packed image tokens of one sample: (latent_size / 2)^2."""
        if self.latent_size % 2:
            raise ValueError(
                f"Flux packs 2x2 latent patches: latent_size must be even, got {self.latent_size}"
            )
        return (self.latent_size // 2) ** 2

    def sigmas(self) -> Tensor:
        """Float[num_steps + 1]: the scheduler's sigmas from 1 down to 0, with Flux's resolution-dependent
        shift (mu of `image_seq_len`) under ``use_dynamic_shifting``; fp32 on CPU."""
        base = np.linspace(1.0, 1.0 / self.num_steps, self.num_steps)
        if self.scheduler.config.get("use_dynamic_shifting", False):
            self.scheduler.set_timesteps(
                sigmas=base, mu=calculate_mu(self.image_seq_len(), self.scheduler.config)
            )
        else:
            self.scheduler.set_timesteps(sigmas=base)
        return self.scheduler.sigmas.detach().to("cpu", torch.float32)

    def latent_shape(self) -> tuple[int, ...]:
        """(C, h, w) in the unpacked layout, C = ``in_channels / 4`` (h = w = ``latent_size``, even)."""
        self.image_seq_len()  # checks that latent_size is even
        return (int(self.model.config.in_channels) // 4, self.latent_size, self.latent_size)

    # ------------------------------------------------------------------ model
    def predict(
        self,
        model: torch.nn.Module,
        latents: Tensor,
        sched: dict[str, Tensor],
        cond: dict[str, Tensor],
        *,
        guided: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """(velocity, velocity), fp32 [B, C, h, w], at unpacked latents and per-sample ``sched["sigmas"]`` [B]:
        one forward of the Flux transformer on the packed latents (``guidance`` = ``guidance_scale`` when it
        has a guidance embedding). `guided` is ignored: Flux has no two-branch CFG, so the velocity is also
        the conditional one."""
        del guided
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
        v = unpack_latents(out.float(), h, w)
        return v, v

    def save(self, path: str | Path) -> None:
        """Write the whole FLUX.1 folder (loadable by `FluxPolicy.from_pretrained` and diffusers'
        ``FluxPipeline.from_pretrained``). Under LoRA the adapter is merged into a copy of the transformer,
        and also saved on its own in ``transformer_lora/``."""
        path = Path(path)
        self.components.save_pretrained(path, transformer=self._denoiser_to_save(path, "transformer"))


def flow_policy_class(name_or_path: str | Path) -> type[FlowPolicy]:
    """The flow-matching policy class for a model: `FluxPolicy` for a FLUX.1 folder (or a hub id naming
    Flux; `mmalign.policies.flux_components.is_flux_folder`), else `FlowPolicy` (SD3 / SD3.5)."""
    from mmalign.policies.flux_components import is_flux_folder

    return FluxPolicy if is_flux_folder(name_or_path) else FlowPolicy
