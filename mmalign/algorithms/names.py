"""The algorithm a config names, checked before anything loads.

`check_names` is the one check of the registry names of ``algorithm`` and ``data.sampler`` and of the options
each ``*_kwargs`` passes to them: every registered function or class declares its options in its signature
(keyword-only parameters with defaults), so an unknown option is refused with close matches, and a value of the
wrong type for a default that is a bool, a number or a string is refused naming the key. `needs_reference`
says whether a run reads the reference policy. The command line's validation (`mmalign.app.preflight.validate`)
runs `check_names` before any model is built; `mmalign.training.trainer.GroupTrainer` for a config built in code.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from mmalign.config import Config
from mmalign.errors import ConfigError
from mmalign.registry import RegistryError

__all__ = ["check_names", "check_options", "declared_options", "needs_reference"]


def declared_options(
    fn: Callable[..., Any], skip: int, exclude: frozenset[str] = frozenset()
) -> dict[str, Any] | None:
    """The options `fn` declares after its first `skip` positional parameters, with their defaults
    (`inspect.Parameter.empty`: required), minus `exclude` (inputs the caller supplies); None when `fn` also
    takes ``**kwargs`` (it checks its options itself)."""
    params = list(inspect.signature(inspect.unwrap(fn)).parameters.values())[skip:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {
        p.name: p.default
        for p in params
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        and p.name not in exclude
    }


def _type_ok(value: Any, default: Any) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int | float):
        return isinstance(value, int | float) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, str)
    return True  # None, containers, tensors: the function checks them


def check_options(
    source: str, key: str, what: str, options: Mapping[str, Any], declared: Mapping[str, Any] | None
) -> None:
    """`options` (the config's ``key``, e.g. ``algorithm.estimator_kwargs``) against what `what` declares: an
    unknown option (with close matches) or a value whose type differs from a bool / number / string default is
    a `ConfigError` naming the key."""
    if declared is None:
        return
    for name, value in options.items():
        if name not in declared:
            close = difflib.get_close_matches(str(name), list(declared), n=2)
            hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
            listed = ", ".join(sorted(declared)) or "none"
            raise ConfigError(f"{source}: unknown key '{key}.{name}'{hint}; {what} takes: {listed}")
        default = declared[name]
        if default is not inspect.Parameter.empty and not _type_ok(value, default):
            raise ConfigError(
                f"{source}: key '{key}.{name}' must be {type(default).__name__} (like its default "
                f"{default!r}), got {type(value).__name__} {value!r}"
            )


def check_names(cfg: Config) -> None:
    """The registry names of the ``algorithm`` section (estimator, loss, loss aggregation, KL estimator, filter,
    objective, reward transforms) and the prompt sampler (``data.sampler``) are registered, their ``*_kwargs``
    are options they declare, and ``adora``'s ``rule`` is one it knows: a `ConfigError` naming the key, with
    close matches, otherwise."""
    from mmalign.algorithms import advantages, filters, flow_objectives, losses, reward_transforms
    from mmalign.data import prompt_samplers

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
        known = flow_objectives.options(a.objective)
        unknown = sorted(set(a.objective_kwargs) - set(known))
        if unknown:
            raise ConfigError(
                f"{src}: key 'algorithm.objective_kwargs': {a.objective!r} takes no option "
                f"{', '.join(map(repr, unknown))} (it takes {', '.join(sorted(known))})"
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
    if a.estimator == "adora":  # the release's rule is the default; a misspelt one fails here, not at step 1
        rule = a.estimator_kwargs.get("rule", "release")
        if rule not in advantages.ADORA_RULES:
            raise ConfigError(
                f"{src}: key 'algorithm.estimator_kwargs.rule': adora's rule must be one of "
                f"{', '.join(map(repr, advantages.ADORA_RULES))} (release: the authors' released recipe), "
                f"got {rule!r}"
            )
    for key, get, name in (
        ("algorithm.estimator", advantages.get, a.estimator),
        ("algorithm.loss", losses.get, a.loss),
        ("algorithm.loss_agg", losses.AGGREGATIONS.get, a.loss_agg),
        ("algorithm.kl_estimator", losses.KL_ESTIMATORS.get, a.kl_estimator),
        ("algorithm.filter", filters.get, a.filter),
        ("data.sampler", prompt_samplers.get, cfg.data.sampler),
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
