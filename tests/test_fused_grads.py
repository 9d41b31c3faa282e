"""The loss head's fused mode (hf_distill.losses.fused_grads, `kd_head_mode="fused"`, issue #41 item 6): the gradients
formed in the forward (four LM-head GEMMs, not six) equal the default mode's and float64's, for the dense and the
sparse head; other weights than announced are recomputed exactly; it is refused where it cannot run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import OpTrace, args, labelled_collate, llama, sft_rows
from test_sparse_head import _problem
from test_sparse_head import _reference as _sparse_reference

from hf_distill import losses
from hf_distill.distiller import Distiller
from hf_distill.losses import chunked, fused_grads, kd_head, sparse_head

WEIGHTS = (0.7, 0.3)


def _dense_problem(dtype=torch.float32, n=40, hidden=16, vocab=300, pad=40, bias=True, noise=0.3, scale=4.0):
    """A student head of `vocab + pad` ids (a bias), a teacher head of `vocab`, states, a KD mask and labels that
    differ (rows counted by one term only)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, n, hidden, generator=g)
    h_t = h + noise * torch.randn(1, n, hidden, generator=g)
    s_head, t_head = torch.nn.Linear(hidden, vocab + pad, bias=bias), torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        s_head.weight.copy_(torch.randn(vocab + pad, hidden, generator=g) * scale / hidden**0.5)
        t_head.weight.copy_(s_head.weight[:vocab] + noise * torch.randn(vocab, hidden, generator=g) / hidden**0.5)
        if bias:
            s_head.bias.copy_(torch.randn(vocab + pad, generator=g) * 0.1)
    kd_mask = torch.rand(1, n - 1, generator=g) > 0.2
    labels = torch.randint(0, vocab + pad, (1, n - 1), generator=g).masked_fill(
        torch.rand(1, n - 1, generator=g) < 0.25, -100)
    return h.to(dtype), s_head.to(dtype), h_t.to(dtype), t_head.to(dtype), kd_mask, labels, vocab


def _dense_reference(kind, h, s_head, h_t, t_head, kd_mask, labels, vocab, weights, cap=None):
    x = h.detach().double().requires_grad_(True)
    w = s_head.weight.detach().double().requires_grad_(True)
    b = s_head.bias.detach().double().requires_grad_(True) if s_head.bias is not None else None
    z = x[0, :-1] @ w.T + (b if b is not None else 0)
    z = torch.tanh(z / cap) * cap if cap is not None else z
    zt = h_t[0, :-1].double() @ t_head.weight.double().T
    kd = losses.logit_kd_loss(kind, z[:, :vocab], zt, 2.0, mask=kd_mask[0], beta=0.3, alpha=0.2)
    ce = F.cross_entropy(z, labels[0], ignore_index=-100)
    (weights[0] * kd + weights[1] * ce).backward()
    return x.grad, w.grad, (b.grad if b is not None else None)


def _dense(kind, h, s_head, h_t, t_head, kd_mask, labels, vocab, weights, fused, chunk=8, cap=None, upstream=1.0):
    x = h.clone().requires_grad_(True)
    s_head.zero_grad(set_to_none=True)
    kd, ce = chunked.chunked_kd_and_ce(x, chunked.LogitsHead(s_head, 1.0, cap), chunked.LogitsHead(t_head), h_t,
                                       kd_mask, labels, chunked.dense_kd(kind, 2.0, 0.3, 0.2), chunk, vocab,
                                       fused=fused)
    ((weights[0] * kd + weights[1] * ce) * upstream).backward()
    return x.grad, s_head.weight.grad, (s_head.bias.grad if s_head.bias is not None else None)


def _relative(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.fixture
def logits_calls(monkeypatch):
    """Counts the student and teacher logit GEMMs of the head's walks, and fails a recompute that was not expected."""
    calls = {"logits": 0, "recompute": 0}
    real_logits, real_walk = kd_head._head_logits, kd_head._backward_walk

    def logits(*a, **kw):
        calls["logits"] += 1
        return real_logits(*a, **kw)

    def walk(*a, **kw):
        calls["recompute"] += 1
        return real_walk(*a, **kw)

    monkeypatch.setattr(kd_head, "_head_logits", logits)
    monkeypatch.setattr(kd_head, "_backward_walk", walk)
    monkeypatch.setattr(sparse_head, "_backward_walk", walk)
    return calls


@pytest.mark.parametrize(("kind", "cap"), [("kl", None), ("jsd", 3.0), ("skew_reverse_kl", None), ("tvd", 3.0)])
def test_fused_dense_head_equals_float64_with_two_logit_gemms_per_chunk(kind, cap, logits_calls):
    """Padded student vocabulary (its last 40 ids: the CE's part alone), a bias, 39 rows in 5 chunks: the gradients
    equal float64's (1e-5) and the default mode's, from the forward's logits only (2 per chunk: none recomputed)."""
    h, s_head, h_t, t_head, kd_mask, labels, vocab = _dense_problem()
    want = _dense_reference(kind, h, s_head, h_t, t_head, kd_mask, labels, vocab, WEIGHTS, cap)
    got = _dense(kind, h, s_head, h_t, t_head, kd_mask, labels, vocab, WEIGHTS, WEIGHTS, cap=cap)
    assert logits_calls == {"logits": 2 * 5, "recompute": 0}
    for g, r in zip(got, want, strict=True):
        assert _relative(g, r) < 1e-5
    default = _dense(kind, h, s_head, h_t, t_head, kd_mask, labels, vocab, WEIGHTS, None, cap=cap)
    assert logits_calls["recompute"] == 1 and logits_calls["logits"] > 2 * 2 * 5
    for g, r in zip(got, default, strict=True):
        assert _relative(g, r) < 1e-6


def test_fused_gradients_scale_with_the_upstream_gradient(logits_calls):
    """A loss scale (fp16's GradScaler) or accumulation's division multiplies both sums' gradients alike: the kept
    gradients are scaled, nothing recomputed."""
    problem = _dense_problem()
    base = _dense("jsd", *problem, WEIGHTS, WEIGHTS)
    scaled = _dense("jsd", *problem, WEIGHTS, WEIGHTS, upstream=1024.0)
    assert logits_calls["recompute"] == 0
    for g, r in zip(scaled, base, strict=True):
        torch.testing.assert_close(g, r * 1024.0, rtol=1e-6, atol=0)


def test_other_weights_than_announced_are_recomputed_exactly(logits_calls, caplog):
    """The forward formed the gradient for 0.7 KD + 0.3 CE; a loss of 0.2 KD + 0.8 CE is not approximated: the
    backward recomputes (float64's gradients), and says so once."""
    fused_grads._WARNED.clear()
    h, s_head, h_t, t_head, kd_mask, labels, vocab = _dense_problem()
    want = _dense_reference("jsd", h, s_head, h_t, t_head, kd_mask, labels, vocab, (0.2, 0.8))
    with caplog.at_level("WARNING"):
        got = _dense("jsd", h, s_head, h_t, t_head, kd_mask, labels, vocab, (0.2, 0.8), WEIGHTS)
    assert logits_calls["recompute"] == 1
    assert "recomputed the gradient" in caplog.text
    for g, r in zip(got, want, strict=True):
        assert _relative(g, r) < 1e-5


@pytest.mark.parametrize("kind", ["jsd", "skew_kl"])
def test_fused_sparse_head_equals_float64(kind, logits_calls):
    h, head, teacher, kd_mask, labels = _problem()
    want = _sparse_reference(kind, h, head, teacher, kd_mask, labels, 2.0, 203, WEIGHTS)
    x = h.clone().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    kd, ce = sparse_head.sparse_kd_and_ce(x, chunked.LogitsHead(head), teacher, kd_mask, labels,
                                          chunked.dense_kd(kind, 2.0, 0.3, 0.1), 8, vocab=203, fused=WEIGHTS)
    (WEIGHTS[0] * kd + WEIGHTS[1] * ce).backward()
    assert logits_calls == {"logits": 5, "recompute": 0}  # 38 rows in chunks of 8: the student's logits only
    assert float(kd.detach()) == pytest.approx(float(want[0]), rel=1e-5)
    for g, r in zip((x.grad, head.weight.grad, head.bias.grad), want[2:], strict=True):
        assert _relative(g, r) < 1e-5


@pytest.mark.parametrize(("kind", "scale"), [("jsd", 16.0), pytest.param("kl", 4.0, marks=pytest.mark.slow)])
def test_fused_bf16_gradients_within_half_a_percent_of_float64(kind, scale):
    """Issue #29's bound in the agreement regime (student = teacher + 2% noise), bf16 states and heads: the fused
    mode's weight gradient accumulates over token chunks in float32, rounded once."""
    problem = _dense_problem(torch.bfloat16, n=129, hidden=32, vocab=1000, pad=0, bias=False, noise=0.02,
                             scale=scale)
    want = _dense_reference(kind, *problem, WEIGHTS)
    got = _dense(kind, *problem, WEIGHTS, WEIGHTS, chunk=16)
    assert _relative(got[0], want[0]) < 5e-3 and _relative(got[1], want[1]) < 5e-3


def test_fused_mode_writes_its_accumulators_without_a_zero_fill_or_a_copy():
    """What a fused chunk moves (issue #41 item 6): the float32 `(V, H)` weight-gradient accumulator is allocated empty
    and written by the first chunk's product (no zero-fill pass over it, no read of zeros), and each chunk's rows of
    the hidden-state gradient are written by their product in place (no temporary copied in). 39 rows in 5 chunks:
    the gradients equal float64's."""
    h, s_head, h_t, t_head, kd_mask, labels, vocab = _dense_problem(pad=0, bias=False)
    want = _dense_reference("jsd", h, s_head, h_t, t_head, kd_mask, labels, vocab, WEIGHTS)
    with OpTrace() as trace:
        got = _dense("jsd", h, s_head, h_t, t_head, kd_mask, labels, vocab, WEIGHTS, WEIGHTS)
    v_h, rows_h = tuple(s_head.weight.shape), (h.shape[1] - 1, h.shape[2])
    assert sum(trace.count(op, v_h) for op in ("zeros", "zeros_like", "new_zeros", "zero_", "fill_")) == 0
    assert trace.count("empty", v_h, torch.float32, "outs") == 1
    assert trace.count("__setitem__", rows_h, torch.float32, "args") == 0
    for g, r in zip(got[:2], want[:2], strict=True):  # no bias
        assert _relative(g, r) < 1e-5


def test_fused_mode_scales_and_rounds_its_weight_gradient_in_one_pass(monkeypatch):
    """A loss scale (fp16's GradScaler, accumulation's division): the float32 accumulator is scaled and rounded to the
    weight's dtype by one operation (on CUDA one read of it), not scaled in place first; the same gradients."""
    problem = _dense_problem(torch.bfloat16, n=33, hidden=16, vocab=300, pad=0, bias=False, noise=0.05)
    v_h = tuple(problem[1].weight.shape)
    base = _dense("jsd", *problem, WEIGHTS, WEIGHTS)
    trace, finish = OpTrace(), fused_grads.Fused.finish

    def traced(self, *a):  # the backward's own ops (a mode entered outside does not reach the autograd backward)
        with trace:
            return finish(self, *a)

    monkeypatch.setattr(fused_grads.Fused, "finish", traced)
    scaled = _dense("jsd", *problem, WEIGHTS, WEIGHTS, upstream=1000.0)
    assert trace.count("mul_", v_h, torch.float32) == 0
    assert trace.count("mul", v_h, torch.bfloat16, "args") == 1  # into the bf16 gradient (`out=`)
    for g, r in zip(scaled[:2], base[:2], strict=True):  # no bias
        assert _relative(g, r.double() * 1000.0) < 1e-2  # bf16's rounding of each side


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scaled_cast_is_the_scale_then_the_cast_bit_for_bit(device, dtype):
    g = torch.Generator().manual_seed(0)
    acc = (torch.randn(64, 96, generator=g) * 3).to(device)
    for lam in (1.0, 0.37, 1024.0, 1 / 3):
        want = acc.clone().mul_(lam).to(dtype)
        got = fused_grads._scaled_cast(acc.clone(), lam, dtype)
        assert got.dtype == dtype and torch.equal(got, want)


def test_fused_head_with_every_position_counted_reads_rows_without_a_gather():
    """No KD mask and every label counted (pretraining, packed rows): the student's and teacher's rows are the
    positions flattened (views here), not boolean gathers; the gradients equal float64's."""
    h, s_head, h_t, t_head, _, labels, vocab = _dense_problem(pad=0, bias=False)
    every = torch.ones(1, h.shape[1] - 1, dtype=torch.bool)
    labels = labels.clamp(min=0)
    want = _dense_reference("jsd", h, s_head, h_t, t_head, every, labels, vocab, WEIGHTS)
    with OpTrace() as trace:
        got = _dense("jsd", h, s_head, h_t, t_head, None, labels, vocab, WEIGHTS, WEIGHTS)
    assert trace.count("__getitem__", every.shape, torch.bool, "args") == 0
    for g, r in zip(got[:2], want[:2], strict=True):  # no bias
        assert _relative(g, r) < 1e-5


@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_one_chunk_of_logits_is_alive_when_the_next_is_computed(mode, monkeypatch):
    """Peak memory: when a chunk's (or a backward block's) logits GEMM runs, the previous chunk's student and teacher
    logits are already freed, so at most one earlier logits tensor is alive then (the same chunk's student logits,
    while its teacher's are computed), not three float32 `(chunk, V)` buffers (0.5 GiB each at 1,024 x 128,256)."""
    import weakref

    made, alive = [], []
    real = kd_head._head_logits

    def spy(*a, **kw):
        alive.append(sum(ref() is not None for ref in made))
        out = real(*a, **kw)
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(kd_head, "_head_logits", spy)
    h, s_head, h_t, t_head, kd_mask, labels, vocab = _dense_problem(pad=0, bias=False)
    _dense("jsd", h, s_head, h_t, t_head, kd_mask, labels, vocab, WEIGHTS, WEIGHTS if mode == "fused" else None)
    assert len(made) >= 10 and max(alive) == 1


def test_padded_vocabulary_gradient_parts_are_written_in_place(monkeypatch):
    """A student vocabulary padded past the KD's (its last 40 ids: the CE's part alone): each chunk's two column
    ranges are handed to the gradient kernel as views of the chunk's gradient to write into (the Triton kernels write
    there; here a stand-in with their `out=`), not computed apart and copied in; the gradients equal float64's."""
    outs = []
    triton_like = fused_grads.writes_into(kd_head._by_rows(kd_head._grad_block))

    def kernel(*a, out=None):
        outs.append(out is not None)
        return triton_like(*a, out=out)

    monkeypatch.setattr(kd_head, "_grad_block_fn", lambda device: kernel)
    h, s_head, h_t, t_head, kd_mask, labels, vocab = _dense_problem(bias=False)
    want = _dense_reference("jsd", h, s_head, h_t, t_head, kd_mask, labels, vocab, WEIGHTS)
    with OpTrace() as trace:
        got = _dense("jsd", h, s_head, h_t, t_head, kd_mask, labels, vocab, WEIGHTS, WEIGHTS)
    assert outs == [True] * 10  # 5 chunks x 2 column ranges
    assert trace.count("__setitem__", (8, s_head.weight.shape[0]), where="args") == 0
    for g, r in zip(got[:2], want[:2], strict=True):
        assert _relative(g, r) < 1e-5


def test_fused_mode_is_refused_on_the_module_route():
    h, s_head, h_t, t_head, kd_mask, labels, vocab = _dense_problem()
    with pytest.raises(ValueError, match="kd_head_mode='fused'.*called as modules"):
        chunked.chunked_kd_and_ce(h, chunked.LogitsHead(s_head), chunked.LogitsHead(t_head), h_t, kd_mask, labels,
                                  chunked.dense_kd("kl", 2.0), 8, vocab, route="module", fused=WEIGHTS)


def test_fused_default_chunk_is_four_times_longer():
    assert chunked.default_chunk(128_256) == 256 and chunked.default_chunk(128_256, "fused") == 1024
    assert chunked.default_chunk(1000) == 4096 and chunked.default_chunk(1000, "fused") == 16384


def test_fused_chunk_factor_is_the_one_switch_of_the_fused_default(monkeypatch):
    """`FUSED_CHUNK_FACTOR` (the candidate a GPU sweep decides: 8, 2,048 tokens at V = 128,256) moves the fused
    default and nothing else."""
    monkeypatch.setattr(chunked, "FUSED_CHUNK_FACTOR", 8)
    assert chunked.default_chunk(128_256, "fused") == 2048 and chunked.default_chunk(128_256) == 256
    assert chunked.default_chunk(1000, "fused") == 32768 and chunked.default_chunk(1000) == 4096


# ---------------------------------------------------------------------- the trainer's argument


def test_trainer_step_in_fused_mode_equals_the_default_mode(tmp_path, logits_calls):
    """One step's loss and gradients through DistillationTrainer's loss head with kd_head_mode='fused' equal the
    default mode's (1e-6), the gradients formed in the forward."""
    rows = sft_rows(8)
    batch = labelled_collate([rows[i] for i in range(8)])
    results = []
    for mode in ("fused", "recompute"):
        student = llama(0).train()
        run = args(tmp_path / mode, kd_loss="jsd", kd_weight=0.6, task_weight=0.4, kd_head_mode=mode)
        distiller = Distiller(student, run, llama(1))
        assert distiller.paths.chunk == chunked.default_chunk(student.config.vocab_size, mode)
        before = logits_calls["recompute"]
        loss = distiller.compute_loss(student, dict(batch))
        loss.backward()
        assert logits_calls["recompute"] - before == (0 if mode == "fused" else 1)
        results.append((float(loss.detach()), torch.cat([p.grad.flatten() for p in student.parameters()])))
    (loss_f, grad_f), (loss_r, grad_r) = results
    assert loss_f == pytest.approx(loss_r, rel=1e-6)
    assert _relative(grad_f, grad_r) < 1e-6


@pytest.mark.parametrize("value", ["fast", None, 1])
def test_kd_head_mode_must_be_known(tmp_path, value):
    with pytest.raises(ValueError, match="kd_head_mode must be 'recompute'"):
        args(tmp_path, kd_head_mode=value)


def test_fused_mode_is_refused_where_the_loss_head_does_not_run(tmp_path):
    """kd_loss='mse' compares whole logits: kd_head_mode='fused' cannot be honoured, refused at set-up."""
    with pytest.raises(ValueError, match="kd_head_mode='fused' cannot be honoured: kd_loss='mse'"):
        Distiller(llama(0), args(tmp_path, kd_loss="mse", kd_head_mode="fused"), llama(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("teacher", ["dense", "signal"])
def test_cuda_fused_mode_bf16_within_half_a_percent_of_float64(teacher):
    """On a GPU (its Triton kernels, its GEMMs): both heads' fused mode in bf16 against the CPU float64 reference,
    a vocabulary of 5,000 in several chunks, padded student ids, a bias, rows counted by one term only."""
    if teacher == "signal":
        h, head, signal, kd_mask, labels = _problem(torch.bfloat16, b=2, t=129, hidden=64, vocab=5000, pad=120, k=32,
                                                    logit_scale=8.0, noise=0.02)
        want = _sparse_reference("jsd", h, head, signal, kd_mask, labels, 2.0, 5000, WEIGHTS)[2:]
        x = h.cuda().requires_grad_(True)
        head = head.cuda()
        kd, ce = sparse_head.sparse_kd_and_ce(x, chunked.LogitsHead(head), tuple(p.cuda() for p in signal),
                                              kd_mask.cuda(), labels.cuda(), chunked.dense_kd("jsd", 2.0, 0.3), 64,
                                              vocab=5000, fused=WEIGHTS)
        (WEIGHTS[0] * kd + WEIGHTS[1] * ce).backward()
        got = (x.grad, head.weight.grad, head.bias.grad)
    else:
        problem = _dense_problem(torch.bfloat16, n=257, hidden=64, vocab=5000, pad=120, noise=0.02, scale=8.0)
        want = _dense_reference("jsd", *problem, WEIGHTS)
        h, s_head, h_t, t_head, kd_mask, labels, vocab = problem
        got = _dense("jsd", h.cuda(), s_head.cuda(), h_t.cuda(), t_head.cuda(), kd_mask.cuda(), labels.cuda(), vocab,
                     WEIGHTS, WEIGHTS, chunk=64)
    for g, r in zip(got, want, strict=True):
        assert _relative(g.cpu(), r) < 5e-3


@pytest.mark.slow
@pytest.mark.parametrize("mask", ["labels", "attention"])
def test_trainer_training_in_fused_mode_equals_the_default_mode(tmp_path, logits_calls, mask, caplog):
    """Two SGD steps with gradient accumulation 2 (each term a mean over its step's tokens) on prompt-masked rows:
    kd_head_mode='fused' gives the default mode's weights and logged losses (1e-6), and its gradients are used as
    formed (no recompute, no warning) also where the KD and CE count different shares of the micro-batches' tokens
    ('attention': the prompts too), since the forward is told each term's step-mean share."""
    from helpers import flat_params

    from hf_distill import DistillationTrainer

    fused_grads._WARNED.clear()
    runs = []
    for mode in ("fused", "recompute"):
        before = logits_calls["recompute"]
        trainer = DistillationTrainer(
            model=llama(0), teacher_model=llama(1),
            args=args(tmp_path / mode, max_steps=2, optim="sgd", learning_rate=0.5, kd_loss="jsd", kd_weight=0.6,
                      task_weight=0.4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      kd_token_mask=mask, kd_head_mode=mode),
            train_dataset=sft_rows(16), data_collator=labelled_collate)
        with caplog.at_level("WARNING"):
            trainer.train()
        recomputed = logits_calls["recompute"] - before
        runs.append(trainer)
        if mode == "fused":
            assert recomputed == 0 and "recomputed the gradient" not in caplog.text
    fused, default = runs
    torch.testing.assert_close(flat_params(fused.model), flat_params(default.model), atol=1e-6, rtol=0)
    for a, b in zip(*([r for r in t.state.log_history if "loss" in r] for t in runs), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


def test_fused_mode_is_refused_with_a_lora_wrapped_lm_head(tmp_path):
    """A LoRA-wrapped LM head is called as a module (autograd forms its gradients): refused when the trainer is built.
    (LoRA on the attention only keeps a plain, frozen head: fused, it forms the hidden states' gradient alone.)"""
    from peft import LoraConfig, get_peft_model

    student = get_peft_model(llama(0), LoraConfig(r=4, target_modules=["lm_head", "q_proj"], lora_dropout=0.0))
    with pytest.raises(ValueError, match="kd_head_mode='fused' cannot be honoured: the student's LM head"):
        Distiller(student, args(tmp_path, kd_head_mode="fused"), llama(1))
    attention_only = get_peft_model(llama(0), LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0))
    Distiller(attention_only, args(tmp_path, kd_head_mode="fused"), llama(1))
