"""``python -m rewards.geneval_server``: serve GenEval scoring over HTTP for the ``geneval`` reward.

Details: docs/reward_plugins.md, "rewards.geneval_server".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .geneval import COLOUR_CLASSIFIERS, DETECTORS, GENEVAL_MODES

__all__ = ["build_remote_argv", "main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rewards.geneval_server",
        description="Serve GenEval scoring (geneval_local) for the `geneval` reward; other flags go to "
        "`python -m rewards.remote` (--host, --port, --token-env, limits).",
    )
    parser.add_argument(
        "--detector",
        default="mmdet",
        help=f"{' | '.join(DETECTORS)} | package.module:factory (default mmdet)",
    )
    parser.add_argument("--detector-kwargs", default="{}", help="the detector's options as a JSON object")
    parser.add_argument(
        "--colour-classifier",
        default="clip",
        help=f"{' | '.join(COLOUR_CLASSIFIERS)} | package.module:factory (default clip)",
    )
    parser.add_argument(
        "--colour-kwargs", default="{}", help="the colour classifier's options as a JSON object"
    )
    parser.add_argument(
        "--mode", default="score", choices=GENEVAL_MODES, help="default when a request sets none"
    )
    parser.add_argument("--threshold", type=float, default=0.3, help="detection confidence (GenEval: 0.3)")
    parser.add_argument("--counting-threshold", type=float, default=0.9, help="for tag 'counting' (0.9)")
    parser.add_argument("--max-objects", type=int, default=16, help="boxes kept per class (16)")
    parser.add_argument("--max-overlap", type=float, default=1.0, help="suppression IoU; 1 = none (1.0)")
    parser.add_argument(
        "--position-threshold", type=float, default=0.1, help="relative-position margin (0.1)"
    )
    return parser


def build_remote_argv(argv: Sequence[str] | None = None) -> list[str]:
    """The ``python -m rewards.remote`` arguments that serve ``geneval_local`` as `argv` asks."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    options: dict[str, object] = {}
    for flag, text in (("--detector-kwargs", args.detector_kwargs), ("--colour-kwargs", args.colour_kwargs)):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            parser.error(f"{flag} is not JSON: {e}")
        if not isinstance(value, dict):
            parser.error(f"{flag} must be a JSON object, got {text!r}")
        options[flag[2:].replace("-", "_")] = value
    if any(a == "--reward" or a.startswith(("--reward=", "--kwargs")) for a in rest):
        parser.error("--reward and --kwargs are set by this command; give the GenEval flags instead")
    options.update(
        detector=args.detector,
        colour_classifier=args.colour_classifier,
        mode=args.mode,
        threshold=args.threshold,
        counting_threshold=args.counting_threshold,
        max_objects=args.max_objects,
        max_overlap=args.max_overlap,
        position_threshold=args.position_threshold,
    )
    return ["--reward", "geneval_local", "--kwargs", json.dumps(options), *rest]


def main(argv: Sequence[str] | None = None) -> int:
    from .remote import main as remote_main

    return remote_main(build_remote_argv(argv))


if __name__ == "__main__":
    sys.exit(main())
