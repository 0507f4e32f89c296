"""Tiny random FLUX.2 folders (``Flux2Pipeline`` [dev] and ``Flux2KleinPipeline`` [klein]) built from config kwargs.

Details: docs/architecture.md, "mmalign.tiny.flux2".
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from mmalign.policies.flux2_components import (
    DEV_PIPELINE,
    DEV_TEXT_LAYERS,
    KLEIN_PIPELINE,
    KLEIN_TEXT_LAYERS,
    Flux2Components,
)
from mmalign.tiny import BUILDERS, train_bpe_tokenizer

__all__ = [
    "FLUX2_SCHEDULER",
    "MISTRAL_CHAT_TEMPLATE",
    "QWEN3_CHAT_TEMPLATE",
    "build_tiny_flux2",
    "tiny_flux2_components",
    "tiny_flux2_transformer",
    "tiny_flux2_vae",
]

FLUX2_SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
"""The scheduler settings of the FLUX.2 folders (the pipelines pass their own mu, so only the kind matters)."""
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)
"""A Mistral-Small-3.x-style chat template (system and user turns, text parts of list contents)."""
MISTRAL_SPECIALS = [
    "<s>",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[INST]",
    "[/INST]",
]
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
"""A Qwen3-style chat template (``enable_thinking=False`` adds the empty think block)."""
QWEN3_SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def _captions() -> list[str]:
    from mmalign.tiny.shapes import shapes_rows

    rows = shapes_rows(None, counts=(1, 2, 3, 4), positions=("left", "right", "top", "bottom", None))
    return [str(r["prompt"]) for r in rows]


def tiny_mistral_processor(vocab_size: int = 512) -> Any:
    """A ``PixtralProcessor``: a BPE trained on the FLUX.2 system message and the shapes captions, Mistral's
    special tokens and `MISTRAL_CHAT_TEMPLATE`."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import PixtralImageProcessor, PixtralProcessor

    fast = train_bpe_tokenizer([SYSTEM_MESSAGE] * 8 + _captions() * 2, vocab_size, MISTRAL_SPECIALS)
    fast.bos_token = "<s>"
    fast.chat_template = None
    return PixtralProcessor(
        image_processor=PixtralImageProcessor(patch_size=16),
        tokenizer=fast,
        chat_template=MISTRAL_CHAT_TEMPLATE,
        patch_size=16,
        spatial_merge_size=2,
    )


def tiny_qwen3_tokenizer(vocab_size: int = 384) -> Any:
    """A Qwen2 tokenizer (BPE on the shapes captions) with `QWEN3_CHAT_TEMPLATE`."""
    from transformers import AutoTokenizer

    fast = train_bpe_tokenizer(_captions() * 2, vocab_size, QWEN3_SPECIALS)
    fast.chat_template = QWEN3_CHAT_TEMPLATE
    with tempfile.TemporaryDirectory() as tmp:
        fast.save_pretrained(tmp)
        return AutoTokenizer.from_pretrained(tmp)


def tiny_mistral3(tokenizer: Any, hidden: int = 16, layers: int = max(DEV_TEXT_LAYERS)) -> torch.nn.Module:
    """A random ``Mistral3ForConditionalGeneration``: `layers` text layers of width `hidden`, a one-layer Pixtral
    vision tower."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tok = tokenizer.tokenizer
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": len(tok),
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "max_position_embeddings": 1024,
            "num_attention_heads": 2,
            "num_hidden_layers": layers,
            "num_key_value_heads": 1,
            "head_dim": hidden // 2,
            "sliding_window": None,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 32,
            "image_size": 32,
            "patch_size": 16,
            "num_channels": 3,
        },
        image_token_index=tok.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
        vision_feature_layer=-1,
    )
    return Mistral3ForConditionalGeneration(config)


def tiny_qwen3(tokenizer: Any, hidden: int = 16, layers: int = max(KLEIN_TEXT_LAYERS)) -> torch.nn.Module:
    """A random ``Qwen3ForCausalLM`` of `layers` layers of width `hidden`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=hidden // 2,
            max_position_embeddings=1024,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            bos_token_id=None,
            tie_word_embeddings=True,
        )
    )


def tiny_flux2_vae(latent_channels: int = 4, sample_size: int = 32) -> torch.nn.Module:
    """A random ``AutoencoderKLFlux2`` with one 2x downsample and made-up batch-norm statistics (so that
    decoding's un-normalisation is not the identity)."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        sample_size=sample_size,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
    )
    n = 4 * latent_channels
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.2, 0.2, n))
        vae.bn.running_var.copy_(torch.linspace(0.5, 1.5, n))
    return vae


def tiny_flux2_transformer(
    latent_channels: int = 4, text_hidden: int = 16, *, guidance_embeds: bool = True, layers: int = 1
) -> torch.nn.Module:
    """A random ``Flux2Transformer2DModel``: `layers` double- and single-stream blocks, 2 heads of 16, RoPE
    axes (4, 4, 4, 4), ``joint_attention_dim`` 3 x `text_hidden` (three stacked encoder layers)."""
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * latent_channels,
        num_layers=layers,
        num_single_layers=layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * text_hidden,
        timestep_guidance_channels=256,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds,
    )


def tiny_flux2_components(
    *,
    klein: bool = False,
    is_distilled: bool = False,
    latent_channels: int = 4,
    text_hidden: int = 16,
    seed: int = 0,
) -> Flux2Components:
    """Random tiny FLUX.2 components (see the module docstring), deterministic for `seed`."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    torch.manual_seed(seed)
    if klein:
        tokenizer = tiny_qwen3_tokenizer()
        text_encoder = tiny_qwen3(tokenizer, text_hidden)
    else:
        tokenizer = tiny_mistral_processor()
        text_encoder = tiny_mistral3(tokenizer, text_hidden)
    return Flux2Components(
        transformer=tiny_flux2_transformer(latent_channels, text_hidden, guidance_embeds=not klein),
        vae=tiny_flux2_vae(latent_channels),
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        pipeline=KLEIN_PIPELINE if klein else DEV_PIPELINE,
        is_distilled=is_distilled,
    )


def build_tiny_flux2(path: str | Path, **kwargs: Any) -> Path:
    """Write a random tiny FLUX.2 folder at `path` (`tiny_flux2_components` keywords); returns `path`."""
    path = Path(path)
    tiny_flux2_components(**kwargs).save_pretrained(path)
    return path


@BUILDERS.register("flux2_tiny", minutes=0.05)
def _build_dev(path: Path) -> None:
    build_tiny_flux2(path)


@BUILDERS.register("flux2_klein_tiny", minutes=0.05)
def _build_klein(path: Path) -> None:
    build_tiny_flux2(path, klein=True)
