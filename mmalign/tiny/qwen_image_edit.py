"""A tiny Qwen-Image-Edit pipeline built offline from config kwargs (`mmalign.policies.qwen_image_edit`).

Builder ``qwen_image_edit_tiny`` (`build_tiny_qwen_image_edit`): a random ``Qwen/Qwen-Image-Edit``-layout folder.

Details: docs/image_edit.md, "mmalign.tiny.qwen_image_edit".
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from mmalign.policies.qwen_image_components import (
    EDIT_PROMPT_DROP,
    EDIT_PROMPT_TEMPLATE,
    QwenImageEditComponents,
)
from mmalign.tiny import BUILDERS, train_bpe_tokenizer

__all__ = [
    "IMAGE_PIXELS",
    "build_tiny_qwen_image_edit",
    "tiny_edit_processor",
    "tiny_edit_text_encoder",
    "tiny_edit_tokenizer",
    "tiny_qwen_image_edit_components",
]

IMAGE_PIXELS = 56 * 56
"""``min_pixels`` = ``max_pixels`` of the tiny image processor: every source becomes 56 x 56 pixels for the VLM
(4 x 4 patches of 14, merged 2 x 2: 4 vision tokens)."""


def _texts() -> list[str]:
    """Edit instructions and shapes captions in the edit template (the tokenizer's training text)."""
    from mmalign.tiny.image_edit import edit_examples
    from mmalign.tiny.qwen_image import shape_captions

    words = sorted({e.instruction for e in edit_examples()}) + shape_captions()
    return [EDIT_PROMPT_TEMPLATE.format(w) for w in words] * 2


def tiny_edit_tokenizer(vocab_size: int = 512) -> Any:
    """A ``Qwen2Tokenizer`` with Qwen2-VL's special tokens; raises if the edit template's part before the image is
    not the `EDIT_PROMPT_DROP` tokens ``QwenImageEditPipeline`` drops."""
    from transformers import Qwen2Tokenizer

    from mmalign.tiny.vlm import VLM_SPECIALS

    fast = train_bpe_tokenizer(_texts(), vocab_size=vocab_size, extra_special=VLM_SPECIALS)
    with tempfile.TemporaryDirectory() as tmp:
        fast.save_pretrained(tmp)
        tok = Qwen2Tokenizer.from_pretrained(tmp)
    prefix = EDIT_PROMPT_TEMPLATE.split("<|vision_start|>")[0]
    n = len(tok(prefix).input_ids)
    if n != EDIT_PROMPT_DROP:
        raise RuntimeError(
            f"the tiny edit tokenizer splits the template's part before the image into {n} tokens; the pipeline "
            f"drops {EDIT_PROMPT_DROP} (change vocab_size)"
        )
    return tok


def tiny_edit_processor(tokenizer: Any) -> Any:
    """A ``Qwen2VLProcessor`` of `tokenizer` whose image processor resizes every image to `IMAGE_PIXELS`."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=IMAGE_PIXELS, max_pixels=IMAGE_PIXELS),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(min_pixels=IMAGE_PIXELS, max_pixels=4 * IMAGE_PIXELS),
    )


def tiny_edit_text_encoder(tokenizer: Any, hidden: int = 32) -> torch.nn.Module:
    """`mmalign.tiny.qwen_image.tiny_qwen_vl` with its config's image / video / vision-start / vision-end token
    ids set to `tokenizer`'s (the model reads them from its config at every call)."""
    from mmalign.tiny.qwen_image import tiny_qwen_vl
    from mmalign.tiny.vlm import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START

    model = tiny_qwen_vl(tokenizer, hidden)
    ids = {
        "image_token_id": IMAGE_PAD,
        "video_token_id": VIDEO_PAD,
        "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
    }
    for key, token in ids.items():
        setattr(model.config, key, tokenizer.convert_tokens_to_ids(token))
    return model


def tiny_qwen_image_edit_components(
    *, z_dim: int = 4, text_hidden: int = 32, num_layers: int = 2, seed: int = 0
) -> QwenImageEditComponents:
    """Random tiny Qwen-Image-Edit components (see the module docstring), deterministic for `seed`."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from mmalign.tiny.qwen_image import QWEN_SCHEDULER, tiny_qwen_transformer, tiny_qwen_vae

    torch.manual_seed(seed)
    tokenizer = tiny_edit_tokenizer()
    return QwenImageEditComponents(
        transformer=tiny_qwen_transformer(z_dim, text_hidden, num_layers=num_layers),
        vae=tiny_qwen_vae(z_dim),
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER),
        text_encoder=tiny_edit_text_encoder(tokenizer, text_hidden),
        tokenizer=tokenizer,
        processor=tiny_edit_processor(tokenizer),
    )


def build_tiny_qwen_image_edit(
    path: str | Path, *, z_dim: int = 4, text_hidden: int = 32, num_layers: int = 2, seed: int = 0
) -> Path:
    """Write a random tiny Qwen-Image-Edit folder at `path` (`tiny_qwen_image_edit_components`); returns `path`."""
    path = Path(path)
    tiny_qwen_image_edit_components(
        z_dim=z_dim, text_hidden=text_hidden, num_layers=num_layers, seed=seed
    ).save_pretrained(path)
    return path


@BUILDERS.register("qwen_image_edit_tiny", minutes=0.05)
def _build_random(path: Path) -> None:
    build_tiny_qwen_image_edit(path)
