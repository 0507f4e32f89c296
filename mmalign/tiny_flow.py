"""A tiny SD3-style flow-matching pipeline built offline from config kwargs (tests, quickstart).

`build_tiny_sd3(path)` writes a folder with the same layout as a real Stable Diffusion 3 folder
(``transformer/``, ``vae/``, ``scheduler/``, ``text_encoder/``, ``tokenizer/``), each saved with
``save_pretrained``; `load_sd3_components(path)` loads it back with ``from_pretrained`` per
component -- the very path a real SD3 folder takes. Nothing is downloaded.

Simplification: the real SD3 / SD3.5 has three text encoders (two CLIPs whose penultimate hidden
states are concatenated and padded to the T5 width, plus a T5 whose states are concatenated along
the sequence; the pooled embedding is the concatenation of both CLIP projections). The tiny one has
a single `CLIPTextModelWithProjection`: prompt embeddings are its penultimate hidden states
[B, L, joint_attention_dim] and the pooled embedding its projection [B, pooled_projection_dim].
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmalign.tiny import BUILDERS

__all__ = ["SD3Components", "build_tiny_sd3", "clip_byte_tokenizer", "encode_prompt", "load_sd3_components"]

TOKEN_LENGTH = 16


def _bytes_to_unicode() -> list[str]:
    """GPT-2/CLIP byte-to-unicode table (the 256 symbols of a byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def clip_byte_tokenizer(max_length: int = TOKEN_LENGTH) -> Any:
    """A `CLIPTokenizer` with a byte-level vocab and no merges (every byte is a token; 514 ids)."""
    from transformers import CLIPTokenizer

    chars = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for c in chars:
        vocab[c] = len(vocab)
    for c in chars:
        vocab[c + "</w>"] = len(vocab)
    for s in ("<|startoftext|>", "<|endoftext|>"):
        vocab[s] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def build_tiny_sd3(
    path: str | Path,
    *,
    sample_size: int = 8,
    latent_channels: int = 4,
    num_layers: int = 1,
    text_hidden: int = 32,
    pooled_dim: int = 16,
    seed: int = 0,
) -> Path:
    """Write a tiny SD3-style pipeline folder at `path` (random weights, ~100k parameters)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=sample_size,
        patch_size=2,
        in_channels=latent_channels,
        out_channels=latent_channels,
        num_layers=num_layers,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=text_hidden,
        caption_projection_dim=16,
        pooled_projection_dim=pooled_dim,
        pos_embed_max_size=sample_size,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(8,),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=sample_size,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    tokenizer = clip_byte_tokenizer()
    text_encoder = CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=text_hidden,
            intermediate_size=2 * text_hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=TOKEN_LENGTH,
            projection_dim=pooled_dim,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    transformer.save_pretrained(path / "transformer")
    vae.save_pretrained(path / "vae")
    scheduler.save_pretrained(path / "scheduler")
    text_encoder.save_pretrained(path / "text_encoder")
    tokenizer.save_pretrained(path / "tokenizer")
    return path


@BUILDERS.register("flow_sd3_tiny")
def _build_registered(path: Path) -> None:
    build_tiny_sd3(path)


@dataclass
class SD3Components:
    """The loaded pieces of an SD3-style folder (one text encoder in the tiny variant)."""

    transformer: torch.nn.Module
    vae: torch.nn.Module
    scheduler: Any
    text_encoder: torch.nn.Module
    tokenizer: Any


def load_sd3_components(path: str | Path, *, dtype: torch.dtype = torch.float32) -> SD3Components:
    """Load each component with its own ``from_pretrained`` from the pipeline folder `path`."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer

    path = str(path)
    return SD3Components(
        transformer=SD3Transformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=dtype),
        vae=AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=dtype),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler"),
        text_encoder=CLIPTextModelWithProjection.from_pretrained(path, subfolder="text_encoder", dtype=dtype),
        tokenizer=CLIPTokenizer.from_pretrained(path, subfolder="tokenizer"),
    )


@torch.no_grad()
def encode_prompt(
    text_encoder: torch.nn.Module, tokenizer: Any, prompts: list[str], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_embeds [B, L, D], pooled [B, P]) as SD3 takes them from one CLIP: penultimate hidden
    states and the text projection; prompts are padded/truncated to the tokenizer's max length."""
    tok = tokenizer(
        list(prompts), padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
        return_tensors="pt",
    )
    out = text_encoder(tok.input_ids.to(device), output_hidden_states=True)
    return out.hidden_states[-2], out.text_embeds
