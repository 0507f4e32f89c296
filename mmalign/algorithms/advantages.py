"""Group-relative advantage estimators (see docs/algorithms.md, "Advantage estimators").

Every estimator is a plain, vectorised tensor function registered by name,
``fn(rewards, group, **options) -> Float[B]`` (``rewards`` Float[B] or Float[B, K], ``group`` Long[B] of
arbitrary group ids). NaN rewards mean "not applicable" (left out of the group statistics, advantage 0), a
group with fewer than 2 valid samples gets 0, and no estimator returns NaN or inf. Per-batch inputs
(``num_actions``, ``step_rewards`` / ``step_mask``), registry metadata (``extra_samples``,
``loss_sample_mask``), the ``context`` (:class:`EstimatorContext`) and cross-step ``state``
(:class:`EstimatorState`) are specified in docs/algorithms.md ("Advantage estimators", "Estimator context
and state").
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import math
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from mmalign.errors import MmalignError
from mmalign.registry import Registry, option_checked

Estimator = Callable[..., Tensor]
Weights = Sequence[float] | Tensor | None

REGISTRY: Registry[Estimator] = Registry("advantage estimator")

# Keyword inputs an estimator may take that are per-batch data supplied by the trainer, not config options.
_BATCH_INPUTS = frozenset({"num_actions", "step_rewards", "step_mask", "context", "state"})

# reinforce_pp: what the batch whitening runs over
_WHITEN_OVER = ("samples", "tokens")

# |A| at or below this counts as zero when mc_grpo rescales the non-zero advantages of a group
# (the reference implementation uses torch.isclose(A, 0, atol=1e-6)).
_MC_ZERO_ATOL = 1e-6


# --------------------------------------------------------------------------- estimator context


class ContextError(MmalignError, ValueError):
    """An estimator (or reward transform) lacks a context field it needs, or a field is malformed.

    The message names the estimator, the field and what supplies it (:data:`CONTEXT_FIELDS`).
    """


# name -> (shape, what it is and what fills it). Shapes: "B" one value per sample, "BT" one per action
# (columns of ``Rollout.mask``), "BK" one per turn, "BD" a feature row per sample, "int" a plain integer.
CONTEXT_FIELDS: dict[str, tuple[str, str]] = {
    "prompt_ids": (
        "B",
        "Long[B]: a prompt id stable across steps (the dataset row index of the sample's prompt)",
    ),
    "step": ("int", "int: the training step being taken (0-based, GroupTrainer.step)"),
    "total_steps": ("int", "int: the number of training steps of the run (trainer.steps)"),
    "lengths": ("B", "Float[B]: number of valid actions per sample (rollout.mask.sum(1))"),
    "action_mask": ("BT", "Bool[B,T]: the valid actions (rollout.mask)"),
    "logp_old_mean": (
        "B",
        "Float[B]: mean over valid actions of the log-prob under pi_old (rollout.logp_old)",
    ),
    "logp_old_sum": ("B", "Float[B]: sum over valid actions of the log-prob under pi_old (rollout.logp_old)"),
    "logp_ref_mean": ("B", "Float[B]: mean over valid actions of the reference log-prob (rollout.logp_ref)"),
    "logp_ref_sum": ("B", "Float[B]: sum over valid actions of the reference log-prob (rollout.logp_ref)"),
    "entropy_mean": ("B", "Float[B]: mean over valid actions of the policy entropy at rollout time"),
    "token_entropy": ("BT", "Float[B,T]: the policy entropy of every action at rollout time"),
    "policy_shift": (
        "B",
        "Float[B]: SPO's D(x): mean |log pi_now(y') - log pi_then(y')| over the tokens of the response y' "
        "drawn for this prompt at its previous visit (0 at the first visit)",
    ),
    "turn_index": (
        "BT",
        "Long[B,T]: the turn (env step) of every action, -1 where not an action (turns_from_mask)",
    ),
    "turn_state": ("BK", "Long[B,K]: a key of the environment state each turn starts from (state_key)"),
    "turn_rewards": ("BK", "Float[B,K]: the environment's reward of each turn (0 / NaN: none)"),
    "phase_index": (
        "BT",
        "Long[B,T]: the output phase of every action (e.g. 0 = candidates, 1 = ranking; -1: none), set by the "
        "pipeline",
    ),
    "features": ("BD", "Float[B,D]: an embedding of each sample (set diversity)"),
    "set_ids": ("B", "Long[B]: the candidate set of each sample inside its group (set diversity)"),
    "logp_uncond_mean": (
        "B",
        "Float[B]: mean log-prob of the answer without the query (a second scoring pass; self-aligned reward)",
    ),
}

_LONG_FIELDS = frozenset({"prompt_ids", "turn_index", "turn_state", "set_ids", "phase_index"})
_BOOL_FIELDS = frozenset({"action_mask"})


@dataclass(frozen=True)
class EstimatorContext:
    """What an estimator may need besides rewards and group ids, all of the same GLOBAL batch of B samples.

    Every field is optional (None: not supplied); an estimator declares the ones it needs at
    registration and fails with :class:`ContextError` without them. Shapes and sources are in
    :data:`CONTEXT_FIELDS`. `from_actions` fills the per-sample means and sums from per-action tensors.
    """

    prompt_ids: Tensor | None = None
    step: int | None = None
    total_steps: int | None = None
    lengths: Tensor | None = None
    action_mask: Tensor | None = None
    logp_old_mean: Tensor | None = None
    logp_old_sum: Tensor | None = None
    logp_ref_mean: Tensor | None = None
    logp_ref_sum: Tensor | None = None
    entropy_mean: Tensor | None = None
    token_entropy: Tensor | None = None
    policy_shift: Tensor | None = None
    turn_index: Tensor | None = None
    turn_state: Tensor | None = None
    turn_rewards: Tensor | None = None
    phase_index: Tensor | None = None
    features: Tensor | None = None
    set_ids: Tensor | None = None
    logp_uncond_mean: Tensor | None = None

    @classmethod
    def from_actions(
        cls,
        mask: Tensor,
        *,
        logp_old: Tensor | None = None,
        logp_ref: Tensor | None = None,
        entropy: Tensor | None = None,
        **fields: Any,
    ) -> EstimatorContext:
        """A context whose per-sample fields are reduced from per-action Float[B,T] tensors over ``mask``.

        Fills ``action_mask``, ``lengths``, ``logp_old_mean`` / ``_sum`` (from ``logp_old``),
        ``logp_ref_mean`` / ``_sum`` (from ``logp_ref``), ``entropy_mean`` and ``token_entropy`` (from
        ``entropy``); ``fields`` sets the others. Masked positions never enter (padding may be NaN).
        """
        m = torch.as_tensor(mask).bool()
        n = m.sum(dim=1).to(torch.float64)
        out: dict[str, Any] = {"action_mask": m, "lengths": n}

        def reduce(x: Tensor) -> tuple[Tensor, Tensor]:
            x = torch.as_tensor(x).to(torch.float64)
            if x.shape != m.shape:
                raise ContextError(
                    f"per-action tensor {tuple(x.shape)} does not match the mask {tuple(m.shape)}"
                )
            total = torch.where(m, x, torch.zeros_like(x)).sum(dim=1)
            return total / n.clamp(min=1), total

        if logp_old is not None:
            out["logp_old_mean"], out["logp_old_sum"] = reduce(logp_old)
        if logp_ref is not None:
            out["logp_ref_mean"], out["logp_ref_sum"] = reduce(logp_ref)
        if entropy is not None:
            out["entropy_mean"], _ = reduce(entropy)
            out["token_entropy"] = torch.as_tensor(entropy)
        out.update(fields)
        return cls(**out)

    def present(self) -> list[str]:
        """The names of the fields that are set (not None)."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def validate(self, batch_size: int | None = None) -> None:
        """Check every set field's type and shape against :data:`CONTEXT_FIELDS` (and ``batch_size``).

        Raises :class:`ContextError` naming the field.
        """
        b = batch_size
        per_action_width = None
        for name in self.present():
            value = getattr(self, name)
            shape, doc = CONTEXT_FIELDS[name]
            if shape == "int":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ContextError(
                        f"context field {name!r} must be an integer >= 0 ({doc}), got {value!r}"
                    )
                continue
            t = torch.as_tensor(value)
            want_dim = {"B": 1, "BT": 2, "BK": 2, "BD": 2}[shape]
            if t.dim() != want_dim:
                raise ContextError(f"context field {name!r} must be {doc}; got shape {tuple(t.shape)}")
            if b is None:
                b = int(t.shape[0])
            if t.shape[0] != b:
                raise ContextError(
                    f"context field {name!r} has {t.shape[0]} rows but the batch has {b} samples ({doc})"
                )
            if name in _BOOL_FIELDS:
                if t.dtype != torch.bool:
                    raise ContextError(f"context field {name!r} must be a Bool tensor ({doc}), got {t.dtype}")
            elif name in _LONG_FIELDS:
                if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                    raise ContextError(
                        f"context field {name!r} must be an integer tensor ({doc}), got {t.dtype}"
                    )
            elif not t.dtype.is_floating_point:
                raise ContextError(f"context field {name!r} must be a float tensor ({doc}), got {t.dtype}")
            if shape == "BT":
                if per_action_width is not None and t.shape[1] != per_action_width:
                    raise ContextError(
                        f"context field {name!r} has {t.shape[1]} action columns, another per-action field "
                        f"has {per_action_width}"
                    )
                per_action_width = int(t.shape[1])
        if self.total_steps == 0:
            raise ContextError("context field 'total_steps' must be >= 1")
        if self.step is not None and self.total_steps is not None and self.step > self.total_steps:
            raise ContextError(f"context step {self.step} is past total_steps {self.total_steps}")


def check_context_fields(
    name: str, context: EstimatorContext | None, needed: Sequence[str], batch_size: int | None
) -> None:
    """`ContextError` when `context` lacks one of the fields `needed` by `name`, or one is malformed."""
    if context is None:
        if needed:
            raise ContextError(
                f"estimator {name!r} needs an EstimatorContext with {', '.join(needed)}: "
                + "; ".join(f"{f} = {CONTEXT_FIELDS[f][1]}" for f in needed)
            )
        return
    if not isinstance(context, EstimatorContext):
        raise ContextError(
            f"estimator {name!r}: context must be an EstimatorContext, got {type(context).__name__}"
        )
    missing = [f for f in needed if getattr(context, f) is None]
    if missing:
        raise ContextError(
            f"estimator {name!r} needs context field(s) {', '.join(missing)}, which the context lacks: "
            + "; ".join(f"{f} = {CONTEXT_FIELDS[f][1]}" for f in missing)
        )
    context.validate(batch_size)


def require_field(name: str, context: EstimatorContext | None, field_name: str, why: str = "") -> Tensor:
    """The context field ``field_name`` as a tensor, or :class:`ContextError` (for option-dependent needs)."""
    value = None if context is None else getattr(context, field_name)
    if value is None:
        raise ContextError(
            f"estimator {name!r}{why} needs context field {field_name!r} = {CONTEXT_FIELDS[field_name][1]}"
        )
    return torch.as_tensor(value)


def turns_from_mask(mask: Tensor) -> Tensor:
    """Long[B,T] turn index of every action: runs of consecutive valid actions are turns 0, 1, ...; -1 elsewhere.

    In a ``multi_turn`` rollout the generated turns are separated by inserted (non-action) tokens, so
    each run of ``rollout.mask`` is one turn; a single-turn rollout is one turn.
    """
    m = torch.as_tensor(mask).bool()
    starts = m.clone()
    starts[:, 1:] = m[:, 1:] & ~m[:, :-1]
    idx = torch.cumsum(starts.long(), dim=1) - 1
    return torch.where(m, idx, torch.full_like(idx, -1))


def state_key(obj: Any) -> int:
    """A stable 63-bit integer key of an environment state (same on every process and every run).

    Strings are hashed as they are; other objects through ``json.dumps(obj, sort_keys=True)``. Use it to
    fill ``turn_state`` (GiGPO groups the turns that start from the same state).
    """
    text = obj if isinstance(obj, str) else json.dumps(obj, sort_keys=True, default=str)
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


# --------------------------------------------------------------------------- estimator state


class EstimatorState:
    """Base class of what a stateful estimator keeps across steps (made by :func:`make_state`).

    ``state_dict()`` returns plain numbers, strings, lists and CPU tensors (what
    ``mmalign.training.rundir.save_state`` writes without pickle); ``load_state_dict`` restores it exactly.
    """

    name = "state"

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


def _check_state(name: str, state: Any, cls: type[EstimatorState]) -> None:
    if state is None:
        raise ContextError(
            f"estimator {name!r} keeps state across steps: pass state=mmalign.algorithms.advantages.make_state({name!r}) "
            "(the trainer holds it and saves its state_dict() in checkpoints)"
        )
    if not isinstance(state, cls):
        raise ContextError(f"estimator {name!r}: state must be a {cls.__name__}, got {type(state).__name__}")


class SPOTracker(EstimatorState):
    """SPO's persistent value tracker: a Beta(alpha, beta) posterior on each prompt's success rate.

    Keyed by the stable prompt id (``context.prompt_ids``); a prompt not seen yet has the prior given
    by the estimator's options. ``visits`` counts the batches that updated a prompt. The state is a
    sorted id tensor with float64 alpha / beta and long visits (exact round trip).
    """

    name = "spo"

    def __init__(self) -> None:
        self._table: dict[int, tuple[float, float, int]] = {}

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self._table

    def posterior(
        self, prompt_id: int, prior_alpha: float = 0.5, prior_beta: float = 0.5
    ) -> tuple[float, float]:
        """(alpha, beta) of a prompt; the prior for a prompt never seen."""
        a, b, _ = self._table.get(int(prompt_id), (prior_alpha, prior_beta, 0))
        return a, b

    def p_hat(self, prompt_id: int, prior_alpha: float = 0.5, prior_beta: float = 0.5) -> float:
        """The posterior mean alpha / (alpha + beta)."""
        a, b = self.posterior(prompt_id, prior_alpha, prior_beta)
        return a / (a + b)

    def posterior_table(
        self, num_rows: int, prior_alpha: float = 0.5, prior_beta: float = 0.5
    ) -> tuple[Tensor, Tensor]:
        """Float64[num_rows] alpha and beta of prompt ids 0 .. num_rows - 1 (the prior where unseen)."""
        alpha = torch.full((num_rows,), float(prior_alpha), dtype=torch.float64)
        beta = torch.full((num_rows,), float(prior_beta), dtype=torch.float64)
        known = [(i, a, b) for i, (a, b, _) in self._table.items() if 0 <= i < num_rows]
        if known:
            idx = torch.tensor([k[0] for k in known], dtype=torch.long)
            alpha[idx] = torch.tensor([k[1] for k in known], dtype=torch.float64)
            beta[idx] = torch.tensor([k[2] for k in known], dtype=torch.float64)
        return alpha, beta

    def count_below(self, num_rows: int) -> int:
        """How many prompt ids in 0 .. num_rows - 1 the tracker holds."""
        return sum(1 for i in self._table if 0 <= i < num_rows)

    def visits(self, prompt_id: int) -> int:
        return self._table.get(int(prompt_id), (0.0, 0.0, 0))[2]

    def set(self, prompt_id: int, alpha: float, beta: float, visits: int) -> None:
        if not (alpha > 0 and beta > 0 and math.isfinite(alpha) and math.isfinite(beta)):
            raise ValueError(f"SPO tracker: alpha and beta must be finite and > 0, got {alpha!r}, {beta!r}")
        self._table[int(prompt_id)] = (float(alpha), float(beta), int(visits))

    def init_offline(self, prompt_id: int, successes: float, trials: int, rho_min: float = 0.875) -> None:
        """Initialise a prompt from ``trials`` offline samples with ``successes`` correct ones (SPO's warm start).

        N_init = 1 / (1 - rho_min); alpha = N_init (s + 0.5) / (n + 1), beta = N_init (n - s + 0.5) / (n + 1),
        as in the authors' code (verl-recipe ``spo``); n = 0 gives Beta(0.5, 0.5).
        """
        if trials < 0 or not 0 <= successes <= trials:
            raise ValueError(f"SPO tracker: need 0 <= successes <= trials, got {successes!r} / {trials!r}")
        if trials == 0:
            self.set(prompt_id, 0.5, 0.5, 0)
            return
        n_init = 1.0 / (1.0 - rho_min)
        self.set(
            prompt_id,
            n_init * (successes + 0.5) / (trials + 1),
            n_init * (trials - successes + 0.5) / (trials + 1),
            0,
        )

    def state_dict(self) -> dict[str, Any]:
        ids = sorted(self._table)
        rows = [self._table[i] for i in ids]
        return {
            "name": self.name,
            "version": 1,
            "ids": torch.tensor(ids, dtype=torch.long),
            "alpha": torch.tensor([r[0] for r in rows], dtype=torch.float64),
            "beta": torch.tensor([r[1] for r in rows], dtype=torch.float64),
            "visits": torch.tensor([r[2] for r in rows], dtype=torch.long),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("name") != self.name:
            raise ValueError(
                f"not an SPO tracker state: {type(state).__name__} named {state.get('name')!r}"
                if isinstance(state, dict)
                else f"not an SPO tracker state: {type(state).__name__}"
            )
        ids, alpha, beta, visits = (state[k].tolist() for k in ("ids", "alpha", "beta", "visits"))
        if not len(ids) == len(alpha) == len(beta) == len(visits):
            raise ValueError("SPO tracker state: ids, alpha, beta and visits differ in length")
        self._table = {int(i): (float(a), float(b), int(v)) for i, a, b, v in zip(ids, alpha, beta, visits)}


class PolicyShiftMemory:
    """SPO's D(x) for ``rho_mode="kl"``: how far the policy moved since prompt x's previous visit.

    Keeps, per prompt id, one response drawn at its last visit (an opaque ``item``, e.g. a one-sample
    `Rollout`) with its per-action log-probs then (``logp_then``, Float[T], and the valid actions
    ``mask``, Bool[T]). At the next visit

        D(x) = mean_{t valid} | log pi_now(y'_t) - log pi_then(y'_t) |

    with log pi_now from ``score(item)`` (Float[T], the current policy's per-action log-probs of the
    stored response): the mean absolute log-ratio on the old response, a sample estimate of the policy
    shift on x that the authors' tracker decays by (verl-recipe ``spo``: rho = 2^(-D / D_half)).
    (our design): one stored response per prompt (the first sample of its group at that visit) and the
    absolute value (so D >= 0). The memory is checkpointed (`state_dict`: items that are `Rollout`s as
    plain tensors), so a resumed run measures the same D as an uninterrupted one.

    The trainer calls ``shift`` BEFORE the estimator (fills ``EstimatorContext.policy_shift``) and
    ``record`` after it, on the global batch.
    """

    def __init__(self) -> None:
        self._items: dict[int, tuple[Any, Tensor, Tensor]] = {}

    def state_dict(self) -> dict[str, Any]:
        """The stored responses by prompt id (a `Rollout` item as `mmalign.data.batch.rollout_state`; any other item
        as it is, which must then be something `mmalign.training.rundir.save_state` can write)."""
        from mmalign.data.batch import Rollout, rollout_state

        ids = sorted(self._items)
        items = [self._items[i][0] for i in ids]
        return {
            "name": "policy_shift",
            "version": 1,
            "ids": ids,
            "rollout": [isinstance(it, Rollout) for it in items],
            "items": [rollout_state(it) if isinstance(it, Rollout) else it for it in items],
            "logp": [self._items[i][1] for i in ids],
            "mask": [self._items[i][2] for i in ids],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from mmalign.data.batch import rollout_from_state

        if not isinstance(state, dict) or state.get("name") != "policy_shift":
            raise ValueError("not a PolicyShiftMemory state")
        self._items = {
            int(i): (rollout_from_state(it) if is_rollout else it, logp, mask)
            for i, is_rollout, it, logp, mask in zip(
                state["ids"], state["rollout"], state["items"], state["logp"], state["mask"], strict=True
            )
        }

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self._items

    def shift(self, prompt_ids: Sequence[int] | Tensor, score: Callable[[Any], Tensor]) -> Tensor:
        """Float64[B]: D of each sample's prompt (0 for a prompt with nothing stored); ``score`` is called
        once per distinct stored prompt of the batch."""
        ids = [int(x) for x in torch.as_tensor(prompt_ids).flatten().tolist()]
        per_prompt: dict[int, float] = {}
        for x in dict.fromkeys(ids):
            if x not in self._items:
                continue
            item, then, mask = self._items[x]
            now = torch.as_tensor(score(item)).detach().to(torch.float64).flatten().cpu()
            if now.shape != then.shape:
                raise ValueError(
                    f"PolicyShiftMemory: score returned {tuple(now.shape)} log-probs for prompt {x}, "
                    f"the stored response has {tuple(then.shape)}"
                )
            n = int(mask.sum())
            gap = (now - then).abs()
            per_prompt[x] = float(gap[mask].sum()) / n if n else 0.0
        return torch.tensor([per_prompt.get(x, 0.0) for x in ids], dtype=torch.float64)

    def record(
        self, prompt_ids: Sequence[int] | Tensor, items: Sequence[Any], logp: Tensor, mask: Tensor
    ) -> None:
        """Store, for each prompt of the batch, its first sample: ``items[i]`` with ``logp[i]`` / ``mask[i]``
        (Float[B,T] / Bool[B,T]: the log-probs under the policy that drew it, detached)."""
        ids = [int(x) for x in torch.as_tensor(prompt_ids).flatten().tolist()]
        if not len(ids) == len(items) == logp.shape[0] == mask.shape[0]:
            raise ValueError("PolicyShiftMemory.record: prompt_ids, items, logp and mask differ in length")
        seen: set[int] = set()
        for i, x in enumerate(ids):
            if x in seen:
                continue
            seen.add(x)
            m = torch.as_tensor(mask[i]).bool().cpu()
            lp = torch.as_tensor(logp[i]).detach().to(torch.float64).cpu()
            self._items[x] = (items[i], torch.where(m, lp, torch.zeros_like(lp)), m)


# --------------------------------------------------------------------------- registry API


def register(
    name: str,
    *,
    context: Sequence[str] = (),
    context_optional: Sequence[str] = (),
    state: type[EstimatorState] | None = None,
    **meta: Any,
) -> Callable[[Estimator], Estimator]:
    """Decorator registering ``fn(rewards, group, **options) -> Float[B]`` under ``name``.

    The registered (and returned) function rejects unknown options with a TypeError. With
    ``step_rewards=True`` the estimator takes the keywords ``step_rewards`` and ``step_mask`` and
    returns Float[B, T] (see the module docstring). ``context`` / ``context_optional`` name the
    :class:`EstimatorContext` fields it needs / reads when present (it must then take the keyword
    ``context``); ``state`` is the class of the state object it keeps across steps (it must then take
    the keyword ``state``). Both are checked on every call (:class:`ContextError`).
    """
    needed, optional = tuple(context), tuple(context_optional)
    for field_name in needed + optional:
        if field_name not in CONTEXT_FIELDS:
            raise ValueError(f"estimator {name!r} declares an unknown context field {field_name!r}")

    def deco(fn: Estimator) -> Estimator:
        checked = option_checked(REGISTRY.kind, name, fn, n_positional=2)
        takes = set(_options_of(fn))
        if (needed or optional) and "context" not in takes:
            raise TypeError(f"estimator {name!r} declares context fields but takes no 'context' keyword")
        if state is not None and "state" not in takes:
            raise TypeError(f"estimator {name!r} declares a state class but takes no 'state' keyword")

        @functools.wraps(checked)
        def in_float64(rewards: Tensor, group: Tensor, **options: Any) -> Tensor:
            # Group statistics are taken in float64: float32 sums of equal rewards can miss the
            # mean by ~1e-8, which eps = 1e-4 would blow up into spurious advantages of ~1e-4
            # for groups whose rewards are all equal.
            r = torch.as_tensor(rewards)
            out_dtype = torch.float64 if r.dtype == torch.float64 else torch.float32
            if "context" in takes:
                check_context_fields(name, options.get("context"), needed, r.shape[0] if r.dim() else None)
            if state is not None:
                _check_state(name, options.get("state"), state)
            return checked(r.to(torch.float64), group, **options).to(out_dtype)

        return REGISTRY.register(name, context=needed, context_optional=optional, state=state, **meta)(
            in_float64
        )

    return deco


def get(name: str) -> Estimator:
    """The estimator registered under ``name`` (``RegistryError``, a KeyError, if unknown)."""
    return REGISTRY.get(name)


def names() -> list[str]:
    """Sorted names of the registered estimators."""
    return REGISTRY.names()


def describe(name: str) -> str:
    """One-line summary of an estimator (first line of its docstring)."""
    return REGISTRY.describe(name)


def options(name: str) -> dict[str, Any]:
    """The options an estimator accepts, with their defaults (for config validation).

    Per-batch inputs the trainer supplies (``num_actions``, ``step_rewards``, ``step_mask``,
    ``context``, ``state``) are not config options and are not listed.
    """
    fn = inspect.unwrap(REGISTRY.get(name))
    params = list(inspect.signature(fn).parameters.values())[2:]
    return {
        p.name: p.default
        for p in params
        if p.kind is not inspect.Parameter.VAR_KEYWORD and p.name not in _BATCH_INPUTS
    }


def accepts_num_actions(name: str) -> bool:
    """True when the estimator registered under ``name`` takes the keyword ``num_actions``.

    The trainer passes ``num_actions`` (each sample's number of valid actions) only to these
    estimators, and with the same options to :func:`loss_sample_mask`.
    """
    return "num_actions" in _options_of(REGISTRY.get(name))


def accepts_step_rewards(name: str) -> bool:
    """True when the estimator registered under ``name`` takes ``step_rewards`` and ``step_mask``.

    Registry metadata ``step_rewards=True``. The trainer passes ``step_rewards`` (Float[B, T]) and
    ``step_mask`` (Bool[B, T]) of the global batch only to these estimators, and with the same
    options to :func:`loss_sample_mask`; their result is Float[B, T].
    """
    return bool(REGISTRY.meta(name).get("step_rewards", False))


def extra_samples(name: str) -> int:
    """How many samples per prompt the rollout must draw on top of G (0 unless the estimator says so)."""
    return int(REGISTRY.meta(name).get("extra_samples", 0))


def context_fields(name: str) -> tuple[str, ...]:
    """Every :class:`EstimatorContext` field the estimator reads: the needed ones, then the optional ones.

    The trainer fills each of these it can (see :data:`CONTEXT_FIELDS` for what supplies a field) and
    passes the context only to estimators for which :func:`accepts_context` is True.
    """
    meta = REGISTRY.meta(name)
    return tuple(meta.get("context", ())) + tuple(meta.get("context_optional", ()))


def required_context_fields(name: str) -> tuple[str, ...]:
    """The :class:`EstimatorContext` fields without which the estimator raises :class:`ContextError`."""
    return tuple(REGISTRY.meta(name).get("context", ()))


def accepts_context(name: str) -> bool:
    """True when the estimator takes the keyword ``context`` (an :class:`EstimatorContext`)."""
    return "context" in _options_of(REGISTRY.get(name))


def make_state(name: str) -> EstimatorState | None:
    """A fresh state object for an estimator registered with ``state=...``; None for stateless ones.

    The trainer makes it once, passes it as ``state=`` on every call, and saves / restores it with
    ``state_dict()`` / ``load_state_dict()`` in checkpoints.
    """
    cls = REGISTRY.meta(name).get("state")
    return None if cls is None else cls()


def check_context(name: str, context: EstimatorContext | None, batch_size: int | None = None) -> None:
    """Raise :class:`ContextError` when ``context`` lacks a field the estimator needs or a field is malformed.

    The registered estimator runs this on every call; the trainer may call it once up front to fail
    before the first rollout.
    """
    check_context_fields(name, context, required_context_fields(name), batch_size)


def loss_sample_mask(name: str, rewards: Tensor, group: Tensor, **options: Any) -> Tensor:
    """Bool[B]: which samples take part in the loss (all True unless the estimator drops some).

    ``options`` are the estimator's options; unknown ones raise TypeError as for the estimator.
    """
    fn = REGISTRY.get(name)
    mask_fn = REGISTRY.meta(name).get("loss_sample_mask")
    if mask_fn is None:
        allowed = _options_of(fn)
        bad = sorted(set(options) - set(allowed))
        if bad:
            raise TypeError(
                f"{REGISTRY.kind} {name!r} got unknown option(s) {', '.join(map(repr, bad))}; "
                f"valid options: {', '.join(sorted(allowed)) or 'none'}"
            )
        r = torch.as_tensor(rewards)
        return torch.ones(r.shape[0], dtype=torch.bool, device=r.device)
    return option_checked(REGISTRY.kind, name, mask_fn, n_positional=2)(rewards, group, **options)


def _options_of(fn: Callable[..., Any]) -> list[str]:
    params = list(inspect.signature(inspect.unwrap(fn)).parameters.values())[2:]
    return [p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]


# --------------------------------------------------------------------------- public helpers


def clip_advantages(adv: Tensor, limit: float | None) -> Tensor:
    """Clamp advantages (Float[B] or Float[B, T]) to [-limit, limit]; ``None`` returns ``adv`` unchanged."""
    if limit is None:
        return adv
    if not limit > 0:
        raise ValueError(f"advantage clip limit must be > 0 or None, got {limit!r}")
    return adv.clamp(-float(limit), float(limit))


def combine_rewards(rewards: Tensor, weights: Weights = None) -> Tensor:
    """Float[B] total reward: r_i = nansum_k w_k r_{i,k}; NaN where every weighted component is NaN.

    ``rewards`` is Float[B] (returned as float, weighted by ``weights[0]`` if given) or
    Float[B, K]; ``weights`` has K entries (default all 1). Computed in float32 (float64 for
    float64 input).

    r_i is NaN ("not applicable") when every component k with w_k != 0 is NaN for sample i: a
    component of weight 0 (e.g. the column of a per-step reward, whose outcome weight is 0 in
    ``RewardSet.weights``) neither adds to the total nor makes a sample applicable. When every
    weight is 0, r_i is 0 where some component is not NaN and NaN where all are.
    """
    r = _as_float(rewards)
    if r.dim() == 1:
        r2 = r[:, None]
    elif r.dim() == 2:
        r2 = r
    else:
        raise ValueError(f"rewards must be Float[B] or Float[B, K], got shape {tuple(r.shape)}")
    w = _weights(weights, r2.shape[1], r2)
    nan = torch.isnan(r2)
    total = torch.where(nan, torch.zeros_like(r2), r2 * w).sum(dim=1)
    weighted = w != 0
    absent = (nan | ~weighted).all(dim=1) if bool(weighted.any()) else nan.all(dim=1)
    return torch.where(absent, torch.full_like(total, float("nan")), total)


# --------------------------------------------------------------------------- internals


def _as_float(x: Tensor) -> Tensor:
    x = torch.as_tensor(x)
    return x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)


def _weights(weights: Weights, k: int, like: Tensor) -> Tensor:
    if weights is None:
        return torch.ones(k, dtype=like.dtype, device=like.device)
    w = torch.as_tensor(weights, dtype=like.dtype, device=like.device).reshape(-1)
    if w.numel() != k:
        raise ValueError(f"weights has {w.numel()} entries but rewards have {k} component(s)")
    if not torch.isfinite(w).all():
        raise ValueError("weights must be finite")
    return w


def group_index(group: Tensor, batch: int, device: torch.device) -> tuple[Tensor, int]:
    """Map arbitrary group ids to 0..G-1 (ordered by id); returns (gid Long[B], G)."""
    g = torch.as_tensor(group, device=device)
    if g.dim() != 1 or g.shape[0] != batch:
        raise ValueError(f"group must be Long[B] with B={batch}, got shape {tuple(g.shape)}")
    if g.dtype.is_floating_point or g.dtype.is_complex or g.dtype == torch.bool:
        raise TypeError(f"group ids must be an integer tensor, got {g.dtype}")
    uniq, gid = torch.unique(g, return_inverse=True)
    return gid, int(uniq.numel())


def _prepare(rewards: Tensor, group: Tensor, weights: Weights) -> tuple[Tensor, Tensor, Tensor, int]:
    """Combined reward r Float[B], valid Bool[B], gid Long[B], number of groups G."""
    r = combine_rewards(rewards, weights)
    gid, n_groups = group_index(group, r.shape[0], r.device)
    return r, torch.isfinite(r), gid, n_groups


def _seg_sum(x: Tensor, gid: Tensor, n_groups: int) -> Tensor:
    """Per-group sums of x (Float[B] or Float[B, K]) -> Float[G] or Float[G, K]."""
    out = torch.zeros((n_groups, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out.index_add_(0, gid, x)


def _group_stats(r: Tensor, valid: Tensor, gid: Tensor, n_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per group over valid samples: count n, mean, unbiased std (0 where n < 2). Works for [B] or [B, K]."""
    zero = torch.zeros_like(r)
    n = _seg_sum(valid.to(r.dtype), gid, n_groups)
    mean = _seg_sum(torch.where(valid, r, zero), gid, n_groups) / n.clamp(min=1)
    # a group whose valid rewards are all equal gets its mean exactly (no rounding residue)
    idx = gid.view(-1, *([1] * (r.dim() - 1))).expand_as(r)
    shape = (n_groups, *r.shape[1:])
    gmax = torch.full(shape, float("-inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, idx, torch.where(valid, r, torch.full_like(r, float("-inf"))), reduce="amax"
    )
    gmin = torch.full(shape, float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, idx, torch.where(valid, r, torch.full_like(r, float("inf"))), reduce="amin"
    )
    mean = torch.where((gmax == gmin) & (n > 0), gmax, mean)
    dev = torch.where(valid, r - mean[gid], zero)
    var = _seg_sum(dev * dev, gid, n_groups) / (n - 1).clamp(min=1)
    return n, mean, var.sqrt()


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """num / den where den > 0, else 0 (never NaN/inf from a zero denominator)."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def _whiten(x: Tensor, sel: Tensor, eps: float, count: Tensor | None = None) -> Tensor:
    """(x - mean) / (std + eps) over the selected entries (unbiased std); 0 elsewhere or if < 2 selected.

    With ``count`` (Float[B], >= 0) entry i counts ``count_i`` times, as if repeated once per action:
    N = sum_sel count_i, mean = sum_sel count_i x_i / N, var = sum_sel count_i (x_i - mean)^2 / (N - 1);
    entries with count 0 get 0, and everything is 0 when N < 2.
    """
    zero = torch.zeros_like(x)
    if count is None:
        cnt = sel.sum().to(x.dtype)
        mu = torch.where(sel, x, zero).sum() / cnt.clamp(min=1)
        dev = torch.where(sel, x - mu, zero)
        sd = ((dev * dev).sum() / (cnt - 1).clamp(min=1)).sqrt()
    else:
        w = torch.where(sel, count, zero)
        sel = sel & (w > 0)
        cnt = w.sum()
        mu = (w * x).sum() / cnt.clamp(min=1)
        dev = torch.where(sel, x - mu, zero)
        sd = ((w * dev * dev).sum() / (cnt - 1).clamp(min=1)).sqrt()
    out = _safe_div(x - mu, (sd + eps).expand_as(x))
    return torch.where(sel & (cnt >= 2), out, zero)


def _group_lower_median(x: Tensor, sel: Tensor, gid: Tensor, n_groups: int) -> tuple[Tensor, Tensor]:
    """Per-group lower median of the selected entries: the ((n-1)//2)-th order statistic.

    Returns (median Float[G] (0 for groups with no selected entry), n Long[G]). Vectorised: one
    stable sort by value, then a stable sort by group, so each group is a contiguous sorted run.
    """
    key = torch.where(sel, x, torch.full_like(x, float("inf")))  # unselected sort last in their group
    by_value = torch.argsort(key, stable=True)
    order = by_value[torch.argsort(gid[by_value], stable=True)]
    size = torch.bincount(gid, minlength=n_groups)
    start = torch.cumsum(size, 0) - size
    n = _seg_sum(sel.long(), gid, n_groups)
    pos = start + (n - 1).clamp(min=0) // 2
    med = key[order][pos]
    return torch.where(n > 0, med, torch.zeros_like(med)), n


def _num_actions(name: str, num_actions: Tensor | Sequence[float], like: Tensor) -> Tensor:
    """Validated per-sample action counts as Float[B] in ``like``'s dtype and device."""
    n = torch.as_tensor(num_actions, device=like.device)
    if n.dtype == torch.bool or n.dtype.is_complex:
        raise ValueError(f"{name}: num_actions must be a Long or Float tensor of counts, got {n.dtype}")
    if n.dim() != 1 or n.shape[0] != like.shape[0]:
        raise ValueError(
            f"{name}: num_actions must be Long/Float[B] with B={like.shape[0]} (one count per sample), "
            f"got shape {tuple(n.shape)}"
        )
    n = n.to(like.dtype)
    if not torch.isfinite(n).all():
        raise ValueError(f"{name}: num_actions must be finite")
    if (n < 0).any():
        raise ValueError(
            f"{name}: num_actions must be >= 0 (counts of valid actions), got {n.min().item()!r}"
        )
    return n


def _check_eps(name: str, eps: float) -> float:
    if not eps >= 0:
        raise ValueError(f"{name}: eps must be >= 0, got {eps!r}")
    return float(eps)


# --------------------------------------------------------------------------- estimators


StdMode = Literal["group", "batch", "none"]
"""How ``grpo`` scales the centred rewards: by the group's std, the batch's, or not at all."""


@register("grpo")
def grpo(
    rewards: Tensor, group: Tensor, *, weights: Weights = None, std: StdMode = "group", eps: float = 1e-4
) -> Tensor:
    """GRPO: A_i = (r_i - mean_g r) / (std + eps), std per group (unbiased), over the batch, or none.

    ``std="group"`` (default): unbiased std of the group; ``"batch"``: unbiased std of all valid
    rewards in the batch (the mean stays per group); ``"none"``: no division.
    """
    if std not in ("group", "batch", "none"):
        raise ValueError(f"grpo: std must be 'group', 'batch' or 'none', got {std!r}")
    eps = _check_eps("grpo", eps)
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    n, mean, sd = _group_stats(r, valid, gid, n_groups)
    eligible = valid & (n[gid] >= 2)
    centered = torch.where(eligible, r - mean[gid], torch.zeros_like(r))
    if std == "group":
        adv = _safe_div(centered, sd[gid] + eps)
    elif std == "batch":
        _, _, batch_sd = _group_stats(r, valid, torch.zeros_like(gid), 1)
        adv = _safe_div(centered, (batch_sd + eps).expand_as(r))
    else:
        adv = centered
    return torch.where(eligible, adv, torch.zeros_like(adv))


@register("dr_grpo")
def dr_grpo(rewards: Tensor, group: Tensor, *, weights: Weights = None) -> Tensor:
    """Dr. GRPO: A_i = r_i - mean_g r, no std division (pair with aggregation ``seq_sum_norm``)."""
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    n, mean, _ = _group_stats(r, valid, gid, n_groups)
    eligible = valid & (n[gid] >= 2)
    return torch.where(eligible, r - mean[gid], torch.zeros_like(r))


@register("rloo")
def rloo(rewards: Tensor, group: Tensor, *, weights: Weights = None) -> Tensor:
    """RLOO: A_i = r_i - mean of the other valid samples of the group, (1/(n-1)) sum_{j!=i} r_j."""
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    n, mean, _ = _group_stats(r, valid, gid, n_groups)
    ng = n[gid]
    eligible = valid & (ng >= 2)
    # r_i - (S - r_i)/(n-1) = n/(n-1) * (r_i - mean)
    adv = ng / (ng - 1).clamp(min=1) * (r - mean[gid])
    return torch.where(eligible, adv, torch.zeros_like(r))


@register("reinforce_pp")
def reinforce_pp(
    rewards: Tensor,
    group: Tensor,
    *,
    weights: Weights = None,
    eps: float = 1e-4,
    whiten_over: str = "samples",
    num_actions: Tensor | None = None,
) -> Tensor:
    """REINFORCE++ (baseline): whiten over the batch the group-centred rewards r_i - mean_g r.

    x_i = r_i - mean_g r for the eligible samples E: valid reward and >= 2 valid samples in the group
    (mean_g over the group's valid samples). Every other sample gets 0. Then, over E:

    - ``whiten_over="samples"`` (default): each sample counts once. With M = |E|,
      mu = sum_E x_i / M, var = sum_E (x_i - mu)^2 / (M - 1), A_i = (x_i - mu) / (sqrt(var) + eps);
      all 0 when M < 2.
    - ``whiten_over="tokens"`` (verl's REINFORCE++-baseline): each sample counts once per valid
      action, so longer answers weigh more in the mean and the variance. Needs ``num_actions``
      (Long/Float[B], n_i >= 0; the trainer passes it). With N = sum_E n_i,
      mu = sum_E n_i x_i / N, var = sum_E n_i (x_i - mu)^2 / (N - 1) (Bessel over the action
      count), A_i = (x_i - mu) / (sqrt(var) + eps); samples with n_i = 0 get 0 (they still enter
      their group's mean), and all are 0 when N < 2. The result is still Float[B]: A_i is the
      constant advantage of every action of sample i, as in verl's per-token tensor.

    Differences from verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage``: the
    division is by sqrt(var) + eps (the convention of every estimator here) instead of
    rsqrt(var + 1e-8), and singleton / NaN-reward samples get 0 and stay out of the statistics
    (verl keeps a singleton group's raw score and counts its tokens). With all n_i = n the two modes
    differ only in the Bessel factor: for eps = 0, A_tokens = A_samples * sqrt((n M - 1) / (n (M - 1))).

    ``num_actions`` is validated (shape [B], finite, >= 0) whenever given, and ignored by
    ``whiten_over="samples"``.
    """
    eps = _check_eps("reinforce_pp", eps)
    if whiten_over not in _WHITEN_OVER:
        raise ValueError(
            f"reinforce_pp: whiten_over must be {' or '.join(map(repr, _WHITEN_OVER))}, got {whiten_over!r}"
        )
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    count = None if num_actions is None else _num_actions("reinforce_pp", num_actions, r)
    if whiten_over == "tokens" and count is None:
        raise ValueError(
            "reinforce_pp with whiten_over='tokens' needs num_actions (each sample's number of valid "
            "actions); the trainer passes it"
        )
    n, mean, _ = _group_stats(r, valid, gid, n_groups)
    eligible = valid & (n[gid] >= 2)
    x = torch.where(eligible, r - mean[gid], torch.zeros_like(r))
    return _whiten(x, eligible, eps, count if whiten_over == "tokens" else None)


@register("gdpo")
def gdpo(rewards: Tensor, group: Tensor, *, weights: Weights = None, eps: float = 1e-4) -> Tensor:
    """GDPO: normalise each reward component within its group, weighted-sum them, then whiten over the batch.

    A_hat_{i,k} = (r_{i,k} - mean_g r_{.,k}) / (std_g r_{.,k} + eps) over the samples whose component
    k is not NaN (a NaN component contributes 0 to its sample's sum; a component with < 2 valid
    values in a group contributes 0); A_pre_i = sum_k w_k A_hat_{i,k}; A = (A_pre - mean) /
    (std + eps) over the batch's valid samples in groups with >= 2 valid samples (unbiased stds).
    """
    eps = _check_eps("gdpo", eps)
    r2 = _as_float(rewards)
    if r2.dim() == 1:
        r2 = r2[:, None]
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    w = _weights(weights, r2.shape[1], r2)
    comp_valid = torch.isfinite(r2) & valid[:, None]
    n_k, mean_k, sd_k = _group_stats(r2, comp_valid, gid, n_groups)
    comp_ok = comp_valid & (n_k[gid] >= 2)
    centered = torch.where(comp_ok, r2 - mean_k[gid], torch.zeros_like(r2))
    a_hat = torch.where(comp_ok, _safe_div(centered, sd_k[gid] + eps), torch.zeros_like(r2))
    a_pre = (a_hat * w).sum(dim=1)
    n, _, _ = _group_stats(r, valid, gid, n_groups)
    eligible = valid & (n[gid] >= 2)
    return _whiten(a_pre, eligible, eps)


def _mc_grpo_core(rewards: Tensor, group: Tensor, weights: Weights, mad_eps: float) -> tuple[Tensor, Tensor]:
    """Shared by mc_grpo and its loss mask: (advantages Float[B], keep Bool[B])."""
    if not mad_eps > 0:
        raise ValueError(f"mc_grpo: mad_eps must be > 0, got {mad_eps!r}")
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    batch = r.shape[0]
    zero = torch.zeros_like(r)
    med, n = _group_lower_median(r, valid, gid, n_groups)
    dev = torch.where(valid, (r - med[gid]).abs(), zero)
    mad, _ = _group_lower_median(dev, valid, gid, n_groups)
    mad = mad + mad_eps
    ng = n[gid]
    eligible = valid & (ng >= 2)
    adv = torch.where(eligible, (r - med[gid]) / mad[gid], zero)
    # rescale the non-zero advantages of each group by (#valid samples) / (#non-zero advantages)
    nonzero = adv.abs() > _MC_ZERO_ATOL
    nnz = _seg_sum(nonzero.long(), gid, n_groups)
    scale = n.to(r.dtype) / nnz.clamp(min=1).to(r.dtype)
    adv = torch.where(nonzero, adv * scale[gid], adv)
    # pivot: lowest-index valid sample whose reward equals the median; for a group without valid
    # samples, its lowest-index sample (so that every group drops exactly one sample)
    idx = torch.arange(batch, device=r.device)
    sentinel = torch.full((n_groups,), batch, dtype=torch.long, device=r.device)
    at_median = valid & (r == med[gid])
    pivot = sentinel.scatter_reduce(0, gid, torch.where(at_median, idx, batch), "amin")
    first = sentinel.scatter_reduce(0, gid, idx, "amin")
    pivot = torch.where(pivot == batch, first, pivot)
    keep = torch.ones(batch, dtype=torch.bool, device=r.device)
    keep[pivot] = False
    return adv, keep


def _mc_grpo_loss_mask(
    rewards: Tensor, group: Tensor, *, weights: Weights = None, mad_eps: float = 1e-3
) -> Tensor:
    """Bool[B]: False for the one pivot (median) sample of each group, True elsewhere."""
    return _mc_grpo_core(rewards, group, weights, mad_eps)[1]


@register("mc_grpo", extra_samples=1, loss_sample_mask=_mc_grpo_loss_mask)
def mc_grpo(rewards: Tensor, group: Tensor, *, weights: Weights = None, mad_eps: float = 1e-3) -> Tensor:
    """MC-GRPO: median-centred, MAD-scaled advantages on G+1 samples; the median (pivot) sample is dropped.

    Per group, over its n valid samples (normally n = G+1, odd):
    m = median r; MAD = median |r - m| + mad_eps (1e-3); A_i = (r_i - m) / MAD; then every
    non-zero advantage (|A| > 1e-6) is multiplied by n / #non-zero, i.e. (G+1)/#non-zero for a
    full group. The pivot, exactly one sample per group, is excluded from the loss via the
    registry metadata ``loss_sample_mask`` (see :func:`loss_sample_mask`); the rollout draws
    ``extra_samples=1`` sample per prompt on top of G.

    Details (as in the authors' code, lotusroot-kim/MC-GRPO, which uses ``torch.median``):

    - "median" is the LOWER median, the ((n-1)//2)-th smallest value. For odd n it is the usual
      median; for even n it is the smaller of the two middle values (not their average), so the
      median is always an actual sample's reward and the pivot has advantage exactly 0. The MAD
      uses the lower median too.
    - The rescale counts the pivot among the n samples (n / #non-zero, computed before the pivot
      is dropped), as the reference code does. Samples tied with the median also have A = 0 and
      stay in the loss with zero advantage.
    - The pivot is the lowest-index sample whose reward equals the median. A group with no valid
      sample drops its lowest-index sample; all its advantages are 0.
    - NaN-reward samples and groups with < 2 valid samples get 0 (the shared convention).
    - With binary rewards the MAD is usually 0, so MAD = mad_eps and |A| is ~1/mad_eps (1000) times
      the rescale: faithful to the reference (Adam is nearly invariant to that global scale), but
      consider ``adv_clip`` or a larger ``mad_eps`` with other optimizers.
    """
    return _mc_grpo_core(rewards, group, weights, mad_eps)[0]


@register("ngrpo")
def ngrpo(
    rewards: Tensor,
    group: Tensor,
    *,
    weights: Weights = None,
    k: int = 1,
    r_max: float = 1.0,
    eps: float = 1e-6,
) -> Tensor:
    """NGRPO: GRPO statistics over the group plus k virtual samples of reward r_max (all-wrong groups < 0).

    mu' and sigma' are the mean and unbiased std of the n valid rewards together with k copies of
    ``r_max`` (as ``torch.std`` in the authors' code); A_i = (r_i - mu') / (sigma' + eps), eps = 1e-6.
    Pair with asymmetric clipping (eps_low 0.16, eps_high 0.24). Groups with < 2 real valid
    samples still get 0, like every estimator here.
    """
    if isinstance(k, bool) or int(k) != k or k < 0:
        raise ValueError(f"ngrpo: k must be an integer >= 0, got {k!r}")
    eps = _check_eps("ngrpo", eps)
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    zero = torch.zeros_like(r)
    n = _seg_sum(valid.to(r.dtype), gid, n_groups)
    total = _seg_sum(torch.where(valid, r, zero), gid, n_groups)
    n_aug = n + k
    mean = (total + k * r_max) / n_aug.clamp(min=1)
    dev = torch.where(valid, r - mean[gid], zero)
    ss = _seg_sum(dev * dev, gid, n_groups) + k * (r_max - mean) ** 2
    sd = (ss / (n_aug - 1).clamp(min=1)).sqrt()
    eligible = valid & (n[gid] >= 2)
    adv = _safe_div(r - mean[gid], sd[gid] + eps)
    return torch.where(eligible, adv, zero)


@register("pass_at_k")
def pass_at_k(
    rewards: Tensor, group: Tensor, *, weights: Weights = None, normalize: bool = False, eps: float = 1e-4
) -> Tensor:
    """Pass@k: only the group's best sample gets (its reward - the second-best reward); all others get 0.

    If the two best rewards of a group are equal (a tie for first) every sample of the group gets
    0. ``normalize=True`` divides by the group's unbiased std + eps.
    """
    eps = _check_eps("pass_at_k", eps)
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    zero = torch.zeros_like(r)
    neg_inf = torch.full_like(r, float("-inf"))
    init = torch.full((n_groups,), float("-inf"), dtype=r.dtype, device=r.device)
    top = init.scatter_reduce(0, gid, torch.where(valid, r, neg_inf), "amax")
    at_top = valid & (r == top[gid])
    n_top = _seg_sum(at_top.long(), gid, n_groups)
    second = init.scatter_reduce(0, gid, torch.where(valid & ~at_top, r, neg_inf), "amax")
    n, _, sd = _group_stats(r, valid, gid, n_groups)
    best = at_top & (n_top[gid] == 1) & (n[gid] >= 2)
    gap = torch.where(best, top[gid] - torch.where(best, second[gid], zero), zero)
    if normalize:
        gap = _safe_div(gap, sd[gid] + eps)
    return torch.where(best, gap, zero)


@register("a_grae", context_optional=("step", "total_steps"))
def a_grae(
    rewards: Tensor,
    group: Tensor,
    *,
    context: EstimatorContext | None = None,
    weights: Weights = None,
    progress: float | None = None,
    beta_pos_start: float = 0.6,
    beta_pos_end: float = 0.9,
    difficulty_strength: float = 0.5,
    eps: float = 1e-4,
) -> Tensor:
    """A-GRAE (our design from the paper's description): GRPO, damped positives, easy->hard group weights.

    Our design from the description in "Unveiling Implicit Advantage Symmetry" (A-GRAE); the paper's
    exact schedule is not reproduced. With p in [0, 1] the fraction of training done: the option
    ``progress`` when set, else ``context.step / context.total_steps`` (clamped to [0, 1]) when the
    context has both, else 0:

    1. A = grpo advantages (group std, ``eps``).
    2. Asymmetric suppression: positive advantages are multiplied by
       beta_pos(p) = beta_pos_start + (beta_pos_end - beta_pos_start) * p (each in (0, 1]).
    3. Difficulty weight per group: e_g = the group's mean valid reward, min-max normalised over the
       groups of the batch that have >= 2 valid samples (e_g = 0.5 when they all have the same mean);
       e_g = 1 is the easiest group. w_g = 1 + s * (1 - 2p) * (2 e_g - 1), s = ``difficulty_strength``
       in [0, 1]: at p = 0 easy groups weigh 1 + s and hard ones 1 - s, at p = 0.5 all weigh 1,
       at p = 1 hard groups weigh 1 + s and easy ones 1 - s.

    A_i = w_g * (beta_pos(p) if A_i > 0 else 1) * A_i.
    """
    if progress is None:
        progress = _training_progress(context)
    if not 0.0 <= progress <= 1.0:
        raise ValueError(f"a_grae: progress must be in [0, 1], got {progress!r}")
    for label, beta in (("beta_pos_start", beta_pos_start), ("beta_pos_end", beta_pos_end)):
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"a_grae: {label} must be in (0, 1], got {beta!r}")
    if not 0.0 <= difficulty_strength <= 1.0:
        raise ValueError(f"a_grae: difficulty_strength must be in [0, 1], got {difficulty_strength!r}")
    base = grpo(rewards, group, weights=weights, std="group", eps=eps)
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    n, mean, _ = _group_stats(r, valid, gid, n_groups)
    ok = n >= 2
    inf = torch.full_like(mean, float("inf"))
    sentinel = mean.new_full((1,), float("inf"))  # keeps min/max defined for an empty batch
    lo = torch.cat([torch.where(ok, mean, inf), sentinel]).min()
    hi = torch.cat([torch.where(ok, mean, -inf), -sentinel]).max()
    span = hi - lo
    has_span = ok.any() & (span > 0)
    easiness = torch.where(has_span, (mean - lo) / torch.where(has_span, span, torch.ones_like(span)), 0.5)
    easiness = torch.where(ok, easiness, torch.full_like(easiness, 0.5))
    weight = 1.0 + difficulty_strength * (1.0 - 2.0 * progress) * (2.0 * easiness - 1.0)
    beta_pos = beta_pos_start + (beta_pos_end - beta_pos_start) * progress
    adv = torch.where(base > 0, base * beta_pos, base) * weight[gid]
    return torch.where(valid & (n[gid] >= 2), adv, torch.zeros_like(adv))


def _training_progress(context: EstimatorContext | None) -> float:
    """step / total_steps of the context clamped to [0, 1]; 0 without both (or with total_steps 0)."""
    if context is None or context.step is None or not context.total_steps:
        return 0.0
    return min(1.0, max(0.0, context.step / context.total_steps))


def _step_inputs(
    name: str, step_rewards: Tensor | None, step_mask: Tensor | None, like: Tensor
) -> tuple[Tensor, Tensor]:
    """Validated (step rewards Float[B, T] in ``like``'s dtype and device, step mask Bool[B, T])."""
    if step_rewards is None:
        raise ValueError(f"{name} needs step rewards: no reward in the config declares per_step")
    batch = like.shape[0]
    s = torch.as_tensor(step_rewards, device=like.device)
    if s.dtype == torch.bool or s.dtype.is_complex:
        raise ValueError(f"{name}: step_rewards must be a real Float[B, T] tensor, got {s.dtype}")
    if s.dim() != 2 or s.shape[0] != batch:
        raise ValueError(
            f"{name}: step_rewards must be Float[B, T] with B={batch} (one row per sample), "
            f"got shape {tuple(s.shape)}"
        )
    if step_mask is None:
        raise ValueError(
            f"{name} needs step_mask (Bool[B, T], rollout.mask: the valid actions) with step_rewards"
        )
    m = torch.as_tensor(step_mask, device=like.device)
    if m.dtype.is_floating_point or m.dtype.is_complex:
        raise ValueError(f"{name}: step_mask must be a Bool[B, T] tensor, got {m.dtype}")
    if m.shape != s.shape:
        raise ValueError(
            f"{name}: step_mask {tuple(m.shape)} and step_rewards {tuple(s.shape)} differ in shape"
        )
    return s.to(like.dtype), m.bool()


@register("grpo_process", step_rewards=True)
def grpo_process(
    rewards: Tensor,
    group: Tensor,
    *,
    step_rewards: Tensor | None = None,
    step_mask: Tensor | None = None,
    weights: Weights = None,
    std: StdMode = "group",
    eps: float = 1e-4,
    process_coef: float = 1.0,
) -> Tensor:
    """Dual-reward GRPO: outcome GRPO advantage + process_coef * step reward z-scored per (group, step).

    Returns Float[B, T], one advantage per action. With s = ``step_rewards`` (Float[B, T], the
    weighted process rewards), M = ``step_mask`` (Bool[B, T]) and c = ``process_coef`` (1.0):

        A_{i,t} = A^out_i + c * A^proc_{i,t}    where M_{i,t}, and 0 where M_{i,t} is False

    - A^out_i is exactly ``grpo`` on the outcome rewards (``weights``, ``std``, ``eps`` as there:
      (r_i - mean_g r) / (unbiased std_g + eps) by default), the same for every action of sample i;
      0 for a NaN outcome reward or a group with < 2 valid outcome rewards.
    - A^proc_{i,t} = (s_{i,t} - mean_{g,t}) / (sd_{g,t} + eps): mean_{g,t} and sd_{g,t} are the mean
      and unbiased std of s_{j,t} over the samples j of i's group g that are valid at step t
      (M_{j,t} True and s_{j,t} finite). A^proc is 0 where s_{i,t} is not valid, and for a
      (group, step) cell with fewer than 2 valid samples or zero std.

    Source of the idea: the Dual-Reward GRPO of Euphonium (Zhong et al., "Euphonium: Steering Video
    Flow Matching via Process Reward Gradient Guided Stochastic Dynamics", arXiv:2602.04928): an
    outcome advantage normalised per group plus a process advantage normalised per group and
    denoising step. (our design): the unbiased std and the eps (those of ``grpo``; ``std`` applies
    to the outcome part only), the coefficient c, and the handling of masked / non-finite cells and
    small cells. Step t is the column index of the action tensors: for text the token position; for
    diffusion the t-th trained step of each sample, which is the same denoising timestep for every
    sample only when all samples train the same steps (``window_size`` windows or all steps, not
    ``train_fraction`` < 1).

    Raises ValueError without ``step_rewards`` (no reward in the config declares ``per_step``) or
    without ``step_mask``.
    """
    eps = _check_eps("grpo_process", eps)
    if not math.isfinite(process_coef) or process_coef < 0:
        raise ValueError(f"grpo_process: process_coef must be a finite number >= 0, got {process_coef!r}")
    r = _as_float(rewards)
    s, m = _step_inputs("grpo_process", step_rewards, step_mask, r)
    outcome = grpo(r, group, weights=weights, std=std, eps=eps).to(s.dtype)
    gid, n_groups = group_index(group, r.shape[0], r.device)
    valid = m & torch.isfinite(s)
    zero = torch.zeros_like(s)
    s0 = torch.where(valid, s, zero)
    n, mean, sd = _group_stats(s0, valid, gid, n_groups)  # per (group, step): Float[G, T]
    ok = valid & (n[gid] >= 2)
    proc = torch.where(ok, _safe_div(s0 - mean[gid], sd[gid] + eps), zero)
    adv = outcome[:, None] + float(process_coef) * proc
    return torch.where(m, adv, zero)


# --------------------------------------------------------------------------- estimators with a context

_RHO_MODES = ("kl", "constant")
_GIGPO_MODES = ("mean_std_norm", "mean_norm")
_CANON_METRICS = ("entropy", "length")


def _check_unit(name: str, key: str, value: float, *, low_open: bool = False) -> float:
    ok = (0.0 < value <= 1.0) if low_open else (0.0 <= value <= 1.0)
    if not (math.isfinite(value) and ok):
        raise ValueError(f"{name}: {key} must be in {'(0, 1]' if low_open else '[0, 1]'}, got {value!r}")
    return float(value)


@register("spo", context=("prompt_ids",), context_optional=("policy_shift",), state=SPOTracker)
def spo(
    rewards: Tensor,
    group: Tensor,
    *,
    context: EstimatorContext | None = None,
    state: SPOTracker | None = None,
    weights: Weights = None,
    rho_mode: str = "kl",
    rho: float = 0.96,
    rho_min: float = 0.875,
    rho_max: float = 0.96,
    d_half: float = 0.06,
    prior_alpha: float = 0.5,
    prior_beta: float = 0.5,
    normalize: bool = True,
    eps: float = 1e-8,
) -> Tensor:
    """SPO (Single-stream Policy Optimization): A_i = r_i - p_hat(x_i), z-scored over the batch; no group baseline.

    Xu & Ding, "Single-stream Policy Optimization" (arXiv:2509.13232); checked against the authors' code
    (volcengine verl-recipe ``spo``). A persistent tracker (``state``, an :class:`SPOTracker`) holds a
    Beta(alpha, beta) per prompt (``context.prompt_ids``); p_hat = alpha / (alpha + beta) read BEFORE this
    batch's update (prior Beta(prior_alpha, prior_beta) = Beta(0.5, 0.5) for an unseen prompt).

    1. A_i = r_i - p_hat(x_i) for every valid sample; with ``normalize`` (default) A is z-scored over the
       valid samples of the whole batch: (A - mean) / (unbiased std + eps), eps = 1e-8 (all 0 when fewer
       than 2 valid samples). Group ids play no part: groups of one sample are fine.
    2. Then, per prompt x of the batch: alpha <- rho_x alpha + sum_i r~_i, beta <- rho_x beta + sum_i
       (1 - r~_i) over its valid samples, with r~ = r clamped to [0, 1].
       ``rho_mode="kl"`` (paper): rho_x = clip(2^(-D(x) / d_half), rho_min, rho_max) with D(x) =
       ``context.policy_shift`` (the policy's change since the prompt's previous visit, measured on the
       response drawn then; the mean over x's samples), d_half = 0.06, [rho_min, rho_max] = [0.875, 0.96];
       a prompt never updated before (visits 0) has D = 0, so rho = rho_max. ``rho_mode="constant"``:
       rho_x = ``rho``.

    (our design) for G > 1 samples of a prompt in one batch: one update with all of them (G Bernoulli
    trials, one decay); the reference draws one sample per prompt, where the two agree. NaN rewards get
    A = 0 and do not update the tracker. The state is updated from the batch given (the GLOBAL batch in
    the trainer), so every process keeps the same tracker. Pair with the ``spo`` prompt sampler
    (sampling weight sqrt(p_hat (1 - p_hat)) + 0.05, read from the same tracker).
    """
    if rho_mode not in _RHO_MODES:
        raise ValueError(f"spo: rho_mode must be {' or '.join(map(repr, _RHO_MODES))}, got {rho_mode!r}")
    rho = _check_unit("spo", "rho", rho, low_open=True)
    rho_min = _check_unit("spo", "rho_min", rho_min, low_open=True)
    rho_max = _check_unit("spo", "rho_max", rho_max, low_open=True)
    if rho_min > rho_max:
        raise ValueError(f"spo: rho_min {rho_min!r} must be <= rho_max {rho_max!r}")
    if not (math.isfinite(d_half) and d_half > 0):
        raise ValueError(f"spo: d_half must be > 0, got {d_half!r}")
    for key, value in (("prior_alpha", prior_alpha), ("prior_beta", prior_beta)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"spo: {key} must be > 0, got {value!r}")
    eps = _check_eps("spo", eps)
    assert state is not None  # checked by the registry wrapper
    r, valid, _, _ = _prepare(rewards, group, weights)
    pid = require_field("spo", context, "prompt_ids").to(r.device).long()
    shift = None
    if rho_mode == "kl":
        shift = require_field("spo", context, "policy_shift", " with rho_mode='kl'").to(r.device, r.dtype)
        bad = valid & ~(torch.isfinite(shift) & (shift >= 0))
        if bool(bad.any()):
            raise ContextError("spo: context field 'policy_shift' must be finite and >= 0 for valid samples")
    ids = pid.tolist()
    ok = valid.tolist()
    p_hat = torch.zeros_like(r)
    for i, (x, v) in enumerate(zip(ids, ok, strict=True)):
        if v:
            p_hat[i] = state.p_hat(x, prior_alpha, prior_beta)
    adv = torch.where(valid, r - p_hat, torch.zeros_like(r))
    if normalize:
        adv = _whiten(adv, valid, eps)
    # tracker update, one per prompt of the batch, in increasing id order (order-independent)
    clamped = r.clamp(0.0, 1.0)
    for x in sorted({x for x, v in zip(ids, ok, strict=True) if v}):
        members = (pid == x) & valid
        succ = float(clamped[members].sum())
        fail = float((1.0 - clamped[members]).sum())
        if rho_mode == "constant":
            rho_x = rho
        elif state.visits(x) == 0:
            rho_x = min(max(1.0, rho_min), rho_max)
        else:
            d = float(shift[members].mean())  # type: ignore[index]
            rho_x = min(max(2.0 ** (-d / d_half), rho_min), rho_max)
        a, b = state.posterior(x, prior_alpha, prior_beta)
        state.set(x, rho_x * a + succ, rho_x * b + fail, state.visits(x) + 1)
    return adv


@register("gigpo", context=("turn_index", "turn_state"), context_optional=("turn_rewards",))
def gigpo(
    rewards: Tensor,
    group: Tensor,
    *,
    context: EstimatorContext | None = None,
    weights: Weights = None,
    gamma: float = 0.95,
    step_weight: float = 1.0,
    mode: str = "mean_std_norm",
    eps: float = 1e-6,
) -> Tensor:
    """GiGPO: A = A_episode + step_weight * A_step, A_step relative among the turns that start from one state.

    Feng et al., "Group-in-Group Policy Optimization for LLM Agent Training" (arXiv:2505.10978); facts
    from the authors' verl-agent ``gigpo/core_gigpo.py`` (defaults: mode ``mean_std_norm``, eps 1e-6,
    step_advantage_w 1.0; gamma 0.95 in their ALFWorld / WebShop scripts). Returns Float[B, T].

    Inputs: ``context.turn_index`` (Long[B, T], the turn of each action, -1 off actions; see
    :func:`turns_from_mask`), ``context.turn_state`` (Long[B, K], a key of the state turn k starts from;
    see :func:`state_key`), optionally ``context.turn_rewards`` (Float[B, K], the environment's reward per
    turn; NaN / absent = 0). Sample i has n_i = max turn_index + 1 turns (n_i <= K).

    - Turn rewards R_{i,k} = turn_rewards_{i,k} for k < n_i, plus the outcome reward r_i (combined with
      ``weights``) on the last turn (our design: the outcome is the episode's final environment reward).
    - Episode return E_i = sum_k R_{i,k}; A_episode_i = (E_i - mean_g E) / (std_g E + eps) over the valid
      samples of group g (the paper's Eq. 3, over trajectories; verl-agent's default averages over step
      rows instead), or E_i - mean_g E with ``mode="mean_norm"``.
    - Discounted return G_{i,k} = sum_{k' >= k} gamma^(k'-k) R_{i,k'}. Step groups: the turns (i, k) of
      the same group g whose ``turn_state`` keys are equal (anchor states, including repeats inside one
      trajectory); A_step_{i,k} = (G_{i,k} - mean) / (std + eps) over the step group (or G - mean).
    - A_{i,t} = A_episode_i + step_weight * A_step_{i, turn(t)} on the actions of sample i, 0 elsewhere.

    Stds are unbiased; a group or step group with one member gives 0 (the shared convention; verl-agent
    leaves a singleton trajectory's raw return). NaN outcome rewards give 0 for the whole sample.
    """
    if mode not in _GIGPO_MODES:
        raise ValueError(f"gigpo: mode must be {' or '.join(map(repr, _GIGPO_MODES))}, got {mode!r}")
    gamma = _check_unit("gigpo", "gamma", gamma)
    if not (math.isfinite(step_weight) and step_weight >= 0):
        raise ValueError(f"gigpo: step_weight must be a finite number >= 0, got {step_weight!r}")
    eps = _check_eps("gigpo", eps)
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    turn, keys, live, episode, ret = _turn_returns("gigpo", r, valid, context, gamma)
    a_ep = _episode_advantage(episode, valid, gid, n_groups, mode, eps)
    # step groups: (group, state key) among the live turns of valid samples
    cell_ok = live & valid[:, None]
    a_step = torch.zeros_like(ret)
    if bool(cell_ok.any()):
        rows, cols = cell_ok.nonzero(as_tuple=True)
        pairs = torch.stack([gid[rows], keys[rows, cols]], dim=1)
        _, cell = torch.unique(pairs, dim=0, return_inverse=True)
        n_cells = int(cell.max()) + 1
        x = ret[rows, cols]
        sel = torch.ones_like(x, dtype=torch.bool)
        cn, cmean, csd = _group_stats(x, sel, cell, n_cells)
        cok = cn[cell] >= 2
        dev = torch.where(cok, x - cmean[cell], torch.zeros_like(x))
        val = dev if mode == "mean_norm" else _safe_div(dev, csd[cell] + eps)
        a_step[rows, cols] = torch.where(cok, val, torch.zeros_like(val))
    per_turn = a_ep[:, None] + float(step_weight) * a_step  # Float[B, K]
    return _per_action(per_turn, turn, valid)


def _turn_returns(
    name: str, r: Tensor, valid: Tensor, context: EstimatorContext | None, gamma: float
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Turn structure of a multi-turn batch: (turn_index Long[B,T], state keys Long[B,K], live turns
    Bool[B,K], episode return Float[B], discounted return per turn Float[B,K]).

    Turn rewards are ``context.turn_rewards`` (0 where absent or NaN) plus the outcome reward on each
    sample's last turn; the episode return is their sum (the outcome alone for a sample without turns).
    """
    assert context is not None
    turn = torch.as_tensor(context.turn_index).to(r.device).long()
    keys = torch.as_tensor(context.turn_state).to(r.device).long()
    batch, width = turn.shape[0], keys.shape[1]
    if turn.shape[1]:
        n_turns = (turn.max(dim=1).values + 1).clamp(min=0)
    else:
        n_turns = torch.zeros(batch, dtype=torch.long, device=r.device)
    if bool((n_turns > width).any()):
        raise ContextError(
            f"{name}: a sample has {int(n_turns.max())} turns but context.turn_state has {width} columns"
        )
    k_idx = torch.arange(width, device=r.device)
    live = k_idx[None, :] < n_turns[:, None]  # Bool[B, K]: the sample's turns
    step_r = torch.zeros(batch, width, dtype=r.dtype, device=r.device)
    if context.turn_rewards is not None:
        tr = torch.as_tensor(context.turn_rewards).to(r.device, r.dtype)
        if tr.shape != keys.shape:
            raise ContextError(
                f"{name}: turn_rewards {tuple(tr.shape)} and turn_state {tuple(keys.shape)} differ"
            )
        step_r = torch.where(live & torch.isfinite(tr), tr, step_r)
    last = (k_idx[None, :] == (n_turns - 1)[:, None]) & live
    r0 = torch.where(valid, r, torch.zeros_like(r))
    step_r = step_r + torch.where(last, r0[:, None], torch.zeros_like(step_r))
    episode = torch.where(n_turns > 0, step_r.sum(dim=1), r0)
    ret = torch.zeros_like(step_r)
    running = torch.zeros(batch, dtype=r.dtype, device=r.device)
    for k in range(width - 1, -1, -1):
        running = step_r[:, k] + gamma * running
        ret[:, k] = running
    return turn, keys, live, episode, ret


def _episode_advantage(
    episode: Tensor, valid: Tensor, gid: Tensor, n_groups: int, mode: str, eps: float
) -> Tensor:
    """Group-relative advantage of the episode returns (unbiased std; groups < 2 valid samples: 0)."""
    n, mean, sd = _group_stats(episode, valid, gid, n_groups)
    ok = valid & (n[gid] >= 2)
    centred = torch.where(ok, episode - mean[gid], torch.zeros_like(episode))
    a_ep = centred if mode == "mean_norm" else _safe_div(centred, sd[gid] + eps)
    return torch.where(ok, a_ep, torch.zeros_like(a_ep))


def _per_action(per_turn: Tensor, turn: Tensor, valid: Tensor) -> Tensor:
    """Float[B,T]: each action gets its turn's value (0 off actions and for invalid samples)."""
    if per_turn.shape[1] == 0:
        return torch.zeros(turn.shape, dtype=per_turn.dtype, device=per_turn.device)
    acting = (turn >= 0) & valid[:, None]
    out = torch.gather(per_turn, 1, turn.clamp(min=0, max=per_turn.shape[1] - 1))
    return torch.where(acting, out, torch.zeros_like(out))


@register("hgpo", context=("turn_index", "turn_state"), context_optional=("turn_rewards",))
def hgpo(
    rewards: Tensor,
    group: Tensor,
    *,
    context: EstimatorContext | None = None,
    weights: Weights = None,
    gamma: float = 0.95,
    history_length: int = 2,
    length_weight_alpha: float = 1.0,
    base_group: bool = False,
    mode: str = "mean_std_norm",
    eps: float = 1e-6,
) -> Tensor:
    """HGPO: each turn's advantage mixes its step groups of growing history context, weighted by length.

    "Hierarchy-of-Groups Policy Optimization for Long-Horizon Agentic Tasks" (HGPO); facts from the
    authors' recipe (verl-agent ``recipe/hgpo/core_hgpo.py``: history_length 2 or 4, length_weight_alpha 1,
    base_group False, mode ``mean_std_norm``, eps 1e-6). Same inputs, turn rewards and discounted
    returns G_{i,k} as :func:`gigpo`; returns Float[B, T].

    For turn k of sample i and each history depth d = 1 .. min(history_length + 1, k + 1), the step
    group H_d(i, k) holds the turns of the same group whose last d state keys (states k-d+1 .. k) are
    the same sequence: d = 1 is GiGPO's anchor state, deeper levels are context-consistent. In each
    H_d with >= 2 members, a = (G - mean) / (std + eps) with the POPULATION std (as the authors'), or
    G - mean for ``mode="mean_norm"``. The turn's advantage is sum_d w_d a_d over its non-zero a_d with
    w_d = (d + 1)^alpha / (sum of those (d + 1)^alpha + eps) (0 when none). ``base_group`` adds the
    episode advantage (:func:`gigpo`'s, unbiased std) as an item of depth 0.
    """
    if mode not in _GIGPO_MODES:
        raise ValueError(f"hgpo: mode must be {' or '.join(map(repr, _GIGPO_MODES))}, got {mode!r}")
    gamma = _check_unit("hgpo", "gamma", gamma)
    if isinstance(history_length, bool) or int(history_length) != history_length or history_length < 0:
        raise ValueError(f"hgpo: history_length must be an integer >= 0, got {history_length!r}")
    if not math.isfinite(length_weight_alpha):
        raise ValueError(f"hgpo: length_weight_alpha must be finite, got {length_weight_alpha!r}")
    eps = _check_eps("hgpo", eps)
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    turn, keys, live, episode, ret = _turn_returns("hgpo", r, valid, context, gamma)
    a_ep = _episode_advantage(episode, valid, gid, n_groups, mode, eps) if base_group else None
    n_turns = live.sum(dim=1).tolist()
    key_rows, ret_rows, groups = keys.tolist(), ret.tolist(), gid.tolist()
    cells: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
    for i, ok in enumerate(valid.tolist()):
        if not ok:
            continue
        for k in range(n_turns[i]):
            for d in range(1, min(int(history_length) + 1, k + 1) + 1):
                history = tuple(key_rows[i][k - d + 1 : k + 1])
                cells.setdefault((groups[i], d, history), []).append((i, k))
    items: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for (_, d, _), members in cells.items():
        if len(members) < 2:
            continue
        xs = [ret_rows[i][k] for i, k in members]
        mean = math.fsum(xs) / len(xs)
        sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / len(xs))
        for (i, k), x in zip(members, xs, strict=True):
            a = x - mean if mode == "mean_norm" else ((x - mean) / (sd + eps) if sd + eps > 0 else 0.0)
            items.setdefault((i, k), []).append((d, a))
    per_turn = torch.zeros_like(ret)
    for i, ok in enumerate(valid.tolist()):
        if not ok:
            continue
        for k in range(n_turns[i]):
            its = list(items.get((i, k), []))
            if a_ep is not None:
                its.insert(0, (0, float(a_ep[i])))
            nonzero = [(d, a) for d, a in its if a != 0]
            if not nonzero:
                continue
            w = [(d + 1.0) ** length_weight_alpha for d, _ in nonzero]
            total = math.fsum(w) + eps
            per_turn[i, k] = math.fsum(wj * a for wj, (_, a) in zip(w, nonzero, strict=True)) / total
    return _per_action(per_turn, turn, valid)


@register("factorized", context=("phase_index",))
def factorized(
    rewards: Tensor,
    group: Tensor,
    *,
    context: EstimatorContext | None = None,
    weights: Weights = None,
    phase_components: Sequence[Sequence[int]] | None = None,
    std: str = "group",
    eps: float = 1e-4,
) -> Tensor:
    """F-GRPO: a separate group-relative advantage per output phase, each from that phase's reward components.

    "F-GRPO: Factorized Group-Relative Policy Optimization for Unified Candidate Generation and
    Ranking": one rollout holds several phases (candidate generation, then ranking) whose rewards
    (coverage, position-aware utility) should credit only their own tokens. ``phase_components[p]``
    lists the reward components (columns of Float[B, K] rewards) of phase p; phase p's advantage is
    ``grpo`` on those components alone (``weights`` restricted to them; ``std``, ``eps``), and an
    action gets the advantage of its phase (``context.phase_index``, Long[B, T]; -1: no phase, 0).
    Returns Float[B, T].
    """
    if not phase_components:
        raise ValueError("factorized needs phase_components: a list, per phase, of reward component indices")
    r2 = _as_float(rewards)
    if r2.dim() == 1:
        r2 = r2[:, None]
    k = r2.shape[1]
    w = _weights(weights, k, r2)
    assert context is not None
    phase = torch.as_tensor(context.phase_index).to(r2.device).long()
    out = torch.zeros(phase.shape, dtype=r2.dtype, device=r2.device)
    for p, comps in enumerate(phase_components):
        comps = [int(c) for c in comps]
        if not comps or any(not -k <= c < k for c in comps):
            raise ValueError(f"factorized: phase {p} must list reward components in [0, {k}), got {comps!r}")
        mask = torch.zeros(k, dtype=torch.bool, device=r2.device)
        mask[comps] = True
        a = grpo(r2, group, weights=torch.where(mask, w, torch.zeros_like(w)), std=std, eps=eps).to(r2.dtype)
        out = torch.where(phase == p, a[:, None], out)
    if bool((phase >= len(phase_components)).any()):
        raise ContextError(
            f"factorized: context.phase_index holds phase {int(phase.max())} but phase_components lists "
            f"{len(phase_components)} phases"
        )
    return out


@register("ace", context=("logp_old_sum", "logp_ref_sum"))
def ace(
    rewards: Tensor,
    group: Tensor,
    *,
    context: EstimatorContext | None = None,
    weights: Weights = None,
    alpha: float = 1.0,
    base: str = "grpo",
    base_options: dict[str, Any] | None = None,
) -> Tensor:
    """ACE: negative advantages of over-confident errors scaled by (1 + alpha * softplus(c_i)), c_i = log pi/pi_ref.

    "Overconfident Errors Need Stronger Correction: Asymmetric Confidence Penalties for RL" (ACE). With
    A = the ``base`` estimator's advantages (``grpo`` by default, with ``base_options`` and ``weights``)
    and c_i = ``logp_old_sum`` - ``logp_ref_sum`` (the sequence log-ratio log pi_theta(y_i|x) /
    pi_ref(y_i|x), measured at rollout time, where pi_theta = pi_old):

        A'_i = A_i * (1 + alpha * softplus(c_i))   where A_i < 0;   A'_i = A_i otherwise.

    (our design) alpha = 1.0: the abstract leaves the coefficient open and no code is public. A
    non-finite c_i leaves A_i unchanged. ``base`` must return Float[B] and take no step rewards or
    state; it gets the context when it takes one.
    """
    if not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"ace: alpha must be a finite number >= 0, got {alpha!r}")
    if base == "ace":
        raise ValueError("ace: base cannot be 'ace'")
    if accepts_step_rewards(base) or REGISTRY.meta(base).get("state") is not None:
        raise ValueError(f"ace: base {base!r} must be an outcome estimator without step rewards or state")
    opts = dict(base_options or {})
    if weights is not None:
        opts.setdefault("weights", weights)
    if accepts_context(base):
        opts.setdefault("context", context)
    a = get(base)(rewards, group, **opts).to(torch.float64)
    if a.dim() != 1:
        raise ValueError(f"ace: base {base!r} returned shape {tuple(a.shape)}, not Float[B]")
    assert context is not None
    c = torch.as_tensor(context.logp_old_sum).to(a) - torch.as_tensor(context.logp_ref_sum).to(a)
    scale = 1.0 + alpha * torch.nn.functional.softplus(torch.nan_to_num(c, nan=0.0, posinf=0.0, neginf=0.0))
    scale = torch.where(torch.isfinite(c), scale, torch.ones_like(scale))
    return torch.where(a < 0, a * scale, a)


@register("canon", context_optional=("entropy_mean",))
def canon(
    rewards: Tensor,
    group: Tensor,
    *,
    context: EstimatorContext | None = None,
    num_actions: Tensor | None = None,
    weights: Weights = None,
    metric: str = "entropy",
    inter_weight: float = 1.0,
    std: str = "group",
    eps: float = 1e-4,
) -> Tensor:
    """CANON: split each group at the median of a metric; intra-subgroup advantage + inter-subgroup difference.

    "Conditional Advantage Estimation for RL in Large Reasoning Models" (CANON). The metric m_i is the
    mean token entropy (``metric="entropy"``: ``context.entropy_mean``) or the response length
    (``"length"``: ``num_actions``, which the trainer passes). Per group g, over its valid samples, with
    m~ the lower median of m: L = {m_i <= m~}, H = {m_i > m~}; for i in subgroup S (S' the other one):

        A_i = [(r_i - mean_S r) + lambda (mean_S r - mean_S' r)] / (std_g r + eps)

    The inter term says which direction of the metric paid off in this group, without presuming it;
    the intra term ranks responses inside the subgroup. (our design): the two-term sum with lambda =
    ``inter_weight`` = 1 (then A_i = r_i - mean_S' r: each response is compared with the other
    subgroup), the lower-median split and the division by the group's unbiased std (``std="none"``: no
    division). A group whose metric does not split (H empty) gets GRPO's (r_i - mean_g r) / (std + eps).
    """
    if metric not in _CANON_METRICS:
        raise ValueError(f"canon: metric must be {' or '.join(map(repr, _CANON_METRICS))}, got {metric!r}")
    if std not in ("group", "none"):
        raise ValueError(f"canon: std must be 'group' or 'none', got {std!r}")
    if not (math.isfinite(inter_weight) and inter_weight >= 0):
        raise ValueError(f"canon: inter_weight must be a finite number >= 0, got {inter_weight!r}")
    eps = _check_eps("canon", eps)
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    if metric == "entropy":
        m = require_field("canon", context, "entropy_mean", " with metric='entropy'").to(r.device, r.dtype)
    else:
        if num_actions is None:
            raise ValueError("canon with metric='length' needs num_actions (each sample's number of actions)")
        m = _num_actions("canon", num_actions, r)
    valid = valid & torch.isfinite(m)
    n, mean, sd = _group_stats(r, valid, gid, n_groups)
    med, _ = _group_lower_median(m, valid, gid, n_groups)
    high = valid & (m > med[gid])
    low = valid & ~high
    zero = torch.zeros_like(r)
    n_hi = _seg_sum(high.to(r.dtype), gid, n_groups)
    n_lo = _seg_sum(low.to(r.dtype), gid, n_groups)
    mean_hi = _seg_sum(torch.where(high, r, zero), gid, n_groups) / n_hi.clamp(min=1)
    mean_lo = _seg_sum(torch.where(low, r, zero), gid, n_groups) / n_lo.clamp(min=1)
    own = torch.where(high, mean_hi[gid], mean_lo[gid])
    other = torch.where(high, mean_lo[gid], mean_hi[gid])
    split = (n_hi[gid] > 0) & (n_lo[gid] > 0)
    cond = (r - own) + inter_weight * (own - other)
    centred = torch.where(split, cond, r - mean[gid])
    eligible = valid & (n[gid] >= 2)
    adv = centred if std == "none" else _safe_div(centred, sd[gid] + eps)
    return torch.where(eligible, adv, zero)


@register("drpo")
def drpo(
    rewards: Tensor,
    group: Tensor,
    *,
    num_actions: Tensor | None = None,
    weights: Weights = None,
    threshold: float = 0.5,
    length_weight: float = 0.5,
    eps: float = 1e-4,
) -> Tensor:
    """DRPO-style decoupled length signal: GRPO on the reward + a length term normalised among the correct only.

    "DRPO: Efficient Reasoning via Decoupled Reward Policy Optimization". A_i = grpo_i (the reward's
    group-relative advantage, ``eps``) + for correct samples (r_i > ``threshold``) ``length_weight`` *
    z_i, where z_i = -(l_i - mean_P l) / (std_P l + eps) over the correct valid samples P of the group
    (l = ``num_actions``, which the trainer passes; z = 0 when |P| < 2). Incorrect samples get grpo_i
    only. The length signal of correct rollouts is thus normalised within the positives and never
    compared with the negatives, so GRPO's mixing of a length penalty into the shared baseline cannot
    turn a correct answer's advantage negative through the wrong answers. (our design): the paper's
    discriminative objective with its closed-form positive distribution is replaced by this additive
    z-score, with length_weight 0.5 and the correctness threshold 0.5.
    """
    if not (math.isfinite(length_weight) and length_weight >= 0):
        raise ValueError(f"drpo: length_weight must be a finite number >= 0, got {length_weight!r}")
    eps = _check_eps("drpo", eps)
    if num_actions is None:
        raise ValueError(
            "drpo needs num_actions (each sample's number of valid actions); the trainer passes it"
        )
    base = grpo(rewards, group, weights=weights, eps=eps).to(torch.float64)
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    length = _num_actions("drpo", num_actions, r)
    pos = valid & (r > threshold)
    n_pos, mean_l, sd_l = _group_stats(length, pos, gid, n_groups)
    z = torch.where(
        pos & (n_pos[gid] >= 2), _safe_div(mean_l[gid] - length, sd_l[gid] + eps), torch.zeros_like(r)
    )
    n, _, _ = _group_stats(r, valid, gid, n_groups)
    return torch.where(valid & (n[gid] >= 2), base + length_weight * z, torch.zeros_like(r))


@register("hapo")
def hapo(
    rewards: Tensor,
    group: Tensor,
    *,
    num_actions: Tensor | None = None,
    weights: Weights = None,
    std: str = "group",
    eps: float = 1e-6,
    fallback: float = 5.0,
) -> Tensor:
    """HAPO Token Level Group Average: group statistics over the group's TOKENS, GRPO where they blow up.

    "From Uniform to Heterogeneous: Tailoring Policy Optimization to Every Token's Nature" (HAPO,
    arXiv:2509.16591); facts from the authors' verl code (``compute_hapo_outcome_advantage``: eps 1e-6,
    fallback threshold 5). Each sample counts once per valid action (n_i = ``num_actions``, which the
    trainer passes), so the baseline matches a token-mean loss. Over the valid samples of group g:

        mu_g = sum_i n_i r_i / N_g,  s_g^2 = sum_i n_i (r_i - mu_g)^2 / N_g   (N_g = sum_i n_i, population)
        A_i = (r_i - mu_g) / (s_g + eps)          (``std="none"``: A_i = r_i - mu_g)

    If some valid sample of the group has |A_i| >= ``fallback`` (a lone long outlier), the whole group
    takes ``grpo``'s advantage instead ((r_i - mean) / (unbiased std + eps)). Groups with < 2 valid
    samples, N_g = 0 or all rewards equal get 0. (our reading): the authors test the threshold on every position of the
    padded token matrix (padding holds (0 - mu) / s); we test the valid samples only.
    """
    if std not in ("group", "none"):
        raise ValueError(f"hapo: std must be 'group' or 'none', got {std!r}")
    eps = _check_eps("hapo", eps)
    if not (math.isfinite(fallback) and fallback > 0):
        raise ValueError(f"hapo: fallback must be a finite number > 0, got {fallback!r}")
    if num_actions is None:
        raise ValueError(
            "hapo needs num_actions (each sample's number of valid actions); the trainer passes it"
        )
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    n_tok = _num_actions("hapo", num_actions, r)
    zero = torch.zeros_like(r)
    w = torch.where(valid, n_tok, zero)
    total = _seg_sum(w, gid, n_groups)
    mu = _seg_sum(w * torch.where(valid, r, zero), gid, n_groups) / total.clamp(min=1e-300)
    dev = torch.where(valid, r - mu[gid], zero)
    var = _seg_sum(w * dev * dev, gid, n_groups) / total.clamp(min=1e-300)
    adv = dev if std == "none" else _safe_div(dev, var.sqrt()[gid] + eps)
    n, _, spread = _group_stats(r, valid, gid, n_groups)  # spread 0 exactly when the rewards are all equal
    eligible = valid & (n[gid] >= 2) & (total[gid] > 0) & (spread[gid] > 0)
    adv = torch.where(eligible, adv, zero)
    blown = _seg_sum((eligible & (adv.abs() >= fallback)).to(r.dtype), gid, n_groups) > 0
    base = grpo(rewards, group, weights=weights, eps=eps).to(r.dtype)
    return torch.where(blown[gid], base, adv)


AdoraRule = Literal["release", "early"]
ADORA_RULES: tuple[str, ...] = typing.get_args(AdoraRule)


@register("adora")
def adora(
    rewards: Tensor,
    group: Tensor,
    *,
    num_actions: Tensor | None = None,
    weights: Weights = None,
    rule: AdoraRule = "release",
    threshold: float = 0.5,
    weight: float = 0.1,
    max_length_threshold: float = 3900.0,
    eps: float = 1e-6,
) -> Tensor:
    """ADORA: GRPO advantages of a group scaled down when its correct answers are not longer than its wrong ones.

    "ADORA: Training Reasoning Models with Dynamic Advantage Estimation on Reinforcement Learning". Every
    sample starts from its ``grpo`` advantage ((r - mean) / (unbiased std + eps)); a group that is not
    "temporarily advantageous" has them multiplied by ``weight`` (lamda 0.1). H: the valid samples with
    r > ``threshold`` (correct), L: the other valid ones, l = ``num_actions`` (the trainer passes it).

    - ``rule="release"`` (default; the authors' release ShadeCloak/ADORA c518485, README and ADORA.sh,
      ``compute_grpo_outcome_advantage_ADORA``): wrong answers with l >= ``max_length_threshold`` (3900, the
      script's value) are left out of L; a group is advantageous when H is not empty and either L is empty
      or max_H l > mean_L l. So a group with no correct answer is scaled by ``weight`` and an all-correct
      group keeps full weight.
    - ``rule="early"`` (the authors' first function, commit 8f046a3,
      ``compute_grpo_outcome_advantage_length_weight``): no length cut (``max_length_threshold`` is not
      used); advantageous when H is empty or max_H l > mean_L l, with the mean over an empty L = +inf.

    Longer successful reasoning keeps full weight, so training steers toward long chains of thought.
    (our design): ``threshold`` 0.5 for 0/1 rewards (the authors use 1.01 / 1.0 on Logic-RL's reward scale,
    where a correct answer scores above it). NaN rewards stay out of H and L.
    """
    if rule not in ADORA_RULES:
        raise ValueError(
            f"adora: rule must be one of {', '.join(map(repr, ADORA_RULES))} "
            f"(algorithm.estimator_kwargs.rule), got {rule!r}"
        )
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"adora: weight must be a finite number >= 0, got {weight!r}")
    if not math.isfinite(threshold):
        raise ValueError(f"adora: threshold must be finite, got {threshold!r}")
    if not max_length_threshold > 0:
        raise ValueError(
            f"adora: max_length_threshold must be > 0 (inf keeps every wrong answer), got {max_length_threshold!r}"
        )
    eps = _check_eps("adora", eps)
    if num_actions is None:
        raise ValueError(
            "adora needs num_actions (each sample's number of valid actions); the trainer passes it"
        )
    base = grpo(rewards, group, weights=weights, eps=eps).to(torch.float64)
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    length = _num_actions("adora", num_actions, r)
    high = valid & (r > threshold)
    low = valid & ~high
    if rule == "release":
        low = low & (length < max_length_threshold)
    neg_inf = torch.full((n_groups,), -math.inf, dtype=r.dtype, device=r.device)
    max_high = neg_inf.scatter_reduce(
        0, gid, torch.where(high, length, torch.full_like(r, -math.inf)), "amax"
    )
    n_high = _seg_sum(high.to(r.dtype), gid, n_groups)
    n_low = _seg_sum(low.to(r.dtype), gid, n_groups)
    sum_low = _seg_sum(torch.where(low, length, torch.zeros_like(r)), gid, n_groups)
    mean_low = sum_low / n_low.clamp(min=1)
    if rule == "release":
        advantageous = (n_high > 0) & ((n_low == 0) | (max_high > mean_low))
    else:
        advantageous = (n_high == 0) | ((n_low > 0) & (max_high > mean_low))
    scale = torch.where(advantageous, torch.ones_like(mean_low), torch.full_like(mean_low, float(weight)))
    return base * scale[gid]


_RISKPO_CREDIT = ("uniform", "std")


@register("riskpo")
def riskpo(
    rewards: Tensor,
    group: Tensor,
    *,
    weights: Weights = None,
    bundle_size: int = 5,
    quantile_down: float = 0.2,
    quantile_up: float = 0.9,
    w_mix: float = 1.5,
    credit: str = "std",
    normalize: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """RiskPO: a Mixed Value-at-Risk advantage of bundles of questions instead of the group mean baseline.

    "RiskPO: Risk-based Policy Optimization via Verifiable Reward for LLM Post-Training"; facts and defaults
    from the authors' verl code (``compute_grpo_bundle_rvar_outcome_advantage_quantile_tracking`` and their
    MVaR script: quantiles 0.2 / 0.9, w_mix 1.5, credit ``std``, std normalisation, natural baseline, eps 1e-6).

    Bundles: the batch's groups in ascending id order, ``bundle_size`` at a time. Paper k of a bundle is the
    k-th valid sample (batch order) of each of its questions, k < the smallest question's sample count;
    its score S_k is the sum of their rewards. Over the papers of a bundle, q_d and q_u are the
    ``quantile_down`` / ``quantile_up`` (alpha, beta) quantiles of S (linear interpolation), s the unbiased std:

        RVaR_k = ([S_k - q_d]_+ - [S_k - q_u]_+ + q_d - q_u) / (beta - alpha + eps)
        CVaR_k = -[q_d - S_k]_+ / (alpha + eps)
        A_k = (w CVaR_k + RVaR_k) / (w + 1) / (s + eps)      (``normalize=False``: no division by s)

    Every sample of paper k gets A_k (``credit="uniform"``) or A_k / (s_q + eps) with s_q the unbiased std of
    its question's rewards (1 where s_q <= 1e-3; ``credit="std"``). Samples outside every paper, NaN rewards
    and bundles with one paper get 0. The quantiles are the bundle's own: the authors' trainer also tracks
    running quantiles (SGD on a pinball loss, lr_q 0.1), but as read it stores them on the batch only after
    that batch's advantages were computed, so their advantages use each bundle's quantiles too; the tracked
    values (and the ``use_mean_as_baseline`` variant that needs them) are not reproduced.
    """
    if isinstance(bundle_size, bool) or int(bundle_size) != bundle_size or bundle_size < 1:
        raise ValueError(f"riskpo: bundle_size must be an integer >= 1, got {bundle_size!r}")
    if not (0.0 < quantile_down < quantile_up < 1.0):
        raise ValueError(
            f"riskpo: need 0 < quantile_down < quantile_up < 1, got {quantile_down!r}, {quantile_up!r}"
        )
    if not (math.isfinite(w_mix) and w_mix >= 0):
        raise ValueError(f"riskpo: w_mix must be a finite number >= 0, got {w_mix!r}")
    if credit not in _RISKPO_CREDIT:
        raise ValueError(f"riskpo: credit must be {' or '.join(map(repr, _RISKPO_CREDIT))}, got {credit!r}")
    eps = _check_eps("riskpo", eps)
    r, valid, gid, n_groups = _prepare(rewards, group, weights)
    out = torch.zeros_like(r)
    members = [(gid == g).logical_and(valid).nonzero().flatten() for g in range(n_groups)]
    q_scale = torch.ones(r.shape[0], dtype=r.dtype, device=r.device)
    for idx in members:
        if idx.numel() >= 2:
            s_q = r[idx].std()
            q_scale[idx] = torch.where(s_q > 1e-3, s_q, torch.ones_like(s_q))
    for start in range(0, n_groups, int(bundle_size)):
        questions = members[start : start + int(bundle_size)]
        n_papers = min(int(q.numel()) for q in questions)
        if n_papers < 2:
            continue
        papers = torch.stack([q[:n_papers] for q in questions], dim=1)  # [n_papers, questions]
        scores = r[papers].sum(dim=1)
        q_d = torch.quantile(scores, quantile_down)
        q_u = torch.quantile(scores, quantile_up)
        rvar = ((scores - q_d).clamp(min=0) - (scores - q_u).clamp(min=0) + q_d - q_u) / (
            quantile_up - quantile_down + eps
        )
        cvar = -(q_d - scores).clamp(min=0) / (quantile_down + eps)
        a = (w_mix * cvar + rvar) / (w_mix + 1.0)
        if normalize:
            a = a / (scores.std() + eps)
        share = a[:, None].expand_as(papers)
        if credit == "std":
            share = share / (q_scale[papers] + eps)
        out[papers.flatten()] = share.flatten()
    return out
