"""Issue 35, item 5a: a flow-matching policy trains through one strategy object (`mmalign.policies.flow_training`)
picked once by `setup` -- the policy-gradient path or a forward-process objective -- with no branch on the
objective in `FlowMatchingPolicy`; a new objective is only a `flow_objectives` registry entry; the ``sde``
solver samples through the policy-gradient path's rollout (it recursed into the objective's rollout before);
`ObjectiveSettings.from_config` counts a pairwise objective's whole groups per process."""

from __future__ import annotations

import ast
import inspect
import math
from pathlib import Path

import pytest
import torch

from mmalign.algorithms import flow_objectives as fo
from mmalign.config import ConfigError
from mmalign.policies import flow_matching, flow_training
from mmalign.policies import forward_process as fp
from tests.policies.tiny_t2i import SMALL, t2i_config
from tests.policies.tiny_t2i import make_trainer as make

REPO = Path(__file__).resolve().parents[2]
NFT = REPO / "configs" / "text_to_image-nft-tiny.yaml"
DPO = REPO / "configs" / "text_to_image-dpo-tiny.yaml"
TINY = REPO / "configs" / "text_to_image-tiny.yaml"


def cfg(base: Path, out: Path, *extra: str):
    return t2i_config(base, out, "trainer.save_every=1000", *SMALL, "trainer.steps=1", *extra)


def test_flow_matching_policy_has_no_objective_branch() -> None:
    """No ``if`` / conditional expression in `FlowMatchingPolicy` tests the objective: the strategy decides."""
    tree = ast.parse(inspect.getsource(flow_matching.FlowMatchingPolicy))
    tests = [n.test for n in ast.walk(tree) if isinstance(n, ast.If | ast.IfExp)]
    assert tests  # (the class does branch on other things)
    assert [ast.unparse(t) for t in tests if "objective" in ast.unparse(t)] == []


def test_setup_picks_the_strategy(tmp_path: Path) -> None:
    pg = make(cfg(TINY, tmp_path / "pg"))
    assert pg.policy.training is flow_training.POLICY_GRADIENT and pg.policy.objective is None
    assert pg.policy.callbacks() == []
    nft = make(cfg(NFT, tmp_path / "nft"))
    s = nft.policy.training
    assert isinstance(s, flow_training.ForwardProcessTraining) and nft.policy.objective == "diffusion_nft"
    assert isinstance(s.old_policy, fp.OldPolicy) and isinstance(s.eval_ema, fp.WeightEMA)
    assert nft.policy.callbacks() == [s.old_policy, s.eval_ema]
    # K = int(4 steps * 0.99) = 3 training sigmas per sample (DiffusionNFT's timestep_fraction rule)
    assert s.num_actions == math.floor(4 * 0.99) == 3


def _toy(v, v_old, noise, x0, t, advantages, mask, *, scale: float = 1.0) -> fo.FlowObjectiveOutput:
    """-A times the flow-matching error of each action (a toy objective; 0 where masked)."""
    err = ((v - (noise - x0)) ** 2).flatten(t.ndim).mean(dim=-1)
    adv = advantages[:, None].expand_as(t) if advantages.ndim < t.ndim else advantages
    loss = torch.where(mask, scale * adv * err, torch.zeros_like(err))
    return fo.FlowObjectiveOutput(
        per_action=loss, clipped=torch.zeros_like(mask), stats={"toy_err": err.detach()}
    )


def test_a_new_objective_is_a_registry_entry(tmp_path: Path) -> None:
    """An objective registered from outside trains through the trainer with no change to the policy: its
    options, its timestep defaults (registry metadata) and its stats reach the run."""
    fo.register("toy_fm", timesteps={"strategy": "discrete", "num_timesteps": 2})(_toy)
    try:
        c = cfg(
            TINY, tmp_path / "toy", "algorithm.objective=toy_fm", "algorithm.objective_kwargs={scale: 2.0}"
        )
        t = make(c)
        assert t.policy.training.num_actions == 2 and t.policy.training.settings.objective_kwargs == {
            "scale": 2.0
        }
        before = [p.detach().clone() for p in t.policy.trainable_parameters()]
        hist = t.train()
    finally:
        fo.REGISTRY.unregister("toy_fm")
    assert "objective/toy_err" in hist[0] and math.isfinite(hist[0]["loss"])
    moved = [not torch.equal(a, b) for a, b in zip(before, t.policy.trainable_parameters(), strict=True)]
    assert any(moved)


def test_sde_solver_samples_through_the_policy_gradient_rollout(tmp_path: Path) -> None:
    """``algorithm.solver: sde`` rolls out with the policy's SDE (`DenoisingPolicy.rollout`); before the
    strategy it recursed through the objective's own rollout until RecursionError."""
    t = make(cfg(NFT, tmp_path / "sde", "algorithm.solver=sde", "options.noise_level=0.7"))
    rollout = t.policy.rollout([{"prompt": "a red circle"}], 2)
    assert set(rollout.payload) >= {fp.CLEAN_KEY} and "log_probs" not in rollout.payload
    assert rollout.mask.shape == (2, t.policy.training.num_actions)
    hist = t.train()
    assert math.isfinite(hist[0]["loss"])


def test_whole_groups_are_counted_per_process(tmp_path: Path) -> None:
    """Flow-DPO's minibatch of 8 rows holds two groups of 4 in one process, half a group in each of 4."""
    c = cfg(DPO, tmp_path / "dpo", "trainer.minibatch_size=8")
    assert flow_training.ObjectiveSettings.from_config(c, world=1) is not None
    with pytest.raises(ConfigError, match=r"key 'trainer\.minibatch_size'.*share \(2\).*multiple of the 4"):
        flow_training.ObjectiveSettings.from_config(c, world=4)


def test_settings_merge_the_objectives_timestep_defaults(tmp_path: Path) -> None:
    s = flow_training.ObjectiveSettings.from_config(cfg(TINY, tmp_path / "awm", "algorithm.objective=awm"))
    assert s is not None and s.timesteps == fo.timestep_defaults("awm") and s.old_policy is None
    assert flow_training.ObjectiveSettings.from_config(cfg(TINY, tmp_path / "pg")) is None
