"""VGGRPO's latent geometry rewards vs decoding to pixels and a pixel-space equivalent: time and peak memory.

    python benchmarks/bench_geometry_rewards.py --size tiny     # ~40 s on 1 thread here -> geometry_rewards_tiny_cpu.json
    python benchmarks/bench_geometry_rewards.py --size wan      # 2-3 min here -> geometry_rewards_wan_cpu.json
    python benchmarks/bench_geometry_rewards.py                 # both sizes -> geometry_rewards_cpu.json
    python benchmarks/bench_geometry_rewards.py --size wan --height 128 --width 128 --batch 1 --repeats 1
    python benchmarks/bench_geometry_rewards.py --device cuda --size wan --frames 81 --height 480 --width 832

Both paths compute the same three numbers per video of a batch of B normalised latent videos
[B, z_dim, f, h, w] (the policy's ``outputs["latents"]``, here ``torch.randn`` with a fixed seed):
``camera_smoothness``, ``reprojection_consistency`` and ``motion_guard`` with the rewards' default options.

- ``latent`` (what `rewards/geometry.py` does): `rewards.geometry.geometry_of` runs a
  `rewards.geometry_model.TinyLatentGeometry` (``latent_channels`` = z_dim, hidden 32, 2 layers: its defaults) on
  the latents, then the reward math of `rewards.geometry_model` (`smoothness_errors`, `reprojection_errors` +
  `consistency_from_errors`, `motion_degree` + `motion_guard`, as the reward classes call them). The
  latent worker checks, outside the timed region, that the three registered reward classes
  (``camera_smoothness``, ``reprojection_consistency``, ``motion_guard``) loaded from the same saved model
  give the same numbers.
- ``pixel``: `mmalign.policies.wan_components.decode_video` decodes the latents with the Wan VAE to
  [B, F, 3, H, W] in [0, 1] (on the CPU, as the trainer hands videos to pixel rewards), then `PixelGeometry`
  (defined here) runs on the pixels in [-1, 1], then the same reward math. `PixelGeometry` is a
  `TinyLatentGeometry` with a stem in front: a ``Conv3d(3, z_dim, kernel = stride = (t, s, s))`` + SiLU
  (t, s: the VAE's temporal and spatial factors; the first frame is repeated t - 1 times in front, as the
  causal VAE keeps it alone) maps the pixels onto the latent grid [z_dim, f, h, w], and the trunk, heads and
  intrinsics are exactly those of the latent model (built from the same seed, so the same initial weights).
  It is UNTRAINED, as is the latent model here: this benchmark compares cost (time, memory), not the
  quality of the geometry or of the rewards. In both models the dynamic head's bias is set to -3
  (`mostly_static`) so that most pixels count as static and reprojection_consistency is defined.

Sizes (``--size``, one or both):

- ``tiny``: the VAE of `mmalign.tiny.wan.build_tiny_wan` (z_dim 4, 2x in time, 4x in space, base_dim 8),
  9 frames of 32x32 pixels -> 5 latent frames of 8x8; batch 8.
- ``wan``: ``AutoencoderKLWan()`` with diffusers' DEFAULT config, i.e. the Wan 2.1 VAE architecture
  (base_dim 96, z_dim 16, 4x in time, 8x in space, 127 M parameters, decoder 73 M) with random weights
  (nothing is downloaded; compute and memory are those of the real model, the output is noise), at a
  CPU-friendly 9 frames of 64x64 -> 3 latent frames of 8x8; batch 2. Real Wan runs are 17-81 frames at
  480x832 (60x104 latents): the decode grows about linearly in frames x pixels (81 x 480 x 832 is 880x
  the pixels of 9 x 64 x 64), the latent path too but from a far smaller base, and the reprojection
  math as O(B f^2 h w).

``--frames/--height/--width/--batch`` override the per-size defaults (frames = 1 + a multiple of t with at
least 3 latent frames, as camera_smoothness needs; height and width multiples of s).

Measurement: each (size, path) runs in a fresh subprocess (`--worker`), one after the other, with
``torch.set_num_threads(--threads)``. The worker builds its models and the latents, then runs the path
`--warmup` times untimed and `--repeats` times timed (the latent path, milliseconds per run,
`--latent-repeats` times); the table shows the median wall time (and the fastest, and the median CPU
time of the process, ``time.process_time``, which waiting for a core on a shared machine does not
inflate). For the pixel path the decode is timed on its own (inside the path) and its share of the
path's time is reported. Memory on CPU: the worker's RSS (VmRSS) right after building the models and the
latents, then the peak RSS over warm-up and timed runs (``ru_maxrss``; before the warm-up the kernel's
peak is reset to the current RSS with ``/proc/self/clear_refs``, so construction does not mask it;
``peak_reset`` in the JSON says whether that worked), and the increase of the peak over that RSS. On CUDA:
``torch.cuda.max_memory_allocated`` over the runs (reset before them) and its increase over
``torch.cuda.memory_allocated`` before them. Results: ``benchmarks/results/geometry_rewards_<device>.json``
(``geometry_rewards_<size>_<device>.json`` with one size; ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from rewards.geometry_model import (  # noqa: E402
    GeometryOutput,
    LatentGeometryModel,
    TinyLatentGeometry,
    consistency_from_errors,
    motion_degree,
    motion_guard,
    reprojection_errors,
    smoothness_errors,
)

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"frames": 9, "height": 32, "width": 32, "batch": 8},
    "wan": {"frames": 9, "height": 64, "width": 64, "batch": 2},
}
"""Per-size defaults of --frames, --height, --width, --batch."""
REWARDS = ("camera_smoothness", "reprojection_consistency", "motion_guard")


# ----------------------------------------------------------------------------- the pixel-space model
class PixelGeometry(TinyLatentGeometry):
    """`TinyLatentGeometry` on pixels: a strided Conv3d stem onto the latent grid, then the same trunk and heads.

    ``forward(pixels)``: pixels Float[B, 3, F, H, W] in [-1, 1] -> the first frame repeated `temporal` - 1
    times in front (the causal VAE's layout: F = 1 + temporal (f - 1) frames give f latent frames) ->
    ``Conv3d(3, latent_channels, kernel = stride = (temporal, spatial, spatial))`` + SiLU -> the features
    [B, latent_channels, f, H / spatial, W / spatial] go through `TinyLatentGeometry.forward` (trunk, depth /
    dynamic / pose heads, intrinsics at the latent resolution). Untrained (random weights)."""

    def __init__(self, *, temporal: int, spatial: int, latent_channels: int, **kwargs: Any) -> None:
        super().__init__(latent_channels=latent_channels, **kwargs)
        self.temporal = temporal
        kernel = (temporal, spatial, spatial)
        self.stem = nn.Sequential(nn.Conv3d(3, latent_channels, kernel, stride=kernel), nn.SiLU())

    def forward(self, pixels: Tensor) -> GeometryOutput:  # type: ignore[override]
        first = pixels[:, :, :1].expand(-1, -1, self.temporal - 1, -1, -1)
        return super().forward(self.stem(torch.cat([first, pixels], dim=2)))


class DecodedPixelGeometry(LatentGeometryModel):
    """The pixel path as a latent geometry model: ``decode_video(vae, latents)`` then `PixelGeometry`.

    The time of each decode (synchronised on CUDA) is appended to ``decode_s``."""

    def __init__(self, vae: nn.Module, pixel_model: PixelGeometry) -> None:
        super().__init__()
        self.vae = vae  # first: `geometry_of` moves the latents to the device / dtype of the first parameter
        self.pixel_model = pixel_model
        self.decode_s: list[float] = []

    def forward(self, latents: Tensor) -> GeometryOutput:
        from mmalign.policies.wan_components import decode_video

        dev = latents.device
        _sync(dev)
        t0 = time.perf_counter()
        video = decode_video(self.vae, latents)  # [B, F, 3, H, W] in [0, 1], on the CPU
        self.decode_s.append(time.perf_counter() - t0)
        pixels = (video.movedim(2, 1) * 2 - 1).to(dev)
        return self.pixel_model(pixels)


# ----------------------------------------------------------------------------- the reward math
def reward_math(geo: GeometryOutput) -> dict[str, Tensor]:
    """The three rewards (default options) of a `GeometryOutput`, as the reward classes compute them."""
    e_trans, e_rot = smoothness_errors(geo.centres, geo.angles, 1e-6)
    smooth = 0.5 * (1.0 / (1.0 + e_trans) + 1.0 / (1.0 + e_rot))
    err = reprojection_errors(
        geo.depth, geo.centres, geo.angles, geo.batched_intrinsics, geo.dynamic, 0.5, relative=False
    )
    consistency = consistency_from_errors(err, 3)
    guard = motion_guard(motion_degree(geo.centres, geo.angles, geo.depth, geo.dynamic), 0.05)
    return {"camera_smoothness": smooth, "reprojection_consistency": consistency, "motion_guard": guard}


def run_path(latents: Tensor, model: LatentGeometryModel) -> dict[str, Tensor]:
    """One evaluation of a path: `rewards.geometry.geometry_of` (eval, no_grad, device / dtype) + the math."""
    from rewards.geometry import geometry_of

    geo = geometry_of(latents, model)
    with torch.no_grad():
        out = reward_math(geo)
    return {k: v.cpu() for k, v in out.items()}


# ----------------------------------------------------------------------------- building
def _count(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def build_vae(size: str, tmp: Path) -> nn.Module:
    """The Wan VAE of `size` (eval, no grad): the tiny one of `build_tiny_wan`, or ``AutoencoderKLWan()``."""
    from diffusers import AutoencoderKLWan

    if size == "tiny":
        from mmalign.tiny.wan import build_tiny_wan

        folder = build_tiny_wan(tmp / "tiny_wan")
        vae = AutoencoderKLWan.from_pretrained(folder / "vae")
    else:
        torch.manual_seed(0)
        vae = AutoencoderKLWan()  # diffusers' default config = the Wan 2.1 VAE architecture
    return vae.eval().requires_grad_(False)


def mostly_static(model: TinyLatentGeometry) -> TinyLatentGeometry:
    """`model` with its dynamic head's bias set to -3, so that most pixels count as static (dynamic < 0.5).

    At random initialisation about half the pixels come out dynamic, and with these few latent pixels no
    view then receives a static point: reprojection_consistency would be NaN for every video. The cost of
    the math does not depend on it (every point is projected and z-buffered either way)."""
    with torch.no_grad():
        model.dynamic_head.bias.fill_(-3.0)
    return model


def vae_geometry(vae: nn.Module) -> tuple[int, int, int]:
    """(z_dim, temporal, spatial) of a Wan VAE."""
    from mmalign.policies.wan_components import vae_factors

    temporal, spatial = vae_factors(vae)
    return int(vae.config.z_dim), temporal, spatial


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS of this process to its current RSS (Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ----------------------------------------------------------------------------- one worker = one (size, path)
def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Build the models of ``args.size`` and the latents, run ``args.path``; the measurements as a dict."""
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        vae = build_vae(args.size, Path(tmp))
        z_dim, temporal, spatial = vae_geometry(vae)
        f_lat = (args.frames - 1) // temporal + 1
        h, w = args.height // spatial, args.width // spatial
        g = torch.Generator().manual_seed(0)
        latents = torch.randn(args.batch, z_dim, f_lat, h, w, generator=g).to(dev)
        torch.manual_seed(1)
        latent_model = mostly_static(TinyLatentGeometry(latent_channels=z_dim)).eval().requires_grad_(False)
        info: dict[str, Any] = {
            "z_dim": z_dim,
            "vae_factors": [temporal, spatial],
            "latent_shape": list(latents.shape),
            "pixel_shape": [args.batch, 3, args.frames, args.height, args.width],
            "params_latent_model": _count(latent_model),
            "params_vae": _count(vae),
            "params_vae_decoder": _count(vae.decoder) + _count(vae.post_quant_conv),
        }
        if args.path == "latent":
            model: LatentGeometryModel = latent_model.to(dev)
            del vae
        else:
            torch.manual_seed(1)  # the trunk and heads start from the same weights as the latent model's
            pixel_model = mostly_static(
                PixelGeometry(temporal=temporal, spatial=spatial, latent_channels=z_dim)
            )
            info["params_pixel_model"] = _count(pixel_model)
            model = DecodedPixelGeometry(vae, pixel_model.eval().requires_grad_(False)).to(dev)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev) / 2**20
            peak_reset = True
        else:
            peak_reset = _reset_peak_rss()
            base = _rss_mib()
        maxrss_before = _maxrss_mib()
        walls, cpus, decodes = [], [], []
        repeats = max(args.repeats, args.latent_repeats) if args.path == "latent" else args.repeats
        for i in range(args.warmup + repeats):
            n_dec = len(getattr(model, "decode_s", []))
            _sync(dev)
            c0, t0 = time.process_time(), time.perf_counter()
            scores = run_path(latents, model)  # ends with a copy to the CPU: synchronised
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            dec = sum(getattr(model, "decode_s", [])[n_dec:])
            print(
                f"  {args.size:<4} {args.path:<6} {'warm-up' if i < args.warmup else 'run':<7} {wall:8.3f} s",
                file=sys.stderr,
            )
            if i >= args.warmup:
                walls.append(wall)
                cpus.append(cpu)
                decodes.append(dec)
        if dev.type == "cuda":
            peak = torch.cuda.max_memory_allocated(dev) / 2**20
        else:
            peak = _maxrss_mib()
        res: dict[str, Any] = {
            "size": args.size,
            "path": args.path,
            **info,
            "wall_s": walls,
            "cpu_s": cpus,
            "decode_s": decodes,
            "median_wall_s": statistics.median(walls),
            "min_wall_s": min(walls),
            "median_cpu_s": statistics.median(cpus),
            "median_decode_s": statistics.median(decodes),
            "decode_share": statistics.median(d / t for d, t in zip(decodes, walls)),
            "peak_mib": peak,
            "base_mib": base,
            "peak_increase_mib": peak - base,
            "peak_reset": peak_reset,
            "maxrss_before_runs_mib": None if dev.type == "cuda" else maxrss_before,
            "rewards": {
                k: [None if math.isnan(x) else round(x, 6) for x in v.tolist()] for k, v in scores.items()
            },
        }
        if args.path == "latent":
            res["matches_reward_classes"] = check_reward_classes(
                latents, latent_model, Path(tmp), args.device
            )
    return res


def check_reward_classes(latents: Tensor, model: TinyLatentGeometry, tmp: Path, device: str) -> bool:
    """Whether the registered reward classes, loading `model` from a saved folder, give `reward_math`'s
    numbers on `latents` (run after the measurements)."""
    from rewards import RewardBatch
    from rewards.geometry import CameraSmoothness, MotionGuard, ReprojectionConsistency, geometry_of

    folder = tmp / "latent_geometry"
    model.save_pretrained(folder)
    batch = RewardBatch(prompts=[""] * latents.shape[0], outputs={"latents": latents})
    opts = {"geometry_model": str(folder), "device": device}
    ours = reward_math(geometry_of(latents, model))
    classes = {"camera_smoothness": CameraSmoothness, "reprojection_consistency": ReprojectionConsistency}
    classes["motion_guard"] = MotionGuard
    return all(
        torch.allclose(cls(**opts)(batch), ours[name].cpu(), equal_nan=True) for name, cls in classes.items()
    )


# ----------------------------------------------------------------------------- driver
def run_worker(args: argparse.Namespace, size: str, path: str, shape: dict[str, int]) -> dict[str, Any]:
    """`worker` in a fresh subprocess; its JSON result."""
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        f"--path={path}",
        f"--size={size}",
        f"--frames={shape['frames']}",
        f"--height={shape['height']}",
        f"--width={shape['width']}",
        f"--batch={shape['batch']}",
        f"--device={args.device}",
        f"--threads={args.threads}",
        f"--warmup={args.warmup}",
        f"--repeats={args.repeats}",
        f"--latent-repeats={args.latent_repeats}",
    ]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("@@")]
    if proc.returncode or not lines:
        raise SystemExit(f"worker {size}/{path} failed (rc {proc.returncode})")
    return json.loads(lines[-1][2:])


def shape_of(size: str, args: argparse.Namespace) -> dict[str, int]:
    """The frames / height / width / batch of `size`: the defaults, overridden by the flags."""
    shape = dict(SIZES[size])
    for key in shape:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    temporal, spatial = (2, 4) if size == "tiny" else (4, 8)
    if (shape["frames"] - 1) % temporal or (shape["frames"] - 1) // temporal + 1 < 3:
        raise SystemExit(
            f"--size {size}: frames must be 1 + a multiple of {temporal} with >= 3 latent frames, "
            f"got {shape['frames']}"
        )
    if shape["height"] % spatial or shape["width"] % spatial:
        raise SystemExit(f"--size {size}: height and width must be multiples of {spatial}")
    return shape


def print_table(runs: list[dict[str, Any]], device: str) -> None:
    """The results table, then the pixel/latent ratios per size."""
    mem = "peak CUDA" if device.startswith("cuda") else "peak RSS"
    print(
        f"\n{'size':<5} {'path':<7} {'B':>2} {'latents':<16} {'pixels':<16} {'median (s)':>10} {'fastest':>8} "
        f"{'CPU s':>7} {'decode':>8} {'decode %':>8} {mem + ' MiB':>13} {'base':>6} {'increase':>8}"
    )
    for r in runs:
        lat = "x".join(str(d) for d in r["latent_shape"][1:])
        pix = "x".join(str(d) for d in r["pixel_shape"][1:])
        dec = f"{r['median_decode_s']:8.3f}" if r["path"] == "pixel" else f"{'-':>8}"
        share = f"{100 * r['decode_share']:7.1f}%" if r["path"] == "pixel" else f"{'-':>8}"
        print(
            f"{r['size']:<5} {r['path']:<7} {r['latent_shape'][0]:>2} {lat:<16} {pix:<16} "
            f"{r['median_wall_s']:>10.4f} {r['min_wall_s']:>8.4f} {r['median_cpu_s']:>7.3f} {dec} {share} "
            f"{r['peak_mib']:>13.0f} {r['base_mib']:>6.0f} {r['peak_increase_mib']:>8.1f}"
        )
    for size in dict.fromkeys(r["size"] for r in runs):
        by = {r["path"]: r for r in runs if r["size"] == size}
        if {"latent", "pixel"} <= set(by):
            lat, pix = by["latent"], by["pixel"]
            t = pix["median_wall_s"] / max(lat["median_wall_s"], 1e-9)
            m = pix["peak_increase_mib"] / max(lat["peak_increase_mib"], 1e-9)
            print(
                f"{size}: pixel / latent = {t:.0f}x time (CPU time {pix['median_cpu_s'] / max(lat['median_cpu_s'], 1e-9):.0f}x), "
                f"{m:.0f}x memory increase; decode = {100 * pix['decode_share']:.1f}% of the pixel path"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", nargs="+", choices=tuple(SIZES), default=list(SIZES), help="tiny and/or wan")
    p.add_argument("--frames", type=int, default=None, help="video frames (default: 9)")
    p.add_argument("--height", type=int, default=None, help="pixels (default: tiny 32, wan 64)")
    p.add_argument("--width", type=int, default=None, help="pixels (default: tiny 32, wan 64)")
    p.add_argument("--batch", type=int, default=None, help="videos per batch (default: tiny 8, wan 2)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads per worker (default 1: a shared machine)"
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed runs of each path first")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each path (the median is shown)")
    p.add_argument(
        "--latent-repeats",
        type=int,
        default=20,
        help="timed runs of the latent path (milliseconds each, so more of them; at least --repeats)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON (default benchmarks/results/geometry_rewards_<device>.json, or "
        "geometry_rewards_<size>_<device>.json for one size)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", choices=("latent", "pixel"), default="latent", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.size = args.size[0]
        print("@@" + json.dumps(worker(args)), flush=True)
        return
    t_start = time.perf_counter()
    runs, shapes = [], {}
    for size in args.size:
        shapes[size] = shape_of(size, args)
        for path in ("latent", "pixel"):
            runs.append(run_worker(args, size, path, shapes[size]))
    print_table(runs, args.device)
    machine = {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "load_average_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
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
    prefix = f"geometry_rewards_{args.size[0]}" if len(args.size) == 1 else "geometry_rewards"
    out = args.out or HERE / "results" / f"{prefix}_{args.device.split(':')[0]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("worker", "path", "out")}
    out.write_text(
        json.dumps(
            {
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                "settings": settings,
                "shapes": shapes,
                "machine": machine,
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                "note": "random weights everywhere (VAE, latent and pixel geometry models): cost only, not quality",
                "memory": (
                    "CUDA: max_memory_allocated over warm-up + timed runs, increase over memory_allocated before them"
                    if args.device.startswith("cuda")
                    else "CPU: ru_maxrss of the worker over warm-up + timed runs (peak reset to the current RSS "
                    "before them via /proc/self/clear_refs), increase over VmRSS after building models and latents"
                ),
                "total_wall_s": time.perf_counter() - t_start,
                "runs": runs,
            },
            indent=1,
        )
    )
    print(f"wrote {out} ({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
