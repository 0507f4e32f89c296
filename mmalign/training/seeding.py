"""Every seed and random state of a run, in one place.

The global generators (Python, NumPy, torch CPU and CUDA) of a process (`set_seed`, `rng_state`,
`set_rng_state`), the per-process offset of a configured seed (`process_seed`), the state a rollout worker
samples from (`worker_rng_state`), and `seed_policy`, which seeds the global generators and the policy's own
through the `Policy.seed` hook (a diffusion policy's noise generator, a rollout engine's seed).
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

__all__ = [
    "process_seed",
    "rng_state",
    "seed_policy",
    "seeded_worker_rng_state",
    "set_rng_state",
    "set_seed",
    "set_worker_rng_state",
    "worker_rng_state",
]


def set_seed(seed: int) -> None:
    """Seed this process's global generators: Python, NumPy (mod 2**32) and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """The global RNGs of this process: Python, NumPy, torch's CPU generator and (when CUDA is in use) every
    CUDA device's generator."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def process_seed(seed: int | None) -> int | None:
    """`seed` + this process's rank (``RANK``, set by torchrun / accelerate launch; 0 alone), so that every
    process draws different noise from the same configured seed; None stays None (unseeded)."""
    return None if seed is None else seed + int(os.environ.get("RANK", "0"))


def seed_policy(policy: Any, seed: int) -> None:
    """Seed the global generators and the policy's own (`Policy.seed`)."""
    set_seed(seed)
    policy.seed(seed)


def worker_rng_state(policy: Any) -> dict[str, Any]:
    """The random state a rollout worker samples from: the global generators of its process and the policy's own
    (`Policy.rng_state`)."""
    return {"global": rng_state(), "policy": policy.rng_state()}


def set_worker_rng_state(policy: Any, state: dict[str, Any]) -> None:
    """Restore what `worker_rng_state` returned."""
    set_rng_state(state["global"])
    policy.load_rng_state(state.get("policy", {}))


def seeded_worker_rng_state(policy: Any, seed: int) -> dict[str, Any]:
    """A `worker_rng_state` for a second worker: the global generators seeded with `seed` and the policy's private
    generators replaced by ones seeded from it, so two workers do not draw the same noise; this process's own
    state is left as it was."""
    keep = rng_state()
    try:
        set_seed(seed)
        out: dict[str, Any] = {}
        for k, (name, value) in enumerate(sorted(policy.rng_state().items())):
            if isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
                out[name] = torch.Generator().manual_seed((seed + 104729 * k) % 2**63).get_state()
            else:
                out[name] = value
        return {"global": rng_state(), "policy": out}
    finally:
        set_rng_state(keep)
