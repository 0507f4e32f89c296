"""A tiny Z-Image pipeline built offline from config kwargs (`mmalign.policies.z_image`).

Builder ``z_image_tiny`` (`build_tiny_z_image`): a random ``Tongyi-MAI/Z-Image-Turbo``-layout folder.

Details: docs/architecture.md, "mmalign.tiny.z_image".
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from mmalign.policies.z_image_components import ZImageComponents
from mmalign.tiny import BUILDERS, train_bpe_tokenizer

__all__ = [
    "QWEN3_CHAT_TEMPLATE",
    "Z_IMAGE_SCHEDULER",
    "build_tiny_z_image",
    "tiny_qwen3_encoder",
    "tiny_qwen3_tokenizer",
    "tiny_z_image_components",
    "tiny_z_image_transformer",
    "tiny_z_image_vae",
]

Z_IMAGE_SCHEDULER: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}
"""``Tongyi-MAI/Z-Image-Turbo``'s ``scheduler/scheduler_config.json``."""
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
"""What Qwen3's chat template renders for plain user turns and the generation prompt (an empty think block only
when ``enable_thinking`` is false)."""
SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def tiny_qwen3_tokenizer(vocab_size: int = 384) -> Any:
    """A ``Qwen2Tokenizer`` (BPE trained on shapes captions in the chat turn) with `QWEN3_CHAT_TEMPLATE`."""
    from transformers import Qwen2Tokenizer

    from mmalign.tiny.qwen_image import shape_captions

    texts = [f"<|im_start|>user\n{c}<|im_end|>\n<|im_start|>assistant\n" for c in shape_captions()] * 2
    fast = train_bpe_tokenizer(texts, vocab_size=vocab_size, extra_special=SPECIALS)
    fast.chat_template = QWEN3_CHAT_TEMPLATE
    with tempfile.TemporaryDirectory() as tmp:
        fast.save_pretrained(tmp)
        return Qwen2Tokenizer.from_pretrained(tmp)


def tiny_qwen3_encoder(tokenizer: Any, hidden: int = 32, layers: int = 2) -> torch.nn.Module:
    """A random ``Qwen3Model``: `layers` layers of width `hidden`, 2 heads of 16, one KV head."""
    from transformers import Qwen3Config, Qwen3Model

    return Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=1024,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            bos_token_id=None,
        )
    )


def tiny_z_image_vae(latent_channels: int = 4) -> torch.nn.Module:
    """A random ``AutoencoderKL`` with one 2x downsample and FLUX.1's latent scaling and shift."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def tiny_z_image_transformer(
    latent_channels: int = 4, text_hidden: int = 32, *, dim: int = 32, num_layers: int = 2
) -> torch.nn.Module:
    """A random ``ZImageTransformer2DModel``: patch 2, width `dim` in 2 heads, `num_layers` main layers and one
    noise and one context refiner layer, caption features of width `text_hidden`."""
    from diffusers import ZImageTransformer2DModel

    head = dim // 2
    rest = 2 * (head // 6)
    return ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=latent_channels,
        dim=dim,
        n_layers=num_layers,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=text_hidden,
        axes_dims=[head - 2 * rest, rest, rest],
        axes_lens=[1024, 64, 64],
    )


def tiny_z_image_components(
    *, latent_channels: int = 4, text_hidden: int = 32, num_layers: int = 2, seed: int = 0
) -> ZImageComponents:
    """Random tiny Z-Image components (see the module docstring), deterministic for `seed`."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    torch.manual_seed(seed)
    tokenizer = tiny_qwen3_tokenizer()
    return ZImageComponents(
        transformer=tiny_z_image_transformer(latent_channels, text_hidden, num_layers=num_layers),
        vae=tiny_z_image_vae(latent_channels),
        scheduler=FlowMatchEulerDiscreteScheduler(**Z_IMAGE_SCHEDULER),
        text_encoder=tiny_qwen3_encoder(tokenizer, text_hidden),
        tokenizer=tokenizer,
    )


def build_tiny_z_image(
    path: str | Path, *, latent_channels: int = 4, text_hidden: int = 32, num_layers: int = 2, seed: int = 0
) -> Path:
    """Write a random tiny Z-Image folder at `path` (`tiny_z_image_components`); returns `path`."""
    path = Path(path)
    tiny_z_image_components(
        latent_channels=latent_channels, text_hidden=text_hidden, num_layers=num_layers, seed=seed
    ).save_pretrained(path)
    return path


@BUILDERS.register("z_image_tiny", minutes=0.05)
def _build_random(path: Path) -> None:
    build_tiny_z_image(path)
