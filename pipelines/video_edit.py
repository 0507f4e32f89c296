"""Edit-GRPO (VIVA): instruction-based video editing with a Wan video flow policy and video rewards.

Each row holds a source clip and an instruction ("make the square red"); the policy
(`mmalign.policies.wan.WanPolicy`) samples ``rollout.group_size`` edits of the source with the Flow-GRPO SDE
(one action = one stochastic denoising step of the video latents [B, C, F, h, w]); the rewards score the
decoded edits -- VIVA's three are ``instruction_faithfulness`` (R_IF), ``source_preservation`` (R_SP) and
``video_preference`` (R_PS), with weights; ``algorithm.estimator: gdpo`` normalises each reward within its
group before the weighted sum (GDPO), so a reward with a large spread does not drown the others -- and the
shared `GroupTrainer` updates the transformer (usually its LoRA adapter).

How the edit sees its source (``options.condition``; see docs/video.md):

- ``vace``: Wan VACE checkpoints (Wan2.1-VACE-1.3B / 14B): the control tensor of the source with the edit
  region masked out, the mask itself, and optional reference frames (``reference_frames`` column).
- ``sdedit``: every Wan checkpoint: the source latents noised to ``options.sdedit_strength`` and
  denoised from there (only those steps are actions). The baseline.
- ``concat``: models trained for it (VIVA's scheme; the tiny config): the source latents concatenated to
  the noisy latents on the channel axis at every step.

Data (``data.train``, ``data.eval``): JSONL rows::

    {"prompt": "make the square red", "source_video": "clips/000", "edit_mask": "masks/000",
     "source_caption": "a blue square", "target_caption": "a red square", "target_video": "targets/000"}

``source_video`` (required) and ``edit_mask`` / ``target_video`` / ``reference_frames`` (optional) are
paths relative to the JSONL's folder (or ``options.video_root``): a folder of PNG frames, an ``.mp4`` or an
``.npy`` (`mmalign.video`). ``prompt`` is the instruction (or ``data.prompt_template`` formats it from the
columns). The captions are what R_IF compares (t_edit = ``target_caption``, t_src = ``source_caption``).
A missing file or column is a `DataError` naming file:line (or the row is skipped and counted with
``options.on_bad_row: skip``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mmalign.config import Config
from mmalign.data import DataError, load_rows
from mmalign.policies.denoising import FLOW_SDE_KINDS, SamplerSettings
from mmalign.tiny import ensure_model
from pipelines import Components, register_pipeline
from rewards import RewardSet

log = logging.getLogger(__name__)

PATH_COLUMNS = ("source_video", "edit_mask", "target_video", "reference_frames")
"""Row columns holding paths (resolved against the JSONL's folder or ``options.video_root``)."""
CONDITIONS = ("concat", "sdedit", "vace")


@dataclass
class VideoEditOptions(SamplerSettings):
    """The ``options:`` section: the sampler (`mmalign.policies.denoising.SamplerSettings`) plus the video
    and editing settings of `mmalign.policies.wan.WanPolicy`."""

    condition: Literal["concat", "sdedit", "vace"] = "sdedit"
    """How the edit sees the source clip: ``vace`` (VACE checkpoints), ``sdedit`` (any Wan checkpoint) or
    ``concat`` (models trained with the source latents concatenated on channels)."""
    sdedit_strength: float = 0.7
    """``sdedit``: the sigma s the source latents are noised to, x = (1 - s) z_src + s eps; the schedule's
    sigmas below s are then run (1: pure noise, plain text to video)."""
    num_frames: int = 17
    """Frames of a clip (Wan wants 4k + 1); sources are subsampled evenly to this many."""
    height: int = 480
    """Frame height in pixels (Wan 480p: 480); sources are resized to it. A multiple of the VAE's spatial
    factor times the transformer's patch (16 for Wan2.1)."""
    width: int = 832
    """Frame width in pixels (Wan 480p: 832)."""
    guidance_scale: float = 5.0
    """Classifier-free guidance scale (Wan's default 5.0; 1: no guidance, half the compute)."""
    max_sequence_length: int = 512
    """Tokens of the UMT5 prompt states (Wan: 512)."""
    boundary_ratio: float | None = None
    """Wan2.2 A14B (two experts): the high-noise expert runs while t >= boundary_ratio * 1000 (null: the
    model folder's own value)."""
    train_expert: Literal["high", "low", "both"] = "both"
    """Two-expert models: which expert's weights train (the steps of the other run without a log-prob)."""
    video_root: str | None = None
    """Folder that relative paths are resolved against (default: the JSONL file's folder)."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A malformed row or missing file: stop with an error naming file:line, or skip it (counted, logged)."""
    reward_models: dict[str, str] = field(default_factory=dict)
    """Offline runs: reward-model folders to build if missing, path -> tiny builder (e.g. a tiny CLIP)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sde_kind not in FLOW_SDE_KINDS:
            raise ValueError(
                f"sde_kind must be one of {', '.join(FLOW_SDE_KINDS)} (Wan is a flow-matching model); "
                f"got {self.sde_kind!r}"
            )
        if self.condition not in CONDITIONS:
            raise ValueError(f"condition must be one of {', '.join(CONDITIONS)}; got {self.condition!r}")
        if not 0 < self.sdedit_strength <= 1:
            raise ValueError(f"sdedit_strength must be in (0, 1], got {self.sdedit_strength}")
        if self.num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {self.num_frames}")
        for key in ("height", "width"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")


def video_edit_options(cfg: Config) -> VideoEditOptions:
    """The typed `options:` section (`config_from_dict` validates it against `VideoEditOptions`)."""
    if isinstance(cfg.options, VideoEditOptions):
        return cfg.options
    if cfg.options is None:
        return VideoEditOptions()
    raise TypeError(f"{cfg.source}: options were not validated as VideoEditOptions (config built by hand?)")


# ----------------------------------------------------------------------------- data


def resolve_edit_row(row: dict[str, Any], root: Path) -> dict[str, Any]:
    """`row` with its path columns (`PATH_COLUMNS`) resolved against `root` and checked to exist; a
    `DataError` names the row's file:line and the column."""
    where = row.get("_source", "?")
    if not row.get("source_video"):
        raise DataError(f"{where}: the row has no 'source_video' column (the clip to edit)")
    out = dict(row)
    for key in PATH_COLUMNS:
        value = row.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise DataError(f"{where}: column {key!r} must be a path, got {str(value)[:80]!r}")
        full = Path(value) if Path(value).is_absolute() else root / value
        if not full.exists():
            raise DataError(f"{where}: column {key!r}: no such file or folder: {full}")
        out[key] = str(full)
    return out


def load_edit_rows(
    source: str, template: str, opts: VideoEditOptions, max_rows: int | None = None
) -> list[dict[str, Any]]:
    """Rows of `source` with resolved paths; bad rows raise or are skipped per ``opts.on_bad_row``."""
    from pipelines.vlm_reasoning import _load_skipping

    if opts.video_root:
        root = Path(opts.video_root)
    else:
        root = Path.cwd() if source.startswith("hf:") else Path(source).resolve().parent
    try:
        rows = load_rows(source, template, max_rows)
    except DataError:
        if opts.on_bad_row == "error" or source.startswith("hf:"):
            raise
        rows = _load_skipping(source, template, max_rows)
    out, skipped = [], int(getattr(rows, "skipped", 0))
    for row in rows:
        try:
            out.append(resolve_edit_row(row, root))
        except DataError as e:
            if opts.on_bad_row == "error":
                raise
            skipped += 1
            log.warning("skipping a bad row: %s", e)
    if skipped:
        log.warning(
            "%s: skipped %d bad row(s) of %d (options.on_bad_row: skip)", source, skipped, len(out) + skipped
        )
    if not out:
        raise DataError(f"{source}: no usable rows")
    return out


# ----------------------------------------------------------------------------- policy


def build_video_policy(cfg: Config) -> Any:
    """The `mmalign.policies.wan.WanPolicy` described by `cfg.model` and the `options:` section: loaded
    through ``from_pretrained`` (a real Wan folder or hub id, or the tiny folder the ``model.tiny_builder``
    writes), with ``model.lora`` adapters and the reference kept when ``algorithm.kl_coef`` > 0."""
    import os

    from mmalign.policies.wan import WanPolicy

    opts = video_edit_options(cfg)
    path = ensure_model(cfg.model.name_or_path, cfg.model.tiny_builder)
    seed = None if opts.seed is None else opts.seed + int(os.environ.get("RANK", "0"))
    try:
        return WanPolicy.from_pretrained(
            path,
            dtype=cfg.model.dtype,
            lora=cfg.model.lora,
            sampler=opts.sampler_settings(seed=seed),
            condition=opts.condition,
            sdedit_strength=opts.sdedit_strength,
            num_frames=opts.num_frames,
            max_sequence_length=opts.max_sequence_length,
            train_expert=opts.train_expert,
            need_reference=cfg.algorithm.kl_coef > 0,
            height=opts.height,
            width=opts.width,
            **({} if opts.boundary_ratio is None else {"boundary_ratio": opts.boundary_ratio}),
        )
    except ValueError as e:  # the policy's checks name the option; say which file holds it
        raise ValueError(f"{cfg.source}: options: {e}") from e


@register_pipeline("video_edit", options=VideoEditOptions)
def build(cfg: Config) -> Any:
    """Edit-GRPO (VIVA): a Wan video flow policy editing source clips, scored by video rewards."""
    opts = video_edit_options(cfg)
    rows = load_edit_rows(cfg.data.train, cfg.data.prompt_template, opts, cfg.data.max_rows)
    eval_rows = load_edit_rows(cfg.data.eval, cfg.data.prompt_template, opts) if cfg.data.eval else None
    for path, builder in opts.reward_models.items():
        ensure_model(path, builder)
    rewards = RewardSet(cfg.rewards, source=cfg.source)
    policy = build_video_policy(cfg)
    return Components(
        policy=policy,
        rewards=rewards,
        data=rows,
        eval_data=eval_rows,
        sample_columns=["source_video", "source_caption", "target_caption"],
    )
