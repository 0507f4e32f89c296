"""The `mmalign` command: `list` shows every registry entry; `train` fails with one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import pipelines
import pipelines.text_reasoning
import rewards
from mmalign.algorithms import advantages, filters, flow_objectives, losses, reward_transforms, sde
from mmalign.app.cli import build_parser, main
from mmalign.config import ConfigError
from mmalign.data import prompt_samplers as samplers
from mmalign.data import rollout_loops
from mmalign.data.rows import DataError
from mmalign.errors import MmalignError
from mmalign.registry import PluginError, RegistryError

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "text_reasoning-tiny.yaml"

SECTIONS = {
    "pipelines": ["pipelines"],
    "rewards": ["rewards"],
    "estimators": ["estimators", "reward transforms (algorithm.reward_transforms)"],
    "losses": [
        "losses",
        "loss aggregations (algorithm.loss_agg)",
        "KL estimators (algorithm.kl_estimator)",
        "flow objectives (algorithm.objective)",
    ],
    "filters": ["filters (algorithm.filter)"],
    "samplers": ["prompt samplers (data.sampler)"],
    "steps": ["denoising steps (mmalign.algorithms.sde.step)"],
    "loops": ["rollout loops (rollout.loop)"],
}


def registered() -> dict[str, list[str]]:
    """Section title -> names, from the registries themselves."""
    return {
        "pipelines": pipelines.names(),
        "rewards": rewards.names(),
        "estimators": advantages.names(),
        "reward transforms (algorithm.reward_transforms)": reward_transforms.names(),
        "flow objectives (algorithm.objective)": flow_objectives.names(),
        "losses": losses.names(),
        "loss aggregations (algorithm.loss_agg)": losses.aggregation_names(),
        "KL estimators (algorithm.kl_estimator)": losses.kl_names(),
        "filters (algorithm.filter)": filters.names(),
        "prompt samplers (data.sampler)": samplers.names(),
        "denoising steps (mmalign.algorithms.sde.step)": sde.names(),
        "rollout loops (rollout.loop)": sorted(rollout_loops.LOOPS.names()),
    }


def parse_list(out: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            assert line.endswith(":"), line
            current = line[:-1]
            assert current not in sections, f"section {current!r} printed twice"
            sections[current] = []
        else:
            assert current is not None, line
            sections[current].append(line.split()[0])
    return sections


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------- list


@pytest.mark.parametrize("what", list(SECTIONS))
def test_list_category_prints_every_registered_name(capsys, what):
    rc, out, err = run_main(capsys, "list", what)
    assert rc == 0 and err == ""
    shown = parse_list(out)
    expected = {title: registered()[title] for title in SECTIONS[what]}
    assert shown == expected
    assert all(expected.values())  # every registry has entries


def test_list_all_is_the_default(capsys):
    rc, out, _ = run_main(capsys, "list")
    assert rc == 0
    assert parse_list(out) == registered()
    assert run_main(capsys, "list", "all")[1] == out


def test_list_shows_descriptions(capsys):
    _, out, _ = run_main(capsys, "list", "estimators")
    line = next(ln for ln in out.splitlines() if ln.split()[:1] == ["grpo"])
    assert advantages.describe("grpo") in line


def _undocumented(*args, **kwargs):
    return None


class _UndocumentedReward(rewards.Reward):
    def __call__(self, batch):
        return [0.0] * len(batch.texts)


_UndocumentedReward.__doc__ = None


@pytest.mark.parametrize(
    "registry, title, obj",
    [
        (advantages.REGISTRY, "estimators", _undocumented),
        (losses.REGISTRY, "losses", _undocumented),
        (losses.AGGREGATIONS, "loss aggregations (algorithm.loss_agg)", _undocumented),
        (losses.KL_ESTIMATORS, "KL estimators (algorithm.kl_estimator)", _undocumented),
        (flow_objectives.REGISTRY, "flow objectives (algorithm.objective)", _undocumented),
        (reward_transforms.TRANSFORMS, "reward transforms (algorithm.reward_transforms)", _undocumented),
        (filters.FILTERS, "filters (algorithm.filter)", _undocumented),
        (samplers.SAMPLERS, "prompt samplers (data.sampler)", _undocumented),
        (sde.STEPS, "denoising steps (mmalign.algorithms.sde.step)", _undocumented),
        (rewards.REGISTRY, "rewards", _UndocumentedReward),
        (pipelines.REGISTRY, "pipelines", _undocumented),
    ],
)
def test_list_shows_entries_without_a_description(capsys, monkeypatch, registry, title, obj):
    pipelines.names()  # load the pipeline modules first, so the patch is not overwritten
    name = "zz_undocumented_test_entry"
    monkeypatch.setitem(registry._items, name, obj)
    monkeypatch.setitem(registry._meta, name, {})
    assert registry.describe(name) == ""
    rc, out, _ = run_main(capsys, "list")
    assert rc == 0
    shown = parse_list(out)
    assert name in shown[title]
    assert shown == registered()


def test_list_shows_reward_entry_points(capsys, monkeypatch):
    monkeypatch.setattr(rewards, "entry_point_names", lambda: ["format", "zz_from_entry_point"])
    _, out, _ = run_main(capsys, "list", "rewards")
    lines = [ln.split() for ln in out.splitlines()[1:]]
    # the entry point cannot be imported: listed as such, the error on stderr, the other rewards still listed
    assert ["zz_from_entry_point", "(entry", "point,", "failed", "to", "load)"] in lines
    assert [ln[0] for ln in lines].count("format") == 1  # a registered name is not repeated


def test_list_unknown_category_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["list", "widgets"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


# ----------------------------------------------------------------------------- train: errors before training


@pytest.fixture
def no_model(monkeypatch):
    """Fail loudly if a test would build or load a model (they all must stop before that)."""

    def refuse(cfg):
        raise AssertionError("the model was built, but the error should have been found before")

    monkeypatch.setattr(pipelines.text_reasoning, "build_text_policy", refuse)


def tiny_config(tmp_path: Path, **changes) -> tuple[Path, dict]:
    """A copy of the tiny config with absolute paths and output_dir under tmp_path."""
    data = yaml.safe_load(TINY.read_text())
    data["output_dir"] = str(tmp_path / "run")
    data["model"]["name_or_path"] = str(ROOT / data["model"]["name_or_path"])
    data["data"]["train"] = str(ROOT / data["data"]["train"])
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        data[section][key] = value
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, data


def assert_one_error_line(err: str, *fragments: str) -> str:
    lines = err.strip().splitlines()
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith("mmalign: error: "), err
    for f in fragments:
        assert f in lines[0], (f, err)
    return lines[0]


def test_train_misspelled_key_in_file(capsys, tmp_path, no_model):
    cfg, _ = tiny_config(tmp_path, trainer__lrr=1e-4)
    rc, out, err = run_main(capsys, "train", str(cfg))
    assert rc == 1 and out == ""
    assert_one_error_line(err, str(cfg), "'trainer.lrr'", "did you mean 'trainer.lr'?")
    assert not (tmp_path / "run").exists()


def test_train_misspelled_override(capsys, tmp_path, no_model):
    cfg, _ = tiny_config(tmp_path)
    rc, _, err = run_main(capsys, "train", str(cfg), "trainer.steps=2", "rewards.0.wieght=2")
    assert rc == 1
    assert_one_error_line(err, "command line", "rewards.0.wieght=2", "did you mean 'rewards[0].weight'?")


def test_train_misspelled_key_subprocess(tmp_path, run_mmalign):
    """The real process: exit status 1, one line on stderr, no traceback, nothing on stdout."""
    cfg, _ = tiny_config(tmp_path, rollout__group_sise=4)
    proc = run_mmalign("train", str(cfg), cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert_one_error_line(proc.stderr, str(cfg), "'rollout.group_sise'", "did you mean 'rollout.group_size'?")


def test_train_missing_config_file(capsys, tmp_path, no_model):
    missing = tmp_path / "nope.yaml"
    rc, out, err = run_main(capsys, "train", str(missing))
    assert rc == 1 and out == ""
    assert_one_error_line(err, f"config file not found: {missing}")


def test_train_invalid_yaml_is_one_line(capsys, tmp_path, no_model):
    path = tmp_path / "cfg.yaml"
    path.write_text("pipeline: text_reasoning\ntrainer: {steps: 2\n")
    rc, _, err = run_main(capsys, "train", str(path))
    assert rc == 1
    assert_one_error_line(err, f"{path}:", "invalid YAML")


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"<dir>", p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


def test_train_malformed_data_line_leaves_output_dir_alone(capsys, tmp_path, no_model):
    """Even with overwrite=true (without it the existing run is reported first), a data error deletes nothing:
    the old run is replaced only once the model is loaded and the trainer starts."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1 + 1", "answer": "2"}\n\n{"question": "2 + 2", "answer": 4\n')
    cfg, raw = tiny_config(tmp_path, data__train=str(data))
    out_dir = Path(raw["output_dir"])
    (out_dir / "samples").mkdir(parents=True)
    (out_dir / "metrics.jsonl").write_text(
        '{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.7}\n'
    )
    (out_dir / "samples" / "step_1.jsonl").write_text("{}\n")
    before = snapshot(out_dir)

    rc, out, err = run_main(
        capsys,
        "train",
        str(cfg),
        "trainer.steps=2",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "overwrite=true",
    )
    assert rc == 1 and out == ""
    assert_one_error_line(err, f"{data}:3:", "invalid JSON")
    assert snapshot(out_dir) == before
    assert sorted(p.name for p in out_dir.iterdir()) == ["metrics.jsonl", "samples"]


def test_train_data_error_does_not_create_output_dir(capsys, tmp_path, no_model):
    cfg, raw = tiny_config(tmp_path, data__train=str(tmp_path / "missing.jsonl"))
    rc, _, err = run_main(capsys, "train", str(cfg))
    assert rc == 1
    assert_one_error_line(err, f"data file not found: {tmp_path / 'missing.jsonl'}")
    assert not Path(raw["output_dir"]).exists()


def test_train_prompt_template_missing_column(capsys, tmp_path, no_model):
    cfg, _ = tiny_config(tmp_path, data__prompt_template="Q: {query}")
    rc, _, err = run_main(capsys, "train", str(cfg))
    assert rc == 1
    line = assert_one_error_line(err, "['query']", "data.prompt_template")
    assert f"{ROOT / 'assets' / 'text_reasoning' / 'train.jsonl'}:1:" in line


def test_train_prompt_template_override_with_braces(capsys, tmp_path, monkeypatch):
    """`data.prompt_template=Q: {question}` reaches the pipeline as the text typed, not a YAML mapping."""
    seen = {}

    def stop(cfg):
        seen["template"] = cfg.data.prompt_template
        raise RuntimeError("stop before the model")

    monkeypatch.setattr(pipelines.text_reasoning, "build_text_policy", stop)
    cfg, _ = tiny_config(tmp_path)
    rc, _, err = run_main(capsys, "train", str(cfg), "data.prompt_template=Q: {question} A:")
    assert rc == 1 and "stop before the model" in err
    assert seen["template"] == "Q: {question} A:"


@pytest.mark.parametrize(
    "override, key",
    [
        ("algorithm.estimator=grpoo", "algorithm.estimator"),
        ("algorithm.loss=ppo", "algorithm.loss"),
        ("algorithm.loss_agg=token_sum", "algorithm.loss_agg"),
        ("algorithm.kl_estimator=k4", "algorithm.kl_estimator"),
        ("algorithm.filter=dynamic", "algorithm.filter"),
        ("pipeline=text_reasonin", "pipeline"),
    ],
)
def test_train_unknown_registry_name_fails_before_the_model_is_built(
    capsys, tmp_path, no_model, override, key
):
    cfg, _ = tiny_config(tmp_path)
    rc, _, err = run_main(capsys, "train", str(cfg), override)
    assert rc == 1
    assert_one_error_line(err, str(cfg), f"key '{key}'", "Registered:")


def test_train_cross_field_error(capsys, tmp_path, no_model):
    cfg, _ = tiny_config(tmp_path)
    rc, _, err = run_main(capsys, "train", str(cfg), "rollout.group_size=0")
    assert rc == 1
    assert_one_error_line(err, "command line", "'rollout.group_size' must be >= 1")


def test_unexpected_error_shows_its_traceback(capsys, tmp_path, monkeypatch):
    def boom(cfg):
        raise RuntimeError("a bug, not a user error")

    monkeypatch.setattr(pipelines.text_reasoning, "build_text_policy", boom)
    cfg, _ = tiny_config(tmp_path)
    rc, _, err = run_main(capsys, "train", str(cfg))
    assert rc == 1
    assert "Traceback" in err
    assert err.strip().splitlines()[-1] == "mmalign: error: a bug, not a user error"


def test_sample_and_eval_resolve_the_checkpoint_once_for_every_process(tmp_path, monkeypatch, capsys):
    """``--checkpoint latest`` on several processes is resolved by the main process and used by all (each resolving
    it, a run still training could finish a checkpoint between their look-ups: rank 1 loaded step 3 and rank 0
    step 2, and ``sample`` wrote both in one grid); a failure there is raised on every process."""
    from types import SimpleNamespace

    import accelerate.utils

    from mmalign.app import cli, evaluation

    cfg = SimpleNamespace(output_dir=str(tmp_path / "run"))
    sent: list = []

    def broadcast(objects, from_process=0):
        assert from_process == 0
        sent.append(objects[0])
        return [main_answer]

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", broadcast)

    def not_here(*args, **kwargs):
        raise AssertionError("a process other than the main resolved the checkpoint")

    monkeypatch.setattr(evaluation, "resolve_checkpoint", not_here)
    rank1 = SimpleNamespace(is_main_process=False, num_processes=2)
    main_answer = ("ok", tmp_path / "run" / "checkpoints" / "step_000002")
    assert cli._shared_checkpoint(cfg, "latest", "x", rank1) == main_answer[1]
    assert sent == [None]
    main_answer = ("error", ("CheckpointError", "checkpoint step_000002 fails verification: a.bin: missing"))
    with pytest.raises(MmalignError, match=r"\(the main process\) checkpoint step_000002 fails verification"):
        cli._shared_checkpoint(cfg, "latest", "x", rank1)

    found = tmp_path / "run" / "checkpoints" / "step_000003"  # the main process resolves it, and shares it
    monkeypatch.setattr(evaluation, "resolve_checkpoint", lambda out, spec: found)
    sent.clear()
    main0 = SimpleNamespace(is_main_process=True, num_processes=2)
    main_answer = ("ok", found)
    assert cli._shared_checkpoint(cfg, "latest", "x", main0) == found and sent == [("ok", found)]


def test_a_failed_tiny_build_leaves_nothing(tmp_path, monkeypatch):
    """A builder that fails removes its ``.building`` folder: a process waiting for it (the other ranks of a
    launch) then builds again instead of being told that a build (the dead one) is writing it."""
    from mmalign import tiny

    def broken(path):
        (path / "half.bin").write_bytes(b"x")
        raise RuntimeError("out of memory")

    tiny.get_builder("vlm_random")  # (the builders are discovered)
    monkeypatch.setattr(tiny, "get_builder", lambda name: broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        tiny.build("vlm_random", tmp_path / "m", announce=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _as_rank_1_of_2(monkeypatch: pytest.MonkeyPatch, error_file: Path) -> None:
    """The environment torchrun gives the second of two workers (the CLI's multi-process error path)."""
    for key, value in {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "ACCELERATE_USE_CPU": "true",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))


def test_a_worker_tags_its_error_with_its_rank_and_tells_the_launcher(capsys, tmp_path, monkeypatch):
    """In a multi-process launch the error line names the process (``rank 1 of 2``), and the error goes into
    torchrun's error file, so the launcher's failure summary shows it (instead of "To enable traceback ...")."""
    import json

    error_file = tmp_path / "error.json"
    _as_rank_1_of_2(monkeypatch, error_file)
    rc, _, err = run_main(capsys, "train", str(tmp_path / "nope.yaml"))
    assert rc == 1
    line = err.strip().splitlines()[-1]
    assert line.startswith(
        f"mmalign: error (rank 1 of 2): config file not found: {tmp_path / 'nope.yaml'}"
    ), err
    recorded = json.loads(error_file.read_text())["message"]
    assert recorded["message"] == "ConfigError: " + line.split(": ", 2)[2]
    assert recorded["extraInfo"]["timestamp"].isdigit()


def test_a_worker_whose_peer_is_gone_points_at_the_peer(capsys, tmp_path, monkeypatch):
    """A collective that fails because another process already stopped (gloo: "Connection closed by peer") is
    a consequence: the line says to look for the other process's error, and nothing goes into the error file, so
    torchrun's summary names the process that failed first."""

    def peer_closed(cfg):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:30411")

    monkeypatch.setattr(pipelines.text_reasoning, "build_text_policy", peer_closed)
    error_file = tmp_path / "error.json"
    _as_rank_1_of_2(monkeypatch, error_file)
    cfg, _ = tiny_config(tmp_path)
    rc, _, err = run_main(capsys, "train", str(cfg))
    assert rc == 1
    lines = err.strip().splitlines()
    assert (
        lines[-2].startswith("mmalign: error (rank 1 of 2): [gloo")
        and "Connection closed by peer" in lines[-2]
    )
    assert "another process of this launch stopped first" in lines[-1]
    assert not error_file.exists()


@pytest.mark.parametrize(
    "error",
    [
        DataError("rows.jsonl:3: bad line"),
        rewards.RewardError("reward 'x' failed: boom"),
        MmalignError("a plain user error"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_every_mmalign_error_is_one_line(capsys, tmp_path, monkeypatch, error):
    """The command line catches the base class: any `MmalignError` subclass is one line, no traceback."""
    exc = error

    def fail(cfg):
        raise exc

    monkeypatch.setattr(pipelines.text_reasoning, "build_text_policy", fail)
    cfg, _ = tiny_config(tmp_path)
    rc, _, err = run_main(capsys, "train", str(cfg))
    assert rc == 1
    assert_one_error_line(err, str(exc))


def test_user_error_classes_share_the_base_and_keep_their_standard_class():
    for cls, std in (
        (ConfigError, ValueError),
        (DataError, ValueError),
        (RegistryError, KeyError),
        (PluginError, KeyError),
        (rewards.RewardError, RuntimeError),
        (rewards.RewardKeyError, KeyError),
    ):
        assert issubclass(cls, MmalignError) and issubclass(cls, std), cls
    assert str(RegistryError("plain")) == "plain"  # not quoted like a KeyError


def test_debug_shows_traceback_for_user_errors(capsys, tmp_path, no_model):
    cfg, _ = tiny_config(tmp_path, trainer__lrr=1)
    rc, _, err = run_main(capsys, "--debug", "train", str(cfg))
    assert rc == 1
    assert "Traceback" in err and "ConfigError" in err
    assert err.strip().splitlines()[-1].startswith("mmalign: error: ")


@pytest.mark.parametrize("override", ["rewards.0.kwargs.extractt=tag", "rewards.0.name=accuracyy"])
def test_train_bad_reward_entry_is_one_line_naming_the_key(capsys, tmp_path, no_model, override):
    cfg, _ = tiny_config(tmp_path)
    rc, _, err = run_main(capsys, "train", str(cfg), override)
    assert rc == 1
    assert_one_error_line(err, "rewards[0]")


def test_components_are_built_from_the_seed(tmp_path, random_text_model_dir):
    """Model construction draws random numbers (a LoRA adapter's initial A); the CLI seeds the global RNGs
    with `seed` before building, so two builds of one config agree whatever state the RNG was in (torch seeds
    its default generator randomly in each new process)."""
    import argparse

    import torch

    from mmalign.app import cli

    cfg, _ = tiny_config(tmp_path, model__name_or_path=str(random_text_model_dir), model__tiny_builder=None)
    overrides = ["model.lora.enabled=true", "model.lora.r=4"]
    built = []
    for rng in (1, 2):
        torch.manual_seed(rng)
        _, components = cli.load_components(
            argparse.Namespace(config=str(cfg), overrides=overrides), resume=False
        )
        built.append({k: v.clone() for k, v in components.policy.trainable_state_dict().items()})
    assert built[0].keys() == built[1].keys() and any("lora_A" in k for k in built[0])
    assert all(torch.equal(built[0][k], built[1][k]) for k in built[0])


def test_tiny_list_and_build(tmp_path, capsys, monkeypatch):
    """``mmalign tiny list`` names the builders and the shipped folders; ``tiny build`` replaces a folder
    only once the new one is complete, and only a folder a tiny build wrote (never a folder of other files)."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    assert main(["tiny", "list"]) == 0
    out = capsys.readouterr().out
    assert "text_reasoning" in out and "assets/models/text_reasoning-tiny" in out and "(tests only)" in out
    target = tmp_path / "tiny-lm"
    target.mkdir()
    (target / "old.txt").write_text("old")
    capsys.readouterr()
    assert main(["tiny", "build", "vlm_random", "--out", str(target)]) == 1
    assert "is not a tiny model mmalign built (no mmalign_tiny.json in it)" in capsys.readouterr().err
    assert (target / "old.txt").read_text() == "old" and not target.with_name("tiny-lm.new").exists()
    (target / "mmalign_tiny.json").write_text("{}")  # an earlier build of this folder
    assert main(["tiny", "build", "vlm_random", "--out", str(target)]) == 0
    assert not (target / "old.txt").exists() and (target / "config.json").is_file()
    assert not target.with_name("tiny-lm.new").exists()
    assert main(["tiny", "build", "no_such_builder"]) == 1
    assert "no_such_builder" in capsys.readouterr().err


def test_tiny_build_removes_only_what_a_killed_build_left(tmp_path, capsys):
    """``<out>.building`` (and `mmalign tiny build`'s ``<out>.new``) beside the folder: a killed build's is removed
    and the build goes on; a folder of that name a build did not write, or one a running build is writing, is
    refused, naming it, and kept."""
    import subprocess
    import sys

    from mmalign import tiny

    target = tmp_path / "tiny-lm"
    building = target.with_name("tiny-lm.building")
    building.mkdir()
    (building / "thesis.tex").write_text("mine")  # a user's folder that happens to have the name
    with pytest.raises(ConfigError, match=r"tiny-lm.building exists and is not an unfinished tiny build"):
        tiny.build("vlm_random", target, announce=False)
    assert (building / "thesis.tex").read_text() == "mine" and not target.exists()

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (building / tiny.BUILDING_MARK).write_text(dead.stdout)  # left by a build that was killed
    (building / "model.safetensors").write_text("half")
    tiny.build("vlm_random", target, announce=False)
    assert (target / "config.json").is_file() and not building.exists()
    assert not (target / tiny.BUILDING_MARK).exists()

    other = tmp_path / "other"
    running = other.with_name("other.building")
    running.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (running / tiny.BUILDING_MARK).write_text(f"{sleeper.pid}\n")
        with pytest.raises(ConfigError, match=rf"another tiny build \(pid {sleeper.pid}\) is writing it"):
            tiny.build("vlm_random", other, announce=False)
        assert running.is_dir()
    finally:
        sleeper.kill()
        sleeper.wait()

    staged = target.with_name("tiny-lm.new")  # a rebuild killed between its build and the swap
    staged.mkdir()
    (staged / "notes.txt").write_text("mine")
    assert main(["tiny", "build", "vlm_random", "--out", str(target)]) == 1
    assert "tiny-lm.new exists and is not a tiny build's staged copy" in capsys.readouterr().err
    (staged / tiny.MARK_FILE).write_text("{}")
    assert main(["tiny", "build", "vlm_random", "--out", str(target)]) == 0
    assert not staged.exists() and (target / "config.json").is_file()


def test_help_lists_the_tool_commands_without_importing_them():
    """`mmalign --help` (and every other command) builds its parser without the planner, probe and parity
    modules (they import torch: a second at start-up); the command being run gets its full parser."""
    import subprocess
    import sys

    code = (
        "import sys; from mmalign.app.cli import build_parser; build_parser('list'); "
        "print(sorted(m for m in ('mmalign.app.plan', 'mmalign.app.probe', 'mmalign.app.parity', 'torch') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    help_text = build_parser().format_help()
    assert all(name in help_text for name in ("plan", "probe", "parity"))
    args = build_parser("plan").parse_args(["plan", str(TINY), "--gpus", "2"])
    assert args.gpus == 2 and callable(args.func)


# ----------------------------------------------------------------------------- list: the cache


def test_list_is_cached_until_the_code_changes(tmp_path):
    """The second `mmalign list` prints the same listing from the cache without importing torch (issue 33
    item 20: the registries' imports were most of its 6.7 s)."""
    import os
    import subprocess
    import sys

    code = (
        "import sys; from mmalign.app.cli import main; main(['list']); "
        "print('torch imported' if 'torch' in sys.modules else 'torch not imported', file=sys.stderr)"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONWARNINGS": "ignore"}
    runs = [
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True
        )
        for _ in range(2)
    ]
    assert runs[0].stderr.strip().splitlines()[-1] == "torch imported"
    assert runs[1].stderr.strip().splitlines()[-1] == "torch not imported"
    assert runs[1].stdout == runs[0].stdout  # the first run built the listing fresh (torch imported)
    assert {"pipelines", "rewards", "estimators"} <= set(parse_list(runs[1].stdout))
    assert (tmp_path / "cache" / "mmalign" / "list-all.json").is_file()


def test_list_fingerprint_follows_the_source(tmp_path, monkeypatch):
    from mmalign.app import listing

    package = tmp_path / "zz_listing_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def key() -> str:
        return listing.fingerprint("all", packages=["zz_listing_pkg"], groups=[])

    first = key()
    assert key() == first
    (package / "__init__.py").write_text("X = 22\n")  # (another size)
    assert key() != first
    second = key()
    (package / "more.py").write_text("")  # a new module
    assert key() != second
    assert listing.fingerprint("estimators", packages=["zz_listing_pkg"], groups=[]) != key()
    import pipelines
    import rewards

    assert listing.ENTRY_POINT_GROUPS == (pipelines.ENTRY_POINT_GROUP, rewards.ENTRY_POINT_GROUP)


def test_list_ignores_the_cache_once_a_registry_is_imported(capsys, tmp_path, monkeypatch):
    """In a process that imported the registries (and may have changed them) the listing is built afresh."""
    from mmalign.app import listing

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(listing, "fingerprint", lambda what, **kw: "same")
    (tmp_path / "mmalign").mkdir()
    (tmp_path / "mmalign" / "list-all.json").write_text('{"key": "same", "out": "stale:\\n", "err": ""}')
    rc, out, _ = run_main(capsys, "list")
    assert rc == 0 and parse_list(out) == registered()


# ----------------------------------------------------------------------------- the run lock, resume, messages

FAST = [
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "trainer.progress_bar=false",
    "trainer.sample_every=100",
]
"""Overrides that make the tiny config train a step in about a second."""


def holder_of(out: Path):
    from tests.training.test_runlock import Holder

    return Holder(out)


def test_second_train_is_refused_before_the_model(capsys, tmp_path, no_model):
    """Issue 33 item 3: a second writer into a run's output_dir stops at once, naming the first."""
    cfg, raw = tiny_config(tmp_path)
    holder = holder_of(Path(raw["output_dir"]))
    try:
        rc, out, err = run_main(capsys, "train", str(cfg))
    finally:
        holder.close()
    assert rc == 1 and out == ""
    assert_one_error_line(
        err, f"pid {holder.pid} on host", "mmalign train held.yaml", f"kill {holder.pid}", "is being written"
    )


def test_resume_after_a_killed_holder_with_changed_keys(capsys, tmp_path, monkeypatch):
    """Issue 33 items 3, 4 and 19: a resume is refused while another run holds the folder and starts once that
    run is SIGKILLed; it says where it resumes from and which changed keys it applied, trains at the new lr,
    refuses a model change before the model loads, and says when the run is finished."""
    import json

    cfg, raw = tiny_config(tmp_path)
    out = Path(raw["output_dir"])
    assert main(["train", str(cfg), *FAST, "trainer.steps=2", "trainer.save_every=1"]) == 0
    capsys.readouterr()
    resume = [
        *FAST,
        "trainer.steps=3",
        "trainer.save_every=1",
        "--resume",
        "trainer.lr=0.003",
    ]  # (as issue 33)
    holder = holder_of(out)
    try:
        rc, _, err = run_main(capsys, "train", str(cfg), *resume)
        assert rc == 1
        assert_one_error_line(err, f"pid {holder.pid} on host")
        holder.kill()
        rc, stdout, err = run_main(capsys, "train", str(cfg), *resume)
    finally:
        holder.close()
    assert rc == 0, err
    lines = stdout.splitlines()
    assert lines[0] == f"resuming from step 2 (checkpoint {out / 'checkpoints' / 'step_000002'})"
    assert lines[1].startswith("resume: trainer.steps: 2 -> 3 (applied: the run trains up to the new step")
    assert lines[2].startswith("resume: trainer.lr: 0.0003 -> 0.003 (applied: the learning rate: ")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["lr"] for r in rows] == [3e-4, 3e-4, 3e-3]

    def refuse(cfg):
        raise AssertionError("the model was built")

    monkeypatch.setattr(pipelines.text_reasoning, "build_text_policy", refuse)
    rc, _, err = run_main(capsys, "train", str(cfg), *resume, "model.lora.enabled=true")
    assert rc == 1
    assert_one_error_line(err, "--resume: model.lora.enabled: false -> true (the run's ", "cannot change")
    rc, stdout, _ = run_main(capsys, "train", str(cfg), *resume)
    assert rc == 0
    assert f"{out} is finished: trained to step 3 (trainer.steps=3;" in stdout
    assert "To train further, raise trainer.steps on --resume: " in stdout
    assert stdout.strip().endswith("trainer.lr=0.003 trainer.steps=6 --resume")


def test_interrupt_names_the_checkpoint_and_the_command(capsys, tmp_path, monkeypatch, caplog):
    """Issue 33 item 19: Ctrl-C says the last complete checkpoint and the command that continues; before any
    checkpoint, the command that starts again. overwrite=true says what it removes."""
    import logging

    from mmalign.training import runlock
    from mmalign.training.trainer import GroupTrainer

    real_step = GroupTrainer.train_step
    stop = {"at": 2}

    def train_step(self):
        if self.step == stop["at"]:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(GroupTrainer, "train_step", train_step)
    cfg, raw = tiny_config(tmp_path)
    out = Path(raw["output_dir"])
    given = [*FAST, "trainer.steps=4", "trainer.save_every=1"]
    rc, _, err = run_main(capsys, "train", str(cfg), *given)
    assert rc == 130
    assert err.strip().splitlines()[-2:] == [
        f"interrupted at step 3. The last complete checkpoint: {out / 'checkpoints' / 'step_000002'} (step 2; "
        "later steps are not kept). Continue with:",
        f"  mmalign train {cfg} {' '.join(given)} --resume",
    ]
    assert not (out / runlock.LOCK_FILE).exists()  # released

    stop["at"] = 0
    fresh = tmp_path / "fresh"
    rc, _, err = run_main(capsys, "train", str(cfg), *given, f"output_dir={fresh}")
    assert rc == 130
    assert err.strip().splitlines()[-2:] == [
        f"interrupted at step 1, before the first checkpoint in {fresh / 'checkpoints'}: nothing to resume "
        "from. Start again with:",
        f"  mmalign train {cfg} {' '.join(given)} output_dir={fresh}",
    ]

    stop["at"] = -1
    with caplog.at_level(logging.WARNING, logger="mmalign.training.trainer"):
        assert main(["train", str(cfg), *FAST, "trainer.steps=1", "overwrite=true"]) == 0
    removed = next(r.getMessage() for r in caplog.records if "overwrite=true" in r.getMessage())
    assert removed.startswith(f"overwrite=true: removing the previous run in {out}: ")
    assert "metrics.jsonl (2 rows)" in removed and "checkpoints/ (step_000001, step_000002)" in removed
    from mmalign.training import rundir

    written = (out / rundir.CONFIG_FILE).read_text()  # the header marks the folder as a run's (`holds_run`)
    assert written.startswith(rundir.CONFIG_HEADER) and yaml.safe_load(written)["output_dir"] == str(out)


def test_eval_and_sample_take_no_lock_and_warn_without_a_checkpoint(capsys, tmp_path):
    """Readers do not take the run lock (they run while the run trains); `eval` of a run with no checkpoint
    scores the base model with a warning before and after the report (issue 33 item 19)."""
    from mmalign.training import runlock

    cfg, raw = tiny_config(tmp_path)
    out = Path(raw["output_dir"])
    holder = holder_of(out)
    try:
        rc, stdout, err = run_main(capsys, "eval", str(cfg), "eval.max_rows=2", "eval.group_size=1")
        assert rc == 0, err
        warning = f"mmalign: warning: no checkpoint: {out / 'checkpoints'} holds no complete checkpoint"
        assert err.count(warning) == 2 and "--checkpoint base" in err
        rc, _, err = run_main(
            capsys, "sample", str(cfg), "-n", "1", "--max-prompts", "1", "--out", str(tmp_path / "s")
        )
        assert rc == 0 and warning in err
        assert runlock.read_holder(out).pid == holder.pid
    finally:
        holder.close()
