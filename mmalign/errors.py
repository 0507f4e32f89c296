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
