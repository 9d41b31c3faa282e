"""Token-level terms are normalised over the whole optimizer step: gradient accumulation with rows of different
lengths gives the big batch's update (the 2-process DDP counterpart is in tests/test_distributed.py)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from helpers import VOCAB, args, bert, bert_config, collate, flat_params, labelled_collate, llama, token_dataset
from helpers import teacher as make_teacher
from transformers import BertForMaskedLM

from hf_distill import DistillationTrainer
from hf_distill.losses.normalise import COUNT_KINDS, StepCounts, batch_counts, kd_positions, same_sequence


def _labelled_rows(n=32, seed=0, causal=False):
    """Rows of 3-14 tokens with labels on some positions only (-100 elsewhere): MLM targets or SFT completions."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, 15, (1,), generator=g))
        ids = torch.randint(5, VOCAB, (length,), generator=g).tolist()
        if causal:
            prompt = int(torch.randint(1, length - 1, (1,), generator=g))
            labels = [-100] * prompt + ids[prompt:]
        else:
            keep = torch.rand(length, generator=g) < 0.4
            keep[0] = True
            labels = [i if k else -100 for i, k in zip(ids, keep.tolist(), strict=True)]
        rows.append({"input_ids": ids, "labels": labels})
    return Dataset.from_list(rows)


def _mlm(seed, layers):
    torch.manual_seed(seed)
    return BertForMaskedLM(bert_config(layers=layers))


def _pair(tmp_path, make_student, make_teacher_, data, collator, **kw):
    common = dict(max_steps=2, optim="sgd", learning_rate=0.5, temperature=2.0, **kw)
    runs = []
    for name, extra in (("big", dict(per_device_train_batch_size=8)),
                        ("acc", dict(per_device_train_batch_size=4, gradient_accumulation_steps=2))):
        trainer = DistillationTrainer(model=make_student(), teacher_model=make_teacher_(),
                                      args=args(tmp_path / name, **common, **extra), train_dataset=data,
                                      data_collator=collator)
        trainer.train()
        runs.append(trainer)
    return runs


def _assert_same(big, acc, keys):
    torch.testing.assert_close(flat_params(acc.model), flat_params(big.model), atol=1e-6, rtol=0)
    logs = [[r for r in t.state.log_history if "loss" in r] for t in (big, acc)]
    for a, b in zip(*logs, strict=True):
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-5), key


@pytest.mark.slow
def test_intermediate_terms_of_different_lengths_match_one_big_batch(tmp_path):
    terms = ["loss=hidden_mse,layers=uniform", "loss=attention_score_mse,layers=uniform",
             "loss=cosine_loss,layers=last,name=cos"]
    big, acc = _pair(tmp_path, lambda: bert(2, hidden=16, seed=0), lambda: make_teacher(), token_dataset(32),
                     collate, distill_terms=terms)
    _assert_same(big, acc, ("loss", "loss_kd", "loss_task", "loss_hidden", "loss_attention",
                            "loss_cos"))


@pytest.mark.slow
@pytest.mark.parametrize("token_mask", ["labels", "attention"])
def test_masked_lm_kd_and_task_loss_match_one_big_batch(tmp_path, token_mask):
    big, acc = _pair(tmp_path, lambda: _mlm(0, 2), lambda: _mlm(1, 3), _labelled_rows(32), labelled_collate,
                     kd_token_mask=token_mask)
    _assert_same(big, acc, ("loss", "loss_kd", "loss_task"))


@pytest.mark.slow
def test_causal_lm_kd_and_task_loss_match_one_big_batch(tmp_path):
    big, acc = _pair(tmp_path, lambda: llama(0, 2), lambda: llama(1, 3), _labelled_rows(32, causal=True),
                     labelled_collate, kd_token_mask="labels")
    _assert_same(big, acc, ("loss", "loss_kd", "loss_task"))


def test_batch_counts_follow_the_masks_each_term_uses():
    batch = {
        "input_ids": torch.ones(2, 4, dtype=torch.long),
        "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
        "labels": torch.tensor([[-100, 5, 6, -100], [7, -100, -100, -100]]),
    }
    counts = dict(zip(COUNT_KINDS, batch_counts(batch, "labels", "labels", causal=False).tolist(), strict=True))
    # causal_pairs: key <= query among real tokens (decoder attention scores), n(n+1)/2 per row
    assert counts == {"tokens": 5, "pairs": 9 + 4, "labels": 3, "kd": 3, "causal_pairs": 6 + 3,
                      "decoder_tokens": 0, "decoder_causal_pairs": 0}  # not an encoder-decoder batch
    causal = dict(zip(COUNT_KINDS, batch_counts(batch, "labels", "attention", causal=True).tolist(), strict=True))
    # next-token positions: labels[:, 1:] != -100 -> 2; both t and t+1 real -> 2 + 1
    assert causal["labels"] == 2 and causal["kd"] == 3


@pytest.mark.parametrize(("mode", "expected"), [("attention", [1, 1, 0, 1, 0, 1, 1, 1]),
                                              ("labels", [1, 1, 0, 1, 0, 0, 1, 1])])
def test_packed_rows_count_no_position_across_sequences(mode, expected):
    """A padding-free row packing sequences of 3, 2 and 4 tokens (position_ids restart at 0): a causal KD term counts
    no position whose next token starts another sequence, even where that token's label is not -100 (t = 2), and
    batch_counts counts what kd_positions selects."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    batch = {"input_ids": torch.ones(1, 9, dtype=torch.long), "position_ids": pos,
             "labels": torch.tensor([[-100, 5, 6, 4, 7, -100, -100, 8, 9]])}
    got = kd_positions(None, batch["labels"], mode, causal=True, position_ids=pos)
    assert got.int().tolist() == [expected]
    counts = dict(zip(COUNT_KINDS, batch_counts(batch, "labels", mode, causal=True).tolist(), strict=True))
    assert counts["kd"] == sum(expected)
    unpacked = dict(zip(COUNT_KINDS, batch_counts({k: v for k, v in batch.items() if k != "position_ids"}, "labels",
                                                  mode, causal=True).tolist(), strict=True))
    assert unpacked["kd"] == {"attention": 8, "labels": 6}[mode]  # one long sequence: the boundaries count
    assert same_sequence(torch.arange(5)[None]).all() and same_sequence(None) is None
    assert kd_positions(None, None, "attention", causal=False, position_ids=pos) is None  # encoders: unchanged


def test_step_counts_scale_and_are_used_up_by_the_steps_micro_batches():
    step = StepCounts()
    assert not step.take()  # outside the training loop: no rescaling
    step.start(torch.tensor([10.0, 0.0, 4.0, 4.0, 0.0, 0.0, 0.0], dtype=torch.float64), micro_batches=2, processes=1)
    assert step.take() and step.take() and not step.take()
    assert step.scale("tokens", 3) == pytest.approx(3 * 2 / 10)
    assert step.scale("pairs", 3) == 0.0  # nothing counted in the whole step: the term contributes nothing


def test_token_labels_under_another_name_are_counted(tmp_path):
    """label_names=["tags"] for a token head: the task term is counted over `tags`, not silently zeroed."""
    data = _labelled_rows(16).rename_column("labels", "tags")

    def collator(features):
        batch = labelled_collate([{"input_ids": f["input_ids"], "labels": f["tags"]} for f in features])
        batch["tags"] = batch.pop("labels")
        return batch

    class TagsMLM(BertForMaskedLM):
        def forward(self, input_ids=None, attention_mask=None, tags=None, **kw):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=tags, **kw)

    torch.manual_seed(0)
    student = TagsMLM(bert_config(layers=2))
    trainer = DistillationTrainer(model=student, teacher_model=_mlm(1, 3),
                                  args=args(tmp_path, max_steps=1, per_device_train_batch_size=8,
                                            label_names=["tags"]),
                                  train_dataset=data, data_collator=collator)
    trainer.train()
    log = next(r for r in trainer.state.log_history if "loss" in r)
    assert log["loss_task"] > 1.0  # an MLM loss over 120 ids, not 0


def test_a_micro_batch_without_counted_labels_adds_nothing(tmp_path):
    """Rows whose labels are all -100: the model's own mean over no tokens is NaN; the term must add 0 instead."""
    rows = _labelled_rows(8).to_list()
    for r in rows:
        r["labels"] = [-100] * len(r["labels"])
    trainer = DistillationTrainer(model=_mlm(0, 2), teacher_model=_mlm(1, 3),
                                  args=args(tmp_path, max_steps=1, per_device_train_batch_size=4,
                                            gradient_accumulation_steps=2),
                                  train_dataset=Dataset.from_list(rows), data_collator=labelled_collate)
    trainer.train()
    log = next(r for r in trainer.state.log_history if "loss" in r)
    assert log["loss_task"] == 0.0 and log["loss_kd"] > 0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.parametrize("name, shape", [("pixel_values", (3, 3, 8, 8)), ("input_values", (3, 1600)),
                                         ("input_values", (3, 64, 16)), ("input_features", (3, 80, 30))],
                         ids=["image", "waveform", "ast-spectrogram", "whisper-features"])
def test_a_batch_without_a_token_mask_counts_its_rows(name, shape):
    """Images and unmasked audio: one unit per row for every term (zeros scaled their terms by 0 in train())."""
    counts = dict(zip(COUNT_KINDS, batch_counts({name: torch.zeros(shape), "labels": torch.tensor([0, 1, 2])},
                                                "labels", "all", causal=False).tolist(), strict=True))
    assert counts["tokens"] == 3 and counts["kd"] == 3
