"""The Hugging Face hub as the preflight sees it: is this process offline, is an id cached, can the hub be
reached, and how to fetch what is missing (`mmalign.app.preflight.check_model_paths` asks these before any
model loads).

Without these checks a missing id surfaces inside `from_pretrained`, after other models have loaded, and only
after huggingface_hub's retries (tens of seconds per id, each retry logged). Here one request per uncached id,
with a short timeout and no retry, decides; with ``HF_HUB_OFFLINE=1`` no request is made at all; and when every
id is cached but the hub does not answer, the process loads from the cache without asking it again.
"""

from __future__ import annotations

import logging
import os

__all__ = ["HUB_TIMEOUT_S", "cache_dir", "cached", "fetch_hint", "offline_reason", "reach", "use_cache_only"]

HUB_TIMEOUT_S = 5.0
"""Seconds one hub request may take before the hub counts as unreachable."""

log = logging.getLogger(__name__)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def offline_reason() -> str | None:
    """The setting that makes this process offline (``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``, or
    huggingface_hub's own constant), or None when it may download."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if _truthy(os.environ.get(var)):
            return f"{var}={os.environ[var]}"
    from huggingface_hub import constants

    return "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else None


def cache_dir() -> str:
    """The hub cache `from_pretrained` reads (huggingface_hub's ``HF_HUB_CACHE``: the environment's
    ``HF_HUB_CACHE`` or ``HF_HOME/hub`` when the process started)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def cached(repo_id: str, files: tuple[str, ...] | list[str]) -> bool | None:
    """Whether one of `files` of the hub repo `repo_id` is in the cache (`cache_dir`); None: not a valid id."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError

    try:
        return any(isinstance(try_to_load_from_cache(repo_id, f, cache_dir=cache_dir()), str) for f in files)
    except HFValidationError:
        return None


def reach(repo_id: str, timeout: float = HUB_TIMEOUT_S, *, repo_type: str = "model") -> str | None:
    """None when the hub answers for the `repo_type` ("model" or "dataset") repo `repo_id` (one request,
    `timeout` seconds, no retry; the endpoint is ``HF_ENDPOINT`` when set); else why not, in a few words."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    info = api.dataset_info if repo_type == "dataset" else api.model_info
    try:
        info(repo_id, timeout=timeout)
        return None
    except GatedRepoError:
        return f"the {repo_type} is gated: accept its terms on the hub and log in (`hf auth login`)"
    except RepositoryNotFoundError:
        return f"the hub has no such {repo_type} (or it is private: log in with `hf auth login`)"
    except Exception as e:  # refused, DNS, timeout, proxy: the hub is not reachable
        first = (str(e).splitlines() or [""])[0][:160]
        return f"the hub is not reachable ({type(e).__name__}: {first})"


def fetch_hint(repo_id: str, key: str) -> str:
    """How to get `repo_id` onto a machine that cannot download it."""
    return (
        f"fetch it where the hub is reachable (`hf download {repo_id}`) into this cache ({cache_dir()}), "
        f"or download it with --local-dir DIR and set {key}=DIR"
    )


def use_cache_only(reason: str) -> None:
    """Offline mode for the rest of this process (``HF_HUB_OFFLINE=1``, also in huggingface_hub's constant that
    transformers and diffusers read): `from_pretrained` then loads from the cache at once instead of retrying
    the hub for each file. Logged once with `reason`."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    log.warning("loading from the Hugging Face cache only: %s", reason)
