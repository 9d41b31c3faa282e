"""The loss head's fused mode (`kd_head_mode="fused"`, issue #41 item 6): both heads' gradients formed in the forward.

The default mode ("recompute") keeps ~5 floats per row in the forward and recomputes both models' logits in the
backward, a vocabulary block at a time: six LM-head GEMMs (student and teacher logits twice, the weight and the
hidden-state gradients). A token chunk of the forward holds every column of its rows, so its logit gradient can be
formed right there, from the row statistics just computed, for the weights the caller will put on the two sums: four
GEMMs (student and teacher logits once, `dL/dH` of the chunk, `dL/dW += G^T H`). The weight gradient accumulates over
the token chunks in a float32 `(V, H)` buffer, rounded once at the end (as precise as the default mode).

Memory: that buffer (V x H x 4 bytes: 2 GiB at 128,256 x 4,096, 1 GiB at 128,256 x 2,048) lives from the forward to
the backward, beside the float32 `(N, H)` hidden-state gradient the default mode also has; and the default token
chunk is 4x longer (:func:`hf_distill.losses.chunked.default_chunk`), since each chunk reads and writes the whole
buffer once: 1,024 tokens at V = 128,256, whose float32 student and teacher logits take 0.5 GiB each. What a chunk
moves beyond its four GEMMs is kept to the logits: the buffer is not zero-filled (the first chunk's product writes
it), each chunk's `dL/dH` rows are written in place, a padded vocabulary's two column ranges are written into the
chunk's gradient by the kernels (:func:`by_columns`), one chunk's logits are alive at a time (freed before the next
chunk's GEMM), and the loss scale and the rounding to the weight's dtype are one pass at the end.

The forward forms the gradient of `c_kd * KD sum + c_ce * CE sum` for the coefficients it is given (the caller's
weights over each term's counted rows: the trainer's `kd_weight` and `task_weight` times each term's step-mean
share). A backward whose upstream gradient is a multiple of those coefficients (a loss scale) scales the kept
gradients; any other (the two terms weighted otherwise than announced) is not approximated: the backward recomputes
the gradient as the default mode does (exact, slower), with a warning once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.utils import logging

from .head_common import addmm_f32, mm_f32_into

logger = logging.get_logger(__name__)

MODES = ("recompute", "fused")

#: How far the upstream gradient's ratio of the two sums may be from the announced one (relative).
_RATIO_TOLERANCE = 1e-5


class Fused:
    """The fused mode's state in one autograd call: the sums' coefficients, the gradient accumulators (float32;
    None where that gradient is not wanted) and the rows' weights of the two terms' closed forms."""

    def __init__(self, coeffs: tuple[float, float], h_s: torch.Tensor, w_s: torch.Tensor, b_s, want: tuple,
                 kd_rows: torch.Tensor, ce_rows: torch.Tensor, kd_scale: float | None, has_ce: bool) -> None:
        self.coeffs, self.terms = coeffs, (kd_scale is not None, has_ce)
        dev = h_s.device
        # the weight's accumulator is not zero-filled: the first chunk writes it (a (V, H) float32 pass saved, and
        # the first chunk's read of it); `fresh` until then
        self.grads = (torch.empty(h_s.shape, dtype=torch.float32, device=dev) if want[0] else None,
                      torch.empty(w_s.shape, dtype=torch.float32, device=dev) if want[1] else None,
                      torch.zeros(b_s.shape, dtype=torch.float32, device=dev) if want[2] else None)
        self.fresh = True
        self.w_kd = kd_rows.float() * (coeffs[0] * kd_scale) if kd_scale is not None else None
        self.w_ce = ce_rows.float() * coeffs[1] if has_ce else None

    @property
    def dtype_out(self) -> torch.dtype | None:
        """The dtype a chunk's gradient is formed in: float32 where the bias's sum needs it, else the GEMMs'."""
        return torch.float32 if self.grads[2] is not None else None

    def add(self, g: torch.Tensor, rows: slice, hs: torch.Tensor, ws: torch.Tensor, dtype_s: torch.dtype) -> None:
        """A token chunk's logit gradient `g` (its rows x every column) into the three accumulators."""
        grad_h, grad_w, grad_b = self.grads
        if grad_b is not None:
            grad_b += g.sum(0)
            g = g.to(dtype_s)
        if grad_w is not None:
            (mm_f32_into if self.fresh else addmm_f32)(grad_w, g.t(), hs)
        self.fresh = False
        if grad_h is not None:
            mm_f32_into(grad_h[rows], g, ws)  # the chunk's rows of the float32 accumulator, written in place

    def finish(self, grad: torch.Tensor, like: tuple) -> tuple | None:
        """The three gradients for the upstream `grad` of the two sums, or None where it is not a multiple of the
        coefficients the forward used (the caller recomputes). Once only: the accumulators are scaled in place."""
        g = [float(v) for v in grad.detach().float().cpu()]
        present = [i for i in (0, 1) if self.terms[i]]
        lam = next((g[i] / self.coeffs[i] for i in present if self.coeffs[i] != 0), 0.0)
        for i in present:
            want = lam * self.coeffs[i]
            if abs(g[i] - want) > _RATIO_TOLERANCE * max(abs(g[i]), abs(want)):
                _warn_recompute(tuple(self.coeffs), (g[0], g[1]))
                return None
        if self.fresh and self.grads[1] is not None:  # no chunk was added (no row): nothing was written
            self.grads[1].zero_()
        out = [None if acc is None else _scaled_cast(acc, lam, x.dtype) for acc, x in zip(self.grads, like,
                                                                                         strict=True)]
        self.grads = (None, None, None)
        return tuple(out)


def _scaled_cast(acc: torch.Tensor, lam: float, dtype: torch.dtype) -> torch.Tensor:
    """`(acc * lam).to(dtype)` in one pass over the float32 accumulator (on CUDA one kernel reads it and writes the
    parameter's dtype; no in-place pass first): the same float32 product, rounded once, bit for bit."""
    if lam == 1.0:
        return acc.to(dtype)
    if dtype == acc.dtype:
        return acc.mul_(lam)
    return torch.mul(acc, lam, out=torch.empty(acc.shape, dtype=dtype, device=acc.device))


def by_columns(zs: torch.Tensor, vocab: int, kd: bool, part: Callable[..., torch.Tensor],
               dtype: torch.dtype) -> torch.Tensor:
    """A chunk's logit gradient over every column: `part(columns, with_kd)` once, or twice where the KD compares only
    the first `vocab` of the student's columns (padded vocabularies: the rest has the CE's part alone), each then
    given its column range of the gradient to write into (`part(columns, with_kd, out)`: the Triton kernels write
    there, no `(rows, V)` copy; :func:`writes_into` gives the PyTorch row math the same form)."""
    v_s = zs.shape[1]
    if not kd or vocab >= v_s:
        return part(slice(0, v_s), kd)
    g = torch.empty(zs.shape, dtype=dtype, device=zs.device)
    part(slice(0, vocab), True, g[:, :vocab])
    part(slice(vocab, v_s), False, g[:, vocab:])
    return g


def writes_into(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fn` (a gradient block's row math) with the Triton kernels' `out=`: its result copied into `out` where one is
    given (the kernels write there directly)."""

    def run(*args, out: torch.Tensor | None = None) -> torch.Tensor:
        g = fn(*args)
        return g if out is None else out.copy_(g)

    return run


_WARNED: list[bool] = []


def _warn_recompute(coeffs: tuple, got: tuple) -> None:
    """Once per process: the fused mode's forward work was not used (the numbers of the first time)."""
    if _WARNED:
        return
    _WARNED.append(True)
    logger.warning(
        "kd_head_mode='fused': the loss weighted the KD and CE sums (%s) otherwise than the forward was told (%s), so "
        "the backward recomputed the gradient as kd_head_mode='recompute' does (exact, but slower than either mode). "
        "This happens where a step's KD and CE count different shares of its tokens, or a loss is combined by hand.",
        got, coeffs)


def sum_coefficients(fused: tuple[float, float] | None, n_kd: int, n_ce: int, route: str,
                     direct_ok: bool) -> tuple[float, float] | None:
    """The entry points' `fused` (the weights the caller puts on the KD and CE means) as the coefficients of the two
    sums, or None: not asked, or no gradient to form (no_grad). Refused where the heads are called as modules."""
    if fused is None:
        return None
    if route == "module" or (route == "auto" and not direct_ok):
        raise ValueError(
            "kd_head_mode='fused' forms the gradients inside the loss head's direct route, but here the LM heads are "
            "called as modules (DeepSpeed, FSDP, or a head that is not a plain nn.Linear, e.g. a LoRA-wrapped head), "
            "whose gradients autograd forms: use kd_head_mode='recompute'.")
    if not torch.is_grad_enabled():
        return None
    return float(fused[0]) / max(n_kd, 1), float(fused[1]) / max(n_ce, 1)
