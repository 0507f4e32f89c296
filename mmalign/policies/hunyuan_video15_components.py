"""The HunyuanVideo 1.5 folder loader and prompt encoding: `HunyuanVideo15Components`,
`load_hunyuan_video15_components`, `encode_prompt`, `encode_glyphs`, `glyph_text`, `hunyuan_video15_velocity`;
for image to video (``HunyuanVideo15ImageToVideoPipeline``) `HunyuanVideo15ImageToVideoComponents`,
`load_hunyuan_video15_i2v_components`, `encode_image` (SigLIP states) and `encode_first_frame` (VAE latents).

Details: docs/video.md, "`mmalign.policies.hunyuan_video15_components`" (folder layout, prompt
states) and "HunyuanVideo 1.5 (text to video)" (the network call).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from mmalign.policies.diffusers_notices import quiet_diffusers_fp32_notice

quiet_diffusers_fp32_notice()

__all__ = [
    "GLYPH_MAX_LENGTH",
    "IMAGE_TOKENS",
    "MAX_SEQUENCE_LENGTH",
    "SYSTEM_MESSAGE",
    "TEMPLATE_TOKENS",
    "HunyuanVideo15Components",
    "HunyuanVideo15ImageToVideoComponents",
    "encode_first_frame",
    "encode_glyphs",
    "encode_image",
    "encode_prompt",
    "glyph_text",
    "hunyuan_video15_velocity",
    "load_hunyuan_video15_components",
    "load_hunyuan_video15_i2v_components",
    "trim_padding",
]

MAX_SEQUENCE_LENGTH = 1000
"""Prompt tokens after the system turn (``HunyuanVideo15Pipeline.tokenizer_max_length``)."""
GLYPH_MAX_LENGTH = 256
"""ByT5 tokens of the glyph text (``tokenizer_2_max_length``)."""
IMAGE_TOKENS = 729
"""Image-state tokens the transformer receives (``vision_num_semantic_tokens``; all zero and masked for text to
video, so fewer change nothing but the compute)."""
TEMPLATE_TOKENS = 108
"""Tokens of the chat template's system turn (and the user turn's opening) that the pipeline drops
(``prompt_template_encode_start_idx``)."""
SKIP_LAYERS = 2
"""The prompt states are ``hidden_states[-(SKIP_LAYERS + 1)]``."""
_ASPECTS = (
    "1. The main content and theme of the video.",
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects.",
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects.",
    "4. background environment, light, style and atmosphere.",
    "5. camera angles, movements, and transitions used in the video.",
)
SYSTEM_MESSAGE = (" " * 9).join(
    ("You are a helpful assistant. Describe the video by detailing the following aspects:", *_ASPECTS)
)
"""The system turn HunyuanVideo 1.5 was trained with (``HunyuanVideo15Pipeline.system_message``, nine spaces
between its items as the pipeline's source renders them)."""
PARTS = (
    "transformer",
    "vae",
    "scheduler",
    "text_encoder",
    "tokenizer",
    "text_encoder_2",
    "tokenizer_2",
    "guider",
)
_QUOTED = re.compile(r"\"(.*?)\"|“(.*?)”")


def glyph_text(prompt: str) -> str | None:
    """The text a prompt asks to render, as the pipeline gives it to ByT5: every span in straight or curly double
    quotes (repeats dropped when there are several), written ``Text "a". Text "b". ``; None without quotes."""
    spans = [a or b for a, b in _QUOTED.findall(prompt)]
    if len(spans) > 1:
        spans = list(dict.fromkeys(spans))
    if not spans:
        return None
    return "".join(f'Text "{s}". ' for s in spans)


@torch.no_grad()
def encode_prompt(
    text_encoder: torch.nn.Module,
    tokenizer: Any,
    prompts: list[str],
    device: torch.device | str = "cpu",
    max_sequence_length: int = MAX_SEQUENCE_LENGTH,
) -> tuple[Tensor, Tensor]:
    """(prompt_embeds Float[B, max_sequence_length, D] in the encoder's dtype, prompt_mask Long[B,
    max_sequence_length]): the third-to-last hidden states of the templated prompts without the system turn (see
    the module docstring). Padding positions keep the encoder's states; the mask marks them 0."""
    if max_sequence_length < 1:
        raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
    chats = [
        [{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": p or " "}]
        for p in prompts
    ]
    tok = tokenizer.apply_chat_template(
        chats,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        padding="max_length",
        max_length=max_sequence_length + TEMPLATE_TOKENS,
        truncation=True,
        return_tensors="pt",
    )
    dev = next(text_encoder.parameters()).device
    mask = tok["attention_mask"].to(dev)
    states = text_encoder(
        input_ids=tok["input_ids"].to(dev), attention_mask=mask, output_hidden_states=True
    ).hidden_states[-(SKIP_LAYERS + 1)]
    return states[:, TEMPLATE_TOKENS:].to(device), mask[:, TEMPLATE_TOKENS:].long().to(device)


@torch.no_grad()
def encode_glyphs(
    text_encoder: torch.nn.Module,
    tokenizer: Any,
    prompts: list[str],
    device: torch.device | str = "cpu",
    glyph_max_length: int = GLYPH_MAX_LENGTH,
) -> tuple[Tensor, Tensor]:
    """(glyph_embeds Float[B, glyph_max_length, D], glyph_mask Long[B, glyph_max_length]): ByT5's last hidden
    states of each prompt's `glyph_text` (padded / truncated to `glyph_max_length`), zeros and a zero mask for a
    prompt without quoted text."""
    if glyph_max_length < 1:
        raise ValueError(f"glyph_max_length must be >= 1, got {glyph_max_length}")
    dev = next(text_encoder.parameters()).device
    width = int(text_encoder.config.d_model)
    states, masks = [], []
    for p in prompts:
        text = glyph_text(p)
        if text is None:
            states.append(torch.zeros(glyph_max_length, width, dtype=text_encoder.dtype, device=dev))
            masks.append(torch.zeros(glyph_max_length, dtype=torch.long, device=dev))
            continue
        tok = tokenizer(
            text,
            padding="max_length",
            max_length=glyph_max_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        ).to(dev)
        states.append(text_encoder(input_ids=tok.input_ids, attention_mask=tok.attention_mask.float())[0][0])
        masks.append(tok.attention_mask[0].long())
    return torch.stack(states).to(device), torch.stack(masks).to(device)


def trim_padding(states: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(`states`[:, :n], `mask`[:, :n]) with n the positions up to the last one any sample's `mask` [B, L] keeps
    (at least one)."""
    kept = mask.bool().any(dim=0).nonzero()
    n = int(kept[-1]) + 1 if len(kept) else 1
    return states[:, :n], mask[:, :n]


@torch.no_grad()
def encode_image(image_encoder: torch.nn.Module, feature_extractor: Any, images: Tensor) -> Tensor:
    """Float[B, N, D] in the encoder's dtype: ``HunyuanVideo15ImageToVideoPipeline._get_image_embeds``, the last
    hidden states of the SigLIP vision tower on `feature_extractor`'s input (resized to the encoder's size) of
    first frames Float[B, 3, H, W] in [0, 1], handed over as uint8 arrays as a PIL image of the same pixels is."""
    arrays = [(im.permute(1, 2, 0).clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy() for im in images]
    param = next(image_encoder.parameters())
    inputs = feature_extractor(images=arrays, do_resize=True, return_tensors="pt", do_convert_rgb=True)
    pixels = inputs["pixel_values"].to(device=param.device, dtype=param.dtype)
    return image_encoder(pixel_values=pixels).last_hidden_state


@torch.no_grad()
def encode_first_frame(vae: torch.nn.Module, images: Tensor) -> Tensor:
    """Float[B, C, 1, h, w] (fp32): ``HunyuanVideo15ImageToVideoPipeline._get_image_latents``, the VAE posterior
    mode of first frames Float[B, 3, H, W] in [0, 1] (as [-1, 1] one-frame clips) times ``scaling_factor``, one
    image per call as the pipeline encodes (the VAE's mid-block attention mask assumes a batch of one)."""
    param = next(vae.parameters())
    clips = (images.float() * 2 - 1)[:, :, None].to(device=param.device, dtype=param.dtype)
    latents = torch.cat([vae.encode(clip[None]).latent_dist.mode() for clip in clips])
    return (latents * float(vae.config.scaling_factor)).float()


def hunyuan_video15_velocity(
    model: torch.nn.Module,
    latents: Tensor,
    sigmas: Tensor,
    cond: dict[str, Tensor],
    num_train_timesteps: int,
    *,
    image_tokens: int = 1,
    trim: bool = True,
) -> Tensor:
    """Float[B, C, F, h, w]: the flow velocity of one ``HunyuanVideo15Transformer3DModel`` call at video latents
    [B, C, F, h, w] and noise levels `sigmas` Float[B]. Text to video: the channels [latents, zeros, zero mask],
    the timestep sigma * `num_train_timesteps` in the transformer's dtype, `image_tokens` all-zero image states
    (masked out by the transformer: the pipeline's `IMAGE_TOKENS` give the same velocity), the prompt and glyph
    states and masks of `cond` (``prompt_embeds``, ``prompt_mask``, ``glyph_embeds``, ``glyph_mask``). Image to
    video (`cond` also holds ``image_latents`` Float[B, C, 1, h, w] and ``image_embeds`` Float[B, N, D]): the
    channels [latents, the first frame's latents then zeros, a mask of ones on latent frame 0] and the SigLIP
    states as the image states, as ``HunyuanVideo15ImageToVideoPipeline`` builds them. With `trim`, the padding
    positions masked in every sample are dropped first (`trim_padding`): the transformer masks them out, so only
    the compute changes. `model` may be a DDP wrapper (the attributes are read from its ``module``)."""
    net = getattr(model, "module", model)
    dtype = net.x_embedder.proj.weight.dtype
    pe, pm, ge, gm = cond["prompt_embeds"], cond["prompt_mask"], cond["glyph_embeds"], cond["glyph_mask"]
    if trim:
        pe, pm = trim_padding(pe, pm)
        ge, gm = trim_padding(ge, gm)
    b, _, f, h, w = latents.shape
    x = latents.to(dtype)
    condition, mask = torch.zeros_like(x), x.new_zeros((b, 1, f, h, w))
    if "image_latents" in cond:  # the first frame's latents on latent frame 0, marked by the mask
        condition[:, :, :1] = cond["image_latents"].to(x)
        mask[:, :, 0] = 1.0
    x = torch.cat([x, condition, mask], dim=1)
    t = (sigmas.float() * float(num_train_timesteps)).to(dtype)
    if "image_embeds" in cond:
        image = cond["image_embeds"].to(device=x.device, dtype=dtype)
    else:
        image = torch.zeros(b, image_tokens, int(net.config.image_embed_dim), dtype=dtype, device=x.device)
    out = model(
        hidden_states=x,
        timestep=t.to(x.device),
        encoder_hidden_states=pe.to(dtype),
        encoder_attention_mask=pm.to(dtype),
        encoder_hidden_states_2=ge.to(dtype),
        encoder_attention_mask_2=gm.to(dtype),
        image_embeds=image,
        return_dict=False,
    )[0]
    return out.float()


@dataclass
class HunyuanVideo15Components:
    """The loaded pieces of a HunyuanVideo 1.5 folder (see the module docstring)."""

    transformer: torch.nn.Module
    vae: torch.nn.Module
    scheduler: Any
    text_encoder: torch.nn.Module
    tokenizer: Any
    text_encoder_2: torch.nn.Module
    tokenizer_2: Any
    guider: Any

    pipeline_class: ClassVar[str] = "HunyuanVideo15Pipeline"
    """The diffusers pipeline ``model_index.json`` names."""
    parts: ClassVar[tuple[str, ...]] = PARTS
    """The subfolders `save_pretrained` writes."""

    def text_encoders(self) -> list[torch.nn.Module]:
        """The Qwen2.5-VL text model and the ByT5 encoder."""
        return [self.text_encoder, self.text_encoder_2]

    def encode_prompt(
        self,
        prompts: list[str],
        device: torch.device | str = "cpu",
        *,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        glyph_max_length: int = GLYPH_MAX_LENGTH,
    ) -> dict[str, Tensor]:
        """``prompt_embeds``, ``prompt_mask`` (`encode_prompt`), ``glyph_embeds``, ``glyph_mask`` (`encode_glyphs`)
        of `prompts` with this folder's encoders, on `device`."""
        pe, pm = encode_prompt(self.text_encoder, self.tokenizer, prompts, device, max_sequence_length)
        ge, gm = encode_glyphs(self.text_encoder_2, self.tokenizer_2, prompts, device, glyph_max_length)
        return {"prompt_embeds": pe, "prompt_mask": pm, "glyph_embeds": ge, "glyph_mask": gm}

    def save_pretrained(self, path: str | Path, *, transformer: torch.nn.Module | None = None) -> None:
        """Write every component to its subfolder of `path` (`transformer` overrides the one saved, e.g. a merged
        LoRA copy) and a ``model_index.json`` naming `pipeline_class`."""
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


def load_hunyuan_video15_components(
    path: str | Path, *, dtype: torch.dtype = torch.float32
) -> HunyuanVideo15Components:
    """Load each component of the HunyuanVideo 1.5 folder (or hub id) `path` with its own ``from_pretrained``: the
    transformer and both text encoders in `dtype`, the VAE in fp32 (decoding is sensitive to bf16)."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextModel, Qwen2Tokenizer, T5EncoderModel

    path = str(path)
    return HunyuanVideo15Components(
        transformer=HunyuanVideo15Transformer3DModel.from_pretrained(
            path, subfolder="transformer", torch_dtype=dtype
        ),
        vae=AutoencoderKLHunyuanVideo15.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler"),
        text_encoder=Qwen2_5_VLTextModel.from_pretrained(path, subfolder="text_encoder", dtype=dtype),
        tokenizer=Qwen2Tokenizer.from_pretrained(path, subfolder="tokenizer"),
        text_encoder_2=T5EncoderModel.from_pretrained(path, subfolder="text_encoder_2", dtype=dtype),
        tokenizer_2=ByT5Tokenizer.from_pretrained(path, subfolder="tokenizer_2"),
        guider=ClassifierFreeGuidance.from_pretrained(path, subfolder="guider"),
    )


I2V_PARTS = (*PARTS, "image_encoder", "feature_extractor")


@dataclass
class HunyuanVideo15ImageToVideoComponents(HunyuanVideo15Components):
    """The loaded pieces of a HunyuanVideo 1.5 image-to-video folder: the text-to-video ones plus the SigLIP
    vision tower (``image_encoder``) and its ``feature_extractor``."""

    image_encoder: torch.nn.Module | None = None
    feature_extractor: Any = None

    pipeline_class: ClassVar[str] = "HunyuanVideo15ImageToVideoPipeline"
    parts: ClassVar[tuple[str, ...]] = I2V_PARTS

    def text_encoders(self) -> list[torch.nn.Module]:
        """The frozen encoders: Qwen2.5-VL, ByT5 and the SigLIP image encoder."""
        return [self.text_encoder, self.text_encoder_2, self.image_encoder]


def load_hunyuan_video15_i2v_components(
    path: str | Path, *, dtype: torch.dtype = torch.float32
) -> HunyuanVideo15ImageToVideoComponents:
    """`load_hunyuan_video15_components` of the image-to-video folder (or hub id) `path` plus its
    ``image_encoder`` (``SiglipVisionModel`` in `dtype`) and ``feature_extractor`` (``SiglipImageProcessor``)."""
    from dataclasses import fields

    from transformers import SiglipImageProcessor, SiglipVisionModel

    base = load_hunyuan_video15_components(path, dtype=dtype)
    path = str(path)
    return HunyuanVideo15ImageToVideoComponents(
        **{f.name: getattr(base, f.name) for f in fields(base)},
        image_encoder=SiglipVisionModel.from_pretrained(path, subfolder="image_encoder", dtype=dtype),
        feature_extractor=SiglipImageProcessor.from_pretrained(path, subfolder="feature_extractor"),
    )
