r"""Multimodal accuracy rewards (the "Mixed-R1 family"): `multiple_choice`, `box_iou`, `bmas`, `mixed_accuracy`.

- ``multiple_choice``: the choice letter of the completion against a reference letter.
- ``box_iou``: IoU of the completion's bounding box with a reference box, with the coordinate
  conventions of the usual VLMs (absolute pixels, Qwen2-VL's 0-1000 grid, pixels of the resized input).
- ``bmas``: bidirectional max-average cosine similarity of token embeddings (open-ended answers).
- ``mixed_accuracy``: picks one of the above (or `answer_accuracy`) per sample from a dataset column.

The helpers `parse_choice`, `extract_choice`, `parse_box`, `iou`, `rescale_box`, `trigram_embed`
and `bmas_score` are public so pipelines and tests can use them on their own. Answer extraction
(``\boxed{}``, ``<answer>`` tags) reuses `rewards.text`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .base import Reward, RewardBatch, _check_options, register_reward
from .text import EXTRACT_MODES, AnswerAccuracy, extract_answer, extract_boxed, extract_tag, parse_number

__all__ = [
    "BMAS",
    "BoxIoU",
    "HFTokenEmbedder",
    "MixedAccuracy",
    "MultipleChoice",
    "bmas_score",
    "extract_choice",
    "iou",
    "parse_box",
    "parse_choice",
    "rescale_box",
    "trigram_embed",
    "trigram_tokens",
]

Box = tuple[float, float, float, float]
TokenEmbedFn = Callable[[Sequence[str]], Sequence[Tensor]]

log = logging.getLogger(__name__)


def _column(reward: Reward, batch: RewardBatch, column: str, what: str) -> list[Any]:
    if column not in batch.columns:
        raise KeyError(
            f"reward {reward.name!r}: {what} column {column!r} is not in the dataset; "
            f"available columns: {sorted(batch.columns) or 'none'}"
        )
    return batch.columns[column]


# =========================================================================== multiple choice
DEFAULT_LETTERS = "ABCDEFGHIJ"


def _letter_classes(letters: str, case_sensitive: bool) -> tuple[str, str, str]:
    """Regex classes of (any accepted letter, upper-case ones, lower-case ones accepted as an alias)."""
    if case_sensitive:
        return f"[{letters}]", f"[{letters}]", "(?!)"
    up, low = "".join(sorted(set(letters.upper()))), "".join(sorted(set(letters.lower())))
    return f"[{up}{low}]", f"[{up}]", f"[{low}]"


@lru_cache(maxsize=64)
def _choice_patterns(
    letters: str, case_sensitive: bool
) -> tuple[re.Pattern[str], re.Pattern[str], re.Pattern[str]]:
    any_, up, low = _letter_classes(letters, case_sensitive)
    bracketed = rf"[(\[]({any_})[)\]]"
    # a fragment that starts with the choice: "B", "(B)", "[B] text", "B. text", "B) text", "B: text", "Option B"
    leading = re.compile(
        rf"\s*(?:(?i:option|choice)\s*)?(?:{bracketed}|({any_})(?=\s*(?:[.:)]|$))).*", re.DOTALL
    )
    # "answer is (B)", "Answer: B", "the correct option is B"; a bare lower-case letter (when not
    # case-sensitive) only before punctuation or the end, so that "the answer is a cat" is no choice
    phrase = re.compile(
        rf"(?i:answer|option|choice)\s*(?:(?i:is)\s*:?|:)\s*(?:(?i:option|choice)\s*)?"
        rf"(?:{bracketed}|({up})(?![A-Za-z0-9'])|({low})(?=\s*(?:[.,;:)]|$)))"
    )
    # the text ends with a lone letter: "... so B.", "... is (C)", "D" (lower-case only in brackets)
    trailing = re.compile(rf"(?:^|[^A-Za-z0-9'])(?:{bracketed}|({up}))\s*[.!]?\s*$")
    return leading, phrase, trailing


def _letter(m: re.Match[str] | None, case_sensitive: bool) -> str | None:
    if m is None:
        return None
    found = next(g for g in m.groups() if g)
    return found if case_sensitive else found.upper()


def _strip_latex_text(s: str) -> str:
    return re.sub(r"\\(?:text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}", r"\1", s)


def parse_choice(s: Any, letters: str = DEFAULT_LETTERS, case_sensitive: bool = False) -> str | None:
    """The choice letter of a short answer: "B", "(B)", "B. text", "B) text", "Option B", "answer is B",
    "\\text{B}"; else None. Upper-cased unless `case_sensitive` (then only letters as given count)."""
    if s is None:
        return None
    s = _strip_latex_text(str(s)).strip().strip("$").strip()
    leading, phrase, trailing = _choice_patterns(letters, case_sensitive)
    m = leading.fullmatch(s)
    if m is None:
        hits = list(phrase.finditer(s))
        m = hits[-1] if hits else trailing.search(s)
    return _letter(m, case_sensitive)


def extract_choice(
    text: str, letters: str = DEFAULT_LETTERS, case_sensitive: bool = False, tag: str = "answer"
) -> str | None:
    r"""The choice letter of a completion, from the first of these sources that yields one:

    1. the last complete ``\boxed{...}`` (its content parsed with `parse_choice`);
    2. the last ``<answer>...</answer>`` (idem; e.g. "B", "(B) cat", "The answer is B");
    3. the last "answer is (B)" / "Answer: B" / "the correct option is B" phrase in the text;
    4. a lone letter ending the text: "... so B." / "... (C)".

    A box or tag whose content holds no letter (``\boxed{42}``) is skipped, not fatal.
    """
    for fragment in (extract_boxed(text), extract_tag(text, tag)):
        if fragment is not None:
            found = parse_choice(fragment, letters, case_sensitive)
            if found is not None:
                return found
    _, phrase, trailing = _choice_patterns(letters, case_sensitive)
    text = _strip_latex_text(text)
    hits = list(phrase.finditer(text))
    return _letter(hits[-1] if hits else trailing.search(text), case_sensitive)


@register_reward("multiple_choice")
class MultipleChoice(Reward):
    r"""Multiple-choice accuracy: the completion's choice letter (A-J) equals the reference letter (1/0).

    The completion's letter comes from (first that yields one) ``\boxed{B}``, ``<answer>B</answer>``,
    an "answer is (B)" / "Answer: B" phrase, a lone letter ending the text ("... so B."); see
    `extract_choice`. The reference column (``answer_column``, "answer") may hold "B", "(B)",
    "B. text" or a list of accepted letters; ``None`` gives NaN; a reference without a letter is a
    ValueError. Options: ``letters`` (the accepted letters, "ABCDEFGHIJ"); ``case_sensitive``
    (False: "b" counts as "B"; True: only the letters as written in ``letters``); ``tag``
    ("answer"); ``correct`` (1.0) / ``incorrect`` (0.0).
    """

    needs = {"texts"}

    def __init__(
        self,
        *,
        answer_column: str = "answer",
        letters: str | Sequence[str] = DEFAULT_LETTERS,
        case_sensitive: bool = False,
        tag: str = "answer",
        correct: float = 1.0,
        incorrect: float = 0.0,
    ) -> None:
        letters = "".join(letters)
        if not letters or not all(c.isalpha() and c.isascii() for c in letters):
            raise ValueError(f"reward {self.name!r}: letters must be ASCII letters, got {letters!r}")
        if len(set(letters if case_sensitive else letters.upper())) != len(letters):
            raise ValueError(f"reward {self.name!r}: letters {letters!r} has duplicates")
        self.answer_column = answer_column
        self.letters = letters
        self.case_sensitive = case_sensitive
        self.tag = tag
        self.correct = float(correct)
        self.incorrect = float(incorrect)

    def _ref_letter(self, ref: Any) -> str:
        found = parse_choice(ref, self.letters, self.case_sensitive)
        if found is None:
            raise ValueError(
                f"reward {self.name!r}: reference {ref!r} holds no choice letter (letters {self.letters!r})"
            )
        return found

    def score(self, text: str, ref: Any) -> float:
        if ref is None:
            return math.nan
        refs = ref if isinstance(ref, list | tuple) else [ref]
        pred = extract_choice(text, self.letters, self.case_sensitive, self.tag)
        hit = pred is not None and any(pred == self._ref_letter(r) for r in refs)
        return self.correct if hit else self.incorrect

    def __call__(self, batch: RewardBatch) -> Tensor:
        refs = _column(self, batch, self.answer_column, "answer")
        return torch.tensor(
            [self.score(t, r) for t, r in zip(batch.texts, refs, strict=True)], dtype=torch.float32
        )


# ================================================================================ boxes / IoU
_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_BOX_RES = (
    # [x1, y1, x2, y2] (also inside {"bbox_2d": [...]}) or (x1, y1, x2, y2)
    re.compile(rf"\[\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*\]"),
    re.compile(rf"\(\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*\)"),
    # (x1,y1),(x2,y2) as Qwen-VL's <box>(x1,y1),(x2,y2)</box>
    re.compile(rf"\(\s*({_NUM})\s*,\s*({_NUM})\s*\)\s*(?:,|-|to)?\s*\(\s*({_NUM})\s*,\s*({_NUM})\s*\)"),
)


def order_box(box: Sequence[float]) -> Box | None:
    """(x1, y1, x2, y2) with x1 <= x2 and y1 <= y2 (swapped if needed); None unless 4 finite numbers."""
    if isinstance(box, str | bytes) or len(box) != 4:
        return None
    vals = [parse_number(v) for v in box]
    if any(v is None for v in vals):
        return None
    x1, y1, x2, y2 = vals  # type: ignore[misc]
    return (min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2))


def _last_box(text: str) -> Box | None:
    best: tuple[int, Box] | None = None
    for rx in _BOX_RES:
        for m in rx.finditer(text):
            box = order_box([float(g) for g in m.groups()])
            if box is not None and (best is None or m.end() > best[0]):
                best = (m.end(), box)
    return best[1] if best else None


def parse_box(text: str, tag: str = "answer") -> Box | None:
    """The last box written in `text`, as (x1, y1, x2, y2) with x1 <= x2, y1 <= y2; else None.

    Forms: ``[x1, y1, x2, y2]``, ``{"bbox_2d": [x1, y1, x2, y2], ...}`` (Qwen2.5-VL's JSON, also in a
    ```json fence or a list of objects), ``(x1, y1, x2, y2)`` and ``(x1,y1),(x2,y2)``. Boxes inside the
    last ``<answer>...</answer>`` take precedence; without a box there, the last box anywhere counts.
    """
    inner = extract_tag(text, tag)
    if inner is not None:
        box = _last_box(inner)
        if box is not None:
            return box
    return _last_box(text)


def box_area(box: Sequence[float]) -> float:
    b = order_box(box)
    return 0.0 if b is None else (b[2] - b[0]) * (b[3] - b[1])


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two (x1, y1, x2, y2) boxes (corners ordered first); 0 if either is
    degenerate (zero area) or not a box."""
    a_, b_ = order_box(a), order_box(b)
    if a_ is None or b_ is None:
        return 0.0
    area_a, area_b = box_area(a_), box_area(b_)
    if area_a <= 0 or area_b <= 0:
        return 0.0
    iw = min(a_[2], b_[2]) - max(a_[0], b_[0])
    ih = min(a_[3], b_[3]) - max(a_[1], b_[1])
    inter = max(iw, 0.0) * max(ih, 0.0)
    return inter / (area_a + area_b - inter)


def rescale_box(box: Sequence[float], from_size: Sequence[float], to_size: Sequence[float]) -> Box:
    """Map a box between two coordinate frames given as (width, height):
    x' = x * W_to / W_from, y' = y * H_to / H_from."""
    (fw, fh), (tw, th) = from_size, to_size
    if min(fw, fh, tw, th) <= 0:
        raise ValueError(
            f"sizes must be positive, got from_size={tuple(from_size)}, to_size={tuple(to_size)}"
        )
    sx, sy = tw / fw, th / fh
    x1, y1, x2, y2 = (float(v) for v in box)
    return (x1 * sx, y1 * sy, x2 * sx, y2 * sy)


COORDS = ("absolute", "norm1000", "resized")


@register_reward("box_iou")
class BoxIoU(Reward):
    """IoU of the completion's bounding box with the reference box (absolute / norm1000 / resized coords).

    The box is parsed with `parse_box` (last box wins, <answer> content first); a completion without
    a box scores 0, reversed corners are swapped, a zero-area box scores 0. The reference column
    (``box_column``, "box") holds [x1, y1, x2, y2] (or a string of it) in absolute pixels of the
    ORIGINAL image; ``None`` gives NaN. ``coords`` says how the completion's box is written, with
    (W, H) the original size (columns ``width_column``/``height_column``, "image_width"/"image_height")
    and (W_r, H_r) the model's resized input (``resized_width_column``/``resized_height_column``,
    "resized_width"/"resized_height", filled in by the VLM policy):

    - "absolute": original pixels, used as is;
    - "norm1000": Qwen2-VL's 0..1000 grid, x_abs = x / 1000 * W, y_abs = y / 1000 * H;
    - "resized": pixels of the resized input, x_abs = x * W / W_r, y_abs = y * H / H_r.

    Boxes are not clipped to the image. Score: with ``threshold`` None and ``dense`` True (default)
    the IoU; ``dense=False`` gives 1 if IoU >= ``threshold`` else 0 (a threshold is then required);
    ``threshold`` with ``dense=True`` gives the IoU where IoU >= threshold, else 0.
    """

    needs = {"texts"}

    def __init__(
        self,
        *,
        box_column: str = "box",
        coords: str = "absolute",
        width_column: str = "image_width",
        height_column: str = "image_height",
        resized_width_column: str = "resized_width",
        resized_height_column: str = "resized_height",
        threshold: float | None = None,
        dense: bool = True,
        tag: str = "answer",
    ) -> None:
        if coords not in COORDS:
            raise ValueError(f"reward {self.name!r}: coords={coords!r}; choose one of {COORDS}")
        if threshold is not None and not 0.0 <= float(threshold) <= 1.0:
            raise ValueError(f"reward {self.name!r}: threshold must be in [0, 1], got {threshold!r}")
        if not dense and threshold is None:
            raise ValueError(f"reward {self.name!r}: dense=False (a 1/0 reward) needs a threshold")
        self.box_column = box_column
        self.coords = coords
        self.width_column, self.height_column = width_column, height_column
        self.resized_width_column, self.resized_height_column = resized_width_column, resized_height_column
        self.threshold = None if threshold is None else float(threshold)
        self.dense = dense
        self.tag = tag

    def _reference(self, ref: Any) -> Box:
        if hasattr(ref, "tolist"):  # a tensor / numpy array
            ref = ref.tolist()
        box = (
            parse_box(ref, self.tag)
            if isinstance(ref, str)
            else order_box(ref)
            if isinstance(ref, Sequence)
            else None
        )
        if box is None:
            raise ValueError(f"reward {self.name!r}: reference box {ref!r} is not [x1, y1, x2, y2]")
        return box

    @staticmethod
    def _size(name: str, w: Any, h: Any, row: int) -> tuple[float, float]:
        pw, ph = parse_number(w), parse_number(h)
        if pw is None or ph is None or pw <= 0 or ph <= 0:
            raise ValueError(f"row {row}: {name} size ({w!r}, {h!r}) is not two positive numbers")
        return pw, ph

    def to_absolute(
        self, box: Box, original: tuple[float, float] | None, resized: tuple[float, float] | None
    ) -> Box:
        """The completion's box in absolute pixels of the original image (see the class docstring)."""
        if self.coords == "absolute":
            return box
        assert original is not None
        if self.coords == "norm1000":
            return rescale_box(box, (1000.0, 1000.0), original)
        assert resized is not None
        return rescale_box(box, resized, original)

    def score_iou(self, value: float) -> float:
        if self.threshold is None:
            return value
        hit = value >= self.threshold
        return (value if hit else 0.0) if self.dense else float(hit)

    def __call__(self, batch: RewardBatch) -> Tensor:
        texts = batch.texts
        refs = _column(self, batch, self.box_column, "reference box")
        n = len(texts)
        widths = heights = rws = rhs = [None] * n
        if self.coords != "absolute":
            widths = _column(self, batch, self.width_column, f"image width (coords={self.coords!r})")
            heights = _column(self, batch, self.height_column, f"image height (coords={self.coords!r})")
        if self.coords == "resized":
            rws = _column(self, batch, self.resized_width_column, "resized width (coords='resized')")
            rhs = _column(self, batch, self.resized_height_column, "resized height (coords='resized')")
        out = []
        unparsed: list[int] = []
        for i in range(n):
            if refs[i] is None:
                out.append(math.nan)
                continue
            ref = self._reference(refs[i])
            pred = parse_box(texts[i], self.tag)
            if pred is None:
                out.append(0.0)
                unparsed.append(i)
                continue
            original = (
                self._size("original image", widths[i], heights[i], i) if self.coords != "absolute" else None
            )
            resized = self._size("resized image", rws[i], rhs[i], i) if self.coords == "resized" else None
            out.append(self.score_iou(iou(self.to_absolute(pred, original, resized), ref)))
        self.last_unparsed = len(unparsed)
        if unparsed:
            i = unparsed[0]
            source = batch.get("_source")
            where = f" ({source[i]})" if isinstance(source, list) and source[i] else ""
            log.warning(
                "reward %r: no box could be parsed from %d of %d completions (scored 0), e.g. sample %d%s: %r",
                self.name,
                len(unparsed),
                n,
                i,
                where,
                texts[i][:120],
            )
        return torch.tensor(out, dtype=torch.float32)


# ======================================================================================= BMAS
_WORD_RE = re.compile(r"\w+|[^\w\s]")


def trigram_tokens(text: str) -> list[str]:
    """The tokens the hashing embedding uses: lower-cased words and single punctuation marks."""
    return _WORD_RE.findall(text.lower())


@lru_cache(maxsize=1 << 16)
def _hashed(gram: str) -> int:
    return int.from_bytes(hashlib.blake2b(gram.encode("utf-8"), digest_size=8).digest(), "little")


def trigram_embed(texts: Sequence[str], dim: int = 1024) -> list[Tensor]:
    """Deterministic character-trigram hashing embedding, a dependency-free stand-in for a model.

    Each token of `trigram_tokens` becomes Float[dim]: every character trigram of ``"#token#"`` adds
    +-1 at index ``h % dim`` (sign from the top bit of h, h = 64-bit blake2b of the trigram, so the
    same in every process), then the vector is L2-normalised. Tokens that share trigrams ("cat",
    "cats") are similar, unrelated ones near-orthogonal. Returns one Float[n_tokens, dim] per text.
    """
    out = []
    for text in texts:
        toks = trigram_tokens(text)
        emb = torch.zeros(len(toks), dim, dtype=torch.float32)
        for r, tok in enumerate(toks):
            padded = f"#{tok}#"
            for j in range(len(padded) - 2):
                h = _hashed(padded[j : j + 3])
                emb[r, h % dim] += 1.0 if h >> 63 else -1.0
        out.append(torch.nn.functional.normalize(emb, dim=-1))
    return out


COMBINE_MODES = ("mean", "f1", "precision", "recall")


def bmas_score(response: Tensor, reference: Tensor, combine: str = "mean") -> float:
    """Bidirectional max-average cosine similarity of two token-embedding sets Float[n, d], Float[m, d].

    P = mean over response tokens of the max cosine to a reference token; R = the same from the
    reference side. "mean": (P + R) / 2; "f1": 2PR / (P + R) (0 if P <= 0 or R <= 0); "precision": P;
    "recall": R. NaN if the reference has no tokens, 0 if the response has none.
    """
    if combine not in COMBINE_MODES:
        raise ValueError(f"unknown combine {combine!r}; choose one of {COMBINE_MODES}")
    if reference.shape[0] == 0:
        return math.nan
    if response.shape[0] == 0:
        return 0.0
    a = torch.nn.functional.normalize(response.detach().double(), dim=-1)
    b = torch.nn.functional.normalize(reference.detach().double().to(a.device), dim=-1)
    sim = (a @ b.T).clamp(-1.0, 1.0)
    p = sim.max(dim=1).values.mean().item()
    r = sim.max(dim=0).values.mean().item()
    if combine == "precision":
        return p
    if combine == "recall":
        return r
    if combine == "mean":
        return (p + r) / 2
    return 0.0 if p <= 0 or r <= 0 else 2 * p * r / (p + r)


EMBEDDING_LAYERS = ("input", "hidden")


class HFTokenEmbedder:
    """Token embeddings from a local Hugging Face model folder, loaded once (`AutoModel` + `AutoTokenizer`).

    ``layer="input"``: rows of the input-embedding matrix for the token ids (context-free);
    ``layer="hidden"``: the last hidden states (contextual). No special tokens are added; texts
    run in batches of `batch_size` under ``torch.no_grad()`` on `device`, truncated to `max_length`.
    """

    def __init__(
        self,
        path: str | Path,
        layer: str = "input",
        device: str = "cpu",
        batch_size: int = 32,
        max_length: int = 512,
    ) -> None:
        if layer not in EMBEDDING_LAYERS:
            raise ValueError(f"embedding_layer={layer!r}; choose one of {EMBEDDING_LAYERS}")
        path = Path(path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"embedding model folder {str(path)!r} does not exist (a local model folder is required)"
            )
        from transformers import AutoModel, AutoTokenizer

        self.path = path
        self.layer = layer
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        self.max_length = int(max_length)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).to(self.device).eval()
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        if self.tokenizer.pad_token is None:  # nothing to pad with: one text at a time
            self.batch_size = 1

    @torch.no_grad()
    def __call__(self, texts: Sequence[str]) -> list[Tensor]:
        out: list[Tensor] = []
        for start in range(0, len(texts), self.batch_size):
            chunk = list(texts[start : start + self.batch_size])
            enc = self.tokenizer(
                chunk,
                add_special_tokens=False,
                padding=self.batch_size > 1,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            ids, mask = enc["input_ids"], enc["attention_mask"]
            if self.layer == "input":
                emb = self.model.get_input_embeddings()(ids)
            else:
                emb = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
            for row, m in zip(emb, mask, strict=True):
                out.append(row[m.bool()].float().cpu())
        return out


@register_reward("bmas")
class BMAS(Reward):
    """Open-ended answer similarity: bidirectional max-average cosine of token embeddings (BMAS).

    For each response token the max cosine similarity over the reference tokens, averaged (P); the
    same from the reference side (R); the reward is ``combine`` of the two: "mean" (default) (P+R)/2,
    "f1" 2PR/(P+R), or one side only ("precision" P, "recall" R); see `bmas_score`. The response is
    the completion's answer found by ``extract`` (a `rewards.text.extract_answer` mode, "tag" by
    default: the last <``tag``>...</``tag``>; "none" = the whole completion); no answer found scores 0.
    The reference is the ``answer_column`` ("answer") column; ``None`` or an empty reference is NaN.

    ``embedding``: a local Hugging Face model folder (loaded once with AutoModel/AutoTokenizer on
    ``device``; ``embedding_layer`` "input" = the input-embedding rows, "hidden" = last hidden
    states; batches of ``batch_size`` under no_grad), or None (default) for the dependency-free
    character-trigram hashing stand-in `trigram_embed` (``hash_dim`` wide), or (from Python) a
    callable ``texts -> [Float[n_i, d]]``. A missing folder fails at construction, naming the path.
    """

    needs = {"texts"}

    def __init__(
        self,
        *,
        answer_column: str = "answer",
        embedding: str | TokenEmbedFn | None = None,
        embedding_layer: str = "input",
        device: str = "cpu",
        batch_size: int = 32,
        max_length: int = 512,
        combine: str = "mean",
        extract: str = "tag",
        tag: str = "answer",
        hash_dim: int = 1024,
    ) -> None:
        if combine not in COMBINE_MODES:
            raise ValueError(f"reward {self.name!r}: combine={combine!r}; choose one of {COMBINE_MODES}")
        if extract not in EXTRACT_MODES:
            raise ValueError(f"reward {self.name!r}: extract={extract!r}; choose one of {EXTRACT_MODES}")
        if embedding_layer not in EMBEDDING_LAYERS:
            raise ValueError(
                f"reward {self.name!r}: embedding_layer={embedding_layer!r}; choose one of {EMBEDDING_LAYERS}"
            )
        self.embed: TokenEmbedFn
        if embedding is None:
            if hash_dim <= 0:
                raise ValueError(f"reward {self.name!r}: hash_dim must be > 0, got {hash_dim}")
            self.embed = lambda texts: trigram_embed(texts, hash_dim)
        elif callable(embedding):
            self.embed = embedding
        else:
            try:
                self.embed = HFTokenEmbedder(embedding, embedding_layer, device, batch_size, max_length)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"reward {self.name!r}: {e}") from e
        self.answer_column = answer_column
        self.combine = combine
        self.extract = extract
        self.tag = tag

    def scores(self, responses: Sequence[str | None], references: Sequence[Any]) -> list[float]:
        """BMAS of each (response, reference) pair; None response -> 0, None reference -> NaN."""
        unique = list(dict.fromkeys(str(s) for s in [*responses, *references] if s is not None))
        embs = dict(zip(unique, self.embed(unique), strict=True)) if unique else {}
        out = []
        for resp, ref in zip(responses, references, strict=True):
            if ref is None:
                out.append(math.nan)
            elif resp is None:
                out.append(0.0)
            else:
                out.append(bmas_score(embs[str(resp)], embs[str(ref)], self.combine))
        return out

    def __call__(self, batch: RewardBatch) -> Tensor:
        refs = _column(self, batch, self.answer_column, "answer")
        responses = [extract_answer(t, self.extract, self.tag) for t in batch.texts]
        return torch.tensor(self.scores(responses, refs), dtype=torch.float32)


# ============================================================================ mixed accuracy
# type -> (reward class, options it is built with that the config cannot change)
SUB_REWARDS: dict[str, tuple[type[Reward], dict[str, Any]]] = {
    "multiple_choice": (MultipleChoice, {}),
    "numeric": (AnswerAccuracy, {"mode": "numeric"}),
    "exact": (AnswerAccuracy, {"mode": "exact"}),
    "box_iou": (BoxIoU, {}),
    "bmas": (BMAS, {}),
}


def _subset(batch: RewardBatch, rows: list[int]) -> RewardBatch:
    n = len(batch)

    def take(v: Any) -> Any:
        if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == n:
            return v[torch.as_tensor(rows, dtype=torch.long, device=v.device)]
        if isinstance(v, list | tuple) and len(v) == n:
            return [v[i] for i in rows]
        return v

    return RewardBatch(
        prompts=[batch.prompts[i] for i in rows],
        outputs={k: take(v) for k, v in batch.outputs.items()},
        columns={k: take(v) for k, v in batch.columns.items()},
        group=take(batch.group),
    )


@register_reward("mixed_accuracy")
class MixedAccuracy(Reward):
    """Per-sample accuracy chosen by a dataset column: multiple_choice, numeric, exact, box_iou or bmas.

    The ``type_column`` ("reward_type") of each row names the reward that scores it:
    "multiple_choice" (`multiple_choice`), "numeric" / "exact" (`answer_accuracy` with that mode),
    "box_iou" (`box_iou`) or "bmas" (`bmas`). ``aliases`` maps other dataset values onto these
    (e.g. ``{"multiple choice": "multiple_choice", "numerical": "numeric"}``). Each sub-reward's
    options are given as a nested dict under its type name, e.g. ``box_iou: {coords: norm1000}``;
    every sub-reward is built (and its options checked) at construction. A value that is not a known
    type is a ValueError naming the value, the row (and its ``_source`` column if present) and the
    allowed values; a ``None`` type is NaN (not applicable).
    """

    needs = {"texts"}

    def __init__(
        self,
        *,
        type_column: str = "reward_type",
        aliases: Mapping[str, str] | None = None,
        multiple_choice: Mapping[str, Any] | None = None,
        numeric: Mapping[str, Any] | None = None,
        exact: Mapping[str, Any] | None = None,
        box_iou: Mapping[str, Any] | None = None,
        bmas: Mapping[str, Any] | None = None,
    ) -> None:
        self.type_column = type_column
        self.aliases = dict(aliases or {})
        bad = {k: v for k, v in self.aliases.items() if v not in SUB_REWARDS}
        if bad:
            raise ValueError(
                f"reward {self.name!r}: aliases {bad} point to unknown types; allowed: {sorted(SUB_REWARDS)}"
            )
        given = {
            "multiple_choice": multiple_choice,
            "numeric": numeric,
            "exact": exact,
            "box_iou": box_iou,
            "bmas": bmas,
        }
        self.sub: dict[str, Reward] = {}
        for kind, opts in given.items():
            if opts is not None and not isinstance(opts, Mapping):
                raise TypeError(
                    f"reward {self.name!r}: option {kind!r} must be a dict of options, got {opts!r}"
                )
            cls, fixed = SUB_REWARDS[kind]
            opts = dict(opts or {})
            try:
                clash = sorted(set(fixed) & set(opts))
                if clash:
                    raise TypeError(f"option(s) {clash} are fixed for type {kind!r}: {fixed}")
                _check_options(kind, cls.__init__, 1, opts)
                reward = cls(**fixed, **opts)
            except TypeError as e:
                raise TypeError(f"reward {self.name!r}, option {kind!r}: {e}") from e
            except (ValueError, FileNotFoundError) as e:
                raise type(e)(f"reward {self.name!r}, option {kind!r}: {e}") from e
            reward.name = f"{self.name}.{kind}"
            self.sub[kind] = reward

    @property
    def allowed(self) -> list[str]:
        return sorted(SUB_REWARDS) + sorted(self.aliases)

    def resolve(self, value: Any, row: int, batch: RewardBatch) -> str | None:
        """The reward type of one row (after `aliases`); ValueError for an unknown value."""
        if value is None:
            return None
        if isinstance(value, str) and value in SUB_REWARDS:
            return value
        if isinstance(value, str) and value in self.aliases:
            return self.aliases[value]
        source = batch.columns.get("_source")
        where = f"row {row}" + (f" ({source[row]})" if source is not None and source[row] is not None else "")
        raise ValueError(
            f"reward {self.name!r}: {where} has {self.type_column}={value!r}, which is not a known reward type; "
            f"allowed: {', '.join(self.allowed)}"
        )

    def __call__(self, batch: RewardBatch) -> Tensor:
        kinds = _column(self, batch, self.type_column, "reward type")
        rows: dict[str, list[int]] = {}
        for i, value in enumerate(kinds):
            kind = self.resolve(value, i, batch)
            if kind is not None:
                rows.setdefault(kind, []).append(i)
        out = torch.full((len(batch),), math.nan, dtype=torch.float32)
        for kind, idx in rows.items():
            values = torch.as_tensor(self.sub[kind](_subset(batch, idx)), dtype=torch.float32).flatten().cpu()
            out[torch.tensor(idx, dtype=torch.long)] = values
        return out
