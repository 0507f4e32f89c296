"""The tiny text-reasoning model: a Qwen2-architecture LM warm-started on a synthetic addition task.

`arithmetic_rows` gives the task's rows ({"question": "7 + 5", "answer": "12"}); the builder
``text_reasoning`` (`build_text_reasoning`, registered in `mmalign.tiny.BUILDERS`) trains the tokenizer
and the model of `mmalign.tiny` on it, then blurs the answers so that RL has something to fix.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mmalign.tiny import BUILDERS, tiny_causal_lm, train_bpe_tokenizer
from mmalign.tiny.warm_start import fit

ARITH_PROMPT = "Q: {question} = ?\nA:"


def arithmetic_rows(n: int, seed: int, max_operand: int = 19) -> list[dict[str, str]]:
    """Rows of the synthetic addition task: {"question": "7 + 5", "answer": "12"}."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    rng.shuffle(pairs)
    return [{"question": f"{a} + {b}", "answer": str(a + b)} for a, b in pairs[:n]]


def _arith_completion(answer: int) -> str:
    return f" <answer>{answer}</answer>"


@BUILDERS.register("text_reasoning", minutes=1.5, phases=2)
def build_text_reasoning(
    path: Path,
    sharp_steps: int = 800,
    blur_steps: int = 300,
    seed: int = 0,
    p_correct: float = 0.35,
    max_operand: int = 9,
    **model_kwargs: Any,
) -> None:
    """Tiny LM warm-started on the addition task, then blurred so that RL has something to fix.

    Phase 1 (`sharp_steps`) teaches the format and the sums; phase 2 (`blur_steps`) fine-tunes on
    noisy answers, correct with probability `p_correct` and otherwise off by one or two. The base
    model therefore samples the right answer only about `p_correct` of the time at temperature 1,
    while its errors stay close to the truth: a sensible weak "base model" that GRPO can sharpen.
    """
    torch.manual_seed(seed)
    rng = random.Random(seed)
    rows = arithmetic_rows((max_operand + 1) ** 2, seed=1234, max_operand=max_operand)
    texts = [ARITH_PROMPT.format(**r) + _arith_completion(int(r["answer"])) for r in rows]
    tokenizer = train_bpe_tokenizer(texts + [_arith_completion(i) for i in range(-3, 45)], vocab_size=400)
    model = tiny_causal_lm(tokenizer, **model_kwargs)
    model.train()

    def batch_of(noisy: bool, size: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seqs, prompt_lens = [], []
        for r in rng.sample(rows, size):
            ans = int(r["answer"])
            if noisy and rng.random() >= p_correct:
                ans += rng.choice([-2, -1, 1, 2])
            prompt = tokenizer(ARITH_PROMPT.format(**r))["input_ids"]
            comp = tokenizer(_arith_completion(ans))["input_ids"] + [tokenizer.eos_token_id]
            seqs.append(prompt + comp)
            prompt_lens.append(len(prompt))
        width = max(map(len, seqs))
        ids = torch.full((size, width), tokenizer.pad_token_id)
        labels = torch.full((size, width), -100)
        att = torch.zeros((size, width), dtype=torch.long)
        for i, (s, pl) in enumerate(zip(seqs, prompt_lens, strict=True)):
            ids[i, : len(s)] = torch.tensor(s)
            labels[i, pl : len(s)] = torch.tensor(s[pl:])
            att[i, : len(s)] = 1
        return ids, att, labels

    def loss_at(noisy: bool) -> Callable[[int], torch.Tensor]:
        def loss(_: int) -> torch.Tensor:
            ids, att, labels = batch_of(noisy=noisy)
            return model(input_ids=ids, attention_mask=att, labels=labels).loss

        return loss

    for phase, steps, lr in (("sharp", sharp_steps, 3e-3), ("blur", blur_steps, 1e-3)):
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        fit(opt, steps, loss_at(phase == "blur"), f"LM warm start, {phase} phase")
    model.eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    meta = {
        "builder": "text_reasoning",
        "sharp_steps": sharp_steps,
        "blur_steps": blur_steps,
        "seed": seed,
        "p_correct": p_correct,
        "max_operand": max_operand,
    }
    (path / "mmalign_tiny.json").write_text(json.dumps(meta))
