"""Rollout and reward workers as Ray actors (``trainer.async.backend: ray``; ``pip install "mmalign[ray]"``).

Ray is imported only here, only when the backend is used.

Rollout actors run `mmalign.training.rollout_worker.RolloutWorker`; with ``trainer.async.reward_workers`` reward
actors (`RewardActor`) score each round as soon as it is sampled.

Details: docs/distributed.md, "mmalign.training.ray_workers".
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from mmalign.config import ConfigError
from mmalign.training.rollout_worker import (
    AsyncWorkerError,
    RolloutJob,
    RolloutResult,
    RolloutWorker,
    score_rollout,
)


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


class RewardActor:
    """The body of a reward actor (wrapped by ``ray.remote``): a copy of the reward set that scores sampled
    rounds (`mmalign.training.rollout_worker.score_rollout`)."""

    def __init__(self, reward_set: Any, index: int, threads: int | None) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.reward_set = reward_set
        self.index = index

    def score(self, result: RolloutResult) -> dict[str, Any]:
        """``rewards``, ``reward_metrics``, ``reward_s`` of a rollout actor's result (Ray resolves the
        reference the trainer passed into the result itself)."""
        return score_rollout(self.reward_set, result.rollout)

    def pid(self) -> int:
        return os.getpid()


class RewardActors:
    """The trainer's handle on its reward actors: `score` submits one round's scoring to the next actor
    (round-robin in submission order)."""

    def __init__(self, ray: Any, actors: list[Any], timeout_s: float) -> None:
        self.ray, self.actors, self.timeout_s = ray, actors, timeout_s
        self._next = 0

    def score(self, run_ref: Any) -> tuple[int, Any]:
        """(the actor's index, the reference of its scores) for the rollout call `run_ref`."""
        j = self._next
        self._next = (j + 1) % len(self.actors)
        return j, self.actors[j].score.remote(run_ref)

    def pids(self) -> list[int]:
        return [int(p) for p in self.ray.get([a.pid.remote() for a in self.actors], timeout=self.timeout_s)]

    def close(self) -> None:
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass


class RayWorker:
    """The trainer's handle on one rollout actor (the interface of `mmalign.training.asynchronous.ProcessWorker`); with
    `rewards`, each round it samples is scored by a reward actor before it is reported."""

    def __init__(
        self,
        ray: Any,
        actor: Any,
        index: int,
        on_result: Callable[[Any], None],
        timeout_s: float,
        rewards: RewardActors | None = None,
    ) -> None:
        self.ray, self.actor, self.index = ray, actor, index
        self._on_result = on_result
        self.timeout_s = timeout_s
        self.rewards = rewards
        self.error: str | None = None
        self.scoring: dict[Any, int] = {}
        """The rounds sampled and waiting for their scores: key -> reward actor index."""
        self._calls: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._wait_loop, daemon=True, name=f"mmalign-ray-{index}")
        self._thread.start()

    @property
    def pid(self) -> int:
        return int(self.ray.get(self.actor.pid.remote(), timeout=self.timeout_s))

    def push_weights(self, version: int, state: dict[str, Any]) -> None:
        ref = self.ray.put(state)  # the object store carries the weights to the actor's node
        self._calls.put(("weights", version, self.actor.load_weights.remote(version, ref), None))

    def submit(self, job: RolloutJob) -> None:
        run_ref = self.actor.run.remote(job)
        # the scoring waits in the reward actor for the rollout: the round goes from actor to actor
        scores = self.rewards.score(run_ref) if self.rewards is not None else None
        self._calls.put(("job", job.key, run_ref, scores))

    def _wait_loop(self) -> None:
        ray = self.ray
        while True:
            call = self._calls.get()
            if call is None:
                return
            kind, what, ref, scores = call
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
            if kind != "job":
                continue
            if scores is not None and not self._add_scores(value, *scores):
                if self.error is not None:
                    return
                continue
            self._on_result(("result", value))

    def _add_scores(self, result: RolloutResult, actor: int, ref: Any) -> bool:
        """Wait (at most ``timeout_s``) for reward actor `actor`'s scores of `result` and put them in it; False
        when they did not come (a dead or silent actor sets `error`, the actor's own error is reported)."""
        ray, key = self.ray, result.key
        where = f"reward actor {actor}"
        what = f"step {key[0] + 1} round {key[1]}"
        self.scoring[key] = actor
        try:
            scored = ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.error = (
                f"{where}: scoring {what} did not finish within trainer.async.timeout_s={self.timeout_s:g} s"
            )
            return False
        except ray.exceptions.RayActorError as e:
            self.error = f"{where} died ({type(e).__name__}: {str(e).splitlines()[0]})"
            return False
        except Exception as e:  # noqa: BLE001 - the reward's own error, reported to the trainer
            self._on_result(("error", key, f"{where} failed scoring {what}: {type(e).__name__}: {e}"))
            return False
        finally:
            self.scoring.pop(key, None)
        result.rewards = scored["rewards"]
        result.reward_metrics = scored["reward_metrics"]
        result.reward_s = scored["reward_s"]
        return True

    def problem(self) -> str | None:
        return self.error

    def close(self) -> None:
        self._calls.put(None)
        try:
            self.ray.kill(self.actor)
        except Exception:  # noqa: BLE001 - already gone
            pass


def _init_ray(cfg: Any) -> Any:
    """The ``ray`` module, initialised: connected to ``trainer.async.ray_address`` or a local instance."""
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
    return ray


def _actor_options(resources: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """(``ray.remote`` resource options with one CPU by default, torch threads for the actor)."""
    resources = {"num_cpus": 1, **dict(resources)}
    threads = int(resources["num_cpus"]) if float(resources.get("num_cpus", 0)) >= 1 else 1
    return resources, threads


def start_reward_actors(reward_set: Any, n: int, cfg: Any) -> RewardActors:
    """Start `n` reward actors (``trainer.async.reward_workers``) holding copies of `reward_set`, placed by
    ``trainer.async.reward_resources``; fails within ``timeout_s`` naming the actor that does not come up."""
    ray = _init_ray(cfg)
    resources, threads = _actor_options(cfg.reward_resources)
    remote_cls = ray.remote(max_restarts=0, max_concurrency=1, **resources)(RewardActor)
    rewards_ref = ray.put(reward_set)
    actors = [remote_cls.remote(rewards_ref, j, threads) for j in range(n)]
    handle = RewardActors(ray, actors, float(cfg.timeout_s))
    for j, actor in enumerate(actors):  # up (the reward set unpickled) or a bounded, named failure
        try:
            ray.get(actor.pid.remote(), timeout=float(cfg.timeout_s))
        except Exception as e:
            handle.close()
            raise AsyncWorkerError(
                f"starting reward actor {j} failed (trainer.async.reward_resources={dict(resources)}): "
                f"{type(e).__name__}: {e}"
            ) from e
    return handle


def start_ray_workers(
    policy: Any,
    version: int,
    n: int,
    cfg: Any,
    on_result: Callable[[Any], None],
    reward_set: Any = None,
    reward_actors: RewardActors | None = None,
) -> list[RayWorker]:
    """Start `n` rollout actors holding `policy` at weight `version` (``trainer.async`` = `cfg`), and `reward_set`
    when they score the rewards (``score_in_worker``); with `reward_actors`, every round is scored by one of
    them before it is reported."""
    ray = _init_ray(cfg)
    resources, threads = _actor_options(cfg.worker_resources)
    remote_cls = ray.remote(max_restarts=0, max_concurrency=1, **resources)(RolloutActor)
    policy_ref = ray.put(policy)
    rewards_ref = ray.put(reward_set) if reward_set is not None else None
    workers = []
    for i in range(n):
        actor = remote_cls.remote(policy_ref, version, i, threads, rewards_ref)
        workers.append(RayWorker(ray, actor, i, on_result, float(cfg.timeout_s), rewards=reward_actors))
    for w in workers:  # the actors are up (the policy unpickled) or the start fails here, bounded
        try:
            w.pid  # noqa: B018 - a round trip
        except Exception as e:
            for x in workers:
                x.close()
            raise AsyncWorkerError(f"starting rollout actor {w.index} failed: {type(e).__name__}: {e}") from e
    return workers
