"""`QwenImageEditPlusPolicy`: Qwen-Image-Edit-2509 / 2511 (``QwenImageEditPlusPipeline``) as a flow-matching GRPO
policy.

A `mmalign.policies.qwen_image_edit.QwenImageEditPolicy` whose every sample sees SEVERAL source images (the row's
``image_column``: one path / PIL image, or a list of them; every sample of a batch must have the same number),
each in the two places the pipeline feeds it (the VLM's prompt states and the packed source latents).

Details: docs/image_edit.md, "Qwen-Image-Edit-2509 / 2511" and "mmalign.policies.qwen_image_edit_plus".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.data.rows import DataError
from mmalign.policies.flux import pack_latents, unpack_latents
from mmalign.policies.qwen_image_components import (
    CONDITION_IMAGE_PIXELS,
    QwenImageEditPlusComponents,
    condition_size,
    load_qwen_image_edit_plus_components,
)
from mmalign.policies.qwen_image_edit import ENCODE_BATCH, QwenImageEditPolicy, source_image, source_pixels

__all__ = ["QwenImageEditPlusPolicy", "condition_image", "qwen_image_edit_plus_velocity", "source_lists"]


def qwen_image_edit_plus_velocity(
    model: torch.nn.Module,
    latents: Tensor,
    sigmas: Tensor,
    embeds: Tensor,
    mask: Tensor,
    num_train_timesteps: int,
    sources: Tensor,
) -> Tensor:
    """Float[B, z, h, w]: one ``QwenImageTransformer2DModel`` call on the noisy latents [B, z, h, w] followed in
    the sequence by the packed tokens of each source of `sources` [B, n, z, hs, ws] (``img_shapes``: the noisy
    frame, then one frame per source), at noise levels `sigmas` Float[B] (timestep ``sigma *
    num_train_timesteps / 1000``), prompt states `embeds` [B, L, D] and their 0/1 `mask`; only the noisy tokens'
    output is kept, as ``QwenImageEditPlusPipeline``."""
    dtype = next(model.parameters()).dtype
    b, _, h, w = latents.shape
    tokens = [pack_latents(latents)] + [
        pack_latents(sources[:, j].to(latents.dtype)) for j in range(sources.shape[1])
    ]
    hs, ws = sources.shape[-2:]
    shapes = [(1, h // 2, w // 2)] + [(1, hs // 2, ws // 2)] * sources.shape[1]
    out = model(
        hidden_states=torch.cat(tokens, dim=1).to(dtype),
        timestep=(sigmas.float() * float(num_train_timesteps) / 1000).to(dtype),
        encoder_hidden_states=embeds.to(dtype),
        encoder_hidden_states_mask=mask.bool(),
        img_shapes=[shapes] * b,
        return_dict=False,
    )[0]
    return unpack_latents(out[:, : (h // 2) * (w // 2)].float(), h, w)


def condition_image(image: Any, pixels: int = CONDITION_IMAGE_PIXELS) -> Any:
    """The RGB PIL image of `image` (a path or a PIL image) resized with Lanczos to `condition_size` (~`pixels`,
    its aspect ratio kept): what the pipeline shows the VLM."""
    from PIL import Image

    from mmalign.data.media import load_rgb

    pil = load_rgb(image)
    return pil.resize(condition_size(*pil.size, pixels), resample=Image.Resampling.LANCZOS)


def source_lists(columns: dict[str, list[Any]], image_column: str, who: str) -> list[list[Any]]:
    """Each sample's sources from column `image_column` (a path / PIL image, or a non-empty list of them), all of
    the same length; a missing column or value, or samples with different numbers of sources, is a `DataError`."""
    values = columns.get(image_column)
    if values is None:
        raise DataError(
            f"{who}: the rows have no {image_column!r} column (the source images to edit; "
            f"columns: {sorted(columns) or 'none'})"
        )
    out = []
    for i, v in enumerate(values):
        items = list(v) if isinstance(v, (list, tuple)) else [v]
        if not items or any(x is None or x == "" for x in items):
            raise DataError(f"{who}: sample {i} has no {image_column!r} (one or more source images)")
        out.append(items)
    counts = sorted({len(s) for s in out})
    if len(counts) > 1:
        raise DataError(
            f"{who}: column {image_column!r}: the samples of a batch must have the same number of source images "
            f"(one sequence length per transformer call), got {counts}; split the data by the number of sources"
        )
    return out


class QwenImageEditPlusPolicy(QwenImageEditPolicy):
    """Qwen-Image-Edit-Plus: a `QwenImageEditPolicy` reading several source images per row (see the module
    docstring)."""

    components: QwenImageEditPlusComponents

    def __init__(
        self,
        transformer: torch.nn.Module,
        vae: torch.nn.Module,
        scheduler: Any,
        text_encoder: torch.nn.Module,
        tokenizer: Any,
        processor: Any,
        *,
        condition_pixels: int = CONDITION_IMAGE_PIXELS,
        **kwargs: Any,
    ) -> None:
        """The parts of a Qwen-Image-Edit-Plus folder (`QwenImageEditPlusComponents`); `condition_pixels`: the area
        each picture is resized to for the VLM (the pipeline's 384 x 384). Other keywords are
        `QwenImageEditPolicy`'s (``image_column``, ``max_sequence_length``, ``guidance_scale`` ...)."""
        if condition_pixels < 32 * 32:
            raise ValueError(f"condition_pixels must be >= 1024 (32 x 32), got {condition_pixels}")
        self.condition_pixels = condition_pixels
        super().__init__(transformer, vae, scheduler, text_encoder, tokenizer, processor, **kwargs)
        self.components = QwenImageEditPlusComponents(
            transformer, vae, scheduler, text_encoder, tokenizer, processor
        )

    @classmethod
    def load_components(
        cls, name_or_path: str | Path, *, dtype: torch.dtype, load_t5: bool = True, **options: Any
    ) -> QwenImageEditPlusComponents:
        """`load_qwen_image_edit_plus_components` (``load_t5`` is ignored)."""
        return load_qwen_image_edit_plus_components(name_or_path, dtype=dtype)

    def encode_prompts(self, prompts: list[str], images: list[Any]) -> tuple[Tensor, Tensor]:
        """(Float[N, L, D], Long[N, L]) fp32 on the policy's device: `encode_edit_plus_prompt` of each prompt with its
        pictures (`images`: a list of PIL images per prompt, at their condition size), `ENCODE_BATCH` per VLM call
        (padded to the batch's longest)."""
        parts = []
        for s in range(0, len(prompts), ENCODE_BATCH):
            parts.append(
                self.components.encode_edit_plus_prompt(
                    prompts[s : s + ENCODE_BATCH],
                    images[s : s + ENCODE_BATCH],
                    self.device,
                    max_sequence_length=self.max_sequence_length,
                )
            )
        length = max(e.shape[1] for e, _ in parts)
        embeds = [torch.nn.functional.pad(e.float(), (0, 0, 0, length - e.shape[1])) for e, _ in parts]
        masks = [torch.nn.functional.pad(m, (0, length - m.shape[1])) for _, m in parts]
        return torch.cat(embeds), torch.cat(masks)

    def row_conditioning(self, columns: dict[str, list[Any]], group: Tensor) -> dict[str, Tensor]:
        """{key of ``row_conditioning_keys``: [B, ...]}: each sample's instruction (column ``prompt``) read with its
        pictures, the negative prompt with the same pictures under true CFG, and the sources' latents
        ``image_latents`` [B, n, z, h, w] (see the module docstring)."""
        who = "QwenImageEditPlusPolicy"
        sources = source_lists(columns, self.image_column, who)
        prompts = columns.get("prompt")
        if prompts is None or len(prompts) != len(sources):
            raise DataError(f"{who}: the rows have no 'prompt' column (the instruction)")
        index: dict[Any, int] = {}
        images: list[Any] = []
        for s in sources:
            for v in s:
                key = v if isinstance(v, str) else id(v)
                if key not in index:
                    index[key] = len(images)
                    images.append(v)
        combos = [tuple(index[v if isinstance(v, str) else id(v)] for v in s) for s in sources]
        side = self.pixel_size()
        from mmalign.data.media import load_rgb

        try:
            loaded = [load_rgb(im) for im in images]  # each distinct file read once
        except OSError as e:
            raise DataError(f"{who}: column {self.image_column!r}: {e}") from e
        conds = [condition_image(im, self.condition_pixels) for im in loaded]
        vaes = [source_image(im, side) for im in loaded]
        pairs = list(dict.fromkeys(zip((str(p) for p in prompts), combos, strict=True)))
        pair_of = {pair: j for j, pair in enumerate(pairs)}
        embeds, mask = self.encode_prompts([p for p, _ in pairs], [[conds[k] for k in c] for _, c in pairs])
        rows = torch.tensor([pair_of[(str(p), c)] for p, c in zip(prompts, combos, strict=True)])
        out = {"prompt_embeds": embeds[rows.to(embeds.device)], "prompt_mask": mask[rows.to(mask.device)]}
        if "negative_prompt_embeds" in self.row_conditioning_keys:
            distinct = list(dict.fromkeys(combos))
            neg, neg_mask = self.encode_prompts(
                [self.negative_prompt] * len(distinct), [[conds[k] for k in c] for c in distinct]
            )
            which = torch.tensor([distinct.index(c) for c in combos])
            out["negative_prompt_embeds"] = neg[which.to(neg.device)]
            out["negative_prompt_mask"] = neg_mask[which.to(neg.device)]
        z = self.encode_source(torch.stack([source_pixels(p) for p in vaes]))
        out["image_latents"] = z[torch.tensor(combos).to(z.device)]
        return out

    def velocity(
        self, model: torch.nn.Module, latents: Tensor, sched: dict[str, Tensor], cond: dict[str, Tensor]
    ) -> Tensor:
        """`qwen_image_edit_plus_velocity` with the row's prompt states and its sources' latents."""
        n_train = int(self.scheduler.config.num_train_timesteps)
        return qwen_image_edit_plus_velocity(
            model,
            latents,
            sched["sigmas"],
            cond["prompt_embeds"],
            cond["prompt_mask"],
            n_train,
            cond["image_latents"],
        )
