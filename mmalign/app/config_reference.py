"""The configuration reference (``docs/configuration.md``), generated from the typed config.

``python -m mmalign.app.config_reference [--write | --check | --undocumented]``; the output is deterministic.

Details: docs/architecture.md, "mmalign.app.config_reference".
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import math
import re
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from mmalign.config import Config, yaml_key

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
"""Where ``--write`` writes the reference and what ``--check`` compares against."""

WRITE_COMMAND = "python -m mmalign.app.config_reference --write"
"""The command that regenerates `DOC_PATH` (named by ``--check`` and the test when the file is stale)."""

_PROJECT_PACKAGES = ("mmalign", "pipelines", "rewards")
"""Registered names count as built in when the object comes from a module under one of these packages."""

_HIDDEN = {(Config, "source")}
"""Dataclass fields that are not YAML keys."""

_TYPE_TEXT = {(Config, "options"): "mapping"}
"""Fields whose declared type says less than what a config file must write (``options: Any``)."""


# ----------------------------------------------------------------------------- reading the dataclasses


@dataclass(frozen=True)
class Row:
    """One key of the reference: a table row."""

    key: str
    """The dotted key as written in overrides (``trainer.lr``; ``rewards[i].name`` for list items)."""
    type: str
    """Markdown for the type column."""
    default: str
    """Markdown for the default column (``required`` when the field has no default)."""
    meaning: str
    """Markdown for the meaning column (the field's docstring, possibly empty, plus links and names)."""


@functools.cache
def _class_source(cls: type) -> ast.ClassDef | None:
    """The parsed class statement of `cls` (None: no source, e.g. `dataclasses.make_dataclass`)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return None
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node
    return None


def own_field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of the fields the class statement of `cls` declares (not its bases')."""
    node = _class_source(cls)
    if node is None:
        return {}
    docs: dict[str, str] = {}
    for stmt, nxt in zip(node.body, node.body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def field_doc(cls: type, name: str) -> str:
    """The docstring of field `name` of `cls`: from the first class in its MRO that documents it ("" if none)."""
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass):
            doc = own_field_docs(klass).get(name)
            if doc:
                return doc
    return ""


def class_doc(cls: type) -> str:
    """The docstring written in the class statement of `cls` ("" if none: not the one dataclass generates)."""
    node = _class_source(cls)
    doc = ast.get_docstring(node) if node is not None else None
    return inspect.cleandoc(doc) if doc else ""


def own_field_names(cls: type) -> list[str]:
    """The fields that the class statement of `cls` declares or redeclares, in declaration order."""
    annotations = cls.__dict__.get("__annotations__", {})
    return [f.name for f in dataclasses.fields(cls) if f.name in annotations]


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # annotations naming something local: show them as written
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.init and (cls, f.name) not in _HIDDEN]


def _nested(tp: Any) -> tuple[type | None, bool]:
    """The dataclass a field of type `tp` holds, and whether as the items of a list (else (None, False))."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in get_args(tp):
            found = _nested(arg)
            if found[0] is not None:
                return found
        return None, False
    if origin is list:
        args = get_args(tp)
        if args and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
            return args[0], True
        return None, False
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp, False
    return None, False


def type_text(tp: Any) -> str:
    """A type as a config reader thinks of it: ``int | null``, ``"a" | "b"``, ``list[str]``, ``mapping``."""
    if isinstance(tp, str):
        return tp
    if tp is Any:
        return "any"
    if tp is type(None):
        return "null"
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(_yaml(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        parts = [type_text(a) for a in args]
        if len(args) < len(get_args(tp)):
            parts.append("null")
        return " | ".join(parts)
    if origin is not None:
        args = get_args(tp)
        if origin is list and args and dataclasses.is_dataclass(args[0]):
            return "list[mapping]"
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_text(a) for a in args)}]" if args else name
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _yaml(value: Any) -> str:
    """`value` in YAML flow style (what a config file would write)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {yaml_key(f): getattr(value, f.name) for f in dataclasses.fields(value)}
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_yaml_key(k)}: {_yaml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _yaml_key(key: Any) -> str:
    plain = isinstance(key, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key)
    return key if plain and key.lower() not in ("true", "false", "null") else _yaml(key)


def _default_value(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def default_text(f: dataclasses.Field[Any]) -> str:
    """The default of field `f` as Markdown: a YAML value, ``{}`` for a section left at its own defaults,
    or ``required``."""
    value = _default_value(f)
    if value is dataclasses.MISSING:
        return "required"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        try:
            plain = type(value)()
        except TypeError:  # a section with required keys: show it whole
            return f"`{_cell_code(_yaml(value))}`"
        changed = {
            g.name: getattr(value, g.name)
            for g in dataclasses.fields(value)
            if getattr(value, g.name) != getattr(plain, g.name)
        }
        return f"`{_cell_code(_yaml(changed))}`"
    return f"`{_cell_code(_yaml(value))}`"


def _cell_code(text: str) -> str:
    return text.replace("`", "'")


def _cell(text: str) -> str:
    """`text` fit for one table cell: a single line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


# ----------------------------------------------------------------------------- registered names


@dataclass(frozen=True)
class RegistryKey:
    """A key whose value is a registered name."""

    names: Callable[[], list[str]]
    """The names registered by this project (sorted)."""
    list_command: str | None = None
    """The ``mmalign list`` command that describes them."""


def _is_builtin(obj: Any) -> bool:
    """Whether `obj` (a registered class or function) is defined in a module of this project's packages."""
    module_name = getattr(obj, "__module__", None) or type(obj).__module__
    root = module_name.split(".")[0]
    if root not in _PROJECT_PACKAGES:
        return False
    module, package = sys.modules.get(module_name), sys.modules.get(root)
    file, package_file = getattr(module, "__file__", None), getattr(package, "__file__", None)
    if not file or not package_file:
        return False
    return Path(file).resolve().is_relative_to(Path(package_file).resolve().parent)


def _builtin_names(names: Iterable[str], get: Callable[[str], Any]) -> list[str]:
    return sorted(n for n in names if _is_builtin(get(n)))


def pipeline_names() -> list[str]:
    """The pipelines this project registers (not entry points, nor names registered at run time elsewhere)."""
    import pipelines

    return _builtin_names(
        (n for n in pipelines.names() if pipelines.origin(n) is None), pipelines.REGISTRY.get
    )


def registry_keys() -> dict[tuple[type, str], RegistryKey]:
    """(dataclass, field) -> the registry its value names."""
    import rewards
    from mmalign import tiny
    from mmalign.algorithms import advantages, filters, losses, sde
    from mmalign.config import AlgorithmConfig, DataConfig, ModelConfig, RewardConfig, RolloutConfig
    from mmalign.data import prompt_samplers as samplers
    from mmalign.data import rollout_loops
    from mmalign.policies.denoising import SamplerSettings
    from rewards.base import DISCOVERY

    def reg(registry: Any, load: Callable[[], object] | None = None) -> Callable[[], list[str]]:
        def names() -> list[str]:
            if load is not None:
                load()
            return _builtin_names(registry.names(), registry.get)

        return names

    return {
        (Config, "pipeline"): RegistryKey(pipeline_names, "mmalign list pipelines"),
        (ModelConfig, "tiny_builder"): RegistryKey(reg(tiny.BUILDERS, tiny.load_builders)),
        (DataConfig, "sampler"): RegistryKey(reg(samplers.SAMPLERS), "mmalign list samplers"),
        (RolloutConfig, "loop"): RegistryKey(reg(rollout_loops.LOOPS)),
        # the entry points too: the project's offline rewards register from mmalign.tiny.world_rewards
        (RewardConfig, "name"): RegistryKey(
            reg(rewards.REGISTRY, DISCOVERY.load_all), "mmalign list rewards"
        ),
        (AlgorithmConfig, "estimator"): RegistryKey(reg(advantages.REGISTRY), "mmalign list estimators"),
        (AlgorithmConfig, "loss"): RegistryKey(reg(losses.REGISTRY), "mmalign list losses"),
        (AlgorithmConfig, "loss_agg"): RegistryKey(reg(losses.AGGREGATIONS), "mmalign list losses"),
        (AlgorithmConfig, "kl_estimator"): RegistryKey(reg(losses.KL_ESTIMATORS), "mmalign list losses"),
        (AlgorithmConfig, "filter"): RegistryKey(reg(filters.FILTERS), "mmalign list filters"),
        (SamplerSettings, "sde_kind"): RegistryKey(reg(sde.STEPS), "mmalign list steps"),
    }


def _registry_note(key: RegistryKey) -> str:
    names = ", ".join(f"`{n}`" for n in key.names())
    where = f" (`{key.list_command}`)" if key.list_command else ""
    return f"Registered{where}: {names}."


# ----------------------------------------------------------------------------- rows and tables


Links = dict[type, tuple[str, str]]
"""Dataclass -> (its section's title, its anchor), for fields that hold a documented section."""


def field_rows(
    cls: type,
    prefix: str = "",
    *,
    names: Sequence[str] | None = None,
    links: Links | None = None,
    registries: dict[tuple[type, str], RegistryKey] | None = None,
    notes: dict[str, str] | None = None,
) -> list[Row]:
    """The rows of the fields of dataclass `cls` (only `names`, if given), keys prefixed with `prefix`.

    `links`: sections documented elsewhere, linked from the fields that hold them; `registries`: the fields
    whose value is a registered name; `notes`: field name -> a sentence added to its meaning."""
    hints = _hints(cls)
    links = links or {}
    registries = registries or {}
    notes = notes or {}
    wanted = None if names is None else set(names)
    rows = []
    for f in _fields(cls):
        if wanted is not None and f.name not in wanted:
            continue
        tp = hints.get(f.name, f.type)
        meaning = [field_doc(cls, f.name)]
        nested, is_list = _nested(tp)
        if nested is not None and nested in links:
            title, anchor = links[nested]
            what = "Each item" if is_list else "The section"
            meaning.append(f"{what}: see [{title}](#{anchor}).")
        for klass in cls.__mro__:
            if (klass, f.name) in registries:
                meaning.append(_registry_note(registries[klass, f.name]))
                break
        meaning.append(notes.get(f.name, ""))
        rows.append(
            Row(
                key=f"{prefix}{yaml_key(f)}",
                type=f"`{_cell_code(_TYPE_TEXT.get((cls, f.name)) or type_text(tp))}`",
                default=default_text(f),
                meaning=" ".join(m for m in meaning if m),
            )
        )
    return rows


def table(rows: Iterable[Row]) -> str:
    """A Markdown table of `rows` (key | type | default | meaning)."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for r in rows:
        cells = (f"`{r.key}`", r.type, r.default, r.meaning)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- the document


def slug(title: str, taken: set[str]) -> str:
    """GitHub's anchor for a heading `title`, made unique against `taken` (which it joins)."""
    base = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
    anchor, n = base, 0
    while anchor in taken:
        n += 1
        anchor = f"{base}-{n}"
    taken.add(anchor)
    return anchor


@dataclass
class _Section:
    title: str
    cls: type | None
    prefix: str
    anchor: str = ""


def _config_sections(root: type, taken: set[str]) -> list[_Section]:
    """The sections of `root` and of every dataclass reachable from it (depth first, each class once)."""
    out: list[_Section] = []
    seen: set[type] = set()

    def walk(cls: type, title: str, prefix: str) -> None:
        seen.add(cls)
        out.append(_Section(title, cls, prefix, slug(title, taken)))
        hints = _hints(cls)
        for f in _fields(cls):
            nested, is_list = _nested(hints.get(f.name, f.type))
            if nested is not None and nested not in seen:
                key = f"{prefix}{yaml_key(f)}" + ("[i]" if is_list else "")
                walk(nested, f"`{key}`", key + ".")

    walk(root, "Top level", "")
    return out


def _option_groups(option_classes: Iterable[type]) -> list[type]:
    """The dataclasses that some pipeline's options class extends, sorted by name."""
    groups = {
        base
        for cls in option_classes
        for base in cls.__mro__[1:]
        if isinstance(base, type) and dataclasses.is_dataclass(base)
    }
    return sorted(groups, key=lambda c: (c.__name__, c.__module__))


def _bases(cls: type) -> list[type]:
    """The dataclasses `cls` extends, nearest first."""
    return [b for b in cls.__mro__[1:] if dataclasses.is_dataclass(b)]


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _options_body(
    cls: type,
    group_anchors: dict[type, str],
    registries: dict[tuple[type, str], RegistryKey],
) -> list[str]:
    """Markdown for an options class: its docstring, what it extends, and the keys it declares itself."""
    parts = []
    doc = class_doc(cls)
    parts.append(f"Class `{_qualified(cls)}`." + (f" {' '.join(doc.split())}" if doc else ""))
    bases = _bases(cls)
    if bases:
        links = " and ".join(f"[`{b.__name__}`](#{group_anchors[b]})" for b in bases)
        parts.append(f"Also takes every key of {links} that is not listed here.")
    own = own_field_names(cls)
    redeclared = [n for n in own if any(n in {f.name for f in dataclasses.fields(b)} for b in bases)]
    if redeclared:
        parts.append(
            "Redeclared here (a different default or meaning): "
            + ", ".join(f"`options.{n}`" for n in redeclared)
            + "."
        )
    if own:
        parts.append(table(field_rows(cls, "options.", names=own, registries=registries)).rstrip("\n"))
    else:
        parts.append("It declares no keys of its own.")
    return parts


_INTRO = f"""\
<!-- Generated from the dataclasses of mmalign/config.py and the pipelines' options classes by
`{WRITE_COMMAND}`; do not edit by hand (tests/app/test_config_reference.py fails when it is stale). -->

Every key a config file (or a `key.sub=value` override on the command line) can set, with its type,
its default and what it does. A config is YAML; keys are written here as dotted paths, the form the
command line takes (`trainer.lr=1e-5`); `rewards[i].name` is the `name` of any item of the `rewards`
list (on the command line: `rewards.0.name=...`). Types use YAML words: `null` is an empty value,
`"a" | "b"` one of these strings, `mapping` a nested section. A default of `required` means the key
must be given; `{{}}` for a section means all of its own defaults. Keys whose value is a registered
name list the names this project registers; plugins (entry points, `package.module:Class` rewards)
add more (`mmalign list`).
"""


def render() -> str:
    """The whole reference, as Markdown."""
    import pipelines

    registries = registry_keys()
    taken: set[str] = set()
    doc_title = "Configuration reference"
    slug(doc_title, taken)
    sections = _config_sections(Config, taken)
    pipes_title, groups_title = "Pipeline options", "Shared option groups"
    pipes_anchor = slug(pipes_title, taken)
    names = pipeline_names()
    option_classes = {n: pipelines.options_class(n) for n in names}
    pipe_anchors = {n: slug(f"`{n}`", taken) for n in names}
    groups = _option_groups(c for c in option_classes.values() if c is not None)
    groups_anchor = slug(groups_title, taken) if groups else ""
    group_anchors = {g: slug(f"`{g.__name__}`", taken) for g in groups}
    links: Links = {s.cls: (s.title, s.anchor) for s in sections if s.cls is not None}

    out = [f"# {doc_title}\n", _INTRO]
    toc = [f"- [{s.title}](#{s.anchor})" for s in sections]
    toc.append(
        f"- [{pipes_title}](#{pipes_anchor}): " + ", ".join(f"[`{n}`](#{pipe_anchors[n]})" for n in names)
    )
    if groups:
        toc.append(
            f"- [{groups_title}](#{groups_anchor}): "
            + ", ".join(f"[`{g.__name__}`](#{group_anchors[g]})" for g in groups)
        )
    out.append("\n".join(toc) + "\n")

    for s in sections:
        assert s.cls is not None
        out.append(f"## {s.title}\n")
        doc = class_doc(s.cls)
        if doc:
            out.append(" ".join(doc.split()) + "\n")
        rows = field_rows(
            s.cls,
            s.prefix,
            links={k: v for k, v in links.items() if k is not s.cls},
            registries=registries,
            notes={"options": f"See [{pipes_title}](#{pipes_anchor})."} if s.cls is Config else None,
        )
        out.append(table(rows))

    out.append(f"## {pipes_title}\n")
    out.append(
        "The top-level `options:` mapping is validated against the options class the config's `pipeline` "
        "registered (`register_pipeline(name, options=...)`); a pipeline without one takes no `options:`. "
        "Keys a class shares with others are listed once, under "
        + (f"[{groups_title}](#{groups_anchor})" if groups else groups_title)
        + ".\n"
    )
    for n in names:
        out.append(f"### `{n}`\n")
        description = pipelines.describe(n)
        if description:
            out.append(description + "\n")
        cls = option_classes[n]
        if cls is None:
            out.append("Takes no `options:` section.\n")
        elif cls in group_anchors:
            out.append(
                f"Options class `{_qualified(cls)}`: every key is listed under "
                f"[`{cls.__name__}`](#{group_anchors[cls]}).\n"
            )
        else:
            out.extend(p + "\n" for p in _options_body(cls, group_anchors, registries))

    if groups:
        out.append(f"## {groups_title}\n")
        out.append("Options classes that pipelines' options classes extend; their keys go in `options:`.\n")
        for g in groups:
            users = [n for n, c in option_classes.items() if c is not None and g in c.__mro__]
            out.append(f"### `{g.__name__}`\n")
            out.append("Used by " + ", ".join(f"[`{n}`](#{pipe_anchors[n]})" for n in users) + ".\n")
            out.extend(p + "\n" for p in _options_body(g, group_anchors, registries))
    return "\n".join(out)


def undocumented() -> list[str]:
    """``module.Class.field`` of every documented dataclass field that has no docstring, sorted."""
    import pipelines

    classes: set[type] = {s.cls for s in _config_sections(Config, set()) if s.cls is not None}
    for n in pipeline_names():
        cls = pipelines.options_class(n)
        if cls is not None:
            classes.update(c for c in cls.__mro__ if dataclasses.is_dataclass(c))
    missing = []
    for cls in classes:
        hints = _hints(cls)
        for name in own_field_names(cls):
            holds_section = _nested(hints.get(name))[0] is not None
            if (cls, name) not in _HIDDEN and not holds_section and not field_doc(cls, name):
                missing.append(f"{_qualified(cls)}.{name}")
    return sorted(missing)


def check(path: Path = DOC_PATH) -> str | None:
    """None if `path` holds the current reference, else a message saying how to regenerate it."""
    expected = render()
    try:
        current = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return f"{path.name} is missing; generate it with `{WRITE_COMMAND}`"
    if current != expected:
        return (
            f"{path.name} is stale (the config dataclasses or the registries changed); "
            f"regenerate it with `{WRITE_COMMAND}`"
        )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mmalign.app.config_reference",
        description="Print the configuration reference generated from the typed config.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write it to docs/configuration.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    mode.add_argument(
        "--undocumented", action="store_true", help="list the config fields that have no docstring"
    )
    parser.add_argument("--path", type=Path, default=DOC_PATH, help="the file for --write and --check")
    args = parser.parse_args(argv)
    if args.write:
        args.path.parent.mkdir(parents=True, exist_ok=True)
        args.path.write_text(render(), encoding="utf-8", newline="\n")
        print(f"wrote {args.path}")
        return 0
    if args.check:
        problem = check(args.path)
        if problem is not None:
            print(f"mmalign.app.config_reference: {problem}", file=sys.stderr)
            return 1
        print(f"{args.path.name} is up to date")
        return 0
    if args.undocumented:
        for name in undocumented():
            print(name)
        return 0
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
