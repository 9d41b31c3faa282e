"""PEFT: LoRA students, LoRA teachers, and self-distillation on one shared base."""

from __future__ import annotations

import pytest
import torch
from helpers import args, bert, collate, flat_params, token_dataset
from helpers import teacher as make_teacher
from transformers import BertForSequenceClassification

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from hf_distill import DistillationTrainer  # noqa: E402
from hf_distill.publish.card import write_model_card  # noqa: E402
from hf_distill.publish.report import DistillationReport  # noqa: E402


def _lora(model, seed=0, dropout=0.0, randomize=False):
    torch.manual_seed(seed)
    wrapped = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=dropout,
                                               target_modules=["query", "value"]))
    if randomize:  # LoRA's B starts at zero; a teacher adapter that changes nothing would test nothing
        with torch.no_grad():
            for name, p in wrapped.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.5)
    return wrapped


def _batch(n=6):
    b = collate([token_dataset(n, seed=5)[i] for i in range(n)])
    b.pop("labels")
    return b


@pytest.mark.slow
def test_lora_student_trains_and_saves_adapters_only(tmp_path):
    student = _lora(bert(2))
    base_before = {n: p.clone() for n, p in student.named_parameters() if "lora" not in n and "classifier" not in n}
    a = args(tmp_path, max_steps=6, learning_rate=1e-2, distill_terms=["loss=hidden_mse", "loss=attention_score_mse"])
    trainer = DistillationTrainer(model=student, teacher_model=make_teacher(), args=a, train_dataset=token_dataset(32),
                                  data_collator=collate)
    trainer.train()
    for name, p in student.named_parameters():
        if name in base_before:
            assert torch.equal(p, base_before[name]), f"frozen base weight {name} changed"
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in student.named_parameters() if "lora_B" in n)
    out = tmp_path / "adapters"
    trainer.save_model(str(out))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    assert not (out / "model.safetensors").exists()
    reloaded = PeftModel.from_pretrained(bert(2), out).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**_batch()).logits, student.eval()(**_batch()).logits, atol=1e-6, rtol=0)
    card = write_model_card(out, DistillationReport.from_trainer(trainer))
    text = card.read_text()
    assert "LORA adapters, rank 4 on query, value" in text and "AutoPeftModelForSequenceClassification" in text


@pytest.mark.slow
@pytest.mark.parametrize("merged", [False, True], ids=["adapter", "merged"])
def test_lora_teacher_merged_or_not(tmp_path, merged):
    lora_teacher = _lora(make_teacher(), seed=1, randomize=True).eval()
    with torch.no_grad():
        reference = lora_teacher(**_batch()).logits
    teacher = lora_teacher.merge_and_unload() if merged else lora_teacher
    a = args(tmp_path, max_steps=3, distill_terms=["loss=hidden_mse,layers=uniform"])
    trainer = DistillationTrainer(model=bert(2), teacher_model=teacher, args=a, train_dataset=token_dataset(32),
                                  data_collator=collate)
    with torch.no_grad():
        got = trainer.distiller.run_teacher(trainer.teacher, _batch())[0].logits
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)
    assert not any(p.requires_grad for p in trainer.teacher.parameters())
    trainer.train()
    assert all(r["loss"] == r["loss"] for r in trainer.state.log_history if "loss" in r)


def test_lora_teacher_loads_from_an_adapter_folder(tmp_path):
    make_teacher().save_pretrained(tmp_path / "base")  # the same weights the adapter is put on below
    lora_teacher = _lora(make_teacher(), seed=1, randomize=True).eval()
    lora_teacher.peft_config["default"].base_model_name_or_path = str(tmp_path / "base")
    lora_teacher.save_pretrained(tmp_path / "adapter")
    trainer = DistillationTrainer(model=bert(2), teacher_model=str(tmp_path / "adapter"), args=args(tmp_path),
                                  data_collator=collate)
    assert isinstance(trainer.teacher, PeftModel)
    with torch.no_grad():
        torch.testing.assert_close(trainer.teacher(**_batch()).logits, lora_teacher(**_batch()).logits, atol=1e-6,
                                   rtol=0)


def test_a_teacher_sharing_the_students_weights_without_adapters_to_switch_off_is_refused(tmp_path):
    """The teacher would be the student being trained: a plain model as its own teacher, or the base that
    get_peft_model changed in place (its LoRA layers stay on; only the PeftModel can switch them off)."""
    plain = bert(2)
    base = bert(2)
    for student, teacher in ((plain, plain), (_lora(base), base)):
        with pytest.raises(ValueError, match="shares parameters with the student but is not a PEFT model"):
            DistillationTrainer(model=student, teacher_model=teacher, args=args(tmp_path),
                                train_dataset=token_dataset(8), data_collator=collate)


def test_shared_base_self_distillation_keeps_student_dropout_on(tmp_path):
    base = bert(2, hidden_dropout_prob=0.3)
    student = _lora(base, dropout=0.2)
    dropout = student.get_base_model().bert.encoder.layer[0].output.dropout
    seen = []  # (grad enabled, dropout training) at every call: the student runs with grad, the teacher without
    dropout.register_forward_pre_hook(lambda m, i: seen.append((torch.is_grad_enabled(), m.training)))
    base_weights = {n: p.clone() for n, p in student.named_parameters() if "lora" not in n and "classifier" not in n}
    a = args(tmp_path, max_steps=4, learning_rate=1e-2, kd_weight=1.0, task_weight=0.0,
             distill_terms=["loss=hidden_mse,layers=uniform"])
    trainer = DistillationTrainer(model=student, teacher_model=student, args=a, train_dataset=token_dataset(32),
                                  data_collator=collate)
    assert trainer.shared_base and trainer.teacher is student
    assert any(p.requires_grad for p in student.parameters())  # the student was not frozen as a teacher
    trainer.train()
    assert {(True, True), (False, False)} == set(seen)  # student in train mode, teacher in eval, every step
    assert student.training and dropout.training
    for name, p in student.named_parameters():
        if name in base_weights:
            assert torch.equal(p, base_weights[name])
    # The teacher is the base with adapters off, in eval mode.
    batch = _batch()
    with torch.no_grad():
        got = trainer.distiller.run_teacher(trainer.teacher, batch)[0].logits
        with student.disable_adapter():
            want = student.eval()(**batch).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    student.train()
    trainer.save_model(str(tmp_path / "adapters"))
    reloaded = PeftModel.from_pretrained(BertForSequenceClassification(base.config), tmp_path / "adapters")
    assert {n for n, _ in reloaded.named_parameters() if "lora" in n}


def test_only_adapters_and_head_are_trainable(tmp_path):
    student = _lora(bert(2))
    trainer = DistillationTrainer(model=student, teacher_model=make_teacher(), args=args(tmp_path),
                                  data_collator=collate)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora" in n or "classifier" in n for n in trainable)
    assert flat_params(trainer.teacher).numel() > 0


def _mean_p1(eval_pred) -> dict[str, float]:
    """A continuous metric (mean probability of class 1): two different models do not tie on it."""
    logits, _ = eval_pred
    return {"mean_p1": float(torch.as_tensor(logits).softmax(-1)[:, 1].mean())}


def test_self_distillation_card_shows_the_base_with_adapters_off(tmp_path):
    """The teacher of self-distillation is the shared base with adapters off: its evaluation must not be the
    student's own (the old card evaluated `trainer.teacher`, i.e. the student with its adapters on)."""
    student = _lora(bert(2))
    valid = token_dataset(16, seed=3)
    a = args(tmp_path, max_steps=4, learning_rate=5e-2, kd_weight=0.5, task_weight=1.0, per_device_eval_batch_size=8)
    trainer = DistillationTrainer(model=student, teacher_model=student, args=a, train_dataset=token_dataset(32),
                                  eval_dataset=valid, data_collator=collate, compute_metrics=_mean_p1)
    trainer.train()
    student_metrics = trainer.evaluate()
    batch = collate([valid[i] for i in range(len(valid))])
    batch.pop("labels")
    student.eval()
    with torch.no_grad():
        before = student(**batch).logits
        with student.disable_adapter():
            base_p1 = float(student(**batch).logits.softmax(-1)[:, 1].mean())
    metrics = trainer.evaluate_teacher()
    assert metrics["teacher_mean_p1"] == pytest.approx(base_p1, abs=1e-6)
    assert abs(metrics["teacher_mean_p1"] - student_metrics["eval_mean_p1"]) > 1e-4
    with torch.no_grad():  # the adapters are back on afterwards
        torch.testing.assert_close(student.eval()(**batch).logits, before, atol=0, rtol=0)
    trainer.create_model_card()
    text = (tmp_path / "out" / "README.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| mean_p1 |"))
    teacher_cell, student_cell = [c.strip() for c in row.strip("|").split("|")][1:3]
    assert teacher_cell == f"{base_p1:.4f}" and student_cell == f"{student_metrics['eval_mean_p1']:.4f}"


def test_card_names_the_modules_peft_trains_in_full_beside_the_adapters(tmp_path):
    """A SEQ_CLS LoRA student trains its classifier in full (PEFT's modules_to_save) and publishes it in
    adapter_model.safetensors: before, its card said "only the adapters were trained"."""
    student = _lora(bert(2))
    student.save_pretrained(tmp_path)
    saved = set(__import__("safetensors.torch").torch.load_file(str(tmp_path / "adapter_model.safetensors")))
    assert any("classifier" in k for k in saved)  # what the card must say is there
    line = next(x for x in write_model_card(tmp_path).read_text().splitlines() if x.startswith("- **Adapters**"))
    assert "classifier" in line and "only the adapters were trained" not in line
