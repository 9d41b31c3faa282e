"""What ties a teacher signal (hf_distill.data.teacher_signal) to its rows and to the run that reads it, and the
checks built on that: its column names and format version, the metadata line a Dataset carries, the vocabulary and
row hashes, joining a signal with its rows (`attach_teacher_signal`) and the trainer's refusal of a signal that does
not fit the run (`check_teacher_signal`).

Each signal row carries two hashes: of the row's `input_ids` (`teacher_signal_row`) and of its counted positions
(`teacher_signal_positions`: the positions kd_token_mask counts, numbered from the row's first real token). The
signal stores distributions for counted positions only, in order, so rows whose ids are the same but whose labels
moved (a shifted prompt/completion boundary, with as many learnt tokens) would otherwise put every distribution on
the wrong token; both hashes are checked when rows are joined, when the trainer is built, and on every batch.

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
import torch

from ..losses.normalise import kd_positions
from ..teacher import student_tokenizer
from .cache import _attach
from .collators import SIGNAL_PREFIX
from .signal_compact import DAMAGED

__all__ = [
    "ADAPTIVE_FORMAT",
    "COMPACT_FORMAT",
    "READABLE_FORMATS",
    "SIGNAL_CODES",
    "SIGNAL_FORMAT",
    "SIGNAL_POSITIONS",
    "SIGNAL_SPEC",
    "SIGNAL_ROW",
    "SIGNAL_TAIL",
    "SIGNAL_TOPK",
    "SIGNAL_VALUES",
    "attach_teacher_signal",
    "check_batch_positions",
    "check_signal_entries",
    "check_signal_meta",
    "check_teacher_signal",
    "padded_rows",
    "positions_hashes",
    "row_hash",
    "row_positions_hash",
    "signal_metadata",
    "vocabulary_hash",
]

SIGNAL_TOPK = f"{SIGNAL_PREFIX}_topk"
SIGNAL_VALUES = f"{SIGNAL_PREFIX}_values"
SIGNAL_TAIL = f"{SIGNAL_PREFIX}_tail"
SIGNAL_ROW = f"{SIGNAL_PREFIX}_row"
SIGNAL_POSITIONS = f"{SIGNAL_PREFIX}_positions"
SIGNAL_CODES = f"{SIGNAL_PREFIX}_codes"  # the compact layout's bit streams (hf_distill.data.signal_compact)
SIGNAL_SPEC = f"{SIGNAL_PREFIX}_spec"  # its (k, id_bits, value_bits, value_step), on every row: batches decode alone
# Bump when the layout changes: an old signal is then refused, never misread. 2: the counted positions' hash.
SIGNAL_FORMAT = 2
# 3: the compact layout (issue #45), written on request; format 2 (packed / split) stays the default and readable.
COMPACT_FORMAT = 3
# 4: the compact layout with adaptive k (each position's count stored; `epsilon` in the metadata): a reader of
# format 3 alone would misread its rows, so it refuses them by this number.
ADAPTIVE_FORMAT = 4
READABLE_FORMATS = (SIGNAL_FORMAT, COMPACT_FORMAT, ADAPTIVE_FORMAT)
_MARKER = "hf_distill.data.teacher_signal "
_RECREATE = ("create the signal again with this version (create_teacher_signal or `hf-distill signal create`, into "
             "a new folder)")


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


def positions_hashes(counted: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Per row of a batch, a signed 64-bit hash of its counted positions (`counted`: (B, T - 1), kd_positions'
    causal mask), numbered from the row's first real token (`attention_mask` != 0) so that the padding side and
    amount do not change it."""
    counted = counted.detach().to("cpu", torch.bool).numpy()
    real = None if attention_mask is None else (attention_mask.detach().cpu() != 0).numpy()
    return [_hash_positions(np.flatnonzero(row) - (0 if real is None else int(real[i].argmax())))
            for i, row in enumerate(counted)]


def row_positions_hash(row: dict[str, Any], kd_token_mask: str) -> int:
    """`positions_hashes` of one row as `datasets` gives it (`input_ids`, optionally `attention_mask`, `labels`),
    without padding it into a batch: kd_positions' causal rule per row ("labels": the next label is not -100;
    "attention", or no labels: this token and the next are real), so checking every row of a dataset stays cheap."""
    n = len(row["input_ids"])
    real = np.ones(n, dtype=bool) if row.get("attention_mask") is None else np.asarray(row["attention_mask"]) != 0
    labels = row.get("labels")
    if kd_token_mask == "labels" and labels is not None:
        padded = np.full(max(n, len(labels)), -100, dtype=np.int64)
        padded[: len(labels)] = labels
        counted = padded[1:n] != -100
    else:
        counted = real[:-1] & real[1:]
    return _hash_positions(np.flatnonzero(counted) - (int(real.argmax()) if real.size else 0))


def _hash_positions(indices: np.ndarray) -> int:
    data = np.asarray(indices, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"kd-positions").digest(), "little", signed=True)


def padded_rows(rows: dict[str, list], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows as `datasets` gives a batch of them (`input_ids`, optionally `attention_mask` and `labels`) right-padded
    to (ids, attention mask, labels or None): the padding the signal is made and checked with."""
    ids_rows = rows["input_ids"]
    length, n = max((len(r) for r in ids_rows), default=0), len(ids_rows)
    ids = torch.full((n, length), pad_id, dtype=torch.long)
    mask = torch.zeros((n, length), dtype=torch.long)
    labels = torch.full((n, length), -100, dtype=torch.long) if rows.get("labels") is not None else None
    masks = rows.get("attention_mask")
    for i, r in enumerate(ids_rows):
        ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask[i, : len(r)] = torch.as_tensor(masks[i], dtype=torch.long) if masks is not None else 1
        if labels is not None:
            labels[i, : len(rows["labels"][i])] = torch.as_tensor(rows["labels"][i], dtype=torch.long)
    return ids, mask, labels


def counted_positions(mask: torch.Tensor, labels: torch.Tensor | None, kd_token_mask: str) -> torch.Tensor:
    """(B, T - 1): the positions the signal holds for right-padded rows, by the trainer's rule (kd_positions)."""
    counted = kd_positions(mask, labels, kd_token_mask, causal=True)
    return torch.ones(mask.shape[0], max(mask.shape[1] - 1, 0), dtype=torch.bool) if counted is None else counted


def check_batch_positions(cached: dict[str, Any], counted: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """Refuse a batch whose rows count other positions than their signal rows (`cached`: the batch's teacher_signal
    columns; `counted`: its kd_positions), checked on every batch: a stream's rows past the first, a collator that
    moves labels."""
    stored = cached.get(SIGNAL_POSITIONS)
    if stored is None:
        raise ValueError(f"This batch carries teacher_signal columns but no {SIGNAL_POSITIONS}: join the rows with "
                         "attach_teacher_signal(rows, load_teacher_signal(path)), whose signal this version made.")
    got = positions_hashes(counted, attention_mask)
    for i, (g, h) in enumerate(zip(got, torch.as_tensor(stored).reshape(-1).tolist(), strict=True)):
        if g != int(h):
            raise ValueError(
                f"Row {i} of this batch counts as many KD positions as its teacher signal but other ones (its labels "
                "or attention mask moved since the signal was made, e.g. by a collator or a shifted prompt/"
                "completion boundary): collate the rows as they were when the signal was created.")


def check_signal_entries(values: torch.Tensor, indices: torch.Tensor, tails: torch.Tensor, rows: torch.Tensor) -> None:
    """Refuse a batch whose decoded signal cannot be a teacher's top-k (`values`, `indices`: (n, k) positions back to
    back, `tails`: (n,), `rows`: each position's batch row): every writer stores k distinct ids in decreasing
    probability and a tail mass at most 1, so repeated ids, values out of order or a positive log tail mean damaged
    bytes. Adaptive k (format 4) pads a position past its count with id -1 and value -inf, after its ids. Neither
    layout carries a checksum: this catches damage with high probability, not with certainty."""
    if not len(values):
        return
    pad = indices < 0
    distinct = torch.where(pad, -1 - torch.arange(indices.shape[-1], device=indices.device), indices)
    checks = (((distinct.sort(-1).values.diff(dim=-1) == 0).any(-1), "an id repeated among a position's top k"),
              ((values.diff(dim=-1) > 0).any(-1), "log-probabilities out of their decreasing order"),
              ((pad[:, :-1] & ~pad[:, 1:]).any(-1) | (pad & (values > float("-inf"))).any(-1),
               "padding before an id, or padding with a probability"),
              (tails > 1e-3, "a tail mass above 1"))
    for bad, what in checks:
        if bool(bad.any()):
            row = int(rows[int(bad.nonzero()[0])])
            raise ValueError(f"Row {row} of this batch reads a damaged teacher signal ({what}): {DAMAGED}. The batch "
                             "was not trained.")


def signal_metadata(dataset: Any) -> dict[str, Any] | None:
    """The signal's metadata recorded in a dataset's info (the signal itself, or rows joined with it)."""
    info = getattr(dataset, "info", None)
    for line in (getattr(info, "description", None) or "").splitlines():
        if line.startswith(_MARKER):
            return json.loads(line[len(_MARKER) :])
    return None


def attach_teacher_signal(rows: datasets.Dataset, signal: datasets.Dataset) -> datasets.Dataset:
    """`rows` with the signal's columns added side by side, after checking that every row is the one the signal
    was made from: its `input_ids` hash and its counted positions' hash (its labels or attention mask, by the
    signal's kd_token_mask). Stream the result with `streamed(...)`."""
    streams = [name for name, data in (("rows", rows), ("signal", signal))
               if isinstance(data, datasets.IterableDataset)]
    if streams:
        raise ValueError(f"attach_teacher_signal got a streamed {' and '.join(streams)} (IterableDataset): it checks "
                         "every row against the signal first, so it joins two Datasets. Give load_teacher_signal(path) "
                         "without streaming=True (its files are memory-mapped, not read into memory) and the rows as "
                         "a Dataset, then stream the result: streamed(attach_teacher_signal(rows, signal)).")
    meta = _format_checked(signal_metadata(signal), "The teacher signal")
    if len(rows) != len(signal):
        raise ValueError(f"The rows ({len(rows)}) and the teacher signal ({len(signal)} rows) differ in length: "
                         "give the rows the signal was created from, in the same order.")
    stored = signal.select_columns([SIGNAL_ROW, SIGNAL_POSITIONS]).with_format(None)
    _check_rows(rows, stored[SIGNAL_ROW], stored[SIGNAL_POSITIONS], meta["kd_token_mask"], "rows")
    return _attach(rows, signal)


def _format_checked(meta: dict[str, Any] | None, what: str) -> dict[str, Any]:
    """The signal's metadata, after refusing none (not a signal) and another format (an older signal's hashes
    cover less than this version checks: its rows' counted positions were not hashed)."""
    if meta is None:
        raise ValueError(f"{what} carries no teacher-signal metadata: load it with load_teacher_signal(path) (or "
                         "keep the Dataset it returned; to stream it use teacher_signal.streamed(...)).")
    if meta.get("format") not in READABLE_FORMATS or (meta.get("format") in (COMPACT_FORMAT, ADAPTIVE_FORMAT)) != (
            meta.get("layout") == "compact"):
        raise ValueError(f"{what} has format {meta.get('format')}, this hf_distill reads format {SIGNAL_FORMAT} "
                         f"(it also hashes each row's counted positions, so rows whose labels moved are refused) and "
                         f"{COMPACT_FORMAT} and {ADAPTIVE_FORMAT} (the compact layout, fixed and adaptive k): "
                         f"{_RECREATE}.")
    return meta


def _check_rows(rows: datasets.Dataset, hashes: list[int], positions: list[int], kd_token_mask: str,
                which: str) -> None:
    """Every row's input_ids hash and counted positions' hash against the signal's, one error naming the first
    row that differs."""
    columns = [c for c in ("input_ids", "attention_mask", "labels") if c in rows.column_names]
    data = rows.select_columns(columns).with_format(None)
    step = 512
    for start in range(0, len(rows), step):
        chunk = data[start : start + step]
        for i, (r, h) in enumerate(zip(chunk["input_ids"], hashes[start : start + step], strict=True)):
            if row_hash(r) != int(h):
                raise ValueError(
                    f"Row {start + i} of the {which} ({len(r)} tokens) is not the row the teacher signal was made "
                    "from (its input_ids hash differs): the rows were changed, reordered or retokenised. Join the "
                    "signal with the rows it was created from (attach_teacher_signal), or create it again."
                )
        names = list(chunk)
        for i, h in enumerate(positions[start : start + step]):
            if row_positions_hash({c: chunk[c][i] for c in names}, kd_token_mask) != int(h):
                raise ValueError(
                    f"Row {start + i} of the {which} has the signal's input_ids but other counted positions "
                    f"(kd_token_mask={kd_token_mask!r}: its labels or attention mask moved, e.g. a shifted prompt/"
                    "completion boundary), so the teacher's distributions would land on the wrong tokens: join the "
                    "signal with the rows exactly as they were when it was created, or create it again from these."
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
    if meta is None and isinstance(dataset, datasets.IterableDataset):  # to_iterable_dataset() drops the info
        raise ValueError(f"The {which} dataset streams teacher_signal columns without the signal's metadata "
                         "(Dataset.to_iterable_dataset drops it): stream the joined rows with "
                         "hf_distill.data.teacher_signal.streamed(attach_teacher_signal(rows, signal)) instead.")
    if meta is None:
        raise ValueError(f"The {which} dataset carries teacher_signal columns but not the signal's metadata: join "
                         "the rows with the signal through attach_teacher_signal(rows, load_teacher_signal(path)).")
    check_signal_meta(meta, temperature=temperature, kd_token_mask=kd_token_mask, tokenizer=tokenizer, causal=causal)
    entries = (SIGNAL_CODES, SIGNAL_SPEC) if meta.get("layout") == "compact" else (SIGNAL_TOPK,)
    missing = [c for c in ("input_ids", SIGNAL_ROW, SIGNAL_POSITIONS, SIGNAL_TAIL, *entries) if c not in names]
    if missing:
        raise ValueError(f"The {which} dataset lacks {missing}: join the rows with attach_teacher_signal.")
    mode = meta["kd_token_mask"]
    if isinstance(dataset, datasets.Dataset):
        stored = dataset.select_columns([SIGNAL_ROW, SIGNAL_POSITIONS]).with_format(None)
        _check_rows(dataset, stored[SIGNAL_ROW], stored[SIGNAL_POSITIONS], mode, f"{which} dataset")
    elif first:  # a stream: its first row here, every row on its batch (signal_teacher)
        row = {c: _as_list(first[c]) for c in ("input_ids", "attention_mask", "labels") if c in first}
        _check_rows(datasets.Dataset.from_list([row]), [first[SIGNAL_ROW]], [first[SIGNAL_POSITIONS]], mode,
                    f"{which} dataset")


def check_signal_meta(meta: dict[str, Any] | None, *, temperature: float, kd_token_mask: str, tokenizer: Any,
                      causal: bool, what: str = "The teacher signal") -> dict[str, Any]:
    """Refuse a signal (its metadata) that does not fit the run: another format, vocabulary, temperature or
    kd_token_mask, a student that is not a causal LM (also for a signal named as a teacher, hf_distill.routed_signal).
    Returns the metadata."""
    meta = _format_checked(meta, what)
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
    return meta


def _as_list(value: Any) -> list:
    return value.tolist() if hasattr(value, "tolist") else list(value)
