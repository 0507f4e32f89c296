"""The geovis pipeline end to end on a random tiny VLM: the zoom policy trains through the core's multi-turn
loop (crops inserted as images at their own pixel bounds, env_state in the samples, tool-use metrics, the
process reward with grpo_process), one-shot answering through the single-turn loop, the tree search as an
eval-only policy that training refuses, and the per-view pixel options' errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import pipelines
from mmalign import tiny
from mmalign.app.evaluation import evaluate_run
from mmalign.config import ConfigError, load_config
from mmalign.training.trainer import GroupTrainer
from pipelines.grounding.geovis_search import TreeSearchPolicy
from pipelines.grounding.geovis_views import resized_size

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "configs" / "geovis-tiny.yaml"


@pytest.fixture(scope="module")
def geo_random(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "geovis-random"
    tiny.build("geovis_random", path, announce=False)
    return path


def small(model: Path, out: Path, *extra: str):
    return load_config(
        CONFIG,
        [
            f"model.name_or_path={model}",
            f"output_dir={out}",
            "rollout.group_size=2",
            "rollout.prompts_per_step=2",
            "rollout.max_new_tokens=12",
            "rollout.loop_kwargs.max_tokens_per_turn=12",
            "trainer.steps=2",
            "trainer.sample_every=1",
            "trainer.save_every=100",
            "trainer.progress_bar=false",
            "data.max_rows=4",
            "eval.max_rows=2",
            "eval.group_size=1",
            *extra,
        ],
    )


def test_zoom_policy_trains_two_steps(geo_random: Path, tmp_path: Path) -> None:
    cfg = small(geo_random, tmp_path / "run")
    history = GroupTrainer(cfg, pipelines.get("geovis")(cfg)).train()
    for m in history:
        for key in ("tool_call_rate", "num_turns/mean", "over_turn_frac", "reward/box_iou/unparsed_frac"):
            assert key in m, key
        assert "reward/crop_keeps_target/mean" in m
    rows = [
        json.loads(x) for x in (tmp_path / "run" / "samples" / "step_000001.jsonl").read_text().splitlines()
    ]
    assert rows and all(r["env_state"]["views"][0]["id"] == 0 for r in rows)  # view 0 is the whole map
    # configs/geovis-tiny.yaml: the 224 px map at 56x56 (options.root_*_pixels), each crop at 784 px
    for r in rows:
        views = r["env_state"]["views"]
        assert views[0]["resized"] == [56, 56] and views[0]["size"] == [224.0, 224.0]
        for v in views[1:]:
            assert v["resized"] == list(resized_size(*v["size"], 784, 784)), v
    assert all("boxes" in r for r in rows)
    # the samples hold each sample's process rewards by action position: grpo_process recomputed from them in
    # a plain one-process call gives the advantages the trainer wrote (over-turn samples included)
    import sys

    sys.path.insert(0, str(REPO / "tests" / "scripts"))
    import two_process

    assert all(len(r["step_rewards"]) >= r["num_actions"] > 0 for r in rows)
    checked = two_process.check_advantages(tmp_path / "run")
    assert checked["steps"] == 2 and checked["max_abs_diff"] < 1e-5


def test_one_shot_is_the_single_turn_loop(geo_random: Path, tmp_path: Path) -> None:
    cfg = small(
        geo_random,
        tmp_path / "run",
        "rollout.loop=single_turn",
        "rollout.loop_kwargs={}",
        "algorithm.estimator=grpo",
        "rewards=[{name: box_iou, kwargs: {box_key: answer_box, coords: resized}}]",
    )
    comps = pipelines.get("geovis")(cfg)
    report = evaluate_run(cfg, comps, checkpoint=None, progress=False)
    scores = report["base"]["all"]
    assert scores["samples"] == 2 and 0.0 <= scores["acc@0.5"] <= 1.0
    assert scores["turns_used"] == 1.0


def test_view_pixels_of_the_policy_and_the_environment(geo_random: Path, tmp_path: Path) -> None:
    cfg = small(geo_random, tmp_path / "run")
    comps = pipelines.get("geovis")(cfg)
    policy = comps.policy
    assert policy.view_pixels.root == (3136, 3136) and policy.view_pixels.crop == (784, 784)
    env = policy.loop.environment
    assert env.pixels == policy.view_pixels
    # the processor holds both kinds of view (and the rounding of smart_resize around them)
    ip = policy.processor.image_processor
    assert (ip.size["shortest_edge"], ip.size["longest_edge"]) == policy.view_pixels.processor
    row = dict(comps.data[0], prompt="p")
    enc = policy.encode_row(row)
    assert enc["image_sizes"] == [(224, 224)] and enc["resized_sizes"] == [(56, 56)]
    # unset per-view bounds fall back to min_pixels / max_pixels
    cfg = small(
        geo_random,
        tmp_path / "run2",
        "options.root_min_pixels=null",
        "options.root_max_pixels=null",
        "options.min_pixels=12544",
        "options.max_pixels=12544",
    )
    pixels = pipelines.get("geovis")(cfg).policy.view_pixels
    assert pixels.root == (12544, 12544) and pixels.crop == (784, 784)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["options.crop_min_pixels=1000"],
            r"options.crop_min_pixels \(1000\) must be <= options.crop_max_pixels \(784\)",
        ),
        (["options.root_max_pixels=0"], r"options.root_max_pixels must be an integer >= 1"),
        (
            ["options.crop_max_pixels=50176", "rollout.loop_kwargs.max_insert_tokens=40"],
            r"rollout.loop_kwargs.max_insert_tokens' \(40\).*crop_max_pixels \(50176 px = 64 image tokens",
        ),
    ],
)
def test_pixel_options_errors(geo_random: Path, tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        pipelines.get("geovis")(small(geo_random, tmp_path / "run", *overrides))


def test_tree_search_evaluates_and_refuses_training(geo_random: Path, tmp_path: Path) -> None:
    cfg = small(
        geo_random, tmp_path / "run", "options.search=tree", "options.simulations=2", "options.max_depth=1"
    )
    comps = pipelines.get("geovis")(cfg)
    assert isinstance(comps.policy, TreeSearchPolicy)
    report = evaluate_run(cfg, comps, checkpoint=None, progress=False)
    assert report["base"]["all"]["samples"] == 2
    with pytest.raises(ConfigError, match="options.search"):
        GroupTrainer(cfg, comps)
