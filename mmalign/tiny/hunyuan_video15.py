"""Tiny HunyuanVideo 1.5 text-to-video pipelines built offline from config kwargs (`mmalign.policies.hunyuan_video15`).

Builders ``hunyuan_video15_tiny`` (`build_tiny_hunyuan_video15`): a random
``hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v``-layout folder; ``hunyuan_video15_i2v_tiny``
(`build_tiny_hunyuan_video15_i2v`): the image-to-video layout (``HunyuanVideo15ImageToVideoPipeline``, plus a SigLIP
``image_encoder/`` and ``feature_extractor/``), as ``hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v``.

Details: docs/video.md, "mmalign.tiny.hunyuan_video15".
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from mmalign.policies.hunyuan_video15_components import (
    SYSTEM_MESSAGE,
    TEMPLATE_TOKENS,
    HunyuanVideo15Components,
    HunyuanVideo15ImageToVideoComponents,
)
from mmalign.tiny import BUILDERS, train_bpe_tokenizer

__all__ = [
    "QWEN25_CHAT_TEMPLATE",
    "build_tiny_hunyuan_video15",
    "build_tiny_hunyuan_video15_i2v",
    "tiny_hunyuan_tokenizer",
    "tiny_hunyuan_transformer",
    "tiny_hunyuan_vae",
    "tiny_hunyuan_video15_components",
    "tiny_hunyuan_video15_i2v_components",
    "tiny_siglip",
]

QWEN25_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""What Qwen2.5's chat template renders for a system turn, user turns and the generation prompt."""
SPECIALS = ["<|im_start|>", "<|im_end|>"]
PREFIX = f"<|im_start|>system\n{SYSTEM_MESSAGE}<|im_end|>\n<|im_start|>user\n"
"""The rendered template before the prompt: the part the pipeline drops."""


def _captions() -> list[str]:
    from mmalign.tiny.qwen_image import shape_captions as shapes_captions

    return shapes_captions()


def _tokenizer(vocab_size: int) -> Any:
    from transformers import Qwen2Tokenizer

    texts = [f"{PREFIX}{c}<|im_end|>\n<|im_start|>assistant\n" for c in _captions()]
    fast = train_bpe_tokenizer(texts, vocab_size=vocab_size, extra_special=SPECIALS)
    fast.chat_template = QWEN25_CHAT_TEMPLATE
    with tempfile.TemporaryDirectory() as tmp:
        fast.save_pretrained(tmp)
        tok = Qwen2Tokenizer.from_pretrained(tmp)
    tok.padding_side = "right"
    return tok


def tiny_hunyuan_tokenizer(vocab_sizes: range = range(480, 700, 4)) -> Any:
    """A ``Qwen2Tokenizer`` (BPE on templated shapes captions) whose template prefix (`PREFIX`) is exactly
    `TEMPLATE_TOKENS` tokens: the first of `vocab_sizes` giving that count (raises if none does)."""
    counts = {}
    for v in vocab_sizes:
        tok = _tokenizer(v)
        n = len(tok(PREFIX).input_ids)
        if n == TEMPLATE_TOKENS:
            return tok
        counts[v] = n
    raise RuntimeError(
        f"no vocabulary size in {vocab_sizes} splits the template prefix into {TEMPLATE_TOKENS} tokens: {counts}"
    )


def tiny_qwen25_text_model(tokenizer: Any, hidden: int = 32, layers: int = 3) -> torch.nn.Module:
    """A random ``Qwen2_5_VLTextModel``: `layers` layers of width `hidden`, 2 heads, one KV head."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    quarter = hidden // 4
    return Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [quarter - 2 * (quarter // 3), quarter // 3, quarter // 3],
            },
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        )
    )


def tiny_byt5(tokenizer: Any, hidden: int = 16) -> torch.nn.Module:
    """A random one-layer ``T5EncoderModel`` of width `hidden` over `tokenizer`'s bytes (ByT5, tiny)."""
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
            feed_forward_proj="gated-gelu",
            is_encoder_decoder=False,
            use_cache=False,
        )
    )


def tiny_hunyuan_vae(latent_channels: int = 4) -> torch.nn.Module:
    """A random ``AutoencoderKLHunyuanVideo15``: 2x temporal, 4x spatial, ``scaling_factor`` 0.75."""
    from diffusers import AutoencoderKLHunyuanVideo15

    return AutoencoderKLHunyuanVideo15(
        latent_channels=latent_channels,
        block_out_channels=(8, 8, 16),
        layers_per_block=1,
        spatial_compression_ratio=4,
        temporal_compression_ratio=2,
        scaling_factor=0.75,
    )


def tiny_hunyuan_transformer(
    latent_channels: int = 4,
    text_hidden: int = 32,
    glyph_hidden: int = 16,
    num_layers: int = 1,
    task_type: str = "t2v",
) -> torch.nn.Module:
    """A random ``HunyuanVideo15Transformer3DModel`` (2 heads of 8, patch 1, RoPE axes 2/2/4, 16-wide image
    states) of `task_type` (``t2v`` or ``i2v``: the same network, as in the converted checkpoints)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    return HunyuanVideo15Transformer3DModel(
        in_channels=2 * latent_channels + 1,
        out_channels=latent_channels,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=num_layers,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=text_hidden,
        text_embed_2_dim=glyph_hidden,
        image_embed_dim=16,
        rope_axes_dim=(2, 2, 4),
        target_size=32,
        task_type=task_type,
    )


def tiny_hunyuan_video15_components(*, latent_channels: int = 4, seed: int = 0) -> HunyuanVideo15Components:
    """Random tiny HunyuanVideo 1.5 components (see the module docstring), deterministic for `seed`."""
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler
    from transformers import ByT5Tokenizer

    torch.manual_seed(seed)
    tokenizer = tiny_hunyuan_tokenizer()
    tokenizer_2 = ByT5Tokenizer()
    return HunyuanVideo15Components(
        transformer=tiny_hunyuan_transformer(latent_channels),
        vae=tiny_hunyuan_vae(latent_channels),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        text_encoder=tiny_qwen25_text_model(tokenizer),
        tokenizer=tokenizer,
        text_encoder_2=tiny_byt5(tokenizer_2),
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )


def tiny_siglip(hidden: int = 16, image_size: int = 32, patch: int = 8) -> tuple[torch.nn.Module, Any]:
    """(a random one-layer ``SiglipVisionModel`` of width `hidden` on `image_size` px in `patch` px patches, its
    ``SiglipImageProcessor`` resizing to that size): the tiny SigLIP of the image-to-video folder."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    model = SiglipVisionModel(
        SiglipVisionConfig(
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=image_size,
            patch_size=patch,
        )
    )
    return model, SiglipImageProcessor(size={"height": image_size, "width": image_size})


def tiny_hunyuan_video15_i2v_components(
    *, latent_channels: int = 4, seed: int = 0
) -> HunyuanVideo15ImageToVideoComponents:
    """Random tiny HunyuanVideo 1.5 image-to-video components: `tiny_hunyuan_video15_components`' parts (an
    ``i2v`` transformer) plus `tiny_siglip`, deterministic for `seed`."""
    from dataclasses import fields

    base = tiny_hunyuan_video15_components(latent_channels=latent_channels, seed=seed)
    base.transformer = tiny_hunyuan_transformer(latent_channels, task_type="i2v")
    image_encoder, feature_extractor = tiny_siglip(int(base.transformer.config.image_embed_dim))
    return HunyuanVideo15ImageToVideoComponents(
        **{f.name: getattr(base, f.name) for f in fields(base)},
        image_encoder=image_encoder,
        feature_extractor=feature_extractor,
    )


def build_tiny_hunyuan_video15_i2v(path: str | Path, *, latent_channels: int = 4, seed: int = 0) -> Path:
    """Write a random tiny HunyuanVideo 1.5 image-to-video folder at `path`
    (`tiny_hunyuan_video15_i2v_components`; ``model_index.json`` names ``HunyuanVideo15ImageToVideoPipeline``);
    returns `path`."""
    path = Path(path)
    tiny_hunyuan_video15_i2v_components(latent_channels=latent_channels, seed=seed).save_pretrained(path)
    return path


def build_tiny_hunyuan_video15(path: str | Path, *, latent_channels: int = 4, seed: int = 0) -> Path:
    """Write a random tiny HunyuanVideo 1.5 folder at `path` (`tiny_hunyuan_video15_components`); returns `path`."""
    path = Path(path)
    tiny_hunyuan_video15_components(latent_channels=latent_channels, seed=seed).save_pretrained(path)
    return path


@BUILDERS.register("hunyuan_video15_tiny", minutes=0.05)
def _build_random(path: Path) -> None:
    build_tiny_hunyuan_video15(path)


@BUILDERS.register("hunyuan_video15_i2v_tiny", minutes=0.05)
def _build_random_i2v(path: Path) -> None:
    build_tiny_hunyuan_video15_i2v(path)
