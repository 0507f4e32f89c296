"""Rewards from the seed papers (docs/seeds.md): group-aware text rewards and text-to-SQL partial rewards.

Registered: ``majority_vote``, ``tournament``, ``bootstrapped_pairwise``, ``paraphrase_consistency``,
``set_equivalence``, ``sql_execution``, ``sql_syntax``, ``sql_schema_linking``, ``sql_ngram``.

Details: docs/reward_plugins.md, "rewards.seed_rewards".
"""

from __future__ import annotations

import hashlib
import math
import re
import sqlite3
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.registry import import_path

from .base import Reward, RewardBatch, RewardError, register_reward
from .text import answers_match, extract_answer, normalize_answer

__all__ = [
    "BootstrappedPairwise",
    "MajorityVote",
    "ParaphraseConsistency",
    "SetEquivalence",
    "SqlExecution",
    "SqlNgram",
    "SqlSchemaLinking",
    "SqlSyntax",
    "Tournament",
    "extract_sql",
]

Judge = Callable[[str, str, str], float]


def _judge(spec: str | Judge, reward: str) -> Judge:
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"reward {reward!r}: option 'judge' must be a 'package.module:function' path")
    return import_path(spec, f"{reward} judge", "package.module:function")


def _groups(batch: RewardBatch) -> dict[int, list[int]]:
    """Group id -> the batch indices of its samples, in batch order."""
    out: dict[int, list[int]] = {}
    assert batch.group is not None
    for i, g in enumerate(batch.group.tolist()):
        out.setdefault(int(g), []).append(i)
    return out


@register_reward("majority_vote")
class MajorityVote(Reward):
    """SCOPE / TTRL pseudo-label reward: 1 where the extracted answer equals its subgroup's weighted majority.

    "Beyond Majority Voting ... for Test-Time Reinforcement Learning" (SCOPE); from the paper's description
    (the authors' code was not public when this was written): each sample votes for its extracted answer
    (``extract`` / ``tag`` as `answer_accuracy`, answers compared by `answers_match` with ``mode``) with
    weight c_i = exp(``outputs[confidence_key]``) (a per-sample mean log-prob, SCOPE's confidence; without
    ``confidence_key`` every vote weighs 1: TTRL's plain majority). The group is split into ``subgroups``
    contiguous subgroups in batch order ((our design); SCOPE partitions by quality and diversity), each with
    its own pseudo-label (ties: the answer seen first). Reward ``correct`` / ``incorrect``; a sample without an
    answer scores ``incorrect`` and does not vote. Needs no reference column.
    """

    needs = {"texts"}

    def __init__(
        self,
        *,
        extract: str = "auto",
        tag: str = "answer",
        mode: str = "auto",
        confidence_key: str | None = None,
        subgroups: int = 1,
        correct: float = 1.0,
        incorrect: float = 0.0,
    ) -> None:
        if subgroups < 1:
            raise ValueError(f"majority_vote: subgroups must be >= 1, got {subgroups!r}")
        self.extract, self.tag, self.mode = extract, tag, mode
        self.confidence_key, self.subgroups = confidence_key, int(subgroups)
        self.correct, self.incorrect = float(correct), float(incorrect)

    def __call__(self, batch: RewardBatch) -> Tensor:
        answers = [extract_answer(t, self.extract, self.tag) for t in batch.texts]
        conf = [1.0] * len(answers)
        if self.confidence_key is not None:
            values = torch.as_tensor(batch[self.confidence_key], dtype=torch.float64).flatten().tolist()
            conf = [math.exp(v) if math.isfinite(v) else 0.0 for v in values]
        out = [self.incorrect] * len(answers)
        for members in _groups(batch).values():
            size = math.ceil(len(members) / self.subgroups)
            for start in range(0, len(members), size):
                sub = members[start : start + size]
                label = self._label([answers[i] for i in sub], [conf[i] for i in sub])
                for i in sub:
                    if (
                        label is not None
                        and answers[i] is not None
                        and answers_match(answers[i], label, self.mode)
                    ):
                        out[i] = self.correct
        return torch.tensor(out, dtype=torch.float32)

    def _label(self, answers: list[str | None], conf: list[float]) -> str | None:
        """The answer with the largest summed confidence (first seen on ties); None without answers."""
        reps: list[str] = []
        totals: list[float] = []
        for a, c in zip(answers, conf, strict=True):
            if a is None:
                continue
            for k, rep in enumerate(reps):
                if answers_match(a, rep, self.mode):
                    totals[k] += c
                    break
            else:
                reps.append(a)
                totals.append(c)
        if not reps:
            return None
        best = max(range(len(reps)), key=lambda k: (totals[k], -k))
        return reps[best]


@register_reward("tournament")
class Tournament(Reward):
    """ArenaRL: each group plays a seeded single-elimination bracket judged pairwise; reward = rounds won / rounds.

    "ArenaRL: Scaling RL for Open-Ended Agents via Tournament-based Relative Ranking"; from the abstract
    ((our design) the seeding and the score): the samples of a group are seeded in batch order (seed 1 = the
    first), the bracket has R = ceil(log2 G) rounds, seed k meets seed (2^R + 1 - k) in the first round (the
    top seeds get byes when G is not a power of two; a bye counts as a round won), the ``judge`` decides each
    match (a tie goes to the higher seed) and a sample's reward is the number of rounds it won / R (the
    champion 1). A group of one sample gets NaN. The judge is called G - 1 times per group (O(G), against
    G (G - 1) / 2 for a round robin).
    """

    needs = {"texts"}

    def __init__(self, *, judge: str | Judge) -> None:
        self.judge = _judge(judge, "tournament")

    def __call__(self, batch: RewardBatch) -> Tensor:
        texts = batch.texts
        out = [math.nan] * len(texts)
        for members in _groups(batch).values():
            n = len(members)
            if n < 2:
                continue
            rounds = math.ceil(math.log2(n))
            size = 2**rounds
            # standard bracket order of seeds 1..size, then byes where the seed exceeds n
            order = [1]
            while len(order) < size:
                m = 2 * len(order) + 1
                order = [s for k in order for s in (k, m - k)]
            alive: list[int | None] = [members[s - 1] if s <= n else None for s in order]
            wins = dict.fromkeys(members, 0)
            while len(alive) > 1:
                nxt: list[int | None] = []
                for a, b in zip(alive[0::2], alive[1::2], strict=True):
                    if a is None or b is None:
                        w = a if b is None else b
                    else:
                        p = float(self.judge(batch.prompts[a], texts[a], texts[b]))
                        w = b if p < 0.5 else a  # a is the higher seed of the pair
                    if w is not None:
                        wins[w] += 1
                    nxt.append(w)
                alive = nxt
            for i in members:
                out[i] = wins[i] / rounds
        return torch.tensor(out, dtype=torch.float32)


@register_reward("bootstrapped_pairwise")
class BootstrappedPairwise(Reward):
    """Writing-Zero's BRPO reward: each sample judged against a reference response drawn from its own group.

    "Writing-Zero: Bridge the Gap Between Non-verifiable Problems and Verifiable Rewards"; from the abstract
    ((our reading) the scores): per group one sample is drawn uniformly as the temporary reference; every other
    sample i gets ``win`` if judge(prompt, y_i, y_ref) > 0.5, ``loss`` if < 0.5, ``tie`` at 0.5; the reference
    itself gets ``tie``. A group of one sample gets NaN. The draw is a hash of `seed`, the prompt and the group's
    texts (`reference_index`), not a stream: the reward holds no state, so a resumed run draws what the
    uninterrupted one drew.
    """

    needs = {"texts"}

    def __init__(
        self, *, judge: str | Judge, seed: int = 0, win: float = 1.0, loss: float = -1.0, tie: float = 0.0
    ) -> None:
        self.judge = _judge(judge, "bootstrapped_pairwise")
        self.seed = int(seed)
        self.win, self.loss, self.tie = float(win), float(loss), float(tie)

    def __call__(self, batch: RewardBatch) -> Tensor:
        texts = batch.texts
        out = [math.nan] * len(texts)
        self.last_references: list[int] = []
        for members in _groups(batch).values():
            if len(members) < 2:
                continue
            ref = members[reference_index(self.seed, batch.prompts[members[0]], [texts[i] for i in members])]
            self.last_references.append(ref)
            for i in members:
                if i == ref:
                    out[i] = self.tie
                    continue
                p = float(self.judge(batch.prompts[i], texts[i], texts[ref]))
                out[i] = self.win if p > 0.5 else self.loss if p < 0.5 else self.tie
        return torch.tensor(out, dtype=torch.float32)


def reference_index(seed: int, prompt: str, texts: Sequence[str]) -> int:
    """The group member `bootstrapped_pairwise` takes as reference: the first 8 bytes of the SHA-256 of the seed,
    the prompt and the texts (NUL-separated), as a big-endian integer, modulo the group size."""
    h = hashlib.sha256("\0".join([str(seed), prompt, *texts]).encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(h[:8], "big") % len(texts)


_UNIT_SPLIT = re.compile(r"[.;!?\n]+")
_WORD = re.compile(r"\w+")


def _units(text: str) -> list[set[str]]:
    """A caption's units: its sentences / clauses (split at . ; ! ? and newlines) as sets of lower-case words."""
    out = []
    for part in _UNIT_SPLIT.split(text):
        words = set(_WORD.findall(part.lower()))
        if words:
            out.append(words)
    return out


def _jaccard(a: set[Any], b: set[Any]) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


@register_reward("set_equivalence")
class SetEquivalence(Reward):
    """OwlCap's caption set-equivalence reward, lexical: F1 of caption units matched to the reference's units.

    "OwlCap: Harmonizing Motion-Detail for Video Captioning via HMD-270K and Caption Set Equivalence Reward";
    (our design) the unit split and the match: both captions are split into units (`_units`: sentences /
    clauses as word sets); a unit is matched when some unit of the other caption has word Jaccard >=
    ``threshold``; P = matched caption units / caption units, R = matched reference units / reference units,
    reward = 2 P R / (P + R) (0 when either is 0). The paper's LLM-based unit extraction and equivalence check
    are not built. ``reference_column`` ("caption"); a None reference gives NaN.
    """

    needs = {"texts"}

    def __init__(self, *, reference_column: str = "caption", threshold: float = 0.5) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"set_equivalence: threshold must be in (0, 1], got {threshold!r}")
        self.column, self.threshold = reference_column, float(threshold)

    def __call__(self, batch: RewardBatch) -> Tensor:
        refs = batch[self.column]
        out = []
        for text, ref in zip(batch.texts, refs, strict=True):
            if ref is None:
                out.append(math.nan)
                continue
            pred_u, ref_u = _units(text), _units(str(ref))
            if not pred_u or not ref_u:
                out.append(0.0)
                continue
            p = sum(any(_jaccard(u, v) >= self.threshold for v in ref_u) for u in pred_u) / len(pred_u)
            r = sum(any(_jaccard(v, u) >= self.threshold for u in pred_u) for v in ref_u) / len(ref_u)
            out.append(2 * p * r / (p + r) if p + r > 0 else 0.0)
        return torch.tensor(out, dtype=torch.float32)


# ----------------------------------------------------------------------------- text-to-SQL (Reasoning-SQL)

_SQL_BLOCK = re.compile(r"```sql\s*(.*?)```", re.DOTALL | re.IGNORECASE)
_SQL_TOKEN = re.compile(r"\w+|[^\w\s]")


def extract_sql(text: str, tag: str = "answer") -> str:
    """The SQL of a completion: the last ```sql block, else the last <tag>...</tag>, else the whole text."""
    blocks = _SQL_BLOCK.findall(text)
    if blocks:
        return blocks[-1].strip()
    found = extract_answer(text, "tag", tag)
    return (found if found is not None else text).strip()


def _run(db: str, sql: str) -> list[tuple[Any, ...]] | None:
    """The rows `sql` returns on the SQLite file `db` opened read-only; None when it fails."""
    if not Path(db).is_file():
        raise RewardError(f"SQL reward: database file {db!r} (dataset column) does not exist")
    con = sqlite3.connect(f"file:{Path(db).resolve()}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    except sqlite3.Error:
        return None
    finally:
        con.close()


def _schema_names(db: str) -> set[str]:
    """Lower-case table and column names of the SQLite file `db`."""
    con = sqlite3.connect(f"file:{Path(db).resolve()}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        names = {t.lower() for t in tables}
        for t in tables:
            names |= {r[1].lower() for r in con.execute(f'PRAGMA table_info("{t}")')}
        return names
    finally:
        con.close()


class _SqlReward(Reward):
    needs = {"texts"}

    def __init__(self, *, sql_column: str = "sql", db_column: str = "db_path", tag: str = "answer") -> None:
        self.sql_column, self.db_column, self.tag = sql_column, db_column, tag

    def __call__(self, batch: RewardBatch) -> Tensor:
        golds = batch[self.sql_column]
        dbs = batch[self.db_column] if self.db_column in batch else [None] * len(golds)
        out = []
        for text, gold, db in zip(batch.texts, golds, dbs, strict=True):
            out.append(math.nan if gold is None else self.score(extract_sql(text, self.tag), str(gold), db))
        return torch.tensor(out, dtype=torch.float32)

    def score(self, pred: str, gold: str, db: str | None) -> float:
        raise NotImplementedError

    def _db(self, db: str | None) -> str:
        if db is None:
            raise RewardError(
                f"reward {self.name!r} needs the SQLite database path column {self.db_column!r}"
            )
        return str(db)


@register_reward("sql_execution")
class SqlExecution(_SqlReward):
    """Reasoning-SQL execution accuracy: 1 when the predicted and reference SQL return the same rows (as multisets).

    "Reasoning-SQL: Reinforcement Learning with SQL Tailored Partial Rewards"; from the paper's definition.
    Columns: ``sql_column`` ("sql", the reference query), ``db_column`` ("db_path", a SQLite file, opened
    read-only); the completion's SQL is `extract_sql`. A failing prediction scores 0.
    """

    def score(self, pred: str, gold: str, db: str | None) -> float:
        path = self._db(db)
        want, got = _run(path, gold), _run(path, pred)
        if want is None:
            raise RewardError(f"sql_execution: the reference query fails on {path!r}: {gold!r}")
        return float(got is not None and Counter(got) == Counter(want))


@register_reward("sql_syntax")
class SqlSyntax(_SqlReward):
    """Reasoning-SQL syntax check: 1 when the predicted SQL executes on the database without error, else 0."""

    def score(self, pred: str, gold: str, db: str | None) -> float:
        return float(_run(self._db(db), pred) is not None)


@register_reward("sql_schema_linking")
class SqlSchemaLinking(_SqlReward):
    """Reasoning-SQL schema-linking reward: Jaccard of the tables and columns the predicted and reference SQL use.

    The items used are the query's word tokens (lower case) that name a table or column of the database.
    Both empty: 1.
    """

    def score(self, pred: str, gold: str, db: str | None) -> float:
        names = _schema_names(self._db(db))

        def used(sql: str) -> set[str]:
            return {t for t in _WORD.findall(sql.lower()) if t in names}

        return _jaccard(used(pred), used(gold))


@register_reward("sql_ngram")
class SqlNgram(_SqlReward):
    """Reasoning-SQL n-gram similarity: Jaccard of the token n-grams (``n`` = 2) of the predicted and reference SQL.

    Tokens: words and single punctuation marks, upper-cased keywords and names alike (`normalize_answer`
    case folding). No database needed.
    """

    def __init__(self, *, n: int = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if n < 1:
            raise ValueError(f"sql_ngram: n must be >= 1, got {n!r}")
        self.n = int(n)

    def score(self, pred: str, gold: str, db: str | None) -> float:
        def grams(sql: str) -> set[tuple[str, ...]]:
            toks = _SQL_TOKEN.findall(normalize_answer(sql))
            return {tuple(toks[i : i + self.n]) for i in range(len(toks) - self.n + 1)}

        return _jaccard(grams(pred), grams(gold))


@register_reward("paraphrase_consistency")
class ParaphraseConsistency(Reward):
    """Information-consistent recommendations: agreement of a response with the responses to paraphrased prompts.

    "Information-Consistent Language Model Recommendations through Group Relative Policy Optimization"; (our
    design) the similarity: prompts that are paraphrases of one query share a value of ``set_column``
    ("paraphrase_set"); sample i's reward is the mean word-set Jaccard of its text with the texts of the
    batch's samples of the same set whose prompt differs (NaN when there is none, or when its set value is
    None). Put all paraphrases of a set in one batch (e.g. one dataset row per paraphrase, consecutive) and
    leave ``batch_size`` unset.
    """

    needs = {"texts"}

    def __init__(self, *, set_column: str = "paraphrase_set") -> None:
        self.column = set_column

    def __call__(self, batch: RewardBatch) -> Tensor:
        sets, texts, prompts = batch[self.column], batch.texts, batch.prompts
        words = [set(_WORD.findall(t.lower())) for t in texts]
        out = []
        for i, s in enumerate(sets):
            others = [j for j, t in enumerate(sets) if s is not None and t == s and prompts[j] != prompts[i]]
            out.append(
                sum(_jaccard(words[i], words[j]) for j in others) / len(others) if others else math.nan
            )
        return torch.tensor(out, dtype=torch.float32)
