"""Building a `GroupTrainer` for a real run: the trainer with the app's standard monitors.

The core trainer imports no tool; `build_trainer` hands it the live learning diagnostics
(`mmalign.app.doctor.DoctorMonitor`), the experiment trackers of ``trainer.log_with``
(`mmalign.app.trackers.TrackerMonitor`) and, in a multi-process run, the bound on waiting for a peer
(`HeartbeatMonitor`: the process group's timeout and the heartbeat monitor of `mmalign.training.heartbeat`) and, with
``eval.watchdog.every`` > 0, the over-optimisation watchdog (`mmalign.app.overopt.OverOptMonitor`: held-out gold
rewards during training), which `mmalign train` and scripts that want the same run use.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from mmalign.app.doctor import DoctorMonitor
from mmalign.app.overopt import OverOptMonitor, watchdog_monitors
from mmalign.app.trackers import TrackerMonitor
from mmalign.config import Config
from mmalign.training.distributed import launched_processes
from mmalign.training.trainer import GroupTrainer


class HeartbeatMonitor:
    """``trainer.dist_timeout_s`` for a multi-process run: the process group's timeout (every collective gives up
    after it; accelerate's ``InitProcessGroupKwargs``) and, while `GroupTrainer.train` runs, a heartbeat
    heartbeat (`mmalign.training.heartbeat.start_heartbeat`): when a peer has been silent that long (frozen, stopped,
    unreachable), this process reports the silent rank and the last complete checkpoint and exits."""

    def __init__(self, cfg: Config) -> None:
        self.timeout_s = float(cfg.trainer.dist_timeout_s)
        self.output_dir = cfg.output_dir
        self.heartbeat: Any = None

    def accelerator_kwargs(self) -> dict[str, Any]:
        from accelerate.utils import InitProcessGroupKwargs

        return {"kwargs_handlers": [InitProcessGroupKwargs(timeout=timedelta(seconds=self.timeout_s))]}

    def on_train_start(self, trainer: Any, step: int) -> None:
        from mmalign.training.heartbeat import start_heartbeat

        self.on_train_end(trainer)  # a previous train() that did not end its watch
        self.heartbeat = start_heartbeat(
            trainer.rank, trainer.world, self.timeout_s, output_dir=self.output_dir
        )

    def on_train_end(self, trainer: Any) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None


def standard_monitors(cfg: Config, *, resume: bool = False, components: Any = None) -> list[Any]:
    """The trackers of ``trainer.log_with`` (a missing tracker package is a `ConfigError` now), the live
    doctor, when the launcher started several processes (``WORLD_SIZE`` > 1) the `HeartbeatMonitor` and, given
    the pipeline's `components` and ``eval.watchdog.every`` > 0, the over-optimisation watchdog
    (`OverOptMonitor`, last: it samples the held-out rows of `components`)."""
    monitors: list[Any] = [TrackerMonitor(cfg, resume=resume), DoctorMonitor()]
    if launched_processes() > 1:
        monitors.append(HeartbeatMonitor(cfg))
    if components is not None:
        monitors.extend(watchdog_monitors(cfg, components))
    return monitors


def build_trainer(
    cfg: Config,
    components: Any,
    *,
    resume: bool = False,
    accelerator: Any = None,
    monitors: Sequence[Any] = (),
) -> GroupTrainer:
    """`GroupTrainer(cfg, components, ...)` with the `standard_monitors`, then `monitors`, then the
    over-optimisation watchdog (last, so that its ``eval.watchdog.stop`` error is raised after every other
    monitor's ``on_train_end``). An ``Accelerator`` passed in must have been built with
    ``mmalign.app.trackers.accelerator_kwargs(cfg)`` when the config lists trackers."""
    standard = standard_monitors(cfg, resume=resume, components=components)
    last = [m for m in standard if isinstance(m, OverOptMonitor)]
    first = [m for m in standard if not isinstance(m, OverOptMonitor)]
    return GroupTrainer(
        cfg,
        components,
        resume=resume,
        accelerator=accelerator,
        monitors=[*first, *monitors, *last],
    )
