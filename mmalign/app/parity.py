"""`mmalign parity CONFIG`: does the first update of a run see ratio = 1, and which settings break it?

It draws one rollout from the base model (``compute_logp=True``) and re-scores it as the trainer's update does
(`mmalign.algorithms.composition.LossComposer`: train mode, microbatches, action chunks, grad enabled) under
each setting: the run's own, other micro-batch sizes, fp32 / bf16 / fp16 autocast, eval mode, actions in one
piece, and an engine's log-probs against the trainer's. Per setting it reports the log-ratio error (max, mean,
per action index), the ratio statistics and whether ratio = 1 holds within ``--tol``. Settings, output and
exit status: docs/probe.md, "`mmalign parity`".
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmalign.config import Config, ConfigError

__all__ = [
    "PRECISIONS",
    "Setting",
    "add_parser",
    "compare",
    "main",
    "parity",
    "render",
    "score_rollout",
]

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Precision name -> the autocast dtype (None: no autocast, the model's own dtype)."""
MIXED = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
"""``trainer.mixed_precision`` -> precision name."""


@dataclass(frozen=True)
class Setting:
    """One way of re-scoring the rollout."""

    name: str
    microbatch: int
    precision: str = "fp32"
    train_mode: bool = True
    chunked: bool = True


@contextlib.contextmanager
def _precision(name: str, device: torch.device) -> Iterator[None]:
    dtype = PRECISIONS[name]
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def _device(policy: Any) -> torch.device:
    dev = getattr(policy, "device", None)
    if isinstance(dev, torch.device):
        return dev
    return next(policy.model.parameters()).device


def score_rollout(policy: Any, rollout: Any, setting: Setting, *, chunkable: bool = True) -> Tensor | None:
    """Float[B, T] log-probs of `rollout`'s actions re-scored as the trainer's update scores them under `setting`:
    microbatches of ``setting.microbatch`` samples (``rollout[idx]``), each through ``policy.action_stats`` -- per
    chunk of `Policy.action_chunks` when ``setting.chunked`` and `chunkable` (the loss does not couple a sample's
    actions) -- with grad enabled, the model in train (or eval) mode, under the precision's autocast. None when
    the policy returns no log-probs (its own loss)."""
    model = policy.model
    was_training = bool(model.training)
    model.train(setting.train_mode)
    dev = _device(policy)
    b, t = rollout.mask.shape
    out = torch.zeros(b, t, dtype=torch.float64)
    try:
        for start in range(0, b, setting.microbatch):
            idx = list(range(start, min(start + setting.microbatch, b)))
            mu = rollout[idx]
            chunks = policy.action_chunks(mu) if setting.chunked and chunkable else None
            with torch.enable_grad(), _precision(setting.precision, dev):
                if not chunks or len(chunks) == 1:
                    logp = policy.action_stats(mu).logp
                    if logp is None:
                        return None
                    out[start : start + len(idx), : logp.shape[1]] = logp.detach().double().cpu()
                    continue
                for cols in chunks:
                    logp = policy.action_stats(mu, actions=cols).logp
                    if logp is None:
                        return None
                    out[start : start + len(idx), cols.cpu()] = logp.detach().double().cpu()
    finally:
        model.train(was_training)
    return out


def compare(
    logp: Tensor, logp_old: Tensor, mask: Tensor, *, tol: float, eps_low: float = 0.2, eps_high: float = 0.2
) -> dict[str, Any]:
    """The log-ratio error ``d = logp - logp_old`` on the valid actions (`mask`): ``max_abs``, ``mean_abs``,
    ``per_action`` (max |d| per action index; NaN where no sample has a valid action), ``breaking`` (the action
    indices whose max |d| exceeds `tol`), ratio ``exp(d)`` statistics (mean, std, min, max, ``clip_frac``: outside
    [1 - eps_low, 1 + eps_high]) and ``ok`` (max |d| <= tol)."""
    m = mask.bool().cpu()
    d = logp.double().cpu() - logp_old.double().cpu()
    d = torch.where(m, d, torch.zeros_like(d))
    valid = d[m]
    ratio = valid.exp()
    per = torch.where(m, d.abs(), torch.full_like(d, -1.0)).max(dim=0).values
    per_action = [float(x) if x >= 0 else math.nan for x in per.tolist()]
    max_abs = float(valid.abs().max()) if valid.numel() else 0.0
    return {
        "max_abs": max_abs,
        "mean_abs": float(valid.abs().mean()) if valid.numel() else 0.0,
        "per_action": per_action,
        "breaking": [i for i, x in enumerate(per_action) if not math.isnan(x) and x > tol],
        "ratio": {
            "mean": float(ratio.mean()) if valid.numel() else 1.0,
            "std": float(ratio.std(unbiased=False)) if valid.numel() else 0.0,
            "min": float(ratio.min()) if valid.numel() else 1.0,
            "max": float(ratio.max()) if valid.numel() else 1.0,
            "clip_frac": float(((ratio < 1 - eps_low) | (ratio > 1 + eps_high)).double().mean())
            if valid.numel()
            else 0.0,
        },
        "actions": int(m.sum()),
        "ok": max_abs <= tol,
    }


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _names(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in values if v not in PRECISIONS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"precisions are among {', '.join(PRECISIONS)}, got {text!r}")
    return values


def settings_for(
    cfg: Config, batch: int, microbatches: Sequence[int], precisions: Sequence[str], chunked: bool
) -> list[Setting]:
    """The settings `parity` measures: the trainer's first, then the micro-batch sizes (fp32), the precisions
    (at the trainer's micro-batch size), eval mode and, when the policy scores chunks, one piece."""
    mb = min(cfg.trainer.microbatch_size or batch, batch)
    cfg_prec = MIXED.get(cfg.trainer.mixed_precision, "fp32")
    out = [Setting(f"trainer (microbatch {mb}, {cfg_prec}, train mode)", mb, cfg_prec)]
    for m in sorted({min(x, batch) for x in microbatches} | {batch}):
        if m != mb or cfg_prec != "fp32":
            out.append(Setting(f"microbatch {m}, fp32", m))
    for p in precisions:
        if p != cfg_prec:
            out.append(Setting(f"{p} autocast (microbatch {mb})", mb, p))
    out.append(Setting(f"eval mode (microbatch {mb}, {cfg_prec})", mb, cfg_prec, train_mode=False))
    if chunked:
        out.append(
            Setting(f"actions in one piece (microbatch {mb}, {cfg_prec})", mb, cfg_prec, chunked=False)
        )
    return out


def parity(
    cfg: Config,
    components: Any,
    *,
    prompts: int = 2,
    group_size: int | None = None,
    microbatches: Sequence[int] = (1, 2, 4),
    precisions: Sequence[str] = ("fp32", "bf16", "fp16"),
    tol: float = 1e-3,
    seed: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Draw one rollout of `prompts` training rows x `group_size` (default ``rollout.group_size``) from the base
    policy of `components`, re-score it under every setting (`settings_for`, `score_rollout`) and compare with the
    rollout's ``logp_old`` (`compare`); the engine's log-probs too when ``rollout.engine`` is not ``hf``.
    `progress` receives one line as each phase starts and ends (the CLI prints them to stderr)."""
    from mmalign.algorithms import losses
    from mmalign.app.probe import pick_rows
    from mmalign.policies.base import RunInfo
    from mmalign.training.seeding import seed_policy

    policy = components.policy
    seed = cfg.seed if seed is None else seed
    g = int(group_size or cfg.rollout.group_size)
    if g < 1:
        raise ConfigError(f"group size must be >= 1, got {g}")
    rows = pick_rows(components.data, prompts, seed)
    engine = cfg.rollout.engine
    if engine != "hf":  # the trainer's set-up: the engine is built, gets the weights and the step's seed
        policy.setup(RunInfo(cfg=cfg, accelerator=None))
        policy.on_train_step(0)
    say = progress or (lambda line: None)
    seed_policy(policy, seed)
    say(f"rollout: {len(rows)} prompt(s) x {g} samples from the base policy ...")
    t0 = time.perf_counter()
    with torch.no_grad():
        rollout = policy.rollout(rows, g, compute_logp=True)
    t1 = time.perf_counter()
    say(f"rollout: done in {t1 - t0:.1f} s")
    if rollout.logp_old is None:
        raise ConfigError(
            f"{cfg.source}: {type(policy).__name__}.rollout stored no logp_old: nothing to compare"
        )
    kw = dict(cfg.algorithm.loss_kwargs)
    eps_low = float(kw.get("eps_low", kw.get("eps", 0.2)))
    eps_high = float(kw.get("eps_high", kw.get("eps", 0.2)))
    chunkable = not losses.couples_actions(cfg.algorithm.loss)
    chunks = policy.action_chunks(rollout) if chunkable else None
    b, t = rollout.mask.shape
    kind = "token" if "texts" in rollout.outputs and "latents" not in rollout.outputs else "denoising step"
    report: dict[str, Any] = {
        "config": cfg.source,
        "policy": type(policy).__name__,
        "prompts": len(rows),
        "group_size": g,
        "samples": b,
        "actions_per_sample": t,
        "action": kind,
        "valid_actions": int(rollout.mask.sum()),
        "tolerance": tol,
        "clip_range": [1 - eps_low, 1 + eps_high],
        "engine": engine,
        "seconds": {"rollout": round(t1 - t0, 2)},
        "settings": [],
    }
    dev = _device(policy)
    if t == 0 or not bool(rollout.mask.any()):
        report["no_logp"] = (
            f"{type(policy).__name__}.rollout recorded no stochastic actions (e.g. a deterministic sampler for a "
            "forward-process objective, algorithm.objective): there is no log-prob ratio to check"
        )
        report["first_update"], report["breaking_settings"] = None, []
        return report
    settings = settings_for(cfg, b, microbatches, precisions, bool(chunks and len(chunks) > 1))
    for i, s in enumerate(settings, 1):
        say(f"re-scoring {i}/{len(settings)}: {s.name} ...")
        entry: dict[str, Any] = {"name": s.name, "microbatch": s.microbatch, "precision": s.precision}
        try:
            # a precision the device cannot autocast fails here, before scoring
            with _precision(s.precision, dev):
                pass
            t2 = time.perf_counter()
            logp = score_rollout(policy, rollout, s, chunkable=chunkable)
            entry["seconds"] = round(time.perf_counter() - t2, 2)
            say(f"re-scoring {i}/{len(settings)}: done in {entry['seconds']:.1f} s")
        except (RuntimeError, TypeError, ValueError) as e:  # e.g. fp16 kernels missing on this device
            if s.precision == "fp32":  # not a precision the device lacks: a real failure
                raise
            entry["unsupported"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            report["settings"].append(entry)
            continue
        if logp is None:
            report["no_logp"] = (
                f"{type(policy).__name__}.action_stats returns its own loss and no log-probs (algorithm.objective): "
                "there is no ratio to check"
            )
            report["settings"] = []
            break
        entry.update(
            compare(logp, rollout.logp_old, rollout.mask, tol=tol, eps_low=eps_low, eps_high=eps_high)
        )
        report["settings"].append(entry)
    if rollout.logp_sampler is not None:
        entry = {"name": f"engine ({engine}) log-probs vs the trainer's recomputation", "precision": "engine"}
        entry.update(
            compare(
                rollout.logp_sampler,
                rollout.logp_old,
                rollout.mask,
                tol=tol,
                eps_low=eps_low,
                eps_high=eps_high,
            )
        )
        report["engine_vs_trainer"] = entry
    scored = [s for s in report["settings"] if "max_abs" in s]
    report["first_update"] = scored[0] if scored else None
    report["breaking_settings"] = [s["name"] for s in scored if not s["ok"]]
    if "engine_vs_trainer" in report and not report["engine_vs_trainer"]["ok"]:
        report["breaking_settings"].append(report["engine_vs_trainer"]["name"])
    return report


def _f(x: Any, spec: str = ".3g") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float) and math.isnan(x):
        return "-"
    return format(x, spec)


def _indices(idx: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    parts, start = [], None
    for i, x in enumerate(idx):
        if start is None:
            start = x
        if i + 1 == len(idx) or idx[i + 1] != x + 1:
            parts.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(parts)


def render(report: dict[str, Any]) -> str:
    """The markdown report of `parity`."""
    tol = report["tolerance"]
    lo, hi = report["clip_range"]
    lines = [
        f"# mmalign parity: {report['config']}",
        "",
        f"One rollout of the base model ({report['policy']}): {report['prompts']} prompts x {report['group_size']} "
        f"samples, {report['actions_per_sample']} {report['action']}s per sample ({report['valid_actions']} valid); "
        f"rollout {report['seconds']['rollout']:.1f} s. Reference: the rollout's logp_old. Error = logp - logp_old "
        f"over the valid actions; ratio = exp(error); ratio = 1 holds when max |error| <= {tol:g}; clip range "
        f"[{lo:g}, {hi:g}].",
        "",
    ]
    if report.get("no_logp"):
        return "\n".join([*lines, report["no_logp"]]) + "\n"
    lines += [
        "| setting | max abs error | mean abs error | ratio mean | ratio std | ratio min | ratio max | outside clip "
        "| ratio = 1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    rows = list(report["settings"])
    if "engine_vs_trainer" in report:
        rows.append(report["engine_vs_trainer"])
    for s in rows:
        if "unsupported" in s:
            lines.append(f"| {s['name']} | unsupported: {s['unsupported']} | | | | | | | |")
            continue
        r = s["ratio"]
        lines.append(
            f"| {s['name']} | {_f(s['max_abs'])} | {_f(s['mean_abs'])} | {r['mean']:.6f} | {_f(r['std'])} | "
            f"{r['min']:.6f} | {r['max']:.6f} | {r['clip_frac']:.1%} | {'yes' if s['ok'] else '**no**'} |"
        )
    first = report.get("first_update")
    if first:
        r = first["ratio"]
        lines += [
            "",
            f"First update (the trainer's setting, unchanged weights): ratio mean {r['mean']:.6f}, std {_f(r['std'])}, "
            f"range [{r['min']:.6f}, {r['max']:.6f}], {r['clip_frac']:.1%} outside the clip range.",
        ]
    width = report["actions_per_sample"]
    lines += ["", f"## Max abs error per {report['action']}", ""]
    if width <= 20:
        lines += [
            "| setting | " + " | ".join(str(i) for i in range(width)) + " |",
            "|---|" + "---:|" * width,
        ]
        for s in rows:
            if "per_action" in s:
                lines.append(f"| {s['name']} | " + " | ".join(_f(x, ".2g") for x in s["per_action"]) + " |")
        lines.append("")
    for s in rows:
        if s.get("breaking"):
            lines.append(
                f"- {s['name']}: max abs error > {tol:g} at {report['action']} {_indices(s['breaking'])}"
            )
    broken = report["breaking_settings"]
    lines += [
        "",
        f"Settings that break ratio = 1: {', '.join(broken)}."
        if broken
        else "Every setting keeps ratio = 1 within the tolerance.",
    ]
    return "\n".join(lines) + "\n"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``parity`` to the ``mmalign`` subcommands (`mmalign.app.cli.build_parser`)."""
    p = subparsers.add_parser(
        "parity",
        help="re-score one rollout with unchanged weights per micro-batch size, precision and engine: is ratio = 1?",
    )
    p.add_argument("config", help="path to a YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.engine=fake")
    p.add_argument("-n", "--prompts", type=int, default=2, help="training prompts in the rollout (default 2)")
    p.add_argument(
        "--group-size", type=int, default=None, help="samples per prompt (default rollout.group_size)"
    )
    p.add_argument(
        "--microbatch-sizes", type=_ints, default=[1, 2, 4], help="micro-batch sizes to try (default 1,2,4)"
    )
    p.add_argument(
        "--precisions",
        type=_names,
        default=list(PRECISIONS),
        help="autocast precisions (default fp32,bf16,fp16)",
    )
    p.add_argument("--tol", type=float, default=1e-3, help="max |log-ratio| that still counts as ratio = 1")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the config's seed)")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    """``mmalign parity``: print the markdown report (and the JSON one with ``--json``); 0 when the trainer's own
    setting keeps ratio = 1, 2 when it does not."""
    from mmalign.app.probe import emit_report, load_setup

    if not args.tol > 0:
        raise ConfigError(f"--tol must be > 0, got {args.tol}")

    def say(line: str) -> None:
        print(f"mmalign parity: {line}", file=sys.stderr, flush=True)

    cfg, components = load_setup(
        args.config, args.overrides, need_rewards=False, command="parity", progress=say
    )
    report = parity(
        cfg,
        components,
        prompts=args.prompts,
        group_size=args.group_size,
        microbatches=args.microbatch_sizes,
        precisions=args.precisions,
        tol=args.tol,
        seed=args.seed,
        progress=say,
    )
    emit_report(render(report), report, args.json)
    first = report.get("first_update")
    return 2 if first is not None and not first["ok"] else 0
