"""TextPolicy: tokenizer round trip, rollout masks, log-probs against generate's own scores, LoRA/reference,
the own decode loop and its sampler against `generate` and transformers' warpers."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from mmalign import tiny
from mmalign.algorithms.logprobs import selective_log_softmax, token_entropy
from mmalign.config import LoraConfig
from mmalign.policies.text import TextPolicy
from mmalign.policies.token_sampling import completion_mask, sample_next_tokens


def test_bpe_tokenizer_survives_save_and_auto_load(tmp_path: Path) -> None:
    """AutoTokenizer of a Qwen2-architecture folder must tokenize exactly like the in-process BPE."""
    texts = ["Q: 7 + 5 = ?\nA: <answer>12</answer>", "hello world 123, it's 4.5!"] * 20
    tok = tiny.train_bpe_tokenizer(texts, vocab_size=280)
    model = tiny.tiny_causal_lm(tok, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    plain = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    for s in ["Q: 13 + 9 = ?\nA:", " <answer>12</answer>", "it's 4.5 hello"]:
        assert loaded(s)["input_ids"] == tok(s)["input_ids"] == plain(s)["input_ids"], s
        assert loaded.decode(loaded(s)["input_ids"]) == s
    assert loaded.eos_token == tiny.EOS and loaded.pad_token == tiny.PAD
    assert loaded.chat_template == tiny.CHAT_TEMPLATE


def test_selective_log_softmax_matches_full() -> None:
    logits = torch.randn(3, 5, 11)
    idx = torch.randint(0, 11, (3, 5))
    ref = torch.log_softmax(logits, -1).gather(-1, idx[..., None]).squeeze(-1)
    assert torch.allclose(selective_log_softmax(logits, idx), ref, atol=1e-6)


def test_completion_mask_includes_eos_and_stops() -> None:
    ids = torch.tensor([[5, 6, 0, 1, 1], [5, 5, 5, 5, 5], [0, 1, 1, 1, 1]])
    m = completion_mask(ids, eos_ids=[0])
    assert m.tolist() == [
        [True, True, True, False, False],
        [True] * 5,
        [True, False, False, False, False],
    ]
    m2 = completion_mask(ids, eos_ids=[0], stop_lengths=torch.tensor([2, 4, 5]))
    assert m2.sum(1).tolist() == [2, 4, 1]


def _policy(path: Path, **kw) -> TextPolicy:
    kw.setdefault("max_new_tokens", 10)
    return TextPolicy.from_pretrained(str(path), **kw)


def _rows(prompts: list[str]) -> list[dict]:
    return [{"prompt": p, "idx": i} for i, p in enumerate(prompts)]


PROMPTS = ["Q: 1 + 2 = ?\nA:", "hello", "Q: 9 + 9 = ?\nA: <answer>", "world, the end. Q: 3 + 4 = ?\nA:"]


def test_rollout_fields_and_columns(random_text_model_dir: Path) -> None:
    torch.manual_seed(0)
    pol = _policy(random_text_model_dir)
    ro = pol.rollout(_rows(PROMPTS), 3, compute_logp=True)
    assert len(ro) == 12 and ro.group.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert ro.columns["idx"] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert ro.prompts[3] == "hello"
    n = ro.outputs["num_tokens"]
    assert torch.equal(n, ro.mask.sum(1))
    # the mask is a prefix; a sample that stopped ends with EOS, a truncated one fills T
    for i in range(len(ro)):
        k = int(n[i])
        assert ro.mask[i, :k].all() and not ro.mask[i, k:].any()
        ids = ro.payload["completion_ids"][i]
        if not bool(ro.outputs["truncated"][i]):
            assert int(ids[k - 1]) in pol.eos_ids
        else:
            assert k == 10
    # logp_old: finite on valid tokens, 0 on padding
    assert torch.isfinite(ro.logp_old).all() and (ro.logp_old[~ro.mask] == 0).all()
    assert (ro.logp_old[ro.mask] < 0).all()


def test_logprobs_equal_generate_scores_with_left_padding(random_text_model_dir: Path) -> None:
    """Recomputed log-probs equal those of the distribution generate sampled from (prompts of
    different lengths, so left padding and position ids matter), at temperature 0.7."""
    pol = _policy(random_text_model_dir, temperature=0.7)
    ids, att = pol._encode_prompts(PROMPTS)
    assert (att == 0).any()  # some prompts are padded
    torch.manual_seed(1)
    out = pol.model.generate(
        input_ids=ids,
        attention_mask=att,
        do_sample=True,
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        max_new_tokens=6,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=pol.tokenizer.pad_token_id,
        eos_token_id=pol.eos_ids,
    )
    comp = out.sequences[:, ids.shape[1] :]
    scores = torch.stack(out.scores, dim=1)  # [B, T, V], already divided by the temperature
    ref = torch.log_softmax(scores.float(), -1).gather(-1, comp[..., None]).squeeze(-1)
    mask = completion_mask(comp, pol.eos_ids)
    from mmalign.data.batch import Rollout

    ro = Rollout(
        group=torch.arange(4),
        mask=mask,
        prompts=PROMPTS,
        payload={"prompt_ids": ids, "prompt_mask": att, "completion_ids": comp.masked_fill(~mask, 1)},
    )
    logp = pol.action_stats(ro).logp
    assert torch.allclose(logp[mask], ref[mask], atol=1e-4), (logp[mask] - ref[mask]).abs().max()


def test_ratio_is_one_on_unchanged_weights(random_text_model_dir: Path) -> None:
    pol = _policy(random_text_model_dir)
    ro = pol.rollout(_rows(PROMPTS), 2, compute_logp=True)
    logp = pol.action_stats(ro).logp
    assert torch.allclose(logp.detach(), ro.logp_old, atol=1e-6)
    # and a minibatch slice gives the same numbers
    sub = ro[[1, 4, 6]]
    assert torch.allclose(pol.action_stats(sub).logp.detach(), ro.logp_old[[1, 4, 6]], atol=1e-6)


def test_stop_lengths_find_the_token_that_completes_the_stop_string(random_text_model_dir: Path) -> None:
    pol = _policy(random_text_model_dir, stop_strings=["wor", "zzz"])
    ids = pol.tokenizer("hello world, the end")["input_ids"]
    k = next(k for k in range(1, len(ids) + 1) if "wor" in pol.tokenizer.decode(ids[:k]))
    none = pol.tokenizer("hello hello")["input_ids"]
    width = max(len(ids), len(none))
    batch = torch.tensor([ids + [1] * (width - len(ids)), none + [1] * (width - len(none))])
    assert pol._stop_lengths(batch).tolist() == [k, width + 1]


def test_stop_strings_end_the_completion(tiny_text_model_dir: Path) -> None:
    """The warm-started model writes ' <answer>N</answer>' then EOS; stopping at '</' cuts it there."""
    torch.manual_seed(0)
    pol = _policy(tiny_text_model_dir, max_new_tokens=12, stop_strings=["</"])
    ro = pol.rollout(_rows(["Q: 3 + 4 = ?\nA:", "Q: 9 + 1 = ?\nA:"]), 4, compute_logp=True)
    for i, text in enumerate(ro.outputs["texts"]):
        assert text.endswith("</"), text
        assert not bool(ro.outputs["truncated"][i])
        k = int(ro.outputs["num_tokens"][i])
        assert (
            not ro.mask[i, k:].any()
            and (ro.payload["completion_ids"][i, k:] == pol.tokenizer.pad_token_id).all()
        )
    # without the stop string the same model finishes with EOS, and nothing is flagged truncated
    ro2 = _policy(tiny_text_model_dir, max_new_tokens=12).rollout(
        _rows(["Q: 3 + 4 = ?\nA:"]), 4, compute_logp=False
    )
    assert all(t.endswith("</answer>") for t in ro2.outputs["texts"])
    assert not ro2.outputs["truncated"].any()
    ro3 = _policy(tiny_text_model_dir, max_new_tokens=3).rollout(
        _rows(["Q: 3 + 4 = ?\nA:"]), 2, compute_logp=False
    )
    assert ro3.outputs["truncated"].all()


def test_lora_reference_is_the_base_model(random_text_model_dir: Path) -> None:
    pol = _policy(random_text_model_dir, lora=LoraConfig(enabled=True, r=4, alpha=8))
    names = [n for n, p in pol.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    base = _policy(random_text_model_dir)
    ro = base.rollout(_rows(PROMPTS[:2]), 2, compute_logp=True)
    # LoRA B starts at zero: policy == base; perturb B, then the reference still equals base
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                p.add_(0.5)
    ref = pol.reference_logprobs(ro)
    assert torch.allclose(ref, ro.logp_old, atol=1e-5)
    assert not torch.allclose(pol.action_stats(ro).logp.detach(), ro.logp_old, atol=1e-3)


def test_full_finetune_reference_is_a_frozen_copy(random_text_model_dir: Path) -> None:
    pol = _policy(random_text_model_dir, need_reference=True)
    ro = pol.rollout(_rows(PROMPTS[:2]), 2, compute_logp=True)
    with torch.no_grad():
        for p in pol.model.parameters():
            p.mul_(1.1)
    assert torch.allclose(pol.reference_logprobs(ro), ro.logp_old, atol=1e-5)
    assert all(not p.requires_grad for p in pol.ref_model.parameters())


def test_chat_template_is_applied(random_text_model_dir: Path) -> None:
    pol = _policy(random_text_model_dir, use_chat_template=True, system_prompt="be brief")
    assert pol.format_prompt("hi") == "<|system|>be brief\n<|user|>hi\n<|assistant|>"


def test_trainable_state_round_trip(random_text_model_dir: Path) -> None:
    pol = _policy(random_text_model_dir)
    state = pol.trainable_state_dict()
    with torch.no_grad():
        for p in pol.model.parameters():
            p.zero_()
    pol.load_trainable_state_dict(state)
    again = pol.trainable_state_dict()
    assert all(torch.equal(state[k], again[k]) for k in state)
    with pytest.raises(ValueError, match="does not match"):
        pol.load_trainable_state_dict({"nope": torch.zeros(1)})


@pytest.mark.parametrize("lora", [False, True])
def test_shared_prefix_logprobs_and_gradients_equal_plain_forward(
    random_text_model_dir: Path, lora: bool, check_shared_prefix_matches_plain
) -> None:
    """Prefix Grouper: same per-token log-probs AND parameter gradients as the plain forward, with
    prompts of different lengths (left padding), completions of different lengths (right padding)
    and groups scattered over the batch (as after minibatch shuffling)."""
    kw = {"lora": LoraConfig(enabled=True, r=4, alpha=8)} if lora else {}
    pol = _policy(random_text_model_dir, **kw)
    torch.manual_seed(0)
    ro = pol.rollout(_rows(PROMPTS), 3, compute_logp=False)
    ro.mask[0, 4:] = False  # force some right padding
    ro = ro[torch.randperm(len(ro), generator=torch.Generator().manual_seed(1))]
    check_shared_prefix_matches_plain(pol, ro)


def test_prefilled_generation_samples_the_same_tokens(random_text_model_dir: Path) -> None:
    """Generation from a per-prompt prefilled KV cache draws the same tokens as plain `generate`."""
    pol = _policy(random_text_model_dir)
    outs = []
    for shared in (False, True):
        pol.shared_prefix = shared
        torch.manual_seed(0)
        outs.append(pol.rollout(_rows(PROMPTS), 4, compute_logp=True))
    plain, shared = outs
    assert torch.equal(plain.payload["completion_ids"], shared.payload["completion_ids"])
    assert torch.allclose(plain.logp_old, shared.logp_old, atol=1e-5)


@pytest.mark.parametrize("shared", [False, True])
def test_generation_raises_no_future_warning(random_text_model_dir: Path, shared: bool) -> None:
    """Sampling (with the prefilled KV cache or without) uses the arguments the installed transformers wants:
    no FutureWarning (the old `past_key_values` name warned at every step)."""
    pol = _policy(random_text_model_dir)
    pol.shared_prefix = shared
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ro = pol.rollout(_rows(PROMPTS), 2, compute_logp=False)
    assert len(ro) == 8
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []


def test_token_entropy_against_a_plain_loop() -> None:
    import math

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)
    logits[0, 1, 3] = float("-inf")  # a suppressed token contributes nothing
    got = token_entropy(logits, chunk=2)
    for b in range(2):
        for t in range(5):
            z = [math.exp(v) for v in logits[b, t].tolist()]
            total = sum(z)
            h = -sum((p / total) * math.log(p / total) for p in z if p > 0)
            assert abs(got[b, t].item() - h) < 1e-5
    assert torch.allclose(token_entropy(torch.zeros(1, 3, 8)), torch.full((1, 3), math.log(8)))


def test_evaluate_returns_entropy_of_the_sampled_distribution(random_text_model_dir: Path) -> None:
    pol = _policy(random_text_model_dir)
    ro = pol.rollout(_rows(PROMPTS[:2]), 2, compute_logp=True)
    stats = pol.action_stats(ro)
    assert stats.entropy is not None and stats.entropy.shape == ro.mask.shape
    assert not stats.entropy.requires_grad
    assert torch.all(stats.entropy[~ro.mask] == 0) and torch.all(stats.entropy[ro.mask] > 0)
    vocab = pol.model.config.vocab_size
    assert torch.all(stats.entropy <= math.log(vocab) + 1e-4)


# ----------------------------------------------------------------------------- the own decode loop
def _reference_inverse_cdf(logits: torch.Tensor, u: torch.Tensor, temperature: float, suppressed: list[int]):
    """Per row, the first id whose running sum of softmax(logits / T) (suppressed ids removed, float64,
    a plain loop) exceeds u; and each row's log_softmax in float64."""
    tokens, logps = [], []
    for row, ur in zip(logits.float().tolist(), u.tolist(), strict=True):
        z = [
            -math.inf if i in suppressed else float(torch.tensor(x, dtype=torch.float32) / temperature)
            for i, x in enumerate(row)
        ]
        top = max(z)
        w = [math.exp(x - top) for x in z]
        total = sum(w)
        acc, pick = 0.0, len(w) - 1
        for i, wi in enumerate(w):
            acc += wi / total
            if acc > ur:
                pick = i
                break
        tokens.append(pick)
        logps.append([x - top - math.log(total) for x in z])
    return torch.tensor(tokens), torch.tensor(logps, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_draws_the_inverse_cdf_token_of_its_uniform_number(dtype: torch.dtype) -> None:
    """With the uniform numbers its generator yields, `sample_next_tokens` picks exactly the token a plain
    float64 inverse CDF of softmax(logits / T) picks (V = 1000: four blocks, the last one partial; a
    suppressed id; bf16 logits read in their own dtype), and returns that token's log_softmax."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 1000, generator=g) * 3).to(dtype)
    temperature, suppressed = 0.7, [5]
    tokens, logp = sample_next_tokens(
        logits.clone(),
        temperature=temperature,
        suppressed=torch.tensor(suppressed),
        generator=torch.Generator().manual_seed(11),
    )
    u = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    ref_tokens, ref_logp = _reference_inverse_cdf(logits, u, temperature, suppressed)
    assert torch.equal(tokens, ref_tokens)
    assert not (tokens == 5).any() and len(set(tokens.tolist())) > 20
    assert torch.allclose(logp.double(), ref_logp.gather(1, tokens[:, None]).squeeze(1), atol=2e-5)


@pytest.mark.parametrize(
    ("top_k", "top_p"), [(5, 1.0), (0, 0.7), (10, 0.8), (3, 1.0)], ids=["top_k", "top_p", "both", "ties"]
)
def test_sampler_truncation_matches_the_transformers_warpers(top_k: int, top_p: float) -> None:
    """Top-k / top-p against transformers' own `TopKLogitsWarper` / `TopPLogitsWarper` (a peer
    implementation) on the same logits: the tokens drawn lie in the warped support, with its frequencies
    (20,000 draws, within 5 standard deviations); "ties": the 3rd and 4th logits are equal, and both stay
    in, as in transformers. The log-probs are those of the untruncated distribution."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(1)
    row = torch.randn(1, 300, generator=g) * 2
    if top_k == 3:
        order = row[0].argsort(descending=True)
        row[0, order[3]] = row[0, order[2]]
    temperature, n = 1.3, 20_000
    tokens, logp = sample_next_tokens(
        row.repeat(n, 1), temperature=temperature, top_k=top_k, top_p=top_p, generator=g
    )
    scores = row / temperature
    full = torch.log_softmax(scores, dim=-1)[0]
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    probs = torch.softmax(scores.double(), dim=-1)[0]
    counts = torch.bincount(tokens, minlength=300).double()
    assert counts[probs == 0].sum() == 0
    assert (counts[probs > 0] > 0).all()
    if top_k == 3:
        assert int((probs > 0).sum()) == 4
    sd = (probs * (1 - probs) / n).sqrt()
    assert ((counts / n - probs).abs() <= 5 * sd + 1e-9).all()
    assert torch.allclose(logp, full[tokens], atol=1e-5)


def test_sampler_makes_no_full_fp32_copy_and_no_sort() -> None:
    """On bf16 logits [8, 4096] no op makes an fp32 (or wider) tensor of more than an eighth of the
    vocabulary per row, and a top-p nucleus of a peaked distribution is found without a full sort."""
    from torch.utils._python_dispatch import TorchDispatchMode

    made: list[tuple[str, torch.dtype, int]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else [out]:
                if isinstance(t, torch.Tensor):
                    made.append((str(func), t.dtype, t.numel()))
            return out

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, 4096, generator=g) * 4).to(torch.bfloat16)
    for top_k, top_p in ((0, 1.0), (50, 0.9), (0, 0.5)):
        made.clear()
        with Record():
            sample_next_tokens(logits.clone(), top_k=top_k, top_p=top_p, generator=g)
        wide = [m for m in made if m[1] in (torch.float32, torch.float64) and m[2] > 8 * 4096 // 8]
        assert wide == [], (top_k, top_p, wide)
        assert not any(m[0].split(".")[1] in ("sort", "argsort", "msort") for m in made), (top_k, top_p)


@pytest.mark.parametrize("shared", [False, True])
def test_own_loop_decodes_like_generate(random_text_model_dir: Path, shared: bool) -> None:
    """With top-k = 1 both samplers are deterministic: the own decode loop (KV cache, left-padding
    positions, the prefilled prompt cache, EOS then padding, a token suppressed by the generation config)
    produces exactly `generate`'s completions, as the same rollout with ``sampler="hf"`` does."""
    outs = {}
    for sampler in ("mmalign", "hf"):
        pol = _policy(random_text_model_dir, top_k=1, max_new_tokens=12, sampler=sampler)
        pol.shared_prefix = shared
        greedy = pol.rollout(_rows(PROMPTS), 1, compute_logp=False).payload["completion_ids"]
        pol.model.generation_config.suppress_tokens = [int(greedy[0, 0])]  # prompt 0's greedy first token
        pol.eos_ids = sorted({*pol.eos_ids, int(greedy[1, 2])})  # prompt 1 now stops by its 3rd token
        assert pol.own_loop_blockers() == ([] if sampler == "mmalign" else ["sampler=hf"])
        outs[sampler] = pol.rollout(_rows(PROMPTS), 2, compute_logp=True)
    a, b = outs["mmalign"], outs["hf"]
    assert torch.equal(a.payload["completion_ids"], b.payload["completion_ids"])
    assert torch.equal(a.mask, b.mask) and torch.allclose(a.logp_old, b.logp_old)
    assert int(a.payload["completion_ids"][0, 0]) != int(greedy[0, 0])  # the suppressed token was not drawn
    lengths = a.mask.sum(dim=1)
    assert int(lengths[2]) <= 3 and int(lengths.max()) == 12  # a row ended at EOS, others ran on


def test_own_loop_stops_at_stop_strings_like_generate(tiny_text_model_dir: Path) -> None:
    """Stop strings end a row in the own loop as in `generate` (greedy, the warm-started model)."""
    outs = [
        _policy(tiny_text_model_dir, top_k=1, max_new_tokens=12, stop_strings=["</"], sampler=s).rollout(
            _rows(["Q: 3 + 4 = ?\nA:", "Q: 9 + 1 = ?\nA:"]), 1, compute_logp=False
        )
        for s in ("mmalign", "hf")
    ]
    assert outs[0].outputs["texts"] == outs[1].outputs["texts"]
    assert all(t.endswith("</") for t in outs[0].outputs["texts"])
    assert torch.equal(outs[0].payload["completion_ids"], outs[1].payload["completion_ids"])


def test_generation_settings_the_loop_lacks_fall_back_to_generate(random_text_model_dir: Path) -> None:
    """A repetition penalty in the model's generation config (as some instruct models ship): the rollout
    goes through `generate`, so it draws the same tokens as ``sampler="hf"`` for the same seed."""
    from mmalign.policies.token_sampling import unsupported_generation_settings

    rolls = []
    for sampler in ("mmalign", "hf"):
        pol = _policy(random_text_model_dir, sampler=sampler)
        pol.model.generation_config.repetition_penalty = 1.3
        torch.manual_seed(4)
        rolls.append(pol.rollout(_rows(PROMPTS), 2, compute_logp=False))
    assert pol.own_loop_blockers() == ["sampler=hf"]
    assert unsupported_generation_settings(pol.model.generation_config) == ["repetition_penalty=1.3"]
    assert torch.equal(rolls[0].payload["completion_ids"], rolls[1].payload["completion_ids"])
    pol.model.generation_config.repetition_penalty = 1.0  # neutral: the own loop again
    pol.sampler = "mmalign"
    assert pol.own_loop_blockers() == []
    with pytest.raises(ValueError, match="sampler"):
        _policy(random_text_model_dir, sampler="vllm")


def _count_scoring(pol: TextPolicy) -> list[int]:
    """Count the policy's scoring passes (`TextPolicy._logprobs` calls)."""
    calls = [0]
    score = pol._logprobs

    def counted(*args, **kwargs):
        calls[0] += 1
        return score(*args, **kwargs)

    pol._logprobs = counted
    return calls


def _plain_logprobs(pol: TextPolicy, rollout) -> torch.Tensor:
    """Reference: each sample alone (no padding, no KV cache, no shared prefix), its prompt and valid completion
    tokens in one forward, log_softmax(logits / T) at the completion tokens; 0 where masked."""
    p = rollout.payload
    out = torch.zeros(rollout.mask.shape, dtype=torch.float64)
    with torch.no_grad():
        for i in range(len(rollout)):
            prompt = p["prompt_ids"][i][p["prompt_mask"][i].bool()]
            n = int(rollout.mask[i].sum())
            seq = torch.cat([prompt, p["completion_ids"][i, :n]])[None]
            logits = pol.model(input_ids=seq).logits[0, len(prompt) - 1 : -1].double() / pol.temperature
            out[i, :n] = torch.log_softmax(logits, dim=-1).gather(1, seq[0, len(prompt) :, None]).squeeze(1)
    return out


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"temperature": 0.7, "top_k": 5},
        {"temperature": 1.3, "top_p": 0.8, "generation_batch_size": 3},
        {"shared_prefix": False, "stop_strings": ["e"]},
    ],
    ids=["plain", "top_k", "top_p_chunks", "no_prefix_stops"],
)
def test_own_loop_logprobs_replace_the_scoring_pass(random_text_model_dir: Path, kw: dict) -> None:
    """With ``sampled_logp`` on (an asynchronous rollout worker's copy) and ``compute_logp=True`` the own decode
    loop's log-probs of the drawn tokens are the rollout's ``logp_old``, with no scoring pass: they equal the policy's scoring path (`_logprobs`: one causal forward
    over the padded batch) and a plain reference (each sample alone, no cache) within 1e-5. fp32 tolerance: the
    loop attends over a KV cache one token at a time and runs the head on one position, the others run the
    whole sequence at once, so only the order of float operations differs (~1e-6 here)."""
    pol = _policy(random_text_model_dir, max_new_tokens=12, **kw)
    calls = _count_scoring(pol)
    torch.manual_seed(3)
    off = pol.rollout(_rows(PROMPTS), 3, compute_logp=True)  # off by default: the scoring pass
    assert calls[0] == 1 and not pol.sampled_logp
    pol.sampled_logp = True
    calls[0] = 0
    torch.manual_seed(3)
    r = pol.rollout(_rows(PROMPTS), 3, compute_logp=True)
    assert torch.equal(r.payload["completion_ids"], off.payload["completion_ids"])  # the same draws
    assert (r.logp_old - off.logp_old).abs().max() <= 1e-5
    assert calls[0] == 0 and pol.sampled_logp_blockers() == []
    assert r.logp_old.dtype == torch.float32 and r.logp_old.shape == r.mask.shape
    assert (r.logp_old[~r.mask] == 0).all() and (r.logp_old[r.mask] < 0).all()
    scored = pol._logprobs(pol.model, r, grad=False)
    assert calls[0] == 1  # (this one)
    assert (r.logp_old - scored).abs().max() <= 1e-5
    assert (r.logp_old.double() - _plain_logprobs(pol, r)).abs().max() <= 1e-5
    if "stop_strings" in kw:  # masked tails: rows that ended early
        assert int(r.mask.sum(dim=1).min()) < r.mask.shape[1]


def test_sampled_logprobs_fall_back_to_the_scoring_pass(random_text_model_dir: Path) -> None:
    """Where the loop's log-probs are not those the scoring path computes, the rollout is scored: tokens
    suppressed in sampling (generation config) or in scoring (`suppressed_ids`), bf16 logits, autocast, reduced
    fp32 matmul precision (TF32), and ``generate`` (``sampler="hf"``); without ``compute_logp`` there are none and nothing is scored."""

    def scored_once(pol: TextPolicy, **kw) -> torch.Tensor:
        pol.sampled_logp = True
        calls = _count_scoring(pol)
        r = pol.rollout(_rows(PROMPTS), 2, compute_logp=True)
        assert calls[0] == 1, pol.sampled_logp_blockers()
        return r

    pol = _policy(random_text_model_dir)
    pol.model.generation_config.suppress_tokens = [7]
    assert pol.sampled_logp_blockers() == ["suppress_tokens=[7]"]
    scored_once(pol)
    pol = _policy(random_text_model_dir)
    pol.suppressed_ids = [7]
    assert pol.sampled_logp_blockers() == ["suppressed_ids=[7]"]
    scored_once(pol)
    scored_once(_policy(random_text_model_dir, sampler="hf"))
    scored_once(_policy(random_text_model_dir, dtype="bfloat16"))
    pol = _policy(random_text_model_dir)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scored_once(pol)
    torch.set_float32_matmul_precision("high")  # TF32 on a GPU: fp32 logits, not fp32 products
    try:
        assert pol.sampled_logp_blockers() == ["float32_matmul_precision=high"]
        scored_once(pol)
    finally:
        torch.set_float32_matmul_precision("highest")
    calls = _count_scoring(pol)
    assert pol.rollout(_rows(PROMPTS), 2, compute_logp=False).logp_old is None and calls[0] == 0


def test_a_checkpoints_repetition_penalty_is_reset_so_rollouts_stay_on_policy(
    random_text_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Qwen2.5's published generation_config carries repetition_penalty 1.1: `generate` would sample from a
    penalised distribution the loss never scores. Loading resets it (and says so), and the own decode loop,
    which samples softmax(logits / T), is then no longer blocked."""
    import logging
    import shutil

    from transformers import GenerationConfig

    folder = tmp_path / "qwen-like"
    shutil.copytree(random_text_model_dir, folder)
    GenerationConfig(
        repetition_penalty=1.1, temperature=0.7, top_k=20, top_p=0.8, do_sample=True
    ).save_pretrained(folder)
    with caplog.at_level(logging.WARNING, logger="mmalign.policies.loading"):
        pol = TextPolicy.from_pretrained(str(folder))
    assert pol.model.generation_config.repetition_penalty == 1.0
    assert "repetition_penalty=1.1" in caplog.text and "reset to neutral" in caplog.text
    assert pol.own_loop_blockers() == []
