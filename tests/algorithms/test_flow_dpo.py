"""Flow-DPO (`mmalign.algorithms.flow_objectives.flow_dpo`) against a plain loop over pairs written from Diffusion-DPO's loss
(Wallace et al. 2023; the authors' train.py and the flow-matching form of flow_grpo's train_sd3_dpo.py /
Flow-Factory's trainers/dpo.py), a hand-worked pair, and the best-vs-worst pair choice (`best_worst_pairs`) on
hand-worked groups."""

from __future__ import annotations

import math

import pytest
import torch

from mmalign.algorithms import flow_objectives as fo

F64 = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-9}


# ----------------------------------------------------------------------------- pair choice


def pairs_of(scores, group, valid=None):
    out = fo.best_worst_pairs(
        torch.tensor(scores, dtype=F64), torch.tensor(group), None if valid is None else torch.tensor(valid)
    )
    assert out.dtype == torch.long and out.ndim == 2 and out.shape[1] == 2
    return [tuple(p) for p in out.tolist()]


def test_best_vs_worst_of_each_group():
    #          group 0 ------   group 1 -  group 2 (ties) --------
    scores = [0.1, 0.9, 0.5, 0.3, 0.3, 2.0, -1.0, 2.0, -1.0]
    group = [0, 0, 0, 1, 1, 2, 2, 2, 2]
    # group 1's rewards are all equal: no pair; ties take the first row with the max / min
    assert pairs_of(scores, group) == [(1, 0), (5, 6)]


def test_pairs_follow_first_appearance_and_skip_small_groups():
    scores = [1.0, 5.0, 3.0, 0.0, 7.0]
    group = [4, 2, 4, 2, 9]  # group 9 has one sample: no pair
    assert pairs_of(scores, group) == [(2, 0), (1, 3)]
    assert pairs_of([], []) == []


def test_invalid_and_nan_samples_are_left_out():
    scores = [0.2, 0.8, float("nan"), 0.5, 0.1, 0.4]
    group = [0, 0, 0, 0, 1, 1]
    valid = [True, False, True, True, True, False]
    # group 0: row 1 (the best) is invalid, row 2 is NaN -> rows 0 and 3; group 1: one valid row -> no pair
    assert pairs_of(scores, group, valid) == [(3, 0)]
    assert pairs_of([1.0, float("nan")], [0, 0]) == []
    with pytest.raises(ValueError, match="must be"):
        fo.best_worst_pairs(torch.zeros(3), torch.zeros(2, dtype=torch.long))


# ----------------------------------------------------------------------------- the loss


def _inputs(b=6, k=2, latent=(2, 3), seed=0, pairs=((1, 0), (3, 5))):
    """Random velocities; each pair's loser shares its winner's t and noise (as the policy draws them)."""
    g = torch.Generator().manual_seed(seed)
    shape = (b, k, *latent)
    v = torch.randn(shape, generator=g, dtype=F64).requires_grad_(True)
    v_ref = v.detach() + 0.2 * torch.randn(shape, generator=g, dtype=F64)
    noise = torch.randn(shape, generator=g, dtype=F64)
    x0 = torch.randn((b, 1, *latent), generator=g, dtype=F64).expand(shape)
    t = torch.rand((b, k), generator=g, dtype=F64) * 0.9 + 0.05
    pairs_t = torch.tensor(pairs, dtype=torch.long)
    noise[pairs_t[:, 1]] = noise[pairs_t[:, 0]]
    t[pairs_t[:, 1]] = t[pairs_t[:, 0]]
    adv = torch.linspace(-1, 1, b, dtype=F64)
    return v, v_ref, noise, x0, t, adv, pairs_t


def dpo_reference(v, v_ref, noise, x0, t, pairs, beta):
    """A plain loop over pairs and sigmas: per pair and column, mean squared error of the velocity against
    eps - x0 for policy and reference, -log sigmoid(-beta/2 ((e_w - r_w) - (e_l - r_l))); returns the per-pair
    losses Float[P, K] (with grad through v)."""
    rows = []
    for w, lo in pairs.tolist():
        row = []
        for j in range(t.shape[1]):
            target_w = noise[w, j] - x0[w, j]
            target_l = noise[lo, j] - x0[lo, j]
            e_w = ((v[w, j] - target_w) ** 2).mean()
            e_l = ((v[lo, j] - target_l) ** 2).mean()
            r_w = ((v_ref[w, j] - target_w) ** 2).mean()
            r_l = ((v_ref[lo, j] - target_l) ** 2).mean()
            inside = -0.5 * beta * ((e_w - r_w) - (e_l - r_l))
            row.append(-torch.log(1.0 / (1.0 + torch.exp(-inside))))
        rows.append(torch.stack(row))
    return torch.stack(rows)


@pytest.mark.parametrize("beta", [0.5, 5.0, 40.0])
def test_matches_loop_loss_and_gradient(beta):
    v, v_ref, noise, x0, t, adv, pairs = _inputs(seed=1)
    out = fo.flow_dpo(v, v.detach(), noise, x0, t, adv, None, beta=beta, v_ref=v_ref, pairs=pairs)
    ref = dpo_reference(v, v_ref, noise, x0, t, pairs, beta)
    # half of each pair's loss on each member's action; unpaired rows (2, 4) carry nothing
    expect = torch.zeros(t.shape, dtype=F64)
    for p, (w, lo) in enumerate(pairs.tolist()):
        expect[w] = expect[w] + ref[p].detach() / 2
        expect[lo] = expect[lo] + ref[p].detach() / 2
    torch.testing.assert_close(out.per_action.detach(), expect, **TOL)
    (g,) = torch.autograd.grad(out.per_action.sum(), v)
    (g_ref,) = torch.autograd.grad(ref.sum(), v)
    torch.testing.assert_close(g, g_ref, **TOL)
    assert (g[[2, 4]] == 0).all()
    acc = torch.zeros(t.shape, dtype=F64)
    for p, (w, lo) in enumerate(pairs.tolist()):
        # loss = log(1 + e^-logit): the logit is > 0 exactly when the loss is < log 2
        acc[w, 0] = acc[lo, 0] = float(float(ref[p, 0].detach()) < math.log(2))
    torch.testing.assert_close(out.stats["implicit_acc"][:, 0], acc[:, 0])
    assert out.stats["paired"].sum() == 2 * pairs.shape[0] * t.shape[1]


def test_hand_worked_pair():
    """D = 2, beta = 2, t = 1/2, eps = (1, 1): the winner x0 = (0, 0) has target (1, 1), the loser x0 = (1, 1)
    target (0, 0). v_w = (1, 1) is exact (e_w = 0), the reference 0 misses by 1 (r_w = 1); v_l = (1, 1) misses
    by 1 (e_l = 1), the reference is exact (r_l = 0). logit = -1 ((0 - 1) - (1 - 0)) = 2, loss = log(1 + e^-2)
    = 0.126928; d loss / d v_l = -sigmoid(-2) * d e_l / d v_l = -sigmoid(-2) (1, 1); d / d v_w = 0."""
    v = torch.tensor([[[1.0, 1.0]], [[1.0, 1.0]]], dtype=F64, requires_grad=True)
    v_ref = torch.zeros(2, 1, 2, dtype=F64)
    noise = torch.ones(2, 1, 2, dtype=F64)
    x0 = torch.tensor([[[0.0, 0.0]], [[1.0, 1.0]]], dtype=F64)
    t = torch.full((2, 1), 0.5, dtype=F64)
    out = fo.flow_dpo(
        v, v, noise, x0, t, torch.zeros(2, dtype=F64), beta=2.0, v_ref=v_ref, pairs=torch.tensor([[0, 1]])
    )
    loss = math.log1p(math.exp(-2.0))
    torch.testing.assert_close(out.per_action.detach(), torch.full((2, 1), loss / 2, dtype=F64), **TOL)
    torch.testing.assert_close(out.stats["logit"], torch.full((2, 1), 2.0, dtype=F64), **TOL)
    (g,) = torch.autograd.grad(out.per_action.sum(), v)
    s = 1.0 / (1.0 + math.exp(2.0))
    torch.testing.assert_close(g, torch.tensor([[[0.0, 0.0]], [[-s, -s]]], dtype=F64), **TOL)


def test_identical_policy_and_reference_give_log_two():
    v, _, noise, x0, t, adv, pairs = _inputs(seed=2)
    out = fo.flow_dpo(v, v, noise, x0, t, adv, beta=2000.0, v_ref=v.detach(), pairs=pairs)
    paired = out.stats["paired"] > 0
    torch.testing.assert_close(
        out.per_action[paired].detach(), torch.full((int(paired.sum()),), math.log(2) / 2, dtype=F64)
    )


def test_mask_drops_a_pairs_action_even_with_nan():
    v, v_ref, noise, x0, t, adv, pairs = _inputs(seed=3)
    mask = torch.ones(t.shape, dtype=torch.bool)
    mask[5, 1] = False  # the second pair's loser, column 1: that pair's column-1 action is dropped
    mask[4] = False  # an unpaired row
    poisoned = v.detach().clone()
    poisoned[~mask] = float("nan")
    vv = poisoned.requires_grad_(True)
    out = fo.flow_dpo(vv, vv, noise, x0, t, adv, mask, beta=3.0, v_ref=v_ref, pairs=pairs)
    assert torch.isfinite(out.per_action).all() and (out.per_action[~mask] == 0).all()
    assert out.per_action[3, 1] == 0 and out.per_action[3, 0] > 0  # the winner of the dropped column
    (g,) = torch.autograd.grad(out.per_action.sum(), vv)
    assert torch.isfinite(g).all() and (g[~mask] == 0).all() and (g[3, 1] == 0).all()
    full = fo.flow_dpo(v.detach(), v, noise, x0, t, adv, beta=3.0, v_ref=v_ref, pairs=pairs)
    torch.testing.assert_close(out.per_action[:, 0], full.per_action[:, 0], **TOL)


def test_no_pair_keeps_a_zero_gradient():
    v, v_ref, noise, x0, t, adv, _ = _inputs(seed=4)
    out = fo.flow_dpo(v, v, noise, x0, t, adv, v_ref=v_ref, pairs=torch.zeros(0, 2, dtype=torch.long))
    assert (out.per_action == 0).all() and out.per_action.requires_grad
    (g,) = torch.autograd.grad(out.per_action.sum(), v)
    assert (g == 0).all()


def test_inputs_are_checked():
    v, v_ref, noise, x0, t, adv, pairs = _inputs(seed=5)
    call = fo.get("flow_dpo")
    with pytest.raises(ValueError, match="needs v_ref"):
        call(v, v, noise, x0, t, adv, pairs=pairs)
    with pytest.raises(ValueError, match="needs pairs"):
        call(v, v, noise, x0, t, adv, v_ref=v_ref)
    with pytest.raises(ValueError, match="share t and the noise"):
        call(v, v, noise, x0, t, adv, v_ref=v_ref, pairs=torch.tensor([[0, 2]]))
    with pytest.raises(ValueError, match="at most one pair"):
        call(v, v, noise, x0, t, adv, v_ref=v_ref, pairs=torch.tensor([[1, 1]]))
    with pytest.raises(ValueError, match="must index"):
        call(v, v, noise, x0, t, adv, v_ref=v_ref, pairs=torch.tensor([[1, 9]]))
    with pytest.raises(ValueError, match="beta must be"):
        call(v, v, noise, x0, t, adv, beta=0.0, v_ref=v_ref, pairs=pairs)
    with pytest.raises(TypeError, match="unknown option"):
        call(v, v, noise, x0, t, adv, None, bta=1.0, v_ref=v_ref, pairs=pairs)


def test_registry_entry():
    assert "flow_dpo" in fo.names()
    assert fo.options("flow_dpo") == {"beta": 2000.0}  # v_ref and pairs are inputs, not config options
    assert fo.inputs("flow_dpo") == ("v_ref", "pairs")
    assert fo.timestep_defaults("flow_dpo")["strategy"] == "logit_normal"
    assert "Diffusion-DPO" in fo.REGISTRY.describe("flow_dpo")
