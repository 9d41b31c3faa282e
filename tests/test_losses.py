"""hf_distill.losses against straightforward float64 loop references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hf_distill import losses as losses_module
from hf_distill.losses import (
    FEATURE_LOSSES,
    KD_LOSSES,
    attention_score_mse,
    cosine_loss,
    generalized_jsd,
    hidden_mse,
    kl_div,
    logit_kd_loss,
    logit_mse,
    pkd_loss,
    relation_kl,
    reverse_kl,
    soft_cross_entropy,
)
from hf_distill.losses import jsd as jsd_module

ATOL = RTOL = 1e-5
LENGTHS = [5, 1, 3]  # padded batch: a full row, a single real token, a partial row
B, T = len(LENGTHS), max(LENGTHS)


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * scale


def length_mask(lengths: list[int], length: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
    return (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).to(dtype)


def close(actual: torch.Tensor, expected: float | torch.Tensor) -> None:
    assert actual.dtype == torch.float32
    assert actual.dim() == 0
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.double(), expected, atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------------------------
# float64 references: explicit formulas, one item at a time


def _items(x: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Rows of the last dim at the real positions, as float64."""
    rows = x.double().reshape(-1, x.shape[-1])
    if mask is None:
        return list(rows)
    keep = mask.reshape(-1) != 0
    return [row for row, k in zip(rows, keep) if k]


def _softmax(x: torch.Tensor) -> torch.Tensor:
    e = torch.exp(x - x.max())
    return e / e.sum()


def _log_softmax(x: torch.Tensor) -> torch.Tensor:
    shifted = x - x.max()
    return shifted - math.log(torch.exp(shifted).sum().item())


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def ref_kl(s, t, temp, mask=None) -> float:
    out = []
    for srow, trow in zip(_items(s, mask), _items(t, mask)):
        p, log_p, log_q = _softmax(trow / temp), _log_softmax(trow / temp), _log_softmax(srow / temp)
        out.append(sum(p[c] * (log_p[c] - log_q[c]) for c in range(len(p))).item())
    return temp**2 * _mean(out)


def ref_soft_ce(s, t, temp, mask=None) -> float:
    out = []
    for srow, trow in zip(_items(s, mask), _items(t, mask)):
        p, log_q = _softmax(trow / temp), _log_softmax(srow / temp)
        out.append(-sum(p[c] * log_q[c] for c in range(len(p))).item())
    return _mean(out)


def ref_topk(s, values, indices, temp, kind, mask=None) -> float:
    out = []
    flat_idx = indices.reshape(-1, indices.shape[-1])
    keep = [True] * flat_idx.shape[0] if mask is None else list(mask.reshape(-1) != 0)
    srows = list(s.double().reshape(-1, s.shape[-1]))
    vrows = list(values.double().reshape(-1, values.shape[-1]))
    for srow, vrow, irow, k in zip(srows, vrows, flat_idx, keep):
        if not k:
            continue
        p, log_p = _softmax(vrow / temp), _log_softmax(vrow / temp)
        # the student renormalised over the same k ids: softmax of its gathered logits
        log_q = _log_softmax(torch.stack([srow[i] for i in irow.tolist()]) / temp)
        if kind == "kl":
            out.append((p * (log_p - log_q)).sum().item())
        else:
            out.append(-(p * log_q).sum().item())
    return (temp**2 if kind == "kl" else 1.0) * _mean(out)


def _ref_pairs(s, teacher, temp, mask=None):
    """(log P, log Q) in float64 per real item; a top-k teacher renormalises both sides over its k ids."""
    if isinstance(teacher, tuple):
        values, indices = teacher
        gathered = s.double().gather(-1, indices.long())
        return [
            (_log_softmax(v / temp), _log_softmax(g / temp))
            for v, g in zip(_items(values, mask), _items(gathered, mask))
        ]
    return [(_log_softmax(t / temp), _log_softmax(q / temp)) for t, q in zip(_items(teacher, mask), _items(s, mask))]


def _kl_rows(log_a, log_b) -> float:
    """KL(A || B) = sum_c a_c (log a_c - log b_c), class by class."""
    return sum(math.exp(log_a[c]) * (log_a[c] - log_b[c]) for c in range(len(log_a))).item()


def ref_reverse_kl(s, teacher, temp, mask=None) -> float:
    return temp**2 * _mean([_kl_rows(log_q, log_p) for log_p, log_q in _ref_pairs(s, teacher, temp, mask)])


def ref_jsd(s, teacher, beta, temp, mask=None) -> float:
    """Generalized JSD with the mixture built in probability space, class by class (no log-space tricks)."""
    out = []
    for log_p, log_q in _ref_pairs(s, teacher, temp, mask):
        if beta == 0:
            out.append(_kl_rows(log_p, log_q))
        elif beta == 1:
            out.append(_kl_rows(log_q, log_p))
        else:
            log_m = torch.log(beta * log_p.exp() + (1 - beta) * log_q.exp())
            out.append(beta * _kl_rows(log_p, log_m) + (1 - beta) * _kl_rows(log_q, log_m))
    return temp**2 * _mean(out)


def ref_sq_mean(s, t, mask=None) -> float:
    srows, trows = _items(s, mask), _items(t, mask)
    total = sum(((a - b) ** 2).sum().item() for a, b in zip(srows, trows))
    return total / (len(srows) * s.shape[-1]) if srows else 0.0


def ref_cosine(s, t, mask=None) -> float:
    out = []
    for a, b in zip(_items(s, mask), _items(t, mask)):
        out.append(1.0 - (a @ b).item() / (a.norm().item() * b.norm().item()))
    return _mean(out)


def ref_attention(s, t, mask=None) -> float:
    s, t = s.double(), t.double()
    bsz, heads, length, _ = s.shape
    real = torch.ones(bsz, length, dtype=torch.bool) if mask is None else mask != 0
    total, count = 0.0, 0
    for b in range(bsz):
        for h in range(heads):
            for i in range(length):
                for j in range(length):
                    if real[b, i] and real[b, j]:
                        total += (s[b, h, i, j] - t[b, h, i, j]).item() ** 2
                        count += 1
    return total / count if count else 0.0


def ref_relation(sa, sb, ta, tb, heads, mask=None) -> float:
    bsz, length = sa.shape[:2]
    real = torch.ones(bsz, length, dtype=torch.bool) if mask is None else mask != 0
    per_example = []
    for b in range(bsz):
        keys = [j for j in range(length) if real[b, j]]
        if not keys:
            continue
        per_query_head = []
        for h in range(heads):
            dists = []
            for a, bb in ((sa, sb), (ta, tb)):
                dh = a.shape[-1] // heads
                a_h = a[b, :, h * dh : (h + 1) * dh].double()
                b_h = bb[b, :, h * dh : (h + 1) * dh].double()
                dists.append(
                    {i: _softmax(torch.stack([a_h[i] @ b_h[j] for j in keys]) / math.sqrt(dh)) for i in keys}
                )
            q_dist, p_dist = dists
            for i in keys:
                p, q = p_dist[i], q_dist[i]
                per_query_head.append((p * (torch.log(p) - torch.log(q))).sum().item())
        per_example.append(_mean(per_query_head))
    return _mean(per_example)


def ref_pkd(s, t) -> float:
    out = []
    for a, b in zip(s.double(), t.double()):
        out.append(((a / a.norm() - b / b.norm()) ** 2).sum().item())
    return _mean(out)


# ------------------------------------------------------------------------------------------------
# logit losses


@pytest.mark.parametrize("temp", [1.0, 2.0, 4.0])
@pytest.mark.parametrize("fn,ref", [(kl_div, ref_kl), (soft_cross_entropy, ref_soft_ce)])
def test_softmax_losses_match_reference(fn, ref, temp):
    # (B, C) rows
    s, t = randn(4, 7, seed=0, scale=3), randn(4, 7, seed=1, scale=3)
    close(fn(s, t, temp), ref(s, t, temp))
    row_mask = torch.tensor([1, 0, 1, 1])
    close(fn(s, t, temp, row_mask), ref(s, t, temp, row_mask))
    # (B, T, C) token-level with and without a padded mask
    s, t = randn(B, T, 6, seed=2, scale=3), randn(B, T, 6, seed=3, scale=3)
    mask = length_mask(LENGTHS, T)
    close(fn(s, t, temp), ref(s, t, temp))
    close(fn(s, t, temp, mask), ref(s, t, temp, mask))


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int32, torch.long, torch.float32])
def test_mask_dtypes_agree(mask_dtype):
    s, t = randn(B, T, 6, seed=4), randn(B, T, 6, seed=5)
    mask = length_mask(LENGTHS, T, mask_dtype)
    close(kl_div(s, t, 2.0, mask), ref_kl(s, t, 2.0, mask))
    close(hidden_mse(s, t, mask), ref_sq_mean(s, t, mask))


def test_logit_mse_matches_reference():
    s, t = randn(4, 7, seed=6), randn(4, 7, seed=7)
    close(logit_mse(s, t), ref_sq_mean(s, t))
    s, t = randn(B, T, 6, seed=8), randn(B, T, 6, seed=9)
    mask = length_mask(LENGTHS, T)
    close(logit_mse(s, t), ref_sq_mean(s, t))
    close(logit_mse(s, t, mask), ref_sq_mean(s, t, mask))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_computed_in_float32(dtype):
    mask = length_mask(LENGTHS, T)
    s, t = randn(B, T, 6, seed=10, scale=4).to(dtype), randn(B, T, 6, seed=11, scale=4).to(dtype)
    close(kl_div(s, t, 2.0, mask), ref_kl(s, t, 2.0, mask))
    close(soft_cross_entropy(s, t, 2.0, mask), ref_soft_ce(s, t, 2.0, mask))
    close(reverse_kl(s, t, 2.0, mask), ref_reverse_kl(s, t, 2.0, mask))
    close(generalized_jsd(s, t, 0.3, 2.0, mask), ref_jsd(s, t, 0.3, 2.0, mask))
    sparse = tuple(t.topk(3, dim=-1))
    close(generalized_jsd(s, sparse, 0.3, 2.0, mask), ref_jsd(s, sparse, 0.3, 2.0, mask))
    close(logit_mse(s, t, mask), ref_sq_mean(s, t, mask))
    close(hidden_mse(s, t, mask), ref_sq_mean(s, t, mask))
    close(cosine_loss(s, t, mask), ref_cosine(s, t, mask))
    scores_s, scores_t = randn(B, 2, T, T, seed=12).to(dtype), randn(B, 2, T, T, seed=13).to(dtype)
    close(attention_score_mse(scores_s, scores_t, mask), ref_attention(scores_s, scores_t, mask))
    sa, sb = randn(B, T, 8, seed=14).to(dtype), randn(B, T, 8, seed=15).to(dtype)
    ta, tb = randn(B, T, 16, seed=16).to(dtype), randn(B, T, 16, seed=17).to(dtype)
    close(relation_kl(sa, sb, ta, tb, 2, mask), ref_relation(sa, sb, ta, tb, 2, mask))
    close(pkd_loss(sa[:, 0], tb[:, 0, :8]), ref_pkd(sa[:, 0], tb[:, 0, :8]))


def test_mixed_student_teacher_dtypes():
    s, t = randn(3, 5, seed=18).to(torch.bfloat16), randn(3, 5, seed=19)
    close(kl_div(s, t, 2.0), ref_kl(s, t, 2.0))


# ------------------------------------------------------------------------------------------------
# reverse KL and generalized JSD (causal-LM objectives, GKD)

BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


@pytest.mark.parametrize("temp", [1.0, 2.0, 4.0])
@pytest.mark.parametrize("beta", BETAS)
def test_reverse_kl_and_jsd_match_reference(beta, temp):
    s, t = randn(4, 7, seed=120, scale=3), randn(4, 7, seed=121, scale=3)
    row_mask = torch.tensor([1, 0, 1, 1])
    close(reverse_kl(s, t, temp), ref_reverse_kl(s, t, temp))
    close(generalized_jsd(s, t, beta, temp), ref_jsd(s, t, beta, temp))
    close(generalized_jsd(s, t, beta, temp, row_mask), ref_jsd(s, t, beta, temp, row_mask))
    s, t = randn(B, T, 6, seed=122, scale=3), randn(B, T, 6, seed=123, scale=3)
    mask = length_mask(LENGTHS, T)
    for m in (None, mask):
        close(reverse_kl(s, t, temp, m), ref_reverse_kl(s, t, temp, m))
        close(generalized_jsd(s, t, beta, temp, m), ref_jsd(s, t, beta, temp, m))
        close(logit_kd_loss("jsd", s, t, temp, m, beta=beta), ref_jsd(s, t, beta, temp, m))
    close(logit_kd_loss("reverse_kl", s, t, temp, mask), ref_reverse_kl(s, t, temp, mask))


@pytest.mark.parametrize("beta", BETAS)
def test_reverse_kl_and_jsd_topk_match_reference(beta):
    s, t = randn(B, T, 9, seed=124, scale=3), randn(B, T, 9, seed=125, scale=3)
    mask = length_mask(LENGTHS, T)
    sparse = t.topk(3, dim=-1)
    sparse = (sparse.values, sparse.indices)
    for m in (None, mask):
        close(reverse_kl(s, sparse, 2.0, m), ref_reverse_kl(s, sparse, 2.0, m))
        close(generalized_jsd(s, sparse, beta, 2.0, m), ref_jsd(s, sparse, beta, 2.0, m))
    # k = C: the sparse teacher is the dense one
    full = t.topk(9, dim=-1)
    torch.testing.assert_close(
        generalized_jsd(s, (full.values, full.indices), beta, 2.0, mask), generalized_jsd(s, t, beta, 2.0, mask)
    )


def test_jsd_endpoints_are_exactly_forward_and_reverse_kl():
    s, t = randn(B, T, 6, seed=126, scale=3), randn(B, T, 6, seed=127, scale=3)
    mask = length_mask(LENGTHS, T)
    sparse = tuple(t.topk(3, dim=-1))
    for teacher in (t, sparse):
        assert torch.equal(generalized_jsd(s, teacher, 0.0, 2.0, mask), kl_div(s, teacher, 2.0, mask))
        assert torch.equal(generalized_jsd(s, teacher, 1.0, 2.0, mask), reverse_kl(s, teacher, 2.0, mask))
        assert torch.equal(logit_kd_loss("jsd", s, teacher, 2.0, mask, beta=0), kl_div(s, teacher, 2.0, mask))


def _autograd_jsd64(s, teacher, beta, temp, mask):
    """The GKD loss by plain float64 autograd: log-mixture by logaddexp, masked mean over items."""
    s = s.double()
    if isinstance(teacher, tuple):
        values, indices = teacher
        log_p = torch.log_softmax(values.double() / temp, -1)
        log_q = torch.log_softmax(s.gather(-1, indices.long()) / temp, -1)
    else:
        log_p, log_q = torch.log_softmax(teacher.double() / temp, -1), torch.log_softmax(s / temp, -1)
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    per_item = beta * (log_p.exp() * (log_p - log_m)).sum(-1) + (1 - beta) * (log_q.exp() * (log_q - log_m)).sum(-1)
    real = torch.ones_like(per_item) if mask is None else mask.double()
    return temp**2 * (per_item * real).sum() / real.sum()


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("sparse", [False, True])
def test_jsd_closed_form_gradient_matches_float64_autograd(beta, sparse):
    """generalized_jsd has a hand-written backward: it must be the gradient of the loss it computes."""
    s, t = randn(B, T, 9, seed=140, scale=3), randn(B, T, 9, seed=141, scale=3)
    mask = length_mask(LENGTHS, T)
    teacher = tuple(t.topk(4, dim=-1)) if sparse else t
    for m in (None, mask):
        s32 = s.clone().requires_grad_(True)
        (got,) = torch.autograd.grad(generalized_jsd(s32, teacher, beta, 2.0, m), s32)
        s64 = s.double().requires_grad_(True)
        (want,) = torch.autograd.grad(_autograd_jsd64(s64, teacher, beta, 2.0, m), s64)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    # the teacher side too, for a teacher whose logits carry a gradient (e.g. a trained assistant)
    t32, s_fixed = t.clone().requires_grad_(True), s.clone()
    (got,) = torch.autograd.grad(generalized_jsd(s_fixed, t32, beta, 2.0, mask), t32)
    t64 = t.double().requires_grad_(True)
    (want,) = torch.autograd.grad(_autograd_jsd64(s_fixed, t64, beta, 2.0, mask), t64)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [1.3473632366886775e-140, 1e-300, 1e-45])
def test_jsd_with_beta_below_float32_range_is_finite(beta):
    """Found by hypothesis: beta = 1.35e-140 is 0 in float32, and exp(-800) too: log(0 + 0) was -inf, times 0."""
    s, t = randn(2, 3, 5, seed=144, scale=400), randn(2, 3, 5, seed=145, scale=400)
    s.requires_grad_(True)
    loss = generalized_jsd(s, t, beta, 0.5)
    (grad,) = torch.autograd.grad(loss, s)
    assert torch.isfinite(loss) and loss >= 0 and torch.isfinite(grad).all()
    assert generalized_jsd(t.clone(), t, beta, 0.5).item() == 0.0


@pytest.mark.parametrize("beta", [1e-3, 0.3, 0.5, 0.7, 1 - 1e-3])
def test_jsd_fast_path_equals_the_guarded_path(monkeypatch, beta):
    """Blocks whose log-ratios are finite and in range take the short expm1/log1p formula; the others the
    guarded one (_log_mixture_terms). Forcing every block onto the guarded one changes nothing."""
    s, t = randn(3, 5, 11, seed=146, scale=6), randn(3, 5, 11, seed=147, scale=6)
    results = []
    for fast_range in (80.0, -1.0):  # -1: no block qualifies for the fast path
        monkeypatch.setattr(jsd_module, "_JSD_FAST_RANGE", fast_range)
        x, y = s.clone().requires_grad_(True), t.clone().requires_grad_(True)
        loss = generalized_jsd(x, y, beta, 2.0)
        results.append((loss, *torch.autograd.grad(loss, (x, y))))
    for fast, guarded in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(fast, guarded, rtol=1e-5, atol=1e-7)
    want = _autograd_jsd64(s.double(), t.double(), beta, 2.0, None)
    torch.testing.assert_close(results[0][0].double(), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("beta", [0.2, 0.8])
def test_jsd_classes_with_zero_mass_mix_with_fast_blocks(monkeypatch, beta):
    """A class with -inf logits (zero mass on one side) sends its block to the guarded formula while the
    other blocks stay fast: value and gradient still match float64 autograd on the finite classes."""
    monkeypatch.setattr(jsd_module, "_JSD_BLOCK", 11)  # one row per block
    s, t = randn(2, 3, 11, seed=148, scale=3), randn(2, 3, 11, seed=149, scale=3)
    t[0, 1, 4] = float("-inf")  # the teacher gives class 4 no mass in one row
    s[1, 2, 7] = float("-inf")  # the student gives class 7 no mass in another
    x = s.clone().requires_grad_(True)
    loss = generalized_jsd(x, t, beta, 1.0)
    (grad,) = torch.autograd.grad(loss, x)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    # float64 reference with -1e4 for -inf: exp underflows to exactly 0 and every log stays finite
    x64 = s.double().nan_to_num(neginf=-1e4).requires_grad_(True)
    want = _autograd_jsd64(x64, t.double().nan_to_num(neginf=-1e4), beta, 1.0, None)
    (want_grad,) = torch.autograd.grad(want, x64)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-5, atol=1e-6)


def test_jsd_row_blocks_do_not_change_value_or_gradient(monkeypatch):
    """The loss walks rows in cache-sized blocks; any block size gives the same numbers."""
    s, t = randn(3, 5, 11, seed=142, scale=3), randn(3, 5, 11, seed=143, scale=3)
    mask = length_mask([5, 2, 4], 5)
    results = []
    for block in (1 << 18, 11, 30, 1):  # all rows at once, one row, 2 rows + a short last block, 1 element
        monkeypatch.setattr(jsd_module, "_JSD_BLOCK", block)
        x = s.clone().requires_grad_(True)
        loss = generalized_jsd(x, t, 0.3, 2.0, mask)
        (grad,) = torch.autograd.grad(loss, x)
        results.append((loss, grad))
    for loss, grad in results[1:]:
        torch.testing.assert_close(loss, results[0][0])
        torch.testing.assert_close(grad, results[0][1])


def test_jsd_default_beta_is_one_half_and_symmetric():
    s, t = randn(B, T, 6, seed=128, scale=3), randn(B, T, 6, seed=129, scale=3)
    mask = length_mask(LENGTHS, T)
    close(generalized_jsd(s, t, temperature=2.0, mask=mask), ref_jsd(s, t, 0.5, 2.0, mask))
    torch.testing.assert_close(generalized_jsd(s, t, 0.5, 2.0, mask), generalized_jsd(t, s, 0.5, 2.0, mask))
    torch.testing.assert_close(logit_kd_loss("jsd", s, t, 2.0, mask), generalized_jsd(s, t, 0.5, 2.0, mask))


@pytest.mark.parametrize("beta", [-0.1, 1.5, float("nan"), float("inf"), True, "half", None])
def test_bad_beta(beta):
    s = torch.zeros(2, 5)
    with pytest.raises(ValueError, match=r"beta \(jsd_beta\) must be a number in \[0, 1\]"):
        generalized_jsd(s, s, beta)
    with pytest.raises(ValueError, match=r"beta \(jsd_beta\) must be a number in \[0, 1\]"):
        logit_kd_loss("jsd", s, s, 1.0, beta=beta)
    with pytest.raises(ValueError, match=r"beta \(jsd_beta\) must be a number in \[0, 1\]"):
        logit_kd_loss("kl", s, s, 1.0, beta=beta)  # a bad config fails whichever kind it selects


# ------------------------------------------------------------------------------------------------
# sparse (top-k) teacher


@pytest.mark.parametrize("fn", [kl_div, soft_cross_entropy])
def test_topk_with_all_classes_equals_dense(fn):
    s, t = randn(B, T, 9, seed=20, scale=3), randn(B, T, 9, seed=21, scale=3)
    mask = length_mask(LENGTHS, T)
    values, indices = t.topk(9, dim=-1)
    for m in (None, mask):
        torch.testing.assert_close(fn(s, (values, indices), 3.0, m), fn(s, t, 3.0, m), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kind,fn", [("kl", kl_div), ("soft_ce", soft_cross_entropy)])
def test_topk_subset_matches_reference(kind, fn):
    s, t = randn(B, T, 9, seed=22, scale=3), randn(B, T, 9, seed=23, scale=3)
    mask = length_mask(LENGTHS, T)
    values, indices = t.topk(3, dim=-1)
    for m in (None, mask):
        close(fn(s, (values, indices), 2.0, m), ref_topk(s, values, indices, 2.0, kind, m))
    # also via the dispatcher, with bf16 values and int32 indices
    v16 = values.to(torch.bfloat16)
    close(logit_kd_loss(kind, s, (v16, indices.int()), 2.0, mask), ref_topk(s, v16, indices, 2.0, kind, mask))


DIVERGENCES = {
    "kl_div": kl_div,
    "reverse_kl": reverse_kl,
    "jsd_0.5": lambda s, t, temp, m=None: generalized_jsd(s, t, 0.5, temp, m),
    "jsd_0.1": lambda s, t, temp, m=None: generalized_jsd(s, t, 0.1, temp, m),
    "jsd_0.9": lambda s, t, temp, m=None: generalized_jsd(s, t, 0.9, temp, m),
}


@pytest.mark.parametrize("temp", [1.0, 2.0, 4.0, 8.0])
@pytest.mark.parametrize("name", list(DIVERGENCES))
def test_topk_divergence_is_zero_when_student_equals_teacher(name, temp):
    """A vocabulary-sized teacher cached as its top-20: a student with the teacher's logits scores 0 at every T."""
    vocab, k = 1000, 20
    t = randn(B, T, vocab, seed=100)
    values, indices = t.topk(k, dim=-1)
    for m in (None, length_mask(LENGTHS, T)):
        loss = DIVERGENCES[name](t.clone(), (values, indices), temp, m)
        assert loss.dtype == torch.float32
        assert abs(loss.item()) < 1e-6, (name, temp, loss.item())
        dense = DIVERGENCES[name](t.clone(), t, temp, m)
        assert abs(dense.item()) < 1e-6, (name, temp, dense.item())


@pytest.mark.parametrize("temp", [1.0, 2.0, 4.0, 8.0])
def test_topk_soft_cross_entropy_is_teacher_entropy_on_support_at_agreement(temp):
    vocab, k = 1000, 20
    t = randn(B, T, vocab, seed=101)
    values, indices = t.topk(k, dim=-1)
    mask = length_mask(LENGTHS, T)
    log_p = torch.log_softmax(values.double() / temp, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    close(soft_cross_entropy(t.clone(), (values, indices), temp), entropy.mean())
    close(soft_cross_entropy(t.clone(), (values, indices), temp, mask), entropy[mask != 0].mean())


@pytest.mark.parametrize("fn", [kl_div, soft_cross_entropy, *DIVERGENCES.values()])
def test_topk_gradient_reaches_only_the_gathered_student_logits(fn):
    vocab, k = 50, 4
    s, t = randn(B, T, vocab, seed=102, scale=2), randn(B, T, vocab, seed=103, scale=2)
    values, indices = t.topk(k, dim=-1)
    mask = length_mask(LENGTHS, T)
    s.requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(s, (values, indices), 2.0, mask), s)
    support = torch.zeros(B, T, vocab, dtype=torch.bool).scatter_(-1, indices, True) & (mask != 0)[..., None]
    assert (grad[~support] == 0).all()
    assert (grad.abs().sum(-1)[mask != 0] > 0).all()


def test_topk_padding_may_hold_garbage_indices():
    s, t = randn(2, 4, 9, seed=24), randn(2, 4, 9, seed=25)
    mask = length_mask([4, 2], 4)
    values, indices = t.topk(3, dim=-1)
    bad_values, bad_indices = values.clone(), indices.clone()
    bad_values[1, 2:] = float("nan")
    bad_indices[1, 2:] = 10_000  # out of range, but padding
    for fn in (kl_div, soft_cross_entropy, *DIVERGENCES.values()):
        torch.testing.assert_close(fn(s, (bad_values, bad_indices), 1.0, mask), fn(s, (values, indices), 1.0, mask))


def test_topk_validation():
    s, t = randn(2, 9, seed=26), randn(2, 9, seed=27)
    values, indices = t.topk(3, dim=-1)
    with pytest.raises(ValueError, match="integer"):
        kl_div(s, (values, indices.float()))
    with pytest.raises(ValueError, match="indices"):
        kl_div(s, (values, indices[:, :2]))
    with pytest.raises(ValueError, match="dense"):
        logit_mse(s, (values, indices))


# ------------------------------------------------------------------------------------------------
# feature losses


def test_hidden_mse_matches_reference_and_mse_loss():
    s, t = randn(B, T, 8, seed=30), randn(B, T, 8, seed=31)
    mask = length_mask(LENGTHS, T)
    torch.testing.assert_close(hidden_mse(s, t), F.mse_loss(s, t), atol=1e-7, rtol=1e-6)
    close(hidden_mse(s, t), ref_sq_mean(s, t))
    close(hidden_mse(s, t, mask), ref_sq_mean(s, t, mask))


def test_cosine_loss_matches_reference():
    s, t = randn(B, T, 8, seed=32), randn(B, T, 8, seed=33)
    mask = length_mask(LENGTHS, T)
    close(cosine_loss(s, t), ref_cosine(s, t))
    close(cosine_loss(s, t, mask), ref_cosine(s, t, mask))


def test_attention_score_mse_matches_reference():
    s, t = randn(B, 2, T, T, seed=34, scale=2), randn(B, 2, T, T, seed=35, scale=2)
    mask = length_mask(LENGTHS, T)
    close(attention_score_mse(s, t), ref_attention(s, t))
    close(attention_score_mse(s, t, mask), ref_attention(s, t, mask))


@pytest.mark.parametrize("garbage", [1e4, float("inf"), float("nan")])
def test_attention_score_mse_invariant_to_extra_padding(garbage):
    s, t = randn(B, 2, T, T, seed=36), randn(B, 2, T, T, seed=37)
    mask = length_mask(LENGTHS, T)
    extra = 3
    big_s = torch.full((B, 2, T + extra, T + extra), garbage)
    big_t = randn(B, 2, T + extra, T + extra, seed=38, scale=1e3)
    big_s[:, :, :T, :T], big_t[:, :, :T, :T] = s, t
    big_mask = length_mask(LENGTHS, T + extra)
    big_s.requires_grad_(True)
    loss = attention_score_mse(big_s, big_t, big_mask)
    torch.testing.assert_close(loss, attention_score_mse(s, t, mask), atol=1e-7, rtol=1e-6)
    loss.backward()
    assert torch.isfinite(big_s.grad).all()


def test_relation_kl_different_hidden_sizes():
    # student D=32 with 4 heads (d_h=8), teacher D=64 with 4 heads (d_h=16)
    sa, sb = randn(B, T, 32, seed=40), randn(B, T, 32, seed=41)
    ta, tb = randn(B, T, 64, seed=42), randn(B, T, 64, seed=43)
    mask = length_mask(LENGTHS, T)
    close(relation_kl(sa, sb, ta, tb, 4), ref_relation(sa, sb, ta, tb, 4))
    close(relation_kl(sa, sb, ta, tb, 4, mask), ref_relation(sa, sb, ta, tb, 4, mask))
    # value relation (V, V) and a fully padded example in the batch
    mask_with_empty = length_mask([5, 0, 2], T)
    close(relation_kl(sa, sa, ta, ta, 4, mask_with_empty), ref_relation(sa, sa, ta, ta, 4, mask_with_empty))


def test_relation_kl_zero_for_identical_relations():
    a, b = randn(2, 4, 16, seed=44), randn(2, 4, 16, seed=45)
    close(relation_kl(a, b, a, b, 4), 0.0)


def test_pkd_loss_matches_reference():
    s, t = randn(4, 16, seed=46, scale=3), randn(4, 16, seed=47)
    close(pkd_loss(s, t), ref_pkd(s, t))
    close(pkd_loss(s, s * 7.0), 0.0)  # scale invariant


# ------------------------------------------------------------------------------------------------
# gradients, masking edge cases, registries


def _all_losses(s_grad: bool = True):
    """(name, loss_fn(student_tensors...), student tensors, teacher tensors) with a padded mask."""
    mask = length_mask(LENGTHS, T)
    lin = torch.nn.Linear(6, 6)
    with torch.no_grad():  # teacher outputs built the way a Trainer builds them
        t_logits = lin(randn(B, T, 6, seed=50))
        t_hidden = randn(B, T, 8, seed=51)
        t_scores = randn(B, 2, T, T, seed=52)
        t_rel = (randn(B, T, 16, seed=53), randn(B, T, 16, seed=54))
        t_cls = randn(B, 8, seed=55)
        t_topk = t_logits.topk(3, dim=-1)
    return [
        ("kl", lambda s: kl_div(s, t_logits, 2.0, mask), randn(B, T, 6, seed=56), t_logits),
        ("kl_topk", lambda s: kl_div(s, tuple(t_topk), 2.0, mask), randn(B, T, 6, seed=57), t_topk[0]),
        ("soft_ce", lambda s: soft_cross_entropy(s, t_logits, 2.0, mask), randn(B, T, 6, seed=58), t_logits),
        ("reverse_kl", lambda s: reverse_kl(s, t_logits, 2.0, mask), randn(B, T, 6, seed=65), t_logits),
        ("jsd", lambda s: generalized_jsd(s, t_logits, 0.3, 2.0, mask), randn(B, T, 6, seed=66), t_logits),
        (
            "jsd_topk",
            lambda s: generalized_jsd(s, tuple(t_topk), 0.3, 2.0, mask),
            randn(B, T, 6, seed=67),
            t_topk[0],
        ),
        ("mse", lambda s: logit_mse(s, t_logits, mask), randn(B, T, 6, seed=59), t_logits),
        ("hidden_mse", lambda s: hidden_mse(s, t_hidden, mask), randn(B, T, 8, seed=60), t_hidden),
        ("cosine", lambda s: cosine_loss(s, t_hidden, mask), randn(B, T, 8, seed=61), t_hidden),
        ("attn", lambda s: attention_score_mse(s, t_scores, mask), randn(B, 2, T, T, seed=62), t_scores),
        ("relation", lambda s: relation_kl(s, s, *t_rel, 2, mask), randn(B, T, 8, seed=63), t_rel[0]),
        ("pkd", lambda s: pkd_loss(s, t_cls), randn(B, 8, seed=64), t_cls),
    ]


@pytest.mark.parametrize("case", _all_losses(), ids=lambda c: c[0])
def test_gradient_reaches_student_only(case):
    _, loss_fn, student, teacher = case
    student = student.clone().requires_grad_(True)
    loss = loss_fn(student)
    assert loss.dtype == torch.float32 and loss.dim() == 0 and loss.requires_grad
    loss.backward()
    assert student.grad is not None and torch.isfinite(student.grad).all()
    assert student.grad.abs().sum() > 0
    assert not teacher.requires_grad and teacher.grad is None


def test_fully_masked_gives_zero_not_nan():
    s = randn(2, 4, 6, seed=70).requires_grad_(True)
    t = randn(2, 4, 6, seed=71)
    empty = torch.zeros(2, 4)
    losses = [
        kl_div(s, t, 2.0, empty),
        kl_div(s, t.topk(2, dim=-1), 2.0, empty),
        soft_cross_entropy(s, t, 2.0, empty),
        reverse_kl(s, t, 2.0, empty),
        generalized_jsd(s, t, 0.3, 2.0, empty),
        generalized_jsd(s, t.topk(2, dim=-1), 0.3, 2.0, empty),
        logit_mse(s, t, empty),
        hidden_mse(s, t, empty),
        cosine_loss(s, t, empty),
        attention_score_mse(s[:, None, :, :4], t[:, None, :, :4], empty),
        relation_kl(s, s, t, t, 2, empty),
    ]
    for loss in losses:
        assert loss.item() == 0.0
        (grad,) = torch.autograd.grad(loss, s)
        assert torch.isfinite(grad).all()


def test_padding_content_does_not_matter():
    s, t = randn(B, T, 6, seed=72), randn(B, T, 6, seed=73)
    mask = length_mask(LENGTHS, T)
    bad_s, bad_t = s.clone(), t.clone()
    pad = mask == 0
    bad_s[pad], bad_t[pad] = float("nan"), float("inf")
    bad_s.requires_grad_(True)
    for fn in (
        lambda a, b, m: kl_div(a, b, 2.0, m),
        lambda a, b, m: reverse_kl(a, b, 2.0, m),
        lambda a, b, m: generalized_jsd(a, b, 0.3, 2.0, m),
        logit_mse,
        hidden_mse,
        cosine_loss,
    ):
        loss = fn(bad_s, bad_t, mask)
        torch.testing.assert_close(loss, fn(s, t, mask))
        (grad,) = torch.autograd.grad(loss, bad_s)
        assert torch.isfinite(grad).all() and (grad[pad] == 0).all()


def test_extreme_logits_float32():
    s, t = randn(B, T, 6, seed=74, scale=1e4), randn(B, T, 6, seed=75, scale=1e4)
    s.requires_grad_(True)
    mask = length_mask(LENGTHS, T)
    losses = (
        kl_div(s, t, 1.0, mask),
        soft_cross_entropy(s, t, 1.0, mask),
        reverse_kl(s, t, 1.0, mask),
        generalized_jsd(s, t, 0.5, 1.0, mask),
        generalized_jsd(s, t, 1e-3, 1.0, mask),
        generalized_jsd(s, t, 1 - 1e-9, 1.0, mask),
        logit_mse(s, t, mask),
    )
    for loss in losses:
        assert torch.isfinite(loss)
        (grad,) = torch.autograd.grad(loss, s)
        assert torch.isfinite(grad).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("temp", [1.0, 2.0, 5.0, 10.0, 20.0])
def test_mixed_precision_stability(dtype, temp):
    def extreme(*shape: int, seed: int) -> torch.Tensor:
        x = randn(*shape, seed=seed)
        return (x / x.abs().max() * 60.0).to(dtype)

    mask = length_mask(LENGTHS, T)
    logits_t = extreme(B, T, 6, seed=80)
    checks = [
        (lambda s, k=k: logit_kd_loss(k, s, logits_t, temp, mask), extreme(B, T, 6, seed=81))
        for k in KD_LOSSES
    ]
    checks.append((lambda s: kl_div(s, logits_t.topk(3, dim=-1), temp, mask), extreme(B, T, 6, seed=82)))
    checks.append(
        (lambda s: generalized_jsd(s, logits_t.topk(3, dim=-1), 0.5, temp, mask), extreme(B, T, 6, seed=79))
    )
    hidden_t = extreme(B, T, 8, seed=83)
    checks += [
        (lambda s: hidden_mse(s, hidden_t, mask), extreme(B, T, 8, seed=84)),
        (lambda s: cosine_loss(s, hidden_t, mask), extreme(B, T, 8, seed=85)),
        (lambda s: attention_score_mse(s, extreme(B, 2, T, T, seed=86), mask), extreme(B, 2, T, T, seed=87)),
        (lambda s: relation_kl(s, s, hidden_t, hidden_t, 2, mask), extreme(B, T, 8, seed=88)),
        (lambda s: pkd_loss(s, hidden_t[:, 0]), extreme(B, 8, seed=89)),
    ]
    for loss_fn, student in checks:
        student.requires_grad_(True)
        loss = loss_fn(student)
        assert loss.dtype == torch.float32 and torch.isfinite(loss)
        (grad,) = torch.autograd.grad(loss, student)
        assert torch.isfinite(grad).all()


def test_logit_kd_loss_dispatch():
    s, t = randn(B, T, 6, seed=90), randn(B, T, 6, seed=91)
    mask = length_mask(LENGTHS, T)
    assert KD_LOSSES == {
        "kl": kl_div,
        "soft_ce": soft_cross_entropy,
        "mse": logit_mse,
        "reverse_kl": reverse_kl,
        "jsd": generalized_jsd,
        "skew_kl": losses_module.skew_kl,
        "skew_reverse_kl": losses_module.skew_reverse_kl,
        "tvd": losses_module.total_variation,
    }
    torch.testing.assert_close(logit_kd_loss("kl", s, t, 3.0, mask), kl_div(s, t, 3.0, mask))
    torch.testing.assert_close(logit_kd_loss("skew_kl", s, t, 3.0, mask, alpha=0.3),
                               losses_module.skew_kl(s, t, 0.3, 3.0, mask))
    torch.testing.assert_close(logit_kd_loss("tvd", s, t, 3.0, mask), losses_module.total_variation(s, t, 3.0, mask))
    torch.testing.assert_close(logit_kd_loss("soft_ce", s, t, 3.0, mask), soft_cross_entropy(s, t, 3.0, mask))
    # mse ignores the temperature
    torch.testing.assert_close(logit_kd_loss("mse", s, t, 3.0, mask), logit_mse(s, t, mask))
    torch.testing.assert_close(logit_kd_loss("mse", s, t, 1.0, mask), logit_kd_loss("mse", s, t, 7.0, mask))


def test_feature_registry():
    assert FEATURE_LOSSES == {
        "hidden_mse": hidden_mse,
        "cosine_loss": cosine_loss,
        "attention_score_mse": attention_score_mse,
        "relation_kl": relation_kl,
        "pkd_loss": pkd_loss,
    }


# ------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "call",
    [
        lambda: kl_div(torch.zeros(2, 5), torch.zeros(2, 6)),
        lambda: soft_cross_entropy(torch.zeros(2, 5), torch.zeros(2, 6)),
        lambda: reverse_kl(torch.zeros(2, 5), torch.zeros(2, 6)),
        lambda: generalized_jsd(torch.zeros(2, 5), torch.zeros(2, 6)),
        lambda: logit_mse(torch.zeros(2, 5), torch.zeros(2, 6)),
        lambda: hidden_mse(torch.zeros(2, 5), torch.zeros(2, 6)),
        lambda: cosine_loss(torch.zeros(2, 5), torch.zeros(2, 6)),
        lambda: attention_score_mse(torch.zeros(2, 5), torch.zeros(2, 6)),
        lambda: pkd_loss(torch.zeros(2, 5), torch.zeros(2, 6)),
    ],
)
def test_shape_mismatch_names_shapes_and_projection(call):
    with pytest.raises(ValueError, match=r"\(2, 5\).*\(2, 6\).*add a projection"):
        call()


def test_relation_kl_bad_num_heads():
    s, t = torch.zeros(2, 3, 32), torch.zeros(2, 3, 48)
    with pytest.raises(ValueError, match="num_heads=5 does not divide the student hidden size 32"):
        relation_kl(s, s, t, t, 5)
    with pytest.raises(ValueError, match="num_heads=32 does not divide the teacher hidden size 48"):
        relation_kl(s, s, t, t, 32)
    with pytest.raises(ValueError, match="num_heads"):
        relation_kl(s, s, t, t, 0)
    with pytest.raises(ValueError, match=r"same \(B, T\)"):
        relation_kl(s, s, t[:, :2], t[:, :2], 4)


@pytest.mark.parametrize("temp", [0.0, -1.0, float("nan"), float("inf")])
@pytest.mark.parametrize("kind", ["kl", "soft_ce", "mse", "reverse_kl", "jsd"])
def test_bad_temperature(temp, kind):
    s = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="temperature"):
        logit_kd_loss(kind, s, s, temp)
    if kind != "mse":
        with pytest.raises(ValueError, match="temperature"):
            KD_LOSSES[kind](s, s, temperature=temp)


def test_unknown_kind_lists_known_kinds():
    with pytest.raises(ValueError, match=r"unknown logit KD kind 'cos'.*jsd.*kl.*mse.*reverse_kl.*soft_ce"):
        logit_kd_loss("cos", torch.zeros(2, 5), torch.zeros(2, 5), 1.0)


def test_bad_mask_shape():
    with pytest.raises(ValueError, match="mask shape"):
        kl_div(torch.zeros(2, 3, 5), torch.zeros(2, 3, 5), 1.0, torch.ones(2, 4))


# ---------------------------------------------------------------- the divergence family (issue #29)

def _ref_divergence(kind, p, q, alpha=0.1):
    """Float64 definitions in probability space, written from the papers (not from hf_distill's log-space code)."""
    p, q = p.double(), q.double()
    if kind == "skew_kl":  # DistiLLM: KL(P || alpha P + (1 - alpha) Q)
        r = alpha * p + (1 - alpha) * q
        return (p * (p / r).log()).nansum(-1)
    if kind == "skew_reverse_kl":  # KL(Q || (1 - alpha) P + alpha Q)
        r = (1 - alpha) * p + alpha * q
        return (q * (q / r).log()).nansum(-1)
    if kind == "tvd":
        return 0.5 * (p - q).abs().sum(-1)
    raise AssertionError(kind)


NEW_KINDS = {"skew_kl": losses_module.skew_kl, "skew_reverse_kl": losses_module.skew_reverse_kl,
             "tvd": losses_module.total_variation}


@pytest.mark.parametrize("kind", sorted(NEW_KINDS))
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_new_divergences_match_float64_definitions_with_gradients(kind, temperature):
    g = torch.Generator().manual_seed(3)
    s = (torch.randn(6, 5, 40, generator=g) * 3).requires_grad_(True)
    t = torch.randn(6, 5, 40, generator=g) * 3
    mask = torch.ones(6, 5)
    mask[2, 3:] = 0
    kw = {"alpha": 0.2} if kind != "tvd" else {}
    got = NEW_KINDS[kind](s, t, temperature=temperature, mask=mask, **kw)
    s64 = s.detach().double().requires_grad_(True)
    per = _ref_divergence(kind, torch.softmax(t.double() / temperature, -1), torch.softmax(s64 / temperature, -1),
                          alpha=0.2)
    want = temperature**2 * (per * mask).sum() / mask.sum()
    want.backward()
    got.backward()
    assert float(got.detach()) == pytest.approx(float(want), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(s.grad.double(), s64.grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("kind", sorted(NEW_KINDS))
def test_new_divergences_are_nonnegative_and_exactly_zero_at_agreement(kind):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 50, generator=g) * 5
    assert float(losses_module.logit_kd_loss(kind, x, x.clone(), 2.0)) == 0.0
    for _ in range(5):
        assert float(losses_module.logit_kd_loss(kind, torch.randn(8, 50, generator=g) * 5, x, 2.0)) >= 0.0


def _coarse_reference(kind: str, t, s, idx, temperature: float):
    """Per row, in float64: both full distributions coarsened onto the ids `idx` + one tail bucket, then `kind`
    (beta 0.3, alpha 0.2). The tail is computed from the other ids' probabilities, not as 1 - sum."""
    p = torch.softmax(t.double() / temperature, -1)
    q = torch.softmax(s.double() / temperature, -1)
    rest = torch.ones_like(p, dtype=torch.bool).scatter(-1, idx, False)
    pc = torch.cat([p.gather(-1, idx), (p * rest).sum(-1, keepdim=True)], -1)
    qc = torch.cat([q.gather(-1, idx), (q * rest).sum(-1, keepdim=True)], -1)
    if kind == "kl":
        return (pc * (pc / qc).log()).sum(-1)
    if kind == "reverse_kl":
        return (qc * (qc / pc).log()).sum(-1)
    if kind == "jsd":
        m = 0.3 * pc + 0.7 * qc
        return 0.3 * (pc * (pc / m).log()).sum(-1) + 0.7 * (qc * (qc / m).log()).sum(-1)
    return _ref_divergence(kind, pc, qc, alpha=0.2)


@pytest.mark.parametrize("kind", ["kl", "reverse_kl", "jsd", *sorted(NEW_KINDS)])
def test_top_k_with_a_tail_bucket_is_a_true_divergence_on_k_plus_one_outcomes(kind):
    """A teacher stored as its top-k log-probabilities at T plus log(tail mass): both sides become distributions
    over the k ids and "the rest". The value is the divergence of those coarsened distributions (float64 reference),
    0 exactly at agreement, >= 0 elsewhere, and no clamping hides a negative."""
    g = torch.Generator().manual_seed(5)
    t = torch.randn(7, 60, generator=g) * 4
    s = (t + torch.randn(7, 60, generator=g)).requires_grad_(True)
    temperature, k = 2.0, 8
    sparse = losses_module.topk_with_tail(t, k, temperature)
    got = losses_module.logit_kd_loss(kind, s, sparse, temperature, beta=0.3, alpha=0.2)
    per = _coarse_reference(kind, t, s.detach(), sparse[1], temperature)
    assert float(got) == pytest.approx(float(temperature**2 * per.mean()), rel=1e-4)
    got.backward()
    assert s.grad.abs().sum() > 0  # the tail bucket reaches the student's other ids too
    assert (s.grad[0].abs() > 0).sum() > k
    assert float(losses_module.logit_kd_loss(kind, t.clone(), sparse, temperature, beta=0.3, alpha=0.2)) == 0.0


def test_skew_alpha_is_validated():
    x = torch.randn(2, 5)
    for bad in (1.0, -0.1, True, "0.1"):
        with pytest.raises(ValueError, match="alpha"):
            losses_module.skew_kl(x, x, alpha=bad)


@pytest.mark.parametrize("kind", ["kl", "reverse_kl", "jsd", *sorted(NEW_KINDS)])
def test_a_tail_bucket_stays_exact_when_the_top_k_hold_nearly_all_the_mass(kind):
    """A peaked student whose k ids hold all but ~1e-12 of its mass: its tail is the logsumexp of its other logits,
    so the loss and gradient stay finite and match float64 (`log(1 - sum)` rounds to log 0 in float32). With the
    ids covering the whole vocabulary there is no tail bucket: the sparse loss is the dense one."""
    g = torch.Generator().manual_seed(6)
    t = torch.randn(5, 40, generator=g)
    t[:, :4] += 30.0  # 4 ids hold all but ~e^-27 of the mass, student and teacher alike
    s = (t + 0.3 * torch.randn(5, 40, generator=g)).requires_grad_(True)
    sparse = losses_module.topk_with_tail(t, 4)
    got = losses_module.logit_kd_loss(kind, s, sparse, 1.0, beta=0.3, alpha=0.2)
    got.backward()
    s64 = s.detach().double().requires_grad_(True)
    want = _coarse_reference(kind, t, s64, sparse[1], 1.0).mean()
    want.backward()
    assert math.isfinite(float(got)) and torch.isfinite(s.grad).all()
    assert float(got) == pytest.approx(float(want), rel=1e-3, abs=1e-12)
    assert float((s.grad.double() - s64.grad).norm() / s64.grad.norm()) < 1e-3
    s.grad = None
    whole = losses_module.logit_kd_loss(kind, s, losses_module.topk_with_tail(t, 40), 1.0, beta=0.3, alpha=0.2)
    whole.backward()
    dense_s = s.detach().clone().requires_grad_(True)
    dense = losses_module.logit_kd_loss(kind, dense_s, t, 1.0, beta=0.3, alpha=0.2)
    dense.backward()
    assert torch.isfinite(s.grad).all()
    torch.testing.assert_close(whole, dense, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(s.grad, dense_s.grad, rtol=1e-4, atol=1e-7)
