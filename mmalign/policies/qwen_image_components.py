"""The Qwen-Image folder loader and prompt encoding: `QwenImageComponents`, `load_qwen_image_components`,
`is_qwen_image_folder`, `encode_prompt`.

A Qwen-Image diffusers folder (``Qwen/Qwen-Image``) holds:

- ``transformer/``: a ``QwenImageTransformer2DModel`` (an MMDiT on 2x2-packed latents: ``in_channels`` = 4 x
  the VAE's ``z_dim``, patch 2, 3-axis RoPE on the image tokens, text tokens after them);
- ``vae/``: an ``AutoencoderKLQwenImage`` (Wan's causal video VAE layout used on single frames: latents
  [B, z, 1, h, w], normalised with the config's ``latents_mean`` / ``latents_std``; spatial factor
  ``2 ** len(temperal_downsample)``, 8 for the real model);
- ``scheduler/``: a ``FlowMatchEulerDiscreteScheduler`` with dynamic (exponential) shifting and
  ``shift_terminal``;
- ``text_encoder/`` + ``tokenizer/``: ``Qwen2_5_VLForConditionalGeneration`` and its ``Qwen2Tokenizer``;
- ``model_index.json`` naming ``QwenImagePipeline``.

**Prompt encoding** (`encode_prompt`): diffusers' ``QwenImagePipeline._get_qwen_prompt_embeds``: each prompt
is put into the chat template `PROMPT_TEMPLATE` (a system turn asking to describe the image, then the prompt
as the user turn), tokenized with padding to the batch's longest (at most 1024 + `PROMPT_DROP` tokens), run
through the text encoder with its attention mask, and the LAST hidden states of each prompt's valid tokens
are kept without the first `PROMPT_DROP` (34: the template's system part, as the real tokenizer splits it).
Where the pipeline pads the states to the batch's longest prompt, `encode_prompt` pads every prompt to
``max_sequence_length`` (truncating longer ones, as the pipeline does) and returns the 0/1 mask of the valid
positions, so that cached prompts of any batch stack; the transformer masks the padding out of attention and
places text RoPE positions from 0 whatever the padding, so the network's output does not depend on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "PROMPT_DROP",
    "PROMPT_TEMPLATE",
    "QWEN_IMAGE_MAX_SEQUENCE_LENGTH",
    "QwenImageComponents",
    "encode_prompt",
    "is_qwen_image_folder",
    "load_qwen_image_components",
    "prompt_states",
    "prompt_tokens",
    "vae_scale_factor",
]

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
"""``QwenImagePipeline.prompt_template_encode``: the chat turn each prompt is encoded in."""
PROMPT_DROP = 34
"""``QwenImagePipeline.prompt_template_encode_start_idx``: leading template tokens dropped from the states."""
TOKENIZER_MAX_LENGTH = 1024
"""``QwenImagePipeline.tokenizer_max_length``: prompt tokens kept after the template (the longest allowed
``max_sequence_length``)."""
QWEN_IMAGE_MAX_SEQUENCE_LENGTH = 512
"""``QwenImagePipeline.__call__``'s default ``max_sequence_length``."""
PARTS = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")


def vae_scale_factor(vae: torch.nn.Module) -> int:
    """The VAE's spatial factor, ``2 ** len(temperal_downsample)`` (``QwenImagePipeline.vae_scale_factor``)."""
    return 2 ** len(vae.config.temperal_downsample)


def prompt_tokens(tokenizer: Any, prompts: list[str]) -> tuple[Tensor, Tensor]:
    """(input ids Long[B, L], attention mask Long[B, L]) of `prompts` in `PROMPT_TEMPLATE`, padded to the
    longest and truncated at ``1024 + PROMPT_DROP`` tokens, as the pipeline tokenizes them."""
    tok = tokenizer(
        [PROMPT_TEMPLATE.format(p) for p in prompts],
        max_length=TOKENIZER_MAX_LENGTH + PROMPT_DROP,
        padding=True,
        truncation=True,
        return_tensors="pt",
    )
    return tok.input_ids, tok.attention_mask


def prompt_states(
    text_encoder: torch.nn.Module, ids: Tensor, mask: Tensor, max_sequence_length: int
) -> tuple[Tensor, Tensor]:
    """(states Float[B, max_sequence_length, D] in the encoder's dtype, mask Long[B, max_sequence_length]):
    the last hidden states of each sequence's valid tokens after the first `PROMPT_DROP`, at most
    `max_sequence_length` of them, zero-padded (mask 0) to `max_sequence_length`. Runs with whatever grad
    mode the caller has (the tiny builder trains through it)."""
    hidden = text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    b = ids.shape[0]
    out = hidden.new_zeros((b, max_sequence_length, hidden.shape[-1]))
    valid = torch.zeros((b, max_sequence_length), dtype=torch.long, device=hidden.device)
    keep = mask.bool()
    for i in range(b):
        states = hidden[i][keep[i]][PROMPT_DROP:][:max_sequence_length]
        out[i, : states.shape[0]] = states
        valid[i, : states.shape[0]] = 1
    return out, valid


@torch.no_grad()
def encode_prompt(
    text_encoder: torch.nn.Module,
    tokenizer: Any,
    prompts: list[str],
    device: torch.device | str = "cpu",
    max_sequence_length: int = QWEN_IMAGE_MAX_SEQUENCE_LENGTH,
) -> tuple[Tensor, Tensor]:
    """(prompt_embeds Float[B, max_sequence_length, D], prompt_mask Long[B, max_sequence_length]) of
    `prompts`: `prompt_tokens` then `prompt_states` (see the module docstring)."""
    if not 1 <= max_sequence_length <= TOKENIZER_MAX_LENGTH:
        raise ValueError(
            f"max_sequence_length must be in [1, {TOKENIZER_MAX_LENGTH}] (QwenImagePipeline's limit), "
            f"got {max_sequence_length}"
        )
    ids, mask = prompt_tokens(tokenizer, list(prompts))
    dev = next(text_encoder.parameters()).device
    states, valid = prompt_states(text_encoder, ids.to(dev), mask.to(dev), max_sequence_length)
    return states.to(device), valid.to(device)


@dataclass
class QwenImageComponents:
    """The loaded pieces of a Qwen-Image folder (see the module docstring)."""

    transformer: torch.nn.Module
    vae: torch.nn.Module
    scheduler: Any
    text_encoder: torch.nn.Module
    tokenizer: Any

    def text_encoders(self) -> list[torch.nn.Module]:
        """The Qwen2.5-VL text encoder (the one there is)."""
        return [self.text_encoder]

    def encode_prompt(
        self,
        prompts: list[str],
        device: torch.device | str = "cpu",
        *,
        max_sequence_length: int = QWEN_IMAGE_MAX_SEQUENCE_LENGTH,
    ) -> tuple[Tensor, Tensor]:
        """`encode_prompt` with this folder's text encoder and tokenizer."""
        return encode_prompt(self.text_encoder, self.tokenizer, prompts, device, max_sequence_length)

    def save_pretrained(self, path: str | Path, *, transformer: torch.nn.Module | None = None) -> None:
        """Write every component to its subfolder of `path` (`transformer` overrides the one saved, e.g. a
        merged LoRA copy) and a ``model_index.json`` for diffusers' ``QwenImagePipeline.from_pretrained``."""
        import diffusers

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        index: dict[str, Any] = {
            "_class_name": "QwenImagePipeline",
            "_diffusers_version": diffusers.__version__,
        }
        for name in PARTS:
            part = transformer if name == "transformer" and transformer is not None else getattr(self, name)
            part.save_pretrained(path / name)
            lib = "diffusers" if type(part).__module__.startswith("diffusers") else "transformers"
            index[name] = [lib, type(part).__name__]
        (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def is_qwen_image_folder(name_or_path: str | Path) -> bool:
    """Whether `name_or_path` is a Qwen-Image model: for a local folder, its ``transformer/config.json`` names
    ``QwenImageTransformer2DModel``; for anything else (a hub id; nothing is fetched to decide) whether the
    name contains "qwen-image" or "qwen_image" (case-insensitive)."""
    p = Path(name_or_path)
    if p.is_dir():
        cfg = p / "transformer" / "config.json"
        return (
            cfg.is_file() and json.loads(cfg.read_text()).get("_class_name") == "QwenImageTransformer2DModel"
        )
    name = str(name_or_path).lower()
    return "qwen-image" in name or "qwen_image" in name


def load_qwen_image_components(
    path: str | Path, *, dtype: torch.dtype = torch.float32
) -> QwenImageComponents:
    """Load each component of the Qwen-Image folder (or hub id) `path` with its own ``from_pretrained``; the
    VAE in fp32 (its decode is sensitive to bf16, as Wan's), the rest in `dtype`. A guidance-distilled
    transformer (``guidance_embeds``) is refused: the policy applies true CFG."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    path = str(path)
    transformer = QwenImageTransformer2DModel.from_pretrained(
        path, subfolder="transformer", torch_dtype=dtype
    )
    if transformer.config.guidance_embeds:
        raise ValueError(
            f"{path}/transformer/config.json: guidance_embeds is true; the Qwen-Image policy supports the "
            "true-CFG transformers (guidance_embeds: false) only"
        )
    return QwenImageComponents(
        transformer=transformer,
        vae=AutoencoderKLQwenImage.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler"),
        text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(
            path, subfolder="text_encoder", dtype=dtype
        ),
        tokenizer=AutoTokenizer.from_pretrained(path, subfolder="tokenizer"),
    )
