"""Schedules that follow training progress: MixGRPO's sliding window of trained denoising steps."""

from __future__ import annotations

import pytest

from mmalign.algorithms.schedules import SlidingWindow


def test_sliding_window_positions_by_hand():
    # 6 steps, window 2: starts 0..4; shift every 3 training steps by 1; wraps to 0 after start 4
    w = SlidingWindow(num_steps=6, window_size=2, shift_every=3)
    assert w.positions == [0, 1, 2, 3, 4]
    assert [w.start_at(s) for s in range(17)] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 0, 0]
    assert w.steps_at(0) == [0, 1] and w.steps_at(7) == [2, 3] and w.steps_at(12) == [4, 5]


def test_sliding_window_stride_start_end_and_clip():
    # stride 2 from start 1: positions 1, 3, 5 (7 would not fit: 8 steps, window 3 -> last start 5)
    w = SlidingWindow(num_steps=8, window_size=3, shift_every=2, stride=2, start=1)
    assert w.positions == [1, 3, 5]
    assert [w.start_at(s) for s in range(8)] == [1, 1, 3, 3, 5, 5, 1, 1]
    # end bounds the slide; wrap=False stays at the last position (MixGRPO's default clip)
    w = SlidingWindow(num_steps=10, window_size=2, shift_every=1, end=3, wrap=False)
    assert [w.start_at(s) for s in range(7)] == [0, 1, 2, 3, 3, 3, 3]
    # a window as long as the schedule never moves
    assert {SlidingWindow(4, 4, 1).start_at(s) for s in range(5)} == {0}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_steps": 4, "window_size": 5, "shift_every": 1}, "window_size"),
        ({"num_steps": 4, "window_size": 2, "shift_every": 0}, "shift_every"),
        ({"num_steps": 4, "window_size": 2, "shift_every": 1, "stride": 0}, "stride"),
        ({"num_steps": 4, "window_size": 2, "shift_every": 1, "end": 3}, "end"),
        ({"num_steps": 4, "window_size": 2, "shift_every": 1, "start": 3}, "start"),
    ],
)
def test_sliding_window_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SlidingWindow(**kwargs)
    with pytest.raises(ValueError, match="step"):
        SlidingWindow(4, 2, 1).start_at(-1)
