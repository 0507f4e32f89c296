"""The Wan video folder loader and the Wan-specific tensor helpers `mmalign.policies.wan.WanPolicy` builds on.

`load_wan_components` / `WanComponents.save_pretrained` read and write a diffusers ``WanPipeline`` /
``WanVACEPipeline`` folder (optional ``transformer_2/`` expert, I2V image encoder), training on a
``FlowMatchEulerDiscreteScheduler`` at the folder's ``flow_shift`` and keeping its own scheduler as
``ode_scheduler`` for deterministic sampling. The helpers reproduce the pipelines' tensors: `encode_prompt`
(UMT5), `vae_factors` / `encode_video` / `decode_video` (videos Float[B, F, 3, H, W] in [0, 1]),
`i2v_condition` / `encode_image` and `vace_control_tensor` (any batch size). Details: docs/video.md, "The Wan
folder and its helpers"; formulas: docs/algorithms.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.policies.diffusers_notices import quiet_diffusers_fp32_notice

quiet_diffusers_fp32_notice()  # diffusers' empty "should be kept in float32: []" notice (LoRA saves)

__all__ = [
    "WAN_MAX_SEQUENCE_LENGTH",
    "WanComponents",
    "decode_video",
    "encode_image",
    "encode_prompt",
    "encode_video",
    "flow_scheduler",
    "i2v_condition",
    "i2v_mask",
    "latent_frames",
    "latent_stats",
    "letterbox_reference",
    "load_wan_components",
    "ode_scheduler",
    "prompt_states",
    "vace_control_tensor",
    "vace_mask_channels",
    "vae_factors",
]

WAN_MAX_SEQUENCE_LENGTH = 512
"""``WanPipeline``'s default ``max_sequence_length`` (UMT5 tokens per prompt)."""


@dataclass
class WanComponents:
    """The loaded pieces of a Wan folder. ``transformer_2`` (the Wan2.2 low-noise expert) and
    ``boundary_ratio`` (where the experts switch) come together or not at all; ``ode_scheduler`` is the
    folder's own scheduler when it is not the flow-matching Euler one (UniPC: deterministic sampling);
    ``image_encoder`` / ``image_processor`` the CLIP vision tower of a Wan2.1 image-to-video folder."""

    transformer: torch.nn.Module
    vae: torch.nn.Module
    scheduler: Any
    text_encoder: torch.nn.Module
    tokenizer: Any
    transformer_2: torch.nn.Module | None = None
    boundary_ratio: float | None = None
    ode_scheduler: Any = None
    image_encoder: torch.nn.Module | None = None
    image_processor: Any = None

    def __post_init__(self) -> None:
        if (self.transformer_2 is None) != (self.boundary_ratio is None):
            raise ValueError(
                "transformer_2 and boundary_ratio go together (model_index.json of a Wan2.2 two-expert folder "
                f"holds both); got transformer_2={'set' if self.transformer_2 is not None else None}, "
                f"boundary_ratio={self.boundary_ratio}"
            )
        if self.boundary_ratio is not None and not 0 < self.boundary_ratio < 1:
            raise ValueError(f"boundary_ratio must be in (0, 1), got {self.boundary_ratio}")
        if (self.image_encoder is None) != (self.image_processor is None):
            raise ValueError(
                "image_encoder and image_processor go together (a Wan2.1 image-to-video folder holds both)"
            )

    def text_encoders(self) -> list[torch.nn.Module]:
        """The frozen encoders: UMT5, and the CLIP image encoder of an image-to-video folder."""
        return [self.text_encoder] + ([self.image_encoder] if self.image_encoder is not None else [])

    @property
    def is_vace(self) -> bool:
        """True when the transformer is a ``WanVACETransformer3DModel`` (it takes a control tensor)."""
        return hasattr(self.transformer.config, "vace_layers")

    @property
    def is_i2v(self) -> bool:
        """True when the transformer takes image-to-video conditioning: ``in_channels`` = 2 z_dim + the VAE's
        temporal factor (noisy latents, the first-frame mask, the image latents)."""
        z = int(self.vae.config.z_dim)
        return int(self.transformer.config.in_channels) == 2 * z + vae_factors(self.vae)[0]

    def encode_prompt(
        self, prompts: list[str], device: torch.device | str = "cpu", *, max_sequence_length: int
    ) -> Tensor:
        """Float[B, max_sequence_length, D] of `prompts`; see `encode_prompt`."""
        return encode_prompt(self.text_encoder, self.tokenizer, prompts, device, max_sequence_length)

    def save_pretrained(
        self,
        path: str | Path,
        *,
        transformer: torch.nn.Module | None = None,
        transformer_2: torch.nn.Module | None = None,
    ) -> None:
        """Write every component to its subfolder of `path` and a diffusers ``model_index.json``
        (``WanVACEPipeline`` for a VACE transformer, ``WanImageToVideoPipeline`` for an image-to-video one, else
        ``WanPipeline``; ``boundary_ratio`` and ``transformer_2`` as ``[null, null]`` when there is one
        expert). The scheduler written is the folder's own (``ode_scheduler`` when set). `transformer` /
        `transformer_2` override the experts saved (merged LoRA copies)."""
        import diffusers

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        t1 = transformer if transformer is not None else self.transformer
        t2 = transformer_2 if transformer_2 is not None else self.transformer_2
        t1.save_pretrained(path / "transformer")
        if t2 is not None:
            t2.save_pretrained(path / "transformer_2")
        self.vae.save_pretrained(path / "vae")
        scheduler = self.ode_scheduler if self.ode_scheduler is not None else self.scheduler
        scheduler.save_pretrained(path / "scheduler")
        self.text_encoder.save_pretrained(path / "text_encoder")
        self.tokenizer.save_pretrained(path / "tokenizer")
        if self.image_encoder is not None:
            self.image_encoder.save_pretrained(path / "image_encoder")
            self.image_processor.save_pretrained(path / "image_processor")

        def entry(part: Any) -> list[str | None]:
            if part is None:
                return [None, None]
            lib = "diffusers" if type(part).__module__.startswith("diffusers") else "transformers"
            return [lib, type(part).__name__]

        name = (
            "WanVACEPipeline" if self.is_vace else "WanImageToVideoPipeline" if self.is_i2v else "WanPipeline"
        )
        index: dict[str, Any] = {
            "_class_name": name,
            "_diffusers_version": diffusers.__version__,
            "boundary_ratio": self.boundary_ratio,
            "scheduler": entry(scheduler),
            "text_encoder": entry(self.text_encoder),
            "tokenizer": entry(self.tokenizer),
            "transformer": entry(t1),
            "transformer_2": entry(t2),
            "vae": entry(self.vae),
        }
        if self.is_i2v:
            index["image_encoder"] = entry(self.image_encoder)
            index["image_processor"] = entry(self.image_processor)
        if not self.is_vace:
            index["expand_timesteps"] = False
        (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def _load_config(path: str, subfolder: str | None = None) -> dict[str, Any]:
    """A component's config (``config.json``; ``scheduler_config.json`` for ``scheduler``) or, without
    `subfolder`, ``model_index.json``, from a local folder or a hub id."""
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

    name = {None: "model_index.json", "scheduler": "scheduler_config.json"}.get(subfolder, "config.json")
    local = Path(path) / (subfolder or "") / name
    if local.is_file():
        return json.loads(local.read_text())
    if subfolder is None:
        return dict(DiffusionPipeline.load_config(path))
    loader = FlowMatchEulerDiscreteScheduler if subfolder == "scheduler" else WanTransformer3DModel
    return dict(loader.load_config(path, subfolder=subfolder))


def flow_scheduler(path: str) -> Any:
    """The ``FlowMatchEulerDiscreteScheduler`` the policy samples with, from ``path/scheduler``: the folder's
    own when it is one, else (a real Wan folder's ``UniPCMultistepScheduler``) one with ``shift`` =
    its ``flow_shift`` and the same ``num_train_timesteps`` (see the module docstring)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    cfg = _load_config(path, "scheduler")
    name = cfg.get("_class_name", "")
    if name == "FlowMatchEulerDiscreteScheduler":
        return FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
    if "flow_shift" not in cfg:
        raise ValueError(
            f"{path}/scheduler/scheduler_config.json: a {name or 'scheduler'} without flow_shift; a Wan folder "
            "needs a FlowMatchEulerDiscreteScheduler or a flow-sigma scheduler with flow_shift (UniPC)"
        )
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=int(cfg.get("num_train_timesteps", 1000)), shift=float(cfg["flow_shift"])
    )


def ode_scheduler(path: str) -> Any:
    """The folder's own scheduler when it is not a ``FlowMatchEulerDiscreteScheduler`` (a real Wan folder's
    ``UniPCMultistepScheduler``: what deterministic sampling steps with), loaded by the diffusers class its
    ``scheduler_config.json`` names; None for a flow-matching Euler folder."""
    import diffusers

    name = _load_config(path, "scheduler").get("_class_name", "")
    if name in ("", "FlowMatchEulerDiscreteScheduler"):
        return None
    cls = getattr(diffusers, name, None)
    if cls is None or not hasattr(cls, "step"):
        raise ValueError(f"{path}/scheduler/scheduler_config.json: unknown scheduler class {name!r}")
    return cls.from_pretrained(path, subfolder="scheduler")


def _transformer_class(path: str, subfolder: str) -> Any:
    from diffusers import WanTransformer3DModel, WanVACETransformer3DModel

    name = _load_config(path, subfolder).get("_class_name", "WanTransformer3DModel")
    classes = {
        "WanTransformer3DModel": WanTransformer3DModel,
        "WanVACETransformer3DModel": WanVACETransformer3DModel,
    }
    if name not in classes:
        raise ValueError(
            f"{path}/{subfolder}/config.json: _class_name {name!r} is not a Wan transformer "
            f"({', '.join(classes)})"
        )
    return classes[name]


def load_wan_components(path: str | Path, *, dtype: torch.dtype = torch.float32) -> WanComponents:
    """Load a Wan pipeline folder (or hub id) `path` component by component with ``from_pretrained``: the
    transformer class from ``transformer/config.json``, ``transformer_2/`` and ``boundary_ratio`` from
    ``model_index.json`` when present, the scheduler through `flow_scheduler` (and the folder's own through
    `ode_scheduler`), ``image_encoder/`` and ``image_processor/`` when ``model_index.json`` names them. The VAE
    and the image encoder are loaded in fp32 (as diffusers' Wan examples do; the VAE's decode is sensitive to
    bf16)."""
    import transformers
    from diffusers import AutoencoderKLWan
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPVisionModel, UMT5EncoderModel

    path = str(path)
    index = _load_config(path)
    t2_entry = index.get("transformer_2")
    has_t2 = isinstance(t2_entry, list | tuple) and t2_entry[0] is not None
    boundary = index.get("boundary_ratio")
    if has_t2 and boundary is None:
        raise ValueError(f"{path}/model_index.json: transformer_2 is set but boundary_ratio is null")
    transformer_2 = None
    if has_t2:
        transformer_2 = _transformer_class(path, "transformer_2").from_pretrained(
            path, subfolder="transformer_2", torch_dtype=dtype
        )
    enc_entry = index.get("image_encoder")
    has_image_encoder = isinstance(enc_entry, list | tuple) and enc_entry[0] is not None
    image_encoder = image_processor = None
    if has_image_encoder:
        image_encoder = CLIPVisionModel.from_pretrained(path, subfolder="image_encoder", dtype=torch.float32)
        image_processor = CLIPImageProcessor.from_pretrained(path, subfolder="image_processor")
    # the tokenizer class model_index.json names: AutoTokenizer would also look for tokenizer/config.json, which a
    # downloaded hub snapshot lacks, and fail offline (HF_HUB_OFFLINE=1) although the tokenizer is cached
    tokenizer_entry = index.get("tokenizer")
    tokenizer_class = AutoTokenizer
    if isinstance(tokenizer_entry, list | tuple) and tokenizer_entry[0] == "transformers":
        tokenizer_class = getattr(transformers, str(tokenizer_entry[1]), AutoTokenizer)
    return WanComponents(
        transformer=_transformer_class(path, "transformer").from_pretrained(
            path, subfolder="transformer", torch_dtype=dtype
        ),
        vae=AutoencoderKLWan.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32),
        scheduler=flow_scheduler(path),
        text_encoder=UMT5EncoderModel.from_pretrained(path, subfolder="text_encoder", dtype=dtype),
        tokenizer=tokenizer_class.from_pretrained(path, subfolder="tokenizer"),
        transformer_2=transformer_2,
        boundary_ratio=float(boundary) if has_t2 else None,
        ode_scheduler=ode_scheduler(path),
        image_encoder=image_encoder,
        image_processor=image_processor,
    )


# ----------------------------------------------------------------------------- prompts


@torch.no_grad()
def encode_prompt(
    text_encoder: torch.nn.Module,
    tokenizer: Any,
    prompts: list[str],
    device: torch.device | str = "cpu",
    max_sequence_length: int = WAN_MAX_SEQUENCE_LENGTH,
) -> Tensor:
    """Float[B, max_sequence_length, D] (the text encoder's dtype): ``WanPipeline._get_t5_prompt_embeds``
    -- cleaned prompts, UMT5 states with the attention mask, zeros beyond each prompt's token count."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    cleaned = [prompt_clean(p) for p in prompts]
    tok = tokenizer(
        cleaned,
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    return prompt_states(text_encoder, tok.input_ids.to(device), tok.attention_mask.to(device))


def prompt_states(text_encoder: torch.nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
    """Float[B, L, D]: UMT5's ``last_hidden_state`` of token ids Long[B, L] under their attention mask, zeros
    beyond each sequence's token count (the second half of `encode_prompt`; runs in the caller's grad mode, so
    a builder can train the text encoder through it)."""
    lens = mask.gt(0).sum(dim=1).long()
    states = text_encoder(ids, mask).last_hidden_state
    pad = torch.arange(states.shape[1], device=states.device)[None, :] >= lens[:, None]
    return states.masked_fill(pad[..., None], 0.0)


# ----------------------------------------------------------------------------- VAE


def vae_factors(vae: torch.nn.Module) -> tuple[int, int]:
    """(temporal, spatial) downsampling factors of an ``AutoencoderKLWan`` from its config: temporal
    ``2 ** sum(temperal_downsample)``, spatial ``2 ** len(temperal_downsample)`` (times ``patch_size``
    where set). Raises if the config's ``scale_factor_temporal`` / ``scale_factor_spatial`` (what diffusers'
    Wan pipelines read) disagree."""
    cfg = vae.config
    down = list(cfg.temperal_downsample)
    temporal = 2 ** sum(bool(d) for d in down)
    spatial = 2 ** len(down) * int(getattr(cfg, "patch_size", None) or 1)
    for key, derived in (("scale_factor_temporal", temporal), ("scale_factor_spatial", spatial)):
        given = getattr(cfg, key, None)
        if given is not None and int(given) != derived:
            raise ValueError(
                f"vae/config.json: {key}={given} disagrees with temperal_downsample={down} "
                f"(which gives {derived}); fix the config so diffusers' pipelines and the policy agree"
            )
    return temporal, spatial


def latent_frames(num_frames: int, temporal: int) -> int:
    """Latent frames of a `num_frames` video: ``(num_frames - 1) // temporal + 1`` (Wan's causal VAE keeps
    the first frame alone)."""
    return (num_frames - 1) // temporal + 1


def latent_stats(vae: torch.nn.Module, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """(mean, std), each Float[1, z_dim, 1, 1, 1] fp32: the VAE config's ``latents_mean`` / ``latents_std``."""
    cfg = vae.config
    z = int(cfg.z_dim)
    mean = torch.tensor(cfg.latents_mean, dtype=torch.float32, device=device).view(1, z, 1, 1, 1)
    std = torch.tensor(cfg.latents_std, dtype=torch.float32, device=device).view(1, z, 1, 1, 1)
    return mean, std


def _vae_dtype(vae: torch.nn.Module) -> torch.dtype:
    return next(vae.parameters()).dtype


@torch.no_grad()
def _encode_raw(vae: torch.nn.Module, pixels: Tensor) -> Tensor:
    """Normalised latents Float[1, z, f, h, w] (fp32) of one clip [1, 3, F, H, W] in [-1, 1]: the mode of
    the VAE posterior, then ``(z - mean) / std`` computed as the pipelines do (times 1 / std)."""
    mean, std = latent_stats(vae, pixels.device)
    z = vae.encode(pixels.to(_vae_dtype(vae))).latent_dist.mode()
    return (z.float() - mean) * (1.0 / std)


@torch.no_grad()
def encode_video(vae: torch.nn.Module, video: Tensor) -> Tensor:
    """Float[B, z, f, h, w] normalised latents (fp32) of videos Float[B, F, 3, H, W] in [0, 1], each video
    encoded on its own (as ``WanVideoToVideoPipeline.prepare_latents`` does)."""
    pixels = (video.movedim(2, 1) * 2 - 1).to(next(vae.parameters()).device)
    return torch.cat([_encode_raw(vae, pixels[i : i + 1]) for i in range(pixels.shape[0])])


@torch.no_grad()
def decode_video(vae: torch.nn.Module, latents: Tensor) -> Tensor:
    """Float[B, F, 3, H, W] in [0, 1] on the CPU of normalised latents [B, z, f, h, w]: ``z * std + mean``
    (the pipelines' ``z / (1 / std) + mean``), the VAE's decode of the whole clip, ``x / 2 + 0.5`` clamped."""
    dev = next(vae.parameters()).device
    mean, std = latent_stats(vae, dev)
    dtype = _vae_dtype(vae)
    z = latents.to(dev, dtype) / (1.0 / std).to(dtype) + mean.to(dtype)
    video = vae.decode(z, return_dict=False)[0].float()
    return (video / 2 + 0.5).clamp(0, 1).movedim(1, 2).cpu()


# ----------------------------------------------------------------------------- image to video


def i2v_mask(batch: int, num_frames: int, temporal: int, height: int, width: int) -> Tensor:
    """Float[B, temporal, F_lat, h, w]: ``WanImageToVideoPipeline.prepare_latents``' first-frame mask at latent
    size h x w -- 1 for pixel frame 0 (repeated `temporal` times, since the causal VAE keeps it alone in its
    latent frame), 0 for frames 1..F-1, regrouped so that channel k of latent frame j is pixel frame
    ``j * temporal + k`` of that padded sequence."""
    f_lat = latent_frames(num_frames, temporal)
    m = torch.zeros(batch, 1, num_frames, height, width)
    m[:, :, 0] = 1
    m = torch.cat([m[:, :, :1].repeat_interleave(temporal, dim=2), m[:, :, 1:]], dim=2)
    return m.view(batch, f_lat, temporal, height, width).transpose(1, 2)


@torch.no_grad()
def i2v_condition(vae: torch.nn.Module, images: Tensor, num_frames: int) -> Tensor:
    """Float[B, temporal + z, F_lat, h, w] (fp32): the image-to-video conditioning of first frames
    Float[B, 3, H, W] in [0, 1] -- `i2v_mask`, then the normalised VAE latents of each image followed by
    ``num_frames - 1`` zero frames ([-1, 1] pixels), encoded as one clip (see the module docstring)."""
    b, _, h, w = images.shape
    temporal, spatial = vae_factors(vae)
    dev = next(vae.parameters()).device
    first = (images.float() * 2 - 1).to(dev)[:, :, None]
    clip = torch.cat([first, first.new_zeros(b, 3, num_frames - 1, h, w)], dim=2)
    latents = torch.cat([_encode_raw(vae, clip[i : i + 1]) for i in range(b)])
    mask = i2v_mask(b, num_frames, temporal, h // spatial, w // spatial).to(latents)
    return torch.cat([mask, latents], dim=1)


@torch.no_grad()
def encode_image(image_encoder: torch.nn.Module, image_processor: Any, images: Tensor) -> Tensor:
    """Float[B, N, D] (fp32): ``WanImageToVideoPipeline.encode_image`` -- the penultimate hidden states of the
    CLIP vision tower on `image_processor`'s input of images Float[B, 3, H, W] in [0, 1] (handed over as uint8
    arrays, as a PIL image of the same pixels would be)."""
    arrays = [(im.permute(1, 2, 0).clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy() for im in images]
    dev = next(image_encoder.parameters()).device
    inputs = image_processor(images=arrays, return_tensors="pt").to(dev)
    return image_encoder(**inputs, output_hidden_states=True).hidden_states[-2].float()


# ----------------------------------------------------------------------------- VACE


def vace_mask_channels(mask: Tensor, spatial: int, temporal: int, patch: int = 1) -> Tensor:
    """Float[B, s*s, f, h, w]: ``WanVACEPipeline.prepare_masks`` for a batch of masks Float[B, F, H, W]
    (already binarised): each s x s block folded into s^2 channels (row offset major), then the frames
    resampled to ``f = ceil(F / temporal)`` with ``nearest-exact``. H and W must be multiples of
    ``spatial * patch`` (the pipeline's own requirement)."""
    b, f, h, w = mask.shape
    base = spatial * patch
    if h % base or w % base:
        raise ValueError(
            f"the mask is {h}x{w} pixels; height and width must be multiples of the VAE's spatial factor "
            f"times the transformer's patch size ({spatial} * {patch} = {base})"
        )
    nh, nw = h // spatial, w // spatial
    m = mask.view(b, f, nh, spatial, nw, spatial).permute(0, 3, 5, 1, 2, 4).flatten(1, 2)
    new_f = (f + temporal - 1) // temporal
    return torch.nn.functional.interpolate(m, size=(new_f, nh, nw), mode="nearest-exact")


def letterbox_reference(image: Tensor, height: int, width: int) -> Tensor:
    """Float[3, height, width] in [-1, 1]: a reference image Float[3, h, w] in [0, 1] resized (bilinear,
    aspect kept) to fit and centred on a white canvas -- ``WanVACEPipeline.preprocess_conditions``."""
    img = image.float()[None] * 2 - 1
    h, w = img.shape[-2:]
    scale = min(height / h, width / w)
    nh, nw = int(h * scale), int(w * scale)
    resized = torch.nn.functional.interpolate(img, size=(nh, nw), mode="bilinear", align_corners=False)[0]
    canvas = torch.ones(3, height, width, dtype=resized.dtype)
    top, left = (height - nh) // 2, (width - nw) // 2
    canvas[:, top : top + nh, left : left + nw] = resized
    return canvas


@torch.no_grad()
def vace_control_tensor(
    vae: torch.nn.Module,
    video: Tensor,
    mask: Tensor | None = None,
    *,
    patch_size: int = 1,
    reference_frames: list[Tensor] | list[list[Tensor]] | None = None,
) -> Tensor:
    """Float[B, 2 z + s^2, R + f, h, w] (fp32): the VACE control tensor of videos Float[B, F, 3, H, W] in
    [0, 1] and masks Float[B, F, H, W] (1 = regenerate; None: all ones, as the pipeline's default), for any
    batch size; see the module docstring for the channel layout. `patch_size`: the transformer's spatial
    patch (``config.patch_size[1]``), which H and W must be multiples of times the VAE's spatial factor.
    `reference_frames`: per video, R images in [0, 1] (a Float[R, 3, h', w'] stack or a list of Float[3, h',
    w'] of any sizes; the same R for every video), prepended as ``WanVACEPipeline`` does with
    ``reference_images``."""
    b, _, _, height, width = video.shape
    temporal, spatial = vae_factors(vae)
    dev = next(vae.parameters()).device
    pixels = (video.float().movedim(2, 1) * 2 - 1).to(dev)  # [B, 3, F, H, W] in [-1, 1]
    m = torch.ones_like(video[:, :, 0]) if mask is None else mask.float()
    m = torch.where(m > 0.5, 1.0, 0.0).to(dev)
    m5 = m[:, None]
    rows = []
    for i in range(b):
        inactive = _encode_raw(vae, pixels[i : i + 1] * (1 - m5[i : i + 1]))
        reactive = _encode_raw(vae, pixels[i : i + 1] * m5[i : i + 1])
        rows.append(torch.cat([inactive, reactive], dim=1))
    latents = torch.cat(rows)
    masks = vace_mask_channels(m, spatial, temporal, patch_size)
    if reference_frames is not None:
        counts = {len(r) for r in reference_frames}
        if len(reference_frames) != b or len(counts) != 1:
            raise ValueError(
                f"reference_frames: one stack per video with the same number of frames each; got "
                f"{[len(r) for r in reference_frames]} for {b} videos"
            )
        lat_rows, mask_rows = [], []
        for i, refs in enumerate(reference_frames):
            lat_i = latents[i]
            for ref in refs:  # as the pipeline: each reference prepended in turn
                canvas = letterbox_reference(ref, height, width).to(dev)
                r = _encode_raw(vae, canvas[None, :, None])[0]  # [z, 1, h, w]
                lat_i = torch.cat([torch.cat([r, torch.zeros_like(r)]), lat_i], dim=1)
            lat_rows.append(lat_i)
            n_ref = len(refs)
            mask_rows.append(torch.cat([torch.zeros_like(masks[i][:, :n_ref]), masks[i]], dim=1))
        latents, masks = torch.stack(lat_rows), torch.stack(mask_rows)
    return torch.cat([latents, masks.to(latents.dtype)], dim=1)
