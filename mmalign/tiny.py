"""Builders for tiny offline models (tests, the quickstart, benchmarks).

Nothing here downloads anything: tokenizers are byte-level BPEs trained in-process with
`tokenizers`, models are built from config kwargs, and everything is written with
`save_pretrained` so that it is loaded back through the very `from_pretrained` path that real
hub ids use.

`build(name, path)` runs a registered builder; `mmalign train` calls it when a config sets
``model.tiny_builder`` and ``model.name_or_path`` does not exist yet.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from mmalign.registry import Registry

log = logging.getLogger(__name__)

BUILDERS: Registry[Callable[[Path], None]] = Registry("tiny model builder")

EOS = "<|endoftext|>"
PAD = "<|pad|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 512, extra_special: list[str] | None = None) -> Any:
    """A byte-level BPE trained on `texts`, wrapped as a `PreTrainedTokenizerFast` (EOS, PAD, chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [EOS, PAD, *(extra_special or [])]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_causal_lm(tokenizer: Any, **overrides: Any) -> torch.nn.Module:
    """A Qwen2-architecture causal LM of a few hundred thousand parameters, built from kwargs."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    kwargs: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    kwargs.update(overrides)
    model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build(name: str, path: str | Path) -> Path:
    """Run the tiny builder `name`, writing a `from_pretrained`-loadable folder at `path`."""
    path = Path(path)
    builder = BUILDERS.get(name)
    tmp = path.with_name(path.name + ".building")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    builder(tmp)
    tmp.rename(path)  # appears whole or not at all
    return path


def ensure_model(name_or_path: str, builder: str | None) -> str:
    """Build the tiny model at `name_or_path` if a builder is named and the folder is missing."""
    if builder and not Path(name_or_path).exists():
        log.info("building tiny model %r at %s", builder, name_or_path)
        build(builder, name_or_path)
    return name_or_path


# ----------------------------------------------------------------------------- arithmetic task

ARITH_PROMPT = "Q: {question} = ?\nA:"


def arithmetic_rows(n: int, seed: int, max_operand: int = 19) -> list[dict[str, str]]:
    """Rows of the synthetic addition task: {"question": "7 + 5", "answer": "12"}."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    rng.shuffle(pairs)
    return [{"question": f"{a} + {b}", "answer": str(a + b)} for a, b in pairs[:n]]


def _arith_completion(answer: int) -> str:
    return f" <answer>{answer}</answer>"


@BUILDERS.register("text_reasoning")
def build_text_reasoning(
    path: Path, steps: int = 300, seed: int = 0, p_correct: float = 0.4, max_operand: int = 9, **model_kwargs: Any
) -> None:
    """Tiny LM warm-started on the addition task with noisy answers (correct with prob. p_correct).

    The warm start teaches the answer format and a blurred version of the sums: the answer is
    correct with probability `p_correct`, otherwise off by one or two. The resulting base model
    therefore answers correctly about `p_correct` of the time, and RL has to sharpen it.
    """
    from tqdm.auto import tqdm

    torch.manual_seed(seed)
    rng = random.Random(seed)
    rows = arithmetic_rows((max_operand + 1) ** 2, seed=1234, max_operand=max_operand)
    texts = [ARITH_PROMPT.format(**r) + _arith_completion(int(r["answer"])) for r in rows]
    tokenizer = train_bpe_tokenizer(texts + [_arith_completion(i) for i in range(-3, 45)], vocab_size=400)
    model = tiny_causal_lm(tokenizer, **model_kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    batch = 64
    model.train()
    for _ in tqdm(range(steps), desc="warm start (tiny text model)", leave=False):
        seqs, prompt_lens = [], []
        for r in rng.sample(rows, batch):
            ans = int(r["answer"])
            u = rng.random()
            if u >= p_correct:
                ans += rng.choice([-2, -1, 1, 2])
            prompt = tokenizer(ARITH_PROMPT.format(**r))["input_ids"]
            comp = tokenizer(_arith_completion(ans))["input_ids"] + [tokenizer.eos_token_id]
            seqs.append(prompt + comp)
            prompt_lens.append(len(prompt))
        width = max(map(len, seqs))
        ids = torch.full((batch, width), tokenizer.pad_token_id)
        labels = torch.full((batch, width), -100)
        att = torch.zeros((batch, width), dtype=torch.long)
        for i, (s, pl) in enumerate(zip(seqs, prompt_lens, strict=True)):
            ids[i, : len(s)] = torch.tensor(s)
            labels[i, pl : len(s)] = torch.tensor(s[pl:])
            att[i, : len(s)] = 1
        loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "mmalign_tiny.json").write_text(
        json.dumps({"builder": "text_reasoning", "steps": steps, "seed": seed, "p_correct": p_correct})
    )
