"""Rule-based augmentation of Tang et al. 2019 (§3.3), the transfer set of the Distilled BiLSTM.

The teacher labels the copies (its logits are the student's target), so the rules need no model:
for each example, `n_iter` times, walk its words and draw X ~ U[0, 1] per word:
- X < p_mask: the word becomes the mask token ("masking": what does the teacher say without it?);
- p_mask <= X < p_mask + p_pos: the word becomes another word with the same part-of-speech tag, drawn
  from the unigram distribution of that tag's words over the whole data set ("POS-guided replacement");
then with probability p_ng keep only a random n-gram of the result, n uniform in `ngram_range`
("n-gram sampling"). A copy equal to the example or to an earlier copy is dropped, so each example gives at
most `n_iter` new rows. The paper's values for SST-2: p_mask = p_pos = 0.1, p_ng = 0.25, n in [1, 5],
n_iter = 20.

POS tags: the paper runs a POS tagger. None ships offline with the packages this library depends on
(NLTK's and spaCy's taggers are separate downloads), so `tagger` is any callable `words -> tags`, e.g.
`lambda ws: [t for _, t in nltk.pos_tag(ws)]` with NLTK's tagger data installed. `p_pos > 0` without a
tagger is refused rather than silently skipped.
Words are the tokenizer's basic tokenisation (`hf_distill.data.augment.basic_words`); copies are the words
joined by single spaces. Randomness: one generator per row, seeded from `(seed, row index)`.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from ..compat import dataset_fingerprint
from .augment import basic_words

Tagger = Callable[[list[str]], list[str]]
AUGMENTED_COLUMN = "augmented"  # 1 for a copy, 0 for an original row: copies carry no gold label


class UnigramsByTag:
    """Word frequencies per POS tag over a corpus; draws a word of a given tag in proportion to its count."""

    def __init__(self, tagged: list[tuple[list[str], list[str]]]):
        counts: dict[str, Counter] = {}
        for words, tags in tagged:
            for word, tag in zip(words, tags):
                counts.setdefault(tag, Counter())[word] += 1
        self.words = {tag: list(c) for tag, c in counts.items()}
        self.probs = {tag: np.array(list(c.values()), dtype=np.float64) / sum(c.values())
                      for tag, c in counts.items()}

    def draw(self, tag: str, rng: np.random.Generator) -> str:
        words = self.words[tag]
        return words[int(rng.choice(len(words), p=self.probs[tag]))]


def copies(
    words: list[str],
    tags: list[str] | None,
    rng: np.random.Generator,
    *,
    mask_token: str,
    unigrams: UnigramsByTag | None,
    n_iter: int,
    p_mask: float,
    p_pos: float,
    p_ng: float,
    ngram_range: tuple[int, int],
) -> list[str]:
    """Up to `n_iter` distinct new copies of one word list (the algorithm in the module docstring)."""
    seen, out = {" ".join(words)}, []
    for _ in range(n_iter):
        new = list(words)
        for i, x in enumerate(rng.random(len(words))):
            if x < p_mask:
                new[i] = mask_token
            elif x < p_mask + p_pos:
                new[i] = unigrams.draw(tags[i], rng)
        if len(new) > 1 and rng.random() < p_ng:
            n = int(rng.integers(ngram_range[0], ngram_range[1] + 1))
            if n < len(new):
                start = int(rng.integers(0, len(new) - n + 1))
                new = new[start : start + n]
        text = " ".join(new)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def tang_augment_dataset(
    dataset: Any,
    tokenizer: Any,
    text_column: str = "sentence",
    n_iter: int = 20,
    p_mask: float = 0.1,
    p_pos: float = 0.1,
    p_ng: float = 0.25,
    ngram_range: tuple[int, int] = (1, 5),
    tagger: Tagger | None = None,
    seed: int = 0,
    batch_size: int = 256,
) -> Any:
    """Each row of `dataset`, followed by its copies (`AUGMENTED_COLUMN` = 1, other columns as the row's).

    The copies' other columns (labels included) are the original row's: relabel them from the teacher, as
    the paper does, before training on them (`recipes/bilstm.py` does). Cached by `datasets` under a
    fingerprint of the data, the settings, the vocabulary and the tagger's output on a probe sentence.
    """
    if text_column not in dataset.column_names:
        raise ValueError(f"tang_augment_dataset: column {text_column!r} not in the dataset ({dataset.column_names})")
    for name, p in (("p_mask", p_mask), ("p_pos", p_pos), ("p_ng", p_ng)):
        if not 0 <= p <= 1:
            raise ValueError(f"tang_augment_dataset: {name} must be in [0, 1], got {p}")
    if p_mask + p_pos > 1:
        raise ValueError(f"tang_augment_dataset: p_mask + p_pos must be <= 1 (one draw per word), got "
                         f"{p_mask} + {p_pos}")
    lo, hi = ngram_range
    if not 1 <= lo <= hi:
        raise ValueError(f"tang_augment_dataset: ngram_range must be (lo, hi) with 1 <= lo <= hi, got {ngram_range}")
    if n_iter < 0:
        raise ValueError(f"tang_augment_dataset: n_iter must be >= 0, got {n_iter}")
    if p_pos > 0 and tagger is None:
        raise ValueError("tang_augment_dataset: p_pos > 0 needs a POS tagger (tagger=callable words -> tags), "
                         "e.g. NLTK's with its tagger data installed; or set p_pos=0 to skip POS-guided replacement")
    if AUGMENTED_COLUMN in dataset.column_names:
        raise ValueError(f"tang_augment_dataset: the dataset already has a {AUGMENTED_COLUMN!r} column "
                         "(augmented twice?)")
    if tokenizer.mask_token is None:
        raise ValueError("tang_augment_dataset: the tokenizer has no mask token (needed by the masking rule)")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "WordPiece":
        # Byte-level BPE and SentencePiece pre-tokenisers keep their word markers (Ġ, ▁) in the words, so
        # copies written as words joined by spaces would carry them into the text.
        raise ValueError("tang_augment_dataset needs a fast WordPiece tokenizer (BERT, DistilBERT, ELECTRA...): "
                         "its words are rejoined with spaces, which BPE and SentencePiece word markers do not survive")
    texts = dataset[text_column]
    words = [basic_words(backend, t) for t in texts]
    tags = None
    unigrams = None
    if p_pos > 0:
        tags = [tagger(ws) if ws else [] for ws in words]
        bad = next((i for i, (ws, ts) in enumerate(zip(words, tags)) if len(ws) != len(ts)), None)
        if bad is not None:
            raise ValueError(f"tang_augment_dataset: the tagger gave {len(tags[bad])} tags for the "
                             f"{len(words[bad])} words of row {bad}")
        unigrams = UnigramsByTag(list(zip(words, tags)))
    columns = dataset.column_names
    settings = dict(text_column=text_column, n_iter=n_iter, p_mask=p_mask, p_pos=p_pos, p_ng=p_ng,
                    ngram_range=list(ngram_range), seed=seed, version=1)

    def run(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {c: [] for c in [*columns, AUGMENTED_COLUMN]}
        for r, index in enumerate(indices):
            new = copies(words[index], None if tags is None else tags[index], np.random.default_rng([seed, index]),
                         mask_token=tokenizer.mask_token, unigrams=unigrams, n_iter=n_iter, p_mask=p_mask,
                         p_pos=p_pos, p_ng=p_ng, ngram_range=ngram_range) if words[index] else []
            for k, text in enumerate([batch[text_column][r], *new]):
                for c in columns:
                    out[c].append(text if c == text_column and k else batch[c][r])
                out[AUGMENTED_COLUMN].append(int(k > 0))
        return out

    h = hashlib.blake2b(digest_size=16)
    h.update(str(dataset_fingerprint(dataset, id(dataset))).encode())
    h.update(json.dumps(settings, sort_keys=True).encode())
    h.update(backend.to_str().encode())  # vocabulary, normaliser (casing, accents) and pre-tokeniser
    if tagger is not None and p_pos > 0:
        h.update(json.dumps(tags).encode())  # the tagger's actual output on this data, whatever tagger it is
    return dataset.map(run, batched=True, batch_size=batch_size, with_indices=True, remove_columns=columns,
                       desc="Tang et al. augmentation", new_fingerprint=h.hexdigest())
