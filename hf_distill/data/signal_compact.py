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

Adaptive k (format 4, `epsilon` set): each position keeps its `n` most likely ids, the fewest whose probabilities sum
to at least `1 - epsilon`, at most k (at least 1), and its tail is the exact mass of every other id. A row's bit
stream is then its positions' `n - 1` in `count_bits = ceil(log2(k))` bits each, then every position's n ids back to
back, then every position's n - 1 gaps back to back (the same widths as above), the last byte padded with zero bits.
Read back, a position with n < k holds padding after its n entries: id -1, log-probability -inf
(:mod:`hf_distill.losses.teacher_forms`), which the losses read as an outcome of no mass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["DAMAGED", "CompactSpec", "adaptive_counts", "compact_spec", "decode_rows", "encode_rows", "layout_spec",
           "normalised"]


DAMAGED = ("its files changed after they were written (a broken copy or download): download the signal again, or "
           "run the command that made it again into a new folder")
"""The fix named when a signal's stored bytes do not decode to a top-k distribution (every layout)."""


def _short_stream(row: int, length: int, n: int, bits: int) -> None:
    """Refuse a row's bit stream of `length` bytes that cannot hold its `n` positions' `bits` bits."""
    if length < (bits + 7) // 8:
        raise ValueError(f"Row {row} of this batch reads a damaged teacher signal ({length} bytes of bit stream for "
                         f"{n} positions of {bits} bits): {DAMAGED}.")


@dataclass(frozen=True)
class CompactSpec:
    """The compact layout's parameters, recorded in the signal's metadata."""

    k: int
    id_bits: int
    value_bits: int
    value_step: float
    count_bits: int = 0  # adaptive k: bits of each position's entry count (0: every position holds k)

    @property
    def record_bits(self) -> int:
        """Bits per stored position (fixed k)."""
        return self.k * self.id_bits + (self.k - 1) * self.value_bits

    @property
    def row(self) -> list[float]:
        """The spec as the `teacher_signal_spec` column stores it on every row (a fifth entry for adaptive k)."""
        return [self.k, self.id_bits, self.value_bits, self.value_step] + ([self.count_bits] if self.count_bits else [])

    @property
    def value_range(self) -> float:
        return (2**self.value_bits - 1) * self.value_step


def layout_spec(layout: str | None, k: int, vocab_size: int, value_bits: int | None,
                value_step: float | None, epsilon: float | None = None) -> CompactSpec | None:
    """The compact spec for `layout="compact"` (value_bits None: 8), else None after refusing `value_bits`,
    `value_step` or `epsilon` given for format 2, which has no quantised values nor adaptive k: a setting that would
    do nothing is refused."""
    if layout not in (None, "compact"):
        raise ValueError(f"layout={layout!r}: use None (format 2, packed ids and float16 values) or 'compact'.")
    if layout == "compact":
        return compact_spec(k, vocab_size, 8 if value_bits is None else value_bits, value_step, epsilon)
    if epsilon is not None:
        raise ValueError(f"epsilon={epsilon!r} (adaptive k) is a setting of the compact layout: add layout='compact'.")
    given = [f"{name}={value!r}" for name, value in (("value_bits", value_bits), ("value_step", value_step))
             if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} set the compact layout's quantisation, which format 2 does not have: "
                         "add layout='compact' (CLI: --layout compact), or remove them.")
    return None


def compact_spec(k: int, vocab_size: int, value_bits: int, value_step: float | None,
                 epsilon: float | None = None) -> CompactSpec:
    """The spec for `k` ids of a `vocab_size` vocabulary; `value_step` None: a range of 16 nats (an id 9e6 times
    less likely than the top one is stored as that); `epsilon` set: adaptive k (each position's count stored)."""
    if epsilon is not None and not (isinstance(epsilon, int | float) and not isinstance(epsilon, bool)
                                    and 0.0 <= float(epsilon) < 1.0):
        raise ValueError(f"epsilon must be a number in [0, 1) (the tail mass a position may leave out), got "
                         f"{epsilon!r}.")
    if isinstance(value_bits, bool) or not isinstance(value_bits, int) or not 1 <= value_bits <= 16:
        raise ValueError(f"value_bits must be an integer in 1..16, got {value_bits!r}.")
    if value_step is None:
        value_step = 16.0 / (2**value_bits - 1)
    if not (isinstance(value_step, int | float) and 0 < float(value_step) < math.inf):
        raise ValueError(f"value_step must be a finite number of nats > 0, got {value_step!r}.")
    count_bits = max(1, math.ceil(math.log2(k))) if epsilon is not None else 0
    return CompactSpec(k, max(1, math.ceil(math.log2(vocab_size))), value_bits, float(value_step), count_bits)


def adaptive_counts(log_probs: torch.Tensor, log_tail: torch.Tensor, epsilon: float) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """Positions' top-k (log-probabilities sorted decreasing `(n, k)`, log tail mass `(n,)`) -> each position's
    count, the fewest entries whose probabilities sum to at least `1 - epsilon` (1..k), and its tail: the log mass
    of every id past them, `logsumexp(tail, l_count, ..., l_{k-1})` in float64 (bit for bit the given tail where
    the count is k)."""
    k = log_probs.shape[-1]
    lp = log_probs.double()
    counts = ((lp.exp().cumsum(-1) < 1.0 - epsilon).sum(-1) + 1).clamp(max=k)
    rest = torch.cat([lp, log_tail.double()[:, None]], -1).flip(-1).logcumsumexp(-1).flip(-1)  # logsumexp of j..k
    tails = rest.gather(-1, counts[:, None]).squeeze(-1)
    return counts, torch.where(counts == k, log_tail.float(), tails.float())


def _bits(values: np.ndarray, width: int) -> np.ndarray:
    """(..., m) non-negative integers -> (..., m * width) bits, most significant first."""
    shifts = np.arange(width - 1, -1, -1, dtype=np.int64)
    bits = ((values[..., None].astype(np.int64) >> shifts) & 1).astype(np.uint8)
    return bits.reshape(*values.shape[:-1], values.shape[-1] * width)


def _ints(bits: np.ndarray, width: int) -> np.ndarray:
    """(..., m * width) bits -> (..., m) integers."""
    weights = 1 << np.arange(width - 1, -1, -1, dtype=np.int64)
    return bits.reshape(*bits.shape[:-1], bits.shape[-1] // width, width).astype(np.int64) @ weights


def encode_rows(log_probs: torch.Tensor, ids: torch.Tensor, per_row: list[int], spec: CompactSpec,
                counts: torch.Tensor | None = None) -> list[np.ndarray]:
    """Positions' top-k (log-probabilities sorted decreasing, as `topk` gives them, and ids; `(n, k)`, rows' positions
    back to back, `per_row` of them each) -> each row's bit stream (uint8); adaptive k: each position keeps its first
    `counts` entries (:func:`adaptive_counts`)."""
    lp = log_probs.double().numpy() if log_probs.numel() else np.zeros((0, spec.k))
    gaps = lp[:, :1] - lp[:, 1:]
    q = np.minimum(np.rint(np.maximum(gaps, 0.0) / spec.value_step), 2**spec.value_bits - 1)
    idx = ids.numpy().astype(np.int64) if ids.numel() else np.zeros((0, spec.k), np.int64)
    if idx.size and int(idx.max()) >= 2**spec.id_bits:
        raise ValueError(f"The compact layout holds ids below 2**{spec.id_bits}, got {int(idx.max())}.")
    if spec.count_bits:
        return _encode_adaptive(idx, q.astype(np.int64), per_row, spec, counts.numpy().astype(np.int64))
    bits = np.concatenate([_bits(idx, spec.id_bits), _bits(q.astype(np.int64), spec.value_bits)], axis=1)
    out, start = [], 0
    for n in per_row:
        out.append(np.packbits(bits[start : start + n].reshape(-1)))
        start += n
    return out


def _encode_adaptive(idx: np.ndarray, q: np.ndarray, per_row: list[int], spec: CompactSpec,
                     counts: np.ndarray) -> list[np.ndarray]:
    """The adaptive layout: per row, its positions' counts, then their ids, then their gaps (module docstring)."""
    k = spec.k
    keep = np.arange(k) < counts[:, None]
    out, start = [], 0
    for n in per_row:
        rows = slice(start, start + n)
        parts = [_bits(counts[rows][None] - 1, spec.count_bits).reshape(-1),
                 _bits(idx[rows][keep[rows]][None], spec.id_bits).reshape(-1),
                 _bits(q[rows][keep[rows][:, 1:]][None], spec.value_bits).reshape(-1)]
        out.append(np.packbits(np.concatenate(parts)))
        start += n
    return out


def _decode_adaptive(codes: list[np.ndarray], per_row: list[int], spec: CompactSpec) -> tuple[np.ndarray,
                                                                                               np.ndarray]:
    """The adaptive layout's rows -> `(q (n, k - 1) with -1 past each count, ids (n, k) with -1 past each count)`."""
    k, qs, ids = spec.k, [], []
    for i, (c, n) in enumerate(zip(codes, per_row, strict=True)):
        if not n:
            continue
        _short_stream(i, len(c), n, n * spec.count_bits)
        bits = np.unpackbits(np.asarray(c, dtype=np.uint8))
        counts = _ints(bits[: n * spec.count_bits][None], spec.count_bits)[0] + 1
        total = int(counts.sum())
        _short_stream(i, len(c), n, n * spec.count_bits + total * spec.id_bits + (total - n) * spec.value_bits)
        at = n * spec.count_bits
        flat_ids = _ints(bits[at : at + total * spec.id_bits][None], spec.id_bits)[0]
        at += total * spec.id_bits
        flat_q = _ints(bits[at : at + (total - n) * spec.value_bits][None], spec.value_bits)[0]
        keep = np.arange(k) < counts[:, None]
        row_ids, row_q = np.full((n, k), -1, np.int64), np.full((n, k - 1), -1, np.int64)
        row_ids[keep] = flat_ids
        row_q[keep[:, 1:]] = flat_q
        ids.append(row_ids)
        qs.append(row_q)
    return (np.concatenate(qs) if qs else np.zeros((0, k - 1), np.int64),
            np.concatenate(ids) if ids else np.zeros((0, k), np.int64))


def decode_rows(codes: list[np.ndarray], per_row: list[int], spec: CompactSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' bit streams (`codes[i]` may carry padding bytes past its `per_row[i]` positions) -> the positions'
    `(relative log-probabilities (n, k): 0 for the top id, -q * step for the rest, ids (n, k))`, rows back to back;
    adaptive k: -inf and id -1 past each position's count."""
    if spec.count_bits:
        q, ids = _decode_adaptive(codes, per_row, spec)
        rel = np.concatenate([np.zeros((len(q), 1)), np.where(q >= 0, -q * spec.value_step, -np.inf)], axis=1)
        return torch.from_numpy(rel).float(), torch.from_numpy(ids)
    r = spec.record_bits
    for i, (c, n) in enumerate(zip(codes, per_row, strict=True)):
        _short_stream(i, len(c), n, n * r)
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
