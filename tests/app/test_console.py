"""`mmalign.app.console.quiet_third_party_warnings`: named library warnings at most once per run."""

from __future__ import annotations

import logging
import sys
import uuid
import warnings

import pytest

from mmalign.app import console


def _step_filters_change() -> None:
    """What the trainer does every step: a `catch_warnings` block that changes the filters (which clears
    Python's per-location memory of the warnings already shown)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")


def test_cache_rename_warning_shown_once_across_steps(monkeypatch) -> None:
    monkeypatch.setattr(sys, "warnoptions", [])
    tag = uuid.uuid4().hex  # the set of warnings already shown is per process: texts no other test shows
    msg = f"`past_key_values` is deprecated and will be removed in version 6.0.0 for `M{tag}.generate`."
    msg2 = f"`past_key_values` is deprecated and will be removed in version 5.40.0 for `M{tag}.forward`."
    other = f"an unrelated FutureWarning {tag}"
    shown: list[str] = []
    with warnings.catch_warnings():  # restores the filters and showwarning afterwards
        warnings.simplefilter("default")
        warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message))
        console.quiet_third_party_warnings()
        console.quiet_third_party_warnings()  # a second call wraps nothing twice
        for _ in range(3):
            warnings.warn(msg, FutureWarning, stacklevel=1)
            warnings.warn(msg2, FutureWarning, stacklevel=1)
            warnings.warn(other, FutureWarning, stacklevel=1)
            _step_filters_change()
    assert shown.count(msg) == 1
    assert shown.count(msg2) == 1  # each distinct text once
    assert shown.count(other) == 3  # not named: shown as Python would show it (once per step here)


def test_named_warning_still_obeys_the_filters(monkeypatch) -> None:
    monkeypatch.setattr(sys, "warnoptions", [])
    msg = f"`cache_params` is deprecated and will be removed in version 6.0.0 for `M{uuid.uuid4().hex}`."
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        console.quiet_third_party_warnings()
        with pytest.raises(FutureWarning):
            warnings.warn(msg, FutureWarning, stacklevel=1)
    with pytest.warns(FutureWarning, match="cache_params"):  # pytest.warns records every warning
        warnings.warn(msg, FutureWarning, stacklevel=1)


def test_user_warning_options_win(monkeypatch) -> None:
    monkeypatch.setattr(sys, "warnoptions", ["error::FutureWarning"])
    with warnings.catch_warnings():
        before, show = list(warnings.filters), warnings.showwarning
        console.quiet_third_party_warnings()
        assert list(warnings.filters) == before
        assert warnings.showwarning is show


def test_every_filter_says_why() -> None:
    for action, message, category, why in console._THIRD_PARTY_WARNINGS:
        assert action in ("once", "ignore")
        assert message and why
        assert issubclass(category, Warning) and category is not Warning


# ----------------------------------------------------------------------------- log records and the progress bar
def _bar_and_record(handler_for) -> str:
    """What a stream shows when a warning is logged while a progress bar is drawn on it."""
    import io
    import logging

    from tqdm.auto import tqdm

    buf = io.StringIO()
    bar = tqdm(total=10, file=buf, desc="step", mininterval=0, ascii=True)
    bar.update(1)
    record = logging.LogRecord("rewards.boxes", logging.WARNING, __file__, 1, "no box in %d", (3,), None)
    handler = handler_for(buf)
    handler.setFormatter(logging.Formatter(console.LOG_FORMAT))
    handler.emit(record)
    bar.close()
    return buf.getvalue()


def test_log_record_gets_its_own_line_above_the_progress_bar() -> None:
    import logging

    line = "WARNING rewards.boxes: no box in 3"
    plain = _bar_and_record(logging.StreamHandler)
    assert "it/s]" + line in plain  # the problem: glued to the end of the bar
    out = _bar_and_record(console.TqdmLoggingHandler)
    assert line + "\n" in out and "]" + line not in out
    head = out[: out.index(line)]
    assert head.rstrip("\x1b[A").endswith("\r")  # the bar was cleared (carriage return) before the line


def test_setup_logging_routes_records_through_tqdm(monkeypatch, capsys) -> None:
    import logging

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    console.setup_logging()
    (handler,) = root.handlers
    assert isinstance(handler, console.TqdmLoggingHandler)
    logging.getLogger("rewards.boxes").warning("hello %s", "there")
    assert capsys.readouterr().err == "WARNING rewards.boxes: hello there\n"  # the stderr of the moment
    console.setup_logging()  # a root logger with a handler is left as it is
    assert root.handlers == [handler]


# ----------------------------------------------------------------------------- diffusers' empty float32 notice
class _Records:
    """A handler on diffusers' modeling logger itself (diffusers' loggers do not propagate to the root, so caplog
    would see nothing either way); a logger's filters run before its handlers."""

    def __init__(self) -> None:
        import logging

        self.records: list[logging.LogRecord] = []
        self.logger = logging.getLogger("diffusers.models.modeling_utils")
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = self.records.append  # type: ignore[method-assign]

    def __enter__(self) -> list[str]:
        self.logger.addHandler(self.handler)
        self.messages: list[str] = []
        return self.messages

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self.handler)
        self.messages.extend(r.getMessage() for r in self.records)


def test_sd3_lora_save_and_cast_print_no_empty_fp32_notice(tiny_sd3_model_dir, tmp_path) -> None:
    """A tiny SD3 LoRA save (`save_lora_adapter`, as `DenoisingPolicy._denoiser_to_save`), a folder save and a dtype
    cast (as the planner's meta models) do not log diffusers' "should be kept in float32: []"."""
    import torch
    from peft import LoraConfig

    from mmalign.policies.sd3_components import load_sd3_components

    c = load_sd3_components(tiny_sd3_model_dir, load_t5=False)
    c.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k"]))
    with _Records() as messages:
        c.transformer.save_lora_adapter(str(tmp_path / "transformer_lora"))
        c.save_pretrained(tmp_path / "out")
        c.vae.to(torch.float32)
    assert (tmp_path / "transformer_lora").is_dir() and (tmp_path / "out/transformer").is_dir()
    assert not [m for m in messages if "kept in float32" in m], messages


def test_fp32_notice_filter_keeps_every_other_record() -> None:
    import logging

    console.quiet_diffusers_fp32_notice()
    console.quiet_diffusers_fp32_notice()  # once
    logger = logging.getLogger("diffusers.models.modeling_utils")
    assert sum(isinstance(f, console.EmptyFp32NoticeFilter) for f in logger.filters) == 1
    empty = (
        "There are modules in SD3Transformer2DModel that should be kept in float32: []. Casting directly ..."
    )
    named = "There are modules in T5EncoderModel that should be kept in float32: ['wo']. Casting directly ..."
    with _Records() as messages:
        logger.warning(empty)
        logger.warning(named)
        logger.warning("some other diffusers warning")
    assert messages == [named, "some other diffusers warning"]


def test_a_library_record_its_own_handler_printed_is_not_printed_again(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """huggingface_hub's logger has its own stderr handler and propagates: its retry warnings printed twice
    (plain, then as `WARNING huggingface_hub...` through the root's handler). Now once; a record of a logger
    with no handler of its own still reaches the root's handler."""
    import io

    from mmalign.app import console

    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    own = io.StringIO()
    lib = logging.getLogger("fakehub_lib")
    lib_handler = logging.StreamHandler(own)
    lib.addHandler(lib_handler)
    try:
        console.setup_logging()
        logging.getLogger("fakehub_lib.utils._http").warning("retrying in 1s [Retry 1/5]")
        logging.getLogger("mmalign.somewhere").warning("a line of ours")
        err = capsys.readouterr().err
    finally:
        lib.removeHandler(lib_handler)
        root.handlers[:] = saved
    assert own.getvalue().count("retrying in 1s") == 1
    assert "retrying in 1s" not in err and "a line of ours" in err
