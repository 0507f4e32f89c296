"""rewards.camera: rotations from angles against hand-built matrices, projection round trips, intrinsics."""

import math

import torch

from rewards.camera import (
    angles_from_rotation,
    intrinsics,
    pixel_grid,
    project,
    rotation_from_angles,
    scale_intrinsics,
    unproject,
)


def test_yaw_alone_turns_the_view_direction_about_the_world_y_axis() -> None:
    r = rotation_from_angles(torch.tensor([math.pi / 2, 0.0, 0.0]))
    # the camera's forward axis (third column) points along world +x after a quarter turn of yaw
    assert torch.allclose(r[:, 2], torch.tensor([1.0, 0.0, 0.0]), atol=1e-6)
    assert torch.allclose(r[:, 1], torch.tensor([0.0, 1.0, 0.0]), atol=1e-6)


def test_rotation_matches_a_hand_built_product_and_inverts() -> None:
    yaw, pitch, roll = 0.4, -0.3, 0.2
    cy, sy, cp, sp, cr, sr = (
        math.cos(yaw),
        math.sin(yaw),
        math.cos(pitch),
        math.sin(pitch),
        math.cos(roll),
        math.sin(roll),
    )
    ry = [[cy, 0, sy], [0, 1, 0], [-sy, 0, cy]]
    rx = [[1, 0, 0], [0, cp, -sp], [0, sp, cp]]
    rz = [[cr, -sr, 0], [sr, cr, 0], [0, 0, 1]]

    def mul(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:
        return [[sum(a[i][k] * b[k][j] for k in range(3)) for j in range(3)] for i in range(3)]

    expected = torch.tensor(mul(mul(ry, rx), rz))
    got = rotation_from_angles(torch.tensor([yaw, pitch, roll]))
    assert torch.allclose(got, expected, atol=1e-6)
    assert torch.allclose(angles_from_rotation(got), torch.tensor([yaw, pitch, roll]), atol=1e-6)


def test_intrinsics_of_a_90_degree_camera() -> None:
    k = intrinsics(math.pi / 2, 24, 32)
    assert torch.allclose(k, torch.tensor([[16.0, 0, 16], [0, 16, 12], [0, 0, 1]]))
    assert torch.allclose(scale_intrinsics(k, 0.25, 0.5), torch.tensor([[4.0, 0, 4], [0, 8, 6], [0, 0, 1]]))


def test_a_point_straight_ahead_lands_on_the_image_centre_at_its_distance() -> None:
    k = intrinsics(math.pi / 3, 32, 32)
    r = rotation_from_angles(torch.tensor([0.5, 0.0, 0.0]))
    c = torch.tensor([1.0, 0.0, -2.0])
    point = c + 3.0 * r[:, 2]  # 3 units along the viewing direction
    uv, z = project(point[None], k, r, c)
    assert torch.allclose(uv[0], torch.tensor([16.0, 16.0]), atol=1e-4)
    assert torch.allclose(z, torch.tensor([3.0]), atol=1e-5)


def test_unproject_then_project_returns_the_pixel_centres_and_depths() -> None:
    g = torch.Generator().manual_seed(0)
    k = intrinsics(math.radians(60), 8, 10)
    r = rotation_from_angles(torch.randn(2, 3, generator=g) * 0.3)
    c = torch.randn(2, 3, generator=g)
    depth = torch.rand(2, 8, 10, generator=g) + 0.5
    points = unproject(depth, k, r, c)
    uv, z = project(points.flatten(1, 2), k, r, c)
    assert torch.allclose(z, depth.flatten(1), atol=1e-5)
    assert torch.allclose(uv, pixel_grid(8, 10).flatten(0, 1).expand(2, -1, -1), atol=1e-4)
