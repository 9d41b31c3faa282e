"""MobileBERT's progressive transfer (hf_distill.students.progressive): one block per stage, the blocks below frozen."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import args, collate, mobilebert, token_dataset
from helpers import teacher as make_teacher
from test_callbacks import _StopAfterSave, _train_logs
from transformers import TrainerCallback

from hf_distill import DistillationTrainer
from hf_distill.callbacks import Stage, StageSwitchCallback
from hf_distill.students.progressive import block_names, progressive_stages


def _run(out, freeze=True, stop=None, resume=None, snapshots=None):
    student, teacher = mobilebert(layers=2, hidden=32, heads=4), make_teacher(layers=2, hidden=32, heads=4)
    terms, switch = progressive_stages(student, teacher, epochs_per_stage=1, learning_rate=1e-3,
                                       freeze_lower=freeze, warmup_ratio=0.0)
    a = args(out, max_steps=-1, num_train_epochs=2, learning_rate=1e-3, distill_terms=terms, kd_weight=0.0,
             task_weight=0.0, save_strategy="steps", save_steps=2, per_device_train_batch_size=8)
    callbacks = [switch] + ([_StopAfterSave(stop)] if stop else [])
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=a, train_dataset=token_dataset(24),
                                  data_collator=collate, callbacks=callbacks)
    if snapshots is not None:  # the student's weights at each stage boundary (3 steps per epoch)
        class Record(TrainerCallback):
            def on_step_end(self, args, state, control, model=None, **kwargs):
                if state.global_step in (3, 6):
                    snapshots[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}

        trainer.add_callback(Record())
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_terms_and_stages_follow_the_blocks():
    student, teacher = mobilebert(layers=2, hidden=32, heads=4), make_teacher(layers=2, hidden=32, heads=4)
    assert block_names(student) == ("mobilebert.embeddings",
                                    ["mobilebert.encoder.layer.0", "mobilebert.encoder.layer.1"])
    terms, switch = progressive_stages(student, teacher, epochs_per_stage=1.5, learning_rate=1e-3)
    assert [(t["name"], t["loss"], t["layers"], t["weight"]) for t in terms] == [
        ("hidden_1", "hidden_mse", [[1, 1]], 1.0), ("attention_1", "relation_kl", [[1, 1]], 1.0),
        ("hidden_2", "hidden_mse", [[2, 2]], 0.0), ("attention_2", "relation_kl", [[2, 2]], 0.0)]
    first, second = switch.stages
    assert first.until_epoch == 1.5 and first.frozen == [] and not first.reset_optimizer
    assert second.until_epoch is None and second.reset_optimizer
    assert second.frozen == ["mobilebert.embeddings", "mobilebert.encoder.layer.0"]
    assert second.term_weights == {"hidden_1": 0.0, "attention_1": 0.0, "hidden_2": 1.0, "attention_2": 1.0}
    _, loose = progressive_stages(student, teacher, epochs_per_stage=1, learning_rate=1e-3, freeze_lower=False)
    assert all(s.frozen == [] for s in loose.stages)


def test_stage_k_trains_block_k_only_with_lower_blocks_frozen(tmp_path):
    snaps: dict = {}
    trainer = _run(tmp_path, snapshots=snaps)
    logs = _train_logs(trainer)
    assert all(logs[s]["distill_stage"] == 0 and "loss_hidden_1" in logs[s] and "loss_hidden_2" not in logs[s]
               for s in (1, 2, 3))
    assert all(logs[s]["distill_stage"] == 1 and "loss_attention_2_qk" in logs[s]
               and "loss_attention_1_qk" not in logs[s] for s in (4, 5, 6))
    at3, at6 = snaps[3], snaps[6]
    emb, b0, b1 = "mobilebert.embeddings", "mobilebert.encoder.layer.0", "mobilebert.encoder.layer.1"
    changed = {n for n in at3 if not torch.equal(at3[n], at6[n])}
    assert changed and all(n.startswith(b1 + ".") for n in changed)  # stage 2 moved block 2 only
    assert any(n.startswith(b0 + ".") for n in at3) and not any(n.startswith(emb + ".") for n in changed)
    # Back in the user's hands, every parameter trains again.
    assert all(p.requires_grad for p in trainer.model.parameters())


def test_without_freezing_lower_blocks_keep_training(tmp_path):
    snaps: dict = {}
    _run(tmp_path, freeze=False, snapshots=snaps)
    changed = {n for n in snaps[3] if not torch.equal(snaps[3][n], snaps[6][n])}
    assert any(n.startswith("mobilebert.encoder.layer.0.") for n in changed)


@pytest.mark.slow
def test_resume_in_the_second_stage_keeps_the_freeze(tmp_path):
    full = _run(tmp_path / "full")
    cut = tmp_path / "cut"
    _run(cut, stop=4)
    ckpt = cut / "out" / "checkpoint-4"
    saved = json.loads((ckpt / "trainer_state.json").read_text())["stateful_callbacks"]["StageSwitchCallback"]
    assert saved["args"]["stages"][1]["frozen"] == ["mobilebert.embeddings", "mobilebert.encoder.layer.0"]
    resumed = _run(cut, resume=str(ckpt))
    for (n, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=n)


def test_bad_progressive_setups_are_refused(tmp_path):
    teacher = make_teacher(layers=2, hidden=32, heads=4)
    with pytest.raises(ValueError, match="the student has 3 blocks, the teacher 2"):
        progressive_stages(mobilebert(layers=3), teacher, epochs_per_stage=1, learning_rate=1e-3)
    with pytest.raises(ValueError, match="the student has 2 heads, the teacher 4"):
        progressive_stages(mobilebert(layers=2, heads=2), teacher, epochs_per_stage=1, learning_rate=1e-3)
    switch = StageSwitchCallback([Stage(until_step=1, frozen=["mobilebert.encoder.layer.9"]), Stage()])
    with pytest.raises(ValueError, match="names no parameter"):
        switch._check_frozen(args(tmp_path), mobilebert())


def test_stages_beyond_max_steps_are_refused(tmp_path):
    student, teacher = mobilebert(layers=2, hidden=32, heads=4), make_teacher(layers=2, hidden=32, heads=4)
    terms, switch = progressive_stages(student, teacher, epochs_per_stage=1, learning_rate=1e-3)
    a = args(tmp_path, max_steps=3, distill_terms=terms, kd_weight=0.0, task_weight=0.0)  # 3 steps per epoch
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=a, train_dataset=token_dataset(24),
                                  data_collator=collate, callbacks=[switch])
    with pytest.raises(ValueError, match="the last stage\\(s\\) would never run"):
        trainer.train()


def test_an_interrupted_run_hands_back_every_parameter_trainable(tmp_path):
    class Boom(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 4:  # inside stage 2, with the embeddings and block 1 frozen
                raise KeyboardInterrupt

    student, teacher = mobilebert(layers=2, hidden=32, heads=4), make_teacher(layers=2, hidden=32, heads=4)
    student.classifier.weight.requires_grad_(False)  # the user's own choice survives
    terms, switch = progressive_stages(student, teacher, epochs_per_stage=1, learning_rate=1e-3)
    a = args(tmp_path, max_steps=-1, num_train_epochs=2, distill_terms=terms, kd_weight=0.0, task_weight=0.0)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=a, train_dataset=token_dataset(24),
                                  data_collator=collate, callbacks=[switch, Boom()])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    frozen = [n for n, p in student.named_parameters() if not p.requires_grad]
    assert frozen == ["classifier.weight"]
