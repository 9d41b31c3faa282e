"""Trainer options a user keeps when swapping the class: label_names, label smoothing, compute_loss_func, optimizers,
gradient clipping and weight decay (with the projections a distillation run adds)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import args, bert, collate, flat_params, token_dataset
from helpers import teacher as make_teacher
from torch import nn

from hf_distill import DistillationTrainer


def _first_log(trainer):
    return next(r for r in trainer.state.log_history if "loss" in r)


def _trainer(tmp_path, student=None, teacher=None, data=None, collator=collate, **kw):
    kw.setdefault("max_steps", 1)
    kw.setdefault("per_device_train_batch_size", 8)
    optimizers = kw.pop("optimizers", (None, None))
    compute_loss_func = kw.pop("compute_loss_func", None)
    return DistillationTrainer(
        model=student if student is not None else bert(2),
        teacher_model=teacher if teacher is not None else make_teacher(),
        args=args(tmp_path, **kw),
        train_dataset=data if data is not None else token_dataset(8),
        data_collator=collator,
        optimizers=optimizers,
        compute_loss_func=compute_loss_func,
    )


def _batch(data, n=8):
    return collate([data[i] for i in range(n)])


# ---------------------------------------------------------------- task loss options


class TargetsClassifier(nn.Module):
    """A student whose labels are called `targets` (label_names=["targets"])."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.EmbeddingBag(200, 16)
        self.out = nn.Linear(16, 2)

    def forward(self, input_ids, attention_mask=None, targets=None):
        logits = self.out(self.emb(input_ids, per_sample_weights=None if attention_mask is None else None))
        loss = F.cross_entropy(logits, targets) if targets is not None else None
        return {"loss": loss, "logits": logits} if loss is not None else {"logits": logits}


def _targets_collate(features):
    batch = collate([{"input_ids": f["input_ids"]} for f in features])
    batch["targets"] = torch.tensor([f["targets"] for f in features])
    return batch


def test_label_names_are_honoured(tmp_path):
    data = token_dataset(8).rename_column("label", "targets")
    student = TargetsClassifier()
    s0 = copy.deepcopy(student)
    trainer = _trainer(tmp_path, student=student, data=data, collator=_targets_collate, label_names=["targets"])
    log = _first_log(trainer.train() and trainer)
    batch = _targets_collate([data[i] for i in range(8)])
    with torch.no_grad():
        expected = s0(batch["input_ids"], targets=batch["targets"])["loss"]
    assert "loss_task" in log, "the task term was silently dropped"
    assert log["loss_task"] == pytest.approx(float(expected), rel=1e-5)


def test_label_smoothing_changes_the_task_loss_to_the_smoothed_value(tmp_path):
    data = token_dataset(8).map(lambda r: {"label": 0})  # one class: the smoothing terms cannot cancel out
    student = make_teacher(layers=2, seed=5)  # confident logits, so smoothing makes a difference
    s0 = copy.deepcopy(student)
    trainer = _trainer(tmp_path, student=student, data=data, label_smoothing_factor=0.1)
    trainer.train()
    batch = _batch(data)
    with torch.no_grad():
        logits = s0(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    smoothed = F.cross_entropy(logits, batch["labels"], label_smoothing=0.1)
    # the Trainer's LabelSmoother: (1 - eps) * nll + eps * mean over classes of -log p
    log_p = logits.log_softmax(-1)
    trainer_def = 0.9 * F.nll_loss(log_p, batch["labels"]) + 0.1 * (-log_p.mean(-1)).mean()
    log = _first_log(trainer)
    assert log["loss_task"] == pytest.approx(float(trainer_def), rel=1e-5)
    assert float(trainer_def) == pytest.approx(float(smoothed), rel=1e-5)
    assert log["loss_task"] != pytest.approx(float(F.cross_entropy(logits, batch["labels"])), rel=1e-2)


def test_compute_loss_func_is_the_task_loss(tmp_path):
    calls = []

    def triple_ce(outputs, labels, num_items_in_batch=None):
        calls.append(num_items_in_batch)
        return 3.0 * F.cross_entropy(outputs["logits"], labels)

    data = token_dataset(8)
    student = bert(2)
    s0 = copy.deepcopy(student)
    trainer = _trainer(tmp_path, student=student, data=data, compute_loss_func=triple_ce)
    trainer.train()
    batch = _batch(data)
    with torch.no_grad():
        logits = s0(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert calls and int(calls[0]) == 8
    assert _first_log(trainer)["loss_task"] == pytest.approx(3.0 * float(F.cross_entropy(logits, batch["labels"])),
                                                             rel=1e-5)


@pytest.mark.slow
def test_compute_loss_func_normalised_by_num_items_gives_the_big_batch_update(tmp_path):
    def summed_ce(outputs, labels, num_items_in_batch=None):
        return F.cross_entropy(outputs["logits"], labels, reduction="sum") / num_items_in_batch

    common = dict(max_steps=2, optim="sgd", learning_rate=0.5, compute_loss_func=summed_ce)
    big = _trainer(tmp_path / "a", data=token_dataset(32), per_device_train_batch_size=8, **common)
    big.train()
    acc = _trainer(tmp_path / "b", data=token_dataset(32), per_device_train_batch_size=4,
                   gradient_accumulation_steps=2, **common)
    acc.train()
    torch.testing.assert_close(flat_params(big.model), flat_params(acc.model), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- projections: optimizer, clipping, decay

TERMS = dict(distill_terms=["loss=hidden_mse,layers=uniform"], kd_weight=0.5, task_weight=0.5)


def _narrow_student():
    return bert(2, hidden=16)  # the teacher is 32 wide: a projection is trained


def test_projections_are_clipped_with_the_student(tmp_path):
    student = _narrow_student()
    trainer = _trainer(tmp_path, student=student, optim="sgd", learning_rate=1.0, max_grad_norm=1e-3, **TERMS)
    before = torch.cat([flat_params(student), flat_params(trainer.intermediate.projections)])
    trainer.train()
    after = torch.cat([flat_params(trainer.model), flat_params(trainer.intermediate.projections)])
    # SGD with lr 1 moves the parameters by exactly the clipped gradient: its norm is max_grad_norm.
    assert float((after - before).norm()) == pytest.approx(1e-3, rel=1e-3)


def test_logged_grad_norm_counts_the_projections(tmp_path):
    student = _narrow_student()
    trainer = _trainer(tmp_path, student=student, optim="sgd", learning_rate=1.0, max_grad_norm=1e6, **TERMS)
    before = torch.cat([flat_params(student), flat_params(trainer.intermediate.projections)])
    trainer.train()
    after = torch.cat([flat_params(trainer.model), flat_params(trainer.intermediate.projections)])
    assert _first_log(trainer)["grad_norm"] == pytest.approx(float((after - before).norm()), rel=1e-4)


def test_projection_biases_get_no_weight_decay(tmp_path):
    trainer = _trainer(tmp_path, student=_narrow_student(), weight_decay=0.1, projection_lr=1e-2, **TERMS)
    optimizer = trainer.create_optimizer()
    proj = trainer.intermediate.projections
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for name, p in proj.named_parameters():
        group = group_of[id(p)]
        assert group["lr"] == 1e-2
        assert group["weight_decay"] == (0.0 if name.endswith("bias") else 0.1), name


def _as_if_under(trainer, kind, ds_config=None):
    """The trainer's engine checks, run against an accelerator state of another engine (no launch needed)."""
    from accelerate.utils import DistributedType

    plugin = SimpleNamespace(deepspeed_config=ds_config or {})
    trainer.accelerator = SimpleNamespace(distributed_type=getattr(DistributedType, kind),
                                          state=SimpleNamespace(deepspeed_plugin=plugin))
    return trainer


def test_projections_under_fsdp_are_refused(tmp_path):
    trainer = _as_if_under(_trainer(tmp_path, student=_narrow_student(), **TERMS), "FSDP")
    with pytest.raises(ValueError, match=r"Projections \(student width 16 -> teacher width 32\).*FSDP"):
        trainer._check_projection_optimizer()


def test_projection_lr_with_a_deepspeed_optimizer_section_is_refused(tmp_path):
    """DeepSpeed builds the optimizer of its config over the student and the projections alike."""
    trainer = _trainer(tmp_path, student=_narrow_student(), projection_lr=1e-2, **TERMS)
    _as_if_under(trainer, "DEEPSPEED", {"optimizer": {"type": "AdamW"}})
    with pytest.raises(ValueError, match=r"projection_lr=0.01 cannot be honoured.*'optimizer' section"):
        trainer._check_projection_optimizer()
    trainer.args.projection_lr = None  # the config's learning rate for both: fine
    trainer._check_projection_optimizer()
    trainer.args.projection_lr = 1e-2  # no optimizer section: the Trainer's optimizer gets the projections' group
    _as_if_under(trainer, "DEEPSPEED", {"zero_optimization": {"stage": 3}})
    trainer._check_projection_optimizer()
    assert trainer._projections_in_engine()


def test_under_deepspeed_the_projections_get_their_own_groups_not_the_students(tmp_path):
    """While attached to the student (DeepSpeed), the Trainer's groups would take the projections at the
    student's learning rate: create_optimizer moves them into the projection groups."""
    trainer = _trainer(tmp_path, student=_narrow_student(), projection_lr=1e-2, weight_decay=0.1, **TERMS)
    _as_if_under(trainer, "DEEPSPEED", {"zero_optimization": {"stage": 3}})
    proj = trainer.intermediate.projections
    with trainer._projections_attached():
        assert trainer.model.hf_distill_projections is proj
        optimizer = trainer.create_optimizer()
    assert not hasattr(trainer.model, "hf_distill_projections")  # the student is bare again
    ids = {id(p) for p in proj.parameters()}
    for group in optimizer.param_groups:
        mine = [id(p) in ids for p in group["params"]]
        assert all(mine) or not any(mine)  # never mixed with the student's parameters
        if any(mine):
            assert group["lr"] == 1e-2
    placed = [p for g in optimizer.param_groups for p in g["params"] if id(p) in ids]
    assert len(placed) == len(ids)  # each projection parameter exactly once


def test_an_engine_built_before_train_without_the_projections_is_refused(tmp_path):
    """transformers reuses an engine that evaluate() built: it would train without the projections."""
    trainer = _trainer(tmp_path, student=_narrow_student(), **TERMS)
    _as_if_under(trainer, "DEEPSPEED", {"zero_optimization": {"stage": 3}})
    trainer.deepspeed = SimpleNamespace(param_names={p: "x" for p in trainer.model.parameters()})
    with pytest.raises(RuntimeError, match="engine was built for this trainer before train"):
        trainer.train()
    assert not hasattr(trainer.model, "hf_distill_projections")
    # an engine of an earlier train() holds them: allowed (it is the one the Trainer continues with)
    proj = list(trainer.intermediate.projections.parameters())
    trainer.deepspeed.param_names.update({p: "hf_distill_projections.x" for p in proj})
    with trainer._projections_attached():
        assert trainer.model.hf_distill_projections is trainer.intermediate.projections


def test_projections_detach_from_the_student_they_were_attached_to(tmp_path):
    trainer = _trainer(tmp_path, student=_narrow_student(), **TERMS)
    _as_if_under(trainer, "DEEPSPEED", {"zero_optimization": {"stage": 3}})
    student = trainer.model
    with pytest.raises(KeyError):
        with trainer._projections_attached():
            trainer.model = bert(2, hidden=16)  # e.g. a model_init run replacing the model
            raise KeyError("boom")
    assert not hasattr(student, "hf_distill_projections")


def test_projection_file_under_deepspeed_only_when_the_engine_checkpoint_is_not_written(tmp_path):
    """With save_only_model the Trainer writes no engine checkpoint: the projections get their own file."""
    trainer = _trainer(tmp_path, student=_narrow_student(), **TERMS)
    assert set(trainer._projection_file_state()) == {"maps.shared.weight", "maps.shared.bias"}  # DDP / 1 process
    _as_if_under(trainer, "DEEPSPEED", {"zero_optimization": {"stage": 3}})
    with trainer._projections_attached():
        assert trainer._projection_file_state() is None  # inside the engine's global_step*/ files
        trainer.args.save_only_model = True
        state = trainer._projection_file_state()
    assert torch.equal(state["maps.shared.weight"], trainer.intermediate.projections.maps["shared"].weight)


def test_a_deepspeed_checkpoint_resumed_without_deepspeed_says_so(tmp_path):
    trainer = _trainer(tmp_path, student=_narrow_student(), save_strategy="steps", save_steps=1, **TERMS)
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    (checkpoint / "distill_projections.pt").unlink()
    (checkpoint / "global_step1").mkdir()  # what a DeepSpeed run writes instead
    again = _trainer(tmp_path, student=_narrow_student(), max_steps=2, **TERMS)
    with pytest.raises(FileNotFoundError, match="written under DeepSpeed.*same DeepSpeed config"):
        again.train(resume_from_checkpoint=str(checkpoint))


def test_user_optimizer_and_scheduler_without_the_projections_are_refused(tmp_path):
    student = _narrow_student()
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    with pytest.raises(ValueError, match=r"optimizers=\(optimizer, None\)"):
        _trainer(tmp_path, student=student, optimizers=(opt, sched), **TERMS)


def test_user_optimizer_alone_gets_the_projections_and_a_scheduler_over_every_group(tmp_path):
    student = _narrow_student()
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    trainer = _trainer(tmp_path, student=student, optimizers=(opt, None), max_steps=2, **TERMS)
    proj_before = flat_params(trainer.intermediate.projections)
    trainer.train()
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(p) in in_opt for p in trainer.intermediate.projections.parameters())
    assert len(trainer.lr_scheduler.base_lrs) == len(opt.param_groups)
    assert not torch.equal(proj_before, flat_params(trainer.intermediate.projections))


def test_label_names_missing_from_the_batch_are_refused_while_the_task_term_is_on(tmp_path):
    trainer = _trainer(tmp_path, label_names=["label"])  # the collator emits `labels`
    with pytest.raises(ValueError, match=r"label_names=\['label'\]"):
        trainer.train()


def test_hidden_states_asked_for_the_loss_never_reach_predictions(tmp_path):
    """An unregistered family captures hidden states through output_hidden_states: predict() must not see them."""
    data = token_dataset(8)
    trainer = _trainer(tmp_path, student=_albert(), data=data, eval_with_teacher=True,
                       distill_terms=["loss=hidden_mse,layers=0:0;2:4"])
    assert trainer.intermediate.student_taps.use_hidden_states_output
    predictions = trainer.predict(data).predictions
    assert isinstance(predictions, np.ndarray) and predictions.shape == (8, 2)


def test_hidden_states_the_students_config_asks_for_stay_in_predictions(tmp_path):
    """A student whose config returns hidden states predicts them with the teacher as without (eval_with_teacher must
    not take away what the taps happen to ask for too)."""
    data = token_dataset(8)
    trainer = _trainer(tmp_path, student=_albert(output_hidden_states=True), data=data, eval_with_teacher=True,
                       distill_terms=["loss=hidden_mse,layers=0:0;2:4"])
    predictions = trainer.predict(data).predictions
    assert isinstance(predictions, tuple) and predictions[0].shape == (8, 2)
    assert len(predictions[1]) == 3 and predictions[1][2].shape[-1] == 32  # embeddings + 2 layers, width 32


def _albert(**kw):
    from transformers import AlbertConfig, AlbertForSequenceClassification

    torch.manual_seed(0)
    return AlbertForSequenceClassification(AlbertConfig(
        vocab_size=120, embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        **kw))


# ---------------------------------------------------------------- auto_find_batch_size, use_liger_kernel


class _OutOfMemoryAtSecondMicroBatch(DistillationTrainer):
    """The first try (batch 8) runs out of memory in its second micro-batch, after the first one's backward."""

    def compute_loss(self, model, inputs, *rest, **kw):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2 and len(inputs["input_ids"]) == 8:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().compute_loss(model, inputs, *rest, **kw)


def test_auto_find_batch_size_retry_starts_clean_with_projections(tmp_path):
    """The retry (batch 7) equals a run at batch 7: no projection gradient or logged component of the failed try."""
    common = dict(max_steps=1, gradient_accumulation_steps=2, optim="sgd", learning_rate=1.0, **TERMS)
    runs = []
    for cls, size, auto in ((_OutOfMemoryAtSecondMicroBatch, 8, True), (DistillationTrainer, 7, False)):
        trainer = cls(model=_narrow_student(), teacher_model=make_teacher(), data_collator=collate,
                      train_dataset=token_dataset(16), args=args(tmp_path / str(size), auto_find_batch_size=auto,
                                                                 per_device_train_batch_size=size, **common))
        trainer.train()
        runs.append((trainer, _first_log(trainer)))
    (retried, retried_log), (direct, direct_log) = runs
    assert retried._train_batch_size == 7
    torch.testing.assert_close(flat_params(retried.intermediate.projections),
                               flat_params(direct.intermediate.projections), rtol=0, atol=1e-7)
    torch.testing.assert_close(flat_params(retried.model), flat_params(direct.model), rtol=0, atol=1e-7)
    assert retried_log == pytest.approx(direct_log, rel=1e-6)


def test_liger_kernel_fused_cross_entropy_is_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match=r"use_liger_kernel=True.*liger_kernel_config=\{'fused_linear_cross_entropy'"):
        _trainer(tmp_path, use_liger_kernel=True)
    trainer = _trainer(tmp_path, use_liger_kernel=True, liger_kernel_config={"fused_linear_cross_entropy": False})
    assert trainer.args.liger_kernel_config == {"fused_linear_cross_entropy": False}


@pytest.mark.parametrize("optim", ["galore_adamw_layerwise", "lomo"])
def test_optimizers_stepping_in_the_backward_are_refused_with_projections(tmp_path, optim):
    """Their Trainer optimizer is a no-op (the student steps in its own parameter hooks): the projections never move."""
    with pytest.raises(ValueError, match=rf"optim='{optim}'.*projections \(student width 16 -> teacher width 32\)"):
        _trainer(tmp_path, student=_narrow_student(), optim=optim, **TERMS)


# ---------------------------------------------------------------- neftune_noise_alpha


def test_neftune_noises_the_student_embeddings_only_also_on_a_shared_base(tmp_path):
    """NEFTune's noise is the student's (its embedding-output terms read the noisy embeddings, as its first block
    does); the teacher reads clean ones, also when it is the student's own PEFT base with adapters off."""
    peft = pytest.importorskip("peft")
    student = peft.get_peft_model(bert(2), peft.LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["query"]))
    embeddings = student.get_base_model().bert.embeddings
    calls = []  # [grad enabled, input ids, the embeddings' sum before their LayerNorm] at every call
    embeddings.register_forward_pre_hook(
        lambda m, a, kw: calls.append([torch.is_grad_enabled(), kw["input_ids"].clone(), None]), with_kwargs=True)
    embeddings.LayerNorm.register_forward_pre_hook(lambda m, a: calls[-1].__setitem__(2, a[0].detach().clone()))
    trainer = _trainer(tmp_path, student=student, teacher=student, neftune_noise_alpha=5.0, max_steps=2,
                       distill_terms=["loss=hidden_mse,layers=0:0"])
    trainer.train()
    assert trainer.shared_base and sorted(c[0] for c in calls) == [False, False, True, True]
    embeddings.eval()
    for student_call, ids, summed in list(calls):
        with torch.no_grad():
            embeddings(input_ids=ids)
        noise = (summed - calls[-1][2]).abs().max()
        assert (noise > 0) == student_call  # noisy for the student only
        assert noise <= 5.0 / (ids.shape[1] * 32) ** 0.5  # NEFTune's bound: alpha / sqrt(length * width)
