"""transformers' own collators and `datasets` formats in place of the padded rows the other tests feed: the same
sequences give the same KD and task terms and the same training (1e-6)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from helpers import VOCAB, args, flat_params, llama
from transformers import DataCollatorWithFlattening

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


def _components(trainer, batch: dict, train: bool) -> dict[str, float]:
    trainer.model.train(train)
    trainer.distiller.tracker.reset()
    if train:
        with torch.no_grad():
            trainer.compute_loss(trainer.model, dict(batch))
        return trainer.distiller.tracker.pop_means()
    settings, out = trainer.settings, {}
    weights = (settings.kd_weight, settings.task_weight)
    for name, kd, task in (("kd", 1.0, 0.0), ("task", 0.0, 1.0)):
        settings.set("kd_weight", kd), settings.set("task_weight", task)
        with torch.no_grad():
            out[name] = float(trainer.compute_loss(trainer.model, dict(batch)))
    settings.set("kd_weight", weights[0]), settings.set("task_weight", weights[1])
    return out


@pytest.mark.parametrize("kd_token_mask", ["labels", "attention"])
def test_flattening_collator_equals_padded_rows(tmp_path, kd_token_mask):
    """DataCollatorWithFlattening (one row, position_ids restarting at 0, no attention mask): KD and task terms on the
    loss head (training) and whole logits (evaluation with the teacher) equal the padded rows'; no position across
    a boundary counted."""
    flat = _trainer(tmp_path, "flat", DataCollatorWithFlattening(), kd_token_mask=kd_token_mask)
    pad = _trainer(tmp_path, "pad", _padded, kd_token_mask=kd_token_mask)
    fb, pb = next(iter(flat.get_train_dataloader())), next(iter(pad.get_train_dataloader()))
    assert fb["input_ids"].shape[0] == 1 and "attention_mask" not in fb and "position_ids" in fb
    for train in (True, False):
        got, ref = _components(flat, fb, train), _components(pad, pb, train)
        assert got["kd"] == pytest.approx(ref["kd"], rel=1e-6, abs=1e-7)
        assert got["task"] == pytest.approx(ref["task"], rel=1e-6, abs=1e-7)


def test_flattening_collator_trains_as_padded_rows_with_accumulation(tmp_path):
    """Two optimizer steps of two micro-batches each (rows of unequal lengths): the same weights as padded rows."""
    runs = {}
    for name, collator in (("flat", DataCollatorWithFlattening()), ("pad", _padded)):
        t = _trainer(tmp_path, name, collator, gradient_accumulation_steps=2, per_device_train_batch_size=2)
        t.train()
        runs[name] = flat_params(t.model)
    assert (runs["flat"] - flat_params(llama(0))).abs().max() > 1e-5
    assert torch.allclose(runs["flat"], runs["pad"], atol=1e-6, rtol=0)
