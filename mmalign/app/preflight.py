"""The validation pass of a command: every check of a run that needs no model, before anything slow is built.

A wrong command should fail in seconds, not after minutes of model building: every command that takes a
config (`mmalign train`, `sample`, `eval`) reads it with `mmalign.config.load_config` (the schema: keys,
types, cross-field rules) and then calls `validate` once, and only then the pipeline's ``build`` (which
loads the data files first and the model last). `validate` checks, cheapest first:

- the pipeline name (``pipelines.get``) and the registry names of ``algorithm`` (`mmalign.config.check_names`);
- then `preflight`, the checks of the files and options the config names:
- `mmalign.rundir.check_output_dir(cfg, resume)`: ``output_dir`` already holds a run (without ``--resume``
  or ``overwrite=true``), or ``--resume`` finds no checkpoint. `GroupTrainer` calls it again (and then
  acts on the folder: loads the checkpoint, or clears it under ``overwrite``) once the model is loaded.
- `check_model_source(...)` / `check_model_paths(cfg)`: ``model.name_or_path`` and the model folders
  that rewards name (``rewards[i].kwargs.path``) are local folders, folders a tiny builder will create,
  or hub ids that can be loaded (offline: ids already in the Hugging Face cache).
- `check_data_files(cfg)`: ``data.train`` / ``data.eval`` name files that exist.
- `rewards.check_reward_specs(specs, source)`: every reward name resolves and its ``kwargs`` fit the reward's
  constructor, without constructing it (some load a model when constructed).

The run directory itself (its layout, checkpoints, samples) is `mmalign.rundir`'s.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from mmalign.config import Config, ConfigError, check_names
from mmalign.registry import RegistryError
from mmalign.rundir import check_output_dir
from rewards import check_reward_specs

MODEL_FILES = ("config.json", "model_index.json")
"""A hub id counts as cached when one of these is in the Hugging Face cache (transformers / diffusers folders)."""


# ----------------------------------------------------------------------------- model folders / hub ids


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_offline() -> str | None:
    """The variable that makes this process offline (``HF_HUB_OFFLINE=1``), or None when it may download."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if _truthy(os.environ.get(var)):
            return f"{var}={os.environ[var]}"
    try:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            return "HF_HUB_OFFLINE=1"
    except ImportError:  # pragma: no cover - a dependency of transformers
        pass
    return None


def looks_local(name: str) -> bool:
    """`name` is meant as a filesystem path, not a hub id (``name`` or ``org/name``): it starts with
    ``/``, ``./``, ``../`` or ``~``, has more than one ``/`` or a backslash, or its first part is a
    folder here (``assets/typo``)."""
    if name.startswith(("/", "./", "../", "~", ".\\", "..\\")) or Path(name).is_absolute() or "\\" in name:
        return True
    parts = name.split("/")
    return len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir())


def _cached(repo_id: str, files: Iterable[str]) -> bool | None:
    """Whether one of `files` of the hub repo `repo_id` is in the local cache; None: not a valid repo id."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError

    try:
        for filename in files:
            if isinstance(try_to_load_from_cache(repo_id, filename), str):
                return True
    except HFValidationError:
        return None
    return False


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
) -> None:
    """ConfigError (naming `source` and `key`) unless `name` can be loaded: an existing local path, or
    a hub id (`local_only` False) that is in the Hugging Face cache or may be downloaded (not offline).

    Nothing is loaded or downloaded: a local path is checked with `Path.exists`, a hub id against the
    cache with `huggingface_hub.try_to_load_from_cache` (one of `files`)."""
    if not name:
        raise ConfigError(f"{source}: key '{key}' is required (a local {what} or a hub id)")
    path = Path(name).expanduser()
    if path.exists():
        return
    if local_only or looks_local(name):
        raise ConfigError(
            f"{source}: key '{key}': no such {what} {name!r} (looked for {path.resolve()}; relative paths "
            f"start at the working directory).{_close_siblings(path)}"
        )
    where = f"no {path.resolve()}"
    cached = _cached(name, files)
    if cached is None:
        raise ConfigError(
            f"{source}: key '{key}': {name!r} is neither a local {what} ({where}) nor a valid hub id "
            "('name' or 'org/name' of letters, digits, '-', '_' and '.')"
        )
    offline = hub_offline()
    if not cached and offline:
        from huggingface_hub import constants

        raise ConfigError(
            f"{source}: key '{key}': {name!r} is neither a local {what} ({where}) nor a hub id that can be "
            f"loaded offline (not in the Hugging Face cache {constants.HF_HUB_CACHE}; {offline})"
        )


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
    else:
        check_model_source(m.name_or_path, key="model.name_or_path", source=cfg.source)
    built = built_paths(cfg)
    for path, builder in built.items():
        _check_builder(builder, f"options.reward_models.{path}", cfg.source)
    lists = [("rewards", cfg.rewards)] + ([("eval.rewards", cfg.eval.rewards)] if eval_rewards else [])
    for list_key, specs in lists:
        for i, spec in enumerate(specs):
            for option, value, kind in _reward_model_options(spec):
                if any(_same_path(value, p) for p in built):
                    continue
                check_model_source(
                    value,
                    key=f"{list_key}[{i}].kwargs.{option}",
                    source=cfg.source,
                    files=("config.json",),
                    local_only=kind == "file",
                    what="model folder" if kind == "model" else "file",
                )


def _reward_model_options(spec: Any) -> list[tuple[str, str, str]]:
    """(option, value, "model" | "file") for the options of a built-in reward that name what it loads:
    ``path`` (a model folder or hub id; a local checkpoint file with ``backend: open_clip``) and
    ``mlp_path`` (a local weights file). Plugin rewards are left alone: their ``path`` may mean anything."""
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
    for option in ("path", "mlp_path"):
        value = kwargs.get(option)
        if option in params and isinstance(value, str):
            local_file = option != "path" or kwargs.get("backend", "hf") != "hf"
            out.append((option, value, "file" if local_file else "model"))
    return out


# ----------------------------------------------------------------------------- data files


def check_data_files(cfg: Config) -> None:
    """``data.train`` and ``data.eval``, where set to a file (not ``hf:...``), exist: a ConfigError naming
    the key (and a file of a similar name next to it). Reading them is the pipeline's job (`load_rows`
    reports malformed lines and missing columns with file:line)."""
    for key, value in (("data.train", cfg.data.train), ("data.eval", cfg.data.eval)):
        if not value or value.startswith("hf:"):
            continue
        path = Path(value).expanduser()
        if not path.is_file():
            what = " (it is a directory)" if path.is_dir() else ""
            hint = "" if what else _close_siblings(path)
            raise ConfigError(
                f"{cfg.source}: key '{key}': data file not found: {value}{what}"
                + (f".{hint}" if hint else "")
            )


# ----------------------------------------------------------------------------- all of it


def preflight(cfg: Config, *, resume: bool | None = None, eval_rewards: bool = False) -> None:
    """Every check of a command that needs no model, cheapest first: the output directory and the trackers'
    packages (`resume` None: not training, no check), that the data files exist, the reward names and options, the model
    folders and hub ids. The data files are read by the pipeline's ``build``, before its model."""
    if resume is not None:
        from mmalign.app.trackers import check_available

        check_output_dir(cfg, resume)
        check_available(cfg)  # a tracker in trainer.log_with whose package is missing
    check_data_files(cfg)
    check_reward_specs(cfg.rewards, cfg.source)
    if eval_rewards:
        check_reward_specs(cfg.eval.rewards, cfg.source, key="eval.rewards")
    check_model_paths(cfg, eval_rewards=eval_rewards)


def validate(
    cfg: Config, *, resume: bool | None = None, eval_rewards: bool = False
) -> Callable[[Config], Any]:
    """The one validation pass of a command, after `mmalign.config.load_config` checked the schema: the
    pipeline name, the registry names of ``algorithm`` (`mmalign.config.check_names`), then `preflight`
    (output directory and trackers when `resume` is not None, data files, rewards, model folders). Every
    problem is a `ConfigError` naming the file and the key. Returns the pipeline's ``build``."""
    import pipelines

    try:
        build = pipelines.get(cfg.pipeline)
    except RegistryError as e:
        raise ConfigError(f"{cfg.source}: key 'pipeline': {e}") from None
    check_names(cfg)
    preflight(cfg, resume=resume, eval_rewards=eval_rewards)
    return build
