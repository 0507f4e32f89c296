"""What a new user hit (issue 8): a wrong `mmalign` command fails with one clear line before any model is
built or loaded, and an existing run in ``output_dir`` is left exactly as it was; the first run says which
tiny models it builds, for about how long, and shows each builder's progress."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from mmalign import tiny
from mmalign.app import preflight
from mmalign.app.cli import main
from mmalign.config import ConfigError, load_config
from mmalign.training import rundir

ROOT = Path(__file__).resolve().parents[2]
PIPELINES = ["text_reasoning", "vlm_reasoning", "text_to_image", "safe_diffusion"]
DATA_KEY = {  # an override pointing the pipeline's training prompts at a file that does not exist
    "text_reasoning": "data.train={}",
    "vlm_reasoning": "data.train={}",
    "text_to_image": "data.train={}",
    "safe_diffusion": "options.safe_prompts=[{}]",
}


def _relocate(node: Any, models: Path) -> Any:
    """Paths of a tiny config made absolute: data under the repository, model folders under `models`."""
    if isinstance(node, dict):
        return {_relocate(k, models): _relocate(v, models) for k, v in node.items()}
    if isinstance(node, list):
        return [_relocate(v, models) for v in node]
    if isinstance(node, str) and node.startswith("assets/models/"):
        return str(models / node[len("assets/models/") :])
    if isinstance(node, str) and node.startswith("assets/"):
        return str(ROOT / node)
    return node


def tiny_config(tmp_path: Path, pipeline: str) -> tuple[Path, Path]:
    """configs/<pipeline>-tiny.yaml with absolute data paths, model folders (not built) under tmp_path/models
    and output_dir tmp_path/run; returns (config file, output_dir)."""
    data = yaml.safe_load((ROOT / "configs" / f"{pipeline}-tiny.yaml").read_text())
    data = _relocate(data, tmp_path / "models")
    data["output_dir"] = str(tmp_path / "run")
    path = tmp_path / f"{pipeline}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, tmp_path / "run"


def old_run(out: Path, checkpoint: bool = True) -> dict[str, tuple[bytes, int]]:
    """An earlier run in `out` (metrics, samples, a complete checkpoint); returns its `snapshot`."""
    (out / "samples").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.7}\n')
    (out / "samples" / "step_1.jsonl").write_text("{}\n")
    (out / "config.yaml").write_text("pipeline: text_reasoning\n")
    if checkpoint:
        ckpt = out / "checkpoints" / "step_000002"
        ckpt.mkdir(parents=True)
        (ckpt / "trainable.safetensors").write_bytes(b"weights")
        (ckpt / "COMPLETE").write_text("")
    return snapshot(out)


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"<dir>", p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err: str, *fragments: str) -> str:
    lines = err.strip().splitlines()
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("mmalign: error: "), err
    for f in fragments:
        assert f in lines[0], (f, err)
    return lines[0]


# ----------------------------------------------------------------------------- the output directory


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_existing_run_is_refused_before_any_model(capsys, tmp_path, no_model, pipeline):
    cfg, out = tiny_config(tmp_path, pipeline)
    before = old_run(out)
    rc, stdout, err = run_main(capsys, "train", str(cfg))
    assert rc == 1 and stdout == ""
    one_error_line(
        err,
        f"output_dir {out} already holds a run (metrics.jsonl)",
        "--resume",
        "output_dir=...",
        "overwrite=true",
    )
    assert snapshot(out) == before
    assert not (tmp_path / "models").exists()  # no tiny model was built either


@pytest.mark.parametrize("checkpoint", [False, True])
def test_resume_without_a_complete_checkpoint_is_refused_before_any_model(
    capsys, tmp_path, no_model, checkpoint
):
    cfg, out = tiny_config(tmp_path, "text_reasoning")
    old_run(out, checkpoint=False)
    if checkpoint:  # one that was being written when the run stopped: no COMPLETE marker
        (out / "checkpoints" / "step_000004").mkdir(parents=True)
        (out / "checkpoints" / "step_000004" / "trainable.safetensors").write_bytes(b"half")
    before = snapshot(out)
    rc, _, err = run_main(capsys, "train", str(cfg), "--resume")
    assert rc == 1
    one_error_line(err, f"--resume: no complete checkpoint in {out / 'checkpoints'}; run without --resume")
    assert snapshot(out) == before


def test_resume_with_a_checkpoint_passes_the_output_dir_check(capsys, tmp_path, no_model):
    cfg, out = tiny_config(tmp_path, "text_reasoning")
    old_run(out)
    (out / "config.yaml").write_text(yaml.safe_dump(load_config(cfg).to_dict(), sort_keys=False))  # as saved
    before = snapshot(out)
    rc, _, err = run_main(capsys, "train", str(cfg), "--resume")
    assert rc == 1 and "a model was built or loaded" in err  # got as far as the model: nothing refused it
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- data, rewards, models


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_missing_data_file_is_reported_before_any_model(capsys, tmp_path, no_model, pipeline):
    cfg, out = tiny_config(tmp_path, pipeline)
    before = old_run(out)
    missing = tmp_path / "missing.jsonl"
    rc, _, err = run_main(capsys, "train", str(cfg), DATA_KEY[pipeline].format(missing), "overwrite=true")
    assert rc == 1
    line = one_error_line(err, f"data file not found: {missing}")
    if pipeline != "safe_diffusion":  # data.train is checked (and named) before the pipeline reads it
        assert f"{cfg} (with command-line overrides): key 'data.train': " in line
    assert snapshot(out) == before  # overwrite=true replaces the old run only once training starts


def test_misspelled_data_file_gets_a_suggestion(capsys, tmp_path, no_model):
    cfg, _ = tiny_config(tmp_path, "text_to_image")
    typo = ROOT / "assets" / "text_to_image" / "trian.jsonl"
    rc, _, err = run_main(capsys, "train", str(cfg), f"data.train={typo}")
    assert rc == 1
    one_error_line(
        err, f"key 'data.train': data file not found: {typo}. Did you mean '{typo.with_name('train.jsonl')}'?"
    )


def test_training_the_ode_is_refused_before_any_model(capsys, tmp_path, no_model):
    cfg, out = tiny_config(tmp_path, "text_to_image")
    rc, _, err = run_main(capsys, "train", str(cfg), "options.noise_level=0")
    assert rc == 1
    one_error_line(err, "key 'options.noise_level': 0 samples the deterministic ODE", "algorithm.objective")
    assert not (out / "metrics.jsonl").exists() and not (tmp_path / "models").exists()


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_unknown_reward_is_reported_before_any_model(capsys, tmp_path, no_model, pipeline):
    cfg, out = tiny_config(tmp_path, pipeline)
    before = old_run(out)
    rc, _, err = run_main(capsys, "train", str(cfg), "rewards.0.name=clip_steerin", "overwrite=true")
    assert rc == 1
    one_error_line(err, str(cfg), "key 'rewards[0].name'", "unknown reward 'clip_steerin'", "Registered:")
    assert snapshot(out) == before


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_bad_reward_option_is_reported_before_any_model(capsys, tmp_path, no_model, pipeline):
    cfg, out = tiny_config(tmp_path, pipeline)
    before = old_run(out)
    rc, _, err = run_main(capsys, "train", str(cfg), "rewards.0.kwargs.bogus=1", "overwrite=true")
    assert rc == 1
    one_error_line(err, str(cfg), "key 'rewards[0].kwargs'", "unknown option(s) 'bogus'")
    assert snapshot(out) == before


@pytest.mark.parametrize(
    "override, key, words",
    [
        ("rewards.0.batch_size=0", "rewards[0].batch_size", "must be an integer >= 1"),
        ("rewards.0.timeout_s=-1", "rewards[0].timeout_s", "must be a finite number of seconds > 0"),
        ("rewards.0.device=cuda:1", "rewards[0].device", "takes no `device` option"),
    ],
)
def test_bad_per_reward_option_is_reported_before_any_model(capsys, tmp_path, no_model, override, key, words):
    cfg, _ = tiny_config(tmp_path, "text_reasoning")
    rc, _, err = run_main(capsys, "train", str(cfg), override, "overwrite=true")
    assert rc == 1
    one_error_line(err, str(cfg), f"key '{key}'", words)
    assert not (tmp_path / "models").exists()


def test_missing_required_reward_option_is_reported_before_the_reward_model(capsys, tmp_path, no_model):
    cfg, _ = tiny_config(tmp_path, "safe_diffusion")
    data = yaml.safe_load(cfg.read_text())
    del data["rewards"][0]["kwargs"]["unsafe_anchors"]
    cfg.write_text(yaml.safe_dump(data))
    rc, _, err = run_main(capsys, "train", str(cfg))
    assert rc == 1
    one_error_line(
        err, "key 'rewards[0].kwargs'", "reward 'clip_steering' needs the option(s) 'unsafe_anchors'"
    )


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_missing_model_folder_is_reported_before_loading(capsys, tmp_path, monkeypatch, no_model, pipeline):
    """The user's example: `model.name_or_path=assets/models/typo` with no tiny builder, relative to the
    working directory (here one that has assets/models/<pipeline>-tiny, so a close match is offered)."""
    cfg, out = tiny_config(tmp_path, pipeline)
    before = old_run(out)
    work = tmp_path / "work"
    (work / "assets" / "models" / f"{pipeline}-tiny").mkdir(parents=True)
    monkeypatch.chdir(work)
    rc, _, err = run_main(
        capsys,
        "train",
        str(cfg),
        f"model.name_or_path=assets/models/{pipeline}-tyny",
        "model.tiny_builder=null",
        "overwrite=true",
    )
    assert rc == 1
    one_error_line(
        err,
        str(cfg),
        "key 'model.name_or_path': no such model folder",
        f"'assets/models/{pipeline}-tyny'",
        f"looked for {work / 'assets' / 'models' / f'{pipeline}-tyny'}",
        "working directory",
        f"Did you mean 'assets/models/{pipeline}-tiny'?",
    )
    assert "Repo id must be" not in err
    assert snapshot(out) == before


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_hub_id_not_in_the_cache_offline(capsys, tmp_path, monkeypatch, no_model, pipeline):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    cfg, out = tiny_config(tmp_path, pipeline)
    before = old_run(out)
    monkeypatch.chdir(tmp_path)
    rc, _, err = run_main(
        capsys,
        "train",
        str(cfg),
        "model.name_or_path=nobody/no-such-model",
        "model.tiny_builder=null",
        "overwrite=true",
    )
    assert rc == 1
    one_error_line(
        err,
        "key 'model.name_or_path': 'nobody/no-such-model' is neither a local model folder",
        "nor a hub id that can be loaded offline",
        str(tmp_path / "hf-cache"),
        "HF_HUB_OFFLINE=1",
    )
    assert snapshot(out) == before


def test_hub_id_checks(tmp_path, monkeypatch):
    """Online, an id not in the cache may be downloaded; offline, an id in the cache passes; an invalid id
    that is no folder either fails whatever the mode. Nothing is looked up on the network."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    from mmalign.data import hub

    check = preflight.check_model_source
    monkeypatch.setattr(hub, "reach", lambda repo_id, timeout=5.0: None)  # the hub answers (no request made)
    assert check("org/online-model", key="model.name_or_path", source="c.yaml") == "download"
    with pytest.raises(
        ConfigError, match=r"c\.yaml: key 'model\.name_or_path': 'bad name!' is neither .* valid hub id"
    ):
        check("bad name!", key="model.name_or_path", source="c.yaml")

    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    with pytest.raises(ConfigError, match="TRANSFORMERS_OFFLINE=1"):
        check("org/cached-model", key="model.name_or_path", source="c.yaml")
    snap = cache / "models--org--cached-model" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "model_index.json").write_text("{}")  # a diffusers folder
    (cache / "models--org--cached-model" / "refs").mkdir()
    (cache / "models--org--cached-model" / "refs" / "main").write_text("abc123")
    check("org/cached-model", key="model.name_or_path", source="c.yaml")


@pytest.mark.parametrize(
    "name, local",
    [
        ("assets/models/typo", True),  # more than one '/'
        ("./typo", True),
        ("../typo", True),
        ("/abs/typo", True),
        ("~/typo", True),
        ("assets/typo", True),  # its first part is a folder here
        ("Qwen/Qwen2.5-0.5B-Instruct", False),
        ("gpt2", False),
    ],
)
def test_looks_local(tmp_path, monkeypatch, name, local):
    (tmp_path / "assets").mkdir()
    monkeypatch.chdir(tmp_path)
    assert preflight.looks_local(name) is local


def test_reward_model_folder_is_checked(capsys, tmp_path, no_model):
    cfg, _ = tiny_config(tmp_path, "safe_diffusion")
    missing = tmp_path / "clip-typo"
    rc, _, err = run_main(capsys, "train", str(cfg), f"rewards.0.kwargs.path={missing}")
    assert rc == 1
    one_error_line(err, "key 'rewards[0].kwargs.path': no such model folder", str(missing))


def test_reward_model_built_by_the_pipeline_is_not_flagged(tmp_path):
    """options.reward_models folders are built before the rewards load them: the check lets them pass."""
    cfg = load_config(tiny_config(tmp_path, "safe_diffusion")[0])
    assert not (tmp_path / "models" / "clip_shapes-tiny").exists()
    preflight.preflight(cfg, resume=False, eval_rewards=True)


def test_unknown_tiny_builder_is_reported_before_any_model(capsys, tmp_path, no_model):
    cfg, _ = tiny_config(tmp_path, "text_reasoning")
    rc, _, err = run_main(capsys, "train", str(cfg), "model.tiny_builder=text_reasonin")
    assert rc == 1
    one_error_line(
        err, "key 'model.tiny_builder'", "unknown tiny model builder 'text_reasonin'", "Did you mean"
    )


def test_eval_checks_eval_rewards_and_checkpoint_before_any_model(capsys, tmp_path, no_model):
    cfg, out = tiny_config(tmp_path, "safe_diffusion")
    before = old_run(out)
    rc, _, err = run_main(capsys, "eval", str(cfg), "eval.rewards.1.name=shapes_compositionl")
    assert rc == 1
    one_error_line(err, "key 'eval.rewards[1].name'", "unknown reward 'shapes_compositionl'")
    rc, _, err = run_main(capsys, "eval", str(cfg), "--checkpoint", str(tmp_path / "nope"))
    assert rc == 1
    one_error_line(err, "neither a checkpoint folder")
    rc, _, err = run_main(capsys, "sample", str(cfg), "--prompts", str(tmp_path / "nope.txt"))
    assert rc == 1
    one_error_line(err, f"{tmp_path / 'nope.txt'}")
    assert snapshot(out) == before


def test_bad_checkpoint_lists_the_checkpoints_of_the_run(capsys, tmp_path, no_model):
    """Issue 33 item 19: a --checkpoint that names nothing says which checkpoints the run has."""
    cfg, out = tiny_config(tmp_path, "text_reasoning")
    rc, _, err = run_main(capsys, "eval", str(cfg), "--checkpoint", str(tmp_path / "nope"))
    assert rc == 1
    one_error_line(
        err,
        "neither a checkpoint folder",
        f"{out / 'checkpoints'} holds no complete checkpoint",
        "--checkpoint base",
    )
    old_run(out)  # checkpoints/step_000002
    (out / "checkpoints" / "step_000004").mkdir()
    (out / "checkpoints" / "step_000004" / "COMPLETE").write_text("")
    (out / "checkpoints" / "step_000005").mkdir()  # incomplete: not offered
    rc, _, err = run_main(capsys, "sample", str(cfg), "--checkpoint", "step_000004")
    assert rc == 1
    ckpts = out / "checkpoints"
    line = one_error_line(
        err,
        "checkpoint 'step_000004': neither a checkpoint folder",
        f"The checkpoints of {out}: {ckpts / 'step_000002'}, {ckpts / 'step_000004'}; or --checkpoint latest",
    )
    assert "step_000005" not in line


def test_missing_config_file_suggests_close_names(capsys, monkeypatch, no_model):
    """Issue 33 item 19: a config path that does not exist gets the closest names of configs/."""
    monkeypatch.chdir(ROOT)
    rc, _, err = run_main(capsys, "train", "configs/text_reasoning_tiny.yaml")
    assert rc == 1
    one_error_line(
        err,
        "config file not found: configs/text_reasoning_tiny.yaml; did you mean configs/text_reasoning-tiny.yaml",
    )
    rc, _, err = run_main(capsys, "eval", "text_reasoning-tiny.yaml")  # the folder left out
    assert rc == 1
    one_error_line(
        err, "config file not found: text_reasoning-tiny.yaml; did you mean configs/text_reasoning-tiny.yaml"
    )
    rc, _, err = run_main(capsys, "sample", "configs/zzzz.yaml")  # nothing close: no suggestion
    assert rc == 1
    assert one_error_line(err).endswith("config file not found: configs/zzzz.yaml")


def test_real_command_fails_fast_and_keeps_the_run(tmp_path, run_mmalign):
    """The installed entry point, as a user runs it: no model is built (no models folder appears)."""
    cfg, out = tiny_config(tmp_path, "safe_diffusion")
    before = old_run(out)
    proc = run_mmalign("train", str(cfg), cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == ""
    one_error_line(proc.stderr, "already holds a run")
    assert snapshot(out) == before
    assert not (tmp_path / "models").exists()


# ----------------------------------------------------------------------------- rundir


def test_check_output_dir(tmp_path):
    cfg = load_config(tiny_config(tmp_path, "text_reasoning")[0])
    out = Path(cfg.output_dir)
    rundir.check_output_dir(cfg, resume=False)  # no folder yet
    out.mkdir()
    (out / "config.yaml").write_text(rundir.CONFIG_HEADER + "pipeline: text_reasoning\n")
    (out / "metrics.jsonl").write_text("")  # a run that ended before its first step: no rows to keep
    rundir.check_output_dir(cfg, resume=False)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="already holds a run"):
        rundir.check_output_dir(cfg, resume=False)
    cfg.overwrite = True
    rundir.check_output_dir(cfg, resume=False)
    with pytest.raises(ConfigError, match="--resume: no complete checkpoint"):
        rundir.check_output_dir(cfg, resume=True)
    for step in (2, 10):
        (out / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
        (out / "checkpoints" / f"step_{step:06d}" / "COMPLETE").write_text("")
    (out / "checkpoints" / "step_000011").mkdir()  # incomplete
    rundir.check_output_dir(cfg, resume=True)
    assert rundir.latest_checkpoint(out) == out / "checkpoints" / "step_000010"
    file_cfg = load_config(
        tiny_config(tmp_path, "text_reasoning")[0], [f"output_dir={out / 'metrics.jsonl'}"]
    )
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        rundir.check_output_dir(file_cfg, resume=False)


def test_a_folder_of_other_files_is_never_a_run_directory(tmp_path, capsys, no_model):
    """A non-empty output_dir that holds no mmalign run (a data folder, a home folder, a link to /etc, a user's own
    config.yaml) is refused with and without overwrite=true, before anything is written or removed; overwrite=true's
    `clear_run` refuses it too. A run's folder (header config, old runs' metrics rows, a complete checkpoint) and
    a folder holding only the run lock are accepted."""
    cfg_path, out = tiny_config(tmp_path, "text_reasoning")
    out.mkdir()
    (out / "samples").mkdir()  # names a run writes, but not a run's
    (out / "samples" / "holiday.png").write_bytes(b"png")
    (out / "metrics.jsonl").write_text("my,own,csv\n")
    (out / "config.yaml").write_text("lr: 3\n")
    before = snapshot(out)
    for extra in ([], ["overwrite=true"]):
        rc, _, err = run_main(capsys, "train", str(cfg_path), *extra)
        assert rc == 1
        one_error_line(err, "key 'output_dir'", f"{out} is not empty and holds no mmalign run", "config.yaml")
        assert snapshot(out) == before
    with pytest.raises(ConfigError, match="overwrite=true removes nothing"):
        rundir.clear_run(out)
    assert snapshot(out) == before
    link = tmp_path / "link"
    link.symlink_to(out, target_is_directory=True)
    assert "holds no mmalign run" in rundir.foreign_problem(link)

    assert rundir.foreign_problem(tmp_path / "absent") is None
    # `mmalign eval --checkpoint base` before the first run (the README's "before"): not a foreign folder
    readers = tmp_path / "evaluated"
    (readers / "samples_cli" / "base").mkdir(parents=True)
    (readers / "eval.json").write_text("{}")
    (readers / ".lock").write_text("{}")
    assert rundir.foreign_problem(readers) is None
    # the temp file of a run's atomic write (written now by the main process, or left by a kill): a run's
    (readers / ".config.yaml.tmp-4242").write_text(rundir.CONFIG_HEADER)
    (readers / ".metrics.jsonl.tmp-7").write_text("")
    (readers / ".eval.json.tmp-8").write_text("")  # an eval writing (or killed writing) its report
    (readers / f"{rundir.WRITE_TEST_PREFIX}x1y2").write_text("")  # another process's writability probe
    assert rundir.foreign_problem(readers) is None
    (readers / ".notes.txt.tmp-7").write_text("")  # not a name a run writes
    assert "holds no mmalign run (it has .notes.txt.tmp-7)" in rundir.foreign_problem(readers)
    (out / "config.yaml").write_text(rundir.CONFIG_HEADER + "pipeline: text_reasoning\n")
    assert rundir.holds_run(out) and rundir.foreign_problem(out) is None
    old = tmp_path / "old"
    old_run(old, checkpoint=False)  # written before the header: recognised by its metrics rows
    assert rundir.holds_run(old)
    (old / "metrics.jsonl").write_text("")
    assert not rundir.holds_run(old)
    (old / "checkpoints" / "step_000001").mkdir(parents=True)
    (old / "checkpoints" / "step_000001" / "COMPLETE").write_text("1")
    assert rundir.holds_run(old)


# ----------------------------------------------------------------------------- first-run progress


def test_build_announces_itself_and_names_each_phase(tmp_path, capsys, monkeypatch):
    def fake(path: Path) -> None:
        for _ in tiny.progress_bar(range(3), "first loop"):
            pass
        for _ in tiny.progress_bar(range(2), "second loop"):
            pass
        (path / "config.json").write_text("{}")

    tiny.load_builders()
    monkeypatch.setitem(tiny.BUILDERS._items, "zz_fake", fake)
    monkeypatch.setitem(tiny.BUILDERS._meta, "zz_fake", {"minutes": 2, "phases": 2})
    tiny.build("zz_fake", tmp_path / "fake-tiny")
    err = capsys.readouterr().err
    assert (
        f"building tiny model 'zz_fake' at {tmp_path / 'fake-tiny'} (first run only; about 2 min on 2 idle CPU cores)"
        in err
    )
    assert "building tiny model fake-tiny: first loop (1/2)" in err
    assert "building tiny model fake-tiny: second loop (2/2)" in err
    assert "3/3 [" in err and "2/2 [" in err  # tqdm's counts (and elapsed<remaining) are shown
    assert f"built tiny model 'zz_fake' at {tmp_path / 'fake-tiny'} in " in err
    assert (tmp_path / "fake-tiny" / "config.json").is_file()


def test_every_builder_has_an_estimate():
    for name in tiny.load_builders():
        assert tiny.estimate(name).startswith("about "), name


def test_real_builder_loops_report_progress(tmp_path, capsys, monkeypatch):
    """The shapes builder's two loops (VAE, transformer) and the CLIP builder's loop, shortened."""
    from mmalign.tiny.clip import train_tiny_clip
    from mmalign.tiny.shapes import build_text_to_image

    def quick(path: Path) -> None:
        build_text_to_image(path, vae_steps=2, steps=2, batch_size=4, target_reward=None)

    tiny.load_builders()
    monkeypatch.setitem(tiny.BUILDERS._items, "zz_quick_shapes", quick)
    monkeypatch.setitem(tiny.BUILDERS._meta, "zz_quick_shapes", dict(tiny.BUILDERS.meta("text_to_image")))
    tiny.build("zz_quick_shapes", tmp_path / "shapes-tiny")
    err = capsys.readouterr().err
    assert "building tiny model shapes-tiny: VAE warm start (1/2)" in err
    assert "building tiny model shapes-tiny: transformer warm start (2/2)" in err

    train_tiny_clip(steps=2, batch_size=8)  # called directly: quiet, as before
    assert "CLIP" not in capsys.readouterr().err
    with tiny._building("clip-tiny", 1):
        train_tiny_clip(steps=2, batch_size=8)
    assert "building tiny model clip-tiny: CLIP on the shapes world (1/1)" in capsys.readouterr().err
