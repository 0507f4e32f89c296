"""The run directory: its layout, checkpoints, and samples written and read by kind.

One module owns the folder a run writes (``output_dir``); the trainer, `mmalign.app.evaluation`, the CLI and
the sample browser read and write it only through these functions::

    output_dir/
      config.yaml                 the resolved config of the run
      metrics.jsonl               one JSON object per logged step
      samples/step_XXXXXX.jsonl   one row per sample: group, prompt, advantage, rewards, the dataset
                                  columns the pipeline shows, and one key per sample kind (below)
      samples/step_XXXXXX/        that step's media: IIII.png, IIII.mp4 (+ IIII_frames.png);
                                  with several processes rR_IIII.* (R the rank: each process writes its own)
      checkpoints/step_XXXXXX/    trainable.safetensors, optimizer.pt, scheduler.pt, trainer_state.pt,
                                  rng_<rank>.pt, COMPLETE (written last: a folder without it is ignored)
      final/                      the trained model or adapter, `from_pretrained`-loadable

Sample kinds (`mmalign.policies.base.SAMPLE_KINDS`; what `Policy.sample_view` returns per sample):
``text`` (a string, stored in the row), ``image`` (Float[3,H,W] in [0, 1] -> PNG, the row holds its path
relative to ``samples/``), ``video`` (Float[F,3,H,W] -> H.264 mp4 through PyAV, and a strip of frames as
PNG under ``video_frames``), ``boxes`` (a list of [x1, y1, x2, y2], stored in the row).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from torch import Tensor

from mmalign.config import Config, ConfigError
from mmalign.media import save_frame_strip, save_image, save_video

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SAMPLES_DIR = "samples"
CHECKPOINTS_DIR = "checkpoints"
FINAL_DIR = "final"
CHECKPOINT_PREFIX = "step_"
COMPLETE_MARK = "COMPLETE"
TRAINABLE_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
TRAINER_STATE_FILE = "trainer_state.pt"
DISTRIBUTED_FILE = "distributed.json"
"""How `mmalign train` was launched (``distributed_type`` as accelerate names it, ``num_processes``); written
by multi-process runs, removed by a one-process run in the same folder."""
RUN_OUTPUTS = (METRICS_FILE, SAMPLES_DIR, CHECKPOINTS_DIR, FINAL_DIR, DISTRIBUTED_FILE)
"""What ``overwrite=true`` clears from an existing run directory."""


def step_name(step: int) -> str:
    """``step_XXXXXX``: the name of a step's checkpoint folder, sample file and media folder."""
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def rng_file(rank: int) -> str:
    return f"rng_{rank}.pt"


# ----------------------------------------------------------------------------- the folder


def check_output_dir(cfg: Config, resume: bool) -> None:
    """Raise the `ConfigError` the trainer would raise for ``cfg.output_dir``, without touching it.

    With `resume`, the folder must hold a complete checkpoint; without, it must not hold a run
    (a non-empty ``metrics.jsonl``) unless ``overwrite`` is set."""
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{cfg.source}: key 'output_dir': {out} is a file, not a folder")
    if resume:
        if latest_checkpoint(out) is None:
            raise ConfigError(
                f"--resume: no complete checkpoint in {out / CHECKPOINTS_DIR}; run without --resume"
            )
        return
    metrics = out / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0 and not cfg.overwrite:
        raise ConfigError(
            f"output_dir {out} already holds a run ({METRICS_FILE}). Continue it with --resume, "
            f"choose another output_dir=..., or pass overwrite=true to replace it"
        )


def clear_run(output_dir: str | Path) -> None:
    """Remove what a previous run wrote (`RUN_OUTPUTS`); other files in the folder stay."""
    out = Path(output_dir)
    for name in RUN_OUTPUTS:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def truncate_metrics(output_dir: str | Path, last_step: int) -> None:
    """Drop the metrics of steps after `last_step` (a resumed run writes them again)."""
    metrics = Path(output_dir) / METRICS_FILE
    if metrics.exists():
        kept = [
            ln
            for ln in metrics.read_text().splitlines()
            if ln.strip() and json.loads(ln)["step"] <= last_step
        ]
        metrics.write_text("".join(ln + "\n" for ln in kept))


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl`` (empty when the run logged nothing yet)."""
    metrics = Path(output_dir) / METRICS_FILE
    if not metrics.is_file():
        return []
    return [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR / step_name(step)


def pending_checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """Where a checkpoint is written before `finish_checkpoint` renames it into place."""
    return Path(output_dir) / CHECKPOINTS_DIR / f".tmp_{step_name(step)}"


def checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete checkpoint folders of a run, oldest first."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    done = [
        p for p in root.iterdir() if p.name.startswith(CHECKPOINT_PREFIX) and (p / COMPLETE_MARK).exists()
    ]
    return sorted(done, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder in `output_dir/checkpoints`, or None."""
    done = checkpoints(output_dir)
    return done[-1] if done else None


def finish_checkpoint(output_dir: str | Path, step: int, keep: int) -> Path:
    """Mark the pending checkpoint of `step` complete, move it into place, keep the newest `keep`."""
    tmp, final = pending_checkpoint_dir(output_dir, step), checkpoint_dir(output_dir, step)
    (tmp / COMPLETE_MARK).write_text(str(step))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    root = Path(output_dir) / CHECKPOINTS_DIR
    every = sorted(
        (p for p in root.iterdir() if p.name.startswith(CHECKPOINT_PREFIX)),
        key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]),
    )
    for old in every[: max(0, len(every) - keep)]:
        shutil.rmtree(old)
    return final


def store_media(
    view: dict[str, Any], folder: str | Path, name: str, relative_to: str | Path
) -> dict[str, Any]:
    """`view` (one sample's kinds) with its ``image`` / ``video`` tensors written into `folder` as
    ``<name>.png`` / ``<name>.mp4`` and replaced by paths relative to `relative_to`; a video also gets
    ``video_frames`` (a PNG strip). Text and boxes are returned as they are (boxes as plain lists)."""
    folder, base = Path(folder), Path(relative_to)
    out: dict[str, Any] = {}
    for kind, value in view.items():
        if kind == "image" and isinstance(value, Tensor):
            out[kind] = save_image(value, folder / f"{name}.png").relative_to(base).as_posix()
        elif kind == "video" and isinstance(value, Tensor):
            out[kind] = save_video(value, folder / f"{name}.mp4").relative_to(base).as_posix()
            strip = save_frame_strip(value, folder / f"{name}_frames.png")
            out["video_frames"] = strip.relative_to(base).as_posix()
        elif isinstance(value, Tensor):
            out[kind] = value.tolist()
        else:
            out[kind] = value
    return out


# ----------------------------------------------------------------------------- samples


def samples_file(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / SAMPLES_DIR / f"{step_name(step)}.jsonl"


def store_sample_media(
    output_dir: str | Path, step: int, views: list[dict[str, Any]], *, rank: int = 0, world: int = 1
) -> list[dict[str, Any]]:
    """Write the media of one process's samples of `step` into ``samples/step_XXXXXX/`` (``IIII.*``;
    ``rR_IIII.*`` with several processes) and return the views with paths relative to ``samples/``."""
    root = Path(output_dir) / SAMPLES_DIR
    folder = root / step_name(step)
    prefix = f"r{rank}_" if world > 1 else ""
    return [store_media(v, folder, f"{prefix}{i:04d}", root) for i, v in enumerate(views)]


def write_samples(output_dir: str | Path, step: int, rows: list[dict[str, Any]]) -> Path:
    """Write ``samples/step_XXXXXX.jsonl`` (rows whose media are already stored; NaN -> null)."""
    path = samples_file(output_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(jsonable(row)) + "\n")
    return path


def sample_steps(output_dir: str | Path) -> list[int]:
    """The steps that have a samples file, in order."""
    root = Path(output_dir) / SAMPLES_DIR
    if not root.is_dir():
        return []
    steps = []
    for p in root.glob(f"{CHECKPOINT_PREFIX}*.jsonl"):
        tail = p.stem[len(CHECKPOINT_PREFIX) :]
        if tail.isdigit():
            steps.append(int(tail))
    return sorted(steps)


def read_samples(output_dir: str | Path, step: int, *, resolve: bool = True) -> list[dict[str, Any]]:
    """The rows of a step's samples file; with `resolve`, media paths (``image``, ``video``,
    ``video_frames``) become absolute `Path`s inside the run directory."""
    path = samples_file(output_dir, step)
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    if resolve:
        root = Path(output_dir) / SAMPLES_DIR
        for row in rows:
            for key in ("image", "video", "video_frames"):
                if isinstance(row.get(key), str):
                    row[key] = root / row[key]
    return rows


def jsonable(obj: Any) -> Any:
    """`obj` with tensors as lists and NaN / inf as None, ready for `json.dumps`."""
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, Tensor):
        return jsonable(obj.tolist())
    return obj
