"""The GeoViS zoom environment: a multi_turn rollout environment that opens crops of the original image.

After each generated turn `ZoomEnvironment` reads the turn's first action tag: ``<answer>[...]</answer>``
stores the box, mapped to original pixels, as ``env_state["answer_box"]`` and ends the episode;
``<crop>[...]</crop>`` / ``<crop view=K>[...]</crop>`` opens a crop of the ORIGINAL image (checked by
`geovis_views.child_view`, rendered by `geovis_views.view_image`) and inserts it as a new view, or inserts a
"Crop refused" message; anything else ends the episode without an answer. Boxes are in the ``convention`` of
the view they are written in. `replay` rebuilds the state from the turn texts alone. Protocol, state layout
and our design choices: docs/grounding.md, "The trained zoom policy".
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from mmalign.data.rollout_loops import DONE, Done, Insert, TurnContext
from pipelines.grounding.geovis_views import (
    MIN_CROP_PX,
    ZOOM_PROMPT,
    View,
    ViewPixels,
    child_view,
    resolve_convention,
    view_image,
    view_to_global,
)

__all__ = ["ZOOM_PROMPT", "ACTION_RE", "ZoomEnvironment", "parse_action", "replay"]

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
BOX_RE = re.compile(rf"\[\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*\]")
"""A box written as ``[x1,y1,x2,y2]`` (spaces allowed, ints or decimals)."""
ACTION_RE = re.compile(
    r"<crop(?:\s+view\s*=\s*(?P<view>\d+))?\s*>(?P<crop>.*?)</crop>|<answer>(?P<answer>.*?)</answer>",
    re.DOTALL,
)
"""The action tags of a turn: ``<crop>..</crop>``, ``<crop view=K>..</crop>``, ``<answer>..</answer>``."""

REFUSAL = "Crop refused: {reason}. Crop a larger region of a view, or answer."
"""The text of the insertion after a refused crop (no image)."""


def _box(text: str) -> list[float] | None:
    m = BOX_RE.search(text)
    return None if m is None else [float(v) for v in m.groups()]


def parse_action(text: str) -> tuple[str, int | None, list[float] | None] | None:
    """The first action tag of a turn: ``("crop", view id or None, box or None)``, ``("answer", None, box or
    None)``, or None when the turn has no action tag. The box is the first ``[x1,y1,x2,y2]`` inside the tag,
    as written (corners not reordered)."""
    m = ACTION_RE.search(text)
    if m is None:
        return None
    if m.group("answer") is not None:
        return "answer", None, _box(m.group("answer"))
    view = m.group("view")
    return "crop", None if view is None else int(view), _box(m.group("crop"))


def _image_of(row: Mapping[str, Any]) -> Any:
    """The row's (first) image: a path or an in-memory PIL image."""
    images = row.get("images", row.get("image"))
    if isinstance(images, list | tuple):
        if not images:
            raise ValueError(f"{row.get('_source', 'row')}: the row has an empty 'images' list")
        images = images[0]
    if images is None:
        raise ValueError(f"{row.get('_source', 'row')}: the row has no 'images' (or 'image') column")
    return images


class ZoomEnvironment:
    """``env(turn: TurnContext) -> Done | Insert``: the GeoViS zoom tool (see the module docstring).

    Options: ``convention`` (how the model writes boxes in a view, default "resized"), ``min_pixels`` /
    ``max_pixels`` (the resize bounds of view 0, the whole image), ``crop_min_pixels`` / ``crop_max_pixels``
    (those of every crop; default: view 0's), ``factor`` (patch size x merge size): each view's resized size
    is predicted with ``smart_resize`` and each crop is inserted at that size (pass the bounds the policy
    shows its images at: `ViewPixels`), ``min_crop_px`` (smallest accepted crop side in original pixels),
    ``max_aspect`` (largest long/short side ratio, 4.0), ``max_views`` (views in all, view 0 included; a
    crop beyond it is refused), ``cache_images`` (how many original images to keep decoded)."""

    def __init__(
        self,
        *,
        convention: str = "resized",
        min_pixels: int = 3136,
        max_pixels: int = 12845056,
        crop_min_pixels: int | None = None,
        crop_max_pixels: int | None = None,
        factor: int = 28,
        min_crop_px: float = MIN_CROP_PX,
        max_aspect: float = 4.0,
        max_views: int = 8,
        cache_images: int = 64,
    ) -> None:
        try:
            self.convention = resolve_convention(convention)
        except ValueError as e:
            raise ValueError(f"ZoomEnvironment option 'convention': {e}") from None
        self.set_pixels(min_pixels, max_pixels, crop_min_pixels, crop_max_pixels, factor)
        if not float(min_crop_px) > 0:
            raise ValueError(f"ZoomEnvironment option 'min_crop_px' must be > 0 pixels, got {min_crop_px!r}")
        if not float(max_aspect) >= 1:
            raise ValueError(f"ZoomEnvironment option 'max_aspect' must be >= 1, got {max_aspect!r}")
        if not isinstance(max_views, int) or isinstance(max_views, bool) or max_views < 1:
            raise ValueError(f"ZoomEnvironment option 'max_views' must be an integer >= 1, got {max_views!r}")
        self.min_crop_px, self.max_aspect = float(min_crop_px), float(max_aspect)
        self.max_views = max_views
        self.cache_images = cache_images
        self._images: OrderedDict[str, Any] = OrderedDict()

    def set_pixels(
        self,
        min_pixels: int,
        max_pixels: int,
        crop_min_pixels: int | None = None,
        crop_max_pixels: int | None = None,
        factor: int = 28,
    ) -> None:
        """Set the pixel bounds of view 0 and of the crops (None: view 0's); ValueError naming the option
        on a bound that is not an integer >= 1 or a min above its max."""
        crop = (
            min_pixels if crop_min_pixels is None else crop_min_pixels,
            max_pixels if crop_max_pixels is None else crop_max_pixels,
        )
        try:
            self.pixels = ViewPixels(root=(min_pixels, max_pixels), crop=crop, factor=factor)
        except ValueError as e:
            message = str(e).replace("root_min_pixels", "min_pixels").replace("root_max_pixels", "max_pixels")
            raise ValueError(f"ZoomEnvironment option {message}") from None

    @property
    def min_pixels(self) -> int:
        return self.pixels.root[0]

    @property
    def max_pixels(self) -> int:
        return self.pixels.root[1]

    @property
    def factor(self) -> int:
        return self.pixels.factor

    # ------------------------------------------------------------------ the environment
    def __call__(self, turn: TurnContext) -> Done | Insert:
        conv = turn.conversation
        return self.step(conv.state, conv.row, turn.turn, turn.text)

    def step(
        self, state: dict[str, Any], row: Mapping[str, Any], turn: int, text: str, *, load_images: bool = True
    ) -> Done | Insert:
        """One environment step on `state` (modified in place) for the generated turn `text` (index `turn`)
        of `row`. With ``load_images=False`` an accepted crop's Insert carries no image (`replay`)."""
        views = self.ensure_views(state, row)
        crops: list[dict[str, Any]] = state.setdefault("crops", [])
        action = parse_action(text)
        if action is None:
            return DONE
        kind, view_id, box = action
        latest = View.from_dict(views[-1])
        if kind == "answer":
            if box is not None:
                x1, y1, x2, y2 = view_to_global(box, latest, self.convention)
                state["answer_box"] = [min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)]
                state["answer_turn"] = turn
            return DONE
        parent = latest
        reason: str | None = None
        if view_id is not None:
            known = {int(v["id"]): v for v in views}
            if view_id not in known:
                reason = f"unknown view {view_id} (views so far: {', '.join(map(str, sorted(known)))})"
            else:
                parent = View.from_dict(known[view_id])
        if reason is None and box is None:
            reason = "no box (write four numbers [x1,y1,x2,y2])"
        if reason is None and len(views) >= self.max_views:
            reason = f"view limit reached ({self.max_views} views)"
        child: View | str | None = None
        if reason is None:
            assert box is not None
            child = child_view(
                parent,
                box,
                self.convention,
                self._image_size(views),
                self.pixels.crop[0],
                self.pixels.crop[1],
                min_crop_px=self.min_crop_px,
                max_aspect=self.max_aspect,
                next_id=len(views),
                factor=self.factor,
            )
            if isinstance(child, str):
                reason = child
        if reason is not None or not isinstance(child, View):
            crops.append({"turn": turn, "view": None, "accepted": False, "reason": str(reason)})
            return Insert(text=REFUSAL.format(reason=reason), images=[], role="user")
        views.append(child.to_dict())
        crops.append({"turn": turn, "view": child.id, "accepted": True, "reason": ""})
        images = [view_image(self._load(row), child)] if load_images else []
        return Insert(text=f"View {child.id}:", images=images, role="user")

    # ------------------------------------------------------------------ helpers
    def ensure_views(self, state: dict[str, Any], row: Mapping[str, Any]) -> list[dict[str, Any]]:
        """``state["views"]``, created with view 0 (the whole image) on the first call."""
        if not state.get("views"):
            size = self._row_size(row)
            state["views"] = [self.pixels.root_view(size).to_dict()]
            state.setdefault("crops", [])
        return state["views"]

    @staticmethod
    def _image_size(views: list[dict[str, Any]]) -> tuple[float, float]:
        """(w, h) of the original image: view 0's size."""
        w, h = views[0]["size"]
        return float(w), float(h)

    def _row_size(self, row: Mapping[str, Any]) -> tuple[float, float]:
        """(w, h) of the original image: the row's image_width / image_height, else read from the image."""
        w, h = row.get("image_width"), row.get("image_height")
        if w is not None and h is not None:
            return float(w), float(h)
        image = _image_of(row)
        if isinstance(image, str):
            from PIL import Image

            with Image.open(image) as im:
                return float(im.width), float(im.height)
        return float(image.width), float(image.height)

    def _load(self, row: Mapping[str, Any]) -> Any:
        """The original image as RGB PIL (paths decoded once and kept in a small cache)."""
        image = _image_of(row)
        if not isinstance(image, str):
            return image.convert("RGB") if getattr(image, "mode", "RGB") != "RGB" else image
        if image in self._images:
            self._images.move_to_end(image)
            return self._images[image]
        from PIL import Image

        with Image.open(image) as im:
            loaded = im.convert("RGB")
        self._images[image] = loaded
        while len(self._images) > self.cache_images:
            self._images.popitem(last=False)
        return loaded


def replay(row: Mapping[str, Any], turns: Sequence[str], **options: Any) -> dict[str, Any]:
    """The state `ZoomEnvironment(**options)` builds for the generated `turns` of `row` (no image loaded).

    Steps through the turns in order and stops at the first `DONE`, as the multi_turn loop does; the
    result equals the live ``Conversation.state`` of a rollout that generated these turns."""
    env = ZoomEnvironment(**options)
    state: dict[str, Any] = {}
    env.ensure_views(state, row)
    for t, text in enumerate(turns):
        if isinstance(env.step(state, row, t, text, load_images=False), Done):
            break
    return state
