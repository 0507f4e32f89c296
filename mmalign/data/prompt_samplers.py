"""Prompt samplers: which dataset rows the trainer rolls out next (docs/algorithms.md, "Group filters and samplers").

A sampler (``build_sampler(name, num_rows=, seed=, **options)``) picks row indices each round with
``next_indices(n)`` (distinct when ``n <= num_rows``, cycling beyond), may learn from
``observe(indices, successes, counts)`` (per-prompt success rates in [0, 1], NaN = no evidence), reports
``last_stats()`` and checkpoints through ``state_dict()`` (no pickle; a resumed sampler draws the same
prompts). Registered: ``uniform`` (shuffled epochs), ``vade`` (our design after VADE: Beta posteriors,
Thompson sampling; `VadeSampler`) and ``spo`` (SPO's prioritized sampling; `SpoSampler`). Rules and
formulas: docs/algorithms.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from mmalign.algorithms.advantages import SPOTracker
from mmalign.registry import Registry, option_checked

__all__ = [
    "SAMPLERS",
    "PromptSamplerBase",
    "SpoSampler",
    "UniformSampler",
    "VadeSampler",
    "beta_sample",
    "build_sampler",
    "get",
    "group_successes",
    "names",
    "success_from_rewards",
]

SAMPLERS: Registry[type[PromptSamplerBase]] = Registry("prompt sampler")


def get(name: str) -> type[PromptSamplerBase]:
    """The sampler class registered as `name` (raises `RegistryError`, a KeyError, if unknown)."""
    return SAMPLERS.get(name)


def names() -> list[str]:
    """The names of the registered prompt samplers, sorted."""
    return SAMPLERS.names()


def build_sampler(name: str, num_rows: int, seed: int = 0, **options: Any) -> PromptSamplerBase:
    """Instantiate the sampler `name`; an unknown option raises TypeError naming the sampler and option."""
    cls = get(name)
    return option_checked(SAMPLERS.kind, name, cls, n_positional=2)(num_rows, seed, **options)


# ---------------------------------------------------------------------------- success rates
def success_from_rewards(rewards: Tensor | Sequence[float], threshold: float | None = 0.5) -> float:
    """Success rate of one group of samples: Float[G] rewards -> float in [0, 1] (NaN if no valid reward).

    - ``threshold`` a float: the fraction of samples whose (total) reward is strictly greater than
      ``threshold``, e.g. 0.5 for 0/1 correctness rewards.
    - ``threshold=None``: the mean reward clamped to [0, 1] (for rewards already normalised to [0, 1]).

    NaN rewards ("not applicable") are left out; a group without any valid reward gives NaN, which
    `observe` treats as "no evidence".
    """
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    r = r[~torch.isnan(r)]
    if r.numel() == 0:
        return float("nan")
    if threshold is None:
        return float(r.mean().clamp(0.0, 1.0))
    return float((r > threshold).to(torch.float64).mean())


def group_successes(
    scores: Tensor, group: Tensor, threshold: float | None = 0.5
) -> tuple[list[int], list[float], list[float]]:
    """Per-group `success_from_rewards` of a batch: (group ids ascending, success rates, valid-sample counts).

    ``scores`` Float[B] is the combined scalar reward of each sample (``advantages.combine_rewards``),
    ``group`` Long[B] its group id. Counts are the numbers of non-NaN scores (G_eff for `observe`).
    """
    scores = torch.as_tensor(scores, dtype=torch.float64).flatten()
    group = torch.as_tensor(group).flatten().to(scores.device)
    if scores.numel() != group.numel():
        raise ValueError(f"scores has {scores.numel()} entries but group has {group.numel()}")
    ids: list[int] = []
    rates: list[float] = []
    counts: list[float] = []
    for g in torch.unique(group).tolist():
        r = scores[group == g]
        ids.append(int(g))
        rates.append(success_from_rewards(r, threshold))
        counts.append(float((~torch.isnan(r)).sum()))
    return ids, rates, counts


# ---------------------------------------------------------------------------- Beta sampling
def _log_standard_gamma(shape: Tensor, generator: torch.Generator) -> Tensor:
    """log of Gamma(shape, 1) draws (float64), Marsaglia & Tsang (2000), using only `generator`.

    ``torch._standard_gamma`` takes no generator, so the draws would not be reproducible from the
    sampler's own state; this rejection sampler consumes ``generator`` only (deterministically: the
    number of rounds depends on the draws alone). Shapes < 1 use the boost
    Gamma(a) = Gamma(a + 1) · U^(1/a), in log space so tiny shapes do not underflow to 0.
    """
    shape = shape.to(torch.float64)
    if bool((shape <= 0).any()) or not bool(torch.isfinite(shape).all()):
        raise ValueError("Gamma shapes must be finite and > 0")
    boost = shape < 1.0
    a = torch.where(boost, shape + 1.0, shape)
    d = a - 1.0 / 3.0
    c = 1.0 / torch.sqrt(9.0 * d)
    out = torch.empty_like(a)
    pending = torch.arange(a.numel())
    tiny = torch.finfo(torch.float64).tiny
    while pending.numel():
        m = pending.numel()
        x = torch.randn(m, generator=generator, dtype=torch.float64)
        u = torch.rand(m, generator=generator, dtype=torch.float64).clamp_min(tiny)
        dp, cp = d[pending], c[pending]
        v = (1.0 + cp * x) ** 3
        ok = v > 0
        log_v = torch.log(torch.where(ok, v, torch.ones_like(v)))
        accept = ok & (torch.log(u) < 0.5 * x * x + dp - dp * v + dp * log_v)
        out[pending[accept]] = torch.log(dp[accept]) + log_v[accept]
        pending = pending[~accept]
    if bool(boost.any()):
        u = torch.rand(int(boost.sum()), generator=generator, dtype=torch.float64).clamp_min(tiny)
        out[boost] = out[boost] + torch.log(u) / shape[boost]
    return out


def beta_sample(alpha: Tensor, beta: Tensor, generator: torch.Generator) -> Tensor:
    """Float64 draws p ~ Beta(alpha, beta), elementwise, reproducible from `generator` alone.

    p = Ga / (Ga + Gb) with Ga ~ Gamma(alpha), Gb ~ Gamma(beta), computed as sigmoid(log Ga − log Gb).
    """
    alpha = torch.as_tensor(alpha, dtype=torch.float64)
    beta = torch.as_tensor(beta, dtype=torch.float64)
    alpha, beta = torch.broadcast_tensors(alpha, beta)
    n = alpha.numel()
    lg = _log_standard_gamma(torch.cat([alpha.flatten(), beta.flatten()]), generator)
    return torch.sigmoid(lg[:n] - lg[n:]).reshape(alpha.shape)


# ---------------------------------------------------------------------------- samplers
class PromptSamplerBase:
    """Interface of a prompt sampler (see the module docstring)."""

    name = "base"

    def __init__(self, num_rows: int, seed: int = 0) -> None:
        if int(num_rows) < 1:
            raise ValueError(f"prompt sampler {self.name!r} needs at least one row, got num_rows={num_rows}")
        self.num_rows = int(num_rows)
        self.seed = int(seed)
        self._stats: dict[str, float] = {}

    def next_indices(self, n: int) -> list[int]:
        raise NotImplementedError

    def observe(
        self, indices: Sequence[int], successes: Sequence[float], counts: Sequence[float] | None = None
    ) -> None:
        """Feed back this round's per-prompt success rates (no-op unless the sampler learns)."""
        self._check_observation(indices, successes, counts)

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def last_stats(self) -> dict[str, float]:
        """Metrics of the last `next_indices` call (keys ``sampler/...``)."""
        return dict(self._stats)

    # helpers
    def _check_n(self, n: int) -> int:
        if isinstance(n, bool) or int(n) != n or n < 0:
            raise ValueError(f"prompt sampler {self.name!r}: n must be an integer >= 0, got {n!r}")
        return int(n)

    def _check_observation(
        self, indices: Sequence[int], successes: Sequence[float], counts: Sequence[float] | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        idx = torch.as_tensor(list(indices), dtype=torch.long).flatten()
        s = torch.as_tensor(list(successes), dtype=torch.float64).flatten()
        if idx.numel() != s.numel():
            raise ValueError(f"observe: {idx.numel()} indices but {s.numel()} success rates")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_rows):
            raise ValueError(f"observe: indices must be in [0, {self.num_rows}), got {idx.tolist()}")
        valid = ~torch.isnan(s)
        if bool(((s[valid] < 0) | (s[valid] > 1)).any()):
            raise ValueError(f"observe: success rates must be in [0, 1] (or NaN), got {s.tolist()}")
        c = None
        if counts is not None:
            c = torch.as_tensor(list(counts), dtype=torch.float64).flatten()
            if c.numel() != idx.numel():
                raise ValueError(f"observe: {idx.numel()} indices but {c.numel()} counts")
            if bool((c < 0).any()) or not bool(torch.isfinite(c).all()):
                raise ValueError(f"observe: counts must be finite and >= 0, got {c.tolist()}")
        return idx, s, c

    def _check_state(self, state: dict[str, Any]) -> None:
        name = state.get("name", "uniform")
        if name != self.name:
            raise ValueError(f"the checkpoint's prompt sampler is {name!r} but this run uses {self.name!r}")
        if state["num_rows"] != self.num_rows:
            raise ValueError(
                f"the checkpoint's sampler saw {state['num_rows']} rows but the data now has {self.num_rows}"
            )


@SAMPLERS.register("uniform")
class UniformSampler(PromptSamplerBase):
    """Shuffled epochs: every row once per epoch, in the order of the former `mmalign.data.rows.PromptSampler`.

    Epoch e's order is ``randperm(num_rows)`` from a generator seeded with ``seed * 1_000_003 + e``
    (identity order with ``shuffle=False``), exactly as the former `mmalign.data.rows.PromptSampler`. One difference: a call
    that crosses an epoch boundary stays distinct — rows of the new epoch already returned in this
    call (from the tail of the old epoch) are moved, in their order, to the end of the new epoch
    ("deferred"), so each epoch still holds every row exactly once. When the calls' n divides
    num_rows nothing is ever deferred and the sequence equals the former `mmalign.data.rows.PromptSampler`'s. Its state
    dicts (which lack ``name`` and ``deferred``) load here too.
    """

    name = "uniform"

    def __init__(self, num_rows: int, seed: int = 0, *, shuffle: bool = True) -> None:
        super().__init__(num_rows, seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.position = 0
        self.deferred: list[int] = []
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % 2**64)
            order = torch.randperm(self.num_rows, generator=g).tolist()
        else:
            order = list(range(self.num_rows))
        if self.deferred:
            late = set(self.deferred)
            order = [i for i in order if i not in late] + [i for i in order if i in late]
        return order

    def next_indices(self, n: int) -> list[int]:
        n = self._check_n(n)
        out: list[int] = []
        while len(out) < n:
            if self.position >= self.num_rows:
                self.epoch += 1
                self.position = 0
                # rows already in this call wait until the end of the new epoch (n > num_rows: plain epochs)
                self.deferred = sorted(set(out)) if n <= self.num_rows else []
                self._order = self._make_order()
            take = min(n - len(out), self.num_rows - self.position)
            out.extend(self._order[self.position : self.position + take])
            self.position += take
        self._stats = {"sampler/epoch": float(self.epoch)}
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_rows": self.num_rows,
            "deferred": list(self.deferred),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_state(state)
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
        self.deferred = [int(i) for i in state.get("deferred", [])]
        self._order = self._make_order()


@SAMPLERS.register("vade")
class VadeSampler(PromptSamplerBase):
    """VADE-style sampler — our design from the paper's description (docs/algorithms.md).

    State per prompt i: evidence counts a_i, b_i >= 0 (start 0); the posterior on its success rate
    is Beta(α_i, β_i) with α_i = alpha0 + a_i, β_i = beta0 + b_i.

    ``observe(indices, successes, counts)`` is one *sampler step*. For the prompts with a non-NaN
    success rate s_i over G_i samples (G_i = counts[i], default ``samples_per_prompt``), in order:

    1. slow, global decay — every prompt:     a ← γ_slow · a,  b ← γ_slow · b
    2. fast decay — each observed prompt once: a ← γ_fast · a,  b ← γ_fast · b
    3. evidence:                               a += w · s_i · G_i,  b += w · (1 − s_i) · G_i

    with γ_slow = ``gamma_slow``, γ_fast = ``gamma_fast``, w = ``evidence_weight``. Decaying the
    evidence (not α, β) shrinks every posterior toward the prior Beta(alpha0, beta0). The two time
    scales: a prompt seen again has its older evidence discounted by γ_fast per visit (the policy has
    moved since, so the newest group dominates: steady-state evidence w·G/(1 − γ_fast·γ_slow)); a
    prompt not seen for k steps drifts back by γ_slow^k, so its posterior widens and Thompson
    sampling revisits it. The evidence update treats the G samples of a group as G Bernoulli trials
    with s·G successes (the conjugate update), tempered by w (w < 1 for correlated samples; w = 1/G
    counts a group as one trial). A prompt listed twice in one call gets one fast decay and both
    evidence terms. NaN success rates are no evidence: those prompts are skipped entirely.

    ``next_indices(n)`` (n <= num_rows):

    - n_explore = ⌊explore · n + 0.5⌋ prompts are drawn uniformly among the least-visited ones: rank
      by (number of observations so far, uniform random key) and take the first n_explore
      (never-seen prompts first).
    - Thompson sampling: p̂_i ~ Beta(α_i, β_i) for every prompt (one vectorised draw from the
      sampler's own torch.Generator); among the others, the n − n_explore prompts with the largest
      information p̂(1 − p̂) are picked; ties go to the smaller index (stable sort).
    - Returned: the Thompson picks by decreasing information, then the exploration picks.

    For n > num_rows the full ranking of all rows is repeated (see the module docstring).

    ``last_stats()``: ``sampler/picked_p`` (mean posterior mean α/(α+β) of the picked prompts),
    ``sampler/picked_info`` (mean Thompson information p̂(1 − p̂) of the picked),
    ``sampler/picked_unseen_frac`` (share of picked never observed), ``sampler/seen_frac`` (share of
    all prompts observed at least once), ``sampler/all_info`` (mean posterior-mean information of
    all prompts).
    """

    name = "vade"

    def __init__(
        self,
        num_rows: int,
        seed: int = 0,
        *,
        alpha0: float = 1.0,
        beta0: float = 1.0,
        evidence_weight: float = 1.0,
        samples_per_prompt: float = 1.0,
        gamma_fast: float = 0.5,
        gamma_slow: float = 0.999,
        explore: float = 0.0,
    ) -> None:
        super().__init__(num_rows, seed)
        for key, value in (("alpha0", alpha0), ("beta0", beta0)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"prompt sampler 'vade': {key} must be > 0, got {value}")
        for key, value in (("evidence_weight", evidence_weight), ("samples_per_prompt", samples_per_prompt)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"prompt sampler 'vade': {key} must be >= 0, got {value}")
        for key, value in (("gamma_fast", gamma_fast), ("gamma_slow", gamma_slow), ("explore", explore)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"prompt sampler 'vade': {key} must be in [0, 1], got {value}")
        self.alpha0, self.beta0 = float(alpha0), float(beta0)
        self.evidence_weight = float(evidence_weight)
        self.samples_per_prompt = float(samples_per_prompt)
        self.gamma_fast, self.gamma_slow = float(gamma_fast), float(gamma_slow)
        self.explore = float(explore)
        self.a = torch.zeros(self.num_rows, dtype=torch.float64)
        self.b = torch.zeros(self.num_rows, dtype=torch.float64)
        self.visits = torch.zeros(self.num_rows, dtype=torch.long)
        self.steps = 0
        self.generator = torch.Generator().manual_seed((self.seed * 1_000_003 + 0x5EED_0ADE) % 2**64)

    # posterior
    @property
    def alpha(self) -> Tensor:
        return self.alpha0 + self.a

    @property
    def beta(self) -> Tensor:
        return self.beta0 + self.b

    def posterior_mean(self) -> Tensor:
        return self.alpha / (self.alpha + self.beta)

    # learning
    def observe(
        self, indices: Sequence[int], successes: Sequence[float], counts: Sequence[float] | None = None
    ) -> None:
        idx, s, c = self._check_observation(indices, successes, counts)
        if c is None:
            c = torch.full_like(s, self.samples_per_prompt)
        valid = ~torch.isnan(s)
        idx, s, c = idx[valid], s[valid], c[valid]
        self.a.mul_(self.gamma_slow)
        self.b.mul_(self.gamma_slow)
        seen = torch.unique(idx)
        self.a[seen] *= self.gamma_fast
        self.b[seen] *= self.gamma_fast
        self.a.index_add_(0, idx, self.evidence_weight * s * c)
        self.b.index_add_(0, idx, self.evidence_weight * (1.0 - s) * c)
        self.visits.index_add_(0, idx, torch.ones_like(idx))
        self.steps += 1

    # picking
    def _rank(self, k: int) -> tuple[list[int], Tensor]:
        """k distinct prompts (k <= num_rows) and the Thompson draws of all prompts."""
        n_explore = min(k, math.floor(self.explore * k + 0.5))
        p_hat = beta_sample(self.alpha, self.beta, self.generator)
        info = p_hat * (1.0 - p_hat)
        explored = torch.empty(0, dtype=torch.long)
        if n_explore:
            keys = torch.rand(self.num_rows, generator=self.generator, dtype=torch.float64)
            by_key = torch.argsort(keys, stable=True)
            by_visits = torch.sort(self.visits[by_key], stable=True).indices
            explored = by_key[by_visits][:n_explore]
        score = info.clone()
        score[explored] = -math.inf
        picked = torch.sort(score, descending=True, stable=True).indices[: k - n_explore]
        return torch.cat([picked, explored]).tolist(), info

    def next_indices(self, n: int) -> list[int]:
        n = self._check_n(n)
        k = min(n, self.num_rows)
        ranked, info = self._rank(k)
        out = ranked
        if n > self.num_rows:
            out = ranked * (n // self.num_rows) + ranked[: n % self.num_rows]
        sel = torch.tensor(ranked, dtype=torch.long)
        if sel.numel():
            p = self.posterior_mean()
            self._stats = {
                "sampler/picked_p": float(p[sel].mean()),
                "sampler/picked_info": float(info[sel].mean()),
                "sampler/picked_unseen_frac": float((self.visits[sel] == 0).double().mean()),
                "sampler/seen_frac": float((self.visits > 0).double().mean()),
                "sampler/all_info": float((p * (1.0 - p)).mean()),
            }
        return out

    # checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_rows": self.num_rows,
            "seed": self.seed,
            "a": self.a.clone(),
            "b": self.b.clone(),
            "visits": self.visits.clone(),
            "steps": self.steps,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counts and RNG; the options (prior, decays, explore) are this instance's (the config's)."""
        self._check_state(state)
        self.seed = int(state["seed"])
        self.a = state["a"].detach().to(torch.float64).clone()
        self.b = state["b"].detach().to(torch.float64).clone()
        self.visits = state["visits"].detach().to(torch.long).clone()
        self.steps = int(state["steps"])
        self.generator.set_state(state["generator"])


@SAMPLERS.register("spo")
class SpoSampler(PromptSamplerBase):
    """SPO's prioritized prompt sampling: weight w_i = sqrt(p̂_i (1 − p̂_i)) + epsilon, drawn without replacement.

    Xu & Ding, "Single-stream Policy Optimization" (arXiv:2509.13232), as in the authors' code
    (verl-recipe ``spo``): p̂_i = α_i / (α_i + β_i) from the per-prompt Beta tracker, ε = ``epsilon`` =
    0.05 keeps every prompt reachable; ``next_indices(n)`` draws min(n, num_rows) distinct rows with
    ``torch.multinomial`` on the sampler's own generator (repeating the draw order when n > num_rows).

    The tracker: `attach(tracker)` shares the :class:`mmalign.algorithms.advantages.SPOTracker` of the ``spo``
    estimator (prompt id = row index), which then updates it with its KL-adaptive decay, and
    ``observe`` does nothing. Unattached, the sampler keeps its own tracker and ``observe(indices,
    successes, counts)`` updates it as the estimator's ``rho_mode: constant`` does: α ← ρ α + s·c,
    β ← ρ β + (1 − s)·c with ρ = ``rho`` (0.96) and c the count (``samples_per_prompt`` if not given);
    unseen prompts have the prior Beta(``prior_alpha``, ``prior_beta``) = Beta(0.5, 0.5).

    ``last_stats()``: ``sampler/picked_p`` (mean p̂ of the picked rows), ``sampler/picked_weight`` (mean
    weight of the picked rows), ``sampler/seen_frac`` (share of rows the tracker has seen).
    """

    name = "spo"

    def __init__(
        self,
        num_rows: int,
        seed: int = 0,
        *,
        epsilon: float = 0.05,
        rho: float = 0.96,
        prior_alpha: float = 0.5,
        prior_beta: float = 0.5,
        samples_per_prompt: float = 1.0,
    ) -> None:
        super().__init__(num_rows, seed)
        if not (math.isfinite(epsilon) and epsilon > 0):
            raise ValueError(f"prompt sampler 'spo': epsilon must be > 0, got {epsilon}")
        if not 0.0 < rho <= 1.0:
            raise ValueError(f"prompt sampler 'spo': rho must be in (0, 1], got {rho}")
        for key, value in (("prior_alpha", prior_alpha), ("prior_beta", prior_beta)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"prompt sampler 'spo': {key} must be > 0, got {value}")
        if not (math.isfinite(samples_per_prompt) and samples_per_prompt >= 0):
            raise ValueError(
                f"prompt sampler 'spo': samples_per_prompt must be >= 0, got {samples_per_prompt}"
            )
        self.epsilon, self.rho = float(epsilon), float(rho)
        self.prior_alpha, self.prior_beta = float(prior_alpha), float(prior_beta)
        self.samples_per_prompt = float(samples_per_prompt)
        self.tracker = SPOTracker()
        self.attached = False
        self.generator = torch.Generator().manual_seed((self.seed * 1_000_003 + 0x5B0) % 2**64)

    def attach(self, tracker: SPOTracker) -> None:
        """Read p̂ from the ``spo`` estimator's tracker (which the estimator updates); ``observe`` becomes a no-op."""
        if not isinstance(tracker, SPOTracker):
            raise TypeError(f"prompt sampler 'spo' attaches an SPOTracker, got {type(tracker).__name__}")
        self.tracker = tracker
        self.attached = True

    def p_hat(self) -> Tensor:
        """Float64[num_rows]: the posterior mean of every row."""
        alpha, beta = self.tracker.posterior_table(self.num_rows, self.prior_alpha, self.prior_beta)
        return alpha / (alpha + beta)

    def weights(self) -> Tensor:
        """Float64[num_rows]: the sampling weights sqrt(p̂ (1 − p̂)) + epsilon."""
        p = self.p_hat()
        return (p * (1.0 - p)).clamp(min=0.0).sqrt() + self.epsilon

    def observe(
        self, indices: Sequence[int], successes: Sequence[float], counts: Sequence[float] | None = None
    ) -> None:
        idx, s, c = self._check_observation(indices, successes, counts)
        if self.attached:
            return
        if c is None:
            c = torch.full_like(s, self.samples_per_prompt)
        valid = ~torch.isnan(s)
        rows, inverse = torch.unique(idx[valid], return_inverse=True)
        succ = torch.zeros(rows.numel(), dtype=torch.float64).index_add_(0, inverse, (s * c)[valid])
        fail = torch.zeros(rows.numel(), dtype=torch.float64).index_add_(0, inverse, ((1.0 - s) * c)[valid])
        for row, sx, fx in zip(rows.tolist(), succ.tolist(), fail.tolist(), strict=True):
            a, b = self.tracker.posterior(row, self.prior_alpha, self.prior_beta)
            self.tracker.set(row, self.rho * a + sx, self.rho * b + fx, self.tracker.visits(row) + 1)

    def next_indices(self, n: int) -> list[int]:
        n = self._check_n(n)
        k = min(n, self.num_rows)
        p = self.p_hat()
        w = (p * (1.0 - p)).clamp(min=0.0).sqrt() + self.epsilon
        picked = torch.multinomial(w, k, replacement=False, generator=self.generator).tolist() if k else []
        out = picked
        if n > self.num_rows:
            out = picked * (n // self.num_rows) + picked[: n % self.num_rows]
        if picked:
            sel = torch.tensor(picked, dtype=torch.long)
            self._stats = {
                "sampler/picked_p": float(p[sel].mean()),
                "sampler/picked_weight": float(w[sel].mean()),
                "sampler/seen_frac": self.tracker.count_below(self.num_rows) / self.num_rows,
            }
        return out

    def state_dict(self) -> dict[str, Any]:
        """Generator state and, unattached, the sampler's own tracker (an attached one is the estimator's to save)."""
        return {
            "name": self.name,
            "num_rows": self.num_rows,
            "seed": self.seed,
            "attached": self.attached,
            "tracker": None if self.attached else self.tracker.state_dict(),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_state(state)
        self.seed = int(state["seed"])
        if state.get("tracker") is not None and not self.attached:
            self.tracker.load_state_dict(state["tracker"])
        self.generator.set_state(state["generator"])
