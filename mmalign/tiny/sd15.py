"""A tiny Stable-Diffusion-1.x-style UNet pipeline built offline from config kwargs (tests, quickstart).

Builder registered in `mmalign.tiny.BUILDERS`: ``ddim_sd15_tiny``.

Details: docs/architecture.md, "mmalign.tiny.sd15".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mmalign.tiny import BUILDERS
from mmalign.tiny.sd3 import TOKEN_LENGTH, clip_byte_tokenizer

__all__ = ["SD15_SCHEDULER", "build_tiny_sd15"]

SD15_SCHEDULER: dict[str, Any] = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    set_alpha_to_one=False,
    steps_offset=1,
)
"""The noise schedule of the real SD 1.5 scheduler config (as a `DDIMScheduler`)."""


def build_tiny_sd15(
    path: str | Path,
    *,
    sample_size: int = 8,
    latent_channels: int = 4,
    block_out_channels: tuple[int, ...] = (16, 32),
    cross_attention_dim: int = 32,
    prediction_type: str = "epsilon",
    set_alpha_to_one: bool = False,
    seed: int = 0,
) -> Path:
    """Write a tiny SD 1.5-style pipeline folder at `path` (random weights, ~200k parameters).

    `sample_size` is the latent size (images are twice as large); `prediction_type` ("epsilon", or
    "v_prediction" as in SD 2.x) and `set_alpha_to_one` go into the scheduler config.
    """
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    n = len(block_out_channels)
    unet = UNet2DConditionModel(
        sample_size=sample_size,
        in_channels=latent_channels,
        out_channels=latent_channels,
        down_block_types=("CrossAttnDownBlock2D",) + ("DownBlock2D",) * (n - 1),
        up_block_types=("UpBlock2D",) * (n - 1) + ("CrossAttnUpBlock2D",),
        block_out_channels=tuple(block_out_channels),
        layers_per_block=1,
        cross_attention_dim=cross_attention_dim,
        attention_head_dim=4,
        norm_num_groups=8,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=2 * sample_size,
    )
    scheduler = DDIMScheduler(
        **{**SD15_SCHEDULER, "prediction_type": prediction_type, "set_alpha_to_one": set_alpha_to_one}
    )
    tokenizer = clip_byte_tokenizer()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=cross_attention_dim,
            intermediate_size=2 * cross_attention_dim,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=TOKEN_LENGTH,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    unet.save_pretrained(path / "unet")
    vae.save_pretrained(path / "vae")
    scheduler.save_pretrained(path / "scheduler")
    text_encoder.save_pretrained(path / "text_encoder")
    tokenizer.save_pretrained(path / "tokenizer")
    return path


@BUILDERS.register("ddim_sd15_tiny", minutes=0.05)
def _build_registered(path: Path) -> None:
    build_tiny_sd15(path)
