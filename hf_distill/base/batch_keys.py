"""The batch keys every layer agrees on: the prefix of cached teacher columns, the offline teacher signal's, and the
left-padded prompts generation reads; and the one check that a batch carries the tensors a step needs.

On the ground floor because both sides use them: the collators (hf_distill.data) build batches with these keys,
the losses, the on-policy generation and the Distiller read them."""

from __future__ import annotations

from typing import Any

import torch

TEACHER_PREFIX = "teacher_"
ROUTE_COLUMN = f"{TEACHER_PREFIX}id"  # which named teacher distils each row (hf_distill.routing): names, not tensors
SIGNAL_PREFIX = f"{TEACHER_PREFIX}signal"  # an offline teacher signal (data.teacher_signal): one tensor per row
PROMPT_IDS, PROMPT_MASK = "prompt_input_ids", "prompt_attention_mask"
PROMPT_KEYS = (PROMPT_IDS, PROMPT_MASK)
"""The batch keys of the left-padded prompts (hf_distill.data.prompts.PromptCompletionCollator): generation reads
them, the loss never passes them to a model."""

__all__ = ["PROMPT_IDS", "PROMPT_KEYS", "PROMPT_MASK", "ROUTE_COLUMN", "SIGNAL_PREFIX", "TEACHER_PREFIX",
           "require_tensors"]


def require_tensors(batch: dict[str, Any], keys: tuple[str, ...], needs: str, fix: str) -> None:
    """Refuse a batch without the tensors `keys`: `needs` says what needs them, `fix` which collator builds them
    (a batch from another collator would otherwise fail later with a bare KeyError)."""
    missing = [k for k in keys if not isinstance(batch.get(k), torch.Tensor)]
    if missing:
        raise ValueError(
            f"{needs} in every batch, but this one has no {', '.join(missing)} (its keys: {sorted(batch)}). {fix}"
        )
