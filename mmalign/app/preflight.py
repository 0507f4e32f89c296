"""The validation pass of a command: every check of a run that needs no model, before anything slow is built.

Every command that takes a config (`mmalign train`, `sample`, `eval`) reads it with
`mmalign.config.load_config`, then calls `validate` once (the pipeline name, the registry names, then
`preflight`: output directory, model sources, data files, reward specs, code references, writability and the
prompts themselves), and only then the pipeline's ``build``. `fit_setup` / `fit_prompts` apply
``data.too_long`` to the rows built. Each check, in order: docs/architecture.md, "Configs and the command
line". The run directory itself is `mmalign.training.rundir`'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mmalign.algorithms.names import check_names
from mmalign.app.fixtures import check_fixtures_available, ensure_fixtures
from mmalign.config import Config, ConfigError
from mmalign.data.rows import DataError, load_rows, missing_data_hint
from mmalign.registry import RegistryError
from mmalign.training.rundir import WRITE_TEST_PREFIX, check_output_dir
from rewards import check_reward_specs

log = logging.getLogger(__name__)

MODEL_FILES = ("config.json", "model_index.json")
"""A hub id counts as cached when one of these is in the Hugging Face cache (transformers / diffusers folders)."""
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "tokenizer_config.json")
"""A reward's ``processor`` hub id counts as cached when one of these is (a tokenizer / image processor repo)."""


# ----------------------------------------------------------------------------- model folders / hub ids


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_offline() -> str | None:
    """The variable that makes this process offline (``HF_HUB_OFFLINE=1``), or None when it may download
    (`mmalign.data.hub.offline_reason`)."""
    from mmalign.data.hub import offline_reason

    return offline_reason()


def looks_local(name: str) -> bool:
    """`name` is meant as a filesystem path, not a hub id (``name`` or ``org/name``): it starts with
    ``/``, ``./``, ``../`` or ``~``, has more than one ``/`` or a backslash, or its first part is a
    folder here (``assets/typo``)."""
    if name.startswith(("/", "./", "../", "~", ".\\", "..\\")) or Path(name).is_absolute() or "\\" in name:
        return True
    parts = name.split("/")
    return len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir())


def _close_siblings(path: Path) -> str:
    """ " Did you mean 'x'?" for a sibling folder named like `path`, if its parent exists."""
    parent = path.parent
    try:
        names = [p.name for p in parent.iterdir() if not p.name.startswith(".")] if parent.is_dir() else []
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=1)
    return f" Did you mean {str(parent / close[0])!r}?" if close else ""


def check_model_source(
    name: str,
    *,
    key: str,
    source: str,
    files: Sequence[str] = MODEL_FILES,
    local_only: bool = False,
    what: str = "model folder",
) -> str:
    """ConfigError (naming `source` and `key`, and how to fetch a missing hub id) unless `name` can be loaded:
    an existing local path (returns ``"local"``), a hub id in the Hugging Face cache (``"cached"``), or, when
    not offline, a hub id the hub answers for (``"download"``: one request of `mmalign.data.hub.reach`, a few
    seconds at most, no retry).

    Nothing is loaded or downloaded: a local path is checked with `Path.exists`, a hub id against the
    cache with `huggingface_hub.try_to_load_from_cache` (one of `files`)."""
    from mmalign.data import hub

    if not name:
        raise ConfigError(f"{source}: key '{key}' is required (a local {what} or a hub id)")
    path = Path(name).expanduser()
    if path.exists():
        return "local"
    if local_only or looks_local(name):
        raise ConfigError(
            f"{source}: key '{key}': no such {what} {name!r} (looked for {path.resolve()}; relative paths "
            f"start at the working directory).{_close_siblings(path)}"
        )
    where = f"no {path.resolve()}"
    cached = hub.cached(name, tuple(files))
    if cached is None:
        raise ConfigError(
            f"{source}: key '{key}': {name!r} is neither a local {what} ({where}) nor a valid hub id "
            "('name' or 'org/name' of letters, digits, '-', '_' and '.')"
        )
    if cached:
        return "cached"
    offline = hub_offline()
    if offline:
        raise ConfigError(
            f"{source}: key '{key}': {name!r} is neither a local {what} ({where}) nor a hub id that can be "
            f"loaded offline (not in the Hugging Face cache; {offline}): {hub.fetch_hint(name, key)}"
        )
    why = hub.reach(name)
    if why is not None:
        raise ConfigError(
            f"{source}: key '{key}': {name!r} is neither a local {what} ({where}) nor in the Hugging Face "
            f"cache, and {why}: {hub.fetch_hint(name, key)}"
        )
    return "download"


def _check_builder(name: str, key: str, source: str) -> None:
    from mmalign import tiny

    try:
        tiny.get_builder(name)
    except RegistryError as e:
        raise ConfigError(f"{source}: key '{key}': {e}") from None


def built_paths(cfg: Config) -> dict[str, str]:
    """Folders the pipeline builds before loading them (``options.reward_models``: path -> tiny builder)."""
    return dict(getattr(cfg.options, "reward_models", None) or {})


def _same_path(a: str, b: str) -> bool:
    return os.path.normpath(os.path.expanduser(a)) == os.path.normpath(os.path.expanduser(b))


def check_model_paths(cfg: Config, *, eval_rewards: bool = False) -> None:
    """`check_model_source` for ``model.name_or_path`` (unless ``model.tiny_builder`` builds it) and for
    the model folders of the rewards (``rewards[i].kwargs.path``, plus ``eval.rewards`` with
    `eval_rewards`), except folders the pipeline builds first (``options.reward_models``). Tiny
    builder names are checked too."""
    m = cfg.model
    if m.tiny_builder:
        _check_builder(m.tiny_builder, "model.tiny_builder", cfg.source)
        if not m.name_or_path:
            raise ConfigError(
                f"{cfg.source}: key 'model.name_or_path' is required (where model.tiny_builder builds)"
            )
    hub_ids: dict[str, str] = {}  # hub id -> "cached" | "download"
    if not m.tiny_builder:
        kind = check_model_source(m.name_or_path, key="model.name_or_path", source=cfg.source)
        if kind != "local":
            hub_ids[m.name_or_path] = kind
    built = built_paths(cfg)
    for path, builder in built.items():
        _check_builder(builder, f"options.reward_models.{path}", cfg.source)
    lists = [("rewards", cfg.rewards)] + ([("eval.rewards", cfg.eval.rewards)] if eval_rewards else [])
    for list_key, specs in lists:
        for i, spec in enumerate(specs):
            for option, value, kind, files in _reward_model_options(spec):
                if any(_same_path(value, p) for p in built):
                    continue
                found = check_model_source(
                    value,
                    key=f"{list_key}[{i}].kwargs.{option}",
                    source=cfg.source,
                    files=files,
                    local_only=kind == "file",
                    what={"model": "model folder", "processor": "processor folder"}.get(kind, "file"),
                )
                if found != "local":
                    hub_ids[value] = found
    _cache_only_when_unreachable(hub_ids)


def _cache_only_when_unreachable(hub_ids: dict[str, str]) -> None:
    """Every hub id is cached but the hub does not answer: this process loads from the cache only
    (`mmalign.data.hub.use_cache_only`), so `from_pretrained` does not retry the hub for every file."""
    from mmalign.data import hub

    if not hub_ids or "download" in hub_ids.values() or hub_offline():
        return
    first = next(iter(hub_ids))
    why = hub.reach(first)
    if why is not None:
        hub.use_cache_only(f"{', '.join(hub_ids)} are cached and {why}")


def _reward_model_options(spec: Any) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(option, value, "model" | "processor" | "hub_file" | "file", the files that make a hub id count as
    cached) for the options of a built-in reward that name what it loads: ``path`` (a model folder or hub id;
    a local checkpoint file with ``backend: open_clip``), ``processor`` (a tokenizer / image processor folder
    or hub id) and ``mlp_path`` (a local weights file; with ``mlp_file``, a folder or hub id holding that
    file). Plugin rewards are left alone: their ``path`` may mean anything."""
    import inspect

    from rewards import resolve

    kwargs = dict(getattr(spec, "kwargs", None) or {})
    try:
        obj = resolve(spec.name)
    except Exception:  # an unknown name is `check_reward_specs`' message
        return []
    if not isinstance(obj, type) or not obj.__module__.startswith("rewards."):
        return []
    try:
        params = inspect.signature(obj.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return []
    out = []
    for option in ("path", "processor", "mlp_path"):
        value = kwargs.get(option)
        if option not in params or not isinstance(value, str):
            continue
        if option == "processor":
            out.append((option, value, "processor", PROCESSOR_FILES))
        elif option == "mlp_path" and isinstance(kwargs.get("mlp_file"), str):
            out.append((option, value, "hub_file", (kwargs["mlp_file"],)))
        elif option == "mlp_path" or kwargs.get("backend", "hf") != "hf":
            out.append((option, value, "file", ("config.json",)))
        else:
            out.append((option, value, "model", ("config.json",)))
    return out


# ----------------------------------------------------------------------------- code a config names


def _geometry_spec(value: Any) -> str | None:
    """`value` when it is a ``package.module:Class`` geometry-model spec (not a folder that exists)."""
    if not isinstance(value, str) or ":" not in value or Path(value).expanduser().exists():
        return None
    return value


def _check_geometry_model(spec: str, key: str, source: str) -> None:
    """A ConfigError naming `key` unless `spec` imports (`mmalign.registry.import_path`) to a
    `rewards.geometry_model.LatentGeometryModel` subclass or another callable that makes one."""
    from mmalign.registry import import_path
    from rewards.geometry_model import LatentGeometryModel

    try:
        obj = import_path(spec, "geometry model", "package.module:ClassName")
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{source}: key '{key}': {e}") from None
    if isinstance(obj, type) and not issubclass(obj, LatentGeometryModel):
        raise ConfigError(
            f"{source}: key '{key}': geometry model {spec!r} is class {obj.__qualname__}, which does not subclass "
            "rewards.geometry_model.LatentGeometryModel"
        )
    if not callable(obj):
        raise ConfigError(
            f"{source}: key '{key}': geometry model {spec!r} is a {type(obj).__name__}, not a class or a function"
        )


def check_code_references(cfg: Config, *, eval_rewards: bool = False) -> None:
    """Import and check now, before any model loads, the code a config names as ``package.module:attr``
    besides the reward names (`rewards.check_reward_specs` resolves those): ``rollout.loop_kwargs.environment``
    (a callable, `mmalign.data.rollout_loops.resolve_environment`), ``options.geometry_model`` and the
    ``geometry_model`` option of the built-in rewards (a `LatentGeometryModel` class or a function making one).
    A module that does not import, a missing attribute, an object of the wrong kind or a standard-library
    module (`mmalign.registry.refused_module`) is a ConfigError naming the key.

    Importing a module runs its code: a config that names one is code, to be trusted as a script would be."""
    from mmalign.data.rollout_loops import resolve_environment

    spec = cfg.rollout.loop_kwargs.get("environment")
    if spec is not None:
        try:
            resolve_environment(str(spec))
        except ValueError as e:
            raise ConfigError(f"{cfg.source}: key 'rollout.loop_kwargs.environment': {e}") from None
    geometry = _geometry_spec(getattr(cfg.options, "geometry_model", None))
    if geometry is not None:
        _check_geometry_model(geometry, "options.geometry_model", cfg.source)
    lists = [("rewards", cfg.rewards)] + ([("eval.rewards", cfg.eval.rewards)] if eval_rewards else [])
    for list_key, specs in lists:
        for i, item in enumerate(specs):
            geometry = _geometry_spec((getattr(item, "kwargs", None) or {}).get("geometry_model"))
            if geometry is not None and _is_builtin_reward(item.name):
                _check_geometry_model(geometry, f"{list_key}[{i}].kwargs.geometry_model", cfg.source)


def _is_builtin_reward(name: str) -> bool:
    """Whether the reward `name` is one of this project's (its options mean what our docs say)."""
    from rewards import resolve

    try:
        obj = resolve(name)
    except Exception:  # noqa: BLE001 - an unknown name is `check_reward_specs`' message
        return False
    return str(getattr(obj, "__module__", "")).startswith("rewards.")


# ----------------------------------------------------------------------------- data files


def check_data_files(cfg: Config) -> None:
    """``data.train`` and ``data.eval`` (and the ``options`` fields a pipeline marks with ``metadata={"data_files":
    True}``), where set to a file (not ``hf:...``), exist: a ConfigError naming
    the key, a file of a similar name next to it, and the ``hf:`` source or command that gives the file
    (`mmalign.data.rows.missing_data_hint`). Reading them is the pipeline's job (`load_rows`
    reports malformed lines and missing columns with file:line)."""
    files = [("data.train", cfg.data.train), ("data.eval", cfg.data.eval)]
    if dataclasses.is_dataclass(cfg.options):  # options fields a pipeline marks as data files
        for f in dataclasses.fields(cfg.options):
            if f.metadata.get("data_files"):
                value = getattr(cfg.options, f.name)
                items = value if isinstance(value, list) else [value]
                files += [(f"options.{f.name}[{i}]", v) for i, v in enumerate(items) if isinstance(v, str)]
    for key, value in files:
        if not value or value.startswith("hf:"):
            continue
        path = Path(value).expanduser()
        if not path.is_file():
            what = " (it is a directory)" if path.is_dir() else ""
            hint = "" if what else _close_siblings(path)
            source = "" if what else missing_data_hint(value, key=key, pipeline=cfg.pipeline)
            raise ConfigError(
                f"{cfg.source}: key '{key}': data file not found: {value}{what}"
                + (f".{hint}" if hint else "")
                + (f"{'' if hint else '.'} To get it: {source}" if source else "")
            )


# ----------------------------------------------------------------------------- the output directory


def check_output_writable(cfg: Config) -> None:
    """``output_dir`` can hold a run: the folder is created if missing (it stays) and a small temp file is
    written in it and removed. A ConfigError names the path otherwise (a parent that is a file, no
    permission, a read-only filesystem), before any model is loaded."""
    out = Path(cfg.output_dir).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"{cfg.source}: key 'output_dir': cannot create {out}: {e.strerror or e}"
            + (f" ({e.filename})" if e.filename and str(e.filename) != str(out) else "")
        ) from None
    try:
        with tempfile.NamedTemporaryFile(dir=out, prefix=WRITE_TEST_PREFIX, delete=True) as f:
            f.write(b"ok")
            f.flush()
    except OSError as e:
        raise ConfigError(
            f"{cfg.source}: key 'output_dir': {out} is not writable: {e.strerror or e}"
        ) from None


# ----------------------------------------------------------------------------- prompts

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
"""Config attributes that give a model's context length (first found, in the text config of a VLM first)."""


def model_context(config: Any) -> tuple[int, str] | None:
    """(context length in tokens, the attribute that gave it) of a transformers model config; None if none."""
    configs = []
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            configs.append(get_text())
        except Exception:  # noqa: BLE001 - a config without a text part
            pass
    configs.append(config)
    for c in configs:
        for key in CONTEXT_KEYS:
            value = getattr(c, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, key
    return None


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, list | tuple) else [x]


def _text_format(tokenizer: Any, use_chat_template: bool, system_prompt: str | None) -> Any:
    """An object that encodes a prompt exactly as `TextPolicy` does (`TokenSampling._prompt_token_ids`:
    ``model.use_chat_template`` / ``model.system_prompt``), without a model."""
    from mmalign.policies.token_sampling import TokenSampling

    class _TextFormat(TokenSampling):
        def __init__(self) -> None:
            self.tokenizer = tokenizer
            self.use_chat_template = use_chat_template
            self.system_prompt = system_prompt
            self._prompt_cache = {}

    return _TextFormat()


def _vlm_format(processor: Any, system_prompt: str | None) -> Any:
    """An object with `VLMPolicy.format_vlm_prompt` (always the processor's chat template), without a model."""
    from mmalign.policies.vlm import VLMPolicy

    class _VLMFormat:
        format_vlm_prompt = VLMPolicy.format_vlm_prompt

        def __init__(self) -> None:
            self.processor = processor
            self.tokenizer = processor.tokenizer
            self.system_prompt = system_prompt

    return _VLMFormat()


class PromptLengths:
    """The number of tokens a token policy gives a row's prompt, and the model's context.

    Text policies: exactly `TextPolicy`'s encoding (`TokenSampling._prompt_token_ids`: the chat template with
    ``model.system_prompt`` when ``model.use_chat_template``). VLM policies: `VLMPolicy.format_vlm_prompt`'s
    text (the processor's chat template with one placeholder per image) plus, per image, the tokens the
    image processor makes of it where that is cheap: an image processor with ``get_number_of_image_patches``
    and ``merge_size`` (Qwen2-VL family) and an image whose size can be read from its header. Other images
    and video frames count as their one placeholder token (text only)."""

    def __init__(
        self, fmt: Any, context: int, *, vlm: bool, where: str, image_root: Path | None = None
    ) -> None:
        self.fmt = fmt
        self.context = context
        self.vlm = vlm
        self.where = where
        """What gave the context, for messages (``max_position_embeddings of MODEL``)."""
        self.image_root = image_root
        """Relative image paths of unresolved rows (preflight) are looked up here; None: the working directory."""
        self._image_tokens: dict[Any, int] = {}
        self._text_tokens: dict[tuple[str, int, bool], int] = {}

    @property
    def tokenizer(self) -> Any:
        return self.fmt.tokenizer

    def count(self, row: dict[str, Any], prompt: str | None = None) -> int:
        """Tokens of `row`'s prompt (or of `prompt` in its place) as the policy encodes it."""
        text = str(row["prompt"]) if prompt is None else prompt
        if not self.vlm:
            return len(self.fmt._prompt_token_ids(text))
        images = _as_list(row.get("images", row.get("image")))
        key = (text, len(images), bool(row.get("video")))
        n = self._text_tokens.get(key)
        if n is None:
            formatted = self.fmt.format_vlm_prompt(*key)
            n = len(self.tokenizer(formatted, add_special_tokens=False)["input_ids"])
            if len(self._text_tokens) < 100_000:
                self._text_tokens[key] = n
        return n + sum(max(self._tokens_of_image(im) - 1, 0) for im in images)

    def _tokens_of_image(self, image: Any) -> int:
        """Tokens of one image (its size from the header); 1 (its placeholder) where that is not cheap."""
        ip = getattr(getattr(self.fmt, "processor", None), "image_processor", None)
        patches = getattr(ip, "get_number_of_image_patches", None)
        merge = getattr(ip, "merge_size", None)
        if not callable(patches) or not isinstance(merge, int) or merge < 1:
            return 1
        key = image if isinstance(image, str) else id(image)
        if key in self._image_tokens:
            return self._image_tokens[key]
        tokens = 1
        try:
            if isinstance(image, str):
                from PIL import Image

                path = Path(image)
                if not path.is_absolute() and self.image_root is not None:
                    path = self.image_root / path
                with Image.open(path) as im:  # reads the header only
                    width, height = im.size
            else:
                width, height = image.size
            tokens = max(int(patches(height, width)) // (merge * merge), 1)
        except Exception:  # noqa: BLE001 - a missing or unreadable image is the pipeline's error
            tokens = 1
        if len(self._image_tokens) < 100_000:
            self._image_tokens[key] = tokens
        return tokens

    def truncate(self, row: dict[str, Any], budget: int) -> str | None:
        """`row`'s prompt with its start cut so that it encodes to at most `budget` tokens; None when even an
        empty prompt would not fit (the template, system prompt or images alone are too long)."""
        prompt = str(row["prompt"])
        tok = self.tokenizer
        for _ in range(8):  # a cut at a token boundary can re-tokenize a little differently: cut again
            excess = self.count(row, prompt) - budget
            if excess <= 0:
                return prompt
            fast = bool(getattr(tok, "is_fast", False))
            enc = tok(prompt, add_special_tokens=False, return_offsets_mapping=fast)
            ids = enc["input_ids"]
            if excess >= len(ids):
                return None
            if fast:
                prompt = prompt[enc["offset_mapping"][excess][0] :]
            else:
                prompt = tok.decode(ids[excess:], skip_special_tokens=False)
        return prompt if self.count(row, prompt) <= budget else None


def prompt_lengths_for(cfg: Config) -> PromptLengths | None:
    """`PromptLengths` of ``model.name_or_path`` from its tokenizer (or processor) and ``config.json`` only,
    offline; None (with a debug log saying why) when it is no token policy's model or cannot be read
    without a download: a folder a tiny builder has yet to build, no ``config.json`` (a diffusers folder),
    no context length in the config, no tokenizer."""
    m = cfg.model
    name = m.name_or_path
    if m.tiny_builder and not Path(name).expanduser().exists():
        log.debug(
            "prompt length check skipped before the model is built: %s does not exist yet (model.tiny_builder "
            "%s builds it); the built rows are checked once the policy is loaded",
            name,
            m.tiny_builder,
        )
        return None
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(
            name, local_files_only=True, trust_remote_code=m.trust_remote_code
        )
    except Exception as e:  # noqa: BLE001 - not a transformers model folder (diffusers), not cached, ...
        log.debug("prompt length check skipped: no transformers config for %s (%s)", name, e)
        return None
    found = model_context(config)
    if found is None:
        log.debug("prompt length check skipped: the config of %s names no context length", name)
        return None
    context, key = found
    vlm = getattr(config, "vision_config", None) is not None
    try:
        if vlm:
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(
                name, local_files_only=True, trust_remote_code=m.trust_remote_code
            )
            opts = cfg.options
            min_px, max_px = getattr(opts, "min_pixels", None), getattr(opts, "max_pixels", None)
            if min_px is not None or max_px is not None:
                from mmalign.policies.vlm import set_pixel_range

                set_pixel_range(processor, min_px, max_px)
            fmt = _vlm_format(processor, m.system_prompt)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(
                name, local_files_only=True, trust_remote_code=m.trust_remote_code
            )
            fmt = _text_format(tokenizer, m.use_chat_template, m.system_prompt)
    except Exception as e:  # noqa: BLE001 - no tokenizer / processor in the folder
        log.debug("prompt length check skipped: no tokenizer for %s (%s)", name, e)
        return None
    root = getattr(cfg.options, "image_root", None)
    image_root = Path(root) if root else (Path(cfg.data.train).resolve().parent if cfg.data.train else None)
    return PromptLengths(fmt, context, vlm=vlm, where=f"{key} of {name}", image_root=image_root)


def policy_prompt_lengths(cfg: Config, policy: Any) -> PromptLengths | None:
    """`PromptLengths` of a loaded token policy (a `TextPolicy` / `VLMPolicy`, which encode the prompts
    themselves); None for any other policy, or a model config without a context length."""
    from mmalign.policies.token_sampling import TokenSampling

    if not isinstance(policy, TokenSampling):
        return None
    config = getattr(getattr(policy, "model", None), "config", None)
    found = model_context(config) if config is not None else None
    if found is None:
        return None
    vlm = hasattr(policy, "format_vlm_prompt") and getattr(policy, "processor", None) is not None
    return PromptLengths(policy, found[0], vlm=vlm, where=f"{found[1]} of {cfg.model.name_or_path}")


def check_empty_prompts(rows: Sequence[dict[str, Any]], template: str) -> None:
    """A DataError naming the row (file:line) whose prompt is empty (or only whitespace, or not a string)
    after ``data.prompt_template``."""
    for row in rows:
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataError(
                f"{row.get('_source', '?')}: the prompt is empty after data.prompt_template {template!r} "
                f"(got {prompt!r}); fill in the row or drop it"
            )


def fit_prompts(
    cfg: Config,
    rows: list[dict[str, Any]],
    lengths: PromptLengths | Any | None,
    *,
    key: str = "data.train",
    apply: bool = True,
) -> list[dict[str, Any]]:
    """`rows` whose prompts fit the model's context with ``rollout.max_new_tokens``, per ``data.too_long``:
    ``error``: a DataError naming file:line and the length of the first prompt that does not fit (and how many
    more); ``skip``: those rows dropped; ``truncate``: their prompts' start cut so that they fit (a row whose
    template alone does not fit is an error). Skipped / truncated rows are counted in one warning (with
    `apply` False, the preflight check: nothing changes and nothing is logged above debug; `rows` is
    returned as it would be).

    `lengths`: a `PromptLengths`, or a loaded policy (a `TextPolicy` / `VLMPolicy`: its own encoding and
    its model's context); None or any other policy (diffusion): `rows` unchanged."""
    if lengths is not None and not isinstance(lengths, PromptLengths):
        lengths = policy_prompt_lengths(cfg, lengths)
    if lengths is None or not rows:
        return rows
    max_new = cfg.rollout.max_new_tokens
    budget = lengths.context - max_new
    mode = cfg.data.too_long
    counted: dict[str, int] = {}
    over: list[tuple[dict[str, Any], int]] = []
    for row in rows:
        prompt = row.get("prompt")
        if not isinstance(prompt, str):
            continue
        n = counted.get(prompt) if not lengths.vlm else None
        if n is None:
            n = lengths.count(row)
            if not lengths.vlm:
                counted[prompt] = n
        if n > budget:
            over.append((row, n))
    if not over:
        return rows
    first, n_first = over[0]
    more = f" ({len(over) - 1} more row(s) of {key} are too long too)" if len(over) > 1 else ""
    limit = (
        f"with rollout.max_new_tokens ({max_new}) that exceeds the model's context of {lengths.context} "
        f"tokens ({lengths.where})"
    )
    if mode == "error" or budget < 1:
        fix = "shorten it, lower rollout.max_new_tokens, or set data.too_long: skip | truncate"
        if budget < 1:
            fix = "lower rollout.max_new_tokens"
        raise DataError(f"{first.get('_source', key)}: the prompt is {n_first} tokens; {limit}{more}; {fix}")
    longest = max(n for _, n in over)
    ids = {id(r) for r, _ in over}
    if mode == "skip":
        out = [r for r in rows if id(r) not in ids]
        if not out:
            raise DataError(
                f"{key}: every row's prompt is too long ({first.get('_source', key)}: {n_first} tokens; "
                f"{limit}); data.too_long: skip leaves no rows"
            )
        what = "dropped"
    else:
        out = []
        for row in rows:
            if id(row) in ids:
                cut = lengths.truncate(row, budget)
                if cut is None:
                    raise DataError(
                        f"{row.get('_source', key)}: the prompt cannot be truncated to fit: {limit}, and the "
                        "template / system prompt / images alone do not fit; lower rollout.max_new_tokens"
                    )
                row = {**row, "prompt": cut}
            out.append(row)
        what = "truncated at the start"
    message = (
        f"data.too_long: {mode}: {what} {len(over)} of {len(rows)} rows of {key} whose prompt + "
        f"rollout.max_new_tokens ({max_new}) exceeds the context of {lengths.context} tokens (the longest "
        f"{longest} tokens; first {first.get('_source', key)})"
    )
    if apply:
        log.warning(message)
    else:
        log.debug("will be %s", message)
    return out


def media_columns(cfg: Config) -> tuple[str, ...]:
    """The row columns that hold a prompt's images or video (`pipelines.common.IMAGE_COLUMNS`, and the
    pipeline's own ``options.image_column`` where it has one)."""
    from pipelines.common import IMAGE_COLUMNS

    extra = getattr(cfg.options, "image_column", None)
    return (*IMAGE_COLUMNS, extra) if isinstance(extra, str) and extra not in IMAGE_COLUMNS else IMAGE_COLUMNS


def _freeze(value: Any) -> Any:
    """A hashable stand-in for a column value (lists -> tuples; an in-memory image -> its identity)."""
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return id(value)


def prompt_key(row: dict[str, Any], columns: Sequence[str]) -> tuple[Any, ...]:
    """What makes a row's prompt distinct: its text and its media `columns` (image paths, frames): the same
    question about two pictures is two prompts."""
    return (str(row.get("prompt")), *(_freeze(row.get(c)) for c in columns))


def check_distinct_prompts(cfg: Config, rows: Sequence[dict[str, Any]]) -> None:
    """Fewer distinct training prompts (`prompt_key`: the text and the images or video, `media_columns`) than
    ``rollout.prompts_per_step``: a warning (a step then trains copies of the same prompts), or a DataError
    with ``data.too_few_prompts: error``."""
    columns = media_columns(cfg)
    distinct = len({prompt_key(r, columns) for r in rows})
    need = cfg.rollout.prompts_per_step
    if distinct >= need:
        return
    text = (
        f"data.train {cfg.data.train} has {distinct} distinct prompt(s) ({len(rows)} rows), fewer than "
        f"rollout.prompts_per_step ({need}): every step trains copies of the same prompts"
    )
    if cfg.data.too_few_prompts == "error":
        raise DataError(f"{text}; add rows or lower rollout.prompts_per_step (data.too_few_prompts: error)")
    log.warning("%s; add rows or lower rollout.prompts_per_step (data.too_few_prompts: error stops)", text)


def _read_rows(cfg: Config, source: str, max_rows: int | None) -> list[dict[str, Any]] | None:
    """The rows of `source` as the pipelines read them (`load_rows`, after ``data.prompt_template``). With
    ``options.on_bad_row: skip`` unreadable lines of a local file are left out as the pipeline leaves them
    out (`pipelines.common.load_rows_skipping`)."""
    try:
        return load_rows(source, cfg.data.prompt_template, max_rows)
    except DataError:
        if getattr(cfg.options, "on_bad_row", "error") != "skip" or source.startswith("hf:"):
            raise
    from pipelines.common import load_rows_skipping

    return load_rows_skipping(source, cfg.data.prompt_template, max_rows)


IMAGE_CHECK_SECONDS = 20.0
"""How long the validation pass may spend decoding the images of ``data.train`` and ``data.eval`` (in row
order; all of them when they take less)."""


def _image_root(cfg: Config, source: str) -> Path:
    """The folder a row's relative image paths start at, as the pipelines resolve them: ``options.image_root``
    (``options.video_root``), else the data file's folder (the working directory for ``hf:`` sources)."""
    root = getattr(cfg.options, "image_root", None) or getattr(cfg.options, "video_root", None)
    if root:
        return Path(root)
    return Path.cwd() if source.startswith("hf:") else Path(source).resolve().parent


def check_images(
    cfg: Config, key: str, source: str, rows: Sequence[dict[str, Any]], deadline: float
) -> tuple[int, int]:
    """Decode (``PIL.Image.open`` + ``load``) the image files that the rows of `source` (config key `key`) name,
    each once, in row order, until `deadline` (a `time.monotonic` value); (decoded, total) images. An image
    that does not decode (truncated, corrupt) is a DataError naming the row's file:line and the image, before
    any model loads, unless ``options.on_bad_row: skip`` (then the pipeline decodes every image when it loads
    the data and skips those rows: nothing is done here). Missing files are left to the pipeline's loader,
    which names them."""
    from pipelines.common import bad_image_message, image_files, image_problem

    if getattr(cfg.options, "on_bad_row", "error") == "skip":
        return 0, 0
    columns = media_columns(cfg)
    root = _image_root(cfg, source)
    seen: set[str] = set()
    decoded = 0
    for row in rows:
        for path in image_files(row, root, columns):
            if path in seen:
                continue
            seen.add(path)
            if time.monotonic() > deadline:
                continue  # counted, not decoded
            problem = image_problem(path)
            if problem is not None:
                fix = ", or set options.on_bad_row: skip" if hasattr(cfg.options, "on_bad_row") else ""
                raise DataError(bad_image_message(str(row.get("_source", key)), path, problem) + fix)
            decoded += 1
    return decoded, len(seen)


def check_prompts(cfg: Config, *, training: bool) -> None:
    """The prompts of ``data.train`` and ``data.eval``, before any model is loaded: none empty
    (`check_empty_prompts`); their image files decode (`check_images`, for `IMAGE_CHECK_SECONDS` at most); for
    a token policy, each fits the context with ``rollout.max_new_tokens`` per ``data.too_long`` (`fit_prompts`
    without changing anything; the CLI applies skip / truncate to the built rows with `fit_setup`); when
    `training`, enough distinct prompts (`check_distinct_prompts`, counted after a ``skip``)."""
    sources = [("data.train", cfg.data.train, cfg.data.max_rows), ("data.eval", cfg.data.eval, None)]
    lengths: PromptLengths | None = None
    loaded = False
    deadline = time.monotonic() + IMAGE_CHECK_SECONDS
    for key, source, max_rows in sources:
        if not source:
            continue
        rows = _read_rows(cfg, source, max_rows)
        if rows is None:
            continue
        check_empty_prompts(rows, cfg.data.prompt_template)
        decoded, images = check_images(cfg, key, source, rows, deadline)
        if decoded < images:
            log.info(
                "decoded %d of the %d images of %s in the %g s the validation pass gives them; the others are "
                "decoded when training reads them (one that does not decode then stops the run, naming its row)",
                decoded,
                images,
                key,
                IMAGE_CHECK_SECONDS,
            )
        if not loaded:
            lengths, loaded = prompt_lengths_for(cfg), True
        kept = fit_prompts(cfg, rows, lengths, key=key, apply=False)
        if training and key == "data.train":
            extra = [
                k for k, v in getattr(cfg.options, "__dict__", {}).items() if k.endswith("_prompts") and v
            ]
            if extra:  # (safe_diffusion: options.safe_prompts / unsafe_prompts add training rows)
                log.debug("distinct prompt count not checked: options.%s add training prompts", extra[0])
            else:
                check_distinct_prompts(cfg, kept)


def fit_setup(cfg: Config, components: Any) -> Any:
    """`fit_prompts` on what a pipeline built (its ``data`` and ``eval_data``, with its policy's own
    encoding): ``data.too_long: skip | truncate`` take effect for the run. Other policies: unchanged.
    Returns `components` (changed in place)."""
    policy = getattr(components, "policy", None)
    lengths = policy_prompt_lengths(cfg, policy) if policy is not None else None
    if lengths is None:
        return components
    for attr, key in (("data", "data.train"), ("eval_data", "data.eval")):
        rows = getattr(components, attr, None)
        if rows:
            setattr(components, attr, fit_prompts(cfg, list(rows), lengths, key=key))
    return components


# ----------------------------------------------------------------------------- all of it


def preflight(cfg: Config, *, resume: bool | None = None, eval_rewards: bool = False) -> None:
    """Every check of a command that needs no model, cheapest first: the output directory, the trackers'
    packages and a forward-process objective's settings (`check_flow_objective`) (`resume` None: not training,
    no check), that the data files exist, the reward names and options
    and the other ``module:attr`` references (`check_code_references`), the model folders and hub ids; in
    training that ``output_dir`` is writable (`check_output_writable`); then the prompts (`check_prompts`:
    empty, images that do not decode, too long for the context, too few distinct ones), from the rows and, for
    a token policy, the tokenizer and config of the model only. The pipeline's ``build`` reads the data files
    again, before its model."""
    check_fixtures_available(cfg)  # a tiny builder on a wheel install (no mmalign.tiny): needs a checkout
    if resume is not None:
        from mmalign.app.trackers import check_available

        check_output_dir(cfg, resume)
        check_available(cfg)  # a tracker in trainer.log_with whose package is missing
        check_flow_objective(cfg)
        check_training_setup(cfg)
    check_data_files(cfg)
    check_reward_specs(cfg.rewards, cfg.source)  # the reward names: module:attr ones are imported here
    if eval_rewards:
        check_reward_specs(cfg.eval.rewards, cfg.source, key="eval.rewards")
    check_code_references(cfg, eval_rewards=eval_rewards)
    check_model_paths(cfg, eval_rewards=eval_rewards)
    if resume is not None:
        check_output_writable(cfg)
        check_trainable_sampler(cfg)
    check_prompts(cfg, training=resume is not None)


def check_flow_objective(cfg: Config) -> None:
    """The settings of a forward-process objective (``algorithm.objective``) that the config alone decides,
    before any model loads (`mmalign.policies.flow_training.ObjectiveSettings.from_config`: ``algorithm.solver``
    against ``options.noise_level``, the keys and values of ``algorithm.timesteps``, ``algorithm.old_policy`` and
    ``algorithm.eval_ema``, ``ema_kl_beta``'s type, and a pairwise objective's whole-group batches over the
    processes the launcher started). A ConfigError naming the file and the key; nothing without an objective."""
    from mmalign.policies.flow_training import ObjectiveSettings
    from mmalign.training.distributed import launched_processes

    ObjectiveSettings.from_config(cfg, world=launched_processes())


def check_training_setup(cfg: Config) -> None:
    """What the trainer would refuse about a config once its model had loaded, checked before: the batches
    over the processes the launcher started (`mmalign.training.distributed.check_batches`), the round hooks'
    options (`algorithm.group_refill`) and the group
    filter's options (`mmalign.algorithms.filters.build_filter`, which builds nothing heavy)."""
    from mmalign.algorithms import filters
    from mmalign.algorithms.round_hooks import build_round_hooks
    from mmalign.training.distributed import check_batches, launched_processes

    check_batches(cfg, launched_processes())
    build_round_hooks(cfg, [1.0] * max(1, len(cfg.rewards)))  # their options (e.g. algorithm.group_refill)
    a = cfg.algorithm
    try:
        filters.build_filter(a.filter, **a.filter_kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{cfg.source}: key 'algorithm.filter_kwargs': {e}") from None


def check_trainable_sampler(cfg: Config) -> None:
    """Training a denoising policy with ``options.noise_level: 0`` (the deterministic ODE, no log-probs) is
    refused before any model loads; a forward-process objective (``algorithm.objective``) trains on any
    solver, the ODE included. The policy's ``setup`` refuses it too (for code that builds a trainer itself)."""
    if cfg.algorithm.objective is None and getattr(cfg.options, "noise_level", None) == 0:
        raise ConfigError(
            f"{cfg.source}: key 'options.noise_level': 0 samples the deterministic ODE, which has no log-probs "
            "to train; set it > 0 for training ('options.eval_noise_level' chooses how `mmalign sample` and "
            "`mmalign eval` sample, the ODE by default), or train with a forward-process objective "
            "(algorithm.objective: diffusion_nft or awm)"
        )


def validate(
    cfg: Config, *, resume: bool | None = None, eval_rewards: bool = False
) -> Callable[[Config], Any]:
    """The one validation pass of a command, after `mmalign.config.load_config` checked the schema: the
    pipeline name, the registry names of ``algorithm`` (`mmalign.algorithms.names.check_names`), then `preflight`
    (output directory and trackers when `resume` is not None, data files, rewards, model folders, prompts).
    Every problem is a `ConfigError` (a `DataError` for the rows) naming the file and the key or line.

    Returns the pipeline's ``build``, wrapped so that what it builds goes through `fit_setup`
    (``data.too_long: skip | truncate`` applied to the built rows with the loaded policy's own encoding, and
    ``error`` for a prompt the preflight could not measure because a tiny builder had yet to build the model)."""
    import functools

    import pipelines

    try:
        build = pipelines.get(cfg.pipeline)
    except RegistryError as e:
        raise ConfigError(f"{cfg.source}: key 'pipeline': {e}") from None
    check_names(cfg)
    preflight(cfg, resume=resume, eval_rewards=eval_rewards)

    @functools.wraps(build)
    def build_and_fit(cfg: Config) -> Any:
        ensure_fixtures(cfg)  # the tiny models the config names (`mmalign.app.fixtures`), before the pipeline
        return fit_setup(cfg, build(cfg))

    return build_and_fit
