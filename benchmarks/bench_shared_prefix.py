"""Shared-prefix (Prefix Grouper) vs plain log-probs + backward, for one group of G completions.

    python benchmarks/bench_shared_prefix.py [--prompt 512 --completion 64 --groups 8,16 --hidden 256 --layers 4]
    python benchmarks/bench_shared_prefix.py --case vlm [--image 448 --text-words 60 --groups 8,16]

For each G and each mode, a fresh subprocess loads the same random tiny model (built once, saved with
`save_pretrained`, loaded back with `from_pretrained`), makes one group of G completions of one prompt,
and times the policy's `evaluate` (per-token log-probs with grad) + `backward()` (median of `--repeats`
after one warm-up), reporting the time and the process's peak RSS increase over its RSS before the
first forward.

``--case text`` (default): a Qwen2 causal LM through `TextPolicy`, a prompt of `--prompt` random tokens;
results go to benchmarks/results/shared_prefix.json.

``--case vlm``: a Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration` built from config kwargs: the text
model as in the text case, a vision tower of `--vision-layers` blocks of width `--vision-hidden` with
window attention) through `VLMPolicy` (mode = ``shared_prefix`` given to `VLMPolicy.from_pretrained`),
one `--image` x `--image` picture plus `--text-words` words of text in the chat template; in plain mode
every sample runs the vision tower and the prompt, in shared mode each runs once per group. Results go
to benchmarks/results/shared_prefix_vlm.json.
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
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _time_evaluate(pol: Any, ro: Any, args: argparse.Namespace, extra: dict[str, Any] | None = None) -> None:
    """Median time of `evaluate` + `backward` and the peak RSS increase; prints one JSON line."""
    pol.model.train()
    rss0 = _rss_mb()
    times = []
    for i in range(args.repeats + 1):
        pol.model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        logp = pol.action_stats(ro).logp
        logp.sum().backward()
        dt = time.perf_counter() - t0
        if i:
            times.append(dt)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "mode": args.mode,
                "G": args.g,
                "median_s": statistics.median(times),
                "times_s": times,
                "peak_rss_increase_mb": peak - rss0,
                **(extra or {}),
            }
        )
    )


def worker(args: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    if args.case == "vlm":
        vlm_worker(args)
        return

    from mmalign import tiny
    from mmalign.data.batch import Rollout
    from mmalign.policies.text import TextPolicy

    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        words = [f"w{i} x{i % 7} y{i % 13}." for i in range(400)]
        tok = tiny.train_bpe_tokenizer(words, vocab_size=args.vocab)
        tiny.tiny_causal_lm(
            tok,
            hidden_size=args.hidden,
            intermediate_size=3 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
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
        group=torch.zeros(g, dtype=torch.long),
        mask=mask,
        prompts=["p"] * g,
        payload={"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion},
    )
    _time_evaluate(pol, ro, args)


def build_vlm(args: argparse.Namespace, model_dir: Path) -> None:
    """A random Qwen2.5-VL + processor (in-process BPE with Qwen2-VL's special tokens), saved to `model_dir`."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
    )
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from mmalign import tiny
    from mmalign.tiny import vlm as tiny_vlm

    words = [f"w{i} x{i % 7} y{i % 13}." for i in range(400)]
    tok = tiny.train_bpe_tokenizer(words, vocab_size=args.vocab, extra_special=tiny_vlm.VLM_SPECIALS)
    tok.chat_template = tiny_vlm.VLM_CHAT_TEMPLATE
    pixels = args.image * args.image
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(min_pixels=pixels, max_pixels=pixels),
        chat_template=tiny_vlm.VLM_CHAT_TEMPLATE,
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in tiny_vlm.VLM_SPECIALS}
    half = args.hidden // 4 // 2  # head_dim / 2 rotary frequencies, split over (t, h, w) as in Qwen2.5-VL
    text = dict(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [half // 4, half * 3 // 8, half - half // 4 - half * 3 // 8],
        },
        eos_token_id=ids[tiny_vlm.IM_END],
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    vision = dict(
        depth=args.vision_layers,
        hidden_size=args.vision_hidden,
        intermediate_size=2 * args.vision_hidden,
        num_heads=4,
        out_hidden_size=args.hidden,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=list(range(args.vision_layers // 2 - 1, args.vision_layers, 2)),
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[tiny_vlm.IMAGE_PAD],
        video_token_id=ids[tiny_vlm.VIDEO_PAD],
        vision_start_token_id=ids[tiny_vlm.VISION_START],
        vision_end_token_id=ids[tiny_vlm.VISION_END],
        tie_word_embeddings=True,
    )
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = [ids[tiny_vlm.IM_END], tok.eos_token_id]
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)


def vlm_worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from PIL import Image

    from mmalign.data.batch import Rollout
    from mmalign.policies.token_scoring import VISION_KEYS
    from mmalign.policies.vlm import VLMPolicy

    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        build_vlm(args, model_dir)
        return
    pol = VLMPolicy.from_pretrained(str(model_dir), shared_prefix=args.mode == "shared")
    assert pol.shared_prefix == (args.mode == "shared"), (
        "the shared-prefix path is not available for this model"
    )
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (args.image, args.image, 3), dtype=np.uint8))
    text = " ".join(f"w{i % 400}" for i in range(args.text_words))
    enc = pol.encode_row({"prompt": text, "images": [image]})
    g, c = args.g, args.completion
    prompt = enc["input_ids"][None].repeat(g, 1)
    special = max(pol.tokenizer.all_special_ids + pol.suppressed_ids)
    completion = torch.randint(special + 1, len(pol.tokenizer), (g, c))
    lengths = torch.randint(c // 2, c + 1, (g,))
    mask = torch.arange(c)[None, :] < lengths[:, None]  # ragged completions
    payload: dict[str, Any] = {
        "prompt_ids": prompt,
        "prompt_mask": torch.ones_like(prompt),
        "mm_token_type_ids": enc["mm_token_type_ids"][None].repeat(g, 1),
        "completion_ids": completion,
    }
    for key in VISION_KEYS:
        payload[key] = [enc[key]] * g
    ro = Rollout(group=torch.zeros(g, dtype=torch.long), mask=mask, prompts=[text] * g, payload=payload)
    image_tokens = int((enc["input_ids"] == pol.processor.image_token_id).sum())
    _time_evaluate(
        pol,
        ro,
        args,
        {
            "prompt_tokens": int(prompt.shape[1]),
            "image_tokens": image_tokens,
            "image_patches": int(enc["pixel_values"].shape[0]),
        },
    )


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
    p.add_argument("--case", choices=["text", "vlm"], default="text")
    p.add_argument("--image", type=int, default=448, help="vlm: image side in pixels (multiple of 28)")
    p.add_argument("--text-words", type=int, default=60, help="vlm: words of prompt text after the image")
    p.add_argument("--vision-hidden", type=int, default=128, help="vlm: vision tower width")
    p.add_argument("--vision-layers", type=int, default=4, help="vlm: vision tower blocks")
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help="default: results/shared_prefix.json (text), results/shared_prefix_vlm.json (vlm)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="plain", help=argparse.SUPPRESS)
    p.add_argument("--g", type=int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.json is None:
        args.json = (
            HERE / "results" / ("shared_prefix_vlm.json" if args.case == "vlm" else "shared_prefix.json")
        )
    common = [
        f"--case={args.case}",
        f"--prompt={args.prompt}",
        f"--completion={args.completion}",
        f"--hidden={args.hidden}",
        f"--layers={args.layers}",
        f"--vocab={args.vocab}",
        f"--repeats={args.repeats}",
        f"--threads={args.threads}",
        f"--image={args.image}",
        f"--text-words={args.text_words}",
        f"--vision-hidden={args.vision_hidden}",
        f"--vision-layers={args.vision_layers}",
    ]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        subprocess.run(
            [sys.executable, __file__, "--worker", f"--model-dir={model_dir}", *common], check=True
        )
        for g in [int(x) for x in args.groups.split(",")]:
            row = {}
            for mode in ("plain", "shared"):
                out = (
                    subprocess.run(
                        [
                            sys.executable,
                            __file__,
                            "--worker",
                            f"--model-dir={model_dir}",
                            f"--mode={mode}",
                            f"--g={g}",
                            *common,
                        ],
                        check=True,
                        capture_output=True,
                        text=True,
                    )
                    .stdout.strip()
                    .splitlines()[-1]
                )
                row[mode] = json.loads(out)
            row["speedup"] = row["plain"]["median_s"] / row["shared"]["median_s"]
            results.append({"G": g, **row})
    if args.case == "vlm":
        first = results[0]["plain"]
        print(
            f"Qwen2.5-VL: prompt {first['prompt_tokens']} tokens ({first['image_tokens']} image tokens from a "
            f"{args.image}x{args.image} image, {first['image_patches']} patches; vision tower {args.vision_layers} "
            f"blocks x {args.vision_hidden}), completion {args.completion} tokens, hidden {args.hidden}, "
            f"{args.layers} layers, vocab {args.vocab}, {args.threads} threads (log-probs + backward, one group)"
        )
    else:
        print(
            f"prompt {args.prompt} tokens, completion {args.completion} tokens, hidden {args.hidden}, "
            f"{args.layers} layers, vocab {args.vocab}, {args.threads} threads (log-probs + backward, one group)"
        )
    print(
        f"{'G':>3}  {'plain (s)':>9}  {'shared (s)':>10}  {'speed-up':>8}  {'plain peak+ (MiB)':>17}  {'shared peak+ (MiB)':>18}"
    )
    for r in results:
        print(
            f"{r['G']:>3}  {r['plain']['median_s']:>9.3f}  {r['shared']['median_s']:>10.3f}  {r['speedup']:>7.2f}x  "
            f"{r['plain']['peak_rss_increase_mb']:>17.0f}  {r['shared']['peak_rss_increase_mb']:>18.0f}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"settings": vars(args) | {"json": str(args.json)}, "results": results}, indent=1)
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
