"""The loss of one microbatch, composed from the configured parts, and the update's metrics.

`LossComposer` turns a policy's `ActionStats` for a microbatch into the tensor the backward runs on: a head
gives the per-action loss (the registered policy-gradient loss of `mmalign.algorithms.losses` with the truncated
importance-sampling correction, or the loss the policy computed itself: a forward-process objective), then one
tail adds the KL penalty, aggregates with the minibatch's global normalisers and adds the auxiliary terms. It
needs no trainer: tests build one from a `Config` and call it. `Tally` sums the microbatches' metrics.
Formulas: docs/algorithms.md, "Composing the loss".
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mmalign.algorithms import is_correction as isc
from mmalign.algorithms import losses as loss_lib
from mmalign.config import Config, ConfigError
from mmalign.data.batch import Rollout
from mmalign.policies.base import ActionStats

__all__ = ["LOSS_NEEDS", "LossComposer", "MicroLoss", "Tally", "is_weighted", "microbatch_sums"]

LOSS_NEEDS = {"group_std": "group_std", "entropy": "entropy", "total_steps": "progress"}
"""Loss options the composer fills, by option name -> the need it declares: ``group_std`` (each sample's group
reward std, ``Rollout.outputs["group_std"]``), ``entropy`` (`ActionStats.entropy`), ``progress`` (``step`` and
``total_steps``)."""


def is_weighted(
    per_token: Tensor, logp_old: Tensor, logp_sampler: Tensor, mask: Tensor, *, level: str, cap: float
) -> tuple[Tensor, dict[str, Any]]:
    """The per-action loss weighted by the truncated importance weights of the trainer's over the sampler's
    log-probs (`rollout.is_correction` = `level`, `rollout.is_cap` = `cap`; `mmalign.algorithms.is_correction`), and the
    weights' metrics (``is/...``)."""
    w = isc.tis_weights(logp_old, logp_sampler, mask, level=level, cap=cap)
    weighted = isc.apply_is_weights(per_token, w)
    return weighted, isc.is_metrics(logp_old, logp_sampler, mask, level=level, cap=cap, weights=w)


@dataclass
class MicroLoss:
    """One microbatch's loss (`LossComposer.__call__`) and what its metrics need."""

    total: Tensor
    """What the backward runs on: the policy loss plus the weighted auxiliary terms (times the processes)."""
    loss: Tensor
    """The policy loss (aggregated, times the processes)."""
    logp: Tensor | None
    logp_old: Tensor | None
    mask: Tensor
    clipped: Tensor
    kl: Tensor | None
    entropy: Tensor | None
    is_stats: dict[str, Any]
    aux: dict[str, float]
    metrics: dict[str, Tensor] = field(default_factory=dict)
    """Per-action diagnostics of a policy-computed loss (`ActionStats.metrics`), logged as masked means."""


class LossComposer:
    """The microbatch loss of ``algorithm`` / ``rollout`` in `cfg` for `world` processes, for the policy named
    `policy_name` (in errors)."""

    def __init__(self, cfg: Config, *, world: int = 1, policy_name: str = "the policy") -> None:
        a, r = cfg.algorithm, cfg.rollout
        self.source = cfg.source
        self.loss_fn = loss_lib.get(a.loss)
        self.loss_kwargs = dict(a.loss_kwargs)
        options = loss_lib.options(a.loss)
        self.needs = frozenset(need for option, need in LOSS_NEEDS.items() if option in options)
        """What the loss reads besides the log-probs (`LOSS_NEEDS`)."""
        self.kl_coef, self.kl_estimator, self.agg = a.kl_coef, a.kl_estimator, a.loss_agg
        self.is_level, self.is_cap = r.is_correction, r.is_cap
        self.aux_coefs = dict(a.aux_coefs)
        self.total_steps = cfg.trainer.steps
        self.world, self.policy_name = world, policy_name

    def __call__(
        self,
        stats: ActionStats,
        mu: Rollout,
        n_tok: float,
        n_seq: float,
        *,
        actions: Tensor | None = None,
        measure_is: bool = True,
        step: int = 0,
        max_actions: int | None = None,
    ) -> MicroLoss:
        """The loss of microbatch `mu` whose gradient is its part of the minibatch's gradient, from the policy's
        `stats` of it: the per-action loss (times ``stats.loss_weights``, importance-weighted, plus the KL
        penalty) aggregated with the minibatch's global normalisers `n_tok` / `n_seq`, plus the auxiliary terms.
        With `actions` (one chunk of `Policy.action_chunks`: column indices) `stats` scored only those; the
        whole rows' action counts and width are the normalisers and their importance weights are used, so the
        chunks' losses add up to the whole microbatch's. `measure_is`: report the IS metrics; `step`: the
        training step (a loss that declares ``progress``); `max_actions`: the policy's fixed action count
        (``seq_sum_norm``'s length; None: the rows' width)."""
        if stats.loss is not None:
            head = self._policy_loss_head(stats, mu, actions)
        elif stats.logp is None:
            raise TypeError(f"{self.policy_name}.action_stats returned neither logp nor loss")
        else:
            head = self._policy_gradient_head(stats, mu, actions, measure_is, step)
        per_token, mask, full_mask, kl_tok = head["per_token"], head["mask"], head["full_mask"], head["kl"]
        if kl_tok is not None:
            per_token = per_token + self.kl_coef * kl_tok
        if actions is None:
            loss = self.aggregate(per_token, mask, n_tok, n_seq, max_actions=max_actions)
        else:
            loss = self.aggregate(
                per_token,
                mask,
                n_tok,
                n_seq,
                lengths=full_mask.sum(dim=1),
                width=int(full_mask.shape[1]),
                max_actions=max_actions,
            )
        aux_total, aux_values = self.aux_loss(stats.aux_losses, len(mu) / n_seq)
        return MicroLoss(
            total=loss if aux_total is None else loss + aux_total * self.world,
            loss=loss,
            logp=head["logp"],
            logp_old=head["logp_old"],
            mask=mask,
            clipped=head["clipped"],
            kl=kl_tok,
            entropy=stats.entropy,
            is_stats=head["is_stats"],
            aux=aux_values,
            metrics=head["metrics"],
        )

    def _policy_gradient_head(
        self, stats: ActionStats, mu: Rollout, actions: Tensor | None, measure_is: bool, step: int
    ) -> dict[str, Any]:
        """The registered loss of the log-probs, times ``loss_weights``, importance-weighted; its KL term."""
        logp = stats.logp
        assert logp is not None
        dev = logp.device
        idx = None if actions is None else actions.to(dev)

        def cols(x: Tensor) -> Tensor:  # this chunk's columns of a per-action [B, T] tensor
            x = x.to(dev)
            return x if idx is None else x.index_select(1, idx)

        full_mask = mu.mask.to(dev)
        mask = cols(full_mask)
        logp_old = cols(mu.logp_old) if mu.logp_old is not None else logp.detach()
        adv = mu.advantages.to(dev)
        loss_kwargs = dict(self.loss_kwargs)
        if "group_std" in self.needs:
            loss_kwargs["group_std"] = mu.outputs["group_std"].to(dev)
        if "entropy" in self.needs:  # this chunk's entropies (action_stats scored the same columns)
            loss_kwargs["entropy"] = None if stats.entropy is None else stats.entropy.to(dev)
        if "progress" in self.needs:
            loss_kwargs["step"], loss_kwargs["total_steps"] = step, self.total_steps
        out = self.loss_fn(logp, logp_old, adv if adv.dim() == 1 else cols(adv), mask, **loss_kwargs)
        per_token, is_stats = out.per_token, {}
        if stats.loss_weights is not None:
            per_token = per_token * stats.loss_weights.to(dev).detach()
        if mu.logp_sampler is not None and self.is_level != "none":
            level, cap = self.is_level, self.is_cap
            if idx is None or mu.logp_old is None:
                per_token, is_stats = is_weighted(
                    per_token, logp_old, cols(mu.logp_sampler), mask, level=level, cap=cap
                )
            else:  # the weights of the whole rows: a sequence-level weight needs all of a sample's actions
                old_full, sampler_full = mu.logp_old.to(dev), mu.logp_sampler.to(dev)
                w = isc.tis_weights(old_full, sampler_full, full_mask, level=level, cap=cap)
                per_token = isc.apply_is_weights(per_token, w.index_select(1, idx))
                is_stats = isc.is_metrics(old_full, sampler_full, full_mask, level=level, cap=cap, weights=w)
            if not measure_is:
                is_stats = {}
        kl_tok = None
        if self.kl_coef > 0:
            kl_tok = (
                stats.kl if stats.kl is not None else loss_lib.kl(logp, cols(mu.logp_ref), self.kl_estimator)
            )
        return {
            "per_token": per_token,
            "mask": mask,
            "full_mask": full_mask,
            "kl": kl_tok,
            "logp": logp,
            "logp_old": logp_old,
            "clipped": out.clipped,
            "is_stats": is_stats,
            "metrics": {},
        }

    def _policy_loss_head(self, stats: ActionStats, mu: Rollout, actions: Tensor | None) -> dict[str, Any]:
        """The loss the policy computed (`ActionStats.loss`; a forward-process objective), times
        ``loss_weights``: no log-prob, so no importance-sampling correction and no ``approx_kl``;
        `ActionStats.metrics` are logged instead."""
        per_token = stats.loss
        assert per_token is not None
        dev = per_token.device
        full_mask = mu.mask.to(dev)
        mask = full_mask if actions is None else full_mask.index_select(1, actions.to(dev))
        if stats.loss_weights is not None:
            per_token = per_token * stats.loss_weights.to(dev).detach()
        if self.kl_coef > 0 and stats.kl is None:
            raise TypeError(
                f"{self.policy_name}.action_stats returned a loss but no kl while algorithm.kl_coef > 0"
            )
        return {
            "per_token": per_token,
            "mask": mask,
            "full_mask": full_mask,
            "kl": stats.kl if self.kl_coef > 0 else None,
            "logp": None,
            "logp_old": None,
            "clipped": stats.clipped.to(dev) if stats.clipped is not None else torch.zeros_like(mask),
            "is_stats": {},
            "metrics": {k: v.detach() for k, v in stats.metrics.items()},
        }

    def aggregate(
        self,
        per_token: Tensor,
        mask: Tensor,
        n_tok: float,
        n_seq: float,
        *,
        lengths: Tensor | None = None,
        width: int | None = None,
        max_actions: int | None = None,
    ) -> Tensor:
        """``algorithm.loss_agg`` of the per-action loss with the minibatch's global normalisers, times the number
        of processes: DDP (and FSDP2's reduce-scatter) average gradients over processes. A chunk of a
        microbatch's actions passes its whole rows' action counts (`lengths`) and width (`width`: the
        ``seq_sum_norm`` length when the policy has no `max_actions`)."""
        max_len = max_actions
        if max_len is None and width is not None:
            max_len = width
        return (
            loss_lib.aggregate(
                per_token, mask, self.agg, num_tokens=n_tok, num_seqs=n_seq, max_len=max_len, lengths=lengths
            )
            * self.world
        )

    def aux_loss(self, terms: dict[str, Tensor], share: float) -> tuple[Tensor | None, dict[str, float]]:
        """The policy's auxiliary loss terms (`ActionStats.aux_losses`, microbatch means) weighted by their
        ``algorithm.aux_coefs`` and by the microbatch's `share` of the minibatch's samples (all processes), so
        the update sees the minibatch mean; and each term's share of its logged ``aux/<name>`` value."""
        total, values = None, {}
        for name, term in terms.items():
            if name not in self.aux_coefs:
                raise ConfigError(
                    f"{self.source}: key 'algorithm.aux_coefs': the policy returns the auxiliary loss "
                    f"{name!r} but the config gives it no coefficient (set algorithm.aux_coefs.{name}; 0 turns "
                    f"it off)"
                )
            if term.dim() != 0:
                raise ValueError(
                    f"auxiliary loss {name!r} must be a scalar (the microbatch mean), got {tuple(term.shape)}"
                )
            weighted = self.aux_coefs[name] * term * share
            total = weighted if total is None else total + weighted
            values[f"aux/{name}"] = float(term.detach()) * share * self.world
        return total, values


def microbatch_sums(micro: MicroLoss, world: int) -> dict[str, float]:
    """One microbatch's contributions to the update's sums: the loss (this process's share), clipped actions,
    ``approx_kl``, KL and entropy (summed over actions), and ``tokens``, its number of actions."""
    with torch.no_grad():
        mask = micro.mask
        k = float(mask.sum())
        sums = {
            "loss": float(micro.loss) / world,
            "clip_frac": float((micro.clipped & mask).sum()),
        }
        if micro.logp is not None and micro.logp_old is not None:
            sums["approx_kl"] = float(loss_lib.approx_kl(micro.logp, micro.logp_old, mask)) * k
        for key, value in micro.metrics.items():
            sums["policy_metric:" + key] = float(torch.where(mask, value.to(mask.device).double(), 0.0).sum())
        if micro.kl is not None:
            sums["kl"] = float((micro.kl * mask).sum())
        if micro.entropy is not None:
            sums["entropy"] = float((micro.entropy * mask).sum())
        sums["tokens"] = k
        return sums


class Tally:
    """Sums and counts of one update's metrics, added microbatch by microbatch and step by step."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, float] = defaultdict(float)

    def add_microbatch(self, micro: MicroLoss, world: int) -> None:
        for key, value in micro.is_stats.items():
            self.sums[key] += float(value)
            self.counts[key] += 1
        for key, value in micro.aux.items():
            self.sums[key] += value
        values = microbatch_sums(micro, world)
        self.counts["tokens"] += values.pop("tokens")
        for key, value in values.items():
            self.sums[key] += value

    def add_optimizer_step(self, grad_norm: float | None) -> None:
        if grad_norm is not None:
            self.sums["grad_norm"] += grad_norm
            self.counts["opt_steps"] += 1
        self.counts["updates"] += 1

    def metrics(self, *, kl: bool) -> dict[str, float]:
        """Per action: clip_frac, approx_kl, kl (`kl`: logged), entropy; per update: loss, ``aux/*``; per IS
        measurement: ``is/*``; per clipped step: grad_norm."""
        sums, counts = self.sums, self.counts
        tok = max(counts["tokens"], 1.0)
        m = {
            "loss": sums["loss"] / max(counts["updates"], 1),
            "clip_frac": sums["clip_frac"] / tok,
        }
        if "approx_kl" in sums:
            m["approx_kl"] = sums["approx_kl"] / tok
        for key in [k for k in sums if k.startswith("policy_metric:")]:
            m[key.removeprefix("policy_metric:")] = sums[key] / tok
        if kl:
            m["kl"] = sums["kl"] / tok
        if "entropy" in sums:
            m["entropy"] = sums["entropy"] / tok
        for key in [k for k in sums if k.startswith("is/")]:
            m[key] = sums[key] / max(counts[key], 1.0)
        for key in [k for k in sums if k.startswith("aux/")]:
            m[key] = sums[key] / max(counts["updates"], 1)
        if counts["opt_steps"]:
            m["grad_norm"] = sums["grad_norm"] / counts["opt_steps"]
        return m
