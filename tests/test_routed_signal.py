"""An offline teacher signal as a named teacher of routing per row (hf_distill.routed_signal, issue #42 item 6):
its rows take their KD from the stored top-k + tail, mixed with a local and a served teacher in one run; a dict of
that one teacher is bitwise the plain signal path; the plain path's refusals, naming the teacher, before training."""

from __future__ import annotations

import pytest
import torch
from helpers import VOCAB, args, flat_params, labelled_collate, llama, sft_rows, word_tokenizer
from served_fakes import fake_vllm

from hf_distill import DistillationTrainer
from hf_distill.data.collators import TeacherOutputsCollator
from hf_distill.data.teacher_signal import attach_teacher_signal, create_teacher_signal, signal_teacher, streamed
from hf_distill.distiller import Distiller
from hf_distill.losses.normalise import COUNT_KINDS, kd_positions
from hf_distill.publish.card import model_card
from hf_distill.publish.report import DistillationReport
from hf_distill.serving.server import ServerThread

K, T = 8, 1.0
RUN = dict(kd_loss="kl", temperature=T, kd_weight=1.0, task_weight=0.0)
SERVED = dict(teacher_top_k=K, teacher_retries=1, teacher_backoff=0.0, teacher_timeout=5.0)


def _tok(prefix: str = "w"):
    return word_tokenizer([f"{prefix}{i}" for i in range(VOCAB - 2)])


def _signal(folder, rows, teacher=None, **kw):
    settings = dict(tokenizer=_tok(), k=K, temperature=T, rows_per_shard=8, batch_size=4, progress=False)
    settings.update(kw)
    return create_teacher_signal(teacher or llama(3), rows, folder, **settings)


@pytest.fixture(scope="module")
def signal16(tmp_path_factory):
    """One format-2 signal of sft_rows(16) (whose first n rows are sft_rows(n)), shared: a signal is read only."""
    return _signal(tmp_path_factory.mktemp("signal16") / "signal", sft_rows(16), teacher_name="tiny/teacher-70b")


@pytest.fixture
def served():
    log = []
    server = ServerThread(fake_vllm(llama(2), _tok(), log=log))
    yield server.url, log
    server.stop()


def test_signal_rows_mixed_with_a_local_and_a_served_teacher(tmp_path, served):
    """One batch routed to a signal, a local and a served teacher: the loss is the token-weighted mean of the three
    single-teacher losses (the signal's: the plain path on its rows joined with the signal); `loss_kd/<name>` is each
    one; the server is asked for its rows only. The signal holds every row (made from all of them), in the compact
    layout (format 3; the other tests use format 2)."""
    url, log = served
    ids = ["sig", "local", "big", "sig", "local", "big"]
    rows = sft_rows(6)
    signal = _signal(tmp_path / "signal", rows, layout="compact")
    data = rows.add_column("teacher_id", ids)
    student, local = llama(0).train(), llama(1)
    distiller = Distiller(student, args(tmp_path, **RUN, **SERVED), {"sig": signal, "local": local, "big": url},
                          processing_class=_tok(), train_dataset=data)
    batch = labelled_collate([rows[i] for i in range(6)])
    log.clear()
    got = distiller.compute_loss(student, {**batch, "teacher_id": ids})
    assert sum(len(body["prompt"]) for kind, _, body in log if kind == "completions") == 2  # rows 2 and 5 only
    joined = attach_teacher_signal(rows, signal)  # the plain signal path's batch, at the same width
    with_signal = TeacherOutputsCollator(labelled_collate)([joined[i] for i in range(6)])
    parts, counts = [], []
    for rows_of, teacher, run in (([0, 3], None, args(tmp_path, **RUN)), ([1, 4], local, args(tmp_path, **RUN)),
                                  ([2, 5], url, args(tmp_path, **RUN, **SERVED))):
        sub = {k: v[rows_of] for k, v in (with_signal if teacher is None else batch).items()}
        alone = Distiller(student, run, teacher, processing_class=_tok(),
                          train_dataset=joined.select(rows_of) if teacher is None else None)
        counts.append(float(alone._counts(sub)[COUNT_KINDS.index("kd")]))
        parts.append(alone.compute_loss(student, dict(sub)).item())
    want = sum(p * c for p, c in zip(parts, counts, strict=True)) / sum(counts)
    assert got.item() == pytest.approx(want, rel=1e-5)  # float32 sums in another order
    means = distiller.router.log_values()
    for name, part in zip(("sig", "local", "big"), parts, strict=True):
        assert means[f"loss_kd/{name}"] == pytest.approx(part, rel=1e-5), name
    assert len({round(p, 4) for p in parts}) == 3  # three different teachers, not one path taken three times
    # the signal's rows against float64: KL over its k + 1 outcomes (top-k ids and the tail), mean over counted tokens
    sub = {k: v[[0, 3]] for k, v in with_signal.items()}
    log_p, index, log_tail = (x.double() if x.is_floating_point() else x for x in signal_teacher(
        {k: v for k, v in sub.items() if k.startswith("teacher_signal")}, sub, "labels", "labels"))
    with torch.no_grad():
        z = student(input_ids=sub["input_ids"], attention_mask=sub["attention_mask"]).logits
    log_q = z.double().log_softmax(-1)
    q_top = log_q.gather(-1, index)
    q_tail = torch.log1p(-q_top.exp().sum(-1).clamp(max=1.0))
    kl = (log_p.exp() * (log_p - q_top)).sum(-1) + log_tail.exp() * (log_tail - q_tail)
    mask = kd_positions(sub["attention_mask"], sub["labels"], "labels", causal=True)
    assert means["loss_kd/sig"] == pytest.approx(kl[:, :-1][mask].mean().item(), rel=1e-4)


def _train(tmp_path, name, teacher, data, log=None, **kw):
    run = args(tmp_path / name, **{**RUN, "per_device_train_batch_size": 4, "max_steps": 3, "optim": "sgd",
                                   "learning_rate": 0.5, **kw})
    trainer = DistillationTrainer(model=llama(0), teacher_model=teacher, args=run, train_dataset=data,
                                  data_collator=labelled_collate, processing_class=_tok())
    if log is not None:
        log.clear()  # the set-up's probe requests
    trainer.train()
    return trainer, torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h]), \
        flat_params(trainer.model)


@pytest.mark.slow
def test_a_dict_of_one_signal_is_bitwise_the_plain_signal_path(tmp_path, signal16):
    """teacher_model={"sig": signal} with every row routed to it, and a dict of two whose other teacher gets no row:
    the losses and weights of DistillationTrainer(teacher_model=None, train_dataset=attach_teacher_signal(...))."""
    rows = sft_rows(12)
    signal = signal16.select(range(12))
    _, base_losses, base_weights = _train(tmp_path, "plain", None, attach_teacher_signal(rows, signal))
    routed = rows.add_column("teacher_id", ["sig"] * 12)
    trainer, losses, weights = _train(tmp_path, "one", {"sig": signal}, routed)
    assert torch.equal(losses, base_losses) and torch.equal(weights, base_weights)
    _, losses, weights = _train(tmp_path, "two", {"local": llama(1), "sig": signal}, routed)
    assert torch.equal(losses, base_losses) and torch.equal(weights, base_weights)
    assert trainer.distiller.teacher is None and trainer.distiller.router.rows["sig"] == 12


@pytest.mark.slow
def test_a_mixed_run_logs_each_teacher_and_the_card_names_the_signal(tmp_path, served, signal16):
    """Through the Trainer with gradient accumulation: a signal, a local and a served teacher; each logged; the
    server scores its rows only; the card and report name the signal's teacher and its rows."""
    url, log = served
    ids = ["big", "sig", "local", "sig", "local", "big", "sig", "sig"] * 2
    data = sft_rows(16).add_column("teacher_id", ids)
    signal = signal16.select([i for i, name in enumerate(ids) if name == "sig"])  # the rows routed to it only
    trainer, losses, _ = _train(tmp_path, "mixed", {"sig": signal, "local": llama(1), "big": url}, data, log,
                                gradient_accumulation_steps=2, per_device_train_batch_size=2, **SERVED)
    assert torch.isfinite(losses).all() and len(losses) == 3
    asked = {tuple(p) for kind, _, body in log if kind == "completions" for p in body["prompt"]}
    by_row = {tuple(r["input_ids"]): r["teacher_id"] for r in data}
    assert asked and {by_row[p] for p in asked} == {"big"}
    logged = {k for h in trainer.state.log_history for k in h}
    assert {"loss_kd/sig", "loss_kd/local", "loss_kd/big"} <= logged
    rows = trainer.distiller.router.rows
    assert sum(rows.values()) == 12 and rows["sig"] > 0  # 3 steps of 2 x 2 rows, shuffled
    report = DistillationReport.from_trainer(trainer)
    assert report.routing["sig"] == {"teacher": "tiny/teacher-70b (offline signal, k=8)", "rows": rows["sig"]}
    assert f"`sig` = tiny/teacher-70b (offline signal, k=8) ({rows['sig']} rows)" in model_card(report)


@pytest.mark.parametrize("case, words", [
    ("not a signal", r"teacher_model\['sig'\] is a Dataset without teacher-signal metadata"),
    ("streamed", r"teacher_model\['sig'\] is a streamed teacher signal"),
    ("temperature", r"teacher_model\['sig'\]: The teacher signal was made at temperature 1.0, but the run's "
                    "temperature is 2.0"),
    ("kd_token_mask", r"teacher_model\['sig'\]: The teacher signal holds the positions of kd_token_mask='labels'"),
    ("vocabulary", r"teacher_model\['sig'\]: The student's tokenizer has another vocabulary"),
    ("mse", r"teacher_model\['sig'\] is a teacher signal .* kd_loss='mse' cannot use"),
    ("row not in it", r"Row 1 of the train dataset is routed to 'sig', but that teacher signal holds no row"),
    ("positions moved", r"Row 0 of the train dataset is routed to 'sig' and its tokens are in that teacher signal, "
                        "but with other counted positions"),
    ("joined too", r"The train dataset carries teacher_signal columns .* teacher_model\['sig'\] is a signal too"),
    ("not named", r"teacher_model holds an offline teacher signal outside a dict: join it with its rows"),
    ("cached beside", r"cached columns \[.*\] with teachers routed per row .* give the signal as a named teacher"),
])
def test_what_a_named_signal_cannot_honour_is_refused_before_any_teacher_loads(tmp_path, signal16, case, words):
    """Each refusal is one line, raised before the other named teacher (a folder that does not exist) is loaded."""
    rows = sft_rows(4)
    signal = signal16.select([0, 2, 3] if case == "row not in it" else range(4))
    data, run, tok = rows, dict(RUN), _tok()
    if case == "not a signal":
        signal = rows
    if case == "streamed":
        signal = streamed(signal)
    if case == "temperature":
        run["temperature"] = 2.0
    if case == "kd_token_mask":
        run["kd_token_mask"] = "attention"
    if case == "vocabulary":
        tok = _tok("v")
    if case == "mse":
        run["kd_loss"] = "mse"
    if case == "positions moved":  # one more prompt token masked: as many tokens, other counted positions
        def shift(r, i):
            first = next(p for p, label in enumerate(r["labels"]) if label != -100)
            return {"labels": [-100 if (i == 0 and p == first) else v for p, v in enumerate(r["labels"])]}

        data = rows.map(shift, with_indices=True)
    if case in ("joined too", "cached beside"):
        data = attach_teacher_signal(rows, signal)
    other = {} if case == "joined too" else {"other": str(tmp_path / "no-such-teacher")}
    data = data.add_column("teacher_id", ["sig", "sig", "other" if other else "sig", "sig"])
    teachers = [signal, other["other"]] if case == "not named" else {"sig": signal, **other}
    with pytest.raises(ValueError, match=words) as err:
        Distiller(llama(0), args(tmp_path, **run), teachers, processing_class=tok,
                  train_dataset=data.remove_columns("teacher_id") if case == "not named" else data)
    assert "\n" not in str(err.value)


def test_a_streamed_rows_batch_not_in_the_signal_is_refused_at_its_batch(tmp_path, signal16):
    """Rows that could not be checked before training (a stream) are found per batch: one that the signal does not
    hold is refused there, never trained without its teacher."""
    rows = sft_rows(4)
    signal = signal16.select([0, 1])
    student = llama(0).train()
    distiller = Distiller(student, args(tmp_path, **RUN), {"sig": signal}, processing_class=_tok())
    batch = labelled_collate([rows[i] for i in range(4)])
    with pytest.raises(ValueError, match=r"Row 2 of this batch is routed to 'sig', but that teacher signal holds no"):
        distiller.compute_loss(student, {**batch, "teacher_id": ["sig"] * 4})
    packed = {**batch, "position_ids": torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])}
    with pytest.raises(ValueError, match=r"packs several sequences per row .* Train without packing"):
        distiller.compute_loss(student, {**packed, "teacher_id": ["sig"] * 4})
    # evaluation rows (eval_with_teacher: the trainer checks them as it checks the training rows)
    with pytest.raises(ValueError, match=r"Row 1 of the evaluation \(eval\) dataset is routed to 'sig', but"):
        distiller.check_dataset(rows.select([1, 2]).add_column("teacher_id", ["sig", "sig"]), "evaluation (eval)")
