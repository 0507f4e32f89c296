"""Text to image: a flow-matching model (SD3 / SD3.5, FLUX.1, Qwen-Image) trained with Flow-GRPO on image rewards.

Each prompt is sampled ``rollout.group_size`` times with the stochastic sampler of the family's
`mmalign.policies.flow_matching.FlowMatchingPolicy` (one action = one SDE denoising step; the family picks
the class, `mmalign.policies.families`), the decoded images are scored by the config's rewards and the
shared `GroupTrainer` updates the transformer (usually its LoRA adapter). Data: a ``.txt`` file (one prompt
per line) or JSONL / ``hf:`` rows with a ``prompt`` column; bad rows are a `DataError` naming file:line.
Options: `FlowOptions` (the `mmalign.policies.denoising.SamplerSettings` keys plus loading). Data format and
the per-family meaning of ``guidance_scale``, ``max_sequence_length``, ``load_t5`` and ``resolution``:
docs/architecture.md, "Pipelines", ``text_to_image``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmalign.algorithms.names import needs_reference
from mmalign.config import Config
from mmalign.policies.denoising import FLOW_SDE_KINDS, SamplerSettings
from mmalign.policies.families import policy_class_for
from mmalign.policies.flow_matching import FlowMatchingPolicy
from mmalign.training.seeding import process_seed
from pipelines import TrainingSetup, register_pipeline
from pipelines.common import load_prompts, options
from rewards import RewardSet


@dataclass
class FlowOptions(SamplerSettings):
    """The ``options:`` section: the sampler (`mmalign.policies.denoising.SamplerSettings`: ``num_steps``,
    ``noise_level``, ``sde_kind``, ``cps_log_prob``, ``train_fraction``, the window keys, ``train_guidance``,
    ``seed`` ...; validated there) plus what loading the model needs."""

    guidance_scale: float = 4.5
    """Classifier-free guidance scale, the same in sampling and in the log-probs (1: no guidance, half the
    compute; a model needs unconditional training for > 1 to help). SD3.5 / Flow-GRPO use 4.5."""
    max_sequence_length: int | None = None
    """Tokens of the T5 encoder's prompt states (CLIP encoders always use 77); null: the policy's default,
    256 for SD3/SD3.5 (as diffusers) and 512 for Flux (as diffusers; FLUX.1-schnell was trained with 256)."""
    load_t5: bool = True
    """Load an SD3 folder's T5 encoder (false: skip it, its prompt states become zeros; saves ~9 GB)."""
    resolution: int | None = None
    """Image side in pixels (latents are resolution / the VAE's downsampling factor); null: the
    transformer's own ``sample_size``. Must be a multiple of the factor times the patch size."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sde_kind not in FLOW_SDE_KINDS:
            raise ValueError(
                f"sde_kind must be one of {', '.join(FLOW_SDE_KINDS)} (text_to_image trains flow-matching "
                f"models); got {self.sde_kind!r}"
            )
        if self.max_sequence_length is not None and self.max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {self.max_sequence_length}")
        if self.resolution is not None and self.resolution < 1:
            raise ValueError(f"resolution must be >= 1 or null, got {self.resolution}")


def flow_options(cfg: Config) -> FlowOptions:
    """The typed `options:` section (`config_from_dict` validates it against `FlowOptions`)."""
    return options(cfg, FlowOptions)


# ----------------------------------------------------------------------------- data


# ----------------------------------------------------------------------------- policy


def build_flow_policy(cfg: Config) -> FlowMatchingPolicy:
    """The `SD3Policy` described by `cfg.model` and the `options:` section (`FlowOptions`): a `FluxPolicy`
    for a FLUX.1 model, a `QwenImagePolicy` for Qwen-Image (see the module docstring for how they are detected
    and which options they ignore)."""
    from mmalign.policies.flux import FluxPolicy

    opts = flow_options(cfg)
    path = cfg.model.name_or_path
    seed = process_seed(opts.seed)
    policy = flow_policy_for(path).from_pretrained(
        path,
        dtype=cfg.model.dtype,
        lora=cfg.model.lora,
        sampler=opts.sampler_settings(seed=seed),
        **({} if opts.max_sequence_length is None else {"max_sequence_length": opts.max_sequence_length}),
        load_t5=opts.load_t5,
        need_reference=needs_reference(cfg),
    )
    if opts.resolution is not None:
        policy.latent_size = latent_size_for(policy, opts.resolution, cfg.source)
        if isinstance(policy, FluxPolicy) and policy.latent_size % 2:
            raise ValueError(
                f"{cfg.source}: key 'options.resolution' ({opts.resolution}) gives {policy.latent_size} latents, "
                "but Flux packs 2x2 latent patches: the latent side must be even"
            )
    return policy


def flow_policy_for(path: str | Path) -> type[FlowMatchingPolicy]:
    """The policy class of the model at `path` for text to image: its family in
    `mmalign.policies.families` (a model of another task, e.g. an editing model, is a `ConfigError`)."""
    return policy_class_for(path, "text_to_image")


def vae_factor(vae: torch.nn.Module) -> int:
    """Pixels per latent along a side: ``2 ** len(temperal_downsample)`` for the Wan-style VAEs (Qwen-Image),
    else ``2 ** (len(block_out_channels) - 1)`` (``AutoencoderKL``)."""
    cfg = vae.config
    if getattr(cfg, "temperal_downsample", None) is not None:
        return 2 ** len(cfg.temperal_downsample)
    return 2 ** (len(cfg.block_out_channels) - 1)


def latent_size_for(policy: FlowMatchingPolicy, resolution: int, source: str = "<config>") -> int:
    """Latent side for an image of `resolution` pixels: resolution / the VAE's downsampling factor
    (`vae_factor`), which must also be a multiple of the transformer's patch size."""
    factor = vae_factor(policy.vae)
    patch = int(getattr(policy.model.config, "patch_size", 1) or 1)
    if resolution % (factor * patch):
        raise ValueError(
            f"{source}: key 'options.resolution' ({resolution}) must be a multiple of {factor * patch} "
            f"(the VAE downsamples by {factor}, the transformer's patches are {patch} latents wide)"
        )
    return resolution // factor


@register_pipeline("text_to_image", options=FlowOptions)
def build(cfg: Config) -> Any:
    """Flow-matching text-to-image model (SD3, FLUX.1 or Qwen-Image) + image rewards on prompt files (.txt or JSONL)."""
    rows = load_prompts(cfg.data.train, cfg.data.prompt_template, cfg.data.max_rows)
    eval_rows = load_prompts(cfg.data.eval, cfg.data.prompt_template) if cfg.data.eval else None
    rewards = RewardSet(cfg.rewards, source=cfg.source)
    policy = build_flow_policy(cfg)
    return TrainingSetup(policy=policy, rewards=rewards, data=rows, eval_data=eval_rows)
