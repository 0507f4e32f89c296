"""Per-token log-probs and entropies of a language model's output distribution.

Two ways to get ``log softmax(head(h_t) / temperature)[y_t]``: from the model's full ``[B, T, V]`` logits
(`selective_log_softmax`), or chunked (`chunked_token_logprobs`): the output head applied to a few valid
tokens at a time to the final hidden states (`final_hidden_states`), each chunk checkpointed, so the head's
peak memory is one fp32 ``[chunk_tokens, V]`` block whatever the batch, length or vocabulary. Both give the
same numbers and gradients; `check_agreement` verifies it once per model (a head that does more than
``lm_head(hidden_states[-1])`` is reported, not mis-scored). The policies' scorer is
`mmalign.policies.token_scoring`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = [
    "ChunkedLogprobError",
    "check_agreement",
    "chunked_token_logprobs",
    "decoder_of",
    "final_hidden_states",
    "output_head",
    "selective_log_softmax",
    "token_entropy",
]


class ChunkedLogprobError(RuntimeError):
    """The chunked log-probs disagree with the full-logits path for this model."""


def selective_log_softmax(logits: Tensor, index: Tensor) -> Tensor:
    """log_softmax(logits)[..., index] without materialising the full log-softmax (fp32)."""
    logits = logits.float()
    picked = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def token_entropy(logits: Tensor, chunk: int = 256) -> Tensor:
    """Entropy (nats) of the next-token distribution softmax(logits) at every position, Float[..., T] in fp32,
    without gradient; computed `chunk` positions at a time so that only one fp32 [B, chunk, V] block of
    probabilities exists at once. Tokens whose logit is -inf (suppressed) contribute 0."""
    out = []
    for start in range(0, logits.shape[-2], chunk):
        probs = logits[..., start : start + chunk, :].float().softmax(dim=-1)
        out.append(torch.special.entr(probs).sum(dim=-1))
    return torch.cat(out, dim=-1) if out else logits.new_zeros(logits.shape[:-1], dtype=torch.float32)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _is_fsdp(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The module that turns final hidden states into logits (``get_output_embeddings()``), through DDP
    and peft wrappers (a LoRA-wrapped head keeps its adapter)."""
    head = _unwrap(model).get_output_embeddings()
    if head is None:
        raise ChunkedLogprobError(
            f"{type(_unwrap(model)).__name__} has no output embeddings (get_output_embeddings() is None); "
            f"set model.logprob_chunk_size: null"
        )
    return head


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The model without its output head (``model.<base_model_prefix>``; through DDP and peft wrappers):
    its output's ``last_hidden_state`` is the head's input."""
    m = _unwrap(model)
    if hasattr(m, "get_base_model"):  # peft: the transformers model, adapters injected in place
        m = m.get_base_model()
    prefix = getattr(m, "base_model_prefix", "")
    inner = getattr(m, prefix, None) if prefix else None
    if not isinstance(inner, torch.nn.Module):
        raise ChunkedLogprobError(
            f"{type(m).__name__}: cannot find its decoder (base_model_prefix {prefix!r}); "
            f"set model.logprob_chunk_size: null"
        )
    return inner


def final_hidden_states(model: torch.nn.Module, *, grad: bool, **inputs: Any) -> tuple[Tensor, Any]:
    """``(hidden [B, T, H], output)``: the input of the output head at every position, and the forward's
    output object (for ``past_key_values``).

    With grad, or under FSDP2, the forward goes through `model` itself (so a DDP / FSDP wrapper sees one
    forward per backward) with ``output_hidden_states=True`` and ``logits_to_keep=1`` (the logits of the
    last position only): the per-layer hidden states it returns are the tensors autograd keeps for the
    backward anyway. Without grad it calls the decoder alone (`decoder_of`), which keeps no per-layer
    states and computes no logits at all."""
    inputs.pop("logits_to_keep", None)
    if grad or _is_fsdp(_unwrap(model)):
        out = model(**inputs, output_hidden_states=True, logits_to_keep=1)
        return out.hidden_states[-1], out
    out = decoder_of(model)(**inputs)
    return out.last_hidden_state, out


def _chunk_logprobs(
    hidden: Tensor,
    ids: Tensor,
    head: torch.nn.Module,
    temperature: float,
    suppressed: Tensor | None,
    entropy_out: list[Tensor] | None,
) -> Tensor:
    """One chunk's log-probs; its entropies (no grad) are appended to `entropy_out` on the first call only,
    so the backward's recomputation of the chunk does not compute them again."""
    logits = head(hidden).float()
    if suppressed is not None:
        logits = logits.index_fill(-1, suppressed, float("-inf"))
    if temperature != 1.0:
        logits = logits / temperature
    logp = selective_log_softmax(logits, ids)
    if entropy_out is not None and not entropy_out:
        with torch.no_grad():
            entropy_out.append(torch.special.entr(logits.detach().softmax(dim=-1)).sum(dim=-1))
    return logp


def chunked_token_logprobs(
    hidden: Tensor,
    head: torch.nn.Module,
    ids: Tensor,
    mask: Tensor,
    *,
    chunk_tokens: int,
    temperature: float = 1.0,
    suppressed_ids: list[int] | None = None,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """``(logp, entropy)``, each Float[B, T] in fp32: log softmax(head(hidden) / temperature)[ids] and the
    entropy of the same distribution (no grad; None unless `with_entropy`), 0 where `mask` is False.

    hidden: [B, T, H] the head's inputs for the positions that predict ``ids`` [B, T]. Only the masked-in
    tokens are scored, ``chunk_tokens`` at a time; with grad enabled each chunk is checkpointed (its
    logits recomputed in the backward), so at most one [chunk_tokens, V] block of logits exists at once.
    ``suppressed_ids``: vocabulary entries set to -inf before the temperature (tokens the sampler could
    not draw)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    b, t, h = hidden.shape
    flat_mask = mask.reshape(-1).to(hidden.device)
    idx = flat_mask.nonzero().squeeze(1)
    h_valid = hidden.reshape(b * t, h).index_select(0, idx)
    y_valid = ids.reshape(-1).to(hidden.device).index_select(0, idx)
    suppressed = (
        torch.tensor(suppressed_ids, dtype=torch.long, device=hidden.device) if suppressed_ids else None
    )
    use_checkpoint = torch.is_grad_enabled() and hidden.requires_grad
    logps, ents = [], []
    for start in range(0, idx.numel(), chunk_tokens):
        hc, yc = h_valid[start : start + chunk_tokens], y_valid[start : start + chunk_tokens]
        ent: list[Tensor] | None = [] if with_entropy else None
        args = (hc, yc, head, temperature, suppressed, ent)
        logps.append(
            checkpoint(_chunk_logprobs, *args, use_reentrant=False)
            if use_checkpoint
            else _chunk_logprobs(*args)
        )
        if ent:
            ents.append(ent[0])
    zeros = hidden.new_zeros(b * t, dtype=torch.float32)
    empty_entropy = zeros.view(b, t).detach() if with_entropy else None
    if not logps:  # nothing to score: zeros, still attached to the graph
        return zeros.view(b, t) + 0.0 * hidden.float().sum(), empty_entropy
    logp = zeros.index_copy(0, idx, torch.cat(logps)).view(b, t)
    entropy = zeros.detach().index_copy(0, idx, torch.cat(ents)).view(b, t) if with_entropy else None
    return logp, entropy


def check_agreement(
    chunked: Tensor, full: Tensor, mask: Tensor, *, what: str, model_dtype: torch.dtype
) -> None:
    """Raise `ChunkedLogprobError` unless the chunked log-probs match the full-logits ones where `mask` is
    set (tolerance: 1e-3 nats for fp32 models, 5e-2 for half-precision ones, whose matmuls round
    differently when the head sees fewer rows)."""
    m = mask.to(chunked.device)
    if not bool(m.any()):
        return
    diff = (chunked - full.to(chunked.device)).abs()[m].max().item()
    tol = 1e-3 if model_dtype == torch.float32 else 5e-2
    if not diff <= tol:
        raise ChunkedLogprobError(
            f"{what}: chunked log-probs differ from the full-logits path by {diff:.3g} nats (> {tol}); the "
            f"model's output head does more than get_output_embeddings()(hidden_states[-1]) (logit "
            f"soft-capping or scaling?). Set model.logprob_chunk_size: null to use the full-logits path."
        )


def cache_kwarg() -> str:
    """The name under which the installed transformers takes a KV cache, in a model's ``forward`` and in
    ``generate``, and returns it in a model output: ``cache`` (newer releases, which deprecate the old name
    with a FutureWarning on every call) or ``past_key_values`` (older ones, which do not know ``cache``)."""
    try:
        from transformers.generation.utils import ALL_CACHE_NAMES
    except ImportError:  # pragma: no cover - a release without the list knows only the old name
        return "past_key_values"
    return "cache" if "cache" in ALL_CACHE_NAMES else "past_key_values"
