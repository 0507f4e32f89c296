"""Auxiliary loss terms (`ActionStats.aux_losses`, `algorithm.aux_coefs`), checked with hand-worked numbers.

The policy's sampling is rewarded with a constant, so every group has zero reward std and every advantage
is 0: the policy-gradient loss contributes no gradient and the only force on the weights is the auxiliary
term. One AdamW step from zero state moves each weight by lr * g / (|g| + eps) ~ lr * sign(g) (bias
correction cancels at step 1), which makes the expected weights a hand computation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mmalign.config import ConfigError, config_from_dict
from mmalign.data.batch import Rollout
from mmalign.policies.base import ActionStats, Policy
from mmalign.training.trainer import GroupTrainer, TrainingError
from pipelines import TrainingSetup
from rewards import RewardSet


def constant(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    return [1.0] * len(completions)


class WeightPolicy(Policy):
    """Three weights w; one action per sample; the auxiliary term is mean(w^2) (name `l2`)."""

    def __init__(self, aux_name: str = "l2") -> None:
        self.model = torch.nn.Linear(3, 1, bias=False)
        with torch.no_grad():
            self.model.weight.copy_(torch.tensor([[1.0, 2.0, -3.0]]))
        self.forward_model = self.model
        self.aux_name = aux_name

    def _logp(self, model: torch.nn.Module, n: int) -> torch.Tensor:
        return model(torch.zeros(n, 3))  # 0 with grad: the PG loss has zero gradient anyway

    @torch.no_grad()
    def rollout(self, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool) -> Rollout:
        n = len(rows) * group_size
        return Rollout(
            group=torch.arange(len(rows)).repeat_interleave(group_size),
            mask=torch.ones(n, 1, dtype=torch.bool),
            prompts=[r["prompt"] for r in rows for _ in range(group_size)],
            outputs={"texts": ["x"] * n},
            logp_old=self._logp(self.model, n) if compute_logp else None,
        )

    def action_stats(self, rollout: Rollout) -> ActionStats:
        stats = ActionStats(logp=self._logp(self.forward_model, len(rollout)))
        stats.aux_losses[self.aux_name] = self.forward_model.weight.pow(2).mean()
        return stats

    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        return torch.zeros(len(rollout), 1)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    def save(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)


def train(tmp_path: Path, *, coef: float | None, microbatch: int | None = None, name: str = "l2") -> Any:
    algorithm: dict[str, Any] = {} if coef is None else {"aux_coefs": {"l2": coef}}
    cfg = config_from_dict(
        {
            "pipeline": "aux_test",
            "output_dir": str(tmp_path / f"run_{coef}_{microbatch}_{name}"),
            "rewards": [{"name": f"{__name__}:constant"}],
            "rollout": {"group_size": 4, "prompts_per_step": 2},
            "algorithm": algorithm,
            "trainer": {
                "steps": 1,
                "lr": 0.1,
                "max_grad_norm": 1e6,  # never clips; logs the gradient norm
                "microbatch_size": microbatch,
                "progress_bar": False,
                "save_every": 100,
            },
        }
    )
    policy = WeightPolicy(name)
    comps = TrainingSetup(
        policy=policy, rewards=RewardSet(cfg.rewards), data=[{"prompt": "a"}, {"prompt": "b"}]
    )
    history = GroupTrainer(cfg, comps).train()
    return history[-1], policy.model.weight.detach().flatten()


def test_aux_term_moves_the_weights_by_hand_worked_amounts(tmp_path: Path) -> None:
    m, w = train(tmp_path, coef=0.5)
    # grad of 0.5 * mean(w^2) = w / 3 = (1/3, 2/3, -1): first Adam step -> w - 0.1 * sign(w)
    assert torch.allclose(w, torch.tensor([0.9, 1.9, -2.9]), atol=1e-5)
    assert m["aux/l2"] == pytest.approx((1 + 4 + 9) / 3, rel=1e-6)  # logged before the step
    assert m["grad_norm"] == pytest.approx((1 / 9 + 4 / 9 + 1) ** 0.5, rel=1e-5)  # |(1/3, 2/3, -1)|
    _, w0 = train(tmp_path, coef=0.0)
    assert torch.equal(w0, torch.tensor([1.0, 2.0, -3.0]))  # coefficient 0: no force at all


def test_microbatches_see_the_minibatch_mean(tmp_path: Path) -> None:
    m1, w1 = train(tmp_path, coef=0.5)
    m2, w2 = train(tmp_path, coef=0.5, microbatch=2)  # 4 microbatches, each 1/4 of the samples
    assert torch.allclose(w1, w2, atol=1e-6)
    assert m2["aux/l2"] == pytest.approx(m1["aux/l2"], rel=1e-6)
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)  # the sum of shares is 1, not 4


def test_a_term_without_a_coefficient_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(TrainingError) as err:
        train(tmp_path, coef=0.5, name="distill")
    assert isinstance(err.value.__cause__, ConfigError)
    assert "algorithm.aux_coefs" in str(err.value) and "distill" in str(err.value)
