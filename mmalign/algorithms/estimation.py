"""Rewards to advantages for the configured algorithm, with what its parts declare they need.

`Estimation` holds ``algorithm.estimator`` (and its state across steps), the ``reward_transforms`` and the
advantage clamp. The estimator and the transforms declare the `EstimatorContext` fields they read
(`mmalign.algorithms.advantages.context_fields`, `mmalign.algorithms.reward_transforms.context_fields`) and the loss declares what it
reads (`LossComposer.needs`); `Estimation` fills exactly those from a round (`Round`) through the trainer's
collectives (`Collectives`), so the trainer names no algorithm. All advantages are computed on the GLOBAL batch:
N processes give the advantages of one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from mmalign.algorithms import advantages as adv_lib
from mmalign.algorithms import filters as filter_lib
from mmalign.algorithms import reward_transforms as rt_lib
from mmalign.config import GUARD_ADV_CLIP, Config
from mmalign.data.batch import Rollout
from mmalign.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["Collectives", "Estimation", "Round"]


@dataclass
class Round:
    """One sampling round: this process's `rollout` and the GLOBAL rewards, group ids, valid actions per sample
    and prompt ids (each sample's dataset row)."""

    rollout: Rollout
    rewards: Tensor
    group: Tensor
    actions: Tensor
    prompt: Tensor


class Collectives(Protocol):
    """What `Estimation` asks of the trainer (`mmalign.training.trainer.GroupTrainer` implements it)."""

    step: int

    def gather(self, x: Tensor) -> Tensor: ...

    def gather_padded(self, x: Tensor) -> Tensor: ...

    def local_slice(self, x: Tensor, n_local: int) -> Tensor: ...

    def current_logprobs(self, rollout: Rollout) -> Tensor: ...
    def current_entropy(self, rollout: Rollout) -> Tensor: ...


class Estimation:
    """The advantage side of ``algorithm`` in `cfg`, checked against the reward set's names / per-step rewards
    and the policy (`policy`: its rollout loop may give step rewards; GRPO-Guard's ratio norm sets the default
    clamp); `loss_needs`: what the loss reads (`LossComposer.needs`)."""

    def __init__(
        self,
        cfg: Config,
        reward_set: Any,
        policy: Any,
        *,
        loss_needs: frozenset[str] = frozenset(),
        main: bool = True,
    ) -> None:
        a = cfg.algorithm
        self.source, self.name, self.kwargs = cfg.source, a.estimator, dict(a.estimator_kwargs)
        self.total_steps = cfg.trainer.steps
        self.reward_names = list(reward_set.names)
        self.weights = reward_set.weights.tolist()
        self.per_step_names = list(getattr(reward_set, "per_step_names", []))
        self.estimator = adv_lib.get(a.estimator)
        self.takes_lengths = adv_lib.accepts_num_actions(a.estimator)
        """The estimator weighs samples by their number of actions (e.g. reinforce_pp over tokens)."""
        self.takes_steps = adv_lib.accepts_step_rewards(a.estimator)
        """The estimator turns per-step process rewards into Float[B,T] advantages (e.g. grpo_process)."""
        if self.per_step_names and not self.takes_steps:
            raise ConfigError(self._ignores_steps())
        # a rollout loop may write the step rewards itself (igpo: the policy's information gain per turn)
        loop_steps = bool(getattr(getattr(policy, "loop", None), "gives_step_rewards", False))
        if self.takes_steps and not self.per_step_names and not loop_steps:
            raise ConfigError(
                f"{cfg.source}: key 'algorithm.estimator': {a.estimator!r} turns per-step (process) rewards into "
                f"advantages, but no reward in 'rewards' declares per_step"
            )
        self.extra_samples = adv_lib.extra_samples(a.estimator)
        self.state = adv_lib.make_state(a.estimator)
        """What the estimator keeps across steps (spo's per-prompt tracker; None if stateless): updated from the
        global batch, saved in checkpoints."""
        self.transforms = [dict(spec) for spec in a.reward_transforms]
        try:
            rt_lib.check_specs(self.transforms, self.reward_names)
        except (TypeError, ValueError, KeyError) as e:
            raise ConfigError(f"{cfg.source}: key 'algorithm.reward_transforms': {e}") from None
        self.fields = set(adv_lib.context_fields(a.estimator)) | {
            f for spec in self.transforms for f in rt_lib.context_fields(str(spec["name"]))
        }
        """The `EstimatorContext` fields this run fills (the estimator's and the reward transforms')."""
        self.loss_needs = loss_needs
        self.policy_shift = (
            adv_lib.PolicyShiftMemory()
            if "policy_shift" in self.fields and self.kwargs.get("rho_mode", "kl") == "kl"
            else None
        )
        """SPO's KL-adaptive decay: each prompt's last response, re-scored at its next visit (policy_shift)."""
        self.adv_clip = a.adv_clip
        """The advantage clamp: ``algorithm.adv_clip``, or `GUARD_ADV_CLIP` when it is null and the policy
        scores with GRPO-Guard's RatioNorm (``options.guard_ratio_norm``), as verl-omni's GRPO-Guard loss."""
        if self.adv_clip is None and getattr(policy, "guard_ratio_norm", False):
            self.adv_clip = GUARD_ADV_CLIP
            if main:
                log.warning(
                    "algorithm.adv_clip is null and options.guard_ratio_norm is on: advantages are clamped to "
                    "[-%g, %g], as verl-omni's GRPO-Guard loss (adv_clip_max); set algorithm.adv_clip to "
                    "choose another bound",
                    GUARD_ADV_CLIP,
                    GUARD_ADV_CLIP,
                )

    def _ignores_steps(self) -> str:
        return (
            f"{self.source}: key 'algorithm.estimator': the rewards {self.per_step_names} give per-step (process) "
            f"rewards, which {self.name!r} ignores; use an estimator that takes them "
            f"({', '.join(n for n in adv_lib.names() if adv_lib.accepts_step_rewards(n))})"
        )

    def state_parts(self) -> dict[str, Any]:
        """What the estimation keeps across steps, by checkpoint name (None: not in this run): the estimator's
        state and SPO's per-prompt policy-shift memory."""
        return {"estimator": self.state, "policy_shift": self.policy_shift}

    @property
    def needs_logp_old(self) -> bool:
        """The context reads the behaviour log-probs (so the rollout must record them)."""
        return bool(self.fields & {"logp_old_mean", "logp_old_sum"}) or self.policy_shift is not None

    def context(self, rnd: Round, comm: Collectives, policy: Any) -> adv_lib.EstimatorContext | None:
        """The `EstimatorContext` of the GLOBAL batch with the fields this run needs (None if none)."""
        need = self.fields
        if not need:
            return None
        fields: dict[str, Any] = {}
        rollout, mask = rnd.rollout, rnd.rollout.mask

        def reduce(x: Tensor) -> tuple[Tensor, Tensor]:
            x = torch.where(mask, x.to(mask.device).double(), torch.zeros((), dtype=torch.float64))
            total = x.sum(dim=1)
            return comm.gather(total / mask.sum(dim=1).clamp(min=1)), comm.gather(total)

        if "prompt_ids" in need:
            fields["prompt_ids"] = rnd.prompt
        if need & {"step", "total_steps"}:
            fields["step"], fields["total_steps"] = comm.step, self.total_steps
        if "policy_shift" in need and self.policy_shift is not None:
            # this process's samples re-score their prompts' stored responses; exact with one process (with
            # several, a prompt drawn by another process than at its last visit gets D = 0)
            local = comm.local_slice(rnd.prompt, len(rollout))
            fields["policy_shift"] = comm.gather(
                self.policy_shift.shift(local, lambda item: comm.current_logprobs(item)[0]).to(mask.device)
            ).cpu()
        if "lengths" in need:
            fields["lengths"] = rnd.actions.double()
        if need & {"logp_old_mean", "logp_old_sum"}:
            fields["logp_old_mean"], fields["logp_old_sum"] = reduce(rollout.logp_old)
        if need & {"logp_ref_mean", "logp_ref_sum"}:
            if rollout.logp_ref is None:  # computed once here; the update reuses it for the KL term
                try:
                    rollout.logp_ref = policy.reference_logprobs(rollout).detach()
                except RuntimeError as e:  # the pipeline built the policy without a reference
                    raise ConfigError(
                        f"{self.source}: key 'algorithm.estimator': reading reference log-probs failed "
                        f"({e}); the pipeline must build the policy with "
                        "need_reference=mmalign.algorithms.names.needs_reference(cfg)"
                    ) from e
            fields["logp_ref_mean"], fields["logp_ref_sum"] = reduce(rollout.logp_ref)
        if "entropy_mean" in need:  # the policy's entropy on the round's actions, before this step's update
            fields["entropy_mean"], _ = reduce(comm.current_entropy(rollout))
        if "action_mask" in need:
            fields["action_mask"] = comm.gather_padded(mask.to(torch.uint8)).bool()
        if "turn_index" in need:  # padded with 0 after the +1: -1 (no action) again after the -1
            fields["turn_index"] = comm.gather_padded(adv_lib.turns_from_mask(mask) + 1) - 1
        # written by the environment into its per-sample state, under the keys "turn_states" / "turn_rewards"
        for name, key in (("turn_state", "turn_states"), ("turn_rewards", "turn_rewards")):
            if name in need:
                rows = [list(s.get(key, [])) for s in rollout.outputs.get("env_state", [{}] * len(rollout))]
                width = max([len(r) for r in rows] + [1])
                dtype = torch.long if name == "turn_state" else torch.float64
                local_rows = torch.zeros(len(rows), width, dtype=dtype)
                for i, r in enumerate(rows):
                    local_rows[i, : len(r)] = torch.tensor(r, dtype=dtype)
                fields[name] = comm.gather_padded(local_rows)
        missing = [f for f in adv_lib.required_context_fields(self.name) if f not in fields]
        if missing:
            raise ConfigError(
                f"{self.source}: key 'algorithm.estimator': {self.name!r} needs {', '.join(missing)}, which this "
                "trainer does not supply yet"
            )
        return adv_lib.EstimatorContext(**fields)

    def compute(
        self,
        rewards: Tensor,
        group: Tensor,
        num_actions: Tensor | None = None,
        step_rewards: Tensor | None = None,
        step_mask: Tensor | None = None,
        context: adv_lib.EstimatorContext | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Advantages (Float[B], or Float[B,T] from an estimator that takes step rewards) and loss-sample mask
        of the GLOBAL batch (identical on every process). `num_actions` (Long[B], valid actions per sample)
        reaches estimators that take it (`accepts_num_actions`); `step_rewards` / `step_mask` (Float[B,T] /
        Bool[B,T]) those that take process rewards (`accepts_step_rewards`)."""
        opts = dict(self.kwargs)
        if rewards.dim() == 2:
            opts.setdefault("weights", self.weights)
        if self.takes_lengths and num_actions is not None:
            opts["num_actions"] = num_actions
        if step_rewards is not None and not self.takes_steps:
            raise ConfigError(self._ignores_steps())
        if self.takes_steps:
            opts["step_rewards"], opts["step_mask"] = step_rewards, step_mask
        if adv_lib.accepts_context(self.name):
            opts["context"] = context
        if self.state is not None:
            opts["state"] = self.state
        if self.transforms:
            rewards = rt_lib.apply(
                self.transforms, rewards, group, context=context, reward_names=self.reward_names
            )
        try:
            adv = self.estimator(rewards, group, **opts)
            keep = adv_lib.loss_sample_mask(self.name, rewards, group, **opts)
        except TypeError as e:
            raise ConfigError(f"{self.source}: key 'algorithm.estimator_kwargs': {e}") from None
        return adv_lib.clip_advantages(adv, self.adv_clip), keep

    def record(self, rnd: Round, comm: Collectives) -> None:
        """After the advantages: what the declared needs keep from this round. SPO's policy shift stores each
        prompt's first sample for its next visit; a loss that reads ``group_std`` gets each sample's group reward
        std in ``rollout.outputs["group_std"]``."""
        rollout, n_local = rnd.rollout, len(rnd.rollout)
        if self.policy_shift is not None:
            local = comm.local_slice(rnd.prompt, n_local).tolist()
            first = list({x: i for i, x in reversed(list(enumerate(local)))}.values())
            self.policy_shift.record(
                [local[i] for i in first],
                [rollout[[i]] for i in first],
                rollout.logp_old[first],
                rollout.mask[first],
            )
        if "group_std" in self.loss_needs:  # etr: each sample's group reward std, for its macro trust region
            total = adv_lib.combine_rewards(rnd.rewards, self.weights)
            ids, stds = filter_lib.group_std(total, rnd.group)
            pos = {int(g): k for k, g in enumerate(ids.tolist())}
            per_sample = torch.stack([stds[pos[int(g)]] for g in rnd.group.tolist()]).double()
            rollout.outputs["group_std"] = comm.local_slice(per_sample, n_local)
