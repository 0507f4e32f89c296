"""What the Wan video pipelines share (`video_edit`, `video_geometry`, `euphonium`, `image_to_video`): the video
options of the ``options:`` section (`WanVideoOptions`) and building the `mmalign.policies.wan.WanPolicy` (or the
subclass of a condition) they describe (`build_wan_policy`). Not a pipeline itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from mmalign.algorithms.names import needs_reference
from mmalign.config import Config
from mmalign.errors import ConfigError
from mmalign.policies.denoising import FLOW_SDE_KINDS, SamplerSettings
from mmalign.training.seeding import process_seed

__all__ = ["WanVideoOptions", "build_wan_policy"]


@dataclass
class WanVideoOptions(SamplerSettings):
    """The sampler (`mmalign.policies.denoising.SamplerSettings`) plus the video settings of
    `mmalign.policies.wan.WanPolicy`."""

    num_frames: int = 17
    """Frames of a clip (Wan wants 4k + 1; source clips are subsampled evenly to this many)."""
    height: int = 480
    """Frame height in pixels (Wan 480p: 480). A multiple of the VAE's spatial factor times the transformer's
    patch (16 for Wan2.1)."""
    width: int = 832
    """Frame width in pixels (Wan 480p: 832)."""
    guidance_scale: float = 5.0
    """Classifier-free guidance scale (Wan's default 5.0; 1: no guidance, half the compute)."""
    max_sequence_length: int = 512
    """Tokens of the UMT5 prompt states (Wan: 512)."""
    boundary_ratio: float | None = None
    """Wan2.2 A14B (two experts): the high-noise expert runs while t >= boundary_ratio * 1000 (null: the
    model folder's own value)."""
    train_expert: Literal["high", "low", "both"] = "both"
    """Two-expert models: which expert's weights train (the steps of the other run without a log-prob)."""
    reward_models: dict[str, str] = field(default_factory=dict)
    """Offline runs: reward-model folders to build if missing, path -> tiny builder (e.g. a tiny CLIP)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sde_kind not in FLOW_SDE_KINDS:
            raise ValueError(
                f"sde_kind must be one of {', '.join(FLOW_SDE_KINDS)} (Wan is a flow-matching model); "
                f"got {self.sde_kind!r}"
            )
        if self.num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {self.num_frames}")
        for key in ("height", "width"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")


def build_wan_policy(
    cfg: Config,
    opts: WanVideoOptions,
    policy_class: Any = None,
    *,
    condition: str | None = None,
    **extra: Any,
) -> Any:
    """The video policy described by `cfg.model` and `opts`: `policy_class` (default: the model's video family,
    `mmalign.policies.families.policy_class_for`; `mmalign.policies.wan.WanPolicy` for Wan; with a `condition`
    name, Wan's subclass for it, `mmalign.policies.wan.wan_policy_class`) loaded through ``from_pretrained`` (a
    real folder or hub id, or the tiny folder `mmalign.app.fixtures` built), with ``model.lora`` adapters, the
    reference kept when ``algorithm.kl_coef`` > 0, and `extra` keyword arguments (a pipeline's own settings:
    ``sdedit_strength`` ...). Each process's sampler seed is ``options.seed + RANK``. The tiny folders of
    ``model.tiny_builder`` and ``options.reward_models`` are built by the app layer."""
    path = cfg.model.name_or_path
    if condition is not None and policy_class is not None:
        raise TypeError("build_wan_policy: give policy_class or condition, not both")
    if policy_class is None:  # the model's video family (`mmalign.policies.families`; Wan by default)
        from mmalign.policies.families import policy_class_for

        policy_class = policy_class_for(path, "video")
        if condition is None and getattr(policy_class, "image_column", None):
            raise ConfigError(
                f"{cfg.source}: key 'model.name_or_path': {path} is an image-to-video model "
                f"({policy_class.__name__}: every clip starts from a row's {policy_class.image_column!r}); the "
                f"{cfg.pipeline} pipeline generates from text: train it with the image_to_video pipeline"
            )
    seed = process_seed(opts.seed)
    try:
        if condition is not None:
            policy_class = _conditioned(policy_class, condition, path)
        return policy_class.from_pretrained(
            path,
            dtype=cfg.model.dtype,
            lora=cfg.model.lora,
            sampler=opts.sampler_settings(seed=seed),
            num_frames=opts.num_frames,
            max_sequence_length=opts.max_sequence_length,
            train_expert=opts.train_expert,
            need_reference=needs_reference(cfg),
            height=opts.height,
            width=opts.width,
            **({} if opts.boundary_ratio is None else {"boundary_ratio": opts.boundary_ratio}),
            **extra,
        )
    except ValueError as e:  # the policy's checks name the option; say which file holds it
        raise ValueError(f"{cfg.source}: options: {e}") from e


def _conditioned(family_class: type, condition: str, path: str) -> type:
    """Wan's policy class for `condition` (`mmalign.policies.wan.wan_policy_class`; an unknown name is a
    ValueError); a ValueError for a model of another video family, which has no conditions."""
    from mmalign.policies.wan import WanPolicy, wan_policy_class

    cls = wan_policy_class(condition)
    if not issubclass(family_class, WanPolicy):
        raise ValueError(
            f"condition {condition!r} needs a Wan model; model.name_or_path {path} loads as "
            f"{family_class.__name__}, which has no conditions"
        )
    return cls
