"""Euphonium: process-reward-guided stochastic sampling and dual-reward GRPO for Wan text to video.

Euphonium (Zhong et al., arXiv:2602.04928) steers each stochastic denoising step with the gradient of a
*process reward* r(x_t), a reward defined on the latents of every step: the step mean becomes

    mu' = mu + s * g / ||g||,    g = grad_x r(x_t)        (`pipelines.video.guidance.guided_mean`)

and the step's log-prob is that of the guided Gaussian N(mu', std^2) (the core's `shift_step_mean` hook: the
shift is stored with the rollout and re-scoring adds it again). ``g`` comes from autograd through a
differentiable latent reward, or, without gradients, from SPSA (`pipelines.video.guidance.spsa_gradient`, c = 0.01).
The scale s is fixed (``options.guidance_strength``) or eta^2 / (2 beta) with eta the step's std
(``options.guidance_beta``). Training uses dual-reward advantages (``algorithm.estimator: grpo_process``: the
outcome advantage per group plus the process advantage per group and step, Float[B, T]); the per-step process
rewards the sampler computed reach the estimator through the ``sampler_process_reward`` reward. A distillation
loss (auxiliary term ``drift_distill``, weighted by ``algorithm.aux_coefs.drift_distill``) regresses the
velocity network on the velocity that produces the guided drift (`pipelines.video.guidance.guided_velocity`), so that
sampling after training needs no reward model: guidance is applied only in the trainer's rollouts, and
``mmalign sample`` / ``mmalign eval`` sample the plain (distilled) policy unless ``options.guide_eval``.

The process rewards here are latent geometry rewards (``options.process_reward``; `PROCESS_REWARDS`), computed
on the step's clean-latent estimate x0_hat = x_t - sigma * v (v the network's velocity at the step, held
fixed, so grad_x r(x0_hat(x)) = grad r at x0_hat) by the latent geometry model ``options.geometry_model``
(`rewards.geometry_model`). (our design): evaluating the reward on x0_hat rather than training a noise-aware
process reward model, and recording r(x0_hat) at every trained step as that step's process reward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from mmalign.config import Config
from mmalign.data.batch import Rollout
from mmalign.policies.base import ActionStats
from mmalign.policies.denoising import StepContext
from mmalign.policies.wan import WanPolicy
from pipelines import TrainingSetup, register_pipeline
from pipelines.common import load_prompts, options
from pipelines.video.wan import WanVideoOptions, build_wan_policy
from rewards import RewardSet

__all__ = ["PROCESS_REWARDS", "EuphoniumOptions", "GuidedWanPolicy", "build", "geometry_process_reward"]

DISTILL_TERM = "drift_distill"
"""Name of the distillation loss among the policy's auxiliary terms (``algorithm.aux_coefs``)."""


def _smoothness(g: Any) -> Tensor:
    from rewards.geometry_model import camera_smoothness

    return camera_smoothness(g.centres, g.angles)


def _reprojection(g: Any) -> Tensor:
    from rewards.geometry_model import reprojection_consistency

    return reprojection_consistency(g.depth, g.centres, g.angles, g.batched_intrinsics, g.dynamic)


PROCESS_REWARDS: dict[str, Callable[[Any], Tensor]] = {
    "camera_smoothness": _smoothness,
    "reprojection_consistency": _reprojection,
    "geometry": lambda g: (_smoothness(g) + _reprojection(g)) / 2,
}
"""Latent process rewards by name: functions of a `rewards.geometry_model.GeometryOutput` -> Float[B], differentiable
in the latents through the geometry model (``geometry`` is the mean of the other two)."""


def geometry_process_reward(name: str, model: torch.nn.Module) -> Callable[[Tensor], Tensor]:
    """r(latents) Float[B] of latents Float[B, C, F, h, w]: `PROCESS_REWARDS` [`name`] of `model`'s geometry."""
    if name not in PROCESS_REWARDS:
        raise ValueError(f"process_reward must be one of {', '.join(PROCESS_REWARDS)}; got {name!r}")
    fn = PROCESS_REWARDS[name]
    param = next(model.parameters(), None)

    def reward(latents: Tensor) -> Tensor:
        x = latents if param is None else latents.to(param.device, param.dtype)
        return fn(model(x)).float().to(latents.device)

    return reward


class GuidedWanPolicy(WanPolicy):
    """`WanPolicy` whose stochastic steps are steered by a process-reward gradient (Euphonium).

    Hooks used (no loop is copied): `shift_step_mean` moves each SDE step's mean by s * g / ||g|| and records the
    step's process reward and the guided-drift velocity; `rollout_outputs` puts them in the rollout
    (``outputs["process_rewards"]`` Float[B, T], ``payload["guided_velocity"]`` Float[B, T, C, F, h, w]);
    `action_stats` adds the distillation loss ``drift_distill`` (MSE between the network's velocity at each trained
    step and the stored guided velocity) to the auxiliary terms. `configure_guidance` must be called once."""

    reward_fn: Callable[[Tensor], Tensor] | None = None

    def configure_guidance(
        self,
        reward_fn: Callable[[Tensor], Tensor],
        *,
        gradient: str = "autograd",
        strength: float | None = 1.0,
        beta: float | None = None,
        spsa_c: float = 0.01,
        spsa_samples: int = 4,
        distill: bool = True,
        guide_eval: bool = False,
    ) -> None:
        """Set the process reward `reward_fn` (latents Float[B, ...] -> Float[B]) and how it guides: ``gradient``
        ``autograd`` or ``spsa``; the scale: a fixed `strength` s, or s = std^2 / (2 `beta`) (exactly one);
        `distill`: return the distillation term; `guide_eval`: also guide outside training rollouts."""
        if gradient not in ("autograd", "spsa"):
            raise ValueError(f"reward_gradient must be autograd or spsa, got {gradient!r}")
        if (strength is None) == (beta is None):
            raise ValueError(
                "give exactly one of guidance_strength (a fixed s) and guidance_beta (s = std^2 / (2 beta)); got "
                f"guidance_strength={strength}, guidance_beta={beta}"
            )
        if distill and self.sde_kind != "flow_sde":
            raise ValueError(
                f"the drift distillation target is derived for sde_kind flow_sde, got {self.sde_kind!r}"
            )
        self.reward_fn = reward_fn
        self.gradient = gradient
        self.strength, self.beta = strength, beta
        self.spsa_c, self.spsa_samples = float(spsa_c), int(spsa_samples)
        self.distill = distill
        self.guiding = guide_eval
        self._records: dict[int, tuple[Tensor, Tensor]] = {}
        self._captured: list[Tensor] | None = None

    # ------------------------------------------------------------------ sampling
    def on_train_step(self, step: int) -> None:
        super().on_train_step(step)
        self.guiding = True  # the trainer's rollouts are guided; sample / eval see the distilled policy

    def _clean_estimate(self, v: Tensor, sigma: Tensor) -> Callable[[Tensor], Tensor]:
        """x -> x0_hat = x - sigma * v for a batch that repeats the step's B samples (SPSA stacks copies)."""

        def x0(x: Tensor) -> Tensor:
            reps = x.shape[0] // v.shape[0]
            vv = v.repeat(reps, *([1] * (v.ndim - 1)))
            ss = sigma.repeat(reps).view(-1, *([1] * (v.ndim - 1)))
            return x - ss * vv

        return x0

    def shift_step_mean(self, mean: Tensor, latents: Tensor, t_index: int, context: StepContext) -> Tensor:
        from pipelines.video import guidance

        if self.reward_fn is None:
            raise RuntimeError("GuidedWanPolicy: call configure_guidance(reward_fn, ...) before sampling")
        sched = context.sched
        v = context.prediction.detach().float()
        x0 = self._clean_estimate(v, sched["sigmas"].float())
        reward_fn = self.reward_fn

        def f(x: Tensor) -> Tensor:
            return reward_fn(x0(x))

        x = latents.detach().float()
        with torch.no_grad():
            r_now = f(x)
        if not self.guiding:
            shift = torch.zeros_like(mean)
        else:
            if self.gradient == "autograd":
                g = guidance.autograd_gradient(f, x)
            else:
                gen = self.generator if x.device.type == "cpu" else None
                g = guidance.spsa_gradient(f, x, c=self.spsa_c, num_samples=self.spsa_samples, generator=gen)
            s = guidance.guidance_scale(context.std, scale=self.strength, beta=self.beta)
            shift = guidance.guided_mean(mean, g, s) - mean
        target = guidance.guided_velocity(
            v,
            x,
            sched["sigmas"],
            sched["sigmas_next"],
            shift,
            noise_level=self.noise_level,
            sigma_max_fallback=sched["sigma_max_fallback"],
        )
        self._records[t_index] = (r_now.detach().cpu(), target.detach().cpu())
        return mean + shift

    def rollout(self, rows: list[dict[str, Any]], group_size: int, *, compute_logp: bool = True) -> Rollout:
        self._records = {}
        try:
            return super().rollout(rows, group_size, compute_logp=compute_logp)
        finally:
            self._records = {}

    def rollout_outputs(self, rollout: Rollout) -> None:
        super().rollout_outputs(rollout)
        steps = rollout.payload["step_index"]  # Long[B, T]: the denoising step of each trained action
        b, t = steps.shape
        rewards = torch.full((b, t), float("nan"))
        velocity = torch.zeros_like(rollout.payload["latents"])
        rows = torch.arange(b)
        for j in range(t):
            for i in steps[:, j].unique().tolist():
                if i in self._records:
                    sel = rows[steps[:, j] == i]
                    r, v = self._records[i]
                    rewards[sel, j] = r[sel]
                    velocity[sel, j] = v[sel]
        rollout.outputs["process_rewards"] = rewards
        rollout.payload["guided_velocity"] = velocity

    def rollout_stats(self, rollout: Rollout) -> dict[str, Tensor]:
        stats = super().rollout_stats(rollout)
        pr = rollout.outputs.get("process_rewards")
        if pr is not None:
            stats["process_reward_first_step"] = pr[:, 0]
            stats["process_reward_last_step"] = pr[:, -1]
        shift = rollout.payload.get("mean_shift")
        if shift is not None:
            stats["guidance_shift_norm"] = shift.flatten(2).norm(dim=2).mean(dim=1)
        return stats

    # ------------------------------------------------------------------ training
    def step(self, prediction: Tensor, latents: Tensor, sched: dict[str, Tensor], **kw: Any) -> Any:
        if self._captured is not None and prediction.requires_grad:
            self._captured.append(prediction)  # the trained network's velocity at a re-scored step
        return super().step(prediction, latents, sched, **kw)

    def action_stats(self, rollout: Rollout, *, actions: Tensor | None = None) -> ActionStats:
        """The log-probs (and KL) of `WanPolicy.action_stats` for the trained-step columns `actions` (one chunk
        of `action_chunks`; None: all), plus ``drift_distill`` when distilling: the chunk's term is its
        steps' mean squared error times its share of the steps, so the chunks' terms add up to the whole
        microbatch's."""
        if not self.distill:
            return super().action_stats(rollout, actions=actions)
        from pipelines.video.guidance import drift_distillation_loss

        cols = torch.arange(rollout.num_actions) if actions is None else actions.to("cpu", torch.long)
        self._captured = []
        try:
            stats = super().action_stats(rollout, actions=actions)
            captured = self._captured
        finally:
            self._captured = None
        if len(captured) != len(cols):
            raise RuntimeError(f"expected {len(cols)} re-scored steps, captured {len(captured)}")
        pred = torch.stack(captured, dim=1)
        target = rollout.payload["guided_velocity"][:, cols].to(pred.device)
        share = len(cols) / rollout.num_actions
        stats.aux_losses[DISTILL_TERM] = drift_distillation_loss(pred, target) * share
        return stats


@dataclass
class EuphoniumOptions(WanVideoOptions):
    """The ``options:`` section: the sampler and video settings (`pipelines.video.wan.WanVideoOptions`) plus the
    process-reward guidance."""

    geometry_model: str = ""
    """The latent geometry model the process reward is computed with (a folder or ``package.module:Class``,
    `rewards.geometry_model.load_geometry_model`)."""
    process_reward: Literal["camera_smoothness", "reprojection_consistency", "geometry"] = "geometry"
    """Which latent process reward guides the steps (`PROCESS_REWARDS`)."""
    reward_gradient: Literal["autograd", "spsa"] = "autograd"
    """How grad r is obtained: autograd through the geometry model, or SPSA without gradients."""
    guidance_strength: float | None = 1.0
    """A fixed guidance scale s: the L2 norm of each step's mean shift (set null to use ``guidance_beta``)."""
    guidance_beta: float | None = None
    """s = std^2 / (2 beta) per step instead of a fixed s (``guidance_strength: null``)."""
    spsa_c: float = 0.01
    """SPSA perturbation size c."""
    spsa_samples: int = 4
    """SPSA perturbations per estimate (each costs two reward evaluations)."""
    distill: bool = True
    """Return the ``drift_distill`` auxiliary loss (give it a weight in ``algorithm.aux_coefs``)."""
    guide_eval: bool = False
    """Also guide the samples of ``mmalign sample`` / ``mmalign eval`` (default: the plain, distilled policy)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sde_kind != "flow_sde":
            raise ValueError(f"euphonium guides the flow_sde step; got sde_kind {self.sde_kind!r}")
        if self.spsa_c <= 0 or self.spsa_samples < 1:
            raise ValueError(
                f"spsa_c must be > 0 and spsa_samples >= 1, got {self.spsa_c}, {self.spsa_samples}"
            )


@register_pipeline("euphonium", options=EuphoniumOptions)
def build(cfg: Config) -> Any:
    """Euphonium: a Wan text-to-video policy with process-reward-guided SDE steps and dual-reward GRPO."""
    from rewards.geometry_model import load_geometry_model

    opts = options(cfg, EuphoniumOptions)
    if not opts.geometry_model:
        raise ValueError(f"{cfg.source}: options.geometry_model is required (the latent geometry model)")
    rows = load_prompts(cfg.data.train, cfg.data.prompt_template, cfg.data.max_rows)
    eval_rows = load_prompts(cfg.data.eval, cfg.data.prompt_template) if cfg.data.eval else None
    policy = build_wan_policy(cfg, opts, policy_class=GuidedWanPolicy)
    try:
        model = load_geometry_model(opts.geometry_model).eval().requires_grad_(False)
    except (FileNotFoundError, ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{cfg.source}: options.geometry_model: {e}") from e
    model.to(policy.device)
    policy.configure_guidance(
        geometry_process_reward(opts.process_reward, model),
        gradient=opts.reward_gradient,
        strength=opts.guidance_strength,
        beta=opts.guidance_beta,
        spsa_c=opts.spsa_c,
        spsa_samples=opts.spsa_samples,
        distill=opts.distill,
        guide_eval=opts.guide_eval,
    )
    rewards = RewardSet(cfg.rewards, source=cfg.source)
    return TrainingSetup(policy=policy, rewards=rewards, data=rows, eval_data=eval_rows)
