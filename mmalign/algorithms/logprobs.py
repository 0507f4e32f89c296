"""Per-token log-probs and entropies of a language model's output distribution.

Two ways to get ``log softmax(head(h_t) / temperature)[y_t]``: from the model's full ``[B, T, V]`` logits
(`selective_log_softmax`), or chunked (`chunked_token_logprobs`): the output head applied to a few valid
tokens at a time to the final hidden states (`final_hidden_states`), so the head's peak memory is one
``[chunk_tokens, V]`` block whatever the batch or length. A plain ``nn.Linear`` head goes through
`LinearTokenLogprobs` (one fp32 block buffer, reused; the gradient written from the saved log-sum-exp, no
autograd graph over the block); any other head through a checkpointed chunk (recomputed in the backward).
`auto_chunk_tokens` sizes the chunk from a memory budget (``model.logprob_chunk_size: auto``,
``model.logprob_memory_mb``). All give the same numbers and gradients; `check_agreement` verifies it once
per model (a head that does more than ``lm_head(hidden_states[-1])`` is reported, not mis-scored). The
policies' scorer is `mmalign.policies.token_scoring`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = [
    "ChunkedLogprobError",
    "LinearTokenLogprobs",
    "agreement_tolerance",
    "auto_chunk_tokens",
    "autocast_dtype",
    "check_agreement",
    "chunked_token_logprobs",
    "decoder_of",
    "final_hidden_states",
    "fusable_head",
    "head_output_dtypes",
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


# ----------------------------------------------------------------------------- the fused linear head
VOCAB_SLICES = 8
"""The fused path reduces each block of logits over the vocabulary in this many slices, through one
reused fp32 buffer of an eighth of the block (``exp`` and the entropy's products)."""

FUSED_BYTES_PER_LOGIT = 4 * (1 + 1 / VOCAB_SLICES)
"""Bytes per (token, vocabulary entry) the fused path holds at once: the fp32 block buffer and the slice
buffer; a head that computes in half precision adds its own output (2 bytes)."""

CHECKPOINT_BYTES_PER_LOGIT = 17.0
"""The same for the checkpointed path of a head that is not a plain ``nn.Linear``: about four fp32 blocks
(logits, the log-sum-exp's and the entropy's temporaries, their gradient), as measured."""


def fusable_head(head: torch.nn.Module) -> bool:
    """The head is a plain ``nn.Linear`` without hooks, whose output `LinearTokenLogprobs` can compute from
    its weight and bias (a peft LoRA head, or one with hooks, takes the checkpointed path)."""
    return (
        type(head) is torch.nn.Linear
        and not head._forward_hooks
        and not head._forward_pre_hooks
        and not head._forward_hooks_with_kwargs
    )


def auto_chunk_tokens(vocab_size: int, memory_mb: float, *, fused: bool, logits_dtype: torch.dtype) -> int:
    """Tokens per chunk so that the head's block of logits and its temporaries fit in `memory_mb` MiB:
    ``memory_mb * 2**20 / (vocab_size * bytes per logit)``, at least 1 (`FUSED_BYTES_PER_LOGIT` or
    `CHECKPOINT_BYTES_PER_LOGIT`, plus the head's own output when it is not fp32)."""
    if vocab_size < 1 or not memory_mb > 0:
        raise ValueError(
            f"auto_chunk_tokens: need vocab_size >= 1 and memory_mb > 0, got {vocab_size}, {memory_mb}"
        )
    per_logit = FUSED_BYTES_PER_LOGIT if fused else CHECKPOINT_BYTES_PER_LOGIT
    if logits_dtype != torch.float32:
        per_logit += torch.empty((), dtype=logits_dtype).element_size()
    return max(1, int(memory_mb * 2**20 // (vocab_size * per_logit)))


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes matmuls in on `device` where it is on, else None (also for devices
    without autocast, such as ``meta``)."""
    kind = device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def _no_autocast(device: torch.device) -> Any:
    """A context with autocast off on `device` (a no-op where it has none)."""
    kind = device.type
    return torch.autocast(kind, enabled=False) if torch.amp.is_autocast_available(kind) else nullcontext()


def _compute_dtype(weight: Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's where it is on for the weight's device."""
    return autocast_dtype(weight.device) or weight.dtype


def _block_logits(
    out: Tensor,
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    temperature: float,
    suppressed: Tensor | None,
) -> Tensor:
    """``out[:n] = (h @ weight.T + bias)`` in fp32, suppressed ids at -inf, divided by the temperature;
    `weight` / `h` / `bias` are already in the compute dtype (a half-precision product is rounded to it
    first, as the head's own output would be)."""
    buf = out[: h.shape[0]]
    if weight.dtype == torch.float32:
        torch.matmul(h, weight.t(), out=buf)
        if bias is not None:
            buf.add_(bias)
    else:
        buf.copy_(torch.nn.functional.linear(h, weight, bias))
    if suppressed is not None:
        buf.index_fill_(-1, suppressed, float("-inf"))
    if temperature != 1.0:
        buf.div_(temperature)
    return buf


class LinearTokenLogprobs(torch.autograd.Function):
    """``(logp, entropy)`` Float[N] of ids [N] under ``softmax((hidden @ weight.T + bias) / temperature)``
    with `suppressed` ids removed; `hidden` [N, H], `block` rows at a time.

    Forward: per block, the fp32 logits in one buffer (reused), the max and the sum of ``exp`` over the
    vocabulary in slices, the picked logit; it saves `hidden` and the log-sum-exp, nothing of size V. The
    backward recomputes each block's logits into the buffer and turns them in place into the gradient of
    the logits, ``g * (onehot(y) - softmax) / temperature``, then ``dL/dhidden = G @ weight`` and
    ``dL/dweight += G.T @ hidden`` (fp32 accumulator). The entropy has no gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        ids: Tensor,
        temperature: float,
        suppressed: Tensor | None,
        block: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        n, v = hidden.shape[0], weight.shape[0]
        cd = _compute_dtype(weight)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        with _no_autocast(weight.device):
            w, b = weight.to(cd), (None if bias is None else bias.to(cd))
            rows_max = min(block, n)
            buf = torch.empty(rows_max, v, dtype=torch.float32, device=hidden.device)
            width = -(-v // VOCAB_SLICES)
            ebuf = torch.empty(rows_max, width, dtype=torch.float32, device=hidden.device)
            for start in range(0, n, block):
                rows = slice(start, start + block)
                z = _block_logits(buf, hidden[rows].to(cd), w, b, temperature, suppressed)
                picked = z.gather(1, ids[rows, None]).squeeze(1)
                top = z.amax(dim=1)
                z.sub_(top[:, None])  # d = z - max <= 0
                total = torch.zeros_like(top)
                dot = torch.zeros_like(top) if with_entropy else None
                for s in range(0, v, width):
                    d = z[:, s : s + width]
                    e = torch.exp(d, out=ebuf[: d.shape[0], : d.shape[1]])
                    total += e.sum(dim=1)
                    if dot is not None:  # sum of e * d; nansum: 0 * -inf (a suppressed id) counts 0
                        dot += e.mul_(d).nansum(dim=1)
                log_total = total.log()
                lse[rows] = top + log_total
                logp[rows] = picked - lse[rows]
                if dot is not None:
                    entropy[rows] = log_total - dot / total
        ctx.save_for_backward(hidden, weight, bias, ids, lse, suppressed)
        ctx.temperature, ctx.block, ctx.cd = temperature, block, cd
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor, _grad_entropy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, bias, ids, lse, suppressed = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        temperature, block, cd = ctx.temperature, ctx.block, ctx.cd
        n, v = hidden.shape[0], weight.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(v, dtype=torch.float32, device=weight.device) if need_b else None
        with _no_autocast(weight.device):
            w, b = weight.to(cd), (None if bias is None else bias.to(cd))
            buf = torch.empty(min(block, n), v, dtype=torch.float32, device=hidden.device)
            for start in range(0, n, block):
                rows = slice(start, start + block)
                h = hidden[rows].to(cd)
                z = _block_logits(buf, h, w, b, temperature, suppressed)
                coef = grad_logp[rows].float() / temperature
                z.sub_(lse[rows, None]).exp_()  # softmax
                z.mul_(-coef[:, None]).scatter_add_(1, ids[rows, None], coef[:, None])  # dL/dlogits
                if grad_h is not None:
                    grad_h[rows] = (z if cd == torch.float32 else z.to(cd)) @ w
                if grad_w is not None:
                    grad_w.addmm_(z.t(), h.float())
                if grad_b is not None:
                    grad_b += z.sum(dim=0)
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
        )


# ----------------------------------------------------------------------------- chunked log-probs
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
    fused: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``(logp, entropy)``, each Float[B, T] in fp32: log softmax(head(hidden) / temperature)[ids] and the
    entropy of the same distribution (no grad; None unless `with_entropy`), 0 where `mask` is False.

    hidden: [B, T, H] the head's inputs for the positions that predict ``ids`` [B, T]. Only the masked-in
    tokens are scored, ``chunk_tokens`` at a time, so that at most one [chunk_tokens, V] block of logits
    exists at once. `fused` (default: when `fusable_head`): `LinearTokenLogprobs` on the head's weight;
    otherwise each chunk is checkpointed (its logits recomputed in the backward). ``suppressed_ids``:
    vocabulary entries set to -inf before the temperature (tokens the sampler could not draw)."""
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
    zeros = hidden.new_zeros(b * t, dtype=torch.float32)
    empty_entropy = zeros.view(b, t).detach() if with_entropy else None
    if idx.numel() == 0:  # nothing to score: zeros, still attached to the graph
        return zeros.view(b, t) + 0.0 * hidden.float().sum(), empty_entropy
    if fused is None:
        fused = fusable_head(head)
    if fused:
        logp_valid, ent_valid = LinearTokenLogprobs.apply(
            h_valid, head.weight, head.bias, y_valid, temperature, suppressed, chunk_tokens, with_entropy
        )
        ents = [ent_valid] if with_entropy else []
        logps = [logp_valid]
    else:
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
    logp = zeros.index_copy(0, idx, torch.cat(logps)).view(b, t)
    entropy = zeros.detach().index_copy(0, idx, torch.cat(ents)).view(b, t) if with_entropy else None
    return logp, entropy


HALF_PRECISION_TOLERANCE = 5e-2
"""Nats the chunked and full log-probs may differ by when either path computes in half precision."""

FP32_TOLERANCE = 1e-3
"""The same when both compute in fp32 (or wider)."""


def agreement_tolerance(compute_dtype: torch.dtype) -> float:
    """`check_agreement`'s limit for a model that computes in `compute_dtype`: `FP32_TOLERANCE` for fp32 and
    wider, `HALF_PRECISION_TOLERANCE` for bf16 / fp16 (their matmuls keep about 3 significant digits, and the
    two paths round differently: the chunked head computes in fp32 outside the model's forward, the full
    path's head inside it, in autocast's dtype)."""
    return FP32_TOLERANCE if torch.finfo(compute_dtype).bits >= 32 else HALF_PRECISION_TOLERANCE


@contextmanager
def head_output_dtypes(model: torch.nn.Module) -> Iterator[list[torch.dtype]]:
    """Inside the block, the dtypes of the outputs of the model's output head (`output_head`), in call order:
    the dtype the full-logits path computes its logits in. It is the model's dtype, or autocast's where the
    forward runs under it: ``trainer.mixed_precision: bf16`` (accelerate wraps the model's forward in
    autocast) gives bf16 logits from an fp32 model."""
    seen: list[torch.dtype] = []

    def record(_module: torch.nn.Module, _args: Any, out: Any) -> None:
        if isinstance(out, Tensor):
            seen.append(out.dtype)

    handle = output_head(model).register_forward_hook(record)
    try:
        yield seen
    finally:
        handle.remove()


def check_agreement(
    chunked: Tensor, full: Tensor, mask: Tensor, *, what: str, compute_dtype: torch.dtype
) -> None:
    """Raise `ChunkedLogprobError` unless the chunked log-probs match the full-logits ones where `mask` is
    set, within `agreement_tolerance` of `compute_dtype`: the lowest precision the model computes in (its
    dtype, or autocast's under mixed precision: see `head_output_dtypes`), not just its weights' dtype."""
    m = mask.to(chunked.device)
    if not bool(m.any()):
        return
    diff = (chunked - full.to(chunked.device)).abs()[m].max().item()
    tol = agreement_tolerance(compute_dtype)
    if not diff <= tol:
        name = str(compute_dtype).removeprefix("torch.")
        raise ChunkedLogprobError(
            f"{what}: chunked log-probs differ from the full-logits path by {diff:.3g} nats, more than "
            f"rounding explains for a model computing in {name} (limit {tol}); the model's forward likely "
            f"changes the logits after get_output_embeddings()(hidden_states[-1]) (logit soft-capping or "
            f"scaling), which the chunked path does not see. Set model.logprob_chunk_size: null to use the "
            f"full-logits path."
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
