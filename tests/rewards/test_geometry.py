"""Latent geometry rewards (rewards/geometry_model.py, rewards/geometry.py): the reward math against plain-Python
references and hand-worked synthetic scenes, the tiny latent geometry model, the model loader and the
registered rewards on latents-only batches."""

from __future__ import annotations

import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import rewards.geometry as rg  # registers the geometry rewards (rewards/__init__.py may not import it)
from rewards import RewardBatch, RewardSet, load_reward
from rewards.camera import intrinsics, rotation_from_angles
from rewards.geometry_model import (
    GeometryOutput,
    LatentGeometryModel,
    TinyLatentGeometry,
    camera_smoothness,
    load_geometry_model,
    motion_degree,
    motion_guard,
    reprojection_consistency,
    reprojection_errors,
    smoothness_errors,
    wrap_angle,
)


# =========================================================================== camera smoothness
def _wrap(x: float) -> float:
    while x > math.pi:
        x -= 2 * math.pi
    while x <= -math.pi:
        x += 2 * math.pi
    return x


def _ref_error(traj: list[list[float]], wrap: bool, eps: float = 1e-6) -> float:
    """e = mean_t ||a_t|| / (||v_t|| + ||v_{t-1}|| + eps), written from the formula with plain floats."""
    w = _wrap if wrap else (lambda x: x)
    v = [[w(traj[t][d] - traj[t - 1][d]) for d in range(3)] for t in range(1, len(traj))]
    terms = []
    for t in range(1, len(v)):
        a = [w(v[t][d] - v[t - 1][d]) for d in range(3)]
        na = math.sqrt(sum(x * x for x in a))
        n1 = math.sqrt(sum(x * x for x in v[t]))
        n0 = math.sqrt(sum(x * x for x in v[t - 1]))
        terms.append(na / (n1 + n0 + eps))
    return sum(terms) / len(terms)


def test_camera_smoothness_matches_plain_loop() -> None:
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(3, 6, 3, generator=g, dtype=torch.float64)
    angles = 2.5 * torch.randn(3, 6, 3, generator=g, dtype=torch.float64)  # large: the wrap matters
    r = camera_smoothness(centres, angles)
    e_t, e_r = smoothness_errors(centres, angles)
    for b in range(3):
        et = _ref_error(centres[b].tolist(), wrap=False)
        er = _ref_error(angles[b].tolist(), wrap=True)
        assert e_t[b].item() == pytest.approx(et, rel=1e-9)
        assert e_r[b].item() == pytest.approx(er, rel=1e-9)
        assert r[b].item() == pytest.approx(0.5 * (1 / (1 + et) + 1 / (1 + er)), rel=1e-9)


def test_wrap_angle_range() -> None:
    x = torch.tensor([math.pi, -math.pi, 3 * math.pi / 2, -3 * math.pi / 2, 0.3, 7.0], dtype=torch.float64)
    out = wrap_angle(x)
    assert all(_wrap(v) == pytest.approx(o, abs=1e-12) for v, o in zip(x.tolist(), out.tolist()))
    assert out[0].item() == pytest.approx(math.pi) and out[1].item() == pytest.approx(math.pi)


def test_camera_smoothness_constant_velocity_and_jitter() -> None:
    t = torch.arange(8, dtype=torch.float64)[:, None]
    centres = (torch.tensor([0.3, -0.1, 0.2], dtype=torch.float64) * t)[None]
    angles = (torch.tensor([0.05, 0.01, -0.02], dtype=torch.float64) * t)[None]
    assert camera_smoothness(centres, angles).item() == pytest.approx(1.0, abs=1e-12)
    g = torch.Generator().manual_seed(1)
    noise_c, noise_a = torch.randn(centres.shape, generator=g), torch.randn(angles.shape, generator=g)
    values = [
        camera_smoothness(centres + s * noise_c, angles + 0.1 * s * noise_a).item() for s in (0.01, 0.1, 0.5)
    ]
    assert values[0] < 1.0
    assert values[0] > values[1] > values[2] >= 0.5


def test_camera_smoothness_needs_three_frames() -> None:
    with pytest.raises(ValueError, match="F = 2"):
        camera_smoothness(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3))


# =========================================================================== reprojection
def _plane_scene(depth_offset: float = 0.0) -> tuple[torch.Tensor, ...]:
    """A fronto-parallel plane z = 2 seen by 3 cameras (R = I) at x = 0, 1, 2; 4 x 8 pixels, f = 4.

    f * dx / Z = 2: an uncorrupted point moves by exactly 2 pixels per camera step. Depth = Z0 - c_z = 2.
    """
    h, w = 4, 8
    k = torch.tensor([[4.0, 0.0, 4.0], [0.0, 4.0, 2.0], [0.0, 0.0, 1.0]])
    centres = torch.tensor([[[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [2.0, 0.0, 0.0]]])
    angles = torch.zeros(1, 3, 3)
    depth = torch.full((1, 3, h, w), 2.0)
    return depth, centres, angles, k


def test_reprojection_exact_plane_is_consistent() -> None:
    depth, centres, angles, k = _plane_scene()
    err = reprojection_errors(depth, centres, angles, k)
    assert torch.allclose(err, torch.zeros(1, 3), atol=1e-5)
    assert reprojection_consistency(depth, centres, angles, k).item() == pytest.approx(1.0, abs=1e-5)


def test_reprojection_corrupted_frame_hand_worked() -> None:
    depth, centres, angles, k = _plane_scene()
    depth[0, 0] += 0.5  # frame 0 now says 2.5 everywhere
    err = reprojection_errors(depth, centres, angles, k)[0].tolist()
    # View 0: frames 1, 2 render depth 2 into columns 2..7; predicted 2.5 -> 0.5 everywhere rendered.
    # View 1: frame 0's points (z = 2.5) shift by 4*1/2.5 = 1.6 px: columns c - 1.1 -> 0..5; frame 2's
    #   (z = 2) shift by exactly 2 -> columns 2..7. z-buffer min: columns 0, 1 hold 2.5 (error 0.5),
    #   columns 2..7 hold 2 (error 0): 2 of 8 columns -> 0.125.
    # View 2: frame 0's points shift 3.2 px -> columns 0..4 at 2.5, frame 1's 2 px -> columns 0..5 at 2;
    #   min is 2 on columns 0..5, columns 6, 7 receive nothing -> error 0.
    assert err == pytest.approx([0.5, 0.125, 0.0], abs=1e-5)
    r = reprojection_consistency(depth, centres, angles, k, worst_k=3).item()
    assert r == pytest.approx(1 / (1 + (0.5 + 0.125 + 0.0) / 3), abs=1e-5)
    r1 = reprojection_consistency(depth, centres, angles, k, worst_k=1).item()
    assert r1 == pytest.approx(1 / 1.5, abs=1e-5)
    rel = reprojection_errors(depth, centres, angles, k, relative=True)[0, 0].item()
    assert rel == pytest.approx(0.5 / 2.5, abs=1e-5)


def test_reprojection_ignores_dynamic_pixels() -> None:
    depth, centres, angles, k = _plane_scene()
    dynamic = torch.zeros_like(depth)
    dynamic[0, 0, 1:3, 2:6] = 0.9
    dynamic[0, 2, :, :3] = 0.7
    corrupted = depth.clone()
    corrupted[dynamic > 0.5] += 0.8  # only the moving pixels disagree with the static plane
    assert reprojection_consistency(corrupted, centres, angles, k, dynamic).item() == pytest.approx(
        1.0, abs=1e-5
    )
    # the mask is what saves it: without it (or with a threshold above the values) the error shows
    assert reprojection_consistency(corrupted, centres, angles, k).item() < 0.99
    assert (
        reprojection_consistency(corrupted, centres, angles, k, dynamic, static_threshold=0.95).item() < 0.99
    )


def _ref_view_errors(depth, centres, angles, k, static) -> list[float]:
    """Plain nested loops: unproject every static pixel, project into every other view, dict z-buffer."""
    f, h, w = depth.shape
    rots = [rotation_from_angles(angles[i].double()).tolist() for i in range(f)]
    fx, fy, cx, cy = (float(k[0, 0]), float(k[1, 1]), float(k[0, 2]), float(k[1, 2]))
    cs = centres.double().tolist()
    pts = []  # (source frame, world point)
    for i in range(f):
        for r in range(h):
            for c in range(w):
                if not static[i][r][c]:
                    continue
                z = float(depth[i, r, c])
                cam = [(c + 0.5 - cx) / fx * z, (r + 0.5 - cy) / fy * z, z]
                world = [sum(rots[i][a][b] * cam[b] for b in range(3)) + cs[i][a] for a in range(3)]
                pts.append((i, world))
    out = []
    for j in range(f):
        zbuf: dict[tuple[int, int], float] = {}
        for i, p in pts:
            if i == j:
                continue
            d = [p[a] - cs[j][a] for a in range(3)]
            cam = [sum(rots[j][b][a] * d[b] for b in range(3)) for a in range(3)]  # R^T (X - c)
            if cam[2] <= 1e-4:
                continue
            u, v = fx * cam[0] / cam[2] + cx, fy * cam[1] / cam[2] + cy
            assert min(abs(u - round(u)), abs(v - round(v))) > 1e-4, "ambiguous pixel; change the seed"
            col, row = math.floor(u), math.floor(v)
            if 0 <= col < w and 0 <= row < h:
                zbuf[(row, col)] = min(zbuf.get((row, col), math.inf), cam[2])
        errs = [abs(z - float(depth[j, r, c])) for (r, c), z in zbuf.items() if static[j][r][c]]
        out.append(sum(errs) / len(errs) if errs else math.nan)
    return out


def test_reprojection_matches_nested_loop_zbuffer() -> None:
    g = torch.Generator().manual_seed(3)
    b, f, h, w = 2, 3, 6, 6
    depth = 2.0 + torch.rand(b, f, h, w, generator=g)
    centres = 0.3 * torch.randn(b, f, 3, generator=g)
    angles = 0.15 * torch.randn(b, f, 3, generator=g)
    dynamic = torch.rand(b, f, h, w, generator=g) * 0.7  # ~30 % of the pixels above 0.5
    k = intrinsics(math.radians(70), h, w)
    err = reprojection_errors(depth, centres, angles, k, dynamic)
    for s in range(b):
        static = (dynamic[s] < 0.5).tolist()
        ref = _ref_view_errors(depth[s], centres[s], angles[s], k, static)
        assert not any(math.isnan(x) for x in ref)
        assert err[s].tolist() == pytest.approx(ref, abs=1e-4)
    everything = [[[True] * w] * h] * f
    err_all = reprojection_errors(depth, centres, angles, k)
    for s in range(b):
        ref = _ref_view_errors(depth[s], centres[s], angles[s], k, everything)
        assert err_all[s].tolist() == pytest.approx(ref, abs=1e-4)
    r = reprojection_consistency(depth, centres, angles, k, dynamic, worst_k=2)
    for s in range(b):
        worst = sorted(err[s].tolist(), reverse=True)[:2]
        assert r[s].item() == pytest.approx(1 / (1 + sum(worst) / 2), abs=1e-6)


def test_reprojection_no_other_view_is_nan_and_differentiable() -> None:
    depth, centres, angles, k = _plane_scene()
    assert math.isnan(reprojection_consistency(depth[:, :1], centres[:, :1], angles[:, :1], k).item())
    d = depth.clone()
    d[0, 0] += 0.5
    d.requires_grad_(True)
    reprojection_consistency(d, centres, angles, k).sum().backward()
    assert d.grad is not None and torch.isfinite(d.grad).all() and d.grad.abs().sum() > 0


# =========================================================================== motion
def test_motion_degree_and_guard() -> None:
    still = torch.zeros(2, 5, 3)
    assert torch.equal(motion_degree(still, still), torch.zeros(2))
    depth = torch.full((1, 4, 3, 3), 2.0)
    centres = torch.tensor([[[0.2 * t, 0.0, 0.0] for t in range(4)]])
    angles = torch.tensor([[[0.1 * t, 0.0, 0.0] for t in range(4)]])  # yaw 0.1 rad per frame
    deg = motion_degree(centres, angles, depth).item()
    assert deg == pytest.approx(0.2 / 2.0 + 0.1, abs=1e-5)
    dyn = torch.zeros(1, 4, 3, 3)
    dyn[..., 0, :] = 1.0  # a third of the pixels move
    assert motion_degree(centres, angles, depth, dyn).item() == pytest.approx(deg + 1 / 3, abs=1e-5)
    assert motion_degree(centres, angles).item() == pytest.approx(0.2 + 0.1, abs=1e-5)
    g = motion_guard(torch.tensor([0.0, 0.025, 0.05, 3.0]), 0.05)
    assert g.tolist() == pytest.approx([0.0, 0.5, 1.0, 1.0])
    with pytest.raises(ValueError, match="min_degree"):
        motion_guard(torch.zeros(1), 0.0)


# =========================================================================== the tiny model and the loader
def _tiny(channels: int = 4) -> TinyLatentGeometry:
    torch.manual_seed(0)
    return TinyLatentGeometry(latent_channels=channels, hidden=8, fov_x=math.radians(60)).eval()


def test_tiny_geometry_shapes_and_round_trip(tmp_path: Path) -> None:
    model = _tiny()
    x = torch.randn(2, 4, 5, 6, 7)
    out = model(x)
    assert out.depth.shape == (2, 5, 6, 7) and out.dynamic is not None and out.dynamic.shape == (2, 5, 6, 7)
    assert out.centres.shape == (2, 5, 3) and out.angles.shape == (2, 5, 3)
    assert out.rotations.shape == (2, 5, 3, 3)
    assert (out.depth > 0).all() and (out.dynamic >= 0).all() and (out.dynamic <= 1).all()
    assert torch.equal(out.centres[:, 0], torch.zeros(2, 3)) and torch.equal(
        out.angles[:, 0], torch.zeros(2, 3)
    )
    assert torch.allclose(out.rotations[:, 0], torch.eye(3).expand(2, 3, 3))
    assert torch.allclose(out.intrinsics, intrinsics(math.radians(60), 6, 7))
    assert out.centres[:, 1:].abs().sum() > 0  # the other frames are not all identity
    model.save_pretrained(tmp_path / "geo")
    for loaded in (
        TinyLatentGeometry.from_pretrained(tmp_path / "geo"),
        load_geometry_model(tmp_path / "geo"),
    ):
        again = loaded(x)
        assert isinstance(loaded, TinyLatentGeometry) and not loaded.training
        for name in ("depth", "centres", "angles", "dynamic", "intrinsics"):
            assert torch.equal(getattr(again, name), getattr(out, name)), name


def test_tiny_geometry_bad_folders(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        TinyLatentGeometry.from_pretrained(missing)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_geometry_model(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        load_geometry_model(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"class": "Nope"}')
    with pytest.raises(ValueError, match="bad.*Nope"):
        load_geometry_model(tmp_path / "bad")


_PLUGIN = '''
from pathlib import Path

import torch
from rewards.geometry_model import GeometryOutput, LatentGeometryModel
from rewards.camera import intrinsics


class ConstantGeometry(LatentGeometryModel):
    """A plane at depth `depth` seen by a camera sliding along x by `step` per latent frame."""

    def __init__(self, depth=2.0, step=0.5):
        super().__init__()
        self.d, self.step = float(depth), float(step)

    @classmethod
    def from_pretrained(cls, path):
        path = Path(path)
        return cls(depth=float((path / "depth.txt" if path.is_dir() else path).read_text()))

    def forward(self, latents):
        b, _, f, h, w = latents.shape
        t = torch.arange(f, dtype=torch.float32)
        centres = torch.stack([self.step * t, 0 * t, 0 * t], -1).expand(b, f, 3)
        return GeometryOutput(
            depth=torch.full((b, f, h, w), self.d),
            centres=centres,
            angles=torch.zeros(b, f, 3),
            intrinsics=intrinsics(1.2, h, w),
        )


class NotAModel:
    def __init__(self, **kw):
        pass
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"geo_plugin_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(_PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_load_geometry_model_from_module_spec(plugin: str, tmp_path: Path) -> None:
    model = load_geometry_model(f"{plugin}:ConstantGeometry", depth=3.0)
    assert isinstance(model, LatentGeometryModel) and model.d == 3.0
    (tmp_path / "depth.txt").write_text("4.5")
    assert load_geometry_model(f"{plugin}:ConstantGeometry", path=tmp_path / "depth.txt").d == 4.5
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text(f'{{"class": "{plugin}:ConstantGeometry"}}')
    (tmp_path / "folder" / "depth.txt").write_text("1.5")
    assert load_geometry_model(tmp_path / "folder").d == 1.5  # config.json names the plugin class
    with pytest.raises(ImportError, match="no_such_geo_module:X"):
        load_geometry_model("no_such_geo_module:X")
    with pytest.raises(AttributeError, match=f"{plugin}:Missing"):
        load_geometry_model(f"{plugin}:Missing")
    with pytest.raises(TypeError, match=f"{plugin}:NotAModel"):
        load_geometry_model(f"{plugin}:NotAModel")
    with pytest.raises(TypeError, match=f"{plugin}:ConstantGeometry"):
        load_geometry_model(f"{plugin}:ConstantGeometry", colour="red")


# =========================================================================== the registered rewards
NAMES = ("camera_smoothness", "reprojection_consistency", "motion_guard")


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    rg.clear_geometry_cache()
    _tiny().save_pretrained(tmp_path / "tiny-geo")
    return tmp_path / "tiny-geo"


def _batch(b: int = 3, f: int = 4) -> RewardBatch:
    torch.manual_seed(5)
    return RewardBatch(prompts=["a"] * b, outputs={"latents": torch.randn(b, 4, f, 6, 6)})


def test_registered_rewards_on_latents(tiny_dir: Path) -> None:
    batch = _batch()
    model = TinyLatentGeometry.from_pretrained(tiny_dir)
    geo = model(batch.outputs["latents"])
    expected = {
        "camera_smoothness": camera_smoothness(geo.centres, geo.angles),
        "reprojection_consistency": reprojection_consistency(
            geo.depth, geo.centres, geo.angles, geo.intrinsics, geo.dynamic, 0.5, 3
        ),
        "motion_guard": motion_guard(motion_degree(geo.centres, geo.angles, geo.depth, geo.dynamic), 0.05),
    }
    for name in NAMES:
        reward = load_reward(name, geometry_model=str(tiny_dir))
        assert reward.needs == {"latents"}
        out = reward(batch)
        assert out.shape == (3,) and torch.isfinite(out).all()
        assert torch.allclose(out, expected[name].detach(), atol=1e-5), name
        assert "motion_degree" in reward.last_metrics and "static_frac" in reward.last_metrics
    rs = RewardSet([{"name": n, "kwargs": {"geometry_model": str(tiny_dir)}} for n in NAMES])
    assert rs.needs == {"latents"}
    cols = rs(batch)
    assert cols.shape == (3, 3) and torch.isfinite(cols).all()
    assert "reward/reprojection_consistency/worst_view_error" in rs.last_metrics
    assert len(rg._MODELS) == 1  # one shared model for the three rewards


def test_registered_rewards_options_and_errors(tiny_dir: Path, plugin: str) -> None:
    for name in NAMES:
        with pytest.raises(ValueError, match="geometry_model"):
            load_reward(name)
        with pytest.raises(ValueError, match="geometry_model.*nowhere"):
            load_reward(name, geometry_model=str(tiny_dir.parent / "nowhere"))
    with pytest.raises(ValueError, match="worst_k"):
        load_reward("reprojection_consistency", geometry_model=str(tiny_dir), worst_k=0)
    with pytest.raises(ValueError, match="min_degree"):
        load_reward("motion_guard", geometry_model=str(tiny_dir), min_degree=-1)
    reward = load_reward("camera_smoothness", geometry_model=str(tiny_dir))
    with pytest.raises(KeyError, match="latents"):
        reward(RewardBatch(prompts=["a"], outputs={"videos": torch.zeros(1, 2, 3, 4, 4)}))
    # a plugin model: a camera sliding at constant speed over a plane is smooth, consistent and moving
    spec = f"{plugin}:ConstantGeometry"
    batch = _batch(b=2, f=5)
    opts = {"geometry_model": spec, "geometry_kwargs": {"depth": 2.0, "step": 0.05}}
    assert load_reward("camera_smoothness", **opts)(batch).tolist() == pytest.approx([1.0, 1.0])
    assert load_reward("reprojection_consistency", **opts)(batch).tolist() == pytest.approx(
        [1.0, 1.0], abs=1e-5
    )
    slow = {"geometry_model": spec, "geometry_kwargs": {"depth": 2.0, "step": 0.05}, "min_degree": 0.05}
    assert load_reward("motion_guard", **slow)(batch).tolist() == pytest.approx([0.5, 0.5], abs=1e-5)
    still = {"geometry_model": spec, "geometry_kwargs": {"depth": 2.0, "step": 0.0}}
    assert load_reward("motion_guard", **still)(batch).tolist() == [0.0, 0.0]


def test_geometry_of_memo_and_placement(tiny_dir: Path) -> None:
    model = TinyLatentGeometry.from_pretrained(tiny_dir).double()
    latents = torch.randn(1, 4, 3, 5, 5)
    out = rg.geometry_of(latents, model)
    assert isinstance(out, GeometryOutput) and out.depth.dtype == torch.float32
    reward = load_reward("camera_smoothness", geometry_model=str(tiny_dir))
    batch = RewardBatch(prompts=["a"], outputs={"latents": latents})
    first = reward(batch)
    assert reward(batch).tolist() == first.tolist()
    latents.mul_(3.0)  # in-place change: the memo must not serve the stale geometry
    again = reward(batch)
    geo = TinyLatentGeometry.from_pretrained(tiny_dir)(latents)
    assert torch.allclose(again, camera_smoothness(geo.centres, geo.angles).detach(), atol=1e-6)
    assert not torch.allclose(again, first)
