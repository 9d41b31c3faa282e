"""The causal-LM loss head over a sparse (top-k + tail) teacher (hf_distill.losses.sparse_head): loss and gradients
equal to the whole-logits sparse divergence of hf_distill.losses, within issue #29's bound in bf16/fp16, and the
trainer's route for an offline teacher signal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import VOCAB, args, flat_params, labelled_collate, llama, padded_llama, sft_rows, word_tokenizer

from hf_distill import DistillationTrainer, losses
from hf_distill.data.collators import TeacherOutputsCollator
from hf_distill.data.teacher_signal import attach_teacher_signal, create_teacher_signal
from hf_distill.distiller import Distiller
from hf_distill.losses import chunked, sparse_head

KINDS = ["kl", "reverse_kl", "jsd", "skew_kl", "skew_reverse_kl", "tvd", "soft_ce"]
BETA, ALPHA = 0.3, 0.1


def _post(z, scale, cap):
    z = z * scale
    return torch.tanh(z / cap) * cap if cap is not None else z


def _problem(dtype=torch.float32, b=2, t=20, hidden=16, vocab=203, pad=53, k=9, bias=True, logit_scale=4.0,
             noise=0.3, temperature=2.0, seed=0):
    """Student states and LM head (vocabulary `vocab + pad`), a teacher's top-k + tail signal over the first `vocab`
    ids (the teacher = the student + `noise`), a KD mask and labels that differ (rows counted by one term only)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, t, hidden, generator=g)
    w = torch.randn(vocab + pad, hidden, generator=g) * logit_scale / hidden**0.5
    head = torch.nn.Linear(hidden, vocab + pad, bias=bias)
    with torch.no_grad():
        head.weight.copy_(w)
        if bias:
            head.bias.copy_(torch.randn(vocab + pad, generator=g) * 0.1)
    h_t = h.double() + noise * torch.randn(b, t, hidden, generator=g).double()
    w_t = w[:vocab].double() + noise * torch.randn(vocab, hidden, generator=g).double() * logit_scale / hidden**0.5
    teacher = losses.topk_with_tail(h_t[:, :-1] @ w_t.T, k, temperature)
    teacher = tuple(x.float() if x.is_floating_point() else x for x in teacher)
    kd_mask = torch.rand(b, t - 1, generator=g) > 0.2
    labels = torch.randint(0, vocab + pad, (b, t - 1), generator=g).masked_fill(
        torch.rand(b, t - 1, generator=g) < 0.25, -100)
    return h.to(dtype), head.to(dtype), teacher, kd_mask, labels


def _reference(kind, h, head, teacher, kd_mask, labels, temperature, vocab, weights, scale=1.0, cap=None):
    """The loss and its gradients from whole logits in float64 (hf_distill.losses' sparse divergence)."""
    x = h.detach().double().requires_grad_(True)
    w = head.weight.detach().double().requires_grad_(True)
    b = head.bias.detach().double().requires_grad_(True) if head.bias is not None else None
    z = x[:, :-1] @ w.T
    if b is not None:
        z = z + b
    z = _post(z, scale, cap)
    t64 = tuple(v.double() if v.is_floating_point() else v for v in teacher)
    kd = losses.logit_kd_loss(kind, z[..., :vocab], t64, temperature, mask=kd_mask, beta=BETA, alpha=ALPHA)
    ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), labels.reshape(-1), ignore_index=-100)
    (weights[0] * kd + weights[1] * ce).backward()
    return kd.detach(), ce.detach(), x.grad, w.grad, (b.grad if b is not None else None)


def _head(h, head, teacher, kd_mask, labels, kind, temperature, vocab, weights, chunk=8, route="auto", scale=1.0,
          cap=None):
    x = h.clone().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    kd, ce = sparse_head.sparse_kd_and_ce(x, chunked.LogitsHead(head, scale, cap), teacher, kd_mask, labels,
                                          chunked.dense_kd(kind, temperature, BETA, ALPHA), chunk, vocab=vocab,
                                          route=route)
    (weights[0] * kd + (weights[1] * ce if ce is not None else 0)).backward()
    ce = ce.detach() if ce is not None else None
    return kd.detach(), ce, x.grad, head.weight.grad, (head.bias.grad if head.bias is not None else None)


def _relative(got, want):
    return float((got.double() - want).norm() / want.norm())


# ---------------------------------------------------------------------- the head against whole logits


@pytest.mark.parametrize("route", ["direct", "module"])
@pytest.mark.parametrize("post", [(1.0, None), (0.5, 3.0)], ids=["plain", "scale-softcap"])
@pytest.mark.parametrize("kind", KINDS)
def test_loss_and_gradients_equal_the_whole_logits_sparse_divergence(kind, post, route):
    """Odd shapes: 38 rows in chunks of 8, a student of 256 ids distilled on the teacher's 203 (backward blocks of
    128 columns: the top-k ids fall in two blocks, the padded ids in a third), a bias, rows counted by KD or CE only."""
    h, head, teacher, kd_mask, labels = _problem()
    assert (teacher[1] < 128).any() and (teacher[1] >= 128).any()
    assert (kd_mask & (labels == -100)).any() and (~kd_mask & (labels != -100)).any()
    weights, scale, cap = (0.7, 0.3), *post
    want = _reference(kind, h, head, teacher, kd_mask, labels, 2.0, 203, weights, scale, cap)
    got = _head(h, head, teacher, kd_mask, labels, kind, 2.0, 203, weights, route=route, scale=scale, cap=cap)
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-5, abs=1e-7)
    assert float(got[1]) == pytest.approx(float(want[1]), rel=1e-6)
    for g, r in zip(got[2:], want[2:], strict=True):
        assert _relative(g, r) < 1e-5
    if kind != "soft_ce":
        assert float(got[0]) > 0


@pytest.mark.parametrize("route", ["direct", "module"])
@pytest.mark.parametrize("kind", KINDS)
def test_all_ids_kept_is_the_dense_divergence(kind, route):
    """k = vocabulary: the tail outcome is empty on both sides (no column to sum, log-mass -inf) and the sparse
    divergence is the dense one, value and gradients, with nothing undefined."""
    h, head, _, kd_mask, labels = _problem(vocab=150, pad=0, bias=False, seed=1)
    with torch.no_grad():
        # a generator of its own: the global RNG's state depends on which tests ran before on this worker, and
        # tvd's gradient jumps where a student and a teacher probability tie
        noise = torch.randn(h.shape[0], h.shape[1] - 1, 150, generator=torch.Generator().manual_seed(5))
        t_logits = (h[:, :-1] @ head.weight.T).double() + 0.3 * noise.double()
    log_p, ids = torch.log_softmax(t_logits / 2.0, -1).float().sort(-1, descending=True)
    teacher = (log_p, ids, torch.full(log_p.shape[:-1], float("-inf")))  # the teacher signal's exact tail
    x = h.double().requires_grad_(True)
    w = head.weight.detach().double().requires_grad_(True)
    kd = losses.logit_kd_loss(kind, x[:, :-1] @ w.T, t_logits, 2.0, mask=kd_mask, beta=BETA, alpha=ALPHA)
    kd.backward()
    kd = kd.detach()
    got = _head(h, head, teacher, kd_mask, None, kind, 2.0, None, (1.0, 0.0), route=route)
    assert float(got[0]) == pytest.approx(float(kd), rel=1e-5)
    assert _relative(got[2], x.grad) < 1e-5 and _relative(got[3], w.grad) < 1e-5


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "soft_ce"])
def test_agreement_gives_zero_loss_and_zero_kd_gradient(kind):
    h, head, _, kd_mask, _ = _problem(pad=0, seed=2)
    with torch.no_grad():
        own = losses.topk_with_tail((h[:, :-1] @ head.weight.T + head.bias).double(), 9, 2.0)
    own = tuple(x.float() if x.is_floating_point() else x for x in own)
    kd, _, gh, gw, gb = _head(h, head, own, kd_mask, None, kind, 2.0, None, (1.0, 0.0))
    assert abs(float(kd)) < 1e-6
    if kind == "tvd":  # |P - Q| has no derivative at agreement (its sign flips with the last bit)
        return
    assert float(gh.abs().max()) < 1e-5 and float(gw.abs().max()) < 1e-5 and float(gb.abs().max()) < 1e-5


def test_tvd_sign_is_read_from_a_shift_below_the_logits_last_bit():
    """TVD's gradient jumps where P = Q. Against a teacher `log P = log Q + shift`, a shift below half of `la`'s last
    bit (a tail of small per-column mass, its total one float32 step off) vanished in `la + shift`, and sign(Q - P)
    became 0 instead of -1 (found on an H200: the CUDA kernel and this PyTorch path alike). Against float64."""
    la = torch.tensor([[-12.3, -12.1, -11.7, -9.5, -2.0]])  # |la| in [8, 16): half a last bit is 4.8e-7
    shift = torch.tensor([[2.4e-7, 2.4e-7, -2.4e-7, 2.4e-7, 0.3]])
    stat, w_kd = torch.tensor([0.1]), torch.tensor([1.0])
    got = sparse_head._sparse_grad_block(la, shift, 0, None, None, None, torch.zeros(1), stat, w_kd, "tvd", 1.0,
                                         0.5, 0.1, 1.0, None, torch.float32)
    la64, shift64 = la.double(), shift.double()
    q = la64.exp()
    want = q * (0.5 * torch.sign(q - (la64 + shift64).exp()) - 0.1)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------- precision (issue #29's bound)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scale", [4.0, 16.0])
@pytest.mark.parametrize("route", ["direct", "module"])
@pytest.mark.parametrize("kind", KINDS)
def test_low_precision_gradients_are_within_half_a_percent_of_float64(kind, route, scale, dtype):
    """The agreement regime (student = teacher + 2% noise) with low-precision states and head: KD + CE gradients
    within 0.5% (relative Frobenius) of float64 on the same inputs."""
    h, head, teacher, kd_mask, labels = _problem(dtype, b=1, t=65, hidden=32, vocab=1000, pad=0, k=16, bias=False,
                                                 logit_scale=scale, noise=0.02)
    weights = (0.7, 0.3)
    want = _reference(kind, h, head, teacher, kd_mask, labels, 2.0, 1000, weights)
    got = _head(h, head, teacher, kd_mask, labels, kind, 2.0, None, weights, chunk=16, route=route)
    assert _relative(got[2], want[2]) < 5e-3
    assert _relative(got[3], want[3]) < 5e-3
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-3, abs=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("route", ["direct", "module"])
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_low_precision_gradients_are_within_half_a_percent_of_float64(kind, route, dtype):
    """The same bound on a GPU (its GEMMs and reductions, not the CPU's), against the CPU float64 reference: a
    vocabulary of 5,000 in several backward blocks, a bias, padded student ids, rows counted by one term only."""
    h, head, teacher, kd_mask, labels = _problem(dtype, b=2, t=129, hidden=64, vocab=5000, pad=120, k=32,
                                                 logit_scale=8.0, noise=0.02)
    weights = (0.7, 0.3)
    want = _reference(kind, h, head, teacher, kd_mask, labels, 2.0, 5000, weights)
    cuda = [x.cuda() if isinstance(x, torch.Tensor) else x for x in (h, kd_mask, labels)]
    teacher_cuda = tuple(x.cuda() for x in teacher)
    got = _head(cuda[0], head.cuda(), teacher_cuda, cuda[1], cuda[2], kind, 2.0, 5000, weights, chunk=64,
                route=route)
    for g, r in zip(got[2:], want[2:], strict=True):
        assert _relative(g.cpu(), r) < 5e-3
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-3, abs=1e-6)
    assert float(got[1]) == pytest.approx(float(want[1]), rel=1e-3)


def test_bf16_rounded_logits_fail_the_bound_this_test_sets():
    """The regime above discriminates: the same sparse loss from logits rounded to bf16 by their GEMM is far off."""
    h, head, teacher, kd_mask, labels = _problem(torch.bfloat16, b=1, t=65, hidden=32, vocab=1000, pad=0, k=16,
                                                 bias=False, logit_scale=16.0, noise=0.02)
    want = _reference("kl", h, head, teacher, kd_mask, labels, 2.0, 1000, (1.0, 0.0))
    x = h.clone().requires_grad_(True)
    losses.kl_div(head(x)[:, :-1].float(), teacher, 2.0, mask=kd_mask).backward()
    assert _relative(x.grad, want[2]) > 0.05


# ---------------------------------------------------------------------- refusals


def test_bad_sparse_teachers_are_refused():
    h, head, (lp, ids, tail), kd_mask, labels = _problem(pad=0)
    lm, spec = chunked.LogitsHead(head), chunked.dense_kd("kl", 2.0)

    def call(teacher, vocab=None):
        return sparse_head.sparse_kd_and_ce(h, lm, teacher, kd_mask, labels, spec, 8, vocab=vocab)

    with pytest.raises(ValueError, match="without the tail"):
        call((lp, ids))
    with pytest.raises(ValueError, match="log_probs .* must be"):
        call((lp[:, 1:], ids[:, 1:], tail[:, 1:]))
    with pytest.raises(ValueError, match="indices must be an integer"):
        call((lp, ids.float(), tail))
    with pytest.raises(ValueError, match="log_tail"):
        call((lp, ids, tail[..., None]))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 150\)"):
        call((lp, ids, tail), vocab=150)
    with pytest.raises(ValueError, match="k=9"):
        call((lp, ids, tail), vocab=5)
    garbage = ids.masked_fill(~kd_mask[..., None], 10_000)  # positions the KD does not count may hold anything
    assert torch.isfinite(call((lp, garbage, tail))[0])


def test_no_second_derivative():
    h, head, teacher, kd_mask, labels = _problem()
    x = h.clone().requires_grad_(True)
    kd, _ = sparse_head.sparse_kd_and_ce(x, chunked.LogitsHead(head), teacher, kd_mask, labels,
                                         chunked.dense_kd("jsd", 2.0, 0.3), 8, vocab=203)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(kd, x, create_graph=True)


# ---------------------------------------------------------------------- the trainer's route


K, T = 8, 2.0


def _tokenizer():
    return word_tokenizer([f"w{i}" for i in range(VOCAB - 2)])


def _joined(tmp_path, rows):
    signal = create_teacher_signal(llama(1), rows, tmp_path / "signal", tokenizer=_tokenizer(), k=K, temperature=T,
                                   rows_per_shard=4, batch_size=3, progress=False)
    return attach_teacher_signal(rows, signal)


def _spy(monkeypatch):
    calls = []
    real = sparse_head.sparse_kd_and_ce

    def spy(*a, **kw):
        calls.append(a[5] is not None)  # the KD objective given
        return real(*a, **kw)

    monkeypatch.setattr(sparse_head, "sparse_kd_and_ce", spy)
    return calls


@pytest.mark.parametrize("student", [llama, padded_llama], ids=["same-vocab", "padded-student"])
@pytest.mark.parametrize("kind", KINDS)
def test_distiller_step_from_a_signal_equals_whole_logits(tmp_path, monkeypatch, kind, student):
    """One training step's loss and gradients through the loss head equal the whole-logits signal path (1e-5)."""
    rows = sft_rows(8)
    joined = _joined(tmp_path, rows)
    results = []
    for whole in (False, True):
        model = student(0).train()
        run = args(tmp_path, kd_loss=kind, temperature=T, kd_weight=0.6, task_weight=0.4, kd_chunk_size=5,
                   **({"jsd_beta": BETA} if kind == "jsd" else {}))
        distiller = Distiller(model, run, None, processing_class=_tokenizer(), train_dataset=joined)
        if whole:
            distiller.paths.chunk = None
        calls = _spy(monkeypatch)
        loss = distiller.compute_loss(model, TeacherOutputsCollator(labelled_collate)([joined[i] for i in range(8)]))
        assert calls == ([] if whole else [True])
        loss.backward()
        results.append((float(loss.detach()), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (loss_head, grad_head), (loss_whole, grad_whole) = results
    assert loss_head == pytest.approx(loss_whole, rel=1e-5)
    assert _relative(grad_head, grad_whole.double()) < 1e-5


@pytest.mark.slow
def test_trainer_from_a_signal_with_accumulation_equals_whole_logits(tmp_path, monkeypatch):
    """Two SGD steps of jsd + CE from the signal with gradient accumulation 2 and masked prompts: the loss head and the
    whole-logits path give the same weights and logged terms, and GA 2 x 4 rows the weights of GA 1 x 8."""
    rows = sft_rows(16)
    joined = _joined(tmp_path, rows)
    calls = _spy(monkeypatch)
    runs = []
    for name, whole, shape in (("head", False, dict(per_device_train_batch_size=4, gradient_accumulation_steps=2)),
                               ("whole", True, dict(per_device_train_batch_size=4, gradient_accumulation_steps=2)),
                               ("big", False, dict(per_device_train_batch_size=8))):
        trainer = DistillationTrainer(
            model=llama(0), teacher_model=None,
            args=args(tmp_path / name, max_steps=2, optim="sgd", learning_rate=0.5, kd_loss="jsd", jsd_beta=BETA,
                      kd_weight=0.6, task_weight=0.4, temperature=T, kd_chunk_size=3, **shape),
            train_dataset=joined, data_collator=labelled_collate, processing_class=_tokenizer())
        if whole:
            trainer.distiller.paths.chunk = None
        before = len(calls)
        trainer.train()
        assert len(calls) - before == (0 if whole else 4 if name == "head" else 2)
        runs.append(trainer)
    head, whole, big = runs
    assert flat_params(head.model).ne(flat_params(llama(0))).any()
    torch.testing.assert_close(flat_params(head.model), flat_params(whole.model), atol=1e-6, rtol=0)
    torch.testing.assert_close(flat_params(head.model), flat_params(big.model), atol=1e-6, rtol=0)
    logs = [[r for r in t.state.log_history if "loss" in r] for t in runs]
    assert len(logs[0]) == 2
    for a, b, c in zip(*logs, strict=True):
        for key in ("loss", "loss_kd", "loss_task"):
            assert a[key] == pytest.approx(b[key], rel=1e-5) and a[key] == pytest.approx(c[key], rel=1e-5), key
