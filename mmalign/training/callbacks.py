"""The hooks the trainer calls on its callbacks and monitors (`TrainerCallback`)."""

from __future__ import annotations

from typing import Protocol

__all__ = ["TrainerCallback"]


class TrainerCallback(Protocol):
    """What `GroupTrainer` calls on its callbacks (the pipeline's ``TrainingSetup.callbacks``) and monitors (the
    ``monitors`` argument: the app's live doctor and trackers). Every method is optional; the trainer calls
    only those an object has, callbacks first, each in list order, on every process (a hook that should act
    on the main process only checks ``trainer.is_main``).

    - ``accelerator_kwargs()``: keyword arguments for the ``Accelerator`` the trainer builds (monitors only;
      unused when an accelerator is passed in);
    - ``on_init(trainer)``: the accelerator exists (``trainer.accelerator``), nothing else is set up yet;
    - ``on_train_start(trainer, step)``: `GroupTrainer.train` starts, continuing after `step`;
    - ``on_rewards(trainer, rewards, group, names)``: the gathered rewards of a sampling round;
    - ``on_step_end(trainer, step, metrics)``: every step's metrics, which it may add to;
    - ``on_log(trainer, step, metrics)``: the steps written to ``metrics.jsonl``;
    - ``on_samples(trainer, step, rows, views)``: the steps whose samples are written: this process's rows (as
      the run directory stores them) and `Policy.sample_view`'s views of them;
    - ``on_train_end(trainer)``: `train` ends, also when it fails;
    - any hook may call ``trainer.request_stop(reason)`` to end the run after the current step (written as the
      last step: metrics, samples, a checkpoint);
    - ``state_dict()`` / ``load_state_dict(state)``: saved in and restored from checkpoints (callbacks only).

    (Every hook being optional, the protocol declares none; it names the contract.)
    """
