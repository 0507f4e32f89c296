"""The reward plugin API: `Reward`, `RewardBatch`, loading by name / entry point / path, `RewardSet`.

A reward is a `Reward` subclass registered with ``@register_reward(name)`` (or a plain function, TRL style
``f(prompts, completions, **columns)`` or batch style ``f(batch, **options)``): ``needs`` names the outputs it
reads and ``__call__(batch)`` returns Float[B] (NaN = not applicable), or Float[B, T] with ``per_step = True``.
`load_reward` resolves a registered name, then a ``mmalign.rewards`` entry point, then a
``"package.module:attr"`` path. `RewardSet` returns Float[B, K] (one column per reward) and, for per-step
rewards, writes ``rollout.step_rewards``; combining the columns is `mmalign.algorithms.advantages.combine_rewards`.
The full contract (function styles, ``last_metrics``, shapes, the per-entry options ``device``, ``batch_size``,
``timeout_s``): docs/architecture.md, "Rewards", and docs/reward_plugins.md.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from mmalign.errors import MmalignError
from mmalign.options import check_values, options_class
from mmalign.registry import Discovery, Registry

__all__ = [
    "check_options",
    "ENTRY_POINT_GROUP",
    "REGISTRY",
    "FunctionReward",
    "Reward",
    "RewardBatch",
    "RewardError",
    "RewardKeyError",
    "RewardSet",
    "RewardSpec",
    "check_reward_specs",
    "entry_point_names",
    "get",
    "load_reward",
    "names",
    "register_reward",
    "resolve",
    "spec_problem",
    "takes_option",
]

ENTRY_POINT_GROUP = "mmalign.rewards"

REGISTRY: Registry[Any] = Registry("reward")

DISCOVERY = Discovery(REGISTRY, None, ENTRY_POINT_GROUP, cache=False)
"""Reward lookup (`resolve`): registered names, the ``mmalign.rewards`` entry points (read at each lookup,
so a plugin installed while the process runs is found) and explicit ``package.module:attr`` paths."""


class RewardError(MmalignError, RuntimeError):
    """A reward failed or returned something unusable; the message names the reward (a RuntimeError too)."""


class _RewardTimeout(Exception):
    """Internal: a reward call ran past its ``timeout_s`` (re-raised as a `RewardError`)."""


class RewardKeyError(MmalignError, KeyError):
    """A key is missing from a `RewardBatch` (the message lists the available keys)."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


# --------------------------------------------------------------------------- the batch
@dataclass
class RewardBatch:
    """What a reward receives: one entry per sample in every list / first tensor dimension.

    - ``prompts``  list[str]
    - ``outputs``  dict: "texts" list[str], "num_tokens" Long[B], "images" Float[B,3,H,W], ...
    - ``columns``  dict[str, list]: every dataset column, one value per sample
    - ``group``    Long[B]: which prompt each sample came from (default: each sample its own group)
    - ``mask``     Bool[B,T] or None: the valid actions (``rollout.mask``); a per-step reward returns
      Float[B,T] with this T. None when the batch was not built from a rollout.

    ``batch["key"]`` looks the key up in ``columns``, then in ``outputs``.
    """

    prompts: list[str]
    outputs: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, list[Any]] = field(default_factory=dict)
    group: Tensor | None = None
    mask: Tensor | None = None

    def __post_init__(self) -> None:
        n = len(self.prompts)
        if self.group is None:
            self.group = torch.arange(n)
        elif self.group.shape[0] != n:
            raise ValueError(f"RewardBatch: {n} prompts but group has {self.group.shape[0]} entries")
        if self.mask is not None and (self.mask.dim() != 2 or self.mask.shape[0] != n):
            raise ValueError(f"RewardBatch: {n} prompts but mask has shape {tuple(self.mask.shape)}")

    @classmethod
    def from_rollout(cls, rollout: Any) -> RewardBatch:
        """The reward view of a `mmalign.data.batch.Rollout` (shares its lists and tensors, no copies)."""
        return cls(
            prompts=list(rollout.prompts),
            outputs=rollout.outputs,
            columns=rollout.columns,
            group=rollout.group,
            mask=getattr(rollout, "mask", None),
        )

    def __len__(self) -> int:
        return len(self.prompts)

    def keys(self) -> list[str]:
        """Every key ``batch[key]`` can find: the columns, then the outputs."""
        return list(self.columns) + [k for k in self.outputs if k not in self.columns]

    def __contains__(self, key: object) -> bool:
        return key in self.columns or key in self.outputs

    def __getitem__(self, key: str) -> Any:
        if key in self.columns:
            return self.columns[key]
        if key in self.outputs:
            return self.outputs[key]
        raise RewardKeyError(
            f"{key!r} is neither a dataset column nor an output. "
            f"Columns: {sorted(self.columns) or 'none'}; outputs: {sorted(self.outputs) or 'none'}"
        )

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    @property
    def texts(self) -> list[str]:
        """The decoded completions, ``outputs["texts"]``."""
        if "texts" not in self.outputs:
            raise RewardKeyError(f"the outputs have no 'texts'; outputs: {sorted(self.outputs) or 'none'}")
        return self.outputs["texts"]


# ------------------------------------------------------------------------- the reward
class Reward:
    """Base class of rewards. Subclasses implement ``__call__(batch) -> Float[B]`` (NaN = not applicable).

    Options from the config arrive as keyword arguments of the constructor; a subclass without
    options need not define ``__init__`` (then any option is a TypeError naming the reward).
    ``needs`` lists what the reward reads from the outputs (the trainer decodes pixels only if some
    reward needs "images"). ``per_step = True`` makes it a process reward: ``__call__`` then returns
    Float[B, T] with T = ``batch.mask.shape[1]`` (see the module docstring). ``name`` is the
    registered name; the loader sets it on the instance to the spec it was loaded by. Rewards are
    called under ``torch.no_grad()`` by `RewardSet`.
    """

    needs: ClassVar[set[str]] = set()
    per_step: ClassVar[bool] = False
    name: str = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__name__

    def __init__(self, **options: Any) -> None:
        if options:
            raise TypeError(
                f"reward {self.name!r} takes no options, got {', '.join(map(repr, sorted(options)))}"
            )

    def __call__(self, batch: RewardBatch) -> Tensor | list[float]:
        raise NotImplementedError(f"reward {self.name!r} does not implement __call__(batch)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _accepted_options(fn: Callable[..., Any], skip: int) -> tuple[set[str], bool]:
    """Keyword names `fn` accepts (after `skip` leading positional parameters) and whether it has **kwargs."""
    params = list(inspect.signature(fn).parameters.values())[skip:]
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, var_kw


def check_options(
    name: str, fn: Callable[..., Any], skip: int, options: Mapping[str, Any], check_missing: bool = True
) -> None:
    """TypeError naming the reward for options `fn` does not take, values that do not fit an option's
    annotation (`mmalign.options`: the reward's options dataclass derived from `fn`'s signature), or required
    ones that are missing."""
    try:
        params = list(inspect.signature(fn).parameters.values())[skip:]
    except (TypeError, ValueError):  # no signature available (builtins): let the call decide
        return
    accepted, var_kw = _accepted_options(fn, skip)
    unknown = sorted(set(options) - accepted)
    if unknown and not var_kw:
        known = ", ".join(sorted(accepted)) or "none"
        raise TypeError(
            f"reward {name!r} got unknown option(s) {', '.join(map(repr, unknown))}; its options: {known}"
        )
    declared = options_class(fn, skip)
    if declared is not None:
        for option, problem in check_values(declared, options):
            raise ValueError(f"reward {name!r}: option {option!r} {problem}")
    missing = [
        p.name
        for p in params
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in options
    ]
    if missing and check_missing:
        raise TypeError(f"reward {name!r} needs the option(s) {', '.join(map(repr, missing))}")


class FunctionReward(Reward):
    """A plain function used as a reward (batch style or TRL style; see the module docstring).

    The function's ``needs`` and ``per_step`` attributes, if set, become the reward's.
    """

    def __init__(self, fn: Callable[..., Any], name: str | None = None, **options: Any) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.style = self.detect_style(fn)
        self.needs = set(getattr(fn, "needs", {"texts"}))
        self.per_step = bool(getattr(fn, "per_step", False))
        self.options = dict(options)
        batch_style = self.style == "batch"
        check_options(self.name, fn, 1 if batch_style else 0, self.options, check_missing=batch_style)
        if self.style == "trl":
            try:
                self._accepted, self._var_kw = _accepted_options(fn, 0)
            except (TypeError, ValueError):
                self._accepted, self._var_kw = set(), True

    @staticmethod
    def detect_style(fn: Callable[..., Any]) -> str:
        """Return "trl" if `fn` has a parameter named ``completions``, else "batch"."""
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return "batch"
        return "trl" if "completions" in params else "batch"

    def __call__(self, batch: RewardBatch) -> Any:
        if self.style == "batch":
            return self.fn(batch, **self.options)
        columns = {k: v for k, v in batch.columns.items() if k not in ("prompts", "completions")}
        kwargs = {"prompts": batch.prompts, "completions": batch.texts, **columns, **self.options}
        if not self._var_kw:  # pass only what it names (TRL itself always passes prompts=...)
            kwargs = {k: v for k, v in kwargs.items() if k in self._accepted}
        return self.fn(**kwargs)


def register_reward(name: str, **meta: Any) -> Callable[[Any], Any]:
    """Decorator registering a `Reward` subclass (or a reward function) under `name`."""

    def deco(obj: Any) -> Any:
        if isinstance(obj, type):
            if not issubclass(obj, Reward):
                raise TypeError(f"@register_reward({name!r}): {obj.__name__} must subclass rewards.Reward")
            obj.name = name
        elif not callable(obj):
            raise TypeError(f"@register_reward({name!r}) decorates a Reward subclass or a function")
        return REGISTRY.register(name, **meta)(obj)

    return deco


def get(name: str) -> Any:
    """The reward class (or function) registered as `name`, loading the ``mmalign.rewards`` entry point of that
    name first if it is not registered yet; `RegistryError` (a KeyError) if unknown."""
    return DISCOVERY.get(name)


def names() -> list[str]:
    """The registered reward names, sorted (entry points: `entry_point_names()`)."""
    return REGISTRY.names()


def entry_point_names() -> list[str]:
    """Names of the rewards installed through the ``mmalign.rewards`` entry-point group (nothing is imported)."""
    return DISCOVERY.entry_point_names()


def resolve(spec: str) -> Any:
    """What the reward `spec` names (`mmalign.registry.Discovery.resolve`): a registered name, an entry point
    of group ``mmalign.rewards`` (only that one is imported) or a ``package.module:attr`` path. Nothing is
    constructed. Unknown or broken: a `RegistryError` (a KeyError) listing the registered names and the
    installed entry points, or naming the entry point (`PluginError`) or the path that failed."""
    return DISCOVERY.resolve(spec)


def load_reward(spec: str, **kwargs: Any) -> Reward:
    """Build the reward `spec` (registered name, entry point or ``module:attr``) with options `kwargs`.

    Unknown options are a TypeError naming the reward; an unknown spec a `RegistryError` (a KeyError)
    listing the registered names and the installed entry points.
    """
    obj = resolve(spec)
    if isinstance(obj, type):
        if not issubclass(obj, Reward):
            raise TypeError(
                f"reward {spec!r} resolves to class {obj.__qualname__}, which does not subclass rewards.Reward "
                f"(a reward is a Reward subclass or a function)"
            )
        check_options(spec, obj.__init__, 1, kwargs)
        reward = obj(**kwargs)
    elif isinstance(obj, Reward):
        if kwargs:
            raise TypeError(f"reward {spec!r} is an already built Reward instance and takes no options")
        reward = obj
    elif callable(obj):
        return FunctionReward(obj, name=spec, **kwargs)
    else:
        raise TypeError(f"reward {spec!r} resolves to {type(obj).__name__}, not a Reward class or a function")
    reward.name = spec
    return reward


# ---------------------------------------------------------------------- a set of rewards
@dataclass
class RewardSpec:
    """One entry of the config's reward list; `alias` names the column (default: `name`).

    The fields mirror `mmalign.config.RewardConfig` (same names, same meaning)."""

    name: str
    """Registered name, entry point of group `mmalign.rewards`, or `package.module:Class`."""
    weight: float = 1.0
    """Weight of this reward in the total reward (0: logged only)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Options of the reward (its constructor's keyword arguments)."""
    alias: str | None = None
    """Column name of this reward in metrics and samples (default: `name`)."""
    device: str | None = None
    """Where the reward's model runs (e.g. `cuda:1`, `cpu`): passed to its constructor as `device=`."""
    batch_size: int | None = None
    """Score at most this many samples per call, in consecutive chunks (null: the whole batch at once)."""
    timeout_s: float | None = None
    """Wall-clock limit of one call in seconds; past it a `RewardError` (null: no limit)."""

    @property
    def column(self) -> str:
        return self.alias or self.name

    @classmethod
    def coerce(cls, item: Any) -> RewardSpec:
        """A RewardSpec from a RewardSpec, a name, a mapping, or any object with the same fields
        (e.g. `mmalign.config.RewardConfig`)."""
        if isinstance(item, RewardSpec):
            return item
        if isinstance(item, str):
            return cls(name=item)
        allowed = [f.name for f in dataclasses.fields(cls)]
        if isinstance(item, Mapping):
            unknown = sorted(set(item) - set(allowed))
            if unknown:
                raise TypeError(f"reward entry {dict(item)!r}: unknown key(s) {unknown}; allowed: {allowed}")
            return cls(**item)
        if hasattr(item, "name"):
            return cls(**{k: getattr(item, k) for k in allowed if hasattr(item, k)})
        raise TypeError(f"cannot make a RewardSpec from {type(item).__name__}: {item!r}")


def _fmt_rows(rows: Iterable[int], limit: int = 8) -> str:
    rows = list(rows)
    shown = ", ".join(map(str, rows[:limit]))
    return f"[{shown}{', ...' if len(rows) > limit else ''}]"


def takes_option(obj: Any, option: str) -> bool:
    """Whether the reward `obj` (a `Reward` subclass, instance or function, as `load_reward` resolves it)
    accepts the keyword option `option` (e.g. ``"device"``); a ``**kwargs`` parameter accepts any."""
    if isinstance(obj, type):
        if obj.__init__ is Reward.__init__:  # the base class takes no options at all
            return False
        fn, skip = obj.__init__, 1
    elif isinstance(obj, Reward) or not callable(obj):
        return False
    else:
        fn, skip = obj, 1 if FunctionReward.detect_style(obj) == "batch" else 0
    try:
        named, var_kw = _accepted_options(fn, skip)
    except (TypeError, ValueError):  # no signature available: let the call decide
        return True
    return option in named or var_kw


def spec_problem(
    spec: RewardSpec, index: int, key: str = "rewards", obj: Any = None
) -> tuple[str, Exception] | None:
    """The first problem with the per-reward options ``device``, ``batch_size`` and ``timeout_s`` of
    `spec` (entry `index` of the config list `key`), as (config key, exception), or None.

    `obj` is what the spec's name resolves to (`resolve`); when given and ``device`` is set, a reward
    whose constructor takes no ``device`` is a problem. `RewardSet` raises these; `check_reward_specs` reports
    them before any model loads."""
    where = f"{key}[{index}]"
    label = f"{where} ({spec.name!r})"
    if spec.device is not None:
        if not isinstance(spec.device, str) or not spec.device:
            return f"{where}.device", ValueError(
                f"{label}: device must be a device name such as 'cuda:1' or 'cpu', got {spec.device!r}"
            )
        try:
            torch.device(spec.device)
        except (RuntimeError, ValueError) as e:
            return f"{where}.device", ValueError(
                f"{label}: device {spec.device!r} is not a torch device: {e}"
            )
        if "device" in spec.kwargs:
            return f"{where}.device", ValueError(
                f"{label}: device is given twice, as {where}.device ({spec.device!r}) and as "
                f"{where}.kwargs.device ({spec.kwargs['device']!r}); keep one"
            )
        if obj is not None and not takes_option(obj, "device"):
            return f"{where}.device", TypeError(
                f"{label}: reward {spec.name!r} takes no `device` option (its constructor has no `device` "
                f"parameter), so {where}.device cannot be used; remove it"
            )
    b = spec.batch_size
    if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
        return f"{where}.batch_size", ValueError(
            f"{label}: batch_size must be an integer >= 1 or null, got {b!r}"
        )
    t = spec.timeout_s
    if t is not None and (
        isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t <= 0
    ):
        return f"{where}.timeout_s", ValueError(
            f"{label}: timeout_s must be a finite number of seconds > 0 or null, got {t!r}"
        )
    return None


def _rows(value: Any, start: int, stop: int, n: int) -> Any:
    """Rows start:stop of `value` if its first dimension is the batch (length n), recursively in dicts."""
    if isinstance(value, Tensor):
        return value[start:stop] if value.dim() > 0 and value.shape[0] == n else value
    if isinstance(value, dict):
        return {k: _rows(v, start, stop, n) for k, v in value.items()}
    if isinstance(value, list | tuple) and len(value) == n:
        return value[start:stop]
    return value


def _chunk(batch: RewardBatch, start: int, stop: int) -> RewardBatch:
    """Samples start:stop of `batch` (views and list slices; per-sample = first dimension of length B)."""
    n = len(batch)
    return RewardBatch(
        prompts=batch.prompts[start:stop],
        outputs=_rows(batch.outputs, start, stop, n),
        columns=_rows(batch.columns, start, stop, n),
        group=None if batch.group is None else batch.group[start:stop],
        mask=None if batch.mask is None else batch.mask[start:stop],
    )


def _combine_metrics(entries: list[tuple[float, int]]) -> float:
    """One number from a metric reported by several chunks: the mean weighted by chunk size over the
    non-NaN values (NaN if all are NaN); a single chunk's value unchanged."""
    if len(entries) == 1:
        return entries[0][0]
    valid = [(v, w) for v, w in entries if not math.isnan(v)]
    if not valid:
        return math.nan
    total = sum(w for _, w in valid)
    if total == 0:
        return sum(v for v, _ in valid) / len(valid)
    return sum(v * w for v, w in valid) / total


class RewardSet:
    """The rewards of a config, evaluated together into Float[B, K] columns (NaN = not applicable).

    ``names`` are the column names (alias or spec name), ``needs`` the union of the rewards' needs.
    ``weights`` Float[K] are the OUTCOME weights: each outcome reward's configured weight, 0 for the
    per-step (process) rewards, whose columns only report each sample's mean step reward.
    ``step_weights`` Float[K] hold each per-step reward's configured weight (0 for outcome columns);
    ``per_step_names`` / ``is_per_step`` tell which columns are per-step. Weighting the outcome
    columns is `mmalign.algorithms.advantages.combine_rewards`' job; `__call__` writes the weighted step rewards
    to ``rollout.step_rewards``. Without per-step rewards ``weights`` are the configured weights.
    """

    def __init__(
        self,
        specs: Sequence[RewardSpec | str | Mapping[str, Any] | Any],
        source: str | None = None,
        key: str = "rewards",
    ) -> None:
        """Build every reward of `specs`. With `source` (the config file), a bad entry raises
        `mmalign.config.ConfigError` naming the file and the key (``rewards[i].name`` / ``.kwargs``;
        `key` is the list's key in the config, e.g. ``eval.rewards``)."""
        self.specs = [RewardSpec.coerce(s) for s in specs]
        seen: dict[str, int] = {}
        for i, s in enumerate(self.specs):
            if not isinstance(s.weight, int | float) or not math.isfinite(s.weight):
                raise self._config_error(
                    source,
                    f"{key}[{i}].weight",
                    ValueError(f"{key}[{i}] ({s.name!r}): weight must be a finite number, got {s.weight!r}"),
                )
            if s.column in seen:
                raise self._config_error(
                    source,
                    f"{key}[{i}].alias",
                    ValueError(
                        f"{key}[{i}] and {key}[{seen[s.column]}] are both named {s.column!r}; "
                        f"give one of them an alias"
                    ),
                )
            seen[s.column] = i
            problem = spec_problem(s, i, key)
            if problem is not None:
                raise self._config_error(source, *problem)
        self.key = key
        self.rewards: list[Reward] = []
        for i, s in enumerate(self.specs):
            options = dict(s.kwargs)
            if s.device is not None:
                try:
                    obj = resolve(s.name)
                except (KeyError, ImportError, AttributeError) as e:
                    raise self._config_error(source, f"{key}[{i}].name", e) from e
                problem = spec_problem(s, i, key, obj=obj)
                if problem is not None:
                    raise self._config_error(source, *problem)
                options["device"] = s.device
            try:
                self.rewards.append(load_reward(s.name, **options))
            except (TypeError, ValueError) as e:
                raise self._config_error(source, f"{key}[{i}].kwargs", e) from e
            except (KeyError, ImportError, AttributeError) as e:
                raise self._config_error(source, f"{key}[{i}].name", e) from e
        self.last_metrics: dict[str, float] = {}
        """Extra numbers the rewards reported on the last call (a reward sets ``self.last_metrics``, a dict
        of floats, while scoring): ``reward/<column>/<key>``, e.g. ``reward/box_iou/unparsed_frac``."""

    @staticmethod
    def _config_error(source: str | None, key: str, err: Exception) -> Exception:
        if source is None:
            return err
        from mmalign.config import ConfigError

        text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        return ConfigError(f"{source}: key '{key}': {text}")

    @classmethod
    def from_rewards(cls, rewards: Sequence[Reward], weights: Sequence[float] | None = None) -> RewardSet:
        """A set of already built rewards (columns named by ``reward.name``)."""
        weights = [1.0] * len(rewards) if weights is None else list(weights)
        if len(weights) != len(rewards):
            raise ValueError(f"{len(rewards)} rewards but {len(weights)} weights")
        self = cls.__new__(cls)
        self.key = "rewards"
        self.specs = [RewardSpec(name=r.name, weight=float(w)) for r, w in zip(rewards, weights, strict=True)]
        if len({s.column for s in self.specs}) != len(self.specs):
            raise ValueError(f"reward names must be distinct, got {[s.column for s in self.specs]}")
        self.rewards = list(rewards)
        return self

    # ------------------------------------------------------------------ what it holds
    @property
    def names(self) -> list[str]:
        return [s.column for s in self.specs]

    @property
    def is_per_step(self) -> list[bool]:
        """One entry per column: True for a per-step (process) reward."""
        return [bool(getattr(r, "per_step", False)) for r in self.rewards]

    @property
    def per_step_names(self) -> list[str]:
        """The column names of the per-step (process) rewards, in column order."""
        return [s.column for s, p in zip(self.specs, self.is_per_step, strict=True) if p]

    @property
    def weights(self) -> Tensor:
        """Float[K] outcome weights: the configured weight of each outcome reward, 0 for per-step ones."""
        return torch.tensor(
            [0.0 if p else float(s.weight) for s, p in zip(self.specs, self.is_per_step, strict=True)],
            dtype=torch.float32,
        )

    @property
    def step_weights(self) -> Tensor:
        """Float[K]: the configured weight of each per-step reward, 0 for outcome ones."""
        return torch.tensor(
            [float(s.weight) if p else 0.0 for s, p in zip(self.specs, self.is_per_step, strict=True)],
            dtype=torch.float32,
        )

    @property
    def needs(self) -> set[str]:
        out: set[str] = set()
        for r in self.rewards:
            out |= set(getattr(r, "needs", ()))
        return out

    def __len__(self) -> int:
        return len(self.rewards)

    def __repr__(self) -> str:
        parts = [
            f"{s.column}*{s.weight:g}{' per step' if p else ''}"
            for s, p in zip(self.specs, self.is_per_step, strict=True)
        ]
        return f"RewardSet({', '.join(parts)})"

    def _label(self, k: int) -> str:
        s = self.specs[k]
        inner = f"{s.name}, rewards[{k}]" if s.alias else f"rewards[{k}]"
        return f"reward {s.column!r} ({inner})"

    # ---------------------------------------------------------------------- scoring
    def __call__(self, data: Any, prompts: Sequence[str] | None = None) -> Tensor:
        """Float[B, K] for a `Rollout` or a `RewardBatch` (on the device of its ``group``).

        `prompts`, if given, replaces the batch's prompts. Each reward runs under ``torch.no_grad()``.
        A per-step reward's column is each sample's mean over its valid, non-NaN steps (NaN if none).
        Called on a `Rollout` with at least one per-step reward, this also sets
        ``rollout.step_rewards`` = sum_k step_weights[k] * r_k, Float[B, T] (NaN read as 0, 0 where
        ``rollout.mask`` is False); without per-step rewards ``rollout.step_rewards`` is not touched.
        A spec's ``batch_size`` splits the batch into chunks for that reward, its ``timeout_s`` bounds
        each call (see the module docstring).
        """
        is_batch = isinstance(data, RewardBatch)
        batch = data if is_batch else RewardBatch.from_rollout(data)
        if prompts is not None:
            batch = dataclasses.replace(batch, prompts=list(prompts))
        n = len(batch)
        mask = None if batch.mask is None else batch.mask.detach().to("cpu").bool()
        per_step = self.is_per_step
        cols = []
        steps: list[tuple[float, Tensor]] = []
        self.last_metrics = {}
        chunks: dict[int, list[tuple[int, int, RewardBatch]]] = {}  # shared by rewards of one batch_size
        with torch.no_grad():
            for k, reward in enumerate(self.rewards):
                size = getattr(self.specs[k], "batch_size", None)
                if size is None or size >= n:
                    parts = [(0, n, batch)]
                else:
                    if size not in chunks:
                        bounds = [(a, min(a + size, n)) for a in range(0, n, size)]
                        chunks[size] = [(a, b, _chunk(batch, a, b)) for a, b in bounds]
                    parts = chunks[size]
                metrics: dict[str, list[tuple[float, int]]] = {}
                col_parts: list[Tensor] = []
                step_parts: list[Tensor] = []
                for a, b, part in parts:
                    out = self._call_one(k, reward, part)
                    for key, value in (getattr(reward, "last_metrics", None) or {}).items():
                        metrics.setdefault(key, []).append((float(value), b - a))
                    try:
                        sub_mask = None if mask is None else mask[a:b]
                        if per_step[k]:
                            col, step = self._validate_steps(k, out, b - a, sub_mask)
                            step_parts.append(step)
                        else:
                            col = self._validate(k, out, b - a)
                    except RewardError as e:
                        if len(parts) == 1:
                            raise
                        raise RewardError(
                            f"{e} (samples {a}..{b - 1} of {n}; {self._key}[{k}].batch_size = {size})"
                        ) from e
                    col_parts.append(col)
                for key, entries in metrics.items():
                    self.last_metrics[f"reward/{self.specs[k].column}/{key}"] = _combine_metrics(entries)
                if per_step[k]:
                    widths = sorted({p.shape[1] for p in step_parts})
                    if len(widths) > 1:
                        raise RewardError(
                            f"{self._label(k)} returned a different number of steps T per chunk {widths} "
                            f"({self._key}[{k}].batch_size = {size}); every chunk must give the same T"
                        )
                    steps.append((float(self.specs[k].weight), torch.cat(step_parts, dim=0)))
                cols.append(torch.cat(col_parts, dim=0) if len(col_parts) > 1 else col_parts[0])
        device = batch.group.device if batch.group is not None else torch.device("cpu")
        if steps and not is_batch:
            total = torch.zeros_like(steps[0][1])
            for w, step in steps:
                total = total + w * step
            data.step_rewards = total.to(device)
        if not cols:
            return torch.zeros(n, 0, dtype=torch.float32, device=device)
        return torch.stack(cols, dim=1).to(device)

    @property
    def _key(self) -> str:
        return getattr(self, "key", "rewards")

    def _call_one(self, k: int, reward: Reward, batch: RewardBatch) -> Any:
        """``reward(batch)`` under ``torch.no_grad()``; an exception becomes a `RewardError` naming the reward.

        With the spec's ``timeout_s`` the call runs in a daemon worker thread and is waited for that long;
        past it a `RewardError` is raised. A Python thread cannot be stopped: the stuck call goes on in the
        background (holding whatever it holds) until it returns by itself, and its result is dropped. To
        truly bound a call, bound the work itself, e.g. the ``timeout_s`` option of the ``remote`` reward,
        which limits its HTTP request.
        """
        if isinstance(getattr(reward, "last_metrics", None), dict):
            reward.last_metrics = {}  # a reward that sets none this call reports none
        timeout = getattr(self.specs[k], "timeout_s", None)
        try:
            if timeout is None:
                with torch.no_grad():
                    return reward(batch)
            return self._call_in_thread(k, reward, batch, float(timeout))
        except _RewardTimeout as e:
            raise RewardError(str(e)) from None
        except Exception as e:
            raise RewardError(f"{self._label(k)} failed: {type(e).__name__}: {e}") from e

    def _call_in_thread(self, k: int, reward: Reward, batch: RewardBatch, timeout: float) -> Any:
        result: dict[str, Any] = {}
        cuda_device = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda_device = torch.cuda.current_device()  # the current CUDA device is per thread

        def work() -> None:
            try:
                if cuda_device is not None:
                    torch.cuda.set_device(cuda_device)
                with torch.no_grad():  # grad mode is per thread too
                    result["out"] = reward(batch)
            except BaseException as e:  # handed to the caller
                result["error"] = e

        worker = threading.Thread(target=work, name=f"reward-{self.specs[k].column}", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            raise _RewardTimeout(
                f"{self._label(k)} did not return within {timeout:g} s (key '{self._key}[{k}].timeout_s'); "
                f"the call goes on in a background thread, which cannot be stopped (the `remote` reward's own "
                f"timeout_s bounds an HTTP call)"
            )
        if "error" in result:
            raise result["error"]
        return result["out"]

    def _validate(self, k: int, out: Any, n: int) -> Tensor:
        label = self._label(k)
        if isinstance(out, Tensor):
            out = out.detach()
            if out.dtype.is_complex:
                raise RewardError(f"{label} returned a complex tensor; rewards are real numbers")
            if out.dim() == 2:
                raise RewardError(
                    f"{label} returned a tensor of shape {tuple(out.shape)}; process rewards Float[B,T] "
                    f"must declare per_step = True (an outcome reward returns Float[{n}])"
                )
            if out.dim() != 1:
                raise RewardError(
                    f"{label} returned a tensor of shape {tuple(out.shape)}; expected Float[{n}]"
                )
            col = out.to(device="cpu", dtype=torch.float32)
        else:
            if isinstance(out, str | bytes) or not isinstance(out, Iterable):
                raise RewardError(
                    f"{label} returned {type(out).__name__}; expected Float[{n}] or a list of {n} floats"
                )
            col = torch.tensor(self._floats(label, out, sample=None), dtype=torch.float32)
        if col.shape[0] != n:
            raise RewardError(f"{label} returned {col.shape[0]} values for a batch of {n}")
        inf = torch.isinf(col)
        if inf.any():
            raise RewardError(
                f"{label} returned +/-inf at sample(s) {_fmt_rows(inf.nonzero().flatten().tolist())} "
                f"(use NaN for 'not applicable')"
            )
        return col

    @staticmethod
    def _floats(label: str, values: Iterable[Any], sample: int | None) -> list[float]:
        """`values` as floats (None -> NaN); a non-numeric entry is a RewardError naming its sample."""
        out = []
        for i, v in enumerate(values):
            if v is None:
                out.append(math.nan)
                continue
            if isinstance(v, Tensor) and v.numel() == 1:
                v = v.item()
            if isinstance(v, str | bytes) or not hasattr(v, "__float__"):
                where = f"sample {i}" if sample is None else f"sample {sample}, step {i}"
                raise RewardError(f"{label} returned a non-numeric value at {where}: {v!r}")
            out.append(float(v))
        return out

    def _validate_steps(self, k: int, out: Any, n: int, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """A per-step reward's output -> (column Float[B], step rewards Float[B, T], 0 where masked or NaN).

        T is ``mask.shape[1]``; without a mask (a `RewardBatch` not built from a rollout) any T is
        accepted and every step counts as valid.
        """
        label = self._label(k)
        t = None if mask is None else mask.shape[1]
        want = f"Float[{n}, {'T' if t is None else t}]"
        hint = f"a per-step reward returns {want} (T = rollout.mask.shape[1], the number of actions)"
        if isinstance(out, Tensor):
            out = out.detach()
            if out.dtype.is_complex:
                raise RewardError(f"{label} returned a complex tensor; rewards are real numbers")
            steps = out.to(device="cpu", dtype=torch.float32)
        else:
            if isinstance(out, str | bytes) or not isinstance(out, Iterable):
                raise RewardError(f"{label} returned {type(out).__name__}; {hint}")
            rows = []
            for i, row in enumerate(out):
                if isinstance(row, Tensor):
                    row = row.detach().cpu().tolist()
                if isinstance(row, str | bytes) or not isinstance(row, Iterable):
                    raise RewardError(f"{label} returned {type(row).__name__} for sample {i}; {hint}")
                rows.append(self._floats(label, row, sample=i))
            lengths = sorted({len(r) for r in rows})
            if len(lengths) > 1:
                raise RewardError(f"{label} returned rows of different lengths {lengths}; {hint}")
            if rows:
                steps = torch.tensor(rows, dtype=torch.float32)
            else:
                steps = torch.zeros(0, t or 0, dtype=torch.float32)
        if steps.dim() != 2 or steps.shape[0] != n or (t is not None and steps.shape[1] != t):
            raise RewardError(f"{label} returned a tensor of shape {tuple(steps.shape)}; {hint}")
        valid = torch.ones(steps.shape, dtype=torch.bool) if mask is None else mask
        inf = torch.isinf(steps) & valid
        if inf.any():
            raise RewardError(
                f"{label} returned +/-inf at sample(s) {_fmt_rows(inf.any(dim=1).nonzero().flatten().tolist())} "
                f"(use NaN for 'no process reward at this step')"
            )
        scored = valid & ~torch.isnan(steps)
        step = torch.where(scored, steps, torch.zeros_like(steps))
        count = scored.sum(dim=1)
        mean = step.double().sum(dim=1) / count.clamp(min=1)
        col = torch.where(count > 0, mean, torch.full_like(mean, math.nan)).to(torch.float32)
        return col, step

    # ---------------------------------------------------------------------- reporting
    def _check_columns(self, rewards: Tensor) -> None:
        if rewards.dim() != 2 or rewards.shape[1] != len(self.specs):
            raise ValueError(
                f"expected rewards Float[B, {len(self.specs)}], got shape {tuple(rewards.shape)}"
            )

    def stats(self, rewards: Tensor) -> dict[str, float]:
        """``reward/<name>/mean``, ``/std`` and ``/nan_frac`` per column, over the non-NaN entries.

        The std is the population std (ddof 0: one valid value gives 0); mean and std are NaN when
        every entry of a column is NaN.
        """
        self._check_columns(rewards)
        out: dict[str, float] = {}
        r = rewards.detach().to("cpu", torch.float64)
        for k, name in enumerate(self.names):
            col = r[:, k]
            valid = col[~torch.isnan(col)]
            if valid.numel():
                mean = valid.mean().item()
                std = valid.std(correction=0).item()
            else:
                mean = std = math.nan
            out[f"reward/{name}/mean"] = mean
            out[f"reward/{name}/std"] = std
            out[f"reward/{name}/nan_frac"] = 1.0 - valid.numel() / col.numel() if col.numel() else math.nan
        return out

    def nan_groups(self, rewards: Tensor, group: Tensor) -> list[tuple[str, int]]:
        """(reward name, group id) for each reward that is NaN for every sample of a group.

        Ordered by column, then by first appearance of the group in the batch.
        """
        self._check_columns(rewards)
        g = group.detach().cpu().tolist()
        order = list(dict.fromkeys(g))
        nan = torch.isnan(rewards.detach().cpu())
        out = []
        for k, name in enumerate(self.names):
            col = nan[:, k].tolist()
            all_nan = dict.fromkeys(order, True)
            for gid, is_nan in zip(g, col, strict=True):
                all_nan[gid] = all_nan[gid] and is_nan
            out.extend((name, gid) for gid in order if all_nan[gid])
        return out


# ---------------------------------------------------------------------- a config's list, checked without building
def check_reward_specs(specs: Sequence[Any], source: str, key: str = "rewards") -> None:
    """What `RewardSet(specs, source=source, key=key)` would reject about names and options, with the same
    `mmalign.config.ConfigError` messages, without constructing any reward (some load a model when
    constructed): the name resolves (`resolve`: registered, entry point or ``module:attr``), the ``kwargs``
    fit the reward's signature, and the per-reward ``device`` / ``batch_size`` / ``timeout_s`` are valid
    (`spec_problem`). The command line's validation (`mmalign.app.preflight.validate`) calls it; so may a
    pipeline before it builds its model."""

    def error(k: str, err: Exception) -> Exception:
        return RewardSet._config_error(source, k, err)

    for i, item in enumerate(specs):
        s = RewardSpec.coerce(item)
        options = dict(s.kwargs)
        try:
            obj = resolve(s.name)
        except (KeyError, ImportError, AttributeError) as e:
            raise error(f"{key}[{i}].name", e) from e
        try:
            if isinstance(obj, type):
                if not issubclass(obj, Reward):
                    raise TypeError(
                        f"reward {s.name!r} resolves to class {obj.__qualname__}, which does not subclass "
                        f"rewards.Reward (a reward is a Reward subclass or a function)"
                    )
                check_options(s.name, obj.__init__, 1, options)
            elif isinstance(obj, Reward):
                if options:
                    raise TypeError(
                        f"reward {s.name!r} is an already built Reward instance and takes no options"
                    )
            elif callable(obj):
                batch_style = FunctionReward.detect_style(obj) == "batch"
                check_options(s.name, obj, 1 if batch_style else 0, options, check_missing=batch_style)
            else:
                raise TypeError(
                    f"reward {s.name!r} resolves to {type(obj).__name__}, not a Reward class or a function"
                )
        except (TypeError, ValueError) as e:
            raise error(f"{key}[{i}].kwargs", e) from e
        problem = spec_problem(s, i, key, obj=obj)
        if problem is not None:
            raise error(*problem)
