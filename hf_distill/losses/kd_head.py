"""The direct route of the causal-LM loss head (:mod:`hf_distill.losses.chunked`): :class:`_KDHead`, the autograd
function that reads each LM head's weight, the row math it runs on, and the token-chunk and vocabulary-block walks it
shares with the sparse head (:mod:`hf_distill.losses.sparse_head`), so each head states only its teacher's part.

- the forward's row statistics (:func:`_row_stats`) and the backward's closed-form logit gradient per vocabulary
  block (:func:`_grad_block`, :func:`row_gradient`): on CUDA the Triton kernels of
  :mod:`hf_distill.losses.triton_head` (`HF_DISTILL_TRITON=0`: these functions compiled by `torch.compile`;
  `HF_DISTILL_COMPILE=0`: plain PyTorch), on the CPU these functions walked in cache-sized slices of rows.
- the walks both heads' autograd functions run (:func:`_forward_chunks`, :func:`_backward_walk`): the student's
  logits a token chunk (forward) or a vocabulary block (backward) at a time, from the float32-output GEMMs of
  :mod:`hf_distill.losses.head_common`, the CE's part and the gradients' accumulation; the head adds its KD's part.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..compat import recompile_limit
from . import divergences as losses
from .fused_grads import Fused, by_columns, writes_into
from .head_common import (  # noqa: F401 - re-exported: `kd_head.mm_f32`, ... (tests, benchmarks)
    DIVERGENCES,
    KDSpec,
    LogitsHead,
    _compute_dtype,
    _LinearF32,
    addmm_f32,
    float32_logits,
    mm_f32,
)
from .registry import get_divergence

_NO_SECOND_DERIVATIVE = (
    "The causal-LM loss head (hf_distill.losses.chunked) has no second derivative: its gradient is formed in closed "
    "form. For create_graph=True compute the loss from whole logits (kd_chunk_size unset where chunking is "
    "impossible, or hf_distill.losses on the model's logits).")

# Logit elements per block of the backward's vocabulary walk, at least: the forward's chunk holds
# `chunk_size * V` of them, and the backward's blocks are sized to hold as many (N rows x a slice of V).
_MIN_BLOCK_COLUMNS = 128


# ---------------------------------------------------------------------------------------------- row math


def row_gradient(kind: str, la: torch.Tensor, lb: torch.Tensor, stat: torch.Tensor, beta: float = 0.5,
                 alpha: float = 0.1) -> torch.Tensor:
    """d divergence / d (student logits / T) for a block of columns, from the row's statistic (`stat`, `(n, 1)`,
    from :func:`hf_distill.losses.divergence_rows`): the closed form of `kind`'s registry entry
    (:mod:`hf_distill.losses.registry`; the built-in ones: :mod:`hf_distill.losses.kinds`).

    With `g_v = dL/dQ_v` the chain rule through the softmax gives `Q_v (g_v - sum_u Q_u g_u)`; the sum is the row
    statistic, which needs every column and so comes from the forward pass."""
    entry = get_divergence(kind, needs="rows")
    return entry.grad(la, lb, stat, entry.weight(beta, alpha))


def shift_gradient(kind: str, la: torch.Tensor, shift: torch.Tensor, stat: torch.Tensor, beta: float = 0.5,
                   alpha: float = 0.1) -> torch.Tensor:
    """:func:`row_gradient` against a teacher given as `log P = log Q + shift` (the sparse head): the entry's
    ``shift_grad`` where it has one (a gradient that jumps where P = Q reads the jump from the exact shift)."""
    entry = get_divergence(kind, needs="rows")
    if entry.shift_grad is not None:
        return entry.shift_grad(la, shift, stat, entry.weight(beta, alpha))
    return entry.grad(la, la + shift, stat, entry.weight(beta, alpha))


def _head_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, head: LogitsHead,
                 dtype: torch.dtype, cols: slice = slice(None)) -> torch.Tensor:
    """float32 logits of rows `h` (already in `dtype`) for the vocabulary columns `cols`, post-processed."""
    z = mm_f32(h, weight[cols].to(dtype).t())
    if bias is not None:
        z += bias[cols].float()
    return head.post(z)


def _row_stats(zs: torch.Tensor, zt: torch.Tensor | None, targets: torch.Tensor | None, kind: str | None,
               temperature: float, beta: float, alpha: float, vocab: int):
    """Per row of a token chunk (every column): CE normaliser and CE, the two log-normalisers at T, the divergence
    (no factor) and its gradient statistic. Elementwise and row reductions only: fused by `torch.compile` on GPUs."""
    lse1 = ce = lse_a = lse_b = value = stat = None
    if kind is not None:
        a = zs[:, :vocab] / temperature if temperature != 1.0 else zs[:, :vocab]
        b = zt / temperature if temperature != 1.0 else zt
        lse_a, lse_b = torch.logsumexp(a, -1), torch.logsumexp(b, -1)
        value, stat = losses.divergence_rows(kind, a - lse_a[:, None], b - lse_b[:, None], beta, alpha)
    if targets is not None:
        # at T = 1 over the whole vocabulary the KD's student normaliser is the CE's: one reduction fewer
        same = kind is not None and temperature == 1.0 and vocab == zs.shape[1]
        lse1 = lse_a if same else torch.logsumexp(zs, -1)
        ce = lse1 - zs.gather(-1, targets[:, None]).squeeze(-1)
    return lse1, ce, lse_a, lse_b, value, stat


def _grad_block(zs: torch.Tensor, zt: torch.Tensor | None, start: int, targets: torch.Tensor | None,
                lse1: torch.Tensor | None, w_ce: torch.Tensor | None, lse_a: torch.Tensor | None,
                lse_b: torch.Tensor | None, stat: torch.Tensor | None, w_kd: torch.Tensor | None, kind: str | None,
                temperature: float, beta: float, alpha: float, scale: float, cap: float | None,
                dtype: torch.dtype) -> torch.Tensor:
    """d loss / d raw logits of a vocabulary block (columns `start...` of every row), in the GEMM dtype: the CE's
    `softmax - onehot` and the divergence's closed form (:func:`row_gradient`), each times its row weight, through
    the family's post-processing. Elementwise only: one fused kernel under `torch.compile` on GPUs."""
    g = _ce_grad(zs, start, targets, lse1, w_ce)
    if zt is not None:
        la = (zs / temperature if temperature != 1.0 else zs) - lse_a[:, None]
        lb = (zt / temperature if temperature != 1.0 else zt) - lse_b[:, None]
        g = g + row_gradient(kind, la, lb, stat[:, None], beta, alpha) * w_kd[:, None]
    return _post_grad(g, zs, scale, cap, dtype)


def _ce_grad(zs: torch.Tensor, start: int, targets: torch.Tensor | None, lse1: torch.Tensor | None,
             w_ce: torch.Tensor | None) -> torch.Tensor:
    """A gradient block's start (both heads): zeros, plus the CE's `softmax - onehot` times its row weight."""
    g = torch.zeros_like(zs)
    if targets is not None:
        cols = torch.arange(start, start + zs.shape[1], device=zs.device)
        onehot = (targets[:, None] == cols[None, :]).to(zs.dtype)
        g = g + (torch.exp(zs - lse1[:, None]) - onehot) * w_ce[:, None]
    return g


def _post_grad(g: torch.Tensor, zs: torch.Tensor, scale: float, cap: float | None, dtype: torch.dtype) -> torch.Tensor:
    """A gradient block's end (both heads): through the family's post-processing (soft cap, scale), in `dtype`."""
    if cap is not None:
        g = g * (1 - (zs / cap) ** 2)
    if scale != 1.0:
        g = g * scale
    return g.to(dtype)


@functools.cache
def _fused(fn):
    """`fn` compiled by inductor (one or two kernels instead of ~25 passes over the logits) where it runs on a
    CUDA GPU and `HF_DISTILL_COMPILE` is not 0; the same function, same math, elsewhere (tested equal on a GPU,
    `benchmarks/kd_precision.py`)."""
    import os

    if os.environ.get("HF_DISTILL_COMPILE", "1") == "0":
        return fn
    compiled = torch.compile(fn, dynamic=True, fullgraph=True)

    @functools.wraps(fn)
    def run(*args):
        # A graph per divergence, temperature, CE or not: dynamo's default limit (8 per function) is a hard error
        # under fullgraph=True, hit by a process that trains several configurations (a sweep, the CUDA tests).
        with recompile_limit(_RECOMPILE_LIMIT):
            return compiled(*args)

    return run


_RECOMPILE_LIMIT = 256


def _elementwise(fn, device: torch.device):
    return _fused(fn) if device.type == "cuda" else _by_rows(fn)


_CPU_ELEMENTS = 1 << 20  # logits per slice of rows in the CPU's elementwise work: its temporaries stay in cache


def _by_rows(fn):
    """`fn` (row statistics or a gradient block) over slices of ~2^20 logits' rows: the same results, but its dozen
    temporaries are slices' size (4 MiB), not the chunk's, and stay in cache (no `torch.compile` on CPU)."""

    @functools.wraps(fn)
    def run(zs, zt, *args):
        step = max(1, _CPU_ELEMENTS // max(zs.shape[1], 1))
        if zs.shape[0] <= step:
            return fn(zs, zt, *args)
        out = None
        parts = []
        for r in (slice(i, i + step) for i in range(0, zs.shape[0], step)):
            part = fn(zs[r], None if zt is None else zt[r], *(_rows_of(x, r) for x in args))
            if isinstance(part, torch.Tensor):  # a gradient block: written into one preallocated block
                out = part.new_empty(zs.shape[0], part.shape[1]) if out is None else out
                out[r] = part
            else:
                parts.append(part)
        if out is not None:
            return out
        return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts, strict=True))

    return run


def _rows_of(x, rows: slice):
    """The per-row arguments (1-D tensors: targets, row statistics, row weights) sliced; everything else as is."""
    return x[rows] if isinstance(x, torch.Tensor) and x.dim() == 1 else x


def _row_stats_fn(device: torch.device):
    """The forward's row statistics: a Triton kernel on CUDA (:mod:`hf_distill.losses.triton_head`, two reads of each
    logit), else :func:`_row_stats` (compiled on CUDA). `HF_DISTILL_TRITON=0`: no Triton kernel;
    `HF_DISTILL_COMPILE=0`: plain PyTorch (both for comparisons: same math)."""
    import os

    from . import triton_head

    on = os.environ.get("HF_DISTILL_COMPILE", "1") != "0" and os.environ.get("HF_DISTILL_TRITON", "1") != "0"
    if on and triton_head.available(device):
        return triton_head.row_stats
    return _elementwise(_row_stats, device)


def _grad_block_fn(device: torch.device):
    """The backward's gradient blocks: a Triton kernel on CUDA (each logit read once), else :func:`_grad_block`
    (compiled on CUDA); the same switches as :func:`_row_stats_fn`."""
    import os

    from . import triton_head

    on = os.environ.get("HF_DISTILL_COMPILE", "1") != "0" and os.environ.get("HF_DISTILL_TRITON", "1") != "0"
    if on and triton_head.available(device):
        return triton_head.grad_block
    return writes_into(_elementwise(_grad_block, device))


def _blocks(v_s: int, vocab: int, cols: int):
    """Vocabulary blocks of at most `cols` columns that never straddle `vocab` (the KD's last column)."""
    for lo, hi in ((0, min(vocab, v_s)), (min(vocab, v_s), v_s)):
        for start in range(lo, hi, cols):
            yield slice(start, min(start + cols, hi))


def _backward_start(ctx, grad, h_s, w_s, b_s, spec, targets, kd_rows, ce_rows, chunk: int, no_second: str):
    """The common start of the loss heads' backward passes (this one and :mod:`hf_distill.losses.sparse_head`):
    which gradients are wanted, the per-row weights of the two sums' gradients (the upstream gradient, e.g. a loss
    scale, included), the float32 hidden-state accumulator, the weight and bias gradients, and the width of a
    vocabulary block (as many logits as a forward chunk). None when no gradient is wanted."""
    if torch.is_grad_enabled():
        raise RuntimeError(no_second)
    want = tuple(ctx.needs_input_grad[:3])
    if grad is None or not any(want):
        return None
    n, v_s = h_s.shape[0], w_s.shape[0]
    w_kd = (kd_rows.float() * grad[0].float() * (spec.factor / spec.temperature)) if spec is not None else None
    w_ce = (ce_rows.float() * grad[1].float()) if targets is not None else None
    grads = (torch.zeros(h_s.shape, dtype=torch.float32, device=h_s.device) if want[0] else None,
             torch.empty_like(w_s) if want[1] else None, torch.empty_like(b_s) if want[2] else None)
    cols = max(_MIN_BLOCK_COLUMNS, (chunk * v_s) // max(n, 1) // _MIN_BLOCK_COLUMNS * _MIN_BLOCK_COLUMNS)
    return want, w_kd, w_ce, grads, cols


def _add_block(g: torch.Tensor, block: slice, hs: torch.Tensor, wb: torch.Tensor, b_s, grads, dtype_s) -> None:
    """A vocabulary block's logit gradient `g` into the bias, weight and hidden-state gradients `grads` (`wb`: the
    block's weight rows, already in the GEMMs' dtype)."""
    grad_h, grad_w, grad_b = grads
    if grad_b is not None:
        grad_b[block] = g.sum(0).to(b_s.dtype)
        g = g.to(dtype_s)
    if grad_w is not None:  # float32 out, then one rounding (bf16 GEMMs may reduce split-K partials in bf16)
        grad_w[block].copy_(mm_f32(g.t(), hs))
    if grad_h is not None:
        addmm_f32(grad_h, g, wb)  # in place


def _spec_args(spec: KDSpec | None) -> tuple[str | None, float, float, float]:
    """`(kind, temperature, beta, alpha)` of a KD objective; without one, no kind and neutral values."""
    return (spec.kind, spec.temperature, spec.beta, spec.alpha) if spec is not None else (None, 1.0, 0.5, 0.1)


def _forward_chunks(h_s: torch.Tensor, w_s: torch.Tensor, b_s, s_head: LogitsHead, dtype_s: torch.dtype, chunk: int,
                    targets, ce_rows, lse1: torch.Tensor, sums: torch.Tensor,
                    chunk_stats: Callable[[slice, torch.Tensor], tuple], fused: Fused | None = None,
                    chunk_grad: Callable[[slice, torch.Tensor], torch.Tensor] | None = None) -> None:
    """The forward's walk of both heads: token chunks of `chunk` rows (every column of a row), each chunk's student
    logits in float32, then `chunk_stats(rows, zs)`, the head's row statistics: it keeps its KD's own and returns the
    CE's normaliser and CE per row, kept here (`lse1[rows]`, their sum over the CE's rows into `sums[1]`). Fused mode
    (:mod:`hf_distill.losses.fused_grads`): then `chunk_grad(rows, zs)`, the chunk's logit gradient, into `fused`."""
    with torch.autocast(h_s.device.type, enabled=False), torch.no_grad():
        ws = w_s.to(dtype_s)  # float32 weights under autocast: cast once, not once per chunk
        for start in range(0, h_s.shape[0], chunk):
            rows = slice(start, start + chunk)
            hs = h_s[rows].to(dtype_s)
            zs = _head_logits(hs, ws, b_s, s_head, dtype_s)
            lse_1, ce = chunk_stats(rows, zs)
            if targets is not None:
                lse1[rows] = lse_1
                sums[1] += torch.where(ce_rows[rows], ce, 0.0).sum()
            if fused is not None:
                fused.add(chunk_grad(rows, zs), rows, hs, ws, dtype_s)
            del zs  # freed before the next chunk's GEMM: one chunk's logits alive at a time, not two


def _backward_walk(ctx, grad, h_s: torch.Tensor, w_s: torch.Tensor, b_s, s_head: LogitsHead, spec: KDSpec | None,
                   targets, kd_rows, ce_rows, vocab: int, chunk: int, dtype_s: torch.dtype, no_second: str,
                   block_grad: Callable[..., torch.Tensor]) -> tuple:
    """The backward's walk of both heads: vocabulary blocks (every row; :func:`_backward_start` sizes them), each
    block's student logits recomputed in float32, `block_grad(block, zs, w_kd, w_ce, dtype)` its logit gradient (the
    head's closed form, in `dtype`), added into the gradients (:func:`_add_block`). Returns the autograd function's
    gradients: those of its first three inputs `h_s`, `w_s`, `b_s` (None where not wanted), None for the rest."""
    rest = (None,) * (len(ctx.needs_input_grad) - 3)
    start = _backward_start(ctx, grad, h_s, w_s, b_s, spec, targets, kd_rows, ce_rows, chunk, no_second)
    if start is None:
        return None, None, None, *rest
    want, w_kd, w_ce, grads, cols = start
    with torch.autocast(h_s.device.type, enabled=False), torch.no_grad():
        hs = h_s.to(dtype_s)
        for block in _blocks(w_s.shape[0], vocab, cols):
            wb = w_s[block].to(dtype_s)  # float32 weights under autocast: each block cast once, for both its GEMMs
            zs = _head_logits(hs, wb, None if b_s is None else b_s[block], s_head, dtype_s)
            g = block_grad(block, zs, w_kd, w_ce, torch.float32 if want[2] else dtype_s)
            _add_block(g, block, hs, wb, b_s, grads, dtype_s)
            del zs, g, wb  # freed before the next block's GEMM
    grad_h, grad_w, grad_b = grads
    return grad_h.to(h_s.dtype) if want[0] else None, grad_w, grad_b, *rest


class _KDHead(torch.autograd.Function):
    """`[sum of KD over kd rows, sum of CE over ce rows]` of `N` counted rows from hidden states and LM heads.

    Forward: token chunks (every column of a row), keeping per row the student's and teacher's log-normalisers
    at T, the student's at T = 1 (CE) and the divergence's statistic. Backward: vocabulary blocks (every row),
    the block's logits recomputed, its gradient formed from those statistics (:func:`row_gradient`)."""

    @staticmethod
    def forward(ctx, h_s, w_s, b_s, h_t, w_t, b_t, t_logits, targets, kd_rows, ce_rows,
                s_head: LogitsHead, t_head: LogitsHead | None, spec: KDSpec | None, vocab: int, chunk: int,
                fused: tuple[float, float] | None = None):
        dtype_s = _compute_dtype(h_s, w_s)
        dtype_t = _compute_dtype(h_t, w_t) if h_t is not None else None
        kind, T, beta, alpha = _spec_args(spec)
        stats = h_s.new_zeros(4, h_s.shape[0], dtype=torch.float32)  # lse_s(T), lse_t(T), lse_s(1), statistic
        sums = h_s.new_zeros(2, dtype=torch.float32)
        row_stats = _row_stats_fn(h_s.device)
        # the teacher's float32 weights under autocast: cast once, not once per chunk
        wt = w_t[:vocab].to(dtype_t) if w_t is not None and spec is not None and t_logits is None else None

        kept = {}  # the chunk's teacher logits, for the fused mode's gradient (taken by it: never two chunks' alive)

        def chunk_stats(rows: slice, zs: torch.Tensor):
            zt = None
            if spec is not None:
                zt = (_head_logits(h_t[rows].to(dtype_t), wt, b_t, t_head, dtype_t, slice(0, vocab))
                      if t_logits is None else t_logits[rows, :vocab].float())
            if state is not None:
                kept["zt"] = zt
            lse1, ce, lse_a, lse_b, value, stat = row_stats(
                zs, zt, targets[rows] if targets is not None else None, kind, T, beta, alpha, vocab)
            if spec is not None:
                stats[0, rows], stats[1, rows], stats[3, rows] = lse_a, lse_b, stat
                sums[0] += torch.where(kd_rows[rows], value, 0.0).sum() * spec.factor
            return lse1, ce

        state = _fused_state(ctx, fused, h_s, w_s, b_s, spec, kd_rows, ce_rows, targets)
        grad_block = _grad_block_fn(h_s.device) if state is not None else None

        def chunk_grad(rows: slice, zs: torch.Tensor) -> torch.Tensor:
            dtype = state.dtype_out or dtype_s
            tg, w_ce = (targets[rows], state.w_ce[rows]) if targets is not None else (None, None)
            w_kd = state.w_kd[rows] if spec is not None else None
            zt = kept.pop("zt")

            def part(cols: slice, kd: bool, out: torch.Tensor | None = None) -> torch.Tensor:
                return grad_block(zs[:, cols], zt[:, cols] if kd else None, cols.start, tg, stats[2, rows],
                                  w_ce, stats[0, rows], stats[1, rows], stats[3, rows], w_kd, kind, T, beta, alpha,
                                  s_head.scale, s_head.cap, dtype, out=out)

            return by_columns(zs, vocab, spec is not None, part, dtype)

        _forward_chunks(h_s, w_s, b_s, s_head, dtype_s, chunk, targets, ce_rows, stats[2], sums, chunk_stats, state,
                        chunk_grad)
        ctx.save_for_backward(h_s, w_s, b_s, h_t, w_t, b_t, t_logits, targets, kd_rows, ce_rows, stats)
        ctx.args = (s_head, t_head, spec, vocab, chunk, dtype_s, dtype_t)
        ctx.set_materialize_grads(False)
        return sums

    @staticmethod
    def backward(ctx, grad):
        done = _fused_finish(ctx, grad, ctx.saved_tensors[:3])
        return done if done is not None else recompute_backward(ctx, grad, ctx.saved_tensors, ctx.args)


def _fused_state(ctx, fused: tuple[float, float] | None, h_s, w_s, b_s, spec: KDSpec | None, kd_rows, ce_rows,
                 targets) -> Fused | None:
    """Both heads' fused-mode state (:mod:`hf_distill.losses.fused_grads`), kept on `ctx`: None in the default mode
    or where no input wants a gradient (the entry points pass no coefficients under no_grad)."""
    ctx.fused = None
    want = tuple(ctx.needs_input_grad[:3])
    if fused is None or not any(want):
        return None
    ctx.fused = Fused(fused, h_s, w_s, b_s, want, kd_rows, ce_rows,
                      spec.factor / spec.temperature if spec is not None else None, targets is not None)
    return ctx.fused


def _fused_finish(ctx, grad, inputs: tuple) -> tuple | None:
    """The fused mode's gradients (then None for the other inputs), or None: not fused, or recompute instead."""
    if ctx.fused is None:
        return None
    if torch.is_grad_enabled():
        raise RuntimeError(_NO_SECOND_DERIVATIVE)
    rest = (None,) * (len(ctx.needs_input_grad) - 3)
    if grad is None:
        return None, None, None, *rest
    done = ctx.fused.finish(grad, inputs)
    ctx.fused = None  # a second backward (retain_graph) recomputes
    return None if done is None else (*done, *rest)


def recompute_backward(ctx, grad, saved: tuple, args: tuple) -> tuple:
    """:class:`_KDHead`'s backward from its saved tensors and arguments (also the fused head's, where the upstream
    gradient is not the one its forward formed the gradients for: :mod:`hf_distill.losses.fused_head`)."""
    h_s, w_s, b_s, h_t, w_t, b_t, t_logits, targets, kd_rows, ce_rows, stats = saved
    s_head, t_head, spec, vocab, chunk, dtype_s, dtype_t = args
    kind, T, beta, alpha = _spec_args(spec)
    grad_block = _grad_block_fn(h_s.device)
    ht = h_t.to(dtype_t) if h_t is not None else None

    def block_grad(block: slice, zs: torch.Tensor, w_kd, w_ce, dtype: torch.dtype):
        zt = None
        if spec is not None and block.start < vocab:
            zt = (_head_logits(ht, w_t, b_t, t_head, dtype_t, block)
                  if t_logits is None else t_logits[:, block].float())
        return grad_block(zs, zt, block.start, targets, stats[2], w_ce, stats[0], stats[1], stats[3], w_kd,
                          kind, T, beta, alpha, s_head.scale, s_head.cap, dtype)

    return _backward_walk(ctx, grad, h_s, w_s, b_s, s_head, spec, targets, kd_rows, ce_rows, vocab, chunk,
                          dtype_s, _NO_SECOND_DERIVATIVE, block_grad)
