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
``torch.cuda.memory_allocated`` before the first step. The update phase alone is measured too: on CPU the
peak RSS (VmHWM) during the update, reset before it (``/proc/self/clear_refs``), and its increase over the RSS
at its start; on CUDA the peak allocation during the update (reset before it).

**Side by side with Flow-GRPO** (``--flow-grpo PATH``: a checkout of github.com/yifan123/flow_grpo; it is not a
package, so it is imported from that folder, nothing of it lives here):

    python benchmarks/bench_flow_step.py --flow-grpo /tmp/flow_grpo [--prompts 8 --group 4 --guidance 4.5
                                          --num-steps 10 --out benchmarks/results/flow_step_vs_flow_grpo_cpu.json]

three workers on the same tiny SD3 folder, prompts, batch and settings (fp32, CFG ``--guidance``, every one of
the ``--num-steps`` steps an SDE step and trained, one optimizer step per training step over all samples,
``--microbatch`` samples per forward (default: all), a pixel reward, so both decode):

- ``flow_grpo``: Flow-GRPO's own code from the checkout -- sampling with its ``pipeline_with_logprob`` (its SDE
  step ``sde_step_with_logprob``, then the VAE decode), and its training loop as ``scripts/train_sd3.py`` runs
  it: per microbatch and per timestep its ``compute_log_prob`` (read from that script: one batched forward of
  both CFG branches), the clipped loss, ``accelerator.backward`` inside ``accelerator.accumulate`` (gradient
  accumulation over all microbatches and timesteps), gradient clipping and one optimizer step;
- ``before``: `GroupTrainer.train_step()` with ``steps_per_backward: null`` and ``detach_uncond: false`` (the
  behaviour before Flow-GRPO's per-step backward and detached branch: one backward over all steps' graphs);
- ``after``: the defaults (``steps_per_backward: 1``, ``detach_uncond: true``).

``--before-after`` runs the ``before`` and ``after`` workers alone (also ``--family wan``: the Flow-GRPO checkout
fetched for this benchmark has no Wan trainer). The reward of these modes is ``bench_pixel_mean`` (the mean
pixel of the decoded image or video), computed the same way on Flow-GRPO's decoded images.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

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
PROMPTS = (
    "a red square",
    "two blue circles",
    "a green triangle on grey",
    "one yellow star",
    "three small dots",
    "a purple ring",
    "an orange cross on white",
    "four black lines",
    "a pink heart",
    "a brown box on the left",
)
"""The training prompts (the first ``--prompts`` of them in the Flow-GRPO worker)."""
SIDE_BY_SIDE = ("flow_grpo", "before", "after")
"""The workers of ``--flow-grpo`` (``--before-after``: the last two)."""
WAN_TEXT_DIM = 64
"""Hidden size of the Wan family's UMT5 text encoder (the transformer's ``text_dim``)."""


@register_reward("bench_pixel_mean")
class PixelMean(Reward):
    """The mean pixel of each decoded image (or video): a cheap reward that makes the trainer decode."""

    needs = {"images"}

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        media = batch.outputs.get("images")
        if media is None:
            media = batch.outputs["videos"]
        return media.float().flatten(1).mean(1)


@register_reward("bench_latent_energy")
class LatentEnergy(Reward):
    """Minus the mean squared final latent (a cheap latent-space reward: reads latents, never pixels)."""

    needs = {"latents"}

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        z = batch["latents"].float()
        return -z.pow(2).flatten(1).mean(1)


def reward_config(args: argparse.Namespace) -> dict:
    """The reward config entry of a worker: ``bench_pixel_mean`` in the side-by-side modes, else the grid's."""
    if args.variant:
        return {"name": "bench_pixel_mean"}
    return FAMILY_REWARDS[args.family][args.reward]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_hwm() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux ``clear_refs`` 5); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm_mb() -> float:
    """This process's peak RSS since the last `_reset_hwm` (VmHWM), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return _maxrss_mb()


class _Saved:
    """A tensor saved for backward, wrapped so that its release (when its graph is freed) is seen."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class PhaseMemory:
    """What one phase (the update) costs: its peak memory (CPU: VmHWM reset before it; CUDA: the peak
    allocation), its process CPU time, and the peak of the activations kept for backward (the bytes of the
    tensors autograd saves, parameters excluded, counted through ``saved_tensors_hooks`` until their graph is
    freed): the memory that the graph of the trained steps holds, free of allocator and RSS noise."""

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.peaks: list[float] = []
        self.increases: list[float] = []
        self.cpu_s: list[float] = []
        self.saved_peaks: list[float] = []
        self.cuda_peak_before = 0.0
        """CUDA: the largest peak allocation seen before a reset (the whole run's peak is the max with it)."""

    def _pack(self, t: torch.Tensor) -> object:
        if isinstance(t, torch.nn.Parameter):
            return t
        n = t.numel() * t.element_size()
        self._now += n
        self._peak = max(self._peak, self._now)
        box = _Saved(t)
        weakref.finalize(box, self._release, n)
        return box

    def _release(self, n: int) -> None:
        self._now -= n

    @staticmethod
    def _unpack(x: object) -> torch.Tensor:
        return x.t if isinstance(x, _Saved) else x  # type: ignore[return-value]

    def __enter__(self) -> PhaseMemory:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
            self.cuda_peak_before = max(self.cuda_peak_before, torch.cuda.max_memory_allocated() / 2**20)
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated() / 2**20
        else:
            _reset_hwm()
            self.base = _rss_mb()
        self._now = self._peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._cpu0 = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu_s.append(time.process_time() - self._cpu0)
        self._hooks.__exit__(*exc)
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**20
        else:
            peak = _hwm_mb()
        self.peaks.append(peak)
        self.increases.append(peak - self.base)
        self.saved_peaks.append(self._peak / 2**20)

    def summary(self, warmup: int) -> dict:
        """The timed steps' (after `warmup`) largest update peak, increase and saved activations, median CPU."""
        timed = slice(warmup, None)
        return {
            "update_peak_mb": max(self.peaks[timed]),
            "update_increase_mb": max(self.increases[timed]),
            "update_saved_peak_mb": max(self.saved_peaks[timed]),
            "median_update_cpu_s": statistics.median(self.cpu_s[timed]),
        }


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
        from mmalign.training.trainer import GroupTrainer
        from pipelines import TrainingSetup
        from rewards import RewardSet

        self.args = args
        torch.manual_seed(0)
        torch.set_num_threads(args.threads)
        self.dev = dev = torch.device(args.device)
        window = args.window if args.trained == "window" else None
        training = {  # before / after Flow-GRPO's per-step backward and detached unconditional branch
            "before": {"steps_per_backward": None, "detach_uncond": False},
            "after": {"steps_per_backward": 1, "detach_uncond": True},
        }.get(args.variant, {})
        extra = {"guidance_scale": args.guidance, **training}
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
                **extra,
            )
        else:
            pol = SD3Policy.from_pretrained(
                args.model_dir, num_steps=args.num_steps, window_size=window, seed=0, **extra
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
                "rewards": [reward_config(args)],
                "trainer": {
                    "steps": 10**6,
                    "lr": 1e-4,
                    "max_grad_norm": 1.0,
                    "microbatch_size": args.microbatch,
                    "progress_bar": False,
                    "save_every": 10**6,
                    "sample_every": 10**6,
                    "cpu": dev.type == "cpu",
                },
            },
            "bench_flow_step",
        )
        rows = [{"prompt": p} for p in PROMPTS]
        self.trainer = GroupTrainer(cfg, TrainingSetup(policy=pol, rewards=RewardSet(cfg.rewards), data=rows))
        self.update_memory = PhaseMemory(dev)
        inner_update = self.trainer.update

        def measured_update(batch):  # noqa: ANN001, ANN202
            with self.update_memory:
                return inner_update(batch)

        self.trainer.update = measured_update
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
            "variant": args.variant,
            "reward_name": reward_config(args)["name"],
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
        mem = self.update_memory
        if self.dev.type == "cuda":
            res["peak_mb"] = max(torch.cuda.max_memory_allocated() / 2**20, mem.cuda_peak_before)
            res["base_mb"] = self.alloc0
        else:
            res["peak_mb"] = _maxrss_mb()
            res["base_mb"] = self.rss0
            res["maxrss_before_steps_mb"] = self.maxrss0
        res["peak_increase_mb"] = res["peak_mb"] - res["base_mb"]
        res.update(mem.summary(args.warmup))
        self.run_dir.cleanup()
        return res


def _function_from(path: Path, name: str, namespace: dict) -> Any:
    """The top-level function `name` of the script `path`, compiled on its own into `namespace` (the script
    itself imports packages this benchmark does not need, so it is not imported whole)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec")
            exec(code, namespace)  # noqa: S102 - Flow-GRPO's own function, from the given checkout
            return namespace[name]
    raise SystemExit(f"{path}: no function {name!r} (is --flow-grpo a flow_grpo checkout?)")


class FlowGrpoWorker:
    """Flow-GRPO's sampling and training loop from a checkout (``--flow-grpo``) on the same tiny SD3 folder:
    the `Worker` protocol (`step`, `result`) with the same split of the step and the same memory measurements.

    Sampling: its ``pipeline_with_logprob`` (prompt embeddings given, as its training script passes them) with
    ``output_type="pt"`` (it decodes). Training: its ``scripts/train_sd3.py`` loop (per microbatch, per timestep
    ``compute_log_prob``, the clipped loss, ``accelerator.backward`` under ``accelerator.accumulate``, clipping
    and the optimizer step when the gradients sync), written out here because it lives inside its ``main``;
    ``compute_log_prob`` itself is read from the script."""

    def __init__(self, args: argparse.Namespace) -> None:
        from types import SimpleNamespace

        from accelerate import Accelerator
        from diffusers import StableDiffusion3Pipeline

        from mmalign.policies.sd3_components import load_sd3_components

        root = Path(args.flow_grpo).resolve()
        sys.path.insert(0, str(root))
        from flow_grpo.diffusers_patch.sd3_pipeline_with_logprob import pipeline_with_logprob
        from flow_grpo.diffusers_patch.sd3_sde_with_logprob import sde_step_with_logprob

        self.args = args
        torch.manual_seed(0)
        torch.set_num_threads(args.threads)
        self.dev = dev = torch.device(args.device)
        self.sample_fn = pipeline_with_logprob
        self.compute_log_prob = _function_from(
            root / "scripts" / "train_sd3.py",
            "compute_log_prob",
            {"torch": torch, "sde_step_with_logprob": sde_step_with_logprob},
        )
        c = load_sd3_components(args.model_dir)
        self.components = c
        for m in (c.vae, c.text_encoder):
            m.to(dev).requires_grad_(False)
        self.pipeline = StableDiffusion3Pipeline(
            transformer=c.transformer.to(dev),
            scheduler=c.scheduler,
            vae=c.vae,
            text_encoder=c.text_encoder,
            tokenizer=c.tokenizer,
            text_encoder_2=None,
            tokenizer_2=None,
            text_encoder_3=None,
            tokenizer_3=None,
        )
        self.pipeline.set_progress_bar_config(disable=True)
        self.n_samples = args.prompts * args.group
        self.microbatch = args.microbatch or self.n_samples
        self.num_batches = -(-self.n_samples // self.microbatch)
        self.accelerator = Accelerator(
            cpu=dev.type == "cpu", gradient_accumulation_steps=self.num_batches * args.num_steps
        )
        transformer = c.transformer
        transformer.requires_grad_(True)
        optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-4)
        self.transformer, self.optimizer = self.accelerator.prepare(transformer, optimizer)
        self.config = SimpleNamespace(
            train=SimpleNamespace(
                cfg=args.guidance > 1, clip_range=1e-4, adv_clip_max=5.0, max_grad_norm=1.0
            ),
            sample=SimpleNamespace(guidance_scale=args.guidance, noise_level=0.7),
        )
        self.prompts = [p for p in PROMPTS[: args.prompts] for _ in range(args.group)]
        self.group = torch.arange(args.prompts).repeat_interleave(args.group)
        with torch.no_grad():
            pe, po = c.encode_prompt(self.prompts, dev)
            ne, npo = c.encode_prompt([""], dev)
        self.embeds, self.pooled = pe, po
        self.neg_embeds = ne.expand(self.n_samples, -1, -1)
        self.neg_pooled = npo.expand(self.n_samples, -1)
        self.update_memory = PhaseMemory(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.alloc0 = torch.cuda.memory_allocated() / 2**20 if dev.type == "cuda" else None
        self.rss0, self.maxrss0 = _rss_mb(), _maxrss_mb()
        self.n = 0
        self.steps: list[dict] = []
        self.latent_size = int(c.transformer.config.sample_size)

    def _sample(self) -> dict:
        args, cfg = self.args, self.config
        self.transformer.eval()
        with torch.no_grad():
            images, latents, log_probs = self.sample_fn(
                self.pipeline,
                prompt_embeds=self.embeds,
                pooled_prompt_embeds=self.pooled,
                negative_prompt_embeds=self.neg_embeds,
                negative_pooled_prompt_embeds=self.neg_pooled,
                num_inference_steps=args.num_steps,
                guidance_scale=cfg.sample.guidance_scale,
                output_type="pt",
                height=args.size,
                width=args.size,
                noise_level=cfg.sample.noise_level,
            )
        latents = torch.stack(latents, dim=1)
        rewards = images.float().flatten(1).mean(1).cpu()
        adv = torch.zeros_like(rewards)
        for g in self.group.unique():  # its per-prompt stat tracker: (r - mean) / (std + 1e-4)
            m = self.group == g
            adv[m] = (rewards[m] - rewards[m].mean()) / (rewards[m].std(unbiased=False) + 1e-4)
        return {
            "prompt_embeds": self.embeds,
            "pooled_prompt_embeds": self.pooled,
            "timesteps": self.pipeline.scheduler.timesteps.repeat(self.n_samples, 1),
            "latents": latents[:, :-1],
            "next_latents": latents[:, 1:],
            "log_probs": torch.stack(log_probs, dim=1),
            "advantages": adv.to(self.dev).unsqueeze(1).repeat(1, args.num_steps),
        }

    def _train(self, samples: dict) -> float:
        """One inner epoch of ``scripts/train_sd3.py``'s training loop; returns the mean loss."""
        cfg, acc, transformer = self.config, self.accelerator, self.transformer
        perm = torch.randperm(self.n_samples)
        samples = {k: v[perm] for k, v in samples.items()}
        transformer.train()
        losses = []
        for start in range(0, self.n_samples, self.microbatch):
            sample = {k: v[start : start + self.microbatch] for k, v in samples.items()}
            b = len(sample["latents"])
            if cfg.train.cfg:
                embeds = torch.cat([self.neg_embeds[:b], sample["prompt_embeds"]])
                pooled = torch.cat([self.neg_pooled[:b], sample["pooled_prompt_embeds"]])
            else:
                embeds, pooled = sample["prompt_embeds"], sample["pooled_prompt_embeds"]
            for j in range(self.args.num_steps):
                with acc.accumulate(transformer):
                    _, log_prob, _, _ = self.compute_log_prob(
                        transformer, self.pipeline, sample, j, embeds, pooled, cfg
                    )
                    advantages = torch.clamp(
                        sample["advantages"][:, j], -cfg.train.adv_clip_max, cfg.train.adv_clip_max
                    )
                    ratio = torch.exp(log_prob - sample["log_probs"][:, j])
                    unclipped_loss = -advantages * ratio
                    clipped_loss = -advantages * torch.clamp(
                        ratio, 1.0 - cfg.train.clip_range, 1.0 + cfg.train.clip_range
                    )
                    loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
                    acc.backward(loss)
                    if acc.sync_gradients:
                        acc.clip_grad_norm_(transformer.parameters(), cfg.train.max_grad_norm)
                    self.optimizer.step()
                    self.optimizer.zero_grad()
                losses.append(float(loss.detach()))
        return sum(losses) / len(losses)

    def step(self) -> dict:
        tick = os.sysconf("SC_CLK_TCK")
        busy0, own0 = _busy_jiffies(), sum(os.times()[:2])
        t0 = time.perf_counter()
        samples = self._sample()
        t1 = time.perf_counter()
        with self.update_memory:
            loss = self._train(samples)
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        own = sum(os.times()[:2]) - own0
        dt = t2 - t0
        other = max(0.0, (_busy_jiffies() - busy0) / tick - own)
        rec = {
            "step_s": dt,
            "rollout_s": t1 - t0,
            "reward_s": 0.0,
            "decode_s": 0.0,
            "update_s": t2 - t1,
            "cpu_s": own,
            "other_cpu_frac": other / (dt * (os.cpu_count() or 1)),
            "trained_steps": self.args.num_steps,
            "loss": loss,
            "reward_mean": float(samples["advantages"].abs().mean()),
            "warmup": self.n < self.args.warmup,
        }
        self.n += 1
        if not rec["warmup"]:
            self.steps.append(rec)
        return rec

    def result(self) -> dict:
        args, steps, mem = self.args, self.steps, self.update_memory
        res = {
            "reward": "pixel",
            "trained": "full",
            "variant": "flow_grpo",
            "reward_name": "bench_pixel_mean",
            "decoded": True,
            "trained_steps": args.num_steps,
            "steps": steps,
            "min_step_s": min(s["step_s"] for s in steps),
            "other_cpu_frac": sum(s["other_cpu_frac"] * s["step_s"] for s in steps)
            / sum(s["step_s"] for s in steps),
        }
        for key in ("step_s", "rollout_s", "reward_s", "decode_s", "update_s", "cpu_s"):
            res[f"median_{key}"] = statistics.median(s[key] for s in steps)
            res[f"min_{key}"] = min(s[key] for s in steps)
        if self.dev.type == "cuda":
            res["peak_mb"] = max(torch.cuda.max_memory_allocated() / 2**20, mem.cuda_peak_before)
            res["base_mb"] = self.alloc0
        else:
            res["peak_mb"] = _maxrss_mb()
            res["base_mb"] = self.rss0
            res["maxrss_before_steps_mb"] = self.maxrss0
        res["peak_increase_mb"] = res["peak_mb"] - res["base_mb"]
        res.update(mem.summary(args.warmup))
        return res


def worker_loop(args: argparse.Namespace) -> None:
    """Lockstep protocol on stdin/stdout: reply ``@@ready``, then one ``@@{json}`` line per command
    (``step``: one training step; ``result``: the summary, then exit)."""
    w = FlowGrpoWorker(args) if args.variant == "flow_grpo" else Worker(args)
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


def print_side_by_side(results: list[dict], mem: str, args: argparse.Namespace) -> None:
    """The side-by-side table: per worker the median step (wall and process CPU seconds), its sampling part
    (sampling, decode, reward), its update (wall and CPU seconds), the peak of the activations kept for backward
    during the update, the update's peak memory and the whole run's; then the ratios to Flow-GRPO's (speed: its
    CPU seconds over ours, which other processes on a shared machine disturb less than wall time)."""
    print(
        f"CFG {args.guidance}, microbatch {args.microbatch or args.prompts * args.group}, every step trained; "
        f"'saved' = peak of the activations kept for backward during the update; 'update {mem}' = {mem} "
        "during the update (reset before it)"
    )
    print(
        f"{'worker':<10} {'step s':>7} {'CPU s':>6} {'sample':>7} {'update':>7} {'upd CPU':>7} "
        f"{'saved MiB':>9} {'update ' + mem:>16} {'run ' + mem:>13}"
    )
    ref = next((r for r in results if r["variant"] == "flow_grpo"), None)
    for r in results:
        sample = r["median_rollout_s"] + r["median_reward_s"]
        line = (
            f"{r['variant']:<10} {r['median_step_s']:>7.2f} {r['median_cpu_s']:>6.2f} {sample:>7.2f} "
            f"{r['median_update_s']:>7.2f} {r['median_update_cpu_s']:>7.2f} {r['update_saved_peak_mb']:>9.0f} "
            f"{r['update_peak_mb']:>16.0f} {r['peak_mb']:>13.0f}"
        )
        if ref is not None and r is not ref:
            line += (
                f"   vs flow_grpo: step {ref['median_cpu_s'] / r['median_cpu_s']:.2f}x, update "
                f"{ref['median_update_cpu_s'] / r['median_update_cpu_s']:.2f}x its speed (CPU s); saved "
                f"{r['update_saved_peak_mb'] / ref['update_saved_peak_mb']:.2f}x, update peak "
                f"{r['update_peak_mb'] / ref['update_peak_mb']:.2f}x"
            )
        print(line)


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
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 2; side by side 8)")
    p.add_argument(
        "--group", type=int, default=None, help="group size, samples per prompt (default 8; side by side 4)"
    )
    p.add_argument(
        "--flow-grpo",
        default=None,
        metavar="PATH",
        help="a checkout of github.com/yifan123/flow_grpo: run Flow-GRPO's sampling and training loop beside "
        "mmalign before / after (see the module docstring) instead of the 2x2 grid",
    )
    p.add_argument(
        "--before-after",
        action="store_true",
        help="run mmalign before / after alone (one backward over all steps with the unconditional branch in "
        "the graph, vs a backward per step with it detached); also for --family wan",
    )
    p.add_argument(
        "--guidance", type=float, default=None, help="CFG scale (default 1: none; side by side 4.5)"
    )
    p.add_argument(
        "--microbatch",
        type=int,
        default=None,
        help="samples per training forward (trainer.microbatch_size; Flow-GRPO's train.batch_size); "
        "default all",
    )
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
    p.add_argument("--variant", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.size is None:
        args.size = 64 if args.family == "wan" else 128
    side = bool(args.flow_grpo) or args.before_after
    if args.flow_grpo and args.family != "sd3":
        raise SystemExit("--flow-grpo runs Flow-GRPO's SD3 trainer: use it with --family sd3")
    args.prompts = args.prompts or (8 if side else 2)
    args.group = args.group or (4 if side else 8)
    args.guidance = args.guidance or (4.5 if side else 1.0)
    if args.worker:
        worker_loop(args)
        return
    video = args.family == "wan"
    name = f"flow_step_{'video_' if video else ''}"
    if args.flow_grpo:
        name += "vs_flow_grpo_"
    elif args.before_after:
        name += "before_after_"
    out = args.out or HERE / "results" / f"{name}{args.device}.json"
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
        f"--guidance={args.guidance}",
        *([f"--microbatch={args.microbatch}"] if args.microbatch else []),
        *([f"--flow-grpo={args.flow_grpo}"] if args.flow_grpo else []),
    ]
    t_start = time.perf_counter()
    if args.flow_grpo:
        specs = list(SIDE_BY_SIDE)
    elif args.before_after:
        specs = list(SIDE_BY_SIDE[1:])
    else:
        specs = [s.strip() for s in args.configs.split(",")]
    n_rounds = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / args.family
        sizes = build_model(model_dir, args)

        def start(spec: str) -> Proc:
            reward, trained, variant = ("pixel", "full", spec) if side else (*spec.split("-"), "")
            return Proc(
                spec,
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    f"--model-dir={model_dir}",
                    f"--reward={reward}",
                    f"--trained={trained}",
                    f"--variant={variant}",
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
            + (
                "reward bench_pixel_mean;"
                if side
                else "pixel = flicker (negated), latent = bench_latent_energy;"
            )
            + f"\n{args.device}, {args.threads} threads; median of {args.steps} steps after {args.warmup} warm-up"
        )
    else:
        print(
            f"\n{args.prompts} prompts x {args.group} = {args.prompts * args.group} samples, {args.size}x{args.size} "
            f"images ({sizes['latent_size']}x{sizes['latent_size']}x16 latents), {args.num_steps} sampling steps; "
            f"transformer {sizes['transformer'] / 1e6:.2f} M, VAE {sizes['vae'] / 1e6:.2f} M parameters; "
            f"{args.device}, {args.threads} threads; median of {args.steps} steps after {args.warmup} warm-up"
        )
    if side:
        print_side_by_side(results, mem, args)
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
    busy = [r["variant"] or f"{r['reward']}-{r['trained']}" for r in results if r["other_cpu_frac"] > 0.05]
    if busy:
        print(
            f"warning: other processes used more than 5% of the CPU during {', '.join(busy)}: times are noisy"
        )
    settings = {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k not in ("worker", "reward", "trained", "model_dir")
        and (video or k not in ("family", "frames", "text_len", "ffn_dim"))  # the image JSON stays as it was
        and (side or k not in ("flow_grpo", "before_after", "guidance", "microbatch", "variant"))
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
