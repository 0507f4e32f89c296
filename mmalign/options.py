"""Typed options of registry entries, derived from their signatures.

Every registered estimator, loss, filter, prompt sampler, reward transform, flow objective and reward declares
its options once, as keyword parameters with annotations and defaults. `options_class` turns that declaration
into a frozen dataclass (one field per option: name, type, default), so the options have a type that configs are checked
against before anything loads
(`mmalign.algorithms.names.check_names`, `rewards.base.check_reward_specs`); `type_problem` is the check of one
value against one field's annotation. Writing each declaration twice (a signature and a hand-written
dataclass) would let the two drift; deriving keeps one source.
"""

from __future__ import annotations

import collections.abc as cabc
import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union

__all__ = ["describe", "options_class", "required_options", "type_problem"]

_CONTAINERS = {
    list: (list, tuple),
    tuple: (list, tuple),
    cabc.Sequence: (list, tuple),
    set: (list, tuple, set),
    frozenset: (list, tuple, set),
    dict: (dict,),
    cabc.Mapping: (dict,),
}


def _annotation(fn: Callable[..., Any], p: inspect.Parameter) -> Any:
    """`p`'s annotation as an object (string annotations evaluated in `fn`'s module); `Any` when it cannot be
    resolved (a name imported only for type checkers) or is absent."""
    ann = p.annotation
    if ann is inspect.Parameter.empty:
        return Any
    if isinstance(ann, str):
        try:
            ann = eval(ann, getattr(fn, "__globals__", {}), {})  # noqa: S307 - the module's own annotation
        except Exception:  # noqa: BLE001 - unresolvable: no type check for this option
            return Any
    return ann


def options_class(
    fn: Callable[..., Any], skip: int = 0, exclude: frozenset[str] = frozenset()
) -> type | None:
    """The options `fn` declares after its first `skip` positional parameters (minus `exclude`: inputs its
    caller supplies) as a frozen dataclass named ``<fn>Options``: a field per option with its annotation and
    default (no default: a required option). None when `fn` takes ``**kwargs`` (it checks its options itself)
    or has no signature. Derived once per (function, skip, exclude); an unhashable callable every time."""
    try:
        return _cached_options_class(fn, skip, exclude)
    except TypeError:  # an unhashable callable object
        return _options_class(fn, skip, exclude)


def _options_class(fn: Callable[..., Any], skip: int, exclude: frozenset[str]) -> type | None:
    target = inspect.unwrap(fn)
    try:
        params = list(inspect.signature(target).parameters.values())[skip:]
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    fields, optional = [], []
    for p in params:
        if p.kind not in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            continue
        if p.name in exclude:
            continue
        ann = _annotation(target, p)
        if p.default is inspect.Parameter.empty:
            fields.append((p.name, ann))
        else:
            default = p.default
            spec = (
                dataclasses.field(default_factory=lambda d=default: type(d)(d))
                if isinstance(default, list | dict | set)
                else dataclasses.field(default=default)
            )
            optional.append((p.name, ann, spec))
    name = getattr(target, "__name__", type(target).__name__)
    if name == "__init__":
        name = target.__qualname__.split(".")[-2]
    cls_name = "".join(part.capitalize() for part in name.split("_")) + "Options"
    # required fields first (a dataclass cannot put a field without a default after one with a default)
    return dataclasses.make_dataclass(cls_name, [*fields, *optional], frozen=True, kw_only=True)


_cached_options_class = functools.cache(_options_class)


def required_options(cls: type) -> list[str]:
    """The fields of an `options_class` that have no default."""
    return [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]


def describe(hint: Any) -> str:
    """A reader's name for an annotation: ``float``, ``float or None``, ``one of 'a', 'b'``."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(hint))
    if hint is type(None) or hint is None:
        return "None"
    base = origin if origin is not None else hint
    if base in (list, tuple, cabc.Sequence):
        return "list"  # what a config writes for any of them
    if base in (dict, cabc.Mapping):
        return "dict"
    return getattr(base, "__name__", str(base))


def _conforms(value: Any, hint: Any) -> bool | None:
    """True / False when `hint` is one a config value can be checked against (bool, int, float, str, None,
    Literal, containers, unions of them), None (no opinion) for anything else (classes, callables, tensors)."""
    if hint is Any:
        return None
    if hint is type(None) or hint is None:
        return value is None
    origin = typing.get_origin(hint)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(hint))
    if origin in (Union, types.UnionType):
        verdicts = [_conforms(value, a) for a in typing.get_args(hint)]
        if any(v is True for v in verdicts):
            return True
        return None if any(v is None for v in verdicts) else False
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    base = origin if origin is not None else hint
    if base in _CONTAINERS:
        return isinstance(value, _CONTAINERS[base])
    return None


def type_problem(value: Any, field: dataclasses.Field) -> str | None:
    """What is wrong with `value` for the option `field` of an `options_class` (``"must be float, got str
    '0.3'"``), or None when it fits or its annotation is not one a config value can be checked against. Without
    a usable annotation, a bool / number / string default gives the expected type."""
    hint = field.type
    verdict = _conforms(value, hint)
    if verdict is None and field.default is not dataclasses.MISSING and field.default is not None:
        default = field.default
        if isinstance(default, bool | int | float | str):
            hint = (
                float if isinstance(default, int | float) and not isinstance(default, bool) else type(default)
            )
            verdict = _conforms(value, hint)
    if verdict is False:
        return f"must be {describe(hint)}, got {type(value).__name__} {value!r}"
    return None


def check_values(cls: type, options: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(option, problem) for every value in `options` that does not fit its field of `cls` (unknown names are
    the caller's concern: it words that error)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = []
    for name, value in options.items():
        if name in fields:
            problem = type_problem(value, fields[name])
            if problem is not None:
                out.append((name, problem))
    return out
