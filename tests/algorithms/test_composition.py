"""`LossComposer` without a trainer: the microbatch loss against a plain loop written from the formula
(docs/algorithms.md, "Composing the loss"), its gradient, and chunks adding up to the whole."""

from __future__ import annotations

import math

import pytest
import torch

from mmalign.algorithms.composition import LossComposer, Tally
from mmalign.config import Config, ConfigError
from mmalign.data.batch import Rollout
from mmalign.policies.base import ActionStats

B, T = 3, 4


def _config(**algorithm: object) -> Config:
    cfg = Config()
    cfg.algorithm.loss = "ppo_clip"
    cfg.algorithm.loss_agg = "token_mean"
    cfg.algorithm.kl_coef = 0.1
    cfg.algorithm.kl_estimator = "k3"
    cfg.algorithm.aux_coefs = {"extra": 0.5}
    cfg.rollout.is_correction = "token"
    cfg.rollout.is_cap = 1.5
    for key, value in algorithm.items():
        setattr(cfg.algorithm, key, value)
    return cfg


def _batch() -> tuple[Rollout, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    rollout = Rollout(prompts=["a", "a", "b"], group=torch.tensor([0, 0, 1]), mask=mask)
    rollout.logp_old = -torch.rand(B, T, generator=g, dtype=torch.float64)
    rollout.logp_sampler = rollout.logp_old - 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    rollout.logp_ref = -torch.rand(B, T, generator=g, dtype=torch.float64)
    rollout.advantages = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    logp = (rollout.logp_old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    return rollout, logp


def _reference(
    rollout: Rollout, logp: torch.Tensor, n_tok: float, aux: torch.Tensor, n_seq: float
) -> torch.Tensor:
    """The loss written as a loop over actions: PPO clip x TIS weight + beta k3, summed over valid actions / n_tok,
    plus 0.5 x aux x (samples / n_seq)."""
    total = torch.zeros((), dtype=torch.float64)
    for i in range(B):
        for t in range(T):
            if not rollout.mask[i, t]:
                continue
            ratio = torch.exp(logp[i, t] - rollout.logp_old[i, t])
            a = rollout.advantages[i]
            surrogate = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
            w = min(math.exp(float(rollout.logp_old[i, t] - rollout.logp_sampler[i, t])), 1.5)
            d = rollout.logp_ref[i, t] - logp[i, t]
            k3 = torch.exp(d) - d - 1
            total = total + surrogate * w + 0.1 * k3
    return total / n_tok + 0.5 * aux * (B / n_seq)


def test_the_loss_and_its_gradient_equal_a_plain_loop() -> None:
    rollout, logp = _batch()
    aux = torch.tensor(0.7, dtype=torch.float64)
    composer = LossComposer(_config(), world=1)
    n_tok = float(rollout.mask.sum())
    micro = composer(ActionStats(logp=logp, aux_losses={"extra": aux}), rollout, n_tok, float(B))
    (grad,) = torch.autograd.grad(micro.total, logp)
    ref_logp = logp.detach().clone().requires_grad_(True)
    ref = _reference(rollout, ref_logp, n_tok, aux, float(B))
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    assert float(micro.total.detach()) == pytest.approx(float(ref.detach()), rel=1e-12)
    assert torch.allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert micro.aux == {"aux/extra": pytest.approx(0.7)}


def test_chunks_add_up_to_the_whole_microbatch() -> None:
    rollout, logp = _batch()
    composer = LossComposer(_config(loss_agg="seq_mean_token_mean"), world=1)
    n_tok = float(rollout.mask.sum())
    whole = composer(ActionStats(logp=logp), rollout, n_tok, float(B))
    parts = torch.zeros((), dtype=torch.float64)
    for cols in (torch.tensor([0, 1]), torch.tensor([2, 3])):
        stats = ActionStats(logp=logp[:, cols])
        parts = parts + composer(stats, rollout, n_tok, float(B), actions=cols).total
    assert float(parts) == pytest.approx(float(whole.total), rel=1e-12)


def test_a_policy_computed_loss_takes_the_same_tail() -> None:
    rollout, _ = _batch()
    per_action = torch.rand(B, T, dtype=torch.float64)
    kl = torch.rand(B, T, dtype=torch.float64)
    composer = LossComposer(_config(), world=2)
    micro = composer(ActionStats(logp=None, loss=per_action, kl=kl), rollout, 5.0, float(B))
    expected = sum(
        float(per_action[i, t] + 0.1 * kl[i, t]) for i in range(B) for t in range(T) if rollout.mask[i, t]
    )
    assert float(micro.loss) == pytest.approx(expected / 5.0 * 2, rel=1e-12)  # times the processes
    assert micro.logp is None and micro.is_stats == {}
    tally = Tally()
    tally.add_microbatch(micro, world=2)
    tally.add_optimizer_step(None)
    assert tally.metrics(kl=True)["kl"] == pytest.approx(float(kl[rollout.mask].mean()))


def test_an_aux_term_without_a_coefficient_names_the_key() -> None:
    rollout, logp = _batch()
    composer = LossComposer(_config(aux_coefs={}))
    with pytest.raises(ConfigError, match="algorithm.aux_coefs.extra"):
        composer(ActionStats(logp=logp, aux_losses={"extra": torch.tensor(1.0)}), rollout, 9.0, 3.0)
