"""Open pipeline discovery: pipelines own their options, third-party pipelines come in through entry points.

A pipeline registers with ``@register_pipeline(name, options=OptionsClass)``; `mmalign.config` learns the
options class through the hook in `mmalign.registry` without importing ``pipelines``. Pipelines are found in
the ``pipelines`` package (pkgutil) and in the ``mmalign.pipelines`` entry-point group; tiny model builders
in ``mmalign.tiny`` and the ``mmalign.tiny_builders`` group. The third-party packages here are written into
``tmp_path`` with a ``*.dist-info`` folder, so `importlib.metadata` finds their entry points as if installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

import pipelines
from mmalign import tiny
from mmalign.app import cli
from mmalign.config import ConfigError, config_from_dict, load_config
from mmalign.registry import PluginError

REPO = Path(__file__).resolve().parents[2]
TRAIN_JSONL = REPO / "assets" / "text_reasoning" / "train.jsonl"

TOY_PIPELINE = '''
"""A third-party pipeline: the text policy on a tiny model, its own reward and its own options."""

from dataclasses import dataclass

from mmalign.data.rows import load_rows
from mmalign.policies.text import TextPolicy
from pipelines import TrainingSetup, register_pipeline
from rewards import Reward, RewardSet


@dataclass
class ToyOptions:
    max_rows: int = 8
    target_len: int = 4


class ToyReward(Reward):
    """1 when the completion has at most `target_len` characters."""

    needs = {"texts"}

    def __init__(self, *, target_len: int = 4) -> None:
        self.target_len = target_len

    def __call__(self, batch):
        return [float(len(t) <= self.target_len) for t in batch.texts]


BUILT_WITH = []


@register_pipeline("toy_thirdparty", options=ToyOptions)
def build(cfg):
    """Toy third-party pipeline (tiny text policy, length reward)."""
    assert isinstance(cfg.options, ToyOptions), cfg.options
    BUILT_WITH.append(cfg.options)
    rows = load_rows(cfg.data.train, cfg.data.prompt_template, cfg.options.max_rows)
    policy = TextPolicy.from_pretrained(
        cfg.model.name_or_path,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
    )
    return TrainingSetup(policy=policy, rewards=RewardSet(cfg.rewards, source=cfg.source), data=rows)
'''

TOY_BUILDER = '''
from mmalign.tiny import BUILDERS


@BUILDERS.register("toy_thirdparty_builder", minutes=0.01)
def build_toy(path):
    """Writes one file."""
    (path / "config.json").write_text("{}")
'''


def write_dist(root: Path, dist: str, groups: dict[str, dict[str, str]], files: dict[str, str]) -> None:
    """An installed-looking distribution in `root`: its files and a ``<dist>-0.1.dist-info`` folder whose
    ``entry_points.txt`` declares `groups` ({group: {name: value}})."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = []
    for group, eps in groups.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


def forget(*modules: str) -> None:
    for name in list(sys.modules):
        if name in modules or name.startswith(tuple(m + "." for m in modules)):
            del sys.modules[name]


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path for third-party distributions; discovery caches and what the test registered
    are forgotten before and after."""
    root = tmp_path / "site"
    root.mkdir()
    # the built-in entries first (their modules register once per process: they must not be unregistered)
    before_pipes, before_builders = set(pipelines.names()), set(tiny.load_builders())
    monkeypatch.syspath_prepend(str(root))
    pipelines.refresh()
    tiny.DISCOVERY.clear()
    yield root
    for name in set(pipelines.REGISTRY.names()) - before_pipes:
        pipelines.REGISTRY.unregister(name)
        pipelines.DISCOVERY.origins.pop(name, None)
    for name in set(tiny.BUILDERS.names()) - before_builders:
        tiny.BUILDERS.unregister(name)
        tiny.DISCOVERY.origins.pop(name, None)
    forget("toy_thirdparty_pkg", "toy_builder_pkg")
    pipelines.refresh()
    tiny.DISCOVERY.clear()


@pytest.fixture
def toy_dist(site):
    write_dist(
        site,
        "toy-thirdparty",
        {"mmalign.pipelines": {"toy_thirdparty": "toy_thirdparty_pkg.pipeline"}},
        {"toy_thirdparty_pkg/__init__.py": "", "toy_thirdparty_pkg/pipeline.py": TOY_PIPELINE},
    )
    return site


@pytest.fixture
def broken_dist(site):
    write_dist(
        site,
        "toy-broken",
        {"mmalign.pipelines": {"broken_toy": "toy_broken_missing_module:build"}},
        {},
    )
    return site


def toy_config(tmp_path: Path, model_dir: Path, **options) -> Path:
    data = {
        "pipeline": "toy_thirdparty",
        "output_dir": str(tmp_path / "run"),
        "seed": 0,
        "model": {"name_or_path": str(model_dir)},
        "data": {"train": str(TRAIN_JSONL), "prompt_template": "Q: {question} = ?\nA:"},
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4},
        "rewards": [{"name": "toy_thirdparty_pkg.pipeline:ToyReward", "kwargs": {"target_len": 3}}],
        "trainer": {"steps": 1, "progress_bar": False, "sample_every": 1, "save_every": 100},
        "options": {"max_rows": 6, **options},
    }
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ----------------------------------------------------------------------------- a third-party pipeline


def test_thirdparty_pipeline_trains_one_step_through_the_cli(
    toy_dist, tmp_path, random_text_model_dir, capsys
):
    assert "toy_thirdparty" not in pipelines.REGISTRY
    path = toy_config(tmp_path, random_text_model_dir, target_len=2)

    cfg = load_config(path)  # the default finder: the hook finds the entry point
    assert type(cfg.options).__name__ == "ToyOptions"
    assert (cfg.options.max_rows, cfg.options.target_len) == (6, 2)
    assert (
        pipelines.origin("toy_thirdparty")
        == "entry point 'toy_thirdparty' of distribution 'toy-thirdparty' 0.1"
    )

    rc = cli.main(["train", str(path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "done: steps 1..1" in out
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]
    assert "reward/toy_thirdparty_pkg.pipeline:ToyReward/mean" in metrics[0]
    module = sys.modules["toy_thirdparty_pkg.pipeline"]
    assert module.BUILT_WITH == [module.ToyOptions(max_rows=6, target_len=2)]


def test_thirdparty_options_are_validated(toy_dist, tmp_path, capsys):
    path = toy_config(tmp_path, tmp_path / "no-model", target_lenn=2)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: unknown key 'options.target_lenn' (did you mean 'options.target_len'?)")

    assert cli.main(["train", str(path)]) == 1
    err = capsys.readouterr().err
    assert "mmalign: error:" in err and "unknown key 'options.target_lenn'" in err
    assert "Traceback" not in err

    with pytest.raises(ConfigError, match="key 'options.max_rows' must be int, got str 'many'"):
        load_config(path, ["options.max_rows=many"])


def test_list_shows_thirdparty_pipelines_and_warns_about_broken_ones(toy_dist, broken_dist, capsys):
    assert cli.main(["list", "pipelines"]) == 0
    out, err = capsys.readouterr()
    lines = {ln.split()[0]: ln for ln in out.splitlines()[1:]}
    assert {"text_reasoning", "vlm_reasoning", "text_to_image", "safe_diffusion", "toy_thirdparty"} <= set(
        lines
    )
    assert "Toy third-party pipeline" in lines["toy_thirdparty"]
    assert "[entry point 'toy_thirdparty' of distribution 'toy-thirdparty' 0.1]" in lines["toy_thirdparty"]
    assert "broken_toy" not in lines
    assert "mmalign: warning: pipeline entry point 'broken_toy'" in err and "'toy-broken'" in err
    assert "Traceback" not in err


def test_broken_entry_point_is_a_clear_error(broken_dist, tmp_path, capsys):
    data = yaml.safe_load((REPO / "configs" / "text_reasoning-tiny.yaml").read_text())
    data.update(pipeline="broken_toy", output_dir=str(tmp_path / "run"))
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(data))

    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert msg.startswith(
        f"{path}: key 'pipeline': pipeline entry point 'broken_toy' = 'toy_broken_missing_module:build'"
    )
    assert "group mmalign.pipelines, distribution 'toy-broken' 0.1" in msg
    assert "could not be loaded: ModuleNotFoundError: No module named 'toy_broken_missing_module'" in msg

    with pytest.raises(PluginError, match="distribution 'toy-broken'"):
        pipelines.get("broken_toy")

    assert cli.main(["train", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("mmalign: error:") == 1 and "entry point 'broken_toy'" in err and "Traceback" not in err


def test_broken_entry_point_does_not_hide_other_pipelines(broken_dist):
    assert pipelines.get("text_reasoning").__module__ == "pipelines.text_reasoning"
    assert "text_reasoning" in pipelines.names()
    assert [str(e) for e in pipelines.load_errors()][0].startswith("pipeline entry point 'broken_toy'")
    with pytest.raises(KeyError) as e:  # an unknown name lists close matches and the broken entry point
        pipelines.get("text_reasoningg")
    assert "Did you mean 'text_reasoning'" in str(e.value)
    assert "Also: pipeline entry point 'broken_toy'" in str(e.value)


def test_unknown_pipeline_name_suggests_a_close_match(tmp_path, capsys):
    data = yaml.safe_load((REPO / "configs" / "text_reasoning-tiny.yaml").read_text())
    data.update(pipeline="text_reasonin", output_dir=str(tmp_path / "run"))
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(data))
    assert cli.main(["train", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}: key 'pipeline': unknown pipeline 'text_reasonin'. Did you mean 'text_reasoning'" in err


# ----------------------------------------------------------------------------- the package scan


def test_a_new_module_in_the_pipelines_package_is_found_without_a_list(tmp_path, monkeypatch):
    extra = tmp_path / "extra_pipelines"
    extra.mkdir()
    (extra / "zz_scanned_pipeline.py").write_text(
        textwrap.dedent(
            """
            from dataclasses import dataclass
            from pipelines import register_pipeline

            @dataclass
            class ZZOptions:
                depth: int = 1

            @register_pipeline("zz_scanned_pipeline", options=ZZOptions)
            def build(cfg):
                '''Found by the pkgutil scan.'''
            """
        )
    )
    (extra / "zz_other_name.py").write_text(
        "from pipelines import register_pipeline\n\n"
        "register_pipeline('zz_registered_under_another_name')(lambda cfg: None)\n"
    )
    monkeypatch.setattr(pipelines, "__path__", [*pipelines.__path__, str(extra)])
    pipelines.refresh()
    try:
        meta = pipelines.find("zz_scanned_pipeline")  # by module name: only that module is imported
        assert meta is not None and meta["options"].__name__ == "ZZOptions"
        assert "pipelines.zz_other_name" not in sys.modules
        assert pipelines.find("zz_registered_under_another_name") is not None  # the full scan
        assert {"zz_scanned_pipeline", "zz_registered_under_another_name"} <= set(pipelines.names())
        data = yaml.safe_load((REPO / "configs" / "text_reasoning-tiny.yaml").read_text())
        data.update(pipeline="zz_scanned_pipeline", options={"depth": 3})
        assert config_from_dict(data).options.depth == 3
        data.update(pipeline="zz_registered_under_another_name")
        with pytest.raises(ConfigError, match="takes no options section"):
            config_from_dict(data)
    finally:
        for name in ("zz_scanned_pipeline", "zz_registered_under_another_name"):
            pipelines.REGISTRY.unregister(name)
        forget("pipelines.zz_scanned_pipeline", "pipelines.zz_other_name")
        pipelines.refresh()


def test_options_must_be_a_dataclass():
    class NotADataclass:
        pass

    with pytest.raises(TypeError, match="options must be a dataclass"):
        pipelines.register_pipeline("zz_bad_options", options=NotADataclass)
    assert "zz_bad_options" not in pipelines.REGISTRY

    @dataclass
    class Fine:
        x: int = 0

    def build(cfg):
        return None

    pipelines.register_pipeline("zz_fine_options", options=Fine)(build)
    try:
        assert pipelines.options_class("zz_fine_options") is Fine
        assert pipelines.options_class("text_reasoning") is None
    finally:
        pipelines.REGISTRY.unregister("zz_fine_options")


def test_thirdparty_tiny_builder_entry_point(site, tmp_path):
    write_dist(
        site,
        "toy-builder",
        {"mmalign.tiny_builders": {"toy_builder": "toy_builder_pkg"}},
        {"toy_builder_pkg/__init__.py": TOY_BUILDER},
    )
    assert "toy_thirdparty_builder" in tiny.load_builders()
    assert "text_reasoning" in tiny.BUILDERS  # the package scan
    out = tiny.build("toy_thirdparty_builder", tmp_path / "toy-model", announce=False)
    assert (out / "config.json").is_file()


# ----------------------------------------------------------------------------- layering and laziness


def test_config_does_not_import_pipelines_and_imports_only_the_named_pipeline():
    """In a fresh interpreter: `mmalign.config` imports neither ``pipelines`` nor ``rewards``; ``import pipelines``
    imports no pipeline module (nor torch); loading a config imports only the module of its pipeline."""
    code = textwrap.dedent(
        """
        import sys
        import mmalign.config
        assert not any(m == "pipelines" or m.startswith(("pipelines.", "rewards")) for m in sys.modules), sorted(sys.modules)
        import pipelines
        assert not [m for m in sys.modules if m.startswith("pipelines.")]
        assert "torch" not in sys.modules
        cfg = mmalign.config.load_config("configs/vlm_reasoning-tiny.yaml")
        assert type(cfg.options).__name__ == "VLMOptions"
        loaded = sorted(m for m in sys.modules if m.startswith("pipelines."))
        # vlm_reasoning imports the shared helpers (pipelines.common); no other pipeline is loaded
        assert loaded == ["pipelines.common", "pipelines.vlm_reasoning"], loaded
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    src = (REPO / "mmalign" / "config.py").read_text()
    for line in src.splitlines():
        stripped = line.strip()
        assert not stripped.startswith(
            ("import pipelines", "from pipelines", "import rewards", "from rewards")
        ), line


def test_the_former_components_name_still_resolves_with_a_warning():
    import pipelines

    with pytest.warns(DeprecationWarning, match="TrainingSetup"):
        assert pipelines.Components is pipelines.TrainingSetup
    with pytest.raises(AttributeError):
        pipelines.NoSuchThing  # noqa: B018


def test_a_domain_package_pipeline_is_found_without_importing_the_others():
    """``medloc`` lives in ``pipelines/grounding/``: looking it up imports its package, not the video pipelines
    nor the other top-level ones (a broken unrelated module cannot stop it)."""
    code = textwrap.dedent(
        """
        import sys
        import pipelines
        pipelines.get("medloc")
        loaded = sorted(m for m in sys.modules if m.startswith("pipelines."))
        assert "pipelines.grounding.medloc" in loaded, loaded
        assert not [m for m in loaded if m.startswith("pipelines.video")], loaded
        assert not {"pipelines.text_to_image", "pipelines.safe_diffusion", "pipelines.text_reasoning"} & set(loaded)
        pipelines.get("video_edit")
        assert "pipelines.video.video_edit" in sys.modules
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
