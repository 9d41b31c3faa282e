"""Causal-LM KD and cross-entropy computed a chunk of tokens at a time equal the whole-logits computation."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import VOCAB, args, bert, flat_params, labelled_collate, llama, padded_llama, sft_rows
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    PreTrainedTokenizerFast,
)

from hf_distill import DistillationTrainer, chunked, losses


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
@pytest.mark.parametrize(("kind", "weights"), [("jsd", (0.7, 0.3)), ("kl", (1.0, 0.0)), ("reverse_kl", (0.0, 2.0))])
def test_fused_chunks_equal_checkpointed_chunks(make, kind, weights):
    """The fused path takes each chunk's gradient in the forward pass: the weighted loss and every gradient
    (hidden states, the LM head's weight, tied or not) equal the checkpointed path's."""
    ids, mask, labels = _batch(seed=4)
    kd_mask = labels[:, 1:] != -100
    teacher = make(1)
    batch = {"input_ids": ids, "attention_mask": mask}
    with torch.no_grad():
        t_hidden = chunked.last_hidden(teacher(**chunked.hidden_only_kwargs(batch)))
    results = []
    for fused in (False, True):
        student = make(0)
        s_out = student(**chunked.hidden_only_kwargs(batch))
        common = (chunked.logits_fn(teacher), t_hidden, kd_mask, labels[:, 1:], chunked.dense_kd(kind, 2.0, 0.4))
        if fused:
            params = chunked.head_parameters(student)
            assert params and params[0] is student.get_output_embeddings().weight
            loss, kd, ce = chunked.fused_kd_and_ce(chunked.last_hidden(s_out), chunked.logits_fn(student), params,
                                                   *common, chunk_size=4, kd_weight=weights[0], ce_weight=weights[1])
            assert not kd.requires_grad and not ce.requires_grad  # logged values only
        else:
            kd, ce = chunked.chunked_kd_and_ce(chunked.last_hidden(s_out), chunked.logits_fn(student), *common,
                                               chunk_size=4)
            loss = weights[0] * kd + weights[1] * ce
        (3.0 * loss).backward()  # an outer factor (gradient accumulation, loss scaling) reaches every gradient
        results.append((loss.detach(), kd.detach(), ce.detach(), [q.grad for q in student.parameters()]))
    (loss_c, kd_c, ce_c, grads_c), (loss_f, kd_f, ce_f, grads_f) = results
    torch.testing.assert_close(loss_f, loss_c, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kd_f, kd_c, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ce_f, ce_c, atol=1e-6, rtol=1e-6)
    for got, want in zip(grads_f, grads_c, strict=True):
        if want is None:
            assert got is None or not got.any()
        else:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def _fused_loss(student, teacher):
    ids, mask, labels = _batch(seed=5)
    batch = chunked.hidden_only_kwargs({"input_ids": ids, "attention_mask": mask})
    with torch.no_grad():
        t_hidden = chunked.last_hidden(teacher(**batch))
    s_hidden = chunked.last_hidden(student(**batch))
    return chunked.fused_kd_and_ce(s_hidden, chunked.logits_fn(student), chunked.head_parameters(student),
                                   chunked.logits_fn(teacher), t_hidden, labels[:, 1:] != -100, labels[:, 1:],
                                   chunked.dense_kd("jsd", 1.0, 0.5), chunk_size=4, kd_weight=0.5, ce_weight=0.5)


def test_fused_chunks_refuse_double_backward():
    """The gradient is computed in the forward pass, so there is no graph for a second derivative: say so."""
    student = llama(0)
    loss, _, _ = _fused_loss(student, llama(1))
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(loss, [student.get_output_embeddings().weight], create_graph=True)
    loss, _, _ = _fused_loss(student, llama(1))
    loss.backward()  # a plain backward is unaffected
    assert student.get_output_embeddings().weight.grad.abs().sum() > 0


def test_fused_chunks_under_no_grad_compute_values_only(monkeypatch):
    """A loss computed under no_grad (e.g. logged by a callback) takes no gradient and has the same value."""
    student, teacher = llama(0), llama(1)
    want, kd, ce = _fused_loss(student, teacher)
    calls = []
    real_grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or real_grad(*a, **k))
    with torch.no_grad():
        got, kd2, ce2 = _fused_loss(student, teacher)
    assert not calls and not got.requires_grad
    torch.testing.assert_close(got, want.detach())
    torch.testing.assert_close((kd2, ce2), (kd, ce))


@pytest.mark.parametrize("fp16", [False, True])
def test_fp16_mixed_precision_keeps_the_checkpointed_chunks(tmp_path, monkeypatch, fp16):
    """Under fp16 the GradScaler multiplies the loss after the forward pass: gradients taken inside it would
    underflow in float16, so the trainer uses the checkpointed chunks there (fp16 itself needs CUDA, so the
    flag is set on a CPU trainer after it is built)."""
    used = []
    for name in ("fused_kd_and_ce", "chunked_kd_and_ce"):
        real = getattr(chunked, name)
        monkeypatch.setattr(chunked, name, lambda *a, _n=name, _f=real, **k: used.append(_n) or _f(*a, **k))
    trainer = DistillationTrainer(model=llama(0), teacher_model=llama(1), args=args(tmp_path, kd_loss="jsd"),
                                  train_dataset=sft_rows(4), data_collator=labelled_collate)
    trainer.args.fp16 = fp16
    trainer.model.train()
    trainer.compute_loss(trainer.model, labelled_collate([sft_rows(4)[i] for i in range(4)]))
    assert used == (["chunked_kd_and_ce"] if fp16 else ["fused_kd_and_ce"])


@pytest.mark.parametrize("tied", [False, True])
def test_trainer_fused_chunks_equal_whole_logits_with_accumulation(tmp_path, tied):
    """Two SGD steps of jsd + CE with gradient accumulation and masked prompts: the trainer's fused chunks (the
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
            trainer._chunk = None  # the path used where chunking is impossible
        trainer.train()
        runs.append(trainer)
    fused, whole = runs
    torch.testing.assert_close(flat_params(fused.model), flat_params(whole.model), atol=1e-6, rtol=0)
    logs = [[r for r in t.state.log_history if "loss" in r] for t in runs]
    assert len(logs[0]) == 2
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
    assert a._chunk == 3 and b._chunk == 10_000
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=0)


def test_causal_lm_students_chunk_by_default(tmp_path):
    trainer = DistillationTrainer(model=llama(0), teacher_model=llama(1), args=args(tmp_path),
                                  train_dataset=sft_rows(4), data_collator=labelled_collate)
    assert trainer._chunk == 512


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
    assert trainer._shared_vocab == VOCAB
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
    assert trainer._chunk == 4
    for n, p in trainer.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    assert any(not torch.equal(p, lora[n]) for n, p in trainer.model.named_parameters() if n in lora)
    log = next(r for r in trainer.state.log_history if "loss" in r)
    assert log["loss_kd"] > 0 and log["loss_task"] > 0
