"""DDIM diffusion policy (DDPO-style) for `UNet2DConditionModel` pipelines (Stable Diffusion 1.x / 2.x):
one action = one stochastic DDIM step (eta > 0).

The rollout and re-scoring loops, trained-step selection, initial noise and the KL are
`mmalign.policies.denoising.DenoisingPolicy`'s (settings: `SamplerSettings` with ``sde_kind: ddim`` and
``noise_level`` = eta); this class overrides its hooks: `encode_conditioning` (as `StableDiffusionPipeline`),
`schedule` (the scheduler's DDIM timesteps and alpha-bars, as ``DDIMScheduler.step``), `predict` (eps, CFG
included, from any ``prediction_type``), `step` (`mmalign.algorithms.sde.step("ddim", ...)`) and `ode_step`
(the eta = 0 update, also the last step under ``set_alpha_to_one``). Formulas and details: docs/algorithms.md,
"Sigma schedules" (``DDIMPolicy``), "Guidance" and "Denoising steps with log-prob".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.algorithms import sde
from mmalign.config import LoraConfig
from mmalign.policies.base import torch_dtype
from mmalign.policies.denoising import DenoisingPolicy, SamplerSettings, add_lora

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
"""Attention projections of the UNet's transformer blocks (the usual DDPO LoRA targets)."""

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")


def _bshape(t: Tensor, ref: Tensor) -> Tensor:
    """A per-sample [B] coefficient shaped [B, 1, ..., 1] to broadcast over `ref`."""
    return t.to(device=ref.device, dtype=torch.float32).view(-1, *([1] * (ref.ndim - 1)))


class DDIMPolicy(DenoisingPolicy):
    """A Stable Diffusion 1.x/2.x UNet with DDIM sampling as a GRPO policy. See the module docstring."""

    noise_level_key = "options.eta"
    conditioning_keys = ("prompt_embeds",)
    schedule_keys = ("timesteps", "alpha_bar", "alpha_bar_prev")

    def __init__(
        self,
        unet: torch.nn.Module,
        vae: torch.nn.Module,
        scheduler: Any,
        text_encoder: torch.nn.Module,
        tokenizer: Any,
        *,
        sampler: SamplerSettings | None = None,
        eta: float | None = None,
        latent_size: int | None = None,
        need_reference: bool = False,
        lora: bool = False,
        **sampler_kwargs: Any,
    ) -> None:
        """`sampler`: `SamplerSettings` with ``sde_kind="ddim"`` (``noise_level`` is eta), or ``eta`` (default
        1) and the other fields as keywords."""
        if sampler is not None and eta is not None:
            raise TypeError("give eta as the sampler's noise_level, not both sampler= and eta=")
        sampler = self._settings(
            sampler, sampler_kwargs, sde_kind="ddim", noise_level=1.0 if eta is None else eta
        )
        if sampler.sde_kind != "ddim":
            raise ValueError(
                f"DDIMPolicy samples DDIM steps: sde_kind must be 'ddim', got {sampler.sde_kind!r}"
            )
        if sampler.num_steps > int(scheduler.config.num_train_timesteps):
            raise ValueError(
                f"num_steps={sampler.num_steps} exceeds the scheduler's num_train_timesteps "
                f"({scheduler.config.num_train_timesteps})"
            )
        cfg = scheduler.config
        if cfg.prediction_type not in PREDICTION_TYPES:
            raise ValueError(
                f"unsupported scheduler prediction_type {cfg.prediction_type!r}; "
                f"supported: {PREDICTION_TYPES}"
            )
        if getattr(cfg, "thresholding", False) or getattr(cfg, "clip_sample", False):
            raise ValueError(
                "schedulers with clip_sample or thresholding are not supported (the DDIM step log-prob "
                "assumes an unclipped x0 prediction); load the scheduler with clip_sample=False, "
                "thresholding=False (Stable Diffusion's own configs have both off)"
            )
        self._init_denoising(
            unet, vae, sampler, latent_size=latent_size, need_reference=need_reference, lora=lora
        )
        self.scheduler = scheduler
        self.text_encoder = text_encoder.eval().requires_grad_(False)
        self.tokenizer = tokenizer

        sched = self.schedule()
        ab, ab_prev = sched["alpha_bar"], sched["alpha_bar_prev"]
        # which steps have noise at eta > 0 (eta = 0, the ODE for sampling / eval, keeps the same structure)
        std = torch.sqrt((1 - ab_prev) / (1 - ab)) * torch.sqrt(1 - ab / ab_prev)
        stochastic = (std > 0).tolist()
        self.num_sde_steps = sum(stochastic)
        """How many steps have std > 0 (trainable, first in order; a last step to ab = 1 has none)."""
        if stochastic != [True] * self.num_sde_steps + [False] * (self.num_steps - self.num_sde_steps):
            raise ValueError(f"only a final step may be deterministic, got step stds {std.tolist()}")
        if self.num_sde_steps == 0:
            raise ValueError(
                "no step has std > 0 (num_steps=1 with set_alpha_to_one=True goes straight to a clean "
                "sample): nothing to train; use more steps"
            )
        self._init_trained_steps()

    @property
    def eta(self) -> float:
        """The DDIM eta (the sampler's ``noise_level``)."""
        return float(self.noise_level)

    # ------------------------------------------------------------------ building
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        *,
        dtype: str = "float32",
        lora: LoraConfig | None = None,
        **kwargs: Any,
    ) -> DDIMPolicy:
        """Load an SD 1.x/2.x pipeline folder (see
        `mmalign.policies.sd15_components.load_sd15_components`); with ``lora.enabled`` the UNet gets a peft
        LoRA adapter (diffusers ``add_adapter``) and only the adapter trains; the reference is then the same
        UNet with the adapter disabled."""
        from mmalign.policies.sd15_components import load_sd15_components

        c = load_sd15_components(name_or_path, dtype=torch_dtype(dtype))
        use_lora = add_lora(c.unet, lora, LORA_TARGETS)
        return cls(c.unet, c.vae, c.scheduler, c.text_encoder, c.tokenizer, lora=use_lora, **kwargs)

    # ------------------------------------------------------------------ prompts and schedule
    def encode_conditioning(self, prompts: list[str]) -> dict[str, Tensor]:
        from mmalign.policies.sd15_components import encode_prompt

        return {
            "prompt_embeds": encode_prompt(self.text_encoder, self.tokenizer, prompts, device=self.device)
        }

    def encode_prompt(self, prompts: list[str]) -> Tensor:
        """Prompt embeddings [B,L,D] in fp32 on the policy's device; each distinct prompt encoded once."""
        return self.conditioning(prompts)["prompt_embeds"]

    def schedule(self) -> dict[str, Tensor]:
        """The UNet timestep (Long), alpha-bar and alpha-bar_prev of the `num_steps` DDIM steps, on CPU, as
        ``DDIMScheduler.step`` computes them (prev = t - num_train_timesteps // n; below 0 the scheduler's
        ``final_alpha_cumprod``: 1 with ``set_alpha_to_one``, else alpha-bar_0)."""
        self.scheduler.set_timesteps(self.num_steps)
        timesteps = self.scheduler.timesteps.detach().to("cpu", torch.long)
        acp = self.scheduler.alphas_cumprod.detach().to("cpu", torch.float32)
        final = torch.as_tensor(self.scheduler.final_alpha_cumprod, dtype=torch.float32).reshape(())
        prev = timesteps - int(self.scheduler.config.num_train_timesteps) // self.num_steps
        ab = acp[timesteps]
        ab_prev = torch.where(prev >= 0, acp[prev.clamp_min(0)], final)
        return {"timesteps": timesteps, "alpha_bar": ab, "alpha_bar_prev": ab_prev}

    def _num_trainable_steps(self) -> int:
        return self.num_sde_steps

    # ------------------------------------------------------------------ model and step
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
        """(eps, conditional eps), fp32, at latents [B,...] and the per-sample UNet timesteps and alpha-bars of
        `sched`: CFG on the raw model output when `guided` and ``guidance_scale`` > 1 (one batched call of both
        branches; with `detach_uncond` and grad enabled the unconditional branch runs on its own without a
        graph), then the prediction type converted to eps."""
        dtype = next(model.parameters()).dtype
        t, pe = sched["timesteps"], cond["prompt_embeds"]
        use_cfg = guided and self.guidance_scale > 1.0

        def unet(x: Tensor, steps: Tensor, embeds: Tensor) -> Tensor:
            return model(x.to(dtype), steps, encoder_hidden_states=embeds.to(dtype), return_dict=False)[
                0
            ].float()

        if not use_cfg:
            eps = self._to_eps(unet(latents, t, pe), latents, sched["alpha_bar"])
            return eps, eps
        if detach_uncond and torch.is_grad_enabled():
            with torch.no_grad():
                u = unet(latents, t, self._negative_inputs(cond, latents.shape[0])["prompt_embeds"])
            out_c = unet(latents, t, pe)
            out = self._guide(u, out_c)
        else:
            both = self._cfg_inputs(cond, latents.shape[0])["prompt_embeds"]
            out, out_c = self._cfg_combine(unet(torch.cat([latents, latents]), torch.cat([t, t]), both))
        ab = sched["alpha_bar"]
        return self._to_eps(out, latents, ab), self._to_eps(out_c, latents, ab)

    def _to_eps(self, out: Tensor, x: Tensor, ab: Tensor) -> Tensor:
        """The model output `out` (of ``prediction_type``) as eps at latents x and alpha-bars ab [B]."""
        kind = self.scheduler.config.prediction_type
        if kind == "epsilon":
            return out
        a = _bshape(ab, x)
        x32 = x.float()
        if kind == "v_prediction":
            return torch.sqrt(a) * out + torch.sqrt(1 - a) * x32
        return (x32 - torch.sqrt(a) * out) / torch.sqrt(1 - a)  # "sample"

    def step(
        self, prediction: Tensor, latents: Tensor, sched: dict[str, Tensor], **kw: Any
    ) -> sde.StepOutput:
        return sde.step(
            "ddim", prediction, latents, sched["alpha_bar"], sched["alpha_bar_prev"], eta=self.eta, **kw
        )

    def ode_step(self, prediction: Tensor, latents: Tensor, sched: dict[str, Tensor]) -> Tensor:
        """The eta = 0 DDIM update sqrt(ab_prev) x0_hat + sqrt(1 - ab_prev) eps (fp32), no density."""
        a, ap = _bshape(sched["alpha_bar"], latents), _bshape(sched["alpha_bar_prev"], latents)
        x0 = (latents.float() - torch.sqrt(1 - a) * prediction) / torch.sqrt(a)
        return torch.sqrt(ap) * x0 + torch.sqrt(1 - ap) * prediction

    def save(self, path: str | Path) -> None:
        """Write the whole pipeline folder (loadable by `DDIMPolicy.from_pretrained` / per-component).
        Under LoRA the adapter is merged into a copy of the UNet, and also saved on its own in
        ``unet_lora/`` (diffusers ``save_lora_adapter``)."""
        path = Path(path)
        self._denoiser_to_save(path, "unet").save_pretrained(path / "unet")
        self.vae.save_pretrained(path / "vae")
        self.scheduler.save_pretrained(path / "scheduler")
        self.text_encoder.save_pretrained(path / "text_encoder")
        self.tokenizer.save_pretrained(path / "tokenizer")
