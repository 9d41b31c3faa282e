"""What the benchmarks made of named sections (causal_lm.py, prune_recover.py) share: the record of how a section
was run (command, date, load average before and after, seconds), the machine line, and each section's heading in
the Markdown report, so that every results file states its conditions the same way; and what every side of
causal_lm.py's timed trainer comparisons (trl, sft, onpolicy) shares: the step clock and the CPU Trainer arguments.

`portable` is how every benchmark records a path or a command line in benchmarks/results: relative to the
repository (its caches, .cache/ and benchmarks/.cache/, included), or under `~` for the home folder, never a
machine's absolute path (they are published with the repository and mean nothing elsewhere)."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def portable(text: Any) -> str:
    """A path, or a command line holding paths, as benchmarks/results record it: the repository's absolute path
    (as given and resolved) dropped (paths relative to it; the repository itself is "."), the home folder as `~`."""
    text = str(text)
    end = r"$|[\s'\"`,;:)\]]"  # what may follow a folder's own name (not a longer name that starts like it)
    for root in dict.fromkeys((str(ROOT), os.path.realpath(ROOT))):
        text = re.sub(re.escape(root + os.sep), "", text)
        text = re.sub(re.escape(root) + f"(?={end})", ".", text)
    home = os.path.expanduser("~")
    if home not in ("", os.sep):
        for where in dict.fromkeys((home, os.path.realpath(home))):
            text = re.sub(re.escape(where) + f"(?={re.escape(os.sep)}|{end})", "~", text)
    return text


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}"


def portable_tree(data: Any) -> Any:
    """A results file's data (dicts, lists, strings, paths) with every string and path made `portable`."""
    if isinstance(data, str | os.PathLike):
        return portable(os.fspath(data))
    if isinstance(data, dict):
        return {k: portable_tree(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return type(data)(portable_tree(v) for v in data)
    return data


@contextlib.contextmanager
def section_record(script: str) -> Iterator[dict]:
    """The record ("meta") of the section run inside: the command line (`script` and this process's arguments), the
    date, the load average before and after, and its seconds (filled in when the section is done)."""
    record = {"command": portable(" ".join(shlex.quote(x) for x in ["python", script, *sys.argv[1:]])),
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


def step_clock(times: list[float]):
    """A TrainerCallback appending each step's seconds (from its on_step_begin to its on_step_end) to `times`: the
    same clock on every side of a comparison."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    return Clock()


def cpu_train_args(name: str, steps: int, batch: int, **extra: Any) -> dict[str, Any]:
    """The Trainer arguments every side of a timed comparison shares (`extra` adds or overrides): `steps` steps of
    `batch` rows at a constant lr on the CPU, seed 0, nothing saved or reported, no loader workers."""
    return {"output_dir": f"/tmp/hf_distill_causal_{name}", "max_steps": steps, "per_device_train_batch_size": batch,
            "learning_rate": 1e-4, "lr_scheduler_type": "constant", "save_strategy": "no", "report_to": "none",
            "use_cpu": True, "seed": 0, "disable_tqdm": True, "dataloader_num_workers": 0, **extra}
