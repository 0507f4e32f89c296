"""Shared-prefix (Prefix Grouper) vs plain log-probs + backward, for one group of G completions.

    python benchmarks/bench_shared_prefix.py [--prompt 512 --completion 64 --groups 8,16 --hidden 256 --layers 4]

For each G and each mode, a fresh subprocess builds the same random tiny Qwen2 model (saved with
`save_pretrained`, loaded back with `from_pretrained`), makes one group of G completions of one
prompt, and times `TextPolicy.evaluate` (per-token log-probs with grad) + `backward()` (median of
`--repeats` after one warm-up), reporting the time and the process's peak RSS increase over its
RSS before the first forward. Results go to benchmarks/results/shared_prefix.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(args: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    from mmalign import tiny
    from mmalign.batch import Rollout
    from mmalign.policies.text import TextPolicy

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        words = [f"w{i} x{i % 7} y{i % 13}." for i in range(400)]
        tok = tiny.train_bpe_tokenizer(words, vocab_size=args.vocab)
        tiny.tiny_causal_lm(
            tok, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        ).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        return
    pol = TextPolicy.from_pretrained(str(model_dir), shared_prefix=args.mode == "shared")
    vocab = len(pol.tokenizer)
    g = args.g
    prompt = torch.randint(2, vocab, (1, args.prompt)).repeat(g, 1)
    completion = torch.randint(2, vocab, (g, args.completion))
    mask = torch.ones(g, args.completion, dtype=torch.bool)
    lengths = torch.randint(args.completion // 2, args.completion + 1, (g,))
    mask &= torch.arange(args.completion)[None, :] < lengths[:, None]  # ragged completions
    ro = Rollout(
        group=torch.zeros(g, dtype=torch.long), mask=mask, prompts=["p"] * g,
        payload={"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion},
    )
    pol.model.train()
    rss0 = _rss_mb()
    times = []
    for i in range(args.repeats + 1):
        pol.model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        logp = pol.evaluate(ro).logp
        logp.sum().backward()
        dt = time.perf_counter() - t0
        if i:
            times.append(dt)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"mode": args.mode, "G": g, "median_s": statistics.median(times), "times_s": times,
                      "peak_rss_increase_mb": peak - rss0}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--completion", type=int, default=64)
    p.add_argument("--groups", default="8,16")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", type=Path, default=HERE / "results" / "shared_prefix.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="plain", help=argparse.SUPPRESS)
    p.add_argument("--g", type=int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    common = [f"--prompt={args.prompt}", f"--completion={args.completion}", f"--hidden={args.hidden}",
              f"--layers={args.layers}", f"--vocab={args.vocab}", f"--repeats={args.repeats}",
              f"--threads={args.threads}"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        subprocess.run([sys.executable, __file__, "--worker", f"--model-dir={model_dir}", *common], check=True)
        for g in [int(x) for x in args.groups.split(",")]:
            row = {}
            for mode in ("plain", "shared"):
                out = subprocess.run(
                    [sys.executable, __file__, "--worker", f"--model-dir={model_dir}", f"--mode={mode}", f"--g={g}",
                     *common], check=True, capture_output=True, text=True,
                ).stdout.strip().splitlines()[-1]
                row[mode] = json.loads(out)
            row["speedup"] = row["plain"]["median_s"] / row["shared"]["median_s"]
            results.append({"G": g, **row})
    print(f"prompt {args.prompt} tokens, completion {args.completion} tokens, hidden {args.hidden}, "
          f"{args.layers} layers, vocab {args.vocab}, {args.threads} threads (log-probs + backward, one group)")
    print(f"{'G':>3}  {'plain (s)':>9}  {'shared (s)':>10}  {'speed-up':>8}  {'plain peak+ (MiB)':>17}  {'shared peak+ (MiB)':>18}")
    for r in results:
        print(f"{r['G']:>3}  {r['plain']['median_s']:>9.3f}  {r['shared']['median_s']:>10.3f}  {r['speedup']:>7.2f}x  "
              f"{r['plain']['peak_rss_increase_mb']:>17.0f}  {r['shared']['peak_rss_increase_mb']:>18.0f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "results": results}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
