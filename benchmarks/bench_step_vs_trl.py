"""Time one full GRPO training step (rollout, reward, update) of mmalign and of TRL's `GRPOTrainer`.

Both frameworks train the SAME tiny causal LM (a randomly initialised Qwen2 built offline with
`mmalign.tiny`, written with `save_pretrained` and loaded back by each framework with
`from_pretrained`) on the same prompts, with the same batch (prompts per step x group size),
the same completion length, temperature 1.0, full fine-tuning, the same learning rate, no KL and
one optimizer step per training step, scored by the same TRL-style reward function.

Each framework runs in its own subprocess (separate imports, separate peak memory), warms up for
`--warmup` steps and then times `--steps` steps. By default the two subprocesses run side by side
in lockstep: step i of one, then step i of the other (the order alternates), never both at once,
so load from other programs on a shared machine that drifts over time hits both frameworks alike;
the median of the per-pair ratios is printed as well. `--no-interleave` runs one after the other.

- mmalign: wall time of each `GroupTrainer.train_step()` call (sample prompts, generate, reward,
  advantages, forward + backward, optimizer step); its metrics give the split rollout / reward /
  update.
- TRL: wall time between `on_step_begin` and `on_step_end` of a `TrainerCallback`, which brackets
  `training_step` (generation, reward and advantages happen in `_prepare_inputs`, inside it), the
  gradient clipping and the optimizer step. The split comes from timing wrappers around
  `_generate`, `_calculate_rewards` and `_generate_and_score_completions` on the trainer instance.

Memory: on CPU the peak RSS of the worker process (`ru_maxrss`) and its RSS once the trainer is
built (model loaded); on CUDA `torch.cuda.max_memory_allocated` over the timed steps. Each worker
also records its CPU time per step and how much CPU other processes used meanwhile (a noise flag).

Usage::

    python benchmarks/bench_step_vs_trl.py                      # defaults, about 1.5 min on 2 CPU cores
    python benchmarks/bench_step_vs_trl.py --device cuda --hidden 1024 --layers 8 --max-new-tokens 256
    python benchmarks/bench_step_vs_trl.py --model-vocab 151936 --logprob-chunk-size null   # full logits

``--model-vocab`` makes the model's vocabulary (embedding and LM head rows) larger than the BPE
tokenizer's; ``--logprob-chunk-size``, ``--logprob-memory-mb`` and ``--sampler`` set mmalign's
``model.logprob_chunk_size``, ``model.logprob_memory_mb`` and ``rollout.sampler``.
`benchmarks/bench_logprob_memory.py` runs these workers at several vocabularies.

TRL comes with the ``bench`` extra: ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import resource
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_JSON = HERE / "results" / "step_vs_trl.json"
FRAMEWORKS = ("mmalign", "trl")


# ----------------------------------------------------------------------------- the shared reward
def char_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """TRL-style reward used by both frameworks: the fraction of letters that are vowels.

    Cheap, deterministic and different from sample to sample (so advantages are not all zero).
    """
    out = []
    for text in completions:
        letters = [c for c in text.lower() if c.isalpha()]
        out.append(sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0)
    return out


# ----------------------------------------------------------------------------- data and model
_SYLLABLES = [
    "ka",
    "to",
    "ri",
    "mu",
    "se",
    "la",
    "po",
    "ne",
    "di",
    "fa",
    "gu",
    "ho",
    "be",
    "zi",
    "wa",
    "qu",
    "ex",
    "an",
    "or",
    "il",
    "um",
    "st",
    "th",
    "ch",
    "sh",
    "pr",
    "tr",
    "gr",
    "en",
    "on",
]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    """`n` distinct synthetic prompts of `words` made-up words each (deterministic)."""
    rng = random.Random(seed)
    prompts: list[str] = []
    seen: set[str] = set()
    while len(prompts) < n:
        p = "Q: " + " ".join(_word(rng) for _ in range(words)) + " ?\nA:"
        if p not in seen:
            seen.add(p)
            prompts.append(p)
    return prompts


def build_model(path: Path, args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    """Train a BPE tokenizer, build a random-init Qwen2 with mmalign.tiny, `save_pretrained` both."""
    import torch

    from mmalign.tiny import tiny_causal_lm, train_bpe_tokenizer

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed + 1)
    corpus = prompts + [" ".join(_word(rng) for _ in range(24)) for _ in range(2000)]
    tokenizer = train_bpe_tokenizer(corpus, vocab_size=args.vocab)
    model_vocab = getattr(args, "model_vocab", None)
    if model_vocab is not None and model_vocab < len(tokenizer):
        raise ValueError(
            f"--model-vocab {model_vocab} is smaller than the BPE tokenizer ({len(tokenizer)} tokens, --vocab)"
        )
    heads = max(1, args.hidden // 64)
    model = tiny_causal_lm(
        tokenizer,
        # a vocabulary larger than the tokenizer's: the embedding and LM head have `model_vocab` rows; the
        # sampler may draw the extra ids, which the tokenizer decodes to nothing (as a real model's padding ids)
        vocab_size=model_vocab or len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=max(256, 2 * (args.max_new_tokens + 64)),
    )
    if args.suppress_eos:
        # mmalign's generate() call takes suppress_tokens from the model's generation config; TRL
        # builds its own GenerationConfig, so it gets the same list through generation_kwargs.
        model.generation_config.suppress_tokens = [tokenizer.eos_token_id]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    n_params = sum(p.numel() for p in model.parameters())
    prompt_tokens = [len(tokenizer(p)["input_ids"]) for p in prompts]
    return {
        "params": n_params,
        "vocab_size": model.config.vocab_size,
        "tokenizer_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens),
    }


# ----------------------------------------------------------------------------- worker helpers
def _rss_mb() -> float:
    """Current resident set size of this process (MiB)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):  # not Linux: fall back to the peak
        return _peak_rss_mb()


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def _system_busy_s() -> float:
    """CPU seconds spent by every process on the machine since boot (all cores; NaN if unknown)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class StepClock:
    """Times steps in a worker; with a gate, each step waits for the driver's go (lockstep interleaving).

    Per step: wall time, this process's CPU time, and the CPU time OTHER processes used meanwhile (a
    noise indicator on shared machines). `begin(i)`/`end(i)` bracket step i (0-based); the first
    `warmup` steps are not recorded; CUDA is synchronised at both ends and its peak memory counter is
    reset when the first timed step begins.
    """

    def __init__(self, gate: str | None, warmup: int, total: int, cuda: bool) -> None:
        self.warmup, self.total, self.cuda = warmup, total, cuda
        self.go = self.done = None
        if gate:
            go_fd, done_fd = (int(x) for x in gate.split(","))
            self.go, self.done = os.fdopen(go_fd, "r"), os.fdopen(done_fd, "w")
        self.ready_sent = False
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.other_cpu = self.timed_wall = 0.0

    def begin(self, i: int) -> None:
        if self.go is not None:
            if not self.ready_sent:
                self._say("ready")
                self.ready_sent = True
            if not self.go.readline():
                raise SystemExit("the benchmark driver went away")
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            if i == self.warmup:
                torch.cuda.reset_peak_memory_stats()
        self.c0, self.sys0, self.t0 = time.process_time(), _system_busy_s(), time.perf_counter()

    def end(self, i: int) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        dt, ct = time.perf_counter() - self.t0, time.process_time() - self.c0
        other = _system_busy_s() - self.sys0 - ct
        if i >= self.warmup:
            self.times.append(dt)
            self.cpu_times.append(ct)
            self.other_cpu += other
            self.timed_wall += dt
        if self.done is not None:
            self._say("done")
            if i == self.total - 1:  # hold the post-training work until every framework is done
                self.go.readline()

    def _say(self, word: str) -> None:
        assert self.done is not None
        self.done.write(word + "\n")
        self.done.flush()

    def stats(self) -> dict[str, Any]:
        cores = os.cpu_count() or 1
        return {
            "step_times_s": self.times,
            "step_cpu_times_s": self.cpu_times,
            **_summary(self.times),
            "other_procs_cpu_s": self.other_cpu,
            "other_procs_cpu_frac": max(0.0, self.other_cpu) / max(self.timed_wall * cores, 1e-9),
        }


PROBE_ELEMENTS = 65536
"""How many entries of one trainable matrix the workers compare before / after training."""


def _param_probe(model: Any) -> tuple[str, Any]:
    """(name, fp64 copy of the first `PROBE_ELEMENTS` entries) of the first trainable matrix: a small copy,
    so that checking the weights changed adds nothing to the measured memory."""
    name, p = next((n, p) for n, p in model.named_parameters() if p.requires_grad and p.dim() == 2)
    return name, _probe_values(p)


def _probe_values(p: Any) -> Any:
    import torch

    return p.detach().reshape(-1)[:PROBE_ELEMENTS].cpu().to(torch.float64)


def _memory(spec: dict[str, Any], rss_setup: float, cuda_setup: float | None) -> dict[str, Any]:
    mem: dict[str, Any] = {"rss_after_setup_mb": rss_setup, "peak_rss_mb": _peak_rss_mb()}
    mem["peak_rss_increase_mb"] = mem["peak_rss_mb"] - rss_setup
    if spec["device"] == "cuda":
        import torch

        mem["cuda_after_setup_mb"] = cuda_setup
        mem["cuda_peak_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        mem["cuda_peak_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    return mem


def _setup_torch(spec: dict[str, Any]) -> Any:
    import torch

    torch.set_num_threads(spec["threads"])
    if spec["device"] == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    return torch


def _summary(times: list[float]) -> dict[str, float]:
    return {
        "median_s": statistics.median(times),
        "mean_s": statistics.fmean(times),
        "min_s": min(times),
        "max_s": max(times),
    }


# ----------------------------------------------------------------------------- mmalign worker
def run_mmalign(spec: dict[str, Any], gate: str | None = None) -> dict[str, Any]:
    torch = _setup_torch(spec)
    sys.path[:0] = [str(ROOT), str(HERE)]
    import accelerate  # noqa: F401  (imported lazily by mmalign; loaded here so that the
    import transformers  # noqa: F401  "after import" RSS is comparable with TRL's, which imports both)

    import pipelines
    from mmalign.config import config_from_dict
    from mmalign.training.trainer import GroupTrainer

    transformers.AutoModelForCausalLM  # noqa: B018  (resolve the lazy module, as TRL's import does)
    rss_import = _rss_mb()
    work = Path(spec["workdir"])
    data = work / "prompts.jsonl"
    with data.open("w") as f:
        for p in spec["prompts"]:
            f.write(json.dumps({"prompt": p}) + "\n")
    steps = spec["warmup"] + spec["steps"]
    cfg = config_from_dict(
        {
            "pipeline": "text_reasoning",
            "output_dir": str(work / "mmalign_run"),
            "seed": spec["seed"],
            "overwrite": True,
            "model": {
                "name_or_path": spec["model_dir"],
                "dtype": spec["dtype"],
                "gradient_checkpointing": spec["gradient_checkpointing"],
                "shared_prefix": spec.get("shared_prefix", True),
                # e.g. {"logprob_chunk_size": None} (--logprob-chunk-size); absent: the config's defaults
                **spec.get("model_overrides", {}),
                **{k: v for k, v in spec.get("policy_attrs", {}).items() if k == "logprob_memory_mb"},
            },
            "data": {"train": str(data), "prompt_template": "{prompt}", "shuffle": True},
            "rollout": {
                "group_size": spec["group_size"],
                "prompts_per_step": spec["prompts_per_step"],
                "max_new_tokens": spec["max_new_tokens"],
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 0,
                **{k: v for k, v in spec.get("policy_attrs", {}).items() if k == "sampler"},
            },
            "rewards": [{"name": "bench_step_vs_trl:char_reward"}],
            "algorithm": {"estimator": "grpo", "loss": "ppo_clip", "loss_agg": "token_mean", "kl_coef": 0.0},
            "trainer": {
                "steps": steps,
                "lr": spec["lr"],
                "lr_scheduler": "constant",
                "num_iterations": 1,
                "minibatch_size": None,  # the whole rollout: one optimizer step per training step
                "microbatch_size": None,
                "max_grad_norm": 1.0,
                "cpu": spec["device"] == "cpu",
                "mixed_precision": spec["mixed_precision"],
                "save_every": 10**9,
                "sample_every": 10**9,
                "progress_bar": False,
            },
        },
        source="bench_step_vs_trl",
    )
    components = pipelines.get("text_reasoning")(cfg)
    trainer = GroupTrainer(cfg, components)
    for key, value in spec.get("policy_attrs", {}).items():  # --logprob-memory-mb, --sampler
        setattr(trainer.policy, key, value)
    policy = trainer.policy
    settings = {
        "logprob_chunk_size": policy.logprob_chunk_size,
        "logprob_memory_mb": getattr(policy, "logprob_memory_mb", None),
        "sampler": getattr(policy, "sampler", "hf"),
        "own_loop_blockers": policy.own_loop_blockers() if hasattr(policy, "own_loop_blockers") else None,
    }
    probe_name, before = _param_probe(trainer.policy.model)
    if spec["device"] == "cuda":
        torch.cuda.synchronize()
    rss_setup = _rss_mb()
    cuda_setup = torch.cuda.memory_allocated() / 2**20 if spec["device"] == "cuda" else None

    clock = StepClock(gate, spec["warmup"], steps, spec["device"] == "cuda")
    rows = []
    for i in range(steps):
        clock.begin(i)
        m = trainer.train_step()
        clock.end(i)
        if i >= spec["warmup"]:
            rows.append(m)
    timing = clock.stats()
    memory = _memory(spec, rss_setup, cuda_setup)  # the peak of training, before anything else
    after = _probe_values(dict(trainer.policy.model.named_parameters())[probe_name])

    def mean(key: str) -> float:
        return statistics.fmean(float(r[key]) for r in rows)

    rollout, reward, update = mean("time/rollout_s"), mean("time/reward_s"), mean("time/update_s")
    return {
        "framework": "mmalign",
        **timing,
        "completion_len_mean": mean("completion_len/mean"),
        "truncated_frac": mean("truncated_frac"),
        "breakdown_mean_s": {
            "rollout (generate)": rollout,
            "reward": reward,
            "update (fwd+bwd+optim)": update,
            "other (advantages, metrics)": timing["mean_s"] - rollout - reward - update,
        },
        "reward_mean": mean("reward/mean"),
        "policy_settings": settings,
        "params_changed": bool((after - before).abs().max() > 0),
        "rss_after_import_mb": rss_import,
        **memory,
    }


# ----------------------------------------------------------------------------- TRL worker
class _Timed:
    """Wraps a bound method, accumulating its wall time (and synchronising CUDA around it)."""

    def __init__(self, fn: Any, cuda: bool) -> None:
        self.fn, self.cuda, self.total = fn, cuda, 0.0

    def __call__(self, *a: Any, **k: Any) -> Any:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.total += time.perf_counter() - t0


def run_trl(spec: dict[str, Any], gate: str | None = None) -> dict[str, Any]:
    torch = _setup_torch(spec)
    try:
        from datasets import Dataset
        from transformers import AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(f"TRL side needs `trl` and `datasets` (pip install -e '.[bench]'): {e}") from e

    rss_import = _rss_mb()
    cuda = spec["device"] == "cuda"
    warmup, steps = spec["warmup"], spec["steps"]
    batch = spec["prompts_per_step"] * spec["group_size"]
    gen_kwargs = {"suppress_tokens": [spec["eos_token_id"]]} if spec["suppress_eos"] else None
    args = GRPOConfig(
        output_dir=str(Path(spec["workdir"]) / "trl_run"),
        seed=spec["seed"],
        # one generation batch (prompts_per_step x group_size completions) = one optimizer step
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=spec["group_size"],
        num_iterations=1,
        max_completion_length=spec["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        generation_kwargs=gen_kwargs,
        beta=0.0,
        loss_type="dapo",  # token mean over the batch, like mmalign's token_mean
        scale_rewards="group",
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=warmup + steps,
        model_init_kwargs={"dtype": getattr(torch, spec["dtype"])},
        gradient_checkpointing=spec["gradient_checkpointing"],  # TRL's default is True; mmalign's False
        bf16=spec["mixed_precision"] == "bf16",  # TRL's default is True; mmalign's mixed_precision is "no"
        fp16=spec["mixed_precision"] == "fp16",
        use_cpu=not cuda,
        report_to="none",
        logging_steps=10**9,
        disable_tqdm=True,
        save_strategy="no",
        eval_strategy="no",
        log_completions=False,
        dataloader_num_workers=0,
        shuffle_dataset=True,
    )
    dataset = Dataset.from_list([{"prompt": p} for p in spec["prompts"]])

    class StepTimer(TrainerCallback):
        """Brackets each optimizer step: on_step_begin .. on_step_end (see the module docstring)."""

        def __init__(self) -> None:
            self.clock = StepClock(gate, warmup, warmup + steps, cuda)
            self.rows: list[dict[str, float]] = []
            self.trainer: Any = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.clock.begin(state.global_step)
            tr = self.trainer
            self.marks = (
                tr._generate.total,
                tr._calculate_rewards.total,
                tr._generate_and_score_completions.total,
            )

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.clock.end(state.global_step - 1)
            tr = self.trainer
            gen, rew, score = (
                tr._generate.total - self.marks[0],
                tr._calculate_rewards.total - self.marks[1],
                tr._generate_and_score_completions.total - self.marks[2],
            )
            lens = tr._metrics["train"].get("completions/mean_length") or [float("nan")]
            clipped = tr._metrics["train"].get("completions/clipped_ratio") or [float("nan")]
            self.rows.append(
                {
                    "generate_s": gen,
                    "reward_s": rew,
                    "score_total_s": score,
                    "completion_len": float(lens[-1]),
                    "clipped_ratio": float(clipped[-1]),
                }
            )

    timer = StepTimer()
    trainer = GRPOTrainer(
        model=spec["model_dir"],
        reward_funcs=char_reward,
        args=args,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(spec["model_dir"]),
        callbacks=[timer],
    )
    timer.trainer = trainer
    for name in ("_generate", "_calculate_rewards", "_generate_and_score_completions"):
        setattr(trainer, name, _Timed(getattr(trainer, name), cuda))
    probe_name, before = _param_probe(trainer.model)
    if cuda:
        torch.cuda.synchronize()
    rss_setup = _rss_mb()
    cuda_setup = torch.cuda.memory_allocated() / 2**20 if cuda else None

    trainer.train()

    memory = _memory(spec, rss_setup, cuda_setup)  # the peak of training, before anything else
    after = _probe_values(dict(trainer.model.named_parameters())[probe_name])
    rows = timer.rows[warmup:]
    if len(rows) != steps:
        raise RuntimeError(f"TRL ran {len(timer.rows)} optimizer steps, expected {warmup + steps}")
    timing = timer.clock.stats()

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in rows)

    gen, rew, score = mean("generate_s"), mean("reward_s"), mean("score_total_s")
    return {
        "framework": "trl",
        **timing,
        "completion_len_mean": mean("completion_len"),
        "truncated_frac": mean("clipped_ratio"),
        "breakdown_mean_s": {
            "rollout (generate)": gen,
            "reward": rew,
            "update (fwd+bwd+optim)": timing["mean_s"] - score,
            "other (advantages, metrics)": score - gen - rew,
        },
        "params_changed": bool((after - before).abs().max() > 0),
        "rss_after_import_mb": rss_import,
        **memory,
    }


# ----------------------------------------------------------------------------- driver
def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "trl", "accelerate", "mmalign"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _machine(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    desc = f"{os.cpu_count()} CPU cores ({cpu})"
    if device == "cuda":
        import torch

        desc += f", GPU: {torch.cuda.get_device_name(0)}"
    return desc


def _readline(f: Any, timeout: float) -> str:
    ready, _, _ = select.select([f], [], [], timeout)
    return f.readline() if ready else "<timeout>"


def _run_workers(
    frameworks: list[str], spec: dict[str, Any], work: Path, tag: str, timeout: float
) -> dict[str, dict[str, Any]]:
    """Start one worker process per framework and run their steps in lockstep.

    All workers load their model first; then step i of every framework runs in turn (order
    alternating from step to step), never two at once. Background load that drifts over time thus
    hits every framework alike, while each process keeps its own imports and peak memory.
    """
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    procs: dict[str, Any] = {}
    t0 = time.perf_counter()

    def fail(fw: str, why: str) -> None:
        for p, *_ in procs.values():
            if p.poll() is None:
                p.kill()
        log = (work / f"{fw}{tag}.log").read_text().splitlines()[-40:]
        raise RuntimeError(f"{fw} worker {why}; last lines of its output:\n" + "\n".join(log))

    try:
        for fw in frameworks:
            go_r, go_w = os.pipe()
            done_r, done_w = os.pipe()
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                fw,
                "--spec",
                str(spec_path),
                "--worker-out",
                str(work / f"result_{fw}{tag}.json"),
                "--gate",
                f"{go_r},{done_w}",
            ]
            log = (work / f"{fw}{tag}.log").open("w")
            p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, pass_fds=(go_r, done_w))
            log.close()
            os.close(go_r)
            os.close(done_w)
            procs[fw] = (p, os.fdopen(go_w, "w"), os.fdopen(done_r, "r"))
        for fw, (_, _, done) in procs.items():
            if (line := _readline(done, timeout).strip()) != "ready":
                fail(fw, f"did not get ready ({line or 'exited'})")
        for i in range(spec["warmup"] + spec["steps"]):
            order = frameworks if i % 2 == 0 else frameworks[::-1]
            for fw in order:
                _, go, done = procs[fw]
                go.write("go\n")
                go.flush()
                if (line := _readline(done, timeout).strip()) != "done":
                    fail(fw, f"failed in step {i + 1} ({line or 'exited'})")
        results = {}
        for _, go, _ in procs.values():  # let every worker finish (TRL logs at the end of train())
            go.write("finish\n")
            go.flush()
        for fw, (p, go, _) in procs.items():
            go.close()
            rc = p.wait(timeout=timeout)
            out = work / f"result_{fw}{tag}.json"
            if rc != 0 or not out.exists():
                fail(fw, f"exited with code {rc}")
            results[fw] = json.loads(out.read_text())
            results[fw]["process_wall_s"] = time.perf_counter() - t0
        return results
    finally:
        for p, go, done in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
            for f in (go, done):
                try:
                    f.close()
                except (OSError, ValueError):
                    pass


def _merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from the rounds of one framework: all timed steps pooled, memory the max over rounds."""
    if len(rounds) == 1:
        return rounds[0]
    out = dict(rounds[0])
    out["step_times_s"] = [t for r in rounds for t in r["step_times_s"]]
    out["step_cpu_times_s"] = [t for r in rounds for t in r["step_cpu_times_s"]]
    out.update(_summary(out["step_times_s"]))
    for key in (
        "completion_len_mean",
        "truncated_frac",
        "other_procs_cpu_frac",
        "other_procs_cpu_s",
        "process_wall_s",
    ):
        out[key] = statistics.fmean(r[key] for r in rounds)
    out["breakdown_mean_s"] = {
        k: statistics.fmean(r["breakdown_mean_s"][k] for r in rounds) for k in rounds[0]["breakdown_mean_s"]
    }
    for key in out:
        if key.endswith("_mb") and out[key] is not None:
            out[key] = max(r[key] for r in rounds)
    out["params_changed"] = all(r["params_changed"] for r in rounds)
    out["rounds"] = rounds
    return out


def _fmt_table(results: dict[str, dict[str, Any]], device: str) -> str:
    mem_key = "cuda_peak_allocated_mb" if device == "cuda" else "peak_rss_mb"
    mem_name = "peak CUDA alloc (MiB)" if device == "cuda" else "peak RSS (MiB)"
    head = [
        "framework",
        "median step (s)",
        "min step (s)",
        "median CPU (s)",
        "mean compl. len",
        mem_name,
        "setup (MiB)",
        "train incr. (MiB)",
    ]
    lines = []
    for fw, r in results.items():
        if device == "cuda":
            setup, incr = r["cuda_after_setup_mb"], r["cuda_peak_allocated_mb"] - r["cuda_after_setup_mb"]
        else:
            setup, incr = r["rss_after_setup_mb"], r["peak_rss_increase_mb"]
        lines.append(
            [
                fw,
                f"{r['median_s']:.3f}",
                f"{r['min_s']:.3f}",
                f"{statistics.median(r['step_cpu_times_s']):.3f}",
                f"{r['completion_len_mean']:.1f}",
                f"{r[mem_key]:.0f}",
                f"{setup:.0f}",
                f"{incr:.0f}",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*row) for row in lines]
    return "\n".join(out)


def _fmt_breakdown(results: dict[str, dict[str, Any]]) -> str:
    keys = list(next(iter(results.values()))["breakdown_mean_s"])
    head = ["phase (mean s/step)", *results]
    rows = [[k, *(f"{results[fw]['breakdown_mean_s'][k]:.3f}" for fw in results)] for k in keys]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(
        [fmt.format(*head), fmt.format(*("-" * w for w in widths)), *(fmt.format(*r) for r in rows)]
    )


def _chunk_size(text: str) -> int | str | None:
    """``--logprob-chunk-size``: a positive int, auto, or null / none for the full-logits path."""
    if text.strip().lower() in ("null", "none"):
        return None
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, auto or null, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps per framework (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps (default 2)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="completion length (default 32)")
    p.add_argument("--hidden", type=int, default=256, help="model hidden size (default 256)")
    p.add_argument("--layers", type=int, default=4, help="model layers (default 4)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP size (default 3 x hidden)")
    p.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary size (default 1024)")
    p.add_argument(
        "--model-vocab",
        type=int,
        default=None,
        help="rows of the model's embedding and LM head, >= the BPE vocabulary (default: the same);\n"
        "the sampler may draw the extra ids, which decode to nothing",
    )
    p.add_argument(
        "--logprob-chunk-size",
        type=_chunk_size,
        default=argparse.SUPPRESS,
        help="mmalign's model.logprob_chunk_size: tokens per chunk through the LM head, auto (sized from\n"
        "--logprob-memory-mb), or null for the full-logits path (default: the config's default, auto)",
    )
    p.add_argument(
        "--logprob-memory-mb",
        type=float,
        default=argparse.SUPPRESS,
        help="mmalign's model.logprob_memory_mb, the budget of an auto chunk (default: the config's, 256)",
    )
    p.add_argument(
        "--sampler",
        choices=["mmalign", "hf"],
        default=argparse.SUPPRESS,
        help="mmalign's rollout.sampler: its own decode loop (default) or Hugging Face generate",
    )
    p.add_argument("--prompt-words", type=int, default=12, help="made-up words per prompt (default 12)")
    p.add_argument(
        "--dataset-size", type=int, default=256, help="distinct prompts in the dataset (default 256)"
    )
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights dtype (both)")
    p.add_argument(
        "--mixed-precision",
        choices=["no", "bf16", "fp16"],
        default="no",
        help="autocast in both (mmalign trainer.mixed_precision, TRL bf16/fp16; default no)",
    )
    p.add_argument(
        "--gradient-checkpointing", action="store_true", help="enable it in both (default off in both)"
    )
    p.add_argument(
        "--suppress-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="forbid EOS while sampling, in both, so every completion has max length (default on)",
    )
    p.add_argument(
        "--shared-prefix",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="mmalign's shared-prefix log-prob forward (model.shared_prefix; default on, as in its configs)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads in both workers (default: all cores)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="start the workers this many times; timed steps are pooled (default 1)",
    )
    p.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run both workers at once, their steps in lockstep turns (default); --no-interleave:\n"
        "one framework after the other",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--frameworks", default="mmalign,trl", help="comma list, run in this order (default mmalign,trl)"
    )
    p.add_argument(
        "--json",
        type=Path,
        default=DEFAULT_JSON,
        help=f"results file (default {DEFAULT_JSON.relative_to(ROOT)})",
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds per framework before giving up")
    p.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--gate", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is None:
        if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
            p.error("--steps and --rounds must be >= 1, --warmup >= 0")
        if args.group_size < 2:
            p.error("--group-size must be >= 2 (TRL refuses smaller groups)")
        if args.dataset_size < args.prompts:
            p.error("--dataset-size must be >= --prompts")
        if args.model_vocab is not None and args.model_vocab < args.vocab:
            p.error("--model-vocab must be >= --vocab (the BPE vocabulary)")
        frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
        bad = [f for f in frameworks if f not in FRAMEWORKS]
        if bad or not frameworks:
            p.error(f"--frameworks: unknown {bad}; choose from {list(FRAMEWORKS)}")
        args.frameworks = frameworks
    return args


def _tokenizer_note(model_info: dict[str, Any]) -> str:
    n = model_info["tokenizer_size"]
    return f" (tokenizer {n})" if n != model_info["vocab_size"] else ""


def make_spec(
    args: argparse.Namespace, work: Path, prompts: list[str], model_info: dict[str, Any], threads: int
) -> dict[str, Any]:
    """What every worker reads (model folder ``work / "model"``, prompts, batch, lengths, settings)."""
    spec: dict[str, Any] = {
        "model_dir": str(work / "model"),
        "workdir": str(work),
        "prompts": prompts,
        "prompts_per_step": args.prompts,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "lr": args.lr,
        "dtype": args.dtype,
        "mixed_precision": args.mixed_precision,
        "gradient_checkpointing": args.gradient_checkpointing,
        "shared_prefix": args.shared_prefix,
        "suppress_eos": args.suppress_eos,
        "eos_token_id": model_info["eos_token_id"],
        "device": args.device,
        "threads": threads,
        "seed": args.seed,
        "warmup": args.warmup,
        "steps": args.steps,
    }
    if hasattr(args, "logprob_chunk_size"):  # mmalign only; TRL has its own fused LM head
        spec["model_overrides"] = {"logprob_chunk_size": args.logprob_chunk_size}
    # mmalign only: set in the config and on the built policy (whatever the pipeline passes on)
    policy_attrs = {key: getattr(args, key) for key in ("logprob_memory_mb", "sampler") if hasattr(args, key)}
    if policy_attrs:
        spec["policy_attrs"] = policy_attrs
    return spec


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.spec.read_text())
        result = (run_mmalign if args.worker == "mmalign" else run_trl)(spec, args.gate)
        args.worker_out.write_text(json.dumps(result))
        return 0

    if "trl" in args.frameworks:
        missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
        if missing:
            print(
                f"error: {', '.join(missing)} not installed; install the bench extra: pip install -e '.[bench]' "
                f"(or run --frameworks mmalign)",
                file=sys.stderr,
            )
            return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
            return 2
    threads = args.threads or os.cpu_count() or 1
    sys.path.insert(0, str(ROOT))

    with tempfile.TemporaryDirectory(prefix="bench_step_vs_trl_") as tmp:
        work = Path(tmp)
        prompts = make_prompts(args.dataset_size, args.prompt_words, args.seed)
        t0 = time.perf_counter()
        model_info = build_model(work / "model", args, prompts)
        print(
            f"model: Qwen2, {model_info['params'] / 1e6:.2f}M parameters, hidden {args.hidden}, "
            f"{args.layers} layers, vocab {model_info['vocab_size']}{_tokenizer_note(model_info)}, "
            f"prompts ~{model_info['prompt_tokens_mean']:.1f} "
            f"tokens (built in {time.perf_counter() - t0:.1f}s at {work / 'model'})",
            flush=True,
        )
        spec = make_spec(args, work, prompts, model_info, threads)
        runs: dict[str, list[dict[str, Any]]] = {fw: [] for fw in args.frameworks}
        groups = [args.frameworks] if args.interleave else [[fw] for fw in args.frameworks]
        for rnd in range(args.rounds):
            for group in groups:
                tag = f" (round {rnd + 1}/{args.rounds})" if args.rounds > 1 else ""
                how = " in lockstep" if len(group) > 1 else ""
                print(
                    f"running {' and '.join(group)}{how}{tag}: {args.warmup} warm-up + {args.steps} timed steps "
                    f"each ...",
                    flush=True,
                )
                for fw, r in _run_workers(group, spec, work, f"_{rnd}", args.timeout).items():
                    runs[fw].append(r)
                    print(
                        f"  {fw}: median {r['median_s']:.3f}s/step, steps {[round(t, 3) for t in r['step_times_s']]}, "
                        f"other processes' CPU {100 * r['other_procs_cpu_frac']:.0f}%",
                        flush=True,
                    )
        results = {fw: _merge_rounds(rs) for fw, rs in runs.items()}

    print()
    print(
        f"settings: {args.prompts} prompts x {args.group_size} completions = {args.prompts * args.group_size} "
        f"samples/step, {args.max_new_tokens} new tokens, temperature 1.0, lr {args.lr:g}, no KL, "
        f"1 optimizer step/step, {args.dtype} weights, autocast {args.mixed_precision}, device {args.device}, {threads} threads, "
        f"EOS {'suppressed' if args.suppress_eos else 'allowed'}"
    )
    print(_fmt_table(results, args.device))
    print()
    print(_fmt_breakdown(results))
    ratio = paired = cpu_ratio = memory_ratio = None
    if "mmalign" in results and "trl" in results:
        ratio = results["trl"]["median_s"] / results["mmalign"]["median_s"]
        print()
        verdict = "mmalign faster" if ratio > 1.02 else "TRL faster" if ratio < 1 / 1.02 else "about equal"
        print(f"ratio TRL/mmalign (median step time): {ratio:.2f}x  ({verdict}; target >= 1.5x)")
        if args.interleave:
            # step i of both ran back to back: the per-step ratio cancels slow drifts in machine load
            pairs = [
                t / m for t, m in zip(results["trl"]["step_times_s"], results["mmalign"]["step_times_s"])
            ]
            paired = statistics.median(pairs)
            print(f"ratio TRL/mmalign, median of the {len(pairs)} back-to-back step pairs: {paired:.2f}x")
        cpu_ratio = statistics.median(results["trl"]["step_cpu_times_s"]) / statistics.median(
            results["mmalign"]["step_cpu_times_s"]
        )
        print(f"ratio TRL/mmalign of the median CPU time per step: {cpu_ratio:.2f}x")
        for key, name in (("peak_rss_mb", "peak RSS"), ("cuda_peak_allocated_mb", "peak CUDA memory")):
            if results["mmalign"].get(key) is not None:
                a, b = results["mmalign"][key], results["trl"][key]
                memory_ratio = a / b
                print(
                    f"{name}: mmalign {a:.0f} MiB vs TRL {b:.0f} MiB ({memory_ratio:.2f}x TRL's; "
                    f"{'no more' if a <= b else 'MORE'} than TRL)"
                )
    busy = max(r["other_procs_cpu_frac"] for r in results.values())
    if args.device == "cpu" and busy > 0.05:
        print(
            f"note: other processes used up to {100 * busy:.0f}% of the CPU during the timed steps; wall "
            f"times are noisy (look at the CPU column, rerun on a quiet machine or use --rounds)",
            file=sys.stderr,
        )
    for fw, r in results.items():
        if not r["params_changed"]:
            print(f"warning: {fw}: the probed parameter did not change during training", file=sys.stderr)

    payload = {
        "benchmark": "step_vs_trl",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": _machine(args.device),
        "versions": _versions(),
        "settings": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("worker", "spec", "worker_out", "gate")
        }
        | {"threads": threads},
        "model": model_info,
        "results": results,
        "ratio_trl_over_mmalign": ratio,
        "ratio_trl_over_mmalign_paired_median": paired,
        "ratio_trl_over_mmalign_cpu_time": cpu_ratio,
        "peak_memory_mmalign_over_trl": memory_ratio,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
