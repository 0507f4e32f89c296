"""`mmalign.options`: a signature becomes a typed options dataclass, and config values are checked against its
annotations (hand-written expectations for each kind of annotation)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import pytest

from mmalign.options import check_values, describe, options_class, required_options


def estimator(
    rewards: Any,
    group: Any,
    *,
    context: Any = None,
    mode: Literal["a", "b"] = "a",
    scale: float = 1.0,
    steps: int = 3,
    flag: bool = False,
    name: str | None = None,
    clip: float | Sequence[float] = 0.2,
    table: dict[str, float] | None = None,
    items: list[int] = [1, 2],  # noqa: B006 - a mutable default must become a factory
    anything=5,  # no annotation: the default's type decides
    needed: float,
) -> None:
    del rewards, group, context, mode, scale, steps, flag, name, clip, table, items, anything, needed


def with_kwargs(x: Any, **options: Any) -> None:
    del x, options


def test_the_dataclass_mirrors_the_signature() -> None:
    cls = options_class(estimator, 2, frozenset({"context"}))
    assert cls is not None and cls.__name__ == "EstimatorOptions"
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert list(fields) == [
        "needed", "mode", "scale", "steps", "flag", "name", "clip", "table", "items", "anything",
    ]  # fmt: skip
    assert fields["scale"].type is float and fields["scale"].default == 1.0
    assert required_options(cls) == ["needed"]
    a, b = cls(needed=1.0), cls(needed=2.0)
    assert a.items == [1, 2] and a.items is not b.items  # a fresh list per instance
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.scale = 2.0  # type: ignore[misc]
    assert options_class(with_kwargs, 1) is None  # **kwargs: the function checks its own options
    assert options_class(estimator, 2, frozenset({"context"})) is cls  # derived once


@pytest.mark.parametrize(
    "options, problems",
    [
        ({"mode": "b", "scale": 2, "steps": 4, "flag": True, "name": None, "clip": [0.1, 0.3]}, []),
        ({"mode": "c"}, [("mode", "must be one of 'a', 'b', got str 'c'")]),
        ({"scale": "0.3"}, [("scale", "must be float, got str '0.3'")]),
        ({"scale": True}, [("scale", "must be float, got bool True")]),
        ({"steps": 2.5}, [("steps", "must be int, got float 2.5")]),
        ({"flag": 1}, [("flag", "must be bool, got int 1")]),
        ({"name": 3}, [("name", "must be str or None, got int 3")]),
        ({"clip": "x"}, [("clip", "must be float or list, got str 'x'")]),
        ({"table": [1]}, [("table", "must be dict or None, got list [1]")]),
        ({"items": {"a": 1}}, [("items", "must be list, got dict {'a': 1}")]),
        ({"anything": "five"}, [("anything", "must be float, got str 'five'")]),
        ({"anything": 6.5}, []),
    ],
)
def test_values_against_annotations(options: dict, problems: list) -> None:
    cls = options_class(estimator, 2, frozenset({"context"}))
    assert check_values(cls, options) == problems


def test_describe() -> None:
    assert describe(Literal["x", "y"]) == "one of 'x', 'y'"
    assert describe(float | None) == "float or None"
