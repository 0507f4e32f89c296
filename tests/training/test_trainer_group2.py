"""The trainer wiring of issue 26's remaining methods (helper "group2"): d3s receives the entropy and the step,
SPO's rho_mode kl gets its policy_shift from PolicyShiftMemory (checked against a plain Beta update), all-fail
groups are hinted (metrics) and R³ replay resumes exactly. Proposed as tests/training/test_trainer_group2.py once
/work/frag/group2/trainer_hunk.diff and config_hunk.diff are applied; it replaces
tests/training/test_trainer_context.py::test_spo_kl_mode_names_the_missing_field (kl mode now works)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

import pipelines
from mmalign.config import config_from_dict
from mmalign.training.trainer import GroupTrainer
from rewards.base import Reward, RewardBatch


class HintSeen(Reward):
    """1 when the prompt carries a hint, else 0: every unhinted group fails, the first hint tier rescues it."""

    def __call__(self, batch: RewardBatch) -> list[float]:
        return [float("Hint:" in p) for p in batch.prompts]


class LengthMod3Is0(Reward):
    """1 when len(text) % 3 == 0: random successes on a random model's gibberish."""

    def __call__(self, batch: RewardBatch) -> list[float]:
        return [float(len(t) % 3 == 0) for t in batch.texts]


class LengthMod5Is0(Reward):
    """1 when len(text) % 5 == 0: rarer successes, so all-fail groups follow successes of the same prompt."""

    def __call__(self, batch: RewardBatch) -> list[float]:
        return [float(len(t) % 5 == 0) for t in batch.texts]


def rows_file(tmp: Path, n: int) -> Path:
    path = tmp / "rows.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"{i} + 1", "answer": str(i + 1)}) + "\n" for i in range(n))
    )
    return path


def cfg(model_dir, out, train, rewards, steps=2, sampler="uniform", **algorithm):
    data = {
        "pipeline": "text_reasoning",
        "output_dir": str(out),
        "seed": 0,
        "model": {"name_or_path": str(model_dir)},
        "data": {"train": str(train), "prompt_template": "Q: {question} = ?\nA:", "sampler": sampler},
        "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6},
        "rewards": rewards,
        "algorithm": algorithm,
        "trainer": {"steps": steps, "lr": 1e-3, "progress_bar": False, "save_every": 2, "sample_every": 1},
    }
    return config_from_dict(data, "test")


def make(c, resume=False):
    return GroupTrainer(c, pipelines.get(c.pipeline)(c), resume=resume)


def metrics(out):
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
        for line in (out / "metrics.jsonl").read_text().splitlines()
    ]


VARIED = [{"name": f"{__name__}:LengthMod3Is0", "alias": "mod3"}]


def test_d3s_loss_gets_entropy_and_progress(random_text_model_dir, tmp_path):
    t = make(
        cfg(random_text_model_dir, tmp_path / "run", rows_file(tmp_path, 8), VARIED, steps=2, loss="d3s")
    )
    seen = []
    fn = t.composer.loss_fn

    def spy(logp, logp_old, a, mask, **kw):
        seen.append((kw["entropy"].shape == logp.shape, kw["step"], kw["total_steps"]))
        return fn(logp, logp_old, a, mask, **kw)

    t.composer.loss_fn = spy
    h = t.train()
    assert len(h) == 2 and seen and all(ok for ok, _, _ in seen)
    assert {s for _, s, _ in seen} == {0, 1} and {n for _, _, n in seen} == {2}
    assert all(not (isinstance(v, float) and math.isnan(v)) for m in h for v in m.values())


def test_spo_kl_mode_decays_by_the_measured_policy_shift(random_text_model_dir, tmp_path):
    c = cfg(random_text_model_dir, tmp_path / "run", rows_file(tmp_path, 2), VARIED, steps=4, estimator="spo")
    t = make(c)
    assert t.estimation.policy_shift is not None and t.need_logp_old
    seen = []
    fn = t.compute_advantages

    def spy(rewards, group, *args, **kw):
        ctx = kw.get("context", args[3] if len(args) > 3 else None)
        seen.append((rewards.clone(), ctx.prompt_ids.clone(), ctx.policy_shift.clone()))
        return fn(rewards, group, *args, **kw)

    t.compute_advantages = spy
    t.train()
    # the 2 prompts are drawn every step: first visit D = 0, later D > 0 (the weights moved)
    assert torch.all(seen[0][2] == 0) and all(bool((s[2] > 0).all()) for s in seen[1:])
    table = {}  # plain Beta update with the measured D: rho = clip(2^(-D/0.06), 0.875, 0.96)
    for r, pids, shift in seen:
        for x in sorted(set(pids.tolist())):
            sel = pids == x
            a, b, v = table.get(x, (0.5, 0.5, 0))
            rho = 0.96 if v == 0 else min(max(2 ** (-float(shift[sel].mean()) / 0.06), 0.875), 0.96)
            s = float(r[sel].clamp(0, 1).sum())
            table[x] = (rho * a + s, rho * b + float(sel.sum()) - s, v + 1)
    for x, (a, b, v) in table.items():
        got = t.estimator_state.posterior(x)
        assert abs(got[0] - a) < 1e-9 and abs(got[1] - b) < 1e-9 and t.estimator_state.visits(x) == v


def test_hints_rescue_all_fail_groups(random_text_model_dir, tmp_path):
    rewards = [{"name": f"{__name__}:HintSeen", "alias": "hinted"}]
    c = cfg(
        random_text_model_dir,
        tmp_path / "run",
        rows_file(tmp_path, 8),
        rewards,
        steps=2,
        group_refill={"hints": True},
    )
    h = make(c).train()
    for m in h:
        assert m["hints/groups"] == 2.0 and m["hints/success"] == 1.0 and m["hints/tiers"] == 1.0
        assert m["reward/mean"] == 1.0  # the trained groups are the hinted ones


def test_replay_memory_resumes_exactly(random_text_model_dir, tmp_path):
    train = rows_file(tmp_path, 2)
    rare = [{"name": f"{__name__}:LengthMod5Is0", "alias": "mod5"}]
    algo = {"group_refill": {"replay": True}}
    full = make(cfg(random_text_model_dir, tmp_path / "full", train, rare, steps=6, **algo))
    full.train()
    assert len(full.round_hooks["group_refill"].memory()) > 0
    make(cfg(random_text_model_dir, tmp_path / "part", train, rare, steps=4, **algo)).train()
    resumed = make(cfg(random_text_model_dir, tmp_path / "part", train, rare, steps=6, **algo), resume=True)
    assert len(resumed.round_hooks["group_refill"].memory()) > 0  # the memory came back from the checkpoint
    resumed.train()
    assert metrics(tmp_path / "part") == metrics(tmp_path / "full")
    assert sum(m["replay/injected"] for m in metrics(tmp_path / "full")[4:]) > 0  # injected after the resume


def test_spo_kl_mode_resumes_exactly(random_text_model_dir, tmp_path):
    """SPO's policy-shift memory (each prompt's last response) is checkpointed: 2 steps + resume to 4 give the
    metrics of 4 steps in one go (the D of the first step after the resume is measured, not 0)."""
    train = rows_file(tmp_path, 2)
    full = make(cfg(random_text_model_dir, tmp_path / "full", train, VARIED, steps=4, estimator="spo"))
    full.train()
    make(cfg(random_text_model_dir, tmp_path / "part", train, VARIED, steps=2, estimator="spo")).train()
    resumed = make(
        cfg(random_text_model_dir, tmp_path / "part", train, VARIED, steps=4, estimator="spo"), resume=True
    )
    assert len(resumed.estimation.policy_shift) == 2  # both prompts' responses came back from the checkpoint
    resumed.train()
    assert metrics(tmp_path / "part") == metrics(tmp_path / "full")


class ZeroLastSample:
    """A round hook registered at test time: sets every group's last reward to 0 and counts its calls."""

    needs_logp_old = False

    def __init__(self) -> None:
        self.calls = 0

    def after_rewards(self, rollout, rewards, prompt_ids, rows, services):
        self.calls += 1
        assert len(prompt_ids) == len(rollout) and callable(services.regenerate)
        rewards = rewards.clone()
        last = torch.ones_like(rollout.group, dtype=torch.bool)
        last[:-1] = rollout.group[1:] != rollout.group[:-1]
        rewards[last] = 0.0
        rollout.rewards = rewards
        return rollout, rewards, {"hook/calls": float(self.calls)}

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def test_a_round_hook_is_a_registration_not_a_trainer_change(random_text_model_dir, tmp_path, monkeypatch):
    from mmalign.algorithms import round_hooks

    hook = ZeroLastSample()
    monkeypatch.setitem(round_hooks.HOOKS, "zero_last", lambda cfg, weights: hook)
    ones = [{"name": f"{__name__}:HintSeen", "alias": "hint"}]  # 0 everywhere: the hook's zeros are visible
    t = make(cfg(random_text_model_dir, tmp_path / "run", rows_file(tmp_path, 4), ones + VARIED, steps=2))
    assert t.round_hooks == {"zero_last": hook} and t.state_parts()["zero_last"] is hook
    h = t.train()
    assert hook.calls == 2 and [m["hook/calls"] for m in h] == [1.0, 2.0]
    again = ZeroLastSample()
    monkeypatch.setitem(round_hooks.HOOKS, "zero_last", lambda cfg, weights: again)
    make(
        cfg(random_text_model_dir, tmp_path / "run", rows_file(tmp_path, 4), ones + VARIED, steps=2),
        resume=True,
    )
    assert again.calls == 2  # the hook's state came back from the checkpoint under its name


def test_dcpo_gets_the_rollout_entropy(random_text_model_dir, tmp_path):
    """dcpo reads ``entropy_mean``: the trainer fills it from the policy's entropy on the round's actions,
    checked against an entropy computed here from the model's logits, one unpadded sequence at a time
    (-sum p log p at temperature 1 at each generated token, averaged over the sample's actions)."""
    c = cfg(
        random_text_model_dir, tmp_path / "run", rows_file(tmp_path, 4), VARIED, steps=1, estimator="dcpo"
    )
    t = make(c)
    seen = []
    original = t.estimation.context

    def spy(rnd, comm, policy):
        ctx = original(rnd, comm, policy)
        ro, expected = rnd.rollout, []
        for i in range(len(ro)):
            prompt = ro.payload["prompt_ids"][i][ro.payload["prompt_mask"][i].bool()]
            actions = ro.payload["completion_ids"][i][ro.mask[i]]
            ids = torch.cat([prompt, actions])[None]
            with torch.no_grad():
                logits = policy.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
            logp = torch.log_softmax(logits, dim=-1)
            expected.append(float(-(logp.exp() * logp).sum(-1).mean()))
        seen.append((ctx.entropy_mean.double(), torch.tensor(expected, dtype=torch.float64)))
        return ctx

    t.estimation.context = spy
    h = t.train()
    assert len(h) == 1 and seen
    got, expected = seen[0]
    assert torch.allclose(got, expected, atol=1e-3), (got, expected)
