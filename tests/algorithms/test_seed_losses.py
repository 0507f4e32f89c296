"""loss:target_entropy (mmalign/algorithms/seed_losses.py): PPO plus a targeted entropy regulariser."""

from __future__ import annotations

import pytest
import torch

from mmalign.algorithms import (
    losses,
    seed_losses,  # noqa: F401  (registers target_entropy)
)
from mmalign.algorithms.seed_losses import entropy_surrogate


def test_surrogate_gradient_is_minus_the_exact_entropy_gradient_in_expectation():
    """Summing the surrogate over every action weighted by pi gives -grad H of a categorical (exact reference)."""
    torch.manual_seed(0)
    logits = torch.randn(5, dtype=torch.float64, requires_grad=True)
    logp_all = torch.log_softmax(logits, -1)
    h = -(logp_all.exp() * logp_all).sum()
    (exact,) = torch.autograd.grad(h, logits, retain_graph=True)
    probs = logp_all.exp().detach()
    expected = sum(
        probs[a]
        * entropy_surrogate(
            logp_all[a].view(1, 1), h.detach().view(1, 1), torch.ones(1, 1, dtype=torch.bool)
        )[0, 0]
        for a in range(5)
    )
    (grad,) = torch.autograd.grad(expected, logits)
    assert grad.tolist() == pytest.approx((-exact).tolist(), abs=1e-10)


def test_target_entropy_adds_the_signed_regulariser_to_ppo_clip():
    torch.manual_seed(1)
    logp = torch.randn(2, 3, dtype=torch.float64) - 1
    old = logp + 0.1 * torch.randn(2, 3, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    ent = torch.tensor([[0.1, 0.2, 9.0], [0.3, 0.4, 0.5]], dtype=torch.float64)
    mean_h = (0.1 + 0.2 + 0.3 + 0.4 + 0.5) / 5
    for target, sign in ((1.0, 1.0), (0.1, -1.0)):
        out = losses.get("target_entropy")(logp, old, adv, mask, target=target, coef=0.5, entropy=ent)
        ppo = losses.get("ppo_clip")(logp, old, adv, mask)
        for i in range(2):
            for t in range(3):
                want = 0.0
                if mask[i, t]:
                    want = (
                        ppo.per_token[i, t].item()
                        + 0.5 * sign * (logp[i, t] + ent[i, t]).item() * logp[i, t].item()
                    )
                assert out.per_token[i, t].item() == pytest.approx(want)
        assert mean_h < 1.0 and mean_h > 0.1
    with pytest.raises(ValueError, match="entropy"):
        losses.get("target_entropy")(logp, old, adv, mask)
    assert "entropy" in losses.options("target_entropy")
