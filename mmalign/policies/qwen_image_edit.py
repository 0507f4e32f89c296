"""`QwenImageEditPolicy`: Qwen-Image-Edit (``QwenImageEditPipeline``) as a flow-matching GRPO policy.

A `mmalign.policies.qwen_image.QwenImagePolicy` whose every sample also sees a source image: in the prompt
states (Qwen2.5-VL reads the instruction with the source; `row_conditioning`) and in the sequence (the
source's packed VAE latents after the noisy tokens).

Details: docs/algorithms.md, "Qwen-Image-Edit inputs", and docs/image_edit.md.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from mmalign.data.rows import DataError
from mmalign.policies.flux_kontext import distinct_sources
from mmalign.policies.qwen_image import QwenImagePolicy, qwen_image_velocity
from mmalign.policies.qwen_image_components import (
    QwenImageEditComponents,
    load_qwen_image_edit_components,
)
from mmalign.policies.wan_components import latent_stats

__all__ = ["ENCODE_BATCH", "QwenImageEditPolicy", "source_image", "source_pixels"]

ENCODE_BATCH = 8
"""Distinct (instruction, source) pairs the VLM reads, and sources the VAE encodes, at once."""
PROMPT_KEYS = ("prompt_embeds", "prompt_mask")
NEGATIVE_KEYS = ("negative_prompt_embeds", "negative_prompt_mask")


def source_image(image: Any, side: int) -> Any:
    """The RGB PIL image of `image` (a path or a PIL image) at `side` x `side` pixels (Lanczos when its size
    differs, as diffusers' ``VaeImageProcessor.resize``)."""
    from PIL import Image

    from mmalign.data.media import load_rgb

    pil = load_rgb(image)
    if pil.size != (side, side):
        pil = pil.resize((side, side), resample=Image.Resampling.LANCZOS)
    return pil


def source_pixels(pil: Any) -> Tensor:
    """Float[3, H, W] in [-1, 1] of an RGB PIL image (``x / 255 * 2 - 1``, as ``VaeImageProcessor.preprocess``)."""
    import numpy as np

    arr = torch.from_numpy(np.asarray(pil, dtype=np.float32).copy()).permute(2, 0, 1) / 255.0
    return arr * 2 - 1


class QwenImageEditPolicy(QwenImagePolicy):
    """Qwen-Image-Edit: a `QwenImagePolicy` conditioned on each row's source image (see the module docstring)."""

    components: QwenImageEditComponents
    conditioning_keys = ()
    negative_row_keys = MappingProxyType(dict(zip(PROMPT_KEYS, NEGATIVE_KEYS, strict=True)))

    def __init__(
        self,
        transformer: torch.nn.Module,
        vae: torch.nn.Module,
        scheduler: Any,
        text_encoder: torch.nn.Module,
        tokenizer: Any,
        processor: Any,
        *,
        image_column: str = "source_image",
        **kwargs: Any,
    ) -> None:
        """The parts of a Qwen-Image-Edit folder (`QwenImageEditComponents`); `image_column`: the dataset column
        holding each row's source image. ``max_sequence_length`` bounds the instruction's states after the
        image's vision tokens. Other keywords are `QwenImagePolicy`'s (``guidance_scale``, true CFG with
        ``negative_prompt``, defaults to 4.0 as the pipeline's ``true_cfg_scale``)."""
        if processor is None:
            raise ValueError(
                "Qwen-Image-Edit needs its processor (the folder's processor/, a Qwen2VLProcessor)"
            )
        self.image_column = image_column
        self.processor = processor
        super().__init__(transformer, vae, scheduler, text_encoder, tokenizer, **kwargs)
        self.components = QwenImageEditComponents(
            transformer, vae, scheduler, text_encoder, tokenizer, processor
        )

    @classmethod
    def load_components(
        cls, name_or_path: str | Path, *, dtype: torch.dtype, load_t5: bool = True, **options: Any
    ) -> QwenImageEditComponents:
        """`load_qwen_image_edit_components` (``load_t5`` is ignored)."""
        return load_qwen_image_edit_components(name_or_path, dtype=dtype)

    @property
    def row_conditioning_keys(self) -> tuple[str, ...]:  # type: ignore[override]
        """The prompt states, with true CFG the negative prompt's, and the source latents."""
        negative = NEGATIVE_KEYS if self._cfg_scale() > 1.0 else ()
        return (*PROMPT_KEYS, *negative, "image_latents")

    def encode_conditioning(self, prompts: list[str]) -> dict[str, Tensor]:
        """{}: the prompt states depend on the row's image, so they are row conditioning (`row_conditioning`)."""
        return {}

    # ------------------------------------------------------------------ the source image
    def pixel_size(self) -> int:
        """Side of the edited image in pixels: ``latent_size`` times the VAE's factor."""
        return self.latent_size * self.vae_scale_factor

    @torch.no_grad()
    def encode_source(self, pixels: Tensor) -> Tensor:
        """Float[B, z, h, w] (fp32, the policy's device): the normalised VAE latents of source images Float[B, 3,
        H, W] in [-1, 1], ``(mode(E(x)) - latents_mean) / latents_std`` of each as a one-frame video."""
        dtype = next(self.vae.parameters()).dtype
        mean, std = latent_stats(self.vae, self.device)
        out = []
        for s in range(0, pixels.shape[0], ENCODE_BATCH):
            x = pixels[s : s + ENCODE_BATCH, :, None].to(self.device, dtype)
            out.append(((self.vae.encode(x).latent_dist.mode().float() - mean) / std)[:, :, 0])
        return torch.cat(out)

    def encode_prompts(self, prompts: list[str], images: list[Any]) -> tuple[Tensor, Tensor]:
        """(Float[N, L, D], Long[N, L]) fp32 on the policy's device: `encode_edit_prompt` of each prompt with its
        image (PIL), `ENCODE_BATCH` pairs per VLM call."""
        embeds, masks = [], []
        for s in range(0, len(prompts), ENCODE_BATCH):
            e, m = self.components.encode_edit_prompt(
                prompts[s : s + ENCODE_BATCH],
                images[s : s + ENCODE_BATCH],
                self.device,
                max_sequence_length=self.max_sequence_length,
            )
            embeds.append(e.float())
            masks.append(m)
        return torch.cat(embeds), torch.cat(masks)

    def row_conditioning(self, columns: dict[str, list[Any]], group: Tensor) -> dict[str, Tensor]:
        """{key of ``row_conditioning_keys``: [B, ...]}: each sample's instruction (column ``prompt``) read with its
        source (column ``image_column``) by the VLM, the negative prompt with the same source under true CFG,
        and the source's latents (`encode_source`); each distinct source and each distinct (instruction,
        source) pair of the batch is encoded once."""
        images, image_of = distinct_sources(columns, self.image_column, "QwenImageEditPolicy")
        prompts = columns.get("prompt")
        if prompts is None or len(prompts) != len(image_of):
            raise DataError("QwenImageEditPolicy: the rows have no 'prompt' column (the instruction)")
        side = self.pixel_size()
        try:
            pils = [source_image(im, side) for im in images]
        except OSError as e:
            raise DataError(f"QwenImageEditPolicy: column {self.image_column!r}: {e}") from e
        pairs = list(dict.fromkeys(zip((str(p) for p in prompts), image_of, strict=True)))
        pair_of = {pair: j for j, pair in enumerate(pairs)}
        embeds, mask = self.encode_prompts([p for p, _ in pairs], [pils[k] for _, k in pairs])
        rows = torch.tensor([pair_of[(str(p), k)] for p, k in zip(prompts, image_of, strict=True)])
        by_image = torch.tensor(image_of)
        out = {"prompt_embeds": embeds[rows.to(embeds.device)], "prompt_mask": mask[rows.to(mask.device)]}
        if NEGATIVE_KEYS[0] in self.row_conditioning_keys:
            neg, neg_mask = self.encode_prompts([self.negative_prompt] * len(pils), pils)
            out["negative_prompt_embeds"] = neg[by_image.to(neg.device)]
            out["negative_prompt_mask"] = neg_mask[by_image.to(neg.device)]
        z = self.encode_source(torch.stack([source_pixels(p) for p in pils]))
        out["image_latents"] = z[by_image.to(z.device)]
        return out

    # ------------------------------------------------------------------ model
    def velocity(
        self, model: torch.nn.Module, latents: Tensor, sched: dict[str, Tensor], cond: dict[str, Tensor]
    ) -> Tensor:
        """`qwen_image_velocity` with the row's prompt states and its source latents appended to the sequence."""
        n_train = int(self.scheduler.config.num_train_timesteps)
        return qwen_image_velocity(
            model,
            latents,
            sched["sigmas"],
            cond["prompt_embeds"],
            cond["prompt_mask"],
            n_train,
            source=cond["image_latents"],
        )
