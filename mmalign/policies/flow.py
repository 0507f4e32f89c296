"""Flow-matching diffusion policy (SD3-style): one action = one stochastic denoising step.

- `rollout` encodes each distinct prompt once, draws initial latents (optionally the same noise for
  every member of a group), and integrates from sigma = 1 to 0 over the scheduler's `num_steps`
  sigmas. Trained steps are Flow-GRPO SDE steps (`mmalign.sde.step("flow_sde", ...)`, `noise_level`
  a); untrained steps are either SDE steps too (`train_fraction` < 1: a random subset per sample is
  trained, the rest still explore) or deterministic Euler ODE steps x + v dt outside a window of
  `window_size` consecutive SDE steps whose start is random in `window_range` (Flow-GRPO-Fast).
- Classifier-free guidance with `guidance_scale` > 1 (negative prompt = empty prompt), the same
  in sampling and in `evaluate`, so the log-probs agree.
- The payload stores, for each trained step j of each sample, x_t (``latents``), x_{t+1}
  (``next_latents``), sigma and sigma' and the step index, plus the prompt embeddings; `evaluate`
  re-scores the stored transitions with grad (``prev_sample`` = stored x_{t+1}) so with unchanged
  weights exp(logp - logp_old) = 1.
- KL (optional, ``need_reference``): per step ||mu_theta - mu_ref||^2 / (2 std_t^2) averaged over
  the latent dims (std_t the step's full std). The reference is the same transformer with its LoRA
  adapter disabled under LoRA (``lora.enabled``), else a frozen copy.
- `seed` seeds a CPU generator for initial noise and (on CPU) the SDE noise; on an accelerator the
  SDE noise uses the global RNG.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmalign import sde
from mmalign.batch import Rollout
from mmalign.config import LoraConfig
from mmalign.policies.base import ActionStats

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
"""Attention projections of SD3 joint blocks (the usual Flow-GRPO LoRA targets)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FlowPolicy:
    """An SD3-style flow-matching transformer as a GRPO policy. See the module docstring."""

    def __init__(
        self,
        transformer: torch.nn.Module,
        vae: torch.nn.Module,
        scheduler: Any,
        text_encoder: torch.nn.Module,
        tokenizer: Any,
        *,
        num_steps: int = 10,
        noise_level: float = 0.7,
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
        if not 0 < train_fraction <= 1:
            raise ValueError(f"train_fraction must be in (0, 1], got {train_fraction}")
        if window_size is not None and not 1 <= window_size <= num_steps:
            raise ValueError(f"window_size must be in [1, num_steps={num_steps}], got {window_size}")
        self.model = transformer
        self.kl_in_evaluate = need_reference
        """`evaluate` returns the KL on step means itself (the trainer then skips reference log-probs)."""
        self.forward_model = transformer
        """What `evaluate` runs (the trainer may swap in a DDP-wrapped model; sampling uses `model`)."""
        self.vae = vae.eval().requires_grad_(False)
        self.scheduler = scheduler
        self.text_encoder = text_encoder.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.num_steps = num_steps
        self.noise_level = noise_level
        self.guidance_scale = guidance_scale
        self.latent_size = latent_size or int(transformer.config.sample_size)
        self.same_initial_noise = same_initial_noise
        self.train_fraction = train_fraction
        self.window_size = window_size
        self.window_range = window_range
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.lora = lora
        self.need_reference = need_reference
        self.ref_model: torch.nn.Module | None = None
        if need_reference and not lora:
            self.ref_model = copy.deepcopy(transformer).eval().requires_grad_(False)
        self._embed_cache: dict[str, tuple[Tensor, Tensor]] = {}

    # ------------------------------------------------------------------ building
    @classmethod
    def from_pretrained(
        cls, name_or_path: str | Path, *, dtype: str = "float32", lora: LoraConfig | None = None, **kwargs: Any
    ) -> FlowPolicy:
        """Load an SD3-style pipeline folder (see `mmalign.tiny_flow.load_sd3_components`); with
        ``lora.enabled`` the transformer gets a peft LoRA adapter (diffusers ``add_adapter``) and only
        the adapter trains; the reference is then the same transformer with the adapter disabled."""
        from mmalign.tiny_flow import load_sd3_components

        c = load_sd3_components(name_or_path, dtype=_DTYPES[dtype])
        use_lora = bool(lora and lora.enabled)
        if use_lora:
            from peft import LoraConfig as PeftLoraConfig

            assert lora is not None
            targets = lora.target_modules
            if targets == "all-linear":
                targets = list(LORA_TARGETS)
            c.transformer.requires_grad_(False)
            c.transformer.add_adapter(
                PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets)
            )
        return cls(c.transformer, c.vae, c.scheduler, c.text_encoder, c.tokenizer, lora=use_lora, **kwargs)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ prompts and sigmas
    def encode_prompt(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(prompt_embeds [B,L,D], pooled [B,P]) in fp32 on the policy's device; each distinct prompt once."""
        from mmalign.tiny_flow import encode_prompt

        missing = list(dict.fromkeys(p for p in prompts if p not in self._embed_cache))
        if missing:
            pe, po = encode_prompt(self.text_encoder, self.tokenizer, missing, device=self.device)
            for i, p in enumerate(missing):
                if len(self._embed_cache) < 10_000:
                    self._embed_cache[p] = (pe[i].float(), po[i].float())
        pairs = [self._embed_cache[p] if p in self._embed_cache else None for p in prompts]
        if any(x is None for x in pairs):  # cache full: encode directly
            pe, po = encode_prompt(self.text_encoder, self.tokenizer, prompts, device=self.device)
            return pe.float(), po.float()
        return torch.stack([x[0] for x in pairs]), torch.stack([x[1] for x in pairs])  # type: ignore[index]

    def sigmas(self) -> Tensor:
        """Float[num_steps + 1]: the scheduler's (shifted) sigmas from 1 down to 0, fp32 on CPU."""
        self.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / self.num_steps, self.num_steps).tolist())
        return self.scheduler.sigmas.detach().to("cpu", torch.float32)

    def _trained_steps(self, batch: int) -> Tensor:
        """Long[B, T]: the (sorted) step indices whose transitions are trained, per sample."""
        n = self.num_steps
        if self.window_size is not None:
            lo, hi = self.window_range or (0, n - self.window_size)
            hi = min(hi, n - self.window_size)
            start = int(torch.randint(lo, hi + 1, (1,), generator=self.generator))
            return torch.arange(start, start + self.window_size).expand(batch, -1).clone()
        t = max(1, math.ceil(self.train_fraction * n))
        if t == n:
            return torch.arange(n).expand(batch, -1).clone()
        perm = torch.stack([torch.randperm(n, generator=self.generator)[:t] for _ in range(batch)])
        return perm.sort(dim=1).values

    # ------------------------------------------------------------------ model
    def _velocity(self, model: torch.nn.Module, x: Tensor, sigma: Tensor, pe: Tensor, po: Tensor) -> Tensor:
        """Model velocity (fp32) at latents x [B,...] and per-sample sigma [B], with CFG when enabled."""
        dtype = next(model.parameters()).dtype
        t = sigma * float(self.scheduler.config.num_train_timesteps)
        if self.guidance_scale > 1.0:
            npe, npo = self.encode_prompt([""])
            b = x.shape[0]
            pe = torch.cat([npe.expand(b, -1, -1), pe])
            po = torch.cat([npo.expand(b, -1), po])
            x_in, t = torch.cat([x, x]), torch.cat([t, t])
        else:
            x_in = x
        v = model(
            hidden_states=x_in.to(dtype), encoder_hidden_states=pe.to(dtype), pooled_projections=po.to(dtype),
            timestep=t.to(dtype), return_dict=False,
        )[0].float()
        if self.guidance_scale > 1.0:
            v_u, v_c = v.chunk(2)
            v = v_u + self.guidance_scale * (v_c - v_u)
        return v

    def _initial_noise(self, group: Tensor) -> Tensor:
        c = int(self.model.config.in_channels)
        shape = (c, self.latent_size, self.latent_size)
        if self.same_initial_noise:
            n_groups = int(group.max()) + 1
            noise = torch.randn((n_groups, *shape), generator=self.generator)[group]
        else:
            noise = torch.randn((group.shape[0], *shape), generator=self.generator)
        return noise.to(self.device)

    # ------------------------------------------------------------------ rollout
    @torch.no_grad()
    def rollout(self, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool = True) -> Rollout:
        """Sample `group_size` images (latents) for each row's ``prompt`` (see `Policy.rollout`)."""
        prompts = [str(r["prompt"]) for r in rows for _ in range(group_size)]
        group = torch.arange(len(rows)).repeat_interleave(group_size)
        columns = {key: [r.get(key) for r in rows for _ in range(group_size)] for key in rows[0]}
        b = len(prompts)
        pe, po = self.encode_prompt(prompts)
        sig = self.sigmas().to(self.device)
        fallback = float(sig[1]) if self.num_steps > 1 else 0.5
        steps = self._trained_steps(b).to(self.device)
        t = steps.shape[1]
        window = set(steps[0].tolist()) if self.window_size is not None else None

        x = self._initial_noise(group)
        lat = torch.zeros((b, t, *x.shape[1:]), device=self.device)
        nxt = torch.zeros_like(lat)
        logp = torch.zeros((b, t), device=self.device)
        was_training = self.model.training
        self.model.eval()
        for i in range(self.num_steps):
            s = sig[i].expand(b)
            sn = sig[i + 1].expand(b)
            v = self._velocity(self.model, x, s, pe, po)
            if window is not None and i not in window:
                x_new = x + v * (sn - s).view(-1, *([1] * (x.ndim - 1)))
            else:
                out = sde.step(
                    "flow_sde", v, x, s, sn, noise_level=self.noise_level, sigma_max_fallback=fallback,
                    generator=self.generator if self.device.type == "cpu" else None,
                )
                x_new = out.sample
                hit = steps == i
                rows_hit = hit.any(dim=1)
                if bool(rows_hit.any()):
                    lat[hit] = x[rows_hit]
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
                "latents": lat.cpu(), "next_latents": nxt.cpu(), "step_index": steps.cpu(),
                "sigmas": sig[steps].cpu(), "sigmas_next": sig[steps + 1].cpu(),
                "sigma_max_fallback": torch.full((b,), fallback),
                "prompt_embeds": pe.cpu(), "pooled_embeds": po.cpu(),
            },
        )
        if compute_logp:
            rollout.logp_old = logp.cpu()
        return rollout

    @torch.no_grad()
    def decode(self, rollout: Rollout) -> Tensor:
        """Images Float[B,3,H,W] in [0, 1] from ``outputs["latents"]`` (also stored as ``outputs["images"]``)."""
        z = rollout.outputs["latents"].to(self.device)
        cfg = self.vae.config
        z = z / cfg.scaling_factor + (cfg.shift_factor or 0.0)
        img = self.vae.decode(z.to(next(self.vae.parameters()).dtype), return_dict=False)[0].float()
        img = (img / 2 + 0.5).clamp(0, 1).cpu()
        rollout.outputs["images"] = img
        return img

    # ------------------------------------------------------------------ log-probs
    def _score(self, model: torch.nn.Module, rollout: Rollout, *, grad: bool, with_kl: bool = False
               ) -> tuple[Tensor, Tensor | None]:
        """(logp Float[B,T], kl Float[B,T] or None) of the stored transitions under `model`."""
        p = {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in rollout.payload.items()}
        logps, kls = [], []
        for j in range(rollout.num_actions):
            x, s, sn = p["latents"][:, j], p["sigmas"][:, j], p["sigmas_next"][:, j]
            with torch.set_grad_enabled(grad):
                v = self._velocity(model, x, s, p["prompt_embeds"], p["pooled_embeds"])
                out = sde.step(
                    "flow_sde", v, x, s, sn, noise_level=self.noise_level,
                    sigma_max_fallback=p["sigma_max_fallback"], prev_sample=p["next_latents"][:, j],
                )
            logps.append(out.log_prob)
            if with_kl:
                with torch.no_grad(), self._reference() as ref:
                    v_ref = self._velocity(ref, x, s, p["prompt_embeds"], p["pooled_embeds"])
                    ref_mean = sde.step(
                        "flow_sde", v_ref, x, s, sn, noise_level=self.noise_level,
                        sigma_max_fallback=p["sigma_max_fallback"], prev_sample=p["next_latents"][:, j],
                    ).mean
                diff = (out.mean - ref_mean) ** 2
                std2 = (out.std**2).reshape(-1) if out.std.ndim else out.std**2
                kls.append(diff.mean(dim=tuple(range(1, diff.ndim))) / (2 * std2))
        logp = torch.stack(logps, dim=1)
        kl = torch.stack(kls, dim=1) if with_kl else None
        return logp, kl

    @contextmanager
    def _reference(self) -> Iterator[torch.nn.Module]:
        """The reference network: the adapter-disabled transformer under LoRA, else the frozen copy."""
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

    def evaluate(self, rollout: Rollout) -> ActionStats:
        """Recompute per-step log-probs with grad (and the mean-difference KL when a reference is used)."""
        logp, kl = self._score(self.forward_model, rollout, grad=True, with_kl=self.need_reference)
        return ActionStats(logp=logp, kl=kl)

    def reference_logprobs(self, rollout: Rollout) -> Tensor:
        with self._reference() as ref:
            return self._score(ref, rollout, grad=False)[0]

    # ------------------------------------------------------------------ parameters
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def trainable_state_dict(self) -> dict[str, Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def load_trainable_state_dict(self, state: dict[str, Tensor]) -> None:
        missing = set(state) - {n for n, _ in self.model.named_parameters()}
        if missing:
            raise KeyError(f"unknown parameters in the state dict: {sorted(missing)[:5]}")
        self.model.load_state_dict(state, strict=False)

    def save(self, path: str | Path) -> None:
        """Write the whole pipeline folder (loadable by `FlowPolicy.from_pretrained` / per-component).
        Under LoRA the adapter is merged into a copy of the transformer, and also saved on its own in
        ``transformer_lora/`` (diffusers ``save_lora_adapter``)."""
        path = Path(path)
        if self.lora:
            self.model.save_lora_adapter(str(path / "transformer_lora"))
            merged = copy.deepcopy(self.model)
            merged.fuse_lora()
            merged.unload_lora()
            merged.save_pretrained(path / "transformer")
        else:
            self.model.save_pretrained(path / "transformer")
        self.vae.save_pretrained(path / "vae")
        self.scheduler.save_pretrained(path / "scheduler")
        self.text_encoder.save_pretrained(path / "text_encoder")
        self.tokenizer.save_pretrained(path / "tokenizer")
