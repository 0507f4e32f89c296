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


@pytest.mark.parametrize(
    "algorithm, expected",
    [
        # a Literal annotation lists its choices (adora's rule)
        (
            {"estimator": "adora", "estimator_kwargs": {"rule": "late"}},
            "key 'algorithm.estimator_kwargs.rule' must be one of 'release', 'early', got str 'late'",
        ),
        # a Literal of strings refuses a number
        (
            {"estimator": "grpo", "estimator_kwargs": {"std": 1}},
            "key 'algorithm.estimator_kwargs.std' must be one of 'group', 'batch', 'none', got int 1",
        ),
        # the objective's options go through the same typed check
        (
            {"objective": "awm", "objective_kwargs": {"ema_kl_beta": "lots"}},
            "key 'algorithm.objective_kwargs.ema_kl_beta' must be float, got str 'lots'",
        ),
        (
            {"objective": "diffusion_nft", "objective_kwargs": {"betta": 1.0}},
            "unknown key 'algorithm.objective_kwargs.betta' (did you mean 'beta'?)",
        ),
    ],
)
def test_values_are_checked_against_the_annotations(algorithm: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_names(_cfg(**algorithm))
    assert expected in str(e.value)


def test_the_rollout_loop_and_its_options_are_checked() -> None:
    cfg = config_from_dict({**BASE, "rollout": {"loop": "multi_turn", "loop_kwargs": {"max_turn": 3}}})
    with pytest.raises(ConfigError, match=r"rollout.loop_kwargs.max_turn' \(did you mean 'max_turns'"):
        check_names(cfg)
    cfg = config_from_dict({**BASE, "rollout": {"loop": "multi_turn", "loop_kwargs": {"reward_text": "all"}}})
    with pytest.raises(ConfigError, match="reward_text' must be one of 'conversation', 'last_turn'"):
        check_names(cfg)
    with pytest.raises(ConfigError, match="key 'rollout.loop'"):
        check_names(config_from_dict({**BASE, "rollout": {"loop": "multi_trun"}}))
    check_names(
        config_from_dict({**BASE, "rollout": {"loop": "multi_turn", "loop_kwargs": {"max_turns": 2}}})
    )
