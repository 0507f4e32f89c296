"""Synchronous vs asynchronous rollouts (``trainer.async``): steps per second and reward per sample seen.

Trains the same tiny config twice (or more: ``--repeats``) from the same seed, once synchronously and once with
``trainer.async: {max_staleness: K}`` (the rollout worker in its own process), each side on one thread
(``OMP_NUM_THREADS=1``; the trainer and the worker are two processes, so two cores give true parallelism), and
reports steps per second after ``--warmup`` steps, the reward of every step against the samples seen so far,
and the async run's staleness, importance weights and idle times. Not a test: nothing asserts a timing.

    OMP_NUM_THREADS=1 python benchmarks/bench_async.py --task text --steps 30
    OMP_NUM_THREADS=1 python benchmarks/bench_async.py --task image --steps 20

GPU (a real model, vLLM sampling in a Ray rollout actor on its own GPU, the trainer on the other; not run here):

    CUDA_VISIBLE_DEVICES=0,1 python benchmarks/bench_async.py --config configs/text_reasoning.yaml --steps 50 \
        --set rollout.engine=vllm trainer.cpu=false \
        --async-options 'backend: ray, worker_resources: {num_gpus: 1, num_cpus: 4}'

(the synchronous run then samples with vLLM colocated on the trainer's GPU). Reward actors of their own (Ray):
``--async-options 'backend: ray, reward_workers: 2, reward_resources: {num_cpus: 1}'``.

The async run's worker records the behaviour log-probs from the text policy's decode loop (no scoring pass, fp32
models); ``async/worker_sample_cpu_s`` is the worker's CPU time per step for sampling.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TASKS = {
    "text": "configs/text_reasoning-tiny.yaml",
    "image": "configs/text_to_image-tiny.yaml",
}


class Clock:
    """Monitor: the wall-clock time at the end of every step."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.cpu: list[float] = []
        self.start = 0.0

    def on_train_start(self, trainer: Any, step: int) -> None:
        self.start = time.perf_counter()

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        self.ends.append(time.perf_counter())
        self.cpu.append(time.process_time())  # the trainer's process (the worker's is logged by the trainer)


def run(
    config: str, overrides: list[str], steps: int, staleness: int | None, out: Path, extra: str = ""
) -> dict[str, Any]:
    import pipelines
    from mmalign.config import load_config
    from mmalign.training.trainer import GroupTrainer

    ov = [
        f"output_dir={out}",
        f"trainer.steps={steps}",
        f"trainer.save_every={steps + 1000}",
        f"trainer.sample_every={steps + 1000}",
        "trainer.progress_bar=false",
        *overrides,
    ]
    if staleness is not None:
        ov.append(f"trainer.async={{max_staleness: {staleness}{', ' + extra if extra else ''}}}")
    cfg = load_config(REPO / config, ov)
    clock = Clock()
    trainer = GroupTrainer(cfg, pipelines.get(cfg.pipeline)(cfg), monitors=(clock,))
    hist = trainer.train()
    per_step = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    return {
        "step_end_s": [t - clock.start for t in clock.ends],
        "trainer_cpu_s": clock.cpu,
        "reward": [m.get("reward/mean") for m in hist],
        "samples_seen": [per_step * (i + 1) for i in range(len(hist))],
        "metrics": hist,
    }


def summarize(res: dict[str, Any], warmup: int) -> dict[str, float]:
    ends = res["step_end_s"]
    span = ends[-1] - ends[warmup - 1] if warmup else ends[-1]
    n = len(ends) - warmup
    m = res["metrics"]
    cpu = res["trainer_cpu_s"]
    worker_cpu = sum(x.get("async/worker_sample_cpu_s", 0.0) for x in m[warmup:])
    out = {
        "steps_per_s": n / span,
        "cpu_s_per_step": (cpu[-1] - cpu[warmup - 1 if warmup else 0] + worker_cpu) / n,
        "reward_mean": statistics.fmean(r for r in res["reward"] if r is not None),
        "reward_last_third": statistics.fmean(r for r in res["reward"][-(len(ends) // 3) :] if r is not None),
    }
    for key in (
        "async/staleness_mean",
        "async/trainer_wait_s",
        "async/worker_idle_s",
        "async/worker_sample_s",
        "async/worker_sample_cpu_s",
        "async/reward_s",
        "is/weight_mean",
        "is/capped_frac",
        "time/update_s",
    ):
        vals = [x[key] for x in m[warmup:] if key in x]
        if vals:
            out[key] = statistics.fmean(vals)
    return out


def _burn(seconds: float) -> float:
    """CPU-bound work of about `seconds` on one idle core; returns the wall time it took."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(192, 192)
    t0 = time.perf_counter()
    for _ in range(int(seconds * 2000)):
        a = torch.tanh(a @ a * 0.01)
    return time.perf_counter() - t0


def parallel_capacity(seconds: float = 2.0) -> float:
    """How many cores two processes get at once now: 2 x (one process's time) / (two at once' time); 2.0 on two
    idle cores, about 1.0 when other work takes the second one. The async speed-up cannot exceed it."""
    import multiprocessing as mp

    one = _burn(seconds)
    with mp.get_context("spawn").Pool(2) as pool:
        pool.map(_burn, [0.01, 0.01])  # start both processes and import torch first
        two = max(pool.map(_burn, [seconds, seconds]))
    return 2 * one / two


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(TASKS), default="text")
    p.add_argument("--config", default=None, help="a config instead of the task's tiny one")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--staleness", type=int, default=1, help="K of the async run")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--async-options", default="", help="more trainer.async keys, e.g. 'backend: ray, num_workers: 2'"
    )
    p.add_argument("--set", nargs="*", default=[], help="config overrides for both runs")
    p.add_argument("--json", default=None, help="default: benchmarks/results/async_<task>_cpu.json")
    args = p.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    config = args.config or TASKS[args.task]
    load_start = list(os.getloadavg())  # other work on the machine shares its cores: report it
    capacity = [parallel_capacity()]
    print(f"parallel capacity (cores two processes get at once): {capacity[0]:.2f}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {"sync": [], f"async_k{args.staleness}": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for name, k in (("sync", None), (f"async_k{args.staleness}", args.staleness)):
                res = run(config, args.set, args.steps, k, Path(tmp) / f"{name}_{rep}", args.async_options)
                res["summary"] = summarize(res, args.warmup)
                runs[name].append(res)
                print(name, rep, json.dumps(res["summary"]), flush=True)
    table = {}
    for name, rs in runs.items():
        table[name] = {
            key: statistics.fmean(r["summary"][key] for r in rs)
            for key in rs[0]["summary"]
            if all(key in r["summary"] for r in rs)
        }
    speedup = table[f"async_k{args.staleness}"]["steps_per_s"] / table["sync"]["steps_per_s"]
    print("\n| run | steps/s | CPU s / step | reward mean | reward (last third) |\n|---|---|---|---|---|")
    for name, s in table.items():
        print(
            f"| {name} | {s['steps_per_s']:.3f} | {s['cpu_s_per_step']:.3f} | {s['reward_mean']:.3f} | "
            f"{s['reward_last_third']:.3f} |"
        )
    capacity.append(parallel_capacity())
    print(f"speed-up async/sync: {speedup:.2f}x; parallel capacity before / after: {capacity}")
    result = {
        "config": config,
        "overrides": args.set,
        "steps": args.steps,
        "warmup": args.warmup,
        "staleness": args.staleness,
        "repeats": args.repeats,
        "threads": int(os.environ.get("OMP_NUM_THREADS", "1")),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "load_avg_1_5_15_at_start": load_start,
            "load_avg_1_5_15_at_end": list(os.getloadavg()),
            "parallel_capacity_before_after": capacity,
        },
        "summary": table,
        "speedup": speedup,
        "runs": {
            name: [{k: v for k, v in r.items() if k != "metrics"} | {"metrics": r["metrics"]} for r in rs]
            for name, rs in runs.items()
        },
    }
    path = Path(args.json) if args.json else REPO / "benchmarks" / "results" / f"async_{args.task}_cpu.json"
    path.write_text(json.dumps(result, indent=1, default=float))
    print("wrote", path)


if __name__ == "__main__":
    main()
