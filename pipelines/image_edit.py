"""Instruction-based image editing: FLUX.1 Kontext or Qwen-Image-Edit trained with Flow-GRPO on editing rewards.

The policy (`mmalign.policies.flux_kontext.FluxKontextPolicy`, or the Qwen-Image-Edit / -Plus policy
chosen by the model folder) samples ``rollout.group_size`` edits of each row's source; the rewards score
the decoded edits and the shared `GroupTrainer` updates the transformer.

Rows, options and the policies: docs/image_edit.md ("Data and options", the Qwen-Image-Edit sections).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import rewards.edit  # noqa: F401  (registers the editing rewards this pipeline's configs name)
from mmalign.algorithms.names import needs_reference
from mmalign.config import Config
from mmalign.data.rows import DataError
from mmalign.policies.denoising import FLOW_SDE_KINDS, SamplerSettings
from mmalign.policies.families import policy_class_for
from mmalign.policies.flux_kontext import FluxKontextPolicy
from mmalign.policies.qwen_image_edit import QwenImageEditPolicy
from mmalign.training.seeding import process_seed
from pipelines import TrainingSetup, register_pipeline
from pipelines.common import load_resolved_rows, options
from pipelines.text_to_image import latent_size_for
from rewards import RewardSet

PATH_COLUMNS = ("edit_mask", "target_image")
"""Optional row columns holding paths (resolved like the source image column)."""


@dataclass
class ImageEditOptions(SamplerSettings):
    """The ``options:`` section: the sampler (`mmalign.policies.denoising.SamplerSettings`, validated there) plus
    the editing data and the model's input sizes."""

    guidance_scale: float = 2.5
    """FLUX.1 Kontext-dev's distilled guidance (its guidance embedding; one forward per step, no CFG branches),
    the same in sampling and in the log-probs. Its model card uses 2.5. Qwen-Image-Edit: true CFG with
    ``negative_prompt`` read with the source image (two branches; the pipeline's ``true_cfg_scale`` is 4.0)."""
    max_sequence_length: int | None = None
    """Tokens of the T5 encoder's instruction states (Qwen-Image-Edit: of the instruction's states after the
    source's vision tokens); null: 512, as diffusers."""
    resolution: int | None = None
    """Side of the edited image in pixels (the source is resized to it); null: the VAE's ``sample_size`` (FLUX.1
    Kontext), 1024 (Qwen-Image-Edit, the pipeline's default area). Must be a multiple of 2 x the VAE's
    downsampling factor (2x2 latent packing)."""
    image_column: str = "source_image"
    """The row column holding the source image (a path relative to the JSONL's folder or ``image_root``)."""
    image_root: str | None = None
    """Folder that relative paths are resolved against (default: the JSONL file's folder)."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A malformed row or missing file: stop with an error naming file:line, or skip it (counted, logged)."""
    reward_models: dict[str, str] = field(default_factory=dict)
    """Reward-model folders to build first when missing (path -> tiny builder, e.g. the tiny CLIP)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sde_kind not in FLOW_SDE_KINDS:
            raise ValueError(
                f"sde_kind must be one of {', '.join(FLOW_SDE_KINDS)} (image_edit trains flow-matching models); "
                f"got {self.sde_kind!r}"
            )
        if self.max_sequence_length is not None and self.max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {self.max_sequence_length}")
        if self.resolution is not None and self.resolution < 1:
            raise ValueError(f"resolution must be >= 1 or null, got {self.resolution}")
        if not self.image_column:
            raise ValueError("image_column must name the row column holding the source image")


def image_edit_options(cfg: Config) -> ImageEditOptions:
    """The typed `options:` section (`config_from_dict` validates it against `ImageEditOptions`)."""
    return options(cfg, ImageEditOptions)


# ----------------------------------------------------------------------------- data


def edit_row_resolver(image_column: str) -> Any:
    """``resolve(row, root)`` for `load_resolved_rows`: the row with its source image (`image_column`,
    required) and `PATH_COLUMNS` (optional) resolved against `root` and checked to exist; a `DataError` names
    the row's file:line and the column. A source image already in memory (a PIL image) is kept as is. A list in
    `image_column` is several source images (Qwen-Image-Edit-Plus), each resolved and checked as one."""

    def resolve(row: dict[str, Any], root: Path) -> dict[str, Any]:
        where = row.get("_source", "?")
        sources = row.get(image_column)
        if isinstance(sources, list):
            if not sources:
                raise DataError(
                    f"{where}: column {image_column!r} is an empty list (give one or more source images)"
                )
            each = [resolve({**row, image_column: s}, root)[image_column] for s in sources]
            return {**resolve({**row, image_column: sources[0]}, root), image_column: each}
        if row.get(image_column) in (None, ""):
            raise DataError(f"{where}: the row has no {image_column!r} column (the source image to edit)")
        out = dict(row)
        for key in (image_column, *PATH_COLUMNS):
            value = row.get(key)
            if value is None or (key != image_column and value == ""):
                continue
            if not isinstance(value, str):
                if key == image_column and hasattr(value, "convert"):  # a PIL image (Hugging Face datasets)
                    continue
                raise DataError(f"{where}: column {key!r} must be a path, got {str(value)[:80]!r}")
            full = Path(value) if Path(value).is_absolute() else root / value
            if not full.is_file():
                raise DataError(f"{where}: column {key!r}: no such file: {full}")
            out[key] = str(full)
        return out

    return resolve


def load_edit_rows(
    source: str, template: str, opts: ImageEditOptions, max_rows: int | None = None
) -> list[dict[str, Any]]:
    """Rows of `source` with resolved paths; bad rows raise or are skipped per ``opts.on_bad_row``."""
    resolve = edit_row_resolver(opts.image_column)
    return load_resolved_rows(source, template, resolve, opts.image_root, opts.on_bad_row, max_rows)


# ----------------------------------------------------------------------------- policy


def edit_policy_class(name_or_path: str | Path) -> type[FluxKontextPolicy] | type[QwenImageEditPolicy]:
    """The editing policy class of the model at `name_or_path`: its ``image_edit`` family in
    `mmalign.policies.families` (FLUX.1 Kontext by default, Qwen-Image-Edit by pipeline class or hub id)."""
    return policy_class_for(name_or_path, "image_edit")


def build_edit_policy(cfg: Config) -> FluxKontextPolicy | QwenImageEditPolicy:
    """The editing policy described by `cfg.model` (`edit_policy_class`: FLUX.1 Kontext or Qwen-Image-Edit) and
    the `options:` section (`ImageEditOptions`)."""
    opts = image_edit_options(cfg)
    path = cfg.model.name_or_path
    cls = edit_policy_class(path)
    policy = cls.from_pretrained(
        path,
        dtype=cfg.model.dtype,
        lora=cfg.model.lora,
        sampler=opts.sampler_settings(seed=process_seed(opts.seed)),
        image_column=opts.image_column,
        **({} if opts.max_sequence_length is None else {"max_sequence_length": opts.max_sequence_length}),
        need_reference=needs_reference(cfg),
    )
    if opts.resolution is not None:
        size = latent_size_for(policy, opts.resolution, cfg.source)
        if size % 2:
            raise ValueError(
                f"{cfg.source}: key 'options.resolution' ({opts.resolution}) gives {size} latents, but FLUX.1 "
                "packs 2x2 latent patches: the latent side must be even"
            )
        policy.latent_size = size
    return policy


@register_pipeline("image_edit", options=ImageEditOptions)
def build(cfg: Config) -> Any:
    """Instruction-based image editing: FLUX.1 Kontext or Qwen-Image-Edit (by the folder) on (source image,
    instruction) rows + editing rewards."""
    opts = image_edit_options(cfg)
    rows = load_edit_rows(cfg.data.train, cfg.data.prompt_template, opts, cfg.data.max_rows)
    eval_rows = load_edit_rows(cfg.data.eval, cfg.data.prompt_template, opts) if cfg.data.eval else None
    reward_set = RewardSet(cfg.rewards, source=cfg.source)
    policy = build_edit_policy(cfg)
    return TrainingSetup(
        policy=policy,
        rewards=reward_set,
        data=rows,
        eval_data=eval_rows,
        sample_columns=edit_sample_columns(rows, opts.image_column),
    )


def edit_sample_columns(rows: list[dict[str, Any]], image_column: str) -> list[str]:
    """The columns written beside each training sample: the source image's path (only when every row holds a
    path: an in-memory PIL image from a Hugging Face dataset cannot go into the JSONL) and the two captions."""
    paths = all(isinstance(r.get(image_column), str) for r in rows)
    return [*([image_column] if paths else []), "source_caption", "target_caption"]
