"""Single-turn sampling of a token policy: prompt encoding, batched sampling (mmalign's own decode loop,
Hugging Face ``generate`` or the rollout engine), stop strings and the action mask, and the `Rollout` of
sampled completions.

Details: docs/algorithms.md, "mmalign.policies.token_sampling".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from mmalign.algorithms.logprobs import autocast_dtype, cache_kwarg
from mmalign.data.batch import Rollout, group_fields, left_pad
from mmalign.engines.client import EngineClient

SAMPLING_SLICES = 8
"""`sample_next_tokens` walks the vocabulary in this many slices (fp32 temporaries of [B, V / 8])."""
SAMPLING_BLOCK = 256
"""Vocabulary ids per block of the two-level inverse CDF (block sums, then one block per row)."""

_HANDLED_GENERATION_KEYS = frozenset(
    {
        # handled by the own loop, or given by the policy's arguments
        "eos_token_id",
        "pad_token_id",
        "bos_token_id",
        "decoder_start_token_id",
        "suppress_tokens",
        "temperature",
        "top_k",
        "top_p",
        "do_sample",
        "max_length",
        "max_new_tokens",
        "use_cache",
        # bookkeeping, outputs, beam search / assisted decoding / compilation settings that sampling ignores
        "transformers_version",
        "_from_model_config",
        "_commit_hash",
        "output_attentions",
        "output_hidden_states",
        "output_scores",
        "output_logits",
        "return_dict_in_generate",
        "length_penalty",
        "early_stopping",
        "low_memory",
        "num_assistant_tokens",
        "num_assistant_tokens_schedule",
        "assistant_confidence_threshold",
        "assistant_lookbehind",
        "target_lookbehind",
        "assistant_early_exit",
        "assistant_ensemble_weight",
        "is_assistant",
        "max_matching_ngram_size",
        "compile_config",
        "disable_compile",
        "cache_config",
        "max_cache_len",
        "prefill_chunk_size",
        "continuous_batching_config",
    }
)
_NEUTRAL_GENERATION_VALUES: dict[str, tuple[Any, ...]] = {
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "min_p": (None, 0.0),
    "guidance_scale": (None, 1.0),
    "num_beams": (None, 1),
    "num_beam_groups": (None, 1),
    "num_return_sequences": (None, 1),
    "diversity_penalty": (None, 0.0),
}


SHAPING_GENERATION_KEYS = (
    "repetition_penalty",
    "encoder_repetition_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "min_p",
)
"""Settings of a checkpoint's ``generation_config`` that reshape the sampling distribution away from
``softmax(logits / T)`` (Qwen2.5's published configs carry ``repetition_penalty`` 1.05-1.1)."""


def neutralize_shaping_settings(generation_config: Any) -> list[str]:
    """Set the `SHAPING_GENERATION_KEYS` of a model's ``generation_config`` to their neutral values; returns
    the ``key=old`` strings it changed. RL samples must come from the policy the loss scores: the trainer's
    log-probs are of ``softmax(logits / T)`` (with the rollout's top-k / top-p), so a repetition penalty applied
    by ``generate`` would make every rollout silently off-policy. TRL's GRPO and verl's vLLM rollouts likewise
    sample with a repetition penalty of 1.0 unless told otherwise."""
    if generation_config is None:
        return []
    changed = []
    for key in SHAPING_GENERATION_KEYS:
        value = getattr(generation_config, key, None)
        neutral = _NEUTRAL_GENERATION_VALUES[key]
        if value not in neutral:
            setattr(generation_config, key, neutral[1])
            changed.append(f"{key}={value!r}")
    return changed


def unsupported_generation_settings(generation_config: Any) -> list[str]:
    """The settings of a model's ``generation_config`` that `generate` would apply and the own decode loop
    does not (repetition penalties, bad words, min length, typical / min-p / epsilon sampling, a stop string
    of the model's own, beams, a custom cache ...): ``key=value`` strings; empty when the loop samples the
    same distribution as `generate`."""
    if generation_config is None:
        return []
    out = []
    for key, value in generation_config.to_dict().items():
        if key in _HANDLED_GENERATION_KEYS:
            continue
        if value in _NEUTRAL_GENERATION_VALUES.get(key, (None, False, [], {}, ())):
            continue
        out.append(f"{key}={value!r}")
    return out


def _block_sums(logits: Tensor, top: Tensor, temperature: float) -> Tensor:
    """Float64[B, ceil(V / SAMPLING_BLOCK)]: the sums of ``exp(fp32(logits) / T - top)`` over consecutive
    blocks of `SAMPLING_BLOCK` vocabulary ids, the vocabulary read in `SAMPLING_SLICES` slices (each block
    summed in fp32, then kept in fp64)."""
    b, v = logits.shape
    n_blocks = -(-v // SAMPLING_BLOCK)
    per_slice = -(-n_blocks // SAMPLING_SLICES) * SAMPLING_BLOCK
    out = torch.empty(b, n_blocks, dtype=torch.float64, device=logits.device)
    for lo in range(0, v, per_slice):
        e = _shifted_exp(logits[:, lo : lo + per_slice], top, temperature)
        if e.shape[1] % SAMPLING_BLOCK:
            e = torch.nn.functional.pad(e, (0, SAMPLING_BLOCK - e.shape[1] % SAMPLING_BLOCK))
        first = lo // SAMPLING_BLOCK
        out[:, first : first + e.shape[1] // SAMPLING_BLOCK] = e.view(b, -1, SAMPLING_BLOCK).sum(dim=-1)
    return out


def _shifted_exp(x: Tensor, top: Tensor, temperature: float) -> Tensor:
    """``exp(fp32(x) / T - top[:, None])``, a new fp32 tensor (`x` [B, n] in any float dtype)."""
    if x.dtype == torch.float32 and temperature == 1.0:
        return torch.sub(x, top[:, None]).exp_()
    z = x / temperature if x.dtype == torch.float32 else x.float()
    if x.dtype != torch.float32 and temperature != 1.0:
        z.div_(temperature)
    return z.sub_(top[:, None]).exp_()


def _scaled(x: Tensor, temperature: float) -> Tensor:
    """fp32 ``x / temperature`` of a small tensor (maxima, picked logits)."""
    return x.float() / temperature


def _inverse_cdf(weights: Tensor, target: Tensor) -> Tensor:
    """Per row, the first column whose running sum of `weights` (>= 0) exceeds `target` (fp64 running sums;
    a target at or past the row's total, from rounding, takes the last column of positive weight)."""
    cum = weights.double().cumsum(dim=-1)
    pos = torch.searchsorted(cum, target[:, None].contiguous(), right=True).squeeze(1)
    last = weights.shape[-1] - 1 - (weights > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(pos, last)


def sample_next_tokens(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    suppressed: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Draw one token per row of `logits` [B, V] (any float dtype; suppressed entries are set to -inf in
    place) from the distribution ``generate`` samples: suppressed ids removed, ``softmax(logits / T)`` in
    fp32, truncated to the top-k (ties with the k-th kept, as ``TopKLogitsWarper``), then to the top-p
    nucleus of the renormalised rest (a token stays while the mass of the strictly better ones is < p, at
    least one).

    Returns ``(tokens, logp)``: Long[B] and Float[B], the drawn token's log-prob under the untruncated
    ``log_softmax(logits / T)`` without the suppressed ids (what `TextPolicy` recomputes), via a
    log-sum-exp. The vocabulary is read in `SAMPLING_SLICES` slices (fp32 temporaries of [B, V / 8], no
    full-size copy); top-k uses ``topk``, top-p alone ``topk`` with a growing k until the nucleus fits (a
    full sort only when it spans the vocabulary); the draw is an inverse CDF on one uniform number per row
    (``torch.rand`` with `generator`), not ``multinomial``'s exponential race, so the tokens differ from
    ``generate``'s for the same seed while their distribution is the same."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    b, v = logits.shape
    if suppressed is not None and suppressed.numel():
        logits.index_fill_(-1, suppressed, float("-inf"))
    top = _scaled(logits.amax(dim=-1), temperature)  # max(x / T) == max(x) / T: rounding is monotone
    blocks = _block_sums(logits, top, temperature)  # [B, ceil(V / SAMPLING_BLOCK)] sums of exp(z - top)
    total = blocks.sum(dim=-1)
    u = torch.rand(b, dtype=torch.float64, device=logits.device, generator=generator)
    k = min(int(top_k), v) if top_k and top_k > 0 else 0
    if k == 0 and top_p >= 1.0:
        # two-level inverse CDF: the block of SAMPLING_BLOCK ids, then the id within it
        target = u * total
        j = _inverse_cdf(blocks, target)
        before = (blocks.cumsum(dim=-1) - blocks).gather(1, j[:, None]).squeeze(1)
        cols = j[:, None] * SAMPLING_BLOCK + torch.arange(SAMPLING_BLOCK, device=logits.device)[None, :]
        w = _shifted_exp(logits.gather(1, cols.clamp(max=v - 1)), top, temperature)
        w.masked_fill_(cols >= v, 0.0)
        tokens = cols.gather(1, _inverse_cdf(w, target - before)[:, None]).squeeze(1)
    else:
        tokens = _sample_truncated(logits, top, total, u, k, top_p, temperature)
    picked = _scaled(logits.gather(1, tokens[:, None]).squeeze(1), temperature)
    logp = picked - (top + total.log().float())
    return tokens, logp


def _sample_truncated(
    logits: Tensor, top: Tensor, total: Tensor, u: Tensor, k: int, top_p: float, temperature: float
) -> Tensor:
    """`sample_next_tokens` with top-k (k > 0) and/or top-p (< 1): the candidates, best first, from ``topk``."""
    v = logits.shape[-1]
    if k:
        kth = logits.topk(k, dim=-1).values[:, -1:]
        k = int((logits >= kth).sum(dim=-1).max())  # ties with the k-th value stay in, as in generate
        vals, idx = logits.topk(k, dim=-1)
        w = _shifted_exp(vals, top, temperature).double().masked_fill_(vals < kth, 0.0)
        mass = w.sum(dim=-1)  # the top-k's share of `total`
    else:
        mass = total
        k = min(256, v)
        while True:
            vals, idx = logits.topk(k, dim=-1)
            w = _shifted_exp(vals, top, temperature).double()
            # the nucleus lies within these k when their mass reaches top_p of the whole (or k == V)
            if k == v or bool((w.sum(dim=-1) >= top_p * mass).all()):
                break
            k = min(4 * k, v)
    if top_p < 1.0:
        before = w.cumsum(dim=-1) - w
        w = w.masked_fill(before >= top_p * mass[:, None], 0.0)  # never the best token: its `before` is 0
    pick = _inverse_cdf(w, u * w.sum(dim=-1))
    return idx.gather(1, pick[:, None]).squeeze(1)


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


def pad_left(x: Tensor, width: int, value: int) -> Tensor:
    if x.shape[1] == width:
        return x
    pad = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype)
    return torch.cat([pad, x], dim=1)


def pad_right(x: Tensor, width: int, value: int) -> Tensor:
    if x.shape[1] == width:
        return x
    pad = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype)
    return torch.cat([x, pad], dim=1)


def sharded_over_processes(model: torch.nn.Module) -> bool:
    """The model is FSDP2-sharded across more than one process (generation must then be lock-stepped)."""
    import torch.distributed as dist

    from mmalign.training.distributed import is_fsdp2

    return is_fsdp2(model) and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class TokenSampling:
    """Sampling methods of `TextPolicy` (`VLMPolicy` overrides the encoding parts)."""

    model: torch.nn.Module
    tokenizer: Any
    engine_client: EngineClient
    eos_ids: list[int]
    stop_strings: list[str]
    use_chat_template: bool
    system_prompt: str | None
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    generation_batch_size: int | None
    shared_prefix: bool
    sampler: str
    suppressed_ids: list[int]
    sampled_logp: bool = False
    """``compute_logp=True`` takes ``logp_old`` from the own decode loop's log-probs of the drawn tokens (no
    scoring pass) where `sampled_logp_blockers` is empty. Off by default: the synchronous trainer's ``logp_old``
    is pi_old of its first update and comes from the same scoring path as the update's log-probs (equal to the
    bit, which `mmalign parity` checks); an asynchronous rollout worker with ``max_staleness > 0`` turns it on
    for its own copy, whose log-probs are the behaviour log-probs of the importance weights."""
    _prompt_cache: dict[str, list[int]]
    device: torch.device
    _logprobs: Callable[..., Tensor]

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

    @staticmethod
    def _rollout_fields(
        rows: list[dict[str, Any]], group_size: int
    ) -> tuple[list[str], Tensor, dict[str, list[Any]]]:
        """Prompts, group ids and dataset columns, one entry per sample (`mmalign.data.batch.group_fields`)."""
        return group_fields(rows, group_size)

    # ------------------------------------------------------------------ single-turn rollout
    @torch.no_grad()
    def single_turn_rollout(
        self, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool = True
    ) -> Rollout:
        """One completion per sample (the ``single_turn`` loop)."""
        prompts, group, columns = self._rollout_fields(rows, group_size)
        if self.engine_client.engine is not None:
            return self._rollout_with_engine(rows, group_size, prompts, group, columns)
        with_logp = compute_logp and self.sampled_logp
        parts = self._generate_in_chunks(prompts, functools.partial(self._generate, with_logp=with_logp))
        p_width = max(p[0].shape[1] for p in parts)
        c_width = max(p[2].shape[1] for p in parts)
        pad = self.tokenizer.pad_token_id
        prompt_ids = torch.cat([pad_left(p[0], p_width, pad) for p in parts])
        prompt_mask = torch.cat([pad_left(p[1], p_width, 0) for p in parts])
        completion_ids = torch.cat([pad_right(p[2], c_width, pad) for p in parts])
        sampled_logp = None
        if with_logp and all(p[3] is not None for p in parts):  # the decode loop's own log-probs
            sampled_logp = torch.cat([pad_right(p[3], c_width, 0) for p in parts])
        return self._finish_rollout(
            prompts,
            group,
            columns,
            prompt_ids,
            prompt_mask,
            completion_ids,
            compute_logp,
            sampled_logp=sampled_logp,
        )

    def _rollout_with_engine(
        self,
        rows: list[dict[str, Any]],
        group_size: int,
        prompts: list[str],
        group: Tensor,
        columns: dict[str, list[Any]],
    ) -> Rollout:
        """Sample with the engine; its log-probs become ``rollout.logp_sampler``, ``logp_old`` is recomputed
        with the trainer's own weights."""
        ids, att = self._encode_prompts([str(r["prompt"]) for r in rows])
        token_lists = [row[m.bool()].tolist() for row, m in zip(ids, att, strict=True)]
        completion_ids, logp_engine = self.engine_client.generate(
            token_lists, group_size, self._engine_sampling(), self.tokenizer.pad_token_id
        )
        self.engine_client.sampling_done()  # the engine sleeps while the trainer scores and updates
        rollout = self._finish_rollout(
            prompts,
            group,
            columns,
            ids.repeat_interleave(group_size, 0),
            att.repeat_interleave(group_size, 0),
            completion_ids,
            compute_logp=True,
        )
        return self.engine_client.keep_logprobs(rollout, logp_engine)

    def _engine_sampling(self, suppress_token_ids: list[int] | None = None) -> Any:
        """The engine's `SamplingSpec`: this policy's sampling settings and the step's engine seed."""
        from mmalign.engines import SamplingSpec

        return SamplingSpec(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            stop=list(self.stop_strings),
            stop_token_ids=list(self.eos_ids),
            seed=self.engine_client.seed,
            suppress_token_ids=list(suppress_token_ids or []),
        )

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
        *,
        sampled_logp: Tensor | None = None,
    ) -> Rollout:
        """Masks, texts and (optionally) log-probs of sampled completions (`extra_payload` joins the payload).
        `sampled_logp` (Float[B, T]): the log-probs the decode loop recorded for the drawn tokens; with
        `compute_logp` they are the rollout's ``logp_old`` (0 where masked) instead of a scoring pass."""
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
        if compute_logp and sampled_logp is not None:
            dev = self.device  # where the scoring pass would put them
            rollout.logp_old = sampled_logp.to(dev, torch.float32).masked_fill(~mask.to(dev), 0.0)
        elif compute_logp:
            rollout.logp_old = self._logprobs(self.model, rollout, grad=False)
        return rollout

    def _stop_lengths(self, completion_ids: Tensor) -> Tensor:
        """Per row, the number of tokens up to the end of the first stop string (T + 1 if none); the shortest
        decoded prefix holding a stop string, found by bisection (O(T log T) decodes per matching row)."""
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

    # ------------------------------------------------------------------ generate
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
        if sharded_over_processes(self.model):
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

    def _generate(
        self, prompts: list[str], with_logp: bool = False
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """(prompt ids, prompt mask, completion ids, the drawn tokens' log-probs or None) of one chunk of
        prompts: the own decode loop (`_sample_loop`) where `own_loop_blockers` is empty, Hugging Face
        ``generate`` otherwise. The log-probs (Float[B, T], `with_logp`) come only from the own loop and only
        where `sampled_logp_blockers` is empty; None: the caller scores the completions instead."""
        ids, att = self._encode_prompts(prompts)
        ids, att = ids.to(self.device), att.to(self.device)
        cache = self._prefill(prompts, ids, att) if self.shared_prefix and ids.shape[1] > 1 else None
        logp = None
        if not self.own_loop_blockers():
            new, logp = self._sample_loop(ids, att, cache)
            if not with_logp or self.sampled_logp_blockers():
                logp = None
        else:
            kwargs = self._sampling_kwargs()
            if cache is not None:
                kwargs[cache_kwarg()] = cache
            new = self.model.generate(input_ids=ids, attention_mask=att, **kwargs)[:, ids.shape[1] :]
        return ids.cpu(), att.cpu(), new.cpu(), None if logp is None else logp.cpu()

    def own_loop_blockers(self) -> list[str]:
        """Why single-turn sampling goes through ``generate`` instead of the own decode loop: ``sampler: hf``,
        a model sharded over processes (``generate`` lock-steps the ranks), or generation-config settings the
        loop does not apply (`unsupported_generation_settings`); empty: the own loop samples."""
        if self.sampler == "hf":
            return ["sampler=hf"]
        if sharded_over_processes(self.model):
            return ["FSDP2 over several processes"]
        return unsupported_generation_settings(getattr(self.model, "generation_config", None))

    def sampled_logp_blockers(self) -> list[str]:
        """Why the own decode loop's log-probs of the drawn tokens cannot stand for the scoring pass
        (`_logprobs`) as ``logp_old``; empty: with `sampled_logp` on they are used, and ``compute_logp=True``
        costs no extra forward.

        Details: docs/algorithms.md, "mmalign.policies.token_sampling.TokenSampling.sampled_logp_blockers".
        """
        out = []
        precision = torch.get_float32_matmul_precision()
        if precision != "highest":
            out.append(f"float32_matmul_precision={precision}")
        if self.suppressed_ids:
            out.append(f"suppressed_ids={list(self.suppressed_ids)}")
        blocked = getattr(getattr(self.model, "generation_config", None), "suppress_tokens", None)
        if blocked:
            out.append(f"suppress_tokens={list(blocked)}")
        return out

    def _stop_criterion(self) -> Any:
        """Hugging Face's ``StopStringCriteria`` for the policy's stop strings (built once; None without)."""
        key = tuple(self.stop_strings)
        if not key:
            return None
        cached = getattr(self, "_stop_criterion_cache", None)
        if cached is None or cached[0] != key:
            from transformers import StopStringCriteria

            cached = (key, StopStringCriteria(tokenizer=self.tokenizer, stop_strings=list(key)))
            self._stop_criterion_cache = cached
        return cached[1]

    @torch.no_grad()
    def _sample_loop(self, ids: Tensor, att: Tensor, cache: Any = None) -> tuple[Tensor, Tensor | None]:
        """Sample up to ``max_new_tokens`` per row after the left-padded prompts `ids` / `att` (on the model's
        device), with the KV cache and positions ``generate`` would use; `cache`: the prefilled cache of all
        but the last prompt token (`_prefill`), or None. Each step runs the new token(s) with
        ``logits_to_keep=1`` and draws with `sample_next_tokens`; a row that produced EOS or completed a
        stop string gets the pad id from then on, and the loop ends when every row has. Returns the new
        tokens [B, steps] and their log-probs Float[B, steps] under ``log_softmax(logits / T)`` without the
        suppressed ids (those of the pad ids after a row's end are meaningless), or None for the log-probs
        when the logits were not fp32 or autocast was on (`sampled_logp_blockers`)."""
        from transformers import DynamicCache

        key = cache_kwarg()
        dev = ids.device
        b = ids.shape[0]
        pad = self.tokenizer.pad_token_id
        eos = torch.tensor(self.eos_ids, device=dev) if self.eos_ids else None
        gen_cfg = getattr(self.model, "generation_config", None)
        blocked = list(getattr(gen_cfg, "suppress_tokens", None) or [])
        suppressed = torch.tensor(blocked, dtype=torch.long, device=dev) if blocked else None
        stop = self._stop_criterion()
        # generate's positions for left padding: cumsum of the mask - 1 (1 on the padding)
        positions = (att.long().cumsum(dim=1) - 1).masked_fill(att == 0, 1)
        step_ids, step_pos = (ids[:, -1:], positions[:, -1:]) if cache is not None else (ids, positions)
        cache = DynamicCache() if cache is None else cache
        seq, mask = ids, att
        unfinished = torch.ones(b, dtype=torch.bool, device=dev)
        new: list[Tensor] = []
        logps: list[Tensor] = []
        exact = autocast_dtype(dev) is None  # fp32 logits computed in fp32 (checked per step below)
        for _ in range(self.max_new_tokens):
            out = self.model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=step_pos,
                use_cache=True,
                logits_to_keep=1,
                **{key: cache},
            )
            cache = out[key]
            exact = exact and out.logits.dtype == torch.float32
            tokens, logp = sample_next_tokens(
                out.logits[:, -1, :],
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                suppressed=suppressed,
            )
            del out
            tokens = torch.where(unfinished, tokens, torch.full_like(tokens, pad))
            new.append(tokens)
            logps.append(logp)
            if eos is not None:
                unfinished &= ~torch.isin(tokens, eos)
            if stop is not None:
                seq = torch.cat([seq, tokens[:, None]], dim=1)
                unfinished &= ~stop(seq, None).to(dev)
            if not bool(unfinished.any()):
                break
            step_ids, step_pos = tokens[:, None], step_pos[:, -1:] + 1
            mask = torch.cat([mask, mask.new_ones(b, 1)], dim=1)
        if not new:
            return ids.new_zeros(b, 0), (torch.zeros(b, 0, device=dev) if exact else None)
        return torch.stack(new, dim=1), (torch.stack(logps, dim=1).float() if exact else None)

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
            use_cache=True,
            logits_to_keep=1,
            **{cache_kwarg(): cache},
        )
        cache.batch_select_indices(inverse)
        return cache
