"""A tiny FLUX.1-style pipeline built offline from config kwargs (tests, quickstart).

Builder registered in `mmalign.tiny.BUILDERS`: ``flux_tiny``.

Details: docs/architecture.md, "mmalign.tiny.flux".
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmalign.policies.flux_components import FluxComponents
from mmalign.tiny import BUILDERS
from mmalign.tiny.sd3 import TOKEN_LENGTH, clip_byte_tokenizer, t5_char_tokenizer, tiny_t5_encoder

__all__ = ["build_tiny_flux"]


def build_tiny_flux(
    path: str | Path,
    *,
    guidance_embeds: bool = True,
    image_size: int = 16,
    latent_channels: int = 4,
    clip_hidden: int = 16,
    t5_hidden: int = 32,
    seed: int = 0,
) -> Path:
    """Write a tiny FLUX.1-style folder at `path` (random weights, ~100k parameters); see the module docstring.

    ``guidance_embeds`` True gives a FLUX.1-dev-like transformer (distilled guidance embedding), False a
    schnell-like one. The VAE downsamples by 2, so ``image_size`` pixels give ``image_size / 2`` latents
    (the VAE's ``sample_size``), which must be even for the 2x2 packing.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    if image_size % 4:
        raise ValueError(
            f"image_size must be a multiple of 4 (even latents after the 2x VAE), got {image_size}"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * latent_channels,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=t5_hidden,
        pooled_projection_dim=clip_hidden,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=image_size,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    tokenizer = clip_byte_tokenizer()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=clip_hidden,
            intermediate_size=2 * clip_hidden,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=TOKEN_LENGTH,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    tokenizer_2 = t5_char_tokenizer()
    text_encoder_2 = tiny_t5_encoder(tokenizer_2, t5_hidden)
    FluxComponents(
        transformer, vae, scheduler, text_encoder, tokenizer, text_encoder_2, tokenizer_2
    ).save_pretrained(path)
    return path


@BUILDERS.register("flux_tiny", minutes=0.05)
def _build_registered(path: Path) -> None:
    build_tiny_flux(path)
