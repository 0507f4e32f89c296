"""Builders for tiny offline models (tests, the quickstart, benchmarks).

Nothing here downloads anything: tokenizers are byte-level BPEs trained in-process with
`tokenizers`, models are built from config kwargs, and everything is written with
`save_pretrained` so that it is loaded back through the very `from_pretrained` path that real
hub ids use.

`build(name, path)` runs a registered builder; `mmalign train` calls it when a config sets
``model.tiny_builder`` and ``model.name_or_path`` does not exist yet. A build announces itself on stderr
with a rough duration (the builder's ``minutes`` metadata, for 2 idle CPU cores) and every training
loop of a builder shows a `progress_bar` (elapsed<remaining) named after the build and its phase.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmalign.registry import Registry

log = logging.getLogger(__name__)

BUILDERS: Registry[Callable[[Path], None]] = Registry("tiny model builder")

EOS = "<|endoftext|>"
PAD = "<|pad|>"
QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int = 512, extra_special: list[str] | None = None
) -> Any:
    """A byte-level BPE trained on `texts`, wrapped as a `PreTrainedTokenizerFast` (EOS, PAD, chat template)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [EOS, PAD, *(extra_special or [])]
    tok = Tokenizer(models.BPE())
    # The same normalizer and pre-tokenizer as Qwen2's tokenizer class: `AutoTokenizer` rebuilds a
    # Qwen2-architecture model's tokenizer with those, so training with anything else would make the
    # folder tokenize differently once loaded back with `from_pretrained`.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
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


BUILDER_MODULES = (
    "mmalign.tiny_flow",
    "mmalign.tiny_flux",
    "mmalign.tiny_ddim",
    "mmalign.tiny_vlm",
    "mmalign.tiny_shapes",
    "mmalign.tiny_clip",
)
"""Modules that register more builders, imported on first use (not at import: they import this module)."""


def load_builders() -> list[str]:
    """Import every module of `BUILDER_MODULES` (registering its builders); returns the builder names."""
    import importlib

    for module in BUILDER_MODULES:
        importlib.import_module(module)
    return BUILDERS.names()


# ----------------------------------------------------------------------------- progress


@dataclass
class _Build:
    label: str
    """What the bars are named after: the folder being built (e.g. ``safe_diffusion-tiny``)."""
    phases: int
    """Training loops the builder runs (its ``phases`` metadata); 0: unknown."""
    started: int = 0


_BUILD: _Build | None = None


@contextmanager
def _building(label: str, phases: int) -> Iterator[_Build]:
    global _BUILD
    outer, _BUILD = _BUILD, _Build(label, phases)
    try:
        yield _BUILD
    finally:
        _BUILD = outer


def progress_bar(iterable: Iterable[Any], what: str, *, enabled: bool | None = True, **kwargs: Any) -> Any:
    """A tqdm bar on stderr over a builder's training loop (tqdm shows elapsed<remaining).

    Inside `build` the bar is named ``building tiny model LABEL: WHAT (i/n)``, i counting the builder's
    loops, and stays on screen when done (a record of how long each phase took); outside it is called
    `what` and disappears when done. `enabled`: True shows it, False hides it, None shows it only
    inside `build` (for helpers that are quiet when called directly). Reporting only: the loop runs
    the same either way. Where stderr is not a terminal (a log file) the bar is redrawn every 30 s."""
    from tqdm.auto import tqdm

    b = _BUILD
    if b is not None:
        b.started += 1
        count = f"{b.started}/{max(b.phases, b.started)}" if b.phases else f"{b.started}"
        desc = f"building tiny model {b.label}: {what} ({count})"
    else:
        desc = what
    show = enabled if enabled is not None else b is not None
    tty = getattr(sys.stderr, "isatty", lambda: False)()
    kwargs.setdefault("leave", b is not None)
    kwargs.setdefault("mininterval", 0.1 if tty else 30.0)
    kwargs.setdefault("maxinterval", max(10.0, kwargs["mininterval"]))  # tqdm's monitor redraws no more often
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, desc=desc, disable=not show, file=sys.stderr, **kwargs)


def estimate(name: str) -> str:
    """The builder's rough duration on 2 idle CPU cores, as text ("about 4 min"), from its ``minutes``
    metadata (a busy machine takes several times longer: the progress bars show the live estimate)."""
    minutes = BUILDERS.meta(name).get("minutes")
    if minutes is None:
        return "duration unknown"
    if minutes < 1:
        return f"about {max(5, round(minutes * 60 / 5) * 5)} s"
    return f"about {minutes:g} min"


def _duration(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


def build(name: str, path: str | Path, *, announce: bool = True) -> Path:
    """Run the tiny builder `name`, writing a `from_pretrained`-loadable folder at `path`.

    With `announce`, one line on stderr says what is built where and roughly how long it takes, and
    another how long it took; the builder's loops show `progress_bar`s either way."""
    path = Path(path)
    load_builders()
    builder = BUILDERS.get(name)
    meta = BUILDERS.meta(name)
    if announce:
        print(
            f"building tiny model {name!r} at {path} (first run only; {estimate(name)} on 2 idle CPU cores)",
            file=sys.stderr,
            flush=True,
        )
    t0 = time.perf_counter()
    tmp = path.with_name(path.name + ".building")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with _building(path.name, int(meta.get("phases", 0))):
        builder(tmp)
    tmp.rename(path)  # appears whole or not at all
    if announce:
        print(
            f"built tiny model {name!r} at {path} in {_duration(time.perf_counter() - t0)}",
            file=sys.stderr,
            flush=True,
        )
    return path


def ensure_model(name_or_path: str, builder: str | None) -> str:
    """Build the tiny model at `name_or_path` if a builder is named and the folder is missing."""
    if builder and not Path(name_or_path).exists():
        build(builder, name_or_path)  # announces itself on stderr
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

    for phase, steps, lr in (("sharp", sharp_steps, 3e-3), ("blur", blur_steps, 1e-3)):
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        for _ in progress_bar(range(steps), f"LM warm start, {phase} phase"):
            ids, att, labels = batch_of(noisy=phase == "blur")
            loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
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
