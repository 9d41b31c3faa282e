"""The causal-LM loss head (:mod:`hf_distill.losses.chunked`) over a sparse teacher: an offline teacher signal's
top-k log-probabilities, their ids and the log of the tail mass per position (:mod:`hf_distill.data.teacher_signal`).

The divergence is the one :mod:`hf_distill.losses` defines for a `(log_probs, indices, log_tail)` teacher: both
sides are distributions over k + 1 outcomes (the k ids and "every other id"), the student's from its full softmax at
T; every kind of :func:`hf_distill.losses.divergence_rows` is a true divergence of that coarsening (0 at agreement,
no clamping). Same memory shape as the dense head (:class:`hf_distill.losses.kd_head._KDHead`): the student's logits
exist a token chunk at a time (forward) or a vocabulary block at a time (backward), from float32-output GEMMs. The
frame is the dense head's (the counted rows, the routes and the means: :mod:`hf_distill.losses.head_common`; the two
walks: :mod:`hf_distill.losses.kd_head`); this module states only what a sparse teacher changes: its rows, its row
statistics and gradient blocks, and its KD sum on the module route.

A row may hold fewer than k ids (an adaptive-k signal): its padding entries (id -1, log-probability -inf:
:mod:`hf_distill.losses.teacher_forms`) are outcomes of no mass on both sides, with a zero shift that no column
receives; the student's tail is the mass of every id the row does not hold, as the teacher's stored tail is.

The gradient in closed form: with `Q` the student's softmax at T, `q_o` its mass on outcome o and `p_o` the
teacher's, `dL/da_v = Q_v (g_o(v) - sum_o q_o g_o)` where `g_o = dL/dq_o` depends on `p_o / q_o` only. That is the
dense gradient (:func:`hf_distill.losses.kd_head.row_gradient`) against a teacher `P_v = Q_v p_o / q_o`, i.e.
`log P_v = log Q_v + (log p_o - log q_o)`: per vocabulary block every column gets its row's tail shift and the top-k
columns that fall in the block get their own (a scatter); the row statistic comes from the k + 1 outcomes.
"""

from __future__ import annotations

import functools

import torch

from . import divergences as losses
from .fused_grads import by_columns, sum_coefficients, writes_into
from .head_common import (
    Counted,
    KDSpec,
    LogitsHead,
    _compute_dtype,
    counted_rows,
    head_means,
    module_sums,
    vocab_size,
)
from .kd_head import (
    _backward_walk,
    _ce_grad,
    _elementwise,
    _forward_chunks,
    _fused_finish,
    _fused_state,
    _post_grad,
    _spec_args,
    shift_gradient,
)
from .teacher_forms import TopKTail, as_teacher, check_padding, gather_ids, padded_outcomes

SparseTeacher = TopKTail | tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""`(log_probs (..., k), indices (..., k), log_tail (...))`: the teacher's top-k log-probabilities at T, their ids
and the log of the mass of every other id (:func:`hf_distill.losses.topk_with_tail`, an offline teacher signal;
:class:`hf_distill.losses.TopKTail`, or the plain triple)."""

_NO_SECOND_DERIVATIVE = (
    "The causal-LM loss head (hf_distill.losses.sparse_head) has no second derivative: its gradient is formed in "
    "closed form. For create_graph=True compute the loss from whole logits (hf_distill.losses on the model's logits "
    "with the (log_probs, indices, log_tail) teacher).")


def _check_teacher(teacher, s_hidden: torch.Tensor) -> TopKTail:
    try:
        form = as_teacher(teacher, "the loss head")
    except (TypeError, ValueError):
        form = None
    if form is None or form.form != TopKTail.form:
        raise ValueError(
            "The loss head takes a sparse teacher as a (log_probs, indices, log_tail) triple (an offline teacher "
            "signal, hf_distill.losses.topk_with_tail); a top-k (values, indices) pair without the tail mass is "
            "compared on whole logits (kd_chunk_size unset where chunking is impossible)."
        )
    log_probs, ids, log_tail = form
    want = tuple(s_hidden.shape[:2])
    want = (want[0], want[1] - 1)
    if tuple(log_probs.shape[:-1]) != want or log_probs.dim() != 3:
        raise ValueError(f"sparse teacher log_probs {tuple(log_probs.shape)} must be (batch, length - 1, k) = "
                         f"{(*want, 'k')}: the shifted positions of the student's hidden states "
                         f"{tuple(s_hidden.shape)}")
    if ids.shape != log_probs.shape:
        raise ValueError(f"sparse teacher indices {tuple(ids.shape)} must have the shape of its log_probs "
                         f"{tuple(log_probs.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"sparse teacher indices must be an integer tensor, got {ids.dtype}")
    if tuple(log_tail.shape) != want:
        raise ValueError(f"sparse teacher log_tail {tuple(log_tail.shape)} must be (batch, length - 1) = {want}")
    return TopKTail(log_probs, ids, log_tail)


def _teacher_rows(teacher: TopKTail, counted: Counted, kd: KDSpec | None):
    """The teacher's three parts at the counted rows (:func:`hf_distill.losses.head_common.counted_rows`); rows the
    KD does not count get the ids 0..k-1 (any distinct valid ids: their teacher is replaced by the student itself)."""
    if kd is None:
        return None
    device = counted.hidden.device
    log_probs, ids, log_tail = (counted.take(x.to(device)) for x in teacher)
    k = ids.shape[-1]
    ids = torch.where(counted.is_kd[:, None], ids.long(), torch.arange(k, device=device))
    # padding entries (id -1, an adaptive-k row) become outcomes of no mass (teacher_forms.padded_outcomes)
    return padded_outcomes(log_probs.float(), ids >= 0), ids, log_tail.float()


def sparse_kd_and_ce(
    s_hidden: torch.Tensor,
    student_head: LogitsHead,
    teacher: SparseTeacher,
    kd_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    kd: KDSpec | None,
    chunk_size: int,
    vocab: int | None = None,
    route: str = "auto",
    fused: tuple[float, float] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """:func:`hf_distill.losses.chunked.chunked_kd_and_ce` with a sparse teacher `(log_probs, indices, log_tail)` of
    shapes `(B, T-1, k)`, `(B, T-1, k)`, `(B, T-1)`, aligned with `kd_mask`. The student's distribution is its softmax
    at T over its first `vocab` ids (default: all of them), which the ids must index. `fused`: as there (the
    gradients formed in the forward)."""
    if kd is not None and not isinstance(kd, KDSpec):
        raise TypeError("kd must be an hf_distill.losses.chunked.dense_kd(...) objective")
    if kd is not None and kd.kind == "mse":
        raise ValueError("kd_loss='mse' compares raw logits, which a top-k + tail teacher signal does not hold")
    teacher = _check_teacher(teacher, s_hidden)
    counted = counted_rows(s_hidden, kd_mask, labels, kd)
    if kd is not None:
        check_padding(teacher.log_probs, teacher.indices, "the loss head")
    parts = _teacher_rows(teacher, counted, kd)
    v = vocab if vocab is not None else vocab_size(student_head)
    if parts is not None:
        k = parts[1].shape[-1]
        if not 0 < k <= v:
            raise ValueError(f"The sparse teacher keeps k={k} ids per position, but the KD compares {v} ids: need "
                             "0 < k <= vocab.")
        checked = parts[1][counted.is_kd]
        if checked.numel() and (int(checked[:, 0].min()) < 0 or int(checked.max()) >= v):
            raise ValueError(f"The sparse teacher's ids must lie in [0, {v}) (the student's compared vocabulary), got "
                             f"[{int(checked.min())}, {int(checked.max())}]: a signal of another vocabulary?")
    log_probs, ids, log_tail = parts if parts is not None else (None, None, None)
    coeffs = sum_coefficients(fused, counted.n_kd, counted.n_ce, route, student_head.direct)

    def direct():
        return _SparseKDHead.apply(counted.hidden, student_head.module.weight, student_head.module.bias, log_probs,
                                   ids, log_tail, counted.targets, counted.is_kd, counted.is_ce, student_head, kd, v,
                                   chunk_size, coeffs)

    def module():
        kd_sum = functools.partial(_module_kd_sum, kd, v) if kd is not None else None
        return module_sums(student_head, kd_sum, counted, (log_probs, ids, log_tail), chunk_size)

    return head_means(s_hidden, counted, kd, labels, route, student_head.direct, "a plain nn.Linear LM head", direct,
                      module)


# ---------------------------------------------------------------------------------------------- the row math


def _sparse_row_stats(zs: torch.Tensor, ids: torch.Tensor | None, targets: torch.Tensor | None, temperature: float,
                      vocab: int):
    """Per row of a token chunk: the CE's normaliser and CE, the student's log-normaliser at T over the first `vocab`
    columns, and its log-probabilities of the k + 1 outcomes (the tail as the logsumexp of the other columns: exact
    however much mass the k ids hold)."""
    lse1 = ce = lse_a = log_q = None
    if ids is not None:
        a = zs[:, :vocab] / temperature if temperature != 1.0 else zs[:, :vocab]
        lse_a = torch.logsumexp(a, -1)
        valid, safe = gather_ids(ids)  # padding (-1): the row's first id, then masked
        rest = a.scatter(-1, safe, float("-inf")).logsumexp(-1)
        log_q = torch.cat([padded_outcomes(a.gather(-1, safe) - lse_a[:, None], valid), (rest - lse_a)[:, None]], -1)
    if targets is not None:
        same = ids is not None and temperature == 1.0 and vocab == zs.shape[1]
        lse1 = lse_a if same else torch.logsumexp(zs, -1)
        ce = lse1 - zs.gather(-1, targets[:, None]).squeeze(-1)
    return lse1, ce, lse_a, log_q


def _block_shift(ids: torch.Tensor, shift_k: torch.Tensor, shift_tail: torch.Tensor, block: slice) -> torch.Tensor:
    """`log P_v - log Q_v` for the columns of `block`: the tail's shift everywhere, each top-k id's own where it falls
    in the block (ids outside it are scattered into a spare column, then dropped: no two writes to one column)."""
    width = block.stop - block.start
    out = shift_tail[:, None].expand(-1, width + 1).contiguous()
    local = ids - block.start
    inside = (local >= 0) & (local < width)
    out.scatter_(1, torch.where(inside, local, width), torch.where(inside, shift_k, shift_tail[:, None]))
    return out[:, :width]


def _sparse_grad_block(zs: torch.Tensor, shift: torch.Tensor | None, start: int, targets: torch.Tensor | None,
                       lse1: torch.Tensor | None, w_ce: torch.Tensor | None, lse_a: torch.Tensor | None,
                       stat: torch.Tensor | None, w_kd: torch.Tensor | None, kind: str | None, temperature: float,
                       beta: float, alpha: float, scale: float, cap: float | None, dtype: torch.dtype) -> torch.Tensor:
    """d loss / d raw logits of a vocabulary block: the CE's `softmax - onehot` and the divergence's dense closed form
    against `log P = log Q + shift`, each times its row weight, through the family's post-processing (the CE's part
    and the post-processing are the dense head's: :func:`hf_distill.losses.kd_head._ce_grad`, `_post_grad`)."""
    g = _ce_grad(zs, start, targets, lse1, w_ce)
    if shift is not None:
        la = (zs / temperature if temperature != 1.0 else zs) - lse_a[:, None]
        g = g + shift_gradient(kind, la, shift, stat[:, None], beta, alpha) * w_kd[:, None]
    return _post_grad(g, zs, scale, cap, dtype)


class _SparseKDHead(torch.autograd.Function):
    """`[sum of KD over kd rows, sum of CE over ce rows]` of `N` counted rows from hidden states, the student's LM
    head and a sparse teacher. Forward: token chunks, keeping per row the student's log-normalisers (T and 1), the
    divergence's statistic and the k + 1 shifts `log p_o - log q_o`. Backward: vocabulary blocks, the block's logits
    recomputed and its gradient formed in closed form (see the module docstring). Both walks are the dense head's
    (:func:`hf_distill.losses.kd_head._forward_chunks`, :func:`hf_distill.losses.kd_head._backward_walk`)."""

    @staticmethod
    def forward(ctx, h_s, w_s, b_s, log_p, ids, log_tail, targets, kd_rows, ce_rows, s_head: LogitsHead,
                spec: KDSpec | None, vocab: int, chunk: int, fused: tuple[float, float] | None = None):
        n = h_s.shape[0]
        dtype_s = _compute_dtype(h_s, w_s)
        kind, T, beta, alpha = _spec_args(spec)
        stats = h_s.new_zeros(4, n, dtype=torch.float32)  # lse_s(T), lse_s(1), divergence statistic, tail shift
        shift_k = h_s.new_zeros(n, ids.shape[1], dtype=torch.float32) if spec is not None else None
        sums = h_s.new_zeros(2, dtype=torch.float32)
        row_stats = _triton_or(h_s.device, "row_stats") or _elementwise(_sparse_row_stats, h_s.device)

        def chunk_stats(rows: slice, zs: torch.Tensor):
            lse1, ce, lse_a, log_q = row_stats(zs, ids[rows] if spec is not None else None,
                                               targets[rows] if targets is not None else None, T, vocab)
            if spec is not None:
                counted = kd_rows[rows]
                log_p_c = torch.cat([log_p[rows], log_tail[rows, None]], -1)
                # rows the KD does not count compare the student with itself: value 0, no gradient
                log_p_c = torch.where(counted[:, None], log_p_c, log_q)
                value, stat = losses.divergence_rows(kind, log_q, log_p_c, beta, alpha)
                sums[0] += torch.where(counted, value, 0.0).sum() * spec.factor
                # an outcome without student mass (no tail columns): its columns have Q = 0, no shift needed
                shift = torch.where(log_q == float("-inf"), 0.0, log_p_c - log_q)
                stats[0, rows], stats[2, rows], stats[3, rows] = lse_a, stat, shift[:, -1]
                shift_k[rows] = shift[:, :-1]
            return lse1, ce

        state = _fused_state(ctx, fused, h_s, w_s, b_s, spec, kd_rows, ce_rows, targets)
        block_of = _block_grad_fn(h_s.device, ids, shift_k, targets, stats, s_head, spec, vocab)

        def chunk_grad(rows: slice, zs: torch.Tensor) -> torch.Tensor:
            dtype = state.dtype_out or dtype_s
            w_ce = state.w_ce[rows] if targets is not None else None
            w_kd = state.w_kd[rows] if spec is not None else None
            return by_columns(zs, vocab, spec is not None,
                              lambda cols, kd, out=None: block_of(zs[:, cols], rows, cols, w_kd, w_ce, dtype, out),
                              dtype)

        _forward_chunks(h_s, w_s, b_s, s_head, dtype_s, chunk, targets, ce_rows, stats[1], sums, chunk_stats, state,
                        chunk_grad)
        ctx.save_for_backward(h_s, w_s, b_s, ids, targets, kd_rows, ce_rows, stats, shift_k)
        ctx.args = (s_head, spec, vocab, chunk, dtype_s)
        ctx.set_materialize_grads(False)
        return sums

    @staticmethod
    def backward(ctx, grad):
        done = _fused_finish(ctx, grad, ctx.saved_tensors[:3])
        if done is not None:
            return done
        h_s, w_s, b_s, ids, targets, kd_rows, ce_rows, stats, shift_k = ctx.saved_tensors
        s_head, spec, vocab, chunk, dtype_s = ctx.args
        block_of = _block_grad_fn(h_s.device, ids, shift_k, targets, stats, s_head, spec, vocab)
        every = slice(None)

        def block_grad(block: slice, zs: torch.Tensor, w_kd, w_ce, dtype: torch.dtype):
            return block_of(zs, every, block, w_kd, w_ce, dtype)

        return _backward_walk(ctx, grad, h_s, w_s, b_s, s_head, spec, targets, kd_rows, ce_rows, vocab, chunk,
                              dtype_s, _NO_SECOND_DERIVATIVE, block_grad)


def _block_grad_fn(device: torch.device, ids, shift_k, targets, stats, s_head: LogitsHead, spec: KDSpec | None,
                   vocab: int):
    """`block_of(zs, rows, block, w_kd, w_ce, dtype)`: the logit gradient of the rows `rows` and vocabulary columns
    `block` (`zs` their logits; the row weights already the rows'): the backward's blocks (every row) and the fused
    mode's token chunks (every column). On CUDA the Triton kernels (shifts from the ids), else the row math."""
    kind, T, beta, alpha = _spec_args(spec)
    grad_block = writes_into(_elementwise(_sparse_grad_block, device))
    kernel = _triton_or(device, "grad_block")

    def block_of(zs: torch.Tensor, rows: slice, block: slice, w_kd, w_ce, dtype: torch.dtype,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        kd_here = spec is not None and block.start < vocab
        tg = targets[rows] if targets is not None else None
        lse1, lse_a, stat, tail = stats[1, rows], stats[0, rows], stats[2, rows], stats[3, rows]
        if kernel is not None:  # the shifts from the ids on the GPU: no (rows, columns) shift block
            return kernel(zs, ids[rows] if kd_here else None, shift_k[rows] if kd_here else None, tail, block.start,
                          tg, lse1, w_ce, lse_a, stat, w_kd, kind, T, beta, alpha, s_head.scale, s_head.cap, dtype,
                          out=out)
        shift = _block_shift(ids[rows], shift_k[rows], tail, block) if kd_here else None
        return grad_block(zs, shift, block.start, tg, lse1, w_ce, lse_a, stat, w_kd,
                          kind if shift is not None else None, T, beta, alpha, s_head.scale, s_head.cap, dtype, out=out)

    return block_of


def _triton_or(device: torch.device, name: str):
    """The Triton kernel `name` of :mod:`hf_distill.losses.triton_sparse` on CUDA (the dense head's switches:
    `HF_DISTILL_TRITON=0` or `HF_DISTILL_COMPILE=0` turn it off), else None (the row math above)."""
    import os

    from . import triton_sparse

    on = os.environ.get("HF_DISTILL_COMPILE", "1") != "0" and os.environ.get("HF_DISTILL_TRITON", "1") != "0"
    return getattr(triton_sparse, name) if on and triton_sparse.available(device) else None


# ---------------------------------------------------------------------------------------------- the module route


def _module_kd_sum(kd: KDSpec, vocab: int, z: torch.Tensor, kd_part, log_p, ids, log_tail) -> torch.Tensor:
    """The KD sum of one module-route chunk (:func:`hf_distill.losses.head_common.module_sums`), by autograd through
    the direct route's row math (the tail as the logsumexp of the other columns, which stays finite where
    `1 - sum of the top k` rounds to 0 in float32)."""
    _, _, _, log_q = _sparse_row_stats(z[kd_part], ids[kd_part], None, kd.temperature, vocab)
    log_p_c = torch.cat([log_p[kd_part], log_tail[kd_part, None]], -1)
    if ids.shape[-1] == vocab:  # the ids are the whole vocabulary: no tail outcome (its -inf on both sides
        log_q, log_p_c = log_q[:, :-1], log_p_c[:, :-1]  # would put NaN into autograd's mixtures)
    return losses.divergence_rows(kd.kind, log_q, log_p_c, kd.beta, kd.alpha)[0].sum() * kd.factor
