"""Prompt data: JSONL files (or Hugging Face datasets) turned into rows with prompts.

Every row is a dict; all of its columns travel with the samples to the rewards. The prompt
text is made from the row with a format template (``"{question}"`` by default) and stored
under the key ``prompt``; a row that already has a ``prompt`` column keeps it when the template
is the default.

Details: docs/architecture.md, "mmalign.data.rows".
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from string import Formatter
from typing import Any

from mmalign.errors import MmalignError

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 1 << 20
"""The longest line (in bytes, without its line break) the prompt readers accept by default: 1 MiB, far more
than any prompt row (a context of 128k tokens is about 0.5 MB of text); image rows hold paths, not pixels.
Read at each call, so code may raise it (``mmalign.data.rows.MAX_LINE_BYTES = ...``) before a run."""

_CHUNK = 1 << 16
"""How much of an over-long line is read at a time while skipping the rest of it."""


class DataError(MmalignError, ValueError):
    """Bad input data; the message names the file and line (a ValueError too)."""


def line_too_long(path: str | Path, lineno: int, max_line_bytes: int | None = None) -> DataError:
    """The DataError of a line over `max_line_bytes` (None: `MAX_LINE_BYTES`): ``FILE:LINE: line longer than
    N bytes ...``."""
    if max_line_bytes is None:
        max_line_bytes = MAX_LINE_BYTES
    return DataError(
        f"{path}:{lineno}: line longer than {max_line_bytes} bytes (mmalign.data.rows.MAX_LINE_BYTES); "
        "one row per line: is this a JSON file rather than JSONL, or a row holding data inline (an image or a "
        "document) instead of a path to it?"
    )


def read_lines(path: str | Path, max_line_bytes: int | None = None) -> Iterator[tuple[int, bytes | None]]:
    """``(line number, the line's bytes without its line break)`` for each line of `path`, counting from 1;
    ``None`` in place of the bytes for a line longer than `max_line_bytes` (None: `MAX_LINE_BYTES`, read at
    each call; the rest of such a line is read and dropped in small chunks, so at most about `max_line_bytes`
    of a line is held). Callers refuse such a line (`line_too_long`) or skip it."""
    if max_line_bytes is None:
        max_line_bytes = MAX_LINE_BYTES
    if max_line_bytes < 1:
        raise ValueError(f"max_line_bytes must be >= 1, got {max_line_bytes}")
    with Path(path).open("rb") as f:
        lineno = 0
        while True:
            raw = f.readline(max_line_bytes + 2)  # the line, its "\r\n", and one byte that says "too long"
            if not raw:
                return
            lineno += 1
            ended = raw.endswith(b"\n")
            body = raw[:-1] if ended else raw
            if body.endswith(b"\r"):
                body = body[:-1]
            if len(body) <= max_line_bytes:
                yield lineno, body
                continue
            while not ended:  # drop the rest of the line without holding it
                chunk = f.readline(_CHUNK)
                ended = not chunk or chunk.endswith(b"\n")
            yield lineno, None


def load_jsonl(
    path: str | Path, max_rows: int | None = None, max_line_bytes: int | None = None
) -> list[dict[str, Any]]:
    """Read a JSONL file; a malformed line, or one longer than `max_line_bytes`, raises DataError naming
    `path:line`. Blank lines are skipped (line numbers still count them); a UTF-8 byte-order mark is allowed."""
    path = Path(path)
    if max_rows is not None and max_rows < 1:
        raise DataError(f"{path}: max_rows must be >= 1 or None, got {max_rows}")
    if not path.is_file():
        if path.is_dir():
            raise DataError(
                f"data file not found: {path} (it is a directory; hf:{path}:<split> reads a dataset folder)"
            )
        raise DataError(f"data file not found: {path}; {missing_data_hint(path)}")
    rows: list[dict[str, Any]] = []
    for lineno, raw in read_lines(path, max_line_bytes):
        line = _decode(path, lineno, raw, max_line_bytes)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            column = min(e.pos, len(line)) + 1
            raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {column})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}")
        row["_source"] = f"{path}:{lineno}"
        rows.append(row)
        if max_rows is not None and len(rows) >= max_rows:
            break
    if not rows:
        raise DataError(f"{path}: no rows (the file is empty)")
    return rows


def _decode(path: Path, lineno: int, raw: bytes | None, max_line_bytes: int | None) -> str:
    """A line of `read_lines` as text (a byte-order mark allowed on line 1); DataError naming `path:line`
    for a line too long or not UTF-8."""
    if raw is None:
        raise line_too_long(path, lineno, max_line_bytes)
    try:
        return raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start + 1} of the line)") from None


# ----------------------------------------------------------------------------- Hugging Face datasets


@dataclass(frozen=True)
class HFSource:
    """A parsed ``hf:`` data source: `name` (a hub dataset id, or a local folder), `config` (None: the
    dataset's default, or its only one) and `split`."""

    name: str
    config: str | None
    split: str

    @property
    def local(self) -> bool:
        """`name` is a folder here (a `save_to_disk` folder or a folder of data files), not a hub id."""
        return Path(self.name).expanduser().is_dir()


HF_FORM = "hf:<dataset id or folder>[:<config>]:<split>"
"""The form of an ``hf:`` data source, as messages show it."""


def parse_hf_source(spec: str) -> HFSource:
    """``hf:<name>[:<config>]:<split>`` -> `HFSource` (``hf:openai/gsm8k:main:train``, ``hf:data/ds:test``).
    Without a split: ``train``; without a config: the known dataset's (`KNOWN_DATASETS`, e.g. GSM8K's
    ``main``), else None. A malformed spec is a DataError showing the form."""
    body = spec[3:] if spec.startswith("hf:") else spec
    parts = body.split(":")
    if not parts[0] or len(parts) > 3 or not all(parts[1:]):
        raise DataError(f"{spec!r}: expected {HF_FORM}, e.g. hf:openai/gsm8k:main:train")
    known = KNOWN_DATASETS.get(parts[0])
    if len(parts) == 3:
        return HFSource(parts[0], parts[1], parts[2])
    return HFSource(parts[0], known.config if known else None, parts[1] if len(parts) == 2 else "train")


class SkipRow(Exception):
    """Raised by a `KnownDataset` row mapping for a hub row it cannot use (the message says why); the row is
    left out and counted in one warning."""


@dataclass(frozen=True)
class KnownDataset:
    """A public hub dataset whose schema `load_hf_dataset` maps onto the columns the pipelines read (the hub
    columns stay; the mapping adds or rewrites the pipeline's ones, see `columns`)."""

    id: str
    title: str
    config: str | None
    """The configuration read when the spec names none (GSM8K: ``main``)."""
    train_split: str
    eval_split: str | None
    pipelines: tuple[str, ...]
    """The pipelines whose rows it gives (the missing-file hint suggests it for them)."""
    rows: Callable[[dict[str, Any]], list[dict[str, Any]]]
    """One hub row -> the pipeline rows made from it (several for RefCOCO: one per referring expression);
    `SkipRow` leaves the row out."""
    columns: str
    """What the mapping makes of the hub columns (docs and messages)."""
    words: tuple[str, ...] = ()
    """Words of a local data path that name this dataset (``data/gsm8k/train.jsonl``: ``gsm8k``)."""
    note: str = ""
    """What else a run needs (image files), shown in the hint."""

    def source(self, split: str | None = None) -> str:
        """The ``hf:`` spec of `split` (default: the training split)."""
        split = split or self.train_split
        return f"hf:{self.id}:{self.config}:{split}" if self.config else f"hf:{self.id}:{split}"


def _gsm8k_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    """GSM8K: ``answer`` is the worked solution ending in ``#### 72``; the row's ``answer`` becomes the text
    after the last ``####`` (``"72"``), the solution moves to ``solution``."""
    text = row["answer"]
    if not isinstance(text, str) or "####" not in text:
        raise SkipRow("its 'answer' has no '#### <final answer>' line")
    final = text.rsplit("####", 1)[1].strip()
    if not final:
        raise SkipRow("nothing after '####' in its 'answer'")
    return [{**row, "answer": final, "solution": text}]


def _math_answer_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A MATH set with an ``answer`` column (MATH-500): ``question`` = ``problem``."""
    return [{**row, "question": row["problem"]}]


def _math_boxed_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    r"""A MATH set without an answer column (MATH-lighteval): ``question`` = ``problem``, ``answer`` = the
    content of the solution's last ``\boxed{}`` (`mmalign.data.answers.extract_boxed`)."""
    from mmalign.data.answers import extract_boxed

    answer = extract_boxed(row["solution"]) if isinstance(row["solution"], str) else None
    if answer is None:
        raise SkipRow("its 'solution' has no \\boxed{} answer")
    return [{**row, "question": row["problem"], "answer": answer}]


def _geometry3k_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Geometry3K: ``question`` = ``problem`` without its ``<image>`` placeholder (the VLM policy puts the
    image before the text itself); ``images`` (in memory) and ``answer`` as on the hub."""
    question = str(row["problem"]).replace("<image>", "").strip()
    return [{**row, "question": question}]


def _expressions(value: Any) -> list[str]:
    """The non-empty referring expressions of a column (a list of strings, or one string)."""
    items = value if isinstance(value, list | tuple) else [value]
    return [s.strip() for s in items if isinstance(s, str) and s.strip()]


def _refcoco_path_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    """jxu124's RefCOCO / RefCOCO+ / RefCOCOg: one grounding row per caption; ``image`` = ``image_path``
    (``coco/train2014/...jpg``, resolved against ``options.image_root``), ``boxes`` = [``bbox``] (already
    x1, y1, x2, y2 in pixels), ``image_width`` / ``image_height`` from ``raw_image_info``."""
    captions = _expressions(row.get("captions")) or _expressions(
        [s.get("sent") for s in row.get("sentences") or [] if isinstance(s, dict)]
    )
    if not captions:
        raise SkipRow("no referring expression in 'captions' or 'sentences'")
    extra: dict[str, Any] = {}
    try:
        info = json.loads(row.get("raw_image_info") or "null")
        if (
            isinstance(info, dict)
            and isinstance(info.get("width"), int)
            and isinstance(info.get("height"), int)
        ):
            extra = {"image_width": info["width"], "image_height": info["height"]}
    except (TypeError, ValueError):
        pass
    box = [float(v) for v in row["bbox"]]
    return [
        {**row, **extra, "image": row["image_path"], "expression": c, "boxes": [box], "coords": "absolute"}
        for c in captions
    ]


def _refcoco_image_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    """lmms-lab's RefCOCO (evaluation splits, images in the rows): one grounding row per expression of
    ``answer``; ``bbox`` is COCO's [x, y, width, height] in pixels -> ``boxes`` = [[x, y, x + w, y + h]]."""
    expressions = _expressions(row.get("answer"))
    if not expressions:
        raise SkipRow("no referring expression in 'answer'")
    x, y, w, h = (float(v) for v in row["bbox"])
    return [
        {**row, "expression": e, "boxes": [[x, y, x + w, y + h]], "coords": "absolute"} for e in expressions
    ]


def _parti_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    """PartiPrompts: ``prompt`` = ``Prompt`` (``Category``, ``Challenge`` and ``Note`` reach the rewards)."""
    return [{**row, "prompt": row["Prompt"]}]


_REFCOCO_PATH = dict(
    config=None,
    train_split="train",
    eval_split="validation",
    rows=_refcoco_path_rows,
    columns="image (= image_path), expression (one row per caption), boxes ([bbox], x1 y1 x2 y2 pixels)",
    note="COCO train2014 images under options.image_root, as coco/train2014/*.jpg",
)

KNOWN_DATASETS: dict[str, KnownDataset] = {
    d.id: d
    for d in (
        KnownDataset(
            "openai/gsm8k",
            "GSM8K",
            "main",
            "train",
            "test",
            ("text_reasoning",),
            _gsm8k_rows,
            "question; answer = the text after '####'; solution = the hub's answer",
            words=("gsm8k",),
        ),
        KnownDataset(
            "DigitalLearningGmbH/MATH-lighteval",
            "MATH",
            None,
            "train",
            "test",
            ("text_reasoning",),
            _math_boxed_rows,
            "question = problem; answer = the last \\boxed{} of solution",
            words=("math",),
        ),
        KnownDataset(
            "HuggingFaceH4/MATH-500",
            "MATH-500",
            None,
            "test",
            "test",
            (),
            _math_answer_rows,
            "question = problem; answer as on the hub",
            words=("math500",),
        ),
        KnownDataset(
            "hiyouga/geometry3k",
            "Geometry3K",
            None,
            "train",
            "test",
            ("vlm_reasoning",),
            _geometry3k_rows,
            "images (in memory); question = problem without '<image>'; answer",
            words=("geometry3k", "geo3k"),
        ),
        KnownDataset(
            "jxu124/refcoco", "RefCOCO", pipelines=("medloc", "geovis"), words=("refcoco",), **_REFCOCO_PATH
        ),
        KnownDataset("jxu124/refcocoplus", "RefCOCO+", pipelines=(), words=("refcocoplus",), **_REFCOCO_PATH),
        KnownDataset("jxu124/refcocog", "RefCOCOg", pipelines=(), words=("refcocog",), **_REFCOCO_PATH),
        KnownDataset(
            "lmms-lab/RefCOCO",
            "RefCOCO (lmms-lab, evaluation splits)",
            None,
            "val",
            "val",
            (),
            _refcoco_image_rows,
            "image (in memory); expression (one row per answer); boxes = [bbox as x, y, x + w, y + h]",
        ),
        KnownDataset(
            "nateraw/parti-prompts",
            "PartiPrompts",
            None,
            "train",
            None,
            ("text_to_image",),
            _parti_rows,
            "prompt = Prompt",
            words=("parti", "partiprompts"),
        ),
    )
}
"""The public datasets whose hub schema `load_hf_dataset` maps onto the pipelines' columns, by hub id (the
spec's id must be exactly one of these; a local folder is read as it is)."""
KNOWN_DATASETS["gsm8k"] = KNOWN_DATASETS["openai/gsm8k"]  # the hub's old name (it redirects)

_LOCAL_HINTS: tuple[tuple[tuple[str, ...], tuple[str, ...], str], ...] = (
    (
        ("pickscore", "geneval"),
        ("text_to_image",),
        "Flow-GRPO's prompt files are dataset/pickscore/{train,test}.txt and dataset/geneval/ in "
        "github.com/yifan123/flow_grpo (one prompt per line)",
    ),
    (
        (),
        ("medloc", "geovis"),
        "convert grounding annotations to rows with `python -m pipelines.grounding.data convert coco|refcoco ...` "
        "(docs/grounding.md), then check them with `mmalign grounding check FILE`",
    ),
)
"""(path words, pipelines, hint) for data that is not on the hub by a known id."""


def missing_data_hint(path: str | Path, *, key: str = "data.train", pipeline: str | None = None) -> str:
    """Where the missing data file `path` (config key `key`) can come from, in one line: a known dataset
    whose words are in the path (``data/gsm8k/train.jsonl``: GSM8K) as the ``hf:`` value for `key` (its
    evaluation split for ``data.eval``) and the `export` command that writes the file; the source of data that
    is not on the hub (`_LOCAL_HINTS`); with no dataset named, the conversions and hub datasets of `pipeline`;
    else the accepted forms."""
    words = {w for w in re.split(r"[^a-z0-9]+", str(path).lower()) if w}
    known = list(dict.fromkeys(KNOWN_DATASETS.values()))

    def spec(d: KnownDataset) -> str:
        return d.source((d.eval_split or d.train_split) if key.endswith("eval") else d.train_split)

    parts = []
    named = [d for d in known if words & set(d.words)][:1]
    for d in named:
        export = (
            ""
            if str(path).endswith(".txt")
            else f", or write this file: python -m mmalign.data.rows export {spec(d)} {path}"
        )
        parts.append(f"{d.title} by id: {key}={spec(d)}" + (f" ({d.note})" if d.note else "") + export)
    parts += [hint for hint_words, _, hint in _LOCAL_HINTS if words & set(hint_words)]
    if pipeline and not named:
        parts += [hint for _, pipelines, hint in _LOCAL_HINTS if pipeline in pipelines and hint not in parts]
        by_id = [d for d in known if pipeline in d.pipelines][:2]
        if by_id:
            choices = " or ".join(f"{spec(d)} ({d.title}{'; ' + d.note if d.note else ''})" for d in by_id)
            parts.append(f"by id: {key}={choices}")
    if not parts:
        parts.append(
            f"set {key} to a JSONL file, a .txt file of prompts or {HF_FORM} (docs/configuration.md; the "
            "comments at the top of each config in configs/ say what its rows hold)"
        )
    return "; ".join(parts)


@contextmanager
def _datasets_offline(datasets: Any) -> Iterator[None]:
    """`datasets` reads only its caches while inside (its own offline flag, read when it was imported), without
    its warnings that it does ("Using the latest cached version ...", twice per load)."""
    before, verbosity = datasets.config.HF_HUB_OFFLINE, datasets.logging.get_verbosity()
    datasets.config.HF_HUB_OFFLINE = True
    datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = before
        datasets.logging.set_verbosity(verbosity)


@cache
def _hub_problem(repo_id: str) -> str | None:
    """None when the hub answers for the dataset `repo_id` (`mmalign.data.hub.reach`: one request, no retry;
    ``datasets`` itself retries for about 25 s); else why not, in a few words. Asked once per process and id."""
    from mmalign.data.hub import reach

    return reach(repo_id, repo_type="dataset")


def hf_fetch_hint(src: HFSource) -> str:
    """How to get the hub dataset of `src` onto a machine that cannot download it."""
    args = repr(src.name) + (f", {src.config!r}" if src.config else "")
    spec = f"hf:{src.name}{':' + src.config if src.config else ''}:{src.split}"
    return (
        'on a machine where the hub is reachable, load it once with the same HF_HOME (`python -c "import '
        f'datasets; datasets.load_dataset({args})"`) or download it (`hf download {src.name} --repo-type '
        "dataset`) and copy HF_HOME's datasets/ or hub/ folder here, or write it to a JSONL file there "
        f"(`python -m mmalign.data.rows export {spec} FILE.jsonl`) and name that file instead"
    )


def _load_cached(datasets: Any, src: HFSource, spec: str, reason: str) -> Any:
    """The hub dataset of `src` from the local caches only: the one `datasets.load_dataset` prepared
    (``HF_DATASETS_CACHE``, e.g. ``HF_HOME/datasets/openai___gsm8k/main/...``), else the repository's files in
    the hub cache (``HF_HOME/hub/datasets--openai--gsm8k``, as `hf download --repo-type dataset` leaves them),
    read as a local folder. Neither: a DataError saying `reason` and how to fetch it."""
    with _datasets_offline(datasets):
        try:
            return datasets.load_dataset(src.name, src.config, split=src.split)
        except (ConnectionError, FileNotFoundError, ValueError) as e:
            prepared_error = e  # not prepared (or not this config / split): try the repository's files
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            folder = snapshot_download(src.name, repo_type="dataset", local_files_only=True)
        except LocalEntryNotFoundError:
            if isinstance(prepared_error, ValueError):  # prepared, but without this configuration or split
                raise prepared_error from None
            from huggingface_hub import constants

            raise DataError(
                f"{spec}: the dataset {src.name} is in neither local cache ({datasets.config.HF_DATASETS_CACHE}, "
                f"{constants.HF_HUB_CACHE}) and {reason}; {hf_fetch_hint(src)}"
            ) from None
        return datasets.load_dataset(folder, src.config, split=src.split)


def _load_hf(spec: str, src: HFSource) -> Any:
    """The `datasets.Dataset` of `src`: a `save_to_disk` folder, a folder of data files, or a hub id (from the
    hub, or from the caches alone when offline or when the hub does not answer)."""
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - a dev extra
        raise DataError(f"{spec}: the `datasets` package is needed for hf: data sources") from e
    if src.local:
        folder = Path(src.name).expanduser()
        if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
            ds = datasets.load_from_disk(str(folder))
            if isinstance(ds, datasets.DatasetDict):
                if src.split not in ds:
                    raise DataError(f"{spec}: no split {src.split!r} (has {sorted(ds)})")
                ds = ds[src.split]
            return ds
        return datasets.load_dataset(str(folder), src.config, split=src.split)
    from mmalign.data.hub import offline_reason

    reason = offline_reason() or ("HF_DATASETS_OFFLINE=1" if datasets.config.HF_HUB_OFFLINE else None)
    if reason is not None:
        return _load_cached(datasets, src, spec, f"this process is offline ({reason})")
    problem = _hub_problem(src.name)
    if problem is None:
        return datasets.load_dataset(src.name, src.config, split=src.split)
    return _load_cached(datasets, src, spec, problem)  # a copy made before (or when logged in) still serves


def load_hf_dataset(spec: str, max_rows: int | None = None) -> list[dict[str, Any]]:
    """``hf:<name>[:<config>]:<split>`` (`parse_hf_source`) -> list of rows, each with ``_source`` =
    ``spec[i]`` (the hub row's index).

    `name` is a local folder (written by `Dataset.save_to_disk`, or holding data files such as a dataset
    repository downloaded with ``hf download ... --local-dir``), read as it is, or a hub dataset id, loaded with
    ``datasets.load_dataset(id, config, split=split)``; offline (``HF_HUB_OFFLINE=1``) or when the hub does not
    answer within a few seconds, from the local caches only (`_load_cached`). The rows of a dataset in
    `KNOWN_DATASETS` are mapped onto the pipelines' columns (GSM8K's ``#### 72`` -> ``answer`` ``"72"``); a hub
    row the mapping cannot use is left out, with one warning counting them.
    """
    src = parse_hf_source(spec)
    try:
        ds = _load_hf(spec, src)
    except DataError:
        raise
    except Exception as e:
        text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())[:400]
        hint = ""
        if "config" in text.lower():
            hint = f"; name the configuration: {HF_FORM}"
            if src.config in ("train", "test", "validation", "val", "dev"):
                hint += f" (the split comes last: hf:{src.name}:{src.split}:{src.config}?)"
        raise DataError(f"{spec}: cannot load the dataset: {type(e).__name__}: {text}{hint}") from e
    known = None if src.local else KNOWN_DATASETS.get(src.name)
    rows: list[dict[str, Any]] = []
    skipped: Counter[str] = Counter()
    for i, hub_row in enumerate(ds):
        where = f"{spec}[{i}]"
        if known is None:
            made = [dict(hub_row)]
        else:
            try:
                made = known.rows(dict(hub_row))
            except SkipRow as e:
                skipped[str(e)] += 1
                continue
            except (KeyError, TypeError, ValueError) as e:
                raise DataError(
                    f"{where}: does not have the schema mmalign maps for {known.id} ({known.columns}): "
                    f"{type(e).__name__}: {e}; hub columns: {sorted(hub_row)}"
                ) from None
        for row in made:
            row["_source"] = where
            rows.append(row)
        if max_rows is not None and len(rows) >= max_rows:
            del rows[max_rows:]
            break
    if skipped:
        reasons = ", ".join(f"{n} with {r}" for r, n in skipped.most_common())
        log.warning("%s: left out %d hub row(s) (%s)", spec, sum(skipped.values()), reasons)
    if not rows:
        raise DataError(f"{spec}: no rows")
    return rows


def _jsonable(value: Any, key: str, where: str, save_image: Callable[[Any], str]) -> Any:
    """`value` of column `key` with in-memory images replaced by the paths `save_image` writes them to."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return save_image(value)
    if isinstance(value, list | tuple):
        return [_jsonable(v, key, where, save_image) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v, key, where, save_image) for k, v in value.items()}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise DataError(f"{where}: column {key!r} holds a {type(value).__name__}, which JSONL cannot hold")


def export_jsonl(spec: str, out: str | Path, max_rows: int | None = None) -> int:
    """Write the rows of the ``hf:`` source `spec` (as the pipelines read them: `load_hf_dataset`, with a known
    dataset's mapping) to the JSONL file `out`; in-memory images are written as PNG files into the folder
    ``<out stem>_images/`` next to it and named by paths relative to `out`'s folder (the pipelines' default
    image root). Returns the number of rows written."""
    out = Path(out)
    rows = load_hf_dataset(spec, max_rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    images = out.parent / f"{out.stem}_images"
    saved: dict[int, str] = {}

    def save_image(image: Any) -> str:
        if id(image) not in saved:  # rows made from one hub row share its image
            images.mkdir(exist_ok=True)
            name = f"{len(saved):06d}.png"
            image.save(images / name)
            saved[id(image)] = f"{images.name}/{name}"
        return saved[id(image)]

    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            where = str(row.pop("_source", spec))
            clean = {k: _jsonable(v, k, where, save_image) for k, v in row.items()}
            f.write(json.dumps(clean, ensure_ascii=False) + "\n")
    tmp.replace(out)
    return len(rows)


def add_prompts(rows: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """Set ``row["prompt"] = template.format(**row)``; a missing column is a DataError naming the row.

    With the default template ``"{question}"``, a row that already has a ``prompt`` column keeps it.
    """
    try:
        fields = [f for _, f, _, _ in Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise DataError(f"data.prompt_template {template!r} is not a valid format string: {e}") from None
    positional = [f for f in fields if not f or f.split(".")[0].split("[")[0].isdigit()]
    if positional:
        raise DataError(
            f"data.prompt_template {template!r}: every field must name a column, like {{question}} "
            f"(got {{{positional[0]}}})"
        )
    columns = {f.split(".")[0].split("[")[0] for f in fields}
    default = template == "{question}"
    for row in rows:
        if default and "prompt" in row:
            continue
        missing = sorted({c for c in columns if c not in row})
        if missing:
            have = sorted(k for k in row if not k.startswith("_"))
            if default:
                raise DataError(
                    f"{row.get('_source', '?')}: the row has no 'prompt' column (nor 'question', which the default "
                    f"data.prompt_template formats; row has: {have}); add one or set data.prompt_template"
                )
            raise DataError(
                f"{row.get('_source', '?')}: column(s) {missing} used by data.prompt_template are missing "
                f"(row has: {have})"
            )
        try:
            row["prompt"] = template.format(**row)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise DataError(
                f"{row.get('_source', '?')}: data.prompt_template {template!r} cannot format this row: "
                f"{type(e).__name__}: {e}"
            ) from None
    return rows


def load_text_prompts(
    path: str | Path, max_rows: int | None = None, max_line_bytes: int | None = None
) -> list[dict[str, Any]]:
    """A plain-text prompt list, one prompt per line -> rows ``{"prompt": line}``. Blank lines and lines
    starting with ``#`` are skipped; a line that is not UTF-8, or longer than `max_line_bytes`, is a DataError
    naming `path:line`."""
    path = Path(path)
    if not path.is_file():
        if path.is_dir():
            raise DataError(f"prompt file not found: {path} (it is a directory)")
        raise DataError(f"prompt file not found: {path}; {missing_data_hint(path)}")
    rows: list[dict[str, Any]] = []
    for lineno, raw in read_lines(path, max_line_bytes):
        line = _decode(path, lineno, raw, max_line_bytes).strip()
        if not line or line.startswith("#"):
            continue
        rows.append({"prompt": line, "_source": f"{path}:{lineno}"})
        if max_rows is not None and len(rows) >= max_rows:
            break
    if not rows:
        raise DataError(f"{path}: no prompts (the file is empty or only comments)")
    return rows


def load_rows(
    source: str,
    template: str = "{question}",
    max_rows: int | None = None,
    *,
    max_line_bytes: int | None = None,
) -> list[dict[str, Any]]:
    """Rows with a ``prompt`` from `source`: a JSONL file, ``hf:<dataset>[:<config>]:<split>``, or a ``.txt``
    file with one prompt per line (used as is: its rows have only a ``prompt`` column). A line of a file
    longer than `max_line_bytes` is a DataError naming ``FILE:LINE``."""
    if source.startswith("hf:"):
        rows = load_hf_dataset(source, max_rows)
    elif source.endswith(".txt"):
        return load_text_prompts(source, max_rows, max_line_bytes)
    else:
        rows = load_jsonl(source, max_rows, max_line_bytes)
    return add_prompts(rows, template)


def load_prompt_rows(source: str, template: str = "{question}") -> list[dict[str, Any]]:
    """`load_rows` for ad-hoc prompt files (`mmalign sample --prompts`): a JSONL row with a ``prompt``
    column keeps it whatever the template."""
    if source.endswith(".txt") or source.startswith("hf:"):
        return load_rows(source, template)
    rows = load_jsonl(source)
    if all("prompt" in r for r in rows):
        return rows
    return add_prompts(rows, template)


def main(argv: list[str] | None = None) -> int:
    """``python -m mmalign.data.rows export hf:<id>[:<config>]:<split> OUT.jsonl [--max-rows N]``: `export_jsonl`."""
    parser = argparse.ArgumentParser(prog="python -m mmalign.data.rows", description="Prompt data tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="write an hf: source's rows (as the pipelines read them) to JSONL")
    export.add_argument("source", help=HF_FORM)
    export.add_argument("out", help="the JSONL file to write (images go to <stem>_images/ next to it)")
    export.add_argument("--max-rows", type=int, default=None)
    args = parser.parse_args(argv)
    source = args.source if args.source.startswith("hf:") else f"hf:{args.source}"
    try:
        n = export_jsonl(source, args.out, args.max_rows)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {n} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
