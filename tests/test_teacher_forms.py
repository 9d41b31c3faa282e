"""Padding entries of a top-k + tail teacher (hf_distill.losses.teacher_forms; an adaptive-k signal's rows hold
fewer than k ids): the loss head (both routes) and the whole-logits divergences against float64 row by row, each row
at its own k without padding."""

from __future__ import annotations

import pytest
import torch
from test_sparse_head import ALPHA, BETA, KINDS, _head, _problem, _relative

from hf_distill import losses
from hf_distill.losses.teacher_forms import PAD_ID


def _padded(teacher_logits: torch.Tensor, k: int, temperature: float, seed: int = 3):
    """The teacher's top-k + tail with each position cut to its own count in 1..k (some at k): padding after it
    (id -1, -inf) and the exact mass of every other id as its tail; with the counts."""
    log_p = torch.log_softmax(teacher_logits.double() / temperature, -1)
    values, ids = log_p.topk(k, -1)
    counts = torch.randint(1, k + 1, values.shape[:-1], generator=torch.Generator().manual_seed(seed))
    counts.view(-1)[::4] = k
    keep = torch.arange(k) < counts[..., None]
    tail = log_p.scatter(-1, torch.where(keep, ids, ids[..., :1]), float("-inf")).logsumexp(-1)
    teacher = (torch.where(keep, values, float("-inf")).float(), torch.where(keep, ids, PAD_ID), tail.float())
    return teacher, counts


def _row_by_row(kind, h, head, teacher, counts, kd_mask, temperature, vocab):
    """KD (no CE) from whole logits in float64, each counted row alone at its own k (no padding): the fixed-k path."""
    x = h.detach().double().requires_grad_(True)
    w = head.weight.detach().double().requires_grad_(True)
    b = head.bias.detach().double().requires_grad_(True)
    z = (x[:, :-1] @ w.T + b)[..., :vocab]
    rows = kd_mask.nonzero().tolist()
    total = 0
    for i, j in rows:
        n = int(counts[i, j])
        one = (teacher[0][i, j, :n].double()[None], teacher[1][i, j, :n][None], teacher[2][i, j].double()[None])
        total = total + losses.logit_kd_loss(kind, z[i, j][None], one, temperature, beta=BETA, alpha=ALPHA)
    kd = total / len(rows)
    kd.backward()
    return kd.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("route", ["direct", "module"])
@pytest.mark.parametrize("kind", KINDS)
def test_padded_rows_equal_each_row_at_its_own_k_in_float64(kind, route):
    h, head, _, kd_mask, _ = _problem()
    with torch.no_grad():
        t_logits = (h[:, :-1] @ head.weight[:203].T).double() * 1.3
    teacher, counts = _padded(t_logits, 9, 2.0)
    assert (counts < 9).any() and (counts == 9).any() and (counts == 1).any()
    want = _row_by_row(kind, h, head, teacher, counts, kd_mask, 2.0, 203)
    got = _head(h, head, teacher, kd_mask, None, kind, 2.0, 203, (1.0, 0.0), route=route)
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-5, abs=1e-7)
    for g, r in zip((got[2], got[3], got[4]), want[1:], strict=True):
        assert _relative(g, r) < 1e-5
    # the whole-logits divergences with the padded teacher (they compute in float32)
    x = h.detach().double().requires_grad_(True)
    z = (x[:, :-1] @ head.weight.detach().double().T + head.bias.detach().double())[..., :203]
    t64 = (teacher[0].double(), teacher[1], teacher[2].double())
    whole = losses.logit_kd_loss(kind, z, t64, 2.0, mask=kd_mask, beta=BETA, alpha=ALPHA)
    whole.backward()
    assert float(whole.detach()) == pytest.approx(float(want[0]), rel=1e-5, abs=1e-7)
    assert _relative(x.grad, want[1]) < 1e-5 and not x.grad.isnan().any()


def test_badly_padded_teachers_are_refused():
    h, head, teacher, kd_mask, _ = _problem()
    log_p, ids, tail = teacher
    first = ids.clone()
    first[0, 0, 0] = PAD_ID  # no real entry first
    finite = ids.clone()
    finite[0, 0, -1] = PAD_ID  # padding whose log-probability is not -inf
    for bad in (first, finite):
        with pytest.raises(ValueError, match="or -1 for padding after a real first id"):
            _head(h, head, (log_p, bad, tail), kd_mask, None, "kl", 2.0, 203, (1.0, 0.0))
        with pytest.raises(ValueError, match="or -1 for padding after a real first id"):
            losses.kl_div(h[:, :-1] @ head.weight[:203].T, (log_p, bad, tail), 2.0)
