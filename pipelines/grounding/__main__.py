"""``python -m pipelines.grounding convert|check ...``: the grounding data tools (`pipelines.grounding.data`)."""

from pipelines.grounding.data import main

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m pipelines.grounding"))
