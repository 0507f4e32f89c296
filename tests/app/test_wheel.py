"""The wheel and the source checkout (pyproject.toml, mmalign/app/fixtures.py).

The built wheel leaves out the offline fixtures (``mmalign.tiny``: tiny model builders, the shapes world and its
rewards), which a source checkout (``pip install -e .``) has; on a wheel install a config that names a tiny builder
is one error line saying a source checkout is needed, before anything else is checked.
"""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import mmalign.app.fixtures as fixtures
from mmalign.app.cli import main
from mmalign.app.fixtures import FixturesUnavailableError, check_fixtures_available, ensure_fixtures
from mmalign.config import load_config
from mmalign.errors import MmalignError

ROOT = Path(__file__).resolve().parents[2]


def without_fixtures(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `mmalign.app.fixtures` see no ``mmalign.tiny``, as on a wheel install."""
    real = fixtures.find_spec
    monkeypatch.setattr(fixtures, "find_spec", lambda name: None if name == "mmalign.tiny" else real(name))


def test_the_packaging_config_leaves_the_fixtures_out_of_the_wheel() -> None:
    """The fast guard of the slow test below: setuptools' package discovery with pyproject's settings finds no
    ``mmalign.tiny`` package, and package data is only what is listed (the default would put the excluded
    package's .py files back into the wheel as data files of ``mmalign``)."""
    from setuptools import find_packages

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = find_packages(str(ROOT), **setup["packages"]["find"])
    assert {"mmalign", "mmalign.app", "rewards", "pipelines"} <= set(found)
    assert not [p for p in found if p == "mmalign.tiny" or p.startswith("mmalign.tiny.")]
    assert setup["include-package-data"] is False


def test_a_tiny_config_without_the_fixtures_names_the_source_checkout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = load_config(ROOT / "configs" / "safe_diffusion-tiny.yaml")
    check_fixtures_available(cfg)  # a source checkout: nothing to say
    without_fixtures(monkeypatch)
    for call in (check_fixtures_available, ensure_fixtures):
        with pytest.raises(FixturesUnavailableError) as info:
            call(cfg)
        msg = str(info.value)
        assert isinstance(info.value, ImportError) and isinstance(info.value, MmalignError)
        for fragment in (
            "safe_diffusion-tiny.yaml",
            "model.tiny_builder ('safe_diffusion') and options.reward_models",
            "source checkout",
            "pip install -e .",
        ):
            assert fragment in msg, (fragment, msg)
    plain = load_config(ROOT / "configs" / "text_reasoning-tiny.yaml", ["model.tiny_builder=null"])
    check_fixtures_available(plain)  # no tiny builder named: no fixtures needed
    ensure_fixtures(plain)


def test_train_on_a_wheel_install_says_so_before_any_other_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The preflight asks first: not the reward lookup (``shapes_compositional`` is an entry point into
    ``mmalign.tiny``) nor the tiny builder's name."""
    without_fixtures(monkeypatch)
    rc = main(["train", str(ROOT / "configs" / "text_to_image-tiny.yaml"), f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert err[0].startswith("mmalign: error: ") and "source checkout" in err[0], err
    assert "model.tiny_builder ('text_to_image')" in err[0]
    assert not (tmp_path / "run").exists()


def test_tiny_and_plan_on_a_wheel_install_say_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``mmalign tiny list|build`` and ``mmalign plan`` of a tiny config: one error line naming the source
    checkout, not an ImportError's traceback; nothing is built."""
    without_fixtures(monkeypatch)
    for argv in (
        ["tiny", "list"],
        ["tiny", "build", "text_reasoning", "--out", str(tmp_path / "m")],
        ["plan", str(ROOT / "configs" / "text_reasoning-tiny.yaml"), f"model.name_or_path={tmp_path / 'm'}"],
    ):
        rc = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 1 and len(err) == 1, (argv, err)
        assert err[0].startswith("mmalign: error: ") and "source checkout" in err[0], (argv, err)
    assert not (tmp_path / "m").exists()


def run(*cmd: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_wheel_has_no_fixtures_and_says_what_a_tiny_config_needs(tmp_path: Path) -> None:
    """Build the wheel from a copy of the sources (offline, no build isolation), check its files, install it
    alone in a fresh venv and run from outside the checkout: the CLI imports, ``mmalign.tiny`` does not, and
    ``mmalign train`` on a tiny config is one error line naming the source checkout.

    The venv reaches the dependencies through a path line in a .pth file: unlike ``--system-site-packages``,
    that does not run the .pth files there, among them this checkout's editable-install finder, which would
    serve ``mmalign.tiny`` from the checkout and hide the wheel's content."""
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("mmalign", "rewards", "pipelines"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = run(
        sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "--no-index",
        "-w", tmp_path / "dist", cwd=src,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("mmalign-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "mmalign/app/cli.py" in names and "rewards/boxes.py" in names and "pipelines/__init__.py" in names
    assert "mmalign/app/architectures.json" in names
    assert [n for n in names if n.startswith("mmalign/tiny/")] == []

    venv = tmp_path / "venv"
    out = run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    python, cli = venv / "bin" / "python", venv / "bin" / "mmalign"
    out = run(python, "-m", "pip", "install", "--no-deps", "--no-index", wheel, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (purelib,) = (venv / "lib").glob("python3.*/site-packages")
    (purelib / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    probe = (
        "import importlib.util, mmalign, mmalign.app.cli\n"
        "print(mmalign.__file__)\n"
        "print(importlib.util.find_spec('mmalign.tiny'))\n"
    )
    out = run(python, "-c", probe, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    where, tiny = out.stdout.split()
    assert Path(where).is_relative_to(venv) and tiny == "None", out.stdout

    out = run(
        cli, "train", ROOT / "configs" / "medloc-tiny.yaml", f"output_dir={tmp_path / 'run'}", cwd=tmp_path
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
    assert "source checkout" in lines[0] and "model.tiny_builder ('medloc')" in lines[0], lines
