"""Tang et al.'s augmentation rules (hf_distill.data.tang_augment) on hand-built cases."""

import numpy as np
import pytest
from datasets import Dataset
from test_recipes import SPECIAL, WORDS
from transformers import BertTokenizer

from hf_distill.data.tang_augment import AUGMENTED_COLUMN, UnigramsByTag, copies, tang_augment_dataset

TAGS = {"movie": "NN", "film": "NN", "plot": "NN", "story": "NN", "good": "JJ", "bad": "JJ", "great": "JJ"}


def tag(words):
    return [TAGS.get(w, "X") for w in words]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vocab")
    (folder / "vocab.txt").write_text("\n".join(SPECIAL + WORDS) + "\n")
    return BertTokenizer.from_pretrained(str(folder))


def rows():
    return Dataset.from_dict({"sentence": ["The movie is good", "a bad film", "great story and great plot"],
                              "label": [1, 0, 1]})


def draw(words, seed=0, **kw):
    settings = dict(mask_token="[MASK]", unigrams=None, n_iter=20, p_mask=0.0, p_pos=0.0, p_ng=0.0,
                    ngram_range=(1, 5), tags=None)
    settings.update(kw)
    tags = settings.pop("tags")
    return copies(words, tags, np.random.default_rng(seed), **settings)


def test_masking_every_word_gives_one_copy():
    assert draw(["the", "movie", "is", "good"], p_mask=1.0) == ["[MASK] [MASK] [MASK] [MASK]"]


def test_no_rule_gives_no_copy():
    assert draw(["the", "movie"]) == []


def test_pos_replacement_keeps_each_words_tag():
    words = ["the", "movie", "is", "good"]
    unigrams = UnigramsByTag([(w, tag(w)) for w in (words, ["film", "great"])])  # the data set includes the row
    out = draw(words, p_pos=1.0, unigrams=unigrams, tags=tag(words))
    assert out and len(set(out)) == len(out)
    for text in out:
        assert tag(text.split()) == tag(words)
    assert {t.split()[1] for t in out} == {"movie", "film"} and {t.split()[3] for t in out} == {"good", "great"}
    assert {w for t in out for w in t.split()[::2]} == {"the", "is"}  # X words only draw X words


def test_unigram_draws_follow_counts():
    unigrams = UnigramsByTag([(["film", "film", "film", "plot"], ["NN"] * 4)])
    rng = np.random.default_rng(0)
    share = sum(unigrams.draw("NN", rng) == "film" for _ in range(4000)) / 4000
    assert abs(share - 0.75) < 0.03


def test_masking_and_replacement_rates_follow_one_draw_per_word():
    """p_mask = 0.2 and p_pos = 0.3 from one uniform draw per word: 20% masks, 30% replacements, 50% kept."""
    words = [f"w{i}" for i in range(400)]
    tags = [f"T{i}" for i in range(400)]
    unigrams = UnigramsByTag([([f"r{i}" for i in range(400)], tags)])  # each tag's only other word
    out = draw(words, p_mask=0.2, p_pos=0.3, unigrams=unigrams, tags=tags, n_iter=10)
    cells = [w for text in out for w in text.split()]
    assert len(out) == 10 and len(cells) == 4000
    masked = sum(w == "[MASK]" for w in cells) / 4000
    replaced = sum(w.startswith("r") for w in cells) / 4000
    assert abs(masked - 0.2) < 0.03 and abs(replaced - 0.3) < 0.03


def test_ngram_sampling_keeps_a_contiguous_span_of_the_allowed_length():
    words = "a b c d e f g h".split()
    out = draw(words, p_ng=1.0, ngram_range=(2, 3), n_iter=50)
    assert out
    for text in out:
        span = text.split()
        assert len(span) in (2, 3)
        start = words.index(span[0])
        assert words[start : start + len(span)] == span


def test_dataset_rows_copies_flags_and_determinism(tokenizer):
    ds = rows()
    out = tang_augment_dataset(ds, tokenizer, n_iter=5, p_mask=0.3, p_pos=0.3, p_ng=0.25, tagger=tag, seed=1)
    assert set(out.column_names) == {"sentence", "label", AUGMENTED_COLUMN}
    originals = [i for i, f in enumerate(out[AUGMENTED_COLUMN]) if f == 0]
    assert [out["sentence"][i] for i in originals] == ds["sentence"]  # each row, then its copies
    for a, b in zip(originals, [*originals[1:], len(out)]):
        assert 1 <= b - a <= 6 and len(set(out["sentence"][a:b])) == b - a  # at most n_iter distinct copies
        assert set(out["label"][a:b]) == {out["label"][a]}
    again = tang_augment_dataset(ds, tokenizer, n_iter=5, p_mask=0.3, p_pos=0.3, p_ng=0.25, tagger=tag, seed=1,
                                 batch_size=1)
    assert again["sentence"] == out["sentence"]  # one generator per row: batching does not matter
    other = tang_augment_dataset(ds, tokenizer, n_iter=5, p_mask=0.3, p_pos=0.3, p_ng=0.25, tagger=tag, seed=2)
    assert other["sentence"] != out["sentence"]


def test_non_wordpiece_tokenizers_are_refused():
    """BPE/SentencePiece words keep their markers (Ġ, ▁): copies joined by spaces would carry them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(vocab={"[UNK]": 0, "[MASK]": 1, "a": 2}, merges=[], unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, mask_token="[MASK]", unk_token="[UNK]")
    with pytest.raises(ValueError, match="needs a fast WordPiece tokenizer"):
        tang_augment_dataset(rows(), tok, p_pos=0.0)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"p_pos": 0.1}, "needs a POS tagger"),
    ({"p_mask": 0.7, "p_pos": 0.6, "tagger": tag}, "p_mask \\+ p_pos must be <= 1"),
    ({"p_ng": 1.5}, "p_ng must be in"),
    ({"ngram_range": (0, 3)}, "ngram_range"),
    ({"text_column": "text"}, "column 'text' not in the dataset"),
    ({"p_pos": 0.1, "tagger": lambda ws: ["NN"]}, "the tagger gave 1 tags"),
])
def test_bad_settings_are_refused(tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tang_augment_dataset(rows(), tokenizer, **{"p_pos": 0.0, **kwargs})
