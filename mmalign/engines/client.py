"""`EngineClient`: a token policy's side of a rollout engine (building it, weight sync, per-step seeds, sleep).

Order within a training step (synchronous runs): `on_train_step` wakes the engine and pushes the weights
when an optimizer step changed them; the rollout samples through `generate` (once, or once per turn of a
multi-turn loop); `sampling_done` then puts the engine to sleep (where its ``sleep_enabled``), so the
trainer's scoring and update run with the memory it released; the next `on_train_step` wakes it again. An
asynchronous run's rollout worker samples while the trainer updates, so its engine never sleeps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mmalign.data.batch import Rollout
from mmalign.engines.base import (
    EnginePrompt,
    RolloutEngine,
    SamplingSpec,
    adapter_state_dict,
    full_state_dict,
    outputs_to_tensors,
)

ENGINE_NAMES = ("hf", "fake", "vllm")


def get_engine(name: str, **kwargs: Any) -> RolloutEngine | None:
    """The engine called ``name`` built with ``kwargs`` (``None`` for ``"hf"``)."""
    if name == "hf":
        if kwargs:
            raise TypeError(f"engine 'hf' takes no options, got {sorted(kwargs)}")
        return None
    if name == "fake":
        from mmalign.engines.fake import FakeEngine

        return FakeEngine(**kwargs)
    if name == "vllm":
        from mmalign.engines.vllm import VLLMEngine

        return VLLMEngine(**kwargs)
    raise ValueError(f"unknown rollout engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")


class EngineClient:
    """Holds the optional rollout engine of a policy: builds it from ``rollout.engine``, pushes the trainer's
    weights when they changed, seeds each step's sampling, and turns its outputs into tensors."""

    def __init__(self) -> None:
        self.engine: RolloutEngine | None = None
        """The engine that samples instead of the policy's ``generate`` (None: ``hf``)."""
        self.seed = 0
        """The seed of the current step's sampling."""
        self.stale = True
        """The engine holds older weights than the trainer."""
        self.run: Any = None
        """The `mmalign.policies.base.RunInfo` given to `setup` (None outside a run)."""
        self.deferred: tuple[str, dict[str, Any]] | None = None
        """An asynchronous run (``trainer.async``): the engine's name and options, built by the rollout worker's
        copy of the policy on its first step rather than in the trainer's process (which never samples)."""

    def setup(
        self, run: Any, *, loop: Any, fill_defaults: Callable[[str, dict[str, Any], Any], None]
    ) -> None:
        """Build the engine named by ``rollout.engine`` (none for ``hf``); `fill_defaults(name, kwargs, run)`
        adds what the policy's engine needs beyond ``rollout.engine_kwargs``. Any rollout loop samples through
        it (a multi-turn loop once per turn); `loop` is kept for the signature."""
        self.run = run
        r = run.cfg.rollout
        if r.engine == "hf":
            return
        kwargs = dict(r.engine_kwargs)
        fill_defaults(r.engine, kwargs, run)
        if getattr(run.cfg.trainer, "async_", None) is not None:
            self.deferred = (r.engine, kwargs)  # the rollout worker builds it (`on_train_step`)
            return
        self.engine = self._build(r.engine, kwargs)

    def _build(self, name: str, kwargs: dict[str, Any]) -> RolloutEngine | None:
        from mmalign.config import ConfigError

        try:
            engine = get_engine(name, **kwargs)
        except TypeError as e:
            source = self.run.cfg.source if self.run is not None and self.run.cfg is not None else "<config>"
            raise ConfigError(f"{source}: key 'rollout.engine_kwargs': {e}") from None
        self.stale = True
        return engine

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a rollout worker's copy of the policy sent to a Ray actor): a deferred engine is left out,
        the copy builds its own."""
        state = dict(self.__dict__)
        if self.deferred is not None:
            state["engine"] = None
        return state

    def on_train_step(self, step: int, sync: Callable[[int], None]) -> None:
        """Before a step's sampling: wake the engine, `sync(step)` when the weights changed, and this step's
        seed. A deferred engine (asynchronous runs) is built here, in the rollout worker, on its first step."""
        if self.engine is None and self.deferred is not None:
            self.engine = self._build(*self.deferred)
        if self.engine is None:
            return
        self.engine.wake()  # before the sync: a sleeping engine has given its weights' memory back
        if self.stale:
            sync(step)
        run = self.run
        base = run.cfg.seed if run is not None and run.cfg is not None else 0
        rank = run.rank if run is not None else 0
        self.seed = base * 1_000_003 + step * 7919 + rank

    def after_optimizer_step(self) -> None:
        self.stale = self.engine is not None

    def sampling_done(self) -> None:
        """A rollout's sampling is over: put the engine to sleep until the next `on_train_step` (a no-op
        without an engine, where the engine's sleep mode is off, and in an asynchronous run's worker)."""
        if self.engine is not None and self.deferred is None:
            self.engine.sleep()

    def sync(self, model: torch.nn.Module, *, lora: bool, step: int = 0) -> None:
        """Push `model`'s weights (merged LoRA, or the adapter where the engine loads adapters); raises
        `WeightSyncError` past ``rollout.sync_timeout_s`` instead of hanging."""
        assert self.engine is not None
        run = self.run
        if run is not None and run.accelerator:
            model = run.accelerator.unwrap_model(model)
        if getattr(self.engine, "supports_lora_adapters", False) and lora:
            state, as_adapter = adapter_state_dict(model), True
        else:
            state, as_adapter = full_state_dict(model), False
        timeout = run.cfg.rollout.sync_timeout_s if run is not None and run.cfg is not None else None
        limit = {} if timeout is None else {"timeout_s": timeout}  # outside a run: the engine's default
        self.engine.sync_weights(state, lora=as_adapter, step=step, **limit)
        self.stale = False

    def generate(
        self, prompts: list[EnginePrompt], n: int, sampling: SamplingSpec, pad_id: int
    ) -> tuple[Tensor, Tensor]:
        """`n` samples per prompt (prompt-major): right-padded completion ids and the engine's log-probs."""
        assert self.engine is not None
        outs = self.engine.generate(prompts, n, sampling)
        completion_ids, logp_engine, _ = outputs_to_tensors(outs, pad_id)
        return completion_ids, logp_engine

    @staticmethod
    def keep_logprobs(rollout: Rollout, logp_engine: Tensor) -> Rollout:
        """``rollout.logp_sampler``: the engine's log-probs cut or padded to the rollout's width, 0 where
        masked (the importance-sampling correction compares them with ``logp_old``)."""
        width = rollout.mask.shape[1]
        logp = logp_engine.float()[:, :width]
        if logp.shape[1] < width:
            logp = torch.cat([logp, logp.new_zeros(logp.shape[0], width - logp.shape[1])], dim=1)
        rollout.logp_sampler = logp.masked_fill(~rollout.mask, 0.0)
        return rollout
