"""Generation and scoring without training: the engine of `mmalign sample` and `mmalign eval`.

- `resolve_checkpoint(output_dir, spec)`: which weights to use (``latest`` checkpoint of a run, a
  checkpoint folder, or ``base`` for the model as loaded).
- `load_weights(policy, checkpoint)`: put a checkpoint's trainable weights into a built policy.
- `generate(policy, rows, n, ...)`: `n` samples per row without grad, with the sampling noise seeded so
  that two checkpoints evaluated with the same seed see the same noise (paired before/after samples).
- `score(...)`: every training reward and every ``eval.rewards`` entry, averaged overall and per value
  of ``eval.split_column`` (NaN, "not applicable", is left out of a mean).
- `evaluate_run(cfg, components, ...)`: the before/after report: the base model and the checkpoint,
  side by side.
- `save_grid(images, path, ncols)`: a PNG grid (rows = prompts, columns = samples).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.batch import Rollout
from mmalign.config import Config, ConfigError

log = logging.getLogger(__name__)

__all__ = [
    "evaluate_run",
    "format_report",
    "generate",
    "load_weights",
    "resolve_checkpoint",
    "save_grid",
    "score",
]


MEDIA_OUTPUTS = ("images", "videos")
"""What `generate` asks a policy to materialise (pixels of latent samples) when `decode` is set."""


def resolve_checkpoint(output_dir: str | Path, spec: str | None) -> Path | None:
    """The checkpoint folder `spec` names: ``base`` (None: no checkpoint), ``latest`` (the newest complete
    checkpoint in `output_dir`, None if there is none) or a path to a checkpoint folder (or to a run
    directory, whose newest checkpoint is used)."""
    from mmalign.rundir import TRAINABLE_FILE, latest_checkpoint

    if spec in (None, "", "base"):
        return None
    if spec == "latest":
        return latest_checkpoint(output_dir)
    path = Path(spec)
    if (path / TRAINABLE_FILE).is_file():
        return path
    if path.is_dir():
        found = latest_checkpoint(path)
        if found is not None:
            return found
    raise ConfigError(
        f"checkpoint {spec!r}: neither a checkpoint folder (with trainable.safetensors) nor a run directory "
        "with checkpoints/"
    )


def load_weights(policy: Any, checkpoint: Path) -> None:
    """Load the trainable weights saved in `checkpoint` (``trainable.safetensors``) into `policy`."""
    from safetensors.torch import load_file

    from mmalign.rundir import TRAINABLE_FILE

    file = Path(checkpoint) / TRAINABLE_FILE
    if not file.is_file():
        raise ConfigError(f"checkpoint {checkpoint}: no trainable.safetensors in it")
    policy.load_trainable_state_dict(load_file(str(file)))


def _reseed(policy: Any, seed: int) -> None:
    torch.manual_seed(seed)
    gen = getattr(policy, "generator", None)
    if isinstance(gen, torch.Generator):
        gen.manual_seed(seed)
    if hasattr(policy, "engine_seed"):
        policy.engine_seed = seed


@torch.no_grad()
def generate(
    policy: Any,
    rows: list[dict[str, Any]],
    n: int,
    *,
    seed: int = 0,
    prompts_per_batch: int = 8,
    decode: bool = True,
    progress: bool = True,
) -> Rollout:
    """`n` samples for each row (rows in order, samples of a row adjacent), pixels decoded when the policy
    paints and `decode` is set. Sampling noise is seeded with `seed`."""
    from tqdm.auto import tqdm

    if not rows:
        raise ValueError("nothing to generate: no prompts")
    _reseed(policy, seed)
    model = getattr(policy, "model", None)
    was_training = bool(getattr(model, "training", False))
    if model is not None:
        model.eval()
    parts: list[Rollout] = []
    try:
        chunks = range(0, len(rows), prompts_per_batch)
        for start in tqdm(chunks, desc="generate", disable=not progress, leave=False):
            part = policy.rollout(rows[start : start + prompts_per_batch], n, compute_logp=False)
            part.group = part.group + start
            if decode:
                policy.materialize(part, MEDIA_OUTPUTS)
            parts.append(part)
    finally:
        if model is not None and was_training:
            model.train()
    return parts[0] if len(parts) == 1 else Rollout.cat(parts)


def _nanmean(x: Tensor) -> float:
    x = x[~torch.isnan(x)]
    return float(x.mean()) if x.numel() else math.nan


def score(
    rollout: Rollout, reward_sets: Sequence[Any], split_column: str | None = None
) -> dict[str, dict[str, float]]:
    """``{"all": {name: mean, ...}, "<split value>": {...}}`` over the columns of every reward set."""
    names: list[str] = []
    cols: list[Tensor] = []
    for rs in reward_sets:
        if rs is None or not len(rs):
            continue
        values = rs(rollout)
        names += list(rs.names)
        cols.append(values.float().cpu())
    table = torch.cat(cols, dim=1) if cols else torch.zeros((len(rollout), 0))
    subsets: dict[str, Tensor] = {"all": torch.ones(len(rollout), dtype=torch.bool)}
    if split_column is not None:
        if split_column not in rollout.columns:
            raise ConfigError(
                f"key 'eval.split_column': column {split_column!r} is not in the data "
                f"(columns: {sorted(rollout.columns)})"
            )
        values = [str(v) for v in rollout.columns[split_column]]
        for v in sorted(set(values)):
            subsets[v] = torch.tensor([x == v for x in values])
    out: dict[str, dict[str, float]] = {}
    for sub, mask in subsets.items():
        out[sub] = {"samples": float(mask.sum())}
        for k, name in enumerate(names):
            out[sub][name] = _nanmean(table[mask, k])
    return out


def eval_rows(cfg: Config, components: Any) -> list[dict[str, Any]]:
    """The evaluation prompts: `components.eval_data` (``data.eval``), else the training rows; at most
    ``eval.max_rows``."""
    rows = components.eval_data
    if not rows:
        log.warning("%s: no data.eval given; evaluating on the training prompts", cfg.source)
        rows = components.data
    if cfg.eval.max_rows is not None:
        rows = rows[: cfg.eval.max_rows]
    return list(rows)


def evaluate_run(
    cfg: Config,
    components: Any,
    *,
    checkpoint: Path | None,
    compare_base: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Score the base model (if `compare_base` or no checkpoint) and the `checkpoint` on the evaluation
    prompts with the same seeds. `components` must be freshly built (its policy holding the base weights,
    as `mmalign eval` builds them); the checkpoint's weights are loaded into it afterwards. Returns ``{"base": scores, "trained": scores, "checkpoint": str, ...}``."""
    from rewards import RewardSet

    e = cfg.eval
    rows = eval_rows(cfg, components)
    extra = RewardSet(e.rewards, source=cfg.source, key="eval.rewards") if e.rewards else None
    sets = [components.rewards, extra]
    report: dict[str, Any] = {
        "config": cfg.source,
        "prompts": len(rows),
        "samples_per_prompt": e.group_size,
        "seed": e.seed,
        "checkpoint": str(checkpoint) if checkpoint else None,
    }
    policy = components.policy

    def run() -> dict[str, dict[str, float]]:
        r = generate(
            policy, rows, e.group_size, seed=e.seed, prompts_per_batch=e.prompts_per_batch, progress=progress
        )
        return score(r, sets, e.split_column)

    if compare_base or checkpoint is None:
        report["base"] = run()
    if checkpoint is not None:
        load_weights(policy, checkpoint)
        report["trained"] = run()
    return report


def format_report(report: dict[str, Any]) -> str:
    """A plain-text table: one line per (subset, score), with base, trained and their difference."""
    cols = [c for c in ("base", "trained") if c in report]
    first = report[cols[0]]
    lines = [
        f"{report['prompts']} prompts x {report['samples_per_prompt']} samples, seed {report['seed']}; "
        f"checkpoint: {report.get('checkpoint') or 'none (base model)'}"
    ]
    header = f"{'subset':<10} {'score':<28}" + "".join(f" {c:>10}" for c in cols)
    if len(cols) == 2:
        header += f" {'change':>10}"
    lines.append(header)
    for sub, scores in first.items():
        for name in scores:
            vals = [report[c].get(sub, {}).get(name, math.nan) for c in cols]
            line = f"{sub:<10} {name:<28}" + "".join(
                f" {v:>10.0f}" if name == "samples" else f" {v:>10.4f}" for v in vals
            )
            if len(cols) == 2 and name != "samples":
                line += f" {vals[1] - vals[0]:>+10.4f}"
            lines.append(line)
    return "\n".join(lines)


def save_grid(images: Tensor, path: str | Path, ncols: int, pad: int = 2) -> Path:
    """Write Float[N,3,H,W] in [0, 1] as one PNG grid with `ncols` columns (white padding)."""
    from PIL import Image

    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be Float[N,3,H,W], got {tuple(images.shape)}")
    n, _, h, w = images.shape
    nrows = math.ceil(n / ncols)
    grid = torch.ones((3, nrows * (h + pad) + pad, ncols * (w + pad) + pad))
    for i in range(n):
        r, c = divmod(i, ncols)
        y, x = pad + r * (h + pad), pad + c * (w + pad)
        grid[:, y : y + h, x : x + w] = images[i].float().clamp(0, 1)
    arr = (grid.permute(1, 2, 0).numpy() * 255).round().astype("uint8")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)
    return path
