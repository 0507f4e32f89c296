"""``python -m mmalign ...`` is the ``mmalign`` command, with the same import path.

``python -m`` puts the working directory first on ``sys.path`` (Python's rule); the ``mmalign`` console script
does not. A config's ``module:attr`` reference (a reward, an environment, a geometry model) imports that module,
so with the working directory on the path a ``payload.py`` lying next to the config (run from its folder)
would be imported and run. `drop_working_directory` removes that entry, so both commands import the same
modules: installed packages and ``PYTHONPATH`` (set ``PYTHONPATH=.`` to import from the working directory on
purpose). It stays when mmalign itself was imported from there (a source checkout run without installing).
"""

from __future__ import annotations

import importlib.util
import os
import sys

PACKAGES = ("mmalign", "rewards", "pipelines")
"""The top-level packages of this project (a source checkout holds all three side by side)."""


def _found_in(folder: str) -> bool:
    """Whether every package of `PACKAGES` is found in `folder` on the current ``sys.path``."""
    for name in PACKAGES:
        spec = importlib.util.find_spec(name) if name not in sys.modules else sys.modules[name].__spec__
        origin = getattr(spec, "origin", None)
        if not origin or os.path.dirname(os.path.dirname(os.path.realpath(origin))) != folder:
            return False
    return True


def drop_working_directory() -> bool:
    """Remove the working directory that ``python -m`` put first on ``sys.path``; whether it did. Nothing
    changes under ``python -P`` (no such entry) or when the first entry is another folder. Run from a source
    checkout (the working directory holds ``mmalign/``), the entry goes only if the project's packages are
    still found there without it (an editable install), else it stays: the checkout is the import path."""
    if sys.flags.safe_path or not sys.path:
        return False
    cwd = os.path.realpath(os.getcwd())
    if os.path.realpath(sys.path[0] or os.curdir) != cwd:
        return False
    here = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    first = sys.path.pop(0)
    importlib.invalidate_caches()
    if here == cwd and not _found_in(cwd):
        sys.path.insert(0, first)
        return False
    return True


if __name__ == "__main__":
    drop_working_directory()
    from mmalign.app.cli import main

    raise SystemExit(main())
