"""The split behind benchmarks/sentence_embeddings.py's second probe test set (`--test-phrases`, issue #44 item 2):
SST-2's training file holds every phrase of each parsed sentence, so a test phrase must share no 4-word run with
the probe's rows or the distillation sentences, or the probe would be read on text it was trained on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture()
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import sentence_embeddings

    yield sentence_embeddings
    for name in ("sentence_embeddings", "sections", "sentence_probe", "sentence_report"):
        sys.modules.pop(name, None)


def _phrases() -> list[str]:
    """Parsed-sentence style rows: each sentence of 12 words and its nested phrases (as SST-2's file holds them)."""
    rows = []
    for s in range(40):
        words = [f"w{s}_{i}" for i in range(12)]
        rows += [" ".join(words), " ".join(words[:10]), " ".join(words[2:8]), " ".join(words[5:8]), words[0]]
    return rows


def _grams(text: str) -> set:
    w = text.split()
    return {tuple(w[k:k + 4]) for k in range(len(w) - 3)}


def test_test_phrases_share_no_four_word_run_with_the_probe_or_the_distillation(bench):
    texts = _phrases()
    order = list(range(len(texts)))[::-1]
    test, probe, kd = bench.split_rows(texts, order, n_test=10, n_probe=40, n_kd=130)  # every row left
    assert len(test) == 10 and len(probe) == 40 and len(kd) == 130
    assert all(len(texts[i].split()) >= 10 for i in test)
    assert not set(test) & (set(probe) | set(kd)) and not set(probe) & set(kd)
    test_grams = set().union(*(_grams(texts[i]) for i in test))
    assert all(not _grams(texts[i]) & test_grams for i in probe + kd)
    for i in test:  # and none with each other
        assert all(not _grams(texts[i]) & _grams(texts[j]) for j in test if j != i)


def test_without_test_phrases_the_split_is_the_first_runs(bench):
    texts = _phrases()
    order = list(range(len(texts)))
    assert bench.split_rows(texts, order, 0, 30, 50) == ([], order[:30], order[30:80])


def test_too_few_rows_left_is_refused_with_the_numbers(bench):
    with pytest.raises(SystemExit, match="--test-phrases 30: .* ask for fewer"):
        bench.split_rows(_phrases(), list(range(200)), 30, 100, 100)
