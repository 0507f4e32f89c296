"""VGGRPO: world-consistent text-to-video with latent geometry rewards, on a Wan video flow policy.

Each prompt ("a red box and a blue box in a grey room, camera pans left") is sampled ``rollout.group_size``
times by `mmalign.policies.wan.WanPolicy` (text to video, the Flow-GRPO SDE; one action = one stochastic
denoising step of the latents [B, C, F, h, w]). The rewards read the LATENTS only: a latent geometry model
(`rewards.geometry_model.LatentGeometryModel`; the rewards' ``geometry_model`` option) predicts per-frame depth and
camera poses from them, and ``camera_smoothness`` (the camera path's second differences against its first),
``reprojection_consistency`` (static points z-buffered into the other views against their depth) and
``motion_guard`` (min(1, motion degree / min_degree), because the first two are maximised by a still camera)
score that geometry (`rewards.geometry`, docs/video.md). Nothing is decoded to pixels for these rewards; a
config that adds a pixel reward makes the policy decode for it.

Data (``data.train``, ``data.eval``): a ``.txt`` file of prompts or JSONL rows with a ``prompt`` (or the
columns ``data.prompt_template`` formats into one); every other column reaches the rewards and the eval split
(e.g. ``motion`` for the tiny task).

The tiny config (``configs/video_geometry-tiny.yaml``) trains the tiny scene model of
`mmalign.tiny.video_geometry` (rendered rooms with boxes under a moving camera; its ``geometry/`` subfolder is
the tiny latent geometry model trained on the renderer's exact depth and poses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmalign.config import Config
from pipelines import TrainingSetup, register_pipeline
from pipelines.common import load_prompts, options
from pipelines.video.wan import WanVideoOptions, build_wan_policy
from rewards import RewardSet

__all__ = ["VideoGeometryOptions", "build"]


@dataclass
class VideoGeometryOptions(WanVideoOptions):
    """The ``options:`` section: the sampler and video settings (`pipelines.video.wan.WanVideoOptions`)."""


@register_pipeline("video_geometry", options=VideoGeometryOptions)
def build(cfg: Config) -> Any:
    """VGGRPO: a Wan text-to-video policy scored by latent geometry rewards (no decoding)."""
    opts = options(cfg, VideoGeometryOptions)
    rows = load_prompts(cfg.data.train, cfg.data.prompt_template, cfg.data.max_rows)
    eval_rows = load_prompts(cfg.data.eval, cfg.data.prompt_template) if cfg.data.eval else None
    policy = build_wan_policy(cfg, opts)
    rewards = RewardSet(cfg.rewards, source=cfg.source)
    return TrainingSetup(policy=policy, rewards=rewards, data=rows, eval_data=eval_rows)
