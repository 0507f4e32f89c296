"""Latent geometry rewards (VGGRPO, world-consistent video generation): `camera_smoothness`,
`reprojection_consistency`, `motion_guard`.

Each reads ``outputs["latents"]`` (Float[B,C,F,h,w], ``needs = {"latents"}``: nothing is decoded), runs the
latent geometry model named by ``geometry_model`` / ``geometry_kwargs`` (`rewards.geometry_model`; loaded
once per process and run once per step for all three rewards) and scores camera smoothness, reprojection
consistency of static points, or enough motion (``motion_guard``, which keeps the policy from collapsing
onto near-static clips). Formulas, options, caching and metrics: docs/video.md, "The rewards
(`rewards/geometry.py`)"; conventions: `rewards.geometry_model`, `rewards.camera`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rewards.geometry_model import (
    GeometryOutput,
    LatentGeometryModel,
    consistency_from_errors,
    load_geometry_model,
    motion_degree,
    motion_guard,
    reprojection_errors,
    smoothness_errors,
)

from .base import Reward, RewardBatch, register_reward

__all__ = [
    "CameraSmoothness",
    "MotionGuard",
    "ReprojectionConsistency",
    "clear_geometry_cache",
    "geometry_of",
]

_MODELS: dict[tuple[Any, ...], LatentGeometryModel] = {}
_LAST: dict[int, tuple[Tensor, int, GeometryOutput]] = {}  # id(model) -> (latents, version, output)


def clear_geometry_cache() -> None:
    """Forget the cached geometry models and memoised outputs of this process."""
    _MODELS.clear()
    _LAST.clear()


def _model_key(spec: str, kwargs: dict[str, Any], device: str) -> tuple[Any, ...]:
    path = Path(spec).expanduser()
    if path.exists():
        stamps = tuple(
            (p.name, p.stat().st_mtime_ns) for p in sorted(path.iterdir()) if p.is_file()
        )  # a re-saved folder is reloaded
        resolved: Any = (str(path.resolve()), stamps)
    else:
        resolved = spec
    return resolved, repr(sorted(kwargs.items())), device


def _load_shared(spec: str, kwargs: dict[str, Any], device: str) -> LatentGeometryModel:
    key = _model_key(spec, kwargs, device)
    if key not in _MODELS:
        model = load_geometry_model(spec, **kwargs)
        _MODELS[key] = model.eval().requires_grad_(False).to(device)
    return _MODELS[key]


def _placement(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    for p in model.parameters():
        return p.device, p.dtype
    return torch.device("cpu"), torch.float32


def geometry_of(latents: Tensor, model: LatentGeometryModel) -> GeometryOutput:
    """The geometry of `latents` Float[B,C,F,h,w]: `model` in eval mode under ``torch.no_grad()``, the
    latents moved to the device and dtype of its first parameter (float32 on the CPU without any).

    The outputs' float tensors are returned in float32 (depth, poses, intrinsics, dynamic) on the
    model's device. A `GeometryOutput` of the wrong shape is a ValueError naming the model class.
    """
    if not isinstance(latents, Tensor) or latents.dim() != 5:
        shape = tuple(latents.shape) if isinstance(latents, Tensor) else type(latents).__name__
        raise ValueError(f"latents must be Float[B,C,F,h,w], got {shape}")
    device, dtype = _placement(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(latents.detach().to(device=device, dtype=dtype))
    finally:
        model.train(was_training)
    if not isinstance(out, GeometryOutput):
        raise ValueError(f"{type(model).__name__}.forward returned {type(out).__name__}, not GeometryOutput")
    b, f = latents.shape[0], latents.shape[2]
    if out.depth.dim() != 4 or tuple(out.depth.shape[:2]) != (b, f):
        raise ValueError(
            f"{type(model).__name__}: depth must be Float[{b}, {f}, h, w] for latents of shape "
            f"{tuple(latents.shape)}, got {tuple(out.depth.shape)}"
        )
    for name in ("centres", "angles"):
        t = getattr(out, name)
        if tuple(t.shape) != (b, f, 3):
            raise ValueError(
                f"{type(model).__name__}: {name} must be Float[{b}, {f}, 3], got {tuple(t.shape)}"
            )
    if out.dynamic is not None and out.dynamic.shape != out.depth.shape:
        raise ValueError(
            f"{type(model).__name__}: dynamic must have depth's shape {tuple(out.depth.shape)}, "
            f"got {tuple(out.dynamic.shape)}"
        )
    return GeometryOutput(
        depth=out.depth.float(),
        centres=out.centres.float(),
        angles=out.angles.float(),
        intrinsics=out.intrinsics.float(),
        dynamic=None if out.dynamic is None else out.dynamic.float(),
    )


class _GeometryReward(Reward):
    """Shared options and plumbing: the model, the latents, the memoised geometry, common metrics."""

    needs = {"latents"}

    def _init_geometry(
        self, geometry_model: str | Path | None, geometry_kwargs: dict[str, Any] | None, device: str | None
    ) -> None:
        if geometry_model is None or str(geometry_model) == "":
            raise ValueError(
                f"reward {self.name!r} needs the option geometry_model: a folder saved by "
                f"TinyLatentGeometry.save_pretrained, or a 'package.module:Class' LatentGeometryModel"
            )
        if geometry_kwargs is not None and not isinstance(geometry_kwargs, dict):
            raise ValueError(
                f"reward {self.name!r}: geometry_kwargs must be a mapping of options, got {geometry_kwargs!r}"
            )
        self.geometry_spec = str(geometry_model)
        self.device = device or "cpu"
        try:
            self.model = _load_shared(self.geometry_spec, dict(geometry_kwargs or {}), self.device)
        except (FileNotFoundError, ImportError, AttributeError) as e:
            raise ValueError(f"reward {self.name!r}: option geometry_model: {e}") from e
        self.last_metrics: dict[str, float] = {}

    def _geometry(self, batch: RewardBatch) -> GeometryOutput:
        if "latents" not in batch.outputs:
            raise KeyError(
                f"reward {self.name!r} needs outputs['latents'] (Float[B,C,F,h,w]); "
                f"outputs: {sorted(batch.outputs) or 'none'}"
            )
        latents = batch.outputs["latents"]
        if not isinstance(latents, Tensor) or latents.dim() != 5:
            shape = tuple(latents.shape) if isinstance(latents, Tensor) else type(latents).__name__
            raise ValueError(
                f"reward {self.name!r}: outputs['latents'] must be Float[B,C,F,h,w], got {shape}"
            )
        if latents.shape[0] != len(batch):
            raise ValueError(
                f"reward {self.name!r}: outputs['latents'] holds {latents.shape[0]} videos for "
                f"{len(batch)} prompts"
            )
        memo = _LAST.get(id(self.model))
        if memo is not None and memo[0] is latents and memo[1] == latents._version:
            geo = memo[2]
        else:
            geo = geometry_of(latents, self.model)
            _LAST[id(self.model)] = (latents, latents._version, geo)
        static = 1.0 if geo.dynamic is None else float((geo.dynamic < 0.5).float().mean())
        self.last_metrics = {"static_frac": static}
        if geo.depth.shape[1] >= 2:
            degree = motion_degree(geo.centres, geo.angles, geo.depth, geo.dynamic)
            self.last_metrics["motion_degree"] = float(degree.mean())
        return geo


@register_reward("camera_smoothness")
class CameraSmoothness(_GeometryReward):
    """Smoothness of the predicted camera path: ``1/2 [1/(1 + e_trans) + 1/(1 + e_rot)]``, in [1/2, 1].

    ``e = mean_t ||a_t|| / (||v_t|| + ||v_{t-1}|| + eps)`` over the second differences a_t of the latent
    frames' camera centres (e_trans) and wrapped angles (e_rot); see `rewards.geometry_model.camera_smoothness`.
    A constant-velocity camera scores 1, and so does a static one (pair with ``motion_guard``). Clips with
    fewer than 3 latent frames score NaN (not applicable). Metrics: ``trans_error``, ``rot_error`` (means
    of e_trans, e_rot).
    """

    def __init__(
        self,
        *,
        geometry_model: str | Path | None = None,
        geometry_kwargs: dict[str, Any] | None = None,
        eps: float = 1e-6,
        device: str | None = None,
    ) -> None:
        if not float(eps) > 0:
            raise ValueError(f"reward {self.name!r}: eps must be > 0, got {eps!r}")
        self.eps = float(eps)
        self._init_geometry(geometry_model, geometry_kwargs, device)

    def __call__(self, batch: RewardBatch) -> Tensor:
        geo = self._geometry(batch)
        if geo.centres.shape[1] < 3:
            return torch.full((len(batch),), math.nan)
        e_trans, e_rot = smoothness_errors(geo.centres, geo.angles, self.eps)
        self.last_metrics["trans_error"] = float(e_trans.mean())
        self.last_metrics["rot_error"] = float(e_rot.mean())
        return (0.5 * (1.0 / (1.0 + e_trans) + 1.0 / (1.0 + e_rot))).cpu()


@register_reward("reprojection_consistency")
class ReprojectionConsistency(_GeometryReward):
    """Multi-view depth consistency: ``1 / (1 + mean of the worst_k per-view errors)``, in (0, 1].

    Every latent frame's static pixels (dynamic < ``static_threshold``) are unprojected with its depth and
    pose and z-buffered into every OTHER view; a view's error is the mean ``|D_render - D_pred|`` over
    its static pixels that received a point (``relative=True`` divides by D_pred). See
    `rewards.geometry_model.reprojection_errors`. A clip with no view that received a point (one latent
    frame, or no overlap) scores NaN. Options: ``static_threshold`` (0.5), ``worst_k`` (3), ``relative``
    (False). Metrics: ``worst_view_error`` (mean over the batch of each clip's largest view error),
    ``mean_view_error``.
    """

    def __init__(
        self,
        *,
        geometry_model: str | Path | None = None,
        geometry_kwargs: dict[str, Any] | None = None,
        static_threshold: float = 0.5,
        worst_k: int = 3,
        relative: bool = False,
        device: str | None = None,
    ) -> None:
        if isinstance(worst_k, bool) or not isinstance(worst_k, int) or worst_k < 1:
            raise ValueError(f"reward {self.name!r}: worst_k must be an int >= 1, got {worst_k!r}")
        if not 0.0 < float(static_threshold) <= 1.0:
            raise ValueError(
                f"reward {self.name!r}: static_threshold must be in (0, 1], got {static_threshold!r}"
            )
        self.static_threshold = float(static_threshold)
        self.worst_k = worst_k
        self.relative = bool(relative)
        self._init_geometry(geometry_model, geometry_kwargs, device)

    def __call__(self, batch: RewardBatch) -> Tensor:
        geo = self._geometry(batch)
        k = geo.batched_intrinsics
        err = reprojection_errors(
            geo.depth, geo.centres, geo.angles, k, geo.dynamic, self.static_threshold, relative=self.relative
        )
        rows = (~torch.isnan(err)).any(dim=1)
        if rows.any():
            worst = err.nan_to_num(nan=-math.inf).amax(dim=1)[rows]
            self.last_metrics["worst_view_error"] = float(worst.mean())
            self.last_metrics["mean_view_error"] = float(torch.nanmean(err))
        return consistency_from_errors(err, self.worst_k).cpu()


@register_reward("motion_guard")
class MotionGuard(_GeometryReward):
    """Anti-collapse term: ``min(1, motion_degree / min_degree)``, in [0, 1].

    `rewards.geometry_model.motion_degree`: the camera translation per latent frame in scene depths (divided by
    the median predicted depth) + the rotation per latent frame in radians + the share of moving pixels.
    The default ``min_degree = 0.05`` (e.g. 5 % of the scene depth, or about 2.9 degrees of rotation, per
    latent frame; with Wan's 4x temporal compression that is ~1.25 % of the depth per video frame) is
    reached by any clearly moving clip, so the term only punishes near-static ones, which the
    consistency rewards would otherwise favour. One latent frame scores 0 (no motion measurable).
    Metrics: ``guard_active`` (share of the batch below ``min_degree``).
    """

    def __init__(
        self,
        *,
        geometry_model: str | Path | None = None,
        geometry_kwargs: dict[str, Any] | None = None,
        min_degree: float = 0.05,
        device: str | None = None,
    ) -> None:
        if not math.isfinite(float(min_degree)) or float(min_degree) <= 0:
            raise ValueError(
                f"reward {self.name!r}: min_degree must be a positive number, got {min_degree!r}"
            )
        self.min_degree = float(min_degree)
        self._init_geometry(geometry_model, geometry_kwargs, device)

    def __call__(self, batch: RewardBatch) -> Tensor:
        geo = self._geometry(batch)
        if geo.centres.shape[1] < 2:
            return torch.zeros(len(batch))
        degree = motion_degree(geo.centres, geo.angles, geo.depth, geo.dynamic)
        self.last_metrics["guard_active"] = float((degree < self.min_degree).float().mean())
        return motion_guard(degree, self.min_degree).cpu()
