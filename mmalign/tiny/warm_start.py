"""The one optimisation loop of the tiny builders' warm starts.

`fit` runs `steps` optimiser steps of a loss the builder computes (`loss_at(step)`, which draws its own
batch): zero the gradients, backward, optionally clip the gradient norm, step the optimiser and its schedule,
show the running loss, and, every `check_every` steps, ask `stop(done)` whether to end early.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mmalign.tiny import progress_bar

__all__ = ["fit"]


def fit(
    opt: torch.optim.Optimizer,
    steps: int,
    loss_at: Callable[[int], Tensor],
    desc: str,
    *,
    sched: torch.optim.lr_scheduler.LRScheduler | None = None,
    clip_norm: float | None = None,
    stop: Callable[[int], bool] | None = None,
    check_every: int = 50,
    check_at_end: bool = False,
    progress: bool | None = True,
    window: int = 50,
    show: Callable[[], dict[str, str]] | None = None,
) -> list[float]:
    """Train for `steps` steps (fewer when `stop(done)`, called without grad every `check_every` steps
    before the last, and at the last too with `check_at_end`, returns True) and return each step's loss. `clip_norm` clips the gradient norm of the
    optimiser's parameters; `sched` steps after the optimiser; the bar shows the mean of the last `window`
    losses and what `show()` returns."""
    params = [p for group in opt.param_groups for p in group["params"]]
    losses: list[float] = []
    bar = progress_bar(range(steps), desc, enabled=progress)
    for step in bar:
        loss = loss_at(step)
        opt.zero_grad()
        loss.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, clip_norm)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(float(loss.detach()))
        recent = losses[-window:]
        bar.set_postfix(loss=f"{sum(recent) / len(recent):.4f}", **(show() if show else {}), refresh=False)
        done = step + 1
        if stop is not None and done % check_every == 0 and (done < steps or check_at_end):
            with torch.no_grad():
                if stop(done):
                    break
    bar.close()
    return losses
