"""`mmalign.data.batch`: the rollout-columns rule (`group_fields`), left padding, and slicing / concatenating a
`Rollout` (every field follows the same rows). Expected values are written out by hand."""

from __future__ import annotations

import torch

from mmalign.data.batch import Rollout, group_fields, left_pad


def test_group_fields_repeats_each_row_and_keeps_every_rows_columns() -> None:
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "image": "x.png"}]
    prompts, group, columns = group_fields(rows, 2)
    assert prompts == ["a", "a", "b", "b"]
    assert group.tolist() == [0, 0, 1, 1]
    # the union of the rows' columns, in first-seen order; None where a row lacks one
    assert list(columns) == ["prompt", "answer", "image"]
    assert columns["answer"] == ["1", "1", None, None]
    assert columns["image"] == [None, None, "x.png", "x.png"]


def test_left_pad() -> None:
    ids, att = left_pad([[5, 6, 7], [8]], pad_value=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert att.tolist() == [[1, 1, 1], [0, 0, 1]]


def _rollout() -> Rollout:
    return Rollout(
        group=torch.tensor([0, 0, 1, 1]),
        mask=torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]], dtype=torch.bool),
        prompts=["a", "a", "b", "b"],
        logp_old=torch.arange(8.0).reshape(4, 2),
        columns={"answer": ["1", "1", "2", "2"]},
        outputs={"texts": ["w", "x", "y", "z"]},
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
    )


def test_slicing_takes_the_same_rows_of_every_field() -> None:
    part = _rollout()[[3, 0]]
    assert part.group.tolist() == [1, 0] and part.prompts == ["b", "a"]
    assert part.logp_old.tolist() == [[6.0, 7.0], [0.0, 1.0]]
    assert part.mask.tolist() == [[False, False], [True, True]]
    assert part.columns["answer"] == ["2", "1"] and part.outputs["texts"] == ["z", "w"]
    assert part.advantages.tolist() == [-0.5, 1.0]


def test_cat_is_the_inverse_of_slicing() -> None:
    ro = _rollout()
    back = Rollout.cat([ro[[0, 1]], ro[[2, 3]]])
    assert torch.equal(back.logp_old, ro.logp_old) and torch.equal(back.mask, ro.mask)
    assert back.prompts == ro.prompts and back.columns == ro.columns and back.outputs == ro.outputs
