"""What ties a teacher signal (hf_distill.data.teacher_signal) to its rows and to the run that reads it, and the
checks built on that: its column names and format version, the metadata line a Dataset carries, the vocabulary and
row hashes, joining a signal with its rows (`attach_teacher_signal`) and the trainer's refusal of a signal that does
not fit the run (`check_teacher_signal`).

Apart from creating and reading a signal because these checks run where no signal is made: in every trainer set-up
(a dataset with `teacher_signal_*` columns), in hf_distill.data.signal_rescale and on rows joined with a downloaded
signal. Every name here is also importable from hf_distill.data.teacher_signal.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import datasets
import numpy as np

from ..teacher import student_tokenizer
from .cache import _attach
from .collators import SIGNAL_PREFIX

__all__ = [
    "SIGNAL_FORMAT",
    "SIGNAL_ROW",
    "SIGNAL_TAIL",
    "SIGNAL_TOPK",
    "SIGNAL_VALUES",
    "attach_teacher_signal",
    "check_teacher_signal",
    "row_hash",
    "signal_metadata",
    "vocabulary_hash",
]

SIGNAL_TOPK = f"{SIGNAL_PREFIX}_topk"
SIGNAL_VALUES = f"{SIGNAL_PREFIX}_values"
SIGNAL_TAIL = f"{SIGNAL_PREFIX}_tail"
SIGNAL_ROW = f"{SIGNAL_PREFIX}_row"
SIGNAL_FORMAT = 1  # bump when the layout changes: an old signal is then refused, never misread
_MARKER = "hf_distill.data.teacher_signal "



def vocabulary_hash(tokenizer: Any) -> str:
    """blake2b of the tokenizer's (token, id) pairs, added tokens included: equal for tokenizers that map every
    string to the same ids. A processor is hashed by the tokenizer it holds (`.tokenizer`)."""
    inner = student_tokenizer(tokenizer)
    if inner is None:
        raise ValueError(f"A tokenizer with get_vocab() (or a processor holding one as .tokenizer) is needed to hash "
                         f"the vocabulary, got {type(tokenizer).__name__}.")
    pairs = sorted(inner.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.blake2b(json.dumps(pairs).encode(), digest_size=16).hexdigest()


def row_hash(input_ids: Any) -> int:
    """A signed 64-bit hash of one row's token ids (as int64, so the stored integer type does not matter)."""
    data = np.asarray(input_ids, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def signal_metadata(dataset: Any) -> dict[str, Any] | None:
    """The signal's metadata recorded in a dataset's info (the signal itself, or rows joined with it)."""
    info = getattr(dataset, "info", None)
    for line in (getattr(info, "description", None) or "").splitlines():
        if line.startswith(_MARKER):
            return json.loads(line[len(_MARKER) :])
    return None


def attach_teacher_signal(rows: datasets.Dataset, signal: datasets.Dataset) -> datasets.Dataset:
    """`rows` with the signal's columns added side by side, after checking that every row is the one the signal
    was made from (its `input_ids` hash). Stream the result with `streamed(...)`."""
    if len(rows) != len(signal):
        raise ValueError(f"The rows ({len(rows)}) and the teacher signal ({len(signal)} rows) differ in length: "
                         "give the rows the signal was created from, in the same order.")
    _check_rows(rows, signal[SIGNAL_ROW], "rows")
    return _attach(rows, signal)


def _check_rows(rows: datasets.Dataset, hashes: list[int], which: str) -> None:
    ids = rows.select_columns(["input_ids"]).with_format(None)
    for start in range(0, len(rows), 4096):
        for i, (r, h) in enumerate(zip(ids[start : start + 4096]["input_ids"], hashes[start : start + 4096],
                                       strict=True)):
            if row_hash(r) != int(h):
                raise ValueError(
                    f"Row {start + i} of the {which} ({len(r)} tokens) is not the row the teacher signal was made "
                    "from (its input_ids hash differs): the rows were changed, reordered or retokenised. Join the "
                    "signal with the rows it was created from (attach_teacher_signal), or create it again."
                )


def check_teacher_signal(
    dataset: Any, which: str, *, temperature: float, kd_token_mask: str, tokenizer: Any, causal: bool
) -> None:
    """Refuse, before training, a signal that does not fit the run: another vocabulary, temperature or
    kd_token_mask, rows that are not the signal's, a student that is not a causal LM."""
    from .teacher_columns import first_row

    if dataset is None:
        return
    names, first = first_row(dataset, needed=False)
    if not any(n.startswith(SIGNAL_PREFIX) for n in names):
        return
    meta = signal_metadata(dataset)
    if meta is None:
        raise ValueError(f"The {which} dataset carries teacher_signal columns but not the signal's metadata: join "
                         "the rows with the signal through attach_teacher_signal(rows, load_teacher_signal(path)).")
    if meta.get("format") != SIGNAL_FORMAT:
        raise ValueError(f"The teacher signal has format {meta.get('format')}, this hf_distill reads format "
                         f"{SIGNAL_FORMAT}: create the signal again with this version.")
    if not causal:
        raise ValueError("A teacher signal holds a causal-LM teacher's next-token distributions: the student must be "
                         "a causal LM.")
    if float(temperature) != meta["temperature"]:
        raise ValueError(f"The teacher signal was made at temperature {meta['temperature']}, but the run's "
                         f"temperature is {temperature}: set DistillationArguments(temperature={meta['temperature']})"
                         ", create the signal at the run's temperature, or (exact only for a signal without tail "
                         "mass, e.g. k = the vocabulary) rescale it with "
                         "hf_distill.data.signal_rescale.rescale_teacher_signal(signal, temperature).")
    if kd_token_mask != meta["kd_token_mask"]:
        raise ValueError(f"The teacher signal holds the positions of kd_token_mask={meta['kd_token_mask']!r}, but "
                         f"the run counts kd_token_mask={kd_token_mask!r}: set kd_token_mask="
                         f"{meta['kd_token_mask']!r} or create the signal with the run's.")
    if tokenizer is None:
        raise ValueError("Training from a teacher signal needs the student's tokenizer (processing_class=...) to "
                         "check that its vocabulary is the one the signal's ids refer to.")
    if vocabulary_hash(tokenizer) != meta["vocab_hash"]:
        raise ValueError(f"The student's tokenizer has another vocabulary than the teacher signal's (made with "
                         f"{meta['teacher'] or 'its teacher'}'s tokenizer, vocabulary hash {meta['vocab_hash']}): its "
                         "ids would mean other tokens. Use a student that shares the teacher's tokenizer.")
    missing = [c for c in ("input_ids", SIGNAL_ROW, SIGNAL_TAIL, SIGNAL_TOPK) if c not in names]
    if missing:
        raise ValueError(f"The {which} dataset lacks {missing}: join the rows with attach_teacher_signal.")
    if isinstance(dataset, datasets.Dataset):
        _check_rows(dataset, dataset.select_columns([SIGNAL_ROW]).with_format(None)[SIGNAL_ROW], f"{which} dataset")
    elif first:
        _check_rows(datasets.Dataset.from_list([{"input_ids": list(first["input_ids"])}]), [first[SIGNAL_ROW]],
                    f"{which} dataset")
