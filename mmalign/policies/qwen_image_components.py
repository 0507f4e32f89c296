"""The Qwen-Image folder loader and prompt encoding: `QwenImageComponents`, `load_qwen_image_components`,
`is_qwen_image_folder`, `encode_prompt`; and Qwen-Image-Edit's (`QwenImageEditComponents`,
`load_qwen_image_edit_components`, `is_qwen_image_edit_folder`, `encode_edit_prompt`).

Details: docs/extending.md, "`mmalign.policies.qwen_image_components`" (folder layout, prompt
encoding); the edit prompts: docs/algorithms.md, "Qwen-Image-Edit inputs", and docs/image_edit.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from mmalign.policies.diffusers_notices import quiet_diffusers_fp32_notice

quiet_diffusers_fp32_notice()  # diffusers' empty "should be kept in float32: []" notice (LoRA saves)

__all__ = [
    "CONDITION_IMAGE_PIXELS",
    "EDIT_PLUS_PIPELINES",
    "EDIT_PLUS_PROMPT_TEMPLATE",
    "EDIT_PROMPT_DROP",
    "EDIT_PROMPT_TEMPLATE",
    "PICTURE_TEMPLATE",
    "PROMPT_DROP",
    "PROMPT_TEMPLATE",
    "QWEN_IMAGE_MAX_SEQUENCE_LENGTH",
    "QwenImageComponents",
    "QwenImageEditComponents",
    "QwenImageEditPlusComponents",
    "condition_size",
    "edit_plus_prompt_inputs",
    "edit_prompt_inputs",
    "encode_edit_plus_prompt",
    "encode_edit_prompt",
    "encode_prompt",
    "is_qwen_image_edit_folder",
    "is_qwen_image_folder",
    "load_qwen_image_components",
    "load_qwen_image_edit_components",
    "load_qwen_image_edit_plus_components",
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
EDIT_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
"""``QwenImageEditPipeline.prompt_template_encode``: the chat turn holding the source image and the instruction."""
EDIT_PROMPT_DROP = 64
"""``QwenImageEditPipeline.prompt_template_encode_start_idx``: leading template tokens dropped from the states."""
EDIT_PLUS_PROMPT_TEMPLATE = EDIT_PROMPT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
"""``QwenImageEditPlusPipeline.prompt_template_encode``: the edit template whose user turn is the pictures (each
`PICTURE_TEMPLATE`) followed by the instruction."""
PICTURE_TEMPLATE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
"""One source image of a Qwen-Image-Edit-Plus user turn (numbered from 1)."""
CONDITION_IMAGE_PIXELS = 384 * 384
"""``pipeline_qwenimage_edit_plus.CONDITION_IMAGE_SIZE``: the area each source is resized to for the VLM."""
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
    text_encoder: torch.nn.Module,
    ids: Tensor,
    mask: Tensor,
    max_sequence_length: int,
    *,
    drop: int = PROMPT_DROP,
    **vision: Tensor,
) -> tuple[Tensor, Tensor]:
    """(states Float[B, max_sequence_length, D] in the encoder's dtype, mask Long[B, max_sequence_length]):
    the last hidden states of each sequence's valid tokens after the first `drop` (`PROMPT_DROP`; the edit
    template's `EDIT_PROMPT_DROP`), at most `max_sequence_length` of them, zero-padded (mask 0) to
    `max_sequence_length`. `vision`: the processor's ``pixel_values`` / ``image_grid_thw`` when the template holds
    an image. Runs with whatever grad mode the caller has (the tiny builder trains through it)."""
    hidden = text_encoder(
        input_ids=ids, attention_mask=mask, output_hidden_states=True, **vision
    ).hidden_states[-1]
    b = ids.shape[0]
    out = hidden.new_zeros((b, max_sequence_length, hidden.shape[-1]))
    valid = torch.zeros((b, max_sequence_length), dtype=torch.long, device=hidden.device)
    keep = mask.bool()
    for i in range(b):
        states = hidden[i][keep[i]][drop:][:max_sequence_length]
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


def edit_prompt_inputs(processor: Any, prompts: list[str], images: list[Any]) -> dict[str, Tensor]:
    """The processor's tensors (``input_ids``, ``attention_mask``, ``pixel_values``, ``image_grid_thw``) of each
    prompt in `EDIT_PROMPT_TEMPLATE` with its image (`images`: one PIL image per prompt), padded to the longest,
    as ``QwenImageEditPipeline._get_qwen_prompt_embeds`` calls it."""
    texts = [EDIT_PROMPT_TEMPLATE.format(p) for p in prompts]
    return dict(processor(text=texts, images=list(images), padding=True, return_tensors="pt"))


def image_tokens(processor: Any, grid_thw: Tensor) -> Tensor:
    """Long[N]: the merged vision tokens of each image of `grid_thw` [N, 3] (t h w / merge_size^2), what the
    processor expands each ``<|image_pad|>`` to."""
    merge = int(getattr(processor.image_processor, "merge_size", 2))
    return grid_thw.prod(dim=-1) // merge**2


@torch.no_grad()
def encode_edit_prompt(
    text_encoder: torch.nn.Module,
    processor: Any,
    prompts: list[str],
    images: list[Any],
    device: torch.device | str = "cpu",
    max_sequence_length: int = QWEN_IMAGE_MAX_SEQUENCE_LENGTH,
) -> tuple[Tensor, Tensor]:
    """(prompt_embeds Float[B, L, D], prompt_mask Long[B, L]) of `prompts` each read with its image (`images`, PIL,
    one per prompt) by Qwen2.5-VL (`edit_prompt_inputs`, then `prompt_states` dropping `EDIT_PROMPT_DROP`):
    ``QwenImageEditPipeline``'s states, padded to L = the images' vision tokens (the most of the batch) +
    `max_sequence_length`, longer ones truncated (the pipeline never truncates)."""
    if len(images) != len(prompts):
        raise ValueError(f"one image per prompt: {len(prompts)} prompts, {len(images)} images")
    if max_sequence_length < 1:
        raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
    inputs = edit_prompt_inputs(processor, prompts, images)
    dev = next(text_encoder.parameters()).device
    dtype = next(text_encoder.parameters()).dtype
    length = int(image_tokens(processor, inputs["image_grid_thw"]).max()) + max_sequence_length
    states, valid = prompt_states(
        text_encoder,
        inputs["input_ids"].to(dev),
        inputs["attention_mask"].to(dev),
        length,
        drop=EDIT_PROMPT_DROP,
        pixel_values=inputs["pixel_values"].to(dev, dtype),
        image_grid_thw=inputs["image_grid_thw"].to(dev),
    )
    return states.to(device), valid.to(device)


def condition_size(width: int, height: int, area: int = CONDITION_IMAGE_PIXELS) -> tuple[int, int]:
    """(width, height) of about `area` pixels with the aspect ratio width / height, each rounded to a multiple of
    32: the pipelines' ``calculate_dimensions``."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    h = w / ratio
    return round(w / 32) * 32, round(h / 32) * 32


def edit_plus_prompt_inputs(processor: Any, prompts: list[str], images: list[list[Any]]) -> dict[str, Tensor]:
    """The processor's tensors of each prompt in `EDIT_PLUS_PROMPT_TEMPLATE` after its pictures (`images`: one list
    of PIL images per prompt, each a `PICTURE_TEMPLATE`), padded to the longest, as
    ``QwenImageEditPlusPipeline._get_qwen_prompt_embeds`` builds them."""
    texts = [
        EDIT_PLUS_PROMPT_TEMPLATE.format("".join(PICTURE_TEMPLATE.format(j + 1) for j in range(len(ims))) + p)
        for p, ims in zip(prompts, images, strict=True)
    ]
    flat = [im for ims in images for im in ims]
    return dict(processor(text=texts, images=flat, padding=True, return_tensors="pt"))


@torch.no_grad()
def encode_edit_plus_prompt(
    text_encoder: torch.nn.Module,
    processor: Any,
    prompts: list[str],
    images: list[list[Any]],
    device: torch.device | str = "cpu",
    max_sequence_length: int = QWEN_IMAGE_MAX_SEQUENCE_LENGTH,
) -> tuple[Tensor, Tensor]:
    """(prompt_embeds Float[B, L, D], prompt_mask Long[B, L]) of `prompts` each read with its pictures (`images`: a
    list of PIL images per prompt, already at their condition size) by Qwen2.5-VL (`edit_plus_prompt_inputs`, then
    `prompt_states` dropping `EDIT_PROMPT_DROP`): ``QwenImageEditPlusPipeline``'s states, padded to L = the most
    tokens a prompt's pictures take (their ``Picture k:`` labels and vision tokens) + `max_sequence_length` (the
    instruction's), longer ones truncated."""
    if len(images) != len(prompts):
        raise ValueError(f"one list of images per prompt: {len(prompts)} prompts, {len(images)} lists")
    if max_sequence_length < 1:
        raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
    inputs = edit_plus_prompt_inputs(processor, prompts, images)
    dev = next(text_encoder.parameters()).device
    dtype = next(text_encoder.parameters()).dtype
    per_image = image_tokens(processor, inputs["image_grid_thw"]).tolist()
    counts, start = [], 0
    for ims in images:
        # the labels' tokens with one <|image_pad|> per picture, which the processor expands to its vision tokens
        labels = "".join(PICTURE_TEMPLATE.format(j + 1) for j in range(len(ims)))
        vision = sum(per_image[start : start + len(ims)])
        counts.append(len(processor.tokenizer(labels).input_ids) - len(ims) + vision)
        start += len(ims)
    states, valid = prompt_states(
        text_encoder,
        inputs["input_ids"].to(dev),
        inputs["attention_mask"].to(dev),
        int(max(counts)) + max_sequence_length,
        drop=EDIT_PROMPT_DROP,
        pixel_values=inputs["pixel_values"].to(dev, dtype),
        image_grid_thw=inputs["image_grid_thw"].to(dev),
    )
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

    pipeline_class: ClassVar[str] = "QwenImagePipeline"
    """The diffusers pipeline ``model_index.json`` names."""
    parts: ClassVar[tuple[str, ...]] = PARTS
    """The subfolders `save_pretrained` writes."""

    def save_pretrained(self, path: str | Path, *, transformer: torch.nn.Module | None = None) -> None:
        """Write every component to its subfolder of `path` (`transformer` overrides the one saved, e.g. a
        merged LoRA copy) and a ``model_index.json`` for diffusers' ``from_pretrained`` of `pipeline_class`."""
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


@dataclass
class QwenImageEditComponents(QwenImageComponents):
    """The loaded pieces of a Qwen-Image-Edit folder: Qwen-Image's plus ``processor`` (a ``Qwen2VLProcessor``)."""

    processor: Any = None
    pipeline_class: ClassVar[str] = "QwenImageEditPipeline"
    parts: ClassVar[tuple[str, ...]] = (*PARTS, "processor")

    def encode_edit_prompt(
        self,
        prompts: list[str],
        images: list[Any],
        device: torch.device | str = "cpu",
        *,
        max_sequence_length: int = QWEN_IMAGE_MAX_SEQUENCE_LENGTH,
    ) -> tuple[Tensor, Tensor]:
        """`encode_edit_prompt` with this folder's text encoder and processor."""
        return encode_edit_prompt(
            self.text_encoder, self.processor, prompts, images, device, max_sequence_length
        )


@dataclass
class QwenImageEditPlusComponents(QwenImageEditComponents):
    """The loaded pieces of a Qwen-Image-Edit-Plus folder (Qwen-Image-Edit-2509 / 2511): Qwen-Image-Edit's, saved
    as a ``QwenImageEditPlusPipeline``, read with several pictures (`encode_edit_plus_prompt`)."""

    pipeline_class: ClassVar[str] = "QwenImageEditPlusPipeline"

    def encode_edit_plus_prompt(
        self,
        prompts: list[str],
        images: list[list[Any]],
        device: torch.device | str = "cpu",
        *,
        max_sequence_length: int = QWEN_IMAGE_MAX_SEQUENCE_LENGTH,
    ) -> tuple[Tensor, Tensor]:
        """`encode_edit_plus_prompt` with this folder's text encoder and processor."""
        return encode_edit_plus_prompt(
            self.text_encoder, self.processor, prompts, images, device, max_sequence_length
        )


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
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

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
        # QwenImagePipeline's tokenizer class: AutoTokenizer would also look for tokenizer/config.json, which a
        # downloaded hub snapshot lacks, and fail offline (HF_HUB_OFFLINE=1) although the tokenizer is cached
        tokenizer=Qwen2Tokenizer.from_pretrained(path, subfolder="tokenizer"),
    )


EDIT_PIPELINES = ("QwenImageEditPipeline",)
"""The ``model_index.json`` pipeline classes `QwenImageEditComponents` reproduces (``QwenImageEditPlusPipeline``,
of Qwen-Image-Edit-2509 / 2511, reads its images differently: `EDIT_PLUS_PIPELINES`)."""
EDIT_PLUS_PIPELINES = ("QwenImageEditPlusPipeline",)
"""The ``model_index.json`` pipeline classes `QwenImageEditPlusComponents` reproduces."""


def _pipeline_class(name_or_path: str | Path) -> str | None:
    """``_class_name`` of the folder's ``model_index.json`` (None without one)."""
    index = Path(name_or_path) / "model_index.json"
    return json.loads(index.read_text()).get("_class_name") if index.is_file() else None


def is_qwen_image_edit_folder(name_or_path: str | Path) -> bool:
    """Whether `name_or_path` is a Qwen-Image-Edit model: for a local folder, its ``model_index.json`` names a
    ``QwenImageEdit*`` pipeline; for anything else (a hub id; nothing is fetched to decide) whether the name
    contains "qwen-image-edit" or "qwen_image_edit" (case-insensitive)."""
    p = Path(name_or_path)
    if p.is_dir():
        return str(_pipeline_class(p) or "").startswith("QwenImageEdit")
    name = str(name_or_path).lower()
    return "qwen-image-edit" in name or "qwen_image_edit" in name


def load_qwen_image_edit_components(
    path: str | Path, *, dtype: torch.dtype = torch.float32
) -> QwenImageEditComponents:
    """`load_qwen_image_components` plus the folder's ``processor/`` (``Qwen2VLProcessor``). A folder whose
    ``model_index.json`` names another pipeline than `EDIT_PIPELINES` (``QwenImageEditPlusPipeline``) is refused."""
    _check_pipeline(path, EDIT_PIPELINES, "Qwen-Image-Edit policy", "Qwen/Qwen-Image-Edit")
    return QwenImageEditComponents(**_edit_parts(path, dtype))


def load_qwen_image_edit_plus_components(
    path: str | Path, *, dtype: torch.dtype = torch.float32
) -> QwenImageEditPlusComponents:
    """As `load_qwen_image_edit_components`, for a folder whose ``model_index.json`` names one of
    `EDIT_PLUS_PIPELINES` (Qwen-Image-Edit-2509 / 2511); another pipeline is refused."""
    _check_pipeline(
        path, EDIT_PLUS_PIPELINES, "Qwen-Image-Edit-Plus policy", "Qwen/Qwen-Image-Edit-2509 or -2511"
    )
    return QwenImageEditPlusComponents(**_edit_parts(path, dtype))


def _check_pipeline(path: str | Path, allowed: tuple[str, ...], who: str, example: str) -> None:
    from diffusers import DiffusionPipeline

    index = DiffusionPipeline.load_config(str(path))
    if index.get("_class_name") not in allowed:
        raise ValueError(
            f"{path}/model_index.json names {index.get('_class_name')!r}; the {who} reproduces "
            f"{', '.join(allowed)} ({example})"
        )


def _edit_parts(path: str | Path, dtype: torch.dtype) -> dict[str, Any]:
    """The Qwen-Image parts of an edit folder plus its ``processor/`` (``Qwen2VLProcessor``), by field name."""
    from transformers import Qwen2Tokenizer, Qwen2VLProcessor

    base = load_qwen_image_components(path, dtype=dtype)
    local = Path(path).is_dir()
    source = str(Path(path) / "processor") if local else str(path)
    where = {} if local else {"subfolder": "processor"}
    # the tokenizer by its class, handed in: the processor would load it with AutoTokenizer, which also looks for
    # processor/config.json (absent from a downloaded hub snapshot) and fails offline although everything is cached
    tokenizer = Qwen2Tokenizer.from_pretrained(source, **where)
    processor = Qwen2VLProcessor.from_pretrained(source, tokenizer=tokenizer, **where)
    return {**{name: getattr(base, name) for name in PARTS}, "processor": processor}
