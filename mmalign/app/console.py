"""What the `mmalign` command prints besides its own output: third-party warnings.

Python shows a warning once per code location, but it forgets what it has shown whenever the warning
filters change (CPython clears its registries, the one of the ``"once"`` action included), and the trainer
changes them every step (``warnings.catch_warnings`` around the LR scheduler): a library warning raised
during a step is printed again at every step. `quiet_third_party_warnings` names the library warnings that
a user cannot act on and shows each of them at most once per process (per distinct text), whatever the
filters do; every other warning, the user's own included, is shown as Python shows it.
"""

from __future__ import annotations

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
        # passes the name the installed release takes (`mmalign.logprobs.cache_kwarg`);
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
