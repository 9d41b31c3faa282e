"""Heads beyond single-label classification: QA spans, regression, multi-label, causal LM alignment."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from helpers import (
    VOCAB,
    args,
    bert,
    bert_config,
    collate,
    labelled_collate,
    llama,
    qa_collate,
    sft_rows,
    token_dataset,
)
from helpers import teacher as make_teacher
from transformers import BertForQuestionAnswering

from hf_distill import DistillationTrainer, losses


def _first_log(trainer):
    return next(r for r in trainer.state.log_history if "loss" in r)


def _train(tmp_path, student, teacher, data, collator, **kw):
    kw.setdefault("max_steps", 1)
    trainer = DistillationTrainer(
        model=student, teacher_model=teacher, args=args(tmp_path, **kw), train_dataset=data, data_collator=collator
    )
    trainer.train()
    return trainer


# ---------------------------------------------------------------- question answering


def _qa_rows(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(6, 13, (1,), generator=g))
        ids = [101] + torch.randint(5, VOCAB, (length - 1,), generator=g).tolist()
        start = int(torch.randint(1, length - 1, (1,), generator=g))
        rows.append({"input_ids": ids, "start_positions": start, "end_positions": start + 1})
    return Dataset.from_list(rows)


def _qa_model(seed, layers=2):
    torch.manual_seed(seed)
    model = BertForQuestionAnswering(bert_config(layers=layers))
    if seed == 1:  # a confident teacher, so the KD term is far from 0
        with torch.no_grad():
            model.qa_outputs.weight.mul_(20.0)
    return model


def test_question_answering_distils_start_and_end_logits(tmp_path):
    data = _qa_rows(8)
    student, teacher = _qa_model(0), _qa_model(1, layers=4)
    s0, t0 = copy.deepcopy(student), copy.deepcopy(teacher)
    trainer = _train(tmp_path, student, teacher, data, qa_collate, per_device_train_batch_size=8,
                     kd_weight=0.5, task_weight=0.5, temperature=2.0)
    log = _first_log(trainer)

    batch = qa_collate([data[i] for i in range(8)])
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        s = s0(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
               start_positions=batch["start_positions"], end_positions=batch["end_positions"])
        t = t0(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    kd = [
        losses.kl_div(s[k].masked_fill(~real, -1e9), t[k].masked_fill(~real, -1e9), 2.0)
        for k in ("start_logits", "end_logits")
    ]
    assert log["loss_kd"] == pytest.approx(float(sum(kd) / 2), rel=1e-4)
    assert log["loss_kd"] > 0.1
    assert log["loss_task"] == pytest.approx(float(s.loss), rel=1e-4)


def test_question_answering_refuses_mse(tmp_path):
    with pytest.raises(ValueError, match="question-answering"):
        DistillationTrainer(model=_qa_model(0), teacher_model=_qa_model(1), args=args(tmp_path, kd_loss="mse"),
                            train_dataset=_qa_rows(4), data_collator=qa_collate)


# ---------------------------------------------------------------- regression


def _regression_rows(n=16):
    data = token_dataset(n)
    return data.map(lambda r, i: {"label": float(i % 5) / 4}, with_indices=True)


def test_regression_head_refuses_softmax_losses(tmp_path):
    for kind in ("kl", "soft_ce"):
        with pytest.raises(ValueError, match="kd_loss='mse'"):
            DistillationTrainer(model=bert(2, labels=1), teacher_model=make_teacher(labels=1),
                                args=args(tmp_path, kd_loss=kind), train_dataset=_regression_rows(),
                                data_collator=collate)


def test_regression_head_distils_with_mse(tmp_path):
    student, teacher = bert(2, labels=1), make_teacher(labels=1)
    s0, t0 = copy.deepcopy(student), copy.deepcopy(teacher)
    data = _regression_rows(8)
    trainer = _train(tmp_path, student, teacher, data, collate, kd_loss="mse", per_device_train_batch_size=8)
    batch = collate([data[i] for i in range(8)])
    with torch.no_grad():
        s = s0(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        t = t0(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert _first_log(trainer)["loss_kd"] == pytest.approx(float(F.mse_loss(s, t)), rel=1e-4)
    assert _first_log(trainer)["loss_kd"] > 0


# ---------------------------------------------------------------- multi-label


def _multi_label_rows(n=8, labels=3):
    data = token_dataset(n)
    return data.map(lambda r, i: {"label": [float((i >> j) & 1) for j in range(labels)]}, with_indices=True)


def _binary_kl_reference(s, t, T):
    p, q = torch.sigmoid(t.double() / T), torch.sigmoid(s.double() / T)
    kl = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
    return T**2 * kl.sum(-1).mean()


@pytest.mark.parametrize("declared", [True, False], ids=["problem_type", "from_float_labels"])
def test_multi_label_head_distils_each_label_with_a_sigmoid(tmp_path, declared):
    kw = {"problem_type": "multi_label_classification"} if declared else {}
    student, teacher = bert(2, labels=3, **kw), make_teacher(labels=3, **kw)
    s0, t0 = copy.deepcopy(student), copy.deepcopy(teacher)
    data = _multi_label_rows(8)
    trainer = _train(tmp_path, student, teacher, data, collate, per_device_train_batch_size=8, temperature=2.0)
    batch = collate([data[i] for i in range(8)])
    with torch.no_grad():
        s = s0(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        t = t0(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    log = _first_log(trainer)
    assert log["loss_kd"] == pytest.approx(float(_binary_kl_reference(s, t, 2.0)), rel=1e-4)
    softmax_kl = float(losses.kl_div(s, t, 2.0))
    assert log["loss_kd"] != pytest.approx(softmax_kl, rel=1e-2)
    assert log["loss_task"] == pytest.approx(float(F.binary_cross_entropy_with_logits(s, batch["labels"])), rel=1e-4)


def test_binary_losses_match_float64_references():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(5, 4, generator=g) * 3, torch.randn(5, 4, generator=g) * 3
    for T in (1.0, 2.0, 4.0):
        assert float(losses.binary_kl_div(s, t, T)) == pytest.approx(float(_binary_kl_reference(s, t, T)), rel=1e-5)
        p = torch.sigmoid(t.double() / T)
        bce = F.binary_cross_entropy_with_logits(s.double() / T, p, reduction="none").sum(-1).mean()
        assert float(losses.binary_soft_cross_entropy(s, t, T)) == pytest.approx(float(bce), rel=1e-5)
    assert float(losses.binary_kl_div(t, t, 3.0)) == pytest.approx(0.0, abs=1e-6)


def test_multi_label_refuses_jsd_like_losses_only_where_undefined(tmp_path):
    from hf_distill.features.heads import Head, check_kd_loss

    check_kd_loss(Head.MULTI_LABEL, "kl")
    check_kd_loss(Head.MULTI_LABEL, "mse")
    with pytest.raises(ValueError, match="multi-label"):
        check_kd_loss(Head.MULTI_LABEL, "jsd")


# ---------------------------------------------------------------- causal LM


def _llama(seed, layers=2):
    model = llama(seed, layers)
    if seed == 1:  # a confident teacher
        with torch.no_grad():
            model.lm_head.weight.mul_(10.0)
    return model


@pytest.mark.parametrize("token_mask", ["labels", "attention"])
def test_causal_lm_distils_next_token_logits_on_counted_positions(tmp_path, token_mask):
    student, teacher = _llama(0), _llama(1, layers=3)
    s0, t0 = copy.deepcopy(student), copy.deepcopy(teacher)
    data = sft_rows(8)
    trainer = _train(tmp_path, student, teacher, data, labelled_collate, per_device_train_batch_size=8,
                     kd_token_mask=token_mask, temperature=1.0)
    batch = labelled_collate([data[i] for i in range(8)])
    with torch.no_grad():
        s = s0(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        t = t0(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    real = batch["attention_mask"].bool()
    mask = batch["labels"][:, 1:] != -100 if token_mask == "labels" else real[:, :-1] & real[:, 1:]
    expected = losses.kl_div(s.logits[:, :-1], t[:, :-1], 1.0, mask=mask)
    log = _first_log(trainer)
    assert log["loss_kd"] == pytest.approx(float(expected), rel=1e-4)
    unshifted = losses.kl_div(s.logits, t, 1.0, mask=batch["labels"] != -100)
    assert log["loss_kd"] != pytest.approx(float(unshifted), rel=1e-3)
    assert log["loss_task"] == pytest.approx(float(s.loss), rel=1e-4)
