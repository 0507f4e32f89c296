"""`HunyuanVideo15Policy`: HunyuanVideo 1.5 text to video (``HunyuanVideo15Pipeline``, e.g.
``hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v``) as a flow-matching GRPO policy, and
`HunyuanVideo15ImageToVideoPolicy`, image to video (``HunyuanVideo15ImageToVideoPipeline``, e.g.
``hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v``): each row's ``image`` is the first frame; its VAE latents
(on latent frame 0 of the condition channels, with a mask of ones there) and its SigLIP states (the transformer's
image states) condition every step, in both CFG branches, as in the diffusers pipeline.

Details: docs/video.md, "mmalign.policies.hunyuan_video15".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmalign.policies.denoising import SamplerSettings
from mmalign.policies.flow_matching import FlowMatchingPolicy
from mmalign.policies.hunyuan_video15_components import (
    GLYPH_MAX_LENGTH,
    MAX_SEQUENCE_LENGTH,
    HunyuanVideo15Components,
    HunyuanVideo15ImageToVideoComponents,
    encode_first_frame,
    encode_image,
    hunyuan_video15_velocity,
    load_hunyuan_video15_components,
    load_hunyuan_video15_i2v_components,
)

__all__ = [
    "DEFAULT_NUM_FRAMES",
    "HUNYUAN_VIDEO15_LORA_TARGETS",
    "HunyuanVideo15ImageToVideoPolicy",
    "HunyuanVideo15Policy",
    "read_first_frame",
]

HUNYUAN_VIDEO15_LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)
"""Both streams' attention projections and feed-forward layers of the dual-stream blocks (the token refiner's
attention and feed-forward layers match too), Flow-Factory's default pattern for dual-stream DiTs
(``target_modules: all-linear``)."""
DEFAULT_NUM_FRAMES = 121
"""``HunyuanVideo15Pipeline.__call__``'s default frames."""


class HunyuanVideo15Policy(FlowMatchingPolicy):
    """A ``HunyuanVideo15Transformer3DModel`` text-to-video pipeline as a GRPO policy (see the module docstring)."""

    components: HunyuanVideo15Components
    conditioning_keys = ("prompt_embeds", "prompt_mask", "glyph_embeds", "glyph_mask")
    constructor_takes_parts = True
    lora_targets = HUNYUAN_VIDEO15_LORA_TARGETS

    def __init__(
        self,
        transformer: torch.nn.Module,
        vae: torch.nn.Module,
        scheduler: Any,
        text_encoder: torch.nn.Module,
        tokenizer: Any,
        text_encoder_2: torch.nn.Module,
        tokenizer_2: Any,
        guider: Any = None,
        *,
        sampler: SamplerSettings | None = None,
        num_frames: int = DEFAULT_NUM_FRAMES,
        height: int | None = None,
        width: int | None = None,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        glyph_max_length: int = GLYPH_MAX_LENGTH,
        train_expert: str = "both",
        need_reference: bool = False,
        lora: bool = False,
        **sampler_kwargs: Any,
    ) -> None:
        """The parts of a HunyuanVideo 1.5 folder (`HunyuanVideo15Components`). ``num_frames`` x ``height`` x
        ``width``: the video in pixels (frames 1 + a multiple of the VAE's temporal factor; sides multiples of its
        spatial factor times the patch); without a size, the pipeline's default (16:9 at the transformer's
        ``target_size``). ``max_sequence_length`` / ``glyph_max_length``: prompt / glyph tokens kept (the
        pipeline's 1000 / 256; longer prompts are truncated as the pipeline truncates them). ``train_expert`` is accepted for the shared video options and must be
        ``both`` (one transformer). Sampler settings as `FlowMatchingPolicy`."""
        if train_expert != "both":
            raise ValueError(
                f"train_expert {train_expert!r}: HunyuanVideo 1.5 has one transformer; use train_expert: both"
            )
        for key, value in (
            ("max_sequence_length", max_sequence_length),
            ("glyph_max_length", glyph_max_length),
        ):
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        self.max_sequence_length = int(max_sequence_length)
        self.glyph_max_length = int(glyph_max_length)
        self.temporal_factor = int(vae.config.temporal_compression_ratio)
        self.spatial_factor = int(vae.config.spatial_compression_ratio)
        if height is None or width is None:
            height, width = self.default_size(transformer, self.spatial_factor)
        self.num_frames, self.height, self.width = int(num_frames), int(height), int(width)
        self._check(transformer, vae)
        components = HunyuanVideo15Components(
            transformer, vae, scheduler, text_encoder, tokenizer, text_encoder_2, tokenizer_2, guider
        )
        super().__init__(
            components,
            sampler=sampler,
            latent_size=self.height // self.spatial_factor,
            need_reference=need_reference,
            lora=lora,
            **sampler_kwargs,
        )
        self.text_encoder_2 = text_encoder_2
        self.tokenizer_2 = tokenizer_2
        self.freeze_unreachable()

    def freeze_unreachable(self) -> None:
        """Freeze what never reaches the velocity: the last dual-stream block's text-stream output layers
        (``attn.to_add_out`` and ``ff_context``, with any LoRA adapter on them), whose result the transformer
        drops. They get no gradient either way, so one process trains the same; DDP (several processes) requires
        every trainable parameter to get one."""
        last = self.model.transformer_blocks[-1]
        for module in (last.attn.to_add_out, last.ff_context):
            module.requires_grad_(False)

    @staticmethod
    def default_size(transformer: torch.nn.Module, spatial_factor: int) -> tuple[int, int]:
        """(height, width) the pipeline chooses when given none: the 16:9 bucket of the transformer's
        ``target_size`` (``HunyuanVideo15ImageProcessor.calculate_default_height_width``)."""
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

        proc = HunyuanVideo15ImageProcessor(vae_scale_factor=spatial_factor)
        h, w = proc.calculate_default_height_width(9, 16, int(transformer.config.target_size))
        return int(h), int(w)

    def _check(self, transformer: torch.nn.Module, vae: torch.nn.Module) -> None:
        cfg, z = transformer.config, int(vae.config.latent_channels)
        if int(cfg.in_channels) != 2 * z + 1:
            raise ValueError(
                f"transformer/config.json in_channels={cfg.in_channels}, but the VAE's latent_channels={z} needs "
                f"{2 * z + 1} (the noisy latents, the condition latents and a 1-channel mask)"
            )
        if int(cfg.out_channels or cfg.in_channels) != z:
            raise ValueError(
                f"transformer/config.json out_channels={cfg.out_channels}, expected latent_channels={z}"
            )
        t, s = self.temporal_factor, self.spatial_factor
        pt, p = int(cfg.patch_size_t), int(cfg.patch_size)
        if self.num_frames < 1 or (self.num_frames - 1) % t:
            raise ValueError(
                f"num_frames must be 1 + a multiple of the VAE's temporal factor {t} (vae/config.json "
                f"temporal_compression_ratio), got {self.num_frames}"
            )
        if self.height < 1 or self.width < 1 or self.height % (s * p) or self.width % (s * p):
            raise ValueError(
                f"height and width must be multiples of {s * p} (the VAE's spatial factor {s} times the "
                f"transformer's patch_size {p}), got {self.height}x{self.width}"
            )
        if ((self.num_frames - 1) // t + 1) % pt:
            raise ValueError(
                f"{(self.num_frames - 1) // t + 1} latent frames are not a multiple of the transformer's "
                f"patch_size_t {pt}; change num_frames"
            )

    # ------------------------------------------------------------------ building
    @classmethod
    def load_components(
        cls, name_or_path: str | Path, *, dtype: torch.dtype, **options: Any
    ) -> HunyuanVideo15Components:
        """`load_hunyuan_video15_components` of a folder or hub id."""
        return load_hunyuan_video15_components(name_or_path, dtype=dtype)

    # ------------------------------------------------------------------ prompts, shapes and sigmas
    def encode_conditioning(self, prompts: list[str]) -> dict[str, Tensor]:
        return self.components.encode_prompt(
            prompts,
            self.device,
            max_sequence_length=self.max_sequence_length,
            glyph_max_length=self.glyph_max_length,
        )

    def latent_frames(self) -> int:
        """Latent frames of a clip: (num_frames - 1) // temporal + 1."""
        return (self.num_frames - 1) // self.temporal_factor + 1

    def latent_shape(self) -> tuple[int, ...]:
        """(latent_channels, F_lat, h, w) with h = height / spatial, w = width / spatial."""
        s = self.spatial_factor
        return (int(self.vae.config.latent_channels), self.latent_frames(), self.height // s, self.width // s)

    def base_sigmas(self) -> np.ndarray:
        """linspace(1, 0, num_steps + 1) without the final 0, as ``HunyuanVideo15Pipeline`` passes them."""
        return np.linspace(1.0, 0.0, self.num_steps + 1)[:-1]

    # ------------------------------------------------------------------ model and decoding
    def velocity(
        self, model: torch.nn.Module, latents: Tensor, sched: dict[str, Tensor], cond: dict[str, Tensor]
    ) -> Tensor:
        """`hunyuan_video15_velocity` with the policy's prompt and glyph states."""
        n_train = int(self.scheduler.config.num_train_timesteps)
        return hunyuan_video15_velocity(model, latents, sched["sigmas"], cond, n_train)

    def decode_latents(self, z: Tensor) -> Tensor:
        """Float[B, F, 3, H, W] in [0, 1] on the CPU: the whole clip through the causal video VAE at
        ``z / scaling_factor``, as the pipeline decodes."""
        vae = self.vae
        z = z / float(vae.config.scaling_factor)
        video = vae.decode(z.to(next(vae.parameters()).dtype), return_dict=False)[0].float()
        return (video / 2 + 0.5).clamp(0, 1).movedim(1, 2).cpu()


def read_first_frame(path: str | Path, height: int, width: int) -> Tensor:
    """Float[3, height, width] in [0, 1]: a row's ``image``, an image file (``.png`` ...) or the first frame of
    anything `mmalign.data.media.read_video` reads, scaled to cover height x width and centre-cropped (the
    pipeline's ``resize_mode="crop"``; an image of that size is kept as it is)."""
    from mmalign.data.media import IMAGE_SUFFIXES, load_rgb, read_video

    p = Path(path)
    if p.suffix.lower() in IMAGE_SUFFIXES:
        frame = torch.from_numpy(np.array(load_rgb(p))).permute(2, 0, 1).float()[None] / 255.0
    else:
        frame = read_video(p)[:1]
    h, w = frame.shape[-2:]
    if (h, w) == (height, width):
        return frame[0]
    scale = max(height / h, width / w)
    nh, nw = max(height, round(h * scale)), max(width, round(w * scale))
    frame = torch.nn.functional.interpolate(
        frame, size=(nh, nw), mode="bilinear", align_corners=False, antialias=True
    ).clamp(0, 1)
    top, left = (nh - height) // 2, (nw - width) // 2
    return frame[0, :, top : top + height, left : left + width]


class HunyuanVideo15ImageToVideoPolicy(HunyuanVideo15Policy):
    """A ``HunyuanVideo15ImageToVideoPipeline`` folder as a GRPO policy (see the module docstring): every row's
    ``image`` column is the first frame; its ``image_latents`` Float[C, 1, h, w] and ``image_embeds``
    Float[N, D] are row conditioning (stored in the payload, so re-scoring sees what sampling saw)."""

    components: HunyuanVideo15ImageToVideoComponents
    row_conditioning_keys = ("image_latents", "image_embeds")
    image_column = "image"
    """The row column holding the first frame."""

    def __init__(
        self,
        *args: Any,
        image_encoder: torch.nn.Module | None = None,
        feature_extractor: Any = None,
        **kwargs: Any,
    ) -> None:
        """`HunyuanVideo15Policy`'s parts plus the folder's SigLIP `image_encoder` and `feature_extractor`."""
        if image_encoder is None or feature_extractor is None:
            raise ValueError(
                "HunyuanVideo 1.5 image to video needs the model folder's image_encoder/ (SiglipVisionModel) and "
                "feature_extractor/ (SiglipImageProcessor); model.name_or_path names a folder without them"
            )
        super().__init__(*args, **kwargs)
        base = self.components
        self.components = HunyuanVideo15ImageToVideoComponents(
            **{name: getattr(base, name) for name in HunyuanVideo15Components.parts},
            image_encoder=image_encoder,
            feature_extractor=feature_extractor,
        )
        image_encoder.eval().requires_grad_(False)
        self.image_encoder, self.feature_extractor = image_encoder, feature_extractor
        d, want = int(image_encoder.config.hidden_size), int(self.model.config.image_embed_dim)
        if d != want:
            raise ValueError(
                f"image_encoder/config.json hidden_size={d}, but transformer/config.json image_embed_dim={want}"
            )

    @classmethod
    def load_components(
        cls, name_or_path: str | Path, *, dtype: torch.dtype, **options: Any
    ) -> HunyuanVideo15ImageToVideoComponents:
        """`load_hunyuan_video15_i2v_components` of a folder or hub id."""
        return load_hunyuan_video15_i2v_components(name_or_path, dtype=dtype)

    def first_frames(self, columns: dict[str, list[Any]], b: int) -> tuple[list[str], dict[str, Tensor]]:
        """(the `b` rows' ``image`` paths, {path: Float[3, H, W] in [0, 1]} of each distinct one, `read_first_frame`
        at the policy's size)."""
        paths = list(columns.get(self.image_column) or [None] * b)
        if any(p is None for p in paths):
            raise ValueError(
                "HunyuanVideo 1.5 image to video needs an image in every row (column 'image': an image file, or a "
                "clip whose first frame is used)"
            )
        paths = [str(p) for p in paths]
        return paths, {p: read_first_frame(p, self.height, self.width) for p in dict.fromkeys(paths)}

    def row_conditioning(self, columns: dict[str, list[Any]], group: Tensor) -> dict[str, Tensor]:
        """``image_latents`` Float[B, C, 1, h, w] (`encode_first_frame`) and ``image_embeds`` Float[B, N, D]
        (`encode_image`, fp32) of each row's first frame, each distinct image encoded once."""
        paths, frames = self.first_frames(columns, int(group.shape[0]))
        order = list(frames)
        unique = torch.stack([frames[p] for p in order])
        index = torch.tensor([order.index(p) for p in paths])
        latents = encode_first_frame(self.vae, unique)[index]
        embeds = encode_image(self.image_encoder, self.feature_extractor, unique).float()[index]
        return {"image_latents": latents.to(self.device), "image_embeds": embeds.to(self.device)}
