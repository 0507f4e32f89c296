"""Writes the tiny image-editing task (run once; the files are committed).

The edit world of `mmalign.tiny.image_edit`: one or two squares of the shapes-world palette in fixed slots
(left, right, top, bottom, center) of a 32 x 32 white image, and an instruction that recolours, moves or
removes the square it names by colour ("make the red square blue", "move the green square to the left",
"remove the yellow square"). Writes, next to this script:

- ``scenes/``: every source and target image the rows name, one PNG per scene (``red-left_blue-top.png``);
- ``masks/``: the edit regions (white: the boxes that change, 1 px wider), one PNG per set of changed slots;
- ``train.jsonl``: 384 edits for RL, which the ``image_edit`` tiny builder does not train on either (so many that
  RL cannot memorise them: with 64, RL raised their accuracy and lowered the held-out one);
- ``eval.jsonl``: the 48 held-out edits (16 of each kind), which the tiny builder never trains on.

A row: ``prompt`` (the instruction), ``edit`` (the kind), ``source_image`` / ``target_image`` / ``edit_mask``
(paths relative to this folder, shared between rows), ``edit_bbox`` (the changed boxes as fractions of the image),
``source_caption`` / ``target_caption`` (the edited square before and after, in the tiny CLIP's words) and
``target_objects`` (the target scene's squares with their boxes: what ``shapes_edit_accuracy`` checks).

    python assets/image_edit/make_data.py
"""

from __future__ import annotations

from pathlib import Path

from mmalign.tiny.image_edit import write_image_edit_dataset

HERE = Path(__file__).resolve().parent


def main() -> None:
    for split, path in write_image_edit_dataset(HERE, n_train=384, n_eval=16, seed=0).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
