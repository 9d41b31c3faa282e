"""MLM masking for general distillation (DistilBERT's prepare_batch_mlm) and corpus token counts."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from datasets import Dataset
from helpers import VOCAB, args, bert_config
from transformers import BertForMaskedLM, BertTokenizer

from hf_distill import DistillationTrainer, losses
from hf_distill.data.collators import MLMDistillationCollator, TeacherOutputsCollator, token_counts

# [PAD] is not id 0, so padding really uses the tokenizer's pad id.
TOKENS = ["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]
PAD, CLS, SEP, MASK = 1, 2, 3, 4


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    (folder / "vocab.txt").write_text("\n".join(TOKENS) + "\n")
    tok = BertTokenizer.from_pretrained(str(folder))
    assert (tok.pad_token_id, tok.mask_token_id, len(tok)) == (PAD, MASK, VOCAB)
    return tok


def _rows(n: int, seed: int = 0, min_len: int = 4, max_len: int = 20, types: bool = False) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = [CLS] + torch.randint(5, VOCAB, (length - 2,), generator=g).tolist() + [SEP]
        row = {"input_ids": ids, "attention_mask": [1] * length}
        if types:
            row["token_type_ids"] = [0] * (length // 2) + [1] * (length - length // 2)
        rows.append(row)
    return rows


def test_masks_exactly_ceil_15_percent_of_real_tokens_never_pads_or_specials(tokenizer):
    collator = MLMDistillationCollator(tokenizer, seed=0)
    for seed in range(20):
        rows = _rows(8, seed=seed, types=True)
        batch = collator(rows)
        ids, labels, attn = batch["input_ids"], batch["labels"], batch["attention_mask"]
        real = sum(len(r["input_ids"]) for r in rows)
        selected = labels != -100
        assert int(selected.sum()) == math.ceil(0.15 * real)
        originals = torch.full_like(ids, PAD)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            originals[i, :n] = torch.tensor(r["input_ids"])
            assert attn[i].tolist() == [1] * n + [0] * (ids.shape[1] - n)
            assert batch["token_type_ids"][i, :n].tolist() == r["token_type_ids"]
        assert torch.equal(labels[selected], originals[selected])
        assert not (selected & ((originals == PAD) | (originals == CLS) | (originals == SEP))).any()
        assert torch.equal(ids[~selected], originals[~selected])  # only selected positions change
        assert (ids[attn == 0] == PAD).all()


def test_80_10_10_split_of_selected_positions(tokenizer):
    collator = MLMDistillationCollator(tokenizer, seed=1)
    masked = kept = other = 0
    for seed in range(60):
        rows = _rows(16, seed=seed, min_len=20, max_len=40)
        batch = collator(rows)
        sel = batch["labels"] != -100
        new, old = batch["input_ids"][sel], batch["labels"][sel]
        masked += int((new == MASK).sum())
        kept += int((new == old).sum())
        other += int(((new != MASK) & (new != old)).sum())
    total = masked + kept + other
    # A random token is uniform over the vocabulary, so it equals the original 1/V of the time (or [MASK]).
    expected = {"mask": 0.8 + 0.1 / VOCAB, "keep": 0.1 + 0.1 / VOCAB, "other": 0.1 * (1 - 2 / VOCAB)}
    for name, got in (("mask", masked), ("keep", kept), ("other", other)):
        q = expected[name]
        assert abs(got / total - q) < 4 * math.sqrt(q * (1 - q) / total), (name, got / total, q, total)


def test_token_frequency_smoothing(tokenizer):
    frequent, rare = 10, 11
    corpus = Dataset.from_dict({"input_ids": [[CLS] + [frequent] * 99 + [rare] + [SEP]] * 10})
    counts = token_counts(corpus, VOCAB)
    assert counts[frequent] == 990 and counts[rare] == 10 and counts[CLS] == 10 and counts.sum() == 1020
    collator = MLMDistillationCollator(tokenizer, mlm_probability=0.01, token_counts=counts, seed=0)
    w = collator.token_weights
    assert w[frequent] == pytest.approx(990**-0.7) and w[rare] == pytest.approx(10**-0.7)
    assert w[20] == 1.0  # unseen: count clamped to 1
    assert w[[PAD, CLS, SEP, MASK, 0]].eq(0).all()

    # Half the positions hold the frequent token, half the rare one; few draws per batch, so the share of
    # rare picks is the per-draw probability w_rare / (w_rare + w_frequent).
    rows = [{"input_ids": [frequent, rare] * 250}]
    picks = Counter()
    for _ in range(200):
        batch = collator(rows)
        picks.update(batch["labels"][batch["labels"] != -100].tolist())
    n = picks[frequent] + picks[rare]
    assert n == 200 * 5
    q = w[rare].item() / (w[rare].item() + w[frequent].item())
    assert abs(picks[rare] / n - q) < 4 * math.sqrt(q * (1 - q) / n) + 0.002, (picks[rare] / n, q)

    uniform = MLMDistillationCollator(tokenizer, mlm_probability=0.01, seed=0)
    flat = Counter()
    for _ in range(200):
        batch = uniform(rows)
        flat.update(batch["labels"][batch["labels"] != -100].tolist())
    assert abs(flat[rare] / 1000 - 0.5) < 4 * math.sqrt(0.25 / 1000)


def test_token_counts_on_views_and_plain_rows():
    rows = _rows(30, seed=3)
    data = Dataset.from_list(rows).shuffle(seed=0).select(range(12))
    expected = Counter(i for r in data for i in r["input_ids"])
    counts = token_counts(data, VOCAB)
    assert {i: int(c) for i, c in enumerate(counts) if c} == dict(expected)
    assert torch.equal(token_counts(list(data), VOCAB), counts)
    with pytest.raises(ValueError, match="outside"):
        token_counts([{"input_ids": [VOCAB]}], VOCAB)


def test_seeded_masks(tokenizer):
    rows = _rows(8, seed=5)
    a = [MLMDistillationCollator(tokenizer, seed=7)(rows) for _ in range(2)]
    b = MLMDistillationCollator(tokenizer, seed=8)(rows)
    torch.manual_seed(123)  # the global RNG plays no part
    c = MLMDistillationCollator(tokenizer, seed=7)(rows)
    for key in ("input_ids", "labels"):
        assert torch.equal(a[0][key], a[1][key]) and torch.equal(a[0][key], c[key])
    assert not torch.equal(a[0]["labels"], b["labels"])
    collator = MLMDistillationCollator(tokenizer, seed=7)
    assert not torch.equal(collator(rows)["labels"], collator(rows)["labels"])  # a new draw per batch


def test_padding_options(tokenizer):
    tokenizer.padding_side = "left"
    try:
        rows = _rows(3, seed=2, max_len=9)
        batch = MLMDistillationCollator(tokenizer, pad_to_multiple_of=8)(rows)
        assert batch["input_ids"].shape[1] % 8 == 0 and set(batch) == {"input_ids", "attention_mask", "labels"}
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            assert batch["attention_mask"][i, -n:].all() and not batch["attention_mask"][i, :-n].any()
            assert batch["labels"][i, :-n].eq(-100).all()
    finally:
        tokenizer.padding_side = "right"
    with pytest.raises(ValueError, match="mask_prob"):
        MLMDistillationCollator(tokenizer, mask_prob=0.95, random_prob=0.1)


def test_cached_teacher_outputs_are_refused(tokenizer):
    rows = [{**r, "teacher_logits": [[0.0] * VOCAB] * len(r["input_ids"])} for r in _rows(2)]
    with pytest.raises(ValueError, match="MLM masking"):
        TeacherOutputsCollator(MLMDistillationCollator(tokenizer))(rows)


def test_transformers_mlm_collator_with_cached_teacher_outputs_is_refused(tokenizer, tmp_path):
    """transformers' DataCollatorForLanguageModeling(mlm=True) masks every batch anew, as
    MLMDistillationCollator does: cached teacher outputs (computed on the unmasked rows) are refused with it, when
    cached and when training; mlm=False leaves the inputs alone and is let through."""
    from transformers import DataCollatorForLanguageModeling

    from hf_distill.data.cache import cache_teacher_outputs

    rows = [{**r, "teacher_logits": [[0.0] * VOCAB] * len(r["input_ids"])} for r in _rows(2)]
    for masking in (DataCollatorForLanguageModeling(tokenizer, mlm=True),):
        with pytest.raises(ValueError, match="DataCollatorForLanguageModeling changes the inputs of every batch"):
            TeacherOutputsCollator(masking)(rows)
        with pytest.raises(ValueError, match="changes the inputs of every batch"):
            cache_teacher_outputs(BertForMaskedLM(bert_config(layers=1)), Dataset.from_list(_rows(2)),
                                  cache_dir=tmp_path / "cache", collator=masking, progress=False)
    assert not (tmp_path / "cache").exists()
    student = BertForMaskedLM(bert_config(layers=1))
    trainer = DistillationTrainer(model=student, args=args(tmp_path / "run", max_steps=1),
                                  train_dataset=Dataset.from_list(rows),
                                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=True))
    before = [p.detach().clone() for p in student.parameters()]
    with pytest.raises(ValueError, match="changes the inputs of every batch"):
        trainer.train()  # at the first batch: no step taken
    assert trainer.state.global_step == 0 and all(torch.equal(a, b) for a, b in zip(before, student.parameters()))
    batch = TeacherOutputsCollator(DataCollatorForLanguageModeling(tokenizer, mlm=False))(rows)
    assert batch["teacher_logits"].shape[:2] == batch["input_ids"].shape


@pytest.mark.parametrize("kd_token_mask", ["labels", "attention"])
@pytest.mark.parametrize("masking", ["ours", "transformers"])
def test_kd_loss_over_masked_positions_with_the_trainer(tmp_path, tokenizer, kd_token_mask, masking):
    """The teacher reads the student's masked inputs; `kd_token_mask="labels"` counts the masked positions only,
    `"attention"` every real token; with transformers' DataCollatorForLanguageModeling(mlm=True) as with ours."""
    from transformers import DataCollatorForLanguageModeling

    torch.manual_seed(0)
    student = BertForMaskedLM(bert_config(layers=2))
    teacher = BertForMaskedLM(bert_config(layers=3))
    a = args(tmp_path, kd_token_mask=kd_token_mask, kd_weight=1.0, task_weight=0.5, temperature=2.0)
    collator = (MLMDistillationCollator(tokenizer, seed=0) if masking == "ours"
                else DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.3))
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=a, data_collator=collator)
    assert isinstance(trainer.data_collator, TeacherOutputsCollator)
    batch = trainer.data_collator(_rows(6, seed=9))
    masked = batch["labels"] != -100
    assert masked.any() and (~masked & (batch["attention_mask"] == 1)).any()  # both kinds of real position
    trainer.compute_loss(student.train(), dict(batch))
    got = trainer.tracker.pop_means()
    model_inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        t = teacher(**model_inputs).logits
        s = student(**model_inputs).logits
    mask = batch["labels"] != -100 if kd_token_mask == "labels" else batch["attention_mask"]
    assert got["kd"] == pytest.approx(losses.kl_div(s, t, 2.0, mask=mask).item(), rel=1e-5)
    mlm = torch.nn.functional.cross_entropy(s.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=-100)
    assert got["task"] == pytest.approx(mlm.item(), rel=1e-5)  # the student's own MLM loss on the masked tokens


def test_batch_of_special_tokens_only_is_left_unmasked(tokenizer):
    rows = [{"input_ids": [tokenizer.cls_token_id, tokenizer.sep_token_id]} for _ in range(3)]
    batch = MLMDistillationCollator(tokenizer, seed=0)(rows)
    assert (batch["labels"] == -100).all()
    assert batch["input_ids"].tolist() == [[tokenizer.cls_token_id, tokenizer.sep_token_id]] * 3


def test_column_remover_keeps_teacher_columns_and_drops_the_rest(caplog):
    """The Trainer's row-by-row column filter (datasets other than datasets.Dataset) keeps cached outputs."""
    import logging

    from hf_distill.data.collators import KeepTeacherColumnsCollator

    seen = []
    logger = logging.getLogger("test_column_remover")
    remover = KeepTeacherColumnsCollator(seen.append, ["input_ids", "labels"], logger=logger, model_name="Student",
                                         description="training")
    rows = [{"input_ids": [2, 5], "labels": 1, "id": "a", "teacher_logits": [0.1, 0.2], "teacher_hidden_2": [[0.0]]}]
    with caplog.at_level(logging.INFO, logger="test_column_remover"):
        remover(rows)
        remover(rows)
    assert seen[0] == [{"input_ids": [2, 5], "labels": 1, "teacher_logits": [0.1, 0.2], "teacher_hidden_2": [[0.0]]}]
    assert seen[1] == seen[0]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and " id " in messages[0] and "teacher_" in messages[0]  # logged once, names `id`
    assert "teacher_logits" not in messages[0] and "teacher_hidden" not in messages[0]


def test_the_trainers_collators_pickle_for_spawned_dataloader_workers(tmp_path, tokenizer):
    """`dataloader_num_workers > 0` where workers are spawned (macOS, Windows) pickles the collate function: the
    trainer's wrapped collator (cached teacher columns kept through the row-by-row column filter) and the MLM
    collator survive it and collate as before."""
    import pickle

    from helpers import bert
    from transformers import DataCollatorWithPadding

    rows = [{**r, "label": 1, "teacher_logits": [0.5, -0.5], "id": "x"} for r in _rows(4)]  # a 2-class student
    trainer = DistillationTrainer(model=bert(1), teacher_model=None, train_dataset=rows, args=args(tmp_path),
                                  data_collator=DataCollatorWithPadding(tokenizer))
    collate = trainer.get_train_dataloader().collate_fn
    mlm = MLMDistillationCollator(tokenizer, seed=3)
    for fn, data in ((collate, rows), (mlm, _rows(4))):
        again = pickle.loads(pickle.dumps(fn))
        want, got = fn(data), again(data)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert "teacher_logits" in collate(rows) and "id" not in collate(rows)
