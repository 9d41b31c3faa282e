"""`DistillationArguments.from_training_arguments`: plain `TrainingArguments` become distillation arguments
with every field the user set kept, and `DistillationTrainer` upgrades them (with a warning) instead of
refusing them."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from helpers import args, bert, collate, token_dataset
from helpers import teacher as make_teacher
from transformers import BertConfig, BertForMaskedLM, HfArgumentParser, Seq2SeqTrainingArguments, TrainingArguments

from hf_distill import DistillationArguments, DistillationTrainer

PLAIN = DistillationArguments(output_dir="x", use_cpu=True, report_to=[])
DISTILLATION_FIELDS = [f.name for f in dataclasses.fields(DistillationArguments) if f.name not in
                       {g.name for g in dataclasses.fields(TrainingArguments)}]


def many_fields(tmp_path) -> TrainingArguments:
    """Non-default values, including fields that `__post_init__` transforms (strings to enums or lists,
    a JSON string to a dict, a dict to an AcceleratorConfig, booleans to strings)."""
    return TrainingArguments(
        output_dir=str(tmp_path / "ta"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=5,
        gradient_accumulation_steps=2,
        learning_rate=3e-4,
        weight_decay=0.01,
        adam_beta2=0.98,
        adam_epsilon=1e-7,
        max_grad_norm=0.5,
        num_train_epochs=2.0,
        max_steps=4,
        lr_scheduler_type="cosine_with_restarts",
        lr_scheduler_kwargs='{"num_cycles": 2}',
        warmup_steps=2,
        logging_strategy="steps",
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=4,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=False,
        seed=7,
        data_seed=11,
        label_smoothing_factor=0.1,
        optim="adamw_torch",
        report_to="none",
        run_name="upgrade-me",
        remove_unused_columns=False,
        label_names=["labels"],
        dataloader_drop_last=True,
        disable_tqdm=True,
        include_num_input_tokens_seen=True,
        accelerator_config={"split_batches": False, "even_batches": False},
        hub_model_id="me/student",
        hub_private_repo=True,
        use_cpu=True,
        bf16=True,
    )


def test_every_training_argument_survives_the_upgrade(tmp_path):
    ta = many_fields(tmp_path)
    before = ta.to_dict()
    up = DistillationArguments.from_training_arguments(ta)
    assert type(up) is DistillationArguments
    after = up.to_dict()
    assert {k: after[k] for k in before} == before
    for f in dataclasses.fields(TrainingArguments):
        assert getattr(up, f.name) == getattr(ta, f.name), f.name
    assert ta.to_dict() == before  # the original is not changed
    # the distillation fields hold their plain defaults
    assert {k: getattr(up, k) for k in DISTILLATION_FIELDS} == {k: getattr(PLAIN, k) for k in DISTILLATION_FIELDS}


def test_upgrade_takes_distillation_fields_and_keeps_distillation_arguments_as_they_are(tmp_path):
    ta = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], learning_rate=1e-3)
    up = DistillationArguments.from_training_arguments(ta, distill_preset="tinybert_prediction", temperature=2.0)
    assert (up.learning_rate, up.kd_loss, up.temperature, up.task_weight) == (1e-3, "soft_ce", 2.0, 0.0)
    assert DistillationArguments.from_training_arguments(up) is up


def test_upgrade_refuses_fields_that_distillation_arguments_cannot_hold(tmp_path):
    ta = Seq2SeqTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], predict_with_generate=True)
    with pytest.raises(TypeError, match="predict_with_generate.*DistillationArguments"):
        DistillationArguments.from_training_arguments(ta)


def test_trainer_upgrades_training_arguments_with_a_warning_and_trains(tmp_path, caplog):
    ta = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=2,
                           learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                           seed=3, disable_tqdm=True)
    with caplog.at_level(logging.WARNING):
        trainer = DistillationTrainer(model=bert(2), teacher_model=make_teacher(), args=ta,
                                      train_dataset=token_dataset(16), data_collator=collate)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "TrainingArguments" in r.getMessage()]
    assert len(warnings) == 1
    assert "DistillationArguments" in warnings[0].getMessage() and "kd_weight=0.5" in warnings[0].getMessage()
    assert isinstance(trainer.args, DistillationArguments)
    assert {k: v for k, v in trainer.args.to_dict().items() if k in ta.to_dict()} == ta.to_dict()
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all("loss_kd" in h and "loss_task" in h for h in logged)


# ------------------------------------------------ arguments that would do nothing are refused (issue 28, case 7)

BASE = {"output_dir": "out", "use_cpu": True, "report_to": []}


def test_jsd_beta_without_kd_loss_jsd_is_refused_as_a_keyword_a_flag_and_with_a_preset():
    with pytest.raises(ValueError, match=r"jsd_beta=0.3 does nothing with kd_loss='kl'.*kd_loss='jsd'"):
        DistillationArguments(**BASE, jsd_beta=0.3)
    with pytest.raises(ValueError, match="jsd_beta=0.5 does nothing with kd_loss='soft_ce'"):  # the default, given
        DistillationArguments(**BASE, distill_preset="tinybert_prediction", jsd_beta=0.5)
    with pytest.raises(ValueError, match="jsd_beta=0.2 does nothing with kd_loss='reverse_kl'"):
        HfArgumentParser(DistillationArguments).parse_args_into_dataclasses(
            ["--output_dir", "out", "--kd_loss", "reverse_kl", "--jsd_beta", "0.2"])
    # with jsd it is kept; unset it is 0.5 where used (summary, loss) and never becomes "given"
    assert DistillationArguments(**BASE, kd_loss="jsd", jsd_beta=0.3).distillation_summary()["jsd_beta"] == 0.3
    jsd = DistillationArguments(**BASE, kd_loss="jsd")
    assert jsd.jsd_beta is None and jsd.distillation_summary()["jsd_beta"] == 0.5 and jsd.effective_jsd_beta == 0.5
    assert dataclasses.replace(jsd, kd_loss="kl").kd_loss == "kl"


def _trainer(tmp_path, student=None, teacher=None, **kw):
    return DistillationTrainer(model=student if student is not None else bert(2),
                               teacher_model=teacher if teacher is not None else make_teacher(),
                               args=args(tmp_path, **kw), train_dataset=token_dataset(16), data_collator=collate)


def test_kd_token_mask_is_refused_for_a_sequence_level_student(tmp_path):
    with pytest.raises(ValueError, match=r"kd_token_mask='labels' does nothing for this student \(single-label"):
        _trainer(tmp_path, kd_token_mask="labels")
    trainer = _trainer(tmp_path)  # not given: left unset for a classifier
    assert trainer.settings.kd_token_mask is None
    mlm = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=120)
    trainer = _trainer(tmp_path, BertForMaskedLM(BertConfig(**mlm)), BertForMaskedLM(BertConfig(**mlm)),
                       kd_token_mask="labels")
    assert trainer.settings.kd_token_mask == "labels"


def test_teacher_weights_and_multi_teacher_are_refused_with_one_teacher(tmp_path):
    with pytest.raises(ValueError, match=r"teacher_weights=\[1.0\] does nothing with 1 teacher model"):
        _trainer(tmp_path, teacher_weights=[1.0])
    with pytest.raises(ValueError, match="multi_teacher='losses' does nothing with 1 teacher model"):
        _trainer(tmp_path, multi_teacher="losses")
    trainer = _trainer(tmp_path, teacher=[make_teacher(), make_teacher(seed=2)], teacher_weights=[1.0, 3.0],
                       multi_teacher="losses")
    assert trainer.teacher_weights == [0.25, 0.75]
    assert _trainer(tmp_path).args.distillation_summary()["multi_teacher"] == "probs"


def test_projection_lr_is_refused_when_no_projection_is_trained(tmp_path):
    with pytest.raises(ValueError, match="projection_lr=0.01 does nothing: this run trains no projection"):
        _trainer(tmp_path, projection_lr=0.01)
    with pytest.raises(ValueError, match="projection_lr=0.01 does nothing"):  # equal widths: nothing to project
        _trainer(tmp_path, projection_lr=0.01, distill_terms=["loss=hidden_mse,layers=last"])
    trainer = _trainer(tmp_path, student=bert(2, hidden=16), projection_lr=0.01,
                       distill_terms=["loss=hidden_mse,layers=last"])
    assert trainer.intermediate.projections is not None


@pytest.mark.parametrize("generation", [dict(lmbda=0.5), dict(lmbda=1.0), dict(seq_kd=True)],
                         ids=["lmbda_half", "lmbda_1", "seq_kd"])
def test_a_run_that_generates_defaults_to_gkds_loss_weights(generation):
    """Issue #39, case 6: with neither kd_weight nor task_weight given, a generating run trains on KD alone (GKD and
    TRL put no cross-entropy on the student's own samples); an off-policy run keeps 0.5 / 0.5."""
    run = DistillationArguments(output_dir="x", use_cpu=True, report_to=[], **generation)
    assert (run.kd_weight, run.task_weight) == (1.0, 0.0)
    assert (PLAIN.kd_weight, PLAIN.task_weight) == (0.5, 0.5)
    # what is given wins, field by field, and the other field takes the generating default
    given = DistillationArguments(output_dir="x", use_cpu=True, report_to=[], task_weight=0.5, **generation)
    assert (given.kd_weight, given.task_weight) == (1.0, 0.5)
    given = DistillationArguments(output_dir="x", use_cpu=True, report_to=[], kd_weight=0.5, **generation)
    assert (given.kd_weight, given.task_weight) == (0.5, 0.0)
    preset = DistillationArguments(output_dir="x", use_cpu=True, report_to=[], distill_preset="distilbert",
                                   **generation)
    assert (preset.kd_weight, preset.task_weight) == (5.0, 2.0)  # a preset's weights win too
    # resolved once: replace keeps the values (a later lmbda does not re-resolve them), flags resolve the same way
    assert (dataclasses.replace(run, lmbda=0.0, seq_kd=False).kd_weight, run.task_weight) == (1.0, 0.0)
    flags = [f"--{k}={v}" for k, v in generation.items()]
    (parsed,) = HfArgumentParser(DistillationArguments).parse_args_into_dataclasses(
        ["--output_dir=x", "--use_cpu=True", "--report_to=none", *flags])
    assert (parsed.kd_weight, parsed.task_weight) == (1.0, 0.0)


def test_readme_on_policy_snippet_resolves_to_gkds_loss():
    """Issue #39, case 9: README's snippet (task_weight=0.0, kd_weight not given) is GKD's loss, KD at weight 1 (it
    was 0.5 x KD, half GKD's gradient). tests/test_on_policy.py checks the loss itself."""
    run = DistillationArguments(output_dir="out", lmbda=0.5, kd_loss="jsd", task_weight=0.0, max_new_tokens=128)
    assert (run.kd_weight, run.task_weight) == (1.0, 0.0)


def test_every_argument_check_runs_from_one_list(tmp_path, monkeypatch):
    """Each feature's checks live in its module and are collected once (argument_checks.CHECKS): a check added
    there runs when the arguments are built, and the features' own checks are in it."""
    from hf_distill import argument_checks
    from hf_distill.base.generation_checks import validate_generation_arguments
    from hf_distill.losses.cross_tokenizer import validate_cross_tokenizer

    assert validate_cross_tokenizer in argument_checks.CHECKS
    assert validate_generation_arguments in argument_checks.CHECKS

    def refuse(args):
        raise ValueError("a feature's own check ran")

    monkeypatch.setattr(argument_checks, "CHECKS", (*argument_checks.CHECKS, refuse))
    with pytest.raises(ValueError, match="a feature's own check ran"):
        DistillationArguments(output_dir=str(tmp_path), report_to="none")
