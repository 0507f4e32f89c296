"""Typed, validated run configuration: YAML files plus dotted command-line overrides.

A config is a tree of dataclasses. Loading checks every key and value against the declared
fields and types; an unknown or misspelled key is an error naming the key, the file and a
close match. Command-line overrides use dotted paths: ``trainer.lr=1e-5 rollout.group_size=4``;
values are parsed as YAML scalars (so ``1e-5`` is a float, ``[a, b]`` a list, ``null`` None).

Pipelines may declare their own typed section: ``register_options("my_pipeline", MyOptions)``
makes the top-level ``options:`` mapping validate against ``MyOptions``.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and the source."""


# ----------------------------------------------------------------------------- sections


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] | str = "all-linear"


@dataclass
class ModelConfig:
    name_or_path: str = ""
    """Hub id or local folder, loaded with `from_pretrained`."""
    tiny_builder: str | None = None
    """If set and `name_or_path` does not exist, build that tiny model there first (mmalign.tiny)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora: LoraConfig = field(default_factory=LoraConfig)
    use_chat_template: bool = False
    system_prompt: str | None = None
    gradient_checkpointing: bool = False
    attn_implementation: str | None = None
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    train: str = ""
    """JSONL file (one JSON object per line), or `hf:<dataset>[:<split>]` for Hugging Face datasets."""
    eval: str | None = None
    prompt_template: str = "{question}"
    """Python format string over the row's columns; gives the prompt text."""
    shuffle: bool = True
    max_rows: int | None = None


@dataclass
class RolloutConfig:
    group_size: int = 8
    prompts_per_step: int = 8
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_strings: list[str] = field(default_factory=list)
    engine: Literal["hf"] = "hf"
    batch_size: int | None = None
    """Generate at most this many sequences at once (None: the whole step)."""


@dataclass
class RewardConfig:
    name: str = ""
    """Registered name, entry point of group `mmalign.rewards`, or `package.module:Class`."""
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    alias: str | None = None


@dataclass
class AlgorithmConfig:
    estimator: str = "grpo"
    estimator_kwargs: dict[str, Any] = field(default_factory=dict)
    loss: str = "ppo_clip"
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    loss_agg: str = "token_mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    adv_clip: float | None = None
    filter: str = "none"
    filter_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainerConfig:
    steps: int = 100
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    num_iterations: int = 1
    """mu: passes over each rollout."""
    minibatch_size: int | None = None
    """Samples per optimizer step (None: the whole rollout, one optimizer step per pass)."""
    microbatch_size: int | None = None
    """Samples per forward/backward; gradients accumulate up to `minibatch_size`."""
    shuffle_minibatches: bool = True
    max_grad_norm: float | None = 1.0
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    cpu: bool = False
    log_every: int = 1
    sample_every: int = 10
    save_every: int = 50
    keep_checkpoints: int = 2
    progress_bar: bool = True


@dataclass
class Config:
    pipeline: str = ""
    output_dir: str = ""
    seed: int = 0
    overwrite: bool = False
    """Allow training into an `output_dir` that already holds a run (its metrics are replaced)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rewards: list[RewardConfig] = field(default_factory=list)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    options: Any = None
    """Pipeline-specific section, typed by the pipeline (see `register_options`)."""
    source: str = "<dict>"
    """Where the config came from (set by the loader; not a YAML key)."""

    def to_dict(self) -> dict[str, Any]:
        out = _to_plain(self)
        out.pop("source", None)
        return out


_OPTIONS: dict[str, type] = {}


def register_options(pipeline: str, options_cls: type) -> None:
    """Declare the dataclass that validates the `options:` section of `pipeline`'s configs."""
    _OPTIONS[pipeline] = options_cls


# ----------------------------------------------------------------------------- conversion


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [_to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    return obj


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


class _Mismatch(Exception):
    pass


def _convert(value: Any, tp: Any, key: str, src: str) -> Any:
    """Check `value` against type `tp`; return it converted (dicts into dataclasses)."""
    if tp is Any:
        return value
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key, src)
            except (_Mismatch, ConfigError):
                continue
        raise _Mismatch
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise _Mismatch
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Mismatch
        return _build(tp, value, key, src)
    if origin is list:
        if not isinstance(value, list):
            raise _Mismatch
        (item_tp,) = get_args(tp) or (Any,)
        return [_convert_checked(v, item_tp, f"{key}[{i}]", src) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads "1e-5" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise _Mismatch from None
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if isinstance(value, tp):
        return value
    raise _Mismatch


def _convert_checked(value: Any, tp: Any, key: str, src: str) -> Any:
    try:
        return _convert(value, tp, key, src)
    except _Mismatch:
        raise ConfigError(
            f"{src}: key '{key}' must be {_type_name(tp)}, got {type(value).__name__} {value!r}"
        ) from None


def _build(cls: type, data: dict[str, Any], prefix: str, src: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    kwargs: dict[str, Any] = {}
    for k, v in data.items():
        full = f"{prefix}.{k}" if prefix else str(k)
        if k not in fields:
            close = difflib.get_close_matches(str(k), list(fields), n=1)
            hint = f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""
            raise ConfigError(
                f"{src}: unknown key '{full}'{hint}. Valid keys here: {', '.join(sorted(fields))}"
            )
        kwargs[k] = _convert_checked(v, hints[k], full, src)
    return cls(**kwargs)


# ----------------------------------------------------------------------------- overrides


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], parsed value)."""
    if "=" not in text:
        raise ConfigError(f"command line: override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"command line: override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"command line: cannot parse the value of {key!r}: {e}") from None
    return key.split("."), value


def apply_override(data: dict[str, Any], path: list[str], value: Any) -> None:
    node: Any = data
    for i, part in enumerate(path[:-1]):
        if isinstance(node, list):
            try:
                node = node[int(part)]
            except (ValueError, IndexError):
                raise ConfigError(
                    f"command line: '{'.'.join(path)}': {'.'.join(path[: i + 1])} is not a valid list index"
                ) from None
            continue
        if part not in node or node[part] is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict | list):
            raise ConfigError(f"command line: '{'.'.join(path)}': '{'.'.join(path[: i + 1])}' is not a section")
    last = path[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


# ----------------------------------------------------------------------------- entry points


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    """Validate a plain mapping into a `Config` (errors name the key and `source`)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    raw_options = data.get("options")
    data = {k: v for k, v in data.items() if k != "options"}
    cfg = _build(Config, data, "", source)
    cfg.source = source
    options_cls = _OPTIONS.get(cfg.pipeline)
    if options_cls is not None:
        cfg.options = _build(options_cls, raw_options or {}, "options", source)
    elif raw_options is not None:
        cfg.options = raw_options
    validate(cfg)
    return cfg


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config and apply `key.sub=value` overrides; raise ConfigError on any problem."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    source = str(path)
    for text in overrides:
        keys, value = parse_override(text)
        apply_override(data, keys, value)
        source = f"{path} (with command-line overrides)"
    return config_from_dict(data, source)


def validate(cfg: Config) -> None:
    """Cross-field checks that the type system cannot express."""
    src = cfg.source
    r, t, a = cfg.rollout, cfg.trainer, cfg.algorithm

    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{src}: key '{key}' {msg}")

    need(bool(cfg.pipeline), "pipeline", "is required")
    need(bool(cfg.output_dir), "output_dir", "is required")
    need(r.group_size >= 1, "rollout.group_size", "must be >= 1")
    need(r.prompts_per_step >= 1, "rollout.prompts_per_step", "must be >= 1")
    need(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
    need(r.temperature > 0, "rollout.temperature", "must be > 0 (sampling is required for GRPO)")
    need(0 < r.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
    need(t.steps >= 1, "trainer.steps", "must be >= 1")
    need(t.lr >= 0, "trainer.lr", "must be >= 0")
    need(t.num_iterations >= 1, "trainer.num_iterations", "must be >= 1")
    need(len(t.betas) == 2, "trainer.betas", "must be two numbers")
    for key in ("minibatch_size", "microbatch_size"):
        v = getattr(t, key)
        need(v is None or v >= 1, f"trainer.{key}", "must be >= 1 or null")
    if t.minibatch_size and t.microbatch_size:
        need(
            t.minibatch_size % t.microbatch_size == 0,
            "trainer.microbatch_size",
            f"({t.microbatch_size}) must divide trainer.minibatch_size ({t.minibatch_size})",
        )
    need(t.save_every >= 1 and t.log_every >= 1, "trainer.save_every", "and trainer.log_every must be >= 1")
    need(a.kl_coef >= 0, "algorithm.kl_coef", "must be >= 0")
    need(a.adv_clip is None or a.adv_clip > 0, "algorithm.adv_clip", "must be > 0 or null")
    need(len(cfg.rewards) >= 1, "rewards", "must list at least one reward")
    for i, rw in enumerate(cfg.rewards):
        need(bool(rw.name), f"rewards[{i}].name", "is required")
