"""The over-optimisation watchdog (``eval.watchdog``): is the training reward being hacked?

Every ``eval.watchdog.every`` steps (and once on the base model) `OverOptMonitor` samples held-out prompts as
``mmalign eval`` does and scores them with the training rewards and the gold ``eval.rewards``; every random
generator it touches is restored, so a run trains exactly as without it. It tracks the gold-vs-training gap,
divergence (warning with the step it began), image statistics drift, flow policies' per-step ratio bias, and
can ``keep_best`` and ``stop``. Its log ``RUN_DIR/overopt.jsonl`` is its state (replayed on resume;
`read_log` / `findings_text` feed ``mmalign doctor``). Details: docs/overoptimisation.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.config import Config, WatchdogConfig
from mmalign.training import rundir
from mmalign.training.seeding import rng_state, set_rng_state
from mmalign.training.trainer import TrainingError

log = logging.getLogger("mmalign.app.overopt")

__all__ = [
    "BEST_DIR",
    "BEST_INFO",
    "IMAGE_STATS",
    "LOG_FILE",
    "Evaluation",
    "OverOptMonitor",
    "OverOptimisationStop",
    "WatchdogState",
    "background_uniformity",
    "colour_entropy",
    "findings_text",
    "high_frequency_energy",
    "image_statistics",
    "preserved_rng",
    "ratio_bias",
    "read_log",
    "saturation",
]

LOG_FILE = "overopt.jsonl"
"""The watchdog's log in the run directory: one JSON object per evaluation (`Evaluation` plus the state)."""
BEST_DIR = "best"
"""The best checkpoint by gold reward (``policy.save``), in the run directory."""
BEST_INFO = "watchdog_best.json"
"""Inside `BEST_DIR`: the step and the gold reward of the weights it holds (written last)."""
DRIFT_EPS = 0.01
"""`drift z`: the change of a statistic's mean over (the base samples' std + this)."""


class OverOptimisationStop(TrainingError):
    """``eval.watchdog.stop``: the gold reward diverged from the training reward; the run stopped after the
    checkpoint of the step that detected it."""


# ----------------------------------------------------------------------------- image statistics


def _as_images(pixels: Tensor) -> tuple[Tensor, int]:
    """Float[N,3,H,W] of Float[B,3,H,W] images or Float[B,F,3,H,W] clips (frames flattened), and F (1 for
    images)."""
    x = pixels.detach().float().cpu()
    if x.dim() == 5:
        return x.flatten(0, 1), x.shape[1]
    if x.dim() != 4 or x.shape[1] != 3:
        raise ValueError(f"image statistics need Float[B,3,H,W] or Float[B,F,3,H,W], got {tuple(x.shape)}")
    return x, 1


def saturation(images: Tensor) -> Tensor:
    """Float[N]: each image's mean HSV saturation, S = (max_c - min_c) / max_c per pixel (0 where max_c = 0).
    0 for greys (white, black), 1 for pure hues."""
    x = images.float().clamp(0, 1)
    hi, lo = x.max(dim=1).values, x.min(dim=1).values
    s = torch.where(hi > 0, (hi - lo) / hi.clamp_min(1e-12), torch.zeros_like(hi))
    return s.flatten(1).mean(1)


def colour_entropy(images: Tensor, levels: int = 4) -> Tensor:
    """Float[N]: Shannon entropy in bits of each image's colour histogram, every channel quantised to `levels`
    values (q = min(floor(x * levels), levels - 1); ``levels**3`` joint bins). 0 for one colour; at most
    3 log2(levels)."""
    x = images.float().clamp(0, 1)
    q = (x * levels).floor().clamp(max=levels - 1).long()
    bins = (q[:, 0] * levels + q[:, 1]) * levels + q[:, 2]
    out = []
    for b in bins.flatten(1):
        p = torch.bincount(b, minlength=levels**3).double() / b.numel()
        p = p[p > 0]
        out.append(float(-(p * torch.log2(p)).sum()))
    return torch.tensor(out, dtype=torch.float32)


def high_frequency_energy(images: Tensor, cutoff: float = 0.25) -> Tensor:
    """Float[N]: the share of each image's spectral energy above radial frequency `cutoff` (cycles per pixel;
    0.25 is half the Nyquist frequency), of the luminance Y = 0.299 R + 0.587 G + 0.114 B with its mean
    removed: sum_{r > cutoff} |F|^2 / sum |F|^2 (0 for a flat image)."""
    x = images.float()
    y = 0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]
    y = y - y.mean(dim=(1, 2), keepdim=True)
    power = torch.fft.fft2(y.double()).abs() ** 2
    h, w = y.shape[1:]
    fy, fx = torch.fft.fftfreq(h, dtype=torch.float64), torch.fft.fftfreq(w, dtype=torch.float64)
    radius = (fy[:, None] ** 2 + fx[None, :] ** 2).sqrt()
    total = power.flatten(1).sum(1)
    high = (power * (radius > cutoff)).flatten(1).sum(1)
    return torch.where(total > 0, high / total.clamp_min(1e-300), torch.zeros_like(total)).float()


def background_uniformity(images: Tensor, border: float = 0.125) -> Tensor:
    """Float[N]: 1 - 2 * (the mean over channels of the std of the pixels in the border ring, of width
    max(1, round(border * min(H, W))) pixels). 1 for a constant border (a plain background); the std of values
    in [0, 1] is at most 0.5, so the value is in [0, 1]."""
    x = images.float().clamp(0, 1)
    h, w = x.shape[-2:]
    k = max(1, round(border * min(h, w)))
    ring = torch.ones((h, w), dtype=torch.bool)
    ring[k : h - k, k : w - k] = False
    values = x[:, :, ring]  # [N, 3, P]
    return 1.0 - 2.0 * values.std(dim=2, unbiased=False).mean(dim=1)


IMAGE_STATS: dict[str, Callable[[Tensor], Tensor]] = {
    "saturation": saturation,
    "colour_entropy": colour_entropy,
    "high_freq_energy": high_frequency_energy,
    "background_uniformity": background_uniformity,
}
"""The statistics whose drift the watchdog tracks, by the name they are logged under."""


def image_statistics(pixels: Tensor) -> dict[str, Tensor]:
    """Every `IMAGE_STATS` statistic of each sample, Float[B]: images Float[B,3,H,W] in [0, 1], or clips
    Float[B,F,3,H,W] (the mean over a clip's frames)."""
    images, frames = _as_images(pixels)
    out = {}
    for name, fn in IMAGE_STATS.items():
        values = fn(images)
        out[name] = values.view(-1, frames).mean(1)
    return out


# ----------------------------------------------------------------------------- RNG


@contextlib.contextmanager
def preserved_rng(policy: Any) -> Iterator[None]:
    """Restore on exit every generator a watchdog evaluation touches: the process's global RNGs (Python,
    NumPy, torch CPU and CUDA: `mmalign.training.seeding.rng_state`), the policy's own (`Policy.rng_state`) and a
    token policy's ``engine_seed``."""
    saved = rng_state()
    own = policy.rng_state() if hasattr(policy, "rng_state") else {}
    own = {k: v.clone() if isinstance(v, Tensor) else v for k, v in own.items()}
    has_seed = hasattr(policy, "engine_seed")
    engine_seed = getattr(policy, "engine_seed", None)
    try:
        yield
    finally:
        set_rng_state(saved)
        if own and hasattr(policy, "load_rng_state"):
            policy.load_rng_state(own)
        if has_seed:
            policy.engine_seed = engine_seed


# ----------------------------------------------------------------------------- ratio bias


_RATIO_KEY = re.compile(r"^ratio/step_(\d+)$")


def ratio_bias(
    logp: Tensor, logp_old: Tensor, mask: Tensor, step_index: Tensor
) -> dict[int, tuple[float, int]]:
    """GRPO-Guard's per-denoising-step ratio bias: for each denoising step k, (sum over the valid actions of
    that step of (exp(logp - logp_old) - 1), their count). All tensors Float/Bool/Long[B,T]."""
    ratio = torch.exp(logp.double() - logp_old.double()) - 1.0
    out: dict[int, tuple[float, int]] = {}
    valid = mask.bool()
    for k in sorted({int(v) for v in step_index[valid].tolist()}):
        sel = valid & (step_index == k)
        out[k] = (float(ratio[sel].sum()), int(sel.sum()))
    return out


# ----------------------------------------------------------------------------- state


@dataclass
class Evaluation:
    """One watchdog evaluation, as measured (what the log stores besides the state)."""

    step: int
    gold: dict[str, float]
    """Each gold reward's mean over the held-out samples."""
    gold_total: float
    """The weighted total of the gold rewards (their ``eval.rewards`` weights), averaged over the samples."""
    train_total: float
    """The training rewards' weighted total on the same held-out samples."""
    train_batch: float | None = None
    """``reward/mean`` of the training batch of that step (None at step 0)."""
    stats: dict[str, float] = field(default_factory=dict)
    """Images / video: each `IMAGE_STATS` statistic's mean over the samples."""
    stats_std: dict[str, float] = field(default_factory=dict)
    ratio_bias: dict[str, float] = field(default_factory=dict)
    """Flow policies: ``step_<k>`` -> mean(ratio - 1) of denoising step k (training batch of this step)."""


@dataclass
class WatchdogState:
    """The divergence rule, a pure function of the evaluations in order (`observe`); `replay` rebuilds it from
    the log on resume."""

    patience: int = 2
    tolerance: float = 0.02
    base: Evaluation | None = None
    best: Evaluation | None = None
    below: list[int] = field(default_factory=list)
    """Steps of the current run of evaluations with the gold reward below best - tolerance while the training
    reward held."""
    diverged_since: int | None = None
    """The step at which the current divergence began (the first of `below`), once it counted `patience`."""
    warnings: list[str] = field(default_factory=list)

    def observe(self, ev: Evaluation) -> dict[str, Any]:
        """Add one evaluation; returns its record for the log: the evaluation, ``best_step``, ``best_gold``,
        ``diverging``, ``diverged_since``, ``new_best`` and ``warning`` (the text, when divergence is detected
        now)."""
        warning = None
        new_best = False
        if self.base is None:
            self.base = ev
        if self.best is None or ev.gold_total > self.best.gold_total:
            self.best, new_best = ev, True
            self.below, self.diverged_since = [], None
        elif (
            ev.gold_total < self.best.gold_total - self.tolerance and ev.train_total >= self.best.train_total
        ):
            self.below.append(ev.step)
            if len(self.below) >= self.patience and self.diverged_since is None:
                self.diverged_since = self.below[0]
                warning = self._warning(ev)
                self.warnings.append(warning)
        else:
            self.below, self.diverged_since = [], None
        return {
            **asdict(ev),
            "best_step": self.best.step,
            "best_gold": self.best.gold_total,
            "diverging": self.diverged_since is not None,
            "diverged_since": self.diverged_since,
            "new_best": new_best,
            "warning": warning,
        }

    def _warning(self, ev: Evaluation) -> str:
        best, base = self.best, self.base
        assert best is not None and base is not None
        text = (
            f"over-optimisation: the gold reward fell from {best.gold_total:.4f} (step {best.step}) to "
            f"{ev.gold_total:.4f} (step {ev.step}) while the training reward on the same held-out samples did not "
            f"fall ({best.train_total:.4f} -> {ev.train_total:.4f}); divergence began at step {self.below[0]} "
            f"(gold below its best by more than {self.tolerance:g} at steps {', '.join(map(str, self.below))})"
        )
        drift = drift_of(ev, base)
        if drift:
            name, (delta, z) = max(drift.items(), key=lambda kv: abs(kv[1][1]))
            text += (
                f"; the largest drift from the base samples is {name} {base.stats[name]:.3f} -> "
                f"{ev.stats[name]:.3f} ({delta:+.3f}, {z:+.1f} base std)"
            )
        return text + f". The best checkpoint by gold reward is step {best.step}"

    @classmethod
    def replay(cls, records: Sequence[dict[str, Any]], cfg: WatchdogConfig) -> WatchdogState:
        """The state after the logged `records` (log lines, in order)."""
        state = cls(patience=cfg.patience, tolerance=cfg.tolerance)
        for rec in records:
            state.observe(evaluation_of(rec))
        return state


def evaluation_of(record: dict[str, Any]) -> Evaluation:
    """The `Evaluation` of a log line."""
    names = {f for f in Evaluation.__dataclass_fields__}
    return Evaluation(**{k: v for k, v in record.items() if k in names})


def drift_of(ev: Evaluation, base: Evaluation) -> dict[str, tuple[float, float]]:
    """Per statistic: (mean now - mean of the base samples, that change over (the base std + `DRIFT_EPS`))."""
    out = {}
    for name, value in ev.stats.items():
        if name in base.stats:
            delta = value - base.stats[name]
            out[name] = (delta, delta / (base.stats_std.get(name, 0.0) + DRIFT_EPS))
    return out


def record_metrics(record: dict[str, Any], base: Evaluation | None) -> dict[str, float]:
    """The ``watchdog/*`` metrics of one log record (what metrics.jsonl gets at an evaluation step)."""
    m: dict[str, float] = {
        "watchdog/gold": record["gold_total"],
        "watchdog/train_reward": record["train_total"],
        "watchdog/best_gold": record["best_gold"],
        "watchdog/best_step": float(record["best_step"]),
        "watchdog/diverging": float(bool(record["diverging"])),
    }
    for name, value in record["gold"].items():
        m[f"watchdog/gold/{name}"] = value
    if record.get("diverged_since") is not None:
        m["watchdog/diverged_since"] = float(record["diverged_since"])
    ev = evaluation_of(record)
    if base is not None:
        m["watchdog/gap"] = (ev.train_total - base.train_total) - (ev.gold_total - base.gold_total)
        for name, (delta, z) in drift_of(ev, base).items():
            m[f"watchdog/drift/{name}"] = delta
            m[f"watchdog/drift_z/{name}"] = z
    for name, value in ev.stats.items():
        m[f"watchdog/stat/{name}"] = value
    for name, value in ev.ratio_bias.items():
        m[f"watchdog/ratio_bias/{name}"] = value
    if ev.ratio_bias:
        m["watchdog/ratio_bias/max_abs"] = max(abs(v) for v in ev.ratio_bias.values())
    return m


def read_log(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/overopt.jsonl`` (empty without one); a torn last line is skipped."""
    path = Path(run_dir) / LOG_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "step" in row:
                out.append(row)
    return out


def findings_text(records: Sequence[dict[str, Any]]) -> list[str]:
    """The warnings of a log (divergence episodes), in order."""
    return [str(r["warning"]) for r in records if r.get("warning")]


# ----------------------------------------------------------------------------- the monitor


def _nanmean(x: Tensor) -> float:
    x = x[~torch.isnan(x)]
    return float(x.mean()) if x.numel() else math.nan


class OverOptMonitor:
    """The watchdog as a `GroupTrainer` monitor (`mmalign.training.callbacks.TrainerCallback`); see the module docstring.
    `rows` are the held-out rows it samples (the first ``eval.watchdog.prompts`` of them are used). Every
    process evaluates its chunks of the prompts and the scores are gathered, so every process reaches the
    same decisions; the main process writes the log and ``best/``."""

    def __init__(self, cfg: Config, rows: Sequence[dict[str, Any]], *, gold: Any = None) -> None:
        self.cfg = cfg
        self.w = cfg.eval.watchdog
        self.rows = list(rows)[: self.w.prompts]
        if not self.rows:
            raise ValueError("eval.watchdog: no prompts to evaluate (data.eval and data.train are empty)")
        self.gold = gold
        """The gold `RewardSet` (``eval.rewards``); built at `on_train_start` when not given."""
        self.state = WatchdogState(patience=self.w.patience, tolerance=self.w.tolerance)
        self.out = Path(cfg.output_dir)
        self.stop_step: int | None = None
        self._stop_message = ""

    # -- hooks
    def on_train_start(self, trainer: Any, step: int) -> None:
        if self.gold is None:
            from rewards import RewardSet

            self.gold = RewardSet(self.cfg.eval.rewards, source=self.cfg.source, key="eval.rewards")
        records = read_log(self.out) if step > 0 else []
        records = [r for r in records if int(r["step"]) <= step]
        if trainer.is_main:
            rundir.write_atomic(
                self.out / LOG_FILE, "".join(json.dumps(rundir.jsonable(r)) + "\n" for r in records)
            )
            if step == 0 and (self.out / BEST_DIR).exists():
                shutil.rmtree(self.out / BEST_DIR)  # a previous run's (overwrite=true)
        trainer.accelerator.wait_for_everyone()
        self.state = WatchdogState.replay(records, self.w)
        if self.state.base is None:  # a fresh run (or one resumed without a log): the reference evaluation
            if step > 0:
                log.warning(
                    "eval.watchdog: %s has no evaluations before step %d; the reference is taken now, from the "
                    "resumed weights, not from the base model",
                    self.out / LOG_FILE,
                    step,
                )
            self._evaluate(trainer, step, None)

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if self.w.every and step % self.w.every == 0:
            metrics.update(self._evaluate(trainer, step, metrics))

    def on_train_end(self, trainer: Any) -> None:
        if self.stop_step is None:
            return
        stop_step, self.stop_step = self.stop_step, None
        written = rundir.latest_checkpoint(self.out)
        if sys.exc_info()[0] is None and trainer.step == stop_step and written is not None:
            raise OverOptimisationStop(
                f"training stopped after step {stop_step} (eval.watchdog.stop): {self._stop_message}\n"
                f"  kept: metrics of steps 1..{stop_step} in {self.out / rundir.METRICS_FILE}; the checkpoint "
                f"{written}"
                + (f"; the best by gold reward: {self.out / BEST_DIR}" if self.w.keep_best else "")
            )

    # -- the evaluation
    def _evaluate(self, trainer: Any, step: int, metrics: dict[str, Any] | None) -> dict[str, float]:
        policy = trainer.policy
        with preserved_rng(policy):
            ev = self._measure(trainer, step)
            ev.ratio_bias = self._ratio_bias(trainer, metrics)
        if metrics is not None and isinstance(metrics.get("reward/mean"), int | float):
            ev.train_batch = float(metrics["reward/mean"])
        record = self.state.observe(ev)
        if trainer.is_main:
            line = json.dumps(rundir.jsonable(record)) + "\n"
            with rundir.writing(self.out / LOG_FILE), (self.out / LOG_FILE).open("a") as f:
                f.write(line)
            if record["new_best"] and self.w.keep_best:
                self._save_best(policy, step, ev.gold_total)
            if record["warning"]:
                log.warning("step %d: [watchdog] %s", step, record["warning"])
        if record["warning"] and self.w.stop:
            self.stop_step = step
            self._stop_message = record["warning"]
            # the loop ends after this step: its metrics, samples and checkpoint are written, then
            # `on_train_end` raises
            trainer.request_stop(f"over-optimisation (eval.watchdog.stop): {record['warning']}")
        return record_metrics(record, self.state.base)

    def _measure(self, trainer: Any, step: int) -> Evaluation:
        from mmalign.algorithms.advantages import combine_rewards
        from mmalign.app.evaluation import generate_chunks, score_table

        e = self.cfg.eval
        policy = trainer.policy
        parts = generate_chunks(
            policy,
            self.rows,
            self.w.group_size,
            seed=e.seed,
            prompts_per_batch=e.prompts_per_batch,
            progress=False,
            rank=trainer.rank,
            world=trainer.world,
        )
        tables = []
        for c, part in parts:
            _, train = score_table(part, [trainer.reward_set])[:2]
            names, gold = score_table(part, [self.gold])[:2]
            pixels = part.outputs.get("images", part.outputs.get("videos"))
            stats = image_statistics(pixels) if self.w.drift and isinstance(pixels, Tensor) else {}
            tables.append((c, names, train, gold, stats))
        if trainer.world > 1:
            from accelerate.utils import gather_object

            tables = gather_object(tables)
        tables.sort(key=lambda t: t[0])
        names = tables[0][1]
        train = torch.cat([t[2] for t in tables])
        gold = torch.cat([t[3] for t in tables])
        train_total = combine_rewards(train, trainer.reward_set.weights.tolist())
        gold_total = combine_rewards(gold, self.gold.weights.tolist())
        stats: dict[str, float] = {}
        stats_std: dict[str, float] = {}
        if tables[0][4]:
            for name in tables[0][4]:
                values = torch.cat([t[4][name] for t in tables]).double()
                stats[name] = float(values.mean())
                stats_std[name] = float(values.std(unbiased=False))
        return Evaluation(
            step=step,
            gold={n: _nanmean(gold[:, k]) for k, n in enumerate(names)},
            gold_total=_nanmean(gold_total),
            train_total=_nanmean(train_total),
            stats=stats,
            stats_std=stats_std,
        )

    def _ratio_bias(self, trainer: Any, metrics: dict[str, Any] | None) -> dict[str, float]:
        """Per denoising step, mean(ratio - 1): from ``ratio/step_<k>`` metrics when the trainer logs them,
        else re-scored on this step's training batch under the updated weights when the batch holds
        ``logp_old`` and per-action ``step_index`` (flow policies with more than one update per rollout; with
        one, the ratio is 1 at the update). Empty when neither applies."""
        if metrics:
            logged = {m.group(1): v for k, v in metrics.items() if (m := _RATIO_KEY.match(k))}
            if logged:
                return {
                    f"step_{k}": float(v) - 1.0 for k, v in sorted(logged.items(), key=lambda kv: int(kv[0]))
                }
        batch = getattr(trainer, "_last_batch", None)
        if metrics is None or batch is None or batch.logp_old is None or not len(batch):
            return {}
        index = batch.payload.get("step_index")
        if not isinstance(index, Tensor) or index.shape != batch.mask.shape:
            return {}
        size = trainer.cfg.trainer.microbatch_size or len(batch)
        sums: dict[int, list[float]] = {}
        with torch.no_grad():
            for start in range(0, len(batch), size):
                mb = batch[list(range(start, min(start + size, len(batch))))]
                stats = trainer.policy.action_stats(mb)
                if stats.logp is None:
                    return {}
                part = ratio_bias(
                    stats.logp.cpu(), mb.logp_old.cpu(), mb.mask.cpu(), mb.payload["step_index"].cpu()
                )
                for k, (s, n) in part.items():
                    acc = sums.setdefault(k, [0.0, 0.0])
                    acc[0] += s
                    acc[1] += n
        if trainer.world > 1:
            from accelerate.utils import gather_object

            merged: dict[int, list[float]] = {}
            for part in gather_object([sums]):
                for k, (s, n) in part.items():
                    acc = merged.setdefault(k, [0.0, 0.0])
                    acc[0] += s
                    acc[1] += n
            sums = merged
        return {f"step_{k}": s / n for k, (s, n) in sorted(sums.items()) if n}

    def _save_best(self, policy: Any, step: int, gold: float) -> None:
        """``best/``: `policy.save` into a temp folder, `BEST_INFO` written last, then renamed over the old."""
        final, tmp = self.out / BEST_DIR, self.out / f".{BEST_DIR}.tmp"
        with rundir.writing(tmp, runtime=False):
            if tmp.exists():
                shutil.rmtree(tmp)
            policy.save(tmp)
            (tmp / BEST_INFO).write_text(json.dumps({"step": step, "gold": gold}) + "\n")
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)


def watchdog_monitors(cfg: Config, components: Any) -> list[OverOptMonitor]:
    """``[OverOptMonitor]`` when ``eval.watchdog.every`` > 0 (held-out rows: ``components.eval_data``, else the
    training rows), else ``[]``."""
    if not cfg.eval.watchdog.every:
        return []
    rows = list(getattr(components, "eval_data", None) or []) or list(components.data)
    return [OverOptMonitor(cfg, rows)]
