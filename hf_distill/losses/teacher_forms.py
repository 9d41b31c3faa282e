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

A :class:`TopKTail` row may hold fewer than k entries (an adaptive-k signal, issue #45): its missing entries are
padding, id :data:`PAD_ID` with log-probability -inf, after the real ones. The losses read a padded entry as an
outcome with no mass on either side (:func:`padded_outcomes`), so it adds exactly 0 to every divergence and its
gradient, and the tail is the stored one (the mass of every id the row does not hold).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["PAD_ID", "DenseLogits", "TeacherForm", "TopK", "TopKTail", "as_teacher", "check_padding", "gather_ids",
           "padded_outcomes"]


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


PAD_ID = -1
"""The id of a padding entry of a :class:`TopKTail` row (its log-probability is -inf)."""
_NO_MASS = -1.0e4  # a padded outcome's log-probability on both sides: exp() is exactly 0, the log finite (no NaN)


def gather_ids(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(valid, ids to gather and scatter with)`: padding (:data:`PAD_ID`) replaced by the row's first id, which is
    always a real one (scattering it twice writes the same column; a gathered copy is masked by `valid`)."""
    valid = indices >= 0
    return valid, torch.where(valid, indices, indices[..., :1])


def padded_outcomes(log_probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`log_probs` (..., m) with the entries where `valid` is False set to a finite log of exactly zero mass: an
    outcome both sides give 0, so it adds 0 to any divergence and to its gradient (-inf on both sides would give
    NaN, as -inf - -inf). Where every entry is valid, the values are returned bit for bit."""
    return torch.where(valid, log_probs, _NO_MASS)


def check_padding(log_probs: torch.Tensor, indices: torch.Tensor, fn: str) -> None:
    """Refuse padding other than :data:`PAD_ID` entries with log-probability -inf after a real first entry."""
    pad = indices < 0
    if not bool(pad.any()):
        return
    if bool((indices < PAD_ID).any()) or bool(pad[..., 0].any()) or not bool(
            (log_probs[pad] == float("-inf")).all()):
        raise ValueError(f"{fn}: a sparse teacher's ids must be >= 0, or {PAD_ID} for padding after a real first id "
                         "with log-probability -inf (an adaptive-k row holding fewer than k entries).")
