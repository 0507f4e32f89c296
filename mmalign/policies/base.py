"""The policy contract: every method and attribute `GroupTrainer` uses, in one base class.

A policy is a model family that samples groups and re-scores its own samples (text, VLM, flow matching,
DDIM ...). Subclass `Policy`, implement the abstract methods, override the hooks you need; the trainer
calls every hook unconditionally, so the no-op defaults below are the behaviour of a policy that has
nothing to do there. docs/architecture.md, "Writing a policy", has a worked example.

Details: docs/architecture.md, "mmalign.policies.base".
"""

from __future__ import annotations

import abc
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmalign.data.batch import Rollout

__all__ = ["ActionStats", "DTYPES", "Policy", "RunInfo", "SAMPLE_KINDS", "torch_dtype"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The ``model.dtype`` names a policy loads its weights in."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``model.dtype`` `name`; an unknown name is a ValueError listing the valid ones."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}") from None


SAMPLE_KINDS = ("text", "image", "video", "boxes")
"""What `Policy.sample_view` may return per sample (see `mmalign.training.rundir.write_samples` for the files)."""


@dataclass
class ActionStats:
    """What `Policy.action_stats` returns for a minibatch: per-action quantities, with grad on `logp`."""

    logp: Tensor | None
    """Float[B,T] log-probs of the stored actions under the current policy (carries grad); None when the
    policy computes its per-action loss itself (`loss`)."""
    entropy: Tensor | None = None
    """Float[B,T] per-action entropy where cheap to compute (no grad needed)."""
    kl: Tensor | None = None
    """Float[B,T] KL to the reference computed by the policy itself (diffusion: mean difference)."""
    aux_losses: dict[str, Tensor] = field(default_factory=dict)
    """Named scalar loss terms (with grad), each the MEAN over this microbatch's samples. The trainer adds
    ``algorithm.aux_coefs[name] * term`` to the loss (weighted by the microbatch's share of the minibatch,
    so the update sees the minibatch mean) and logs each as ``aux/<name>``. A name without a coefficient
    in the config is an error. Scored in chunks (`Policy.action_chunks`), each chunk's term is its part of
    the microbatch mean: the chunks' terms add up to it."""
    loss_weights: Tensor | None = None
    """Float[B,T] weights of the per-action policy loss (before the KL term is added; e.g. GRPO-Guard's
    per-step reweighting); None: 1."""
    loss: Tensor | None = None
    """Float[B,T] the per-action loss computed by the policy itself (with grad; e.g. a forward-process
    objective of `mmalign.algorithms.flow_objectives`): the trainer then uses it in place of ``algorithm.loss`` on
    ``logp`` and skips the importance-sampling correction; the KL term, aggregation and aux terms apply
    as usual. None: the trainer's policy-gradient loss on ``logp``."""
    clipped: Tensor | None = None
    """Bool[B,T] where `loss` was clipped (logged as ``clip_frac``); None: nowhere."""
    metrics: dict[str, Tensor] = field(default_factory=dict)
    """Per-action diagnostics Float[B,T] (no grad), each logged as its mean over valid actions under its
    name (e.g. ``objective/ratio``)."""


@dataclass
class RunInfo:
    """What `Policy.setup` learns about the run."""

    cfg: Any
    """The run's `mmalign.config.Config`."""
    accelerator: Any
    """The `accelerate.Accelerator` (``unwrap_model``, ``device``)."""
    rank: int = 0
    world: int = 1


class Policy(abc.ABC):
    """A model family that samples groups and re-scores its own samples. See the module docstring."""

    model: torch.nn.Module
    """The trained network, unwrapped; sampling runs it."""
    forward_model: torch.nn.Module
    """What `action_stats` runs: ``model`` until the trainer swaps in the accelerate-prepared (DDP) wrapper."""
    kl_in_action_stats: bool = False
    """`action_stats` fills ``ActionStats.kl`` itself (diffusion: KL on step means), so the trainer does not ask
    for `reference_logprobs`."""

    # ------------------------------------------------------------------ required
    @abc.abstractmethod
    def rollout(self, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool) -> Rollout:
        """Sample `group_size` outputs for each row's prompt without grad.

        `rows` are dataset rows (dicts) that carry at least a ``prompt``; every column reaches the
        rewards through `Rollout.columns`. `compute_logp` asks for `logp_old` (needed when a rollout
        is reused for more than one optimizer step, or when `needs_logp_old`)."""

    @abc.abstractmethod
    def action_stats(self, rollout: Rollout) -> ActionStats:
        """Recompute per-action log-probs of `rollout` with grad (through `forward_model`)."""

    @abc.abstractmethod
    def reference_logprobs(self, rollout: Rollout) -> Tensor:
        """Float[B,T] per-action log-probs under the reference model (no grad)."""

    # ------------------------------------------------------------------ weight state (one behaviour for all)
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer updates: those of `model` that require grad."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """Name -> a CPU copy of each trainable parameter (what checkpoints hold; never aliases the live weights)."""
        return {n: p.detach().cpu().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def load_trainable_state_dict(self, state: dict[str, Tensor]) -> None:
        """Copy `state` into the trainable parameters (onto their device and dtype). A state that misses a
        trainable parameter or names one the model does not have is a ValueError listing them; nothing is
        copied then."""
        params = dict(self.model.named_parameters())
        missing = [n for n, p in params.items() if p.requires_grad and n not in state]
        unknown = [n for n in state if n not in params]
        if missing or unknown:
            raise ValueError(
                f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unknown[:5]}"
            )
        with torch.no_grad():
            for n, v in state.items():
                params[n].copy_(v)

    @abc.abstractmethod
    def save(self, path: str | Path) -> None:
        """Export for use outside mmalign (`from_pretrained`-loadable; adapters for LoRA)."""

    # ------------------------------------------------------------------ hooks (no-op defaults)
    def setup(self, run: RunInfo) -> None:
        """Called once by the trainer after ``forward_model`` is prepared. The default refuses a rollout
        engine (``rollout.engine`` other than ``hf``): only policies that sample through one override this."""
        engine = run.cfg.rollout.engine
        if engine != "hf":
            from mmalign.config import ConfigError

            raise ConfigError(
                f"{run.cfg.source}: key 'rollout.engine': {type(self).__name__} samples with its own model and "
                f"does not use a rollout engine ({engine!r}); leave it at 'hf'"
            )

    def action_chunks(self, rollout: Rollout) -> list[Tensor] | None:
        """How the trainer may split microbatch `rollout`'s actions into chunks that are scored and
        back-propagated one at a time: Long[k] column indices into dim 1 of ``rollout.mask`` that partition
        the columns, each scored by ``action_stats(rollout, actions=idx)`` (which then returns Float[B, k]
        tensors) with a backward pass after each, so only one chunk's graph is alive at a time (a diffusion
        policy: one denoising step's forward per chunk). The trainer aggregates every chunk with the whole
        microbatch's normalisers, so the accumulated gradient equals one backward over the microbatch.
        None (default): one `action_stats(rollout)` call for all actions (a text policy's one forward)."""
        return None

    def callbacks(self) -> list[Any]:
        """Trainer callbacks (`mmalign.training.callbacks.TrainerCallback`) the policy contributes, asked once after
        `setup`: the trainer appends them to the pipeline's callbacks, calls their hooks and checkpoints their
        ``state_dict`` (e.g. a forward-process objective's old-policy EMA). Default: none."""
        return []

    @property
    def max_actions(self) -> int | None:
        """The most actions one sample can have (``seq_sum_norm``'s constant normaliser, Dr. GRPO's
        maximum generation length); None: the width T of the batch at hand."""
        return None

    @property
    def needs_logp_old(self) -> bool:
        """Whether `rollout` must always store ``logp_old`` (e.g. it samples with another process whose
        log-probs only enter an importance-sampling correction)."""
        return False

    def on_train_step(self, step: int) -> None:
        """Before each sampling round of training step `step` (0-based): schedules of the policy (a
        sliding window of trained steps), weight syncs of an external sampler. Must be resume-safe: a
        function of `step` and of state in `trainable_state_dict` / `rng_state`."""
        return None

    def materialize(self, rollout: Rollout, needs: Collection[str]) -> None:
        """Fill ``rollout.outputs`` with the outputs named in `needs` (what the rewards declared, e.g.
        ``"images"``) that `rollout` skipped because they are costly (decoding latents to pixels)."""
        return None

    def after_optimizer_step(self) -> None:
        """After each optimizer step (e.g. mark an external sampler's weights stale)."""
        return None

    def rollout_stats(self, rollout: Rollout) -> dict[str, Tensor]:
        """Per-sample numbers to log for a fresh rollout, Float[B] each (the trainer logs their mean over
        all processes under the given name, e.g. ``completion_len/mean``)."""
        return {}

    def seed(self, seed: int) -> None:
        """Seed the policy's private random generators (`mmalign.training.seeding.seed_policy`; none by default)."""
        return None

    def rng_state(self) -> dict[str, Any]:
        """The policy's private random generators, saved in checkpoints for exact resume."""
        return {}

    def load_rng_state(self, state: dict[str, Any]) -> None:
        """Restore what `rng_state` returned."""
        return None

    def sample_view(self, rollout: Rollout) -> list[dict[str, Any]]:
        """What each sample of `rollout` looks like in the run directory: per sample a dict whose keys are
        `SAMPLE_KINDS` -- ``text`` (str), ``image`` (Float[3,H,W] in [0, 1]), ``video`` (Float[F,3,H,W]),
        ``boxes`` (list of [x1, y1, x2, y2]). The default reads ``outputs["texts"]``, ``["images"]``,
        ``["videos"]`` and ``["boxes"]`` where present."""
        n = len(rollout)
        views: list[dict[str, Any]] = [{} for _ in range(n)]
        for key, kind, dims in (("texts", "text", None), ("images", "image", 4), ("videos", "video", 5)):
            value = rollout.outputs.get(key)
            if value is None or len(value) != n:
                continue
            if dims is not None and not (isinstance(value, Tensor) and value.dim() == dims):
                continue
            for i in range(n):
                views[i][kind] = value[i]
        boxes = rollout.outputs.get("boxes")
        if isinstance(boxes, list) and len(boxes) == n:
            for i in range(n):
                views[i]["boxes"] = boxes[i]
        return views
