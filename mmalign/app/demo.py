"""`mmalign demo RUN_DIR [RUN_DIR ...]`: a Gradio app that browses the samples of runs (the ``demo`` extra).

Every file it reads or shows must resolve inside its run directory, and live generation refuses a config
that names code unless ``--trust-run-code``.

Details: docs/demo.md, "mmalign.app.demo".
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

from mmalign.training import rundir

log = logging.getLogger(__name__)

__all__ = [
    "WATCHDOG_CURVES",
    "DEMO_MAX_BYTES",
    "DEMO_MAX_GENERATIONS",
    "DEMO_SAMPLES_DIR",
    "MAX_PANELS",
    "MAX_PROMPTS",
    "MAX_SAMPLES_PER_PROMPT",
    "UntrustedRunCode",
    "box_annotations",
    "build_app",
    "checked_path",
    "checkpoint_choices",
    "curve_rows",
    "default_curve_keys",
    "demo_main",
    "diagnostic_panels",
    "find_group",
    "generate_samples",
    "group_overview",
    "input_image",
    "launch_app",
    "list_groups",
    "list_steps",
    "load_group",
    "mask_secrets",
    "media_items",
    "metric_keys",
    "metrics_rows",
    "open_checked",
    "outline_masks",
    "predicted_boxes",
    "prompt_columns",
    "prune_demo_samples",
    "reward_names",
    "reward_table",
    "run_code_problems",
    "run_status",
    "sample_layout",
    "score_generated",
    "score_summary",
    "served_copy",
    "served_paths",
    "split_prompts",
]

DEMO_SAMPLES_DIR = "demo_samples"
"""Where on-demand generations are written, inside the run directory (``RUN_DIR/demo_samples/<key>/``)."""

MAX_SAMPLES_PER_PROMPT = 16
"""The most samples per prompt one generation request may ask (``n``); more is refused."""

MAX_PROMPTS = 16
"""The most prompts one generation request may hold; more is refused."""

DEMO_MAX_BYTES = 200 * 2**20
"""``demo_samples/`` of a run is pruned (oldest generations first) to at most this many bytes..."""

DEMO_MAX_GENERATIONS = 50
"""... and at most this many generations; the two generations of the last request are always kept."""

MAX_PANELS = 12
"""The most diagnostic panels the Curves tab draws (one small plot per metric); more keys are not drawn."""

PANEL_COLUMNS = 3
"""Diagnostic panels per row of the Curves tab's grid."""

INPUT_IMAGE_KEYS = ("images", "image_path", "input_image")
"""Columns of a sample row that may name its INPUT image (grounding: ``images`` = [one path]); the boxes are
drawn on it. Only image files are read (`IMAGE_SUFFIXES`), server-side, and shown as pixels."""

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".gif"})

MEDIA_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".gif", ".mp4", ".webm"})
"""The kinds of file the app shows (and so hands to Gradio to serve): images, videos, frame strips."""

SECRET_KEY = re.compile(r"header|token|secret|key|passw|auth|credential|cookie", re.IGNORECASE)
"""A config key whose value is never shown (`mask_secrets`): headers, tokens, API keys, passwords..."""

NOT_SECRET_KEY = re.compile(r"tokens$|tokenizer|keyframe", re.IGNORECASE)
"""... except counts and names that only look like one (``max_new_tokens``, ``tokenizer``)."""

MEDIA_KEYS = ("image", "video", "video_frames")
STANDARD_KEYS = {"group", "prompt", "advantage", "rewards", "text", "boxes", "env_state", *MEDIA_KEYS}
DIAGNOSTIC_KEYS = (
    "loss",
    "kl",
    "clip_frac",
    "approx_kl",
    "grad_norm",
    "zero_std_frac",
    "adv/abs_mean",
    "completion_len/mean",
    "truncated_frac",
)


# ============================================================================= data layer


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def run_label(run_dir: str | Path) -> str:
    """The name a run is shown under: its folder name."""
    return Path(run_dir).name or str(run_dir)


def _is_media(path: Any) -> bool:
    """`path` names an existing image or video file (`MEDIA_SUFFIXES`): the only files the app shows."""
    return path is not None and Path(path).suffix.lower() in MEDIA_SUFFIXES and Path(path).is_file()


# ----------------------------------------------------------------------------- the path rule

_WARNED: set[str] = set()
"""Warnings already logged: each is logged once, not at every refresh of the app."""


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning("%s", message)


def _refuse(path: Any, run: Path, what: str, why: str) -> None:
    """Log (once) that `what` `path` of `run` is refused, and why."""
    _warn_once(f"refused {what} {path} of run {run}: {why}")


def checked_path(
    run_dir: str | Path, path: str | Path, what: str = "file", data_roots: Sequence[str | Path] = ()
) -> Path | None:
    """`path` resolved (``Path.resolve(strict=True)``: every symbolic link followed) when it exists and lies
    inside the resolved `run_dir` (or one of `data_roots`, resolved); None when it does not exist, and None
    with a logged warning naming it and the run when it resolves anywhere else (the path rule of the demo)."""
    run = Path(run_dir).resolve()
    try:
        real = Path(path).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, a dangling link, a loop
        return None
    roots = [run, *(Path(r).resolve() for r in data_roots)]
    if any(real.is_relative_to(root) for root in roots):
        return real
    _refuse(path, run, what, f"it resolves to {real}, outside the run directory")
    return None


def open_checked(
    run_dir: str | Path, path: str | Path, what: str = "file", data_roots: Sequence[str | Path] = ()
) -> IO[bytes] | None:
    """`path` opened for reading (binary) when it is a regular file that passes `checked_path`; the file
    actually opened is checked again (through ``/proc/self/fd`` where there is one), so a link swapped in
    between is refused too. None (logged when refused) otherwise; a FIFO or device is never opened blocking."""
    real = checked_path(run_dir, path, what, data_roots)
    if real is None:
        return None
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            _refuse(path, Path(run_dir).resolve(), what, "not a regular file")
            os.close(fd)
            return None
        proc = Path(f"/proc/self/fd/{fd}")
        if proc.is_symlink():
            opened = Path(os.readlink(proc))
            roots = [Path(run_dir).resolve(), *(Path(r).resolve() for r in data_roots)]
            if not any(opened.is_relative_to(root) for root in roots):
                _refuse(path, roots[0], what, f"the file opened is {opened}, outside the run directory")
                os.close(fd)
                return None
        return os.fdopen(fd, "rb")
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def _read_checked(run_dir: str | Path, path: str | Path, what: str) -> str | None:
    """The text of `path` (`open_checked`; undecodable bytes replaced), or None."""
    f = open_checked(run_dir, path, what)
    if f is None:
        return None
    with f:
        return f.read().decode("utf-8", errors="replace")


_COPIES: list[Path] = []
"""The folder of `served_copy` (made on first use, removed at exit)."""
_COPIES_LOCK = threading.Lock()


def _copies_dir() -> Path:
    with _COPIES_LOCK:
        if not _COPIES:
            folder = Path(tempfile.mkdtemp(prefix="mmalign-demo-"))
            atexit.register(shutil.rmtree, folder, True)
            _COPIES.append(folder)
        return _COPIES[0]


def served_copy(
    run_dir: str | Path, path: str | Path, what: str = "media file", data_roots: Sequence[str | Path] = ()
) -> str | None:
    """What the app hands Gradio for an image or video of a run: a copy of `path`, read through
    `open_checked`, in a private temporary folder (Gradio copies it into its cache and serves that); None when
    `path` is refused (the path rule), missing, or no `MEDIA_SUFFIXES` file. Gradio never gets a path of a run,
    so a link in the run cannot make it serve anything else. Copies are reused while the file is unchanged."""
    if path is None or Path(path).suffix.lower() not in MEDIA_SUFFIXES:
        return None
    f = open_checked(run_dir, path, what, data_roots)
    if f is None:
        return None
    with f:
        st = os.fstat(f.fileno())
        key = hashlib.sha256(f"{Path(path).resolve()}\0{st.st_mtime_ns}\0{st.st_size}".encode()).hexdigest()
        dest = _copies_dir() / f"{key[:32]}{Path(path).suffix.lower()}"
        if not dest.is_file():
            tmp = dest.with_name(f".{dest.name}.{threading.get_ident()}")
            with open(tmp, "wb") as out:
                shutil.copyfileobj(f, out)
            os.replace(tmp, dest)
    return str(dest)


def served_paths(run_dirs: Sequence[str | Path]) -> tuple[list[str], list[str]]:
    """``(allowed_paths, blocked_paths)`` for Gradio: nothing is allowed (the app hands Gradio copies of the
    checked media, `served_copy`, which Gradio serves from its own cache), and every resolved run directory is
    blocked, so Gradio's file route serves no file of a run (``config.yaml``, checkpoints, a link to ``/etc``),
    nor copies one into its cache. A run directory that holds the temporary folders Gradio needs (its cache,
    `served_copy`'s folder: ``mmalign demo /tmp``) is not blocked; nothing of it is allowed either."""
    needed = [Path(tempfile.gettempdir()).resolve()]  # (`served_copy`'s folder is made in it)
    if os.environ.get("GRADIO_TEMP_DIR"):
        needed.append(Path(os.environ["GRADIO_TEMP_DIR"]).resolve())
    blocked = []
    for r in run_dirs:
        run = Path(r).resolve()
        if not any(n.is_relative_to(run) for n in needed):
            blocked.append(str(run))
    return [], blocked


# ----------------------------------------------------------------------------- the trust model

MODULE_PATH = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
"""The shape of an explicit import path, ``package.module:attr`` (`mmalign.registry.import_path`)."""

TRUST_HINT = (
    "the demo imports no code a served run names. If you trust this run folder, restart the demo with "
    "`mmalign demo RUN_DIR --trust-run-code` (from Python: launch_app(..., trust_run_code=True))"
)


class UntrustedRunCode(ValueError):
    """Live generation or scoring refused: the run's config names code to import (`run_code_problems`) and the
    demo was not started with ``--trust-run-code``. The message names the file, key and value and the flag."""


def _importable(spec: str) -> bool:
    """Whether the top-level package of ``package.module:attr`` can be imported here (found on ``sys.path``;
    nothing is imported to find out). One that cannot be imported runs no code."""
    top = spec.partition(":")[0].split(".")[0]
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def _config_strings(value: Any, key: str = "") -> Iterable[tuple[str, Any]]:
    """``(key path, value)`` of every leaf of a config (``rewards[0].name``)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _config_strings(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _config_strings(v, f"{key}[{i}]")
    else:
        yield key, value


def _folder_class(value: str) -> str | None:
    """The ``"class"`` of ``<value>/config.json`` when `value` names a folder holding one with an import path
    (a saved geometry model: `rewards.geometry_model.load_geometry_model` imports it)."""
    config = Path(value).expanduser() / "config.json"
    try:
        if not config.is_file() or config.stat().st_size > 1_000_000:
            return None
        cls = json.loads(config.read_text()).get("class")
    except (OSError, ValueError, AttributeError):
        return None
    return cls if isinstance(cls, str) and MODULE_PATH.fullmatch(cls) else None


def run_code_problems(run_dir: str | Path) -> list[str]:
    """What in the run's ``config.yaml`` would import or run code when the demo builds its pipeline and
    rewards: a value ``package.module:attr`` whose package can be imported here (a reward, an environment,
    anything not a registered name or installed entry point, which are plain names), a saved folder whose
    ``config.json`` names such a class, a true ``trust_remote_code`` (the model folder's own Python). Each
    item names the file, the key and the value. Empty: only registered names."""
    run = Path(run_dir).resolve()
    config = run / rundir.CONFIG_FILE
    out = []
    for key, value in _config_strings(_run_config(run)):
        where = f"{config}: key {key!r}"
        if key.rsplit(".", 1)[-1] == "trust_remote_code" and value is True:
            out.append(f"{where} is true (it runs the model folder's own Python code)")
        elif isinstance(value, str) and MODULE_PATH.fullmatch(value) and _importable(value):
            out.append(f"{where} names the module path {value!r} (package.module:attr, imported to build it)")
        elif isinstance(value, str) and (cls := _folder_class(value)) and _importable(cls):
            out.append(f"{where}: folder {value!r} names the class {cls!r} in its config.json (imported)")
    return out


def _check_run_code(run_dir: str | Path, trust_run_code: bool) -> None:
    """Raise `UntrustedRunCode` when the run's config names code to import and the operator did not opt in."""
    if trust_run_code:
        return
    problems = run_code_problems(run_dir)
    if problems:
        raise UntrustedRunCode(
            f"refused to build the run's pipeline and rewards: {'; '.join(problems)}. {TRUST_HINT}"
        )


def _is_secret_key(key: Any) -> bool:
    return bool(SECRET_KEY.search(str(key))) and not NOT_SECRET_KEY.search(str(key))


def mask_secrets(value: Any) -> Any:
    """`value` (a config, or part of one) with the values of secret-looking keys (`SECRET_KEY`: headers,
    token, secret, key, password, ...) replaced by ``"***"``, at any depth."""
    if isinstance(value, dict):
        return {k: "***" if _is_secret_key(k) else mask_secrets(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [mask_secrets(v) for v in value]
    return value


def _secret_strings(value: Any, secret: bool = False) -> set[str]:
    """Every string (of at least 4 characters) under a secret-looking key of `value`."""
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            out |= _secret_strings(v, secret or _is_secret_key(k))
    elif isinstance(value, list | tuple):
        for v in value:
            out |= _secret_strings(v, secret)
    elif secret and isinstance(value, str) and len(value) >= 4:
        out.add(value)
        out.update(w for w in value.split() if len(w) >= 8)  # "Bearer <token>": the token alone too
    return out


def _scrub(text: str, run_dir: str | Path) -> str:
    """`text` (an error message shown in the UI) with the secret values of the run's config masked."""
    for secret in sorted(_secret_strings(_run_config(run_dir)), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def _samples_dir(run_dir: str | Path) -> Path | None:
    """The run's ``samples/`` folder when it exists and resolves inside the run (`checked_path`), else None."""
    real = checked_path(run_dir, Path(run_dir) / rundir.SAMPLES_DIR, "samples folder")
    return real if real is not None and real.is_dir() else None


def list_steps(run_dir: str | Path) -> list[int]:
    """The steps of `run_dir` that logged samples, oldest first (read again on every call); none when its
    ``samples/`` resolves outside the run."""
    return rundir.sample_steps(run_dir) if _samples_dir(run_dir) is not None else []


def _checked_media(run_dir: str | Path, row: dict[str, Any], root: Path) -> dict[str, Any]:
    """`row` with its media paths (`MEDIA_KEYS`, relative to `root`) absolute and resolved when they pass the
    path rule (`checked_path`), None when they are refused (logged) or missing."""
    for key in MEDIA_KEYS:
        value = row.get(key)
        if isinstance(value, str | Path):
            row[key] = checked_path(run_dir, root / value, f"{key} of a sample row")
    return row


def _rows(run_dir: str | Path, step: int) -> list[dict[str, Any]]:
    """A step's sample rows, each with its ``index`` in the file and its media checked (`_checked_media`); []
    when the step has none (yet) or its file is refused (the path rule)."""
    root = _samples_dir(run_dir)
    if root is None:
        return []
    text = _read_checked(run_dir, rundir.samples_file(run_dir, step), "samples file")
    if text is None:
        return []
    try:
        rows = [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    except json.JSONDecodeError:  # being written
        return []
    rows = [r for r in rows if isinstance(r, dict)]
    for i, row in enumerate(rows):
        _checked_media(run_dir, row, root)
        row["index"] = i
    return rows


def list_groups(run_dir: str | Path, step: int) -> list[tuple[int, str]]:
    """``(group, prompt)`` of every group of a step, in group order."""
    seen: dict[int, str] = {}
    for row in _rows(run_dir, step):
        seen.setdefault(int(row.get("group", 0)), str(row.get("prompt", "")))
    return sorted(seen.items())


def load_group(run_dir: str | Path, step: int, group: int) -> list[dict[str, Any]]:
    """The sample rows of one group (media paths absolute, inside the run directory), in file order."""
    return [r for r in _rows(run_dir, step) if int(r.get("group", 0)) == int(group)]


def find_group(run_dir: str | Path, step: int, prompt: str) -> int | None:
    """The group of `step` whose prompt is `prompt` (to put two runs side by side), or None."""
    for g, p in list_groups(run_dir, step):
        if p == prompt:
            return g
    return None


def reward_names(samples: Sequence[dict[str, Any]]) -> list[str]:
    """The reward components of the samples, in the order the run logged them."""
    names: list[str] = []
    for s in samples:
        for n in s.get("rewards") or {}:
            if n not in names:
                names.append(n)
    return names


def reward_table(
    samples: Sequence[dict[str, Any]], text_chars: int = 300
) -> tuple[list[str], list[list[Any]]]:
    """Headers and rows of a group's table: sample index, each reward component, the advantage, and the
    text (cut at `text_chars`) when the samples have one."""
    names = reward_names(samples)
    has_text = any(isinstance(s.get("text"), str) for s in samples)
    headers = ["sample", *names, "advantage"] + (["text"] if has_text else [])
    rows = []
    for k, s in enumerate(samples):
        rewards = s.get("rewards") or {}
        row: list[Any] = [k, *[_fmt(rewards.get(n)) for n in names], _fmt(s.get("advantage"))]
        if has_text:
            text = str(s.get("text") or "")
            row.append(text if len(text) <= text_chars else text[:text_chars] + "...")
        rows.append(row)
    return headers, rows


def _mean(values: list[Any]) -> float:
    vals = [float(v) for v in values if isinstance(v, int | float) and not math.isnan(float(v))]
    return sum(vals) / len(vals) if vals else math.nan


def group_overview(
    run_dir: str | Path, step: int, prompt_chars: int = 80
) -> tuple[list[str], list[list[Any]]]:
    """Headers and rows of a step's groups: group, samples, mean of each reward, mean |advantage|, prompt."""
    rows = _rows(run_dir, step)
    names = reward_names(rows)
    by_group: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_group.setdefault(int(r.get("group", 0)), []).append(r)
    headers = ["group", "samples", *[f"{n} (mean)" for n in names], "|advantage| (mean)", "prompt"]
    out = []
    for g, members in sorted(by_group.items()):
        prompt = str(members[0].get("prompt", ""))
        out.append(
            [
                g,
                len(members),
                *[_fmt(_mean([(m.get("rewards") or {}).get(n) for m in members])) for n in names],
                _fmt(_mean([abs(a) for m in members if isinstance(a := m.get("advantage"), int | float)])),
                prompt if len(prompt) <= prompt_chars else prompt[:prompt_chars] + "...",
            ]
        )
    return headers, out


def _caption(k: int, s: dict[str, Any]) -> str:
    rewards = s.get("rewards") or {}
    parts = [f"sample {k}"] + [f"{n}={_fmt(v, 3)}" for n, v in rewards.items()]
    if "advantage" in s:
        parts.append(f"adv={_fmt(s.get('advantage'), 3)}")
    return " | ".join(parts)


def media_items(samples: Sequence[dict[str, Any]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(images, videos)``: per sample that has one, ``(path, caption)`` of its image (or, for a video, its
    frame strip) and of its mp4; the caption names the sample, its rewards and advantage. Only image and
    video files (`MEDIA_SUFFIXES`) that exist are listed."""
    images, videos = [], []
    for k, s in enumerate(samples):
        cap = _caption(k, s)
        still = s.get("image") or s.get("video_frames")
        if _is_media(still):
            images.append((str(still), cap))
        if _is_media(s.get("video")):
            videos.append((str(s["video"]), cap))
    return images, videos


def _run_config(run_dir: str | Path) -> dict[str, Any]:
    """The run's ``config.yaml`` as read (server-side only); {} when missing, unreadable or refused."""
    text = _read_checked(run_dir, Path(run_dir) / rundir.CONFIG_FILE, "config")
    if text is None:
        return {}
    import yaml

    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError:
        return {}
    return config if isinstance(config, dict) else {}


def box_coords(run_dir: str | Path) -> str:
    """How the run's model writes boxes: the ``coords`` option of its first box reward ("absolute")."""
    for spec in _run_config(run_dir).get("rewards") or []:
        if isinstance(spec, dict) and str(spec.get("name", "")).startswith(("box_", "iou_")):
            coords = (spec.get("kwargs") or {}).get("coords")
            if coords:
                return str(coords)
    return "absolute"


def _size(row: dict[str, Any], w: str, h: str) -> tuple[float, float] | None:
    try:
        return float(row[w]), float(row[h])
    except (KeyError, TypeError, ValueError):
        return None


def predicted_boxes(sample: dict[str, Any], coords: str = "absolute") -> tuple[list[list[float]], bool]:
    """The boxes a sample predicts and whether they are in pixels of the original image: ``env_state``'s
    ``answer_box`` (GeoViS, original pixels), else the boxes parsed from its text
    (`rewards.boxes.parse_boxes`), converted from `coords` when the row carries the image sizes."""
    from rewards.boxes import order_box, parse_boxes, resolve_convention, to_absolute

    state = sample.get("env_state")
    if isinstance(state, dict) and state.get("answer_box") is not None:
        box = order_box(state["answer_box"])
        return ([list(box)] if box else []), True
    text = sample.get("text")
    if not isinstance(text, str):
        return [], True
    boxes = [list(b) for b in parse_boxes(text)]
    convention = resolve_convention(coords)
    if convention == "absolute" or not boxes:
        return boxes, True
    original = _size(sample, "image_width", "image_height")
    resized = _size(sample, "resized_width", "resized_height")
    try:
        return [list(to_absolute(b, convention, original, resized)) for b in boxes], True
    except (ValueError, TypeError):
        return boxes, False  # sizes unknown: drawn as written


def _reference_boxes(sample: dict[str, Any]) -> list[list[float]]:
    ref = sample.get("boxes")
    if ref is None:
        ref = sample.get("box")
    if not isinstance(ref, list) or not ref:
        return []
    if all(isinstance(v, int | float) for v in ref):
        ref = [ref]
    return [list(map(float, b)) for b in ref if isinstance(b, list | tuple) and len(b) == 4]


def input_image(
    sample: dict[str, Any], run_dir: str | Path, data_roots: Sequence[str | Path] = ()
) -> Path | None:
    """The input image a sample row of `run_dir` names (`INPUT_IMAGE_KEYS`: grounding rows carry ``images`` =
    [its path]), resolved, when it is an existing image file inside the run directory or one of `data_roots`
    (`checked_path`: anything else is refused and logged); else None."""
    for key in INPUT_IMAGE_KEYS:
        value = sample.get(key)
        if isinstance(value, list | tuple):
            value = value[0] if len(value) == 1 else None
        if isinstance(value, str | Path) and Path(value).suffix.lower() in IMAGE_SUFFIXES:
            real = checked_path(run_dir, value, f"input image ({key})", data_roots)
            if real is not None and real.is_file():
                return real
    return None


def _load_input_image(run_dir: str | Path, path: Path, data_roots: Sequence[str | Path] = ()) -> Any:
    """The uint8 ``[H, W, 3]`` pixels of `path`, read through `open_checked`, or None when it cannot be read
    or is refused."""
    import numpy as np
    from PIL import Image

    f = open_checked(run_dir, path, "image", data_roots)
    if f is None:
        return None
    try:
        with f, Image.open(f) as im:
            return np.asarray(im.convert("RGB"))
    except (OSError, ValueError, Image.DecompressionBombError):
        return None


def box_annotations(
    sample: dict[str, Any],
    coords: str = "absolute",
    *,
    run_dir: str | Path | None = None,
    data_roots: Sequence[str | Path] = (),
) -> tuple[Any, list[tuple[tuple[int, int, int, int], str]]] | None:
    """``(base image, [(box, "reference" | "predicted"), ...])`` for `gr.AnnotatedImage`, or None without a
    box. The base is the sample's image (its path, checked when the row was read) when it has one, else, with
    `run_dir`, its input image (`input_image`: a grounding row's ``images`` inside the run or `data_roots`,
    read here and handed over as pixels, scaled to 256..1024 px), else a grey canvas large enough for the
    boxes. The input image's size stands in for ``image_width`` / ``image_height`` when the row lacks them
    (to convert the predicted boxes)."""
    import numpy as np

    pixels = None
    image = sample.get("image")
    path = input_image(sample, run_dir, data_roots) if run_dir is not None and not _is_media(image) else None
    if path is not None:
        pixels = _load_input_image(run_dir, path, data_roots)  # type: ignore[arg-type]
        if pixels is not None and _size(sample, "image_width", "image_height") is None:
            sample = {**sample, "image_width": pixels.shape[1], "image_height": pixels.shape[0]}
    refs = _reference_boxes(sample)
    preds, converted = predicted_boxes(sample, coords)
    if not refs and not preds:
        return None
    labels = [(b, "reference") for b in refs] + [
        (b, "predicted" if converted else f"predicted ({coords})") for b in preds
    ]
    base: Any = None
    scale = 1.0
    if _is_media(image):
        base = str(image)
    elif pixels is not None:
        from PIL import Image

        h, w = pixels.shape[:2]
        scale = max(1.0, 256.0 / max(w, h)) if max(w, h) <= 1024 else 1024.0 / max(w, h)
        size = (max(int(round(w * scale)), 1), max(int(round(h * scale)), 1))
        resample = Image.Resampling.NEAREST if scale >= 1 else Image.Resampling.BILINEAR
        base = np.asarray(Image.fromarray(pixels).resize(size, resample))
    else:
        size = _size(sample, "image_width", "image_height")
        w = size[0] if size else max(max(b[2] for b, _ in labels), 1.0) * 1.15
        h = size[1] if size else max(max(b[3] for b, _ in labels), 1.0) * 1.15
        scale = max(1.0, 256.0 / max(w, h))  # small images (tiny runs) drawn larger
        w, h = int(min(max(w * scale, 16), 4096)), int(min(max(h * scale, 16), 4096))
        base = np.full((h, w, 3), 48, dtype=np.uint8)
    out = []
    for b, label in labels:
        x1, y1, x2, y2 = (int(round(v * scale)) for v in b)
        out.append(((max(x1, 0), max(y1, 0), max(x2, x1 + 1), max(y2, y1 + 1)), label))
    return base, out


def outline_masks(ann: tuple[Any, list[tuple[tuple[int, int, int, int], str]]]) -> tuple[Any, list[Any]]:
    """`box_annotations` as `gr.AnnotatedImage` shows them: each box an outline mask (its frame opaque, its
    inside tinted lightly), so the input image stays visible inside the boxes (Gradio's own box annotation
    fills the box half opaque)."""
    import numpy as np

    base, boxes = ann
    if isinstance(base, np.ndarray):
        h, w = base.shape[:2]
    else:
        from PIL import Image

        with Image.open(base) as im:
            w, h = im.size
    t = max(2, round(min(h, w) / 128))
    out = []
    for (x1, y1, x2, y2), label in boxes:
        x1, x2, y1, y2 = min(x1, w - 1), min(x2, w), min(y1, h - 1), min(y2, h)
        mask = np.zeros((h, w), dtype=np.float32)
        mask[y1:y2, x1:x2] = 0.08
        for sl in (
            np.s_[y1:y2, x1 : x1 + t],
            np.s_[y1:y2, max(x2 - t, x1) : x2],
            np.s_[y1 : y1 + t, x1:x2],
            np.s_[max(y2 - t, y1) : y2, x1:x2],
        ):
            mask[sl] = 1.0
        out.append((mask, label))
    return base, out


def sample_layout(samples: Sequence[dict[str, Any]], coords: str = "absolute") -> dict[str, bool]:
    """Which panels of the Samples tab the group needs: ``gallery`` (images or frame strips), ``videos``
    (mp4s), ``boxes`` (some sample has a box), ``text`` (some sample has a completion) and ``picker`` (the
    one-sample picker, for boxes or a video). A text run shows its table only: no empty image panel."""
    images, videos = media_items(samples)
    boxes = any(_reference_boxes(s) or predicted_boxes(s, coords)[0] for s in samples)
    return {
        "gallery": bool(images),
        "videos": bool(videos),
        "boxes": boxes,
        "text": any(isinstance(s.get("text"), str) for s in samples),
        "picker": boxes or bool(videos),
    }


def row_columns(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The dataset columns the pipeline logged with the group (reference answer, category, ...)."""
    if not samples:
        return {}
    return {k: v for k, v in samples[0].items() if k not in STANDARD_KEYS and k != "index"}


_METRICS: dict[str, tuple[tuple[int, int], list[dict[str, Any]], list[str]]] = {}
"""`metrics_rows` of each run's metrics file, by (modification time, size): the app's timer reads it often."""


def metrics_rows(run_dir: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """``(rows, problems)`` of the run's ``metrics.jsonl``, read through `open_checked` (the path rule): every
    line that is a JSON object with an integer ``step``, and for each other line a message naming the file and
    the line (logged once; the app shows them in the run's status line) and carries on with the valid ones.
    Empty when the run logged nothing yet or the file is refused."""
    path = Path(run_dir) / rundir.METRICS_FILE
    f = open_checked(run_dir, path, "metrics file")
    if f is None:
        return [], []
    with f:
        st = os.fstat(f.fileno())
        stamp = (st.st_mtime_ns, st.st_size)
        cached = _METRICS.get(str(path))
        if cached is not None and cached[0] == stamp:
            return cached[1], cached[2]
        text = f.read().decode("utf-8", errors="replace")
    rows, problems = [], []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            problems.append(f"{path}: line {n} is not JSON ({e}); skipped")
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool):
            rows.append(row)
        else:
            problems.append(f"{path}: line {n} is not a JSON object with an integer 'step'; skipped")
    for problem in problems:
        _warn_once(problem)
    _METRICS[str(path)] = (stamp, rows, problems)
    return rows, problems


def _read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    return metrics_rows(run_dir)[0]


def _watchdog_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """`mmalign.app.doctor.watchdog_rows` of the run when its ``overopt.jsonl`` passes the path rule."""
    from mmalign.app import overopt
    from mmalign.app.doctor import watchdog_rows

    log_file = Path(run_dir) / overopt.LOG_FILE
    if not log_file.exists() or checked_path(run_dir, log_file, "watchdog log") is None:
        return []
    return watchdog_rows(run_dir)


def metric_keys(run_dirs: Sequence[str | Path]) -> list[str]:
    """Every numeric key of the runs' ``metrics.jsonl`` and of the over-optimisation watchdog's log
    (``overopt.jsonl``; ``step`` excluded), sorted."""
    keys: set[str] = set()
    for run in run_dirs:
        for row in [*_read_metrics(run), *_watchdog_rows(run)]:
            keys.update(k for k, v in row.items() if k != "step" and isinstance(v, int | float))
    return sorted(keys)


WATCHDOG_CURVES = ("watchdog/gold", "watchdog/train_reward")
"""The over-optimisation watchdog's curves (``eval.watchdog``) the reward plot shows by default beside the
training reward: the held-out gold reward and the training reward on the same held-out samples."""


def default_curve_keys(keys: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(reward keys, diagnostic keys)`` plotted by default: the total and each component's mean reward, and
    the watchdog's gold and held-out training rewards (`WATCHDOG_CURVES`) when the runs have them; loss, KL,
    clip fraction, |advantage| and the others of `DIAGNOSTIC_KEYS` that the runs log."""
    rewards = [k for k in keys if k == "reward/mean" or (k.startswith("reward/") and k.endswith("/mean"))]
    rewards += [k for k in WATCHDOG_CURVES if k in keys]
    diags = [k for k in DIAGNOSTIC_KEYS if k in keys]
    return rewards, diags


def _curve_source(run: str | Path, keys: Sequence[str]) -> list[dict[str, Any]]:
    """The rows `curve_rows` reads for one run: ``metrics.jsonl``, whose ``watchdog/*`` numbers are replaced by
    the watchdog's own log when the run has one (``overopt.jsonl``: every evaluation, the base model's at step
    0 included, also at steps that were not logged)."""
    rows = _read_metrics(run)
    if not any(k.startswith("watchdog/") for k in keys):
        return rows
    evals = _watchdog_rows(run)
    if not evals:
        return rows
    plain = [{k: v for k, v in r.items() if not k.startswith("watchdog/")} for r in rows]
    return plain + [{k: v for k, v in r.items() if k != "watchdog/warning"} for r in evals]


def curve_rows(run_dirs: Sequence[str | Path], keys: Sequence[str]) -> list[dict[str, Any]]:
    """Long-format rows ``{"step", "value", "series"}`` of `keys` for every run (series ``run: key`` with
    several runs, ``key`` with one), in step order; non-finite values are left out. ``watchdog/*`` keys come
    from the watchdog's log when the run has one (`_curve_source`)."""
    out = []
    several = len(run_dirs) > 1
    for run in run_dirs:
        label = run_label(run)
        for row in sorted(_curve_source(run, keys), key=lambda r: r.get("step", 0)):
            for k in keys:
                v = row.get(k)
                if isinstance(v, int | float) and math.isfinite(v) and "step" in row:
                    out.append(
                        {
                            "step": int(row["step"]),
                            "value": float(v),
                            "series": f"{label}: {k}" if several else k,
                        }
                    )
    return out


def diagnostic_panels(
    run_dirs: Sequence[str | Path], keys: Sequence[str], max_panels: int = MAX_PANELS
) -> list[tuple[str, list[dict[str, Any]]]]:
    """Small multiples: one panel per metric of `keys` (at most `max_panels`, in the order given), each
    ``(key, rows)`` with long-format rows ``{"step", "value", "run"}`` of every run (the run's folder name),
    so each metric has its own axis and two runs are two labelled lines of one panel. A key no run logs
    (finite values) gets no panel."""
    labels = [run_label(r) for r in run_dirs]
    if len(set(labels)) < len(labels):  # two runs of the same folder name: their paths tell them apart
        labels = [str(r) for r in run_dirs]
    panels = []
    for key in keys:
        rows = []
        for run, label in zip(run_dirs, labels, strict=True):
            for row in _read_metrics(run):
                v = row.get(key)
                if isinstance(v, int | float) and math.isfinite(v) and "step" in row:
                    rows.append({"step": int(row["step"]), "value": float(v), "run": label})
        if rows:
            panels.append((key, rows))
        if len(panels) >= max_panels:
            break
    return panels


def run_status(run_dir: str | Path) -> str:
    """One line: the run's last logged step, its sample steps and checkpoints (for the live view); below it
    the lines of ``metrics.jsonl`` that were skipped (`metrics_rows`), at most 3 named."""
    metrics, problems = metrics_rows(run_dir)
    last = metrics[-1] if metrics else {}
    steps = list_steps(run_dir)
    ckpts = _checkpoints(run_dir)
    parts = [
        f"**{run_label(run_dir)}**: last step {last.get('step', 'none')}",
        f"reward/mean {_fmt(last.get('reward/mean'), 3)}" if last else "",
        f"{len(steps)} sample steps" + (f" ({steps[0]}..{steps[-1]})" if steps else ""),
        f"{len(ckpts)} checkpoints",
    ]
    line = ", ".join(p for p in parts if p)
    for problem in problems[:3]:
        line += f"\n- warning: `{problem}`"
    if len(problems) > 3:
        line += f"\n- warning: {len(problems) - 3} more lines of {rundir.METRICS_FILE} skipped"
    return line


PROMPT_SEPARATOR = "---"
"""A line holding only this separates two prompts in the Compare tab (prompts may span lines)."""


def split_prompts(text: str) -> list[str]:
    """The prompts of the Compare tab's box: separated by lines holding only ``---``; a prompt keeps its
    inner newlines (a text prompt such as ``"Q: 1 + 2 = ?\nA:"``); empty ones are dropped."""
    prompts, current = [], []
    for line in (text or "").split("\n"):
        if line.strip() == PROMPT_SEPARATOR:
            prompts.append("\n".join(current))
            current = []
        else:
            current.append(line)
    prompts.append("\n".join(current))
    return [p for p in prompts if p.strip()]


def checkpoint_choices(run_dir: str | Path) -> list[tuple[str, str]]:
    """``(label, spec)`` for the checkpoint picker: the newest checkpoint, the base model, each checkpoint
    folder (spec: its path, as `mmalign.app.evaluation.resolve_checkpoint` takes it)."""
    out = [("latest checkpoint", "latest"), ("base model", "base")]
    out += [(p.name, str(p)) for p in reversed(_checkpoints(run_dir))]
    return out


def _checkpoints(run_dir: str | Path) -> list[Path]:
    """`mmalign.training.rundir.checkpoints` of the run that pass the path rule (`checked_path`), oldest first."""
    root = Path(run_dir) / rundir.CHECKPOINTS_DIR
    if not root.exists() or checked_path(run_dir, root, "checkpoints folder") is None:
        return []
    return [p for p in rundir.checkpoints(run_dir) if checked_path(run_dir, p, "checkpoint") is not None]


def _generation_key(ckpt: Path | None, prompts: Sequence[str], n: int, seed: int) -> str:
    blob = json.dumps([str(ckpt) if ckpt else "base", list(prompts), n, seed])
    return f"{ckpt.name if ckpt else 'base'}-seed{seed}-n{n}-{hashlib.sha1(blob.encode()).hexdigest()[:10]}"


_GENERATE_LOCK = threading.Lock()
_RECENT: collections.deque[Path] = collections.deque(maxlen=2)
"""The last generations handed to the UI (the two sides of the last request): never pruned, so their
files are still there when Gradio reads them."""


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def prune_demo_samples(
    run_dir: str | Path,
    keep: Sequence[Path] = (),
    max_bytes: int | None = None,
    max_generations: int | None = None,
) -> list[Path]:
    """Delete the oldest generations (by last use) of ``RUN_DIR/demo_samples/`` until at most
    `max_generations` (`DEMO_MAX_GENERATIONS`) remain and they hold at most `max_bytes` (`DEMO_MAX_BYTES`);
    the folders of `keep` (the generations being shown) are never deleted. Returns the deleted paths."""
    max_bytes = DEMO_MAX_BYTES if max_bytes is None else max_bytes
    max_generations = DEMO_MAX_GENERATIONS if max_generations is None else max_generations
    root = Path(run_dir) / DEMO_SAMPLES_DIR
    if not root.is_dir() or root.is_symlink():
        return []
    kept = {Path(k).resolve() for k in keep}
    entries = sorted(root.iterdir(), key=lambda p: p.lstat().st_mtime)  # oldest first
    folder = lambda p: p.is_dir() and not p.is_symlink()  # noqa: E731
    sizes = {p: _tree_bytes(p) if folder(p) else p.lstat().st_size for p in entries}
    total, count = sum(sizes.values()), len(entries)
    deleted = []
    for p in entries:
        if total <= max_bytes and count <= max_generations:
            break
        if p.resolve() in kept:
            continue
        if folder(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        total, count = total - sizes[p], count - 1
        deleted.append(p)
    return deleted


def generate_samples(
    run_dir: str | Path,
    checkpoint: str,
    prompts: Sequence[str],
    n: int,
    seed: int,
    *,
    sample_fn: Callable[[argparse.Namespace], int] | None = None,
    trust_run_code: bool = False,
) -> tuple[str, list[dict[str, Any]]]:
    """`n` samples per prompt from `checkpoint` (``latest``, ``base`` or a folder) of `run_dir` with seed `seed`,
    by `mmalign.app.cli.cmd_sample` (or `sample_fn`) on the run's ``config.yaml``; ``(label, rows)`` with media
    paths absolute and checked (the path rule; refused ones None). Kept in ``RUN_DIR/demo_samples/<key>/`` and
    reused for the same arguments; the folder is then pruned to its caps (`prune_demo_samples`). `ValueError`
    for more than `MAX_PROMPTS` prompts or `MAX_SAMPLES_PER_PROMPT` samples per prompt, or a config,
    checkpoint or ``demo_samples/`` outside the run; `UntrustedRunCode` when the config names code to import
    (`run_code_problems`) and not `trust_run_code`. Paths in the config are relative to the current
    directory, as for `mmalign sample`."""
    from mmalign.app.evaluation import resolve_checkpoint
    from mmalign.config import ConfigError

    run = Path(run_dir).resolve()
    prompts = [str(p) for p in prompts if str(p).strip()]
    if not prompts:
        raise ValueError("no prompt to generate from")
    if n < 1:
        raise ValueError(f"samples per prompt must be >= 1, got {n}")
    if n > MAX_SAMPLES_PER_PROMPT:
        raise ValueError(f"at most {MAX_SAMPLES_PER_PROMPT} samples per prompt, got {n}")
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} prompts per generation, got {len(prompts)}")
    config = run / rundir.CONFIG_FILE
    if not config.is_file():
        raise ConfigError(f"{run}: no {rundir.CONFIG_FILE}, so no model to generate with")
    if checked_path(run, config, "config") is None:
        raise ValueError(f"{config} resolves outside the run directory: refused")
    _check_run_code(run, trust_run_code)
    ckpt = resolve_checkpoint(run, checkpoint)
    if ckpt is not None and checked_path(run, ckpt, "checkpoint") is None:
        raise ValueError(f"checkpoint {ckpt} resolves outside the run directory {run}: refused")
    if ckpt is None and checkpoint == "latest":
        checkpoint = "base"
    label = f"{run_label(run)} / {ckpt.name if ckpt else 'base model'} / seed {seed}"
    root = run / DEMO_SAMPLES_DIR
    if root.is_symlink() or (root.exists() and checked_path(run, root, "generations folder") != root):
        raise ValueError(f"{root} is a link or resolves elsewhere: refused (remove it to generate)")
    out = root / _generation_key(ckpt, prompts, n, seed)
    if out.is_symlink() or (out.exists() and checked_path(run, out, "generation folder") != out):
        raise ValueError(f"{out} is a link or resolves elsewhere: refused (remove it to generate)")
    done = out / "samples.jsonl"
    with _GENERATE_LOCK:  # one model in memory at a time; no pruning while another request reads
        if not done.is_file():
            if sample_fn is None:
                from mmalign.app.cli import cmd_sample as sample_fn
            args = argparse.Namespace(
                config=str(config),
                overrides=[f"output_dir={run}"],
                checkpoint=str(ckpt) if ckpt else "base",
                prompt=list(prompts),
                prompts=None,
                n=int(n),
                max_prompts=len(prompts),
                seed=int(seed),
                out=str(out),
            )
            try:
                sample_fn(args)
            finally:
                prune_demo_samples(run, keep=[*_RECENT, out] if done.is_file() else list(_RECENT))
        else:
            os.utime(out)  # used again: the newest for pruning
            prune_demo_samples(run, keep=[*_RECENT, out])
        _RECENT.append(out)
        text = _read_checked(run, done, "generated samples file")
    if text is None:
        raise ValueError(f"{done}: missing or outside the run directory (refused)")
    rows = [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    return label, [_checked_media(run, row, out) for row in rows if isinstance(row, dict)]


DATA_COLUMN_STEPS = 50
"""How many of a run's newest sample steps `prompt_columns` searches for a prompt's data columns."""


def prompt_columns(run_dir: str | Path, prompt: str) -> dict[str, Any] | None:
    """The data-row columns (`row_columns`: reference answer, boxes, ...) the run logged with `prompt`, from
    its newest `DATA_COLUMN_STEPS` sample steps; None when the run never logged that prompt (a free-typed
    one)."""
    for step in reversed(list_steps(run_dir)[-DATA_COLUMN_STEPS:]):
        group = find_group(run_dir, step, prompt)
        if group is not None:
            return row_columns(load_group(run_dir, step, group))
    return None


_REWARD_SETS: dict[tuple[str, float], Any] = {}
"""The run's `rewards.RewardSet`, built once per config file (and its modification time)."""


def _reward_set(run_dir: str | Path, trust_run_code: bool = False) -> Any:
    """The `rewards.RewardSet` of the run's ``config.yaml`` ``rewards:`` (None when it lists none);
    `UntrustedRunCode` when the config names code to import and not `trust_run_code`."""
    from rewards import RewardSet

    _check_run_code(run_dir, trust_run_code)
    config = Path(run_dir).resolve() / rundir.CONFIG_FILE
    key = (str(config), config.stat().st_mtime if config.is_file() else 0.0)
    if key not in _REWARD_SETS:
        specs = _run_config(run_dir).get("rewards") or []
        _REWARD_SETS.clear()  # one set in memory (a reward may hold a model)
        _REWARD_SETS[key] = RewardSet(specs, source=str(config)) if specs else None
    return _REWARD_SETS[key]


def _generated_outputs(run_dir: str | Path, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the rewards read of generated rows of `run_dir`: ``texts``, and ``images`` Float[B, 3, H, W] in
    [0, 1] read back from the PNGs (`open_checked`) when every row has one of the same size."""
    import numpy as np
    import torch

    outputs: dict[str, Any] = {}
    if rows and all(isinstance(r.get("text"), str) for r in rows):
        outputs["texts"] = [r["text"] for r in rows]
    paths = [r.get("image") for r in rows]
    if rows and all(_is_media(p) and Path(p).suffix.lower() in IMAGE_SUFFIXES for p in paths):
        pixels = [_load_input_image(run_dir, Path(p)) for p in paths]
        if all(x is not None for x in pixels) and len({x.shape for x in pixels}) == 1:
            stack = torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2)
            outputs["images"] = stack.float() / 255.0
    return outputs


def score_generated(
    run_dir: str | Path, rows: list[dict[str, Any]], *, trust_run_code: bool = False
) -> tuple[list[str], dict[str, str]]:
    """Score generated `rows` with the run's rewards (`rewards.RewardSet` of its ``config.yaml``, each reward
    on its own): every row gets ``rewards`` ``{name: value}`` and ``reward``, the weighted total
    (`mmalign.algorithms.advantages.combine_rewards`; NaN, "not applicable", left out). The samples of one prompt are
    scored together with the data columns the run logged with that prompt (`prompt_columns`: a reference
    answer, boxes); a free-typed prompt has none, so a reward that needs one is NaN for it. Returns ``(reward
    names, notes)``: notes say, per reward, why it is NaN somewhere (or, under ``""``, why nothing was
    scored). A config that names code to import is not built without `trust_run_code` (`run_code_problems`:
    the note says which name and how to opt in)."""
    import torch

    from mmalign.algorithms.advantages import combine_rewards
    from rewards import RewardBatch, RewardSet

    try:
        rs = _reward_set(run_dir, trust_run_code)
    except UntrustedRunCode as e:
        return [], {"": _scrub(str(e), run_dir)}
    except Exception as e:  # a reward that cannot be built here: the samples are shown unscored
        return [], {"": _scrub(f"the run's rewards could not be built: {type(e).__name__}: {e}", run_dir)}
    if rs is None or not len(rs):
        return [], {"": "the run's config lists no rewards"}
    names, notes = list(rs.names), {}
    singles = [RewardSet.from_rewards([r]) for r in rs.rewards]
    by_prompt: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        by_prompt.setdefault(str(r.get("prompt", "")), []).append(i)
    for prompt, idx in by_prompt.items():
        members = [rows[i] for i in idx]
        columns = prompt_columns(run_dir, prompt)
        batch = RewardBatch(
            prompts=[prompt] * len(idx),
            outputs=_generated_outputs(run_dir, members),
            columns={k: [v] * len(idx) for k, v in (columns or {}).items()},
            group=torch.zeros(len(idx), dtype=torch.long),
        )
        table = torch.full((len(idx), len(names)), math.nan)
        for k, single in enumerate(singles):
            try:
                table[:, k] = single(batch)[:, 0].float().cpu()
            except Exception as e:  # a column the prompt lacks, an output not kept: not applicable
                why = f"{type(e).__name__}: {e.args[0] if e.args else e}"
                if columns is None:
                    why += " (a typed prompt, not one of the run's logged prompts: no data columns)"
                notes.setdefault(names[k], _scrub(why[:400], run_dir))
        totals = combine_rewards(table, rs.weights)
        for j, row in enumerate(members):
            row["rewards"] = {n: float(table[j, k]) for k, n in enumerate(names)}
            row["reward"] = float(totals[j])
    return names, notes


# ============================================================================= layout


def _check_gradio() -> Any:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        import gradio as gr
    except ImportError as e:
        raise ImportError(
            'the demo needs Gradio: pip install "mmalign[demo]" (or pip install "gradio>=4")'
        ) from e
    return gr


def _frame(headers: list[str], rows: list[list[Any]]) -> Any:
    import pandas as pd

    return pd.DataFrame(rows, columns=headers)


# ----------------------------------------------------------------------------- event handlers
# Module-level so each is one job; their names are kept (Gradio names the app's API endpoints after them).


def step_update(run: str, step: Any, follow: bool = False) -> Any:
    """The step picker of `run`: its steps; keeps `step` when the run has it, else (or when `follow`ing)
    the newest step."""
    gr = _check_gradio()
    steps = list_steps(run)
    if follow and steps:
        value = steps[-1]
    else:
        value = int(step) if step is not None and int(step) in steps else (steps[-1] if steps else None)
    return gr.update(choices=steps, value=value)


def timer_step_update(run: str, step: Any, follow: bool = False) -> Any:
    """The timer's update of the step picker: new steps appear; the selection moves only when following
    the newest step or when none is selected (setting the request's step back would undo a click made
    while the request was in flight)."""
    gr = _check_gradio()
    steps = list_steps(run)
    if (follow or step is None) and steps:
        return gr.update(choices=steps, value=steps[-1])
    return gr.update(choices=steps)


def groups_update(run: str, step: Any, group: Any = None) -> Any:
    """The group picker of `step`: ``"group: prompt"`` choices; keeps `group` when the step has it, else
    the first group."""
    gr = _check_gradio()
    groups = list_groups(run, int(step)) if step is not None else []
    ids = [g for g, _ in groups]
    value = int(group) if group is not None and int(group) in ids else (ids[0] if ids else None)
    choices = [(f"{g}: {p[:70]}", g) for g, p in groups]
    return gr.update(choices=choices, value=value)


def _group_header(step: Any, group: Any, samples: list[dict[str, Any]], has_media: bool) -> str:
    """The Markdown above a group: step, group, sample count, prompt, the logged dataset columns, and a
    note when the samples carry neither media nor text."""
    cols = row_columns(samples)
    prompt = samples[0].get("prompt", "") if samples else ""
    md = f"**step {step}, group {group}** ({len(samples)} samples)\n\n**prompt:**\n```\n{prompt}\n```"
    if cols:
        md += "\n" + "\n".join(f"- **{k}**: `{json.dumps(v)[:300]}`" for k, v in cols.items())
    if not has_media and not any("text" in s for s in samples):
        md += "\n\n*this run's samples carry no media or text (e.g. latents only); rewards are below*"
    return md


def _served_items(run: str | Path, items: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """`media_items`' ``(path, caption)`` as Gradio gets them: copies of the checked files (`served_copy`)."""
    out = []
    for path, caption in items:
        copy = served_copy(run, path)
        if copy is not None:
            out.append((copy, caption))
    return out


def show_group(run: str, step: Any, group: Any, *, data_roots: Sequence[str | Path] = ()) -> tuple[Any, ...]:
    """The Samples tab for one group, as the 8 values of ``header, table, gallery, videos, overview,
    sample picker, boxes, video`` (the first sample shown in the last two); placeholders without a group.
    Media are handed over as copies of the checked files (`served_copy`)."""
    gr = _check_gradio()
    if step is None or group is None:
        empty = _frame(["sample"], [])
        return (
            "*no samples logged yet*",
            empty,
            gr.update(value=[], visible=False),
            gr.update(value=[], visible=False),
            empty,
            gr.update(choices=[], value=None, visible=False),
            None,
            gr.update(value=None, visible=False),
        )
    samples = load_group(run, int(step), int(group))
    headers, rows = reward_table(samples)
    images, videos = media_items(samples)
    layout = sample_layout(samples, box_coords(run))
    md = _group_header(step, group, samples, bool(images or videos))
    oh, orows = group_overview(run, int(step))
    sample_choices = list(range(len(samples)))
    first = sample_choices[0] if sample_choices else None
    ann, vid = show_sample(run, step, group, first, data_roots=data_roots)
    return (
        md,
        _frame(headers, rows),
        gr.update(value=_served_items(run, images), visible=layout["gallery"]),
        gr.update(value=_served_items(run, videos), visible=layout["videos"]),
        _frame(oh, orows),
        gr.update(choices=sample_choices, value=first, visible=layout["picker"]),
        ann,
        vid,
    )


def show_sample(
    run: str, step: Any, group: Any, k: Any, *, data_roots: Sequence[str | Path] = ()
) -> tuple[Any, Any]:
    """``(boxes, video)`` updates for sample `k` of the group: its `box_annotations` (the input image read
    from the run or `data_roots`) and its mp4, each hidden when the sample has none (both hidden when nothing is
    selected); files are handed over as copies of the checked files (`served_copy`)."""
    gr = _check_gradio()
    if step is None or group is None or k is None:
        return gr.update(value=None, visible=False), gr.update(value=None, visible=False)
    samples = load_group(run, int(step), int(group))
    if not 0 <= int(k) < len(samples):
        return gr.update(value=None, visible=False), gr.update(value=None, visible=False)
    s = samples[int(k)]
    ann = box_annotations(s, box_coords(run), run_dir=run, data_roots=data_roots)
    if ann is not None and not hasattr(ann[0], "shape"):  # the sample's own image: a checked copy
        copy = served_copy(run, ann[0])
        ann = (copy, ann[1]) if copy is not None else None
    video = served_copy(run, s["video"]) if _is_media(s.get("video")) else None
    return (
        gr.update(value=outline_masks(ann) if ann else None, visible=ann is not None),
        gr.update(value=video, visible=video is not None),
    )


_show_group, _show_sample = show_group, show_sample
"""(The app's handlers of the same names call these, for the runs it serves.)"""


def move(choices_of: Callable[..., list[Any]], delta: int) -> Callable[..., Any]:
    """A button handler ``fn(*context, current)``: the item `delta` places from `current` among
    ``choices_of(*context)``, clamped to the ends (the first item when `current` is not among them)."""

    def fn(*args: Any) -> Any:
        *ctx, current = args
        items = choices_of(*ctx)
        if not items:
            return None
        if current is None or int(current) not in items:
            return items[0]
        i = items.index(int(current)) + delta
        return items[max(0, min(len(items) - 1, i))]

    return fn


def _curve_frames(runs: Sequence[str], keys_r: list[str], keys_d: list[str]) -> tuple[Any, list[Any]]:
    """The data of the Curves tab: `curve_rows` of the reward keys (one plot), and `diagnostic_panels` of
    the diagnostic keys as ``[(key, DataFrame), ...]`` (one small plot each)."""
    import pandas as pd

    r = pd.DataFrame(curve_rows(runs, keys_r or []), columns=["step", "value", "series"])
    d = [
        (key, pd.DataFrame(rows, columns=["step", "value", "run"]))
        for key, rows in diagnostic_panels(runs, keys_d or [])
    ]
    return r, d


def _panel_kwargs(panels: list[Any], k: int) -> dict[str, Any]:
    """Value, title and visibility of the `k`-th diagnostic panel slot (hidden past the last panel)."""
    if k < len(panels):
        key, frame = panels[k]
        return {"value": frame, "title": key, "visible": True}
    return {"value": None, "title": "", "visible": False}


def _panel_updates(panels: list[Any]) -> list[Any]:
    """`gr.update` of every diagnostic panel slot (`MAX_PANELS`)."""
    gr = _check_gradio()
    return [gr.update(**_panel_kwargs(panels, k)) for k in range(MAX_PANELS)]


def sync_prompt(run: str, step: Any, group: Any) -> tuple[Any, Any]:
    """The Compare tab follows the Samples tab: the selected group's prompt and step."""
    gr = _check_gradio()
    groups = dict(list_groups(run, int(step))) if step is not None else {}
    return gr.update(value=groups.get(int(group), "") if group is not None else ""), step


def _logged_side(run: str, step: Any, prompt: str) -> list[Any]:
    """``[header, images, table]`` of the group of `run` at `step` whose prompt is `prompt` (a note and
    an empty table when there is none); the gallery is hidden when the samples have no image."""
    gr = _check_gradio()
    g = find_group(run, int(step or 0), prompt) if prompt else None
    if g is None:
        return [
            f"**{run_label(run)}**, step {step}: no group with this prompt",
            gr.update(value=[], visible=False),
            _frame(["sample"], []),
        ]
    samples = load_group(run, int(step), g)
    h, rows = reward_table(samples)
    images = _served_items(run, media_items(samples)[0])
    return [
        f"**{run_label(run)}**, step {step}, group {g} (logged)",
        gr.update(value=images, visible=bool(images)),
        _frame(h, rows),
    ]


def logged(ra: str, rb: str, step: Any, prompts: str) -> tuple[Any, ...]:
    """Both sides of the Compare tab from the logged samples of the first prompt at `step`."""
    found = split_prompts(prompts)
    prompt = found[0] if found else ""
    return tuple(_logged_side(ra, step, prompt) + _logged_side(rb, step, prompt))


def score_summary(rows: Sequence[dict[str, Any]], names: Sequence[str], notes: dict[str, str]) -> str:
    """Markdown of one side's scores: the mean total reward and the mean of each reward over its samples
    (NaN left out; "n/a" when no sample has a value), then why a reward is n/a (`score_generated`'s notes)."""
    if not names:
        return f"*not scored: {notes.get('', 'no rewards')}*"
    mean = _mean([r.get("reward") for r in rows])
    parts = [f"{n} {_fmt(_mean([(r.get('rewards') or {}).get(n) for r in rows]), 3)}" for n in names]
    md = f"mean reward **{_fmt(mean, 3)}** over {len(rows)} samples ({', '.join(parts)})"
    for n, why in notes.items():
        md += f"\n- **{n}** n/a: {why}" if n else f"\n- {why}"
    return md


def _generated_side(
    run: str | Path,
    label: str,
    rows: list[dict[str, Any]],
    n: int,
    names: Sequence[str] = (),
    notes: dict[str, str] | None = None,
) -> list[Any]:
    """``[header, images, table]`` of one side's generated rows of `run` (`n` samples per prompt): with the
    run's rewards (`score_generated`), each sample's total and per-reward values and the side's means; images
    handed over as copies of the checked files (`served_copy`)."""
    gr = _check_gradio()
    scored = bool(names)

    def caption(k: int, r: dict[str, Any]) -> str:
        cap = f"prompt {k // n} sample {r.get('sample')}"
        return cap + (f" | reward={_fmt(r.get('reward'), 3)}" if scored else "")

    images = _served_items(
        run,
        [
            (str(r.get("image") or r.get("video_frames")), caption(k, r))
            for k, r in enumerate(rows)
            if r.get("image") or r.get("video_frames")
        ],
    )
    has_text = any("text" in r for r in rows)
    score_cols = ["reward", *names] if scored else []
    table_rows = [
        [r.get("prompt", ""), r.get("sample")]
        + ([_fmt(r.get("reward"))] + [_fmt((r.get("rewards") or {}).get(x)) for x in names] if scored else [])
        + ([r.get("text", "")] if has_text else [])
        for r in rows
    ]
    cols = ["prompt", "sample", *score_cols] + (["text"] if has_text else [])
    header = f"**{label}**\n\n{score_summary(rows, names, notes or {})}"
    return [header, gr.update(value=images, visible=bool(images)), _frame(cols, table_rows)]


def _generate_both(
    sides: Sequence[tuple[str, str]],
    prompts: str,
    n: Any,
    seed: Any,
    progress: Any,
    *,
    trust_run_code: bool = False,
) -> tuple[Any, ...]:
    """Generate on both ``(run, checkpoint)`` `sides` (`generate_samples`), reporting to `progress`;
    `gr.Error` without a prompt or when a side fails (the app keeps running), e.g. a config that names code
    to import without `trust_run_code` (the message names it and the ``--trust-run-code`` flag)."""
    gr = _check_gradio()
    lines = split_prompts(prompts)
    if not lines:
        raise gr.Error("write at least one prompt")
    if len(lines) > MAX_PROMPTS:
        raise gr.Error(f"at most {MAX_PROMPTS} prompts per generation (got {len(lines)})")
    try:
        n, seed = int(n or 1), int(seed or 0)
    except (TypeError, ValueError, OverflowError) as e:
        raise gr.Error(f"samples per prompt and seed must be whole numbers: {e}") from e
    if not 1 <= n <= MAX_SAMPLES_PER_PROMPT:
        raise gr.Error(f"samples per prompt must be between 1 and {MAX_SAMPLES_PER_PROMPT} (got {n})")
    out: list[Any] = []
    for i, (run, ck) in enumerate(sides):
        progress(i / 2, desc=f"{'left' if i == 0 else 'right'}: loading the model and generating")
        try:
            label, rows = generate_samples(run, ck, lines, n, seed, trust_run_code=trust_run_code)
        except Exception as e:  # a wrong config / checkpoint: shown (secrets masked), the app keeps running
            raise gr.Error(_scrub(f"{run_label(run)} ({ck}): {type(e).__name__}: {e}", run)) from e
        progress((i + 0.5) / 2, desc=f"{'left' if i == 0 else 'right'}: scoring with the run's rewards")
        names, notes = score_generated(run, rows, trust_run_code=trust_run_code)
        out += _generated_side(run, label, rows, n, names, notes)
    progress(1.0, desc="done")
    return tuple(out)


# ----------------------------------------------------------------------------- tabs


def _samples_tab(
    gr: Any,
    ui: SimpleNamespace,
    labels: list[tuple[str, str]],
    steps0: list[int],
    groups0: list[tuple[int, str]],
) -> None:
    """Lay out the "Samples" tab, adding its components to `ui`: run / step / group pickers (opened on the
    first run's newest step `steps0[-1]`, its first group of `groups0`), navigation buttons, the group's
    table, media, boxes and the step's overview."""
    with gr.Tab("Samples"):
        with gr.Row():
            ui.run_dd = gr.Dropdown(choices=labels, value=labels[0][1], label="run", elem_id="run")
            ui.step_dd = gr.Dropdown(
                choices=steps0, value=steps0[-1] if steps0 else None, label="step", elem_id="step"
            )
            ui.group_dd = gr.Dropdown(
                choices=[(f"{g}: {p[:70]}", g) for g, p in groups0],
                value=groups0[0][0] if groups0 else None,
                label="group",
                elem_id="group",
            )
            ui.follow = gr.Checkbox(value=False, label="follow the newest step", elem_id="follow")
        with gr.Row():
            ui.prev_step = gr.Button("◀ previous step", elem_id="prev-step", size="sm")
            ui.next_step = gr.Button("next step ▶", elem_id="next-step", size="sm")
            ui.prev_group = gr.Button("◀ previous group", elem_id="prev-group", size="sm")
            ui.next_group = gr.Button("next group ▶", elem_id="next-group", size="sm")
        ui.header = gr.Markdown(elem_id="group-header")
        ui.table = gr.Dataframe(label="rewards and advantage per sample", elem_id="reward-table", wrap=True)
        # shown only when the group needs them (`sample_layout`): a text run has no image panel
        ui.gallery = gr.Gallery(
            label="images (or video frame strips)", columns=4, visible=False, elem_id="gallery"
        )
        ui.videos = gr.Gallery(label="videos", columns=4, visible=False, elem_id="videos")
        with gr.Row():
            ui.sample_dd = gr.Dropdown(
                choices=[], label="sample (boxes, video)", visible=False, elem_id="sample"
            )
            ui.boxes = gr.AnnotatedImage(
                label="boxes on the input image: reference (green) and predicted (red)",
                color_map={"reference": "#22c55e", "predicted": "#ef4444"},
                visible=False,
                elem_id="boxes",
            )
            ui.video = gr.Video(label="video", visible=False, elem_id="video")
        ui.overview = gr.Dataframe(label="groups of this step", elem_id="overview", wrap=True)


def _curves_tab(gr: Any, ui: SimpleNamespace, runs: list[str]) -> None:
    """Lay out the "Curves" tab, adding its components to `ui`: key pickers (every metric key; the
    `default_curve_keys` selected) and the reward and diagnostic plots."""
    all_keys = metric_keys(runs)
    rk, dk = default_curve_keys(all_keys)
    with gr.Tab("Curves"):
        ui.keys_r = gr.Dropdown(choices=all_keys, value=rk, multiselect=True, label="reward curves")
        ui.keys_d = gr.Dropdown(
            choices=all_keys,
            value=dk,
            multiselect=True,
            label=f"diagnostic curves (one panel each, at most {MAX_PANELS})",
        )
        r0, d0 = _curve_frames(runs, rk, dk)
        ui.plot_r = gr.LinePlot(
            r0, x="step", y="value", color="series", title="rewards", elem_id="plot-rewards"
        )
        ui.panels = []
        with gr.Column(elem_id="diagnostic-panels"):
            for start in range(0, MAX_PANELS, PANEL_COLUMNS):
                with gr.Row():
                    for k in range(start, start + PANEL_COLUMNS):
                        ui.panels.append(
                            gr.LinePlot(
                                **_panel_kwargs(d0, k),
                                x="step",
                                y="value",
                                color="run",
                                height=220,
                                min_width=280,
                                elem_id=f"panel-{k}",
                                elem_classes=["diagnostic-panel"],
                            )
                        )


def _compare_pickers(gr: Any, ui: SimpleNamespace, runs: list[str], labels: list[tuple[str, str]]) -> None:
    """Lay out the Compare tab's run and checkpoint pickers into `ui`: left = the first run's latest
    checkpoint, right = the last run's (its base model when there is one run)."""
    with gr.Row():
        with gr.Column():
            ui.run_a = gr.Dropdown(choices=labels, value=runs[0], label="left run")
            ui.ckpt_a = gr.Dropdown(
                choices=checkpoint_choices(runs[0]), value="latest", label="left checkpoint"
            )
        with gr.Column():
            ui.run_b = gr.Dropdown(choices=labels, value=runs[-1], label="right run")
            ui.ckpt_b = gr.Dropdown(
                choices=checkpoint_choices(runs[-1]),
                value="base" if len(runs) == 1 else "latest",
                label="right checkpoint",
            )


def _compare_tab(
    gr: Any,
    ui: SimpleNamespace,
    runs: list[str],
    labels: list[tuple[str, str]],
    steps0: list[int],
    groups0: list[tuple[int, str]],
) -> None:
    """Lay out the "Compare" tab, adding its components to `ui`: pickers, step and prompts (opened on the
    Samples tab's group), generation settings, the two sides."""
    with gr.Tab("Compare"):
        gr.Markdown(
            "Logged samples of two runs at the same step and prompt, or new samples generated from two "
            "checkpoints (of one run or two) on the same prompts with the same seed."
        )
        _compare_pickers(gr, ui, runs, labels)
        with gr.Row():
            ui.cmp_step = gr.Number(value=steps0[-1] if steps0 else 0, precision=0, label="step (logged)")
            ui.show_logged = gr.Button("show logged samples of the prompt above", elem_id="show-logged")
        ui.prompts_box = gr.Textbox(
            value=groups0[0][1] if groups0 else "",
            lines=3,
            label="prompts (separate two prompts with a line holding only ---)",
            elem_id="prompts",
        )
        with gr.Row():
            ui.n_box = gr.Number(
                value=4,
                precision=0,
                minimum=1,
                maximum=MAX_SAMPLES_PER_PROMPT,
                label=f"samples per prompt (at most {MAX_SAMPLES_PER_PROMPT})",
            )
            ui.seed_box = gr.Number(value=0, precision=0, label="seed")
            ui.gen = gr.Button("generate both sides", variant="primary", elem_id="generate")
        with gr.Row():
            with gr.Column():
                ui.head_a = gr.Markdown(elem_id="head-left")
                ui.gal_a = gr.Gallery(columns=4, label="left", visible=False, elem_id="gallery-left")
                ui.tab_a = gr.Dataframe(wrap=True, elem_id="table-left")
            with gr.Column():
                ui.head_b = gr.Markdown(elem_id="head-right")
                ui.gal_b = gr.Gallery(columns=4, label="right", visible=False, elem_id="gallery-right")
                ui.tab_b = gr.Dataframe(wrap=True, elem_id="table-right")


# ----------------------------------------------------------------------------- events


def _known_run(run: Any, runs: Sequence[str]) -> str:
    """`run` when it is one of the app's run directories; else `gr.Error` (a request naming another folder)."""
    if run not in runs:
        raise _check_gradio().Error(f"{run!r} is not one of the runs this demo serves")
    return str(run)


def _wire_samples(
    demo: Any, ui: SimpleNamespace, runs: list[str], data_roots: Sequence[str | Path] = ()
) -> None:
    """Events of the Samples tab: run -> steps -> groups -> the group shown, sample -> boxes / video,
    the navigation buttons, and the group shown when the page loads. The handlers that read a group serve
    only `runs` (and input images of `data_roots`)."""

    def show_group(run: str, step: Any, group: Any) -> tuple[Any, ...]:  # (its name: the API endpoint's)
        return _show_group(_known_run(run, runs), step, group, data_roots=data_roots)

    def show_sample(run: str, step: Any, group: Any, k: Any) -> tuple[Any, Any]:
        return _show_sample(_known_run(run, runs), step, group, k, data_roots=data_roots)

    group_outputs = [
        ui.header,
        ui.table,
        ui.gallery,
        ui.videos,
        ui.overview,
        ui.sample_dd,
        ui.boxes,
        ui.video,
    ]
    where = [ui.run_dd, ui.step_dd, ui.group_dd]
    ui.run_dd.change(step_update, [ui.run_dd, ui.step_dd], ui.step_dd)
    ui.step_dd.change(groups_update, where, ui.group_dd).then(show_group, where, group_outputs)
    ui.group_dd.change(show_group, where, group_outputs)
    ui.sample_dd.change(show_sample, [*where, ui.sample_dd], [ui.boxes, ui.video])
    ui.prev_step.click(move(list_steps, -1), [ui.run_dd, ui.step_dd], ui.step_dd)
    ui.next_step.click(move(list_steps, +1), [ui.run_dd, ui.step_dd], ui.step_dd)
    group_ids = lambda run, step: [g for g, _ in list_groups(run, int(step))] if step is not None else []  # noqa: E731
    ui.prev_group.click(move(group_ids, -1), where, ui.group_dd)
    ui.next_group.click(move(group_ids, +1), where, ui.group_dd)
    demo.load(show_group, where, group_outputs)


def _wire_curves(runs: list[str], ui: SimpleNamespace) -> Callable[[list[str], list[str]], tuple[Any, Any]]:
    """Events of the Curves tab: a key picker change redraws the reward plot and the diagnostic panels.
    Returns the redraw function."""

    def curves(keys_r: list[str], keys_d: list[str]) -> tuple[Any, ...]:
        r, d = _curve_frames(runs, keys_r, keys_d)
        return (r, *_panel_updates(d))

    for k in (ui.keys_r, ui.keys_d):
        k.change(curves, [ui.keys_r, ui.keys_d], [ui.plot_r, *ui.panels])
    return curves


def _wire_compare(gr: Any, ui: SimpleNamespace, runs: list[str], trust_run_code: bool = False) -> None:
    """Events of the Compare tab: follow the Samples tab's group, refresh the checkpoint pickers, show the
    logged samples, generate both sides (one generation at a time, on `runs` only; importing code the runs'
    configs name only with `trust_run_code`)."""
    ui.group_dd.change(sync_prompt, [ui.run_dd, ui.step_dd, ui.group_dd], [ui.prompts_box, ui.cmp_step])
    ui.run_a.change(lambda r: gr.update(choices=checkpoint_choices(r), value="latest"), ui.run_a, ui.ckpt_a)
    ui.run_b.change(lambda r: gr.update(choices=checkpoint_choices(r), value="latest"), ui.run_b, ui.ckpt_b)
    sides = [ui.head_a, ui.gal_a, ui.tab_a, ui.head_b, ui.gal_b, ui.tab_b]
    ui.show_logged.click(logged, [ui.run_a, ui.run_b, ui.cmp_step, ui.prompts_box], sides)

    def generate_both(
        ra: str,
        ca: str,
        rb: str,
        cb: str,
        prompts: str,
        n: Any,
        seed: Any,
        progress: Any = gr.Progress(track_tqdm=True),
    ) -> tuple[Any, ...]:
        sides = ((_known_run(ra, runs), ca), (_known_run(rb, runs), cb))
        return _generate_both(sides, prompts, n, seed, progress, trust_run_code=trust_run_code)

    inputs = [ui.run_a, ui.ckpt_a, ui.run_b, ui.ckpt_b, ui.prompts_box, ui.n_box, ui.seed_box]
    ui.gen.click(generate_both, inputs, sides, concurrency_limit=1)


def _wire_timer(
    gr: Any, runs: list[str], ui: SimpleNamespace, curves: Callable[..., Any], refresh_s: float
) -> None:
    """Every `refresh_s` seconds re-read the runs: the status line, new steps (`timer_step_update`), the
    plots and the metric keys offered."""
    timer = gr.Timer(refresh_s)

    def tick(run: str, step: Any, follow_: bool, kr: list[str], kd: list[str]) -> tuple[Any, ...]:
        keys = metric_keys(runs)
        return (
            "\n\n".join(run_status(r) for r in runs) + f"\n\n*refreshed {time.strftime('%H:%M:%S')}*",
            timer_step_update(run, step, follow_),
            *curves(kr, kd),
            gr.update(choices=keys),
            gr.update(choices=keys),
        )

    timer.tick(
        tick,
        [ui.run_dd, ui.step_dd, ui.follow, ui.keys_r, ui.keys_d],
        [ui.status, ui.step_dd, ui.plot_r, *ui.panels, ui.keys_r, ui.keys_d],
    )


def build_app(
    run_dirs: Sequence[str | Path],
    refresh_s: float = 5.0,
    *,
    trust_run_code: bool = False,
    data_roots: Sequence[str | Path] = (),
) -> Any:
    """The `gr.Blocks` of the demo on `run_dirs` (tabs "Samples", "Curves", "Compare"; ``.run_dirs``: the
    resolved run directories); with `refresh_s` > 0 a timer re-reads the runs every `refresh_s` seconds.
    `trust_run_code`: live generation may import the code the runs' configs name (`run_code_problems`);
    `data_roots`: folders outside the runs whose images a grounding row may name as its input image."""
    gr = _check_gradio()
    runs = [str(Path(r).resolve()) for r in run_dirs]
    if not runs:
        raise ValueError("no run directory given")
    roots = [str(Path(r).resolve()) for r in data_roots]
    labels = [(run_label(r), r) for r in runs]
    steps0 = list_steps(runs[0])
    groups0 = list_groups(runs[0], steps0[-1]) if steps0 else []
    ui = SimpleNamespace()
    with gr.Blocks(title="mmalign demo") as demo:
        gr.Markdown("# mmalign: samples of a run")
        ui.status = gr.Markdown("\n\n".join(run_status(r) for r in runs), elem_id="run-status")
        _samples_tab(gr, ui, labels, steps0, groups0)
        _curves_tab(gr, ui, runs)
        _compare_tab(gr, ui, runs, labels, steps0, groups0)
        gr.Markdown(
            "*Live generation imports the code the runs' configs name (`--trust-run-code`).*"
            if trust_run_code
            else "*Live generation imports no code a run's config names (a `package.module:attr`, "
            "`trust_remote_code`); start the demo with `--trust-run-code` to allow it.*",
            elem_id="trust-note",
        )
        _wire_samples(demo, ui, runs, roots)
        curves = _wire_curves(runs, ui)
        _wire_compare(gr, ui, runs, trust_run_code)
        if refresh_s and refresh_s > 0:
            _wire_timer(gr, runs, ui, curves, refresh_s)
    demo.run_dirs = runs
    return demo


def launch_app(
    run_dirs: Sequence[str | Path],
    host: str = "127.0.0.1",
    port: int | None = 7860,
    *,
    refresh_s: float = 5.0,
    block: bool = True,
    quiet: bool = False,
    trust_run_code: bool = False,
    data_roots: Sequence[str | Path] = (),
) -> Any:
    """Build (`build_app`) and serve the demo on `host`:`port`, never through a Gradio share link. Gradio is
    handed copies of the checked media only and every run directory is blocked (`served_paths`), so its file
    route serves no file of a run. Prints one line with the address (unless `quiet`; Gradio's own launch
    lines, its "set share=True" hint included, are silenced). With `block` False the server runs in a thread:
    call ``.close()`` on the returned `gr.Blocks` (its ``.local_url`` is the address)."""
    demo = build_app(run_dirs, refresh_s=refresh_s, trust_run_code=trust_run_code, data_roots=data_roots)
    demo.queue(default_concurrency_limit=4)
    allowed, blocked = served_paths(demo.run_dirs)
    demo.launch(
        server_name=host,
        server_port=port,
        allowed_paths=allowed,
        blocked_paths=blocked,
        prevent_thread_lock=True,
        quiet=True,  # Gradio's lines: its local URL and the "set share=True" hint; ours follows
        inbrowser=False,
        share=False,
    )
    if not quiet:
        runs = ", ".join(run_label(r) for r in demo.run_dirs)
        print(f"mmalign demo: serving {runs} on {demo.local_url} (Ctrl+C stops it)", flush=True)
    if block:
        demo.block_thread()
    return demo


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mmalign demo",
        description="Browse the samples, rewards and curves of runs in a local web app (needs the demo extra).",
    )
    p.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (output_dir of mmalign train)"
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    p.add_argument(
        "--refresh",
        type=float,
        default=5.0,
        help="seconds between re-reads of the runs (default 5; 0: never)",
    )
    p.add_argument(
        "--trust-run-code",
        action="store_true",
        help="let live generation import the code the runs' config.yaml names (a reward or environment "
        "'package.module:attr', trust_remote_code); without it such a generation is refused. Only for runs "
        "you trust: a config is code when it is imported",
    )
    p.add_argument(
        "--data-root",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder outside the runs whose image files a grounding row may name as its input image "
        "(read and shown as pixels; repeatable). Without it the demo reads only files inside the runs",
    )
    return p


def demo_main(argv: list[str]) -> int:
    """`mmalign demo RUN_DIR [RUN_DIR ...] [--host H] [--port P] [--refresh S] [--trust-run-code]
    [--data-root DIR]`; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for r in args.run_dirs:
        path = Path(r)
        if not path.is_dir():
            print(f"mmalign demo: error: {r} is not a directory", file=sys.stderr)
            return 2
        if not any(
            (path / n).exists() for n in (rundir.METRICS_FILE, rundir.SAMPLES_DIR, rundir.CONFIG_FILE)
        ):
            print(
                f"mmalign demo: error: {r} is not a run directory (no {rundir.METRICS_FILE}, "
                f"{rundir.SAMPLES_DIR}/ or {rundir.CONFIG_FILE})",
                file=sys.stderr,
            )
            return 2
    try:
        _check_gradio()
    except ImportError as e:
        print(f"mmalign demo: error: {e}", file=sys.stderr)
        return 1
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"mmalign demo: warning: serving on {args.host}: anyone who can reach it sees these runs",
            file=sys.stderr,
        )
    for root in args.data_root:
        if not Path(root).is_dir():
            print(f"mmalign demo: error: --data-root {root} is not a directory", file=sys.stderr)
            return 2
    if args.trust_run_code:
        print(
            "mmalign demo: --trust-run-code: live generation imports the code the runs' configs name",
            file=sys.stderr,
        )
    launch_app(
        args.run_dirs,
        args.host,
        args.port,
        refresh_s=args.refresh,
        trust_run_code=args.trust_run_code,
        data_roots=args.data_root,
    )
    return 0
