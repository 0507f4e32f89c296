"""Video rewards (rewards/video.py): frame sampling, regions, PSNR / SSIM / flicker against hand-worked and
plain-loop references, the CLIP rewards against the image rewards, and the VLM judge.

Models are tiny and offline: the shapes-world CLIP (`clip_shapes_tiny`; the prebuilt copy in
assets/models when present, else built once) and the tiny Qwen2-VL (assets/models/vlm_reasoning-tiny
when present, else the random `vlm_random` build of conftest).
"""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import rewards
from mmalign.tiny.world import render_scene
from rewards import RewardBatch, RewardSet, load_reward
from rewards.image import CLIPEmbedder, aesthetic_mlp
from rewards.video import (
    check_frames,
    composite_region,
    frame_indices,
    gaussian_window,
    resample_video,
)

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "models"
VIDEO_REWARDS = (
    "instruction_faithfulness",
    "source_preservation",
    "video_preference",
    "video_psnr",
    "video_ssim",
    "temporal_consistency",
    "flicker",
    "vlm_judge",
    "frame_aesthetic",
)


@pytest.fixture(scope="module")
def clip_path(shapes_clip_dir: Path) -> Path:
    """The shapes-world tiny CLIP, built once per session by conftest's fixture."""
    return shapes_clip_dir


@pytest.fixture(scope="module")
def vlm_path(request: pytest.FixtureRequest) -> Path:
    """The tiny Qwen2-VL: the prebuilt vlm_reasoning-tiny, or conftest's random build."""
    prebuilt = ASSETS / "vlm_reasoning-tiny"
    if (prebuilt / "config.json").exists():
        return prebuilt
    return request.getfixturevalue("random_vlm_model_dir")


def video_batch(videos: torch.Tensor, prompts: list[str] | None = None, **kw: Any) -> RewardBatch:
    """A batch with outputs["videos"] and the outputs / columns in `kw` (tensors -> outputs, lists -> columns)."""
    outputs: dict[str, Any] = {"videos": videos}
    columns = {}
    for k, v in kw.items():
        (outputs if isinstance(v, torch.Tensor) else columns)[k] = v
    return RewardBatch(prompts=prompts or [""] * videos.shape[0], outputs=outputs, columns=columns)


def scene_video(
    colours: list[str], count: int = 1, position: str | None = "center", size: int = 32
) -> torch.Tensor:
    """Float[F,3,H,W]: one shapes-world frame per colour."""
    return torch.stack([render_scene(c, count, position, size=size) for c in colours])  # type: ignore[misc]


# =========================================================================== registry
def test_registered_with_summaries(capsys: pytest.CaptureFixture[str]) -> None:
    from mmalign.app.cli import main

    for name in VIDEO_REWARDS:
        assert name in rewards.names()
        cls = rewards.get(name)
        assert cls.name == name and "videos" in cls.needs
        doc = (cls.__doc__ or "").strip()
        assert doc and len(doc.splitlines()[0]) > 10
    assert main(["list", "rewards"]) == 0
    shown = {ln.split()[0] for ln in capsys.readouterr().out.splitlines()[1:] if ln.strip()}
    assert set(VIDEO_REWARDS) <= shown


# =========================================================================== frames / regions
def test_frame_indices() -> None:
    assert frame_indices(5, "all") == [0, 1, 2, 3, 4]
    assert frame_indices(5, 3) == [0, 2, 4]
    assert frame_indices(10, 4) == [0, 3, 6, 9]
    assert frame_indices(49, 5) == [0, 12, 24, 36, 48]
    assert frame_indices(7, 2) == [0, 6]
    assert frame_indices(4, 1) == [0]
    assert frame_indices(3, 8) == [0, 1, 2]  # k >= F: every frame
    assert frame_indices(6, [5, 0, -1, -6]) == [5, 0, 5, 0]
    with pytest.raises(IndexError, match="frame index 6 is out of range for a video of 6 frames"):
        frame_indices(6, [6])
    for bad in (0, -2, "some", [], True, [1.5], None):
        with pytest.raises(ValueError, match="frames"):
            check_frames(bad)
    with pytest.raises(ValueError, match="reward 'flicker'.*frames"):
        load_reward("flicker", frames="first")
    with pytest.raises(IndexError, match="reward 'flicker'.*frames=\\[9\\]"):
        load_reward("flicker", frames=[9])(video_batch(torch.rand(1, 3, 3, 8, 8)))


def test_composite_and_resample() -> None:
    frames = torch.rand(2, 3, 3, 4, 4)
    masks = torch.zeros(2, 3, 4, 4)
    masks[..., :2, :] = 1.0
    out = composite_region(frames, masks, "outside")
    assert (out[..., :2, :] == 0.5).all() and torch.equal(out[..., 2:, :], frames[..., 2:, :])
    inside = composite_region(frames, masks, "inside")
    assert (inside[..., 2:, :] == 0.5).all() and torch.equal(inside[..., :2, :], frames[..., :2, :])
    assert composite_region(frames, None, "all") is frames
    v = torch.rand(9, 3, 8, 8)
    assert torch.equal(resample_video(v, 3, (8, 8)), v[[0, 4, 8]])  # nearest in time: 0, 4, 8 of 9
    assert torch.equal(resample_video(v, 5, (8, 8)), v[[0, 2, 4, 6, 8]])
    assert torch.equal(resample_video(v[:2], 3, (8, 8)), v[[0, 0, 1]])  # fewer source frames: repeated
    flat = resample_video(torch.full((2, 3, 8, 8), 0.3), 2, (4, 6))
    assert flat.shape == (2, 3, 4, 6) and torch.allclose(flat, torch.full_like(flat, 0.3))
    m = resample_video(torch.ones(2, 8, 8), 4, (2, 2), nearest=True)
    assert m.shape == (4, 2, 2) and (m == 1).all()


# =========================================================================== PSNR / SSIM / flicker
def test_psnr_hand_worked() -> None:
    g = torch.Generator().manual_seed(0)
    src = torch.rand(2, 4, 3, 8, 8, generator=g) * 0.8
    edit = src + 0.1  # MSE 0.01 -> 20 dB
    masks = torch.zeros(2, 4, 8, 8)
    masks[:, :, 2:5, 3:7] = 1.0
    edit_in = edit.clone()
    edit_in[:, :, :, 2:5, 3:7] = 1 - src[:, :, :, 2:5, 3:7]  # a large change, only inside the mask
    r = load_reward("video_psnr")
    assert r.needs == {"videos"}
    out = r(video_batch(edit_in, source_videos=src, edit_masks=masks))
    assert out.shape == (2,) and torch.allclose(out, torch.full((2,), 20.0), atol=1e-4)
    assert r.last_metrics["frames"] == 4 and r.last_metrics["region_frac"] == pytest.approx(1 - 12 / 64)
    # region all: the pooled MSE by hand
    mse = ((edit_in - src) ** 2).flatten(1).double().mean(1)
    full = load_reward("video_psnr", region="all")(video_batch(edit_in, source_videos=src))
    assert torch.allclose(full.double(), 10 * torch.log10(1 / mse), atol=1e-4)
    # inside: only the changed pixels
    d = (1 - 2 * src[:, :, :, 2:5, 3:7]) ** 2
    inside = load_reward("video_psnr", region="inside")(
        video_batch(edit_in, source_videos=src, edit_masks=masks)
    )
    assert torch.allclose(inside.double(), 10 * torch.log10(1 / d.flatten(1).double().mean(1)), atol=1e-4)
    # pooled over frames: frame 0 offset 0.1, frame 1 exact -> MSE 0.005, not the mean of 20 dB and the cap
    two = torch.stack([src[0, 0] + 0.1, src[0, 1]]).unsqueeze(0)
    pooled = load_reward("video_psnr", region="all")(video_batch(two, source_videos=src[:1, :2]))
    assert pooled.item() == pytest.approx(10 * math.log10(1 / 0.005), abs=1e-4)
    assert (
        load_reward("video_psnr", region="all", frames=[1])(
            video_batch(two, source_videos=src[:1, :2])
        ).item()
        == 100.0
    )
    assert (
        load_reward("video_psnr", region="all", max_db=50)(video_batch(src, source_videos=src)).tolist()
        == [50.0] * 2
    )
    # the mask covers everything -> no pixel outside -> NaN
    assert torch.isnan(r(video_batch(edit, source_videos=src, edit_masks=torch.ones(2, 4, 8, 8)))).all()


def ssim_reference(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Plain loops over window centres, straight from Wang et al. (2004): x, y Float[F,3,H,W], mask Float[F,H,W]."""
    size, sigma = 11, 1.5
    g = [math.exp(-((i - 5) ** 2) / (2 * sigma**2)) for i in range(size)]
    w = [[a * b for b in g] for a in g]
    tot = sum(map(sum, w))
    w = [[v / tot for v in row] for row in w]
    c1, c2 = 0.01**2, 0.03**2
    f, _, h, wd = x.shape
    total, count = 0.0, 0
    for t in range(f):
        for i in range(h - size + 1):
            for j in range(wd - size + 1):
                if mask is not None and mask[t, i + 5, j + 5] > 0.5:
                    continue
                s = 0.0
                for c in range(3):
                    px = x[t, c, i : i + size, j : j + size].tolist()
                    py = y[t, c, i : i + size, j : j + size].tolist()
                    mx = sum(w[a][b] * px[a][b] for a in range(size) for b in range(size))
                    my = sum(w[a][b] * py[a][b] for a in range(size) for b in range(size))
                    vx = sum(w[a][b] * (px[a][b] - mx) ** 2 for a in range(size) for b in range(size))
                    vy = sum(w[a][b] * (py[a][b] - my) ** 2 for a in range(size) for b in range(size))
                    cxy = sum(
                        w[a][b] * (px[a][b] - mx) * (py[a][b] - my) for a in range(size) for b in range(size)
                    )
                    s += ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
                total += s / 3
                count += 1
    return total / count


def test_ssim_against_plain_loops() -> None:
    g = torch.Generator().manual_seed(1)
    src = torch.rand(1, 2, 3, 13, 14, generator=g, dtype=torch.float64)
    edit = (src + 0.15 * torch.randn(src.shape, generator=g, dtype=torch.float64)).clamp(0, 1)
    masks = torch.zeros(1, 2, 13, 14)
    masks[0, :, 4:7, 5:9] = 1.0
    ref_all = ssim_reference(edit[0], src[0])
    ref_out = ssim_reference(edit[0], src[0], masks[0])
    batch = video_batch(edit.float(), source_videos=src.float(), edit_masks=masks)
    assert load_reward("video_ssim", region="all")(batch).item() == pytest.approx(ref_all, abs=1e-5)
    assert load_reward("video_ssim")(batch).item() == pytest.approx(ref_out, abs=1e-5)
    assert ref_out != pytest.approx(ref_all, abs=1e-4)  # the mask really excluded centres
    same = load_reward("video_ssim", region="all")(video_batch(src.float(), source_videos=src.float()))
    assert same.item() == pytest.approx(1.0, abs=1e-6)
    w = gaussian_window()
    assert w.shape == (11, 11) and w.sum().item() == pytest.approx(1.0) and w[5, 5] == w.max()
    with pytest.raises(ValueError, match="video_ssim.*at least 11x11"):
        load_reward("video_ssim", region="all")(
            video_batch(torch.rand(1, 2, 3, 8, 8), source_videos=torch.rand(1, 2, 3, 8, 8))
        )


def test_flicker_hand_worked() -> None:
    levels = [0.0, 0.2, 0.5, 0.5, 0.1]
    video = torch.stack([torch.full((3, 4, 4), v) for v in levels]).unsqueeze(0)
    video = torch.cat([video, torch.zeros_like(video)])  # a still second video
    r = load_reward("flicker")
    out = r(video_batch(video))
    assert out.tolist() == pytest.approx([(0.2 + 0.3 + 0.0 + 0.4) / 4, 0.0])
    assert r.last_metrics == {"frames": 5.0}
    assert load_reward("flicker", frames=3)(video_batch(video))[0].item() == pytest.approx(
        (0.5 + 0.4) / 2
    )  # 0, 2, 4
    assert load_reward("flicker", frames=[3, 0])(video_batch(video))[0].item() == pytest.approx(
        0.5
    )  # sorted pairs
    assert load_reward("flicker", negate=True)(video_batch(video))[0].item() == pytest.approx(-0.225)
    assert torch.isnan(load_reward("flicker", frames=1)(video_batch(video))).all()


def test_input_errors() -> None:
    r = load_reward("video_psnr")
    with pytest.raises(KeyError, match="outputs\\['videos'\\]"):
        r(RewardBatch(prompts=["a"], outputs={"images": torch.rand(1, 3, 8, 8)}))
    with pytest.raises(ValueError, match="Float\\[B,F,3,H,W\\], got \\(1, 3, 8, 8\\)"):
        r(video_batch(torch.rand(1, 3, 8, 8)))
    v = torch.rand(1, 2, 3, 8, 8)
    with pytest.raises(
        ValueError, match="source_videos'\\] has shape \\(1, 3, 3, 8, 8\\).*\\(1, 2, 3, 8, 8\\)"
    ):
        r(video_batch(v, source_videos=torch.rand(1, 3, 3, 8, 8), edit_masks=torch.zeros(1, 2, 8, 8)))
    with pytest.raises(KeyError, match="source_videos.*'source_video'"):
        r(video_batch(v, edit_masks=torch.zeros(1, 2, 8, 8)))
    with pytest.raises(KeyError, match="edit_masks.*'edit_mask'.*region='outside'"):
        r(video_batch(v, source_videos=v))
    with pytest.raises(ValueError, match="edit_masks'\\] has shape \\(1, 8, 8\\)"):
        r(video_batch(v, source_videos=v, edit_masks=torch.zeros(1, 8, 8)))
    with pytest.raises(ValueError, match="region must be one of"):
        load_reward("video_ssim", region="border")
    with pytest.raises(TypeError, match="'video_psnr' got unknown option"):
        load_reward("video_psnr", frame=2)


def test_source_and_mask_from_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without outputs['source_videos'] the paths of the columns are read with mmalign.data.media and resampled."""
    g = torch.Generator().manual_seed(2)
    files = {
        "src.mp4": torch.rand(8, 3, 16, 16, generator=g),  # twice the frames and size of the edit
        "mask.png": (torch.rand(8, 16, 16, generator=g) > 0.7).float(),
    }
    calls: list[tuple[str, Any, Any]] = []

    def read_video(path: str, num_frames: int | None = None, size: Any = None) -> torch.Tensor:
        calls.append((path, num_frames, size))
        return files[path]

    fake = types.ModuleType("mmalign.data.media")
    fake.read_video = read_video  # type: ignore[attr-defined]
    fake.read_mask = read_video  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mmalign.data.media", fake)
    edit = torch.rand(2, 4, 3, 8, 8, generator=g)
    batch = video_batch(edit, source_video=["src.mp4", None], edit_mask=["mask.png", "mask.png"])
    out = load_reward("video_psnr")(batch)
    assert calls == [("src.mp4", None, None), ("mask.png", None, None)]  # a shared path is read once
    src = resample_video(files["src.mp4"], 4, (8, 8)).unsqueeze(0)
    mask = resample_video(files["mask.png"], 4, (8, 8), nearest=True).unsqueeze(0)
    expected = load_reward("video_psnr")(video_batch(edit[:1], source_videos=src, edit_masks=mask))
    assert out[0].item() == pytest.approx(expected.item(), abs=1e-5) and math.isnan(out[1].item())


# =========================================================================== CLIP rewards
def test_instruction_faithfulness_sign_and_clip_score(clip_path: Path) -> None:
    red = scene_video(["red"] * 3)
    blue = scene_video(["blue"] * 3)
    videos = torch.stack([red, blue])
    r = load_reward("instruction_faithfulness", path=str(clip_path))
    fwd = r(video_batch(videos, target_caption=["a red square"] * 2, source_caption=["a blue square"] * 2))
    rev = r(video_batch(videos, target_caption=["a blue square"] * 2, source_caption=["a red square"] * 2))
    assert fwd[0] > 0 > rev[0] and fwd[1] < 0 < rev[1]
    assert torch.allclose(fwd, -rev, atol=1e-4)
    # reference: the difference of two clip_score calls on the frames, averaged over the frames
    mixed = torch.stack(
        [scene_video(["red", "green", "blue", "yellow"]), scene_video(["blue", "blue", "red", "red"])]
    )
    t_edit, t_src = ["a red square", "two green squares"], ["a blue square", "yellow"]
    cs = load_reward("clip_score", path=str(clip_path))
    frames = mixed.flatten(0, 1)
    per_frame = cs(
        RewardBatch(prompts=[t for t in t_edit for _ in range(4)], outputs={"images": frames})
    ) - cs(RewardBatch(prompts=[t for t in t_src for _ in range(4)], outputs={"images": frames}))
    per_frame = per_frame.view(2, 4)
    batch = video_batch(mixed, target_caption=t_edit, source_caption=t_src)
    assert torch.allclose(r(batch), per_frame.mean(1), atol=1e-4)
    assert r.last_metrics == {"frames": 4.0}
    # frames option: "all" vs k vs list
    assert torch.allclose(
        load_reward("instruction_faithfulness", path=str(clip_path), frames=2)(batch),
        per_frame[:, [0, 3]].mean(1),
        atol=1e-4,
    )
    assert torch.allclose(
        load_reward("instruction_faithfulness", path=str(clip_path), frames=[1, 2])(batch),
        per_frame[:, [1, 2]].mean(1),
        atol=1e-4,
    )
    raw = load_reward("instruction_faithfulness", path=str(clip_path), raw=True, batch_size=3)(batch)
    assert torch.allclose(100 * raw, per_frame.mean(1), atol=1e-4)
    with pytest.raises(
        KeyError, match="target caption column 'target_caption'.*available columns: \\['source_caption'\\]"
    ):
        r(video_batch(mixed, source_caption=t_src))


def test_instruction_faithfulness_region(clip_path: Path) -> None:
    video = scene_video(["red", "red"]).unsqueeze(0)
    masks = torch.zeros(1, 2, 32, 32)
    masks[..., :, 16:] = 1.0
    texts = dict(target_caption=["a red square"], source_caption=["a blue square"])
    clip = CLIPEmbedder(clip_path)
    grey = composite_region(video[0], masks[0], "inside")
    te, ts = clip.encode_texts(["a red square", "a blue square"])
    expected = 100 * ((clip.encode_images(grey) @ te) - (clip.encode_images(grey) @ ts)).mean()
    r = load_reward("instruction_faithfulness", path=str(clip_path), region="inside")
    assert r(video_batch(video, edit_masks=masks, **texts)).item() == pytest.approx(expected.item(), abs=1e-3)


def test_source_preservation(clip_path: Path) -> None:
    src = torch.stack(
        [scene_video(["red", "green", "blue"]), scene_video(["yellow"] * 3, count=2, position="left")]
    )
    masks = torch.zeros(2, 3, 32, 32)
    masks[..., 8:24, 8:24] = 1.0
    r = load_reward("source_preservation", path=str(clip_path))
    same = r(video_batch(src.clone(), source_videos=src, edit_masks=masks))
    assert torch.allclose(same, torch.ones(2), atol=1e-5)
    edited = src.clone()
    edited[..., 8:24, 8:24] = torch.rand(2, 3, 3, 16, 16)  # only masked pixels change
    assert torch.allclose(r(video_batch(edited, source_videos=src, edit_masks=masks)), same, atol=1e-6)
    whole = load_reward("source_preservation", path=str(clip_path), region="all")(
        video_batch(edited, source_videos=src)
    )
    assert (whole < 1 - 1e-3).all()
    # hand computation per frame, frames=[0, 2]
    changed = src.clone()
    changed[:, :, :, :4] = 0.0  # outside the mask: counts
    clip = CLIPEmbedder(clip_path)
    e = clip.encode_images(composite_region(changed[0, [0, 2]], masks[0, [0, 2]], "outside"))
    s = clip.encode_images(composite_region(src[0, [0, 2]], masks[0, [0, 2]], "outside"))
    got = load_reward("source_preservation", path=str(clip_path), frames=[0, 2])(
        video_batch(changed, source_videos=src, edit_masks=masks)
    )
    assert got[0].item() == pytest.approx((e * s).sum(-1).mean().item(), abs=1e-5) and got[0] < 1 - 1e-4


def test_temporal_consistency(clip_path: Path) -> None:
    videos = torch.stack([scene_video(["red"] * 4), scene_video(["red", "blue", "green", "yellow"])])
    r = load_reward("temporal_consistency", path=str(clip_path))
    out = r(video_batch(videos))
    emb = CLIPEmbedder(clip_path).encode_images(videos[1])
    assert out[0].item() == pytest.approx(1.0, abs=1e-5)
    assert out[1].item() == pytest.approx((emb[1:] * emb[:-1]).sum(-1).mean().item(), abs=1e-5)
    sparse = load_reward("temporal_consistency", path=str(clip_path), frames=2)(video_batch(videos))
    assert sparse[1].item() == pytest.approx((emb[0] @ emb[3]).item(), abs=1e-5)
    assert torch.isnan(
        load_reward("temporal_consistency", path=str(clip_path), frames=[2])(video_batch(videos))
    ).all()


def test_video_preference_is_mean_of_frame_preference(clip_path: Path) -> None:
    videos = torch.stack([scene_video(["red", "blue", "red"]), scene_video(["green"] * 3, count=3)])
    prompts = ["a red square", "three green squares"]
    r = load_reward("video_preference", path=str(clip_path), frames=[0, 1])
    assert r.needs == {"videos", "prompts"}
    pref = load_reward("preference", path=str(clip_path))
    per_frame = pref(
        RewardBatch(
            prompts=[p for p in prompts for _ in range(2)], outputs={"images": videos[:, :2].flatten(0, 1)}
        )
    ).view(2, 2)
    assert torch.allclose(r(video_batch(videos, prompts=prompts)), per_frame.mean(1), atol=1e-4)
    by_col = load_reward("video_preference", path=str(clip_path), frames=[0, 1], text_column="target_caption")
    assert torch.allclose(by_col(video_batch(videos, target_caption=prompts)), per_frame.mean(1), atol=1e-4)


def test_frame_aesthetic(clip_path: Path, tmp_path: Path) -> None:
    dim = CLIPEmbedder(clip_path).encode_images(torch.rand(1, 3, 32, 32)).shape[-1]
    torch.manual_seed(0)
    mlp = aesthetic_mlp(dim, (8,)).eval()
    torch.save(mlp.state_dict(), tmp_path / "mlp.pt")
    videos = torch.rand(2, 3, 3, 32, 32)
    opts = dict(mlp_path=str(tmp_path / "mlp.pt"), path=str(clip_path), hidden=[8], scale=2.0)
    per_frame = load_reward("aesthetic", **opts)(
        RewardBatch(prompts=[""] * 6, outputs={"images": videos.flatten(0, 1)})
    )
    r = load_reward("frame_aesthetic", **opts)
    assert torch.allclose(r(video_batch(videos)), per_frame.view(2, 3).mean(1), atol=1e-5)
    assert torch.allclose(
        load_reward("frame_aesthetic", frames=[2], **opts)(video_batch(videos)),
        per_frame.view(2, 3)[:, 2],
        atol=1e-5,
    )


def test_in_reward_set(clip_path: Path) -> None:
    rs = RewardSet(
        [
            {"name": "flicker", "weight": -1.0},
            {"name": "video_psnr", "kwargs": {"region": "all"}},
            {"name": "temporal_consistency", "kwargs": {"path": str(clip_path), "frames": 3}},
        ]
    )
    assert rs.needs == {"videos"}
    v = torch.rand(2, 5, 3, 16, 16)
    out = rs(video_batch(v, source_videos=v))
    assert out.shape == (2, 3) and torch.isfinite(out).all()
    assert rs.last_metrics["reward/temporal_consistency/frames"] == 3.0


# =========================================================================== VLM judge
def test_vlm_judge(vlm_path: Path) -> None:
    videos = torch.stack(
        [scene_video(["red"] * 5, size=56), scene_video(["blue", "green", "blue", "green", "red"], size=56)]
    )
    batch = video_batch(
        videos, prompts=["make it red", "x"], target_caption=["a red square", "a blue square"]
    )
    r = load_reward(
        "vlm_judge",
        path=str(vlm_path),
        questions=["Does this video show {target_caption}? Answer yes or no.", "Is it {prompt}? yes or no"],
    )
    assert r.needs == {"videos", "prompts"}
    out = r(batch)
    assert out.shape == (2,) and out.dtype == torch.float32
    assert ((out >= 0) & (out <= 1)).all()
    assert torch.equal(out, r(batch))  # deterministic
    assert r.last_metrics["frames"] == 4.0 and set(r.last_metrics) == {"frames", "p_yes_q0", "p_yes_q1"}
    probs = r.yes_no_probs(batch)
    assert probs.shape == (2, 2, 2)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 2), atol=1e-6)
    assert torch.allclose(out, probs[..., 0].mean(1), atol=1e-6)
    tok = r.processor.tokenizer
    assert r.yes_ids and r.no_ids and not set(r.yes_ids) & set(r.no_ids)
    assert tok("yes", add_special_tokens=False)["input_ids"][0] in r.yes_ids
    as_images = load_reward("vlm_judge", path=str(vlm_path), mode="images", frames=2)(batch)
    assert as_images.shape == (2,) and ((as_images >= 0) & (as_images <= 1)).all()
    single = load_reward("vlm_judge", path=str(vlm_path), batch_size=1)
    assert torch.allclose(single(batch), load_reward("vlm_judge", path=str(vlm_path))(batch), atol=1e-5)


def test_vlm_judge_errors(vlm_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="uses \\{caption\\}; placeholders"):
        load_reward("vlm_judge", path=str(vlm_path), questions=["Is it {caption}?"])
    with pytest.raises(ValueError, match="mode must be"):
        load_reward("vlm_judge", path=str(vlm_path), mode="gif")
    with pytest.raises(FileNotFoundError, match="no-such-vlm"):
        load_reward("vlm_judge", path=str(tmp_path / "no-such-vlm"))
    r = load_reward("vlm_judge", path=str(vlm_path), questions="Does it follow {instruction}? yes or no")
    with pytest.raises(KeyError, match="instruction column 'instruction'"):
        r(video_batch(torch.rand(1, 2, 3, 28, 28), target_caption=["x"]))


def test_source_and_mask_files_through_mmalign_video(tmp_path: Path) -> None:
    """The column fallback with the real readers: frame folders written by `mmalign.data.media.write_frames`."""
    video_io = pytest.importorskip("mmalign.data.media")
    g = torch.Generator().manual_seed(4)
    src = (torch.rand(6, 3, 16, 16, generator=g) * 255).round() / 255  # exact in 8-bit PNGs
    mask = torch.zeros(6, 16, 16)
    mask[:, 4:12, 4:12] = 1.0
    video_io.write_frames(src, tmp_path / "src")
    video_io.write_frames(mask, tmp_path / "mask")
    edit = src.clone().unsqueeze(0)
    edit[..., 4:12, 4:12] = 1 - edit[..., 4:12, 4:12]  # changed only inside the mask
    batch = video_batch(edit, source_video=[str(tmp_path / "src")], edit_mask=[str(tmp_path / "mask")])
    assert load_reward("video_psnr")(batch).item() == 100.0
    # the 6x6 SSIM map's window centres (pixels 5..10) all lie in the mask: no centre outside -> NaN
    assert math.isnan(load_reward("video_ssim")(batch).item())
    same = video_batch(src.unsqueeze(0), source_video=[str(tmp_path / "src")])
    assert load_reward("video_ssim", region="all")(same).item() == pytest.approx(1.0, abs=1e-6)
    assert load_reward("video_psnr", region="inside")(batch).item() < 20
