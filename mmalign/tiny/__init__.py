"""Builders for tiny offline models (tests, the quickstart, benchmarks).

The builder registry and what every builder shares (`BUILDERS`, `build`, `ensure_model`, `get_builder`,
`progress_bar`, `train_bpe_tokenizer`, `tiny_causal_lm`); builders live in the submodules and in entry points
of ``mmalign.tiny_builders``. Nothing is downloaded: everything is built and saved with ``save_pretrained``.

Details: docs/architecture.md, "mmalign.tiny".
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmalign.errors import ConfigError
from mmalign.registry import Discovery, Registry

log = logging.getLogger(__name__)

BUILDERS: Registry[Callable[[Path], None]] = Registry("tiny model builder")

ENTRY_POINT_GROUP = "mmalign.tiny_builders"
MARK_FILE = "mmalign_tiny.json"
"""What every built tiny model folder holds (its builder and arguments): `mmalign tiny build` replaces only such a folder."""
BUILDING_MARK = ".mmalign_building"
"""What a tiny build's ``<folder>.building`` holds while it is written (the builder's pid): `build` removes a
``.building`` folder a killed build left, and nothing else of that name."""

DISCOVERY = Discovery(BUILDERS, __name__, ENTRY_POINT_GROUP)
"""Finds the builders: the submodules of this package, then the ``mmalign.tiny_builders`` entry points."""

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


def load_builders() -> list[str]:
    """Import every submodule of this package and every ``mmalign.tiny_builders`` entry point (registering
    their builders; a broken entry point is skipped, see `DISCOVERY.errors`); returns the builder names.

    Submodules are imported on first use, not at import: they import this package, and some of them
    import the policies' component loaders and diffusers."""
    return DISCOVERY.names()


def get_builder(name: str) -> Callable[[Path], None]:
    """The builder `name`, importing what registers it (`DISCOVERY.get`); `RegistryError` if unknown."""
    return DISCOVERY.get(name)


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


def _builder_defaults(name: str) -> dict[str, Any]:
    """``{"builder": name, **the default arguments}`` of builder `name` (or of the module's ``build_<name>`` it
    wraps), what ``mmalign_tiny.json`` records; ``"options": {}`` when it takes none."""
    import inspect

    registered = get_builder(name)
    full = getattr(inspect.getmodule(registered), f"build_{name}", registered)
    defaults = {
        k: list(p.default) if isinstance(p.default, tuple) else p.default
        for k, p in inspect.signature(full).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    return {"builder": name, **defaults} if defaults else {"builder": name, "options": {}}


def remove_stale(folder: Path, mark: str, *, what: str) -> None:
    """Remove `folder`, `what` a killed build left, when it is one: a folder holding the file `mark` (for
    `BUILDING_MARK`, the pid in it no longer running). Anything else there (a user's folder, a link, a build
    still running) is refused with a `ConfigError` naming it; nothing is removed."""
    if not (folder.exists() or folder.is_symlink()):
        return
    marked = not folder.is_symlink() and folder.is_dir() and (folder / mark).is_file()
    if not marked:
        raise ConfigError(
            f"{folder} exists and is not {what} (no {mark} in it), so it is not removed: move it away, or build "
            "somewhere else"
        )
    if mark == BUILDING_MARK:
        pid = (folder / mark).read_text().strip()
        if pid.isdigit() and int(pid) != os.getpid() and _running(int(pid)):
            raise ConfigError(f"{folder}: another tiny build (pid {pid}) is writing it; wait for it to end")
    import shutil

    shutil.rmtree(folder)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def build(name: str, path: str | Path, *, announce: bool = True) -> Path:
    """Run the tiny builder `name`, writing a `from_pretrained`-loadable folder at `path`.

    With `announce`, one line on stderr says what is built where and roughly how long it takes, and
    another how long it took; the builder's loops show `progress_bar`s either way."""
    path = Path(path)
    builder = get_builder(name)
    meta = BUILDERS.meta(name)
    if announce:
        print(
            f"building tiny model {name!r} at {path} (first run only; {estimate(name)} on 2 idle CPU cores)",
            file=sys.stderr,
            flush=True,
        )
    t0 = time.perf_counter()
    tmp = path.with_name(path.name + ".building")
    remove_stale(tmp, BUILDING_MARK, what="an unfinished tiny build")
    tmp.mkdir(parents=True)
    (tmp / BUILDING_MARK).write_text(f"{os.getpid()}\n")
    try:
        with _building(path.name, int(meta.get("phases", 0))):
            builder(tmp)
        if not (tmp / MARK_FILE).exists():  # a builder that records nothing itself: its name and defaults
            (tmp / MARK_FILE).write_text(json.dumps(_builder_defaults(name), indent=1, default=str) + "\n")
        (tmp / BUILDING_MARK).unlink()
    except (
        BaseException
    ):  # a failed build leaves nothing (a waiting process then builds again, or fails itself)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tmp.rename(path)  # appears whole or not at all
    if announce:
        print(
            f"built tiny model {name!r} at {path} in {_duration(time.perf_counter() - t0)}",
            file=sys.stderr,
            flush=True,
        )
    return path


def ensure_model(name_or_path: str, builder: str | None) -> str:
    """Build the tiny model at `name_or_path` if a builder is named and the folder is missing.

    Several processes may ask at once (the ranks of one multi-process launch, or two runs): an exclusive
    lock on ``<name>.lock`` beside the folder lets one of them build while the others wait, then find the
    folder and load it."""
    path = Path(name_or_path)
    if builder and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = path.with_name(path.name + ".lock")
        with open(lock, "w") as handle:
            _lock(handle)
            try:
                if not path.exists():  # built by another process while this one waited
                    build(builder, name_or_path)  # announces itself on stderr
            finally:
                _lock(handle, release=True)
        lock.unlink(missing_ok=True)  # (the folder exists now: later callers take no lock)
    return name_or_path


def _lock(handle: Any, *, release: bool = False) -> None:
    """Take (or release) an exclusive advisory lock on an open file; no-op where `fcntl` is missing."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return
    fcntl.flock(handle, fcntl.LOCK_UN if release else fcntl.LOCK_EX)
