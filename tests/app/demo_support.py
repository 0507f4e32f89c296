"""Helpers shared by the demo's tests (tests/app/test_demo.py, test_demo_security.py): runs written the way the
trainer writes them, and HTTP calls to a launched app on 127.0.0.1."""

from __future__ import annotations

import argparse
import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import torch

from mmalign.training import rundir


def write_step(run: Path, step: int, rows: list[dict], views: list[dict] | None = None) -> None:
    """Write a step the way the trainer does: media through `store_sample_media`, rows, a metrics line."""
    if views is not None:
        stored = rundir.store_sample_media(run, step, views)
        rows = [{**r, **v} for r, v in zip(rows, stored, strict=True)]
    rundir.write_samples(run, step, rows)
    reward = sum(sum(r["rewards"].values()) for r in rows) / len(rows)
    with (run / rundir.METRICS_FILE).open("a") as f:
        f.write(json.dumps({"step": step, "reward/mean": reward, "loss": 0.1 * step, "kl": None}) + "\n")


def rows_for(step: int, groups: int = 2, g: int = 2) -> list[dict]:
    return [
        {
            "group": k,
            "prompt": f"prompt {k}",
            "advantage": (-1.0) ** j,
            "rewards": {"quality": 0.25 * j + 0.1 * step, "format": 1.0},
        }
        for k in range(groups)
        for j in range(g)
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=20) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def fake_cmd_sample(args: argparse.Namespace) -> int:
    """`cmd_sample` without a model: one 16x16 PNG per sample (about 1 kB each) and the samples file."""
    out = Path(args.out)
    rows = []
    for i in range(args.n * len(args.prompt)):
        view = rundir.store_media({"image": torch.rand(3, 16, 16)}, out / "media", f"000_{i:02d}", out)
        rows.append({"prompt": args.prompt[i // args.n], "sample": i % args.n, **view})
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


def file_route(app: object) -> str:
    """Gradio's file route (Gradio 5 and later: `gradio_api/file=`; pyproject asks for gradio>=5)."""
    return app.local_url + "gradio_api/file="  # type: ignore[attr-defined]


def call_api(app: object, name: str, data: list) -> tuple[str, str]:
    """Call the app's `name` endpoint over HTTP (Gradio's two-step REST API): ``(event, data)`` of its
    last event, ``"complete"`` or ``"error"``."""
    base = app.local_url + "gradio_api/call/" + name  # type: ignore[attr-defined]
    req = urllib.request.Request(
        base, json.dumps({"data": data}).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        event_id = json.loads(r.read())["event_id"]
    with urllib.request.urlopen(f"{base}/{event_id}", timeout=60) as r:
        text = r.read().decode()
    event, payload = "", ""
    for line in text.splitlines():
        if line.startswith("event:"):
            event = line.split(":", 1)[1].strip()
        elif line.startswith("data:"):
            payload = line.split(":", 1)[1].strip()
    return event, payload
