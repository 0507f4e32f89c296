"""Image to video: a Wan image-to-video model (``WanImageToVideoPipeline``) or a HunyuanVideo 1.5 one
(``HunyuanVideo15ImageToVideoPipeline``) trained with Flow-GRPO on video rewards.

Each row holds a first frame and a prompt; the model folder's video family (`mmalign.policies.families`) picks
the policy: `mmalign.policies.wan.WanImageToVideoPolicy` (the ``i2v`` condition) for Wan,
`mmalign.policies.hunyuan_video15.HunyuanVideo15ImageToVideoPolicy` for HunyuanVideo 1.5. It samples
``rollout.group_size`` clips that start from that frame (one action = one stochastic denoising step), the
first-frame latents and mask (and the image encoder's states: Wan2.1 I2V's CLIP, HunyuanVideo 1.5's SigLIP)
conditioning every step as in the diffusers pipeline; the video rewards score the decoded clips (first-frame consistency,
fidelity to a ``target_video``, smoothness, prompt alignment). Data: JSONL rows
``{"prompt", "image", "target_video"?, ...}``; a bad row is a `DataError` naming file:line. Models, formats and
the deterministic UniPC evaluation: docs/video.md, "Image to video"; the conditioning formula:
docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mmalign.config import Config
from mmalign.errors import ConfigError
from mmalign.policies.families import policy_class_for
from pipelines import TrainingSetup, register_pipeline
from pipelines.common import load_resolved_rows, options, resolve_path_columns
from pipelines.video.wan import WanVideoOptions, build_wan_policy
from rewards import RewardSet

__all__ = [
    "PATH_COLUMNS",
    "ImageToVideoOptions",
    "build",
    "build_i2v_policy",
    "load_i2v_rows",
    "resolve_i2v_row",
]

PATH_COLUMNS = ("image", "target_video")
"""Row columns holding paths (resolved against the JSONL's folder or ``options.video_root``)."""


@dataclass
class ImageToVideoOptions(WanVideoOptions):
    """The ``options:`` section: the sampler and video settings (`pipelines.video.wan.WanVideoOptions`) plus
    where the rows' files are and what a bad row does."""

    video_root: str | None = None
    """Folder that relative paths are resolved against (default: the JSONL file's folder)."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A malformed row or missing file: stop with an error naming file:line, or skip it (counted, logged)."""


def resolve_i2v_row(row: dict[str, Any], root: Path) -> dict[str, Any]:
    """`row` with its path columns (`PATH_COLUMNS`) resolved against `root` and checked to exist; a `DataError`
    names the row's file:line and the column."""
    return resolve_path_columns(row, root, PATH_COLUMNS, "image", "the first frame of the clip")


def load_i2v_rows(
    source: str, template: str, opts: ImageToVideoOptions, max_rows: int | None = None
) -> list[dict[str, Any]]:
    """Rows of `source` with resolved paths; bad rows raise or are skipped per ``opts.on_bad_row``."""
    return load_resolved_rows(source, template, resolve_i2v_row, opts.video_root, opts.on_bad_row, max_rows)


def build_i2v_policy(cfg: Config, opts: ImageToVideoOptions) -> Any:
    """The image-to-video policy of ``model.name_or_path``: its video family's class when that is an
    image-to-video policy (one with an ``image_column``: HunyuanVideo 1.5 I2V), else Wan's ``i2v`` condition
    (`build_wan_policy`; a text-to-video model of another family is a `ConfigError`)."""
    from mmalign.policies.wan import WanPolicy

    path = cfg.model.name_or_path
    family_class = policy_class_for(path, "video")
    if getattr(family_class, "image_column", None):
        return build_wan_policy(cfg, opts, family_class)
    if not issubclass(family_class, WanPolicy):
        raise ConfigError(
            f"{cfg.source}: key 'model.name_or_path': {path} loads as {family_class.__name__}, a text-to-video "
            "policy; image_to_video needs an image-to-video model (WanImageToVideoPipeline or "
            "HunyuanVideo15ImageToVideoPipeline in its model_index.json)"
        )
    return build_wan_policy(cfg, opts, condition="i2v")


@register_pipeline("image_to_video", options=ImageToVideoOptions)
def build(cfg: Config) -> Any:
    """Image to video: the model's I2V flow policy (`build_i2v_policy`) starting clips from each row's image,
    scored by video rewards."""
    opts = options(cfg, ImageToVideoOptions)
    rows = load_i2v_rows(cfg.data.train, cfg.data.prompt_template, opts, cfg.data.max_rows)
    eval_rows = load_i2v_rows(cfg.data.eval, cfg.data.prompt_template, opts) if cfg.data.eval else None
    rewards = RewardSet(cfg.rewards, source=cfg.source)
    policy = build_i2v_policy(cfg, opts)
    return TrainingSetup(
        policy=policy, rewards=rewards, data=rows, eval_data=eval_rows, sample_columns=["image"]
    )
