"""The layers of the house, read from the source with `ast` (every import, module level or inside a function):

- the core (``mmalign/*.py``, ``mmalign/policies/``, ``mmalign/engines/``) imports no tool (``mmalign.app``), no
  tiny-model builder (``mmalign.tiny``), no reward family (``rewards``) and no pipeline (``pipelines``);
- ``rewards/`` imports no pipeline and no tool;
- ``pipelines/`` imports no tool, and no pipeline imports another pipeline's private (``_``) name;
- ``mmalign/tiny/`` (fixtures for every layer) imports no tool; rewards use only its world definitions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = [
    p
    for p in (REPO / "mmalign").rglob("*.py")
    if p.relative_to(REPO / "mmalign").parts[0] not in ("app", "tiny", "__main__.py")
]


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, imported names) of every import statement in `path`, relative ones resolved."""
    rel = path.relative_to(REPO).with_suffix("").parts
    package = rel[:-1] if rel[-1] != "__init__" else rel[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            out.append((node.lineno, module, [a.name for a in node.names]))
    return out


def violations(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in paths:
        for line, module, names in imports(path):
            targets = [module] + [f"{module}.{n}" for n in names]
            for target in targets:
                if any(target == f or target.startswith(f + ".") for f in forbidden):
                    bad.append(f"{path.relative_to(REPO)}:{line} imports {target}")
                    break
    return bad


def test_core_imports_no_tool_builder_reward_or_pipeline() -> None:
    assert CORE and len(CORE) > 20
    assert violations(CORE, ("mmalign.app", "mmalign.tiny", "rewards", "pipelines")) == []


def test_rewards_import_no_pipeline_or_tool() -> None:
    assert violations(sorted((REPO / "rewards").rglob("*.py")), ("pipelines", "mmalign.app")) == []


def test_pipelines_import_no_tool() -> None:
    assert violations(sorted((REPO / "pipelines").rglob("*.py")), ("mmalign.app",)) == []


def test_no_pipeline_imports_another_pipelines_private_name() -> None:
    bad = []
    for path in sorted((REPO / "pipelines").rglob("*.py")):
        for line, module, names in imports(path):
            private = [n for n in names if n.startswith("_") and n != "__future__"]
            if module.startswith("pipelines") and private:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {module}.{', '.join(private)}")
    assert bad == []


@pytest.mark.parametrize(
    "source, forbidden, expected",
    [
        ("from mmalign.app.doctor import LiveDoctor\n", ("mmalign.app",), 1),
        ("def f():\n    from pipelines import common\n", ("pipelines",), 1),
        ("from mmalign import app\n", ("mmalign.app",), 1),
        ("from mmalign import batch\n", ("mmalign.app",), 0),
    ],
)
def test_the_check_sees_hidden_and_package_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, forbidden: tuple[str, ...], expected: int
) -> None:
    """Guard: the check catches an import inside a function and ``from package import module``."""
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path, raising=False)
    path = tmp_path / "mmalign" / "x.py"
    path.parent.mkdir()
    path.write_text(source)
    assert len(violations([path], forbidden)) == expected


def test_tiny_builders_import_no_tool_and_rewards_only_the_world_definitions() -> None:
    """``mmalign/tiny/`` builds fixtures for every layer (it may use rewards and pipelines, never a tool);
    rewards read only the synthetic world's definitions from it (`mmalign.tiny.world`, which imports nothing)."""
    assert violations(sorted((REPO / "mmalign" / "tiny").rglob("*.py")), ("mmalign.app",)) == []
    world = REPO / "mmalign" / "tiny" / "world.py"
    assert [m for _, m, _ in imports(world) if m.startswith(("mmalign", "rewards", "pipelines"))] == []
    reward_files = sorted((REPO / "rewards").rglob("*.py"))
    used = {m for p in reward_files for _, m, _ in imports(p) if m.startswith("mmalign.tiny")}
    assert used <= {"mmalign.tiny.world"}, used
