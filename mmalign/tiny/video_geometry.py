"""A tiny text-to-video Wan model of rendered 3-D scenes under a moving camera, with its latent geometry model
(VGGRPO's tiny task, `pipelines.video.video_geometry`; also Euphonium's, `pipelines.video.euphonium`).

Builder ``video_geometry`` (`build_video_geometry`): a Wan-layout folder plus ``geometry/`` and
``mmalign_tiny.json``.

Details: docs/video.md, "mmalign.tiny.video_geometry".
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.tiny import BUILDERS
from mmalign.tiny.warm_start import fit

__all__ = ["GEOMETRY_SUBFOLDER", "build_video_geometry", "geometry_targets", "write_prompt_files"]

GEOMETRY_SUBFOLDER = "geometry"
"""Where the latent geometry model is saved inside the tiny folder."""


def geometry_targets(clips: list[Any], temporal: int = 2, spatial: int = 4) -> dict[str, Tensor]:
    """The renderer's exact geometry at the latent frames and resolution of `clips` (`SceneClip`): ``depth``
    Float[N, f, h, w] (mean of each `spatial` x `spatial` block of pixel frame ``temporal * k``), ``centres``
    and ``angles`` Float[N, f, 3] relative to frame 0 (``R_0^T (c_t - c_0)``, angles of ``R_0^T R_t``)."""
    from rewards.camera import angles_from_rotation

    frames = clips[0].depth.shape[0]
    idx = list(range(0, frames, temporal))
    depth = torch.stack([c.depth[idx] for c in clips])
    depth = torch.nn.functional.avg_pool2d(depth, spatial)
    rot = torch.stack([c.rotations[idx] for c in clips])  # [N, f, 3, 3]
    cen = torch.stack([c.centres[idx] for c in clips])
    r0 = rot[:, :1]
    rel_rot = r0.transpose(-1, -2) @ rot
    rel_cen = (r0.transpose(-1, -2) @ (cen - cen[:, :1])[..., None])[..., 0]
    return {"depth": depth, "centres": rel_cen, "angles": angles_from_rotation(rel_rot)}


def _geometry_loss(
    out: Any, target: dict[str, Tensor], pose_weight: float
) -> tuple[Tensor, dict[str, float]]:
    depth = (out.depth.clamp_min(1e-3).log() - target["depth"].log()).abs().mean()
    cen = (out.centres - target["centres"]).pow(2).sum(-1).mean()
    ang = (out.angles - target["angles"]).pow(2).sum(-1).mean()
    dyn = out.dynamic.mean() if out.dynamic is not None else out.depth.new_zeros(())
    return depth + pose_weight * (cen + ang) + dyn, {
        "depth": float(depth.detach()),
        "centre": float(cen.detach()),
        "angle": float(ang.detach()),
    }


def _geometry_errors(model: Any, latents: Tensor, target: dict[str, Tensor]) -> dict[str, float]:
    """Mean absolute relative depth error, mean centre error (world units) and angle error (degrees)."""
    with torch.no_grad():
        out = model(latents)
    rel = ((out.depth - target["depth"]).abs() / target["depth"]).mean()
    cen = (out.centres - target["centres"]).norm(dim=-1)[:, 1:].mean()
    ang = (out.angles - target["angles"]).norm(dim=-1)[:, 1:].mean()
    return {
        "depth_rel_error": round(float(rel), 4),
        "centre_error": round(float(cen), 4),
        "angle_error_deg": round(math.degrees(float(ang)), 3),
        "target_centre_step": round(
            float((target["centres"][:, 1:] - target["centres"][:, :-1]).norm(dim=-1).mean()), 4
        ),
    }


def _geometry_rewards(model: Any, latents: Tensor) -> dict[str, float]:
    from rewards.geometry_model import camera_smoothness, motion_degree, reprojection_consistency

    with torch.no_grad():
        g = model(latents)
    k = g.batched_intrinsics
    return {
        "camera_smoothness": round(float(camera_smoothness(g.centres, g.angles).mean()), 4),
        "reprojection_consistency": round(
            float(reprojection_consistency(g.depth, g.centres, g.angles, k, g.dynamic).mean()), 4
        ),
        "motion_degree": round(float(motion_degree(g.centres, g.angles, g.depth, g.dynamic).mean()), 4),
    }


def _sigmas(u: Tensor, shift: float) -> Tensor:
    return shift * u / (1 + (shift - 1) * u)


def _sample(
    transformer: torch.nn.Module, shape: tuple[int, ...], text: Tensor, steps: int, shift: float, seed: int
) -> Tensor:
    """Deterministic Euler samples of the rectified flow from seeded noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    sig = _sigmas(torch.linspace(1, 0, steps + 1), shift)
    with torch.no_grad():
        for i in range(steps):
            t = torch.full((shape[0],), float(sig[i]) * 1000)
            v = transformer(x, t, text, return_dict=False)[0]
            x = x + (sig[i + 1] - sig[i]) * v
    return x


def build_video_geometry(
    path: Path,
    *,
    num_clips: int = 768,
    vae_steps: int = 1200,
    vae_lr: float = 1e-3,
    vae_batch_size: int = 4,
    min_vae_psnr: float = 18.0,
    geometry_steps: int = 1500,
    geometry_lr: float = 2e-3,
    geometry_hidden: int = 32,
    geometry_layers: int = 3,
    pose_weight: float = 4.0,
    steps: int = 800,
    lr: float = 1e-3,
    batch_size: int = 16,
    shift: float = 3.0,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    attention_head_dim: int = 16,
    text_hidden: int = 32,
    seed: int = 0,
    vae_from: str | None = None,
    progress: bool = True,
) -> None:
    """Write the tiny scene model to `path` (see the module docstring for the phases). `vae_from`: a folder
    holding an already fitted tiny Wan VAE (``save_pretrained``) to use instead of phase 1 (experiments)."""
    meta: dict[str, Any] = {
        "builder": "video_geometry",
        **{k: v for k, v in locals().items() if k not in ("path", "progress")},
    }
    from mmalign.policies.wan_components import decode_video, encode_prompt, encode_video
    from mmalign.tiny.geometry_scenes import FOV_X, make_scene_clips
    from mmalign.tiny.wan import fitted_tiny_wan, tiny_wan_transformer
    from rewards.geometry_model import TinyLatentGeometry

    clips = make_scene_clips(num_clips, seed + 1000)
    held = make_scene_clips(64, seed + 2000)
    videos = torch.stack([c.frames for c in clips])
    comp, meta["vae_psnr"] = fitted_tiny_wan(
        "video_geometry",
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
    vae = comp.vae
    z_train = encode_video(vae, videos)
    held_videos = torch.stack([c.frames for c in held])
    z_held = encode_video(vae, held_videos)
    t_train, t_held = geometry_targets(clips), geometry_targets(held)

    # phase 2: the latent geometry model
    z = int(vae.config.z_dim)
    geometry = TinyLatentGeometry(
        latent_channels=z, hidden=geometry_hidden, layers=geometry_layers, fov_x=FOV_X
    )
    opt = torch.optim.AdamW(geometry.parameters(), lr=geometry_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, geometry_steps)
    g = torch.Generator().manual_seed(seed)

    def geometry_loss(_: int) -> torch.Tensor:
        idx = torch.randint(0, num_clips, (32,), generator=g)
        return _geometry_loss(geometry(z_train[idx]), {k: v[idx] for k, v in t_train.items()}, pose_weight)[0]

    fit(opt, geometry_steps, geometry_loss, "latent geometry model", sched=sched, progress=progress)
    geometry.eval().requires_grad_(False)
    meta["geometry_held_out"] = _geometry_errors(geometry, z_held, t_held)
    # the same clips through decode and encode again: what the model sees of a generated clip
    z_round = encode_video(vae, decode_video(vae, z_held))
    meta["geometry_held_out_reencoded"] = _geometry_errors(geometry, z_round, t_held)
    meta["rewards_ground_truth_clips"] = _geometry_rewards(geometry, z_held)

    # phase 3: text to video
    transformer = tiny_wan_transformer(
        z,
        z,
        num_layers=num_layers,
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,
        text_hidden=text_hidden,
    )
    text_encoder, tokenizer = comp.text_encoder, comp.tokenizer
    text_encoder.train().requires_grad_(True)
    captions = [c.caption for c in clips]
    max_len = max(len(tokenizer(p).input_ids) for p in captions + [c.caption for c in held])
    params = list(transformer.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))

    def video_loss(_: int) -> torch.Tensor:
        idx = torch.randint(0, num_clips, (batch_size,), generator=g)
        x0 = z_train[idx]
        noise = torch.randn(x0.shape, generator=g)
        sigma = _sigmas(torch.rand(batch_size, generator=g), shift)
        s = sigma.view(-1, 1, 1, 1, 1)
        text = encode_prompt(text_encoder, tokenizer, [captions[i] for i in idx.tolist()], "cpu", max_len)
        pred = transformer((1 - s) * x0 + s * noise, sigma * 1000, text, return_dict=False)[0]
        return (pred - (noise - x0)).pow(2).mean()

    losses = fit(
        opt, steps, video_loss, "text-to-video warm start", sched=warm, clip_norm=1.0, progress=progress
    )
    loss_v = losses[-1] if losses else float("nan")
    text_encoder.eval().requires_grad_(False)
    transformer.eval()
    with torch.no_grad():
        text_h = encode_prompt(text_encoder, tokenizer, [c.caption for c in held], "cpu", max_len)
    samples = _sample(transformer, tuple(z_held.shape), text_h, 10, shift, seed)
    meta["rewards_warm_start_samples"] = _geometry_rewards(geometry, samples)
    comp.transformer = transformer
    path = Path(path)
    comp.save_pretrained(path)
    geometry.save_pretrained(path / GEOMETRY_SUBFOLDER)
    meta.update(final_loss=loss_v, max_prompt_tokens=max_len)
    (path / "mmalign_tiny.json").write_text(json.dumps(meta, indent=2) + "\n")
    if not math.isfinite(loss_v):
        raise RuntimeError(
            f"text-to-video warm start diverged (loss {loss_v}); see {path / 'mmalign_tiny.json'}"
        )


def write_prompt_files(
    out_dir: str | Path, num_train: int = 64, num_eval: int = 16, seed: int = 3000
) -> None:
    """Write ``train.jsonl`` and ``eval.jsonl`` of scene captions with a moving camera (no ``static`` clips: the
    tiny task rewards consistent motion) to `out_dir`: rows ``{"prompt", "motion"}``, the eval rows cycling
    through the motions so that ``eval.split_column: motion`` has every kind."""
    from mmalign.tiny.geometry_scenes import MOTIONS, make_scene_clip

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    moving = [m for m in MOTIONS if m != "static"]
    rng = random.Random(seed)
    for name, n in (("train", num_train), ("eval", num_eval)):
        rows = []
        for i in range(n):
            clip = make_scene_clip(rng, moving[i % len(moving)] if name == "eval" else rng.choice(moving))
            rows.append({"prompt": clip.caption, "motion": clip.motion})
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@BUILDERS.register("video_geometry", minutes=12)
def _build(path: Path) -> None:
    build_video_geometry(path)
