"""What the trainer would refuse about a config after its model loaded is refused by the validation pass first
(`mmalign.app.preflight.check_training_setup`): batches that do not split over the launched processes
(``WORLD_SIZE``) and a group filter's bad option values. The model folder does not exist and every way of
loading a model raises (`no_model`), so each error must come before any model."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mmalign.app import preflight
from mmalign.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def validate(tmp_path: Path, *overrides: str) -> None:
    data = yaml.safe_load((ROOT / "configs" / "text_reasoning-tiny.yaml").read_text())
    data["data"] = {
        k: str(ROOT / v) if isinstance(v, str) and "/" in v else v for k, v in data["data"].items()
    }
    data["model"]["name_or_path"] = str(tmp_path / "no-such-model")
    data["model"]["tiny_builder"] = None
    data["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    preflight.validate(load_config(path, list(overrides)), resume=False)


@pytest.mark.parametrize(
    "world, overrides, expected",
    [
        ("3", ["rollout.prompts_per_step=4"], "key 'rollout.prompts_per_step' (4) must be divisible by the number of processes (3)"),
        ("2", ["rollout.prompts_per_step=4", "trainer.minibatch_size=5"], "key 'trainer.minibatch_size' must be divisible"),
        ("1", ["algorithm.filter=dynamic_sampling", "algorithm.filter_kwargs={max_rounds: 0}"], "key 'algorithm.filter_kwargs'"),
        ("1", ["algorithm.group_refill={replay: true, prefix_fractions: [2]}"], "key 'algorithm.group_refill': group refill: prefix_fractions"),
    ],
)  # fmt: skip
def test_refused_before_any_model(tmp_path, monkeypatch, no_model, world, overrides, expected) -> None:
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ConfigError) as e:
        validate(tmp_path, *overrides)
    assert expected in str(e.value) and "c.yaml" in str(e.value)


def test_a_config_that_splits_reaches_the_model_check(tmp_path, monkeypatch, no_model) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="no-such-model"):  # the next check: the model folder
        validate(tmp_path, "rollout.prompts_per_step=4", "trainer.minibatch_size=4")
