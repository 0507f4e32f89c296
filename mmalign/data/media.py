"""Media helpers: reading and writing images, videos and edit masks (one module for every layer).

A video is ``Float[F, 3, H, W]`` in [0, 1] and an edit mask ``Float[F, H, W]`` in {0, 1} (1 = the region the
edit may change). Three storage forms are read, chosen by the path (`read_video`, `read_mask`).

Details: docs/video.md, "mmalign.data.media".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "IMAGE_SUFFIXES",
    "VIDEO_SUFFIXES",
    "even_frame_indices",
    "frame_strip",
    "load_rgb",
    "read_mask",
    "read_video",
    "save_frame_strip",
    "save_grid",
    "save_image",
    "save_video",
    "to_uint8_hwc",
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
    """Float[F, 3, H, W] in [0, 1] of a frame folder, a video file, a ``.npy`` (see the module docstring) or one
    image (a one-frame clip, e.g. the first frame of image-to-video)."""
    from PIL import Image

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"video not found: {path}")
    if path.is_dir():
        arr = np.stack([np.asarray(Image.open(f).convert("RGB")) for f in _frame_files(path)])
    elif path.suffix.lower() in IMAGE_SUFFIXES:
        arr = np.asarray(Image.open(path).convert("RGB"))[None]
    elif path.suffix.lower() in VIDEO_SUFFIXES:
        arr = _decode_file(path)
    elif path.suffix.lower() in (".npy", ".npz"):
        arr = _load_array(path)
    else:
        raise ValueError(
            f"{path}: unknown video format {path.suffix!r}; give a frame folder, a .npy / .npz, an image or one "
            f"of {', '.join(VIDEO_SUFFIXES)}"
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


# ----------------------------------------------------------------------------- writing images and clips


def to_uint8_hwc(image: Tensor) -> Any:
    """Float[C,H,W] in [0, 1] (C = 1 or 3) -> a uint8 H x W (x 3) numpy array."""
    if image.dim() != 3 or image.shape[0] not in (1, 3):
        raise ValueError(f"an image must be Float[3,H,W] or Float[1,H,W] in [0, 1], got {tuple(image.shape)}")
    arr = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().permute(1, 2, 0).numpy()
    return arr[..., 0] if arr.shape[-1] == 1 else arr


def save_image(image: Tensor, path: str | Path) -> Path:
    """Write one Float[3,H,W] image in [0, 1] as PNG."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(to_uint8_hwc(image)).save(path)
    return path


def save_frame_strip(video: Tensor, path: str | Path, max_frames: int = 8) -> Path:
    """Up to `max_frames` evenly spaced frames of a Float[F,3,H,W] video side by side, as one PNG."""
    if video.dim() != 4:
        raise ValueError(f"a video must be Float[F,3,H,W] in [0, 1], got {tuple(video.shape)}")
    return save_image(frame_strip(video, max_frames), path)


def save_video(video: Tensor, path: str | Path, fps: int = 8) -> Path:
    """Write a Float[F,3,H,W] video in [0, 1] as H.264 mp4 with PyAV (its wheel carries the encoder). H.264's
    yuv420p needs even sides: an odd height or width is padded by repeating the last row / column."""
    try:
        import av
    except ImportError as e:
        raise ImportError(f"writing {path} needs PyAV: pip install av") from e
    if video.dim() != 4 or video.shape[1] != 3:
        raise ValueError(f"a video must be Float[F,3,H,W] in [0, 1], got {tuple(video.shape)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    import numpy as np

    h, w = video.shape[-2:]
    # yuv420p needs even sides: an odd side gets one more row / column, a copy of the last (not a resize)
    frames = [np.pad(to_uint8_hwc(frame), ((0, h % 2), (0, w % 2), (0, 0)), mode="edge") for frame in video]
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = w + w % 2, h + h % 2
        stream.pix_fmt = "yuv420p"
        for arr in frames:
            frame = av.VideoFrame.from_ndarray(arr, format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def frame_strip(video: Tensor, max_frames: int = 8) -> Tensor:
    """Up to `max_frames` evenly spaced frames of a Float[F,3,H,W] clip side by side: Float[3,H,W*k]."""
    idx = torch.linspace(0, video.shape[0] - 1, min(video.shape[0], max_frames)).round().long()
    return torch.cat(list(video[idx]), dim=-1)


def load_rgb(image: Any) -> Any:
    """A PIL RGB image from a path or a PIL image (the file is closed before returning)."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    with Image.open(image) as im:
        return im.convert("RGB")


def save_grid(images: Tensor, path: str | Path, ncols: int, pad: int = 2) -> Path:
    """Write Float[N,3,H,W] in [0, 1] as one PNG grid with `ncols` columns (white padding)."""
    from PIL import Image

    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be Float[N,3,H,W], got {tuple(images.shape)}")
    n, _, h, w = images.shape
    nrows = math.ceil(n / ncols)
    grid = torch.ones((3, nrows * (h + pad) + pad, ncols * (w + pad) + pad))
    for i in range(n):
        r, c = divmod(i, ncols)
        y, x = pad + r * (h + pad), pad + c * (w + pad)
        grid[:, y : y + h, x : x + w] = images[i].float().clamp(0, 1)
    arr = (grid.permute(1, 2, 0).numpy() * 255).round().astype("uint8")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)
    return path
