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
``.npy`` (`mmalign.data.media`). ``prompt`` is the instruction (or ``data.prompt_template`` formats it from the
columns). The captions are what R_IF compares (t_edit = ``target_caption``, t_src = ``source_caption``).
A missing file or column is a `DataError` naming file:line (or the row is skipped and counted with
``options.on_bad_row: skip``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mmalign.config import Config
from pipelines import TrainingSetup, register_pipeline
from pipelines.common import load_resolved_rows, options, resolve_path_columns
from pipelines.video.wan import WanVideoOptions, build_wan_policy
from rewards import RewardSet

log = logging.getLogger(__name__)

PATH_COLUMNS = ("source_video", "edit_mask", "target_video", "reference_frames")
"""Row columns holding paths (resolved against the JSONL's folder or ``options.video_root``)."""
CONDITIONS = ("concat", "sdedit", "vace")


@dataclass
class VideoEditOptions(WanVideoOptions):
    """The ``options:`` section: the sampler and video settings (`pipelines.video.wan.WanVideoOptions`) plus
    how the edit sees its source."""

    condition: Literal["concat", "sdedit", "vace"] = "sdedit"
    """How the edit sees the source clip: ``vace`` (VACE checkpoints), ``sdedit`` (any Wan checkpoint) or
    ``concat`` (models trained with the source latents concatenated on channels)."""
    sdedit_strength: float = 0.7
    """``sdedit``: the sigma s the source latents are noised to, x = (1 - s) z_src + s eps; the schedule's
    sigmas below s are then run (1: pure noise, plain text to video)."""
    video_root: str | None = None
    """Folder that relative paths are resolved against (default: the JSONL file's folder)."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A malformed row or missing file: stop with an error naming file:line, or skip it (counted, logged)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.condition not in CONDITIONS:
            raise ValueError(f"condition must be one of {', '.join(CONDITIONS)}; got {self.condition!r}")
        if not 0 < self.sdedit_strength <= 1:
            raise ValueError(f"sdedit_strength must be in (0, 1], got {self.sdedit_strength}")


def video_edit_options(cfg: Config) -> VideoEditOptions:
    """The typed `options:` section (`config_from_dict` validates it against `VideoEditOptions`)."""
    return options(cfg, VideoEditOptions)


# ----------------------------------------------------------------------------- data


def resolve_edit_row(row: dict[str, Any], root: Path) -> dict[str, Any]:
    """`row` with its path columns (`PATH_COLUMNS`) resolved against `root` and checked to exist; a
    `DataError` names the row's file:line and the column."""
    return resolve_path_columns(row, root, PATH_COLUMNS, "source_video", "the clip to edit")


def load_edit_rows(
    source: str, template: str, opts: VideoEditOptions, max_rows: int | None = None
) -> list[dict[str, Any]]:
    """Rows of `source` with resolved paths; bad rows raise or are skipped per ``opts.on_bad_row``."""
    return load_resolved_rows(source, template, resolve_edit_row, opts.video_root, opts.on_bad_row, max_rows)


# ----------------------------------------------------------------------------- policy


def build_video_policy(cfg: Config) -> Any:
    """The `mmalign.policies.wan.WanPolicy` described by `cfg.model` and the `options:` section
    (`pipelines.video.wan.build_wan_policy` with the editing settings)."""
    opts = video_edit_options(cfg)
    return build_wan_policy(cfg, opts, condition=opts.condition, sdedit_strength=opts.sdedit_strength)


@register_pipeline("video_edit", options=VideoEditOptions)
def build(cfg: Config) -> Any:
    """Edit-GRPO (VIVA): a Wan video flow policy editing source clips, scored by video rewards."""
    opts = video_edit_options(cfg)
    rows = load_edit_rows(cfg.data.train, cfg.data.prompt_template, opts, cfg.data.max_rows)
    eval_rows = load_edit_rows(cfg.data.eval, cfg.data.prompt_template, opts) if cfg.data.eval else None
    rewards = RewardSet(cfg.rewards, source=cfg.source)
    policy = build_video_policy(cfg)
    return TrainingSetup(
        policy=policy,
        rewards=rewards,
        data=rows,
        eval_data=eval_rows,
        sample_columns=["source_video", "source_caption", "target_caption"],
    )
