"""Decoding DistillKit's compressed teacher log-probabilities (its `DistributionQuantizationConfig` format), for
hf_distill.data.signal_interop.import_distillkit.

Schema followed (DistillKit V2, `distillkit/compression/{config,monotonic_logprobs,bitpack}.py` and
`sample_logits_vllm.py`, as documented there): each position of a row is two byte strings. `bytepacked_indices`:
the k ids sorted by decreasing log-probability, `ceil(log2(d))` bits each, most significant bit first, zero-padded
to a whole byte. `compressed_logprobs`: the k log-probabilities (after delta encoding when `delta_encoding`: the
first value, then each one minus the one before) as, back to back: `exact_k` values in `exact_dtype`; when
`polynomial_terms` is set, one coefficient per term in `term_dtype`, the fit of the remaining `k - exact_k` values
at t = 0, 1, ... (or linspace(0, 1) with `normalize_t`; a term is t**i, or sqrt(t) / exp(t)); then per residual bin
a scale in its `scale_dtype` and `num_elements` integers of `element_bits` bits (MSB first, padded to a byte),
dequantised as `(q - 2**(b-1)) * scale` (b = 1: `(2q - 1) * scale`); residuals past the bins are 0. Values are
`fit + residual`, then the running sum undoes the delta encoding. Floats are little-endian.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DistillKitConfig", "decode_position"]

_DTYPES = {"float16": np.float16, "bfloat16": "bfloat16", "float32": np.float32, "float64": np.float64}


@dataclass(frozen=True)
class DistillKitConfig:
    """The fields of DistillKit's DistributionQuantizationConfig the bytes depend on."""

    d: int
    k: int
    exact_k: int
    exact_dtype: str
    polynomial_terms: tuple
    term_dtype: str
    residual_bins: tuple  # (scale_dtype, element_bits, num_elements)
    delta_encoding: bool
    normalize_t: bool

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> DistillKitConfig:
        missing = [f for f in ("d", "k", "exact_k") if f not in c]
        if missing:
            raise ValueError(f"The DistillKit compression config lacks {missing}: it needs d (the vocabulary), k and "
                             "exact_k (DistributionQuantizationConfig).")
        for name in (c.get("exact_dtype", "float32"), c.get("term_dtype", "float32"),
                     *(b.get("scale_dtype") for b in c.get("residual_bins") or [])):
            if name not in _DTYPES:
                raise ValueError(f"DistillKit dtype {name!r} is not one of {sorted(_DTYPES)}.")
        bins = tuple((b["scale_dtype"], int(b["element_bits"]), int(b["num_elements"]))
                     for b in c.get("residual_bins") or [])
        return cls(int(c["d"]), int(c["k"]), int(c["exact_k"]), c.get("exact_dtype", "float32"),
                   tuple(c.get("polynomial_terms") or ()), c.get("term_dtype", "float32"), bins,
                   bool(c.get("delta_encoding", True)), bool(c.get("normalize_t", False)))

    @property
    def id_bits(self) -> int:
        return math.ceil(math.log2(self.d))


def _floats(raw: np.ndarray, dtype: str, count: int) -> np.ndarray:
    if dtype == "bfloat16":  # the high 16 bits of a float32
        halves = raw[: 2 * count].view("<u2").astype(np.uint32) << 16
        return halves.view("<f4").astype(np.float64)
    size = np.dtype(_DTYPES[dtype]).itemsize
    return raw[: size * count].view(np.dtype(_DTYPES[dtype]).newbyteorder("<")).astype(np.float64)


def _unpack(raw: np.ndarray, bits: int, count: int) -> np.ndarray:
    stream = np.unpackbits(raw)[: bits * count].reshape(count, bits).astype(np.int64)
    return stream @ (1 << np.arange(bits - 1, -1, -1, dtype=np.int64))


def decode_position(logprob_bytes: Any, index_bytes: Any, cfg: DistillKitConfig) -> tuple[np.ndarray, np.ndarray]:
    """One position's `(ids (k,), log-probabilities (k,) float64)` from its two byte strings."""
    raw = np.asarray(logprob_bytes, dtype=np.uint8)
    ids = _unpack(np.asarray(index_bytes, dtype=np.uint8), cfg.id_bits, cfg.k)
    at = 0
    size = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
    exact = _floats(raw[at:], cfg.exact_dtype, cfg.exact_k)
    at += size[cfg.exact_dtype] * cfg.exact_k
    rest = cfg.k - cfg.exact_k
    fit = np.zeros(rest)
    if cfg.polynomial_terms:
        coeffs = _floats(raw[at:], cfg.term_dtype, len(cfg.polynomial_terms))
        at += size[cfg.term_dtype] * len(cfg.polynomial_terms)
        t = np.linspace(0.0, 1.0, rest) if cfg.normalize_t else np.arange(rest, dtype=np.float64)
        columns = [t**term if isinstance(term, int) else getattr(np, str(term))(t) for term in cfg.polynomial_terms]
        fit = np.stack(columns, -1) @ coeffs if rest else fit
    residual = np.zeros(rest)
    start = 0
    for scale_dtype, bits, count in cfg.residual_bins:
        scale = _floats(raw[at:], scale_dtype, 1)[0]
        at += size[scale_dtype]
        q = _unpack(raw[at:], bits, count)
        at += (bits * count + 7) // 8
        residual[start : start + count] = ((2 * q - 1) if bits == 1 else (q - 2 ** (bits - 1))) * scale
        start += count
    values = np.concatenate([exact, fit + residual])
    return ids, np.cumsum(values) if cfg.delta_encoding else values
