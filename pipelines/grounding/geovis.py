"""GeoViS: remote-sensing visual grounding by visual search, on the VLM policy.

GeoViS (geospatial visual search) localises small targets described by spatial relations ("the small red
building left of the lake") in large remote-sensing images, which a vision-language model sees only at a
reduced resolution. It searches the image by zooming. The paper's search runs at inference time; this
pipeline offers it and a search policy trained with GRPO, chosen by ``options.search``:

``zoom`` (default; train and evaluate)
    A multi-turn rollout (``rollout.loop: multi_turn``) in which each generated turn either requests a crop
    of the original image or of an earlier view (``<crop>[x1,y1,x2,y2]</crop>``, ``<crop view=K>...``) or
    answers with the final box (``<answer>[x1,y1,x2,y2]</answer>``), both in the coordinates of the view
    as the model sees it (``options.coords``). The environment (`pipelines.grounding.geovis_env.ZoomEnvironment`)
    records the tree of views, maps the answer to original pixels (``env_state["answer_box"]``), refuses
    tiny or extreme-aspect crops and inserts each accepted crop as a new image. With
    ``rollout.loop: single_turn`` the same pipeline answers in one shot (the box is then parsed from the
    text in ``options.coords``): the baseline. This trained variant is our design, following the public
    "thinking with images" recipes (DeepEyes and others); the paper itself does not train the search.
``tree`` (evaluation only)
    The paper's inference-time tree search (`pipelines.grounding.geovis_search`): UCT selection over views, actions
    zoom into one cell of a 3x3 grid or zoom out, ``options.simulations`` (10) simulations of depth at most
    ``options.max_depth`` (5), node value 0.1 r_QA + 0.9 r_IoU from the model's own yes/no answers and
    from its own box in the crop against a central box; the final box is predicted on the full image with
    the best crop as a second image (``options.final: full_image``), or in the best crop alone and mapped
    to the full image (``best_crop``, our choice for small models). Training with it is refused.

Data: grounding JSONL rows (`pipelines.grounding.data`): ``image``, ``expression``, ``boxes``, ``coords``, and
optionally ``object`` / ``relation`` / ``landmark`` columns, which the tree search's yes/no checks use.
Public remote-sensing grounding sets (DIOR-RSVG, RSVG, GeoChat's referring data, ...) come in their own
formats: convert them to these rows (``mmalign grounding check`` validates a file).

Rewards (`rewards.boxes`, `rewards.search`): the final IoU and ``box_center`` (the geospatial term
exp(-d_centre / diagonal)) read ``env_state["answer_box"]`` (``box_key: answer_box``); ``crop_keeps_target``
is a per-turn process reward (with the ``grpo_process`` estimator); ``search_format``, ``tool_use_bonus``;
``turns_used`` for evaluation. ``rollout.loop_kwargs.mask_over_turn`` removes samples stopped at the turn
cap from the loss (they still count in their group's statistics).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

from mmalign.config import Config
from pipelines import TrainingSetup, register_pipeline
from pipelines.common import build_vlm_policy, options
from pipelines.grounding.data import GroundingOptions, load_grounding_rows
from pipelines.grounding.geovis_env import ZoomEnvironment
from pipelines.grounding.geovis_search import SearchConfig, TreeSearchPolicy
from pipelines.grounding.geovis_views import processor_pixel_bounds
from rewards import RewardSet

log = logging.getLogger(__name__)


@dataclass
class GeoViSOptions(GroundingOptions):
    search: Literal["zoom", "tree"] = "zoom"
    """``zoom``: the VLM policy with the crop environment (trained with GRPO; ``rollout.loop: single_turn``
    answers in one shot); ``tree``: the paper's inference-time tree search (``mmalign eval`` only)."""
    min_crop_px: float = 8.0
    """Smallest accepted crop side, in original pixels (smaller crops are refused with a message)."""
    max_aspect: float = 4.0
    """Largest accepted long/short side ratio of a crop."""
    max_views: int = 8
    """Views per sample, the full image included (later crops are refused)."""
    simulations: int = 10
    """Tree search: simulations per image."""
    max_depth: int = 5
    """Tree search: deepest zoom level."""
    uct_c: float = math.sqrt(2.0)
    """Tree search: UCT exploration constant (our design where the paper is silent)."""
    final: Literal["full_image", "best_crop"] = "full_image"
    """Tree search: predict the final box on the full image with the best crop as a second image (the
    paper), or in the best crop alone, mapped to the full image (our choice for small models)."""
    search_temperature: float = 0.0
    """Tree search: 0 searches deterministically (the G samples of a row are copies); > 0 samples."""


def geovis_options(cfg: Config) -> GeoViSOptions:
    return options(cfg, GeoViSOptions)


def build_zoom_environment(opts: GeoViSOptions) -> ZoomEnvironment:
    """The crop environment of the zoom policy; its pixel bounds are set from the policy's processor once
    the policy is built (`sync_pixel_bounds`)."""
    return ZoomEnvironment(
        convention=opts.convention,
        min_crop_px=opts.min_crop_px,
        max_aspect=opts.max_aspect,
        max_views=opts.max_views,
    )


def sync_pixel_bounds(env: ZoomEnvironment, processor: Any) -> None:
    """Give the environment the processor's resize bounds, so that the view sizes it records are the sizes
    the model sees (the coordinates its boxes are written in)."""
    env.min_pixels, env.max_pixels, env.factor = processor_pixel_bounds(processor)


@register_pipeline("geovis", options=GeoViSOptions)
def build(cfg: Config) -> Any:
    """GeoViS remote-sensing grounding: a VLM zooming through crops (GRPO) or the inference-time tree search."""
    opts = geovis_options(cfg)
    rows = load_grounding_rows(cfg.data.train, cfg.data.prompt_template, opts, cfg.data.max_rows)
    eval_rows = load_grounding_rows(cfg.data.eval, cfg.data.prompt_template, opts) if cfg.data.eval else None
    rewards = RewardSet(cfg.rewards, source=cfg.source)
    env = build_zoom_environment(opts)
    policy: Any = build_vlm_policy(cfg, environment=env)
    sync_pixel_bounds(env, policy.processor)
    if opts.search == "tree":  # (the trainer's call of TreeSearchPolicy.setup refuses training with it)
        policy = TreeSearchPolicy(
            policy,
            convention=opts.convention,
            config=SearchConfig(
                simulations=opts.simulations,
                max_depth=opts.max_depth,
                c=opts.uct_c,
                final=opts.final,
                min_crop_px=opts.min_crop_px,
                max_aspect=opts.max_aspect,
            ),
            temperature=opts.search_temperature,
            max_new_tokens=cfg.rollout.max_new_tokens,
        )
    return TrainingSetup(
        policy=policy,
        rewards=rewards,
        data=rows,
        eval_data=eval_rows,
        sample_columns=["boxes", "images", "image_width", "image_height"],
    )
