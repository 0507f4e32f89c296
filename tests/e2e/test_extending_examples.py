"""The worked examples of docs/extending.md run as written (their ``python`` blocks, in order, in one
namespace), and what they claim holds: the bandit policy learns through the unchanged trainer, the
process reward and the auxiliary loss reach the update."""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def namespace() -> Iterator[dict[str, Any]]:
    module = types.ModuleType("extending_examples")  # a real module: dataclasses look their module up
    sys.modules[module.__name__] = module
    torch.manual_seed(0)
    try:
        for block in _python_blocks():
            exec(compile(block, str(DOC), "exec"), module.__dict__)  # noqa: S102 - the documentation's code
        yield module.__dict__
    finally:
        import pipelines
        from rewards.base import REGISTRY as REWARDS

        del sys.modules[module.__name__]
        pipelines.REGISTRY.unregister("bandit")
        for name in ("says_choice_2", "later_is_better"):
            REWARDS.unregister(name)


def test_the_documented_policy_learns_through_the_trainer(namespace: dict[str, Any]) -> None:
    history = namespace["history"]
    assert len(history) == 30
    first = sum(m["reward/mean"] for m in history[:3]) / 3
    last = sum(m["reward/mean"] for m in history[-3:]) / 3
    assert first < 0.5 and last > 0.9, (first, last)
    samples = namespace["run_dir"] / "samples" / "step_000001.jsonl"
    assert '"text": "choice' in samples.read_text()


def test_the_documented_pipeline_validates_its_options(namespace: dict[str, Any], tmp_path: Path) -> None:
    import pipelines
    from mmalign.config import ConfigError, config_from_dict

    base = {"pipeline": "bandit", "output_dir": str(tmp_path), "rewards": [{"name": "says_choice_2"}]}
    cfg = config_from_dict({**base, "options": {"arms": 6}}, pipeline_finder=pipelines.find)
    components = pipelines.get("bandit")(cfg)
    assert components.policy.model.out_features == 6
    with pytest.raises(ConfigError, match="arm"):
        config_from_dict({**base, "options": {"armz": 6}}, pipeline_finder=pipelines.find)


def test_the_documented_environment_inserts_a_crop_once(namespace: dict[str, Any]) -> None:
    from PIL import Image

    from mmalign.data.rollout_loops import DONE, Conversation, Insert, TurnContext

    image = Image.new("RGB", (32, 32), (10, 200, 30))
    conv = Conversation(index=0, group_index=0, row={"image": image, "prompt": "find the car"}, prompt=None)
    zoom_in = namespace["zoom_in"]
    first = zoom_in(TurnContext(conversation=conv, turn=0, text="let me zoom in", finished=True))
    assert isinstance(first, Insert) and first.images[0].size == (32, 32)
    assert zoom_in(TurnContext(conversation=conv, turn=0, text="it is red", finished=True)) is DONE
    assert zoom_in(TurnContext(conversation=conv, turn=1, text="zoom again", finished=True)) is DONE


def test_the_documented_process_reward_fills_step_rewards(namespace: dict[str, Any]) -> None:
    from rewards import RewardSet

    policy = namespace["BanditPolicy"]()
    rollout = policy.rollout([{"prompt": "q"}], 4, compute_logp=False)
    rollout.mask = torch.tensor([[True, True, True, True]]).repeat(4, 1)
    rollout.payload["actions"] = rollout.payload["actions"].repeat(1, 4)
    rs = RewardSet([{"name": "says_choice_2"}, {"name": "later_is_better", "weight": 0.5}])
    rs(rollout)
    # positions 1..4 of 4 valid actions: cumsum/len = .25 .5 .75 1 -> later half (> .5) scores 1, times 0.5
    expected = torch.tensor([[0.0, 0.0, 0.5, 0.5]]).repeat(4, 1)
    assert torch.equal(rollout.step_rewards, expected)


def test_the_documented_aux_loss_is_added_with_its_coefficient(namespace: dict[str, Any]) -> None:
    from mmalign.config import config_from_dict
    from mmalign.training.trainer import GroupTrainer
    from pipelines import TrainingSetup
    from rewards import RewardSet

    def run(coef: float, tmp: Path) -> tuple[list[dict[str, Any]], torch.Tensor]:
        torch.manual_seed(0)
        cfg = config_from_dict(
            {
                "pipeline": "bandit",
                "output_dir": str(tmp),
                "rewards": [{"name": "says_choice_2"}],
                "rollout": {"group_size": 8, "prompts_per_step": 4},
                "algorithm": {"aux_coefs": {"logit_l2": coef}},
                "trainer": {"steps": 3, "lr": 0.1, "progress_bar": False, "save_every": 100},
            }
        )
        policy = namespace["BanditWithPrior"]()
        comps = TrainingSetup(policy=policy, rewards=RewardSet(cfg.rewards), data=[{"prompt": "q"}] * 4)
        return GroupTrainer(cfg, comps).train(), policy.model.weight.detach().clone()

    base = namespace["run_dir"].parent
    hist0, w0 = run(0.0, base / "aux0")
    hist1, w1 = run(100.0, base / "aux1")
    assert "aux/logit_l2" in hist1[-1] and hist1[-1]["aux/logit_l2"] >= 0
    # the same samples at step 1 (same seed) but a strong pull toward 0: smaller logits
    assert w1.abs().sum() < w0.abs().sum()
