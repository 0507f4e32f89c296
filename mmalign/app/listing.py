"""`mmalign list`: what the registries hold, and a cache of that listing.

`render` prints the registries' names and summary lines; `listing` caches that output under a `fingerprint`
of the code and installs it depends on.

Details: docs/architecture.md, "mmalign.app.listing".
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import io
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CACHE_FORMAT = "mmalign-list/1"
SOURCE_PACKAGES = ("mmalign", "pipelines", "rewards")
"""The packages whose code registers what `mmalign list` shows."""
ENTRY_POINT_GROUPS = ("mmalign.pipelines", "mmalign.rewards")
"""The plugin groups `mmalign list` shows (``pipelines.ENTRY_POINT_GROUP``, ``rewards.ENTRY_POINT_GROUP``)."""
LISTED_MODULES = (
    "pipelines",
    "rewards",
    "mmalign.algorithms.advantages",
    "mmalign.algorithms.reward_transforms",
    "mmalign.algorithms.losses",
    "mmalign.algorithms.flow_objectives",
    "mmalign.data.prompt_samplers",
    "mmalign.algorithms.sde",
    "mmalign.algorithms.filters",
    "mmalign.data.rollout_loops",
)
"""The modules that hold the registries listed: once one is imported, this process may have changed it."""


def listing(what: str) -> tuple[str, str]:
    """The text `mmalign list WHAT` prints on stdout and on stderr: from the cache when its fingerprint matches,
    else built (`render`) and stored."""
    if any(name in sys.modules for name in LISTED_MODULES):
        return render(what)
    try:
        key = fingerprint(what)
    except Exception:  # noqa: BLE001 - the cache must never break the command
        return render(what)
    path = cache_dir() / f"list-{what}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        cached = json.loads(path.read_text(encoding="utf-8"))
        if cached["key"] == key:
            return str(cached["out"]), str(cached["err"])
    out, err = render(what)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "out": out, "err": err}), encoding="utf-8")
        os.replace(tmp, path)
    return out, err


def render(what: str) -> tuple[str, str]:
    """Build the listing of `what` (``all`` or one section argument) from the registries: (stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        _render(what)
    return out.getvalue(), err.getvalue()


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/mmalign`` (default ``~/.cache/mmalign``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mmalign"


def fingerprint(
    what: str,
    *,
    packages: Iterable[str] = SOURCE_PACKAGES,
    groups: Iterable[str] = ENTRY_POINT_GROUPS,
) -> str:
    """The cache key of the listing of `what`: a sha256 of what the listing depends on (see the module
    docstring). Nothing is imported but ``importlib.metadata``."""
    from importlib.metadata import entry_points

    h = hashlib.sha256()
    _add(h, CACHE_FORMAT, sys.version, sys.executable, what)
    for name in packages:
        _add_package(h, name)
    for entry in sys.path:
        folder = Path(entry or os.curdir)
        if not folder.is_dir():
            continue
        with contextlib.suppress(OSError):
            for item in sorted(os.scandir(folder), key=lambda e: e.name):
                if item.name.endswith((".dist-info", ".egg-info", ".pth", ".egg-link")):
                    _add(h, os.path.join(entry, item.name), item.stat().st_mtime_ns)
    for group in groups:
        for ep in sorted(entry_points(group=group), key=lambda e: (e.name, e.value)):
            _add(h, group, ep.name, ep.value)
            _add_package(h, ep.value.split(":")[0].split(".")[0])
    return h.hexdigest()


def _add(h: Any, *parts: object) -> None:
    for part in parts:
        h.update(str(part).encode("utf-8", errors="replace") + b"\0")


def _add_package(h: Any, name: str) -> None:
    """The ``.py`` files of top-level module or package `name` where this process would import it from."""
    module = sys.modules.get(name)
    spec = module.__spec__ if module is not None else importlib.util.find_spec(name)
    if spec is None:
        _add(h, name, "not found")
        return
    places = list(spec.submodule_search_locations or []) or [spec.origin]
    for place in places:
        if place is None or not os.path.isdir(place):
            with contextlib.suppress(OSError, TypeError):
                st = os.stat(place)
                _add(h, place, st.st_size, st.st_mtime_ns)
            continue
        for root, dirs, files in os.walk(place):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
            for file in sorted(files):
                if file.endswith(".py"):
                    path = os.path.join(root, file)
                    with contextlib.suppress(OSError):
                        st = os.stat(path)
                        _add(h, path, st.st_size, st.st_mtime_ns)


def _list_section(title: str, items: list[tuple[str, str]]) -> None:
    print(f"{title}:")
    width = max((len(n) for n, _ in items), default=0)
    for name, desc in items:
        print(f"  {name:<{width}}  {desc}")


def _render(what: str) -> None:
    """Print the sections of `what` (stdout) and the plugins that failed to load (stderr)."""
    if what in ("pipelines", "all"):
        import pipelines

        items = []
        for n in pipelines.names():  # this package's modules and the mmalign.pipelines entry points
            origin = pipelines.origin(n)
            desc = pipelines.describe(n)
            items.append((n, f"{desc} [{origin}]" if origin and desc else f"[{origin}]" if origin else desc))
        _list_section("pipelines", items)
        for err in pipelines.load_errors():
            print(f"mmalign: warning: {err}", file=sys.stderr)
    if what in ("rewards", "all"):
        import rewards
        from mmalign.registry import PluginError

        builtin = set(rewards.names())  # before any entry point loads (one module may register several)
        items = []
        errors = []
        for n in rewards.entry_point_names():
            if n in builtin:
                continue
            try:  # an installed plugin: its summary line and the package it comes from
                obj = rewards.resolve(n)
            except Exception as e:  # noqa: BLE001 - a broken plugin must not hide the others
                # (a PluginError names the entry point, its distribution and the failure itself)
                errors.append(
                    str(e)
                    if isinstance(e, PluginError)
                    else f"reward entry point {n!r} could not be loaded: {e}"
                )
                items.append((n, "(entry point, failed to load)"))
                continue
            doc = (inspect.getdoc(obj) or "").strip().splitlines()
            package = (getattr(obj, "__module__", "") or "").split(".")[0]
            items.append((n, f"{doc[0] if doc else ''} [entry point: {package}]".strip()))
        listed = {n for n, _ in items}
        items += [(n, rewards.REGISTRY.describe(n)) for n in rewards.names() if n not in listed]
        _list_section("rewards", sorted(items))
        for err in errors:
            print(f"mmalign: warning: {err}", file=sys.stderr)
    if what in ("estimators", "all"):
        from mmalign.algorithms import advantages

        _list_section("estimators", [(n, advantages.REGISTRY.describe(n)) for n in advantages.names()])
        from mmalign.algorithms import reward_transforms

        _list_section(
            "reward transforms (algorithm.reward_transforms)",
            [(n, reward_transforms.TRANSFORMS.describe(n)) for n in reward_transforms.names()],
        )
    if what in ("losses", "all"):
        from mmalign.algorithms import losses

        _list_section("losses", [(n, losses.REGISTRY.describe(n)) for n in losses.names()])
        _list_section(
            "loss aggregations (algorithm.loss_agg)",
            [(n, losses.AGGREGATIONS.describe(n)) for n in losses.AGGREGATIONS.names()],
        )
        _list_section(
            "KL estimators (algorithm.kl_estimator)",
            [(n, losses.KL_ESTIMATORS.describe(n)) for n in losses.KL_ESTIMATORS.names()],
        )
        from mmalign.algorithms import flow_objectives

        _list_section(
            "flow objectives (algorithm.objective)",
            [(n, flow_objectives.REGISTRY.describe(n)) for n in flow_objectives.names()],
        )
    if what in ("samplers", "all"):
        from mmalign.data import prompt_samplers as samplers

        _list_section(
            "prompt samplers (data.sampler)", [(n, samplers.SAMPLERS.describe(n)) for n in samplers.names()]
        )
    if what in ("steps", "all"):
        from mmalign.algorithms import sde

        _list_section(
            "denoising steps (mmalign.algorithms.sde.step)", [(n, sde.STEPS.describe(n)) for n in sde.names()]
        )
    if what in ("filters", "all"):
        from mmalign.algorithms import filters

        _list_section(
            "filters (algorithm.filter)", [(n, filters.FILTERS.describe(n)) for n in filters.names()]
        )
    if what in ("loops", "all"):
        from mmalign.data import rollout_loops

        _list_section(
            "rollout loops (rollout.loop)",
            [(n, rollout_loops.LOOPS.describe(n)) for n in sorted(rollout_loops.LOOPS.names())],
        )
