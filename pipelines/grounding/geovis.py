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

Pixel bounds per view (our design, following DeepEyes / Mini-o3 / GeoViS, which show a crop at up to the
model's full pixel budget): view 0, the whole image, is shown within ``options.root_min_pixels`` /
``root_max_pixels`` (keep it coarse: one-shot answering should not see a small target) and every crop within
``options.crop_min_pixels`` / ``crop_max_pixels`` (a crop is resized UP to them: zooming is the gain in
resolution). Each defaults to ``options.min_pixels`` / ``max_pixels`` (one set of bounds, the processor's
own when those are unset too). `GeoViSPolicy` shows the prompt's image at the root bounds, the environment
inserts each crop at the crop bounds (`geovis_views.view_image`), the processor's bounds hold both.

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

import torch

from mmalign.config import Config, ConfigError
from mmalign.data.media import load_rgb
from mmalign.policies.vlm import VLMPolicy
from pipelines import TrainingSetup, register_pipeline
from pipelines.common import options, policy_kwargs
from pipelines.grounding.data import GroundingOptions, load_grounding_rows
from pipelines.grounding.geovis_env import ZoomEnvironment
from pipelines.grounding.geovis_search import SearchConfig, TreeSearchPolicy
from pipelines.grounding.geovis_views import PRESIZED, ViewPixels, processor_pixel_bounds, view_image
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
    root_min_pixels: int | None = None
    """Smallest size (pixels) view 0, the whole image, is shown at (None: ``min_pixels``)."""
    root_max_pixels: int | None = None
    """Largest size (pixels) view 0 is shown at (None: ``max_pixels``); keep it low enough that a target is
    too small to answer without zooming."""
    crop_min_pixels: int | None = None
    """Smallest size (pixels) a crop is shown at (None: ``min_pixels``): a smaller crop is resized up to it,
    so zooming gains resolution."""
    crop_max_pixels: int | None = None
    """Largest size (pixels) a crop is shown at (None: ``max_pixels``); ``crop_max_pixels / 28^2`` is the
    image tokens of one inserted crop."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in PIXEL_KEYS:
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"options.{key} must be an integer >= 1 (a pixel count) or null, got {value!r}"
                )
        for kind in ("root", "crop"):
            lo, hi = self.view_bounds(kind)
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(
                    f"options.{kind}_min_pixels ({lo}) must be <= options.{kind}_max_pixels ({hi})"
                    " (a bound left null takes min_pixels / max_pixels)"
                )

    def view_bounds(self, kind: Literal["root", "crop"]) -> tuple[int | None, int | None]:
        """(min, max) pixels of view 0 (``root``) or of a crop, falling back to ``min_pixels`` /
        ``max_pixels``; None where those are unset too (the processor's own)."""
        lo, hi = getattr(self, f"{kind}_min_pixels"), getattr(self, f"{kind}_max_pixels")
        return (self.min_pixels if lo is None else lo), (self.max_pixels if hi is None else hi)


PIXEL_KEYS = ("root_min_pixels", "root_max_pixels", "crop_min_pixels", "crop_max_pixels")


def geovis_options(cfg: Config) -> GeoViSOptions:
    return options(cfg, GeoViSOptions)


def view_pixels(opts: GeoViSOptions, processor: Any) -> ViewPixels:
    """The pixel bounds of view 0 and of the crops (`GeoViSOptions.view_bounds`, a bound left unset being the
    processor's own); ValueError naming the option when they are inconsistent."""
    lo, hi, factor = processor_pixel_bounds(processor)
    (rlo, rhi), (clo, chi) = opts.view_bounds("root"), opts.view_bounds("crop")
    return ViewPixels(
        root=(lo if rlo is None else rlo, hi if rhi is None else rhi),
        crop=(lo if clo is None else clo, hi if chi is None else chi),
        factor=factor,
    )


class GeoViSPolicy(VLMPolicy):
    """The VLM policy with a pixel budget per view (`ViewPixels`): the prompt's image (view 0, the whole map)
    is resized to the ROOT bounds before the processor sees it, while the processor's own bounds are set to
    hold both kinds of view (`ViewPixels.processor`), so that the crops the environment inserts at the CROP
    bounds (`geovis_views.view_image`) reach the model unchanged. The ``image_width`` / ``image_height``
    columns stay the ORIGINAL image's size and ``resized_*`` the size the model saw, as box rewards expect.
    A row with ``PRESIZED`` set (the tree search's views) is encoded as it is. ``view_pixels=None`` takes
    the processor's bounds for every view."""

    def __init__(
        self, model: torch.nn.Module, processor: Any, *, view_pixels: ViewPixels | None = None, **kwargs: Any
    ) -> None:
        if kwargs.get("min_pixels") is not None or kwargs.get("max_pixels") is not None:
            raise ValueError(
                "GeoViSPolicy sets the processor's bounds from view_pixels; pass no min_pixels / max_pixels"
            )
        self.view_pixels = view_pixels or ViewPixels.same(*processor_pixel_bounds(processor))
        lo, hi = self.view_pixels.processor
        super().__init__(model, processor, min_pixels=lo, max_pixels=hi, **kwargs)

    def root_images(self, row: dict[str, Any]) -> tuple[list[Any], list[Any]]:
        """(the row's images as loaded, the same as the model sees them): each is view 0 of itself, resized
        to the root bounds; a ``PRESIZED`` row's images are kept as they are."""
        value = row.get("images", row.get("image"))
        images = [
            load_rgb(x) for x in (value if isinstance(value, list | tuple) else [value]) if x is not None
        ]
        if row.get(PRESIZED):
            return images, images
        return images, [view_image(im, self.view_pixels.root_view(im.size)) for im in images]

    def encode_row(self, row: dict[str, Any]) -> dict[str, Any]:
        """`VLMPolicy.encode_row` of the row with its images shown at the root bounds (`root_images`);
        ``image_sizes`` are the original sizes."""
        originals, shown = self.root_images(row)
        enc = super().encode_row({**row, "images": shown})
        enc["image_sizes"] = [(im.width, im.height) for im in originals]
        return enc

    def engine_prompt(self, row: dict[str, Any]) -> Any:
        """`VLMPolicy.engine_prompt` with the images the model sees (`root_images`), so that a rollout
        engine processing them under the same bounds shows the model what this policy scores."""
        return super().engine_prompt({**row, "images": self.root_images(row)[1]})


def build_geovis_policy(cfg: Config, opts: GeoViSOptions, environment: ZoomEnvironment) -> GeoViSPolicy:
    """The `GeoViSPolicy` of `cfg` (as `pipelines.common.build_vlm_policy` builds a `VLMPolicy`), with the
    per-view pixel bounds of `opts`; the environment is given the same bounds."""
    kwargs = policy_kwargs(cfg, environment)  # checks the rollout loop before the model is loaded
    path = cfg.model.name_or_path
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    try:
        pixels = view_pixels(opts, processor)
    except ValueError as e:
        raise ConfigError(
            f"{cfg.source}: options: {e} (resolved from the options and the processor)"
        ) from None
    check_insert_budget(cfg, pixels)
    environment.set_pixels(pixels.root[0], pixels.root[1], pixels.crop[0], pixels.crop[1], pixels.factor)
    return GeoViSPolicy.from_pretrained(
        path,
        view_pixels=pixels,
        freeze_vision=opts.freeze_vision,
        shared_prefix=cfg.model.shared_prefix,
        **kwargs,
    )


def check_insert_budget(cfg: Config, pixels: ViewPixels) -> None:
    """A crop at ``crop_max_pixels`` must fit in one insertion of the multi-turn loop (else every accepted
    crop would end the episode): ConfigError naming both keys."""
    if cfg.rollout.loop != "multi_turn":
        return
    budget = int((cfg.rollout.loop_kwargs or {}).get("max_insert_tokens", 512))
    need = pixels.crop_tokens() + 16  # the image's tokens + "View k:" and the chat markup
    if budget < need:
        raise ConfigError(
            f"{cfg.source}: key 'rollout.loop_kwargs.max_insert_tokens' ({budget}) is below the tokens of one "
            f"crop at options.crop_max_pixels ({pixels.crop[1]} px = {pixels.crop_tokens()} image tokens, "
            f"+ 16 for its text): raise it to >= {need} or lower crop_max_pixels"
        )


@register_pipeline("geovis", options=GeoViSOptions)
def build(cfg: Config) -> Any:
    """GeoViS remote-sensing grounding: a VLM zooming through crops (GRPO) or the inference-time tree search."""
    opts = geovis_options(cfg)
    rows = load_grounding_rows(cfg.data.train, cfg.data.prompt_template, opts, cfg.data.max_rows)
    eval_rows = load_grounding_rows(cfg.data.eval, cfg.data.prompt_template, opts) if cfg.data.eval else None
    rewards = RewardSet(cfg.rewards, source=cfg.source)
    env = ZoomEnvironment(
        convention=opts.convention,
        min_crop_px=opts.min_crop_px,
        max_aspect=opts.max_aspect,
        max_views=opts.max_views,
    )
    policy: Any = build_geovis_policy(cfg, opts, env)
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
