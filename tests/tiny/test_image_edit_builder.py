"""mmalign.tiny.image_edit's warm-start check: `kept_accuracy` (is the square the instruction does not name
left as it was) on hand-drawn scenes, and the builder's stop after `patience` checks in a row at the target."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mmalign.tiny import image_edit as tiny_edit
from mmalign.tiny.image_edit import Square, draw_scene, edit_examples, kept_accuracy


def _two_square_recolour():
    return next(e for e in edit_examples() if e.edit == "recolour" and len(e.source) == 2)


def test_kept_accuracy_on_drawn_scenes() -> None:
    ex = _two_square_recolour()
    (other,) = [s for s in ex.source if s != ex.before]
    spare = next(c for c in tiny_edit.COLOURS if c not in {other.colour, ex.before.colour, ex.after.colour})
    right = draw_scene(ex.target)
    leaked = draw_scene((ex.after, Square(spare, other.slot)))  # the untouched square took another colour
    gone = draw_scene((ex.after,))  # the untouched square was erased
    assert kept_accuracy(right[None], [ex]) == 1.0
    assert kept_accuracy(leaked[None], [ex]) == 0.0
    assert kept_accuracy(gone[None], [ex]) == 0.0
    # a hand count: 1 of 2 kept; one-square scenes have nothing to keep and do not count
    single = next(e for e in edit_examples() if len(e.source) == 1)
    assert kept_accuracy(torch.stack([right, leaked, draw_scene(single.target)]), [ex, ex, single]) == 0.5
    assert math.isnan(kept_accuracy(draw_scene(single.target)[None], [single]))


def test_kept_accuracy_fill_threshold() -> None:
    """A square counts as kept from `min_fill` of its box's pixels on: half of the box painted white keeps it
    at min_fill 0.5 and not at 0.6."""
    ex = _two_square_recolour()
    (other,) = [s for s in ex.source if s != ex.before]
    img = draw_scene(ex.target)
    x0, y0, x1, y1 = tiny_edit.slot_box(other.slot)
    img[:, y0 : y0 + (y1 - y0) // 2, x0:x1] = 1.0
    assert kept_accuracy(img[None], [ex], min_fill=0.5) == 1.0
    assert kept_accuracy(img[None], [ex], min_fill=0.6) == 0.0


@pytest.mark.parametrize(("patience", "stopped_at"), [(1, 1), (2, 2), (3, 3)])
def test_builder_stops_after_patience_checks_at_the_target(
    tmp_path: Path, patience: int, stopped_at: int
) -> None:
    """A target of 0 is reached at every check (one per step here), so the warm start stops after exactly
    `patience` checks, and each check records (step, exact, graded, kept)."""
    out = tmp_path / "m"
    out.mkdir()
    tiny_edit.build_image_edit(
        out,
        vae_steps=2,
        steps=10,
        batch_size=2,
        min_steps=0,
        check_every=1,
        target_accuracy=0.0,
        patience=patience,
        num_checks=1,
        check_steps=1,
        progress=False,
    )
    meta = json.loads((out / "mmalign_tiny.json").read_text())
    assert meta["steps_done"] == stopped_at and meta["patience"] == patience
    assert [c[0] for c in meta["checks"]] == list(range(1, stopped_at + 1))
    assert all(len(c) == 4 for c in meta["checks"])


def test_builder_rejects_bad_patience(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="patience"):
        tiny_edit.build_image_edit(tmp_path, patience=0, progress=False)
