"""A trainer-like parent for tests/training/test_async_orphan.py: starts a rollout worker the way the trainer does
for ``trainer.async.backend: process`` (`mmalign.training.asynchronous.ProcessWorker`, forked), prints the worker's pid,
then blocks until it is killed.

``--busy``: the worker is in the middle of a job (a rollout that never ends) when the parent dies.
``--no-pdeathsig``: the worker gets no parent-death signal from the kernel, so only the portable fallback (its
thread polling ``os.getppid()``) can end it.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import mmalign.training.asynchronous as asynchronous


class EndlessPolicy:
    """A policy whose rollout never returns; it sets `started` (a file) when it began."""

    def __init__(self, started: str) -> None:
        self.started = started

    def on_train_step(self, step: int) -> None:
        pass

    def rollout(self, rows: list[dict[str, Any]], group_size: int, compute_logp: bool = True) -> Any:
        with open(self.started, "w") as f:
            f.write("sampling\n")
        while True:
            time.sleep(60)


def main() -> None:
    if "--no-pdeathsig" in sys.argv:
        asynchronous._set_parent_death_signal = lambda: False  # type: ignore[attr-defined]
    started = sys.argv[1]
    worker = asynchronous.ProcessWorker(EndlessPolicy(started), version=0, on_result=lambda msg: None)
    if "--busy" in sys.argv:
        worker.submit(asynchronous.RolloutJob(key=(0, 0), indices=[0], rows=[{}], group_size=1, version=0))
    else:
        with open(started, "w") as f:
            f.write("idle\n")
    print(worker.pid, flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
