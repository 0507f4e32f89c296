"""The safe-diffusion pipeline (SafeDiffusion-R1): data mixing, policy choice, training and the eval report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import pipelines
from mmalign.app.cli import main
from mmalign.config import ConfigError, load_config
from mmalign.policies.ddim import DDIMPolicy
from mmalign.policies.sd3 import SD3Policy
from mmalign.training.trainer import GroupTrainer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from mmalign import tiny

    d = tmp_path_factory.mktemp("safe_models")
    return {"ddim": tiny.build("ddim_sd15_tiny", d / "ddim"), "flow": tiny.build("flow_sd3_tiny", d / "flow")}


def write_config(tmp_path: Path, models, **changes) -> Path:
    rows = {
        "safe.jsonl": [
            {"prompt": "one blue square on the left", "colour": "blue"},
            {"prompt": "one green square at the top", "colour": "green"},
        ],
        "unsafe.txt": "one red square on the left\n# a comment\none red square at the top\n",
    }
    for name, content in rows.items():
        text = content if isinstance(content, str) else "".join(json.dumps(r) + "\n" for r in content)
        (tmp_path / name).write_text(text)
    cfg = {
        "pipeline": "safe_diffusion",
        "output_dir": str(tmp_path / "run"),
        "model": {"name_or_path": str(models["ddim"])},
        "data": {"prompt_template": "{prompt}"},
        "options": {
            "policy": "ddim",
            "num_steps": 3,
            "guidance_scale": 1.0,
            "safe_prompts": [str(tmp_path / "safe.jsonl")],
            "unsafe_prompts": [str(tmp_path / "unsafe.txt")],
            "eval_safe_prompts": [str(tmp_path / "safe.jsonl")],
            "eval_unsafe_prompts": [str(tmp_path / "unsafe.txt")],
        },
        "rollout": {"group_size": 2, "prompts_per_step": 2},
        "rewards": [{"name": "colour_present", "weight": -1.0, "kwargs": {"colour": "red", "min_pixels": 1}}],
        "trainer": {"steps": 1, "lr": 1e-3, "save_every": 1, "progress_bar": False},
        "eval": {
            "group_size": 2,
            "split_column": "category",
            "rewards": [{"name": "colour_present", "alias": "flagged", "kwargs": {"colour": "red"}}],
        },
    }
    for key, value in changes.items():
        node = cfg
        *path, last = key.split(".")
        for k in path:
            node = node[k]
        node[last] = value
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_rows_are_mixed_and_labelled(tmp_path, models):
    cfg = load_config(write_config(tmp_path, models))
    comp = pipelines.get("safe_diffusion")(cfg)
    assert isinstance(comp.policy, DDIMPolicy) and comp.policy.num_steps == 3
    assert [(r["prompt"], r["category"]) for r in comp.data] == [
        ("one blue square on the left", "safe"),
        ("one green square at the top", "safe"),
        ("one red square on the left", "unsafe"),
        ("one red square at the top", "unsafe"),
    ]
    assert comp.data[0]["colour"] == "blue"  # the other columns reach the rewards
    assert len(comp.eval_data) == 4


def test_flow_policy_option(tmp_path, models):
    cfg = load_config(
        write_config(
            tmp_path, models, **{"model.name_or_path": str(models["flow"]), "options.policy": "flow"}
        )
    )
    assert isinstance(pipelines.get("safe_diffusion")(cfg).policy, SD3Policy)


def test_sampler_options_are_validated_and_reach_the_policy(tmp_path, models):
    """The sampler keys are `SamplerSettings` (validated at load, naming the key); policy ddim samples DDIM
    steps with noise eta, policy flow takes the flow keys; options.seed (default: the top-level seed) seeds."""
    with pytest.raises(ConfigError, match=r"eta \(the noise_level of sde_kind ddim\) must be in \(0, 1\]"):
        load_config(write_config(tmp_path, models, **{"options.eta": 1.5}))
    # eta 0 (deterministic DDIM) samples for `mmalign sample` / `eval`, but training with it is refused
    cfg = load_config(write_config(tmp_path, models, **{"options.eta": 0.0}))
    with pytest.raises(ConfigError, match=r"key 'options\.(eta|noise_level)': 0 samples the deterministic"):
        GroupTrainer(cfg, pipelines.get("safe_diffusion")(cfg))
    with pytest.raises(ConfigError, match="sde_kind 'cps' is a flow-policy step"):
        load_config(write_config(tmp_path, models, **{"options.sde_kind": "cps"}))
    with pytest.raises(ConfigError, match="num_steps must be >= 1"):
        load_config(write_config(tmp_path, models, **{"options.num_steps": 0}))
    cfg = load_config(write_config(tmp_path, models, **{"options.eta": 0.5, "options.window_size": 2}))
    pol = pipelines.get("safe_diffusion")(cfg).policy
    assert (
        pol.sampler == cfg.options.policy_sampler(seed=cfg.seed) and pol.eta == 0.5 and pol.window_size == 2
    )
    changes = {"model.name_or_path": str(models["flow"]), "options.policy": "flow", "options.sde_kind": "cps"}
    cfg = load_config(
        write_config(tmp_path, models, **changes, **{"options.noise_level": 0.5, "options.seed": 7})
    )
    pol = pipelines.get("safe_diffusion")(cfg).policy
    assert (
        isinstance(pol, SD3Policy)
        and pol.sde_kind == "cps"
        and pol.noise_level == 0.5
        and pol.sampler.seed == 7
    )


def test_training_needs_both_categories(tmp_path, models):
    cfg = load_config(write_config(tmp_path, models, **{"options.unsafe_prompts": []}))
    with pytest.raises(ConfigError, match="no unsafe rows"):
        pipelines.get("safe_diffusion")(cfg)


def test_data_file_category_is_checked(tmp_path, models):
    bad = tmp_path / "mixed.jsonl"
    bad.write_text(
        json.dumps({"prompt": "x", "category": "safe"})
        + "\n"
        + json.dumps({"prompt": "y", "category": "nsfw"})
        + "\n"
    )
    cfg = load_config(write_config(tmp_path, models, **{"data.train": str(bad)}))
    with pytest.raises(ConfigError, match=r"mixed.jsonl:2: column 'category' must be 'safe' or 'unsafe'"):
        pipelines.get("safe_diffusion")(cfg)


def test_train_then_eval_report_per_category(tmp_path, models, capsys):
    path = write_config(tmp_path, models)
    assert main(["train", str(path)]) == 0
    assert main(["eval", str(path)]) == 0
    out = capsys.readouterr().out
    rep = json.loads((tmp_path / "run" / "eval.json").read_text())
    for col in ("base", "trained"):
        assert set(rep[col]) == {"all", "safe", "unsafe"}
        assert rep[col]["unsafe"]["samples"] == 4 and rep[col]["safe"]["samples"] == 4
        assert 0.0 <= rep[col]["unsafe"]["flagged"] <= 1.0
    assert "unsafe" in out and "flagged" in out
    # the sample grid: 4 prompts x 2 samples of 16x16 images
    assert main(["sample", str(path), "-n", "2", "--out", str(tmp_path / "s")]) == 0
    assert (tmp_path / "s" / "grid.png").is_file()
    assert len(list((tmp_path / "s" / "media").glob("*.png"))) == 8  # `mmalign sample` writes media/


def test_shipped_configs_load():
    for name in ("safe_diffusion.yaml", "safe_diffusion-tiny.yaml"):
        cfg = load_config(ROOT / "configs" / name)
        assert cfg.pipeline == "safe_diffusion" and cfg.eval.split_column == "category"


@pytest.mark.slow
def test_tiny_config_suppresses_the_unsafe_concept(tmp_path, monkeypatch):
    """The offline config end to end (tiny UNet and CLIP built into tmp, ~7 min on 2 cores): after training,
    fewer images of the held-out unsafe (red) prompts show red, while safe prompts keep their scenes."""
    from mmalign.app.evaluation import evaluate_run
    from mmalign.training.trainer import GroupTrainer

    monkeypatch.chdir(ROOT)  # the config's asset paths are relative to the repository
    models = tmp_path / "models"
    cfg = load_config(
        ROOT / "configs" / "safe_diffusion-tiny.yaml",
        [
            f"output_dir={tmp_path / 'run'}",
            "trainer.progress_bar=false",
            "trainer.sample_every=1000",
            f"model.name_or_path={models / 'unet'}",
            f"options.reward_models={{{models / 'clip'}: clip_shapes_tiny}}",
            f"rewards.0.kwargs.path={models / 'clip'}",
            f"eval.rewards.2.kwargs.path={models / 'clip'}",
        ],
    )
    comps = pipelines.get("safe_diffusion")(cfg)
    GroupTrainer(cfg, comps).train()
    final = tmp_path / "run" / "checkpoints" / f"step_{cfg.trainer.steps:06d}"
    fresh = pipelines.get("safe_diffusion")(
        cfg
    )  # the base weights (`comps.policy` now holds the trained ones)
    rep = evaluate_run(cfg, fresh, checkpoint=final, progress=False)
    base, trained = rep["base"], rep["trained"]
    assert base["unsafe"]["flagged"] >= 0.5, base  # the base model does draw the concept
    assert trained["unsafe"]["flagged"] <= base["unsafe"]["flagged"] - 0.3, (
        base["unsafe"],
        trained["unsafe"],
    )
    # the safe prompts' reward holds (measured: 0.197 -> 0.189) and their scenes mostly survive
    assert trained["safe"]["clip_steering"] >= base["safe"]["clip_steering"] - 0.03, (
        base["safe"],
        trained["safe"],
    )
    assert trained["safe"]["shapes_compositional"] >= base["safe"]["shapes_compositional"] - 0.2, (
        base,
        trained,
    )
    assert trained["safe"]["flagged"] <= 0.1
