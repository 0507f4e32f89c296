"""Text policy: any Hugging Face causal LM (hub id or local folder), one action = one token.

- Rollouts use ``model.generate`` (temperature, top-p, top-k, max new tokens, stop strings).
- Per-token log-probs are recomputed with grad from one forward pass over prompt + completion,
  with the logits divided by the sampling temperature (the distribution that was sampled).
- The action mask covers the completion up to and including the EOS token or the last token of
  a stop string; everything after (padding) is masked out.
- A rollout loop (`mmalign.rollout_loops`, ``rollout.loop``) decides what a sample is: one completion
  (``single_turn``, the default) or several generated turns with environment content inserted between
  them (``multi_turn``). The payload always describes the whole sequence: ``prompt_ids`` /
  ``prompt_mask`` (left-padded), ``completion_ids`` (the completion region: generated and inserted tokens,
  right-padded) and ``completion_attention_mask`` (its real tokens, what the model attends to), kept
  apart from ``Rollout.mask`` (the generated tokens only: the loss mask).
- LoRA through peft (the reference model is then the same network with the adapter disabled), or
  full fine-tuning (a frozen copy serves as reference, made only when a KL penalty is used).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor
from tqdm.auto import tqdm

from mmalign.batch import Rollout, group_fields, left_pad
from mmalign.config import LoraConfig
from mmalign.logprobs import (
    check_agreement,
    chunked_token_logprobs,
    final_hidden_states,
    output_head,
    selective_log_softmax,
    token_entropy,
)
from mmalign.policies.base import ActionStats, Policy, RunInfo, torch_dtype
from mmalign.rollout_loops import Conversation, Environment, Insert, RolloutLoop, Segment, make_loop

log = logging.getLogger(__name__)

_TURN_PROBE = "MMALIGN_ASSISTANT_TURN_PROBE"
"""Stand-in assistant message used to find the strings a chat template puts around an inserted message."""


def completion_mask(completion_ids: Tensor, eos_ids: list[int], stop_lengths: Tensor | None = None) -> Tensor:
    """Bool[B,T]: tokens up to and including the first EOS (or the end given by `stop_lengths`)."""
    b, t = completion_ids.shape
    lengths = torch.full((b,), t, dtype=torch.long, device=completion_ids.device)
    if eos_ids:
        is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
        has = is_eos.any(dim=1)
        first = is_eos.int().argmax(dim=1)
        lengths = torch.where(has, first + 1, lengths)
    if stop_lengths is not None:
        lengths = torch.minimum(lengths, stop_lengths.clamp(max=t))
    return torch.arange(t, device=completion_ids.device)[None, :] < lengths[:, None]


class TextPolicy(Policy):
    """A causal language model as a GRPO policy. See the module docstring."""

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
        logprob_chunk_size: int | None = 1024,
        loop: RolloutLoop | str = "single_turn",
        loop_kwargs: dict[str, Any] | None = None,
        environment: Environment | None = None,
    ) -> None:
        self.loop = (
            make_loop(loop, environment=environment, **(loop_kwargs or {})) if isinstance(loop, str) else loop
        )
        """How `rollout` turns rows into samples (`mmalign.rollout_loops`): a loop object, or a registered
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
        if logprob_chunk_size is not None and logprob_chunk_size < 1:
            raise ValueError(f"logprob_chunk_size must be >= 1 or None, got {logprob_chunk_size}")
        self.logprob_chunk_size = logprob_chunk_size
        """Score the completion tokens through the output head this many at a time, from the final hidden
        states (`mmalign.logprobs.chunked_token_logprobs`); None: from the model's full [B, T, V] logits."""
        self._chunking_checked = False
        self.engine: Any = None
        """A `mmalign.engines.RolloutEngine` that samples instead of `generate` (built in `setup` from
        ``rollout.engine``, or set directly)."""
        self.engine_seed = 0
        self._engine_stale = True
        """The engine holds older weights than `model` (synced in `on_train_step`)."""
        self._run: RunInfo | None = None
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
        load_kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype), "trust_remote_code": trust_remote_code}
        if attn_implementation:
            load_kwargs["attn_implementation"] = attn_implementation
        try:
            tokenizer, model = cls._load_pretrained(name_or_path, load_kwargs)
        except OSError as e:
            raise OSError(
                f"cannot load the model {name_or_path!r} (config key model.name_or_path): {e}"
            ) from e
        if gradient_checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        use_lora = bool(lora and lora.enabled)
        if use_lora:
            from peft import LoraConfig as PeftLoraConfig
            from peft import get_peft_model

            assert lora is not None
            peft_cfg = PeftLoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=cls._lora_targets(lora.target_modules),
                task_type="CAUSAL_LM",
            )
            model = get_peft_model(model, peft_cfg)
        return cls(model, tokenizer, need_reference=need_reference, lora=use_lora, **kwargs)

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

    # ------------------------------------------------------------------ prompts
    def format_prompt(self, prompt: str) -> str:
        if not self.use_chat_template:
            return prompt
        messages = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": prompt})
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _prompt_token_ids(self, prompt: str) -> list[int]:
        """Token ids of the formatted prompt (cached per distinct prompt)."""
        ids = self._prompt_cache.get(prompt)
        if ids is None:
            ids = self.tokenizer(self.format_prompt(prompt), add_special_tokens=not self.use_chat_template)[
                "input_ids"
            ]
            if len(self._prompt_cache) < 100_000:
                self._prompt_cache[prompt] = ids
        return ids

    def _encode_prompts(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """Left-padded prompt ids and attention mask; each distinct prompt is tokenized once."""
        return self._left_pad([self._prompt_token_ids(p) for p in prompts])

    def _left_pad(self, seqs: list[list[int]]) -> tuple[Tensor, Tensor]:
        """Left-padded ids (the tokenizer's pad id) and attention mask of token lists."""
        return left_pad(seqs, self.tokenizer.pad_token_id)

    # ------------------------------------------------------------------ inserted messages
    def _chat_content(self, text: str, num_images: int) -> Any:
        """A message's ``content`` for the chat template (a VLM lists image parts first)."""
        if num_images:
            raise ValueError(f"{type(self).__name__} cannot insert images (use a VLM policy)")
        return text

    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def insert_text(self, insert: Insert, previous: Segment | None) -> str:
        """The text that appends `insert` to a conversation whose last segment is `previous`.

        ``role=None``, or a policy without a chat template: ``insert.text`` verbatim. Otherwise what the
        chat template itself writes after an assistant turn: the end of that turn (less the EOS token the
        model already generated), the inserted message with ``insert.role``, and the opening of the next
        assistant turn. Found by rendering a probe conversation with and without the new message."""
        n_images = len(insert.images)
        if insert.role is None or not self.use_chat_template:
            if n_images:
                raise ValueError("an Insert with images needs a chat role (and a chat template)")
            return insert.text
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        probe = [
            *system,
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": _TURN_PROBE},
        ]
        base = self._render_chat(probe, False)
        message = {"role": insert.role, "content": self._chat_content(insert.text, n_images)}
        full = self._render_chat([*probe, message], True)
        if _TURN_PROBE not in base or not full.startswith(base):
            raise ValueError(
                "the chat template does not render a conversation as a prefix of its continuation, so a "
                "message cannot be appended after a generated turn; return Insert(role=None, text=...) with "
                "the exact text instead"
            )
        closing = base[base.rindex(_TURN_PROBE) + len(_TURN_PROBE) :]
        if previous is not None and previous.ids and previous.ids[-1] in self.eos_ids:
            eos_text = self.tokenizer.decode([previous.ids[-1]], skip_special_tokens=False)
            if eos_text and closing.startswith(eos_text):
                closing = closing[len(eos_text) :]
        return closing + full[len(base) :]

    # ------------------------------------------------------------------ trainer hooks
    def setup(self, run: RunInfo) -> None:
        """Build the rollout engine named by ``rollout.engine`` (none for ``hf``: sampling uses `generate`)."""
        self._run = run
        r = run.cfg.rollout
        if r.engine == "hf":
            return
        from mmalign.config import ConfigError
        from mmalign.engines import get_engine

        if self.loop.multi_turn:
            raise ConfigError(
                f"{run.cfg.source}: key 'rollout.loop': the {self.loop.name!r} loop samples with the policy's "
                f"own generate; leave rollout.engine at 'hf' (got {r.engine!r})"
            )

        kwargs = dict(r.engine_kwargs)
        self._engine_defaults(r.engine, kwargs, run)
        try:
            self.engine = get_engine(r.engine, **kwargs)
        except TypeError as e:
            raise ConfigError(f"{run.cfg.source}: key 'rollout.engine_kwargs': {e}") from None
        self._engine_stale = True

    def _engine_defaults(self, engine: str, kwargs: dict[str, Any], run: RunInfo) -> None:
        """Fill the engine's options the config left out: the in-process model and tokenizer for ``fake``,
        the model folder or hub id (``model.name_or_path``) otherwise."""
        if engine == "fake":
            kwargs.setdefault("model", self.model)
            kwargs.setdefault("tokenizer", self.tokenizer)
        else:
            kwargs.setdefault("model", run.cfg.model.name_or_path)

    @property
    def max_actions(self) -> int:
        """``max_new_tokens``; with a multi-turn loop its cap on the completion region (generated and
        inserted tokens: every completion position is an action, masked or not)."""
        limits = getattr(self.loop, "limits", None)
        return limits(self)[1] if self.loop.multi_turn and limits is not None else self.max_new_tokens

    @property
    def needs_logp_old(self) -> bool:
        """With an engine, ``logp_old`` is recomputed with the trainer's weights (the engine's own log-probs
        only enter the importance-sampling correction)."""
        return self.engine is not None

    def on_train_step(self, step: int) -> None:
        """Push the current weights to the engine when they changed, and seed its sampling for this step."""
        if self.engine is None:
            return
        run = self._run or RunInfo(cfg=None, accelerator=None)
        if self._engine_stale:
            self.sync_engine(step)
        seed = run.cfg.seed if run.cfg is not None else 0
        self.engine_seed = seed * 1_000_003 + step * 7919 + run.rank

    def after_optimizer_step(self) -> None:
        self._engine_stale = self.engine is not None

    def rollout_stats(self, rollout: Rollout) -> dict[str, Tensor]:
        """Completion length (generated tokens) and the share of truncated samples; multi-turn rollouts add
        the number of generated turns, of inserted tokens, ``tool_call_rate`` (the share of samples into
        which the environment inserted anything: tool use collapsing to 0 is the classic failure of
        multi-turn RL) and ``over_turn_frac`` (samples stopped at ``max_turns``)."""
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

    def sync_engine(self, step: int = 0) -> None:
        """Push the current weights to the rollout engine (merged LoRA, or the adapter where the engine
        loads adapters); raises `WeightSyncError` past ``rollout.sync_timeout_s`` instead of hanging."""
        from mmalign.engines import adapter_state_dict, full_state_dict

        run = self._run
        model = (
            run.accelerator.unwrap_model(self.model) if run is not None and run.accelerator else self.model
        )
        if getattr(self.engine, "supports_lora_adapters", False) and self.lora:
            state, lora = adapter_state_dict(model), True
        else:
            state, lora = full_state_dict(model), False
        timeout = run.cfg.rollout.sync_timeout_s if run is not None and run.cfg is not None else None
        limit = {} if timeout is None else {"timeout_s": timeout}  # outside a run: the engine's default
        self.engine.sync_weights(state, lora=lora, step=step, **limit)
        self._engine_stale = False

    # ------------------------------------------------------------------ rollout
    @torch.no_grad()
    def rollout(self, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool = True) -> Rollout:
        """Sample `group_size` samples for each row's ``prompt`` through the rollout loop (see
        `Policy.rollout` and `mmalign.rollout_loops`)."""
        return self.loop.rollout(self, rows, group_size, compute_logp=compute_logp)

    @staticmethod
    def _rollout_fields(
        rows: list[dict[str, Any]], group_size: int
    ) -> tuple[list[str], Tensor, dict[str, list[Any]]]:
        """Prompts, group ids and dataset columns, one entry per sample (`mmalign.batch.group_fields`)."""
        return group_fields(rows, group_size)

    @torch.no_grad()
    def single_turn_rollout(
        self, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool = True
    ) -> Rollout:
        """One completion per sample (the ``single_turn`` loop)."""
        prompts, group, columns = self._rollout_fields(rows, group_size)
        if self.engine is not None:
            return self._rollout_with_engine(rows, group_size, prompts, group, columns)
        parts = self._generate_in_chunks(prompts, self._generate)
        p_width = max(p[0].shape[1] for p in parts)
        c_width = max(p[2].shape[1] for p in parts)
        pad = self.tokenizer.pad_token_id
        prompt_ids = torch.cat([_pad_left(p[0], p_width, pad) for p in parts])
        prompt_mask = torch.cat([_pad_left(p[1], p_width, 0) for p in parts])
        completion_ids = torch.cat([_pad_right(p[2], c_width, pad) for p in parts])
        return self._finish_rollout(
            prompts, group, columns, prompt_ids, prompt_mask, completion_ids, compute_logp
        )

    def _rollout_with_engine(
        self,
        rows: list[dict[str, Any]],
        group_size: int,
        prompts: list[str],
        group: Tensor,
        columns: dict[str, list[Any]],
    ) -> Rollout:
        """Sample with `self.engine`; keep its log-probs as ``rollout.logp_sampler`` and recompute
        ``logp_old`` with the trainer's own weights (the IS correction compares the two)."""
        from mmalign.engines import outputs_to_tensors

        ids, att = self._encode_prompts([str(r["prompt"]) for r in rows])
        token_lists = [row[m.bool()].tolist() for row, m in zip(ids, att, strict=True)]
        outs = self.engine.generate(token_lists, group_size, self._engine_sampling())
        completion_ids, logp_engine, _ = outputs_to_tensors(outs, self.tokenizer.pad_token_id)
        rollout = self._finish_rollout(
            prompts,
            group,
            columns,
            ids.repeat_interleave(group_size, 0),
            att.repeat_interleave(group_size, 0),
            completion_ids,
            compute_logp=True,
        )
        return self._keep_engine_logprobs(rollout, logp_engine)

    def _engine_sampling(self, suppress_token_ids: list[int] | None = None) -> Any:
        """The engine's `SamplingSpec`: this policy's temperature, top-p / top-k, length, stops and the
        step's engine seed."""
        from mmalign.engines import SamplingSpec

        return SamplingSpec(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            stop=list(self.stop_strings),
            stop_token_ids=list(self.eos_ids),
            seed=self.engine_seed,
            suppress_token_ids=list(suppress_token_ids or []),
        )

    @staticmethod
    def _keep_engine_logprobs(rollout: Rollout, logp_engine: Tensor) -> Rollout:
        """``rollout.logp_sampler``: the engine's log-probs, cut or padded to the rollout's width, 0 where masked."""
        width = rollout.mask.shape[1]
        logp_engine = _pad_right(logp_engine.float(), width, 0)[:, :width]
        rollout.logp_sampler = logp_engine.masked_fill(~rollout.mask, 0.0)
        return rollout

    def _finish_rollout(
        self,
        prompts: list[str],
        group: Tensor,
        columns: dict[str, list[Any]],
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        completion_ids: Tensor,
        compute_logp: bool,
        extra_payload: dict[str, Any] | None = None,
    ) -> Rollout:
        """Masks, texts and (optionally) log-probs of sampled completions (`extra_payload` joins the payload)."""
        pad = self.tokenizer.pad_token_id
        stop_lengths = self._stop_lengths(completion_ids) if self.stop_strings else None
        mask = completion_mask(completion_ids, self.eos_ids, stop_lengths)
        completion_ids = completion_ids.masked_fill(~mask, pad)
        num_tokens = mask.sum(dim=1)
        ends_with_eos = torch.zeros(len(prompts), dtype=torch.bool)
        if self.eos_ids:
            last = completion_ids.gather(1, (num_tokens - 1).clamp(min=0)[:, None]).squeeze(1)
            ends_with_eos = torch.isin(last, torch.tensor(self.eos_ids)) & (num_tokens > 0)
        stopped = ends_with_eos if stop_lengths is None else ends_with_eos | (stop_lengths <= num_tokens)
        texts = self.tokenizer.batch_decode(
            [ids[:n].tolist() for ids, n in zip(completion_ids, num_tokens.tolist(), strict=True)],
            skip_special_tokens=True,
        )
        rollout = Rollout(
            group=group,
            mask=mask,
            prompts=prompts,
            columns=columns,
            outputs={"texts": texts, "num_tokens": num_tokens, "truncated": ~stopped},
            payload={
                "prompt_ids": prompt_ids,
                "prompt_mask": prompt_mask,
                "completion_ids": completion_ids,
                "completion_attention_mask": mask.long(),
                **(extra_payload or {}),
            },
        )
        if compute_logp:
            rollout.logp_old = self._logprobs(self.model, rollout, grad=False)
        return rollout

    def _sampling_kwargs(self) -> dict[str, Any]:
        """`generate` arguments for sampling (temperature, top-p/k, length, EOS, stop strings)."""
        kwargs: dict[str, Any] = {
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "pad_token_id": self.tokenizer.pad_token_id,
            "eos_token_id": self.eos_ids or None,
        }
        if self.stop_strings:
            kwargs["stop_strings"] = self.stop_strings
            kwargs["tokenizer"] = self.tokenizer
        if _sharded_over_processes(self.model):
            # every rank must run the same number of forward passes (each one all-gathers the shards)
            kwargs["synced_gpus"] = True
        return kwargs

    def _generate_in_chunks(self, items: list[Any], generate: Callable[[list[Any]], Any]) -> list[Any]:
        """`generate` over chunks of at most `generation_batch_size` items, in eval mode, with a progress bar."""
        chunk = self.generation_batch_size or len(items)
        was_training = self.model.training
        self.model.eval()
        parts: list[Any] = []
        bar = tqdm(total=len(items), desc="rollout", leave=False, disable=len(items) <= chunk)
        try:
            for start in range(0, len(items), chunk):
                part = items[start : start + chunk]
                parts.append(generate(part))
                bar.update(len(part))
        finally:
            bar.close()
            if was_training:
                self.model.train()
        return parts

    def _generate(self, prompts: list[str]) -> tuple[Tensor, Tensor, Tensor]:
        ids, att = self._encode_prompts(prompts)
        ids, att = ids.to(self.device), att.to(self.device)
        kwargs = self._sampling_kwargs()
        if self.shared_prefix and ids.shape[1] > 1:
            kwargs["past_key_values"] = self._prefill(prompts, ids, att)
        out = self.model.generate(input_ids=ids, attention_mask=att, **kwargs)
        return ids.cpu(), att.cpu(), out[:, ids.shape[1] :].cpu()

    def _prefill(self, prompts: list[str], ids: Tensor, att: Tensor) -> Any:
        """KV cache of all but the last prompt token, computed once per distinct prompt and gathered
        for every sample; `generate` then only runs the last prompt token and the new ones."""
        from transformers import DynamicCache

        index: dict[str, int] = {}
        inverse = torch.tensor([index.setdefault(p, len(index)) for p in prompts], device=ids.device)
        first = torch.tensor([prompts.index(p) for p in index], device=ids.device)
        u_ids, u_att = ids[first, :-1], att[first, :-1]
        cache = DynamicCache()
        self.model(
            input_ids=u_ids,
            attention_mask=u_att,
            position_ids=(u_att.cumsum(dim=1) - 1).clamp(min=0),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        cache.batch_select_indices(inverse)
        return cache

    # ------------------------------------------------------------------ multi-turn primitives
    # (`mmalign.rollout_loops.TurnPolicy`: the loop calls these; VLMPolicy overrides the encoding parts)
    def start_conversations(self, rows: list[dict[str, Any]], group_size: int) -> list[Conversation]:
        """`group_size` empty conversations per row; the prompt is tokenized once per row."""
        conversations: list[Conversation] = []
        for row in rows:
            prompt = self._prompt_token_ids(str(row["prompt"]))
            for g in range(group_size):
                conversations.append(
                    Conversation(index=len(conversations), group_index=g, row=row, prompt=prompt)
                )
        return conversations

    def _sequence_ids(self, conversation: Conversation) -> list[int]:
        """Prompt + completion region so far, as one token list."""
        return list(conversation.prompt) + [t for seg in conversation.segments for t in seg.ids]

    def generate_turn(self, conversations: list[Conversation], budgets: list[int]) -> list[Segment]:
        """One batched `generate` over the conversations' whole sequences (left-padded), then each new turn
        cut to its budget and after its EOS / stop string."""
        max_new = max(budgets)
        pad = self.tokenizer.pad_token_id

        def generate(chunk: list[Conversation]) -> Tensor:
            ids, att = self._left_pad([self._sequence_ids(c) for c in chunk])
            kwargs = {**self._sampling_kwargs(), "max_new_tokens": max_new}
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=att.to(self.device), **kwargs
            )
            return out[:, ids.shape[1] :].cpu()

        parts = self._generate_in_chunks(conversations, generate)
        new = torch.cat([_pad_right(x, max(q.shape[1] for q in parts), pad) for x in parts])
        return self._turn_segments(new, budgets)

    def _turn_segments(self, new_ids: Tensor, budgets: list[int]) -> list[Segment]:
        """Generated turns as segments: at most `budgets[i]` tokens, up to and including EOS / stop string."""
        segments = []
        for row, budget in zip(new_ids, budgets, strict=True):
            ids = row[:budget][None]
            stop = self._stop_lengths(ids) if self.stop_strings else None
            n = int(completion_mask(ids, self.eos_ids, stop).sum())
            kept = ids[0, :n].tolist()
            finished = bool(kept) and kept[-1] in self.eos_ids
            if stop is not None and int(stop[0]) <= n:
                finished = True
            text = self.tokenizer.decode(kept, skip_special_tokens=True)
            segments.append(Segment(ids=kept, trained=True, text=text, finished=finished))
        return segments

    def insert_segment(self, conversation: Conversation, insert: Insert) -> Segment:
        """The tokens of `insert` after `conversation` (`insert_text`, tokenized without special tokens)."""
        previous = conversation.segments[-1] if conversation.segments else None
        text = self.insert_text(insert, previous)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return Segment(ids=list(ids), trained=False, text=insert.text)

    def finish_conversations(
        self,
        rows: list[dict[str, Any]],
        group_size: int,
        conversations: list[Conversation],
        *,
        compute_logp: bool,
    ) -> Rollout:
        """The `Rollout` of finished conversations: the completion region holds every segment in order;
        ``mask`` marks the generated tokens only, ``completion_attention_mask`` every real token."""
        prompts, group, columns = self._rollout_fields(rows, group_size)
        b = len(conversations)
        width = max(1, max(c.length for c in conversations))
        pad = self.tokenizer.pad_token_id
        completion_ids = torch.full((b, width), pad, dtype=torch.long)
        attention = torch.zeros((b, width), dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.bool)
        for i, conv in enumerate(conversations):
            at = 0
            for seg in conv.segments:
                n = len(seg.ids)
                completion_ids[i, at : at + n] = torch.tensor(seg.ids, dtype=torch.long)
                attention[i, at : at + n] = 1
                mask[i, at : at + n] = seg.trained
                at += n
        texts = self.tokenizer.batch_decode(
            [ids[: c.length].tolist() for ids, c in zip(completion_ids, conversations, strict=True)],
            skip_special_tokens=True,
        )
        outputs: dict[str, Any] = {
            "texts": texts,
            "num_tokens": mask.sum(dim=1),
            "truncated": torch.tensor([c.truncated for c in conversations], dtype=torch.bool),
            "turns": [c.turns for c in conversations],
            "inserted_texts": [c.inserted_texts for c in conversations],
            "num_turns": torch.tensor([len(c.turns) for c in conversations], dtype=torch.long),
            "num_inserted_tokens": attention.sum(dim=1) - mask.sum(dim=1),
            "stop_reasons": [c.stop_reason for c in conversations],
        }
        payload = {
            **self._conversation_prompt_payload(conversations, columns),
            "completion_ids": completion_ids,
            "completion_attention_mask": attention,
        }
        rollout = Rollout(
            group=group, mask=mask, prompts=prompts, columns=columns, outputs=outputs, payload=payload
        )
        if compute_logp:
            rollout.logp_old = self._logprobs(self.model, rollout, grad=False)
        return rollout

    def _conversation_prompt_payload(
        self, conversations: list[Conversation], columns: dict[str, list[Any]]
    ) -> dict[str, Any]:
        """The prompt part of a multi-turn payload (VLMs add token types and vision inputs, and columns)."""
        prompt_ids, prompt_mask = self._left_pad([list(c.prompt) for c in conversations])
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask}

    def _stop_lengths(self, completion_ids: Tensor) -> Tensor:
        """Per row, the number of tokens up to the end of the first stop string (T + 1 if none).

        Decodes prefixes (so multi-byte characters split across tokens are handled) and finds the
        shortest prefix containing a stop string by bisection: O(T log T) decodes per matching row.
        """
        b, t = completion_ids.shape
        out = torch.full((b,), t + 1, dtype=torch.long)

        def hit(ids: list[int], k: int) -> bool:
            text = self.tokenizer.decode(ids[:k], skip_special_tokens=False)
            return any(s in text for s in self.stop_strings)

        for i in range(b):
            ids = completion_ids[i].tolist()
            if not hit(ids, t):
                continue
            lo, hi = 1, t  # smallest k with hit(ids, k)
            while lo < hi:
                mid = (lo + hi) // 2
                if hit(ids, mid):
                    hi = mid
                else:
                    lo = mid + 1
            out[i] = lo
        return out

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
        """Float[B, T] log-probs of the stored completion tokens (0 where masked); with `entropy_out` (a list)
        the per-token entropy of the same distribution (no grad, 0 where masked) is appended to it.

        With ``logprob_chunk_size`` (`chunked` None: when it is set) the log-probs come from the final hidden
        states through the output head, a chunk of tokens at a time (`mmalign.logprobs`); otherwise from the
        full [B, T, V] logits. The first chunked call checks the two agree on one sample."""
        chunked = self._use_chunked(model) if chunked is None else chunked
        p = rollout.payload
        prompt_ids, prompt_mask = p["prompt_ids"].to(self.device), p["prompt_mask"].to(self.device)
        completion_ids = p["completion_ids"].to(self.device)
        mask = rollout.mask.to(self.device)
        attention = completion_attention(rollout).to(self.device)
        with torch.set_grad_enabled(grad):
            if self.shared_prefix and not self._gradient_checkpointing():
                features = self._shared_prefix_logits(
                    model,
                    rollout.group,
                    prompt_ids,
                    prompt_mask,
                    completion_ids,
                    attention,
                    hidden=chunked,
                    grad=grad,
                )
            else:
                features = self._plain_logits(
                    model, prompt_ids, prompt_mask, completion_ids, attention, hidden=chunked, grad=grad
                )
            logp, entropy = self._score_features(
                model, features, completion_ids, mask, chunked=chunked, with_entropy=entropy_out is not None
            )
        if chunked and not self._chunking_checked:
            self._check_chunking(model, rollout, logp)
        if entropy_out is not None:
            assert entropy is not None
            entropy_out.append(entropy.masked_fill(~mask, 0.0))
        return logp.masked_fill(~mask, 0.0)

    def _use_chunked(self, model: torch.nn.Module) -> bool:
        """Chunked log-probs when ``logprob_chunk_size`` is set, except under FSDP2: the output head would
        run outside the root module's forward, where its weight is still sharded (our limitation for now;
        the full-logits path is used and a line is logged once)."""
        if not self.logprob_chunk_size:
            return False
        from mmalign.distributed import is_fsdp2

        if is_fsdp2(model):
            if not getattr(self, "_fsdp_chunk_logged", False):
                log.info(
                    "chunked log-probs: off under FSDP2 (the output head is sharded); using the full logits"
                )
                self._fsdp_chunk_logged = True
            return False
        return True

    def _score_features(
        self,
        model: torch.nn.Module,
        features: Tensor,
        completion_ids: Tensor,
        mask: Tensor,
        *,
        chunked: bool,
        with_entropy: bool,
        suppressed_ids: list[int] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """(logp, entropy or None) Float[B, T] of `completion_ids` from `features`: final hidden states
        (`chunked`) or logits."""
        if chunked:
            assert self.logprob_chunk_size is not None
            return chunked_token_logprobs(
                features,
                output_head(model),
                completion_ids,
                mask,
                chunk_tokens=self.logprob_chunk_size,
                temperature=self.temperature,
                suppressed_ids=suppressed_ids,
                with_entropy=with_entropy,
            )
        logits = features
        if suppressed_ids:  # the distribution that was sampled
            logits = logits.index_fill(-1, torch.tensor(suppressed_ids, device=logits.device), float("-inf"))
        if self.temperature != 1.0:
            logits = logits / self.temperature
        logp = selective_log_softmax(logits, completion_ids)
        return logp, (token_entropy(logits.detach()) if with_entropy else None)

    def _check_chunking(self, model: torch.nn.Module, rollout: Rollout, logp: Tensor) -> None:
        """Once per policy: the chunked log-probs of the first sample equal the full-logits ones
        (`mmalign.logprobs.check_agreement`), or a clear error before anything trains on them."""
        first = rollout[[0]]
        with torch.no_grad():
            full = self._logprobs(model, first, grad=False, chunked=False)
        dtype = next(self.model.parameters()).dtype
        check_agreement(
            logp[:1].detach(),
            full,
            first.mask,
            what=f"{type(self).__name__} ({type(self.model).__name__})",
            model_dtype=dtype,
        )
        self._chunking_checked = True

    def _gradient_checkpointing(self) -> bool:
        m = self.model
        flag = getattr(m, "is_activation_checkpointing", None)  # transformers >= 5 name
        if flag is None:
            flag = getattr(m, "is_gradient_checkpointing", False)
        return bool(flag) and m.training

    @staticmethod
    def _plain_logits(
        model: torch.nn.Module,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        completion_ids: Tensor,
        completion_attention: Tensor,
        *,
        hidden: bool = False,
        grad: bool = True,
    ) -> Tensor:
        """One forward over prompt + completion region per sample; logits that predict each completion-region
        token (`completion_attention`: its real tokens, generated or inserted). With `hidden`, the final
        hidden states at the same positions instead (the output head's input; no logits computed)."""
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention = torch.cat([prompt_mask, completion_attention.long()], dim=1)
        position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
        t = completion_ids.shape[1]
        inputs = dict(
            input_ids=input_ids, attention_mask=attention, position_ids=position_ids, use_cache=False
        )
        if hidden:
            states, _ = final_hidden_states(model, grad=grad, **inputs)
            return states[:, -t - 1 : -1, :]
        out = model(**inputs, logits_to_keep=t + 1)
        return out.logits[:, -t - 1 : -1, :]

    @staticmethod
    def _shared_prefix_logits(
        model: torch.nn.Module,
        group: Tensor,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        completion_ids: Tensor,
        completion_attention: Tensor,
        *,
        hidden: bool = False,
        grad: bool = True,
    ) -> Tensor:
        """Shared-prefix forward (Prefix Grouper): each group's prompt is encoded once, its keys and
        values are gathered for the group's completions, which attend to them through the KV cache.

        Log-probs and parameter gradients equal those of `_plain_logits` (the prompt's KV tensors
        stay in the autograd graph, so gradients flow back through them into the prompt forward);
        the prompt's forward and backward cost is paid once per group instead of once per sample.
        With `hidden`, the final hidden states at the same positions instead of the logits.
        """
        from transformers import DynamicCache

        uniq, inverse = torch.unique(group.to(prompt_ids.device), return_inverse=True)
        first = torch.full((uniq.numel(),), group.numel(), dtype=torch.long, device=prompt_ids.device)
        first = first.scatter_reduce(
            0, inverse, torch.arange(group.numel(), device=prompt_ids.device), reduce="amin"
        )
        u_ids, u_mask = prompt_ids[first], prompt_mask[first]
        keep = u_mask.any(dim=0)  # drop columns that are padding in every unique prompt
        if not bool(keep.all()):
            u_ids, u_mask = u_ids[:, keep], u_mask[:, keep]
            prompt_mask = prompt_mask[:, keep]
        u_pos = (u_mask.cumsum(dim=1) - 1).clamp(min=0)
        # Under DDP the prefix pass goes through the inner module: DDP expects one forward per
        # backward; every parameter still gets one gradient hook call, so the all-reduce is complete.
        prefix_model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        prefix_inputs = dict(
            input_ids=u_ids,
            attention_mask=u_mask,
            position_ids=u_pos,
            past_key_values=DynamicCache(),
            use_cache=True,
        )
        if hidden:
            h_p, out_p = final_hidden_states(prefix_model, grad=grad, **prefix_inputs)
            last_p = h_p[:, -1:, :]
        else:
            out_p = prefix_model(**prefix_inputs, logits_to_keep=1)
            last_p = out_p.logits[:, -1:, :]
        cache = out_p.past_key_values
        cache.batch_select_indices(inverse)  # [U, ...] -> [B, ...], differentiable gather
        t = completion_ids.shape[1]
        attention = torch.cat([prompt_mask, completion_attention.long()], dim=1)
        position_ids = (
            prompt_mask.sum(dim=1, keepdim=True) + torch.arange(t, device=attention.device)[None, :]
        )
        inputs = dict(
            input_ids=completion_ids,
            attention_mask=attention,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        if hidden:
            rest, _ = final_hidden_states(model, grad=grad, **inputs)
        else:
            rest = model(**inputs).logits
        return torch.cat([last_p[inverse], rest[:, :-1, :]], dim=1)

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

    def save_trainable(self, path: str | Path) -> None:
        save_file({k: v.contiguous() for k, v in self.trainable_state_dict().items()}, str(path))


def completion_attention(rollout: Rollout) -> Tensor:
    """Long[B,T]: the real tokens of the completion region (generated or inserted), which the model attends
    to; ``payload["completion_attention_mask"]``, or the loss mask for payloads built without it."""
    att = rollout.payload.get("completion_attention_mask")
    return rollout.mask.long() if att is None else att.long()


def _pad_left(x: Tensor, width: int, value: int) -> Tensor:
    if x.shape[1] == width:
        return x
    pad = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype)
    return torch.cat([pad, x], dim=1)


def _pad_right(x: Tensor, width: int, value: int) -> Tensor:
    if x.shape[1] == width:
        return x
    pad = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype)
    return torch.cat([x, pad], dim=1)


def _sharded_over_processes(model: torch.nn.Module) -> bool:
    """The model is FSDP2-sharded across more than one process (generation must then be lock-stepped)."""
    import torch.distributed as dist

    from mmalign.distributed import is_fsdp2

    return is_fsdp2(model) and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
