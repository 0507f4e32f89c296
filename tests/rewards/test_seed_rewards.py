"""Seed-paper rewards (rewards/seed_rewards.py) against hand-worked references."""

from __future__ import annotations

import math
import sqlite3

import pytest
import torch

import rewards
from rewards import (
    RewardBatch,
    load_reward,
    seed_rewards,  # noqa: F401  (registers the rewards)
)


def batch(texts, group, **columns):
    return RewardBatch(
        prompts=["q"] * len(texts), outputs={"texts": texts}, columns=columns, group=torch.tensor(group)
    )


def test_majority_vote_plain_and_confidence_weighted():
    texts = [
        "<answer>3</answer>",
        "<answer>3</answer>",
        "<answer>5</answer>",
        "no answer here",
        "<answer>7</answer>",
        "<answer>8</answer>",
        "<answer>8</answer>",
        "<answer>7</answer>",
    ]
    b = batch(texts, [0, 0, 0, 0, 1, 1, 1, 1])
    b.outputs["logp"] = torch.tensor([-3.0, -3.0, -0.1, 0.0, -0.1, -2.0, -2.0, -0.1])
    plain = load_reward("majority_vote", extract="tag")(b).tolist()
    # group 0: 3 wins 2-1; group 1: 7 and 8 tie 2-2, the first seen (7) wins
    assert plain == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    weighted = load_reward("majority_vote", extract="tag", confidence_key="logp")(b).tolist()
    # group 0: weight of 3 = 2 e^-3 ~ 0.10 < e^-0.1 ~ 0.90, so 5 wins; "no answer" never votes
    assert weighted == [0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    sub = load_reward("majority_vote", extract="tag", subgroups=2)(b).tolist()
    # subgroups {0,1}, {2,3}, {4,5}, {6,7}: each has its own label
    assert sub == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]


def longer_wins(prompt: str, a: str, b: str) -> float:
    return 1.0 if len(a) > len(b) else 0.0 if len(a) < len(b) else 0.5


def test_tournament_bracket_scores_rounds_won():
    calls = []

    def judge(p, a, b):
        calls.append((a, b))
        return longer_wins(p, a, b)

    texts = ["aa", "aaaaa", "a", "aaaa", "aaa"]  # 5 samples: 3 rounds, seeds 1..5 in batch order
    out = load_reward("tournament", judge=judge)(batch(texts, [0] * 5)).tolist()
    # bracket 1v8(bye) 4v5 2v7(bye) 3v6(bye): round 1 "aaaa" beats "aaa"; round 2 "aa" vs "aaaa" -> "aaaa",
    # "aaaaa" vs "a" -> "aaaaa"; final "aaaa" vs "aaaaa" -> "aaaaa"
    assert out == pytest.approx([1 / 3, 3 / 3, 1 / 3, 2 / 3, 0.0])
    assert len(calls) == 4  # G - 1 matches
    single = load_reward("tournament", judge=longer_wins)(batch(["x"], [0])).tolist()
    assert math.isnan(single[0])


def test_bootstrapped_pairwise_against_a_reference_of_the_group():
    import hashlib

    texts = ["a", "aaa", "aa", "aaaa", "bb", "b"]
    b = batch(texts, [0, 0, 0, 0, 1, 1])
    r = load_reward("bootstrapped_pairwise", judge=longer_wins, seed=3)
    out = r(b).tolist()
    ref0, ref1 = r.last_references

    def drawn(prompt: str, group: list[str]) -> int:  # the documented draw, written out
        key = "\0".join(["3", prompt, *group]).encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % len(group)

    assert (ref0, ref1) == (drawn(b.prompts[0], texts[:4]), 4 + drawn(b.prompts[4], texts[4:]))
    for i in range(6):
        ref = ref0 if i < 4 else ref1
        want = 0.0 if i == ref else (1.0 if len(texts[i]) > len(texts[ref]) else -1.0)
        assert out[i] == want
    # no state: a second call and a fresh reward (a resumed run) draw the same references
    assert r(b).tolist() == out and r.last_references == [ref0, ref1]
    fresh = load_reward("bootstrapped_pairwise", judge=longer_wins, seed=3)
    assert fresh(b).tolist() == out and fresh.last_references == [ref0, ref1]


def test_bootstrapped_pairwise_draws_each_member_about_equally_often():
    from rewards.seed_rewards import reference_index

    counts = [0] * 4
    for k in range(4000):
        counts[reference_index(0, f"prompt {k}", ["w", "x", "y", "z"])] += 1
    assert all(900 < c < 1100 for c in counts), counts  # 1000 +- 3.2 sigma


def test_set_equivalence_is_the_f1_of_matched_units():
    ref = "A man runs across the street. He waves at a dog; the dog barks."
    text = "A man runs across the street. A cat sleeps."
    out = load_reward("set_equivalence")(
        batch([text, ref, "zzz"], [0, 0, 0], caption=[ref, ref, None])
    ).tolist()
    # units: ref = {man runs..., he waves at a dog, the dog barks}; text matches 1 of its 2, covers 1 of 3
    p, r = 1 / 2, 1 / 3
    assert out[0] == pytest.approx(2 * p * r / (p + r))
    assert out[1] == pytest.approx(1.0)
    assert math.isnan(out[2])


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "shop.sqlite"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE items (id INTEGER, name TEXT, price REAL)")
    con.executemany("INSERT INTO items VALUES (?, ?, ?)", [(1, "pen", 2.0), (2, "ink", 5.0), (3, "pad", 3.0)])
    con.commit()
    con.close()
    return str(path)


def test_sql_partial_rewards(db):
    gold = "SELECT name FROM items WHERE price > 2.5"
    texts = [
        "```sql\nSELECT name FROM items WHERE price >= 3\n```",  # same rows, other text
        "<answer>SELECT id FROM items WHERE price > 2.5</answer>",  # other rows
        "SELEC nonsense",  # fails
    ]
    b = batch(texts, [0, 0, 0], sql=[gold] * 3, db_path=[db] * 3)
    assert load_reward("sql_execution")(b).tolist() == [1.0, 0.0, 0.0]
    assert load_reward("sql_syntax")(b).tolist() == [1.0, 1.0, 0.0]
    link = load_reward("sql_schema_linking")(b).tolist()
    # gold uses {items, name, price}; second uses {items, id, price}: 2 / 4
    assert link == pytest.approx([1.0, 0.5, 0.0])
    ngram = load_reward("sql_ngram")(b).tolist()

    def grams(s):
        import re

        toks = re.findall(r"\w+|[^\w\s]", " ".join(s.lower().split()))
        return {tuple(toks[i : i + 2]) for i in range(len(toks) - 1)}

    want0 = len(grams(gold) & grams("SELECT name FROM items WHERE price >= 3")) / len(
        grams(gold) | grams("SELECT name FROM items WHERE price >= 3")
    )
    assert ngram[0] == pytest.approx(want0)
    assert 0 < ngram[1] < 1 and ngram[2] == 0.0


def test_registered_and_listed():
    assert {
        "majority_vote",
        "tournament",
        "bootstrapped_pairwise",
        "set_equivalence",
        "sql_execution",
        "sql_syntax",
        "sql_schema_linking",
        "sql_ngram",
    } <= set(rewards.names())


def test_paraphrase_consistency_compares_across_paraphrased_prompts():
    b = RewardBatch(
        prompts=["best phone?", "which phone is best?", "best phone?", "a pet?"],
        outputs={"texts": ["buy the x1 phone", "buy the x1", "get a y2 phone", "a cat"]},
        columns={"paraphrase_set": [7, 7, 7, 9]},
        group=torch.tensor([0, 1, 0, 2]),
    )
    out = load_reward("paraphrase_consistency")(b).tolist()

    def jac(a, c):
        a, c = set(a.split()), set(c.split())
        return len(a & c) / len(a | c)

    # sample 0 and 2 share a prompt: each is compared only with sample 1 (the paraphrase)
    assert out[0] == pytest.approx(jac("buy the x1 phone", "buy the x1"))
    assert out[1] == pytest.approx(
        (jac("buy the x1", "buy the x1 phone") + jac("buy the x1", "get a y2 phone")) / 2
    )
    assert out[2] == pytest.approx(jac("get a y2 phone", "buy the x1"))
    assert math.isnan(out[3])
