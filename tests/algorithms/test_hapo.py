"""HAPO (estimator:hapo, loss:hapo) against plain-loop references written from the formulas, and hand-worked numbers."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from mmalign.algorithms import advantages as adv
from mmalign.algorithms import losses as L
from mmalign.algorithms import losses as X

NAN = float("nan")


# ---------------------------------------------------------------------------- estimator: token-level group average
def ref_hapo_adv(r, gids, lengths, eps=1e-6, fallback=5.0, std="group"):
    """Each group's rewards repeated once per token (the authors' token matrix), population statistics."""
    out = [0.0] * len(r)
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(gids):
        groups.setdefault(g, []).append(i)
    for idxs in groups.values():
        members = [i for i in idxs if not math.isnan(r[i])]
        tokens = [r[i] for i in members for _ in range(lengths[i])]
        if len(members) < 2 or not tokens or len({r[i] for i in members}) == 1:
            continue  # equal rewards: 0 (the shared convention)
        mu, sd = statistics.fmean(tokens), statistics.pstdev(tokens)
        a = {i: (r[i] - mu) / (sd + eps) if std == "group" else r[i] - mu for i in members}
        if any(abs(x) >= fallback for x in a.values()):
            vals = [r[i] for i in members]
            m, s = statistics.fmean(vals), statistics.stdev(vals)
            a = {i: (r[i] - m) / (s + eps) for i in members}
        for i in members:
            out[i] = a[i]
    return out


def test_hapo_estimator_matches_token_expanded_reference():
    rng = random.Random(11)
    worst = 0.0
    for trial in range(60):
        n_groups = rng.randint(1, 5)
        gids = [g for g in rng.sample(range(-5, 50), n_groups) for _ in range(rng.randint(1, 6))]
        rng.shuffle(gids)
        r = [NAN if rng.random() < 0.1 else rng.choice([0.0, 0.5, 1.0, rng.gauss(0, 1)]) for _ in gids]
        lengths = [rng.choice([0, 1, 3, 40, 200]) for _ in gids]
        std = "none" if trial % 5 == 0 else "group"
        got = adv.hapo(
            torch.tensor(r, dtype=torch.float64),
            torch.tensor(gids),
            num_actions=torch.tensor(lengths),
            std=std,
        )
        want = torch.tensor(ref_hapo_adv(r, gids, lengths, std=std), dtype=torch.float64)
        diff = (got - want).abs().max().item()
        worst = max(worst, diff)
        assert diff < 1e-9, (trial, diff)
    print(f"estimator hapo max abs diff vs token-expanded reference: {worst:.3e}")


def test_hapo_estimator_hand_worked_and_fallback():
    # r = [1, 0, 0, 1], n = [10, 2, 3, 4]: N = 19, mu = 14/19, var = (14 (5/19)^2 + 5 (14/19)^2) / 19
    mu = 14 / 19
    sd = math.sqrt((14 * (5 / 19) ** 2 + 5 * mu**2) / 19)
    a = adv.hapo(
        torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long), num_actions=[10, 2, 3, 4]
    )
    hand = [(1 - mu) / (sd + 1e-6), -mu / (sd + 1e-6)]
    torch.testing.assert_close(a, torch.tensor([hand[0], hand[1], hand[1], hand[0]]))
    # one short correct answer among long wrong ones: its token-level z-score is sqrt(999) > 5 -> GRPO instead
    r = torch.tensor([1.0, 0.0, 0.0])
    g = torch.zeros(3, dtype=torch.long)
    torch.testing.assert_close(
        adv.hapo(r, g, num_actions=[1, 500, 499]), adv.grpo(r, g, eps=1e-6), rtol=1e-6, atol=1e-7
    )
    # equal lengths: token statistics = sample statistics with the population std
    r4 = torch.tensor([1.0, 0.0, 1.0, 1.0])
    want = (r4 - 0.75) / (math.sqrt(0.1875) + 1e-6)
    torch.testing.assert_close(adv.hapo(r4, torch.zeros(4, dtype=torch.long), num_actions=[7] * 4), want)
    # equal rewards: exactly 0, whatever the lengths
    assert (
        adv.hapo(torch.full((3,), 0.3), torch.zeros(3, dtype=torch.long), num_actions=[1, 7, 90]).abs().sum()
        == 0
    )
    assert adv.accepts_num_actions("hapo")
    with pytest.raises(ValueError, match="num_actions"):
        adv.hapo(r4, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="fallback"):
        adv.hapo(r4, torch.zeros(4, dtype=torch.long), num_actions=[1] * 4, fallback=0.0)


# ---------------------------------------------------------------------------- loss: adaptive clip + redistribution
def ref_entropy_score(ent, mask, pivot):
    cells = [(i, j) for i in range(len(ent)) for j in range(len(ent[0])) if mask[i][j]]
    logs = {c: math.log(max(ent[c[0]][c[1]], 1e-8)) for c in cells}
    ordered = sorted(logs.values())
    med = ordered[round(pivot * (len(ordered) - 1))]
    d = {c: v - med for c, v in logs.items()}
    s = math.sqrt(max(sum(x * x for x in d.values()) / len(d), 1e-8))
    d = {c: x / s for c, x in d.items()}
    top = max([x for x in d.values() if x > 0] + [0.0])
    bottom = max([-x for x in d.values() if x < 0] + [0.0])
    out = [[0.0] * len(ent[0]) for _ in ent]
    for (i, j), x in d.items():
        out[i][j] = x / max(top, 1e-8) if x > 0 else x / max(bottom, 1e-8)
    return out


def ref_hapo_loss(logp, logp_old, a, mask, ent, eps_low, eps_high, c, pivot, alpha, beta):
    h = ref_entropy_score(ent, mask, pivot)
    b, t = len(logp), len(logp[0])
    per = [[0.0] * t for _ in range(b)]
    for i in range(b):
        for j in range(t):
            if not mask[i][j]:
                continue
            rho = math.exp(logp[i][j] - logp_old[i][j])
            A = a[i][j] if isinstance(a[i], list) else a[i]
            hh = h[i][j]
            lo = eps_low * (1 - alpha * hh) if hh <= 0 else eps_low
            hi = eps_high * (1 + alpha * hh) if hh > 0 else eps_high
            inside = 1 - lo / 2 < rho < 1 + hi / 2
            boosted = A * (1 + beta * hh)
            if hh > 0:
                A = A if inside else boosted
            else:
                A = boosted if inside else A
            loss = max(-rho * A, -min(max(rho, 1 - lo), 1 + hi) * A)
            if A < 0:
                loss = min(loss, -c * A)
            per[i][j] = loss
    return per


def random_inputs(seed, b=4, t=6, token_adv=False):
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(b, t, generator=g, dtype=torch.float64) * 0.5 - 1.0).requires_grad_(True)
    logp_old = logp.detach() + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.25
    mask = torch.rand(b, t, generator=g) < 0.8
    mask[0, 0] = True
    mask[-1] = False
    a = torch.randn(b, t, generator=g, dtype=torch.float64) if token_adv else torch.randn(b, generator=g)
    ent = torch.rand(b, t, generator=g, dtype=torch.float64) * 3.0
    return logp, logp_old, a.double(), mask, ent


@pytest.mark.parametrize("token_adv", [False, True])
def test_hapo_loss_matches_plain_loop(token_adv):
    worst = 0.0
    settings = [
        (0.2, 0.2, 10.0, 0.8, 1.0, 1.0),
        (0.2, 0.28, 3.0, 0.5, 0.5, 0.0),
        (0.1, 0.3, 2.0, 0.0, 1.0, 0.7),
    ]
    for seed in range(8):
        logp, logp_old, a, mask, ent = random_inputs(seed, token_adv=token_adv)
        for el, eh, c, pivot, alpha, beta in settings:
            out = L.get("hapo")(
                logp,
                logp_old,
                a,
                mask,
                eps_low=el,
                eps_high=eh,
                c=c,
                entropy_pivot=pivot,
                clip_alpha=alpha,
                adv_beta=beta,
                entropy=ent,
            )
            want = ref_hapo_loss(
                logp.tolist(),
                logp_old.tolist(),
                a.tolist(),
                mask.tolist(),
                ent.tolist(),
                el,
                eh,
                c,
                pivot,
                alpha,
                beta,
            )
            diff = (out.per_token.detach() - torch.tensor(want, dtype=torch.float64)).abs().max().item()
            worst = max(worst, diff)
            assert diff < 1e-12, (seed, pivot, diff)
    print(f"loss hapo (token_adv={token_adv}) max abs diff vs plain loop: {worst:.3e}")


def test_hapo_entropy_score_hand_worked():
    # log entropies 0, 1, 2, 3 (one masked out: 9): pivot 0.5 -> rank round(1.5) = 2 -> median log 2
    ent = torch.tensor([[1.0, math.e, math.e**2, math.e**3, math.e**9]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, False]])
    # d0 = [-2, -1, 0, 1]; s = sqrt(6 / 4); d = d0 / s; then positives / max (1 -> 1), negatives / |min| (-2 -> -1)
    h = X.hapo_entropy_score(ent, mask, pivot=0.5)
    torch.testing.assert_close(h, torch.tensor([[-1.0, -0.5, 0.0, 1.0, 0.0]], dtype=torch.float64))
    assert X.hapo_entropy_score(ent, torch.zeros_like(mask), 0.5).abs().sum() == 0


def test_hapo_loss_bounds_by_hand_and_reductions():
    # two tokens, entropies e^0 and e^2, pivot 0.5 -> rank round(0.5) = 0: median log 0 -> h = [0, 1]
    mask = torch.ones(1, 2, dtype=torch.bool)
    ent = torch.tensor([[1.0, math.e**2]], dtype=torch.float64)
    lp = torch.tensor([[0.0, math.log(1.3)]], dtype=torch.float64, requires_grad=True)
    out = L.get("hapo")(
        lp,
        torch.zeros(1, 2, dtype=torch.float64),
        torch.tensor([1.0]),
        mask,
        entropy=ent,
        entropy_pivot=0.5,
        adv_beta=0.0,
    )
    # token 2 (h = 1): eps_high 0.2 * 2 = 0.4, so rho 1.3 is NOT clipped (PPO would clip at 1.2)
    assert out.clipped.tolist() == [[False, False]]
    out.per_token.sum().backward()
    assert lp.grad[0, 1].item() == pytest.approx(-1.3)
    # redistribution: rho 1.3 lies outside the neutral zone (1 + 0.4 / 2 = 1.2) of an uncertain token -> A (1 + h) = 2
    out2 = L.get("hapo")(
        lp.detach(),
        torch.zeros(1, 2, dtype=torch.float64),
        torch.tensor([1.0]),
        mask,
        entropy=ent,
        entropy_pivot=0.5,
    )
    assert out2.per_token[0, 1].item() == pytest.approx(-1.3 * 2.0)
    assert out2.per_token[0, 0].item() == pytest.approx(-1.0)  # h = 0 and rho = 1: inside, A (1 + 0) = 1
    # alpha = beta = 0 with a large c: exactly ppo_clip
    logp, logp_old, a, m, e = random_inputs(3)
    got = L.get("hapo")(logp, logp_old, a, m, entropy=e, clip_alpha=0.0, adv_beta=0.0, c=1e9)
    torch.testing.assert_close(got.per_token, L.get("ppo_clip")(logp, logp_old, a, m).per_token)
    with pytest.raises(ValueError, match="entropy"):
        L.get("hapo")(logp, logp_old, a, m)
    with pytest.raises(ValueError, match="clip_alpha"):
        L.get("hapo")(logp, logp_old, a, m, entropy=e, clip_alpha=2.0)
    assert L.options("hapo") == {
        "eps_low": 0.2,
        "eps_high": 0.2,
        "c": 10.0,
        "entropy_pivot": 0.8,
        "clip_alpha": 1.0,
        "adv_beta": 1.0,
        "entropy": None,
    }
