"""MedLoc: medical visual grounding (lesion localisation) with GRPO and MedLoc-R1's IoU-threshold curriculum.

MedLoc-R1 trains a vision-language model to answer a referring expression about a medical image ("the
nodule in the left upper lobe") with a bounding box, by GRPO on a 1/0 "hit" reward (IoU with the reference
>= tau). A fixed high tau gives almost no signal early on (no sample of a group hits, every advantage is 0)
and a fixed low tau stops rewarding precision later, so tau starts low and is raised once the policy
reliably hits it: the curriculum of `pipelines.grounding.curriculum.IoUThresholdCurriculum` (its rule, gates and
constants are documented there and in docs/grounding.md). This pipeline wires it up:

- the policy is the VLM policy (`pipelines.common.build_vlm_policy`), one image per prompt,
  single-turn (``rollout.loop: single_turn``);
- the rewards come from ``rewards:`` (`rewards.boxes`): the hit reward ``iou_at`` (weight 1: the reward the
  policy is trained on; the curriculum writes its ``threshold``) and ``box_iou`` (weight 0: logged, read by
  the curriculum as the window's mean IoU), plus e.g. ``format``; every box reward takes ``coords``, how the
  model writes its boxes (``qwen2_5_vl`` / ``resized``: pixels of the resized input; ``qwen2_vl``:
  0..1000);
- with ``options.curriculum`` (default on) a `pipelines.grounding.curriculum.CurriculumCallback` holds the curriculum:
  it reads the gathered ``iou_at`` / ``box_iou`` columns every sampling round (``options.hit_reward`` /
  ``options.iou_reward`` name them) and moves tau between training steps; ``options.curriculum_kwargs``
  are the `IoUThresholdCurriculum` options (``start``, ``max_threshold``, ``window``, ``step_mode``,
  ``margin``, ``keep_after_raise``, ``step_back``, ...). With the curriculum off, ``iou_at`` keeps the
  threshold of its config (a fixed-tau baseline); with ``box_iou`` as the weighted reward instead, the
  policy learns from the raw continuous IoU (the other baseline).

Data: grounding JSONL rows (`pipelines.grounding.data.load_grounding_rows`), one object per line::

    {"image": "cxr/00012.png", "expression": "the opacity in the right lower lung",
     "boxes": [[412, 630, 598, 811]], "coords": "absolute", "image_width": 1024, "image_height": 1024,
     "modality": "X-ray", "finding": "opacity"}

``image`` is relative to ``options.image_root`` (default: the JSONL's folder); ``boxes`` are one or more
reference boxes, ``coords`` says how they are written ("absolute" pixels of the original image, "norm1000"
or "norm1"); every other column (modality, finding, ...) reaches the rewards and the sample dumps. Public
medical grounding data comes in other formats and must be converted to these rows first (a short script
per source; ``mmalign grounding check DATA.jsonl`` validates the result). Examples of public sources: chest
X-ray phrase grounding with report phrases and boxes (MS-CXR, built on MIMIC-CXR), the disease boxes of
the NIH ChestX-ray8 / ChestX-ray14 bounding-box subset, lesion boxes on CT slices (DeepLesion), or medical
VQA sets that ship boxes (SLAKE). Their access terms, licences, splits and box formats differ and are not
checked here: read each source's documentation, and write the expression from its labels or phrases.

Our design (the paper does not specify it): the option names and defaults here, the fixed-tau and raw-IoU
baselines as switches of one pipeline, and the synthetic task of the tiny config (`mmalign.tiny.medloc`:
64x64 "scans" with one faint lesion, the model ``medloc`` writes boxes in pixels of its 56x56 input).
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
