"""Flow-matching diffusion policy (SD3 / SD3.5-style): one action = one stochastic denoising step.

- `rollout` encodes each distinct prompt once, draws initial latents (optionally the same noise for
  every member of a group), and integrates from sigma = 1 to 0 over the scheduler's `num_steps`
  sigmas.
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
  ``train_guidance=True`` (default): `evaluate`, the reference and the recorded ``logp_old`` all use the
  same CFG velocity v_u + w (v_c - v_u), so the log-probs are those of the sampling policy.
  ``train_guidance=False`` (**"CFG-free training"**, our design): samples are still drawn with the CFG
  mean, but every log-prob -- ``logp_old`` recorded in `rollout`, `evaluate`, the reference and its KL --
  uses the *conditional* velocity v_c alone: log N(x_{t+1}; mu(v_c), std^2) of the stored transition.
  In `rollout` v_c is the conditional half of the very forward pass that gave the CFG velocity (no extra
  forward), so with unchanged weights exp(logp - logp_old) = 1 at init, as for every other mode. This
  trains the conditional network directly (inference then needs no CFG, or less); the "ratio" is a ratio
  of conditional-branch densities of samples drawn by the CFG policy, i.e. an off-policy surrogate. The
  conditional density of a CFG sample is low (the CFG shift mu_cfg - mu_c enters its quadratic term), so
  the log-probs are far below those of ``train_guidance=True``. With ``guidance_scale`` <= 1 the option
  has no effect.
- The payload stores, for each trained step j of each sample, x_t (``latents``), x_{t+1}
  (``next_latents``), sigma and sigma' and the step index, plus the prompt embeddings; `evaluate`
  re-scores the stored transitions with grad (``prev_sample`` = stored x_{t+1}) so with unchanged
  weights exp(logp - logp_old) = 1.
- KL (optional, ``need_reference``): per step ||mu_theta - mu_ref||^2 / (2 sigma_t^2) averaged over
  the latent dims, sigma_t the step's noise scale without the sqrt(|dt|) factor (`StepOutput.kl_std`), as
  Flow-GRPO computes it. The reference is the same transformer with its LoRA
  adapter disabled under LoRA (``lora.enabled``), else a frozen copy.
- Text encoders: `mmalign.tiny_flow.SD3Components` -- the real SD3 / SD3.5 layout (two CLIPs + optional
  T5, prompt embeddings exactly as diffusers' ``StableDiffusion3Pipeline``; ``max_sequence_length`` is
  the T5 length, default 256) or the tiny single-CLIP layout. `save` writes every component.
- `seed` seeds a CPU generator for initial noise, random windows / subsets and (on CPU) the SDE noise;
  on an accelerator the SDE noise uses the global RNG.

Flux: FLUX.1 (dev / schnell) is served by `mmalign.policies.flux.FluxPolicy`, a subclass that keeps the
step kinds, trained-step selection, payload, scoring, KL and LoRA of this class and overrides only what
Flux changes: the velocity call `_forward` (2x2-packed latents with ``img_ids``/``txt_ids``, timestep as
sigma, FLUX.1-dev's distilled ``guidance`` embedding instead of two-branch CFG), the prompt encoding (T5
states + pooled CLIP), the initial noise (``in_channels / 4`` channels), the resolution-dependent sigma
shift (``mu``) and loading / saving of the Flux folder layout.
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
from mmalign.schedules import SlidingWindow

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
"""Attention projections of SD3 joint blocks (the usual Flow-GRPO LoRA targets)."""

SDE_KINDS = ("flow_sde", "cps", "dance")
"""Step kinds a FlowPolicy samples with (`mmalign.sde` functions of the flow-matching convention)."""

CPS_LOG_PROBS = sde.LOG_PROB_FORMS
"""How a ``cps`` step is scored: ``squared_error`` (Flow-GRPO, default) or ``gaussian``."""

WINDOW_MODES = ("random", "sliding")


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


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FlowPolicy(DenoisingPolicy):
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
        sde_kind: str = "flow_sde",
        window_mode: str = "random",
        window_shift_every: int = 25,
        window_stride: int = 1,
        train_guidance: bool = True,
        text_encoder_2: torch.nn.Module | None = None,
        tokenizer_2: Any = None,
        text_encoder_3: torch.nn.Module | None = None,
        tokenizer_3: Any = None,
        max_sequence_length: int = 256,
        cps_log_prob: str = "squared_error",
    ) -> None:
        from mmalign.tiny_flow import SD3Components

        if cps_log_prob not in CPS_LOG_PROBS:
            raise ValueError(f"cps_log_prob must be one of {', '.join(CPS_LOG_PROBS)}; got {cps_log_prob!r}")
        self.cps_log_prob = cps_log_prob
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if sde_kind not in SDE_KINDS:
            raise ValueError(f"sde_kind must be one of {', '.join(SDE_KINDS)}; got {sde_kind!r}")
        if not noise_level > 0 or (sde_kind == "cps" and noise_level > 1):
            allowed = "(0, 1]" if sde_kind == "cps" else "> 0"
            name = "eta" if sde_kind == "dance" else "noise level a"
            raise ValueError(f"noise_level ({name} of {sde_kind}) must be {allowed}, got {noise_level}")
        if window_mode not in WINDOW_MODES:
            raise ValueError(f"window_mode must be one of {', '.join(WINDOW_MODES)}; got {window_mode!r}")
        if window_mode == "sliding" and window_size is None:
            raise ValueError("window_mode='sliding' needs window_size")
        self._init_denoising(
            transformer,
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
        self.num_steps = num_steps
        self.noise_level = noise_level
        self.sde_kind = sde_kind
        self.guidance_scale = guidance_scale
        self.train_guidance = train_guidance
        self.window_mode = window_mode
        self.train_step = 0
        """The trainer's step, set by `on_train_step` (drives the sliding window)."""

        self.stochastic_steps = self._stochastic_steps(self.sigmas())
        """Step indices whose std is > 0 (the only ones that can be trained), ascending."""
        n_sto = len(self.stochastic_steps)
        if n_sto == 0:
            raise ValueError(f"{sde_kind} with num_steps={num_steps} has no stochastic step to train")
        if self.stochastic_steps != list(range(n_sto)):  # windows index into a contiguous prefix
            raise ValueError(f"the stochastic steps of {sde_kind} are not a prefix: {self.stochastic_steps}")
        self.window_schedule: SlidingWindow | None = None
        if window_size is not None:
            if not 1 <= window_size <= n_sto:
                why = (
                    ""
                    if n_sto == num_steps
                    else f" ({num_steps - n_sto} final step(s) of {sde_kind} have std 0)"
                )
                raise ValueError(
                    f"window_size must be in [1, {n_sto}] (the stochastic steps{why}), got {window_size}"
                )
            lo, hi = window_range or (0, n_sto - window_size)
            hi = min(hi, n_sto - window_size)
            if not 0 <= lo <= hi:
                raise ValueError(
                    f"window_range {window_range} leaves no window start in [0, {n_sto - window_size}] "
                    f"for window_size={window_size}"
                )
            self._window_bounds = (lo, hi)
            if window_mode == "sliding":
                self.window_schedule = SlidingWindow(
                    n_sto, window_size, window_shift_every, stride=window_stride, start=lo, end=hi
                )
        self._embed_cache: dict[str, tuple[Tensor, Tensor]] = {}

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
        """Load an SD3-style pipeline folder (see `mmalign.tiny_flow.load_sd3_components`; ``load_t5=False``
        skips an SD3 folder's T5, whose prompt states are then zeros); with ``lora.enabled`` the transformer
        gets a peft LoRA adapter (diffusers ``add_adapter``) and only the adapter trains; the reference is
        then the same transformer with the adapter disabled. Other kwargs go to the constructor."""
        from mmalign.tiny_flow import load_sd3_components

        c = load_sd3_components(name_or_path, dtype=_DTYPES[dtype], load_t5=load_t5)
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

    # ------------------------------------------------------------------ training progress
    def on_train_step(self, step: int) -> None:
        """Called by the trainer before each rollout with its step (finished training steps)."""
        self.train_step = int(step)

    # ------------------------------------------------------------------ prompts and sigmas
    def _encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        return self.components.encode_prompt(
            prompts, self.device, max_sequence_length=self.max_sequence_length
        )

    def encode_prompt(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(prompt_embeds [B,L,D], pooled [B,P]) in fp32 on the policy's device; each distinct prompt once."""
        missing = list(dict.fromkeys(p for p in prompts if p not in self._embed_cache))
        if missing:
            pe, po = self._encode(missing)
            for i, p in enumerate(missing):
                if len(self._embed_cache) < 10_000:
                    self._embed_cache[p] = (pe[i].float(), po[i].float())
        pairs = [self._embed_cache[p] if p in self._embed_cache else None for p in prompts]
        if any(x is None for x in pairs):  # cache full: encode directly
            pe, po = self._encode(prompts)
            return pe.float(), po.float()
        return torch.stack([x[0] for x in pairs]), torch.stack([x[1] for x in pairs])  # type: ignore[index]

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

    def _stochastic_steps(self, sig: Tensor) -> list[int]:
        """Step indices whose std is > 0 under `sde_kind` (CPS: std = sigma' sin(a pi/2) is 0 at sigma' = 0;
        flow_sde and dance: std > 0 whenever sigma' < sigma)."""
        if self.sde_kind == "cps":
            return [i for i in range(self.num_steps) if float(sig[i + 1]) > 0]
        return list(range(self.num_steps))

    def _num_trainable_steps(self) -> int:
        return len(self.stochastic_steps)  # the stochastic steps are 0 .. n-1

    def _window_start(self, n: int) -> int:
        if self.window_schedule is not None:
            return self.window_schedule.start_at(self.train_step)
        lo, hi = self._window_bounds
        return int(torch.randint(lo, hi + 1, (1,), generator=self.generator))

    # ------------------------------------------------------------------ model
    def _forward(
        self, model: torch.nn.Module, x: Tensor, sigma: Tensor, pe: Tensor, po: Tensor, *, cfg: bool
    ) -> tuple[Tensor, Tensor]:
        """(velocity, conditional velocity), fp32, at latents x [B,...] and per-sample sigma [B]. With
        ``cfg`` and ``guidance_scale`` > 1 one batched forward of both branches gives the CFG velocity
        v_u + w (v_c - v_u) and v_c; otherwise one conditional forward gives v_c twice."""
        dtype = next(model.parameters()).dtype
        t = sigma * float(self.scheduler.config.num_train_timesteps)
        use_cfg = cfg and self.guidance_scale > 1.0
        if use_cfg:
            npe, npo = self.encode_prompt([""])
            b = x.shape[0]
            pe = torch.cat([npe.expand(b, -1, -1), pe])
            po = torch.cat([npo.expand(b, -1), po])
            x_in, t = torch.cat([x, x]), torch.cat([t, t])
        else:
            x_in = x
        v = model(
            hidden_states=x_in.to(dtype),
            encoder_hidden_states=pe.to(dtype),
            pooled_projections=po.to(dtype),
            timestep=t.to(dtype),
            return_dict=False,
        )[0].float()
        if use_cfg:
            v_u, v_c = v.chunk(2)
            return v_u + self.guidance_scale * (v_c - v_u), v_c
        return v, v

    def _velocity(self, model: torch.nn.Module, x: Tensor, sigma: Tensor, pe: Tensor, po: Tensor) -> Tensor:
        """The velocity log-probs are scored with: CFG if enabled and ``train_guidance``, else conditional."""
        return self._forward(model, x, sigma, pe, po, cfg=self.train_guidance)[0]

    def _step(
        self, v: Tensor, x: Tensor, s: Tensor, sn: Tensor, fallback: float | Tensor, **kw: Any
    ) -> sde.StepOutput:
        """One `sde.step` of ``sde_kind`` with ``noise_level`` mapped to the kind's option."""
        if self.sde_kind == "flow_sde":
            opts: dict[str, Any] = {"noise_level": self.noise_level, "sigma_max_fallback": fallback}
        elif self.sde_kind == "cps":
            opts = {"noise_level": self.noise_level, "log_prob_form": self.cps_log_prob}
        else:  # dance
            opts = {"eta": self.noise_level}
        return sde.step(self.sde_kind, v, x, s, sn, **opts, **kw)

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
        sde_steps = set(steps[0].tolist()) if self.window_size is not None else set(self.stochastic_steps)
        cond_logp = compute_logp and not self.train_guidance and self.guidance_scale > 1.0

        x = self._initial_noise(group)
        lat = torch.zeros((b, t, *x.shape[1:]), device=self.device)
        nxt = torch.zeros_like(lat)
        logp = torch.zeros((b, t), device=self.device)
        was_training = self.model.training
        self.model.eval()
        for i in range(self.num_steps):
            s = sig[i].expand(b)
            sn = sig[i + 1].expand(b)
            v, v_c = self._forward(self.model, x, s, pe, po, cfg=True)
            if i not in sde_steps:  # outside the window, or a zero-std step: deterministic Euler ODE step
                x_new = x + v * (sn - s).view(-1, *([1] * (x.ndim - 1)))
            else:
                out = self._step(
                    v, x, s, sn, fallback, generator=self.generator if self.device.type == "cpu" else None
                )
                x_new = out.sample
                hit = steps == i
                rows_hit = hit.any(dim=1)
                if bool(rows_hit.any()):
                    lat[hit] = x[rows_hit]
                    nxt[hit] = x_new[rows_hit]
                    lp = (
                        self._step(v_c, x, s, sn, fallback, prev_sample=x_new).log_prob
                        if cond_logp
                        else out.log_prob
                    )
                    logp[hit] = lp[rows_hit]
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
                "step_index": steps.cpu(),
                "sigmas": sig[steps].cpu(),
                "sigmas_next": sig[steps + 1].cpu(),
                "sigma_max_fallback": torch.full((b,), fallback),
                "prompt_embeds": pe.cpu(),
                "pooled_embeds": po.cpu(),
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
        logps, kls = [], []
        for j in range(rollout.num_actions):
            x, s, sn = p["latents"][:, j], p["sigmas"][:, j], p["sigmas_next"][:, j]
            with torch.set_grad_enabled(grad):
                v = self._velocity(model, x, s, p["prompt_embeds"], p["pooled_embeds"])
                out = self._step(v, x, s, sn, p["sigma_max_fallback"], prev_sample=p["next_latents"][:, j])
            logps.append(out.log_prob)
            if with_kl:
                with torch.no_grad(), self._reference() as ref:
                    v_ref = self._velocity(ref, x, s, p["prompt_embeds"], p["pooled_embeds"])
                    ref_mean = self._step(
                        v_ref, x, s, sn, p["sigma_max_fallback"], prev_sample=p["next_latents"][:, j]
                    ).mean
                kls.append(mean_kl(out.mean, ref_mean, out.kl_std))
        logp = torch.stack(logps, dim=1)
        kl = torch.stack(kls, dim=1) if with_kl else None
        return logp, kl

    def save(self, path: str | Path) -> None:
        """Write the whole pipeline folder, every component (loadable by `FlowPolicy.from_pretrained` /
        per-component; the SD3 layout also by diffusers' ``StableDiffusion3Pipeline.from_pretrained``).
        Under LoRA the adapter is merged into a copy of the transformer, and also saved on its own in
        ``transformer_lora/`` (diffusers ``save_lora_adapter``)."""
        path = Path(path)
        self.components.save_pretrained(path, transformer=self._denoiser_to_save(path, "transformer"))
