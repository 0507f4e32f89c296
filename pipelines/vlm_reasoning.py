"""VLM reasoning: a vision-language model (Qwen2-VL / Qwen2.5-VL) trained with GRPO on verifiable answers.

Data: JSONL rows with ``images`` (a list of image paths, or one path as a string, relative to
``options.image_root``; absolute paths are kept), optionally ``video`` (a list of frame paths),
the columns used by ``data.prompt_template`` (``question`` by default) and the reference answer
read by the accuracy reward (``answer``); every other column reaches the rewards too. A malformed
row or a missing image is a `DataError` naming the file and line, or (``options.on_bad_row: skip``)
a skipped row, counted and logged.
"""

from __future__ import annotations

import logging
from typing import Any

from mmalign.config import Config
from pipelines import TrainingSetup, register_pipeline
from pipelines.common import VLMOptions, build_vlm_policy, load_vlm_rows, vlm_options
from rewards import RewardSet

log = logging.getLogger(__name__)


@register_pipeline("vlm_reasoning", options=VLMOptions)
def build(cfg: Config) -> Any:
    """Vision-language model + verifiable text rewards on JSONL rows with image paths."""
    opts = vlm_options(cfg)
    rows = load_vlm_rows(cfg.data.train, cfg.data.prompt_template, opts, cfg.data.max_rows)
    eval_rows = load_vlm_rows(cfg.data.eval, cfg.data.prompt_template, opts) if cfg.data.eval else None
    rewards = RewardSet(cfg.rewards, source=cfg.source)
    policy = build_vlm_policy(cfg)
    return TrainingSetup(
        policy=policy, rewards=rewards, data=rows, eval_data=eval_rows, sample_columns=["answer", "solution"]
    )
