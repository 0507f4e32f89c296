"""`geneval`: GenEval's compositional checks (objects, counts, colours, relative positions) as rewards.

GenEval (Ghosh et al. 2023) scores an image against its prompt's metadata from an object detector's boxes and
a CLIP colour classifier. The rules follow its ``evaluation/evaluate_images.py``: `select_detections`,
`geneval_iou`, `relative_position` and `evaluate_correct` (the binary verdict); `evaluate_score` is
Flow-GRPO's partial-credit training reward. `GenEvalLocal` (``geneval_local``) runs them in-process with a
pluggable detector; ``python -m rewards.geneval_server`` serves it over HTTP and `GenEval` (``geneval``) is the
client. Rules, thresholds and formulas: docs/reward_plugins.md, "Judges and scoring servers", and
docs/algorithms.md, "Preference and judge rewards".
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from .base import Reward, RewardBatch, register_reward
from .image import to_pil
from .remote import RemoteReward

__all__ = [
    "COLORS",
    "DETECTORS",
    "COLOUR_CLASSIFIERS",
    "GENEVAL_MODES",
    "BlobDetector",
    "ClipColourClassifier",
    "Detection",
    "GenEval",
    "GenEvalLocal",
    "MMDetDetector",
    "MeanColourClassifier",
    "evaluate_correct",
    "evaluate_score",
    "geneval_iou",
    "parse_metadata",
    "relative_position",
    "select_detections",
]

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
"""GenEval's colour names, in its order (``COLORS`` of evaluate_images.py)."""

GENEVAL_MODES = ("score", "strict", "correct")
"""What a GenEval reward returns: Flow-GRPO's partial score, its strict 1/0, or GenEval's own 1/0."""


@dataclass(frozen=True)
class Detection:
    """One detected object: class name, confidence, box ``(x0, y0, x1, y1)`` in pixels, optional Bool[H, W] mask."""

    cls: str
    score: float
    box: tuple[float, float, float, float]
    mask: np.ndarray | None = field(default=None, compare=False)


Detector = Callable[[list[Image.Image]], list[list[Detection]]]
"""Images -> the detections of each image (any order, any confidence)."""
ColourClassifier = Callable[[Image.Image, list[Detection], str], list[str]]
"""(image, detections of one class, the class name) -> one of `COLORS` per detection."""


# ----------------------------------------------------------------------------- the rules
def geneval_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU of two boxes read as inclusive pixel ranges (a side is ``x1 - x0 + 1``), as GenEval's ``compute_iou``."""

    def area(x0: float, y0: float, x1: float, y1: float) -> float:
        return max(x1 - x0 + 1, 0) * max(y1 - y0 + 1, 0)

    inter = area(max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3]))
    union = area(*a[:4]) + area(*b[:4]) - inter
    return inter / union if union else 0.0


def relative_position(
    box_a: Sequence[float], box_b: Sequence[float], position_threshold: float = 0.1
) -> set[str]:
    """Where box A lies relative to box B: a subset of {"left of", "right of", "above", "below"} (y grows
    downwards); see the module docstring for the rule."""
    a, b = np.asarray(box_a[:4], dtype=np.float64), np.asarray(box_b[:4], dtype=np.float64)
    offset = (a[:2] + a[2:]) / 2 - (b[:2] + b[2:]) / 2
    extent = np.abs(a[2:] - a[:2]) + np.abs(b[2:] - b[:2])
    shrunk = np.maximum(np.abs(offset) - position_threshold * extent, 0) * np.sign(offset)
    if np.all(np.abs(shrunk) < 1e-3):
        return set()
    dx, dy = shrunk / np.linalg.norm(offset)
    out = set()
    if dx < -0.5:
        out.add("left of")
    if dx > 0.5:
        out.add("right of")
    if dy < -0.5:
        out.add("above")
    if dy > 0.5:
        out.add("below")
    return out


def select_detections(
    detections: Sequence[Detection],
    tag: str,
    *,
    threshold: float = 0.3,
    counting_threshold: float = 0.9,
    max_objects: int = 16,
    max_overlap: float = 1.0,
) -> dict[str, list[Detection]]:
    """The kept detections per class name, most confident first (GenEval's ``evaluate_image``)."""
    cut = counting_threshold if tag == "counting" else threshold
    by_class: dict[str, list[Detection]] = {}
    for d in detections:
        by_class.setdefault(d.cls, []).append(d)
    out: dict[str, list[Detection]] = {}
    for cls, dets in by_class.items():
        order = sorted((d for d in dets if d.score > cut), key=lambda d: -d.score)[:max_objects]
        kept: list[Detection] = []
        while order:
            best = order.pop(0)
            kept.append(best)
            if max_overlap != 1:
                order = [d for d in order if geneval_iou(best.box, d.box) < max_overlap]
        if kept:
            out[cls] = kept
    return out


def _position_holds(
    found: list[Detection], targets: list[Detection], relation: str, position_threshold: float
) -> bool:
    return all(
        relation in relative_position(o.box, t.box, position_threshold) for o in found for t in targets
    )


def evaluate_correct(
    image: Image.Image,
    detected: Mapping[str, list[Detection]],
    metadata: Mapping[str, Any],
    classify: ColourClassifier,
    position_threshold: float = 0.1,
) -> tuple[bool, str]:
    """GenEval's verdict (``evaluate``): (all clauses hold, the reasons of those that do not)."""
    correct, reasons = True, []
    matched: list[list[Detection] | None] = []
    for req in metadata.get("include", []):
        cls, count = req["class"], req["count"]
        ok = True
        found = list(detected.get(cls, []))[:count]
        if len(found) < count:
            ok = False
            reasons.append(f"expected {cls}>={count}, found {len(found)}")
        else:
            if "color" in req:
                colours = classify(image, found, cls)
                if colours.count(req["color"]) < count:
                    ok = False
                    reasons.append(f"expected {req['color']} {cls}>={count}, found colours {colours}")
            if "position" in req and ok:
                relation, target = req["position"]
                if matched[target] is None:
                    ok = False
                    reasons.append(f"no target for {cls} to be {relation}")
                elif not _position_holds(found, matched[target], relation, position_threshold):  # type: ignore[arg-type]
                    ok = False
                    reasons.append(f"expected {cls} {relation} target")
        correct = correct and ok
        matched.append(found if ok else None)
    for req in metadata.get("exclude", []):
        n = len(detected.get(req["class"], []))
        if n >= req["count"]:
            correct = False
            reasons.append(f"expected {req['class']}<{req['count']}, found {n}")
    return correct, "\n".join(reasons)


def evaluate_score(
    image: Image.Image,
    detected: Mapping[str, list[Detection]],
    metadata: Mapping[str, Any],
    classify: ColourClassifier,
    position_threshold: float = 0.1,
) -> tuple[bool, float, str]:
    """Flow-GRPO's GenEval reward (``evaluate_reward``): (strict verdict, partial score, reasons).

    Per include clause with N = ``count`` and F = all boxes found of its class: a count term 1 - |N - F| / N
    (negative when F > 2N); strict needs F == N. When F != N, a clause with a colour or a position adds a 0
    term. Else a colour adds 1 - |N - n_colour| / N (strict needs n_colour == N, n_colour counting the boxes
    classified as that colour), and a position whose target clause failed adds 0; a position checked against
    the target's boxes adds 0 when some pair does not hold, and then, as in Flow-GRPO's code, 1 in every
    case. The score is the mean of the terms (0 without terms); exclude clauses are not read."""
    correct, reasons, terms = True, [], []
    matched: list[list[Detection] | None] = []
    for req in metadata.get("include", []):
        cls, count = req["class"], req["count"]
        ok = True
        found = list(detected.get(cls, []))
        terms.append(1 - abs(count - len(found)) / count)
        if len(found) != count:
            ok = False
            reasons.append(f"expected {cls}=={count}, found {len(found)}")
            if "color" in req or "position" in req:
                terms.append(0.0)
        else:
            if "color" in req:
                n_colour = classify(image, found, cls).count(req["color"])
                terms.append(1 - abs(count - n_colour) / count)
                if n_colour != count:
                    ok = False
                    reasons.append(f"expected {count} {req['color']} {cls}, found {n_colour}")
            if "position" in req and ok:
                relation, target = req["position"]
                if matched[target] is None:
                    ok = False
                    reasons.append(f"no target for {cls} to be {relation}")
                    terms.append(0.0)
                else:
                    if not _position_holds(found, matched[target], relation, position_threshold):  # type: ignore[arg-type]
                        ok = False
                        reasons.append(f"expected {cls} {relation} target")
                        terms.append(0.0)
                    terms.append(1.0)
        correct = correct and ok
        matched.append(found if ok else None)
    score = sum(terms) / len(terms) if terms else 0.0
    return correct, score, "\n".join(reasons)


def parse_metadata(value: Any, where: str) -> dict[str, Any]:
    """A row's GenEval metadata: a dict or its JSON text with ``include`` clauses (``class``, ``count``, and
    optional ``color`` / ``position``); ValueError naming `where` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{where}: GenEval metadata is not JSON: {e}") from None
    if not isinstance(value, Mapping) or not isinstance(value.get("include", []), list):
        raise ValueError(f"{where}: GenEval metadata must be an object with an 'include' list, got {value!r}")
    for req in [*value.get("include", []), *value.get("exclude", [])]:
        count = req.get("count") if isinstance(req, Mapping) else None
        if (
            not isinstance(req, Mapping)
            or not isinstance(req.get("class"), str)
            or not isinstance(count, int)
            or count < 1
        ):
            raise ValueError(f"{where}: a clause needs a 'class' name and a 'count' >= 1, got {req!r}")
        if "color" in req and req["color"] not in COLORS:
            raise ValueError(f"{where}: colour {req['color']!r} is not one of GenEval's {COLORS}")
        if "position" in req:
            pos = req["position"]
            if not (isinstance(pos, list | tuple) and len(pos) == 2 and isinstance(pos[1], int)):
                raise ValueError(f"{where}: 'position' must be [relation, clause index], got {pos!r}")
    return dict(value)


# ----------------------------------------------------------------------------- detectors
_REFERENCE_RGB = {
    "red": (255, 0, 0),
    "orange": (255, 165, 0),
    "yellow": (255, 255, 0),
    "green": (0, 128, 0),
    "blue": (0, 0, 255),
    "purple": (128, 0, 128),
    "pink": (255, 192, 203),
    "brown": (139, 69, 19),
    "black": (0, 0, 0),
    "white": (255, 255, 255),
}


class BlobDetector:
    """A stand-in detector for tests and the tiny shapes world: each class is one or more RGB colours; every
    4-connected blob of at least `min_pixels` pixels within `tolerance` (max channel difference) of one is
    a detection of that class with confidence `score`, its box ``(x0, y0, x1 + 1, y1 + 1)`` and its mask,
    listed top to bottom, then left to right."""

    def __init__(
        self,
        classes: Mapping[str, Sequence[Sequence[int]]],
        tolerance: int = 40,
        min_pixels: int = 16,
        score: float = 1.0,
    ) -> None:
        if not classes:
            raise ValueError("BlobDetector: classes must map class names to lists of RGB colours")
        self.classes = {k: [tuple(int(c) for c in rgb) for rgb in v] for k, v in classes.items()}
        self.tolerance, self.min_pixels, self.score = int(tolerance), int(min_pixels), float(score)

    def __call__(self, images: list[Image.Image]) -> list[list[Detection]]:
        from scipy import ndimage

        out = []
        for image in images:
            arr = np.asarray(image.convert("RGB"), dtype=np.int32)
            dets = []
            for cls, colours in self.classes.items():
                for rgb in colours:
                    near = np.abs(arr - np.asarray(rgb)).max(axis=-1) <= self.tolerance
                    labels, n = ndimage.label(near)
                    for k in range(1, n + 1):
                        mask = labels == k
                        if mask.sum() < self.min_pixels:
                            continue
                        ys, xs = np.nonzero(mask)
                        box = (float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1))
                        dets.append(Detection(cls, self.score, box, mask))
            out.append(sorted(dets, key=lambda d: (d.box[1], d.box[0])))
        return out


class MMDetDetector:
    """GenEval's detector: an mmdet (2.x) model, by default Mask2Former
    ``mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco`` (`config` its mmdet config file, `checkpoint` its
    ``.pth``; GenEval's ``evaluation/download_models.sh`` fetches it). Class names are the model's
    ``CLASSES`` unless `class_names` (a list, or a text file with one per line: GenEval's
    ``object_names.txt``) is given. Images go to mmdet as BGR arrays, as mmdet reads GenEval's PNG files.
    Not run by the tests here (mmdet, mmcv and the weights are not installed)."""

    def __init__(
        self,
        config: str,
        checkpoint: str,
        device: str = "cuda",
        class_names: str | Sequence[str] | None = None,
    ) -> None:
        try:
            from mmdet.apis import inference_detector, init_detector
        except ImportError as e:
            raise ImportError(
                f"the mmdet detector needs mmdet 2.x and mmcv-full as GenEval installs them ({e}); see GenEval's "
                f"README, or use another detector (--detector module:factory)"
            ) from e
        self._infer = inference_detector
        self.model = init_detector(config, checkpoint, device=device)
        if isinstance(class_names, str):
            with open(class_names, encoding="utf-8") as f:
                class_names = [line.strip() for line in f if line.strip()]
        self.class_names = list(class_names) if class_names is not None else list(self.model.CLASSES)

    def __call__(self, images: list[Image.Image]) -> list[list[Detection]]:
        arrays = [np.ascontiguousarray(np.asarray(im.convert("RGB"))[..., ::-1]) for im in images]
        out = []
        for result in self._infer(self.model, arrays):
            bbox = result[0] if isinstance(result, tuple) else result
            segm = result[1] if isinstance(result, tuple) and len(result) > 1 else None
            dets = []
            for index, cls in enumerate(self.class_names):
                for j, row in enumerate(bbox[index]):
                    mask = None if segm is None else np.asarray(segm[index][j], dtype=bool)
                    dets.append(Detection(cls, float(row[4]), tuple(float(v) for v in row[:4]), mask))  # type: ignore[arg-type]
            out.append(dets)
        return out


class MeanColourClassifier:
    """A stand-in colour classifier: the mean RGB of each detection's mask (its box without one), named by
    the nearest (Euclidean) reference colour of `palette` (default: one RGB per GenEval colour)."""

    def __init__(self, palette: Mapping[str, Sequence[int]] | None = None) -> None:
        self.palette = {k: np.asarray(v, dtype=np.float64) for k, v in (palette or _REFERENCE_RGB).items()}

    def __call__(self, image: Image.Image, detections: list[Detection], classname: str) -> list[str]:
        arr = np.asarray(image.convert("RGB"), dtype=np.float64)
        out = []
        for d in detections:
            if d.mask is not None:
                pixels = arr[d.mask]
            else:
                x0, y0, x1, y1 = (int(round(v)) for v in d.box)
                pixels = arr[y0:y1, x0:x1].reshape(-1, 3)
            mean = pixels.mean(axis=0)
            out.append(min(self.palette, key=lambda c: float(((self.palette[c] - mean) ** 2).sum())))
        return out


class ClipColourClassifier:
    """GenEval's colour classifier: CLIP zero-shot over `COLORS`. For class ``X`` the weight of colour ``c``
    is the mean of the L2-normalised text embeddings of "a photo of a {c} X", "a photo of a {c}-colored
    X", "a photo of a {c} object", normalised again; each detection's crop (the image inside its mask
    pasted on a ``background`` grey, then cropped to its box) is embedded and gets the colour of highest
    cosine. GenEval uses open_clip ViT-L-14 with OpenAI weights: ``backend: open_clip, arch: ViT-L-14,
    path: <checkpoint>``, or ``path: openai/clip-vit-large-patch14`` (a local folder) with the "hf" backend
    (`rewards.image.CLIPEmbedder`; its preprocessing is done in torch)."""

    TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")

    def __init__(
        self,
        path: str,
        *,
        backend: str = "hf",
        arch: str | None = None,
        processor: str | None = None,
        device: str | None = None,
        background: str = "#999",
    ) -> None:
        from .image import CLIPEmbedder

        self.embedder = CLIPEmbedder(path, processor=processor, backend=backend, arch=arch, device=device)
        self.background = background
        self._weights: dict[str, Tensor] = {}

    def weights(self, classname: str) -> Tensor:
        """Float[len(COLORS), D]: the zero-shot weight of each colour for `classname`."""
        if classname not in self._weights:
            rows = []
            for c in COLORS:
                emb = self.embedder.encode_texts([t.format(c=c, cls=classname) for t in self.TEMPLATES])
                rows.append(torch.nn.functional.normalize(emb.mean(0), dim=-1))
            self._weights[classname] = torch.stack(rows)
        return self._weights[classname]

    def crops(self, image: Image.Image, detections: list[Detection]) -> list[Image.Image]:
        """The image each detection is classified from (masked onto the background, cropped to its box)."""
        image = image.convert("RGB")
        blank = Image.new("RGB", image.size, color=self.background)
        out = []
        for d in detections:
            shown = (
                image
                if d.mask is None
                else Image.composite(image, blank, Image.fromarray(d.mask.astype(np.uint8) * 255))
            )
            out.append(shown.crop(tuple(int(v) for v in d.box)))
        return out

    def __call__(self, image: Image.Image, detections: list[Detection], classname: str) -> list[str]:
        if not detections:
            return []
        w = self.weights(classname)
        names = []
        for crop in self.crops(image, detections):  # crops differ in size: one at a time
            x = torch.from_numpy(np.asarray(crop, dtype=np.float32).copy()).permute(2, 0, 1)[None] / 255.0
            names.append(
                COLORS[int((self.embedder.encode_images(x) @ w.T.to(self.embedder.device)).argmax())]
            )
        return names


DETECTORS: dict[str, Callable[..., Detector]] = {"blobs": BlobDetector, "mmdet": MMDetDetector}
"""Built-in detectors by name (``detector:`` option); anything else is a ``package.module:factory`` path."""
COLOUR_CLASSIFIERS: dict[str, Callable[..., ColourClassifier]] = {
    "mean_rgb": MeanColourClassifier,
    "clip": ClipColourClassifier,
}
"""Built-in colour classifiers by name (``colour_classifier:``); or a ``package.module:factory`` path."""


def _build(
    kind: str, table: Mapping[str, Callable[..., Any]], spec: Any, kwargs: Mapping[str, Any] | None
) -> Any:
    if callable(spec):
        return spec(**(kwargs or {})) if kwargs else spec
    if not isinstance(spec, str):
        raise ValueError(f"{kind} must be one of {sorted(table)} or 'package.module:factory', got {spec!r}")
    if spec in table:
        factory = table[spec]
    elif ":" in spec:
        module, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{kind} {spec!r} cannot be imported: {e}") from e
    else:
        raise ValueError(f"{kind} must be one of {sorted(table)} or 'package.module:factory', got {spec!r}")
    return factory(**(kwargs or {}))


def _images(who: str, batch: RewardBatch) -> Tensor:
    images = batch.outputs.get("images")
    if not isinstance(images, Tensor) or images.dim() != 4 or images.shape[1] != 3:
        got = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise ValueError(f"{who} needs outputs['images'] as Float[B,3,H,W] in [0, 1] (or uint8), got {got}")
    return images.float() / 255.0 if images.dtype == torch.uint8 else images


# ----------------------------------------------------------------------------- rewards
@register_reward("geneval_local")
@dataclass(kw_only=True, eq=False, repr=False)
class GenEvalLocal(Reward):
    """GenEval in this process: detector boxes + GenEval's rules against each row's metadata (the server side
    of ``geneval``; see `rewards.geneval`).

    ``detector``: "mmdet" (GenEval's Mask2Former, `MMDetDetector`: ``detector_kwargs`` {config,
    checkpoint, device, class_names}), "blobs" (the stand-in `BlobDetector`: ``{classes: {name: [[r, g,
    b], ...]}}``) or a ``package.module:factory`` returning a callable images -> detections.
    ``colour_classifier``: "clip" (`ClipColourClassifier`, GenEval's; ``colour_kwargs`` {path, backend,
    arch, ...}), "mean_rgb" (stand-in) or a factory path. ``mode``: "score" (Flow-GRPO's partial credit,
    default), "strict" (its exact-count 1/0) or "correct" (GenEval's benchmark 1/0); a request may set it
    per batch with ``outputs["geneval_mode"]``. Thresholds as GenEval's defaults. The metadata is the
    ``metadata_column`` ("metadata") column: a dict or JSON text per row; None is NaN. ``last_metrics``
    holds the means of all three ("score", "strict", "correct").
    """

    detector: Any = "mmdet"
    detector_kwargs: dict[str, Any] | None = None
    colour_classifier: Any = "clip"
    colour_kwargs: dict[str, Any] | None = None
    metadata_column: str = "metadata"
    mode: str = "score"
    threshold: float = 0.3
    counting_threshold: float = 0.9
    max_objects: int = 16
    max_overlap: float = 1.0
    position_threshold: float = 0.1

    needs: ClassVar[set[str]] = {"images"}

    def __post_init__(self) -> None:
        who = f"reward {self.name!r}"
        if self.mode not in GENEVAL_MODES:
            raise ValueError(f"{who}: mode must be one of {GENEVAL_MODES}, got {self.mode!r}")
        try:
            self._detect = _build("detector", DETECTORS, self.detector, self.detector_kwargs)
            self._classify = _build(
                "colour_classifier", COLOUR_CLASSIFIERS, self.colour_classifier, self.colour_kwargs
            )
        except (TypeError, ValueError) as e:
            raise type(e)(f"{who}: {e}") from e
        self.last_metrics: dict[str, float] = {}

    def __repr__(self) -> str:
        return f"GenEvalLocal(name={self.name!r}, detector={self.detector!r}, mode={self.mode!r})"

    def results(
        self, images: Sequence[Image.Image], metadatas: Sequence[Mapping[str, Any]]
    ) -> list[dict[str, Any]]:
        """Per image: ``score``, ``strict``, ``correct`` and the ``reason`` of each verdict."""
        out = []
        for image, dets, meta in zip(images, self._detect(list(images)), metadatas, strict=True):
            detected = select_detections(
                dets,
                meta.get("tag", ""),
                threshold=self.threshold,
                counting_threshold=self.counting_threshold,
                max_objects=self.max_objects,
                max_overlap=self.max_overlap,
            )
            strict, score, reason = evaluate_score(
                image, detected, meta, self._classify, self.position_threshold
            )
            correct, reason_correct = evaluate_correct(
                image, detected, meta, self._classify, self.position_threshold
            )
            out.append(
                {"score": score, "strict": float(strict), "correct": float(correct), "reason": reason_correct}
            )
        return out

    def __call__(self, batch: RewardBatch) -> Tensor:
        who = f"reward {self.name!r}"
        images = _images(who, batch)
        mode = batch.outputs.get("geneval_mode", self.mode)
        if mode not in GENEVAL_MODES:
            raise ValueError(f"{who}: outputs['geneval_mode'] must be one of {GENEVAL_MODES}, got {mode!r}")
        if self.metadata_column not in batch.columns:
            raise KeyError(
                f"{who} reads GenEval metadata from the dataset column {self.metadata_column!r} (option "
                f"metadata_column); columns: {sorted(batch.columns) or 'none'}"
            )
        column = batch.columns[self.metadata_column]
        rows = [i for i, v in enumerate(column) if v is not None]
        metas = [
            parse_metadata(column[i], f"{who}, row {i} of column {self.metadata_column!r}") for i in rows
        ]
        results = self.results([to_pil(images[i]) for i in rows], metas)
        out = torch.full((len(batch),), math.nan, dtype=torch.float32)
        for i, r in zip(rows, results, strict=True):
            out[i] = r[mode]
        self.last_metrics = (
            {k: sum(r[k] for r in results) / len(results) for k in GENEVAL_MODES} if results else {}
        )
        return out


@register_reward("geneval")
@dataclass(kw_only=True, eq=False, repr=False)
class GenEval(Reward):
    """GenEval scored by a GenEval server (``python -m rewards.geneval_server``): sends each image (uint8,
    safetensors) with its row's metadata (the ``metadata_column`` column, a dict or JSON text) and ``mode``
    ("score" partial credit, default; "strict"; "correct": GenEval's 1/0; see ``geneval_local``). Rows
    without metadata are NaN and not sent. Server options as the ``remote`` reward: ``url``,
    ``timeout_s``, ``token_env`` / ``token_file``, ``retries``, ``retry_backoff_s``, ``max_response_mb``.
    The server's means of the three modes arrive in ``last_metrics``."""

    url: str
    metadata_column: str = "metadata"
    mode: str = "score"
    timeout_s: float = 120.0
    token_env: str | None = None
    token_file: str | None = None
    retries: int = 4
    retry_backoff_s: float = 0.5
    max_response_mb: float = 16.0

    needs: ClassVar[set[str]] = {"images"}

    def __post_init__(self) -> None:
        if self.mode not in GENEVAL_MODES:
            raise ValueError(f"reward {self.name!r}: mode must be one of {GENEVAL_MODES}, got {self.mode!r}")
        self._remote = RemoteReward(
            url=self.url,
            payload="safetensors",
            fields=["images", "metadata", "geneval_mode"],
            timeout_s=self.timeout_s,
            token_env=self.token_env,
            token_file=self.token_file,
            retries=self.retries,
            retry_backoff_s=self.retry_backoff_s,
            max_response_mb=self.max_response_mb,
        )
        self.last_metrics: dict[str, float] = {}

    def __repr__(self) -> str:
        return f"GenEval(name={self.name!r}, url={self.url!r}, mode={self.mode!r})"

    def __call__(self, batch: RewardBatch) -> Tensor:
        who = f"reward {self.name!r}"
        images = _images(who, batch)
        if self.metadata_column not in batch.columns:
            raise KeyError(
                f"{who} reads GenEval metadata from the dataset column {self.metadata_column!r} (option "
                f"metadata_column); columns: {sorted(batch.columns) or 'none'}"
            )
        column = batch.columns[self.metadata_column]
        rows = [i for i, v in enumerate(column) if v is not None]
        out = torch.full((len(batch),), math.nan, dtype=torch.float32)
        if not rows:
            return out
        metas = [
            parse_metadata(column[i], f"{who}, row {i} of column {self.metadata_column!r}") for i in rows
        ]
        pixels = (images[rows].clamp(0, 1) * 255).round().to(torch.uint8)
        sub = RewardBatch(
            prompts=[batch.prompts[i] for i in rows],
            outputs={"images": pixels, "geneval_mode": self.mode},
            columns={"metadata": metas},
        )
        self._remote.name = self.name
        out[torch.tensor(rows)] = self._remote(sub)
        self.last_metrics = dict(self._remote.last_metrics)
        return out
