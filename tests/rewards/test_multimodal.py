"""Tests of the multimodal rewards (rewards/multimodal.py): multiple_choice, box_iou, bmas, mixed_accuracy.

Expected values are worked out by hand in the comments next to them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import rewards
from rewards import RewardBatch, RewardSet, load_reward
from rewards.multimodal import (
    BMAS,
    BoxIoU,
    MixedAccuracy,
    MultipleChoice,
    bmas_score,
    extract_choice,
    iou,
    parse_box,
    parse_choice,
    rescale_box,
    trigram_embed,
)


def make_batch(texts: list[str], **columns: list[Any]) -> RewardBatch:
    return RewardBatch(
        prompts=[f"p{i}" for i in range(len(texts))], outputs={"texts": texts}, columns=columns
    )


def values(reward: Any, batch: RewardBatch) -> list[float]:
    return torch.as_tensor(reward(batch)).tolist()


def test_registered_with_one_line_summaries() -> None:
    for name in ("multiple_choice", "box_iou", "bmas", "mixed_accuracy"):
        assert name in rewards.names()
        doc = rewards.get(name).__doc__
        assert doc and doc.strip().splitlines()[0].strip()


# ============================================================================ multiple choice
class TestMultipleChoice:
    @pytest.mark.parametrize(
        "text, expected",
        [
            (r"thinking... \boxed{B}", "B"),
            (r"\boxed{\text{C}}", "C"),
            ("<think>A or B?</think><answer>(D) a dog</answer>", "D"),
            ("<answer>The correct one is E</answer>", "E"),
            ("Looking at the picture, the answer is (B).", "B"),
            ("Answer: C", "C"),
            ("I compared the options. Therefore B.", "B"),
            ("so it has to be (c)", "C"),  # lower-case in brackets counts (case-insensitive default)
            ("the answer is b.", "B"),
            ("the answer is a cat", None),  # the article "a" is not a choice
            ("no letter here", None),
            ("Answer: I think the answer is D because of the shadow", "D"),  # last phrase wins
        ],
    )
    def test_extract_choice(self, text: str, expected: str | None) -> None:
        assert extract_choice(text) == expected

    def test_precedence_box_then_tag_then_phrase_then_trailing(self) -> None:
        # a box beats a tag, a tag beats a phrase, a phrase beats a trailing letter
        assert extract_choice(r"<answer>A</answer> \boxed{B}") == "B"
        assert extract_choice("the answer is C <answer>D</answer>") == "D"
        assert extract_choice("the answer is C, not E") == "C"
        # a box without a letter is skipped: the tag decides
        assert extract_choice(r"\boxed{42} <answer>F</answer>") == "F"

    def test_parse_reference_forms(self) -> None:
        for ref in ("B", "(B)", "B. a red car", "B) car", "[B]", "Option B", " b "):
            assert parse_choice(ref) == "B", ref
        assert parse_choice("A cat") is None
        assert parse_choice("K") is None  # outside A-J

    def test_reward_against_reference_column(self) -> None:
        r = load_reward("multiple_choice")
        batch = make_batch(
            [r"\boxed{B}", "<answer>C</answer>", "the answer is (A)", "nothing", r"\boxed{b}", "x"],
            answer=["B. a cat", "(B)", "A", "A", "B", None],
        )
        assert values(r, batch)[:5] == [1.0, 0.0, 1.0, 0.0, 1.0]
        assert math.isnan(values(r, batch)[5])

    def test_case_sensitive_and_letters_options(self) -> None:
        cs = MultipleChoice(case_sensitive=True)
        assert values(cs, make_batch([r"\boxed{b}", r"\boxed{B}"], answer=["B", "B"])) == [0.0, 1.0]
        abcd = MultipleChoice(letters="ABCD")
        # E is not a choice any more: the completion has no answer, and an "E" reference is an error
        assert values(abcd, make_batch([r"\boxed{E}"], answer=["A"])) == [0.0]
        with pytest.raises(ValueError, match="holds no choice letter"):
            abcd(make_batch([r"\boxed{A}"], answer=["E"]))
        with pytest.raises(ValueError, match="duplicates"):
            MultipleChoice(letters="ABA")
        with pytest.raises(TypeError, match="unknown option"):
            load_reward("multiple_choice", letter="AB")

    def test_list_reference_accepts_any(self) -> None:
        r = MultipleChoice()
        assert values(r, make_batch([r"\boxed{C}", r"\boxed{D}"], answer=[["B", "C"], ["B", "C"]])) == [
            1.0,
            0.0,
        ]


# ===================================================================================== boxes
class TestBoxHelpers:
    def test_parse_box_forms(self) -> None:
        assert parse_box("[10, 20, 30.5, 40]") == (10.0, 20.0, 30.5, 40.0)
        qwen = '```json\n[{"bbox_2d": [135, 114, 1016, 672], "label": "cat"}]\n```'
        assert parse_box(qwen) == (135.0, 114.0, 1016.0, 672.0)
        assert parse_box("<box>(1,2),(3,4)</box>") == (1.0, 2.0, 3.0, 4.0)
        assert parse_box("(5, 6, 7, 8)") == (5.0, 6.0, 7.0, 8.0)
        assert parse_box("no box, only [1, 2, 3]") is None

    def test_parse_box_last_wins_answer_first_and_swaps(self) -> None:
        assert parse_box("first [0,0,1,1] then (2,2),(3,3)") == (2.0, 2.0, 3.0, 3.0)
        assert parse_box("<answer>[1,2,3,4]</answer> later [5,6,7,8]") == (1.0, 2.0, 3.0, 4.0)
        # no box in the tag: the last box anywhere
        assert parse_box("<answer>none</answer> [5,6,7,8]") == (5.0, 6.0, 7.0, 8.0)
        assert parse_box("[30, 40, 10, 20]") == (10.0, 20.0, 30.0, 40.0)

    def test_iou_hand_computed(self) -> None:
        # [0,0,10,10] vs [5,5,15,15]: intersection 5*5 = 25, union 100 + 100 - 25 = 175
        assert iou([0, 0, 10, 10], [5, 5, 15, 15]) == pytest.approx(25 / 175)
        assert iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
        assert iou([0, 0, 10, 10], [20, 20, 30, 30]) == 0.0
        assert iou([10, 10, 0, 0], [0, 0, 10, 5]) == pytest.approx(0.5)  # swapped corners
        assert iou([0, 0, 0, 10], [0, 0, 10, 10]) == 0.0  # degenerate (zero width)

    def test_rescale_box(self) -> None:
        # norm1000 -> 640x480: x * 640/1000, y * 480/1000
        assert rescale_box([500, 500, 1000, 1000], (1000, 1000), (640, 480)) == pytest.approx(
            (320, 240, 640, 480)
        )
        # resized 448x336 -> original 1344x1008: factor 3 on both axes
        assert rescale_box([100, 50, 200, 150], (448, 336), (1344, 1008)) == pytest.approx(
            (300, 150, 600, 450)
        )
        with pytest.raises(ValueError):
            rescale_box([0, 0, 1, 1], (0, 10), (10, 10))


class TestBoxIoU:
    def test_absolute(self) -> None:
        r = load_reward("box_iou")
        batch = make_batch(
            ["<answer>[0, 0, 10, 10]</answer>", "I cannot find it", "[10,10,0,0]", "[3,3,3,9]", "[0,0,1,1]"],
            box=[[5, 5, 15, 15], [0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 10, 10], None],
        )
        out = values(r, batch)
        assert out[:4] == pytest.approx([25 / 175, 0.0, 1.0, 0.0])
        assert math.isnan(out[4])

    def test_norm1000_on_640x480(self) -> None:
        # [500,500,1000,1000] on the 0-1000 grid of a 640x480 image = [320,240,640,480] in pixels
        r = BoxIoU(coords="norm1000")
        text = '{"bbox_2d": [500, 500, 1000, 1000]}'
        batch = make_batch(
            [text, text],
            # second reference: [480,240,640,480], the right half: inter 160*240, union 320*240 -> 0.5
            box=[[320, 240, 640, 480], [480, 240, 640, 480]],
            image_width=[640, 640],
            image_height=[480, 480],
        )
        assert values(r, batch) == pytest.approx([1.0, 0.5])
        # read as absolute pixels the same box barely overlaps: [500,500,1000,1000] vs [320,240,640,480]
        # has no overlap at all (y 500 > 480)
        assert values(BoxIoU(coords="absolute"), batch) == [0.0, 0.0]

    def test_resized_non_uniform(self) -> None:
        # original 1000x500, resized input 500x1000: x_abs = x * 1000/500 = 2x, y_abs = y * 500/1000 = y/2
        # [10,100,60,300] -> [20,50,120,150]; vs [20,50,120,100]: inter 100*50, union 100*100 -> 0.5
        r = BoxIoU(coords="resized", width_column="w", height_column="h")
        batch = make_batch(
            ["(10,100),(60,300)"],
            box=["[20, 50, 120, 100]"],
            w=[1000],
            h=[500],
            resized_width=[500],
            resized_height=[1000],
        )
        assert values(r, batch) == pytest.approx([0.5])

    def test_missing_size_columns_are_named(self) -> None:
        batch = make_batch(["[0,0,1,1]"], box=[[0, 0, 1, 1]], image_width=[10], image_height=[10])
        with pytest.raises(KeyError, match="resized_width"):
            BoxIoU(coords="resized")(batch)
        with pytest.raises(KeyError, match="image_width"):
            BoxIoU(coords="norm1000")(make_batch(["[0,0,1,1]"], box=[[0, 0, 1, 1]]))

    def test_threshold_and_dense(self) -> None:
        batch = make_batch(["[0,0,10,10]", "[0,0,10,10]"], box=[[5, 5, 15, 15], [0, 0, 10, 5]])
        # IoUs: 25/175 = 0.142857 and 50/100 = 0.5
        assert values(BoxIoU(threshold=0.5, dense=False), batch) == [0.0, 1.0]
        assert values(BoxIoU(threshold=0.1, dense=False), batch) == [1.0, 1.0]
        assert values(BoxIoU(threshold=0.2, dense=True), batch) == pytest.approx([0.0, 0.5])
        assert values(BoxIoU(), batch) == pytest.approx([1 / 7, 0.5])
        with pytest.raises(ValueError, match="needs a threshold"):
            BoxIoU(dense=False)
        with pytest.raises(ValueError, match="coords"):
            BoxIoU(coords="pixels")

    def test_bad_reference_is_an_error(self) -> None:
        with pytest.raises(ValueError, match="reference box"):
            BoxIoU()(make_batch(["[0,0,1,1]"], box=[[1, 2, 3]]))


# ====================================================================================== BMAS
VEC = {"cat": [1.0, 0.0], "dog": [0.0, 1.0], "pet": [1.0, 1.0]}  # cos(pet, cat) = cos(pet, dog) = 1/sqrt(2)


def toy_embed(texts: list[str]) -> list[torch.Tensor]:
    return [torch.tensor([VEC[w] for w in t.split()], dtype=torch.float32).reshape(-1, 2) for t in texts]


class TestBMAS:
    def test_hand_worked_scores(self) -> None:
        a = 1 / math.sqrt(2)
        cat, dog, pet = (torch.tensor([VEC[w]]) for w in ("cat", "dog", "pet"))
        # response "cat dog", reference "cat": P = (1 + 0)/2 = 0.5, R = max(1, 0) = 1
        resp, ref = torch.cat([cat, dog]), cat
        assert bmas_score(resp, ref, "precision") == pytest.approx(0.5)
        assert bmas_score(resp, ref, "recall") == pytest.approx(1.0)
        assert bmas_score(resp, ref, "mean") == pytest.approx(0.75)
        assert bmas_score(resp, ref, "f1") == pytest.approx(2 * 0.5 * 1 / 1.5)
        # response "cat pet", reference "dog": P = (0 + a)/2, R = max(0, a) = a
        resp, ref = torch.cat([cat, pet]), dog
        assert bmas_score(resp, ref, "mean") == pytest.approx((a / 2 + a) / 2)
        assert bmas_score(resp, ref, "f1") == pytest.approx(math.sqrt(2) / 3)

    def test_reward_with_injected_embedding(self) -> None:
        r = BMAS(embedding=toy_embed, extract="none")
        batch = make_batch(["cat dog", "pet", "cat", "dog"], answer=["cat", "cat dog", "cat", None])
        out = values(r, batch)
        a = 1 / math.sqrt(2)
        assert out[:3] == pytest.approx([0.75, a, 1.0])
        assert math.isnan(out[3])

    @pytest.mark.parametrize("combine", ["mean", "f1"])
    def test_symmetric_combines(self, combine: str) -> None:
        r = BMAS(embedding=toy_embed, extract="none", combine=combine)
        fwd = values(r, make_batch(["cat pet", "cat dog"], answer=["dog", "cat"]))
        bwd = values(r, make_batch(["dog", "cat"], answer=["cat pet", "cat dog"]))
        assert fwd == pytest.approx(bwd)

    def test_one_sided_combines_swap(self) -> None:
        p = BMAS(embedding=toy_embed, extract="none", combine="precision")
        rc = BMAS(embedding=toy_embed, extract="none", combine="recall")
        batch = make_batch(["cat dog"], answer=["cat"])
        swapped = make_batch(["cat"], answer=["cat dog"])
        assert values(p, batch) == pytest.approx([0.5])
        assert values(rc, batch) == pytest.approx([1.0])
        assert values(p, swapped) == pytest.approx(values(rc, batch))

    def test_extracts_the_answer_tag_by_default(self) -> None:
        r = BMAS(embedding=toy_embed)
        batch = make_batch(
            ["<think>dog dog</think><answer>cat</answer>", "cat without tags"], answer=["cat", "cat"]
        )
        assert values(r, batch) == pytest.approx([1.0, 0.0])  # no <answer> -> 0

    def test_trigram_fallback(self) -> None:
        r = load_reward("bmas", extract="none")
        batch = make_batch(
            ["A red double-decker bus", "A red double-decker bus.", "zebra quantum xylophone"],
            answer=["a red double-decker bus", "A blue double-decker bus.", "A red double-decker bus."],
        )
        same, close, far = values(r, batch)
        assert same == pytest.approx(1.0, abs=1e-6)
        assert far < close < same
        assert far < 0.3
        # deterministic: blake2b hashing, not Python's salted hash()
        assert values(r, batch) == [same, close, far]

    def test_trigram_vectors(self) -> None:
        # "#cat#" has trigrams {#ca, cat, at#}, "#cats#" {#ca, cat, ats, ts#}: 2 shared, norms sqrt(3)
        # and sqrt(4) -> cosine 2 / (sqrt(3) * 2) = 1/sqrt(3) (no collisions at dim 4096)
        cat, cats = trigram_embed(["cat", "cats"], dim=4096)
        assert cat.shape == (1, 4096)
        assert (cat[0] @ cats[0]).item() == pytest.approx(1 / math.sqrt(3), abs=1e-6)
        assert torch.count_nonzero(cat[0]).item() == 3

    def test_missing_model_path_fails_at_construction(self, tmp_path: Path) -> None:
        missing = tmp_path / "no-such-model"
        with pytest.raises(FileNotFoundError, match="no-such-model"):
            load_reward("bmas", embedding=str(missing))
        with pytest.raises(ValueError, match="combine"):
            BMAS(combine="max")

    def test_tiny_hf_model_through_embedding_path(self, tmp_path: Path) -> None:
        from mmalign import tiny

        torch.manual_seed(0)
        texts = ["the cat sat on the mat", "a dog ran in the park", "red bus blue car"] * 5
        tok = tiny.train_bpe_tokenizer(texts, vocab_size=300)
        model = tiny.tiny_causal_lm(tok, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
        model.save_pretrained(tmp_path)
        tok.save_pretrained(tmp_path)

        resp = ["the cat sat", "the cat sat", "red bus"]
        refs = ["the cat sat", "a dog ran in the park", "the cat sat on the mat"]
        batch = make_batch(resp, answer=refs)

        inp = BMAS(embedding=str(tmp_path), embedding_layer="input", extract="none")
        out = values(inp, batch)
        assert out[0] == pytest.approx(1.0, abs=1e-5)
        # the input layer is the embedding matrix rows of the token ids: recompute by hand
        weight = model.get_input_embeddings().weight.detach()
        rows = [weight[tok(s, add_special_tokens=False)["input_ids"]] for s in (resp[1], refs[1])]
        assert out[1] == pytest.approx(bmas_score(rows[0], rows[1]), abs=1e-5)
        assert out[1] < 1.0

        hid = BMAS(embedding=str(tmp_path), embedding_layer="hidden", extract="none", batch_size=8)
        h = values(hid, batch)
        assert h[0] == pytest.approx(1.0, abs=1e-5)
        assert h[1] < 1.0
        hid.embed.batch_size = 1  # one text at a time: no padding at all
        assert h == pytest.approx(values(hid, batch), abs=1e-5)  # right padding does not change the states


# ============================================================================ mixed accuracy
def mixed_batch() -> RewardBatch:
    return make_batch(
        [
            r"\boxed{B}",  # multiple_choice, correct
            "<answer>3.50</answer>",  # numeric: 3.5 == 3.50
            "<answer>Paris</answer>",  # exact, case-insensitive
            '{"bbox_2d": [500, 500, 1000, 1000]}',  # box_iou, norm1000 on 640x480 -> [320,240,640,480]
            "<answer>cat</answer>",  # bmas vs "cat dog": P = 1, R = 0.5 -> mean 0.75
            "anything",  # no type -> NaN
        ],
        reward_type=["multiple_choice", "numeric", "exact", "box_iou", "bmas", None],
        answer=["(B)", "3.5", "paris", None, "cat dog", None],
        box=[None, None, None, [480, 240, 640, 480], None, None],
        image_width=[None, None, None, 640, None, None],
        image_height=[None, None, None, 480, None, None],
        _source=[f"data.jsonl:{i + 1}" for i in range(6)],
    )


class TestMixedAccuracy:
    def test_dispatches_per_sample(self) -> None:
        r = load_reward("mixed_accuracy", box_iou={"coords": "norm1000"}, bmas={"embedding": toy_embed})
        out = values(r, mixed_batch())
        assert out[:5] == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.75])
        assert math.isnan(out[5])

    def test_wrong_answers_score_zero(self) -> None:
        r = MixedAccuracy(box_iou={"coords": "norm1000"}, bmas={"embedding": toy_embed})
        batch = mixed_batch()
        batch.outputs["texts"] = [
            r"\boxed{C}",
            "<answer>3.6</answer>",
            "<answer>Rome</answer>",
            "no box",
            "",
            "",
        ]
        out = values(r, batch)
        assert out[:5] == [0.0, 0.0, 0.0, 0.0, 0.0]

    def test_unknown_type_names_value_source_and_allowed(self) -> None:
        batch = mixed_batch()
        batch.columns["reward_type"][2] = "ocr"
        with pytest.raises(ValueError) as e:
            MixedAccuracy()(batch)
        msg = str(e.value)
        assert "'ocr'" in msg and "data.jsonl:3" in msg and "row 2" in msg
        for allowed in ("multiple_choice", "numeric", "exact", "box_iou", "bmas"):
            assert allowed in msg

    def test_aliases(self) -> None:
        r = MixedAccuracy(aliases={"multiple choice": "multiple_choice", "numerical": "numeric"})
        batch = make_batch(
            [r"\boxed{A}", r"\boxed{2}"], reward_type=["multiple choice", "numerical"], answer=["A", "2.0"]
        )
        assert values(r, batch) == [1.0, 1.0]
        with pytest.raises(ValueError, match="unknown types"):
            MixedAccuracy(aliases={"x": "ocr"})

    def test_nested_options_are_checked_at_construction(self) -> None:
        with pytest.raises(TypeError, match="box_iou.*unknown option.*cords"):
            MixedAccuracy(box_iou={"cords": "norm1000"})
        with pytest.raises(ValueError, match="box_iou.*coords"):
            MixedAccuracy(box_iou={"coords": "pixels"})
        with pytest.raises(TypeError, match="mode"):
            MixedAccuracy(numeric={"mode": "exact"})
        with pytest.raises(TypeError, match="unknown option"):
            load_reward("mixed_accuracy", ocr={})

    def test_in_a_reward_set(self) -> None:
        rs = RewardSet([{"name": "mixed_accuracy", "kwargs": {"box_iou": {"coords": "norm1000"}}}])
        out = rs(mixed_batch())
        assert out.shape == (6, 1)
        assert out[:4, 0].tolist() == pytest.approx([1.0, 1.0, 1.0, 0.5])


def test_box_iou_reports_completions_without_a_parsable_box(caplog):
    import logging

    from rewards import RewardBatch, load_reward

    r = load_reward("box_iou")
    batch = RewardBatch(
        prompts=["p", "p"],
        outputs={"texts": ["<answer>[10, 10, 20, 20]</answer>", "the dog is on the left"]},
        columns={"box": [[10, 10, 20, 20], [0, 0, 5, 5]], "_source": ["data.jsonl:1", "data.jsonl:2"]},
    )
    with caplog.at_level(logging.WARNING):
        scores = r(batch)
    assert scores.tolist() == [1.0, 0.0] and r.last_unparsed == 1
    assert (
        "no box could be parsed from 1 of 2 completions (scored 0), e.g. sample 1 (data.jsonl:2): 'the dog is on the left'"
        in caplog.text
    )
