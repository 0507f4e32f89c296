"""The demo's path rule and trust model (`mmalign.app.demo`, issue 33): a hostile run directory (``samples/`` a
link to a folder outside, ``metrics.jsonl`` and ``config.yaml`` links to files outside, sample rows naming
``../`` and absolute paths, a FIFO) makes the demo read and serve nothing outside the run, through its own
functions and over HTTP against the running app; a config naming a module path is not imported by live
generation unless the operator opts in (``--trust-run-code``); a broken ``metrics.jsonl`` line is named and
skipped; Gradio's "share=True" line is not printed."""

from __future__ import annotations

import json
import logging
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image, PngImagePlugin

from mmalign.app import demo
from mmalign.training import rundir
from tests.app.demo_support import (
    call_api,
    fake_cmd_sample,
    file_route,
    free_port,
    http_get,
    rows_for,
    write_step,
)

SECRET = b"TOP-SECRET-outside-the-run"


# ----------------------------------------------------------------------------- the path rule


def secret_png(path: Path) -> bytes:
    """A valid PNG outside the run whose bytes hold `SECRET` (a text chunk); its bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    info = PngImagePlugin.PngInfo()
    info.add_text("secret", SECRET.decode())
    Image.fromarray(np.full((8, 8, 3), 200, dtype=np.uint8)).save(path, pnginfo=info)
    return path.read_bytes()


@pytest.fixture
def hostile(tmp_path: Path) -> dict[str, Path]:
    """Two hostile runs and the folder outside them:

    - ``links``: ``samples/`` a link to ``outside/samples`` (a samples file and an image holding the secret),
      ``metrics.jsonl`` a link to ``outside/metrics.jsonl``, ``config.yaml`` a link to ``outside/config.yaml``,
      ``etc`` a link to ``/etc``;
    - ``rows``: a real run whose one group's rows name an absolute path to the secret (image and video; the
      first sample), ``../../../outside/secret.png``, a link inside ``samples/`` to it, a FIFO, and a
      grounding input image outside, next to one honest sample (the second)."""
    outside = tmp_path / "outside"
    secret = outside / "secret.png"
    secret_png(secret)
    (outside / "secret.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + SECRET)
    write_step(outside, 1, rows_for(1, groups=1), [{"image": torch.rand(3, 8, 8)} for _ in range(2)])
    for png in (outside / "samples" / "step_000001").glob("*.png"):
        secret_png(png)
    (outside / "metrics.jsonl").write_text(json.dumps({"step": 1, "secret/metric": 42.0}) + "\n")
    (outside / "config.yaml").write_text(
        yaml.safe_dump({"rewards": [{"name": "x", "kwargs": {"coords": "s"}}]})
    )

    links = tmp_path / "links"
    links.mkdir()
    for name in ("samples", "metrics.jsonl", "config.yaml"):
        (links / name).symlink_to(outside / name)
    (links / "etc").symlink_to("/etc")

    rows_run = tmp_path / "rows"
    honest = rows_for(1, groups=1)[:1]
    write_step(rows_run, 1, honest, [{"image": torch.rand(3, 8, 8)}])
    step_dir = rows_run / "samples" / "step_000001"
    (step_dir / "link.png").symlink_to(secret)
    os.mkfifo(step_dir / "fifo.png")
    base = {"group": 0, "prompt": "prompt 0", "advantage": 0.0, "rewards": {"quality": 0.0}}
    first = {**base, "image": str(secret), "video": str(outside / "secret.mp4"), "boxes": [[1, 1, 4, 4]]}
    hostile_rows = [
        {**base, "image": "../../../outside/secret.png"},
        {**base, "image": "step_000001/link.png", "video_frames": "step_000001/link.png"},
        {**base, "image": "step_000001/fifo.png"},
        {**base, "images": [str(secret)], "boxes": [[1, 1, 4, 4]], "text": "<answer>[1,1,4,4]</answer>"},
    ]
    rows = [json.loads(ln) for ln in rundir.samples_file(rows_run, 1).read_text().splitlines()]
    all_rows = [first, *rows, *hostile_rows]  # the first one is what the app shows on opening the group
    rundir.samples_file(rows_run, 1).write_text("".join(json.dumps(r) + "\n" for r in all_rows))
    return {"outside": outside, "secret": secret, "links": links, "rows": rows_run}


def test_linked_samples_metrics_and_config_are_refused(
    hostile: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    run = hostile["links"]
    with caplog.at_level(logging.WARNING, logger="mmalign.app.demo"):
        assert demo.list_steps(run) == [] and demo.load_group(run, 1, 0) == []
        assert demo.metrics_rows(run) == ([], [])
        assert "secret/metric" not in demo.metric_keys([run])
        assert demo.curve_rows([run], ["secret/metric"]) == []
        assert "last step none" in demo.run_status(run)
        assert demo.box_coords(run) == "absolute"  # config.yaml outside: not read
        assert demo.checked_path(run, run / "etc" / "hostname") is None
    logged = caplog.text
    for name in ("samples", "metrics.jsonl", "config.yaml"):
        assert f"{run / name} of run {run.resolve()}" in logged, name  # the path and the run
    assert "outside the run directory" in logged


def test_rows_naming_files_outside_the_run_are_refused(
    hostile: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    run, secret = hostile["rows"], hostile["secret"]
    with caplog.at_level(logging.WARNING, logger="mmalign.app.demo"):
        samples = demo.load_group(run, 1, 0)
    assert len(samples) == 6
    images, videos = demo.media_items(samples)
    assert len(images) == 1 and not videos  # only the honest sample's image
    assert Path(images[0][0]).is_relative_to(run.resolve())
    for s in samples[:1] + samples[2:]:
        assert s.get("image") is None or s["image"].name == "fifo.png"  # inside the run, but not a file
        assert s.get("video") is None and s.get("video_frames") is None
    assert str(secret) in caplog.text and str(run.resolve()) in caplog.text
    # the grounding row's input image outside the run: not read (a grey canvas), unless a data root allows it
    grounding = samples[-1]
    assert demo.input_image(grounding, run) is None
    base, _ = demo.box_annotations(grounding, run_dir=run)
    assert isinstance(base, np.ndarray) and base[0, 0].tolist() == [48, 48, 48]
    assert demo.input_image(grounding, run, [hostile["outside"]]) == secret.resolve()
    # the checked opener and the copies handed to Gradio
    assert demo.served_copy(run, secret) is None
    assert demo.served_copy(run, run / "samples" / "step_000001" / "link.png") is None
    assert demo.served_copy(run, run / "samples" / "step_000001" / "fifo.png") is None  # never blocks
    assert demo.open_checked(run, secret) is None
    copy = demo.served_copy(run, images[0][0])
    assert copy is not None and Path(copy).read_bytes() == Path(images[0][0]).read_bytes()
    assert not Path(copy).is_relative_to(run.resolve())
    pytest.importorskip("gradio", reason="the demo extra (gradio) is not installed")
    _, _, gallery, videos_update, _, _, _, _ = demo.show_group(str(run), 1, 0)
    assert [Path(p).read_bytes() for p, _ in gallery["value"]] == [Path(images[0][0]).read_bytes()]
    assert videos_update["value"] == []
    for k in (0, 2, 3, 4, 5):
        boxes, video = demo.show_sample(str(run), 1, 0, k)
        assert video["value"] is None
        if boxes["value"] is not None:
            assert isinstance(boxes["value"][0], np.ndarray)  # a canvas, not the secret image


def _urls(payload: object) -> list[str]:
    """Every file URL in an API payload."""
    found: list[str] = []
    if isinstance(payload, dict):
        for k, v in payload.items():
            if k == "url" and isinstance(v, str):
                found.append(v)
            else:
                found += _urls(v)
    elif isinstance(payload, list):
        for v in payload:
            found += _urls(v)
    return found


def test_nothing_outside_the_runs_is_served_over_http(hostile: dict[str, Path]) -> None:
    pytest.importorskip("gradio", reason="the demo extra (gradio) is not installed")
    links, rows_run, outside = hostile["links"], hostile["rows"], hostile["outside"]
    etc_run = outside.parent / "etc_run"  # the reported case: RUN/samples a link to /etc
    etc_run.mkdir()
    (etc_run / rundir.SAMPLES_DIR).symlink_to("/etc")
    runs = [rows_run, links, etc_run]
    app = demo.launch_app(runs, "127.0.0.1", free_port(), refresh_s=0, block=False, quiet=True)
    try:
        route = file_route(app)
        paths = [
            hostile["secret"],
            outside / "metrics.jsonl",
            links / "samples" / "step_000001" / "0000.png",
            links / "samples" / "step_000001.jsonl",
            links / "metrics.jsonl",
            links / "config.yaml",
            links / "etc" / "passwd",
            "/etc/passwd",
            "/etc/shadow",
            etc_run / "samples" / "passwd",
            etc_run / "samples" / "shadow",
            rows_run / "samples" / "step_000001" / "link.png",
            rows_run / "samples" / "step_000001" / "0000.png",  # inside, but Gradio gets copies only
            rows_run / "metrics.jsonl",
        ]
        for path in paths:
            for form in (str(path), urllib.parse.quote(str(path))):
                status, body = http_get(route + form)
                assert status != 200 and SECRET not in body and b"root:" not in body, (path, status)
        # the app's own endpoints: the group of the hostile rows shows the honest image only
        event, data = call_api(app, "show_group", [str(rows_run.resolve()), 1, 0])
        assert event == "complete", data
        outputs = json.loads(data)
        gallery = _urls(outputs[2])
        assert len(gallery) == 1  # the honest sample's image only
        for url in _urls(outputs):  # the gallery, the first sample's boxes (on a canvas) and their masks
            status, body = http_get(url if url.startswith("http") else app.local_url + url.lstrip("/"))
            assert status == 200 and SECRET not in body
        assert outputs[7].get("value") is None  # the first sample's video: the secret, refused
        event, data = call_api(app, "show_group", [str(links.resolve()), None, None])
        assert event == "complete" and "no samples" in data and not _urls(json.loads(data))
    finally:
        app.close()


def test_a_broken_metrics_line_is_named_and_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    run.mkdir()
    lines = [
        {"step": 1, "loss": 0.5},
        "this is not JSON",
        {"step": 2, "loss": 0.4},
        {"loss": 0.3},  # no step
        {"step": 3, "loss": 0.2},
    ]
    (run / rundir.METRICS_FILE).write_text(
        "".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines)
    )
    with caplog.at_level(logging.WARNING, logger="mmalign.app.demo"):
        status = demo.run_status(run)  # (raised a MetricsError: a traceback in the app)
        keys = demo.metric_keys([run])
        rows, problems = demo.metrics_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    metrics = run / rundir.METRICS_FILE
    assert len(problems) == 2
    assert problems[0].startswith(f"{metrics}: line 2 is not JSON") and f"{metrics}: line 4 " in problems[1]
    assert "last step 3" in status and "line 2" in status and "line 4" in status
    assert keys == ["loss"]
    assert [r["step"] for r in demo.curve_rows([run], ["loss"])] == [1, 2, 3]
    assert [len(r) for _, r in demo.diagnostic_panels([run], ["loss"])] == [3]
    assert f"{metrics}: line 2 is not JSON" in caplog.text
    pytest.importorskip("gradio", reason="the demo extra (gradio) is not installed")
    demo.build_app([run], refresh_s=0)  # builds: no traceback


# ----------------------------------------------------------------------------- the trust model

PAYLOAD = '''
import pathlib
pathlib.Path({marker!r}).write_text("imported")

class Evil:
    """Not a reward at all: importing this module is the attack."""
'''


@pytest.fixture
def payload_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A run whose config names ``demo_evil_payload:Evil`` as a reward, the module importable here (a
    ``payload.py`` on ``sys.path``) and writing a marker file when imported."""
    code = tmp_path / "code"
    code.mkdir()
    marker = tmp_path / "imported.txt"
    (code / "demo_evil_payload.py").write_text(PAYLOAD.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.delitem(sys.modules, "demo_evil_payload", raising=False)
    run = tmp_path / "run"
    write_step(run, 1, rows_for(1, groups=1), [{"image": torch.rand(3, 8, 8)} for _ in range(2)])
    config = {
        "pipeline": "text_to_image",
        "data": {"train": "hf:gsm8k"},  # a data source, not code: not flagged
        "rewards": [{"name": "answer_accuracy"}, {"name": "demo_evil_payload:Evil"}],
    }
    (run / rundir.CONFIG_FILE).write_text(yaml.safe_dump(config))
    return run, marker


def test_run_code_problems_name_what_would_be_imported(
    payload_run: tuple[Path, Path], tmp_path: Path
) -> None:
    run, marker = payload_run
    (problem,) = demo.run_code_problems(run)
    assert "'rewards[1].name'" in problem and "'demo_evil_payload:Evil'" in problem
    assert str(run.resolve() / rundir.CONFIG_FILE) in problem
    remote = tmp_path / "remote_run"
    remote.mkdir()
    (remote / rundir.CONFIG_FILE).write_text(yaml.safe_dump({"model": {"trust_remote_code": True}}))
    assert ["'model.trust_remote_code' is true" in p for p in demo.run_code_problems(remote)] == [True]
    geometry = tmp_path / "geometry_model"
    geometry.mkdir()
    (geometry / "config.json").write_text(json.dumps({"class": "demo_evil_payload:Evil"}))
    (remote / rundir.CONFIG_FILE).write_text(yaml.safe_dump({"options": {"geometry_model": str(geometry)}}))
    assert ["'demo_evil_payload:Evil'" in p for p in demo.run_code_problems(remote)] == [True]
    plain = {"rewards": [{"name": "format"}], "data": {"prompt_template": "Q: {q}\nA:"}}
    (remote / rundir.CONFIG_FILE).write_text(yaml.safe_dump(plain))
    assert demo.run_code_problems(remote) == []
    assert not marker.exists() and "demo_evil_payload" not in sys.modules


def test_generation_imports_no_run_code_unless_trusted(payload_run: tuple[Path, Path]) -> None:
    run, marker = payload_run
    calls: list[object] = []
    fake = lambda args: calls.append(args) or fake_cmd_sample(args)  # noqa: E731
    with pytest.raises(demo.UntrustedRunCode) as err:
        demo.generate_samples(run, "base", ["a"], 1, 0, sample_fn=fake)
    assert "demo_evil_payload:Evil" in str(err.value) and "--trust-run-code" in str(err.value)
    assert not calls and not marker.exists() and "demo_evil_payload" not in sys.modules
    # rows generated earlier (or by hand) are not scored either: the note says why and how to opt in
    _, rows = demo.generate_samples(run, "base", ["a"], 1, 0, sample_fn=fake, trust_run_code=True)
    assert len(calls) == 1
    names, notes = demo.score_generated(run, rows)
    assert names == [] and "--trust-run-code" in notes[""] and "demo_evil_payload:Evil" in notes[""]
    assert not marker.exists()
    # the operator opted in: the run's code is imported (the gate above is what kept it out)
    demo.score_generated(run, rows, trust_run_code=True)
    assert marker.exists()
    args = demo.build_parser().parse_args(["r"])
    assert args.trust_run_code is False and args.data_root == []
    assert demo.build_parser().parse_args(["r", "--trust-run-code"]).trust_run_code is True


def test_generate_over_http_refuses_run_code(
    payload_run: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("gradio", reason="the demo extra (gradio) is not installed")
    import mmalign.app.cli

    run, marker = payload_run
    calls: list[object] = []
    monkeypatch.setattr(mmalign.app.cli, "cmd_sample", lambda a: calls.append(a) or fake_cmd_sample(a))
    app = demo.launch_app([run], "127.0.0.1", free_port(), refresh_s=0, block=False, quiet=True)
    try:
        r = str(run.resolve())
        event, data = call_api(app, "generate_both", [r, "base", r, "base", "a prompt", 1, 0])
        assert event == "error" and "demo_evil_payload:Evil" in data and "--trust-run-code" in data, data
        assert not calls and not marker.exists() and "demo_evil_payload" not in sys.modules
    finally:
        app.close()


def test_launch_prints_no_share_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gradio", reason="the demo extra (gradio) is not installed")
    run = tmp_path / "run"
    write_step(run, 1, rows_for(1, groups=1))
    app = demo.launch_app([run], "127.0.0.1", free_port(), refresh_s=0, block=False)
    try:
        out = capsys.readouterr()
        assert f"mmalign demo: serving run on {app.local_url}" in out.out
        assert "share=True" not in out.out + out.err and "public link" not in out.out + out.err
    finally:
        app.close()
