"""pipelines.common's row loaders with ``options.on_bad_row: skip`` (issue 33): a line over
`mmalign.data.rows.MAX_LINE_BYTES` and a row whose image does not decode are skipped, each named."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from PIL import Image

from mmalign.data.rows import DataError
from pipelines.common import VLMOptions, image_files, image_problem, load_rows_skipping, load_vlm_rows


def picture(path: Path, truncated: bool = False) -> str:
    """A 32x32 PNG of noise (incompressible, so half of it holds no complete image); its name."""
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray((np.random.default_rng(0).random((32, 32, 3)) * 255).astype("uint8")).save(path)
    if truncated:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path.name


def test_skipping_reader_skips_an_over_long_line_naming_it(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("mmalign.data.rows.MAX_LINE_BYTES", 64)
    path = tmp_path / "d.jsonl"
    long = json.dumps({"question": "x" * 100})
    path.write_text(f'{{"question": "a"}}\n{long}\n{{"question": "b"}}\n')
    with caplog.at_level(logging.WARNING, logger="pipelines.common"):
        rows = load_rows_skipping(str(path), "{question}", None)
    assert [r["prompt"] for r in rows] == ["a", "b"] and rows.skipped == 1  # type: ignore[attr-defined]
    assert any(f"{path}:2: line longer than 64 bytes" in r.getMessage() for r in caplog.records)


def test_vlm_rows_with_an_image_that_does_not_decode_error_or_skip(tmp_path, caplog):
    bad = picture(tmp_path / "img" / "bad.png", truncated=True)
    good = picture(tmp_path / "img" / "good.png")
    path = tmp_path / "d.jsonl"
    path.write_text(
        "".join(json.dumps({"images": [f"img/{n}"], "question": "Colour?"}) + "\n" for n in (good, bad, good))
    )
    rows = load_vlm_rows(str(path), "{question}", VLMOptions())  # error mode: the validation pass decodes
    assert len(rows) == 3
    with caplog.at_level(logging.WARNING, logger="pipelines.common"):
        rows = load_vlm_rows(str(path), "{question}", VLMOptions(on_bad_row="skip"))
    assert [r["_source"] for r in rows] == [f"{path}:1", f"{path}:3"]
    warned = [r.getMessage() for r in caplog.records if "skipping a bad row" in r.getMessage()]
    assert len(warned) == 1 and f"{path}:2: image {tmp_path / 'img' / bad} cannot be decoded" in warned[0]
    only_bad = tmp_path / "bad.jsonl"
    only_bad.write_text(json.dumps({"images": [f"img/{bad}"], "question": "Colour?"}) + "\n")
    with pytest.raises(DataError, match="no usable rows"):
        load_vlm_rows(str(only_bad), "{question}", VLMOptions(on_bad_row="skip"))


def test_image_files_and_image_problem(tmp_path):
    good = tmp_path / picture(tmp_path / "a.png")
    bad = tmp_path / picture(tmp_path / "b.png", truncated=True)
    for other in ("clip.mp4", "first.npz"):
        (tmp_path / other).write_bytes(b"")
    row = {"images": ["a.png", "a.png", "missing.png", "first.npz"], "image": "b.png", "video": "clip.mp4"}
    assert image_files(row, tmp_path) == [str(good), str(bad)]  # each once; no video, .npz or missing file
    assert image_problem(good) is None
    assert image_problem(bad) == "OSError: image file is truncated"
    assert (image_problem(tmp_path / "clip.mp4") or "").startswith("UnidentifiedImageError")
