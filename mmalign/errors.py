"""The base class of the errors a user can fix.

Every error that reports a problem with what the user gave (a config, a data file, a registry name, a
plugin, a reward) subclasses `MmalignError`, usually together with the standard class it has always been
(``ConfigError`` is also a ValueError, ``RegistryError`` a KeyError), so ``except ValueError`` keeps
working. The command line (`mmalign.app.cli`) reports an `MmalignError` as one ``mmalign: error: ...``
line; any other exception is a bug and also prints its traceback.
"""

from __future__ import annotations


class MmalignError(Exception):
    """A problem the user can fix, described by the message (which names the file, key or plugin)."""


class ConfigError(MmalignError, ValueError):
    """A config file or override is invalid; the message names the key and the source (a ValueError too)."""


class CheckpointError(MmalignError, ValueError):
    """A checkpoint that cannot be used: a file fails its manifest (missing, truncated, corrupted) or cannot be
    read. The message names the file and why."""


class MetricsError(MmalignError, ValueError):
    """A ``metrics.jsonl`` that cannot be read back (a broken line other than a torn last one): the message names
    the file and the line."""


class RunWriteError(MmalignError, OSError):
    """Writing a file of the run directory failed (a full disk, permissions): names the file and the cause
    (`cause`; its ``errno``, when it has one, or `errno`, is ``cause_errno``). `detail` is appended to the
    message (`mmalign.training.rundir.writing` adds the free space of a full disk)."""

    def __init__(
        self, path: object, cause: BaseException, *, detail: str = "", errno: int | None = None
    ) -> None:
        self.path = path
        self.cause = cause
        hint = " (a full disk?)" if "unexpected pos" in str(cause) else ""  # torch.save's words for ENOSPC
        super().__init__(f"could not write {path}: {cause}{hint}{detail}")
        self.cause_errno = errno if errno is not None else getattr(cause, "errno", None)


class TrainingError(MmalignError, RuntimeError):
    """Training stopped; the message says at which step and what was kept."""


class NonFiniteError(TrainingError):
    """A NaN or infinity in the loss, the gradient norm or the weights: the run stops rather than train on
    garbage, and no checkpoint with non-finite weights is written."""
