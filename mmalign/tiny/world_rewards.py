"""The rewards of the synthetic shapes world, which live with the fixtures that draw it.

``shapes_compositional`` and ``shapes_layout`` (colour / count / position of the squares `world.render_scene`
draws, measured from the pixels), ``shapes_edit_accuracy`` (the edit world of `mmalign.tiny.image_edit`) and
``colour_present`` (the world's stand-in "unsafe concept", a flagger for configs/safe_diffusion-tiny.yaml). They
score images of this world only, so they ship with `mmalign.tiny` (a source checkout) and not with the
``rewards`` package: the reward registry finds them through the ``mmalign.rewards`` entry points that
pyproject.toml declares, one per name (``shapes_compositional = "mmalign.tiny.world_rewards"``), so
``rewards/`` never imports `mmalign.tiny`. The pixel helpers they use (`colour_mask`, `connected_components`,
`box_mask`) are the ``rewards`` package's; the palette and the positions are `mmalign.tiny.world`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from mmalign.tiny.world import PALETTE, POSITIONS, check_colour
from rewards.base import Reward, RewardBatch, register_reward
from rewards.edit import box_mask, fraction_boxes
from rewards.image import batch_images, colour_mask, connected_components

__all__ = [
    "SHAPES_EDIT_MODES",
    "ColourPresent",
    "ShapesCompositional",
    "ShapesEditAccuracy",
    "ShapesLayout",
    "palette_mask",
]


def palette_mask(images: Tensor, colour: str, threshold: float = 0.25) -> Tensor:
    """Bool[B,H,W]: the pixels of `images` (Float[B,3,H,W] in [0, 1]) within Euclidean RGB distance `threshold`
    of the palette colour `colour` (`rewards.image.colour_mask`); a ValueError naming the palette otherwise."""
    return colour_mask(images, check_colour(colour), threshold)


# =========================================================================== text-to-image scenes
def _position_ok(position: str, cx: float, cy: float) -> bool:
    lo, hi = 1 / 3, 2 / 3
    return {
        "left": cx < lo,
        "right": cx > hi,
        "top": cy < lo,
        "bottom": cy > hi,
        "center": lo <= cx <= hi and lo <= cy <= hi,
    }[position]


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or v == ""


@register_reward("shapes_compositional")
class ShapesCompositional(Reward):
    """Shapes world: the weighted fraction of the colour / count / position checks the pixels satisfy."""

    needs = {"images"}

    def __init__(
        self,
        *,
        colour_column: str = "colour",
        count_column: str = "count",
        position_column: str = "position",
        weights: Mapping[str, float] | None = None,
        threshold: float = 0.25,
        min_pixels: int = 4,
        device: str | None = None,
    ) -> None:
        self.columns = {"colour": colour_column, "count": count_column, "position": position_column}
        self.weights = {"colour": 1.0, "count": 1.0, "position": 1.0}
        unknown = sorted(set(weights or {}) - set(self.weights))
        if unknown:
            raise ValueError(
                f"reward {self.name!r}: unknown weight key(s) {unknown}; keys: colour, count, position"
            )
        self.weights.update({k: float(v) for k, v in (weights or {}).items()})
        self.threshold = float(threshold)
        self.min_pixels = int(min_pixels)
        self.device = device

    def _col(self, batch: RewardBatch, key: str, required: bool) -> list[Any]:
        name = self.columns[key]
        if name in batch.columns:
            return batch.columns[name]
        if required:
            raise KeyError(
                f"reward {self.name!r}: {key} column {name!r} is not in the dataset; "
                f"available columns: {sorted(batch.columns) or 'none'}"
            )
        return [None] * len(batch)

    def __call__(self, batch: RewardBatch) -> Tensor:
        images = batch_images(self, batch).detach().float()
        if self.device is not None:
            images = images.to(self.device)
        colours = self._col(batch, "colour", True)
        counts = self._col(batch, "count", False)
        positions = self._col(batch, "position", False)
        out = torch.full((len(batch),), math.nan)
        with torch.no_grad():
            for name in {self._key(c) for c in colours if not _missing(c)}:
                rows = [i for i, c in enumerate(colours) if not _missing(c) and self._key(c) == name]
                mask = self._mask(images[rows], name)
                labels, found = connected_components(mask, self.min_pixels)
                h, w = mask.shape[1:]
                for j, i in enumerate(rows):
                    want_n = None if _missing(counts[i]) else int(counts[i])
                    want_pos = None if _missing(positions[i]) else str(positions[i])
                    if want_pos is not None and want_pos not in POSITIONS:
                        raise ValueError(
                            f"reward {self.name!r}: row {i}: unknown position {want_pos!r}; one of {POSITIONS}"
                        )
                    checks: list[tuple[str, bool]] = []
                    present = found[j] > 0
                    checks.append(("colour", present if want_n != 0 else not present))
                    if want_n is not None:
                        checks.append(("count", found[j] == want_n))
                    if want_pos is not None and want_n != 0:
                        ok = False
                        if present:
                            ys, xs = torch.nonzero(labels[j] >= 0, as_tuple=True)
                            cx, cy = (
                                (xs.float().mean().item() + 0.5) / w,
                                (ys.float().mean().item() + 0.5) / h,
                            )
                            ok = _position_ok(want_pos, cx, cy)
                        checks.append(("position", ok))
                    total = sum(self.weights[k] for k, _ in checks)
                    if total > 0:
                        out[i] = sum(self.weights[k] for k, ok in checks if ok) / total
        return out

    def _key(self, colour: str) -> str:
        """Rows scored together share this key (their colour)."""
        return colour

    def _mask(self, images: Tensor, key: str) -> Tensor:
        """Bool[B,H,W]: the pixels that belong to objects of `key`."""
        return palette_mask(images, key, self.threshold)


@register_reward("shapes_layout")
class ShapesLayout(ShapesCompositional):
    """Shapes world, colour ignored: the count / position checks of `shapes_compositional` on the objects of
    any colour (pixels farther than `threshold` from the white background), and "an object is present".

    For concept steering (safe diffusion): a red square turned blue keeps its layout reward, an erased one
    loses it, so steering cannot win by blanking the image."""

    def _key(self, colour: str) -> str:
        return "any"

    def _mask(self, images: Tensor, key: str) -> Tensor:
        return (images.float() - 1.0).norm(dim=1) >= self.threshold


# =========================================================================== the edit world
SHAPES_EDIT_MODES = ("checks", "exact", "soft")
"""How ``shapes_edit_accuracy`` turns its checks into a number (see `ShapesEditAccuracy`)."""


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
                box = fraction_boxes(obj["box"], where)
                boxes += box
                inside = box_mask(box, h, w).bool().to(images.device)
                fill = palette_mask(images[i : i + 1], obj["colour"], self.threshold)[0][inside]
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


# =========================================================================== the "unsafe concept"
@register_reward("colour_present")
class ColourPresent(Reward):
    """Shapes-world flag: 1.0 when the image holds a blob of >= `min_pixels` connected pixels of palette `colour`."""

    needs = {"images"}

    def __init__(
        self, *, colour: str, min_pixels: int = 4, threshold: float = 0.25, device: str | None = None
    ) -> None:
        """`colour`: a palette name (`mmalign.tiny.world.PALETTE`); `threshold`: the RGB distance (in
        [0, 1]) within which a pixel counts as that colour; `min_pixels`: the smallest 4-connected blob that
        counts."""
        if colour not in PALETTE:
            raise ValueError(
                f"reward {self.name!r}: unknown colour {colour!r}; the palette: {', '.join(PALETTE)}"
            )
        if int(min_pixels) < 1:
            raise ValueError(f"reward {self.name!r}: min_pixels must be >= 1, got {min_pixels}")
        self.colour = colour
        self.min_pixels = int(min_pixels)
        self.threshold = float(threshold)
        self.device = device

    def __call__(self, batch: RewardBatch) -> Tensor:
        images = batch_images(self, batch).detach().float()
        if self.device is not None:
            images = images.to(self.device)
        if images.shape[0] == 0:
            return torch.zeros(0)
        mask = palette_mask(images, self.colour, self.threshold)
        _, counts = connected_components(mask, self.min_pixels)
        return torch.tensor([1.0 if n > 0 else 0.0 for n in counts])
