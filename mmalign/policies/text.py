"""Text policy: any Hugging Face causal LM (hub id or local folder), one action = one token.

Sampling (`mmalign.policies.token_sampling`: ``generate`` or a rollout engine), the multi-turn protocol
(`mmalign.policies.token_turns`), log-prob scoring (`mmalign.policies.token_scoring`, log-probs of the
temperature-scaled distribution that was sampled) and loading (`mmalign.policies.loading`) live in their
own modules; `TextPolicy` ties them together and implements the trainer hooks. The action mask covers the
generated tokens up to and including EOS / a stop string. LoRA through peft (the reference is the adapter
disabled), or full fine-tuning (a frozen copy is the reference, made only when a KL penalty is used).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from mmalign.config import LoraConfig
from mmalign.data.batch import Rollout
from mmalign.data.rollout_loops import Environment, RolloutLoop, make_loop
from mmalign.engines.client import EngineClient
from mmalign.policies.base import ActionStats, Policy, RunInfo
from mmalign.policies.loading import load_token_policy
from mmalign.policies.token_sampling import TokenSampling
from mmalign.policies.token_scoring import (
    DEFAULT_LOGPROB_MEMORY_MB,
    LinearPositions,
    PositionScheme,
    ScoringOptions,
    TokenScorer,
)
from mmalign.policies.token_turns import TurnProtocol


class TextPolicy(TokenSampling, TurnProtocol, Policy):
    """A causal language model as a GRPO policy. See the module docstring."""

    position_scheme: ClassVar[type[PositionScheme]] = LinearPositions
    """How the scorer builds forward inputs and positions from a payload."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_strings: list[str] | None = None,
        use_chat_template: bool = False,
        system_prompt: str | None = None,
        generation_batch_size: int | None = None,
        need_reference: bool = False,
        lora: bool = False,
        shared_prefix: bool = True,
        logprob_chunk_size: int | str | None = "auto",
        logprob_memory_mb: float = DEFAULT_LOGPROB_MEMORY_MB,
        sampler: str = "mmalign",
        loop: RolloutLoop | str = "single_turn",
        loop_kwargs: dict[str, Any] | None = None,
        environment: Environment | None = None,
    ) -> None:
        self.loop = (
            make_loop(loop, environment=environment, **(loop_kwargs or {})) if isinstance(loop, str) else loop
        )
        """How `rollout` turns rows into samples (`mmalign.data.rollout_loops`): a loop object, or a registered
        name built with `loop_kwargs` and `environment`."""
        if not isinstance(loop, str) and (loop_kwargs or environment is not None):
            raise ValueError("pass loop_kwargs / environment only with a loop name, not with a loop object")
        self.model = model
        self.forward_model = model
        """What `action_stats` runs (the trainer swaps in the DDP-wrapped model; generation uses `model`)."""
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.stop_strings = list(stop_strings or [])
        self.use_chat_template = use_chat_template
        self.system_prompt = system_prompt
        self.generation_batch_size = generation_batch_size
        self.lora = lora
        self.shared_prefix = shared_prefix
        """Encode each group's prompt once when recomputing log-probs (off under gradient checkpointing)."""
        if not (
            logprob_chunk_size is None
            or logprob_chunk_size == "auto"
            or (isinstance(logprob_chunk_size, int) and logprob_chunk_size >= 1)
        ):
            raise ValueError(f"logprob_chunk_size must be >= 1, 'auto' or None, got {logprob_chunk_size!r}")
        if not logprob_memory_mb > 0:
            raise ValueError(f"logprob_memory_mb must be > 0, got {logprob_memory_mb}")
        if sampler not in ("mmalign", "hf"):
            raise ValueError(f"sampler must be 'mmalign' or 'hf', got {sampler!r}")
        self.logprob_chunk_size = logprob_chunk_size
        """Score the completion tokens through the output head this many at a time; "auto": as many as
        fit in `logprob_memory_mb`; None: full logits."""
        self.logprob_memory_mb = logprob_memory_mb
        """The memory budget (MiB) of one chunk of logits and its temporaries, for ``"auto"``."""
        self.sampler = sampler
        """Single-turn sampling without an engine: ``mmalign`` (the own decode loop, where the model's
        generation config allows it; `TokenSampling.own_loop_blockers`) or ``hf`` (``generate``)."""
        self.suppressed_ids: list[int] = []
        """Tokens never sampled (VLM vision placeholders), masked out of the recomputed distribution too."""
        self.scorer = TokenScorer(self.position_scheme(), label=type(self).__name__)
        self.engine_client = EngineClient()
        self.ref_model: torch.nn.Module | None = None
        if need_reference and not lora:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        eos = tokenizer.eos_token_id
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids = {eos} if eos is not None else set()
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif isinstance(gen_eos, list):
            ids.update(gen_eos)
        self.eos_ids = sorted(ids)
        self._prompt_cache: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ building
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        dtype: str = "float32",
        lora: LoraConfig | None = None,
        gradient_checkpointing: bool = False,
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
        need_reference: bool = False,
        **kwargs: Any,
    ) -> TextPolicy:
        """Load model and tokenizer with `from_pretrained` (hub id or local path); wrap LoRA if enabled."""
        return load_token_policy(
            cls,
            name_or_path,
            dtype=dtype,
            lora=lora,
            gradient_checkpointing=gradient_checkpointing,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
            need_reference=need_reference,
            **kwargs,
        )

    @staticmethod
    def _load_pretrained(name_or_path: str, load_kwargs: dict[str, Any]) -> tuple[Any, torch.nn.Module]:
        """(tokenizer, model) from a hub id or folder; model families override this."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            name_or_path, trust_remote_code=load_kwargs["trust_remote_code"]
        )
        return tokenizer, AutoModelForCausalLM.from_pretrained(name_or_path, **load_kwargs)

    @staticmethod
    def _lora_targets(target_modules: list[str] | str) -> list[str] | str:
        """The peft `target_modules` for the configured ones (families narrow them, e.g. VLMs)."""
        return target_modules

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ rollout engine
    @property
    def engine(self) -> Any:
        """The `mmalign.engines.RolloutEngine` that samples instead of `generate` (None: ``hf``)."""
        return self.engine_client.engine

    @engine.setter
    def engine(self, engine: Any) -> None:
        self.engine_client.engine = engine

    @property
    def engine_seed(self) -> int:
        return self.engine_client.seed

    @engine_seed.setter
    def engine_seed(self, seed: int) -> None:
        self.engine_client.seed = seed

    def seed(self, seed: int) -> None:
        """Seed the rollout engine's sampling (`engine_seed`)."""
        self.engine_seed = seed

    def setup(self, run: RunInfo) -> None:
        """Build the rollout engine named by ``rollout.engine`` (none for ``hf``: sampling uses `generate`)."""
        self.engine_client.setup(run, loop=self.loop, fill_defaults=self._engine_defaults)

    def _engine_defaults(self, engine: str, kwargs: dict[str, Any], run: RunInfo) -> None:
        """Fill the engine's options the config left out: the in-process model and tokenizer for ``fake``,
        the model folder or hub id (``model.name_or_path``) otherwise."""
        if engine == "fake":
            kwargs.setdefault("model", self.model)
            kwargs.setdefault("tokenizer", self.tokenizer)
        else:
            kwargs.setdefault("model", run.cfg.model.name_or_path)

    def sync_engine(self, step: int = 0) -> None:
        """Push the current weights to the rollout engine (`EngineClient.sync`)."""
        self.engine_client.sync(self.model, lora=self.lora, step=step)

    @property
    def needs_logp_old(self) -> bool:
        """With an engine, ``logp_old`` is recomputed with the trainer's weights (the engine's own log-probs
        only enter the importance-sampling correction)."""
        return self.engine is not None

    def on_train_step(self, step: int) -> None:
        """Push the current weights to the engine when they changed, and seed its sampling for this step."""
        self.engine_client.on_train_step(step, self.sync_engine)

    def after_optimizer_step(self) -> None:
        self.engine_client.after_optimizer_step()

    # ------------------------------------------------------------------ rollout
    @property
    def max_actions(self) -> int:
        """``max_new_tokens``; with a multi-turn loop its cap on the completion region (generated and
        inserted tokens: every completion position is an action, masked or not)."""
        limits = getattr(self.loop, "limits", None)
        return limits(self)[1] if self.loop.multi_turn and limits is not None else self.max_new_tokens

    @torch.no_grad()
    def rollout(self, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool = True) -> Rollout:
        """Sample `group_size` samples for each row's ``prompt`` through the rollout loop (see
        `Policy.rollout` and `mmalign.data.rollout_loops`)."""
        return self.loop.rollout(self, rows, group_size, compute_logp=compute_logp)

    def rollout_stats(self, rollout: Rollout) -> dict[str, Tensor]:
        """Completion length and truncated share; multi-turn rollouts add the number of turns, of inserted
        tokens, ``tool_call_rate`` (samples with any insertion) and ``over_turn_frac`` (stopped at
        ``max_turns``)."""
        stats: dict[str, Tensor] = {}
        n_tok = rollout.outputs.get("num_tokens")
        if isinstance(n_tok, Tensor):
            stats["completion_len/mean"] = n_tok.float()
        trunc = rollout.outputs.get("truncated")
        if isinstance(trunc, Tensor):
            stats["truncated_frac"] = trunc.float()
        for key, name in (("num_turns", "num_turns/mean"), ("num_inserted_tokens", "inserted_len/mean")):
            value = rollout.outputs.get(key)
            if isinstance(value, Tensor):
                stats[name] = value.float()
        inserted = rollout.outputs.get("num_inserted_tokens")
        if isinstance(inserted, Tensor):
            stats["tool_call_rate"] = (inserted > 0).float()
        reasons = rollout.outputs.get("stop_reasons")
        if isinstance(reasons, list) and len(reasons) == len(rollout):
            stats["over_turn_frac"] = torch.tensor([r == "max_turns" for r in reasons], dtype=torch.float32)
        return stats

    # ------------------------------------------------------------------ log-probs
    def _logprobs(
        self,
        model: torch.nn.Module,
        rollout: Rollout,
        *,
        grad: bool,
        entropy_out: list[Tensor] | None = None,
        chunked: bool | None = None,
    ) -> Tensor:
        """Float[B, T] log-probs of the stored completion tokens under `model` (`TokenScorer.logprobs`)."""
        opts = ScoringOptions(
            temperature=self.temperature,
            chunk_size=self.logprob_chunk_size,
            shared_prefix=self.shared_prefix,
            suppressed_ids=tuple(self.suppressed_ids),
            memory_mb=self.logprob_memory_mb,
        )
        return self.scorer.logprobs(
            model, rollout, opts, base_model=self.model, grad=grad, entropy_out=entropy_out, chunked=chunked
        )

    def _use_chunked(self, model: torch.nn.Module) -> bool:
        """Whether log-probs under `model` are scored chunked (`TokenScorer.use_chunked`)."""
        return self.scorer.use_chunked(model, self.logprob_chunk_size)

    def action_stats(self, rollout: Rollout) -> ActionStats:
        """Per-token log-probs of the stored completions, with grad, and their entropies (logged as
        ``entropy``, read by `mmalign doctor`'s entropy-collapse check)."""
        entropy: list[Tensor] = []
        logp = self._logprobs(self.forward_model, rollout, grad=True, entropy_out=entropy)
        return ActionStats(logp=logp, entropy=entropy[0])

    @torch.no_grad()
    def reference_logprobs(self, rollout: Rollout) -> Tensor:
        """Log-probs under the reference: the adapter disabled (LoRA) or the frozen copy."""
        if self.lora:
            with self.model.disable_adapter():
                return self._logprobs(self.model, rollout, grad=False)
        if self.ref_model is None:
            raise RuntimeError("no reference model: construct TextPolicy with need_reference=True")
        return self._logprobs(self.ref_model, rollout, grad=False)

    # ------------------------------------------------------------------ weights
    def save(self, path: str | Path) -> None:
        """`save_pretrained` of the adapter (LoRA) or the whole model, plus the tokenizer."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
