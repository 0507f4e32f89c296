"""The tiny models shipped in ``assets/models/`` (so a fresh clone reaches step 1 in seconds): every tiny config's
model and reward-model folders are there, each records the builder the config names with that builder's
default arguments (``mmalign_tiny.json``), and each loads through its pipeline's own ``from_pretrained`` path.
``mmalign tiny build NAME`` rebuilds one."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import yaml

from mmalign import tiny
from mmalign.app.cli import tiny_model_paths
from mmalign.config import load_config

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIGS = sorted((REPO / "configs").glob("*-tiny.yaml"))


def _shipped() -> dict[str, str]:
    import os

    here = Path.cwd()
    os.chdir(REPO)
    try:
        return tiny_model_paths()
    finally:
        os.chdir(here)


def test_every_tiny_config_has_its_models_shipped() -> None:
    paths = _shipped()
    assert len(TINY_CONFIGS) >= 9 and len(paths) >= 9
    for config in TINY_CONFIGS:
        model = (yaml.safe_load(config.read_text()) or {})["model"]
        assert (
            model["name_or_path"] == paths[model["tiny_builder"]] or (REPO / model["name_or_path"]).is_dir()
        ), config.name
    for builder, path in paths.items():
        folder = REPO / path
        assert folder.is_dir(), f"{path} (builder {builder}) is not shipped: mmalign tiny build {builder}"


@pytest.mark.parametrize("builder", sorted(_shipped()))
def test_a_shipped_model_records_its_builder_and_its_default_arguments(builder: str) -> None:
    folder = REPO / _shipped()[builder]
    meta = json.loads((folder / "mmalign_tiny.json").read_text())
    assert meta["builder"] == builder
    registered = tiny.get_builder(builder)
    # a registered builder may be a thin wrapper calling the module's `build_<name>(path, **defaults)`
    full = getattr(inspect.getmodule(registered), f"build_{builder}", registered)
    params = inspect.signature(full).parameters
    compared = 0
    for name, p in params.items():
        if name in meta and p.default is not inspect.Parameter.empty:
            value = list(p.default) if isinstance(p.default, tuple) else p.default
            assert meta[name] == value, (
                f"{folder.name}: {name} = {meta[name]!r}, the builder's default {value!r}"
            )
            compared += 1
    options = meta.get("options")
    assert compared > 0 or options == {}, f"{folder.name} records none of its builder's arguments"


@pytest.mark.parametrize("config", [c.name for c in TINY_CONFIGS])
def test_a_tiny_config_loads_its_shipped_model_without_building(
    config: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipelines

    def refuse(*args, **kwargs):
        raise AssertionError("a shipped tiny model was rebuilt")

    monkeypatch.setattr(tiny, "build", refuse)
    monkeypatch.chdir(REPO)
    cfg = load_config(f"configs/{config}")
    setup = pipelines.get(cfg.pipeline)(cfg)
    assert setup.policy.trainable_parameters()


def _unstamped(d: dict) -> dict:
    """`d` without the library version stamps (``transformers_version``): the installed versions move."""
    return {k: v for k, v in d.items() if not k.endswith("_version")}


@pytest.mark.slow
def test_the_text_reasoning_builder_rebuilds_the_shipped_model(tmp_path: Path) -> None:
    """The tests' warm-started LM (tests/conftest.py, ``tiny_text_model_dir``) is the shipped folder: building it
    again writes the same files, config (version stamps aside), tokenizer and tensors (names and shapes; the values of a warm start on
    another CPU or torch may differ in the last bits), and the rebuilt LM answers the task as the shipped one does."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shipped = REPO / "assets" / "models" / "text_reasoning-tiny"
    built = tiny.build("text_reasoning", tmp_path / "text_reasoning-tiny", announce=False)
    assert sorted(p.name for p in built.iterdir()) == sorted(p.name for p in shipped.iterdir())
    for name in ("config.json", "mmalign_tiny.json", "tokenizer.json"):
        a_json, b_json = (_unstamped(json.loads((f / name).read_text())) for f in (built, shipped))
        assert a_json == b_json, name
    a, b = load_file(built / "model.safetensors"), load_file(shipped / "model.safetensors")
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    prompt = "Q: 3 + 4 = ?\nA:"
    answers = []
    for folder in (built, shipped):
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
        answers.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    assert answers[0] == answers[1] and "<answer>7</answer>" in answers[0], answers
