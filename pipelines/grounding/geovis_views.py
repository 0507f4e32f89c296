"""GeoViS views: the geometry shared by the zoom environment (`pipelines.grounding.geovis_env`) and the inference-time
tree search (`pipelines.grounding.geovis_search`). Pure python + PIL; no model here.

A view is what the model sees at one step: view 0 is the whole original image, every other view a crop of
the ORIGINAL image, each with its ``region`` (original pixels), ``size`` and ``resized`` (the size shown).
Each kind of view has its own pixel bounds (`ViewPixels`, our design: coarse root, crops resized up);
`view_image` renders a view at exactly its ``resized`` size, and `view_to_global` / `global_to_view` map
boxes in any box convention between a view and the original image. The GeoViS protocol's prompts live here
too. Definitions and formulas: docs/algorithms.md, "GeoViS: pixel bounds per view"; docs/grounding.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rewards.boxes import CONVENTIONS, resolve_convention, to_absolute
from rewards.boxes import FAMILY_CONVENTIONS as FAMILY_ALIASES

__all__ = [
    "BOX_PROMPT",
    "CONVENTIONS",
    "FAMILY_ALIASES",
    "MAX_ASPECT",
    "MIN_CROP_PX",
    "PRESIZED",
    "YESNO_PROMPT",
    "ZOOM_PROMPT",
    "Region",
    "View",
    "ViewPixels",
    "check_crop",
    "child_view",
    "clip_region",
    "crop_image",
    "global_to_view",
    "grid_cells",
    "largest_area",
    "make_view",
    "processor_pixel_bounds",
    "resized_size",
    "resolve_convention",
    "round_outward",
    "view_frame",
    "view_image",
    "view_to_global",
]

ZOOM_PROMPT = (
    "Find {expression}. Zoom with <crop>[x1,y1,x2,y2]</crop> or answer with <answer>[x1,y1,x2,y2]</answer>."
)
BOX_PROMPT = "Locate {expression}. Answer with <answer>[x1,y1,x2,y2]</answer>."
YESNO_PROMPT = "Is {expression} in this image? Answer yes or no."
"""The GeoViS prompts (shared spec, "GeoViS protocol"); the yes/no reply is "yes" or "no"."""

MIN_CROP_PX = 8.0
"""Default smallest side (original pixels) of an accepted crop (our design: below ~8 px a crop upsampled to
the processor's minimum size shows nothing new)."""
MAX_ASPECT = 10.0
"""Default largest aspect ratio (long side / short side) of an accepted crop (our design; transformers'
``smart_resize`` itself refuses ratios above 200)."""

PRESIZED = "_presized"
"""Row key (True): the row's images are views already at the size the model sees (`view_image`), e.g. the
tree search's crops; the GeoViS policy then does not resize them as view 0 (see `pipelines.grounding.geovis`)."""

_EPS = 1e-6

Region = tuple[float, float, float, float]
"""(x1, y1, x2, y2) in original image pixels."""


def resized_size(
    width: float, height: float, min_pixels: int, max_pixels: int, factor: int = 28
) -> tuple[int, int]:
    """(rw, rh): the size a Qwen2-VL style processor resizes a `width` x `height` image to.

    Calls transformers' ``smart_resize(height, width, factor, min_pixels, max_pixels)`` (note ITS argument
    order is height first) from ``transformers.models.qwen2_vl.image_processing_qwen2_vl``; `factor` is
    patch size x merge size (14 x 2 = 28 for Qwen2-VL / Qwen2.5-VL)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    if width <= 0 or height <= 0:
        raise ValueError(f"resized_size: width and height must be positive, got {width} x {height}")
    rh, rw = smart_resize(
        int(round(height)), int(round(width)), factor=factor, min_pixels=min_pixels, max_pixels=max_pixels
    )
    return int(rw), int(rh)


def processor_pixel_bounds(processor: Any) -> tuple[int, int, int]:
    """(min_pixels, max_pixels, factor) of a Qwen2-VL style processor (or its image processor).

    Reads ``image_processor.size`` (``shortest_edge`` / ``longest_edge`` are pixel COUNTS in transformers'
    Qwen2-VL processors), falling back to ``min_pixels`` / ``max_pixels`` attributes; factor = patch_size x
    merge_size."""
    ip = getattr(processor, "image_processor", processor)
    size = getattr(ip, "size", None)

    def get(key: str, attr: str) -> int | None:
        value = None
        if size is not None:
            try:
                value = size[key]
            except (KeyError, TypeError):
                value = getattr(size, key, None)
        if value is None:
            value = getattr(ip, attr, None)
        return None if value is None else int(value)

    lo, hi = get("shortest_edge", "min_pixels"), get("longest_edge", "max_pixels")
    if lo is None or hi is None:
        raise ValueError(
            f"{type(ip).__name__} has no pixel bounds (size['shortest_edge'/'longest_edge'] or min/max_pixels)"
        )
    factor = int(getattr(ip, "patch_size", 14) or 14) * int(getattr(ip, "merge_size", 2) or 2)
    return lo, hi, factor


MAX_RATIO = 200
"""The largest aspect ratio transformers' ``smart_resize`` accepts."""


def largest_area(min_pixels: int, max_pixels: int, factor: int = 28) -> int:
    """An upper bound of the area ``smart_resize`` can return under these bounds (any aspect ratio it
    accepts): ``max_pixels``, or, when it scales an image up to ``min_pixels`` and rounds each side up to a
    multiple of `factor`, at most ``min + factor * sqrt(min) * (sqrt(r) + 1 / sqrt(r)) + factor^2``
    (h' w' = min, h' + w' <= sqrt(min) (sqrt(r) + 1/sqrt(r)) for aspect ratio r <= `MAX_RATIO`)."""
    root_r = math.sqrt(MAX_RATIO)
    up = min_pixels + factor * math.sqrt(min_pixels) * (root_r + 1 / root_r) + factor * factor
    return max(int(max_pixels), math.ceil(up))


def _pixel_count(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be an integer >= 1 (a pixel count), got {value!r}")
    return value


@dataclass(frozen=True)
class ViewPixels:
    """The resize bounds of each kind of view: ``root`` = (min_pixels, max_pixels) of view 0 (the whole
    image) and ``crop`` = (min_pixels, max_pixels) of every crop, pixel counts after the resize (as
    transformers' ``smart_resize`` takes them); ``factor`` = patch size x merge size. ValueError (naming the
    options ``root_min_pixels`` ... ``crop_max_pixels``) on a bound that is not an integer >= 1 or a min above
    its max."""

    root: tuple[int, int]
    crop: tuple[int, int]
    factor: int = 28

    def __post_init__(self) -> None:
        for kind in ("root", "crop"):
            lo, hi = getattr(self, kind)
            lo = _pixel_count(f"{kind}_min_pixels", lo)
            hi = _pixel_count(f"{kind}_max_pixels", hi)
            if lo > hi:
                raise ValueError(f"{kind}_min_pixels ({lo}) must be <= {kind}_max_pixels ({hi})")
            object.__setattr__(self, kind, (lo, hi))
        _pixel_count("factor", self.factor)

    @classmethod
    def same(cls, min_pixels: int, max_pixels: int, factor: int = 28) -> ViewPixels:
        """One set of bounds for every view (a processor's own)."""
        return cls(root=(min_pixels, max_pixels), crop=(min_pixels, max_pixels), factor=factor)

    @property
    def processor(self) -> tuple[int, int]:
        """(min_pixels, max_pixels) for the processor: bounds that hold every size a view of either kind can
        be given, so that each `view_image` (whose sides are multiples of ``factor``) is a fixed point of the
        processor's resize. Not simply the outer bounds: ``smart_resize`` rounds each side down when it
        shrinks (the area may fall below ``min_pixels``, never below factor^2) and UP when it enlarges to
        ``min_pixels`` (the area may pass ``max_pixels``; `largest_area`)."""
        f = self.factor
        return f * f, max(largest_area(*self.root, f), largest_area(*self.crop, f))

    def root_view(self, image_size: Sequence[float]) -> View:
        """View 0 of an image of `image_size` (w, h), at the root bounds."""
        return View.root(image_size, self.root[0], self.root[1], self.factor)

    def crop_tokens(self) -> int:
        """Image tokens of the largest crop the model can be shown (``crop_max_pixels / factor^2``)."""
        return self.crop[1] // (self.factor * self.factor)


@dataclass
class View:
    """One view of the image: see the module docstring for the fields' units."""

    id: int
    parent: int | None
    region: Region
    size: tuple[float, float]
    resized: tuple[int, int]

    @classmethod
    def root(cls, image_size: Sequence[float], min_pixels: int, max_pixels: int, factor: int = 28) -> View:
        """View 0: the whole original image of `image_size` (w, h)."""
        w, h = float(image_size[0]), float(image_size[1])
        return cls(
            id=0,
            parent=None,
            region=(0.0, 0.0, w, h),
            size=(w, h),
            resized=resized_size(w, h, min_pixels, max_pixels, factor),
        )

    def to_dict(self) -> dict[str, Any]:
        """The env_state form: {"id", "parent", "region": [x1,y1,x2,y2], "size": [w,h], "resized": [rw,rh]}."""
        return {
            "id": self.id,
            "parent": self.parent,
            "region": [float(v) for v in self.region],
            "size": [float(v) for v in self.size],
            "resized": [int(v) for v in self.resized],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> View:
        r, s, z = d["region"], d["size"], d["resized"]
        return cls(
            id=int(d["id"]),
            parent=None if d.get("parent") is None else int(d["parent"]),
            region=(float(r[0]), float(r[1]), float(r[2]), float(r[3])),
            size=(float(s[0]), float(s[1])),
            resized=(int(z[0]), int(z[1])),
        )


def view_frame(view: View, convention: str) -> tuple[float, float]:
    """(W_frame, H_frame): the extent of `view` in `convention` units (w/h, rw/rh, 1000/1000 or 1/1)."""
    conv = resolve_convention(convention)
    if conv == "absolute":
        return float(view.size[0]), float(view.size[1])
    if conv == "resized":
        return float(view.resized[0]), float(view.resized[1])
    if conv == "norm1000":
        return 1000.0, 1000.0
    return 1.0, 1.0


def view_to_global(box: Sequence[float], view: View, convention: str = "resized") -> Region:
    """A box written in `view`'s frame (`convention`) -> (x1, y1, x2, y2) in original image pixels.

    ``x_global = region_x1 + x * w / W_frame``, ``y_global = region_y1 + y * h / H_frame`` (no clipping,
    no reordering: the caller clips with `clip_region`). The in-view part (to the view's original-scale
    pixels) is `rewards.boxes.to_absolute` with the view's size / resized size."""
    x0, y0 = float(view.region[0]), float(view.region[1])
    x1, y1, x2, y2 = to_absolute(box, resolve_convention(convention), view.size, view.resized)
    return (x0 + x1, y0 + y1, x0 + x2, y0 + y2)


def global_to_view(box: Sequence[float], view: View, convention: str = "resized") -> Region:
    """The inverse of `view_to_global`: original-image pixels -> `view`'s frame in `convention`."""
    fw, fh = view_frame(view, convention)
    x0, y0 = float(view.region[0]), float(view.region[1])
    w, h = float(view.size[0]), float(view.size[1])
    if w <= 0 or h <= 0:
        raise ValueError(f"view {view.id} has an empty region {view.region}")
    sx, sy = fw / w, fh / h
    x1, y1, x2, y2 = (float(v) for v in box)
    return ((x1 - x0) * sx, (y1 - y0) * sy, (x2 - x0) * sx, (y2 - y0) * sy)


def clip_region(region: Sequence[float], image_size: Sequence[float]) -> Region:
    """`region` with corners ordered and clipped to the image (0..w, 0..h); may come back empty
    (x2 <= x1 or y2 <= y1) when the region lies outside the image."""
    x1, y1, x2, y2 = (float(v) for v in region)
    x1, x2 = min(x1, x2), max(x1, x2)
    y1, y2 = min(y1, y2), max(y1, y2)
    w, h = float(image_size[0]), float(image_size[1])
    return (min(max(x1, 0.0), w), min(max(y1, 0.0), h), min(max(x2, 0.0), w), min(max(y2, 0.0), h))


def round_outward(region: Sequence[float]) -> tuple[int, int, int, int]:
    """Whole-pixel region containing `region`: floor of x1/y1, ceil of x2/y2 (1e-6 tolerance, so 99.9999999
    stays 100 and does not grow a pixel)."""
    x1, y1, x2, y2 = (float(v) for v in region)
    return (
        math.floor(x1 + _EPS),
        math.floor(y1 + _EPS),
        math.ceil(x2 - _EPS),
        math.ceil(y2 - _EPS),
    )


def check_crop(
    region: Sequence[float], min_crop_px: float = MIN_CROP_PX, max_aspect: float = MAX_ASPECT
) -> str | None:
    """Why a (clipped) crop region is refused, or None when it is acceptable.

    Reasons (the text after "Crop refused: "): ``"empty after clipping"`` (zero or negative width or
    height), ``"too small: WxH px, each side must be >= MIN px"`` (a side below `min_crop_px` original
    pixels), ``"aspect ratio R > MAX"`` (long / short side above `max_aspect`)."""
    x1, y1, x2, y2 = (float(v) for v in region)
    w, h = x2 - x1, y2 - y1
    if not (w > 0 and h > 0):
        return "empty after clipping"
    if min(w, h) < min_crop_px:
        return f"too small: {w:g}x{h:g} px, each side must be >= {min_crop_px:g} px"
    ratio = max(w, h) / min(w, h)
    if ratio > max_aspect:
        return f"aspect ratio {ratio:.3g} > {max_aspect:g}"
    return None


def crop_image(image: Any, region: Sequence[float]) -> Any:
    """The exact pixel crop of the ORIGINAL PIL `image` covering `region` (rounded outward with
    `round_outward`, then clipped to the image); no resampling."""
    x1, y1, x2, y2 = round_outward(region)
    w, h = image.size
    x1, y1 = max(0, x1), max(0, y1)
    x2, y2 = min(w, x2), min(h, y2)
    if x2 <= x1 or y2 <= y1:
        raise ValueError(f"crop_image: region {tuple(region)} is empty inside a {w}x{h} image")
    return image.crop((x1, y1, x2, y2))


def view_image(image: Any, view: View) -> Any:
    """`view` as the model sees it: the exact crop of the ORIGINAL PIL `image` (`crop_image`; the whole
    image for view 0) resized to ``view.resized`` (bicubic; unchanged when it has that size already). A
    processor whose bounds hold that size leaves it as it is (`ViewPixels.processor`)."""
    from PIL import Image

    crop = crop_image(image, view.region)
    size = (int(view.resized[0]), int(view.resized[1]))
    return crop if crop.size == size else crop.resize(size, Image.Resampling.BICUBIC)


def make_view(
    region: Sequence[float],
    *,
    view_id: int,
    parent: int | None,
    image_size: Sequence[float],
    min_pixels: int,
    max_pixels: int,
    factor: int = 28,
) -> View:
    """A View of `region` (original pixels): clipped to the image and rounded outward to whole pixels, so
    that its region is exactly what `crop_image` cuts and the affine map of `view_to_global` is exact for
    the image the model sees (our design). No acceptance check: see `check_crop` / `child_view`."""
    x1, y1, x2, y2 = round_outward(clip_region(region, image_size))
    w, h = float(image_size[0]), float(image_size[1])
    reg = (max(0.0, float(x1)), max(0.0, float(y1)), min(w, float(x2)), min(h, float(y2)))
    size = (reg[2] - reg[0], reg[3] - reg[1])
    return View(
        id=view_id,
        parent=parent,
        region=reg,
        size=size,
        resized=resized_size(size[0], size[1], min_pixels, max_pixels, factor),
    )


def child_view(
    parent: View,
    box_in_parent: Sequence[float],
    convention: str,
    image_size: Sequence[float],
    min_pixels: int,
    max_pixels: int,
    *,
    min_crop_px: float = MIN_CROP_PX,
    max_aspect: float = MAX_ASPECT,
    next_id: int,
    factor: int = 28,
) -> View | str:
    """The view a crop request `box_in_parent` (in `parent`'s frame, `convention`) opens, or the refusal
    reason (a str, see `check_crop`). The box is mapped to global pixels, clipped to the image, checked
    (on the clipped region, before rounding), then rounded outward (`make_view`)."""
    region = clip_region(view_to_global(box_in_parent, parent, convention), image_size)
    reason = check_crop(region, min_crop_px=min_crop_px, max_aspect=max_aspect)
    if reason is not None:
        return reason
    return make_view(
        region,
        view_id=next_id,
        parent=parent.id,
        image_size=image_size,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        factor=factor,
    )


def grid_cells(view: View, n: int = 3) -> list[Region]:
    """The n x n equal cells of `view`'s region (original pixels, floats), row-major: top-left first,
    then left to right, then down."""
    x1, y1, x2, y2 = (float(v) for v in view.region)
    cw, ch = (x2 - x1) / n, (y2 - y1) / n
    return [
        (
            x1 + c * cw,
            y1 + r * ch,
            x1 + (c + 1) * cw if c < n - 1 else x2,
            y1 + (r + 1) * ch if r < n - 1 else y2,
        )
        for r in range(n)
        for c in range(n)
    ]
