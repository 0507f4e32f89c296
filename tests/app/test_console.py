"""`mmalign.app.console.quiet_third_party_warnings`: named library warnings at most once per run."""

from __future__ import annotations

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
