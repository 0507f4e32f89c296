"""Training a flow-matching policy as Flow-GRPO does: a backward after each trained step (``steps_per_backward``)
with the one-backward gradient, the unconditional CFG branch detached (``detach_uncond``) as in Flow-GRPO's
training script, activations that do not grow with the number of trained steps, and GRPO-Guard
(``guard_ratio_norm``, ``guard_grad_reweight``) equal to verl-omni's ``GRPOGuardLoss`` on the same inputs.

The references are written here from the reference code's formulas: Flow-GRPO's ``sde_step_with_logprob``
(yifan123/flow_grpo, flow_grpo/diffusers_patch/sd3_sde_with_logprob.py) for the step mean and log-prob, and
verl-omni's ``GRPOGuardLoss.compute_loss`` (verl-project/verl-omni, verl_omni/trainer/diffusion/diffusion_algos.py)
for GRPO-Guard; the network is called directly (the transformer, not the policy's `predict`)."""

from __future__ import annotations

import math
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from mmalign.config import config_from_dict
from mmalign.data.batch import Rollout
from mmalign.policies.sd3 import SD3Policy
from mmalign.tiny.sd3 import build_tiny_sd3
from mmalign.training.trainer import GroupTrainer
from pipelines import TrainingSetup
from rewards import RewardSet

ROWS = [{"prompt": "a red cat"}, {"prompt": "a blue dog"}]


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_sd3(tmp_path_factory.mktemp("flow_training") / "sd3")


def make(sd3_dir: Path, **kw: Any) -> SD3Policy:
    kw.setdefault("num_steps", 4)
    kw.setdefault("seed", 0)
    return SD3Policy.from_pretrained(sd3_dir, **kw)


def with_advantages(r: Rollout, seed: int = 3) -> Rollout:
    r.advantages = torch.randn(len(r), generator=torch.Generator().manual_seed(seed))
    return r


def trainer_for(pol: SD3Policy, tmp_path: Path, **algorithm: Any) -> GroupTrainer:
    cfg = config_from_dict(
        {
            "pipeline": "flow_training_test",
            "output_dir": str(tmp_path / f"run{len(list(tmp_path.iterdir()))}"),
            "rewards": [{"name": "jpeg_compressibility"}],
            "rollout": {"group_size": 2, "prompts_per_step": 2},
            "algorithm": algorithm,
            "trainer": {"steps": 1, "lr": 1e-4, "progress_bar": False},
        }
    )
    return GroupTrainer(cfg, TrainingSetup(policy=pol, rewards=RewardSet(cfg.rewards), data=ROWS))


def update_gradient(pol: SD3Policy, r: Rollout, tmp_path: Path, **algorithm: Any) -> tuple[dict, dict]:
    """({name: gradient} the trainer's update accumulates for `r`, captured at the optimizer step; metrics)."""
    trainer = trainer_for(pol, tmp_path, **algorithm)
    seen: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def capture(*args: Any, **kw: Any) -> Any:
        for n, p in pol.model.named_parameters():
            if p.grad is not None:
                seen[n] = p.grad.detach().clone()
        return step(*args, **kw)

    trainer.optimizer.step = capture
    metrics = trainer.update(r)
    return seen, metrics


def assert_same_gradients(a: dict, b: dict, rtol: float = 1e-4) -> None:
    assert a.keys() == b.keys() and a
    scale = max(float(g.abs().max()) for g in a.values())
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=rtol * scale, rtol=rtol, msg=n)


# ----------------------------------------------------------------------------- per-step backward


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_a_backward_per_step_gives_the_one_backward_gradient(sd3_dir: Path, tmp_path: Path, agg: str) -> None:
    """CFG, the KL on step means and 4 trained steps: chunks of 1 and 3 steps give the gradient and loss of one
    backward over all steps."""
    base = make(sd3_dir, guidance_scale=3.0, need_reference=True)
    r = with_advantages(base.rollout(ROWS, 2, compute_logp=True))
    r.mask[1, 2:] = False  # a row with fewer valid actions (as the trainer's loss-sample mask may leave)
    algorithm = {"loss_agg": agg, "kl_coef": 0.5}
    results = {}
    for k in (None, 1, 3):
        pol = make(sd3_dir, guidance_scale=3.0, need_reference=True, steps_per_backward=k)
        with torch.no_grad():  # move away from the rollout's weights: ratios != 1, KL != 0
            for p, q in zip(pol.model.parameters(), base.model.parameters(), strict=True):
                p.copy_(q + 0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        chunks = pol.action_chunks(r)
        assert (chunks is None) == (k is None) and (k is None or len(chunks) == math.ceil(4 / k))
        results[k] = update_gradient(pol, r, tmp_path, **algorithm)
    (whole, m), (one, m1), (three, m3) = results[None], results[1], results[3]
    assert m["kl"] > 0
    for grads, metrics in ((one, m1), (three, m3)):
        assert_same_gradients(grads, whole)
        for key in ("loss", "kl", "clip_frac", "approx_kl"):
            assert metrics[key] == pytest.approx(m[key], rel=1e-4, abs=1e-7), key


class SavedBytes:
    """saved_tensors_hooks that track the bytes of activations alive for backward (parameters excluded) and
    their peak."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def _free(self, n: int) -> None:
        self.now -= n

    def pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, torch.nn.Parameter):
            return t
        n = t.numel() * t.element_size()
        self.now += n
        self.peak = max(self.peak, self.now)
        box = [t]
        holder = _Holder(box)
        weakref.finalize(holder, self._free, n)
        return holder

    def unpack(self, x: Any) -> torch.Tensor:
        return x.box[0] if isinstance(x, _Holder) else x


class _Holder:
    def __init__(self, box: list) -> None:
        self.box = box


def peak_saved(sd3_dir: Path, tmp_path: Path, **kw: Any) -> int:
    pol = make(sd3_dir, guidance_scale=3.0, **kw)
    r = with_advantages(pol.rollout(ROWS, 2, compute_logp=True))
    trainer = trainer_for(pol, tmp_path)
    meter = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        trainer.update(r)
    assert meter.now == 0  # every graph was freed
    return meter.peak


def test_activations_kept_for_backward_do_not_grow_with_the_trained_steps(
    sd3_dir: Path, tmp_path: Path
) -> None:
    per_step_4 = peak_saved(sd3_dir, tmp_path, num_steps=4)
    per_step_2 = peak_saved(sd3_dir, tmp_path, num_steps=2)
    one_backward_4 = peak_saved(sd3_dir, tmp_path, num_steps=4, steps_per_backward=None)
    both_branches = peak_saved(sd3_dir, tmp_path, num_steps=4, detach_uncond=False)
    assert per_step_4 <= 1.05 * per_step_2  # one step's graph, however many steps are trained
    assert one_backward_4 >= 3.5 * per_step_4  # all four steps' graphs at once
    assert per_step_4 <= 0.6 * both_branches  # the detached unconditional branch keeps no graph


# ----------------------------------------------------------------------------- detached unconditional branch


def flow_grpo_step(x, x_next, v, sigma, sigma_next, sigma_max, noise_level):
    """Flow-GRPO's ``sde_step_with_logprob``: (step mean, log-prob averaged over the latent dims, std_dev_t,
    sqrt(-dt)), per sample."""
    sh = (-1, *([1] * (x.ndim - 1)))
    sigma, sigma_next = sigma.view(sh), sigma_next.view(sh)
    dt = sigma_next - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, torch.full_like(sigma, sigma_max), sigma)))
    std_dev_t = std_dev_t * noise_level
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_dev_t * torch.sqrt(-dt)
    lp = -((x_next.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    return mean, lp.mean(dim=tuple(range(1, lp.ndim))), std_dev_t.flatten(), torch.sqrt(-dt).flatten()


def reference_velocity(pol: SD3Policy, r: Rollout, j: int, *, detach_uncond: bool, w: float) -> torch.Tensor:
    """Flow-GRPO's training CFG: one batched transformer call on [negative; prompt], v = u + w (c - u), with
    ``noise_pred_uncond.detach()`` when `detach_uncond`."""
    p = r.payload
    x = p["latents"][:, j]
    neg = pol.encode_conditioning([""])
    b = x.shape[0]
    pe = torch.cat([neg["prompt_embeds"].expand(b, -1, -1), p["prompt_embeds"]])
    po = torch.cat([neg["pooled_embeds"].expand(b, -1), p["pooled_embeds"]])
    t = p["sigmas"][:, j] * 1000
    out = pol.model(
        hidden_states=torch.cat([x, x]),
        encoder_hidden_states=pe,
        pooled_projections=po,
        timestep=torch.cat([t, t]),
        return_dict=False,
    )[0]
    u, c = out.chunk(2)
    if detach_uncond:
        u = u.detach()
    return u + w * (c - u)


@pytest.mark.parametrize("detach", [True, False])
def test_training_cfg_gradient_is_flow_grpos(sd3_dir: Path, detach: bool) -> None:
    pol = make(sd3_dir, guidance_scale=4.5, detach_uncond=detach)
    r = pol.rollout(ROWS, 2, compute_logp=True)
    pol.action_stats(r).logp.sum().backward()
    ours = {n: p.grad.clone() for n, p in pol.model.named_parameters()}
    pol.model.zero_grad(set_to_none=True)
    p = r.payload
    sigma_max = float(pol.full_sigmas()[1])
    total = 0.0
    for j in range(r.num_actions):
        v = reference_velocity(pol, r, j, detach_uncond=detach, w=4.5)
        _, lp, _, _ = flow_grpo_step(
            p["latents"][:, j],
            p["next_latents"][:, j],
            v,
            p["sigmas"][:, j],
            p["sigmas_next"][:, j],
            sigma_max,
            0.7,
        )
        total = total + lp.sum()
    total.backward()
    reference = {n: p.grad.clone() for n, p in pol.model.named_parameters()}
    assert_same_gradients(ours, reference)
    if detach:  # and the detached gradient is not the full one
        full = make(sd3_dir, guidance_scale=4.5, detach_uncond=False)
        full.action_stats(r).logp.sum().backward()
        diff = max(float((q.grad - reference[n]).abs().max()) for n, q in full.model.named_parameters())
        assert diff > 1e-3 * max(float(g.abs().max()) for g in reference.values())


# ----------------------------------------------------------------------------- GRPO-Guard


def verl_omni_guard_loss(old_lp, lp, adv, old_mean, mean, std_dev_t, sqrt_dt, clip):
    """verl-omni's ``GRPOGuardLoss.compute_loss`` for one denoising step (no advantage clipping: adv_clip_max
    is larger than every advantage here)."""
    sigma_t = std_dev_t.mean()
    sqrt_dt_mean = sqrt_dt.mean()
    scale = sqrt_dt_mean * sigma_t
    mean_diff_sq = (mean - old_mean).pow(2)
    mean_diff_sq = mean_diff_sq.mean(dim=tuple(range(1, mean_diff_sq.ndim)))
    ratio_mean_bias = mean_diff_sq / (2 * scale**2)
    ratio = torch.exp((lp - old_lp + ratio_mean_bias) * scale)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    return torch.mean(torch.maximum(unclipped, clipped)) / (sqrt_dt_mean**2), ratio


def test_grpo_guard_equals_verl_omnis_loss_and_gradient(sd3_dir: Path, tmp_path: Path) -> None:
    """Both GRPO-Guard options on: the trainer's loss (ppo_clip, token_mean) and gradient are verl-omni's
    GRPO-Guard loss averaged over the trained steps (as Flow-GRPO's per-step accumulation averages them)."""
    guard = {"guard_ratio_norm": True, "guard_grad_reweight": True}
    old = make(sd3_dir, **guard)
    r = with_advantages(old.rollout(ROWS, 2, compute_logp=True))
    assert "step_mean" in r.payload
    stats = old.action_stats(r)  # unchanged weights: ratio 1, and the weights are 1 / (sigma - sigma')
    torch.testing.assert_close(stats.logp.detach(), r.logp_old, atol=1e-6, rtol=0)
    dsig = r.payload["sigmas"] - r.payload["sigmas_next"]
    torch.testing.assert_close(stats.loss_weights, 1 / dsig)

    pol = make(sd3_dir, **guard)
    with torch.no_grad():
        for q in pol.model.parameters():
            q.add_(0.05 * torch.randn(q.shape, generator=torch.Generator().manual_seed(q.numel())))
    p, sigma_max = r.payload, float(old.full_sigmas()[1])

    def step_terms(policy: SD3Policy, j: int, grad: bool):
        with torch.set_grad_enabled(grad):
            x = p["latents"][:, j]
            v = policy.model(
                hidden_states=x,
                encoder_hidden_states=p["prompt_embeds"],
                pooled_projections=p["pooled_embeds"],
                timestep=p["sigmas"][:, j] * 1000,
                return_dict=False,
            )[0]
            return flow_grpo_step(
                x, p["next_latents"][:, j], v, p["sigmas"][:, j], p["sigmas_next"][:, j], sigma_max, 0.7
            )

    # first pass: the reference ratios, to pick a clip range that some of them cross
    ratios = []
    for j in range(r.num_actions):
        old_mean, old_lp, _, _ = step_terms(old, j, False)
        mean, lp, std_dev_t, sqrt_dt = step_terms(pol, j, False)
        ratios.append(
            verl_omni_guard_loss(old_lp, lp, r.advantages, old_mean, mean, std_dev_t, sqrt_dt, 1.0)[1]
        )
    clip = 0.5 * float((torch.cat(ratios) - 1).abs().median())
    assert clip > 1e-6
    total = 0.0
    for j in range(r.num_actions):
        old_mean, old_lp, _, _ = step_terms(old, j, False)
        mean, lp, std_dev_t, sqrt_dt = step_terms(pol, j, True)
        total = (
            total
            + verl_omni_guard_loss(old_lp, lp, r.advantages, old_mean, mean, std_dev_t, sqrt_dt, clip)[0]
        )
    reference_loss = total / r.num_actions
    reference_loss.backward()
    reference = {n: q.grad.clone() for n, q in pol.model.named_parameters()}
    pol.model.zero_grad(set_to_none=True)

    grads, metrics = update_gradient(
        pol, r, tmp_path, loss_agg="token_mean", loss_kwargs={"eps_low": clip, "eps_high": clip}
    )
    assert 0.05 < metrics["clip_frac"] < 0.95  # the clip is active on some steps, not on all
    assert metrics["loss"] == pytest.approx(float(reference_loss.detach()), rel=1e-4, abs=1e-7)
    assert_same_gradients(grads, reference, rtol=1e-3)
