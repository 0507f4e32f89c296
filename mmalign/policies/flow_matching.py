"""`FlowMatchingPolicy`: what every flow-matching family (SD3, FLUX.1, Wan, ...) shares.

It owns the sigma schedule (the scheduler's shift, dynamic shifting through `calculate_mu`), the velocity
prediction with two-branch CFG, the flow SDE / ODE steps of `mmalign.algorithms.sde`, the trainable steps, LoRA and
saving. It builds no model: it takes loaded components (`FlowComponents`). A family adds one subclass that
supplies `load_components` and overrides `encode_conditioning` and `velocity`; the math is in
docs/algorithms.md ("Denoising steps with log-prob").
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Protocol, Self

import numpy as np
import torch
from torch import Tensor

from mmalign.algorithms import sde
from mmalign.config import LoraConfig
from mmalign.data.batch import Rollout
from mmalign.policies import flow_training
from mmalign.policies.base import ActionStats, Policy, RunInfo, torch_dtype
from mmalign.policies.denoising import (
    CPS_LOG_PROBS,
    FLOW_SDE_KINDS,
    WINDOW_MODES,
    DenoisingPolicy,
    SamplerSettings,
    add_lora,
)

__all__ = [
    "CPS_LOG_PROBS",
    "SDE_KINDS",
    "WINDOW_MODES",
    "FlowComponents",
    "FlowMatchingPolicy",
    "calculate_mu",
]

SDE_KINDS = FLOW_SDE_KINDS
"""Step kinds a flow-matching policy samples with (`mmalign.algorithms.sde` functions of the flow convention)."""


def calculate_mu(image_seq_len: int, scheduler_config: Any, *, default_max_shift: float = 1.15) -> float:
    """The dynamic-shift mu for `image_seq_len` latent tokens: linear through the scheduler config's
    (``base_image_seq_len``, ``base_shift``) and (``max_image_seq_len``, ``max_shift``); missing keys take
    diffusers' defaults 256 -> 0.5 and 4096 -> `default_max_shift` (Flux 1.15, SD3 1.16)."""
    get = scheduler_config.get
    n0, n1 = get("base_image_seq_len", 256), get("max_image_seq_len", 4096)
    s0, s1 = get("base_shift", 0.5), get("max_shift", default_max_shift)
    slope = (s1 - s0) / (n1 - n0)
    return image_seq_len * slope + (s0 - slope * n0)  # (this operation order matches the pipelines' bitwise)


class FlowComponents(Protocol):
    """What `FlowMatchingPolicy` needs of a family's loaded components (a dataclass)."""

    transformer: torch.nn.Module
    vae: torch.nn.Module
    scheduler: Any
    text_encoder: torch.nn.Module
    tokenizer: Any

    def text_encoders(self) -> list[torch.nn.Module]: ...

    def save_pretrained(self, path: str | Path, *, transformer: torch.nn.Module | None = None) -> None: ...


class FlowMatchingPolicy(DenoisingPolicy):
    """A flow-matching denoiser as a GRPO policy; one action = one SDE step (``flow_sde``, ``cps``, ``dance``).

    Subclass contract: `load_components` (classmethod), `encode_conditioning`, `velocity`; optionally
    `image_seq_len` / `base_sigmas` (schedule), `latent_shape`, ``lora_targets``, ``two_branch_cfg``."""

    conditioning_keys = ("prompt_embeds", "pooled_embeds")
    schedule_keys = ("sigmas", "sigmas_next", "sigma_max_fallback")
    lora_targets: tuple[str, ...] = ()
    """The modules LoRA ``target_modules: all-linear`` adapts."""
    load_options: tuple[str, ...] = ()
    """`from_pretrained` keywords that go to `load_components` instead of the constructor."""
    two_branch_cfg = True
    """`predict` runs negative and conditional branches when ``guidance_scale`` > 1 (False: the family
    handles ``guidance_scale`` inside `velocity`, e.g. FLUX.1-dev's distilled guidance, and two branches run
    only for ``true_cfg_scale`` > 1)."""
    default_max_shift = 1.16
    """`calculate_mu`'s max shift where the scheduler config has none."""
    constructor_takes_parts = False
    """The constructor takes the components' fields as keywords (and builds the components itself)."""

    def __init__(
        self,
        components: FlowComponents,
        *,
        sampler: SamplerSettings | None = None,
        latent_size: int | None = None,
        need_reference: bool = False,
        lora: bool = False,
        **sampler_kwargs: Any,
    ) -> None:
        """`components`: loaded parts (`FlowComponents`); `sampler`: the `SamplerSettings` (or its fields as
        keywords) with a flow ``sde_kind``; `lora`: the denoiser already carries an adapter."""
        sampler = self._settings(sampler, sampler_kwargs)
        if sampler.sde_kind not in FLOW_SDE_KINDS:
            raise ValueError(
                f"{type(self).__name__} samples with sde_kind {', '.join(FLOW_SDE_KINDS)}; got {sampler.sde_kind!r}"
            )
        if self.two_branch_cfg and sampler.true_cfg_scale != 1:
            raise ValueError(
                f"true_cfg_scale is FLUX's true CFG (a model with distilled guidance); {type(self).__name__} "
                f"guides with guidance_scale, got true_cfg_scale={sampler.true_cfg_scale}"
            )
        self.components = components
        self.scheduler = components.scheduler
        self._init_denoising(
            self.build_denoiser(components),
            components.vae,
            sampler,
            latent_size=latent_size,
            need_reference=need_reference,
            lora=lora,
        )
        for enc in components.text_encoders():
            enc.eval().requires_grad_(False)
        self.text_encoder = components.text_encoder
        self.tokenizer = components.tokenizer
        self._init_steps()

    def build_denoiser(self, components: FlowComponents) -> torch.nn.Module:
        """The network `predict` calls (default: ``components.transformer``)."""
        return components.transformer

    def _init_steps(self) -> None:
        """Set ``stochastic_steps`` (std > 0) and ``trainable_steps`` (consecutive), then the windows."""
        self.stochastic_steps = self._stochastic_steps(self.sigmas())
        """Indices of the steps a rollout runs whose std is > 0, ascending."""
        if not self.stochastic_steps:
            raise ValueError(
                f"{self.sde_kind} with num_steps={self.num_steps} has no stochastic step to train"
            )
        trainable = self._select_trainable(self.stochastic_steps)
        if trainable != list(range(trainable[0], trainable[-1] + 1)):
            raise ValueError(f"the trainable steps of {self.sde_kind} are not consecutive: {trainable}")
        self.trainable_steps = trainable
        """The step indices that can be trained (consecutive)."""
        self._init_trained_steps()

    def _select_trainable(self, stochastic: list[int]) -> list[int]:
        """The trainable steps among the `stochastic` ones (default: all)."""
        return stochastic

    def _stochastic_steps(self, sig: Tensor) -> list[int]:
        """Steps whose std is > 0: CPS's std sigma' sin(a pi / 2) is 0 at sigma' = 0; flow_sde and dance: all."""
        n = self.num_denoising_steps()
        if self.sde_kind == "cps":
            return [i for i in range(n) if float(sig[i + 1]) > 0]
        return list(range(n))

    def _trainable_offset(self) -> int:
        return self.trainable_steps[0]

    def _num_trainable_steps(self) -> int:
        return len(self.trainable_steps)

    # ------------------------------------------------------------------ building
    @classmethod
    def load_components(cls, name_or_path: str | Path, *, dtype: torch.dtype, **options: Any) -> Any:
        """The family's components of a folder or hub id (the one loader hook a family supplies)."""
        raise NotImplementedError

    @classmethod
    def add_lora(cls, components: Any, lora: LoraConfig | None, options: dict[str, Any]) -> bool:
        """Give the denoiser a LoRA adapter on `lora_targets` when ``lora.enabled``; `options`: the
        constructor keywords. Returns whether an adapter was added."""
        return add_lora(components.transformer, lora, cls.lora_targets)

    @classmethod
    def from_components(cls, components: Any, **kwargs: Any) -> Self:
        """The policy of loaded `components`: ``cls(components, **kwargs)``, or with ``constructor_takes_parts``
        the components' dataclass fields as constructor keywords (`kwargs` over them)."""
        if not cls.constructor_takes_parts:
            return cls(components, **kwargs)
        parts = {f.name: getattr(components, f.name) for f in dataclasses.fields(components)}
        return cls(**{**parts, **kwargs})

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        *,
        dtype: str = "float32",
        lora: LoraConfig | None = None,
        **kwargs: Any,
    ) -> Self:
        """Load a folder or hub id through `load_components` (``load_options`` keywords go there); with
        ``lora.enabled`` only a LoRA adapter trains and the reference is the adapter-disabled model. Other
        kwargs go to the constructor."""
        load_kw = {k: kwargs.pop(k) for k in cls.load_options if k in kwargs}
        c = cls.load_components(name_or_path, dtype=torch_dtype(dtype), **load_kw)
        return cls.from_components(c, lora=cls.add_lora(c, lora, kwargs), **kwargs)

    # ------------------------------------------------------------------ sigmas
    def image_seq_len(self) -> int:
        """Latent tokens of one sample for dynamic shifting: (latent_size / patch)^2."""
        patch = int(getattr(self.model.config, "patch_size", 1) or 1)
        return (self.latent_size // patch) ** 2

    def base_sigmas(self) -> np.ndarray | None:
        """Unshifted sigmas given to ``set_timesteps`` (default None: the scheduler's own spacing)."""
        return None

    def full_sigmas(self) -> Tensor:
        """Float[num_steps + 1]: the scheduler's shifted sigmas 1 -> 0 (fp32, CPU); mu under dynamic shifting."""
        kw: dict[str, Any] = {}
        if self.scheduler.config.get("use_dynamic_shifting", False):
            kw["mu"] = calculate_mu(
                self.image_seq_len(), self.scheduler.config, default_max_shift=self.default_max_shift
            )
        base = self.base_sigmas()
        if base is None:
            self.scheduler.set_timesteps(self.num_steps, **kw)
        else:
            self.scheduler.set_timesteps(sigmas=base, **kw)
        return self.scheduler.sigmas.detach().to("cpu", torch.float32)

    def sigmas(self) -> Tensor:
        """Float[num_denoising_steps + 1]: the sigmas a rollout runs (default `full_sigmas`)."""
        return self.full_sigmas()

    def schedule(self) -> dict[str, Tensor]:
        """sigma and sigma' of every step, and ``flow_sde``'s sigma_max fallback (the full schedule's sigmas[1])."""
        sig = self.sigmas()
        full = self.full_sigmas()
        fallback = float(full[1]) if self.num_steps > 1 else 0.5
        return {"sigmas": sig[:-1], "sigmas_next": sig[1:], "sigma_max_fallback": torch.tensor(fallback)}

    # ------------------------------------------------------------------ prompts
    def encode_prompt(self, prompts: list[str]) -> Any:
        """The cached conditioning of `prompts` (fp32, the policy's device): one tensor per
        ``conditioning_keys`` entry, a lone tensor when there is one key."""
        cond = self.conditioning(prompts)
        out = tuple(cond[k] for k in self.conditioning_keys)
        return out[0] if len(out) == 1 else out

    # ------------------------------------------------------------------ model and step
    def velocity(
        self, model: torch.nn.Module, latents: Tensor, sched: dict[str, Tensor], cond: dict[str, Tensor]
    ) -> Tensor:
        """The network's velocity at `latents` [B, ...] (any float dtype): the family's forward call."""
        raise NotImplementedError

    def _cfg_scale(self) -> float:
        """The two-branch CFG scale: ``guidance_scale``, or ``true_cfg_scale`` for a family whose
        ``guidance_scale`` is a distilled guidance input (``two_branch_cfg`` False)."""
        return float(self.guidance_scale if self.two_branch_cfg else self.true_cfg_scale)

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
        """(velocity, conditional velocity), fp32: with `guided` and a CFG scale w > 1 (`_cfg_scale`) one
        batched `velocity` of both branches, combined v_u + w (v_c - v_u); else v_c twice. With
        `detach_uncond` (and grad enabled) the unconditional branch runs as its own forward without a graph and
        only the conditional branch carries grad (training: ``detach_uncond``)."""
        use_cfg = guided and self._cfg_scale() > 1.0
        if not use_cfg:
            v = self.velocity(model, latents, sched, cond).float()
            return v, v
        if detach_uncond and torch.is_grad_enabled():
            with torch.no_grad():
                v_u = self.velocity(
                    model, latents, sched, self._negative_inputs(cond, latents.shape[0])
                ).float()
            v_c = self.velocity(model, latents, sched, cond).float()
            return self._guide(v_u, v_c), v_c
        cond = self._cfg_inputs(cond, latents.shape[0])
        latents = torch.cat([latents, latents])
        sched = {k: torch.cat([v, v]) for k, v in sched.items()}
        return self._cfg_combine(self.velocity(model, latents, sched, cond).float())

    def step(
        self, prediction: Tensor, latents: Tensor, sched: dict[str, Tensor], **kw: Any
    ) -> sde.StepOutput:
        """One `sde.step` of ``sde_kind`` with ``noise_level`` mapped to the kind's option."""
        if self.sde_kind == "flow_sde":
            opts: dict[str, Any] = {
                "noise_level": self.noise_level,
                "sigma_max_fallback": sched["sigma_max_fallback"],
            }
        elif self.sde_kind == "cps":
            opts = {"noise_level": self.noise_level, "log_prob_form": self.cps_log_prob}
        else:  # dance
            opts = {"eta": self.noise_level}
        return sde.step(
            self.sde_kind, prediction, latents, sched["sigmas"], sched["sigmas_next"], **opts, **kw
        )

    def step_loss_weight(self, sched: dict[str, Tensor]) -> Tensor:
        """GRPO-Guard's gradient reweighting of a step: 1 / (sigma - sigma') = 1 / |dt| (verl-omni's
        ``1 / sqrt_dt**2``), Float[B]."""
        return 1.0 / (sched["sigmas"] - sched["sigmas_next"]).float()

    def ode_step(self, prediction: Tensor, latents: Tensor, sched: dict[str, Tensor]) -> Tensor:
        """The Euler step x + v dt (outside a window; CPS's zero-std final step; every step at ``noise_level``
        0), as ``FlowMatchEulerDiscreteScheduler.step``."""
        dt = sched["sigmas_next"] - sched["sigmas"]
        return latents + prediction * dt.view(-1, *([1] * (latents.ndim - 1)))

    # ------------------------------------------------------------------ training (a strategy)
    objective: str | None = None
    """The `mmalign.algorithms.flow_objectives` name this policy trains with (``algorithm.objective``, set by
    `setup`); None: the policy-gradient path (log-probs of SDE steps)."""
    training: flow_training.FlowTraining = flow_training.POLICY_GRADIENT
    """How this policy trains (`mmalign.policies.flow_training`), picked by `setup`: the policy-gradient path
    (`PolicyGradientTraining`, also before `setup`) or a forward-process objective (`ForwardProcessTraining`)."""

    def setup(self, run: RunInfo) -> None:
        """Pick the training strategy from the config (`flow_training.training_for`) and set it up. The
        policy-gradient path is `DenoisingPolicy.setup`; with ``algorithm.objective`` (DiffusionNFT, AWM,
        Flow-DPO, ...) rollouts keep only clean latents, one action per training sigma, and the old-policy EMA
        (``algorithm.old_policy``) and the EMA of the weights (``algorithm.eval_ema``) are trainer callbacks
        (`ForwardProcessTraining`). Both paths apply ``model.gradient_checkpointing`` and
        ``rollout.batch_size`` (`setup_common`)."""
        self.training = flow_training.training_for(run.cfg, world=run.world)
        self.objective = self.training.objective
        self.training.setup(self, run)

    def setup_common(self, run: RunInfo) -> None:
        """What every training strategy sets up: `Policy.setup` (refuses a rollout engine), ``rollout.batch_size``
        and ``model.gradient_checkpointing``, without the policy-gradient path's refusal of ``noise_level`` 0."""
        Policy.setup(self, run)
        self._setup_memory(run)

    def callbacks(self) -> list[Any]:
        """The strategy's trainer callbacks: a forward-process objective's old-policy EMA (``algorithm.old_policy``)
        and EMA of the weights (``algorithm.eval_ema``), those that are set; else none."""
        return self.training.callbacks()

    def rollout(self, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool = True) -> Rollout:
        """The strategy's rollout: SDE steps with log-probs (`DenoisingPolicy.rollout`), or, with an objective,
        clean latents only, sampled in chunks of whole groups of at most ``rollout_batch_size`` samples."""
        return self.training.rollout(self, rows, group_size, compute_logp=compute_logp)

    def action_stats(self, rollout: Rollout, *, actions: Tensor | None = None) -> ActionStats:
        """The strategy's statistics of the actions `actions` (a chunk of `action_chunks`; None: all): the
        stored SDE steps' log-probs (`DenoisingPolicy.action_stats`), or the objective's per-action loss on the
        forward process of the clean latents (`ForwardProcessTraining.action_stats`)."""
        return self.training.action_stats(self, rollout, actions=actions)

    def action_chunks(self, rollout: Rollout) -> list[Tensor] | None:
        """The strategy's chunks: ``steps_per_backward`` trained steps (`DenoisingPolicy.action_chunks`), or one
        training sigma per backward with an objective."""
        return self.training.action_chunks(self, rollout)

    def export_weights(self) -> contextlib.AbstractContextManager[None]:
        """The weights `save` writes, swapped in for the block: the EMA of the weights when a forward-process
        objective keeps one (``algorithm.eval_ema``), as DiffusionNFT and Flow-Factory save their EMA; the
        trained weights otherwise (they always stay in the run's checkpoints)."""
        return self.training.export_weights()

    def save(self, path: str | Path) -> None:
        """Write every component to `path` (loadable by `from_pretrained`); under LoRA the adapter is merged
        into a copy of the transformer and also saved alone in ``transformer_lora/``. The weights are
        `export_weights`'."""
        path = Path(path)
        with self.export_weights():
            self.components.save_pretrained(path, transformer=self._denoiser_to_save(path, "transformer"))
