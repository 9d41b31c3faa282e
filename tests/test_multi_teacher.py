"""Several teachers: a mixture of their distributions or a weighted sum of losses, online or cached."""

from __future__ import annotations

import pytest
import torch
from helpers import args, bert, collate, flat_params, token_dataset
from helpers import teacher as make_teacher

from hf_distill import DistillationTrainer, losses


def _teachers():
    return [make_teacher(seed=1), make_teacher(layers=2, seed=7)]


def _batch(n=6):
    return collate([token_dataset(n, seed=3)[i] for i in range(n)])


def _teacher_logits(teachers, batch):
    with torch.no_grad():
        return [t(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits for t in teachers]


@pytest.mark.parametrize("kind", ["kl", "soft_ce"])
def test_probs_mode_distils_the_weighted_mixture(tmp_path, kind):
    teachers, student = _teachers(), bert(2)
    a = args(tmp_path, kd_loss=kind, temperature=3.0, kd_weight=1.0, task_weight=0.0, teacher_weights=[1.0, 3.0])
    trainer = DistillationTrainer(model=student, teacher_model=teachers, args=a, data_collator=collate)
    batch = _batch()
    loss = trainer.compute_loss(student.train(), dict(batch))
    t0, t1 = _teacher_logits(teachers, batch)
    s = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    p = 0.25 * (t0 / 3).softmax(-1) + 0.75 * (t1 / 3).softmax(-1)
    log_q = (s / 3).log_softmax(-1)
    if kind == "kl":
        expected = 9 * (p * (p.log() - log_q)).sum(-1).mean()
    else:
        expected = -(p * log_q).sum(-1).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_losses_mode_sums_weighted_losses(tmp_path):
    teachers, student = _teachers(), bert(2)
    a = args(tmp_path, kd_loss="mse", kd_weight=1.0, task_weight=0.0, multi_teacher="losses", teacher_weights=[2, 2])
    trainer = DistillationTrainer(model=student, teacher_model=teachers, args=a, data_collator=collate)
    batch = _batch()
    loss = trainer.compute_loss(student.train(), dict(batch))
    t0, t1 = _teacher_logits(teachers, batch)
    s = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = 0.5 * losses.logit_mse(s, t0) + 0.5 * losses.logit_mse(s, t1)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def _assert_cached_run_matches_online(tmp_path, teachers, cached_data):
    """Training on the cached columns runs no teacher forward and ends where the online run ends (1e-5)."""
    calls = []
    for t in teachers:
        t.register_forward_hook(lambda *a: calls.append(1))
    common = dict(max_steps=3, optim="sgd", learning_rate=0.5, teacher_weights=[0.3, 0.7])
    cached = DistillationTrainer(model=bert(2), teacher_model=teachers, args=args(tmp_path / "c", **common),
                                 train_dataset=cached_data, data_collator=collate)
    cached.train()
    assert calls == []
    online = DistillationTrainer(model=bert(2), teacher_model=teachers, args=args(tmp_path / "o", **common),
                                 train_dataset=token_dataset(24), data_collator=collate)
    online.train()
    assert calls
    torch.testing.assert_close(flat_params(cached.model), flat_params(online.model), atol=1e-5, rtol=0)


def test_each_teacher_has_its_own_cached_column(tmp_path):
    teachers = _teachers()
    data = token_dataset(24)
    with torch.no_grad():
        for i, t in enumerate(teachers):
            column = "teacher_logits" if i == 0 else f"teacher_logits_{i}"
            rows = [t(input_ids=torch.tensor([r["input_ids"]])).logits[0].tolist() for r in token_dataset(24)]
            data = data.add_column(column, rows)
    _assert_cached_run_matches_online(tmp_path, teachers, data)


@pytest.mark.slow
def test_cache_teacher_outputs_writes_one_column_per_teacher(tmp_path):
    from hf_distill.data.cache import cache_teacher_outputs

    teachers, data = _teachers(), token_dataset(24)
    for i, t in enumerate(teachers):
        data = cache_teacher_outputs(t, data, cache_dir=tmp_path / "cache", teacher_index=i, progress=False)
    assert {"teacher_logits", "teacher_logits_1"} <= set(data.column_names)
    with torch.no_grad():
        expected = teachers[1](input_ids=torch.tensor([data[5]["input_ids"]])).logits[0]
    torch.testing.assert_close(data[5]["teacher_logits_1"], expected, atol=1e-5, rtol=0)
    _assert_cached_run_matches_online(tmp_path, teachers, data)
    with pytest.raises(ValueError, match="teacher_index=1"):
        cache_teacher_outputs(teachers[1], token_dataset(4), cache_dir=tmp_path / "cache", teacher_index=1, top_k=1)


def test_multi_teacher_training_lowers_the_kd_loss(tmp_path):
    a = args(tmp_path, max_steps=30, learning_rate=5e-3, kd_weight=1.0, task_weight=0.0, logging_steps=1)
    trainer = DistillationTrainer(model=bert(2), teacher_model=_teachers(), args=a, train_dataset=token_dataset(64),
                                  data_collator=collate)
    trainer.train()
    kd = [r["loss_kd"] for r in trainer.state.log_history if "loss_kd" in r]
    assert sum(kd[-5:]) / 5 < 0.7 * sum(kd[:5]) / 5


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"teacher_weights": [1.0]}, "teacher_weights has 1 values for 2 teachers"),
        ({"teacher_weights": [0.0, 0.0]}, "must sum to a positive number"),
        ({"kd_loss": "mse"}, "multi_teacher='probs' averages probability distributions"),
    ],
)
def test_bad_multi_teacher_settings(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        DistillationTrainer(model=bert(2), teacher_model=_teachers(), args=args(tmp_path, **kw), data_collator=collate)


def test_bad_multi_teacher_arguments(tmp_path):
    with pytest.raises(ValueError, match="multi_teacher='mean' is unknown"):
        args(tmp_path, multi_teacher="mean")
    with pytest.raises(ValueError, match="teacher_weights must be >= 0"):
        args(tmp_path, teacher_weights=[1.0, -1.0])
