"""Helpers that several pipelines share: the typed options accessor, prompt and image-row loading, and the
keyword arguments / builders of the text and vision-language policies. Public: pipelines import these and
never each other's private names."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from mmalign.algorithms.names import needs_reference
from mmalign.config import Config
from mmalign.data.rollout_loops import Environment, loop_from_config
from mmalign.data.rows import DataError, add_prompts, line_too_long, load_rows, read_lines
from mmalign.policies.vlm import VLMPolicy

log = logging.getLogger(__name__)

OptionsT = TypeVar("OptionsT")


def options(cfg: Config, cls: type[OptionsT]) -> OptionsT:
    """The typed ``options:`` section of `cfg` as an instance of `cls` (`config_from_dict` validated it against
    the class the pipeline registered); defaults when the config has none. A config built by hand with another
    options object is a TypeError naming the class."""
    if isinstance(cfg.options, cls):
        return cfg.options
    if cfg.options is None:
        return cls()
    raise TypeError(f"{cfg.source}: options were not validated as {cls.__name__} (config built by hand?)")


def load_prompts(
    source: str, template: str = "{question}", max_rows: int | None = None
) -> list[dict[str, Any]]:
    """Prompt rows of a ``.txt`` file (one prompt per line; blank and ``#`` lines skipped) or JSONL /
    ``hf:`` rows (a ``prompt`` column, or `template` formatted from the row's columns), read by
    `mmalign.data.rows.load_rows`. Every row must end up with a non-empty string ``prompt``, else a DataError
    names the row (file:line)."""
    rows = load_rows(source, template, max_rows)
    for row in rows:
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataError(
                f"{row.get('_source', source)}: the prompt must be a non-empty string, got {prompt!r}"
            )
    return rows


def policy_kwargs(cfg: Config, environment: Environment | None = None) -> dict[str, Any]:
    """`from_pretrained` keyword arguments of a text-generating policy, from `cfg.model` and `cfg.rollout`
    (the rollout loop from ``rollout.loop`` / ``rollout.loop_kwargs``, with the pipeline's `environment`
    for a multi-turn loop; a bad loop name or option is a `ConfigError` naming the key)."""
    m, r = cfg.model, cfg.rollout
    return dict(
        loop=loop_from_config(cfg, environment),
        dtype=m.dtype,
        lora=m.lora,
        gradient_checkpointing=m.gradient_checkpointing,
        attn_implementation=m.attn_implementation,
        trust_remote_code=m.trust_remote_code,
        need_reference=needs_reference(cfg),
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        stop_strings=r.stop_strings,
        system_prompt=m.system_prompt,
        generation_batch_size=r.batch_size,
        logprob_chunk_size=m.logprob_chunk_size,
        logprob_memory_mb=m.logprob_memory_mb,
        sampler=r.sampler,
    )


@dataclass
class VLMOptions:
    image_root: str | None = None
    """Folder that relative image paths are resolved against (default: the JSONL file's folder)."""
    min_pixels: int | None = None
    """Smallest image size (pixels) after the processor's resize (None: the processor's own)."""
    max_pixels: int | None = None
    """Largest image size (pixels) after the processor's resize (None: the processor's own)."""
    freeze_vision: bool = False
    """Keep the vision tower fixed (full fine-tuning; under LoRA it has no adapters anyway)."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A malformed row, a missing image file or one that does not decode (truncated, corrupt): stop with an
    error naming file:line, or skip the row (each logged, then counted). ``error``: the validation pass decodes
    the images for up to 20 s before any model loads; ``skip``: every image is decoded once when the data is
    loaded, to find the bad ones."""


def vlm_options(cfg: Config) -> VLMOptions:
    """The typed `options:` section as `VLMOptions`."""
    return options(cfg, VLMOptions)


def _image_paths(value: Any, key: str, where: str) -> list[Any]:
    """Paths (str) or in-memory PIL images (as `datasets` image columns give them), as a list."""
    from PIL import Image

    if value is None:
        return []
    if isinstance(value, str | Image.Image):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str | Image.Image) for v in value):
        return list(value)
    raise DataError(
        f"{where}: column {key!r} must be a path, an image or a list of them, got {str(value)[:80]}"
    )


def resolve_row(row: dict[str, Any], root: Path) -> dict[str, Any]:
    """Resolve ``images`` / ``video`` paths against `root`; a DataError names the row's file:line."""
    where = row.get("_source", "?")
    images = _image_paths(row.get("images", row.get("image")), "images", where)
    frames = _image_paths(row.get("video"), "video", where)
    if not images and not frames:
        raise DataError(f"{where}: the row has no 'images' (or 'video') column")
    out = dict(row)
    for key, paths in (("images", images), ("video", frames)):
        if not paths:
            continue
        resolved = []
        for p in paths:
            if not isinstance(p, str):  # an image already in memory (Hugging Face datasets)
                resolved.append(p)
                continue
            full = Path(p) if Path(p).is_absolute() else root / p
            if not full.is_file():
                raise DataError(f"{where}: image file not found: {full}")
            resolved.append(str(full))
        out[key] = resolved
    out.pop("image", None)
    return out


IMAGE_COLUMNS = ("images", "image", "video")
"""Row columns that may hold image files (a path or a list of paths; ``video``: its frames, or a video file)."""


def image_files(
    row: dict[str, Any], root: Path | None = None, columns: Sequence[str] = IMAGE_COLUMNS
) -> list[str]:
    """The image files `row` names in `columns` that exist (relative paths against `root`, default: the working
    directory), each once: paths ending in one of `mmalign.data.media.IMAGE_SUFFIXES`. Images in memory, other files
    (a video, a ``.npz`` frame), folders and missing files (the loader's error) are left out."""
    from mmalign.data.media import IMAGE_SUFFIXES

    out: list[str] = []
    for key in columns:
        value = row.get(key)
        for p in value if isinstance(value, list) else [value]:
            if not isinstance(p, str) or Path(p).suffix.lower() not in IMAGE_SUFFIXES:
                continue
            full = Path(p) if Path(p).is_absolute() or root is None else root / p
            if full.is_file() and str(full) not in out:
                out.append(str(full))
    return out


def image_problem(path: str | Path) -> str | None:
    """Why the image file at `path` cannot be decoded (PIL's ``Image.open`` and ``load``: a truncated or corrupt
    file, not an image), as ``"ErrorType: message"``; None when it decodes."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.load()
    except Exception as e:  # noqa: BLE001 - PIL raises OSError, SyntaxError, ValueError, DecompressionBombError...
        return f"{type(e).__name__}: {e}"
    return None


def bad_image_message(where: str, path: str, problem: str) -> str:
    """The message of a row whose image does not decode: the row's file:line, the image, what PIL said."""
    return f"{where}: image {path} cannot be decoded ({problem}); replace the file or remove the row"


def resolve_path_columns(
    row: dict[str, Any], root: Path, columns: Sequence[str], required: str, what: str
) -> dict[str, Any]:
    """`row` with each of its path `columns` (files or folders) resolved against `root` and checked to exist;
    `required` must be present (`what` says what it holds). A `DataError` names the row's file:line and the
    column (the video pipelines' rows)."""
    where = row.get("_source", "?")
    if not row.get(required):
        raise DataError(f"{where}: the row has no {required!r} column ({what})")
    out = dict(row)
    for key in columns:
        value = row.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise DataError(f"{where}: column {key!r} must be a path, got {str(value)[:80]!r}")
        full = Path(value) if Path(value).is_absolute() else root / value
        if not full.exists():
            raise DataError(f"{where}: column {key!r}: no such file or folder: {full}")
        out[key] = str(full)
    return out


def load_vlm_rows(
    source: str, template: str, opts: VLMOptions, max_rows: int | None = None
) -> list[dict[str, Any]]:
    """Rows of `source` with resolved image paths; bad rows raise or are skipped per ``opts.on_bad_row``."""
    return load_resolved_rows(source, template, resolve_row, opts.image_root, opts.on_bad_row, max_rows)


def load_resolved_rows(
    source: str,
    template: str,
    resolve: Callable[[dict[str, Any], Path], dict[str, Any]],
    root: str | None,
    on_bad_row: str,
    max_rows: int | None = None,
) -> list[dict[str, Any]]:
    """Rows of `source` passed through ``resolve(row, root)`` (which resolves a row's file paths against `root`,
    default: the JSONL file's folder, the working directory for ``hf:`` sources, and raises `DataError` for a
    bad row). ``on_bad_row == "error"``: the first bad row raises; ``"skip"``: bad rows (unparsable lines
    included, and rows whose image files do not decode: `image_problem` on each of `image_files`) are skipped,
    each logged, with a count at the end. No usable row left is a DataError."""
    if root:
        base = Path(root)
    else:
        base = Path.cwd() if source.startswith("hf:") else Path(source).resolve().parent
    try:
        rows = load_rows(source, template, max_rows)
    except DataError:
        if on_bad_row == "error" or source.startswith("hf:"):  # skipping reads local JSONL line by line
            raise
        rows = load_rows_skipping(source, template, max_rows)
    out, skipped = [], int(getattr(rows, "skipped", 0))
    for row in rows:
        try:
            resolved = resolve(row, base)
            if (
                on_bad_row == "skip"
            ):  # find the images that do not decode (the validation pass does, for "error")
                for path in image_files(resolved):
                    problem = image_problem(path)
                    if problem is not None:
                        raise DataError(bad_image_message(str(row.get("_source", "?")), path, problem))
            out.append(resolved)
        except DataError as e:
            if on_bad_row == "error":
                raise
            skipped += 1
            log.warning("skipping a bad row: %s", e)
    if skipped:
        log.warning(
            "%s: skipped %d bad row(s) of %d (options.on_bad_row: skip)", source, skipped, len(out) + skipped
        )
    if not out:
        raise DataError(f"{source}: no usable rows")
    return out


class _Rows(list):
    skipped = 0


def load_rows_skipping(source: str, template: str, max_rows: int | None) -> list[dict[str, Any]]:
    """Line by line (`mmalign.data.rows.read_lines`): a line that is too long, not UTF-8, not a JSON object or lacks
    a prompt column is skipped and logged (its file:line); the count is the list's ``skipped``."""
    rows = _Rows()
    for lineno, raw in read_lines(source):
        where = f"{source}:{lineno}"
        try:
            if raw is None:
                raise line_too_long(source, lineno)
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict):
                raise DataError(f"{where}: each line must be a JSON object, got {type(row).__name__}")
            row["_source"] = where
            add_prompts([row], template)
        except (UnicodeDecodeError, json.JSONDecodeError, DataError) as e:
            rows.skipped += 1
            log.warning("skipping a bad row: %s: %s", where, e)
            continue
        rows.append(row)
        if max_rows is not None and len(rows) >= max_rows:
            break
    return rows


def build_vlm_policy(cfg: Config, environment: Environment | None = None) -> VLMPolicy:
    """The `VLMPolicy` described by `cfg.model`, `cfg.rollout` and the `options:` section
    (``model.shared_prefix``: the shared-prefix log-prob forward where the model family supports it;
    ``rollout.loop``: ``single_turn`` or ``multi_turn`` with the pipeline's `environment` or
    ``rollout.loop_kwargs.environment``)."""
    opts = vlm_options(cfg)
    kwargs = policy_kwargs(cfg, environment)  # checks the rollout loop before the model is built or loaded
    path = cfg.model.name_or_path
    return VLMPolicy.from_pretrained(
        path,
        min_pixels=opts.min_pixels,
        max_pixels=opts.max_pixels,
        freeze_vision=opts.freeze_vision,
        shared_prefix=cfg.model.shared_prefix,
        **kwargs,
    )
