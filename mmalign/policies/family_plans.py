"""The built-in families' `PlanSpec`s: how `mmalign plan` sizes and calls each family's denoiser.

Each spec answers, for one family, what its policy computes at run time: the latent shape and token counts of one
sample from the config's options and the model's component configs (`PlanShapes`), and the keyword inputs of one
denoiser call as the policy's ``velocity`` / ``predict`` builds them, on the meta device. `families.Family.plan`
names these by ``"mmalign.policies.family_plans:<NAME>"``; they are imported only when a model is planned.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from mmalign.policies.ddim import LORA_TARGETS as DDIM_LORA_TARGETS
from mmalign.policies.families import PlanRequest, PlanShapes, PlanSpec, vae_factor

__all__ = [
    "FLUX2_PLAN",
    "FLUX_KONTEXT_PLAN",
    "FLUX_PLAN",
    "HUNYUAN_VIDEO15_I2V_PLAN",
    "HUNYUAN_VIDEO15_PLAN",
    "PLUS_LABEL_TOKENS",
    "QWEN_IMAGE_EDIT_PLAN",
    "QWEN_IMAGE_EDIT_PLUS_PLAN",
    "QWEN_IMAGE_PLAN",
    "SD3_PLAN",
    "SD_UNET_PLAN",
    "WAN_PLAN",
    "Z_IMAGE_PLAN",
]

PLUS_LABEL_TOKENS = 6
"""Tokens of a Qwen-Image-Edit-Plus picture label around its vision tokens ("Picture 1: ", vision start / end)."""


def _e(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _text(req: PlanRequest, default: int = 512) -> int:
    return int(req.option("max_sequence_length") or default)


def _square(
    req: PlanRequest, size: int, channels: int, latent_side: int, patch: int, text: int
) -> PlanShapes:
    """An image family's shapes: `size` VAE latents a side, `latent_side` a side of the denoised latent, one image
    token per `patch` x `patch` VAE latents."""
    factor = vae_factor(req)
    return PlanShapes(
        (channels, latent_side, latent_side), text, (size // patch) ** 2, (3, size * factor, size * factor)
    )


# ----------------------------------------------------------------------------- SD3 (and SD3.5)
def _sd3_shapes(req: PlanRequest) -> PlanShapes:
    """Latents of ``options.resolution`` (else the transformer's sample_size); CLIP's 77 + T5's tokens."""
    c, res = req.config, req.option("resolution")
    size = int(res) // vae_factor(req) if res else int(c.get("sample_size", 128))
    encoder = req.component("text_encoder")
    clip = int(encoder.get("max_position_embeddings", 77)) if encoder is not None else 77
    text = clip + _text(req, 256)  # without T5 its part of the prompt states is zeros of the same length
    return _square(req, size, int(c.get("in_channels", 16)), size, int(c.get("patch_size", 2)), text)


def _sd3_inputs(c: Mapping[str, Any], sh: PlanShapes, batch: int, dtype: torch.dtype) -> dict[str, Any]:
    return dict(
        hidden_states=_e(batch, *sh.latent, dtype=dtype),
        encoder_hidden_states=_e(batch, sh.text_tokens, int(c.get("joint_attention_dim", 4096)), dtype=dtype),
        pooled_projections=_e(batch, int(c.get("pooled_projection_dim", 2048)), dtype=dtype),
        timestep=_e(batch, dtype=dtype),
        return_dict=False,
    )


SD3_PLAN = PlanSpec(_sd3_shapes, _sd3_inputs)


# ----------------------------------------------------------------------------- FLUX.1 and FLUX.1 Kontext
def _flux_shapes(req: PlanRequest, *, edit: bool = False) -> PlanShapes:
    """Packed 2 x 2 latent patches; Kontext appends the source image's packed tokens (as many)."""
    vae = req.component("vae")
    vae_size = vae.get("sample_size", 1024) if vae is not None else 1024
    size = int(req.option("resolution") or vae_size) // vae_factor(req)
    sh = _square(req, size, int(req.config.get("in_channels", 64)) // 4, size, 2, _text(req))
    if edit:
        return PlanShapes(sh.latent, sh.text_tokens, 2 * sh.image_tokens, sh.pixels, sh.image_tokens)
    return sh


def _flux_inputs(c: Mapping[str, Any], sh: PlanShapes, batch: int, dtype: torch.dtype) -> dict[str, Any]:
    ch, h, w = sh.latent
    n = (h // 2) * (w // 2) + sh.reference_tokens
    kw = dict(
        hidden_states=_e(batch, n, ch * 4, dtype=dtype),
        encoder_hidden_states=_e(batch, sh.text_tokens, int(c.get("joint_attention_dim", 4096)), dtype=dtype),
        pooled_projections=_e(batch, int(c.get("pooled_projection_dim", 768)), dtype=dtype),
        timestep=_e(batch, dtype=dtype),
        txt_ids=_e(sh.text_tokens, 3, dtype=dtype),
        img_ids=_e(n, 3, dtype=dtype),
        return_dict=False,
    )
    if c.get("guidance_embeds"):
        kw["guidance"] = _e(batch, dtype=torch.float32)
    return kw


FLUX_PLAN = PlanSpec(_flux_shapes, _flux_inputs)
FLUX_KONTEXT_PLAN = PlanSpec(lambda req: _flux_shapes(req, edit=True), _flux_inputs)


# ----------------------------------------------------------------------------- FLUX.2 (dev and klein)
def _flux2_shapes(req: PlanRequest) -> PlanShapes:
    """The VAE latents patchified 2 x 2 (`Flux2PolicyBase`): 128 channels at half the latent side."""
    size = int(req.option("resolution") or 1024) // vae_factor(req)
    return _square(req, size, int(req.config.get("in_channels", 128)), size // 2, 2, _text(req))


def _flux2_inputs(c: Mapping[str, Any], sh: PlanShapes, batch: int, dtype: torch.dtype) -> dict[str, Any]:
    """As ``Flux2PolicyBase.velocity``."""
    ch, h, w = sh.latent
    kw = dict(
        hidden_states=_e(batch, h * w, ch, dtype=dtype),
        encoder_hidden_states=_e(
            batch, sh.text_tokens, int(c.get("joint_attention_dim", 15360)), dtype=dtype
        ),
        timestep=_e(batch, dtype=dtype),
        txt_ids=_e(sh.text_tokens, 4, dtype=torch.long),
        img_ids=_e(h * w, 4, dtype=torch.long),
        return_dict=False,
    )
    if c.get("guidance_embeds", True):
        kw["guidance"] = _e(batch, dtype=torch.float32)
    return kw


def _flux2_vae_latent(sh: PlanShapes) -> tuple[int, ...]:
    """The VAE's latents of one sample: the packed 2 x 2 patches unpacked (a quarter of the channels, twice the
    side)."""
    ch, h, w = sh.latent
    return (ch // 4, 2 * h, 2 * w)


FLUX2_PLAN = PlanSpec(_flux2_shapes, _flux2_inputs, vae_latent=_flux2_vae_latent)


# ----------------------------------------------------------------------------- Qwen-Image and its editing models
def _qwen_shapes(req: PlanRequest, *, edit: bool = False, plus: bool = False) -> PlanShapes:
    """Latents of ``options.resolution`` / 8 in 2 x 2 patches. Editing appends the source image's tokens, and the
    prompt states hold the source's Qwen2.5-VL vision tokens (14 px patches merged 2 x 2, the image resized to a
    multiple of 28 px); Qwen-Image-Edit-Plus shows the VLM each source at ~384 x 384 (``CONDITION_IMAGE_PIXELS``)
    after a "Picture 1: " label (one source per row)."""
    c = req.config
    size = int(req.option("resolution") or 1024) // 8
    sh = _square(req, size, int(c.get("out_channels", 16)), size, int(c.get("patch_size", 2)), _text(req))
    if not edit:
        return sh
    from mmalign.policies.qwen_image_components import CONDITION_IMAGE_PIXELS

    shown = int(math.sqrt(CONDITION_IMAGE_PIXELS)) if plus else sh.pixels[-1]
    side = max(28, round(shown / 28) * 28)
    text = sh.text_tokens + (side // 28) ** 2 + (PLUS_LABEL_TOKENS if plus else 0)
    return PlanShapes(sh.latent, text, 2 * sh.image_tokens, sh.pixels, sh.image_tokens)


def _qwen_inputs(c: Mapping[str, Any], sh: PlanShapes, batch: int, dtype: torch.dtype) -> dict[str, Any]:
    ch, h, w = sh.latent
    frames = [(1, h // 2, w // 2)] * (2 if sh.reference_tokens else 1)  # + the edit's source image
    return dict(
        hidden_states=_e(batch, (h // 2) * (w // 2) + sh.reference_tokens, ch * 4, dtype=dtype),
        timestep=_e(batch, dtype=dtype),
        encoder_hidden_states=_e(batch, sh.text_tokens, int(c.get("joint_attention_dim", 3584)), dtype=dtype),
        encoder_hidden_states_mask=torch.ones((batch, sh.text_tokens), dtype=torch.bool, device="meta"),
        img_shapes=[frames] * batch,
        return_dict=False,
    )


QWEN_IMAGE_PLAN = PlanSpec(_qwen_shapes, _qwen_inputs, vae_fp32=True)
QWEN_IMAGE_EDIT_PLAN = PlanSpec(lambda req: _qwen_shapes(req, edit=True), _qwen_inputs, vae_fp32=True)
QWEN_IMAGE_EDIT_PLUS_PLAN = PlanSpec(
    lambda req: _qwen_shapes(req, edit=True, plus=True), _qwen_inputs, vae_fp32=True
)


# ----------------------------------------------------------------------------- Z-Image
def _z_image_shapes(req: PlanRequest) -> PlanShapes:
    """2 x 2 patches of the VAE latents; Qwen3 prompt states."""
    c = req.config
    size = int(req.option("resolution") or 1024) // vae_factor(req)
    return _square(req, size, int(c.get("in_channels", 16)), size, int(c.get("patch_size", 2)), _text(req))


def _z_image_inputs(c: Mapping[str, Any], sh: PlanShapes, batch: int, dtype: torch.dtype) -> dict[str, Any]:
    """As ``z_image_velocity``: per-sample lists."""
    ch, h, w = sh.latent
    return dict(
        x=[_e(ch, 1, h, w, dtype=dtype) for _ in range(batch)],
        t=_e(batch, dtype=dtype),
        cap_feats=[_e(sh.text_tokens, int(c.get("cap_feat_dim", 2560)), dtype=dtype) for _ in range(batch)],
        return_dict=False,
    )


Z_IMAGE_PLAN = PlanSpec(_z_image_shapes, _z_image_inputs)


# ----------------------------------------------------------------------------- Wan 2.x (T2V, I2V, VACE)
def _wan_shapes(req: PlanRequest) -> PlanShapes:
    """``num_frames`` at height x width: (frames - 1) / 4 + 1 latent frames of height / 8 x width / 8."""
    c = req.config
    frames = int(req.option("num_frames", 17))
    h, w = int(req.option("height", 480)), int(req.option("width", 832))
    lf = (frames - 1) // 4 + 1
    ch = int(c.get("out_channels") or c.get("in_channels", 16))
    ps = c.get("patch_size", [1, 2, 2])
    tokens = lf // ps[0] * (h // 8 // ps[1]) * (w // 8 // ps[2])
    return PlanShapes(
        (ch, lf, h // 8, w // 8), int(req.option("max_sequence_length", 512)), tokens, (frames, 3, h, w)
    )


def _wan_inputs(c: Mapping[str, Any], sh: PlanShapes, batch: int, dtype: torch.dtype) -> dict[str, Any]:
    ch, lf, h, w = sh.latent
    kw = dict(
        hidden_states=_e(batch, int(c.get("in_channels", ch)), lf, h, w, dtype=dtype),
        timestep=_e(batch, dtype=torch.float32),
        encoder_hidden_states=_e(batch, sh.text_tokens, int(c.get("text_dim", 4096)), dtype=dtype),
        return_dict=False,
    )
    if c.get("image_dim"):  # image to video: the CLIP image states (257 tokens of ViT-H/14)
        kw["encoder_hidden_states_image"] = _e(batch, 257, int(c["image_dim"]), dtype=dtype)
    if "vace_layers" in c:  # VACE: the control video's latents and a scale per VACE block
        kw["control_hidden_states"] = _e(batch, int(c.get("vace_in_channels", 96)), lf, h, w, dtype=dtype)
        kw["control_hidden_states_scale"] = _e(len(c["vace_layers"]), dtype=dtype)
    return kw


WAN_PLAN = PlanSpec(_wan_shapes, _wan_inputs, video=True, vae_fp32=True)


# ----------------------------------------------------------------------------- SD 1.x / 2.x UNet (DDIM)
def _unet_shapes(req: PlanRequest) -> PlanShapes:
    """``options.latent_size`` (else the UNet's sample_size) latents a side; CLIP's 77 prompt tokens."""
    c = req.config
    size = int(req.option("latent_size") or c.get("sample_size", 64))
    factor = vae_factor(req)
    return PlanShapes(
        (int(c.get("in_channels", 4)), size, size), 77, size * size, (3, size * factor, size * factor)
    )


def _unet_inputs(c: Mapping[str, Any], sh: PlanShapes, batch: int, dtype: torch.dtype) -> dict[str, Any]:
    return dict(
        sample=_e(batch, *sh.latent, dtype=dtype),
        timestep=_e(batch, dtype=dtype),
        encoder_hidden_states=_e(batch, sh.text_tokens, int(c.get("cross_attention_dim", 768)), dtype=dtype),
        return_dict=False,
    )


SD_UNET_PLAN = PlanSpec(_unet_shapes, _unet_inputs, lora_targets=tuple(DDIM_LORA_TARGETS))


# ----------------------------------------------------------------------------- HunyuanVideo 1.5
def _hunyuan_video15_shapes(req: PlanRequest) -> PlanShapes:
    """``num_frames`` at height x width (the pipeline's 16:9 default at the transformer's target_size when not
    given) through the VAE's temporal / spatial compression; context: the Qwen2.5-VL prompt states
    (``max_sequence_length``) then the ByT5 glyph states (``glyph_max_length``), every token valid."""
    from types import SimpleNamespace

    from mmalign.policies.hunyuan_video15 import DEFAULT_NUM_FRAMES, HunyuanVideo15Policy
    from mmalign.policies.hunyuan_video15_components import GLYPH_MAX_LENGTH, MAX_SEQUENCE_LENGTH

    c, vae = req.config, req.component("vae") or {}
    s, t = int(vae.get("spatial_compression_ratio", 16)), int(vae.get("temporal_compression_ratio", 4))
    frames = int(req.option("num_frames") or DEFAULT_NUM_FRAMES)
    h, w = req.option("height"), req.option("width")
    if h is None or w is None:
        target = SimpleNamespace(config=SimpleNamespace(target_size=int(c.get("target_size", 640))))
        h, w = HunyuanVideo15Policy.default_size(target, s)
    h, w = int(h), int(w)
    lf = (frames - 1) // t + 1
    ch = int(vae.get("latent_channels") or (int(c.get("in_channels", 65)) - 1) // 2)
    p, pt = int(c.get("patch_size", 1)), int(c.get("patch_size_t", 1))
    prompt = int(req.option("max_sequence_length") or MAX_SEQUENCE_LENGTH)
    glyph = int(req.option("glyph_max_length") or GLYPH_MAX_LENGTH)
    tokens = lf // pt * (h // s // p) * (w // s // p)
    return PlanShapes(
        (ch, lf, h // s, w // s), prompt + glyph, tokens, (frames, 3, h, w), text_parts=(prompt, glyph)
    )


def _hunyuan_video15_inputs(
    c: Mapping[str, Any], sh: PlanShapes, batch: int, dtype: torch.dtype
) -> dict[str, Any]:
    """As ``hunyuan_video15_velocity`` (text to video): the channels [latents, zeros, zero mask], all-valid
    prompt and glyph masks (nothing to trim) and one all-zero image state, made with ``torch.ones`` /
    ``torch.zeros`` so that the forward's ``torch.all(image_embeds == 0)`` and mask indexing see their values."""
    _ch, lf, h, w = sh.latent
    prompt, glyph = sh.text_parts
    return dict(
        hidden_states=_e(batch, int(c.get("in_channels", 65)), lf, h, w, dtype=dtype),
        timestep=_e(batch, dtype=dtype),
        encoder_hidden_states=_e(batch, prompt, int(c.get("text_embed_dim", 3584)), dtype=dtype),
        encoder_attention_mask=torch.ones((batch, prompt), dtype=dtype, device="meta"),
        encoder_hidden_states_2=_e(batch, glyph, int(c.get("text_embed_2_dim", 1472)), dtype=dtype),
        encoder_attention_mask_2=torch.ones((batch, glyph), dtype=dtype, device="meta"),
        image_embeds=torch.zeros((batch, 1, int(c.get("image_embed_dim", 1152))), dtype=dtype, device="meta"),
        return_dict=False,
    )


HUNYUAN_VIDEO15_PLAN = PlanSpec(
    _hunyuan_video15_shapes, _hunyuan_video15_inputs, video=True, vae_fp32=True, meta_values=True
)


def _hunyuan_video15_i2v_shapes(req: PlanRequest) -> PlanShapes:
    """`_hunyuan_video15_shapes` plus the first frame's SigLIP states in the context: (image_size / patch_size)^2 of
    the ``image_encoder`` component (729 for SigLIP so400m at 384 px; `IMAGE_TOKENS` when the folder's configs
    hold no image encoder), all valid."""
    from mmalign.policies.hunyuan_video15_components import IMAGE_TOKENS

    sh = _hunyuan_video15_shapes(req)
    enc = req.component("image_encoder") or {}
    enc = enc.get("vision_config", enc)  # a full SiglipConfig nests the vision tower's values
    size, patch = enc.get("image_size"), enc.get("patch_size")
    image = (int(size) // int(patch)) ** 2 if size and patch else IMAGE_TOKENS
    return replace(sh, text_tokens=sh.text_tokens + image, text_parts=(*sh.text_parts, image))


def _hunyuan_video15_i2v_inputs(
    c: Mapping[str, Any], sh: PlanShapes, batch: int, dtype: torch.dtype
) -> dict[str, Any]:
    """As ``hunyuan_video15_velocity`` for image to video: the text-to-video inputs with the SigLIP states of the
    first frame as the image states (made with ``torch.ones``, so the forward's ``torch.all(image_embeds == 0)``
    sees non-zero states and keeps every image token)."""
    *text, image = sh.text_parts
    out = _hunyuan_video15_inputs(c, replace(sh, text_tokens=sum(text), text_parts=tuple(text)), batch, dtype)
    out["image_embeds"] = torch.ones(
        (batch, image, int(c.get("image_embed_dim", 1152))), dtype=dtype, device="meta"
    )
    return out


HUNYUAN_VIDEO15_I2V_PLAN = PlanSpec(
    _hunyuan_video15_i2v_shapes, _hunyuan_video15_i2v_inputs, video=True, vae_fp32=True, meta_values=True
)
