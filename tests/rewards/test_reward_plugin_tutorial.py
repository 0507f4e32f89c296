"""docs/reward_plugins.md, executed: its package is installed and its printed outputs are checked.

The tutorial marks what the test uses with a comment line right before a fenced block:

- ``<!-- file: PATH -->``: a file, written to PATH under a temporary folder. The folder of the
  ``pyproject.toml`` is the package that gets installed.
- ``<!-- output: COMMAND -->``: what COMMAND prints on stdout, exactly (trailing spaces ignored). It
  must exit with 0.
- ``<!-- output-excerpt: COMMAND -->``: lines that COMMAND prints (stdout and stderr together), in
  this order, with whitespace runs compared as one space. ``...`` lines stand for anything.

COMMAND is ``python SCRIPT ...`` or ``mmalign ...``. Both run in a subprocess in the temporary folder.
The package is installed with ``pip install --no-deps --no-build-isolation --target <tmp>/site``
and found through ``PYTHONPATH``, so nothing is installed into the environment running the tests.
Changing the tutorial's code so that it breaks, or so that its shown output no longer matches, fails
this test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "reward_plugins.md"
GROUP = "mmalign.rewards"
MMALIGN = "import sys; from mmalign.app.cli import main; sys.exit(main(sys.argv[1:]))"
TIMEOUT = 240

MARKED_BLOCK = re.compile(
    r"^<!-- (file|output|output-excerpt): (.+?) -->[ \t]*\n```[^\n]*\n(.*?)^```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)


def doc_blocks(kind: str) -> list[tuple[str, str]]:
    """(target, body) of each block of the tutorial marked ``<!-- kind: target -->``, in page order."""
    return [(target.strip(), body) for k, target, body in MARKED_BLOCK.findall(DOC.read_text()) if k == kind]


def squeeze(line: str) -> str:
    return " ".join(line.split())


@dataclass
class Tutorial:
    """The tutorial's files written under `root`, its package installed into `site`."""

    root: Path
    site: Path
    env: dict[str, str]
    runs: dict[str, subprocess.CompletedProcess[str]] = field(default_factory=dict)

    def argv(self, command: str) -> list[str]:
        words = shlex.split(command)
        if words[0] == "python":
            return [sys.executable, *words[1:]]
        if words[0] == "mmalign":
            return [sys.executable, "-c", MMALIGN, *words[1:]]
        raise ValueError(
            f"the tutorial's output marker names {command!r}; expected 'python ...' or 'mmalign ...'"
        )

    def run(self, command: str) -> subprocess.CompletedProcess[str]:
        """`command` run once in `root` (the result is cached for the other tests)."""
        if command not in self.runs:
            self.runs[command] = subprocess.run(
                self.argv(command),
                cwd=self.root,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
            )
        return self.runs[command]


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory: pytest.TempPathFactory) -> Tutorial:
    root = tmp_path_factory.mktemp("reward_tutorial")
    files = doc_blocks("file")
    for rel, body in files:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    projects = [root / rel for rel, _ in files if Path(rel).name == "pyproject.toml"]
    assert len(projects) == 1, f"{DOC.name} should mark exactly one pyproject.toml, found {len(projects)}"
    for module in ("pip", "setuptools"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(
                f"cannot install the tutorial's package: {module} is not importable by {sys.executable}, "
                f"and 'pip install --no-build-isolation' needs it (the test installs offline)"
            )
    site = root / "site"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--quiet",
        "--target",
        str(site),
        str(projects[0].parent),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONNOUSERSITE": "1"}
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    if r.returncode != 0:
        pytest.fail(f"installing the tutorial's package failed:\n$ {shlex.join(cmd)}\n{r.stdout}\n{r.stderr}")
    paths = [str(site), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(paths)  # the package, then this checkout of mmalign
    return Tutorial(root=root, site=site, env=env)


# ---------------------------------------------------------------------------------- the page itself
def test_tutorial_marks_a_package_with_a_reward_entry_point() -> None:
    files = dict(doc_blocks("file"))
    [pyproject] = [body for rel, body in files.items() if Path(rel).name == "pyproject.toml"]
    assert f'[project.entry-points."{GROUP}"]' in pyproject
    assert any(Path(rel).suffix == ".yaml" for rel in files), "the tutorial should mark a config file"
    commands = [cmd for cmd, _ in doc_blocks("output") + doc_blocks("output-excerpt")]
    assert "mmalign list rewards" in commands
    assert any(cmd.startswith("python ") for cmd, _ in doc_blocks("output")), commands


# ----------------------------------------------------------------------- installed, loaded, configured
PROBE = """
import importlib.metadata, json, sys
from pathlib import Path

import rewards
from mmalign.config import load_config
from mmalign.app.preflight import check_data_files
from rewards import check_reward_specs

site = Path(sys.argv[1]).resolve()
configs = sys.argv[2:]
out = {"entry_points": {}, "configs": {}}
for ep in importlib.metadata.entry_points(group="mmalign.rewards"):
    if ep.dist is None or Path(ep.dist.locate_file("")).resolve() != site:
        continue  # installed elsewhere, not by this test
    reward = rewards.load_reward(ep.name)
    out["entry_points"][ep.name] = {
        "value": ep.value,
        "dist": ep.dist.metadata["Name"],
        "listed": ep.name in rewards.entry_point_names(),
        "is_reward": isinstance(reward, rewards.Reward),
        "reward_name": reward.name,
        "summary": (type(reward).__doc__ or "").strip().splitlines()[0],
    }
for path in configs:
    cfg = load_config(path)
    check_data_files(cfg)
    check_reward_specs(cfg.rewards, cfg.source)
    reward_set = rewards.RewardSet(cfg.rewards, source=cfg.source)
    out["configs"][path] = {"names": reward_set.names, "kwargs": [r.kwargs for r in cfg.rewards]}
print(json.dumps(out))
"""


def test_entry_point_loads_and_config_validates(tutorial: Tutorial) -> None:
    """importlib.metadata finds the --target install; load_reward builds the reward by its entry-point
    name; every config the tutorial marks validates and builds its RewardSet, the plugin included."""
    configs = [rel for rel, _ in doc_blocks("file") if Path(rel).suffix in (".yaml", ".yml")]
    r = subprocess.run(
        [sys.executable, "-c", PROBE, str(tutorial.site), *configs],
        cwd=tutorial.root,
        env=tutorial.env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout.strip().splitlines()[-1])
    eps = found["entry_points"]
    assert eps, f"no {GROUP} entry point found in {tutorial.site}: {os.listdir(tutorial.site)}"
    for name, ep in eps.items():
        assert ep["listed"] and ep["is_reward"], (name, ep)
        assert ep["reward_name"] == name, (name, ep)
        assert ep["summary"], f"{name}: the reward class needs a docstring (its summary line)"
    for path, cfg in found["configs"].items():
        assert set(eps) & set(cfg["names"]), f"{path} names none of the plugin's rewards {sorted(eps)}"
        assert any(cfg["kwargs"]), f"{path} should show a reward's kwargs"


@pytest.mark.parametrize("command, expected", doc_blocks("output"), ids=[c for c, _ in doc_blocks("output")])
def test_documented_output(tutorial: Tutorial, command: str, expected: str) -> None:
    r = tutorial.run(command)
    assert r.returncode == 0, f"$ {command}\n{r.stdout}\n{r.stderr}"
    got = [line.rstrip() for line in r.stdout.rstrip("\n").splitlines()]
    want = [line.rstrip() for line in expected.rstrip("\n").splitlines()]
    assert got == want, f"$ {command} printed something else than {DOC.name} shows\nstderr:\n{r.stderr}"


@pytest.mark.parametrize(
    "command, expected", doc_blocks("output-excerpt"), ids=[c for c, _ in doc_blocks("output-excerpt")]
)
def test_documented_output_excerpt(tutorial: Tutorial, command: str, expected: str) -> None:
    r = tutorial.run(command)
    printed = [squeeze(line) for line in (r.stdout + r.stderr).splitlines()]
    want = [squeeze(line) for line in expected.splitlines() if line.strip() and line.strip() != "..."]
    at = 0
    for line in want:
        assert line in printed[at:], (
            f"$ {command}: {DOC.name} shows the line\n  {line}\nafter line {at}, but the command printed:\n"
            + textwrap.indent("\n".join(printed), "  ")
        )
        at = printed.index(line, at) + 1


def test_list_rewards_shows_the_plugin_summary(tutorial: Tutorial) -> None:
    pyproject = next(body for rel, body in doc_blocks("file") if Path(rel).name == "pyproject.toml")
    names = re.findall(
        r"^(\w+)\s*=", pyproject.split(f'[project.entry-points."{GROUP}"]', 1)[1], re.MULTILINE
    )
    docstring = re.compile(r'^class \w+\(Reward\):\n\s+"""([^\n]+?)(?:"""|\n)', re.MULTILINE)
    summary = next(m.group(1) for _, body in doc_blocks("file") for m in docstring.finditer(body))
    printed = [squeeze(line) for line in tutorial.run("mmalign list rewards").stdout.splitlines()]
    assert f"{names[0]} {summary}" in " ".join(printed)
