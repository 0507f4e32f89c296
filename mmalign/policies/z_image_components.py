"""The Z-Image folder loader and prompt encoding: `ZImageComponents`, `load_z_image_components`,
`encode_prompt`, `z_image_velocity`.

Folder layout, prompt encoding and the network call: docs/algorithms.md, "mmalign.policies.z_image_components".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from mmalign.policies.diffusers_notices import quiet_diffusers_fp32_notice

quiet_diffusers_fp32_notice()

__all__ = [
    "Z_IMAGE_MAX_SEQUENCE_LENGTH",
    "ZImageComponents",
    "encode_prompt",
    "load_z_image_components",
    "prompt_texts",
    "z_image_velocity",
]

Z_IMAGE_MAX_SEQUENCE_LENGTH = 512
"""``ZImagePipeline.__call__``'s default ``max_sequence_length``."""
PARTS = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")


def prompt_texts(tokenizer: Any, prompts: list[str]) -> list[str]:
    """Each prompt as the user turn of `tokenizer`'s chat template with the generation prompt and
    ``enable_thinking=True``, as ``ZImagePipeline._encode_prompt`` renders it."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=True,
        )
        for p in prompts
    ]


@torch.no_grad()
def encode_prompt(
    text_encoder: torch.nn.Module,
    tokenizer: Any,
    prompts: list[str],
    device: torch.device | str = "cpu",
    max_sequence_length: int = Z_IMAGE_MAX_SEQUENCE_LENGTH,
) -> tuple[Tensor, Tensor]:
    """(prompt_embeds Float[B, max_sequence_length, D] in the encoder's dtype, prompt_mask Long[B,
    max_sequence_length]): the second-to-last hidden states of the templated prompts (`prompt_texts`), padded /
    truncated to `max_sequence_length` tokens as the pipeline does, zero where the mask is 0."""
    if max_sequence_length < 1:
        raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
    tok = tokenizer(
        prompt_texts(tokenizer, list(prompts)),
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        return_tensors="pt",
    )
    dev = next(text_encoder.parameters()).device
    mask = tok.attention_mask.to(dev)
    states = text_encoder(
        input_ids=tok.input_ids.to(dev), attention_mask=mask.bool(), output_hidden_states=True
    ).hidden_states[-2]
    states = states * mask.unsqueeze(-1).to(states.dtype)
    return states.to(device), mask.long().to(device)


def z_image_velocity(
    model: torch.nn.Module,
    latents: Tensor,
    sigmas: Tensor,
    embeds: Tensor,
    mask: Tensor,
    num_train_timesteps: int,
) -> Tensor:
    """Float[B, C, h, w]: the flow velocity of one ``ZImageTransformer2DModel`` call at latents [B, C, h, w] (any
    float dtype; h, w even) and noise levels `sigmas` Float[B], with prompt states `embeds` [B, L, D] and their
    0/1 `mask` [B, L] (each sample's valid states are passed unpadded, as the pipeline's ragged list). The time
    input is ``(1000 - sigma * num_train_timesteps) / 1000``; the velocity is minus the network's output."""
    dtype = next(model.parameters()).dtype
    x = list(latents.to(dtype).unsqueeze(2).unbind(0))
    t = (1000 - sigmas.float() * float(num_train_timesteps)) / 1000
    caps = [e[m.bool()].to(dtype) for e, m in zip(embeds, mask, strict=True)]
    out = model(x, t.to(latents.device), caps, return_dict=False)[0]
    return -torch.stack([o.float() for o in out]).squeeze(2)


@dataclass
class ZImageComponents:
    """The loaded pieces of a Z-Image folder (see the module docstring)."""

    transformer: torch.nn.Module
    vae: torch.nn.Module
    scheduler: Any
    text_encoder: torch.nn.Module
    tokenizer: Any

    pipeline_class: ClassVar[str] = "ZImagePipeline"
    """The diffusers pipeline ``model_index.json`` names."""
    parts: ClassVar[tuple[str, ...]] = PARTS
    """The subfolders `save_pretrained` writes."""

    def text_encoders(self) -> list[torch.nn.Module]:
        """The Qwen3 text encoder (the one there is)."""
        return [self.text_encoder]

    def encode_prompt(
        self,
        prompts: list[str],
        device: torch.device | str = "cpu",
        *,
        max_sequence_length: int = Z_IMAGE_MAX_SEQUENCE_LENGTH,
    ) -> tuple[Tensor, Tensor]:
        """`encode_prompt` with this folder's text encoder and tokenizer."""
        return encode_prompt(self.text_encoder, self.tokenizer, prompts, device, max_sequence_length)

    def save_pretrained(self, path: str | Path, *, transformer: torch.nn.Module | None = None) -> None:
        """Write every component to its subfolder of `path` (`transformer` overrides the one saved, e.g. a
        merged LoRA copy) and a ``model_index.json`` naming ``ZImagePipeline``."""
        import diffusers

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        index: dict[str, Any] = {
            "_class_name": self.pipeline_class,
            "_diffusers_version": diffusers.__version__,
        }
        for name in self.parts:
            part = transformer if name == "transformer" and transformer is not None else getattr(self, name)
            part.save_pretrained(path / name)
            lib = "diffusers" if type(part).__module__.startswith("diffusers") else "transformers"
            index[name] = [lib, type(part).__name__]
        (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def load_z_image_components(path: str | Path, *, dtype: torch.dtype = torch.float32) -> ZImageComponents:
    """Load each component of the Z-Image folder (or hub id) `path` with its own ``from_pretrained``: the
    transformer and the text encoder in `dtype`, the VAE in fp32 (decoding is sensitive to bf16)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import AutoModel, Qwen2Tokenizer

    path = str(path)
    return ZImageComponents(
        transformer=ZImageTransformer2DModel.from_pretrained(
            path, subfolder="transformer", torch_dtype=dtype
        ),
        vae=AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler"),
        text_encoder=AutoModel.from_pretrained(path, subfolder="text_encoder", dtype=dtype),
        # the pipeline's tokenizer class by name: AutoTokenizer would look for files a hub snapshot may lack
        tokenizer=Qwen2Tokenizer.from_pretrained(path, subfolder="tokenizer"),
    )
