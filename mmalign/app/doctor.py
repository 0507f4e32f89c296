"""Learning diagnostics: why is my reward flat? (`mmalign doctor RUN_DIR`, and live warnings in the trainer).

Each check in `CHECKS` reads a run's ``metrics.jsonl`` / ``config.yaml`` and returns `Finding` s;
`diagnose(run_dir)` runs them.

Details: docs/diagnostics.md, "mmalign.app.doctor".
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger("mmalign.app.doctor")

Level = Literal["ok", "info", "warn", "error"]
LEVELS: tuple[str, ...] = ("error", "warn", "info", "ok")
"""Levels, most severe first (the order of the report)."""

# ----------------------------------------------------------------------------- thresholds

PERSIST_STEPS = 3
"""A per-step condition (zero-std share, clip fraction, length at the cap ...) is reported when it holds on at
least this many logged steps (or on every logged step of a shorter run): one noisy step is not a finding."""

ZERO_STD_WARN = 0.5
"""``zero_std_frac`` at or above this share of groups marks a step (half the groups give no learning signal)."""

CLIP_FRAC_WARN = 0.2
"""``clip_frac`` above this (share of actions whose clipped term is active) marks a step of an off-policy run."""
APPROX_KL_WARN = 0.02
"""``approx_kl`` = 1/2 mean (log ratio)^2 above this (an rms log-ratio of 0.2, the usual clip range) marks a step:
the ratio is far from 1."""
ONPOLICY_TOL = 1e-6
"""``clip_frac`` / ``approx_kl`` at or below this count as exactly 0 (ratio 1)."""
IS_CAPPED_WARN = 0.05
"""``is/capped_frac`` (tokens whose engine/trainer importance weight exceeds ``rollout.is_cap``) above this
marks a step."""

ENTROPY_BASELINE_STEPS = 3
"""The entropy's start is its mean over the first this many logged steps."""
ENTROPY_COLLAPSE_FRAC = 0.3
"""Entropy below this fraction of its start marks a step (collapse)."""
ENTROPY_REWARD_RISE = 0.25
"""A collapse is "as the reward rose" (expected) when ``reward/mean`` over the collapsed steps exceeds its mean over
the first `ENTROPY_BASELINE_STEPS` steps by more than this many starting ``reward/std`` (the per-sample spread of
the total reward; 1 when not logged)."""

CONSTANT_EPS = 1e-9
"""Stds at or below this are 0; means whose spread is at or below this are identical."""
CONSTANT_MIN_STEPS = 2
"""A reward component with std 0 at every logged step is reported once at least this many steps are logged."""
CONSTANT_MEAN_MIN_STEPS = 5
"""A component with the same mean at every step (but std > 0) is reported from this many logged steps."""

TOOL_ACTIVE_RATE = 0.2
"""``tool_call_rate`` must have reached this before a fall counts as a collapse."""
TOOL_COLLAPSE_RATE = 0.05
"""``tool_call_rate`` at or below ``max(TOOL_COLLAPSE_RATE, TOOL_COLLAPSE_FRAC * peak)`` after the peak marks a
step (collapse); at or below ``TOOL_COLLAPSE_RATE`` at every step means the tool is never used."""
TOOL_COLLAPSE_FRAC = 0.1

LENGTH_CAP_FRAC = 0.9
"""``completion_len/mean`` at or above this fraction of the token cap marks a step."""
TRUNCATED_WARN = 0.3
"""``truncated_frac`` at or above this marks a step."""

KL_WARN = 0.1
"""``kl`` (per action, the configured estimator) above this marks a step."""
KL_GROWTH_MIN_STEPS = 6
"""KL growth is judged from this many logged steps on."""
KL_GROWTH_MONOTONE = 0.8
"""Growth: at least this share of the step-to-step changes over the second half of the run are increases ..."""
KL_GROWTH_FACTOR = 2.0
"""... the last value is at least this multiple of the value at the half-way step ..."""
KL_GROWTH_MIN = 0.01
"""... and the last value is at least this (a KL of 1e-5 doubling is not worth a warning)."""

LIVE_WARN_EVERY = 50
"""`LiveDoctor`: at most one warning per check per this many steps."""
LIVE_WINDOW = 50
"""`LiveDoctor`: the checks see the last this many steps ..."""
LIVE_HEAD = ENTROPY_BASELINE_STEPS
"""... plus the first this many (so entropy and tool use keep their start)."""
LIVE_MIN_STEPS = PERSIST_STEPS
"""`LiveDoctor`: checks other than `LIVE_IMMEDIATE` start once this many steps were seen (at step 1 "every logged
step" is one step)."""
LIVE_IMMEDIATE = ("nan",)
"""`LiveDoctor`: checks that warn from the first step (a NaN reward or loss needs no history)."""
LIVE_SKIP = ("overoptimisation",)
"""`LiveDoctor`: checks it does not run (the over-optimisation watchdog warns during training itself)."""

_ZERO_STD_FILTERS = ("dynamic_sampling", "range", "replay")
"""Group filters that keep zero-std groups out of the update (or replace them)."""
_REWARD_KEY = re.compile(r"^reward/(.+)/(mean|std|nan_frac)$")


@dataclass
class Finding:
    """What one check saw. `steps` are the logged step numbers involved (empty when none in particular)."""

    check: str
    level: Level
    steps: list[int]
    message: str
    advice: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    """Machine-readable numbers behind the message (keys depend on the check; in ``--json`` output)."""

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


Check = Callable[[list[dict[str, Any]], "dict[str, Any] | None"], list[Finding]]


# ----------------------------------------------------------------------------- helpers


def format_steps(steps: Iterable[int], max_ranges: int = 8) -> str:
    """Compact step numbers: ``[1, 2, 3, 5, 7, 8]`` -> ``"1-3, 5, 7-8"`` (long lists end with ``, ...``)."""
    ordered = sorted(set(int(s) for s in steps))
    ranges: list[tuple[int, int]] = []
    for s in ordered:
        if ranges and s == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], s)
        else:
            ranges.append((s, s))
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in ranges[:max_ranges]]
    if len(ranges) > max_ranges:
        parts.append(f"... ({len(ordered)} steps)")
    return ", ".join(parts)


def _steps_text(steps: Sequence[int]) -> str:
    return ("step " if len(steps) == 1 else "steps ") + format_steps(steps)


def _num(value: Any) -> float:
    """A logged value as float; None (NaN / inf written by `rundir.jsonable`) and non-numbers -> NaN."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return math.nan


def _step_of(row: dict[str, Any], index: int) -> int:
    s = row.get("step")
    return int(s) if isinstance(s, int | float) and not isinstance(s, bool) else index + 1


def _series(metrics: list[dict[str, Any]], key: str, *, finite: bool = True) -> list[tuple[int, float]]:
    """(step, value) of every row that logged `key`; with `finite`, only finite values."""
    out = []
    for i, row in enumerate(metrics):
        if key in row:
            v = _num(row[key])
            if not finite or math.isfinite(v):
                out.append((_step_of(row, i), v))
    return out


def _persistent(flagged: Sequence[int], n_logged: int) -> bool:
    return bool(flagged) and len(flagged) >= min(PERSIST_STEPS, n_logged)


def _cfg(config: dict[str, Any] | None, dotted: str) -> Any:
    """`config`'s value at ``section.key``, else the default of `mmalign.config` (None without a config)."""
    if config is None:
        return None
    from mmalign import config as cfg_lib

    section, key = dotted.split(".", 1)
    values = config.get(section)
    if isinstance(values, dict) and key in values:
        return values[key]
    defaults = {
        "rollout": cfg_lib.RolloutConfig,
        "trainer": cfg_lib.TrainerConfig,
        "algorithm": cfg_lib.AlgorithmConfig,
    }
    cls = defaults.get(section)
    return getattr(cls(), key, None) if cls is not None else None


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
        return f"{x:.2e}"
    return f"{x:.3g}"


def _span(values: Sequence[float]) -> str:
    """``lo..hi`` (one number when they are equal)."""
    lo, hi = _fmt(min(values)), _fmt(max(values))
    return lo if lo == hi else f"{lo}..{hi}"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _reward_columns(metrics: list[dict[str, Any]]) -> list[str]:
    """Reward columns (``reward/<name>/mean|std|nan_frac``), in order of first appearance."""
    seen: dict[str, None] = {}
    for row in metrics:
        for key in row:
            m = _REWARD_KEY.match(key)
            if m:
                seen.setdefault(m.group(1), None)
    return list(seen)


def _reward_weights(config: dict[str, Any] | None) -> dict[str, float]:
    """Outcome weight of each reward column (``alias`` or ``name``) from the config."""
    out: dict[str, float] = {}
    for spec in (config or {}).get("rewards") or []:
        if isinstance(spec, dict) and spec.get("name"):
            out[str(spec.get("alias") or spec["name"])] = float(spec.get("weight", 1.0))
    return out


# ----------------------------------------------------------------------------- the checks


def check_zero_std(metrics: list[dict[str, Any]], config: dict[str, Any] | None) -> list[Finding]:
    """Share of groups whose total reward has std 0 (``zero_std_frac``): their advantages are 0."""
    name = "zero_std"
    s = _series(metrics, "zero_std_frac")
    if not s:
        return [Finding(name, "info", [], "zero_std_frac not logged", "")]
    values = [v for _, v in s]
    mean, peak = sum(values) / len(values), max(values)
    peak_step = s[values.index(peak)][0]
    flt = _cfg(config, "algorithm.filter")
    filtered = flt in _ZERO_STD_FILTERS
    rewards = dict(_series(metrics, "reward/mean"))
    details = {"mean": mean, "max": peak, "max_step": peak_step, "filter": flt}
    meaning = (
        "A group whose samples all get the same reward has advantage 0 for every sample: it gives no learning "
        "signal (the loss gradient from it is 0). Prompts that are too easy (every sample right) or too hard "
        "(every sample wrong) do this, and so does a reward that cannot tell the samples apart."
    )
    what_to_try = (
        " Try: algorithm.filter=dynamic_sampling (drops such groups and samples more prompts), a larger "
        "rollout.group_size (more chances that one sample differs), easier/harder prompts or data.sampler=vade "
        "(prefers prompts of intermediate success), or a denser reward (partial credit, a format term)."
    )
    if all(v >= 1.0 - CONSTANT_EPS for v in values):
        steps = [st for st, _ in s]
        r = [rewards[st] for st in steps if st in rewards]
        where = f" (reward/mean {_span(r)})" if r else ""
        return [
            Finding(
                name,
                "error",
                steps,
                f"every group had zero reward std at every logged step ({_steps_text(steps)}){where}: all "
                "advantages are 0 and the policy learns nothing",
                meaning + " With every group affected, check first that the reward can vary at all (see the "
                "constant_reward check), then the prompts' difficulty." + what_to_try,
                details,
            )
        ]
    flagged = [st for st, v in s if v >= ZERO_STD_WARN]
    if _persistent(flagged, len(s)):
        r = [rewards[st] for st in flagged if st in rewards]
        where = f"; reward/mean there {_span(r)}" if r else ""
        msg = (
            f"zero-std groups were >= {_pct(ZERO_STD_WARN)} of the groups at {_steps_text(flagged)} "
            f"(mean share {_pct(mean)}, max {_pct(peak)} at step {peak_step}{where})"
        )
        if filtered:
            return [
                Finding(
                    name,
                    "info",
                    flagged,
                    msg + f"; algorithm.filter={flt} keeps them out of the update",
                    meaning + f" The {flt} filter handles them; the cost is extra sampling rounds "
                    "(filter/rounds) or a smaller batch (filter/groups_used). If rounds run out often, make the "
                    "prompts better matched to the model or the group larger.",
                    details,
                )
            ]
        return [
            Finding(name, "warn", flagged, msg, meaning + what_to_try, {**details, "steps_flagged": flagged})
        ]
    return [
        Finding(
            name,
            "ok",
            [],
            f"zero-std groups: mean share {_pct(mean)}, max {_pct(peak)} at step {peak_step}",
            "",
            details,
        )
    ]


def _on_policy(config: dict[str, Any] | None) -> bool | None:
    """True when every rollout gets exactly one optimizer step from the weights that sampled it (ratio = 1);
    None without a config."""
    if config is None:
        return None
    n_iter = int(_cfg(config, "trainer.num_iterations") or 1)
    mb = _cfg(config, "trainer.minibatch_size")
    pps = int(_cfg(config, "rollout.prompts_per_step") or 1)
    g = int(_cfg(config, "rollout.group_size") or 1)
    extra = 1 if _cfg(config, "algorithm.estimator") == "mc_grpo" else 0
    one_update = mb is None or int(mb) >= pps * (g + extra)
    return n_iter == 1 and one_update and _cfg(config, "algorithm.filter") != "replay"


def check_ratio(metrics: list[dict[str, Any]], config: dict[str, Any] | None) -> list[Finding]:
    """Importance ratio and clipping health (``clip_frac``, ``approx_kl``, ``loss``, ``is/capped_frac``)."""
    name = "ratio"
    clip, akl = _series(metrics, "clip_frac"), _series(metrics, "approx_kl")
    if not clip and not akl:
        return [Finding(name, "info", [], "clip_frac / approx_kl not logged (no update ran?)", "")]
    losses = [v for _, v in _series(metrics, "loss")]
    loss_abs = sum(abs(v) for v in losses) / len(losses) if losses else math.nan
    max_clip = max((v for _, v in clip), default=0.0)
    max_akl = max((v for _, v in akl), default=0.0)
    on_policy = _on_policy(config)
    exact = max_clip <= ONPOLICY_TOL and max_akl <= ONPOLICY_TOL
    details = {
        "on_policy": on_policy,
        "max_clip_frac": max_clip,
        "max_approx_kl": max_akl,
        "mean_abs_loss": loss_abs,
    }
    out: list[Finding] = []
    expected = (
        "In on-policy GRPO (trainer.num_iterations 1, one optimizer step per rollout) the weights being updated "
        "are the ones that sampled, so the ratio pi/pi_old is exactly 1, nothing is clipped, and the loss value "
        "is minus the (token-weighted) mean advantage, close to 0 by construction of group-relative advantages. "
        "Its gradient is not 0: this is not a sign that nothing is learned. Judge learning by reward/mean, "
        "adv/abs_mean and grad_norm; clipping only acts with trainer.num_iterations > 1 or minibatches."
    )
    if exact and on_policy is not False:
        why = "on-policy run" if on_policy else "looks on-policy (no config.yaml to confirm)"
        out.append(
            Finding(
                name,
                "info",
                [],
                f"{why}: ratio = 1, clip_frac 0 and approx_kl 0 at every logged step, mean |loss| "
                f"{_fmt(loss_abs)} -- expected",
                expected,
                details,
            )
        )
    elif on_policy:
        steps = [st for st, v in clip if v > ONPOLICY_TOL] + [st for st, v in akl if v > ONPOLICY_TOL]
        steps = sorted(set(steps))
        out.append(
            Finding(
                name,
                "warn",
                steps,
                f"the config is on-policy, yet the ratio differs from 1 at {_steps_text(steps)} (max clip_frac "
                f"{_fmt(max_clip)}, max approx_kl {_fmt(max_akl)})",
                "With one optimizer step per rollout the ratio should be exactly 1. logp_old then came from a "
                "separate forward pass (a rollout engine, see is/*) that does not match the training forward: "
                "dropout left on, different precision or kernels. Check model dropout and mixed precision.",
                details,
            )
        )
    else:
        flagged_clip = [st for st, v in clip if v > CLIP_FRAC_WARN]
        flagged_kl = [st for st, v in akl if v > APPROX_KL_WARN]
        if _persistent(flagged_clip, len(clip)):
            out.append(
                Finding(
                    name,
                    "warn",
                    flagged_clip,
                    f"clip_frac above {_fmt(CLIP_FRAC_WARN)} at {_steps_text(flagged_clip)} (max {_fmt(max_clip)})",
                    "Many actions hit the clip: later passes over a rollout move the policy so far that their "
                    "gradient is cut off, and each rollout is used less than the extra passes cost. Try fewer "
                    "trainer.num_iterations, a lower trainer.lr, larger minibatches (fewer optimizer steps per "
                    "rollout), or a wider clip (loss_kwargs eps_high, e.g. 0.28 as in DAPO).",
                    {**details, "steps_flagged": flagged_clip},
                )
            )
        if _persistent(flagged_kl, len(akl)):
            out.append(
                Finding(
                    name,
                    "warn",
                    flagged_kl,
                    f"the ratio is far from 1: approx_kl above {_fmt(APPROX_KL_WARN)} at "
                    f"{_steps_text(flagged_kl)} (max {_fmt(max_akl)}, rms log-ratio "
                    f"{_fmt(math.sqrt(2 * max_akl))})",
                    "The policy drifts far from the one that sampled within one step's updates: the surrogate is "
                    "no longer a good estimate and training can become unstable. Lower trainer.lr or "
                    "trainer.num_iterations, or use more samples per optimizer step.",
                    {**details, "steps_flagged": flagged_kl},
                )
            )
        if not out:
            out.append(
                Finding(
                    name,
                    "ok",
                    [],
                    f"off-policy updates (several per rollout): max clip_frac {_fmt(max_clip)}, max approx_kl "
                    f"{_fmt(max_akl)}",
                    "",
                    details,
                )
            )
    capped = _series(metrics, "is/capped_frac")
    flagged_is = [st for st, v in capped if v > IS_CAPPED_WARN]
    if _persistent(flagged_is, len(capped)):
        out.append(
            Finding(
                name,
                "warn",
                flagged_is,
                f"engine/trainer mismatch: is/capped_frac above {_fmt(IS_CAPPED_WARN)} at {_steps_text(flagged_is)} "
                f"(max {_fmt(max(v for _, v in capped))})",
                "Many tokens' importance weights (trainer log-prob over the rollout engine's) exceed "
                "rollout.is_cap: the engine samples from a different distribution than the one trained. Check the "
                "engine's dtype and weight sync (is/abs_dlogp_mean); keep rollout.is_correction on.",
                {"steps_flagged": flagged_is},
            )
        )
    return out


def _reward_rise(metrics: list[dict[str, Any]], steps: Sequence[int]) -> tuple[float, float, float] | None:
    """(before, at, scale): ``reward/mean`` averaged over the first `ENTROPY_BASELINE_STEPS` logged steps and
    over `steps`, and the starting ``reward/std`` a rise is measured against (1 when not logged or 0); None
    when ``reward/mean`` is not logged at the start or at `steps`."""
    rewards = _series(metrics, "reward/mean")
    head = [v for _, v in rewards[:ENTROPY_BASELINE_STEPS]]
    wanted = set(steps)
    at = [v for st, v in rewards if st in wanted]
    if not head or not at:
        return None
    stds = [v for _, v in _series(metrics, "reward/std")[:ENTROPY_BASELINE_STEPS]]
    scale = sum(stds) / len(stds) if stds else 0.0
    return sum(head) / len(head), sum(at) / len(at), scale if scale > CONSTANT_EPS else 1.0


def check_entropy(metrics: list[dict[str, Any]], config: dict[str, Any] | None) -> list[Finding]:
    """Entropy collapse: ``entropy`` falling below `ENTROPY_COLLAPSE_FRAC` of its start.

    Whether that is a problem depends on the reward at the collapsed steps (`_reward_rise`): entropy that fell
    as ``reward/mean`` rose (by more than `ENTROPY_REWARD_RISE` starting reward stds) is the policy committing
    to what it learned, expected on a task with one right answer (``info``); a collapse while the reward is
    flat or falling ends exploration without a gain (``warn``, with what to try); without ``reward/mean`` the
    two cannot be told apart (``warn``, saying so)."""
    name = "entropy"
    s = _series(metrics, "entropy")
    if not s:
        return [
            Finding(
                name,
                "info",
                [],
                "entropy not logged: no policy fills ActionStats.entropy, so collapse cannot be checked",
                "Signs of collapse that are logged: zero_std_frac rising (the samples of a group become "
                "identical) and completion_len/mean freezing.",
            )
        ]
    head = [v for _, v in s[:ENTROPY_BASELINE_STEPS]]
    start = sum(head) / len(head)
    details: dict[str, Any] = {"start": start, "last": s[-1][1]}
    if start <= 0:
        return [
            Finding(
                name, "info", [], f"entropy starts at {_fmt(start)}; nothing to compare with", "", details
            )
        ]
    limit = ENTROPY_COLLAPSE_FRAC * start
    flagged = [st for st, v in s[ENTROPY_BASELINE_STEPS:] if v < limit]
    if _persistent(flagged, len(s)):
        low = min(v for _, v in s)
        seen = (
            f"from {_fmt(start)} (first {len(head)} steps) to below {_pct(ENTROPY_COLLAPSE_FRAC)} of it at "
            f"{_steps_text(flagged)} (min {_fmt(low)}, last {_fmt(s[-1][1])})"
        )
        what_to_try = (
            "Try a lower trainer.lr, a KL term (algorithm.kl_coef), a higher rollout.temperature, clip-higher "
            "(loss_kwargs eps_high 0.28) or fewer trainer.num_iterations."
        )
        rise = _reward_rise(metrics, flagged)
        details = {**details, "steps_flagged": flagged}
        if rise is None:
            return [
                Finding(
                    name,
                    "warn",
                    flagged,
                    f"entropy collapsed {seen}; reward/mean is not logged there, so whether the reward still "
                    "rose (expected) cannot be told",
                    "If the reward was flat or falling, the policy became nearly deterministic without a gain: "
                    "the samples of a group stop differing, groups get zero reward std and exploration ends. "
                    + what_to_try,
                    details,
                )
            ]
        before, at, scale = rise
        details = {**details, "reward_start": before, "reward_at_flagged": at, "reward_std_start": scale}
        change = f"reward/mean {_fmt(before)} over the first steps, {_fmt(at)} over the collapsed ones"
        if at - before > ENTROPY_REWARD_RISE * scale:
            return [
                Finding(
                    name,
                    "info",
                    flagged,
                    f"entropy fell as the reward rose: {seen}; {change} -- expected on tasks with one right "
                    "answer",
                    "The policy is committing to the answers that earn reward: on a verifiable task with short, "
                    "single correct answers (arithmetic, multiple choice, a box) that is what learning looks "
                    "like. It becomes a problem when reward/mean stops rising while zero_std_frac climbs (groups "
                    "no longer differ), or on an open-ended task where varied outputs are wanted; then: "
                    + what_to_try,
                    details,
                )
            ]
        return [
            Finding(
                name,
                "warn",
                flagged,
                f"entropy collapsed while the reward is flat or falling: {seen}; {change} -- a problem",
                "The policy became nearly deterministic without a gain in reward: the samples of a group stop "
                "differing, groups get zero reward std and exploration ends (the reward plateaus where it is). "
                + what_to_try,
                details,
            )
        ]
    return [
        Finding(
            name,
            "ok",
            [],
            f"entropy {_fmt(start)} at the start, {_fmt(s[-1][1])} at step {s[-1][0]}",
            "",
            details,
        )
    ]


def check_constant_reward(metrics: list[dict[str, Any]], config: dict[str, Any] | None) -> list[Finding]:
    """Reward components that never vary (``reward/<name>/std`` 0 at every step, or the same mean every step)."""
    name = "constant_reward"
    columns = _reward_columns(metrics)
    if not columns:
        return [Finding(name, "info", [], "no reward/<name>/mean|std columns logged", "")]
    weights = _reward_weights(config)
    out: list[Finding] = []
    for col in columns:
        stds = _series(metrics, f"reward/{col}/std")
        means = _series(metrics, f"reward/{col}/mean")
        weight = weights.get(col)
        level: Level = "info" if weight == 0 else "warn"
        zero_w = " (its weight is 0: logged only, or a per-step process reward)" if weight == 0 else ""
        steps = [st for st, _ in stds]
        mvals = [v for _, v in means]
        if len(stds) >= CONSTANT_MIN_STEPS and all(abs(v) <= CONSTANT_EPS for _, v in stds):
            same = mvals and max(mvals) - min(mvals) <= CONSTANT_EPS
            value = f", always {_fmt(mvals[0])}" if same else ""
            out.append(
                Finding(
                    name,
                    level,
                    steps,
                    f"reward {col!r} never varies: std 0 at every logged step ({_steps_text(steps)}){value}{zero_w}",
                    "A component that gives every sample the same value adds nothing to group-relative "
                    "advantages; it only shifts reward/mean. Check its options and inputs (a threshold never "
                    "reached, a guard that always passes, a column or output it does not find), fix it or drop it.",
                    {"reward": col, "kind": "zero_std", "value": mvals[0] if same else None},
                )
            )
        elif len(means) >= CONSTANT_MEAN_MIN_STEPS and max(mvals) - min(mvals) <= CONSTANT_EPS:
            out.append(
                Finding(
                    name,
                    level,
                    [st for st, _ in means],
                    f"reward {col!r} has the same mean {_fmt(mvals[0])} at every logged step "
                    f"({_steps_text([st for st, _ in means])}) although it varies within a batch{zero_w}",
                    "Its batch mean never moves as the policy changes: it probably does not depend on what the "
                    "policy samples (e.g. it reads the prompt or the sample's position, not the output). Check "
                    "what it reads.",
                    {"reward": col, "kind": "constant_mean", "value": mvals[0]},
                )
            )
    if not out:
        out.append(Finding(name, "ok", [], f"every reward component varies ({', '.join(columns)})", ""))
    return out


def check_nan(metrics: list[dict[str, Any]], config: dict[str, Any] | None) -> list[Finding]:
    """NaN rewards (``reward/mean``, ``reward/<name>/nan_frac``, ``reward/nan_groups``), unparsed completions
    (``reward/<name>/unparsed_frac``) and non-finite ``loss`` / ``grad_norm``."""
    name = "nan"
    out: list[Finding] = []
    total_nan = [st for st, v in _series(metrics, "reward/mean", finite=False) if not math.isfinite(v)]
    if total_nan:
        out.append(
            Finding(
                name,
                "error",
                total_nan,
                f"the total reward was NaN for the whole batch at {_steps_text(total_nan)}",
                "Every sample had NaN ('not applicable') in some weighted component, so every advantage is 0. "
                "Find the reward that returns NaN (its reward/<name>/nan_frac) and the rows it cannot score.",
                {"kind": "total_nan"},
            )
        )
    for key in ("loss", "grad_norm"):
        bad = [st for st, v in _series(metrics, key, finite=False) if not math.isfinite(v)]
        if bad:
            out.append(
                Finding(
                    name,
                    "error",
                    bad,
                    f"{key} was NaN or infinite at {_steps_text(bad)}",
                    "The update itself is broken: look for infinite log-probs (a masked token sampled), fp16 "
                    "overflow (use bf16), a reward of huge magnitude, or a too-high trainer.lr.",
                    {"kind": f"nonfinite_{key}"},
                )
            )
    nan_groups = dict(_series(metrics, "reward/nan_groups"))
    for col in _reward_columns(metrics):
        s = _series(metrics, f"reward/{col}/nan_frac")
        flagged = [(st, v) for st, v in s if v > 0]
        if not flagged:
            continue
        steps = [st for st, _ in flagged]
        peak = max(v for _, v in flagged)
        groups = sum(nan_groups.get(st, 0.0) for st in steps)
        always = len(flagged) == len(s) and all(v >= 1.0 for _, v in flagged)
        msg = (
            f"reward {col!r} was NaN for every sample at every logged step ({_steps_text(steps)})"
            if always
            else f"reward {col!r} was NaN for up to {_pct(peak)} of the samples at {_steps_text(steps)}"
        )
        if groups:
            msg += f" ({int(groups)} all-NaN (reward, group) pairs in reward/nan_groups)"
        out.append(
            Finding(
                name,
                "warn",
                steps,
                msg,
                "NaN means 'not applicable': the sample's total leaves this component out, and a group where it "
                "is NaN for every sample gets no signal from it. If the reward applies to some rows only by design "
                "this is expected; otherwise the reward cannot find its inputs (a missing reference column, an "
                "output not produced).",
                {"reward": col, "kind": "nan", "max": peak},
            )
        )
    for key in sorted(
        {k for row in metrics for k in row if k.startswith("reward/") and k.endswith("/unparsed_frac")}
    ):
        col = key[len("reward/") : -len("/unparsed_frac")]
        s = _series(metrics, key)
        flagged = [(st, v) for st, v in s if v > 0]
        if not flagged:
            continue
        steps = [st for st, _ in flagged]
        peak = max(v for _, v in flagged)
        last = s[-1][1]
        out.append(
            Finding(
                name,
                "warn",
                steps,
                f"reward {col!r} could not parse up to {_pct(peak)} of the completions at {_steps_text(steps)} "
                f"(last {_pct(last)})",
                "Unparsed completions get the reward's worst score. A share that falls over training is the "
                "policy learning the format; one that stays high means the format asked for in the prompt and the "
                "one the reward parses disagree (tags, coordinate convention). The reward logs an example "
                "completion when it happens.",
                {"reward": col, "kind": "unparsed", "max": peak, "last": last},
            )
        )
    if not out:
        out.append(Finding(name, "ok", [], "no NaN rewards, unparsed completions or non-finite losses", ""))
    return out


def check_tool_use(metrics: list[dict[str, Any]], config: dict[str, Any] | None) -> list[Finding]:
    """Multi-turn runs: ``tool_call_rate`` (share of samples into which the environment inserted anything)
    collapsing to ~0, or never above ~0; ``num_turns/mean`` is quoted."""
    name = "tool_use"
    s = _series(metrics, "tool_call_rate")
    if not s:
        if _cfg(config, "rollout.loop") == "multi_turn":
            return [Finding(name, "info", [], "multi-turn run, but tool_call_rate is not logged", "")]
        return [Finding(name, "info", [], "not a multi-turn run (no tool_call_rate logged)", "")]
    turns = dict(_series(metrics, "num_turns/mean"))
    values = [v for _, v in s]
    peak = max(values)
    peak_i = values.index(peak)
    peak_step = s[peak_i][0]
    details: dict[str, Any] = {"peak": peak, "peak_step": peak_step, "last": values[-1]}

    def turns_at(st: int) -> str:
        return f", num_turns/mean {_fmt(turns[st])}" if st in turns else ""

    if peak <= TOOL_COLLAPSE_RATE:
        steps = [st for st, _ in s]
        if len(steps) < PERSIST_STEPS:
            return [Finding(name, "ok", [], f"tool_call_rate {_fmt(peak)} so far", "", details)]
        return [
            Finding(
                name,
                "warn",
                steps,
                f"the tool is never used: tool_call_rate <= {_fmt(TOOL_COLLAPSE_RATE)} at every logged step "
                f"({_steps_text(steps)}, max {_fmt(peak)})",
                "The environment never inserted anything: the model does not produce the tool-call format. Check "
                "that the prompt / system prompt shows the format the environment parses, warm-start on a few "
                "tool-using examples, or pay for it (tool_use_bonus).",
                details,
            )
        ]
    limit = max(TOOL_COLLAPSE_RATE, TOOL_COLLAPSE_FRAC * peak)
    collapsed = [st for st, v in s[peak_i + 1 :] if v <= limit]
    if peak >= TOOL_ACTIVE_RATE and _persistent(collapsed, len(s)):
        last_step = s[-1][0]
        return [
            Finding(
                name,
                "warn",
                collapsed,
                f"tool use collapsed: tool_call_rate fell from {_fmt(peak)} (step {peak_step}{turns_at(peak_step)}) "
                f"to <= {_fmt(limit)} at {_steps_text(collapsed)} (last {_fmt(values[-1])}{turns_at(last_step)})",
                "The classic failure of multi-turn RL: answering directly pays as well as (or better than) "
                "calling the tool, so the policy stops calling it and the multi-turn behaviour is lost. Reward "
                "tool use (tool_use_bonus) or a process reward on useful calls, check how often the environment "
                "refuses calls (reward/<name>/refused_frac), keep rollout.loop_kwargs.mask_over_turn in mind, and "
                "lower trainer.lr or add a KL term to slow the drift.",
                {**details, "steps_flagged": collapsed},
            )
        ]
    return [
        Finding(
            name,
            "ok",
            [],
            f"tool_call_rate {_span(values)} (last {_fmt(values[-1])} at step {s[-1][0]})",
            "",
            details,
        )
    ]


def _token_cap(config: dict[str, Any] | None) -> int | None:
    """The cap on generated tokens per sample, from the config (None when unknown)."""
    if config is None:
        return None
    per_turn = _cfg(config, "rollout.max_new_tokens")
    loop = _cfg(config, "rollout.loop")
    if loop == "single_turn":
        return int(per_turn) if per_turn else None
    if loop == "multi_turn":
        kw = _cfg(config, "rollout.loop_kwargs") or {}
        per_turn = kw.get("max_tokens_per_turn") or per_turn
        cap = int(kw.get("max_turns") or 4) * int(per_turn)
        if kw.get("max_completion_tokens"):
            cap = min(cap, int(kw["max_completion_tokens"]))
        return cap
    return None


def check_length_cap(metrics: list[dict[str, Any]], config: dict[str, Any] | None) -> list[Finding]:
    """Completion length drifting to the cap: ``completion_len/mean`` near the token cap
    (``rollout.max_new_tokens``; multi-turn: ``max_turns`` x per-turn budget) and ``truncated_frac`` high."""
    name = "length_cap"
    lengths, trunc = _series(metrics, "completion_len/mean"), _series(metrics, "truncated_frac")
    if not lengths and not trunc:
        return [
            Finding(
                name, "info", [], "completion_len/mean and truncated_frac not logged (not a text run)", ""
            )
        ]
    cap = _token_cap(config)
    near = [st for st, v in lengths if cap and v >= LENGTH_CAP_FRAC * cap]
    cut = [st for st, v in trunc if v >= TRUNCATED_WARN]
    flagged = sorted(set(near) | set(cut))
    n = max(len(lengths), len(trunc))
    lv = [v for _, v in lengths]
    head = lv[:PERSIST_STEPS]
    tail = lv[-PERSIST_STEPS:]
    start = sum(head) / len(head) if head else math.nan
    end = sum(tail) / len(tail) if tail else math.nan
    cap_text = f" of the cap {cap}" if cap else ""
    details = {
        "cap": cap,
        "len_start": start,
        "len_end": end,
        "max_truncated": max((v for _, v in trunc), default=0.0),
    }
    drift = (
        f"completion_len/mean {_fmt(start)} -> {_fmt(end)}{cap_text}"
        if lv
        else "completion_len/mean not logged"
    )
    if _persistent(flagged, n):
        parts = []
        if near:
            parts.append(f"completion_len/mean >= {_pct(LENGTH_CAP_FRAC)}{cap_text} at {_steps_text(near)}")
        if cut:
            parts.append(
                f"truncated_frac >= {_pct(TRUNCATED_WARN)} at {_steps_text(cut)} (max {_pct(details['max_truncated'])})"
            )
        return [
            Finding(
                name,
                "warn",
                flagged,
                "completions run into the length cap: " + "; ".join(parts) + f" ({drift})",
                "Truncated completions end without an answer (usually the worst reward) and, with a length-"
                "normalised loss, long wrong answers are penalised less per token, so length can drift up. Try a "
                "larger rollout.max_new_tokens, the overlong reward (soft penalty near the cap), stop strings, or a "
                "length-unbiased aggregation (algorithm.loss_agg seq_sum_norm, estimator dr_grpo).",
                {**details, "steps_flagged": flagged},
            )
        ]
    return [
        Finding(
            name,
            "ok",
            [],
            drift + (f", max truncated_frac {_pct(details['max_truncated'])}" if trunc else ""),
            "",
            details,
        )
    ]


def check_kl(metrics: list[dict[str, Any]], config: dict[str, Any] | None) -> list[Finding]:
    """KL to the reference (``kl``, logged when ``algorithm.kl_coef`` > 0): above `KL_WARN`, or still growing
    steadily over the second half of the run."""
    name = "kl"
    s = _series(metrics, "kl")
    if not s:
        coef = _cfg(config, "algorithm.kl_coef")
        if coef:
            return [Finding(name, "info", [], f"algorithm.kl_coef is {coef} but kl is not logged", "")]
        return [
            Finding(
                name,
                "info",
                [],
                "no KL term (algorithm.kl_coef 0): kl is not logged",
                "approx_kl is the per-update drift from the sampling policy, not the distance to the reference.",
            )
        ]
    out: list[Finding] = []
    values = [v for _, v in s]
    details = {"max": max(values), "last": values[-1]}
    flagged = [st for st, v in s if v > KL_WARN]
    if _persistent(flagged, len(s)):
        out.append(
            Finding(
                name,
                "warn",
                flagged,
                f"kl above {_fmt(KL_WARN)} at {_steps_text(flagged)} (max {_fmt(max(values))}, last {_fmt(values[-1])})",
                "The policy is far from the reference: reward hacking or degenerate outputs often show up here. "
                "Look at the samples of those steps; raise algorithm.kl_coef or lower trainer.lr.",
                {**details, "steps_flagged": flagged},
            )
        )
    if len(s) >= KL_GROWTH_MIN_STEPS:
        half = len(s) // 2
        second = s[half - 1 :]
        ups = sum(b > a for (_, a), (_, b) in zip(second, second[1:], strict=False))
        share = ups / max(1, len(second) - 1)
        mid, last = second[0][1], second[-1][1]
        if (
            share >= KL_GROWTH_MONOTONE
            and last >= KL_GROWTH_MIN
            and last >= KL_GROWTH_FACTOR * max(mid, 1e-12)
        ):
            steps = [st for st, _ in second]
            out.append(
                Finding(
                    name,
                    "warn",
                    steps,
                    f"kl is still growing: {_fmt(mid)} at step {second[0][0]} -> {_fmt(last)} at step "
                    f"{second[-1][0]}, rising at {_pct(share)} of the steps {format_steps(steps)}",
                    "The KL did not level off in the second half of the run: the policy keeps moving away from the "
                    "reference. If rewards still improve this can be fine; if they do not, raise algorithm.kl_coef "
                    "or lower trainer.lr.",
                    {**details, "mid": mid, "rising_share": share},
                )
            )
    if not out:
        out.append(
            Finding(name, "ok", [], f"kl max {_fmt(max(values))}, last {_fmt(values[-1])}", "", details)
        )
    return out


def check_overoptimisation(metrics: list[dict[str, Any]], config: dict[str, Any] | None) -> list[Finding]:
    """The over-optimisation watchdog's findings (``eval.watchdog``, `mmalign.app.overopt`): the held-out gold
    reward against the training reward, the step at which a divergence began, drift of the samples' image
    statistics, the per-denoising-step ratio bias. `diagnose` feeds it the watchdog's own log
    (``overopt.jsonl``: every evaluation) when the run has one, else the ``watchdog/*`` metrics."""
    name = "overoptimisation"
    gold = _series(metrics, "watchdog/gold")
    if not gold:
        every = ((config or {}).get("eval") or {}).get("watchdog", {}) or {}
        why = "eval.watchdog.every is 0" if config is not None and not every.get("every") else "not logged"
        return [
            Finding(
                name,
                "info",
                [],
                f"no over-optimisation watchdog numbers ({why})",
                "Set eval.watchdog.every (with a held-out gold reward in eval.rewards) to check during training "
                "that the training reward is not being hacked (docs/overoptimisation.md).",
            )
        ]
    train = dict(_series(metrics, "watchdog/train_reward"))
    best_step = (
        int(_series(metrics, "watchdog/best_step")[-1][1]) if _series(metrics, "watchdog/best_step") else None
    )
    best = max(v for _, v in gold)
    (first_step, first), (last_step, last) = gold[0], gold[-1]
    drift = {}
    for row in metrics[::-1]:
        found = {k.split("/", 2)[2]: _num(v) for k, v in row.items() if k.startswith("watchdog/drift_z/")}
        if found:
            drift = {k: v for k, v in found.items() if math.isfinite(v)}
            break
    bias = [v for _, v in _series(metrics, "watchdog/ratio_bias/max_abs")]
    details: dict[str, Any] = {
        "evaluations": len(gold),
        "first": first,
        "best": best,
        "best_step": best_step,
        "last": last,
        "last_step": last_step,
        "drift_z": drift,
    }
    extra = ""
    if drift:
        k = max(drift, key=lambda n: abs(drift[n]))
        extra += f"; largest drift of the samples: {k} {drift[k]:+.1f} base std"
    if bias:
        details["max_ratio_bias"] = max(bias)
        extra += f"; max |mean(ratio - 1)| of a denoising step {_fmt(max(bias))}"
    curve = (
        f"gold reward {_fmt(first)} (step {first_step}) -> best {_fmt(best)}"
        f"{f' (step {best_step})' if best_step is not None else ''} -> {_fmt(last)} (step {last_step}); training "
        f"reward on the same samples {_fmt(train.get(first_step, math.nan))} -> {_fmt(train.get(last_step, math.nan))}"
    )
    diverging = [st for st, v in _series(metrics, "watchdog/diverging") if v >= 0.5]
    if diverging:
        since = [v for _, v in _series(metrics, "watchdog/diverged_since")]
        began = int(since[0]) if since else diverging[0]
        warned = [str(r["watchdog/warning"]) for r in metrics if r.get("watchdog/warning")]
        details.update({"diverged_since": began, "flagged_at": diverging[0], "warnings": warned})
        return [
            Finding(
                name,
                "warn",
                diverging,
                (warned[0] if warned else f"over-optimisation: divergence began at step {began}")
                + f" ({curve}{extra})",
                "The training reward keeps rising on held-out prompts while the gold reward falls: the policy is "
                "exploiting the training reward (reward hacking). Use the best checkpoint by gold reward (best/ in "
                "the run directory), look at the samples from the step the divergence began, and fix the reward "
                "(add the gold criterion, a KL term algorithm.kl_coef, a lower trainer.lr).",
                details,
            )
        ]
    return [Finding(name, "ok", [], curve + extra, "", details)]


def check_step_order(metrics: list[dict[str, Any]], config: dict[str, Any] | None) -> list[Finding]:
    """The logged steps increase one row at a time. A step logged twice or going back (1, 1, 2, 2, ...) means
    two runs wrote into one ``output_dir`` (the run lock refuses that since it exists) or a hand-edited file:
    every other check then reads a mix of two runs."""
    name = "step_order"
    steps = [_step_of(row, i) for i, row in enumerate(metrics)]
    bad = sorted({b for a, b in zip(steps, steps[1:]) if b <= a})
    if not bad:
        return [Finding(name, "ok", [], f"{len(steps)} logged steps, each after the one before")]
    repeated = sorted({s for s in steps if steps.count(s) > 1})
    return [
        Finding(
            name,
            "error",
            bad,
            f"metrics.jsonl logs steps out of order: step {_steps_text(bad)} comes after a step as late or later "
            f"({len(repeated)} step(s) logged more than once: {format_steps(repeated)})",
            "Two runs wrote into this output_dir at once (or the file was edited): the curves mix two runs, so the "
            "other findings do not describe one run. Train again into a fresh output_dir; a second writer is "
            "refused now (the run lock).",
            {"out_of_order": bad, "repeated": repeated},
        )
    ]


CHECKS: dict[str, Check] = {
    "step_order": check_step_order,
    "zero_std": check_zero_std,
    "ratio": check_ratio,
    "entropy": check_entropy,
    "constant_reward": check_constant_reward,
    "nan": check_nan,
    "tool_use": check_tool_use,
    "length_cap": check_length_cap,
    "kl": check_kl,
    "overoptimisation": check_overoptimisation,
}
"""Every check, by name, in report order."""


# ----------------------------------------------------------------------------- a run directory


def load_run(run_dir: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(metrics rows, config dict or None) of a run directory. Raises `FileNotFoundError` naming the missing
    ``metrics.jsonl``. A line that is not JSON (a run being written) is skipped."""
    import yaml

    from mmalign.training import rundir

    root = Path(run_dir)
    path = root / rundir.METRICS_FILE
    if not path.is_file():
        what = "the folder does not exist" if not root.exists() else "no such file"
        raise FileNotFoundError(
            f"{path}: {what}; RUN_DIR must be a run's output_dir (it holds metrics.jsonl)"
        )
    metrics = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # e.g. the last line of a run that is writing it
            if isinstance(row, dict):
                metrics.append(row)
    config = None
    cfg_path = root / rundir.CONFIG_FILE
    if cfg_path.is_file():
        try:
            loaded = yaml.safe_load(cfg_path.read_text())
            config = loaded if isinstance(loaded, dict) else None
        except yaml.YAMLError:
            config = None
    return metrics, config


def run_checks(
    metrics: list[dict[str, Any]], config: dict[str, Any] | None, checks: Sequence[str] | None = None
) -> list[Finding]:
    """The findings of `checks` (default: all of `CHECKS`) on metrics rows; a check that fails is reported as
    an ``error`` finding of that check instead of raising."""
    names = list(CHECKS) if checks is None else list(checks)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise KeyError(f"unknown check(s) {unknown}; known: {', '.join(CHECKS)}")
    out: list[Finding] = []
    for n in names:
        try:
            out.extend(CHECKS[n](metrics, config))
        except Exception as e:  # a check bug must not hide the others
            out.append(Finding(n, "error", [], f"the check failed: {type(e).__name__}: {e}", ""))
    return out


def diagnose(run_dir: str | Path, checks: Sequence[str] | None = None) -> list[Finding]:
    """Run the checks on a run directory (``metrics.jsonl`` and ``config.yaml``). NaN findings get an example
    sample from ``samples/`` when one of the flagged steps was sampled."""
    metrics, config = load_run(run_dir)
    if not metrics:
        return [Finding("run", "info", [], f"{Path(run_dir) / 'metrics.jsonl'} holds no steps yet", "")]
    findings = run_checks(metrics, config, checks)
    if checks is None or "overoptimisation" in checks:
        rows = watchdog_rows(run_dir)
        if rows:
            findings = [f for f in findings if f.check != "overoptimisation"]
            try:
                findings.extend(check_overoptimisation(rows, config))
            except Exception as e:  # a check bug must not hide the others
                findings.append(Finding("overoptimisation", "error", [], f"the check failed: {e}", ""))
    for f in findings:
        if f.check == "nan" and f.details.get("kind") == "nan":
            example = _nan_example(run_dir, f.steps, f.details["reward"])
            if example:
                f.message += f"; e.g. {example}"
                f.details["example"] = example
    return findings


def watchdog_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """The over-optimisation watchdog's evaluations (``RUN_DIR/overopt.jsonl``) as metrics-like rows: each
    evaluation's ``watchdog/*`` numbers (`mmalign.app.overopt.record_metrics`) and, where it warned,
    ``watchdog/warning`` (the text). Empty when the run has no such log. Unlike ``metrics.jsonl`` it holds every
    evaluation, also those of steps that were not logged, and the base model's at step 0."""
    from mmalign.app import overopt

    records = overopt.read_log(run_dir)
    if not records:
        return []
    base = overopt.evaluation_of(records[0])
    rows = []
    for rec in records:
        row: dict[str, Any] = {"step": int(rec["step"]), **overopt.record_metrics(rec, base)}
        if rec.get("warning"):
            row["watchdog/warning"] = rec["warning"]
        rows.append(row)
    return rows


def _nan_example(run_dir: str | Path, steps: Sequence[int], column: str) -> str | None:
    """A sample whose `column` reward is NaN (null) in the samples file of one of `steps`."""
    from mmalign.training import rundir

    sampled = set(rundir.sample_steps(run_dir))
    for st in steps:
        if st not in sampled:
            continue
        try:
            rows = rundir.read_samples(run_dir, st, resolve=False)
        except (OSError, ValueError):
            continue
        for i, row in enumerate(rows):
            rewards = row.get("rewards") or {}
            if column in rewards and rewards[column] is None:
                prompt = str(row.get("prompt", ""))[:80]
                text = row.get("text")
                shown = f", output {str(text)[:80]!r}" if isinstance(text, str) else ""
                return f"step {st} sample {i}: prompt {prompt!r}{shown}"
    return None


def summary(findings: Sequence[Finding]) -> dict[str, int]:
    """How many findings of each level."""
    return {lv: sum(f.level == lv for f in findings) for lv in LEVELS}


def format_report(findings: Sequence[Finding], title: str | None = None, width: int = 110) -> str:
    """The findings as text, most severe first (checks in registry order within a level), lines wrapped at
    `width`, with a summary line."""
    order = {lv: i for i, lv in enumerate(LEVELS)}
    check_order = {n: i for i, n in enumerate(CHECKS)}
    ranked = sorted(
        enumerate(findings), key=lambda p: (order.get(p[1].level, 9), check_order.get(p[1].check, 99), p[0])
    )
    lines = [title] if title else []
    pad = " " * 22
    for _, f in ranked:
        head = f"{f.level.upper():5} {f.check:15} "
        lines.append(textwrap.fill(f.message, width, initial_indent=head, subsequent_indent=pad))
        if f.advice and f.level != "ok":
            lines.append(
                textwrap.fill(f.advice, width, initial_indent=pad + "-> ", subsequent_indent=pad + "   ")
            )
    counts = summary(findings)
    lines.append(
        f"summary: {counts['error']} error(s), {counts['warn']} warning(s), {counts['info']} info, {counts['ok']} ok"
    )
    return "\n".join(lines)


def doctor_main(argv: Sequence[str] | None = None) -> int:
    """``mmalign doctor RUN_DIR [--json] [--checks a,b]``: print the report. Exit status 0 without an
    ``error`` finding, 1 with one or when the run cannot be read (the message names the path)."""
    p = argparse.ArgumentParser(
        prog="mmalign doctor",
        description="Diagnose a training run from its metrics.jsonl: why is the reward flat?",
    )
    p.add_argument("run_dir", help="the run's output_dir (holds metrics.jsonl and config.yaml)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument("--checks", help=f"comma-separated checks to run (default all: {','.join(CHECKS)})")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    checks = None
    if args.checks:
        checks = [c.strip() for c in args.checks.split(",") if c.strip()]
        unknown = [c for c in checks if c not in CHECKS]
        if unknown:
            p.error(f"unknown check(s): {', '.join(unknown)} (known: {', '.join(CHECKS)})")
    try:
        findings = diagnose(args.run_dir, checks)
    except (OSError, ValueError) as e:
        print(f"mmalign doctor: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        n_steps = len(load_run(args.run_dir)[0])
        doc = {
            "run_dir": str(args.run_dir),
            "logged_steps": n_steps,
            "summary": summary(findings),
            "findings": [f.to_dict() for f in findings],
        }
        print(json.dumps(doc, indent=2, allow_nan=False))
    else:
        print(format_report(findings, title=f"mmalign doctor: {args.run_dir}"))
    return 1 if any(f.level == "error" for f in findings) else 0


# ----------------------------------------------------------------------------- live, in the trainer


class LiveDoctor:
    """The checks, run on every step's metrics during training; warnings go to the ``mmalign.app.doctor`` logger.

    It keeps the first `LIVE_HEAD` and the last `LIVE_WINDOW` steps' metrics and runs `checks` on them after
    each `observe` (from the `LIVE_MIN_STEPS`-th step on; `LIVE_IMMEDIATE` ones from the first). It logs the
    ``warn`` / ``error`` findings that involve the current step, at most once per `every` steps per check
    (a check that warned is not run again before that). `observe` never raises (a failure is logged at
    debug level)."""

    def __init__(
        self,
        config: dict[str, Any] | None = None,
        *,
        checks: Sequence[str] | None = None,
        every: int = LIVE_WARN_EVERY,
        window: int = LIVE_WINDOW,
        head: int = LIVE_HEAD,
        logger: logging.Logger | None = None,
    ) -> None:
        self.config = config
        self.checks = [c for c in CHECKS if c not in LIVE_SKIP] if checks is None else list(checks)
        self.every = every
        self.window = window
        self.head = head
        self.log = logger or log
        self._head: list[dict[str, Any]] = []
        self._recent: list[dict[str, Any]] = []
        self._last_warned: dict[str, int] = {}
        self._count = 0

    def observe(self, metrics: dict[str, Any]) -> list[Finding]:
        """Add one step's metrics; return (and log) the findings warned about now."""
        try:
            return self._observe(metrics)
        except Exception as e:  # never into training
            self.log.debug("doctor: live check failed: %s: %s", type(e).__name__, e)
            return []

    def _observe(self, metrics: dict[str, Any]) -> list[Finding]:
        row = dict(metrics)
        self._count += 1
        step = _step_of(row, self._count - 1)
        row["step"] = step
        if len(self._head) < self.head:
            self._head.append(row)
        else:
            self._recent.append(row)
            del self._recent[: max(0, len(self._recent) - self.window)]
        rows = self._head + self._recent
        emitted: list[Finding] = []
        for name in self.checks:
            if self._count < LIVE_MIN_STEPS and name not in LIVE_IMMEDIATE:
                continue
            last = self._last_warned.get(name)
            if last is not None and step - last < self.every:
                continue
            try:
                found = CHECKS[name](rows, self.config)
            except Exception as e:
                self.log.debug("doctor: check %s failed: %s: %s", name, type(e).__name__, e)
                continue
            now = [f for f in found if f.level in ("warn", "error") and step in f.steps]
            for f in now:
                self.log.warning("step %d: [doctor/%s] %s. %s", step, f.check, f.message, f.advice)
            if now:
                self._last_warned[name] = step
                emitted.extend(now)
        return emitted


class DoctorMonitor:
    """`LiveDoctor` as a `GroupTrainer` monitor (`mmalign.training.callbacks.TrainerCallback`): every `GroupTrainer.train`
    call starts a fresh doctor on the main process (the run's resolved config), which observes every step's
    metrics. Never raises into training."""

    def __init__(self) -> None:
        self.doctor: LiveDoctor | None = None

    def on_train_start(self, trainer: Any, step: int) -> None:
        self.doctor = LiveDoctor(trainer.cfg.to_dict()) if trainer.is_main else None

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if self.doctor is not None:
            self.doctor.observe(metrics)
