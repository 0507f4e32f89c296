"""`mmalign.algorithms.names`: every ``*_kwargs`` option checked against what its registry entry declares, before
anything loads, with the key and close matches in the message."""

from __future__ import annotations

import pytest

from mmalign.algorithms.names import check_names, needs_reference
from mmalign.config import ConfigError, config_from_dict

BASE = {"pipeline": "text_reasoning", "output_dir": "runs/x", "rewards": [{"name": "format"}]}


def _cfg(**algorithm: object) -> object:
    return config_from_dict({**BASE, "algorithm": dict(algorithm)})


@pytest.mark.parametrize(
    "algorithm, expected",
    [
        (
            {"loss": "ppo_clip", "loss_kwargs": {"eps_hihg": 0.3}},
            "unknown key 'algorithm.loss_kwargs.eps_hihg' (did you mean 'eps_high'?)",
        ),
        (
            {"loss": "ppo_clip", "loss_kwargs": {"eps_high": "0.3"}},
            "key 'algorithm.loss_kwargs.eps_high' must be float",
        ),
        (
            {"estimator": "grpo", "estimator_kwargs": {"scael": True}},
            "unknown key 'algorithm.estimator_kwargs.scael'",
        ),
        ({"filter": "dynamic_sampling", "filter_kwargs": {"max_round": 3}}, "did you mean 'max_rounds'"),
        (
            {"reward_transforms": [{"name": "unlikeliness", "betta": 0.5}]},
            "unknown key 'algorithm.reward_transforms[0].betta' (did you mean 'beta'?)",
        ),
    ],
)
def test_a_wrong_option_names_its_key(algorithm: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_names(_cfg(**algorithm))
    assert expected in str(e.value)


def test_declared_options_pass_and_trainer_inputs_are_not_options() -> None:
    check_names(_cfg(loss="ppo_clip", loss_kwargs={"eps_high": 0.28}, estimator="grpo", estimator_kwargs={}))
    with pytest.raises(ConfigError, match="estimator_kwargs.context"):
        check_names(_cfg(estimator="grpo", estimator_kwargs={"context": 1}))


def test_a_sampler_option_is_checked_too() -> None:
    cfg = config_from_dict({**BASE, "data": {"sampler": "uniform", "sampler_kwargs": {"shufle": True}}})
    with pytest.raises(ConfigError, match="data.sampler_kwargs.shufle' \\(did you mean 'shuffle'"):
        check_names(cfg)


def test_needs_reference() -> None:
    assert not needs_reference(_cfg())
    assert needs_reference(_cfg(kl_coef=0.01))
    assert needs_reference(_cfg(estimator="ace"))
