"""Answer extraction shared by the data loader (MATH's solutions to answers, `mmalign.data.rows`) and the text
rewards (`rewards.text`, which re-exports it)."""

from __future__ import annotations

import re

__all__ = ["extract_boxed"]

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_boxed(text: str) -> str | None:
    r"""Content of the last complete ``\boxed{...}`` (or ``\fbox{...}``), nested braces allowed; else None.

    ``"so \boxed{\frac{1}{2}}."`` -> ``"\frac{1}{2}"``. An unclosed (truncated) box is skipped.
    """
    for m in reversed(list(_BOXED_RE.finditer(text))):
        depth = 1
        for j in range(m.end(), len(text)):
            c = text[j]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[m.end() : j].strip()
    return None
