"""A small name -> object registry shared by estimators, losses, rewards and pipelines."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    """Raised when a name is not registered (the message lists close matches)."""

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
