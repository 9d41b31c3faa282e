"""`hf-distill auto`: the most accurate student within a latency budget, picked and distilled (issue #33).

`auto_student` (in `search`) builds candidate shapes (`space`), times them on the target device, ranks those within
the budget by a short distillation, distils the best fully and writes the Pareto table and plot (`table`);
`command` is its command line. Guide: docs/guides/auto.md. Names load on first use (the command line's help
needs no torch).
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {"AutoResult": "search", "auto_student": "search", "rank": "search", "Candidate": "space",
          "candidate_grid": "space", "DEFAULT_COPY_DEPTHS": "space", "DEFAULT_DEPTHS": "space",
          "DEFAULT_SHRINK": "space", "DEFAULT_WIDTHS": "space"}
__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
