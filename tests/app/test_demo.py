"""The sample-comparison app (`mmalign.app.demo`): its data layer on synthetic run directories of every sample
kind (text, image, video, boxes, latents only), a run that grows while the app reads it, generation on
demand through `mmalign sample`'s path (its caps on ``n`` and on the size of ``demo_samples/``), the command
line, and the file route that serves only what the app shows, never ``config.yaml`` or checkpoints (HTTP
tests against the running app)."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from mmalign.app import demo
from mmalign.training import rundir
from rewards import Reward, RewardBatch, register_reward
from tests.app.demo_support import (
    call_api,
    fake_cmd_sample,
    file_route,
    free_port,
    http_get,
    rows_for,
    write_step,
)


@pytest.fixture
def image_run(tmp_path: Path) -> Path:
    run = tmp_path / "img_run"
    for step in (1, 2):
        rows = rows_for(step)
        views = [{"image": torch.rand(3, 8, 8)} for _ in rows]
        write_step(run, step, rows, views)
    return run


def test_steps_groups_and_reward_table(image_run: Path) -> None:
    assert demo.list_steps(image_run) == [1, 2]
    assert demo.list_groups(image_run, 2) == [(0, "prompt 0"), (1, "prompt 1")]
    samples = demo.load_group(image_run, 2, 1)
    assert len(samples) == 2 and all(s["prompt"] == "prompt 1" for s in samples)
    headers, rows = demo.reward_table(samples)
    assert headers == ["sample", "quality", "format", "advantage"]
    assert rows[1] == [1, "0.4500", "1.0000", "-1.0000"]
    images, videos = demo.media_items(samples)
    assert len(images) == 2 and not videos
    assert all(Path(p).is_file() and Path(p).is_relative_to(image_run) for p, _ in images)
    assert "quality=0.450" in images[1][1] and "adv=-1.000" in images[1][1]
    oh, orows = demo.group_overview(image_run, 2)
    assert oh[:3] == ["group", "samples", "quality (mean)"] and [r[0] for r in orows] == [0, 1]
    assert demo.find_group(image_run, 2, "prompt 1") == 1 and demo.find_group(image_run, 2, "nope") is None
    assert demo.list_groups(image_run, 99) == []  # a step without samples: nothing, no error


def test_text_rows_have_a_text_column(tmp_path: Path) -> None:
    run = tmp_path / "text_run"
    rows = [{**r, "text": f" <answer>{i}</answer>", "answer": "3"} for i, r in enumerate(rows_for(1))]
    write_step(run, 1, rows)
    samples = demo.load_group(run, 1, 0)
    headers, table = demo.reward_table(samples)
    assert headers[-1] == "text" and table[1][-1] == " <answer>1</answer>"
    assert demo.row_columns(samples) == {"answer": "3"}
    assert demo.media_items(samples) == ([], [])
    assert demo.box_annotations(samples[0]) is None


def test_video_rows_list_the_mp4_and_its_frame_strip(tmp_path: Path) -> None:
    run = tmp_path / "video_run"
    rows = rows_for(1, groups=1)
    write_step(run, 1, rows, [{"video": torch.rand(3, 3, 8, 8)} for _ in rows])
    images, videos = demo.media_items(demo.load_group(run, 1, 0))
    assert [Path(p).suffix for p, _ in videos] == [".mp4", ".mp4"]
    assert all(Path(p).name.endswith("_frames.png") for p, _ in images)


def test_latent_only_rows_still_show_rewards(tmp_path: Path) -> None:
    run = tmp_path / "latent_run"
    write_step(run, 1, rows_for(1, groups=1))  # video_geometry without decoding: no media, no text
    samples = demo.load_group(run, 1, 0)
    assert demo.media_items(samples) == ([], [])
    assert demo.reward_table(samples)[0] == ["sample", "quality", "format", "advantage"]


def test_boxes_reference_and_prediction(tmp_path: Path) -> None:
    # grounding (medloc): reference boxes in the row, the prediction parsed from the text
    sample = {"boxes": [[10.0, 12.0, 30.0, 40.0]], "text": "<answer>[11,13,29,41]</answer>", "rewards": {}}
    base, labels = demo.box_annotations(sample)
    assert [lab for _, lab in labels] == ["reference", "predicted"]
    # no input image in the row: a canvas holding the boxes, scaled up together with them (>= 256 px)
    h, w, _ = base.shape
    scale = labels[0][0][2] / 30
    assert max(h, w) >= 256 and scale > 1
    assert all(abs(a - v * scale) <= 1 for a, v in zip(labels[1][0], (11, 13, 29, 41)))
    assert all(b[2] <= w and b[3] <= h for b, _ in labels)
    # model coords "resized" with the sizes in the row: converted to original pixels
    sized = {**sample, "image_width": 100, "image_height": 100, "resized_width": 50, "resized_height": 50}
    boxes, converted = demo.predicted_boxes(sized, "resized")
    assert converted and boxes == [[22.0, 26.0, 58.0, 82.0]]
    # without sizes: drawn as written, and the label says so
    _, labels = demo.box_annotations(sample, "resized")
    assert labels[-1][1] == "predicted (resized)"
    # GeoViS: the answer box of the environment state (original pixels)
    geo = {
        "boxes": [[0, 0, 5, 5]],
        "text": "<crop>[0,0,9,9]</crop>",
        "env_state": {"answer_box": [1, 1, 4, 4]},
    }
    assert demo.predicted_boxes(geo) == ([[1.0, 1.0, 4.0, 4.0]], True)
    # an image sample with boxes is drawn on its image
    run = tmp_path / "boxes_run"
    write_step(run, 1, [{**rows_for(1, 1, 1)[0], "boxes": [[1, 1, 4, 4]]}], [{"image": torch.rand(3, 8, 8)}])
    base, _ = demo.box_annotations(demo.load_group(run, 1, 0)[0])
    assert isinstance(base, str) and Path(base).is_file()


def test_box_coords_come_from_the_run_config(tmp_path: Path) -> None:
    (tmp_path / rundir.CONFIG_FILE).write_text(
        yaml.safe_dump({"rewards": [{"name": "format"}, {"name": "iou_at", "kwargs": {"coords": "resized"}}]})
    )
    assert demo.box_coords(tmp_path) == "resized"
    assert demo.box_coords(tmp_path / "missing") == "absolute"


def test_a_run_still_training_shows_new_steps(image_run: Path) -> None:
    """What the app's timer re-reads: a step written after the first read appears in every view."""
    keys = demo.metric_keys([image_run])
    assert "reward/mean" in keys and "loss" in keys and "kl" not in keys  # None values are not curves
    before = demo.curve_rows([image_run], ["reward/mean"])
    assert [r["step"] for r in before] == [1, 2]
    assert "last step 2" in demo.run_status(image_run)
    write_step(image_run, 3, rows_for(3), [{"image": torch.rand(3, 8, 8)} for _ in range(4)])
    assert demo.list_steps(image_run) == [1, 2, 3]
    assert [r["step"] for r in demo.curve_rows([image_run], ["reward/mean"])] == [1, 2, 3]
    assert "last step 3" in demo.run_status(image_run)
    assert len(demo.media_items(demo.load_group(image_run, 3, 0))[0]) == 2
    # a samples file still being written (a partial last line) is read as "no samples yet", not an error
    rundir.samples_file(image_run, 4).write_text('{"group": 0, "prompt"')
    assert demo.list_groups(image_run, 4) == []


def test_curves_of_two_runs_are_labelled_by_run(image_run: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    write_step(other, 1, rows_for(1))
    rows = demo.curve_rows([image_run, other], ["loss"])
    assert {r["series"] for r in rows} == {"img_run: loss", "other: loss"}
    rk, dk = demo.default_curve_keys(
        ["reward/mean", "reward/quality/mean", "reward/quality/std", "loss", "kl"]
    )
    assert rk == ["reward/mean", "reward/quality/mean"] and dk == ["loss", "kl"]


def test_gold_curve_beside_the_training_curve(image_run: Path) -> None:
    """A run with the over-optimisation watchdog: the reward plot shows the held-out gold reward and the held-out
    training reward by default, read from the watchdog's log (every evaluation, the base model's at step 0
    included), beside reward/mean."""
    from mmalign.app import overopt
    from mmalign.app.overopt import Evaluation, WatchdogState

    state = WatchdogState()
    with (image_run / overopt.LOG_FILE).open("w") as f:
        for step, gold, train in [(0, 0.5, 0.1), (2, 0.3, 0.4)]:
            rec = state.observe(Evaluation(step=step, gold={"g": gold}, gold_total=gold, train_total=train))
            f.write(json.dumps(rec) + "\n")
    keys = demo.metric_keys([image_run])
    assert "watchdog/gold" in keys and "watchdog/train_reward" in keys
    rk, _ = demo.default_curve_keys(keys)
    assert rk[0] == "reward/mean" and rk[-2:] == ["watchdog/gold", "watchdog/train_reward"]
    rows = demo.curve_rows([image_run], ["reward/mean", "watchdog/gold"])
    gold = [(r["step"], r["value"]) for r in rows if r["series"] == "watchdog/gold"]
    assert gold == [(0, 0.5), (2, 0.3)]
    assert [r["step"] for r in rows if r["series"] == "reward/mean"] == [1, 2]


def test_checkpoint_choices(image_run: Path) -> None:
    ck = rundir.checkpoint_dir(image_run, 2)
    ck.mkdir(parents=True)
    (ck / rundir.COMPLETE_MARK).write_text("2")
    rundir.checkpoint_dir(image_run, 3).mkdir()  # incomplete: not offered
    assert demo.checkpoint_choices(image_run) == [
        ("latest checkpoint", "latest"),
        ("base model", "base"),
        ("step_000002", str(ck)),
    ]


def test_generate_goes_through_cmd_sample_and_is_reused(image_run: Path) -> None:
    (image_run / rundir.CONFIG_FILE).write_text("pipeline: text_to_image\n")
    calls: list[argparse.Namespace] = []

    def fake_sample(args: argparse.Namespace) -> int:
        calls.append(args)
        out = Path(args.out)
        rows = []
        for i in range(args.n * len(args.prompt)):
            view = rundir.store_media({"image": torch.rand(3, 4, 4)}, out / "media", f"000_{i:02d}", out)
            rows.append({"prompt": args.prompt[i // args.n], "sample": i % args.n, **view})
        (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return 0

    label, rows = demo.generate_samples(image_run, "latest", ["a", "b"], 2, 7, sample_fn=fake_sample)
    (args,) = calls
    assert args.config == str(image_run.resolve() / "config.yaml") and args.checkpoint == "base"
    assert args.prompt == ["a", "b"] and args.n == 2 and args.seed == 7
    assert args.overrides == [f"output_dir={image_run.resolve()}"]
    assert Path(args.out).is_relative_to(image_run.resolve() / demo.DEMO_SAMPLES_DIR)  # servable
    assert label.endswith("base model / seed 7") and len(rows) == 4
    assert all(Path(r["image"]).is_file() for r in rows)
    demo.generate_samples(image_run, "latest", ["a", "b"], 2, 7, sample_fn=fake_sample)
    assert len(calls) == 1  # same checkpoint, prompts, n and seed: read back, not generated again
    demo.generate_samples(image_run, "latest", ["a", "b"], 2, 8, sample_fn=fake_sample)
    assert len(calls) == 2
    with pytest.raises(ValueError, match="no prompt"):
        demo.generate_samples(image_run, "latest", ["  "], 2, 7, sample_fn=fake_sample)


def test_generate_from_a_real_text_model(tmp_path: Path, random_text_model_dir: Path) -> None:
    """The real path: `mmalign.app.cli.cmd_sample` on the run's config.yaml, same seed -> same samples."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = {
        "pipeline": "text_reasoning",
        "output_dir": str(run),
        "model": {"name_or_path": str(random_text_model_dir)},
        "data": {"prompt_template": "Q: {question} = ?\nA:"},
        "rollout": {"group_size": 2, "prompts_per_step": 1, "max_new_tokens": 4},
        "rewards": [{"name": "answer_accuracy"}],
    }
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1 + 1", "answer": "2"}) + "\n")
    cfg["data"]["train"] = str(data)
    (run / rundir.CONFIG_FILE).write_text(yaml.safe_dump(cfg))
    label, rows = demo.generate_samples(run, "latest", ["Q: 1 + 2 = ?\nA:"], 2, 3)
    assert "base model" in label and [r["sample"] for r in rows] == [0, 1]
    assert all(isinstance(r["text"], str) for r in rows)
    again = demo.generate_samples(run, "base", ["Q: 1 + 2 = ?\nA:"], 2, 3)[1]
    assert [r["text"] for r in again] == [r["text"] for r in rows]


def test_prompts_are_separated_by_dashes_and_keep_their_newlines() -> None:
    assert demo.split_prompts("Q: 1 + 2 = ?\nA:") == ["Q: 1 + 2 = ?\nA:"]
    assert demo.split_prompts("a red cat\n---\na blue dog\n---\n\n") == ["a red cat", "a blue dog"]
    assert demo.split_prompts("") == []


def test_demo_main_rejects_what_is_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.demo_main([str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert demo.demo_main([str(tmp_path)]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.demo_main(["--help"])
    out = capsys.readouterr().out
    assert "mmalign demo" in out and "--host" in out and "--port" in out
    args = demo.build_parser().parse_args(["a", "b"])
    assert args.host == "127.0.0.1" and args.run_dirs == ["a", "b"]


def test_only_files_inside_the_run_directories_are_served(image_run: Path, tmp_path: Path) -> None:
    pytest.importorskip("gradio", reason="the demo extra (gradio) is not installed")

    outside = tmp_path / "outside_secret.txt"
    outside.write_text("TOP SECRET outside the runs")
    sibling = image_run.parent / "img_run_sibling.txt"  # shares the run's name prefix, not its folder
    sibling.write_text("TOP SECRET sibling")
    app = demo.launch_app([image_run], "127.0.0.1", free_port(), refresh_s=0, block=False, quiet=True)
    try:
        assert app.local_url.startswith("http://127.0.0.1:")
        route = file_route(app)
        inside = demo.media_items(demo.load_group(image_run, 1, 0))[0][0][0]
        event, data = call_api(app, "show_group", [str(image_run.resolve()), 2, 0])
        assert event == "complete", data
        url = json.loads(data)[2]["value"][0]["image"]["url"]  # Gradio's copy of a sample image
        status, body = http_get(url if url.startswith("http") else app.local_url + url.lstrip("/"))
        assert status == 200 and body[:8] == b"\x89PNG\r\n\x1a\n"
        refused = [
            str(inside),  # a file of the run by its path: Gradio is handed copies of the checked files only
            str(outside),
            "/etc/passwd",
            str(sibling),
            f"{image_run}/../outside_secret.txt",
            f"{image_run}/samples/../../outside_secret.txt",
            str(Path(__file__).resolve()),  # the current directory is not served either
        ]
        for path in refused:
            status, body = http_get(route + path)
            assert status in (403, 404), (path, status)
            assert b"TOP SECRET" not in body and b"root:" not in body
    finally:
        app.close()


SECRET = "sk-demo-SECRET-0123456789"
CONFIG = {
    "pipeline": "text_to_image",
    "rollout": {"max_new_tokens": 64},
    "rewards": [
        {
            "name": "remote",
            "kwargs": {"url": "http://127.0.0.1:9/score", "headers": {"Authorization": f"Bearer {SECRET}"}},
        },
        {"name": "format", "kwargs": {"api_key": SECRET, "nested": {"password": "hunter22"}}},
    ],
}


@pytest.fixture
def full_run(image_run: Path) -> Path:
    """`image_run` with everything a finished run holds: a config holding a bearer token, a checkpoint,
    ``final/``, the distributed record and a stray file."""
    (image_run / rundir.CONFIG_FILE).write_text(yaml.safe_dump(CONFIG))
    ck = rundir.checkpoint_dir(image_run, 2)
    ck.mkdir(parents=True)
    (ck / rundir.COMPLETE_MARK).write_text("2")
    (ck / rundir.TRAINABLE_FILE).write_bytes(b"TOP SECRET weights")
    (image_run / rundir.FINAL_DIR).mkdir()
    (image_run / rundir.FINAL_DIR / "model.safetensors").write_bytes(b"TOP SECRET weights")
    (image_run / rundir.DISTRIBUTED_FILE).write_text('{"TOP SECRET": 1}')
    (image_run / "notes.txt").write_text("TOP SECRET notes")
    return image_run


def test_served_paths_allow_nothing_and_block_the_runs(full_run: Path) -> None:
    """Gradio is handed copies of the checked media only: no path is allowed, every run is blocked."""
    assert demo.served_paths([full_run]) == ([], [str(full_run.resolve())])


def test_secrets_of_the_config_are_masked() -> None:
    masked = demo.mask_secrets(CONFIG)
    assert SECRET not in json.dumps(masked) and "hunter22" not in json.dumps(masked)
    assert masked["rewards"][0]["kwargs"]["headers"] == "***"
    assert masked["rewards"][0]["kwargs"]["url"] == "http://127.0.0.1:9/score"  # not secret: shown
    assert masked["rewards"][1]["kwargs"]["api_key"] == "***"
    assert masked["rewards"][1]["kwargs"]["nested"] == {"password": "***"}
    assert masked["rollout"] == {"max_new_tokens": 64}  # a count of tokens is no token
    assert CONFIG["rewards"][0]["kwargs"]["headers"]["Authorization"].endswith(SECRET)  # a copy


def test_a_generation_error_never_shows_a_secret(full_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gr = pytest.importorskip("gradio", reason="the demo extra (gradio) is not installed")
    import mmalign.app.cli

    def failing(args: argparse.Namespace) -> int:
        raise RuntimeError(f"401 from http://127.0.0.1:9/score with Authorization: Bearer {SECRET}")

    monkeypatch.setattr(mmalign.app.cli, "cmd_sample", failing)
    with pytest.raises(gr.Error) as err:
        demo._generate_both([(str(full_run), "base")] * 2, "a prompt", 1, 0, lambda *a, **k: None)
    assert "401" in str(err.value) and SECRET not in str(err.value) and "***" in str(err.value)


def test_generate_caps_n_and_the_prompts(full_run: Path) -> None:
    gr = pytest.importorskip("gradio", reason="the demo extra (gradio) is not installed")
    calls: list[argparse.Namespace] = []
    fake = lambda args: calls.append(args) or fake_cmd_sample(args)  # noqa: E731
    cap = demo.MAX_SAMPLES_PER_PROMPT
    assert demo.generate_samples(full_run, "base", ["a"], cap, 0, sample_fn=fake)[1][-1]["sample"] == cap - 1
    with pytest.raises(ValueError, match=f"at most {cap} samples per prompt, got 3000"):
        demo.generate_samples(full_run, "base", ["a"], 3000, 0, sample_fn=fake)
    with pytest.raises(ValueError, match=f"at most {demo.MAX_PROMPTS} prompts"):
        demo.generate_samples(full_run, "base", ["p"] * (demo.MAX_PROMPTS + 1), 1, 0, sample_fn=fake)
    assert len(calls) == 1
    noop = lambda *a, **k: None  # noqa: E731
    with pytest.raises(gr.Error, match=f"between 1 and {cap}"):
        demo._generate_both([(str(full_run), "base")] * 2, "a", 3000, 0, noop)
    with pytest.raises(gr.Error, match="at most"):
        demo._generate_both([(str(full_run), "base")] * 2, "\n---\n".join("p" * 99), 1, 0, noop)


def test_the_demo_folder_is_pruned_to_its_caps(full_run: Path) -> None:
    root = full_run / demo.DEMO_SAMPLES_DIR
    made = []
    for seed in range(6):
        made.append(demo.generate_samples(full_run, "base", ["a"], 2, seed, sample_fn=fake_cmd_sample)[1])
        os.utime(Path(made[-1][0]["image"]).parent.parent, (seed, seed))  # distinct ages, oldest first
    assert len(list(root.iterdir())) == 6  # under the default caps
    sizes = sorted(demo._tree_bytes(p) for p in root.iterdir())
    newest = max(root.iterdir(), key=lambda p: p.stat().st_mtime)
    deleted = demo.prune_demo_samples(full_run, keep=[newest], max_bytes=sizes[-1] * 2, max_generations=10)
    assert len(deleted) == 4 and newest in set(root.iterdir()) and len(list(root.iterdir())) == 2
    demo.prune_demo_samples(full_run, keep=[newest], max_bytes=0, max_generations=10)
    assert list(root.iterdir()) == [newest]  # the one being shown survives any cap
    assert all(Path(r["image"]).is_file() for r in made[-1])


def test_only_what_the_app_shows_is_served(full_run: Path) -> None:
    """Over HTTP: the copies of the sample images the app shows are served; no file of the run by its path
    (the samples, metrics.jsonl, config.yaml with a bearer token, checkpoints, final/, the rest), nor links or
    encoded paths to them."""
    pytest.importorskip("gradio", reason="the demo extra (gradio) is not installed")
    run = full_run
    ck = rundir.checkpoint_dir(run, 2)
    link = run / "samples" / "step_000001" / "link.png"
    link.symlink_to(run / rundir.CONFIG_FILE)
    app = demo.launch_app([run], "127.0.0.1", free_port(), refresh_s=0, block=False, quiet=True)
    try:
        route = file_route(app)
        image = demo.media_items(demo.load_group(run, 1, 0))[0][0][0]
        event, data = call_api(app, "show_group", [str(run.resolve()), 1, 0])
        assert event == "complete", data
        url = json.loads(data)[2]["value"][0]["image"]["url"]
        status, body = http_get(url if url.startswith("http") else app.local_url + url.lstrip("/"))
        assert status == 200 and body[:8] == b"\x89PNG\r\n\x1a\n"
        (run / "late.txt").write_text("TOP SECRET written after the launch")
        refused = [
            image,
            rundir.samples_file(run, 1),
            run / rundir.METRICS_FILE,
            run / rundir.CONFIG_FILE,
            ck / rundir.TRAINABLE_FILE,
            ck / rundir.COMPLETE_MARK,
            run / rundir.FINAL_DIR / "model.safetensors",
            run / rundir.DISTRIBUTED_FILE,
            run / "notes.txt",
            run / "late.txt",
            link,
            f"{run}/samples/../config.yaml",
            f"{run}/samples/%2e%2e/config.yaml",
            f"{run}/samples/%252e%252e/config.yaml",
            f"{run}/SAMPLES/../CONFIG.YAML",
        ]
        for path in refused:
            status, body = http_get(route + str(path))
            assert status in (403, 404), (path, status)
            assert SECRET.encode() not in body and b"TOP SECRET" not in body
        status, body = http_get(route + urllib.parse.quote(str(run / rundir.CONFIG_FILE)))
        assert status in (403, 404) and SECRET.encode() not in body
        # nor through the page or its config
        for page in ("", "config", "gradio_api/info"):
            status, body = http_get(app.local_url + page)
            assert SECRET.encode() not in body and b"hunter22" not in body
    finally:
        app.close()


def test_generate_over_http_refuses_a_large_n_and_keeps_the_demo_folder_small(
    full_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The app's generate endpoint over HTTP with a fake `cmd_sample`: ``n`` = 3000 is refused before any
    generation; many generations keep ``demo_samples/`` within its caps, the newest one served."""
    pytest.importorskip("gradio", reason="the demo extra (gradio) is not installed")
    import mmalign.app.cli

    calls: list[argparse.Namespace] = []
    monkeypatch.setattr(mmalign.app.cli, "cmd_sample", lambda a: calls.append(a) or fake_cmd_sample(a))
    monkeypatch.setattr(demo, "DEMO_MAX_GENERATIONS", 4)
    monkeypatch.setattr(demo, "DEMO_MAX_BYTES", 40_000)
    run = str(full_run.resolve())
    root = full_run / demo.DEMO_SAMPLES_DIR
    app = demo.launch_app([full_run], "127.0.0.1", free_port(), refresh_s=0, block=False, quiet=True)
    try:
        event, data = call_api(app, "generate_both", [run, "base", run, "base", "a prompt", 3000, 0])
        assert event == "error" and "16" in data, data
        assert not calls and not root.exists()
        for seed in range(10):
            event, data = call_api(app, "generate_both", [run, "base", run, "latest", "a\n---\nb", 3, seed])
            assert event == "complete", data
            assert len(list(root.iterdir())) <= 4
            assert sum(demo._tree_bytes(p) for p in root.iterdir()) <= 40_000
        assert len(calls) == 20  # two sides of 10 generations (latest -> the checkpoint of step 2)
        left_gallery = json.loads(data)[1]
        left_gallery = (
            left_gallery.get("value", left_gallery) if isinstance(left_gallery, dict) else left_gallery
        )
        assert len(left_gallery) == 6
        url = left_gallery[0]["image"]["url"]  # Gradio's copy of the generated image
        status, body = http_get(url if url.startswith("http") else app.local_url + url.lstrip("/"))
        assert status == 200 and body[:4] == b"\x89PNG"
        status, body = http_get(file_route(app) + str(full_run / rundir.CONFIG_FILE))
        assert status in (403, 404) and SECRET.encode() not in body
    finally:
        app.close()


# ----------------------------------------------------------------------------- issue 24: what a newcomer saw


def write_metrics(run: Path, off: float = 0.0) -> None:
    """Diagnostics on very different scales (completion length ~8, clip fraction ~0.02)."""
    run.mkdir(parents=True, exist_ok=True)
    with (run / rundir.METRICS_FILE).open("w") as f:
        for step in range(1, 5):
            row = {"step": step, "loss": 0.5 / step + off, "clip_frac": 0.02 + off / 10}
            row |= {"approx_kl": 0.001 * step, "completion_len/mean": 8.0 + step, "kl": None}
            f.write(json.dumps(row) + "\n")


def test_diagnostics_are_one_panel_per_metric(tmp_path: Path) -> None:
    a, b = tmp_path / "run_a", tmp_path / "run_b"
    write_metrics(a)
    write_metrics(b, off=0.1)
    keys = ["loss", "clip_frac", "approx_kl", "completion_len/mean", "kl", "never_logged"]
    panels = demo.diagnostic_panels([a], keys)
    assert [k for k, _ in panels] == [
        "loss",
        "clip_frac",
        "approx_kl",
        "completion_len/mean",
    ]  # own axis each
    for key, rows in panels:
        assert {r["run"] for r in rows} == {"run_a"} and [r["step"] for r in rows] == [1, 2, 3, 4], key
    clip = dict(panels)["clip_frac"]
    assert all(abs(r["value"] - 0.02) < 1e-9 for r in clip)  # not flattened by completion_len's scale
    # two runs: both runs' lines in each panel, labelled by run
    two = demo.diagnostic_panels([a, b], keys)
    assert len(two) == 4 and all({r["run"] for r in rows} == {"run_a", "run_b"} for _, rows in two)
    assert len(demo.diagnostic_panels([a], keys, max_panels=2)) == 2
    _, frames = demo._curve_frames([str(a), str(b)], ["loss"], keys)
    assert [k for k, _ in frames] == [k for k, _ in two] and list(frames[0][1].columns) == [
        "step",
        "value",
        "run",
    ]
    gr = pytest.importorskip("gradio", reason="the demo extra (gradio) is not installed")
    updates = demo._panel_updates(frames)
    assert len(updates) == demo.MAX_PANELS
    assert [u.get("visible") for u in updates] == [True] * 4 + [False] * (demo.MAX_PANELS - 4)
    assert [u.get("title") for u in updates[:4]] == ["loss", "clip_frac", "approx_kl", "completion_len/mean"]
    assert isinstance(demo.build_app([a, b], refresh_s=0), gr.Blocks)


def test_a_text_run_shows_no_image_panel(tmp_path: Path, image_run: Path) -> None:
    run = tmp_path / "text_run"
    write_step(
        run, 1, [{**r, "text": f" <answer>{i}</answer>", "answer": "3"} for i, r in enumerate(rows_for(1))]
    )
    layout = demo.sample_layout(demo.load_group(run, 1, 0))
    assert layout == {"gallery": False, "videos": False, "boxes": False, "text": True, "picker": False}
    assert demo.sample_layout(demo.load_group(image_run, 1, 0))["gallery"]
    pytest.importorskip("gradio", reason="the demo extra (gradio) is not installed")
    _, _, gallery, videos, _, picker, boxes, video = demo.show_group(str(run), 1, 0)
    assert gallery["visible"] is False and videos["visible"] is False and picker["visible"] is False
    assert boxes["visible"] is False and video["visible"] is False
    assert demo.show_group(str(image_run), 1, 0)[2]["visible"] is True
    header, gal, _ = demo._logged_side(str(run), 1, "prompt 0")
    assert "group 0" in header and gal["visible"] is False  # nor in Compare


def test_grounding_rows_are_drawn_on_their_input_image(tmp_path: Path) -> None:
    import numpy as np
    from PIL import Image

    scan = np.full((64, 64), 30, dtype=np.uint8)
    scan[20:40, 24:44] = 200  # the lesion
    data = tmp_path / "data" / "scan.png"
    data.parent.mkdir()
    Image.fromarray(scan, mode="L").save(data)
    run = tmp_path / "medloc_run"
    rows = [
        {
            **r,
            "text": f"<answer>[{22 + i},18,42,38]</answer>",
            "boxes": [[24.0, 20.0, 44.0, 40.0]],
            "images": [str(data)],  # the input image of the grounding row
        }
        for i, r in enumerate(rows_for(1, groups=1))
    ]
    write_step(run, 1, rows)
    samples = demo.load_group(run, 1, 0)
    # the input image lies outside the run: read only from a folder the operator names (--data-root)
    canvas, _ = demo.box_annotations(samples[0], run_dir=run)
    assert isinstance(canvas, np.ndarray) and canvas[0, 0].tolist() == [48, 48, 48]  # refused: a grey canvas
    roots = [data.parent]
    base, labels = demo.box_annotations(samples[0], run_dir=run, data_roots=roots)
    assert isinstance(base, np.ndarray) and base.shape == (256, 256, 3)  # 64 px drawn 4x larger
    assert base[30 * 4, 30 * 4].tolist() == [200, 200, 200] and base[4, 4].tolist() == [30, 30, 30]
    assert labels == [((96, 80, 176, 160), "reference"), ((88, 72, 168, 152), "predicted")]
    layout = demo.sample_layout(samples)
    assert layout["boxes"] and layout["picker"] and not layout["gallery"]
    assert demo.input_image({"images": [str(tmp_path / "missing.png")]}, run, roots) is None
    assert demo.input_image({"images": [str(run / rundir.METRICS_FILE)]}, run) is None  # images only
    # coords "norm1000": converted with the input image's size when the row carries none
    norm = {**samples[0], "text": "<answer>[375,312,687,625]</answer>"}
    _, labels = demo.box_annotations(norm, "norm1000", run_dir=run, data_roots=roots)
    assert labels[1] == ((96, 80, 176, 160), "predicted")
    gr = pytest.importorskip("gradio", reason="the demo extra (gradio) is not installed")
    boxes, _ = demo.show_sample(str(run), 1, 0, 1, data_roots=roots)
    assert boxes["visible"] is True and isinstance(boxes["value"][0], np.ndarray)
    (mask, label), _ = boxes["value"][1]
    assert label == "reference" and mask[80, 120] == 1.0 and mask[120, 120] < 0.5  # a frame, see-through
    assert isinstance(gr.AnnotatedImage().postprocess(boxes["value"]).image.path, str)


@register_reward("demo_test_length")
class DemoLength(Reward):
    """Test reward: the completion's length / 10."""

    needs = {"texts"}

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        return torch.tensor([len(t) / 10 for t in batch.texts])


@register_reward("demo_test_match")
class DemoMatch(Reward):
    """Test reward: 1 when the completion holds the reference ``answer`` column."""

    needs = {"texts"}

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        return torch.tensor([float(str(a) in t) for a, t in zip(batch["answer"], batch.texts, strict=True)])


def fake_text_sample(args: argparse.Namespace) -> int:
    """`cmd_sample` without a model: sample j of every prompt answers "3" * (j + 1)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [
        {"prompt": p, "sample": j, "text": f" {'3' * (j + 1)}"} for p in args.prompt for j in range(args.n)
    ]
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


def test_generated_samples_are_scored_with_the_run_rewards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "text_run"
    logged = [{**r, "prompt": "Q: 1 + 2 = ?", "text": " 3", "answer": "3"} for r in rows_for(1, groups=1)]
    write_step(run, 1, logged)
    rewards = [{"name": "demo_test_length"}, {"name": "demo_test_match", "weight": 2.0}]
    (run / rundir.CONFIG_FILE).write_text(yaml.safe_dump({"pipeline": "text_reasoning", "rewards": rewards}))
    prompts = ["Q: 1 + 2 = ?", "a typed prompt"]
    _, rows = demo.generate_samples(run, "base", prompts, 2, 0, sample_fn=fake_text_sample)
    names, notes = demo.score_generated(run, rows)
    assert names == ["demo_test_length", "demo_test_match"]
    # the logged prompt: its reference answer "3" comes from the run's data row
    assert rows[0]["rewards"] == pytest.approx({"demo_test_length": 0.2, "demo_test_match": 1.0})
    assert rows[0]["reward"] == pytest.approx(0.2 + 2.0)
    # the typed prompt: no reference, so the match reward is n/a (NaN) and the total leaves it out
    assert rows[3]["rewards"]["demo_test_length"] == pytest.approx(0.3)
    assert rows[3]["rewards"]["demo_test_match"] != rows[3]["rewards"]["demo_test_match"]  # NaN
    assert rows[3]["reward"] == pytest.approx(0.3)
    assert "answer" in notes["demo_test_match"] and "typed prompt" in notes["demo_test_match"]
    assert "demo_test_length" not in notes
    gr = pytest.importorskip("gradio", reason="the demo extra (gradio) is not installed")
    import mmalign.app.cli

    monkeypatch.setattr(mmalign.app.cli, "cmd_sample", fake_text_sample)
    out = demo._generate_both([(str(run), "base")] * 2, "\n---\n".join(prompts), 2, 0, lambda *a, **k: None)
    head_a, gal_a, table_a, head_b, _, table_b = out
    assert gal_a["visible"] is False  # text: no gallery
    for head, table in ((head_a, table_a), (head_b, table_b)):
        assert list(table.columns) == [
            "prompt",
            "sample",
            "reward",
            "demo_test_length",
            "demo_test_match",
            "text",
        ]
        assert table["demo_test_match"].tolist() == ["1.0000", "1.0000", "n/a", "n/a"]
        assert table["reward"].tolist() == ["2.2000", "2.3000", "0.2000", "0.3000"]
        mean = (2.2 + 2.3 + 0.2 + 0.3) / 4
        assert f"mean reward **{mean:.3f}**" in head and "demo_test_match 1.000" in head and "n/a" in head
    assert isinstance(gr.Markdown().postprocess(head_a), str)


def test_generated_samples_of_a_run_without_rewards_are_not_scored(full_run: Path) -> None:
    """A config whose rewards cannot be built here: the samples are shown unscored, secrets masked."""
    _, rows = demo.generate_samples(full_run, "base", ["a"], 1, 0, sample_fn=fake_cmd_sample)
    names, notes = demo.score_generated(full_run, rows)
    assert names == [] and "could not be built" in notes[""] and SECRET not in notes[""]
    assert "rewards" not in rows[0]
