"""Distillation losses: pure functions of student and teacher tensors.

Every function returns a float32 scalar that is differentiable w.r.t. the student arguments. Inputs of
any floating dtype are upcast with ``.float()`` before any arithmetic, so bf16/fp16 activations give the
same (stable) result as float32 ones. Log-probabilities always come from ``log_softmax``.

Shapes: logits ``(B, C)`` or ``(B, T, C)``; hidden states ``(B, T, D)``; attention scores
``(B, H, T, T)``; ``mask`` is ``(B, T)`` (``(B,)`` for ``(B, C)`` logits) with non-zero for real
tokens, in any int/bool/float dtype. Padded positions are replaced by zeros *before* the loss is
computed, so whatever they hold (even inf/NaN) changes neither the value nor the gradient, and a mask
without a single real position gives a loss of exactly 0.

References for the definitions:

- Hinton et al., 2015, "Distilling the Knowledge in a Neural Network": KL at temperature T, scaled
  by T**2 so gradient magnitudes do not shrink as T grows.
- Sanh et al., 2019, DistilBERT: the same KL plus a cosine loss between hidden states.
- Jiao et al., 2020, TinyBERT: soft cross-entropy on predictions, MSE on hidden states and on
  pre-softmax attention scores.
- Wang et al., 2020/2021, MiniLM and MiniLMv2: KL between self-attention (relation) distributions.
- Sun et al., 2019, BERT-PKD: distance between L2-normalised [CLS] states.
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
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = [
    "DIVERGENCE_KINDS",
    "FEATURE_LOSSES",
    "KD_LOSSES",
    "TeacherLogits",
    "attention_score_mse",
    "binary_kl_div",
    "binary_soft_cross_entropy",
    "cosine_loss",
    "generalized_jsd",
    "hidden_mse",
    "kl_div",
    "logit_kd_loss",
    "logit_mse",
    "pkd_loss",
    "relation_kl",
    "reverse_kl",
    "divergence_rows",
    "skew_kl",
    "skew_reverse_kl",
    "soft_cross_entropy",
    "topk_with_tail",
    "total_variation",
    "with_tail",
]

TeacherLogits = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""Dense teacher logits ``(..., C)``, or top-k ``(values, indices)``, both ``(..., k)``."""


# --------------------------------------------------------------------------------------------------
# validation and masking helpers


def _check_temperature(temperature: float) -> float:
    try:
        value = float(temperature)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return value


def _check_beta(beta: float) -> float:
    if isinstance(beta, bool):
        value = math.nan
    else:
        try:
            value = float(beta)
        except (TypeError, ValueError, RuntimeError):
            value = math.nan
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            f"beta (jsd_beta) must be a number in [0, 1] (0 = forward KL, 1 = reverse KL, 0.5 = JSD), "
            f"got {beta!r}"
        )
    return value


def _check_same_shape(fn: str, student: torch.Tensor, teacher: torch.Tensor) -> None:
    if student.shape != teacher.shape:
        raise ValueError(
            f"{fn}: student shape {tuple(student.shape)} and teacher shape {tuple(teacher.shape)} differ; "
            "add a projection (e.g. nn.Linear) that maps the student to the teacher's size"
        )


def _real_positions(mask: torch.Tensor | None, shape: torch.Size, device: torch.device, fn: str):
    """Boolean mask of real positions with exactly ``shape``, or None when every position is real."""
    if mask is None:
        return None
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{fn}: mask shape {tuple(mask.shape)} does not match the positions {tuple(shape)}")
    return mask.to(device=device) != 0


def _zero_padding(x: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """Zero the padded positions so their content cannot reach the value or the gradient."""
    if real is None:
        return x
    return torch.where(real.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _mean_over_positions(per_position: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """Mean over the real positions; 0 (not 0/0) when there are none."""
    if real is None:
        return per_position.sum() / max(per_position.numel(), 1)
    total = torch.where(real, per_position, 0.0).sum()
    return total / real.sum().clamp_min(1)


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
    if isinstance(teacher_logits, tuple | list):
        if len(teacher_logits) not in (2, 3):
            raise ValueError(
                f"{fn}: sparse teacher logits must be a (values, indices) pair or a (log_probs, indices, log_tail) "
                "triple"
            )
        values, indices = teacher_logits[0], teacher_logits[1]
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
        if len(teacher_logits) == 3:  # top-k log-probabilities at T plus the tail bucket: k + 1 outcomes
            tail = teacher_logits[2].float().to(s.device)
            if tail.shape != values.shape[:-1]:
                raise ValueError(f"{fn}: log_tail {tuple(tail.shape)} must have the shape {tuple(values.shape[:-1])}")
            log_p = torch.cat([values, _zero_padding(tail.unsqueeze(-1), real)], -1)
            log_q = with_tail(F.log_softmax(s / temperature, dim=-1).gather(-1, indices))
        else:
            log_p = F.log_softmax(values / temperature, dim=-1)
            log_q = F.log_softmax(s.gather(-1, indices) / temperature, dim=-1)
    else:
        _check_same_shape(fn, student_logits, teacher_logits)
        t = _zero_padding(teacher_logits.float(), real)
        log_p = F.log_softmax(t / temperature, dim=-1)
        log_q = F.log_softmax(s / temperature, dim=-1)
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


def _log_mixture_terms(d: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``log(M/P)`` and ``log(M/Q)`` from ``d = log Q - log P``, with ``M = beta*P + (1-beta)*Q``.

    Both share one term: ``log(M/P) = relu(d) + c`` and ``log(M/Q) = relu(-d) + c`` with
    ``c = log(r + w*exp(-|d|))``, ``(w, r) = (1-beta, beta)`` where ``d <= 0`` and ``(beta, 1-beta)``
    elsewhere. Near agreement ``c = log1p(w*expm1(-|d|))``, exactly 0 at ``d = 0`` (a float32 logsumexp
    leaves ~1e-7 there, times ``T**2``); far from it ``logaddexp(log r, log w - |d|)`` keeps ``log(beta)`` when
    ``1 - beta`` rounds to 1 and when ``beta`` itself is below float32's range. ``exp`` only sees
    ``-|d| <= 0``, so nothing overflows, and ``d = +-inf`` (a class with zero mass on one side) gives inf only
    in the term that zero mass multiplies.
    """
    neg = d <= 0
    w = torch.where(neg, d.new_tensor(1.0 - beta), d.new_tensor(beta))
    # the logs of the weights in double first: beta may be far below float32's range (1e-140), its log is not
    log_beta, log_rest = d.new_tensor(math.log(beta)), d.new_tensor(math.log1p(-beta))
    log_w, log_r = torch.where(neg, log_rest, log_beta), torch.where(neg, log_beta, log_rest)
    a = -d.abs()
    y = w * torch.expm1(a)  # in [-w, 0]
    near = y > -0.5
    c = torch.where(near, torch.log1p(torch.where(near, y, 0.0)), torch.logaddexp(log_r, log_w + a))
    return d.clamp(min=0) + c, (-d).clamp(min=0) + c


class _GeneralizedJSD(torch.autograd.Function):
    """Per-item ``beta*KL(P||M) + (1-beta)*KL(Q||M)`` from log-probabilities, with a closed-form backward.

    Autograd through the forward would keep about ten ``(N, C)`` intermediates and walk them back (15x
    the time of :func:`kl_div` on CPU at 4,096 x 32,000). The gradient has a closed form instead,
    ``dL/dlog Q = -(1-beta) * Q * log(M/Q)`` and ``dL/dlog P = -beta * P * log(M/P)``: the forward computes
    exactly these products on its way to the value and keeps them (one ``(N, C)`` tensor per input that
    needs a gradient, usually only the student's), so the backward is one multiplication. The rows are
    walked in blocks of about :data:`_JSD_BLOCK` elements, so the elementwise steps stay in cache.
    """

    @staticmethod
    def forward(ctx, log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
        want_p, want_q = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        flat_p, flat_q = log_p.reshape(-1, log_p.shape[-1]), log_q.reshape(-1, log_q.shape[-1])
        out = flat_p.new_empty(flat_p.shape[0])
        keep_p = torch.empty_like(flat_p) if want_p else None
        keep_q = torch.empty_like(flat_q) if want_q else None
        for rows in _row_blocks(flat_p):
            p_term, q_term = _jsd_terms(flat_p[rows], flat_q[rows], beta)
            out[rows] = -(p_term.sum(-1) + q_term.sum(-1))
            if want_p:
                keep_p[rows] = p_term
            if want_q:
                keep_q[rows] = q_term
        ctx.shape = log_p.shape
        ctx.save_for_backward(keep_p, keep_q)
        return out.reshape(log_p.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        keep_p, keep_q = ctx.saved_tensors
        g = -grad.reshape(-1, 1)
        return (
            (keep_p * g).reshape(ctx.shape) if keep_p is not None else None,
            (keep_q * g).reshape(ctx.shape) if keep_q is not None else None,
            None,
        )


_JSD_BLOCK = 1 << 18  # elements per block of rows on CPU: 1 MiB of float32, a few blocks fit in L2
_JSD_BLOCK_ACCELERATOR = 1 << 25  # on GPUs: few kernel launches; 128 MiB per float32 temporary
# The fast path's log-ratio range: exp(80) and exp(-80) are normal float32 numbers, far from overflow.
_JSD_FAST_RANGE = 80.0


def _row_blocks(x: torch.Tensor):
    block = _JSD_BLOCK if x.device.type == "cpu" else _JSD_BLOCK_ACCELERATOR
    step = max(1, block // max(1, x.shape[-1]))
    for start in range(0, x.shape[0], step):
        yield slice(start, start + step)


def _jsd_terms(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``beta * P * log(M/P)`` and ``(1-beta) * Q * log(M/Q)``, 0 where that probability is 0.

    Fast path (a dozen elementwise passes): with ``d = log Q - log P``, ``log(M/Q) = log1p(beta*expm1(-d))``
    when ``beta <= 1/2`` (the argument stays above -1/2, so no cancellation) and ``log(M/P) = log(M/Q) + d``;
    the mirror image ``log(M/P) = log1p((1-beta)*expm1(d))`` when ``beta > 1/2``. Both are exactly 0 at
    agreement. It needs every ``d`` of the block finite and inside the side where ``expm1`` cannot overflow;
    a block outside (a class with zero mass, log-ratios beyond 80) takes :func:`_log_mixture_terms`.
    """
    d = log_q - log_p
    low, high = torch.stack(torch.aminmax(d)).tolist()  # one device sync for both bounds (NaN: guarded path)
    small_beta = beta <= 0.5
    if small_beta and low >= -_JSD_FAST_RANGE and high < math.inf:
        m_over_q = torch.expm1(-d).mul_(beta).log1p_()
        m_over_p = m_over_q + d
    elif not small_beta and high <= _JSD_FAST_RANGE and low > -math.inf:
        m_over_p = torch.expm1(d).mul_(1.0 - beta).log1p_()
        m_over_q = m_over_p - d
    else:
        m_over_p, m_over_q = _log_mixture_terms(d, beta)
        p, q = log_p.exp(), log_q.exp()
        return (torch.where(p > 0, (beta * p) * m_over_p, 0.0),
                torch.where(q > 0, ((1.0 - beta) * q) * m_over_q, 0.0))
    # every d is finite here, so both log-ratios are finite and a zero probability gives a zero product
    return log_p.exp().mul_(m_over_p).mul_(beta), log_q.exp().mul_(m_over_q).mul_(1.0 - beta)


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
    ``log(M/Q)`` come from the log-ratio ``log Q - log P`` (see :func:`_log_mixture_terms`), so the value
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


def topk_with_tail(logits: torch.Tensor, k: int, temperature: float = 1.0):
    """A teacher's top-k signal with its tail bucket: ``(log_probs, indices, log_tail)`` at temperature T, the
    sparse teacher format every logit KD function here takes (offline teacher outputs)."""
    log_p = F.log_softmax(logits.float() / _check_temperature(temperature), dim=-1)
    values, indices = log_p.topk(k, dim=-1)
    return values, indices, with_tail(values)[..., -1]


def _log1p_mix(w: float, d: torch.Tensor) -> torch.Tensor:
    """``log((1 - w) + w * exp(d))`` for ``w`` in [0, 1], without overflow for any ``d`` and exactly 0 at ``d = 0``.

    ``d <= 0``: ``log1p(w * expm1(d))``; ``d > 0``: ``d + log1p((1 - w) * expm1(-d))`` (the same quantity with
    ``exp(d)`` factored out). Both are one ``expm1`` of ``-|d|`` in [-1, 0] and one ``log1p``: two transcendental
    functions per element, no branch computed twice."""
    neg = d <= 0
    return d.clamp(min=0) + torch.log1p(torch.where(neg, w, 1.0 - w) * torch.expm1(-d.abs()))


_FAST_RANGE = 80.0  # exp(80) is a normal float32 number: below it log1p(w * expm1(d)) cannot overflow


def _bounded(d: torch.Tensor) -> bool:
    """Eager code only: every log-ratio finite and within +-80 (one pass, one sync). Then the mixtures' plain form
    `log1p(w * expm1(d))` is exact and overflow-free, and no product meets an infinity: a third of the elementwise
    passes of the general form. Traced (`torch.compile`) code always takes the general form."""
    if torch.compiler.is_compiling() or d.numel() == 0:
        return False
    low, high = torch.stack(torch.aminmax(d)).tolist()
    return -_FAST_RANGE <= low and high <= _FAST_RANGE  # False for NaN


def _mixer(fast: bool):
    """`_log1p_mix` in the form `fast` allows (see :func:`_bounded`)."""
    if fast:
        return lambda w, d: torch.log1p(torch.expm1(d) * w)
    return _log1p_mix


def _multiplier(fast: bool):
    return torch.mul if fast else _masked_product


def _masked_product(p: torch.Tensor, x: torch.Tensor | float) -> torch.Tensor:
    """``p * x``, 0 where ``p == 0``: an outcome without mass contributes nothing, even where ``x`` is infinite."""
    return torch.where(p > 0, p * x, 0.0)


def divergence_rows(kind: str, log_q: torch.Tensor, log_p: torch.Tensor, beta: float = 0.5, alpha: float = 0.1):
    """Per row of student/teacher log-probabilities (``(..., C)``, float32): the divergence ``kind`` (no ``T**2``)
    and the statistic ``sum_v Q_v dL/dQ_v`` its logit gradient needs (:mod:`hf_distill.losses.chunked`).

    ``P`` = teacher, ``Q`` = student; all but ``soft_ce`` are true divergences (>= 0, exactly 0 at agreement):

    - ``kl``: KL(P || Q) (Hinton et al., 2015); ``soft_ce``: -sum P log Q (TinyBERT);
    - ``reverse_kl``: KL(Q || P) (MiniLLM, Gu et al., 2024);
    - ``jsd``: beta KL(P || M) + (1-beta) KL(Q || M), M = beta P + (1-beta) Q (GKD, Agarwal et al., 2024);
    - ``skew_kl``: KL(P || alpha P + (1-alpha) Q); ``skew_reverse_kl``: KL(Q || (1-alpha) P + alpha Q) (DistiLLM,
      Ko et al., 2024, alpha = 0.1 there);
    - ``tvd``: total variation distance 1/2 sum |P - Q| (used for KD by Wen et al., 2023, f-divergence KD).

    Mixtures are never formed in probability space: their logs come from the log-ratio ``d = log Q - log P``.
    ``jsd`` at ``beta`` 0 / 1 is the forward / reverse KL, as in :func:`generalized_jsd`.
    """
    if kind == "jsd" and beta in (0.0, 1.0):
        kind = "kl" if beta == 0.0 else "reverse_kl"
    d = log_q - log_p
    fast = kind != "soft_ce" and _bounded(d)
    mix, times = _mixer(fast), _multiplier(fast)
    if kind in ("kl", "soft_ce"):
        p = log_p.exp()
        value = times(p, -d if kind == "kl" else -log_q).sum(-1)
        return value, torch.zeros_like(value)
    q = log_q.exp()
    if kind == "reverse_kl":
        value = times(q, d).sum(-1)
        return value, value
    if kind == "jsd":
        log_m_q = mix(beta, -d)  # log(M/Q) = log((1-beta) + beta P/Q); log(M/P) = log(M/Q) + d
        kl_q_m = -times(q, log_m_q).sum(-1)
        kl_p_m = -times(log_p.exp(), log_m_q + d).sum(-1)
        return beta * kl_p_m + (1 - beta) * kl_q_m, kl_q_m
    if kind == "skew_kl":
        log_r_p = mix(1 - alpha, d)  # log(R/P) = log(alpha + (1-alpha) Q/P)
        return -times(log_p.exp(), log_r_p).sum(-1), times(q, torch.exp(-log_r_p)).sum(-1)
    if kind == "skew_reverse_kl":
        log_r_q = mix(1 - alpha, -d)  # log(R/Q) = log(alpha + (1-alpha) P/Q)
        g = -log_r_q - alpha * torch.exp(-log_r_q)  # dL/dQ up to a constant
        return -times(q, log_r_q).sum(-1), times(q, g).sum(-1)
    if kind == "tvd":
        diff = q - log_p.exp()
        return 0.5 * diff.abs().sum(-1), (0.5 * q * torch.sign(diff)).sum(-1)
    raise ValueError(f"unknown divergence {kind!r}; known: {', '.join(DIVERGENCE_KINDS)}")


DIVERGENCE_KINDS = ("kl", "reverse_kl", "jsd", "skew_kl", "skew_reverse_kl", "tvd", "soft_ce")


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


def _squared_error_mean(fn: str, student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None):
    """Global mean of squared errors over real positions and the last (feature/class) dim."""
    _check_same_shape(fn, student, teacher)
    s = student.float()
    real = _real_positions(mask, s.shape[:-1], s.device, fn)
    diff = _zero_padding(s, real) - _zero_padding(teacher.float(), real)
    sq = diff.square()
    if real is None:
        return sq.sum() / max(sq.numel(), 1)
    return sq.sum() / (real.sum().clamp_min(1) * s.shape[-1])


def logit_mse(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Squared error of raw logits averaged over items and classes.

    Logit regression as in Ba & Caruana (2014), "Do Deep Nets Really Need to be Deep?" (see also Kim et
    al., 2021, comparing it with KL); raw logits are compared, so there is no temperature. Needs dense
    teacher logits.
    """
    if isinstance(teacher_logits, tuple | list):
        raise ValueError(
            "logit_mse needs dense teacher logits; top-k (values, indices) works with "
            "kl / soft_ce / reverse_kl / jsd only"
        )
    return _squared_error_mean("logit_mse", student_logits, teacher_logits, mask)


def _binary_log_probs(fn: str, student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float):
    if isinstance(teacher_logits, tuple | list):
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


KD_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "kl": kl_div,
    "soft_ce": soft_cross_entropy,
    "mse": logit_mse,
    "reverse_kl": reverse_kl,
    "jsd": generalized_jsd,
    "skew_kl": skew_kl,
    "skew_reverse_kl": skew_reverse_kl,
    "tvd": total_variation,
}
"""Logit KD objectives by config name. Signatures differ (``mse`` has no temperature, ``jsd`` takes
``beta`` third), so call them through :func:`logit_kd_loss` or by keyword."""


def logit_kd_loss(
    kind: str,
    student_logits: torch.Tensor,
    teacher_logits: TeacherLogits,
    temperature: float,
    mask: torch.Tensor | None = None,
    beta: float = 0.5,
    alpha: float = 0.1,
) -> torch.Tensor:
    """Dispatch to the logit KD objective named ``kind`` (a key of :data:`KD_LOSSES`).

    ``"mse"`` compares raw logits and ignores ``temperature`` (as in TinyBERT and DistilBERT, where the
    temperature only enters the softmax-based terms); ``beta`` is used by ``"jsd"`` only. Both are still
    validated for all kinds so a bad config fails the same way whichever objective it selects.
    """
    if kind not in KD_LOSSES:
        raise ValueError(f"unknown logit KD kind {kind!r}; known kinds: {', '.join(sorted(KD_LOSSES))}")
    temperature = _check_temperature(temperature)
    beta = _check_beta(beta)
    if kind == "mse":
        return logit_mse(student_logits, teacher_logits, mask)
    if kind == "jsd":
        return generalized_jsd(student_logits, teacher_logits, beta=beta, temperature=temperature, mask=mask)
    if kind in ("skew_kl", "skew_reverse_kl"):
        return KD_LOSSES[kind](student_logits, teacher_logits, alpha=alpha, temperature=temperature, mask=mask)
    return KD_LOSSES[kind](student_logits, teacher_logits, temperature, mask)


# --------------------------------------------------------------------------------------------------
# intermediate-layer (feature) distillation


def hidden_mse(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Squared error of hidden states, one global mean over real positions and features.

    TinyBERT's hidden-state loss (after any projection of the student). Equals ``F.mse_loss`` when
    ``mask`` is None; with a mask, padding neither contributes nor dilutes the mean.
    """
    return _squared_error_mean("hidden_mse", student, teacher, mask)


def cosine_loss(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``1 - cos(s, t)`` per token, averaged over real positions (DistilBERT's cosine-embedding term)."""
    _check_same_shape("cosine_loss", student, teacher)
    s = student.float()
    real = _real_positions(mask, s.shape[:-1], s.device, "cosine_loss")
    cos = F.cosine_similarity(_zero_padding(s, real), _zero_padding(teacher.float(), real), dim=-1)
    return _mean_over_positions(1.0 - cos, real)


def attention_score_mse(
    student_scores: torch.Tensor,
    teacher_scores: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
) -> torch.Tensor:
    """Squared error of pre-softmax attention scores ``(B, H, T, T)``, averaged over real pairs.

    TinyBERT's attention loss, but the mean runs only over (batch, head, query, key) entries whose query
    and key are both real, so the value does not depend on how much padding the batch has (TinyBERT
    instead zeroes scores below -100 and averages over every entry). Entries at real pairs must be
    finite. ``causal=True`` (decoders) also leaves out every key later than its query: the mean runs over
    real pairs with key <= query.
    """
    _check_same_shape("attention_score_mse", student_scores, teacher_scores)
    s = student_scores.float()
    t = teacher_scores.float()
    if causal:
        if s.dim() != 4 or s.shape[-1] != s.shape[-2]:
            raise ValueError(f"attention_score_mse: causal scores must be (B, H, T, T), got {tuple(s.shape)}")
        if mask is None:
            mask = torch.ones(s.shape[0], s.shape[-1], dtype=torch.bool, device=s.device)
    if mask is None:
        sq = (s - t).square()
        return sq.sum() / max(sq.numel(), 1)
    if s.dim() != 4 or s.shape[-1] != s.shape[-2]:
        raise ValueError(
            f"attention_score_mse: scores must be (B, H, T, T) when a mask is given, got {tuple(s.shape)}"
        )
    real = _real_positions(mask, torch.Size((s.shape[0], s.shape[-1])), s.device, "attention_score_mse")
    pair = real[:, :, None] & real[:, None, :]
    if causal:
        pair = pair & _causal_keys(s.shape[-1], s.device)
    pair = pair.unsqueeze(1).expand_as(s)
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    diff = torch.where(pair, s, zero) - torch.where(pair, t, zero)
    return diff.square().sum() / pair.sum().clamp_min(1)


def _causal_keys(length: int, device: torch.device) -> torch.Tensor:
    """``(T, T)`` with True where the key (column) is not later than the query (row)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def _relation_log_probs(
    a: torch.Tensor, b: torch.Tensor, num_heads: int, keys: torch.Tensor | None, causal: bool = False
):
    """``log_softmax(a_h b_h^T / sqrt(d_h))`` per head, ``(B, H, T, T)``, with padded (and, causal, future)
    keys at -inf."""
    batch, length, dim = a.shape
    head_dim = dim // num_heads
    a_h = a.reshape(batch, length, num_heads, head_dim).transpose(1, 2)
    b_h = b.reshape(batch, length, num_heads, head_dim).transpose(1, 2)
    scores = a_h @ b_h.transpose(-1, -2) / math.sqrt(head_dim)
    allowed = None if keys is None else keys[:, None, None, :]
    if causal:
        future_ok = _causal_keys(length, a.device)
        # the diagonal stays allowed so a padded query's (ignored) row is never all -inf
        allowed = future_ok if allowed is None else (allowed & future_ok) | torch.eye(
            length, dtype=torch.bool, device=a.device
        )
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return F.log_softmax(scores, dim=-1)


def relation_kl(
    student_a: torch.Tensor,
    student_b: torch.Tensor,
    teacher_a: torch.Tensor,
    teacher_b: torch.Tensor,
    num_heads: int,
    mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
) -> torch.Tensor:
    """KL between teacher and student self-relation distributions (MiniLM / MiniLMv2).

    Each ``(B, T, D)`` input is split into ``num_heads`` contiguous heads; per head
    ``R = softmax(a_h b_h^T / sqrt(d_h))`` over the real keys, with ``d_h`` each model's own head dim, so
    student and teacher hidden sizes may differ. ``KL(R_teacher || R_student)`` is summed over keys,
    averaged over heads and the real queries of each example, then over the examples that have at least
    one real token. MiniLM: attention = ``(Q, K)`` with the model's heads and value relation = ``(V, V)``;
    MiniLMv2: ``(Q, Q) + (K, K) + (V, V)`` with a chosen number of relation heads. ``causal=True``
    (decoders): a query's relation runs only over keys not later than itself.
    """
    for name, x in (
        ("student_a", student_a),
        ("student_b", student_b),
        ("teacher_a", teacher_a),
        ("teacher_b", teacher_b),
    ):
        if x.dim() != 3:
            raise ValueError(f"relation_kl: {name} must be (B, T, D), got shape {tuple(x.shape)}")
    if student_a.shape != student_b.shape:
        raise ValueError(
            f"relation_kl: student_a {tuple(student_a.shape)} and student_b {tuple(student_b.shape)} differ"
        )
    if teacher_a.shape != teacher_b.shape:
        raise ValueError(
            f"relation_kl: teacher_a {tuple(teacher_a.shape)} and teacher_b {tuple(teacher_b.shape)} differ"
        )
    if student_a.shape[:2] != teacher_a.shape[:2]:
        raise ValueError(
            f"relation_kl: student {tuple(student_a.shape)} and teacher {tuple(teacher_a.shape)} need the "
            "same (B, T)"
        )
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"relation_kl: num_heads must be a positive int, got {num_heads!r}")
    for who, x in (("student", student_a), ("teacher", teacher_a)):
        if x.shape[-1] % num_heads:
            raise ValueError(
                f"relation_kl: num_heads={num_heads} does not divide the {who} hidden size {x.shape[-1]}"
            )

    real = _real_positions(mask, student_a.shape[:2], student_a.device, "relation_kl")
    # an example without real tokens keeps all keys so its (ignored) rows stay finite
    keys = None if real is None else real | ~real.any(-1, keepdim=True)
    log_q = _relation_log_probs(
        _zero_padding(student_a.float(), real), _zero_padding(student_b.float(), real), num_heads, keys, causal
    )
    log_p = _relation_log_probs(
        _zero_padding(teacher_a.float(), real), _zero_padding(teacher_b.float(), real), num_heads, keys, causal
    )
    p = log_p.exp()
    per_query = torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)  # (B, H, T)
    if real is None:
        return per_query.mean(dim=(1, 2)).sum() / max(per_query.shape[0], 1)
    n_real = real.sum(-1)
    per_example = torch.where(real[:, None, :], per_query, 0.0).sum(dim=(1, 2))
    per_example = per_example / (num_heads * n_real.clamp_min(1))
    return per_example.sum() / (n_real > 0).sum().clamp_min(1)


def pkd_loss(student_cls: torch.Tensor, teacher_cls: torch.Tensor) -> torch.Tensor:
    """``||s/||s|| - t/||t|| ||^2`` summed over features, averaged over the batch (BERT-PKD).

    Normalising first makes the loss independent of the two models' activation scales.
    """
    _check_same_shape("pkd_loss", student_cls, teacher_cls)
    s = F.normalize(student_cls.float(), dim=-1)
    t = F.normalize(teacher_cls.float(), dim=-1)
    per_item = (s - t).square().sum(-1)
    return per_item.sum() / max(per_item.numel(), 1)


FEATURE_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "hidden_mse": hidden_mse,
    "cosine_loss": cosine_loss,
    "attention_score_mse": attention_score_mse,
    "relation_kl": relation_kl,
    "pkd_loss": pkd_loss,
}
"""Intermediate-layer objectives by name (their signatures differ; see each function)."""
