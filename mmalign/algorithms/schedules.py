"""Things that change with training progress (see docs/architecture.md): pure functions of the trainer's step.

Every schedule here is a function of the *training step* only (``GroupTrainer.step``: the number of
finished training steps, 0 before the first one), so it needs no state of its own and is resume-safe:
the step is restored from checkpoints.

- `SlidingWindow` -- MixGRPO's window of trained SDE steps, sliding from high noise to low noise as
  training goes on (`mmalign.policies.flow_matching.FlowMatchingPolicy` with ``window_mode="sliding"``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SlidingWindow"]


@dataclass(frozen=True)
class SlidingWindow:
    """A window of ``window_size`` consecutive denoising steps whose start moves with training (MixGRPO).

    Step indices count denoising steps from the noisy end: index 0 is the first step (sigma = 1, high
    noise), ``num_steps - 1`` the last (low noise). The window starts at ``start``; every
    ``shift_every`` training steps its start moves by ``stride`` toward low noise, up to the last
    position ``end`` (default ``num_steps - window_size``, the last start at which the whole window
    fits). After the last position it restarts at ``start`` (``wrap=True``, MixGRPO's ``roll_back``)
    or stays at the last position (``wrap=False``, MixGRPO's default clip).

    So with ``P = (end - start) // stride + 1`` positions and ``k = step // shift_every``:
    ``start_at(step) = start + stride * (k mod P)`` (wrap) or ``start + stride * min(k, P - 1)``.

    Difference from MixGRPO's ``GRPOTrainingStates`` (progressive strategy): there the window is cut at
    the end of the schedule (its last positions hold fewer than ``window_size`` steps); here the window
    always holds ``window_size`` steps, so the number of trained actions per sample is constant.
    """

    num_steps: int
    window_size: int
    shift_every: int
    stride: int = 1
    start: int = 0
    end: int | None = None
    wrap: bool = True

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if not 1 <= self.window_size <= self.num_steps:
            raise ValueError(
                f"window_size must be in [1, num_steps={self.num_steps}], got {self.window_size}"
            )
        if self.shift_every < 1:
            raise ValueError(f"shift_every must be >= 1, got {self.shift_every}")
        if self.stride < 1:
            raise ValueError(f"stride must be >= 1, got {self.stride}")
        last = self.num_steps - self.window_size
        if self.end is not None and not 0 <= self.end <= last:
            raise ValueError(
                f"end (the last window start) must be in [0, num_steps - window_size = {last}], got {self.end}"
            )
        if not 0 <= self.start <= self.last:
            raise ValueError(f"start must be in [0, {self.last}] (the last window start), got {self.start}")

    @property
    def last(self) -> int:
        """The last window start (``end``, or ``num_steps - window_size``)."""
        return self.num_steps - self.window_size if self.end is None else self.end

    @property
    def positions(self) -> list[int]:
        """Every window start, in the order the window visits them."""
        return list(range(self.start, self.last + 1, self.stride))

    def start_at(self, step: int) -> int:
        """The window's first step index at training step `step` (>= 0)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n_pos = (self.last - self.start) // self.stride + 1
        k = step // self.shift_every
        k = k % n_pos if self.wrap else min(k, n_pos - 1)
        return self.start + self.stride * k

    def steps_at(self, step: int) -> list[int]:
        """The window's step indices at training step `step`."""
        s = self.start_at(step)
        return list(range(s, s + self.window_size))
