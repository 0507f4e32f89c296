"""The algorithm a config names, checked before anything loads.

`check_names` is the one check of the registry names of ``algorithm``, ``data.sampler`` and ``rollout.loop`` and
of the options each ``*_kwargs`` passes to them: every registered function or class declares its options in
its signature, from which `mmalign.options.options_class` derives a typed options dataclass; an unknown option
is refused with close matches, a value that does not fit the option's annotation (a Literal's choices, bool,
int, float, str, None, containers) or a missing required option is refused naming the key. `needs_reference`
says whether a run reads the reference policy. The command line's validation (`mmalign.app.preflight.validate`)
runs `check_names` before any model is built; `mmalign.training.trainer.GroupTrainer` for a config built in code.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Any

from mmalign.config import Config
from mmalign.errors import ConfigError
from mmalign.options import check_values, options_class, required_options
from mmalign.registry import RegistryError

__all__ = ["check_names", "check_options", "declared_options", "needs_reference"]


def declared_options(fn: Callable[..., Any], skip: int, exclude: frozenset[str] = frozenset()) -> type | None:
    """The options dataclass `fn` declares after its first `skip` positional parameters, minus `exclude`
    (inputs the caller supplies): `mmalign.options.options_class`; None when `fn` takes ``**kwargs``."""
    return options_class(fn, skip, frozenset(exclude))


def check_options(
    source: str, key: str, what: str, options: Mapping[str, Any], declared: type | None
) -> None:
    """`options` (the config's ``key``, e.g. ``algorithm.estimator_kwargs``) against the options dataclass
    `what` declares: an unknown option (with close matches), a missing required one, or a value that does not
    fit the option's annotation (or its bool / number / string default) is a `ConfigError` naming the key."""
    if declared is None:
        return
    fields = {f.name: f for f in dataclasses.fields(declared)}
    for name in options:
        if name not in fields:
            close = difflib.get_close_matches(str(name), list(fields), n=2)
            hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
            listed = ", ".join(sorted(fields)) or "none"
            raise ConfigError(f"{source}: unknown key '{key}.{name}'{hint}; {what} takes: {listed}")
    for name, problem in check_values(declared, options):
        raise ConfigError(f"{source}: key '{key}.{name}' {problem}")
    missing = [n for n in required_options(declared) if n not in options]
    if missing:
        raise ConfigError(
            f"{source}: key '{key}': {what} needs the option(s) {', '.join(map(repr, missing))}"
        )


def check_names(cfg: Config) -> None:
    """The registry names of the ``algorithm`` section (estimator, loss, loss aggregation, KL estimator, filter,
    objective, reward transforms), the prompt sampler (``data.sampler``) and the rollout loop (``rollout.loop``)
    are registered, their ``*_kwargs``
    are options they declare, and ``adora``'s ``rule`` is one it knows: a `ConfigError` naming the key, with
    close matches, otherwise."""
    from mmalign.algorithms import advantages, filters, flow_objectives, losses, reward_transforms
    from mmalign.data import prompt_samplers, rollout_loops

    a, src = cfg.algorithm, cfg.source
    for i, spec in enumerate(a.reward_transforms):
        name = str(spec.get("name"))
        try:
            transform = reward_transforms.get(name)
        except RegistryError as e:
            raise ConfigError(f"{src}: key 'algorithm.reward_transforms[{i}].name': {e}") from None
        opts = {k: v for k, v in spec.items() if k not in ("name", "column")}
        check_options(
            src,
            f"algorithm.reward_transforms[{i}]",
            f"reward transform {name!r}",
            opts,
            declared_options(transform, 2, frozenset({"context"})),
        )
    if a.objective is not None:
        try:
            flow_objectives.get(a.objective)
        except RegistryError as e:
            raise ConfigError(f"{src}: key 'algorithm.objective': {e}") from None
        check_options(
            src,
            "algorithm.objective_kwargs",
            f"objective {a.objective!r}",
            a.objective_kwargs,
            declared_options(
                flow_objectives.get(a.objective), 7, frozenset(flow_objectives.inputs(a.objective))
            ),
        )
        if a.sample_with_old and a.old_policy is None:
            raise ConfigError(
                f"{src}: key 'algorithm.sample_with_old': sampling with the old policy needs "
                "'algorithm.old_policy' (e.g. {decay_type: 1})"
            )
    elif a.eval_ema is not None:
        raise ConfigError(
            f"{src}: key 'algorithm.eval_ema': an evaluation EMA belongs to a forward-process objective "
            f"(algorithm.objective: {', '.join(flow_objectives.names())})"
        )
    for key, get, name in (
        ("algorithm.estimator", advantages.get, a.estimator),
        ("algorithm.loss", losses.get, a.loss),
        ("algorithm.loss_agg", losses.AGGREGATIONS.get, a.loss_agg),
        ("algorithm.kl_estimator", losses.KL_ESTIMATORS.get, a.kl_estimator),
        ("algorithm.filter", filters.get, a.filter),
        ("data.sampler", prompt_samplers.get, cfg.data.sampler),
        ("rollout.loop", rollout_loops.get, cfg.rollout.loop),
    ):
        try:
            get(name)
        except RegistryError as e:
            raise ConfigError(f"{src}: key '{key}': {e}") from None
    estimator_inputs = frozenset({"num_actions", "step_rewards", "step_mask", "context", "state", "weights"})
    for key, what, options, declared in (
        (
            "algorithm.estimator_kwargs",
            f"estimator {a.estimator!r}",
            a.estimator_kwargs,
            declared_options(advantages.get(a.estimator), 2, estimator_inputs),
        ),
        (
            "algorithm.loss_kwargs",
            f"loss {a.loss!r}",
            a.loss_kwargs if a.objective is None else {},
            declared_options(
                losses.get(a.loss), 4, frozenset({"group_std", "entropy", "step", "total_steps"})
            ),
        ),
        (
            "algorithm.filter_kwargs",
            f"filter {a.filter!r}",
            a.filter_kwargs,
            declared_options(filters.get(a.filter), 0),
        ),
        (
            "data.sampler_kwargs",
            f"prompt sampler {cfg.data.sampler!r}",
            cfg.data.sampler_kwargs,
            declared_options(prompt_samplers.get(cfg.data.sampler), 2),
        ),
        (
            "rollout.loop_kwargs",
            f"rollout loop {cfg.rollout.loop!r}",
            {k: v for k, v in cfg.rollout.loop_kwargs.items() if k != "environment"},
            declared_options(rollout_loops.get(cfg.rollout.loop).__init__, 1, frozenset({"environment"})),
        ),
    ):
        if key == "algorithm.estimator_kwargs" and "weights" in options:
            options = {k: v for k, v in options.items() if k != "weights"}
        check_options(src, key, what, options, declared)


def needs_reference(cfg: Config) -> bool:
    """Whether the run reads the reference policy: a KL penalty (``algorithm.kl_coef`` > 0), or an estimator
    or reward transform that reads reference log-probs (``logp_ref_*`` context fields, e.g. ``ace``).
    Pipelines pass it as the policy's ``need_reference``."""
    from mmalign.algorithms import advantages, reward_transforms

    a = cfg.algorithm
    if a.kl_coef > 0:
        return True
    try:
        fields = set(advantages.context_fields(a.estimator))
        for spec in a.reward_transforms:
            fields |= set(reward_transforms.context_fields(str(spec.get("name"))))
    except KeyError:  # an unknown name: check_names reports it
        return False
    return bool(fields & {"logp_ref_mean", "logp_ref_sum"})
