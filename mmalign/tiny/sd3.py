"""A tiny SD3-style flow-matching pipeline built offline from config kwargs, and the tiny tokenizers
the other tiny diffusion builders share.

Builders registered in `mmalign.tiny.BUILDERS`: ``flow_sd3_tiny`` (one CLIP) and ``flow_sd3_tiny_3enc``
(the real SD3 layout: two CLIPs and a T5).

Details: docs/architecture.md, "mmalign.tiny.sd3".
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch

from mmalign.policies.sd3_components import SD3Components
from mmalign.tiny import BUILDERS

__all__ = [
    "build_tiny_sd3",
    "clip_byte_tokenizer",
    "t5_char_tokenizer",
]

TOKEN_LENGTH = 16


def _bytes_to_unicode() -> list[str]:
    """GPT-2/CLIP byte-to-unicode table (the 256 symbols of a byte-level BPE)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
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


def t5_char_tokenizer(model_max_length: int = 512) -> Any:
    """A `T5TokenizerFast` (Unigram, like the real one) over single characters: ``<pad>`` 0, ``</s>`` 1,
    ``<unk>`` 2, then the word-start marker and printable ASCII characters with and without it."""
    from transformers import T5TokenizerFast

    chars = list(string.ascii_letters + string.digits + string.punctuation)
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + c, -3.0) for c in chars] + [(c, -4.0) for c in chars]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=model_max_length)


def _tiny_clip(tokenizer: Any, hidden: int, projection: int) -> torch.nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=TOKEN_LENGTH,
            projection_dim=projection,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )


def tiny_t5_encoder(tokenizer: Any, hidden: int) -> torch.nn.Module:
    """A one-layer ``T5EncoderModel`` of width `hidden` for the character T5 tokenizer (SD3's third and
    Flux's second text encoder in the tiny builders)."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer),
            d_model=hidden,
            d_kv=8,
            d_ff=2 * hidden,
            num_layers=1,
            num_heads=2,
            relative_attention_num_buckets=8,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    )


def build_tiny_sd3(
    path: str | Path,
    *,
    sample_size: int = 8,
    latent_channels: int = 4,
    num_layers: int = 1,
    text_hidden: int = 32,
    pooled_dim: int = 16,
    seed: int = 0,
    text_encoders: int = 1,
) -> Path:
    """Write a tiny SD3-style pipeline folder at `path` (random weights, ~100k parameters).

    ``text_encoders``: 1 = one CLIP (hidden ``text_hidden``, projection ``pooled_dim``); 3 = the real
    SD3 layout: CLIP-1 (hidden ``text_hidden // 4``), CLIP-2 (hidden ``text_hidden // 2``), each with a
    ``pooled_dim // 2`` projection, and a T5 encoder of width ``text_hidden`` (= the transformer's
    ``joint_attention_dim``); 2 = the same without the T5 (``text_encoder_3``/``tokenizer_3`` absent).
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    if text_encoders not in (1, 2, 3):
        raise ValueError(f"text_encoders must be 1, 2 or 3, got {text_encoders}")
    if text_encoders > 1 and (text_hidden % 8 or pooled_dim % 2):
        raise ValueError("with 2 or 3 text encoders text_hidden must be a multiple of 8 and pooled_dim even")
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
    extra: dict[str, Any] = {}
    if text_encoders == 1:
        text_encoder = _tiny_clip(tokenizer, text_hidden, pooled_dim)
    else:
        text_encoder = _tiny_clip(tokenizer, text_hidden // 4, pooled_dim // 2)
        extra["tokenizer_2"] = clip_byte_tokenizer()
        extra["text_encoder_2"] = _tiny_clip(
            extra["tokenizer_2"], text_hidden // 2, pooled_dim - pooled_dim // 2
        )
    if text_encoders == 3:
        tok3 = t5_char_tokenizer()
        extra["tokenizer_3"] = tok3
        extra["text_encoder_3"] = tiny_t5_encoder(tok3, text_hidden)
    c = SD3Components(transformer, vae, scheduler, text_encoder, tokenizer, **extra)
    c.save_pretrained(path)
    return path


@BUILDERS.register("flow_sd3_tiny", minutes=0.05)
def _build_registered(path: Path) -> None:
    build_tiny_sd3(path)


@BUILDERS.register("flow_sd3_tiny_3enc", minutes=0.05)
def _build_registered_3enc(path: Path) -> None:
    build_tiny_sd3(path, text_encoders=3)
