"""Speech recognition data for Whisper-style encoder-decoders: checks, the training collator, transcription and
distil-whisper's pseudo-labelling stage (batched, resumable).

* `check_audio` refuses an audio column at another sampling rate than the feature extractor's (Whisper's log-mel
  frames assume 16 kHz: audio at 8 or 44.1 kHz would be read too slow or too fast, silently);
  `check_feature_extractors` refuses a teacher and student that would need different features (mel bins, sampling
  rate, hop, FFT or window length) when the batch cannot give each its own; `check_input_features` refuses
  precomputed `input_features` of another shape (mel bins x frames) than the feature extractor's;
  `check_clip_lengths` (and the collator, clip by clip) refuses clips longer than the extractor's window
  (`chunk_length`), which it would cut silently while their transcript still holds every word.
* `SpeechSeq2SeqCollator` makes `input_features` from the raw audio (or takes precomputed ones) and the `labels`
  from a text column: the tokenizer's prefix (`<|startoftranscript|>` ... `<|notimestamps|>`), the text and
  `<|endoftext|>`, padded with -100; the leading decoder-start token is dropped, since the model prepends it when it
  shifts the labels right.
* `pseudo_label` transcribes a dataset with the teacher, `batch_size` rows per `generate` call, and appends each
  finished batch to a JSON-lines file, so a run killed mid-way restarts where it stopped; the file's settings (the
  teacher's weights, the rows, the generation settings) are checked first, so labels of another teacher or dataset
  are never mixed in (the run is refused, and nothing is deleted); settings with no finished row (a run that
  failed before its first batch) are replaced.
* `whisper_processor` builds a `WhisperProcessor` offline (a byte-level BPE trained on your texts plus Whisper's
  special tokens), for tests and for teachers trained from scratch where no Hub tokenizer can be downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "PSEUDO_LABEL_FILE",
    "SPECIAL_TOKENS",
    "SpeechSeq2SeqCollator",
    "audio_sampling_rates",
    "check_audio",
    "check_clip_lengths",
    "check_feature_extractors",
    "check_input_features",
    "digest",
    "pseudo_label",
    "transcribe",
    "whisper_processor",
]

# Whisper's special tokens an English-only model uses (tiny.en's decoder prompt: <|startoftranscript|><|notimestamps|>)
SPECIAL_TOKENS = ("<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|translate|>", "<|transcribe|>",
                  "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>")
FEATURE_FIELDS = ("feature_size", "sampling_rate", "hop_length", "n_fft", "chunk_length")
PSEUDO_LABEL_FILE = "pseudo_labels.jsonl"


def whisper_processor(texts: Iterable[str], vocab_size: int = 1000, num_mel_bins: int = 80, chunk_length: int = 30,
                      sampling_rate: int = 16_000):
    """A `WhisperProcessor` built here: `WhisperFeatureExtractor(num_mel_bins, chunk_length)` and a
    `WhisperTokenizer` over a byte-level BPE of `vocab_size` entries trained on `texts` (special tokens first, so
    `<|endoftext|>` is id 0). English-only: its prefix is `<|startoftranscript|><|notimestamps|>`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import WhisperFeatureExtractor, WhisperProcessor, WhisperTokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    state = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["merges"]]
    tokenizer = WhisperTokenizer(vocab=state["vocab"], merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    tokenizer.set_prefix_tokens()  # the prefix ids are read at construction: again, now that the tokens exist
    extractor = WhisperFeatureExtractor(feature_size=num_mel_bins, chunk_length=chunk_length,
                                        sampling_rate=sampling_rate)
    return WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer)


def audio_sampling_rates(dataset: Any, audio_column: str) -> set[int]:
    """The sampling rates of an audio column: a `datasets.Audio` feature's own rate (datasets resamples to it when
    it decodes), else every row's `sampling_rate` (read from the Arrow column, without decoding the arrays)."""
    if audio_column not in dataset.column_names:
        raise ValueError(f"audio_column {audio_column!r} is not a column of the dataset ({dataset.column_names})")
    feature = dataset.features[audio_column]
    rate = getattr(feature, "sampling_rate", None)
    if rate is not None:
        return {int(rate)}
    if type(feature).__name__ == "Audio":
        raise ValueError(f"audio_column {audio_column!r} is a datasets.Audio column without a sampling_rate (each file "
                         f"decodes at its own rate): cast it to the feature extractor's, dataset.cast_column("
                         f"{audio_column!r}, datasets.Audio(sampling_rate=16000)) for Whisper")
    if not isinstance(feature, dict) or "sampling_rate" not in feature or "array" not in feature:
        raise ValueError(f"audio_column {audio_column!r} must hold {{'array', 'sampling_rate'}} rows or be a "
                         f"datasets.Audio column, got {feature}")
    import pyarrow.compute as pc

    # as Arrow: iterating the flattened column of a concatenated dataset fails in datasets 5 (KeyError)
    flat = dataset.select_columns([audio_column]).flatten().with_format("arrow")
    return {int(r) for r in pc.unique(flat[f"{audio_column}.sampling_rate"]).to_pylist()}


def check_audio(dataset: Any, audio_column: str, sampling_rate: int) -> None:
    """A one-line ValueError when the audio column is not all at `sampling_rate` (the feature extractor's)."""
    rates = audio_sampling_rates(dataset, audio_column)
    wrong = sorted(rates - {sampling_rate})
    if wrong:
        raise ValueError(f"audio_column {audio_column!r} has audio at {wrong} Hz, the feature extractor expects "
                         f"{sampling_rate} Hz: resample it first (dataset.cast_column({audio_column!r}, "
                         f"datasets.Audio(sampling_rate={sampling_rate})))")


def _too_long(seconds: float, count: int, where: str, extractor: Any) -> ValueError:
    return ValueError(f"{where}: {count} clip(s) up to {seconds:.1f} s, longer than the feature extractor's "
                      f"{extractor.chunk_length} s window, which would cut them while their transcripts keep every "
                      "word: drop or split them first (dataset.filter), or use a longer chunk_length")


def check_clip_lengths(dataset: Any, audio_column: str, extractor: Any) -> None:
    """A one-line ValueError when clips of an {"array", "sampling_rate"} audio column are longer than the feature
    extractor's window (read from the Arrow lengths, nothing decoded). A `datasets.Audio` column is checked by
    `SpeechSeq2SeqCollator` as its clips are decoded."""
    import pyarrow.compute as pc

    if audio_column not in dataset.column_names or getattr(dataset.features[audio_column], "sampling_rate", None):
        return
    flat = dataset.select_columns([audio_column]).flatten().with_format("arrow")
    lengths = pc.list_value_length(flat[f"{audio_column}.array"])
    long = pc.greater(lengths, extractor.n_samples)
    count = pc.sum(long).as_py() or 0
    if count:
        longest = pc.max(lengths).as_py() / extractor.sampling_rate
        raise _too_long(longest, count, f"audio_column {audio_column!r}", extractor)


def check_input_features(dataset: Any, extractor: Any) -> None:
    """A one-line ValueError when a dataset's precomputed `input_features` (its first row) are not the shape the
    feature extractor makes, mel bins x frames: the model's first convolution would fail on them mid-run."""
    if "input_features" not in dataset.column_names or len(dataset) == 0:
        return
    shape = tuple(torch.as_tensor(dataset.select_columns(["input_features"])[0]["input_features"]).shape)
    expected = (extractor.feature_size, extractor.nb_max_frames)
    if shape != expected:
        raise ValueError(f"input_features are {' x '.join(map(str, shape))} (mel bins x frames), the feature extractor "
                         f"makes {expected[0]} x {expected[1]} ({extractor.chunk_length} s): compute them with this "
                         "model's feature extractor, or give the raw audio")


def _extractor_settings(extractor: Any) -> dict[str, Any]:
    return {name: getattr(extractor, name, None) for name in FEATURE_FIELDS}


def check_feature_extractors(teacher_extractor: Any, student_extractor: Any, has_audio: bool) -> None:
    """A one-line ValueError when teacher and student need different log-mel features (mel bins, sampling rate,
    hop, FFT or window length): without the raw audio one set of `input_features` cannot serve both, and this
    package's distillation step feeds the same batch to both, so with it too."""
    t, s = _extractor_settings(teacher_extractor), _extractor_settings(student_extractor)
    diff = {k: (t[k], s[k]) for k in FEATURE_FIELDS if t[k] != s[k]}
    if not diff:
        return
    said = ", ".join(f"{k} {a} (teacher) vs {b} (student)" for k, (a, b) in diff.items())
    why = ("the dataset has no raw audio to compute each one's features from" if not has_audio else
           "the distillation step feeds one batch of input_features to both")
    raise ValueError(f"teacher and student feature extractors differ: {said}; {why}: build the student from the "
                     "teacher (it keeps the teacher's encoder and extractor) or give one with the teacher's extractor")


class SpeechSeq2SeqCollator:
    """Rows with raw audio (`audio_column`: {"array", "sampling_rate"}) or precomputed `input_features`, and a
    transcript (`text_column`) -> `input_features` and `labels` (-100 padding), as Whisper fine-tuning collates."""

    def __init__(self, processor: Any, text_column: str = "text", audio_column: str = "audio",
                 decoder_start_token_id: int | None = None) -> None:
        self.processor, self.text_column, self.audio_column = processor, text_column, audio_column
        self.decoder_start_token_id = decoder_start_token_id

    def features(self, rows: Sequence[dict]) -> torch.Tensor:
        if all("input_features" in r for r in rows):
            return torch.stack([torch.as_tensor(r["input_features"], dtype=torch.float32) for r in rows])
        extractor = self.processor.feature_extractor
        arrays = []
        for r in rows:
            audio = r[self.audio_column]
            if audio["sampling_rate"] != extractor.sampling_rate:
                raise ValueError(f"audio_column {self.audio_column!r}: a row at {audio['sampling_rate']} Hz, the "
                                 f"feature extractor expects {extractor.sampling_rate} Hz")
            arrays.append(audio["array"])
        long = [len(a) for a in arrays if len(a) > extractor.n_samples]
        if long:
            raise _too_long(max(long) / extractor.sampling_rate, len(long), f"audio_column {self.audio_column!r}",
                            extractor)
        out = extractor(arrays, sampling_rate=extractor.sampling_rate, return_tensors="pt")
        return out["input_features"]

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        batch = {"input_features": self.features(rows)}
        ids = [self.processor.tokenizer(r[self.text_column]).input_ids for r in rows]
        start = self.decoder_start_token_id
        if start is not None and all(x and x[0] == start for x in ids):
            ids = [x[1:] for x in ids]  # the model puts it back when it shifts the labels right
        width = max(len(x) for x in ids)
        batch["labels"] = torch.tensor([x + [-100] * (width - len(x)) for x in ids])
        if start is not None:  # Whisper has no prepare_decoder_input_ids_from_labels: the shift is made here
            pad = self.processor.tokenizer.pad_token_id
            shifted = torch.cat([torch.full((len(ids), 1), start), batch["labels"][:, :-1]], dim=1)
            batch["decoder_input_ids"] = shifted.masked_fill(shifted == -100, pad if pad is not None else start)
        return batch


def transcribe(model: Any, processor: Any, rows: Sequence[dict] | Any, batch_size: int = 16,
               audio_column: str = "audio", **generate_kwargs: Any) -> list[str]:
    """Greedy (or `generate_kwargs`) transcripts of `rows`, `batch_size` per `generate` call, special tokens
    dropped."""
    collate = SpeechSeq2SeqCollator(processor, audio_column=audio_column)
    texts: list[str] = []
    model.eval()
    device = next(model.parameters()).device
    for i in range(0, len(rows), batch_size):
        chunk = [rows[j] for j in range(i, min(i + batch_size, len(rows)))]
        features = collate.features(chunk).to(device=device, dtype=model.dtype)
        with torch.no_grad():
            tokens = model.generate(input_features=features, **generate_kwargs)
        texts.extend(processor.tokenizer.batch_decode(tokens, skip_special_tokens=True))
    return [t.strip() for t in texts]


def _settings_key(model: Any, dataset: Any, audio_column: str, generate_kwargs: dict) -> dict[str, Any]:
    from ..compat import dataset_fingerprint
    from .cache_key import teacher_fingerprint

    rows = dataset_fingerprint(dataset, None)
    if rows is None:
        raise ValueError("pseudo_label needs a datasets.Dataset (its fingerprint keys the resumable file)")
    return {"teacher": teacher_fingerprint(model), "rows": len(dataset), "dataset_fingerprint": rows,
            "audio_column": audio_column, "generate": {k: repr(v) for k, v in sorted(generate_kwargs.items())}}


def _read_done(path: Path) -> dict[int, str]:
    """Finished rows of the file; a last line cut by a kill is dropped (and cut from the file)."""
    done: dict[int, str] = {}
    if not path.exists():
        return done
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    for line in data[:end].decode("utf-8").splitlines():
        row = json.loads(line)
        done[int(row["row"])] = row["text"]
    return done


def pseudo_label(model: Any, processor: Any, dataset: Any, folder: str | os.PathLike, batch_size: int = 16,
                 audio_column: str = "audio", progress: Callable[[int, int], None] | None = None,
                 generate: bool = True, **generate_kwargs: Any) -> list[str]:
    """The teacher's transcript of every row of `dataset` (in row order), generated `batch_size` rows at a time and
    appended to `folder/pseudo_labels.jsonl` batch by batch: a second call (after a kill, or to read them back)
    generates only the rows the file lacks. A folder holding labels made with other settings is refused. Rows
    without `audio_column` must hold precomputed `input_features`. `generate=False` only reads them back: a folder
    that lacks rows is refused (a later stage never runs the teacher's generation unasked)."""
    if audio_column in dataset.column_names or "input_features" not in dataset.column_names:
        check_audio(dataset, audio_column, processor.feature_extractor.sampling_rate)
        check_clip_lengths(dataset, audio_column, processor.feature_extractor)
    else:
        check_input_features(dataset, processor.feature_extractor)
    folder = Path(folder)
    key = _settings_key(model, dataset, audio_column, generate_kwargs)
    meta_path, path = folder / "pseudo_labels.meta.json", folder / PSEUDO_LABEL_FILE
    if not generate:
        found = len(_read_done(path)) if meta_path.exists() else 0
        if found < len(dataset):
            raise ValueError(f"{folder} holds {found} of the {len(dataset)} pseudo-labels: label them first "
                             "(pseudo_label with generate=True; in distil_whisper, the pseudo_label stage)")
    if meta_path.exists() and not _read_done(path):  # a run that failed before its first batch: nothing to keep
        meta_path.write_text(json.dumps(key, indent=2) + "\n")
    elif meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old != key:
            changed = sorted(k for k in key if old.get(k) != key[k])
            raise ValueError(f"{folder} holds pseudo-labels made with other settings ({', '.join(changed)} differ): "
                             "give another folder, or remove it to label again")
    else:
        if path.exists():
            raise ValueError(f"{path} exists without its settings file: give another folder, or remove it")
        folder.mkdir(parents=True, exist_ok=True)
        meta_path.write_text(json.dumps(key, indent=2) + "\n")
    done = _read_done(path)
    todo = [i for i in range(len(dataset)) if i not in done]
    with open(path, "a", encoding="utf-8") as out:
        for start in range(0, len(todo), batch_size):
            ids = todo[start : start + batch_size]
            texts = transcribe(model, processor, dataset.select(ids), batch_size=len(ids),
                               audio_column=audio_column, **generate_kwargs)
            out.write("".join(json.dumps({"row": i, "text": t}) + "\n" for i, t in zip(ids, texts)))
            out.flush()
            os.fsync(out.fileno())
            done.update(zip(ids, texts))
            if progress is not None:
                progress(len(done), len(dataset))
    return [done[i] for i in range(len(dataset))]


def digest(texts: Sequence[str]) -> str:
    """A short hash of a list of texts (what a results file records of the pseudo-labels it used)."""
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
