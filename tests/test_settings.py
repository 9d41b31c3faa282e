"""The run's loss settings (hf_distill.settings): built once from arguments a run never changes, one setter."""

from __future__ import annotations

import pytest
import torch
from helpers import args, labelled_collate, llama, sft_rows
from transformers import TrainerControl, TrainerState

from hf_distill import DistillationTrainer
from hf_distill.arguments import SETTINGS_FIELDS
from hf_distill.callbacks import Schedule, ScheduleCallback, Stage, StageSwitchCallback
from hf_distill.settings import DistillSettings


def _fields(a) -> dict:
    return {name: getattr(a, name) for name in SETTINGS_FIELDS}


def test_a_run_never_changes_its_arguments(tmp_path):
    """Head defaults and schedules go to the settings; the arguments stay as given (they were set by
    resolve_head_defaults and by every schedule step)."""
    a = args(tmp_path, max_steps=2, kd_loss="jsd")
    before = _fields(a)
    schedule = ScheduleCallback({"temperature": Schedule(4.0, 2.0), "kd_weight": Schedule(1.0, 0.5)})
    trainer = DistillationTrainer(model=llama(0), teacher_model=llama(1), args=a, train_dataset=sft_rows(16),
                                  data_collator=labelled_collate, callbacks=[schedule])
    assert trainer.settings.filled == {"temperature": 1.0, "kd_token_mask": "labels"}
    trainer.train()
    assert _fields(trainer.args) == before and trainer.args.temperature is None
    assert trainer.settings.temperature == pytest.approx(3.0) and trainer.settings.kd_weight == pytest.approx(0.75)
    logged = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["temperature"] for r in logged] == pytest.approx([4.0, 3.0])


def test_the_setter_applies_the_arguments_checks(tmp_path):
    s = DistillSettings(args(tmp_path, distill_terms=[{"loss": "hidden_mse", "name": "hidden"}]))
    for name, value, match in (("temperature", 0.0, "must be > 0"), ("kd_weight", -1.0, "must be >= 0"),
                               ("kd_loss", "cosine", "is unknown"), ("term:attention", 1.0, "No distill_terms entry"),
                               ("seed", 3, "Unknown loss field")):
        with pytest.raises(ValueError, match=match):
            s.set(name, value)
    s.set("term:hidden", 0.25)
    assert s.get("term:hidden") == 0.25 and s.terms[0].weight == 0.25 and s.distill_terms[0]["weight"] == 0.25


def test_fields_set_on_the_arguments_before_training_are_taken_over(tmp_path):
    """A hyperparameter-search trial sets its values on the arguments before training starts."""
    trainer = DistillationTrainer(model=llama(0), teacher_model=llama(1), args=args(tmp_path, kd_weight=0.5),
                                  train_dataset=sft_rows(4), data_collator=labelled_collate)
    trainer.args.kd_weight = 0.25
    trainer.callback_handler.on_train_begin(trainer.args, trainer.state, trainer.control)
    assert trainer.settings.kd_weight == 0.25 and trainer.settings.temperature == 1.0  # the head default kept


@pytest.mark.parametrize("callback", [ScheduleCallback({"temperature": Schedule(2, 1)}),
                                      StageSwitchCallback([Stage(kd_weight=1.0)])])
def test_loss_callbacks_need_the_runs_settings(tmp_path, callback):
    a = args(tmp_path)
    with pytest.raises(ValueError, match="needs a DistillationTrainer"):
        callback.on_train_begin(a, TrainerState(max_steps=3), TrainerControl(), model=torch.nn.Linear(1, 1))


def test_settings_record_what_the_run_used(tmp_path):
    a = args(tmp_path, kd_loss="jsd")
    s = DistillSettings(a, causal=True)
    s.set("kd_weight", 0.75)
    record = s.record(a)
    assert (record.temperature, record.kd_token_mask, record.kd_weight) == (1.0, "labels", 0.75)
    assert (a.temperature, a.kd_weight) == (None, 0.5)  # the arguments as given


def test_a_loss_field_set_on_the_arguments_during_training_is_taken_over(tmp_path):
    """A user's callback that sets `args.kd_weight` / `args.task_weight` mid-run (as worked when the run read its
    arguments) changes the loss from the next training step: never silently ignored."""
    from transformers import TrainerCallback

    class KDOff(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                args.kd_weight, args.task_weight = 0.0, 1.0

    a = args(tmp_path, max_steps=3, logging_steps=1, kd_weight=0.5, task_weight=0.5)
    trainer = DistillationTrainer(model=llama(0), teacher_model=llama(1), args=a, train_dataset=sft_rows(16),
                                  data_collator=labelled_collate, callbacks=[KDOff()])
    trainer.train()
    logged = [r for r in trainer.state.log_history if "loss" in r]
    assert logged[0]["loss"] == pytest.approx(0.5 * logged[0]["loss_kd"] + 0.5 * logged[0]["loss_task"], rel=1e-5)
    for r in logged[1:]:
        assert r["loss"] == pytest.approx(r["loss_task"], rel=1e-5)
    assert trainer.settings.kd_weight == 0.0 and trainer.settings.task_weight == 1.0
    trainer.args.kd_weight = -1.0  # the same checks as the arguments' own
    with pytest.raises(ValueError, match="must be >= 0"):
        trainer.settings.follow(trainer.args)


def test_a_field_that_cannot_change_while_training_is_refused_when_set_mid_run(tmp_path):
    """jsd_beta / skew_alpha / kd_token_mask were checked against the student when the trainer was built: set on the
    arguments mid-run they are refused, not taken over unchecked."""
    from transformers import TrainerCallback

    class Beta(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                args.jsd_beta = 0.3

    a = args(tmp_path, max_steps=3, kd_loss="kl")
    trainer = DistillationTrainer(model=llama(0), teacher_model=llama(1), args=a, train_dataset=sft_rows(16),
                                  data_collator=labelled_collate, callbacks=[Beta()])
    with pytest.raises(ValueError, match=r"jsd_beta changed during training"):
        trainer.train()


def test_a_step_whose_every_weight_a_callback_set_to_0_names_the_weights(tmp_path):
    """The callbacks guide's warm-up from 0 on a KD-only run: the error says the weights are 0 (it blamed labels)."""
    from transformers import TrainerCallback

    class WarmFromZero(TrainerCallback):
        def on_step_begin(self, args, state, control, distill_settings=None, **kwargs):
            distill_settings.set("kd_weight", min(1.0, state.global_step / 100))

    a = args(tmp_path, max_steps=2, kd_weight=1.0, task_weight=0.0)
    trainer = DistillationTrainer(model=llama(0), teacher_model=llama(1), args=a, train_dataset=sft_rows(16),
                                  data_collator=labelled_collate, callbacks=[WarmFromZero()])
    with pytest.raises(ValueError, match=r"Every loss weight is 0 at this step \(kd_weight=0.0, task_weight=0.0"):
        trainer.train()
