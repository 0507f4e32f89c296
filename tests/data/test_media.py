"""`mmalign.data.media` (reading / writing clips and edit masks) and the synthetic editing clips of
`mmalign.tiny.video_shapes`.

Every storage form is written and read back: a frame folder (`write_frames`), a ``.npz`` (`write_array`), a
``.npy`` (written here with NumPy) and an H.264 ``.mp4`` (`mmalign.data.media.save_video`, lossy: compared with a
tolerance). Frame subsampling is checked against hand-computed indices, resizing against frames whose resized
value is known, and every error against a message naming the path. The editing clips are checked for the
invariants the rewards rely on: the target equals the source outside the mask, the mask covers every changed
pixel, a recolour changes only the colour, a removal whitens the moving square.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmalign.data.media import (
    even_frame_indices,
    read_mask,
    read_video,
    save_video,
    write_array,
    write_frames,
)
from mmalign.tiny import video_shapes
from mmalign.tiny.video_shapes import EDIT_KINDS, FRAMES, SIZE, make_edit_clip, write_video_edit_dataset
from mmalign.tiny.world import PALETTE


def quantised(x: torch.Tensor) -> torch.Tensor:
    """What an 8-bit store keeps of Float in [0, 1]."""
    return (x * 255).round() / 255


def numbered_clip(frames: int = 9, h: int = 16, w: int = 24) -> torch.Tensor:
    """Float[F, 3, H, W]: random pixels, and frame i's first pixel is i / 255 (so frames can be told apart)."""
    g = torch.Generator().manual_seed(frames)
    clip = torch.rand(frames, 3, h, w, generator=g)
    clip[:, 0, 0, 0] = torch.arange(frames) / 255
    return clip


def frame_ids(video: torch.Tensor) -> list[int]:
    return [round(float(v) * 255) for v in video[:, 0, 0, 0]]


def in_message(path: Path) -> str:
    return re.escape(str(path))


# ----------------------------------------------------------------------------- round trips


def test_even_frame_indices_by_hand() -> None:
    assert even_frame_indices(9, 5) == [0, 2, 4, 6, 8]
    assert even_frame_indices(10, 4) == [0, 3, 6, 9]
    assert even_frame_indices(9, 9) == list(range(9))
    assert even_frame_indices(7, 1) == [0]
    assert even_frame_indices(5, 2) == [0, 4]
    with pytest.raises(ValueError, match="cannot keep 6 frames of a clip of 5"):
        even_frame_indices(5, 6)
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        even_frame_indices(5, 0)


def test_frame_folder_round_trip(tmp_path: Path) -> None:
    clip = numbered_clip()
    folder = write_frames(clip, tmp_path / "frames")
    assert sorted(p.name for p in folder.iterdir()) == [f"frame_{i:03d}.png" for i in range(9)]
    back = read_video(folder)
    assert back.shape == (9, 3, 16, 24) and back.dtype == torch.float32
    torch.testing.assert_close(back, quantised(clip), atol=1e-6, rtol=0)
    # writing a shorter clip into the same folder replaces the old frames (no stale frame_008.png)
    write_frames(clip[:3], folder)
    assert read_video(folder).shape[0] == 3


def test_npz_round_trip(tmp_path: Path) -> None:
    clip = numbered_clip()
    path = write_array(clip, tmp_path / "clip.npz")
    with np.load(path) as archive:
        assert archive.files == ["frames"]
        assert archive["frames"].dtype == np.uint8 and archive["frames"].shape == (9, 16, 24, 3)
    torch.testing.assert_close(read_video(path), quantised(clip), atol=1e-6, rtol=0)
    mask = (torch.rand(9, 16, 24, generator=torch.Generator().manual_seed(1)) > 0.5).float()
    torch.testing.assert_close(read_mask(write_array(mask, tmp_path / "mask.npz")), mask, atol=0, rtol=0)
    # a .npz with one array under another name is read too
    np.savez(tmp_path / "other.npz", video=(quantised(clip).permute(0, 2, 3, 1) * 255).byte().numpy())
    torch.testing.assert_close(read_video(tmp_path / "other.npz"), quantised(clip), atol=1e-6, rtol=0)


def test_npy_round_trip_uint8_and_float(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, (5, 8, 12, 3), dtype=np.uint8)
    np.save(tmp_path / "u8.npy", arr)
    expect = torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 255
    torch.testing.assert_close(read_video(tmp_path / "u8.npy"), expect, atol=1e-6, rtol=0)
    flt = rng.random((5, 8, 12, 3)).astype(np.float64)
    np.save(tmp_path / "f.npy", flt)
    got = read_video(tmp_path / "f.npy")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.from_numpy(flt).permute(0, 3, 1, 2).float(), atol=1e-6, rtol=0)


def test_mp4_round_trip_is_close(tmp_path: Path) -> None:
    import av

    # smooth content (flat colour blocks moving) so H.264 at its default quality keeps it close
    clip = torch.ones(9, 3, 32, 32)
    for t in range(9):
        clip[t, :, 4 + t : 16 + t, 8:24] = torch.tensor([0.9, 0.1, 0.1]).view(3, 1, 1)
    path = save_video(clip, tmp_path / "clip.mp4")
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        assert sum(1 for _ in container.decode(video=0)) == 9
    back = read_video(path)
    assert back.shape == clip.shape
    err = (back - clip).abs()
    assert float(err.mean()) < 0.02, float(err.mean())
    assert float(err.max()) < 0.5, float(err.max())  # chroma subsampling blurs the square's edges
    # the square stays where it was: its red channel is high, its green channel low, frame by frame
    for t in (0, 4, 8):
        assert float(back[t, 0, 6 + t : 14 + t, 10:22].mean()) > 0.8
        assert float(back[t, 1, 6 + t : 14 + t, 10:22].mean()) < 0.25
    # subsampling a decoded file picks the same frames as from the original
    sub = read_video(path, num_frames=5)
    torch.testing.assert_close(sub, back[even_frame_indices(9, 5)], atol=0, rtol=0)


@pytest.mark.parametrize("form", ["folder", "npz", "npy"])
@pytest.mark.parametrize("k", [1, 3, 5, 9])
def test_num_frames_picks_even_indices(tmp_path: Path, form: str, k: int) -> None:
    clip = numbered_clip()
    if form == "folder":
        path = write_frames(clip, tmp_path / "frames")
    elif form == "npz":
        path = write_array(clip, tmp_path / "clip.npz")
    else:
        path = tmp_path / "clip.npy"
        np.save(path, (quantised(clip) * 255).round().byte().permute(0, 2, 3, 1).numpy())
    got = read_video(path, num_frames=k)
    assert frame_ids(got) == even_frame_indices(9, k)
    torch.testing.assert_close(got, quantised(clip)[even_frame_indices(9, k)], atol=1e-6, rtol=0)


def test_one_image_is_a_one_frame_clip(tmp_path: Path) -> None:
    rgb = np.random.default_rng(0).integers(0, 256, (6, 5, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "first.png")
    clip = read_video(tmp_path / "first.png")
    assert clip.shape == (1, 3, 6, 5)
    assert torch.equal(clip, torch.from_numpy(rgb).permute(2, 0, 1)[None].float() / 255)


def test_size_resizes_each_frame(tmp_path: Path) -> None:
    # flat frames stay flat at any size; a left-black / right-white frame keeps its halves
    clip = torch.zeros(3, 3, 32, 32)
    clip[0] = 0.2
    clip[1] = 0.6
    clip[2, :, :, 16:] = 1.0
    path = write_array(clip, tmp_path / "clip.npz")
    got = read_video(path, size=(16, 24))
    assert got.shape == (3, 3, 16, 24)
    torch.testing.assert_close(got[0], torch.full((3, 16, 24), quantised(torch.tensor(0.2)).item()))
    torch.testing.assert_close(got[1], torch.full((3, 16, 24), quantised(torch.tensor(0.6)).item()))
    assert float(got[2, :, :, :10].max()) < 0.01 and float(got[2, :, :, 14:].min()) > 0.99
    assert float(got.min()) >= 0 and float(got.max()) <= 1
    # the same size is a no-op, and size with num_frames both apply
    torch.testing.assert_close(read_video(path, size=(32, 32)), read_video(path), atol=0, rtol=0)
    assert read_video(path, num_frames=2, size=(8, 8)).shape == (2, 3, 8, 8)


def test_masks_stay_binary_and_threshold_at_half(tmp_path: Path) -> None:
    mask = torch.zeros(9, 32, 32)
    for t in range(9):
        mask[t, 5 + t : 17 + t, 3:19] = 1.0
    path = write_array(mask, tmp_path / "mask.npz")
    for size in [(16, 16), (13, 17), (64, 48)]:
        got = read_mask(path, size=size)
        assert got.shape == (9, *size)
        assert set(got.unique().tolist()) <= {0.0, 1.0}
        # the area share is kept up to a pixel of rounding along each side
        share = float(got.mean()) / float(mask.mean())
        assert 0.75 < share < 1.3, (size, share)
    # halving by nearest keeps the square at half its coordinates
    half = read_mask(path, size=(16, 16))
    torch.testing.assert_close(half[0, 3:8, 2:9], torch.ones(5, 7))
    # grey > 0.5 is 1: 128 / 255 is in, 127 / 255 out
    grey = np.zeros((2, 4, 4), np.uint8)
    grey[:, 0, 0], grey[:, 1, 1], grey[:, 2, 2] = 128, 127, 255
    np.save(tmp_path / "grey.npy", grey)
    got = read_mask(tmp_path / "grey.npy")
    assert got.dtype == torch.float32
    assert (
        got[:, 0, 0].tolist() == [1, 1]
        and got[:, 1, 1].tolist() == [0, 0]
        and got[:, 2, 2].tolist() == [1, 1]
    )
    assert float(got.sum()) == 4
    # a frame-folder mask (RGB frames as written by write_frames) and an RGB .npy mask read the same
    folder_mask = read_mask(write_frames(mask, tmp_path / "mask_frames"))
    torch.testing.assert_close(folder_mask, mask, atol=0, rtol=0)
    np.save(tmp_path / "rgb_mask.npy", (mask[..., None].expand(-1, -1, -1, 3) * 255).byte().numpy())
    torch.testing.assert_close(read_mask(tmp_path / "rgb_mask.npy"), mask, atol=0, rtol=0)


def test_single_image_mask_holds_for_every_frame(tmp_path: Path) -> None:
    img = np.zeros((20, 30), np.uint8)
    img[4:12, 6:20] = 255
    Image.fromarray(img).save(tmp_path / "mask.png")
    one = read_mask(tmp_path / "mask.png")
    assert one.shape == (1, 20, 30) and float(one.sum()) == 8 * 14
    many = read_mask(tmp_path / "mask.png", num_frames=9, size=(10, 15))
    assert many.shape == (9, 10, 15)
    for t in range(9):
        torch.testing.assert_close(many[t], many[0], atol=0, rtol=0)
    assert float(many[0].sum()) == 4 * 7
    # a [H, W] .npy is one frame too
    np.save(tmp_path / "hw.npy", img)
    assert read_mask(tmp_path / "hw.npy", num_frames=5).shape == (5, 20, 30)


# ----------------------------------------------------------------------------- errors name the path


def test_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.npz"
    with pytest.raises(FileNotFoundError, match=f"video not found: {in_message(missing)}"):
        read_video(missing)
    with pytest.raises(FileNotFoundError, match=f"edit mask not found: {in_message(missing)}"):
        read_mask(missing)

    bad = tmp_path / "clip.txt"
    bad.write_text("hello")
    with pytest.raises(ValueError, match=f"{in_message(bad)}: unknown video format '.txt'"):
        read_video(bad)
    with pytest.raises(ValueError, match=f"{in_message(bad)}: unknown mask format '.txt'"):
        read_mask(bad)

    clip = write_array(numbered_clip(), tmp_path / "clip.npz")
    with pytest.raises(ValueError, match=f"{in_message(clip)}: 10 frames were asked for, the clip has 9"):
        read_video(clip, num_frames=10)
    mask = write_array(torch.ones(3, 8, 8), tmp_path / "mask.npz")
    with pytest.raises(ValueError, match=f"{in_message(mask)}: 4 frames were asked for, the clip has 3"):
        read_mask(mask, num_frames=4)

    dims = tmp_path / "dims.npy"
    np.save(dims, np.zeros((4, 8, 8), np.uint8))
    with pytest.raises(
        ValueError, match=rf"{in_message(dims)}: frames must be \[F, H, W, 3\], got \[4, 8, 8\]"
    ):
        read_video(dims)
    dims4 = tmp_path / "dims4.npy"
    np.save(dims4, np.zeros((2, 4, 8, 8, 1), np.uint8))
    with pytest.raises(ValueError, match=rf"{in_message(dims4)}: a mask must be \[F, H, W\]"):
        read_mask(dims4)

    out_of_range = tmp_path / "float.npy"
    np.save(out_of_range, np.full((2, 4, 4, 3), 1.5, np.float32))
    with pytest.raises(ValueError, match=rf"{in_message(out_of_range)}: float frames must be in \[0, 1\]"):
        read_video(out_of_range)
    negative = tmp_path / "neg.npy"
    np.save(negative, np.full((2, 4, 4), -0.5, np.float32))
    with pytest.raises(ValueError, match=rf"{in_message(negative)}: float frames must be in \[0, 1\]"):
        read_mask(negative)
    ints = tmp_path / "int.npy"
    np.save(ints, np.zeros((2, 4, 4, 3), np.int64))
    with pytest.raises(ValueError, match=f"{in_message(ints)}: frames must be uint8 or float"):
        read_video(ints)

    two = tmp_path / "two.npz"
    np.savez(two, a=np.zeros((1, 4, 4, 3), np.uint8), b=np.zeros((1, 4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match=f"{in_message(two)}: a .npz video must hold one array"):
        read_video(two)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=f"{in_message(empty)}: a frame folder must hold image files"):
        read_video(empty)

    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video at all")
    with pytest.raises(ValueError, match=f"{in_message(broken)}: cannot decode the video"):
        read_video(broken)

    with pytest.raises(ValueError, match="write_array writes .npz files"):
        write_array(torch.zeros(1, 3, 4, 4), tmp_path / "x.npy")


# ----------------------------------------------------------------------------- synthetic editing clips


def _colour_of(clip: torch.Tensor, where: torch.Tensor) -> set[tuple[int, int, int]]:
    """The set of RGB (0..255) values of the pixels of Float[F, 3, H, W] where Bool[F, H, W]."""
    px = (clip.permute(0, 2, 3, 1)[where] * 255).round().long()
    return {tuple(v) for v in px.tolist()}


WHITE = (255, 255, 255)


@pytest.mark.parametrize("kind", EDIT_KINDS)
@pytest.mark.parametrize("seed", range(6))
def test_edit_clip_invariants(kind: str, seed: int) -> None:
    clip = make_edit_clip(random.Random(seed), kind)
    src, tgt, mask = clip.source, clip.target, clip.mask
    assert clip.edit == kind
    assert src.shape == tgt.shape == (FRAMES, 3, SIZE, SIZE) and mask.shape == (FRAMES, SIZE, SIZE)
    assert set(mask.unique().tolist()) <= {0.0, 1.0}
    inside = mask.bool()
    changed = (src != tgt).any(dim=1)
    for t in range(FRAMES):
        # outside the mask the target IS the source, in every frame; the mask covers every changed pixel
        assert torch.equal(src[t][:, ~inside[t]], tgt[t][:, ~inside[t]]), t
        assert not bool((changed[t] & ~inside[t]).any()), t
        assert bool(changed[t].any()), f"frame {t} is not edited"
        # the mask is the changed region dilated by at most the margin: no more than a ring around it
        assert float(inside[t].sum()) <= float(changed[t].sum()) + 4 * (SIZE + 2), t
    # the edited square moves: its pixels are not at the same place in the first and last frame
    assert not torch.equal(changed[0], changed[-1])
    colours = {v: k for k, v in PALETTE.items()}
    if kind == "recolour":
        old = clip.source_caption.removeprefix("a ").removesuffix(" square")
        new = clip.target_caption.removeprefix("a ").removesuffix(" square")
        assert old != new and clip.instruction == f"make the square {new}"
        # the same pixels are coloured (only the colour changes): the source's square, now in the new colour
        src_square = (src != 1).any(dim=1)
        assert torch.equal(src_square, (tgt != 1).any(dim=1))
        assert torch.equal(src_square, changed)
        assert _colour_of(src, src_square) == {PALETTE[old]}
        assert _colour_of(tgt, src_square) == {PALETTE[new]}
        assert _colour_of(src, ~src_square) == _colour_of(tgt, ~src_square) == {WHITE}
    else:
        gone = clip.source_caption.removeprefix("a ").removesuffix(" square")
        keep = clip.target_caption.removeprefix("a ").removesuffix(" square")
        assert clip.instruction == f"remove the {gone} square" and gone != keep
        assert {colours.get(c) for c in _colour_of(src, changed)} == {gone}
        # the moving square is whitened: the target is white wherever the mask is
        assert _colour_of(tgt, inside) == {WHITE}
        # the static square of the other colour stays, unmoved, in every frame of the target
        kept = (tgt != 1).any(dim=1)
        assert _colour_of(tgt, kept) == {PALETTE[keep]}
        assert all(torch.equal(kept[t], kept[0]) for t in range(FRAMES)) and bool(kept[0].any())
        assert not bool((kept & inside).any())


def test_edit_clip_is_seeded_and_rejects_unknown_kinds() -> None:
    a, b = make_edit_clip(random.Random(3)), make_edit_clip(random.Random(3))
    assert (
        torch.equal(a.source, b.source) and torch.equal(a.target, b.target) and a.instruction == b.instruction
    )
    with pytest.raises(ValueError, match="unknown edit 'blur'; one of recolour, remove"):
        make_edit_clip(random.Random(0), "blur")


def test_write_video_edit_dataset_round_trip(tmp_path: Path) -> None:
    paths = write_video_edit_dataset(tmp_path, n_train=4, n_eval=2, seed=7)
    assert paths == {"train": tmp_path / "train.jsonl", "eval": tmp_path / "eval.jsonl"}
    for split, n, seed in (("train", 4, 7), ("eval", 2, 8)):
        rows = [json.loads(x) for x in paths[split].read_text().splitlines()]
        assert len(rows) == n
        rng = random.Random(seed)
        for i, row in enumerate(rows):
            clip = make_edit_clip(rng, EDIT_KINDS[i % 2])  # the same draws, in the same order
            name = f"{split}_{i:03d}"
            assert row == {
                "prompt": clip.instruction,
                "instruction": clip.instruction,
                "edit": EDIT_KINDS[i % 2],
                "source_video": f"clips/{name}.npz",
                "edit_mask": f"masks/{name}.npz",
                "target_video": f"targets/{name}.npz",
                "source_caption": clip.source_caption,
                "target_caption": clip.target_caption,
            }
            # paths are relative to the JSONL's folder, lossless
            torch.testing.assert_close(read_video(tmp_path / row["source_video"]), quantised(clip.source))
            torch.testing.assert_close(read_video(tmp_path / row["target_video"]), quantised(clip.target))
            torch.testing.assert_close(read_mask(tmp_path / row["edit_mask"]), clip.mask, atol=0, rtol=0)


def test_committed_assets_are_what_the_generator_writes(tmp_path: Path) -> None:
    """assets/video_edit/ is reproducible: the default call writes the same rows and the same clips."""
    committed = video_shapes.ASSETS
    assert (committed / "train.jsonl").is_file(), f"missing {committed}/train.jsonl"
    write_video_edit_dataset(tmp_path)
    for split in ("train", "eval"):
        assert (tmp_path / f"{split}.jsonl").read_text() == (committed / f"{split}.jsonl").read_text(), split
        rows = [json.loads(x) for x in (committed / f"{split}.jsonl").read_text().splitlines()]
        for row in rows[:3]:
            for key in ("source_video", "target_video"):
                torch.testing.assert_close(read_video(committed / row[key]), read_video(tmp_path / row[key]))
            torch.testing.assert_close(
                read_mask(committed / row["edit_mask"]), read_mask(tmp_path / row["edit_mask"])
            )
