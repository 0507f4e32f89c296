"""The ``igpo`` rollout loop (`mmalign.data.rollout_loops.InfoGainMultiTurn`): turn rewards = the policy's gain in
log P(gold answer | history), checked against a plain recomputation (one forward per history prefix, built here
from the rollout's tokens), and fed to ``grpo_process``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from mmalign.algorithms import advantages as adv
from mmalign.data.rollout_loops import DONE, Done, Insert, TurnContext, make_loop
from mmalign.policies.text import TextPolicy


def tool_env(ctx: TurnContext) -> Done | Insert:
    """Even samples get two tool answers (3 turns); odd samples stop after one turn."""
    if ctx.group_index % 2 == 1 or ctx.turn >= 2:
        return DONE
    return Insert(text=f" Tool says {ctx.turn}.", role=None)


ROWS = [{"prompt": "Q: 1 + 2 = ?\nA:", "answer": "3"}, {"prompt": "Q: 4 + 4 = ?\nA:", "answer": "8"}]


def igpo_policy(path: Path, **loop_kwargs: Any) -> TextPolicy:
    return TextPolicy.from_pretrained(
        str(path),
        max_new_tokens=4,
        temperature=1.0,
        loop="igpo",
        loop_kwargs={"max_turns": 3, "answer_template": " The answer is {answer}.", **loop_kwargs},
        environment=tool_env,
    )


def plain_answer_logprob(pol: TextPolicy, ids: list[int], answer: str) -> float:
    """log P(answer | ids): one plain forward over ids + answer tokens, no padding."""
    ans = pol.tokenizer(answer, add_special_tokens=False)["input_ids"]
    full = torch.tensor(ids + ans)[None]
    with torch.no_grad():
        logp = torch.log_softmax(pol.model(input_ids=full).logits[0].float(), -1)
    return sum(float(logp[len(ids) - 1 + j, a]) for j, a in enumerate(ans))


def history_prefixes(pol: TextPolicy, ro: Any, i: int, row: dict[str, Any]) -> list[list[int]]:
    """The token ids of the prompt, then of the prompt + each turn (with the insertion after it)."""
    prompt = pol.tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
    comp = ro.payload["completion_ids"][i].tolist()
    att = ro.payload["completion_attention_mask"][i].bool().tolist()
    mask = ro.mask[i].tolist()
    ends, j, n = [], 0, sum(att)
    while j < n:  # a turn = a run of actions, then the non-action run (insertion) after it
        while j < n and mask[j]:
            j += 1
        while j < n and not mask[j]:
            j += 1
        ends.append(j)
    return [list(prompt)] + [list(prompt) + comp[:e] for e in ends]


def test_igpo_turn_rewards_equal_a_plain_recomputation(random_text_model_dir: Path) -> None:
    pol = igpo_policy(random_text_model_dir)
    torch.manual_seed(0)
    ro = pol.rollout(ROWS, 4, compute_logp=True)
    assert ro.outputs["num_turns"].tolist() == [3, 1] * 4
    turn = adv.turns_from_mask(ro.mask)
    worst = 0.0
    for i in range(len(ro)):
        row = ROWS[i // 4]
        answer = " The answer is " + row["answer"] + "."
        plain = [plain_answer_logprob(pol, h, answer) for h in history_prefixes(pol, ro, i, row)]
        state = ro.outputs["env_state"][i]
        assert len(state["answer_logprobs"]) == len(plain) == ro.outputs["num_turns"][i] + 1
        worst = max(worst, max(abs(a - b) for a, b in zip(state["answer_logprobs"], plain, strict=True)))
        gains = [b - a for a, b in zip(plain[:-1], plain[1:], strict=True)]
        worst = max(worst, max(abs(a - b) for a, b in zip(state["turn_rewards"], gains, strict=True)))
        for t in range(ro.mask.shape[1]):
            want = gains[int(turn[i, t])] if ro.mask[i, t] else 0.0
            worst = max(worst, abs(float(ro.step_rewards[i, t]) - want))
    print(f"igpo max abs diff vs plain recomputation: {worst:.3e}")
    assert worst < 1e-4
    # the per-step estimator takes them: process part nonzero where the turn gains differ within a group
    a = adv.grpo_process(
        torch.tensor([1.0, 0.0, 1.0, 0.0] * 2),
        ro.group,
        step_rewards=ro.step_rewards,
        step_mask=ro.mask,
    )
    assert a.shape == ro.mask.shape and bool(torch.isfinite(a).all())


def test_igpo_prob_gain_and_errors(random_text_model_dir: Path) -> None:
    pol = igpo_policy(random_text_model_dir, gain="prob")
    torch.manual_seed(1)
    ro = pol.rollout(ROWS[:1], 2, compute_logp=False)
    n = len(pol.tokenizer(" The answer is 3.", add_special_tokens=False)["input_ids"])
    s = ro.outputs["env_state"][0]["answer_logprobs"]
    want = [math.exp(b / n) - math.exp(a / n) for a, b in zip(s[:-1], s[1:], strict=True)]
    assert ro.outputs["env_state"][0]["turn_rewards"] == pytest.approx(want, abs=1e-12)
    assert make_loop("igpo", environment=tool_env).gives_step_rewards
    assert not make_loop("multi_turn", environment=tool_env).gives_step_rewards
    with pytest.raises(ValueError, match="gain"):
        make_loop("igpo", environment=tool_env, gain="kl")
    with pytest.raises(ValueError, match="answer"):
        igpo_policy(random_text_model_dir).rollout([{"prompt": "hi"}], 1, compute_logp=False)
    with pytest.raises(TypeError):
        make_loop("igpo", environment=tool_env, bogus=1)
