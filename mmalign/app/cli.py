"""The `mmalign` command.

Subcommands ``train``, ``sample``, ``eval``, ``list``, ``plan``, ``probe``, ``parity``, ``grounding``,
``doctor``, ``demo`` and ``tiny`` (``mmalign --help``); every command validates before it builds a model,
and a wrong one fails with one ``mmalign: error:`` line.

Details: docs/architecture.md, "mmalign.app.cli".
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmalign.config import Config


PEER_GONE_HINT = (
    "(another process of this launch stopped first and closed its connections: its own 'mmalign: error' line "
    "above is the cause, and the launcher's summary below names it)"
)
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def launch_rank() -> str | None:
    """``"rank R of N"`` in a multi-process launch (``RANK`` and ``WORLD_SIZE`` > 1, set by torchrun and accelerate
    launch), else None: what a process's error line is tagged with, so that interleaved logs say who failed."""
    from mmalign.training.distributed import launched_processes

    world = launched_processes()
    if world < 2:
        return None
    rank = os.environ.get("RANK", "").strip()
    return f"rank {rank if rank.isdigit() else '?'} of {world}"


def peer_gone(e: BaseException) -> bool:
    """`e` is a collective's failure because another process of the launch is gone (gloo's "Connection closed by
    peer" / "reset by peer", a broken pipe): a consequence, not the cause, of a multi-process run's failure."""
    text = f"{e} {e.__cause__ or ''}"
    return isinstance(e, RuntimeError | ConnectionError | BrokenPipeError) and any(
        x in text for x in _PEER_GONE
    )


def _record_for_launcher(e: BaseException) -> None:
    """Write `e` to torchrun's per-process error file (``TORCHELASTIC_ERROR_FILE``; torch's `ErrorHandler`), so the
    launcher's failure summary shows this message instead of "To enable traceback see ...". A consequence of a
    peer's failure (`peer_gone`) is not recorded: the summary then names the process that failed first."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(e)
    except Exception as err:  # noqa: BLE001 - the error line is printed already; the summary is a courtesy
        print(f"mmalign: could not write the launcher's error file: {err}", file=sys.stderr)


def _expected(e: BaseException) -> bool:
    """Reported as one `mmalign: error: ...` line: an `MmalignError` (config, data, registry, plugin, reward,
    training errors) or an OSError (a file that cannot be read or written). Anything else is a bug and also
    prints its traceback."""
    from mmalign.errors import MmalignError

    return isinstance(e, MmalignError | OSError)


def _prepare(
    args: argparse.Namespace, *, resume: bool | None = None, eval_rewards: bool = False
) -> tuple[Config, Callable[[Config], Any]]:
    """The config (with overrides; its schema checked by `mmalign.config.load_config`), put through the one
    validation pass of a command (`mmalign.app.preflight.validate`: pipeline and registry names, the output
    directory for `resume` not None, data files, rewards, model folders), and its pipeline's ``build``.
    ``build`` then reads the data files before it builds or loads the model."""
    import pipelines
    from mmalign.app.preflight import validate
    from mmalign.config import load_config

    _check_config_file(args.config)
    cfg = load_config(args.config, args.overrides, pipeline_finder=pipelines.find)
    build = validate(cfg, resume=resume, eval_rewards=eval_rewards)
    return cfg, build


def _check_config_file(config: str) -> None:
    """A config path that is not a file is a `ConfigError` that suggests the closest names (difflib) among the
    YAML files of its folder and of ``configs/`` (in the working directory and in this checkout)."""
    import difflib

    from mmalign.config import ConfigError

    path = Path(config)
    if path.is_file():
        return
    here = Path.cwd().resolve()
    found: dict[str, str] = {}  # the path shown (relative to the working directory when inside it) -> name
    for folder in (path.parent, Path("configs"), Path(__file__).resolve().parents[2] / "configs"):
        if folder.is_dir():
            for file in folder.glob("*.y*ml"):
                real = file.resolve()
                found.setdefault(
                    str(real.relative_to(here) if real.is_relative_to(here) else real), file.name
                )
    close = difflib.get_close_matches(path.name, sorted(set(found.values())), n=3, cutoff=0.6)
    suggestions = [shown for name in close for shown, n in sorted(found.items()) if n == name][:3]
    what = " (it is a directory)" if path.is_dir() else ""
    hint = f"; did you mean {' or '.join(suggestions)}?" if suggestions else ""
    raise ConfigError(f"config file not found: {path}{what}{hint}")


def load_components(
    args: argparse.Namespace, *, resume: bool | None = None, eval_rewards: bool = False
) -> tuple[Config, Any]:
    """The checked config (`_prepare`) and the components its pipeline builds. The global RNGs are seeded
    with ``seed`` first: torch seeds its default generator randomly in every new process, so without this
    the random parts of model construction (a LoRA adapter's initial A matrices) would differ between two
    runs of the same config, and a resumed run would not repeat an uninterrupted one."""
    from mmalign.training.seeding import set_seed

    cfg, build = _prepare(args, resume=resume, eval_rewards=eval_rewards)
    set_seed(cfg.seed)
    return cfg, build(cfg)


def _prepare_launch() -> None:
    """Before accelerate's state exists: a multi-process launch on a machine without CUDA runs on CPU
    processes (gloo). Without this, ``Accelerator(cpu=False)`` ignores the launch and every process would
    train alone, all of them into the same output directory."""
    from mmalign.training.distributed import launched_processes

    if launched_processes() > 1:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("ACCELERATE_USE_CPU", "true")


def distributed_info(distributed_type: Any, num_processes: int) -> dict[str, Any]:
    """``{"distributed_type": "MULTI_CPU", "num_processes": 2}`` (accelerate's name of the type)."""
    return {
        "distributed_type": str(getattr(distributed_type, "value", distributed_type)),
        "num_processes": int(num_processes),
    }


def _process_state(cfg: Config) -> Any:
    """accelerate's process state for `sample` / `eval` (rank, number of processes, gather); a plain stand-in
    in a one-process run, which then sets up no accelerate state."""
    from mmalign.training.distributed import check_launch, launched_processes

    if launched_processes() == 1:
        from types import SimpleNamespace

        return SimpleNamespace(distributed_type="NO", num_processes=1, process_index=0, is_main_process=True)
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    # (Accelerator reads ACCELERATE_USE_CPU itself; PartialState does not)
    state = PartialState(cpu=cfg.trainer.cpu or parse_flag_from_env("ACCELERATE_USE_CPU"))
    check_launch(state.distributed_type, state.num_processes)
    return state


def _end_processes(args: argparse.Namespace, state: Any) -> None:
    """Close the process group of a multi-process `sample` / `eval` (see `main` for the exit)."""
    if state.num_processes > 1:
        state.wait_for_everyone()
        state.destroy_process_group()
        args._multi_process = True


def cmd_train(args: argparse.Namespace) -> int:
    """Train (or, with ``--resume``, continue) a run. Before any model is built: the one validation pass
    (`_prepare`), the run lock (`mmalign.training.runlock`: a second writer into the same output_dir is refused, naming
    the first), and for a resume the config compared with the run's saved one (`mmalign.training.resume.resume_changes`:
    a change it cannot apply is refused) and a finished run reported as such."""
    from mmalign.app.run import build_trainer
    from mmalign.training import rundir, runlock
    from mmalign.training.seeding import set_seed

    cfg, build = _prepare(args, resume=args.resume)
    args._output_dir = cfg.output_dir  # (for the message of an interrupt: `_interrupted`)
    lock = runlock.acquire(cfg.output_dir, command=_command_line(args)) if _main_rank() else None
    try:
        rundir.check_output_dir(cfg, args.resume)  # again, now that no other writer can change the folder
        if args.resume:
            from mmalign.training.resume import resume_changes

            resume_changes(cfg.output_dir, cfg)  # a change a resume cannot apply fails here, before the model
            if _finished(args, cfg):
                return 0
        set_seed(cfg.seed)
        trainer = build_trainer(cfg, build(cfg), resume=args.resume)
        args._trainer = trainer
        return _train(args, cfg, trainer)
    finally:
        if lock is not None:
            lock.release()


def _train(args: argparse.Namespace, cfg: Config, trainer: Any) -> int:
    """`cmd_train` once the trainer is built: what a resume loaded and changed, the training, the summary."""
    import json

    from mmalign.training import rundir
    from mmalign.training.distributed import check_launch

    acc = trainer.accelerator
    check_launch(acc.distributed_type, acc.num_processes)
    if trainer.is_main:
        if trainer.resumed_from is not None:
            print(f"resuming from step {trainer.step} (checkpoint {trainer.resumed_from})", flush=True)
            for change in trainer.config_changes:
                print(f"resume: {change.describe()} (applied: {change.how})", flush=True)
            if trainer.step >= cfg.trainer.steps:
                print(
                    f"step {trainer.step} of trainer.steps={cfg.trainer.steps} is trained already: writing "
                    f"{Path(cfg.output_dir) / rundir.FINAL_DIR} only",
                    flush=True,
                )
        info = distributed_info(acc.distributed_type, acc.num_processes)
        record = Path(cfg.output_dir) / rundir.DISTRIBUTED_FILE
        if acc.num_processes > 1:
            record.write_text(json.dumps(info) + "\n")
            print(f"distributed: {info['distributed_type']}, {info['num_processes']} processes", flush=True)
        elif record.exists():
            record.unlink()
    history = trainer.train()
    trainer.accelerator.end_training()  # closes the process group of a multi-process run cleanly
    args._multi_process = trainer.world > 1
    if trainer.is_main and history:
        first, last = history[0], history[-1]
        print(
            f"done: steps {first['step']}..{last['step']}, reward/mean {first.get('reward/mean', float('nan')):.3f} "
            f"-> {last.get('reward/mean', float('nan')):.3f}; run directory {cfg.output_dir}"
        )
    return 0


def _main_rank() -> bool:
    """Whether this is the main process (rank 0) of the launch, read before accelerate exists: ``RANK`` (torchrun,
    accelerate launch) or an MPI launcher's rank, as accelerate reads it; a plain run is rank 0."""
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(name, "").strip():
            try:
                return int(os.environ[name]) == 0
            except ValueError:
                return True
    return True


def _command_line(args: argparse.Namespace, *, resume: bool | None = None, extra: Sequence[str] = ()) -> str:
    """The `mmalign train` command of `args` (shell-quoted), with ``--resume`` when `resume` (default: as
    given) and `extra` overrides after the given ones."""
    import shlex

    resume = bool(getattr(args, "resume", False)) if resume is None else resume
    words = ["mmalign", "train", args.config, *args.overrides, *extra] + (["--resume"] if resume else [])
    return shlex.join(words)


def _finished(args: argparse.Namespace, cfg: Config) -> bool:
    """A resume of a run that is trained to ``trainer.steps`` (its newest checkpoint, and ``final/``, exist):
    says so, and how to train further; nothing is loaded."""
    from mmalign.training import rundir

    out = Path(cfg.output_dir)
    latest = rundir.latest_checkpoint(out)
    if latest is None or not (out / rundir.FINAL_DIR).is_dir():
        return False
    step, steps = rundir.checkpoint_step(latest), cfg.trainer.steps
    if step < steps:
        return False
    if _main_rank():
        print(
            f"{out} is finished: trained to step {step} (trainer.steps={steps}; checkpoint {latest}, model in "
            f"{out / rundir.FINAL_DIR}). Nothing to do. To train further, raise trainer.steps on --resume: "
            f"{_command_line(args, resume=True, extra=[f'trainer.steps={max(step, steps) * 2}'])}"
        )
    return True


def _interrupted(args: argparse.Namespace) -> str:
    """What Ctrl-C prints. For `mmalign train` (its main process): the step it stopped at, the last complete
    checkpoint and the command that continues from it (or, with none, the one that starts again)."""
    out = getattr(args, "_output_dir", None)
    if getattr(args, "command", None) != "train" or out is None or not _main_rank():
        return "interrupted"
    from mmalign.training import rundir

    trainer = getattr(args, "_trainer", None)
    if trainer is None:
        where = "interrupted before training"
    elif trainer.step < trainer.cfg.trainer.steps:
        where = f"interrupted at step {trainer.step + 1}"
    else:
        where = (
            f"interrupted after the last step ({trainer.step}), while writing {Path(out) / rundir.FINAL_DIR}"
        )
    done = rundir.checkpoints(out)
    if done:
        return (
            f"{where}. The last complete checkpoint: {done[-1]} (step {rundir.checkpoint_step(done[-1])}; "
            f"later steps are not kept). Continue with:\n  {_command_line(args, resume=True)}"
        )
    metrics = Path(out) / rundir.METRICS_FILE
    again = ["overwrite=true"] if metrics.is_file() and metrics.stat().st_size > 0 else []
    return (
        f"{where}, before the first checkpoint in {Path(out) / rundir.CHECKPOINTS_DIR}: nothing to resume from. "
        f"Start again with:\n  {_command_line(args, resume=False, extra=again)}"
    )


def _checkpoint(cfg: Config, spec: str, what: str) -> Path | None:
    """The checkpoint folder `spec` names (None: the base model), resolved before any model is loaded. A
    `spec` that names no checkpoint is a `ConfigError` listing the run's checkpoints; ``latest`` with none
    prints a warning (`_no_checkpoint_warning`) and gives None."""
    from mmalign.app.evaluation import resolve_checkpoint
    from mmalign.config import ConfigError

    try:
        ckpt = resolve_checkpoint(cfg.output_dir, spec)
    except ConfigError as e:
        raise ConfigError(f"{e}. {_existing_checkpoints(cfg)}") from None
    if ckpt is None and spec == "latest":
        print(_no_checkpoint_warning(cfg, what), file=sys.stderr, flush=True)
    return ckpt


def _shared_checkpoint(cfg: Config, spec: str, what: str, state: Any) -> Path | None:
    """`_checkpoint` of `spec`, resolved by the main process only and used by every process of a multi-process
    `sample` / `eval` (accelerate's `state`): resolved on each, a run still training could finish or rotate a
    checkpoint between their look-ups, and the processes would load different weights. A failure on the main
    process is raised on every process."""
    answer: tuple[str, Any] | None = None
    error: Exception | None = None
    if state.is_main_process:
        try:
            answer = ("ok", _checkpoint(cfg, spec, what))
        except Exception as e:  # noqa: BLE001 - shared with the other processes first, then raised here
            error, answer = e, ("error", (type(e).__name__, str(e)))
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        answer = broadcast_object_list([answer], from_process=0)[0]
    if error is not None:
        raise error
    assert answer is not None
    kind, value = answer
    if kind == "error":
        from mmalign.errors import CheckpointError, ConfigError

        name, message = value
        kinds = {"ConfigError": ConfigError, "CheckpointError": CheckpointError}
        raise kinds.get(name, RuntimeError)(f"(the main process) {message}")
    return value


def _existing_checkpoints(cfg: Config) -> str:
    """The run's complete checkpoints, for a message: what ``--checkpoint`` may name."""
    from mmalign.training import rundir

    root = Path(cfg.output_dir) / rundir.CHECKPOINTS_DIR
    done = rundir.checkpoints(cfg.output_dir)
    if not done:
        return f"{root} holds no complete checkpoint: use --checkpoint base (the base model) or another run's folder"
    return (
        f"The checkpoints of {cfg.output_dir}: {', '.join(str(c) for c in done)}; or --checkpoint latest "
        "(the newest) or base (the base model)"
    )


def _no_checkpoint_warning(cfg: Config, what: str) -> str:
    """The warning of `sample` / `eval` when ``--checkpoint latest`` finds no checkpoint in the run."""
    from mmalign.training import rundir

    root = Path(cfg.output_dir) / rundir.CHECKPOINTS_DIR
    why = "does not exist" if not Path(cfg.output_dir).is_dir() else "holds no complete checkpoint"
    return (
        f"mmalign: warning: no checkpoint: {root} {why} (is output_dir right? has the run saved one?): {what}. "
        "Pass --checkpoint base to use the base model on purpose, or --checkpoint PATH"
    )


def _prompt_rows(args: argparse.Namespace, cfg: Config) -> list[dict] | None:
    """The prompts of --prompt / --prompts (read before the model is loaded); None: the eval prompts."""
    from mmalign.data.rows import load_prompt_rows

    if args.prompt:
        return [{"prompt": p} for p in args.prompt]
    if args.prompts:
        return load_prompt_rows(args.prompts, cfg.data.prompt_template)
    return None


def cmd_sample(args: argparse.Namespace) -> int:
    """Generate `n` samples per prompt from a checkpoint: a PNG grid (images; for videos, of frame strips),
    media files (mp4 + frame strip per video) and a JSONL. On N processes each generates its chunks of
    ``eval.prompts_per_batch`` prompts (`mmalign.app.evaluation.generate_chunks`) and the first writes them all,
    in the order one process would."""

    import torch

    from mmalign.app.evaluation import eval_rows, generate_chunks, load_agreed
    from mmalign.data.media import save_grid
    from mmalign.training import rundir

    cfg, build = _prepare(args)
    state = _process_state(cfg)
    main_process = state.is_main_process
    ckpt = _shared_checkpoint(cfg, args.checkpoint, "using the base model", state)
    rows = _prompt_rows(args, cfg)
    components = build(cfg)
    if ckpt is not None:
        # the one loaded: a checkpoint rotated away since falls back to the newest, the same on every process
        ckpt = load_agreed(components.policy, ckpt, state.process_index, state.num_processes)  # type: ignore[attr-defined]
    if rows is None:
        rows = eval_rows(cfg, components)[: args.max_prompts]
    seed = cfg.eval.seed if args.seed is None else args.seed
    policy = components.policy  # type: ignore[attr-defined]
    local = []
    for c, part in generate_chunks(
        policy,
        rows,
        args.n,
        seed=seed,
        prompts_per_batch=cfg.eval.prompts_per_batch,
        progress=main_process,
        rank=state.process_index,
        world=state.num_processes,
    ):
        images = part.outputs.get("images")
        videos = part.outputs.get("videos")
        if images is None and videos is not None:  # a grid of frame strips (up to 8 frames of each video)
            idx = torch.linspace(0, videos.shape[1] - 1, min(videos.shape[1], 8)).round().long()
            images = torch.cat(list(videos[:, idx].movedim(1, 0)), dim=-1)
        local.append((c, list(part.prompts), policy.sample_view(part), images, videos is not None))
    if state.num_processes > 1:
        from accelerate.utils import gather_object

        local = sorted(gather_object(local), key=lambda t: t[0])
    if main_process:
        if state.num_processes > 1:
            info = distributed_info(state.distributed_type, state.num_processes)
            print(f"distributed: {info['distributed_type']}, {info['num_processes']} processes", flush=True)
        _write_samples(args, cfg, ckpt, rows, local, rundir, save_grid)
    _end_processes(args, state)
    return 0


def _write_samples(
    args: argparse.Namespace,
    cfg: Config,
    ckpt: Path | None,
    rows: list[dict],
    chunks: list[tuple[int, list[str], list[dict[str, Any]], Any, bool]],
    rundir: Any,
    save_grid: Callable[..., Path],
) -> None:
    """`mmalign sample`'s files from the generated chunks (in chunk order): samples.jsonl, media/, grid.png."""
    import json

    import torch

    out = (
        Path(args.out)
        if args.out
        else Path(cfg.output_dir) / rundir.CLI_SAMPLES_DIR / (ckpt.name if ckpt else "base")
    )
    out.mkdir(parents=True, exist_ok=True)
    prompts = [p for _, ps, _, _, _ in chunks for p in ps]
    views = [v for _, _, vs, _, _ in chunks for v in vs]
    parts = [im for _, _, _, im, _ in chunks if im is not None]
    images = torch.cat(parts, dim=0) if parts and len(parts) == len(chunks) else None
    videos = any(is_video for *_, is_video in chunks)
    with (out / "samples.jsonl").open("w") as f:
        for i in range(len(prompts)):
            row = {"prompt": prompts[i], "sample": i % args.n}
            row.update(
                rundir.store_media(views[i], out / "media", f"{i // args.n:03d}_{i % args.n:02d}", out)
            )
            f.write(json.dumps(rundir.jsonable(row)) + "\n")
    what = f"{len(rows)} prompts x {args.n} samples ({'checkpoint ' + str(ckpt) if ckpt else 'base model'})"
    if images is not None:
        grid = save_grid(images, out / "grid.png", ncols=args.n)
        kind = "frame strips, " if videos else ""
        print(f"{what}: grid {grid} ({kind}a row per prompt), media/ and samples.jsonl in {out}")
    else:
        print(f"{what}: {out / 'samples.jsonl'}")


def cmd_eval(args: argparse.Namespace) -> int:
    """Before/after report: the base model and a checkpoint scored on the evaluation prompts."""
    from mmalign.app.evaluation import evaluate_run, format_report, write_report
    from mmalign.training import rundir

    cfg, build = _prepare(args, eval_rewards=True)
    state = _process_state(cfg)
    ckpt = _shared_checkpoint(cfg, args.checkpoint, "scoring the base model only", state)
    components = build(cfg)
    out = Path(args.out) if args.out else Path(cfg.output_dir) / rundir.EVAL_FILE
    report = evaluate_run(
        cfg,
        components,
        checkpoint=ckpt,
        compare_base=not args.no_base,
        progress=state.is_main_process,
        rank=state.process_index,
        world=state.num_processes,
        report_path=out if state.is_main_process else None,  # (after each half: keeps the base half)
    )
    info = distributed_info(state.distributed_type, state.num_processes)
    report.update(info)
    if state.is_main_process:
        if state.num_processes > 1:
            print(f"distributed: {info['distributed_type']}, {info['num_processes']} processes", flush=True)
        write_report(report, out)
        print(format_report(report))
        print(f"report: {out}")
        if (
            ckpt is None and args.checkpoint == "latest"
        ):  # (said before the model loaded; again under the report)
            print(_no_checkpoint_warning(cfg, "scored the base model only"), file=sys.stderr)
    _end_processes(args, state)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """What the registries hold (`mmalign.app.listing`: from its cache when the code has not changed)."""
    from mmalign.app.listing import listing

    out, err = listing(args.what)
    sys.stdout.write(out)
    sys.stderr.write(err)
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``mmalign`` parser; `command` (the first argument) gets its full subparser when it is one of the
    `TOOL_COMMANDS`, which are otherwise listed without importing their modules."""
    p = argparse.ArgumentParser(
        prog="mmalign", description="Group-relative RL for multimodal and generative models"
    )
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train with a YAML config")
    t.add_argument("config", help="path to a YAML config (see configs/)")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-5 output_dir=runs/x")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir")
    t.set_defaults(func=cmd_train)

    def checkpoint_arg(q: argparse.ArgumentParser) -> None:
        q.add_argument("config", help="path to a YAML config (see configs/)")
        q.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.group_size=8")
        q.add_argument(
            "--checkpoint",
            default="latest",
            help="'latest' (newest checkpoint in output_dir; the base model if none), 'base', or a checkpoint folder",
        )

    sm = sub.add_parser(
        "sample", help="generate samples for prompts from a checkpoint (a PNG grid for images)"
    )
    checkpoint_arg(sm)
    sm.add_argument("--prompt", action="append", help="a prompt (repeatable); default: the eval prompts")
    sm.add_argument("--prompts", help="a .txt (one prompt per line) or .jsonl file of prompts")
    sm.add_argument("-n", type=int, default=4, help="samples per prompt (default 4)")
    sm.add_argument("--max-prompts", type=int, default=8, help="prompts taken from the eval data (default 8)")
    sm.add_argument("--seed", type=int, default=None, help="sampling seed (default eval.seed)")
    sm.add_argument("--out", help="output folder (default OUTPUT_DIR/samples_cli/<checkpoint>)")
    sm.set_defaults(func=cmd_sample)

    ev = sub.add_parser(
        "eval", help="score the base model and a checkpoint on the eval prompts (before/after)"
    )
    checkpoint_arg(ev)
    ev.add_argument("--no-base", action="store_true", help="score only the checkpoint")
    ev.add_argument("--out", help="report file (default OUTPUT_DIR/eval.json)")
    ev.set_defaults(func=cmd_eval)

    gr = sub.add_parser(
        "grounding",
        help="grounding data: convert COCO / RefCOCO annotations to JSONL rows, or check a JSONL file",
        add_help=False,
    )
    gr.add_argument("args", nargs=argparse.REMAINDER, help="see `mmalign grounding --help`")
    # (main() hands `mmalign grounding ...` to pipelines.grounding.data.main before this parser runs)

    for name, text in (
        ("doctor", "diagnose a run directory: flat rewards, zero-std groups, clipping, NaNs, tool use, KL"),
        ("demo", "browse and compare runs' samples, rewards and curves in a Gradio app"),
    ):
        extra = sub.add_parser(name, help=text, add_help=False)
        extra.add_argument("args", nargs=argparse.REMAINDER, help=f"see `mmalign {name} --help`")
        # (main() hands `mmalign doctor|demo ...` to their own parsers before this parser runs)

    tb = sub.add_parser("tiny", help="the tiny offline models: list their builders, or (re)build one")
    tsub = tb.add_subparsers(dest="tiny_command", required=True)
    tsub.add_parser("list", help="the tiny-model builders and where the tiny configs keep their models")
    tbuild = tsub.add_parser("build", help="(re)build a tiny model (the shipped folders are their outputs)")
    tbuild.add_argument("name", help="a builder name (`mmalign tiny list`)")
    tbuild.add_argument("--out", help="folder to write (default: where the tiny configs load it from)")
    tb.set_defaults(func=cmd_tiny)

    ls = sub.add_parser("list", help="show what is registered")
    ls.add_argument(
        "what",
        nargs="?",
        default="all",
        choices=[
            "pipelines",
            "rewards",
            "estimators",
            "losses",
            "filters",
            "samplers",
            "steps",
            "loops",
            "all",
        ],
    )
    ls.set_defaults(func=cmd_list)

    for name, (module, text) in TOOL_COMMANDS.items():
        if name == command:  # the command being run: its full parser (imports torch)
            importlib.import_module(module).add_parser(sub)
        else:  # listed in `mmalign --help` without importing its module (a second of torch at start-up)
            stub = sub.add_parser(name, help=text, add_help=False)
            stub.add_argument("args", nargs=argparse.REMAINDER, help=f"see `mmalign {name} --help`")
    return p


TOOL_COMMANDS = {
    "plan": (
        "mmalign.app.plan",
        "predict the peak memory per device and the time of a training step, without a GPU",
    ),
    "probe": (
        "mmalign.app.probe",
        "sample the base model and report its reward distribution, flat groups per group size, box conventions",
    ),
    "parity": (
        "mmalign.app.parity",
        "re-score one rollout with unchanged weights per micro-batch size, precision and engine: is ratio = 1?",
    ),
}
"""The subcommands whose modules `build_parser` imports only when they are the command run: name -> (module
with an ``add_parser(subparsers)`` that sets ``func``, the help line of `mmalign --help`)."""


def tiny_model_paths() -> dict[str, str]:
    """Builder name -> the folder the tiny configs (``configs/*-tiny.yaml``) load its model from."""
    import yaml

    paths: dict[str, str] = {}
    for config in sorted(Path("configs").glob("*-tiny.yaml")):
        data = yaml.safe_load(config.read_text()) or {}
        model = data.get("model") or {}
        if model.get("tiny_builder") and model.get("name_or_path"):
            paths.setdefault(model["tiny_builder"], model["name_or_path"])
        for options in (data.get("options") or {}, data.get("eval") or {}):
            for path, builder in (options.get("reward_models") or {}).items():
                paths.setdefault(builder, path)
    return paths


def cmd_tiny(args: argparse.Namespace) -> int:
    """``mmalign tiny list`` / ``mmalign tiny build NAME [--out PATH]``: a rebuild replaces the folder only
    once the new one is complete."""
    import shutil

    from mmalign.app.fixtures import require_fixtures
    from mmalign.config import ConfigError

    require_fixtures(f"mmalign tiny {args.tiny_command}")
    from mmalign import tiny

    paths = tiny_model_paths()
    if args.tiny_command == "list":
        for name in tiny.DISCOVERY.names():
            where = paths.get(name)
            print(f"  {name:24s} {tiny.estimate(name):>10s}  {where or '(tests only)'}")
        return 0
    tiny.DISCOVERY.get(args.name)  # an unknown name: RegistryError listing the builders
    out = Path(args.out or paths.get(args.name) or f"assets/models/{args.name}")
    if (out.exists() or out.is_symlink()) and not (out.is_dir() and (out / tiny.MARK_FILE).is_file()):
        raise ConfigError(  # a rebuild replaces only a folder a tiny build wrote (it holds MARK_FILE)
            f"mmalign tiny build: {out} exists and is not a tiny model mmalign built (no {tiny.MARK_FILE} in "
            "it), so it is not replaced; choose another --out or remove it yourself"
        )
    staged = out.with_name(out.name + ".new")
    # a rebuild killed between its build and the swap left a complete copy there
    tiny.remove_stale(staged, tiny.MARK_FILE, what="a tiny build's staged copy")
    fresh = tiny.build(args.name, staged)
    if out.exists():
        shutil.rmtree(out)
    fresh.rename(out)
    print(f"wrote {out}")
    return 0


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`parser`'s arguments, where `train`, `sample` and `eval` also take ``key=value`` overrides after an
    option (``mmalign train CFG --resume trainer.lr=1e-4``), appended to those before it in their order."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        if getattr(args, "command", None) not in ("train", "sample", "eval") or not all(
            "=" in a and not a.startswith("-") for a in extra
        ):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["grounding"]:  # its own parser (convert / check), options such as --help included
        from pipelines.grounding import data as grounding

        return grounding.main(argv[1:], prog="mmalign grounding")
    if argv[:1] == ["doctor"]:  # learning diagnostics of a run directory (mmalign/app/doctor.py)
        from mmalign.app.doctor import doctor_main

        return doctor_main(argv[1:])
    if argv[:1] == ["demo"]:  # the Gradio sample browser (mmalign/app/demo.py, the `demo` extra)
        from mmalign.app.demo import demo_main

        return demo_main(argv[1:])
    parser = build_parser(argv[0] if argv else None)
    args = _parse(parser, argv)
    from mmalign.app.console import quiet_third_party_warnings, setup_logging

    setup_logging()  # log lines go above the progress bar, not onto it
    quiet_third_party_warnings()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        if args.command in ("train", "sample", "eval"):
            _prepare_launch()
        rc = int(args.func(args) or 0)
        if getattr(args, "_multi_process", False):
            # Everything is written and closed. Skip interpreter teardown, where gloo's threads can
            # abort a finished multi-process run ("terminate called without an active exception").
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
        return rc
    except KeyboardInterrupt:
        try:
            message = _interrupted(args)
        except Exception:  # noqa: BLE001 - reading the run directory must not hide the interrupt
            message = "interrupted"
        print(message, file=sys.stderr)
        return 130
    except Exception as e:
        expected = _expected(e)
        if args.debug or not expected:
            traceback.print_exc()
        msg = str(e)
        if e.__cause__ is not None and args.debug is False and expected:
            cause = e.__cause__
            if str(cause) and str(cause) not in msg:
                msg += f"\n  caused by {type(cause).__name__}: {cause}"
        where = launch_rank()
        if where is None:
            print(f"mmalign: error: {msg}", file=sys.stderr)
        elif peer_gone(e):
            print(f"mmalign: error ({where}): {msg}\n  {PEER_GONE_HINT}", file=sys.stderr)
        else:
            print(f"mmalign: error ({where}): {msg}", file=sys.stderr)
            _record_for_launcher(e)
        return 1


if __name__ == "__main__":  # pragma: no cover  (accelerate launch / torchrun -m mmalign.app.cli)
    from mmalign.__main__ import drop_working_directory

    drop_working_directory()
    sys.exit(main())
