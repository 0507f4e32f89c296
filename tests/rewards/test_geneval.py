"""GenEval's rules (`rewards.geneval`), hand-worked; the in-process reward with the stand-in detector; the
``geneval`` client against a GenEval server on 127.0.0.1 (`rewards.remote.serve_reward` and the one command
``python -m rewards.geneval_server``)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import rewards
from rewards.base import RewardBatch, load_reward
from rewards.geneval import (
    COLORS,
    BlobDetector,
    ClipColourClassifier,
    Detection,
    GenEvalLocal,
    MeanColourClassifier,
    evaluate_correct,
    evaluate_score,
    geneval_iou,
    parse_metadata,
    relative_position,
    select_detections,
)
from rewards.geneval_server import build_remote_argv

ROOT = Path(__file__).resolve().parents[2]


def det(cls: str, box: tuple[float, float, float, float], score: float = 1.0) -> Detection:
    return Detection(cls, score, box)


class Scripted:
    """A colour classifier answering from a table keyed by box; records what it was asked."""

    def __init__(self, colours: dict[tuple[float, ...], str]) -> None:
        self.colours = colours
        self.asked: list[int] = []

    def __call__(self, image: Any, detections: list[Detection], classname: str) -> list[str]:
        self.asked.append(len(detections))
        return [self.colours[d.box] for d in detections]


# ----------------------------------------------------------------------------- geometry
@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        # offset (-30, 0); x shrinks by 0.1 * (10 + 10) = 2 -> -28; dx = -28 / 30 = -0.93
        ((0, 0, 10, 10), (30, 0, 40, 10), {"left of"}),
        ((30, 0, 40, 10), (0, 0, 10, 10), {"right of"}),
        # offset (-20, -20) -> (-18, -18); / 28.28 = -0.64 on both axes
        ((0, 0, 10, 10), (20, 20, 30, 30), {"left of", "above"}),
        # offset (-10, -25) -> (-8, -23); / 26.93: dx = -0.30 (no relation), dy = -0.85
        ((0, 0, 10, 10), (10, 25, 20, 35), {"above"}),
        ((10, 25, 20, 35), (0, 0, 10, 10), {"below"}),
        # offset (-1, 0) shrinks to 0: no relation
        ((0, 0, 10, 10), (1, 0, 11, 10), set()),
    ],
)
def test_relative_position_hand_worked(a: tuple, b: tuple, expected: set[str]) -> None:
    assert relative_position(a, b) == expected


def test_position_threshold_widens_the_dead_zone() -> None:
    # offset (-12, 0): shrink 0.1 * 20 = 2 -> dx = -10/12 (left of); with 0.6: shrink 12 -> nothing
    assert relative_position((0, 0, 10, 10), (12, 0, 22, 10)) == {"left of"}
    assert relative_position((0, 0, 10, 10), (12, 0, 22, 10), position_threshold=0.6) == set()


def test_geneval_iou_counts_inclusive_pixels() -> None:
    # 10 x 10 boxes (0..9) sharing 5 x 5 pixels: 25 / (100 + 100 - 25)
    assert geneval_iou((0, 0, 9, 9), (5, 5, 14, 14)) == pytest.approx(25 / 175)
    assert geneval_iou((0, 0, 9, 9), (0, 0, 9, 4)) == pytest.approx(50 / 100)
    assert geneval_iou((0, 0, 1, 1), (5, 5, 6, 6)) == 0.0


def test_select_detections_thresholds_order_cap_and_suppression() -> None:
    dets = [
        det("dog", (0, 0, 9, 9), 0.5),
        det("dog", (20, 0, 29, 9), 0.95),
        det("dog", (40, 0, 49, 9), 0.2),
        det("dog", (0, 0, 9, 4), 0.31),
        det("cat", (0, 0, 5, 5), 0.1),
    ]
    kept = select_detections(dets, "two_object")
    assert [d.score for d in kept["dog"]] == [0.95, 0.5, 0.31] and "cat" not in kept  # > 0.3, best first
    assert [d.score for d in select_detections(dets, "counting")["dog"]] == [0.95]  # > 0.9 for counting
    assert [d.score for d in select_detections(dets, "two_object", max_objects=2)["dog"]] == [0.95, 0.5]
    # (0,0,9,4) overlaps (0,0,9,9) by IoU 0.5: dropped when max_overlap <= 0.5, kept above
    assert [d.score for d in select_detections(dets, "x", max_overlap=0.5)["dog"]] == [0.95, 0.5]
    assert [d.score for d in select_detections(dets, "x", max_overlap=0.6)["dog"]] == [0.95, 0.5, 0.31]


# ----------------------------------------------------------------------------- verdicts and scores
CAT_L, DOG_R = (0, 0, 10, 10), (30, 0, 40, 10)
POSITION = {
    "tag": "position",
    "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}],
}


def test_counts_are_at_least_for_geneval_and_exact_for_strict() -> None:
    meta = {"include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}]}
    detected = {"cat": [det("cat", CAT_L)], "dog": [det("dog", DOG_R), det("dog", (50, 0, 60, 10))]}
    assert evaluate_correct(None, detected, meta, Scripted({}))[0] is True  # 2 dogs >= 1
    strict, score, _ = evaluate_score(None, detected, meta, Scripted({}))
    assert strict is False and score == pytest.approx((1.0 + (1 - 1 / 1)) / 2)  # dog term 1 - |1 - 2| / 1 = 0
    ok, reason = evaluate_correct(None, detected, {"include": [{"class": "dog", "count": 3}]}, Scripted({}))
    assert ok is False and reason == "expected dog>=3, found 2"
    # count 1 with 3 found: the term goes negative, 1 - 2 / 1 = -1
    three = {"cat": [det("cat", (i, 0, i + 5, 5)) for i in (0, 10, 20)]}
    assert evaluate_score(None, three, {"include": [{"class": "cat", "count": 1}]}, Scripted({}))[1] == -1.0


def test_colour_uses_the_count_most_confident_boxes() -> None:
    meta = {"include": [{"class": "car", "count": 2, "color": "red"}]}
    boxes = [(0, 0, 5, 5), (10, 0, 15, 5), (20, 0, 25, 5)]
    colours = Scripted(dict(zip(boxes, ["red", "blue", "red"], strict=True)))
    detected = {"car": [det("car", b) for b in boxes]}
    assert evaluate_correct(None, detected, meta, colours)[0] is False  # first two: red, blue
    assert colours.asked == [2]
    # strict scoring: 3 cars for 2 -> count term 1 - 1/2 and a 0 for the unchecked colour: 0.25
    assert evaluate_score(None, detected, meta, colours)[:2] == (False, pytest.approx(0.25))
    two = {"car": [det("car", b) for b in boxes[:2]]}
    assert evaluate_score(None, two, meta, colours)[:2] == (False, pytest.approx((1.0 + (1 - 1 / 2)) / 2))
    all_red = Scripted(dict.fromkeys(boxes, "red"))
    assert evaluate_correct(None, two, meta, all_red)[0] is True
    assert evaluate_score(None, two, meta, all_red)[:2] == (True, 1.0)


def test_position_against_the_target_clause() -> None:
    good = {"dog": [det("dog", DOG_R)], "cat": [det("cat", CAT_L)]}
    bad = {"dog": [det("dog", CAT_L)], "cat": [det("cat", DOG_R)]}
    assert evaluate_correct(None, good, POSITION, Scripted({}))[0] is True
    ok, reason = evaluate_correct(None, bad, POSITION, Scripted({}))
    assert ok is False and reason == "expected cat left of target"
    assert evaluate_score(None, good, POSITION, Scripted({}))[:2] == (True, 1.0)
    # Flow-GRPO's terms for the failed position: dog 1, cat 1, position 0, and its unconditional 1: 3/4
    assert evaluate_score(None, bad, POSITION, Scripted({}))[:2] == (False, 0.75)


def test_position_without_a_matched_target() -> None:
    meta = {
        "include": [{"class": "dog", "count": 2}, {"class": "cat", "count": 1, "position": ["left of", 0]}]
    }
    detected = {"dog": [det("dog", DOG_R)], "cat": [det("cat", CAT_L)]}
    ok, reason = evaluate_correct(None, detected, meta, Scripted({}))
    assert ok is False and reason.splitlines() == [
        "expected dog>=2, found 1",
        "no target for cat to be left of",
    ]
    # terms: dog 1 - 1/2, cat 1, position 0 -> 0.5
    assert evaluate_score(None, detected, meta, Scripted({}))[:2] == (False, pytest.approx(0.5))


def test_exclude_clause_only_in_the_geneval_verdict() -> None:
    meta = {
        "tag": "counting",
        "include": [{"class": "cat", "count": 1}],
        "exclude": [{"class": "cat", "count": 2}],
    }
    two_cats = {"cat": [det("cat", CAT_L), det("cat", DOG_R)]}
    ok, reason = evaluate_correct(None, two_cats, meta, Scripted({}))
    assert ok is False and reason == "expected cat<2, found 2"
    assert evaluate_correct(None, {"cat": [det("cat", CAT_L)]}, meta, Scripted({}))[0] is True


def test_parse_metadata() -> None:
    assert parse_metadata(json.dumps(POSITION), "row 0") == POSITION
    with pytest.raises(ValueError, match="row 3: a clause needs a 'class' name and a 'count' >= 1"):
        parse_metadata({"include": [{"class": "cat", "count": 0}]}, "row 3")
    with pytest.raises(ValueError, match="colour 'teal' is not one of GenEval's"):
        parse_metadata({"include": [{"class": "cat", "count": 1, "color": "teal"}]}, "row 0")
    with pytest.raises(ValueError, match="not JSON"):
        parse_metadata("{oops", "row 0")


# ----------------------------------------------------------------------------- stand-ins and the reward
WHITE, RED, GREEN, YELLOW = (255, 255, 255), (255, 0, 0), (0, 128, 0), (255, 255, 0)
BLOBS = {"classes": {"apple": [list(RED), list(GREEN)], "banana": [list(YELLOW)]}}


def scene(*rects: tuple[tuple[int, int, int, int], tuple[int, int, int]], size: int = 64) -> torch.Tensor:
    arr = np.full((size, size, 3), WHITE, dtype=np.uint8)
    for (x0, y0, x1, y1), rgb in rects:
        arr[y0:y1, x0:x1] = rgb
    return torch.from_numpy(arr).permute(2, 0, 1).float() / 255.0


def test_blob_detector_and_mean_colour() -> None:
    image = Image.fromarray(
        (
            scene(((4, 20, 14, 30), RED), ((40, 20, 50, 30), YELLOW), ((20, 40, 22, 42), RED))
            .permute(1, 2, 0)
            .numpy()
            * 255
        ).astype(np.uint8)
    )
    (dets,) = BlobDetector(BLOBS["classes"])([image])
    assert [(d.cls, d.box) for d in dets] == [
        ("apple", (4.0, 20.0, 14.0, 30.0)),
        ("banana", (40.0, 20.0, 50.0, 30.0)),
    ]  # 4-pixel blob dropped
    assert dets[0].mask.sum() == 100
    assert MeanColourClassifier()(image, dets, "apple") == ["red", "yellow"]


def local(**options: Any) -> GenEvalLocal:
    return load_reward(
        "geneval_local", detector="blobs", detector_kwargs=BLOBS, colour_classifier="mean_rgb", **options
    )  # type: ignore[return-value]


def scenes_batch() -> RewardBatch:
    images = torch.stack(
        [
            scene(((4, 20, 14, 30), RED), ((40, 20, 50, 30), YELLOW)),  # red apple left of a banana
            scene(((4, 20, 14, 30), RED)),  # a red apple
            scene(((4, 20, 14, 30), GREEN), ((30, 20, 40, 30), GREEN)),  # two green apples
        ]
    )
    metadata = [
        {
            "tag": "position",
            "include": [
                {"class": "apple", "count": 1},
                {"class": "banana", "count": 1, "position": ["right of", 0]},
            ],
        },
        json.dumps({"tag": "color_attr", "include": [{"class": "apple", "count": 1, "color": "green"}]}),
        {
            "tag": "counting",
            "include": [{"class": "apple", "count": 3}],
            "exclude": [{"class": "apple", "count": 4}],
        },
    ]
    return RewardBatch(prompts=["a", "b", "c"], outputs={"images": images}, columns={"metadata": metadata})


# scene 0: every check holds; scene 1: count 1, colour red for green -> terms (1, 0) = 0.5;
# scene 2: 2 apples for 3 -> term 1 - 1/3
EXPECTED = {"score": [1.0, 0.5, 2 / 3], "strict": [1.0, 0.0, 0.0], "correct": [1.0, 0.0, 0.0]}


@pytest.mark.parametrize("mode", ["score", "strict", "correct"])
def test_geneval_local_end_to_end(mode: str) -> None:
    reward = local(mode=mode)
    assert reward(scenes_batch()).tolist() == pytest.approx(EXPECTED[mode])
    assert reward.last_metrics["score"] == pytest.approx(sum(EXPECTED["score"]) / 3)


def test_geneval_local_errors_name_the_row_and_column() -> None:
    batch = scenes_batch()
    batch.columns["metadata"][1] = {"include": [{"class": "apple"}]}
    with pytest.raises(ValueError, match=r"row 1 of column 'metadata': a clause needs"):
        local()(batch)
    with pytest.raises(KeyError, match="column 'meta'"):
        local(metadata_column="meta")(scenes_batch())
    with pytest.raises(ValueError, match="detector must be one of"):
        load_reward("geneval_local", detector="yolo", colour_classifier="mean_rgb")


def test_geneval_client_against_a_server() -> None:
    from rewards.remote import serve_reward

    with serve_reward(local()) as server:
        batch = scenes_batch()
        batch.columns["metadata"].append(None)  # a row without metadata: NaN, not sent
        batch.outputs["images"] = torch.cat([batch.outputs["images"], torch.zeros(1, 3, 64, 64)])
        batch.prompts.append("d")
        for mode in ("score", "correct"):
            reward = load_reward("geneval", url=server.url, mode=mode)
            out = reward(batch)
            assert out[:3].tolist() == pytest.approx(EXPECTED[mode]) and math.isnan(out[3].item())
            assert reward.last_metrics["strict"] == pytest.approx(1 / 3)


def test_server_command_arguments() -> None:
    argv = build_remote_argv(
        [
            "--detector",
            "blobs",
            "--detector-kwargs",
            json.dumps(BLOBS),
            "--colour-classifier",
            "mean_rgb",
            "--port",
            "0",
            "--token-env",
            "T",
        ]
    )
    assert argv[:2] == ["--reward", "geneval_local"] and argv[4:] == ["--port", "0", "--token-env", "T"]
    options = json.loads(argv[3])
    assert options["detector_kwargs"] == BLOBS and options["counting_threshold"] == 0.9
    local(
        **{k: v for k, v in options.items() if k not in ("detector", "detector_kwargs", "colour_classifier")}
    )
    with pytest.raises(SystemExit):
        build_remote_argv(["--detector-kwargs", "[1]"])


@pytest.mark.slow
def test_one_command_server(tmp_path: Path) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    cmd = [
        sys.executable,
        "-m",
        "rewards.geneval_server",
        "--detector",
        "blobs",
        "--detector-kwargs",
        json.dumps(BLOBS),
        "--colour-classifier",
        "mean_rgb",
        "--port",
        str(port),
        "--quiet",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert "serving reward 'geneval_local'" in line, line
        reward = load_reward("geneval", url=f"http://127.0.0.1:{port}/", retry_backoff_s=0.2)
        assert reward(scenes_batch()).tolist() == pytest.approx(EXPECTED["score"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ----------------------------------------------------------------------------- CLIP colours
@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import CLIPConfig, CLIPModel

    from mmalign.tiny import train_bpe_tokenizer

    texts = [t.format(c=c, cls="apple") for c in COLORS for t in ClipColourClassifier.TEMPLATES]
    tok = train_bpe_tokenizer(texts * 2, vocab_size=200)
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            max_position_embeddings=77,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
        ),
        projection_dim=16,
    )
    path = tmp_path_factory.mktemp("clip") / "tiny-clip"
    CLIPModel(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_clip_colour_weights_and_crops(tiny_clip: Path) -> None:
    from transformers import AutoTokenizer, CLIPModel

    clf = ClipColourClassifier(str(tiny_clip))
    model, tok = CLIPModel.from_pretrained(tiny_clip).eval(), AutoTokenizer.from_pretrained(tiny_clip)
    expected = []
    for c in COLORS:  # mean of the normalised template embeddings, normalised again (clip_benchmark's rule)
        rows = []
        for t in (f"a photo of a {c} apple", f"a photo of a {c}-colored apple", f"a photo of a {c} object"):
            ids = tok([t], return_tensors="pt")
            with torch.no_grad():
                f = model.get_text_features(**ids)
            f = f if isinstance(f, torch.Tensor) else f.pooler_output
            rows.append(f[0] / f[0].norm())
        m = torch.stack(rows).mean(0)
        expected.append(m / m.norm())
    assert torch.allclose(clf.weights("apple"), torch.stack(expected), atol=1e-5)
    arr = np.zeros((16, 16, 3), dtype=np.uint8)
    arr[:, :] = (255, 0, 0)
    mask = np.zeros((16, 16), dtype=bool)
    mask[4:8, 4:8] = True
    (crop,) = clf.crops(Image.fromarray(arr), [Detection("apple", 1.0, (2, 2, 10, 10), mask)])
    crop_arr = np.asarray(crop)
    assert crop.size == (8, 8)
    assert tuple(crop_arr[3, 3]) == (255, 0, 0) and tuple(crop_arr[0, 0]) == (
        0x99,
        0x99,
        0x99,
    )  # grey outside the mask
    names = clf(Image.fromarray(arr), [Detection("apple", 1.0, (2, 2, 10, 10), mask)], "apple")
    assert len(names) == 1 and names[0] in COLORS


def test_registered() -> None:
    assert {"geneval", "geneval_local"} <= set(rewards.names())
    assert rewards.get("geneval_local") is GenEvalLocal
