"""Group filters: which groups of a scored rollout take part in the update (docs/algorithms.md).

Registered (``names()``): ``none``, ``dynamic_sampling``, ``range``, ``replay``, ``d3s``; `build_filter` makes one.

The contract: docs/algorithms.md, "mmalign.algorithms.filters"; the rules: "Group filters" and "The D³S filter".
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import torch
from torch import Tensor

from mmalign.data.batch import Rollout
from mmalign.registry import Registry

__all__ = [
    "FILTERS",
    "GroupFilter",
    "NoFilter",
    "DynamicSampling",
    "RangeFilter",
    "ReplayFilter",
    "build_filter",
    "get",
    "group_std",
    "max_variance_subset",
    "names",
]

FILTERS: Registry[type[GroupFilter]] = Registry("group filter")


def get(name: str) -> type[GroupFilter]:
    """The filter class registered as `name` (raises `RegistryError`, a KeyError, if unknown)."""
    return FILTERS.get(name)


def names() -> list[str]:
    """The names of the registered group filters, sorted."""
    return FILTERS.names()


def build_filter(name: str, **options: Any) -> GroupFilter:
    """Instantiate the filter `name` with keyword `options`; an unknown option raises TypeError."""
    cls = get(name)
    params = inspect.signature(cls).parameters
    allowed = [p for p, v in params.items() if v.kind in (v.KEYWORD_ONLY, v.POSITIONAL_OR_KEYWORD)]
    for key in options:
        if key not in allowed:
            listed = ", ".join(allowed) if allowed else "none"
            raise TypeError(f"group filter {name!r} got an unknown option {key!r} (options: {listed})")
    return cls(**options)


# ---------------------------------------------------------------------------- group statistics
def _group_index(group: Tensor) -> tuple[Tensor, Tensor]:
    """(distinct ids in order of first appearance, per-sample position of its id in that list)."""
    group = group.flatten()
    n = group.numel()
    if n == 0:
        return group.new_empty(0), torch.empty(0, dtype=torch.long, device=group.device)
    uniq, inv = torch.unique(group, return_inverse=True)
    first = torch.full((uniq.numel(),), n, dtype=torch.long, device=group.device)
    first = first.scatter_reduce(0, inv, torch.arange(n, device=group.device), reduce="amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=group.device)
    return uniq[order], rank[inv]


@dataclasses.dataclass
class _GroupStats:
    ids: Tensor  # Long[G], order of first appearance
    index: Tensor  # Long[B], position of each sample's group in `ids`
    count: Tensor  # Float64[G], number of non-NaN scores
    mean: Tensor  # Float64[G], NaN-aware mean (NaN when no valid score)
    std: Tensor  # Float64[G], NaN-aware unbiased std, 0 for < 2 valid or all-equal scores


def _group_stats(scores: Tensor, group: Tensor) -> _GroupStats:
    scores = scores.flatten()
    group = group.flatten().to(scores.device)
    if scores.numel() != group.numel():
        raise ValueError(f"scores has {scores.numel()} entries but group has {group.numel()}")
    ids, index = _group_index(group)
    g = ids.numel()
    x = scores.to(torch.float64)
    valid = ~torch.isnan(x)
    zeros = torch.zeros(g, dtype=torch.float64, device=x.device)
    count = zeros.index_add(0, index, valid.to(torch.float64))
    total = zeros.index_add(0, index, torch.where(valid, x, 0.0))
    mean = total / count  # 0/0 = NaN for groups without a valid score
    dev = torch.where(valid, (x - mean[index]) ** 2, 0.0)
    var = zeros.index_add(0, index, dev) / (count - 1).clamp_min(1.0)
    # exact zero when all valid scores are equal (a two-pass mean may leave rounding residue)
    hi = torch.full_like(zeros, -torch.inf).scatter_reduce(
        0, index, torch.where(valid, x, -torch.inf), reduce="amax"
    )
    lo = torch.full_like(zeros, torch.inf).scatter_reduce(
        0, index, torch.where(valid, x, torch.inf), reduce="amin"
    )
    std = torch.where((count >= 2) & (hi > lo), var.sqrt(), torch.zeros_like(var))
    return _GroupStats(ids=ids, index=index, count=count, mean=mean, std=std)


def _float_dtype(t: Tensor) -> torch.dtype:
    return t.dtype if t.is_floating_point() else torch.get_default_dtype()


def group_std(scores: Tensor, group: Tensor) -> tuple[Tensor, Tensor]:
    """Per-group NaN-aware unbiased std of `scores` Float[B] for group ids `group` Long[B].

    Returns (distinct group ids in order of first appearance, std per group). NaN scores are
    ignored; a group with fewer than two valid scores (or all valid scores equal) has std 0.
    """
    st = _group_stats(scores, group)
    return st.ids, st.std.to(_float_dtype(scores))


# ---------------------------------------------------------------------------- base class
class GroupFilter:
    """Base class: keeps whole groups of a rollout according to per-sample scalar scores.

    Subclasses override `_keep` (a Bool[G] over the groups in order of first appearance) or
    `__call__` itself. `resample` tells the trainer to keep generating rounds of prompts until
    the batch holds `target_groups` groups or `max_rounds` rounds were generated.
    """

    resample: bool = False
    max_rounds: int = 1

    def __init__(self) -> None:
        self._stats: dict[str, float] = {}

    # -- the filter
    def __call__(self, rollout: Rollout, scores: Tensor) -> Rollout:
        scores = self._check(rollout, scores)
        st = _group_stats(scores, rollout.group)
        keep = self._keep(rollout, scores, st)
        kept_ids = st.ids[keep]
        out = rollout if bool(keep.all()) else rollout.select_groups(kept_ids)
        self._stats = self._base_stats(rollout, st, int(keep.sum()), out)
        return out

    def _keep(self, rollout: Rollout, scores: Tensor, st: _GroupStats) -> Tensor:
        return torch.ones(st.ids.numel(), dtype=torch.bool, device=st.ids.device)

    # -- helpers
    @staticmethod
    def _check(rollout: Rollout, scores: Tensor) -> Tensor:
        scores = torch.as_tensor(scores)
        if scores.dim() != 1 or scores.shape[0] != len(rollout):
            raise ValueError(
                f"scores must be Float[B] with B={len(rollout)} (one combined reward per sample), "
                f"got shape {tuple(scores.shape)}"
            )
        return scores.to(rollout.group.device)

    @staticmethod
    def _base_stats(rollout: Rollout, st: _GroupStats, kept: int, out: Rollout) -> dict[str, float]:
        n = st.ids.numel()
        zero = int((st.std == 0).sum())
        return {
            "filter/groups_in": float(n),
            "filter/groups_kept": float(kept),
            "filter/groups_dropped": float(n - kept),
            "filter/groups_out": float(len(out.group_ids())),
            "filter/samples_in": float(len(rollout)),
            "filter/samples_out": float(len(out)),
            "filter/zero_std_frac": zero / n if n else 0.0,
        }

    def last_stats(self) -> dict[str, float]:
        """Statistics of the latest call (empty before the first one)."""
        return dict(self._stats)

    # -- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue exactly (stateless filters: an empty dict)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        if not isinstance(state, dict):
            raise TypeError(
                f"{type(self).__name__}.load_state_dict expects a dict, got {type(state).__name__}"
            )

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self._options().items())
        return f"{type(self).__name__}({opts})"

    def _options(self) -> dict[str, Any]:
        return {"resample": self.resample, "max_rounds": self.max_rounds}


def _check_rounds(max_rounds: int) -> int:
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
        raise ValueError(f"max_rounds must be an integer >= 1, got {max_rounds!r}")
    return max_rounds


# ---------------------------------------------------------------------------- registered filters
@FILTERS.register("none")
class NoFilter(GroupFilter):
    """Keeps every group (no filtering, no resampling)."""


@FILTERS.register("dynamic_sampling")
class DynamicSampling(GroupFilter):
    """DAPO dynamic sampling: keep a group iff the std of its scores is > 0; resample up to max_rounds.

    Options: ``max_rounds`` (default 3) generation rounds per step; ``resample`` (default True).
    """

    def __init__(self, *, max_rounds: int = 3, resample: bool = True) -> None:
        super().__init__()
        self.max_rounds = _check_rounds(max_rounds)
        self.resample = bool(resample)

    def _keep(self, rollout: Rollout, scores: Tensor, st: _GroupStats) -> Tensor:
        return st.std > 0


@FILTERS.register("range")
class RangeFilter(GroupFilter):
    """Keep a group iff low < mean score < high (strict; defaults 0.01 / 0.99).

    The mean ignores NaN scores; a group without valid scores is dropped. A group with a single
    valid score keeps that score as its mean. The comparison is made in the scores' own float
    dtype, so a mean exactly equal to ``low`` or ``high`` (as that dtype) is dropped.
    Options: ``low``, ``high``, ``resample`` (default False), ``max_rounds`` (default 3).
    """

    def __init__(
        self, *, low: float = 0.01, high: float = 0.99, resample: bool = False, max_rounds: int = 3
    ) -> None:
        super().__init__()
        if not low < high:
            raise ValueError(f"range filter needs low < high, got low={low!r}, high={high!r}")
        self.low = float(low)
        self.high = float(high)
        self.resample = bool(resample)
        self.max_rounds = _check_rounds(max_rounds)

    def _keep(self, rollout: Rollout, scores: Tensor, st: _GroupStats) -> Tensor:
        dtype = _float_dtype(scores)
        mean = st.mean.to(dtype)
        low = torch.tensor(self.low, dtype=dtype, device=mean.device)
        high = torch.tensor(self.high, dtype=dtype, device=mean.device)
        return (mean > low) & (mean < high)  # NaN compares False: dropped

    def _options(self) -> dict[str, Any]:
        return {"low": self.low, "high": self.high, **super()._options()}


# ---------------------------------------------------------------------------- replay
def _copy_tensors(value: Any, device: torch.device | str) -> Any:
    """Detached copies of every tensor (recursively in dicts, lists and tuples) on `device`."""
    if isinstance(value, Tensor):
        return value.detach().to(device, copy=True)
    if isinstance(value, dict):
        return {k: _copy_tensors(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_tensors(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy_tensors(v, device) for v in value)
    return value


def _copy_rollout(rollout: Rollout, device: torch.device | str, **changes: Any) -> Rollout:
    fields = {f.name: _copy_tensors(getattr(rollout, f.name), device) for f in dataclasses.fields(Rollout)}
    fields.update(changes)
    return Rollout(**fields)


def _sample_advantage(rollout: Rollout) -> Tensor:
    """|A_i| per sample: Float[B]; Float[B,T] advantages are averaged over the valid actions."""
    adv = rollout.advantages
    if adv is None:
        raise ValueError("the replay filter needs rollout.advantages: run it after the advantage estimator")
    adv = adv.detach()
    if adv.dim() == 2:
        mask = rollout.mask.to(device=adv.device, dtype=adv.dtype)
        if mask.shape != adv.shape:
            raise ValueError(f"advantages {tuple(adv.shape)} and mask {tuple(mask.shape)} differ in shape")
        adv = (adv * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
    elif adv.dim() != 1:
        raise ValueError(f"advantages must be Float[B] or Float[B,T], got shape {tuple(adv.shape)}")
    return torch.nan_to_num(adv.abs().to(torch.float64), nan=0.0)


@FILTERS.register("replay")
class ReplayFilter(GroupFilter):
    """Replay of informative groups (Skywork SSB style): zero-variance groups are replaced from a buffer.

    Options: ``capacity`` (64 groups), ``reuse_limit`` (2), ``seed`` (0), ``evict``.

    Details: docs/algorithms.md, "mmalign.algorithms.filters.ReplayFilter".
    """

    def __init__(
        self, *, capacity: int = 64, reuse_limit: int = 2, seed: int = 0, evict: str = "lowest_score"
    ) -> None:
        super().__init__()
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"replay capacity must be an integer >= 0, got {capacity!r}")
        if isinstance(reuse_limit, bool) or not isinstance(reuse_limit, int) or reuse_limit < 1:
            raise ValueError(f"replay reuse_limit must be an integer >= 1, got {reuse_limit!r}")
        if evict not in ("lowest_score", "oldest"):
            raise ValueError(f"replay evict must be 'lowest_score' or 'oldest', got {evict!r}")
        self.capacity = capacity
        self.reuse_limit = reuse_limit
        self.seed = int(seed)
        self.evict = evict
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(self.seed)
        self._buffer: list[dict[str, Any]] = []  # insertion order; keys rollout, score, uses, serial, group
        self._serial = 0

    def _options(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "reuse_limit": self.reuse_limit,
            "seed": self.seed,
            "evict": self.evict,
        }

    # -- buffer
    def __len__(self) -> int:
        return len(self._buffer)

    def buffer_entries(self) -> list[dict[str, float]]:
        """A summary of the buffer, oldest first: original group id, score and times replayed."""
        return [{"group": e["group"], "score": e["score"], "uses": e["uses"]} for e in self._buffer]

    def _evict_one(self) -> None:
        if self.evict == "oldest":
            self._buffer.pop(0)
            return
        worst = min(
            range(len(self._buffer)), key=lambda i: (self._buffer[i]["score"], self._buffer[i]["serial"])
        )
        self._buffer.pop(worst)

    def _insert(self, rollout: Rollout, group: int, score: float) -> tuple[bool, int]:
        """Add one group; returns (inserted, number of evicted entries)."""
        if self.capacity == 0:
            return False, 0
        evicted = 0
        if len(self._buffer) >= self.capacity:
            if self.evict == "lowest_score" and score < min(e["score"] for e in self._buffer):
                return False, 0
            while len(self._buffer) >= self.capacity:
                self._evict_one()
                evicted += 1
        self._buffer.append(
            {"rollout": rollout, "score": score, "uses": 0, "serial": self._serial, "group": group}
        )
        self._serial += 1
        return True, evicted

    def _draw(self, k: int) -> list[dict[str, Any]]:
        """Draw min(k, len(buffer)) entries ∝ score without replacement; count uses, evict spent ones."""
        m = min(k, len(self._buffer))
        if m == 0:
            return []
        weights = torch.tensor([e["score"] for e in self._buffer], dtype=torch.float64)
        picks = torch.multinomial(weights, m, replacement=False, generator=self.generator).tolist()
        drawn = [self._buffer[i] for i in picks]
        for e in drawn:
            e["uses"] += 1
        self._buffer = [e for e in self._buffer if e["uses"] < self.reuse_limit]
        return drawn

    # -- the filter
    def __call__(self, rollout: Rollout, scores: Tensor) -> Rollout:
        scores = self._check(rollout, scores)
        st = _group_stats(scores, rollout.group)
        informative = st.std > 0
        abs_adv = _sample_advantage(rollout).to(st.std.device)
        group_score = torch.zeros_like(st.std).index_add(0, st.index.to(st.std.device), abs_adv) * st.std

        kept_ids = st.ids[informative]
        n_zero = int((~informative).sum())
        kept = rollout if n_zero == 0 else rollout.select_groups(kept_ids)

        # 1-2. replace zero-variance groups from the buffer as it was before this call
        drawn = self._draw(n_zero)
        parts = [kept] if len(kept) > 0 else []
        next_id = int(rollout.group.max()) + 1 if len(rollout) else 0
        device = rollout.group.device
        for k, entry in enumerate(drawn):
            stored: Rollout = entry["rollout"]
            new_group = torch.full_like(stored.group, next_id + k)
            parts.append(_copy_rollout(stored, device, group=new_group.to(device)))
        out = Rollout.cat(parts) if parts else kept

        # 3. buffer this rollout's informative groups
        added = evicted = 0
        ids = st.ids.tolist()
        scores_g = group_score.tolist()
        for gid, ok, sc in zip(ids, informative.tolist(), scores_g):
            if not ok or not (sc > 0 and sc < float("inf")):
                continue
            stored = _copy_rollout(rollout.select_groups([gid]), "cpu")
            inserted, ev = self._insert(stored, int(gid), float(sc))
            added += int(inserted)
            evicted += ev

        stats = self._base_stats(rollout, st, len(kept_ids), out)
        stats.update(
            {
                "filter/groups_replayed": float(len(drawn)),
                "filter/groups_dropped": float(n_zero - len(drawn)),
                "filter/buffer_size": float(len(self._buffer)),
                "filter/buffer_added": float(added),
                "filter/buffer_evicted": float(evicted),
                "filter/replay_score_mean": (sum(e["score"] for e in drawn) / len(drawn) if drawn else 0.0),
            }
        )
        self._stats = stats
        return out

    # -- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Buffer (plain dicts of tensors), use counts and generator state; saved in checkpoints (`mmalign.training.rundir.save_state`)."""
        buffer = []
        for e in self._buffer:
            r: Rollout = e["rollout"]
            buffer.append(
                {
                    "fields": {f.name: getattr(r, f.name) for f in dataclasses.fields(Rollout)},
                    "score": e["score"],
                    "uses": e["uses"],
                    "serial": e["serial"],
                    "group": e["group"],
                }
            )
        return {
            "version": 1,
            "buffer": buffer,
            "serial": self._serial,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the buffer and the generator; a buffer above `capacity` is trimmed by `evict`."""
        super().load_state_dict(state)
        buffer = []
        for e in state["buffer"]:
            buffer.append(
                {
                    "rollout": _copy_rollout(Rollout(**e["fields"]), "cpu"),
                    "score": float(e["score"]),
                    "uses": int(e["uses"]),
                    "serial": int(e["serial"]),
                    "group": int(e["group"]),
                }
            )
        self._buffer = buffer
        self._serial = int(state["serial"])
        self.generator.set_state(state["generator"].clone())
        while len(self._buffer) > self.capacity:
            self._evict_one()


# ---------------------------------------------------------------------------- D³S
def max_variance_subset(values: Tensor, k: int) -> Tensor:
    """Long[k]: indices of the k entries of ``values`` (Float[n]) whose (unbiased) variance is largest.

    A maximum-variance k-subset always consists of the j largest and the k − j smallest values for
    some j (moving an inner value outward never lowers the spread), so the k + 1 such subsets are
    compared; ties go to the smaller j, and values are ordered by a stable sort (ties by position).
    Returned in increasing index order. k >= n returns every index.
    """
    x = torch.as_tensor(values).to(torch.float64).flatten()
    n = x.numel()
    if k >= n:
        return torch.arange(n, device=x.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=x.device)
    order = torch.sort(x, stable=True).indices
    best_j, best_var = 0, -1.0
    for j in range(k + 1):
        pick = torch.cat([order[: k - j], order[n - j :]]) if j else order[:k]
        var = float(x[pick].var(unbiased=True)) if k > 1 else 0.0
        if var > best_var + 1e-12:
            best_j, best_var = j, var
    pick = torch.cat([order[: k - best_j], order[n - best_j :]]) if best_j else order[:k]
    return torch.sort(pick).values


@FILTERS.register("d3s")
class D3SFilter(GroupFilter):
    """D³S sample-level down-sampling: in every group keep the k samples that maximise the variance of A.

    Per group of n samples (advantages: Float[B], or the masked mean over actions of Float[B,T]):
    k = min(n, max(min_keep, ceil(f · n))) with the kept fraction
    f(t) = start_frac + (end_frac − start_frac) · min(1, t / schedule_steps), t = the number of calls
    so far (one per training step; in the state); the kept samples are `max_variance_subset`. Groups
    keep their order and ids; the rollout's other fields are sliced alike. Scores are not used.

    Details: docs/algorithms.md, "mmalign.algorithms.filters.D3SFilter".
    """

    def __init__(
        self,
        *,
        start_frac: float = 0.5,
        end_frac: float = 1.0,
        schedule_steps: int = 200,
        min_keep: int = 2,
    ) -> None:
        super().__init__()
        for key, value in (("start_frac", start_frac), ("end_frac", end_frac)):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"d3s {key} must be in (0, 1], got {value!r}")
        if isinstance(schedule_steps, bool) or not isinstance(schedule_steps, int) or schedule_steps < 0:
            raise ValueError(f"d3s schedule_steps must be an integer >= 0, got {schedule_steps!r}")
        if isinstance(min_keep, bool) or not isinstance(min_keep, int) or min_keep < 1:
            raise ValueError(f"d3s min_keep must be an integer >= 1, got {min_keep!r}")
        self.start_frac, self.end_frac = float(start_frac), float(end_frac)
        self.schedule_steps, self.min_keep = schedule_steps, min_keep
        self.calls = 0

    def _options(self) -> dict[str, Any]:
        return {
            "start_frac": self.start_frac,
            "end_frac": self.end_frac,
            "schedule_steps": self.schedule_steps,
            "min_keep": self.min_keep,
        }

    def keep_fraction(self, t: int | None = None) -> float:
        """The kept fraction f(t) (t defaults to the number of calls so far)."""
        t = self.calls if t is None else t
        ramp = 1.0 if self.schedule_steps == 0 else min(1.0, t / self.schedule_steps)
        return self.start_frac + (self.end_frac - self.start_frac) * ramp

    def keep_count(self, n: int, t: int | None = None) -> int:
        """k for a group of n samples."""
        return min(n, max(self.min_keep, math.ceil(self.keep_fraction(t) * n - 1e-9)))

    def __call__(self, rollout: Rollout, scores: Tensor) -> Rollout:
        scores = self._check(rollout, scores)
        st = _group_stats(scores, rollout.group)
        adv = _signed_sample_advantage(rollout).to(st.index.device)
        rows: list[int] = []
        index = st.index.tolist()
        members: dict[int, list[int]] = {}
        for i, g in enumerate(index):
            members.setdefault(g, []).append(i)
        kept_samples = 0
        for g in range(st.ids.numel()):
            idx = members.get(g, [])
            k = self.keep_count(len(idx))
            local = max_variance_subset(adv[idx], k).tolist()
            rows.extend(idx[j] for j in local)
            kept_samples += len(local)
        rows.sort()
        out = rollout if len(rows) == len(rollout) else rollout[rows]
        self._stats = self._base_stats(rollout, st, int(st.ids.numel()), out)
        self._stats["filter/keep_frac"] = self.keep_fraction()
        self._stats["filter/samples_dropped"] = float(len(rollout) - kept_samples)
        self.calls += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """The number of calls so far (the schedule's clock)."""
        return {"version": 1, "calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.calls = int(state["calls"])


def _signed_sample_advantage(rollout: Rollout) -> Tensor:
    """A_i per sample: Float[B]; Float[B,T] advantages are averaged over the valid actions (NaN read as 0)."""
    adv = rollout.advantages
    if adv is None:
        raise ValueError("the d3s filter needs rollout.advantages: run it after the advantage estimator")
    adv = adv.detach()
    if adv.dim() == 2:
        mask = rollout.mask.to(device=adv.device, dtype=adv.dtype)
        if mask.shape != adv.shape:
            raise ValueError(f"advantages {tuple(adv.shape)} and mask {tuple(mask.shape)} differ in shape")
        adv = (adv * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
    elif adv.dim() != 1:
        raise ValueError(f"advantages must be Float[B] or Float[B,T], got shape {tuple(adv.shape)}")
    return torch.nan_to_num(adv.to(torch.float64), nan=0.0)
