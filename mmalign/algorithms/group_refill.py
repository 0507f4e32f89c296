"""Refilling all-fail groups: tiered hints (Scaf-GRPO, SAGE) and R³ replay of a past success.

A group whose every sample fails (combined reward below ``success_threshold``) gives GRPO no signal.
`GroupRefill.refill` takes one round's rollout with its rewards and, for every such group, first re-rolls it
with hints inserted in the prompt, tier after tier (``hints: true``; training only), then, if it still fails,
replaces its last sample by the prompt's best past success from a per-prompt memory (``replay: true``; saved
by ``state_dict``, corrected by the trainer's importance sampling). Rules, metrics and what is our design:
docs/algorithms.md, "All-fail groups: hints and replay".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from mmalign.algorithms.advantages import combine_rewards
from mmalign.data.batch import Rollout, rollout_from_state, rollout_state

__all__ = ["LEFT_PADDED", "GroupRefill", "cat_rollouts", "rollout_from_state", "rollout_state"]

RegenerateFn = Callable[[list[dict[str, Any]], int], tuple[Rollout, Tensor]]
"""``(rows, group_size) -> (rollout of group_size samples per row, their rewards Float[B] or Float[B,K])``."""
ScoreFn = Callable[[Rollout], Tensor]
"""``rollout -> Float[B,T]`` per-action log-probs of its stored actions under the current policy (no grad)."""

LEFT_PADDED = ("prompt_ids", "prompt_mask", "prompt_attention_mask")
"""Payload keys padded on the left (the prompt precedes the completion region)."""


def cat_rollouts(parts: Sequence[Rollout]) -> Rollout:
    """`Rollout.cat` after re-padding the left-padded prompt tensors (`LEFT_PADDED`) to one width on the left."""
    if len(parts) == 1:
        return parts[0]
    parts = list(parts)
    for key in LEFT_PADDED:
        tensors = [p.payload.get(key) for p in parts]
        if not all(isinstance(t, Tensor) and t.dim() == 2 for t in tensors):
            continue
        width = max(int(t.shape[1]) for t in tensors)  # type: ignore[union-attr]
        for i, (p, t) in enumerate(zip(parts, tensors, strict=True)):
            assert isinstance(t, Tensor)
            if t.shape[1] < width:
                pad = torch.zeros((t.shape[0], width - t.shape[1]), dtype=t.dtype, device=t.device)
                parts[i] = dataclasses.replace(p, payload={**p.payload, key: torch.cat([pad, t], dim=1)})
    return Rollout.cat(parts)


class GroupRefill:
    """Hints and replay for the all-fail groups of a round (see the module docstring)."""

    def __init__(
        self,
        *,
        hints: bool = False,
        hint_column: str | None = "hints",
        reference_column: str = "answer",
        prefix_fractions: Sequence[float] = (0.25, 0.5, 0.75),
        hint_template: str = "{prompt}\nHint: {hint}",
        replay: bool = False,
        success_threshold: float = 0.5,
        weights: Sequence[float] | None = None,
    ) -> None:
        fracs = [float(f) for f in prefix_fractions]
        if not fracs or not all(0.0 < f <= 1.0 for f in fracs):
            raise ValueError(
                f"group refill: prefix_fractions must be in (0, 1], got {list(prefix_fractions)!r}"
            )
        if "{prompt}" not in hint_template or "{hint}" not in hint_template:
            raise ValueError(
                f"group refill: hint_template must contain {{prompt}} and {{hint}}, got {hint_template!r}"
            )
        if not math.isfinite(success_threshold):
            raise ValueError(f"group refill: success_threshold must be finite, got {success_threshold!r}")
        self.hints, self.replay = bool(hints), bool(replay)
        self.hint_column, self.reference_column = hint_column, reference_column
        self.prefix_fractions, self.hint_template = fracs, hint_template
        self.success_threshold = float(success_threshold)
        self.weights = None if weights is None else [float(w) for w in weights]
        self._memory: dict[int, tuple[Rollout, float]] = {}

    # ------------------------------------------------------------------ hints
    def tiers(self, row: dict[str, Any]) -> list[str]:
        """The hints of `row`, weakest first: its ``hint_column`` or prefixes of its reference answer."""
        given = row.get(self.hint_column) if self.hint_column else None
        if given is not None:
            tiers = [given] if isinstance(given, str) else [str(h) for h in given]
            return [t for t in tiers if t]
        ref = row.get(self.reference_column)
        if ref is None:
            raise ValueError(
                f"group refill: a row has neither the hint column {self.hint_column!r} nor the reference "
                f"column {self.reference_column!r} (algorithm.group_refill.hint_column / reference_column)"
            )
        text = str(ref)
        out: list[str] = []
        for f in self.prefix_fractions:
            hint = text[: max(1, math.ceil(f * len(text) - 1e-9))]
            if hint not in out:
                out.append(hint)
        return out

    def hinted_row(self, row: dict[str, Any], hint: str) -> dict[str, Any]:
        """`row` with the hint in its prompt (no other column changes, so rollouts concatenate)."""
        return {**row, "prompt": self.hint_template.format(prompt=row["prompt"], hint=hint)}

    # ------------------------------------------------------------------ the call
    def _total(self, rewards: Tensor) -> Tensor:
        return combine_rewards(rewards.detach().cpu(), self.weights).double()

    def _success(self, total: Tensor) -> Tensor:
        return torch.nan_to_num(total, nan=-math.inf) >= self.success_threshold

    @property
    def needs_logp_old(self) -> bool:
        """Replayed samples are importance-weighted, so a run with replay scores ``logp_old``."""
        return self.replay

    def after_rewards(
        self,
        rollout: Rollout,
        rewards: Tensor,
        prompt_ids: Sequence[int],
        rows: Sequence[dict[str, Any]],
        services: Any,
    ) -> tuple[Rollout, Tensor, dict[str, float]]:
        """`refill` as a round hook (`mmalign.algorithms.round_hooks`): `services` regenerates and re-scores."""
        return self.refill(
            rollout, rewards, rollout.group, prompt_ids, rows, services.regenerate, services.current_logprobs
        )

    def refill(
        self,
        rollout: Rollout,
        rewards: Tensor,
        group: Tensor,
        prompt_ids: Sequence[int] | Tensor,
        rows: Sequence[dict[str, Any]],
        regenerate_fn: RegenerateFn,
        score_fn: ScoreFn | None = None,
    ) -> tuple[Rollout, Tensor, dict[str, float]]:
        """(rollout, rewards, metrics) with the all-fail groups hinted / given a replayed sample; the metrics
        include ``refill/reward_before``, the round's mean combined reward before the refill.

        ``rollout`` holds whole groups, each contiguous, with ``rewards`` (Float[B] or Float[B,K]) and
        ``group`` (Long[B]); ``prompt_ids[i]`` is sample i's dataset row index and ``rows[pid]`` that row.
        The result keeps the groups in order, with the same group ids and sizes (so prompt ids per sample
        are unchanged), and ``rollout.rewards`` set. ``score_fn`` is needed with ``replay``.
        """
        pids = [int(x) for x in torch.as_tensor(prompt_ids).flatten().tolist()]
        gids = [int(g) for g in torch.as_tensor(group).flatten().tolist()]
        if not len(pids) == len(gids) == len(rollout) == rewards.shape[0]:
            raise ValueError("group refill: rollout, rewards, group and prompt_ids differ in length")
        if self.replay and (score_fn is None or rollout.logp_old is None):
            raise ValueError(
                "group refill: replay needs score_fn and rollout.logp_old (the behaviour log-probs of the "
                "round; the trainer must compute logp_old when replay is on)"
            )
        total = self._total(rewards)
        success = self._success(total)
        order = list(dict.fromkeys(gids))
        members = {g: [i for i, x in enumerate(gids) if x == g] for g in order}
        metrics = {"hints/groups": 0.0, "hints/success": 0.0, "hints/tiers": 0.0, "replay/injected": 0.0}
        # the round's reward before any refill: what the policy does without hints or replayed samples
        metrics["refill/reward_before"] = float(total.nanmean()) if len(total) else float("nan")
        parts: list[Rollout] = []
        part_rewards: list[Tensor] = []
        hinted_ok = tiers_tried = 0
        fresh: dict[int, tuple[Rollout, float]] = {}
        totals = self._total(rewards)
        for g in order:
            idx = members[g]
            if any(pids[i] != pids[idx[0]] for i in idx) or idx != list(range(idx[0], idx[0] + len(idx))):
                raise ValueError(f"group refill: group {g} is not one contiguous run of one prompt")
            pid, size = pids[idx[0]], len(idx)
            part, part_r = rollout[idx], rewards[idx]
            ok = [bool(success[i]) for i in idx]
            for i in idx:  # candidates for the memory: this round's successful unhinted samples
                if bool(success[i]) and (pid not in fresh or float(totals[i]) >= fresh[pid][1]):
                    fresh[pid] = (rollout[[i]], float(totals[i]))
            if not any(ok) and self.hints:
                metrics["hints/groups"] += 1
                row = rows[pid]
                for hint in self.tiers(row):
                    tiers_tried += 1
                    new, new_r = regenerate_fn([self.hinted_row(row, hint)], size)
                    if len(new) != size:
                        raise ValueError(
                            f"group refill: regenerate_fn returned {len(new)} samples, not {size}"
                        )
                    if bool(self._success(self._total(new_r)).any()):
                        new.group = torch.full_like(new.group, g)
                        new.reward_names = list(rollout.reward_names)
                        part, part_r, ok, hinted_ok = new, new_r.to(rewards.dtype), [True], hinted_ok + 1
                        break
            if not any(ok) and self.replay and pid in self._memory:
                stored, _ = self._memory[pid]
                part = self._inject(part, stored, g, score_fn)  # type: ignore[arg-type]
                stored_r = stored.rewards if stored.rewards is not None else torch.zeros(1)
                part_r = torch.cat([part_r[:-1], stored_r.to(rewards.dtype).reshape(1, *part_r.shape[1:])])
                metrics["replay/injected"] += 1
            part.rewards = part_r
            parts.append(part)
            part_rewards.append(part_r)
        if self.replay:
            for pid, (cand, total) in fresh.items():
                if pid not in self._memory or total >= self._memory[pid][1]:
                    self._memory[pid] = (rollout_from_state(rollout_state(cand)), total)
        if any(p.logp_sampler is not None for p in parts):  # a replayed sample: the others weigh 1
            for p in parts:
                if p.logp_sampler is None and p.logp_old is not None:
                    p.logp_sampler = p.logp_old.clone()
        out = cat_rollouts(parts)
        out_rewards = torch.cat(part_rewards).to(rewards.device)
        out.rewards = out_rewards
        n_hinted = metrics["hints/groups"]
        metrics["hints/success"] = hinted_ok / n_hinted if n_hinted else 0.0
        metrics["hints/tiers"] = tiers_tried / n_hinted if n_hinted else 0.0
        metrics["replay/memory"] = float(len(self._memory))
        return out, out_rewards, metrics

    def _inject(self, part: Rollout, stored: Rollout, g: int, score_fn: ScoreFn) -> Rollout:
        """`part` with its last sample replaced by `stored`: logp_sampler = the stored behaviour log-probs,
        logp_old = the current policy's (``score_fn``); the others get logp_sampler = their logp_old."""
        if stored.logp_old is None:
            raise ValueError("group refill: a replayed sample has no behaviour log-probs (logp_old)")
        device = part.mask.device
        item = stored.to(device)
        item = dataclasses.replace(
            item,
            group=torch.full_like(item.group, g),
            logp_sampler=item.logp_old.clone(),
            advantages=None,
            logp_ref=None,
        )
        item.logp_old = torch.as_tensor(score_fn(item)).detach().to(device, item.logp_sampler.dtype)  # type: ignore[union-attr]
        keep = part[list(range(len(part) - 1))]
        assert keep.logp_old is not None
        keep.logp_sampler = keep.logp_old.clone() if keep.logp_sampler is None else keep.logp_sampler
        keep.logp_ref = None
        return cat_rollouts([keep, item])

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        ids = sorted(self._memory)
        return {
            "name": "group_refill",
            "version": 1,
            "ids": ids,
            "totals": [self._memory[i][1] for i in ids],
            "samples": [rollout_state(self._memory[i][0]) for i in ids],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("name") != "group_refill":
            raise ValueError("not a group refill state")
        self._memory = {
            int(i): (rollout_from_state(s), float(t))
            for i, t, s in zip(state["ids"], state["totals"], state["samples"], strict=True)
        }

    def memory(self) -> dict[int, tuple[Rollout, float]]:
        """The replay memory: prompt id -> (the stored one-sample rollout, its combined reward)."""
        return dict(self._memory)
