"""mmalign.config: typed YAML configs, dotted command-line overrides and the errors they give."""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import pytest
import yaml

from mmalign import config as config_mod
from mmalign.config import (
    Config,
    ConfigError,
    LoraConfig,
    RewardConfig,
    config_from_dict,
    load_config,
    parse_override,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "text_reasoning-tiny.yaml"


def tiny_data() -> dict[str, Any]:
    return yaml.safe_load(TINY.read_text())


def write_yaml(tmp_path: Path, data: Any, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def load_modified(tmp_path: Path, edit: Any, overrides: tuple[str, ...] = ()) -> Config:
    data = tiny_data()
    edit(data)
    return load_config(write_yaml(tmp_path, data), overrides)


def error_of(fn: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


# ----------------------------------------------------------------------------- loading


def _check_types(obj: Any, tp: Any, where: str) -> None:
    """Assert that `obj` has exactly the declared type `tp` (recursively through dataclasses)."""
    if tp is Any:
        return
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            try:
                _check_types(obj, arg, where)
                return
            except AssertionError as e:
                errors.append(str(e))
        raise AssertionError(f"{where}: {obj!r} matches none of {tp}: {errors}")
    if origin is Literal:
        assert obj in typing.get_args(tp), f"{where}: {obj!r} not in {tp}"
        return
    if tp is type(None):
        assert obj is None, f"{where}: {obj!r} is not None"
        return
    if dataclasses.is_dataclass(tp):
        assert type(obj) is tp, f"{where}: {type(obj).__name__} is not {tp.__name__}"
        hints = typing.get_type_hints(tp)
        for f in dataclasses.fields(tp):
            _check_types(getattr(obj, f.name), hints[f.name], f"{where}.{f.name}")
        return
    if origin is list:
        assert type(obj) is list, f"{where}: {obj!r} is not a list"
        (item,) = typing.get_args(tp)
        for i, v in enumerate(obj):
            _check_types(v, item, f"{where}[{i}]")
        return
    if origin is dict:
        assert type(obj) is dict, f"{where}: {obj!r} is not a dict"
        return
    # exact types: a bool is not an int, an int is not a float
    assert type(obj) is tp, f"{where}: {obj!r} is {type(obj).__name__}, expected {tp.__name__}"


def test_tiny_config_loads_with_declared_types():
    cfg = load_config(TINY)
    _check_types(cfg, Config, "cfg")
    assert cfg.source == str(TINY)
    assert cfg.pipeline == "text_reasoning"
    assert cfg.output_dir == "runs/text_reasoning-tiny"
    assert cfg.seed == 0
    assert cfg.model.tiny_builder == "text_reasoning"
    assert cfg.model.lora == LoraConfig()
    assert cfg.data.prompt_template == "Q: {question} = ?\nA:"
    assert (cfg.rollout.group_size, cfg.rollout.prompts_per_step, cfg.rollout.max_new_tokens) == (8, 16, 12)
    assert cfg.rollout.temperature == 1.0
    assert cfg.rewards == [
        RewardConfig(name="answer_accuracy", weight=1.0, kwargs={"extract": "tag", "mode": "numeric"}),
        RewardConfig(name="format", weight=0.2, kwargs={"tags": ["answer"], "strict": True}),
    ]
    assert cfg.trainer.lr == pytest.approx(3e-4)
    assert (cfg.trainer.steps, cfg.trainer.save_every, cfg.trainer.sample_every) == (100, 25, 10)
    assert cfg.options is None


def test_defaults_are_not_shared_between_configs(tmp_path):
    a = load_config(TINY)
    b = load_config(TINY)
    a.trainer.betas.append(0.5)
    a.rollout.stop_strings.append("x")
    assert b.trainer.betas == [0.9, 0.999]
    assert b.rollout.stop_strings == []


# ----------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    "edit, key, suggestion",
    [
        (lambda d: d.update(seeed=1), "'seeed'", "'seed'"),
        (lambda d: d["trainer"].update(lrr=1e-4), "'trainer.lrr'", "'trainer.lr'"),
        (lambda d: d["model"].update(lora={"enabeld": True}), "'model.lora.enabeld'", "'model.lora.enabled'"),
        (lambda d: d["rewards"][0].update(wieght=2.0), "'rewards[0].wieght'", "'rewards[0].weight'"),
        (lambda d: d["rewards"][1].update(kwarg={}), "'rewards[1].kwarg'", "'rewards[1].kwargs'"),
    ],
)
def test_unknown_key_names_file_full_key_and_close_match(tmp_path, edit, key, suggestion):
    msg = error_of(load_modified, tmp_path, edit)
    assert str(tmp_path / "cfg.yaml") in msg
    assert f"unknown key {key}" in msg
    assert f"did you mean {suggestion}?" in msg


def test_unknown_key_without_close_match_lists_valid_keys(tmp_path):
    msg = error_of(load_modified, tmp_path, lambda d: d["trainer"].update(zzzz=1))
    assert "unknown key 'trainer.zzzz'" in msg
    assert "did you mean" not in msg
    assert "Valid keys here:" in msg and "lr" in msg and "steps" in msg


def test_source_is_not_a_config_key(tmp_path):
    msg = error_of(load_modified, tmp_path, lambda d: d.update(source="x"))
    assert "unknown key 'source'" in msg


# ----------------------------------------------------------------------------- types


@pytest.mark.parametrize(
    "section, key, value, expected",
    [
        ("trainer", "steps", "ten", "must be int, got str 'ten'"),
        ("rollout", "group_size", 2.5, "must be int, got float 2.5"),
        ("rollout", "group_size", True, "must be int, got bool True"),
        ("trainer", "lr", True, "must be float, got bool True"),
        ("trainer", "lr", "fast", "must be float, got str 'fast'"),
        ("trainer", "cpu", 1, "must be bool, got int 1"),
        ("trainer", "betas", 0.9, "must be list[float], got float 0.9"),
        ("rollout", "stop_strings", ["</answer>", 3], "must be str, got int 3"),
        ("data", "max_rows", "all", "must be int | null, got str 'all'"),
        ("model", "lora", 5, "must be a mapping (LoraConfig), got int 5"),
        ("algorithm", "estimator_kwargs", [1], "must be dict[str, Any], got list [1]"),
    ],
)
def test_wrong_type_names_key_and_expected_type(tmp_path, section, key, value, expected):
    msg = error_of(load_modified, tmp_path, lambda d: d.setdefault(section, {}).update({key: value}))
    full = f"{section}.{key}" if key != "stop_strings" else f"{section}.{key}[1]"
    assert f"key '{full}' {expected}" in msg
    assert str(tmp_path / "cfg.yaml") in msg


def test_int_is_accepted_for_float_and_becomes_float(tmp_path):
    cfg = load_modified(tmp_path, lambda d: d["trainer"].update(lr=1, max_grad_norm=2))
    assert type(cfg.trainer.lr) is float and cfg.trainer.lr == 1.0
    assert type(cfg.trainer.max_grad_norm) is float


def test_reward_item_must_be_a_mapping(tmp_path):
    msg = error_of(load_modified, tmp_path, lambda d: d["rewards"].append("overlong"))
    assert "key 'rewards[2]' must be a mapping (RewardConfig), got str 'overlong'" in msg


@pytest.mark.parametrize(
    "section, key, value",
    [
        ("model", "dtype", "float64"),
        ("trainer", "lr_scheduler", "exponential"),
        ("trainer", "mixed_precision", "fp8"),
        ("trainer", "mixed_precision", False),
        ("rollout", "engine", "sglang"),
    ],
)
def test_literal_fields_reject_other_values(tmp_path, section, key, value):
    msg = error_of(load_modified, tmp_path, lambda d: d[section].update({key: value}))
    assert f"key '{section}.{key}' must be " in msg
    allowed = typing.get_args(typing.get_type_hints(type(getattr(Config(), section)))[key])
    for a in allowed:
        assert repr(a) in msg


def test_literal_fields_accept_their_values(tmp_path):
    cfg = load_modified(
        tmp_path, lambda d: d["trainer"].update(lr_scheduler="cosine", mixed_precision="bf16")
    )
    assert (cfg.trainer.lr_scheduler, cfg.trainer.mixed_precision) == ("cosine", "bf16")


# ----------------------------------------------------------------------------- YAML reading


def test_yaml_exponent_without_dot_is_a_float_in_files(tmp_path):
    # YAML 1.1 (PyYAML) reads `1e-5` as the string "1e-5"; the config must read it as a number,
    # also inside free-form kwargs, where no declared type could convert it later
    text = TINY.read_text().replace("lr: 3.0e-4", "lr: 1e-5") + "\n"
    text = text.replace("  kl_coef: 0.0", "  kl_coef: 0.0\n  loss_kwargs: {eps_high: 3e-1, eps_low: 2E-1}")
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    cfg = load_config(path)
    assert type(cfg.trainer.lr) is float and cfg.trainer.lr == 1e-5
    assert cfg.algorithm.loss_kwargs == {"eps_high": 0.3, "eps_low": 0.2}
    assert all(type(v) is float for v in cfg.algorithm.loss_kwargs.values())


def test_mixed_precision_no_is_the_string_not_false(tmp_path):
    # YAML 1.1 reads a bare `no` as False, which the Literal["no", ...] field then rejected
    path = tmp_path / "cfg.yaml"
    path.write_text(TINY.read_text().replace("  save_every: 25", "  save_every: 25\n  mixed_precision: no"))
    assert load_config(path).trainer.mixed_precision == "no"


def test_duplicate_key_is_an_error_naming_the_line(tmp_path):
    text = TINY.read_text() + "\ntrainer:\n  steps: 3\n"
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    dup_line = len(TINY.read_text().splitlines()) + 2
    msg = error_of(load_config, path)
    assert f"{path}:{dup_line}:" in msg
    assert "duplicate key 'trainer'" in msg


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("pipeline: text_reasoning\ntrainer:\n  steps: [1, 2\n  lr: 1\n")
    msg = error_of(load_config, path)
    assert msg.startswith(f"{path}:")
    assert "invalid YAML" in msg
    assert "\n" not in msg


def test_missing_config_file(tmp_path):
    msg = error_of(load_config, tmp_path / "nope.yaml")
    assert msg == f"config file not found: {tmp_path / 'nope.yaml'}"


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n"])
def test_top_level_must_be_a_mapping(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    msg = error_of(load_config, path)
    assert str(path) in msg and "top level must be a mapping" in msg


def test_empty_file_reports_the_first_required_key(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("# nothing\n")
    assert error_of(load_config, path) == f"{path}: key 'pipeline' is required"


# ----------------------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    "override, get, expected",
    [
        ("trainer.lr=1e-5", lambda c: c.trainer.lr, 1e-05),
        ("trainer.lr=2", lambda c: c.trainer.lr, 2.0),
        ("trainer.lr=.5", lambda c: c.trainer.lr, 0.5),
        ("trainer.steps=7", lambda c: c.trainer.steps, 7),
        ("trainer.betas=[0.8, 0.95]", lambda c: c.trainer.betas, [0.8, 0.95]),
        ("trainer.max_grad_norm=null", lambda c: c.trainer.max_grad_norm, None),
        ("trainer.cpu=true", lambda c: c.trainer.cpu, True),
        ("data.shuffle=false", lambda c: c.data.shuffle, False),
        ("data.max_rows=10", lambda c: c.data.max_rows, 10),
        ("trainer.mixed_precision=no", lambda c: c.trainer.mixed_precision, "no"),
        ("model.lora.enabled=true", lambda c: c.model.lora.enabled, True),
        (
            "model.lora.target_modules=[q_proj, v_proj]",
            lambda c: c.model.lora.target_modules,
            ["q_proj", "v_proj"],
        ),
        ("rollout.stop_strings=['</answer>']", lambda c: c.rollout.stop_strings, ["</answer>"]),
        ("rewards.0.weight=0.5", lambda c: c.rewards[0].weight, 0.5),
        (
            "rewards.1.kwargs.strict=false",
            lambda c: c.rewards[1].kwargs,
            {"tags": ["answer"], "strict": False},
        ),
        ("rewards.0.alias=acc", lambda c: c.rewards[0].alias, "acc"),
        ("output_dir=/tmp/run-1", lambda c: c.output_dir, "/tmp/run-1"),
        # nested creation of sections that the file does not have
        ("algorithm.estimator_kwargs.eps=1e-6", lambda c: c.algorithm.estimator_kwargs, {"eps": 1e-6}),
        ("algorithm.filter_kwargs.a.b=3", lambda c: c.algorithm.filter_kwargs, {"a": {"b": 3}}),
        ("model.lora.r=4", lambda c: c.model.lora.r, 4),
        # a str key takes the text as typed (YAML would read these as a mapping / number / comment)
        ("data.prompt_template=Q: {question}", lambda c: c.data.prompt_template, "Q: {question}"),
        ("data.prompt_template={question}", lambda c: c.data.prompt_template, "{question}"),
        ("data.prompt_template=Task #1: {question}", lambda c: c.data.prompt_template, "Task #1: {question}"),
        ("output_dir=2024", lambda c: c.output_dir, "2024"),
        (
            "model.system_prompt=Be brief: answer only",
            lambda c: c.model.system_prompt,
            "Be brief: answer only",
        ),
        ("model.system_prompt=null", lambda c: c.model.system_prompt, None),
        ("model.system_prompt='null'", lambda c: c.model.system_prompt, "null"),
        ("data.eval=a=b.jsonl", lambda c: c.data.eval, "a=b.jsonl"),
    ],
)
def test_override_values(override, get, expected):
    cfg = load_config(TINY, [override])
    value = get(cfg)
    assert value == expected
    assert type(value) is type(expected)
    assert cfg.source == f"{TINY} (with command-line overrides)"


def test_override_1e5_is_float_1e_05():
    cfg = load_config(TINY, ["trainer.lr=1e-5"])
    assert type(cfg.trainer.lr) is float
    assert repr(cfg.trainer.lr) == "1e-05"
    assert parse_override("trainer.lr=1e-5") == (["trainer", "lr"], 1e-05)
    assert parse_override("a.b=1E5") == (["a", "b"], 100000.0)


def test_override_exponent_in_free_form_kwargs_is_a_float():
    cfg = load_config(TINY, ["algorithm.loss_kwargs.eps_high=3e-1"])
    assert cfg.algorithm.loss_kwargs == {"eps_high": 0.3}
    assert type(cfg.algorithm.loss_kwargs["eps_high"]) is float


def test_overrides_apply_in_order_and_leave_the_rest():
    base = load_config(TINY)
    cfg = load_config(TINY, ["trainer.steps=2", "trainer.steps=3", "rewards.1.weight=0.7"])
    assert cfg.trainer.steps == 3
    assert cfg.rewards[1].weight == 0.7
    assert cfg.rewards[0] == base.rewards[0]
    assert cfg.trainer.lr == base.trainer.lr
    assert cfg.model == base.model


def test_override_index_one_past_the_end_appends():
    cfg = load_config(TINY, ["rewards.2.name=overlong", "rewards.2.weight=0.1"])
    assert [r.name for r in cfg.rewards] == ["answer_accuracy", "format", "overlong"]
    assert cfg.rewards[2].weight == 0.1
    cfg = load_config(TINY, ["rollout.stop_strings.0=</answer>"])
    assert cfg.rollout.stop_strings == ["</answer>"]


def test_override_replaces_a_whole_list():
    cfg = load_config(TINY, ["rewards=[{name: format, weight: 2}]"])
    assert cfg.rewards == [RewardConfig(name="format", weight=2.0)]


def test_override_does_not_touch_the_file():
    before = TINY.read_text()
    load_config(TINY, ["trainer.steps=2", "rewards.2.name=overlong"])
    assert TINY.read_text() == before


@pytest.mark.parametrize(
    "override, key, suggestion",
    [
        ("trainer.lrr=1e-5", "trainer.lrr", "'trainer.lr'"),
        ("seeed=3", "seeed", "'seed'"),
        ("rewards.0.wieght=0.5", "rewards[0].wieght", "'rewards[0].weight'"),
        ("rolout.group_size=4", "rolout", "'rollout'"),
        ("model.lora.rr=4", "model.lora.rr", "'model.lora.r'"),
    ],
)
def test_unknown_override_key_says_command_line(override, key, suggestion):
    msg = error_of(load_config, TINY, [override])
    assert msg.startswith(f"command line: override {override!r}: ")
    assert f"unknown key '{key}'" in msg
    assert f"did you mean {suggestion}?" in msg


def test_override_type_error_says_command_line_and_type():
    msg = error_of(load_config, TINY, ["trainer.steps=ten"])
    assert msg == "command line: override 'trainer.steps=ten': key 'trainer.steps' must be int, got str 'ten'"
    msg = error_of(load_config, TINY, ["rollout.group_size=2.5"])
    assert "command line" in msg and "key 'rollout.group_size' must be int, got float 2.5" in msg
    msg = error_of(load_config, TINY, ["trainer.betas=[0.9, 0.95"])  # unparsable: stays text
    assert "key 'trainer.betas' must be list[float], got str '[0.9, 0.95'" in msg


def test_error_in_file_is_still_blamed_on_the_file_when_overrides_are_given(tmp_path):
    data = tiny_data()
    data["trainer"]["lrr"] = 1
    p = write_yaml(tmp_path, data)
    msg = error_of(load_config, p, ["trainer.steps=2"])
    assert msg.startswith(f"{p} (with command-line overrides): unknown key 'trainer.lrr'")
    assert "command line: override" not in msg


@pytest.mark.parametrize(
    "override, fragment",
    [
        (
            "rewards.5.weight=1",
            "'rewards.5' is not a valid index into a list of 2 (use 0..1, or 2 to append)",
        ),
        ("rewards.x.weight=1", "'rewards.x' is not a valid index"),
        ("rewards.-1.weight=1", "'rewards.-1' is not a valid index"),
        ("rewards.7=null", "'rewards.7' is not a valid index"),
        ("trainer.lr.x=1", "'trainer.lr' is a value, not a section"),
        ("trainer.steps", "must look like key.sub=value"),
        ("=3", "has an empty key"),
        ("trainer..lr=3", "the key has an empty part"),
    ],
)
def test_bad_override_paths(override, fragment):
    msg = error_of(load_config, TINY, [override])
    assert msg.startswith("command line: ")
    assert fragment in msg


# ----------------------------------------------------------------------------- cross-field checks


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["rollout.group_size=0"], "key 'rollout.group_size' must be >= 1"),
        (["rollout.prompts_per_step=0"], "key 'rollout.prompts_per_step' must be >= 1"),
        (["rollout.temperature=0"], "key 'rollout.temperature' must be a finite number > 0"),
        (["rollout.top_p=1.5"], "key 'rollout.top_p' must be in (0, 1]"),
        (
            ["trainer.minibatch_size=8", "trainer.microbatch_size=3"],
            "key 'trainer.microbatch_size' (3) must divide trainer.minibatch_size (8)",
        ),
        (["trainer.minibatch_size=0"], "key 'trainer.minibatch_size' must be >= 1 or null"),
        (["trainer.steps=0"], "key 'trainer.steps' must be >= 1"),
        (["trainer.lr=-1e-5"], "key 'trainer.lr' must be a finite number >= 0"),
        (["trainer.lr=.inf"], "key 'trainer.lr' must be a finite number >= 0"),
        (["trainer.betas=[0.9]"], "key 'trainer.betas' must be two numbers"),
        (["trainer.betas=[0.9, 1.0]"], "key 'trainer.betas' must be in [0, 1)"),
        (["trainer.adam_eps=0"], "key 'trainer.adam_eps' must be a finite number > 0"),
        (["trainer.sample_every=0"], "key 'trainer.sample_every' must be >= 1"),
        (["trainer.save_every=0"], "key 'trainer.save_every' must be >= 1"),
        (["trainer.log_every=0"], "key 'trainer.log_every' must be >= 1"),
        (["trainer.keep_checkpoints=0"], "key 'trainer.keep_checkpoints' must be >= 1"),
        (["trainer.max_grad_norm=0"], "key 'trainer.max_grad_norm' must be > 0 or null"),
        (["trainer.warmup_steps=-1"], "key 'trainer.warmup_steps' must be >= 0"),
        (["data.max_rows=0"], "key 'data.max_rows' must be >= 1 or null"),
        (["algorithm.kl_coef=-0.1"], "key 'algorithm.kl_coef' must be a finite number >= 0"),
        (["algorithm.adv_clip=0"], "key 'algorithm.adv_clip' must be > 0 or null"),
        (["rewards=[]"], "key 'rewards' must list at least one reward"),
        (["rewards.0.name=''"], "key 'rewards[0].name' is required"),
        (["rewards.0.weight=.nan"], "key 'rewards[0].weight' must be a finite number"),
        (["rewards.1.name=answer_accuracy"], "key 'rewards[1]' is named 'answer_accuracy' like rewards[0]"),
        (["output_dir=''"], "key 'output_dir' is required"),
    ],
)
def test_cross_field_validation(overrides, expected):
    msg = error_of(load_config, TINY, overrides)
    assert expected in msg
    assert "command line" in msg or str(TINY) in msg


def test_duplicate_reward_names_are_fine_with_an_alias():
    cfg = load_config(TINY, ["rewards.1.name=answer_accuracy", "rewards.1.alias=acc2"])
    assert [r.alias or r.name for r in cfg.rewards] == ["answer_accuracy", "acc2"]


def test_empty_rewards_list_in_file_names_the_file(tmp_path):
    path = write_yaml(tmp_path, {**tiny_data(), "rewards": []})
    assert error_of(load_config, path) == f"{path}: key 'rewards' must list at least one reward"


def test_microbatch_that_divides_minibatch_is_accepted():
    cfg = load_config(TINY, ["trainer.minibatch_size=8", "trainer.microbatch_size=4"])
    assert (cfg.trainer.minibatch_size, cfg.trainer.microbatch_size) == (8, 4)


def test_config_from_dict_names_its_source():
    data = tiny_data()
    data["rollout"]["group_size"] = 0
    msg = error_of(config_from_dict, data, "my-source")
    assert msg == "my-source: key 'rollout.group_size' must be >= 1"
    assert config_from_dict(tiny_data()).source == "<dict>"


# ----------------------------------------------------------------------------- pipeline options


@dataclass
class _Sub:
    depth: int = 1


@dataclass
class _Options:
    levels: int
    mode: Literal["easy", "hard"] = "easy"
    ratio: float = 0.5
    sub: _Sub = field(default_factory=_Sub)
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 <= self.ratio <= 1:
            raise ValueError(f"ratio must be in [0, 1], got {self.ratio}")


PIPE = "test_config_pipeline"


def _build_nothing(cfg: Config) -> None:
    """A pipeline registered only for its options section."""


@pytest.fixture
def options_pipeline():
    import pipelines

    pipelines.register_pipeline(PIPE, options=_Options)(_build_nothing)
    yield PIPE
    pipelines.REGISTRY.unregister(PIPE)


def _with_options(options: Any) -> dict[str, Any]:
    data = tiny_data()
    data["pipeline"] = PIPE
    if options is not ...:
        data["options"] = options
    return data


def test_register_options_builds_the_typed_section(options_pipeline):
    cfg = config_from_dict(_with_options({"levels": 3, "mode": "hard", "sub": {"depth": 2}, "ratio": 1}))
    assert cfg.options == _Options(levels=3, mode="hard", ratio=1.0, sub=_Sub(depth=2))
    assert type(cfg.options.ratio) is float


def test_a_pipeline_finder_can_be_passed(monkeypatch):
    """`load_config` / `config_from_dict` ask the finder they are given (name -> registration metadata) and
    do not import the pipelines package for it."""
    asked = []

    def finder(name):
        asked.append(name)
        return {"options": _Options} if name == PIPE else None

    monkeypatch.setattr(config_mod._registry, "_pipeline_finder", None)
    monkeypatch.setattr(config_mod._registry, "FINDER_GROUP", "no.such.finder.group")
    cfg = config_from_dict(_with_options({"levels": 1}), pipeline_finder=finder)
    assert cfg.options == _Options(levels=1) and asked == [PIPE]
    assert config_from_dict(_with_options({"levels": 1})).options == {"levels": 1}  # no provider: plain data


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"levels": 1, "levles": 2}, "unknown key 'options.levles' (did you mean 'options.levels'?)"),
        (
            {"levels": 1, "sub": {"dept": 2}},
            "unknown key 'options.sub.dept' (did you mean 'options.sub.depth'?)",
        ),
        ({"levels": "three"}, "key 'options.levels' must be int, got str 'three'"),
        ({"levels": 1, "mode": "medium"}, "key 'options.mode' must be 'easy' | 'hard', got str 'medium'"),
        ({"levels": 1, "tags": [1]}, "key 'options.tags[0]' must be str, got int 1"),
        ({}, "key 'options.levels' is required (int)"),
        (..., "key 'options.levels' is required (int)"),
        ([1, 2], "key 'options' must be a mapping (_Options), got list [1, 2]"),
        ({"levels": 1, "ratio": 2}, "section 'options': ratio must be in [0, 1], got 2.0"),
    ],
)
def test_register_options_validation(options_pipeline, options, expected):
    msg = error_of(config_from_dict, _with_options(options), "opts.yaml")
    assert msg.startswith("opts.yaml: ")
    assert expected in msg


def test_options_override_from_command_line(options_pipeline, tmp_path):
    path = write_yaml(tmp_path, _with_options({"levels": 1}))
    cfg = load_config(path, ["options.levels=4", "options.sub.depth=3"])
    assert cfg.options == _Options(levels=4, sub=_Sub(depth=3))
    msg = error_of(load_config, path, ["options.levls=4"])
    assert msg.startswith("command line: override 'options.levls=4'")
    assert "did you mean 'options.levels'?" in msg


def test_unregistered_pipeline_keeps_options_as_plain_data():
    data = tiny_data()
    data["pipeline"] = "someone_elses_pipeline"
    data["options"] = {"anything": [1, {"x": 2}]}
    assert config_from_dict(data).options == {"anything": [1, {"x": 2}]}


def test_registered_pipeline_without_options_rejects_an_options_section():
    data = tiny_data()
    assert data["pipeline"] == "text_reasoning"
    data["options"] = {"bogus": 1}
    msg = error_of(config_from_dict, data)
    assert "key 'options': pipeline 'text_reasoning' takes no options section" in msg and "bogus" in msg
    data["options"] = {}
    assert config_from_dict(data).options == {}


# ----------------------------------------------------------------------------- round trip


def _round_trip(cfg: Config, tmp_path: Path) -> Config:
    path = tmp_path / "dumped.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return load_config(path)


def test_to_dict_round_trip_through_yaml(tmp_path):
    cfg = load_config(
        TINY,
        [
            "trainer.lr=1e-5",
            "trainer.max_grad_norm=null",
            "model.system_prompt=Think: then answer",
            "rollout.stop_strings=['</answer>']",
            "rewards.2.name=overlong",
            "rewards.2.kwargs={max_len: 10, buffer: 4}",
            "algorithm.estimator_kwargs.eps=1e-6",
            "model.lora.target_modules=[q_proj]",
        ],
    )
    d = cfg.to_dict()
    assert "source" not in d
    assert d["trainer"]["lr"] == 1e-5 and d["rewards"][2]["name"] == "overlong"
    back = _round_trip(cfg, tmp_path)
    assert back.to_dict() == d
    assert back == cfg  # `source` differs and is not compared
    assert back.source != cfg.source


def test_to_dict_round_trip_with_typed_options(options_pipeline, tmp_path):
    cfg = config_from_dict(_with_options({"levels": 2, "sub": {"depth": 5}, "tags": ["a"]}))
    d = cfg.to_dict()
    assert d["options"] == {"levels": 2, "mode": "easy", "ratio": 0.5, "sub": {"depth": 5}, "tags": ["a"]}
    back = _round_trip(cfg, tmp_path)
    assert back == cfg
    assert isinstance(back.options, _Options)


def test_to_dict_is_a_deep_copy():
    cfg = load_config(TINY)
    d = cfg.to_dict()
    snapshot = copy.deepcopy(d)
    d["rewards"][0]["kwargs"]["extract"] = "changed"
    d["trainer"]["betas"].append(1)
    assert cfg.to_dict() == snapshot


def test_special_floats_round_trip(tmp_path):
    cfg = load_config(TINY, ["trainer.max_grad_norm=1e3", "rollout.top_p=1e-3"])
    back = _round_trip(cfg, tmp_path)
    assert back.trainer.max_grad_norm == 1000.0 and back.rollout.top_p == 1e-3
    assert not math.isnan(back.rollout.top_p)


@pytest.mark.parametrize(
    "key, value",
    [
        ("estimator", "grpoo"),
        ("loss", "nope"),
        ("loss_agg", "nope"),
        ("kl_estimator", "k9"),
        ("filter", "nope"),
    ],
)
def test_check_names_names_the_key_and_the_registered_names(key, value):
    """`check_names`: the one check of the algorithm's registry names (the CLI's validation, the trainer)."""
    from mmalign.algorithms.names import check_names
    from mmalign.config import ConfigError, config_from_dict

    cfg = config_from_dict(
        {"pipeline": "text_reasoning", "output_dir": "runs/x", "rewards": [{"name": "format"}]}
    )
    check_names(cfg)  # the defaults are registered
    setattr(cfg.algorithm, key, value)
    with pytest.raises(ConfigError, match=rf"key 'algorithm.{key}': unknown .*{value!r}.*Registered: "):
        check_names(cfg)


# ----------------------------------------------------------------------------- configurations that cannot learn


@pytest.mark.parametrize("estimator", sorted(config_mod._GROUP_RELATIVE_ESTIMATORS))
def test_group_of_one_with_a_group_relative_estimator_is_an_error(estimator):
    msg = error_of(load_config, TINY, ["rollout.group_size=1", f"algorithm.estimator={estimator}"])
    assert "key 'rollout.group_size' is 1" in msg
    assert f"algorithm.estimator {estimator!r}" in msg
    assert "command line: override 'rollout.group_size=1'" in msg


def test_group_of_one_in_a_file_names_the_file(tmp_path):
    path = write_yaml(tmp_path, {**tiny_data(), "rollout": {**tiny_data()["rollout"], "group_size": 1}})
    msg = error_of(load_config, path)
    assert msg.startswith(f"{path}: key 'rollout.group_size' is 1, but algorithm.estimator 'grpo' ")


def test_group_of_one_is_fine_for_mc_grpo_and_a_group_of_two_for_all():
    """mc_grpo draws G+1 samples per group: with G=1 the non-median sample still gets an advantage."""
    assert load_config(TINY, ["rollout.group_size=1", "algorithm.estimator=mc_grpo"]).rollout.group_size == 1
    for estimator in sorted(config_mod._GROUP_RELATIVE_ESTIMATORS):
        cfg = load_config(TINY, ["rollout.group_size=2", f"algorithm.estimator={estimator}"])
        assert (cfg.rollout.group_size, cfg.algorithm.estimator) == (2, estimator)


def test_group_relative_estimators_are_the_builtins_with_zero_advantage_for_a_group_of_one():
    """The config's list follows `mmalign.algorithms.advantages`: every built-in estimator is in it exactly when a group
    of `1 + extra_samples` samples (three such groups here, different rewards) gets advantage 0."""
    import inspect

    import torch

    from mmalign.algorithms import advantages

    builtins = [
        n for n in advantages.names() if inspect.unwrap(advantages.get(n)).__module__ == advantages.__name__
    ]
    for name in builtins:
        n = 1 + advantages.extra_samples(name)
        rewards = torch.arange(3 * n, dtype=torch.float32) * 0.37
        group = torch.arange(3).repeat_interleave(n)
        kwargs: dict[str, Any] = {}
        if advantages.accepts_step_rewards(name):
            kwargs = {
                "step_rewards": rewards[:, None].repeat(1, 4),
                "step_mask": torch.ones(3 * n, 4, dtype=torch.bool),
            }
        if advantages.accepts_context(name):  # every field an estimator may need, for 3 groups of n
            b = 3 * n
            kwargs["context"] = advantages.EstimatorContext(
                prompt_ids=group,
                policy_shift=torch.zeros(b),
                logp_old_sum=-rewards,
                logp_ref_sum=-2 * rewards,
                entropy_mean=rewards,
                turn_index=torch.zeros(b, 4, dtype=torch.long),
                turn_state=torch.zeros(b, 1, dtype=torch.long),
                phase_index=torch.zeros(b, 4, dtype=torch.long),
            )
        if advantages.make_state(name) is not None:
            kwargs["state"] = advantages.make_state(name)
        if advantages.accepts_num_actions(name):
            kwargs["num_actions"] = torch.full((3 * n,), 4)
        if name == "factorized":
            kwargs["phase_components"] = [[0]]
        adv = advantages.get(name)(rewards, group, **kwargs)
        assert bool((adv == 0).all()) == (name in config_mod._GROUP_RELATIVE_ESTIMATORS), name
    assert config_mod._GROUP_RELATIVE_ESTIMATORS <= set(builtins)


@pytest.mark.parametrize(
    "overrides",
    [["rewards.0.weight=0", "rewards.1.weight=0"], ["rewards=[{name: format, weight: 0}]"]],
)
def test_every_reward_weight_zero_is_an_error(overrides):
    msg = error_of(load_config, TINY, overrides)
    assert "key 'rewards' has weight 0 everywhere (rewards[0].weight" in msg
    assert "command line: override" in msg


def test_every_reward_weight_zero_in_a_file_names_the_file(tmp_path):
    path = write_yaml(
        tmp_path,
        {
            **tiny_data(),
            "rewards": [{"name": "answer_accuracy", "weight": 0}, {"name": "format", "weight": 0.0}],
        },
    )
    msg = error_of(load_config, path)
    assert msg.startswith(
        f"{path}: key 'rewards' has weight 0 everywhere (rewards[0].weight, rewards[1].weight)"
    )


def test_a_zero_weight_reward_is_fine_when_another_one_counts():
    cfg = load_config(TINY, ["rewards.1.weight=0"])
    assert [r.weight for r in cfg.rewards] == [1.0, 0.0]
    # a negative weight contributes too
    cfg = load_config(TINY, ["rewards.0.weight=0", "rewards.1.weight=-0.5"])
    assert [r.weight for r in cfg.rewards] == [0.0, -0.5]
