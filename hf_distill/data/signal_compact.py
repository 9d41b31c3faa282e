"""The compact teacher-signal layout (format 3): bit-packed ids and log-probabilities quantised relative to each
position's largest, about a third of the packed layout's bytes at the same fidelity.

A signal row (hf_distill.data.teacher_signal) holds, for each counted position in order, the teacher's k most likely
ids at temperature T sorted by decreasing probability, `l_0 >= l_1 >= ... >= l_{k-1}` their log-probabilities, and
the log of the mass of every other id (the tail). The compact layout stores (docs/guides/teacher_signal.md gives the
byte-level description another program reads it by):

- `teacher_signal_codes`: `List(uint8)`, one bit stream per row, most significant bit first: for each position, its
  k ids in `id_bits = ceil(log2(vocab_size))` bits each, then the k - 1 gaps `q_j = min(round((l_0 - l_j) / step),
  2**value_bits - 1)` (j = 1..k-1) in `value_bits` bits each; positions back to back, the row's last byte padded
  with zero bits.
- `teacher_signal_tail`: `List(float16)`: the log tail mass per position (-inf where the k ids hold all of it).

Reading: `l'_0 = 0`, `l'_j = -q_j * step`, then `log p_j = l'_j - logsumexp(l') + log(1 - exp(tail))`: the k + 1
outcomes sum to 1 and the tail is the stored one. Error bound, tested against float64: a gap within the range
`(2**value_bits - 1) * step` is off by at most `step / 2`, so at a position whose gaps all lie within the range each
read log-probability is within `step` of the exact one plus the tail's float16 rounding (the renormalisation moves
all of them by at most `step / 2`); a gap past the range is stored as the range (an id under `exp(-range)` times the
top one's probability is read as that much: the default 16-nat range puts it below 1.2e-7 of the top one's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["CompactSpec", "compact_spec", "decode_rows", "encode_rows", "layout_spec", "normalised"]


@dataclass(frozen=True)
class CompactSpec:
    """The compact layout's parameters, recorded in the signal's metadata."""

    k: int
    id_bits: int
    value_bits: int
    value_step: float

    @property
    def record_bits(self) -> int:
        """Bits per stored position."""
        return self.k * self.id_bits + (self.k - 1) * self.value_bits

    @property
    def value_range(self) -> float:
        return (2**self.value_bits - 1) * self.value_step


def layout_spec(layout: str | None, k: int, vocab_size: int, value_bits: int | None,
                value_step: float | None) -> CompactSpec | None:
    """The compact spec for `layout="compact"` (value_bits None: 8), else None after refusing `value_bits` or
    `value_step` given for format 2, which has no quantised values: a setting that would do nothing is refused."""
    if layout not in (None, "compact"):
        raise ValueError(f"layout={layout!r}: use None (format 2, packed ids and float16 values) or 'compact'.")
    if layout == "compact":
        return compact_spec(k, vocab_size, 8 if value_bits is None else value_bits, value_step)
    given = [f"{name}={value!r}" for name, value in (("value_bits", value_bits), ("value_step", value_step))
             if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} set the compact layout's quantisation, which format 2 does not have: "
                         "add layout='compact' (CLI: --layout compact), or remove them.")
    return None


def compact_spec(k: int, vocab_size: int, value_bits: int, value_step: float | None) -> CompactSpec:
    """The spec for `k` ids of a `vocab_size` vocabulary; `value_step` None: a range of 16 nats (an id 9e6 times
    less likely than the top one is stored as that)."""
    if isinstance(value_bits, bool) or not isinstance(value_bits, int) or not 1 <= value_bits <= 16:
        raise ValueError(f"value_bits must be an integer in 1..16, got {value_bits!r}.")
    if value_step is None:
        value_step = 16.0 / (2**value_bits - 1)
    if not (isinstance(value_step, int | float) and 0 < float(value_step) < math.inf):
        raise ValueError(f"value_step must be a finite number of nats > 0, got {value_step!r}.")
    return CompactSpec(k, max(1, math.ceil(math.log2(vocab_size))), value_bits, float(value_step))


def _bits(values: np.ndarray, width: int) -> np.ndarray:
    """(..., m) non-negative integers -> (..., m * width) bits, most significant first."""
    shifts = np.arange(width - 1, -1, -1, dtype=np.int64)
    bits = ((values[..., None].astype(np.int64) >> shifts) & 1).astype(np.uint8)
    return bits.reshape(*values.shape[:-1], values.shape[-1] * width)


def _ints(bits: np.ndarray, width: int) -> np.ndarray:
    """(..., m * width) bits -> (..., m) integers."""
    weights = 1 << np.arange(width - 1, -1, -1, dtype=np.int64)
    return bits.reshape(*bits.shape[:-1], bits.shape[-1] // width, width).astype(np.int64) @ weights


def encode_rows(log_probs: torch.Tensor, ids: torch.Tensor, per_row: list[int], spec: CompactSpec) -> list[np.ndarray]:
    """Positions' top-k (log-probabilities sorted decreasing, as `topk` gives them, and ids; `(n, k)`, rows' positions
    back to back, `per_row` of them each) -> each row's bit stream (uint8)."""
    lp = log_probs.double().numpy() if log_probs.numel() else np.zeros((0, spec.k))
    gaps = lp[:, :1] - lp[:, 1:]
    q = np.minimum(np.rint(np.maximum(gaps, 0.0) / spec.value_step), 2**spec.value_bits - 1)
    idx = ids.numpy().astype(np.int64) if ids.numel() else np.zeros((0, spec.k), np.int64)
    if idx.size and int(idx.max()) >= 2**spec.id_bits:
        raise ValueError(f"The compact layout holds ids below 2**{spec.id_bits}, got {int(idx.max())}.")
    bits = np.concatenate([_bits(idx, spec.id_bits), _bits(q.astype(np.int64), spec.value_bits)], axis=1)
    out, start = [], 0
    for n in per_row:
        out.append(np.packbits(bits[start : start + n].reshape(-1)))
        start += n
    return out


def decode_rows(codes: list[np.ndarray], per_row: list[int], spec: CompactSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' bit streams (`codes[i]` may carry padding bytes past its `per_row[i]` positions) -> the positions'
    `(relative log-probabilities (n, k): 0 for the top id, -q * step for the rest, ids (n, k))`, rows back to back."""
    r = spec.record_bits
    for i, (c, n) in enumerate(zip(codes, per_row, strict=True)):
        if len(c) < (n * r + 7) // 8:
            raise ValueError(f"Row {i} of this batch reads a damaged teacher signal ({len(c)} bytes of bit stream for "
                             f"{n} positions of {r} bits): its files changed after they were written (a broken copy "
                             "or download): download the signal again, or run the command that made it again into a "
                             "new folder.")
    parts = [np.unpackbits(np.asarray(c, dtype=np.uint8)[: (n * r + 7) // 8])[: n * r].reshape(n, r)
             for c, n in zip(codes, per_row, strict=True) if n]
    bits = np.concatenate(parts) if parts else np.zeros((0, r), np.uint8)
    split = spec.k * spec.id_bits
    ids = _ints(bits[:, :split], spec.id_bits)
    q = _ints(bits[:, split:], spec.value_bits)
    rel = np.concatenate([np.zeros((len(bits), 1)), -q * spec.value_step], axis=1)
    return torch.from_numpy(rel).float(), torch.from_numpy(ids)


def normalised(relative: torch.Tensor, log_tail: torch.Tensor) -> torch.Tensor:
    """Relative log-probabilities (n, k) and the log tail mass (n,) -> the k log-probabilities whose mass with the
    tail's is 1: `relative - logsumexp(relative) + log(1 - exp(tail))` (as log(-expm1(tail)): exact near tail = 0)."""
    kept = torch.log(-torch.expm1(log_tail.float().clamp(max=0.0)))
    return relative - relative.logsumexp(-1, keepdim=True) + kept[:, None]
