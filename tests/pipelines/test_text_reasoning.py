"""The `text_reasoning` pipeline: `build(cfg)` on the tiny config with a random tiny LM, what reaches the policy
from the config, and the rollout-loop check that runs before any model is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmalign.config import ConfigError, load_config
from mmalign.policies.text import TextPolicy
from pipelines.common import policy_kwargs
from pipelines.text_reasoning import build

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "text_reasoning-tiny.yaml"


def _lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def test_build_gives_the_policy_rewards_and_rows_the_config_names(random_text_model_dir: Path) -> None:
    cfg = load_config(CONFIG, [f"model.name_or_path={random_text_model_dir}", "model.tiny_builder=null"])
    built = build(cfg)
    assert isinstance(built.policy, TextPolicy)
    assert built.rewards.names == [r.alias or r.name for r in cfg.rewards]
    assert len(built.data) == _lines(REPO / cfg.data.train)
    assert cfg.data.eval is None and built.eval_data is None  # the tiny config has no eval file
    assert all(isinstance(r["prompt"], str) and r["prompt"] for r in built.data)
    assert built.sample_columns == ["answer", "solution"]


def test_eval_rows_come_from_data_eval(random_text_model_dir: Path, tmp_path: Path) -> None:
    rows = tmp_path / "eval.jsonl"
    rows.write_text(
        '{"question": "Q: 1 + 1 = ?", "answer": "2"}\n{"question": "Q: 2 + 2 = ?", "answer": "4"}\n'
    )
    cfg = load_config(
        CONFIG,
        [f"model.name_or_path={random_text_model_dir}", "model.tiny_builder=null", f"data.eval={rows}"],
    )
    built = build(cfg)
    assert [r["answer"] for r in built.eval_data] == ["2", "4"]


def test_policy_kwargs_carry_the_rollout_and_model_keys() -> None:
    cfg = load_config(
        CONFIG,
        [
            "rollout.temperature=0.7",
            "rollout.max_new_tokens=9",
            "rollout.top_k=5",
            "algorithm.kl_coef=0.04",
            "model.logprob_chunk_size=null",
        ],
    )
    kw = policy_kwargs(cfg)
    assert (kw["temperature"], kw["max_new_tokens"], kw["top_k"]) == (0.7, 9, 5)
    assert kw["need_reference"] is True  # kl_coef > 0 keeps a reference
    assert kw["logprob_chunk_size"] is None
    assert policy_kwargs(load_config(CONFIG, ["algorithm.kl_coef=0"]))["need_reference"] is False


def test_a_bad_rollout_loop_is_a_config_error_before_any_model_loads(tmp_path: Path) -> None:
    missing = tmp_path / "no-model-here"
    cfg = load_config(
        CONFIG, [f"model.name_or_path={missing}", "model.tiny_builder=null", "rollout.loop=no_such_loop"]
    )
    with pytest.raises(ConfigError, match="rollout.loop"):
        build(cfg)
    assert not missing.exists()
