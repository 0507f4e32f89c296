"""The synthetic shapes world: its palette, its position regions and `render_scene`, which draws a scene.

A scene is ``count`` objects of one `PALETTE` colour inside one of the `POSITIONS` regions (or anywhere)
of a white image. The tiny shapes-world models (`mmalign.tiny.shapes`, `mmalign.tiny.clip`) are trained
on rendered scenes; the ``shapes_compositional``, ``shapes_layout``, ``shapes_edit_accuracy`` and
``colour_present`` rewards (`mmalign.tiny.world_rewards`) score images of this world from their pixels, with
this palette and these positions.
Light to import: PIL, NumPy and torch only.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import Tensor

__all__ = ["PALETTE", "POSITIONS", "check_colour", "render_scene"]

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (230, 30, 30),
    "green": (30, 180, 40),
    "blue": (30, 70, 230),
    "yellow": (240, 220, 30),
}
"""The colours of the shapes world, RGB 0-255."""

POSITIONS = ("left", "right", "top", "bottom", "center")

# where `render_scene` puts the objects (x0, y0, x1, y1 as fractions of the image)
_REGIONS: dict[str | None, tuple[float, float, float, float]] = {
    "left": (0.04, 0.1, 0.30, 0.9),
    "right": (0.70, 0.1, 0.96, 0.9),
    "top": (0.1, 0.04, 0.9, 0.30),
    "bottom": (0.1, 0.70, 0.9, 0.96),
    "center": (0.36, 0.36, 0.64, 0.64),
    None: (0.05, 0.05, 0.95, 0.95),
}


def check_colour(colour: str) -> tuple[int, int, int]:
    """The RGB (0-255) of the palette colour `colour`; a `ValueError` naming the palette otherwise."""
    if colour not in PALETTE:
        raise ValueError(f"unknown colour {colour!r}; the palette: {', '.join(PALETTE)}")
    return PALETTE[colour]


def render_scene(
    colour: str,
    count: int = 1,
    position: str | None = None,
    size: int = 64,
    *,
    shape: str = "square",
    background: tuple[int, int, int] = (255, 255, 255),
    as_pil: bool = False,
) -> Tensor | Image.Image:
    """Draw `count` objects of palette `colour` inside the `position` region of a `size`x`size` image.

    The objects sit on a grid (no overlaps, no anti-aliasing), so `shapes_compositional` scores the
    scene 1 for the same (colour, count, position). ``position=None`` uses the whole image. Returns
    Float[3,size,size] in [0,1], or the PIL image with ``as_pil=True``.
    """
    rgb = check_colour(colour)
    if position not in _REGIONS:
        raise ValueError(f"unknown position {position!r}; one of {', '.join(POSITIONS)} or None")
    if shape not in ("square", "circle"):
        raise ValueError(f"unknown shape {shape!r}; 'square' or 'circle'")
    count = int(count)
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    img = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(img)
    if count:
        fx0, fy0, fx1, fy1 = _REGIONS[position]
        x0, y0, x1, y1 = fx0 * size, fy0 * size, fx1 * size, fy1 * size
        w, h = x1 - x0, y1 - y0
        # the grid: as square-ish cells as the region allows
        cols = max(1, min(count, round(math.sqrt(count * w / h))))
        rows = math.ceil(count / cols)
        cw, ch = w / cols, h / rows
        side = max(2.0, 0.6 * min(cw, ch))
        if side >= min(cw, ch):
            raise ValueError(
                f"{count} objects do not fit in the {position or 'whole'} region of a {size}px image"
            )
        for k in range(count):
            r, c = divmod(k, cols)
            n_in_row = min(cols, count - r * cols)  # centre a short last row
            off = (cols - n_in_row) * cw / 2
            cx, cy = x0 + off + (c + 0.5) * cw, y0 + (r + 0.5) * ch
            box = [
                round(cx - side / 2),
                round(cy - side / 2),
                round(cx + side / 2) - 1,
                round(cy + side / 2) - 1,
            ]
            if shape == "square":
                draw.rectangle(box, fill=rgb)
            else:
                draw.ellipse(box, fill=rgb)
    if as_pil:
        return img
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255.0
