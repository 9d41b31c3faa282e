"""Data collators for distillation batches.

`TeacherOutputsCollator` lets precomputed teacher outputs ride along with the inputs: columns whose
name starts with `teacher_` are taken out before the usual collator pads the text, then stacked (and,
for token-level outputs, padded to the batch's sequence length) so rows and teacher outputs stay
aligned whatever the shuffling and padding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

TEACHER_PREFIX = "teacher_"


def _to_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


def pad_stack(values: list[torch.Tensor], length: int | None, side: str = "right", fill: float = 0.0) -> torch.Tensor:
    """Stack per-example tensors; those with a sequence dimension are padded along it to `length`."""
    if all(v.shape == values[0].shape for v in values) and (values[0].dim() < 2 or length is None):
        return torch.stack(values)
    length = length or max(v.shape[0] for v in values)
    out = values[0].new_full((len(values), length, *values[0].shape[1:]), fill)
    for i, v in enumerate(values):
        n = min(v.shape[0], length)
        if side == "right":
            out[i, :n] = v[:n]
        else:
            out[i, length - n :] = v[v.shape[0] - n :]
    return out


class TeacherOutputsCollator:
    """Wrap a collator so that `teacher_*` columns are stacked and padded next to the inputs."""

    def __init__(self, base: Callable[[list[dict]], dict], padding_side: str | None = None) -> None:
        self.base = base
        tok = getattr(base, "tokenizer", None)
        self.padding_side = padding_side or getattr(tok, "padding_side", "right")

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        keys = [k for k in features[0] if k.startswith(TEACHER_PREFIX)]
        if not keys:
            return self.base(features)
        teacher = {k: [_to_tensor(f[k]) for f in features] for k in keys}
        batch = self.base([{k: v for k, v in f.items() if not k.startswith(TEACHER_PREFIX)} for f in features])
        ids = batch.get("input_ids")
        length = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
        for k, vals in teacher.items():
            batch[k] = pad_stack(vals, length, self.padding_side)
        return batch
