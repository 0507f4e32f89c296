"""Image to video: a Wan image-to-video model (``WanImageToVideoPipeline``) trained with Flow-GRPO on video rewards.

Each row holds a first frame and a prompt ("the red square moves right"); the policy
(`mmalign.policies.wan.WanPolicy` with ``condition: i2v``) samples ``rollout.group_size`` clips that start from
that frame with the Flow-GRPO SDE (one action = one stochastic denoising step of the video latents
[B, C, F, h, w]); the first-frame latents and mask (and, for Wan2.1 I2V, the CLIP image states) condition every
step, as in the diffusers pipeline. The rewards score the decoded clips, e.g. first-frame consistency
(``video_psnr`` with ``source_column: image``, ``frames: [0]``, ``region: all``), fidelity to a reference clip
when the data has one (``video_psnr`` / ``video_ssim`` with ``source_column: target_video``), motion smoothness
(``temporal_consistency``, ``flicker``) or prompt alignment (``video_preference``).

Data (``data.train``, ``data.eval``): JSONL rows::

    {"prompt": "the red square moves right", "image": "frames/000.png", "target_video": "clips/000.npz"}

``image`` (required) is the first frame: an image file (``.png``, ``.jpg`` ...) or anything
`mmalign.data.media.read_video` reads (a ``.npy`` / ``.npz``, a video file or a frame folder), whose first frame is
used; it is resized to ``options.height`` x ``options.width``. The rewards read ``image`` / ``target_video``
with `mmalign.data.media.read_video`, so a reward on the first frame needs a format it reads (the tiny data uses
one-frame ``.npz`` files). Paths are relative to the JSONL's folder (or ``options.video_root``); a missing file
or column is a `DataError` naming file:line (or the row is skipped and counted with ``options.on_bad_row:
skip``). Every other column reaches the rewards.

Models: Wan2.1 I2V (``Wan-AI/Wan2.1-I2V-14B-480P-Diffusers``: CLIP image encoder, one expert; the transformer
then needs ``max_sequence_length: 512``) and Wan2.2 I2V A14B (``Wan-AI/Wan2.2-I2V-A14B-Diffusers``: two
experts, no image encoder; ``train_expert`` chooses). Wan2.2 TI2V-5B's first-frame replacement is not
supported. ``mmalign sample`` / ``mmalign eval`` sample deterministically with the folder's UniPC scheduler
(``options.eval_noise_level: 0``), as the diffusers pipeline does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mmalign.config import Config
from pipelines import TrainingSetup, register_pipeline
from pipelines.common import load_resolved_rows, options, resolve_path_columns
from pipelines.video.wan import WanVideoOptions, build_wan_policy
from rewards import RewardSet

__all__ = ["PATH_COLUMNS", "ImageToVideoOptions", "build", "load_i2v_rows", "resolve_i2v_row"]

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


@register_pipeline("image_to_video", options=ImageToVideoOptions)
def build(cfg: Config) -> Any:
    """Image to video: a Wan I2V flow policy starting clips from each row's image, scored by video rewards."""
    opts = options(cfg, ImageToVideoOptions)
    rows = load_i2v_rows(cfg.data.train, cfg.data.prompt_template, opts, cfg.data.max_rows)
    eval_rows = load_i2v_rows(cfg.data.eval, cfg.data.prompt_template, opts) if cfg.data.eval else None
    rewards = RewardSet(cfg.rewards, source=cfg.source)
    policy = build_wan_policy(cfg, opts, condition="i2v")
    return TrainingSetup(
        policy=policy, rewards=rewards, data=rows, eval_data=eval_rows, sample_columns=["image"]
    )
