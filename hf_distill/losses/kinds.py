"""The built-in `kd_loss` kinds, one :class:`.registry.Divergence` entry each, with the row math the loss heads run.

``P`` = teacher, ``Q`` = student (rows of log-probabilities at T, ``d = log Q - log P``); all but ``soft_ce`` are
true divergences (>= 0, exactly 0 at agreement):

- ``kl``: KL(P || Q) (Hinton et al., 2015); ``soft_ce``: -sum P log Q (TinyBERT); ``mse``: squared error of raw
  logits (Ba & Caruana, 2014; Tang et al., 2019), not a softmax divergence, so no row math;
- ``reverse_kl``: KL(Q || P) (MiniLLM, Gu et al., 2024);
- ``jsd``: beta KL(P || M) + (1-beta) KL(Q || M), M = beta P + (1-beta) Q (GKD, Agarwal et al., 2024); at beta 0 /
  1 the forward / reverse KL, as :func:`hf_distill.losses.generalized_jsd`;
- ``skew_kl``: KL(P || alpha P + (1-alpha) Q); ``skew_reverse_kl``: KL(Q || (1-alpha) P + alpha Q) (DistiLLM,
  Ko et al., 2024, alpha = 0.1 there);
- ``tvd``: total variation distance 1/2 sum |P - Q| (used for KD by Wen et al., 2023, f-divergence KD).

Mixtures are never formed in probability space: their logs come from the log-ratio ``d``. Each ``_*_grad`` is the
closed-form ``dL/d(student logits / T)`` of its ``_*_rows`` (the chain rule through the softmax,
``Q_v (dL/dQ_v - stat)`` with ``stat = sum_u Q_u dL/dQ_u`` from the rows).
"""

from __future__ import annotations

import torch

from .divergences import (
    binary_kl_div,
    binary_soft_cross_entropy,
    generalized_jsd,
    kl_div,
    logit_mse,
    reverse_kl,
    skew_kl,
    skew_reverse_kl,
    soft_cross_entropy,
    total_variation,
)
from .registry import Divergence, Mixture, register

# ---------------------------------------------------------------------------------------------- shared row helpers


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


# ---------------------------------------------------------------------------------------------- row math per kind


def _kl_rows(log_q, log_p, w=None):
    d = log_q - log_p
    value = _multiplier(_bounded(d))(log_p.exp(), -d).sum(-1)
    return value, torch.zeros_like(value)


def _soft_ce_rows(log_q, log_p, w=None):
    value = _masked_product(log_p.exp(), -log_q).sum(-1)
    return value, torch.zeros_like(value)


def _softmax_gap(la, lb, stat, w=None):
    """The gradient of both `kl` and `soft_ce` (they differ by the teacher's entropy): ``Q - P``."""
    return la.exp() - lb.exp()


def _reverse_kl_rows(log_q, log_p, w=None):
    d = log_q - log_p
    value = _multiplier(_bounded(d))(log_q.exp(), d).sum(-1)
    return value, value


def _reverse_kl_grad(la, lb, stat, w=None):
    q, d = la.exp(), la - lb
    return _multiplier(_bounded(d))(q, d - stat)


def _jsd_rows(log_q, log_p, beta):
    if beta in (0.0, 1.0):
        return (_kl_rows if beta == 0.0 else _reverse_kl_rows)(log_q, log_p)
    d = log_q - log_p
    fast = _bounded(d)
    mix, times = _mixer(fast), _multiplier(fast)
    q = log_q.exp()
    log_m_q = mix(beta, -d)  # log(M/Q) = log((1-beta) + beta P/Q); log(M/P) = log(M/Q) + d
    kl_q_m = -times(q, log_m_q).sum(-1)
    kl_p_m = -times(log_p.exp(), log_m_q + d).sum(-1)
    return beta * kl_p_m + (1 - beta) * kl_q_m, kl_q_m


def _jsd_grad(la, lb, stat, beta):
    q, d = la.exp(), la - lb
    fast = _bounded(d)
    return _multiplier(fast)(q, -_mixer(fast)(beta, -d) - stat) * (1 - beta)


def _skew_kl_rows(log_q, log_p, alpha):
    d = log_q - log_p
    fast = _bounded(d)
    times = _multiplier(fast)
    log_r_p = _mixer(fast)(1 - alpha, d)  # log(R/P) = log(alpha + (1-alpha) Q/P)
    return -times(log_p.exp(), log_r_p).sum(-1), times(log_q.exp(), torch.exp(-log_r_p)).sum(-1)


def _skew_kl_grad(la, lb, stat, alpha):
    q, d = la.exp(), la - lb
    fast = _bounded(d)
    return _multiplier(fast)(q, torch.exp(-_mixer(fast)(1 - alpha, d)) - stat) * -(1 - alpha)


def _skew_reverse_kl_rows(log_q, log_p, alpha):
    d = log_q - log_p
    fast = _bounded(d)
    times = _multiplier(fast)
    q = log_q.exp()
    log_r_q = _mixer(fast)(1 - alpha, -d)  # log(R/Q) = log(alpha + (1-alpha) P/Q)
    g = -log_r_q - alpha * torch.exp(-log_r_q)  # dL/dQ up to a constant
    return -times(q, log_r_q).sum(-1), times(q, g).sum(-1)


def _skew_reverse_kl_grad(la, lb, stat, alpha):
    q, d = la.exp(), la - lb
    fast = _bounded(d)
    log_r_q = _mixer(fast)(1 - alpha, -d)
    return _multiplier(fast)(q, -log_r_q - alpha * torch.exp(-log_r_q) - stat)


def _tvd_rows(log_q, log_p, w=None):
    q = log_q.exp()
    diff = q - log_p.exp()
    return 0.5 * diff.abs().sum(-1), (0.5 * q * torch.sign(diff)).sum(-1)


def _tvd_grad(la, lb, stat, w=None):
    q = la.exp()
    return q * (0.5 * torch.sign(q - lb.exp()) - stat)


def _tvd_shift_grad(la, shift, stat, w=None):
    # P = Q e^shift: sign(Q - P) = sign(-shift) exactly, however far below la's last bit the shift is
    return la.exp() * (0.5 * torch.sign(-shift) - stat)


# ---------------------------------------------------------------------------------------------- the entries

_SKEW_ALPHA = "skew_alpha"

register(Divergence(
    "kl", "KL divergence", _kl_rows, _softmax_gap, kl_div, triton_code=0,
    help="T**2 * KL(teacher || student), DistilBERT", multi_label=binary_kl_div))
register(Divergence(
    "soft_ce", "soft cross-entropy", _soft_ce_rows, _softmax_gap, soft_cross_entropy, triton_code=1,
    temperature_power=0, help="soft cross-entropy without T**2, TinyBERT", multi_label=binary_soft_cross_entropy))
register(Divergence(
    "mse", "MSE of logits", dense=logit_mse, temperature_power=None,
    help="squared error of logits, Tang et al. 2019 BiLSTM students", multi_label=logit_mse))
register(Divergence(
    "reverse_kl", "reverse KL divergence", _reverse_kl_rows, _reverse_kl_grad, reverse_kl, triton_code=2,
    help="T**2 * KL(student || teacher), MiniLLM", method="reverse-kl"))
register(Divergence(
    "jsd", "generalized JSD", _jsd_rows, _jsd_grad, generalized_jsd, triton_code=3,
    mixture=Mixture("beta", "jsd_beta", "0 is the forward KL, 1 the reverse KL; TRL's GKD convention"),
    help="generalized Jensen-Shannon divergence of GKD, Agarwal et al. 2024, with `jsd_beta`", method="gkd"))
register(Divergence(
    "skew_kl", "skew KL divergence", _skew_kl_rows, _skew_kl_grad, skew_kl, triton_code=4,
    mixture=Mixture("alpha", _SKEW_ALPHA, "KL(teacher || alpha teacher + (1 - alpha) student); 0 is the forward KL"),
    help="DistiLLM's skew KL(teacher || alpha teacher + (1-alpha) student), Ko et al. 2024, with `skew_alpha`",
    method="distillm"))
register(Divergence(
    "skew_reverse_kl", "skew reverse KL divergence", _skew_reverse_kl_rows, _skew_reverse_kl_grad, skew_reverse_kl,
    triton_code=5,
    mixture=Mixture("alpha", _SKEW_ALPHA, "KL(student || alpha student + (1 - alpha) teacher); 0 is the reverse KL"),
    help="DistiLLM's skew reverse KL(student || alpha student + (1-alpha) teacher), with `skew_alpha`",
    method="distillm"))
register(Divergence(
    "tvd", "total variation distance", _tvd_rows, _tvd_grad, total_variation, triton_code=6,
    help="T**2 * total variation distance", method="tvd-kd", shift_grad=_tvd_shift_grad))
