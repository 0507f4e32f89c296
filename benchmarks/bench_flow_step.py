"""One Flow-GRPO training step (`GroupTrainer.train_step()`) on a tiny SD3-style image model (default) or a
tiny Wan video model (``--family wan``): time and peak memory.

    python benchmarks/bench_flow_step.py [--device cpu|cuda --steps 3 --size 128 --prompts 2 --group 8
                                          --num-steps 10 --window 2 --out benchmarks/results/flow_step_cpu.json]
    python benchmarks/bench_flow_step.py --family wan [--frames 9 --size 64 --text-len 64 --ffn-dim 256
                                          --out benchmarks/results/flow_step_video_cpu.json]

A 2x2 grid, one configuration per fresh subprocess:

- reward: ``pixel`` = `jpeg_compressibility` (the trainer VAE-decodes the final latents to images
  because the reward needs ``images``) vs ``latent`` = `bench_latent_energy`, a reward registered
  here with ``needs = {"latents"}`` that reads ``outputs["latents"]`` (no decode);
- trained steps: ``full`` = every one of the `--num-steps` denoising steps is an SDE step and trained,
  vs ``window`` = SD3Policy ``window_size=--window`` (SDE + trained inside a window at a random
  start, deterministic Euler ODE outside it; Flow-GRPO-Fast).

The model (random weights, built from config kwargs, saved with ``save_pretrained`` into a temporary
folder in the SD3 layout, loaded back with `SD3Policy.from_pretrained`): an SD3Transformer2DModel
(`--layers` joint blocks, `--heads` x `--head-dim`, patch 2, 16 latent channels), an AutoencoderKL with
4 down / 4 up blocks (8x down-sampling: `--size` 128 -> 16x16 latents; channels 32/64/64/64, SD3's
scaling and shift factors, no quant convs) and one small CLIP text encoder (byte tokenizer, 16 tokens).

Each configuration runs in its own worker process, which builds the policy and the trainer. By
default all workers are loaded first and then run in lockstep: step i of every configuration, one
at a time (rotating order), so load from other programs that drifts over time hits all of them
alike (`--no-interleave`: one configuration after the other). Each runs `--warmup` untimed steps,
then `--steps` timed steps; the table shows the median (and the fastest) step. Step time = wall
time of `train_step()`; the split comes from the trainer's metrics (``time/rollout_s``: sampling +
advantages; ``time/reward_s``: decode + reward; ``time/update_s``: log-probs with grad, backward,
optimizer), with the decode timed on its own by wrapping `policy.decode`. "CPU s" is the worker's
user + system CPU time per step; "other CPU" the share of the machine's CPU that other processes
took during its steps (from /proc/stat).

``--family wan`` (video): the same grid and measurements on a `WanPolicy` (text to video), with ``pixel`` =
the registered `flicker` reward (``negate=True``: minus the mean absolute difference of adjacent frames; it
needs ``videos``, so the trainer decodes the whole clip with the Wan VAE) and ``latent`` =
`bench_latent_energy` on the video latents [B, 16, F_lat, h, w]. The folder (random weights, written with
`WanComponents.save_pretrained`, loaded with `WanPolicy.from_pretrained` as a real model id would be): a
``WanTransformer3DModel`` (`--layers` blocks, `--heads` x `--head-dim`, `--ffn-dim`, patch (1, 2, 2),
text_dim 64, freq_dim 64), an ``AutoencoderKLWan`` with the real model's factors (z_dim 16,
``temperal_downsample`` [False, True, True]: 4x in time, 8x in space; base_dim 16, dim_mult [1, 2, 4, 4], one
res block per stage, Wan 2.1's ``latents_mean`` / ``latents_std``), a 2-layer ``UMT5EncoderModel`` (d_model
64) with the character-level T5 tokenizer of `mmalign.tiny.sd3`, and a flow-matching Euler scheduler
(shift 3). `--frames` 9 x `--size` 64: 3 latent frames of 8 x 8 (48 video tokens), `--text-len` UMT5
tokens per prompt. The results go to ``flow_step_video_<device>.json`` by default.

Memory: on CPU, the worker's peak RSS (``ru_maxrss``, after all steps) and its increase over the
worker's current RSS (VmRSS) just before the first (warm-up) step, i.e. once the libraries are
imported, the model is loaded and the trainer (optimizer) is built. On CUDA,
``torch.cuda.max_memory_allocated`` over all steps (reset before the first) and its increase over
``torch.cuda.memory_allocated`` before the first step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from rewards import Reward, RewardBatch, register_reward  # noqa: E402

CONFIGS = [("pixel", "full"), ("pixel", "window"), ("latent", "full"), ("latent", "window")]
FAMILY_REWARDS = {
    "sd3": {"pixel": {"name": "jpeg_compressibility"}, "latent": {"name": "bench_latent_energy"}},
    "wan": {
        "pixel": {"name": "flicker", "kwargs": {"negate": True}},
        "latent": {"name": "bench_latent_energy"},
    },
}
"""The reward config entry of each (family, reward kind)."""
WAN_TEXT_DIM = 64
"""Hidden size of the Wan family's UMT5 text encoder (the transformer's ``text_dim``)."""


@register_reward("bench_latent_energy")
class LatentEnergy(Reward):
    """Minus the mean squared final latent (a cheap latent-space reward: reads latents, never pixels)."""

    needs = {"latents"}

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        z = batch["latents"].float()
        return -z.pow(2).flatten(1).mean(1)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _busy_jiffies() -> int:
    """Non-idle CPU time of the whole machine, in clock ticks (Linux /proc/stat; 0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0
    return sum(v) - v[3] - (v[4] if len(v) > 4 else 0)  # minus idle and iowait


def _count(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def build_model(path: Path, args: argparse.Namespace) -> dict[str, int]:
    """Write the model folder of `args.family` at `path`; returns its parameter counts and latent size."""
    return build_wan(path, args) if args.family == "wan" else build_sd3(path, args)


def build_wan(path: Path, args: argparse.Namespace) -> dict[str, int]:
    """Write the Wan folder (model_index.json, transformer/, vae/, scheduler/, text_encoder/, tokenizer/)
    with `WanComponents.save_pretrained` (see the module docstring for the architecture)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

    from mmalign.policies.wan_components import WanComponents, latent_frames
    from mmalign.tiny.sd3 import t5_char_tokenizer
    from mmalign.tiny.wan import tiny_umt5

    down = [False, True, True]  # the real Wan VAE: 4x in time, 8x in space
    temporal, spatial = 2 ** sum(down), 2 ** len(down)
    if args.size % (2 * spatial):
        raise SystemExit(f"--size must be a multiple of {2 * spatial} (VAE 8x, patch 2), got {args.size}")
    if (args.frames - 1) % temporal:
        raise SystemExit(
            f"--frames must be 1 + a multiple of {temporal} (the VAE's 4x in time), got {args.frames}"
        )
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=16,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=down,
        scale_factor_temporal=temporal,
        scale_factor_spatial=spatial,
    )
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=args.heads,
        attention_head_dim=args.head_dim,
        in_channels=16,
        out_channels=16,
        text_dim=WAN_TEXT_DIM,
        freq_dim=64,
        ffn_dim=args.ffn_dim,
        num_layers=args.layers,
        rope_max_seq_len=64,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    tokenizer = t5_char_tokenizer()
    text_encoder = tiny_umt5(tokenizer, WAN_TEXT_DIM, num_layers=2, num_heads=4, d_kv=16, buckets=16)
    WanComponents(transformer, vae, scheduler, text_encoder, tokenizer).save_pretrained(path)
    f_lat, hw = latent_frames(args.frames, temporal), args.size // spatial
    return {
        "transformer": _count(transformer),
        "vae": _count(vae),
        "vae_decoder": _count(vae.decoder) + _count(vae.post_quant_conv),
        "text_encoder": _count(text_encoder),
        "latent_frames": f_lat,
        "latent_size": hw,
        "video_tokens": f_lat * (hw // 2) ** 2,
    }


def build_sd3(path: Path, args: argparse.Namespace) -> dict[str, int]:
    """Write the tiny SD3-style folder (transformer/, vae/, scheduler/, text_encoder/, tokenizer/)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from mmalign.tiny.sd3 import TOKEN_LENGTH, clip_byte_tokenizer

    if args.size % 8:
        raise SystemExit(f"--size must be a multiple of 8 (the VAE down-samples 8x), got {args.size}")
    latent = args.size // 8
    torch.manual_seed(0)
    inner = args.heads * args.head_dim
    text_hidden, pooled = 64, 64
    transformer = SD3Transformer2DModel(
        sample_size=latent,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=args.layers,
        attention_head_dim=args.head_dim,
        num_attention_heads=args.heads,
        joint_attention_dim=text_hidden,
        caption_projection_dim=inner,
        pooled_projection_dim=pooled,
        pos_embed_max_size=latent,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32, 64, 64, 64),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=16,
        sample_size=args.size,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    tokenizer = clip_byte_tokenizer()
    text_encoder = CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=text_hidden,
            intermediate_size=2 * text_hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=TOKEN_LENGTH,
            projection_dim=pooled,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    path.mkdir(parents=True, exist_ok=True)
    transformer.save_pretrained(path / "transformer")
    vae.save_pretrained(path / "vae")
    scheduler.save_pretrained(path / "scheduler")
    text_encoder.save_pretrained(path / "text_encoder")
    tokenizer.save_pretrained(path / "tokenizer")

    def count(m: torch.nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    return {
        "transformer": count(transformer),
        "vae": count(vae),
        "vae_decoder": count(vae.decoder),
        "text_encoder": count(text_encoder),
        "latent_size": latent,
    }


class Worker:
    """One configuration in this process: the policy, the trainer, and its timed steps."""

    def __init__(self, args: argparse.Namespace) -> None:
        from mmalign.config import config_from_dict
        from mmalign.policies.sd3 import SD3Policy
        from mmalign.trainer import GroupTrainer
        from pipelines import TrainingSetup
        from rewards import RewardSet

        self.args = args
        torch.manual_seed(0)
        torch.set_num_threads(args.threads)
        self.dev = dev = torch.device(args.device)
        window = args.window if args.trained == "window" else None
        if args.family == "wan":
            from mmalign.policies.wan import WanPolicy

            pol = WanPolicy.from_pretrained(
                args.model_dir,
                num_frames=args.frames,
                height=args.size,
                width=args.size,
                max_sequence_length=args.text_len,
                num_steps=args.num_steps,
                window_size=window,
                seed=0,
            )
        else:
            pol = SD3Policy.from_pretrained(
                args.model_dir, num_steps=args.num_steps, window_size=window, seed=0
            )
        for m in (pol.model, pol.vae, pol.text_encoder):
            m.to(dev)
        self.decode_s: list[float] = []
        inner_decode = pol.decode

        def timed_decode(rollout):  # noqa: ANN001, ANN202
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = inner_decode(rollout)
            self.decode_s.append(
                time.perf_counter() - t0
            )  # decode copies the images to the CPU: synchronised
            return out

        pol.decode = timed_decode
        self.run_dir = tempfile.TemporaryDirectory()
        cfg = config_from_dict(
            {
                "pipeline": "bench_flow_step",
                "output_dir": self.run_dir.name,
                "rollout": {"group_size": args.group, "prompts_per_step": args.prompts},
                "rewards": [FAMILY_REWARDS[args.family][args.reward]],
                "trainer": {
                    "steps": 10**6,
                    "lr": 1e-4,
                    "progress_bar": False,
                    "save_every": 10**6,
                    "sample_every": 10**6,
                    "cpu": dev.type == "cpu",
                },
            },
            "bench_flow_step",
        )
        rows = [
            {"prompt": p}
            for p in (
                "a red square",
                "two blue circles",
                "a green triangle on grey",
                "one yellow star",
                "three small dots",
                "a purple ring",
            )
        ]
        self.trainer = GroupTrainer(cfg, TrainingSetup(policy=pol, rewards=RewardSet(cfg.rewards), data=rows))
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.alloc0 = torch.cuda.memory_allocated() / 2**20 if dev.type == "cuda" else None
        self.rss0, self.maxrss0 = _rss_mb(), _maxrss_mb()
        self.n = 0
        self.steps: list[dict] = []

    def step(self) -> dict:
        """One `train_step()`: wall time, the trainer's split, CPU time of this process and of the others."""
        tick = os.sysconf("SC_CLK_TCK")
        n_dec = len(self.decode_s)
        busy0, own0 = _busy_jiffies(), sum(os.times()[:2])
        t0 = time.perf_counter()
        m = self.trainer.train_step()
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        own = sum(os.times()[:2]) - own0
        other = max(0.0, (_busy_jiffies() - busy0) / tick - own)
        rec = {
            "step_s": dt,
            "rollout_s": m["time/rollout_s"],
            "reward_s": m["time/reward_s"],
            "decode_s": sum(self.decode_s[n_dec:]),
            "update_s": m["time/update_s"],
            "cpu_s": own,
            "other_cpu_frac": other / (dt * (os.cpu_count() or 1)),
            "trained_steps": int(self.trainer._last_batch.num_actions),
            "loss": m["loss"],
            "reward_mean": m["reward/mean"],
            "warmup": self.n < self.args.warmup,
        }
        self.n += 1
        if not rec["warmup"]:
            self.steps.append(rec)
        return rec

    def result(self) -> dict:
        args, steps = self.args, self.steps
        res = {
            "reward": args.reward,
            "trained": args.trained,
            "reward_name": FAMILY_REWARDS[args.family][args.reward]["name"],
            "decoded": any(k in self.trainer._last_batch.outputs for k in ("images", "videos")),
            "trained_steps": steps[-1]["trained_steps"],
            "steps": steps,
            "min_step_s": min(s["step_s"] for s in steps),
            "other_cpu_frac": sum(s["other_cpu_frac"] * s["step_s"] for s in steps)
            / sum(s["step_s"] for s in steps),
        }
        for key in ("step_s", "rollout_s", "reward_s", "decode_s", "update_s", "cpu_s"):
            res[f"median_{key}"] = statistics.median(s[key] for s in steps)
            res[f"min_{key}"] = min(s[key] for s in steps)
        if self.dev.type == "cuda":
            res["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
            res["base_mb"] = self.alloc0
        else:
            res["peak_mb"] = _maxrss_mb()
            res["base_mb"] = self.rss0
            res["maxrss_before_steps_mb"] = self.maxrss0
        res["peak_increase_mb"] = res["peak_mb"] - res["base_mb"]
        self.run_dir.cleanup()
        return res


def worker_loop(args: argparse.Namespace) -> None:
    """Lockstep protocol on stdin/stdout: reply ``@@ready``, then one ``@@{json}`` line per command
    (``step``: one training step; ``result``: the summary, then exit)."""
    w = Worker(args)
    print("@@ready", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "step":
            print("@@" + json.dumps(w.step()), flush=True)
        elif cmd == "result":
            print("@@" + json.dumps(w.result()), flush=True)
            return


class Proc:
    """The parent's handle on one worker subprocess."""

    def __init__(self, spec: str, cmd: list[str], log_dir: Path) -> None:
        self.spec = spec
        self.log = log_dir / f"{spec}.stderr"
        self.p = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log.open("w"),
            text=True,
            bufsize=1,
        )

    def read(self) -> str:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith("@@"):
                return line[2:].strip()
        raise RuntimeError(f"worker {self.spec} exited (rc {self.p.wait()}):\n{self.log.read_text()[-3000:]}")

    def ask(self, cmd: str) -> dict:
        assert self.p.stdin is not None
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return json.loads(self.read())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--family",
        choices=("sd3", "wan"),
        default="sd3",
        help="sd3: the tiny SD3-style image model (default); wan: a tiny Wan text-to-video model",
    )
    p.add_argument(
        "--size",
        type=int,
        default=None,
        help="image / frame height and width (latents: size / 8; default 128, with --family wan 64)",
    )
    p.add_argument(
        "--frames", type=int, default=9, help="--family wan: frames per video (1 + a multiple of 4)"
    )
    p.add_argument("--text-len", type=int, default=64, help="--family wan: UMT5 tokens per prompt")
    p.add_argument(
        "--ffn-dim", type=int, default=256, help="--family wan: the transformer's feed-forward size"
    )
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="group size (samples per prompt)")
    p.add_argument("--num-steps", type=int, default=10, help="denoising (sampling) steps")
    p.add_argument("--window", type=int, default=2, help="trained steps in the window configurations")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads per worker (default: all cores; on a machine shared with other jobs, "
        "1 avoids oversubscription, which made 2-thread steps 3-5x slower and erratic here)",
    )
    p.add_argument(
        "--configs",
        default=",".join(f"{r}-{t}" for r, t in CONFIGS),
        help="comma-separated subset of pixel-full,pixel-window,latent-full,latent-window",
    )
    p.add_argument(
        "--no-interleave",
        dest="interleave",
        action="store_false",
        help="run the configurations one after the other (default: all loaded, in lockstep)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results JSON (default benchmarks/results/flow_step_<device>.json; with --family wan "
        "flow_step_video_<device>.json)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--reward", default="pixel", help=argparse.SUPPRESS)
    p.add_argument("--trained", default="full", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.size is None:
        args.size = 64 if args.family == "wan" else 128
    if args.worker:
        worker_loop(args)
        return
    video = args.family == "wan"
    out = args.out or HERE / "results" / f"flow_step_{'video_' if video else ''}{args.device}.json"
    common = [
        f"--family={args.family}",
        f"--frames={args.frames}",
        f"--text-len={args.text_len}",
        f"--device={args.device}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--size={args.size}",
        f"--prompts={args.prompts}",
        f"--group={args.group}",
        f"--num-steps={args.num_steps}",
        f"--window={args.window}",
        f"--threads={args.threads}",
    ]
    t_start = time.perf_counter()
    specs = [s.strip() for s in args.configs.split(",")]
    n_rounds = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / args.family
        sizes = build_model(model_dir, args)

        def start(spec: str) -> Proc:
            reward, trained = spec.split("-")
            return Proc(
                spec,
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    f"--model-dir={model_dir}",
                    f"--reward={reward}",
                    f"--trained={trained}",
                    *common,
                ],
                Path(tmp),
            )

        def show(spec: str, rec: dict) -> None:
            tag = "warm-up" if rec["warmup"] else "step"
            print(
                f"  {spec:<13} {tag:<7} {rec['step_s']:7.3f} s  (other processes: "
                f"{100 * rec['other_cpu_frac']:.0f}% of the CPU)",
                flush=True,
            )

        results = []
        if args.interleave:  # every worker loaded; step i of each in turn (rotating order), one at a time
            procs = [start(spec) for spec in specs]
            for pr in procs:
                pr.read()
            for i in range(n_rounds):
                k = i % len(procs)
                for pr in procs[k:] + procs[:k]:
                    show(pr.spec, pr.ask("step"))
            results = [pr.ask("result") for pr in procs]
            for pr in procs:
                pr.p.wait()
        else:
            for spec in specs:
                pr = start(spec)
                pr.read()
                for _ in range(n_rounds):
                    show(spec, pr.ask("step"))
                results.append(pr.ask("result"))
                pr.p.wait()
    mem = "peak CUDA alloc" if args.device.startswith("cuda") else "peak RSS"
    if video:
        lat = sizes["latent_size"]
        print(
            f"\n{args.prompts} prompts x {args.group} = {args.prompts * args.group} samples, {args.frames} frames of "
            f"{args.size}x{args.size} ({sizes['latent_frames']}x{lat}x{lat}x16 latents, {sizes['video_tokens']} "
            f"video tokens, {args.text_len} text tokens), {args.num_steps} sampling steps; Wan transformer "
            f"{sizes['transformer'] / 1e6:.2f} M, VAE {sizes['vae'] / 1e6:.2f} M (decoder "
            f"{sizes['vae_decoder'] / 1e6:.2f} M), UMT5 {sizes['text_encoder'] / 1e6:.2f} M parameters; "
            f"pixel = flicker (negated), latent = bench_latent_energy;"
            f"\n{args.device}, {args.threads} threads; median of {args.steps} steps after {args.warmup} warm-up"
        )
    else:
        print(
            f"\n{args.prompts} prompts x {args.group} = {args.prompts * args.group} samples, {args.size}x{args.size} "
            f"images ({sizes['latent_size']}x{sizes['latent_size']}x16 latents), {args.num_steps} sampling steps; "
            f"transformer {sizes['transformer'] / 1e6:.2f} M, VAE {sizes['vae'] / 1e6:.2f} M parameters; "
            f"{args.device}, {args.threads} threads; median of {args.steps} steps after {args.warmup} warm-up"
        )
    head = (
        f"{'reward':<7} {'trained':<8} {'T':>2} {'median (s)':>10} {'fastest':>7} {'CPU s':>6} {'rollout':>7} "
        f"{'decode':>6} {'reward':>6} {'update':>6} {mem + ' (MiB)':>19} {'increase':>8} {'other CPU':>9}"
    )
    print(head)
    for r in results:
        print(
            f"{r['reward']:<7} {r['trained']:<8} {r['trained_steps']:>2} {r['median_step_s']:>10.3f} "
            f"{r['min_step_s']:>7.3f} {r['median_cpu_s']:>6.2f} {r['median_rollout_s']:>7.3f} "
            f"{r['median_decode_s']:>6.3f} {r['median_reward_s'] - r['median_decode_s']:>6.3f} "
            f"{r['median_update_s']:>6.3f} {r['peak_mb']:>19.0f} {r['peak_increase_mb']:>8.0f} "
            f"{100 * r['other_cpu_frac']:>8.0f}%"
        )
    print("fastest of each phase over the timed steps (s; the least disturbed by other processes):")
    print(f"{'reward':<7} {'trained':<8} {'rollout':>7} {'decode':>6} {'reward':>6} {'update':>6} {'sum':>6}")
    for r in results:
        rew = max(0.0, r["min_reward_s"] - r["min_decode_s"])
        total = r["min_rollout_s"] + r["min_reward_s"] + r["min_update_s"]
        print(
            f"{r['reward']:<7} {r['trained']:<8} {r['min_rollout_s']:>7.3f} {r['min_decode_s']:>6.3f} {rew:>6.3f} "
            f"{r['min_update_s']:>6.3f} {total:>6.3f}"
        )
    busy = [f"{r['reward']}-{r['trained']}" for r in results if r["other_cpu_frac"] > 0.05]
    if busy:
        print(
            f"warning: other processes used more than 5% of the CPU during {', '.join(busy)}: times are noisy"
        )
    settings = {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k not in ("worker", "reward", "trained", "model_dir")
        and (video or k not in ("family", "frames", "text_len", "ffn_dim"))  # the image JSON stays as it was
    }
    machine = {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        import diffusers

        machine["diffusers"] = diffusers.__version__
    except ImportError:
        pass
    if args.device.startswith("cuda") and torch.cuda.is_available():
        machine["gpu"] = torch.cuda.get_device_name()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "settings": settings,
                "model": sizes,
                "machine": machine,
                "total_wall_s": time.perf_counter() - t_start,
                "memory": (
                    "CUDA: torch.cuda.max_memory_allocated over warm-up + timed steps; increase over "
                    "memory_allocated before the first step"
                    if args.device.startswith("cuda")
                    else "CPU: ru_maxrss of the worker process after all steps; increase over its VmRSS just before "
                    "the first (warm-up) step (trainer built, model loaded)"
                ),
                "results": results,
            },
            indent=1,
        )
    )
    print(f"wrote {out} ({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
