"""DistillationTrainer with logit distillation: loss scale, logging, teacher handling, saving, bad input."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import VOCAB, args, bert, collate, flat_params, token_dataset
from helpers import teacher as make_teacher
from safetensors.torch import load_file
from torch import nn
from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

from hf_distill import DistillationArguments, DistillationTrainer, losses


def _train(tmp_path, student, teacher, **kw):
    data = kw.pop("data", None) or token_dataset(32)
    trainer = DistillationTrainer(
        model=student,
        teacher_model=teacher,
        args=args(tmp_path, **kw),
        train_dataset=data,
        data_collator=collate,
    )
    trainer.train()
    return trainer


def _logs(trainer):
    return [r for r in trainer.state.log_history if "loss" in r]


# ---------------------------------------------------------------- loss scale


@pytest.mark.slow
def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    """GA 2 x batch 4 must give the same update and logged values as GA 1 x batch 8 (SGD: a scale bug shows)."""
    common = dict(max_steps=2, optim="sgd", learning_rate=0.5, temperature=2.0)
    big = _train(tmp_path / "a", bert(2), make_teacher(), per_device_train_batch_size=8, **common)
    acc = _train(
        tmp_path / "b",
        bert(2),
        make_teacher(),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        **common,
    )
    assert torch.allclose(flat_params(big.model), flat_params(acc.model), atol=1e-6, rtol=0)
    for a, b in zip(_logs(big), _logs(acc), strict=True):
        for key in ("loss", "loss_kd", "loss_task"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key


def test_logged_loss_is_weighted_sum_of_components(tmp_path):
    trainer = _train(
        tmp_path, bert(2), make_teacher(), kd_weight=0.7, task_weight=0.3, max_steps=4, logging_steps=2
    )
    logs = _logs(trainer)
    assert len(logs) == 2
    for r in logs:
        assert r["loss"] == pytest.approx(0.7 * r["loss_kd"] + 0.3 * r["loss_task"], rel=1e-5)


def test_loss_equals_hand_computation(tmp_path):
    student, teacher = bert(2), make_teacher()
    a = args(tmp_path, kd_loss="kl", temperature=3.0, kd_weight=0.6, task_weight=0.4)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=a, data_collator=collate)
    batch = collate([token_dataset(6)[i] for i in range(6)])
    loss = trainer.compute_loss(student.train(), dict(batch))
    with torch.no_grad():
        t = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    s = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = 0.6 * losses.kl_div(s, t, 3.0) + 0.4 * F.cross_entropy(s, batch["labels"])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


# ---------------------------------------------------------------- teacher handling


def test_teacher_frozen_eval_and_not_wrapped(tmp_path):
    teacher = make_teacher()
    before = flat_params(teacher).clone()
    trainer = _train(tmp_path, bert(2), teacher, learning_rate=0.1)
    assert trainer.teacher is teacher
    assert not teacher.training
    assert not any(p.requires_grad for p in teacher.parameters())
    assert torch.equal(before, flat_params(teacher))
    assert not any(p is q for p in trainer.model.parameters() for q in teacher.parameters())


def test_teacher_loaded_from_path(tmp_path):
    teacher = make_teacher()
    teacher.save_pretrained(tmp_path / "teacher")
    trainer = DistillationTrainer(
        model=bert(2), teacher_model=str(tmp_path / "teacher"), args=args(tmp_path), data_collator=collate
    )
    assert isinstance(trainer.teacher, BertForSequenceClassification)
    assert torch.equal(flat_params(trainer.teacher), flat_params(teacher))


def test_bf16_runs_teacher_and_student_in_bf16(tmp_path):
    student, teacher = bert(2), make_teacher()
    seen = {}
    for name, model in (("student", student), ("teacher", teacher)):
        lin = model.bert.encoder.layer[0].attention.self.query
        lin.register_forward_hook(lambda m, i, o, name=name: seen.setdefault(name, o.dtype) and None)
    trainer = _train(tmp_path, student, teacher, bf16=True, max_steps=2)
    assert seen == {"student": torch.bfloat16, "teacher": torch.bfloat16}
    for r in _logs(trainer):
        assert all(torch.isfinite(torch.tensor(r[k])) for k in ("loss", "loss_kd", "loss_task"))


# ---------------------------------------------------------------- cached teacher logits


@pytest.mark.slow
def test_teacher_logits_column_replaces_teacher_forward(tmp_path):
    teacher = make_teacher()
    data = token_dataset(16)
    with torch.no_grad():
        cached = [teacher(input_ids=torch.tensor([r["input_ids"]])).logits[0].tolist() for r in data]
    data = data.add_column("teacher_logits", cached)
    calls = []
    teacher.register_forward_hook(lambda *a: calls.append(1))
    with_teacher = _train(tmp_path / "a", bert(2), teacher, data=data, optim="sgd", learning_rate=0.5)
    assert calls == []  # the column survived remove_unused_columns and was used
    without = _train(tmp_path / "b", bert(2), None, data=data, optim="sgd", learning_rate=0.5)
    online = _train(tmp_path / "c", bert(2), teacher, data=token_dataset(16), optim="sgd", learning_rate=0.5)
    assert torch.allclose(flat_params(with_teacher.model), flat_params(without.model), atol=0)
    assert torch.allclose(flat_params(online.model), flat_params(without.model), atol=1e-5)


def test_teacher_logits_width_mismatch_is_refused(tmp_path):
    data = token_dataset(8).add_column("teacher_logits", [[0.0, 1.0, 2.0]] * 8)
    with pytest.raises(ValueError, match="teacher_logits have width 3 but the student has 2 labels"):
        DistillationTrainer(model=bert(2), args=args(tmp_path), train_dataset=data, data_collator=collate)


def test_no_teacher_and_no_cached_logits_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs teacher logits"):
        DistillationTrainer(
            model=bert(2), args=args(tmp_path), train_dataset=token_dataset(8), data_collator=collate
        )


# ---------------------------------------------------------------- evaluation and saving


def test_evaluation_is_the_students_and_skips_the_teacher(tmp_path):
    student, teacher = bert(2), make_teacher()
    calls = []
    teacher.register_forward_hook(lambda *a: calls.append(1))
    eval_data = token_dataset(12, seed=3)

    def accuracy(p):
        return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}

    trainer = DistillationTrainer(
        model=student,
        teacher_model=teacher,
        args=args(tmp_path),
        eval_dataset=eval_data,
        data_collator=collate,
        compute_metrics=accuracy,
    )
    metrics = trainer.evaluate()
    assert calls == []
    batch = collate([eval_data[i] for i in range(len(eval_data))])
    with torch.no_grad():
        logits = student.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert metrics["eval_accuracy"] == pytest.approx(
        (logits.argmax(-1) == batch["labels"]).float().mean().item()
    )
    assert metrics["eval_loss"] == pytest.approx(F.cross_entropy(logits, batch["labels"]).item(), rel=1e-5)

    trainer.args.eval_with_teacher = True
    trainer.evaluate()
    assert calls, "eval_with_teacher=True must run the teacher"


def test_save_model_writes_the_student_alone(tmp_path):
    trainer = _train(tmp_path, bert(2), make_teacher())
    out = tmp_path / "student"
    trainer.save_model(str(out))
    weights = load_file(out / "model.safetensors")
    assert set(weights) == set(trainer.model.state_dict())
    reloaded = BertForSequenceClassification.from_pretrained(out)
    assert reloaded.config.num_hidden_layers == 2
    assert torch.equal(flat_params(reloaded), flat_params(trainer.model))
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2


# ---------------------------------------------------------------- any nn.Module student


class BiLSTMClassifier(nn.Module):
    """Tang et al. (2019): a BiLSTM student distilled from BERT with a logit MSE."""

    def __init__(self, vocab=VOCAB, dim=16, labels=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * dim, labels)

    def forward(self, input_ids, attention_mask):
        h, _ = self.lstm(self.embed(input_ids))
        m = attention_mask.unsqueeze(-1).float()
        return self.head((h * m).sum(1) / m.sum(1))


def test_bilstm_student_learns_from_bert_teacher(tmp_path):
    teacher = make_teacher()
    student = BiLSTMClassifier()
    trainer = _train(
        tmp_path,
        student,
        teacher,
        kd_loss="mse",
        kd_weight=1.0,
        task_weight=0.0,
        max_steps=30,
        learning_rate=1e-2,
        data=token_dataset(64),
    )
    logs = _logs(trainer)
    assert "loss_kd" in logs[0] and "loss_task" not in logs[0]
    first, last = sum(r["loss_kd"] for r in logs[:5]) / 5, sum(r["loss_kd"] for r in logs[-5:]) / 5
    assert last < 0.5 * first
    trainer.save_model(str(tmp_path / "lstm"))
    weights = load_file(tmp_path / "lstm" / "model.safetensors")
    assert set(weights) == set(student.state_dict())


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", 0.0, "temperature must be > 0"),
        ("temperature", -1.0, "temperature must be > 0"),
        ("kd_weight", -0.1, "kd_weight must be >= 0"),
        ("task_weight", -1.0, "task_weight must be >= 0"),
        ("kd_loss", "js", "kd_loss='js' is unknown. Known: kl, soft_ce, mse, reverse_kl, jsd"),
        ("projection", "mlp", "projection='mlp' is unknown"),
    ],
)
def test_bad_arguments_are_refused(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        args(tmp_path, **{field: value})


def test_all_zero_weights_are_refused(tmp_path):
    with pytest.raises(ValueError, match="All loss weights are zero"):
        args(tmp_path, kd_weight=0.0, task_weight=0.0)


def test_arguments_that_are_not_training_arguments_are_refused(tmp_path):
    # plain TrainingArguments are upgraded instead (tests/test_arguments.py)
    with pytest.raises(TypeError, match=r"needs DistillationArguments \(or TrainingArguments\), got dict"):
        DistillationTrainer(model=bert(2), teacher_model=bert(4), args={"output_dir": str(tmp_path)})


def test_label_count_mismatch_is_refused(tmp_path):
    with pytest.raises(ValueError, match="teacher has 3 labels and the student 2"):
        DistillationTrainer(
            model=bert(2), teacher_model=bert(4, labels=3), args=args(tmp_path), data_collator=collate
        )


def test_label_order_mismatch_is_refused(tmp_path):
    s = bert(2, id2label={0: "negative", 1: "positive"})
    t = bert(4, id2label={0: "positive", 1: "negative"})
    with pytest.raises(ValueError, match="differ in names or order"):
        DistillationTrainer(model=s, teacher_model=t, args=args(tmp_path), data_collator=collate)


def test_vocabulary_mismatch_for_token_level_logits_is_refused(tmp_path):
    cfg = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    student = BertForMaskedLM(BertConfig(vocab_size=VOCAB, **cfg))
    teacher = BertForMaskedLM(BertConfig(vocab_size=VOCAB + 8, **cfg))
    with pytest.raises(ValueError, match="Vocabulary sizes differ \\(student 120, teacher 128\\)"):
        DistillationTrainer(model=student, teacher_model=teacher, args=args(tmp_path), data_collator=collate)


def test_token_level_logits_use_the_attention_mask(tmp_path):
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    student, teacher = BertForMaskedLM(BertConfig(**cfg)), BertForMaskedLM(BertConfig(**cfg))
    a = args(tmp_path, kd_weight=1.0, task_weight=0.0)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=a, data_collator=collate)
    batch = collate([token_dataset(4)[i] for i in range(4)])
    batch.pop("labels")
    loss = trainer.compute_loss(student.train(), dict(batch))
    with torch.no_grad():
        t = teacher(**batch).logits
    s = student(**batch).logits
    assert loss.item() == pytest.approx(
        losses.kl_div(s, t, 2.0, mask=batch["attention_mask"]).item(), rel=1e-5
    )
    assert not torch.isclose(loss, losses.kl_div(s, t, 2.0))


def test_arguments_parse_from_command_line_and_yaml(tmp_path):
    from transformers import HfArgumentParser

    parser = HfArgumentParser(DistillationArguments)
    (cli,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--temperature",
            "4",
            "--kd_loss",
            "soft_ce",
            "--kd_weight",
            "1",
            "--task_weight",
            "0",
            "--use_cpu",
            "true",
        ]
    )
    assert (cli.temperature, cli.kd_loss, cli.kd_weight, cli.task_weight) == (4.0, "soft_ce", 1.0, 0.0)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"output_dir: {tmp_path}\ntemperature: 3.0\nkd_loss: mse\nuse_cpu: true\n")
    (from_yaml,) = parser.parse_yaml_file(str(cfg))
    assert (from_yaml.temperature, from_yaml.kd_loss) == (3.0, "mse")


@pytest.mark.parametrize(("kind", "beta"), [("jsd", 0.3), ("reverse_kl", None)])  # beta: jsd only
def test_jsd_and_reverse_kl_are_the_kd_term(tmp_path, kind, beta):
    import copy

    data = token_dataset(8)
    student, teacher = bert(2), make_teacher()
    s0, t0 = copy.deepcopy(student), copy.deepcopy(teacher)
    trainer = _train(tmp_path, student, teacher, data=data, kd_loss=kind, jsd_beta=beta, max_steps=1,
                     per_device_train_batch_size=8, temperature=2.0)
    batch = collate([data[i] for i in range(8)])
    with torch.no_grad():
        s = s0(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        t = t0(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = losses.generalized_jsd(s, t, beta=beta, temperature=2.0) if kind == "jsd" else losses.reverse_kl(
        s, t, 2.0)
    assert _logs(trainer)[0]["loss_kd"] == pytest.approx(float(expected), rel=1e-5)
    assert float(expected) > 1e-3


@pytest.mark.parametrize("beta", [-0.1, 1.5])
def test_jsd_beta_outside_the_unit_interval_is_refused(tmp_path, beta):
    with pytest.raises(ValueError, match="jsd_beta"):
        args(tmp_path, kd_loss="jsd", jsd_beta=beta)


class BagOfWords(nn.Module):
    """A student that is a plain nn.Module (no PreTrainedModel, no config): mean-pooled embeddings -> classes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.out = nn.Embedding(VOCAB, 16), nn.Linear(16, 2)

    def forward(self, input_ids, attention_mask, labels=None):
        mask = attention_mask.unsqueeze(-1).float()
        return {"logits": self.out((self.embed(input_ids) * mask).sum(1) / mask.sum(1))}


def test_a_plain_module_student_checkpoints_and_resumes_to_the_uninterrupted_run(tmp_path):
    """The test helpers train with save_strategy="no"; under the Trainer's default of saving, a student that is not a
    PreTrainedModel goes through its other save path (an early-exit model's crashed there): saved, resumed, equal."""
    from transformers import TrainerCallback

    class StopAfterTheFirstSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            control.should_training_stop = True

    final = {}
    for name in ("whole", "stopped", "resumed"):
        trainer = DistillationTrainer(
            model=BagOfWords(), teacher_model=make_teacher(), train_dataset=token_dataset(16), data_collator=collate,
            args=args(tmp_path / ("whole" if name == "whole" else "cut"), max_steps=4, save_strategy="steps",
                      save_steps=2, per_device_train_batch_size=4),
            callbacks=[StopAfterTheFirstSave()] if name == "stopped" else None)
        checkpoint = tmp_path / "cut" / "out" / "checkpoint-2"
        trainer.train(resume_from_checkpoint=str(checkpoint) if name == "resumed" else None)
        final[name] = (trainer.state.global_step, flat_params(trainer.model))
    assert (checkpoint / "model.safetensors").is_file() and final["stopped"][0] == 2
    assert final["resumed"][0] == final["whole"][0] == 4
    torch.testing.assert_close(final["resumed"][1], final["whole"][1], rtol=0, atol=1e-6)
