"""KD paths (hf_distill.kd_paths): one object per way the KD loss is computed, chosen once per model, form of the
teacher's logits and pass, from a registry a new path joins with one class and one registration."""

from __future__ import annotations

import pytest
import torch
from helpers import args, bert, collate, labelled_collate, llama, sft_rows, teacher, token_dataset

from hf_distill import losses
from hf_distill.distiller import Distiller
from hf_distill.kd_paths import PATHS, CrossTokenizer, LossHead, SparseHead, WholeLogits, register_path
from hf_distill.teacher_sources import MODEL


def _causal(tmp_path, **kw):
    student = llama(0)
    distiller = Distiller(student, args(tmp_path, kd_loss="jsd", **kw), teacher_model=llama(1))
    return student, distiller, labelled_collate([sft_rows(4)[i] for i in range(4)])


def test_the_registry_orders_every_path_by_priority():
    assert [p.name for p in PATHS][-4:] == ["cross_tokenizer", "sparse_head", "loss_head", "whole_logits"]
    assert PATHS[-4:] == [CrossTokenizer, SparseHead, LossHead, WholeLogits]
    with pytest.raises(ValueError, match="registered already"):
        register_path(WholeLogits)


def test_a_path_is_chosen_and_its_model_checked_once_per_model_form_and_pass(tmp_path, monkeypatch):
    student, distiller, batch = _causal(tmp_path)
    binds = []
    real = LossHead.bind
    monkeypatch.setattr(LossHead, "bind", lambda self, state, model: binds.append(model) or real(self, state, model))
    for _ in range(2):
        distiller.compute_loss(student.train(), dict(batch))
    distiller.compute_loss(student.eval(), dict(batch))  # evaluation without the teacher: whole logits
    state = distiller._student_state(student)
    assert {k: type(p) for k, p in state.paths.items()} == {(MODEL, True): LossHead, (MODEL, False): WholeLogits}
    assert binds == [student] and state.rebuilds
    other = llama(2)  # what model_init would return: its own choice and check
    distiller.compute_loss(other.train(), dict(batch))
    assert binds == [student, other] and type(distiller._student_state(other).paths[(MODEL, True)]) is LossHead


def test_a_model_whose_logits_cannot_be_rebuilt_falls_to_whole_logits(tmp_path, caplog):
    student, distiller, batch = _causal(tmp_path)
    student.logit_scale = 3.0  # the rebuild multiplies by it, the model's own forward does not
    with caplog.at_level("WARNING"):
        distiller.compute_loss(student.train(), dict(batch))
    assert type(distiller._student_state(student).paths[(MODEL, True)]) is WholeLogits
    assert "computed whole" in caplog.text


class _Halved(WholeLogits):
    """A test path: whole logits with the KD term halved, in training only."""

    name = "test_halved"
    priority = 100

    @classmethod
    def applies(cls, ctx, form, training):
        return training

    def loss(self, batch):
        kd, task = super().loss(batch)
        return kd * 0.5, task


def test_a_new_path_is_one_class_and_one_registration(tmp_path):
    student, t = bert(2), teacher()
    distiller = Distiller(student, args(tmp_path, kd_weight=1.0, task_weight=0.0), teacher_model=t)
    batch = collate([token_dataset(4)[i] for i in range(4)])
    with torch.no_grad():
        want = losses.kl_div(student(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits,
                             t(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits, 2.0)
    register_path(_Halved)
    try:
        with torch.no_grad():
            got = distiller.compute_loss(student.train(), dict(batch))
    finally:
        PATHS.remove(_Halved)
    assert float(got) == pytest.approx(0.5 * float(want), rel=1e-6)
    assert type(distiller._student_state(student).paths[(MODEL, True)]) is _Halved
