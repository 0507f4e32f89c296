"""Tests of the reward plugin API (rewards/base.py) and the built-in text rewards (rewards/text.py).

Expected values are worked out by hand in the comments next to them.
"""

from __future__ import annotations

import math
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import rewards
from mmalign.data.batch import Rollout
from mmalign.registry import PluginError, RegistryError
from rewards import (
    FunctionReward,
    Reward,
    RewardBatch,
    RewardError,
    RewardSet,
    RewardSpec,
    load_reward,
    register_reward,
)
from rewards.text import (
    answers_match,
    extract_answer,
    extract_boxed,
    extract_last_number,
    extract_tag,
    normalize_answer,
    parse_number,
)


def make_batch(texts: list[str], **columns: list[Any]) -> RewardBatch:
    return RewardBatch(
        prompts=[f"p{i}" for i in range(len(texts))], outputs={"texts": texts}, columns=columns
    )


def values(reward: Reward, batch: RewardBatch) -> list[float]:
    return torch.as_tensor(reward(batch)).tolist()


# =============================================================================== extraction
class TestExtraction:
    def test_boxed_nested_braces(self) -> None:
        assert extract_boxed(r"so the answer is \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
        assert extract_boxed(r"\boxed{\sqrt{\frac{1}{4}}} done") == r"\sqrt{\frac{1}{4}}"
        assert extract_boxed(r"\boxed{ {a}{b} }") == "{a}{b}"

    def test_boxed_last_wins_and_truncated_is_skipped(self) -> None:
        assert extract_boxed(r"\boxed{1} then \boxed{2}") == "2"
        # the last box is cut off (truncated completion): the previous complete one counts
        assert extract_boxed(r"\boxed{7} and finally \boxed{\frac{1}{") == "7"
        assert extract_boxed(r"\boxed{\frac{1}{") is None
        assert extract_boxed("no box here") is None
        assert extract_boxed(r"\fbox{x}") == "x"

    def test_tag(self) -> None:
        assert extract_tag("<think>hmm</think><answer> 42 </answer>") == "42"
        assert extract_tag("<answer>a\nb</answer>") == "a\nb"  # spans lines
        assert extract_tag("<answer>1</answer> wait <answer>2</answer>") == "2"  # last one
        assert extract_tag("<answer>unclosed") is None
        assert extract_tag("<final>x</final>", tag="final") == "x"

    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("it costs 1,234 dollars", "1,234"),
            ("total $1,234,567.89.", "1,234,567.89"),
            ("first 3 then -3.5", "-3.5"),
            ("x = -7", "-7"),
            ("10-3", "3"),  # a binary minus is not a sign
            ("the ratio is 3/4", "3/4"),
            ("about 1e3 items", "1e3"),
            ("list 1,2,3", "3"),  # not a thousands separator
            ("the answer is 42.", "42"),
            ("x2 and y3", None),  # digits glued to a name are not numbers
            ("no digits", None),
        ],
    )
    def test_last_number(self, text: str, expected: str | None) -> None:
        assert extract_last_number(text) == expected

    def test_auto_precedence(self) -> None:
        both = r"<answer>5</answer> hence \boxed{6} and 7"
        assert extract_answer(both, "auto") == "6"  # boxed first
        assert extract_answer("<answer>5</answer> and 7", "auto") == "5"  # then the tag
        assert extract_answer("maybe 5 or 7", "auto") == "7"  # then the last number
        assert extract_answer(r"<answer>5</answer> \boxed{6", "auto") == "5"  # unclosed box: not present
        assert extract_answer("nothing", "auto") is None
        assert extract_answer(" whole ", "none") == " whole "
        assert extract_answer(both, "tag") == "5"
        assert extract_answer(both, "last_number") == "7"
        with pytest.raises(ValueError, match="unknown extract mode"):
            extract_answer("x", "first_number")


class TestComparison:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("42", 42.0),
            ("-3.5", -3.5),
            ("+2", 2.0),
            ("1,234", 1234.0),
            ("1,234.5", 1234.5),
            ("3/4", 0.75),
            ("-3 / 4", -0.75),
            ("1e3", 1000.0),
            ("2.5E-1", 0.25),
            (".5", 0.5),
            (r"\frac{1}{2}", 0.5),
            (r"-\dfrac{3}{4}", -0.75),
            ("$7$.", 7.0),
            (r"1{,}000", 1000.0),
            ("12,34", None),  # malformed thousands
            ("1/0", None),
            ("inf", None),
            ("1e999", None),
            ("x+1", None),
            ("", None),
        ],
    )
    def test_parse_number(self, text: str, expected: float | None) -> None:
        assert parse_number(text) == expected

    def test_normalize(self) -> None:
        assert normalize_answer("  $X^2$. ") == "x^2"
        assert normalize_answer("New   York\n City.") == "new york city"
        assert normalize_answer("$Paris.$", case_sensitive=True) == "Paris"

    def test_numeric_tolerance_on_and_off(self) -> None:
        # |0.3333333 - 1/3| = 3.3e-8 <= rel_tol * 1/3 = 3.3e-7: equal with the default tolerance
        assert answers_match("0.3333333", "1/3", mode="numeric")
        assert not answers_match("0.3333333", "1/3", mode="numeric", abs_tol=0.0, rel_tol=0.0)
        # |0.333 - 1/3| = 3.3e-4: too far for the defaults, close enough for abs_tol = 1e-3
        assert not answers_match("0.333", "1/3", mode="numeric")
        assert answers_match("0.333", "1/3", mode="numeric", abs_tol=1e-3)
        assert answers_match("0.5", "1/2", mode="numeric", abs_tol=0.0, rel_tol=0.0)  # exactly equal

    def test_modes(self) -> None:
        assert answers_match("1,234", "1234", mode="numeric")
        assert not answers_match("1,234", "1234", mode="exact")
        assert answers_match("1,234", 1234, mode="auto")  # numeric reference from the dataset
        assert answers_match(r"\frac{1}{2}", "0.5", mode="auto")
        assert answers_match("$Paris$.", "paris", mode="auto")  # not numbers: exact
        assert not answers_match("Paris", "paris", mode="exact", case_sensitive=True)
        assert not answers_match("abc", "5", mode="numeric")  # unparsable prediction: just wrong
        with pytest.raises(ValueError, match="not a number"):
            answers_match("5", "five", mode="numeric")
        with pytest.raises(ValueError, match="unknown mode"):
            answers_match("5", "5", mode="fuzzy")


# ========================================================================== answer_accuracy
class TestAnswerAccuracy:
    def test_every_extraction_branch(self) -> None:
        texts = [
            r"so \boxed{\frac{1}{2}}.",  # boxed, nested   vs 1/2      -> 1
            "<think>..</think><answer>0.5</answer>",  # tag  vs 1/2      -> 1
            "I get 1,234 in total",  # last number with comma vs 1234 -> 1
            "first 3, then -3.5",  # negative last number vs -3.5     -> 1
            "I do not know",  # nothing extractable                  -> 0
            r"\boxed{7} and then 8",  # boxed beats last number, 7 != 8  -> 0
        ]
        batch = make_batch(texts, answer=["1/2", "1/2", "1234", "-3.5", "4", "8"])
        assert values(load_reward("answer_accuracy"), batch) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
        # forcing the last number: "8" matches, "2" (of \frac{1}{2}) does not match 1/2
        forced = load_reward("answer_accuracy", extract="last_number")
        assert values(forced, batch) == [0.0, 1.0, 1.0, 1.0, 0.0, 1.0]

    def test_values_options_and_reference_forms(self) -> None:
        reward = load_reward("answer_accuracy", answer_column="gold", correct=2.0, incorrect=-1.0)
        batch = make_batch(
            ["<answer>Paris</answer>", "<answer>Lyon</answer>", "<answer>5</answer>", "<answer>5</answer>"],
            gold=["paris", ["marseille", "lyon"], None, 6],
        )
        out = values(reward, batch)
        assert out[:2] == [2.0, 2.0] and math.isnan(out[2]) and out[3] == -1.0

    def test_reference_extract(self) -> None:
        reward = load_reward("answer_accuracy", reference_extract="last_number")
        batch = make_batch(["so 72", "so 71"], answer=["48 + 24 = 72\n#### 72", "#### 72"])
        assert values(reward, batch) == [1.0, 0.0]

    def test_exact_mode_case_option(self) -> None:
        batch = make_batch([r"\boxed{$X^2$.}"], answer=["x^2"])
        assert values(load_reward("answer_accuracy", mode="exact"), batch) == [1.0]
        assert values(load_reward("answer_accuracy", mode="exact", case_sensitive=True), batch) == [0.0]

    def test_missing_answer_column_names_it(self) -> None:
        reward = load_reward("answer_accuracy", answer_column="solution")
        with pytest.raises(KeyError, match=r"'solution'.*available columns: \['answer', 'level'\]"):
            reward(make_batch(["1"], answer=["1"], level=[3]))

    def test_bad_options(self) -> None:
        with pytest.raises(TypeError, match=r"'answer_accuracy'.*'answer_col'"):
            load_reward("answer_accuracy", answer_col="x")
        with pytest.raises(ValueError, match="extract='first'"):
            load_reward("answer_accuracy", extract="first")


# ================================================================================== format
class TestFormat:
    def test_pattern_fullmatch_and_search(self) -> None:
        pattern = r"<think>.*</think>\s*<answer>.*</answer>"
        texts = [
            "  <think>a\nb</think>\n<answer>1</answer>\n",  # stripped, "." spans newlines -> 1
            "<think>a</think><answer>1</answer> trailing",  # fullmatch fails            -> 0
            "<answer>1</answer>",  # no think                                              -> 0
        ]
        batch = make_batch(texts)
        assert values(load_reward("format", pattern=pattern), batch) == [1.0, 0.0, 0.0]
        assert values(load_reward("format", pattern=pattern, search=True), batch) == [1.0, 1.0, 0.0]
        assert values(load_reward("format", pattern=pattern, strip=False), batch) == [0.0, 0.0, 0.0]
        scored = load_reward("format", pattern=pattern, correct=0.5, incorrect=-0.5)
        assert values(scored, batch) == [0.5, -0.5, -0.5]

    def test_tags(self) -> None:
        texts = [
            "<think>x</think> <answer>1</answer>",  # ok                  -> 1
            "<answer>1</answer><think>x</think>",  # wrong order          -> 0
            "<think>x</think><answer>1</answer><answer>2</answer>",  # twice -> 0
            "<think>x</think>",  # missing answer                          -> 0
            "<think>x<answer>1</answer></think>",  # nested, not in sequence -> 0
            "Sure! <think>x</think><answer>1</answer> bye",  # text outside: ok unless strict
            "<think>x</answer>1<answer></think>",  # closes before it opens -> 0
        ]
        batch = make_batch(texts)
        assert values(load_reward("format", tags=["think", "answer"]), batch) == [1, 0, 0, 0, 0, 1, 0]
        strict = load_reward("format", tags=["think", "answer"], strict=True)
        assert values(strict, batch) == [1, 0, 0, 0, 0, 0, 0]

    def test_bad_options(self) -> None:
        with pytest.raises(ValueError, match="exactly one of"):
            load_reward("format")
        with pytest.raises(ValueError, match="exactly one of"):
            load_reward("format", pattern="a", tags=["a"])
        with pytest.raises(ValueError, match="invalid pattern"):
            load_reward("format", pattern="(unclosed")
        with pytest.raises(ValueError, match="option 'tags' must be list or None, got str 'answer'"):
            load_reward("format", tags="answer")  # checked against the annotation before the constructor runs


# ================================================================================= overlong
class TestOverlong:
    def test_piecewise_at_the_boundaries(self) -> None:
        # L = 20, c = 5, L - c = 15:  n <= 15 -> 0;  15 < n <= 20 -> (15 - n) / 5;  n > 20 -> -1
        reward = load_reward("overlong", max_len=20, cache_len=5)
        n = torch.tensor([0, 15, 16, 18, 20, 21, 100])
        batch = RewardBatch(prompts=["p"] * 7, outputs={"texts": [""] * 7, "num_tokens": n})
        out = reward(batch)
        assert out.dtype == torch.float32
        assert out.tolist() == pytest.approx([0.0, 0.0, -0.2, -0.6, -1.0, -1.0, -1.0], abs=1e-7)

    def test_hard_cut_and_list_input(self) -> None:
        reward = load_reward("overlong", max_len=20, cache_len=0)
        batch = RewardBatch(prompts=["p"] * 3, outputs={"num_tokens": [19, 20, 21]})
        assert reward(batch).tolist() == [0.0, 0.0, -1.0]

    def test_errors(self) -> None:
        with pytest.raises(TypeError, match=r"'overlong' needs the option\(s\) 'max_len', 'cache_len'"):
            load_reward("overlong")
        with pytest.raises(ValueError, match="cache_len <= max_len"):
            load_reward("overlong", max_len=4, cache_len=8)
        reward = load_reward("overlong", max_len=20, cache_len=5)
        with pytest.raises(KeyError, match=r"'num_tokens'.*outputs: \['texts'\]"):
            reward(make_batch(["a"]))


# ========================================================================== registry, loading
@pytest.fixture
def temp_registered():
    """Register names for one test and remove them afterwards (the registry is process-global)."""
    added: list[str] = []

    def register(name: str):
        added.append(name)
        return register_reward(name)

    yield register
    for name in added:
        rewards.REGISTRY._items.pop(name, None)
        rewards.REGISTRY._meta.pop(name, None)


class TestRegistry:
    def test_builtins(self) -> None:
        assert {"answer_accuracy", "format", "overlong"} <= set(rewards.names())
        assert rewards.get("overlong") is rewards.OverlongPenalty
        assert rewards.REGISTRY.describe("overlong").startswith("DAPO soft overlong punishment")
        for name in ("answer_accuracy", "format", "overlong"):
            assert rewards.get(name).name == name

    def test_unknown_name(self) -> None:
        with pytest.raises(RegistryError, match=r"Did you mean 'format'"):
            rewards.get("formatt")
        with pytest.raises(KeyError) as info:
            load_reward("no_such_reward")
        msg = str(info.value)
        assert "unknown reward 'no_such_reward'" in msg
        assert all(n in msg for n in ("answer_accuracy", "format", "overlong"))
        assert "Entry points (mmalign.rewards)" in msg and "module:Class" in msg

    def test_register_and_get(self, temp_registered) -> None:
        @temp_registered("_test_const")
        class Const(Reward):
            """Always 3."""

            def __call__(self, batch):
                return [3.0] * len(batch)

        assert "_test_const" in rewards.names() and rewards.get("_test_const") is Const
        assert Const.name == "_test_const"
        r = load_reward("_test_const")
        assert values(r, make_batch(["a", "b"])) == [3.0, 3.0]
        with pytest.raises(TypeError, match=r"reward '_test_const' takes no options, got 'x'"):
            load_reward("_test_const", x=1)
        with pytest.raises(TypeError, match="must subclass rewards.Reward"):
            register_reward("_test_bad")(dict)


PLUGIN_MODULE = '''
from rewards import Reward

class LenReward(Reward):
    """Number of characters times a scale."""
    needs = {"texts"}

    def __init__(self, *, scale=1.0):
        self.scale = scale

    def __call__(self, batch):
        return [self.scale * len(t) for t in batch.texts]

class NotAReward:
    pass

def batch_fn(batch, bonus=0.0):
    return [float(t == batch["answer"][i]) + bonus for i, t in enumerate(batch.texts)]

def trl_fn(prompts, completions, answer, **kwargs):
    # None = not applicable, as in TRL
    return [None if a is None else float(c == a) for c, a in zip(completions, answer)]

def trl_strict(completions, level):
    return [float(lv) for lv in level]

def boom(batch):
    raise ValueError("kaboom")

def too_short(batch):
    return [1.0] * (len(batch) - 1)

def with_inf(batch):
    return [0.0, float("inf")] + [0.0] * (len(batch) - 2)

def process(batch):
    import torch
    return torch.zeros(len(batch), 3)

def text_values(batch):
    return ["a"] * len(batch)

def with_nan(batch):
    return [float("nan"), 1.0] + [0.0] * (len(batch) - 2)

def grad_state(batch):
    import torch
    return [float(torch.is_grad_enabled())] * len(batch)

with_nan.needs = {"images"}
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A throw-away module `_mm_plugin_rewards` on sys.path."""
    (tmp_path / "_mm_plugin_rewards.py").write_text(PLUGIN_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "_mm_plugin_rewards"
    sys.modules.pop("_mm_plugin_rewards", None)


class TestLoading:
    def test_module_class(self, plugin) -> None:
        r = load_reward(f"{plugin}:LenReward", scale=2.0)
        assert isinstance(r, Reward) and r.name == f"{plugin}:LenReward"
        assert values(r, make_batch(["ab", "abcd"])) == [4.0, 8.0]
        with pytest.raises(TypeError, match=rf"'{plugin}:LenReward' got unknown option\(s\) 'scal'.*scale"):
            load_reward(f"{plugin}:LenReward", scal=2.0)

    def test_module_errors(self, plugin) -> None:
        with pytest.raises(RegistryError, match="cannot import module '_mm_no_such_module'"):
            load_reward("_mm_no_such_module:X")
        with pytest.raises(RegistryError, match="has no attribute 'Missing'"):
            load_reward(f"{plugin}:Missing")
        with pytest.raises(TypeError, match="does not subclass rewards.Reward"):
            load_reward(f"{plugin}:NotAReward")

    def test_batch_function(self, plugin) -> None:
        r = load_reward(f"{plugin}:batch_fn", bonus=0.5)
        assert isinstance(r, FunctionReward) and r.style == "batch" and r.needs == {"texts"}
        assert values(r, make_batch(["x", "y"], answer=["x", "z"])) == [1.5, 0.5]
        with pytest.raises(TypeError, match=r"got unknown option\(s\) 'malus'"):
            load_reward(f"{plugin}:batch_fn", malus=1.0)

    def test_trl_function(self, plugin) -> None:
        r = load_reward(f"{plugin}:trl_fn")
        assert r.style == "trl"
        batch = make_batch(["x", "y", "z"], answer=["x", "q", None], level=[1, 2, 3])
        assert r(batch) == [1.0, 0.0, None]  # the function's own list; RewardSet turns None into NaN
        # without **kwargs only the columns it names are passed
        strict = load_reward(f"{plugin}:trl_strict")
        assert values(strict, make_batch(["x", "y"], answer=["x", "q"], level=[1, 2])) == [1.0, 2.0]

    def test_function_style_detection(self) -> None:
        def a(batch): ...
        def b(prompts, completions, **kw): ...
        def c(completions, **kw): ...

        assert [FunctionReward.detect_style(f) for f in (a, b, c)] == ["batch", "trl", "trl"]

    def test_entry_point_from_a_real_dist_info(self, tmp_path, monkeypatch) -> None:
        mod = "_mm_ep_plugin"
        (tmp_path / f"{mod}.py").write_text(PLUGIN_MODULE)
        dist = tmp_path / "mm_ep_plugin-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mm-ep-plugin\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(
            f"[mmalign.rewards]\nep_len = {mod}:LenReward\nep_fn = {mod}:batch_fn\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        try:
            assert {"ep_fn", "ep_len"} <= set(rewards.entry_point_names())
            assert mod not in sys.modules  # listing entry points imports nothing
            r = load_reward("ep_len", scale=3.0)
            assert mod in sys.modules and r.name == "ep_len"
            assert values(r, make_batch(["ab"])) == [6.0]
            assert values(load_reward("ep_fn"), make_batch(["x"], answer=["x"])) == [1.0]
            with pytest.raises(KeyError, match=r"Entry points \(mmalign.rewards\): .*ep_fn, ep_len"):
                load_reward("ep_nope")
        finally:
            sys.modules.pop(mod, None)

    def test_broken_entry_point_names_itself_and_its_distribution(self, tmp_path, monkeypatch) -> None:
        dist = tmp_path / "mm_ep_broken-0.2.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mm-ep-broken\nVersion: 0.2\n")
        (dist / "entry_points.txt").write_text("[mmalign.rewards]\nep_broken = _mm_no_such_module:R\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        with pytest.raises(PluginError) as e:  # a RegistryError (a KeyError) too
            load_reward("ep_broken")
        msg = str(e.value)
        assert (
            "reward entry point 'ep_broken' = '_mm_no_such_module:R'" in msg and "'mm-ep-broken' 0.2" in msg
        )
        assert "could not be loaded: ModuleNotFoundError" in msg
        with pytest.raises(KeyError, match=r"Or give an explicit 'package.module:Class' path"):
            load_reward("ep_brokn")


# ================================================================================= RewardBatch
class TestRewardBatch:
    def test_lookup_order_and_errors(self) -> None:
        batch = RewardBatch(
            prompts=["a", "b"],
            outputs={"texts": ["x", "y"], "answer": ["from outputs"] * 2, "num_tokens": torch.tensor([1, 2])},
            columns={"answer": ["1", "2"]},
            group=torch.tensor([0, 0]),
        )
        assert len(batch) == 2 and batch.texts == ["x", "y"]
        assert batch["answer"] == ["1", "2"]  # columns before outputs
        assert batch["num_tokens"].tolist() == [1, 2]
        assert "num_tokens" in batch and "images" not in batch
        with pytest.raises(
            KeyError, match=r"'images'.*Columns: \['answer'\]; outputs: \['answer', 'num_tokens'"
        ):
            batch["images"]
        with pytest.raises(KeyError, match="outputs have no 'texts'"):
            _ = RewardBatch(prompts=["a"], outputs={"images": None}).texts
        assert RewardBatch(prompts=["a", "b", "c"]).group.tolist() == [0, 1, 2]
        with pytest.raises(ValueError, match="2 prompts but group has 3"):
            RewardBatch(prompts=["a", "b"], group=torch.tensor([0, 0, 1]))


# =================================================================================== RewardSet
def make_rollout(texts: list[str], group: list[int], **columns: list[Any]) -> Rollout:
    b = len(texts)
    return Rollout(
        group=torch.tensor(group),
        mask=torch.ones(b, 3, dtype=torch.bool),
        prompts=[f"prompt {g}" for g in group],
        columns=columns,
        outputs={"texts": texts, "num_tokens": torch.tensor([len(t) for t in texts])},
    )


@dataclass
class FakeRewardConfig:  # the shape of mmalign.config.RewardConfig
    name: str = ""
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    alias: str | None = None


class TestRewardSet:
    def test_columns_on_a_rollout(self) -> None:
        specs = [
            RewardSpec("answer_accuracy", weight=1.0),
            RewardSpec("format", weight=0.5, kwargs={"tags": ["answer"]}),
            {"name": "overlong", "weight": 0.25, "kwargs": {"max_len": 20, "cache_len": 5}},
            FakeRewardConfig(name="answer_accuracy", weight=2.0, alias="acc_exact", kwargs={"mode": "exact"}),
        ]
        rs = RewardSet(specs)
        assert rs.names == ["answer_accuracy", "format", "overlong", "acc_exact"]
        assert rs.weights.dtype == torch.float32 and rs.weights.tolist() == [1.0, 0.5, 0.25, 2.0]
        assert rs.needs == {"texts", "num_tokens"}
        # overlong with L = 20, c = 5 on the character counts used as num_tokens by make_rollout
        texts = [
            "<answer>1,000</answer>",  # 8 + 5 + 9 = 22 chars > 20                 -> -1
            "1000",  # 4 chars                                                     -> 0
            "<answer>7</answer>xxx",  # 8 + 1 + 9 + 3 = 21 chars > 20             -> -1
            "so 1000 yes ok. yes",  # 19 chars: (15 - 19) / 5                      -> -0.8
        ]
        r = rs(make_rollout(texts, [0, 0, 1, 1], answer=["1000", "1000", "7", "1000"]))
        assert r.dtype == torch.float32 and r.shape == (4, 4)
        #            accuracy  format  overlong  acc_exact (still extracts with "auto")
        expected = [
            [1.0, 1.0, -1.0, 0.0],  # "1,000" == 1000 numerically, but not as a string
            [1.0, 0.0, 0.0, 1.0],  # last number "1000"; no <answer> tag
            [1.0, 1.0, -1.0, 1.0],  # trailing text is allowed by non-strict tags
            [1.0, 0.0, -0.8, 1.0],
        ]
        assert r.tolist() == [pytest.approx(row, abs=1e-7) for row in expected]

    def test_duplicate_names_need_an_alias(self) -> None:
        with pytest.raises(ValueError, match="both named 'format'; give one of them an alias"):
            RewardSet(["format", {"name": "format", "kwargs": {"tags": ["a"]}}])
        with pytest.raises(TypeError, match="unknown key"):
            RewardSet([{"name": "format", "weigth": 2.0}])
        with pytest.raises(ValueError, match="weight must be a finite number"):
            RewardSet([{"name": "overlong", "weight": float("nan")}])

    def test_a_failing_reward_is_named(self, plugin) -> None:
        rs = RewardSet([{"name": "format", "kwargs": {"pattern": "x"}}, f"{plugin}:boom"])
        with pytest.raises(RewardError) as info:
            rs(make_batch(["x", "y"]))
        assert str(info.value) == f"reward '{plugin}:boom' (rewards[1]) failed: ValueError: kaboom"
        assert isinstance(info.value.__cause__, ValueError)

    def test_alias_and_spec_both_named(self, plugin) -> None:
        rs = RewardSet([{"name": f"{plugin}:boom", "alias": "b"}])
        with pytest.raises(RewardError, match=rf"reward 'b' \({plugin}:boom, rewards\[0\]\) failed"):
            rs(make_batch(["x"]))

    @pytest.mark.parametrize(
        ("fn", "message"),
        [
            ("too_short", r"reward '{p}:too_short' \(rewards\[0\]\) returned 2 values for a batch of 3"),
            ("with_inf", r"reward '{p}:with_inf' \(rewards\[0\]\) returned \+/-inf at sample\(s\) \[1\]"),
            ("process", r"returned a tensor of shape \(3, 3\); process rewards"),
            ("text_values", r"non-numeric value at sample 0: 'a'"),
        ],
    )
    def test_bad_outputs(self, plugin, fn: str, message: str) -> None:
        rs = RewardSet([f"{plugin}:{fn}"])
        with pytest.raises(RewardError, match=message.format(p=plugin)):
            rs(make_batch(["a", "b", "c"]))

    def test_nan_and_none_pass_through_and_no_grad(self, plugin) -> None:
        rs = RewardSet([f"{plugin}:with_nan", f"{plugin}:trl_fn", f"{plugin}:grad_state"])
        assert rs.needs == {"images", "texts"}
        r = rs(make_batch(["x", "y", "z"], answer=[None, "y", "q"]))
        assert torch.isnan(r[0, 0]) and r[1:, 0].tolist() == [1.0, 0.0]
        assert torch.isnan(r[0, 1]) and r[1:, 1].tolist() == [1.0, 0.0]
        assert r[:, 2].tolist() == [0.0, 0.0, 0.0]  # rewards ran with grad disabled

    def test_from_rewards_and_prompt_override(self) -> None:
        class PromptLen(Reward):
            needs = {"prompts"}

            def __call__(self, batch):
                return torch.tensor([len(p) for p in batch.prompts])  # integer tensor -> float32

        rs = RewardSet.from_rewards([PromptLen()], weights=[0.5])
        assert rs.names == ["PromptLen"] and rs.weights.tolist() == [0.5]
        out = rs(make_rollout(["a", "b"], [0, 1]), prompts=["xy", "xyz"])
        assert out.dtype == torch.float32 and out[:, 0].tolist() == [2.0, 3.0]

    def test_stats_are_nan_aware(self) -> None:
        rs = RewardSet.from_rewards([_Named("a"), _Named("b"), _Named("c")])
        nan = math.nan
        r = torch.tensor([[1.0, nan, 2.0], [nan, nan, 2.0], [3.0, nan, 2.0], [5.0, nan, 2.0]])
        s = rs.stats(r)
        # a: valid 1, 3, 5 -> mean 3, population std sqrt((4 + 0 + 4) / 3) = sqrt(8/3), 1 of 4 NaN
        assert s["reward/a/mean"] == pytest.approx(3.0)
        assert s["reward/a/std"] == pytest.approx(math.sqrt(8 / 3))
        assert s["reward/a/nan_frac"] == pytest.approx(0.25)
        assert (
            math.isnan(s["reward/b/mean"]) and math.isnan(s["reward/b/std"]) and s["reward/b/nan_frac"] == 1.0
        )
        assert s == {**s, "reward/c/mean": 2.0, "reward/c/std": 0.0, "reward/c/nan_frac": 0.0}
        assert len(s) == 9
        with pytest.raises(ValueError, match=r"expected rewards Float\[B, 3\]"):
            rs.stats(r[:, :2])

    def test_nan_groups(self) -> None:
        rs = RewardSet.from_rewards([_Named("a"), _Named("b")])
        nan = math.nan
        group = torch.tensor([3, 3, 5, 5, 7, 7])
        r = torch.tensor(
            [
                [1.0, nan],  # group 3: b all NaN
                [0.0, nan],
                [nan, 1.0],  # group 5: a all NaN
                [nan, 0.0],
                [1.0, 0.0],  # group 7: a NaN only for its last sample -> not reported
                [nan, 0.0],
            ]
        )
        assert rs.nan_groups(r, group) == [("a", 5), ("b", 3)]
        assert rs.nan_groups(torch.zeros(6, 2), group) == []


class _Named(Reward):
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, batch):
        return [0.0] * len(batch)


def test_public_api_is_exported() -> None:
    for attr in (
        "Reward",
        "RewardBatch",
        "RewardSet",
        "RewardSpec",
        "RewardError",
        "load_reward",
        "get",
        "names",
    ):
        assert hasattr(rewards, attr)
    assert textwrap.dedent(rewards.__doc__ or "").strip()


# ======================================================================= per-reward options
class ChunkRecorder(Reward):
    """len(text) + 10 * group id, per sample; records the sizes it was called with."""

    needs = {"texts"}

    def __init__(self, *, device: str | None = None) -> None:
        self.device = device
        self.sizes: list[int] = []
        self.last_metrics: dict[str, float] = {}

    def __call__(self, batch):
        self.sizes.append(len(batch))
        lengths = [len(t) for t in batch.texts]
        # per-sample columns and tensors arrive sliced consistently with the texts
        assert batch["answer"] == [t.upper() for t in batch.texts]
        assert batch["num_tokens"].tolist() == lengths
        self.last_metrics = {"mean_len": sum(lengths) / len(lengths), "calls": 1.0}
        return [n + 10.0 * g for n, g in zip(lengths, batch.group.tolist())]


class StepRecorder(Reward):
    """Per-step: at valid step j of a sample, len(text) * (j + 1); NaN at padding."""

    per_step = True
    needs = {"texts"}

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, batch):
        self.sizes.append(len(batch))
        t = batch.mask.shape[1]
        out = torch.full((len(batch), t), math.nan)
        for i, text in enumerate(batch.texts):
            for j in range(t):
                if batch.mask[i, j]:
                    out[i, j] = len(text) * (j + 1)
        return out


class NoDevice(Reward):
    def __call__(self, batch):
        return [0.0] * len(batch)


class Sleeper(Reward):
    """Blocks until released (at most 2 s), then scores 1; `grad` reports whether grad mode was on."""

    release = None

    def __init__(self, *, wait_s: float = 2.0) -> None:
        import threading

        self.wait_s = wait_s
        self.release = threading.Event()

    def __call__(self, batch):
        if self.wait_s > 0:
            self.release.wait(self.wait_s)
        return [float(torch.is_grad_enabled())] * len(batch)


def _options_batch() -> RewardBatch:
    texts = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff", "g"]
    return RewardBatch(
        prompts=[f"p{i}" for i in range(7)],
        outputs={"texts": texts, "num_tokens": torch.tensor([len(t) for t in texts]), "scale": 3.0},
        columns={"answer": [t.upper() for t in texts]},
        group=torch.tensor([0, 0, 1, 1, 2, 2, 3]),
    )


class TestPerRewardOptions:
    def test_batch_size_chunks_outcome_rewards(self) -> None:
        spec = {"name": f"{__name__}:ChunkRecorder", "alias": "rec"}
        whole = RewardSet([spec])
        chunked = RewardSet([{**spec, "batch_size": 3}])
        batch = _options_batch()
        r_whole, r_chunked = whole(batch), chunked(batch)
        assert whole.rewards[0].sizes == [7]
        assert chunked.rewards[0].sizes == [3, 3, 1]
        # len + 10 * group: a(1) bb(2) ccc(3)+10 dddd(4)+10 eeeee(5)+20 ffffff(6)+20 g(1)+30
        assert r_chunked[:, 0].tolist() == [1.0, 2.0, 13.0, 14.0, 25.0, 26.0, 31.0]
        assert torch.equal(r_chunked, r_whole)
        # chunk means 2, 5, 1 weighted by sizes 3, 3, 1: (6 + 15 + 1) / 7 = the mean length 22 / 7
        assert chunked.last_metrics["reward/rec/mean_len"] == pytest.approx(22 / 7)
        assert whole.last_metrics["reward/rec/mean_len"] == pytest.approx(22 / 7)
        assert chunked.last_metrics["reward/rec/calls"] == 1.0
        # a batch_size at least B scores in one call
        big = RewardSet([{**spec, "batch_size": 7}])
        big(batch)
        assert big.rewards[0].sizes == [7]

    def test_batch_size_chunks_per_step_rewards(self) -> None:
        texts = ["a", "bb", "ccc", "dddd", "eeeee"]
        mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0], [1, 1, 0]], dtype=torch.bool)

        def rollout() -> Rollout:
            return Rollout(
                group=torch.tensor([0, 0, 1, 1, 2]),
                mask=mask.clone(),
                prompts=["p"] * 5,
                outputs={"texts": list(texts)},
            )

        whole = RewardSet([{"name": f"{__name__}:StepRecorder", "weight": 2.0}])
        chunked = RewardSet([{"name": f"{__name__}:StepRecorder", "weight": 2.0, "batch_size": 2}])
        ro_whole, ro_chunked = rollout(), rollout()
        r_whole, r_chunked = whole(ro_whole), chunked(ro_chunked)
        assert chunked.rewards[0].sizes == [2, 2, 1]
        # column = mean over valid steps of len * (j + 1): a (1+2)/2, bb 2, ccc (3+6+9)/3, dddd none, eeeee 7.5
        assert r_chunked[:, 0].tolist()[:3] == [1.5, 2.0, 6.0] and r_chunked[4, 0].item() == 7.5
        assert math.isnan(r_chunked[3, 0].item())
        assert torch.equal(r_chunked.isnan(), r_whole.isnan())
        assert torch.equal(r_chunked.nan_to_num(), r_whole.nan_to_num())
        expected = 2.0 * torch.tensor(
            [[1, 2, 0], [2, 0, 0], [3, 6, 9], [0, 0, 0], [5, 10, 0]], dtype=torch.float32
        )
        assert torch.equal(ro_chunked.step_rewards, expected)
        assert torch.equal(ro_whole.step_rewards, expected)

    def test_a_chunk_with_a_bad_output_is_named(self, plugin) -> None:
        rs = RewardSet([{"name": f"{plugin}:too_short", "batch_size": 2}])
        with pytest.raises(
            RewardError,
            match=r"returned 1 values for a batch of 2 \(samples 0\.\.1 of 3; rewards\[0\]\.batch_size = 2\)",
        ):
            rs(make_batch(["a", "b", "c"]))

    def test_timeout(self) -> None:
        rs = RewardSet([{"name": f"{__name__}:Sleeper", "alias": "slow", "timeout_s": 0.2}])
        try:
            with pytest.raises(RewardError) as info:
                rs(make_batch(["a", "b"]))
        finally:
            rs.rewards[0].release.set()  # let the abandoned call finish
        msg = str(info.value)
        assert "reward 'slow'" in msg and "0.2 s" in msg and "rewards[0].timeout_s" in msg
        assert "background" in msg

    def test_a_call_within_its_timeout_runs_in_no_grad_and_errors_are_wrapped(self, plugin) -> None:
        rs = RewardSet([{"name": f"{__name__}:Sleeper", "kwargs": {"wait_s": 0}, "timeout_s": 30}])
        assert rs(make_batch(["a", "b"]))[:, 0].tolist() == [0.0, 0.0]  # grad mode off in the worker thread
        rs = RewardSet([{"name": f"{plugin}:boom", "timeout_s": 30}])
        with pytest.raises(RewardError) as info:
            rs(make_batch(["x"]))
        assert str(info.value) == f"reward '{plugin}:boom' (rewards[0]) failed: ValueError: kaboom"

    def test_device_goes_to_the_constructor(self) -> None:
        rs = RewardSet([{"name": f"{__name__}:ChunkRecorder", "device": "cpu"}])
        assert rs.rewards[0].device == "cpu"
        # a built-in that already took `device` in kwargs keeps working, and takes the field as well
        assert (
            RewardSet([{"name": "jpeg_compressibility", "kwargs": {"device": "cpu"}}]).rewards[0].device
            == "cpu"
        )
        assert RewardSet([{"name": "jpeg_compressibility", "device": "cpu"}]).rewards[0].device == "cpu"

    @pytest.mark.parametrize(
        ("entry", "key", "message"),
        [
            (
                {"name": "format", "device": "cpu"},
                "rewards[0].device",
                "reward 'format' takes no `device` option",
            ),
            (
                {"name": f"{__name__}:NoDevice", "device": "cpu"},
                "rewards[0].device",
                "takes no `device` option",
            ),
            (
                {"name": "jpeg_compressibility", "device": "cpu", "kwargs": {"device": "cpu"}},
                "rewards[0].device",
                "device is given twice",
            ),
            ({"name": "format", "device": "banana"}, "rewards[0].device", "'banana' is not a torch device"),
            (
                {"name": "format", "batch_size": 0},
                "rewards[0].batch_size",
                "batch_size must be an integer >= 1",
            ),
            (
                {"name": "format", "timeout_s": -1},
                "rewards[0].timeout_s",
                "timeout_s must be a finite number",
            ),
        ],
    )
    def test_bad_options_name_the_key_and_file(self, entry, key: str, message: str) -> None:
        from mmalign.config import ConfigError

        with pytest.raises(ConfigError) as info:
            RewardSet([entry], source="run.yaml")
        assert str(info.value).startswith(f"run.yaml: key '{key}': ")
        assert message in str(info.value)

    def test_config_fields_reach_the_reward_set(self) -> None:
        from mmalign.config import ConfigError, load_config

        tiny = Path(__file__).resolve().parents[2] / "configs" / "text_reasoning-tiny.yaml"
        cfg = load_config(tiny, ["rewards.1.batch_size=4", "rewards.1.timeout_s=30"])
        assert (cfg.rewards[1].batch_size, cfg.rewards[1].timeout_s, cfg.rewards[1].device) == (4, 30.0, None)
        rs = RewardSet(cfg.rewards, source=cfg.source)
        assert (rs.specs[1].batch_size, rs.specs[1].timeout_s) == (4, 30.0)
        cfg = load_config(tiny, ["rewards.0.device=cuda:1"])
        with pytest.raises(
            ConfigError,
            match=r"text_reasoning-tiny.yaml.*key 'rewards\[0\].device'.*'answer_accuracy' takes no `device`",
        ):
            RewardSet(cfg.rewards, source=cfg.source)
