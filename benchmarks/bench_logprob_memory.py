"""Peak memory and step time of the per-token log-probs at large vocabularies (issue 14).

For each vocabulary in ``--vocabs`` (default 32,000 and 151,936) one random Qwen2 model is built offline
(`bench_step_vs_trl.build_model`: a small BPE tokenizer, ``--bpe-vocab`` tokens, and an embedding / LM head
of ``vocab`` rows, tied), saved with ``save_pretrained``, and three paths run on it with the same batch
(``--prompts`` x ``--group-size``) and lengths (``--max-new-tokens``):

- ``mmalign full``: mmalign with ``model.logprob_chunk_size: null`` (the model's ``[B, T, V]`` logits);
- ``mmalign chunked``: mmalign with ``model.logprob_chunk_size: --chunk`` (default ``auto``: as many tokens
  as fit in ``--memory-mb``, ``model.logprob_memory_mb``; the final hidden states through the LM head a
  chunk at a time, each chunk's logits recomputed in the backward);
- ``TRL``: TRL's ``GRPOTrainer`` (its fused, chunked LM head), if ``trl`` and ``datasets`` are importable;
  otherwise its rows say so.

Two measurements per path, each in its own process:

- **step**: one whole GRPO training step (generate, reward, advantages, forward + backward, optimizer
  step), by the workers of `bench_step_vs_trl` (same settings: no KL, one optimizer step per step,
  temperature 1, EOS suppressed so every completion is ``--max-new-tokens`` long); median step time,
  peak memory (RSS on CPU, ``torch.cuda.max_memory_allocated`` on CUDA) and its increase over the memory
  once the trainer is built (model loaded, libraries imported). On CPU this peak also holds generation.
- **log-prob**: the log-prob part alone, on a fixed batch (the first ``--prompts`` prompts, each repeated
  ``--group-size`` times, left-padded; ``--max-new-tokens`` completion tokens drawn uniformly from the
  whole model vocabulary, all scored): mmalign's ``TextPolicy.action_stats`` (with its shared prompt prefix,
  as in training) or TRL's patched forward exactly as ``GRPOTrainer._get_per_token_logps_and_entropies``
  calls it (``model(..., labels=labels, fused_lm_head=True)``, log-probs and entropy), then the backward
  of the token-mean negative log-prob. After one warm-up run, the peak is reset (``/proc/self/clear_refs``
  on CPU, ``reset_peak_memory_stats`` on CUDA) and ``--lp-repeats`` runs are timed; reported: the median
  time and the peak's increase over the memory before them (which includes the parameters' gradients,
  the same for every path).

Sampling can draw the model's ids beyond the tokenizer (no suppression): they decode to nothing (the
tokenizer drops unknown ids), as a real model's padding rows would. Rewards of such completions are
mostly 0; that changes no cost measured here.

Usage::

    python benchmarks/bench_logprob_memory.py                    # CPU defaults (benchmarks/README.md)
    python benchmarks/bench_logprob_memory.py --device cuda --prompts 8 --group-size 8 \\
        --max-new-tokens 512 --hidden 1024 --layers 8 --vocabs 151936

Results: ``benchmarks/results/logprob_memory_<device>.json`` (``--json``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE)]

import bench_step_vs_trl as bsv  # noqa: E402  (the worker machinery: build_model, make_spec, _run_workers)
from bench_geometry_rewards import _reset_peak_rss  # noqa: E402  (VmHWM reset through /proc/self/clear_refs)

PATHS = ("mmalign-full", "mmalign-chunked", "trl")
LABELS = {
    "mmalign-full": "mmalign full logits",
    "mmalign-chunked": "mmalign chunked",
    "trl": "TRL GRPOTrainer",
}


# ----------------------------------------------------------------------------- the log-prob worker
def _status_mb(field: str) -> float:
    """A memory line of /proc/self/status (VmRSS, VmHWM) in MiB; NaN when unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _fixed_batch(spec: dict[str, Any], tokenizer: Any, vocab: int) -> dict[str, Any]:
    """Prompt ids / mask (left-padded, each prompt repeated group_size times), completion ids drawn
    uniformly from the model's vocabulary (EOS and PAD replaced), all scored."""
    import torch

    g, t = spec["group_size"], spec["max_new_tokens"]
    tokenizer.padding_side = "left"
    enc = tokenizer(spec["prompts"][: spec["prompts_per_step"]], return_tensors="pt", padding=True)
    prompt_ids = enc["input_ids"].repeat_interleave(g, 0)
    prompt_mask = enc["attention_mask"].repeat_interleave(g, 0)
    b = prompt_ids.shape[0]
    gen = torch.Generator().manual_seed(spec["seed"])
    completion = torch.randint(0, vocab, (b, t), generator=gen)
    special = torch.tensor([tokenizer.eos_token_id, tokenizer.pad_token_id])
    completion = torch.where(
        torch.isin(completion, special), torch.full_like(completion, vocab - 1), completion
    )
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion,
        "mask": torch.ones(b, t, dtype=torch.bool),
        "group": torch.arange(spec["prompts_per_step"]).repeat_interleave(g),
    }


def run_logprob(spec: dict[str, Any]) -> dict[str, Any]:
    """Time and peak memory of log-probs + backward on a fixed batch, for one path (see the module docstring)."""
    torch = bsv._setup_torch(spec)
    sys.path[:0] = [str(ROOT)]
    from transformers import AutoTokenizer

    dev = torch.device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    path = spec["path"]
    if path.startswith("mmalign"):
        from mmalign.data.batch import Rollout
        from mmalign.policies.text import TextPolicy

        policy = TextPolicy.from_pretrained(
            spec["model_dir"],
            dtype=spec["dtype"],
            logprob_chunk_size=spec["chunk"] if path == "mmalign-chunked" else None,
            logprob_memory_mb=spec["memory_mb"],
            shared_prefix=spec["shared_prefix"],
        )
        model = policy.model.to(dev)
        vocab = model.config.vocab_size
        batch = _fixed_batch(spec, tokenizer, vocab)
        rollout = Rollout(
            group=batch["group"],
            mask=batch["mask"],
            prompts=["p"] * batch["group"].numel(),
            payload={
                "prompt_ids": batch["prompt_ids"],
                "prompt_mask": batch["prompt_mask"],
                "completion_ids": batch["completion_ids"],
                "completion_attention_mask": batch["mask"].long(),
            },
        )

        def logprobs() -> Any:
            return policy.action_stats(rollout).logp

    else:
        from transformers import AutoModelForCausalLM
        from trl.trainer.utils import add_fused_lm_head

        model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype).to(dev)
        # as GRPOTrainer.__init__ patches its model (temperature 1.0 here)
        add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
        vocab = model.config.vocab_size
        batch = _fixed_batch(spec, tokenizer, vocab)
        t = batch["completion_ids"].shape[1]
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1).to(dev)
        attention = torch.cat([batch["prompt_mask"], batch["mask"].long()], dim=1).to(dev)
        # as GRPOTrainer._get_per_token_logps_and_entropies: only the completion tokens are labelled
        labels = input_ids.masked_fill(attention == 0, -100)
        labels[:, :-t] = -100

        def logprobs() -> Any:
            out = model(input_ids=input_ids, attention_mask=attention, labels=labels, fused_lm_head=True)
            return out.log_probs[:, -t:]

    model.train()
    mask = batch["mask"].to(dev)
    cuda = spec["device"] == "cuda"

    def once() -> tuple[float, float]:
        """One log-prob + backward: (seconds, mean log-prob of the scored tokens)."""
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logp = logprobs()
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, float((logp.detach() * mask).sum() / mask.sum())

    once()  # warm-up: first-call allocations, mmalign's one-off chunked/full agreement check
    model.zero_grad(set_to_none=True)
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    reset = _reset_peak_rss()
    rss_base = _status_mb("VmRSS")
    runs = [once() for _ in range(spec["repeats"])]
    times = [dt for dt, _ in runs]
    out: dict[str, Any] = {
        "path": path,
        "vocab_size": vocab,
        "tokens_scored": int(mask.sum()),
        "times_s": times,
        "median_s": statistics.median(times),
        "logp_mean": runs[-1][1],
        "rss_before_mb": rss_base,
        "peak_rss_mb": _status_mb("VmHWM") if reset else bsv._peak_rss_mb(),
        "peak_reset": reset,
    }
    out["peak_rss_increase_mb"] = out["peak_rss_mb"] - rss_base
    if cuda:
        out["cuda_before_mb"] = base
        out["cuda_peak_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["cuda_peak_increase_mb"] = out["cuda_peak_allocated_mb"] - base
    return out


def _run_logprob_worker(spec: dict[str, Any], work: Path, tag: str, timeout: float) -> dict[str, Any]:
    spec_path, out_path, log_path = (work / f"lp_{tag}{ext}" for ext in (".spec.json", ".json", ".log"))
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        env.setdefault(key, "1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--lp-worker", str(spec_path), str(out_path)]
    with log_path.open("w") as log:
        try:
            rc = subprocess.run(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0 or not out_path.exists():
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise RuntimeError(f"log-prob worker {tag} failed ({rc}); last lines of its output:\n{tail}")
    return json.loads(out_path.read_text())


# ----------------------------------------------------------------------------- driver
def _step_args(args: argparse.Namespace, vocab: int, path: str) -> argparse.Namespace:
    """bench_step_vs_trl's settings for one (vocabulary, path)."""
    argv = [
        "--prompts", str(args.prompts),
        "--group-size", str(args.group_size),
        "--max-new-tokens", str(args.max_new_tokens),
        "--hidden", str(args.hidden),
        "--layers", str(args.layers),
        "--vocab", str(args.bpe_vocab),
        "--model-vocab", str(vocab),
        "--steps", str(args.steps),
        "--warmup", str(args.warmup),
        "--dtype", args.dtype,
        "--device", args.device,
        "--seed", str(args.seed),
        "--frameworks", "trl" if path == "trl" else "mmalign",
    ]  # fmt: skip
    argv += ["--threads", str(args.threads)]
    if path == "mmalign-full":
        argv += ["--logprob-chunk-size", "null"]
    elif path == "mmalign-chunked":
        argv += ["--logprob-chunk-size", str(args.chunk), "--logprob-memory-mb", str(args.memory_mb)]
    return bsv.parse_args(argv)


def _mem_columns(r: dict[str, Any] | None, device: str, part: str) -> tuple[str, str]:
    if r is None:
        return "-", "-"
    if part == "step":
        if device == "cuda":
            return (
                f"{r['cuda_peak_allocated_mb']:.0f}",
                f"{r['cuda_peak_allocated_mb'] - r['cuda_after_setup_mb']:.0f}",
            )
        return f"{r['peak_rss_mb']:.0f}", f"{r['peak_rss_increase_mb']:.0f}"
    if device == "cuda":
        return f"{r['cuda_peak_allocated_mb']:.0f}", f"{r['cuda_peak_increase_mb']:.0f}"
    return f"{r['peak_rss_mb']:.0f}", f"{r['peak_rss_increase_mb']:.0f}"


def format_table(rows: list[dict[str, Any]], device: str) -> str:
    mem = "CUDA alloc" if device == "cuda" else "RSS"
    head = [
        "vocab",
        "path",
        "step median (s)",
        "step CPU (s)",
        f"step peak {mem} (MiB)",
        "after setup (MiB)",
        "step incr. (MiB)",
        "log-prob+bwd median (s)",
        f"log-prob peak {mem} (MiB)",
        "log-prob incr. (MiB)",
    ]
    lines, notes = [], []
    for row in rows:
        step, lp = row.get("step"), row.get("logprob")
        label = LABELS[row["path"]]
        if row.get("skipped"):
            label += " *"
            notes.append(f"* {row['skipped']}")
        failed = [part for part in ("step", "logprob") if row.get(f"{part}_error")]
        if failed:
            label += " !"
            notes.append(f"! {' and '.join(failed)} failed (the JSON has the worker's last output lines)")
        s_peak, s_incr = _mem_columns(step, device, "step")  # "-" where not run or failed
        l_peak, l_incr = _mem_columns(lp, device, "logprob")
        setup = "-"
        if step is not None:
            setup = f"{step['cuda_after_setup_mb'] if device == 'cuda' else step['rss_after_setup_mb']:.0f}"
        lines.append(
            [
                f"{row['vocab']:,}",
                label,
                f"{step['median_s']:.3f}" if step else "-",
                f"{statistics.median(step['step_cpu_times_s']):.3f}" if step else "-",
                s_peak,
                setup,
                s_incr,
                f"{lp['median_s']:.3f}" if lp else "-",
                l_peak,
                l_incr,
            ]
        )
    widths = [max(len(h), *(len(r[i]) for r in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*r) for r in lines]
    out += sorted(set(notes))
    return "\n".join(out)


def _chunk_arg(text: str) -> int | str:
    """``--chunk``: a positive number of tokens, or auto."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "--vocabs",
        type=int,
        nargs="+",
        default=[32000, 151936],
        help="model vocabularies (default 32000 151936)",
    )
    p.add_argument(
        "--chunk",
        type=_chunk_arg,
        default="auto",
        help="mmalign's model.logprob_chunk_size: tokens, or auto (default) sized from --memory-mb",
    )
    p.add_argument(
        "--memory-mb",
        type=float,
        default=256.0,
        help="mmalign's model.logprob_memory_mb, the budget of an auto chunk (default 256)",
    )
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma list of {', '.join(PATHS)} (default all)")
    p.add_argument("--parts", default="step,logprob", help="comma list of step, logprob (default both)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (default 4)")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="completion length (default 64)")
    p.add_argument("--hidden", type=int, default=256, help="model hidden size (default 256)")
    p.add_argument("--layers", type=int, default=2, help="model layers (default 2)")
    p.add_argument("--bpe-vocab", type=int, default=1024, help="BPE tokenizer vocabulary (default 1024)")
    p.add_argument("--steps", type=int, default=2, help="timed training steps (default 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps (default 1)")
    p.add_argument(
        "--lp-repeats", type=int, default=2, help="timed log-prob runs after 1 warm-up (default 2)"
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights dtype")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per worker (default: $OMP_NUM_THREADS if set, else all cores)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json", type=Path, default=None, help="results file (default results/logprob_memory_<device>.json)"
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds per worker before giving up")
    p.add_argument("--print", type=Path, metavar="JSON", help="print the table of a results file and exit")
    p.add_argument("--lp-worker", nargs=2, type=Path, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.lp_worker is None:
        paths = [x.strip() for x in args.paths.split(",") if x.strip()]
        parts = [x.strip() for x in args.parts.split(",") if x.strip()]
        if not paths or set(paths) - set(PATHS):
            p.error(f"--paths: unknown {sorted(set(paths) - set(PATHS))}; choose from {list(PATHS)}")
        if not parts or set(parts) - {"step", "logprob"}:
            p.error(f"--parts: choose from step, logprob; got {parts}")
        if args.memory_mb <= 0:
            p.error("--memory-mb must be > 0")
        if args.group_size < 2:
            p.error("--group-size must be >= 2 (TRL refuses smaller groups)")
        if any(v < args.bpe_vocab for v in args.vocabs):
            p.error(f"--vocabs must all be >= --bpe-vocab ({args.bpe_vocab})")
        if args.steps < 1 or args.warmup < 0 or args.lp_repeats < 1:
            p.error("--steps and --lp-repeats must be >= 1, --warmup >= 0")
        args.paths, args.parts = paths, parts
        omp = os.environ.get("OMP_NUM_THREADS", "")
        args.threads = args.threads or (int(omp) if omp.isdigit() and int(omp) > 0 else os.cpu_count() or 1)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print is not None:
        saved = json.loads(args.print.read_text())
        print(saved.get("settings_line", ""))
        print(format_table(saved["rows"], saved["settings"]["device"]))
        return 0
    if args.lp_worker is not None:
        spec_path, out_path = args.lp_worker
        out_path.write_text(json.dumps(run_logprob(json.loads(spec_path.read_text()))))
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
            return 2
    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    trl_note = f"not run: {', '.join(missing)} not installed (pip install -e '.[bench]')" if missing else None
    threads = args.threads
    out_json = args.json or HERE / "results" / f"logprob_memory_{args.device}.json"
    sys.path.insert(0, str(ROOT))
    t_start = time.perf_counter()
    load = {"before": os.getloadavg()}
    rows: list[dict[str, Any]] = []
    models: dict[int, dict[str, Any]] = {}
    for vocab in args.vocabs:
        with tempfile.TemporaryDirectory(prefix="bench_logprob_memory_") as tmp:
            work = Path(tmp)
            base = _step_args(args, vocab, "mmalign-full")
            prompts = bsv.make_prompts(base.dataset_size, base.prompt_words, args.seed)
            t0 = time.perf_counter()
            models[vocab] = info = bsv.build_model(work / "model", base, prompts)
            print(
                f"vocab {vocab:,}: Qwen2, {info['params'] / 1e6:.2f}M parameters, hidden {args.hidden}, "
                f"{args.layers} layers, tokenizer {info['tokenizer_size']} tokens (built in "
                f"{time.perf_counter() - t0:.1f}s)",
                flush=True,
            )
            for path in args.paths:
                row: dict[str, Any] = {"vocab": vocab, "path": path}
                rows.append(row)
                if path == "trl" and trl_note:
                    row["skipped"] = trl_note
                    print(f"  {LABELS[path]}: {trl_note}", flush=True)
                    continue
                sargs = _step_args(args, vocab, path)
                spec = bsv.make_spec(sargs, work, prompts, info, threads)
                tag = f"{path}_{vocab}"
                # a worker that fails (e.g. out of memory on the full-logits path) fails its row, not the run
                if "step" in args.parts:
                    fw = "trl" if path == "trl" else "mmalign"
                    try:
                        row["step"] = r = bsv._run_workers([fw], spec, work, f"_{tag}", args.timeout)[fw]
                        print(
                            f"  {LABELS[path]}: step median {r['median_s']:.3f}s, steps "
                            f"{[round(x, 3) for x in r['step_times_s']]}, other processes' CPU "
                            f"{100 * r['other_procs_cpu_frac']:.0f}%",
                            flush=True,
                        )
                    except RuntimeError as e:
                        row["step_error"] = str(e)
                        print(f"  {LABELS[path]}: step FAILED: {e}", flush=True)
                if "logprob" in args.parts:
                    lp_spec = dict(
                        spec, path=path, chunk=args.chunk, memory_mb=args.memory_mb, repeats=args.lp_repeats
                    )
                    try:
                        row["logprob"] = r = _run_logprob_worker(lp_spec, work, tag, args.timeout)
                        print(
                            f"  {LABELS[path]}: log-prob + backward median {r['median_s']:.3f}s, mean "
                            f"log-prob {r['logp_mean']:.4f}",
                            flush=True,
                        )
                    except RuntimeError as e:
                        row["logprob_error"] = str(e)
                        print(f"  {LABELS[path]}: log-prob FAILED: {e}", flush=True)
    load["after"] = os.getloadavg()
    total = time.perf_counter() - t_start
    b = args.prompts * args.group_size
    settings_line = (
        f"settings: {args.prompts} prompts x {args.group_size} = {b} samples, {args.max_new_tokens} new tokens "
        f"({b * args.max_new_tokens} completion tokens), hidden {args.hidden}, {args.layers} layers, "
        f"{args.dtype}, chunk {args.chunk} ({args.memory_mb:g} MiB budget), device {args.device}, {threads} threads; steps {args.warmup} warm-up + "
        f"{args.steps} timed, log-prob 1 warm-up + {args.lp_repeats} timed; load average "
        f"{load['before'][0]:.1f} before, {load['after'][0]:.1f} after; {total / 60:.1f} min"
    )
    print()
    print(settings_line)
    print(format_table(rows, args.device))
    payload = {
        "benchmark": "logprob_memory",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": bsv._machine(args.device),
        "versions": bsv._versions(),
        "settings": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "lp_worker"
        }
        | {"threads": threads},
        "load_average_1min": load,
        "settings_line": settings_line,
        "total_wall_s": total,
        "models": {str(v): m for v, m in models.items()},
        "memory": (
            "step: peak over the worker process (CPU: ru_maxrss; CUDA: max_memory_allocated over the timed "
            "steps), increase over the memory once the trainer is built; log-prob: peak over the timed runs "
            "(CPU: VmHWM after /proc/self/clear_refs; CUDA: max_memory_allocated after a reset), increase over "
            "the memory before them"
        ),
        "rows": rows,
    }
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
