"""`Policy.action_chunks`: the trainer scores a microbatch's actions chunk by chunk with a backward after each,
and the accumulated gradient (and the logged loss) equals one backward over the whole microbatch, for every
aggregation mode, with the KL penalty, 2-D advantages, ragged masks, a sequence-level IS correction and
several microbatches. A loss that ties a sample's actions together (gspo) is evaluated in one piece.

The policy is modality-free on purpose: action t of sample i has logp = w . f_{i,t} (stored features), so the
only thing under test is how the trainer splits, aggregates and accumulates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mmalign.config import config_from_dict
from mmalign.data.batch import Rollout
from mmalign.policies.base import ActionStats, Policy
from mmalign.training.trainer import GroupTrainer
from pipelines import TrainingSetup
from rewards import RewardSet

B, T, D = 6, 5, 4


def constant(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    return [1.0] * len(completions)


class FeaturePolicy(Policy):
    """logp[i, t] = w . features[i, t] (+ a per-action weight and a KL of its own when asked); `chunk`: how
    many action columns per chunk (None: no chunks)."""

    def __init__(self, chunk: int | None, *, own_kl: bool = False, loss_weights: bool = False) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(D, 1, bias=False)
        self.forward_model = self.model
        self.chunk = chunk
        self.kl_in_action_stats = own_kl
        self.weighted = loss_weights
        self.calls: list[int] = []

    def _logp(self, rollout: Rollout, cols: torch.Tensor) -> torch.Tensor:
        f = rollout.payload["features"][:, cols]
        return self.forward_model(f).squeeze(-1)

    def rollout(self, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool) -> Rollout:
        raise NotImplementedError  # the test builds its batch by hand

    def action_stats(self, rollout: Rollout, *, actions: torch.Tensor | None = None) -> ActionStats:
        cols = torch.arange(rollout.num_actions) if actions is None else actions
        self.calls.append(len(cols))
        logp = self._logp(rollout, cols)
        stats = ActionStats(logp=logp)
        if self.kl_in_action_stats:
            stats.kl = (logp - rollout.payload["ref"][:, cols]) ** 2
        if self.weighted:
            stats.loss_weights = rollout.payload["weights"][:, cols]
        return stats

    def action_chunks(self, rollout: Rollout) -> list[torch.Tensor] | None:
        if self.chunk is None:
            return None
        t = rollout.num_actions
        return [torch.arange(s, min(s + self.chunk, t)) for s in range(0, t, self.chunk)]

    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        return rollout.payload["ref"]

    def save(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)


def batch(two_d_advantages: bool, with_sampler: bool) -> Rollout:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False  # ragged rows: |o_i| differs, which seq_mean_token_mean divides by
    mask[2, 1:] = False
    mask[4, :] = False  # a row without a valid action
    features = torch.randn(B, T, D, generator=g)
    adv = torch.randn(B, T, generator=g) if two_d_advantages else torch.randn(B, generator=g)
    r = Rollout(
        group=torch.arange(B) // 2,
        mask=mask,
        prompts=["p"] * B,
        payload={
            "features": features,
            "ref": torch.randn(B, T, generator=g) * 0.1,
            "weights": torch.rand(B, T, generator=g) + 0.5,
        },
        advantages=adv,
    )
    with torch.no_grad():
        logp = FeaturePolicy(None).model(features).squeeze(-1)
    r.logp_old = logp + 0.3 * torch.randn(B, T, generator=g)  # ratios away from 1: clipping is active
    if with_sampler:
        r.logp_sampler = r.logp_old + 0.2 * torch.randn(B, T, generator=g)
    return r


def gradient(
    policy: FeaturePolicy, tmp_path: Path, *, rollout: Rollout, **algorithm: Any
) -> tuple[Any, dict]:
    """The gradient the trainer's update accumulates for `rollout` (captured at the optimizer step) and the
    update's metrics."""
    micro = algorithm.pop("microbatch", None)
    is_level = algorithm.pop("is_correction", "none")
    cfg = config_from_dict(
        {
            "pipeline": "chunk_test",
            "output_dir": str(tmp_path / f"run{len(list(tmp_path.iterdir()))}"),
            "rewards": [{"name": f"{__name__}:constant"}],
            "rollout": {"group_size": 2, "prompts_per_step": 3, "is_correction": is_level},
            "algorithm": algorithm,
            "trainer": {"steps": 1, "lr": 1e-3, "microbatch_size": micro, "progress_bar": False},
        }
    )
    trainer = GroupTrainer(
        cfg, TrainingSetup(policy=policy, rewards=RewardSet(cfg.rewards), data=[{"prompt": "p"}])
    )
    seen: list[torch.Tensor] = []
    step = trainer.optimizer.step

    def capture(*args: Any, **kw: Any) -> Any:
        seen.append(policy.model.weight.grad.detach().clone())
        return step(*args, **kw)

    trainer.optimizer.step = capture
    metrics = trainer.update(rollout)
    assert len(seen) == 1
    return seen[0], metrics


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_sum_norm"])
@pytest.mark.parametrize(
    "variant",
    [
        {"kl_coef": 0.3},  # the trainer's KL estimator on logp_ref
        {"kl_coef": 0.3, "own_kl": True},  # the policy's own KL (diffusion's KL on step means)
        {"two_d": True, "loss_weights": True},
        {"sampler": True, "is_correction": "sequence", "microbatch": 4},
    ],
)
def test_chunked_backward_gives_the_one_backward_gradient(tmp_path: Path, agg: str, variant: dict) -> None:
    v = dict(variant)
    kw = {"own_kl": v.pop("own_kl", False), "loss_weights": v.pop("loss_weights", False)}
    r = batch(v.pop("two_d", False), v.pop("sampler", False))
    algorithm = {"loss_agg": agg, "loss_kwargs": {"eps_low": 0.1, "eps_high": 0.1}, **v}
    whole_policy = FeaturePolicy(None, **kw)
    whole, m_whole = gradient(whole_policy, tmp_path, rollout=r, **dict(algorithm))
    for chunk in (1, 2):
        policy = FeaturePolicy(chunk, **kw)
        split, m_split = gradient(policy, tmp_path, rollout=r, **dict(algorithm))
        n_micro = -(-B // (algorithm.get("microbatch") or B))
        assert len(policy.calls) == n_micro * -(-T // chunk) and max(policy.calls) == chunk
        torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-5)
        assert whole.abs().sum() > 0
        for key in ("loss", "clip_frac", "approx_kl", "kl", "is/weight_mean"):
            if key in m_whole:
                assert m_split[key] == pytest.approx(m_whole[key], rel=1e-5, abs=1e-7), key


def test_loss_weights_scale_the_policy_loss_only(tmp_path: Path) -> None:
    """`ActionStats.loss_weights` multiply each action's policy loss before the KL term is added: with all
    weights 2 the policy-loss gradient doubles and the KL's does not."""
    r = batch(False, False)
    r.payload["weights"] = torch.full((B, T), 2.0)
    algorithm = {"loss_agg": "token_mean"}
    plain, _ = gradient(FeaturePolicy(None), tmp_path, rollout=r, **dict(algorithm))
    doubled, _ = gradient(FeaturePolicy(None, loss_weights=True), tmp_path, rollout=r, **dict(algorithm))
    torch.testing.assert_close(doubled, 2 * plain)
    kl_only = {"loss_agg": "token_mean", "kl_coef": 1.0}
    r.advantages = torch.zeros(B)
    a, _ = gradient(FeaturePolicy(None), tmp_path, rollout=r, **dict(kl_only))
    b, _ = gradient(FeaturePolicy(None, loss_weights=True), tmp_path, rollout=r, **dict(kl_only))
    torch.testing.assert_close(a, b)


def test_a_loss_that_couples_actions_is_not_chunked(tmp_path: Path) -> None:
    r = batch(False, False)
    algorithm = {"loss": "gspo", "loss_agg": "seq_mean_token_mean"}
    whole, _ = gradient(FeaturePolicy(None), tmp_path, rollout=r, **dict(algorithm))
    policy = FeaturePolicy(1)
    split, _ = gradient(policy, tmp_path, rollout=r, **dict(algorithm))
    assert policy.calls == [T]  # one call over all actions: gspo's ratio is a mean over the sample's actions
    torch.testing.assert_close(split, whole)
