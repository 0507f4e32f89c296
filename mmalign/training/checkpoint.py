"""A run's checkpoints and final weights, written and read for the trainer.

`save_checkpoint` writes ``checkpoints/step_N/`` (`mmalign.training.rundir` owns the layout, the atomic rename and the
manifest): the trainable weights (safetensors) or the FSDP2 shards, the optimizer and scheduler, each process's
random states, and the trainer's stateful parts (`GroupTrainer.state_parts`: the prompt sampler, the group
filter, an estimator's or a transform's state, ...) and callbacks. `load_checkpoint` reads and checks every file
before restoring anything. `save_final_sharded` writes an FSDP2 run's ``final/``. The functions take the
trainer (`mmalign.training.trainer.GroupTrainer`) whose state they move.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from mmalign.errors import CheckpointError, ConfigError, NonFiniteError, TrainingError
from mmalign.training import distributed as dist_lib
from mmalign.training import rundir
from mmalign.training.seeding import rng_state, set_rng_state

log = logging.getLogger(__name__)

__all__ = ["apply_optimizer_config", "load_checkpoint", "save_checkpoint", "save_final_sharded"]


def save_final_sharded(t: Any, path: Path) -> None:
    """``final/`` of an FSDP2 run: the full weights are gathered on every rank (a collective), then the main
    process writes them with ``save_pretrained(state_dict=...)`` (and the policy's tokenizer or processor),
    the layout `Policy.save` gives a text or VLM policy."""
    model = t.policy.model
    full = dist_lib.gather_full_state_dict(model)
    if not t.is_main:
        return
    if not hasattr(model, "save_pretrained"):
        raise TrainingError(
            f"cannot write {path}: {type(model).__name__} has no save_pretrained (FSDP2 runs save the gathered "
            "weights with it)"
        )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, state_dict=full)
    extras = [getattr(t.policy, a, None) for a in ("tokenizer", "processor")]
    extras = [e for e in extras if e is not None and hasattr(e, "save_pretrained")]
    for extra in extras:
        extra.save_pretrained(path)
    if not extras:
        log.warning(
            "FSDP2 run: %s holds the trained %s only (save_pretrained of the gathered weights), not the "
            "layout of %s.save",
            path,
            type(model).__name__,
            type(t.policy).__name__,
        )


def save_checkpoint(t: Any) -> Path:
    """Write `checkpoints/step_N/` atomically (a temp folder renamed when complete) with its manifest. The
    state files hold plain values and tensors only (`rundir.save_state`); weights holding NaN / inf are not
    written (`NonFiniteError`). An I/O error removes the temp folder and raises `RunWriteError`."""
    tmp = rundir.pending_checkpoint_dir(t.out, t.step)
    try:
        return _write_checkpoint(t, tmp)
    except BaseException:
        if t.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space a full disk needs
        raise


def _write_checkpoint(t: Any, tmp: Path) -> Path:
    from safetensors.torch import save_file

    if t.is_main:
        with rundir.writing(tmp):
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
    t.accelerator.wait_for_everyone()
    rng = {
        "rng": rng_state(),
        "shuffle_gen": t.shuffle_gen.get_state(),
        "policy": t.policy.rng_state(),
    }
    if t.rounds.source is not None:  # nothing is in flight at a checkpoint (`AsyncRounds.prefetch`)
        if t.rounds.source.in_flight():
            raise TrainingError(f"{t.rounds.source.in_flight()} rollout job(s) in flight at a checkpoint")
        rng["async_workers"] = list(t.rounds.source.last_rng)
    elif t.async_rngs is not None:
        rng["async_workers"] = list(t.async_rngs)
    rundir.save_state(rng, tmp / rundir.rng_file(t.rank))
    if t.sharded:  # every rank writes its shards of the weights and optimizer state (DCP)
        with rundir.writing(tmp / dist_lib.SHARDED_DIR):
            dist_lib.save_sharded(tmp / dist_lib.SHARDED_DIR, t.policy.model, t.optimizer)
    if t.is_main:
        if not t.sharded:
            state = t.policy.trainable_state_dict()
            bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
            if bad:
                raise NonFiniteError(
                    f"the weights after step {t.step} hold NaN/inf ({', '.join(bad[:3])}"
                    f"{' ...' if len(bad) > 3 else ''}); checkpoint {rundir.step_name(t.step)} not written"
                )
            with rundir.writing(tmp / rundir.TRAINABLE_FILE):
                save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / rundir.TRAINABLE_FILE))
            rundir.save_state(t.optimizer.state_dict(), tmp / rundir.OPTIMIZER_FILE)
        rundir.save_state(t.scheduler.state_dict(), tmp / rundir.SCHEDULER_FILE)
        rundir.save_state(
            {
                "step": t.step,
                **{
                    name: None if part is None else part.state_dict()
                    for name, part in t.state_parts().items()
                },
                "callbacks": [cb.state_dict() if hasattr(cb, "state_dict") else None for cb in t.callbacks],
                "world_size": t.world,
                "nan_reward_run": dict(t.nan_reward_run),
            },
            tmp / rundir.TRAINER_STATE_FILE,
        )
    t.accelerator.wait_for_everyone()
    final = rundir.checkpoint_dir(t.out, t.step)
    if t.is_main:  # the manifest (every rank's files), the COMPLETE mark, the rename
        rundir.finish_checkpoint(t.out, t.step, keep=t.cfg.trainer.keep_checkpoints)
    t.accelerator.wait_for_everyone()
    return final


def load_checkpoint(t: Any, path: Path) -> None:
    """Restore the run from the checkpoint folder `path`. Every file is read (``weights_only`` loads, no
    unpickling) and checked before anything is restored: an unreadable file, or weights holding NaN / inf,
    raise `CheckpointError` naming the file and leave the trainer as it was. A checkpoint of another
    number of processes, or of another sharding, is a `ConfigError`. (Callers check the manifest first:
    `rundir.verified_checkpoint`.)"""
    from safetensors.torch import load_file

    legacy = not (path / rundir.MANIFEST_FILE).is_file()  # written before manifests and tagged state
    state = rundir.load_state(path / rundir.TRAINER_STATE_FILE, legacy=legacy)
    if state["world_size"] != t.world:
        raise ConfigError(
            f"checkpoint {path} was written by {state['world_size']} process(es); resume with the same number "
            f"(now {t.world})"
        )
    sharded = (path / dist_lib.SHARDED_DIR).is_dir()
    if sharded != t.sharded:
        raise ConfigError(
            f"checkpoint {path} was written by a {'sharded (FSDP2)' if sharded else 'non-sharded'} run; resume "
            f"it with the model {'sharded' if sharded else 'not sharded'} (this run's is "
            f"{'sharded' if t.sharded else 'not'})"
        )
    rng = rundir.load_state(path / rundir.rng_file(t.rank), legacy=legacy)
    scheduler = rundir.load_state(path / rundir.SCHEDULER_FILE, legacy=legacy)
    if not sharded:
        file = path / rundir.TRAINABLE_FILE
        try:
            weights = load_file(str(file))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"{file}: unreadable ({type(e).__name__}: {e})") from None
        bad = [k for k, v in weights.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:
            raise CheckpointError(f"{file}: the weights hold NaN/inf ({', '.join(bad[:3])})")
        optimizer = rundir.load_state(path / rundir.OPTIMIZER_FILE, legacy=legacy)
    # everything is read: restore
    if sharded:  # every rank reads its shards
        dist_lib.load_sharded(path / dist_lib.SHARDED_DIR, t.policy.model, t.optimizer)
    else:
        t.policy.load_trainable_state_dict(weights)
        t.optimizer.load_state_dict(optimizer)
    t.scheduler.load_state_dict(scheduler)
    t.step = state["step"]
    t.nan_reward_run = dict(state.get("nan_reward_run", {}))
    for name, part in t.state_parts().items():
        if part is not None and state.get(name) is not None:
            part.load_state_dict(state[name])
    for cb, s in zip(t.callbacks, state["callbacks"], strict=False):
        if s is not None and hasattr(cb, "load_state_dict"):
            cb.load_state_dict(s)
    set_rng_state(rng["rng"])
    t.shuffle_gen.set_state(rng["shuffle_gen"])
    t.policy.load_rng_state(rng.get("policy", {}))
    # an asynchronous run's rollout workers continue their random streams (None: a synchronous run's
    # checkpoint; the workers start from this process's restored state)
    t.async_rngs = rng.get("async_workers")
    apply_optimizer_config(t)


def apply_optimizer_config(t: Any) -> None:
    """After a checkpoint is loaded: the optimizer's and the LR schedule's hyperparameters from the config
    (their state_dicts restored the values the run was saved with). Every param group's ``initial_lr``,
    ``weight_decay``, ``betas``, ``eps``, the scheduler's ``base_lrs`` = ``trainer.lr``, and the current
    ``lr`` = ``trainer.lr`` x the schedule (`GroupTrainer.lr_factor`) at the current step, as ``LambdaLR`` computes it.
    With the saved config every value is the one restored (the resume stays exact); with a changed
    ``trainer.lr``, schedule, ``trainer.steps`` or AdamW setting the run trains with the new one."""
    c = t.cfg.trainer
    groups = t.optimizer.param_groups
    for group in groups:
        group["initial_lr"] = c.lr
        group["weight_decay"] = c.weight_decay
        group["betas"] = tuple(c.betas)
        group["eps"] = c.adam_eps
    t.scheduler.base_lrs = [c.lr for _ in groups]
    factor = t.lr_factor(t.scheduler.last_epoch)
    for group in groups:
        group["lr"] = c.lr * factor
    t.scheduler._last_lr = [group["lr"] for group in groups]  # (what get_last_lr returns)
