"""The sparse (top-k + tail) loss head's elementwise work as Triton kernels (CUDA only; issue #41 item 5), beside the
dense head's (:mod:`hf_distill.losses.triton_head`). :func:`hf_distill.losses.sparse_head._sparse_row_stats` and
:func:`hf_distill.losses.sparse_head._sparse_grad_block` are the references they are tested against: in Triton's
CPU interpreter where triton is installed (tests/test_triton_sparse.py) and on a GPU (`benchmarks/gpu_checks.sh`).

Forward (:func:`row_stats`): the k ids' logits (and the CE's target logit) are gathered first, then the ids' columns
of the chunk's float32 logits are set to -inf in place (restored after: k writes per row), and one program per
row walks the row once with two online logsumexps: the tail's at T over the first `vocab` columns and, where the CE
needs another normaliser, at T = 1 over every column. The student's normaliser is then the tail's plus the k ids'
(a sum of two positive parts: exact however much mass the k ids hold, as the reference's masked logsumexp).

Backward (:func:`grad_block`): the dense closed form against `log P_v = log Q_v + shift_v`. The shift is the row's
tail shift on every column but the row's k ids: one program per row and tile of columns writes every column with
the tail shift, then one program per row rewrites the k ids that fall in the block with their own shift (the same
element function: no `(rows, columns)` shift tensor exists). TVD's sign is read from the shift, not from the rounded
`la + shift` (:func:`hf_distill.losses.kd_head.shift_gradient`).
"""

from __future__ import annotations

import torch

from .teacher_forms import gather_ids, padded_outcomes
from .triton_head import _out_or_new, kernel_code

try:
    import triton
    import triton.language as tl

    from .triton_head import _kd_grad
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

# the dense kernels' launch settings and CUDA check (`available` is this module's too: sparse_head asks it here)
from .triton_head import _BLOCK, _GRAD_BLOCK, _GRAD_WARPS, _WARPS, available  # noqa: F401

if triton is not None:

    @triton.jit
    def _tail_lse_kernel(z_ptr, z_stride, out_ptr, n_rows, n_cols, vocab, inv_t, HAS_ONE: tl.constexpr,
                         BLOCK: tl.constexpr):
        """Per row: logsumexp at T of the first `vocab` columns and (HAS_ONE) at T = 1 of every column."""
        row = tl.program_id(0)
        z_row = z_ptr + row.to(tl.int64) * z_stride
        cols = tl.arange(0, BLOCK)
        neg = -1.0e38
        m_a = tl.full([BLOCK], neg, tl.float32)
        s_a = tl.zeros([BLOCK], tl.float32)
        m_1 = tl.full([BLOCK], neg, tl.float32)
        s_1 = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            z = tl.load(z_row + c, mask=c < n_cols, other=float("-inf"))
            a = tl.where(c < vocab, z * inv_t, float("-inf"))
            new = tl.maximum(m_a, a)
            s_a = s_a * tl.exp(m_a - new) + tl.exp(a - new)
            m_a = new
            if HAS_ONE:
                new = tl.maximum(m_1, z)
                s_1 = s_1 * tl.exp(m_1 - new) + tl.exp(z - new)
                m_1 = new
        big = tl.max(m_a, 0)
        tl.store(out_ptr + row, big + tl.log(tl.sum(s_a * tl.exp(m_a - big), 0)))
        if HAS_ONE:
            big = tl.max(m_1, 0)
            tl.store(out_ptr + n_rows + row, big + tl.log(tl.sum(s_1 * tl.exp(m_1 - big), 0)))

    @triton.jit
    def _element(zs, col, shift, row, tgt_ptr, lse1_ptr, wce_ptr, lsea_ptr, stat_ptr, wkd_ptr, inv_t, beta, alpha,
                 scale, inv_cap, KIND: tl.constexpr, HAS_KD: tl.constexpr, HAS_CE: tl.constexpr,
                 HAS_CAP: tl.constexpr):
        """d loss / d raw logit of elements of one row (`col`: their vocabulary ids, `shift`: log P - log Q)."""
        g = tl.zeros_like(zs)
        if HAS_CE:
            onehot = tl.where(col == tl.load(tgt_ptr + row), 1.0, 0.0)
            g += (tl.exp(zs - tl.load(lse1_ptr + row)) - onehot) * tl.load(wce_ptr + row)
        if HAS_KD:
            la = zs * inv_t - tl.load(lsea_ptr + row)
            if KIND == 6:  # tvd: sign(Q - P) = sign(-shift), exactly (kd_head.shift_gradient)
                sign = tl.where(shift < 0.0, 1.0, tl.where(shift > 0.0, -1.0, 0.0))
                g += tl.exp(la) * (0.5 * sign - tl.load(stat_ptr + row)) * tl.load(wkd_ptr + row)
            else:
                g += _kd_grad(la, la + shift, tl.load(stat_ptr + row), KIND, beta, alpha) * tl.load(wkd_ptr + row)
        if HAS_CAP:
            r = zs * inv_cap
            g = g * (1.0 - r * r)
        return g * scale

    @triton.jit
    def _grad_tail_kernel(zs_ptr, zs_stride, g_ptr, g_stride, tail_ptr, tgt_ptr, lse1_ptr, wce_ptr, lsea_ptr,
                          stat_ptr, wkd_ptr, n_cols, start, inv_t, beta, alpha, scale, inv_cap, KIND: tl.constexpr,
                          HAS_KD: tl.constexpr, HAS_CE: tl.constexpr, HAS_CAP: tl.constexpr, BLOCK: tl.constexpr):
        """Every column of a tile with its row's tail shift."""
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = c < n_cols
        zs = tl.load(zs_ptr + row.to(tl.int64) * zs_stride + c, mask=inside, other=0.0)
        shift = tl.zeros_like(zs)
        if HAS_KD:
            shift += tl.load(tail_ptr + row)
        g = _element(zs, c + start, shift, row, tgt_ptr, lse1_ptr, wce_ptr, lsea_ptr, stat_ptr, wkd_ptr, inv_t, beta,
                     alpha, scale, inv_cap, KIND, HAS_KD, HAS_CE, HAS_CAP)
        tl.store(g_ptr + row.to(tl.int64) * g_stride + c, g.to(g_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _grad_ids_kernel(zs_ptr, zs_stride, g_ptr, g_stride, ids_ptr, shk_ptr, k, tgt_ptr, lse1_ptr, wce_ptr,
                         lsea_ptr, stat_ptr, wkd_ptr, n_cols, start, inv_t, beta, alpha, scale, inv_cap,
                         KIND: tl.constexpr, HAS_CE: tl.constexpr, HAS_CAP: tl.constexpr, BLOCK_K: tl.constexpr):
        """The row's top-k ids that fall in the block, rewritten with their own shift (after `_grad_tail_kernel`)."""
        row = tl.program_id(0)
        j = tl.arange(0, BLOCK_K)
        ids = tl.load(ids_ptr + row.to(tl.int64) * k + j, mask=j < k, other=-1)
        local = ids - start
        inside = (j < k) & (local >= 0) & (local < n_cols)
        local = tl.where(inside, local, 0)
        zs = tl.load(zs_ptr + row.to(tl.int64) * zs_stride + local, mask=inside, other=0.0)
        shift = tl.load(shk_ptr + row.to(tl.int64) * k + j, mask=inside, other=0.0)
        g = _element(zs, ids, shift, row, tgt_ptr, lse1_ptr, wce_ptr, lsea_ptr, stat_ptr, wkd_ptr, inv_t, beta,
                     alpha, scale, inv_cap, KIND, True, HAS_CE, HAS_CAP)
        tl.store(g_ptr + row.to(tl.int64) * g_stride + local, g.to(g_ptr.dtype.element_ty), mask=inside)


def row_stats(zs: torch.Tensor, ids: torch.Tensor | None, targets: torch.Tensor | None, temperature: float,
              vocab: int):
    """The Triton version of :func:`hf_distill.losses.sparse_head._sparse_row_stats` (same arguments, same results).
    The ids' columns of `zs` are -inf during the kernel's walk, and restored after it."""
    if ids is None:  # the CE alone: the dense head's kernel
        from . import triton_head

        return triton_head.row_stats(zs, None, targets, None, 1.0, 0.5, 0.1, vocab)[:2] + (None, None)
    zs = zs if zs.stride(-1) == 1 else zs.contiguous()
    n, n_cols = zs.shape
    inv_t = 1.0 / temperature
    valid, ids = gather_ids(ids)  # padding (-1, an adaptive-k row): the row's first id, masked below
    z_ids = zs.gather(-1, ids)
    z_tgt = zs.gather(-1, targets[:, None]).squeeze(-1) if targets is not None else None
    same = temperature == 1.0 and vocab == n_cols
    has_one = targets is not None and not same
    zs.scatter_(-1, ids, float("-inf"))
    out = torch.empty(2, n, device=zs.device, dtype=torch.float32)
    if n:
        _tail_lse_kernel[(n,)](zs, zs.stride(0), out, n, n_cols, vocab, inv_t, HAS_ONE=has_one, BLOCK=_BLOCK,
                               num_warps=_WARPS)
    zs.scatter_(-1, ids, z_ids)  # the chunk as it was (the fused mode forms its gradient from it next)
    a_ids = z_ids * inv_t if temperature != 1.0 else z_ids
    rest = out[0]
    held = torch.where(valid, a_ids, float("-inf"))  # a padded copy of the first id is no mass of its own
    lse_a = torch.logaddexp(rest, torch.logsumexp(held, -1))
    log_q = torch.cat([padded_outcomes(a_ids - lse_a[:, None], valid), (rest - lse_a)[:, None]], -1)
    lse1 = ce = None
    if targets is not None:
        z_held = torch.where(valid, z_ids, float("-inf"))
        lse1 = lse_a if same else torch.logaddexp(out[1], torch.logsumexp(z_held, -1))
        ce = lse1 - z_tgt
    return lse1, ce, lse_a, log_q


def grad_block(zs: torch.Tensor, ids: torch.Tensor | None, shift_k: torch.Tensor | None,
               shift_tail: torch.Tensor | None, start: int, targets: torch.Tensor | None, lse1: torch.Tensor | None,
               w_ce: torch.Tensor | None, lse_a: torch.Tensor | None, stat: torch.Tensor | None,
               w_kd: torch.Tensor | None, kind: str | None, temperature: float, beta: float, alpha: float,
               scale: float, cap: float | None, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton version of :func:`hf_distill.losses.sparse_head._sparse_grad_block` on the columns `start...` of
    every row, from the ids and their shifts (`ids`, `shift_k`: `(n, k)`; `shift_tail`: `(n,)`; None without a KD)
    instead of a `(n, columns)` shift block; `out` as :func:`hf_distill.losses.triton_head.grad_block`'s."""
    has_kd, has_ce = ids is not None, targets is not None
    code = kernel_code(kind if has_kd else None)
    zs = zs if zs.stride(-1) == 1 else zs.contiguous()
    n, n_cols = zs.shape
    g = _out_or_new(out, n, n_cols, zs.device, dtype)
    if n == 0 or n_cols == 0:
        return g
    dummy = zs.new_zeros(1)
    targets, lse1, w_ce, lse_a, stat, w_kd, shift_tail = (
        x.contiguous() if x is not None else None for x in (targets, lse1, w_ce, lse_a, stat, w_kd, shift_tail))
    common = (targets if has_ce else dummy, lse1 if has_ce else dummy, w_ce if has_ce else dummy,
              lse_a if has_kd else dummy, stat if has_kd else dummy, w_kd if has_kd else dummy, n_cols, start,
              1.0 / temperature, float(beta), float(alpha), float(scale), 0.0 if cap is None else 1.0 / cap)
    _grad_tail_kernel[(n, triton.cdiv(n_cols, _GRAD_BLOCK))](
        zs, zs.stride(0), g, g.stride(0), shift_tail if has_kd else dummy, *common, KIND=code, HAS_KD=has_kd,
        HAS_CE=has_ce, HAS_CAP=cap is not None, BLOCK=_GRAD_BLOCK, num_warps=_GRAD_WARPS)
    if has_kd:
        ids, shift_k = ids.contiguous(), shift_k.contiguous()
        k = ids.shape[1]
        _grad_ids_kernel[(n,)](zs, zs.stride(0), g, g.stride(0), ids, shift_k, k, *common, KIND=code,
                               HAS_CE=has_ce, HAS_CAP=cap is not None, BLOCK_K=max(16, triton.next_power_of_2(k)),
                               num_warps=4)
    return g
