"""``python -m mmalign ...`` is the ``mmalign`` command."""

from mmalign.app.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
