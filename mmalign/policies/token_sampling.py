"""Single-turn sampling of a token policy: prompt encoding, batched ``generate`` (or the rollout engine), stop
strings and the action mask, and the `Rollout` of sampled completions."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from mmalign.batch import Rollout, group_fields, left_pad
from mmalign.engines.client import EngineClient
from mmalign.logprobs import cache_kwarg


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


@functools.cache
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

    from mmalign.distributed import is_fsdp2

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
        """Prompts, group ids and dataset columns, one entry per sample (`mmalign.batch.group_fields`)."""
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
        parts = self._generate_in_chunks(prompts, self._generate)
        p_width = max(p[0].shape[1] for p in parts)
        c_width = max(p[2].shape[1] for p in parts)
        pad = self.tokenizer.pad_token_id
        prompt_ids = torch.cat([pad_left(p[0], p_width, pad) for p in parts])
        prompt_mask = torch.cat([pad_left(p[1], p_width, 0) for p in parts])
        completion_ids = torch.cat([pad_right(p[2], c_width, pad) for p in parts])
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
        """Sample with the engine; its log-probs become ``rollout.logp_sampler``, ``logp_old`` is recomputed
        with the trainer's own weights."""
        ids, att = self._encode_prompts([str(r["prompt"]) for r in rows])
        token_lists = [row[m.bool()].tolist() for row, m in zip(ids, att, strict=True)]
        completion_ids, logp_engine = self.engine_client.generate(
            token_lists, group_size, self._engine_sampling(), self.tokenizer.pad_token_id
        )
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

    def _generate(self, prompts: list[str]) -> tuple[Tensor, Tensor, Tensor]:
        ids, att = self._encode_prompts(prompts)
        ids, att = ids.to(self.device), att.to(self.device)
        kwargs = self._sampling_kwargs()
        if self.shared_prefix and ids.shape[1] > 1:
            kwargs[cache_kwarg()] = self._prefill(prompts, ids, att)
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
            use_cache=True,
            logits_to_keep=1,
            **{cache_kwarg(): cache},
        )
        cache.batch_select_indices(inverse)
        return cache
