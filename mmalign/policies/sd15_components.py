"""The SD 1.x / 2.x folder loader: `SD15Components`, `load_sd15_components` and SD 1.x prompt encoding.

`load_sd15_components(path)` loads a Stable Diffusion 1.x / 2.x pipeline folder (``unet/``, ``vae/``,
``scheduler/``, ``text_encoder/``, ``tokenizer/``) with ``from_pretrained`` per component; the
scheduler is read as a `DDIMScheduler` (a real folder's PNDM scheduler config too). `encode_prompt`
gives the prompt embeddings as `StableDiffusionPipeline` computes them. `DDIMPolicy` loads its model
through here; the tiny builder `mmalign.tiny.sd15` writes folders of this layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmalign.policies.diffusers_notices import quiet_diffusers_fp32_notice

quiet_diffusers_fp32_notice()  # diffusers' empty "should be kept in float32: []" notice (LoRA saves)

__all__ = ["SD15Components", "encode_prompt", "load_sd15_components"]


@dataclass
class SD15Components:
    """The loaded pieces of an SD 1.x / 2.x folder."""

    unet: torch.nn.Module
    vae: torch.nn.Module
    scheduler: Any
    text_encoder: torch.nn.Module
    tokenizer: Any


def load_sd15_components(path: str | Path, *, dtype: torch.dtype = torch.float32) -> SD15Components:
    """Load each component with its own ``from_pretrained`` from the pipeline folder `path`; the
    scheduler is always a `DDIMScheduler` (``DDIMScheduler.from_pretrained`` reads a PNDM config too)."""
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    path = str(path)
    return SD15Components(
        unet=UNet2DConditionModel.from_pretrained(path, subfolder="unet", torch_dtype=dtype),
        vae=AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=dtype),
        scheduler=DDIMScheduler.from_pretrained(path, subfolder="scheduler"),
        text_encoder=CLIPTextModel.from_pretrained(path, subfolder="text_encoder", dtype=dtype),
        tokenizer=CLIPTokenizer.from_pretrained(path, subfolder="tokenizer"),
    )


@torch.no_grad()
def encode_prompt(
    text_encoder: torch.nn.Module, tokenizer: Any, prompts: list[str], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Prompt embeddings [B, L, D] as `StableDiffusionPipeline` takes them: the text encoder's last
    hidden states over ids padded/truncated to the tokenizer's max length (attention mask passed only
    when the text encoder's config asks for it)."""
    tok = tokenizer(
        list(prompts),
        padding="max_length",
        max_length=tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    )
    mask = None
    if getattr(text_encoder.config, "use_attention_mask", False):
        mask = tok.attention_mask.to(device)
    return text_encoder(tok.input_ids.to(device), attention_mask=mask)[0]
