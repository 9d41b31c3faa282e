"""The three forms a teacher's logit signal takes, as typed objects with an explicit tag (`form`), so the losses
dispatch on what the teacher is rather than on `isinstance`/`len` checks of tuples:

- :class:`DenseLogits`: the teacher's logits over every class, ``(..., C)``;
- :class:`TopK`: top-k ``(values, indices)``, both ``(..., k)`` (offline caches); every divergence compares it with
  *both* distributions renormalised over the k ids;
- :class:`TopKTail`: top-k log-probabilities at T, their ids and the log of the mass of every other id,
  ``(log_probs (..., k), indices (..., k), log_tail (...))`` (an offline teacher signal,
  :func:`hf_distill.losses.topk_with_tail`); both sides become distributions over k + 1 outcomes.

:class:`TopK` and :class:`TopKTail` are named tuples, so a caller holding the plain tuples (cached columns, the data
layer) passes them as they are: :func:`as_teacher` is the one place that tells the forms apart.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["DenseLogits", "TeacherForm", "TopK", "TopKTail", "as_teacher"]


class DenseLogits(NamedTuple):
    """The teacher's logits over every class, ``(..., C)``."""

    logits: torch.Tensor
    form = "dense"


class TopK(NamedTuple):
    """The teacher's top-k logits and their ids, both ``(..., k)``: compared on those k ids, renormalised."""

    values: torch.Tensor
    indices: torch.Tensor
    form = "topk"


class TopKTail(NamedTuple):
    """The teacher's top-k log-probabilities at T, their ids and the log of the rest's mass: k + 1 outcomes."""

    log_probs: torch.Tensor
    indices: torch.Tensor
    log_tail: torch.Tensor
    form = "topk_tail"


TeacherForm = DenseLogits | TopK | TopKTail


def as_teacher(teacher, fn: str = "the loss") -> TeacherForm:
    """`teacher` as its typed form: a typed form as is, a tensor as :class:`DenseLogits`, a pair as :class:`TopK`,
    a triple as :class:`TopKTail`; anything else refused with `fn` named."""
    if isinstance(teacher, DenseLogits | TopK | TopKTail):
        return teacher
    if isinstance(teacher, torch.Tensor):
        return DenseLogits(teacher)
    if isinstance(teacher, tuple | list):
        if len(teacher) == 2:
            return TopK(*teacher)
        if len(teacher) == 3:
            return TopKTail(*teacher)
        raise ValueError(
            f"{fn}: sparse teacher logits must be a (values, indices) pair or a (log_probs, indices, log_tail) triple"
        )
    raise TypeError(f"{fn}: teacher logits must be a tensor or a top-k tuple, got {type(teacher).__name__}")
