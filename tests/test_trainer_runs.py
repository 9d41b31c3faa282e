"""Evaluation, best-model loading and resumption of a distillation run where the Trainer's own would be silently
wrong (hf_distill.trainer_runs, and the projections' `_load_best_model`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import args, bert, collate, token_dataset
from helpers import teacher as make_teacher
from safetensors import safe_open
from torch import nn

from hf_distill import DistillationTrainer
from hf_distill.publish.report import DistillationReport


def _trainer(tmp_path, student=None, data=None, eval_dataset=None, compute_metrics=None, **kw):
    kw.setdefault("max_steps", 1)
    return DistillationTrainer(
        model=student if student is not None else bert(2),
        teacher_model=make_teacher(),
        args=args(tmp_path, **kw),
        train_dataset=data if data is not None else token_dataset(8),
        eval_dataset=eval_dataset,
        data_collator=collate,
        compute_metrics=compute_metrics,
    )


def test_eval_with_teacher_reports_the_distillation_loss_of_rows_without_labels(tmp_path):
    """The Trainer runs the student alone on a batch without labels and reports no loss; with eval_with_teacher the
    teacher's terms give it one, and the predictions stay the student's logits."""
    unlabeled = token_dataset(8).remove_columns(["label"])
    trainer = _trainer(tmp_path, eval_with_teacher=True, per_device_eval_batch_size=8, task_weight=0.0)
    out = trainer.predict(unlabeled)
    batch = collate([unlabeled[i] for i in range(8)])
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(**batch).logits
        expected = trainer.compute_loss(trainer.model, dict(batch))
    assert out.label_ids is None
    assert np.allclose(out.predictions, logits.numpy(), atol=1e-6)
    assert out.metrics["test_loss"] == pytest.approx(float(expected), rel=1e-5)
    assert float(expected) > 0
    assert "eval_loss" in trainer.evaluate(unlabeled)
    assert "eval_loss" not in _trainer(tmp_path).evaluate(unlabeled)  # without the teacher: the Trainer's own
    task_only = _trainer(tmp_path, eval_with_teacher=True, kd_weight=0.0, task_weight=1.0)  # the teacher adds nothing
    assert "eval_loss" not in task_only.evaluate(unlabeled)


def test_load_best_model_at_end_restores_the_best_checkpoints_projections(tmp_path):
    """The best checkpoint's student comes back with the projections it was saved with, not the last step's."""
    scores = iter([0.9, 0.1])

    def metrics(_):
        return {"score": next(scores)}

    data = token_dataset(8)
    trainer = _trainer(tmp_path, student=bert(2, hidden=16), data=data, eval_dataset=data.select(range(2)),
                       compute_metrics=metrics, max_steps=2, per_device_train_batch_size=4, eval_strategy="steps",
                       eval_steps=1, save_strategy="steps", save_steps=1, load_best_model_at_end=True,
                       metric_for_best_model="score", distill_terms=["loss=hidden_mse,layers=uniform"])
    trainer.train()
    best = tmp_path / "out" / "checkpoint-1"
    assert trainer.state.best_model_checkpoint == str(best)
    saved = torch.load(best / "distill_projections.pt", weights_only=True)
    last = torch.load(tmp_path / "out" / "checkpoint-2" / "distill_projections.pt", weights_only=True)
    assert not all(torch.equal(saved[k], last[k]) for k in saved)  # the projections trained between the two
    now = trainer.distiller.projections.state_dict()
    assert all(torch.equal(saved[k], now[k]) for k in saved)
    with safe_open(str(best / "model.safetensors"), "pt") as f:  # the student alone: no teacher, no projection
        assert set(f.keys()) == set(trainer.model.state_dict())
    groups = torch.load(best / "optimizer.pt", weights_only=True)["param_groups"]
    trained = [*trainer.model.parameters(), *trainer.distiller.projections.parameters()]
    assert sum(len(g["params"]) for g in groups) == len(trained)  # no teacher parameter in the optimizer
    report = DistillationReport.from_trainer(trainer)  # the card describes the weights restored
    assert report.student_metrics["score"] == 0.9 and report.eval_step == 1


def test_a_checkpoint_saved_without_its_optimizer_is_refused_for_resumption(tmp_path):
    """save_only_model writes no optimizer or scheduler state: resuming would restart both at the checkpoint's step."""
    _trainer(tmp_path, save_strategy="steps", save_steps=1, save_only_model=True).train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    again = _trainer(tmp_path, max_steps=2)
    for given in (str(checkpoint), True):
        with pytest.raises(ValueError, match="holds no optimizer state.*save_only_model=True"):
            again.train(resume_from_checkpoint=given)
    assert again.state.global_step == 0


def test_an_eval_loss_a_schedule_changes_cannot_choose_the_best_checkpoint(tmp_path):
    """With eval_with_teacher, eval_loss is the distillation loss at the step's kd_weight and temperature: while a
    schedule moves them, it cannot rank checkpoints (load_best_model_at_end's default metric is that loss)."""
    from hf_distill.callbacks import ScheduleCallback
    from hf_distill.trainer_runs import check_best_metric

    data = token_dataset(8)
    best = dict(eval_strategy="steps", save_strategy="steps", load_best_model_at_end=True, eval_with_teacher=True)
    trainer = _trainer(tmp_path, data=data, eval_dataset=data, **best)
    trainer.add_callback(ScheduleCallback({"temperature": {"start": 4.0, "end": 1.0}}))
    with pytest.raises(ValueError, match="metric_for_best_model='loss'.*ScheduleCallback.*eval_with_teacher=False"):
        trainer.train()
    assert trainer.state.global_step == 0
    per_set = _trainer(tmp_path, data=data, eval_dataset={"dev": data}, metric_for_best_model="dev_loss", **best)
    per_set.add_callback(ScheduleCallback({"kd_weight": {"start": 1.0, "end": 0.5}}))
    with pytest.raises(ValueError, match="'dev_loss'"):
        check_best_metric(per_set)
    check_best_metric(_trainer(tmp_path, data=data, eval_dataset=data, **best))  # no schedule: comparable
    check_best_metric(_trainer(tmp_path, data=data, eval_dataset=data, **{**best, "eval_with_teacher": False}))


def test_a_search_ranked_by_the_distillation_eval_loss_is_refused(tmp_path):
    """hyperparameter_search's default objective (no compute_metrics) is eval_loss: under eval_with_teacher each trial
    would weigh it by its own kd_weight and temperature."""
    data = token_dataset(8)
    trainer = DistillationTrainer(model_init=lambda: bert(2), teacher_model=make_teacher(), data_collator=collate,
                                  args=args(tmp_path, max_steps=1, eval_with_teacher=True), train_dataset=data,
                                  eval_dataset=data)
    with pytest.raises(ValueError, match="default objective is eval_loss.*compute_objective="):
        trainer.hyperparameter_search(hp_space=lambda trial: {"temperature": 2.0}, backend="optuna", n_trials=1)


def test_evaluation_with_the_teacher_hands_compute_metrics_what_the_trainer_does(tmp_path):
    """eval_with_teacher changes the loss only: compute_metrics gets the student's logits, the labels, the inputs and
    the per-batch losses (include_for_metrics), under each evaluation set's prefix; the teacher's own are teacher_*."""
    data = token_dataset(8)
    seen = {}

    def metrics(p):
        seen[len(seen)] = p
        return {"acc": float((p.predictions.argmax(-1) == p.label_ids).mean())}

    trainer = _trainer(tmp_path, eval_dataset={"a": data, "b": data.select(range(4))}, compute_metrics=metrics,
                       eval_with_teacher=True, include_for_metrics=["inputs", "loss"], per_device_eval_batch_size=4)
    out = trainer.evaluate()
    assert {"eval_a_loss", "eval_a_acc", "eval_b_loss", "eval_b_acc"} <= set(out)
    first = seen[0]
    batch = collate([data[i] for i in range(4)])
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert np.allclose(first.predictions[:4, :], logits.numpy(), atol=1e-6)  # the student's, not the teacher's
    assert np.array_equal(first.label_ids, np.array(data["label"]))
    assert np.array_equal(first.inputs[:4, : batch["input_ids"].shape[1]], batch["input_ids"].numpy())
    assert first.losses.shape == (8,) and out["eval_a_loss"] == pytest.approx(float(first.losses.mean()), rel=1e-5)
    assert {"teacher_a_loss", "teacher_a_acc"} <= set(trainer.evaluate_teacher())


class _Plain(nn.Module):
    """A student whose forward takes no `**kwargs`: it refuses any key it does not name."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.EmbeddingBag(200, 16), nn.Linear(16, 2)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.out(self.emb(input_ids))
        return {"loss": F.cross_entropy(logits, labels), "logits": logits} if labels is not None else {"logits": logits}


def test_a_student_predicting_alone_never_gets_the_cached_teacher_columns(tmp_path):
    """Rows without labels go to the student's forward itself (no compute_loss): the teacher_* columns the
    distillation keeps through column removal must not reach it (a plain Trainer would have dropped them)."""
    rows = token_dataset(8).add_column("teacher_logits", [[0.5, -0.5]] * 8).remove_columns(["label"])
    student = _Plain()
    out = _trainer(tmp_path, student=student, per_device_eval_batch_size=8).predict(rows)
    batch = collate([{"input_ids": r} for r in rows["input_ids"]])
    assert np.allclose(out.predictions, student(batch["input_ids"])["logits"].detach().numpy(), atol=1e-6)
