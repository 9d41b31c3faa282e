"""The loss head's elementwise work as two Triton kernels (CUDA only; :func:`hf_distill.losses.kd_head._row_stats`
and :func:`hf_distill.losses.kd_head._grad_block` are the references they are tested against, on a GPU, by
`benchmarks/causal_lm_gpu.py` and tests/test_chunked.py, and in Triton's CPU interpreter where triton is installed).

Forward (:func:`row_stats`): for a chunk of rows of float32 student and teacher logits it computes, per row: the
log-normalisers of both at T (and of the student at T = 1 for the CE), the divergence and its gradient statistic
(:func:`hf_distill.losses.divergence_rows`), and the CE. One program per row walks the vocabulary twice, an online
logsumexp first and the divergence second, so each logit is read twice and nothing of size `(rows, V)` is written:
the compiled PyTorch version reads it ~6 times and writes one such intermediate. One program per row, 16 warps:
on an H200 that is 1.8x faster than 4 warps (`benchmarks/head_profile.py`: 7.4 ms against 13.8 ms for the forward
of 8,192 x 128,256 JSD + CE), as a long row needs many loads in flight.

Backward (:func:`grad_block`): the logit gradient of a vocabulary block, one program per row and tile of columns,
each logit read once and the gradient written once in the GEMM's dtype (the compiled PyTorch version: 9.3 ms for
the whole backward at that shape).

`expm1` and `log1p` are written with Kahan's corrections (`exp`/`log` only), accurate to a few ulps, so the kernels
run on every Triton version and in Triton's CPU interpreter.
"""

from __future__ import annotations

import torch

from .registry import KindMap, get_divergence

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

KIND_CODES = KindMap("triton_code")
"""kind -> the branch of `_terms` / `_kd_grad` that computes it: each registry entry's `triton_code` (a live view of
:mod:`hf_distill.losses.registry`)."""
KERNEL_CODES = range(7)  # the branches `_terms` and `_kd_grad` have: 0 kl, 1 soft_ce, 2 reverse_kl, 3 jsd, 4 skew_kl,
# 5 skew_reverse_kl, 6 tvd (the built-in entries' codes, hf_distill.losses.kinds)
_BLOCK = 2048
_WARPS = 16
_GRAD_BLOCK = 4096
_GRAD_WARPS = 8


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def kernel_code(kind: str | None) -> int:
    """The kernels' branch for `kind` (its registry entry's `triton_code`; 0 without a KD, where no branch runs).
    A kind without an entry or without a code is refused here, before any launch: never computed as another."""
    if kind is None:
        return 0
    code = get_divergence(kind, needs="rows").triton_code
    if code is None or code not in KERNEL_CODES:
        raise ValueError(
            f"kd_loss={kind!r} has no Triton kernel code (its registry entry's triton_code is {code!r}), so the loss "
            "head's CUDA kernels cannot compute it: set HF_DISTILL_TRITON=0 (the same row math compiled by PyTorch), "
            "or add a branch to hf_distill/losses/triton_head.py and give the entry its code.")
    return code


if triton is not None:

    @triton.jit
    def _expm1_neg(x):
        """expm1(x) for x <= 0 (Kahan: (u - 1) * x / log(u), u = exp(x); x where u rounds to 1)."""
        u = tl.exp(x)
        um1 = u - 1.0
        safe = tl.where(um1 == 0.0, 1.0, um1)
        logu = tl.where(um1 == 0.0, 1.0, tl.log(u))
        return tl.where(um1 == 0.0, x, tl.where(u == 0.0, -1.0, safe * x / logu))

    @triton.jit
    def _log1p(y):
        """log1p(y) for y >= -1 (Kahan: log(u) * y / (u - 1), u = 1 + y; y where u rounds to 1)."""
        u = 1.0 + y
        um1 = u - 1.0
        ratio = y / tl.where(um1 == 0.0, 1.0, um1)
        return tl.where(um1 == 0.0, y, tl.log(u) * ratio)

    @triton.jit
    def _mix(w, d):
        """log((1 - w) + w exp(d)), exactly 0 at d = 0 (as hf_distill.losses.divergences._log1p_mix)."""
        c = tl.where(d <= 0.0, w, 1.0 - w)
        return tl.maximum(d, 0.0) + _log1p(c * _expm1_neg(-tl.abs(d)))

    @triton.jit
    def _terms(la, lb, KIND: tl.constexpr, beta, alpha):
        """Per element: the divergence's term and its statistic's term (hf_distill.losses.divergence_rows)."""
        p = tl.exp(lb)
        q = tl.exp(la)
        d = la - lb
        zero = tl.zeros_like(la)
        if KIND == 0:
            v = tl.where(p > 0.0, p * (lb - la), zero)
            s = zero
        elif KIND == 1:
            v = tl.where(p > 0.0, -p * la, zero)
            s = zero
        elif KIND == 2:
            v = tl.where(q > 0.0, q * d, zero)
            s = v
        elif KIND == 3:
            lmq = _mix(beta, -d)
            tq = tl.where(q > 0.0, q * lmq, zero)
            tp = tl.where(p > 0.0, p * (lmq + d), zero)
            v = -(beta * tp + (1.0 - beta) * tq)
            s = -tq
        elif KIND == 4:
            lrp = _mix(1.0 - alpha, d)
            v = tl.where(p > 0.0, -p * lrp, zero)
            s = tl.where(q > 0.0, q * tl.exp(-lrp), zero)
        elif KIND == 5:
            lrq = _mix(1.0 - alpha, -d)
            v = tl.where(q > 0.0, -q * lrq, zero)
            s = tl.where(q > 0.0, q * (-lrq - alpha * tl.exp(-lrq)), zero)
        else:
            diff = q - p
            v = 0.5 * tl.abs(diff)
            s = 0.5 * q * tl.where(diff > 0.0, 1.0, tl.where(diff < 0.0, -1.0, 0.0))
        return v, s

    @triton.jit
    def _row_stats_kernel(zs_ptr, zs_stride, zt_ptr, zt_stride, tgt_ptr, out_ptr, n_rows, n_cols, vocab, inv_t,
                          beta, alpha, KIND: tl.constexpr, HAS_KD: tl.constexpr, HAS_CE: tl.constexpr,
                          SAME: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        zs_row = zs_ptr + row.to(tl.int64) * zs_stride
        zt_row = zt_ptr + row.to(tl.int64) * zt_stride
        cols = tl.arange(0, BLOCK)
        neg = -1.0e38
        m_a = tl.full([BLOCK], neg, tl.float32)
        s_a = tl.zeros([BLOCK], tl.float32)
        m_b = tl.full([BLOCK], neg, tl.float32)
        s_b = tl.zeros([BLOCK], tl.float32)
        m_1 = tl.full([BLOCK], neg, tl.float32)
        s_1 = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):  # pass 1: online logsumexps
            c = start + cols
            zs = tl.load(zs_row + c, mask=c < n_cols, other=float("-inf"))
            if HAS_KD:
                a = tl.where(c < vocab, zs * inv_t, float("-inf"))
                b = tl.load(zt_row + c, mask=c < vocab, other=float("-inf")) * inv_t
                new = tl.maximum(m_a, a)
                s_a = s_a * tl.exp(m_a - new) + tl.exp(a - new)
                m_a = new
                new = tl.maximum(m_b, b)
                s_b = s_b * tl.exp(m_b - new) + tl.exp(b - new)
                m_b = new
            if HAS_CE and not SAME:
                new = tl.maximum(m_1, zs)
                s_1 = s_1 * tl.exp(m_1 - new) + tl.exp(zs - new)
                m_1 = new
        lse_a = 0.0
        lse_b = 0.0
        value = 0.0
        stat = 0.0
        if HAS_KD:
            big = tl.max(m_a, 0)
            lse_a = big + tl.log(tl.sum(s_a * tl.exp(m_a - big), 0))
            big = tl.max(m_b, 0)
            lse_b = big + tl.log(tl.sum(s_b * tl.exp(m_b - big), 0))
            acc_v = tl.zeros([BLOCK], tl.float32)
            acc_s = tl.zeros([BLOCK], tl.float32)
            for start in range(0, vocab, BLOCK):  # pass 2: the divergence and its statistic
                c = start + cols
                inside = c < vocab
                la = tl.load(zs_row + c, mask=inside, other=0.0) * inv_t - lse_a
                lb = tl.load(zt_row + c, mask=inside, other=0.0) * inv_t - lse_b
                v, s = _terms(la, lb, KIND, beta, alpha)
                acc_v += tl.where(inside, v, 0.0)
                acc_s += tl.where(inside, s, 0.0)
            value = tl.sum(acc_v, 0)
            stat = tl.sum(acc_s, 0)
        lse_1 = lse_a
        ce = 0.0
        if HAS_CE:
            if not SAME:
                big = tl.max(m_1, 0)
                lse_1 = big + tl.log(tl.sum(s_1 * tl.exp(m_1 - big), 0))
            target = tl.load(tgt_ptr + row)
            ce = lse_1 - tl.load(zs_row + target)
        tl.store(out_ptr + row, lse_a)
        tl.store(out_ptr + n_rows + row, lse_b)
        tl.store(out_ptr + 2 * n_rows + row, lse_1)
        tl.store(out_ptr + 3 * n_rows + row, value)
        tl.store(out_ptr + 4 * n_rows + row, stat)
        tl.store(out_ptr + 5 * n_rows + row, ce)


if triton is not None:

    @triton.jit
    def _kd_grad(la, lb, stat, KIND: tl.constexpr, beta, alpha):
        """d divergence / d (student logits / T) per element (:func:`hf_distill.losses.kd_head.row_gradient`)."""
        q = tl.exp(la)
        zero = tl.zeros_like(la)
        d = la - lb
        if KIND <= 1:  # kl, soft_ce
            g = q - tl.exp(lb)
        elif KIND == 2:
            g = tl.where(q > 0.0, q * (d - stat), zero)
        elif KIND == 3:
            g = tl.where(q > 0.0, q * (-_mix(beta, -d) - stat), zero) * (1.0 - beta)
        elif KIND == 4:
            g = tl.where(q > 0.0, q * (tl.exp(-_mix(1.0 - alpha, d)) - stat), zero) * -(1.0 - alpha)
        elif KIND == 5:
            lrq = _mix(1.0 - alpha, -d)
            g = tl.where(q > 0.0, q * (-lrq - alpha * tl.exp(-lrq) - stat), zero)
        else:
            diff = q - tl.exp(lb)
            g = q * (0.5 * tl.where(diff > 0.0, 1.0, tl.where(diff < 0.0, -1.0, 0.0)) - stat)
        return g

    @triton.jit
    def _grad_block_kernel(zs_ptr, zs_stride, zt_ptr, zt_stride, g_ptr, g_stride, tgt_ptr, lse1_ptr, wce_ptr,
                           lsea_ptr, lseb_ptr, stat_ptr, wkd_ptr, n_cols, start, inv_t, beta, alpha, scale, inv_cap,
                           KIND: tl.constexpr, HAS_KD: tl.constexpr, HAS_CE: tl.constexpr, HAS_CAP: tl.constexpr,
                           BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = c < n_cols
        zs = tl.load(zs_ptr + row.to(tl.int64) * zs_stride + c, mask=inside, other=0.0)
        g = tl.zeros([BLOCK], tl.float32)
        if HAS_CE:
            onehot = tl.where(c + start == tl.load(tgt_ptr + row), 1.0, 0.0)
            g += (tl.exp(zs - tl.load(lse1_ptr + row)) - onehot) * tl.load(wce_ptr + row)
        if HAS_KD:
            zt = tl.load(zt_ptr + row.to(tl.int64) * zt_stride + c, mask=inside, other=0.0)
            la = zs * inv_t - tl.load(lsea_ptr + row)
            lb = zt * inv_t - tl.load(lseb_ptr + row)
            g += _kd_grad(la, lb, tl.load(stat_ptr + row), KIND, beta, alpha) * tl.load(wkd_ptr + row)
        if HAS_CAP:
            r = zs * inv_cap
            g = g * (1.0 - r * r)
        g = g * scale
        tl.store(g_ptr + row.to(tl.int64) * g_stride + c, g.to(g_ptr.dtype.element_ty), mask=inside)


def grad_block(zs: torch.Tensor, zt: torch.Tensor | None, start: int, targets: torch.Tensor | None,
               lse1: torch.Tensor | None, w_ce: torch.Tensor | None, lse_a: torch.Tensor | None,
               lse_b: torch.Tensor | None, stat: torch.Tensor | None, w_kd: torch.Tensor | None, kind: str | None,
               temperature: float, beta: float, alpha: float, scale: float, cap: float | None,
               dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton version of :func:`hf_distill.losses.kd_head._grad_block` (same arguments, same results); `out`: a
    `(rows, columns)` view of `dtype` to write into (a column range of a wider gradient: no copy), else a new one."""
    code = kernel_code(kind if zt is not None else None)
    zs = zs if zs.stride(-1) == 1 else zs.contiguous()
    zt = zt if zt is None or zt.stride(-1) == 1 else zt.contiguous()
    n, n_cols = zs.shape
    g = _out_or_new(out, n, n_cols, zs.device, dtype)
    if n == 0 or n_cols == 0:
        return g
    has_kd, has_ce = zt is not None, targets is not None
    dummy = zs.new_zeros(1)
    _grad_block_kernel[(n, triton.cdiv(n_cols, _GRAD_BLOCK))](
        zs, zs.stride(0), zt if has_kd else zs, (zt if has_kd else zs).stride(0), g, g.stride(0),
        targets if has_ce else dummy, lse1 if has_ce else dummy, w_ce if has_ce else dummy,
        lse_a if has_kd else dummy, lse_b if has_kd else dummy, stat if has_kd else dummy, w_kd if has_kd else dummy,
        n_cols, start, 1.0 / temperature, float(beta), float(alpha), float(scale),
        0.0 if cap is None else 1.0 / cap, KIND=code, HAS_KD=has_kd, HAS_CE=has_ce,
        HAS_CAP=cap is not None, BLOCK=_GRAD_BLOCK, num_warps=_GRAD_WARPS)
    return g


def _out_or_new(out: torch.Tensor | None, n: int, n_cols: int, device: torch.device,
                dtype: torch.dtype) -> torch.Tensor:
    """The gradient block a kernel writes: `out` (checked: its shape, dtype and unit column stride) or a new one."""
    if out is None:
        return torch.empty(n, n_cols, device=device, dtype=dtype)
    if tuple(out.shape) != (n, n_cols) or out.dtype != dtype or (n_cols > 1 and out.stride(-1) != 1):
        raise ValueError(f"grad_block's out must be ({n}, {n_cols}) {dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    return out


def row_stats(zs: torch.Tensor, zt: torch.Tensor | None, targets: torch.Tensor | None, kind: str | None,
              temperature: float, beta: float, alpha: float, vocab: int):
    """The Triton version of :func:`hf_distill.losses.kd_head._row_stats` (same arguments, same results)."""
    code = kernel_code(kind)
    zs = zs if zs.stride(-1) == 1 else zs.contiguous()
    zt = zt if zt is None or zt.stride(-1) == 1 else zt.contiguous()
    n, n_cols = zs.shape
    has_kd, has_ce = kind is not None, targets is not None
    same = has_kd and temperature == 1.0 and vocab == n_cols
    out = torch.empty(6, n, device=zs.device, dtype=torch.float32)
    zt_arg = zt if zt is not None else zs
    tgt = targets if targets is not None else torch.zeros(1, dtype=torch.long, device=zs.device)
    _row_stats_kernel[(n,)](zs, zs.stride(0), zt_arg, zt_arg.stride(0), tgt, out, n, n_cols, vocab if has_kd else 0,
                            1.0 / temperature, float(beta), float(alpha), KIND=code,
                            HAS_KD=has_kd, HAS_CE=has_ce, SAME=same, BLOCK=_BLOCK, num_warps=_WARPS)
    lse_a, lse_b, lse_1, value, stat, ce = out
    if not has_kd:
        return lse_1, ce, None, None, None, None
    return (lse_1 if has_ce else None), (ce if has_ce else None), lse_a, lse_b, value, stat
