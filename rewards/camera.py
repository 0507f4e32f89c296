"""Pinhole camera conventions shared by the synthetic scene renderer (`mmalign.tiny.geometry_scenes`), the latent
geometry models (`rewards.geometry_model`) and the VGGRPO rewards (`rewards.geometry`).

Details: docs/video.md, "rewards.camera".
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "angles_from_rotation",
    "intrinsics",
    "pixel_grid",
    "project",
    "rotation_from_angles",
    "scale_intrinsics",
    "unproject",
]


def rotation_from_angles(angles: Tensor) -> Tensor:
    """Float[..., 3] (yaw, pitch, roll) -> camera-to-world rotation Float[..., 3, 3] = R_y(yaw) R_x(pitch) R_z(roll)."""
    yaw, pitch, roll = angles.unbind(-1)
    one, zero = torch.ones_like(yaw), torch.zeros_like(yaw)

    def mat(rows: list[list[Tensor]]) -> Tensor:
        return torch.stack([torch.stack(r, -1) for r in rows], -2)

    cy, sy = torch.cos(yaw), torch.sin(yaw)
    cp, sp = torch.cos(pitch), torch.sin(pitch)
    cr, sr = torch.cos(roll), torch.sin(roll)
    ry = mat([[cy, zero, sy], [zero, one, zero], [-sy, zero, cy]])
    rx = mat([[one, zero, zero], [zero, cp, -sp], [zero, sp, cp]])
    rz = mat([[cr, -sr, zero], [sr, cr, zero], [zero, zero, one]])
    return ry @ rx @ rz


def angles_from_rotation(rotation: Tensor) -> Tensor:
    """The inverse of `rotation_from_angles`: Float[..., 3, 3] -> Float[..., 3] (yaw, pitch, roll)."""
    r = rotation
    pitch = torch.asin((-r[..., 1, 2]).clamp(-1.0, 1.0))
    yaw = torch.atan2(r[..., 0, 2], r[..., 2, 2])
    roll = torch.atan2(r[..., 1, 0], r[..., 1, 1])
    return torch.stack([yaw, pitch, roll], -1)


def intrinsics(fov_x: float, height: int, width: int) -> Tensor:
    """K Float[3, 3] of an H x W image with horizontal field of view `fov_x` (radians), square pixels."""
    if not 0 < fov_x < math.pi:
        raise ValueError(f"fov_x must be in (0, pi) radians, got {fov_x}")
    f = (width / 2) / math.tan(fov_x / 2)
    return torch.tensor([[f, 0.0, width / 2], [0.0, f, height / 2], [0.0, 0.0, 1.0]])


def scale_intrinsics(k: Tensor, sx: float, sy: float) -> Tensor:
    """K for the same camera at an image scaled by `sx` horizontally and `sy` vertically."""
    out = k.clone()
    out[..., 0, :] = out[..., 0, :] * sx
    out[..., 1, :] = out[..., 1, :] * sy
    return out


def pixel_grid(height: int, width: int, device: torch.device | None = None) -> Tensor:
    """Pixel centres Float[H, W, 2] as (u, v) = (column + 0.5, row + 0.5)."""
    v, u = torch.meshgrid(
        torch.arange(height, device=device, dtype=torch.float32) + 0.5,
        torch.arange(width, device=device, dtype=torch.float32) + 0.5,
        indexing="ij",
    )
    return torch.stack([u, v], -1)


def unproject(depth: Tensor, k: Tensor, rotation: Tensor, centre: Tensor) -> Tensor:
    """World points Float[..., H, W, 3] of every pixel of `depth` Float[..., H, W] seen by the camera (K Float[...,
    3, 3], R Float[..., 3, 3], c Float[..., 3]; leading dims broadcast)."""
    h, w = depth.shape[-2:]
    uv = pixel_grid(h, w, depth.device)
    kinv = torch.linalg.inv(k)[..., None, None, :, :]
    rays = (kinv @ torch.cat([uv, torch.ones_like(uv[..., :1])], -1)[..., None])[..., 0]  # z = 1
    cam = rays * depth[..., None]
    return (rotation[..., None, None, :, :] @ cam[..., None])[..., 0] + centre[..., None, None, :]


def project(points: Tensor, k: Tensor, rotation: Tensor, centre: Tensor) -> tuple[Tensor, Tensor]:
    """Pixel coordinates Float[..., N, 2] (u, v) and depth Float[..., N] of world `points` Float[..., N, 3] in the
    camera (K, R, c as in `unproject`). Points behind the camera get depth <= 0 (their uv are meaningless)."""
    cam = ((points - centre[..., None, :])[..., None, :] @ rotation[..., None, :, :])[
        ..., 0, :
    ]  # R^T (X - c)
    z = cam[..., 2]
    pix = (k[..., None, :, :] @ cam[..., None])[..., 0]
    uv = pix[..., :2] / torch.where(z.abs() < 1e-8, torch.full_like(z, 1e-8), z)[..., None]
    return uv, z
