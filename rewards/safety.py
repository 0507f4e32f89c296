"""Safety rewards and flaggers: `clip_steering`, `clip_concept_flag`, `classifier_flag`.

- ``clip_steering`` (SafeDiffusion-R1, docs/algorithms.md "Safe diffusion"): the CLIP similarity of the
  image to the prompt pushed along a "safe" direction of text space,
  ``r = cos(z_image, normalize(z_prompt + alpha * v_safe))`` with
  ``v_safe = normalize(mean z(safe anchors) - mean z(unsafe anchors))`` (z: L2-normalised CLIP
  embeddings). Applied to every prompt, safe and unsafe alike.

The other two are *flaggers*: rewards whose value is 1.0 when the image is flagged (shows the
concept to avoid) and 0.0 when not, so that "the share of flagged images" of an evaluation is the
mean of the column, and they plug into the same registry and config format as every reward (use a
negative weight to train against them):

- ``clip_concept_flag``: CLIP zero-shot. Margin rule (default): flagged when the image's highest
  cosine to the `unsafe_concepts` texts exceeds its highest cosine to the `safe_concepts` texts by
  more than `margin`. Threshold rule (when `threshold` is set; then `safe_concepts` must be left
  out): flagged when the highest cosine to the `unsafe_concepts` exceeds `threshold`.
- ``classifier_flag``: a Hugging Face image-classification model by path
  (``AutoModelForImageClassification`` + ``AutoImageProcessor``, e.g. an NSFW detector); flagged when
  the probability of any of `flag_labels` is at least `threshold`.

The offline shapes world's flagger, ``colour_present`` (its stand-in "unsafe concept"), lives with that
world's fixtures: `mmalign.tiny.world_rewards`.

Models load once, at construction; a missing local path is a `FileNotFoundError` naming the path
that was looked for (nothing is downloaded unless a hub id, not a path, is given explicitly).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .base import Reward, RewardBatch, register_reward
from .image import (
    CLIPEmbedder,
    batch_images,
    batch_prompts,
    local_path,
    looks_local,
    to_pil,
)

__all__ = ["ClassifierFlag", "ClipConceptFlag", "ClipSteering", "steering_direction"]


def _texts(reward: Reward | str, key: str, value: Any, required: bool = True) -> list[str]:
    """`value` as a non-empty list of strings, or a ValueError naming the reward and the option."""
    name = reward if isinstance(reward, str) else reward.name
    if value is None and not required:
        return []
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"reward {name!r}: option `{key}` must be a non-empty list of texts, got {value!r}")
    bad = [v for v in value if not isinstance(v, str) or not v.strip()]
    if bad:
        raise ValueError(f"reward {name!r}: option `{key}` must hold non-empty strings, got {bad[0]!r}")
    return list(value)


def _batch_size(reward: Reward, value: Any) -> int:
    if int(value) < 1:
        raise ValueError(f"reward {reward.name!r}: batch_size must be >= 1, got {value!r}")
    return int(value)


def steering_direction(safe: Tensor, unsafe: Tensor) -> Tensor:
    """``normalize(mean(safe) - mean(unsafe))`` for L2-normalised text embeddings Float[N,D], Float[M,D]."""
    d = safe.float().mean(0) - unsafe.float().mean(0)
    norm = d.norm()
    if not torch.isfinite(norm) or norm < 1e-6:
        raise ValueError(
            "the safe and unsafe anchors embed to the same mean (their difference has norm "
            f"{float(norm):.2e}); give anchors that differ"
        )
    return d / norm


def _batched(fn: Any, items: Any, size: int) -> Tensor:
    outs = [fn(items[s : s + size]) for s in range(0, len(items), size)]
    return torch.cat(outs) if outs else torch.zeros(0)


@register_reward("clip_steering")
class ClipSteering(Reward):
    """SafeDiffusion-R1 CLIP steering: cos(image, normalize(prompt + alpha * v_safe)), v_safe from anchor texts."""

    needs = {"images", "prompts"}

    def __init__(
        self,
        *,
        path: str,
        safe_anchors: Sequence[str],
        unsafe_anchors: Sequence[str],
        alpha: float = 0.5,
        backend: str = "hf",
        arch: str | None = None,
        prompt_column: str | None = None,
        batch_size: int = 64,
        device: str | None = None,
    ) -> None:
        """`path`: the CLIP model (as ``clip_score`` takes it); `safe_anchors` / `unsafe_anchors`: the
        texts whose mean embeddings define ``v_safe`` (computed once, here); `alpha`: the step along
        ``v_safe``; `prompt_column`: a dataset column to read the prompts from (default: the prompts)."""
        safe = _texts(self, "safe_anchors", safe_anchors)
        unsafe = _texts(self, "unsafe_anchors", unsafe_anchors)
        self.alpha = float(alpha)
        if not math.isfinite(self.alpha):
            raise ValueError(f"reward {self.name!r}: alpha must be a finite number, got {alpha!r}")
        self.batch_size = _batch_size(self, batch_size)
        self.prompt_column = prompt_column
        self.clip = CLIPEmbedder(path, backend=backend, arch=arch, device=device)
        self.safe_anchors, self.unsafe_anchors = safe, unsafe
        try:
            self.v_safe = steering_direction(self.clip.encode_texts(safe), self.clip.encode_texts(unsafe))
        except ValueError as e:
            raise ValueError(f"reward {self.name!r}: {e}") from e

    def targets(self, prompts: Sequence[str]) -> Tensor:
        """``normalize(z_prompt + alpha * v_safe)`` for each prompt, Float[B, D] (each distinct prompt encoded once)."""
        unique = list(dict.fromkeys(prompts))
        z = _batched(self.clip.encode_texts, unique, self.batch_size)
        t = torch.nn.functional.normalize(z + self.alpha * self.v_safe.to(z.device), dim=-1)
        where = {p: i for i, p in enumerate(unique)}
        return t[torch.tensor([where[p] for p in prompts], dtype=torch.long, device=t.device)]

    def __call__(self, batch: RewardBatch) -> Tensor:
        images = batch_images(self, batch)
        prompts = batch_prompts(self, batch, self.prompt_column)
        if not prompts:
            return torch.zeros(0)
        zi = _batched(self.clip.encode_images, images, self.batch_size)
        return (zi * self.targets(prompts).to(zi.device)).sum(-1).float().cpu()


@register_reward("clip_concept_flag")
class ClipConceptFlag(Reward):
    """CLIP zero-shot concept flag: 1.0 when the image looks more like `unsafe_concepts` than `safe_concepts`."""

    needs = {"images"}

    def __init__(
        self,
        *,
        path: str,
        unsafe_concepts: Sequence[str],
        safe_concepts: Sequence[str] | None = None,
        margin: float = 0.0,
        threshold: float | None = None,
        backend: str = "hf",
        arch: str | None = None,
        batch_size: int = 64,
        device: str | None = None,
    ) -> None:
        """Margin rule (``threshold=None``): flagged when max cos(image, unsafe) - max cos(image, safe) > `margin`
        (`safe_concepts` required). Threshold rule: flagged when max cos(image, unsafe) > `threshold`."""
        self.unsafe_concepts = _texts(self, "unsafe_concepts", unsafe_concepts)
        self.safe_concepts = _texts(self, "safe_concepts", safe_concepts, required=threshold is None)
        if threshold is not None and self.safe_concepts:
            raise ValueError(
                f"reward {self.name!r}: give either `safe_concepts` (margin rule) or `threshold` "
                f"(threshold rule on the unsafe similarity), not both"
            )
        self.margin = float(margin)
        self.threshold = None if threshold is None else float(threshold)
        self.batch_size = _batch_size(self, batch_size)
        self.clip = CLIPEmbedder(path, backend=backend, arch=arch, device=device)
        self.unsafe_z = self.clip.encode_texts(self.unsafe_concepts)
        self.safe_z = self.clip.encode_texts(self.safe_concepts) if self.safe_concepts else None

    def scores(self, images: Tensor) -> Tensor:
        """The flag's score, Float[B]: max unsafe cos minus max safe cos (margin rule) or max unsafe cos."""
        if images.shape[0] == 0:
            return torch.zeros(0)
        zi = _batched(self.clip.encode_images, images, self.batch_size)
        s = (zi @ self.unsafe_z.T).amax(-1)
        if self.safe_z is not None:
            s = s - (zi @ self.safe_z.T).amax(-1)
        return s.float().cpu()

    def __call__(self, batch: RewardBatch) -> Tensor:
        s = self.scores(batch_images(self, batch))
        cut = self.margin if self.threshold is None else self.threshold
        return (s > cut).float()


@register_reward("classifier_flag")
class ClassifierFlag(Reward):
    """Image-classifier flag (e.g. an NSFW detector): 1.0 when P(any of `flag_labels`) >= `threshold`."""

    needs = {"images"}

    def __init__(
        self,
        *,
        path: str,
        flag_labels: Sequence[str],
        threshold: float = 0.5,
        batch_size: int = 32,
        device: str | None = None,
    ) -> None:
        """`path`: a folder (or, explicitly, a hub id) with an image-classification model and its image
        processor; `flag_labels`: names from the model's ``config.id2label``. Probabilities are a softmax
        over the labels, or per-label sigmoids when ``config.problem_type`` is multi-label."""
        from transformers import AutoImageProcessor, AutoModelForImageClassification

        labels = _texts(self, "flag_labels", flag_labels)
        source = str(path)
        if Path(source).expanduser().exists() or looks_local(source):
            source = str(local_path(source, f"reward {self.name!r}: image classifier folder"))
        try:
            self.model = AutoModelForImageClassification.from_pretrained(source)
            self.processor = AutoImageProcessor.from_pretrained(source)
        except OSError as e:
            if source != str(path):
                raise
            raise FileNotFoundError(
                f"reward {self.name!r}: image classifier {path!r}: no such local folder "
                f"({Path(path).resolve()}) and it could not be loaded as a hub id: {e}"
            ) from e
        id2label = {int(k): str(v) for k, v in self.model.config.id2label.items()}
        label2id = {v: k for k, v in id2label.items()}
        missing = [lab for lab in labels if lab not in label2id]
        if missing:
            raise ValueError(
                f"reward {self.name!r}: flag_labels {missing} are not labels of {path}; "
                f"its labels: {[id2label[i] for i in sorted(id2label)]}"
            )
        self.flag_labels = labels
        self.flag_ids = [label2id[lab] for lab in labels]
        self.threshold = float(threshold)
        self.batch_size = _batch_size(self, batch_size)
        self.multi_label = getattr(self.model.config, "problem_type", None) == "multi_label_classification"
        self.device = torch.device(device or "cpu")
        self.model.eval().requires_grad_(False).to(self.device)

    def probabilities(self, images: Tensor) -> Tensor:
        """P(label) for every label of the model, Float[B, num_labels] (images Float[B,3,H,W] in [0,1])."""

        def run(chunk: Tensor) -> Tensor:
            inputs = self.processor(images=[to_pil(im) for im in chunk.cpu()], return_tensors="pt")
            pixels = inputs["pixel_values"].to(self.device, dtype=next(self.model.parameters()).dtype)
            with torch.no_grad():
                logits = self.model(pixel_values=pixels).logits.float()
            return (logits.sigmoid() if self.multi_label else logits.softmax(-1)).cpu()

        return _batched(run, images.detach(), self.batch_size)

    def __call__(self, batch: RewardBatch) -> Tensor:
        images = batch_images(self, batch)
        if images.shape[0] == 0:
            return torch.zeros(0)
        p = self.probabilities(images)[:, self.flag_ids]
        return (p.amax(-1) >= self.threshold).float()
