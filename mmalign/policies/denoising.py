"""What the diffusion policies share: `SamplerSettings` and `DenoisingPolicy`, the one rollout / re-scoring loop.

Tree: `DenoisingPolicy` -> `mmalign.policies.flow_matching.FlowMatchingPolicy` (-> `SD3Policy`, `FluxPolicy`,
`WanPolicy`) and `mmalign.policies.ddim.DDIMPolicy`. One stochastic denoising step is one action: `rollout`
stores x_t / x_{t+1} and the log-prob of every trained step; `action_stats` / `reference_logprobs` re-score the
stored transitions, so with unchanged weights the ratio is 1 (plus the KL on step means with a reference).

Subclasses override hooks only (each documented on its method; the table is in docs/architecture.md):
``conditioning_keys`` / ``schedule_keys`` / ``row_conditioning_keys`` / ``negative_row_keys`` (row-aware prompt
states: empty ``conditioning_keys``, the prompt keys and the negative branch's from `row_conditioning`),
`encode_conditioning`, `schedule`,
`latent_shape`, `predict`, `step`, `ode_step`, `shift_step_mean`, `row_conditioning`, `initial_latents`,
`num_denoising_steps`, `_num_trainable_steps`, `_trainable_offset`, `rollout_outputs`, `step_loss_weight`.
``columns`` (what the row hooks and rewards see) holds every column any row of the batch has, None where a row
lacks it.

Training follows Flow-GRPO's script: `action_chunks` hands the trainer ``steps_per_backward`` trained steps at a
time (a backward after each chunk, the same gradient as one backward), and the training forward of two-branch
CFG runs the unconditional branch without a graph (``detach_uncond``). ``noise_level`` 0 samples the
deterministic ODE (no actions; `setup` refuses it for training); `evaluation_sampler` is what `mmalign sample` /
`mmalign eval` sample with (``eval_noise_level``, the ODE by default). GRPO-Guard (``guard_ratio_norm``,
``guard_grad_reweight``) scores steps with `mmalign.algorithms.sde.ratio_norm_score` and weights their loss.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from mmalign.algorithms import sde
from mmalign.algorithms.schedules import SlidingWindow
from mmalign.config import ConfigError
from mmalign.data.batch import Rollout, group_fields
from mmalign.policies.base import ActionStats, Policy, RunInfo

__all__ = [
    "AUTO_DECODE_IMAGES",
    "AUTO_DECODE_VIDEOS",
    "CPS_LOG_PROBS",
    "FLOW_SDE_KINDS",
    "SDE_KINDS",
    "WINDOW_MODES",
    "DenoisingPolicy",
    "SamplerSettings",
    "StepContext",
    "add_lora",
    "mean_kl",
]

FLOW_SDE_KINDS = ("flow_sde", "cps", "dance")
"""Step kinds of the flow-matching policies (`mmalign.algorithms.sde` functions of the flow-matching convention)."""
SDE_KINDS = (*FLOW_SDE_KINDS, "ddim")
"""Every step kind a denoising policy samples with (``ddim``: `DDIMPolicy`)."""
CPS_LOG_PROBS = sde.LOG_PROB_FORMS
"""How a ``cps`` step is scored: ``squared_error`` (Flow-GRPO, default) or ``gaussian``."""
WINDOW_MODES = ("random", "sliding")
_NOISE_NAMES = {"flow_sde": "noise level a", "cps": "noise level a", "dance": "eta", "ddim": "eta"}
AUTO_DECODE_IMAGES = 8
"""``vae_decode_batch: auto``: images decoded per VAE call."""
AUTO_DECODE_VIDEOS = 1
"""``vae_decode_batch: auto``: video clips decoded per VAE call (one 81 x 480 x 832 clip through the Wan VAE
keeps several GiB of temporaries)."""
_EMBED_CACHE_SIZE = 10_000
"""Distinct prompts whose encodings are kept (further prompts are encoded on every use)."""


@dataclass
class SamplerSettings:
    """How a diffusion policy samples and which steps it trains, validated once here (the messages name the
    key). The ``options:`` classes of the diffusion pipelines extend it (``FlowOptions``,
    ``SafeDiffusionOptions``), so these are also their YAML keys; the policies take it as ``sampler=``."""

    num_steps: int = 10
    """Denoising steps per sample (flow: the scheduler's shifted sigmas from 1 to 0; DDIM: the scheduler's
    DDIM timesteps); Flow-GRPO trains with 10."""
    noise_level: float = 0.7
    """The noise knob of ``sde_kind``: the noise level a of ``flow_sde`` (sigma_t = a sqrt(sigma / (1 - sigma)),
    > 0) and ``cps`` (in (0, 1]), the eta of ``dance`` (> 0) and of ``ddim`` (in (0, 1]). How far samples of
    one prompt spread: higher explores more; too high degrades the images. 0 runs the deterministic ODE (flow:
    Euler steps; DDIM: eta = 0), which has no log-probs: accepted for `mmalign sample` / `mmalign eval`, refused
    for training."""
    guidance_scale: float = 1.0
    """Classifier-free guidance scale (empty negative prompt; FLUX.1-dev: its distilled guidance input), the
    same in sampling and in the log-probs (1: no guidance, half the compute)."""
    same_initial_noise: bool = False
    """Start every sample of a group from the same initial noise (only the step noise then differs)."""
    train_fraction: float = 1.0
    """Share of the stochastic steps trained per sample (a random subset each; the others still sample
    stochastically). Ignored when `window_size` is set."""
    window_size: int | None = None
    """Train only a window of this many consecutive stochastic steps (deterministic ODE steps outside it;
    Flow-GRPO-Fast). null: no window."""
    window_range: list[int] | None = None
    """[lo, hi]: the window's first step is drawn uniformly from lo..hi each rollout (default: anywhere)."""
    window_mode: str = "random"
    """How the window moves: ``random`` (a fresh start per rollout, Flow-GRPO-Fast) or ``sliding`` (MixGRPO:
    starts at ``window_range[0]`` and moves `window_stride` steps later every `window_shift_every` training
    steps, wrapping around; see `mmalign.algorithms.schedules.SlidingWindow`)."""
    window_shift_every: int = 25
    """Sliding window: training steps between moves."""
    window_stride: int = 1
    """Sliding window: denoising steps per move."""
    sde_kind: str = "flow_sde"
    """The stochastic step (`mmalign.algorithms.sde`): ``flow_sde`` (Flow-GRPO), ``cps`` (coefficients-preserving,
    noise_level in (0, 1]) or ``dance`` (DanceGRPO, noise_level is its eta) for flow policies; ``ddim`` for
    `DDIMPolicy` (noise_level is its eta). Zero-std steps run as ODE steps."""
    cps_log_prob: str = "squared_error"
    """How a ``cps`` step is scored: ``squared_error`` (Flow-GRPO: log p = -mean((x' - mu)^2), no 1/(2 sigma_t^2)
    factor, so ratios stay well-scaled on the tiny-noise last steps) or ``gaussian`` (the full Gaussian
    log-density; the clip range then means something else). Only used with ``sde_kind: cps``."""
    train_guidance: bool = True
    """Apply CFG in the training forward too (false: train the conditional branch only, half the compute;
    the log-probs of a CFG rollout are then off-policy, so keep ratios near 1 with small clip ranges)."""
    seed: int | None = None
    """null: the initial and step noise come from torch's global RNG (which the trainer seeds and saves in
    checkpoints). An int: a private generator for the sampler (reproducible independently of any other random
    draw; its state is saved in checkpoints too)."""
    eval_noise_level: float | None = 0.0
    """The noise level `mmalign sample` and `mmalign eval` sample with: 0 (default) the deterministic ODE, as
    Flow-GRPO evaluates; null: the training `noise_level`; another value: that SDE noise level. The eval report
    says which sampler it used."""
    negative_prompt: str = ""
    """The negative prompt of classifier-free guidance: the unconditional branch of two-branch CFG and FLUX's
    true CFG ("" : the empty prompt)."""
    true_cfg_scale: float = 1.0
    """FLUX.1 only: true classifier-free guidance with `negative_prompt`, as diffusers' ``FluxPipeline``:
    v = v_neg + s (v_pos - v_neg), two forwards each with the distilled `guidance_scale` (1: off). The other
    families guide with `guidance_scale`."""
    detach_uncond: bool = True
    """Training forward of two-branch CFG: no gradient through the unconditional branch (it runs without a
    graph, so backward keeps and traverses one branch), as Flow-GRPO detaches it; false: the gradient also flows
    through the unconditional branch."""
    steps_per_backward: int | None = 1
    """Trained steps whose forwards share one backward pass: 1 (default) back-propagates after each trained
    step, as Flow-GRPO, so a step's graph is freed before the next step's forward and peak memory does not grow
    with the number of trained steps; k: chunks of k steps; null: all of a microbatch's steps in one backward.
    The accumulated gradient is the same in every case (`mmalign.policies.base.Policy.action_chunks`)."""
    guard_ratio_norm: bool = False
    """GRPO-Guard's RatioNorm (flow sde kinds): score each trained step as mean(mu_theta * eps) with eps the
    stored standardised step noise, so the policy loss sees the log-ratio mean((mu_theta - mu_old) * eps) =
    (log-ratio + ||mu_theta - mu_old||^2 / (2 std^2)) * std: centred and on one scale across steps
    (docs/algorithms.md, "GRPO-Guard"). The clip range then bounds that normalised ratio. As verl-omni's
    GRPO-Guard loss (``adv_clip_max`` 5), the advantages are then clamped to [-5, 5] when ``algorithm.adv_clip``
    is null (the trainer logs a line saying so; set ``algorithm.adv_clip`` for another bound)."""
    guard_grad_reweight: bool = False
    """GRPO-Guard's gradient reweighting (flow sde kinds): the policy loss of each trained step times
    1 / (sigma - sigma'), the step's 1 / |dt|, so every step pulls with a similar gradient magnitude."""
    vae_decode_batch: int | str | None = "auto"
    """Samples the VAE decodes at once when a reward needs pixels (`DenoisingPolicy.decode`): an int k decodes
    chunks of k samples (the same pixels as one call; peak memory of the decode is that of k samples);
    ``auto`` (default): `AUTO_DECODE_IMAGES` images or `AUTO_DECODE_VIDEOS` clip at a time; null: every sample of
    the rollout in one call."""

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.sde_kind not in SDE_KINDS:
            raise ValueError(f"sde_kind must be one of {', '.join(SDE_KINDS)}; got {self.sde_kind!r}")
        self._check_noise("noise_level", self.noise_level)
        if self.eval_noise_level is not None:
            self._check_noise("eval_noise_level", self.eval_noise_level)
        if self.cps_log_prob not in CPS_LOG_PROBS:
            raise ValueError(
                f"cps_log_prob must be one of {', '.join(CPS_LOG_PROBS)}; got {self.cps_log_prob!r}"
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
        if self.window_mode not in WINDOW_MODES:
            raise ValueError(
                f"window_mode must be one of {', '.join(WINDOW_MODES)}; got {self.window_mode!r}"
            )
        if self.window_mode == "sliding" and self.window_size is None:
            raise ValueError("window_mode sliding needs window_size")
        if self.window_shift_every < 1 or self.window_stride < 1:
            raise ValueError(
                "window_shift_every and window_stride must be >= 1, got "
                f"{self.window_shift_every}, {self.window_stride}"
            )
        if not self.true_cfg_scale >= 1:
            raise ValueError(f"true_cfg_scale must be >= 1 (1: no true CFG), got {self.true_cfg_scale}")
        if self.steps_per_backward is not None and self.steps_per_backward < 1:
            raise ValueError(
                f"steps_per_backward must be >= 1 (null: one backward for all steps), got {self.steps_per_backward}"
            )
        if self.vae_decode_batch is not None and self.vae_decode_batch != "auto":
            if isinstance(self.vae_decode_batch, bool) or not isinstance(self.vae_decode_batch, int):
                raise ValueError(
                    f"vae_decode_batch must be an int >= 1, 'auto' or null, got {self.vae_decode_batch!r}"
                )
            if self.vae_decode_batch < 1:
                raise ValueError(
                    f"vae_decode_batch must be >= 1 ('auto' or null: all at once), got {self.vae_decode_batch}"
                )
        if self.sde_kind == "ddim" and (self.guard_ratio_norm or self.guard_grad_reweight):
            raise ValueError(
                "guard_ratio_norm and guard_grad_reweight (GRPO-Guard) are for the flow sde kinds "
                f"({', '.join(FLOW_SDE_KINDS)}), not ddim"
            )

    @property
    def deterministic(self) -> bool:
        """Whether the sampler runs the deterministic ODE (`noise_level` 0): no step has a log-prob."""
        return self.noise_level == 0

    def _check_noise(self, key: str, level: float) -> None:
        """`level` (the value of `key`) is 0 (the ODE) or a valid noise level of ``sde_kind``."""
        kind = self.sde_kind
        bounded = kind in ("cps", "ddim")
        if level == 0 or (level > 0 and (level <= 1 or not bounded)):
            return
        if kind == "ddim":
            raise ValueError(
                f"eta (the {key} of sde_kind ddim) must be in (0, 1], or 0 for deterministic DDIM (sampling and "
                f"evaluation only), got {level}"
            )
        allowed = "in (0, 1]" if bounded else "> 0"
        raise ValueError(
            f"{key} must be {allowed}, or 0 for the deterministic ODE (sampling and evaluation only), got {level} "
            f"(the {_NOISE_NAMES[kind]} of {kind}, {allowed})"
        )

    def sampler_settings(self, **changes: Any) -> SamplerSettings:
        """A plain `SamplerSettings` with this object's sampler fields (an options class that extends it hands
        this to its policy) and `changes` applied (validated again)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(SamplerSettings)}
        return SamplerSettings(**{**values, **changes})


class _Setting:
    """A policy attribute read from (and, when set, replaced in) the policy's `SamplerSettings`."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.sampler, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.sampler = dataclasses.replace(obj.sampler, **{self.name: value})


@dataclass
class StepContext:
    """What `DenoisingPolicy.shift_step_mean` may use besides the mean and x_t (one rollout step)."""

    sched: dict[str, Tensor]
    """The step's schedule values per sample (``schedule_keys`` and ``step_index``), Float/Long[B]."""
    cond: dict[str, Tensor]
    """The prompt conditioning (``conditioning_keys``), per sample."""
    prediction: Tensor
    """The network output the step mean was computed from (velocity, eps ...; guided)."""
    std: Tensor
    """The step's std (broadcasts against the mean)."""
    prompts: list[str]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    """The dataset columns per sample (what a reward reads)."""


ADAPTABLE_LAYERS = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding)
"""The layer types a LoRA adapter is put on."""


def adaptable_targets(model: torch.nn.Module, suffixes: list[str] | tuple[str, ...]) -> list[str]:
    """LoRA target names for `model`: `suffixes` as given when every module they name (as peft matches them:
    a name equal to one, or ending in ``.`` + one) is an adaptable layer; otherwise the full names of the
    adaptable layers they name. So a suffix that names a layer in one block type and a container in another
    (FLUX.2's ``attn.to_out``: the single blocks' output Linear, the double blocks' ModuleList) adapts the layer."""
    modules = dict(model.named_modules())
    named = [n for n in modules if any(n == s or n.endswith("." + s) for s in suffixes)]
    if all(isinstance(modules[n], ADAPTABLE_LAYERS) for n in named):
        return list(suffixes)
    return [n for n in named if isinstance(modules[n], ADAPTABLE_LAYERS)]


def add_lora(denoiser: torch.nn.Module, lora: Any, all_linear: tuple[str, ...] | list[str]) -> bool:
    """Freeze `denoiser` and give it a peft LoRA adapter (diffusers ``add_adapter``) when ``lora.enabled``
    (`mmalign.config.LoraConfig`; ``target_modules: all-linear`` means the model's `all_linear` list).
    Returns whether an adapter was added."""
    if not (lora and lora.enabled):
        return False
    from peft import LoraConfig as PeftLoraConfig

    targets = list(all_linear) if lora.target_modules == "all-linear" else lora.target_modules
    if isinstance(targets, list | tuple):
        targets = adaptable_targets(denoiser, targets)
    denoiser.requires_grad_(False)
    denoiser.add_adapter(
        PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets)
    )
    return True


def mean_kl(mean: Tensor, ref_mean: Tensor, kl_std: Tensor) -> Tensor:
    """Float[B]: the KL on step means, ``||mu - mu_ref||^2 / (2 sigma_t^2)`` with the squared distance
    averaged over the non-batch dims (docs/algorithms.md; Flow-GRPO's training script). ``kl_std`` is the step's
    noise scale sigma_t *without* the sqrt(|dt|) factor of the discretisation -- `mmalign.algorithms.sde.StepOutput.kl_std`,
    not ``.std`` -- so ``kl_coef`` values of the Flow-GRPO recipes mean the same here. A scalar or one value
    per sample (any shape that broadcasts as [B, 1, ..., 1])."""
    diff = (mean - ref_mean) ** 2
    std2 = (kl_std**2).reshape(-1) if kl_std.ndim else kl_std**2
    return diff.mean(dim=tuple(range(1, diff.ndim))) / (2 * std2)


def _checkpointable(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost diffusers models under `module` (itself included) that support gradient checkpointing."""
    if getattr(module, "_supports_gradient_checkpointing", False) and hasattr(
        module, "enable_gradient_checkpointing"
    ):
        return [module]
    return [m for child in module.children() for m in _checkpointable(child)]


def _add_shift(delta: Tensor) -> sde.MeanShift:
    return lambda mean, std: mean + delta


class DenoisingPolicy(Policy):
    """The rollout and re-scoring loops of the diffusion policies; see the module docstring for the hooks."""

    conditioning_keys: tuple[str, ...] = ("prompt_embeds",)
    """Keys of `encode_conditioning`'s result (also the payload keys of the prompt conditioning)."""
    row_conditioning_keys: tuple[str, ...] = ()
    """Keys of `row_conditioning`'s result (per-sample conditioning from the rows; also payload keys). A
    policy whose row conditioning depends on its options sets this per instance. A policy whose prompt states
    depend on the row (Qwen-Image-Edit: the instruction read together with the source image) leaves
    ``conditioning_keys`` empty and returns its prompt keys from `row_conditioning` instead."""
    negative_row_keys: Mapping[str, str] = MappingProxyType({})
    """{conditioning key: row-conditioning key holding its value for the unconditional CFG branch}: for a policy
    whose negative prompt is encoded per row (with the row's image), `_negative_inputs` takes these in place of
    the keys (default: none; the negative prompt's `conditioning` replaces the prompt keys)."""
    schedule_keys: tuple[str, ...] = ()
    """Keys of `schedule`'s result (also payload keys)."""

    model: torch.nn.Module
    forward_model: torch.nn.Module
    ref_model: torch.nn.Module | None
    vae: torch.nn.Module
    generator: torch.Generator | None
    lora: bool
    need_reference: bool
    latent_size: int
    sampler: SamplerSettings

    num_steps = _Setting()
    noise_level = _Setting()
    guidance_scale = _Setting()
    same_initial_noise = _Setting()
    train_fraction = _Setting()
    window_size = _Setting()
    window_range = _Setting()
    window_mode = _Setting()
    sde_kind = _Setting()
    cps_log_prob = _Setting()
    train_guidance = _Setting()
    eval_noise_level = _Setting()
    negative_prompt = _Setting()
    true_cfg_scale = _Setting()
    detach_uncond = _Setting()
    steps_per_backward = _Setting()
    guard_ratio_norm = _Setting()
    guard_grad_reweight = _Setting()
    vae_decode_batch = _Setting()

    noise_level_key = "options.noise_level"
    """The config key of ``noise_level`` in the pipelines that build this policy (named by `setup`'s refusal)."""

    @staticmethod
    def _settings(
        sampler: SamplerSettings | None, kwargs: dict[str, Any], **defaults: Any
    ) -> SamplerSettings:
        """`sampler`, or one built from the constructor's keyword arguments over `defaults` (not both)."""
        if sampler is None:
            return SamplerSettings(**{**defaults, **kwargs})
        if kwargs:
            raise TypeError(
                f"give either sampler= or sampler settings as keywords, not both: {sorted(kwargs)}"
            )
        return sampler

    def _init_denoising(
        self,
        model: torch.nn.Module,
        vae: torch.nn.Module,
        sampler: SamplerSettings,
        *,
        latent_size: int | None,
        need_reference: bool,
        lora: bool,
    ) -> None:
        """Set the shared attributes: ``model`` (the denoiser), ``forward_model`` (what `action_stats` runs; the
        trainer may swap in a DDP wrapper), ``ref_model`` (a frozen copy when a reference is needed without
        LoRA), ``vae`` (frozen), ``generator`` (seeded by ``sampler.seed``, or None), ``latent_size``. A
        subclass calls `_init_trained_steps` once its schedule is known."""
        self.sampler = sampler
        self.model = model
        self.forward_model = model
        self.kl_in_action_stats = need_reference
        """`action_stats` returns the KL on step means itself (the trainer then skips reference log-probs)."""
        self.vae = vae.eval().requires_grad_(False)
        self.latent_size = latent_size or int(model.config.sample_size)
        self.generator = torch.Generator().manual_seed(sampler.seed) if sampler.seed is not None else None
        self.lora = lora
        self.need_reference = need_reference
        self.ref_model = (
            copy.deepcopy(model).eval().requires_grad_(False) if need_reference and not lora else None
        )
        self.rollout_batch_size: int | None = None
        """Samples a rollout denoises at once (``rollout.batch_size``, set by `setup`; whole groups, at least one;
        None: the whole batch)."""
        self.gradient_checkpointing = False
        """Whether the denoiser checkpoints its activations in the training forward (`set_gradient_checkpointing`;
        ``model.gradient_checkpointing``, applied by `setup`)."""
        self.train_step = 0
        """The trainer's step, set by `on_train_step` (drives the sliding window)."""
        self.window_schedule: SlidingWindow | None = None
        self._window_bounds = (0, 0)
        self._embed_cache: dict[str, dict[str, Tensor]] = {}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def setup(self, run: RunInfo) -> None:
        """Refuse a rollout engine (`Policy.setup`) and training with ``noise_level`` 0: the deterministic ODE
        has no log-probs (it is for `mmalign sample` / `mmalign eval`); turn on activation checkpointing of the
        denoiser with ``model.gradient_checkpointing`` (`set_gradient_checkpointing`); take ``rollout.batch_size``
        as the samples a rollout denoises at once (`rollout_batch_size`)."""
        super().setup(run)
        self._setup_memory(run)
        if self.sampler.deterministic:
            raise ConfigError(
                f"{run.cfg.source}: key '{self.noise_level_key}': 0 samples the deterministic ODE, which has no "
                f"log-probs to train; set it > 0 for training ('options.eval_noise_level' chooses how "
                "`mmalign sample` and `mmalign eval` sample, the ODE by default)"
            )

    def _setup_memory(self, run: RunInfo) -> None:
        """``rollout.batch_size`` (`rollout_batch_size`) and, when ``model.gradient_checkpointing`` is true,
        `set_gradient_checkpointing`."""
        batch = getattr(getattr(run.cfg, "rollout", None), "batch_size", None)
        self.rollout_batch_size = None if batch is None else int(batch)
        if getattr(getattr(run.cfg, "model", None), "gradient_checkpointing", False):
            try:
                self.set_gradient_checkpointing(True)
            except ValueError as e:
                raise ConfigError(f"{run.cfg.source}: key 'model.gradient_checkpointing': {e}") from None

    def set_gradient_checkpointing(self, enable: bool = True) -> None:
        """Activation checkpointing of the denoiser(s) in ``model`` (both experts of a `WanExperts`): diffusers'
        ``enable_gradient_checkpointing()`` on every outermost diffusers model inside it, so each transformer
        block / UNet block keeps only its inputs and is recomputed in the backward. It acts where grad is enabled
        only (the training forward of `action_stats`); the rollout and the reference forwards run without grad
        and are unchanged. The gradient is the same as without. A denoiser that does not support it is a
        ValueError."""
        found = _checkpointable(self.model)
        if not found:
            raise ValueError(
                f"the denoiser {type(self.model).__name__} holds no diffusers model that supports gradient "
                "checkpointing (_supports_gradient_checkpointing)"
            )
        for m in found:
            if enable:
                m.enable_gradient_checkpointing()
            else:
                m.disable_gradient_checkpointing()
        self.gradient_checkpointing = bool(enable)

    @property
    def checkpointing_denoisers(self) -> list[torch.nn.Module]:
        """The diffusers models `set_gradient_checkpointing` switches (outermost first)."""
        return _checkpointable(self.model)

    # ------------------------------------------------------------------ evaluation sampler
    def sampler_description(self) -> dict[str, Any]:
        """How the policy samples now, for reports: ``{"sampler": "ode", ...}`` or ``{"sampler": "sde",
        "sde_kind": ..., "noise_level": ...}``, with ``num_steps``."""
        s = self.sampler
        if s.deterministic:
            return {"sampler": "ode", "num_steps": s.num_steps}
        return {
            "sampler": "sde",
            "sde_kind": s.sde_kind,
            "noise_level": s.noise_level,
            "num_steps": s.num_steps,
        }

    @contextmanager
    def evaluation_sampler(self) -> Iterator[dict[str, Any]]:
        """Sample as `mmalign sample` / `mmalign eval` do inside the block: with ``eval_noise_level`` (0: the
        deterministic ODE; None: the training ``noise_level``); yields `sampler_description` of that sampler.
        The settings are restored on exit (nesting is fine)."""
        before = self.sampler
        if before.eval_noise_level is not None:
            self.sampler = dataclasses.replace(before, noise_level=before.eval_noise_level)
        try:
            yield self.sampler_description()
        finally:
            self.sampler = before

    # ------------------------------------------------------------------ checkpointed randomness
    def seed(self, seed: int) -> None:
        """Re-seed the sampler's private generator (``sampler.seed``), when the policy has one."""
        if self.generator is not None:
            self.generator.manual_seed(seed)

    def rng_state(self) -> dict[str, Tensor]:
        """The state of the policy's private generator (``seed``), which the trainer writes into every
        checkpoint (per process) so that a resumed run draws the same noise as an uninterrupted one."""
        return {"generator": self.generator.get_state()} if self.generator is not None else {}

    def load_rng_state(self, state: dict[str, Tensor]) -> None:
        """Restore `rng_state`; a checkpoint of a policy without a private generator restores nothing."""
        if self.generator is not None and "generator" in state:
            self.generator.set_state(state["generator"])
        elif self.generator is not None:
            raise ValueError(
                "the checkpoint holds no state of the policy's seeded generator (written by a run without a "
                "policy seed?); resume with the same configuration it was written with"
            )

    # ------------------------------------------------------------------ trained steps
    def _num_trainable_steps(self) -> int:
        """How many leading denoising steps can be trained (those with std > 0)."""
        raise NotImplementedError

    def _init_trained_steps(self) -> None:
        """Check the window against the `_num_trainable_steps` stochastic steps and build the sliding
        schedule (``window_mode: sliding``)."""
        n, size, total = self._num_trainable_steps(), self.window_size, self.num_steps
        if size is None:
            return
        if not 1 <= size <= n:
            why = "" if n == total else f"; the last {total - n} step(s) of {self.sde_kind} have std 0"
            raise ValueError(
                f"window_size must be in [1, {n}] (the stochastic steps of num_steps={total}{why}), got {size}"
            )
        lo, hi = self.window_range or (0, n - size)
        hi = min(hi, n - size)
        if not 0 <= lo <= hi:
            raise ValueError(
                f"window_range {self.window_range} leaves no window start in [0, {n - size}] "
                f"for window_size={size}"
            )
        self._window_bounds = (lo, hi)
        if self.window_mode == "sliding":
            s = self.sampler
            self.window_schedule = SlidingWindow(
                n, size, s.window_shift_every, stride=s.window_stride, start=lo, end=hi
            )

    def on_train_step(self, step: int) -> None:
        """Called by the trainer before each rollout with its step (finished training steps)."""
        self.train_step = int(step)

    def _window_start(self, n: int) -> int:
        """First step of the trained window: the sliding schedule's at ``train_step``, else uniform in
        ``window_range`` (clipped so the window fits in the `n` trainable steps)."""
        if self.window_schedule is not None:
            return self.window_schedule.start_at(self.train_step)
        lo, hi = self._window_bounds
        return int(torch.randint(lo, hi + 1, (1,), generator=self.generator))

    def _trainable_offset(self) -> int:
        """The first denoising step that can be trained (default 0): the trainable steps are the
        `_num_trainable_steps` consecutive steps from here; windows and subsets index into them."""
        return 0

    def num_denoising_steps(self) -> int:
        """How many denoising steps a rollout runs (default ``num_steps``); `schedule` holds that many."""
        return self.num_steps

    def _trained_steps(self, batch: int) -> Tensor:
        """Long[B, T]: the (sorted) step indices whose transitions are trained, per sample."""
        n, off = self._num_trainable_steps(), self._trainable_offset()
        if self.window_size is not None:
            start = self._window_start(n) + off
            return torch.arange(start, start + self.window_size).expand(batch, -1).clone()
        t = max(1, math.ceil(self.train_fraction * n))
        if t == n:
            return (torch.arange(n) + off).expand(batch, -1).clone()
        perm = torch.stack([torch.randperm(n, generator=self.generator)[:t] for _ in range(batch)])
        return perm.sort(dim=1).values + off

    # ------------------------------------------------------------------ hooks
    def encode_conditioning(self, prompts: list[str]) -> dict[str, Tensor]:
        """{key of ``conditioning_keys``: [B, ...]} of `prompts` (uncached; `conditioning` caches)."""
        raise NotImplementedError

    def schedule(self) -> dict[str, Tensor]:
        """{key of ``schedule_keys``: Float[num_steps] per-step values, or a 0-d constant of the rollout}."""
        raise NotImplementedError

    def latent_shape(self) -> tuple[int, ...]:
        """Shape of one sample's latents without the batch dim: (C, h, w) of the denoiser's ``in_channels``
        and ``latent_size``; a video policy returns (C, F, h, w)."""
        return (int(self.model.config.in_channels), self.latent_size, self.latent_size)

    def predict(
        self,
        model: torch.nn.Module,
        latents: Tensor,
        sched: dict[str, Tensor],
        cond: dict[str, Tensor],
        *,
        guided: bool = True,
        detach_uncond: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """(prediction, conditional prediction), fp32, at `latents` [B, ...]: the network call, with
        classifier-free guidance when `guided` and the policy uses it. The conditional prediction is the
        conditional branch of the same call (the prediction itself without two-branch CFG). `detach_uncond`
        (passed only by the training forward, ``detach_uncond`` setting): when grad is enabled the unconditional
        branch carries none (it may run as a separate forward without a graph)."""
        raise NotImplementedError

    def step(
        self, prediction: Tensor, latents: Tensor, sched: dict[str, Tensor], **kw: Any
    ) -> sde.StepOutput:
        """One stochastic step of `mmalign.algorithms.sde` (`kw`: ``prev_sample``, ``generator``, ``shift_mean``)."""
        raise NotImplementedError

    def ode_step(self, prediction: Tensor, latents: Tensor, sched: dict[str, Tensor]) -> Tensor:
        """The deterministic update (outside a window, or a step whose std is 0)."""
        raise NotImplementedError

    def shift_step_mean(self, mean: Tensor, latents: Tensor, t_index: int, context: StepContext) -> Tensor:
        """The mean x_{t+1} is drawn around at step `t_index` (default: `mean` unchanged). An override (a
        reward-guided SDE: ``mean + s * grad r``) makes the sample and its log-prob those of the returned
        mean; the shift of each trained step is stored and added again when the step is re-scored."""
        return mean

    def _shifts_mean(self) -> bool:
        return type(self).shift_step_mean is not DenoisingPolicy.shift_step_mean

    def row_conditioning(self, columns: dict[str, list[Any]], group: Tensor) -> dict[str, Tensor]:
        """{key of ``row_conditioning_keys``: Float[B, ...]} built from the dataset `columns` (one entry per
        sample) on the policy's device; merged into the prompt conditioning and stored in the payload.
        Default: {} (conditioning comes from the prompts only)."""
        return {}

    def initial_latents(
        self, group: Tensor, cond: dict[str, Tensor], columns: dict[str, list[Any]]
    ) -> Tensor:
        """Float[B, *latent_shape]: the latents the first denoising step starts from (default: standard
        normal noise, `_initial_noise`). `cond` holds the prompt and row conditioning of every sample."""
        return self._initial_noise(group)

    def rollout_outputs(self, rollout: Rollout) -> None:
        """Add outputs the rewards read besides ``latents`` to a fresh `rollout` (default: nothing)."""
        return None

    # ------------------------------------------------------------------ conditioning
    def conditioning(self, prompts: list[str]) -> dict[str, Tensor]:
        """`encode_conditioning` in fp32 on the policy's device, each distinct prompt encoded once (cached); {}
        without calling it when ``conditioning_keys`` is empty (the prompt states are row conditioning)."""
        if not self.conditioning_keys:
            return {}
        cache = self._embed_cache
        missing = list(dict.fromkeys(p for p in prompts if p not in cache))
        if missing:
            enc = self.encode_conditioning(missing)
            for i, p in enumerate(missing):
                if len(cache) < _EMBED_CACHE_SIZE:
                    cache[p] = {k: v[i].float() for k, v in enc.items()}
        if any(p not in cache for p in prompts):  # cache full: encode directly
            return {k: v.float() for k, v in self.encode_conditioning(prompts).items()}
        return {k: torch.stack([cache[p][k] for p in prompts]) for k in self.conditioning_keys}

    def _negative_inputs(self, cond: dict[str, Tensor], batch: int) -> dict[str, Tensor]:
        """The conditioning of the unconditional CFG branch for `batch` samples: the ``negative_prompt``'s
        (the empty prompt by default) in place of the prompt conditioning; a key of ``negative_row_keys`` takes
        the row conditioning it names (a negative prompt encoded per row); other row conditioning
        (``row_conditioning_keys``) is kept as is."""
        neg = self.conditioning([self.negative_prompt])
        swap = self.negative_row_keys
        return {
            k: cond[swap[k]] if k in swap else neg[k].expand(batch, *([-1] * (v.ndim - 1))) if k in neg else v
            for k, v in cond.items()
        }

    def _cfg_inputs(self, cond: dict[str, Tensor], batch: int) -> dict[str, Tensor]:
        """The conditioning of a two-branch CFG call: the negative branch's (`_negative_inputs`) for `batch`
        samples, then `cond`; the network's input is doubled the same way and its output split by
        `_cfg_combine`."""
        neg = self._negative_inputs(cond, batch)
        return {k: torch.cat([neg[k], v]) for k, v in cond.items()}

    def _cfg_scale(self) -> float:
        """The scale w of two-branch CFG, u + w (c - u) (default ``guidance_scale``)."""
        return float(self.guidance_scale)

    def _cfg_combine(self, out: Tensor) -> tuple[Tensor, Tensor]:
        """(u + w (c - u), c) of a two-branch output [u; c]."""
        u, c = out.chunk(2)
        return self._guide(u, c), c

    def _guide(self, u: Tensor, c: Tensor) -> Tensor:
        """u + w (c - u) with w = `_cfg_scale`."""
        return u + self._cfg_scale() * (c - u)

    # ------------------------------------------------------------------ sampling
    def _initial_noise(self, group: Tensor) -> Tensor:
        """Float[B, *latent_shape] standard normal latents; with ``same_initial_noise`` one draw per group."""
        shape = tuple(self.latent_shape())
        if self.same_initial_noise:
            n_groups = int(group.max()) + 1
            noise = torch.randn((n_groups, *shape), generator=self.generator)[group]
        else:
            noise = torch.randn((group.shape[0], *shape), generator=self.generator)
        return noise.to(self.device)

    @torch.no_grad()
    def rollout(self, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool = True) -> Rollout:
        """Sample `group_size` latents for each row's ``prompt`` (see `Policy.rollout`). With
        ``rollout_batch_size`` (``rollout.batch_size``, set by `setup`) smaller than the batch, the rows are
        sampled in chunks of whole groups, at most that many samples each (at least one group), and the chunks
        concatenated; the trained steps (a window's start included) are drawn once for the whole batch."""
        b = len(rows) * group_size
        k = getattr(self, "rollout_batch_size", None)
        if k is None or b <= k:
            return self._rollout_chunk(rows, group_size, compute_logp=compute_logp)
        ode = self.sampler.deterministic
        steps = torch.zeros((b, 0), dtype=torch.long) if ode else self._trained_steps(b)
        per = max(1, k // group_size)
        parts = []
        for start in range(0, len(rows), per):
            chunk = rows[start : start + per]
            lo, hi = start * group_size, (start + len(chunk)) * group_size
            part = self._rollout_chunk(chunk, group_size, compute_logp=compute_logp, steps=steps[lo:hi])
            part.group = part.group + start
            parts.append(part)
        return Rollout.cat(parts)

    @torch.no_grad()
    def _rollout_chunk(
        self,
        rows: list[dict[str, Any]],
        group_size: int,
        *,
        compute_logp: bool = True,
        steps: Tensor | None = None,
    ) -> Rollout:
        """`rollout` of `rows` in one batch; `steps` Long[B, T]: the trained steps (None: drawn here)."""
        prompts, group, columns = group_fields(rows, group_size)
        b, dev = len(prompts), self.device
        cond = self.conditioning(prompts)
        row_cond = self.row_conditioning(columns, group)
        if tuple(row_cond) != tuple(self.row_conditioning_keys):
            raise RuntimeError(
                f"row_conditioning() returned {tuple(row_cond)}, expected row_conditioning_keys "
                f"{tuple(self.row_conditioning_keys)}"
            )
        cond.update(row_cond)
        table = self.schedule()
        if tuple(table) != self.schedule_keys:
            raise RuntimeError(
                f"schedule() returned {tuple(table)}, expected schedule_keys {self.schedule_keys}"
            )
        ode = self.sampler.deterministic  # noise_level 0: every step is an ODE step, nothing is recorded
        if steps is None:
            steps = torch.zeros((b, 0), dtype=torch.long) if ode else self._trained_steps(b)
        t = steps.shape[1]
        n_sde, off = self._num_trainable_steps(), self._trainable_offset()
        window = set(steps[0].tolist()) if self.window_size is not None and not ode else None
        guard = self.guard_ratio_norm and not ode
        cfg_free = not self.train_guidance and self.guidance_scale > 1.0
        score_cond = cfg_free and (compute_logp or guard)
        shifting = self._shifts_mean()
        generator = self.generator if dev.type == "cpu" else None

        x = self.initial_latents(group, cond, columns)
        lat = torch.zeros((b, t, *x.shape[1:]), device=dev)
        nxt = torch.zeros_like(lat)
        shifts = torch.zeros_like(lat) if shifting else None
        means = torch.zeros_like(lat) if guard else None
        logp = torch.zeros((b, t), device=dev)
        steps_d = steps.to(dev)
        table_d = {k: v.to(dev) for k, v in table.items()}
        was_training = self.model.training
        self.model.eval()
        for i in range(self.num_denoising_steps()):
            sched = {k: (v[i] if v.ndim else v).expand(b) for k, v in table_d.items()}
            sched["step_index"] = torch.full((b,), i, dtype=torch.long, device=dev)
            pred, pred_c = self.predict(self.model, x, sched, cond, guided=True)
            if ode or not off <= i < off + n_sde or (window is not None and i not in window):
                x = self.ode_step(pred, x, sched)
                continue
            delta: list[Tensor] = []
            shift = None
            if shifting:
                shift = self._recording_shift(x, i, sched, cond, pred, prompts, columns, delta)
            out = self.step(pred, x, sched, generator=generator, shift_mean=shift)
            x_new = out.sample
            hit = steps_d == i
            rows_hit = hit.any(dim=1)
            if bool(rows_hit.any()):
                lat[hit] = x[rows_hit]
                nxt[hit] = x_new[rows_hit]
                scored = out
                if score_cond:  # CFG-free training: the conditional branch's density of the CFG sample
                    again = _add_shift(delta[0]) if shifting else None
                    scored = self.step(pred_c, x, sched, prev_sample=x_new, shift_mean=again)
                lp = scored.log_prob
                if means is not None:  # GRPO-Guard: the mean the transition is scored against
                    lp = sde.ratio_norm_score(x_new, scored.mean, scored.mean, scored.std)
                    means[hit] = scored.mean[rows_hit]
                logp[hit] = lp[rows_hit]
                if shifts is not None:
                    shifts[hit] = delta[0][rows_hit]
            x = x_new
        if was_training:
            self.model.train()
        payload: dict[str, Any] = {"latents": lat.cpu(), "next_latents": nxt.cpu(), "step_index": steps}
        for k, v in table.items():
            payload[k] = v[steps] if v.ndim else v.repeat(b)
        payload.update({k: v.cpu() for k, v in cond.items()})
        if shifts is not None:
            payload["mean_shift"] = shifts.cpu()
        if means is not None:
            payload["step_mean"] = means.cpu()
        rollout = Rollout(
            group=group,
            mask=torch.ones((b, t), dtype=torch.bool),
            prompts=prompts,
            columns=columns,
            outputs={"latents": x.cpu()},
            payload=payload,
        )
        if compute_logp:
            rollout.logp_old = logp.cpu()
        self.rollout_outputs(rollout)
        return rollout

    def _recording_shift(
        self,
        x: Tensor,
        t_index: int,
        sched: dict[str, Tensor],
        cond: dict[str, Tensor],
        pred: Tensor,
        prompts: list[str],
        columns: dict[str, list[Any]],
        record: list[Tensor],
    ) -> sde.MeanShift:
        """The ``shift_mean`` of a rollout step: `shift_step_mean`, its shift appended to `record`."""

        def shift(mean: Tensor, std: Tensor) -> Tensor:
            ctx = StepContext(
                sched=sched, cond=cond, prediction=pred, std=std, prompts=prompts, columns=columns
            )
            shifted = self.shift_step_mean(mean, x, t_index, ctx)
            record.append(shifted - mean)
            return shifted

        return shift

    # ------------------------------------------------------------------ decoding
    def materialize(self, rollout: Rollout, needs: Collection[str]) -> None:
        """Decode the latents to pixels when a reward needs ``images`` / ``videos`` (and none are there yet)."""
        media = {"images", "videos"}
        if media & set(needs) and not media & set(rollout.outputs):
            self.decode(rollout)

    @torch.no_grad()
    def decode(self, rollout: Rollout) -> Tensor:
        """Pixels in [0, 1] of ``outputs["latents"]`` (`decode_latents`), also stored as ``outputs["images"]``
        (Float[B,3,H,W]) or, for video latents, ``outputs["videos"]`` (Float[B,F,3,H,W]). The VAE sees
        `decode_chunk` samples at a time (``vae_decode_batch``); the pixels are those of one call."""
        z = rollout.outputs["latents"]
        k = self.decode_chunk(z.ndim == 5)
        parts = [self.decode_latents(c.to(self.device)) for c in (z.split(k) if k else [z])]
        pixels = parts[0] if len(parts) == 1 else torch.cat(parts)
        rollout.outputs["videos" if pixels.ndim == 5 else "images"] = pixels
        return pixels

    def decode_chunk(self, video: bool) -> int | None:
        """Samples per VAE call of `decode` (``vae_decode_batch``; ``auto``: `AUTO_DECODE_VIDEOS` clips when
        `video`, else `AUTO_DECODE_IMAGES` images); None: all at once."""
        k = self.sampler.vae_decode_batch
        if k == "auto":
            return AUTO_DECODE_VIDEOS if video else AUTO_DECODE_IMAGES
        return k

    def decode_latents(self, z: Tensor) -> Tensor:
        """Pixels in [0, 1] on the CPU: the VAE decodes ``z / scaling_factor + shift_factor`` of image latents
        [B, C, h, w] -> [B, 3, H, W]; video latents [B, C, F, h, w] frame by frame -> [B, F, 3, H, W]."""
        if z.ndim == 5:
            frames = self.decode_latents(z.movedim(2, 1).flatten(0, 1))
            return frames.unflatten(0, (z.shape[0], z.shape[2]))
        cfg = self.vae.config
        z = z / cfg.scaling_factor + (getattr(cfg, "shift_factor", None) or 0.0)
        img = self.vae.decode(z.to(next(self.vae.parameters()).dtype), return_dict=False)[0].float()
        return (img / 2 + 0.5).clamp(0, 1).cpu()

    # ------------------------------------------------------------------ log-probs
    def _score(
        self,
        model: torch.nn.Module,
        rollout: Rollout,
        *,
        grad: bool,
        with_kl: bool = False,
        actions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(log-probs Float[B, A] of the stored trained transitions under `model`, KL Float[B, A] or None, the
        GRPO-Guard loss weights Float[B, A] or None) for the action columns `actions` (None: all, A = T). Only
        those columns of the payload are moved to the device. Under ``guard_ratio_norm`` the "log-prob" is
        `mmalign.algorithms.sde.ratio_norm_score` against the stored rollout mean."""
        p = rollout.payload
        dev = self.device
        cond = {k: p[k].to(dev) for k in (*self.conditioning_keys, *self.row_conditioning_keys)}
        cols = range(rollout.num_actions) if actions is None else [int(j) for j in actions]
        if self.guard_ratio_norm and "step_mean" not in p:
            raise ValueError(
                "guard_ratio_norm scores against the rollout's step means, but this rollout holds none (it was "
                "sampled without guard_ratio_norm)"
            )
        detach = grad and self.detach_uncond and "detach_uncond" in inspect.signature(self.predict).parameters
        predict_kw = {"detach_uncond": True} if detach else {}  # (a `predict` without it keeps both branches)
        logps, kls, weights = [], [], []
        for j in cols:
            x, x_next = p["latents"][:, j].to(dev), p["next_latents"][:, j].to(dev)
            sched = {k: (p[k][:, j] if p[k].ndim == 2 else p[k]).to(dev) for k in self.schedule_keys}
            sched["step_index"] = p["step_index"][:, j].to(dev)
            shift = _add_shift(p["mean_shift"][:, j].to(dev)) if "mean_shift" in p else None
            with torch.set_grad_enabled(grad):
                pred = self.predict(model, x, sched, cond, guided=self.train_guidance, **predict_kw)[0]
                out = self.step(pred, x, sched, prev_sample=x_next, shift_mean=shift)
                lp = out.log_prob
                if self.guard_ratio_norm:
                    lp = sde.ratio_norm_score(x_next, out.mean, p["step_mean"][:, j].to(dev), out.std)
            logps.append(lp)
            if self.guard_grad_reweight:
                weights.append(self.step_loss_weight(sched).to(lp.dtype))
            if with_kl:
                with torch.no_grad(), self._reference() as ref:
                    pred_ref = self.predict(ref, x, sched, cond, guided=self.train_guidance)[0]
                    ref_mean = self.step(pred_ref, x, sched, prev_sample=x_next, shift_mean=shift).mean
                kls.append(mean_kl(out.mean, ref_mean, out.kl_std))
        logp = torch.stack(logps, dim=1)
        kl = torch.stack(kls, dim=1) if with_kl else None
        weight = torch.stack(weights, dim=1) if weights else None
        return logp, kl, weight

    def step_loss_weight(self, sched: dict[str, Tensor]) -> Tensor:
        """Float[B]: GRPO-Guard's weight of the policy loss of the step `sched` describes (``guard_grad_reweight``;
        the flow policies: 1 / (sigma - sigma'))."""
        raise NotImplementedError(f"{type(self).__name__} has no GRPO-Guard step weights")

    @contextmanager
    def _reference(self) -> Iterator[torch.nn.Module]:
        """The reference network: the adapter-disabled denoiser under LoRA, else the frozen copy."""
        if self.lora:
            self.model.disable_adapters()
            try:
                yield self.model
            finally:
                self.model.enable_adapters()
        else:
            if self.ref_model is None:
                raise RuntimeError("no reference model: build the policy with need_reference=True")
            yield self.ref_model

    @contextmanager
    def reference_network(self) -> Iterator[torch.nn.Module]:
        """The reference network for the block (what the KL and Flow-DPO compare with): the adapter-disabled
        denoiser under LoRA, else the frozen copy; a RuntimeError when the policy keeps neither."""
        with self._reference() as ref:
            yield ref

    def action_stats(self, rollout: Rollout, *, actions: Tensor | None = None) -> ActionStats:
        """Recompute per-step log-probs with grad (and the mean-difference KL when a reference is used; the
        GRPO-Guard loss weights under ``guard_grad_reweight``) of the trained steps `actions` (column indices,
        one chunk of `action_chunks`; None: all)."""
        logp, kl, weight = self._score(
            self.forward_model, rollout, grad=True, with_kl=self.need_reference, actions=actions
        )
        return ActionStats(logp=logp, kl=kl, loss_weights=weight)

    def action_chunks(self, rollout: Rollout) -> list[Tensor] | None:
        """Chunks of ``steps_per_backward`` consecutive trained-step columns (one backward each; None: one
        backward for all, also when a subclass overrides `action_stats` without ``actions=``)."""
        k, t = self.steps_per_backward, rollout.num_actions
        if k is None or k >= t or not self._scores_chunks():
            return None
        return [torch.arange(start, min(start + k, t)) for start in range(0, t, k)]

    def _scores_chunks(self) -> bool:
        """Whether this class's `action_stats` takes ``actions=`` (scores one chunk of the trained steps)."""
        fn = type(self).action_stats
        return fn is DenoisingPolicy.action_stats or "actions" in inspect.signature(fn).parameters

    def reference_logprobs(self, rollout: Rollout) -> Tensor:
        """Per-step log-probs of the stored transitions under the reference network (no grad)."""
        with self._reference() as ref:
            return self._score(ref, rollout, grad=False)[0]

    # ------------------------------------------------------------------ parameters

    def _denoiser_to_save(self, path: str | Path, subfolder: str) -> Any:
        """The denoiser as it should be saved in ``path/subfolder``: under LoRA the adapter is also written
        on its own to ``path/<subfolder>_lora`` (diffusers ``save_lora_adapter``) and a merged copy is
        returned; otherwise the model itself."""
        if not self.lora:
            return self.model
        self.model.save_lora_adapter(str(Path(path) / f"{subfolder}_lora"))
        merged = copy.deepcopy(self.model)
        merged.fuse_lora()
        merged.unload_lora()
        return merged
