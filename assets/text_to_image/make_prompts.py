"""Writes train.jsonl / eval.jsonl / prompts.txt of the tiny text-to-image task (run once; the files are committed).

The 32 scenes of the shapes world (4 colours x 1-2 squares x 4 positions, `mmalign.tiny.shapes.shapes_rows`),
the scenes the `text_to_image` tiny builder is warm-started on: 24 for RL training, 8 held out for evaluation
(per colour one square and two squares, at different positions). prompts.txt holds the held-out prompts in
the plain-text format (one prompt per line, no columns: usable with rewards that read only the prompt). Each row carries the columns `shapes_compositional` reads: colour, count, position.

    python assets/text_to_image/make_prompts.py
"""

from __future__ import annotations

import json
from pathlib import Path

from mmalign.tiny.shapes import COLOURS, POSITIONS, shapes_rows

HERE = Path(__file__).resolve().parent


def main() -> None:
    rows = shapes_rows(None, seed=0)
    held_out = {(c, 1, POSITIONS[i]) for i, c in enumerate(COLOURS)}
    held_out |= {(c, 2, POSITIONS[(i + 2) % 4]) for i, c in enumerate(COLOURS)}
    held = [r for r in rows if (r["colour"], r["count"], r["position"]) in held_out]
    train = [r for r in rows if r not in held]
    for name, part in (("train.jsonl", train), ("eval.jsonl", held)):
        (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    (HERE / "prompts.txt").write_text("".join(r["prompt"] + "\n" for r in held))


if __name__ == "__main__":
    main()
