"""The tiny image-to-video task and its warm-started Wan I2V model (``configs/image_to_video-tiny.yaml``).

**Task.** A clip is `FRAMES` frames of `SIZE` x `SIZE` pixels: one square of the shapes-world palette
(`mmalign.tiny.world.PALETTE`) on white, moving `SPEED` pixels a frame in a straight line. The first frame is
the image the model starts from; the prompt says where the square goes ("the red square moves right"), so
the clip is determined by the image and the prompt. `write_i2v_dataset` writes ``frames/`` (the first frames,
one-frame ``.npz``), ``clips/`` (the whole clips, the ``target_video`` a reward compares with) and
``train.jsonl`` / ``eval.jsonl``::

    {"prompt": "the red square moves right", "image": "frames/train_000.npz",
     "target_video": "clips/train_000.npz", "colour": "red", "direction": "right"}

``python -m mmalign.tiny.wan_i2v [FOLDER]`` rewrites it (default ``assets/image_to_video``).

**Builder** ``image_to_video`` (`build_image_to_video`), in two phases:

1. **VAE.** The tiny ``AutoencoderKLWan`` of `mmalign.tiny.wan` fitted to clips of the task
   (`mmalign.tiny.wan.fitted_tiny_wan`), with their latent statistics.
2. **Model.** A ``WanTransformer3DModel`` with ``in_channels`` = 2 z_dim + 2 (noisy latents, the first-frame
   mask of the temporal factor 2, the image latents: `mmalign.policies.wan_components.i2v_condition`; no CLIP
   image encoder, as Wan2.2 I2V) and the tiny UMT5 text encoder trained together with the rectified-flow loss
   (`mmalign.tiny.shapes.train_denoiser`, `p_uncond` empty prompts) on `num_clips` fresh clips. From
   `min_steps` on, every `check_every` steps, `held_out_psnr` samples held-out clips as the pipeline's rollouts
   do (10 SDE steps at noise level 0.7) and training stops once their PSNR against the true clips reaches
   `target_psnr`: an imperfect model (squares that lag, smear or drift) that GRPO can improve.

The folder has the Wan I2V layout (``WanImageToVideoPipeline`` loads it) with the real folders' UniPC scheduler,
and ``mmalign_tiny.json`` with these arguments and the checks.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.tiny import BUILDERS
from mmalign.tiny.world import PALETTE

__all__ = [
    "ASSETS",
    "DIRECTIONS",
    "FRAMES",
    "SIZE",
    "SPEED",
    "I2VClip",
    "build_image_to_video",
    "held_out_psnr",
    "make_i2v_clip",
    "write_i2v_dataset",
]

FRAMES = 9
"""Frames per clip (4k + 1 for Wan; the tiny VAE's temporal factor is 2)."""
SIZE = 32
"""Side of a frame in pixels."""
SPEED = 2
"""Pixels the square moves per frame."""
SIDE = (8, 10)
"""Smallest and largest square side in pixels."""
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
ASSETS = Path(__file__).resolve().parents[2] / "assets" / "image_to_video"


@dataclass
class I2VClip:
    """One example: the clip Float[F, 3, H, W] in [0, 1] (its frame 0 is the image), the prompt and its parts."""

    clip: Tensor
    prompt: str
    colour: str
    direction: str


def make_i2v_clip(rng: random.Random, direction: str | None = None) -> I2VClip:
    """A random clip: a square of a random colour and side starting where its whole path stays in frame."""
    direction = direction or rng.choice(list(DIRECTIONS))
    colour = rng.choice(list(PALETTE))
    side = rng.randint(*SIDE)
    dx, dy = DIRECTIONS[direction]
    travel = SPEED * (FRAMES - 1)
    lo_x, hi_x = (travel, SIZE - side) if dx < 0 else (0, SIZE - side - travel * dx)
    lo_y, hi_y = (travel, SIZE - side) if dy < 0 else (0, SIZE - side - travel * dy)
    x0, y0 = rng.randint(lo_x, hi_x), rng.randint(lo_y, hi_y)
    clip = torch.ones(FRAMES, 3, SIZE, SIZE)
    rgb = torch.tensor(PALETTE[colour], dtype=torch.float32).view(3, 1, 1) / 255.0
    for t in range(FRAMES):
        x, y = x0 + dx * SPEED * t, y0 + dy * SPEED * t
        clip[t, :, y : y + side, x : x + side] = rgb
    return I2VClip(clip, f"the {colour} square moves {direction}", colour, direction)


def _clips(n: int, seed: int) -> list[I2VClip]:
    rng = random.Random(seed)
    names = list(DIRECTIONS)
    return [make_i2v_clip(rng, names[i % len(names)]) for i in range(n)]


def _write(clips: list[I2VClip], folder: Path, split: str) -> list[dict[str, Any]]:
    from mmalign.data.media import write_array

    rows = []
    for i, c in enumerate(clips):
        name = f"{split}_{i:03d}"
        write_array(c.clip[:1], folder / "frames" / f"{name}.npz")
        write_array(c.clip, folder / "clips" / f"{name}.npz")
        rows.append(
            {
                "prompt": c.prompt,
                "image": f"frames/{name}.npz",
                "target_video": f"clips/{name}.npz",
                "colour": c.colour,
                "direction": c.direction,
            }
        )
    return rows


def write_i2v_dataset(
    folder: str | Path = ASSETS, n_train: int = 64, n_eval: int = 16, seed: int = 30
) -> dict[str, Path]:
    """Write the first frames, clips and ``train.jsonl`` / ``eval.jsonl`` under `folder` (train and eval from
    seeds ``seed`` and ``seed + 1``, the four directions in equal shares); returns the JSONL paths."""
    folder = Path(folder)
    out = {}
    for split, n, s in (("train", n_train, seed), ("eval", n_eval, seed + 1)):
        rows = _write(_clips(n, s), folder, split)
        path = folder / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out[split] = path
    return out


def held_out_psnr(policy: Any, rows: list[dict[str, Any]], group_size: int = 2) -> tuple[float, float]:
    """(mean PSNR of the whole clip against ``target_video``, mean PSNR of frame 0 against ``image``), in dB, of
    `group_size` samples per row drawn by `policy` (a `WanPolicy` with ``condition: i2v``) as it is set up;
    the ``video_psnr`` reward computes both."""
    from rewards import RewardSet

    rollout = policy.rollout(rows, group_size, compute_logp=False)
    policy.decode(rollout)
    rewards = RewardSet(
        [
            {
                "name": "video_psnr",
                "alias": "clip",
                "kwargs": {"source_column": "target_video", "region": "all"},
            },
            {
                "name": "video_psnr",
                "alias": "first",
                "kwargs": {"source_column": "image", "region": "all", "frames": [0]},
            },
        ]
    )(rollout)
    return float(rewards[:, 0].mean()), float(rewards[:, 1].mean())


def _flow_loss(
    transformer: torch.nn.Module, text_encoder: torch.nn.Module, pad_id: int, z_dim: int, shift: float
) -> Any:
    """The warm start's `mmalign.tiny.shapes.DenoiserLoss`: its "latents" are the target latents with the I2V
    conditioning concatenated on the channels ([z | mask + image latents]); rectified flow on the first part,
    the second concatenated to the noisy latents, UMT5 states of the ids with grad."""
    from mmalign.policies.wan_components import prompt_states

    def loss(lat: Tensor, ids: Tensor, g: torch.Generator) -> Tensor:
        x0, cond = lat[:, :z_dim], lat[:, z_dim:]
        text = prompt_states(text_encoder, ids, (ids != pad_id).long())
        u = torch.rand(x0.shape[0], generator=g)
        sigma = shift * u / (1 + (shift - 1) * u)
        noise = torch.randn(x0.shape, generator=g)
        s = sigma.view(-1, 1, 1, 1, 1)
        pred = transformer(
            hidden_states=torch.cat([(1 - s) * x0 + s * noise, cond], dim=1),
            timestep=sigma * 1000,
            encoder_hidden_states=text,
            return_dict=False,
        )[0]
        return torch.nn.functional.mse_loss(pred, noise - x0)

    return loss


@BUILDERS.register("image_to_video", minutes=18, phases=2)
def build_image_to_video(
    path: Path,
    *,
    num_clips: int = 512,
    vae_steps: int = 1200,
    vae_lr: float = 1e-3,
    vae_batch_size: int = 4,
    min_vae_psnr: float = 18.0,
    steps: int = 2000,
    min_steps: int = 200,
    check_every: int = 100,
    target_psnr: float | None = 17.0,
    lr: float = 1e-3,
    batch_size: int = 16,
    shift: float = 3.0,
    p_uncond: float = 0.1,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    attention_head_dim: int = 16,
    text_hidden: int = 32,
    max_sequence_length: int = 32,
    seed: int = 0,
    vae_from: str | None = None,
    progress: bool = True,
) -> None:
    """Write the tiny image-to-video model to `path` (see the module docstring for the phases). `vae_from`: a
    folder holding an already fitted tiny Wan VAE (``save_pretrained``) to use instead of fitting one."""
    meta: dict[str, Any] = {
        "builder": "image_to_video",
        **{k: v for k, v in locals().items() if k not in ("path", "progress")},
    }
    from diffusers import UniPCMultistepScheduler

    from mmalign.policies.wan import wan_policy_class
    from mmalign.policies.wan_components import encode_video, i2v_condition
    from mmalign.tiny.shapes import ShapesLatents, train_denoiser
    from mmalign.tiny.wan import fitted_tiny_wan, tiny_wan_transformer

    clips = _clips(num_clips, seed + 1000)
    videos = torch.stack([c.clip for c in clips])
    comp, meta["vae_psnr"] = fitted_tiny_wan(
        "image_to_video",
        videos,
        text_hidden=text_hidden,
        vae_steps=vae_steps,
        vae_lr=vae_lr,
        vae_batch_size=vae_batch_size,
        min_vae_psnr=min_vae_psnr,
        seed=seed,
        vae_from=vae_from,
        progress=progress,
    )
    vae, tokenizer, text_encoder = comp.vae, comp.tokenizer, comp.text_encoder
    z = int(vae.config.z_dim)
    target = encode_video(vae, videos)
    cond = torch.cat([i2v_condition(vae, videos[i : i + 64, 0], FRAMES) for i in range(0, len(clips), 64)])
    tok = tokenizer(
        [c.prompt for c in clips] + [""],
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        return_tensors="pt",
    )
    data = ShapesLatents(
        rows=[{"prompt": c.prompt} for c in clips],
        latents=torch.cat([target, cond], dim=1),
        tokens=tok.input_ids[:-1],
        empty=tok.input_ids[-1],
    )
    transformer = tiny_wan_transformer(
        2 * z + 2,
        z,
        num_layers=num_layers,
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,
        text_hidden=text_hidden,
    )
    comp.transformer = transformer
    comp.ode_scheduler = UniPCMultistepScheduler(
        num_train_timesteps=1000, use_flow_sigmas=True, flow_shift=shift, prediction_type="flow_prediction"
    )
    checks: list[tuple[int, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        held = [dict(r, image=str(Path(tmp) / r["image"]), target_video=str(Path(tmp) / r["target_video"]))
                for r in _write(_clips(16, seed + 2000), Path(tmp), "held")]  # fmt: skip

        def reached_target(step: int) -> bool:
            if step < min_steps:
                return False
            policy = wan_policy_class("i2v").from_components(
                comp,
                num_frames=FRAMES,
                height=SIZE,
                width=SIZE,
                max_sequence_length=max_sequence_length,
                num_steps=10,
                noise_level=0.7,
                guidance_scale=1.0,
                seed=seed,
            )
            clip_psnr, first_psnr = held_out_psnr(policy, held)
            checks.append((step, round(clip_psnr, 2), round(first_psnr, 2)))
            return target_psnr is not None and clip_psnr >= target_psnr

        loss, done = train_denoiser(
            [transformer, text_encoder],
            _flow_loss(transformer, text_encoder, tokenizer.pad_token_id, z, shift),
            data,
            steps=steps,
            lr=lr,
            batch_size=batch_size,
            p_uncond=p_uncond,
            seed=seed,
            progress=progress,
            stop=reached_target if target_psnr is not None else None,
            check_every=check_every,
            desc="image-to-video warm start" + (", may stop early" if target_psnr is not None else ""),
        )
    text_encoder.requires_grad_(False)
    path = Path(path)
    comp.save_pretrained(path)
    meta.update(steps_done=done, final_loss=loss, checks=checks)
    (path / "mmalign_tiny.json").write_text(json.dumps(meta, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mmalign.tiny.wan_i2v", description=__doc__.split("\n")[0]
    )
    parser.add_argument("folder", nargs="?", default=str(ASSETS))
    parser.add_argument("--train", type=int, default=64)
    parser.add_argument("--eval", type=int, default=16)
    args = parser.parse_args(argv)
    for split, path in write_i2v_dataset(args.folder, args.train, args.eval).items():
        print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
