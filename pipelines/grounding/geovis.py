"""GeoViS: remote-sensing visual grounding by visual search, on the VLM policy.

``options.search`` picks the search: ``zoom`` (default; trained with GRPO, our design) is a multi-turn rollout
whose turns request crops (``<crop>[...]</crop>``, ``<crop view=K>...``) or answer
(``<answer>[...]</answer>``), driven by `pipelines.grounding.geovis_env.ZoomEnvironment`, which writes
``env_state["answer_box"]`` in original pixels; ``tree`` (evaluation only) is the paper's inference-time UCT
search (`pipelines.grounding.geovis_search`). ``rollout.loop: single_turn`` is the one-shot baseline.
`GeoViSPolicy` shows the prompt's image at the root pixel bounds, crops at the crop bounds
(`pipelines.grounding.geovis_views`). Data, rewards, options and bounds: docs/grounding.md, "GeoViS visual
search".
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
