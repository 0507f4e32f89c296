"""The shipped tiny SD3 text-to-image model and data as config overrides, for the flow-objective tests
(`test_flow_training_strategy`, `test_flow_objective_training`, `test_flow_dpo_training`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import pipelines
from mmalign.app.run import build_trainer
from mmalign.config import Config, load_config

REPO = Path(__file__).resolve().parents[2]
SMALL = ["rollout.prompts_per_step=2", "rollout.group_size=4", "options.num_steps=4"]
"""A step of two prompts x four images of four denoising steps."""


def t2i_config(base: Path, out: Path, *extra: str) -> Config:
    """Config file `base` on the shipped tiny model and the text_to_image data (absolute paths), writing to
    `out`, with no samples and no progress bar, then `extra` overrides."""
    return load_config(
        base,
        [
            f"model.name_or_path={REPO / 'assets' / 'models' / 'text_to_image-tiny'}",
            f"data.train={REPO / 'assets' / 'text_to_image' / 'train.jsonl'}",
            f"data.eval={REPO / 'assets' / 'text_to_image' / 'eval.jsonl'}",
            f"output_dir={out}",
            "trainer.progress_bar=false",
            "trainer.sample_every=1000",
            *extra,
        ],
    )


def make_trainer(c: Config, resume: bool = False) -> Any:
    """The trainer of `c`, seeded first: the pipeline adds the LoRA adapter (random A) before the trainer seeds
    the process, so two fresh runs in one process start from the same weights."""
    torch.manual_seed(c.seed)
    return build_trainer(c, pipelines.get(c.pipeline)(c), resume=resume)
