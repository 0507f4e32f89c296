"""Process (per-step) rewards in `rewards.RewardSet` and their use by the `grpo_process` estimator.

Expected values are worked out by hand in the comments next to them.
"""

from __future__ import annotations

import math

import pytest
import torch

from mmalign.algorithms import advantages as adv
from mmalign.data.batch import Rollout
from rewards import FunctionReward, Reward, RewardBatch, RewardError, RewardSet, load_reward

NAN = math.nan
INF = math.inf


# --------------------------------------------------------------------------- rewards used by the tests
def length(batch):
    """Outcome reward: the number of characters."""
    return [float(len(t)) for t in batch.texts]


def prm(batch):
    """Per-step reward returning Float[B, T] (T = 4, the rollout below)."""
    return torch.tensor(
        [
            [1.0, NAN, 3.0, 99.0],  # step 3 is masked: 99 is ignored
            [2.0, 4.0, INF, 7.0],  # steps 2, 3 are masked: inf and 7 are ignored
            [NAN, NAN, NAN, NAN],  # no process reward at any step
        ]
    )


prm.per_step = True


def prm_rows(batch):
    """Per-step reward returning lists (None = NaN) instead of a tensor."""
    return [[1.0, None, 3.0, 0.0], [2.0, 4.0, 0.0, 0.0], [None, None, None, None]]


prm_rows.per_step = True


class Ones(Reward):
    """Per-step reward: 1 at every step."""

    per_step = True
    needs = {"texts"}

    def __call__(self, batch):
        return torch.ones(batch.mask.shape)


def make_rollout() -> Rollout:
    # B = 3 samples (groups 0, 0, 1), T = 4 actions
    mask = torch.tensor(
        [
            [True, True, True, False],
            [True, True, False, False],
            [True, True, True, True],
        ]
    )
    return Rollout(
        group=torch.tensor([0, 0, 1]),
        mask=mask,
        prompts=["p0", "p0", "p1"],
        outputs={"texts": ["ab", "abcd", "a"]},
    )


def reward_set(*pairs) -> RewardSet:
    rs = [r if isinstance(r, Reward) else FunctionReward(r) for r, _ in pairs]
    return RewardSet.from_rewards(rs, weights=[w for _, w in pairs])


# --------------------------------------------------------------------------- RewardSet
def test_columns_step_rewards_and_weights():
    rs = reward_set((length, 2.0), (prm, 0.5), (Ones(), 2.0))
    assert rs.names == ["length", "prm", "Ones"]
    assert rs.is_per_step == [False, True, True]
    assert rs.per_step_names == ["prm", "Ones"]
    assert rs.weights.dtype == torch.float32 and rs.weights.tolist() == [2.0, 0.0, 0.0]  # outcome weights
    assert rs.step_weights.dtype == torch.float32 and rs.step_weights.tolist() == [0.0, 0.5, 2.0]
    assert repr(rs) == "RewardSet(length*2, prm*0.5 per step, Ones*2 per step)"
    rollout = make_rollout()
    cols = rs(rollout)
    # length: 2, 4, 1
    # prm column = mean over the valid, non-NaN steps:
    #   sample 0: valid steps 0..2 hold 1, NaN, 3 -> (1 + 3) / 2 = 2
    #   sample 1: valid steps 0..1 hold 2, 4      -> 3
    #   sample 2: all NaN                         -> NaN
    # Ones column: 1 for every sample (each has a valid step)
    assert cols.dtype == torch.float32 and cols.shape == (3, 3)
    torch.testing.assert_close(
        cols, torch.tensor([[2.0, 2.0, 1.0], [4.0, 3.0, 1.0], [1.0, NAN, 1.0]]), equal_nan=True
    )
    # step_rewards = 0.5 * prm + 2 * Ones, NaN read as 0, 0 at masked actions:
    #   sample 0: [0.5 + 2, 0 + 2, 1.5 + 2, 0]   = [2.5, 2, 3.5, 0]
    #   sample 1: [1 + 2, 2 + 2, 0, 0]           = [3, 4, 0, 0]
    #   sample 2: [0 + 2, 0 + 2, 0 + 2, 0 + 2]   = [2, 2, 2, 2]
    s = rollout.step_rewards
    assert s is not None and s.dtype == torch.float32 and s.shape == (3, 4)
    torch.testing.assert_close(
        s, torch.tensor([[2.5, 2.0, 3.5, 0.0], [3.0, 4.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    )
    # the outcome total leaves the per-step columns out: 2 * length = [4, 8, 2]
    torch.testing.assert_close(adv.combine_rewards(cols, rs.weights), torch.tensor([4.0, 8.0, 2.0]))
    # stats treat the per-step column like any other: mean of (2, 3) = 2.5, 1 of 3 NaN
    stats = rs.stats(cols)
    assert stats["reward/prm/mean"] == pytest.approx(2.5)
    assert stats["reward/prm/nan_frac"] == pytest.approx(1 / 3)


def test_list_output_and_loading_by_path():
    # the same per-step reward as lists with None, loaded by "module:function" with an alias
    rs = RewardSet([{"name": f"{__name__}:prm_rows", "alias": "p", "weight": 3.0}])
    assert rs.per_step_names == ["p"] and rs.weights.tolist() == [0.0] and rs.step_weights.tolist() == [3.0]
    rollout = make_rollout()
    cols = rs(rollout)
    torch.testing.assert_close(cols, torch.tensor([[2.0], [3.0], [NAN]]), equal_nan=True)
    # 3 * [1, NaN->0, 3, masked], 3 * [2, 4, masked, masked], all NaN -> 0
    torch.testing.assert_close(
        rollout.step_rewards,
        torch.tensor([[3.0, 0.0, 9.0, 0.0], [6.0, 12.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]),
    )
    # a config whose rewards are all per-step: outcome total 0 where a column is not NaN
    torch.testing.assert_close(
        adv.combine_rewards(cols, rs.weights), torch.tensor([0.0, 0.0, NAN]), equal_nan=True
    )


def test_function_and_class_attributes():
    assert Reward.per_step is False
    assert FunctionReward(length).per_step is False
    assert FunctionReward(prm).per_step is True
    assert load_reward(f"{__name__}:prm").per_step is True
    assert load_reward(f"{__name__}:Ones").per_step is True


def test_outcome_only_set_is_unchanged():
    rs = reward_set((length, 2.0), (lambda b: [0.5] * len(b), 0.25))
    assert rs.weights.tolist() == [2.0, 0.25] and rs.step_weights.tolist() == [0.0, 0.0]
    assert rs.per_step_names == [] and rs.is_per_step == [False, False]
    rollout = make_rollout()
    cols = rs(rollout)
    assert cols.tolist() == [[2.0, 0.5], [4.0, 0.5], [1.0, 0.5]]
    assert rollout.step_rewards is None
    assert repr(rs) == "RewardSet(length*2, <lambda>*0.25)"


def test_reward_batch_without_a_mask():
    # a RewardBatch not built from a rollout: any T, every step valid, no step_rewards anywhere
    batch = RewardBatch(prompts=["a", "b"], outputs={"texts": ["x", "y"]})
    assert batch.mask is None

    def two_steps(batch):
        return torch.tensor([[1.0, 2.0], [NAN, 5.0]])

    two_steps.per_step = True
    cols = reward_set((two_steps, 1.0))(batch)
    torch.testing.assert_close(cols, torch.tensor([[1.5], [5.0]]))
    # from_rollout hands the mask over
    assert torch.equal(RewardBatch.from_rollout(make_rollout()).mask, make_rollout().mask)
    with pytest.raises(ValueError, match=r"2 prompts but mask has shape \(3, 4\)"):
        RewardBatch(prompts=["a", "b"], mask=torch.ones(3, 4, dtype=torch.bool))


@pytest.mark.parametrize(
    ("out", "message"),
    [
        (
            torch.zeros(3),
            r"reward 'bad' \(rewards\[0\]\) returned a tensor of shape \(3,\); a per-step reward returns "
            r"Float\[3, 4\] \(T = rollout.mask.shape\[1\], the number of actions\)",
        ),
        (torch.zeros(3, 5), r"reward 'bad' \(rewards\[0\]\) returned a tensor of shape \(3, 5\); a per-step"),
        (torch.zeros(2, 4), r"returned a tensor of shape \(2, 4\); a per-step reward returns Float\[3, 4\]"),
        (
            torch.tensor([[0.0, INF, 0.0, 0.0]] * 3),
            r"reward 'bad' \(rewards\[0\]\) returned \+/-inf at sample\(s\) \[0, 1, 2\] "
            r"\(use NaN for 'no process reward at this step'\)",
        ),
        ([[0.0] * 4, [0.0] * 3, [0.0] * 4], r"returned rows of different lengths \[3, 4\]"),
        ([0.0, 0.0, 0.0], r"returned float for sample 0; a per-step reward returns Float\[3, 4\]"),
        ([[0.0, "x", 0.0, 0.0]] * 3, r"non-numeric value at sample 0, step 1: 'x'"),
        (torch.zeros(3, 4, dtype=torch.complex64), "returned a complex tensor"),
    ],
)
def test_per_step_errors_name_the_reward_and_the_shapes(out, message):
    def bad(batch):
        return out

    bad.per_step = True
    with pytest.raises(RewardError, match=message):
        reward_set((bad, 1.0))(make_rollout())


def test_outcome_reward_returning_2d_is_an_error():
    def steps_but_not_declared(batch):
        return torch.zeros(3, 4)

    with pytest.raises(RewardError) as info:
        reward_set((steps_but_not_declared, 1.0))(make_rollout())
    assert str(info.value) == (
        "reward 'steps_but_not_declared' (rewards[0]) returned a tensor of shape (3, 4); process rewards "
        "Float[B,T] must declare per_step = True (an outcome reward returns Float[3])"
    )


# --------------------------------------------------------------------------- into the estimator
def test_reward_set_into_grpo_process():
    # one outcome reward and one per-step reward, as the trainer would pass them (one process)
    rs = reward_set((length, 1.0), (prm, 1.0))
    rollout = make_rollout()
    cols = rs(rollout)
    name = "grpo_process"
    assert adv.accepts_step_rewards(name)
    a = adv.get(name)(
        cols,
        rollout.group,
        weights=rs.weights.tolist(),
        step_rewards=rollout.step_rewards,
        step_mask=rollout.mask,
    )
    # group 0 = samples 0, 1: outcome 2, 4 -> mean 3, unbiased sd sqrt(2) -> A_out = -+1/(sqrt2 + 1e-4)
    # process, group 0: step 0: s = 1, 2 -> mean 1.5, sd sqrt(0.5) -> -+0.5/(sqrt0.5 + 1e-4)
    #                   step 1: s = 0 (NaN read as 0), 4 -> mean 2, sd sqrt(8) -> -+2/(sqrt8 + 1e-4)
    #                   step 2: only sample 0 valid -> 0; step 3: masked for both -> 0
    # group 1 = sample 2 alone: 0 everywhere
    o = 1 / (math.sqrt(2) + 1e-4)
    p0 = 0.5 / (math.sqrt(0.5) + 1e-4)
    p1 = 2 / (math.sqrt(8) + 1e-4)
    expected = torch.tensor([[-o - p0, -o - p1, -o, 0.0], [o + p0, o + p1, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(a, expected)


def test_trainer_refuses_a_per_step_reward_with_an_estimator_that_ignores_it(tmp_path) -> None:
    """Both mismatches are ConfigErrors naming 'algorithm.estimator' when the trainer is built, before any
    sampling: a per-step reward with `grpo`, and `grpo_process` without a per-step reward."""
    import pytest
    import torch

    from mmalign.config import ConfigError, config_from_dict
    from mmalign.training.trainer import GroupTrainer
    from pipelines import TrainingSetup
    from rewards import RewardSet, register_reward
    from rewards.base import REGISTRY

    def every_step(batch):
        return batch.mask.float()

    every_step.per_step = True

    def outcome(batch):
        return [1.0] * len(batch)

    class Stub:
        model = torch.nn.Linear(1, 1)

    register_reward("_every_step_for_test")(every_step)
    register_reward("_outcome_for_test")(outcome)
    try:
        for estimator, rewards in (
            ("grpo", ["_every_step_for_test"]),
            ("grpo_process", ["_outcome_for_test"]),
        ):
            cfg = config_from_dict(
                {
                    "pipeline": "x",
                    "output_dir": str(tmp_path / estimator),
                    "rewards": [{"name": n} for n in rewards],
                    "algorithm": {"estimator": estimator},
                }
            )
            comps = TrainingSetup(policy=Stub(), rewards=RewardSet(cfg.rewards), data=[{"prompt": "q"}])
            with pytest.raises(ConfigError, match="algorithm.estimator"):
                GroupTrainer(cfg, comps)
    finally:
        REGISTRY.unregister("_every_step_for_test")
        REGISTRY.unregister("_outcome_for_test")
