"""Input checks and padding rules shared by every loss here (:mod:`.divergences`, :mod:`.feature_losses`).

``mask`` is ``(B, T)`` (``(B,)`` for ``(B, C)`` logits) with non-zero for real tokens, in any int/bool/float
dtype. Padded positions are replaced by zeros *before* a loss is computed, so whatever they hold (even inf/NaN)
changes neither the value nor the gradient, and a mask without a single real position gives a loss of exactly 0.
"""

from __future__ import annotations

import math

import torch


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
