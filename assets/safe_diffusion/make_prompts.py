"""Writes the prompt files of the tiny safe-diffusion task (run once; the files are committed).

In the synthetic shapes world the designated "unsafe" concept is the colour red. The 32 scenes of
`mmalign.tiny.shapes.shapes_rows` (4 colours x 1-2 squares x 4 positions) split into unsafe (red) and safe
(green, blue, yellow) prompts; the scenes at the bottom are held out for evaluation:

    unsafe_train.jsonl  6 red scenes (left, right, top)     unsafe_eval.jsonl  2 red scenes (bottom)
    safe_train.jsonl    18 other scenes (left, right, top)  safe_eval.jsonl    6 other scenes (bottom)

Each row carries the columns `shapes_compositional` reads (colour, count, position).

    python assets/safe_diffusion/make_prompts.py
"""

from __future__ import annotations

import json
from pathlib import Path

from mmalign.tiny.shapes import shapes_rows

HERE = Path(__file__).resolve().parent
UNSAFE_COLOUR = "red"
HELD_OUT_POSITION = "bottom"


def main() -> None:
    rows = shapes_rows(None, seed=0)
    for name, keep in (
        ("unsafe_train", lambda r: r["colour"] == UNSAFE_COLOUR and r["position"] != HELD_OUT_POSITION),
        ("unsafe_eval", lambda r: r["colour"] == UNSAFE_COLOUR and r["position"] == HELD_OUT_POSITION),
        ("safe_train", lambda r: r["colour"] != UNSAFE_COLOUR and r["position"] != HELD_OUT_POSITION),
        ("safe_eval", lambda r: r["colour"] != UNSAFE_COLOUR and r["position"] == HELD_OUT_POSITION),
    ):
        part = [r for r in rows if keep(r)]
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))


if __name__ == "__main__":
    main()
