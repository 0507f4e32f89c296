"""What the diffusion policies share: `DenoisingPolicy`, the base of `FlowPolicy` (flow matching, SD3 style)
and `DDIMPolicy` (SD 1.x/2.x UNets).

Both treat one stochastic denoising step as one action. A subclass supplies the network and the step
kind (`rollout`, `_score`, `save`); this base holds the parts that do not depend on them:

- which steps of each sample are trained (`_trained_steps`): a window of ``window_size`` consecutive
  steps (its start drawn in ``window_range``, or given by `_window_start` of a subclass), else a random
  ``train_fraction`` of the steps, per sample;
- the initial noise (`_initial_noise`; the same for a whole group with ``same_initial_noise``);
- decoding latents to pixels (`decode`), only when a reward asks for images;
- the reference network (`_reference`: the adapter-disabled denoiser under LoRA, else a frozen copy)
  and the KL on step means (`mean_kl`);
- the trainer-facing methods `evaluate`, `reference_logprobs` and the trainable-parameter accessors.

A subclass's constructor calls `_init_denoising`, which sets the shared attributes: ``model`` (the
denoiser), ``forward_model`` (what `evaluate` runs; the trainer may swap in a DDP wrapper), ``ref_model``
(frozen copy or None), ``lora``, ``need_reference``, ``vae`` (frozen), ``generator`` (a torch.Generator
or None), ``latent_size``, ``same_initial_noise``, ``train_fraction``, ``window_size``, ``window_range``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.batch import Rollout
from mmalign.policies.base import ActionStats

__all__ = ["DenoisingPolicy", "add_lora", "mean_kl"]


def add_lora(denoiser: torch.nn.Module, lora: Any, all_linear: tuple[str, ...] | list[str]) -> bool:
    """Freeze `denoiser` and give it a peft LoRA adapter (diffusers ``add_adapter``) when ``lora.enabled``
    (`mmalign.config.LoraConfig`; ``target_modules: all-linear`` means the model's `all_linear` list).
    Returns whether an adapter was added."""
    if not (lora and lora.enabled):
        return False
    from peft import LoraConfig as PeftLoraConfig

    targets = list(all_linear) if lora.target_modules == "all-linear" else lora.target_modules
    denoiser.requires_grad_(False)
    denoiser.add_adapter(
        PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets)
    )
    return True


def mean_kl(mean: Tensor, ref_mean: Tensor, kl_std: Tensor) -> Tensor:
    """Float[B]: the KL on step means, ``||mu - mu_ref||^2 / (2 sigma_t^2)`` with the squared distance
    averaged over the non-batch dims (docs/algorithms.md; Flow-GRPO's training script). ``kl_std`` is the step's
    noise scale sigma_t *without* the sqrt(|dt|) factor of the discretisation -- `mmalign.sde.StepOutput.kl_std`,
    not ``.std`` -- so ``kl_coef`` values of the Flow-GRPO recipes mean the same here. A scalar or one value
    per sample (any shape that broadcasts as [B, 1, ..., 1])."""
    diff = (mean - ref_mean) ** 2
    std2 = (kl_std**2).reshape(-1) if kl_std.ndim else kl_std**2
    return diff.mean(dim=tuple(range(1, diff.ndim))) / (2 * std2)


class DenoisingPolicy:
    """Shared machinery of the diffusion policies; see the module docstring."""

    model: torch.nn.Module
    forward_model: torch.nn.Module
    ref_model: torch.nn.Module | None
    vae: torch.nn.Module
    generator: torch.Generator | None
    lora: bool
    need_reference: bool
    latent_size: int
    same_initial_noise: bool
    train_fraction: float
    window_size: int | None
    window_range: tuple[int, int] | None

    def _init_denoising(
        self,
        model: torch.nn.Module,
        vae: torch.nn.Module,
        *,
        latent_size: int | None,
        same_initial_noise: bool,
        train_fraction: float,
        window_size: int | None,
        window_range: tuple[int, int] | None,
        seed: int | None,
        need_reference: bool,
        lora: bool,
    ) -> None:
        """Set the shared attributes (see the module docstring); the VAE is frozen, a frozen copy of `model`
        is the reference when one is needed without LoRA. Subclasses validate the window against their
        trainable steps."""
        if not 0 < train_fraction <= 1:
            raise ValueError(f"train_fraction must be in (0, 1], got {train_fraction}")
        self.model = model
        self.forward_model = model
        """What `evaluate` runs (the trainer may swap in a DDP-wrapped model; sampling uses `model`)."""
        self.kl_in_evaluate = need_reference
        """`evaluate` returns the KL on step means itself (the trainer then skips reference log-probs)."""
        self.vae = vae.eval().requires_grad_(False)
        self.latent_size = latent_size or int(model.config.sample_size)
        self.same_initial_noise = same_initial_noise
        self.train_fraction = train_fraction
        self.window_size = window_size
        self.window_range = window_range
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.lora = lora
        self.need_reference = need_reference
        self.ref_model = (
            copy.deepcopy(model).eval().requires_grad_(False) if need_reference and not lora else None
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ checkpointed randomness
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

    def _window_start(self, n: int) -> int:
        """First step of the trained window: uniform in ``window_range`` (clipped so the window fits
        in the `n` trainable steps)."""
        assert self.window_size is not None
        lo, hi = self.window_range or (0, n - self.window_size)
        hi = min(hi, n - self.window_size)
        lo = min(max(lo, 0), hi)
        return int(torch.randint(lo, hi + 1, (1,), generator=self.generator))

    def _trained_steps(self, batch: int) -> Tensor:
        """Long[B, T]: the (sorted) step indices whose transitions are trained, per sample."""
        n = self._num_trainable_steps()
        if self.window_size is not None:
            start = self._window_start(n)
            return torch.arange(start, start + self.window_size).expand(batch, -1).clone()
        t = max(1, math.ceil(self.train_fraction * n))
        if t == n:
            return torch.arange(n).expand(batch, -1).clone()
        perm = torch.stack([torch.randperm(n, generator=self.generator)[:t] for _ in range(batch)])
        return perm.sort(dim=1).values

    # ------------------------------------------------------------------ sampling
    def _initial_noise(self, group: Tensor) -> Tensor:
        """Float[B, C, h, w] standard normal latents; with ``same_initial_noise`` one draw per group."""
        c = int(self.model.config.in_channels)
        shape = (c, self.latent_size, self.latent_size)
        if self.same_initial_noise:
            n_groups = int(group.max()) + 1
            noise = torch.randn((n_groups, *shape), generator=self.generator)[group]
        else:
            noise = torch.randn((group.shape[0], *shape), generator=self.generator)
        return noise.to(self.device)

    @torch.no_grad()
    def decode(self, rollout: Rollout) -> Tensor:
        """Images Float[B,3,H,W] in [0, 1] from ``outputs["latents"]`` (also stored as ``outputs["images"]``)."""
        z = rollout.outputs["latents"].to(self.device)
        cfg = self.vae.config
        z = z / cfg.scaling_factor + (getattr(cfg, "shift_factor", None) or 0.0)
        img = self.vae.decode(z.to(next(self.vae.parameters()).dtype), return_dict=False)[0].float()
        img = (img / 2 + 0.5).clamp(0, 1).cpu()
        rollout.outputs["images"] = img
        return img

    # ------------------------------------------------------------------ log-probs
    def _score(
        self, model: torch.nn.Module, rollout: Rollout, *, grad: bool, with_kl: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """(log-probs Float[B, T] of the stored trained transitions under `model`, KL Float[B, T] or None)."""
        raise NotImplementedError

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

    def evaluate(self, rollout: Rollout) -> ActionStats:
        """Recompute per-step log-probs with grad (and the mean-difference KL when a reference is used)."""
        logp, kl = self._score(self.forward_model, rollout, grad=True, with_kl=self.need_reference)
        return ActionStats(logp=logp, kl=kl)

    def reference_logprobs(self, rollout: Rollout) -> Tensor:
        """Per-step log-probs of the stored transitions under the reference network (no grad)."""
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
