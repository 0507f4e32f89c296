"""`FluxKontextPolicy`: FLUX.1 Kontext (instruction-based image editing) as a flow-matching GRPO policy.

A `mmalign.policies.flux.FluxPolicy` whose every sample also sees a source image, the way diffusers'
``FluxKontextPipeline`` feeds it (its packed latents ride along the sequence at every step).

Details: docs/image_edit.md, "The policy: `FluxKontextPolicy`", and docs/algorithms.md, "FLUX.1 Kontext inputs".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.data.rows import DataError
from mmalign.policies.flux import FluxPolicy, latent_image_ids, pack_latents, unpack_latents

__all__ = ["FluxKontextPolicy", "kontext_image_ids", "load_source_pixels"]

ENCODE_BATCH = 8
"""Source images encoded by the VAE at once."""


def kontext_image_ids(
    rows: int, cols: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Tensor:
    """Float[rows * cols, 3]: the position ids of the packed SOURCE image tokens, (1, row, column) row-major
    (`latent_image_ids` with the first coordinate set to 1, as Kontext marks its context image)."""
    ids = latent_image_ids(rows, cols, device, dtype)
    ids[:, 0] = 1
    return ids


def load_source_pixels(image: Any, height: int, width: int) -> Tensor:
    """Float[3, height, width] in [-1, 1] of `image` (a path or a PIL image): RGB, resized with Lanczos when
    its size differs (diffusers' ``VaeImageProcessor`` default), then ``2 x - 1``."""
    import numpy as np
    from PIL import Image

    from mmalign.data.media import load_rgb

    pil = load_rgb(image)
    if pil.size != (width, height):
        pil = pil.resize((width, height), resample=Image.Resampling.LANCZOS)
    arr = torch.from_numpy(np.asarray(pil, dtype=np.float32).copy()).permute(2, 0, 1) / 255.0
    return arr * 2 - 1


def distinct_sources(
    columns: dict[str, list[Any]], image_column: str, who: str
) -> tuple[list[Any], list[int]]:
    """The distinct source images of a batch (column `image_column`: paths, or images in memory, told apart by
    identity) and, per sample, the index of its image in that list, so each is read and encoded once; a missing
    column or value is a `DataError` naming `who` (the editing policies' row conditioning)."""
    values = columns.get(image_column)
    if values is None:
        raise DataError(
            f"{who}: the rows have no {image_column!r} column (the source image to edit; "
            f"columns: {sorted(columns) or 'none'})"
        )
    keys: dict[Any, int] = {}
    order: list[int] = []
    images: list[Any] = []
    for i, v in enumerate(values):
        if v is None or v == "":
            raise DataError(f"{who}: sample {i} has no {image_column!r} (a source image)")
        key = v if isinstance(v, str) else id(v)
        if key not in keys:
            keys[key] = len(images)
            images.append(v)
        order.append(keys[key])
    return images, order


class FluxKontextPolicy(FluxPolicy):
    """FLUX.1 Kontext: a `FluxPolicy` conditioned on each row's source image (see the module docstring)."""

    row_conditioning_keys = ("image_latents",)

    def __init__(
        self,
        transformer: torch.nn.Module,
        vae: torch.nn.Module,
        scheduler: Any,
        text_encoder: torch.nn.Module,
        tokenizer: Any,
        text_encoder_2: torch.nn.Module,
        tokenizer_2: Any,
        *,
        image_column: str = "source_image",
        **kwargs: Any,
    ) -> None:
        """The components of a FLUX.1 Kontext folder (as `FluxPolicy`); `image_column`: the dataset column
        holding each row's source image. Other keywords are `FluxPolicy`'s (``guidance_scale`` defaults to
        3.5 there; FLUX.1-Kontext-dev's model card uses 2.5)."""
        self.image_column = image_column
        super().__init__(
            transformer, vae, scheduler, text_encoder, tokenizer, text_encoder_2, tokenizer_2, **kwargs
        )

    # ------------------------------------------------------------------ the source image
    def pixel_size(self) -> int:
        """Side of the edited image in pixels: ``latent_size`` times the VAE's downsampling factor."""
        return self.latent_size * 2 ** (len(self.vae.config.block_out_channels) - 1)

    @torch.no_grad()
    def encode_source(self, pixels: Tensor) -> Tensor:
        """Float[B, C, h, w] (fp32, the policy's device): the scaled VAE latents of source images Float[B, 3,
        H, W] in [-1, 1], ``(mode(E(x)) - shift_factor) * scaling_factor``."""
        cfg = self.vae.config
        dtype = next(self.vae.parameters()).dtype
        out = []
        for s in range(0, pixels.shape[0], ENCODE_BATCH):
            x = pixels[s : s + ENCODE_BATCH].to(self.device, dtype)
            out.append(self.vae.encode(x).latent_dist.mode().float())
        z = torch.cat(out)
        return (z - float(getattr(cfg, "shift_factor", None) or 0.0)) * float(cfg.scaling_factor)

    def row_conditioning(self, columns: dict[str, list[Any]], group: Tensor) -> dict[str, Tensor]:
        """{"image_latents": Float[B, C, h, w]}: each sample's source image (column ``image_column``) encoded
        by `encode_source` at the output size; each distinct image of the batch is read and encoded once."""
        images, order = distinct_sources(columns, self.image_column, "FluxKontextPolicy")
        side = self.pixel_size()
        try:
            pixels = torch.stack([load_source_pixels(im, side, side) for im in images])
        except OSError as e:
            raise DataError(f"FluxKontextPolicy: column {self.image_column!r}: {e}") from e
        z = self.encode_source(pixels)
        return {"image_latents": z[torch.tensor(order, device=z.device)]}

    # ------------------------------------------------------------------ model
    def velocity(
        self, model: torch.nn.Module, latents: Tensor, sched: dict[str, Tensor], cond: dict[str, Tensor]
    ) -> Tensor:
        """One Kontext forward: the packed noisy latents, then the packed source latents along the sequence
        (ids (0, r, c) then (1, r, c)); the output's first tokens (the noisy ones) unpacked to [B, C, h, w]."""
        dtype = next(model.parameters()).dtype
        b, _, h, w = latents.shape
        src = cond["image_latents"]
        hs, ws = src.shape[-2:]
        tokens = pack_latents(latents)
        n = tokens.shape[1]
        pe = cond["prompt_embeds"]
        guidance = None
        if self.model.config.guidance_embeds:  # self.model: `model` may be a DDP wrapper
            guidance = torch.full(
                (b,), float(self.guidance_scale), device=latents.device, dtype=torch.float32
            )
        ids = torch.cat(
            [
                latent_image_ids(h // 2, w // 2, latents.device, dtype),
                kontext_image_ids(hs // 2, ws // 2, latents.device, dtype),
            ]
        )
        out = model(
            hidden_states=torch.cat([tokens, pack_latents(src.to(tokens.dtype))], dim=1).to(dtype),
            timestep=sched["sigmas"].to(dtype),
            guidance=guidance,
            pooled_projections=cond["pooled_embeds"].to(dtype),
            encoder_hidden_states=pe.to(dtype),
            txt_ids=torch.zeros((pe.shape[1], 3), device=latents.device, dtype=dtype),
            img_ids=ids,
            return_dict=False,
        )[0]
        return unpack_latents(out[:, :n].float(), h, w)

    def save(self, path: str | Path) -> None:
        """`FluxPolicy.save`, with ``model_index.json`` naming ``FluxKontextPipeline``."""
        super().save(path)
        mark_kontext_folder(path)


def mark_kontext_folder(path: str | Path) -> None:
    """Make the FLUX.1 folder `path`'s ``model_index.json`` name ``FluxKontextPipeline`` (diffusers'
    ``DiffusionPipeline.from_pretrained`` then builds the editing pipeline)."""
    index_path = Path(path) / "model_index.json"
    index = json.loads(index_path.read_text())
    index["_class_name"] = "FluxKontextPipeline"
    index_path.write_text(json.dumps(index, indent=2) + "\n")
