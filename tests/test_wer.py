"""WER with Whisper's English normaliser and distil-whisper's pseudo-label filter (hf_distill/data/wer.py)."""

from __future__ import annotations

import pytest

from hf_distill.data.wer import check_wer_threshold, english_normaliser, wer, wer_filter


def test_normaliser_is_whispers_english_one():
    norm = english_normaliser()
    assert norm("Hello, World!") == "hello world"
    assert norm("I won't go.") == "i will not go"  # contractions expanded, as Whisper's evaluation does


def test_normaliser_takes_the_tokenizers_spelling_map():
    class Tok:
        english_spelling_normalizer = {"colour": "color"}

    assert english_normaliser(Tok())("The colour") == "the color"
    assert english_normaliser()("The colour") == "the colour"  # no map shipped: spelling left alone


def test_wer_counts_word_edits_over_reference_words():
    assert wer(["a b c d", "e f"], ["a b x d", "e f g"]) == pytest.approx(2 / 6)
    # punctuation and case are not errors once normalised
    assert wer(["Hello, world."], ["hello world"], english_normaliser()) == 0.0
    assert wer(["Hello, world."], ["hello world"]) == 1.0


def test_filter_keeps_rows_at_or_under_the_threshold():
    refs = ["a b c d e f g h i j", "one two", "", ""]
    hyps = ["a b c d e f g h i x", "one three", "", "noise"]
    kept, scores = wer_filter(refs, hyps, 0.1)
    assert kept == [0, 2] and scores == pytest.approx([0.1, 0.5, 0.0, 1.0])
    assert wer_filter(refs, hyps, 0.0)[0] == [2] and wer_filter(refs, hyps, 1.0)[0] == [0, 1, 2, 3]


@pytest.mark.parametrize("bad", [-0.01, 1.5, True, "0.1", float("nan")])
def test_threshold_outside_0_1_is_one_line(bad):
    with pytest.raises(ValueError, match=r"^wer_threshold must be in \[0, 1\].*got") as err:
        check_wer_threshold(bad)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="wer_threshold"):
        wer_filter(["a"], ["a"], bad)
