"""Grounding data (visual grounding / referring expressions): loading, validation and converters.

A shared helper module for the grounding pipelines (``pipelines/grounding/medloc.py``, ``pipelines/grounding/geovis.py``); it
registers no pipeline itself, so pipeline discovery imports it harmlessly.

`load_grounding_rows` reads and checks the rows; `coco_to_rows`, `refcoco_to_rows` and `write_jsonl` convert.

Row layout, converters and checks: docs/grounding.md, "Data" and "pipelines.grounding.data".
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmalign.data.rows import DataError, line_too_long, load_rows, read_lines
from pipelines.common import (
    VLMOptions,
    bad_image_message,
    image_files,
    image_problem,
    load_rows_skipping,
    resolve_row,
)

log = logging.getLogger(__name__)

DATA_COORDS = ("absolute", "norm1000", "norm1")
"""How a data row may write its boxes: original pixels, 0..1000 of width/height, 0..1 fractions."""

_SCALE = {"absolute": None, "norm1000": 1000.0, "norm1": 1.0}


def resolve_model_coords(coords: str) -> str:
    """The box convention a model writes ("absolute", "resized", "norm1000", "norm1") for `coords`, a
    convention or a model-family alias ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"), as
    `rewards.boxes.resolve_convention` reads it (imported here, lazily); ValueError listing the choices."""
    from rewards.boxes import resolve_convention

    try:
        return resolve_convention(coords)
    except (KeyError, ValueError) as e:
        raise ValueError(f"coords: {e}") from None


@dataclass
class GroundingOptions(VLMOptions):
    """The ``options:`` section of the grounding pipelines: `VLMOptions` plus box handling."""

    box_tolerance: float = 1.0
    """How far (pixels of the original image) a data box may reach past the image border: within it the
    box is clipped to the image, beyond it the row is an error (our design: rounding in converted
    annotations often lands a pixel outside)."""
    coords: str = "absolute"
    """How the MODEL writes boxes: "absolute", "resized", "norm1000", "norm1", or a model-family alias
    ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"); the pipelines pass it to the box rewards."""

    def __post_init__(self) -> None:
        tol = self.box_tolerance
        if isinstance(tol, bool) or not isinstance(tol, int | float) or not math.isfinite(tol) or tol < 0:
            raise ValueError(f"box_tolerance must be a finite number >= 0 (pixels), got {tol!r}")
        self.box_tolerance = float(tol)
        if not isinstance(self.coords, str):
            raise ValueError(f"coords must be a string, got {self.coords!r}")
        resolve_model_coords(self.coords)

    @property
    def convention(self) -> str:
        """`coords` with a model-family alias resolved to its convention."""
        return resolve_model_coords(self.coords)


# ----------------------------------------------------------------------------- loading and validation


class _BadRow(DataError):
    """A DataError with a short reason for the skip summary."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _fmt(box: Sequence[Any]) -> str:
    return "[" + ", ".join(f"{float(v):g}" if _is_number(v) else repr(v) for v in box) + "]"


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _raw_boxes(row: Mapping[str, Any], where: str) -> list[Any]:
    """The row's boxes as written (``boxes``: a list of boxes; ``box``: one box)."""
    has_boxes, has_box = row.get("boxes") is not None, row.get("box") is not None
    if not has_boxes and not has_box:
        raise _BadRow(f"{where}: the row has no 'boxes' (or 'box') column", "no box")
    if has_boxes:
        boxes = row["boxes"]
        if not isinstance(boxes, list | tuple) or not boxes:
            raise _BadRow(
                f"{where}: 'boxes' must be a non-empty list of [x1, y1, x2, y2] boxes, got {str(boxes)[:80]}",
                "bad box",
            )
        if all(_is_number(v) for v in boxes):
            raise _BadRow(
                f"{where}: 'boxes' must be a list of boxes, got a single box {_fmt(boxes)}; "
                "write it as [[x1, y1, x2, y2]] or use the 'box' column",
                "bad box",
            )
        boxes = list(boxes)
        if has_box and list(row["box"]) != list(boxes[0]):
            raise _BadRow(
                f"{where}: 'box' {str(row['box'])[:80]} differs from boxes[0] {str(boxes[0])[:80]}; "
                "give one of them",
                "bad box",
            )
        return boxes
    return [row["box"]]


def _image_size(image: Any, where: str, cache: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """(width, height) of a path (header only, no full decode) or of an in-memory PIL image."""
    if not isinstance(image, str):
        return tuple(image.size)  # type: ignore[return-value]
    if image not in cache:
        from PIL import Image

        try:
            with Image.open(image) as im:
                cache[image] = im.size
        except Exception as e:
            raise _BadRow(
                f"{where}: cannot read image {image}: {type(e).__name__}: {e}", "unreadable image"
            ) from None
    return cache[image]


def _declared_size(row: Mapping[str, Any], key: str, where: str) -> int | None:
    v = row.get(key)
    if v is None:
        return None
    if not _is_number(v) or not math.isfinite(v) or v != int(v) or v <= 0:
        raise _BadRow(
            f"{where}: {key!r} must be a positive whole number of pixels, got {v!r}", "size mismatch"
        )
    return int(v)


def _convert_box(box: Any, coords: str, size: tuple[int, int], tolerance: float, where: str) -> list[float]:
    """One box in `coords` -> absolute pixels, validated and clipped (see `load_grounding_rows`)."""
    w, h = size
    if not isinstance(box, list | tuple) or len(box) != 4 or not all(_is_number(v) for v in box):
        raise _BadRow(f"{where}: a box must be 4 numbers [x1, y1, x2, y2], got {str(box)[:80]}", "bad box")
    if not all(math.isfinite(v) for v in box):
        raise _BadRow(f"{where}: box {_fmt(box)} has a non-finite coordinate", "bad box")
    x1, y1, x2, y2 = (float(v) for v in box)
    if not (x2 > x1 and y2 > y1):
        raise _BadRow(
            f"{where}: box {_fmt(box)} is degenerate or reversed (need x1 < x2 and y1 < y2)", "degenerate box"
        )
    scale = _SCALE[coords]
    if scale is not None:
        x1, x2 = x1 / scale * w, x2 / scale * w
        y1, y2 = y1 / scale * h, y2 / scale * h
    if x1 < -tolerance or y1 < -tolerance or x2 > w + tolerance or y2 > h + tolerance:
        shown = _fmt(box) if scale is None else f"{_fmt(box)} ({coords}; {_fmt((x1, y1, x2, y2))} in pixels)"
        raise _BadRow(
            f"{where}: box {shown} lies outside the {w}x{h} image (by more than box_tolerance={tolerance:g} px)",
            "box outside image",
        )
    x1, x2 = min(max(x1, 0.0), float(w)), min(max(x2, 0.0), float(w))
    y1, y2 = min(max(y1, 0.0), float(h)), min(max(y2, 0.0), float(h))
    if not (x2 > x1 and y2 > y1):
        raise _BadRow(
            f"{where}: box {_fmt(box)} is empty after clipping to the {w}x{h} image", "box outside image"
        )
    return [x1, y1, x2, y2]


def normalize_row(
    row: dict[str, Any], root: Path, tolerance: float = 1.0, _sizes: dict[str, tuple[int, int]] | None = None
) -> dict[str, Any]:
    """One raw grounding row -> the normalised row (see the module docstring); a `DataError` names the row's
    ``_source`` (file:line). Boxes in "norm1000" / "norm1" become pixels: x = v / 1000 * W (resp. v * W),
    y likewise with H; boxes reaching at most `tolerance` pixels past the border are clipped to it."""
    where = str(row.get("_source", "?"))
    sizes = {} if _sizes is None else _sizes
    if row.get("video") is not None:
        raise _BadRow(f"{where}: grounding rows take one image, not a 'video'", "bad image column")
    if row.get("images") is not None and row.get("image") is not None:
        raise _BadRow(f"{where}: give the image in 'image' or 'images', not both", "bad image column")
    try:
        out = resolve_row(row, root)
    except DataError as e:
        reason = "missing image" if "not found" in str(e) else "bad image column"
        raise _BadRow(str(e), reason) from None
    images = out["images"]
    if len(images) != 1:
        raise _BadRow(
            f"{where}: a grounding row takes exactly one image, got {len(images)} in 'images'",
            "bad image column",
        )
    image = images[0]
    if isinstance(image, str):
        image = os.path.abspath(image)
    coords = row.get("coords", "absolute")
    if coords is None:
        coords = "absolute"
    if coords not in DATA_COORDS:
        raise _BadRow(
            f"{where}: unknown coords {coords!r}; the data may write boxes as one of {', '.join(DATA_COORDS)}",
            "unknown coords",
        )
    raw = _raw_boxes(row, where)  # before reading the image: cheap checks first
    size = _image_size(image, where, sizes)
    for key, actual in (("image_width", size[0]), ("image_height", size[1])):
        declared = _declared_size(row, key, where)
        if declared is not None and declared != actual:
            raise _BadRow(
                f"{where}: {key}={declared} does not match the image file ({size[0]}x{size[1]}: {image})",
                "size mismatch",
            )
    boxes = [_convert_box(b, coords, size, tolerance, where) for b in raw]
    out["images"] = [image]
    out["boxes"] = boxes
    out["box"] = boxes[0]
    out["coords"] = "absolute"
    out["image_width"], out["image_height"] = int(size[0]), int(size[1])
    out["_source"] = where
    return out


def load_grounding_rows(
    source: str, template: str, opts: VLMOptions, max_rows: int | None = None
) -> list[dict[str, Any]]:
    """Grounding rows of `source` (JSONL or ``hf:``), normalised and validated (see the module docstring).

    Image paths are resolved against ``opts.image_root`` (default: the JSONL file's folder); the size is
    read from the image header unless ``image_width`` / ``image_height`` are given, which must then match.
    Boxes: 4 finite numbers, x1 < x2, y1 < y2, inside the image up to ``opts.box_tolerance`` pixels (then
    clipped; `VLMOptions` without it: 1 px). A bad row is a `DataError` naming file:line, or with
    ``opts.on_bad_row == "skip"`` a skipped row: one warning each and a summary "skipped N of M rows
    (reasons: ...)"; skipping also decodes each image (`pipelines.common.image_problem`) and skips the rows
    whose image does not. No usable row left is a DataError.
    """
    if opts.image_root:
        root = Path(opts.image_root)
    else:  # next to a JSONL file; the working directory for hf: sources
        root = Path.cwd() if source.startswith("hf:") else Path(source).resolve().parent
    tolerance = float(getattr(opts, "box_tolerance", 1.0))
    skip = opts.on_bad_row == "skip"
    try:
        rows = load_rows(source, template, max_rows)
    except DataError:
        if not skip or source.startswith("hf:"):
            raise
        rows = load_rows_skipping(source, template, max_rows)
    reasons: Counter[str] = Counter()
    unreadable = getattr(rows, "skipped", 0)
    if unreadable:
        reasons["unreadable line or missing prompt column"] = unreadable
    sizes: dict[str, tuple[int, int]] = {}
    out: list[dict[str, Any]] = []
    for row in rows:
        try:
            normal = normalize_row(row, root, tolerance, sizes)
            if skip:  # find the images that do not decode (the validation pass does, for "error")
                for path in image_files(normal):
                    problem = image_problem(path)
                    if problem is not None:
                        raise _BadRow(
                            bad_image_message(normal["_source"], path, problem), "image does not decode"
                        )
            out.append(normal)
        except _BadRow as e:
            if not skip:
                raise DataError(str(e)) from None
            reasons[e.reason] += 1
            log.warning("skipping a bad row: %s", e)
    skipped = sum(reasons.values())
    if skipped:
        detail = ", ".join(f"{r}: {n}" for r, n in reasons.most_common())
        log.warning(
            "%s: skipped %d of %d rows (reasons: %s) (options.on_bad_row: skip)",
            source,
            skipped,
            len(out) + skipped,
            detail,
        )
    if not out:
        raise DataError(f"{source}: no usable rows" + (f" ({skipped} skipped)" if skipped else ""))
    return out


# ----------------------------------------------------------------------------- converters


class ConvertedRows(list):
    """The rows a converter made, with ``stats``: counts of what it skipped (e.g. ``skipped_crowd``)."""

    def __init__(self, rows: Sequence[dict[str, Any]] = (), stats: dict[str, int] | None = None) -> None:
        super().__init__(rows)
        self.stats: dict[str, int] = dict(stats or {})


def _read_json(value: Any, what: str) -> tuple[Any, str]:
    """(parsed JSON, a name for messages) of a path or an already parsed object."""
    if isinstance(value, str | os.PathLike):
        path = Path(value)
        if not path.is_file():
            raise DataError(f"{what} file not found: {path}")
        try:
            with path.open(encoding="utf-8-sig") as f:
                return json.load(f), str(path)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        except UnicodeDecodeError:
            raise DataError(f"{path}: not a UTF-8 JSON file") from None
    return value, f"<{what}>"


def _coco_index(instances: Any, where: str) -> tuple[dict[Any, dict], dict[Any, dict], list[dict]]:
    """(images by id, categories by id, annotations) of a COCO instances object."""
    if not isinstance(instances, Mapping):
        raise DataError(f"{where}: a COCO instances file is a JSON object, got {type(instances).__name__}")
    for key in ("images", "annotations"):
        if not isinstance(instances.get(key), list):
            raise DataError(f"{where}: a COCO instances file needs a list {key!r} (has {sorted(instances)})")
    images: dict[Any, dict] = {}
    for i, im in enumerate(instances["images"]):
        if not isinstance(im, Mapping) or "id" not in im or "file_name" not in im:
            raise DataError(f"{where}: images[{i}] needs 'id' and 'file_name', got {str(im)[:80]}")
        images[im["id"]] = dict(im)
    categories = {
        c["id"]: dict(c) for c in instances.get("categories") or [] if isinstance(c, Mapping) and "id" in c
    }
    annotations = instances["annotations"]
    for i, ann in enumerate(annotations):
        if not isinstance(ann, Mapping) or "image_id" not in ann or "bbox" not in ann:
            raise DataError(f"{where}: annotations[{i}] needs 'image_id' and 'bbox', got {str(ann)[:80]}")
    return images, categories, annotations


def _xyxy(bbox: Any, where: str) -> list[float] | None:
    """COCO [x, y, w, h] -> [x1, y1, x2, y2]; None for a zero-area box."""
    if not isinstance(bbox, list | tuple) or len(bbox) != 4 or not all(_is_number(v) for v in bbox):
        raise DataError(f"{where}: bbox must be 4 numbers [x, y, w, h], got {str(bbox)[:80]}")
    x, y, w, h = (float(v) for v in bbox)
    if not all(math.isfinite(v) for v in (x, y, w, h)):
        raise DataError(f"{where}: bbox {list(bbox)} has a non-finite value")
    if w <= 0 or h <= 0:
        return None
    return [x, y, x + w, y + h]


def _image_columns(image: Mapping[str, Any], image_root: str | None) -> dict[str, Any]:
    name = str(image["file_name"])
    out: dict[str, Any] = {"image": str(Path(image_root) / name) if image_root else name}
    if _is_number(image.get("width")) and _is_number(image.get("height")):
        out["image_width"], out["image_height"] = int(image["width"]), int(image["height"])
    return out


def _category(categories: Mapping[Any, dict], cat_id: Any, where: str) -> dict[str, Any]:
    if cat_id is None:
        return {}
    if cat_id not in categories:
        raise DataError(f"{where}: category_id {cat_id!r} is not in the file's categories")
    return categories[cat_id]


def coco_to_rows(
    instances_json: str | os.PathLike[str] | Mapping[str, Any],
    image_root: str | None = None,
    *,
    per: str = "annotation",
    expression: str = "the {category}",
) -> ConvertedRows:
    """Grounding rows from a COCO instances file (a path or the parsed object).

    ``per="annotation"``: one row per annotation with its one box (columns ``ann_id``); ``per="category"``:
    one row per (image, category) with every box of that category in the image (``ann_ids``), in the order
    of first appearance. The expression is `expression` formatted with ``category`` (the category name) and
    ``supercategory``. Boxes: COCO [x, y, w, h] -> [x, y, x + w, y + h] in pixels ("absolute"). Crowd
    annotations (``iscrowd: 1``) and zero-area boxes are skipped and counted (``rows.stats``). The image is
    ``file_name`` (under `image_root` when given); image_width / image_height come from the file."""
    if per not in ("annotation", "category"):
        raise ValueError(f"per must be 'annotation' or 'category', got {per!r}")
    data, where = _read_json(instances_json, "COCO instances")
    images, categories, annotations = _coco_index(data, where)
    stats = {"skipped_crowd": 0, "skipped_empty_box": 0}
    groups: dict[tuple[Any, Any], list[tuple[Any, list[float]]]] = {}
    for i, ann in enumerate(annotations):
        ann_where = f"{where}: annotation {ann.get('id', f'#{i}')}"
        if ann.get("iscrowd"):
            stats["skipped_crowd"] += 1
            continue
        if ann["image_id"] not in images:
            raise DataError(f"{ann_where}: image_id {ann['image_id']!r} is not in the file's images")
        _category(categories, ann.get("category_id"), ann_where)
        box = _xyxy(ann["bbox"], ann_where)
        if box is None:
            stats["skipped_empty_box"] += 1
            continue
        key = (ann["image_id"], ann.get("category_id"))
        if per == "annotation":
            key = (key, ann.get("id", i))  # type: ignore[assignment]
        groups.setdefault(key, []).append((ann.get("id", i), box))
    rows = []
    for key, members in groups.items():
        image_id, cat_id = key[0] if per == "annotation" else key
        cat = _category(categories, cat_id, where)
        name = str(cat.get("name", cat_id))
        try:
            text = expression.format(category=name, supercategory=cat.get("supercategory", name))
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"expression {expression!r}: only {{category}} and {{supercategory}} can be used ({e})"
            ) from None
        row: dict[str, Any] = _image_columns(images[image_id], image_root)
        row.update(expression=text, boxes=[b for _, b in members], coords="absolute")
        row.update(image_id=image_id, category=name)
        if per == "annotation":
            row["ann_id"] = members[0][0]
        else:
            row["ann_ids"] = [a for a, _ in members]
        rows.append(row)
    return ConvertedRows(rows, stats)


_PICKLE_SUFFIXES = (".p", ".pkl", ".pickle")


def _fix_py2_text(value: Any) -> Any:
    """Strings of a Python 2 pickle read as latin-1 -> their UTF-8 text (lists/dicts recursively)."""
    if isinstance(value, str):
        try:
            return value.encode("latin-1").decode("utf-8")
        except UnicodeError:
            return value
    if isinstance(value, list):
        return [_fix_py2_text(v) for v in value]
    if isinstance(value, dict):
        return {_fix_py2_text(k): _fix_py2_text(v) for k, v in value.items()}
    return value


def _read_refs(refs: Any, allow_pickle: bool) -> tuple[list[Any], str]:
    """The refs list of a path (.json list, .jsonl, or a trusted pickle) or an in-memory list."""
    if not isinstance(refs, str | os.PathLike):
        if not isinstance(refs, list):
            raise DataError(f"refs must be a list of ref objects, got {type(refs).__name__}")
        return refs, "<refs>"
    path = Path(refs)
    if not path.is_file():
        raise DataError(f"refs file not found: {path}")
    with path.open("rb") as f:
        head = f.read(2)
    if path.suffix.lower() in _PICKLE_SUFFIXES or head[:1] == b"\x80":
        if not allow_pickle:
            raise DataError(
                f"{path} is a Python pickle: loading a pickle can run arbitrary code, so it is read only "
                "with allow_pickle=True (command line: --allow-pickle), and only for files you trust; "
                "or convert it to JSON first"
            )
        import pickle

        with path.open("rb") as f:
            try:
                data = pickle.load(f)
            except UnicodeDecodeError:  # a Python 2 pickle with non-ASCII text
                f.seek(0)
                data = _fix_py2_text(pickle.load(f, encoding="latin-1"))
        where = str(path)
    elif path.suffix.lower() == ".jsonl":
        data, where = [], str(path)
        for lineno, raw in read_lines(path):  # one line at a time, none longer than MAX_LINE_BYTES
            if raw is None:
                raise line_too_long(path, lineno)
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                if line.strip():
                    data.append(json.loads(line))
            except UnicodeDecodeError:
                raise DataError(f"{path}:{lineno}: not valid UTF-8") from None
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
    else:
        data, where = _read_json(path, "refs")
    if not isinstance(data, list):
        raise DataError(f"{where}: the refs must be a list of ref objects, got {type(data).__name__}")
    return data, where


def refcoco_to_rows(
    refs: str | os.PathLike[str] | list[Mapping[str, Any]],
    instances_json: str | os.PathLike[str] | Mapping[str, Any],
    *,
    split: str | None = None,
    image_root: str | None = None,
    allow_pickle: bool = False,
) -> ConvertedRows:
    """Grounding rows from RefCOCO-style referring expressions (RefCOCO, RefCOCO+, RefCOCOg).

    `refs`: a list of ``{ref_id, ann_id, image_id, split, sentences: [{"sent": ...} or {"raw": ...}]}``,
    or a path to it (.json list, .jsonl, or the official ``refs(unc).p`` pickle -- a pickle runs code when
    loaded, so it is read only with ``allow_pickle=True``, for files you trust). `instances_json`: the
    matching COCO instances file (path or object) giving each ann_id's box and each image's file. One row
    per sentence (``sent``, else ``raw``), with the annotation's box ([x, y, w, h] -> [x, y, x + w, y + h]
    pixels), columns ``split``, ``ref_id``, ``ann_id``, ``image_id``, ``category`` (and ``sent_id``).
    `split`: keep only refs of that split (None: all)."""
    ref_list, ref_where = _read_refs(refs, allow_pickle)
    data, where = _read_json(instances_json, "COCO instances")
    images, categories, annotations = _coco_index(data, where)
    anns = {a["id"]: a for a in annotations if "id" in a}
    stats = {"skipped_split": 0, "skipped_no_sentence": 0}
    rows = []
    for i, ref in enumerate(ref_list):
        here = f"{ref_where}: ref {ref.get('ref_id', f'#{i}') if isinstance(ref, Mapping) else f'#{i}'}"
        if not isinstance(ref, Mapping) or "ann_id" not in ref:
            raise DataError(f"{here}: a ref needs 'ann_id' and 'sentences', got {str(ref)[:80]}")
        if split is not None and ref.get("split") != split:
            stats["skipped_split"] += 1
            continue
        ann = anns.get(ref["ann_id"])
        if ann is None:
            raise DataError(f"{here}: ann_id {ref['ann_id']!r} is not in the annotations of {where}")
        image_id = ref.get("image_id", ann["image_id"])
        if image_id not in images:
            raise DataError(f"{here}: image_id {image_id!r} is not in the images of {where}")
        box = _xyxy(ann["bbox"], f"{here} (annotation {ref['ann_id']})")
        if box is None:
            raise DataError(f"{here}: annotation {ref['ann_id']} has a zero-area bbox {ann['bbox']}")
        cat_id = ref.get("category_id", ann.get("category_id"))
        cat = _category(categories, cat_id, here) if categories else {}
        sentences = ref.get("sentences") or []
        texts = [
            (s.get("sent_id"), s.get("sent") or s.get("raw"))
            for s in sentences
            if isinstance(s, Mapping) and (s.get("sent") or s.get("raw"))
        ]
        if not texts:
            stats["skipped_no_sentence"] += 1
            continue
        for sent_id, text in texts:
            row: dict[str, Any] = _image_columns(images[image_id], image_root)
            row.update(expression=str(text).strip(), boxes=[list(box)], coords="absolute")
            row.update(
                split=ref.get("split"), ref_id=ref.get("ref_id"), ann_id=ref["ann_id"], image_id=image_id
            )
            if cat_id is not None:
                row["category"] = str(cat.get("name", cat_id))
            if sent_id is not None:
                row["sent_id"] = sent_id
            rows.append(row)
    return ConvertedRows(rows, stats)


def write_jsonl(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> int:
    """Write `rows` as JSONL (UTF-8, one object per line; columns starting with "_" are left out);
    the number of rows written. Parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(
                json.dumps({k: v for k, v in row.items() if not str(k).startswith("_")}, ensure_ascii=False)
            )
            f.write("\n")
    return len(rows)


def summarize(rows: Sequence[Mapping[str, Any]], stats: Mapping[str, int] | None = None) -> str:
    """One line of counts: rows, distinct images, boxes, skipped items, rows per split."""
    images = {r.get("image", str(r.get("images"))) for r in rows}
    boxes = sum(len(r.get("boxes") or []) for r in rows)
    parts = [f"{len(rows)} rows", f"{len(images)} images", f"{boxes} boxes"]
    for key, n in (stats or {}).items():
        if n:
            parts.append(f"{key.replace('_', ' ')}: {n}")
    splits = Counter(str(r["split"]) for r in rows if r.get("split") is not None)
    if splits:
        parts.append("per split: " + ", ".join(f"{s} {n}" for s, n in sorted(splits.items())))
    return "; ".join(parts)


# ----------------------------------------------------------------------------- command line


def _parser(prog: str = "python -m pipelines.grounding.data") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Convert and check grounding data (JSONL rows).")
    sub = p.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="convert a public annotation format to grounding JSONL")
    fmt = conv.add_subparsers(dest="format", required=True)
    coco = fmt.add_parser(
        "coco", help="COCO instances file -> one row per annotation (or per image+category)"
    )
    coco.add_argument("instances", help="COCO instances JSON (images, annotations, categories)")
    coco.add_argument("out", help="output JSONL")
    coco.add_argument("--per", choices=("annotation", "category"), default="annotation")
    coco.add_argument(
        "--expression", default="the {category}", help="template with {category}, {supercategory}"
    )
    coco.add_argument("--image-root", default=None, help="folder prefixed to each file_name in the rows")
    ref = fmt.add_parser("refcoco", help="RefCOCO-style refs + COCO instances -> one row per sentence")
    ref.add_argument(
        "refs", help="refs: .json list, .jsonl, or the official refs(*).p pickle (--allow-pickle)"
    )
    ref.add_argument("instances", help="the matching COCO instances JSON")
    ref.add_argument("out", help="output JSONL")
    ref.add_argument("--split", default=None, help="keep only this split (e.g. val, testA)")
    ref.add_argument("--image-root", default=None, help="folder prefixed to each file_name in the rows")
    ref.add_argument(
        "--allow-pickle",
        action="store_true",
        help="read a pickled refs file (a pickle can run arbitrary code: only for files you trust)",
    )
    check = sub.add_parser("check", help="load a grounding JSONL with full validation")
    check.add_argument("data", help="grounding JSONL")
    check.add_argument(
        "--image-root", default=None, help="folder image paths are relative to (default: the file's)"
    )
    check.add_argument(
        "--skip-bad", action="store_true", help="skip bad rows (counted, logged) instead of stopping"
    )
    check.add_argument("--box-tolerance", type=float, default=1.0, help="pixels a box may exceed the image")
    check.add_argument("--template", default="{expression}", help="prompt template every row must format")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "python -m pipelines.grounding.data") -> int:
    """The command line (see the module docstring); 0 on success, 1 on a data error (printed to stderr)."""
    args = _parser(prog).parse_args(argv)
    try:
        if args.command == "convert":
            if args.format == "coco":
                rows = coco_to_rows(args.instances, args.image_root, per=args.per, expression=args.expression)
            else:
                rows = refcoco_to_rows(
                    args.refs,
                    args.instances,
                    split=args.split,
                    image_root=args.image_root,
                    allow_pickle=args.allow_pickle,
                )
            if not rows:
                raise DataError(f"no rows to write ({summarize(rows, rows.stats)})")
            write_jsonl(rows, args.out)
            print(f"wrote {args.out}: {summarize(rows, rows.stats)}")
            return 0
        opts = GroundingOptions(
            image_root=args.image_root,
            on_bad_row="skip" if args.skip_bad else "error",
            box_tolerance=args.box_tolerance,
        )
        loaded = load_grounding_rows(args.data, args.template, opts)
        print(f"{len(loaded)} rows OK ({summarize(loaded)})")
        return 0
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
