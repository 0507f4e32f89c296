"""Issue 33, item 2: a config that names ``module:attr`` is code. The validation pass (`mmalign.app.preflight`)
imports and checks every such reference before any model loads, refuses standard-library modules and builtins
(``os:system``, ``this:s``, ``builtins:eval``), and ``python -m mmalign`` no longer imports a ``payload.py``
from the folder it runs in (the working directory that ``python -m`` puts on ``sys.path``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from mmalign.app import preflight
from mmalign.app.cli import main
from mmalign.config import ConfigError, load_config
from mmalign.registry import import_path, refused_module

ROOT = Path(__file__).resolve().parents[2]

PLUGIN = """
import os

from rewards import Reward

VALUE = "not a reward"


class NotAReward:
    pass


class Length(Reward):
    def __call__(self, batch):
        return [float(len(t)) for t in batch.texts]


def environment(state, row, turn, text):
    return None
"""


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A plugin module on sys.path (as an installed package would be); its name."""
    name = f"mm_plugin_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def config(tmp_path: Path, model: Path, reward: str, **sections: Any) -> Path:
    """A text_reasoning config on the random tiny model whose only reward is `reward`."""
    data: dict[str, Any] = {
        "pipeline": "text_reasoning",
        "output_dir": str(tmp_path / "run"),
        "model": {"name_or_path": str(model), "tiny_builder": None},
        "data": {"train": str(ROOT / "assets" / "text_reasoning" / "train.jsonl")},
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4},
        "rewards": [{"name": reward}],
        "trainer": {"steps": 1},
    }
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def error_line(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- the standard library is refused


@pytest.mark.parametrize("spec", ["os:system", "this:s", "subprocess:run", "builtins:eval", "os.path:join"])
def test_standard_library_reward_is_refused_naming_the_key_before_importing_it(
    capsys, tmp_path, no_model, random_text_model_dir, spec
):
    module = spec.partition(":")[0]
    was_imported = module in sys.modules
    line = error_line(capsys, "train", str(config(tmp_path, random_text_model_dir, spec)))
    assert "key 'rewards[0].name'" in line and spec in line and "standard-library module" in line, line
    if module == "this":  # importing `this` prints the Zen of Python: it must not have run
        assert not was_imported and "this" not in sys.modules


def test_a_standard_library_object_reached_through_a_plugin_is_refused(plugin):
    with pytest.raises(
        ValueError, match=rf"'{plugin}:os.system' resolves to posix.system: .*standard-library"
    ):
        import_path(f"{plugin}:os.system", "reward")
    with pytest.raises(ValueError, match="resolves to os.*standard-library"):
        import_path(f"{plugin}:os", "reward")
    with pytest.raises(ValueError, match="dunder attribute"):
        import_path(f"{plugin}:Length.__init__.__globals__", "reward")


def test_refused_modules():
    for name in ("os", "os.path", "subprocess", "builtins", "this", "sys", "importlib.util", "__main__"):
        assert refused_module(name), name
    for name in ("rewards", "rewards.text", "pipelines", "numpy", "torch", "mm_plugin"):
        assert refused_module(name) is None, name


# ----------------------------------------------------------------------------- every reference is checked


@pytest.mark.parametrize(
    "attr, fragment",
    [
        ("Missing", "has no attribute 'Missing'"),
        ("NotAReward", "does not subclass rewards.Reward"),
        ("VALUE", "resolves to str, not a Reward class or a function"),
    ],
)
def test_plugin_reward_of_the_wrong_kind_is_refused_before_any_model(
    capsys, tmp_path, no_model, random_text_model_dir, plugin, attr, fragment
):
    line = error_line(capsys, "train", str(config(tmp_path, random_text_model_dir, f"{plugin}:{attr}")))
    assert "key 'rewards[0]" in line and fragment in line, line


def test_a_plugin_reward_of_the_right_kind_passes(tmp_path, random_text_model_dir, plugin):
    cfg = load_config(config(tmp_path, random_text_model_dir, f"{plugin}:Length"), [])
    preflight.preflight(cfg, resume=False)


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("os:getcwd", "standard-library module"),
        ("{plugin}:missing", "has no attribute 'missing'"),
        ("{plugin}:VALUE", "is not callable"),
        ("mm_no_such_module_33:env", "No module named 'mm_no_such_module_33'"),
    ],
)
def test_rollout_environment_is_checked_before_any_model(
    capsys, tmp_path, no_model, random_text_model_dir, plugin, spec, fragment
):
    path = config(
        tmp_path,
        random_text_model_dir,
        "format",
        rollout={"loop": "multi_turn", "loop_kwargs": {"environment": spec.format(plugin=plugin)}},
    )
    line = error_line(capsys, "train", str(path))
    assert "key 'rollout.loop_kwargs.environment'" in line and fragment in line, line


def test_a_plugin_environment_passes(tmp_path, random_text_model_dir, plugin):
    path = config(
        tmp_path,
        random_text_model_dir,
        "format",
        rollout={"loop": "multi_turn", "loop_kwargs": {"environment": f"{plugin}:environment"}},
    )
    preflight.check_code_references(load_config(path, []))


def test_geometry_model_specs_are_checked(tmp_path, plugin):
    """``options.geometry_model`` (euphonium) and the geometry rewards' ``geometry_model`` option."""
    path = ROOT / "configs" / "euphonium-tiny.yaml"
    cfg = load_config(path, [f"options.geometry_model={plugin}:NotAReward"])
    with pytest.raises(
        ConfigError, match=r"key 'options.geometry_model': .*does not subclass .*LatentGeometryModel"
    ):
        preflight.check_code_references(cfg)
    cfg = load_config(path, ["options.geometry_model=os:getcwd"])
    with pytest.raises(ConfigError, match="key 'options.geometry_model': .*standard-library"):
        preflight.check_code_references(cfg)
    cfg = load_config(path, [f"rewards.0.kwargs.geometry_model={plugin}:VALUE"])
    with pytest.raises(
        ConfigError, match=r"key 'rewards\[0\].kwargs.geometry_model': .*not a class or a function"
    ):
        preflight.check_code_references(cfg)
    preflight.check_code_references(load_config(path, []))  # the shipped folders are not import specs


def test_pipeline_name_is_never_an_import_path(capsys, tmp_path, no_model, random_text_model_dir):
    path = config(tmp_path, random_text_model_dir, "format")
    line = error_line(capsys, "train", str(path), "pipeline=this:s")
    assert "key 'pipeline'" in line and "unknown pipeline 'this:s'" in line, line


# ----------------------------------------------------------------------------- the working directory


def test_python_m_mmalign_does_not_import_a_payload_from_the_working_directory(
    tmp_path, random_text_model_dir
):
    """The tester's probe: a ``payload.py`` beside the config, run from its folder. Python puts the working
    directory first on sys.path for ``python -m``; `mmalign.__main__` takes it off, as the ``mmalign`` script
    has it, and the error says how to import from there on purpose."""
    marker = tmp_path / "payload-ran"
    (tmp_path / "payload.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef reward(completions, **kw):\n    return [0.0] * len(completions)\n"
    )
    path = config(tmp_path, random_text_model_dir, "payload:reward")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [sys.executable, "-m", "mmalign", "train", str(path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert not marker.exists()
    last = done.stderr.strip().splitlines()[-1]
    assert "key 'rewards[0].name'" in last and "No module named 'payload'" in last, last
    assert "payload.py is in the working directory" in last and "PYTHONPATH" in last, last
