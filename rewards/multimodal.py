r"""Multimodal accuracy rewards (the "Mixed-R1 family"): `multiple_choice`, `box_iou`, `bmas`, `mixed_accuracy`.

- ``multiple_choice``: the choice letter of the completion against a reference letter.
- ``box_iou``: IoU of the completion's bounding box with a reference box, with the coordinate
  conventions of the usual VLMs (absolute pixels, Qwen2-VL's 0-1000 grid, pixels of the resized input);
  it lives in `rewards.boxes` with the other grounding rewards and is re-exported here.
- ``bmas``: bidirectional max-average cosine similarity of token embeddings (open-ended answers).
- ``mixed_accuracy``: picks one of the above (or `answer_accuracy`) per sample from a dataset column.

The helpers `parse_choice`, `extract_choice`, `parse_box`, `iou`, `rescale_box` (the box ones
re-exported from `rewards.boxes`), `trigram_embed` and `bmas_score` are public so pipelines and tests can use them on their own. Answer extraction
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

from .base import Reward, RewardBatch, check_options, register_reward
from .boxes import COORDS, Box, BoxIoU, batch_column, box_area, iou, order_box, parse_box, rescale_box
from .text import EXTRACT_MODES, AnswerAccuracy, extract_answer, extract_boxed, extract_tag

__all__ = [
    "BMAS",
    "COORDS",
    "Box",
    "BoxIoU",
    "HFTokenEmbedder",
    "MixedAccuracy",
    "MultipleChoice",
    "bmas_score",
    "box_area",
    "extract_choice",
    "iou",
    "order_box",
    "parse_box",
    "parse_choice",
    "rescale_box",
    "trigram_embed",
    "trigram_tokens",
]

TokenEmbedFn = Callable[[Sequence[str]], Sequence[Tensor]]

log = logging.getLogger(__name__)


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
        refs = batch_column(self, batch, self.answer_column, "answer")
        return torch.tensor(
            [self.score(t, r) for t, r in zip(batch.texts, refs, strict=True)], dtype=torch.float32
        )


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
        refs = batch_column(self, batch, self.answer_column, "answer")
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
                check_options(kind, cls.__init__, 1, opts)
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
        kinds = batch_column(self, batch, self.type_column, "reward type")
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
