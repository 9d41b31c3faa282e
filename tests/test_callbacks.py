"""Schedules and stage switches: exact values, what the trainer computes and logs, and exact resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import args, bert, collate, flat_params, token_dataset
from helpers import teacher as make_teacher
from transformers import TrainerCallback, TrainerState

from hf_distill import DistillationTrainer, losses
from hf_distill.callbacks import Schedule, ScheduleCallback, Stage, StageSwitchCallback, set_loss_field

TERMS = [
    {"loss": "hidden_mse", "layers": "uniform", "weight": 1.0},
    {"loss": "attention_score_mse", "layers": "uniform", "weight": 1.0},
]


class _StopAfterSave(TrainerCallback):
    """Simulates a killed job: training ends right after the checkpoint of `step` is written."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def _train_logs(trainer) -> dict[int, dict]:
    return {r["step"]: r for r in trainer.state.log_history if "loss" in r}


def _assert_same_logs(a: dict, b: dict, keys) -> None:
    for step in b:
        for key in keys:
            assert (key in a[step]) == (key in b[step]), (step, key)
            if key in a[step]:
                assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-9), (step, key)


# ---------------------------------------------------------------- schedules


def test_schedule_values_are_exact():
    lin, cos = Schedule(4.0, 1.0), Schedule(4.0, 1.0, "cosine")
    assert [lin.value(p) for p in (0, 0.25, 0.5, 1, 1.5)] == [4.0, 3.25, 2.5, 1.0, 1.0]
    assert cos.value(0) == 4.0 and cos.value(1) == 1.0
    assert cos.value(0.5) == pytest.approx(2.5, abs=1e-12)
    assert cos.value(0.25) == pytest.approx(1 + 3 * 0.5 * (1 + math.cos(math.pi / 4)), abs=1e-12)
    cb = ScheduleCallback({"temperature": cos, "term:hidden": {"start": 1, "end": 0}})
    assert cb.values_at(3, 12) == {"temperature": cos.value(0.25), "term:hidden": 0.75}
    with pytest.raises(ValueError, match="Cannot schedule"):
        ScheduleCallback({"learning_rate": lin})
    with pytest.raises(ValueError, match="kind"):
        Schedule(1, 0, "exp")


def test_schedules_drive_the_loss_step_by_step_and_resume(tmp_path):
    schedules = {
        "temperature": {"start": 4.0, "end": 1.0, "kind": "cosine"},
        "kd_weight": {"start": 1.0, "end": 0.2},
        "term:hidden": {"start": 2.0, "end": 0.0},
    }

    def run(out, resume=None):
        a = args(out, max_steps=6, distill_terms=TERMS[:1], kd_weight=1.0, task_weight=0.3,
                 save_strategy="steps", save_steps=2)
        trainer = DistillationTrainer(model=bert(layers=2), teacher_model=make_teacher(), args=a,
                                      train_dataset=token_dataset(48), data_collator=collate,
                                      callbacks=[ScheduleCallback(schedules)])
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    logs = _train_logs(full)
    assert sorted(logs) == [1, 2, 3, 4, 5, 6]
    for step, r in logs.items():
        p = (step - 1) / 6  # the value step k uses is the schedule at (k - 1) / max_steps
        assert r["temperature"] == pytest.approx(Schedule(4, 1, "cosine").value(p), abs=1e-12)
        assert r["kd_weight"] == pytest.approx(1.0 - 0.8 * p, abs=1e-12)
        assert r["weight_hidden"] == pytest.approx(2.0 * (1 - p), abs=1e-12)
        # The logged loss is the weighted sum with the scheduled weights: the trainer used them.
        total = r["kd_weight"] * r["loss_kd"] + 0.3 * r["loss_task"] + r["weight_hidden"] * r["loss_hidden"]
        assert r["loss"] == pytest.approx(total, rel=1e-5)

    # A fresh trainer resumed from the step-2 checkpoint (what a killed run would have left).
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "out" / "checkpoint-2"))
    torch.testing.assert_close(flat_params(resumed.model), flat_params(full.model), atol=1e-6, rtol=0)
    again = _train_logs(resumed)  # steps 1-2 come back from the checkpoint's history, 3-6 are new
    assert sorted(again) == [1, 2, 3, 4, 5, 6]
    _assert_same_logs(logs, again, ["loss", "loss_kd", "loss_hidden", "temperature", "kd_weight", "weight_hidden"])


def test_trainer_rereads_temperature_and_term_weights_each_step(tmp_path):
    student, teacher = bert(2), make_teacher()
    a = args(tmp_path, distill_terms=TERMS[:1], kd_weight=1.0, task_weight=0.0, temperature=2.0)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=a, data_collator=collate)
    batch = collate([token_dataset(6)[i] for i in range(6)])
    set_loss_field(trainer.settings, "temperature", 5.0)
    set_loss_field(trainer.settings, "term:hidden", 0.0)
    loss = trainer.compute_loss(student.train(), dict(batch))
    assert set(trainer.tracker.pop_means()) == {"kd"}
    with torch.no_grad():
        t = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    s = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert loss.item() == pytest.approx(losses.kl_div(s, t, 5.0).item(), rel=1e-5)
    with pytest.raises(ValueError, match="must be > 0"):
        set_loss_field(trainer.settings, "temperature", 0.0)
    with pytest.raises(ValueError, match="No distill_terms entry"):
        set_loss_field(trainer.settings, "term:attention", 1.0)


def test_zero_weight_terms_and_unneeded_teacher_cost_nothing(tmp_path):
    student, teacher = bert(2), make_teacher()
    a = args(tmp_path, distill_terms=TERMS, kd_weight=0.0, task_weight=1.0)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=a, data_collator=collate)
    calls = []
    trainer.teacher.register_forward_pre_hook(lambda *_: calls.append(1))
    batch = collate([token_dataset(4)[i] for i in range(4)])

    set_loss_field(trainer.settings, "term:attention", 0.0)
    trainer.compute_loss(student.train(), dict(batch))
    inter = trainer.intermediate
    assert inter.active == ("hidden",)
    for taps in (inter.student_taps, inter.teacher_taps):
        assert taps.request.hidden and not (taps.request.q or taps.request.k or taps.request.v)
    assert set(trainer.tracker.pop_means()) == {"task", "hidden"} and len(calls) == 1

    set_loss_field(trainer.settings, "term:hidden", 0.0)
    trainer.compute_loss(student.train(), dict(batch))
    assert not inter.student_taps.request and set(trainer.tracker.pop_means()) == {"task"}
    assert len(calls) == 1  # no term and kd_weight 0: the teacher does not run at all

    trainer.settings.distill_terms[0]["layers"] = "last"
    with pytest.raises(ValueError, match="only weights can change"):
        trainer.compute_loss(student.train(), dict(batch))


# ---------------------------------------------------------------- stages


def _tinybert_stages(lr_stage_2: float | None = 4e-3) -> list[Stage]:
    return [
        Stage(preset="tinybert_intermediate", until_step=3, name="intermediate",
              term_weights={"attention": {"start": 1.0, "end": 0.5}}),
        Stage(preset="tinybert_prediction", name="prediction", temperature={"start": 4.0, "end": 1.0, "kind": "cosine"},
              learning_rate=lr_stage_2, lr_scheduler_type="linear", warmup_ratio=0.5, reset_optimizer=True),
    ]


def _stage_run(out, stop=None, resume=None, restore=False, max_steps=6):
    switch = StageSwitchCallback(_tinybert_stages())
    a = args(out, max_steps=max_steps, learning_rate=1e-3, lr_scheduler_type="constant", save_strategy="steps",
             save_steps=2, restore_callback_states_from_checkpoint=restore, **switch.argument_fields())
    cbs = [switch] + ([_StopAfterSave(stop)] if stop else [])
    trainer = DistillationTrainer(model=bert(layers=2, hidden=16), teacher_model=make_teacher(), args=a,
                                  train_dataset=token_dataset(48), data_collator=collate, callbacks=cbs)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_argument_fields_declare_every_stage_term():
    fields = StageSwitchCallback(_tinybert_stages()).argument_fields()
    assert fields["kd_weight"] == 0.0 and fields["task_weight"] == 0.0
    assert [(t["name"], t["weight"]) for t in fields["distill_terms"]] == [("hidden", 1.0), ("attention", 1.0)]
    two = StageSwitchCallback([Stage(preset="tinybert_prediction", until_step=2),
                               Stage(preset="tinybert_intermediate")])
    assert [t["weight"] for t in two.argument_fields()["distill_terms"]] == [0.0, 0.0]
    assert two.argument_fields()["kd_loss"] == "soft_ce"


@pytest.fixture(scope="module")
def full_stage_run(tmp_path_factory):
    return _stage_run(tmp_path_factory.mktemp("full"))


def test_stage_switch_changes_loss_lr_and_optimizer_state(full_stage_run):
    trainer = full_stage_run
    logs = _train_logs(trainer)
    for step in (1, 2, 3):  # stage 1: hidden + attention, no logit loss
        r = logs[step]
        assert r["distill_stage"] == 0 and "loss_kd" not in r
        assert r["weight_attention"] == pytest.approx(1.0 - 0.5 * (step - 1) / 3, abs=1e-12)
        assert r["loss"] == pytest.approx(r["loss_hidden"] + r["weight_attention"] * r["loss_attention"], rel=1e-5)
        assert r["learning_rate"] == pytest.approx(1e-3)
    for step in (4, 5, 6):  # stage 2: soft cross-entropy on the logits alone
        r = logs[step]
        assert r["distill_stage"] == 1
        assert "loss_hidden" not in r and "loss_attention" not in r and "loss_task" not in r
        assert r["loss"] == pytest.approx(r["loss_kd"], rel=1e-6)
        assert r["temperature"] == pytest.approx(Schedule(4, 1, "cosine").value((step - 4) / 3), abs=1e-12)
    # Stage 2's own schedule over its 3 steps: linear warmup over ceil(0.5 * 3) = 2 steps, then decay.
    assert [logs[s]["learning_rate"] for s in (4, 5, 6)] == pytest.approx([0.0, 2e-3, 4e-3])
    assert trainer.settings.kd_loss == "soft_ce"
    assert trainer.settings.temperature == pytest.approx(Schedule(4, 1, "cosine").value(2 / 3))
    # The optimizer state was cleared when stage 2 started: Adam has counted its 3 steps only.
    p = next(trainer.model.parameters())
    assert int(trainer.optimizer.state[p]["step"]) == 3
    assert trainer.settings.distill_terms[0]["weight"] == 0.0  # what a card or a results file will read at the end
    assert StageSwitchCallback(_tinybert_stages()).describe()[1].startswith("prediction: tinybert_prediction")


@pytest.mark.parametrize(
    ("stop", "restore"),
    [(2, False), (4, True)],
    ids=["killed-in-stage-1", "resumed-in-stage-2-restore-callback-states"],
)
def test_kill_and_resume_matches_uninterrupted_run(tmp_path, stop, restore, full_stage_run):
    """Stage, loss weights, temperature schedule, stage learning-rate schedule and optimizer reset all
    continue exactly; with restore_callback_states_from_checkpoint the Trainer rebuilds the callback from
    its saved state, without it the callback reads that state from trainer_state.json itself."""
    full = full_stage_run
    if stop == 2:  # a run stopped right after its stage-1 checkpoint
        _stage_run(tmp_path / "cut", stop=stop)
        ckpt = tmp_path / "cut" / "out" / f"checkpoint-{stop}"
    else:  # the uninterrupted run's own stage-2 checkpoint
        ckpt = Path(full.args.output_dir) / f"checkpoint-{stop}"
    saved = json.loads((ckpt / "trainer_state.json").read_text())["stateful_callbacks"]["StageSwitchCallback"]
    assert saved["attributes"]["boundaries"] == [3] and saved["attributes"]["stage"] == (stop > 3)

    resumed = _stage_run(tmp_path / "cut", resume=str(ckpt), restore=restore)
    assert resumed.state.global_step == 6
    torch.testing.assert_close(flat_params(resumed.model), flat_params(full.model), atol=1e-6, rtol=0)
    torch.testing.assert_close(flat_params(resumed.intermediate.projections),
                               flat_params(full.intermediate.projections), atol=1e-6, rtol=0)
    logs, again = _train_logs(full), _train_logs(resumed)
    assert sorted(again) == [1, 2, 3, 4, 5, 6]
    _assert_same_logs(logs, again, ["loss", "loss_hidden", "loss_attention", "loss_kd", "distill_stage",
                                    "weight_attention", "temperature", "learning_rate"])


def test_epoch_boundaries_use_the_trainers_steps_per_epoch(tmp_path):
    switch = StageSwitchCallback([Stage(until_epoch=1.5, kd_weight=1.0), Stage(kd_weight=0.0, task_weight=1.0)])
    a = args(tmp_path, gradient_accumulation_steps=2)
    switch._resolve(a, TrainerState(), train_dataloader=range(7))  # 7 batches, GA 2 -> 4 steps per epoch
    assert switch.boundaries == [6]
    assert [switch.stage_at(s) for s in (0, 5, 6, 9)] == [0, 0, 1, 1]


def test_bad_stages_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not both"):
        Stage(until_step=2, until_epoch=1)
    with pytest.raises(ValueError, match="only the last stage"):
        StageSwitchCallback([Stage(kd_weight=1.0), Stage(kd_weight=0.0)])
    with pytest.raises(ValueError, match="unknown"):
        Stage(preset="distilgpt")
    switch = StageSwitchCallback([Stage(preset="tinybert_intermediate", until_step=2), Stage(kd_weight=1.0)])
    a = args(tmp_path, kd_weight=1.0)  # the intermediate terms are not declared
    with pytest.raises(ValueError, match="does not declare"):
        switch._resolve(a, TrainerState(), train_dataloader=range(4))
    switch = StageSwitchCallback([Stage(until_step=3, kd_weight=1.0), Stage(until_step=2), Stage()])
    with pytest.raises(ValueError, match="must increase"):
        switch._resolve(a, TrainerState(), train_dataloader=range(4))


class _OutOfMemoryAtFirstBatch(DistillationTrainer):
    """The first try (batch 8) runs out of memory at its first loss, after the first stage froze its modules."""

    def compute_loss(self, model, inputs, *rest, **kw):
        if len(inputs["input_ids"]) == 8:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().compute_loss(model, inputs, *rest, **kw)


def test_a_retry_of_auto_find_batch_size_still_unfreezes_at_the_stage_boundary(tmp_path):
    """The retry's `on_train_begin` finds the embeddings its failed try froze: they are still the user's trainable
    ones, so the second stage trains them, as in a run at the batch size found, and the model comes back trainable."""
    models = []
    for cls, size, auto in ((_OutOfMemoryAtFirstBatch, 8, True), (DistillationTrainer, 7, False)):
        switch = StageSwitchCallback([Stage(until_step=1, frozen=["bert.embeddings"]), Stage()])
        trainer = cls(model=bert(2), teacher_model=make_teacher(), train_dataset=token_dataset(14),
                      data_collator=collate, callbacks=[switch],
                      args=args(tmp_path / str(size), max_steps=2, optim="sgd", learning_rate=1.0,
                                auto_find_batch_size=auto, per_device_train_batch_size=size))
        trainer.train()
        assert all(p.requires_grad for p in trainer.model.parameters())
        models.append(trainer.model)
    start = bert(2).bert.embeddings.word_embeddings.weight
    assert not torch.equal(models[0].bert.embeddings.word_embeddings.weight, start)  # trained in the second stage
    torch.testing.assert_close(flat_params(models[0]), flat_params(models[1]), rtol=0, atol=1e-7)
