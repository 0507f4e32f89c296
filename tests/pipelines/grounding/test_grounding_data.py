"""Grounding data: loading/validation of rows, COCO and RefCOCO converters, the command line.

Expected boxes are worked out by hand in the comments (never with the code under test)."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from mmalign.data.rows import DataError
from pipelines.grounding.data import (
    GroundingOptions,
    _read_refs,
    coco_to_rows,
    load_grounding_rows,
    main,
    refcoco_to_rows,
    write_jsonl,
)


def _png(path: Path, w: int, h: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (w, h), (10, 20, 30)).save(path)
    return path


def _jsonl(path: Path, lines: list[Any]) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def _load(path: str, **opts: Any) -> list[dict[str, Any]]:
    return load_grounding_rows(path, "{expression}", GroundingOptions(**opts))


@pytest.fixture
def imgs(tmp_path: Path) -> Path:
    _png(tmp_path / "images" / "wide.png", 200, 100)
    _png(tmp_path / "images" / "sq.png", 64, 64)
    return tmp_path


# ----------------------------------------------------------------------------- valid rows


def test_valid_rows_convert_to_absolute_pixels(imgs: Path) -> None:
    path = _jsonl(
        imgs / "d.jsonl",
        [
            {"image": "images/wide.png", "expression": "a", "boxes": [[10, 5, 30, 25]], "category": "x"},
            # norm1000 on 200x100: x 100/1000*200 = 20, 500/1000*200 = 100; y 200/1000*100 = 20, 80
            {
                "image": "images/wide.png",
                "expression": "b",
                "boxes": [[100, 200, 500, 800]],
                "coords": "norm1000",
            },
            # norm1: x 0.25*200 = 50, 0.75*200 = 150; y 0.5*100 = 50, 1.0*100 = 100; second box 0..0.1 -> 0..20, 0..10
            {
                "images": ["images/wide.png"],
                "expression": "c",
                "boxes": [[0.25, 0.5, 0.75, 1.0], [0, 0, 0.1, 0.1]],
                "coords": "norm1",
            },
            # one box in "box", declared size matching the file
            {
                "image": "images/sq.png",
                "expression": "d",
                "box": [1, 2, 3, 4],
                "image_width": 64,
                "image_height": 64,
            },
        ],
    )
    rows = _load(path)
    assert [r["boxes"] for r in rows] == [
        [[10, 5, 30, 25]],
        [[20, 20, 100, 80]],
        [[50, 50, 150, 100], [0, 0, 20, 10]],
        [[1, 2, 3, 4]],
    ]
    for r, line in zip(rows, range(1, 5)):
        assert r["box"] == r["boxes"][0]
        assert r["coords"] == "absolute"
        assert r["_source"] == f"{path}:{line}"
        assert len(r["images"]) == 1 and Path(r["images"][0]).is_absolute() and Path(r["images"][0]).is_file()
        assert "image" not in r
        assert r["prompt"] == r["expression"]
    assert (rows[0]["image_width"], rows[0]["image_height"]) == (200, 100)
    assert (rows[3]["image_width"], rows[3]["image_height"]) == (64, 64)
    assert isinstance(rows[0]["image_width"], int)
    assert rows[0]["category"] == "x"  # other columns are kept


def test_box_within_tolerance_is_clipped(imgs: Path) -> None:
    path = _jsonl(
        imgs / "d.jsonl", [{"image": "images/sq.png", "expression": "a", "boxes": [[-0.5, 0, 64.8, 10]]}]
    )
    assert _load(path)[0]["boxes"] == [[0, 0, 64, 10]]
    with pytest.raises(DataError, match="outside the 64x64 image"):
        _load(path, box_tolerance=0.5)
    assert _load(path, box_tolerance=2.0)[0]["boxes"] == [[0, 0, 64, 10]]


def test_image_root_option(tmp_path: Path) -> None:
    _png(tmp_path / "pics" / "a.png", 8, 8)
    (tmp_path / "data").mkdir()
    path = _jsonl(
        tmp_path / "data" / "d.jsonl", [{"image": "a.png", "expression": "x", "boxes": [[0, 0, 4, 4]]}]
    )
    rows = _load(path, image_root=str(tmp_path / "pics"))
    assert rows[0]["images"] == [str((tmp_path / "pics" / "a.png").resolve())]


# ----------------------------------------------------------------------------- errors name file:line


GOOD = {"image": "images/sq.png", "expression": "ok", "boxes": [[0, 0, 8, 8]]}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            {"image": "images/sq.png", "expression": "a", "boxes": [[0, 0, 70, 10]]},
            r"box \[0, 0, 70, 10\] lies outside the 64x64 image",
        ),
        (
            {"image": "images/sq.png", "expression": "a", "boxes": [[-5, 0, 10, 10]]},
            "lies outside the 64x64 image",
        ),
        # norm1000 1100 of 64 px = 70.4 px
        (
            {"image": "images/sq.png", "expression": "a", "boxes": [[0, 0, 1100, 10]], "coords": "norm1000"},
            "lies outside the 64x64 image",
        ),
        ({"image": "images/sq.png", "expression": "a", "boxes": [[10, 10, 10, 20]]}, "degenerate"),
        (
            {"image": "images/sq.png", "expression": "a", "boxes": [[30, 10, 20, 20]]},
            "degenerate or reversed",
        ),
        ({"image": "images/sq.png", "expression": "a", "boxes": [[0, 0, 8]]}, "4 numbers"),
        ({"image": "images/sq.png", "expression": "a", "boxes": [[0, 0, "8", 8]]}, "4 numbers"),
        ({"image": "images/sq.png", "expression": "a", "boxes": [[0, 0, 8, float("nan")]]}, "non-finite"),
        ({"image": "images/sq.png", "expression": "a", "boxes": [0, 0, 8, 8]}, "single box"),
        ({"image": "images/sq.png", "expression": "a", "boxes": []}, "non-empty list"),
        ({"image": "images/sq.png", "expression": "a"}, "no 'boxes'"),
        ({"image": "images/nope.png", "expression": "a", "boxes": [[0, 0, 8, 8]]}, "image file not found"),
        (
            {"images": ["images/sq.png", "images/wide.png"], "expression": "a", "boxes": [[0, 0, 8, 8]]},
            "exactly one image",
        ),
        ({"expression": "a", "boxes": [[0, 0, 8, 8]]}, "no 'images'"),
        (
            {"image": "images/sq.png", "expression": "a", "boxes": [[0, 0, 8, 8]], "coords": "pixels"},
            "unknown coords 'pixels'; the data may write boxes as one of absolute, norm1000, norm1",
        ),
        (
            {"image": "images/sq.png", "expression": "a", "boxes": [[0, 0, 8, 8]], "image_width": 32},
            "image_width=32 does not match the image file \\(64x64",
        ),
        (
            {"image": "images/sq.png", "expression": "a", "boxes": [[0, 0, 8, 8]], "image_height": 0},
            "positive whole number",
        ),
        (
            {"image": "images/sq.png", "expression": "a", "boxes": [[0, 0, 8, 8]], "box": [1, 1, 8, 8]},
            "differs from boxes\\[0\\]",
        ),
        ({"image": "images/sq.png", "boxes": [[0, 0, 8, 8]]}, "data.prompt_template"),
        ("{not json", "invalid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_errors_name_file_and_line(imgs: Path, bad: Any, message: str) -> None:
    path = _jsonl(imgs / "d.jsonl", [GOOD, bad, GOOD])
    with pytest.raises(DataError, match=message) as info:
        _load(path)
    assert str(info.value).startswith(f"{path}:2: ")


def test_unreadable_image_is_an_error(imgs: Path) -> None:
    (imgs / "images" / "broken.png").write_bytes(b"not a png")
    path = _jsonl(
        imgs / "d.jsonl", [{"image": "images/broken.png", "expression": "a", "boxes": [[0, 0, 1, 1]]}]
    )
    with pytest.raises(DataError, match=f"{path}:1: cannot read image"):
        _load(path)


def test_no_rows_left_is_an_error(imgs: Path) -> None:
    path = _jsonl(
        imgs / "d.jsonl", [{"image": "images/nope.png", "expression": "a", "boxes": [[0, 0, 1, 1]]}]
    )
    with pytest.raises(DataError, match="no usable rows"):
        _load(path, on_bad_row="skip")


# ----------------------------------------------------------------------------- skip mode


def test_skip_mode_counts_and_logs(imgs: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _jsonl(
        imgs / "d.jsonl",
        [
            GOOD,
            {"image": "images/sq.png", "expression": "a", "boxes": [[0, 0, 70, 10]]},  # outside
            "{not json",
            {"image": "images/nope.png", "expression": "a", "boxes": [[0, 0, 8, 8]]},  # missing image
            {"image": "images/sq.png", "expression": "a", "boxes": [[5, 5, 5, 9]]},  # degenerate
            GOOD,
        ],
    )
    with caplog.at_level(logging.WARNING):
        rows = _load(path, on_bad_row="skip")
    assert [r["_source"] for r in rows] == [f"{path}:1", f"{path}:6"]
    per_row = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping a bad row")]
    assert len(per_row) == 4
    for line in (2, 3, 4, 5):
        assert sum(f"{path}:{line}" in m for m in per_row) == 1
    summary = [r.getMessage() for r in caplog.records if "skipped 4 of 6 rows" in r.getMessage()]
    assert len(summary) == 1
    for reason in ("box outside image: 1", "missing image: 1", "degenerate box: 1", "unreadable line"):
        assert reason in summary[0]


# ----------------------------------------------------------------------------- options


def test_grounding_options() -> None:
    opts = GroundingOptions()
    assert (opts.box_tolerance, opts.coords, opts.on_bad_row) == (1.0, "absolute", "error")
    assert GroundingOptions(coords="qwen2_5_vl").convention == "resized"
    assert GroundingOptions(coords="qwen2_vl").convention == "norm1000"
    assert GroundingOptions(coords="norm1").convention == "norm1"
    with pytest.raises(ValueError, match="pixelz"):
        GroundingOptions(coords="pixelz")
    with pytest.raises(ValueError, match="box_tolerance"):
        GroundingOptions(box_tolerance=-1)


def test_module_registers_no_pipeline() -> None:
    import pipelines
    import pipelines.grounding.data  # noqa: F401

    assert "grounding" not in pipelines.REGISTRY


# ----------------------------------------------------------------------------- COCO


def _instances() -> dict[str, Any]:
    return {
        "images": [
            {"id": 1, "file_name": "a.png", "width": 64, "height": 48},
            {"id": 2, "file_name": "b.png", "width": 32, "height": 32},
        ],
        "categories": [
            {"id": 1, "name": "cat", "supercategory": "animal"},
            {"id": 2, "name": "dog", "supercategory": "animal"},
        ],
        "annotations": [
            {
                "id": 10,
                "image_id": 1,
                "category_id": 1,
                "bbox": [2, 3, 10, 20],
                "iscrowd": 0,
            },  # -> [2, 3, 12, 23]
            {"id": 11, "image_id": 1, "category_id": 1, "bbox": [30.5, 4, 5.5, 6]},  # -> [30.5, 4, 36, 10]
            {
                "id": 12,
                "image_id": 1,
                "category_id": 2,
                "bbox": [0, 0, 64, 48],
                "iscrowd": 1,
            },  # crowd: skipped
            {"id": 13, "image_id": 2, "category_id": 2, "bbox": [1, 1, 2, 2]},  # -> [1, 1, 3, 3]
            {"id": 14, "image_id": 2, "category_id": 1, "bbox": [1, 1, 0, 2]},  # zero width: skipped
        ],
    }


def test_coco_per_annotation() -> None:
    rows = coco_to_rows(_instances())
    assert rows.stats == {"skipped_crowd": 1, "skipped_empty_box": 1}
    assert rows == [
        {
            "image": "a.png",
            "image_width": 64,
            "image_height": 48,
            "expression": "the cat",
            "boxes": [[2, 3, 12, 23]],
            "coords": "absolute",
            "image_id": 1,
            "category": "cat",
            "ann_id": 10,
        },
        {
            "image": "a.png",
            "image_width": 64,
            "image_height": 48,
            "expression": "the cat",
            "boxes": [[30.5, 4, 36, 10]],
            "coords": "absolute",
            "image_id": 1,
            "category": "cat",
            "ann_id": 11,
        },
        {
            "image": "b.png",
            "image_width": 32,
            "image_height": 32,
            "expression": "the dog",
            "boxes": [[1, 1, 3, 3]],
            "coords": "absolute",
            "image_id": 2,
            "category": "dog",
            "ann_id": 13,
        },
    ]


def test_coco_per_category_and_expression(tmp_path: Path) -> None:
    path = tmp_path / "inst.json"
    path.write_text(json.dumps(_instances()))
    rows = coco_to_rows(path, "imgs", per="category", expression="every {category} ({supercategory})")
    assert [(r["image"], r["category"], r["boxes"], r["ann_ids"]) for r in rows] == [
        (str(Path("imgs") / "a.png"), "cat", [[2, 3, 12, 23], [30.5, 4, 36, 10]], [10, 11]),
        (str(Path("imgs") / "b.png"), "dog", [[1, 1, 3, 3]], [13]),
    ]
    assert rows[0]["expression"] == "every cat (animal)"
    with pytest.raises(ValueError, match="per must be"):
        coco_to_rows(path, per="image")


def test_coco_bad_input(tmp_path: Path) -> None:
    inst = _instances()
    inst["annotations"].append({"id": 99, "image_id": 7, "category_id": 1, "bbox": [0, 0, 1, 1]})
    with pytest.raises(DataError, match="annotation 99: image_id 7"):
        coco_to_rows(inst)
    with pytest.raises(DataError, match="needs a list 'images'"):
        coco_to_rows({"annotations": []})
    bad = tmp_path / "bad.json"
    bad.write_text('{"images": [\n oops')
    with pytest.raises(DataError, match=f"{bad}:2: invalid JSON"):
        coco_to_rows(bad)


def test_converted_rows_load(tmp_path: Path) -> None:
    _png(tmp_path / "a.png", 64, 48)
    _png(tmp_path / "b.png", 32, 32)
    out = tmp_path / "out.jsonl"
    assert write_jsonl(coco_to_rows(_instances(), per="category"), out) == 2
    rows = _load(str(out))
    assert [r["boxes"] for r in rows] == [[[2, 3, 12, 23], [30.5, 4, 36, 10]], [[1, 1, 3, 3]]]
    assert [r["prompt"] for r in rows] == ["the cat", "the dog"]


# ----------------------------------------------------------------------------- RefCOCO


def _refs() -> list[dict[str, Any]]:
    return [
        {
            "ref_id": 0,
            "ann_id": 10,
            "image_id": 1,
            "split": "train",
            "category_id": 1,
            "sentences": [{"sent": "left cat", "sent_id": 0}, {"raw": "The Cat.", "sent_id": 1}],
        },
        {
            "ref_id": 1,
            "ann_id": 13,
            "image_id": 2,
            "split": "val",
            "sentences": [{"sent": "small dog", "raw": "Small dog"}],
        },
        {"ref_id": 2, "ann_id": 11, "image_id": 1, "split": "testA", "sentences": []},
    ]


def test_refcoco_rows() -> None:
    rows = refcoco_to_rows(_refs(), _instances())
    assert [
        (r["expression"], r["boxes"], r["split"], r["ref_id"], r["ann_id"], r["category"]) for r in rows
    ] == [
        ("left cat", [[2, 3, 12, 23]], "train", 0, 10, "cat"),
        ("The Cat.", [[2, 3, 12, 23]], "train", 0, 10, "cat"),
        ("small dog", [[1, 1, 3, 3]], "val", 1, 13, "dog"),
    ]
    assert rows.stats["skipped_no_sentence"] == 1
    assert all(r["coords"] == "absolute" and r["image"] in ("a.png", "b.png") for r in rows)
    assert rows[0]["image_width"] == 64 and rows[2]["image_height"] == 32
    val = refcoco_to_rows(_refs(), _instances(), split="val")
    assert [(r["expression"], r["image"], r["boxes"]) for r in val] == [
        ("small dog", "b.png", [[1, 1, 3, 3]])
    ]
    assert val.stats["skipped_split"] == 2


def test_refcoco_unknown_annotation() -> None:
    refs = [{"ref_id": 5, "ann_id": 404, "image_id": 1, "split": "val", "sentences": [{"sent": "x"}]}]
    with pytest.raises(DataError, match="ref 5: ann_id 404"):
        refcoco_to_rows(refs, _instances())


def test_refcoco_pickle_needs_allow_pickle(tmp_path: Path) -> None:
    path = tmp_path / "refs(unc).p"
    path.write_bytes(pickle.dumps(_refs()))
    with pytest.raises(DataError, match="allow_pickle=True.*--allow-pickle"):
        refcoco_to_rows(path, _instances())
    rows = refcoco_to_rows(path, _instances(), allow_pickle=True)
    assert len(rows) == 3
    # a pickle is also recognised by its content, whatever the name
    disguised = tmp_path / "refs.json"
    disguised.write_bytes(pickle.dumps(_refs(), protocol=2))
    with pytest.raises(DataError, match="is a Python pickle"):
        refcoco_to_rows(disguised, _instances())


def test_python2_pickle_text_is_decoded(tmp_path: Path) -> None:
    # protocol 2, [{"sent": <py2 str b"caf\xc3\xa9">}] as Python 2 writes it (SHORT_BINSTRING 'U')
    raw = b"\x80\x02]q\x00}q\x01U\x04sentq\x02U\x05caf\xc3\xa9q\x03sa."
    path = tmp_path / "refs.p"
    path.write_bytes(raw)
    refs, _ = _read_refs(path, allow_pickle=True)
    assert refs == [{"sent": "caf\u00e9"}]


# ----------------------------------------------------------------------------- command line


def test_cli_convert_then_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _png(tmp_path / "a.png", 64, 48)
    _png(tmp_path / "b.png", 32, 32)
    inst = tmp_path / "instances.json"
    inst.write_text(json.dumps(_instances()))
    out = tmp_path / "coco.jsonl"
    assert main(["convert", "coco", str(inst), str(out), "--per", "category"]) == 0
    printed = capsys.readouterr().out
    assert "2 rows" in printed and "2 images" in printed and "skipped crowd: 1" in printed
    assert main(["check", str(out)]) == 0
    assert "2 rows OK" in capsys.readouterr().out

    refs = tmp_path / "refs.p"
    refs.write_bytes(pickle.dumps(_refs()))
    ref_out = tmp_path / "ref.jsonl"
    assert main(["convert", "refcoco", str(refs), str(inst), str(ref_out)]) == 1
    assert "--allow-pickle" in capsys.readouterr().err
    assert (
        main(["convert", "refcoco", str(refs), str(inst), str(ref_out), "--allow-pickle", "--split", "train"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "2 rows" in printed and "per split: train 2" in printed
    assert main(["check", str(ref_out)]) == 0
    assert "2 rows OK" in capsys.readouterr().out

    bad = tmp_path / "bad.jsonl"
    _jsonl(
        bad,
        [
            {"image": "a.png", "expression": "x", "boxes": [[0, 0, 99, 10]]},
            {"image": "a.png", "expression": "y", "boxes": [[0, 0, 9, 9]]},
        ],
    )
    assert main(["check", str(bad)]) == 1
    assert f"{bad}:1: box [0, 0, 99, 10] lies outside the 64x48 image" in capsys.readouterr().err
    assert main(["check", str(bad), "--skip-bad"]) == 0
    assert "1 rows OK" in capsys.readouterr().out
    # the same through the mmalign command line
    from mmalign.app.cli import main as mmalign_main

    assert mmalign_main(["grounding", "check", str(bad), "--skip-bad"]) == 0
    assert "1 rows OK" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        mmalign_main(["grounding", "--help"])
    assert "usage: mmalign grounding" in capsys.readouterr().out
