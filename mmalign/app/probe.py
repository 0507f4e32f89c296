"""`mmalign probe CONFIG`: what the base model's rewards look like before any training.

Output: a markdown report on stdout and, with ``--json PATH``, the same numbers as JSON.

Details: docs/probe.md, "mmalign.app.probe".
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from itertools import groupby
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from mmalign.config import Config, ConfigError
from mmalign.training.seeding import seed_policy

__all__ = [
    "DEFAULT_GROUP_SIZES",
    "add_parser",
    "box_convention_scores",
    "distribution",
    "histogram",
    "load_setup",
    "main",
    "probe",
    "recommend",
    "render",
    "zero_spread_share",
    "zero_spread_table",
]

DEFAULT_GROUP_SIZES = (4, 8, 16, 32)
"""The group sizes whose zero-spread share is reported (plus the config's ``rollout.group_size``)."""

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
PARSE_METRICS = {"unparsed_frac": True, "malformed_frac": True, "empty_frac": True}
"""`Reward.last_metrics` keys that measure parse failures (the parse rate is 1 minus them)."""
FORMATS = ("xyxy", "xywh")


# ============================================================================ building
def load_setup(
    config: str,
    overrides: Sequence[str],
    *,
    need_rewards: bool,
    command: str,
    progress: Callable[[str], None] | None = None,
) -> tuple[Config, Any]:
    """The checked config (`mmalign.config.load_config`, `mmalign.app.preflight.validate`) and the components its
    pipeline builds, the global RNGs seeded with ``seed`` first. `need_rewards`: a config without ``rewards`` is a
    `ConfigError` naming `command`. `progress` gets a line before and after the build (model, data, rewards)."""
    import pipelines
    from mmalign.app.preflight import validate
    from mmalign.config import load_config
    from mmalign.training.seeding import set_seed

    cfg = load_config(config, list(overrides), pipeline_finder=pipelines.find)
    if need_rewards and not cfg.rewards:
        raise ConfigError(
            f"{cfg.source}: key 'rewards': empty; `mmalign {command}` scores samples with the rewards"
        )
    build = validate(cfg, resume=None)
    set_seed(cfg.seed)
    say = progress or (lambda line: None)
    say(f"building the {cfg.pipeline} pipeline of {cfg.source} (model, data, rewards) ...")
    t0 = time.perf_counter()
    components = build(cfg)
    say(f"built in {time.perf_counter() - t0:.1f} s")
    return cfg, components


def pick_rows(rows: Sequence[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """`n` rows drawn without replacement with `seed` (all of them, in order, when there are at most `n`)."""
    if n < 1:
        raise ConfigError(f"the number of prompts must be >= 1, got {n}")
    if not rows:
        raise ConfigError("the pipeline built no training rows")
    if len(rows) <= n:
        return list(rows)
    idx = sorted(random.Random(seed).sample(range(len(rows)), n))
    return [rows[i] for i in idx]


# ============================================================================ statistics
def _finite(values: Tensor) -> Tensor:
    v = values.detach().double().flatten().cpu()
    return v[~torch.isnan(v)]


def histogram(values: Tensor, bins: int = 10, width: int = 30) -> list[str]:
    """Text bars of the non-NaN `values`: one line per distinct value when there are at most `bins` of them, else
    `bins` equal-width bins over [min, max] (the last bin closed)."""
    v = _finite(values)
    if not v.numel():
        return ["(no values)"]
    distinct = sorted(set(v.tolist()))
    if len(distinct) <= bins:
        labels = [f"{x:.4g}" for x in distinct]
        counts = [int((v == x).sum()) for x in distinct]
    else:
        lo, hi = float(v.min()), float(v.max())
        edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
        idx = torch.clamp(torch.bucketize(v, edges[1:-1], right=True), max=bins - 1)
        counts = [int((idx == b).sum()) for b in range(bins)]
        labels = [
            f"[{float(edges[b]):.3g}, {float(edges[b + 1]):.3g}{']' if b == bins - 1 else ')'}"
            for b in range(bins)
        ]
    top = max(counts)
    pad = max(len(s) for s in labels)
    return [
        f"{lab:>{pad}} {'#' * (round(width * c / top) if top else 0):<{width}} {c}"
        for lab, c in zip(labels, counts, strict=True)
    ]


def distribution(values: Tensor) -> dict[str, Any]:
    """Mean, std (population), min, quantiles 10/25/50/75/90 %, max of the non-NaN `values`, their count and the
    NaN rate."""
    flat = values.detach().double().flatten().cpu()
    v = _finite(flat)
    out: dict[str, Any] = {"count": int(v.numel()), "nan_rate": float(1 - v.numel() / max(1, flat.numel()))}
    if not v.numel():
        return out | {
            k: math.nan for k in ("mean", "std", "min", "max", *(f"q{int(q * 100)}" for q in QUANTILES))
        }
    out.update(mean=float(v.mean()), std=float(v.std(unbiased=False)), min=float(v.min()), max=float(v.max()))
    for q in QUANTILES:
        out[f"q{int(q * 100)}"] = float(torch.quantile(v, q))
    return out


def _key(x: float, ndigits: int) -> float | None:
    return None if math.isnan(x) else round(x, ndigits)


def zero_spread_share(values: Sequence[float], g: int, ndigits: int = 6) -> float:
    """The probability that `g` samples drawn without replacement from `values` (one prompt's rewards) have zero
    spread: all their non-NaN values equal (rounded to `ndigits`), fewer than two non-NaN values counting as zero
    spread, as the group filters count them (`mmalign.algorithms.filters`). Exact over all C(N, g) subsets: with m NaNs and
    n_v samples of value v, (C(m, g) + sum_v [C(n_v + m, g) - C(m, g)]) / C(N, g)."""
    n = len(values)
    if not 1 <= g <= n:
        raise ValueError(f"group size {g} must be in 1..{n} (the samples drawn for the prompt)")
    keys = [_key(float(x), ndigits) for x in values]
    m = sum(k is None for k in keys)
    counts: dict[float, int] = {}
    for k in keys:
        if k is not None:
            counts[k] = counts.get(k, 0) + 1
    flat = math.comb(m, g) + sum(math.comb(c + m, g) - math.comb(m, g) for c in counts.values())
    return flat / math.comb(n, g)


def _by_group(values: Tensor, group: Tensor) -> list[list[float]]:
    order = sorted(range(len(group)), key=lambda i: int(group[i]))
    return [[float(values[i]) for i in idx] for _, idx in groupby(order, key=lambda i: int(group[i]))]


def zero_spread_table(values: Tensor, group: Tensor, sizes: Sequence[int]) -> dict[int, float]:
    """``{G: mean over prompts of zero_spread_share(prompt's values, G)}`` for every G in `sizes`."""
    groups = _by_group(values, group)
    return {g: sum(zero_spread_share(v, g) for v in groups) / len(groups) for g in sizes}


# ============================================================================ parse rates
def parse_rates(reward_set: Any, texts: list[str] | None) -> dict[str, float | None]:
    """Per reward column the share of samples whose answer could be parsed, or None when the reward does not say:
    1 minus what it reported in `Reward.last_metrics` (`PARSE_METRICS`), else for a reward with ``extract`` /
    ``tag`` options (``answer_accuracy``) the share of `texts` with an extractable answer. Call right after
    scoring (``last_metrics`` hold the last call)."""
    from rewards.text import extract_answer

    out: dict[str, float | None] = {}
    metrics = getattr(reward_set, "last_metrics", {}) or {}
    for spec, reward in zip(reward_set.specs, reward_set.rewards, strict=True):
        col = spec.column
        rate = None
        for key in PARSE_METRICS:
            value = metrics.get(f"reward/{col}/{key}")
            if value is not None:
                rate = 1.0 - float(value) if rate is None else min(rate, 1.0 - float(value))
        extract = getattr(reward, "extract", None)
        if rate is None and texts and isinstance(extract, str) and extract != "none":
            tag = getattr(reward, "tag", "answer")
            rate = sum(extract_answer(t, extract, tag) is not None for t in texts) / len(texts)
        out[col] = rate
    return out


def unparsed_examples(reward: Any, texts: list[str], limit: int = 3) -> list[str]:
    """Up to `limit` distinct completions whose answer `reward` cannot read: no box (`rewards.boxes.parse_box`)
    for a box reward reading the text, no extractable answer for a reward with an ``extract`` option."""
    from rewards.boxes import parse_box
    from rewards.text import extract_answer

    extract = getattr(reward, "extract", None)
    if hasattr(reward, "box_column") and hasattr(reward, "coords") and not getattr(reward, "box_key", None):
        bad = [t for t in texts if parse_box(t, getattr(reward, "tag", "answer")) is None]
    elif isinstance(extract, str) and extract != "none":
        bad = [t for t in texts if extract_answer(t, extract, getattr(reward, "tag", "answer")) is None]
    else:
        return []
    return list(dict.fromkeys(t[:160] for t in bad))[:limit]


# ============================================================================ box conventions
_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_FOUR = re.compile(rf"[\[(]\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*[\])]")


def raw_box(text: Any, tag: str = "answer") -> tuple[float, float, float, float] | None:
    """The last four numbers written as ``[a, b, c, d]`` / ``(a, b, c, d)`` (also inside JSON) in the answer
    (the last ``<tag>...</tag>``, else the whole text), as written: not reordered, so an xywh box keeps its
    width and height. None if there is none."""
    from rewards.text import extract_tag

    if not isinstance(text, str):
        return None
    region = extract_tag(text, tag) if tag else None
    for part in (region, text):
        if part is None:
            continue
        found = _FOUR.findall(part)
        if found:
            return tuple(float(x) for x in found[-1])  # type: ignore[return-value]
    return None


def _reference_boxes(ref: Any) -> list[tuple[float, float, float, float]]:
    from rewards.boxes import order_box, parse_boxes

    if ref is None:
        return []
    if hasattr(ref, "tolist"):
        ref = ref.tolist()
    if isinstance(ref, str):
        return parse_boxes(ref)
    if isinstance(ref, dict):
        ref = ref.get("bbox_2d", ref.get("bbox", ref.get("box")))
    if isinstance(ref, list | tuple) and ref and all(isinstance(v, list | tuple) for v in ref):
        return [b for v in ref if (b := order_box(v)) is not None]
    b = order_box(ref) if isinstance(ref, list | tuple) else None
    return [] if b is None else [b]


def box_convention_scores(
    texts: Sequence[str],
    references: Sequence[Any],
    original_sizes: Sequence[tuple[float, float] | None],
    resized_sizes: Sequence[tuple[float, float] | None] | None = None,
    *,
    tag: str = "answer",
    hit: float = 0.5,
) -> list[dict[str, Any]]:
    """Re-score every answer under each coordinate convention of `rewards.boxes.CONVENTIONS` (absolute = original
    pixels, resized = pixels of the model's resized input, norm1000 = 0-1000, norm1 = 0-1) and each format (xyxy
    corners, xywh corner + size). Per (convention, format): ``mean_iou`` (the best IoU with a reference, unparsed
    answers 0, samples without a reference left out), ``hit_rate`` (IoU >= `hit`), ``parsed`` (share of answers
    read), ``scored`` (samples with a reference) and ``ious`` (per sample, NaN without a reference), or ``missing`` (why it cannot be scored: no size given).
    Sorted by mean IoU, best first."""
    from rewards.boxes import CONVENTIONS, best_iou, order_box, parse_box, to_absolute

    n = len(texts)
    resized_sizes = resized_sizes if resized_sizes is not None else [None] * n
    refs = [_reference_boxes(r) for r in references]
    raws = [raw_box(t, tag) for t in texts]
    corners = [parse_box(t, tag) for t in texts]
    rows: list[dict[str, Any]] = []
    for conv in CONVENTIONS:
        for fmt in FORMATS:
            ious: list[float] = []
            per_sample = [math.nan] * n
            parsed = 0
            missing = None
            for i in range(n):
                if not refs[i]:
                    continue
                box = raws[i] if fmt == "xywh" else (raws[i] or corners[i])
                if box is not None and fmt == "xywh":
                    x, y, w, h = box
                    box = (x, y, x + w, y + h)
                orig, res = original_sizes[i], resized_sizes[i]
                if conv != "absolute" and orig is None:
                    missing = "no original image size"
                    break
                if conv == "resized" and res is None:
                    missing = "no resized image size"
                    break
                if box is None:
                    ious.append(0.0)
                    per_sample[i] = 0.0
                    continue
                parsed += 1
                ordered = order_box(to_absolute(box, conv, orig, res))
                ious.append(best_iou(ordered, refs[i]) if ordered is not None else 0.0)
                per_sample[i] = ious[-1]
            row: dict[str, Any] = {"convention": conv, "format": fmt}
            if missing is not None:
                row["missing"] = missing
            else:
                k = len(ious)
                row.update(
                    mean_iou=sum(ious) / k if k else math.nan,
                    hit_rate=sum(v >= hit for v in ious) / k if k else math.nan,
                    parsed=parsed / k if k else math.nan,
                    scored=k,
                    ious=per_sample,
                )
            rows.append(row)
    rows.sort(key=lambda r: -r["mean_iou"] if "mean_iou" in r and not math.isnan(r["mean_iou"]) else math.inf)
    return rows


def _size_column(columns: dict[str, list[Any]], w: str, h: str, n: int) -> list[tuple[float, float] | None]:
    from rewards.text import parse_number

    if w not in columns or h not in columns:
        return [None] * n
    out: list[tuple[float, float] | None] = []
    for a, b in zip(columns[w], columns[h], strict=True):
        pa, pb = parse_number(a), parse_number(b)
        out.append((pa, pb) if pa and pb and pa > 0 and pb > 0 else None)
    return out


def box_rewards(reward_set: Any) -> list[tuple[str, Any]]:
    """The (column, reward) pairs of `reward_set` that score boxes parsed from the text (they have ``coords`` and
    ``box_column`` options, as the rewards of `rewards.boxes` do)."""
    return [
        (spec.column, r)
        for spec, r in zip(reward_set.specs, reward_set.rewards, strict=True)
        if hasattr(r, "coords") and hasattr(r, "box_column")
    ]


def box_check(reward_set: Any, rollout: Any) -> list[dict[str, Any]]:
    """`box_convention_scores` for each distinct box setup (reference column, size columns, tag) of the config's
    box rewards, with the configured convention and whether the best one matches it."""
    out = []
    seen: set[tuple[Any, ...]] = set()
    texts = list(rollout.outputs.get("texts") or [])
    n = len(texts)
    for col, r in box_rewards(reward_set):
        setup = (
            r.box_column,
            r.width_column,
            r.height_column,
            r.resized_width_column,
            r.resized_height_column,
            r.tag,
        )
        if setup in seen:
            continue
        seen.add(setup)
        entry: dict[str, Any] = {"reward": col, "configured": r.coords, "box_column": r.box_column}
        if getattr(r, "box_key", None):
            entry["skipped"] = (
                f"box_key={r.box_key!r}: the environment maps the answers to original pixels (multi-turn), the text "
                "boxes are in each view's pixels"
            )
            out.append(entry)
            continue
        columns = rollout.columns
        ref_col = r.box_column if r.box_column in columns else ("box" if "box" in columns else None)
        if ref_col is None or not n:
            entry["skipped"] = f"no reference column {r.box_column!r} or no texts"
            out.append(entry)
            continue
        rows = box_convention_scores(
            texts,
            columns[ref_col],
            _size_column(columns, r.width_column, r.height_column, n),
            _size_column(columns, r.resized_width_column, r.resized_height_column, n),
            tag=r.tag,
        )
        best = rows[0]
        entry["conventions"] = rows
        entry["best"] = f"{best['convention']}/{best['format']}"
        entry["matches_config"] = best["convention"] == r.coords and best["format"] == "xyxy"
        out.append(entry)
    return out


# ============================================================================ recommendation
def _threshold_advice(reward_set: Any, rollout: Any, checks: list[dict[str, Any]], g: int) -> list[str]:
    """For a thresholded box reward (a ``threshold`` option): the IoU threshold whose 1/0 hits leave the most
    informative groups at the config's group size, and the one with a 50 % hit rate."""
    lines = []
    for col, r in box_rewards(reward_set):
        thr = getattr(r, "threshold", None)
        if not isinstance(thr, int | float) or getattr(r, "box_key", None):
            continue
        check = next((c for c in checks if "conventions" in c and c["box_column"] == r.box_column), None)
        if check is None:
            continue
        row = next(
            (
                x
                for x in check["conventions"]
                if x["convention"] == r.coords and x["format"] == "xyxy" and "ious" in x
            ),
            None,
        )
        if row is None or not row["ious"]:
            continue
        ious = torch.tensor(row["ious"], dtype=torch.float64)
        if not _finite(ious).numel():
            continue
        group = rollout.group.cpu()
        best_t, best_inf = None, -1.0
        for t in [round(0.05 * k, 2) for k in range(1, 20)]:
            hits = (ious >= t).double().masked_fill(torch.isnan(ious), math.nan)
            gg = min(g, min(len(v) for v in _by_group(hits, group)))
            inf = 1.0 - zero_spread_table(hits, group, [gg])[gg]
            if inf > best_inf + 1e-12:
                best_t, best_inf = t, inf
        median = float(torch.quantile(_finite(ious), 0.5))
        lines.append(
            f"curriculum start for `{col}` (threshold {thr:g}): IoU threshold {best_t:g} leaves the most informative "
            f"groups at G={g} ({best_inf:.0%}); a 50 % hit rate is at IoU {median:.2f}"
        )
    return lines


def recommend(
    zero: dict[int, float],
    group_size: int,
    *,
    informative: float = 0.5,
    mean_total: float = math.nan,
    solved: float = 0.0,
    unsolved: float = 0.0,
) -> list[str]:
    """Advice from the zero-spread shares of the total reward (`zero`: ``{G: share}``) at the config's
    `group_size`: the smallest G whose informative share (1 - zero spread) reaches `informative`; a group filter
    when more than 10 % of the groups are flat at `group_size` (``dynamic_sampling`` with enough rounds to expect
    a full batch: ceil(1 / informative share), at most 8); a curriculum when many prompts are always solved
    (`solved`: share of prompts whose every sample has the best total) or never (`unsolved`)."""
    lines = []
    ok = [g for g in sorted(zero) if 1 - zero[g] >= informative]
    cur = 1 - zero.get(group_size, math.nan)
    if ok:
        pick = ok[0]
        verdict = "keep it" if pick <= group_size else f"raise rollout.group_size to {pick}"
        lines.append(
            f"group size: {pick} is the smallest with >= {informative:.0%} informative groups "
            f"({1 - zero[pick]:.0%}); the config uses {group_size} ({cur:.0%} informative): {verdict}"
        )
    else:
        g_max = max(zero)
        lines.append(
            f"group size: no size up to {g_max} reaches {informative:.0%} informative groups (at {g_max}: "
            f"{1 - zero[g_max]:.0%}); a larger group helps little, change the task's difficulty (curriculum) or the reward"
        )
    flat = zero.get(group_size, 0.0)
    if flat > 0.1:
        rounds = min(8, math.ceil(1 / max(1 - flat, 1e-9)))
        lines.append(
            f"filter: {flat:.0%} of the groups are flat at G={group_size}: `algorithm.filter: dynamic_sampling` "
            f"(filter_kwargs.max_rounds: {rounds}) keeps only informative groups, or `replay` reuses earlier ones"
        )
    else:
        lines.append(f"filter: {flat:.0%} of the groups are flat at G={group_size}; no filter needed")
    if unsolved >= 0.3:
        lines.append(
            f"curriculum: {unsolved:.0%} of the prompts are never solved (mean total {mean_total:.3g}); start with "
            "easier prompts or `data.sampler: vade` (prompts with success rates between 0 and 1 first)"
        )
    elif solved >= 0.3:
        lines.append(
            f"curriculum: {solved:.0%} of the prompts are always solved (mean total {mean_total:.3g}); harder prompts "
            "or a stricter reward, or `data.sampler: vade`"
        )
    else:
        lines.append(
            f"curriculum: {solved:.0%} always solved, {unsolved:.0%} never solved: no curriculum needed"
        )
    return lines


# ============================================================================ the probe
def _joined(parts: list[Any]) -> SimpleNamespace:
    """What the report reads of the rollouts of all calls, joined: ``group``, ``columns``, ``outputs["texts"]``
    (no `Rollout.cat`: the payloads, latents and pixels are not needed and need not concatenate)."""
    columns: dict[str, list[Any]] = {}
    keys = set().union(*(p.columns for p in parts))
    for key in keys:
        columns[key] = [v for p in parts for v in p.columns.get(key, [None] * len(p))]
    texts = [t for p in parts for t in (p.outputs.get("texts") or [])]
    outputs = {"texts": texts} if len(texts) == sum(len(p) for p in parts) else {}
    group = torch.cat([p.group.cpu() for p in parts])
    return SimpleNamespace(group=group, columns=columns, outputs=outputs)


def probe(
    cfg: Config,
    components: Any,
    *,
    prompts: int = 8,
    group_sizes: Sequence[int] = DEFAULT_GROUP_SIZES,
    seed: int | None = None,
    informative: float = 0.5,
) -> dict[str, Any]:
    """Sample the base policy of `components` on `prompts` training rows, N = max(`group_sizes`, group size)
    samples each (training sampler), score with the config's rewards and return the report (module docstring)."""
    from mmalign.algorithms.advantages import combine_rewards

    policy, rset = components.policy, components.rewards
    if rset is None or not len(rset):
        raise ConfigError(f"{cfg.source}: key 'rewards': the pipeline built no rewards to probe")
    g_cfg = int(cfg.rollout.group_size)
    sizes = sorted({int(g) for g in group_sizes} | {g_cfg})
    if sizes[0] < 2:
        raise ConfigError(f"group sizes must be >= 2, got {sizes}")
    n = sizes[-1]
    seed = cfg.seed if seed is None else seed
    rows = pick_rows(components.data, prompts, seed)
    per_call = max(1, (cfg.rollout.prompts_per_step * g_cfg) // n)
    t0 = time.perf_counter()
    parts = []
    for c, start in enumerate(range(0, len(rows), per_call)):
        seed_policy(policy, seed + 1_000_003 * c)
        with torch.no_grad():
            part = policy.rollout(rows[start : start + per_call], n, compute_logp=False)
            part.group = part.group + start
            policy.materialize(part, rset.needs)
        parts.append(part)
    t1 = time.perf_counter()
    rollout = _joined(parts)
    scores, metrics = [], {}
    quiet = logging.getLogger("rewards")
    level = quiet.level
    # the report gives the parse rates and examples instead of a warning per call
    quiet.setLevel(logging.ERROR)
    try:
        for part in parts:  # scored per part: the parse metrics of each call are combined by sample count
            scores.append(rset(part).float().cpu())
            texts = list(part.outputs.get("texts") or [])
            for col, rate in parse_rates(rset, texts).items():
                metrics.setdefault(col, []).append((rate, len(part)))
    finally:
        quiet.setLevel(level)
    table = torch.cat(scores)
    t2 = time.perf_counter()
    total = combine_rewards(table, rset.weights)
    group = rollout.group.cpu()
    report: dict[str, Any] = {
        "config": cfg.source,
        "pipeline": cfg.pipeline,
        "prompts": len(rows),
        "samples_per_prompt": n,
        "config_group_size": g_cfg,
        "group_sizes": sizes,
        "seed": seed,
        "seconds": {"sampling": round(t1 - t0, 2), "scoring": round(t2 - t1, 2)},
        "rewards": {},
    }
    for k, name in enumerate(rset.names):
        d = distribution(table[:, k])
        entries = metrics.get(name, [])
        known = [(r, c) for r, c in entries if r is not None]
        d["parse_rate"] = sum(r * c for r, c in known) / sum(c for _, c in known) if known else None
        d["weight"] = float(rset.weights[k])
        d["unparsed_examples"] = unparsed_examples(rset.rewards[k], list(rollout.outputs.get("texts") or []))
        d["histogram"] = histogram(table[:, k])
        d["zero_spread"] = zero_spread_table(table[:, k], group, sizes)
        report["rewards"][name] = d
    tot = distribution(total)
    tot["histogram"] = histogram(total)
    tot["zero_spread"] = zero_spread_table(total, group, sizes)
    report["total"] = tot
    per_prompt = _by_group(total, group)
    best = float(_finite(total).max()) if _finite(total).numel() else math.nan
    solved = sum(all(not math.isnan(x) and x >= best - 1e-6 for x in v) for v in per_prompt) / len(per_prompt)
    worst = float(_finite(total).min()) if _finite(total).numel() else math.nan
    unsolved = sum(all(math.isnan(x) or x <= worst + 1e-6 for x in v) for v in per_prompt) / len(per_prompt)
    if best == worst:  # every sample scored the same: neither solved nor unsolved says anything
        solved, unsolved = 0.0, 1.0
    report["prompt_success"] = {"always_best": solved, "always_worst": unsolved}
    checks = box_check(rset, rollout)
    if checks:
        report["box_conventions"] = checks
    advice = recommend(
        tot["zero_spread"],
        g_cfg,
        informative=informative,
        mean_total=tot["mean"],
        solved=solved,
        unsolved=unsolved,
    )
    advice += _threshold_advice(rset, rollout, checks, g_cfg)
    for c in checks:
        if "best" in c and not c["matches_config"]:
            advice.append(
                f"box coordinates: the answers of `{c['reward']}` match {c['best']} best, the config reads them as "
                f"{c['configured']}/xyxy: check the rewards' `coords` option"
            )
    report["recommendations"] = advice
    report["informative_threshold"] = informative
    return report


# ============================================================================ rendering
def _f(x: Any, spec: str = ".3f") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float) and math.isnan(x):
        return "NaN"
    return format(x, spec)


def render(report: dict[str, Any]) -> str:
    """The markdown report of `probe`."""
    sizes = report["group_sizes"]
    g_cfg = report["config_group_size"]
    lines = [
        f"# mmalign probe: {report['config']}",
        "",
        f"Base model, {report['prompts']} training prompts x {report['samples_per_prompt']} samples (training sampler, "
        f"seed {report['seed']}); config group size {g_cfg}. Sampling {report['seconds']['sampling']:.1f} s, "
        f"scoring {report['seconds']['scoring']:.1f} s.",
        "",
        "## Rewards",
        "",
        "| reward | weight | mean | std | min | q10 | q25 | median | q75 | q90 | max | parsed | NaN |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    entries = [*report["rewards"].items(), ("total (weighted)", report["total"])]
    for name, d in entries:
        cells = [_f(d.get(k)) for k in ("mean", "std", "min", "q10", "q25", "q50", "q75", "q90", "max")]
        weight = _f(d.get("weight"), "g") if "weight" in d else ""
        parsed = _f(d.get("parse_rate"), ".0%") if "weight" in d else ""
        lines.append(
            f"| {name} | {weight} | " + " | ".join(cells) + f" | {parsed} | {_f(d['nan_rate'], '.0%')} |"
        )
    for name, d in report["rewards"].items():
        if d.get("unparsed_examples"):
            lines.append("")
            lines.append(
                f"Unparsed answers of `{name}`, e.g.: " + "; ".join(repr(t) for t in d["unparsed_examples"])
            )
    lines += ["", "Histograms (value or bin, bar, count):", ""]
    for name, d in entries:
        lines += [f"{name}:", "```", *d["histogram"], "```"]
    lines += [
        "",
        "## Zero reward spread",
        "",
        f"Share of groups whose rewards are all equal (no advantage, no gradient). From the {report['samples_per_prompt']} "
        "samples per prompt: at a smaller G, the probability that G of them drawn without replacement are all equal "
        "(exact over all subsets), averaged over the prompts.",
        "",
        "| score | " + " | ".join(f"G={g}{' (config)' if g == g_cfg else ''}" for g in sizes) + " |",
        "|---|" + "---:|" * len(sizes),
    ]
    for name, d in entries:
        lines.append(f"| {name} | " + " | ".join(_f(d["zero_spread"][g], ".0%") for g in sizes) + " |")
    ps = report["prompt_success"]
    lines += [
        "",
        f"Prompts whose every sample has the best total: {ps['always_best']:.0%}; the worst total: "
        f"{ps['always_worst']:.0%}.",
    ]
    for check in report.get("box_conventions", []):
        lines += [
            "",
            f"## Box coordinate conventions (`{check['reward']}`, configured coords: {check['configured']})",
            "",
        ]
        if "skipped" in check:
            lines.append(f"skipped: {check['skipped']}")
            continue
        lines += [
            "absolute = original image pixels, resized = pixels of the resized model input, norm1000 = 0-1000 "
            "(Qwen2-VL), norm1 = 0-1; xyxy = corners, xywh = corner + width, height.",
            "",
            "| convention | format | mean IoU | IoU >= 0.5 | parsed | samples |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for row in check["conventions"]:
            mark = (
                " (configured)"
                if row["convention"] == check["configured"] and row["format"] == "xyxy"
                else ""
            )
            if "missing" in row:
                lines.append(f"| {row['convention']}{mark} | {row['format']} | {row['missing']} | | | |")
                continue
            lines.append(
                f"| {row['convention']}{mark} | {row['format']} | {_f(row['mean_iou'])} | {_f(row['hit_rate'], '.0%')} "
                f"| {_f(row['parsed'], '.0%')} | {row['scored']} |"
            )
        lines += [
            "",
            f"Best match: {check['best']}{'' if check['matches_config'] else ' (not the configured one)'}.",
        ]
    lines += ["", f"## Recommendation (informative share wanted: {report['informative_threshold']:.0%})", ""]
    lines += [f"- {a}" for a in report["recommendations"]]
    return "\n".join(lines) + "\n"


def jsonable(report: dict[str, Any]) -> Any:
    """`report` with NaN as null, int dict keys as strings and the per-sample IoU lists dropped."""

    def conv(x: Any) -> Any:
        if isinstance(x, float):
            return None if math.isnan(x) or math.isinf(x) else x
        if isinstance(x, dict):
            return {str(k): conv(v) for k, v in x.items() if k != "ious"}
        if isinstance(x, list | tuple):
            return [conv(v) for v in x]
        return x

    return conv(report)


# ============================================================================ command line
def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``probe`` to the ``mmalign`` subcommands (`mmalign.app.cli.build_parser`)."""
    p = subparsers.add_parser(
        "probe",
        help="sample the base model and report its reward distribution, flat groups per group size, box conventions",
    )
    p.add_argument("config", help="path to a YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.temperature=0.8")
    p.add_argument("-n", "--prompts", type=int, default=8, help="training prompts to sample (default 8)")
    p.add_argument(
        "--group-sizes",
        type=_int_list,
        default=list(DEFAULT_GROUP_SIZES),
        help="group sizes to report, comma-separated (default 4,8,16,32; the config's is added)",
    )
    p.add_argument(
        "--informative",
        type=float,
        default=0.5,
        help="share of informative groups the recommended group size must reach (default 0.5)",
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the config's seed)")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    """``mmalign probe``: print the markdown report (and write the JSON one with ``--json``)."""
    if not 0 < args.informative <= 1:
        raise ConfigError(f"--informative must be in (0, 1], got {args.informative}")
    cfg, components = load_setup(
        args.config,
        args.overrides,
        need_rewards=True,
        command="probe",
        progress=lambda line: print(f"mmalign probe: {line}", file=sys.stderr, flush=True),
    )
    report = probe(
        cfg,
        components,
        prompts=args.prompts,
        group_sizes=args.group_sizes,
        seed=args.seed,
        informative=args.informative,
    )
    emit_report(render(report), report, args.json)
    return 0


def emit_report(text: str, report: dict[str, Any], json_path: str | None) -> None:
    """Print a command's markdown report; with ``--json PATH`` also write the report as JSON there."""
    sys.stdout.write(text)
    if json_path:
        out = Path(json_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(jsonable(report), indent=2) + "\n")
        print(f"report: {out}")
