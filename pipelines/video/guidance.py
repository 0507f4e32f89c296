"""Process-reward gradient guidance for stochastic flow-matching steps (Euphonium, arXiv:2602.04928).

Each stochastic step's mean is moved by the gradient of a process reward, mu' = mu + s * g / ||g||, and the
step's log-prob is that of the guided Gaussian. ``g`` comes from autograd (`autograd_gradient`) or an SPSA
estimate (`spsa_gradient`); ``s`` from `guidance_scale`; `guided_mean` applies it, and
`flow_sde_velocity_for_mean` / `drift_distillation_loss` teach the network the guided drift. Called from a
``DenoisingPolicy.shift_step_mean`` override. All functions are pure; per-sample coefficients may be numbers,
0-d, [B] or [B, 1, ..., 1] tensors. Formulas and our design choices: docs/video.md, "Euphonium".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mmalign.algorithms.sde import flow_sde_noise

__all__ = [
    "SPSA_DISTRIBUTIONS",
    "autograd_gradient",
    "drift_distillation_loss",
    "flow_sde_velocity_for_mean",
    "guidance_scale",
    "guided_mean",
    "guided_velocity",
    "normalized_direction",
    "spsa_gradient",
]

SPSA_DISTRIBUTIONS = ("rademacher", "gaussian")
"""Perturbation laws of `spsa_gradient`: i.i.d. +-1 entries (default) or standard normal entries."""

RewardFn = Callable[[Tensor], Tensor]
"""A process reward: Float[B, ...] latents -> Float[B] scores (higher is better), one score per sample."""


# ---------------------------------------------------------------------------------------------- helpers


def _per_sample(value: float | Tensor, ref: Tensor, name: str) -> Tensor:
    """``value`` as a tensor on ``ref``'s device that broadcasts over ``ref``: 0-d stays 0-d, [B] becomes
    [B, 1, ..., 1], a tensor already broadcastable to ``ref`` is kept."""
    t = torch.as_tensor(value, device=ref.device)
    if not t.is_floating_point():
        t = t.to(torch.float32)
    if t.ndim == 0:
        return t
    if t.ndim == 1 and ref.ndim >= 1 and t.shape[0] in (1, ref.shape[0]):
        return t.view(-1, *([1] * (ref.ndim - 1)))
    try:
        if torch.broadcast_shapes(t.shape, ref.shape) == ref.shape:
            return t
    except RuntimeError:
        pass
    raise ValueError(
        f"{name} must be a scalar, a [B] tensor (B={ref.shape[0]}) or broadcastable to {tuple(ref.shape)}, "
        f"got shape {tuple(t.shape)}"
    )


def _batch_scores(scores: Tensor, n: int, what: str) -> Tensor:
    if not isinstance(scores, Tensor) or scores.shape != (n,):
        shape = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
        raise ValueError(f"{what} must return one score per sample, Float[{n}], got {shape}")
    return scores


# ------------------------------------------------------------------------------------- guided step mean


def normalized_direction(grad: Tensor, eps: float = 1e-12) -> Tensor:
    """g / ||g|| per sample, the norm taken over all non-batch dims of ``grad`` ([B, ...]).

    A sample whose norm is not finite (a NaN / inf gradient) or is <= ``eps`` (a zero gradient) gets the zero
    direction, so it is left unguided (our design: the paper divides by the norm unguarded). Computed in
    fp32; the result has ``grad``'s shape and dtype, and its per-sample norm is 1 or 0.
    """
    if grad.ndim < 1:
        raise ValueError("grad must have a batch dim, got a 0-d tensor")
    g = grad.to(torch.float32)
    if g.ndim == 1:
        norm = g.abs()
    else:
        norm = torch.linalg.vector_norm(g, dim=tuple(range(1, g.ndim)), keepdim=True)
    ok = torch.isfinite(norm) & (norm > eps)
    direction = torch.where(ok, g, torch.zeros_like(g)) / torch.where(ok, norm, torch.ones_like(norm))
    return direction.to(grad.dtype)


def guidance_scale(std: Tensor | float, *, scale: float | None = None, beta: float | None = None) -> Tensor:
    """The guidance step size s of ``mu' = mu + s g/||g||``: exactly one of

    * ``scale``: a fixed s >= 0 (returned as a 0-d fp32 tensor on ``std``'s device), or
    * ``beta``: the KL temperature beta > 0, giving s = eta^2 / (2 beta) with eta = ``std``, the step's noise
      std (for ``mmalign.algorithms.sde.flow_sde``: s_t sqrt(|dt|), the ``std`` the step returns and
      ``StepContext.std`` holds). Keeps ``std``'s shape (0-d or per-sample [B, 1, ..., 1]), fp32.

    Raises ValueError naming the argument when both or neither are given, beta <= 0, scale < 0, or a std
    is negative or non-finite.
    """
    if (scale is None) == (beta is None):
        raise ValueError(
            "give exactly one of scale= (a fixed guidance scale) or beta= (KL temperature: "
            f"s = std^2 / (2 beta)); got scale={scale}, beta={beta}"
        )
    eta = torch.as_tensor(std).to(torch.float32)
    if scale is not None:
        if not (scale >= 0 and scale < float("inf")):
            raise ValueError(f"scale must be a finite number >= 0, got {scale}")
        return torch.tensor(float(scale), dtype=torch.float32, device=eta.device)
    assert beta is not None
    if not (beta > 0 and beta < float("inf")):
        raise ValueError(f"beta must be a finite number > 0 (the KL temperature), got {beta}")
    if not bool(torch.all(torch.isfinite(eta) & (eta >= 0))):
        raise ValueError(f"std must be finite and >= 0 for beta=, got {std}")
    return eta**2 / (2 * float(beta))


def guided_mean(mean: Tensor, grad: Tensor, s: Tensor | float) -> Tensor:
    """mu' = mu + s * g / ||g|| (`normalized_direction`), per sample.

    ``s`` is a number, a 0-d tensor, a [B] tensor or a [B, 1, ..., 1] tensor (e.g. `guidance_scale` of the
    step's std). Where s == 0 the mean is returned bit for bit (``torch.where``, not ``mean + 0``), so an
    unguided sample's step and log-prob are exactly those of the plain step. The result has ``mean``'s dtype;
    gradients flow through ``mean`` (and through ``s`` if it requires grad), not through ``grad``.
    """
    if grad.shape != mean.shape:
        raise ValueError(f"grad has shape {tuple(grad.shape)}, expected the mean's {tuple(mean.shape)}")
    if isinstance(s, (int, float)) and s == 0:
        return mean
    s_b = _per_sample(s, mean, "s")
    direction = normalized_direction(grad.detach()).to(device=mean.device, dtype=torch.float32)
    moved = (mean.to(torch.float32) + s_b * direction).to(mean.dtype)
    return torch.where(s_b != 0, moved, mean)


# ---------------------------------------------------------------------------------- reward gradients


def spsa_gradient(
    f: RewardFn,
    x: Tensor,
    *,
    c: float = 0.01,
    num_samples: int = 4,
    generator: torch.Generator | None = None,
    distribution: str = "rademacher",
    batch_size: int | None = None,
) -> Tensor:
    """SPSA estimate of grad_x f(x), per sample, without autograd (``torch.no_grad``)::

        g_hat = 1/K sum_{k=1..K} (f(x + c u_k) - f(x - c u_k)) / (2c) * u_k,       K = ``num_samples``

    ``f`` maps Float[B, ...] -> Float[B]; it must score each sample independently (no batch statistics).
    ``u_k`` has i.i.d. entries: ``"rademacher"`` (+-1 with probability 1/2, default, the classic SPSA law) or
    ``"gaussian"`` (standard normal); both have E[u u^T] = I, so E[g_hat] = grad f + O(c^2). For a linear or
    quadratic f the central difference is exact and only the draw of u adds noise.

    Draw order (so a caller can reproduce the perturbations with an identically seeded generator): one tensor
    ``u`` of shape (K, *x.shape) in fp32 on x's device, ``torch.randint(0, 2, ..., generator=generator) * 2 - 1``
    for rademacher or ``torch.randn(..., generator=generator)`` for gaussian; u_k = u[k].

    Evaluation (our design): the 2K perturbed copies of the batch are stacked into one batch of N = 2 K B
    rows, ordered [x + c u_1, ..., x + c u_K, x - c u_1, ..., x - c u_K] (each block the B samples in order),
    cast to x's dtype and scored by ONE call of f. Row r of what f receives is a perturbation of sample
    r % B, always: a reward with per-sample conditioning (prompt embeddings, targets) repeats it as
    ``cond.repeat(n // B, ...)`` for n input rows. ``batch_size`` caps the rows per call when 2 K B latents do
    not fit in memory: f is then called on consecutive chunks of max(1, batch_size // B) whole copies of the
    batch (so the r % B rule holds in every call). Cost: 2 K reward evaluations per sample.

    Returns a tensor of x's shape and (floating) dtype, accumulated in fp32, with no autograd graph.
    """
    if not c > 0:
        raise ValueError(f"c (the SPSA perturbation size) must be > 0, got {c}")
    if not (isinstance(num_samples, int) and num_samples >= 1):
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples}")
    if distribution not in SPSA_DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {', '.join(SPSA_DISTRIBUTIONS)}; got {distribution!r}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    if x.ndim < 1:
        raise ValueError("x must have a batch dim, got a 0-d tensor")
    out_dtype = x.dtype if x.is_floating_point() else torch.float32
    b = x.shape[0]
    with torch.no_grad():
        x32 = x.detach().to(torch.float32)
        shape = (num_samples, *x.shape)
        if distribution == "rademacher":
            u = torch.randint(0, 2, shape, generator=generator, device=x.device).to(torch.float32) * 2 - 1
        else:
            u = torch.randn(shape, generator=generator, device=x.device, dtype=torch.float32)
        stacked = torch.cat([x32 + c * u, x32 - c * u]).reshape(2 * num_samples * b, *x.shape[1:])
        stacked = stacked.to(out_dtype)
        rows = stacked.shape[0]
        chunk = rows if batch_size is None else max(1, batch_size // b) * b
        parts = []
        for i in range(0, rows, chunk):
            part = stacked[i : i + chunk]
            parts.append(_batch_scores(f(part), part.shape[0], "f").to(torch.float32))
        scores = torch.cat(parts).view(2, num_samples, b)
        coef = (scores[0] - scores[1]) / (2 * c)  # [K, B]
        coef = coef.view(num_samples, b, *([1] * (x.ndim - 1)))
        grad = (coef * u).mean(dim=0)
    return grad.to(out_dtype)


def autograd_gradient(f: RewardFn, x: Tensor) -> Tensor:
    """grad_x sum_b f(x)_b by autograd, per sample (``f`` must score samples independently, so the gradient of
    the sum is each sample's own gradient).

    ``f`` runs on a detached leaf copy of x under ``torch.enable_grad()`` (so it works inside the sampler's
    ``torch.no_grad``); ``torch.autograd.grad`` differentiates w.r.t. that copy only, so no ``.grad`` of any
    module parameter is touched. A reward that does not depend on x gives a zero gradient. Returns a detached
    tensor of x's shape and dtype.
    """
    if x.ndim < 1:
        raise ValueError("x must have a batch dim, got a 0-d tensor")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating tensor to differentiate, got {x.dtype}")
    with torch.enable_grad():
        leaf = x.detach().clone().requires_grad_(True)
        scores = _batch_scores(f(leaf), x.shape[0], "f")
        if not scores.requires_grad:
            return torch.zeros_like(x)
        (grad,) = torch.autograd.grad(scores.sum(), leaf, allow_unused=True)
    if grad is None:
        return torch.zeros_like(x)
    return grad.detach()


# ----------------------------------------------------------------------------- drift distillation


def _flow_sde_coefficients(
    x: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    noise_level: float | Tensor,
    sigma_max_fallback: float | Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(k, dt, 1 + k (1 - sigma)) of ``mmalign.algorithms.sde.flow_sde`` in fp32, validated and computed as it does:
    s_t = a sqrt(sigma / (1 - sigma~)) with sigma~ = ``sigma_max_fallback`` where sigma == 1, k = s_t^2 /
    (2 sigma), dt = sigma_next - sigma."""
    s, sn, std_t = flow_sde_noise(x, sigma, sigma_next, noise_level, sigma_max_fallback)
    k = std_t**2 / (2 * s)
    return k, sn - s, 1 + k * (1 - s)


def flow_sde_velocity_for_mean(
    target_mean: Tensor,
    x: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    noise_level: float | Tensor,
    sigma_max_fallback: float | Tensor | None = None,
) -> Tensor:
    """The velocity v* whose ``mmalign.algorithms.sde.flow_sde`` step mean is ``target_mean`` (the distillation target).

    The flow_sde mean is affine in v::

        mu(v) = x + [v + k (x + (1 - sigma) v)] dt = x + [(1 + k (1 - sigma)) v + k x] dt,
        k = s_t^2 / (2 sigma),  s_t = a sqrt(sigma / (1 - sigma)),  dt = sigma_next - sigma < 0,

    so v* = ((target_mean - x) / dt - k x) / (1 + k (1 - sigma)). At sigma = 1 the s_t denominator uses
    ``sigma_max_fallback`` exactly as flow_sde does (required there). Same argument conventions and checks
    as flow_sde; computed and returned in fp32. For a guided mean mu + shift this equals
    `guided_velocity` ``(v, ..., shift)``.
    """
    t32, x32 = target_mean.to(torch.float32), x.to(torch.float32)
    if t32.shape != x32.shape:
        raise ValueError(f"target_mean has shape {tuple(t32.shape)}, expected x's {tuple(x32.shape)}")
    k, dt, gain = _flow_sde_coefficients(x32, sigma, sigma_next, noise_level, sigma_max_fallback)
    return ((t32 - x32) / dt - k * x32) / gain


def guided_velocity(
    v: Tensor,
    x: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    shift: Tensor,
    *,
    noise_level: float | Tensor,
    sigma_max_fallback: float | Tensor | None = None,
) -> Tensor:
    """v + shift / ((1 + k (1 - sigma)) dt): the velocity whose ``flow_sde`` mean is mu(v) + ``shift``.

    Same coefficients as `flow_sde_velocity_for_mean` (of which it is the incremental form, better
    conditioned when the shift is small). ``shift`` is the guided mean minus the plain mean (what
    ``shift_step_mean`` adds, e.g. s g/||g||). Note the division by dt: a shift of size s changes the velocity
    by about s / |dt|, large on fine steps. fp32.
    """
    v32, x32 = v.to(torch.float32), x.to(torch.float32)
    if v32.shape != x32.shape:
        raise ValueError(f"v has shape {tuple(v32.shape)}, expected x's {tuple(x32.shape)}")
    shift32 = _per_sample(shift, x32, "shift").to(torch.float32)
    _, dt, gain = _flow_sde_coefficients(x32, sigma, sigma_next, noise_level, sigma_max_fallback)
    return v32 + shift32 / (gain * dt)


def drift_distillation_loss(v_pred: Tensor, v_target: Tensor, weight: Tensor | None = None) -> Tensor:
    """Mean squared error between the network's velocity and the guided-drift velocity, a 0-d fp32 tensor.

    Per sample l_b = mean over non-batch dims of (v_pred - sg(v_target))^2 (``v_target`` is detached: the
    target is a constant, only ``v_pred`` is trained). Without ``weight`` the loss is mean_b l_b; with a
    per-sample ``weight`` Float[B] (>= 0, e.g. a 0/1 mask of the trained steps) it is the weighted mean
    sum_b w_b l_b / sum_b w_b (our design), and 0 (still attached to ``v_pred``) when all weights are 0.
    """
    if v_pred.shape != v_target.shape:
        raise ValueError(
            f"v_pred has shape {tuple(v_pred.shape)}, v_target {tuple(v_target.shape)}; they must match"
        )
    if v_pred.ndim < 1:
        raise ValueError("v_pred must have a batch dim, got a 0-d tensor")
    diff = v_pred.to(torch.float32) - v_target.detach().to(torch.float32)
    sq = diff**2
    per = sq.mean(dim=tuple(range(1, sq.ndim))) if sq.ndim > 1 else sq
    if weight is None:
        return per.mean()
    w = torch.as_tensor(weight, device=per.device).to(torch.float32).detach()
    if w.shape != per.shape:
        raise ValueError(f"weight must be Float[{per.shape[0]}] (one per sample), got {tuple(w.shape)}")
    if not bool(torch.all(torch.isfinite(w) & (w >= 0))):
        raise ValueError("weight must be finite and >= 0")
    total = w.sum()
    return (w * per).sum() / total.clamp_min(torch.finfo(torch.float32).tiny)
