"""Asynchronous rollouts (``trainer.async``): sampling the next steps while the trainer updates.

A rollout worker holds its own copy of the policy (with its rollout engine when it has one) and turns jobs
(step, round, rows, weight version) into rollouts; `GroupTrainer` submits the first round of the next ``K =
max_staleness`` steps before the current update, pushes its weights when they changed, and scores rewards as
rounds arrive. The schedule is a pure function of the step (stale samples are corrected with truncated
importance weights, `behaviour_fields`), checkpoints are barriers holding the worker's random state, and
``K = 0`` reproduces the synchronous run exactly. Backends: ``process`` (`ProcessWorker`, a forked process)
and ``ray`` (`mmalign.training.ray_workers`); a dead or silent worker is an `AsyncWorkerError` within
``trainer.async.timeout_s``. Details: docs/distributed.md, "Asynchronous rollouts"; math: docs/algorithms.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from mmalign.data.batch import Rollout
from mmalign.training.rollout_worker import (
    AsyncWorkerError,
    Key,
    RolloutJob,
    RolloutResult,
    RolloutWorker,
    score_rollout,
)
from mmalign.training.seeding import seeded_worker_rng_state, worker_rng_state


def _send(conn: Any, obj: Any) -> None:
    conn.send(obj)  # multiprocessing's IPC with this process's own fork (tensors via torch's shared memory)


def _recv(conn: Any) -> Any:
    return conn.recv()


ORPHAN_POLL_S = 1.0
"""How often a forked rollout worker checks that its trainer is still its parent (`exit_with_parent`)."""


def _set_parent_death_signal() -> bool:
    """Ask Linux to SIGKILL this process when the thread that forked it ends (``prctl(PR_SET_PDEATHSIG)``);
    False where that is not available (not Linux, no libc symbol)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1  # <linux/prctl.h>
        return libc.prctl(pr_set_pdeathsig, ctypes.c_ulong(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int, interval_s: float) -> None:
    while True:
        time.sleep(interval_s)
        if os.getppid() != parent_pid:  # reparented (to init or a subreaper): the trainer is gone
            os._exit(1)  # nothing to flush: no one is left to read a result


def exit_with_parent(parent_pid: int, interval_s: float = ORPHAN_POLL_S) -> None:
    """Make this forked process end when its trainer `parent_pid` is gone, however the trainer ended (SIGKILL
    and SIGTERM included), even in the middle of a job: on Linux the kernel SIGKILLs it when the trainer
    thread that forked it ends (``PR_SET_PDEATHSIG``); everywhere a daemon thread checks every `interval_s`
    seconds that `parent_pid` is still its parent and ends the process (``os._exit``) otherwise. Called in the
    child right after the fork; ends it at once when the trainer died before."""
    _set_parent_death_signal()
    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(
        target=_watch_parent, args=(parent_pid, interval_s), daemon=True, name="mmalign-orphan-watch"
    ).start()


def _serve(
    worker: RolloutWorker,
    jobs: Any,
    results: Any,
    parent_pid: int | None = None,
    parent_ends: Sequence[Any] = (),
) -> None:
    """The worker process: weights and jobs in order from `jobs`, results (or the traceback) to `results`.

    It ends with its trainer `parent_pid` (`exit_with_parent`), and closes its copies of the trainer's ends of
    the pipes (`parent_ends`), so that `jobs` reads EOF once no trainer holds them. It runs torch with one
    intra-op thread: OpenMP's thread pool does not survive ``fork``, and a forked process that enters a
    parallel region its parent already used waits forever (one thread keeps torch out of OpenMP)."""
    if parent_pid is not None:
        exit_with_parent(parent_pid)
    for conn in parent_ends:
        with contextlib.suppress(OSError):
            conn.close()
    torch.set_num_threads(1)
    free_since = time.perf_counter()
    while True:
        try:
            msg = _recv(jobs)
        except EOFError:
            return
        kind = msg[0]
        if kind == "stop":
            return
        try:
            if kind == "weights":
                worker.load_weights(msg[1], msg[2])
            elif kind == "job":
                idle = time.perf_counter() - free_since
                _send(results, ("result", worker.run(msg[1], idle_s=idle)))
                free_since = time.perf_counter()
        except BaseException as e:  # noqa: BLE001 - reported to the trainer, which raises
            key = msg[1].key if kind == "job" else None
            _send(results, ("error", key, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class ProcessWorker:
    """A rollout worker in a forked process of this machine (Linux / macOS ``fork``). It inherits the policy as
    it is at `start` (so its weight version is the trainer's then); `push_weights` and `submit` queue messages
    that a sender thread writes to it; `on_result` is called in a receiver thread with each result."""

    def __init__(
        self,
        policy: Any,
        version: int,
        on_result: Callable[[Any], None],
        index: int = 0,
        reward_set: Any = None,
    ) -> None:
        ctx = mp.get_context("fork")
        self.index = index
        self._jobs_r, self._jobs_w = ctx.Pipe(duplex=False)
        self._res_r, self._res_w = ctx.Pipe(duplex=False)
        worker = RolloutWorker(policy, version, index, reward_set)
        self.process = ctx.Process(
            target=_serve,
            args=(worker, self._jobs_r, self._res_w, os.getpid(), (self._jobs_w, self._res_r)),
            daemon=True,
            name=f"mmalign-rollout-{index}",
        )
        self.process.start()
        self._outbox: queue.Queue[Any] = queue.Queue()
        self._on_result = on_result
        self.error: str | None = None
        self._sender = threading.Thread(target=self._send_loop, daemon=True, name="mmalign-async-send")
        self._receiver = threading.Thread(target=self._recv_loop, daemon=True, name="mmalign-async-recv")
        self._sender.start()
        self._receiver.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                _send(self._jobs_w, msg)
            except (OSError, ValueError) as e:
                self.error = f"sending to the worker failed ({type(e).__name__}: {e})"
                return
            if msg[0] == "stop":
                return

    def _recv_loop(self) -> None:
        while True:
            try:
                msg = _recv(self._res_r)
            except (EOFError, OSError):
                return
            self._on_result(msg)

    def push_weights(self, version: int, state: dict[str, Tensor]) -> None:
        self._outbox.put(("weights", version, state))

    def submit(self, job: RolloutJob) -> None:
        self._outbox.put(("job", job))

    def problem(self) -> str | None:
        """Why the worker cannot answer (None: it is alive)."""
        if self.error is not None:
            return self.error
        if not self.process.is_alive():
            return f"the rollout worker process (pid {self.process.pid}) died with exit code {self.process.exitcode}"
        return None

    def close(self) -> None:
        self._outbox.put(("stop",))
        self._outbox.put(None)
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        for conn in (self._jobs_w, self._res_r, self._jobs_r, self._res_w):
            with contextlib.suppress(OSError):
                conn.close()


# ----------------------------------------------------------------------------- the trainer's side


class AsyncRollouts:
    """The trainer's handle on its rollout workers: submits jobs (pushing weights first when the worker's are
    older), scores each result's rewards as it arrives, and hands results back in key order (`take`), failing
    with `AsyncWorkerError` when a worker dies or does not answer within ``timeout_s``.

    ``worker_rngs``: each worker's random state to start from (None: worker 0 continues this process's
    generators as they are at construction; workers i > 0 are seeded from ``seed`` and i)."""

    def __init__(
        self,
        policy: Any,
        reward_set: Any,
        cfg: Any,
        *,
        version: int,
        seed: int = 0,
        worker_rngs: Sequence[dict[str, Any] | None] | None = None,
    ) -> None:
        self.policy = policy
        self.reward_set = reward_set
        self.cfg = cfg
        self.timeout_s = float(cfg.timeout_s)
        self._cond = threading.Condition()
        self._reward_lock = threading.Lock()
        self._results: dict[Key, Any] = {}
        self._pending: dict[Key, RolloutJob] = {}
        self._assigned: dict[Key, int] = {}
        self._next_worker = 0
        n = int(cfg.num_workers)
        rngs = list(worker_rngs) if worker_rngs is not None else [None] * n
        if len(rngs) != n:
            raise AsyncWorkerError(
                f"the checkpoint holds the random state of {len(rngs)} rollout worker(s); this run has {n} "
                "(trainer.async.num_workers must match to resume)"
            )
        self._start_rng: list[dict[str, Any] | None] = []
        for i, r in enumerate(rngs):
            if r is None:
                r = (
                    worker_rng_state(policy)
                    if i == 0
                    else seeded_worker_rng_state(policy, seed * 1_000_003 + 7919 * i)
                )
            self._start_rng.append(r)
        self.last_rng: list[dict[str, Any]] = [r for r in self._start_rng if r is not None]
        """Each worker's random state after the last result taken (what a checkpoint stores)."""
        self.versions = [version] * n
        self.reward_actors: Any = None
        """The reward actors (`mmalign.training.ray_workers.RewardActors`) with ``reward_workers > 0``, else None."""
        self.workers = self._start(policy, version, n)

    def _start(self, policy: Any, version: int, n: int) -> list[Any]:
        rewards = self.reward_set if self.cfg.score_in_worker else None
        if self.cfg.backend == "ray":
            from mmalign.training.ray_workers import start_ray_workers, start_reward_actors

            if getattr(self.cfg, "reward_workers", 0):
                self.reward_actors = start_reward_actors(
                    self.reward_set, int(self.cfg.reward_workers), self.cfg
                )
            try:
                return start_ray_workers(
                    policy,
                    version,
                    n,
                    self.cfg,
                    self._arrived,
                    reward_set=rewards,
                    reward_actors=self.reward_actors,
                )
            except BaseException:
                if self.reward_actors is not None:
                    self.reward_actors.close()
                raise
        return [ProcessWorker(policy, version, self._arrived, index=0, reward_set=rewards)]

    # -------------------------------------------------------------- results arriving (background thread)
    def _arrived(self, msg: Any) -> None:
        """A worker's message: score a result's rewards now (not after the whole batch), then publish it."""
        if msg[0] == "error":
            key, text = msg[1], msg[2]
            with self._cond:
                self._results[key if key is not None else ("error", 0)] = AsyncWorkerError(
                    f"the rollout worker failed{'' if key is None else f' on step {key[0] + 1} round {key[1]}'}:\n"
                    f"{text}"
                )
                self._cond.notify_all()
            return
        result: RolloutResult = msg[1]
        if result.rewards is not None:  # scored by the worker
            with self._cond:
                self._results[result.key] = result
                self._cond.notify_all()
            return
        try:
            with self._reward_lock:  # several workers' threads may deliver at once
                scored = score_rollout(self.reward_set, result.rollout)
            result.rewards = scored["rewards"]
            result.reward_metrics = scored["reward_metrics"]
            result.reward_s = scored["reward_s"]
            item: Any = result
        except Exception as e:  # noqa: BLE001 - raised in the trainer's thread by `take`
            item = e
        with self._cond:
            self._results[result.key] = item
            self._cond.notify_all()

    # -------------------------------------------------------------- the trainer's thread
    def has(self, key: Key) -> bool:
        return key in self._pending

    def indices(self, key: Key) -> list[int]:
        return self._pending[key].indices

    def in_flight(self) -> int:
        return len(self._pending)

    def submit(
        self,
        key: Key,
        indices: list[int],
        rows: list[dict[str, Any]],
        group_size: int,
        version: int,
        weights: Callable[[], dict[str, Tensor]],
        needs: Sequence[str] = (),
        rng: dict[str, Any] | None = None,
        compute_logp: bool = True,
    ) -> None:
        """Queue the job `key` on the next worker (round-robin), after pushing `weights()` of `version` to it when
        it holds older ones. `rng`: the random state the worker samples from (None: its own stream);
        `compute_logp`: record the sampled actions' log-probs (always with ``max_staleness > 0``, where a token
        policy takes them from its decode loop)."""
        w = self._next_worker
        self._next_worker = (w + 1) % len(self.workers)
        worker = self.workers[w]
        if self.versions[w] != version:
            worker.push_weights(version, weights())
            self.versions[w] = version
        start, self._start_rng[w] = self._start_rng[w], None
        rng = rng if rng is not None else start
        stale = int(self.cfg.max_staleness) > 0
        job = RolloutJob(
            key,
            list(indices),
            list(rows),
            group_size,
            version,
            tuple(needs),
            rng,
            bool(self.cfg.score_in_worker),
            compute_logp=compute_logp or stale,
            sampled_logp=stale,
        )
        self._pending[key] = job
        self._assigned[key] = w
        worker.submit(job)

    def take(self, key: Key) -> tuple[RolloutResult, float]:
        """The result of job `key` (submitted before) and the seconds this thread waited for it."""
        if key not in self._pending:
            raise AsyncWorkerError(f"no rollout job was submitted for step {key[0] + 1} round {key[1]}")
        w = self._assigned[key]
        t0 = time.perf_counter()
        deadline = t0 + self.timeout_s
        with self._cond:
            while key not in self._results and ("error", 0) not in self._results:
                problem = self.workers[w].problem()
                if problem is not None and key not in self._results:
                    raise AsyncWorkerError(
                        f"{problem} (the trainer waits for step {key[0] + 1} round {key[1]}); the run stops "
                        "(continue with --resume from the last checkpoint)"
                    )
                left = deadline - time.perf_counter()
                if left <= 0:
                    scorer = getattr(self.workers[w], "scoring", {}).get(key)  # sampled, not yet scored
                    raise AsyncWorkerError(
                        (
                            f"reward actor {scorer} gave no rewards"
                            if scorer is not None
                            else f"rollout worker {w} gave no result"
                        )
                        + f" for step {key[0] + 1} round {key[1]} within trainer.async.timeout_s="
                        f"{self.timeout_s:g} s"
                    )
                self._cond.wait(timeout=min(0.25, left))
            item = self._results.pop(key, None) or self._results.pop(("error", 0))
        del self._pending[key], self._assigned[key]
        if isinstance(item, BaseException):
            raise item
        self.last_rng[w] = item.rng
        return item, time.perf_counter() - t0

    def close(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(Exception):
                worker.close()
        if self.reward_actors is not None:
            with contextlib.suppress(Exception):
                self.reward_actors.close()


# ----------------------------------------------------------------------------- what the loss sees


def behaviour_fields(
    rollout: Rollout,
    *,
    staleness: int,
    max_staleness: int,
    need_logp_old: bool,
    current_logprobs: Callable[[Rollout], Tensor],
    recompute: bool = True,
) -> Rollout:
    """Set a worker rollout's ``logp_old`` (pi_old) and ``logp_sampler`` (the behaviour policy) for the loss.

    The worker recorded ``logp_old`` with the weights it sampled with (and, with an engine, the engine's own
    log-probs in ``logp_sampler``); the behaviour log-probs ``mu`` are the engine's when present, else the
    worker's. With ``max_staleness = 0`` the fields are the synchronous trainer's (``logp_old`` kept only when
    the run needs it). Otherwise ``logp_sampler = mu`` and ``logp_old`` is pi_old: with `recompute` (the
    weights change within the update, or sequence-level weights over chunked actions) the worker's log-probs
    when the weights did not change since sampling (``staleness = 0``), else `current_logprobs(rollout)` under
    the trainer's weights; without it ``None``, which the loss reads as the detached log-probs of the update's
    own forward pass, i.e. pi_old itself when the update makes one optimizer step (no extra forward pass). The
    loss then applies the truncated importance weights ``min(exp(logp_old - mu), cap)``
    (`mmalign.algorithms.is_correction.tis_weights`)."""
    if max_staleness == 0:
        if staleness:
            raise AsyncWorkerError(f"a rollout {staleness} step(s) stale with trainer.async.max_staleness=0")
        if not need_logp_old:
            rollout.logp_old = None
        return rollout
    if staleness > max_staleness:  # the schedule never submits this far ahead
        raise AsyncWorkerError(
            f"a rollout {staleness} steps stale exceeds trainer.async.max_staleness={max_staleness}"
        )
    mu = rollout.logp_sampler if rollout.logp_sampler is not None else rollout.logp_old
    assert mu is not None
    rollout.logp_sampler = mu.float().masked_fill(~rollout.mask, 0.0)
    if not recompute:  # pi_old is the update's own first forward (one optimizer step per rollout)
        rollout.logp_old = None
    elif staleness:
        rollout.logp_old = current_logprobs(rollout)
    return rollout
