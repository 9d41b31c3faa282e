"""The sparse (top-k + tail) loss head's Triton kernels (hf_distill.losses.triton_sparse, issue #41 item 5): equal to
the PyTorch row math they replace (hf_distill.losses.sparse_head) and, through the whole head, to float64 whole
logits. On a GPU with the real kernels; on a CPU in Triton's interpreter where triton is installed (skipped, with the
reason, where it is not or where the interpreter cannot run a kernel). CI needs no triton."""

from __future__ import annotations

import pytest
import torch
from test_chunked import _run_script, _skip_unless_the_interpreter_runs

_CHECK = r"""
import sys

import torch
from hf_distill import losses
from hf_distill.losses import chunked, sparse_head, triton_head, triton_sparse

device = sys.argv[1]  # "cpu": the kernels in Triton's interpreter; "cuda": the real kernels on the GPU
torch.backends.cuda.matmul.allow_tf32 = False
KINDS = ["kl", "soft_ce", "reverse_kl", "jsd", "skew_kl", "skew_reverse_kl", "tvd"]
g = torch.Generator().manual_seed(0)
n, V, k = 6, 3000, 37
zs = (torch.randn(n, V, generator=g) * 6).to(device)
zs[1, :] *= 0.01  # a flat row: the tail holds almost all the mass
y = torch.randint(0, V, (n,), generator=g).to(device)


def close(got, want, what):
    assert (got is None) == (want is None), what
    if want is None:
        return
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)) and torch.equal(got[~fin], want[~fin]), what
    scale = float(want[fin].abs().max()) if fin.any() else 1.0
    torch.testing.assert_close(got[fin], want[fin], atol=2e-5 * scale, rtol=1e-4, msg=what)


# ---- the forward's row statistics, against sparse_head._sparse_row_stats
for T, vocab, tg in [(1.0, V, y), (2.0, V - 100, y), (1.0, V, None), (0.7, V - 7, y), (1.0, V - 50, y)]:
    ids = torch.rand(n, vocab, generator=g).to(device).topk(k, -1).indices
    ids[0] = zs[0, :vocab].topk(k).indices  # the row's largest logits: the tail is what little is left
    if tg is not None:
        tg = tg.clone()
        tg[2] = ids[2, 0]  # a target among the ids
    want = sparse_head._sparse_row_stats(zs, ids, tg, T, vocab)
    got = triton_sparse.row_stats(zs.clone(), ids, tg, T, vocab)
    for a, b, name in zip(got, want, ("lse1", "ce", "lse_a", "log_q")):
        close(a, b, (T, vocab, name))
peaked = zs.clone()
ids = peaked.topk(k, -1).indices
peaked.scatter_(-1, ids, 60.0)  # the k ids hold all but ~e^-50 of the mass: the tail exact, not 1 - sum(top k)
want64 = sparse_head._sparse_row_stats(peaked.double(), ids, None, 1.0, V)[3][:, -1]
got = triton_sparse.row_stats(peaked.clone(), ids, None, 1.0, V)[3][:, -1]
torch.testing.assert_close(got.double(), want64, atol=0, rtol=1e-4)
every = torch.arange(300, device=device).repeat(n, 1)  # k = vocabulary: no tail column (log-mass -inf)
close(triton_sparse.row_stats(zs[:, :300].clone(), every, y % 300, 1.0, 300)[3],
      sparse_head._sparse_row_stats(zs[:, :300], every, y % 300, 1.0, 300)[3], "k = vocab")
close(triton_sparse.row_stats(zs.clone(), None, y, 1.0, V)[1], sparse_head._sparse_row_stats(zs, None, y, 1.0, V)[1],
      "CE alone")
for T, vocab in [(1.0, V), (2.0, V - 100)]:
    padded = torch.rand(n, vocab, generator=g).to(device).topk(k, -1).indices
    padded[0, 5:] = -1  # an adaptive-k row: 5 entries, then padding (id -1); row 3 keeps one entry
    padded[3, 1:] = -1
    for a, b, name in zip(triton_sparse.row_stats(zs.clone(), padded, y, T, vocab),
                          sparse_head._sparse_row_stats(zs, padded, y, T, vocab), ("lse1", "ce", "lse_a", "log_q")):
        close(a, b, ("padded", T, vocab, name))

# ---- the backward's gradient block: columns lo..hi of every row, some ids inside, some before, some after
lo, hi = 700, 2700
ids = torch.rand(n, V, generator=g).to(device).topk(k, -1).indices
ids[0, :3] = torch.tensor([lo, hi - 1, lo - 1])  # the block's edges
w_ce, w_kd = torch.rand(n, generator=g).to(device), torch.rand(n, generator=g).to(device)
w_ce[1] = 0.0
y[0], y[2] = 1000, 5  # one target inside the block, one before it
for kind in [*KINDS, None]:
    for T, tg, cap, scale, dtype in [(1.0, y, None, 1.0, torch.bfloat16), (2.0, None, 30.0, 0.5, torch.float32),
                                     (0.7, y, 50.0, 1.0, torch.float32)]:
        if kind is None and tg is None:
            continue
        lse1, _, lse_a, log_q = sparse_head._sparse_row_stats(zs, ids, y, T, V)
        log_p = torch.log_softmax(log_q + 0.3 * torch.randn(log_q.shape, generator=g).to(device), -1)
        stat = losses.divergence_rows(kind or "kl", log_q, log_p, 0.3, 0.2)[1]
        shift = log_p - log_q
        block = slice(lo, hi)
        want = sparse_head._sparse_grad_block(
            zs[:, block], sparse_head._block_shift(ids, shift[:, :-1], shift[:, -1], block) if kind else None, lo, tg,
            lse1, w_ce, lse_a, stat, w_kd, kind, T, 0.3, 0.2, scale, cap, dtype)
        got = triton_sparse.grad_block(zs[:, block], ids if kind else None, shift[:, :-1], shift[:, -1], lo, tg, lse1,
                                       w_ce, lse_a, stat, w_kd, kind, T, 0.3, 0.2, scale, cap, dtype)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        assert float(want.float().abs().max()) > 0, kind
        tol = 1e-2 if dtype == torch.bfloat16 else 2e-5  # bf16: one rounding of values equal to float32's last bits
        if kind is not None:  # padding (id -1, a zero shift) reaches no column
            cut = torch.where(torch.arange(k, device=device) < 4, ids, -1)
            cut_shift = torch.where(cut >= 0, shift[:, :-1], 0.0)
            pad_want = sparse_head._sparse_grad_block(
                zs[:, block], sparse_head._block_shift(cut, cut_shift, shift[:, -1], block), lo, tg, lse1, w_ce,
                lse_a, stat, w_kd, kind, T, 0.3, 0.2, scale, cap, dtype)
            pad_got = triton_sparse.grad_block(zs[:, block], cut, cut_shift, shift[:, -1], lo, tg, lse1, w_ce, lse_a,
                                               stat, w_kd, kind, T, 0.3, 0.2, scale, cap, dtype)
            # the full-k comparison's tolerance: the same elementwise work, some columns now at the tail's shift
            torch.testing.assert_close(pad_got.float(), pad_want.float(), rtol=tol,
                                       atol=tol * float(want.float().abs().max()), msg=str(("padded", kind, T)))
        torch.testing.assert_close(got.float(), want.float(), atol=tol * float(want.float().abs().max()), rtol=tol,
                                   msg=str((kind, T, cap, dtype)))

# ---- the whole head through the kernels against float64 whole logits (hf_distill.losses' sparse divergence)
calls = []
for name in ("row_stats", "grad_block"):
    kernel = getattr(triton_sparse, name)
    setattr(triton_sparse, name, lambda *a, _k=kernel, **kw: calls.append(1) or _k(*a, **kw))
if device == "cpu":
    triton_sparse.available = lambda device: True  # the CUDA path, its kernels in Triton's interpreter on a CPU
    triton_head.available = lambda device: True
vocab, pad, b, t, hdim = 300, 40, 2, 40, 16
h = torch.randn(b, t, hdim, generator=g)
head = torch.nn.Linear(hdim, vocab + pad)
with torch.no_grad():
    head.weight.copy_(torch.randn(vocab + pad, hdim, generator=g) * 0.8)
    head.bias.copy_(torch.randn(vocab + pad, generator=g) * 0.1)
    h_t = h[:, :-1].double() + 0.1 * torch.randn(b, t - 1, hdim, generator=g).double()
    t_logits = h_t @ head.weight[:vocab].T.double()
teacher = tuple(x.float() if x.is_floating_point() else x for x in losses.topk_with_tail(t_logits, 24, 2.0))
kd_mask = torch.rand(b, t - 1, generator=g) > 0.2
labels = torch.randint(0, vocab + pad, (b, t - 1), generator=g).masked_fill(torch.rand(b, t - 1, generator=g) < 0.2,
                                                                              -100)
h, head, kd_mask, labels = h.to(device), head.to(device), kd_mask.to(device), labels.to(device)
teacher = tuple(x.to(device) for x in teacher)
for (kind, scale, cap), fused in zip((("kl", 1.0, None), ("jsd", 0.5, 3.0), ("skew_reverse_kl", 1.0, None),
                                      ("tvd", 1.0, None)), (None, (0.6, 0.4), (0.6, 0.4), None)):
    x = h.clone().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    kd, ce = sparse_head.sparse_kd_and_ce(x, chunked.LogitsHead(head, scale, cap), teacher, kd_mask, labels,
                                          chunked.dense_kd(kind, 2.0, 0.3, 0.2), 16, vocab=vocab, route="direct",
                                          fused=fused)  # fused: the gradient kernels on token chunks, in the forward
    (0.6 * kd + 0.4 * ce).backward()
    x64 = h.detach().double().requires_grad_(True)
    w64 = head.weight.detach().double().requires_grad_(True)
    b64 = head.bias.detach().double().requires_grad_(True)
    z = x64[:, :-1] @ w64.T + b64
    z = z * scale
    z = torch.tanh(z / cap) * cap if cap is not None else z
    t64 = tuple(v.double() if v.is_floating_point() else v for v in teacher)
    kd64 = losses.logit_kd_loss(kind, z[..., :vocab], t64, 2.0, mask=kd_mask, beta=0.3, alpha=0.2)
    ce64 = torch.nn.functional.cross_entropy(z.reshape(-1, vocab + pad), labels.reshape(-1), ignore_index=-100)
    (0.6 * kd64 + 0.4 * ce64).backward()
    assert abs(float(kd) - float(kd64)) <= 1e-5 * abs(float(kd64)) + 1e-7, (kind, float(kd), float(kd64))
    for got, want in ((x.grad, x64.grad), (head.weight.grad, w64.grad), (head.bias.grad, b64.grad)):
        assert float((got.double().cpu() - want.cpu()).norm() / want.norm()) < 1e-5, kind
assert len(calls) >= 8, calls

# ---- the dense head's fused mode through its kernels (triton_head), padded student vocabulary, against float64
calls.clear()
for name in ("row_stats", "grad_block"):
    kernel = getattr(triton_head, name)
    setattr(triton_head, name, lambda *a, _k=kernel, **kw: calls.append(1) or _k(*a, **kw))
t_head = torch.nn.Linear(hdim, vocab, bias=False).to(device)
with torch.no_grad():
    t_head.weight.copy_(head.weight[:vocab] + 0.2 * torch.randn(vocab, hdim, generator=g).to(device))
h_t = h + 0.1 * torch.randn(h.shape, generator=g).to(device)
for kind in ("jsd", "skew_kl"):
    x = h.clone().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    kd, ce = chunked.chunked_kd_and_ce(x, chunked.LogitsHead(head), chunked.LogitsHead(t_head), h_t, kd_mask, labels,
                                       chunked.dense_kd(kind, 2.0, 0.3, 0.2), 16, vocab, "direct", fused=(0.6, 0.4))
    (0.6 * kd + 0.4 * ce).backward()
    x64 = h.detach().double().requires_grad_(True)
    w64 = head.weight.detach().double().requires_grad_(True)
    b64 = head.bias.detach().double().requires_grad_(True)
    z = x64[:, :-1] @ w64.T + b64
    zt = h_t[:, :-1].double() @ t_head.weight.detach().double().T
    kd64 = losses.logit_kd_loss(kind, z[..., :vocab], zt, 2.0, mask=kd_mask, beta=0.3, alpha=0.2)
    ce64 = torch.nn.functional.cross_entropy(z.reshape(-1, vocab + pad), labels.reshape(-1), ignore_index=-100)
    (0.6 * kd64 + 0.4 * ce64).backward()
    for got, want in ((x.grad, x64.grad), (head.weight.grad, w64.grad), (head.bias.grad, b64.grad)):
        assert float((got.double().cpu() - want.cpu()).norm() / want.norm()) < 1e-5, kind
assert len(calls) >= 2 * 3 * 3, calls  # 3 chunks of 16: row statistics and two gradient blocks (padded columns) each
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["interpreter", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_sparse_head_triton_kernels_equal_the_reference_and_float64(tmp_path, where):
    """The sparse head's forward kernel (row statistics; its tail exact where the k ids hold all but e^-50 of the
    mass; k = vocabulary; the CE alone) and backward kernels (a block with ids inside, at its edges and outside; CE
    targets inside and outside; soft cap, scale, bf16 and float32 output) against sparse_head's PyTorch row math for
    every divergence, then the whole head through them (padded student vocabulary, bias, rows counted by one term
    only) against float64 whole logits, in both modes (kd_head_mode 'fused': the gradient kernels on token chunks in
    the forward), and the dense head's fused mode through its own kernels. `-k triton` in benchmarks/gpu_checks.sh
    runs the [cuda] case."""
    pytest.importorskip("triton")
    if where == "interpreter":
        _skip_unless_the_interpreter_runs(tmp_path)
    done = _run_script(tmp_path, "check_sparse.py", _CHECK, where == "interpreter",
                       "cpu" if where == "interpreter" else "cuda")
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
