"""Resuming with a changed config: which keys a resume may change (`RESUME_APPLIES`) and the comparison of a
config with a run's saved ``config.yaml`` (`resume_changes`)."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mmalign.config import Config, yaml_key
from mmalign.errors import ConfigError
from mmalign.training import rundir

log = logging.getLogger(__name__)

__all__ = ["ABSENT", "RESUME_APPLIES", "ConfigChange", "config_changes", "resume_changes", "resume_rule"]

_OPTIMIZER = "set in the optimizer's param groups after the checkpoint is loaded"
_SCHEDULE = "the learning-rate schedule, recomputed at the current step after the checkpoint is loaded"
_TRACKERS = "the experiment trackers (built from the config)"
_MEMORY = "memory and speed only (the model is built with it)"
_WRITES = "what the run writes from now on"

RESUME_APPLIES: dict[str, str] = {
    "trainer.steps": "the run trains up to the new step count (and the schedule's length)",
    "trainer.lr": "the learning rate: the optimizer's param groups (lr, initial_lr) and the scheduler's base_lrs, "
    "set after the checkpoint is loaded",
    "trainer.lr_scheduler": _SCHEDULE,
    "trainer.warmup_steps": _SCHEDULE,
    "trainer.weight_decay": _OPTIMIZER,
    "trainer.betas": _OPTIMIZER,
    "trainer.adam_eps": _OPTIMIZER,
    "trainer.max_grad_norm": "gradient clipping, from the next optimizer step",
    "trainer.microbatch_size": "memory only: gradients still accumulate over the same minibatch",
    "trainer.log_every": _WRITES,
    "trainer.sample_every": _WRITES,
    "trainer.save_every": _WRITES,
    "trainer.keep_checkpoints": _WRITES,
    "trainer.progress_bar": "the progress bar",
    "trainer.nan_reward_steps": "the NaN-reward stop, from now on",
    "trainer.dist_timeout_s": "the process group's timeout and the heartbeat monitor",
    "trainer.log_with": _TRACKERS,
    "trainer.tracker_project": _TRACKERS,
    "trainer.tracker_kwargs": _TRACKERS,
    "trainer.tracker_media": _TRACKERS,
    "model.gradient_checkpointing": _MEMORY,
    "model.logprob_chunk_size": _MEMORY,
    "model.logprob_memory_mb": _MEMORY,
    "eval": "evaluation and the over-optimisation watchdog (no training state depends on them)",
    "output_dir": "where the run directory is now (it was moved)",
    "overwrite": "nothing (a resume never removes the run)",
}
"""The config keys ``--resume`` may change, each with how the change takes effect: the one list of them (a key
names itself and every key under it: ``eval`` covers ``eval.group_size``). A resume compares the config it is
given with the run's saved ``config.yaml`` (`resume_changes`): a changed key listed here is applied and reported;
a change of any other key (the model, LoRA, the data, the rewards, the group size, the algorithm, the seed,
...) is refused before the checkpoint is loaded, because the checkpoint's weights, optimizer and sampler state
were made under the saved value. The optimizer's hyperparameters and the LR schedule are always set from the
config after a checkpoint is loaded (`GroupTrainer.load_checkpoint`), so an unchanged config resumes exactly."""


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


ABSENT: Any = _Absent()
"""`ConfigChange.old` of a key the saved config does not have (or `new` of one the current config lacks)."""


def resume_rule(key: str) -> str | None:
    """How a change of config key `key` (dotted, ``rewards[0].weight``) takes effect on a resume
    (`RESUME_APPLIES`); None when a resume cannot change it."""
    for prefix, how in RESUME_APPLIES.items():
        if key == prefix or key.startswith((prefix + ".", prefix + "[")):
            return how
    return None


@dataclass(frozen=True)
class ConfigChange:
    """A config key whose value differs between a run's saved ``config.yaml`` and the config it resumes with."""

    key: str
    """Dotted, as in an override (``trainer.lr``, ``rewards[0].weight``)."""
    old: Any
    """The saved value (`ABSENT` when the saved config has no such key)."""
    new: Any

    @property
    def how(self) -> str | None:
        """How the change takes effect (`resume_rule`); None: a resume cannot change this key."""
        return resume_rule(self.key)

    def describe(self) -> str:
        """``trainer.lr: 0.0003 -> 0.003``."""
        return f"{self.key}: {_shown(self.old)} -> {_shown(self.new)}"


def _shown(value: Any) -> str:
    text = repr(value) if value is ABSENT else json.dumps(value)
    return text if len(text) <= 80 else text[:70] + " ... " + text[-5:]


def config_changes(saved: dict[str, Any], cfg: Config) -> list[ConfigChange]:
    """Every key whose value differs between `saved` (a run's ``config.yaml``, as read) and `cfg`, compared as
    ``config.yaml`` stores them. A key the saved config lacks (written by an older mmalign) counts as a change
    only when `cfg` does not hold its default; a saved key the schema no longer has is ignored."""
    new = yaml.safe_load(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    out: list[ConfigChange] = []
    _diff_section(cfg, saved, new, "", out)
    return out


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return ABSENT


def _diff_section(
    obj: Any, old: dict[str, Any], new: dict[str, Any], prefix: str, out: list[ConfigChange]
) -> None:
    """The changed keys of one config section (a dataclass `obj`, its plain values `new`, the saved `old`)."""
    for f in dataclasses.fields(obj):
        if not f.compare:  # (Config.source: where the config was read from)
            continue
        name = yaml_key(f)
        key = f"{prefix}{name}"
        value = getattr(obj, f.name)
        before = old.get(name, ABSENT)
        after = new.get(name)
        default = _field_default(f)
        if dataclasses.is_dataclass(value) and (
            isinstance(before, dict) or (before is ABSENT and dataclasses.is_dataclass(default))
        ):
            _diff_section(value, before if isinstance(before, dict) else {}, after, key + ".", out)
        elif (
            isinstance(value, list)
            and value
            and all(dataclasses.is_dataclass(v) for v in value)
            and isinstance(before, list)
            and len(before) == len(value)
            and all(isinstance(b, dict) for b in before)
        ):
            for i, (v, b, a) in enumerate(zip(value, before, after, strict=True)):
                _diff_section(v, b, a, f"{key}[{i}].", out)
        elif before is ABSENT:
            if default is ABSENT or after != yaml.safe_load(yaml.safe_dump(default)):
                out.append(ConfigChange(key, ABSENT, after))
        elif before != after:
            out.append(ConfigChange(key, before, after))


def resume_changes(output_dir: str | Path, cfg: Config) -> list[ConfigChange]:
    """The changes of `cfg` against the run's saved ``config.yaml`` that a resume applies (`RESUME_APPLIES`);
    any other change is a `ConfigError` naming each such key with both values. [] when the run has no
    readable ``config.yaml`` (nothing to compare with; logged)."""
    path = Path(output_dir) / rundir.CONFIG_FILE
    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        log.warning("--resume: cannot compare the config with %s (%s): changed keys are not checked", path, e)
        return []
    if not isinstance(saved, dict):
        log.warning("--resume: %s is not a mapping: changed keys are not checked", path)
        return []
    changes = config_changes(saved, cfg)
    refused = [c for c in changes if c.how is None]
    if refused:
        one = len(refused) == 1
        raise ConfigError(
            f"--resume: {'; '.join(c.describe() for c in refused)} (the run's {path} -> now): "
            f"{'this key' if one else 'these keys'} cannot change when a run is resumed (its checkpoint was "
            f"trained with the saved {'value' if one else 'values'}). Set {'it' if one else 'them'} back, or "
            "start a new run (another output_dir=..., or overwrite=true). A resume may change the learning rate "
            "and its schedule, gradient clipping, trainer.steps, the logging and saving intervals and a few more "
            "(mmalign.training.resume.RESUME_APPLIES)"
        )
    return changes
