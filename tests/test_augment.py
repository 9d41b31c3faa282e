"""TinyBERT data augmentation on a tiny random BERT MLM with a hand-written WordPiece vocabulary."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from datasets import ClassLabel, Dataset, Features, Value
from transformers import BertConfig, BertForMaskedLM, BertTokenizer

from hf_distill.data.augment import STOP_WORDS, Augmentor, WordEmbeddings, augment_dataset, masked_logits

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PUNCT = [".", ",", "!", "'", "7", "42"]
STOPS = ["the", "a", "is", "and", "of", "it", "not", "very", "this", "was", "s", "to"]
CONTENT = (
    "movie film story actor plot scene music ending script camera director hero villain dialogue "
    "good bad great dull funny sad bright dark slow fast boring clever lovely awful fresh stale "
    "wonder love hate enjoy watch laugh cry believe"
).split()
PIECES = ["##ful", "##ly", "##s", "##ing", "##believ", "##able", "un"]
VOCAB = SPECIAL + PUNCT + STOPS + CONTENT + PIECES
MULTI = ["wonderful", "unbelievable", "lovely"]  # the first two are several wordpieces; "lovely" is one


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return BertTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def mlm():
    torch.manual_seed(0)
    # A wide initialisation makes attention peaky, so the top-M really depends on the context.
    cfg = BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128, initializer_range=0.2)
    return BertForMaskedLM(cfg).eval()


def _sentence(rng: np.random.Generator) -> str:
    words = list(rng.choice(CONTENT, size=int(rng.integers(7, 11)), replace=False))
    for w in ("the", "is", "not", "7", ",", "It", "wonderful", "!"):  # stop words, a number, punctuation
        words.insert(int(rng.integers(0, len(words) + 1)), w)
    return " ".join(words)


def _dataset(rows: int, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    features = Features({"sentence": Value("string"), "label": ClassLabel(names=["neg", "pos"])})
    return Dataset.from_dict(
        {"sentence": [_sentence(rng) for _ in range(rows)], "label": [i % 2 for i in range(rows)]}, features=features
    )


def _groups(out: Dataset, per_row: int) -> list[list[dict]]:
    rows = out.to_list()
    assert len(rows) % per_row == 0
    return [rows[i : i + per_row] for i in range(0, len(rows), per_row)]


# ---------------------------------------------------------------- candidates


def test_words_follow_basic_tokenisation(mlm, tokenizer):
    aug = Augmentor(mlm, tokenizer)
    assert aug.words("It's a Wonderful movie, not bad!") == [
        "it", "'", "s", "a", "wonderful", "movie", ",", "not", "bad", "!"
    ]
    assert tokenizer.tokenize("wonderful") == ["wonder", "##ful"]
    assert len(tokenizer.tokenize("unbelievable")) == 3


@pytest.mark.parametrize("sees_original", [True, False])
def test_single_piece_candidates_are_the_mlm_top_m(mlm, tokenizer, sees_original):
    aug = Augmentor(mlm, tokenizer, m=15, mlm_sees_original=sees_original)
    words = aug.words("the clever actor is not funny , 7 wonderful")
    cands = aug.candidates([words])[0]
    ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]  # "wonderful" (last) is 2 pieces
    for pos in (1, 2, 5):  # clever, actor, funny
        masked = [tokenizer.cls_token_id, *ids, tokenizer.sep_token_id]
        masked[pos + 1] = tokenizer.mask_token_id
        second = [*ids, tokenizer.sep_token_id] if sees_original else []
        inputs = torch.tensor([masked + second])
        types = torch.tensor([[0] * len(masked) + [1] * len(second)])
        with torch.no_grad():
            logits = mlm(input_ids=inputs, token_type_ids=types).logits[0, pos + 1]
        top = tokenizer.convert_ids_to_tokens(logits.topk(15).indices.tolist())
        expected = [t for t in top if not t.startswith("##") and t not in SPECIAL and t != words[pos]]
        assert cands[pos] == expected
        assert 0 < len(expected) <= 15
    assert set(cands) <= {1, 2, 5, 8}  # never the stop words, the comma or the number
    if sees_original:  # the quirk matters: the MLM sees the word in segment B
        plain = Augmentor(mlm, tokenizer, m=15, mlm_sees_original=False).candidates([words])[0]
        assert plain != cands


def test_masked_logits_equal_full_forward(mlm, tokenizer):
    batch = tokenizer(["the clever actor", "a slow and dull film was bad"], padding=True, return_tensors="pt")
    batch["input_ids"][0, 2] = tokenizer.mask_token_id
    positions = torch.tensor([2, 5])
    with torch.no_grad():
        full = mlm(**batch).logits[torch.arange(2), positions]
        got = masked_logits(mlm, dict(batch), positions)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
    assert sum(len(mod._forward_pre_hooks) for mod in mlm.modules()) == 0


def test_multi_piece_candidates_are_embedding_neighbours(mlm, tokenizer):
    aug = Augmentor(mlm, tokenizer, m=5)
    cands = aug.candidates([["a", "wonderful", "unbelievable", "story"]])[0]
    emb = mlm.get_input_embeddings().weight.detach()
    whole = [w for w in VOCAB if w.isalpha() and w not in SPECIAL]
    table = emb[tokenizer.convert_tokens_to_ids(whole)]
    table = table / table.norm(dim=1, keepdim=True)
    for pos, word in ((1, "wonderful"), (2, "unbelievable")):
        query = emb[tokenizer(word, add_special_tokens=False)["input_ids"]].mean(0)
        sims = table @ (query / query.norm())
        assert cands[pos] == [whole[i] for i in sims.topk(5).indices.tolist()]


def test_caller_embedding_table_is_looked_up_by_word(mlm, tokenizer, tmp_path):
    path = tmp_path / "glove.txt"
    path.write_text("wonderful 1 0 0\ngreat 0.9 0.1 0\nsuperb 0.95 0 0.05\nawful -1 0 0\nfilm 0 1 0\n")
    aug = Augmentor(mlm, tokenizer, m=2, embeddings=WordEmbeddings.from_text_file(str(path), limit=4))
    cands = aug.candidates([["wonderful", "unbelievable"]])[0]
    assert cands == {0: ["superb", "great"]}  # "film" is past the limit; "unbelievable" is not in the table


# ---------------------------------------------------------------- copies


@pytest.mark.slow
def test_statistics_of_copies(mlm, tokenizer):
    n, p = 20, 0.4
    data = _dataset(40)
    out = augment_dataset(data, mlm, tokenizer, n=n, p=p, m=15, seed=0, batch_size=16)
    assert out.features == data.features
    aug = Augmentor(mlm, tokenizer, m=15)
    words = [aug.words(s) for s in data["sentence"]]
    cands = aug.candidates(words)

    replaced = trials = 0
    expected = 0.0
    for row, group, ws, cs in zip(data, _groups(out, 1 + n), words, cands):
        original, copies = group[0], group[1:]
        assert original == row
        assert all(c["label"] == row["label"] for c in copies)
        texts = [c["sentence"] for c in copies]
        assert len(set(texts)) == n and " ".join(ws) not in texts
        k = len(cs)
        assert k >= 6
        for text in texts:
            new = text.split(" ")
            assert len(new) == len(ws)
            changed = [i for i, (a, b) in enumerate(zip(ws, new)) if a != b]
            assert changed and set(changed) <= set(cs)
            for i in changed:
                assert new[i] in cs[i]
                assert ws[i].isalpha() and ws[i].lower() not in STOP_WORDS
            replaced += len(changed)
        trials += n * k
        expected += n * k * p / (1 - (1 - p) ** k)  # a copy must change something to be new
    rate, target = replaced / trials, expected / trials
    sigma = math.sqrt(p * (1 - p) / trials)
    assert abs(rate - target) < 4 * sigma, (rate, target, sigma)


@pytest.mark.slow
def test_seeded_and_independent_of_batching(mlm, tokenizer):
    data = _dataset(8, seed=1)
    a = augment_dataset(data, mlm, tokenizer, n=5, seed=3, batch_size=3)
    b = augment_dataset(data, mlm, tokenizer, n=5, seed=3, batch_size=8)
    c = augment_dataset(data, mlm, tokenizer, n=5, seed=4, batch_size=3)
    assert a.to_list() == b.to_list()
    assert a.to_list() != c.to_list()
    assert len(c) == len(a) == 8 * 6


def test_fewer_copies_only_when_no_more_exist(mlm, tokenizer):
    aug = Augmentor(mlm, tokenizer, m=15)
    ws = ["the", "story", "is", "7", "!"]
    cs = aug.candidates([ws])[0]
    assert list(cs) == [1]
    k = len(cs[1])
    data = Dataset.from_dict({"sentence": ["The story is 7!", "the is a , 7", "the clever actor"],
                              "label": [0, 1, 1]})
    out = augment_dataset(data, mlm, tokenizer, n=k + 5, p=0.4, seed=0).to_list()
    first = [r["sentence"] for r in out[1 : 1 + k]]
    assert first == [f"the {c} is 7 !" for c in cs[1]]  # all of them, in candidate order
    assert out[1 + k] == {"sentence": "the is a , 7", "label": 1}  # nothing eligible: the original alone
    assert len(out) == 1 + k + 1 + 1 + k + 5


def test_sentence_pairs_are_augmented_one_field_at_a_time(mlm, tokenizer):
    rng = np.random.default_rng(5)
    data = Dataset.from_dict({
        "sentence1": [_sentence(rng) for _ in range(4)],
        "sentence2": [_sentence(rng) for _ in range(4)],
        "label": [0, 1, 2, 1],
        "idx": [10, 11, 12, 13],
    })
    n = 3
    out = augment_dataset(data, mlm, tokenizer, text_columns=("sentence1", "sentence2"), n=n, seed=0)
    for row, group in zip(data, _groups(out, 1 + 2 * n)):
        assert group[0] == row
        for c in group[1 : 1 + n]:
            assert c["sentence2"] == row["sentence2"] and c["sentence1"] != row["sentence1"]
            assert (c["label"], c["idx"]) == (row["label"], row["idx"])
        for c in group[1 + n :]:
            assert c["sentence1"] == row["sentence1"] and c["sentence2"] != row["sentence2"]
            assert (c["label"], c["idx"]) == (row["label"], row["idx"])


def test_without_original_and_bad_input(mlm, tokenizer):
    data = _dataset(3)
    out = augment_dataset(data, mlm, tokenizer, n=2, include_original=False)
    assert len(out) == 6 and not set(out["sentence"]) & set(data["sentence"])
    with pytest.raises(ValueError, match="not in the dataset"):
        augment_dataset(data, mlm, tokenizer, text_columns=("text",))
    with pytest.raises(ValueError, match="p must be"):
        augment_dataset(data, mlm, tokenizer, p=1.5)
