"""Synthetic videos of static 3D rooms under a moving camera, with exact ground-truth geometry.

The data of the tiny latent geometry model and of the tiny world-consistent text-to-video task (VGGRPO).
Pure torch, deterministic given a `random.Random` (or a seed), fast on CPU: every clip is ray cast in one
vectorised pass over all its pixels and frames.

Entry points: `make_scene_clip`, `render_views`, `write_scene_dataset`; the motions are `MOTIONS`.

Details: docs/video.md, "mmalign.tiny.geometry_scenes".
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rewards.camera import intrinsics, pixel_grid, rotation_from_angles

__all__ = [
    "BOX_COLOURS",
    "FOV_X",
    "MOTIONS",
    "MOTION_PHRASES",
    "ROOM_COLOURS",
    "SPEEDS",
    "Box",
    "Plane",
    "Scene",
    "SceneClip",
    "make_scene",
    "make_scene_clip",
    "make_scene_clips",
    "render_views",
    "write_scene_dataset",
]

FOV_X = math.radians(60.0)
"""Horizontal field of view of every clip (radians)."""

MOTIONS = (
    "static",
    "pan_left",
    "pan_right",
    "dolly_in",
    "dolly_out",
    "truck_left",
    "truck_right",
    "orbit",
)
MOTION_PHRASES: dict[str, str] = {
    "static": "camera stays still",
    "pan_left": "camera pans left",
    "pan_right": "camera pans right",
    "dolly_in": "camera moves forward",
    "dolly_out": "camera moves backward",
    "truck_left": "camera slides left",
    "truck_right": "camera slides right",
    "orbit": "camera orbits the boxes",
}
"""The caption phrase of each motion (no phrase is a substring of another)."""
SPEEDS: dict[str, tuple[float, float]] = {
    "static": (0.0, 0.0),
    "pan_left": (0.25, 0.6),  # radians over the clip
    "pan_right": (0.25, 0.6),
    "dolly_in": (0.6, 1.2),  # scene units over the clip
    "dolly_out": (0.6, 1.2),
    "truck_left": (0.6, 1.5),
    "truck_right": (0.6, 1.5),
    "orbit": (0.25, 0.5),  # radians over the clip
}
"""Range of the total change over a clip, per motion."""

BOX_COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.85, 0.15, 0.12),
    "green": (0.15, 0.70, 0.20),
    "blue": (0.15, 0.30, 0.90),
    "yellow": (0.95, 0.85, 0.15),
    "purple": (0.60, 0.20, 0.75),
    "orange": (0.95, 0.55, 0.10),
}
ROOM_COLOURS: dict[str, tuple[float, float, float]] = {
    "grey": (0.60, 0.60, 0.60),
    "white": (0.90, 0.90, 0.88),
    "brown": (0.60, 0.45, 0.30),
}
BACKGROUND = (0.0, 0.0, 0.0)
"""Colour of a ray that hits nothing (never happens in the rooms of `make_scene`)."""

FLOOR_Y = 1.0
CEILING_Y = -2.5
FRONT_WALL_Z = -4.0
BACK_WALL_Z = (6.0, 8.0)
SIDE_WALL_X = (3.5, 4.5)
BOX_SIZE = (0.5, 1.5)
BOX_X = (-1.2, 1.2)
BOX_Z = (2.5, 5.0)
BOX_GAP = 0.1
"""Smallest gap between the footprints of two boxes."""
PITCH = (-0.3, -0.1)
"""Range of the camera pitch (radians, negative = looking down) of the non-orbit motions."""
FACE_SHADE = (0.8, 1.0, 0.9)
"""Brightness of faces whose normal is along x, y, z."""
TEXTURE_CONTRAST = 0.4
TEXTURES = ("checker", "stripes")

_OTHER_AXES = torch.tensor([[1, 2], [0, 2], [0, 1]])
_EPS = 1e-4


@dataclass(frozen=True)
class Plane:
    """The infinite plane ``X[axis] = offset`` (axis 0, 1, 2 = x, y, z)."""

    axis: int
    offset: float
    rgb: tuple[float, float, float]
    texture: str = "checker"
    scale: float = 1.0
    """Texture period: side of a checker cell, width of a stripe (scene units)."""


@dataclass(frozen=True)
class Box:
    """The axis-aligned box ``lo <= X <= hi``."""

    lo: tuple[float, float, float]
    hi: tuple[float, float, float]
    rgb: tuple[float, float, float]
    texture: str = "stripes"
    scale: float = 0.5
    colour: str = ""
    """Colour name for captions."""

    @property
    def centre(self) -> tuple[float, float, float]:
        (x0, y0, z0), (x1, y1, z1) = self.lo, self.hi
        return ((x0 + x1) / 2, (y0 + y1) / 2, (z0 + z1) / 2)


@dataclass(frozen=True)
class Scene:
    planes: tuple[Plane, ...]
    boxes: tuple[Box, ...]
    room_colour: str = ""

    def describe(self) -> str:
        """ "a red box and a blue box in a grey room"."""
        names = [f"{'an' if b.colour[:1] in 'aeiou' else 'a'} {b.colour} box" for b in self.boxes]
        things = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        return f"{things} in a {self.room_colour} room"

    @property
    def centre(self) -> tuple[float, float, float]:
        """Mean of the box centres (the orbit target)."""
        cs = [b.centre for b in self.boxes] or [(0.0, 0.0, 4.0)]
        x, y, z = (sum(c[i] for c in cs) / len(cs) for i in range(3))
        return (x, y, z)


@dataclass
class SceneClip:
    """One rendered clip with its exact geometry (see the module docstring for the conventions)."""

    frames: Tensor
    """Float[F, 3, H, W] in [0, 1]."""
    depth: Tensor
    """Float[F, H, W], camera-frame z of each pixel's hit (finite, > 0)."""
    centres: Tensor
    """Float[F, 3] camera centres (world)."""
    angles: Tensor
    """Float[F, 3] (yaw, pitch, roll)."""
    rotations: Tensor
    """Float[F, 3, 3] camera-to-world, ``rotation_from_angles(angles)``."""
    K: Tensor
    """Float[3, 3] intrinsics."""
    caption: str
    motion: str
    speed: float
    """The motion's total change over the clip (0 for static)."""
    target: Tensor
    """Float[3] the scene centre (the mean box centre; the point an orbit keeps in view)."""
    scene: Scene


def _scaled(rgb: tuple[float, float, float], factor: float) -> tuple[float, float, float]:
    r, g, b = (min(1.0, factor * c) for c in rgb)
    return (r, g, b)


def _uniform(rng: random.Random, lo_hi: tuple[float, float]) -> float:
    return rng.uniform(*lo_hi)


def make_scene(rng: random.Random) -> Scene:
    """A random closed room with 1-3 non-overlapping boxes on its floor."""
    room = rng.choice(sorted(ROOM_COLOURS))
    base = ROOM_COLOURS[room]
    dark, light = _scaled(base, 0.7), _scaled(base, 1.1)
    side = _uniform(rng, SIDE_WALL_X)
    planes = (
        Plane(1, FLOOR_Y, dark, "checker", rng.uniform(0.9, 1.2)),
        Plane(1, CEILING_Y, light, "checker", rng.uniform(1.0, 1.5)),
        Plane(2, _uniform(rng, BACK_WALL_Z), base, rng.choice(TEXTURES), rng.uniform(0.8, 1.2)),
        Plane(2, FRONT_WALL_Z, base, "checker", 1.0),
        Plane(0, -side, base, rng.choice(TEXTURES), rng.uniform(0.8, 1.2)),
        Plane(0, side, base, rng.choice(TEXTURES), rng.uniform(0.8, 1.2)),
    )
    count = rng.randint(1, 3)
    colours = rng.sample(sorted(BOX_COLOURS), count)
    boxes: list[Box] = []
    for colour in colours:
        for _ in range(50):
            sx, sy, sz = (_uniform(rng, BOX_SIZE) for _ in range(3))
            x, z = _uniform(rng, BOX_X), _uniform(rng, BOX_Z)
            lo = (x - sx / 2, FLOOR_Y - sy, z - sz / 2)
            hi = (x + sx / 2, FLOOR_Y, z + sz / 2)
            apart = all(
                lo[0] > b.hi[0] + BOX_GAP
                or hi[0] < b.lo[0] - BOX_GAP
                or lo[2] > b.hi[2] + BOX_GAP
                or hi[2] < b.lo[2] - BOX_GAP
                for b in boxes
            )
            if apart:
                texture = rng.choice(TEXTURES)
                boxes.append(Box(lo, hi, BOX_COLOURS[colour], texture, rng.uniform(0.4, 0.6), colour))
                break
    return Scene(planes, tuple(boxes), room)


def _surface_table(scene: Scene) -> tuple[Tensor, Tensor, Tensor]:
    surfaces: list[Plane | Box] = [*scene.planes, *scene.boxes]
    rgb = torch.tensor([s.rgb for s in surfaces], dtype=torch.float32).reshape(-1, 3)
    stripes = torch.tensor([s.texture == "stripes" for s in surfaces], dtype=torch.bool)
    scale = torch.tensor([s.scale for s in surfaces], dtype=torch.float32)
    for s in surfaces:
        if s.texture not in TEXTURES:
            raise ValueError(f"unknown texture {s.texture!r}; known: {', '.join(TEXTURES)}")
    return rgb, stripes, scale


def render_views(
    scene: Scene, k: Tensor, rotations: Tensor, centres: Tensor, height: int, width: int
) -> tuple[Tensor, Tensor]:
    """Ray cast `scene` from F cameras (K Float[3, 3], R Float[F, 3, 3], c Float[F, 3]): frames Float[F, 3,
    H, W] in [0, 1] and depth Float[F, H, W] (``inf`` where a ray hits nothing)."""
    f_count = rotations.shape[0]
    uv = pixel_grid(height, width).reshape(-1, 2)
    cam = torch.cat([uv, torch.ones_like(uv[:, :1])], -1) @ torch.linalg.inv(k.float()).T  # [P, 3], z = 1
    # d = R @ cam per frame, as multiply-and-sum so that identical poses give bit-identical rays.
    d = (cam[None, :, None, :] * rotations.float()[:, None, :, :]).sum(-1).reshape(-1, 3)  # [N, 3]
    o = centres.float()[:, None, :].expand(f_count, uv.shape[0], 3).reshape(-1, 3)
    d_safe = torch.where(d.abs() < 1e-12, torch.full_like(d, 1e-12), d)
    ts: list[Tensor] = []
    axes: list[Tensor] = []
    if scene.planes:
        p_axis = torch.tensor([p.axis for p in scene.planes])
        p_off = torch.tensor([p.offset for p in scene.planes], dtype=torch.float32)
        t = (p_off[None, :] - o[:, p_axis]) / d_safe[:, p_axis]  # [N, P]
        ts.append(torch.where(t > _EPS, t, torch.full_like(t, math.inf)))
        axes.append(p_axis[None, :].expand_as(t))
    if scene.boxes:
        lo = torch.tensor([b.lo for b in scene.boxes], dtype=torch.float32)
        hi = torch.tensor([b.hi for b in scene.boxes], dtype=torch.float32)
        t1 = (lo[None] - o[:, None]) / d_safe[:, None]  # [N, B, 3]
        t2 = (hi[None] - o[:, None]) / d_safe[:, None]
        t_near, axis = torch.minimum(t1, t2).max(-1)
        t_far = torch.maximum(t1, t2).min(-1).values
        hit = (t_far >= t_near) & (t_near > _EPS)
        ts.append(torch.where(hit, t_near, torch.full_like(t_near, math.inf)))
        axes.append(axis)
    n = o.shape[0]
    if not ts:
        depth = torch.full((n,), math.inf)
        rgb = torch.tensor(BACKGROUND).expand(n, 3)
    else:
        t_all, axis_all = torch.cat(ts, 1), torch.cat(axes, 1)
        depth, idx = t_all.min(1)
        axis = axis_all.gather(1, idx[:, None])[:, 0]
        colours, stripes, scale = _surface_table(scene)
        hit = torch.isfinite(depth)
        t = torch.where(hit, depth, torch.zeros_like(depth))
        point = o + t[:, None] * d
        uv_tex = point.gather(1, _OTHER_AXES[axis])  # the two in-plane world coordinates
        s = scale[idx]
        a, b = (math.pi * uv_tex / s[:, None]).unbind(-1)
        pattern = torch.where(
            stripes[idx], torch.tanh(3.0 * torch.sin(a + b)), torch.tanh(4.0 * a.sin() * b.sin())
        )
        # Fade the texture where a cell is smaller than ~1.5 pixels (footprint of a pixel on the surface).
        d_axis = d.gather(1, axis[:, None])[:, 0].abs().clamp_min(1e-6)
        footprint = t * (d * d).sum(-1) / (k[0, 0].float() * d_axis)
        fade = ((0.7 - footprint / s) / 0.35).clamp(0.0, 1.0)
        bright = 1.0 + TEXTURE_CONTRAST * 0.5 * pattern * fade - TEXTURE_CONTRAST * 0.5
        shade = torch.tensor(FACE_SHADE)[axis]
        rgb = (colours[idx] * (bright * shade)[:, None]).clamp(0.0, 1.0)
        rgb = torch.where(hit[:, None], rgb, torch.tensor(BACKGROUND).expand(n, 3))
    frames = rgb.reshape(f_count, height, width, 3).permute(0, 3, 1, 2).contiguous()
    return frames, depth.reshape(f_count, height, width)


def _trajectory(
    rng: random.Random, motion: str, num_frames: int, scene: Scene
) -> tuple[Tensor, Tensor, float]:
    """Smooth (centres Float[F, 3], angles Float[F, 3]) of `motion` and its speed, in float64."""
    speed = _uniform(rng, SPEEDS[motion])
    t = torch.linspace(0.0, 1.0, num_frames, dtype=torch.float64)[:, None]
    c0 = torch.tensor(
        [rng.uniform(-0.3, 0.3), rng.uniform(-0.15, 0.15), rng.uniform(-0.2, 0.2)], dtype=torch.float64
    )
    yaw0, pitch = rng.uniform(-0.1, 0.1), _uniform(rng, PITCH)
    if motion == "orbit":
        sign = rng.choice((-1.0, 1.0))
        tx, ty, tz = scene.centre
        radius = math.hypot(tx - c0[0].item(), tz - c0[2].item())
        theta = sign * speed * (t[:, 0] - 0.5)  # yaw, symmetric about facing the target
        centres = torch.stack(
            [tx - radius * theta.sin(), torch.full_like(theta, c0[1].item()), tz - radius * theta.cos()], -1
        )
        pitch = -math.atan2(ty - c0[1].item(), radius)
        angles = torch.stack([theta, torch.full_like(theta, pitch), torch.zeros_like(theta)], -1)
        return centres, angles, speed
    step = {"pan_left": -1.0, "pan_right": 1.0}.get(motion, 0.0)
    yaw0 -= step * speed / 2  # keep the boxes around the middle of the pan
    if motion.startswith("truck"):
        c0[0] += (speed / 2) if motion == "truck_left" else -(speed / 2)
    yaw = yaw0 + step * speed * t[:, 0]
    angles = torch.stack([yaw, torch.full_like(yaw, pitch), torch.zeros_like(yaw)], -1)
    r0 = rotation_from_angles(angles[0])
    direction = {
        "dolly_in": r0[:, 2],
        "dolly_out": -r0[:, 2],
        "truck_left": -r0[:, 0],
        "truck_right": r0[:, 0],
    }.get(motion, torch.zeros(3, dtype=torch.float64))
    centres = c0[None, :] + speed * t * direction[None, :]
    return centres, angles, speed


def make_scene_clip(
    rng: random.Random,
    motion: str | None = None,
    *,
    num_frames: int = 9,
    height: int = 32,
    width: int = 32,
    jitter: float = 0.0,
) -> SceneClip:
    """Render one random room under camera `motion` (one of `MOTIONS`; None: a random one)."""
    if motion is None:
        motion = rng.choice(MOTIONS)
    if motion not in MOTIONS:
        raise ValueError(f"unknown motion {motion!r}; known: {', '.join(MOTIONS)}")
    if num_frames < 2:
        raise ValueError(f"num_frames must be >= 2, got {num_frames}")
    if height < 1 or width < 1:
        raise ValueError(f"height and width must be >= 1, got {height} x {width}")
    if jitter < 0:
        raise ValueError(f"jitter must be >= 0, got {jitter}")
    scene = make_scene(rng)
    centres, angles, speed = _trajectory(rng, motion, num_frames, scene)
    if jitter > 0:
        noise = torch.tensor([[rng.gauss(0.0, jitter) for _ in range(6)] for _ in range(num_frames)])
        centres = centres + noise[:, :3].double()
        angles = angles + noise[:, 3:].double()
    centres, angles = centres.float(), angles.float()
    rotations = rotation_from_angles(angles)
    k = intrinsics(FOV_X, height, width)
    frames, depth = render_views(scene, k, rotations, centres, height, width)
    caption = f"{scene.describe()}, {MOTION_PHRASES[motion]}"
    target = torch.tensor(scene.centre, dtype=torch.float32)
    return SceneClip(frames, depth, centres, angles, rotations, k, caption, motion, speed, target, scene)


def make_scene_clips(n: int, seed: int, **kw: Any) -> list[SceneClip]:
    """`n` clips from ``random.Random(seed)``; `kw` go to `make_scene_clip` (``motion`` included)."""
    rng = random.Random(seed)
    return [make_scene_clip(rng, **kw) for _ in range(n)]


def write_scene_dataset(out_dir: str | Path, n: int, seed: int, **kw: Any) -> Path:
    """Write `n` clips (`make_scene_clips`) as ``out_dir/clips/NNNNNN.npz`` and ``out_dir/scenes.jsonl``
    (see the module docstring); returns the JSONL path."""
    import numpy as np

    out_dir = Path(out_dir)
    clips_dir = out_dir / "clips"
    try:
        clips_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create the dataset folder {clips_dir}: {e}") from e
    rows = []
    for i, clip in enumerate(make_scene_clips(n, seed, **kw)):
        rel = f"clips/{i:06d}.npz"
        path = out_dir / rel
        try:
            np.savez_compressed(
                path,
                frames=(clip.frames.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy(),
                depth=clip.depth.numpy().astype(np.float16),
                centres=clip.centres.numpy(),
                angles=clip.angles.numpy(),
                rotations=clip.rotations.numpy(),
                K=clip.K.numpy(),
            )
        except OSError as e:
            raise OSError(f"cannot write {path}: {e}") from e
        rows.append(json.dumps({"prompt": clip.caption, "motion": clip.motion, "video": rel}))
    jsonl = out_dir / "scenes.jsonl"
    try:
        jsonl.write_text("\n".join(rows) + ("\n" if rows else ""))
    except OSError as e:
        raise OSError(f"cannot write {jsonl}: {e}") from e
    return jsonl
