"""What the `mmalign` command prints besides its own output: log records and third-party warnings.

Details: docs/architecture.md, "mmalign.app.console".
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from typing import Any

# (action, message regex matched at the start of the message (case-insensitive), category, why).
# "once": shown the first time, then never again in this process; "ignore": never shown.
_THIRD_PARTY_WARNINGS: tuple[tuple[str, str, type[Warning], str], ...] = (
    (
        "once",
        r"`(past_key_values|cache_params)` is deprecated and (will be|removed)",
        FutureWarning,
        # transformers 5.x renamed the KV-cache argument of `forward` / `generate` to `cache`. mmalign
        # passes the name the installed release takes (`mmalign.algorithms.logprobs.cache_kwarg`);
        # this is for code between us and the model (PEFT wrappers, remote model code, plugins) that still
        # passes the old name: nothing a user can change, so it is shown once, not once per step.
        "transformers KV-cache argument rename",
    ),
)

_ONCE = [
    (re.compile(message, re.IGNORECASE), category)
    for action, message, category, _ in _THIRD_PARTY_WARNINGS
    if action == "once"
]
_shown: set[tuple[type[Warning], str]] = set()


def _is_named_once(message: Warning | str, category: type[Warning]) -> bool:
    text = str(message)
    return any(issubclass(category, cat) and rx.match(text) for rx, cat in _ONCE)


def _once_showwarning(show: Any) -> Any:
    """``warnings.showwarning`` that passes every warning to `show`, a warning named "once" only the first
    time its text is seen in this process."""

    def showwarning(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        if _is_named_once(message, category):
            key = (category, str(message))
            if key in _shown:
                return
            _shown.add(key)
        show(message, category, filename, lineno, file, line)

    showwarning._mmalign_quiet = True  # type: ignore[attr-defined]
    return showwarning


def quiet_third_party_warnings() -> None:
    """Show each warning of `_THIRD_PARTY_WARNINGS` at most once per run ("ignore": never).

    Called once by the command line at startup (`mmalign.app.cli.main`): adds one ``ignore`` filter per
    "ignore" entry and wraps ``warnings.showwarning`` to drop the repeats of the "once" entries; nothing
    else changes. Calling it again changes nothing. Does nothing when the user chose the warning filters
    (``python -W ...`` or ``PYTHONWARNINGS``): theirs then apply unchanged."""
    if sys.warnoptions:
        return
    for action, message, category, _why in _THIRD_PARTY_WARNINGS:
        if action == "ignore":
            warnings.filterwarnings("ignore", message=message, category=category)
    if not getattr(warnings.showwarning, "_mmalign_quiet", False):
        warnings.showwarning = _once_showwarning(warnings.showwarning)


# ----------------------------------------------------------------------------- log records and progress bars
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
"""The format of the command line's log lines (``WARNING rewards.boxes: ...``)."""


class TqdmLoggingHandler(logging.StreamHandler):
    """A ``logging`` handler that writes each record with ``tqdm.write``: tqdm clears its bars on the stream,
    writes the line and draws the bars again, so a record logged mid-step is a line of its own above the
    progress bar (a plain ``StreamHandler`` writes it where the bar's cursor is, glued to the bar).

    `stream`: where to write; None (the default) means ``sys.stderr`` as it is when the record is emitted
    (so a stream swapped in later, e.g. by a test's capture, is used)."""

    def __init__(self, stream: Any = None) -> None:
        super().__init__(stream)
        self._follow_stderr = stream is None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm.auto import tqdm

            stream = sys.stderr if self._follow_stderr else self.stream
            tqdm.write(self.format(record), file=stream)
            stream.flush()
        except RecursionError:  # as logging.StreamHandler.emit
            raise
        except Exception:
            self.handleError(record)


def setup_logging(level: int = logging.WARNING) -> None:
    """Log records of `level` and above to stderr through `TqdmLoggingHandler`, in `LOG_FORMAT`.

    Called once by the command line at startup (`mmalign.app.cli.main`); like ``logging.basicConfig`` it does
    nothing when the root logger already has a handler (an application embedding mmalign keeps its own)."""
    handler = TqdmLoggingHandler()
    handler.addFilter(PrintedByTheirOwnHandler())
    logging.basicConfig(level=level, format=LOG_FORMAT, handlers=[handler])


class PrintedByTheirOwnHandler(logging.Filter):
    """Drops a record that a logger between its own and the root already handled: huggingface_hub gives its
    library logger a stderr handler and lets records propagate, so each of its lines (the hub retries) printed
    twice, once plain and once as ``WARNING huggingface_hub...`` through the root's handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None and logger is not logging.root:
            if logger.handlers:
                return False
            if not logger.propagate:
                break
            logger = logger.parent  # type: ignore[assignment]
        return True


# ----------------------------------------------------------------------------- diffusers' empty float32 notice
# (in the policies layer, whose diffusers loaders install it; re-exported here for the planner and the tests)
from mmalign.policies.diffusers_notices import (  # noqa: E402
    EmptyFp32NoticeFilter,  # noqa: F401
    quiet_diffusers_fp32_notice,  # noqa: F401
)
