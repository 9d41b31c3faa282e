"""Rescaling a teacher signal to another temperature, only where that is exact.

A signal stores, at temperature T, log p_i = z_i / T - log Z_T for its top k ids and the log of the tail mass. At
T', log p'_i = (T / T') log p_i - log sum_j p_j^(T / T'), where the sum runs over *every* id. For the kept ids the
terms are known; for the tail only sum_j p_j is stored, and one tail mass at T comes from many tails (a few large
logits, or many small ones) with different masses at T' (sum p_j^a is not a function of sum p_j for a != 1). So
both the tail mass and the kept values at T' are unknown unless the tail holds no mass at all: k = the vocabulary,
or every other id's logit is -inf (a stored tail is -inf only then: it is a logsumexp of finite log-probabilities
otherwise). `rescale_teacher_signal` rescales such a signal and refuses any other with the reason.
"""

from __future__ import annotations

import json

import datasets
import numpy as np
import torch

from .teacher_signal import (
    _MARKER,
    SIGNAL_TAIL,
    SIGNAL_TOPK,
    SIGNAL_VALUES,
    pack,
    signal_metadata,
    unpack,
)

__all__ = ["rescale_teacher_signal"]


def rescale_teacher_signal(signal: datasets.Dataset, temperature: float) -> datasets.Dataset:
    """The signal (or rows joined with it) at another temperature, where that is exact: when no stored position has
    tail mass (k = the vocabulary, or every other id's logit is -inf); any other signal is refused with the reason (the
    module docstring's). The float16 rounding of the stored values scales by T / T'."""
    meta = signal_metadata(signal)
    if meta is None or not isinstance(signal, datasets.Dataset):
        raise ValueError("rescale_teacher_signal takes a teacher signal Dataset (load_teacher_signal(path), not "
                         "streamed: rescale it, then stream the result with streamed(...)).")
    if not (isinstance(temperature, int | float) and 0 < float(temperature) < float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}.")
    if float(temperature) == meta["temperature"]:
        return signal
    if meta.get("layout") == "compact":
        raise ValueError("rescale_teacher_signal takes format 2 signals (packed or split); a compact signal (format "
                         "3) stores log-probabilities relative to each token's largest: create it at temperature "
                         f"{temperature}.")
    tails = np.concatenate([c.flatten().to_numpy(zero_copy_only=False) for c in signal.data.column(SIGNAL_TAIL).chunks]
                           or [np.zeros(0, np.float32)])
    if not np.isneginf(tails).all():
        raise ValueError(
            f"The teacher signal (k={meta['k']} of {meta['vocab_size']} ids) holds tail mass at "
            f"{int((~np.isneginf(tails)).sum())} of {tails.size} positions, so it cannot be rescaled from "
            f"temperature {meta['temperature']} to {temperature} exactly: the tail's individual logits are not "
            "stored, and both the tail mass and the top-k values at the new temperature depend on them. Create the "
            f"signal at temperature {temperature} (or with k = the vocabulary, where rescaling is exact).")
    k, ratio, layout = meta["k"], meta["temperature"] / float(temperature), meta["layout"]

    def rows(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {SIGNAL_TOPK: [], **({SIGNAL_VALUES: []} if layout == "split" else {})}
        for i, entries in enumerate(batch[SIGNAL_TOPK]):
            split = torch.tensor(batch[SIGNAL_VALUES][i], dtype=torch.float32) if layout == "split" else None
            values, ids = unpack(torch.tensor(entries, dtype=torch.int64), split)
            values = (values.view(-1, k) * ratio).log_softmax(-1).view(-1)  # the tail stays empty
            topk, values16 = pack(values, ids, layout)
            out[SIGNAL_TOPK].append(topk)
            if values16 is not None:
                out[SIGNAL_VALUES].append(values16)
        return out

    new = {**meta, "temperature": float(temperature), "rescaled_from": meta["temperature"]}
    info = datasets.DatasetInfo(description=_MARKER + json.dumps(new, sort_keys=True), features=signal.features)
    mapped = signal.with_format(None).map(rows, batched=True, batch_size=256, features=signal.features)
    out = datasets.concatenate_datasets([mapped], info=info)
    fmt = signal.format  # rows joined by attach_teacher_signal read the signal's columns as tensors
    out.set_format(fmt["type"], columns=fmt["columns"], output_all_columns=fmt["output_all_columns"],
                   **fmt["format_kwargs"])
    return out
