"""How a model's location is recorded in files others read: a student's `config.json` (`config.distillation`), its
model card and `distillation_report.json`, a teacher signal's metadata and dataset card.

A model loaded from a local folder carries that folder's absolute path as its `name_or_path`; written as it is, it
would publish a machine's layout (user names, mount points) with `push_to_hub` and mean nothing on any other
machine. `recorded_name` keeps a Hub id or plain name as given and records a local folder by the Hub id it was
downloaded from (a Hub cache snapshot, `.../models--org--name/snapshots/<revision>`), else by its folder name.
`recorded_command` does the same for the paths in a command line (how a teacher signal was made): relative to the
current folder when inside it, else as `recorded_name` gives them. Stdlib only, so that any module may import it.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["recorded_command", "recorded_name", "recorded_path"]


def recorded_name(name_or_path: Any) -> str:
    """`name_or_path` as it may be recorded: a Hub id or name unchanged; an absolute path, or a relative one that is
    a local folder, as the Hub id of the cache snapshot it is in, else as its folder's name; "" for None or ""."""
    text = os.fspath(name_or_path) if isinstance(name_or_path, os.PathLike) else str(name_or_path or "")
    if not text:
        return ""
    path = Path(text).expanduser()
    if not (path.is_absolute() or path.is_dir()):
        return text  # a Hub id ("org/name"), or a name that is no folder here
    full = path.resolve() if path.exists() else Path(os.path.abspath(path))
    parts = full.parts
    for i, part in enumerate(parts[:-2]):
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            return part[len("models--") :].replace("--", "/")
    return full.name or text.strip("/\\") or "model"


def recorded_path(path: Any, cwd: Any = None) -> str:
    """A path written into a command line that is recorded: an absolute one relative to `cwd` (default: the
    current folder) when inside it, else as `recorded_name` gives it; a relative one unchanged."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    full = Path(text).expanduser()
    if not full.is_absolute():
        return text
    here = Path(cwd or os.getcwd()).resolve()
    resolved = full.resolve()
    return str(resolved.relative_to(here)) if resolved.is_relative_to(here) else recorded_name(text)


def recorded_command(argv: Sequence[str], cwd: Any = None) -> str:
    """`argv` as one shell line that may be recorded: every absolute path in it (an argument, or the value of
    `--flag=path`) made a `recorded_path`."""
    def one(arg: str) -> str:
        flag, eq, value = arg.partition("=") if arg.startswith("-") else ("", "", arg)
        return f"{flag}{eq}{recorded_path(value, cwd)}" if eq else recorded_path(arg, cwd)

    return shlex.join(one(str(a)) for a in argv)
