"""Synthetic clips of moving squares with editing instructions, for the tiny Edit-GRPO pipeline.

`write_video_edit_dataset` writes the clips, targets, masks and JSONL rows;
``python -m mmalign.tiny.video_shapes [FOLDER]`` rewrites them.

Details: docs/video.md, "mmalign.tiny.video_shapes".
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.tiny.world import PALETTE

__all__ = [
    "ASSETS",
    "EDIT_KINDS",
    "FRAMES",
    "SIZE",
    "EditClip",
    "make_edit_clip",
    "write_video_edit_dataset",
]

FRAMES = 9
"""Frames per clip (4k + 1, as Wan's causal VAE wants: frame 0 alone, then groups)."""
SIZE = 32
"""Side of a frame in pixels (the tiny CLIP's input size)."""
SIDE = (8, 11)
"""Smallest and largest square side in pixels."""
MASK_MARGIN = 1
"""Pixels the edit mask extends beyond the edited square in every frame."""
EDIT_KINDS = ("recolour", "remove")
ASSETS = Path(__file__).resolve().parents[2] / "assets" / "video_edit"


@dataclass
class EditClip:
    """One editing example: source and target clips Float[F,3,H,W] in [0, 1], the mask Float[F,H,W]."""

    source: Tensor
    target: Tensor
    mask: Tensor
    instruction: str
    edit: str
    source_caption: str
    target_caption: str


def _path(rng: random.Random, side: int) -> list[tuple[int, int]]:
    """Top-left corners of a square moving in a straight line at constant speed, inside the frame."""
    hi = SIZE - side
    for _ in range(100):
        x0, y0 = rng.uniform(0, hi), rng.uniform(0, hi)
        vx, vy = rng.uniform(-2.0, 2.0), rng.uniform(-2.0, 2.0)
        if abs(vx) + abs(vy) < 1.0:
            continue
        xs = [x0 + vx * t for t in range(FRAMES)]
        ys = [y0 + vy * t for t in range(FRAMES)]
        if min(xs) >= 0 and min(ys) >= 0 and max(xs) <= hi and max(ys) <= hi:
            return [(round(x), round(y)) for x, y in zip(xs, ys)]
    raise RuntimeError("could not place a moving square")


def _draw(frames: Tensor, corners: list[tuple[int, int]], side: int, colour: str) -> None:
    rgb = torch.tensor(PALETTE[colour], dtype=torch.float32).view(3, 1, 1) / 255.0
    for t, (x, y) in enumerate(corners):
        frames[t, :, y : y + side, x : x + side] = rgb


def _mask(corners: list[tuple[int, int]], side: int) -> Tensor:
    m = torch.zeros(FRAMES, SIZE, SIZE)
    for t, (x, y) in enumerate(corners):
        lo_x, lo_y = max(0, x - MASK_MARGIN), max(0, y - MASK_MARGIN)
        m[t, lo_y : y + side + MASK_MARGIN, lo_x : x + side + MASK_MARGIN] = 1.0
    return m


def _apart(a: tuple[int, int], b: tuple[int, int], side: int) -> bool:
    return abs(a[0] - b[0]) >= side + 2 or abs(a[1] - b[1]) >= side + 2


def make_edit_clip(rng: random.Random, edit: str | None = None) -> EditClip:
    """One random clip of `edit` kind (`EDIT_KINDS`; None: drawn uniformly) with its instruction and target."""
    edit = edit or rng.choice(EDIT_KINDS)
    if edit not in EDIT_KINDS:
        raise ValueError(f"unknown edit {edit!r}; one of {', '.join(EDIT_KINDS)}")
    colours = list(PALETTE)
    white = torch.ones(FRAMES, 3, SIZE, SIZE)
    side = rng.randint(*SIDE)
    moving = _path(rng, side)
    if edit == "recolour":
        c, new = rng.sample(colours, 2)
        source, target = white.clone(), white.clone()
        _draw(source, moving, side, c)
        _draw(target, moving, side, new)
        return EditClip(
            source,
            target,
            _mask(moving, side),
            f"make the square {new}",
            edit,
            f"a {c} square",
            f"a {new} square",
        )
    keep, gone = rng.sample(colours, 2)
    keep_side = rng.randint(*SIDE)
    for _ in range(200):
        corner = (rng.randint(0, SIZE - keep_side), rng.randint(0, SIZE - keep_side))
        if all(_apart(corner, m, max(side, keep_side)) for m in moving):
            break
    else:
        return make_edit_clip(rng, edit)  # the moving square crosses every spot: draw another clip
    static = [corner] * FRAMES
    source, target = white.clone(), white.clone()
    _draw(source, static, keep_side, keep)
    _draw(source, moving, side, gone)
    _draw(target, static, keep_side, keep)
    return EditClip(
        source,
        target,
        _mask(moving, side),
        f"remove the {gone} square",
        edit,
        f"a {gone} square",
        f"a {keep} square",
    )


def _row(clip: EditClip, name: str) -> dict[str, Any]:
    return {
        "prompt": clip.instruction,
        "instruction": clip.instruction,
        "edit": clip.edit,
        "source_video": f"clips/{name}.npz",
        "edit_mask": f"masks/{name}.npz",
        "target_video": f"targets/{name}.npz",
        "source_caption": clip.source_caption,
        "target_caption": clip.target_caption,
    }


def write_video_edit_dataset(
    folder: str | Path = ASSETS, n_train: int = 64, n_eval: int = 16, seed: int = 20
) -> dict[str, Path]:
    """Write the clips, targets, masks and ``train.jsonl`` / ``eval.jsonl`` under `folder` (train and eval
    from disjoint seeds ``seed`` and ``seed + 1``, both kinds in equal shares); returns the JSONL paths."""
    from mmalign.data.media import write_array

    folder = Path(folder)
    out: dict[str, Path] = {}
    for split, n, s in (("train", n_train, seed), ("eval", n_eval, seed + 1)):
        rng = random.Random(s)
        lines = []
        for i in range(n):
            clip = make_edit_clip(rng, EDIT_KINDS[i % len(EDIT_KINDS)])
            name = f"{split}_{i:03d}"
            write_array(clip.source, folder / "clips" / f"{name}.npz")
            write_array(clip.target, folder / "targets" / f"{name}.npz")
            write_array(clip.mask, folder / "masks" / f"{name}.npz")
            lines.append(json.dumps(_row(clip, name)))
        path = folder / f"{split}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        out[split] = path
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mmalign.tiny.video_shapes", description=__doc__.split("\n")[0]
    )
    parser.add_argument("folder", nargs="?", default=str(ASSETS))
    parser.add_argument("--train", type=int, default=64)
    parser.add_argument("--eval", type=int, default=16)
    args = parser.parse_args(argv)
    for split, path in write_video_edit_dataset(args.folder, args.train, args.eval).items():
        print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
