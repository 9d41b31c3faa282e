"""Checks of a dataset's cached teacher columns (hf_distill.data.cache) against the run, before training starts.

A dataset that carries `teacher_*` columns lets the loss skip the teacher's forward; columns that do not fit the
student (another label set), the head (QA spans, encoder-decoder teachers) or the terms (hidden states not cached)
would make a wrong loss, so they are refused here, when the trainer is built.
"""

from __future__ import annotations

from typing import Any

import torch

from ..base.batch_keys import ROUTE_COLUMN
from ..features.heads import SOFTMAX_LOSSES, Head
from .cache import LOGITS_COLUMN, TOPK_INDICES_COLUMN, TOPK_VALUES_COLUMN, cached_hidden_layers
from .collators import TEACHER_PREFIX


def check_teacher_columns(
    dataset: Any, which: str, *, head: Head | None, teacher: Any, kd_weight: float, kd_loss: str,
    num_labels: int | None, intermediate: Any = None,
) -> None:
    """Refuse cached teacher columns that this run cannot use, and a teacher-less run whose rows lack them."""
    if dataset is None:
        return
    names, first = first_row(dataset, needed=teacher is None)
    cached_logits = [c for c in names if c.startswith(LOGITS_COLUMN) or c.startswith(TOPK_VALUES_COLUMN)]
    cached = [c for c in names if c.startswith(TEACHER_PREFIX) and c != ROUTE_COLUMN]  # teacher_id: names, not outputs
    if cached and head is Head.SEQ2SEQ_LM:
        raise ValueError(
            f"The {which} dataset carries cached teacher outputs ({', '.join(cached)}), but hf_distill.data.cache "
            "does not cache encoder-decoder teachers (their outputs depend on the decoder inputs): drop those columns "
            "and let the teacher run."
        )
    if cached_logits and head is Head.QUESTION_ANSWERING:
        raise ValueError(
            f"The {which} dataset carries cached teacher logits ({', '.join(cached_logits)}), but a question-"
            "answering student compares start and end logits, which hf_distill.data.cache does not store: drop "
            "those columns and let the teacher run."
        )
    for name in [c for c in names if c == LOGITS_COLUMN or c.startswith(f"{LOGITS_COLUMN}_")]:
        width = torch.as_tensor(first[name]).shape[-1]
        if num_labels is not None and width != num_labels:
            raise ValueError(
                f"The {which} dataset's {name} have width {width} but the student has {num_labels} "
                "labels. Recompute the cached logits with a teacher of the same label set, or drop the column."
            )
    if LOGITS_COLUMN not in names and teacher is None and kd_weight > 0:
        topk = (TOPK_VALUES_COLUMN in names and TOPK_INDICES_COLUMN in names) or any(
            f"{TEACHER_PREFIX}signal_{c}" in names for c in ("topk", "codes"))
        if topk and kd_loss not in SOFTMAX_LOSSES:  # mse: raw logits
            raise ValueError(
                f"kd_loss={kd_loss!r} needs teacher logits over the whole vocabulary, but the {which} dataset carries "
                "top-k ones (cached top-k logits or a teacher signal), which every divergence of softmax "
                f"distributions uses: set kd_loss to {', '.join(repr(k) for k in SOFTMAX_LOSSES)}, or pass "
                "teacher_model."
            )
        if not topk:
            raise ValueError(
                "kd_weight > 0 needs teacher logits: pass teacher_model, or add a `teacher_logits` column "
                f"to the {which} dataset (see hf_distill.data.cache; cached top-k logits and teacher signals serve "
                "every kd_loss but mse)."
            )
    if teacher is None and intermediate is not None:
        missing = sorted(intermediate.teacher_request.hidden - cached_hidden_layers(names))
        if missing:
            raise ValueError(
                f"distill_terms need teacher hidden states {missing}, which the {which} dataset does not carry "
                "(teacher_hidden_<i> columns): pass teacher_model, or cache them with "
                f"hf_distill.data.cache.cache_teacher_outputs(..., hidden_layers={missing})."
            )


def first_row(dataset: Any, needed: bool) -> tuple[list[str], dict[str, Any]]:
    """Column names and first row of any train dataset the Trainer takes, without consuming it.

    A `datasets.Dataset` has its column names; other datasets (torch map-style or iterable, lists of dicts,
    `datasets.IterableDataset`) are read at their first row: index 0, or a fresh iterator's first item. A dataset
    that is its own iterator would lose that row, so it is only read when the checks cannot do without it
    (`needed`: no teacher to fall back on) and is then refused with what to do instead.
    """
    import datasets

    if isinstance(dataset, datasets.Dataset):
        names = list(dataset.column_names)
        return names, (dataset[0] if any(n.startswith(TEACHER_PREFIX) for n in names) and len(dataset) else {})
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        row = dataset[0] if len(dataset) else {}
    elif hasattr(dataset, "__iter__"):
        rows = iter(dataset)
        if rows is dataset:
            if not needed:
                return [], {}
            raise ValueError(
                f"The train dataset ({type(dataset).__name__}) is its own iterator (iter(dataset) is dataset), so "
                "its first row cannot be read to check the cached teacher_* columns without losing it. Give an "
                "IterableDataset whose __iter__ starts a new pass over the rows (e.g. a generator: `yield from "
                "rows`), a map-style Dataset, or pass teacher_model."
            )
        row = next(rows, {})
    else:
        return [], {}
    return (list(row) if isinstance(row, dict) else []), (row if isinstance(row, dict) else {})
