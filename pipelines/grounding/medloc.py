"""MedLoc: medical visual grounding (lesion localisation) with GRPO and MedLoc-R1's IoU-threshold curriculum.

The VLM policy answers a referring expression about a medical image with a box, trained on the 1/0 hit
reward ``iou_at`` (IoU >= tau); with ``options.curriculum`` (default on) a
`pipelines.grounding.curriculum.CurriculumCallback` raises tau between steps from the gathered ``iou_at`` /
``box_iou`` columns (``options.curriculum_kwargs``: the `IoUThresholdCurriculum` options). Curriculum off
gives the fixed-tau baseline; ``box_iou`` as the weighted reward the raw-IoU one. Data: grounding JSONL rows
(`pipelines.grounding.data.load_grounding_rows`). The wiring, the data format, public sources and what is
our design: docs/grounding.md, "Data", "MedLoc-R1's IoU curriculum" and "The `medloc` pipeline".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from mmalign.config import Config
from pipelines import TrainingSetup, register_pipeline
from pipelines.common import build_vlm_policy, options
from pipelines.grounding.curriculum import CurriculumCallback, IoUThresholdCurriculum
from pipelines.grounding.data import GroundingOptions, load_grounding_rows
from rewards import RewardSet

log = logging.getLogger(__name__)


@dataclass
class MedLocOptions(GroundingOptions):
    """The ``options:`` section of the medloc pipeline: `GroundingOptions` plus the IoU curriculum."""

    curriculum: bool = True
    """Raise the hit reward's IoU threshold as the policy masters it (MedLoc-R1); false: the threshold of
    the hit reward's config stays (fixed-tau baseline)."""
    curriculum_kwargs: dict[str, Any] = field(default_factory=dict)
    """Options of `pipelines.grounding.curriculum.IoUThresholdCurriculum` (``start`` 0.3, ``max_threshold`` 0.8,
    ``window`` 30 groups, ``step_mode``, ``margin``, ``keep_after_raise``, ``step_back``, ...)."""
    hit_reward: str = "iou_at"
    """The reward column (name or alias in ``rewards:``) whose ``threshold`` the curriculum sets; it must
    score 1/0."""
    iou_reward: str = "box_iou"
    """The reward column holding the plain IoU (the curriculum's mean-IoU gate); weight 0 keeps it out of
    the training reward."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.curriculum, bool):
            raise ValueError(f"curriculum must be true or false, got {self.curriculum!r}")
        if not isinstance(self.curriculum_kwargs, dict):
            raise ValueError(
                f"curriculum_kwargs must be a mapping of IoUThresholdCurriculum options, got {self.curriculum_kwargs!r}"
            )
        for key in ("hit_reward", "iou_reward"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ValueError(f"{key} must be a reward column name, got {getattr(self, key)!r}")


def medloc_options(cfg: Config) -> MedLocOptions:
    """The typed ``options:`` section (`config_from_dict` validates it against `MedLocOptions`)."""
    return options(cfg, MedLocOptions)


def build_curriculum(cfg: Config, opts: MedLocOptions, rewards: RewardSet) -> CurriculumCallback:
    """The curriculum callback of ``options``; a bad option or reward column is a ValueError naming the
    config file and the ``options.`` key."""
    try:
        curriculum = IoUThresholdCurriculum(**opts.curriculum_kwargs)
    except TypeError as e:  # an unknown option
        raise ValueError(f"{cfg.source}: options.curriculum_kwargs: {e}") from None
    except ValueError as e:
        raise ValueError(f"{cfg.source}: options.curriculum_kwargs: {e}") from None
    try:
        return CurriculumCallback(curriculum, rewards, hit_reward=opts.hit_reward, iou_reward=opts.iou_reward)
    except ValueError as e:
        raise ValueError(f"{cfg.source}: options: {e}") from None


@register_pipeline("medloc", options=MedLocOptions)
def build(cfg: Config) -> Any:
    """Medical grounding (MedLoc-R1): a VLM answers boxes, GRPO on a hit reward whose IoU threshold rises."""
    opts = medloc_options(cfg)
    rows = load_grounding_rows(cfg.data.train, cfg.data.prompt_template, opts, cfg.data.max_rows)
    eval_rows = load_grounding_rows(cfg.data.eval, cfg.data.prompt_template, opts) if cfg.data.eval else None
    rewards = RewardSet(cfg.rewards, source=cfg.source)
    callbacks = [build_curriculum(cfg, opts, rewards)] if opts.curriculum else []
    policy = build_vlm_policy(cfg)
    return TrainingSetup(
        policy=policy,
        rewards=rewards,
        data=rows,
        eval_data=eval_rows,
        callbacks=callbacks,
        sample_columns=["boxes", "images", "image_width", "image_height"],
    )
