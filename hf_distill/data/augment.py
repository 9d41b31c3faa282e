"""TinyBERT-style data augmentation: many word-substituted copies of each training sentence.

Algorithm (Jiao et al. 2020, the data augmentation procedure; huawei-noah `TinyBERT/data_augmentation.py`): split
the sentence into words with the tokenizer's basic tokenisation; each word that is alphabetic and not a
stop word gets candidates: a single-wordpiece word is replaced by [MASK] and the masked LM's top-M
predictions are taken (sub-words `##...` dropped); a multi-wordpiece word gets its M nearest neighbours
by cosine in a word-embedding table. Then N times: copy the sentence, replace each word that has
candidates, with probability p, by one of them drawn uniformly; keep the copy if it is new. Copies are
written as the reference writes them: basic-tokenised words joined by single spaces (lower-cased for
uncased tokenizers). Each text field of a pair is augmented separately.

Reproduced quirk (`mlm_sees_original=True`, the default): the MLM input is
`[CLS] masked-sentence [SEP] original-sentence [SEP]` with segment ids 0/1, so the model can see the word
it is asked to predict in segment B.

Deliberate differences from the reference code:
- Embedding table: GloVe (the reference's first 100k words of glove.840B) is not available offline. The
  default table is the MLM's own input word embeddings restricted to whole-word vocabulary entries (no
  `##`, alphabetic, not special); a multi-piece word is looked up by the mean of its pieces' embeddings.
  A GloVe-style table can be given with `WordEmbeddings.from_text_file`, where words are looked up by name
  as in the reference.
- MLM candidates also drop special tokens, `[unused..]`-style bracketed entries and the word itself (the
  reference keeps them; with the original sentence visible the MLM often predicts the word itself, which
  then yields no change).
- Exactly `n` new copies per text field: draws continue past `n` attempts until `n` distinct new sentences
  are found (the reference makes `n` attempts and keeps the new ones). When fewer than `n` distinct new
  sentences exist, all of them are returned, in a fixed order. A copy identical to the basic-tokenised
  original does not count as new (the reference compares with the raw sentence, so a copy that changed
  nothing but the casing or spacing counted).
- For pairs, the other fields of each copy keep their original text (the reference mutates the row in
  place, so the second field's copies carry the last copy of the first field).
- Randomness: one `numpy` generator per (row, text field), seeded from `(seed, row index, field)`, so the
  output does not depend on `batch_size`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..compat import dataset_fingerprint

# NLTK's English stop words, as listed in the reference; only alphabetic entries are kept because only
# alphabetic words are candidates for replacement (contractions are split by the basic tokenisation).
STOP_WORDS = frozenset(
    """
    i me my myself we our ours ourselves you your yours yourself yourselves he him his himself she her hers
    herself it its itself they them their theirs themselves what which who whom this that these those am is
    are was were be been being have has had having do does did doing a an the and but if or because as until
    while of at by for with about against between into through during before after above below to from up
    down in out on off over under again further then once here there when where why how all any both each
    few more most other some such no nor not only own same so than too very s t can will just don should now
    d ll m o re ve y ain aren couldn didn doesn hadn hasn haven isn ma mightn mustn needn shan shouldn wasn
    weren won wouldn
    """.split()
)

# Copies per example used by the reference's `default_params` (its default N is 30). STS-B is listed there
# as "STS-b", so the reference falls back to 30 for it, which is the value below anyway.
TINYBERT_N = {"cola": 30, "mnli": 10, "mrpc": 30, "sst2": 20, "stsb": 30, "qqp": 10, "qnli": 20, "rte": 30}

# Text fields the reference augments per GLUE task, under the column names of the `glue` dataset on the Hub.
GLUE_TEXT_COLUMNS = {
    "cola": ("sentence",),
    "sst2": ("sentence",),
    "mrpc": ("sentence1", "sentence2"),
    "stsb": ("sentence1", "sentence2"),
    "qqp": ("question1", "question2"),
    "mnli": ("premise", "hypothesis"),
    "qnli": ("question", "sentence"),
    "rte": ("sentence1", "sentence2"),
}

_ALPHA = re.compile(r"[a-z]+")
_BRACKETED = re.compile(r"^\[.*\]$")


def _is_eligible(word: str) -> bool:
    low = word.lower()
    return bool(_ALPHA.fullmatch(low)) and low not in STOP_WORDS


@dataclass
class WordEmbeddings:
    """A word-embedding table for nearest-neighbour candidates of multi-wordpiece words.

    `words[i]` has the L2-normalised row `vectors[i]`. `piece_vectors`, when set (the MLM default), is the
    token-id-indexed input embedding matrix used to embed a word missing from `words` as the mean of its
    wordpieces; without it such a word gets no candidates (the reference's behaviour for words not in GloVe).
    """

    words: list[str]
    vectors: torch.Tensor
    piece_vectors: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.vectors = _normalise(torch.as_tensor(self.vectors, dtype=torch.float32))
        self.index = {w: i for i, w in enumerate(self.words)}

    @classmethod
    def from_mlm(cls, mlm: nn.Module, tokenizer: Any) -> WordEmbeddings:
        """The MLM's input word embeddings over whole-word vocabulary entries (the offline stand-in for GloVe)."""
        matrix = mlm.get_input_embeddings().weight.detach().float().cpu()
        special = set(tokenizer.all_special_tokens)
        entries = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        keep = [(w, i) for w, i in entries if i < matrix.shape[0] and w not in special and _ALPHA.fullmatch(w.lower())]
        return cls([w for w, _ in keep], matrix[[i for _, i in keep]], piece_vectors=matrix)

    @classmethod
    def from_text_file(cls, path: str, limit: int | None = 100_000) -> WordEmbeddings:
        """Read a GloVe-format text file (`word v1 v2 ...` per line); the reference keeps its first 100k words."""
        words, rows = [], []
        with open(path, encoding="utf-8") as f:
            for line in f:
                if limit is not None and len(words) >= limit:
                    break
                parts = line.rstrip().split(" ")
                if len(parts) < 2:
                    continue
                words.append(parts[0])
                rows.append([float(x) for x in parts[1:]])
        return cls(words, torch.tensor(rows))

    def neighbours(self, queries: Sequence[tuple[str, Sequence[int]]], m: int) -> list[list[str]]:
        """Top-`m` neighbours by cosine of each `(word, piece_ids)` query, the word itself excluded."""
        out: list[list[str]] = [[] for _ in queries]
        rows, vecs = [], []
        for qi, (word, pieces) in enumerate(queries):
            if word in self.index:
                rows.append(qi)
                vecs.append(self.vectors[self.index[word]])
            elif self.piece_vectors is not None and len(pieces):
                rows.append(qi)
                vecs.append(_normalise(self.piece_vectors[list(pieces)].mean(0, keepdim=True))[0])
        if not rows or m <= 0:
            return out
        sims = torch.stack(vecs) @ self.vectors.T
        k = min(m + 1, sims.shape[1])
        top = sims.topk(k, dim=1).indices.tolist()
        for qi, ids in zip(rows, top):
            word = queries[qi][0]
            cands = [self.words[i] for i in ids if self.words[i] != word][:m]
            out[qi] = [c.title() for c in cands] if word.istitle() else cands
        return out

    def digest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update("\n".join(self.words).encode())
        for table in (self.vectors, self.piece_vectors):
            if table is not None:
                h.update(table.detach().float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()


def basic_words(backend: Any, text: str) -> list[str]:
    """The reference's `basic_tokenizer.tokenize`: a fast tokenizer's (`backend_tokenizer`) normaliser and
    pre-tokeniser, so words are cased and split exactly as the tokenizer will see them."""
    normalizer, pre = backend.normalizer, backend.pre_tokenizer
    text = normalizer.normalize_str(text) if normalizer is not None else text
    return [w for w, _ in pre.pre_tokenize_str(text)] if pre is not None else text.split()


def _normalise(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


class Augmentor:
    """Candidate generation and copy sampling for one MLM + tokenizer (used by `augment_dataset`)."""

    def __init__(
        self,
        mlm: nn.Module,
        tokenizer: Any,
        m: int = 15,
        embeddings: WordEmbeddings | None = None,
        mlm_sees_original: bool = True,
        mlm_batch_size: int = 64,
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or type(backend.model).__name__ != "WordPiece":
            raise ValueError(
                "augment needs a WordPiece tokenizer (BERT, DistilBERT, ELECTRA...), as the TinyBERT reference: "
                "its single- versus multi-wordpiece rule and `##` filtering are defined for WordPiece."
            )
        if tokenizer.mask_token_id is None:
            raise ValueError("augment needs a tokenizer with a mask token.")
        self.mlm = mlm.eval()
        self.tokenizer = tokenizer
        self.backend = backend
        self.m = m
        self.embeddings = embeddings if embeddings is not None else WordEmbeddings.from_mlm(mlm, tokenizer)
        self.mlm_sees_original = mlm_sees_original
        self.mlm_batch_size = mlm_batch_size
        config = getattr(mlm, "config", None)
        self.max_length = min(512, getattr(config, "max_position_embeddings", 512))
        self.use_segments = getattr(config, "type_vocab_size", 0) >= 2
        vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        special = set(tokenizer.all_special_tokens)
        prefix = getattr(backend.model, "continuing_subword_prefix", "##") or "##"
        self.vocab = vocab
        self.droppable = {i for i, t in enumerate(vocab) if t.startswith(prefix) or t in special or _BRACKETED.match(t)}

    # ---------------------------------------------------------------- words and candidates

    def words(self, text: str) -> list[str]:
        return basic_words(self.backend, text)

    def candidates(self, sentences: Sequence[list[str]]) -> list[dict[int, list[str]]]:
        """For each word list: position -> candidate replacements, for every eligible word that has some."""
        flat = [w for ws in sentences for w in ws]
        pieces = self.tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
        out: list[dict[int, list[str]]] = []
        mlm_queries: list[tuple[int, int, list[int], int]] = []  # (sentence, word, ids, mask position)
        emb_queries: list[tuple[int, int, str, list[int]]] = []
        start = 0
        for si, ws in enumerate(sentences):
            wp = pieces[start : start + len(ws)]
            start += len(ws)
            out.append({})
            sentence_ids = [i for p in wp for i in p]
            offset = 1  # [CLS]
            for wi, (word, ids) in enumerate(zip(ws, wp)):
                if _is_eligible(word):
                    if len(ids) == 1:
                        mlm_queries.append((si, wi, sentence_ids, offset))
                    elif len(ids) > 1:
                        emb_queries.append((si, wi, word, ids))
                offset += len(ids)
        found = [*zip(mlm_queries, self._mlm_candidates(mlm_queries)),
                 *zip(emb_queries, self.embeddings.neighbours([(w, ids) for _, _, w, ids in emb_queries], self.m))]
        for (si, wi, *_), cands in found:
            # Distinct and different from the word, so that distinct choices give distinct sentences.
            cands = list(dict.fromkeys(c for c in cands if c != sentences[si][wi]))
            if cands:
                out[si][wi] = cands
        return out

    def _mlm_inputs(self, sentence_ids: list[int], pos: int) -> tuple[list[int], list[int]]:
        tok = self.tokenizer
        masked = [tok.cls_token_id, *sentence_ids, tok.sep_token_id]
        masked[pos] = tok.mask_token_id
        ids = masked + ([*sentence_ids, tok.sep_token_id] if self.mlm_sees_original else [])
        segments = [0] * len(masked) + [1] * (len(ids) - len(masked))
        return ids[: self.max_length], segments[: self.max_length]

    @torch.inference_mode()
    def _mlm_candidates(self, queries: list[tuple[int, int, list[int], int]]) -> list[list[str]]:
        results: list[list[str]] = [[] for _ in queries]
        todo = [(qi, *self._mlm_inputs(ids, pos), pos) for qi, (_, _, ids, pos) in enumerate(queries)]
        todo = [t for t in todo if t[3] < self.max_length]  # the reference skips masks past 512 tokens
        device = next(self.mlm.parameters()).device
        pad = self.tokenizer.pad_token_id or 0
        for b in range(0, len(todo), self.mlm_batch_size):
            chunk = todo[b : b + self.mlm_batch_size]
            length = max(len(t[1]) for t in chunk)
            ids = torch.full((len(chunk), length), pad, dtype=torch.long)
            segs = torch.zeros_like(ids)
            attn = torch.zeros_like(ids)
            for r, (_, row_ids, row_segs, _) in enumerate(chunk):
                ids[r, : len(row_ids)] = torch.tensor(row_ids)
                segs[r, : len(row_segs)] = torch.tensor(row_segs)
                attn[r, : len(row_ids)] = 1
            positions = torch.tensor([t[3] for t in chunk])
            kwargs = {"input_ids": ids.to(device), "attention_mask": attn.to(device)}
            if self.use_segments:
                kwargs["token_type_ids"] = segs.to(device)
            logits = masked_logits(self.mlm, kwargs, positions.to(device))
            top = logits.float().topk(min(self.m, logits.shape[-1]), dim=-1).indices.tolist()
            for (qi, *_), ranked in zip(chunk, top):
                results[qi] = [self.vocab[i] for i in ranked if i not in self.droppable]
        return results

    # ---------------------------------------------------------------- copies

    @staticmethod
    def copies(words: list[str], cands: dict[int, list[str]], n: int, p: float, rng: np.random.Generator) -> list[str]:
        """`n` distinct new sentences (all of them, in a fixed order, when fewer than `n` exist)."""
        positions = sorted(cands)
        original = " ".join(words)
        sizes = np.array([len(cands[i]) for i in positions])
        possible = math.prod(int(s) + 1 for s in sizes) - 1
        if n <= 0 or possible <= 0:
            return []
        if possible <= n:
            return [" ".join(v) for v in _enumerate(words, positions, cands)]
        seen, out = {original}, []
        for _ in range(100 * n + 1000):
            replace = rng.random(len(positions)) < p
            picks = rng.integers(0, sizes)
            new = list(words)
            for k, pos in enumerate(positions):
                if replace[k]:
                    new[pos] = cands[pos][picks[k]]
            text = " ".join(new)
            if text not in seen:
                seen.add(text)
                out.append(text)
                if len(out) == n:
                    return out
        # Only reached when a few of the possible copies are very unlikely: complete deterministically.
        for v in _enumerate(words, positions, cands):
            text = " ".join(v)
            if text not in seen:
                seen.add(text)
                out.append(text)
                if len(out) == n:
                    break
        return out


def _enumerate(words: list[str], positions: list[int], cands: dict[int, list[str]]):
    """Every changed copy, in a fixed order (odometer over the positions, unchanged first)."""
    options = [[None, *cands[pos]] for pos in positions]
    for choice in itertools.product(*options):
        if all(c is None for c in choice):
            continue
        new = list(words)
        for pos, c in zip(positions, choice):
            if c is not None:
                new[pos] = c
        yield new


def masked_logits(mlm: nn.Module, inputs: dict[str, torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
    """Vocabulary logits `(B, V)` of a masked LM at one position per row.

    The output projection is applied to those positions only (a pre-hook on `get_output_embeddings()`), so
    the full `(B, T, V)` logits of a 30k vocabulary are never materialised.
    """
    decoder = mlm.get_output_embeddings() if hasattr(mlm, "get_output_embeddings") else None
    rows = torch.arange(positions.shape[0], device=positions.device)
    if decoder is None:
        return mlm(**inputs).logits[rows, positions]

    def gather(_module, args):
        hidden = args[0]
        return (hidden[rows, positions].unsqueeze(1), *args[1:])

    handle = decoder.register_forward_pre_hook(gather)
    try:
        return mlm(**inputs).logits[:, 0]
    finally:
        handle.remove()


def augment_dataset(
    dataset: Any,
    mlm: nn.Module,
    tokenizer: Any,
    text_columns: Sequence[str] = ("sentence",),
    n: int = 20,
    p: float = 0.4,
    m: int = 15,
    seed: int = 0,
    batch_size: int = 256,
    include_original: bool = True,
    embeddings: WordEmbeddings | None = None,
    mlm_sees_original: bool = True,
    mlm_batch_size: int = 64,
    load_from_cache_file: bool | None = None,
) -> Any:
    """TinyBERT data augmentation of a `datasets.Dataset` (see the module docstring for the algorithm).

    Each input row gives, in order: the row itself (if `include_original`), then for each of
    `text_columns` in turn `n` copies in which that column is augmented and every other column (labels,
    the other text of a pair) is kept. `n=20, p=0.4, m=15` are the paper's values; `TINYBERT_N` has the
    reference's per-task `n`. `mlm` is any local masked LM with a WordPiece tokenizer; `embeddings`
    defaults to `WordEmbeddings.from_mlm(mlm, tokenizer)`. Runs as one batched `datasets.map` (with its
    progress bar); the result is cached under a fingerprint of the inputs, the models' weights and the
    settings.
    """
    if not 0 <= p <= 1:
        raise ValueError(f"augment_dataset: p must be in [0, 1], got {p}.")
    if n < 0 or m < 1:
        raise ValueError(f"augment_dataset: need n >= 0 and m >= 1, got n={n}, m={m}.")
    text_columns = list(text_columns)
    missing = [c for c in text_columns if c not in dataset.column_names]
    if missing:
        raise ValueError(f"augment_dataset: column(s) {missing} not in the dataset ({dataset.column_names}).")
    aug = Augmentor(mlm, tokenizer, m=m, embeddings=embeddings, mlm_sees_original=mlm_sees_original,
                    mlm_batch_size=mlm_batch_size)
    columns = dataset.column_names

    def run(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        size = len(indices)
        jobs = [(r, c) for r in range(size) for c in text_columns if isinstance(batch[c][r], str)]
        words = {job: aug.words(batch[job[1]][job[0]]) for job in jobs}
        cands = dict(zip(jobs, aug.candidates([words[j] for j in jobs])))
        out: dict[str, list] = {c: [] for c in columns}
        for r in range(size):
            if include_original:
                for c in columns:
                    out[c].append(batch[c][r])
            for ci, col in enumerate(text_columns):
                if (r, col) not in cands:
                    continue
                rng = np.random.default_rng([seed, indices[r], ci])
                for text in aug.copies(words[(r, col)], cands[(r, col)], n, p, rng):
                    for c in columns:
                        out[c].append(text if c == col else batch[c][r])
        return out

    settings = dict(text_columns=text_columns, n=n, p=p, m=m, seed=seed, include_original=include_original,
                    mlm_sees_original=mlm_sees_original, version=1)
    return dataset.map(
        run,
        batched=True,
        batch_size=batch_size,
        with_indices=True,
        remove_columns=columns,
        features=dataset.features,
        desc="TinyBERT augmentation",
        new_fingerprint=_fingerprint(dataset, mlm, tokenizer, aug.embeddings, settings),
        load_from_cache_file=load_from_cache_file,
    )


def _fingerprint(dataset: Any, mlm: nn.Module, tokenizer: Any, embeddings: WordEmbeddings, settings: dict) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(str(dataset_fingerprint(dataset, id(dataset))).encode())
    h.update(json.dumps(settings, sort_keys=True).encode())
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(type(mlm).__name__.encode())
    for name, tensor in mlm.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().numpy().tobytes())
    h.update(embeddings.digest().encode())
    return h.hexdigest()
