"""The synthetic geometry scenes: exact depth, multi-view consistency, camera motions, determinism."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mmalign.tiny.geometry_scenes import (
    BOX_COLOURS,
    FOV_X,
    MOTION_PHRASES,
    MOTIONS,
    Plane,
    Scene,
    SceneClip,
    make_scene_clip,
    make_scene_clips,
    render_views,
    write_scene_dataset,
)
from rewards.camera import intrinsics, project, rotation_from_angles, unproject

LINEAR = ("static", "pan_left", "pan_right", "dolly_in", "dolly_out", "truck_left", "truck_right")


def clip_of(motion: str, seed: int = 0, **kw) -> SceneClip:
    return make_scene_clip(random.Random(seed), motion, **kw)


def plane_depth(axis: int, offset: float, centres, angles, height: int, width: int) -> torch.Tensor:
    """Hand-derived camera-z depth of the plane X[axis] = offset, in float64 (inf where the ray misses it).

    The ray of pixel (i, j) is c + s * R (x, y, 1) with x = (j + .5 - W/2) / f, y = (i + .5 - H/2) / f, whose
    camera z is s; it meets the plane at s = (offset - c[axis]) / (R[axis] . (x, y, 1)), with the rows of
    R = R_y(yaw) R_x(pitch) (roll 0) written out by hand."""
    f = (width / 2) / math.tan(FOV_X / 2)
    y, x = torch.meshgrid(
        (torch.arange(height, dtype=torch.float64) + 0.5 - height / 2) / f,
        (torch.arange(width, dtype=torch.float64) + 0.5 - width / 2) / f,
        indexing="ij",
    )
    out = []
    for c, (yaw, pitch, roll) in zip(centres.tolist(), angles.tolist()):
        assert roll == 0.0
        cy, sy, cp, sp = math.cos(yaw), math.sin(yaw), math.cos(pitch), math.sin(pitch)
        rows = [[cy, sy * sp, sy * cp], [0.0, cp, -sp], [-sy, cy * sp, cy * cp]]
        denom = rows[axis][0] * x + rows[axis][1] * y + rows[axis][2]
        s = (offset - c[axis]) / denom
        out.append(torch.where((denom.abs() > 1e-12) & (s > 0), s, torch.full_like(s, math.inf)))
    return torch.stack(out)


def test_shapes_dtypes_ranges_and_captions():
    for i, motion in enumerate(MOTIONS):
        clip = clip_of(motion, seed=i)
        assert clip.motion == motion
        assert clip.frames.shape == (9, 3, 32, 32) and clip.frames.dtype == torch.float32
        assert clip.depth.shape == (9, 32, 32) and clip.depth.dtype == torch.float32
        assert clip.centres.shape == (9, 3) and clip.angles.shape == (9, 3)
        assert clip.rotations.shape == (9, 3, 3) and clip.K.shape == (3, 3)
        assert 0.0 <= clip.frames.min() and clip.frames.max() <= 1.0
        assert torch.isfinite(clip.depth).all() and (clip.depth > 0).all()
        assert torch.allclose(clip.K, intrinsics(FOV_X, 32, 32))
        assert torch.allclose(clip.rotations, rotation_from_angles(clip.angles), atol=1e-6)
        assert MOTION_PHRASES[motion] in clip.caption
        assert all(b.colour in clip.caption for b in clip.scene.boxes)
        assert 1 <= len(clip.scene.boxes) <= 3
        assert f"in a {clip.scene.room_colour} room" in clip.caption
        assert clip.frames.std() > 0.05  # textured, not a flat image
    # Other sizes and frame counts; every depth finite also for odd sizes and jittered cameras.
    for kw in ({"num_frames": 2, "height": 24, "width": 40}, {"num_frames": 5, "height": 17, "width": 15}):
        clip = clip_of("orbit", seed=3, jitter=0.05, **kw)
        h, w = kw["height"], kw["width"]
        assert clip.frames.shape == (kw["num_frames"], 3, h, w)
        assert torch.isfinite(clip.depth).all()
    for clip in make_scene_clips(40, seed=11):  # random motions: finite everywhere, captions well formed
        assert torch.isfinite(clip.depth).all() and (clip.depth > 0).all()
        assert clip.caption.endswith(MOTION_PHRASES[clip.motion])
        assert " a o" not in clip.caption and set(clip.caption) <= set("abcdefghijklmnopqrstuvwxyz ,")
    with pytest.raises(ValueError, match="num_frames"):
        clip_of("static", num_frames=1)
    with pytest.raises(ValueError, match="unknown motion"):
        clip_of("zoom")


def test_depth_is_exact_for_a_floor_only_scene():
    angles = torch.tensor([[0.0, -0.3, 0.0], [0.2, -0.5, 0.0], [-0.4, 0.1, 0.0]])
    centres = torch.tensor([[0.0, 0.0, 0.0], [1.0, -0.5, 2.0], [-2.0, 0.3, 1.0]])
    scene = Scene((Plane(1, 1.0, (0.5, 0.5, 0.5)),), ())
    h, w = 12, 16
    frames, depth = render_views(scene, intrinsics(FOV_X, h, w), rotation_from_angles(angles), centres, h, w)
    expected = plane_depth(1, 1.0, centres.double(), angles.double(), h, w)
    hit = torch.isfinite(expected)
    assert hit.float().mean() > 0.3 and (~hit).any()  # some rays miss the floor (above the horizon)
    assert torch.equal(torch.isfinite(depth), hit)
    assert torch.allclose(depth[hit].double(), expected[hit], rtol=1e-4, atol=1e-5)
    assert frames.shape == (3, 3, h, w)


def test_depth_matches_room_planes_and_lies_on_surfaces():
    for i, motion in enumerate(MOTIONS):
        clip = clip_of(motion, seed=100 + i)
        h, w = clip.depth.shape[-2:]
        on_some_plane = torch.zeros_like(clip.depth, dtype=torch.bool)
        for plane in clip.scene.planes:
            expected = plane_depth(
                plane.axis, plane.offset, clip.centres.double(), clip.angles.double(), h, w
            )
            hit = torch.isfinite(expected)
            # The room is convex and closed: nothing visible lies beyond any wall, floor or ceiling.
            assert (clip.depth[hit].double() <= expected[hit] * (1 + 1e-4) + 1e-5).all()
            on_some_plane |= hit & ((clip.depth.double() - expected).abs() <= 1e-4 * expected)
        assert on_some_plane.float().mean() > 0.3
        # Every unprojected pixel lies on a wall or on a box face.
        pts = unproject(clip.depth, clip.K, clip.rotations, clip.centres).reshape(-1, 3)
        on_surface = torch.zeros(len(pts), dtype=torch.bool)
        for plane in clip.scene.planes:
            on_surface |= (pts[:, plane.axis] - plane.offset).abs() < 1e-3
        for box in clip.scene.boxes:
            lo, hi = torch.tensor(box.lo), torch.tensor(box.hi)
            inside = ((pts >= lo - 1e-3) & (pts <= hi + 1e-3)).all(-1)
            on_face = ((pts - lo).abs() < 1e-3).any(-1) | ((pts - hi).abs() < 1e-3).any(-1)
            on_surface |= inside & on_face
        assert on_surface.all(), f"{motion}: {(~on_surface).sum()} pixels off every surface"
        assert not on_some_plane.all()  # the boxes are visible


def reprojection_agreement(clip: SceneClip, k: int, centres=None) -> tuple[float, float]:
    """(visible fraction, fraction of visible pixels whose colours agree) of frame 0 warped into frame k."""
    centres = clip.centres if centres is None else centres
    h, w = clip.depth.shape[-2:]
    pts = unproject(clip.depth[0], clip.K, clip.rotations[0], centres[0]).reshape(-1, 3)
    uv, z = project(pts, clip.K, clip.rotations[k], centres[k])
    inside = (z > 0) & (uv[:, 0] >= 0.5) & (uv[:, 0] <= w - 0.5) & (uv[:, 1] >= 0.5) & (uv[:, 1] <= h - 0.5)
    col = ((uv[:, 0] - 0.5).round().clamp(0, w - 1)).long()
    row = ((uv[:, 1] - 0.5).round().clamp(0, h - 1)).long()
    visible = inside & ((z - clip.depth[k][row, col]).abs() < 0.03 * z)
    grid = torch.stack([uv[:, 0] / w * 2 - 1, uv[:, 1] / h * 2 - 1], -1)[None, None]
    warped = F.grid_sample(clip.frames[k : k + 1], grid, mode="bilinear", align_corners=False)[0, :, 0].T
    source = clip.frames[0].permute(1, 2, 0).reshape(-1, 3)
    agree = (warped - source).abs().max(-1).values < 0.08
    return visible.float().mean().item(), agree[visible].float().mean().item()


def test_multi_view_consistency():
    for i, motion in enumerate(MOTIONS):
        if motion == "static":
            continue
        clip = clip_of(motion, seed=200 + i)
        for k in (1, 4, 8):
            visible, agree = reprojection_agreement(clip, k)
            assert visible > 0.25, (motion, k, visible)
            assert agree > 0.8, (motion, k, agree)
        # Control: with a wrong pose for the last frame, far fewer pixels are confirmed consistent.
        wrong = clip.centres.clone()
        wrong[-1] += torch.tensor([0.4, -0.3, 0.0])
        visible_wrong, agree_wrong = reprojection_agreement(clip, 8, wrong)
        assert visible_wrong * agree_wrong < 0.5 * visible * agree, (motion, visible_wrong, agree_wrong)


def second_diff(x: torch.Tensor) -> torch.Tensor:
    return x[2:] - 2 * x[1:-1] + x[:-2]


def test_motions():
    static = clip_of("static")
    assert all(torch.equal(static.frames[0], f) for f in static.frames)
    assert all(torch.equal(static.depth[0], d) for d in static.depth)
    assert torch.equal(static.centres, static.centres[:1].expand(9, 3))

    for motion, sign in (("pan_left", -1), ("pan_right", 1)):
        clip = clip_of(motion, seed=1)
        assert torch.equal(clip.centres, clip.centres[:1].expand_as(clip.centres))
        steps = clip.angles[1:, 0] - clip.angles[:-1, 0]
        assert (sign * steps > 0.01).all()
        assert torch.allclose(steps, steps[:1].expand_as(steps), atol=1e-5)
        assert torch.allclose(clip.angles[:, 1:], clip.angles[:1, 1:].expand(9, 2))
        assert not torch.equal(clip.frames[0], clip.frames[-1])

    for motion, axis, sign in (
        ("dolly_in", 2, 1),
        ("dolly_out", 2, -1),
        ("truck_left", 0, -1),
        ("truck_right", 0, 1),
    ):
        clip = clip_of(motion, seed=2)
        assert torch.allclose(clip.rotations, clip.rotations[:1].expand_as(clip.rotations))
        move = clip.centres[-1] - clip.centres[0]
        direction = clip.rotations[0][:, axis]  # the camera's z (view) or x axis in world coordinates
        assert sign * torch.dot(move, direction) > 0.5
        assert torch.linalg.cross(move, direction).norm() < 1e-5
        if axis == 0:
            assert torch.allclose(clip.centres[:, 1], clip.centres[:1, 1].expand(9))  # horizontal

    clip = clip_of("orbit", seed=3)
    to_target = clip.target[None] - clip.centres
    view = clip.rotations[:, :, 2]
    assert torch.linalg.cross(to_target, view, dim=-1).norm(dim=-1).max() < 1e-4  # keeps looking at it
    assert (torch.sum(to_target * view, -1) > 0).all()
    radius = to_target[:, [0, 2]].norm(dim=-1)
    assert torch.allclose(radius, radius[:1].expand(9), atol=1e-4)
    assert torch.allclose(clip.centres[:, 1], clip.centres[:1, 1].expand(9))
    assert (clip.angles[1:, 0] - clip.angles[:-1, 0]).abs().min() > 0.01

    for i, motion in enumerate(MOTIONS):
        smooth = clip_of(motion, seed=10 + i)
        assert second_diff(smooth.angles).abs().max() < 1e-5, motion
        if motion in LINEAR:
            assert second_diff(smooth.centres).abs().max() < 1e-5, motion
        else:  # an orbit is smooth: equal steps along the circle
            steps = (smooth.centres[1:] - smooth.centres[:-1]).norm(dim=-1)
            assert torch.allclose(steps, steps[:1].expand_as(steps), atol=1e-4)
        shaky = clip_of(motion, seed=10 + i, jitter=0.02)
        assert second_diff(shaky.centres).abs().max() > 1e-3, motion
        assert second_diff(shaky.angles).abs().max() > 1e-3, motion
    shaky_static = clip_of("static", jitter=0.02)
    assert not torch.equal(shaky_static.frames[0], shaky_static.frames[1])


def test_determinism():
    a, b = make_scene_clips(4, seed=7), make_scene_clips(4, seed=7)
    for x, y in zip(a, b):
        assert x.caption == y.caption and x.motion == y.motion
        for name in ("frames", "depth", "centres", "angles", "rotations", "K"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name
    c = make_scene_clips(4, seed=8)
    assert any(not torch.equal(x.frames, y.frames) for x, y in zip(a, c))
    assert [x.caption for x in a] != [y.caption for y in c]
    motions = {clip.motion for clip in make_scene_clips(40, seed=1, num_frames=2, height=4, width=4)}
    assert len(motions) >= 5  # motion=None draws among all kinds
    assert {clip.motion for clip in make_scene_clips(3, seed=1, motion="orbit")} == {"orbit"}
    assert set(BOX_COLOURS) >= {b.colour for clip in a for b in clip.scene.boxes}


def test_write_scene_dataset(tmp_path):
    from mmalign.data.media import read_video

    jsonl = write_scene_dataset(tmp_path / "ds", 3, seed=5)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    clips = make_scene_clips(3, seed=5)
    assert [r["prompt"] for r in rows] == [c.caption for c in clips]
    assert [r["motion"] for r in rows] == [c.motion for c in clips]
    path = jsonl.parent / rows[0]["video"]
    with np.load(path) as npz:
        assert npz["frames"].dtype == np.uint8 and npz["frames"].shape == (9, 32, 32, 3)
        assert npz["depth"].dtype == np.float16
        assert np.allclose(npz["depth"], clips[0].depth.numpy(), rtol=1e-3)
        assert np.allclose(npz["centres"], clips[0].centres.numpy())
        assert np.allclose(npz["K"], clips[0].K.numpy())
    assert torch.allclose(read_video(path), clips[0].frames, atol=1 / 255)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="file"):
        write_scene_dataset(blocker, 1, seed=0)
