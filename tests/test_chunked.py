"""Causal-LM KD and cross-entropy computed a chunk of tokens at a time equal the whole-logits computation."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import VOCAB, args, bert, flat_params, labelled_collate, llama, padded_llama, sft_rows, word_tokenizer
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    PreTrainedTokenizerFast,
)

from hf_distill import DistillationTrainer, losses
from hf_distill.losses import chunked, kd_head


def _gemma2(seed):
    torch.manual_seed(seed)
    cfg = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                       final_logit_softcapping=3.0)
    return Gemma2ForCausalLM(cfg)


def _cohere(seed):
    torch.manual_seed(seed)
    cfg = CohereConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, logit_scale=0.25)
    return CohereForCausalLM(cfg)


def _batch(seed=0, b=3, t=9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100  # a masked prompt
    return ids, mask, labels


@pytest.mark.parametrize("make", [llama, _gemma2, _cohere], ids=["llama", "gemma2-softcap", "cohere-logit_scale"])
@pytest.mark.parametrize(("kind", "beta"), [("kl", 0.5), ("jsd", 0.3), ("reverse_kl", 0.5)])
def test_chunked_loss_and_gradients_equal_whole_logits(make, kind, beta):
    student, teacher = make(0), make(1)
    chunked.check_logits_fn(student, VOCAB, "student")  # the family's post-processing is rebuilt exactly
    ids, mask, labels = _batch()
    kd_mask = labels[:, 1:] != -100

    out = student(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        t_logits = teacher(input_ids=ids, attention_mask=mask).logits
    whole_kd = losses.logit_kd_loss(kind, out.logits[:, :-1], t_logits[:, :-1], 2.0, mask=kd_mask, beta=beta)
    whole_ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
    (whole_kd + whole_ce).backward()
    whole_grads = [p.grad.clone() for p in student.parameters()]
    student.zero_grad()

    s_out = student(**chunked.hidden_only_kwargs({"input_ids": ids, "attention_mask": mask}))
    assert s_out.logits.numel() == 0  # the student's full logits never exist
    with torch.no_grad():
        t_hidden = chunked.last_hidden(teacher(**chunked.hidden_only_kwargs({"input_ids": ids,
                                                                             "attention_mask": mask})))
    kd, ce = chunked.chunked_kd_and_ce(
        chunked.last_hidden(s_out), chunked.logits_fn(student), chunked.logits_fn(teacher), t_hidden, kd_mask,
        labels[:, 1:], chunked.dense_kd(kind, 2.0, beta), chunk_size=4,
    )
    (kd + ce).backward()
    torch.testing.assert_close(kd, whole_kd, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ce, whole_ce, atol=1e-5, rtol=1e-5)
    for got, want in zip((p.grad for p in student.parameters()), whole_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("make", [llama, _gemma2, _cohere], ids=["llama", "gemma2-softcap", "cohere-logit_scale"])
@pytest.mark.parametrize(("kind", "weights"), [("jsd", (0.7, 0.3)), ("kl", (1.0, 0.0)), ("reverse_kl", (0.0, 2.0)),
                                               ("skew_kl", (0.5, 0.5)), ("tvd", (1.0, 1.0))])
def test_direct_and_module_routes_are_equal(make, kind, weights):
    """The direct head (the weight read, gradient in closed form over vocabulary blocks) and the module route
    (engines: the head called as a module, autograd through float32 logits) give the same weighted loss and every
    gradient (hidden states, the LM head's weight, tied or not), also under an outer factor (GA, loss scaling)."""
    ids, mask, labels = _batch(seed=4)
    kd_mask = labels[:, 1:] != -100
    teacher = make(1)
    batch = {"input_ids": ids, "attention_mask": mask}
    with torch.no_grad():
        t_hidden = chunked.last_hidden(teacher(**chunked.hidden_only_kwargs(batch)))
    results = []
    for route in ("module", "direct"):
        student = make(0)
        s_out = student(**chunked.hidden_only_kwargs(batch))
        kd, ce = chunked.chunked_kd_and_ce(
            chunked.last_hidden(s_out), chunked.logits_fn(student), chunked.logits_fn(teacher), t_hidden, kd_mask,
            labels[:, 1:], chunked.dense_kd(kind, 2.0, 0.4, 0.2), chunk_size=4, route=route)
        loss = weights[0] * kd + weights[1] * ce
        (3.0 * loss).backward()
        results.append((loss.detach(), kd.detach(), ce.detach(), [q.grad for q in student.parameters()]))
    (loss_m, kd_m, ce_m, grads_m), (loss_d, kd_d, ce_d, grads_d) = results
    torch.testing.assert_close(loss_d, loss_m, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kd_d, kd_m, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ce_d, ce_m, atol=1e-6, rtol=1e-6)
    for got, want in zip(grads_d, grads_m, strict=True):
        if want is None:
            assert got is None or not got.any()
        else:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def _head_loss(student, teacher):
    ids, mask, labels = _batch(seed=5)
    batch = chunked.hidden_only_kwargs({"input_ids": ids, "attention_mask": mask})
    with torch.no_grad():
        t_hidden = chunked.last_hidden(teacher(**batch))
    s_hidden = chunked.last_hidden(student(**batch))
    kd, ce = chunked.chunked_kd_and_ce(s_hidden, chunked.logits_fn(student), chunked.logits_fn(teacher), t_hidden,
                                       labels[:, 1:] != -100, labels[:, 1:], chunked.dense_kd("jsd", 1.0, 0.5),
                                       chunk_size=4)
    return 0.5 * kd + 0.5 * ce, kd, ce


def test_loss_head_refuses_double_backward():
    """The gradient is formed in closed form, so there is no graph for a second derivative: say so."""
    student = llama(0)
    loss, _, _ = _head_loss(student, llama(1))
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(loss, [student.get_output_embeddings().weight], create_graph=True)
    loss, _, _ = _head_loss(student, llama(1))
    loss.backward()  # a plain backward is unaffected
    assert student.get_output_embeddings().weight.grad.abs().sum() > 0


def test_loss_head_under_no_grad_computes_the_same_values():
    """A loss computed under no_grad (e.g. logged by a callback) has the same value and no graph."""
    student, teacher = llama(0), llama(1)
    want, kd, ce = _head_loss(student, teacher)
    with torch.no_grad():
        got, kd2, ce2 = _head_loss(student, teacher)
    assert not got.requires_grad
    torch.testing.assert_close(got, want.detach())
    torch.testing.assert_close((kd2, ce2), (kd.detach(), ce.detach()))


@pytest.mark.parametrize("engine", [False, True])
def test_trainer_takes_the_module_route_only_under_engines(tmp_path, monkeypatch, engine):
    """One process and DDP (and fp16, whose loss scale reaches the head's backward like any gradient) read the
    head directly; DeepSpeed and FSDP own the head's parameters inside its module call."""
    used = []
    real = chunked.chunked_kd_and_ce
    monkeypatch.setattr(chunked, "chunked_kd_and_ce", lambda *a, **k: used.append(k["route"]) or real(*a, **k))
    trainer = DistillationTrainer(model=llama(0), teacher_model=llama(1), args=args(tmp_path, kd_loss="jsd"),
                                  train_dataset=sft_rows(4), data_collator=labelled_collate)
    trainer.is_deepspeed_enabled = engine  # set by Trainer.__init__ from the accelerator
    trainer.model.train()
    trainer.compute_loss(trainer.model, labelled_collate([sft_rows(4)[i] for i in range(4)]))
    assert used == (["module"] if engine else ["auto"])


@pytest.mark.parametrize("tied", [False, True])
def test_trainer_loss_head_equals_whole_logits_with_accumulation(tmp_path, tied):
    """Two SGD steps of jsd + CE with gradient accumulation and masked prompts: the trainer's loss head (the
    default for causal LMs) and the whole-logits path give the same weights and the same logged terms."""
    runs = []
    for whole in (False, True):
        trainer = DistillationTrainer(
            model=llama(0, tie_word_embeddings=tied), teacher_model=llama(1, layers=3),
            args=args(tmp_path / str(whole), max_steps=2, per_device_train_batch_size=2,
                      gradient_accumulation_steps=2, optim="sgd", learning_rate=0.5, kd_loss="jsd", jsd_beta=0.3,
                      kd_weight=0.6, task_weight=0.4, temperature=2.0, kd_chunk_size=3),
            train_dataset=sft_rows(8), data_collator=labelled_collate)
        if whole:
            trainer.distiller.paths.chunk = None  # the path used where chunking is impossible
        trainer.train()
        runs.append(trainer)
    head, whole = runs
    torch.testing.assert_close(flat_params(head.model), flat_params(whole.model), atol=1e-6, rtol=0)
    logs = [[r for r in t.state.log_history if "loss" in r] for t in runs]
    assert len(logs[0]) == 2
    for a, b in zip(*logs, strict=True):
        for key in ("loss", "loss_kd", "loss_task"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key


def test_moe_students_router_loss_is_in_the_task_term_on_the_loss_head(tmp_path):
    """A mixture-of-experts student with `output_router_logits`: its own loss is CE + router_aux_loss_coef * aux_loss.
    The loss head runs it without labels, so the load-balancing term must be added back: same weights and logged
    terms as whole logits (the model's own loss). Found by comparing with TRL's SFTTrainer (the term was missing)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    def moe():
        torch.manual_seed(0)
        return MixtralForCausalLM(MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1,
            output_router_logits=True, max_position_embeddings=64))

    runs = []
    for whole in (False, True):
        trainer = DistillationTrainer(
            model=moe(), teacher_model=llama(1),
            args=args(tmp_path / str(whole), max_steps=2, per_device_train_batch_size=2,
                      gradient_accumulation_steps=2, optim="sgd", learning_rate=0.5, kd_loss="jsd",
                      kd_weight=0.6, task_weight=0.4),
            train_dataset=sft_rows(8), data_collator=labelled_collate)
        if whole:
            trainer.distiller.paths.chunk = None
        trainer.train()
        runs.append(trainer)
    head, whole = runs
    assert head.distiller._student_state(head.model).rebuilds
    torch.testing.assert_close(flat_params(head.model), flat_params(whole.model), atol=1e-6, rtol=0)
    logs = [[r for r in t.state.log_history if "loss" in r] for t in runs]
    for a, b in zip(*logs, strict=True):
        for key in ("loss", "loss_kd", "loss_task"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key


def _run(tmp_path, student, teacher, **kw):
    trainer = DistillationTrainer(model=student, teacher_model=teacher,
                                  args=args(tmp_path, max_steps=1, per_device_train_batch_size=8, optim="sgd",
                                            learning_rate=0.5, kd_loss="jsd", **kw),
                                  train_dataset=sft_rows(8), data_collator=labelled_collate)
    trainer.train()
    return trainer


def test_trainer_update_with_tiny_chunks_equals_one_chunk(tmp_path):
    """Chunks of 3 tokens give the same SGD update as one chunk holding every token."""
    a = _run(tmp_path / "a", llama(0), llama(1, layers=3), kd_chunk_size=3)
    b = _run(tmp_path / "b", llama(0), llama(1, layers=3), kd_chunk_size=10_000)
    assert a.distiller.paths.chunk == 3 and b.distiller.paths.chunk == 10_000
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=0)


def test_causal_lm_students_chunk_by_default(tmp_path):
    trainer = DistillationTrainer(model=llama(0), teacher_model=llama(1), args=args(tmp_path),
                                  train_dataset=sft_rows(4), data_collator=labelled_collate)
    assert trainer.distiller.paths.chunk == chunked.default_chunk(VOCAB)


@pytest.mark.parametrize("value", [0, -4])
def test_kd_chunk_size_must_be_positive(tmp_path, value):
    with pytest.raises(ValueError, match="kd_chunk_size"):
        args(tmp_path, kd_chunk_size=value)


def test_kd_chunk_size_that_cannot_be_honoured_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a causal LM"):
        DistillationTrainer(model=bert(2), teacher_model=bert(2, seed=1), args=args(tmp_path, kd_chunk_size=8),
                            train_dataset=sft_rows(4), data_collator=labelled_collate)
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        DistillationTrainer(model=llama(0), teacher_model=llama(1),
                            args=args(tmp_path, kd_chunk_size=8, label_smoothing_factor=0.1),
                            train_dataset=sft_rows(4), data_collator=labelled_collate)


def test_causal_student_with_a_classification_teacher_is_refused(tmp_path):
    with pytest.raises(ValueError, match="causal-LM teacher"):
        DistillationTrainer(model=llama(0), teacher_model=bert(2), args=args(tmp_path),
                            train_dataset=sft_rows(4), data_collator=labelled_collate)


# ---------------------------------------------------------------- vocabularies


def _tokenizer(words):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")


WORDS = [f"w{i}" for i in range(100)]


def test_padded_vocabularies_of_one_tokenizer_compare_their_shared_ids(tmp_path):
    tokenizer = _tokenizer(WORDS)  # 102 tokens: fits both models
    student, teacher = llama(0, vocab=VOCAB), padded_llama(1, VOCAB, 16)  # the teacher's last 16 ids are padding
    s0, t0 = copy.deepcopy(student), copy.deepcopy(teacher)
    teacher.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    trainer = DistillationTrainer(model=student, teacher_model=str(tmp_path / "teacher"),
                                  args=args(tmp_path, max_steps=1, per_device_train_batch_size=8, temperature=1.0,
                                            kd_token_mask="attention"),
                                  train_dataset=sft_rows(8), data_collator=labelled_collate, processing_class=tokenizer)
    assert trainer.distiller.paths.context.shared_vocab == VOCAB
    trainer.train()
    batch = labelled_collate([sft_rows(8)[i] for i in range(8)])
    with torch.no_grad():
        s = s0(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        t = t0(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    real = batch["attention_mask"].bool()
    expected = losses.kl_div(s[:, :-1], t[:, :-1, :VOCAB], 1.0, mask=real[:, :-1] & real[:, 1:])
    log = next(r for r in trainer.state.log_history if "loss" in r)
    assert log["loss_kd"] == pytest.approx(float(expected), rel=1e-4)


def test_different_tokenizers_are_refused(tmp_path):
    teacher = llama(1, vocab=VOCAB + 16)
    teacher.save_pretrained(tmp_path / "teacher")
    _tokenizer([f"x{i}" for i in range(100)]).save_pretrained(tmp_path / "teacher")
    with pytest.raises(ValueError, match="tokenizer"):
        DistillationTrainer(model=llama(0), teacher_model=str(tmp_path / "teacher"), args=args(tmp_path),
                            train_dataset=sft_rows(4), data_collator=labelled_collate,
                            processing_class=_tokenizer(WORDS))


def test_different_vocabulary_sizes_without_a_tokenizer_are_refused(tmp_path):
    with pytest.raises(ValueError, match="processing_class"):
        DistillationTrainer(model=llama(0), teacher_model=llama(1, vocab=VOCAB + 16), args=args(tmp_path),
                            train_dataset=sft_rows(4), data_collator=labelled_collate)


# ---------------------------------------------------------------- PEFT


def test_lora_causal_student_trains_adapters_only_with_chunks(tmp_path):
    from peft import LoraConfig, get_peft_model

    base = llama(0)
    student = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    frozen = {n: p.detach().clone() for n, p in student.named_parameters() if not p.requires_grad}
    lora = {n: p.detach().clone() for n, p in student.named_parameters() if p.requires_grad}
    trainer = _run(tmp_path, student, llama(1), kd_chunk_size=4)
    assert trainer.distiller.paths.chunk == 4
    for n, p in trainer.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    assert any(not torch.equal(p, lora[n]) for n, p in trainer.model.named_parameters() if n in lora)
    log = next(r for r in trainer.state.log_history if "loss" in r)
    assert log["loss_kd"] > 0 and log["loss_task"] > 0


# ---------------------------------------------------------------- precision against float64 (issue #29)

DIVERGENCES = ["kl", "reverse_kl", "jsd", "skew_kl", "skew_reverse_kl", "tvd", "soft_ce"]


def _agreement_inputs(dtype, scale, n=64, hidden=32, vocab=1000, pad=0, seed=0):
    """Teacher and student LM heads and states in `dtype`, the student = teacher + 2% noise (the agreement regime
    every KD run reaches), logits of size ~`scale`."""
    g = torch.Generator().manual_seed(seed)
    h_t = torch.randn(n + 1, hidden, generator=g)
    w_t = torch.randn(vocab, hidden, generator=g) * scale / hidden**0.5
    h_s = h_t + 0.02 * torch.randn(n + 1, hidden, generator=g)
    w_s = torch.cat([w_t + 0.02 * torch.randn(vocab, hidden, generator=g) * scale / hidden**0.5,
                     torch.randn(pad, hidden, generator=g) * scale / hidden**0.5])
    s_head, t_head = torch.nn.Linear(hidden, vocab + pad, bias=False), torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        s_head.weight.copy_(w_s)
        t_head.weight.copy_(w_t)
    labels = torch.randint(0, vocab + pad, (n,), generator=g)
    return h_s.to(dtype), s_head.to(dtype), h_t.to(dtype), t_head.to(dtype), labels


def _reference(kind, h_s, s_head, h_t, t_head, labels, temperature, weights, vocab):
    """The loss and its gradients in float64 on the same low-precision inputs."""
    h = h_s.detach().double().requires_grad_(True)
    w = s_head.weight.detach().double().requires_grad_(True)
    zs = h[:-1] @ w.T
    zt = h_t.double()[:-1] @ t_head.weight.double().T
    log_q = torch.log_softmax(zs[:, :vocab] / temperature, -1)
    log_p = torch.log_softmax(zt / temperature, -1)
    value, _ = losses.divergence_rows(kind, log_q, log_p, beta=0.4, alpha=0.1)
    kd = value.mean() * (1.0 if kind == "soft_ce" else temperature**2)
    ce = F.cross_entropy(zs, labels)
    (weights[0] * kd + weights[1] * ce).backward()
    return kd.detach(), h.grad, w.grad


def _relative(got, want):
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scale", [4.0, 16.0])
@pytest.mark.parametrize("route", ["direct", "module"])
@pytest.mark.parametrize("kind", DIVERGENCES)
def test_low_precision_gradients_are_within_half_a_percent_of_float64(kind, route, scale, dtype):
    """Near agreement a bf16-rounded logit is as large as the divergence gradient itself (8-27% off float64 at this
    shape with bf16 logits); the loss head's float32-output GEMMs keep KD + CE gradients within 0.5%."""
    h_s, s_head, h_t, t_head, labels = _agreement_inputs(dtype, scale)
    weights = (0.7, 0.3)
    want_kd, want_h, want_w = _reference(kind, h_s, s_head, h_t, t_head, labels, 2.0, weights, 1000)
    x = h_s[None].clone().requires_grad_(True)
    kd, ce = chunked.chunked_kd_and_ce(
        x, chunked.LogitsHead(s_head), chunked.LogitsHead(t_head), h_t[None], None, labels[None],
        chunked.dense_kd(kind, 2.0, 0.4, 0.1), chunk_size=16, route=route)
    (weights[0] * kd + weights[1] * ce).backward()
    assert _relative(x.grad[0], want_h) < 5e-3
    assert _relative(s_head.weight.grad, want_w) < 5e-3
    assert float(kd.detach()) == pytest.approx(float(want_kd), rel=1e-3, abs=1e-6)


def test_backward_casts_each_float32_weight_block_once_under_autocast(monkeypatch):
    """Mixed precision (float32 LM-head weights, bf16 autocast: the Trainer's bf16=True): the default mode's backward
    casts each vocabulary block of the student's weight to bf16 once, for both the block's logits and its `dL/dH`
    product (not once per product: a whole weight's cast a step saved); the gradients stay float64's."""
    from helpers import OpTrace

    h_s, s_head, h_t, t_head, labels = _agreement_inputs(torch.float32, 4.0)
    trace, walk, logits = OpTrace(), kd_head._backward_walk, []
    real_logits = kd_head._head_logits
    monkeypatch.setattr(kd_head, "_head_logits", lambda *a, **kw: logits.append(1) or real_logits(*a, **kw))

    def traced(*a, **kw):  # the backward's own ops (a mode entered outside does not reach the autograd backward)
        with trace:
            return walk(*a, **kw)

    monkeypatch.setattr(kd_head, "_backward_walk", traced)
    t_logits = (h_t[:-1] @ t_head.weight.T).detach()[None]  # a dense cached teacher: the student's weight alone is cast
    x = h_s[None].clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kd, ce = chunked.chunked_kd_and_ce(x, chunked.LogitsHead(s_head), t_logits, None, None, labels[None],
                                           chunked.dense_kd("kl", 1.0), chunk_size=16)
    forward_calls = len(logits)
    (0.7 * kd + 0.3 * ce).backward()
    blocks = len(logits) - forward_calls
    hidden = h_s.shape[1]
    casts = sum(1 for name, args, outs in trace.ops if name == "to" and args and args[0][1] == torch.float32
                and args[0][0][1:] == (hidden,) and args[0][0][0] != h_s.shape[0] - 1 and outs
                and outs[0][1] == torch.bfloat16)
    assert blocks > 1 and casts == blocks
    # float64 on the operands the GEMMs multiply (autocast's bf16 roundings of the float32 states and weight)
    h64 = h_s.bfloat16().double().requires_grad_(True)
    w64 = s_head.weight.detach().bfloat16().double().requires_grad_(True)
    z64 = h64[:-1] @ w64.T
    want = 0.7 * losses.logit_kd_loss("kl", z64, t_logits[0].double(), 1.0) + 0.3 * F.cross_entropy(z64, labels)
    want.backward()
    assert _relative(s_head.weight.grad, w64.grad) < 5e-3 and _relative(x.grad[0], h64.grad) < 5e-3


def test_bf16_rounded_logits_fail_the_bound_this_test_sets():
    """The regime above discriminates: the same loss from logits rounded to bf16 by their GEMM (what the model's own
    head, a plain chunked head, or whole logits under autocast give) is far outside 0.5%."""
    h_s, s_head, h_t, t_head, labels = _agreement_inputs(torch.bfloat16, 16.0)
    _, want_h, _ = _reference("kl", h_s, s_head, h_t, t_head, labels, 2.0, (1.0, 0.0), 1000)
    x = h_s.clone().requires_grad_(True)
    zs, zt = s_head(x)[:-1].float(), t_head(h_t)[:-1].float()  # bf16 GEMM outputs, float32 loss math
    losses.kl_div(zs, zt, 2.0).backward()
    assert _relative(x.grad, want_h) > 0.05


def test_float32_models_keep_their_exactness():
    h_s, s_head, h_t, t_head, labels = _agreement_inputs(torch.float32, 16.0)
    want_kd, want_h, want_w = _reference("jsd", h_s, s_head, h_t, t_head, labels, 2.0, (0.5, 0.5), 1000)
    x = h_s[None].clone().requires_grad_(True)
    kd, ce = chunked.chunked_kd_and_ce(x, chunked.LogitsHead(s_head), chunked.LogitsHead(t_head), h_t[None], None,
                                       labels[None], chunked.dense_kd("jsd", 2.0, 0.4), chunk_size=16)
    (0.5 * kd + 0.5 * ce).backward()
    assert _relative(x.grad[0], want_h) < 1e-5 and _relative(s_head.weight.grad, want_w) < 1e-5


@pytest.mark.parametrize("route", ["direct", "module"])
def test_cross_entropy_covers_the_students_whole_padded_vocabulary(route):
    """A student with extra (padded) ids: KD compares the shared ids, the CE is the model's own over every id."""
    h_s, s_head, h_t, t_head, labels = _agreement_inputs(torch.float32, 4.0, vocab=200, pad=56)
    labels[:4] = torch.arange(200, 204)  # targets among the student's extra ids too
    kd, ce = chunked.chunked_kd_and_ce(h_s[None], chunked.LogitsHead(s_head), chunked.LogitsHead(t_head),
                                       h_t[None], None, labels[None], chunked.dense_kd("kl", 1.0), chunk_size=8,
                                       vocab=200, route=route)
    with torch.no_grad():
        zs = s_head(h_s)[:-1]
        torch.testing.assert_close(ce, F.cross_entropy(zs, labels))
        torch.testing.assert_close(kd, losses.kl_div(zs[:, :200], t_head(h_t)[:-1], 1.0))


def test_trainer_task_loss_with_a_padded_student_vocabulary_is_the_models_own(tmp_path):
    """Issue #28 case 6: the default (chunked) path logs the CE the student itself computes over its whole
    vocabulary, not over the ids it shares with the teacher."""
    tokenizer = _tokenizer(WORDS)
    student, teacher = llama(0, vocab=VOCAB + 16), llama(1, vocab=VOCAB)
    s0 = copy.deepcopy(student)
    teacher.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    trainer = DistillationTrainer(model=student, teacher_model=str(tmp_path / "teacher"),
                                  args=args(tmp_path, max_steps=1, per_device_train_batch_size=8, temperature=1.0),
                                  train_dataset=sft_rows(8), data_collator=labelled_collate, processing_class=tokenizer)
    assert trainer.distiller.paths.chunk is not None
    trainer.train()
    batch = labelled_collate([sft_rows(8)[i] for i in range(8)])
    with torch.no_grad():
        own = s0(**batch).loss
    log = next(r for r in trainer.state.log_history if "loss" in r)
    assert log["loss_task"] == pytest.approx(float(own), rel=1e-4)


# ---------------------------------------------------------------- on CUDA (skipped elsewhere; benchmarks/gpu_checks.sh)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_cuda_loss_head_bf16_within_half_a_percent_of_float64(monkeypatch, compiled):
    """On CUDA the GEMMs write float32 (`out_dtype`) and the elementwise work is compiled by default: both the
    compiled and the eager head stay within 0.5% of float64, and they agree with each other."""
    monkeypatch.setenv("HF_DISTILL_COMPILE", "1" if compiled else "0")
    chunked._fused.cache_clear()
    h_s, s_head, h_t, t_head, labels = _agreement_inputs(torch.bfloat16, 16.0, n=512, hidden=64, vocab=8192)
    h_s, s_head, h_t, t_head, labels = h_s.cuda(), s_head.cuda(), h_t.cuda(), t_head.cuda(), labels.cuda()
    want_kd, want_h, want_w = _reference("jsd", h_s, s_head, h_t, t_head, labels, 2.0, (0.7, 0.3), 8192)
    x = h_s[None].clone().requires_grad_(True)
    kd, ce = chunked.chunked_kd_and_ce(x, chunked.LogitsHead(s_head), chunked.LogitsHead(t_head), h_t[None], None,
                                       labels[None], chunked.dense_kd("jsd", 2.0, 0.4), chunk_size=64)
    (0.7 * kd + 0.3 * ce).backward()
    chunked._fused.cache_clear()
    assert _relative(x.grad[0], want_h) < 5e-3
    assert _relative(s_head.weight.grad, want_w) < 5e-3
    assert float(kd.detach()) == pytest.approx(float(want_kd), rel=1e-3)


@cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_causal_lm_trains_through_the_loss_head_in_half_precision(tmp_path, precision):
    """fp16's GradScaler multiplies the loss before backward: the head's gradient, formed in the backward, carries
    the scale like any other, so no step is skipped for overflow and the LM head trains."""
    student = llama(0).cuda()
    before = student.get_output_embeddings().weight.detach().clone()
    trainer = DistillationTrainer(model=student, teacher_model=llama(1).cuda(),
                                  args=args(tmp_path, use_cpu=False, max_steps=3, kd_loss="jsd", **{precision: True}),
                                  train_dataset=sft_rows(24), data_collator=labelled_collate)
    assert trainer.distiller.paths.chunk is not None
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert len(logs) == 3 and all(math.isfinite(r["loss"]) and math.isfinite(r["loss_kd"]) for r in logs)
    assert not torch.equal(student.get_output_embeddings().weight.detach(), before)


_TRITON_CHECK = r"""
import torch
from hf_distill.losses import chunked, kd_head, triton_head
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
n, V = 5, 3000
zt = torch.randn(n, V, device=device) * 6
zs = zt + 0.05 * torch.randn(n, V, device=device)
y = torch.randint(0, V, (n,), device=device)
for kind in [*triton_head.KIND_CODES, None]:
    for T, vocab, tg in [(1.0, V, y), (2.0, V - 100, y), (1.0, V, None), (0.7, V - 7, y)]:
        if kind is None and tg is None:
            continue
        zt_ = zt[:, :vocab].contiguous() if kind is not None else None
        want = chunked._row_stats(zs, zt_, tg, kind, T, 0.3, 0.2, vocab)
        got = triton_head.row_stats(zs, zt_, tg, kind, T, 0.3, 0.2, vocab)
        for a, b in zip(want, got):
            assert (a is None) == (b is None), kind
            if a is not None:
                torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    if kind not in (None, "soft_ce"):
        at = triton_head.row_stats(zt.clone(), zt.clone(), None, kind, 2.0, 0.3, 0.2, V)
        assert float(at[4].abs().max()) == 0.0, kind  # a true divergence: exactly 0 at agreement
# the backward's gradient block: columns 700..2700 of every row (a start offset, a block shorter than a tile)
lo, hi = 700, 2700
w_ce, w_kd = torch.rand(n, device=device), torch.rand(n, device=device)
w_ce[1] = 0.0
y[0], y[2] = 1000, 5  # one target inside the block, one before it
for kind in [*triton_head.KIND_CODES, None]:
    for T, tg, cap, scale, dtype in [(1.0, y, None, 1.0, torch.bfloat16), (2.0, None, 30.0, 0.5, torch.float32),
                                     (0.7, y, 50.0, 1.0, torch.float32)]:
        if kind is None and tg is None:
            continue
        zt_ = zt if kind is not None else None
        lse1, _, lse_a, lse_b, _, stat = chunked._row_stats(zs, zt_, y, kind, T, 0.3, 0.2, V)
        args = (zs[:, lo:hi], None if zt_ is None else zt_[:, lo:hi], lo, tg, lse1, w_ce, lse_a, lse_b, stat, w_kd,
                kind, T, 0.3, 0.2, scale, cap, dtype)
        want = kd_head._grad_block(*args)
        got = triton_head.grad_block(*args)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        assert float(want.float().abs().max()) > 0, kind
        if dtype == torch.bfloat16:  # one rounding of values that may differ in their last float32 bits
            torch.testing.assert_close(got.float(), want.float(), atol=1e-2 * float(want.float().abs().max()),
                                       rtol=1e-2)
            continue
        # float32: the same formulas in another order (Kahan's expm1/log1p), so both stand against float64 (the
        # near-agreement cancellation makes either 1e-4 off at worst): the kernel no further than PyTorch's + 1e-6
        d64 = lambda x: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        lse1_, _, lse_a_, lse_b_, _, stat_ = chunked._row_stats(d64(zs), d64(zt_), y, kind, T, 0.3, 0.2, V)
        ref = kd_head._grad_block(*(d64(a) for a in args[:4]), lse1_, d64(w_ce), lse_a_, lse_b_, stat_, d64(w_kd),
                                  *args[10:16], torch.float64)
        err = lambda x: float((x.double() - ref).norm() / ref.norm())
        assert err(got) <= 1.5 * err(want) + 1e-6, (kind, T, err(got), err(want))
print("ok")
"""


_INTERPRETER_PROBE = r"""
import torch
import triton
import triton.language as tl


@triton.jit
def probe(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):  # a loop over a runtime bound, as the head's kernels walk a row
        c = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + row * n_cols + c, mask=c < n_cols, other=0.0)
    tl.store(out_ptr + row, tl.sum(acc, 0))


x = torch.arange(30, dtype=torch.float32).reshape(3, 10)
out = torch.empty(3)
probe[(3,)](x, out, 10, BLOCK=4)
assert torch.equal(out, x.sum(1)), out
print("ok")
"""


def _run_script(tmp_path, name: str, text: str, interpret: bool, *argv: str):
    import os
    import subprocess
    import sys

    script = tmp_path / name
    script.write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(script), *argv], env=env, capture_output=True, text=True, timeout=600)


_INTERPRETER: dict[str, str | None] = {}


def _skip_unless_the_interpreter_runs(tmp_path) -> None:
    """Skip (with the reason) where Triton's CPU interpreter cannot run a kernel at all: a tiny kernel of the head
    kernels' constructs (program id, a loop over a runtime bound, masked loads, a reduction) is run in it first, so
    a failure of the head's own kernels is never taken for the interpreter's. Triton 3.6's interpreter breaks on
    numpy >= 2.3 ("only 0-dimensional arrays can be converted to Python scalars", in a loop bound)."""
    triton = pytest.importorskip("triton")
    if "problem" not in _INTERPRETER:
        done = _run_script(tmp_path, "probe.py", _INTERPRETER_PROBE, True)
        lines = (done.stderr.strip() or "no output").splitlines()
        _INTERPRETER["problem"] = None if done.returncode == 0 and "ok" in done.stdout else lines[-1][-300:]
    if _INTERPRETER["problem"] is not None:
        import numpy

        pytest.skip(f"Triton {triton.__version__}'s CPU interpreter cannot run a kernel here (numpy "
                    f"{numpy.__version__}): {_INTERPRETER['problem']}")


@pytest.mark.slow
def test_triton_kernels_equal_the_pytorch_reference(tmp_path):
    """The CUDA forward's and backward's Triton kernels against `chunked._row_stats` and `kd_head._grad_block` for
    every divergence, temperature, padded vocabulary, CE, soft cap and output dtype: on a GPU directly, elsewhere
    in Triton's CPU interpreter (runs where triton is installed and its interpreter can run a kernel)."""
    pytest.importorskip("triton")
    interpret = not torch.cuda.is_available()
    if interpret:
        _skip_unless_the_interpreter_runs(tmp_path)
    done = _run_script(tmp_path, "check.py", _TRITON_CHECK, interpret)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


_TRITON_HEAD_CHECK = """
import sys

import torch
from hf_distill import losses
from hf_distill.losses import chunked, triton_head

device = sys.argv[1]  # "cpu": the kernels in Triton's interpreter; "cuda": the real kernels on the GPU
torch.backends.cuda.matmul.allow_tf32 = False  # float32 GEMMs in float32, against float64 at 1e-5
calls = []
for name in ("row_stats", "grad_block"):
    kernel = getattr(triton_head, name)
    setattr(triton_head, name, lambda *a, _k=kernel, **kw: calls.append(1) or _k(*a, **kw))
if device == "cpu":
    triton_head.available = lambda device: True  # the CUDA path, its kernels in Triton's interpreter on a CPU
g = torch.Generator().manual_seed(0)
h = torch.randn(2, 40, 16, generator=g)
s_head, t_head = torch.nn.Linear(16, 300, bias=False), torch.nn.Linear(16, 300, bias=False)
with torch.no_grad():
    s_head.weight.copy_(torch.randn(300, 16, generator=g) * 0.8)
    t_head.weight.copy_(s_head.weight + 0.3 * torch.randn(300, 16, generator=g))
h_t = h + 0.1 * torch.randn(h.shape, generator=g)
labels = torch.randint(0, 300, (2, 39), generator=g)
h, h_t, labels, s_head, t_head = h.to(device), h_t.to(device), labels.to(device), s_head.to(device), t_head.to(device)
for kind in ("kl", "jsd", "skew_reverse_kl", "tvd"):
    x = h.clone().requires_grad_(True)
    s_head.weight.grad = None
    kd, ce = chunked.chunked_kd_and_ce(x, chunked.LogitsHead(s_head), chunked.LogitsHead(t_head), h_t, None,
                                       labels, chunked.dense_kd(kind, 2.0, 0.3, 0.2), chunk_size=16)
    (0.6 * kd + 0.4 * ce).backward()
    x64 = h.double().requires_grad_(True)
    w64 = s_head.weight.detach().double().requires_grad_(True)
    z = (x64 @ w64.T)[:, :-1]
    z_t = (h_t.double() @ t_head.weight.detach().double().T)[:, :-1]
    kd64 = losses.logit_kd_loss(kind, z, z_t, 2.0, beta=0.3, alpha=0.2)
    ce64 = torch.nn.functional.cross_entropy(z.reshape(-1, 300), labels.reshape(-1))
    (0.6 * kd64 + 0.4 * ce64).backward()
    assert abs(float(kd) - float(kd64)) <= 1e-5 * abs(float(kd64)) + 1e-7, (kind, float(kd), float(kd64))
    for got, want in ((x.grad, x64.grad), (s_head.weight.grad, w64.grad)):
        assert float((got.double() - want).norm() / want.norm()) < 1e-5, kind
assert len(calls) >= 8
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["interpreter", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_loss_head_through_the_triton_kernels_equals_float64(tmp_path, where):
    """The whole CUDA walk of the loss head (token chunks through the row-statistics kernel, vocabulary blocks
    through the gradient kernel) against float64 whole logits: on a CPU in Triton's interpreter, so that a change to
    the head's walk is checked without a GPU (where triton is installed and its interpreter can run a kernel), and on
    a GPU with the real kernels (benchmarks/gpu_checks.sh runs it: its `-k "cuda or triton"` selects both)."""
    pytest.importorskip("triton")
    if where == "interpreter":
        _skip_unless_the_interpreter_runs(tmp_path)
    done = _run_script(tmp_path, "check_head.py", _TRITON_HEAD_CHECK, where == "interpreter",
                       "cpu" if where == "interpreter" else "cuda")
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("kind", ["jsd", "skew_reverse_kl"])
def test_cpu_row_slices_give_the_same_loss_and_gradients(monkeypatch, kind):
    """On the CPU the elementwise work runs over slices of rows (temporaries of cache size): slicing changes
    nothing, whatever the slice (here 2 rows of the 64, and a last slice shorter than the others)."""
    h_s, s_head, h_t, t_head, labels = _agreement_inputs(torch.float32, 8.0, n=63, vocab=500, pad=12)
    results = []
    for elements in (1 << 20, 1000):
        monkeypatch.setattr(kd_head, "_CPU_ELEMENTS", elements)
        x = h_s[None].clone().requires_grad_(True)
        s_head.weight.grad = None
        kd, ce = chunked.chunked_kd_and_ce(x, chunked.LogitsHead(s_head), chunked.LogitsHead(t_head), h_t[None],
                                           None, labels[None], chunked.dense_kd(kind, 2.0, 0.3, 0.2), chunk_size=16,
                                           vocab=500)
        (kd + ce).backward()
        results.append((kd.detach(), ce.detach(), x.grad.clone(), s_head.weight.grad.clone()))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("route", ["direct", "module"])
@pytest.mark.parametrize(("beta", "same_as"), [(0.0, "kl"), (1.0, "reverse_kl")])
def test_jsd_at_beta_0_and_1_is_the_forward_and_reverse_kl(route, beta, same_as):
    """GKD's convention: JSD(0) = KL(P || Q), JSD(1) = KL(Q || P), on both routes (the mixture formula is
    identically 0 there, so the head must not use it)."""
    h_s, s_head, h_t, t_head, labels = _agreement_inputs(torch.float32, 8.0)
    results = []
    for kind in ("jsd", same_as):
        x = h_s[None].clone().requires_grad_(True)
        kd, _ = chunked.chunked_kd_and_ce(x, chunked.LogitsHead(s_head), chunked.LogitsHead(t_head), h_t[None], None,
                                          None, chunked.dense_kd(kind, 2.0, beta), chunk_size=16, route=route)
        kd.backward()
        results.append((kd.detach(), x.grad))
    assert float(results[0][0]) > 1e-4
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    value, _ = losses.divergence_rows("jsd", torch.log_softmax(h_s @ s_head.weight.T, -1).detach(),
                                      torch.log_softmax(h_t @ t_head.weight.T, -1).detach(), beta=beta)
    assert float(value.mean()) > 1e-4


def test_causal_lm_with_kd_loss_mse_trains_on_whole_logits(tmp_path):
    """`mse` compares raw logits, which the loss head does not keep: the trainer computes it from whole logits
    (logged), and refuses a kd_chunk_size asked for with it."""
    trainer = DistillationTrainer(model=llama(0), teacher_model=llama(1),
                                  args=args(tmp_path, kd_loss="mse", max_steps=1),
                                  train_dataset=sft_rows(8), data_collator=labelled_collate)
    assert trainer.distiller.paths.chunk is None
    trainer.train()
    assert math.isfinite(next(r for r in trainer.state.log_history if "loss" in r)["loss_kd"])
    with pytest.raises(ValueError, match="mse"):
        DistillationTrainer(model=llama(0), teacher_model=llama(1), args=args(tmp_path, kd_loss="mse",
                                                                              kd_chunk_size=8),
                            train_dataset=sft_rows(8), data_collator=labelled_collate)


def test_different_vocabularies_without_vocab_are_refused_on_both_routes():
    h_s, s_head, h_t, t_head, labels = _agreement_inputs(torch.float32, 4.0, vocab=200, pad=8)
    for route in ("direct", "module"):
        with pytest.raises(ValueError, match="vocab="):
            chunked.chunked_kd_and_ce(h_s[None], chunked.LogitsHead(s_head), chunked.LogitsHead(t_head), h_t[None],
                                      None, labels[None], chunked.dense_kd("kl", 1.0), chunk_size=8, route=route)


def test_every_divergence_has_a_triton_code_and_a_closed_form_gradient():
    """The loss head's three implementations cover one list (hf_distill.losses.DIVERGENCE_KINDS)."""
    from hf_distill.losses import triton_head

    assert set(triton_head.KIND_CODES) == set(losses.DIVERGENCE_KINDS) == set(chunked.DIVERGENCES)
    la, lb = torch.log_softmax(torch.randn(3, 7), -1), torch.log_softmax(torch.randn(3, 7), -1)
    for kind in losses.DIVERGENCE_KINDS:
        _, stat = losses.divergence_rows(kind, la, lb, 0.3, 0.2)
        assert chunked.row_gradient(kind, la, lb, stat[:, None], 0.3, 0.2).shape == la.shape


# ---------------------------------------------------------------------- mixed precision (bf16=True)

AMP_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="needs a CUDA device"))]


@pytest.mark.slow
@pytest.mark.parametrize("signal", [False, True], ids=["teacher", "teacher-signal"])
@pytest.mark.parametrize("device", AMP_DEVICES)
def test_bf16_mixed_precision_trains_through_the_loss_head(tmp_path, monkeypatch, caplog, device, signal):
    """bf16=True (accelerate's autocast around the model's forward, float32 weights): the loss head is used, not
    whole logits, and multiplies in bf16 as the model's own LM head does there (a float32 head would be 10x slower
    on a GPU). Found on an H200: the check that the logits can be rebuilt ran outside that autocast, so every
    mixed-precision run fell back to whole logits. The head's KD and CE equal a float64 computation from the same
    hidden states within bf16's rounding of the operands."""
    student, teacher = llama(0), llama(1)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(8.0)  # a confident teacher: the KD term is far from 0
    w_s, w_t = student.lm_head.weight.detach().double().clone(), teacher.lm_head.weight.detach().double().clone()
    rows, tokenizer = sft_rows(8), None
    if signal:
        from hf_distill.data.teacher_signal import attach_teacher_signal, create_teacher_signal

        tokenizer = word_tokenizer([f"w{i}" for i in range(VOCAB - 2)])
        rows = attach_teacher_signal(rows, create_teacher_signal(
            teacher, rows, tmp_path / "signal", tokenizer=tokenizer, k=VOCAB, batch_size=4, temperature=2.0,
            progress=False))
    seen, dtypes = [], set()
    head_call, mm = chunked.chunked_kd_and_ce, kd_head.mm_f32

    def spy(s_hidden, s_head, teacher_, t_hidden, kd_mask, labels, *a, **k):
        kd, ce = head_call(s_hidden, s_head, teacher_, t_hidden, kd_mask, labels, *a, **k)
        seen.append((s_hidden.detach().clone(), None if t_hidden is None else t_hidden.detach().clone(), kd_mask,
                     labels, float(kd.detach()), float(ce.detach())))
        return kd, ce

    def spy_mm(a, b):
        dtypes.add((a.dtype, b.dtype))
        return mm(a, b)

    from hf_distill.losses import sparse_head

    sparse_call = sparse_head.sparse_kd_and_ce

    def sparse_spy(s_hidden, s_head, teacher_, kd_mask, labels, *a, **k):  # the signal's head: no teacher hidden
        kd, ce = sparse_call(s_hidden, s_head, teacher_, kd_mask, labels, *a, **k)
        seen.append((s_hidden.detach().clone(), None, kd_mask, labels, float(kd.detach()), float(ce.detach())))
        return kd, ce

    monkeypatch.setattr(chunked, "chunked_kd_and_ce", spy)
    monkeypatch.setattr(sparse_head, "sparse_kd_and_ce", sparse_spy)
    monkeypatch.setattr(kd_head, "mm_f32", spy_mm)
    monkeypatch.setattr(sparse_head, "mm_f32", spy_mm, raising=False)
    kw = dict(remove_unused_columns=False) if signal else {}
    trainer = DistillationTrainer(
        model=student, teacher_model=None if signal else teacher, processing_class=tokenizer if signal else None,
        args=args(tmp_path, bf16=True, use_cpu=device == "cpu", max_steps=1, kd_loss="jsd", jsd_beta=0.3,
                  temperature=2.0, task_weight=1.0, **kw),
        train_dataset=rows, data_collator=labelled_collate)
    with caplog.at_level("WARNING"):
        trainer.train()
    assert not any("computed whole" in r.getMessage() for r in caplog.records)
    assert trainer.distiller._student_state(trainer.model).rebuilds
    assert len(seen) == 1 and dtypes and all(d == (torch.bfloat16, torch.bfloat16) for d in dtypes)

    h_s, h_t, kd_mask, labels, kd, ce = seen[0]
    z_s = h_s[:, :-1].double().cpu() @ w_s.T
    kd_mask, labels = kd_mask.cpu(), labels.cpu()
    if signal:  # the signal keeps every id (k = V): the teacher's exact distribution, from its own forward
        with torch.no_grad():
            batch = labelled_collate([rows[i] for i in range(8)])
            z_t = teacher.double()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    else:
        z_t = h_t[:, :-1].double().cpu() @ w_t.T
    want_kd = losses.logit_kd_loss("jsd", z_s, z_t, 2.0, mask=kd_mask, beta=0.3)
    want_ce = F.cross_entropy(z_s.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    assert want_kd > 0.05
    assert kd == pytest.approx(float(want_kd), rel=2e-2)
    assert ce == pytest.approx(float(want_ce), rel=2e-3)


@pytest.mark.slow
def test_compiled_elementwise_work_survives_many_configurations(monkeypatch):
    """On a GPU the sparse head's elementwise work is compiled (fullgraph): a graph per divergence, CE or not, ... .
    Dynamo's default of 8 graphs per function is a hard error there (found by the CUDA tests on an H200): a process
    training several configurations must not fail. Dynamo's own counting, without inductor (eager backend)."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager", **kw))
    kd_head._fused.cache_clear()

    def rows(z, kind: str):
        return (z * len(kind)).sum()

    fused, z = kd_head._fused(rows), torch.randn(4, 5)
    try:
        for i in range(12):  # a new string is a new graph
            assert float(fused(z, "k" * (i + 1))) == pytest.approx(float(z.sum()) * (i + 1), rel=1e-5)
    finally:
        kd_head._fused.cache_clear()
