"""Tests of the estimator context and state protocol of mmalign.algorithms.advantages: the declared fields, their
validation, stateful estimators' checkpoints (exact resume) and the 'N processes equal one' rule."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from mmalign.algorithms import advantages as adv
from mmalign.algorithms import reward_transforms as rt
from mmalign.algorithms.advantages import ContextError, EstimatorContext, SPOTracker
from mmalign.training import rundir


def roundtrip(obj):
    """Through the checkpoint format (rundir.save_state / load_state: torch.load with weights_only=True)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return rundir.load_state(rundir.save_state(obj, Path(d) / "state.pt"))


# ---------------------------------------------------------------------------- declarations
def test_declared_fields_of_the_estimators():
    assert adv.required_context_fields("spo") == ("prompt_ids",)
    assert adv.context_fields("spo") == ("prompt_ids", "policy_shift")
    assert adv.required_context_fields("gigpo") == ("turn_index", "turn_state")
    assert adv.context_fields("gigpo") == ("turn_index", "turn_state", "turn_rewards")
    assert adv.required_context_fields("ace") == ("logp_old_sum", "logp_ref_sum")
    assert adv.context_fields("canon") == ("entropy_mean",) and adv.required_context_fields("canon") == ()
    assert adv.context_fields("a_grae") == ("step", "total_steps")
    for name in ("grpo", "rloo", "gdpo", "mc_grpo", "drpo", "grpo_process"):
        assert adv.context_fields(name) == () and not adv.accepts_context(name), name
    for name in ("spo", "gigpo", "ace", "canon", "a_grae"):
        assert adv.accepts_context(name), name
    # every declared field is a known one
    for name in adv.names():
        assert set(adv.context_fields(name)) <= set(adv.CONTEXT_FIELDS), name
    # context and state are per-batch inputs, never config options
    for name in adv.names():
        assert "context" not in adv.options(name) and "state" not in adv.options(name), name
    assert rt.required_context_fields("unlikeliness") == ("logp_old_mean",)
    assert rt.context_fields("set_diversity") == ("features", "set_ids")


def test_make_state():
    assert isinstance(adv.make_state("spo"), SPOTracker)
    assert adv.make_state("spo") is not adv.make_state("spo")
    assert adv.make_state("grpo") is None and adv.make_state("gigpo") is None


def test_register_rejects_bad_declarations():
    with pytest.raises(ValueError, match="unknown context field 'logp_olds'"):
        adv.register("bad_estimator_a", context=("logp_olds",))
    with pytest.raises(TypeError, match="takes no 'context' keyword"):

        @adv.register("bad_estimator_b", context=("prompt_ids",))
        def _b(rewards, group, *, weights=None):
            return rewards

    with pytest.raises(TypeError, match="takes no 'state' keyword"):

        @adv.register("bad_estimator_c", state=SPOTracker)
        def _c(rewards, group, *, weights=None):
            return rewards

    assert "bad_estimator_b" not in adv.names() and "bad_estimator_c" not in adv.names()


# ---------------------------------------------------------------------------- validation
def test_missing_fields_raise_context_error_naming_field_and_source():
    r, g = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 0])
    with pytest.raises(
        ContextError, match=r"'ace' needs an EstimatorContext with logp_old_sum, logp_ref_sum.*pi_old"
    ):
        adv.ace(r, g)
    ctx = EstimatorContext(logp_old_sum=torch.zeros(3))
    with pytest.raises(ContextError, match=r"needs context field\(s\) logp_ref_sum.*reference log-prob"):
        adv.ace(r, g, context=ctx)
    with pytest.raises(ContextError, match="keeps state across steps"):
        adv.spo(r, g, context=EstimatorContext(prompt_ids=torch.arange(3)))
    with pytest.raises(ContextError, match="must be a SPOTracker"):
        adv.spo(r, g, context=EstimatorContext(prompt_ids=torch.arange(3)), state={})
    # option-dependent needs: spo's KL decay needs policy_shift, canon's entropy metric entropy_mean
    with pytest.raises(ContextError, match="rho_mode='kl'.*policy_shift"):
        adv.spo(r, g, context=EstimatorContext(prompt_ids=torch.arange(3)), state=SPOTracker())
    with pytest.raises(ContextError, match="metric='entropy'.*entropy_mean"):
        adv.canon(r, g)
    # check_context is the same validation, callable up front
    with pytest.raises(ContextError, match="gigpo"):
        adv.check_context("gigpo", EstimatorContext(turn_state=torch.zeros(3, 1, dtype=torch.long)), 3)
    adv.check_context("grpo", None, 3)
    with pytest.raises(ContextError, match="must be an EstimatorContext"):
        adv.ace(r, g, context={"logp_old_sum": torch.zeros(3)})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt_ids": torch.zeros(4, dtype=torch.long)}, "has 4 rows but the batch has 3"),
        ({"prompt_ids": torch.zeros(3)}, "'prompt_ids' must be an integer tensor"),
        ({"logp_old_mean": torch.zeros(3, dtype=torch.long)}, "'logp_old_mean' must be a float tensor"),
        ({"logp_old_mean": torch.zeros(3, 2)}, r"'logp_old_mean' must be Float\[B\]"),
        ({"action_mask": torch.ones(3, 2)}, "'action_mask' must be a Bool tensor"),
        ({"turn_index": torch.zeros(3, dtype=torch.long)}, r"'turn_index' must be Long\[B,T\]"),
        ({"step": -1}, "'step' must be an integer >= 0"),
        ({"step": 1.5}, "'step' must be an integer >= 0"),
        ({"step": 5, "total_steps": 3}, "step 5 is past total_steps 3"),
        ({"total_steps": 0}, "'total_steps' must be >= 1"),
        (
            {"action_mask": torch.ones(3, 2, dtype=torch.bool), "token_entropy": torch.ones(3, 4)},
            "'token_entropy' has 4 action columns",
        ),
    ],
)
def test_validate_names_the_bad_field(fields, message):
    with pytest.raises(ContextError, match=message):
        EstimatorContext(**fields).validate(3)


def test_context_is_frozen_and_lists_present_fields():
    ctx = EstimatorContext(step=3, total_steps=10)
    with pytest.raises(AttributeError):
        ctx.step = 4  # type: ignore[misc]
    assert ctx.present() == ["step", "total_steps"]


def test_from_actions_reduces_over_the_mask_like_a_plain_loop():
    rng = random.Random(0)
    b, t = 5, 6
    mask = [[rng.random() < 0.7 for _ in range(t)] for _ in range(b)]
    mask[2] = [False] * t  # a sample without valid actions
    lp = [[rng.gauss(-1, 0.5) for _ in range(t)] for _ in range(b)]
    ref = [[rng.gauss(-1.2, 0.5) for _ in range(t)] for _ in range(b)]
    ent = [[rng.random() for _ in range(t)] for _ in range(b)]
    lp_t = torch.tensor(lp)
    lp_t[~torch.tensor(mask)] = float("nan")  # padding may be NaN: never read
    ctx = EstimatorContext.from_actions(
        torch.tensor(mask),
        logp_old=lp_t,
        logp_ref=torch.tensor(ref),
        entropy=torch.tensor(ent),
        prompt_ids=torch.arange(b),
    )
    for i in range(b):
        valid = [j for j in range(t) if mask[i][j]]
        n = len(valid)
        assert ctx.lengths[i] == n
        s_old = sum(lp[i][j] for j in valid)
        s_ref = sum(ref[i][j] for j in valid)
        assert ctx.logp_old_sum[i].item() == pytest.approx(s_old, abs=1e-6)
        assert ctx.logp_ref_sum[i].item() == pytest.approx(s_ref, abs=1e-6)
        assert ctx.logp_old_mean[i].item() == pytest.approx(s_old / n if n else 0.0, abs=1e-6)
        assert ctx.entropy_mean[i].item() == pytest.approx(
            sum(ent[i][j] for j in valid) / n if n else 0.0, abs=1e-6
        )
    ctx.validate(b)
    with pytest.raises(ContextError, match="does not match the mask"):
        EstimatorContext.from_actions(torch.ones(2, 3, dtype=torch.bool), logp_old=torch.zeros(2, 4))


def test_turns_from_mask_like_a_plain_loop():
    rng = random.Random(1)
    for _ in range(20):
        b, t = rng.randint(1, 4), rng.randint(0, 9)
        mask = [[rng.random() < 0.6 for _ in range(t)] for _ in range(b)]
        got = adv.turns_from_mask(torch.tensor(mask, dtype=torch.bool).reshape(b, t)).tolist()
        for i in range(b):
            turn, prev, want = -1, False, []
            for j in range(t):
                if mask[i][j] and not prev:
                    turn += 1
                want.append(turn if mask[i][j] else -1)
                prev = mask[i][j]
            assert got[i] == want


def test_state_key_is_stable_and_order_free():
    a = adv.state_key({"room": 3, "items": ["key", "lamp"]})
    assert a == adv.state_key({"items": ["key", "lamp"], "room": 3})  # key order does not matter
    assert a != adv.state_key({"room": 4, "items": ["key", "lamp"]})
    assert adv.state_key("You are in the kitchen.") == adv.state_key("You are in the kitchen.")
    assert 0 <= a < 2**63
    # a fixed value: the same on every process and every run (blake2b, not Python's salted hash)
    import hashlib

    want = int.from_bytes(hashlib.blake2b(b"abc", digest_size=8).digest(), "little") & (2**63 - 1)
    assert adv.state_key("abc") == want


def test_a_grae_progress_from_the_context_step():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    for step, total in ((0, 10), (3, 10), (10, 10), (7, 8)):
        ctx = EstimatorContext(step=step, total_steps=total)
        p = step / total
        torch.testing.assert_close(adv.a_grae(r, g, context=ctx), adv.a_grae(r, g, progress=p))
    # an explicit option wins over the context; no context means progress 0
    ctx = EstimatorContext(step=9, total_steps=10)
    torch.testing.assert_close(adv.a_grae(r, g, context=ctx, progress=0.2), adv.a_grae(r, g, progress=0.2))
    torch.testing.assert_close(adv.a_grae(r, g), adv.a_grae(r, g, progress=0.0))
    assert adv.options("a_grae")["progress"] is None


# ---------------------------------------------------------------------------- state: exact resume, N = 1
def spo_batches(seed: int, steps: int):
    rng = random.Random(seed)
    for _ in range(steps):
        prompts = rng.sample(range(12), 4)
        pid, gid, r, shift = [], [], [], []
        for k, x in enumerate(prompts):
            d = rng.random() * 0.2
            for _ in range(rng.randint(1, 3)):
                pid.append(x)
                gid.append(k)
                r.append(float(rng.random() < 0.5) if rng.random() > 0.1 else math.nan)
                shift.append(d)
        yield (
            torch.tensor(r, dtype=torch.float64),
            torch.tensor(gid),
            EstimatorContext(
                prompt_ids=torch.tensor(pid), policy_shift=torch.tensor(shift, dtype=torch.float64)
            ),
        )


def test_spo_state_round_trip_resumes_exactly():
    batches = list(spo_batches(0, 8))
    straight = SPOTracker()
    for r, g, ctx in batches[:4]:
        adv.spo(r, g, context=ctx, state=straight)
    saved = roundtrip(straight.state_dict())
    resumed = SPOTracker()
    resumed.load_state_dict(saved)
    for r, g, ctx in batches[4:]:
        a = adv.spo(r, g, context=ctx, state=straight)
        b = adv.spo(r, g, context=ctx, state=resumed)
        assert torch.equal(a, b)
    s1, s2 = straight.state_dict(), resumed.state_dict()
    for key in ("ids", "alpha", "beta", "visits"):
        assert torch.equal(s1[key], s2[key]), key
    assert s1["alpha"].dtype == torch.float64 and len(straight) == len(s1["ids"])
    with pytest.raises(ValueError, match="not an SPO tracker state"):
        SPOTracker().load_state_dict({"name": "vade"})


def test_spo_n_processes_equal_one():
    """Every process calls the estimator on the same GLOBAL batch: their trackers stay equal, whatever the
    sample order of the batch (a gather's order) and the group labels."""
    batches = list(spo_batches(1, 6))
    ranks = [SPOTracker(), SPOTracker()]
    for step, (r, g, ctx) in enumerate(batches):
        perm = torch.randperm(len(r), generator=torch.Generator().manual_seed(step))
        a0 = adv.spo(r, g, context=ctx, state=ranks[0])
        pctx = EstimatorContext(prompt_ids=ctx.prompt_ids[perm], policy_shift=ctx.policy_shift[perm])
        a1 = adv.spo(r[perm], g[perm] * 3 + 11, context=pctx, state=ranks[1])
        torch.testing.assert_close(a1, a0[perm], rtol=0, atol=1e-12)
    s0, s1 = ranks[0].state_dict(), ranks[1].state_dict()
    for key in ("ids", "alpha", "beta", "visits"):
        torch.testing.assert_close(s0[key], s1[key], rtol=0, atol=1e-12)


def test_spo_tracker_offline_initialisation_formula():
    t = SPOTracker()
    t.init_offline(3, successes=5, trials=8, rho_min=0.875)
    n_init = 1 / (1 - 0.875)  # 8
    assert t.posterior(3) == pytest.approx((n_init * 5.5 / 9, n_init * 3.5 / 9))
    t.init_offline(4, successes=0, trials=0)
    assert t.posterior(4) == (0.5, 0.5)
    assert t.posterior(99, 2.0, 3.0) == (2.0, 3.0)  # unseen: the prior
    with pytest.raises(ValueError, match="successes <= trials"):
        t.init_offline(5, successes=3, trials=2)
    with pytest.raises(ValueError, match="finite and > 0"):
        t.set(1, 0.0, 1.0, 0)


# ---------------------------------------------------------------------------- learning
def test_spo_with_its_sampler_learns_a_contextual_bandit():
    """Single-stream SPO (one sample per prompt, the spo sampler attached to the estimator's tracker) on a
    tabular softmax policy: the success rate of the sampled prompts rises."""
    from mmalign.data.prompt_samplers import build_sampler

    torch.manual_seed(0)
    n_prompts, n_actions = 12, 5
    correct = torch.randint(0, n_actions, (n_prompts,), generator=torch.Generator().manual_seed(1))
    logits = torch.zeros(n_prompts, n_actions, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=1.0)
    state = adv.make_state("spo")
    sampler = build_sampler("spo", n_prompts, seed=0)
    sampler.attach(state)
    gen = torch.Generator().manual_seed(2)
    history = []
    for _ in range(150):
        rows = torch.tensor(sampler.next_indices(6))
        probs = torch.softmax(logits[rows], dim=1)
        actions = torch.multinomial(probs.detach(), 1, generator=gen).flatten()
        reward = (actions == correct[rows]).double()
        ctx = EstimatorContext(prompt_ids=rows)
        a = adv.spo(reward, torch.arange(len(rows)), context=ctx, state=state, rho_mode="constant")
        loss = -(a.float() * torch.log(probs[torch.arange(len(rows)), actions])).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(float(reward.mean()))
    first, last = sum(history[:20]) / 20, sum(history[-20:]) / 20
    assert first < 0.45 and last > first + 0.3, (first, last)
    # the tracker followed: the mean posterior success rate of all prompts rose above the prior 0.5
    assert sum(state.p_hat(i) for i in range(n_prompts)) / n_prompts > 0.6
