"""Rollout workers as Ray actors (``trainer.async.backend: ray``; ``pip install "mmalign[ray]"``).

Each actor holds a copy of the policy (sent once through Ray's object store, so it may be built on another node)
and runs `mmalign.asynchronous.RolloutWorker`; ``trainer.async.worker_resources`` (``num_cpus``, ``num_gpus``,
custom resources) places it on its own device or node. Weights go to the actors through the object store
(``ray.put`` once per version, one reference per actor). A background thread per actor waits for its calls in
order, each for at most ``trainer.async.timeout_s``: a failed or timed-out weight sync or rollout, or a dead
actor (``RayActorError``), is reported to the trainer, which stops the step with `AsyncWorkerError` (a dead
actor is noticed within about a second). The trainer group itself is unchanged (accelerate / torch
distributed inside); ``ray.init`` connects to ``trainer.async.ray_address`` or starts a local instance.

Ray is imported only here, only when the backend is used.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from mmalign.asynchronous import AsyncWorkerError, RolloutJob, RolloutWorker
from mmalign.config import ConfigError


def import_ray() -> Any:
    """The ``ray`` module, or a `ConfigError` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "trainer.async.backend 'ray' needs Ray: pip install 'mmalign[ray]' (or pip install 'ray[default]')"
        ) from None
    return ray


class RolloutActor:
    """The body of a rollout actor (wrapped by ``ray.remote``): a `RolloutWorker` on the unpickled policy."""

    def __init__(
        self, policy: Any, version: int, index: int, threads: int | None, reward_set: Any = None
    ) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.worker = RolloutWorker(policy, version, index, reward_set)
        self.free_since = time.perf_counter()

    def load_weights(self, version: int, state: dict[str, Any]) -> int:
        self.worker.load_weights(version, state)
        return version

    def run(self, job: RolloutJob) -> Any:
        idle = time.perf_counter() - self.free_since
        try:
            return self.worker.run(job, idle_s=idle)
        finally:
            self.free_since = time.perf_counter()

    def pid(self) -> int:
        return os.getpid()


class RayWorker:
    """The trainer's handle on one rollout actor (the interface of `mmalign.asynchronous.ProcessWorker`)."""

    def __init__(
        self,
        ray: Any,
        actor: Any,
        index: int,
        on_result: Callable[[Any], None],
        timeout_s: float,
    ) -> None:
        self.ray, self.actor, self.index = ray, actor, index
        self._on_result = on_result
        self.timeout_s = timeout_s
        self.error: str | None = None
        self._calls: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._wait_loop, daemon=True, name=f"mmalign-ray-{index}")
        self._thread.start()

    @property
    def pid(self) -> int:
        return int(self.ray.get(self.actor.pid.remote(), timeout=self.timeout_s))

    def push_weights(self, version: int, state: dict[str, Any]) -> None:
        ref = self.ray.put(state)  # the object store carries the weights to the actor's node
        self._calls.put(("weights", version, self.actor.load_weights.remote(version, ref)))

    def submit(self, job: RolloutJob) -> None:
        self._calls.put(("job", job.key, self.actor.run.remote(job)))

    def _wait_loop(self) -> None:
        ray = self.ray
        while True:
            call = self._calls.get()
            if call is None:
                return
            kind, what, ref = call
            try:
                value = ray.get(ref, timeout=self.timeout_s)
            except ray.exceptions.GetTimeoutError:
                self.error = (
                    f"rollout actor {self.index}: {'weight sync' if kind == 'weights' else 'rollout'} "
                    f"{'to version ' + str(what) if kind == 'weights' else 'of step ' + str(what[0] + 1)} did not "
                    f"finish within trainer.async.timeout_s={self.timeout_s:g} s"
                )
                return
            except ray.exceptions.RayActorError as e:
                self.error = f"rollout actor {self.index} died ({type(e).__name__}: {str(e).splitlines()[0]})"
                return
            except Exception as e:  # noqa: BLE001 - the actor's own error, reported to the trainer
                key = what if kind == "job" else None
                self._on_result(("error", key, f"{type(e).__name__}: {e}"))
                continue
            if kind == "job":
                self._on_result(("result", value))

    def problem(self) -> str | None:
        return self.error

    def close(self) -> None:
        self._calls.put(None)
        try:
            self.ray.kill(self.actor)
        except Exception:  # noqa: BLE001 - already gone
            pass


def start_ray_workers(
    policy: Any,
    version: int,
    n: int,
    cfg: Any,
    on_result: Callable[[Any], None],
    reward_set: Any = None,
) -> list[RayWorker]:
    """Start `n` rollout actors holding `policy` at weight `version` (``trainer.async`` = `cfg`), and `reward_set`
    when they score the rewards (``score_in_worker``)."""
    ray = import_ray()
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {
            "ignore_reinit_error": True,
            "include_dashboard": False,
            "log_to_driver": True,
        }
        if cfg.ray_address:
            kwargs["address"] = cfg.ray_address
        ray.init(**kwargs)
    resources = {"num_cpus": 1, **dict(cfg.worker_resources)}
    threads = int(resources["num_cpus"]) if float(resources.get("num_cpus", 0)) >= 1 else 1
    remote_cls = ray.remote(max_restarts=0, max_concurrency=1, **resources)(RolloutActor)
    policy_ref = ray.put(policy)
    rewards_ref = ray.put(reward_set) if reward_set is not None else None
    workers = []
    for i in range(n):
        actor = remote_cls.remote(policy_ref, version, i, threads, rewards_ref)
        workers.append(RayWorker(ray, actor, i, on_result, float(cfg.timeout_s)))
    for w in workers:  # the actors are up (the policy unpickled) or the start fails here, bounded
        try:
            w.pid  # noqa: B018 - a round trip
        except Exception as e:
            for x in workers:
                x.close()
            raise AsyncWorkerError(f"starting rollout actor {w.index} failed: {type(e).__name__}: {e}") from e
    return workers
