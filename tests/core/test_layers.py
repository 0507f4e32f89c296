"""The layers of the house, read from the source with `ast` (every import, module level or inside a function):

- the core (``mmalign/*.py``, ``mmalign/policies/``, ``mmalign/engines/``) imports no tool (``mmalign.app``), no
  tiny-model builder (``mmalign.tiny``), no reward family (``rewards``) and no pipeline (``pipelines``);
- ``rewards/`` imports no pipeline and no tool;
- ``pipelines/`` imports no tool, and no pipeline imports another pipeline's private (``_``) name;
- ``mmalign/tiny/`` (fixtures for every layer) imports no tool; rewards import nothing from it (its shapes-world rewards come in through the
  ``mmalign.rewards`` entry points).
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


def test_pipelines_import_no_tool_and_no_fixture() -> None:
    """Pipelines load models through ``from_pretrained``; the tiny models a config names are built by the app
    layer (`mmalign.app.fixtures`), so the fixture floor stays out of the production path."""
    assert violations(sorted((REPO / "pipelines").rglob("*.py")), ("mmalign.app", "mmalign.tiny")) == []


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


def test_rewards_import_nothing_from_the_fixtures() -> None:
    """``rewards/`` imports nothing from ``mmalign.tiny``, the world definitions included: the shapes-world rewards
    live there (`mmalign.tiny.world_rewards`) and reach the reward registry through ``mmalign.rewards`` entry
    points, so a wheel without the fixtures still imports every reward module."""
    assert violations(sorted((REPO / "rewards").rglob("*.py")), ("mmalign.tiny",)) == []


# ----------------------------------------------------------------------------- second pass (issue 35)
PROJECT = ("mmalign", "rewards", "pipelines")
EVERYWHERE = sorted(p for d in (*PROJECT, "benchmarks") for p in (REPO / d).rglob("*.py"))


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("").parts
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def test_no_private_name_is_taken_across_modules() -> None:
    """``from x import _name`` of a project module: two modules that need the same thing get a public helper."""
    bad = []
    for path in EVERYWHERE:
        for line, module, names in imports(path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and module.startswith(PROJECT):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {module}.{', '.join(private)}")
    assert bad == []


def core_graph() -> dict[str, set[str]]:
    """Core module -> the core modules it imports (module level or in a function), package parents left out."""
    paths = {module_name(p): p for p in CORE}
    graph = {}
    for name, path in paths.items():
        targets = set()
        for _, module, names in imports(path):
            submodules = [f"{module}.{n}" for n in names if f"{module}.{n}" in paths]
            # ``from package import module`` imports that module (and runs the package's __init__ first)
            for target in submodules or [module]:
                if target in paths and target != name and target != "mmalign":
                    targets.add(target)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_core_has_no_import_circles() -> None:
    assert cycles(core_graph()) == []


def test_the_circle_check_sees_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_config_imports_nothing_above_it() -> None:
    """``mmalign/config.py`` sits under everything that reads a config: it imports only the registry and errors."""
    allowed = {"mmalign", "mmalign.registry", "mmalign.errors"}
    used = {m for _, m, _ in imports(REPO / "mmalign" / "config.py") if m.startswith(PROJECT)}
    assert used <= allowed, used - allowed


IMPORT_CALLS = ("import_module", "__import__", "import_path")


def import_strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string that reaches an import call in `path`: a constant argument of
    ``importlib.import_module`` / ``__import__`` / ``import_path``, or a module-level constant passed to one."""
    tree = ast.parse(path.read_text())
    constants = {
        t.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name not in IMPORT_CALLS:
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            found.append((node.lineno, arg.value))
        elif isinstance(arg, ast.Name) and arg.id in constants:
            found.append((node.lineno, constants[arg.id]))
    return found


def test_the_core_names_no_upper_layer_in_an_import_string() -> None:
    """``importlib.import_module("pipelines")`` is an import too: no core module imports an upper layer by name."""
    upper = ("pipelines", "rewards", "mmalign.app", "mmalign.tiny")
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {text!r} by name"
        for path in CORE
        for line, text in import_strings(path)
        if text.startswith(upper)
    ]
    assert bad == []


def test_the_import_string_check_sees_a_constant(tmp_path: Path) -> None:
    path = tmp_path / "x.py"
    path.write_text(
        'import importlib\nPROVIDER = "pipelines"\n\ndef f():\n    importlib.import_module(PROVIDER)\n'
    )
    assert import_strings(path) == [(5, "pipelines")]
