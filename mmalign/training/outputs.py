"""What a run writes besides checkpoints, for the trainer: the output directory's set-up (run lock, resume,
overwrite, ``config.yaml``), each step's samples, the reward metrics and the NaN-reward stop, and the message
that ends a failed run (what is kept, where to continue). The functions take the trainer
(`mmalign.training.trainer.GroupTrainer`)."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from collections import defaultdict
from typing import Any

import torch
import yaml
from torch import Tensor
from tqdm.auto import tqdm

from mmalign.algorithms import advantages as adv_lib
from mmalign.algorithms import filters as filter_lib
from mmalign.data.batch import Rollout
from mmalign.data.rows import DataError
from mmalign.errors import ConfigError, NonFiniteError, RunWriteError, TrainingError
from mmalign.training import rundir, runlock
from mmalign.training.resume import resume_changes

log = logging.getLogger(__name__)

__all__ = [
    "check_nan_rewards",
    "dump_samples",
    "mean_over_processes",
    "nonfinite_weights",
    "per_sample",
    "prepare_output_dir",
    "reward_metrics",
    "stop_error",
    "take_run_lock",
]


def prepare_output_dir(t: Any, resume: bool) -> None:
    """Take the run lock (`mmalign.training.runlock`; the main process), check the output directory, then, resuming:
    refuse a config change a resume cannot apply (`resume_changes`, before anything is loaded), load the
    newest checkpoint that verifies and drop the metrics of later steps; with ``overwrite``: remove the
    previous run, saying what (a warning). Then write ``config.yaml``. A failure releases the lock.

    Every process checks the output directory (`rundir.check_output_dir`) inside `take_run_lock`, before the
    processes meet there: after it, the main process writes and removes files in the folder, which another
    process checking it then could take for a folder of other files."""
    try:
        take_run_lock(t, resume)
        _set_up_output_dir(t, resume)
    except BaseException:
        t.release_run_lock()
        raise


def _set_up_output_dir(t: Any, resume: bool) -> None:
    # (the output directory was checked in take_run_lock, as the CLI checked it before building the model)
    if resume:
        changes = resume_changes(t.out, t.cfg)
        # the newest checkpoint whose files match its manifest and load; the ones skipped are logged
        ckpt = rundir.verified_checkpoint(t.out, load=t.load_checkpoint)
        assert ckpt is not None
        t.resumed_from, t.config_changes = ckpt, changes
        log.info("resuming from step %d (checkpoint %s)", t.step, ckpt)
        for change in changes:
            log.info("resume: %s (applied: %s)", change.describe(), change.how)
        if t.is_main:  # drop metrics of steps after the checkpoint (and a torn last line)
            rundir.truncate_metrics(t.out, t.step)
    elif t.is_main and t.cfg.overwrite:
        _clear_previous_run(t)
    if t.is_main:
        with rundir.writing(t.out):
            t.out.mkdir(parents=True, exist_ok=True)
        resolved = yaml.safe_dump(t.cfg.to_dict(), sort_keys=False)
        rundir.write_atomic(t.out / rundir.CONFIG_FILE, rundir.CONFIG_HEADER + resolved)
    t.accelerator.wait_for_everyone()


def _clear_previous_run(t: Any) -> None:
    """``overwrite=true``: remove what the previous run in the output directory wrote (`rundir.clear_run`),
    with a warning that names it."""
    found = []
    for name in rundir.RUN_OUTPUTS:
        path = t.out / name
        if not path.exists():
            continue
        if name == rundir.METRICS_FILE:
            with contextlib.suppress(OSError), path.open("rb") as f:
                name += f" ({sum(1 for line in f if line.strip())} rows)"
        elif name == rundir.CHECKPOINTS_DIR:
            done = [c.name for c in rundir.checkpoints(t.out)]
            name += f"/ ({', '.join(done) if done else 'no complete checkpoint'})"
        elif path.is_dir():
            name += "/"
        found.append(name)
    if found:
        log.warning("overwrite=true: removing the previous run in %s: %s", t.out, ", ".join(found))
    rundir.clear_run(t.out)


def take_run_lock(t: Any, resume: bool | None = None) -> None:
    """The main process takes the run lock (`mmalign.training.runlock.acquire`, re-entrant: `mmalign train` took it
    before the model loaded) unless it holds it; with `resume` given, every process then checks the output
    directory (`mmalign.training.rundir.check_output_dir`). The processes meet here (a gather), and the first
    problem any of them found is raised on every process: a `RunLockedError`, or the `ConfigError` of the check."""
    problem: tuple[str, str] | None = None
    if t.is_main and t.run_lock is None:
        try:
            t.run_lock = runlock.acquire(t.out)
        except runlock.RunLockedError as e:
            problem = ("lock", str(e))
    if problem is None and resume is not None:
        try:
            rundir.check_output_dir(t.cfg, resume)
        except ConfigError as e:
            problem = ("config", str(e))
    if t.world > 1:
        from accelerate.utils import gather_object

        problem = next((p for p in gather_object([problem]) if p is not None), None)  # rank order
    if problem is not None:
        kind, message = problem
        raise runlock.RunLockedError(message) if kind == "lock" else ConfigError(message)


def check_nan_rewards(t: Any, g_rewards: Tensor) -> None:
    """Count, per reward, the consecutive steps in which it is NaN for every sample of the (global) batch;
    stop the run when one reaches ``trainer.nan_reward_steps`` (0: never)."""
    limit = t.cfg.trainer.nan_reward_steps
    values = g_rewards.detach().float().cpu()
    if values.dim() == 1:
        values = values[:, None]
    nan = torch.isnan(values).all(dim=0).tolist() if values.shape[0] else []
    for name, all_nan in zip(t.reward_set.names, nan, strict=False):
        t.nan_reward_run[name] = t.nan_reward_run.get(name, 0) + 1 if all_nan else 0
        run = t.nan_reward_run[name]
        if limit and run >= limit:
            raise TrainingError(
                f"reward {name!r} was NaN for every sample in {run} consecutive steps "
                f"({t.step + 2 - run}..{t.step + 1}): it scores nothing (check its inputs, the dataset "
                f"columns it reads, its log), so the run stops (trainer.nan_reward_steps={limit}; 0 never stops)"
            )


def reward_metrics(t: Any, g_rewards: Tensor, g_group: Tensor, rollout: Rollout) -> dict[str, float]:
    weights = t.reward_set.weights.tolist()
    total = adv_lib.combine_rewards(g_rewards, weights)
    finite = total[~torch.isnan(total)]
    m: dict[str, float] = {
        "reward/mean": float(finite.mean()) if finite.numel() else float("nan"),
        "reward/std": float(finite.std(unbiased=False)) if finite.numel() else float("nan"),
    }
    m.update(t.reward_set.stats(g_rewards))
    m.update(mean_over_processes(t, t.reward_extra))
    _, stds = filter_lib.group_std(total, g_group)
    m["zero_std_frac"] = float((stds == 0).float().mean())
    nan_groups = t.reward_set.nan_groups(g_rewards, g_group)
    m["reward/nan_groups"] = float(len(nan_groups))
    if nan_groups and t.is_main:
        local = {int(g): p for g, p in zip(rollout.group.tolist(), rollout.prompts, strict=True)}
        for name, gid in nan_groups[:5]:
            prompt = local.get(int(gid), "<prompt on another process>")
            msg = (
                f"step {t.step + 1}: reward {name!r} returned NaN (not applicable) for every sample of "
                f"group {gid} (prompt: {prompt[:80]!r}); that reward is left out of these samples' total"
            )
            tqdm.write(f"warning: {msg}", file=sys.stderr)
        if len(nan_groups) > 5:
            tqdm.write(
                f"warning: ... and {len(nan_groups) - 5} more all-NaN (reward, group) pairs",
                file=sys.stderr,
            )
    for name, values in t.policy.rollout_stats(rollout).items():
        m[name] = float(t.gather(values.float().mean().reshape(1)).mean())
    return m


def mean_over_processes(t: Any, values: dict[str, float]) -> dict[str, float]:
    """Each key's mean over the processes that report it (keys may differ between processes)."""
    if t.world == 1:
        return dict(values)
    from accelerate.utils import gather_object

    merged: dict[str, list[float]] = defaultdict(list)
    for part in gather_object([values]):
        for key, value in part.items():
            merged[key].append(float(value))
    return {key: sum(v) / len(v) for key, v in sorted(merged.items())}


def stop_error(t: Any, e: BaseException, step: int, *, after: bool = False) -> TrainingError:
    """The `TrainingError` that ends the run when `e` stops it at `step` (`after`: while writing what the
    step produced): what happened, what is kept, where to continue from. A NaN / inf (in the update, or
    found in the weights when another error stops the run) points at the last checkpoint written before
    it, not at ``--resume`` blindly: a resumed run is exact and meets the same NaN unless the config
    changes."""
    nonfinite = isinstance(e, NonFiniteError)
    if not nonfinite and not isinstance(e, RunWriteError):
        with contextlib.suppress(Exception):  # (local check: no collective in an error path)
            bad = nonfinite_weights(t)
            if bad:
                nonfinite = True
                e = NonFiniteError(
                    f"{e} (the weights hold NaN/inf: {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''})"
                )
    done = rundir.checkpoints(t.out)
    newest = done[-1] if done else None
    finished = step if after else step - 1
    kept = (
        f"metrics of steps 1..{finished} in {t.out / rundir.METRICS_FILE}" if finished else "no step finished"
    )
    head = f"training stopped {'after' if after else 'at'} step {step}: {e}"
    if nonfinite:
        before = [c for c in done if rundir.checkpoint_step(c) < step]
        if not before:
            return NonFiniteError(f"{head}\n  kept: {kept}; no checkpoint written before the NaN")
        good = before[-1]
        newer = [c.name for c in done if rundir.checkpoint_step(c) > rundir.checkpoint_step(good)]
        how = f"remove the newer {', '.join(newer)} first (--resume loads the newest), then " if newer else ""
        return NonFiniteError(
            f"{head}\n  kept: {kept}; the last checkpoint written before the NaN: {good}\n"
            f"  to continue from it, {how}change what made the NaN (e.g. a lower trainer.lr, "
            f"trainer.max_grad_norm) and run with --resume: a resumed run is exact, so unchanged it meets the "
            f"same NaN at step {step}"
        )
    where = f"the last complete checkpoint: {newest}" if newest else "no checkpoint yet"
    if isinstance(e, DataError):  # --resume alone would meet the same row again
        return TrainingError(
            f"{head}\n  kept: {kept}; {where}; fix or remove that row (or set options.on_bad_row: skip), "
            "then continue with --resume"
        )
    return TrainingError(f"{head}\n  kept: {kept}; {where}" + (" (continue with --resume)" if newest else ""))


def dump_samples(t: Any, batch: Rollout) -> None:
    """Write this step's samples into the run directory (`mmalign.training.rundir`): what `Policy.sample_view`
    shows of each sample, its rewards and advantage, and the pipeline's `sample_columns`."""
    from accelerate.utils import gather_object

    if not len(batch):
        return
    shown = t.policy.sample_view(batch)
    views = rundir.store_sample_media(t.out, t.step, shown, rank=t.rank, world=t.world)
    rows = []
    mask = batch.outputs.get("advantage_mask", batch.mask).bool().cpu()  # before loss exclusions
    adv = per_sample(batch.advantages, mask) if batch.advantages is not None else None
    in_loss = batch.mask.bool().cpu().any(dim=1)
    steps = batch.step_rewards.float().cpu() if batch.step_rewards is not None else None
    for i in range(len(batch)):
        row: dict[str, Any] = {
            "group": int(batch.group[i]),
            "prompt": batch.prompts[i],
            "advantage": float(adv[i]) if adv is not None else None,
            "rewards": {n: _num(batch.rewards[i, k]) for k, n in enumerate(batch.reward_names)},
            "num_actions": int(mask[i].sum()),
            "in_loss": bool(in_loss[i]),
            **views[i],
        }
        if steps is not None:  # the weighted process rewards by action position (None: not an action)
            last = int(mask[i].nonzero().max()) + 1 if bool(mask[i].any()) else 0
            row["step_rewards"] = [_num(steps[i, k]) if mask[i, k] else None for k in range(last)]
        for key in t.sample_columns:
            if key in batch.columns:
                row[key] = batch.columns[key][i]
        state = batch.outputs.get("env_state")
        if isinstance(state, list) and len(state) == len(batch) and state[i]:
            row["env_state"] = state[i]  # what a multi-turn environment recorded (views, tool calls)
        rows.append(row)
    t.emit("on_samples", t.step, rows, shown)  # this process's samples
    if t.world > 1:
        rows = gather_object(rows)
    if t.is_main:
        rundir.write_samples(t.out, t.step, rows)


def nonfinite_weights(t: Any) -> list[str]:
    """Names of the trainable parameters (this process's shards) holding NaN or inf."""
    named = getattr(t.policy.model, "named_parameters", None)
    if named is None:
        return []
    bad = []
    with torch.no_grad():
        for name, p in named():
            if p.requires_grad and p.is_floating_point():
                local = p.to_local() if hasattr(p, "to_local") else p
                if not bool(torch.isfinite(local).all()):
                    bad.append(name)
    return bad


def per_sample(adv: Tensor, mask: Tensor) -> Tensor:
    """Float[B]: the advantage of each sample (per-step advantages: their mean over the sample's actions)."""
    if adv.dim() == 1:
        return adv
    m = mask.to(adv.device, adv.dtype)
    return (adv * m).sum(1) / m.sum(1).clamp(min=1)


def _num(x: Tensor) -> float | None:
    v = float(x)
    return None if math.isnan(v) else v
