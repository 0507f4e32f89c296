"""The `mmalign` command.

    mmalign train CONFIG.yaml [key.sub=value ...] [--resume]
    mmalign list [pipelines|rewards|estimators|losses|filters|samplers|steps]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmalign.config import Config

EXPECTED_ERRORS: tuple[type[BaseException], ...] = ()

_ERROR_CLASSES = [
    ("mmalign.config", "ConfigError"),
    ("mmalign.data", "DataError"),
    ("mmalign.registry", "RegistryError"),
    ("mmalign.trainer", "TrainingError"),
    ("rewards", "RewardError"),
]


def _expected_errors() -> tuple[type[BaseException], ...]:
    """Errors reported as one `mmalign: error: ...` line (anything else also prints its traceback)."""
    import importlib

    found: list[type[BaseException]] = [OSError]
    for module, name in _ERROR_CLASSES:
        try:  # a module that fails to import must not turn the error report itself into a crash
            found.append(getattr(importlib.import_module(module), name))
        except Exception:  # pragma: no cover - only when part of the package is broken
            continue
    return tuple(found)


def _check_names(cfg: Config) -> None:
    """Registry names of `cfg.algorithm`, checked before the (possibly slow) model is built."""
    from mmalign import advantages, filters, losses
    from mmalign.config import ConfigError
    from mmalign.registry import RegistryError

    a = cfg.algorithm
    for key, get, name in (
        ("algorithm.estimator", advantages.get, a.estimator),
        ("algorithm.loss", losses.get, a.loss),
        ("algorithm.loss_agg", losses.AGGREGATIONS.get, a.loss_agg),
        ("algorithm.kl_estimator", losses.KL_ESTIMATORS.get, a.kl_estimator),
        ("algorithm.filter", filters.get, a.filter),
    ):
        try:
            get(name)
        except RegistryError as e:
            raise ConfigError(f"{cfg.source}: key '{key}': {e}") from None


def cmd_train(args: argparse.Namespace) -> int:
    import pipelines
    from mmalign.config import ConfigError, load_config
    from mmalign.registry import RegistryError
    from mmalign.trainer import GroupTrainer

    cfg = load_config(args.config, args.overrides)
    try:
        build = pipelines.get(cfg.pipeline)
    except RegistryError as e:
        raise ConfigError(f"{cfg.source}: key 'pipeline': {e}") from None
    _check_names(cfg)
    components = build(cfg)
    trainer = GroupTrainer(cfg, components, resume=args.resume)
    history = trainer.train()
    trainer.accelerator.end_training()  # closes the process group of a multi-process run cleanly
    args._multi_process = trainer.world > 1
    if trainer.is_main and history:
        first, last = history[0], history[-1]
        print(
            f"done: steps {first['step']}..{last['step']}, reward/mean {first.get('reward/mean', float('nan')):.3f} "
            f"-> {last.get('reward/mean', float('nan')):.3f}; run directory {cfg.output_dir}"
        )
    return 0


def _list_section(title: str, items: list[tuple[str, str]]) -> None:
    print(f"{title}:")
    width = max((len(n) for n, _ in items), default=0)
    for name, desc in items:
        print(f"  {name:<{width}}  {desc}")


def cmd_list(args: argparse.Namespace) -> int:
    what = args.what
    if what in ("pipelines", "all"):
        import pipelines

        _list_section("pipelines", [(n, pipelines.describe(n)) for n in pipelines.names()])
    if what in ("rewards", "all"):
        import rewards

        items = [(n, rewards.REGISTRY.describe(n)) for n in rewards.names()]
        items += [(n, "(entry point)") for n in rewards.entry_point_names() if n not in rewards.names()]
        _list_section("rewards", items)
    if what in ("estimators", "all"):
        from mmalign import advantages

        _list_section("estimators", [(n, advantages.REGISTRY.describe(n)) for n in advantages.names()])
    if what in ("losses", "all"):
        from mmalign import losses

        _list_section("losses", [(n, losses.REGISTRY.describe(n)) for n in losses.names()])
        _list_section("loss aggregations (algorithm.loss_agg)", [(n, losses.AGGREGATIONS.describe(n)) for n in losses.AGGREGATIONS.names()])
        _list_section("KL estimators (algorithm.kl_estimator)", [(n, losses.KL_ESTIMATORS.describe(n)) for n in losses.KL_ESTIMATORS.names()])
    if what in ("samplers", "all"):
        from mmalign import samplers

        _list_section("prompt samplers (data.sampler)", [(n, samplers.SAMPLERS.describe(n)) for n in samplers.names()])
    if what in ("steps", "all"):
        from mmalign import sde

        _list_section("denoising steps (mmalign.sde.step)", [(n, sde.STEPS.describe(n)) for n in sde.names()])
    if what in ("filters", "all"):
        from mmalign import filters

        _list_section("filters (algorithm.filter)", [(n, filters.FILTERS.describe(n)) for n in filters.names()])
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmalign", description="Group-relative RL for multimodal and generative models")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train with a YAML config")
    t.add_argument("config", help="path to a YAML config (see configs/)")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-5 output_dir=runs/x")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir")
    t.set_defaults(func=cmd_train)

    ls = sub.add_parser("list", help="show what is registered")
    ls.add_argument(
        "what", nargs="?", default="all", choices=["pipelines", "rewards", "estimators", "losses", "filters", "samplers", "steps", "all"]
    )
    ls.set_defaults(func=cmd_list)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        rc = int(args.func(args) or 0)
        if getattr(args, "_multi_process", False):
            # Everything is written and closed. Skip interpreter teardown, where gloo's threads can
            # abort a finished multi-process run ("terminate called without an active exception").
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
        return rc
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug or not isinstance(e, _expected_errors()):
            traceback.print_exc()
        msg = str(e)
        if e.__cause__ is not None and args.debug is False and isinstance(e, _expected_errors()):
            cause = e.__cause__
            if str(cause) and str(cause) not in msg:
                msg += f"\n  caused by {type(cause).__name__}: {cause}"
        print(f"mmalign: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
