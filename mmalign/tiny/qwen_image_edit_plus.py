"""A tiny Qwen-Image-Edit-Plus pipeline built offline from config kwargs (`mmalign.policies.qwen_image_edit_plus`).

Builder registered in `mmalign.tiny.BUILDERS`: ``qwen_image_edit_plus_tiny`` (`build_tiny_qwen_image_edit_plus`):
random weights (tests, parity with the pipeline, ``configs/image_edit-qwen-plus-tiny.yaml``; a few seconds).

Details: docs/image_edit.md, "mmalign.tiny.qwen_image_edit_plus".
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from mmalign.policies.qwen_image_components import QwenImageEditPlusComponents
from mmalign.tiny import BUILDERS

__all__ = [
    "build_tiny_qwen_image_edit_plus",
    "combine_rows",
    "tiny_qwen_image_edit_plus_components",
    "write_combine_rows",
]


def tiny_qwen_image_edit_plus_components(
    *, z_dim: int = 4, text_hidden: int = 32, num_layers: int = 2, seed: int = 0
) -> QwenImageEditPlusComponents:
    """Random tiny Qwen-Image-Edit-Plus components (see the module docstring), deterministic for `seed`."""
    from mmalign.tiny.qwen_image_edit import tiny_qwen_image_edit_components

    c = tiny_qwen_image_edit_components(
        z_dim=z_dim, text_hidden=text_hidden, num_layers=num_layers, seed=seed
    )
    return QwenImageEditPlusComponents(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)})


def build_tiny_qwen_image_edit_plus(
    path: str | Path, *, z_dim: int = 4, text_hidden: int = 32, num_layers: int = 2, seed: int = 0
) -> Path:
    """Write a random tiny Qwen-Image-Edit-Plus folder at `path`; returns `path`."""
    path = Path(path)
    tiny_qwen_image_edit_plus_components(
        z_dim=z_dim, text_hidden=text_hidden, num_layers=num_layers, seed=seed
    ).save_pretrained(path)
    return path


@BUILDERS.register("qwen_image_edit_plus_tiny", minutes=0.05)
def _build_random(path: Path) -> None:
    build_tiny_qwen_image_edit_plus(path)


def combine_rows(scenes: Path) -> list[dict[str, Any]]:
    """Every two-picture edit of the scenes in `scenes` (PNG files named ``<colour>-<slot>[_<colour>-<slot>]``):
    picture 1 a one-square scene, picture 2 another whose square goes into it, where the two-square target scene
    exists; paths relative to the parent of `scenes`, sorted by picture 1 then picture 2."""
    names = {p.name for p in scenes.glob("*.png")}
    singles = sorted(n for n in names if "_" not in n)
    rows = []
    for a in singles:
        for b in singles:
            target = f"{a[:-4]}_{b}"
            if a == b or target not in names:
                continue
            colour = b.split("-")[0]
            rows.append(
                {
                    "prompt": f"put the {colour} square of picture 2 into picture 1",
                    "edit": "combine",
                    "source_image": [f"{scenes.name}/{a}", f"{scenes.name}/{b}"],
                    "target_image": f"{scenes.name}/{target}",
                }
            )
    return rows


def write_combine_rows(folder: Path, *, eval_every: int = 5) -> dict[str, Path]:
    """Write `combine_rows` of ``folder/scenes`` as ``plus_train.jsonl`` and ``plus_eval.jsonl`` (every
    `eval_every`-th row) in `folder`; returns the two paths by split."""
    rows = combine_rows(Path(folder) / "scenes")
    out = {}
    for split, keep in (("train", lambda i: i % eval_every), ("eval", lambda i: not i % eval_every)):
        path = Path(folder) / f"plus_{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for i, r in enumerate(rows) if keep(i)))
        out[split] = path
    return out
