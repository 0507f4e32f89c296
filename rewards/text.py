"""Built-in text rewards: `answer_accuracy`, `format`, `overlong`.

The extraction and comparison helpers (`extract_boxed`, `extract_tag`, `extract_last_number`,
`extract_answer`, `parse_number`, `normalize_answer`, `answers_match`) are public so pipelines and
tests can use them on their own.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from mmalign.data.answers import extract_boxed  # (shared with the data loader: MATH's solutions)

from .base import Reward, RewardBatch, register_reward

__all__ = [
    "AnswerAccuracy",
    "FormatReward",
    "OverlongPenalty",
    "answers_match",
    "extract_answer",
    "extract_boxed",
    "extract_last_number",
    "extract_tag",
    "normalize_answer",
    "parse_number",
]

EXTRACT_MODES = ("auto", "boxed", "last_number", "tag", "none")
COMPARE_MODES = ("exact", "numeric", "auto")


# ----------------------------------------------------------------------------- extraction
def extract_tag(text: str, tag: str = "answer") -> str | None:
    """Content of the last ``<tag>...</tag>`` (stripped); else None."""
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return matches[-1].strip() if matches else None


_EXP = r"(?:[eE][-+]?\d+)?"
_UNSIGNED = rf"(?:(?:\d{{1,3}}(?:,\d{{3}})+|\d+)(?:\.\d+)?{_EXP}|\.\d+{_EXP})"
# a sign counts only where it cannot be a binary minus ("10-3" gives 3, "= -3" gives -3);
# a number glued to a word ("x2") is not a number; an optional "/denominator" makes a fraction
_NUMBER_RE = re.compile(rf"(?:(?<![\w)\]}}.])[-+]|(?<![\w.])){_UNSIGNED}(?:\s*/\s*{_UNSIGNED})?")


def extract_last_number(text: str) -> str | None:
    """The last number in `text` as written: "1,234.5", "-3", "3/4", "1e3"; else None."""
    matches = _NUMBER_RE.findall(text)
    return matches[-1] if matches else None


def extract_answer(text: str, how: str = "auto", tag: str = "answer") -> str | None:
    r"""Extract the answer of a completion: "boxed", "tag", "last_number", "none" (the whole text), or
    "auto" (the last complete \boxed{} if any, else the last <tag>...</tag>, else the last number)."""
    if how == "none":
        return text
    if how == "boxed":
        return extract_boxed(text)
    if how == "tag":
        return extract_tag(text, tag)
    if how == "last_number":
        return extract_last_number(text)
    if how == "auto":
        for found in (extract_boxed(text), extract_tag(text, tag)):
            if found is not None:
                return found
        return extract_last_number(text)
    raise ValueError(f"unknown extract mode {how!r}; choose one of {EXTRACT_MODES}")


# ----------------------------------------------------------------------------- comparison
def _strip_wrappers(s: str) -> str:
    """Strip whitespace, a trailing period and surrounding $ (in either order)."""
    s = s.strip()
    for _ in range(2):
        s = s.rstrip(".").strip()
        if len(s) >= 2 and s.startswith("$") and s.endswith("$"):
            s = s.strip("$").strip()
    return s


def normalize_answer(s: str, case_sensitive: bool = False) -> str:
    """Strip, drop surrounding $ and a trailing period, collapse whitespace, lower-case (unless asked not to)."""
    s = " ".join(_strip_wrappers(str(s)).split())
    return s if case_sensitive else s.lower()


_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?" + _EXP)
_PLAIN_RE = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)" + _EXP)
_FRAC_RE = re.compile(r"([-+]?)\\[dt]?frac\s*\{([^{}]+)\}\s*\{([^{}]+)\}")


def _parse_plain(s: str) -> float | None:
    s = s.strip()
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    if not _PLAIN_RE.fullmatch(s):
        return None
    x = float(s)
    return x if math.isfinite(x) else None


def parse_number(s: Any) -> float | None:
    r"""A finite float from "42", "-3.5", "1,234", "1e3", "3/4", "\frac{3}{4}" (with optional $...$ and
    trailing period); None if `s` is not one number."""
    if isinstance(s, bool):
        return None
    if isinstance(s, int | float):
        return float(s) if math.isfinite(s) else None
    s = _strip_wrappers(str(s)).replace("{,}", ",").replace("\\!", "")
    m = _FRAC_RE.fullmatch(s)
    if m:
        num, den = _parse_plain(m.group(2)), _parse_plain(m.group(3))
        if num is None or den is None or den == 0:
            return None
        return -num / den if m.group(1) == "-" else num / den
    if "/" in s:
        a, _, b = s.partition("/")
        num, den = _parse_plain(a), _parse_plain(b)
        if num is None or den is None or den == 0:
            return None
        return num / den
    return _parse_plain(s)


def answers_match(
    pred: str,
    ref: Any,
    mode: str = "auto",
    abs_tol: float = 1e-6,
    rel_tol: float = 1e-6,
    case_sensitive: bool = False,
) -> bool:
    """Whether the extracted answer `pred` equals the reference `ref`.

    numeric: both parsed as numbers, equal within ``math.isclose(rel_tol, abs_tol)`` (0, 0 = exactly);
    exact: `normalize_answer` strings equal; auto: numeric if both parse as numbers, else exact.
    In numeric mode an unparsable reference is a ValueError; an unparsable prediction is just wrong.
    """
    if mode not in COMPARE_MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {COMPARE_MODES}")
    if mode in ("numeric", "auto"):
        r = parse_number(ref)
        if r is None and mode == "numeric":
            raise ValueError(f"reference answer {ref!r} is not a number (mode='numeric')")
        p = parse_number(pred)
        if r is not None and (p is not None or mode == "numeric"):
            return p is not None and math.isclose(p, r, rel_tol=rel_tol, abs_tol=abs_tol)
    return normalize_answer(pred, case_sensitive) == normalize_answer(str(ref), case_sensitive)


# -------------------------------------------------------------------------------- rewards
@register_reward("answer_accuracy")
class AnswerAccuracy(Reward):
    r"""Correctness of the extracted final answer against a reference column (1/0 by default).

    Options: ``answer_column`` ("answer"); ``extract`` how to find the completion's answer ("auto":
    \boxed{} if present, else <answer>...</answer>, else the last number; or "boxed", "tag",
    "last_number", "none"); ``tag`` ("answer"); ``reference_extract`` the same for the reference
    column ("none" by default, e.g. "last_number" for GSM8K-style solutions); ``mode`` "auto",
    "numeric" or "exact" (see `answers_match`); ``abs_tol``/``rel_tol`` (1e-6); ``case_sensitive``
    (False); ``correct`` (1.0) and ``incorrect`` (0.0).

    A completion without an extractable answer scores ``incorrect``. A reference that is a list or
    tuple accepts any of its entries; a ``None`` reference gives NaN (not applicable).
    """

    needs = {"texts"}

    def __init__(
        self,
        *,
        answer_column: str = "answer",
        extract: str = "auto",
        tag: str = "answer",
        reference_extract: str = "none",
        mode: str = "auto",
        abs_tol: float = 1e-6,
        rel_tol: float = 1e-6,
        case_sensitive: bool = False,
        correct: float = 1.0,
        incorrect: float = 0.0,
    ) -> None:
        for opt, value, choices in (
            ("extract", extract, EXTRACT_MODES),
            ("reference_extract", reference_extract, EXTRACT_MODES),
            ("mode", mode, COMPARE_MODES),
        ):
            if value not in choices:
                raise ValueError(f"reward {self.name!r}: {opt}={value!r}; choose one of {choices}")
        if abs_tol < 0 or rel_tol < 0:
            raise ValueError(f"reward {self.name!r}: abs_tol and rel_tol must be >= 0")
        self.answer_column = answer_column
        self.extract = extract
        self.tag = tag
        self.reference_extract = reference_extract
        self.mode = mode
        self.abs_tol = abs_tol
        self.rel_tol = rel_tol
        self.case_sensitive = case_sensitive
        self.correct = float(correct)
        self.incorrect = float(incorrect)

    def _reference(self, ref: Any) -> Any:
        if self.reference_extract == "none" or not isinstance(ref, str):
            return ref
        found = extract_answer(ref, self.reference_extract, self.tag)
        if found is None:
            raise ValueError(
                f"no answer found in reference {ref!r} with reference_extract={self.reference_extract!r}"
            )
        return found

    def score(self, text: str, ref: Any) -> float:
        """The reward of one completion against one reference."""
        if ref is None:
            return math.nan
        refs = ref if isinstance(ref, list | tuple) else [ref]
        pred = extract_answer(text, self.extract, self.tag)
        hit = pred is not None and any(
            answers_match(
                pred, self._reference(r), self.mode, self.abs_tol, self.rel_tol, self.case_sensitive
            )
            for r in refs
        )
        return self.correct if hit else self.incorrect

    def __call__(self, batch: RewardBatch) -> Tensor:
        if self.answer_column not in batch.columns:
            raise KeyError(
                f"answer column {self.answer_column!r} is not in the dataset; "
                f"available columns: {sorted(batch.columns) or 'none'}"
            )
        refs = batch.columns[self.answer_column]
        return torch.tensor(
            [self.score(t, r) for t, r in zip(batch.texts, refs, strict=True)], dtype=torch.float32
        )


@register_reward("format")
class FormatReward(Reward):
    """Whether the completion has the required format: a regex, or <tag>...</tag> blocks in order (1/0).

    Options: ``pattern`` a regex matched with ``re.fullmatch`` against the stripped completion
    (``search=True``: ``re.search`` anywhere; ``strip=False``: unstripped; ``dotall`` True: "." matches
    newlines); or ``tags`` a list of tag names, each of which must appear exactly once as
    ``<tag>...</tag>``, the blocks in the given order (``strict=True``: nothing but whitespace outside
    them). Exactly one of ``pattern`` / ``tags``. ``correct`` (1.0) / ``incorrect`` (0.0).
    """

    needs = {"texts"}

    def __init__(
        self,
        *,
        pattern: str | None = None,
        tags: Sequence[str] | None = None,
        search: bool = False,
        strip: bool = True,
        dotall: bool = True,
        strict: bool = False,
        correct: float = 1.0,
        incorrect: float = 0.0,
    ) -> None:
        if (pattern is None) == (tags is None):
            raise ValueError(f"reward {self.name!r}: give exactly one of 'pattern' or 'tags'")
        if isinstance(tags, str):
            raise TypeError(f"reward {self.name!r}: 'tags' is a list of tag names, got the string {tags!r}")
        if tags is not None and not tags:
            raise ValueError(f"reward {self.name!r}: 'tags' is empty")
        try:
            self.regex = re.compile(pattern, re.DOTALL if dotall else 0) if pattern is not None else None
        except re.error as e:
            raise ValueError(f"reward {self.name!r}: invalid pattern {pattern!r}: {e}") from e
        self.tags = list(tags) if tags is not None else None
        self.search = search
        self.strip = strip
        self.strict = strict
        self.correct = float(correct)
        self.incorrect = float(incorrect)

    def _tags_ok(self, text: str) -> bool:
        assert self.tags is not None
        pos = 0
        for tag in self.tags:
            open_, close = f"<{tag}>", f"</{tag}>"
            if text.count(open_) != 1 or text.count(close) != 1:
                return False
            start, end = text.find(open_), text.find(close)
            if start < pos or end < start + len(open_):
                return False
            if self.strict and text[pos:start].strip():
                return False
            pos = end + len(close)
        return not (self.strict and text[pos:].strip())

    def matches(self, text: str) -> bool:
        if self.strip:
            text = text.strip()
        if self.regex is not None:
            m = self.regex.search(text) if self.search else self.regex.fullmatch(text)
            return m is not None
        return self._tags_ok(text)

    def __call__(self, batch: RewardBatch) -> Tensor:
        return torch.tensor(
            [self.correct if self.matches(t) else self.incorrect for t in batch.texts], dtype=torch.float32
        )


@register_reward("overlong")
class OverlongPenalty(Reward):
    """DAPO soft overlong punishment from the completion length in tokens (0 down to -1).

    With max length L (``max_len``) and cache c (``cache_len``), for n = ``outputs["num_tokens"]``:
    0 if n <= L - c; (L - c - n) / c if L - c < n <= L; -1 if n > L. ``cache_len=0`` is a hard cut.
    """

    needs = {"num_tokens"}

    def __init__(self, *, max_len: int, cache_len: int) -> None:
        if max_len <= 0 or cache_len < 0 or cache_len > max_len:
            raise ValueError(
                f"reward {self.name!r}: need 0 <= cache_len <= max_len and max_len > 0, "
                f"got max_len={max_len}, cache_len={cache_len}"
            )
        self.max_len = max_len
        self.cache_len = cache_len

    def __call__(self, batch: RewardBatch) -> Tensor:
        n = torch.as_tensor(batch["num_tokens"]).detach().to("cpu", torch.float64).flatten()
        L, c = float(self.max_len), float(self.cache_len)
        soft = (L - c - n) / c if c > 0 else torch.zeros_like(n)
        out = torch.where(n <= L - c, torch.zeros_like(n), torch.where(n <= L, soft, -torch.ones_like(n)))
        return out.to(torch.float32)
