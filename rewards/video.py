"""Video rewards (video generation and video editing): `instruction_faithfulness`, `source_preservation`,
`video_preference`, `video_psnr`, `video_ssim`, `temporal_consistency`, `flicker`, `vlm_judge`,
`frame_aesthetic`.

Every reward reads ``outputs["videos"]`` (Float[B,F,3,H,W] in [0, 1]); the ones that compare with the source
read ``outputs["source_videos"]`` / ``outputs["edit_masks"]``, else the ``source_video`` / ``edit_mask``
columns (resampled to the edit's frames and size; a missing path scores NaN). Every reward takes ``frames``
(`frame_indices`); the comparing ones take ``region`` (``all`` / ``outside`` / ``inside`` the edit mask).
CLIP models load once, from local folders. Values, options, resampling and regions: docs/video.md, "Video
rewards".
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .base import Reward, RewardBatch, register_reward
from .image import (
    AestheticScore,
    CLIPEmbedder,
    PreferenceScore,
    batch_prompts,
    local_path,
    looks_local,
    to_pil,
)

__all__ = [
    "REGIONS",
    "Flicker",
    "FrameAesthetic",
    "InstructionFaithfulness",
    "SourcePreservation",
    "TemporalConsistency",
    "VideoPSNR",
    "VideoPreference",
    "VideoSSIM",
    "VlmJudge",
    "check_frames",
    "composite_region",
    "frame_indices",
    "gaussian_window",
    "region_weights",
    "resample_video",
    "ssim_map",
]

Frames = str | int | Sequence[int]
REGIONS = ("all", "outside", "inside")
GREY = 0.5


# =========================================================================== frames and regions
def check_frames(frames: Any, owner: str = "frames") -> Frames:
    """Validate a ``frames`` option (``"all"``, an int >= 1 or a non-empty list of ints); returns it
    normalised (a list becomes a list of ints). A ValueError names `owner` and the value."""
    if isinstance(frames, str):
        if frames != "all":
            raise ValueError(
                f"{owner}: frames must be 'all', an int k >= 1 or a list of indices, got {frames!r}"
            )
        return frames
    if isinstance(frames, bool):
        raise ValueError(f"{owner}: frames must be 'all', an int k >= 1 or a list of indices, got {frames!r}")
    if isinstance(frames, int):
        if frames < 1:
            raise ValueError(f"{owner}: frames = {frames}: k frames needs k >= 1")
        return frames
    if (
        isinstance(frames, Sequence)
        and frames
        and all(isinstance(i, int) and not isinstance(i, bool) for i in frames)
    ):
        return [int(i) for i in frames]
    raise ValueError(
        f"{owner}: frames must be 'all', an int k >= 1 or a non-empty list of int indices, got {frames!r}"
    )


def frame_indices(num_frames: int, frames: Frames) -> list[int]:
    """The frame indices (sorted as given, in ``range(num_frames)``) that `frames` selects from a video of
    `num_frames` frames.

    - ``"all"``: every frame;
    - an int k: k frames evenly spaced, first and last included, ``round(j * (F - 1) / (k - 1))`` for
      j = 0..k-1 (distinct since k <= F); k >= F gives every frame, k = 1 the first frame;
    - a list: those indices (negative ones count from the end, as in Python), in the given order;
      a repeated index is kept (it counts twice in a mean over frames; rewards over adjacent pairs sort
      and de-duplicate); an index out of range is an IndexError naming it and the frame count.
    """
    if num_frames < 1:
        raise ValueError(f"frame_indices: a video needs at least one frame, got num_frames={num_frames}")
    frames = check_frames(frames)
    if frames == "all":
        return list(range(num_frames))
    if isinstance(frames, int):
        k = frames
        if k >= num_frames:
            return list(range(num_frames))
        if k == 1:
            return [0]
        return [round(j * (num_frames - 1) / (k - 1)) for j in range(k)]
    out = []
    for i in frames:  # type: ignore[union-attr]
        if not -num_frames <= i < num_frames:
            raise IndexError(f"frame index {i} is out of range for a video of {num_frames} frames")
        out.append(i % num_frames)
    return out


def _check_region(region: str, owner: str) -> str:
    if region not in REGIONS:
        raise ValueError(f"{owner}: region must be one of {list(REGIONS)}, got {region!r}")
    return region


def region_weights(masks: Tensor | None, region: str) -> Tensor | None:
    """Float[..., H, W] 0/1 weights of the pixels that count for `region`, from edit masks (1 = edit).

    ``"all"``: None (every pixel counts); ``"outside"``: 1 where ``mask <= 0.5``; ``"inside"``: 1 where
    ``mask > 0.5``. A region other than "all" without masks is a ValueError.
    """
    _check_region(region, "region_weights")
    if region == "all":
        return None
    if masks is None:
        raise ValueError(f"region {region!r} needs edit masks")
    edit = (masks > 0.5).float()
    return 1.0 - edit if region == "outside" else edit


def composite_region(frames: Tensor, masks: Tensor | None, region: str, fill: float = GREY) -> Tensor:
    """`frames` (Float[..., 3, H, W]) with everything outside `region` replaced by `fill` (mid-grey).

    `masks` is Float[..., H, W] (1 = edit region; > 0.5 counts). ``"all"`` returns `frames` unchanged;
    ``"outside"`` fills the edit region; ``"inside"`` fills its complement.
    """
    w = region_weights(masks, region)
    if w is None:
        return frames
    w = w.to(frames.device, frames.dtype).unsqueeze(-3)
    return frames * w + fill * (1.0 - w)


def resample_video(video: Tensor, num_frames: int, size: tuple[int, int], *, nearest: bool = False) -> Tensor:
    """`video` (Float[F,3,H,W] or Float[F,H,W] for masks) at `num_frames` frames and `size` = (H, W).

    Frame i takes the source frame ``round(i * (F - 1) / (num_frames - 1))`` (nearest in time); the
    frames are then resized bilinearly with antialiasing, or nearest-neighbour with ``nearest=True``
    (masks). Returns `video` itself when nothing differs.
    """
    f = video.shape[0]
    if f != num_frames:
        idx = (
            [0] * num_frames
            if num_frames == 1
            else [round(i * (f - 1) / (num_frames - 1)) for i in range(num_frames)]
        )
        video = video[idx]
    if tuple(video.shape[-2:]) != tuple(size):
        x = video.float().unsqueeze(1) if video.dim() == 3 else video.float()
        if nearest:
            x = torch.nn.functional.interpolate(x, size=tuple(size), mode="nearest")
        else:
            x = torch.nn.functional.interpolate(
                x, size=tuple(size), mode="bilinear", align_corners=False, antialias=True
            ).clamp(0, 1)
        video = x.squeeze(1) if video.dim() == 3 else x
    return video


# =========================================================================== batch access
def _videos(reward: Reward, batch: RewardBatch) -> Tensor:
    if "videos" not in batch.outputs:
        raise KeyError(
            f"reward {reward.name!r} needs outputs['videos'] (Float[B,F,3,H,W] in [0,1]); "
            f"outputs: {sorted(batch.outputs) or 'none'}"
        )
    videos = batch.outputs["videos"]
    if not isinstance(videos, Tensor) or videos.dim() != 5 or videos.shape[2] != 3:
        shape = tuple(videos.shape) if isinstance(videos, Tensor) else type(videos).__name__
        raise ValueError(f"reward {reward.name!r}: outputs['videos'] must be Float[B,F,3,H,W], got {shape}")
    if videos.shape[0] != len(batch):
        raise ValueError(
            f"reward {reward.name!r}: outputs['videos'] holds {videos.shape[0]} videos for {len(batch)} prompts"
        )
    if videos.shape[1] < 1:
        raise ValueError(
            f"reward {reward.name!r}: outputs['videos'] has no frames (shape {tuple(videos.shape)})"
        )
    return videos


def _no_path(v: Any) -> bool:
    return v is None or v == "" or (isinstance(v, float) and math.isnan(v))


def _from_column(
    reward: Reward, batch: RewardBatch, column: str, like: Tensor, *, mask: bool, output_key: str
) -> tuple[Tensor, Tensor]:
    """Read one file per row from `column` (video or mask) resampled to `like`'s F/H/W: (values, Bool[B] found).

    Rows sharing a path (a group's samples) read it once per call; a missing path leaves zeros, found False.
    """
    if column not in batch.columns:
        raise KeyError(
            f"reward {reward.name!r} needs outputs[{output_key!r}] or the dataset column {column!r} "
            f"(a path per row); outputs: {sorted(batch.outputs) or 'none'}; "
            f"columns: {sorted(batch.columns) or 'none'}"
        )
    from mmalign.data.media import read_mask, read_video  # lazy: file decoding only when a reward reads files

    b, f, _, h, w = like.shape
    shape = (b, f, h, w) if mask else (b, f, 3, h, w)
    out = torch.zeros(shape, dtype=torch.float32, device=like.device)
    found = torch.zeros(b, dtype=torch.bool)
    cache: dict[str, Tensor] = {}  # a group's samples share their row's file: read it once per call
    for i, path in enumerate(batch.columns[column]):
        if _no_path(path):
            continue
        key = str(path)
        if key in cache:
            out[i], found[i] = cache[key], True
            continue
        reader = read_mask if mask else read_video
        x = reader(path, num_frames=None, size=None)
        want = 3 if mask else 4
        if not isinstance(x, Tensor) or x.dim() != want or (not mask and x.shape[1] != 3):
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            what = "Float[F,H,W]" if mask else "Float[F,3,H,W]"
            raise ValueError(
                f"reward {reward.name!r}: column {column!r}, row {i} ({path}): expected {what}, got {got}"
            )
        out[i] = cache[key] = resample_video(x.float(), f, (h, w), nearest=mask).to(like.device)
        found[i] = True
    return out, found


def _sources(reward: Reward, batch: RewardBatch, videos: Tensor, column: str) -> tuple[Tensor, Tensor]:
    """(source videos Float[B,F,3,H,W] matching `videos`, Bool[B] rows that have one)."""
    if "source_videos" in batch.outputs:
        src = batch.outputs["source_videos"]
        if not isinstance(src, Tensor) or tuple(src.shape) != tuple(videos.shape):
            got = tuple(src.shape) if isinstance(src, Tensor) else type(src).__name__
            raise ValueError(
                f"reward {reward.name!r}: outputs['source_videos'] has shape {got} but outputs['videos'] "
                f"has {tuple(videos.shape)}; they must match (the source at the edit's frames and size)"
            )
        return src, torch.ones(videos.shape[0], dtype=torch.bool)
    return _from_column(reward, batch, column, videos, mask=False, output_key="source_videos")


def _masks(
    reward: Reward, batch: RewardBatch, videos: Tensor, column: str, region: str
) -> tuple[Tensor | None, Tensor]:
    """(edit masks Float[B,F,H,W] or None for region "all", Bool[B] rows that have one)."""
    b, f, _, h, w = videos.shape
    if region == "all":
        return None, torch.ones(b, dtype=torch.bool)
    if "edit_masks" in batch.outputs:
        m = batch.outputs["edit_masks"]
        if not isinstance(m, Tensor) or tuple(m.shape) != (b, f, h, w):
            got = tuple(m.shape) if isinstance(m, Tensor) else type(m).__name__
            raise ValueError(
                f"reward {reward.name!r}: outputs['edit_masks'] has shape {got}; expected {(b, f, h, w)} "
                f"(Float[B,F,H,W] for videos of shape {tuple(videos.shape)})"
            )
        return m, torch.ones(b, dtype=torch.bool)
    try:
        return _from_column(reward, batch, column, videos, mask=True, output_key="edit_masks")
    except KeyError as e:
        raise KeyError(f"{e.args[0]} (region={region!r} needs edit masks; region='all' does not)") from e


def _texts(reward: Reward, batch: RewardBatch, column: str, what: str) -> list[str]:
    if column not in batch.columns:
        raise KeyError(
            f"reward {reward.name!r}: {what} column {column!r} is not in the dataset; "
            f"available columns: {sorted(batch.columns) or 'none'}"
        )
    return [str(t) for t in batch.columns[column]]


def _mean_over_frames(values: Tensor, found: Tensor) -> Tensor:
    """Float[B,K] per-frame values -> Float[B] means (float32, CPU), NaN for rows not found."""
    out = values.double().mean(dim=1).float().cpu()
    return torch.where(found.cpu(), out, torch.full_like(out, math.nan))


class _FramesOption(Reward):
    """Holds the ``frames`` option and samples the frames of a batch's videos."""

    frames: Frames = "all"

    def _set_frames(self, frames: Any) -> None:
        self.frames = check_frames(frames, f"reward {self.name!r}")

    def _select(self, videos: Tensor) -> list[int]:
        try:
            idx = frame_indices(videos.shape[1], self.frames)
        except IndexError as e:
            raise IndexError(f"reward {self.name!r}: option frames={self.frames!r}: {e}") from e
        self.last_metrics = {"frames": float(len(idx))}
        return idx


# =========================================================================== CLIP rewards
class _ClipVideoReward(_FramesOption):
    needs = {"videos"}

    def _init_clip(
        self, path: str, backend: str, arch: str | None, device: str | None, frames: Any, batch_size: int
    ) -> None:
        self._set_frames(frames)
        if int(batch_size) < 1:
            raise ValueError(f"reward {self.name!r}: batch_size must be >= 1, got {batch_size}")
        self.batch_size = int(batch_size)
        self.clip = CLIPEmbedder(path, backend=backend, arch=arch, device=device)

    def embed_frames(self, frames: Tensor) -> Tensor:
        """Float[B,K,3,H,W] -> L2-normalised CLIP image embeddings Float[B,K,D] (`batch_size` frames at a time)."""
        b, k = frames.shape[:2]
        flat = frames.reshape(b * k, *frames.shape[2:])
        outs = [
            self.clip.encode_images(flat[s : s + self.batch_size]) for s in range(0, b * k, self.batch_size)
        ]
        emb = torch.cat(outs) if outs else torch.zeros(0, 1)
        return emb.reshape(b, k, -1)


@register_reward("instruction_faithfulness")
class InstructionFaithfulness(_ClipVideoReward):
    """VIVA R_IF: mean over frames of CLIP(frame, target caption) - CLIP(frame, source caption), x100 unless raw.

    For each sampled frame e_k: ``cos(e_k, t_edit) - cos(e_k, t_src)`` with CLIP's L2-normalised
    embeddings, times 100 unless ``raw=True``; the reward is the mean over the sampled frames (a mean:
    frame-count invariant in expectation). t_edit / t_src are the dataset columns `target_column`
    (``target_caption``) and `source_column` (``source_caption``). ``region`` (default "all")
    restricts by compositing with the edit mask (see the module docstring); a row without a mask then
    scores NaN. Positive: the frames are closer to the target caption than to the source caption.
    """

    def __init__(
        self,
        *,
        path: str,
        backend: str = "hf",
        arch: str | None = None,
        device: str | None = None,
        frames: Frames = "all",
        region: str = "all",
        raw: bool = False,
        target_column: str = "target_caption",
        source_column: str = "source_caption",
        mask_column: str = "edit_mask",
        batch_size: int = 64,
    ) -> None:
        self.region = _check_region(region, f"reward {self.name!r}")
        self._init_clip(path, backend, arch, device, frames, batch_size)
        self.raw = bool(raw)
        self.target_column, self.source_column, self.mask_column = target_column, source_column, mask_column

    def __call__(self, batch: RewardBatch) -> Tensor:
        videos = _videos(self, batch)
        t_edit = _texts(self, batch, self.target_column, "target caption")
        t_src = _texts(self, batch, self.source_column, "source caption")
        idx = self._select(videos)
        masks, found = _masks(self, batch, videos, self.mask_column, self.region)
        frames = composite_region(videos[:, idx], None if masks is None else masks[:, idx], self.region)
        emb = self.embed_frames(frames)  # [B,K,D]
        both = t_edit + t_src
        texts = torch.cat(
            [
                self.clip.encode_texts(both[s : s + self.batch_size])
                for s in range(0, len(both), self.batch_size)
            ]
        )
        te, ts = texts[: len(t_edit)], texts[len(t_edit) :]
        diff = (emb * te.unsqueeze(1)).sum(-1) - (emb * ts.unsqueeze(1)).sum(-1)
        out = _mean_over_frames(diff, found)
        return out if self.raw else 100.0 * out


@register_reward("source_preservation")
class SourcePreservation(_ClipVideoReward):
    """VIVA R_SP: mean over frames of the CLIP image-image cosine of source and edited frame (outside the edit).

    For each sampled frame: ``cos(CLIP(source_k), CLIP(edit_k))``, in [-1, 1] (1 for identical
    frames); the reward is the mean over the sampled frames (frame-count invariant in expectation).
    ``region`` defaults to "outside": both frames get the edit region (the edit's mask) filled with
    mid-grey before encoding, so changes inside the mask do not count. The source is
    ``outputs["source_videos"]`` or the column `source_column` (resampled, see the module docstring);
    a row without a source (or, for a region, without a mask) scores NaN.
    """

    def __init__(
        self,
        *,
        path: str,
        backend: str = "hf",
        arch: str | None = None,
        device: str | None = None,
        frames: Frames = "all",
        region: str = "outside",
        source_column: str = "source_video",
        mask_column: str = "edit_mask",
        batch_size: int = 64,
    ) -> None:
        self.region = _check_region(region, f"reward {self.name!r}")
        self._init_clip(path, backend, arch, device, frames, batch_size)
        self.source_column, self.mask_column = source_column, mask_column

    def __call__(self, batch: RewardBatch) -> Tensor:
        videos = _videos(self, batch)
        src, have_src = _sources(self, batch, videos, self.source_column)
        masks, have_mask = _masks(self, batch, videos, self.mask_column, self.region)
        idx = self._select(videos)
        m = None if masks is None else masks[:, idx]
        e = self.embed_frames(composite_region(videos[:, idx], m, self.region))
        s = self.embed_frames(composite_region(src[:, idx].to(videos.device), m, self.region))
        return _mean_over_frames((e * s).sum(-1), have_src & have_mask)


@register_reward("temporal_consistency")
class TemporalConsistency(_ClipVideoReward):
    """Mean CLIP image-embedding cosine of adjacent sampled frames (1 = a still video), NaN with < 2 frames.

    ``mean_j cos(CLIP(x_{k_j}), CLIP(x_{k_{j+1}}))`` over the adjacent pairs of the SAMPLED frames
    k_0 < k_1 < ... (sorted): with sparser sampling (a smaller ``frames``) the pairs are further apart
    in time, so the value usually drops; it is comparable only between runs with the same ``frames``
    and frame count. A single sampled frame has no pair: NaN (not applicable).
    """

    def __init__(
        self,
        *,
        path: str,
        backend: str = "hf",
        arch: str | None = None,
        device: str | None = None,
        frames: Frames = "all",
        batch_size: int = 64,
    ) -> None:
        self._init_clip(path, backend, arch, device, frames, batch_size)

    def __call__(self, batch: RewardBatch) -> Tensor:
        videos = _videos(self, batch)
        idx = sorted(set(self._select(videos)))
        self.last_metrics["frames"] = float(len(idx))
        if len(idx) < 2:
            return torch.full((videos.shape[0],), math.nan)
        emb = self.embed_frames(videos[:, idx])
        cos = (emb[:, 1:] * emb[:, :-1]).sum(-1)
        return cos.double().mean(dim=1).float().cpu()


@register_reward("video_preference")
class VideoPreference(_FramesOption):
    """VIVA R_PS (PickScore style): mean over frames of logit_scale * cos(CLIP(frame), CLIP(text)).

    Each sampled frame is scored by the ``preference`` reward (`rewards.image.PreferenceScore`, built
    with the same options) against the prompt, or the column `text_column` (e.g. ``target_caption``);
    the reward is the mean over the sampled frames (frame-count invariant in expectation). PickScore by id:
    ``path: yuvalkirstain/PickScore_v1, processor: laion/CLIP-ViT-H-14-laion2B-s32B-b79K``.
    """

    needs = {"videos", "prompts"}

    def __init__(
        self,
        *,
        path: str,
        processor: str | None = None,
        backend: str = "hf",
        arch: str | None = None,
        device: str | None = None,
        frames: Frames = "all",
        text_column: str | None = None,
        batch_size: int = 64,
    ) -> None:
        self._set_frames(frames)
        self.scorer = PreferenceScore(
            path=path,
            processor=processor,
            backend=backend,
            arch=arch,
            text_column=None,
            batch_size=batch_size,
            device=device,
        )
        self.scorer.name = self.name  # its errors name this reward; the texts are resolved here
        self.text_column = text_column

    def __call__(self, batch: RewardBatch) -> Tensor:
        videos = _videos(self, batch)
        texts = batch_prompts(self, batch, self.text_column)
        idx = self._select(videos)
        b, k = videos.shape[0], len(idx)
        flat = videos[:, idx].reshape(b * k, *videos.shape[2:])
        frame_batch = RewardBatch(prompts=[t for t in texts for _ in range(k)], outputs={"images": flat})
        scores = self.scorer(frame_batch).reshape(b, k)
        return scores.double().mean(dim=1).float()


@register_reward("frame_aesthetic")
class FrameAesthetic(_FramesOption):
    """Mean over sampled frames of the ``aesthetic`` score (an MLP on the frame's CLIP image embedding).

    Each sampled frame is scored by `rewards.image.AestheticScore`, built with the same options
    (`mlp_path`, `mlp_file`, `path`, `hidden`, `prefix`, `scale` ...); the reward is the mean over the sampled
    frames (frame-count invariant in expectation).
    """

    needs = {"videos"}

    def __init__(
        self,
        *,
        mlp_path: str,
        path: str,
        mlp_file: str | None = None,
        processor: str | None = None,
        backend: str = "hf",
        arch: str | None = None,
        hidden: Sequence[int] = (1024, 128, 64, 16),
        prefix: str = "",
        scale: float = 1.0,
        frames: Frames = "all",
        batch_size: int = 64,
        device: str | None = None,
    ) -> None:
        self._set_frames(frames)
        self.scorer = AestheticScore(
            mlp_path=mlp_path,
            path=path,
            mlp_file=mlp_file,
            processor=processor,
            backend=backend,
            arch=arch,
            hidden=hidden,
            prefix=prefix,
            scale=scale,
            batch_size=batch_size,
            device=device,
        )
        self.scorer.name = self.name

    def __call__(self, batch: RewardBatch) -> Tensor:
        videos = _videos(self, batch)
        idx = self._select(videos)
        b, k = videos.shape[0], len(idx)
        flat = videos[:, idx].reshape(b * k, *videos.shape[2:])
        scores = self.scorer(RewardBatch(prompts=[""] * (b * k), outputs={"images": flat})).reshape(b, k)
        return scores.double().mean(dim=1).float()


# =========================================================================== pixel rewards
@register_reward("flicker")
class Flicker(_FramesOption):
    """Mean absolute pixel difference of adjacent sampled frames (higher = more flicker; ``negate`` flips it).

    ``mean_j mean_{c,y,x} |x_{k_{j+1}} - x_{k_j}|`` over the adjacent pairs of the SAMPLED frames
    (sorted), pixels in [0, 1], so the value is in [0, 1] and 0 for a still video. It grows with the
    gap between sampled frames: sparser sampling (a smaller ``frames``) sees more motion per pair.
    Higher means MORE flicker: give it a negative weight, or set ``negate=True`` to return minus the
    value (then higher is better). A single sampled frame has no pair: NaN (not applicable).
    """

    needs = {"videos"}

    def __init__(self, *, frames: Frames = "all", negate: bool = False, device: str | None = None) -> None:
        self._set_frames(frames)
        self.negate = bool(negate)
        self.device = device

    def __call__(self, batch: RewardBatch) -> Tensor:
        videos = _videos(self, batch)
        idx = sorted(set(self._select(videos)))
        self.last_metrics["frames"] = float(len(idx))
        if len(idx) < 2:
            return torch.full((videos.shape[0],), math.nan)
        x = videos[:, idx].detach().float()
        if self.device is not None:
            x = x.to(self.device)
        out = (x[:, 1:] - x[:, :-1]).abs().flatten(1).double().mean(dim=1).float().cpu()
        return -out if self.negate else out


class _SourceMetric(_FramesOption):
    needs = {"videos"}

    def _init_source(
        self, frames: Any, region: str, source_column: str, mask_column: str, device: str | None
    ) -> None:
        self._set_frames(frames)
        self.region = _check_region(region, f"reward {self.name!r}")
        self.source_column, self.mask_column = source_column, mask_column
        self.device = device

    def _inputs(self, batch: RewardBatch) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
        """(edit Float[B,K,3,H,W], source likewise, region weights Float[B,K,H,W] or None, Bool[B] rows found)."""
        videos = _videos(self, batch)
        src, have_src = _sources(self, batch, videos, self.source_column)
        masks, have_mask = _masks(self, batch, videos, self.mask_column, self.region)
        idx = self._select(videos)
        dev = torch.device(self.device) if self.device is not None else videos.device
        x = videos[:, idx].detach().float().to(dev)
        y = src[:, idx].detach().float().to(dev)
        w = region_weights(None if masks is None else masks[:, idx].float().to(dev), self.region)
        if w is not None:
            self.last_metrics["region_frac"] = float(w.mean())
        return x, y, w, (have_src & have_mask).cpu()


@register_reward("video_psnr")
class VideoPSNR(_SourceMetric):
    """PSNR (dB) of the edited video against its source, by default outside the edit region.

    ``10 * log10(1 / MSE)`` (data range 1) with the MSE POOLED over the sampled frames, the channels and
    the region's pixels (not a mean of per-frame PSNRs): the pooled MSE is frame-count invariant in
    expectation (its log, the PSNR, nearly so), and one perfect frame does not dominate. An identical region (MSE = 0), or a PSNR above `max_db`, gives `max_db` (100 dB by
    default). ``region``: "outside" (default: only pixels whose mask is 0 count), "inside" or "all". A
    row whose region has no pixel in the sampled frames, or without a source / mask, scores NaN.
    """

    def __init__(
        self,
        *,
        frames: Frames = "all",
        region: str = "outside",
        max_db: float = 100.0,
        source_column: str = "source_video",
        mask_column: str = "edit_mask",
        device: str | None = None,
    ) -> None:
        self._init_source(frames, region, source_column, mask_column, device)
        if not math.isfinite(float(max_db)) or float(max_db) <= 0:
            raise ValueError(f"reward {self.name!r}: max_db must be a positive finite number, got {max_db!r}")
        self.max_db = float(max_db)

    def __call__(self, batch: RewardBatch) -> Tensor:
        x, y, w, found = self._inputs(batch)
        sq = (x.double() - y.double()).pow(2).sum(dim=2)  # [B,K,H,W], summed over channels
        if w is None:
            num, den = (
                sq.flatten(1).sum(1),
                torch.full((x.shape[0],), 3.0 * math.prod(sq.shape[1:]), dtype=torch.float64),
            )
        else:
            w = w.double()
            num, den = (sq * w).flatten(1).sum(1), 3.0 * w.flatten(1).sum(1)
        num, den = num.cpu(), den.cpu()
        mse = num / den.clamp_min(1)
        psnr = torch.where(
            mse > 0, 10.0 * torch.log10(1.0 / mse.clamp_min(1e-300)), torch.full_like(mse, self.max_db)
        )
        psnr = psnr.clamp(max=self.max_db)
        psnr = torch.where(found & (den > 0), psnr, torch.full_like(psnr, math.nan))
        return psnr.float()


def gaussian_window(size: int = 11, sigma: float = 1.5, dtype: torch.dtype = torch.float64) -> Tensor:
    """Float[size, size]: the normalised 2-D Gaussian window of SSIM (outer product of 1-D Gaussians)."""
    r = torch.arange(size, dtype=dtype) - (size - 1) / 2
    g = torch.exp(-(r**2) / (2 * sigma**2))
    g = g / g.sum()
    return g[:, None] * g[None, :]


def ssim_map(
    x: Tensor, y: Tensor, *, window: int = 11, sigma: float = 1.5, k1: float = 0.01, k2: float = 0.03
) -> Tensor:
    """Per-pixel SSIM of Float[N,C,H,W] images in [0, 1] (Wang et al. 2004), averaged over channels.

    Each channel: local means / variances / covariance under the Gaussian `window` (sigma 1.5),
    ``((2 mu_x mu_y + C1)(2 s_xy + C2)) / ((mu_x^2 + mu_y^2 + C1)(s_x^2 + s_y^2 + C2))`` with
    ``C1 = (k1 * 1)^2``, ``C2 = (k2 * 1)^2``. "Valid" filtering (no padding, like the reference
    implementation): the map is Float[N, H - window + 1, W - window + 1], its pixel (i, j) centred on
    the input pixel (i + window // 2, j + window // 2). Frames smaller than the window are a ValueError.
    """
    n, c, h, w = x.shape
    if h < window or w < window:
        raise ValueError(f"SSIM needs frames of at least {window}x{window} pixels (the window), got {h}x{w}")
    g = gaussian_window(window, sigma, dtype=x.dtype).to(x.device).expand(c, 1, window, window)

    def filt(t: Tensor) -> Tensor:
        return torch.nn.functional.conv2d(t, g, groups=c)

    c1, c2 = k1**2, k2**2
    mx, my = filt(x), filt(y)
    sxx = filt(x * x) - mx * mx
    syy = filt(y * y) - my * my
    sxy = filt(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx * mx + my * my + c1) * (sxx + syy + c2))
    return s.mean(dim=1)


@register_reward("video_ssim")
class VideoSSIM(_SourceMetric):
    """SSIM of the edited video against its source (Gaussian window 11, sigma 1.5), by default outside the edit.

    The standard Wang et al. SSIM (`ssim_map`: C1 = 0.01^2, C2 = 0.03^2 on [0, 1] data, per channel,
    then averaged over channels) of each sampled frame with its source frame; the SSIM map (valid
    filtering: the 5-pixel border is not a window centre) is averaged over the region's pixels of all
    sampled frames, so the value is frame-count invariant in expectation. ``region="outside"``
    (default) averages the map over the window centres whose mask is 0; windows next to the edit
    region still see some of its pixels. 1 for an identical region. A row whose region has no window
    centre in the sampled frames, or without a source / mask, scores NaN.
    """

    def __init__(
        self,
        *,
        frames: Frames = "all",
        region: str = "outside",
        window: int = 11,
        sigma: float = 1.5,
        source_column: str = "source_video",
        mask_column: str = "edit_mask",
        device: str | None = None,
    ) -> None:
        self._init_source(frames, region, source_column, mask_column, device)
        if int(window) < 1 or int(window) % 2 == 0:
            raise ValueError(f"reward {self.name!r}: window must be an odd int >= 1, got {window!r}")
        self.window, self.sigma = int(window), float(sigma)

    def __call__(self, batch: RewardBatch) -> Tensor:
        x, y, w, found = self._inputs(batch)
        b, k, c, h, wd = x.shape
        try:
            s = ssim_map(
                x.reshape(b * k, c, h, wd).double(),
                y.reshape(b * k, c, h, wd).double(),
                window=self.window,
                sigma=self.sigma,
            )
        except ValueError as e:
            raise ValueError(f"reward {self.name!r}: {e}") from e
        s = s.reshape(b, k, *s.shape[-2:])
        if w is None:
            out = s.flatten(1).mean(1)
            den = torch.full((b,), float(math.prod(s.shape[1:])), dtype=torch.float64)
        else:
            r = self.window // 2
            wc = w.double()[..., r : h - r, r : wd - r]
            den = wc.flatten(1).sum(1)
            out = (s * wc).flatten(1).sum(1) / den.clamp_min(1)
        out, den = out.cpu(), den.cpu()
        return torch.where(found & (den > 0), out, torch.full_like(out, math.nan)).float()


# =========================================================================== VLM judge
YES_VARIANTS = ("yes", " yes", "Yes", " Yes", "YES")
NO_VARIANTS = ("no", " no", "No", " No", "NO")
DEFAULT_QUESTIONS = ("Does this video show {target_caption}? Answer yes or no.",)
_PLACEHOLDERS = ("instruction", "target_caption", "source_caption", "prompt")


def answer_token_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The next-token ids read as "yes" and as "no": the FIRST token of each of `YES_VARIANTS` /
    `NO_VARIANTS` (tokenized without special tokens), minus the ids both sides share (e.g. a lone
    leading-space token of a byte-level BPE that has no merge for " yes"). A side left empty is a
    ValueError."""

    def first(variants: Sequence[str]) -> set[int]:
        out = set()
        for v in variants:
            ids = tokenizer(v, add_special_tokens=False)["input_ids"]
            if ids:
                out.add(int(ids[0]))
        return out

    yes, no = first(YES_VARIANTS), first(NO_VARIANTS)
    shared = yes & no
    yes, no = sorted(yes - shared), sorted(no - shared)
    if not yes or not no:
        raise ValueError(
            f"the tokenizer gives no distinct first token for yes ({YES_VARIANTS}) and no ({NO_VARIANTS})"
        )
    return yes, no


@register_reward("vlm_judge")
class VlmJudge(_FramesOption):
    """P("yes") of a VLM asked yes/no questions about the sampled frames, averaged over the questions.

    Each question is a template (option ``questions``) filled per row with ``{instruction}`` (column
    `instruction_column`), ``{target_caption}`` / ``{source_caption}`` (columns `target_column` /
    `source_column`) and ``{prompt}`` (the batch prompt); only the columns a template names are read.
    The chat is one user turn: the sampled frames (``mode="video"``: one video, the processor's video
    input; ``mode="images"``: one image per frame), then the question, then the generation prompt.
    From the logits of the NEXT token, P(yes) = sum over the yes ids of softmax over the yes and no
    ids only (renormalised: P(yes) + P(no) = 1); the ids are the first tokens of "yes", " yes", "Yes",
    " Yes", "YES" and of the same "no" variants, without ids both share (`answer_token_ids`). The
    reward is in [0, 1]. ``frames`` defaults to 4; the frames only change what the VLM sees (no
    per-frame mean), so the value is not frame-count invariant. Frames go to the processor as uint8
    (rounded from [0, 1]; the processor rescales by 1/255); Qwen2-VL's video input merges frames in
    temporal pairs (an odd count repeats the last frame). The model is loaded with `AutoProcessor` /
    `AutoModelForImageTextToText` (as `mmalign.policies.vlm.VLMPolicy`), in `dtype` when given (e.g.
    "bfloat16"); ``min_pixels`` / ``max_pixels`` set the processor's resize bounds
    (`mmalign.policies.vlm.set_pixel_range`). Deterministic (eval mode, no sampling).
    """

    needs = {"videos", "prompts"}

    def __init__(
        self,
        *,
        path: str,
        questions: Sequence[str] | str = DEFAULT_QUESTIONS,
        frames: Frames = 4,
        mode: str = "video",
        instruction_column: str = "instruction",
        target_column: str = "target_caption",
        source_column: str = "source_caption",
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        batch_size: int = 8,
        device: str | None = None,
        dtype: str | None = None,
    ) -> None:
        self._set_frames(frames)
        if dtype is not None and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(
                f"reward {self.name!r}: dtype must name a torch dtype (e.g. 'bfloat16'), got {dtype!r}"
            )
        if mode not in ("video", "images"):
            raise ValueError(f"reward {self.name!r}: mode must be 'video' or 'images', got {mode!r}")
        self.mode = mode
        qs = [questions] if isinstance(questions, str) else list(questions)
        if not qs or not all(isinstance(q, str) and q.strip() for q in qs):
            raise ValueError(
                f"reward {self.name!r}: questions must be a non-empty list of strings, got {questions!r}"
            )
        for q in qs:
            for _, field, _, _ in string.Formatter().parse(q):
                if field is not None and field not in _PLACEHOLDERS:
                    raise ValueError(
                        f"reward {self.name!r}: question {q!r} uses {{{field}}}; "
                        f"placeholders: {', '.join('{' + p + '}' for p in _PLACEHOLDERS)}"
                    )
        self.questions = qs
        self.columns = {
            "instruction": instruction_column,
            "target_caption": target_column,
            "source_caption": source_column,
        }
        if int(batch_size) < 1:
            raise ValueError(f"reward {self.name!r}: batch_size must be >= 1, got {batch_size}")
        self.batch_size = int(batch_size)
        from transformers import AutoModelForImageTextToText, AutoProcessor

        source = path
        if Path(path).expanduser().exists() or looks_local(path):
            source = str(local_path(path, f"reward {self.name!r}: VLM folder"))
        self.processor = AutoProcessor.from_pretrained(source)
        if min_pixels is not None or max_pixels is not None:
            from mmalign.policies.vlm import set_pixel_range

            set_pixel_range(self.processor, min_pixels, max_pixels)
        self.device = torch.device(device or "cpu")
        load_kwargs = {} if dtype is None else {"dtype": getattr(torch, str(dtype))}
        self.model = AutoModelForImageTextToText.from_pretrained(source, **load_kwargs)
        self.model.eval().requires_grad_(False)
        self.model.to(self.device)
        self.yes_ids, self.no_ids = answer_token_ids(self.processor.tokenizer)

    def _fill(self, batch: RewardBatch) -> list[list[str]]:
        """The questions filled in for each row: [B][Q] texts."""
        needed = {f for q in self.questions for _, f, _, _ in string.Formatter().parse(q) if f}
        values: dict[str, list[str]] = {}
        for key in needed:
            if key == "prompt":
                values[key] = [str(p) for p in batch.prompts]
            else:
                values[key] = _texts(self, batch, self.columns[key], key.replace("_", " "))
        return [
            [q.format(**{k: v[i] for k, v in values.items()}) for q in self.questions]
            for i in range(len(batch))
        ]

    def _chat(self, question: str, num_frames: int) -> str:
        vision = [{"type": "video"}] if self.mode == "video" else [{"type": "image"}] * num_frames
        messages = [{"role": "user", "content": [*vision, {"type": "text", "text": question}]}]
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def yes_no_probs(self, batch: RewardBatch) -> Tensor:
        """Float[B, Q, 2]: (P(yes), P(no)) per row and question, renormalised over the yes / no ids."""
        videos = _videos(self, batch)
        idx = self._select(videos)
        filled = self._fill(batch)
        frames = (videos[:, idx].detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()
        b, q = videos.shape[0], len(self.questions)
        pairs = [(i, j) for i in range(b) for j in range(q)]
        out = torch.zeros(b, q, 2)
        yes = torch.tensor(self.yes_ids)
        no = torch.tensor(self.no_ids)
        for s in range(0, len(pairs), self.batch_size):
            chunk = pairs[s : s + self.batch_size]
            texts = [self._chat(filled[i][j], len(idx)) for i, j in chunk]
            kwargs: dict[str, Any] = {"text": texts, "return_tensors": "pt", "padding": True}
            if self.mode == "video":
                kwargs["videos"] = [frames[i] for i, _ in chunk]
                kwargs["do_sample_frames"] = False
            else:
                kwargs["images"] = [[to_pil(f.float() / 255) for f in frames[i]] for i, _ in chunk]
            enc = self.processor(**kwargs).to(self.device)
            with torch.no_grad():
                logits = self.model(**enc).logits.float()
            att = enc["attention_mask"]
            last = att.shape[1] - 1 - att.flip(1).argmax(dim=1)  # the last real token (either padding side)
            nxt = logits[torch.arange(len(chunk), device=logits.device), last].cpu()
            lp = torch.cat([nxt[:, yes], nxt[:, no]], dim=1).log_softmax(dim=1)
            p_yes, p_no = lp[:, : len(yes)].exp().sum(1), lp[:, len(yes) :].exp().sum(1)
            for r, (i, j) in enumerate(chunk):
                out[i, j, 0], out[i, j, 1] = p_yes[r], p_no[r]
        return out

    def __call__(self, batch: RewardBatch) -> Tensor:
        probs = self.yes_no_probs(batch)
        for j in range(probs.shape[1]):
            self.last_metrics[f"p_yes_q{j}"] = float(probs[:, j, 0].mean()) if probs.shape[0] else math.nan
        return probs[..., 0].double().mean(dim=1).float()
