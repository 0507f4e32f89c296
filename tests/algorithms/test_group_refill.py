"""`mmalign.algorithms.group_refill.GroupRefill` driven with a tiny text policy: tiered hints re-roll all-fail groups (the
hinted samples score exactly like a fresh forward of the hinted prompt), R³ replay injects the stored best
success with its behaviour log-prob (the IS weight checked against exp(logp_old - logp_behaviour) by hand),
and the memory survives a checkpoint round trip exactly."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from mmalign.algorithms import is_correction as isc
from mmalign.algorithms.group_refill import GroupRefill, cat_rollouts
from mmalign.data.batch import Rollout
from mmalign.policies.text import TextPolicy
from mmalign.training import rundir

ROWS = [
    {"prompt": "Q: 1 + 2 = ?\nA:", "answer": "12"},
    {"prompt": "Q: 4 + 4 = ?\nA:", "answer": "8"},
    {"prompt": "Q: 2 + 2 = ?\nA:", "answer": "4", "hints": ["even", "two plus two"]},
]


@pytest.fixture(scope="module")
def pol(random_text_model_dir: Path) -> TextPolicy:
    return TextPolicy.from_pretrained(str(random_text_model_dir), max_new_tokens=4, temperature=1.0)


def reward_of(ro: Rollout) -> torch.Tensor:
    """1 when the prompt carries the whole reference answer (or the strongest hint) as a hint, else 0."""
    good = ("Hint: 12", "Hint: two plus two")
    return torch.tensor([float(any(s in p for s in good)) for p in ro.prompts])


def plain_logp(pol: TextPolicy, ro: Rollout) -> torch.Tensor:
    with torch.no_grad():
        return pol.action_stats(ro).logp.detach()


def rollout_of(pol: TextPolicy, rows: list[dict[str, Any]], size: int, seed: int) -> Rollout:
    torch.manual_seed(seed)
    ro = pol.rollout(rows, size, compute_logp=True)
    ro.rewards = reward_of(ro)
    return ro


def test_tiered_hints_rescue_all_fail_groups(pol: TextPolicy) -> None:
    ro = rollout_of(pol, ROWS, 3, seed=0)
    calls: list[str] = []

    def regenerate(rows: list[dict[str, Any]], size: int) -> tuple[Rollout, torch.Tensor]:
        calls.append(rows[0]["prompt"])
        new = pol.rollout(rows, size, compute_logp=True)
        return new, reward_of(new)

    refill = GroupRefill(hints=True)
    out, rewards, metrics = refill.refill(
        ro, ro.rewards, ro.group, [0, 0, 0, 1, 1, 1, 2, 2, 2], ROWS, regenerate
    )
    # prompt 0: tiers "1" (ceil .25*2 = ceil .5*2 -> deduplicated) then "12" succeeds; prompt 1: "8" fails (one
    # tier); prompt 2: the column's tiers "even", then "two plus two" succeeds
    assert calls == [
        "Q: 1 + 2 = ?\nA:\nHint: 1",
        "Q: 1 + 2 = ?\nA:\nHint: 12",
        "Q: 4 + 4 = ?\nA:\nHint: 8",
        "Q: 2 + 2 = ?\nA:\nHint: even",
        "Q: 2 + 2 = ?\nA:\nHint: two plus two",
    ]
    assert metrics == {
        "hints/groups": 3.0,
        "hints/success": pytest.approx(2 / 3),
        "hints/tiers": pytest.approx(5 / 3),
        "replay/injected": 0.0,
        "replay/memory": 0.0,
        "refill/reward_before": 0.0,  # every group failed before the hints
    }
    assert rewards.tolist() == [1.0] * 3 + [0.0] * 3 + [1.0] * 3
    assert out.group.tolist() == ro.group.tolist()
    assert (
        out.prompts[:3] == ["Q: 1 + 2 = ?\nA:\nHint: 12"] * 3 and out.prompts[3:6] == [ROWS[1]["prompt"]] * 3
    )
    # the merged rollout (prompts of different lengths re-padded on the left) scores like a fresh forward
    diff = (plain_logp(pol, out) - out.logp_old).abs()[out.mask].max().item()
    print(f"hints: merged rollout logp_old vs plain re-scoring max abs diff {diff:.3e}")
    assert diff < 1e-5


def test_replay_injects_the_best_success_with_its_behaviour_logprob(pol: TextPolicy, tmp_path: Path) -> None:
    refill = GroupRefill(replay=True)
    never = lambda rows, size: pytest.fail("no hints configured")  # noqa: E731
    score = lambda r: plain_logp(pol, r)  # noqa: E731
    ro1 = rollout_of(pol, ROWS[:2], 3, seed=1)
    ro1.rewards = torch.tensor([0.0, 0.7, 0.9, 0.0, 0.0, 0.0])  # prompt 0: best success is sample 2
    _, _, m1 = refill.refill(ro1, ro1.rewards, ro1.group, [0, 0, 0, 1, 1, 1], ROWS, never, score)
    assert m1["replay/injected"] == 0.0 and m1["replay/memory"] == 1.0
    stored = ro1[[2]]
    # the policy moves: the stored sample's current log-probs differ from its behaviour log-probs
    with torch.no_grad():
        for p in pol.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ro2 = rollout_of(pol, ROWS[:2], 3, seed=2)
    ro2.rewards = torch.zeros(6)
    state_before = refill.state_dict()
    out, rewards, m2 = refill.refill(ro2, ro2.rewards, ro2.group, [0, 0, 0, 1, 1, 1], ROWS, never, score)
    assert m2["replay/injected"] == 1.0
    assert rewards.tolist() == pytest.approx([0.0, 0.0, 0.9, 0.0, 0.0, 0.0])
    assert out.group.tolist() == ro2.group.tolist()
    n = int(stored.mask.sum())
    inj = out[[2]]
    assert inj.payload["completion_ids"][0, :n].tolist() == stored.payload["completion_ids"][0, :n].tolist()
    assert torch.equal(inj.logp_sampler[0, :n], stored.logp_old[0, :n])
    now = plain_logp(pol, stored)
    assert (inj.logp_old[0, :n] - now[0, :n]).abs().max().item() < 1e-5
    # the trainer's token-level IS weights: exp(logp_old - logp_behaviour) on the injected sample, 1 elsewhere
    w = isc.tis_weights(out.logp_old, out.logp_sampler, out.mask, level="token", cap=1e9)
    by_hand = [math.exp(float(now[0, t]) - float(stored.logp_old[0, t])) for t in range(n)]
    diff = max(abs(float(w[2, t]) - by_hand[t]) for t in range(n))
    print(f"replay: IS weight vs exp(logp_now - logp_behaviour) by hand max abs diff {diff:.3e}")
    assert diff < 1e-4 and max(abs(x - 1) for x in by_hand) > 1e-3
    others = torch.cat([w[:2], w[3:]])[torch.cat([out.mask[:2], out.mask[3:]])]
    assert torch.allclose(others, torch.ones_like(others))
    # resume: the memory saved before step 2, loaded into a fresh component, gives the same injection
    path = rundir.save_state(state_before, tmp_path / "refill.pt")
    again = GroupRefill(replay=True)
    again.load_state_dict(rundir.load_state(path))
    out2, rewards2, _ = again.refill(ro2, torch.zeros(6), ro2.group, [0, 0, 0, 1, 1, 1], ROWS, never, score)
    assert torch.equal(out2.payload["completion_ids"], out.payload["completion_ids"])
    assert torch.equal(out2.logp_sampler, out.logp_sampler) and torch.equal(rewards2, rewards)


def test_errors_and_left_padding() -> None:
    with pytest.raises(ValueError, match="prefix_fractions"):
        GroupRefill(prefix_fractions=[0.0])
    with pytest.raises(ValueError, match="hint_template"):
        GroupRefill(hint_template="{prompt}")
    with pytest.raises(ValueError, match="reference"):
        GroupRefill(hints=True).tiers({"prompt": "x"})
    a = Rollout(
        group=torch.tensor([0]),
        mask=torch.ones(1, 1, dtype=torch.bool),
        prompts=["a"],
        payload={"prompt_ids": torch.tensor([[5, 6]]), "prompt_mask": torch.tensor([[1, 1]])},
    )
    b = Rollout(
        group=torch.tensor([1]),
        mask=torch.ones(1, 2, dtype=torch.bool),
        prompts=["b"],
        payload={"prompt_ids": torch.tensor([[7]]), "prompt_mask": torch.tensor([[1]])},
    )
    c = cat_rollouts([a, b])
    assert c.payload["prompt_ids"].tolist() == [[5, 6], [0, 7]]
    assert c.payload["prompt_mask"].tolist() == [[1, 1], [0, 1]] and c.mask.tolist() == [
        [True, False],
        [True, True],
    ]
    ro = Rollout(group=torch.tensor([0, 0]), mask=torch.ones(2, 1, dtype=torch.bool), prompts=["a", "a"])
    with pytest.raises(ValueError, match="logp_old"):
        GroupRefill(replay=True).refill(ro, torch.zeros(2), ro.group, [0, 0], ROWS, lambda r, s: None, None)
