"""`Rollout`: the batch-first bundle of tensors that flows through the training loop.

Slicing with an index (int tensor, bool tensor, list or slice) slices every per-sample field
consistently: tensors and lists whose first dimension is B, recursively inside dicts.

The fields and who fills them: docs/architecture.md, "What flows: `Rollout`".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

Index = Tensor | Sequence[int] | slice


def left_pad(seqs: Sequence[Sequence[int]], pad_value: int = 0) -> tuple[Tensor, Tensor]:
    """Long[B, W] token ids padded on the left with `pad_value`, and their attention mask (1 on real tokens)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_value, dtype=torch.long)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(list(s), dtype=torch.long)
        att[i, width - len(s) :] = 1
    return ids, att


def group_fields(
    rows: Sequence[dict[str, Any]], group_size: int
) -> tuple[list[str], Tensor, dict[str, list[Any]]]:
    """One entry per sample of a group rollout (each row repeated `group_size` times): the prompts, the group
    ids Long[B] and every dataset column of any row (None where a row lacks it). The one rule every policy
    uses for the columns rewards and samples see."""
    prompts = [str(r["prompt"]) for r in rows for _ in range(group_size)]
    group = torch.arange(len(rows)).repeat_interleave(group_size)
    keys = dict.fromkeys(k for r in rows for k in r)
    columns = {key: [r.get(key) for r in rows for _ in range(group_size)] for key in keys}
    return prompts, group, columns


def _as_index(idx: Index, n: int) -> list[int]:
    if isinstance(idx, slice):
        return list(range(n))[idx]
    if isinstance(idx, Tensor):
        if idx.dtype == torch.bool:
            if idx.numel() != n:
                raise IndexError(f"boolean index of length {idx.numel()} for a batch of {n}")
            return idx.nonzero().flatten().tolist()
        return idx.flatten().tolist()
    return [int(i) for i in idx]


def _take(value: Any, rows: list[int], n: int) -> Any:
    """Select `rows` from `value` if its first dimension is the batch (length n)."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.dim() > 0 and value.shape[0] == n:
            return value[torch.as_tensor(rows, dtype=torch.long, device=value.device)]
        return value
    if isinstance(value, dict):
        return {k: _take(v, rows, n) for k, v in value.items()}
    if isinstance(value, list | tuple) and len(value) == n:
        picked = [value[i] for i in rows]
        return picked if isinstance(value, list) else tuple(picked)
    return value


def _cat(values: list[Any], sizes: list[int]) -> Any:
    """Concatenate per-sample fields of several rollouts (tensors are padded on dim 1 if needed)."""
    first = values[0]
    if first is None:
        if any(v is not None for v in values):
            raise ValueError("cannot concatenate rollouts where a field is set in some and None in others")
        return None
    if isinstance(first, Tensor):
        if first.dim() == 0 or first.shape[0] != sizes[0]:
            return first  # not a per-sample tensor: keep the first
        if first.dim() >= 2 and len({v.shape[1:] for v in values}) > 1:
            width = max(v.shape[1] for v in values)
            padded = []
            for v in values:
                pad = torch.zeros(
                    (v.shape[0], width - v.shape[1], *v.shape[2:]), dtype=v.dtype, device=v.device
                )
                padded.append(torch.cat([v, pad], dim=1))
            values = padded
        return torch.cat(values, dim=0)
    if isinstance(first, dict):
        return {k: _cat([v[k] for v in values], sizes) for k in first}
    if isinstance(first, list | tuple) and len(first) == sizes[0]:
        out: list[Any] = []
        for v in values:
            out.extend(v)
        return out
    return first


@dataclass
class Rollout:
    """The tensors of one batch of sampled groups. See the module docstring for each field."""

    group: Tensor
    mask: Tensor
    prompts: list[str]
    logp_old: Tensor | None = None
    columns: dict[str, list[Any]] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    payload: dict[str, Any] = field(default_factory=dict)
    rewards: Tensor | None = None
    reward_names: list[str] = field(default_factory=list)
    step_rewards: Tensor | None = None
    advantages: Tensor | None = None
    logp_ref: Tensor | None = None
    logp_sampler: Tensor | None = None

    def __post_init__(self) -> None:
        b = self.group.shape[0]
        if self.mask.shape[0] != b or len(self.prompts) != b:
            raise ValueError(
                f"Rollout fields disagree on the batch size: group {b}, mask {self.mask.shape[0]}, "
                f"prompts {len(self.prompts)}"
            )

    # ------------------------------------------------------------------ sizes
    def __len__(self) -> int:
        return int(self.group.shape[0])

    @property
    def batch_size(self) -> int:
        return len(self)

    @property
    def num_actions(self) -> int:
        return int(self.mask.shape[1])

    def group_ids(self) -> list[int]:
        """The distinct group ids, in order of first appearance."""
        seen: dict[int, None] = {}
        for g in self.group.tolist():
            seen.setdefault(g, None)
        return list(seen)

    # --------------------------------------------------------------- slicing
    def __getitem__(self, idx: Index) -> Rollout:
        n = len(self)
        rows = _as_index(idx, n)
        kwargs = {
            f.name: _take(getattr(self, f.name), rows, n)
            for f in dataclasses.fields(self)
            if f.name != "reward_names"
        }
        return Rollout(reward_names=list(self.reward_names), **kwargs)

    def select_groups(self, keep: Sequence[int] | Tensor) -> Rollout:
        """The samples whose group id is in `keep` (order of the batch is preserved)."""
        keep_set = set(torch.as_tensor(keep).flatten().tolist())
        rows = [i for i, g in enumerate(self.group.tolist()) if g in keep_set]
        return self[rows]

    @staticmethod
    def cat(rollouts: Sequence[Rollout]) -> Rollout:
        """Concatenate rollouts sample-wise (T is padded to the longest, with mask False)."""
        if not rollouts:
            raise ValueError("Rollout.cat needs at least one rollout")
        if len(rollouts) == 1:
            return rollouts[0]
        names = rollouts[0].reward_names
        for r in rollouts[1:]:
            if r.reward_names != names:
                raise ValueError(f"reward names differ: {names} vs {r.reward_names}")
        sizes = [len(r) for r in rollouts]
        kwargs = {
            f.name: _cat([getattr(r, f.name) for r in rollouts], sizes)
            for f in dataclasses.fields(Rollout)
            if f.name != "reward_names"
        }
        return Rollout(reward_names=list(names), **kwargs)

    def to(self, device: torch.device | str) -> Rollout:
        def move(v: Any) -> Any:
            if isinstance(v, Tensor):
                return v.to(device)
            if isinstance(v, dict):
                return {k: move(x) for k, x in v.items()}
            return v

        return dataclasses.replace(
            self, **{f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)}
        )


def _plain(value: Any) -> Any:
    """A CPU, detached copy of tensors inside dicts / lists (what `rundir.save_state` writes)."""
    if isinstance(value, Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def rollout_state(rollout: Rollout) -> dict[str, Any]:
    """Every field of `rollout` as plain values and CPU tensors (`rollout_from_state` inverts it)."""
    return {f.name: _plain(getattr(rollout, f.name)) for f in dataclasses.fields(rollout)}


def rollout_from_state(state: dict[str, Any]) -> Rollout:
    """The `Rollout` that `rollout_state` wrote (for checkpoints: `mmalign.training.rundir.save_state` / `load_state`)."""
    return Rollout(**{k: _plain(v) for k, v in state.items()})
