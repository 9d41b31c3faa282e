"""What ties a teacher signal to its rows (hf_distill.data.signal_format): the counted positions' hash that refuses
rows whose labels moved, the refusal of a signal of the previous format, and the advice for a stream that lost the
signal's metadata."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from helpers import VOCAB, args, labelled_collate, llama, sft_rows, word_tokenizer

from hf_distill import DistillationTrainer
from hf_distill.data.collators import TeacherOutputsCollator
from hf_distill.data.signal_format import counted_positions, padded_rows, positions_hashes, row_positions_hash
from hf_distill.data.teacher_signal import (
    SIGNAL_POSITIONS,
    attach_teacher_signal,
    create_teacher_signal,
    load_teacher_signal,
    signal_teacher,
    streamed,
)
from hf_distill.losses.normalise import kd_positions

K, T = 8, 2.0


def _tokenizer():
    return word_tokenizer([f"w{i}" for i in range(VOCAB - 2)])


def _signal(folder, rows):
    return create_teacher_signal(llama(1), rows, folder, tokenizer=_tokenizer(), k=K, temperature=T, rows_per_shard=4,
                                 batch_size=4, progress=False)


def _trainer(tmp_path, train):
    return DistillationTrainer(model=llama(0), teacher_model=None, train_dataset=train, data_collator=labelled_collate,
                               args=args(tmp_path, temperature=T, max_steps=1, per_device_train_batch_size=8),
                               processing_class=_tokenizer())


def _moved(rows: datasets.Dataset, row: int) -> datasets.Dataset:
    """Row `row` with its prompt/completion boundary one token earlier and its last token no longer learnt: the same
    input_ids and the same number of counted positions, each one position earlier."""
    def move(r, i):
        if i != row:
            return r
        prompt = r["labels"].index(next(x for x in r["labels"] if x != -100))
        ids = r["input_ids"]
        return {"labels": [-100] * (prompt - 1) + ids[prompt - 1 : -1] + [-100]}

    return rows.map(move, with_indices=True)


def _counted(rows):
    return [int(kd_positions(None, torch.tensor([r["labels"]]), "labels", causal=True).sum()) for r in rows]


def test_rows_whose_labels_moved_are_refused_when_joined_built_and_batched(tmp_path):
    rows = sft_rows(8)
    signal = _signal(tmp_path / "signal", rows)
    moved = _moved(rows, 5)
    assert moved["input_ids"] == rows["input_ids"] and _counted(moved) == _counted(rows)
    assert moved[5]["labels"] != rows[5]["labels"]
    with pytest.raises(ValueError, match="Row 5 of the rows has the signal's input_ids but other counted positions"):
        attach_teacher_signal(moved, signal)
    forced = datasets.concatenate_datasets([moved, signal], axis=1)  # the join's check bypassed
    with pytest.raises(ValueError, match="Row 5 of the train dataset has the signal's input_ids but other counted"):
        _trainer(tmp_path / "built", forced)
    # A stream is checked on its first row when the trainer is built, then on every batch, before the loss.
    trainer = _trainer(tmp_path / "stream", streamed(forced))
    with pytest.raises(ValueError, match="Row 5 of this batch counts as many KD positions as its teacher signal but"):
        trainer.train()
    assert trainer.state.global_step == 0
    _trainer(tmp_path / "ok", attach_teacher_signal(rows, signal))  # the rows it was made from


def _left_padded(batch: dict) -> dict:
    """The right-padded batch with each row's padding moved to its left (ids, mask, labels)."""
    out = {k: v.clone() for k, v in batch.items()}
    for i, n in enumerate(batch["attention_mask"].sum(-1).tolist()):
        for name in ("input_ids", "attention_mask", "labels"):
            out[name][i] = batch[name][i].roll(batch[name].shape[1] - n)
    return out


def test_the_positions_hash_does_not_depend_on_the_padding_side(tmp_path):
    rows = sft_rows(8)
    joined = attach_teacher_signal(rows, _signal(tmp_path / "signal", rows))
    right = TeacherOutputsCollator(labelled_collate)([joined[i] for i in range(len(joined))])
    cached = {k: right.pop(k) for k in list(right) if k.startswith("teacher_")}
    left = _left_padded(right)
    assert not torch.equal(left["attention_mask"], right["attention_mask"])
    got = [signal_teacher(cached, batch, "labels", "labels") for batch in (right, left)]
    at = [kd_positions(b["attention_mask"], b["labels"], "labels", causal=True) for b in (right, left)]
    for a, b in zip(got[0], got[1], strict=True):
        assert torch.equal(a[:, :-1][at[0]], b[:, :-1][at[1]])
    # A collator that moves one row's labels by a position is refused on the batch.
    shifted = dict(left, labels=left["labels"].clone())
    shifted["labels"][2] = left["labels"][2].roll(-1)
    shifted["labels"][2, -1] = -100
    with pytest.raises(ValueError, match="Row 2 of this batch counts as many KD positions"):
        signal_teacher(cached, shifted, "labels", "labels")


@pytest.mark.parametrize("mode", ["labels", "attention"])
@pytest.mark.parametrize("columns", [("labels", "attention_mask"), ("labels",), ("attention_mask",), ()])
def test_the_per_row_positions_hash_is_the_batch_rules(mode, columns):
    """Rows are checked one at a time (no padding into a batch: cheap over a whole dataset); their hash must be the
    one the signal stores, made by kd_positions on the padded batch: rows of other lengths, masks with leading
    padding, all-masked labels, empty and one-token rows."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in (0, 1, 2, 5, 9, 9, 13):
        lead = int(torch.randint(0, 3, (1,), generator=g)) if n > 3 else 0
        labels = torch.randint(5, VOCAB, (n,), generator=g)
        labels[torch.rand(n, generator=g) < 0.4] = -100
        rows.append({"input_ids": list(range(5, 5 + n)), "labels": labels.tolist(),
                     "attention_mask": [0] * lead + [1] * (n - lead)})
    rows.append({"input_ids": [5, 6, 7], "labels": [-100, -100, -100], "attention_mask": [1, 1, 1]})
    rows = [{k: v for k, v in r.items() if k == "input_ids" or k in columns} for r in rows]
    batch = {c: [r[c] for r in rows] for c in rows[0]}
    _, mask, labels = padded_rows(batch)
    want = positions_hashes(counted_positions(mask, labels, mode), mask)
    assert [row_positions_hash(r, mode) for r in rows] == want
    assert len(set(want)) > 3  # the rows differ, and so do their hashes


def test_a_signal_of_the_previous_format_is_refused_naming_the_fix(tmp_path):
    """Signals written before the positions hash (format 1) are refused wherever they are read, not trained
    from with their rows' labels unchecked."""
    rows = sft_rows(8)
    signal = _signal(tmp_path / "signal", rows)
    meta_path = tmp_path / "signal" / "teacher_signal.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "format": 1}))
    recreate = r"has format 1, this hf_distill reads format 2 .*: create the signal again with this version"
    with pytest.raises(ValueError, match=recreate):
        load_teacher_signal(tmp_path / "signal")
    old = signal.remove_columns(SIGNAL_POSITIONS)
    old.info.description = old.info.description.replace('"format": 2', '"format": 1')
    with pytest.raises(ValueError, match=recreate):
        attach_teacher_signal(rows, old)
    with pytest.raises(ValueError, match=recreate):
        _trainer(tmp_path, datasets.concatenate_datasets([rows, old], axis=1))
    with pytest.raises(ValueError, match="format differ: format: 1 there, 2 now.*delete that folder"):  # not resumed
        _signal(tmp_path / "signal", rows)


def test_a_stream_that_lost_the_signals_metadata_is_told_to_use_streamed(tmp_path):
    rows = sft_rows(8)
    joined = attach_teacher_signal(rows, _signal(tmp_path / "signal", rows))
    with pytest.raises(ValueError, match=r"without the signal's metadata .*teacher_signal.streamed\("):
        _trainer(tmp_path, joined.with_format(None).to_iterable_dataset())
    _trainer(tmp_path, streamed(joined))


def test_entry_checks_read_adaptive_padding_as_padding_and_refuse_it_misplaced():
    """Adaptive k (format 4) pads a position past its count with id -1 and -inf: read as intact, however many pads;
    a pad before an id, or a pad with a probability, is damage."""
    from hf_distill.data.signal_format import check_signal_entries

    inf = float("-inf")
    values = torch.tensor([[-0.1, -1.0, inf, inf], [-0.2, -0.5, -0.9, -2.0]])
    ids = torch.tensor([[5, 7, -1, -1], [1, 2, 3, 4]])
    tails, rows = torch.tensor([-3.0, -4.0]), torch.tensor([0, 1])
    check_signal_entries(values, ids, tails, rows)  # intact
    with pytest.raises(ValueError, match=r"Row 1 of this batch reads a damaged teacher signal \(padding before an id"):
        check_signal_entries(values, torch.tensor([[5, 7, -1, -1], [1, -1, 3, 4]]), tails, rows)
    with pytest.raises(ValueError, match="padding with a probability"):
        check_signal_entries(torch.tensor([[-0.1, -1.0, -2.0, inf], values[1].tolist()]), ids, tails, rows)
