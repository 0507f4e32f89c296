"""GRPO-Guard's advantage clip: with ``options.guard_ratio_norm`` on and ``algorithm.adv_clip`` null, the trainer
clamps advantages to [-5, 5] as verl-omni's ``GRPOGuardLoss`` (``adv_clip_max`` 5); an explicit
``algorithm.adv_clip`` wins, and without the guard null means no clamp."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from mmalign.config import GUARD_ADV_CLIP, config_from_dict
from mmalign.policies.sd3 import SD3Policy
from mmalign.training.trainer import GroupTrainer
from pipelines import TrainingSetup
from rewards import RewardSet

ROWS = [{"prompt": "a red cat"}, {"prompt": "a blue dog"}]


def trainer_for(sd3_dir: Path, out: Path, guard: bool, adv_clip: Any) -> GroupTrainer:
    pol = SD3Policy.from_pretrained(
        sd3_dir, num_steps=2, seed=0, max_sequence_length=8, noise_level=0.7, guard_ratio_norm=guard
    )
    algorithm: dict[str, Any] = {"estimator": "dr_grpo"}
    if adv_clip != "unset":
        algorithm["adv_clip"] = adv_clip
    cfg = config_from_dict(
        {
            "pipeline": "guard_adv_clip_test",
            "output_dir": str(out),
            "rewards": [{"name": "jpeg_compressibility"}],
            "rollout": {"group_size": 2, "prompts_per_step": 2},
            "algorithm": algorithm,
            "trainer": {"steps": 1, "lr": 1e-4, "progress_bar": False},
        }
    )
    return GroupTrainer(cfg, TrainingSetup(policy=pol, rewards=RewardSet(cfg.rewards), data=ROWS))


@pytest.mark.parametrize(
    ("guard", "adv_clip", "bound"),
    [
        (True, "unset", 5.0),  # the guard recipe: null -> verl-omni's adv_clip_max 5
        (True, None, 5.0),
        (True, 2.0, 2.0),  # an explicit clip wins
        (False, None, None),  # no guard: null is no clamp
    ],
)
def test_guard_ratio_norm_clamps_advantages_at_5_when_adv_clip_is_null(
    tiny_sd3_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, guard, adv_clip, bound
) -> None:
    with caplog.at_level(logging.WARNING, logger="mmalign.training.trainer"):
        trainer = trainer_for(tiny_sd3_model_dir, tmp_path / "run", guard, adv_clip)
    assert GUARD_ADV_CLIP == 5.0
    said = "guard_ratio_norm is on: advantages are clamped to [-5, 5]" in caplog.text
    assert said == (guard and adv_clip in ("unset", None))
    # dr_grpo: A = r - group mean. Group 0: rewards 0, 20 -> -10, +10 (beyond 5); group 1: 0, 1 -> -0.5, +0.5
    rewards = torch.tensor([0.0, 20.0, 0.0, 1.0])
    adv, keep = trainer.compute_advantages(rewards, torch.tensor([0, 0, 1, 1]))
    big = 10.0 if bound is None else bound
    torch.testing.assert_close(
        adv.to(torch.float64), torch.tensor([-big, big, -0.5, 0.5], dtype=torch.float64)
    )
    assert keep.all()
