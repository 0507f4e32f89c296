"""The policy side of the forward-process objectives (`mmalign.policies.forward_process`) on the tiny SD3 policy:
clean-latent rollouts with every solver, the predictions on x_t = (1 - t) x0 + t eps, the old policy, and a short
DiffusionNFT / AWM run whose reward rises."""

from __future__ import annotations

import pytest
import torch

from mmalign.algorithms import flow_objectives as fo
from mmalign.config import LoraConfig
from mmalign.policies import forward_process as fp
from mmalign.policies.sd3 import SD3Policy
from mmalign.tiny.sd3 import build_tiny_sd3

ROWS = [{"prompt": "a red cat", "label": 1}, {"prompt": "a blue dog", "label": 2}]
LORA = LoraConfig(enabled=True, r=4, alpha=8)


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3_fp") / "sd3")


def make(pipe_dir, **kw) -> SD3Policy:
    kw.setdefault("num_steps", 4)
    kw.setdefault("seed", 0)
    return SD3Policy.from_pretrained(pipe_dir, **kw)


def _perturb(pol, scale=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def _start(pol, rows, group_size):
    """The conditioning and initial latents a rollout of `pol` starts from (its seeded generator)."""
    prompts = [r["prompt"] for r in rows for _ in range(group_size)]
    group = torch.arange(len(rows)).repeat_interleave(group_size)
    cond = pol.conditioning(prompts)
    return prompts, cond, pol.initial_latents(group, cond, {})


def _velocity(pol, x, sigma, cond, model=None):
    sched = {"sigmas": torch.full((x.shape[0],), float(sigma))}
    return pol.predict(pol.model if model is None else model, x, sched, cond, guided=True)[0]


# ----------------------------------------------------------------------------- sampling


def test_sample_clean_euler_is_the_flow_ode(pipe_dir):
    """``euler``: x <- x + v (sigma' - sigma) over the policy's sigmas from its seeded initial noise; the rollout
    keeps the clean latents and the conditioning only, with one action per training sigma."""
    r = fp.sample_clean(make(pipe_dir), ROWS, 2, num_actions=3, solver="euler")
    pol = make(pipe_dir)
    _, cond, x = _start(pol, ROWS, 2)
    sig = pol.sigmas()
    with torch.no_grad():
        for i in range(pol.num_steps):
            x = x + _velocity(pol, x, sig[i], cond) * (sig[i + 1] - sig[i])
    torch.testing.assert_close(r.payload[fp.CLEAN_KEY], x, rtol=1e-5, atol=1e-5)
    assert r.outputs["latents"] is r.payload[fp.CLEAN_KEY]
    assert set(r.payload) == {"prompt_embeds", "pooled_embeds", fp.CLEAN_KEY}
    assert r.mask.shape == (4, 3) and r.mask.all() and r.logp_old is None
    assert r.columns["label"] == [1, 1, 2, 2] and r.prompts[2] == "a blue dog"
    assert r[1:3].payload[fp.CLEAN_KEY].shape == (2, *pol.latent_shape())


def _dpm2_reference(x, x0_of, sigmas):
    """NVlabs/DiffusionNFT's run_sampling with solver dpm2 (deterministic), written from its solver.py:
    step 0 and the last step DDIM (eta 0), the others multistep_dpm_solver_second_order_update."""
    s = sigmas.to(torch.float64)
    outs = []
    n = len(s) - 1
    for i in range(n):
        x0 = x0_of(x, float(s[i]))
        outs.append(x0)
        if i == 0 or i == n - 1:
            t_, s_ = s[i + 1], s[i]
            eps = (x - (1 - s_) * x0) / s_
            x = ((1 - t_) * x0 + t_ * eps).float()
            continue
        st, s0, s1 = s[i + 1], s[i], s[i - 1]
        lt, l0, l1 = (torch.log(1 - q) - torch.log(q) for q in (st, s0, s1))
        h, h0 = lt - l0, l0 - l1
        d0, d1 = outs[-1], (1.0 / (h0 / h)) * (outs[-1] - outs[-2])
        x = (
            (st / s0) * x
            - (1 - st) * (torch.exp(-h) - 1.0) * d0
            - 0.5 * (1 - st) * (torch.exp(-h) - 1.0) * d1
        ).float()
    return x


def test_dpm2_matches_the_authors_solver_and_is_exact_for_a_point_mass():
    sig = torch.tensor([1.0, 0.9, 0.7, 0.45, 0.2, 0.0])
    x_star = torch.tensor([[0.5, -1.0, 2.0]])
    g = torch.Generator().manual_seed(0)
    start = torch.randn(1, 3, generator=g)

    def run(x0_of):
        x, x0_prev, s_prev = start.clone(), None, None
        for i in range(len(sig) - 1):
            x0 = x0_of(x, float(sig[i]))
            x = fp.dpm2_update(x, x0, x0_prev, s_prev, float(sig[i]), float(sig[i + 1]))
            x0_prev, s_prev = x0, float(sig[i])
        return x

    # a point mass at x*: the x0 prediction is exact at every step, so the solver lands on x*
    torch.testing.assert_close(run(lambda x, s: x_star.expand_as(x)), x_star, rtol=0, atol=1e-6)
    # a curved field: the same numbers as the authors' loop
    field = lambda x, s: torch.tanh(x) * (1 + s) + s * s  # noqa: E731
    torch.testing.assert_close(run(field), _dpm2_reference(start.clone(), field, sig), rtol=1e-6, atol=1e-6)


def test_sample_clean_dpm2_on_the_policy(pipe_dir):
    r = fp.sample_clean(make(pipe_dir), ROWS, 2, num_actions=2, solver="dpm2")
    pol = make(pipe_dir)
    _, cond, x = _start(pol, ROWS, 2)
    with torch.no_grad():
        ref = _dpm2_reference(x, lambda z, s: z - s * _velocity(pol, z, s, cond), pol.sigmas())
    torch.testing.assert_close(r.payload[fp.CLEAN_KEY], ref, rtol=1e-5, atol=1e-5)


def test_sample_clean_sde_is_the_policy_rollout(pipe_dir):
    r = fp.sample_clean(make(pipe_dir, sde_kind="cps", noise_level=0.5), ROWS, 2, num_actions=2, solver="sde")
    full = make(pipe_dir, sde_kind="cps", noise_level=0.5).rollout(ROWS, 2, compute_logp=False)
    assert torch.equal(r.payload[fp.CLEAN_KEY], full.outputs["latents"])
    assert "latents" not in r.payload and "next_latents" not in r.payload and r.mask.shape == (4, 2)
    with pytest.raises(ValueError, match="solver must be one of euler, dpm2, sde"):
        fp.sample_clean(make(pipe_dir), ROWS, 2, num_actions=2, solver="heun")


# ----------------------------------------------------------------------------- predictions


def test_flow_predictions_shapes_values_and_gradients(pipe_dir):
    pol = make(pipe_dir, lora=LORA, need_reference=True)
    r = fp.sample_clean(pol, ROWS, 2, num_actions=3)
    _perturb(pol)  # LoRA away from 0: the current, reference and (copied before) old policies differ
    old = fp.OldPolicy(pol)
    with torch.no_grad():
        held = [p.clone() for p in pol.trainable_parameters()]
        for p in pol.trainable_parameters():
            p.mul_(0.5)
        old.ensure()  # the old policy: LoRA weights halved
        for p, h in zip(pol.trainable_parameters(), held, strict=True):
            p.copy_(h)
    p = fp.flow_predictions(pol, r, old=old, reference=True, generator=torch.Generator().manual_seed(3))
    shape = (4, 3, *pol.latent_shape())
    assert p.v.shape == p.v_old.shape == p.v_ref.shape == p.noise.shape == p.x0.shape == shape
    assert p.t.shape == p.index.shape == p.mask.shape == (4, 3)
    # schedule_subset (DiffusionNFT): distinct steps per sample, t = the step's sigma
    sig = pol.schedule()["sigmas"]
    assert all(len(set(row.tolist())) == 3 for row in p.index)
    torch.testing.assert_close(p.t, sig[p.index])
    torch.testing.assert_close(p.x0[:, 1], r.payload[fp.CLEAN_KEY])
    # each velocity is the network at x_t = (1 - t) x0 + t eps, recomputed here sample by sample
    cond = {k: r.payload[k] for k in pol.conditioning_keys}
    for b, k in [(0, 0), (3, 2)]:
        c = {key: v[b : b + 1] for key, v in cond.items()}
        t = float(p.t[b, k])
        xt = (1 - t) * r.payload[fp.CLEAN_KEY][b : b + 1] + t * p.noise[b, k][None]
        with torch.no_grad():
            torch.testing.assert_close(p.v[b, k][None], _velocity(pol, xt, t, c), rtol=1e-4, atol=1e-5)
            pol.model.disable_adapters()
            torch.testing.assert_close(p.v_ref[b, k][None], _velocity(pol, xt, t, c), rtol=1e-4, atol=1e-5)
            pol.model.enable_adapters()
            with old.applied():
                torch.testing.assert_close(
                    p.v_old[b, k][None], _velocity(pol, xt, t, c), rtol=1e-4, atol=1e-5
                )
    assert (
        float((p.v.detach() - p.v_ref).abs().max()) > 1e-4
        and float((p.v.detach() - p.v_old).abs().max()) > 1e-4
    )
    assert not p.v_old.requires_grad and not p.v_ref.requires_grad and p.v.requires_grad
    # the objective's gradient reaches the LoRA weights, and only them
    loss = p.objective("diffusion_nft", torch.tensor([1.0, -1.0, 0.5, 2.0])).per_action.mean()
    loss.backward()
    grads = {n: q.grad for n, q in pol.model.named_parameters() if q.grad is not None}
    assert grads and all("lora" in n for n in grads) and any(float(g.abs().max()) > 0 for g in grads.values())
    # the current weights are back after the old policy ran
    for q, h in zip(pol.trainable_parameters(), held, strict=True):
        assert torch.equal(q.detach(), h)


def test_flow_predictions_are_seeded_and_on_policy_without_old(pipe_dir):
    pol = make(pipe_dir)
    r = fp.sample_clean(pol, ROWS, 2, num_actions=2)
    a = fp.flow_predictions(
        pol, r, timesteps=fo.timestep_defaults("awm"), generator=torch.Generator().manual_seed(5)
    )
    b = fp.flow_predictions(
        pol, r, timesteps=fo.timestep_defaults("awm"), generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(a.t, b.t) and torch.equal(a.noise, b.noise) and torch.equal(a.v, b.v)
    assert torch.equal(a.v_old, a.v.detach()) and a.v_ref is None
    # AWM's Flow-Factory default: one stratified set of steps shared by the batch
    assert (a.index == a.index[:1]).all()
    # the AWM objective at v_old = sg(v): ratio 1, loss -A
    adv = torch.tensor([1.0, -2.0, 0.5, 0.0])
    out = a.objective("awm", adv)
    torch.testing.assert_close(out.ratio.detach(), torch.ones(4, 2))
    torch.testing.assert_close(out.per_action.detach(), -adv[:, None].expand(4, 2))
    with pytest.raises(KeyError, match="sample_clean"):
        fp.flow_predictions(pol, pol.rollout(ROWS, 2))


def test_chunks_of_one_draw_give_the_full_predictions(pipe_dir):
    """Scoring the sigmas in chunks (one backward each) with one `draw_forward` gives the same velocities and the
    same accumulated gradient as one call over all of them."""
    pol = make(pipe_dir, lora=LORA)
    _perturb(pol, seed=4)
    r = fp.sample_clean(pol, ROWS, 2, num_actions=3)
    draw = fp.draw_forward(pol, r, generator=torch.Generator().manual_seed(9))
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    full = fp.flow_predictions(pol, r, draw=draw)
    full.objective("diffusion_nft", adv).per_action.sum().backward()
    g_full = [q.grad.clone() for q in pol.trainable_parameters()]
    pol.model.zero_grad()
    for cols in (torch.tensor([0, 2]), torch.tensor([1])):
        part = fp.flow_predictions(pol, r, draw=draw, actions=cols)
        torch.testing.assert_close(part.v.detach(), full.v.detach()[:, cols], rtol=1e-5, atol=1e-6)
        assert torch.equal(part.t, full.t[:, cols]) and part.mask.shape == (4, len(cols))
        part.objective("diffusion_nft", adv).per_action.sum().backward()
    for q, g in zip(pol.trainable_parameters(), g_full, strict=True):
        torch.testing.assert_close(q.grad, g, rtol=1e-4, atol=1e-7)


def test_continuous_sigmas_and_schedule_at(pipe_dir):
    pol = make(pipe_dir)
    r = fp.sample_clean(pol, ROWS, 2, num_actions=3)
    p = fp.flow_predictions(
        pol, r, timesteps={"strategy": "logit_normal", "timestep_range": 0.9}, generator=torch.Generator()
    )
    assert p.index is None and ((p.t >= 0.1 - 1e-6) & (p.t <= 1.0)).all()
    sig = pol.schedule()["sigmas"]
    sched = fp.schedule_at(pol, torch.tensor([0.99, 0.5]))
    torch.testing.assert_close(sched["sigmas"], torch.tensor([0.99, 0.5]))
    nearest = (torch.tensor([0.99, 0.5])[:, None] - sig[None]).abs().argmin(dim=1)
    assert torch.equal(sched["step_index"], nearest)
    torch.testing.assert_close(sched["sigmas_next"], pol.schedule()["sigmas_next"][nearest])

    class TwoExperts:  # Wan's schedule table with a boundary at 0.6 (WanPipeline: high-noise expert while t >= 0.6)
        device = torch.device("cpu")
        boundary_ratio = 0.6

        def schedule(self):
            return {"sigmas": torch.tensor([1.0, 0.7, 0.4]), "expert": torch.tensor([0, 0, 1])}

    sched = fp.schedule_at(TwoExperts(), torch.tensor([0.65, 0.55, 0.9]))
    assert sched["expert"].tolist() == [
        0,
        1,
        0,
    ]  # by t itself, not by the nearest step (0.55 -> 0.7: expert 0)
    sched = fp.schedule_at(TwoExperts(), torch.tensor([0.4, 0.7]), torch.tensor([2, 1]))
    assert sched["expert"].tolist() == [1, 0] and sched["step_index"].tolist() == [2, 1]


# ----------------------------------------------------------------------------- the old policy


def test_old_policy_decay_update_swap_and_state(pipe_dir):
    one, two = fp.OldPolicy(None), fp.OldPolicy(None, decay_type=2)
    assert [one.decay(s) for s in (0, 100, 400, 10_000)] == pytest.approx([0.0, 0.1, 0.4, 0.5])
    assert [two.decay(s) for s in (50, 75, 175, 10_000)] == pytest.approx([0.0, 0.0, 0.75, 0.999])
    assert fp.OldPolicy(None, decay_type=0).decay(500) == 0.0
    with pytest.raises(ValueError, match="decay_type must be one of"):
        fp.OldPolicy(None, decay_type=3)

    pol = make(pipe_dir, lora=LORA)
    _perturb(pol, seed=1)
    old = fp.OldPolicy(pol, decay_type=1)
    start = [p.detach().clone() for p in pol.trainable_parameters()]
    old.ensure()
    _perturb(pol, seed=2)
    now = [p.detach().clone() for p in pol.trainable_parameters()]
    metrics: dict = {}
    old.on_step_end(None, 300, metrics)  # d = 0.3
    assert metrics["nft/old_decay"] == pytest.approx(0.3)
    for q, s0, c in zip(old.params, start, now, strict=True):
        torch.testing.assert_close(q, 0.3 * s0 + 0.7 * c)
    with pytest.raises(RuntimeError, match="boom"), old.applied():
        for p, q in zip(pol.trainable_parameters(), old.params, strict=True):
            assert torch.equal(p.detach(), q)
        raise RuntimeError("boom")
    for p, c in zip(pol.trainable_parameters(), now, strict=True):
        assert torch.equal(p.detach(), c)
    state = old.state_dict()
    again = fp.OldPolicy(pol)
    again.load_state_dict(state)
    for q, s in zip(again.params, old.params, strict=True):
        assert torch.equal(q, s)
    with pytest.raises(ValueError, match="do not match"):
        again.load_state_dict({"params": state["params"][:-1]})


# ----------------------------------------------------------------------------- the EMA of the weights


class _Weights:
    """The part of a policy `WeightEMA` reads: ``model`` and ``trainable_parameters`` (float64, one frozen)."""

    def __init__(self, seed=0):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
        self.model[1].bias.requires_grad_(False)

    def trainable_parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]


def _ema_reference(preset, steps, overrides, theta):
    """A plain loop from the authors' code. DiffusionNFT (scripts/train_nft_sd3.py, flow_grpo/ema.py): after
    optimizer step n, ``ema.step(params, n)``: d = min((1 + n) / (10 + n), 0.9), ema += (1 - d)(p - ema).
    Flow-Factory (models/abc.py ema_step(epoch), ema/ema.py, ema_utils.py): after epoch e (0-based), if
    (e + 1) % interval == 0, d = decay_fn(e), ema = d ema + (1 - d) p."""
    ema = [x.clone() for x in theta[0]]
    for n in range(1, steps + 1):
        if preset == "diffusion_nft":
            d = min((1 + n) / (10 + n), 0.9)
            ema = [e + (1 - d) * (p - e) for e, p in zip(ema, theta[n], strict=True)]
            continue
        e_idx = n - 1
        interval = overrides.get("every", 10)
        if (e_idx + 1) % interval != 0:
            continue
        kind, top = overrides.get("schedule", "power"), overrides.get("decay", 0.995)
        warm = overrides.get("warmup_steps", 10)
        if kind == "power":
            d = min(top, (1 + e_idx) / (warm + e_idx))
        elif kind == "linear":
            d0 = overrides.get("initial_decay", 0.0)
            d = top if e_idx >= warm else d0 + (top - d0) * (e_idx / warm)
        elif kind == "piecewise_linear":
            flat, ramp = overrides.get("flat_steps", 0), overrides.get("ramp_rate", 0.001)
            d = 0.0 if e_idx < flat else min((e_idx - flat) * ramp, top)
        else:
            d = top
        ema = [d * e + (1 - d) * p for e, p in zip(ema, theta[n], strict=True)]
    return ema


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [
        ("diffusion_nft", {}),
        ("flow_factory", {}),
        ("flow_factory", {"every": 1, "decay": 0.9}),  # Flow-Factory's guide for AWM's ema_kl_beta
        ("flow_factory", {"every": 1, "decay": 0.3, "schedule": "linear", "warmup_steps": 7}),
        ("flow_factory", {"every": 2, "decay": 0.5, "schedule": "piecewise_linear", "flat_steps": 3}),
        ("flow_factory", {"every": 3, "decay": 0.8, "schedule": "constant"}),
    ],
)
def test_weight_ema_matches_the_authors_loop(preset, overrides):
    pol = _Weights()
    ema = fp.WeightEMA(pol, preset=preset, **overrides)
    ema.ensure()
    g = torch.Generator().manual_seed(3)
    theta = [[p.detach().clone() for p in pol.trainable_parameters()]]
    logged = []
    for n in range(1, 31):  # an "optimizer step": new weights, then the callback
        with torch.no_grad():
            for p in pol.trainable_parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        theta.append([p.detach().clone() for p in pol.trainable_parameters()])
        metrics: dict = {}
        ema.on_step_end(None, n, metrics)
        logged.append(metrics.get("ema/decay"))
    ref = _ema_reference(preset, 30, overrides, theta)
    for q, r in zip(ema.params, ref, strict=True):
        torch.testing.assert_close(q, r, rtol=0, atol=1e-14)
    if preset == "diffusion_nft":  # d = (1 + n) / (10 + n) from the first step: 2/11, 3/12, ...
        assert logged[:2] == pytest.approx([2 / 11, 3 / 12]) and ema.updates == 30
    elif not overrides:  # Flow-Factory's defaults: every 10 epochs, d = min(0.995, (1 + e) / (10 + e))
        assert [x for x in logged if x is not None] == pytest.approx([10 / 19, 20 / 29, 30 / 39])
        assert logged[0] is None and ema.updates == 3


def test_weight_ema_swap_state_and_checkpoint_names():
    pol = _Weights()
    ema = fp.WeightEMA(pol, decay=0.5, schedule="constant")
    ema.ensure()
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(1.0)
    ema.update(1)
    now = [p.detach().clone() for p in pol.trainable_parameters()]
    with pytest.raises(RuntimeError, match="boom"), ema.applied():
        for p, q, c in zip(pol.trainable_parameters(), ema.params, now, strict=True):
            assert torch.equal(p.detach(), q) and torch.equal(q, c - 0.5)
        raise RuntimeError("boom")
    for p, c in zip(pol.trainable_parameters(), now, strict=True):
        assert torch.equal(p.detach(), c)
    state = ema.state_dict()
    trainable = {n for n, p in pol.model.named_parameters() if p.requires_grad}
    assert state["kind"] == fp.EMA_STATE_KIND and set(state["weights"]) == trainable and state["updates"] == 1
    again = fp.WeightEMA(pol)
    again.load_state_dict(state)
    assert again.updates == 1
    for q, s in zip(again.params, ema.params, strict=True):
        assert torch.equal(q, s)
    with pytest.raises(ValueError, match="do not match"):
        again.load_state_dict({"weights": {"0.weight": state["weights"]["0.weight"]}})
    for bad, msg in [
        ({"preset": "nope"}, "preset must be one of"),
        ({"schedule": "cubic"}, "schedule must be one of"),
        ({"decay": 1.5}, "must lie in"),
        ({"every": 0}, "every >= 1"),
    ]:
        with pytest.raises(ValueError, match=msg):
            fp.WeightEMA(pol, **bad)


def test_flow_predictions_v_ema_is_the_ema_weights_velocity(pipe_dir):
    pol = make(pipe_dir, lora=LORA)
    _perturb(pol, seed=4)
    ema = fp.WeightEMA(pol)
    ema.ensure()
    _perturb(pol, seed=5)
    rollout = fp.sample_clean(pol, ROWS, 2, num_actions=2, solver="euler")
    draw = fp.draw_forward(pol, rollout, generator=torch.Generator().manual_seed(0))
    p = fp.flow_predictions(pol, rollout, draw=draw, ema=ema)
    with ema.applied(), torch.no_grad():
        q = fp.flow_predictions(pol, rollout, draw=draw)
    torch.testing.assert_close(p.v_ema, q.v, rtol=0, atol=0)
    assert not torch.allclose(p.v.detach(), p.v_ema)
    out = p.objective("awm", torch.tensor([1.0, -1.0, 0.5, 0.0]), ema_kl_beta=0.1)
    torch.testing.assert_close(out.stats["ema_kl"], fo.velocity_kl(p.v.detach(), p.v_ema, 2))


# ----------------------------------------------------------------------------- learning


@pytest.mark.parametrize("name", ["diffusion_nft", "awm"])
def test_short_run_raises_the_reward(pipe_dir, name):
    """25 steps of the objective with LoRA on a reward that prefers a bright first latent channel: the mean
    reward of the last 5 rollouts is well above that of the first 5 (ODE rollouts: no log-prob anywhere)."""
    torch.manual_seed(0)
    pol = make(pipe_dir, lora=LORA)
    opt = torch.optim.AdamW(pol.trainable_parameters(), lr=1e-2)
    old = fp.OldPolicy(pol, decay_type=1) if name == "diffusion_nft" else None
    gen = torch.Generator().manual_seed(1)
    history = []
    for step in range(25):
        r = fp.sample_clean(pol, ROWS, 8, num_actions=3, solver="euler", weights=old)
        reward = r.payload[fp.CLEAN_KEY][:, 0].mean(dim=(1, 2))
        history.append(float(reward.mean()))
        means = torch.stack([reward[r.group == g].mean() for g in range(len(ROWS))])[r.group]
        adv = (reward - means) / (reward.std() + 1e-4)  # DiffusionNFT: per-prompt mean, global std
        p = fp.flow_predictions(pol, r, timesteps=fo.timestep_defaults(name), old=old, generator=gen)
        loss = p.objective(name, adv).per_action.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if old is not None:
            old.update(step + 1)
    first, last = sum(history[:5]) / 5, sum(history[-5:]) / 5
    assert last > first + 0.3, history
