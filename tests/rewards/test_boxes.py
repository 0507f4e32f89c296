"""Tests of rewards/boxes.py: box parsing, coordinate conventions, box math and the grounding rewards.

Every expected number is worked out by hand in the comment next to it (never with the code under test).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from typing import Any

import pytest
import torch

import rewards
from rewards import RewardBatch, RewardSet, load_reward
from rewards.boxes import (
    CONVENTIONS,
    FAMILY_CONVENTIONS,
    IOU_SWEEP_THRESHOLDS,
    BoxCenter,
    BoxGIoU,
    BoxIoU,
    IoUAt,
    best_iou,
    box_f1,
    box_precision_recall,
    center_distance,
    from_absolute,
    giou,
    iou,
    iou_sweep_accuracy,
    parse_box,
    parse_boxes,
    resolve_convention,
    to_absolute,
)

BOX_REWARDS = ("box_iou", "box_giou", "box_center", "iou_at", "box_f1", "iou_sweep")


def make_batch(texts: list[str], env_state: list[dict] | None = None, **columns: list[Any]) -> RewardBatch:
    outputs: dict[str, Any] = {"texts": texts}
    if env_state is not None:
        outputs["env_state"] = env_state
    return RewardBatch(prompts=[f"p{i}" for i in range(len(texts))], outputs=outputs, columns=columns)


def values(reward: Any, batch: RewardBatch) -> list[float]:
    return torch.as_tensor(reward(batch)).tolist()


# ================================================================================ parsing
class TestParse:
    @pytest.mark.parametrize(
        "text, expected",
        [
            ("[10, 20, 30.5, 40]", [(10.0, 20.0, 30.5, 40.0)]),
            ("(5, 6, 7, 8)", [(5.0, 6.0, 7.0, 8.0)]),
            ("<box>(1,2),(3,4)</box>", [(1.0, 2.0, 3.0, 4.0)]),
            (
                "<|object_ref_start|>cat<|object_ref_end|><|box_start|>(100,200),(300,400)<|box_end|>",
                [(100.0, 200.0, 300.0, 400.0)],
            ),
            ('{"bbox_2d": [1, 2, 3, 4], "label": "cat"}', [(1.0, 2.0, 3.0, 4.0)]),  # one box, not two
            ('{"bbox": [1, 2, 3, 4]}', [(1.0, 2.0, 3.0, 4.0)]),
            ('{"box": [1, 2, 3, 4]}', [(1.0, 2.0, 3.0, 4.0)]),
            # several box keys in one object: the first of bbox_2d, bbox, box counts, once
            ('{"box": [9, 9, 9, 9], "bbox_2d": [1, 2, 3, 4]}', [(1.0, 2.0, 3.0, 4.0)]),
            ('{"bbox_2d": [[1, 2, 3, 4], [5, 6, 7, 8]]}', [(1.0, 2.0, 3.0, 4.0), (5.0, 6.0, 7.0, 8.0)]),
            ("{'bbox_2d': [1, 2, 3, 4]}", [(1.0, 2.0, 3.0, 4.0)]),  # Python-dict quoting: the list itself
            ('{"answer": [1, 2, 3, 4]}', [(1.0, 2.0, 3.0, 4.0)]),  # no box key: the bare list
            ("[30, 40, 10, 20]", [(10.0, 20.0, 30.0, 40.0)]),  # reversed corners are swapped
            ("(3,4),(1,2)", [(1.0, 2.0, 3.0, 4.0)]),
            ("[-1.5e1, .5, 2., 3]", [(-15.0, 0.5, 2.0, 3.0)]),
        ],
    )
    def test_styles(self, text: str, expected: list[tuple[float, ...]]) -> None:
        assert parse_boxes(text) == expected
        assert parse_box(text) == expected[-1]

    def test_fenced_json_list_of_two_objects_is_two_boxes(self) -> None:
        text = (
            "Here they are:\n```json\n"
            '[{"bbox_2d": [135, 114, 1016, 672], "label": "cat"},\n'
            ' {"bbox_2d": [10, 20, 30, 40], "label": "dog"}]\n```'
        )
        assert parse_boxes(text) == [(135.0, 114.0, 1016.0, 672.0), (10.0, 20.0, 30.0, 40.0)]
        assert parse_box(text) == (10.0, 20.0, 30.0, 40.0)

    @pytest.mark.parametrize(
        "junk", ["", "no box here", "only [1, 2, 3]", "[1, 2, x, 4]", "(1, 2), (3)", "[]", "{}", None, 42]
    )
    def test_junk_gives_nothing(self, junk: Any) -> None:
        assert parse_boxes(junk) == []
        assert parse_box(junk) is None

    def test_degenerate_inputs_do_not_raise(self) -> None:
        for text in ("[" * 5000, "{" * 5000, '{"box": ' * 3000, '{"bbox_2d": [' * 3000 + "1,2,3,4"):
            assert parse_boxes(text) == []

    def test_order_of_mixed_styles(self) -> None:
        text = 'a [0,0,1,1] b (2,2),(3,3) c {"bbox_2d": [4,4,5,5]} d (6, 6, 7, 7)'
        assert parse_boxes(text) == [(0, 0, 1, 1), (2, 2, 3, 3), (4, 4, 5, 5), (6, 6, 7, 7)]

    def test_answer_takes_precedence(self) -> None:
        text = "<think>maybe [0,0,1,1]</think><answer>[5,6,7,8]</answer> and later [9,9,10,10]"
        assert parse_boxes(text) == [(5.0, 6.0, 7.0, 8.0)]
        # the LAST answer element counts
        assert parse_boxes("<answer>[1,1,2,2]</answer><answer>[3,3,4,4]</answer>") == [(3, 3, 4, 4)]
        # an answer without a box: the boxes elsewhere
        assert parse_boxes("<answer>none</answer> [5,6,7,8]") == [(5.0, 6.0, 7.0, 8.0)]
        # another tag name
        assert parse_box("<box_answer>[1,2,3,4]</box_answer> [5,6,7,8]", tag="box_answer") == (1, 2, 3, 4)

    def test_crop_is_not_an_answer(self) -> None:
        crop_then_answer = "<crop>[0,0,50,50]</crop> View 1: <answer>[1,2,3,4]</answer>"
        assert parse_boxes(crop_then_answer) == [(1.0, 2.0, 3.0, 4.0)]
        # an answer element without a box: the crop box is NOT taken
        assert parse_boxes("<crop view=0>[0,0,50,50]</crop><answer>no idea</answer>") == []
        # no answer element: boxes outside crops first ...
        assert parse_boxes("<crop>[0,0,50,50]</crop> it is at [1,2,3,4]") == [(1.0, 2.0, 3.0, 4.0)]
        # ... an unclosed crop (stop string cut off) is still a crop ...
        assert parse_boxes("<crop>[0,0,50,50] and [1,2,3,4]<answer>none</answer>") == []
        # ... and only a crop box at all: taken as the last resort
        assert parse_boxes("<crop view=1>[0,0,50,50]</crop>") == [(0.0, 0.0, 50.0, 50.0)]


# ============================================================================ conventions
W, H = 640, 480  # original image
WR, HR = 644, 476  # Qwen2.5-VL resize to multiples of 28: 640/28 = 22.9 -> 23*28, 480/28 = 17.1 -> 17*28


class TestConventions:
    def test_names(self) -> None:
        assert CONVENTIONS == ("absolute", "resized", "norm1000", "norm1")
        assert FAMILY_CONVENTIONS == {"qwen2_vl": "norm1000", "qwen2_5_vl": "resized", "qwen3_vl": "norm1000"}
        for c in CONVENTIONS:
            assert resolve_convention(c) == c
        assert resolve_convention("qwen2_vl") == "norm1000"
        assert resolve_convention("qwen2_5_vl") == "resized"
        assert resolve_convention("qwen3_vl") == "norm1000"
        assert resolve_convention("Qwen2.5-VL") == "resized"  # case, "." and "-" normalised
        with pytest.raises(ValueError) as e:
            resolve_convention("pixels")
        for choice in (*CONVENTIONS, *FAMILY_CONVENTIONS):
            assert choice in str(e.value)

    @pytest.mark.parametrize(
        "convention, written, absolute",
        [
            ("absolute", (10, 20, 30, 40), (10, 20, 30, 40)),
            # x * 640 / 1000, y * 480 / 1000: 500 -> 320, 500 -> 240, 1000 -> 640, 1000 -> 480
            ("norm1000", (500, 500, 1000, 1000), (320, 240, 640, 480)),
            ("qwen2_vl", (500, 500, 1000, 1000), (320, 240, 640, 480)),
            ("qwen3_vl", (250, 0, 500, 1000), (160, 0, 320, 480)),  # 250 * 0.64 = 160
            # x * 640, y * 480: 0.25 -> 160, 0.5 -> 240, 0.75 -> 480, 1.0 -> 480
            ("norm1", (0.25, 0.5, 0.75, 1.0), (160, 240, 480, 480)),
            # x * 640 / 644, y * 480 / 476: 402.5 * 640 = 257600 / 644 = 400; 297.5 * 480 = 142800 / 476 = 300;
            # 603.75 * 640 = 386400 / 644 = 600; 446.25 * 480 = 214200 / 476 = 450
            ("resized", (402.5, 297.5, 603.75, 446.25), (400, 300, 600, 450)),
            ("qwen2_5_vl", (402.5, 297.5, 603.75, 446.25), (400, 300, 600, 450)),
        ],
    )
    def test_to_and_from_absolute(
        self, convention: str, written: tuple[float, ...], absolute: tuple[float, ...]
    ) -> None:
        kw = {"original_size": (W, H), "resized_size": (WR, HR)}
        assert to_absolute(written, convention, **kw) == pytest.approx(absolute)
        assert from_absolute(absolute, convention, **kw) == pytest.approx(written)

    def test_missing_sizes(self) -> None:
        assert to_absolute([1, 2, 3, 4], "absolute") == (1.0, 2.0, 3.0, 4.0)  # needs no size
        with pytest.raises(ValueError, match="original_size"):
            to_absolute([1, 2, 3, 4], "norm1000")
        with pytest.raises(ValueError, match="resized_size"):
            to_absolute([1, 2, 3, 4], "resized", original_size=(W, H))
        with pytest.raises(ValueError, match="convention"):
            from_absolute([1, 2, 3, 4], "pixels", original_size=(W, H))


# =================================================================================== math
class TestMath:
    def test_iou(self) -> None:
        # [0,0,10,10] vs [5,5,15,15]: intersection 5*5 = 25, union 100 + 100 - 25 = 175
        assert iou([0, 0, 10, 10], [5, 5, 15, 15]) == pytest.approx(25 / 175)
        assert iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
        assert iou([0, 0, 10, 10], [20, 20, 30, 30]) == 0.0
        assert iou([10, 10, 0, 0], [0, 0, 10, 5]) == pytest.approx(0.5)  # 50 / 100, corners swapped
        assert iou([0, 0, 0, 10], [0, 0, 10, 10]) == 0.0  # zero width

    def test_giou(self) -> None:
        # same pair: IoU 25/175 = 1/7; enclosing box [0,0,15,15] C = 225, U = 175:
        # GIoU = 1/7 - (225 - 175)/225 = 1/7 - 2/9 = (9 - 14)/63 = -5/63
        assert giou([0, 0, 10, 10], [5, 5, 15, 15]) == pytest.approx(-5 / 63)
        # disjoint side by side with a gap: U = 200, C = 30 * 10 = 300 -> 0 - 100/300
        assert giou([0, 0, 10, 10], [20, 0, 30, 10]) == pytest.approx(-1 / 3)
        # sharing a full edge: C = U = 200 -> 0
        assert giou([0, 0, 10, 10], [10, 0, 20, 10]) == pytest.approx(0.0)
        assert giou([0, 0, 10, 10], [0, 0, 10, 10]) == pytest.approx(1.0)
        # far apart: U = 2, C = 100 * 100 = 10000 -> -(10000 - 2)/10000 = -0.9998
        assert giou([0, 0, 1, 1], [99, 99, 100, 100]) == pytest.approx(-0.9998)
        assert giou([0, 0, 1], [0, 0, 1, 1]) == -1.0  # not a box

    def test_center_distance(self) -> None:
        # centres (5, 5) and (8, 9): dx = 3, dy = 4 -> 5
        assert center_distance([0, 0, 10, 10], [6, 7, 10, 11]) == pytest.approx(5.0)
        assert center_distance([10, 10, 0, 0], [0, 0, 10, 10]) == 0.0
        assert center_distance([0, 0, 1], [0, 0, 1, 1]) == math.inf

    def test_best_iou(self) -> None:
        # vs [0,0,10,10]: inter [5,5,10,10] = 25, union 100 + 100 - 25 = 175 -> 1/7; vs [5,5,15,10]: the
        # reference lies inside the prediction, inter = 10 * 5 = 50, union 100 + 50 - 50 = 100 -> 0.5
        assert best_iou([5, 5, 15, 15], [[0, 0, 10, 10], [5, 5, 15, 10]]) == pytest.approx(0.5)
        assert best_iou([0, 0, 1, 1], []) == 0.0

    def test_box_f1(self) -> None:
        # preds A = [0,0,10,10] (exact) and B = [20,20,30,30] (no match), ref [0,0,10,10]:
        # P = (1 + 0)/2 = 0.5, R = 1 -> F1 = 2 * 0.5 * 1 / 1.5 = 2/3
        preds, refs = [[0, 0, 10, 10], [20, 20, 30, 30]], [[0, 0, 10, 10]]
        assert box_precision_recall(preds, refs) == pytest.approx((0.5, 1.0))
        assert box_f1(preds, refs) == pytest.approx(2 / 3)
        # pred [0,0,10,10]; refs [0,0,10,5] (IoU 50/100 = 0.5) and [20,20,30,30] (0):
        # P = 0.5, R = (0.5 + 0)/2 = 0.25 -> F1 = 2 * 0.5 * 0.25 / 0.75 = 1/3
        assert box_f1([[0, 0, 10, 10]], [[0, 0, 10, 5], [20, 20, 30, 30]]) == pytest.approx(1 / 3)
        assert box_f1([], refs) == 0.0  # no predictions
        assert box_f1([[50, 50, 60, 60]], refs) == 0.0  # P + R == 0

    def test_iou_sweep(self) -> None:
        assert IOU_SWEEP_THRESHOLDS == (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
        assert iou_sweep_accuracy(0.7) == 0.5  # meets 0.50, 0.55, 0.60, 0.65, 0.70: 5 of 10
        assert iou_sweep_accuracy(0.5) == 0.1  # only 0.50
        assert iou_sweep_accuracy(0.49) == 0.0
        assert iou_sweep_accuracy(1.0) == 1.0
        assert iou_sweep_accuracy(0.6, thresholds=(0.5, 0.75)) == 0.5
        with pytest.raises(ValueError):
            iou_sweep_accuracy(0.5, thresholds=())


# ================================================================================ rewards
SHARED_BOX_OPTIONS = {
    "box_column": "boxes",
    "coords": "absolute",
    "width_column": "image_width",
    "height_column": "image_height",
    "resized_width_column": "resized_width",
    "resized_height_column": "resized_height",
    "tag": "answer",
    "box_key": None,
}


def test_box_rewards_declare_the_shared_options_once() -> None:
    """Every box reward takes the shared options (same names, order and defaults, keyword-only) and then its
    own; the shared ones are one declaration (the same dataclass fields in every reward), not a copy each."""
    own = {
        "box_iou": {"threshold": None, "dense": True},
        "box_giou": {"raw": False},
        "box_center": {"form": "exp"},
        "iou_at": {"threshold": 0.5},
        "box_f1": {},
        "iou_sweep": {},
    }
    assert set(own) == set(BOX_REWARDS)
    shared_fields = dataclasses.fields(rewards.get("iou_sweep"))
    for name, extra in own.items():
        cls = rewards.get(name)
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        assert {p.name: p.default for p in params} == {**SHARED_BOX_OPTIONS, **extra}, name
        assert list({p.name: p for p in params}) == [*SHARED_BOX_OPTIONS, *extra], name
        assert all(p.kind is p.KEYWORD_ONLY for p in params), name
        fields = dataclasses.fields(cls)
        assert len(fields) == len(SHARED_BOX_OPTIONS) + len(extra), name
        assert all(a is b for a, b in zip(fields, shared_fields, strict=False)), name
        reward = cls(**({"threshold": 0.5} if name == "box_iou" else {}))
        assert reward == reward and reward != cls(**({"threshold": 0.5} if name == "box_iou" else {}))
        assert repr(reward) == f"{cls.__name__}(name={name!r})"


def test_registered_with_summaries() -> None:
    names = rewards.names()
    for name in BOX_REWARDS:
        assert name in names
        doc = rewards.get(name).__doc__
        assert doc and doc.strip().splitlines()[0].strip()
    assert rewards.get("box_iou") is BoxIoU
    from rewards.multimodal import BoxIoU as OldBoxIoU
    from rewards.multimodal import iou as old_iou
    from rewards.multimodal import parse_box as old_parse_box

    assert OldBoxIoU is BoxIoU and old_iou is iou and old_parse_box is parse_box


class TestRewards:
    def test_box_iou_multi_reference_and_boxes_column(self) -> None:
        batch = make_batch(
            ["<answer>[20, 20, 30, 25]</answer>", "[0,0,10,10]", "[0,0,1,1]"],
            # pred 0 vs ref [20,20,30,30]: inter 10*5 = 50, union 100 -> 0.5; vs [0,0,10,10]: 0
            boxes=[[[0, 0, 10, 10], [20, 20, 30, 30]], "[[0,0,10,10], [20,20,30,30]]", None],
            box=[[100, 100, 101, 101]] * 3,  # ignored: "boxes" wins
        )
        out = values(load_reward("box_iou"), batch)
        assert out[:2] == pytest.approx([0.5, 1.0])
        assert math.isnan(out[2])

    def test_falls_back_to_box_column(self) -> None:
        batch = make_batch(["[0,0,10,10]"], box=[[0, 0, 10, 5]])  # 50 / 100
        assert values(BoxIoU(), batch) == pytest.approx([0.5])
        with pytest.raises(KeyError, match="'boxes'"):
            BoxIoU()(make_batch(["[0,0,1,1]"], target=[[0, 0, 1, 1]]))
        with pytest.raises(KeyError, match="'target'"):
            BoxIoU(box_column="target")(make_batch(["[0,0,1,1]"], box=[[0, 0, 1, 1]]))

    def test_qwen2_5_vl_box_read_as_norm1000_misses(self) -> None:
        # Qwen2.5-VL writes the object at [400,300,600,450] (original 640x480) in pixels of its 644x476 input:
        # [402.5, 297.5, 603.75, 446.25]. As norm1000: x * 0.64, y * 0.48 -> [257.6, 142.8, 386.4, 214.2]:
        # x ends at 386.4 < 400 and y at 214.2 < 300, no overlap -> IoU 0.
        batch = make_batch(
            ['{"bbox_2d": [402.5, 297.5, 603.75, 446.25]}'],
            boxes=[[[400, 300, 600, 450]]],
            image_width=[W],
            image_height=[H],
            resized_width=[WR],
            resized_height=[HR],
        )
        wrong = values(BoxIoU(coords="qwen2_vl"), batch)[0]
        right = values(BoxIoU(coords="qwen2_5_vl"), batch)[0]
        assert wrong < 0.1
        assert right == pytest.approx(1.0)
        assert values(BoxIoU(coords="resized"), batch)[0] == pytest.approx(1.0)

    def test_norm1(self) -> None:
        # [0.25, 0.5, 0.75, 1.0] * (640, 480) = [160, 240, 480, 480]
        batch = make_batch(
            ["[0.25, 0.5, 0.75, 1.0]"], boxes=[[160, 240, 480, 480]], image_width=[W], image_height=[H]
        )
        assert values(load_reward("box_iou", coords="norm1"), batch) == pytest.approx([1.0])

    def test_box_giou(self) -> None:
        batch = make_batch(
            ["[0,0,10,10]", "[0,0,10,10]", "nothing"], boxes=[[5, 5, 15, 15], [20, 0, 30, 10], [0, 0, 1, 1]]
        )
        # GIoU -5/63 -> (1 - 5/63)/2 = 29/63; GIoU -1/3 -> (2/3)/2 = 1/3; unparsed -> 0
        assert values(BoxGIoU(), batch) == pytest.approx([29 / 63, 1 / 3, 0.0])
        # raw: -5/63, -1/3 and the worst value -1 for an unparsed completion
        assert values(BoxGIoU(raw=True), batch) == pytest.approx([-5 / 63, -1 / 3, -1.0])
        # several references: the best GIoU counts ([0,0,10,10] vs itself: 1 -> mapped 1)
        multi = make_batch(["[0,0,10,10]"], boxes=[[[20, 0, 30, 10], [0, 0, 10, 10]]])
        assert values(BoxGIoU(), multi) == pytest.approx([1.0])

    def test_box_center(self) -> None:
        # image 30 x 40: diagonal sqrt(900 + 1600) = 50. Centres (5,5) and (8,9): d = 5, d / D = 0.1
        batch = make_batch(
            ["[0,0,10,10]", "[0,0,10,10]"],
            boxes=[[6, 7, 10, 11], [[100, 100, 110, 110], [6, 7, 10, 11]]],  # 2nd: the nearest ref counts
            image_width=[30, 30],
            image_height=[40, 40],
        )
        assert values(BoxCenter(), batch) == pytest.approx([math.exp(-0.1)] * 2)  # 0.904837
        assert values(BoxCenter(form="linear"), batch) == pytest.approx([0.9, 0.9])  # 1 - 0.1
        # far: centre (5,5) vs (105,105): d = 100 * sqrt(2) = 141.4 > 50 -> linear 0, exp(-2.828) = 0.0591
        far = make_batch(["[0,0,10,10]"], boxes=[[100, 100, 110, 110]], image_width=[30], image_height=[40])
        assert values(BoxCenter(form="linear"), far) == [0.0]
        assert values(BoxCenter(), far) == pytest.approx([math.exp(-100 * math.sqrt(2) / 50)])
        with pytest.raises(KeyError, match="image_width"):
            BoxCenter()(make_batch(["[0,0,10,10]"], boxes=[[0, 0, 10, 10]]))

    def test_box_center_with_norm1000(self) -> None:
        # norm1000 [0,0,250,250] on 40x40 -> [0,0,10,10], centre (5,5); ref centre (8,9): d = 5,
        # D = sqrt(1600 + 1600) = 56.5685 -> exp(-5 / 56.5685) = exp(-0.0883883)
        batch = make_batch(["[0,0,250,250]"], boxes=[[6, 7, 10, 11]], image_width=[40], image_height=[40])
        assert values(BoxCenter(coords="norm1000"), batch) == pytest.approx(
            [math.exp(-5 / (40 * math.sqrt(2)))]
        )

    def test_iou_at_threshold_changes_between_calls(self) -> None:
        batch = make_batch(["[0,0,10,10]", "[0,0,10,10]"], boxes=[[0, 0, 10, 5], [0, 0, 10, 7]])
        # IoUs 50/100 = 0.5 and 70/100 = 0.7
        r = load_reward("iou_at")
        assert r.threshold == 0.5
        assert values(r, batch) == [1.0, 1.0]
        r.threshold = 0.6
        assert values(r, batch) == [0.0, 1.0]
        r.threshold = 0.75
        assert values(r, batch) == [0.0, 0.0]
        for bad in (1.5, -0.1, "high", True, None):
            with pytest.raises(ValueError, match="iou_at.*threshold"):
                r.threshold = bad  # type: ignore[assignment]
        assert r.threshold == 0.75  # unchanged by the refused values
        assert values(IoUAt(threshold=0.7), batch) == [0.0, 1.0]

    def test_box_f1_with_several_parsed_boxes(self) -> None:
        text = '```json\n[{"bbox_2d": [0, 0, 10, 10]}, {"bbox_2d": [20, 20, 30, 30]}]\n```'
        batch = make_batch(
            [text, text, "[0,0,10,10]"],
            # 1: both refs found exactly: P = R = 1; 2: P = (1 + 0)/2, R = 1 -> 2/3;
            # 3: one pred [0,0,10,10], refs [0,0,10,5] (0.5) and [20,20,30,30] (0): P = 0.5, R = 0.25 -> 1/3
            boxes=[
                [[0, 0, 10, 10], [20, 20, 30, 30]],
                [[0, 0, 10, 10]],
                [[0, 0, 10, 5], [20, 20, 30, 30]],
            ],
        )
        assert values(load_reward("box_f1"), batch) == pytest.approx([1.0, 2 / 3, 1 / 3])

    def test_iou_sweep_reward(self) -> None:
        # IoUs 70/100 = 0.7 -> 5/10; 100/100 -> 1; 50/100 = 0.5 -> 1/10; 25/175 -> 0
        batch = make_batch(
            ["[0,0,10,10]"] * 4, boxes=[[0, 0, 10, 7], [0, 0, 10, 10], [0, 0, 10, 5], [5, 5, 15, 15]]
        )
        assert values(load_reward("iou_sweep"), batch) == pytest.approx([0.5, 1.0, 0.1, 0.0])

    @pytest.mark.parametrize("name", BOX_REWARDS)
    def test_unparsed_scores_zero_with_metric_and_one_warning(self, name: str, caplog: Any) -> None:
        junk = "I think the lesion is somewhere on the left " + "x" * 200
        batch = make_batch(
            ["<answer>[0, 0, 10, 10]</answer>", junk, "also none", "whatever"],
            boxes=[[0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 10, 10], None],
            image_width=[10] * 4,
            image_height=[10] * 4,
            _source=["d.jsonl:1", "d.jsonl:2", "d.jsonl:3", "d.jsonl:4"],
        )
        r = load_reward(name)
        with caplog.at_level(logging.WARNING, logger="rewards.boxes"):
            out = values(r, batch)
        assert out[0] == pytest.approx(1.0)
        assert out[1:3] == [0.0, 0.0]
        assert math.isnan(out[3])
        assert r.last_metrics == {"unparsed_frac": pytest.approx(2 / 3)}  # 2 of the 3 with a reference
        warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
        assert len(warnings) == 1
        msg = warnings[0].getMessage()
        assert "2 of 3 completions" in msg and "sample 1 (d.jsonl:2)" in msg and name in msg
        assert repr(junk[:120]) in msg and junk[:121] not in msg
        # a clean call resets the metric and warns no more
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rewards.boxes"):
            r(make_batch(["[0,0,10,10]"], boxes=[[0, 0, 10, 10]], image_width=[10], image_height=[10]))
        assert r.last_metrics == {"unparsed_frac": 0.0}
        assert not caplog.records

    def test_unparsed_warning_once_per_run(self, caplog: Any) -> None:
        """Completions without a box are logged once per reward instance, however many steps have them (the
        share stays in ``last_metrics`` every call), and box rewards of one reward set scoring the same batch
        (medloc's ``iou_at`` and ``box_iou``) log one line between them."""
        rs = RewardSet([{"name": "iou_at", "kwargs": {"threshold": 0.5}}, {"name": "box_iou"}])
        with caplog.at_level(logging.WARNING, logger="rewards.boxes"):
            for step in range(3):
                rs(make_batch(["[0,0,10,10]", f"no box at step {step}"], boxes=[[0, 0, 10, 10]] * 2))
                assert rs.last_metrics == {
                    "reward/iou_at/unparsed_frac": 0.5,
                    "reward/box_iou/unparsed_frac": 0.5,
                }
        (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
        msg = record.getMessage()
        assert "'iou_at'" in msg and "1 of 2 completions" in msg and "no box at step 0" in msg
        assert "once per run" in msg and "unparsed_frac" in msg
        # another run (new reward instances) is told again
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rewards.boxes"):
            load_reward("box_iou")(make_batch(["none"], boxes=[[0, 0, 10, 10]]))
        assert len(caplog.records) == 1
        # a box reward reading env_state fails differently on the same batch: its own line
        caplog.clear()
        batch = make_batch(["none"], boxes=[[0, 0, 10, 10]], env_state=[{"views": []}])
        with caplog.at_level(logging.WARNING, logger="rewards.boxes"):
            load_reward("box_iou")(batch)
            load_reward("box_iou", box_key="answer_box")(batch)
        assert len(caplog.records) == 2 and "'answer_box'" in caplog.records[1].getMessage()

    def test_metrics_reach_the_reward_set(self) -> None:
        rs = RewardSet([{"name": "box_iou"}, {"name": "iou_at", "kwargs": {"threshold": 0.4}}])
        out = rs(make_batch(["[0,0,10,10]", "no box"], boxes=[[0, 0, 10, 5], [0, 0, 1, 1]]))
        assert out.flatten().tolist() == pytest.approx([0.5, 1.0, 0.0, 0.0])
        assert rs.last_metrics == {"reward/box_iou/unparsed_frac": 0.5, "reward/iou_at/unparsed_frac": 0.5}

    def test_box_key_reads_env_state(self, caplog: Any) -> None:
        # the text would parse to [0,0,1,1] (IoU 0.01); box_key reads the env's answer instead
        texts = ["<answer>[0,0,1,1]</answer>"] * 4
        env_state = [
            {"answer_box": [0, 0, 10, 10]},
            {"views": []},  # the environment ran but recorded no answer: unparsed
            {"answer_box": [1, 2, 3]},
            {"answer_box": [10, 5, 0, 0]},
        ]
        # coords="norm1000" does not apply to env_state boxes (already original pixels): no size columns needed
        r = load_reward("box_iou", box_key="answer_box", coords="norm1000")
        with caplog.at_level(logging.WARNING, logger="rewards.boxes"):
            out = values(r, make_batch(texts, env_state=env_state, boxes=[[0, 0, 10, 10]] * 4))
        # sample 3: [10,5,0,0] ordered [0,0,10,5] vs [0,0,10,10]: 50/100
        assert out == pytest.approx([1.0, 0.0, 0.0, 0.5])
        assert r.last_metrics == {"unparsed_frac": 0.5}
        assert "'answer_box'" in caplog.text and "2 of 4" in caplog.text
        f1 = load_reward("box_f1", box_key="answer_box")
        state = [{"answer_box": [[0, 0, 10, 10], [20, 20, 30, 30]]}]  # a list of boxes: P = (1 + 0)/2, R = 1
        assert values(f1, make_batch(["x"], env_state=state, boxes=[[0, 0, 10, 10]])) == pytest.approx(
            [2 / 3]
        )
        with pytest.raises(KeyError, match="env_state"):
            r(make_batch(texts, boxes=[[0, 0, 10, 10]] * 4))
        # an EMPTY env_state (no environment ran: a single-turn rollout) falls back to the text, in coords
        absolute = load_reward("box_iou", box_key="answer_box")
        out = values(
            absolute, make_batch(["<answer>[0,0,10,5]</answer>"], env_state=[{}], boxes=[[0, 0, 10, 10]])
        )
        assert out == pytest.approx([0.5])

    def test_bad_options_name_reward_and_option(self) -> None:
        cases = [
            ("box_iou", {"coords": "pixels"}, ValueError, r"box_iou.*coords.*pixels.*norm1000.*qwen2_5_vl"),
            ("box_iou", {"dense": False}, ValueError, "box_iou.*needs a threshold"),
            ("box_iou", {"threshold": 1.5}, ValueError, "box_iou.*threshold"),
            ("box_giou", {"raw": "yes"}, ValueError, "box_giou.*raw"),
            ("box_center", {"form": "square"}, ValueError, r"box_center.*form.*'exp', 'linear'"),
            ("iou_at", {"threshold": 2}, ValueError, "iou_at.*threshold"),
            ("box_f1", {"box_key": ""}, ValueError, "box_f1.*box_key"),
            ("iou_sweep", {"box_column": 3}, ValueError, "iou_sweep.*box_column"),
            ("iou_sweep", {"threshold": 0.5}, TypeError, "iou_sweep.*unknown option.*threshold"),
            ("box_giou", {"cords": "norm1000"}, TypeError, "box_giou.*unknown option.*cords"),
        ]
        for name, opts, err, pattern in cases:
            with pytest.raises(err, match=pattern):
                load_reward(name, **opts)

    def test_bad_reference_is_an_error(self) -> None:
        for bad in ([1, 2, 3], "no box", [[0, 0, 1, 1], [1, 2]], 7):
            with pytest.raises(ValueError, match="box_iou.*reference box"):
                load_reward("box_iou")(make_batch(["[0,0,1,1]"], boxes=[bad]))

    def test_reference_forms(self) -> None:
        # tensor, JSON string, dict, tuple: all [0,0,10,10]; [] is "no reference" -> NaN
        refs = [
            torch.tensor([0, 0, 10, 10]),
            '{"bbox_2d": [0, 0, 10, 10]}',
            {"bbox_2d": [0, 0, 10, 10]},
            (0, 0, 10, 10),
            [],
        ]
        out = values(load_reward("box_iou"), make_batch(["[0,0,10,10]"] * 5, boxes=refs))
        assert out[:4] == [1.0] * 4
        assert math.isnan(out[4])
