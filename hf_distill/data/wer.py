"""Word error rate with Whisper's English text normaliser, and distil-whisper's pseudo-label filter.

distil-whisper drops a pseudo-label whose WER against the dataset's own transcript exceeds a threshold (10%), both
texts normalised first, so casing, punctuation, spelled-out numbers and contractions do not count as errors. The
normaliser here is transformers' `EnglishTextNormalizer` (the one Whisper's evaluation uses). Its British-to-American
spelling step reads a mapping that ships as `normalizer.json` with the Hub's Whisper tokenizers: it is used when the
tokenizer given has it, and is empty otherwise (an offline tokenizer built here has none), so "colour" and "color"
then differ. WER itself is jiwer's (word-level Levenshtein distance over the reference's word count).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["check_wer_threshold", "english_normaliser", "wer", "wer_filter"]


def english_normaliser(tokenizer: Any = None) -> Callable[[str], str]:
    """Whisper's English normaliser, with the tokenizer's spelling mapping when it has one (else none)."""
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    mapping = getattr(tokenizer, "english_spelling_normalizer", None) or {}
    return EnglishTextNormalizer(mapping)


def check_wer_threshold(threshold: float) -> float:
    """`threshold` as a float, or a one-line ValueError when it is not a WER share in [0, 1]."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise ValueError(f"wer_threshold must be in [0, 1] (a share: distil-whisper drops pseudo-labels above 0.1), "
                         f"got {threshold!r}")
    return float(threshold)


def _pairs(references: Sequence[str], hypotheses: Sequence[str], normalise: Callable[[str], str] | None):
    if len(references) != len(hypotheses):
        raise ValueError(f"wer: {len(references)} references for {len(hypotheses)} hypotheses")
    norm = normalise or (lambda s: s)
    return [norm(r) for r in references], [norm(h) for h in hypotheses]


def wer(references: Sequence[str], hypotheses: Sequence[str], normalise: Callable[[str], str] | None = None) -> float:
    """Corpus WER: word edits over reference words, summed over the rows (jiwer), after `normalise`. Rows whose
    normalised reference is empty are skipped (their WER is undefined); none left raises."""
    import jiwer

    refs, hyps = _pairs(references, hypotheses, normalise)
    kept = [(r, h) for r, h in zip(refs, hyps) if r.strip()]
    if not kept:
        raise ValueError("wer: every reference is empty after normalisation")
    return float(jiwer.wer([r for r, _ in kept], [h for _, h in kept]))


def wer_filter(references: Sequence[str], hypotheses: Sequence[str], threshold: float,
               normalise: Callable[[str], str] | None = None) -> tuple[list[int], list[float]]:
    """distil-whisper's filter: the indices of the rows whose own WER is at most `threshold`, and every row's WER.
    A row whose normalised reference is empty is kept only when its hypothesis is empty too (WER 0, else 1)."""
    import jiwer

    threshold = check_wer_threshold(threshold)
    refs, hyps = _pairs(references, hypotheses, normalise)
    scores = []
    for r, h in zip(refs, hyps):
        if r.strip():
            scores.append(float(jiwer.wer(r, h)))
        else:
            scores.append(0.0 if not h.strip() else 1.0)
    return [i for i, s in enumerate(scores) if s <= threshold], scores
