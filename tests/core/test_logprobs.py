"""Chunked log-probs (`mmalign.logprobs`): the same numbers and gradients as the full-logits path, at most
one chunk of logits at a time, and a clear error for a model whose head the chunked path cannot see."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mmalign.config import ConfigError, LoraConfig, config_from_dict
from mmalign.logprobs import ChunkedLogprobError, chunked_token_logprobs
from mmalign.policies.text import TextPolicy

PROMPTS = ["Q: 1 + 2 = ?\nA:", "Q: 13 + 9 = ?\nA:", "hello", "Q: 7 + 7 + 7 = ?\nA:"]


def _problem(seed: int = 0) -> tuple[torch.Tensor, torch.nn.Linear, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 5, 8, generator=g)
    head = torch.nn.Linear(8, 11, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(11, 8, generator=g))
        head.bias.copy_(torch.randn(11, generator=g))
    ids = torch.randint(0, 11, (3, 5), generator=g)
    ids[ids == 3] = 4  # token 3 is suppressed below: never the target
    mask = torch.rand(3, 5, generator=g) > 0.3
    mask[0, 0] = True
    return hidden, head, ids, mask


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_chunked_logprobs_and_entropy_match_a_plain_loop(chunk: int) -> None:
    hidden, head, ids, mask = _problem()
    temp, suppressed = 0.7, [3]
    with torch.no_grad():
        logp, entropy = chunked_token_logprobs(
            hidden, head, ids, mask, chunk_tokens=chunk, temperature=temp, suppressed_ids=suppressed
        )
    w, b = head.weight.tolist(), head.bias.tolist()
    for i in range(3):
        for t in range(5):
            if not mask[i, t]:
                assert logp[i, t].item() == 0.0 and entropy[i, t].item() == 0.0
                continue
            h = hidden[i, t].tolist()
            z = [sum(w[v][k] * h[k] for k in range(8)) + b[v] for v in range(11)]
            z = [zv / temp if v not in suppressed else -math.inf for v, zv in enumerate(z)]
            top = max(z)
            norm = top + math.log(sum(math.exp(zv - top) for zv in z))
            assert abs(logp[i, t].item() - (z[ids[i, t]] - norm)) < 1e-5
            probs = [math.exp(zv - norm) for zv in z]
            ent = -sum(q * math.log(q) for q in probs if q > 0)
            assert abs(entropy[i, t].item() - ent) < 1e-5


def test_chunked_gradients_match_the_full_logits_gradients() -> None:
    """d/d(hidden) and d/d(head) of a weighted sum of log-probs: chunks of 2 (each recomputed in the
    backward) against `log_softmax` of the full logits."""
    hidden, head, ids, mask = _problem(1)
    weights = torch.randn(3, 5, generator=torch.Generator().manual_seed(5))

    def grads(chunked: bool) -> list[torch.Tensor]:
        h = hidden.clone().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        if chunked:
            logp, _ = chunked_token_logprobs(h, head, ids, mask, chunk_tokens=2, temperature=1.3)
        else:
            full = torch.log_softmax(head(h) / 1.3, dim=-1)
            logp = full.gather(-1, ids[..., None]).squeeze(-1).masked_fill(~mask, 0.0)
        (logp * weights).sum().backward()
        return [h.grad, head.weight.grad, head.bias.grad]

    for a, b in zip(grads(True), grads(False), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    assert grads(True)[0][~mask].abs().max() == 0  # masked positions get no gradient


def test_the_head_never_sees_more_than_one_chunk() -> None:
    """Peak memory is bounded by the chunk: every call of the head, in the forward and in the backward's
    recomputation, gets at most `chunk_tokens` rows (13 valid tokens, chunks of 4: 4 calls each way)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 6, 8, generator=g, requires_grad=True)
    head = torch.nn.Linear(8, 50)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask.view(-1)[:13] = True
    ids = torch.randint(0, 50, (4, 6), generator=g)
    rows: list[int] = []
    head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    logp, _ = chunked_token_logprobs(hidden, head, ids, mask, chunk_tokens=4)
    assert rows == [4, 4, 4, 1]
    logp.sum().backward()
    assert len(rows) == 8 and sorted(rows[4:]) == [1, 4, 4, 4]  # each chunk recomputed once, alone


def test_entropy_is_not_recomputed_in_the_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward recomputes each chunk's log-probs only: the entropies (logged, no gradient) are taken
    once per chunk, in the forward (13 tokens in chunks of 4: 4 entropy computations, not 8)."""
    calls: list[int] = []
    entr = torch.special.entr

    def counting(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return entr(x)

    monkeypatch.setattr(torch.special, "entr", counting)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 1, 8, generator=g, requires_grad=True)
    logp, entropy = chunked_token_logprobs(
        hidden,
        torch.nn.Linear(8, 30),
        torch.zeros(13, 1, dtype=torch.long),
        torch.ones(13, 1, dtype=torch.bool),
        chunk_tokens=4,
    )
    logp.sum().backward()
    assert calls == [4, 4, 4, 1] and entropy is not None and bool((entropy > 0).all())


def test_no_valid_token_gives_zeros_attached_to_the_graph() -> None:
    hidden = torch.randn(2, 3, 8, requires_grad=True)
    logp, entropy = chunked_token_logprobs(
        hidden,
        torch.nn.Linear(8, 5),
        torch.zeros(2, 3, dtype=torch.long),
        torch.zeros(2, 3, dtype=torch.bool),
        chunk_tokens=2,
    )
    assert logp.abs().sum() == 0 and entropy is not None and entropy.abs().sum() == 0
    logp.sum().backward()  # no error: the trainer can still call backward on an all-masked microbatch
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_logprobs(
            hidden,
            torch.nn.Linear(8, 5),
            torch.zeros(2, 3, dtype=torch.long),
            torch.ones(2, 3, dtype=torch.bool),
            chunk_tokens=0,
        )


# ----------------------------------------------------------------------------- policies
def _rollout(pol: TextPolicy):
    torch.manual_seed(0)
    ro = pol.rollout([{"prompt": p} for p in PROMPTS], 3, compute_logp=False)
    ro.mask[0, 4:] = False  # some right padding
    return ro[torch.randperm(len(ro), generator=torch.Generator().manual_seed(1))]


@pytest.mark.parametrize("shared_prefix", [True, False])
@pytest.mark.parametrize("lora", [False, True])
def test_text_policy_chunked_equals_full_logits(
    random_text_model_dir: Path, shared_prefix: bool, lora: bool, check_chunked_matches_full
) -> None:
    """Log-probs, entropies and parameter gradients of the text policy (temperature 0.7), plain and
    shared-prefix forwards, full fine-tuning and LoRA (adapters on the output head too)."""
    kw = {}
    if lora:
        kw["lora"] = LoraConfig(enabled=True, r=4, alpha=8, target_modules=["q_proj", "v_proj", "lm_head"])
    pol = TextPolicy.from_pretrained(
        str(random_text_model_dir), max_new_tokens=10, temperature=0.7, shared_prefix=shared_prefix, **kw
    )
    if (
        lora
    ):  # lora_B starts at zero: move away from the identity adapter so every LoRA weight gets a gradient
        with torch.no_grad():
            for n, q in pol.model.named_parameters():
                if "lora_B" in n:
                    q.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(2))
        assert any(
            "lm_head" in n and "lora_" in n for n, q in pol.model.named_parameters() if q.requires_grad
        )
    n = check_chunked_matches_full(pol, _rollout(pol), 7)
    assert n > (4 if lora else 10)


def test_lora_reference_logprobs_chunked_equal_full(random_text_model_dir: Path) -> None:
    """The reference (adapter disabled) goes through the decoder-only no-grad path."""
    pol = TextPolicy.from_pretrained(
        str(random_text_model_dir), max_new_tokens=10, lora=LoraConfig(enabled=True, r=4, alpha=8)
    )
    with torch.no_grad():
        for n, q in pol.model.named_parameters():
            if "lora_B" in n:
                q.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(2))
    ro = _rollout(pol)
    pol.logprob_chunk_size = 5
    chunked = pol.reference_logprobs(ro)
    pol.logprob_chunk_size = None
    full = pol.reference_logprobs(ro)
    assert torch.allclose(chunked, full, atol=1e-5)
    assert not torch.allclose(
        full, pol._logprobs(pol.model, ro, grad=False), atol=1e-3
    )  # the adapter matters


def test_a_head_the_chunked_path_cannot_see_is_reported(random_text_model_dir: Path) -> None:
    """A model whose forward changes the logits after the output head (a logit scale, as some families
    apply): the first chunked call compares with the full path and raises instead of training on wrong
    numbers."""
    pol = TextPolicy.from_pretrained(str(random_text_model_dir), max_new_tokens=6)
    ro = _rollout(pol)

    def logit_scale(module, args, kwargs, out):
        out.logits = 4.0 * out.logits
        return out

    pol.model.register_forward_hook(logit_scale, with_kwargs=True)
    with pytest.raises(ChunkedLogprobError, match="model.logprob_chunk_size: null"):
        pol.action_stats(ro)
    pol.logprob_chunk_size = None
    pol.action_stats(ro)  # the full path works


def test_config_key_is_validated(tmp_path: Path) -> None:
    base = {
        "pipeline": "text_reasoning",
        "output_dir": str(tmp_path),
        "model": {"name_or_path": "x"},
        "rewards": [{"name": "format"}],
    }
    assert config_from_dict(base).model.logprob_chunk_size == 1024
    assert (
        config_from_dict(
            {**base, "model": {"name_or_path": "x", "logprob_chunk_size": None}}
        ).model.logprob_chunk_size
        is None
    )
    with pytest.raises(ConfigError, match="model.logprob_chunk_size"):
        config_from_dict({**base, "model": {"name_or_path": "x", "logprob_chunk_size": 0}})
