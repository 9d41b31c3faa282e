"""The teacher side (hf_distill.teacher_sources): one typed result per batch, from cached columns or the models."""

from __future__ import annotations

import torch
from helpers import args, labelled_collate, llama, sft_rows

from hf_distill.data.cache import LOGITS_COLUMN, TOPK_INDICES_COLUMN, TOPK_VALUES_COLUMN
from hf_distill.data.teacher_signal import SIGNAL_TOPK
from hf_distill.distiller import Distiller
from hf_distill.teacher_sources import DENSE, MODEL, SIGNAL, TOPK, TeacherRequest


def _side(tmp_path, **kw):
    teacher = llama(1)
    calls = []
    teacher.register_forward_pre_hook(lambda *_: calls.append(1))
    distiller = Distiller(llama(0), args(tmp_path, **kw), teacher_model=teacher)
    return distiller.teacher_side, teacher, calls


def test_the_form_of_the_teachers_logits_comes_from_the_columns(tmp_path):
    side, _, _ = _side(tmp_path, kd_loss="kl")
    x = torch.zeros(1)
    assert side.form({}) == MODEL and side.form({LOGITS_COLUMN: x}) == DENSE
    assert side.form({SIGNAL_TOPK: x}) == SIGNAL
    assert side.form({TOPK_VALUES_COLUMN: x, TOPK_INDICES_COLUMN: x, LOGITS_COLUMN: x}) == TOPK  # compared whole
    mse, _, _ = _side(tmp_path, kd_loss="mse")
    assert mse.form({SIGNAL_TOPK: x}) == MODEL  # a signal holds no raw logits: the teacher runs
    off, _, _ = _side(tmp_path, kd_weight=0.0, task_weight=1.0)
    assert off.form({LOGITS_COLUMN: x}) is None


def test_cached_logits_are_given_without_a_forward_and_the_model_gives_what_is_asked(tmp_path):
    side, teacher, calls = _side(tmp_path, kd_loss="kl")
    batch = labelled_collate([sft_rows(2)[i] for i in range(2)])
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    cached = torch.randn(*batch["input_ids"].shape, 120)
    out = side.outputs(inputs, {LOGITS_COLUMN: cached})
    assert not calls and out.logits[0].form == DENSE and out.views[0][0] is cached and out.hidden is None
    out = side.outputs(inputs, {}, TeacherRequest(hidden=True))
    assert len(calls) == 1 and out.logits[0].form == MODEL and out.views == [[None]]
    assert out.hidden.shape == (*batch["input_ids"].shape, 32)
    out = side.outputs(inputs, {})
    with torch.no_grad():
        want = teacher(**inputs).logits
    assert out.logits[0].form == DENSE and torch.equal(out.views[0][0], want)
