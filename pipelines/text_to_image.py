"""Text to image: a flow-matching model (SD3 / SD3.5 style) trained with Flow-GRPO on image rewards.

Each prompt is sampled ``rollout.group_size`` times with the stochastic Flow-GRPO sampler of
`mmalign.policies.flow.FlowPolicy` (one action = one SDE denoising step), the decoded images are
scored by the rewards of the config (``clip_score``, ``preference``, ``aesthetic``,
``shapes_compositional``, ...), and the shared `GroupTrainer` turns group-relative advantages into a
clipped-surrogate update of the transformer (usually its LoRA adapter), with an optional KL to the
reference model on the step means (``algorithm.kl_coef`` > 0).

Data (``data.train``; ``data.eval`` likewise, kept as evaluation rows):

- a ``.txt`` file: one prompt per line (blank lines and lines starting with ``#`` are skipped);
- a JSONL file (or ``hf:<dataset>[:<split>]``): one object per line with a ``prompt`` column, or the
  columns that ``data.prompt_template`` formats into the prompt. Every other column reaches the
  rewards, e.g. ``{"prompt": "two red squares on the left", "colour": "red", "count": 2,
  "position": "left"}`` for ``shapes_compositional``. A malformed line, a row without a prompt or an
  empty prompt is a `DataError` naming file:line.

The sampler is configured in the typed ``options:`` section (`FlowOptions`).

FLUX.1 (dev / schnell) is served by `mmalign.policies.flux.FluxPolicy` instead: `build_flow_policy`
picks it when the model folder's ``transformer/config.json`` names ``FluxTransformer2DModel``, or, for a
name that is not a local folder (a hub id; nothing is fetched to decide), when the name contains "flux"
(case-insensitive). The same options are passed, with these differences for Flux: ``guidance_scale`` is
the distilled guidance fed to FLUX.1-dev's guidance embedding (one forward, no two-branch CFG; ignored by
schnell, which has no guidance embedding), so ``train_guidance`` has no effect; ``load_t5`` is ignored
(Flux's prompt states are T5's, it is always loaded); ``max_sequence_length`` is the T5 length (default
512, as diffusers; FLUX.1-schnell was trained with 256);
``resolution`` must give an even latent side (resolution / the VAE's factor; 2x2 packing).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from mmalign.config import Config, register_options
from mmalign.data import DataError, load_rows
from mmalign.policies.flow import FlowPolicy
from mmalign.tiny import ensure_model
from pipelines import Components, register_pipeline
from rewards import RewardSet


@dataclass
class FlowOptions:
    num_steps: int = 10
    """Denoising steps per sample (the scheduler's shifted sigmas from 1 to 0); Flow-GRPO trains with 10."""
    noise_level: float = 0.7
    """Flow-GRPO SDE noise level a (sigma_t = a * sqrt(sigma / (1 - sigma))): how far samples of one prompt
    spread. Higher explores more; too high degrades the images."""
    guidance_scale: float = 4.5
    """Classifier-free guidance scale, the same in sampling and in the log-probs (1: no guidance, half the
    compute; a model needs unconditional training for > 1 to help). SD3.5 / Flow-GRPO use 4.5."""
    same_initial_noise: bool = False
    """Start every sample of a group from the same initial noise (only the SDE noise then differs)."""
    train_fraction: float = 1.0
    """Share of the denoising steps trained per sample (a random subset each; the others still sample
    stochastically). Ignored when `window_size` is set."""
    window_size: int | None = None
    """Train only a window of this many consecutive SDE steps (deterministic ODE steps outside it;
    Flow-GRPO-Fast). null: no window."""
    window_range: list[int] | None = None
    """[lo, hi]: the window's first step is drawn uniformly from lo..hi each rollout (default: anywhere)."""
    window_mode: str = "random"
    """How the window moves: ``random`` (a fresh start per rollout, Flow-GRPO-Fast) or ``sliding`` (MixGRPO:
    starts at ``window_range[0]`` and moves `window_stride` steps later every `window_shift_every` training
    steps, wrapping around; see `mmalign.schedules.SlidingWindow`)."""
    window_shift_every: int = 25
    """Sliding window: training steps between moves."""
    window_stride: int = 1
    """Sliding window: denoising steps per move."""
    sde_kind: str = "flow_sde"
    """The stochastic step (`mmalign.sde`): ``flow_sde`` (Flow-GRPO), ``cps`` (coefficients-preserving,
    noise_level in (0, 1]) or ``dance`` (DanceGRPO, noise_level is its eta). Zero-std steps run as ODE."""
    cps_log_prob: str = "squared_error"
    """How a ``cps`` step is scored: ``squared_error`` (Flow-GRPO: log p = -mean((x' - mu)^2), no 1/(2 sigma_t^2)
    factor, so ratios stay well-scaled on the tiny-noise last steps) or ``gaussian`` (the full Gaussian
    log-density; the clip range then means something else). Only used with ``sde_kind: cps``."""
    train_guidance: bool = True
    """Apply CFG in the training forward too (false: train the conditional branch only, half the compute;
    the log-probs of a CFG rollout are then off-policy, so keep ratios near 1 with small clip ranges)."""
    max_sequence_length: int | None = None
    """Tokens of the T5 encoder's prompt states (CLIP encoders always use 77); null: the policy's default,
    256 for SD3/SD3.5 (as diffusers) and 512 for Flux (as diffusers; FLUX.1-schnell was trained with 256)."""
    load_t5: bool = True
    """Load an SD3 folder's T5 encoder (false: skip it, its prompt states become zeros; saves ~9 GB)."""
    resolution: int | None = None
    """Image side in pixels (latents are resolution / the VAE's downsampling factor); null: the
    transformer's own ``sample_size``. Must be a multiple of the factor times the patch size."""
    seed: int | None = None
    """null (default): the initial and SDE noise come from torch's global RNG, which the trainer seeds
    from the top-level ``seed`` (offset per process) and saves in checkpoints, so a run is reproducible
    and resumes exactly. An int: a private generator for the sampler (reproducible independently of any
    other random draw; every process gets seed + its rank, and its state is saved in checkpoints too)."""

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if not self.noise_level > 0:
            raise ValueError(
                f"noise_level must be > 0 (the SDE needs noise for log-probs), got {self.noise_level}"
            )
        if not self.guidance_scale >= 1:
            raise ValueError(f"guidance_scale must be >= 1 (1: no guidance), got {self.guidance_scale}")
        if not 0 < self.train_fraction <= 1:
            raise ValueError(f"train_fraction must be in (0, 1], got {self.train_fraction}")
        if self.window_size is not None and not 1 <= self.window_size <= self.num_steps:
            raise ValueError(
                f"window_size must be in [1, num_steps={self.num_steps}], got {self.window_size}"
            )
        if self.window_range is not None:
            if self.window_size is None:
                raise ValueError("window_range needs window_size")
            if len(self.window_range) != 2 or not 0 <= self.window_range[0] <= self.window_range[1]:
                raise ValueError(f"window_range must be [lo, hi] with 0 <= lo <= hi, got {self.window_range}")
            if self.window_range[0] > self.num_steps - self.window_size:
                raise ValueError(
                    f"window_range starts at {self.window_range[0]}, but a window of {self.window_size} steps "
                    f"must start by step {self.num_steps - self.window_size}"
                )
        from mmalign.policies.flow import SDE_KINDS, WINDOW_MODES

        if self.sde_kind not in SDE_KINDS:
            raise ValueError(f"sde_kind must be one of {', '.join(SDE_KINDS)}; got {self.sde_kind!r}")
        from mmalign.policies.flow import CPS_LOG_PROBS

        if self.cps_log_prob not in CPS_LOG_PROBS:
            raise ValueError(
                f"cps_log_prob must be one of {', '.join(CPS_LOG_PROBS)}; got {self.cps_log_prob!r}"
            )
        if self.sde_kind == "cps" and self.noise_level > 1:
            raise ValueError(f"noise_level must be in (0, 1] for sde_kind cps, got {self.noise_level}")
        if self.window_mode not in WINDOW_MODES:
            raise ValueError(
                f"window_mode must be one of {', '.join(WINDOW_MODES)}; got {self.window_mode!r}"
            )
        if self.window_mode == "sliding" and self.window_size is None:
            raise ValueError("window_mode sliding needs window_size")
        if self.window_shift_every < 1 or self.window_stride < 1:
            raise ValueError(
                f"window_shift_every and window_stride must be >= 1, got {self.window_shift_every}, {self.window_stride}"
            )
        if self.max_sequence_length is not None and self.max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {self.max_sequence_length}")
        if self.resolution is not None and self.resolution < 1:
            raise ValueError(f"resolution must be >= 1 or null, got {self.resolution}")


register_options("text_to_image", FlowOptions)


def flow_options(cfg: Config) -> FlowOptions:
    """The typed `options:` section (`config_from_dict` validates it against `FlowOptions`)."""
    if isinstance(cfg.options, FlowOptions):
        return cfg.options
    if cfg.options is None:
        return FlowOptions()
    raise TypeError(f"{cfg.source}: options were not validated as FlowOptions (config built by hand?)")


# ----------------------------------------------------------------------------- data


def load_prompts(
    source: str, template: str = "{question}", max_rows: int | None = None
) -> list[dict[str, Any]]:
    """Prompt rows of a ``.txt`` file (one prompt per line; blank and ``#`` lines skipped) or JSONL /
    ``hf:`` rows (a ``prompt`` column, or `template` formatted from the row's columns), read by
    `mmalign.data.load_rows`. Every row must end up with a non-empty string ``prompt``, else a DataError
    names the row (file:line)."""
    rows = load_rows(source, template, max_rows)
    for row in rows:
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataError(
                f"{row.get('_source', source)}: the prompt must be a non-empty string, got {prompt!r}"
            )
    return rows


# ----------------------------------------------------------------------------- policy


def build_flow_policy(cfg: Config) -> FlowPolicy:
    """The `FlowPolicy` described by `cfg.model` and the `options:` section (`FlowOptions`): a `FluxPolicy`
    for a FLUX.1 model (see the module docstring for how it is detected and which options it ignores)."""
    from mmalign.policies.flux import FluxPolicy, flow_policy_class

    opts = flow_options(cfg)
    path = ensure_model(cfg.model.name_or_path, cfg.model.tiny_builder)
    seed = None if opts.seed is None else opts.seed + int(os.environ.get("RANK", "0"))
    policy = flow_policy_class(path).from_pretrained(
        path,
        dtype=cfg.model.dtype,
        lora=cfg.model.lora,
        num_steps=opts.num_steps,
        noise_level=opts.noise_level,
        guidance_scale=opts.guidance_scale,
        same_initial_noise=opts.same_initial_noise,
        train_fraction=opts.train_fraction,
        window_size=opts.window_size,
        window_range=tuple(opts.window_range) if opts.window_range is not None else None,
        window_mode=opts.window_mode,
        window_shift_every=opts.window_shift_every,
        window_stride=opts.window_stride,
        sde_kind=opts.sde_kind,
        cps_log_prob=opts.cps_log_prob,
        train_guidance=opts.train_guidance,
        **({} if opts.max_sequence_length is None else {"max_sequence_length": opts.max_sequence_length}),
        load_t5=opts.load_t5,
        seed=seed,
        need_reference=cfg.algorithm.kl_coef > 0,
    )
    if opts.resolution is not None:
        policy.latent_size = latent_size_for(policy, opts.resolution, cfg.source)
        if isinstance(policy, FluxPolicy) and policy.latent_size % 2:
            raise ValueError(
                f"{cfg.source}: key 'options.resolution' ({opts.resolution}) gives {policy.latent_size} latents, "
                "but Flux packs 2x2 latent patches: the latent side must be even"
            )
    return policy


def latent_size_for(policy: FlowPolicy, resolution: int, source: str = "<config>") -> int:
    """Latent side for an image of `resolution` pixels: resolution / the VAE's downsampling factor, which
    must also be a multiple of the transformer's patch size."""
    factor = 2 ** (len(policy.vae.config.block_out_channels) - 1)
    patch = int(getattr(policy.model.config, "patch_size", 1) or 1)
    if resolution % (factor * patch):
        raise ValueError(
            f"{source}: key 'options.resolution' ({resolution}) must be a multiple of {factor * patch} "
            f"(the VAE downsamples by {factor}, the transformer's patches are {patch} latents wide)"
        )
    return resolution // factor


@register_pipeline("text_to_image")
def build(cfg: Config) -> Any:
    """Flow-matching text-to-image model (SD3 style) + image rewards on prompt files (.txt or JSONL)."""
    rows = load_prompts(cfg.data.train, cfg.data.prompt_template, cfg.data.max_rows)
    eval_rows = load_prompts(cfg.data.eval, cfg.data.prompt_template) if cfg.data.eval else None
    rewards = RewardSet(cfg.rewards, source=cfg.source)
    policy = build_flow_policy(cfg)
    return Components(policy=policy, rewards=rewards, data=rows, eval_data=eval_rows)
