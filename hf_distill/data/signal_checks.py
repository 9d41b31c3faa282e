"""Checks of a teacher signal's settings before anything is run or written (hf_distill.data.teacher_signal).

`check_signal_settings` needs no teacher weights, so the command line runs it before loading them (minutes for an
LLM): among the rest, every row's ids must lie in the teacher's vocabulary (an id past it used to crash the first
forward with an IndexError, after the folder was made). `check_signal_tokenizer` refuses a tokenizer that does not
fit the teacher (more tokens than its vocabulary, or another vocabulary than its own saved tokenizer);
`check_signal_run` checks how the loaded teacher is run (dtype, device). All run before
the output folder is created: a refused setting leaves nothing behind that a corrected run would have to resume or
be refused by.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import datasets
import pyarrow.compute as pc
import torch
from torch import nn

from ..teacher import student_tokenizer, vocabulary_difference

META_FILE = "teacher_signal.json"
MODES = ("labels", "attention")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

__all__ = ["check_signal_run", "check_signal_settings", "check_signal_tokenizer"]


def check_signal_settings(dataset: Any, output_dir: str | os.PathLike, *, k: Any, temperature: Any,
                          kd_token_mask: str, vocab_size: int | None, batch_size: Any = 1,
                          rows_per_shard: Any = 1) -> None:
    """Refuse settings `create_teacher_signal` cannot use, each naming the fix; cheap, so the command line runs it
    before loading the teacher's weights (`vocab_size`: the teacher config's, None to skip that check)."""
    if kd_token_mask not in MODES:
        raise ValueError(f"kd_token_mask={kd_token_mask!r}: use 'labels' or 'attention' (the trainer's rule).")
    for name, value in (("k", k), ("batch_size", batch_size), ("rows_per_shard", rows_per_shard)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    if vocab_size is not None and k > vocab_size:
        raise ValueError(f"k={k} exceeds the teacher's vocabulary ({vocab_size} ids): choose k <= {vocab_size}.")
    if not (isinstance(temperature, int | float) and 0 < float(temperature) < float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}.")
    if isinstance(dataset, datasets.DatasetDict):
        raise ValueError(f"dataset is a DatasetDict (splits: {', '.join(dataset)}): give one split, e.g. "
                         f"dataset[{next(iter(dataset), 'train')!r}], the rows the student trains on.")
    if isinstance(dataset, datasets.IterableDataset):
        raise ValueError("dataset is an IterableDataset: the signal is written in shards of rows that a later run "
                         "resumes by index, so give a datasets.Dataset (load it without streaming=True); stream "
                         "the joined rows to the trainer afterwards with teacher_signal.streamed(...).")
    if not isinstance(dataset, datasets.Dataset) or len(dataset) == 0:
        raise ValueError(f"dataset must be a non-empty datasets.Dataset of tokenised rows, got "
                         f"{type(dataset).__name__}{' with no rows' if isinstance(dataset, datasets.Dataset) else ''}.")
    needed = ("input_ids", "labels") if kd_token_mask == "labels" else ("input_ids",)
    missing = [c for c in needed if c not in dataset.column_names]
    if missing:
        raise ValueError(f"The dataset has no {missing} column (columns: {dataset.column_names}); "
                         "kd_token_mask='labels' needs `labels` (-100 where not learnt), or use 'attention'.")
    if vocab_size is not None:
        _check_ids_below(dataset, vocab_size, f"the teacher's vocabulary (config.vocab_size {vocab_size}: ids 0.."
                         f"{vocab_size - 1})", "tokenise the rows with the teacher's tokenizer, or give the teacher "
                         "they were tokenised for")
    folder = Path(output_dir)
    if folder.is_file():
        raise ValueError(f"output_dir {str(output_dir)!r} is a file: give a new folder (or this signal's, to resume).")
    others = sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) if folder.is_dir() else []
    if others and not (folder / META_FILE).is_file():  # not overwritten, not mixed with a signal's files
        raise ValueError(f"{folder} is not empty and holds no teacher signal ({META_FILE} is missing; it holds "
                         f"{', '.join(others[:3])}{', ...' if len(others) > 3 else ''}): choose a new or empty "
                         "output_dir.")


def check_signal_tokenizer(tokenizer: Any, vocab_size: int, own: Any = None, flag: str = "tokenizer") -> None:
    """Refuse a tokenizer the signal cannot be recorded with (its vocabulary hash is what a student must match): one
    with more tokens than the teacher's vocabulary, or one whose vocabulary differs from `own` (the teacher's saved
    tokenizer, when known). `flag` names the argument in the messages (the command line's --tokenizer)."""
    inner = student_tokenizer(tokenizer)
    if inner is None:
        raise ValueError(f"{flag}: a tokenizer (or a processor holding one as .tokenizer) is needed, got "
                         f"{type(tokenizer).__name__}.")
    size = len(inner)
    if size > vocab_size:
        raise ValueError(f"{flag} has {size} tokens, more than the teacher's vocabulary ({vocab_size} ids): it is not "
                         "the teacher's tokenizer; give the teacher's own (the one its rows were tokenised with).")
    theirs = student_tokenizer(own)
    differ = vocabulary_difference(inner, theirs) if theirs is not None else None
    if differ is not None:
        raise ValueError(f"{flag} has another vocabulary than the teacher's own tokenizer ({differ}): the signal "
                         "would record the wrong vocabulary for its ids; give the teacher's tokenizer (on the command "
                         "line, leave --tokenizer out).")


def _check_ids_below(dataset: datasets.Dataset, limit: int, what: str, fix: str) -> None:
    """Refuse the first row holding an input id outside 0..limit - 1 (Arrow compute: no Python loop over ids)."""
    start = 0
    for table in dataset.select_columns(["input_ids"]).with_format("arrow").iter(batch_size=8192):
        column = table.column("input_ids")
        flat = pc.list_flatten(column)
        bad = pc.or_(pc.less(flat, 0), pc.greater_equal(flat, limit))
        if len(flat) and pc.any(bad).as_py():
            at = pc.index(bad, True).as_py()
            row = start + pc.list_parent_indices(column)[at].as_py()
            raise ValueError(f"Row {row} of the dataset holds input id {flat[at].as_py()}, outside {what}: {fix}.")
        start += table.num_rows


def check_signal_run(teacher: nn.Module, dtype: Any, device: Any) -> torch.device:
    """Where the teacher runs (`device`, default: where its first parameter is), after refusing a `dtype` autocast
    cannot honour (anything but bf16/fp16/fp32; fp32 on lower-precision weights, which it would not raise) and a
    `device` that holds none of the teacher's weights (its inputs would go where it does not run)."""
    if dtype is not None and not any(dtype is d for d in DTYPES):
        raise ValueError(f"dtype={dtype!r}: use torch.bfloat16 or torch.float16 (the teacher runs under autocast in "
                         "it), torch.float32, or None (as loaded).")
    params = list(teacher.parameters())
    floats = sorted({str(p.dtype) for p in params if p.is_floating_point()} - {str(torch.float32)})
    if dtype is torch.float32 and floats:
        raise ValueError(f"dtype=torch.float32, but the teacher's weights are {', '.join(floats)}: autocast does not "
                         "raise precision, so the signal would be recorded as float32 but computed in "
                         f"{floats[0]}. Load the teacher in float32 (from_pretrained(..., dtype=torch.float32)) or "
                         "pass dtype=None (run as loaded).")
    if device is None:
        return params[0].device
    run_on = torch.device(device)
    if not any(p.device.type == run_on.type and run_on.index in (None, p.device.index) for p in params):
        where = ", ".join(sorted({str(p.device) for p in params}))
        raise ValueError(f"device={device}, but the teacher's weights are on {where}: move it there first "
                         f"(teacher.to({str(device)!r})), or leave device out to run it where its weights are.")
    return run_on
