"""Edit-GRPO (VIVA): instruction-based video editing with a Wan video flow policy and video rewards.

Each row holds a source clip and an instruction; a `mmalign.policies.wan.WanPolicy` samples
``rollout.group_size`` edits with the Flow-GRPO SDE (one action = one stochastic denoising step), the rewards
score the decoded edits (VIVA's ``instruction_faithfulness``, ``source_preservation``, ``video_preference``;
``algorithm.estimator: gdpo`` normalises each within its group) and `GroupTrainer` updates the transformer.
``options.condition`` (``vace``, ``sdedit``, ``concat``) says how the edit sees its source. Data: JSONL rows
with ``prompt``, ``source_video`` and optional ``edit_mask`` / ``target_video`` / ``reference_frames`` paths and
captions; a bad row is a `DataError` naming file:line. Details: docs/video.md, "Edit-GRPO" and "Conditioning
on a source video".
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
    """The `mmalign.policies.wan.WanPolicy` subclass of ``options.condition`` (``WanConcatPolicy``,
    ``WanSDEditPolicy``, ``WanVACEPolicy``) described by `cfg.model` and the `options:` section
    (`pipelines.video.wan.build_wan_policy` with the editing settings)."""
    opts = video_edit_options(cfg)
    # the strength is an option of the sdedit condition only (`mmalign.policies.wan.WanSDEditPolicy`)
    extra = {"sdedit_strength": opts.sdedit_strength} if opts.condition == "sdedit" else {}
    return build_wan_policy(cfg, opts, condition=opts.condition, **extra)


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
