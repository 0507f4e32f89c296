"""Rewards for visual search with zooming (GeoViS): the action format, crops that keep the target, tool use.

The box rewards on the final answer (IoU, Acc@threshold, centre) live in `rewards.boxes` (option
``box_key="answer_box"`` reads ``env_state``).

Details: docs/grounding.md, "rewards.search".
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .base import Reward, RewardBatch, RewardError, register_reward

__all__ = [
    "CropKeepsTarget",
    "SearchFormat",
    "ToolUseBonus",
    "TurnsUsed",
    "crop_turn_ends",
    "inside_share",
    "turn_runs",
]

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_BOX = rf"\[\s*{_NUM}\s*,\s*{_NUM}\s*,\s*{_NUM}\s*,\s*{_NUM}\s*\]"
CROP_TURN = re.compile(rf"\s*<crop(?:\s+view\s*=\s*\d+)?\s*>\s*{_BOX}\s*</crop>\s*")
ANSWER_TURN = re.compile(rf"\s*<answer>\s*{_BOX}\s*</answer>\s*")


def _turns(batch: RewardBatch) -> list[list[str]]:
    """Per sample, the generated turns: ``outputs["turns"]``, else ``[text]`` (a single-turn rollout)."""
    turns = batch.outputs.get("turns")
    if turns is not None:
        return [list(t) for t in turns]
    return [[t] for t in batch.texts]


def _env_states(batch: RewardBatch, name: str) -> list[dict[str, Any]]:
    """``outputs["env_state"]`` (one dict per sample); {} for every sample when the rollout has none."""
    states = batch.outputs.get("env_state")
    if states is None:
        return [{} for _ in range(len(batch))]
    if len(states) != len(batch):
        raise RewardError(f"reward {name!r}: env_state has {len(states)} entries for {len(batch)} samples")
    return [s or {} for s in states]


def _area(b: Sequence[float]) -> float:
    return max(0.0, float(b[2]) - float(b[0])) * max(0.0, float(b[3]) - float(b[1]))


def inside_share(target: Sequence[float], region: Sequence[float]) -> float:
    """Share of `target`'s area inside `region` (both (x1, y1, x2, y2), same pixels): |T ∩ R| / |T|.
    A zero-area target counts as inside when its point lies in the region (1.0), else 0.0."""
    tx1, ty1, tx2, ty2 = (float(v) for v in target)
    rx1, ry1, rx2, ry2 = (float(v) for v in region)
    area = _area(target)
    if area <= 0:
        return float(rx1 <= tx1 <= rx2 and ry1 <= ty1 <= ry2)
    iw = min(tx2, rx2) - max(tx1, rx1)
    ih = min(ty2, ry2) - max(ty1, ry1)
    return max(iw, 0.0) * max(ih, 0.0) / area


def turn_runs(mask_row: Tensor) -> list[tuple[int, int]]:
    """(start, end) of each run of True in a Bool[T] action mask, in order: run k is generated turn k
    (end exclusive; the turn's last action is at ``end - 1``)."""
    m = mask_row.bool().tolist()
    runs: list[tuple[int, int]] = []
    start = None
    for j, v in enumerate(m):
        if v and start is None:
            start = j
        elif not v and start is not None:
            runs.append((start, j))
            start = None
    if start is not None:
        runs.append((start, len(m)))
    return runs


def crop_turn_ends(mask_row: Tensor, turns: Sequence[int]) -> list[int | None]:
    """The position of the last action of each generated turn in `turns` (None for a turn the mask lacks)."""
    runs = turn_runs(mask_row)
    return [runs[t][1] - 1 if 0 <= t < len(runs) else None for t in turns]


def _reference_boxes(batch: RewardBatch, i: int, column: str) -> list[list[float]]:
    value = batch[column][i] if column in batch else None
    if value is None and column == "boxes" and "box" in batch:
        value = [batch["box"][i]] if batch["box"][i] is not None else None
    if value is None:
        return []
    if len(value) == 4 and all(isinstance(v, int | float) for v in value):
        return [[float(v) for v in value]]
    return [[float(v) for v in b] for b in value]


@register_reward("search_format")
class SearchFormat(Reward):
    """1 if every generated turn is exactly one well-formed action and the last turn is an answer, else 0.

    A turn is well-formed when, up to surrounding whitespace, it is ``<crop>[x1,y1,x2,y2]</crop>``,
    ``<crop view=K>[x1,y1,x2,y2]</crop>`` or ``<answer>[x1,y1,x2,y2]</answer>`` (four numbers, ints or
    decimals); a crop may not be the last turn. Reads ``outputs["turns"]`` (one list per sample), falling
    back to ``[text]`` for a single-turn rollout. (our design: no partial credit.)"""

    needs = {"texts"}

    def __call__(self, batch: RewardBatch) -> Tensor:
        out = []
        bad = 0
        for turns in _turns(batch):
            ok = bool(turns) and ANSWER_TURN.fullmatch(turns[-1]) is not None
            ok = ok and all(CROP_TURN.fullmatch(t) is not None for t in turns[:-1])
            out.append(1.0 if ok else 0.0)
            bad += not ok
        self.last_metrics = {"malformed_frac": bad / max(1, len(out))}
        return torch.tensor(out, dtype=torch.float32)


@register_reward("crop_keeps_target")
class CropKeepsTarget(Reward):
    """Process reward: for each generated turn that asked for a crop, 1.0 if the crop was accepted and its
    region keeps the target, else 0.0 (a refused crop scores 0.0), placed on every action of that turn
    (``placement: turn``, the default) or on its LAST action only (``placement: last``).

    Why every action by default (our design): ``grpo_process`` normalises a step reward per (group, action
    position). Spread over the turn, the crop turns of a group's samples (which mostly start at the same
    position) are compared position by position; at the turn's last token alone, samples whose turns end
    at different positions rarely share a cell, and the process advantage is mostly 0.

    "Keeps the target": the share of a reference box's area inside the crop's region (original pixels) is
    at least ``min_inside`` (0.9; our design), for any of the sample's reference boxes (``box_column``,
    "boxes"). Turn k of sample i is the k-th run of True in ``batch.mask[i]`` (each generated turn is one
    contiguous run of actions; inserted tokens between turns are not actions). Returns Float[B, T] with
    NaN everywhere else (no process reward there), and NaN rows for samples without crops or without a
    reference box. Reads ``outputs["env_state"]`` (``crops``: turn, view, accepted; ``views``: regions)."""

    needs = {"texts"}
    per_step = True

    def __init__(
        self, *, min_inside: float = 0.9, box_column: str = "boxes", placement: str = "turn"
    ) -> None:
        if not (isinstance(min_inside, int | float) and 0.0 < float(min_inside) <= 1.0):
            raise ValueError(f"reward 'crop_keeps_target': min_inside must be in (0, 1], got {min_inside!r}")
        if placement not in ("turn", "last"):
            raise ValueError(
                f"reward 'crop_keeps_target': placement must be 'turn' or 'last', got {placement!r}"
            )
        self.placement = placement
        self.min_inside = float(min_inside)
        self.box_column = box_column

    def __call__(self, batch: RewardBatch) -> Tensor:
        if batch.mask is None:
            raise RewardError(
                f"reward {self.name!r} is a per-step reward and needs batch.mask (a batch built from a rollout)"
            )
        mask = batch.mask
        out = torch.full(mask.shape, math.nan, dtype=torch.float32)
        kept = asked = refused = 0
        for i, state in enumerate(_env_states(batch, self.name)):
            crops = state.get("crops") or []
            targets = _reference_boxes(batch, i, self.box_column)
            if not crops or not targets:
                continue
            regions = {int(v["id"]): v["region"] for v in state.get("views") or []}
            runs = turn_runs(mask[i])
            for crop in crops:
                turn = int(crop["turn"])
                if not 0 <= turn < len(runs):
                    continue
                start, end = runs[turn][0], runs[turn][1] - 1
                value = 0.0
                if crop.get("accepted") and crop.get("view") in regions:
                    region = regions[int(crop["view"])]
                    share = max(inside_share(t, region) for t in targets)
                    value = 1.0 if share >= self.min_inside else 0.0
                else:
                    refused += 1
                if self.placement == "last":
                    out[i, end] = value
                else:
                    out[i, start : end + 1] = value
                asked += 1
                kept += value == 1.0
        self.last_metrics = {
            "keep_rate": kept / asked if asked else math.nan,
            "refused_frac": refused / asked if asked else math.nan,
        }
        return out


@register_reward("tool_use_bonus")
class ToolUseBonus(Reward):
    """min(accepted crops, ``cap``) / ``cap`` (default cap 1: 1.0 if the sample opened at least one crop, else
    0.0). Refused crops do not count. Reads ``outputs["env_state"]`` (``crops``). (our design: the cap keeps
    the bonus from paying for ever more crops.)"""

    needs = {"texts"}

    def __init__(self, *, cap: int = 1) -> None:
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            raise ValueError(f"reward 'tool_use_bonus': cap must be an integer >= 1, got {cap!r}")
        self.cap = cap

    def __call__(self, batch: RewardBatch) -> Tensor:
        out = []
        for state in _env_states(batch, self.name):
            n = sum(1 for c in state.get("crops") or [] if c.get("accepted"))
            out.append(min(n, self.cap) / self.cap)
        return torch.tensor(out, dtype=torch.float32)


@register_reward("turns_used")
class TurnsUsed(Reward):
    """The number of generated turns of each sample (``outputs["num_turns"]``, else the length of
    ``outputs["turns"]``; 1 for a single-turn rollout), as a float. For evaluation logs (give it weight 0)."""

    needs = {"texts"}

    def __call__(self, batch: RewardBatch) -> Tensor:
        n = batch.outputs.get("num_turns")
        if n is not None:
            return torch.as_tensor(n).to(torch.float32).reshape(-1).clone()
        return torch.tensor([float(len(t)) for t in _turns(batch)], dtype=torch.float32)
