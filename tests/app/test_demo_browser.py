"""The demo in a real browser: Debian's Chromium driven by Playwright (no browser download; `.ci/run`
installs both). The app runs on a small synthetic run; the test clicks through steps and groups, checks
that images, boxes and reward values appear, that a step written while the app runs shows up, that the
Curves tab draws one panel per diagnostic metric, and that a file outside the run directories is refused. It saves a screenshot (its path is printed; also copied into
``$MMALIGN_SCREENSHOT_DIR`` when that is set). Without Playwright or Chromium the test is skipped, saying
which is missing."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch

from mmalign.training import rundir

CHROMIUM = os.environ.get("MMALIGN_CHROMIUM", "/usr/bin/chromium")


def _requirements() -> str | None:
    """Why the browser test cannot run here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright; it is in the dev extra)"
    try:
        import gradio  # noqa: F401
    except ImportError:
        return "gradio is not installed (pip install 'gradio>=4'; the demo / dev extras)"
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run does, this machine could not)"
    return None


def write_step(run: Path, step: int, boxes: bool = False) -> None:
    rows, views = [], []
    for group in range(2):
        for j in range(2):
            row = {
                "group": group,
                "prompt": f"a red square, prompt {group}",
                "advantage": 1.0 if j else -1.0,
                "rewards": {"quality": round(0.25 * j + 0.1 * step, 4), "format": 1.0},
            }
            if boxes and group == 1:
                row["boxes"] = [[4, 4, 20, 20]]
            rows.append(row)
            image = torch.zeros(3, 32, 32)
            image[0, 4 + j : 20 + j, 4:20] = 1.0  # a red square
            views.append({"image": image})
    stored = rundir.store_sample_media(run, step, views)
    rundir.write_samples(run, step, [{**r, **v} for r, v in zip(rows, stored, strict=True)])
    with (run / rundir.METRICS_FILE).open("a") as f:
        f.write(json.dumps({"step": step, "reward/mean": 0.5 + 0.1 * step, "loss": 1.0 / step}) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_browse_a_run_in_chromium(tmp_path: Path) -> None:
    why = _requirements()
    if why:
        pytest.skip(f"browser test skipped: {why}")
    from playwright.sync_api import expect, sync_playwright

    from mmalign.app import demo

    run = tmp_path / "tiny_run"
    write_step(run, 1, boxes=True)
    write_step(run, 2)
    outside = tmp_path / "outside.txt"
    outside.write_text("TOP SECRET outside the runs")

    app = demo.launch_app([run], "127.0.0.1", free_port(), refresh_s=1.0, block=False, quiet=True)
    shot = tmp_path / "demo_screenshot.png"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-dev-shm-usage"]
            )
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1800})
                page.set_default_timeout(30_000)
                page.goto(app.local_url)
                header, table = page.locator("#group-header"), page.locator("#reward-table")
                # opens on the newest step, first group
                expect(header).to_contain_text("step 2, group 0")
                expect(table).to_contain_text("0.4500")  # quality of sample 1 at step 2
                expect(table).to_contain_text("-1.0000")  # an advantage
                images = page.locator("#gallery img")
                expect(images).to_have_count(2)
                src = images.first.get_attribute("src") or ""
                assert "/gradio_api/file=" in src or "/file=" in src, src
                page.wait_for_function(
                    "() => [...document.querySelectorAll('#gallery img')]"
                    ".every(i => i.complete && i.naturalWidth > 0)"
                )
                # click through groups and steps
                page.click("#next-group")
                expect(header).to_contain_text("step 2, group 1")
                page.click("#prev-step")
                expect(header).to_contain_text("step 1, group 1")
                expect(table).to_contain_text("0.3500")
                expect(images).to_have_count(2)
                # the grounding boxes of step 1, group 1 on the sample's image
                expect(page.locator("#boxes")).to_be_visible()
                expect(page.locator("#boxes img").first).to_be_visible()
                page.screenshot(path=str(tmp_path / "demo_screenshot_boxes.png"), full_page=True)
                page.click("#prev-group")
                expect(header).to_contain_text("step 1, group 0")
                # a run still training: a step written now appears (the timer re-reads the run)
                write_step(run, 3)
                expect(page.locator("#run-status")).to_contain_text("last step 3", timeout=20_000)
                page.click("#next-step")
                expect(header).to_contain_text("step 2, group 0")
                page.click("#next-step")
                expect(header).to_contain_text("step 3, group 0")
                expect(table).to_contain_text("0.5500")
                page.screenshot(path=str(shot), full_page=True)
                # the Curves tab: one small panel per diagnostic metric (here only loss), titled by it
                page.get_by_role("tab", name="Curves").click()
                expect(page.locator("#panel-0")).to_be_visible()
                expect(page.locator("#panel-0")).to_contain_text("loss")
                expect(page.locator("#panel-1")).to_be_hidden()
                page.get_by_role("tab", name="Samples").click()
                # the file route: a file of the run is served, anything else is refused
                route = src.split("file=")[0] + "file="
                inside = page.request.get(src)
                assert inside.status == 200 and inside.body()[:4] == b"\x89PNG"
                for path in (str(outside), "/etc/passwd", f"{run}/../outside.txt"):
                    r = page.request.get(route + path)
                    assert r.status in (403, 404), (path, r.status)
                    assert b"TOP SECRET" not in r.body() and b"root:" not in r.body()
                refused = page.goto(route + str(outside))
                assert refused is not None and refused.status in (403, 404)
                assert "TOP SECRET" not in page.content()
            finally:
                browser.close()
    finally:
        app.close()
    assert shot.is_file() and shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")
    if os.environ.get("MMALIGN_SCREENSHOT_DIR"):
        dest = Path(os.environ["MMALIGN_SCREENSHOT_DIR"])
        dest.mkdir(parents=True, exist_ok=True)
        for png in (shot, tmp_path / "demo_screenshot_boxes.png"):
            print(f"screenshot copied to {shutil.copy(png, dest / png.name)}")
