"""Routing per row (hf_distill.routing, issue #42 item 6): each row distilled from the named teacher its `teacher_id`
column names (local models and a served one, mixed), the KD loss a mean over all counted tokens, a teacher asked only
for its rows, one teacher bitwise the single-teacher path, per-teacher losses, the card's line, the refusals."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    VOCAB,
    args,
    bert,
    collate,
    flat_params,
    labelled_collate,
    llama,
    sft_rows,
    token_dataset,
    word_tokenizer,
)
from helpers import (
    teacher as bert_teacher,
)
from served_fakes import fake_vllm

from hf_distill import DistillationTrainer
from hf_distill.distiller import Distiller
from hf_distill.losses.normalise import COUNT_KINDS
from hf_distill.publish.card import model_card
from hf_distill.publish.report import DistillationReport
from hf_distill.serving.server import ServerThread

K = 8
RUN = dict(kd_loss="kl", temperature=1.0, kd_weight=1.0, task_weight=0.0)
SERVED = dict(teacher_top_k=K, teacher_retries=1, teacher_backoff=0.0, teacher_timeout=5.0)


def _tok():
    return word_tokenizer([f"w{i}" for i in range(VOCAB - 2)])


@pytest.fixture
def served():
    log, running = [], []
    running.append(ServerThread(fake_vllm(llama(2), _tok(), log=log)))
    yield running[0].url, log
    running[0].stop()


def _rows(ids: list[str]):
    return sft_rows(len(ids)).add_column("teacher_id", ids)


def test_each_row_is_distilled_from_its_own_teacher(tmp_path, served):
    """A local and a served teacher in one batch: the loss is the mean over all counted tokens of each row's KD
    against its own teacher (the two single-teacher losses weighted by their token counts); the server is asked for
    its rows only; each teacher's KD is tracked."""
    url, log = served
    student, local = llama(0).train(), llama(1)
    ids = ["local", "big", "local", "big"]
    data = _rows(ids)
    distiller = Distiller(student, args(tmp_path, **RUN, **SERVED), {"local": local, "big": url},
                          processing_class=_tok(), train_dataset=data)
    batch = labelled_collate([data[i] for i in range(4)])
    log.clear()
    got = distiller.compute_loss(student, {**batch, "teacher_id": ids})
    asked = [len(body["prompt"]) if isinstance(body["prompt"], list) else 1 for kind, _, body in log]
    assert sum(asked) == 2  # rows 1 and 3 only
    parts, counts = [], []
    for rows, teacher, run in (([0, 2], local, args(tmp_path, **RUN)), ([1, 3], url, args(tmp_path, **RUN, **SERVED))):
        sub = {k: v[rows] for k, v in batch.items()}
        alone = Distiller(student, run, teacher, processing_class=_tok())
        parts.append(alone.compute_loss(student, dict(sub)))
        counts.append(float(alone._counts(sub)[COUNT_KINDS.index("kd")]))
    want = sum(p * c for p, c in zip(parts, counts, strict=True)) / sum(counts)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    means = distiller.router.log_values()
    assert means["loss_kd/local"] == pytest.approx(parts[0].item(), rel=1e-5)
    assert means["loss_kd/big"] == pytest.approx(parts[1].item(), rel=1e-5)
    assert dict(distiller.router.rows) == {"local": 2, "big": 2}
    distiller.start_step([{**batch, "teacher_id": ids}])  # one optimizer step: each part its share of the step mean
    assert distiller.compute_loss(student, {**batch, "teacher_id": ids}).item() == pytest.approx(want.item(), rel=1e-5)


def _train(tmp_path, name, teacher, data, log=None, **kw):
    run = args(tmp_path / name, **{**RUN, "per_device_train_batch_size": 4, "max_steps": 3, **kw})
    trainer = DistillationTrainer(model=llama(0), teacher_model=teacher, args=run, train_dataset=data,
                                  data_collator=labelled_collate, processing_class=_tok())
    if log is not None:
        log.clear()  # the set-up's probe requests
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, torch.tensor(losses), flat_params(trainer.model)


@pytest.mark.slow
def test_one_teacher_is_bitwise_the_single_teacher_path(tmp_path, served):
    """Every row routed to one of two named teachers (local or served), and a dict of one: the losses and weights of
    the plain single-teacher run."""
    url, log = served
    data = sft_rows(12)
    _, base_losses, base_weights = _train(tmp_path, "plain", llama(1), data)
    routed = data.add_column("teacher_id", ["a"] * 12)
    trainer, losses, weights = _train(tmp_path, "two", {"a": llama(1), "b": url}, routed, log, **SERVED)
    assert torch.equal(losses, base_losses) and torch.equal(weights, base_weights)
    assert not [e for e in log if e[0] == "completions"]  # the server was never asked: no row went to it
    _, losses, weights = _train(tmp_path, "one", {"a": llama(1)}, routed)
    assert torch.equal(losses, base_losses) and torch.equal(weights, base_weights)
    # every row to the served teacher, second in the dict: the plain served run (its sparse head), bitwise
    _, base_losses, base_weights = _train(tmp_path, "served", url, data, **SERVED)
    to_b = data.add_column("teacher_id", ["b"] * 12)
    _, losses, weights = _train(tmp_path, "to_b", {"a": llama(1), "b": url}, to_b, **SERVED)
    assert torch.equal(losses, base_losses) and torch.equal(weights, base_weights)
    report = DistillationReport.from_trainer(trainer)
    assert report.routing["a"]["rows"] == 12 and report.routing["b"] == {"teacher": "fake/teacher (served)", "rows": 0}
    assert "`a` = " in model_card(report) and "`b` = fake/teacher (served) (0 rows)" in model_card(report)


@pytest.mark.parametrize("case, words", [
    ("unknown", r"column names \['c'\], which teacher_model does not \(a, b\)"),
    ("column without names", "has a 'teacher_id' column but teacher_model names no teachers"),
    ("names without column", "has no 'teacher_id' column"),
    ("multi_teacher", "multi_teacher with teachers routed per row"),
    ("distill_terms", "distill_terms with teachers routed per row"),
    ("on-policy", "lmbda/seq_kd with teachers named in a dict"),
    ("no teacher", r"names \['b'\] without a teacher \(None\): give each name a model, folder, URL or offline "
                   r"signal \(load_teacher_signal\(path\)\)"),
])
def test_what_routing_cannot_honour_is_refused_before_training(tmp_path, case, words):
    data, teacher, kw = _rows(["a", "b"]), {"a": llama(1), "b": llama(2)}, {}
    if case == "unknown":
        data = _rows(["a", "c"])
    if case == "column without names":
        teacher = llama(1)
    if case == "names without column":
        data = sft_rows(2)
    if case == "multi_teacher":
        kw = dict(multi_teacher="losses")
    if case == "distill_terms":
        kw = dict(distill_terms=["loss=hidden_mse,layers=uniform"])
    if case == "on-policy":
        kw, teacher, data = dict(lmbda=0.5), {"a": llama(1)}, _rows(["a", "a"])  # a dict of one too
    if case == "no teacher":
        teacher["b"] = None
    with pytest.raises(ValueError, match=words) as err:
        Distiller(llama(0), args(tmp_path, **RUN, **kw), teacher, processing_class=_tok(), train_dataset=data)
    assert "\n" not in str(err.value)


def test_a_mixed_run_asks_each_teacher_for_its_rows_and_logs_each_loss(tmp_path, served):
    """Through the Trainer (gradient accumulation, the served teacher's prefetch): the server scores the rows routed
    to it and no other; both teachers' KD losses are logged; the rows are counted per teacher."""
    url, log = served
    ids = ["big", "local", "local", "big", "local", "big", "big", "local"] * 2
    data = _rows(ids)
    trainer, losses, _ = _train(tmp_path, "mixed", {"local": llama(1), "big": url}, data, log,
                                gradient_accumulation_steps=2, per_device_train_batch_size=2, **SERVED)
    assert torch.isfinite(losses).all() and len(losses) == 3
    asked = {tuple(p) for kind, _, body in log if kind == "completions" for p in body["prompt"]}
    rows = {tuple(r["input_ids"]): i for r, i in zip(data, ids, strict=True)}
    assert asked and {rows[p] for p in asked} == {"big"}  # only rows routed to the server were sent
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert all(any(k.startswith("loss_kd/") for k in h) for h in logged)  # each logged step: its teachers' KD
    # the logged components are the micro-batches' (not each teacher's sub-batch counted as one): kd_weight 1 only
    assert all(h["loss_kd"] == pytest.approx(h["loss"], rel=1e-5) for h in logged)
    assert {"loss_kd/local", "loss_kd/big"} <= {k for h in logged for k in h}
    assert sum(trainer.distiller.router.rows.values()) == 12 and trainer.distiller.router.rows["big"] > 0


def test_eval_with_teacher_splits_the_batch_and_keeps_row_order(tmp_path):
    """Evaluation with eval_with_teacher: each group's loss by its share of the KD-counted tokens, the predictions
    put back in the batch's row order."""
    student, a, b = llama(0).eval(), llama(1), llama(2)
    ids = ["b", "a", "b"]
    data = _rows(ids)
    run = args(tmp_path, **RUN, eval_with_teacher=True)
    distiller = Distiller(student, run, {"a": a, "b": b}, processing_class=_tok(), train_dataset=data)
    batch = labelled_collate([data[i] for i in range(3)])
    loss, out = distiller.compute_loss(student, {**batch, "teacher_id": ids}, return_outputs=True)
    with torch.no_grad():
        whole = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(out["logits"], whole)
    parts, counts = [], []
    for rows, teacher in (([1], a), ([0, 2], b)):
        sub = {k: v[rows] for k, v in batch.items()}
        alone = Distiller(student, args(tmp_path, **RUN, eval_with_teacher=True), teacher, processing_class=_tok())
        parts.append(alone.compute_loss(student, dict(sub)))
        counts.append(float(alone._counts(sub)[COUNT_KINDS.index("kd")]))
    want = sum(p.item() * c for p, c in zip(parts, counts, strict=True)) / sum(counts)
    assert loss.item() == pytest.approx(want, rel=1e-5)


def test_a_classifier_batch_is_the_row_mean_over_its_teachers(tmp_path):
    """Sequence-level KD (a mean over rows): the routed loss of a batch is each teacher's loss weighted by its rows."""
    student, a, b = bert(layers=2).train(), bert_teacher(layers=2, seed=1), bert_teacher(layers=2, seed=2)
    ids = ["a", "b", "b", "b"]
    data = token_dataset(4).add_column("teacher_id", ids)
    run = dict(kd_loss="kl", temperature=2.0, kd_weight=1.0, task_weight=0.5)
    distiller = Distiller(student, args(tmp_path, **run), {"a": a, "b": b}, train_dataset=data)
    batch = collate([{k: v for k, v in data[i].items() if k != "teacher_id"} for i in range(4)])
    got = distiller.compute_loss(student, {**batch, "teacher_id": ids})
    parts = [Distiller(student, args(tmp_path, **run), t).compute_loss(student, {k: v[rows] for k, v in batch.items()})
             for rows, t in (([0], a), ([1, 2, 3], b))]
    assert got.item() == pytest.approx(0.25 * parts[0].item() + 0.75 * parts[1].item(), rel=1e-5)


def test_several_teachers_under_a_sharded_engine_are_refused(tmp_path):
    """Under FSDP/DeepSpeed (the loss head's "module" route) each process would run one sharded student forward per
    teacher in its batch, a different number per process: refused before any teacher loads, not left to hang."""
    with pytest.raises(ValueError, match=r"routed per row, under FSDP/DeepSpeed: .* Train under DDP") as err:
        Distiller(llama(0), args(tmp_path, **RUN), {"a": llama(1), "b": "no/such-teacher"}, processing_class=_tok(),
                  train_dataset=_rows(["a", "b"]), route="module")
    assert "\n" not in str(err.value)


def test_evaluate_teacher_with_several_named_teachers_is_refused(tmp_path):
    """It scores one teacher on every row: the first named teacher's metrics on the rows routed to the others."""
    data = token_dataset(4).add_column("teacher_id", ["a", "b", "a", "b"])
    trainer = DistillationTrainer(model=bert(layers=2), teacher_model={"a": bert_teacher(layers=2, seed=1),
                                                                       "b": bert_teacher(layers=2, seed=2)},
                                  args=args(tmp_path, remove_unused_columns=False), train_dataset=data,
                                  eval_dataset=data, data_collator=collate)
    with pytest.raises(ValueError, match=r"routes its rows to 2 named teachers \(a, b\)"):
        trainer.evaluate_teacher()


def test_routed_predictions_keep_the_students_own_outputs(tmp_path):
    """A batch split by teacher gives back every output the student returns, in row order: the hidden states its
    config asks for, as the single-teacher path does (they were dropped); an output that is one per sub-batch (the
    KV cache) is refused by name when kept as a prediction, and left out as the Trainer leaves it by default."""
    student = llama(0).eval()
    student.config.output_hidden_states = True
    data = _rows(["b", "a", "b"])
    trainer = DistillationTrainer(model=student, teacher_model={"a": llama(1), "b": llama(2)}, train_dataset=data,
                                  args=args(tmp_path, **RUN, eval_with_teacher=True, per_device_eval_batch_size=3,
                                            use_cache=True),
                                  data_collator=labelled_collate, processing_class=_tok())
    out = trainer.predict(data)
    batch = labelled_collate([{k: v for k, v in data[i].items() if k != "teacher_id"} for i in range(3)])
    with torch.no_grad():
        whole = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits, hidden = out.predictions
    torch.testing.assert_close(torch.as_tensor(logits), whole.logits)
    assert len(hidden) == len(whole.hidden_states)
    for got, want in zip(hidden, whole.hidden_states, strict=True):
        torch.testing.assert_close(torch.as_tensor(got), want)
    with pytest.raises(ValueError, match=r"output 'cache' \(DynamicCache\) is one per sub-batch.*ignore_keys"):
        trainer.predict(data, ignore_keys=[])
    assert "eval_loss" in trainer.evaluate(data)  # loss only: the cache is never read
