"""MedLoc-R1's IoU-threshold curriculum: the hit reward's IoU threshold rises as the policy masters it.

- `IoUThresholdCurriculum` -- the rule (pure Python, no torch): a sliding window of per-group
  statistics, the (P, S) gates and the step size of tau.
- `CurriculumCallback` -- trainer glue: collects the per-group hit rate and mean IoU from the
  trainer's gathered reward columns (`on_rewards`), feeds them to the rule once per training step
  (`on_step_end`) and writes the new tau into the hit reward's ``threshold`` attribute.

The rule and its constants: docs/grounding.md, "MedLoc-R1's IoU curriculum" and "pipelines.grounding.curriculum".
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

__all__ = [
    "STEP_MODES",
    "CurriculumCallback",
    "IoUThresholdCurriculum",
    "gates_for",
    "piecewise_step",
]

logger = logging.getLogger(__name__)

STEP_MODES = ("piecewise", "linear", "cosine")
"""How the size of a raise of tau is chosen (see `IoUThresholdCurriculum.step_size`)."""

_DIGITS = 9
"""tau is rounded to 1e-9 after every change, so 0.3 + 0.15 + 0.15 is exactly 0.6 (float addition
gives 0.6000000000000001) and compares as expected with the (P, S) switch points 0.6 and 0.75."""

_EPS = 1e-9
"""Tolerance of the gate comparisons (our design): a window mean of 30 entries of 0.8 may come out as
0.7999999999999999, and 0.7 - 0.6 is 0.09999999999999998; both must pass a gate set at 0.8 / 0.10."""


def _round(x: float) -> float:
    return round(float(x), _DIGITS)


def gates_for(tau: float) -> tuple[float, float]:
    """MedLoc-R1's gates ``(P, S)`` at threshold `tau`: the window's mean hit rate must be >= P and
    the population std of its hit rates <= S for tau to be raised.

    ``(0.80, 0.20)`` for tau < 0.6, ``(0.75, 0.35)`` for 0.6 <= tau < 0.75, ``(0.55, 0.40)`` for
    tau >= 0.75. `tau` is rounded to 1e-9 before the comparison.
    """
    tau = _round(tau)
    if tau < 0.6:
        return 0.80, 0.20
    if tau < 0.75:
        return 0.75, 0.35
    return 0.55, 0.40


def piecewise_step(tau: float) -> float:
    """MedLoc-R1's step of tau (IoU units): +0.15 while tau < 0.55, +0.10 while 0.55 <= tau < 0.75,
    +0.05 from 0.75 (so 0.3 -> 0.45 -> 0.6 -> 0.7 -> 0.75 ... capped by the maximum)."""
    tau = _round(tau)
    if tau < 0.55:
        return 0.15
    if tau < 0.75:
        return 0.10
    return 0.05


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class IoUThresholdCurriculum:
    """The IoU threshold tau of the hit reward, raised when the policy masters the current one.

    State: ``tau``; ``entries`` (deque of ``(hit_rate, mean_iou)`` per group, newest last, at most
    ``window``); ``transitions`` (list of the dicts `observe` returned); ``groups`` (groups
    appended so far) and ``steps`` (calls of `observe`); ``levels`` (tau before each raise that was
    not stepped back, to undo raises exactly).

    Details: docs/grounding.md, "pipelines.grounding.curriculum.IoUThresholdCurriculum".
    """

    start: float = 0.3
    max_threshold: float = 0.8
    window: int = 30
    step_mode: str = "piecewise"
    margin: float = 0.10
    keep_after_raise: float = 0.5
    step_back: bool = False
    step_back_hit_rate: float = 0.2
    min_threshold: float | None = None

    tau: float = field(init=False)
    entries: deque[tuple[float, float]] = field(init=False, repr=False)
    transitions: list[dict[str, Any]] = field(init=False, repr=False)
    groups: int = field(init=False, default=0)
    steps: int = field(init=False, default=0)
    levels: list[float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for key in ("start", "max_threshold", "margin", "keep_after_raise", "step_back_hit_rate"):
            if not _finite(getattr(self, key)):
                raise ValueError(
                    f"curriculum option {key} must be a finite number, got {getattr(self, key)!r}"
                )
        if not 0.0 <= self.start <= 1.0:
            raise ValueError(f"curriculum option start must be in [0, 1], got {self.start!r}")
        if not self.start <= self.max_threshold <= 1.0:
            raise ValueError(
                f"curriculum option max_threshold must be in [start={self.start}, 1], got {self.max_threshold!r}"
            )
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"curriculum option window must be an integer >= 1, got {self.window!r}")
        if self.step_mode not in STEP_MODES:
            raise ValueError(
                f"curriculum option step_mode must be one of {list(STEP_MODES)}, got {self.step_mode!r}"
            )
        if not 0.0 <= self.keep_after_raise <= 1.0:
            raise ValueError(
                f"curriculum option keep_after_raise must be in [0, 1], got {self.keep_after_raise!r}"
            )
        if not isinstance(self.step_back, bool):
            raise ValueError(f"curriculum option step_back must be true or false, got {self.step_back!r}")
        if not 0.0 <= self.step_back_hit_rate <= 1.0:
            raise ValueError(
                f"curriculum option step_back_hit_rate must be in [0, 1], got {self.step_back_hit_rate!r}"
            )
        if self.min_threshold is None:
            self.min_threshold = self.start
        if not _finite(self.min_threshold) or not 0.0 <= self.min_threshold <= self.start:
            raise ValueError(
                f"curriculum option min_threshold must be in [0, start={self.start}], got {self.min_threshold!r}"
            )
        self.start = float(self.start)
        self.max_threshold = float(self.max_threshold)
        self.min_threshold = float(self.min_threshold)
        self.tau = _round(self.start)
        self.entries = deque(maxlen=self.window)
        self.transitions = []
        self.groups = 0
        self.steps = 0
        self.levels = []

    # ------------------------------------------------------------------ the rule's pieces
    def gates(self, tau: float | None = None) -> tuple[float, float]:
        """``(P, S)`` at `tau` (default: the current tau); see `gates_for`."""
        return gates_for(self.tau if tau is None else tau)

    def step_size(self, tau: float | None = None) -> float:
        """The raise of tau (IoU units) from `tau` (default: the current tau) under ``step_mode``,
        before the cap at ``max_threshold``."""
        tau = self.tau if tau is None else float(tau)
        if self.step_mode == "piecewise":
            return piecewise_step(tau)
        span = self.max_threshold - self.start
        f = 0.0 if span <= 0 else min(1.0, max(0.0, (tau - self.start) / span))
        if self.step_mode == "linear":
            return 0.15 - 0.10 * f
        return 0.05 + 0.10 * 0.5 * (1.0 + math.cos(math.pi * f))

    def window_stats(self) -> tuple[float, float, float]:
        """``(mean hit rate, population std of the hit rates, mean IoU)`` over the window; NaN when
        the window is empty."""
        n = len(self.entries)
        if n == 0:
            return math.nan, math.nan, math.nan
        hits = [h for h, _ in self.entries]
        hit = sum(hits) / n
        std = math.sqrt(sum((h - hit) ** 2 for h in hits) / n)
        iou = sum(i for _, i in self.entries) / n
        return hit, std, iou

    @property
    def window_full(self) -> bool:
        return len(self.entries) == self.window

    # ------------------------------------------------------------------ the update
    def observe(
        self, hit_rates: Sequence[float], mean_ious: Sequence[float], *, step: int | None = None
    ) -> dict[str, Any] | None:
        """Append one training step's groups and decide whether tau changes.

        Call it ONCE PER TRAINING STEP with one entry per group of the step, in global group order
        (the groups of all processes): ``hit_rates[g]`` is the share of group g's samples whose IoU
        reached tau (in [0, 1]), ``mean_ious[g]`` the group's mean IoU. A group with a NaN in either
        (no reference box) is skipped (our design). The decision uses the window statistics before
        any trimming; only one transition can happen per call.

        `step` is the training step written in the transition (default: the number of calls so far,
        this one included).

        Returns the transition ``{"step", "old", "new", "direction" ("raise" / "back"),
        "window_len", "hit_rate", "reward_std", "mean_iou", "P", "S", "groups"}`` or None.
        """
        if len(hit_rates) != len(mean_ious):
            raise ValueError(
                f"curriculum.observe: {len(hit_rates)} hit rates but {len(mean_ious)} mean IoUs "
                "(one of each per group)"
            )
        self.steps += 1
        for h, i in zip(hit_rates, mean_ious, strict=True):
            h, i = float(h), float(i)
            if math.isnan(h) or math.isnan(i):
                continue
            self.entries.append((h, i))
            self.groups += 1
        if not self.window_full:
            return None
        hit, std, iou = self.window_stats()
        p, s = self.gates()
        old = self.tau
        direction, new, keep = None, old, 0
        if (
            old < self.max_threshold
            and hit >= p - _EPS
            and std <= s + _EPS
            and iou - old >= self.margin - _EPS
        ):
            new = _round(min(self.max_threshold, old + self.step_size(old)))
            if new > old:
                direction = "raise"
                self.levels.append(old)
                keep = math.ceil(self.window * self.keep_after_raise)
        elif self.step_back and hit < self.step_back_hit_rate:
            # the step that led to tau: undo the last raise; without one, the step tau would take (our design)
            prev = self.levels[-1] if self.levels else old - self.step_size(old)
            new = _round(max(self.min_threshold, prev))
            if new < old:
                direction = "back"
                if self.levels:
                    self.levels.pop()
                keep = math.ceil(self.window / 2)
        if direction is None:
            return None
        self.tau = new
        self._keep_newest(keep)
        t = {
            "step": self.steps if step is None else int(step),
            "old": old,
            "new": new,
            "direction": direction,
            "window_len": self.window,
            "hit_rate": hit,
            "reward_std": std,
            "mean_iou": iou,
            "P": p,
            "S": s,
            "groups": self.groups,
        }
        self.transitions.append(t)
        return dict(t)

    def _keep_newest(self, keep: int) -> None:
        kept = list(self.entries)[len(self.entries) - keep :] if keep > 0 else []
        self.entries = deque(kept, maxlen=self.window)

    # ------------------------------------------------------------------ logging and resume
    def metrics(self) -> dict[str, float]:
        """``curriculum/tau``, ``curriculum/window_fill`` (entries / window, in [0, 1]),
        ``curriculum/window_hit_rate``, ``curriculum/window_reward_std`` (population std of the hit
        rates), ``curriculum/window_mean_iou`` (NaN while the window is empty) and
        ``curriculum/transitions`` (how many so far)."""
        hit, std, iou = self.window_stats()
        return {
            "curriculum/tau": self.tau,
            "curriculum/window_fill": len(self.entries) / self.window,
            "curriculum/window_hit_rate": hit,
            "curriculum/window_reward_std": std,
            "curriculum/window_mean_iou": iou,
            "curriculum/transitions": float(len(self.transitions)),
        }

    def state_dict(self) -> dict[str, Any]:
        """The state in plain Python types (JSON-able; the options are not part of it: they come
        from the config)."""
        return {
            "tau": self.tau,
            "entries": [[h, i] for h, i in self.entries],
            "transitions": [dict(t) for t in self.transitions],
            "groups": self.groups,
            "steps": self.steps,
            "levels": list(self.levels),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict`'s output. A window longer than ``window`` (the option was lowered)
        keeps its newest entries."""
        try:
            self.tau = _round(state["tau"])
            entries = [(float(h), float(i)) for h, i in state["entries"]]
            self.entries = deque(entries, maxlen=self.window)
            self.transitions = [dict(t) for t in state["transitions"]]
            self.groups = int(state["groups"])
            self.steps = int(state["steps"])
            self.levels = [float(x) for x in state["levels"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"curriculum.load_state_dict: malformed state ({e!r})") from e


class CurriculumCallback:
    """Trainer callback running an `IoUThresholdCurriculum` against a hit reward of the reward set.

    `reward_set` needs ``names`` (the reward columns) and ``rewards`` (the reward objects, same
    order). ``hit_reward`` names the 1/0 hit column (its reward object must have a settable
    ``threshold``: tau is written there), ``iou_reward`` the column with the plain IoU. The hit
    column's per-group mean is taken as the group's hit rate, so the hit reward should score 1 / 0
    (not a dense IoU above the threshold).

    Hooks: `on_rewards` after every sampling round (gathered rewards, global group ids),
    `on_step_end` once per step (the decision; tau changes only here), `state_dict` /
    `load_state_dict` for checkpoints. A transition is logged and, on the main process, appended
    to ``trainer.out / "curriculum.jsonl"`` (one JSON object per line).
    """

    LOG_FILE = "curriculum.jsonl"

    def __init__(
        self,
        curriculum: IoUThresholdCurriculum,
        reward_set: Any,
        *,
        hit_reward: str = "iou_at",
        iou_reward: str = "box_iou",
    ) -> None:
        self.curriculum = curriculum
        self.hit_reward = hit_reward
        self.iou_reward = iou_reward
        names = list(reward_set.names)
        for key, col in (("hit_reward", hit_reward), ("iou_reward", iou_reward)):
            if col not in names:
                raise ValueError(
                    f"curriculum option {key}: no reward column named {col!r}; the reward columns are {names}"
                )
        self.reward = reward_set.rewards[names.index(hit_reward)]
        if not hasattr(self.reward, "threshold"):
            raise ValueError(
                f"curriculum option hit_reward: the reward of column {hit_reward!r} "
                f"({type(self.reward).__name__}) has no `threshold` attribute to set"
            )
        self._groups: dict[int, list[float]] = {}
        self._apply_tau()

    def _apply_tau(self) -> None:
        try:
            self.reward.threshold = self.curriculum.tau
        except AttributeError as e:
            raise ValueError(
                f"curriculum option hit_reward: cannot set `threshold` on the reward of column "
                f"{self.hit_reward!r} ({type(self.reward).__name__}): {e}"
            ) from e

    def on_rewards(self, trainer: Any, rewards: Any, group: Any, names: list[str]) -> None:
        """Accumulate the groups of one sampling round: `rewards` Float[B, K] (gathered over the
        processes, columns `names`), `group` Long[B] (global group ids). Sums per group are kept in
        order of first appearance of the group id; NaN values are ignored."""
        rows = rewards.tolist() if hasattr(rewards, "tolist") else [list(r) for r in rewards]
        gids = group.tolist() if hasattr(group, "tolist") else list(group)
        if len(rows) != len(gids):
            raise ValueError(f"curriculum: {len(rows)} reward rows but {len(gids)} group ids")
        names = list(names)
        for col in (self.hit_reward, self.iou_reward):
            if col not in names:
                raise ValueError(f"curriculum: no reward column named {col!r}; the columns are {names}")
        kh, ki = names.index(self.hit_reward), names.index(self.iou_reward)
        for row, gid in zip(rows, gids, strict=True):
            acc = self._groups.setdefault(int(gid), [0.0, 0, 0.0, 0])
            h, i = float(row[kh]), float(row[ki])
            if not math.isnan(h):
                acc[0] += h
                acc[1] += 1
            if not math.isnan(i):
                acc[2] += i
                acc[3] += 1

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        """Feed the step's groups to the curriculum, write the new tau to the hit reward, add the
        curriculum's metrics to `metrics`, and log / record a transition."""
        hits = [a[0] / a[1] if a[1] else math.nan for a in self._groups.values()]
        ious = [a[2] / a[3] if a[3] else math.nan for a in self._groups.values()]
        self._groups = {}
        t = self.curriculum.observe(hits, ious, step=step)
        self._apply_tau()
        metrics.update(self.curriculum.metrics())
        if getattr(self, "_resumed", False):
            self._resumed = False
            out = getattr(trainer, "out", None)
            if getattr(trainer, "is_main", True) and out is not None:  # drop transitions after the checkpoint
                kept = self.curriculum.transitions[: -1 if t is not None else None]  # t: this step's
                (Path(out) / self.LOG_FILE).write_text("".join(json.dumps(x) + "\n" for x in kept))
        if t is None:
            return
        msg = (
            f"curriculum: step {t['step']}: IoU threshold {t['old']:.3f} -> {t['new']:.3f} ({t['direction']}); "
            f"window of {t['window_len']} groups: hit rate {t['hit_rate']:.3f} (P={t['P']:.2f}), "
            f"reward std {t['reward_std']:.3f} (S={t['S']:.2f}), mean IoU {t['mean_iou']:.3f}"
        )
        logger.info(msg)
        if getattr(trainer, "is_main", True):
            tqdm.write(msg)
            out = getattr(trainer, "out", None)
            if out is not None:
                path = Path(out) / self.LOG_FILE
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a") as f:
                    f.write(json.dumps(t) + "\n")

    def state_dict(self) -> dict[str, Any]:
        return {"curriculum": self.curriculum.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the curriculum and write its tau to the hit reward."""
        self.curriculum.load_state_dict(state["curriculum"])
        self._groups = {}
        self._apply_tau()
        self._resumed = True  # curriculum.jsonl is rewritten from the restored transitions at the next step
