"""DDIM diffusion policy (DDPO-style) for `UNet2DConditionModel` pipelines (Stable Diffusion 1.x / 2.x):
one action = one stochastic DDIM step (eta > 0).

- `rollout` encodes each distinct prompt once (the text encoder's last hidden states over max-length
  padded ids, as `StableDiffusionPipeline`), draws initial latents (optionally the same noise for every
  member of a group) and runs the scheduler's DDIM timesteps for `num_steps` (``set_timesteps``), each
  step from alpha-bar_t to alpha-bar_prev exactly as ``DDIMScheduler.step`` does (prev = t -
  num_train_timesteps // num_steps, below 0 the scheduler's ``final_alpha_cumprod``). Stochastic steps
  are DDPO DDIM steps (`mmalign.sde.step("ddim", ...)`, std_t = eta sqrt((1-ab_prev)/(1-ab_t))
  sqrt(1-ab_t/ab_prev)).
- A step whose std is 0 has no log-density and is never trained: with ``set_alpha_to_one`` the last step
  goes to alpha-bar_prev = 1 (a clean sample) and is always run as a deterministic (eta = 0) DDIM update.
  With ``set_alpha_to_one`` False (SD 1.5's own config) the last step ends at alpha-bar_0 < 1 and is an
  ordinary stochastic, trainable step.
- Trained steps: all stochastic steps; a random subset per sample (`train_fraction` < 1; the rest still
  explore with eta); or a window of `window_size` consecutive stochastic steps whose start is random in
  `window_range`, with deterministic eta = 0 DDIM steps outside it (Flow-GRPO-Fast style).
- Model outputs are turned into eps in fp32 before the step: ``prediction_type`` "epsilon" as is,
  "v_prediction" (SD 2.x) as eps = sqrt(ab_t) v + sqrt(1-ab_t) x, "sample" as eps = (x - sqrt(ab_t) x0) /
  sqrt(1-ab_t). ``clip_sample`` and ``thresholding`` schedulers are refused (SD ships neither).
- Classifier-free guidance with `guidance_scale` > 1 (negative prompt = empty prompt) on the raw model
  output, the same in sampling and in `evaluate`, so the log-probs agree.
- The payload stores, for each trained step j of each sample, x_t (``latents``), x_{t-1}
  (``next_latents``), the step index, the UNet timestep and both alpha-bars, plus the prompt embeddings;
  `evaluate` re-scores the stored transitions with grad (``prev_sample`` = stored x_{t-1}) so with
  unchanged weights exp(logp - logp_old) = 1.
- KL (optional, ``need_reference``): per step ||mu_theta - mu_ref||^2 / (2 std_t^2) averaged over the
  latent dims. The reference is the same UNet with its LoRA adapter disabled under LoRA
  (``lora.enabled``), else a frozen copy.
- `seed` seeds a CPU generator for initial noise and (on CPU) the step noise; on an accelerator the
  step noise uses the global RNG.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign import sde
from mmalign.batch import Rollout
from mmalign.config import LoraConfig
from mmalign.policies.denoising import DenoisingPolicy, add_lora, mean_kl

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
"""Attention projections of the UNet's transformer blocks (the usual DDPO LoRA targets)."""

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _bshape(t: Tensor, ref: Tensor) -> Tensor:
    """A per-sample [B] coefficient shaped [B, 1, ..., 1] to broadcast over `ref`."""
    return t.to(device=ref.device, dtype=torch.float32).view(-1, *([1] * (ref.ndim - 1)))


class DDIMPolicy(DenoisingPolicy):
    """A Stable Diffusion 1.x/2.x UNet with DDIM sampling as a GRPO policy. See the module docstring."""

    def __init__(
        self,
        unet: torch.nn.Module,
        vae: torch.nn.Module,
        scheduler: Any,
        text_encoder: torch.nn.Module,
        tokenizer: Any,
        *,
        num_steps: int = 10,
        eta: float = 1.0,
        guidance_scale: float = 1.0,
        latent_size: int | None = None,
        same_initial_noise: bool = False,
        train_fraction: float = 1.0,
        window_size: int | None = None,
        window_range: tuple[int, int] | None = None,
        seed: int | None = None,
        need_reference: bool = False,
        lora: bool = False,
    ) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if num_steps > int(scheduler.config.num_train_timesteps):
            raise ValueError(
                f"num_steps={num_steps} exceeds the scheduler's num_train_timesteps "
                f"({scheduler.config.num_train_timesteps})"
            )
        if not 0 < eta <= 1:
            raise ValueError(
                f"eta must be in (0, 1] (eta = 0 is deterministic DDIM, nothing to train), got {eta}"
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
            unet,
            vae,
            latent_size=latent_size,
            same_initial_noise=same_initial_noise,
            train_fraction=train_fraction,
            window_size=window_size,
            window_range=window_range,
            seed=seed,
            need_reference=need_reference,
            lora=lora,
        )
        self.scheduler = scheduler
        self.text_encoder = text_encoder.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.num_steps = num_steps
        self.eta = float(eta)
        self.guidance_scale = guidance_scale
        self._embed_cache: dict[str, Tensor] = {}

        timesteps, ab, ab_prev = self.schedule()
        std = self.eta * torch.sqrt((1 - ab_prev) / (1 - ab)) * torch.sqrt(1 - ab / ab_prev)
        stochastic = (std > 0).tolist()
        self.num_sde_steps = sum(stochastic)
        """How many steps have std > 0 (trainable, first in order; a last step to ab = 1 has none)."""
        if stochastic != [True] * self.num_sde_steps + [False] * (num_steps - self.num_sde_steps):
            raise ValueError(f"only a final step may be deterministic, got step stds {std.tolist()}")
        if self.num_sde_steps == 0:
            raise ValueError(
                "no step has std > 0 (num_steps=1 with set_alpha_to_one=True goes straight to a clean "
                "sample): nothing to train; use more steps"
            )
        if window_size is not None and not 1 <= window_size <= self.num_sde_steps:
            raise ValueError(
                f"window_size must be in [1, {self.num_sde_steps}] (the stochastic steps of "
                f"num_steps={num_steps}), "
                f"got {window_size}"
            )

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
        """Load an SD 1.x/2.x pipeline folder (see `mmalign.tiny_ddim.load_sd15_components`); with
        ``lora.enabled`` the UNet gets a peft LoRA adapter (diffusers ``add_adapter``) and only the
        adapter trains; the reference is then the same UNet with the adapter disabled."""
        from mmalign.tiny_ddim import load_sd15_components

        c = load_sd15_components(name_or_path, dtype=_DTYPES[dtype])
        use_lora = add_lora(c.unet, lora, LORA_TARGETS)
        return cls(c.unet, c.vae, c.scheduler, c.text_encoder, c.tokenizer, lora=use_lora, **kwargs)

    # ------------------------------------------------------------------ prompts and schedule
    def encode_prompt(self, prompts: list[str]) -> Tensor:
        """Prompt embeddings [B,L,D] in fp32 on the policy's device; each distinct prompt encoded once."""
        from mmalign.tiny_ddim import encode_prompt

        missing = list(dict.fromkeys(p for p in prompts if p not in self._embed_cache))
        if missing:
            pe = encode_prompt(self.text_encoder, self.tokenizer, missing, device=self.device)
            for i, p in enumerate(missing):
                if len(self._embed_cache) < 10_000:
                    self._embed_cache[p] = pe[i].float()
        if any(p not in self._embed_cache for p in prompts):  # cache full: encode directly
            return encode_prompt(self.text_encoder, self.tokenizer, prompts, device=self.device).float()
        return torch.stack([self._embed_cache[p] for p in prompts])

    def schedule(self) -> tuple[Tensor, Tensor, Tensor]:
        """(timesteps Long[n], alpha_bar Float[n], alpha_bar_prev Float[n]) of the `num_steps` DDIM steps,
        fp32 on CPU, as ``DDIMScheduler.step`` computes them (prev = t - num_train_timesteps // n; below
        0 the scheduler's ``final_alpha_cumprod``: 1 with ``set_alpha_to_one``, else alpha-bar_0)."""
        self.scheduler.set_timesteps(self.num_steps)
        timesteps = self.scheduler.timesteps.detach().to("cpu", torch.long)
        acp = self.scheduler.alphas_cumprod.detach().to("cpu", torch.float32)
        final = torch.as_tensor(self.scheduler.final_alpha_cumprod, dtype=torch.float32).reshape(())
        prev = timesteps - int(self.scheduler.config.num_train_timesteps) // self.num_steps
        ab = acp[timesteps]
        ab_prev = torch.where(prev >= 0, acp[prev.clamp_min(0)], final)
        return timesteps, ab, ab_prev

    def _num_trainable_steps(self) -> int:
        return self.num_sde_steps

    # ------------------------------------------------------------------ model
    def _eps(self, model: torch.nn.Module, x: Tensor, t: Tensor, ab: Tensor, pe: Tensor) -> Tensor:
        """Predicted noise eps (fp32) at latents x [B,...], UNet timesteps t Long[B] and alpha-bars ab [B],
        with CFG when enabled (on the raw model output) and the prediction type converted to eps."""
        dtype = next(model.parameters()).dtype
        if self.guidance_scale > 1.0:
            npe = self.encode_prompt([""])
            b = x.shape[0]
            pe = torch.cat([npe.expand(b, -1, -1), pe])
            x_in, t_in = torch.cat([x, x]), torch.cat([t, t])
        else:
            x_in, t_in = x, t
        out = model(x_in.to(dtype), t_in, encoder_hidden_states=pe.to(dtype), return_dict=False)[0].float()
        if self.guidance_scale > 1.0:
            o_u, o_c = out.chunk(2)
            out = o_u + self.guidance_scale * (o_c - o_u)
        kind = self.scheduler.config.prediction_type
        if kind == "epsilon":
            return out
        a = _bshape(ab, x)
        x32 = x.float()
        if kind == "v_prediction":
            return torch.sqrt(a) * out + torch.sqrt(1 - a) * x32
        return (x32 - torch.sqrt(a) * out) / torch.sqrt(1 - a)  # "sample"

    @staticmethod
    def _deterministic_step(eps: Tensor, x: Tensor, ab: Tensor, ab_prev: Tensor) -> Tensor:
        """The eta = 0 DDIM update sqrt(ab_prev) x0_hat + sqrt(1 - ab_prev) eps (fp32), no density."""
        a, ap = _bshape(ab, x), _bshape(ab_prev, x)
        x0 = (x.float() - torch.sqrt(1 - a) * eps) / torch.sqrt(a)
        return torch.sqrt(ap) * x0 + torch.sqrt(1 - ap) * eps

    # ------------------------------------------------------------------ rollout
    @torch.no_grad()
    def rollout(self, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool = True) -> Rollout:
        """Sample `group_size` images (latents) for each row's ``prompt`` (see `Policy.rollout`)."""
        prompts = [str(r["prompt"]) for r in rows for _ in range(group_size)]
        group = torch.arange(len(rows)).repeat_interleave(group_size)
        columns = {key: [r.get(key) for r in rows for _ in range(group_size)] for key in rows[0]}
        b = len(prompts)
        pe = self.encode_prompt(prompts)
        timesteps, ab_all, abp_all = self.schedule()
        steps = self._trained_steps(b)
        t = steps.shape[1]
        window = set(steps[0].tolist()) if self.window_size is not None else None
        dev = self.device

        x = self._initial_noise(group)
        lat = torch.zeros((b, t, *x.shape[1:]), device=dev)
        nxt = torch.zeros_like(lat)
        logp = torch.zeros((b, t), device=dev)
        steps_d = steps.to(dev)
        was_training = self.model.training
        self.model.eval()
        for i in range(self.num_steps):
            ts = timesteps[i].expand(b).to(dev)
            ab, abp = ab_all[i].expand(b).to(dev), abp_all[i].expand(b).to(dev)
            eps = self._eps(self.model, x, ts, ab, pe)
            if i >= self.num_sde_steps or (window is not None and i not in window):
                x_new = self._deterministic_step(eps, x, ab, abp)
            else:
                out = sde.step(
                    "ddim",
                    eps,
                    x,
                    ab,
                    abp,
                    eta=self.eta,
                    generator=self.generator if dev.type == "cpu" else None,
                )
                x_new = out.sample
                hit = steps_d == i
                rows_hit = hit.any(dim=1)
                if bool(rows_hit.any()):
                    lat[hit] = x.float()[rows_hit]
                    nxt[hit] = x_new[rows_hit]
                    logp[hit] = out.log_prob[rows_hit]
            x = x_new
        if was_training:
            self.model.train()
        rollout = Rollout(
            group=group,
            mask=torch.ones((b, t), dtype=torch.bool),
            prompts=prompts,
            columns=columns,
            outputs={"latents": x.cpu()},
            payload={
                "latents": lat.cpu(),
                "next_latents": nxt.cpu(),
                "step_index": steps,
                "timesteps": timesteps[steps],
                "alpha_bar": ab_all[steps],
                "alpha_bar_prev": abp_all[steps],
                "prompt_embeds": pe.cpu(),
            },
        )
        if compute_logp:
            rollout.logp_old = logp.cpu()
        return rollout

    # ------------------------------------------------------------------ log-probs
    def _score(
        self, model: torch.nn.Module, rollout: Rollout, *, grad: bool, with_kl: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """(logp Float[B,T], kl Float[B,T] or None) of the stored transitions under `model`."""
        p = {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in rollout.payload.items()}
        pe = p["prompt_embeds"]
        logps, kls = [], []
        for j in range(rollout.num_actions):
            x, ts = p["latents"][:, j], p["timesteps"][:, j]
            ab, abp = p["alpha_bar"][:, j], p["alpha_bar_prev"][:, j]
            with torch.set_grad_enabled(grad):
                eps = self._eps(model, x, ts, ab, pe)
                out = sde.step("ddim", eps, x, ab, abp, eta=self.eta, prev_sample=p["next_latents"][:, j])
            logps.append(out.log_prob)
            if with_kl:
                with torch.no_grad(), self._reference() as ref:
                    eps_ref = self._eps(ref, x, ts, ab, pe)
                    ref_mean = sde.step(
                        "ddim", eps_ref, x, ab, abp, eta=self.eta, prev_sample=p["next_latents"][:, j]
                    ).mean
                kls.append(mean_kl(out.mean, ref_mean, out.kl_std))
        logp = torch.stack(logps, dim=1)
        kl = torch.stack(kls, dim=1) if with_kl else None
        return logp, kl

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
