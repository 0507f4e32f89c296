"""Every shipped config loads, names registered things, and its rewards can be built."""

from __future__ import annotations

from pathlib import Path

import pytest

import pipelines
from mmalign import advantages, filters, losses
from mmalign.config import load_config
from rewards import RewardSet

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_every_pipeline_has_a_real_and_a_tiny_config() -> None:
    stems = {p.stem for p in CONFIGS}
    for name in pipelines.names():
        assert name in stems and f"{name}-tiny" in stems, name


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_is_valid(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.pipeline in pipelines.names()
    a = cfg.algorithm
    assert a.estimator in advantages.names() and a.loss in losses.names()
    assert a.loss_agg in losses.aggregation_names() and a.kl_estimator in losses.kl_names()
    assert a.filter in filters.names()
    RewardSet(cfg.rewards)  # every reward and its options resolve
