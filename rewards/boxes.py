r"""Grounding rewards: bounding boxes parsed from a completion scored against reference boxes.

Registered: ``box_iou``, ``box_giou``, ``box_center``, ``iou_at`` (its ``threshold`` may change between
calls, for curricula), ``box_f1`` and ``iou_sweep``. `parse_boxes` / `parse_box` read JSON, bracket,
``<box>`` and Qwen-VL box styles, preferring the last ``<answer>`` and never taking a ``<crop>`` box for an
answer when one exists. ``coords`` says which convention the model writes (``absolute``, ``resized``,
``norm1000``, ``norm1`` or a family alias): mixing them up gives IoU ~ 0 without an error. The rewards, the
conventions with a worked example and the parsing precedence: docs/grounding.md, "Box coordinates" and
"Box rewards".
"""

from __future__ import annotations

import json
import logging
import math
import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from .base import Reward, RewardBatch, register_reward
from .text import extract_tag, parse_number

__all__ = [
    "batch_column",
    "CONVENTIONS",
    "COORDS",
    "FAMILY_CONVENTIONS",
    "IOU_SWEEP_THRESHOLDS",
    "Box",
    "BoxCenter",
    "BoxF1",
    "BoxGIoU",
    "BoxIoU",
    "IoUAt",
    "IoUSweep",
    "best_iou",
    "box_area",
    "box_f1",
    "box_precision_recall",
    "center_distance",
    "from_absolute",
    "giou",
    "iou",
    "iou_sweep_accuracy",
    "order_box",
    "parse_box",
    "parse_boxes",
    "rescale_box",
    "resolve_convention",
    "to_absolute",
]

Box = tuple[float, float, float, float]
Size = tuple[float, float]

log = logging.getLogger(__name__)

_R = TypeVar("_R", bound="Reward")

_LAST_WARNED: dict[str, weakref.ref[Any]] = {}
"""The batch each kind of parse failure was last logged for (`_BoxReward._warn`), so that the several box
rewards of one reward set scoring the same batch log it once."""


# ================================================================================ parsing
_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
# one regex, scanned left to right without overlaps: [x1,y1,x2,y2] | (x1,y1,x2,y2) | (x1,y1),(x2,y2)
_BOX_RE = re.compile(
    rf"\[\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*\]"
    rf"|\(\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*\)"
    rf"|\(\s*({_NUM})\s*,\s*({_NUM})\s*\)\s*(?:,|-|to)?\s*\(\s*({_NUM})\s*,\s*({_NUM})\s*\)"
)
_BOX_RES = (_BOX_RE,)  # kept for code that iterated over the old tuple of patterns
_JSON_START = re.compile(r"{")  # a list of objects is read object by object (same boxes, same order)
_JSON_KEY_RE = re.compile(r'"(?:bbox_2d|bbox|box)"\s*:')
_JSON_KEYS = ("bbox_2d", "bbox", "box")  # per JSON object the first key present counts (no double count)
_CROP_RE = re.compile(r"<crop\b[^>]*>[^<]*(?:</crop>)?")


def order_box(box: Sequence[float]) -> Box | None:
    """(x1, y1, x2, y2) with x1 <= x2 and y1 <= y2 (swapped if needed); None unless 4 finite numbers."""
    if isinstance(box, str | bytes) or not isinstance(box, Sequence) or len(box) != 4:
        return None
    vals = [parse_number(v) for v in box]
    if any(v is None for v in vals):
        return None
    x1, y1, x2, y2 = vals  # type: ignore[misc]
    return (min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2))


def _regex_boxes(text: str) -> list[tuple[int, Box]]:
    out = []
    for m in _BOX_RE.finditer(text):
        nums = [g for g in m.groups() if g is not None]
        box = order_box([float(g) for g in nums])
        if box is not None:
            out.append((m.start(), box))
    return out


def _value_boxes(value: Any) -> list[Box]:
    """The boxes of one JSON value under a box key: a box, a list of boxes or a string holding some."""
    if isinstance(value, str):
        return [b for _, b in _regex_boxes(value)]
    if isinstance(value, list):
        if value and all(isinstance(v, list) for v in value):
            return [b for v in value if (b := order_box(v)) is not None]
        box = order_box(value)
        return [] if box is None else [box]
    return []


def _json_boxes(obj: Any, out: list[Box]) -> bool:
    """Append the boxes under box keys anywhere in `obj`; True if any box key was present."""
    keyed = False
    if isinstance(obj, dict):
        key = next((k for k in _JSON_KEYS if k in obj), None)
        if key is not None:
            keyed = True
            out.extend(_value_boxes(obj[key]))
        for k, v in obj.items():
            if k != key and isinstance(v, dict | list):
                keyed |= _json_boxes(v, out)
    elif isinstance(obj, list):
        for v in obj:
            keyed |= _json_boxes(v, out)
    return keyed


def _scan(text: str) -> list[Box]:
    """Every box in `text` in order of position: JSON structures with box keys first (their text is then
    blanked out), the regex styles on the rest."""
    found: list[tuple[int, Box]] = []
    decoder = json.JSONDecoder()
    masked = text
    i = 0 if _JSON_KEY_RE.search(text) else len(text)  # no quoted box key: no JSON pass at all
    while (m := _JSON_START.search(text, i)) is not None:
        start = m.start()
        try:
            obj, end = decoder.raw_decode(text, start)
        except ValueError:  # not JSON here: the regex styles still apply
            i = start + 1
            continue
        except RecursionError:  # absurdly deep nesting: give up the JSON pass (keeps the scan linear-ish)
            break
        boxes: list[Box] = []
        if _json_boxes(obj, boxes):
            found.extend((start, b) for b in boxes)
            masked = masked[:start] + " " * (end - start) + masked[end:]
        i = end  # an object without box keys holds none deeper either: skip it whole
    found.extend(_regex_boxes(masked))
    found.sort(key=lambda t: t[0])  # stable: boxes of one JSON structure keep their order
    return [b for _, b in found]


def parse_boxes(text: Any, tag: str = "answer") -> list[Box]:
    """Every box of a completion, in order, each (x1, y1, x2, y2) with x1 <= x2, y1 <= y2; [] if none.

    Precedence (our design): the boxes in the last ``<tag>...</tag>`` if it holds any; else the boxes
    outside ``<crop>`` elements; the crop boxes only when the text has no ``<tag>`` element at all
    (see the module docstring for the styles). Coordinates are returned as written (no convention
    applied). Not a string -> [].
    """
    if not isinstance(text, str):
        return []
    inner = extract_tag(text, tag) if tag else None
    if inner is not None:
        boxes = _scan(inner)
        if boxes:
            return boxes
    outside = _scan(_CROP_RE.sub(lambda m: " " * len(m.group(0)), text))
    if outside or inner is not None:
        return outside
    return _scan(text)


def parse_box(text: Any, tag: str = "answer") -> Box | None:
    """The last box of `parse_boxes(text, tag)` (the answer's box), as (x1, y1, x2, y2); else None.

    Forms: ``[x1, y1, x2, y2]``, ``{"bbox_2d": [x1, y1, x2, y2], ...}`` (Qwen2.5-VL's JSON, also in a
    ```json fence or a list of objects), ``(x1, y1, x2, y2)`` and ``(x1,y1),(x2,y2)``. Boxes inside the
    last ``<answer>...</answer>`` take precedence; without a box there, the last box outside
    ``<crop>`` elements counts.
    """
    boxes = parse_boxes(text, tag)
    return boxes[-1] if boxes else None


# ============================================================================ conventions
CONVENTIONS = ("absolute", "resized", "norm1000", "norm1")
COORDS = CONVENTIONS  # the old name (rewards.multimodal.COORDS)
FAMILY_CONVENTIONS = {"qwen2_vl": "norm1000", "qwen2_5_vl": "resized", "qwen3_vl": "norm1000"}


def resolve_convention(name: str) -> str:
    """The convention a `coords` option names: a convention of `CONVENTIONS` or a model family of
    `FAMILY_CONVENTIONS` ("Qwen2.5-VL" and "qwen2.5-vl" are read as "qwen2_5_vl": case, "-" and "."
    are normalised). ValueError listing the choices otherwise."""
    if isinstance(name, str):
        if name in CONVENTIONS:
            return name
        key = name.strip().lower().replace("-", "_").replace(".", "_")
        if key in CONVENTIONS:
            return key
        if key in FAMILY_CONVENTIONS:
            return FAMILY_CONVENTIONS[key]
    families = ", ".join(f"{k} ({v})" for k, v in FAMILY_CONVENTIONS.items())
    raise ValueError(
        f"unknown box coordinate convention {name!r}; choose one of {', '.join(CONVENTIONS)} "
        f"or a model family: {families}"
    )


def rescale_box(box: Sequence[float], from_size: Sequence[float], to_size: Sequence[float]) -> Box:
    """Map a box between two coordinate frames given as (width, height):
    x' = x * W_to / W_from, y' = y * H_to / H_from."""
    (fw, fh), (tw, th) = from_size, to_size
    if min(fw, fh, tw, th) <= 0:
        raise ValueError(
            f"sizes must be positive, got from_size={tuple(from_size)}, to_size={tuple(to_size)}"
        )
    sx, sy = tw / fw, th / fh
    x1, y1, x2, y2 = (float(v) for v in box)
    return (x1 * sx, y1 * sy, x2 * sx, y2 * sy)


def _frame(convention: str, original_size: Size | None, resized_size: Size | None) -> Size | None:
    """The (width, height) of the frame a convention writes in; None for "absolute"."""
    conv = resolve_convention(convention)
    if conv == "absolute":
        return None
    if original_size is None:
        raise ValueError(f"convention {conv!r} needs original_size=(W, H)")
    if conv == "norm1000":
        return (1000.0, 1000.0)
    if conv == "norm1":
        return (1.0, 1.0)
    if resized_size is None:
        raise ValueError("convention 'resized' needs resized_size=(W_r, H_r)")
    return (float(resized_size[0]), float(resized_size[1]))


def to_absolute(
    box: Sequence[float],
    convention: str,
    original_size: Size | None = None,
    resized_size: Size | None = None,
) -> Box:
    """A box written in `convention` (or a model family alias) as pixels of the ORIGINAL image.

    ``original_size`` = (W, H) of the original image (needed unless "absolute"); ``resized_size`` =
    (W_r, H_r) of the model's resized input (needed for "resized"). See the table in the module
    docstring. Corners are kept as given (not ordered, not clipped)."""
    frame = _frame(convention, original_size, resized_size)
    if frame is None:
        x1, y1, x2, y2 = (float(v) for v in box)
        return (x1, y1, x2, y2)
    assert original_size is not None
    return rescale_box(box, frame, original_size)


def from_absolute(
    box: Sequence[float],
    convention: str,
    original_size: Size | None = None,
    resized_size: Size | None = None,
) -> Box:
    """The inverse of `to_absolute`: a box in original pixels written in `convention`
    (e.g. norm1000: x * 1000 / W; resized: x * W_r / W)."""
    frame = _frame(convention, original_size, resized_size)
    if frame is None:
        x1, y1, x2, y2 = (float(v) for v in box)
        return (x1, y1, x2, y2)
    assert original_size is not None
    return rescale_box(box, original_size, frame)


# =================================================================================== math
IOU_SWEEP_THRESHOLDS: tuple[float, ...] = tuple(round(0.5 + 0.05 * k, 2) for k in range(10))


def box_area(box: Sequence[float]) -> float:
    """(x2 - x1) * (y2 - y1) after ordering the corners; 0 for something that is not a box."""
    b = order_box(box)
    return 0.0 if b is None else (b[2] - b[0]) * (b[3] - b[1])


def _intersection(a: Box, b: Box) -> float:
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    return max(iw, 0.0) * max(ih, 0.0)


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two (x1, y1, x2, y2) boxes (corners ordered first); 0 if either is
    degenerate (zero area) or not a box."""
    a_, b_ = order_box(a), order_box(b)
    if a_ is None or b_ is None:
        return 0.0
    area_a, area_b = box_area(a_), box_area(b_)
    if area_a <= 0 or area_b <= 0:
        return 0.0
    inter = _intersection(a_, b_)
    return inter / (area_a + area_b - inter)


def giou(a: Sequence[float], b: Sequence[float]) -> float:
    """Generalised IoU (Rezatofighi et al. 2019): IoU - (C - U) / C with U the union area and C the area
    of the smallest box enclosing both; in [-1, 1]. Our design for the corner cases: a degenerate box
    has IoU 0 (as in `iou`); C == 0 (two identical points) gives 0; something that is not a box gives -1."""
    a_, b_ = order_box(a), order_box(b)
    if a_ is None or b_ is None:
        return -1.0
    inter = _intersection(a_, b_)
    union = box_area(a_) + box_area(b_) - inter
    enclose = (max(a_[2], b_[2]) - min(a_[0], b_[0])) * (max(a_[3], b_[3]) - min(a_[1], b_[1]))
    if enclose <= 0:
        return 0.0
    return iou(a_, b_) - (enclose - union) / enclose


def center_distance(a: Sequence[float], b: Sequence[float]) -> float:
    """Euclidean distance between the box centres ((x1 + x2) / 2, (y1 + y2) / 2), in the boxes' units;
    inf if either is not a box (our design)."""
    a_, b_ = order_box(a), order_box(b)
    if a_ is None or b_ is None:
        return math.inf
    return math.hypot((a_[0] + a_[2] - b_[0] - b_[2]) / 2, (a_[1] + a_[3] - b_[1] - b_[3]) / 2)


def best_iou(pred: Sequence[float], refs: Sequence[Sequence[float]]) -> float:
    """max over `refs` of iou(pred, ref); 0 if `refs` is empty."""
    return max((iou(pred, r) for r in refs), default=0.0)


def box_precision_recall(
    preds: Sequence[Sequence[float]], refs: Sequence[Sequence[float]]
) -> tuple[float, float]:
    """(precision, recall) of soft box matching: precision = mean over predicted boxes of the best IoU
    with any reference, recall = mean over reference boxes of the best IoU with any prediction; each is
    0 when its mean is over nothing or the other side is empty. Not a one-to-one (Hungarian) matching:
    a repeated prediction of the same box is not penalised (our design, simple and smooth)."""
    if not preds or not refs:
        return 0.0, 0.0
    precision = sum(best_iou(p, refs) for p in preds) / len(preds)
    recall = sum(best_iou(r, preds) for r in refs) / len(refs)
    return precision, recall


def box_f1(preds: Sequence[Sequence[float]], refs: Sequence[Sequence[float]]) -> float:
    """F1 = 2 P R / (P + R) of `box_precision_recall`; 0 when P + R == 0 or there are no predictions."""
    p, r = box_precision_recall(preds, refs)
    return 0.0 if p + r == 0 else 2 * p * r / (p + r)


def iou_sweep_accuracy(iou_value: float, thresholds: Sequence[float] = IOU_SWEEP_THRESHOLDS) -> float:
    """Share of `thresholds` t with iou_value >= t (default 0.50, 0.55, ..., 0.95: 10 thresholds, so an
    IoU of 0.7 meets 5 of them -> 0.5)."""
    if not thresholds:
        raise ValueError("iou_sweep_accuracy: thresholds is empty")
    return sum(iou_value >= t for t in thresholds) / len(thresholds)


# ================================================================================ rewards
def batch_column(reward: Reward, batch: RewardBatch, column: str, what: str) -> list[Any]:
    """The dataset `column` of `batch` (`what` it holds, for the KeyError naming the reward and the columns)."""
    if column not in batch.columns:
        raise KeyError(
            f"reward {reward.name!r}: {what} column {column!r} is not in the dataset; "
            f"available columns: {sorted(batch.columns) or 'none'}"
        )
    return batch.columns[column]


def _check_str(reward: str, option: str, value: Any, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or not value:
        raise ValueError(f"reward {reward!r}: option {option} must be a non-empty string, got {value!r}")


def _check_bool(reward: str, option: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"reward {reward!r}: option {option} must be true or false, got {value!r}")


def _check_unit(reward: str, option: str, value: Any) -> float:
    t = None if isinstance(value, bool) else parse_number(value)
    if t is None or not 0.0 <= t <= 1.0:
        raise ValueError(f"reward {reward!r}: option {option} must be a number in [0, 1], got {value!r}")
    return t


def _box_options(cls: type[_R]) -> type[_R]:
    """Make the box reward `cls` a keyword-only dataclass: its annotated class attributes are its options, after
    the ones it inherits, and the generated ``__init__`` takes them all (the signature `rewards.base.load_reward`
    checks a config's options against). Instances keep identity equality and `Reward`'s repr."""
    return dataclass(eq=False, repr=False, kw_only=True)(cls)


class _UnitOption:
    """A box reward option that is a number in [0, 1] whenever it is set, at construction and after it (a
    curriculum changes ``iou_at``'s ``threshold`` between calls); the default of a dataclass field."""

    def __init__(self, default: float) -> None:
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.option, self.attr = name, f"_{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> float:
        return self.default if obj is None else getattr(obj, self.attr)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj, self.attr, _check_unit(obj.name, self.option, value))


@_box_options
class _BoxReward(Reward):
    """Shared machinery of the box rewards (options, reference and prediction reading, unparsed log).

    The options every box reward takes are this dataclass's fields, declared once; a box reward adds its own
    as fields of its subclass (decorated with `_box_options`) and checks them in ``__post_init__`` after
    this one's checks.

    Options: ``box_column`` ("boxes"; when that column is absent, "box" is used): one reference box or a
    list of them, [x1, y1, x2, y2] in absolute pixels of the ORIGINAL image (strings are parsed too;
    None or [] -> NaN); ``coords`` (a convention of `CONVENTIONS` or a model family of
    `FAMILY_CONVENTIONS`, default "absolute"): how the completion writes its box; ``width_column`` /
    ``height_column`` ("image_width" / "image_height": original size, needed unless coords is
    "absolute"); ``resized_width_column`` / ``resized_height_column`` ("resized_width" /
    "resized_height", needed for "resized"); ``tag`` ("answer"); ``box_key`` (None: parse the text;
    a key: read the predicted box from ``outputs["env_state"][i][box_key]``, already in original
    pixels, e.g. GeoViS's "answer_box"; a sample whose env_state is empty -- no environment ran, as in a
    single-turn rollout -- is parsed from its text in ``coords``).
    """

    needs = {"texts"}
    multi_box = False  # True: score every parsed box (box_f1); False: the last one
    needs_original_size = False  # True: the score needs (W, H) even for coords="absolute"
    unparsed_score = 0.0  # the score of a completion without a box (the worst value of the reward)
    _warned_unparsed = False  # set by `_warn` on this instance's first completions without a box

    box_column: str = "boxes"
    coords: str = "absolute"
    width_column: str = "image_width"
    height_column: str = "image_height"
    resized_width_column: str = "resized_width"
    resized_height_column: str = "resized_height"
    tag: str = "answer"
    box_key: str | None = None

    def __post_init__(self) -> None:
        """Check the shared options (a ValueError naming the reward and the option); ``coords`` is resolved
        to its convention (a family alias becomes e.g. "norm1000")."""
        n = self.name
        for opt in (
            "box_column",
            "width_column",
            "height_column",
            "resized_width_column",
            "resized_height_column",
            "tag",
        ):
            _check_str(n, opt, getattr(self, opt))
        _check_str(n, "box_key", self.box_key, optional=True)
        try:
            self.coords = resolve_convention(self.coords)
        except ValueError as e:
            raise ValueError(f"reward {n!r}: option coords: {e}") from None
        self.last_metrics: dict[str, float] = {}
        self.last_unparsed = 0

    # ------------------------------------------------------------------ inputs
    def _reference_column(self, batch: RewardBatch) -> list[Any]:
        if self.box_column not in batch.columns and self.box_column == "boxes" and "box" in batch.columns:
            return batch.columns["box"]
        what = "reference box" + (" (nor 'box')" if self.box_column == "boxes" else "")
        return batch_column(self, batch, self.box_column, what)

    def _reference(self, ref: Any) -> list[Box]:
        """The reference boxes of one row ([] for None / an empty list); ValueError for a malformed one."""
        if ref is None:
            return []
        if hasattr(ref, "tolist"):  # a tensor / numpy array
            ref = ref.tolist()
        boxes: list[Box | None]
        if isinstance(ref, str):
            boxes = list(parse_boxes(ref, self.tag)) or [None]
        elif isinstance(ref, Mapping):  # {"bbox_2d": [...]}
            found: list[Box] = []
            _json_boxes(dict(ref), found)
            boxes = list(found) or [None]
        elif isinstance(ref, Sequence):
            if len(ref) == 0:
                return []
            if all(isinstance(v, Sequence) and not isinstance(v, str) for v in ref):
                boxes = [order_box(v) for v in ref]
            else:
                boxes = [order_box(ref)]
        else:
            boxes = [None]
        if any(b is None for b in boxes):
            raise ValueError(
                f"reward {self.name!r}: reference box {ref!r} is not [x1, y1, x2, y2] "
                f"(or a list of them) in column {self.box_column!r}"
            )
        return boxes  # type: ignore[return-value]

    @staticmethod
    def _size(name: str, w: Any, h: Any, row: int) -> Size:
        pw, ph = parse_number(w), parse_number(h)
        if pw is None or ph is None or pw <= 0 or ph <= 0:
            raise ValueError(f"row {row}: {name} size ({w!r}, {h!r}) is not two positive numbers")
        return pw, ph

    def to_absolute(self, box: Box, original: Size | None, resized: Size | None) -> Box:
        """The completion's box in absolute pixels of the original image (convention ``self.coords``)."""
        return to_absolute(box, self.coords, original, resized)

    def _parse_text(self, text: str) -> list[Box]:
        if self.multi_box:
            return parse_boxes(text, self.tag)
        return [b] if (b := parse_box(text, self.tag)) is not None else []

    def _predictions(self, batch: RewardBatch, n: int) -> tuple[list[list[Box]], list[bool]]:
        """Per sample the predicted boxes ([] = unparsed) and whether they were parsed from the text (so
        written in ``coords``) rather than read from ``env_state[box_key]`` (original pixels). With
        ``box_key``, a sample whose env_state is empty (no environment ran: a single-turn rollout) is
        parsed from its text."""
        if self.box_key is None:
            return [self._parse_text(t) for t in batch.texts], [True] * n
        states = batch.outputs.get("env_state")
        if not isinstance(states, list) or len(states) != n:
            raise KeyError(
                f"reward {self.name!r}: option box_key={self.box_key!r} reads outputs['env_state'] (one dict "
                f"per sample, written by a multi_turn environment), which this batch "
                f"{'does not have' if states is None else 'has with the wrong length'}; "
                f"outputs: {sorted(batch.outputs) or 'none'}"
            )
        out, from_text = [], []
        for state, text in zip(states, batch.texts, strict=True):
            if not state:
                out.append(self._parse_text(text))
                from_text.append(True)
                continue
            value = state.get(self.box_key) if isinstance(state, Mapping) else None
            if hasattr(value, "tolist"):
                value = value.tolist()
            boxes: list[Box] = []
            if isinstance(value, Sequence) and not isinstance(value, str) and value:
                if all(isinstance(v, Sequence) and not isinstance(v, str) for v in value):
                    boxes = [b for v in value if (b := order_box(v)) is not None]
                elif (b := order_box(value)) is not None:
                    boxes = [b]
            out.append(boxes if self.multi_box else boxes[-1:])
            from_text.append(False)
        return out, from_text

    # ------------------------------------------------------------------ scoring
    def score(self, preds: list[Box], refs: list[Box], original: Size | None) -> float:
        """The reward of one sample: `preds` (>= 1 box) and `refs` (>= 1 box) in original pixels."""
        raise NotImplementedError

    def __call__(self, batch: RewardBatch) -> Tensor:
        texts = batch.texts
        n = len(texts)
        refs = self._reference_column(batch)
        preds, from_text = self._predictions(batch, n)
        converts = [t and self.coords != "absolute" for t in from_text]
        convert = any(converts)
        widths = heights = rws = rhs = [None] * n
        if convert or self.needs_original_size:
            why = f"coords={self.coords!r}" if convert else "the image diagonal"
            widths = batch_column(self, batch, self.width_column, f"image width ({why})")
            heights = batch_column(self, batch, self.height_column, f"image height ({why})")
        if convert and self.coords == "resized":
            rws = batch_column(self, batch, self.resized_width_column, "resized width (coords='resized')")
            rhs = batch_column(self, batch, self.resized_height_column, "resized height (coords='resized')")
        out: list[float] = []
        unparsed: list[int] = []
        scored = 0
        for i in range(n):
            ref_boxes = self._reference(refs[i])
            if not ref_boxes:
                out.append(math.nan)
                continue
            scored += 1
            if not preds[i]:
                out.append(self.unparsed_score)
                unparsed.append(i)
                continue
            original = (
                self._size("original image", widths[i], heights[i], i)
                if converts[i] or self.needs_original_size
                else None
            )
            pred_boxes = preds[i]
            if converts[i]:
                resized = self._size("resized image", rws[i], rhs[i], i) if self.coords == "resized" else None
                pred_boxes = [to_absolute(b, self.coords, original, resized) for b in pred_boxes]
            out.append(float(self.score(pred_boxes, ref_boxes, original)))
        self.last_unparsed = len(unparsed)
        self.last_metrics = {"unparsed_frac": len(unparsed) / scored if scored else 0.0}
        if unparsed:
            self._warn(batch, texts, unparsed, scored)
        return torch.tensor(out, dtype=torch.float32)

    def _warn(self, batch: RewardBatch, texts: list[str], unparsed: list[int], scored: int) -> None:
        """Log completions without a box, once per reward instance (a run builds its rewards once): later calls
        only count them in ``last_metrics["unparsed_frac"]``, which the trainer logs every step. A second box
        reward that finds the same failure in the same batch (``iou_at`` and ``box_iou`` on one rollout) logs
        nothing either: the first one's line stands for both."""
        if self._warned_unparsed:
            return
        self._warned_unparsed = True
        what = (
            "no box could be parsed from"
            if self.box_key is None
            else f"env_state has no box {self.box_key!r} for"
        )
        last = _LAST_WARNED.get(what)
        if last is not None and last() is batch:
            return
        _LAST_WARNED[what] = weakref.ref(batch)
        i = unparsed[0]
        source = batch.get("_source")
        where = f" ({source[i]})" if isinstance(source, list) and source[i] else ""
        log.warning(
            "reward %r: %s %d of %d completions (scored 0), e.g. sample %d%s: %r. Shown once per run (other box "
            "rewards on the same completions included); each step's share is logged as "
            "reward/<column>/unparsed_frac",
            self.name,
            what,
            len(unparsed),
            scored,
            i,
            where,
            texts[i][:120],
        )


_COMMON_DOC = """
    Shared options (see `rewards.boxes`): ``box_column`` ("boxes", falls back to "box"), ``coords``
    ("absolute"; a convention or a model family alias), ``width_column`` / ``height_column``,
    ``resized_width_column`` / ``resized_height_column``, ``tag`` ("answer"), ``box_key`` (None; e.g.
    "answer_box" reads ``outputs["env_state"][i]["answer_box"]``). No parsable box -> 0 (counted in
    ``last_metrics["unparsed_frac"]``, logged once per reward per run); no reference (None) -> NaN.
"""


@register_reward("box_iou")
@_box_options
class BoxIoU(_BoxReward):
    """IoU of the completion's bounding box with the best-matching reference box.

    The box is parsed with `parse_box` (last box wins, <answer> content first); a completion without
    a box scores 0, reversed corners are swapped, a zero-area box scores 0. The reference column
    (``box_column``, "boxes", else "box") holds [x1, y1, x2, y2] or a list of them (or a string) in
    absolute pixels of the ORIGINAL image; ``None`` gives NaN. ``coords`` says how the completion's
    box is written, with (W, H) the original size (columns ``width_column``/``height_column``,
    "image_width"/"image_height") and (W_r, H_r) the model's resized input
    (``resized_width_column``/``resized_height_column``, "resized_width"/"resized_height", filled in
    by the VLM policy):

    - "absolute": original pixels, used as is;
    - "norm1000": Qwen2-VL's 0..1000 grid, x_abs = x / 1000 * W, y_abs = y / 1000 * H;
    - "norm1": fractions, x_abs = x * W, y_abs = y * H;
    - "resized": pixels of the resized input, x_abs = x * W / W_r, y_abs = y * H / H_r;
    - a model family: "qwen2_vl" / "qwen3_vl" (norm1000), "qwen2_5_vl" (resized).

    Boxes are not clipped to the image. Score: with ``threshold`` None and ``dense`` True (default)
    the IoU; ``dense=False`` gives 1 if IoU >= ``threshold`` else 0 (a threshold is then required);
    ``threshold`` with ``dense=True`` gives the IoU where IoU >= threshold, else 0.
    """

    __doc__ = (__doc__ or "") + _COMMON_DOC

    threshold: float | None = None
    dense: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.threshold is not None:
            self.threshold = _check_unit(self.name, "threshold", self.threshold)
        _check_bool(self.name, "dense", self.dense)
        if not self.dense and self.threshold is None:
            raise ValueError(f"reward {self.name!r}: dense=False (a 1/0 reward) needs a threshold")

    def score_iou(self, value: float) -> float:
        if self.threshold is None:
            return value
        hit = value >= self.threshold
        return (value if hit else 0.0) if self.dense else float(hit)

    def score(self, preds: list[Box], refs: list[Box], original: Size | None) -> float:
        return self.score_iou(best_iou(preds[-1], refs))


@register_reward("box_giou")
@_box_options
class BoxGIoU(_BoxReward):
    """Generalised IoU of the completion's box with the best-matching reference, mapped to [0, 1].

    GIoU = IoU - (C - U) / C in [-1, 1] (C: smallest box enclosing both, U: union), so unlike IoU it
    still rewards moving a non-overlapping box towards the target. The reward is (GIoU + 1) / 2 in
    [0, 1] (our design: same range as the other box rewards; 0.5 is GIoU 0, e.g. two boxes sharing a full edge);
    ``raw=True`` returns GIoU itself. An unparsable completion gets the worst value: 0 (mapped) or -1
    with ``raw=True`` (our design: in raw units 0 would beat every far-off box). With several
    references the highest GIoU counts.
    """

    __doc__ = (__doc__ or "") + _COMMON_DOC

    raw: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_bool(self.name, "raw", self.raw)
        self.unparsed_score = -1.0 if self.raw else 0.0

    def score(self, preds: list[Box], refs: list[Box], original: Size | None) -> float:
        g = max(giou(preds[-1], r) for r in refs)
        return g if self.raw else (g + 1.0) / 2.0


CENTER_FORMS = ("exp", "linear")


@register_reward("box_center")
@_box_options
class BoxCenter(_BoxReward):
    """Centre-distance reward: exp(-d / D) (or max(0, 1 - d / D)), d = distance of the box centres.

    d is the Euclidean distance between the centre of the completion's box and the centre of the
    nearest reference box, in original pixels; D = sqrt(W^2 + H^2) is the diagonal of the ORIGINAL
    image (columns ``width_column`` / ``height_column`` are always needed). ``form``: "exp" (default,
    GeoViS's geospatial term: 1 at the centre, e^-1 ~ 0.37 a full diagonal away) or "linear"
    (max(0, 1 - d / D)). In [0, 1].
    """

    __doc__ = (__doc__ or "") + _COMMON_DOC
    needs_original_size = True

    form: str = "exp"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.form not in CENTER_FORMS:
            raise ValueError(f"reward {self.name!r}: option form={self.form!r}; choose one of {CENTER_FORMS}")

    def score(self, preds: list[Box], refs: list[Box], original: Size | None) -> float:
        assert original is not None
        diagonal = math.hypot(*original)
        d = min(center_distance(preds[-1], r) for r in refs) / diagonal
        return math.exp(-d) if self.form == "exp" else max(0.0, 1.0 - d)


@register_reward("iou_at")
@_box_options
class IoUAt(_BoxReward):
    """1.0 if the IoU of the completion's box with the best-matching reference is >= threshold, else 0.0.

    ``threshold`` (option, default 0.5) is also a public attribute a curriculum may change between calls
    (``reward.threshold = 0.7``; validated: a number in [0, 1]).
    """

    __doc__ = (__doc__ or "") + _COMMON_DOC

    threshold: float = _UnitOption(0.5)  # type: ignore[assignment]  # the IoU a box needs for reward 1

    def score(self, preds: list[Box], refs: list[Box], original: Size | None) -> float:
        return float(best_iou(preds[-1], refs) >= self._threshold)


@register_reward("box_f1")
class BoxF1(_BoxReward):
    """Multi-box F1 of every box in the completion against every reference box (soft IoU matching).

    All boxes of `parse_boxes` (or every box under ``box_key``) count: precision = mean over predicted
    boxes of the best IoU with any reference, recall = mean over references of the best IoU with any
    prediction, F1 = 2PR / (P + R) (see `box_f1`; 0 when P + R == 0).
    """

    __doc__ = (__doc__ or "") + _COMMON_DOC
    multi_box = True

    def score(self, preds: list[Box], refs: list[Box], original: Size | None) -> float:
        return box_f1(preds, refs)


@register_reward("iou_sweep")
class IoUSweep(_BoxReward):
    """Mean accuracy over the IoU thresholds 0.50, 0.55, ..., 0.95 (COCO-style; for evaluation).

    Per sample: the share of the 10 thresholds t with IoU >= t, IoU with the best-matching reference
    (see `iou_sweep_accuracy`); averaging it over a data set gives the mean of Acc@0.5 ... Acc@0.95.
    """

    __doc__ = (__doc__ or "") + _COMMON_DOC

    def score(self, preds: list[Box], refs: list[Box], original: Size | None) -> float:
        return iou_sweep_accuracy(best_iou(preds[-1], refs))
