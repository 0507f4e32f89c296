"""mmalign/data/hub.py through the preflight's model check (`check_model_paths`): a cached id passes offline; an
uncached one is refused in one line naming its key and how to fetch it, offline without any request and online
after one short request (here to a closed port on 127.0.0.1: nothing leaves the machine); an all-cached config
whose hub does not answer switches the process to the cache."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from mmalign.app import preflight
from mmalign.config import ConfigError, config_from_dict
from mmalign.data import hub

QWEN, CLIP = "Qwen/Qwen2.5-0.5B-Instruct", "openai/clip-vit-large-patch14"


def cfg_with(model: str, reward_path: str | None = None):
    rewards: list[dict] = [{"name": "answer_accuracy"}]
    if reward_path:
        rewards.append({"name": "clip_score", "kwargs": {"path": reward_path}})
    data = {"pipeline": "text_reasoning", "output_dir": "runs/x", "model": {"name_or_path": model}}
    return config_from_dict({**data, "rewards": rewards}, source="conf.yaml")


def write_cached(cache: Path, repo_id: str) -> None:
    """The layout huggingface_hub writes for a downloaded model repo: refs/main names a snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    path = tmp_path / "hub"
    path.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.chdir(tmp_path)
    return path


def online(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)


def test_offline_cached_passes_uncached_is_named_with_how_to_fetch(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_cached(cache, QWEN)
    write_cached(cache, CLIP)
    preflight.check_model_paths(cfg_with(QWEN, CLIP))  # both cached

    def no_request(*a: object, **k: object) -> None:
        raise AssertionError("offline: no hub request may be made")

    monkeypatch.setattr(hub, "reach", no_request)
    with pytest.raises(ConfigError) as e:
        preflight.check_model_paths(cfg_with(QWEN, "openai/clip-vit-base-patch32"))
    (line,) = str(e.value).splitlines()
    assert line.startswith("conf.yaml: key 'rewards[1].kwargs.path': 'openai/clip-vit-base-patch32'")
    assert "HF_HUB_OFFLINE=1" in line and "hf download openai/clip-vit-base-patch32" in line
    assert str(cache) in line and "rewards[1].kwargs.path=DIR" in line


def test_online_unreachable_fails_after_one_short_request(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub endpoint is a port on 127.0.0.1 that nothing listens on: the connection is refused at once, and the
    check fails in seconds instead of after huggingface_hub's retries."""
    online(monkeypatch)
    with socket.socket() as s:  # a free port, closed again: connections to it are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        preflight.check_model_paths(cfg_with(QWEN))
    assert time.perf_counter() - t0 < 30  # a bound on hanging, not a timing claim
    (line,) = str(e.value).splitlines()
    assert line.startswith(f"conf.yaml: key 'model.name_or_path': '{QWEN}'")
    assert "the hub is not reachable" in line and f"hf download {QWEN}" in line


def test_cached_ids_and_an_unreachable_hub_switch_to_the_cache(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Everything is cached but the hub does not answer: the process goes offline (huggingface_hub's constant,
    which transformers and diffusers read), so from_pretrained does not retry the hub for every file."""
    from huggingface_hub import constants

    online(monkeypatch)
    write_cached(cache, QWEN)
    asked: list[str] = []
    monkeypatch.setattr(
        hub, "reach", lambda repo_id, timeout=5.0: asked.append(repo_id) or "unreachable (test)"
    )
    preflight.check_model_paths(cfg_with(QWEN))
    assert asked == [QWEN] and constants.HF_HUB_OFFLINE is True and hub.offline_reason()


def test_cached_ids_and_a_reachable_hub_stay_online(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    online(monkeypatch)
    write_cached(cache, QWEN)
    monkeypatch.setattr(hub, "reach", lambda repo_id, timeout=5.0: None)
    preflight.check_model_paths(cfg_with(QWEN))
    assert constants.HF_HUB_OFFLINE is False and hub.offline_reason() is None
