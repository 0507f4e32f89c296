"""Building a `GroupTrainer` for a real run: the trainer with the app's standard monitors.

The core trainer imports no tool; `build_trainer` hands it the live learning diagnostics
(`mmalign.app.doctor.DoctorMonitor`) and the experiment trackers of ``trainer.log_with``
(`mmalign.app.trackers.TrackerMonitor`), which `mmalign train` and scripts that want the same run use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmalign.app.doctor import DoctorMonitor
from mmalign.app.trackers import TrackerMonitor
from mmalign.config import Config
from mmalign.trainer import GroupTrainer


def standard_monitors(cfg: Config, *, resume: bool = False) -> list[Any]:
    """The trackers of ``trainer.log_with`` (a missing tracker package is a `ConfigError` now) and the live
    doctor."""
    return [TrackerMonitor(cfg, resume=resume), DoctorMonitor()]


def build_trainer(
    cfg: Config,
    components: Any,
    *,
    resume: bool = False,
    accelerator: Any = None,
    monitors: Sequence[Any] = (),
) -> GroupTrainer:
    """`GroupTrainer(cfg, components, ...)` with the `standard_monitors`, then `monitors`. An ``Accelerator``
    passed in must have been built with ``mmalign.app.trackers.accelerator_kwargs(cfg)`` when the config
    lists trackers."""
    return GroupTrainer(
        cfg,
        components,
        resume=resume,
        accelerator=accelerator,
        monitors=[*standard_monitors(cfg, resume=resume), *monitors],
    )
