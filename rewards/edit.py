"""Image-editing rewards: `clip_directional`, `image_vlm_judge`, `image_psnr`, `image_ssim`.

- ``clip_directional`` (instruction following): the CLIP directional similarity
  ``cos(E_img(edit) - E_img(source), E_txt(target caption) - E_txt(source caption))`` with L2-normalised
  CLIP embeddings: did the image change the way the captions change?
- ``image_vlm_judge`` (instruction following): P("yes") of a VLM shown the source image and the edit and asked
  whether the instruction was carried out (``vlm_judge``'s model call, `rewards.video.VlmJudge`).
- ``image_psnr`` / ``image_ssim`` (preservation): PSNR and SSIM of the edit against its source, by default
  only OUTSIDE the edit region; the pixel math is ``video_psnr`` / ``video_ssim``'s (`rewards.video`) on
  one-frame videos.
- (``shapes_edit_accuracy``, the offline edit world of `mmalign.tiny.image_edit` scored from the pixels, lives
  with that world's fixtures: `mmalign.tiny.world_rewards`, built on `box_mask` and `fraction_boxes`.)

Inputs. Every reward reads the edits from ``batch.outputs["images"]`` (Float[B,3,H,W] in [0, 1]). The
source image is ``outputs["source_images"]`` (Float[B,3,H,W], same size) when present, else the dataset
column ``source_image`` (option ``source_column``: a path or a PIL image per row), read as RGB and resized
to the edit's size with Lanczos when the sizes differ (what `FluxKontextPolicy` conditions on). The edit
region is ``outputs["edit_masks"]`` (Float[B,H,W], 1 = edit), else per row the column ``edit_mask`` (a
mask image, `mmalign.data.media.read_mask`: grey > 0.5 is the edit region; resized nearest-neighbour), else the
column ``edit_bbox``: one box ``[x0, y0, x1, y1]`` or a list of boxes, as FRACTIONS of the image width and
height (a pixel belongs to a box when its centre does: ``x0 W <= x + 0.5 < x1 W``, likewise in y). A row
without a source (or, for a region, without a mask and a box) scores NaN; a batch that has neither the
mask nor the box column is a KeyError naming both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .base import Reward, RewardBatch, register_reward
from .image import CLIPEmbedder, batch_images
from .video import REGIONS, VideoPSNR, VideoSSIM, VlmJudge

__all__ = [
    "EDIT_JUDGE_QUESTIONS",
    "ClipDirectional",
    "ImageVlmJudge",
    "ImagePSNR",
    "ImageSSIM",
    "box_mask",
    "edit_masks",
    "fraction_boxes",
    "source_images",
]


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, str) and v == "") or (isinstance(v, float) and math.isnan(v))


def _read_rgb(value: Any, height: int, width: int) -> Tensor:
    """Float[3, height, width] in [0, 1] of a path or PIL image (Lanczos resize when the size differs)."""
    import numpy as np
    from PIL import Image

    from mmalign.data.media import load_rgb

    pil = load_rgb(value)
    if pil.size != (width, height):
        pil = pil.resize((width, height), resample=Image.Resampling.LANCZOS)
    return torch.from_numpy(np.asarray(pil, dtype=np.float32).copy()).permute(2, 0, 1) / 255.0


def source_images(reward: Reward, batch: RewardBatch, images: Tensor, column: str) -> tuple[Tensor, Tensor]:
    """(source images Float[B,3,H,W] at the edits' size, Bool[B] rows that have one): ``outputs["source_images"]``
    or the column `column` (each distinct path read once per call)."""
    b, _, h, w = images.shape
    if "source_images" in batch.outputs:
        src = batch.outputs["source_images"]
        if not isinstance(src, Tensor) or tuple(src.shape) != tuple(images.shape):
            got = tuple(src.shape) if isinstance(src, Tensor) else type(src).__name__
            raise ValueError(
                f"reward {reward.name!r}: outputs['source_images'] has shape {got} but outputs['images'] has "
                f"{tuple(images.shape)}; they must match"
            )
        return src.float(), torch.ones(b, dtype=torch.bool)
    if column not in batch.columns:
        raise KeyError(
            f"reward {reward.name!r} needs outputs['source_images'] or the dataset column {column!r} (the source "
            f"image of each row); columns: {sorted(batch.columns) or 'none'}"
        )
    out = torch.zeros(b, 3, h, w)
    found = torch.zeros(b, dtype=torch.bool)
    cache: dict[Any, Tensor] = {}
    for i, v in enumerate(batch.columns[column]):
        if _missing(v):
            continue
        key = v if isinstance(v, str) else id(v)
        if key not in cache:
            cache[key] = _read_rgb(v, h, w)
        out[i], found[i] = cache[key], True
    return out, found


def fraction_boxes(value: Any, where: str) -> list[list[float]]:
    """One box or a list of boxes as a list of [x0, y0, x1, y1] fractions of the image; a ValueError starting
    with `where` (the reward, row and column) for anything else."""
    if isinstance(value, Sequence) and len(value) == 4 and all(isinstance(v, int | float) for v in value):
        value = [value]
    if not isinstance(value, Sequence) or not value:
        raise ValueError(f"{where}: expected a box [x0, y0, x1, y1] or a list of boxes, got {value!r}")
    out = []
    for box in value:
        if not (isinstance(box, Sequence) and len(box) == 4 and all(isinstance(v, int | float) for v in box)):
            raise ValueError(f"{where}: a box is [x0, y0, x1, y1], got {box!r}")
        x0, y0, x1, y1 = (float(v) for v in box)
        if not (0 <= x0 <= x1 <= 1 and 0 <= y0 <= y1 <= 1):
            raise ValueError(
                f"{where}: box {list(box)} must be fractions of the image with 0 <= x0 <= x1 <= 1 and "
                "0 <= y0 <= y1 <= 1"
            )
        out.append([x0, y0, x1, y1])
    return out


def box_mask(boxes: Sequence[Sequence[float]], height: int, width: int, margin: int = 0) -> Tensor:
    """Float[height, width]: 1 on the pixels whose centre lies in one of `boxes` ([x0, y0, x1, y1] fractions:
    ``x0 W <= x + 0.5 < x1 W``), each box widened by `margin` pixels on every side."""
    xs = torch.arange(width, dtype=torch.float64) + 0.5
    ys = torch.arange(height, dtype=torch.float64) + 0.5
    m = torch.zeros(height, width, dtype=torch.bool)
    for x0, y0, x1, y1 in boxes:
        inx = (xs >= x0 * width - margin) & (xs < x1 * width + margin)
        iny = (ys >= y0 * height - margin) & (ys < y1 * height + margin)
        m |= iny[:, None] & inx[None, :]
    return m.float()


def edit_masks(
    reward: Reward, batch: RewardBatch, images: Tensor, mask_column: str, bbox_column: str
) -> tuple[Tensor, Tensor]:
    """(edit masks Float[B,H,W], 1 = the edit region, Bool[B] rows that have one): ``outputs["edit_masks"]``,
    else per row the mask image of `mask_column`, else the box(es) of `bbox_column` (see the module docstring)."""
    from mmalign.data.media import read_mask

    b, _, h, w = images.shape
    if "edit_masks" in batch.outputs:
        m = batch.outputs["edit_masks"]
        if not isinstance(m, Tensor) or tuple(m.shape) != (b, h, w):
            got = tuple(m.shape) if isinstance(m, Tensor) else type(m).__name__
            raise ValueError(
                f"reward {reward.name!r}: outputs['edit_masks'] has shape {got}; expected {(b, h, w)}"
            )
        return m.float(), torch.ones(b, dtype=torch.bool)
    masks_col, boxes_col = batch.columns.get(mask_column), batch.columns.get(bbox_column)
    if masks_col is None and boxes_col is None:
        raise KeyError(
            f"reward {reward.name!r}: the edit region comes from outputs['edit_masks'], the column "
            f"{mask_column!r} (a mask image) or the column {bbox_column!r} (boxes as fractions); none is there "
            f"(columns: {sorted(batch.columns) or 'none'}); region='all' needs none"
        )
    out = torch.zeros(b, h, w)
    found = torch.zeros(b, dtype=torch.bool)
    cache: dict[str, Tensor] = {}
    for i in range(b):
        path = masks_col[i] if masks_col is not None else None
        if not _missing(path):
            key = str(path)
            if key not in cache:
                m = read_mask(path)[0].float()
                if tuple(m.shape) != (h, w):
                    m = torch.nn.functional.interpolate(m[None, None], size=(h, w), mode="nearest")[0, 0]
                cache[key] = m
            out[i], found[i] = cache[key], True
            continue
        boxes = boxes_col[i] if boxes_col is not None else None
        if not _missing(boxes):
            out[i] = box_mask(
                fraction_boxes(boxes, f"reward {reward.name!r}: row {i}: column {bbox_column!r}"), h, w
            )
            found[i] = True
    return out, found


def _check_region(reward: Reward, region: str) -> str:
    if region not in REGIONS:
        raise ValueError(f"reward {reward.name!r}: region must be one of {list(REGIONS)}, got {region!r}")
    return region


# =========================================================================== instruction following
@register_reward("clip_directional")
class ClipDirectional(Reward):
    """CLIP directional similarity: cos(E_img(edit) - E_img(source), E_txt(target caption) - E_txt(source caption)).

    The embeddings are CLIP's L2-normalised image and text embeddings (`rewards.image.CLIPEmbedder`, loaded
    from `path` like ``clip_score``); the captions are the columns `target_column` (``target_caption``) and
    `caption_column` (``source_caption``). In [-1, 1] (times `scale`): 1 when the image moved in CLIP space
    exactly along the caption change. An edit identical to its source (no image direction) or identical
    captions give 0; a row without a source image or a caption, NaN.
    """

    needs = {"images"}

    def __init__(
        self,
        *,
        path: str,
        backend: str = "hf",
        arch: str | None = None,
        source_column: str = "source_image",
        target_column: str = "target_caption",
        caption_column: str = "source_caption",
        scale: float = 1.0,
        batch_size: int = 64,
        device: str | None = None,
    ) -> None:
        if int(batch_size) < 1:
            raise ValueError(f"reward {self.name!r}: batch_size must be >= 1, got {batch_size}")
        self.clip = CLIPEmbedder(path, backend=backend, arch=arch, device=device)
        self.source_column, self.target_column, self.caption_column = (
            source_column,
            target_column,
            caption_column,
        )
        self.scale = float(scale)
        self.batch_size = int(batch_size)

    def _embed_images(self, images: Tensor) -> Tensor:
        parts = [
            self.clip.encode_images(images[s : s + self.batch_size])
            for s in range(0, images.shape[0], self.batch_size)
        ]
        return torch.cat(parts).cpu().double()

    def _embed_texts(self, texts: list[str]) -> Tensor:
        parts = [
            self.clip.encode_texts(texts[s : s + self.batch_size])
            for s in range(0, len(texts), self.batch_size)
        ]
        return torch.cat(parts).cpu().double()

    def __call__(self, batch: RewardBatch) -> Tensor:
        images = batch_images(self, batch)
        src, found = source_images(self, batch, images, self.source_column)
        for col in (self.target_column, self.caption_column):
            if col not in batch.columns:
                raise KeyError(
                    f"reward {self.name!r}: caption column {col!r} is not in the dataset; "
                    f"columns: {sorted(batch.columns) or 'none'}"
                )
        tgt_txt = batch.columns[self.target_column]
        src_txt = batch.columns[self.caption_column]
        ok = found & torch.tensor([not (_missing(a) or _missing(c)) for a, c in zip(tgt_txt, src_txt)])
        out = torch.full((len(batch),), math.nan)
        rows = torch.nonzero(ok).flatten().tolist()
        if not rows:
            return out
        d_img = self._embed_images(images[rows].float()) - self._embed_images(src[rows])
        d_txt = self._embed_texts([str(tgt_txt[i]) for i in rows]) - self._embed_texts(
            [str(src_txt[i]) for i in rows]
        )
        norms = d_img.norm(dim=-1) * d_txt.norm(dim=-1)
        cos = torch.where(
            norms > 1e-12, (d_img * d_txt).sum(-1) / norms.clamp_min(1e-12), torch.zeros_like(norms)
        )
        out[rows] = (self.scale * cos).float()
        return out


EDIT_JUDGE_QUESTIONS = (
    'The first image is the original and the second is the edited image. Was the instruction "{prompt}" '
    "carried out? Answer yes or no.",
)
"""``image_vlm_judge``'s default question (``{prompt}`` is the row's instruction, the batch prompt)."""


@register_reward("image_vlm_judge")
class ImageVlmJudge(Reward):
    """VLM judge of an edit: P("yes") of a VLM shown the source image, then the edit, asked each question.

    The model call and the answer probabilities are ``vlm_judge``'s (`rewards.video.VlmJudge` in
    ``mode="images"``: P(yes) renormalised over the yes / no first tokens, averaged over the questions), on a
    two-image chat: the source (``outputs["source_images"]`` or the column `source_column`, resized to the
    edit's size) and the edit. With ``show_source=False`` the VLM sees the edit alone. Question placeholders:
    ``{prompt}`` (the instruction), ``{instruction}`` (column `instruction_column`), ``{target_caption}`` /
    ``{source_caption}`` (columns `target_column` / `caption_column`). In [0, 1]; a row without a source image
    scores NaN. ``path``: a Qwen2-VL-style folder or hub id (`AutoModelForImageTextToText`).
    """

    needs = {"images", "prompts"}

    def __init__(
        self,
        *,
        path: str,
        questions: Sequence[str] | str = EDIT_JUDGE_QUESTIONS,
        show_source: bool = True,
        source_column: str = "source_image",
        instruction_column: str = "instruction",
        target_column: str = "target_caption",
        caption_column: str = "source_caption",
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        batch_size: int = 8,
        device: str | None = None,
        dtype: str | None = None,
    ) -> None:
        self.show_source = bool(show_source)
        self.source_column = source_column
        self.judge = VlmJudge(
            path=path,
            questions=questions,
            frames="all",
            mode="images",
            instruction_column=instruction_column,
            target_column=target_column,
            source_column=caption_column,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            batch_size=batch_size,
            device=device,
            dtype=dtype,
        )
        self.judge.name = self.name  # its errors at call time name this reward

    def __call__(self, batch: RewardBatch) -> Tensor:
        images = batch_images(self, batch).float()
        found = torch.ones(images.shape[0], dtype=torch.bool)
        shown = [images]
        if self.show_source:
            src, found = source_images(self, batch, images, self.source_column)
            shown = [src.to(images.device), images]
        videos = torch.stack(shown, dim=1)  # [B, 1 or 2, 3, H, W]: the chat's images in order
        values = self.judge(
            RewardBatch(prompts=list(batch.prompts), outputs={"videos": videos}, columns=batch.columns)
        ).float()
        self.last_metrics = {k: v for k, v in self.judge.last_metrics.items() if k != "frames"}
        return torch.where(found, values, torch.full_like(values, math.nan))


# =========================================================================== preservation
class _OneFrame(Reward):
    """Runs a ``video_*`` pixel metric on one-frame videos built from the images, sources and edit masks."""

    needs = {"images"}
    metric: Reward

    def _setup(self, source_column: str, mask_column: str, bbox_column: str) -> None:
        self.source_column, self.mask_column, self.bbox_column = source_column, mask_column, bbox_column
        self.metric.name = self.name  # its errors name this reward

    def __call__(self, batch: RewardBatch) -> Tensor:
        images = batch_images(self, batch).float()
        src, found = source_images(self, batch, images, self.source_column)
        outputs: dict[str, Any] = {"videos": images[:, None], "source_videos": src.to(images.device)[:, None]}
        if self.region != "all":
            masks, have = edit_masks(self, batch, images, self.mask_column, self.bbox_column)
            outputs["edit_masks"] = masks.to(images.device)[:, None]
            found = found & have
        values = self.metric(RewardBatch(prompts=list(batch.prompts), outputs=outputs))
        self.last_metrics = {
            k: v for k, v in getattr(self.metric, "last_metrics", {}).items() if k != "frames"
        }
        return torch.where(found, values.float(), torch.full_like(values.float(), math.nan))


@register_reward("image_psnr")
class ImagePSNR(_OneFrame):
    """PSNR (dB) of the edit against its source image, by default only outside the edit region (preservation).

    ``10 log10(1 / MSE)`` (data range 1), the MSE pooled over the channels and the region's pixels; an
    identical region gives `max_db` (100 dB by default, also the cap). ``region``: "outside" (default: the
    pixels the edit should keep), "inside" or "all". The same math as ``video_psnr`` with one frame.
    """

    def __init__(
        self,
        *,
        region: str = "outside",
        max_db: float = 100.0,
        source_column: str = "source_image",
        mask_column: str = "edit_mask",
        bbox_column: str = "edit_bbox",
        device: str | None = None,
    ) -> None:
        self.region = _check_region(self, region)
        self.metric = VideoPSNR(region=region, max_db=max_db, device=device)
        self._setup(source_column, mask_column, bbox_column)


@register_reward("image_ssim")
class ImageSSIM(_OneFrame):
    """SSIM of the edit against its source image (Gaussian window 11, sigma 1.5), by default outside the edit.

    Wang et al.'s SSIM per channel (C1 = 0.01^2, C2 = 0.03^2 on [0, 1] data), averaged over the channels;
    the SSIM map (valid filtering: window centres at least ``window // 2`` pixels from the border) is averaged
    over the centres in the region (``region``: "outside" by default, "inside", "all"). 1 for an identical
    region. The same math as ``video_ssim`` with one frame; images need at least `window` pixels a side.
    """

    def __init__(
        self,
        *,
        region: str = "outside",
        window: int = 11,
        sigma: float = 1.5,
        source_column: str = "source_image",
        mask_column: str = "edit_mask",
        bbox_column: str = "edit_bbox",
        device: str | None = None,
    ) -> None:
        self.region = _check_region(self, region)
        self.metric = VideoSSIM(region=region, window=window, sigma=sigma, device=device)
        self._setup(source_column, mask_column, bbox_column)
