"""Experiment trackers (TensorBoard, Weights & Biases) through accelerate's trackers; optional.

`RunTrackers` starts, feeds and finishes the trackers ``trainer.log_with`` names; only the main process logs,
and a tracker that fails while logging is reported with a warning.

Details: docs/trackers.md ("mmalign.app.trackers" for how it is wired).
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

from torch import Tensor

from mmalign.config import TRACKERS, Config, ConfigError
from mmalign.data.media import frame_strip, to_uint8_hwc
from mmalign.training import rundir

log = logging.getLogger(__name__)

EXTRA = "trackers"
"""The pip extra that installs every tracker: ``pip install -e ".[trackers]"``."""
TENSORBOARD_DIR = "tensorboard"
"""TensorBoard's folder in ``output_dir`` (accelerate's ``logging_dir``); the run's events are in
``<project>/`` below it."""
PACKAGES: dict[str, tuple[str, ...]] = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",)}
"""The importable packages each tracker needs (any one of them)."""
GIF_FPS = 8
"""Frames per second of the TensorBoard GIFs (the mp4s of the run directory use 8 too)."""


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_available(cfg: Config) -> None:
    """Raise `ConfigError` naming ``trainer.log_with`` and the pip extra when a listed tracker's package is not
    installed (accelerate would drop that tracker silently)."""
    for i, name in enumerate(cfg.trainer.log_with):
        if name not in TRACKERS:
            raise ConfigError(
                f"{cfg.source}: key 'trainer.log_with[{i}]' names an unknown tracker {name!r}; "
                f"known: {', '.join(TRACKERS)}"
            )
        if not any(_installed(p) for p in PACKAGES[name]):
            raise ConfigError(
                f"{cfg.source}: key 'trainer.log_with[{i}]': tracker {name!r} needs the {PACKAGES[name][0]!r} "
                f'package, which is not installed: pip install -e ".[{EXTRA}]" (or pip install '
                f"{PACKAGES[name][0]}), or remove it from trainer.log_with"
            )


def project_name(cfg: Config) -> str:
    """``trainer.tracker_project``, else the last part of ``output_dir`` (``runs/t2i`` -> ``t2i``)."""
    if cfg.trainer.tracker_project:
        return cfg.trainer.tracker_project
    out = Path(cfg.output_dir)
    return out.name or out.resolve().name or "mmalign"


def tensorboard_dir(cfg: Config) -> Path:
    """Where TensorBoard writes the run's event files: ``output_dir/tensorboard/<project>/``."""
    return Path(cfg.output_dir) / TENSORBOARD_DIR / project_name(cfg)


def accelerator_kwargs(cfg: Config) -> dict[str, Any]:
    """The trackers' arguments of ``Accelerator(...)``: ``log_with`` (None when empty) and a
    ``ProjectConfiguration`` with ``project_dir=output_dir`` and ``logging_dir=output_dir/tensorboard``."""
    from accelerate.utils import ProjectConfiguration

    out = Path(cfg.output_dir)
    return {
        "log_with": list(cfg.trainer.log_with) or None,
        "project_config": ProjectConfiguration(project_dir=str(out), logging_dir=str(out / TENSORBOARD_DIR)),
    }


def flat_config(cfg: Config) -> dict[str, Any]:
    """The resolved config as ``{"trainer.lr": 1e-3, ...}`` of str / int / float / bool / None (lists and
    empty mappings as JSON text): what TensorBoard's hparams and W&B's config accept."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif value is None or isinstance(value, bool | int | float | str):
            out[prefix] = value
        else:
            out[prefix] = json.dumps(rundir.jsonable(value), default=str)

    walk("", cfg.to_dict())
    return out


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of one step's metrics (without ``step``, which is the trackers' step)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key == "step" or not isinstance(value, int | float):
            continue
        v = float(value)
        if math.isfinite(v):
            out[key] = v
    return out


def caption(prompt: str, rewards: dict[str, float | None]) -> str:
    """``<prompt> | reward_a=0.750 reward_b=n/a``."""
    parts = [
        f"{name}={'n/a' if v is None or not math.isfinite(v) else f'{v:.3f}'}" for name, v in rewards.items()
    ]
    return f"{prompt} | {' '.join(parts)}" if parts else prompt


def gif_bytes(video: Tensor, fps: int = GIF_FPS) -> bytes:
    """A Float[F,3,H,W] clip in [0, 1] as an animated GIF (Pillow), looping."""
    from PIL import Image

    frames = [Image.fromarray(to_uint8_hwc(f)) for f in video]
    buf = io.BytesIO()
    frames[0].save(
        buf, format="GIF", save_all=True, append_images=frames[1:], duration=max(1, round(1000 / fps)), loop=0
    )
    return buf.getvalue()


def _tensorboard_gif(writer: Any, tag: str, video: Tensor, step: int) -> None:
    """An animated GIF image summary, the one ``add_video`` writes with moviepy, written with Pillow."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    _, c, h, w = video.shape
    image = Summary.Image(height=h, width=w, colorspace=c, encoded_image_string=gif_bytes(video))
    writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)


class RunTrackers:
    """The trackers of one training run: started, fed and finished by `TrackerMonitor` (module docstring).

    With an empty ``trainer.log_with`` (or no config: ``RunTrackers(None, None)``, trackers off) every method
    does nothing. An ``Accelerator`` built elsewhere (passed to `GroupTrainer`) must have been built with
    `accelerator_kwargs` when the config lists trackers."""

    def __init__(self, cfg: Config | None, accelerator: Any, *, resume: bool = False) -> None:
        self.cfg = cfg
        self.accelerator = accelerator
        self.names = list(cfg.trainer.log_with) if cfg is not None else []
        self.resume = resume
        self.started = False
        self._failed: set[str] = set()
        if self.names:
            from accelerate.tracking import GeneralTracker

            built = {
                t.name if isinstance(t, GeneralTracker) else str(getattr(t, "value", t))
                for t in accelerator.log_with
            }
            missing = [n for n in self.names if n not in built]
            if missing:
                raise ConfigError(
                    f"{cfg.source}: key 'trainer.log_with': the Accelerator given to the trainer was built without "
                    f"the trackers {missing}; build it with Accelerator(..., "
                    f"**mmalign.app.trackers.accelerator_kwargs(cfg)) or let the trainer build it"
                )

    def start(self, step: int) -> None:
        """``init_trackers`` with the flattened config (once; `step` is the step the run continues from)."""
        cfg = self.cfg
        if not self.names or self.started or cfg is None:
            return
        acc = self.accelerator
        kwargs = {n: dict(cfg.trainer.tracker_kwargs.get(n) or {}) for n in self.names}
        if "tensorboard" in kwargs:
            if self.resume:  # TensorBoard hides what the interrupted run logged after the checkpoint
                kwargs["tensorboard"].setdefault("purge_step", step + 1)
            elif acc.is_main_process and tensorboard_dir(cfg).is_dir():
                shutil.rmtree(tensorboard_dir(cfg))  # a fresh run: no events of an earlier one
        if "wandb" in kwargs:
            kwargs["wandb"].setdefault("dir", str(Path(cfg.output_dir)))
        acc.init_trackers(project_name(cfg), config=flat_config(cfg), init_kwargs=kwargs)
        self.started = True

    def _warn(self, what: str, e: Exception) -> None:
        if what not in self._failed:
            self._failed.add(what)
            log.warning("trackers: %s failed (%s: %s); training goes on", what, type(e).__name__, e)
        else:
            log.debug("trackers: %s failed again: %s", what, e)

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        """``accelerator.log`` of the step's finite numbers."""
        if not self.started:
            return
        values = scalars(metrics)
        if not values:
            return
        try:
            self.accelerator.log(values, step=step)
        except Exception as e:  # a tracker's hiccup (network, disk) does not stop training
            self._warn("logging metrics", e)

    def log_samples(self, step: int, rows: list[dict[str, Any]], views: list[dict[str, Any]]) -> None:
        """Log the images / videos of the first ``trainer.tracker_media`` samples of this process (main only).
        `rows` are the samples as the run directory writes them (``prompt``, ``rewards``, media paths relative
        to ``samples/``), `views` the same samples as `Policy.sample_view` gave them (tensors)."""
        acc, cfg = self.accelerator, self.cfg
        if not self.started or cfg is None or not acc.is_main_process or cfg.trainer.tracker_media <= 0:
            return
        root = Path(cfg.output_dir) / rundir.SAMPLES_DIR
        picks = [
            (i, caption(str(rows[i].get("prompt", "")), dict(rows[i].get("rewards") or {})))
            for i in range(len(views))
            if isinstance(views[i].get("image"), Tensor) or isinstance(views[i].get("video"), Tensor)
        ][: cfg.trainer.tracker_media]
        if not picks:
            return
        for tracker in acc.trackers:
            try:
                if tracker.name == "tensorboard":
                    self._tensorboard_samples(tracker.writer, step, picks, views)
                elif tracker.name == "wandb":
                    self._wandb_samples(tracker, step, picks, views, rows, root)
            except Exception as e:
                self._warn(f"logging samples to {tracker.name}", e)

    def _tensorboard_samples(
        self, writer: Any, step: int, picks: list[tuple[int, str]], views: list[dict[str, Any]]
    ) -> None:
        lines = []
        for i, text in picks:
            image, video = views[i].get("image"), views[i].get("video")
            if isinstance(image, Tensor):
                tag = f"samples/image/{i}"
                writer.add_image(tag, image.detach().float().clamp(0, 1).cpu(), step, dataformats="CHW")
                lines.append(f"- `{tag}`: {text}")
            if isinstance(video, Tensor):
                clip = video.detach().float().clamp(0, 1).cpu()
                try:
                    tag = f"samples/video/{i}"
                    _tensorboard_gif(writer, tag, clip, step)
                except Exception as e:  # e.g. a tensorboardX writer: the strip of frames instead
                    log.debug("trackers: TensorBoard GIF failed (%s); logging the frame strip", e)
                    tag = f"samples/video_frames/{i}"
                    writer.add_image(tag, frame_strip(clip), step, dataformats="CHW")
                lines.append(f"- `{tag}`: {text}")
        writer.add_text("samples/captions", "\n".join(lines), step)
        writer.flush()

    def _wandb_samples(
        self,
        tracker: Any,
        step: int,
        picks: list[tuple[int, str]],
        views: list[dict[str, Any]],
        stored: list[dict[str, Any]],
        root: Path,
    ) -> None:
        import wandb

        images, videos = [], []
        for i, text in picks:
            image, video = views[i].get("image"), views[i].get("video")
            if isinstance(image, Tensor):
                path = stored[i].get("image") if i < len(stored) else None
                src = str(root / path) if isinstance(path, str) else to_uint8_hwc(image)
                images.append(wandb.Image(src, caption=text))
            if isinstance(video, Tensor):
                path = stored[i].get("video") if i < len(stored) else None
                if isinstance(path, str) and (root / path).is_file():
                    videos.append(wandb.Video(str(root / path), caption=text, format="mp4"))
                else:  # no mp4 to point at: the strip of frames
                    images.append(wandb.Image(to_uint8_hwc(frame_strip(video)), caption=text))
        values: dict[str, Any] = {}
        if images:
            values["samples/images"] = images
        if videos:
            values["samples/videos"] = videos
        if values:
            tracker.log(values, step=step)

    def finish(self) -> None:
        """Finish the started trackers (``tracker.finish()``, as ``end_training`` does) and forget them, so a
        later ``accelerator.end_training()`` only tears down the process group."""
        if not self.started:
            return
        self.started = False
        for tracker in list(self.accelerator.trackers):
            try:
                tracker.finish()
            except Exception as e:
                self._warn(f"finishing {tracker.name}", e)
        self.accelerator.trackers.clear()


class TrackerMonitor:
    """`RunTrackers` as a `GroupTrainer` monitor (`mmalign.training.callbacks.TrainerCallback`): the trainer builds its
    ``Accelerator`` with `accelerator_kwargs`, and the trackers start with `GroupTrainer.train`, log every
    logged step's metrics and every sample step's media, and finish when training ends.

    Building it checks that the listed trackers are installed (`check_available`): before anything else."""

    def __init__(self, cfg: Config, *, resume: bool = False) -> None:
        check_available(cfg)
        self.cfg = cfg
        self.resume = resume
        self.run = RunTrackers(None, None)
        """The run's trackers (off until the trainer's accelerator exists)."""

    def accelerator_kwargs(self) -> dict[str, Any]:
        return accelerator_kwargs(self.cfg)

    def on_init(self, trainer: Any) -> None:
        self.run = RunTrackers(self.cfg, trainer.accelerator, resume=self.resume)

    def on_train_start(self, trainer: Any, step: int) -> None:
        self.run.start(step)

    def on_log(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        self.run.log_metrics(metrics, step)

    def on_samples(
        self, trainer: Any, step: int, rows: list[dict[str, Any]], views: list[dict[str, Any]]
    ) -> None:
        self.run.log_samples(step, rows, views)  # this process's first samples; main only

    def on_train_end(self, trainer: Any) -> None:
        self.run.finish()
