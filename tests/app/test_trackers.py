"""Experiment trackers through accelerate (`mmalign.app.trackers`, ``trainer.log_with``): a tiny text-to-image run
writes TensorBoard scalars, sample images and captions; videos become GIFs; W&B gets images / mp4s with
captions (a stand-in module, and a real offline run where wandb is installed); bad names and missing
packages are config errors that name the key and the pip extra."""

from __future__ import annotations

import io
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from mmalign.app import trackers
from mmalign.app.run import build_trainer
from mmalign.config import ConfigError, load_config
from mmalign.training import rundir

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "text_to_image-tiny.yaml"
ASSETS = REPO / "assets" / "text_to_image"
SMALL = [
    "trainer.steps=2",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "options.num_steps=3",
    "trainer.sample_every=1",
    "trainer.progress_bar=false",
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SD3-style model of the shapes world, barely trained (seconds): it only has to draw something."""
    from mmalign.tiny import shapes

    path = tmp_path_factory.mktemp("models") / "t2i"
    shapes.build_text_to_image(path, vae_steps=2, steps=2, batch_size=4, target_reward=None, progress=False)
    return path


def tiny_cfg(model: Path, tmp_path: Path, *extra: str):
    return load_config(
        TINY,
        [
            f"model.name_or_path={model}",
            f"output_dir={tmp_path / 'run'}",
            f"data.train={ASSETS / 'train.jsonl'}",
            f"data.eval={ASSETS / 'eval.jsonl'}",
            *SMALL,
            *extra,
        ],
    )


def train(cfg) -> list[dict[str, Any]]:
    import pipelines
    from mmalign.training.seeding import set_seed

    set_seed(cfg.seed)
    trainer = build_trainer(cfg, pipelines.get(cfg.pipeline)(cfg))
    return trainer.train()


def events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


# ----------------------------------------------------------------------------- config errors


def test_unknown_tracker_names_the_key_and_close_match(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"trainer\.log_with\[0\].*'tensorbord'.*did you mean 'tensorboard'"
    ):
        load_config(TINY, [f"output_dir={tmp_path}", "trainer.log_with=[tensorbord]"])
    with pytest.raises(ConfigError, match=r"trainer\.tracker_kwargs\.wandbb.*did you mean 'wandb'"):
        load_config(TINY, [f"output_dir={tmp_path}", "trainer.tracker_kwargs={wandbb: {mode: offline}}"])
    with pytest.raises(ConfigError, match=r"trainer\.tracker_media.*>= 0"):
        load_config(TINY, [f"output_dir={tmp_path}", "trainer.tracker_media=-1"])


def test_missing_package_names_the_key_and_extra_before_anything_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(TINY, [f"output_dir={tmp_path}", "trainer.log_with=[tensorboard, wandb]"])
    monkeypatch.setattr(trackers, "_installed", lambda package: package not in ("wandb",))
    # the check is the first act of building a trainer: no components, no Accelerator are needed to see it
    with pytest.raises(
        ConfigError, match=r"trainer\.log_with\[1\].*'wandb'.*pip install -e \"\.\[trackers\]\""
    ):
        build_trainer(cfg, None)


def test_defaults_and_flat_config(tmp_path: Path) -> None:
    cfg = load_config(TINY, [f"output_dir={tmp_path / 'runs' / 'my-run'}"])
    assert cfg.trainer.log_with == [] and cfg.trainer.tracker_media == 8
    assert trackers.project_name(cfg) == "my-run"
    assert trackers.tensorboard_dir(cfg) == tmp_path / "runs" / "my-run" / "tensorboard" / "my-run"
    assert trackers.accelerator_kwargs(cfg)["log_with"] is None
    flat = trackers.flat_config(cfg)
    assert flat["trainer.lr"] == cfg.trainer.lr and flat["options.num_steps"] == 10
    assert all(v is None or isinstance(v, bool | int | float | str) for v in flat.values())
    named = load_config(TINY, [f"output_dir={tmp_path}", "trainer.tracker_project=shapes"])
    assert trackers.project_name(named) == "shapes"
    assert trackers.scalars({"step": 3, "a": 1, "b": float("nan"), "c": "x", "d": 0.5}) == {
        "a": 1.0,
        "d": 0.5,
    }


# ----------------------------------------------------------------------------- TensorBoard


def test_tiny_run_writes_tensorboard_scalars_images_and_captions(model: Path, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard tracker needs `pip install tensorboard`")
    cfg = tiny_cfg(model, tmp_path, "trainer.log_with=[tensorboard]", "trainer.tracker_media=3")
    history = train(cfg)
    ev = events(trackers.tensorboard_dir(cfg))
    tags = ev.Tags()
    for tag in ("reward/mean", "reward/shapes_compositional/mean", "loss", "lr", "time/step_s"):
        assert tag in tags["scalars"], tag
    logged = [(e.step, e.value) for e in ev.Scalars("reward/mean")]
    assert logged == [(m["step"], pytest.approx(m["reward/mean"])) for m in history]
    # the first 3 samples' images at both sample steps, with their prompts and rewards as captions
    assert sorted(t for t in tags["images"]) == [f"samples/image/{i}" for i in range(3)]
    assert [e.step for e in ev.Images("samples/image/0")] == [1, 2]
    assert ev.Images("samples/image/0")[0].encoded_image_string.startswith(b"\x89PNG")
    text = ev.Tensors("samples/captions/text_summary")[0].tensor_proto.string_val[0].decode()
    first = rundir.read_samples(cfg.output_dir, 1)[0]
    assert first["prompt"] in text and "shapes_compositional=" in text
    # the config went in as hyperparameters; the trainer finished the trackers (nothing left to end)
    assert list(trackers.tensorboard_dir(cfg).rglob("hparams.yml"))


def test_videos_go_to_tensorboard_as_gifs(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard tracker needs `pip install tensorboard`")
    from accelerate import Accelerator

    cfg = load_config(TINY, [f"output_dir={tmp_path / 'run'}", "trainer.log_with=[tensorboard]"])
    acc = Accelerator(cpu=True, **trackers.accelerator_kwargs(cfg))
    run = trackers.RunTrackers(cfg, acc)
    run.start(0)
    video = torch.rand(5, 3, 16, 16)
    views = [{"video": video, "text": "a clip"}, {"text": "no media"}]
    rows = rundir.store_sample_media(cfg.output_dir, 1, views)
    rows = [{"prompt": f"p{i}", "rewards": {"r": 0.5}, **r} for i, r in enumerate(rows)]
    run.log_samples(1, rows, views)
    run.finish()
    assert acc.trackers == []
    ev = events(trackers.tensorboard_dir(cfg))
    (gif,) = ev.Images("samples/video/0")
    assert gif.encoded_image_string.startswith(b"GIF8") and (gif.width, gif.height) == (16, 16)
    assert Image.open(io.BytesIO(gif.encoded_image_string)).n_frames == 5


# ----------------------------------------------------------------------------- W&B


class _Media:
    def __init__(self, data: Any, caption: str | None = None, format: str | None = None) -> None:
        self.data, self.caption, self.format = data, caption, format


def test_wandb_gets_png_and_mp4_paths_with_captions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The W&B side without wandb: a stand-in module and tracker record what would be logged."""
    stub = types.ModuleType("wandb")
    stub.Image = type("Image", (_Media,), {})
    stub.Video = type("Video", (_Media,), {})
    monkeypatch.setitem(sys.modules, "wandb", stub)
    logged: list[tuple[dict[str, Any], int]] = []
    tracker = types.SimpleNamespace(name="wandb", log=lambda values, step: logged.append((values, step)))
    acc = types.SimpleNamespace(log_with=["wandb"], is_main_process=True, trackers=[tracker])
    cfg = load_config(
        TINY, [f"output_dir={tmp_path / 'run'}", "trainer.log_with=[wandb]", "trainer.tracker_media=2"]
    )
    run = trackers.RunTrackers(cfg, acc)
    run.started = True
    views = [
        {"image": torch.rand(3, 8, 8)},
        {"video": torch.rand(4, 3, 8, 8)},
        {"image": torch.rand(3, 8, 8)},
    ]
    stored = rundir.store_sample_media(cfg.output_dir, 3, views)
    rows = [{"prompt": f"prompt {i}", "rewards": {"r": i / 2, "s": None}, **r} for i, r in enumerate(stored)]
    run.log_samples(3, rows, views)
    ((values, step),) = logged
    assert step == 3
    (image,) = values["samples/images"]  # the cap (2) keeps samples 0 and 1
    (video,) = values["samples/videos"]
    root = Path(cfg.output_dir) / rundir.SAMPLES_DIR
    assert image.data == str(root / stored[0]["image"]) and image.caption == "prompt 0 | r=0.000 s=n/a"
    assert video.data == str(root / stored[1]["video"]) and video.format == "mp4"
    assert video.caption == "prompt 1 | r=0.500 s=n/a"


def test_tiny_run_logs_to_wandb_offline(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip(
        "wandb", reason='wandb is not installed (pip install -e ".[trackers]"); TensorBoard is tested'
    )
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny_cfg(
        model, tmp_path, "trainer.log_with=[wandb]", "trainer.tracker_kwargs={wandb: {mode: offline}}"
    )
    train(cfg)
    runs = list((Path(cfg.output_dir) / "wandb").glob("offline-run-*"))
    assert runs and list(runs[0].glob("*.wandb"))
