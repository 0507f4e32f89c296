"""Hub ids of a config, checked before any model loads: each is a local folder, in the local Hugging Face cache,
or reachable on the hub; otherwise one `ConfigError` line names the config key, the id and how to fetch it.

Without this check a missing id surfaces inside `from_pretrained`, after other models have loaded, and only
after huggingface_hub's retries (tens of seconds per id). Here one request per uncached id, with a short
timeout and no retry, decides; with ``HF_HUB_OFFLINE=1`` no request is made at all.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mmalign.config import Config, ConfigError

__all__ = [
    "HUB_TIMEOUT_S",
    "check_hub_ids",
    "hub_references",
    "is_offline",
    "looks_like_hub_id",
    "use_cache_only",
]

HUB_TIMEOUT_S = 5.0
"""Seconds one hub request may take before the id counts as unreachable."""

_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_ID_KEYS = ("name_or_path", "path", "processor", "processor_path", "model_id", "repo_id")
"""Config keys whose string value may be a hub id (also any key ending in ``_name_or_path`` / ``_path``)."""


def looks_like_hub_id(value: Any) -> bool:
    """True for an ``org/name`` string (the form `from_pretrained` takes for a hub repository)."""
    return isinstance(value, str) and bool(_ID.match(value)) and ".." not in value


def _id_key(key: str) -> bool:
    return key in _ID_KEYS or key.endswith(("_name_or_path", "_path"))


def _walk(node: Any, where: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{where}.{k}" if where else str(k)
            if isinstance(v, str) and _id_key(str(k)):
                yield key, v
            else:
                yield from _walk(v, key)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{where}[{i}]")


def hub_references(cfg: Config) -> list[tuple[str, str]]:
    """``(config key, id)`` for every value of the config that names a model by hub id and is not a folder on
    disk (relative to the working directory). A model built by ``model.tiny_builder`` is skipped."""
    out = []
    for key, value in _walk(cfg.to_dict(), ""):
        if key == "model.name_or_path" and cfg.model.tiny_builder:
            continue
        if looks_like_hub_id(value) and not Path(value).expanduser().exists():
            out.append((key, value))
    return out


def is_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set to a true value: no hub request may be made."""
    return any(
        os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _cached(repo_id: str) -> bool:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    for repo_type in ("model", "dataset"):
        try:
            snapshot_download(repo_id, repo_type=repo_type, local_files_only=True, cache_dir=_cache_dir())
            return True
        except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
            continue
    return False


def _reach(repo_id: str, timeout: float) -> str | None:
    """None when the hub answers for `repo_id`; else why not, in a few words."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    try:
        api.model_info(repo_id, timeout=timeout)
        return None
    except GatedRepoError:
        return "the repository is gated: accept its licence on the hub and log in (`hf auth login`)"
    except RepositoryNotFoundError:
        return "no such repository on the hub (or it is private: log in with `hf auth login`)"
    except Exception as e:  # connection refused, DNS, timeout, proxy: the hub is not reachable
        first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        return f"the hub is not reachable ({type(e).__name__}: {first})"


def check_hub_ids(cfg: Config, *, timeout: float = HUB_TIMEOUT_S) -> list[str]:
    """Check every `hub_references` id of `cfg`: a cached one passes; an uncached one is refused when offline,
    else asked of the hub once (`timeout` seconds, no retry). Raises one `ConfigError` listing each id that
    cannot be had (its key, why, and how to fetch it); returns the ids that will be downloaded at load."""
    problems, to_download, cached = [], [], []
    for key, repo_id in hub_references(cfg):
        if _cached(repo_id):
            cached.append(repo_id)
            continue
        if is_offline():
            why = "HF_HUB_OFFLINE is set, so nothing is downloaded"
        else:
            why = _reach(repo_id, timeout)
            if why is None:
                to_download.append(repo_id)
                continue
        problems.append(
            f"{cfg.source}: key '{key}': '{repo_id}' is neither a local folder nor in the Hugging Face cache "
            f"({_cache_dir()}), and {why}. Fetch it where the hub is reachable (`hf download {repo_id}`, "
            f"into the same cache or with --local-dir DIR and then {key}=DIR)"
        )
    if problems:
        raise ConfigError("\n".join(problems))
    if cached and not to_download and not is_offline() and _reach(cached[0], timeout) is not None:
        use_cache_only(f"the hub is not reachable and {', '.join(cached)} are cached")
    return to_download


def use_cache_only(reason: str) -> None:
    """Offline mode for the rest of this process (``HF_HUB_OFFLINE=1``, also in huggingface_hub's constant
    that transformers and diffusers read): `from_pretrained` then loads from the cache at once instead of
    retrying the hub for each file. Logged once with `reason`."""
    import logging

    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    logging.getLogger(__name__).warning("loading from the Hugging Face cache only: %s", reason)


def _cache_dir() -> str:
    """The hub cache as the environment names it now (``HF_HUB_CACHE``, else ``HF_HOME/hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return os.path.join(home, "hub")
