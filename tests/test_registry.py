"""The divergence registry (hf_distill.losses.registry, issue #40 item 3): a divergence defined in one entry, inside
this test, trains through whole logits, the loss head (direct and module routes) and the sparse head, equal to a
float64 reference; what an entry lacks is refused on the path that needs it, and every list of kinds follows the
registry."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import args, flat_params, labelled_collate, llama, sft_rows

from hf_distill import DistillationArguments, DistillationTrainer, losses
from hf_distill.features import heads
from hf_distill.losses import chunked, registry, triton_head
from hf_distill.publish import card, report

# ---------------------------------------------------------------------------------------------- the test's divergence


def _hellinger_rows(log_q, log_p, w=None):
    """Squared Hellinger distance 1/2 sum (sqrt P - sqrt Q)^2 per row, and sum_v Q_v dL/dQ_v with
    dL/dQ_v = 1/2 (1 - sqrt(P_v / Q_v))."""
    sq, sp = (0.5 * log_q).exp(), (0.5 * log_p).exp()
    return 0.5 * (sp - sq).pow(2).sum(-1), 0.5 * (log_q.exp() - sq * sp).sum(-1)


def _hellinger_grad(la, lb, stat, w=None):
    q = la.exp()
    return 0.5 * (q - (0.5 * (la + lb)).exp()) - q * stat


HELLINGER = registry.Divergence("hellinger", "squared Hellinger distance", _hellinger_rows, _hellinger_grad,
                                help="T**2 * squared Hellinger distance", method="hellinger-kd")


@pytest.fixture
def hellinger():
    losses.register(HELLINGER)
    yield HELLINGER.name
    losses.unregister(HELLINGER.name)


def _hellinger64(log_q, log_p):
    """The float64 reference, written independently of the entry: 1/2 sum (sqrt P - sqrt Q)^2."""
    return 0.5 * (log_p.double().exp().sqrt() - log_q.double().exp().sqrt()).pow(2).sum(-1)


# ---------------------------------------------------------------------------------------------- whole logits


def test_a_registered_divergence_trains_through_whole_logits(hellinger):
    g = torch.Generator().manual_seed(0)
    s = (torch.randn(2, 6, 40, generator=g) * 3).requires_grad_(True)
    t = torch.randn(2, 6, 40, generator=g) * 3
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    T = 2.0
    loss = losses.logit_kd_loss(hellinger, s, t, T, mask=mask)
    loss.backward()

    s64 = s.detach().double().requires_grad_(True)
    per = _hellinger64(F.log_softmax(s64 / T, -1), F.log_softmax(t.double() / T, -1))
    want = T**2 * per[mask.bool()].mean()
    want.backward()
    assert float(loss.detach()) > 0
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(s.grad.double(), s64.grad, rtol=1e-4, atol=1e-7)
    # its typed teacher forms: a dense teacher given as DenseLogits is the tensor itself
    assert torch.equal(losses.logit_kd_loss(hellinger, s, losses.DenseLogits(t), T, mask=mask), loss)
    assert float(losses.logit_kd_loss(hellinger, t, t, T)) == pytest.approx(0.0, abs=1e-6)


def test_a_registered_divergence_takes_a_top_k_and_tail_teacher_on_whole_logits(hellinger):
    g = torch.Generator().manual_seed(1)
    s = (torch.randn(3, 30, generator=g) * 2).requires_grad_(True)
    zt = torch.randn(3, 30, generator=g) * 2
    teacher = losses.topk_with_tail(zt, 5, 1.0)
    assert teacher.form == "topk_tail" and isinstance(teacher, losses.TopKTail)
    loss = losses.logit_kd_loss(hellinger, s, teacher, 1.0)
    loss.backward()
    s64 = s.detach().double().requires_grad_(True)
    log_q = F.log_softmax(s64, -1)
    ids = teacher.indices
    rest = log_q.scatter(-1, ids, float("-inf")).logsumexp(-1, keepdim=True)
    log_p = F.log_softmax(zt.double(), -1)
    p_rest = log_p.scatter(-1, ids, float("-inf")).logsumexp(-1, keepdim=True)
    want = _hellinger64(torch.cat([log_q.gather(-1, ids), rest], -1),
                        torch.cat([log_p.gather(-1, ids), p_rest], -1)).mean()
    want.backward()
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(s.grad.double(), s64.grad, rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------------------------------------- the loss heads


def _heads(seed=0, n=12, hidden=8, vocab=60):
    g = torch.Generator().manual_seed(seed)
    s_lin, t_lin = torch.nn.Linear(hidden, vocab, bias=False), torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        s_lin.weight.copy_(torch.randn(vocab, hidden, generator=g))
        t_lin.weight.copy_(s_lin.weight + 0.5 * torch.randn(vocab, hidden, generator=g))
    h_s = torch.randn(1, n + 1, hidden, generator=g)
    h_t = torch.randn(1, n + 1, hidden, generator=g)
    labels = torch.randint(0, vocab, (1, n), generator=g)
    return s_lin, t_lin, h_s, h_t, labels


def _reference(s_lin, h_s, teacher_log_p, labels, T, kd_rows, coarsen=None):
    """Float64 KD (mean over `kd_rows`) + CE (mean) and their gradients w.r.t. the hidden states and the weight."""
    h = h_s.detach().double().requires_grad_(True)
    w = s_lin.weight.detach().double().requires_grad_(True)
    z = h[0, :-1] @ w.T
    log_q = F.log_softmax(z / T, -1)
    if coarsen is not None:
        log_q = coarsen(log_q)
    kd = T**2 * _hellinger64(log_q, teacher_log_p)[kd_rows].mean()
    ce = F.cross_entropy(z, labels[0])
    (kd + ce).backward()
    return kd.detach(), ce.detach(), h.grad, w.grad


@pytest.mark.parametrize("route", ["direct", "module"])
def test_a_registered_divergence_trains_through_the_loss_head(hellinger, route):
    s_lin, t_lin, h_s, h_t, labels = _heads()
    T = 1.5
    kd_mask = torch.ones(1, 12, dtype=torch.bool)
    kd_mask[0, 9:] = False
    x = h_s.clone().requires_grad_(True)
    kd, ce = chunked.chunked_kd_and_ce(x, chunked.LogitsHead(s_lin), chunked.LogitsHead(t_lin), h_t, kd_mask, labels,
                                       chunked.dense_kd(hellinger, T), chunk_size=5, route=route)
    (kd + ce).backward()
    log_p = F.log_softmax(h_t.double()[0, :-1] @ t_lin.weight.double().T / T, -1)
    want_kd, want_ce, want_h, want_w = _reference(s_lin, h_s, log_p, labels, T, kd_mask[0])
    assert float(kd.detach()) > 0
    torch.testing.assert_close(kd.double(), want_kd, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ce.double(), want_ce, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(x.grad.double(), want_h, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(s_lin.weight.grad.double(), want_w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("route", ["direct", "module"])
def test_a_registered_divergence_trains_through_the_sparse_head(hellinger, route):
    s_lin, _, h_s, _, labels = _heads(1)
    T, k = 2.0, 7
    zt = torch.randn(1, 12, 60, generator=torch.Generator().manual_seed(5)).double() * 3
    teacher = losses.topk_with_tail(zt, k, T)  # float64 teacher; the head reads it in float32
    ids = teacher.indices[0]
    kd_mask = torch.ones(1, 12, dtype=torch.bool)
    kd_mask[0, :2] = False
    x = h_s.clone().requires_grad_(True)
    as_float32 = losses.TopKTail(*(p.float() if p.is_floating_point() else p for p in teacher))
    kd, ce = chunked.chunked_kd_and_ce(x, chunked.LogitsHead(s_lin), as_float32, None, kd_mask, labels,
                                       chunked.dense_kd(hellinger, T), chunk_size=4, route=route)
    (kd + ce).backward()

    def coarsen(log_q):
        rest = log_q.scatter(-1, ids, float("-inf")).logsumexp(-1, keepdim=True)
        return torch.cat([log_q.gather(-1, ids), rest], -1)

    log_p = torch.cat([teacher.log_probs[0], teacher.log_tail[0, :, None]], -1)
    want_kd, want_ce, want_h, want_w = _reference(s_lin, h_s, log_p, labels, T, kd_mask[0], coarsen)
    assert float(kd.detach()) > 0
    torch.testing.assert_close(kd.double(), want_kd, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ce.double(), want_ce, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(x.grad.double(), want_h, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(s_lin.weight.grad.double(), want_w, rtol=1e-4, atol=1e-6)


def test_a_registered_divergence_trains_a_causal_lm_through_the_trainer(tmp_path, hellinger):
    """`kd_loss` accepts the registered kind, and the trainer's loss head (the causal-LM default) and the whole-logits
    path train the same weights with it."""
    runs = []
    for whole in (False, True):
        trainer = DistillationTrainer(
            model=llama(0), teacher_model=llama(1),
            args=args(tmp_path / str(whole), max_steps=2, per_device_train_batch_size=4, optim="sgd",
                      learning_rate=0.5, kd_loss=hellinger, kd_weight=0.6, task_weight=0.4, temperature=2.0,
                      kd_chunk_size=3),
            train_dataset=sft_rows(8), data_collator=labelled_collate)
        if whole:
            trainer.distiller._chunk = None  # the path used where chunking is impossible
        trainer.train()
        runs.append(trainer)
    torch.testing.assert_close(flat_params(runs[0].model), flat_params(runs[1].model), atol=1e-6, rtol=0)
    logs = [[r for r in t.state.log_history if "loss" in r] for t in runs]
    assert logs[0][0]["loss_kd"] > 0
    assert logs[0][0]["loss_kd"] == pytest.approx(logs[1][0]["loss_kd"], rel=1e-5)
    assert runs[0].args.distillation_summary()["kd_loss"] == hellinger


# ---------------------------------------------------------------------------------------------- refusals


def test_the_kernel_path_refuses_a_kind_without_a_triton_code(hellinger):
    """No Triton code in the entry: the CUDA kernels refuse it (one error naming the kind and the switch), before
    any launch, instead of computing another divergence (the old `.get(kind, 0)` ran KL)."""
    zs, zt = torch.randn(3, 20), torch.randn(3, 20)
    with pytest.raises(ValueError, match=r"kd_loss='hellinger' has no Triton kernel code.*HF_DISTILL_TRITON=0"):
        triton_head.row_stats(zs, zt, None, hellinger, 1.0, 0.5, 0.1, 20)
    with pytest.raises(ValueError, match=r"kd_loss='hellinger' has no Triton kernel code"):
        triton_head.grad_block(zs, zt, 0, None, None, None, zs[:, 0], zs[:, 0], zs[:, 0], zs[:, 0], hellinger, 1.0,
                               0.5, 0.1, 1.0, None, torch.float32)
    assert hellinger not in triton_head.KIND_CODES and "kl" in triton_head.KIND_CODES


@pytest.mark.parametrize("kind", ["nope", "mse"])
def test_an_unknown_kind_never_reaches_a_kernel(kind):
    """A kind no entry names (or `mse`, which has no row math) is refused by every path's lookup: a KeyError and a
    ValueError at once, never KL."""
    zs, zt = torch.randn(3, 20), torch.randn(3, 20)
    for call in (lambda: triton_head.row_stats(zs, zt, None, kind, 1.0, 0.5, 0.1, 20),
                 lambda: losses.divergence_rows(kind, zs, zt),
                 lambda: chunked.row_gradient(kind, zs, zt, zs[:, :1])):
        with pytest.raises(KeyError) as info:
            call()
        assert isinstance(info.value, ValueError) and repr(kind) in str(info.value)
    assert triton_head.kernel_code(None) == 0  # no KD at all: no branch runs
    if kind == "nope":
        with pytest.raises(ValueError, match="unknown logit KD kind 'nope'"):
            chunked.dense_kd(kind, 1.0)


def test_an_entry_is_checked_when_registered():
    half = registry.Divergence("half", "half", rows=_hellinger_rows)
    with pytest.raises(ValueError, match="give both rows and grad"):
        losses.register(half)
    with pytest.raises(ValueError, match="already registered"):
        losses.register(dataclasses.replace(HELLINGER, name="kl"))
    with pytest.raises(ValueError, match="Triton kernel code 0 is 'kl'"):
        losses.register(dataclasses.replace(HELLINGER, triton_code=0))
    assert "half" not in registry.kinds() and HELLINGER.name not in registry.kinds()


# ---------------------------------------------------------------------------------------------- derived lists


def test_every_list_of_kinds_follows_the_registry(hellinger):
    from hf_distill import arguments

    assert hellinger in losses.DIVERGENCE_KINDS and hellinger in chunked.DIVERGENCES
    assert hellinger in arguments.KD_LOSS_KINDS and hellinger in heads.SOFTMAX_LOSSES
    assert hellinger not in arguments.SKEW_KINDS and hellinger not in arguments.JSD_KINDS
    assert report._KD_METHODS.get(hellinger) == "hellinger-kd"
    assert card._kd_loss_label({"kd_loss": hellinger}) == "squared Hellinger distance x T^2"
    assert DistillationArguments(output_dir="/tmp/unused", kd_loss=hellinger).kd_loss == hellinger
    with pytest.raises(ValueError, match=r"kd_loss='hellinger' is not defined for multi-label heads"):
        heads.check_kd_loss(heads.Head.MULTI_LABEL, hellinger)
    with pytest.raises(ValueError, match="regression head"):
        heads.check_kd_loss(heads.Head.REGRESSION, hellinger)


def test_unregistered_kinds_leave_every_list():
    from hf_distill import arguments

    assert "hellinger" not in arguments.KD_LOSS_KINDS
    with pytest.raises(ValueError, match="kd_loss='hellinger' is unknown"):
        DistillationArguments(output_dir="/tmp/unused", kd_loss="hellinger")
    # the built-in wording the card and the arguments' help show, from the entries
    assert card._kd_loss_label({"kd_loss": "jsd", "jsd_beta": 0.3}) == "generalized JSD (beta = 0.3) x T^2"
    assert card._kd_loss_label({"kd_loss": "skew_kl", "skew_alpha": 0.1}) == "skew KL divergence (alpha = 0.1) x T^2"
    assert card._kd_loss_label({"kd_loss": "soft_ce"}) == "soft cross-entropy"
    assert card._kd_loss_label({"kd_loss": "mse"}) == "MSE of logits"
    help_text = next(f.metadata["help"] for f in dataclasses.fields(DistillationArguments) if f.name == "kd_loss")
    assert all(f"`{k}`" in help_text for k in arguments.KD_LOSS_KINDS)


# ---------------------------------------------------------------------------------------------- teacher forms


def test_the_teacher_form_is_a_tag_not_a_tuple_length():
    t = torch.randn(2, 5)
    v, i = t.topk(2, -1)
    assert losses.as_teacher(t).form == "dense"
    assert losses.as_teacher((v, i)).form == "topk" and losses.as_teacher((v, i, v[:, 0])).form == "topk_tail"
    typed = losses.TopK(v, i)
    assert losses.as_teacher(typed) is typed and typed == (v, i)  # still the plain pair for callers that unpack it
    with pytest.raises(ValueError, match=r"kl_div: sparse teacher logits must be a \(values, indices\) pair"):
        losses.as_teacher((v,), "kl_div")
    with pytest.raises(ValueError, match="needs dense teacher logits"):
        losses.logit_mse(t, typed)
