"""Generation and scoring without training: the engine of `mmalign sample` and `mmalign eval`.

Entry points: `resolve_checkpoint`, `load_weights`, `generate` / `generate_chunks` (seeded per chunk, so the
samples do not depend on the number of processes), `score` (`score_table`, `summarize`) and `evaluate_run`
(the before / after report).

Details: docs/architecture.md, "mmalign.app.evaluation".
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.config import Config, ConfigError
from mmalign.data.batch import Rollout
from mmalign.errors import CheckpointError
from mmalign.training.seeding import seed_policy

log = logging.getLogger(__name__)

__all__ = [
    "chunk_seed",
    "eval_sampling",
    "evaluate_run",
    "format_report",
    "generate",
    "generate_chunks",
    "load_agreed",
    "load_trained",
    "load_weights",
    "resolve_checkpoint",
    "score",
    "score_table",
    "summarize",
    "write_report",
]


MEDIA_OUTPUTS = ("images", "videos")
"""What `generate` asks a policy to materialise (pixels of latent samples) when `decode` is set."""


def resolve_checkpoint(output_dir: str | Path, spec: str | None) -> Path | None:
    """The checkpoint folder `spec` names: ``base`` (None: no checkpoint), ``latest`` (the newest complete
    checkpoint in `output_dir` that verifies against its manifest, None if there is none) or a path to a
    checkpoint folder (checked against its manifest: a `CheckpointError` names the file that fails) or to a run
    directory (its newest checkpoint that verifies). A newer checkpoint that fails is skipped with a warning."""
    from mmalign.training.rundir import TRAINABLE_FILE, checkpoint_problem, verified_checkpoint

    if spec in (None, "", "base"):
        return None
    if spec == "latest":
        return verified_checkpoint(output_dir)
    path = Path(spec)
    if (path / TRAINABLE_FILE).is_file():
        problem = checkpoint_problem(path)
        if problem is not None:
            raise CheckpointError(f"checkpoint {path} fails verification: {problem}")
        return path
    if path.is_dir():
        found = verified_checkpoint(path)
        if found is not None:
            return found
    raise ConfigError(
        f"checkpoint {spec!r}: neither a checkpoint folder (with trainable.safetensors) nor a run directory "
        "with checkpoints/"
    )


def load_weights(policy: Any, checkpoint: Path) -> None:
    """Load the trainable weights saved in `checkpoint` (``trainable.safetensors``, checked against the
    checkpoint's manifest; safetensors, no unpickling) into `policy`; when the run kept an evaluation EMA
    (``algorithm.eval_ema``, a forward-process objective) its EMA weights instead, as `final/` holds them. A file that fails, cannot be read or
    holds NaN / inf is a `CheckpointError` naming it."""
    from safetensors.torch import load_file

    from mmalign.policies.forward_process import checkpoint_ema_weights
    from mmalign.training.rundir import TRAINABLE_FILE, TRAINER_STATE_FILE, checkpoint_problem

    file = Path(checkpoint) / TRAINABLE_FILE
    if not file.is_file():
        raise ConfigError(f"checkpoint {checkpoint}: no trainable.safetensors in it")
    has_state = (Path(checkpoint) / TRAINER_STATE_FILE).is_file()
    problem = checkpoint_problem(
        checkpoint, only=(TRAINABLE_FILE, TRAINER_STATE_FILE) if has_state else (TRAINABLE_FILE,)
    )
    if problem is not None:
        raise CheckpointError(f"checkpoint {checkpoint} fails verification: {problem}")
    try:
        weights = load_file(str(file))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"{file}: unreadable ({type(e).__name__}: {e})") from None
    # a forward-process run's evaluation EMA (algorithm.eval_ema)
    ema = checkpoint_ema_weights(checkpoint) if has_state else None
    if ema is not None:
        log.info("checkpoint %s: evaluating its EMA weights (algorithm.eval_ema)", checkpoint)
        weights = ema
    bad = [k for k, v in weights.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise CheckpointError(f"{file}: the weights hold NaN/inf ({', '.join(bad[:3])})")
    try:
        policy.load_trainable_state_dict(weights)
    except ValueError as e:  # the weights of another model (or another LoRA setup)
        raise ConfigError(f"checkpoint {checkpoint}: {e}") from None


CHUNK_SEED_STRIDE = 1_000_003
"""`chunk_seed(seed, c)` = ``seed + CHUNK_SEED_STRIDE * c``: chunk 0 keeps ``seed`` itself."""


def chunk_seed(seed: int, chunk: int) -> int:
    """The seed of the `chunk`-th chunk of ``prompts_per_batch`` rows (chunk 0: `seed`)."""
    return int(seed) + CHUNK_SEED_STRIDE * int(chunk)


def eval_sampling(policy: Any) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """The sampler `mmalign sample` / `mmalign eval` use, as a context: the policy's ``evaluation_sampler()``
    (a diffusion policy: ``eval_noise_level``, the deterministic ODE by default), yielding its description
    for the report; a policy without one samples as it trains (yields ``{}``)."""
    hook = getattr(policy, "evaluation_sampler", None)
    return hook() if callable(hook) else contextlib.nullcontext({})


def _check_shard(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of {world} processes: need 0 <= rank < world and world >= 1")


@torch.no_grad()
def generate_chunks(
    policy: Any,
    rows: list[dict[str, Any]],
    n: int,
    *,
    seed: int = 0,
    prompts_per_batch: int = 8,
    decode: bool = True,
    progress: bool = True,
    rank: int = 0,
    world: int = 1,
) -> list[tuple[int, Rollout]]:
    """This process's share of `generate`: ``(c, rollout)`` for each chunk ``c`` (rows ``c * prompts_per_batch``
    onwards, ``prompts_per_batch`` of them) with ``c % world == rank``, in chunk order. Chunk ``c`` is seeded
    with `chunk_seed` (seed, c) and its groups are numbered by row (``group = row index``), so a chunk's samples
    are the same whichever process generates it and whatever it generated before."""
    from tqdm.auto import tqdm

    if not rows:
        raise ValueError("nothing to generate: no prompts")
    if prompts_per_batch < 1:
        raise ValueError(
            f"prompts_per_batch must be >= 1 (key 'eval.prompts_per_batch'), got {prompts_per_batch}"
        )
    _check_shard(rank, world)
    model = getattr(policy, "model", None)
    was_training = bool(getattr(model, "training", False))
    if model is not None:
        model.eval()
    parts: list[tuple[int, Rollout]] = []
    try:
        with eval_sampling(policy):
            mine = [c for c in range(math.ceil(len(rows) / prompts_per_batch)) if c % world == rank]
            for c in tqdm(mine, desc="generate", disable=not progress, leave=False):
                start = c * prompts_per_batch
                seed_policy(policy, chunk_seed(seed, c))
                part = policy.rollout(rows[start : start + prompts_per_batch], n, compute_logp=False)
                part.group = part.group + start
                if decode:
                    policy.materialize(part, MEDIA_OUTPUTS)
                parts.append((c, part))
    finally:
        if model is not None and was_training:
            model.train()
    return parts


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
    paints and `decode` is set. Sampling noise is seeded with `seed` (chunk ``c`` of ``prompts_per_batch`` rows
    with `chunk_seed` (seed, c)): the chunks of `generate_chunks` on one process, concatenated."""
    parts = [
        part
        for _, part in generate_chunks(
            policy, rows, n, seed=seed, prompts_per_batch=prompts_per_batch, decode=decode, progress=progress
        )
    ]
    return parts[0] if len(parts) == 1 else Rollout.cat(parts)


def _nanmean(x: Tensor) -> float:
    x = x[~torch.isnan(x)]
    return float(x.mean()) if x.numel() else math.nan


def score_table(
    rollout: Rollout, reward_sets: Sequence[Any], split_column: str | None = None
) -> tuple[list[str], Tensor, list[str] | None]:
    """Every reward set's columns on `rollout`: ``(names, Float[B, K] values, split values or None)`` (the
    split values are ``str`` of the ``split_column`` of each sample)."""
    names: list[str] = []
    cols: list[Tensor] = []
    for rs in reward_sets:
        if rs is None or not len(rs):
            continue
        values = rs(rollout)
        names += list(rs.names)
        cols.append(values.float().cpu())
    table = torch.cat(cols, dim=1) if cols else torch.zeros((len(rollout), 0))
    split: list[str] | None = None
    if split_column is not None:
        if split_column not in rollout.columns:
            raise ConfigError(
                f"key 'eval.split_column': column {split_column!r} is not in the data "
                f"(columns: {sorted(rollout.columns)})"
            )
        split = [str(v) for v in rollout.columns[split_column]]
    return names, table, split


def summarize(names: list[str], table: Tensor, split: list[str] | None = None) -> dict[str, dict[str, float]]:
    """``{"all": {"samples": n, name: mean, ...}, "<split value>": {...}}`` of a `score_table` (NaN left out of
    a mean)."""
    subsets: dict[str, Tensor] = {"all": torch.ones(table.shape[0], dtype=torch.bool)}
    if split is not None:
        for v in sorted(set(split)):
            subsets[v] = torch.tensor([x == v for x in split], dtype=torch.bool)
    out: dict[str, dict[str, float]] = {}
    for sub, mask in subsets.items():
        out[sub] = {"samples": float(mask.sum())}
        for k, name in enumerate(names):
            out[sub][name] = _nanmean(table[mask, k])
    return out


def score(
    rollout: Rollout, reward_sets: Sequence[Any], split_column: str | None = None
) -> dict[str, dict[str, float]]:
    """``{"all": {name: mean, ...}, "<split value>": {...}}`` over the columns of every reward set."""
    return summarize(*score_table(rollout, reward_sets, split_column))


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


def _vanished(checkpoint: Path) -> bool:
    """Whether `checkpoint`, resolved complete, has since been removed (rotated away by a run still training:
    its folder, ``COMPLETE`` mark or weights are gone)."""
    from mmalign.training.rundir import COMPLETE_MARK, TRAINABLE_FILE

    return not all((checkpoint / name).is_file() for name in (COMPLETE_MARK, TRAINABLE_FILE))


def load_trained(policy: Any, checkpoint: Path) -> Path:
    """`load_weights` of `checkpoint` into `policy`, returning the checkpoint loaded. When `checkpoint` (a
    folder of a run's ``checkpoints/``) was removed since it was resolved, as a run still training rotates
    old checkpoints away, the newest checkpoint of that run that verifies is loaded instead, once, with a
    warning. Any other failure, or none to fall back to, raises (`CheckpointError`, `ConfigError`)."""
    from mmalign.training.rundir import CHECKPOINTS_DIR, verified_checkpoint

    checkpoint = Path(checkpoint)
    try:
        load_weights(policy, checkpoint)
        return checkpoint
    except (ConfigError, CheckpointError):
        if checkpoint.parent.name != CHECKPOINTS_DIR or not _vanished(checkpoint):
            raise
    run_dir = checkpoint.parent.parent
    newest = verified_checkpoint(run_dir)
    if newest is None or newest == checkpoint:
        raise CheckpointError(
            f"checkpoint {checkpoint} was removed before its weights were loaded (rotated away by the run still "
            f"training?) and {run_dir} has no other checkpoint that verifies; evaluate again, or pass "
            "--checkpoint with a folder outside checkpoints/"
        )
    log.warning(
        "checkpoint %s was removed before its weights were loaded (rotated away by the run still training?); "
        "evaluating the newest checkpoint that verifies instead: %s",
        checkpoint,
        newest,
    )
    load_weights(policy, newest)
    return newest


def load_agreed(policy: Any, checkpoint: Path, rank: int, world: int) -> Path:
    """`load_trained` of `checkpoint` on this process (rank `rank` of `world`), then the processes compare what they
    loaded (`_agreed_checkpoint`): all go on with the same weights and return that checkpoint, or all raise."""
    used, error = None, None
    try:
        used = load_trained(policy, checkpoint)
    except Exception as e:  # noqa: BLE001 - re-raised by _agreed_checkpoint, after the other processes
        error = e
    return _agreed_checkpoint(used, error, rank, world)


def _agreed_checkpoint(used: Path | None, error: Exception | None, rank: int, world: int) -> Path:
    """The checkpoint every process loaded (`used` here, or `error`): on several processes their outcomes
    are gathered first, so all of them raise, or go on with the same weights."""
    if world == 1:
        if error is not None:
            raise error
        assert used is not None
        return used
    from accelerate.utils import gather_object

    outcomes = gather_object(
        [(rank, None if used is None else str(used), None if error is None else str(error))]
    )
    if error is not None:
        raise error
    failed = [f"process {r}: {e}" for r, _, e in outcomes if e is not None]
    if failed:
        raise CheckpointError(f"loading the checkpoint failed on another process: {failed[0]}")
    loaded = sorted({p for _, p, _ in outcomes if p is not None})
    if len(loaded) > 1:
        raise CheckpointError(
            f"the processes loaded different checkpoints ({', '.join(loaded)}): checkpoints were rotated during "
            "the evaluation; evaluate again, or pass --checkpoint with a folder outside checkpoints/"
        )
    assert used is not None
    return used


def write_report(report: dict[str, Any], path: str | Path) -> Path:
    """Write the report of `evaluate_run` to `path` (JSON, atomically: a kill leaves the old file or this)."""
    from mmalign.training.rundir import write_atomic, writing

    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, json.dumps(report, indent=2) + "\n")


def evaluate_run(
    cfg: Config,
    components: Any,
    *,
    checkpoint: Path | None,
    compare_base: bool = True,
    progress: bool = True,
    rank: int = 0,
    world: int = 1,
    report_path: str | Path | None = None,
) -> dict[str, Any]:
    """Score the base model (if `compare_base` or no checkpoint) and the `checkpoint` on the evaluation
    prompts with the same seeds. `components` must be freshly built (its policy holding the base weights,
    as `mmalign eval` builds them); the checkpoint's weights are loaded into it afterwards (`load_trained`:
    a checkpoint rotated away meanwhile is replaced once by the newest that verifies). Returns ``{"base":
    scores, "trained": scores, "checkpoint": str, ...}`` (``"checkpoint_requested"`` too when it was
    replaced), with ``"sampler"`` (how the samples were drawn, e.g. ``{"sampler": "ode", "num_steps": 10}``)
    for a policy with an evaluation sampler (`eval_sampling`).

    `report_path` (given to one process only): the report is written there after each half (`write_report`);
    when the trained half fails, the file keeps the base half with ``"trained_error"`` saying why, and the
    error is raised.

    In a multi-process launch (`world` processes, this one `rank`; every process calls this) each process
    generates and scores its chunks (`generate_chunks`) and the score tables are gathered in chunk order, so
    every process returns the report one process would write."""
    from rewards import RewardSet

    _check_shard(rank, world)
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
    with eval_sampling(policy) as sampler:
        if sampler:
            report["sampler"] = dict(sampler)

    def run() -> dict[str, dict[str, float]]:
        parts = generate_chunks(
            policy,
            rows,
            e.group_size,
            seed=e.seed,
            prompts_per_batch=e.prompts_per_batch,
            progress=progress and rank == 0,
            rank=rank,
            world=world,
        )
        tables = [(c, *score_table(part, sets, e.split_column)) for c, part in parts]
        if world > 1:
            from accelerate.utils import gather_object

            tables = sorted(gather_object(tables), key=lambda t: t[0])
        names = tables[0][1]
        table = torch.cat([t[2] for t in tables], dim=0)
        split = None if e.split_column is None else [v for t in tables for v in t[3]]
        return summarize(names, table, split)

    if compare_base or checkpoint is None:
        report["base"] = run()
        if report_path is not None:
            write_report(report, report_path)
    if checkpoint is not None:
        try:
            used = load_agreed(policy, checkpoint, rank, world)
            if used != checkpoint:
                report["checkpoint_requested"] = report["checkpoint"]
                report["checkpoint"] = str(used)
            report["trained"] = run()
        except Exception as e:
            if report_path is not None and "base" in report:
                report["trained_error"] = f"{type(e).__name__}: {e}"
                write_report(report, report_path)
                log.error("the trained half of the evaluation failed; the base half is in %s", report_path)
            raise
        if report_path is not None:
            write_report(report, report_path)
    return report


def format_report(report: dict[str, Any]) -> str:
    """A plain-text table: one line per (subset, score), with base, trained and their difference."""
    cols = [c for c in ("base", "trained") if c in report]
    first = report[cols[0]]
    lines = [
        f"{report['prompts']} prompts x {report['samples_per_prompt']} samples, seed {report['seed']}; "
        f"checkpoint: {report.get('checkpoint') or 'none (base model)'}"
    ]
    sampler = report.get("sampler")
    if sampler:  # e.g. "sampler: ode, num_steps 10"
        rest = "".join(f", {k} {v}" for k, v in sampler.items() if k != "sampler")
        lines.append(f"sampler: {sampler.get('sampler')}{rest}")
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
