"""Issue 23 (prompts, output directory): the tester's probes re-run through the real command. A prompt too long
for the model's context, an empty prompt, too few distinct prompts and an unwritable ``output_dir`` are found by
the validation pass (`mmalign.app.preflight`) before any model loads; ``data.too_long: skip | truncate``
change the rows the trainer gets. Issue 33: an over-long line and an image that does not decode are refused
naming file and line; distinct prompts count their images."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from mmalign.app import preflight
from mmalign.app.cli import main
from mmalign.config import load_config
from mmalign.data.rows import DataError, load_rows
from mmalign.errors import MmalignError

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = 256
"""max_position_embeddings of the random tiny text model (`mmalign.tiny.tiny_causal_lm`)."""
LONG = " ".join(["word"] * 9000)
"""The tester's 9,000-word prompt."""


class _Stop(MmalignError):
    """Raised in place of training once the trainer's components are captured."""


@pytest.fixture
def trainer_rows(monkeypatch):
    """What `mmalign train` hands the trainer: the components are captured and the command stops there."""
    import mmalign.app.run

    seen: dict[str, Any] = {}

    def capture(cfg: Any, components: Any, **kwargs: Any) -> None:
        seen["components"] = components
        raise _Stop("stopped before training")

    monkeypatch.setattr(mmalign.app.run, "build_trainer", capture)
    return seen


def write_rows(path: Path, questions: list[str]) -> Path:
    path.write_text("".join(json.dumps({"question": q, "answer": "3"}) + "\n" for q in questions))
    return path


def make_config(tmp_path: Path, model: Path, train: Path, **overrides: Any) -> Path:
    """A text_reasoning config on the random tiny model (no tiny builder), output_dir tmp_path/run."""
    data: dict[str, Any] = {
        "pipeline": "text_reasoning",
        "output_dir": str(tmp_path / "run"),
        "model": {"name_or_path": str(model), "tiny_builder": None},
        "data": {"train": str(train), "prompt_template": "Q: {question} = ?\nA:"},
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 12},
        "rewards": [{"name": "answer_accuracy", "kwargs": {"extract": "tag", "mode": "numeric"}}],
        "trainer": {"steps": 1},
    }
    for key, value in overrides.items():
        section, name = key.split("__")
        data[section][name] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_main(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().err


def one_error_line(err: str, *fragments: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert lines and lines[-1].startswith("mmalign: error: "), err
    for f in fragments:
        assert f in lines[-1], (f, err)
    return lines[-1]


def tokens(components: Any, prompt: str) -> int:
    return len(components.policy._prompt_token_ids(prompt))


# ----------------------------------------------------------------------------- too long


def test_long_prompt_is_an_error_naming_line_and_length_before_any_model(
    capsys, tmp_path, no_model, random_text_model_dir
):
    train = write_rows(tmp_path / "train.jsonl", ["1 + 2", LONG, "3 + 4"])
    cfg = make_config(tmp_path, random_text_model_dir, train)
    start = time.monotonic()
    rc, err = run_main(capsys, "train", str(cfg))
    took = time.monotonic() - start
    line = one_error_line(err, f"{train}:2", "tokens", f"context of {CONTEXT} tokens", "data.too_long")
    assert rc == 1
    n = int(line.split("the prompt is ")[1].split(" tokens")[0])
    assert n > CONTEXT
    assert took < 30, took  # the tokenizer and config only (the tester's run took minutes, or 41 GB)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_long_eval_prompt_is_reported_by_eval(capsys, tmp_path, no_model, random_text_model_dir):
    train = write_rows(tmp_path / "train.jsonl", ["1 + 2", "3 + 4"])
    evals = write_rows(tmp_path / "eval.jsonl", ["5 + 1", LONG])
    cfg = make_config(tmp_path, random_text_model_dir, train, data__eval=str(evals))
    rc, err = run_main(capsys, "eval", str(cfg), "--checkpoint", "base")
    assert rc == 1
    one_error_line(err, f"{evals}:2", f"context of {CONTEXT} tokens")


def test_max_new_tokens_counts_toward_the_context(capsys, tmp_path, no_model, random_text_model_dir):
    train = write_rows(tmp_path / "train.jsonl", ["1 + 2", "3 + 4"])
    cfg = make_config(tmp_path, random_text_model_dir, train)
    rc, err = run_main(capsys, "train", str(cfg), f"rollout.max_new_tokens={CONTEXT}")
    assert rc == 1
    one_error_line(err, f"{train}:1", f"rollout.max_new_tokens ({CONTEXT})")


def test_too_long_skip_drops_the_row_and_counts_it(
    capsys, caplog, tmp_path, trainer_rows, random_text_model_dir
):
    train = write_rows(tmp_path / "train.jsonl", ["1 + 2", LONG, "3 + 4"])
    cfg = make_config(tmp_path, random_text_model_dir, train)
    with caplog.at_level(logging.WARNING, logger="mmalign.app.preflight"):
        rc, err = run_main(capsys, "train", str(cfg), "data.too_long=skip")
    assert rc == 1 and "stopped before training" in err, err
    rows = trainer_rows["components"].data
    assert [r["_source"] for r in rows] == [f"{train}:1", f"{train}:3"]
    warned = [r.getMessage() for r in caplog.records if "data.too_long: skip" in r.getMessage()]
    assert len(warned) == 1 and "dropped 1 of 3 rows" in warned[0] and f"{train}:2" in warned[0], warned


def test_too_long_truncate_cuts_the_start_so_it_fits(
    capsys, caplog, tmp_path, trainer_rows, random_text_model_dir
):
    train = write_rows(tmp_path / "train.jsonl", ["1 + 2", LONG + " 7 + 8", "3 + 4"])
    cfg = make_config(tmp_path, random_text_model_dir, train)
    with caplog.at_level(logging.WARNING, logger="mmalign.app.preflight"):
        rc, err = run_main(capsys, "train", str(cfg), "data.too_long=truncate")
    assert rc == 1 and "stopped before training" in err, err
    components = trainer_rows["components"]
    rows = components.data
    assert len(rows) == 3
    assert rows[0]["prompt"] == "Q: 1 + 2 = ?\nA:"
    cut = rows[1]["prompt"]
    assert cut.endswith("word 7 + 8 = ?\nA:") and len(cut) < len(LONG)  # the start goes, the end stays
    n = tokens(components, cut)
    assert CONTEXT - 12 - 8 <= n <= CONTEXT - 12, n  # fits, and not much shorter than it may be
    assert any("truncated at the start 1 of 3 rows" in r.getMessage() for r in caplog.records)


def test_prompt_that_fits_is_left_alone(capsys, tmp_path, trainer_rows, random_text_model_dir):
    train = write_rows(tmp_path / "train.jsonl", ["1 + 2", "3 + 4"])
    cfg = make_config(tmp_path, random_text_model_dir, train)
    rc, err = run_main(capsys, "train", str(cfg), "data.too_long=truncate")
    assert rc == 1 and "stopped before training" in err, err
    assert [r["prompt"] for r in trainer_rows["components"].data] == ["Q: 1 + 2 = ?\nA:", "Q: 3 + 4 = ?\nA:"]


def test_preflight_counts_as_the_policy_encodes(tmp_path, random_text_model_dir):
    """The tokenizer-only count equals the loaded policy's own encoding, chat template and system prompt included."""
    from mmalign.policies.text import TextPolicy

    train = write_rows(tmp_path / "train.jsonl", ["1 + 2"])
    cfg = load_config(
        make_config(tmp_path, random_text_model_dir, train),
        ["model.use_chat_template=true", "model.system_prompt=Answer in tags."],
    )
    lengths = preflight.prompt_lengths_for(cfg)
    assert lengths is not None and lengths.context == CONTEXT and not lengths.vlm
    policy = TextPolicy.from_pretrained(
        str(random_text_model_dir), use_chat_template=True, system_prompt="Answer in tags."
    )
    for prompt in ["Q: 1 + 2 = ?\nA:", LONG[:400]]:
        assert lengths.count({"prompt": prompt}) == len(policy._prompt_token_ids(prompt))
    assert lengths.count({"prompt": "x"}) > len(policy.tokenizer("x")["input_ids"])  # the template counts


def test_model_a_tiny_builder_has_yet_to_build_is_checked_once_loaded(
    tmp_path, caplog, random_text_model_dir
):
    """No tokenizer before the tiny builder runs: the preflight says so (debug) and `fit_setup` checks the
    built rows with the loaded policy."""
    from mmalign.policies.text import TextPolicy

    train = write_rows(tmp_path / "train.jsonl", ["1 + 2", LONG])
    path = make_config(tmp_path, tmp_path / "not-built-yet", train)
    cfg = load_config(path, ["model.tiny_builder=text_reasoning"])
    with caplog.at_level(logging.DEBUG, logger="mmalign.app.preflight"):
        assert preflight.prompt_lengths_for(cfg) is None
    assert any("tiny_builder" in r.getMessage() for r in caplog.records)
    preflight.check_prompts(cfg, training=True)  # nothing to measure with yet
    rows = [{"prompt": "Q: 1 + 2 = ?\nA:", "_source": "t:1"}, {"prompt": LONG, "_source": "t:2"}]
    components = SimpleNamespace(policy=TextPolicy.from_pretrained(str(random_text_model_dir)), data=rows)
    with pytest.raises(DataError, match="t:2: the prompt is .* tokens"):
        preflight.fit_setup(cfg, components)
    skip = load_config(path, ["data.too_long=skip", "model.tiny_builder=text_reasoning"])
    assert [r["_source"] for r in preflight.fit_setup(skip, components).data] == ["t:1"]


def test_diffusion_model_folder_is_not_measured(tmp_path):
    """No transformers config.json with a context length: no length check (and no error)."""
    (tmp_path / "sd").mkdir()
    (tmp_path / "sd" / "model_index.json").write_text("{}")
    train = write_rows(tmp_path / "train.jsonl", ["a red cube"])
    cfg = load_config(make_config(tmp_path, tmp_path / "sd", train), [])
    assert preflight.prompt_lengths_for(cfg) is None


def test_vlm_count_includes_the_image_tokens(tmp_path, random_vlm_model_dir):
    """VLM rows: the processor's chat template plus each image's tokens (from its header), as `encode_row`."""
    from mmalign.policies.vlm import VLMPolicy

    data = yaml.safe_load((ROOT / "configs" / "vlm_reasoning-tiny.yaml").read_text())
    data["model"] = {"name_or_path": str(random_vlm_model_dir), "tiny_builder": None}
    data["output_dir"] = str(tmp_path / "run")
    data["data"]["train"] = str(ROOT / data["data"]["train"])
    data["options"]["image_root"] = str(ROOT / data["options"]["image_root"])
    path = tmp_path / "vlm.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    cfg = load_config(path, ["options.max_pixels=12544", "options.min_pixels=12544"])  # 112 x 112: 16 tokens
    lengths = preflight.prompt_lengths_for(cfg)
    assert lengths is not None and lengths.vlm
    row = load_rows(cfg.data.train, cfg.data.prompt_template, 1)[0]
    policy = VLMPolicy.from_pretrained(str(random_vlm_model_dir), min_pixels=12544, max_pixels=12544)
    resolved = {**row, "images": [str(Path(cfg.options.image_root) / p) for p in row["images"]]}
    real = int(policy.encode_row(resolved)["input_ids"].shape[0])
    assert lengths.count(row) == real
    assert preflight.policy_prompt_lengths(cfg, policy).count(resolved) == real
    assert real > lengths.count({"prompt": row["prompt"]}) + 10  # the image tokens are counted


# ----------------------------------------------------------------------------- empty and too few prompts


def test_empty_prompt_is_an_error_naming_the_row(capsys, tmp_path, no_model, random_text_model_dir):
    train = write_rows(tmp_path / "train.jsonl", ["1 + 2", "   ", "3 + 4"])
    cfg = make_config(tmp_path, random_text_model_dir, train, data__prompt_template="{question}")
    rc, err = run_main(capsys, "train", str(cfg))
    assert rc == 1
    one_error_line(err, f"{train}:2", "empty", "data.prompt_template")


def test_empty_prompt_column_is_reported_by_sample(capsys, tmp_path, no_model, random_text_model_dir):
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "hello"}\n\n{"prompt": ""}\n')
    cfg = make_config(tmp_path, random_text_model_dir, train, data__prompt_template="{question}")
    rc, err = run_main(capsys, "sample", str(cfg), "--checkpoint", "base")
    assert rc == 1
    one_error_line(err, f"{train}:3", "empty")


def test_one_row_for_many_prompts_per_step_warns(
    capsys, caplog, tmp_path, trainer_rows, random_text_model_dir
):
    train = write_rows(tmp_path / "train.jsonl", ["1 + 2"])
    cfg = make_config(tmp_path, random_text_model_dir, train)
    with caplog.at_level(logging.WARNING, logger="mmalign.app.preflight"):
        rc, err = run_main(capsys, "train", str(cfg), "rollout.prompts_per_step=16")
    assert rc == 1 and "stopped before training" in err, err  # (a warning: the run goes on)
    warned = [r.getMessage() for r in caplog.records if "distinct prompt" in r.getMessage()]
    assert (
        len(warned) == 1
        and "1 distinct prompt(s)" in warned[0]
        and "rollout.prompts_per_step (16)" in warned[0]
    )


def test_one_row_for_many_prompts_per_step_is_an_error_when_asked(
    capsys, tmp_path, no_model, random_text_model_dir
):
    train = write_rows(tmp_path / "train.jsonl", ["1 + 2", "1 + 2"])
    cfg = make_config(tmp_path, random_text_model_dir, train)
    rc, err = run_main(capsys, "train", str(cfg), "rollout.prompts_per_step=16", "data.too_few_prompts=error")
    assert rc == 1
    one_error_line(err, str(train), "1 distinct prompt(s) (2 rows)", "rollout.prompts_per_step (16)")


def vlm_tiny_config(tmp_path: Path, train: Path | None = None, **options: Any) -> Path:
    """configs/vlm_reasoning-tiny.yaml with absolute paths (its own data unless `train`), output_dir in tmp_path."""
    data = yaml.safe_load((ROOT / "configs" / "vlm_reasoning-tiny.yaml").read_text())
    data["output_dir"] = str(tmp_path / "run")
    data["model"]["name_or_path"] = str(ROOT / data["model"]["name_or_path"])
    data["data"]["train"] = str(train or ROOT / data["data"]["train"])
    data["options"]["image_root"] = str(train.parent if train else ROOT / data["options"]["image_root"])
    data["options"].update(options)
    path = tmp_path / "vlm.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_the_same_question_about_different_images_is_a_distinct_prompt(tmp_path, caplog):
    """vlm_reasoning-tiny asks one question about 64 pictures: 64 distinct prompts, not 1 (it warned, and
    ``data.too_few_prompts: error`` refused this valid dataset)."""
    cfg = load_config(vlm_tiny_config(tmp_path), ["data.too_few_prompts=error"])
    rows = load_rows(cfg.data.train, cfg.data.prompt_template)
    assert len({r["prompt"] for r in rows}) == 1 and len(rows) == 64
    with caplog.at_level(logging.WARNING, logger="mmalign.app.preflight"):
        preflight.check_distinct_prompts(cfg, rows)
    assert not caplog.records
    same_image = [{**r, "images": rows[0]["images"]} for r in rows]  # the same picture every time: 1 prompt
    with pytest.raises(DataError, match=r"1 distinct prompt\(s\) \(64 rows\)"):
        preflight.check_distinct_prompts(cfg, same_image)


def test_enough_distinct_prompts_say_nothing(tmp_path, caplog, random_text_model_dir):
    train = write_rows(tmp_path / "train.jsonl", ["1 + 2", "3 + 4"])
    cfg = load_config(make_config(tmp_path, random_text_model_dir, train), [])
    with caplog.at_level(logging.WARNING, logger="mmalign.app.preflight"):
        preflight.check_prompts(cfg, training=True)
    assert not caplog.records


# ----------------------------------------------------------------------------- output directory


def test_output_dir_under_a_file_is_an_error_naming_the_path(
    capsys, tmp_path, no_model, random_text_model_dir
):
    # (tests run as root, where a chmod'ed parent does not stop writes; a path under a regular file does)
    train = write_rows(tmp_path / "train.jsonl", ["1 + 2", "3 + 4"])
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    cfg = make_config(tmp_path, random_text_model_dir, train)
    rc, err = run_main(capsys, "train", str(cfg), f"output_dir={blocker}/run")
    assert rc == 1
    one_error_line(err, "'output_dir'", f"{blocker}/run")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder anyway")
def test_read_only_output_dir_is_an_error_naming_the_path(capsys, tmp_path, no_model, random_text_model_dir):
    train = write_rows(tmp_path / "train.jsonl", ["1 + 2", "3 + 4"])
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        cfg = make_config(tmp_path, random_text_model_dir, train)
        rc, err = run_main(capsys, "train", str(cfg), f"output_dir={parent}/run")
    finally:
        parent.chmod(0o700)
    assert rc == 1
    one_error_line(err, "'output_dir'", f"{parent}/run")


def test_missing_output_dir_is_created_and_left_clean(tmp_path):
    cfg = SimpleNamespace(output_dir=str(tmp_path / "a" / "b"), source="x.yaml")
    preflight.check_output_writable(cfg)  # type: ignore[arg-type]
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())


# ----------------------------------------------------------------------------- images that do not decode


def write_scans(folder: Path, n: int = 4, truncated: int | None = 3) -> Path:
    """A tiny grounding dataset like medloc-tiny's: `n` noisy 64x64 PNG scans, one row each, the image of row
    `truncated` (1-based) cut to half its bytes (PIL opens it, `load` fails: "image file is truncated")."""
    import numpy as np
    from PIL import Image

    (folder / "images").mkdir(parents=True)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(1, n + 1):
        image = folder / "images" / f"scan_{i}.png"
        Image.fromarray((rng.random((64, 64, 3)) * 255).astype("uint8")).save(image)
        if i == truncated:
            image.write_bytes(image.read_bytes()[: image.stat().st_size // 2])
        row = {"image": f"images/scan_{i}.png", "expression": f"lesion {i}", "boxes": [[10, 10, 30, 30]]}
        lines.append(json.dumps(row) + "\n")
    path = folder / "train.jsonl"
    path.write_text("".join(lines))
    return path


def medloc_config(tmp_path: Path, model: Path, train: Path) -> Path:
    """configs/medloc-tiny.yaml on `model` (no tiny builder) and `train` (no eval data), output_dir in tmp_path."""
    data = yaml.safe_load((ROOT / "configs" / "medloc-tiny.yaml").read_text())
    data["output_dir"] = str(tmp_path / "run")
    data["model"] = {"name_or_path": str(model), "tiny_builder": None, "dtype": "float32"}
    data["data"] = {"train": str(train), "prompt_template": data["data"]["prompt_template"]}
    data["rollout"]["prompts_per_step"] = 2
    path = tmp_path / "medloc.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_truncated_scan_is_refused_naming_file_row_and_image_before_any_model(
    capsys, tmp_path, no_model, random_vlm_model_dir
):
    train = write_scans(tmp_path / "data")
    rc, err = run_main(capsys, "train", str(medloc_config(tmp_path, random_vlm_model_dir, train)))
    assert rc == 1
    line = one_error_line(err, f"{train}:3:", "scan_3.png", "cannot be decoded", "truncated")
    assert "options.on_bad_row: skip" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_truncated_picture_of_a_vlm_dataset_is_refused_by_eval_too(capsys, tmp_path, no_model):
    data = tmp_path / "data"
    write_scans(data)
    train = data / "vqa.jsonl"
    train.write_text(
        "".join(
            json.dumps({"images": [f"images/scan_{i}.png"], "question": "Colour?", "answer": "red"}) + "\n"
            for i in range(1, 5)
        )
    )
    rc, err = run_main(capsys, "eval", str(vlm_tiny_config(tmp_path, train)), "--checkpoint", "base")
    assert rc == 1
    one_error_line(err, f"{train}:3:", "scan_3.png", "cannot be decoded")


def test_image_check_stops_at_its_time_budget(tmp_path, monkeypatch, caplog, random_vlm_model_dir):
    """No time left: nothing is decoded (the truncated scan passes) and an info line says how many were not."""
    train = write_scans(tmp_path / "data")
    cfg = load_config(medloc_config(tmp_path, random_vlm_model_dir, train), [])
    monkeypatch.setattr(preflight, "IMAGE_CHECK_SECONDS", 0.0)
    with caplog.at_level(logging.INFO, logger="mmalign.app.preflight"):
        preflight.check_prompts(cfg, training=True)
    assert any("decoded 0 of the 4 images of data.train" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(preflight, "IMAGE_CHECK_SECONDS", 60.0)
    with pytest.raises(DataError, match="scan_3.png cannot be decoded"):
        preflight.check_prompts(cfg, training=True)


def test_skip_leaves_the_truncated_scan_out_naming_it(
    capsys, caplog, tmp_path, trainer_rows, random_vlm_model_dir
):
    train = write_scans(tmp_path / "data")
    cfg = medloc_config(tmp_path, random_vlm_model_dir, train)
    with caplog.at_level(logging.WARNING):
        rc, err = run_main(capsys, "train", str(cfg), "options.on_bad_row=skip")
    assert rc == 1 and "stopped before training" in err, err
    assert [r["_source"] for r in trainer_rows["components"].data] == [f"{train}:{i}" for i in (1, 2, 4)]
    skipped = [r.getMessage() for r in caplog.records if "skipping a bad row" in r.getMessage()]
    assert len(skipped) == 1 and f"{train}:3:" in skipped[0] and "scan_3.png" in skipped[0], skipped


def test_a_scan_that_fails_to_decode_in_training_names_file_and_row(tmp_path, random_vlm_model_dir):
    """What the validation pass did not decode (its time ran out) still names the row when the policy reads it."""
    from mmalign.policies.vlm import VLMPolicy

    train = write_scans(tmp_path / "data")
    policy = VLMPolicy.from_pretrained(str(random_vlm_model_dir))
    image = str(train.parent / "images" / "scan_3.png")
    row = {"prompt": "Locate lesion 3.", "images": [image], "_source": f"{train}:3"}
    with pytest.raises(
        DataError, match=rf"^{train}:3: image {image} cannot be decoded \(OSError: image file is"
    ):
        policy.encode_row(row)
    assert policy.encode_row({**row, "images": [image.replace("_3", "_1")]})["input_ids"].numel() > 0
