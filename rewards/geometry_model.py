"""Latent geometry models and the geometry reward math of VGGRPO (world-consistent video generation).

A latent geometry model (`LatentGeometryModel`; `TinyLatentGeometry` is the small default, `load_geometry_model`
loads either) maps a video policy's latents Float[B, C, F, h, w] to a `GeometryOutput`: per latent frame depth,
camera centre and angles, intrinsics and optionally a dynamic map; nothing is decoded to pixels. The reward math
(`camera_smoothness`, `reprojection_consistency`, `motion_degree`, `motion_guard`) is pure tensor functions,
Float[B] each. Conventions are those of `rewards.camera`. Formulas, conventions and what is our design:
docs/video.md, "Latent geometry models" and "The rewards (`rewards/geometry.py`)".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mmalign.registry import import_path
from rewards.camera import intrinsics as camera_intrinsics
from rewards.camera import project, rotation_from_angles, unproject

__all__ = [
    "GeometryOutput",
    "LatentGeometryModel",
    "TinyLatentGeometry",
    "camera_smoothness",
    "consistency_from_errors",
    "load_geometry_model",
    "motion_degree",
    "motion_guard",
    "reprojection_consistency",
    "reprojection_errors",
    "smoothness_errors",
    "wrap_angle",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


# =========================================================================== the model interface
@dataclass
class GeometryOutput:
    """What a latent geometry model predicts for a batch of latent videos (F = latent frames).

    - ``depth``      Float[B, F, h, w]: camera z of every latent pixel, > 0.
    - ``centres``    Float[B, F, 3]: camera centres in world coordinates.
    - ``angles``     Float[B, F, 3]: (yaw, pitch, roll) of the camera-to-world rotation (`rewards.camera`).
    - ``intrinsics`` Float[B, 3, 3] or Float[3, 3]: K for the depth map's resolution h x w.
    - ``dynamic``    Float[B, F, h, w] or None: probability / magnitude that a pixel belongs to moving
      content (the scene-flow magnitude); None means everything is static.
    """

    depth: Tensor
    centres: Tensor
    angles: Tensor
    intrinsics: Tensor
    dynamic: Tensor | None = None

    @property
    def rotations(self) -> Tensor:
        """Camera-to-world rotations Float[B, F, 3, 3] (`rewards.camera.rotation_from_angles`)."""
        return rotation_from_angles(self.angles)

    @property
    def batched_intrinsics(self) -> Tensor:
        """``intrinsics`` as Float[B, 3, 3] (a shared Float[3, 3] K expanded over the batch)."""
        k = self.intrinsics
        return k.expand(self.depth.shape[0], 3, 3) if k.dim() == 2 else k


class LatentGeometryModel(nn.Module):
    """Base class of latent geometry models: ``forward(latents) -> GeometryOutput``.

    Contract for subclasses (e.g. a wrapper around a pixel-space geometry network stitched onto a video
    VAE's latent features, as VGGRPO does):

    - ``latents`` is Float[B, C, F, h, w], exactly what the video diffusion policy stores as
      ``rollout.outputs["latents"]`` (its normalised latent space: undo the policy's latent
      normalisation inside the wrapper if the stitched network expects raw VAE latents). F counts
      LATENT frames; the output has one pose / depth map per latent frame.
    - Return a `GeometryOutput` whose tensors are on the latents' device: depth > 0 (camera z) at any
      resolution h' x w' with ``intrinsics`` for THAT resolution, poses in any world frame (the rewards
      are invariant to a rigid change of world frame; `TinyLatentGeometry` anchors frame 0 at the
      origin), and ``dynamic`` in [0, 1] or None.
    - The rewards call the model in eval mode under ``torch.no_grad()``, with the latents moved to the
      device and dtype of the model's first parameter (float32 on the CPU for a parameterless model).
    - To be loadable by `load_geometry_model`, give the class a ``from_pretrained(path)`` classmethod
      (used for a folder whose ``config.json`` has ``"class": "package.module:Class"``, or for a
      ``"package.module:Class"`` spec with ``path=...``) or a constructor taking keyword options.
    """

    def forward(self, latents: Tensor) -> GeometryOutput:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement forward(latents) -> GeometryOutput")


class TinyLatentGeometry(LatentGeometryModel):
    """The small default latent geometry model: a 3-D conv trunk and depth / pose / dynamic heads.

    Trunk: ``layers`` ``Conv3d(k=3, padding=1)`` + SiLU layers (``hidden`` channels) over [B, C, F, h, w].
    Heads (our design):

    - depth: ``Conv3d(hidden, 1, 1)``, ``min(min_depth + softplus(x), max_depth)`` per latent pixel;
    - pose: per-frame global average pool -> MLP -> 6 numbers per frame t >= 1, the change of (centre xyz,
      yaw, pitch, roll) from frame t - 1 to t (each frame's features see its neighbours through the 3-D
      convolutions, so a frame-to-frame change is local in time); the poses are their cumulative sums, so
      frame 0 is EXACTLY the identity pose at the origin and the other poses are relative to it (a
      parametrisation, not a rigid composition of the angles);
    - dynamic: ``Conv3d(hidden, 1, 1)`` + sigmoid.

    Intrinsics are fixed: ``rewards.camera.intrinsics(fov_x, h, w)`` at the latent resolution.
    `save_pretrained` writes ``config.json`` (with ``"class": "TinyLatentGeometry"``) and
    ``model.safetensors``; `from_pretrained` reads them back.
    """

    def __init__(
        self,
        *,
        latent_channels: int = 16,
        hidden: int = 32,
        layers: int = 2,
        fov_x: float = math.radians(60.0),
        min_depth: float = 0.1,
        max_depth: float = 100.0,
    ) -> None:
        super().__init__()
        if not 0 < fov_x < math.pi:
            raise ValueError(f"TinyLatentGeometry: fov_x must be in (0, pi) radians, got {fov_x}")
        if not 0 < min_depth < max_depth:
            raise ValueError(
                f"TinyLatentGeometry: need 0 < min_depth < max_depth, got min_depth={min_depth}, "
                f"max_depth={max_depth}"
            )
        self.config: dict[str, Any] = {
            "latent_channels": int(latent_channels),
            "hidden": int(hidden),
            "layers": int(layers),
            "fov_x": float(fov_x),
            "min_depth": float(min_depth),
            "max_depth": float(max_depth),
        }
        if layers < 1:
            raise ValueError(f"TinyLatentGeometry: layers must be >= 1, got {layers}")
        convs: list[nn.Module] = []
        for i in range(layers):
            convs += [nn.Conv3d(latent_channels if i == 0 else hidden, hidden, 3, padding=1), nn.SiLU()]
        self.trunk = nn.Sequential(*convs)
        self.depth_head = nn.Conv3d(hidden, 1, 1)
        self.dynamic_head = nn.Conv3d(hidden, 1, 1)
        self.pose_head = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 6))

    def forward(self, latents: Tensor) -> GeometryOutput:
        if latents.dim() != 5 or latents.shape[1] != self.config["latent_channels"]:
            raise ValueError(
                f"TinyLatentGeometry expects latents Float[B, {self.config['latent_channels']}, F, h, w], "
                f"got shape {tuple(latents.shape)}"
            )
        h, w = latents.shape[-2:]
        feats = self.trunk(latents)  # [B, hidden, F, h, w]
        depth = nn.functional.softplus(self.depth_head(feats)[:, 0]) + self.config["min_depth"]
        depth = depth.clamp(max=self.config["max_depth"])
        dynamic = torch.sigmoid(self.dynamic_head(feats)[:, 0])
        change = self.pose_head(feats.mean(dim=(-2, -1)).transpose(1, 2))  # [B, F, 6]: frame t-1 -> t
        pose = torch.cat([torch.zeros_like(change[:, :1]), change[:, 1:].cumsum(1)], 1)
        k = camera_intrinsics(self.config["fov_x"], h, w).to(device=latents.device, dtype=depth.dtype)
        return GeometryOutput(
            depth=depth, centres=pose[..., :3], angles=pose[..., 3:], intrinsics=k, dynamic=dynamic
        )

    def save_pretrained(self, path: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` into the folder `path` (created if needed)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_NAME).write_text(json.dumps({"class": type(self).__name__, **self.config}, indent=2))
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS_NAME))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> TinyLatentGeometry:
        """The model saved by `save_pretrained` in the folder `path`, in eval mode on the CPU."""
        from safetensors.torch import load_file

        path = Path(path)
        config = _read_config(path)
        if config.get("class") != cls.__name__:
            raise ValueError(f"{path / CONFIG_NAME}: class is {config.get('class')!r}, not {cls.__name__!r}")
        if not (path / WEIGHTS_NAME).is_file():
            raise FileNotFoundError(f"{path}: no {WEIGHTS_NAME} (write it with save_pretrained)")
        kwargs = {k: v for k, v in config.items() if k != "class"}
        try:
            model = cls(**kwargs)
            model.load_state_dict(load_file(str(path / WEIGHTS_NAME)))
        except (TypeError, RuntimeError, ValueError) as e:
            raise ValueError(f"{path}: cannot load {cls.__name__}: {type(e).__name__}: {e}") from e
        return model.eval()


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise FileNotFoundError(f"geometry model folder {str(path)!r} does not exist")
    cfg = path / CONFIG_NAME
    if not cfg.is_file():
        raise FileNotFoundError(f"geometry model folder {str(path)!r} has no {CONFIG_NAME}")
    try:
        config = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg}: invalid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{cfg}: expected a JSON object, got {type(config).__name__}")
    return config


def _import_spec(spec: str) -> Any:
    """The class an import spec names (`mmalign.registry.import_path`): ValueError, ImportError or
    AttributeError naming the spec."""
    return import_path(spec, "geometry model", "package.module:ClassName")


def load_geometry_model(spec: str | Path, **kwargs: Any) -> LatentGeometryModel:
    """A latent geometry model from `spec`, in eval mode (nothing is cached).

    A `spec` that exists on disk, or has no ``":"``, is a folder; anything else an import spec.

    - a folder with ``config.json``: its ``"class"`` is ``"TinyLatentGeometry"`` (loaded with
      `TinyLatentGeometry.from_pretrained`) or ``"package.module:Class"`` (our design: that class's
      ``from_pretrained(folder)``); `kwargs` are not allowed;
    - ``"package.module:Class"``: the class is imported; with ``path=...`` its ``from_pretrained(path)``
      is called, else ``Class(**kwargs)``.

    The result must be a `LatentGeometryModel` (a TypeError otherwise). Errors name the spec.
    """
    text = str(spec)
    path = Path(text).expanduser()
    if path.exists() or ":" not in text:
        config = _read_config(path)
        if kwargs:
            raise TypeError(
                f"geometry model {text!r}: a saved folder takes no options, got {', '.join(sorted(kwargs))}"
            )
        cls_name = config.get("class")
        if cls_name == TinyLatentGeometry.__name__:
            model: Any = TinyLatentGeometry.from_pretrained(path)
        elif isinstance(cls_name, str) and ":" in cls_name:
            cls = _import_spec(cls_name)
            if not hasattr(cls, "from_pretrained"):
                raise TypeError(f"geometry model {text!r}: {cls_name} has no from_pretrained(path)")
            model = cls.from_pretrained(path)
        else:
            raise ValueError(
                f"geometry model {text!r}: {CONFIG_NAME} has class {cls_name!r}; expected "
                f"'TinyLatentGeometry' or 'package.module:Class'"
            )
    else:
        obj = _import_spec(text)
        load_path = kwargs.pop("path", None)
        if load_path is not None:
            if not hasattr(obj, "from_pretrained"):
                raise TypeError(f"geometry model {text!r} has no from_pretrained(path) (path={load_path!r})")
            if kwargs:
                raise TypeError(
                    f"geometry model {text!r}: path= takes no other options, got {', '.join(sorted(kwargs))}"
                )
            model = obj.from_pretrained(load_path)
        else:
            try:
                model = obj(**kwargs)
            except TypeError as e:
                raise TypeError(f"geometry model {text!r}: {e}") from e
    if not isinstance(model, LatentGeometryModel):
        raise TypeError(
            f"geometry model {text!r} gave a {type(model).__name__}, not a rewards.geometry_model.LatentGeometryModel"
        )
    return model.eval()


# =========================================================================== reward math
def wrap_angle(x: Tensor) -> Tensor:
    """`x` (radians) wrapped to (-pi, pi]; the gradient is 1 (the wrap is a piecewise constant shift)."""
    return x - 2 * math.pi * torch.ceil((x - math.pi) / (2 * math.pi))


def _second_order_error(p: Tensor, eps: float, wrap: bool) -> Tensor:
    """``mean_t ||a_t|| / (||v_t|| + ||v_{t-1}|| + eps)`` of a trajectory `p` Float[B, F, 3] (differences
    wrapped to (-pi, pi] with `wrap`)."""
    v = p[:, 1:] - p[:, :-1]
    v = wrap_angle(v) if wrap else v
    a = v[:, 1:] - v[:, :-1]
    a = wrap_angle(a) if wrap else a
    speed = torch.linalg.vector_norm(v, dim=-1)
    return (torch.linalg.vector_norm(a, dim=-1) / (speed[:, 1:] + speed[:, :-1] + eps)).mean(dim=1)


def smoothness_errors(centres: Tensor, angles: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """(e_trans, e_rot) Float[B] each: the normalised second-difference errors of `camera_smoothness`.

    Angle differences (first and second) are wrapped to (-pi, pi]. Needs F >= 3 frames (a ValueError
    naming F otherwise).
    """
    if centres.dim() != 3 or centres.shape[-1] != 3 or angles.shape != centres.shape:
        raise ValueError(
            f"camera_smoothness: expected centres and angles Float[B, F, 3], got "
            f"{tuple(centres.shape)} and {tuple(angles.shape)}"
        )
    f = centres.shape[1]
    if f < 3:
        raise ValueError(f"camera_smoothness needs F >= 3 frames (second differences), got F = {f}")
    return _second_order_error(centres, eps, wrap=False), _second_order_error(angles, eps, wrap=True)


def camera_smoothness(centres: Tensor, angles: Tensor, eps: float = 1e-6) -> Tensor:
    """Float[B] in (0, 1]: ``1/2 [1 / (1 + e_trans) + 1 / (1 + e_rot)]`` (see `smoothness_errors`).

    ``e = mean_t ||a_t|| / (||v_t|| + ||v_{t-1}|| + eps)`` with ``v_t = p_t - p_{t-1}``,
    ``a_t = v_t - v_{t-1}``, over t = 2..F-1, for the centres (e_trans) and the wrapped angles (e_rot).
    A constant-velocity (or static) camera gives 1. Each error is scale-free and in [0, 1] (triangle
    inequality; wrapping only shrinks a_t), so r is in [1/2, 1]. Differentiable in the poses.
    """
    e_trans, e_rot = smoothness_errors(centres, angles, eps)
    return 0.5 * (1.0 / (1.0 + e_trans) + 1.0 / (1.0 + e_rot))


def reprojection_errors(
    depth: Tensor,
    centres: Tensor,
    angles: Tensor,
    k: Tensor,
    dynamic: Tensor | None = None,
    static_threshold: float = 0.5,
    *,
    relative: bool = False,
    min_z: float = 1e-4,
) -> Tensor:
    """Per-view reprojection errors Float[B, F] (NaN for a view that received no point).

    For every frame i, its static pixels (``dynamic < static_threshold``; all pixels if `dynamic` is
    None) are unprojected to world points with frame i's pose (`rewards.camera.unproject`). Each view j
    renders the points of the OTHER frames (our design: a view's own points would compare its depth with
    itself) with a z-buffer: `rewards.camera.project`, keep points with z > `min_z` that fall inside the
    image, take the pixel containing (u, v) (column floor(u), row floor(v), i.e. the nearest pixel
    centre), keep the minimum z per pixel (``scatter_reduce(amin)``, vectorised over batch, views and
    points). The view's error is the mean of ``|D_render - D_j|`` (divided by D_j with `relative`) over
    its STATIC pixels that received a point (our design: a dynamic target pixel legitimately disagrees
    with the static scene, so it is skipped too); pixels without a point are ignored.

    Computed in float32 (inputs are cast). The z-buffer's choice of the winning point is not
    differentiable, but the result is differentiable in the depth values and poses through the winners.
    `k` is Float[3, 3] or Float[B, 3, 3]; memory is O(B F^2 h w).
    """
    depth = depth.float()
    b, f, h, w = depth.shape
    centres, angles = centres.float(), angles.float()
    k = k.float()
    kb = (k.expand(b, 3, 3) if k.dim() == 2 else k)[:, None].expand(b, f, 3, 3)
    rot = rotation_from_angles(angles)  # [B, F, 3, 3]
    n = h * w
    if dynamic is None:
        static = torch.ones(b, f, n, dtype=torch.bool, device=depth.device)
    else:
        static = (dynamic.float() < static_threshold).reshape(b, f, n)
    points = unproject(depth, kb, rot, centres).reshape(b, 1, f * n, 3)  # every frame's points, flattened
    uv, z = project(points, kb, rot, centres)  # [B, F (target view), F*n (source points)]
    source = torch.arange(f, device=depth.device).repeat_interleave(n)  # source frame of each point
    target = torch.arange(f, device=depth.device)
    col, row = torch.floor(uv[..., 0]), torch.floor(uv[..., 1])
    valid = (
        (z > min_z)
        & (col >= 0)
        & (col < w)
        & (row >= 0)
        & (row < h)
        & (source[None, None, :] != target[None, :, None])
        & static.reshape(b, 1, f * n)
    )
    flat_view = torch.arange(b * f, device=depth.device).reshape(b, f, 1) * n
    index = flat_view + row.clamp(0, h - 1).long() * w + col.clamp(0, w - 1).long()
    index = torch.where(valid, index, torch.full_like(index, b * f * n))  # invalid points go to a dump slot
    zbuf = torch.full((b * f * n + 1,), math.inf, dtype=depth.dtype, device=depth.device)
    zbuf = zbuf.scatter_reduce(0, index.flatten(), z.flatten(), reduce="amin", include_self=True)
    rendered = zbuf[:-1].reshape(b, f, n)
    pred = depth.reshape(b, f, n)
    hit = torch.isfinite(rendered) & static
    diff = (torch.where(hit, rendered, pred) - pred).abs()
    if relative:
        diff = diff / pred
    count = hit.sum(dim=-1)
    err = (diff * hit).sum(dim=-1) / count.clamp(min=1)
    return torch.where(count > 0, err, torch.full_like(err, math.nan))


def reprojection_consistency(
    depth: Tensor,
    centres: Tensor,
    angles: Tensor,
    k: Tensor,
    dynamic: Tensor | None = None,
    static_threshold: float = 0.5,
    worst_k: int = 3,
    *,
    relative: bool = False,
) -> Tensor:
    """Float[B] in (0, 1]: ``1 / (1 + mean of the worst_k largest per-view errors)`` (`reprojection_errors`).

    Views without any rendered pixel are ignored; with fewer valid views than `worst_k`, all valid views
    count. A sample with no valid view at all (e.g. F = 1, or no overlap) is NaN (not applicable; our
    design). Depth units: the error is in the depth map's units (relative with ``relative=True``).
    """
    err = reprojection_errors(depth, centres, angles, k, dynamic, static_threshold, relative=relative)
    return consistency_from_errors(err, worst_k)


def consistency_from_errors(errors: Tensor, worst_k: int = 3) -> Tensor:
    """Float[B]: ``1 / (1 + mean of the worst_k largest non-NaN entries)`` of per-view `errors` Float[B, F]
    (all valid entries when fewer than `worst_k`; NaN for a row without any)."""
    if worst_k < 1:
        raise ValueError(f"reprojection_consistency: worst_k must be >= 1, got {worst_k}")
    valid = ~torch.isnan(errors)
    masked = torch.where(valid, errors, torch.full_like(errors, -math.inf))
    top = masked.topk(min(worst_k, errors.shape[1]), dim=1).values
    chosen = torch.isfinite(top)
    n = chosen.sum(dim=1)
    mean = torch.where(chosen, top, torch.zeros_like(top)).sum(dim=1) / n.clamp(min=1)
    return torch.where(n > 0, 1.0 / (1.0 + mean), torch.full_like(mean, math.nan))


def _rotation_angle(r1: Tensor, r2: Tensor) -> Tensor:
    """Geodesic angle (radians, [0, pi]) of ``r1^T r2`` via atan2(sin, cos) (stable near 0 and pi)."""
    rel = r1.transpose(-1, -2) @ r2
    cos = (rel.diagonal(dim1=-2, dim2=-1).sum(-1) - 1.0) / 2.0
    skew = torch.stack(
        [rel[..., 2, 1] - rel[..., 1, 2], rel[..., 0, 2] - rel[..., 2, 0], rel[..., 1, 0] - rel[..., 0, 1]],
        -1,
    )
    sin = torch.linalg.vector_norm(skew, dim=-1) / 2.0
    return torch.atan2(sin, cos)


def motion_degree(
    centres: Tensor, angles: Tensor, depth: Tensor | None = None, dynamic: Tensor | None = None
) -> Tensor:
    """How much a clip moves, Float[B] >= 0 (our design; per LATENT frame).

    ``mean_t ||c_t - c_{t-1}|| / median(depth)`` (translation in scene depths per latent frame; the
    median over all frames and pixels of the sample; world units per latent frame without `depth`)
    ``+ mean_t angle(R_{t-1}^T R_t)`` (geodesic rotation, radians per latent frame)
    ``+ mean(dynamic)`` (the share of moving pixels, in [0, 1], when `dynamic` is given).
    A static camera over a still scene gives 0. Needs F >= 2 (a ValueError naming F otherwise).
    """
    f = centres.shape[1]
    if f < 2:
        raise ValueError(f"motion_degree needs F >= 2 frames, got F = {f}")
    trans = torch.linalg.vector_norm(centres[:, 1:] - centres[:, :-1], dim=-1).mean(dim=1)
    if depth is not None:
        trans = trans / depth.flatten(1).median(dim=1).values.clamp_min(1e-8)
    rot = rotation_from_angles(angles)
    ang = _rotation_angle(rot[:, :-1], rot[:, 1:]).mean(dim=1)
    out = trans + ang
    if dynamic is not None:
        out = out + dynamic.flatten(1).mean(dim=1)
    return out


def motion_guard(degree: Tensor, min_degree: float) -> Tensor:
    """Float[B] in [0, 1]: ``min(1, degree / min_degree)``.

    The geometry rewards are maximised trivially by a static camera over a still scene (smoothness 1,
    no reprojection error); this term is 1 for clips that move at least `min_degree` (see
    `motion_degree`) and falls linearly to 0 for static ones, so adding it keeps the policy from
    collapsing onto near-static videos.
    """
    if not min_degree > 0:
        raise ValueError(f"motion_guard: min_degree must be > 0, got {min_degree}")
    return (degree / min_degree).clamp(max=1.0)
