"""Image-editing rewards: `clip_directional`, `image_vlm_judge`, `image_psnr`, `image_ssim`,
`shapes_edit_accuracy`.

- ``clip_directional`` (instruction following): the CLIP directional similarity
  ``cos(E_img(edit) - E_img(source), E_txt(target caption) - E_txt(source caption))`` with L2-normalised
  CLIP embeddings: did the image change the way the captions change?
- ``image_vlm_judge`` (instruction following): P("yes") of a VLM shown the source image and the edit and asked
  whether the instruction was carried out (``vlm_judge``'s model call, `rewards.video.VlmJudge`).
- ``image_psnr`` / ``image_ssim`` (preservation): PSNR and SSIM of the edit against its source, by default
  only OUTSIDE the edit region; the pixel math is ``video_psnr`` / ``video_ssim``'s (`rewards.video`) on
  one-frame videos.
- ``shapes_edit_accuracy``: the edit world of `mmalign.tiny.image_edit` scored from the pixels: is every
  square of the target scene there in its colour, and is everything else background?

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
from .image import CLIPEmbedder, batch_images, colour_mask
from .video import REGIONS, VideoPSNR, VideoSSIM, VlmJudge

__all__ = [
    "EDIT_JUDGE_QUESTIONS",
    "SHAPES_EDIT_MODES",
    "ClipDirectional",
    "ImageVlmJudge",
    "ImagePSNR",
    "ImageSSIM",
    "ShapesEditAccuracy",
    "box_mask",
    "edit_masks",
    "source_images",
]


SHAPES_EDIT_MODES = ("checks", "exact", "soft")
"""How ``shapes_edit_accuracy`` turns its checks into a number (see `ShapesEditAccuracy`)."""


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


def _boxes(value: Any, where: str) -> list[list[float]]:
    """One box or a list of boxes as a list of [x0, y0, x1, y1] fractions (checked)."""
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
            out[i] = box_mask(_boxes(boxes, f"reward {reward.name!r}: row {i}: column {bbox_column!r}"), h, w)
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


# =========================================================================== the shapes edit world
@register_reward("shapes_edit_accuracy")
class ShapesEditAccuracy(Reward):
    """Shapes edit world: the share of checks the pixels pass (each target square there, the rest background).

    The column `objects_column` (``target_objects``) lists the target scene's squares, each
    ``{"colour": <palette colour>, "box": [x0, y0, x1, y1]}`` (fractions, as ``edit_bbox``). Checks:

    - one per square: at least `min_fill` of the pixels of its box are within `threshold` (Euclidean RGB
      distance in [0, 1], as ``shapes_compositional``) of its palette colour;
    - one for the rest: at least `min_background` of the pixels outside every box (widened by `margin`
      pixels, where the edges of a drawn square may blur) are within `threshold` of the `background` colour.

    So "make the red square blue" passes when the blue square is where the red one was, the other squares are
    unchanged and no red is left anywhere else. ``mode``:

    - ``"checks"`` (default): the share of passed checks (one per square plus one);
    - ``"exact"``: 1 when every check passes, else 0 (the edit accuracy);
    - ``"soft"``: the mean of the measured shares themselves (each square's share of pixels of its colour, the
      background's share of background pixels) instead of pass / fail: continuous, so the samples of a group
      rarely tie (a denser training signal); 1 for a perfect edit.

    ``last_metrics``: ``objects_ok`` (share of square checks passed), ``background_ok`` and ``exact`` (share of
    samples that pass every check), whatever the mode. A row without the column (None) scores NaN.
    """

    needs = {"images"}

    def __init__(
        self,
        *,
        objects_column: str = "target_objects",
        threshold: float = 0.25,
        min_fill: float = 0.6,
        min_background: float = 0.95,
        margin: int = 1,
        background: Sequence[float] = (255, 255, 255),
        mode: str = "checks",
        device: str | None = None,
    ) -> None:
        if mode not in SHAPES_EDIT_MODES:
            raise ValueError(
                f"reward {self.name!r}: mode must be one of {list(SHAPES_EDIT_MODES)}, got {mode!r}"
            )
        for key, v in (("min_fill", min_fill), ("min_background", min_background)):
            if not 0 <= float(v) <= 1:
                raise ValueError(f"reward {self.name!r}: {key} must be in [0, 1], got {v}")
        if int(margin) < 0:
            raise ValueError(f"reward {self.name!r}: margin must be >= 0, got {margin}")
        if len(background) != 3:
            raise ValueError(f"reward {self.name!r}: background must be an RGB triple, got {background!r}")
        self.objects_column = objects_column
        self.threshold, self.min_fill, self.min_background = (
            float(threshold),
            float(min_fill),
            float(min_background),
        )
        self.margin = int(margin)
        self.background = [float(v) for v in background]
        self.mode = mode
        self.device = device

    def __call__(self, batch: RewardBatch) -> Tensor:
        from mmalign.tiny.world import check_colour

        images = batch_images(self, batch).detach().float()
        if self.device is not None:
            images = images.to(self.device)
        if self.objects_column not in batch.columns:
            raise KeyError(
                f"reward {self.name!r}: objects column {self.objects_column!r} is not in the dataset; "
                f"columns: {sorted(batch.columns) or 'none'}"
            )
        b, _, h, w = images.shape
        out = torch.full((b,), math.nan)
        bg = colour_mask(images, self.background, self.threshold)  # [B,H,W]
        obj_ok, obj_n, bg_ok, exact, scored = 0, 0, 0, 0, 0
        for i, objects in enumerate(batch.columns[self.objects_column]):
            if objects is None:
                continue
            if not isinstance(objects, Sequence) or isinstance(objects, str):
                raise ValueError(
                    f"reward {self.name!r}: row {i}: column {self.objects_column!r} must be a list of "
                    f"{{'colour', 'box'}} objects, got {str(objects)[:80]!r}"
                )
            where = f"reward {self.name!r}: row {i}: column {self.objects_column!r}"
            passed, shares, boxes = [], [], []
            for obj in objects:
                if not isinstance(obj, dict) or "colour" not in obj or "box" not in obj:
                    raise ValueError(
                        f"{where}: each object is {{'colour': ..., 'box': [x0, y0, x1, y1]}}, got {obj!r}"
                    )
                check_colour(obj["colour"])
                box = _boxes(obj["box"], where)
                boxes += box
                inside = box_mask(box, h, w).bool().to(images.device)
                fill = colour_mask(images[i : i + 1], obj["colour"], self.threshold)[0][inside]
                shares.append(float(fill.float().mean()) if fill.numel() else 0.0)
                passed.append(bool(fill.numel() and shares[-1] >= self.min_fill))
            rest = ~box_mask(boxes, h, w, self.margin).bool().to(images.device) if boxes else None
            keep = bg[i] if rest is None else bg[i][rest]
            shares.append(float(keep.float().mean()) if keep.numel() else 1.0)
            background_ok = shares[-1] >= self.min_background
            checks = [*passed, background_ok]
            all_ok = all(checks)
            if self.mode == "exact":
                out[i] = float(all_ok)
            else:
                out[i] = sum(shares if self.mode == "soft" else checks) / len(checks)
            obj_ok, obj_n = obj_ok + sum(passed), obj_n + len(passed)
            bg_ok, exact, scored = bg_ok + background_ok, exact + all_ok, scored + 1
        if scored:
            self.last_metrics = {
                "objects_ok": obj_ok / max(1, obj_n),
                "background_ok": bg_ok / scored,
                "exact": exact / scored,
            }
        return out
