"""Reading videos and edit masks for the video pipelines and rewards.

A video is ``Float[F, 3, H, W]`` in [0, 1] and an edit mask ``Float[F, H, W]`` in {0, 1} (1 = the region the
edit may change). Three storage forms are read, chosen by the path:

- a folder of image frames (``.png``, ``.jpg``, ``.jpeg``, ``.webp``, ``.bmp``), in sorted file-name order;
- a video file (``.mp4``, ``.webm``, ``.mkv``, ``.mov``, ``.avi``, ``.gif``), decoded with PyAV (the wheel
  carries its own codecs, no system ffmpeg);
- a ``.npy`` array, or a ``.npz`` archive holding one array (or one named ``frames``): uint8 ``[F, H, W, 3]``
  (masks: ``[F, H, W]``) or float in [0, 1] of the same layout. ``write_array`` writes the compressed
  ``.npz`` form (what the synthetic clips of `mmalign.tiny.video_shapes` use: one small lossless file a
  clip).

A mask may also be one image file (``.png`` ...), which then holds for every frame.

`num_frames` keeps that many frames evenly spaced over the clip (first and last included; the clip must
have at least that many frames, a shorter clip is an error, never padded); `size` = (H, W) resizes each
frame (bilinear with antialiasing for videos, nearest for masks, so a mask stays binary). Every error names
the path. Writing is in `mmalign.rundir` (`save_video`: H.264 mp4; `save_frame_strip`: a PNG strip) and
here (`write_frames`: a lossless frame folder; `write_array`: a compressed ``.npz``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "IMAGE_SUFFIXES",
    "VIDEO_SUFFIXES",
    "even_frame_indices",
    "read_mask",
    "read_video",
    "write_array",
    "write_frames",
]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".mov", ".avi", ".gif")


def even_frame_indices(total: int, k: int) -> list[int]:
    """`k` frame indices evenly spaced over ``0 .. total - 1``, first and last included (k = 1: the first)."""
    if k < 1:
        raise ValueError(f"the number of frames to keep must be >= 1, got {k}")
    if k > total:
        raise ValueError(f"cannot keep {k} frames of a clip of {total}")
    if k == 1:
        return [0]
    return [round(i * (total - 1) / (k - 1)) for i in range(k)]


def _frame_files(folder: Path) -> list[Path]:
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(
            f"{folder}: a frame folder must hold image files ({', '.join(IMAGE_SUFFIXES)}); none found"
        )
    return files


def _decode_file(path: Path) -> np.ndarray:
    """uint8 [F, H, W, 3] of a video file (PyAV)."""
    try:
        import av
    except ImportError as e:  # pragma: no cover - av is a dependency
        raise ImportError(f"reading {path} needs PyAV: pip install av") from e
    try:
        with av.open(str(path)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    except (av.error.FFmpegError, IndexError) as e:
        raise ValueError(f"{path}: cannot decode the video ({e})") from e
    if not frames:
        raise ValueError(f"{path}: the video has no frames")
    return np.stack(frames)


def _load_array(path: Path) -> np.ndarray:
    """The array of a ``.npy``, or of a ``.npz`` holding one array (or one named ``frames``)."""
    if path.suffix.lower() == ".npy":
        return np.load(path, allow_pickle=False)
    with np.load(path, allow_pickle=False) as archive:
        names = list(archive.files)
        if "frames" in names:
            return archive["frames"]
        if len(names) != 1:
            raise ValueError(
                f"{path}: a .npz video must hold one array (or one named 'frames'); it holds {names}"
            )
        return archive[names[0]]


def _to_float(arr: np.ndarray, path: Path) -> Tensor:
    if arr.dtype == np.bool_:  # a boolean mask
        return torch.from_numpy(arr.astype(np.float32))
    if arr.dtype == np.uint8:
        return torch.from_numpy(arr.astype(np.float32) / 255.0)
    if np.issubdtype(arr.dtype, np.floating):
        if arr.size and (arr.min() < 0 or arr.max() > 1):
            raise ValueError(
                f"{path}: float frames must be in [0, 1], got [{arr.min():.3g}, {arr.max():.3g}]"
            )
        return torch.from_numpy(arr.astype(np.float32))
    raise ValueError(f"{path}: frames must be uint8 or float in [0, 1], got {arr.dtype}")


def _select(x: Tensor, num_frames: int | None, path: Path) -> Tensor:
    if num_frames is None:
        return x
    if num_frames > x.shape[0]:
        raise ValueError(f"{path}: {num_frames} frames were asked for, the clip has {x.shape[0]}")
    return x[even_frame_indices(x.shape[0], num_frames)]


def read_video(
    path: str | Path, *, num_frames: int | None = None, size: Sequence[int] | None = None
) -> Tensor:
    """Float[F, 3, H, W] in [0, 1] of a frame folder, a video file or a ``.npy`` (see the module docstring)."""
    from PIL import Image

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"video not found: {path}")
    if path.is_dir():
        arr = np.stack([np.asarray(Image.open(f).convert("RGB")) for f in _frame_files(path)])
    elif path.suffix.lower() in VIDEO_SUFFIXES:
        arr = _decode_file(path)
    elif path.suffix.lower() in (".npy", ".npz"):
        arr = _load_array(path)
    else:
        raise ValueError(
            f"{path}: unknown video format {path.suffix!r}; give a frame folder, a .npy / .npz or one of "
            f"{', '.join(VIDEO_SUFFIXES)}"
        )
    if arr.ndim != 4 or arr.shape[-1] != 3:
        raise ValueError(f"{path}: frames must be [F, H, W, 3], got {list(arr.shape)}")
    video = _select(_to_float(arr, path).permute(0, 3, 1, 2).contiguous(), num_frames, path)
    if size is not None and tuple(video.shape[-2:]) != tuple(size):
        video = torch.nn.functional.interpolate(
            video, size=tuple(size), mode="bilinear", align_corners=False, antialias=True
        ).clamp(0, 1)
    return video


def read_mask(
    path: str | Path, *, num_frames: int | None = None, size: Sequence[int] | None = None
) -> Tensor:
    """Float[F, H, W] in {0, 1} (1 = the edit region) of a frame folder, a ``.npy``, a video file or one image
    (which holds for every frame: F = 1, or `num_frames` copies). A pixel is 1 where its grey value is > 0.5."""
    from PIL import Image

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"edit mask not found: {path}")
    if path.is_dir():
        arr = np.stack([np.asarray(Image.open(f).convert("L")) for f in _frame_files(path)])
    elif path.suffix.lower() in IMAGE_SUFFIXES:
        arr = np.asarray(Image.open(path).convert("L"))[None]
    elif path.suffix.lower() in (".npy", ".npz"):
        arr = _load_array(path)
        if arr.ndim == 4 and arr.shape[-1] in (1, 3):
            arr = arr.max(axis=-1)
    elif path.suffix.lower() in VIDEO_SUFFIXES:
        arr = _decode_file(path).max(axis=-1)
    else:
        raise ValueError(
            f"{path}: unknown mask format {path.suffix!r}; give a frame folder, an image or a .npy / .npz"
        )
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3:
        raise ValueError(f"{path}: a mask must be [F, H, W] (or one [H, W] image), got {list(arr.shape)}")
    mask = (_to_float(arr, path) > 0.5).float()
    if mask.shape[0] == 1 and num_frames is not None:
        mask = mask.expand(num_frames, -1, -1).clone()
    mask = _select(mask, num_frames, path)
    if size is not None and tuple(mask.shape[-2:]) != tuple(size):
        mask = torch.nn.functional.interpolate(mask[:, None], size=tuple(size), mode="nearest")[:, 0]
    return mask


def write_frames(frames: Tensor, folder: str | Path) -> Path:
    """Write Float[F, 3, H, W] (or a mask Float[F, H, W]) in [0, 1] as ``frame_000.png`` ... into `folder`
    (lossless; `read_video` / `read_mask` read it back exactly, up to the 8-bit quantisation)."""
    from PIL import Image

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("frame_*.png"):
        old.unlink()
    for i, frame in enumerate(frames):
        arr = (frame.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
        img = Image.fromarray(arr) if arr.ndim == 2 else Image.fromarray(arr.transpose(1, 2, 0))
        img.save(folder / f"frame_{i:03d}.png")
    return folder


def write_array(frames: Tensor, path: str | Path) -> Path:
    """Write Float[F, 3, H, W] (or a mask Float[F, H, W]) in [0, 1] as a compressed ``.npz`` of uint8
    ``[F, H, W, 3]`` (``[F, H, W]``) named ``frames`` (lossless up to the 8-bit quantisation)."""
    path = Path(path)
    if path.suffix.lower() != ".npz":
        raise ValueError(f"{path}: write_array writes .npz files")
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = (frames.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()
    if arr.dim() == 4:
        arr = arr.permute(0, 2, 3, 1)
    np.savez_compressed(path, frames=arr.numpy())
    return path
