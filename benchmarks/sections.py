"""What the benchmarks made of named sections (causal_lm.py, prune_recover.py) share: the record of how a section
was run (command, date, load average before and after, seconds), the machine line, and each section's heading in
the Markdown report, so that every results file states its conditions the same way."""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import sys
import time
from collections.abc import Iterable, Iterator


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}"


@contextlib.contextmanager
def section_record(script: str) -> Iterator[dict]:
    """The record ("meta") of the section run inside: the command line (`script` and this process's arguments), the
    date, the load average before and after, and its seconds (filled in when the section is done)."""
    record = {"command": " ".join(shlex.quote(x) for x in ["python", script, *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": os.getloadavg()}
    t0 = time.time()
    yield record
    record.update(load_after=os.getloadavg(), seconds=time.time() - t0)


def sections_with_headings(data: dict, names: Iterable[str], minutes: bool = False) -> Iterator[tuple[str, dict, list]]:
    """Each section of `data` that was run, in the order of `names`, with its report heading: the title, then how it
    ran (command, date, `minutes` its duration, load average before / after)."""
    for name in names:
        sec = data.get(name)
        if not sec:
            continue
        meta = sec.get("meta") or {}
        took = f"{meta.get('seconds', 0) / 60:.1f} min, " if minutes else ""
        yield name, sec, [f"## {name}", "", f"Command: `{meta.get('command')}`, {meta.get('date')}, {took}load "
                          f"before / after: {meta.get('load_before')} / {meta.get('load_after')}.", ""]
