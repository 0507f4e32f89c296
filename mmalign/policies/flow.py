"""Flow-matching diffusion policy (SD3 / SD3.5-style): one action = one stochastic denoising step.

- The rollout and re-scoring loops, the prompt-embedding cache, the initial noise, the trained-step
  selection (windows included) and the KL are `mmalign.policies.denoising.DenoisingPolicy`'s; this class
  overrides its hooks: `encode_conditioning` (prompt states + pooled projections), `schedule` (sigmas),
  `predict` (the velocity, CFG included), `step` (the step kind) and `ode_step` (Euler). It samples from
  sigma = 1 to 0 over the scheduler's `num_steps` sigmas; the settings are a
  `mmalign.policies.denoising.SamplerSettings` (``sampler=``, or its fields as keywords).
- **Sigma schedule** (`sigmas`): SD3 / SD3.5 use the schedule of diffusers' ``StableDiffusion3Pipeline``
  (and Flow-GRPO): ``scheduler.set_timesteps(num_steps)`` with no explicit sigmas, i.e. timesteps evenly
  spaced between the scheduler's sigma_max and sigma_min, then shifted. At 10 steps and shift 3 the
  last stochastic step runs 0.0089 -> 0. (`FluxPolicy` overrides this with Flux's
  shift(linspace(1, 1/n, n)) and its resolution-dependent shift.)
- **Step kinds** (``sde_kind``, dispatched through `mmalign.sde.step`): ``flow_sde`` (Flow-GRPO, the
  default), ``cps`` (coefficients-preserving sampling) and ``dance`` (DanceGRPO). ``noise_level`` is
  each kind's noise knob: the noise level a of ``flow_sde`` (a > 0) and ``cps`` (a in (0, 1]), the eta
  of ``dance`` (eta > 0). ``cps_log_prob`` chooses how a CPS step is scored: ``squared_error`` (default,
  Flow-GRPO's -mean((x' - mu)^2)) or ``gaussian`` (the full log-density; see `mmalign.sde`).
- **Zero-std steps.** A step whose std is 0 has no log-density (`mmalign.sde` raises on it): CPS's final
  step to sigma' = 0 (std = sigma' sin(a pi / 2) = 0). Such steps always run as deterministic Euler ODE
  steps x + v dt (for CPS the same as its mean at sigma' = 0, x - sigma v = x0_hat) and are never trained:
  they are left out of the trainable set of every mode below (`stochastic_steps` lists the others; a
  window must fit inside them). ``flow_sde`` and ``dance`` have std > 0 on every step.
- **Trained steps** (the T actions of a sample), one of:
  - ``train_fraction`` < 1: a random subset per sample of ceil(train_fraction * S) of the S stochastic
    steps is trained; the other stochastic steps still run as SDE steps (they explore, untrained).
  - ``window_size`` with ``window_mode="random"`` (Flow-GRPO-Fast): a window of ``window_size``
    consecutive SDE steps whose start is drawn uniformly in ``window_range`` (default: every start that
    fits) at each rollout, the same for the whole batch; deterministic Euler ODE steps outside it.
  - ``window_size`` with ``window_mode="sliding"`` (MixGRPO): the same window, but its start follows
    `mmalign.schedules.SlidingWindow`: it begins at ``window_range[0]`` (default 0, high noise), moves by
    ``window_stride`` toward low noise every ``window_shift_every`` training steps up to
    ``window_range[1]`` (default the last start that fits) and restarts at the first position after the
    last. The trainer tells the policy the step with `on_train_step` before each rollout (the step is
    restored from checkpoints, so this is resume-safe).
  - otherwise every stochastic step is trained.
- **Classifier-free guidance** with ``guidance_scale`` > 1 (negative prompt = empty prompt) in sampling.
  ``train_guidance=True`` (default): `action_stats`, the reference and the recorded ``logp_old`` all use the
  same CFG velocity v_u + w (v_c - v_u), so the log-probs are those of the sampling policy.
  ``train_guidance=False`` (**"CFG-free training"**, our design): samples are still drawn with the CFG
  mean, but every log-prob -- ``logp_old`` recorded in `rollout`, `action_stats`, the reference and its KL --
  uses the *conditional* velocity v_c alone: log N(x_{t+1}; mu(v_c), std^2) of the stored transition.
  In `rollout` v_c is the conditional half of the very forward pass that gave the CFG velocity (no extra
  forward), so with unchanged weights exp(logp - logp_old) = 1 at init, as for every other mode. This
  trains the conditional network directly (inference then needs no CFG, or less); the "ratio" is a ratio
  of conditional-branch densities of samples drawn by the CFG policy, i.e. an off-policy surrogate. The
  conditional density of a CFG sample is low (the CFG shift mu_cfg - mu_c enters its quadratic term), so
  the log-probs are far below those of ``train_guidance=True``. With ``guidance_scale`` <= 1 the option
  has no effect.
- The payload stores, for each trained step j of each sample, x_t (``latents``), x_{t+1}
  (``next_latents``), sigma and sigma' and the step index, plus the prompt embeddings; `action_stats`
  re-scores the stored transitions with grad (``prev_sample`` = stored x_{t+1}) so with unchanged
  weights exp(logp - logp_old) = 1.
- KL (optional, ``need_reference``): per step ||mu_theta - mu_ref||^2 / (2 sigma_t^2) averaged over
  the latent dims, sigma_t the step's noise scale without the sqrt(|dt|) factor (`StepOutput.kl_std`), as
  Flow-GRPO computes it. The reference is the same transformer with its LoRA
  adapter disabled under LoRA (``lora.enabled``), else a frozen copy.
- Text encoders: `mmalign.policies.sd3_components.SD3Components` -- the real SD3 / SD3.5 layout (two
  CLIPs + optional T5, prompt embeddings exactly as diffusers' ``StableDiffusion3Pipeline``;
  ``max_sequence_length`` is the T5 length, default 256) or the tiny single-CLIP layout. `save` writes
  every component.
- `seed` seeds a CPU generator for initial noise, random windows / subsets and (on CPU) the SDE noise;
  on an accelerator the SDE noise uses the global RNG.

Flux: FLUX.1 (dev / schnell) is served by `mmalign.policies.flux.FluxPolicy`, a subclass that keeps the
step kinds, trained-step selection, payload, scoring, KL and LoRA of this class and overrides only what
Flux changes: `predict` (2x2-packed latents with ``img_ids``/``txt_ids``, timestep as sigma, FLUX.1-dev's
distilled ``guidance`` embedding instead of two-branch CFG), the prompt encoding (T5 states + pooled CLIP),
`latent_shape` (``in_channels / 4`` channels), the resolution-dependent sigma shift (``mu``) and loading /
saving of the Flux folder layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign import sde
from mmalign.config import LoraConfig
from mmalign.policies.base import torch_dtype
from mmalign.policies.denoising import (
    CPS_LOG_PROBS,
    FLOW_SDE_KINDS,
    WINDOW_MODES,
    DenoisingPolicy,
    SamplerSettings,
    add_lora,
)

__all__ = ["CPS_LOG_PROBS", "LORA_TARGETS", "SDE_KINDS", "WINDOW_MODES", "FlowPolicy", "calculate_mu"]

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
"""Attention projections of SD3 joint blocks (the usual Flow-GRPO LoRA targets)."""

SDE_KINDS = FLOW_SDE_KINDS
"""Step kinds a FlowPolicy samples with (`mmalign.sde` functions of the flow-matching convention)."""


def calculate_mu(image_seq_len: int, scheduler_config: Any, *, default_max_shift: float = 1.15) -> float:
    """The dynamic-shift parameter mu for `image_seq_len` latent tokens: linear in the token count through
    (``base_image_seq_len``, ``base_shift``) and (``max_image_seq_len``, ``max_shift``) of the scheduler
    config, with diffusers' defaults 256 -> 0.5 and 4096 -> `default_max_shift` where a key is missing
    (FluxPipeline: 1.15, StableDiffusion3Pipeline: 1.16)."""
    get = scheduler_config.get
    n0, n1 = get("base_image_seq_len", 256), get("max_image_seq_len", 4096)
    s0, s1 = get("base_shift", 0.5), get("max_shift", default_max_shift)
    slope = (s1 - s0) / (n1 - n0)
    return image_seq_len * slope + (s0 - slope * n0)  # (this operation order matches the pipelines' bitwise)


class FlowPolicy(DenoisingPolicy):
    """An SD3-style flow-matching transformer as a GRPO policy. See the module docstring."""

    conditioning_keys = ("prompt_embeds", "pooled_embeds")
    schedule_keys = ("sigmas", "sigmas_next", "sigma_max_fallback")

    def __init__(
        self,
        transformer: torch.nn.Module,
        vae: torch.nn.Module,
        scheduler: Any,
        text_encoder: torch.nn.Module,
        tokenizer: Any,
        *,
        sampler: SamplerSettings | None = None,
        latent_size: int | None = None,
        need_reference: bool = False,
        lora: bool = False,
        text_encoder_2: torch.nn.Module | None = None,
        tokenizer_2: Any = None,
        text_encoder_3: torch.nn.Module | None = None,
        tokenizer_3: Any = None,
        max_sequence_length: int = 256,
        **sampler_kwargs: Any,
    ) -> None:
        """`sampler`: the `SamplerSettings` (or give its fields as keywords: ``num_steps``, ``noise_level``,
        ``sde_kind``, ``window_size`` ...); its ``sde_kind`` must be a flow kind (`FLOW_SDE_KINDS`)."""
        from mmalign.policies.sd3_components import SD3Components

        sampler = self._settings(sampler, sampler_kwargs)
        if sampler.sde_kind not in FLOW_SDE_KINDS:
            raise ValueError(
                f"{type(self).__name__} samples with sde_kind {', '.join(FLOW_SDE_KINDS)}; got {sampler.sde_kind!r}"
            )
        self._init_denoising(
            transformer, vae, sampler, latent_size=latent_size, need_reference=need_reference, lora=lora
        )
        self.scheduler = scheduler
        self.components = SD3Components(
            transformer,
            self.vae,
            scheduler,
            text_encoder,
            tokenizer,
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer_2,
            text_encoder_3=text_encoder_3,
            tokenizer_3=tokenizer_3,
        )
        for enc in self.components.text_encoders():
            enc.eval().requires_grad_(False)
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.max_sequence_length = max_sequence_length

        self.stochastic_steps = self._stochastic_steps(self.sigmas())
        """Step indices whose std is > 0 (the only ones that can be trained), ascending."""
        n_sto = len(self.stochastic_steps)
        if n_sto == 0:
            raise ValueError(
                f"{self.sde_kind} with num_steps={self.num_steps} has no stochastic step to train"
            )
        if self.stochastic_steps != list(range(n_sto)):  # windows index into a contiguous prefix
            raise ValueError(
                f"the stochastic steps of {self.sde_kind} are not a prefix: {self.stochastic_steps}"
            )
        self._init_trained_steps()

    # ------------------------------------------------------------------ building
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        *,
        dtype: str = "float32",
        lora: LoraConfig | None = None,
        load_t5: bool = True,
        **kwargs: Any,
    ) -> FlowPolicy:
        """Load an SD3-style pipeline folder (see `mmalign.policies.sd3_components.load_sd3_components`;
        ``load_t5=False`` skips an SD3 folder's T5, whose prompt states are then zeros); with
        ``lora.enabled`` the transformer gets a peft LoRA adapter (diffusers ``add_adapter``) and only the
        adapter trains; the reference is then the same transformer with the adapter disabled. Other kwargs
        go to the constructor."""
        from mmalign.policies.sd3_components import load_sd3_components

        c = load_sd3_components(name_or_path, dtype=torch_dtype(dtype), load_t5=load_t5)
        use_lora = add_lora(c.transformer, lora, LORA_TARGETS)
        return cls(
            c.transformer,
            c.vae,
            c.scheduler,
            c.text_encoder,
            c.tokenizer,
            lora=use_lora,
            text_encoder_2=c.text_encoder_2,
            tokenizer_2=c.tokenizer_2,
            text_encoder_3=c.text_encoder_3,
            tokenizer_3=c.tokenizer_3,
            **kwargs,
        )

    # ------------------------------------------------------------------ prompts and sigmas
    def encode_conditioning(self, prompts: list[str]) -> dict[str, Tensor]:
        pe, po = self.components.encode_prompt(
            prompts, self.device, max_sequence_length=self.max_sequence_length
        )
        return {"prompt_embeds": pe, "pooled_embeds": po}

    def encode_prompt(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(prompt_embeds [B,L,D], pooled [B,P]) in fp32 on the policy's device; each distinct prompt once."""
        cond = self.conditioning(prompts)
        return cond["prompt_embeds"], cond["pooled_embeds"]

    def sigmas(self) -> Tensor:
        """Float[num_steps + 1]: the scheduler's (shifted) sigmas from 1 down to 0, fp32 on CPU, as diffusers'
        ``StableDiffusion3Pipeline`` sets them: ``set_timesteps(num_steps)`` without explicit sigmas."""
        if self.scheduler.config.get(
            "use_dynamic_shifting", False
        ):  # as the SD3 pipeline: mu from the token count
            patch = int(getattr(self.model.config, "patch_size", 1) or 1)
            mu = calculate_mu((self.latent_size // patch) ** 2, self.scheduler.config, default_max_shift=1.16)
            self.scheduler.set_timesteps(self.num_steps, mu=mu)
        else:
            self.scheduler.set_timesteps(self.num_steps)
        return self.scheduler.sigmas.detach().to("cpu", torch.float32)

    def schedule(self) -> dict[str, Tensor]:
        """sigma and sigma' of every step, and the sigma_max fallback of ``flow_sde`` (sigmas[1])."""
        sig = self.sigmas()
        fallback = float(sig[1]) if self.num_steps > 1 else 0.5
        return {"sigmas": sig[:-1], "sigmas_next": sig[1:], "sigma_max_fallback": torch.tensor(fallback)}

    def _stochastic_steps(self, sig: Tensor) -> list[int]:
        """Step indices whose std is > 0 under `sde_kind` (CPS: std = sigma' sin(a pi/2) is 0 at sigma' = 0;
        flow_sde and dance: std > 0 whenever sigma' < sigma)."""
        if self.sde_kind == "cps":
            return [i for i in range(self.num_steps) if float(sig[i + 1]) > 0]
        return list(range(self.num_steps))

    def _num_trainable_steps(self) -> int:
        return len(self.stochastic_steps)  # the stochastic steps are 0 .. n-1

    # ------------------------------------------------------------------ model and step
    def predict(
        self,
        model: torch.nn.Module,
        latents: Tensor,
        sched: dict[str, Tensor],
        cond: dict[str, Tensor],
        *,
        guided: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """(velocity, conditional velocity), fp32, at latents [B,...] and per-sample ``sched["sigmas"]`` [B].
        With `guided` and ``guidance_scale`` > 1 one batched forward of both branches gives the CFG velocity
        v_u + w (v_c - v_u) and v_c; otherwise one conditional forward gives v_c twice."""
        dtype = next(model.parameters()).dtype
        t = sched["sigmas"] * float(self.scheduler.config.num_train_timesteps)
        use_cfg = guided and self.guidance_scale > 1.0
        x_in = latents
        if use_cfg:
            cond = self._cfg_inputs(cond, latents.shape[0])
            x_in, t = torch.cat([latents, latents]), torch.cat([t, t])
        v = model(
            hidden_states=x_in.to(dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            pooled_projections=cond["pooled_embeds"].to(dtype),
            timestep=t.to(dtype),
            return_dict=False,
        )[0].float()
        return self._cfg_combine(v) if use_cfg else (v, v)

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

    def ode_step(self, prediction: Tensor, latents: Tensor, sched: dict[str, Tensor]) -> Tensor:
        """The Euler step x + v dt (outside a window; CPS's zero-std final step)."""
        dt = sched["sigmas_next"] - sched["sigmas"]
        return latents + prediction * dt.view(-1, *([1] * (latents.ndim - 1)))

    def save(self, path: str | Path) -> None:
        """Write the whole pipeline folder, every component (loadable by `FlowPolicy.from_pretrained` /
        per-component; the SD3 layout also by diffusers' ``StableDiffusion3Pipeline.from_pretrained``).
        Under LoRA the adapter is merged into a copy of the transformer, and also saved on its own in
        ``transformer_lora/`` (diffusers ``save_lora_adapter``)."""
        path = Path(path)
        self.components.save_pretrained(path, transformer=self._denoiser_to_save(path, "transformer"))
