"""Prompt data: JSONL files (or Hugging Face datasets) turned into rows with prompts.

Every row is a dict; all of its columns travel with the samples to the rewards. The prompt
text is made from the row with a format template (``"{question}"`` by default) and stored
under the key ``prompt``; a row that already has a ``prompt`` column keeps it when the template
is the default.

Files are read line by line and no line may be longer than `MAX_LINE_BYTES` (1 MiB): a longer one is a
DataError naming ``FILE:LINE`` before it is decoded, and the reader never holds more than about that much of
it (a 100 MB line would otherwise take hundreds of times its size in memory to decode).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from string import Formatter
from typing import Any

from mmalign.errors import MmalignError

MAX_LINE_BYTES = 1 << 20
"""The longest line (in bytes, without its line break) the prompt readers accept by default: 1 MiB, far more
than any prompt row (a context of 128k tokens is about 0.5 MB of text); image rows hold paths, not pixels.
Read at each call, so code may raise it (``mmalign.data.MAX_LINE_BYTES = ...``) before a run."""

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
        f"{path}:{lineno}: line longer than {max_line_bytes} bytes (mmalign.data.MAX_LINE_BYTES); "
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
        raise DataError(f"data file not found: {path}" + (" (it is a directory)" if path.is_dir() else ""))
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


def load_hf_dataset(spec: str, max_rows: int | None = None) -> list[dict[str, Any]]:
    """`hf:<name>[:<split>[:<config>]]` (a hub id, or a local `save_to_disk` folder) -> list of rows.

    Example: ``hf:openai/gsm8k:train:main``. Hub datasets need the network (or the local
    Hugging Face cache); a folder written by `Dataset.save_to_disk` works offline.
    """
    parts = spec.split(":")
    if len(parts) < 2 or not parts[1] or len(parts) > 4:
        raise DataError(f"{spec!r}: expected hf:<name>[:<split>[:<config>]]")
    name = parts[1]
    split = parts[2] if len(parts) > 2 and parts[2] else "train"
    config = parts[3] if len(parts) > 3 and parts[3] else None
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - optional dependency
        raise DataError(f"{spec}: the `datasets` package is needed for hf: data sources") from e
    try:
        ds = (
            datasets.load_from_disk(name)
            if Path(name).is_dir()
            else datasets.load_dataset(name, config, split=split)
        )
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"{spec}: no split {split!r} (has {sorted(ds)})")
            ds = ds[split]
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{spec}: cannot load the dataset: {type(e).__name__}: {e}") from e
    rows = []
    for i, row in enumerate(ds):
        row = dict(row)
        row["_source"] = f"{spec}[{i}]"
        rows.append(row)
        if max_rows is not None and len(rows) >= max_rows:
            break
    if not rows:
        raise DataError(f"{spec}: no rows")
    return rows


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
        raise DataError(f"prompt file not found: {path}" + (" (it is a directory)" if path.is_dir() else ""))
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
    """Rows with a ``prompt`` from `source`: a JSONL file, ``hf:<dataset>[:split[:config]]``, or a ``.txt``
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
