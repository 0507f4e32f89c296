"""Denoising steps with log-prob for diffusion / flow-matching RL (Flow-GRPO, CPS, DanceGRPO, DDPO).

Every step (``flow_sde``, ``cps``, ``dance``, ``ddim``; ``step(kind, **kwargs)`` dispatches through ``STEPS``)
is one small function computed in float32 that returns :class:`StepOutput` ``(sample, log_prob, mean, std,
kl_std)``: ``sample`` drawn as ``mean + std * noise``, or given with ``prev_sample=`` to re-score a stored
transition (then the log-prob is reproduced exactly); ``log_prob`` Float[B], averaged over the non-batch
dims; ``kl_std`` the noise scale without the sqrt(|dt|) factor, which the KL on step means divides by.
``shift_mean=fn`` moves the step mean (reward guidance); ``cps`` takes ``log_prob_form`` (``squared_error``
by default, or ``gaussian``). A step whose std is 0 raises ``ValueError``. Formulas, conventions and the
flow-matching notation: docs/algorithms.md, "Denoising steps with log-prob".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mmalign.registry import Registry, option_checked

__all__ = [
    "LOG_PROB_FORMS",
    "MeanShift",
    "STEPS",
    "StepOutput",
    "cps",
    "dance",
    "ddim",
    "flow_sde",
    "flow_sde_noise",
    "get",
    "gaussian_log_prob",
    "names",
    "ratio_norm_score",
    "squared_error_log_prob",
    "step",
]

STEPS: Registry[Any] = Registry("sde step")

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
Scalar = float | torch.Tensor
MeanShift = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``shift_mean(mean, std) -> shifted mean`` (see the module docstring)."""
LOG_PROB_FORMS = ("squared_error", "gaussian")
"""How `cps` scores a transition: Flow-GRPO's ``-mean((x' - mu)^2)`` (default) or the full Gaussian."""


@dataclass
class StepOutput:
    """One denoising transition, all fp32: ``sample`` (x'), ``log_prob`` Float[B], ``mean`` (mu), ``std`` (of
    x' given x) and ``kl_std`` (the noise scale without the sqrt(|dt|) factor, for the KL on step means)."""

    sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    kl_std: torch.Tensor


# ---------------------------------------------------------------------------------------------- helpers


def _latent(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim < 1:
        raise ValueError(f"{name} must have a batch dim, got a 0-d tensor")
    return t.to(torch.float32)


def _coef(value: Scalar, ref: torch.Tensor, name: str) -> torch.Tensor:
    """A scalar or per-batch coefficient as fp32, shaped to broadcast over ``ref``'s non-batch dims."""
    t = torch.as_tensor(value, device=ref.device).to(torch.float32)
    if t.ndim == 0:
        return t
    if t.ndim == 1 and t.shape[0] in (1, ref.shape[0]):
        return t.view(-1, *([1] * (ref.ndim - 1)))
    if t.ndim == ref.ndim and all(s in (1, r) for s, r in zip(t.shape, ref.shape)):
        return t
    raise ValueError(
        f"{name} must be a scalar, a [B] tensor (B={ref.shape[0]}) or broadcastable to {tuple(ref.shape)}, "
        f"got shape {tuple(t.shape)}"
    )


def _check(cond: torch.Tensor, msg: str) -> None:
    if not bool(torch.all(cond)):
        raise ValueError(msg)


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(sample; mean, std^2) averaged over all non-batch dims -> Float[B] (fp32; ``sample`` detached)."""
    sample = sample.detach().to(torch.float32)
    lp = -((sample - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    lp = lp.expand(torch.broadcast_shapes(lp.shape, sample.shape))
    return lp.mean(dim=tuple(range(1, lp.ndim))) if lp.ndim > 1 else lp


def squared_error_log_prob(sample: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Flow-GRPO's CPS score ``-(sample - mean)^2`` averaged over all non-batch dims -> Float[B] (fp32;
    ``sample`` detached): the Gaussian log-density without its 1/(2 std^2) factor and constants."""
    lp = -((sample.detach().to(torch.float32) - mean) ** 2)
    return lp.mean(dim=tuple(range(1, lp.ndim))) if lp.ndim > 1 else lp


def ratio_norm_score(
    sample: torch.Tensor, mean: torch.Tensor, rollout_mean: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
    """GRPO-Guard's normalised score of a stored transition x' (``sample``), Float[B] (fp32):
    ``mean_dims(mean * (x' - mu_old) / std)``, with ``rollout_mean`` mu_old the step mean the rollout drew x'
    around (``sample`` and ``rollout_mean`` detached; the gradient flows through ``mean`` only).

    The difference of two such scores at the same x' and mu_old is GRPO-Guard's RatioNorm log-ratio: for the
    Gaussian log-density, ``(log p_theta - log p_old + mean_dims((mu_theta - mu_old)^2) / (2 std^2)) * std``
    equals ``mean_dims((mu_theta - mu_old) * (x' - mu_old)) / std`` -- the bias term removes the always-negative
    quadratic part of the log-ratio and the factor std puts every denoising step on one scale
    (docs/algorithms.md, "GRPO-Guard")."""
    eps = (sample.detach().to(torch.float32) - rollout_mean.detach().to(torch.float32)) / std.detach()
    score = mean.to(torch.float32) * eps
    return score.mean(dim=tuple(range(1, score.ndim))) if score.ndim > 1 else score


def _finish(
    mean: torch.Tensor,
    std: torch.Tensor,
    *,
    prev_sample: torch.Tensor | None,
    noise: torch.Tensor | None,
    generator: torch.Generator | None,
    kl_std: torch.Tensor | None = None,
    log_prob_form: str = "gaussian",
    shift_mean: MeanShift | None = None,
) -> StepOutput:
    _check(
        std > 0,
        "std must be > 0 for a log-prob (a zero noise level/eta, or a final step to a clean sample, is a "
        "deterministic ODE step with no density)",
    )
    if shift_mean is not None:
        shifted = shift_mean(mean, std)
        if shifted.shape != mean.shape:
            raise ValueError(
                f"shift_mean returned shape {tuple(shifted.shape)}, expected {tuple(mean.shape)}"
            )
        mean = shifted.to(torch.float32)
    if prev_sample is not None:
        if noise is not None:
            raise ValueError("give either prev_sample= (re-score a stored transition) or noise=, not both")
        if prev_sample.shape != mean.shape:
            raise ValueError(
                f"prev_sample has shape {tuple(prev_sample.shape)}, expected {tuple(mean.shape)}"
            )
        sample = prev_sample.to(torch.float32)
    else:
        if noise is not None:
            if generator is not None:
                raise ValueError("give either noise= or generator=, not both")
            if noise.shape != mean.shape:
                raise ValueError(f"noise has shape {tuple(noise.shape)}, expected {tuple(mean.shape)}")
            eps = noise.to(device=mean.device, dtype=torch.float32)
        else:
            eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
        sample = mean + std * eps
    if log_prob_form == "squared_error":
        log_prob = squared_error_log_prob(sample, mean)
    else:
        log_prob = gaussian_log_prob(sample, mean, std)
    return StepOutput(
        sample=sample, log_prob=log_prob, mean=mean, std=std, kl_std=std if kl_std is None else kl_std
    )


def _flow_sigmas(sigma: Scalar, sigma_next: Scalar, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = _coef(sigma, x, "sigma")
    sn = _coef(sigma_next, x, "sigma_next")
    _check((s > 0) & (s <= 1), f"sigma must be in (0, 1], got {sigma}")
    _check(sn >= 0, f"sigma_next must be >= 0, got {sigma_next}")
    _check(
        sn < s,
        f"sigma_next must be < sigma (denoising goes from sigma down to sigma_next), got "
        f"sigma={sigma}, sigma_next={sigma_next}",
    )
    return s, sn


# ------------------------------------------------------------------------------------------------ steps


def flow_sde_noise(
    x: torch.Tensor,
    sigma: Scalar,
    sigma_next: Scalar,
    noise_level: Scalar,
    sigma_max_fallback: Scalar | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sigma, sigma_next, s_t) of `flow_sde` as tensors broadcastable against the fp32 latent `x`, validated:
    s_t = a sqrt(sigma / (1 - sigma~)), a = `noise_level` > 0, sigma~ = `sigma_max_fallback` (in (0, 1)) where
    sigma == 1 (required there). For code that needs the step's coefficients without taking the step."""
    s, sn = _flow_sigmas(sigma, sigma_next, x)
    a = _coef(noise_level, x, "noise_level")
    _check(a > 0, f"noise_level must be > 0, got {noise_level}")
    at_one = s == 1
    if bool(torch.any(at_one)):
        if sigma_max_fallback is None:
            raise ValueError("sigma == 1 needs sigma_max_fallback (sigmas[1]) for the 1 - sigma denominator")
        fb = _coef(sigma_max_fallback, x, "sigma_max_fallback")
        _check((fb > 0) & (fb < 1), f"sigma_max_fallback must be in (0, 1), got {sigma_max_fallback}")
        s_den = torch.where(at_one, fb, s)
    else:
        s_den = s
    return s, sn, a * torch.sqrt(s / (1 - s_den))


@STEPS.register("flow_sde")
def flow_sde(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: Scalar,
    sigma_next: Scalar,
    *,
    noise_level: Scalar,
    sigma_max_fallback: Scalar | None = None,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    shift_mean: MeanShift | None = None,
) -> StepOutput:
    """Flow-GRPO SDE step: mu = x + [v + s_t^2/(2 sigma) (x + (1-sigma) v)] dt, std = s_t sqrt(-dt).

    s_t = a * sqrt(sigma / (1 - sigma)) with a = ``noise_level`` > 0, dt = sigma_next - sigma < 0.
    At sigma = 1 the denominator 1 - sigma is 0: Flow-GRPO then uses sigmas[1] there, i.e.
    s_t = a * sqrt(1 / (1 - sigmas[1])). Pass that value as ``sigma_max_fallback`` (required, in (0, 1),
    whenever some sigma equals 1; ignored otherwise).
    """
    v32, x32 = _latent(v, "v"), _latent(x, "x")
    s, sn, std_t = flow_sde_noise(x32, sigma, sigma_next, noise_level, sigma_max_fallback)
    dt = sn - s
    mean = x32 + (v32 + std_t**2 / (2 * s) * (x32 + (1 - s) * v32)) * dt
    std = std_t * torch.sqrt(-dt)
    return _finish(
        mean,
        std,
        prev_sample=prev_sample,
        noise=noise,
        generator=generator,
        kl_std=std_t,
        shift_mean=shift_mean,
    )


@STEPS.register("cps")
def cps(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: Scalar,
    sigma_next: Scalar,
    *,
    noise_level: Scalar,
    log_prob_form: str = "squared_error",
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    shift_mean: MeanShift | None = None,
) -> StepOutput:
    """Coefficients-preserving step: mu = (1-sigma') x0_hat + sqrt(sigma'^2 - s_t^2) x1_hat, std = s_t.

    s_t = sigma' sin(a pi / 2) with a = ``noise_level`` in (0, 1]; x0_hat = x - sigma v,
    x1_hat = x + (1 - sigma) v. sigma_next must be > 0 (at sigma' = 0 the std is 0).
    ``log_prob_form``: ``"squared_error"`` (default, Flow-GRPO): log p = -mean((x' - mu)^2);
    ``"gaussian"``: the full Gaussian log-density, as the other steps.
    """
    if log_prob_form not in LOG_PROB_FORMS:
        raise ValueError(f"log_prob_form must be one of {', '.join(LOG_PROB_FORMS)}; got {log_prob_form!r}")
    v32, x32 = _latent(v, "v"), _latent(x, "x")
    s, sn = _flow_sigmas(sigma, sigma_next, x32)
    a = _coef(noise_level, x32, "noise_level")
    _check((a > 0) & (a <= 1), f"noise_level must be in (0, 1] for cps, got {noise_level}")
    std_t = sn * torch.sin(a * (math.pi / 2))
    x0 = x32 - s * v32
    x1 = x32 + (1 - s) * v32
    mean = (1 - sn) * x0 + torch.sqrt((sn**2 - std_t**2).clamp_min(0)) * x1
    return _finish(
        mean,
        std_t,
        prev_sample=prev_sample,
        noise=noise,
        generator=generator,
        log_prob_form=log_prob_form,
        shift_mean=shift_mean,
    )


@STEPS.register("dance")
def dance(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: Scalar,
    sigma_next: Scalar,
    *,
    eta: Scalar,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    shift_mean: MeanShift | None = None,
) -> StepOutput:
    """DanceGRPO step: mu = x + dsigma v - 1/2 eta^2 score dsigma, std = eta sqrt(sigma - sigma').

    Sign convention: dsigma = sigma' - sigma < 0 (as in DanceGRPO's ``flux_step``);
    score = -(x - (1 - sigma) x0_hat) / sigma^2 with x0_hat = x - sigma v. ``eta`` > 0.
    """
    v32, x32 = _latent(v, "v"), _latent(x, "x")
    s, sn = _flow_sigmas(sigma, sigma_next, x32)
    e = _coef(eta, x32, "eta")
    _check(e > 0, f"eta must be > 0, got {eta}")
    dsigma = sn - s
    x0 = x32 - s * v32
    score = -(x32 - (1 - s) * x0) / s**2
    mean = x32 + dsigma * v32 - 0.5 * e**2 * score * dsigma
    std = e * torch.sqrt(s - sn)
    return _finish(
        mean,
        std,
        prev_sample=prev_sample,
        noise=noise,
        generator=generator,
        kl_std=e.expand_as(std),
        shift_mean=shift_mean,
    )


@STEPS.register("ddim")
def ddim(
    eps_pred: torch.Tensor,
    x: torch.Tensor,
    alpha_bar_t: Scalar,
    alpha_bar_prev: Scalar,
    *,
    eta: Scalar,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    shift_mean: MeanShift | None = None,
) -> StepOutput:
    """DDPO DDIM step (eps-prediction): mu = sqrt(ab_prev) x0_hat + sqrt(1 - ab_prev - s_t^2) eps, std = s_t.

    x0_hat = (x - sqrt(1 - ab_t) eps) / sqrt(ab_t);
    s_t = eta sqrt((1 - ab_prev) / (1 - ab_t)) sqrt(1 - ab_t / ab_prev).
    Needs 0 < ab_t < ab_prev < 1 (ab_prev = 1, the final step, gives std 0), eta > 0 and
    1 - ab_prev - s_t^2 >= 0 (always true for eta <= 1).
    """
    e32, x32 = _latent(eps_pred, "eps_pred"), _latent(x, "x")
    ab_t = _coef(alpha_bar_t, x32, "alpha_bar_t")
    ab_p = _coef(alpha_bar_prev, x32, "alpha_bar_prev")
    e = _coef(eta, x32, "eta")
    _check((ab_t > 0) & (ab_t < 1), f"alpha_bar_t must be in (0, 1), got {alpha_bar_t}")
    _check(
        (ab_p > ab_t) & (ab_p <= 1),
        f"alpha_bar_prev must be in (alpha_bar_t, 1], got "
        f"alpha_bar_t={alpha_bar_t}, alpha_bar_prev={alpha_bar_prev}",
    )
    _check(e >= 0, f"eta must be >= 0, got {eta}")
    std_t = e * torch.sqrt((1 - ab_p) / (1 - ab_t)) * torch.sqrt(1 - ab_t / ab_p)
    rad = 1 - ab_p - std_t**2
    _check(rad >= -1e-6, f"1 - alpha_bar_prev - std^2 < 0: eta={eta} is too large for this step")
    x0 = (x32 - torch.sqrt(1 - ab_t) * e32) / torch.sqrt(ab_t)
    mean = torch.sqrt(ab_p) * x0 + torch.sqrt(rad.clamp_min(0)) * e32
    return _finish(
        mean, std_t, prev_sample=prev_sample, noise=noise, generator=generator, shift_mean=shift_mean
    )


# ---------------------------------------------------------------------------------------------- handles


def get(kind: str) -> Any:
    """The step function registered under ``kind`` (``RegistryError``, a KeyError, if unknown)."""
    return STEPS.get(kind)


def names() -> list[str]:
    """Registered step kinds."""
    return STEPS.names()


def step(kind: str, *args: Any, **kwargs: Any) -> StepOutput:
    """Run the step ``kind`` (one of ``names()``) -> StepOutput(sample, log_prob, mean, std, kl_std).

    Unknown kinds raise ``RegistryError`` listing the registered ones; unknown options a TypeError.
    """
    fn = STEPS.get(kind)
    return option_checked(STEPS.kind, kind, fn, n_positional=len(args))(*args, **kwargs)
