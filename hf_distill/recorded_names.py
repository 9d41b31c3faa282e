"""How a model's location is recorded in files others read: a student's `config.json` (`config.distillation`), its
model card and `distillation_report.json`, a teacher signal's metadata and dataset card.

A model loaded from a local folder carries that folder's absolute path as its `name_or_path`; written as it is, it
would publish a machine's layout (user names, mount points) with `push_to_hub` and mean nothing on any other
machine. `recorded_name` keeps a Hub id or plain name as given and records a local folder by the Hub id it was
downloaded from (a Hub cache snapshot, `.../models--org--name/snapshots/<revision>`), else by its folder name.
Stdlib only, so that any module may import it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["recorded_name"]


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
