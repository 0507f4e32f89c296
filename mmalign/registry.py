"""A small name -> object registry shared by estimators, losses, rewards and pipelines.

Also what lets plugins live outside this package: `Discovery` finds what a name means for a `Registry`
(a registered name, the submodules of a package, scanned with pkgutil, the entry points of a group, and
an explicit ``package.module:attr`` path, `import_path`: the one implementation of plugin lookup), and
the pipeline hook (`set_pipeline_finder` / `find_pipeline`) through which `mmalign.config` learns a
pipeline's options class without importing the ``pipelines`` package, which sits above it.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from mmalign.errors import MmalignError

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

T = TypeVar("T")


class RegistryError(MmalignError, KeyError):
    """Raised when a name is not registered (the message lists close matches); a KeyError too."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Maps names to objects; `register` is a decorator, `get` looks up with a helpful error.

    Each entry may carry metadata (keyword arguments of `register`), read with `meta(name)`.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._meta: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **meta: Any) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            self._meta[name] = dict(meta)
            return obj

        return deco

    def unregister(self, name: str) -> None:
        """Forget `name` (tests, reloading a plugin); no error if it is not registered."""
        self._items.pop(name, None)
        self._meta.pop(name, None)

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(self._items), n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise RegistryError(
                f"unknown {self.kind} {name!r}.{hint} Registered: {', '.join(self.names())}"
            ) from None

    def meta(self, name: str) -> dict[str, Any]:
        self.get(name)
        return self._meta[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def describe(self, name: str) -> str:
        """First line of the entry's docstring, for `mmalign list`."""
        doc = getattr(self.get(name), "__doc__", None) or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""


def option_checked(kind: str, name: str, fn: Callable[..., Any], n_positional: int) -> Callable[..., Any]:
    """Wrap ``fn`` so that unknown keyword options raise a TypeError naming ``kind name`` and the option."""
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return fn  # the function takes **kwargs on purpose: it validates itself
    allowed = {
        p.name
        for p in params[n_positional:]
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    }

    @functools.wraps(fn)
    def wrapper(*args: Any, **options: Any) -> Any:
        bad = sorted(set(options) - allowed)
        if bad:
            valid = ", ".join(sorted(allowed)) or "none"
            raise TypeError(
                f"{kind} {name!r} got unknown option(s) {', '.join(map(repr, bad))}; valid options: {valid}"
            )
        return fn(*args, **options)

    return wrapper


# ----------------------------------------------------------------------------- plugins


class PluginError(RegistryError):
    """A plugin module could not be imported; the message names the entry point and its distribution.

    A `RegistryError`, hence an `MmalignError` and a KeyError."""


def _dist_label(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:  # pragma: no cover - EntryPoint objects built by hand
        return "unknown distribution"
    name = getattr(dist, "name", None) or dist.metadata["Name"]
    version = getattr(dist, "version", None)
    return f"distribution {name!r}" + (f" {version}" if version else "")


def _entry_point_label(ep: EntryPoint, group: str) -> str:
    return f"entry point {ep.name!r} = {ep.value!r} (group {group}, {_dist_label(ep)})"


def refused_module(module_name: str) -> str | None:
    """Why a config may not name `module_name` in a ``module:attr`` reference, or None: a standard-library
    module or a builtin (``os``, ``subprocess``, ``builtins``, ``this``; `sys.stdlib_module_names`) and
    ``__main__`` are never a reward, pipeline, environment or model, and naming one only runs its code."""
    top = module_name.split(".")[0]
    if top == "__main__":
        return "'__main__' is the running program, not a plugin module"
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return f"{top!r} is a Python standard-library module, not a plugin"
    return None


def _not_found_hint(module_name: str) -> str:
    """A hint for a module that does not import but lies as a file in the working directory."""
    top = module_name.split(".")[0]
    here = [p for p in (Path(f"{top}.py"), Path(top) / "__init__.py") if p.is_file()]
    if not here:
        return ""
    return (
        f" ({here[0]} is in the working directory, which mmalign does not import from: install it as a package "
        "or put its folder on PYTHONPATH, if you trust it)"
    )


def import_path(spec: str, what: str, form: str = "package.module:Name") -> Any:
    """The object an explicit ``"package.module:attr"`` path names (``attr`` may be dotted: ``Class.method``).

    Importing the module runs its code: a config that names one is code (train only configs you trust).
    Errors name `what` (``"reward"``, ``"geometry model"``, ...) and `spec`: a ValueError when `spec` is not
    of the shape `form`, names a standard-library module or builtin (`refused_module`, checked before
    anything is imported) or a dunder attribute, or resolves to a standard-library function or class through
    another module (``pkg:os.system``); an ImportError when the module cannot be imported (whatever importing
    it raised, chained); an AttributeError when the module lacks the attribute."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r}: expected {form!r}")
    refused = refused_module(module_name)
    if refused is not None:
        raise ValueError(f"{what} {spec!r}: {refused}; expected {form!r} of an installed package")
    if any(part.startswith("__") for part in attr.split(".")):
        raise ValueError(f"{what} {spec!r}: a dunder attribute cannot be named; expected {form!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        hint = _not_found_hint(module_name) if isinstance(e, ModuleNotFoundError) else ""
        raise ImportError(
            f"{what} {spec!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}{hint}"
        ) from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    origin = getattr(obj, "__module__", None) if inspect.isroutine(obj) or isinstance(obj, type) else None
    if inspect.ismodule(obj):
        origin = obj.__name__
    refused = refused_module(origin) if isinstance(origin, str) else None
    if refused is not None:
        raise ValueError(
            f"{what} {spec!r} resolves to {origin}.{getattr(obj, '__qualname__', '')}: {refused}"
        )
    return obj


class Discovery:
    """Finds what a name means for `registry`, importing lazily: the one plugin lookup of the project.

    Sources: the registry itself; the modules of `package` and of its subpackages (``pkgutil.walk_packages``;
    names starting with ``_`` are skipped; None: no package is scanned); the entry points of `group`, each
    naming a module (or a ``module:object``) that registers on import, or (for `resolve`) the object itself;
    and, for `resolve`, an explicit ``package.module:attr`` path (`import_path`).

    `find(name)` imports as little as it can: the registry itself, then the module ``package.name``, then
    the entry points called `name`, and only then everything. `load_all()` imports everything once; a
    broken entry point is collected in `errors` (a `PluginError` naming it and its distribution) and
    skipped, except by `find` / `resolve` when the entry point carries the name looked up, which raises it.
    What was imported is remembered; `clear()` forgets it (and the cached entry-point list), not the registry.
    With `cache` False the entry-point list is read again at every lookup and a broken entry point is tried
    again (a plugin installed while the process runs is seen).
    """

    def __init__(
        self, registry: Registry[Any], package: str | None, group: str | None, *, cache: bool = True
    ) -> None:
        self.registry = registry
        self.package = package
        self.group = group
        self.cache = cache
        self.origins: dict[str, str] = {}
        """Registered name -> the entry point that registered it (`mmalign list` shows it)."""
        self.clear()

    def clear(self) -> None:
        self._scanned = False
        self._eps: list[EntryPoint] | None = None
        self._loaded: set[tuple[str, str]] = set()
        self._errors: dict[tuple[str, str], PluginError] = {}

    @property
    def errors(self) -> list[PluginError]:
        """The entry points that failed to load so far."""
        return list(self._errors.values())

    def entry_points(self) -> list[EntryPoint]:
        """The entry points of `group` (nothing is imported), each (name, value) once."""
        if self.group is None:
            return []
        if self._eps is None or not self.cache:
            from importlib.metadata import entry_points

            seen: set[tuple[str, str]] = set()
            self._eps = []
            for ep in entry_points(group=self.group):
                if (ep.name, ep.value) not in seen:  # a distribution found twice on sys.path
                    seen.add((ep.name, ep.value))
                    self._eps.append(ep)
        return self._eps

    def entry_point_names(self) -> list[str]:
        """The names of the entry points of `group`, sorted (nothing is imported)."""
        return sorted({ep.name for ep in self.entry_points()})

    def _load_entry_point(self, ep: EntryPoint) -> Any:
        """Import `ep`; the object it names. A failure is a `PluginError` naming it and its distribution."""
        key = (ep.name, ep.value)
        if self.cache and key in self._errors:
            raise self._errors[key]
        before = set(self.registry.names())
        try:
            obj = ep.load()
        except Exception as e:
            err = PluginError(
                f"{self.registry.kind} {_entry_point_label(ep, str(self.group))} could not be loaded: "
                f"{type(e).__name__}: {e}"
            )
            self._errors[key] = err
            raise err from e
        self._errors.pop(key, None)
        if key not in self._loaded:
            self._loaded.add(key)
            for name in set(self.registry.names()) - before:
                self.origins[name] = f"entry point {ep.name!r} of {_dist_label(ep)}"
        return obj

    def _import_module(self, name: str) -> bool:
        """Import the module called `name`: ``package.name``, else ``package.<subpackage>.name`` (one level
        down, e.g. ``pipelines.grounding.medloc``); whether one exists."""
        import pkgutil
        from importlib.util import find_spec

        if self.package is None or not name.isidentifier() or name.startswith("_"):
            return False
        candidates = [f"{self.package}.{name}"]
        pkg = importlib.import_module(self.package)
        candidates += [
            f"{info.name}.{name}"
            for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + ".")
            if info.ispkg and not info.name.rpartition(".")[2].startswith("_")
        ]
        for module in candidates:
            try:
                if find_spec(module) is None:
                    continue
            except ModuleNotFoundError:
                continue
            importlib.import_module(module)
            return True
        return False

    def find(self, name: str) -> bool:
        """Import what registers `name` (see the class); whether it is registered now. Raises the
        `PluginError` of a broken entry point called `name`."""
        if name in self.registry:
            return True
        if self._import_module(name) and name in self.registry:
            return True
        for ep in self.entry_points():
            if ep.name == name:
                self._load_entry_point(ep)
        if name in self.registry:
            return True
        self.load_all()
        return name in self.registry

    def load_all(self) -> list[PluginError]:
        """Import every module of `package` and every entry point of `group` (once); the broken entry points."""
        if not self._scanned:
            if self.package is not None:
                import pkgutil

                pkg = importlib.import_module(self.package)
                for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
                    if not any(part.startswith("_") for part in info.name.split(".")):
                        importlib.import_module(info.name)
            self._scanned = True
        for ep in self.entry_points():
            try:
                self._load_entry_point(ep)
            except PluginError:
                continue
        return self.errors

    def get(self, name: str) -> Any:
        """`registry.get(name)` after `find(name)`; an unknown name's error also names the broken entry points."""
        if not self.find(name):
            try:
                self.registry.get(name)
            except RegistryError as e:
                notes = "".join(f". Also: {err}" for err in self.errors)
                raise RegistryError(f"{e}{notes}") from None
        return self.registry.get(name)

    def resolve(self, spec: str) -> Any:
        """What `spec` names, in this order, importing only what that needs (never everything):

        1. a registered name (after importing ``package.spec`` when there is such a module);
        2. an entry point of `group` called `spec`: what it registered as `spec`, else the object it names
           (a broken one raises its `PluginError`);
        3. an explicit ``package.module:attr`` path (`spec` has a ``:``; `import_path`): a `RegistryError`
           naming the spec when it cannot be imported.

        Anything else is a `RegistryError` listing close matches, the registered names, the entry points of
        `group` and the path form."""
        if spec in self.registry:
            return self.registry.get(spec)
        if self._import_module(spec) and spec in self.registry:
            return self.registry.get(spec)
        for ep in self.entry_points():
            if ep.name == spec:
                obj = self._load_entry_point(ep)
                return self.registry.get(spec) if spec in self.registry else obj
        if ":" in spec:
            try:
                return import_path(spec, self.registry.kind, "package.module:Class")
            except (ImportError, AttributeError, ValueError) as e:
                raise RegistryError(str(e)) from e
        names = self.registry.names()
        eps = self.entry_point_names()
        close = difflib.get_close_matches(spec, list(dict.fromkeys(names + eps)), n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        installed = f" Entry points ({self.group}): {', '.join(eps) or 'none'}." if self.group else ""
        raise RegistryError(
            f"unknown {self.registry.kind} {spec!r}.{hint} Registered: {', '.join(names) or 'none'}."
            f"{installed} Or give an explicit 'package.module:Class' path."
        )

    def names(self) -> list[str]:
        self.load_all()
        return self.registry.names()


# The pipeline hook. `mmalign.config` validates a config's `options:` section with the options class the
# pipeline registered (``register_pipeline(name, options=...)`` in ``pipelines``), but must not import
# ``pipelines`` (which imports it). ``pipelines`` installs its finder here when imported; a caller may also
# pass its own finder to `mmalign.config.load_config`.

PipelineFinder = Callable[[str], "Mapping[str, Any] | None"]
"""name -> the pipeline's registration metadata (``options``: its options class or None), or None when no
source registers `name`; raises `PluginError` when the entry point of that name is broken."""

FINDER_GROUP = "mmalign.pipeline_finder"
"""The entry-point group naming the default finder (mmalign's own: ``pipelines:find``, declared in
pyproject.toml), loaded when none is installed yet: the core names no upper layer."""

_pipeline_finder: PipelineFinder | None = None


def set_pipeline_finder(finder: PipelineFinder | None) -> PipelineFinder | None:
    """Install the finder `find_pipeline` uses; returns the previous one."""
    global _pipeline_finder
    previous, _pipeline_finder = _pipeline_finder, finder
    return previous


def find_pipeline(name: str) -> Mapping[str, Any] | None:
    """The registration metadata of pipeline `name` through the installed finder (loading the entry point of
    `FINDER_GROUP` first if none is installed; loading ``pipelines`` installs its finder too); None if no source
    registers it or no finder is installed."""
    if _pipeline_finder is None:
        from importlib.metadata import entry_points

        for ep in entry_points(group=FINDER_GROUP):
            finder = ep.load()
            if _pipeline_finder is None:
                set_pipeline_finder(finder)
            break
    if _pipeline_finder is None:  # pragma: no cover - mmalign installed without its pipelines
        return None
    return _pipeline_finder(name)
