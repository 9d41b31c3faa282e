"""Logit distillation losses (softmax divergences, logit MSE, multi-label sigmoid KD): pure functions of student
and teacher tensors. The feature losses are in :mod:`.feature_losses`; both are importable as `hf_distill.losses`.

Every function returns a float32 scalar that is differentiable w.r.t. the student arguments. Inputs of
any floating dtype are upcast with ``.float()`` before any arithmetic, so bf16/fp16 activations give the
same (stable) result as float32 ones. Log-probabilities always come from ``log_softmax``.

Shapes: logits ``(B, C)`` or ``(B, T, C)``; ``mask`` is ``(B, T)`` (``(B,)`` for ``(B, C)`` logits) with
non-zero for real tokens, in any int/bool/float dtype. Padded positions are replaced by zeros *before* the loss
is computed, so whatever they hold (even inf/NaN) changes neither the value nor the gradient, and a mask
without a single real position gives a loss of exactly 0 (:mod:`.masking`).

References for the definitions:

- Hinton et al., 2015, "Distilling the Knowledge in a Neural Network": KL at temperature T, scaled
  by T**2 so gradient magnitudes do not shrink as T grows.
- Sanh et al., 2019, DistilBERT: the same KL.
- Jiao et al., 2020, TinyBERT: soft cross-entropy on predictions.
- Gu et al., 2024, MiniLLM: reverse KL ``KL(student || teacher)`` for generative (causal) LMs.
- Agarwal et al., 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
  Mistakes" (GKD): the generalized Jensen-Shannon divergence ``JSD(beta)``, with TRL's ``GKDTrainer``
  convention for ``beta`` (0 = forward KL, 1 = reverse KL).
- Ko et al., 2024, "DistiLLM: Towards Streamlined Distillation for Large Language Models": skew KL and skew
  reverse KL (a mixture of both distributions on one side, ``alpha`` = 0.1 there).
- Wen et al., 2023, "f-Divergence Minimization for Sequence-Level Knowledge Distillation": total variation
  distance among the f-divergences for KD.

Top-k teacher logits ``(values, indices)`` (offline caches) are compared on the teacher's top-k support
with *both* distributions renormalised over those k ids, so every divergence here stays a divergence
(0 when the student's logits equal the teacher's, at every T); see :func:`_log_probs`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .jsd import _GeneralizedJSD
from .masking import (
    _check_beta,
    _check_same_shape,
    _check_temperature,
    _mean_over_positions,
    _real_positions,
    _squared_error_mean,
    _zero_padding,
)
from .registry import Divergence, KindMap, KindNames, get_divergence
from .teacher_forms import DenseLogits, TeacherForm, TopKTail, as_teacher, check_padding, gather_ids, padded_outcomes

__all__ = [
    "DIVERGENCE_KINDS",
    "KD_LOSSES",
    "TeacherLogits",
    "binary_kl_div",
    "binary_soft_cross_entropy",
    "generalized_jsd",
    "kl_div",
    "logit_kd_loss",
    "logit_mse",
    "reverse_kl",
    "divergence_rows",
    "skew_kl",
    "skew_reverse_kl",
    "soft_cross_entropy",
    "topk_with_tail",
    "total_variation",
    "with_tail",
]

TeacherLogits = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor] \
    | TeacherForm
"""Dense teacher logits ``(..., C)``, top-k ``(values, indices)``, both ``(..., k)``, or top-k + tail
``(log_probs, indices, log_tail)``: plain tensors and tuples, or their typed forms (:mod:`.teacher_forms`)."""


# --------------------------------------------------------------------------------------------------
# logit distillation


def _log_probs(
    fn: str,
    student_logits: torch.Tensor,
    teacher_logits: TeacherLogits,
    temperature: float,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Teacher and student log-probabilities at temperature ``T`` over the teacher's support.

    Dense teacher: both are ``log_softmax(x / T)`` over all ``C`` classes. Top-k teacher
    ``(values, indices)``: both distributions are renormalised over the teacher's k ids, i.e.
    ``softmax(values / T)`` and ``softmax(s.gather(-1, indices) / T)``. The cache stores no tail mass, so
    this is the only way to compare two distributions on the same support: every divergence built on it
    is a true divergence, exactly 0 when the student's logits equal the teacher's, at every T, and the
    gradient reaches only the k gathered student logits. Indices are assumed distinct, as ``torch.topk``
    gives.

    Top-k with a tail bucket ``(log_probs, indices, log_tail)`` (an offline teacher signal: the teacher's top-k
    log-probabilities *at T* and ``log(1 - sum of them)``): both sides become distributions over k + 1 outcomes,
    the k ids and "every other id", the student's from its full softmax at T (:func:`with_tail`). Divergences
    on them are true divergences of the full distributions' coarsening, 0 at agreement.
    """
    s = student_logits.float()
    real = _real_positions(mask, s.shape[:-1], s.device, fn)
    s = _zero_padding(s, real)
    teacher = as_teacher(teacher_logits, fn)
    if teacher.form == DenseLogits.form:
        _check_same_shape(fn, student_logits, teacher.logits)
        t = _zero_padding(teacher.logits.float(), real)
        return F.log_softmax(t / temperature, dim=-1), F.log_softmax(s / temperature, dim=-1), real
    values, indices = teacher[0], teacher.indices  # TopK's values or TopKTail's log-probabilities at T
    if values.shape != indices.shape:
        raise ValueError(
            f"{fn}: top-k teacher values {tuple(values.shape)} and indices {tuple(indices.shape)} differ"
        )
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise ValueError(f"{fn}: top-k teacher indices must be an integer tensor, got {indices.dtype}")
    if values.shape[:-1] != s.shape[:-1] or not 0 < values.shape[-1] <= s.shape[-1]:
        raise ValueError(
            f"{fn}: top-k teacher shape {tuple(values.shape)} does not fit student shape "
            f"{tuple(s.shape)} (need the same leading dims and 0 < k <= C)"
        )
    values = _zero_padding(values.float(), real)
    indices = indices.to(device=s.device, dtype=torch.long)
    if real is not None:
        indices = torch.where(real.unsqueeze(-1), indices, 0)
    if teacher.form == TopKTail.form:  # top-k log-probabilities at T plus the tail bucket: k + 1 outcomes
        tail = teacher.log_tail.float().to(s.device)
        if tail.shape != values.shape[:-1]:
            raise ValueError(f"{fn}: log_tail {tuple(tail.shape)} must have the shape {tuple(values.shape[:-1])}")
        tail = _zero_padding(tail.unsqueeze(-1), real)[..., 0]
        check_padding(values, indices, fn)
        log_p, log_q = _with_tails(values, tail, s / temperature, indices)
    else:  # TopK: both sides renormalised over the k ids
        log_p = F.log_softmax(values / temperature, dim=-1)
        log_q = F.log_softmax(s.gather(-1, indices) / temperature, dim=-1)
    return log_p, log_q, real


def kl_div(
    student_logits: torch.Tensor,
    teacher_logits: TeacherLogits,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``T**2 * KL(softmax(t/T) || softmax(s/T))`` summed over classes, averaged over items.

    Hinton et al. (2015) / DistilBERT. Items are the rows of ``(B, C)`` logits or the positions of
    ``(B, T, C)`` logits (only the real ones when ``mask`` is given). ``teacher_logits`` may be a top-k
    ``(values, indices)`` pair: then the KL is taken on the teacher's top-k support with the student
    renormalised over the same k ids (see :func:`_log_probs`), so it is 0 when student and teacher agree.
    """
    temperature = _check_temperature(temperature)
    log_p, log_q, real = _log_probs("kl_div", student_logits, teacher_logits, temperature, mask)
    p = log_p.exp()
    # classes the teacher gives exactly zero mass contribute 0, even where log-probs are -inf
    per_item = torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)
    return temperature**2 * _mean_over_positions(per_item, real)


def soft_cross_entropy(
    student_logits: torch.Tensor,
    teacher_logits: TeacherLogits,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``-(softmax(t/T) * log_softmax(s/T)).sum(-1)`` averaged over items, without ``T**2``.

    TinyBERT's prediction-layer loss. It differs from :func:`kl_div` (at ``T=1``) by the teacher's
    entropy, so it is minimal, not zero, when student and teacher agree. With top-k teacher logits
    ``(values, indices)`` the student is renormalised over the teacher's k ids (see :func:`_log_probs`),
    so at agreement the value is the entropy of ``softmax(values / T)``, the teacher on its support.
    """
    temperature = _check_temperature(temperature)
    log_p, log_q, real = _log_probs("soft_cross_entropy", student_logits, teacher_logits, temperature, mask)
    p = log_p.exp()
    per_item = -torch.where(p > 0, p * log_q, 0.0).sum(-1)
    return _mean_over_positions(per_item, real)


def reverse_kl(
    student_logits: torch.Tensor,
    teacher_logits: TeacherLogits,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``T**2 * KL(softmax(s/T) || softmax(t/T))`` summed over classes, averaged over items.

    The mode-seeking direction used for generative LMs (MiniLLM; GKD with ``beta=1``): the student is
    penalised for mass where the teacher has little, not for missing some of the teacher's modes. Items,
    masks and top-k ``(values, indices)`` teachers (both sides renormalised over the k ids) as in
    :func:`kl_div`.
    """
    temperature = _check_temperature(temperature)
    log_p, log_q, real = _log_probs("reverse_kl", student_logits, teacher_logits, temperature, mask)
    q = log_q.exp()
    per_item = torch.where(q > 0, q * (log_q - log_p), 0.0).sum(-1)
    return temperature**2 * _mean_over_positions(per_item, real)


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: TeacherLogits,
    beta: float = 0.5,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence of GKD (Agarwal et al., 2024), times ``T**2``, averaged over items.

    With ``P = softmax(t/T)`` (teacher), ``Q = softmax(s/T)`` (student) and ``M = beta*P + (1-beta)*Q``:
    ``T**2 * (beta*KL(P || M) + (1-beta)*KL(Q || M))``. TRL's ``GKDTrainer`` convention: ``beta = 0`` is
    exactly :func:`kl_div` (forward) and ``beta = 1`` exactly :func:`reverse_kl`; the interior tends to
    them only after dividing by ``beta`` (resp. ``1 - beta``), since ``JSD(beta) ~ beta * KL(P || Q)``.
    ``beta = 0.5`` is the symmetric JSD. ``M`` is never formed in probability space: ``log(M/P)`` and
    ``log(M/Q)`` come from the log-ratio ``log Q - log P`` (see :func:`.jsd._log_mixture_terms`), so the value
    is exactly 0 at agreement and stable for any logits. Items, masks and top-k ``(values, indices)``
    teachers (both sides renormalised over the k ids) as in :func:`kl_div`.
    """
    beta = _check_beta(beta)
    temperature = _check_temperature(temperature)
    if beta == 0.0:
        return kl_div(student_logits, teacher_logits, temperature, mask)
    if beta == 1.0:
        return reverse_kl(student_logits, teacher_logits, temperature, mask)
    log_p, log_q, real = _log_probs("generalized_jsd", student_logits, teacher_logits, temperature, mask)
    per_item = _GeneralizedJSD.apply(log_p, log_q, beta)
    return temperature**2 * _mean_over_positions(per_item, real)


def with_tail(log_probs_k: torch.Tensor) -> torch.Tensor:
    """``(..., k)`` log-probabilities of k ids -> ``(..., k + 1)`` with the log of the remaining mass appended,
    ``log(1 - sum p_k)``, computed as ``log(-expm1(logsumexp))`` (no cancellation when the k ids hold most of the
    mass; ``-inf`` when they hold all of it)."""
    covered = torch.logsumexp(log_probs_k, dim=-1, keepdim=True).clamp(max=0.0)
    return torch.cat([log_probs_k, torch.log(-torch.expm1(covered))], -1)


def _tail(a: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """log of the mass of every id but `indices` under `softmax(a)`: the logsumexp of the other logits, exact however
    much mass the ids hold (`log(1 - sum)` rounds to log 0 in float32 when they hold all but ~1e-7 of it)."""
    rest = a.scatter(-1, indices, float("-inf"))
    return torch.logsumexp(rest, -1) - torch.logsumexp(a, -1)


def _with_tails(values: torch.Tensor, tail: torch.Tensor, a: torch.Tensor, indices: torch.Tensor):
    """Teacher and student over the k ids plus the tail bucket, the student's tail by :func:`_tail` (the same ops as
    :func:`topk_with_tail`'s, so equal logits give equal outcomes: 0 exactly at agreement). When the ids are the
    whole vocabulary there is no tail: both sides are the k outcomes (the teacher's tail is empty then). Padding
    entries (an adaptive-k row: id -1, :mod:`.teacher_forms`) are outcomes of no mass on both sides."""
    valid, ids = gather_ids(indices)
    log_q_k = padded_outcomes(F.log_softmax(a, dim=-1).gather(-1, ids), valid)
    values = padded_outcomes(values, valid)
    if indices.shape[-1] == a.shape[-1]:
        return values, log_q_k
    return torch.cat([values, tail.unsqueeze(-1)], -1), torch.cat([log_q_k, _tail(a, ids).unsqueeze(-1)], -1)


def topk_with_tail(logits: torch.Tensor, k: int, temperature: float = 1.0) -> TopKTail:
    """A teacher's top-k signal with its tail bucket: ``(log_probs, indices, log_tail)`` at temperature T (a
    :class:`.teacher_forms.TopKTail`, a named tuple), the sparse teacher format every logit KD function here takes
    (offline teacher outputs)."""
    a = logits.float() / _check_temperature(temperature)
    values, indices = F.log_softmax(a, dim=-1).topk(k, dim=-1)
    if k == a.shape[-1]:
        return TopKTail(values, indices, torch.full_like(values[..., 0], float("-inf")))
    return TopKTail(values, indices, _tail(a, indices))


def divergence_rows(kind: str, log_q: torch.Tensor, log_p: torch.Tensor, beta: float = 0.5, alpha: float = 0.1):
    """Per row of student/teacher log-probabilities (``(..., C)``, float32): the divergence ``kind`` (no ``T**2``)
    and the statistic ``sum_v Q_v dL/dQ_v`` its logit gradient needs (:mod:`hf_distill.losses.chunked`): the row math
    of ``kind``'s registry entry (:mod:`.registry`; the built-in kinds and their definitions: :mod:`.kinds`), given
    its mixture parameter (``beta`` for ``jsd``, ``alpha`` for the skew divergences). A kind without row math
    (``mse``) or without an entry is refused."""
    entry = get_divergence(kind, needs="rows")
    return entry.rows(log_q, log_p, entry.weight(beta, alpha))


DIVERGENCE_KINDS = KindNames(softmax=True)
"""The divergences of softmax distributions (the kinds with row math, which the loss heads compute): a live view
of :mod:`.registry`."""


def _check_alpha(alpha: float) -> float:
    value = math.nan if isinstance(alpha, bool) else float(alpha) if isinstance(alpha, int | float) else math.nan
    if not 0.0 <= value < 1.0:
        raise ValueError(f"alpha (skew_alpha) must be a number in [0, 1) (DistiLLM uses 0.1), got {alpha!r}")
    return value


def _divergence(fn: str, kind: str, student_logits, teacher_logits, temperature, mask, alpha=0.1):
    temperature = _check_temperature(temperature)
    alpha = _check_alpha(alpha)
    log_p, log_q, real = _log_probs(fn, student_logits, teacher_logits, temperature, mask)
    per_item, _ = divergence_rows(kind, log_q, log_p, alpha=alpha)
    return temperature**2 * _mean_over_positions(per_item, real)


def _from_rows(entry: Divergence, student_logits, teacher_logits, temperature, mask, weight):
    """The whole-logits loss of a kind registered without a function of its own: its row math over the teacher's
    support (:func:`_log_probs`), averaged over positions, times its temperature factor (autograd through the rows)."""
    if entry.mixture is not None and entry.mixture.name == "alpha":
        weight = _check_alpha(weight)
    log_p, log_q, real = _log_probs(entry.name, student_logits, teacher_logits, temperature, mask)
    per_item, _ = entry.rows(log_q, log_p, weight)
    return entry.factor(temperature) * _mean_over_positions(per_item, real)


def skew_kl(
    student_logits: torch.Tensor,
    teacher_logits: TeacherLogits,
    alpha: float = 0.1,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """DistiLLM's skew KL (Ko et al., 2024), ``T**2 * KL(P || alpha*P + (1-alpha)*Q)``, averaged over items.

    Mixing a little of the teacher into the student's side bounds the divergence (at most ``log(1/alpha)`` per
    item) and its gradient where the student gives a teacher token almost no mass. ``alpha = 0`` is
    :func:`kl_div`. Items, masks and sparse teachers as in :func:`kl_div`."""
    return _divergence("skew_kl", "skew_kl", student_logits, teacher_logits, temperature, mask, alpha)


def skew_reverse_kl(
    student_logits: torch.Tensor,
    teacher_logits: TeacherLogits,
    alpha: float = 0.1,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """DistiLLM's skew reverse KL, ``T**2 * KL(Q || (1-alpha)*P + alpha*Q)``, averaged over items; ``alpha = 0``
    is :func:`reverse_kl`. Items, masks and sparse teachers as in :func:`kl_div`."""
    return _divergence("skew_reverse_kl", "skew_reverse_kl", student_logits, teacher_logits, temperature, mask,
                       alpha)


def total_variation(
    student_logits: torch.Tensor,
    teacher_logits: TeacherLogits,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Total variation distance ``T**2 * 1/2 sum |P - Q|`` (in [0, T**2]), averaged over items (f-divergence KD,
    Wen et al., 2023). Items, masks and sparse teachers as in :func:`kl_div`."""
    return _divergence("total_variation", "tvd", student_logits, teacher_logits, temperature, mask)


def logit_mse(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Squared error of raw logits averaged over items and classes.

    Logit regression as in Ba & Caruana (2014), "Do Deep Nets Really Need to be Deep?" (see also Kim et
    al., 2021, comparing it with KL); raw logits are compared, so there is no temperature. Needs dense
    teacher logits.
    """
    if as_teacher(teacher_logits, "logit_mse").form != DenseLogits.form:
        raise ValueError(
            "logit_mse needs dense teacher logits; top-k (values, indices) works with "
            "kl / soft_ce / reverse_kl / jsd only"
        )
    return _squared_error_mean("logit_mse", student_logits, teacher_logits, mask)


def _binary_log_probs(fn: str, student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float):
    if as_teacher(teacher_logits, fn).form != DenseLogits.form:
        raise ValueError(f"{fn}: multi-label distillation needs dense teacher logits, not top-k")
    _check_same_shape(fn, student_logits, teacher_logits)
    s, t = student_logits.float() / temperature, teacher_logits.float() / temperature
    return F.logsigmoid(t), F.logsigmoid(-t), F.logsigmoid(s), F.logsigmoid(-s)


def binary_kl_div(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``T**2 * sum_labels KL(Bernoulli(sigmoid(t/T)) || Bernoulli(sigmoid(s/T)))`` averaged over rows.

    Multi-label heads score each label with its own sigmoid, so a softmax across labels would compare the
    wrong distributions; each label is distilled as a binary distribution at temperature T instead."""
    temperature = _check_temperature(temperature)
    log_p, log_not_p, log_q, log_not_q = _binary_log_probs("binary_kl_div", student_logits, teacher_logits,
                                                           temperature)
    p = log_p.exp()
    per_label = p * (log_p - log_q) + (1 - p) * (log_not_p - log_not_q)
    per_row = per_label.sum(-1)
    return temperature**2 * per_row.sum() / max(per_row.numel(), 1)


def binary_soft_cross_entropy(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Binary cross-entropy of ``sigmoid(s/T)`` against the teacher's ``sigmoid(t/T)``, summed over labels and
    averaged over rows, without ``T**2`` (the multi-label counterpart of :func:`soft_cross_entropy`)."""
    temperature = _check_temperature(temperature)
    log_p, log_not_p, log_q, log_not_q = _binary_log_probs("binary_soft_cross_entropy", student_logits,
                                                           teacher_logits, temperature)
    p = log_p.exp()
    per_row = -(p * log_q + (1 - p) * log_not_q).sum(-1)
    return per_row.sum() / max(per_row.numel(), 1)


KD_LOSSES = KindMap("dense")
"""Logit KD objectives by config name (a live view of :mod:`.registry`: the kinds with a function of their own).
Signatures differ (``mse`` has no temperature, ``jsd`` takes ``beta`` third), so call them through
:func:`logit_kd_loss` or by keyword."""


def logit_kd_loss(
    kind: str,
    student_logits: torch.Tensor,
    teacher_logits: TeacherLogits,
    temperature: float,
    mask: torch.Tensor | None = None,
    beta: float = 0.5,
    alpha: float = 0.1,
) -> torch.Tensor:
    """Dispatch to the logit KD objective named ``kind`` (a registered kind, :mod:`.registry`).

    ``"mse"`` compares raw logits and ignores ``temperature`` (as in TinyBERT and DistilBERT, where the
    temperature only enters the softmax-based terms); ``beta`` is used by ``"jsd"`` only, ``alpha`` by the skew
    divergences. Both are still validated for all kinds so a bad config fails the same way whichever objective it
    selects.
    """
    entry = get_divergence(kind)
    temperature = _check_temperature(temperature)
    beta = _check_beta(beta)
    weight = entry.weight(beta, alpha)
    if entry.dense is None:
        return _from_rows(entry, student_logits, teacher_logits, temperature, mask, weight)
    if entry.temperature_power is None:
        return entry.dense(student_logits, teacher_logits, mask)
    if entry.mixture is not None:
        return entry.dense(student_logits, teacher_logits, temperature=temperature, mask=mask,
                           **{entry.mixture.name: weight})
    return entry.dense(student_logits, teacher_logits, temperature, mask)
