"""docs/configuration.md is generated from the typed config (`mmalign.app.config_reference`) and kept current:
the committed file equals the generator's output, and the generator shows every field of a dataclass, with
or without a docstring, including one added later."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from mmalign.app import config_reference as ref
from mmalign.config import Config, TrainerConfig, yaml_key

REPO = Path(__file__).resolve().parents[2]


def test_the_committed_reference_is_current():
    """In a fresh interpreter, as a user runs it (no names that other tests registered)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mmalign.app.config_reference", "--check"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        f"docs/configuration.md is stale: regenerate it with `{ref.WRITE_COMMAND}` and commit it\n"
        f"{proc.stdout}{proc.stderr}"
    )


def test_check_names_the_command_that_regenerates_a_stale_file(tmp_path, capsys):
    path = tmp_path / "configuration.md"
    assert ref.main(["--write", "--path", str(path)]) == 0
    assert ref.main(["--check", "--path", str(path)]) == 0
    path.write_text(path.read_text().replace("| `trainer.lr` |", "| `trainer.learning_rate` |"))
    capsys.readouterr()
    assert ref.main(["--check", "--path", str(path)]) == 1
    err = capsys.readouterr().err
    assert "configuration.md is stale" in err and ref.WRITE_COMMAND in err
    path.unlink()
    assert ref.main(["--check", "--path", str(path)]) == 1
    assert "missing" in capsys.readouterr().err


@dataclass
class _Inner:
    depth: int = 2
    """How deep."""


@dataclass
class _Synthetic:
    documented: float = 0.5
    """A documented knob."""
    undocumented: int = 3
    maybe: str | None = None
    mode: Literal["a", "b"] = "a"
    items: list[str] = field(default_factory=lambda: ["x", "y"])
    inner: _Inner = field(default_factory=_Inner)
    changed_inner: _Inner = field(default_factory=lambda: _Inner(depth=5))
    needed: int = field(default=0)


@dataclass
class _Required:
    must: str


def _row(rows: list[ref.Row], key: str) -> ref.Row:
    (row,) = [r for r in rows if r.key == key]
    return row


def test_a_field_without_a_docstring_still_appears_with_its_type_and_default():
    rows = ref.field_rows(_Synthetic, "sec.")
    assert [r.key for r in rows] == [f"sec.{f.name}" for f in dataclasses.fields(_Synthetic)]
    assert _row(rows, "sec.documented") == ref.Row("sec.documented", "`float`", "`0.5`", "A documented knob.")
    assert _row(rows, "sec.undocumented") == ref.Row("sec.undocumented", "`int`", "`3`", "")
    assert _row(rows, "sec.maybe").type == "`str | null`" and _row(rows, "sec.maybe").default == "`null`"
    assert _row(rows, "sec.mode").type == '`"a" | "b"`'
    assert _row(rows, "sec.items").default == '`["x", "y"]`'
    assert _row(rows, "sec.inner").type == "`mapping`" and _row(rows, "sec.inner").default == "`{}`"
    assert _row(rows, "sec.changed_inner").default == "`{depth: 5}`"
    assert ref.field_rows(_Required)[0].default == "required"
    text = ref.table(rows)
    assert "| `sec.undocumented` | `int` | `3` |  |" in text
    assert '| `sec.mode` | `"a" \\| "b"` |' in text  # pipes escaped inside the table


def test_a_field_added_to_a_dataclass_appears():
    before = ref.table(ref.field_rows(TrainerConfig, "trainer."))
    grown = dataclasses.make_dataclass(  # no source to read a docstring from: type and default still show
        "TrainerConfig", [("new_knob", float | None, field(default=0.25))], bases=(TrainerConfig,)
    )
    after = ref.table(ref.field_rows(grown, "trainer."))
    assert "new_knob" not in before
    assert "| `trainer.new_knob` | `float | null` | `0.25` |" in after.replace("\\|", "|")
    assert after.startswith(before.rstrip("\n"))  # the other rows are unchanged


def test_docstrings_come_from_the_source_and_inherited_ones_from_the_base():
    assert ref.own_field_docs(TrainerConfig)["num_iterations"] == "mu: passes over each rollout."
    assert ref.own_field_docs(TrainerConfig)["lr"] == "AdamW learning rate."
    from mmalign.policies.denoising import SamplerSettings
    from pipelines.video.wan import WanVideoOptions

    assert ref.field_doc(WanVideoOptions, "num_steps") == ref.own_field_docs(SamplerSettings)["num_steps"]
    assert "Wan's default" in ref.field_doc(WanVideoOptions, "guidance_scale")  # redeclared there


@pytest.fixture(scope="module")
def document() -> str:
    return ref.render()


def test_every_key_of_the_config_and_of_every_pipeline_appears(document):
    import pipelines

    sections = ref._config_sections(Config, set())
    for s in sections:
        assert s.cls is not None
        for f in dataclasses.fields(s.cls):
            if (s.cls, f.name) not in ref._HIDDEN:  # named by its YAML key (`trainer.async` is `async_`)
                assert f"| `{s.prefix}{yaml_key(f)}` |" in document, f"{s.prefix}{yaml_key(f)}"
    for name in ref.pipeline_names():
        assert f"### `{name}`" in document
        cls = pipelines.options_class(name)
        for f in dataclasses.fields(cls) if cls is not None else ():
            assert f"| `options.{f.name}` |" in document, f"{name}: options.{f.name}"
    assert "`source`" not in document  # set by the loader, not a YAML key
    assert document.count("| `options.num_steps` |") == 2  # SamplerSettings, and safe_diffusion redeclares it


def test_registry_valued_keys_list_the_registered_names(document):
    from mmalign.algorithms import advantages, filters, losses
    from mmalign.data import prompt_samplers as samplers

    lines = {line.split(" | ")[0]: line for line in document.splitlines() if line.startswith("| `")}
    for key, names in {
        "algorithm.estimator": advantages.names(),
        "algorithm.loss": losses.names(),
        "algorithm.loss_agg": losses.aggregation_names(),
        "algorithm.kl_estimator": losses.kl_names(),
        "algorithm.filter": filters.names(),
        "data.sampler": samplers.names(),
        "rewards[i].name": ["answer_accuracy", "format", "clip_score"],
        "pipeline": ["text_reasoning", "text_to_image", "vlm_reasoning"],
    }.items():
        line = lines[f"| `{key}`"]
        for name in names:
            assert f"`{name}`" in line, (key, name)


def test_names_registered_outside_the_project_are_left_out():
    import pipelines

    @dataclass
    class ZZOptions:
        x: int = 0

    pipelines.register_pipeline("zz_reference_test", options=ZZOptions)(lambda cfg: None)
    try:
        assert "zz_reference_test" in pipelines.names()
        assert "zz_reference_test" not in ref.pipeline_names()
    finally:
        pipelines.REGISTRY.unregister("zz_reference_test")


def test_the_reference_has_no_machine_paths_and_links_resolve(document):
    import re

    assert str(REPO) not in document and "/home/" not in document and "site-packages" not in document
    taken: set[str] = set()
    anchors = {ref.slug(m, taken) for m in re.findall(r"^#+ (.+)$", document, flags=re.M)}
    for target in re.findall(r"\]\(#([^)]+)\)", document):
        assert target in anchors, target
