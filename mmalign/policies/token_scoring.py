"""The one token scorer of the token policies: per-token log-probs (and entropies) of a rollout's completion.

`TokenScorer` runs one forward over prompt + completion region, either plain (one sequence per sample) or
with a shared prefix (each group's prompt encoded once, its KV cache gathered for the group's completions),
and scores the tokens from the full logits or, chunked, from the final hidden states through the output
head (`mmalign.algorithms.logprobs`). What differs between model families is only how the inputs and positions are
built, a position scheme: `LinearPositions` (1-D positions, text) or `MRopePositions` (Qwen2-VL's 3-D
M-RoPE positions, vision inputs per sample). The math is in docs/algorithms.md (token log-probs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from mmalign.algorithms.logprobs import (
    auto_chunk_tokens,
    autocast_dtype,
    cache_kwarg,
    check_agreement,
    chunked_token_logprobs,
    final_hidden_states,
    fusable_head,
    head_output_dtypes,
    output_head,
    selective_log_softmax,
    token_entropy,
)
from mmalign.data.batch import Rollout

log = logging.getLogger(__name__)

VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
"""The per-sample vision inputs a VLM payload carries (lists, one entry per sample)."""

Inputs = dict[str, Any]
Split = tuple[Inputs, Inputs, Tensor]
"""(prefix inputs of the unique prompts, completion inputs of every sample, sample -> unique prompt index)."""


def checkpointing_on(model: torch.nn.Module) -> bool:
    """Gradient (activation) checkpointing is switched on (in any mode); the one check for the shared prefix,
    which needs the prompt's KV cache in training."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers >= 5 name first
        flag = getattr(model, name, None)
        if flag is not None:
            return bool(flag)
    return False


def completion_attention(rollout: Rollout) -> Tensor:
    """Long[B,T]: the real tokens of the completion region (generated or inserted), which the model attends
    to; ``payload["completion_attention_mask"]``, or the loss mask for payloads built without it."""
    att = rollout.payload.get("completion_attention_mask")
    return rollout.mask.long() if att is None else att.long()


def group_index(group: Tensor) -> tuple[Tensor, Tensor]:
    """(first, inverse): each group's first sample, and each sample's group as an index into `first`."""
    uniq, inverse = torch.unique(group, return_inverse=True)
    first = torch.full((uniq.numel(),), group.numel(), dtype=torch.long, device=group.device)
    first = first.scatter_reduce(0, inverse, torch.arange(group.numel(), device=group.device), reduce="amin")
    return first, inverse


def rope_index_fn(model: torch.nn.Module) -> Any:
    """The model's M-RoPE index function (`get_rope_index`), through peft/DDP wrappers; None if absent."""
    for module in model.modules():
        fn = getattr(module, "get_rope_index", None)
        if callable(fn):
            return fn
    return None


def cat_vision(items: list[dict[str, Tensor | None]]) -> dict[str, Tensor]:
    """Concatenate per-sample vision tensors (patches, grids) in batch order; absent keys are left out."""
    out: dict[str, Tensor] = {}
    for key in VISION_KEYS:
        parts = [it[key] for it in items if it.get(key) is not None]
        if parts:
            out[key] = torch.cat(parts, dim=0)  # type: ignore[arg-type]
    return out


def split_vision(
    payload: dict[str, Any], i: int
) -> tuple[dict[str, Tensor | None], dict[str, Tensor | None]]:
    """Sample `i`'s vision inputs split into the prompt's and those inserted after it (multi-turn): the
    first ``num_prompt_images[i]`` images (all of them when the payload has no such key) are the prompt's."""
    prompt: dict[str, Tensor | None] = {k: payload[k][i] for k in VISION_KEYS}
    grid = prompt["image_grid_thw"]
    counts = payload.get("num_prompt_images")
    if grid is None or counts is None or int(counts[i]) >= grid.shape[0]:
        return prompt, {}
    k = int(counts[i])
    rows = int(grid[:k].prod(dim=-1).sum())
    pixels = prompt["pixel_values"]
    assert pixels is not None
    inserted = {"pixel_values": pixels[rows:], "image_grid_thw": grid[k:]}
    prompt["pixel_values"] = pixels[:rows] if k else None
    prompt["image_grid_thw"] = grid[:k] if k else None
    return prompt, inserted


def _to(d: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {k: v.to(device) for k, v in d.items()}


# ----------------------------------------------------------------------------- position schemes
class PositionScheme(Protocol):
    """How a model family's forward inputs are built from a rollout payload."""

    def inputs(self, rollout: Rollout, device: torch.device) -> Inputs:
        """The plain forward's inputs over prompt + completion region (no cache)."""
        ...

    def split(self, model: torch.nn.Module, rollout: Rollout, inputs: Inputs, p: int) -> Split | None:
        """`inputs` (prompt width `p`) split for the shared-prefix forward; None: use the plain forward."""
        ...


class LinearPositions:
    """1-D positions that skip the left padding (causal LMs)."""

    def inputs(self, rollout: Rollout, device: torch.device) -> Inputs:
        p = rollout.payload
        input_ids = torch.cat([p["prompt_ids"], p["completion_ids"]], dim=1).to(device)
        attention = torch.cat([p["prompt_mask"], completion_attention(rollout)], dim=1).to(device)
        position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
        return dict(input_ids=input_ids, attention_mask=attention, position_ids=position_ids, use_cache=False)

    def split(self, model: torch.nn.Module, rollout: Rollout, inputs: Inputs, p: int) -> Split | None:
        ids, attention = inputs["input_ids"], inputs["attention_mask"]
        prompt_mask = attention[:, :p]
        first, inverse = group_index(rollout.group.to(ids.device))
        u_ids, u_mask = ids[first, :p], prompt_mask[first]
        keep = u_mask.any(dim=0)  # drop columns that are padding in every unique prompt
        if not bool(keep.all()):
            u_ids, u_mask = u_ids[:, keep], u_mask[:, keep]
            prompt_mask = prompt_mask[:, keep]
        prefix = dict(
            input_ids=u_ids, attention_mask=u_mask, position_ids=(u_mask.cumsum(dim=1) - 1).clamp(min=0)
        )
        t = ids.shape[1] - p
        completion = dict(
            input_ids=ids[:, p:],
            attention_mask=torch.cat([prompt_mask, attention[:, p:]], dim=1),
            position_ids=prompt_mask.sum(dim=1, keepdim=True) + torch.arange(t, device=ids.device)[None, :],
        )
        return prefix, completion, inverse


class MRopePositions:
    """Qwen2-VL style inputs: token types and per-sample vision tensors; 3-D M-RoPE positions computed by the
    model (1-D positions for text-only batches). The shared prefix needs the model's ``get_rope_index`` to
    split the positions between prompt and completions; images inserted after the prompt (multi-turn) go to
    the completion pass."""

    def inputs(self, rollout: Rollout, device: torch.device) -> Inputs:
        p = rollout.payload
        completion_ids = p["completion_ids"]
        types = p.get("completion_mm_token_type_ids")
        types = torch.zeros_like(completion_ids) if types is None else types
        attention = torch.cat([p["prompt_mask"], completion_attention(rollout)], dim=1).to(device)
        vision = cat_vision([{k: p[k][i] for k in VISION_KEYS} for i in range(len(rollout))])
        out: Inputs = dict(
            input_ids=torch.cat([p["prompt_ids"], completion_ids], dim=1).to(device),
            attention_mask=attention,
            mm_token_type_ids=torch.cat([p["mm_token_type_ids"], types], dim=1).to(device),
            use_cache=False,
            **_to(vision, device),
        )
        if not vision:  # text-only rows: 1-D positions that skip the left padding
            out["position_ids"] = (attention.cumsum(dim=1) - 1).clamp(min=0)
        return out

    def split(self, model: torch.nn.Module, rollout: Rollout, inputs: Inputs, p: int) -> Split | None:
        rope = rope_index_fn(model)
        if rope is None or "position_ids" in inputs:  # no M-RoPE index, or no vision inputs
            return None
        ids, attention, types = inputs["input_ids"], inputs["attention_mask"], inputs["mm_token_type_ids"]
        dev = ids.device
        positions, _ = rope(
            ids,
            mm_token_type_ids=types,
            image_grid_thw=inputs.get("image_grid_thw"),
            video_grid_thw=inputs.get("video_grid_thw"),
            attention_mask=attention,
        )
        first, inverse = group_index(rollout.group.to(dev))
        parts = [split_vision(rollout.payload, i) for i in range(len(rollout))]
        prefix = dict(
            input_ids=ids[first, :p],
            attention_mask=attention[first, :p],
            mm_token_type_ids=types[first, :p],
            position_ids=positions[:, first, :p],
            **_to(cat_vision([parts[i][0] for i in first.tolist()]), dev),
        )
        completion = dict(
            input_ids=ids[:, p:],
            attention_mask=attention,
            mm_token_type_ids=types[:, p:],
            position_ids=positions[:, :, p:],
            **_to(cat_vision([s[1] for s in parts]), dev),
        )
        return prefix, completion, inverse


# ----------------------------------------------------------------------------- the scorer
DEFAULT_LOGPROB_MEMORY_MB = 256.0
"""The default budget of ``chunk_size="auto"`` (``model.logprob_memory_mb``)."""


@dataclass(frozen=True)
class ScoringOptions:
    """How to score: the sampling temperature, tokens the sampler could not draw, the head's chunk size
    (tokens; ``"auto"``: from `memory_mb`; None: full logits) and whether to share each group's prompt
    forward."""

    temperature: float = 1.0
    chunk_size: int | str | None = None
    shared_prefix: bool = False
    suppressed_ids: tuple[int, ...] = ()
    memory_mb: float = DEFAULT_LOGPROB_MEMORY_MB


def _head_dtype(features: Tensor) -> torch.dtype:
    """The dtype of the head's output: autocast's where it is on, else the hidden states'."""
    return autocast_dtype(features.device) or features.dtype


def chunk_tokens(head: torch.nn.Module, opts: ScoringOptions, logits_dtype: torch.dtype) -> int:
    """Tokens per chunk through `head`: ``opts.chunk_size``, or with ``"auto"`` as many as fit in
    ``opts.memory_mb`` (`mmalign.algorithms.logprobs.auto_chunk_tokens`, for the head's vocabulary and path)."""
    if opts.chunk_size != "auto":
        assert isinstance(opts.chunk_size, int)
        return opts.chunk_size
    weight = getattr(head, "weight", None)
    vocab = weight.shape[0] if isinstance(weight, Tensor) else int(getattr(head, "out_features", 0))
    if vocab < 1:
        raise ValueError(
            f"model.logprob_chunk_size: auto cannot read the vocabulary size of the output head "
            f"({type(head).__name__}); set a number of tokens"
        )
    return auto_chunk_tokens(vocab, opts.memory_mb, fused=fusable_head(head), logits_dtype=logits_dtype)


class TokenScorer:
    """Per-token log-probs of the stored completion tokens: plain / shared-prefix forward, full or chunked
    head, for one position scheme. The first chunked call checks the chunked and full paths agree."""

    def __init__(self, positions: PositionScheme, *, label: str) -> None:
        self.positions = positions
        self.label = label
        self.chunking_checked = False
        self._fsdp_logged = False

    def use_chunked(self, model: torch.nn.Module, chunk_size: int | None) -> bool:
        """Chunked when `chunk_size` is set, except under FSDP2: the output head would run outside the root
        module's forward, where its weight is still sharded (the full logits are used; logged once)."""
        if not chunk_size:
            return False
        from mmalign.training.distributed import is_fsdp2

        if is_fsdp2(model):
            if not self._fsdp_logged:
                log.info(
                    "chunked log-probs: off under FSDP2 (the output head is sharded); using the full logits"
                )
                self._fsdp_logged = True
            return False
        return True

    def logprobs(
        self,
        model: torch.nn.Module,
        rollout: Rollout,
        opts: ScoringOptions,
        *,
        base_model: torch.nn.Module,
        grad: bool,
        entropy_out: list[Tensor] | None = None,
        chunked: bool | None = None,
    ) -> Tensor:
        """Float[B, T] log-probs (0 where masked) under `model`; with `entropy_out` (a list) the per-token
        entropies (no grad, 0 where masked) are appended to it. `base_model`: the unwrapped policy model
        (device, dtype, gradient checkpointing)."""
        chunked = self.use_chunked(model, opts.chunk_size) if chunked is None else chunked
        device = next(base_model.parameters()).device
        completion_ids = rollout.payload["completion_ids"].to(device)
        mask = rollout.mask.to(device)
        shared = opts.shared_prefix and not (checkpointing_on(base_model) and base_model.training)
        with torch.set_grad_enabled(grad):
            inputs = self.positions.inputs(rollout, device)
            p = rollout.payload["prompt_ids"].shape[1]
            split = self.positions.split(model, rollout, inputs, p) if shared else None
            if split is None:
                features = self.plain_features(
                    model, inputs, completion_ids.shape[1], hidden=chunked, grad=grad
                )
            else:
                features = self.shared_prefix_features(model, *split, hidden=chunked, grad=grad)
            logp, entropy = self.score_features(
                model,
                features,
                completion_ids,
                mask,
                opts,
                chunked=chunked,
                with_entropy=entropy_out is not None,
            )
        if chunked and not self.chunking_checked:
            self._check_chunking(model, rollout, opts, logp, base_model)
        if entropy_out is not None:
            assert entropy is not None
            entropy_out.append(entropy.masked_fill(~mask, 0.0))
        return logp.masked_fill(~mask, 0.0)

    @staticmethod
    def plain_features(model: torch.nn.Module, inputs: Inputs, t: int, *, hidden: bool, grad: bool) -> Tensor:
        """One forward per sample; the logits (or, with `hidden`, the final hidden states) at the positions
        that predict the last `t` tokens."""
        if hidden:
            states, _ = final_hidden_states(model, grad=grad, **inputs)
            return states[:, -t - 1 : -1, :]
        return model(**inputs, logits_to_keep=t + 1).logits[:, -t - 1 : -1, :]

    @staticmethod
    def shared_prefix_features(
        model: torch.nn.Module,
        prefix: Inputs,
        completion: Inputs,
        inverse: Tensor,
        *,
        hidden: bool,
        grad: bool,
    ) -> Tensor:
        """`plain_features` with each unique prompt encoded once: its KV cache (kept in the autograd graph,
        so log-probs and gradients equal the plain forward's) is gathered for the completions."""
        from transformers import DynamicCache

        key = cache_kwarg()
        # Under DDP the prefix pass goes through the inner module: DDP expects one forward per
        # backward; every parameter still gets one gradient hook call, so the all-reduce is complete.
        prefix_model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        prefix_inputs = dict(prefix, use_cache=True, **{key: DynamicCache()})
        if hidden:
            h_p, out_p = final_hidden_states(prefix_model, grad=grad, **prefix_inputs)
            last_p = h_p[:, -1:, :]
        else:
            out_p = prefix_model(**prefix_inputs, logits_to_keep=1)
            last_p = out_p.logits[:, -1:, :]
        cache = out_p[key]
        cache.batch_select_indices(inverse)  # [U, ...] -> [B, ...], differentiable gather
        inputs = dict(completion, use_cache=True, **{key: cache})
        rest = final_hidden_states(model, grad=grad, **inputs)[0] if hidden else model(**inputs).logits
        return torch.cat([last_p[inverse], rest[:, :-1, :]], dim=1)

    @staticmethod
    def score_features(
        model: torch.nn.Module,
        features: Tensor,
        completion_ids: Tensor,
        mask: Tensor,
        opts: ScoringOptions,
        *,
        chunked: bool,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """(logp, entropy or None) Float[B, T] of `completion_ids` from `features`: final hidden states
        (`chunked`) or logits."""
        suppressed = list(opts.suppressed_ids)
        if chunked:
            assert opts.chunk_size is not None
            head = output_head(model)
            return chunked_token_logprobs(
                features,
                head,
                completion_ids,
                mask,
                chunk_tokens=chunk_tokens(head, opts, _head_dtype(features)),
                temperature=opts.temperature,
                suppressed_ids=suppressed,
                with_entropy=with_entropy,
            )
        logits = features
        if suppressed:  # the distribution that was sampled
            logits = logits.index_fill(-1, torch.tensor(suppressed, device=logits.device), float("-inf"))
        if opts.temperature != 1.0:
            logits = logits / opts.temperature
        logp = selective_log_softmax(logits, completion_ids)
        return logp, (token_entropy(logits.detach()) if with_entropy else None)

    def _check_chunking(
        self,
        model: torch.nn.Module,
        rollout: Rollout,
        opts: ScoringOptions,
        logp: Tensor,
        base_model: torch.nn.Module,
    ) -> None:
        """Once: the chunked log-probs of the first sample equal the full-logits ones, or a clear error."""
        first = rollout[[0]]
        with torch.no_grad(), head_output_dtypes(base_model) as head_dtypes:
            full = self.logprobs(model, first, opts, base_model=base_model, grad=False, chunked=False)
        # the tolerance follows the lowest precision computed in: the weights' dtype, or autocast's (mixed
        # precision), which the head's output shows
        dtypes = [next(base_model.parameters()).dtype, *head_dtypes]
        check_agreement(
            logp[:1].detach(),
            full,
            first.mask,
            what=f"{self.label} ({type(base_model).__name__})",
            compute_dtype=min(dtypes, key=lambda d: torch.finfo(d).bits),
        )
        self.chunking_checked = True
