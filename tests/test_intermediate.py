"""Intermediate-layer terms through DistillationTrainer: values, gradients, training, resume, bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import args, bert, collate, distilbert, flat_params, token_dataset
from helpers import teacher as make_teacher
from safetensors.torch import load_file
from transformers import BertForSequenceClassification, TrainerCallback

from hf_distill import DistillationTrainer, losses

TERMS = [
    "loss=hidden_mse,layers=uniform,weight=1",
    "loss=cosine_loss,layers=last,weight=0.5",
    "loss=attention_score_mse,layers=uniform,weight=2",
    "loss=relation_kl,layers=last,relations=qk;vv,weight=1",
    "loss=relation_kl,layers=2:4,relations=qq;kk;vv,relation_heads=2,weight=1,name=rel2",
    "loss=pkd_loss,layers=1:2,weight=3",
]


def _eager_features(model, batch, qkv_path):
    """Hidden states from eager outputs; Q/K/V recomputed from each block's input (independent of hooks)."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    out = eager(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    hs = out.hidden_states
    blocks = eager.base_model.get_submodule(qkv_path[0])
    qkv = {
        kind: {i: blocks[i - 1].get_submodule(path)(hs[i - 1]) for i in range(1, len(blocks) + 1)}
        for kind, path in zip("qkv", qkv_path[1:])
    }
    return hs, qkv


BERT_PATHS = ("encoder.layer", "attention.self.query", "attention.self.key", "attention.self.value")
DISTIL_PATHS = ("transformer.layer", "attention.q_lin", "attention.k_lin", "attention.v_lin")


@pytest.mark.parametrize(
    ("make_student", "paths"), [(bert, BERT_PATHS), (distilbert, DISTIL_PATHS)], ids=["bert", "distilbert"]
)
def test_every_term_equals_hand_computation_from_eager(tmp_path, make_student, paths):
    student = make_student(layers=2, seed=3)
    teacher = make_teacher(layers=4)
    a = args(tmp_path, distill_terms=TERMS, kd_weight=0.5, task_weight=0.5)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=a, data_collator=collate)
    batch = collate([token_dataset(6, seed=4)[i] for i in range(6)])
    loss = trainer.compute_loss(student.train(), dict(batch))
    got = trainer.tracker.pop_means()
    mask = batch["attention_mask"]

    sh, sq = _eager_features(student, batch, paths)
    with torch.no_grad():
        th, tq = _eager_features(teacher, batch, BERT_PATHS)
    H, heads_t = student.config.num_attention_heads, teacher.config.num_attention_heads

    def scores(q, k, h):
        b, t, d = q.shape
        qh, kh = q.view(b, t, h, d // h).transpose(1, 2), k.view(b, t, h, d // h).transpose(1, 2)
        return qh @ kh.transpose(-1, -2) / (d // h) ** 0.5

    want = {
        "hidden": sum(losses.hidden_mse(sh[m], th[2 * m], mask) for m in range(3)),
        "cosine": losses.cosine_loss(sh[2], th[4], mask),
        "attention": sum(
            losses.attention_score_mse(scores(sq["q"][m], sq["k"][m], H), scores(tq["q"][2 * m], tq["k"][2 * m],
                                                                                  heads_t), mask)
            for m in (1, 2)
        ),
        "relation_qk": losses.relation_kl(sq["q"][2], sq["k"][2], tq["q"][4], tq["k"][4], H, mask),
        "relation_vv": losses.relation_kl(sq["v"][2], sq["v"][2], tq["v"][4], tq["v"][4], H, mask),
        "rel2_qq": losses.relation_kl(sq["q"][2], sq["q"][2], tq["q"][4], tq["q"][4], 2, mask),
        "rel2_kk": losses.relation_kl(sq["k"][2], sq["k"][2], tq["k"][4], tq["k"][4], 2, mask),
        "rel2_vv": losses.relation_kl(sq["v"][2], sq["v"][2], tq["v"][4], tq["v"][4], 2, mask),
        "pkd": losses.pkd_loss(sh[1][:, 0], th[2][:, 0]),
    }
    for name, value in want.items():
        assert got[name] == pytest.approx(value.item(), rel=1e-5, abs=1e-7), name
    weights = {"hidden": 1, "cosine": 0.5, "attention": 2, "pkd": 3, "kd": 0.5, "task": 0.5}
    assert loss.item() == pytest.approx(sum(weights.get(k, 1.0) * v for k, v in got.items()), rel=1e-5)


def test_gradients_reach_student_and_projections(tmp_path):
    student = bert(layers=2, hidden=16)
    a = args(tmp_path, distill_preset="tinybert_intermediate")
    trainer = DistillationTrainer(model=student, teacher_model=make_teacher(), args=a, data_collator=collate)
    batch = collate([token_dataset(4)[i] for i in range(4)])
    trainer.compute_loss(student.train(), dict(batch)).backward()
    proj = trainer.intermediate.projections
    assert proj is not None and proj.kind == "shared"
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in proj.parameters())
    layer = student.bert.encoder.layer[1]
    assert layer.attention.self.query.weight.grad.abs().sum() > 0
    assert student.bert.embeddings.word_embeddings.weight.grad.abs().sum() > 0
    assert not any(p.grad is not None for p in trainer.teacher.parameters())


def _component_trend(trainer, name):
    values = [r[f"loss_{name}"] for r in trainer.state.log_history if f"loss_{name}" in r]
    return sum(values[:5]) / 5, sum(values[-5:]) / 5


@pytest.mark.slow
def test_tinybert_narrow_student_trains_every_term_down(tmp_path):
    student = bert(layers=2, hidden=16, heads=4)  # half the teacher's width: a projection is learned
    a = args(tmp_path, distill_preset="tinybert_intermediate", max_steps=50, learning_rate=5e-3)
    trainer = DistillationTrainer(model=student, teacher_model=make_teacher(), args=a,
                                  train_dataset=token_dataset(64), data_collator=collate)
    trainer.train()
    for name in ("hidden", "attention"):
        first, last = _component_trend(trainer, name)
        assert last < 0.8 * first, (name, first, last)


def test_minilmv2_with_different_head_counts_trains_every_term_down(tmp_path):
    student = bert(layers=2, hidden=16, heads=2)  # teacher has 4 heads; relation heads re-split both
    a = args(tmp_path, distill_preset="minilmv2", distill_terms=[
        {"loss": "relation_kl", "layers": "last", "relations": ["qq", "kk", "vv"], "relation_heads": 4}],
        max_steps=50, learning_rate=5e-3)
    trainer = DistillationTrainer(model=student, teacher_model=make_teacher(), args=a,
                                  train_dataset=token_dataset(64), data_collator=collate)
    trainer.train()
    for name in ("relation_qq", "relation_kk", "relation_vv"):
        first, last = _component_trend(trainer, name)
        assert last < 0.8 * first, (name, first, last)


class _StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


@pytest.mark.slow
def test_resume_from_checkpoint_continues_exactly(tmp_path):
    def run(out, resume=None, stop=None):
        a = args(out, distill_preset="tinybert_intermediate", distill_terms=None, kd_weight=0.5, max_steps=8,
                 save_strategy="steps", save_steps=4, learning_rate=5e-3)
        trainer = DistillationTrainer(model=bert(layers=2, hidden=16), teacher_model=make_teacher(), args=a,
                                      train_dataset=token_dataset(64), data_collator=collate,
                                      callbacks=[_StopAt(stop)] if stop else None)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    run(tmp_path / "cut", stop=4)
    resumed = run(tmp_path / "cut", resume=str(tmp_path / "cut" / "out" / "checkpoint-4"))
    assert resumed.state.global_step == 8
    torch.testing.assert_close(flat_params(resumed.model), flat_params(full.model), atol=1e-6, rtol=0)
    torch.testing.assert_close(flat_params(resumed.intermediate.projections),
                               flat_params(full.intermediate.projections), atol=1e-6, rtol=0)


def test_saved_student_has_no_projection_or_hook_state(tmp_path):
    student = bert(layers=2, hidden=16)
    a = args(tmp_path, distill_preset="tinybert_intermediate", max_steps=2)
    trainer = DistillationTrainer(model=student, teacher_model=make_teacher(), args=a,
                                  train_dataset=token_dataset(16), data_collator=collate)
    trainer.train()
    trainer.save_model(str(tmp_path / "student"))
    keys = set(load_file(tmp_path / "student" / "model.safetensors"))
    assert keys == set(student.state_dict())
    assert not any("proj" in k or "fit_dense" in k for k in keys)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in student.modules()) == 0
    reloaded = BertForSequenceClassification.from_pretrained(tmp_path / "student")
    assert torch.equal(flat_params(reloaded), flat_params(student))


# ---------------------------------------------------------------- bad input, raised when the trainer is built


@pytest.mark.parametrize(
    ("student_kw", "terms", "extra", "message"),
    [
        ({"heads": 2}, ["loss=attention_score_mse"], {}, "student has 2 heads and the teacher 4"),
        ({"hidden": 16}, ["loss=hidden_mse"], {"projection": "none"}, r"sizes differ \(student 16, teacher 32\)"),
        ({"hidden": 24, "heads": 4}, ["loss=relation_kl,relation_heads=5"], {}, "relation_heads=5 does not divide"),
        ({"heads": 2}, ["loss=relation_kl"], {}, "Set relation_heads"),
        ({}, ["loss=hidden_mse,layers=3:4"], {}, "student layer 3 is out of range: the student has 2 layers"),
        ({}, ["loss=hidden_mse,layers=1:9"], {}, "teacher layer 9 is out of range"),
        ({"layers": 3}, ["loss=hidden_mse,layers=uniform"], {}, "multiple of the student's \\(3\\)"),
        ({}, ["loss=attention_score_mse,layers=0:0"], {}, "valid indices are 1..2"),
    ],
)
def test_bad_term_configurations_fail_before_training(tmp_path, student_kw, terms, extra, message):
    kw = {"layers": 2, **student_kw}
    with pytest.raises(ValueError, match=message):
        DistillationTrainer(model=bert(**kw), teacher_model=make_teacher(), args=args(tmp_path, distill_terms=terms,
                            **extra), data_collator=collate)


def test_unregistered_family_asked_for_attention_says_how_to_register(tmp_path, monkeypatch):
    from hf_distill.features import families

    monkeypatch.delitem(families.FAMILIES, "bert")
    with pytest.raises(ValueError, match="register_family"):
        DistillationTrainer(model=bert(2), teacher_model=make_teacher(),
                            args=args(tmp_path, distill_terms=["loss=attention_score_mse"]), data_collator=collate)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("loss=hiden_mse", "unknown loss 'hiden_mse'. Known: hidden_mse"),
        ("loss=hidden_mse,layer=last", "unknown key\\(s\\) \\['layer'\\]"),
        ("loss=hidden_mse,layers=1-2", "layers='1-2' is not understood"),
        ("loss=relation_kl,relations=qv", "unknown relation\\(s\\) \\['qv'\\]"),
        ("loss=hidden_mse,weight=-1", "must be >= 0"),
        ("weight=1", "has no `loss`"),
    ],
)
def test_bad_term_specs_name_the_problem(tmp_path, spec, message):
    with pytest.raises(ValueError, match=message):
        args(tmp_path, distill_terms=[spec])


def test_presets_fill_terms_and_keep_explicit_values(tmp_path):
    a = args(tmp_path, distill_preset="tinybert_prediction", temperature=4.0)
    assert (a.kd_loss, a.temperature, a.task_weight, a.distill_terms) == ("soft_ce", 4.0, 0.0, None)
    b = args(tmp_path, distill_preset="minilm")
    assert b.distill_terms == [{"loss": "relation_kl", "layers": "last", "weight": 1.0, "name": "relation",
                                "relations": ["qk", "vv"], "relation_heads": None}]
    with pytest.raises(ValueError, match="distill_preset='tinybert' is unknown"):
        args(tmp_path, distill_preset="tinybert")


# ---------------------------------------------------------------- incremental_mse (two-stage feature distillation)


@pytest.mark.slow
@pytest.mark.parametrize("hidden", [32, 16], ids=["same_width", "projected"])
@pytest.mark.parametrize(
    ("layers", "pairs"),
    [("uniform", [(0, 0), (1, 2), (2, 4)]), ("2:4;1:1;0:3", [(1, 1), (0, 3), (2, 4)])],
    ids=["uniform", "explicit_unsorted"],
)
def test_incremental_mse_equals_hand_computation_from_eager(tmp_path, hidden, layers, pairs):
    """Targets: the top pair's teacher feature, every lower pair's teacher feature minus the next mapped one
    (pairs sorted by teacher layer), student features through the projection; padded rows."""
    student = bert(layers=2, hidden=hidden, seed=3)
    teacher = make_teacher(layers=4)
    terms = [f"loss=hidden_mse,layers={layers}", f"loss=incremental_mse,layers={layers},weight=0.5"]
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args(tmp_path, distill_terms=terms,
                                  kd_weight=0.0, task_weight=0.0), data_collator=collate)
    batch = collate([token_dataset(6, seed=4)[i] for i in range(6)])
    mask = batch["attention_mask"]
    assert (mask == 0).any()  # padding is really there
    loss = trainer.compute_loss(student.train(), dict(batch))
    got = trainer.tracker.pop_means()
    assert set(got) == {"hidden", "incremental"}

    sh, _ = _eager_features(student, batch, BERT_PATHS)
    with torch.no_grad():
        th, _ = _eager_features(teacher, batch, BERT_PATHS)
    proj = trainer.intermediate.projections
    assert (proj is not None) == (hidden != 32)

    def p(x, layer):
        return x if proj is None else proj(x, layer)

    want_hidden = sum(losses.hidden_mse(p(sh[a], a), th[b], mask) for a, b in pairs)
    targets = [th[b] - th[c] for (_, b), (_, c) in zip(pairs, pairs[1:])] + [th[pairs[-1][1]]]
    want_incr = sum(losses.hidden_mse(p(sh[a], a), tgt, mask) for (a, _), tgt in zip(pairs, targets))
    assert got["hidden"] == pytest.approx(want_hidden.item(), rel=1e-5)
    assert got["incremental"] == pytest.approx(want_incr.item(), rel=1e-5)
    assert got["incremental"] != pytest.approx(got["hidden"], rel=1e-3)  # the targets really differ
    assert loss.item() == pytest.approx(want_hidden.item() + 0.5 * want_incr.item(), rel=1e-5)
    assert trainer.intermediate.count_kinds()["incremental"] == "tokens"


def test_incremental_mse_under_gradient_accumulation_gives_the_big_batch_update(tmp_path):
    """A sum of token means: normalised over the optimizer step's tokens like hidden_mse (rows of 3-12 tokens)."""
    runs = []
    for name, extra in (("big", dict(per_device_train_batch_size=8)),
                        ("acc", dict(per_device_train_batch_size=4, gradient_accumulation_steps=2))):
        a = args(tmp_path / name, distill_terms=["loss=incremental_mse,layers=uniform"], kd_weight=0.0,
                 task_weight=0.0, max_steps=2, optim="sgd", learning_rate=0.5, **extra)
        trainer = DistillationTrainer(model=bert(2, hidden=16, seed=0), teacher_model=make_teacher(), args=a,
                                      train_dataset=token_dataset(32), data_collator=collate)
        trainer.train()
        runs.append(trainer)
    big, acc = runs
    torch.testing.assert_close(flat_params(acc.model), flat_params(big.model), atol=1e-6, rtol=0)
    logs = [[r["loss_incremental"] for r in t.state.log_history if "loss_incremental" in r] for t in runs]
    assert len(logs[0]) == 2 and logs[1] == pytest.approx(logs[0], rel=1e-5)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("loss=incremental_mse,layers=last", "cannot use layers=last.*at least two layer pairs"),
        ("loss=incremental_mse,layers=2:4", r"holds 1 pair\(s\); incremental_mse needs at least two"),
        ("loss=incremental_mse,layers=1:2;2:2", r"teacher layer\(s\) \[2\] appear in more than one pair"),
        ("loss=incremental_mse,weight=-0.5", "weight of the incremental_mse term must be >= 0"),
    ],
)
def test_bad_incremental_specs_fail_before_training(tmp_path, spec, message):
    with pytest.raises(ValueError, match=message):
        args(tmp_path, distill_terms=[spec])


def test_incremental_mse_names_the_term_in_trainer_errors(tmp_path):
    """Errors found when binding to the models (here: out of range) name the term, as for every term."""
    with pytest.raises(ValueError, match=r"distill_terms\[incremental\] \(incremental_mse\): teacher layer 9"):
        DistillationTrainer(model=bert(2), teacher_model=make_teacher(),
                            args=args(tmp_path, distill_terms=["loss=incremental_mse,layers=1:2;2:9"]),
                            data_collator=collate)


@pytest.mark.slow
def test_incremental_phase_after_a_stage_switch_resumes_exactly(tmp_path):
    """The recipe's two general phases (hidden, then hidden + 0.5 x incremental_mse with a fresh optimizer state)
    as one run: cut inside the second phase and resumed, it ends where the uncut run ends."""
    from hf_distill.callbacks import Stage, StageSwitchCallback

    terms = ["loss=hidden_mse,layers=uniform", "loss=incremental_mse,layers=uniform,weight=0"]

    def run(out, resume=None, stop=None):
        switch = StageSwitchCallback([
            Stage(until_step=3, term_weights={"hidden": 1.0, "incremental": 0.0}, name="general"),
            Stage(term_weights={"hidden": 1.0, "incremental": 0.5}, learning_rate=2e-3, lr_scheduler_type="linear",
                  warmup_ratio=0.2, reset_optimizer=True, name="general_incremental"),
        ])
        a = args(out, distill_terms=terms, kd_weight=0.0, task_weight=0.0, max_steps=8, save_strategy="steps",
                 save_steps=5, learning_rate=5e-3)
        trainer = DistillationTrainer(model=bert(layers=2, hidden=16), teacher_model=make_teacher(), args=a,
                                      train_dataset=token_dataset(64), data_collator=collate,
                                      callbacks=[switch] + ([_StopAt(stop)] if stop else []))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    logged = [r for r in full.state.log_history if "loss_hidden" in r]
    assert ["loss_incremental" in r for r in logged] == [False] * 3 + [True] * 5
    run(tmp_path / "cut", stop=5)
    resumed = run(tmp_path / "cut", resume=str(tmp_path / "cut" / "out" / "checkpoint-5"))
    assert resumed.state.global_step == 8
    torch.testing.assert_close(flat_params(resumed.model), flat_params(full.model), atol=1e-6, rtol=0)
    torch.testing.assert_close(flat_params(resumed.intermediate.projections),
                               flat_params(full.intermediate.projections), atol=1e-6, rtol=0)


def test_incremental_mse_from_cached_teacher_hidden_states_trains_exactly_as_online(tmp_path):
    """The targets are built from the teacher's hidden states, so hf_distill.data.cache can supply them."""
    from hf_distill.data.cache import cache_teacher_outputs

    teacher, data = make_teacher(), token_dataset(24)
    cached = cache_teacher_outputs(teacher, data, cache_dir=tmp_path / "cache", progress=False, batch_size=8,
                                   hidden_layers=[0, 2, 4])
    common = dict(distill_terms=["loss=incremental_mse,layers=uniform"], kd_weight=0.0, task_weight=0.0,
                  optim="sgd", learning_rate=0.5, max_steps=3)
    runs = []
    for sub, dataset, teacher_model in (("online", data, teacher), ("offline", cached, None)):
        t = DistillationTrainer(model=bert(2, hidden=16), teacher_model=teacher_model,
                                args=args(tmp_path / sub, **common), train_dataset=dataset, data_collator=collate)
        t.train()
        runs.append(t)
    online, offline = runs
    assert offline.teacher is None
    torch.testing.assert_close(flat_params(offline.model), flat_params(online.model), atol=1e-5, rtol=0)
    values = [[r["loss_incremental"] for r in t.state.log_history if "loss_incremental" in r] for t in runs]
    assert len(values[0]) == 3 and values[1] == pytest.approx(values[0], rel=1e-5)
