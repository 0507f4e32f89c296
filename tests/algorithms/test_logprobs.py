"""Chunked log-probs (`mmalign.algorithms.logprobs`): the same numbers and gradients as the full-logits path, on the
fused linear-head path and the checkpointed one, at most one chunk of logits at a time, the chunk sized
from a memory budget (``auto``), and a clear error for a model whose head the chunked path cannot see, with a
tolerance that follows the precision the model computes in (``trainer.mixed_precision: bf16`` trains)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mmalign.algorithms.logprobs import (
    CHECKPOINT_BYTES_PER_LOGIT,
    FUSED_BYTES_PER_LOGIT,
    ChunkedLogprobError,
    agreement_tolerance,
    auto_chunk_tokens,
    check_agreement,
    chunked_token_logprobs,
    fusable_head,
    head_output_dtypes,
)
from mmalign.config import ConfigError, LoraConfig, config_from_dict
from mmalign.policies.text import TextPolicy
from mmalign.policies.token_scoring import DEFAULT_LOGPROB_MEMORY_MB, ScoringOptions, chunk_tokens

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


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_chunked_logprobs_and_entropy_match_a_plain_loop(chunk: int, fused: bool) -> None:
    hidden, head, ids, mask = _problem()
    temp, suppressed = 0.7, [3]
    with torch.no_grad():
        logp, entropy = chunked_token_logprobs(
            hidden,
            head,
            ids,
            mask,
            chunk_tokens=chunk,
            temperature=temp,
            suppressed_ids=suppressed,
            fused=fused,
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


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("suppressed", [None, [3]])
def test_chunked_gradients_match_the_full_logits_gradients(fused: bool, suppressed: list[int] | None) -> None:
    """d/d(hidden) and d/d(head) of a weighted sum of log-probs: chunks of 2 (fused: the gradient written
    from the saved log-sum-exp; checkpointed: each chunk recomputed by autograd) against `log_softmax` of
    the full logits."""
    hidden, head, ids, mask = _problem(1)
    weights = torch.randn(3, 5, generator=torch.Generator().manual_seed(5))

    def grads(chunked: bool) -> list[torch.Tensor]:
        h = hidden.clone().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        if chunked:
            logp, _ = chunked_token_logprobs(
                h, head, ids, mask, chunk_tokens=2, temperature=1.3, suppressed_ids=suppressed, fused=fused
            )
        else:
            logits = head(h)
            if suppressed:
                logits = logits.index_fill(-1, torch.tensor(suppressed), float("-inf"))
            full = torch.log_softmax(logits / 1.3, dim=-1)
            logp = full.gather(-1, ids[..., None]).squeeze(-1).masked_fill(~mask, 0.0)
        (logp * weights).sum().backward()
        return [h.grad, head.weight.grad, head.bias.grad]

    for a, b in zip(grads(True), grads(False), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    assert grads(True)[0][~mask].abs().max() == 0  # masked positions get no gradient


def test_fused_path_is_taken_for_a_plain_linear_head_only() -> None:
    """`fusable_head`: a plain `nn.Linear`; a subclass or a head with a hook goes the checkpointed way
    (the hook then sees every chunk)."""
    head = torch.nn.Linear(8, 11)
    assert fusable_head(head)

    class Scaled(torch.nn.Linear):
        pass

    assert not fusable_head(Scaled(8, 11))
    calls: list[int] = []
    head.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    assert not fusable_head(head)
    hidden, _, ids, mask = _problem()
    chunked_token_logprobs(hidden, head, ids, mask, chunk_tokens=100)
    assert calls == [int(mask.sum())]


def test_fused_path_without_weight_gradient() -> None:
    """A frozen head (LoRA elsewhere): only d/d(hidden), equal to the full path's."""
    hidden, head, ids, mask = _problem(2)
    head.requires_grad_(False)
    h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    logp, _ = chunked_token_logprobs(h1, head, ids, mask, chunk_tokens=3, fused=True)
    logp.sum().backward()
    full = torch.log_softmax(head(h2), dim=-1).gather(-1, ids[..., None]).squeeze(-1).masked_fill(~mask, 0.0)
    full.sum().backward()
    assert head.weight.grad is None and torch.allclose(h1.grad, h2.grad, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_path_in_half_precision_matches_the_checkpointed_path(dtype: torch.dtype) -> None:
    """A half-precision head: the logits are rounded to the head's dtype as its own output would be, so
    the log-probs equal the checkpointed path's (which calls the head); the gradients to half-precision
    tolerance (the fused path accumulates the weight's gradient over chunks in fp32)."""
    hidden, head, ids, mask = _problem(3)
    hidden, head = hidden.to(dtype), head.to(dtype)
    out = {}
    for fused in (True, False):
        h = hidden.clone().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        logp, ent = chunked_token_logprobs(h, head, ids, mask, chunk_tokens=2, temperature=0.8, fused=fused)
        (logp * 0.1).sum().backward()
        out[fused] = (logp.detach(), ent, h.grad.float(), head.weight.grad.float())
    assert torch.allclose(out[True][0], out[False][0], atol=1e-5)
    assert torch.allclose(out[True][1], out[False][1], atol=1e-5)
    for a, b in zip(out[True][2:], out[False][2:], strict=True):
        assert torch.allclose(a, b, atol=2e-2, rtol=2e-2)


def test_fused_path_under_autocast_computes_the_head_in_the_autocast_dtype() -> None:
    """Under bf16 autocast the head's matmul runs in bf16 on both paths (the same log-probs)."""
    hidden, head, ids, mask = _problem(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, _ = chunked_token_logprobs(hidden, head, ids, mask, chunk_tokens=2, fused=True)
        plain, _ = chunked_token_logprobs(hidden, head, ids, mask, chunk_tokens=2, fused=False)
    with torch.no_grad():
        fp32, _ = chunked_token_logprobs(hidden, head, ids, mask, chunk_tokens=2, fused=True)
    assert torch.allclose(fused, plain, atol=1e-5)
    assert not torch.allclose(fused, fp32, atol=1e-4)  # bf16 rounding shows: autocast was applied


def test_fused_path_never_makes_a_tensor_larger_than_one_chunk() -> None:
    """Every tensor any op makes during the fused forward and backward has at most chunk x V elements
    (13 valid tokens, chunks of 4, V = 500, hidden 3): no [tokens, V] logits, no full-size temporaries."""
    from torch.utils._python_dispatch import TorchDispatchMode

    sizes: list[int] = []  # elements of every new tensor (not a view, not written in place / out=)

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            flat = [*args, *kwargs.values()]
            seen = {a.untyped_storage().data_ptr() for a in flat if isinstance(a, torch.Tensor)}
            for t in out if isinstance(out, tuple | list) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    sizes.append(t.numel())
            return out

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 6, 3, generator=g, requires_grad=True)
    head = torch.nn.Linear(3, 500, bias=False)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask.view(-1)[:13] = True
    ids = torch.randint(0, 500, (4, 6), generator=g)
    with Record():
        logp, _ = chunked_token_logprobs(hidden, head, ids, mask, chunk_tokens=4, fused=True)
        logp.sum().backward()
    assert max(sizes) == 4 * 500  # the block buffer (the weight's gradient, 500 x 3, is smaller)
    assert sizes.count(4 * 500) <= 2  # one buffer in the forward, one in the backward


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
    logp, _ = chunked_token_logprobs(hidden, head, ids, mask, chunk_tokens=4, fused=False)
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
        fused=False,
    )
    logp.sum().backward()
    assert calls == [4, 4, 4, 1] and entropy is not None and bool((entropy > 0).all())


@pytest.mark.parametrize("fused", [True, False])
def test_no_valid_token_gives_zeros_attached_to_the_graph(fused: bool) -> None:
    hidden = torch.randn(2, 3, 8, requires_grad=True)
    logp, entropy = chunked_token_logprobs(
        hidden,
        torch.nn.Linear(8, 5),
        torch.zeros(2, 3, dtype=torch.long),
        torch.zeros(2, 3, dtype=torch.bool),
        chunk_tokens=2,
        fused=fused,
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


def test_auto_chunk_tokens_from_the_memory_budget() -> None:
    """Hand-worked: 256 MiB at V = 151,936 on the fused path, 4.5 bytes per logit (fp32 block + an eighth
    for the slice buffer): 268,435,456 / 683,712 = 392.6 -> 392 tokens; a bf16 head adds 2 bytes (6.5:
    271 tokens); the checkpointed path 17 bytes (103 tokens); never below one token."""
    assert FUSED_BYTES_PER_LOGIT == 4.5 and CHECKPOINT_BYTES_PER_LOGIT == 17.0
    assert auto_chunk_tokens(151_936, 256, fused=True, logits_dtype=torch.float32) == 392
    assert auto_chunk_tokens(151_936, 256, fused=True, logits_dtype=torch.bfloat16) == 271
    assert auto_chunk_tokens(151_936, 256, fused=False, logits_dtype=torch.float32) == 103
    assert auto_chunk_tokens(151_936, 0.01, fused=True, logits_dtype=torch.float32) == 1
    with pytest.raises(ValueError, match="memory_mb"):
        auto_chunk_tokens(100, 0, fused=True, logits_dtype=torch.float32)
    head = torch.nn.Linear(8, 1000)
    opts = ScoringOptions(chunk_size="auto", memory_mb=0.5)  # 524,288 / 4,500 = 116.5
    assert chunk_tokens(head, opts, torch.float32) == 116
    assert chunk_tokens(head, ScoringOptions(chunk_size=7), torch.float32) == 7


def _peak_vocab_sized_bytes(run, vocab: int, skip: tuple[int, ...]) -> int:
    """Peak bytes held at once in tensors of at least `vocab` elements, other than of shape `skip`, that
    the ops of `run()` allocate (a dispatch mode sees every op's output; a new storage is counted until its
    tensor is freed)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    live, peak = [0], [0]

    def free(n: int) -> None:
        live[0] -= n

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            flat = [*args, *kwargs.values()]
            seen = {a.untyped_storage().data_ptr() for a in flat if isinstance(a, torch.Tensor)}
            for t in out if isinstance(out, tuple | list) else [out]:
                if (
                    isinstance(t, torch.Tensor)
                    and t.numel() >= vocab
                    and tuple(t.shape) != skip
                    and t.untyped_storage().data_ptr() not in seen
                ):
                    n = t.numel() * t.element_size()
                    live[0] += n
                    peak[0] = max(peak[0], live[0])
                    weakref.finalize(t, free, n)
            return out

    with Record():
        run()
    return peak[0]


def test_auto_chunk_memory_stays_within_the_budget() -> None:
    """The vocabulary-sized tensors the fused path holds at once, forward and backward, stay within the
    budget its chunk was sized for (the checkpointed path, at the same chunk, needs several times more:
    the accounting is what makes `auto` differ between the paths). Not counted: the head weight's
    gradient [V, H], which every path makes."""
    vocab, budget_mb = 3000, 0.25
    chunk = auto_chunk_tokens(vocab, budget_mb, fused=True, logits_dtype=torch.float32)  # 262,144 / 13,500
    assert chunk == 19
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 12, 16, generator=g, requires_grad=True)
    head = torch.nn.Linear(16, vocab, bias=False)
    ids = torch.randint(0, vocab, (5, 12), generator=g)
    mask = torch.ones(5, 12, dtype=torch.bool)

    def run(fused: bool):
        def go() -> None:
            logp, _ = chunked_token_logprobs(hidden, head, ids, mask, chunk_tokens=chunk, fused=fused)
            logp.sum().backward()

        return go

    fused_peak = _peak_vocab_sized_bytes(run(True), vocab, skip=(vocab, 16))
    assert chunk * vocab * 4 <= fused_peak <= budget_mb * 2**20
    assert _peak_vocab_sized_bytes(run(False), vocab, skip=(vocab, 16)) > 2 * budget_mb * 2**20


# ----------------------------------------------------------------------------- policies
def _rollout(pol: TextPolicy):
    torch.manual_seed(0)
    ro = pol.rollout([{"prompt": p} for p in PROMPTS], 3, compute_logp=False)
    ro.mask[0, 4:] = False  # some right padding
    return ro[torch.randperm(len(ro), generator=torch.Generator().manual_seed(1))]


@pytest.mark.parametrize("chunk", [7, "auto"])
@pytest.mark.parametrize("shared_prefix", [True, False])
@pytest.mark.parametrize("lora", [False, True])
def test_text_policy_chunked_equals_full_logits(
    random_text_model_dir: Path, shared_prefix: bool, lora: bool, chunk: int | str, check_chunked_matches_full
) -> None:
    """Log-probs, entropies and parameter gradients of the text policy (temperature 0.7), plain and
    shared-prefix forwards, full fine-tuning (the fused linear head) and LoRA (adapters on the output head
    too: the checkpointed path); chunks of 7 tokens, or ``auto`` with a budget of a few tokens (V = 300)."""
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
    pol.logprob_memory_mb = 0.005  # 5,243 bytes: 3 tokens per chunk on the fused path, 1 on the other
    assert pol.scorer.use_chunked(pol.model, chunk)
    n = check_chunked_matches_full(pol, _rollout(pol), chunk)
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

    def model(**kw):
        return config_from_dict({**base, "model": {"name_or_path": "x", **kw}}).model

    assert config_from_dict(base).model.logprob_chunk_size == "auto"
    assert (
        config_from_dict(base).model.logprob_memory_mb == 256.0 == DEFAULT_LOGPROB_MEMORY_MB
    )  # = the policy's
    assert model(logprob_chunk_size=None).logprob_chunk_size is None
    assert model(logprob_chunk_size=512).logprob_chunk_size == 512
    assert model(logprob_memory_mb=64).logprob_memory_mb == 64.0
    for bad in ({"logprob_chunk_size": 0}, {"logprob_chunk_size": "big"}):
        with pytest.raises(ConfigError, match="model.logprob_chunk_size"):
            model(**bad)
    with pytest.raises(ConfigError, match="model.logprob_memory_mb"):
        model(logprob_memory_mb=0)


def test_text_policy_rejects_bad_chunk_settings(random_text_model_dir: Path) -> None:
    for bad in ({"logprob_chunk_size": 0}, {"logprob_chunk_size": "big"}, {"logprob_memory_mb": -1}):
        with pytest.raises(ValueError, match="logprob_"):
            TextPolicy.from_pretrained(str(random_text_model_dir), **bad)


# ----------------------------------------------------------------------------- the agreement check's precision


def test_agreement_tolerance_follows_the_compute_dtype() -> None:
    assert agreement_tolerance(torch.float32) == 1e-3 and agreement_tolerance(torch.float64) == 1e-3
    assert agreement_tolerance(torch.bfloat16) == 5e-2 and agreement_tolerance(torch.float16) == 5e-2
    full = torch.zeros(1, 3)
    chunked = torch.tensor([[0.0114, 0.0, 0.0]])  # the gap of a bf16-autocast full path, as measured below
    mask = torch.ones(1, 3, dtype=torch.bool)
    check_agreement(chunked, full, mask, what="m", compute_dtype=torch.bfloat16)  # within bf16 rounding
    with pytest.raises(ChunkedLogprobError) as err:
        check_agreement(chunked, full, mask, what="m", compute_dtype=torch.float32)
    message = str(err.value)
    assert "0.0114 nats" in message and "computing in float32 (limit 0.001)" in message
    assert "model.logprob_chunk_size: null" in message


def test_head_output_dtypes_sees_autocast(random_text_model_dir: Path) -> None:
    """An fp32 model under bf16 autocast (what accelerate's mixed precision wraps the forward in) computes its
    logits in bf16: the dtype the agreement check must allow for, not the weights' fp32."""
    pol = TextPolicy.from_pretrained(str(random_text_model_dir), max_new_tokens=4)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad(), head_output_dtypes(pol.model) as plain:
        pol.model(input_ids=ids)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), head_output_dtypes(pol.model) as mixed:
        pol.model(input_ids=ids)
    assert plain == [torch.float32] and mixed == [torch.bfloat16]
    assert not pol.model.lm_head._forward_hooks  # the hook is gone after the block


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps one process-wide state, whose mixed precision cannot change once set: reset it before
    and after (as accelerate's own ``AccelerateTestCase``), so that this test's bf16 and the other tests'
    "no" do not clash whatever the order."""
    from accelerate.state import AcceleratorState, GradientState

    def reset() -> None:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()

    reset()
    yield
    reset()


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_bf16_mixed_precision_trains_with_chunked_logprobs(
    random_text_model_dir: Path, tmp_path: Path
) -> None:
    """``trainer.mixed_precision: bf16`` on CPU, chunked log-probs (the default ``auto``): two steps train.

    The check compares the chunked path (fp32 head, outside the autocast region) with the full path (the
    head inside the model's autocast forward: bf16 logits). The random model's logits are ~0.1, where bf16
    rounds below 1e-3 nats; with its output head scaled x20 they are a few units, as a trained model's, and
    the first sample's gap is ~1e-2 nats: above the fp32 limit (1e-3) the check used to apply to any fp32
    model, within the bf16 one (5e-2)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mmalign.training.trainer import GroupTrainer

    model_dir = tmp_path / "model"
    model = AutoModelForCausalLM.from_pretrained(random_text_model_dir)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    model.save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(random_text_model_dir).save_pretrained(model_dir)
    repo = Path(__file__).resolve().parents[2]
    cfg = config_from_dict(
        {
            "pipeline": "text_reasoning",
            "output_dir": str(tmp_path / "run"),
            "seed": 0,
            "model": {"name_or_path": str(model_dir)},
            "data": {
                "train": str(repo / "assets" / "text_reasoning" / "train.jsonl"),
                "prompt_template": "Q: {question} = ?\nA:",
            },
            "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8},
            "rewards": [{"name": "format", "kwargs": {"tags": ["answer"]}}],
            "trainer": {
                "steps": 2,
                "lr": 1e-4,
                "cpu": True,
                "mixed_precision": "bf16",
                "progress_bar": False,
                "save_every": 100,
            },
        },
        "test",
    )
    import pipelines

    trainer = GroupTrainer(cfg, pipelines.get(cfg.pipeline)(cfg))
    history = trainer.train()
    assert [m["step"] for m in history] == [1, 2]
    assert trainer.policy.scorer.chunking_checked  # the chunked path ran and passed its check
