"""transformers' own collators and `datasets` formats in place of the padded rows the other tests feed: the same
sequences give the same KD and task terms and the same training (1e-6)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from helpers import VOCAB, args, bert_config, flat_params, llama, loss_components, word_tokenizer
from transformers import (
    BertForTokenClassification,
    DataCollatorForLanguageModeling,
    DataCollatorForTokenClassification,
    DataCollatorWithFlattening,
)

from hf_distill import DistillationTrainer

LENGTHS = (5, 9, 3, 7, 6, 4, 8, 5)


def _rows() -> Dataset:
    g = torch.Generator().manual_seed(0)
    return Dataset.from_list([{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in LENGTHS])


def _padded(features: list[dict]) -> dict:
    """Right-padded rows, labels = input ids (-100 on padding): the form the rest of the suite tests."""
    width = max(len(f["input_ids"]) for f in features)
    out = {"input_ids": torch.zeros(len(features), width, dtype=torch.long),
           "attention_mask": torch.zeros(len(features), width, dtype=torch.long),
           "labels": torch.full((len(features), width), -100)}
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        out["input_ids"][i, :n] = out["labels"][i, :n] = torch.tensor(f["input_ids"])
        out["attention_mask"][i, :n] = 1
    return out


def _trainer(tmp_path, name, collator, **kw):
    a = args(tmp_path / name, **{"per_device_train_batch_size": 4, "max_steps": 2, "eval_with_teacher": True, **kw})
    return DistillationTrainer(model=llama(0), teacher_model=llama(1, layers=3), args=a, train_dataset=_rows(),
                               data_collator=collator)


@pytest.mark.parametrize("kd_token_mask", ["labels", "attention"])
def test_flattening_collator_equals_padded_rows(tmp_path, kd_token_mask):
    """DataCollatorWithFlattening (one row, position_ids restarting at 0, no attention mask) and
    DataCollatorForLanguageModeling(mlm=False, pad_to_multiple_of=8): KD and task terms on the loss head (training)
    and whole logits (evaluation with the teacher) equal the padded rows'; no position across a boundary, and no
    extra padded position, counted."""
    lm = DataCollatorForLanguageModeling(word_tokenizer([str(i) for i in range(VOCAB - 2)]), mlm=False,
                                         pad_to_multiple_of=8)
    pad = _trainer(tmp_path, "pad", _padded, kd_token_mask=kd_token_mask)
    pb = next(iter(pad.get_train_dataloader()))
    for name, collator in (("flat", DataCollatorWithFlattening()), ("lm8", lm)):
        other = _trainer(tmp_path, name, collator, kd_token_mask=kd_token_mask)
        ob = next(iter(other.get_train_dataloader()))
        if name == "flat":
            assert ob["input_ids"].shape[0] == 1 and "attention_mask" not in ob and "position_ids" in ob
        else:
            assert ob["input_ids"].shape[1] % 8 == 0 and ob["input_ids"].shape[1] > pb["input_ids"].shape[1]
        for train in (True, False):
            got, ref = loss_components(other, ob, train), loss_components(pad, pb, train)
            assert got["kd"] == pytest.approx(ref["kd"], rel=1e-6, abs=1e-7), (name, train)
            assert got["task"] == pytest.approx(ref["task"], rel=1e-6, abs=1e-7), (name, train)


def test_flattening_collator_trains_as_padded_rows_with_accumulation(tmp_path):
    """Two optimizer steps of two micro-batches each (rows of unequal lengths): the same weights as padded rows."""
    runs = {}
    for name, collator in (("flat", DataCollatorWithFlattening()), ("pad", _padded)):
        t = _trainer(tmp_path, name, collator, gradient_accumulation_steps=2, per_device_train_batch_size=2)
        t.train()
        runs[name] = flat_params(t.model)
    assert (runs["flat"] - flat_params(llama(0))).abs().max() > 1e-5
    assert torch.allclose(runs["flat"], runs["pad"], atol=1e-6, rtol=0)


# ---------------------------------------------------------------- token classification: collator padding, dataset forms

ROWS = 8  # one batch holds every row, so a run does not depend on the order the rows come in


def _tagged() -> Dataset:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 12, (ROWS,), generator=g).tolist()
    return Dataset.from_list([{"input_ids": torch.randint(2, VOCAB, (n,), generator=g).tolist(),
                               "labels": torch.randint(0, 3, (n,), generator=g).tolist(), "source": f"doc {i}"}
                              for i, n in enumerate(lengths)])


def _as_transform(data: Dataset) -> Dataset:
    """The rows stored as text ("ids"/"tags" strings), turned into model inputs on access by `with_transform`."""
    stored = Dataset.from_dict({"ids": [" ".join(map(str, r)) for r in data["input_ids"]],
                                "tags": [" ".join(map(str, r)) for r in data["labels"]], "source": data["source"]})

    def to_inputs(batch: dict) -> dict:
        return {"input_ids": [[int(x) for x in s.split()] for s in batch["ids"]],
                "labels": [[int(x) for x in s.split()] for s in batch["tags"]]}

    return stored.with_transform(to_inputs)


def _token_run(tmp_path, name: str, data, collator, **kw) -> tuple[torch.Tensor, dict]:
    a = args(tmp_path / name, per_device_train_batch_size=ROWS, max_steps=2, **kw)
    student = BertForTokenClassification(_seeded(bert_config(layers=1, labels=3), 0))
    trainer = DistillationTrainer(model=student, teacher_model=BertForTokenClassification(
        _seeded(bert_config(layers=2, labels=3), 1)), args=a, train_dataset=data, data_collator=collator)
    trainer.train()
    logged = {k: v for k, v in trainer.state.log_history[1].items() if k in ("loss_kd", "loss_task")}
    return flat_params(trainer.model), logged


def _seeded(config, seed: int):
    torch.manual_seed(seed)
    return config


@pytest.fixture(scope="module")
def token_reference(tmp_path_factory):
    """Two steps on a plain datasets.Dataset through DataCollatorForTokenClassification, and the student before."""
    tok = word_tokenizer([str(i) for i in range(VOCAB - 2)])
    plain = DataCollatorForTokenClassification(tok)
    start = flat_params(BertForTokenClassification(_seeded(bert_config(layers=1, labels=3), 0)))
    return tok, _token_run(tmp_path_factory.mktemp("ref"), "ref", _tagged().remove_columns("source"), plain), start


@pytest.mark.parametrize("form", ["pad_to_multiple_of_8", "torch_format", "with_transform", "iterable"])
def test_token_classification_forms_train_as_plain_rows(tmp_path, token_reference, form):
    """Token-classification KD with transformers' DataCollatorForTokenClassification on a plain datasets.Dataset is
    the reference; padding to a multiple of 8 (extra positions never counted), set_format("torch"), with_transform
    (remove_unused_columns=False, an extra string column dropped by the transform) and a datasets.IterableDataset
    with the teacher online and max_steps give the same two steps (1e-6) and the same logged terms."""
    tok, (ref, ref_logged), start = token_reference
    data, collator, kw = _tagged().remove_columns("source"), DataCollatorForTokenClassification(tok), {}
    if form == "pad_to_multiple_of_8":
        collator = DataCollatorForTokenClassification(tok, pad_to_multiple_of=8)
        assert collator([data[i] for i in range(ROWS)])["input_ids"].shape[1] % 8 == 0
    elif form == "torch_format":
        data = data.with_format("torch")
    elif form == "with_transform":
        data, kw = _as_transform(_tagged()), dict(remove_unused_columns=False)
    else:
        data = data.to_iterable_dataset()
    got, logged = _token_run(tmp_path, form, data, collator, **kw)
    assert (ref - start).abs().max() > 1e-5
    assert torch.allclose(got, ref, atol=1e-6, rtol=0)
    assert logged == pytest.approx(ref_logged, rel=1e-6, abs=1e-7) and set(logged) == {"loss_kd", "loss_task"}
