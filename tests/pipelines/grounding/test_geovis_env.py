"""GeoViS zoom environment (`pipelines.grounding.geovis_env`), its rewards (`rewards.search`), the GeoViS policy's
per-view pixel bounds (`pipelines.grounding.geovis.GeoViSPolicy`) and the tiny GeoViS warm start's rendering
(`mmalign.tiny.geovis`): crop parsing, clipping, refusals, the recorded state, replay, the global mapping of
an answer (hand-worked, with one set of pixel bounds and with crops shown larger than the map), the
multi_turn length budget, image-token accounting, log-probs across turns, the per-step placement of the
process reward, and the warm start's training sequence against the policy's own rollout, token for token."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from mmalign import tiny
from mmalign.data.rollout_loops import Done, Insert, Segment, TurnContext
from mmalign.tiny import geovis as tg
from pipelines.grounding.geovis import GeoViSPolicy
from pipelines.grounding.geovis_env import ZOOM_PROMPT, ZoomEnvironment, parse_action, replay
from pipelines.grounding.geovis_views import View, ViewPixels, view_image
from rewards import RewardBatch
from rewards.search import CropKeepsTarget, SearchFormat, ToolUseBonus, TurnsUsed, turn_runs

PIX = 3136  # min_pixels = max_pixels: the map (view 0) is shown at 56x56
CROP = 112 * 112  # the crops of the policy tests are shown at 112x112 (8x8 patches, 4x4 merged tokens)


# ----------------------------------------------------------------------------- helpers


def stripes(w: int, h: int) -> Any:
    """A w x h RGB picture whose every pixel is distinct enough to tell crops apart (x, y, x ^ y)."""
    from PIL import Image

    img = Image.new("RGB", (w, h))
    img.putdata([(x % 256, y % 256, (x * 7 + y * 13) % 256) for y in range(h) for x in range(w)])
    return img


def env(**kw: Any) -> ZoomEnvironment:
    return ZoomEnvironment(**{"min_pixels": PIX, "max_pixels": PIX, **kw})


class Conv:
    """The bits of a Conversation the environment reads (row, state)."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.row, self.state = row, {}


def run_turns(e: ZoomEnvironment, row: dict[str, Any], turns: list[str]) -> tuple[dict[str, Any], list[Any]]:
    conv = Conv(row)
    replies = []
    for t, text in enumerate(turns):
        ctx = TurnContext(conversation=conv, turn=t, text=text, finished=True)  # type: ignore[arg-type]
        replies.append(e(ctx))
        if isinstance(replies[-1], Done):
            break
    return conv.state, replies


@pytest.fixture()
def wide(tmp_path: Path) -> dict[str, Any]:
    """A 112x56 picture on disk: under 3136 pixels it reaches the model as 56x28 (hand-worked:
    smart_resize(56, 112) -> 56*112 > 3136, beta = sqrt(6272/3136) = 1.414, h = floor(56/1.414/28)*28 = 28,
    w = floor(112/1.414/28)*28 = 56): each resized pixel is 2x2 original pixels."""
    path = tmp_path / "wide.png"
    stripes(112, 56).save(path)
    return {
        "images": [str(path)],
        "image_width": 112,
        "image_height": 56,
        "boxes": [[40.0, 25.0, 60.0, 40.0]],
    }


# ----------------------------------------------------------------------------- parsing


def test_parse_action_forms() -> None:
    assert parse_action("<crop>[1,2,3,4]</crop>") == ("crop", None, [1.0, 2.0, 3.0, 4.0])
    assert parse_action("look <crop view=2>[ 1.5, 2 ,3,4 ]</crop> then") == ("crop", 2, [1.5, 2.0, 3.0, 4.0])
    assert parse_action("<answer>[5,6,7,8]</answer><crop>[1,2,3,4]</crop>") == (
        "answer",
        None,
        [5.0, 6.0, 7.0, 8.0],
    )
    assert parse_action("<crop>[1,2,3]</crop>") == ("crop", None, None)
    assert parse_action("<answer>none</answer>") == ("answer", None, None)
    assert parse_action("the lake is blue") is None


# ----------------------------------------------------------------------------- the environment


def test_view0_crop_answer_mapping_hand_worked(wide: dict[str, Any]) -> None:
    from PIL import Image

    # turn 0: a crop in view 0's resized pixels (56x28): [10,5,30,20] * 2 -> [20,10,60,40] original px
    # view 1 is 40x30 px; smart_resize(30, 40): 28x28 = 784 < 3136, beta = sqrt(1200/3136) = 0.6186,
    #   h = ceil(30/0.6186/28)*28 = 56, w = ceil(40/0.6186/28)*28 = 84 -> resized (84, 56)
    # turn 1: answer [42,28,84,56] in view 1: x = 20 + 42*40/84 = 40, y = 10 + 28*30/56 = 25,
    #   x2 = 20 + 84*40/84 = 60, y2 = 10 + 56*30/56 = 40
    state, replies = run_turns(env(), wide, ["<crop>[10,5,30,20]</crop>", "<answer>[42,28,84,56]</answer>"])
    ins = replies[0]
    assert isinstance(ins, Insert) and ins.text == "View 1:" and ins.role == "user" and len(ins.images) == 1
    with Image.open(wide["images"][0]) as im:  # the exact crop of the original, shown at its resized size
        expected = im.convert("RGB").crop((20, 10, 60, 40)).resize((84, 56), Image.Resampling.BICUBIC)
    assert ins.images[0].size == (84, 56) and list(ins.images[0].getdata()) == list(expected.getdata())
    assert isinstance(replies[1], Done)
    assert state == {
        "views": [
            {
                "id": 0,
                "parent": None,
                "region": [0.0, 0.0, 112.0, 56.0],
                "size": [112.0, 56.0],
                "resized": [56, 28],
            },
            {
                "id": 1,
                "parent": 0,
                "region": [20.0, 10.0, 60.0, 40.0],
                "size": [40.0, 30.0],
                "resized": [84, 56],
            },
        ],
        "crops": [{"turn": 0, "view": 1, "accepted": True, "reason": ""}],
        "answer_box": [40.0, 25.0, 60.0, 40.0],
        "answer_turn": 1,
    }
    assert json.loads(json.dumps(state)) == state  # JSON-serialisable as is


def test_crops_shown_at_their_own_pixel_bounds_hand_worked(wide: dict[str, Any]) -> None:
    """View 0 at 3136 px (56x28, as above), crops at 112*112 = 12544 px: the same crop request opens the same
    region, shown larger, and an answer in the larger crop maps back to the same original pixels."""
    # view 1 = [20,10,60,40], 40x30 px: smart_resize(30, 40, 12544, 12544): 28x28 < 12544,
    #   beta = sqrt(12544/1200) = 3.2332, h = ceil(30*3.2332/28)*28 = ceil(3.464)*28 = 112,
    #   w = ceil(40*3.2332/28)*28 = ceil(4.619)*28 = 140 -> resized (140, 112)
    # answer [70,56,140,112] in view 1: x = 20 + 70*40/140 = 40, y = 10 + 56*30/112 = 25, x2 = 60, y2 = 40
    e = env(crop_min_pixels=CROP, crop_max_pixels=CROP)
    state, replies = run_turns(e, wide, ["<crop>[10,5,30,20]</crop>", "<answer>[70,56,140,112]</answer>"])
    assert [v["resized"] for v in state["views"]] == [[56, 28], [140, 112]]
    assert state["views"][1]["region"] == [20.0, 10.0, 60.0, 40.0]
    assert replies[0].images[0].size == (140, 112)
    assert state["answer_box"] == [40.0, 25.0, 60.0, 40.0]
    assert (
        replay(wide, ["<crop>[10,5,30,20]</crop>", "<answer>[70,56,140,112]</answer>"], **e_options())
        == state
    )
    with pytest.raises(ValueError, match=r"crop_min_pixels \(20000\) must be <= crop_max_pixels \(12544\)"):
        env(crop_min_pixels=20000, crop_max_pixels=CROP)


def e_options() -> dict[str, Any]:
    return {"min_pixels": PIX, "max_pixels": PIX, "crop_min_pixels": CROP, "crop_max_pixels": CROP}


def test_crop_in_earlier_view_clipping_and_reversed_corners(wide: dict[str, Any]) -> None:
    turns = [
        "<crop>[10,5,30,20]</crop>",  # view 1 = [20,10,60,40]
        "<crop view=0>[-10,-10,20,12]</crop>",  # view 0 frame: [-20,-20,40,24] -> clipped [0,0,40,24]
        "<crop view=1>[84,56,42,0]</crop>",  # view 1 frame, corners reversed: [40,10,60,40]
        "<answer>[0,0,28,28]</answer>",  # in the LATEST view (3): [40,10,60,40], resized 56x84 -> half
    ]
    state, replies = run_turns(env(max_views=8), wide, turns)
    regions = [v["region"] for v in state["views"]]
    assert regions == [[0, 0, 112, 56], [20, 10, 60, 40], [0, 0, 40, 24], [40, 10, 60, 40]]
    assert [v["parent"] for v in state["views"]] == [None, 0, 0, 1]
    # view 3 is 20x30 px: smart_resize(30, 20) -> 28x28 < 3136, beta = sqrt(600/3136) = 0.4374,
    #   h = ceil(30/0.4374/28)*28 = 84, w = ceil(20/0.4374/28)*28 = 56
    assert state["views"][3]["resized"] == [56, 84]
    # answer [0,0,28,28] in view 3: x = 40 + 28*20/56 = 50, y = 10 + 28*30/84 = 20
    assert state["answer_box"] == [40.0, 10.0, 50.0, 20.0] and state["answer_turn"] == 3
    assert [type(r).__name__ for r in replies] == ["Insert", "Insert", "Insert", "Done"]
    assert [r.text for r in replies[:3]] == ["View 1:", "View 2:", "View 3:"]


@pytest.mark.parametrize(
    ("turn", "reason"),
    [
        ("<crop>[10,5,12,20]</crop>", "too small"),  # 4 px wide (< min_crop_px 8)
        ("<crop>[0,0,40,5]</crop>", "aspect ratio 8"),  # 80x10 px
        ("<crop>[60,30,70,40]</crop>", "empty after clipping"),  # [120,60,..] lies right of the image
        ("<crop view=3>[0,0,10,10]</crop>", "unknown view 3"),
        ("<crop>[1,2,3]</crop>", "no box"),
    ],
)
def test_refused_crops(wide: dict[str, Any], turn: str, reason: str) -> None:
    state, replies = run_turns(env(), wide, [turn, "<answer>[1,1,4,4]</answer>"])
    ins = replies[0]
    assert isinstance(ins, Insert) and list(ins.images) == [] and ins.role == "user"
    assert ins.text.startswith("Crop refused: ") and reason in ins.text
    assert len(state["views"]) == 1
    assert state["crops"] == [
        {"turn": 0, "view": None, "accepted": False, "reason": state["crops"][0]["reason"]}
    ]
    assert reason in state["crops"][0]["reason"]
    assert state["answer_box"] == [2.0, 2.0, 8.0, 8.0]  # still in view 0 (x2 in both axes)


def test_view_limit_and_episode_ends(wide: dict[str, Any]) -> None:
    state, replies = run_turns(env(max_views=2), wide, ["<crop>[10,5,30,20]</crop>"] * 2 + ["no action"])
    assert replies[1].text.startswith("Crop refused: view limit reached")
    assert isinstance(replies[2], Done) and "answer_box" not in state
    state, replies = run_turns(env(), wide, ["<answer>[a,b,c,d]</answer>", "<answer>[1,1,2,2]</answer>"])
    assert len(replies) == 1 and isinstance(replies[0], Done)
    assert "answer_box" not in state and state["crops"] == []


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="option 'convention'"):
        ZoomEnvironment(convention="pixels")
    with pytest.raises(ValueError, match="max_aspect"):
        ZoomEnvironment(max_aspect=0.5)
    with pytest.raises(ValueError, match="min_pixels"):
        ZoomEnvironment(min_pixels=5000, max_pixels=3136)


def test_conventions_norm1000(wide: dict[str, Any]) -> None:
    # norm1000 of view 0: [250,250,500,750] -> [28,14,56,42]; answer norm1000 [0,0,500,500] of view 1 (28x28
    # px at [28,14]) -> [28,14,42,28]
    state, _ = run_turns(
        env(convention="qwen2_vl"), wide, ["<crop>[250,250,500,750]</crop>", "<answer>[0,0,500,500]</answer>"]
    )
    assert state["views"][1]["region"] == [28.0, 14.0, 56.0, 42.0]
    assert state["answer_box"] == [28.0, 14.0, 42.0, 28.0]


# ----------------------------------------------------------------------------- rewards


def test_search_format() -> None:
    turns = [
        ["<crop>[1,2,3,4]</crop>", " <answer>[1, 2, 3, 4]</answer>\n"],
        ["<crop view=0>[1,2,3,4]</crop>", "<answer>[1,2,3,4]</answer>"],
        ["<answer>[1,2,3,4]</answer>"],
        ["<crop>[1,2,3,4]</crop>"],  # a crop last
        ["<crop>[1,2,3,4]</crop> and more", "<answer>[1,2,3,4]</answer>"],  # extra text
        ["<answer>[1,2,3,4]</answer><answer>[1,2,3,4]</answer>"],  # two actions
        ["<answer>[1,2,3]</answer>"],
    ]
    batch = RewardBatch(prompts=[""] * len(turns), outputs={"turns": turns, "texts": [""] * len(turns)})
    assert SearchFormat()(batch).tolist() == [1, 1, 1, 0, 0, 0, 0]
    single = RewardBatch(prompts=["", ""], outputs={"texts": ["<answer>[1,2,3,4]</answer>", "[1,2,3,4]"]})
    assert SearchFormat()(single).tolist() == [1, 0]


def test_crop_keeps_target_per_step_placement() -> None:
    # sample 0: turns at positions [0,3), [5,9), [12,14) (inserted tokens between); crops at turns 0 and 1
    # sample 1: one turn [0,2) then padding; no crops -> all NaN
    # sample 2: a refused crop at turn 0 ([1,4)) and an accepted crop at turn 1 ([6,7)) that misses the target
    mask = torch.zeros(3, 15, dtype=torch.bool)
    mask[0, 0:3] = mask[0, 5:9] = mask[0, 12:14] = True
    mask[1, 0:2] = True
    mask[2, 1:4] = mask[2, 6:7] = True
    views = [
        {"id": 0, "parent": None, "region": [0, 0, 100, 100], "size": [100, 100], "resized": [56, 56]},
        {"id": 1, "parent": 0, "region": [0, 0, 50, 50], "size": [50, 50], "resized": [56, 56]},
        {"id": 2, "parent": 1, "region": [10, 10, 28, 28], "size": [18, 18], "resized": [56, 56]},
    ]
    states = [
        {
            "views": views,
            "crops": [
                {"turn": 0, "view": 1, "accepted": True, "reason": ""},
                {"turn": 1, "view": 2, "accepted": True, "reason": ""},
            ],
        },
        {},
        {
            "views": views[:2],
            "crops": [
                {"turn": 0, "view": None, "accepted": False, "reason": "too small"},
                {"turn": 1, "view": 1, "accepted": True, "reason": ""},
            ],
        },
    ]
    # target [20,20,30,30]: inside view 1 entirely; view 2 keeps [20,28]x[20,28] = 64 of 100 -> 0.64
    boxes = [[[20, 20, 30, 30]], [[20, 20, 30, 30]], [[60, 60, 70, 70]]]
    batch = RewardBatch(
        prompts=[""] * 3,
        outputs={"texts": [""] * 3, "env_state": states},
        columns={"boxes": boxes},
        mask=mask,
    )
    out = CropKeepsTarget(placement="last")(batch)
    expected = torch.full((3, 15), math.nan)
    expected[0, 2] = 1.0  # last action of turn 0
    expected[0, 8] = 0.0  # turn 1: 0.64 < 0.9
    expected[2, 3] = 0.0  # refused
    expected[2, 6] = 0.0  # accepted, target outside
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(
        out.nan_to_num(-1), expected.nan_to_num(-1)
    )
    # the default spreads each crop turn's value over all of that turn's actions
    out = CropKeepsTarget()(batch)
    expected = torch.full((3, 15), math.nan)
    expected[0, 0:3] = 1.0
    expected[0, 5:9] = 0.0
    expected[2, 1:4] = 0.0
    expected[2, 6:7] = 0.0
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(
        out.nan_to_num(-1), expected.nan_to_num(-1)
    )
    out = CropKeepsTarget(min_inside=0.6, placement="last")(batch)
    assert out[0, 8] == 1.0
    with pytest.raises(ValueError, match="placement"):
        CropKeepsTarget(placement="first")
    assert turn_runs(mask[0]) == [(0, 3), (5, 9), (12, 14)]
    with pytest.raises(ValueError, match="min_inside"):
        CropKeepsTarget(min_inside=0.0)


def test_tool_use_bonus_and_turns_used() -> None:
    crops = [
        [],
        [{"turn": 0, "view": None, "accepted": False, "reason": "x"}],
        [{"turn": 0, "view": 1, "accepted": True, "reason": ""}],
        [{"turn": t, "view": t + 1, "accepted": True, "reason": ""} for t in range(3)],
    ]
    batch = RewardBatch(
        prompts=[""] * 4,
        outputs={
            "texts": [""] * 4,
            "env_state": [{"crops": c} for c in crops],
            "num_turns": torch.tensor([1, 2, 2, 4]),
        },
    )
    assert ToolUseBonus()(batch).tolist() == [0, 0, 1, 1]
    assert ToolUseBonus(cap=2)(batch).tolist() == [0, 0, 0.5, 1]
    assert TurnsUsed()(batch).tolist() == [1.0, 2.0, 2.0, 4.0]
    assert ToolUseBonus()(RewardBatch(prompts=[""], outputs={"texts": [""]})).tolist() == [0]


# ----------------------------------------------------------------------------- the policy (tiny random VLM)


@pytest.fixture(scope="module")
def geo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "geovis-random"
    tiny.build("geovis_random", path, announce=False)
    return path


@pytest.fixture(scope="module")
def maps(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Two tiny GeoViS maps on disk, as grounding rows with the ZOOM_PROMPT."""
    folder = tmp_path_factory.mktemp("maps")
    rng = random.Random(3)
    rows = []
    for i in range(2):
        m = tg.draw_map(rng)
        m.image.save(folder / f"{i}.png")
        row = tg.map_row(m, f"{i}.png")
        row["images"] = [str(folder / row.pop("image"))]
        row["prompt"] = ZOOM_PROMPT.format(expression=row["expression"])
        rows.append(row)
    return rows


PIXELS = ViewPixels(root=(PIX, PIX), crop=(CROP, CROP))


def scripted_policy(path: Path, script: list[list[str]], group: int, **loop_kwargs: Any) -> GeoViSPolicy:
    """A GeoViSPolicy (map at 56x56, crops at 112x112) whose turns are `script[row][turn]` (tokenized +
    <|im_end|>) instead of samples: the environment, insertions, payload and log-probs are the policy's own."""
    policy = GeoViSPolicy.from_pretrained(
        str(path),
        max_new_tokens=40,
        temperature=0.7,
        view_pixels=PIXELS,
        loop="multi_turn",
        loop_kwargs={"max_turns": 4, **loop_kwargs},
        environment=env(crop_min_pixels=CROP, crop_max_pixels=CROP),
    )
    tok = policy.tokenizer
    eos = tok.convert_tokens_to_ids(tg.IM_END)

    def generate_turn(convs: list[Any], budgets: list[int]) -> list[Segment]:
        out = []
        for conv, budget in zip(convs, budgets, strict=True):
            full = tok(script[conv.index // group][len(conv.turns)], add_special_tokens=False)[
                "input_ids"
            ] + [eos]
            ids = full[:budget]
            text = tok.decode(ids, skip_special_tokens=True)
            out.append(Segment(ids=ids, trained=True, text=text, finished=len(ids) == len(full)))
        return out

    policy.generate_turn = generate_turn  # type: ignore[method-assign]
    return policy


def zoom_script(row: dict[str, Any]) -> list[str]:
    """A crop of view 0 around the target (resized 56x56 = original / 4), then an answer in view 1."""
    x1, y1, x2, y2 = row["boxes"][0]
    cx, cy = round((x1 + x2) / 8), round((y1 + y2) / 8)
    return [f"<crop>[{cx - 7},{cy - 7},{cx + 7},{cy + 7}]</crop>", "<answer>[20,21,27,28]</answer>"]


def image_runs(ids: torch.Tensor, image_id: int) -> list[int]:
    """Lengths of the runs of image-pad tokens in `ids`, in order."""
    runs, n = [], 0
    for t in ids.tolist() + [-1]:
        if t == image_id:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_rollout_state_tokens_and_logprobs(geo_dir: Path, maps: list[dict[str, Any]]) -> None:
    scripts = [zoom_script(maps[0]), ["<crop>[0,0,1,1]</crop>", *zoom_script(maps[1])]]
    policy = scripted_policy(geo_dir, scripts, group=2)
    torch.manual_seed(0)
    ro = policy.rollout(maps, 2, compute_logp=True)
    p = ro.payload
    image_id = policy.processor.image_token_id
    merge = policy.processor.image_processor.merge_size
    assert ro.outputs["num_turns"].tolist() == [2, 2, 3, 3]
    assert ro.outputs["stop_reasons"] == ["done"] * 4
    assert ro.outputs["inserted_texts"][2][0].startswith("Crop refused: too small")
    # box rewards read the ORIGINAL map size and the size the model saw view 0 at
    assert ro.columns["image_width"] == [224] * 4 and ro.columns["image_height"] == [224] * 4
    assert ro.columns["resized_width"] == [56] * 4 and ro.columns["resized_height"] == [56] * 4
    for i in range(4):
        row = maps[i // 2]
        live = ro.outputs["env_state"][i]
        assert live == replay(row, ro.outputs["turns"][i], **e_options())
        # the map at 56x56 (4x4 patches); the 56 px crop at 112x112 (8x8 patches): smart_resize(56, 56,
        # 12544, 12544) = 56 * sqrt(12544 / 3136) = 112 a side
        assert [v["resized"] for v in live["views"]] == [[56, 56], [112, 112]]
        assert json.loads(json.dumps(live)) == live
        assert "answer_box" in live and len(live["views"]) == 2
        # the environment's predicted resized size of every view = what the processor made of it
        grid = p["image_grid_thw"][i]
        assert [[int(w) * 14, int(h) * 14] for _, h, w in grid.tolist()] == [
            v["resized"] for v in live["views"]
        ]
        # image tokens: prompt + completion hold exactly sum(t*h*w / merge^2) pads, one whole run per image
        n = int(p["completion_attention_mask"][i].sum())
        ids = torch.cat([p["prompt_ids"][i][p["prompt_mask"][i].bool()], p["completion_ids"][i][:n]])
        per_image = [int(g.prod()) // merge**2 for g in grid]
        assert image_runs(ids, image_id) == per_image and int((ids == image_id).sum()) == sum(per_image)
        assert not bool(ro.mask[i][p["completion_ids"][i] == image_id].any())
    # log-probs of the rollout (no grad) = recomputed with grad, across turns
    new = policy.action_stats(ro).logp
    assert torch.allclose(new.detach(), ro.logp_old, atol=1e-5, rtol=0)
    assert bool(ro.mask.any(1).all()) and bool((ro.logp_old[ro.mask] < 0).all())


def test_rollout_logprobs_match_a_plain_forward(geo_dir: Path, maps: list[dict[str, Any]]) -> None:
    """logp_old of a 2-turn sample = one plain forward over the rendered conversation (built here from the
    chat template and the processor, not by the policy's code)."""
    row = maps[0]
    policy = scripted_policy(geo_dir, [zoom_script(row)], group=1)
    ro = policy.rollout([row], 1, compute_logp=True)
    state = ro.outputs["env_state"][0]
    from PIL import Image

    with Image.open(row["images"][0]) as im:
        original = im.convert("RGB")
    # the map shrunk to 56x56, the crop enlarged to 112x112, by hand (bicubic, as the views are shown)
    crop = original.crop(tuple(int(v) for v in state["views"][1]["region"]))
    shown = [
        original.resize((56, 56), Image.Resampling.BICUBIC),
        crop.resize((112, 112), Image.Resampling.BICUBIC),
    ]
    turns = ro.outputs["turns"][0]
    messages = tg.zoom_messages(row["expression"], turns, ["View 1:"])
    ex = tg.render_conversation(policy.processor, messages, shown)
    with torch.no_grad():
        logits = policy.model(
            input_ids=ex["input_ids"][None],
            mm_token_type_ids=ex["mm_token_type_ids"][None],
            pixel_values=ex["pixel_values"],
            image_grid_thw=ex["image_grid_thw"],
        ).logits[0]
    logits[:, policy.suppressed_ids] = float("-inf")
    logp = torch.log_softmax(logits / 0.7, dim=-1)[:-1].gather(-1, ex["input_ids"][1:, None]).squeeze(-1)
    trained = ex["labels"][1:] != -100
    assert torch.allclose(ro.logp_old[0][ro.mask[0]], logp[trained], atol=1e-5, rtol=0)


def test_warm_start_sequence_equals_rollout(geo_dir: Path, maps: list[dict[str, Any]]) -> None:
    """The builder's rendered zoom conversation (a) = prompt + generated ids + inserted segment of the
    policy's multi_turn rollout, token for token, with the loss exactly on the generated tokens."""
    row = maps[1]
    policy = scripted_policy(geo_dir, [zoom_script(row)], group=1)
    ro = policy.rollout([row], 1, compute_logp=False)
    p = ro.payload
    n = int(p["completion_attention_mask"][0].sum())
    rollout_ids = torch.cat([p["prompt_ids"][0][p["prompt_mask"][0].bool()], p["completion_ids"][0][:n]])
    from PIL import Image

    with Image.open(row["images"][0]) as im:
        original = im.convert("RGB")
    turns = ro.outputs["turns"][0]
    e = env(crop_min_pixels=CROP, crop_max_pixels=CROP)
    inserted = e.step({}, row, 0, turns[0])
    assert isinstance(inserted, Insert)
    messages = tg.zoom_messages(row["expression"], turns, [inserted.text])
    root = View.root(original.size, PIX, PIX)
    ex = tg.render_conversation(policy.processor, messages, [view_image(original, root), *inserted.images])
    assert ex["input_ids"].tolist() == rollout_ids.tolist()
    n_prompt = int(p["prompt_mask"][0].sum())
    assert (ex["labels"] != -100).tolist() == [False] * n_prompt + ro.mask[0][:n].tolist()
    assert torch.equal(ex["image_grid_thw"], p["image_grid_thw"][0])
    assert torch.equal(ex["pixel_values"], p["pixel_values"][0])
    # the builder's own example maker renders the same layout (its crop and answer are its own draws)
    ex2 = tg.zoom_example(policy.processor, tg.draw_map(random.Random(1)), random.Random(2), e)
    text = policy.tokenizer.decode(ex2["input_ids"][ex2["labels"] != -100])
    # (a coarse crop, a fine crop of it, the answer in the fine crop)
    assert text.startswith("<crop>[") and text.count("<|im_end|>") == 3 and text.count("<crop>[") == 2
    assert "<answer>[" in text and ex2["image_grid_thw"].shape[0] == 3


@pytest.mark.parametrize(
    ("limit", "reason"), [({"max_insert_tokens": 8}, "insert_too_long"), ("cap", "max_completion_tokens")]
)
def test_length_budget_ends_the_episode_without_cutting_an_image(
    geo_dir: Path, maps: list[dict[str, Any]], limit: Any, reason: str
) -> None:
    row = maps[0]
    script = [zoom_script(row)]
    from transformers import AutoTokenizer

    tok_len = len(AutoTokenizer.from_pretrained(str(geo_dir))(script[0][0])["input_ids"]) + 1
    # "cap": room for the first turn and part of the insertion (an image of 16 pads + text), not all of it
    kwargs = {"max_completion_tokens": tok_len + 6} if limit == "cap" else limit
    policy = scripted_policy(geo_dir, script, group=1, **kwargs)
    ro = policy.rollout([row], 1, compute_logp=True)
    assert ro.outputs["stop_reasons"] == [reason] and bool(ro.outputs["truncated"][0])
    assert ro.outputs["num_turns"].tolist() == [1]
    p = ro.payload
    image_id = policy.processor.image_token_id
    n = int(p["completion_attention_mask"][0].sum())
    assert n == tok_len and int((p["completion_ids"][0][:n] == image_id).sum()) == 0
    assert p["image_grid_thw"][0].shape[0] == int(p["num_prompt_images"][0]) == 1  # only the prompt's image
    # the environment did accept the crop (recorded), the loop dropped the insertion
    assert ro.outputs["env_state"][0]["crops"][0]["accepted"]
    assert torch.allclose(policy.action_stats(ro).logp.detach(), ro.logp_old, atol=1e-5, rtol=0)


def test_warm_start_zoom_labels_hold_the_target_and_map_back() -> None:
    """The builder's 3-turn labels under the tiny task's own bounds (map 56x56, crops 28x28): replayed
    through the environment, both crops hold the whole target, each crop is shown at one merged token, and
    the answer maps back to the target within the jitter (0.3 resized px ~ 0.25 original px)."""
    from pipelines.grounding.geovis_views import ViewPixels as VP

    assert tg.VIEW_PIXELS == VP(root=(3136, 3136), crop=(784, 784))
    processor = tg.geovis_processor()
    tok = processor.tokenizer
    e = tg.zoom_environment()
    for seed in range(6):
        m = tg.draw_map(random.Random(seed))
        ex = tg.zoom_example(processor, m, random.Random(100 + seed), e)
        assert ex["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 2], [1, 2, 2]]  # 4 tokens, 1, 1
        labelled = tok.decode(ex["input_ids"][ex["labels"] != -100]).split("<|im_end|>")[:3]
        turns = [t.strip() for t in labelled]
        row = {"images": [m.image], "image_width": 224, "image_height": 224}
        state = replay(row, turns, **e_tiny())
        b = m.box
        assert len(state["views"]) == 3
        for v in state["views"][1:]:
            r = v["region"]
            assert r[0] <= b[0] and r[1] <= b[1] and r[2] >= b[2] and r[3] >= b[3], (seed, v)
            assert v["resized"] == [28, 28]
        assert max(abs(x - y) for x, y in zip(state["answer_box"], b, strict=True)) < 1.5


def e_tiny() -> dict[str, Any]:
    return {"min_pixels": 3136, "max_pixels": 3136, "crop_min_pixels": 784, "crop_max_pixels": 784}
