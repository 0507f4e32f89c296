"""mmalign/hub.py: the hub ids a config names are found (model, rewards' paths), a cached id passes offline, an
uncached one is refused in one line naming its key and how to fetch it, offline without any request and online
after one short request (here to a closed port on 127.0.0.1: nothing leaves the machine)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from mmalign import hub
from mmalign.config import ConfigError, config_from_dict


def cfg_with(model: str, reward_path: str | None = None, **model_kw: object):
    rewards: list[dict] = [{"name": "answer_accuracy"}]
    if reward_path:
        rewards.append({"name": "clip_score", "kwargs": {"path": reward_path}})
    data = {
        "pipeline": "text_reasoning",
        "output_dir": "runs/x",
        "model": {"name_or_path": model, **model_kw},
    }
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
    path = tmp_path / "hub"
    path.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(path))
    return path


def test_references_are_the_hub_ids_not_the_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "mine").mkdir(parents=True)
    cfg = cfg_with("Qwen/Qwen2.5-0.5B-Instruct", "openai/clip-vit-large-patch14")
    assert hub.hub_references(cfg) == [
        ("model.name_or_path", "Qwen/Qwen2.5-0.5B-Instruct"),
        ("rewards[1].kwargs.path", "openai/clip-vit-large-patch14"),
    ]
    assert hub.hub_references(cfg_with("models/mine")) == []  # a folder on disk
    assert hub.hub_references(cfg_with("assets/x", tiny_builder="text_reasoning")) == []  # built if missing
    assert not hub.looks_like_hub_id("../x/y") and not hub.looks_like_hub_id("/abs/path")


def test_offline_cached_passes_uncached_is_one_line_per_id(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_cached(cache, "Qwen/Qwen2.5-0.5B-Instruct")
    assert hub.check_hub_ids(cfg_with("Qwen/Qwen2.5-0.5B-Instruct")) == []

    def no_request(*a: object, **k: object) -> None:
        raise AssertionError("offline: no hub request may be made")

    monkeypatch.setattr(hub, "_reach", no_request)
    with pytest.raises(ConfigError) as e:
        hub.check_hub_ids(cfg_with("Qwen/Qwen2.5-0.5B-Instruct", "openai/clip-vit-large-patch14"))
    lines = str(e.value).splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("conf.yaml: key 'rewards[1].kwargs.path': 'openai/clip-vit-large-patch14'")
    assert "HF_HUB_OFFLINE is set" in lines[0] and "hf download openai/clip-vit-large-patch14" in lines[0]
    assert str(cache) in lines[0]


def test_online_unreachable_fails_after_one_short_request(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub endpoint is a port on 127.0.0.1 that nothing listens on: the connection is refused at once, and the
    check fails in seconds instead of huggingface_hub's retries."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    with socket.socket() as s:  # a free port, closed again: connections to it are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        hub.check_hub_ids(cfg_with("Qwen/Qwen2.5-0.5B-Instruct"), timeout=2.0)
    assert time.perf_counter() - t0 < 30  # a bound on hanging, not a timing claim
    (line,) = str(e.value).splitlines()
    assert "key 'model.name_or_path': 'Qwen/Qwen2.5-0.5B-Instruct'" in line
    assert "the hub is not reachable" in line and "hf download Qwen/Qwen2.5-0.5B-Instruct" in line


def test_cached_ids_and_an_unreachable_hub_switch_to_the_cache(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Everything is cached but the hub does not answer: the process goes offline (huggingface_hub's constant,
    which transformers and diffusers read), so from_pretrained does not retry the hub for every file."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    write_cached(cache, "Qwen/Qwen2.5-0.5B-Instruct")
    monkeypatch.setattr(hub, "_reach", lambda repo_id, timeout: "the hub is not reachable (test)")
    assert hub.check_hub_ids(cfg_with("Qwen/Qwen2.5-0.5B-Instruct")) == []
    assert constants.HF_HUB_OFFLINE is True and hub.is_offline()
