"""An offline teacher signal as a named teacher of routing per row (issue #42 item 6):
`teacher_model={"big": load_teacher_signal("signal/"), "local": model, "remote": "http://host:8000/v1"}`.

The rows whose `teacher_id` names the signal take their KD from its stored top-k + tail, the other rows from their
own teachers. The training rows are not joined with the signal (its columns would be empty for every row routed
elsewhere): each batch's rows routed to it are found in the signal by the signal's own identity rule, the hash of
the row's tokens (`teacher_signal_row`) with the hash of its counted positions (`teacher_signal_positions`, by the
signal's kd_token_mask), and batched exactly as the collator batches a joined signal. The signal may hold more rows
than are routed to it (made from every row, or from a larger set); each routed row must be one of them.

Refused before training, one line each: a Dataset that is not a signal, a streamed one (rows are looked up), a
signal whose format, vocabulary, temperature or kd_token_mask differ from the run's, a student that is not a causal
LM, kd_loss="mse" (top-k log-probabilities), and a routed row of a `datasets.Dataset` that the signal does not hold
(or holds with other counted positions). Rows of a stream are checked as their batch comes (the same messages).
"""

from __future__ import annotations

from typing import Any

import datasets
import numpy as np
import torch

from .base.batch_keys import ROUTE_COLUMN, SIGNAL_PREFIX
from .base.positions import kd_positions
from .compat import dataset_fingerprint
from .data.collators import stack_signal
from .data.signal_format import (
    SIGNAL_POSITIONS,
    SIGNAL_ROW,
    check_signal_meta,
    positions_hashes,
    row_hash,
    row_positions_hash,
    signal_metadata,
)
from .features.heads import SOFTMAX_LOSSES


def is_signal(value: Any) -> bool:
    """Whether a `teacher_model` dict value is an offline signal (a `datasets` dataset, which no model is)."""
    return isinstance(value, datasets.Dataset | datasets.IterableDataset)


class SignalTeacher:
    """A teacher signal named `name` in teacher_model's dict: its rows by identity, batched for the rows routed
    to it (:meth:`columns_for`)."""

    def __init__(self, name: str, signal: Any) -> None:
        self.name = name
        if isinstance(signal, datasets.IterableDataset):
            raise ValueError(f"teacher_model[{name!r}] is a streamed teacher signal: a named signal's rows are looked "
                             "up as their batches come, so load it as a Dataset (load_teacher_signal(path)).")
        meta = signal_metadata(signal)
        if meta is None:
            raise ValueError(f"teacher_model[{name!r}] is a Dataset without teacher-signal metadata: give a signal "
                             "loaded with load_teacher_signal(path) (a model, folder or URL otherwise).")
        self.signal, self.meta = signal.with_format(None), meta
        self.columns = [c for c in signal.column_names if c.startswith(SIGNAL_PREFIX)]
        stored = signal.select_columns([SIGNAL_ROW, SIGNAL_POSITIONS]).with_format(None)
        self.index: dict[tuple[int, int], int] = {}
        for i, key in enumerate(zip(stored[SIGNAL_ROW], stored[SIGNAL_POSITIONS], strict=True)):
            self.index.setdefault((int(key[0]), int(key[1])), i)  # equal tokens and positions: equal distributions
        self.rows = {r for r, _ in self.index}
        self._checked: set[str] = set()

    def describe(self) -> str:
        """What the card and report call it: the signal's teacher and k."""
        return f"{self.meta.get('teacher') or 'a teacher'} (offline signal, k={self.meta.get('k')})"

    def check_run(self, *, temperature: float, kd_token_mask: str, tokenizer: Any, causal: bool, kd_loss: str,
                  kd_weight: float) -> None:
        """The plain signal path's refusals (hf_distill.data.signal_format.check_signal_meta), naming the teacher."""
        try:
            check_signal_meta(self.meta, temperature=temperature, kd_token_mask=kd_token_mask, tokenizer=tokenizer,
                              causal=causal)
        except ValueError as err:
            raise ValueError(f"teacher_model[{self.name!r}]: {err}") from None
        if kd_weight > 0 and kd_loss not in SOFTMAX_LOSSES:
            raise ValueError(f"teacher_model[{self.name!r}] is a teacher signal (top-k log-probabilities), which "
                             f"kd_loss={kd_loss!r} cannot use (it needs whole logits): set kd_loss to "
                             f"{', '.join(repr(k) for k in SOFTMAX_LOSSES)}.")

    def check_rows(self, dataset: Any, which: str) -> None:
        """Every row of a `datasets.Dataset` that is routed to this signal is one of its rows, with the same counted
        positions (checked once per dataset; a stream's rows are checked per batch)."""
        joined = [c for c in (getattr(dataset, "column_names", None) or []) if c.startswith(SIGNAL_PREFIX)]
        if joined:
            raise ValueError(f"The {which} dataset carries teacher_signal columns ({joined[0]}, ...) and "
                             f"teacher_model[{self.name!r}] is a signal too: give the signal once, as the named "
                             "teacher (the rows routed to it are found in it), and the rows without its columns.")
        if not isinstance(dataset, datasets.Dataset) or ROUTE_COLUMN not in dataset.column_names:
            return
        key = dataset_fingerprint(dataset, None)
        if key is not None and key in self._checked:
            return
        columns = [c for c in ("input_ids", "attention_mask", "labels") if c in dataset.column_names]
        data = dataset.select_columns([ROUTE_COLUMN, *columns]).with_format(None)
        mode = self.meta["kd_token_mask"]
        step = 512
        for start in range(0, len(data), step):
            chunk = data[start : start + step]
            for i, routed in enumerate(chunk[ROUTE_COLUMN]):
                if str(routed) != self.name:
                    continue
                row = {c: chunk[c][i] for c in columns}
                positions = row_positions_hash(row, mode)
                place = self._find(row_hash(row["input_ids"]), positions, f"Row {start + i} of the {which} dataset")
                mask = row.get("attention_mask")
                if mask is not None and not all(mask):  # padded in the dataset: a batch finds it by its real tokens
                    real = np.asarray(row["input_ids"])[np.asarray(mask) != 0]
                    self.index.setdefault((row_hash(real), positions), place)
        if key is not None:
            self._checked.add(key)

    def _find(self, tokens: int, positions: int, what: str) -> int:
        found = self.index.get((tokens, positions))
        if found is not None:
            return found
        if tokens in self.rows:
            raise ValueError(
                f"{what} is routed to {self.name!r} and its tokens are in that teacher signal, but with other counted "
                f"positions (kd_token_mask={self.meta['kd_token_mask']!r}: its labels or attention mask moved, e.g. a "
                "collator or a shifted prompt/completion boundary): route rows as they were when the signal was made, "
                "or create it again from these.")
        raise ValueError(
            f"{what} is routed to {self.name!r}, but that teacher signal holds no row with its tokens (made from "
            "other rows, or these were changed or retokenised): create the signal from the rows routed to it, e.g. "
            f"create_teacher_signal(teacher, rows.filter(lambda r: r['teacher_id'] == {self.name!r}), ...).")

    def columns_for(self, inputs: dict[str, Any], label_name: str) -> dict[str, torch.Tensor]:
        """The `teacher_signal_*` columns of this batch's rows (all routed here), as the collator batches a signal
        joined with its rows: each row found by its real tokens and counted positions."""
        ids = inputs["input_ids"]
        if isinstance(inputs.get("position_ids"), torch.Tensor):
            raise ValueError(f"This batch packs several sequences per row (position_ids): the rows routed to "
                             f"{self.name!r} are found in its signal one sequence per row. Train without packing "
                             "(padding_free=False / a padding collator).")
        mask = inputs.get("attention_mask")
        counted = kd_positions(mask, inputs.get(label_name), self.meta["kd_token_mask"], causal=True)
        if counted is None:
            counted = torch.ones(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool, device=ids.device)
        positions = positions_hashes(counted, mask)
        real = None if mask is None else (mask != 0).cpu().numpy()
        places = []
        for i, row in enumerate(ids.detach().cpu().numpy()):
            tokens = row if real is None else row[real[i]]
            places.append(self._find(row_hash(np.asarray(tokens)), positions[i], f"Row {i} of this batch"))
        rows = self.signal[places]
        return {c: stack_signal(rows[c]).to(ids.device) for c in self.columns}


def signal_teachers(named: dict[str, Any] | None) -> dict[int, SignalTeacher]:
    """The offline signals of a `teacher_model` dict, by their place among its names."""
    if named is None:
        return {}
    return {place: SignalTeacher(name, value) for place, (name, value) in enumerate(named.items()) if is_signal(value)}


__all__ = ["SignalTeacher", "is_signal", "signal_teachers"]
