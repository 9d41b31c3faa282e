"""hf_distill.data.cache: teacher outputs computed once, keyed so they are never stale, aligned with their rows.

Also a torchrun worker: `python -m torch.distributed.run --nproc_per_node 2 tests/test_cache.py OUT CACHE`.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import args, bert, bert_config, collate, flat_params, token_dataset
from helpers import teacher as make_teacher
from transformers import BertForMaskedLM

from hf_distill import DistillationTrainer, losses
from hf_distill.data.cache import (
    LOGITS_COLUMN,
    TOPK_INDICES_COLUMN,
    TOPK_VALUES_COLUMN,
    cache_teacher_outputs,
    cached_teacher_info,
    hidden_column,
    teacher_fingerprint,
)

HIDDEN_TERMS = ["loss=hidden_mse,layers=uniform,weight=1", "loss=pkd_loss,layers=1:2,weight=2"]


def _count_forwards(model) -> list[int]:
    calls: list[int] = []
    model.register_forward_hook(lambda *a: calls.append(1))
    return calls


def _cache(teacher, data, tmp_path, **kw):
    kw.setdefault("batch_size", 8)
    return cache_teacher_outputs(teacher, data, cache_dir=tmp_path / "cache", progress=False, **kw)


def _mlm(seed: int) -> BertForMaskedLM:
    torch.manual_seed(seed)
    return BertForMaskedLM(bert_config())  # no dropout: live and cached forwards agree


# ---------------------------------------------------------------- keys: reuse, and never stale


@pytest.mark.slow
def test_reused_when_unchanged_recomputed_when_teacher_dataset_or_settings_change(tmp_path):
    teacher, data = make_teacher(), token_dataset(20)
    calls = _count_forwards(teacher)
    first = _cache(teacher, data, tmp_path, hidden_layers=[2])
    assert len(calls) == 3  # 20 rows in batches of 8

    again = _cache(copy.deepcopy(teacher), token_dataset(20), tmp_path, hidden_layers=[2])  # a "later run"
    assert len(calls) == 3
    assert torch.equal(again[:][LOGITS_COLUMN], first[:][LOGITS_COLUMN])

    with torch.no_grad():
        teacher.classifier.bias[0] += 1e-3  # one weight of 22: a new teacher
    changed = _cache(teacher, data, tmp_path, hidden_layers=[2])
    assert len(calls) == 6
    assert not torch.equal(changed[:][LOGITS_COLUMN], first[:][LOGITS_COLUMN])

    edited = data.map(lambda r, i: {"input_ids": r["input_ids"][:-1] if i == 7 else r["input_ids"]}, with_indices=True)
    _cache(teacher, edited, tmp_path, hidden_layers=[2])  # one row one token shorter: a new dataset
    assert len(calls) == 9
    _cache(teacher, data, tmp_path, hidden_layers=[0, 2])  # other settings
    assert len(calls) == 12
    _cache(teacher, data, tmp_path, hidden_layers=[2])
    assert len(calls) == 12
    assert len(list((tmp_path / "cache").iterdir())) == 4  # no temporary folders left behind


def test_teacher_fingerprint_sees_every_tensor_and_is_stable():
    a = make_teacher()
    fp = teacher_fingerprint(a)
    assert teacher_fingerprint(copy.deepcopy(a)) == fp
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.bert.encoder.layer[3].output.dense.weight[5, 7] += 1e-6
    assert teacher_fingerprint(b) != fp
    assert teacher_fingerprint(copy.deepcopy(a).to(torch.bfloat16)) != fp


def _pad_to(rows, max_length=64):
    """A collator with a setting that changes what the teacher sees (truncation)."""
    return collate([{**r, "input_ids": r["input_ids"][:max_length]} for r in rows])


def _closure(max_length):
    def pad(rows):
        return _pad_to(rows, max_length)

    return pad


class _Slotted:
    __slots__ = ("max_length",)

    def __init__(self, max_length):
        self.max_length = max_length

    def __call__(self, rows):
        return _pad_to(rows, self.max_length)


COLLATOR_FORMS = {
    "partial": lambda m: functools.partial(_pad_to, max_length=m),
    "lambda": lambda m: (lambda rows: _pad_to(rows, m)),
    "closure": _closure,
    "slots": _Slotted,
}


@pytest.mark.parametrize("form", list(COLLATOR_FORMS))
def test_collator_settings_are_in_the_key(tmp_path, form):
    teacher, data = make_teacher(), token_dataset(4, min_len=5, max_len=8)
    calls = _count_forwards(teacher)
    make = COLLATOR_FORMS[form]
    short = _cache(teacher, data, tmp_path, collator=make(4))
    assert len(calls) == 1
    _cache(teacher, data, tmp_path, collator=make(4))  # equal settings, a new object: reused
    assert len(calls) == 1
    long = _cache(teacher, data, tmp_path, collator=make(64))
    assert len(calls) == 2
    assert not torch.equal(short[:][LOGITS_COLUMN], long[:][LOGITS_COLUMN])  # the setting did change the outputs


def test_lambdas_with_different_bodies_get_different_keys(tmp_path):
    teacher, data = make_teacher(), token_dataset(4, min_len=5, max_len=8)
    calls = _count_forwards(teacher)
    _cache(teacher, data, tmp_path, collator=lambda rows: _pad_to(rows, 4))
    _cache(teacher, data, tmp_path, collator=lambda rows: _pad_to(rows, 64))
    assert len(calls) == 2


@pytest.mark.slow
def test_ambient_autocast_is_in_the_key(tmp_path):
    teacher, data = make_teacher(), token_dataset(4)
    calls = _count_forwards(teacher)
    plain = _cache(teacher, data, tmp_path)
    with torch.autocast("cpu", torch.bfloat16):
        bf16 = _cache(teacher, data, tmp_path)
        assert len(calls) == 2
        _cache(teacher, data, tmp_path)
        assert len(calls) == 2
    with torch.autocast("cpu", torch.float16):
        _cache(teacher, data, tmp_path)
    assert len(calls) == 3
    with torch.autocast("cpu", torch.bfloat16, enabled=False):
        _cache(teacher, data, tmp_path)
    assert len(calls) == 3  # autocast off is the plain key
    assert not torch.equal(plain[:][LOGITS_COLUMN], bf16[:][LOGITS_COLUMN])


def test_transformers_version_is_in_the_key(tmp_path, monkeypatch):
    import transformers

    teacher, data = make_teacher(), token_dataset(4)
    calls = _count_forwards(teacher)
    _cache(teacher, data, tmp_path)
    monkeypatch.setattr(transformers, "__version__", "999.0.0")
    _cache(teacher, data, tmp_path)
    assert len(calls) == 2


@pytest.mark.slow
def test_only_the_columns_the_teacher_reads_are_in_the_key(tmp_path):
    teacher, data = make_teacher(), token_dataset(12)
    calls = _count_forwards(teacher)
    first = _cache(teacher, data, tmp_path, batch_size=16)
    relabelled = data.map(lambda r: {"label": 1 - r["label"]}).add_column("id", [f"row-{i}" for i in range(12)])
    again = _cache(teacher, relabelled, tmp_path, batch_size=16)
    assert len(calls) == 1  # labels and ids changed, the teacher's inputs did not: reused
    assert again["label"] == relabelled["label"] and again["id"] == relabelled["id"]  # the new rows, old outputs
    assert torch.equal(again[:][LOGITS_COLUMN], first[:][LOGITS_COLUMN])
    shuffled = data.select([1, 0, *range(2, 12)])  # same rows in another order: other inputs per position
    _cache(teacher, shuffled, tmp_path, batch_size=16)
    assert len(calls) == 2
    _cache(teacher, shuffled.flatten_indices(), tmp_path, batch_size=16)  # the same rows, written out
    assert len(calls) == 2
    ids = data.map(lambda r, i: {"input_ids": [*r["input_ids"][:-1], 7] if i == 3 else r["input_ids"]},
                   with_indices=True)
    _cache(teacher, ids, tmp_path, batch_size=16)
    assert len(calls) == 3


def test_teacher_fingerprint_is_memoised_and_sees_in_place_edits(monkeypatch):
    from hf_distill.data import cache_key  # where teacher_fingerprint and its hashing live

    hashed = []
    real = cache_key._hash_state
    monkeypatch.setattr(cache_key, "_hash_state", lambda *a: hashed.append(1) or real(*a))
    t = make_teacher()
    fp = teacher_fingerprint(t)
    assert teacher_fingerprint(t) == fp and len(hashed) == 1  # memoised: the weights were read once

    with torch.no_grad():
        t.bert.encoder.layer[1].attention.self.query.weight[0, 0] += 1e-6  # in place: same storage
    edited = teacher_fingerprint(t)
    assert edited != fp and edited == teacher_fingerprint(copy.deepcopy(t))

    t.classifier.weight.grad = torch.ones_like(t.classifier.weight)
    torch.optim.AdamW([t.classifier.weight], lr=1e-3, fused=True).step()  # fused kernels leave _version alone
    stepped = teacher_fingerprint(t)
    assert stepped != edited and stepped == teacher_fingerprint(copy.deepcopy(t))

    t.classifier.bias.data = t.classifier.bias.data + 1  # new storage
    assert teacher_fingerprint(t) not in (fp, edited, stepped)
    t.load_state_dict(make_teacher().state_dict())
    assert teacher_fingerprint(t) == fp


# ---------------------------------------------------------------- values


@pytest.mark.slow
def test_cached_values_equal_unpadded_forward_per_row(tmp_path):
    teacher, data = make_teacher(), token_dataset(13, seed=2)
    out = _cache(teacher, data, tmp_path, hidden_layers=[0, 4], batch_size=5)
    half = _cache(teacher, data, tmp_path, hidden_layers=[4], dtype=torch.float16)
    assert out.column_names == ["input_ids", "label", LOGITS_COLUMN, hidden_column(0), hidden_column(4)]
    assert cached_teacher_info(out).num_layers == 4 and cached_teacher_info(out).hidden_size == 32
    for i in range(len(data)):
        ids = torch.tensor([data[i]["input_ids"]])
        with torch.no_grad():
            ref = teacher(input_ids=ids, output_hidden_states=True)
        row = out[i]
        torch.testing.assert_close(row[LOGITS_COLUMN], ref.logits[0], atol=1e-5, rtol=0)
        for layer in (0, 4):
            assert row[hidden_column(layer)].shape == (ids.shape[1], 32)  # real tokens only
            torch.testing.assert_close(row[hidden_column(layer)], ref.hidden_states[layer][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(half[i][hidden_column(4)], ref.hidden_states[4][0], atol=5e-3, rtol=1e-3)


@pytest.mark.slow
def test_top_k_of_token_level_logits(tmp_path):
    teacher, data = _mlm(1), token_dataset(9)
    out = _cache(teacher, data, tmp_path, top_k=6, batch_size=4)
    assert LOGITS_COLUMN not in out.column_names
    for i in range(len(data)):
        ids = torch.tensor([data[i]["input_ids"]])
        with torch.no_grad():
            ref = teacher(input_ids=ids).logits[0]
        values, indices = out[i][TOPK_VALUES_COLUMN], out[i][TOPK_INDICES_COLUMN]
        assert values.shape == indices.shape == (ids.shape[1], 6)
        torch.testing.assert_close(values, ref.topk(6).values, atol=1e-5, rtol=0)
        torch.testing.assert_close(ref.gather(-1, indices.long()), values, atol=1e-5, rtol=0)


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="hidden_layers \\[5\\] out of range"):
        _cache(make_teacher(), token_dataset(4), tmp_path, hidden_layers=[5])
    with pytest.raises(ValueError, match="Nothing to cache"):
        _cache(make_teacher(), token_dataset(4), tmp_path, logits=False)
    with pytest.raises(ValueError, match="float32 or torch.float16"):
        _cache(make_teacher(), token_dataset(4), tmp_path, dtype=torch.bfloat16)

    class Masking:
        changes_inputs = True  # as MLMDistillationCollator: new random masks every batch

        def __call__(self, rows):
            return collate(rows)

    with pytest.raises(ValueError, match="Masking changes the inputs of every batch"):
        _cache(make_teacher(), token_dataset(4), tmp_path, collator=Masking())


# ---------------------------------------------------------------- the trainer consumes the cache


class CheckingTrainer(DistillationTrainer):
    """Before each loss, compares the batch's cached outputs with a live forward of a reference teacher."""

    reference: torch.nn.Module
    checked = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mask = inputs["attention_mask"].bool()
        with torch.no_grad():
            ref = self.reference(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], output_hidden_states=True
            )
        if LOGITS_COLUMN in inputs:
            torch.testing.assert_close(inputs[LOGITS_COLUMN], ref.logits, atol=1e-5, rtol=0)
        if TOPK_VALUES_COLUMN in inputs:
            values, indices = inputs[TOPK_VALUES_COLUMN][mask], inputs[TOPK_INDICES_COLUMN][mask].long()
            live = ref.logits[mask]
            torch.testing.assert_close(values, live.topk(values.shape[-1]).values, atol=1e-5, rtol=0)
            torch.testing.assert_close(live.gather(-1, indices), values, atol=1e-5, rtol=0)
        for i, h in enumerate(ref.hidden_states):
            if hidden_column(i) in inputs:
                torch.testing.assert_close(inputs[hidden_column(i)][mask], h[mask], atol=1e-5, rtol=0)
        self.checked += 1
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


@pytest.mark.slow
@pytest.mark.parametrize("token_level", [False, True], ids=["logits+hidden", "top-k"])
def test_rows_and_cached_outputs_stay_aligned_shuffled_padded_multi_epoch(tmp_path, token_level):
    teacher = _mlm(1) if token_level else make_teacher()
    student = _mlm(0) if token_level else bert(2)
    data = token_dataset(22, min_len=2, max_len=14)  # 22 rows, batch 8: a short last batch each epoch
    if token_level:
        data = data.remove_columns("label")
        data = _cache(teacher, data, tmp_path, top_k=5)
        extra = dict(kd_weight=1.0, task_weight=0.0)
    else:
        data = _cache(teacher, data, tmp_path, hidden_layers=[0, 2, 4])
        extra = dict(distill_terms=HIDDEN_TERMS)
    reference = copy.deepcopy(teacher).eval()  # copied before the hook: its forwards are not the trainer's
    calls = _count_forwards(teacher)
    trainer = CheckingTrainer(
        model=student, teacher_model=teacher,
        args=args(tmp_path, num_train_epochs=3, max_steps=-1, optim="sgd", **extra),
        train_dataset=data, data_collator=collate,
    )
    trainer.reference = reference
    trainer.train()
    assert trainer.checked == 9 and trainer.state.epoch == 3
    assert calls == []  # the trainer never ran the teacher


@pytest.mark.slow
def test_cached_logits_and_hidden_states_train_exactly_as_online(tmp_path):
    teacher, data = make_teacher(), token_dataset(24)
    cached = _cache(teacher, data, tmp_path, hidden_layers=[0, 2, 4])
    common = dict(distill_terms=HIDDEN_TERMS, optim="sgd", learning_rate=0.5, max_steps=4)

    def run(sub, dataset, teacher_model):
        t = DistillationTrainer(model=bert(2), teacher_model=teacher_model, args=args(tmp_path / sub, **common),
                                train_dataset=dataset, data_collator=collate)
        t.train()
        return t

    online = run("online", data, teacher)
    offline = run("offline", cached, None)  # no teacher at all: its shape comes from the cache
    assert offline.teacher is None and offline.intermediate.teacher_info.num_layers == 4
    torch.testing.assert_close(flat_params(offline.model), flat_params(online.model), atol=1e-5, rtol=0)
    for a, b in zip(online.state.log_history, offline.state.log_history, strict=True):
        for key in ("loss_kd", "loss_hidden", "loss_pkd"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), key


@pytest.mark.slow
def test_top_k_columns_reach_the_kd_loss(tmp_path):
    teacher, student = _mlm(1), _mlm(0)
    data = _cache(teacher, token_dataset(6).remove_columns("label"), tmp_path, top_k=4)
    a = args(tmp_path, kd_weight=1.0, task_weight=0.0, temperature=3.0)
    trainer = DistillationTrainer(model=student, args=a, train_dataset=data, data_collator=collate)
    batch = trainer.data_collator([data[i] for i in range(6)])
    assert batch[TOPK_VALUES_COLUMN].shape == (6, batch["input_ids"].shape[1], 4)
    loss = trainer.compute_loss(student.train(), dict(batch))
    s = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    sparse = (batch[TOPK_VALUES_COLUMN], batch[TOPK_INDICES_COLUMN])
    assert loss.item() == pytest.approx(losses.kl_div(s, sparse, 3.0, mask=batch["attention_mask"]).item(), rel=1e-6)


@pytest.mark.slow
def test_missing_cached_features_without_teacher_are_refused(tmp_path):
    data = _cache(make_teacher(), token_dataset(8), tmp_path, hidden_layers=[0, 2])

    def build(dataset, **kw):
        DistillationTrainer(model=bert(2), args=args(tmp_path, **kw), train_dataset=dataset, data_collator=collate)

    with pytest.raises(ValueError, match="teacher hidden states \\[4\\]"):
        build(data, distill_terms=["loss=hidden_mse,layers=uniform"])
    with pytest.raises(ValueError, match="need the teacher's Q/K/V"):
        build(data, distill_terms=["loss=attention_score_mse,layers=uniform"])
    with pytest.raises(ValueError, match="teacher_model must be given"):
        build(token_dataset(8), distill_terms=["loss=hidden_mse,layers=uniform"], kd_weight=0.0)
    topk = _cache(_mlm(1), token_dataset(8), tmp_path, top_k=3)
    with pytest.raises(ValueError, match="needs teacher logits"):
        DistillationTrainer(model=_mlm(0), args=args(tmp_path, kd_loss="mse"), train_dataset=topk,
                            data_collator=collate)


# ---------------------------------------------------------------- every dataset type the Trainer accepts


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class _Stream(torch.utils.data.IterableDataset):
    """Re-iterable: every `iter()` starts a new pass, as a generator-based IterableDataset does."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        yield from self.rows


class _OneShot(torch.utils.data.IterableDataset):
    """Its own iterator: reading a row consumes it."""

    def __init__(self, rows):
        self.it = iter(rows)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.it)


def _as(kind: str, data):
    rows = [data[i] for i in range(len(data))]
    if kind == "torch-map":
        return _Rows(rows)
    if kind == "list":
        return rows
    if kind == "torch-iterable":
        return _Stream(rows)
    assert kind == "hf-iterable"
    return data.with_format(None).to_iterable_dataset()  # a formatted dataset cannot be converted as it is


DATASET_KINDS = ["torch-map", "list", "torch-iterable", "hf-iterable"]


def _cached_case(case: str, tmp_path):
    """(teachers to pass, teachers whose forwards are counted, cached datasets.Dataset, student seed maker, args)."""
    data = token_dataset(16, min_len=2, max_len=14)
    if case == "logits+hidden":
        t = make_teacher()
        return t, [t], _cache(t, data, tmp_path, hidden_layers=[0, 2, 4]), lambda: bert(2), dict(
            distill_terms=HIDDEN_TERMS)
    if case == "logits-no-teacher":
        t = make_teacher()
        return None, [t], _cache(t, data, tmp_path), lambda: bert(2), {}
    if case == "multi-teacher":
        ts = [make_teacher(seed=1), make_teacher(layers=2, seed=7)]
        for i, t in enumerate(ts):
            data = _cache(t, data, tmp_path, teacher_index=i)
        return ts, ts, data, lambda: bert(2), dict(teacher_weights=[0.3, 0.7])
    assert case == "top-k"
    t = _mlm(1)
    return t, [t], _cache(t, data.remove_columns("label"), tmp_path, top_k=5), lambda: _mlm(0), dict(
        kd_weight=1.0, task_weight=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["logits+hidden", "logits-no-teacher", "multi-teacher", "top-k"])
def test_cached_columns_work_with_every_dataset_type(tmp_path, case):
    """Same rows, same order (sequential sampling): every dataset type trains as the datasets.Dataset does,
    with no teacher forward."""
    teacher_model, counted, cached, student, extra = _cached_case(case, tmp_path)
    calls = []
    for t in counted:
        t.register_forward_hook(lambda *a: calls.append(1))

    def run(sub, dataset):
        a = args(tmp_path / sub, max_steps=4, optim="sgd", learning_rate=0.5, train_sampling_strategy="sequential",
                 **extra)
        trainer = DistillationTrainer(model=student(), teacher_model=teacher_model, args=a, train_dataset=dataset,
                                      data_collator=collate)
        trainer.train()
        losses_logged = [{k: v for k, v in r.items() if k.startswith("loss")} for r in trainer.state.log_history]
        return flat_params(trainer.model), [r for r in losses_logged if r]

    ref_params, ref_losses = run("ref", cached)
    assert calls == [] and len(ref_losses) == 4
    for kind in DATASET_KINDS:
        params, logged = run(kind, _as(kind, cached))
        assert calls == [], kind  # the cached columns survived the column remover: the teacher never ran
        torch.testing.assert_close(params, ref_params, atol=1e-5, rtol=0, msg=kind)
        assert len(logged) == len(ref_losses), kind
        for got, want in zip(logged, ref_losses, strict=True):
            assert got.keys() == want.keys(), kind
            for k in want:
                assert got[k] == pytest.approx(want[k], rel=1e-5), (kind, k)


@pytest.mark.parametrize("kind", DATASET_KINDS)
def test_init_checks_read_the_first_row_of_any_dataset(tmp_path, kind):
    data = _cache(make_teacher(), token_dataset(8), tmp_path)

    def build(dataset, model=None, **kw):
        DistillationTrainer(model=model or bert(2), args=args(tmp_path, **kw), train_dataset=dataset,
                            data_collator=collate)

    build(_as(kind, data))  # teacher_model=None: the rows carry teacher_logits
    with pytest.raises(ValueError, match="teacher_logits have width 2 but the student has 3 labels"):
        build(_as(kind, data), model=bert(2, labels=3))
    with pytest.raises(ValueError, match="needs teacher logits"):
        build(_as(kind, token_dataset(8)))
    # Without a teacher, its shape comes from the cache's metadata, which only a datasets.Dataset carries.
    with pytest.raises(ValueError, match="teacher_model must be given"):
        DistillationTrainer(model=bert(2), teacher_model=None, train_dataset=_as(kind, data), data_collator=collate,
                            args=args(tmp_path, kd_weight=0.0, distill_terms=["loss=hidden_mse,layers=1:2"]))
    with pytest.raises(ValueError, match="teacher hidden states \\[2\\]"):  # the datasets.Dataset itself
        DistillationTrainer(model=bert(2), teacher_model=None, train_dataset=data, data_collator=collate,
                            args=args(tmp_path, kd_weight=0.0, distill_terms=["loss=hidden_mse,layers=1:2"]))


def test_a_dataset_that_is_its_own_iterator_is_not_consumed_by_the_checks(tmp_path):
    data = _cache(make_teacher(), token_dataset(8), tmp_path)
    rows = [data[i] for i in range(8)]
    with pytest.raises(ValueError, match="iter\\(dataset\\) is dataset"):
        DistillationTrainer(model=bert(2), args=args(tmp_path), train_dataset=_OneShot(rows), data_collator=collate)
    stream = _OneShot(rows)
    DistillationTrainer(model=bert(2), teacher_model=make_teacher(), args=args(tmp_path), train_dataset=stream,
                        data_collator=collate)
    assert len(list(stream)) == 8  # with a teacher nothing had to be read: every row is still there


# ---------------------------------------------------------------- two processes


def _worker_run(out: Path, cache_dir: Path | None, per_device_batch: int) -> dict:
    """Cached (teacher_model=None) when cache_dir is given, else online; kd + a pkd term on layer 2."""
    teacher, data = make_teacher(), token_dataset(48, seed=5)  # variable lengths: padded batches
    a = args(out, per_device_train_batch_size=per_device_batch, max_steps=3, optim="sgd", learning_rate=0.5,
             distill_terms=["loss=pkd_loss,layers=1:2,weight=2"])
    if cache_dir is not None:
        _ = a.device  # initialises the process group under torchrun: rank 0 computes, the other waits
        if a.process_index != 0:  # the key comes from rank 0: no other rank reads the teacher's weights

            def refuse(*_, **__):
                raise AssertionError(f"rank {a.process_index} hashed the teacher")

            teacher.state_dict = refuse
        data = cache_teacher_outputs(teacher, data, cache_dir=cache_dir, batch_size=16, hidden_layers=[2],
                                     progress=False)
        teacher = None
    trainer = DistillationTrainer(model=bert(2), teacher_model=teacher, args=a, train_dataset=data,
                                  data_collator=collate)
    trainer.train()
    result = {"student": flat_params(trainer.model).tolist(), "world_size": trainer.accelerator.num_processes}
    if trainer.accelerator.is_main_process:
        (out / "result.json").write_text(json.dumps(result))
    return result


@pytest.mark.distributed
def test_two_processes_with_cache_match_one_online(tmp_path):
    with socket.socket() as sock:  # torchrun has no "any free port" option for a standalone master
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    # The workers run this file as a script: put this checkout's package first, not an installed copy's.
    root = str(Path(__file__).resolve().parents[1])
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": pythonpath}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
           __file__, str(tmp_path / "ddp"), str(tmp_path / "cache")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ddp = json.loads((tmp_path / "ddp" / "result.json").read_text())
    assert len(list((tmp_path / "cache").iterdir())) == 1  # computed once, by rank 0
    single = _worker_run(tmp_path / "single", None, per_device_batch=8)
    assert ddp["world_size"] == 2 and single["world_size"] == 1
    torch.testing.assert_close(torch.tensor(ddp["student"]), torch.tensor(single["student"]), atol=1e-5, rtol=0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    _worker_run(target, Path(sys.argv[2]), per_device_batch=4)
    from helpers import leave_distributed_run

    leave_distributed_run()  # no interpreter teardown, where a gloo rank can abort under load after a correct run


# ---------------------------------------------------------------- padding side, collators, heads


def _left_collate(features):
    """Left padding (decoders batch this way), with MLM-style labels read from the rows' `label` column."""
    length = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, length - n :] = torch.as_tensor(f["input_ids"])
        mask[i, length - n :] = 1
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    batch["row_label"] = torch.tensor([int(f["label"]) for f in features])  # reads a column the teacher does not
    return batch


@pytest.mark.slow
def test_token_level_cache_lines_up_with_left_padding(tmp_path):
    """Cached rows hold only real tokens; they must land on the batch's real tokens whatever its padding side."""
    data = token_dataset(8)
    student, teacher = _mlm(0), _mlm(1)

    def first_kd(teacher_model, rows):
        trainer = DistillationTrainer(model=copy.deepcopy(student), teacher_model=teacher_model,
                                      args=args(tmp_path / "run", max_steps=1, per_device_train_batch_size=8),
                                      train_dataset=rows, data_collator=_left_collate)
        trainer.train()
        return next(r for r in trainer.state.log_history if "loss" in r)["loss_kd"]

    cached = cache_teacher_outputs(teacher, data, cache_dir=tmp_path / "c", collator=_left_collate, progress=False)
    online = first_kd(teacher, data)
    assert first_kd(None, cached) == pytest.approx(online, rel=1e-5)
    assert first_kd(None, [dict(r) for r in cached]) == pytest.approx(online, rel=1e-5)


def test_question_answering_teachers_cannot_be_cached_and_say_so(tmp_path):
    from transformers import BertForQuestionAnswering

    qa = BertForQuestionAnswering(bert_config(layers=2))
    with pytest.raises(ValueError, match="question-answering teachers"):
        cache_teacher_outputs(qa, token_dataset(4).remove_columns("label"), cache_dir=tmp_path, progress=False)


def test_eval_set_without_cached_columns_is_refused_before_training(tmp_path):
    data = token_dataset(8)
    cached = cache_teacher_outputs(make_teacher(), data, cache_dir=tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match=r"evaluation \(eval\) dataset"):
        DistillationTrainer(model=bert(2), teacher_model=None, args=args(tmp_path, eval_with_teacher=True),
                            train_dataset=cached, eval_dataset=data, data_collator=collate)
