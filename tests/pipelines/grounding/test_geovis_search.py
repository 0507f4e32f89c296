"""GeoViS views geometry and the inference-time tree search (pipelines/grounding/geovis_views.py, geovis_search.py).

Geometry is checked against hand-worked numbers; the search runs on a FAKE oracle that sees pixels (a red
target on white: P(yes) = 1 when a crop shows red, the predicted box = the red pixels' bounding box in the
asked image's pixels), so the right answer is known; the views are shown at their original scale there
(`AS_IS`) except in the test of per-view pixel bounds; the VLM oracle and the policy wrapper are
smoke-tested on the random tiny Qwen2-VL."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from pipelines.grounding.geovis_search import (
    INFERENCE_ONLY,
    SearchConfig,
    SearchOracle,
    TreeSearchPolicy,
    VLMOracle,
    format_answer,
    select_child,
    tree_search,
    uct_score,
    yes_no_questions,
)
from pipelines.grounding.geovis_views import (
    BOX_PROMPT,
    YESNO_PROMPT,
    View,
    ViewPixels,
    check_crop,
    child_view,
    clip_region,
    crop_image,
    global_to_view,
    grid_cells,
    largest_area,
    resized_size,
    view_image,
    view_to_global,
)

# ============================================================================ geometry
VIEW = View(id=1, parent=0, region=(100.0, 0.0, 200.0, 100.0), size=(100.0, 100.0), resized=(56, 56))
"""A 100x100 region of a 300x300 image, shown to the model at 56x56."""


def close(a: Any, b: Any, tol: float = 1e-9) -> bool:
    return len(a) == len(b) and all(abs(float(x) - float(y)) <= tol for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("convention", "box"),
    [
        ("resized", [28, 28, 56, 56]),  # 28 px of 56 = half of 100 px
        ("norm1000", [500, 500, 1000, 1000]),
        ("norm1", [0.5, 0.5, 1.0, 1.0]),
        ("absolute", [50, 50, 100, 100]),  # pixels of the region at original scale
        ("qwen2_5_vl", [28, 28, 56, 56]),  # family alias -> resized
        ("qwen2_vl", [500, 500, 1000, 1000]),  # -> norm1000
    ],
)
def test_view_to_global_hand_numbers(convention: str, box: list[float]) -> None:
    assert close(view_to_global(box, VIEW, convention), [150, 50, 200, 100])
    assert close(global_to_view([150, 50, 200, 100], VIEW, convention), box, tol=1e-6)


def test_view_to_global_non_square() -> None:
    # region x 40..100 (60 px), y 10..40 (30 px), resized to 84 x 28: x = 40 + 42 * 60/84 = 70,
    # y = 10 + 14 * 30/28 = 25; x2 = 40 + 84 * 60/84 = 100, y2 = 10 + 28 * 30/28 = 40
    v = View(id=2, parent=0, region=(40.0, 10.0, 100.0, 40.0), size=(60.0, 30.0), resized=(84, 28))
    assert close(view_to_global([42, 14, 84, 28], v, "resized"), [70, 25, 100, 40])
    # norm1000 250/1000 of 60 = 15 -> 55; 100/1000 of 30 = 3 -> 13
    assert close(view_to_global([250, 100, 250, 100], v, "norm1000"), [55, 13, 55, 13])


def test_unknown_convention_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown box.*convention 'pixels'"):
        view_to_global([0, 0, 1, 1], VIEW, "pixels")


def test_resized_size_argument_order() -> None:
    # 280 wide x 56 tall, bounds wide enough to keep it: multiples of 28 already -> unchanged, (w, h) order
    assert resized_size(280, 56, min_pixels=28 * 28, max_pixels=10_000_000) == (280, 56)
    # 3136 pixels max: 112x112 (12544 px) shrinks by beta = sqrt(12544 / 3136) = 2 -> 56x56
    assert resized_size(112, 112, min_pixels=3136, max_pixels=3136) == (56, 56)


def test_root_view() -> None:
    v = View.root((300, 200), min_pixels=28 * 28, max_pixels=10_000_000)
    assert (v.id, v.parent, v.region, v.size) == (0, None, (0.0, 0.0, 300.0, 200.0), (300.0, 200.0))
    assert v.resized == (308, 196)  # round(300/28)=11 -> 308, round(200/28)=7 -> 196
    assert View.from_dict(v.to_dict()) == v


def test_clip_and_refusals() -> None:
    assert clip_region([-10, 20, 350, 5], (300, 300)) == (0.0, 5.0, 300.0, 20.0)  # ordered and clipped
    assert check_crop(clip_region([310, 0, 400, 50], (300, 300))) == "empty after clipping"
    reason = check_crop((0, 0, 5, 50), min_crop_px=8)
    assert reason is not None and reason.startswith("too small: 5x50 px")
    reason = check_crop((0, 0, 200, 10), min_crop_px=8, max_aspect=10)
    assert reason is not None and reason.startswith("aspect ratio 20 > 10")
    assert check_crop((0, 0, 90, 10), min_crop_px=8, max_aspect=10) is None  # ratio 9


def test_child_view_maps_clips_and_rounds_outward() -> None:
    root = View.root((300, 300), min_pixels=3136, max_pixels=3136)
    # the root is shown at root.resized; ask for the middle third in resized pixels
    rw, rh = root.resized
    box = [rw / 3, rh / 3, 2 * rw / 3, 2 * rh / 3]
    child = child_view(root, box, "resized", (300, 300), 3136, 3136, next_id=5, min_crop_px=8, max_aspect=10)
    assert isinstance(child, View)
    assert (child.id, child.parent) == (5, 0)
    assert close(child.region, [100, 100, 200, 200], tol=1e-6)
    assert child.size == (100.0, 100.0) and child.resized == (56, 56)
    # a fractional request rounds outward to whole pixels: 10.5..20.2 -> 10..21 (norm1 of a 300 px image)
    child = child_view(
        root, [10.5 / 300, 10.5 / 300, 20.2 / 300, 20.2 / 300], "norm1", (300, 300), 3136, 3136, next_id=1
    )
    assert isinstance(child, View) and child.region == (10.0, 10.0, 21.0, 21.0) and child.size == (11.0, 11.0)
    # off the image (clipped empty), too small, too thin
    assert child_view(root, [1.1, 1.1, 1.5, 1.5], "norm1", (300, 300), 3136, 3136, next_id=1) == (
        "empty after clipping"
    )
    small = child_view(root, [0, 0, 10, 10], "absolute", (300, 300), 3136, 3136, next_id=1, min_crop_px=20)
    assert isinstance(small, str) and small.startswith("too small")
    thin = child_view(root, [0, 0, 300, 20], "absolute", (300, 300), 3136, 3136, next_id=1, max_aspect=10)
    assert isinstance(thin, str) and thin.startswith("aspect ratio 15")


def test_crop_image_is_exact() -> None:
    img = Image.new("RGB", (30, 20))
    for x in range(30):
        for y in range(20):
            img.putpixel((x, y), (x, y, 0))
    crop = crop_image(img, (4.2, 3.0, 9.0, 7.5))  # -> 4..9 x 3..8
    assert crop.size == (5, 5)
    assert crop.getpixel((0, 0)) == (4, 3, 0) and crop.getpixel((4, 4)) == (8, 7, 0)


def test_grid_cells() -> None:
    cells = grid_cells(View(3, 0, (30.0, 60.0, 120.0, 150.0), (90.0, 90.0), (56, 56)))
    assert len(cells) == 9
    assert close(cells[0], [30, 60, 60, 90])  # top-left
    assert close(cells[2], [90, 60, 120, 90])  # top-right
    assert close(cells[4], [60, 90, 90, 120])  # centre
    assert close(cells[8], [90, 120, 120, 150])  # bottom-right


def test_prompts_and_questions() -> None:
    assert (
        BOX_PROMPT.format(expression="the car")
        == "Locate the car. Answer with <answer>[x1,y1,x2,y2]</answer>."
    )
    assert YESNO_PROMPT.format(expression="the car") == "Is the car in this image? Answer yes or no."
    assert len(yes_no_questions({"expression": "the red car"})) == 1
    qs = yes_no_questions({"expression": "the red car", "object": "car", "relation": "left of the tree"})
    assert qs[0] == "Is car in this image? Answer yes or no." and "left of the tree" in qs[2] and len(qs) == 3
    assert len(yes_no_questions({"expression": "x", "object": "", "relation": None})) == 1


# ============================================================================ UCT
class _N:
    def __init__(self, total: float, visits: int, children: list[_N] | None = None) -> None:
        self.total, self.visits, self.children = total, visits, children or []


def test_uct_hand_computation() -> None:
    # parent N = 6, c = sqrt(2); children (W, N) = (1.2, 2), (0.5, 1), (2.1, 3):
    # ln 6 = 1.791759
    # a: 0.6 + 1.414214 * sqrt(0.895880) = 0.6 + 1.414214 * 0.946509 = 1.938569
    # b: 0.5 + 1.414214 * sqrt(1.791759) = 0.5 + 1.414214 * 1.338566 = 2.393028
    # c: 0.7 + 1.414214 * sqrt(0.597253) = 0.7 + 1.414214 * 0.772821 = 1.792942
    a, b, c = _N(1.2, 2), _N(0.5, 1), _N(2.1, 3)
    parent = _N(3.8, 6, [a, b, c])
    for child, want in ((a, 1.938569), (b, 2.393028), (c, 1.792942)):
        assert abs(uct_score(child.total, child.visits, 6, math.sqrt(2)) - want) < 1e-5
    assert select_child(parent, math.sqrt(2)) is b
    assert select_child(parent, 0.0) is c  # no exploration: the best mean (0.7)
    assert uct_score(0.0, 0, 6, 1.0) == math.inf


def test_view_pixels_validation_and_processor_bounds() -> None:
    with pytest.raises(ValueError, match=r"crop_min_pixels \(5000\) must be <= crop_max_pixels \(3136\)"):
        ViewPixels(root=(3136, 3136), crop=(5000, 3136))
    with pytest.raises(ValueError, match="root_max_pixels must be an integer >= 1"):
        ViewPixels(root=(3136, 0), crop=(3136, 3136))
    with pytest.raises(ValueError, match="root_min_pixels must be an integer"):
        ViewPixels(root=(True, 3136), crop=(3136, 3136))  # type: ignore[arg-type]
    # smart_resize enlarging to min_pixels rounds each side UP: a 76x76 crop under 224*224 bounds comes out
    # 252x252 (76 * sqrt(50176 / 5776) / 28 = 8.000000000000002 in floats -> 9 tiles of 28), above max_pixels
    assert resized_size(76, 76, 50176, 50176) == (252, 252)
    # the hand bound: 50176 + 28 * 224 * (sqrt(200) + 1/sqrt(200)) + 784 = 50176 + 89142.97 + 784 -> 140103
    assert largest_area(50176, 50176) == 140103
    v = ViewPixels(root=(3136, 3136), crop=(50176, 50176))
    lo, hi = v.processor
    assert (lo, hi) == (784, 140103) and v.crop_tokens() == 64
    # every view of either kind is inside the processor's bounds, so its resize leaves a view_image alone
    for w in range(16, 400, 7):
        for h in (w, max(16, w // 3), min(800, 3 * w)):
            for bounds in (v.root, v.crop):
                rw, rh = resized_size(w, h, *bounds)
                assert lo <= rw * rh <= hi and resized_size(rw, rh, lo, hi) == (rw, rh), (w, h, bounds)


def test_view_image_is_the_crop_at_its_resized_size() -> None:
    img = Image.new("RGB", (300, 300))
    img.putdata([(x % 256, y % 256, 7) for y in range(300) for x in range(300)])
    v = View(id=1, parent=0, region=(100.0, 0.0, 200.0, 100.0), size=(100.0, 100.0), resized=(224, 224))
    shown = view_image(img, v)
    assert shown.size == (224, 224)
    reference = img.crop((100, 0, 200, 100)).resize((224, 224), Image.Resampling.BICUBIC)
    assert list(shown.getdata()) == list(reference.getdata())
    same = View(id=2, parent=0, region=(10.0, 20.0, 66.0, 76.0), size=(56.0, 56.0), resized=(56, 56))
    assert list(view_image(img, same).getdata()) == list(
        img.crop((10, 20, 66, 76)).getdata()
    )  # no resampling


# ============================================================================ search on a fake oracle
IMAGE_SIZE = 300
AS_IS = {"min_pixels": 1, "max_pixels": 10**6, "factor": 1}
"""Pixel bounds under which every view is shown at its original scale (the fake oracle's "absolute" boxes)."""
TARGET = (240.0, 40.0, 260.0, 60.0)  # inside the top-right cell (200..300, 0..100), at its centre


def target_image() -> Any:
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    x1, y1, x2, y2 = (int(v) for v in TARGET)
    img.paste((255, 0, 0), (x1, y1, x2, y2))
    return img


class PixelOracle:
    """Knows the target by its colour: P(yes) = 1 iff red shows; the box = red pixels' bounding box in
    ``images[frame]`` pixels (convention "absolute": a crop is at original scale)."""

    convention = "absolute"

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str]] = []

    @staticmethod
    def red_box(img: Any) -> tuple[float, float, float, float] | None:
        t = torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.int32))  # [H, W, 3]
        red = (t[..., 0] > 200) & (t[..., 1] < 50)
        if not red.any():
            return None
        ys, xs = red.nonzero(as_tuple=True)
        return (float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1))

    def yes_probability(self, images: list[Any], question: str) -> float:
        self.calls.append(("yes", len(images), question))
        return 1.0 if self.red_box(images[-1]) is not None else 0.0

    def predict_box(self, images: list[Any], prompt: str, frame: int = -1) -> Any:
        self.calls.append(("box", len(images), prompt))
        return self.red_box(images[frame])


def box_iou(a: Any, b: Any) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def contains(region: Any, box: Any) -> bool:
    return region[0] <= box[0] and region[1] <= box[1] and region[2] >= box[2] and region[3] >= box[3]


ROW = {"expression": "the red square", "_source": "test.jsonl:1"}


@pytest.mark.parametrize("final", ["best_crop", "full_image"])
def test_search_finds_the_target(final: str) -> None:
    oracle = PixelOracle()
    assert isinstance(oracle, SearchOracle)
    res = tree_search(target_image(), ROW, oracle, SearchConfig(final=final), **AS_IS)
    assert res.best_view.id != 0 and contains(res.best_view.region, TARGET)
    assert res.best_view.region == (200.0, 0.0, 300.0, 100.0)  # the top-right cell
    assert res.answer_box is not None and box_iou(res.answer_box, TARGET) > 0.9
    # 10 simulations: the root + 9 cells + 1 sub-cell evaluated, 2 calls each (1 yes/no + 1 box)
    assert res.simulations == 10 and len(res.views) == 11 and res.depth_reached == 2
    extra = 1 if final == "full_image" else 0
    assert res.model_calls == 22 + extra == len(oracle.calls)
    if final == "full_image":  # the last call: full image + best crop, box in the full image's frame
        assert oracle.calls[-1][:2] == ("box", 2)


def test_search_values_hand_numbers() -> None:
    res = tree_search(target_image(), ROW, PixelOracle(), SearchConfig(final="best_crop"), **AS_IS)
    scores = {s["view"]: s for s in res.scores}
    # root: yes = 1; red box 240..260 x 40..60 of 300 px does not meet the central 100..200 box -> IoU 0
    assert abs(scores[0]["value"] - 0.1) < 1e-9
    # the top-right cell (200..300, 0..100): box 40..60 in a 100 px crop vs central 33.3..66.7:
    # IoU = 20^2 / (100/3)^2 = 400 / 1111.1 = 0.36 -> v = 0.1 + 0.9 * 0.36 = 0.424
    cell = next(v.id for v in res.views if v.region == (200.0, 0.0, 300.0, 100.0))
    assert abs(scores[cell]["value"] - 0.424) < 1e-9
    # empty cells: P(yes) 0, no box -> 0
    assert sum(1 for s in res.scores if s["value"] == 0.0) == 9


def test_search_limits_hold() -> None:
    oracle = PixelOracle()
    res = tree_search(
        target_image(),
        ROW,
        oracle,
        SearchConfig(simulations=30, max_depth=1, final="best_crop"),
        **AS_IS,
    )
    assert res.depth_reached == 1 and len(res.views) == 10  # the root + its 9 cells, nothing deeper
    assert all(v.parent in (None, 0) for v in res.views)
    assert res.model_calls == 20  # values are computed once per view
    # the root: its own evaluation + 30 simulations; each simulation visits exactly one cell
    assert res.scores[0]["visits"] == 31 and sum(s["visits"] for s in res.scores[1:]) == 30

    res = tree_search(
        target_image(),
        ROW,
        PixelOracle(),
        SearchConfig(simulations=60, max_depth=3, final="best_crop"),
        **AS_IS,
    )
    assert res.depth_reached <= 3
    by_id = {v.id: v for v in res.views}
    assert len(by_id) == len(res.views) and len({v.region for v in res.views}) == len(res.views)
    for v in res.views:
        if v.parent is not None:
            assert contains(by_id[v.parent].region, v.region)
    assert contains(res.best_view.region, TARGET)
    assert res.answer_box is not None and box_iou(res.answer_box, TARGET) > 0.9

    res = tree_search(target_image(), ROW, PixelOracle(), SearchConfig(simulations=0), **AS_IS)
    assert res.best_view.id == 0 and len(res.views) == 1 and res.depth_reached == 0


class ShownPixelOracle(PixelOracle):
    """The pixel oracle reading the images as shown (``resized``), recording each image's size."""

    convention = "resized"

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[list[tuple[int, int]]] = []

    def yes_probability(self, images: list[Any], question: str) -> float:
        self.sizes.append([im.size for im in images])
        return super().yes_probability(images, question)

    def predict_box(self, images: list[Any], prompt: str, frame: int = -1) -> Any:
        self.sizes.append([im.size for im in images])
        return super().predict_box(images, prompt, frame)


@pytest.mark.parametrize("final", ["best_crop", "full_image"])
def test_search_shows_each_view_at_its_own_pixel_bounds(final: str) -> None:
    """View 0 at the root bounds (28x28 for the 300 px image: smart_resize's floor of 300 / sqrt(90000 / 3136)
    / 28 = 1.9999999999999998 in floats), every crop at the crop bounds (a 100 px cell -> 224x224), the
    paper's final call with both at their own sizes."""
    oracle = ShownPixelOracle()
    res = tree_search(
        target_image(),
        ROW,
        oracle,
        SearchConfig(final=final),
        min_pixels=3136,
        max_pixels=3136,
        crop_min_pixels=224 * 224,
        crop_max_pixels=224 * 224,
    )
    assert res.views[0].resized == resized_size(300, 300, 3136, 3136) == (28, 28)
    assert all(v.resized == resized_size(*v.size, 50176, 50176) for v in res.views[1:])
    shown = {v.id: v.resized for v in res.views}
    calls = 2 * len(res.views)  # one yes/no + one box per evaluated view, in order of first evaluation
    assert [s[0] for s in oracle.sizes[:calls:2]] == [shown[v.id] for v in res.views]
    assert res.best_view.region == (200.0, 0.0, 300.0, 100.0)
    if final == "full_image":  # the full image at the root size, the best crop at its own
        assert oracle.sizes[-1] == [(28, 28), (224, 224)]
    else:  # the box read in the 224x224 crop, mapped back: within a pixel of the 20 px target
        assert res.answer_box is not None and box_iou(res.answer_box, TARGET) > 0.85


def test_search_needs_an_expression() -> None:
    with pytest.raises(ValueError, match="test.jsonl:1.*'expression'"):
        tree_search(target_image(), {"_source": "test.jsonl:1"}, PixelOracle(), **AS_IS)
    with pytest.raises(ValueError, match="final='crop'"):
        SearchConfig(final="crop")


def test_format_answer() -> None:
    assert format_answer((240.0, 40.04, 260.25, 60.0)) == "<answer>[240, 40, 260.2, 60]</answer>"
    assert format_answer(None) == "<answer>no box</answer>"


# ============================================================================ the VLM oracle and the policy
@pytest.fixture(scope="module")
def vlm_policy(random_vlm_model_dir: Path) -> Any:
    from mmalign.policies.vlm import VLMPolicy

    torch.manual_seed(0)
    return VLMPolicy.from_pretrained(str(random_vlm_model_dir), max_new_tokens=6)


def test_view_resized_matches_the_processor(vlm_policy: Any) -> None:
    """The protocol's views must have the size the policy's processor really gives the model."""
    from pipelines.grounding.geovis_views import processor_pixel_bounds

    lo, hi, factor = processor_pixel_bounds(vlm_policy.processor)
    assert (lo, hi, factor) == (3136, 3136, 28)  # the tiny processor: min = max = 56 * 56
    for size in [(300, 300), (120, 90), (34, 34), (333, 77)]:
        enc = vlm_policy.encode_row({"prompt": "x", "images": [Image.new("RGB", size)]})
        assert enc["resized_sizes"][0] == View.root(size, lo, hi, factor).resized


def test_vlm_oracle_smoke(vlm_policy: Any) -> None:
    oracle = VLMOracle(vlm_policy)
    assert isinstance(oracle, SearchOracle) and oracle.convention == "resized"
    img = target_image()
    p = oracle.yes_probability([img], YESNO_PROMPT.format(expression="the red square"))
    assert 0.0 <= p <= 1.0
    # against a reference: the softmax of the two next-token logits after the policy's own rendering
    enc = vlm_policy.encode_row({"prompt": YESNO_PROMPT.format(expression="the red square"), "images": [img]})
    with torch.no_grad():
        logits = vlm_policy.model(**vlm_policy.batch_inputs([enc])).logits[0, -1]
    ly, ln = float(logits[oracle.yes_id]), float(logits[oracle.no_id])
    assert abs(p - math.exp(ly) / (math.exp(ly) + math.exp(ln))) < 1e-5
    box = oracle.predict_box([img, crop_image(img, (200, 0, 300, 100))], BOX_PROMPT.format(expression="x"))
    assert box is None or len(box) == 4
    assert isinstance(oracle.last_text, str)


def test_tree_search_policy_rollout(vlm_policy: Any) -> None:
    policy = TreeSearchPolicy(vlm_policy, config=SearchConfig(simulations=3, max_depth=2))
    rows = [
        {"prompt": "p0", "images": [target_image()], "expression": "the red square", "box": list(TARGET)},
        {"prompt": "p1", "images": [target_image().resize((120, 90))], "expression": "it", "object": "a"},
    ]
    r = policy.rollout(rows, 2, compute_logp=False)
    assert len(r) == 4 and r.group.tolist() == [0, 0, 1, 1]
    assert r.mask.shape == (4, 1) and not r.mask.any()
    assert r.columns["expression"] == ["the red square", "the red square", "it", "it"]
    texts, states = r.outputs["texts"], r.outputs["env_state"]
    assert texts[0] == texts[1] and states[0] == states[1]  # temperature 0: one search per row
    for i, (text, state) in enumerate(zip(texts, states, strict=True)):
        assert text.startswith("<answer>") and text.endswith("</answer>")
        assert state["views"][0]["id"] == 0 and state["views"][0]["parent"] is None
        assert state["search"]["simulations"] == 3 and state["search"]["depth_reached"] <= 2
        assert state["search"]["model_calls"] == int(r.outputs["model_calls"][i])
        best = next(v for v in state["views"] if v["id"] == state["best_view"])
        depth = 0
        while best["parent"] is not None:
            best = next(v for v in state["views"] if v["id"] == best["parent"])
            depth += 1
        assert int(r.outputs["num_turns"][i]) == depth + 1
        if "answer_box" in state:
            w, h = (300, 300) if i < 2 else (120, 90)
            x1, y1, x2, y2 = state["answer_box"]
            assert 0 <= x1 <= x2 <= w and 0 <= y1 <= y2 <= h
            assert text == format_answer(state["answer_box"])
    assert policy.trainable_parameters() == vlm_policy.trainable_parameters()
    with pytest.raises(RuntimeError, match="tree search is inference only: use it with `mmalign eval`"):
        policy.action_stats(r)
    with pytest.raises(RuntimeError, match="inference only"):
        policy.reference_logprobs(r)
    with pytest.raises(RuntimeError, match="inference only"):
        policy.rollout(rows, 1, compute_logp=True)
    assert INFERENCE_ONLY in str(pytest.raises(RuntimeError, policy.save, "x").value)


def test_tree_search_policy_temperature_samples_differ(vlm_policy: Any) -> None:
    oracle = PixelOracle()
    policy = TreeSearchPolicy(
        vlm_policy, config=SearchConfig(simulations=4, final="best_crop"), temperature=1.0, oracle=oracle
    )
    torch.manual_seed(0)
    r = policy.rollout([{"prompt": "p", "images": [target_image()], "expression": "the red square"}], 4)
    orders = [[v["region"] for v in s["views"]] for s in r.outputs["env_state"]]
    assert len({str(o) for o in orders}) > 1  # random expansion orders
