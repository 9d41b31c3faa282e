"""Offline teacher signal for causal LMs: a causal-LM teacher's top-k log-probabilities and tail mass, computed once.

A large teacher's forward pass dominates a distillation step; its output at each counted position is well kept by
its k most likely ids plus the mass of every other id (the tail). `create_teacher_signal` runs the teacher batched
over tokenised rows and writes, for each position the trainer's KD term counts (`kd_positions` of
hf_distill.losses.normalise, shifted as a causal LM: `kd_token_mask="labels"` keeps the positions whose *next* label
is not -100, `"attention"` the real tokens with a real successor), the top-k log-probabilities at `temperature`,
their ids and `log(1 - sum top-k probabilities)`. The student then trains from it without the teacher
(`DistillationTrainer(teacher_model=None, train_dataset=attach_teacher_signal(rows, signal))`) with any sparse
divergence (the `(log_probs, indices, log_tail)` teacher of hf_distill.losses: k + 1 outcomes, a true divergence).

Layout (one row per training row, only its counted positions, in order; `datasets` features declared):

- `teacher_signal_topk`: `List(uint32)`, n * k entries. Vocabularies up to 2**17 ids ("packed" layout): `id << 15`
  in the high 17 bits, the float16 bits of `-log_prob` (>= 0, so its sign bit is free) in the low 15: 4 bytes per
  entry, the float16 value kept exactly. Larger vocabularies ("split" layout): the ids alone, and
  `teacher_signal_values`: `List(float16)` the log-probabilities, 6 bytes per entry.
- `teacher_signal_tail`: `List(float32)`, n entries: log of the tail mass, computed as the logsumexp of the non-top-k
  log-probabilities (no cancellation when the top k hold nearly all of the mass; -inf when k is the vocabulary).
- `teacher_signal_row`: `int64`, a hash of the row's `input_ids`, checked against the training rows.
- `teacher_signal_positions`: `int64`, a hash of the row's counted positions (from its labels or attention mask, by
  kd_token_mask), checked against the training rows and every batch: rows whose labels moved are refused.

At k = 64 the packed layout takes 64 * 4 + 4 = 260 bytes per counted token plus the list offsets (`bytes_per_token`
in the metadata is measured on the written files). When read back, the float16 values and the tail are renormalised
together (their mass sums to 1 up to float16 rounding), so the teacher is a distribution over k + 1 outcomes.

The metadata (teacher name and weight fingerprint, vocabulary hash, k, temperature, kd_token_mask, versions, the
command that made it) is kept in the Dataset's `info.description` (which `save_to_disk`/`load_from_disk`, `select`,
`concatenate_datasets` keep; `streamed` keeps it in an IterableDataset) and in `teacher_signal.json` next to the
shards. The trainer refuses a signal whose vocabulary, temperature, kd_token_mask, rows or rows' counted positions
differ from the run's
(`check_teacher_signal`, in hf_distill.data.signal_format with the hashes and the metadata, all importable from here
too); hf_distill.data.signal_rescale changes the temperature where that is exact.

Writing is resumable: rows are written in shards of `rows_per_shard` (each renamed into place when complete); run
the same call again after an interruption and the finished shards are kept. hf_distill.data.signal_hub pushes a
signal to the Hub as a dataset repo with a dataset card; `load_teacher_signal("user/name")` loads it back. Training
from a signal goes through the chunked causal-LM loss head (hf_distill.losses.sparse_head: the student's logits a
chunk at a time, never whole) wherever a dense teacher would.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from datasets.arrow_writer import ArrowWriter
from torch import nn
from tqdm.auto import tqdm

from ..base.positions import kd_positions
from ..base.recorded_names import recorded_name, recorded_path
from ..features.taps import unwrap
from ..teacher import teacher_tokenizer
from .cache_key import _dataset_digest, teacher_fingerprint
from .signal_checks import META_FILE as _META_FILE
from .signal_checks import check_signal_run, check_signal_settings, check_signal_tokenizer
from .signal_compact import CompactSpec, adaptive_counts, decode_rows, encode_rows, layout_spec, normalised
from .signal_format import (
    _MARKER,
    ADAPTIVE_FORMAT,
    COMPACT_FORMAT,
    DAMAGED,
    SIGNAL_CODES,
    SIGNAL_FORMAT,
    SIGNAL_POSITIONS,
    SIGNAL_ROW,
    SIGNAL_SPEC,
    SIGNAL_TAIL,
    SIGNAL_TOPK,
    SIGNAL_VALUES,
    _format_checked,
    attach_teacher_signal,
    check_batch_positions,
    check_signal_entries,
    check_teacher_signal,
    counted_positions,
    padded_rows,
    positions_hashes,
    row_hash,
    signal_metadata,
    vocabulary_hash,
)

__all__ = [
    "SIGNAL_CODES",
    "SIGNAL_POSITIONS",
    "SIGNAL_ROW",
    "SIGNAL_TAIL",
    "SIGNAL_TOPK",
    "SIGNAL_VALUES",
    "attach_teacher_signal",
    "check_signal_settings",
    "check_teacher_signal",
    "create_teacher_signal",
    "load_teacher_signal",
    "positions_hashes",
    "row_hash",
    "signal_metadata",
    "signal_teacher",
    "streamed",
    "vocabulary_hash",
]

_ID_BITS, _VALUE_BITS = 17, 15


# ---------------------------------------------------------------------- creating the signal


def create_teacher_signal(
    teacher: nn.Module,
    dataset: datasets.Dataset,
    output_dir: str | os.PathLike,
    *,
    tokenizer: Any,
    k: int = 64,
    temperature: float = 1.0,
    kd_token_mask: str = "labels",
    batch_size: int = 8,
    rows_per_shard: int = 1024,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    teacher_name: str | None = None,
    progress: bool = True,
    command: str | None = None,
    layout: str | None = None,
    value_bits: int | None = None,
    value_step: float | None = None,
    epsilon: float | None = None,
) -> datasets.Dataset:
    """The teacher signal of `teacher` over `dataset`, written to `output_dir` (resumed if it holds part of it).

    Args:
        teacher: a causal-LM teacher (its forward returns `logits` of shape (batch, length, vocabulary)).
        dataset: tokenised rows: `input_ids`, optionally `attention_mask`, and `labels` (-100 where not learnt) for
            `kd_token_mask="labels"`.
        tokenizer: the teacher's tokenizer (its vocabulary hash is recorded; the student's must match).
        k: ids kept per position; temperature: the temperature of the stored log-probabilities (training must use
            the same `DistillationArguments.temperature`).
        kd_token_mask: the positions stored, by the trainer's rule (`"labels"` or `"attention"`); training must use
            the same.
        batch_size: rows per teacher forward (the signal does not depend on it); rows_per_shard: rows per file (the
            unit of resumption).
        dtype: run the teacher under autocast in this dtype (torch.bfloat16 or torch.float16, on CPU or GPU);
            torch.float32 or None: as it is (float32 is refused for a teacher loaded in lower precision).
        device: where the teacher runs, which must hold its weights (default: where its parameters are).
        teacher_name: recorded as the teacher's name (default: its `name_or_path`; a local folder is recorded by its
            name, hf_distill.recorded_names).
        command: how the signal was made, for its dataset card (the CLI gives its command line; default: this
            call, written as Python).
        layout: None: format 2 ("packed", or "split" past 2**17 ids); "compact": format 3 (hf_distill.data
            .signal_compact: bit-packed ids, log-probabilities quantised to `value_bits` bits in steps of
            `value_step` nats below each position's largest; default: 8 bits, a 16-nat range), about 80 bytes a
            token at k = 32 of a 4,096-id vocabulary. Either given without layout="compact" is refused.
        epsilon: with layout="compact", adaptive k (format 4): each position keeps the fewest of its k ids whose
            probabilities sum to at least 1 - epsilon (its count is stored) and the exact mass of every other id.
    """
    inner = unwrap(teacher)
    vocab = getattr(getattr(inner, "config", None), "vocab_size", None)
    if not isinstance(vocab, int):
        raise ValueError("The teacher has no config.vocab_size: give a transformers causal-LM teacher.")
    check_signal_settings(dataset, output_dir, k=k, temperature=temperature, kd_token_mask=kd_token_mask,
                          vocab_size=vocab, batch_size=batch_size, rows_per_shard=rows_per_shard)
    spec = layout_spec(layout, k, vocab, value_bits, value_step, epsilon)
    check_signal_tokenizer(tokenizer, vocab, own=teacher_tokenizer(teacher)[0])
    run_on = check_signal_run(teacher, dtype, device)
    columns = [c for c in ("input_ids", "attention_mask", "labels") if c in dataset.column_names]
    name = recorded_name(teacher_name or getattr(inner, "name_or_path", None)
                         or getattr(inner.config, "name_or_path", "") or "")  # never an absolute path
    import hf_distill

    meta = {"format": SIGNAL_FORMAT if spec is None else COMPACT_FORMAT if epsilon is None else ADAPTIVE_FORMAT,
            "teacher": name,
            "teacher_fingerprint": teacher_fingerprint(teacher),
            "vocab_hash": vocabulary_hash(tokenizer), "vocab_size": vocab, "k": k, "temperature": float(temperature),
            "kd_token_mask": kd_token_mask,
            "layout": "compact" if spec else "packed" if vocab <= 2**_ID_BITS else "split",
            **({"id_bits": spec.id_bits, "value_bits": spec.value_bits, "value_step": spec.value_step} if spec else {}),
            **({"epsilon": float(epsilon), "count_bits": spec.count_bits} if epsilon is not None else {}),
            "dtype": None if dtype is None else str(dtype), "rows": len(dataset), "rows_per_shard": rows_per_shard,
            "dataset": _dataset_digest(dataset, columns), "hf_distill": hf_distill.__version__}
    folder = Path(output_dir)
    meta["command"] = command or (
        f"create_teacher_signal({name!r}, <{len(dataset)} rows>, {recorded_path(folder)!r}, k={k}, "
        f"temperature={float(temperature)}, kd_token_mask={kd_token_mask!r}, batch_size={batch_size}, "
        f"dtype={meta['dtype']}" + (f", layout='compact', value_bits={spec.value_bits}, value_step={spec.value_step}"
                                    if spec else "") + (f", epsilon={float(epsilon)}" if epsilon is not None else "")
        + ")")
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    _check_resumable(folder, meta)
    fresh = not any(folder.glob("shard-*.arrow"))
    (folder / _META_FILE).write_text(json.dumps({**meta, "complete": False}, indent=2) + "\n")
    shards = [(s, min(s + rows_per_shard, len(dataset))) for s in range(0, len(dataset), rows_per_shard)]
    todo = [i for i, (s, e) in enumerate(shards) if not _shard_ok(_shard_path(folder, i), e - s)]
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    source = dataset.select_columns(columns).with_format(None)
    was_training = teacher.training
    teacher.eval()
    bar = tqdm(total=len(dataset), initial=len(dataset) - sum(shards[i][1] - shards[i][0] for i in todo),
               desc="Teacher signal", unit="rows", disable=not progress)
    # The teacher's forwards on this thread; packing each batch and writing each shard on one worker thread, so the
    # teacher runs the next batch meanwhile (torch and numpy release the GIL). At most two batches wait for it.
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="teacher-signal")
    try:
        for i in todo:
            start, end = shards[i]
            tables = []
            for s in range(start, end, batch_size):
                rows = source[s : min(s + batch_size, end)]
                tables.append(pool.submit(_rows_table, *_signal_table(teacher, rows, meta, pad_id, run_on, dtype),
                                          meta))
                while sum(not t.done() for t in tables) > 2:
                    next(t for t in tables if not t.done()).result()
                bar.update(len(rows["input_ids"]))
            pool.submit(_write_shard, _shard_path(folder, i), [t.result() for t in tables], meta).result()
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        if fresh and not any(folder.glob("shard-*.arrow")):  # nothing to resume: leave nothing that refuses a fix
            (folder / _META_FILE).unlink(missing_ok=True)
            if created and not any(folder.iterdir()):
                folder.rmdir()
        raise
    finally:
        pool.shutdown(wait=True)
        bar.close()
        teacher.train(was_training)
    paths = [_shard_path(folder, i) for i in range(len(shards))]
    positions = sum(_positions(p) for p in paths)
    meta["positions"] = positions
    # Measured: the files (with Arrow's per-file schema and footer) and the column buffers alone (the payload).
    meta["bytes_per_token"] = round(sum(p.stat().st_size for p in paths) / max(positions, 1), 2)
    payload = sum(datasets.Dataset.from_file(str(p)).data.nbytes for p in paths)
    meta["payload_bytes_per_token"] = round(payload / max(positions, 1), 2)
    (folder / _META_FILE).write_text(json.dumps({**meta, "complete": True}, indent=2) + "\n")
    return load_teacher_signal(folder)


def _signal_table(teacher, rows: dict[str, list], meta: dict, pad_id: int, device, dtype) -> tuple:
    """One batch of rows: a right-padded teacher forward, then each counted position's top-k log-probabilities
    (float32, decreasing), ids and log tail mass on the CPU, with what `_rows_table` needs of the rows."""
    ids_rows = rows["input_ids"]
    ids, mask, labels = padded_rows(rows, pad_id)
    counted = counted_positions(mask, labels, meta["kd_token_mask"])
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype not in (None, torch.float32)
                else contextlib.nullcontext())
    with torch.no_grad(), autocast:
        out = teacher(input_ids=ids.to(device), attention_mask=mask.to(device))
    logits = out["logits"] if isinstance(out, dict) else out.logits
    z = logits[:, :-1][counted.to(logits.device)]  # (positions, vocabulary), rows in order, positions ascending
    k, T = meta["k"], meta["temperature"]
    values, top, tails = [], [], []
    step = max(1, 2**24 // z.shape[-1])  # positions per block: about 64 MB of float32 log-probabilities
    for part in z.split(step):
        log_p = F.log_softmax(part.float() / T, dim=-1)
        v, idx = log_p.topk(k, dim=-1)
        tails.append(log_p.scatter(-1, idx, float("-inf")).logsumexp(-1))  # log mass of the non-top-k ids
        values.append(v)
        top.append(idx)
    v = torch.cat(values).cpu() if values else torch.zeros(0, k)
    idx = torch.cat(top).cpu() if top else torch.zeros(0, k, dtype=torch.long)
    tail = torch.cat(tails).cpu() if tails else torch.zeros(0)
    return v, idx, tail, counted.cpu(), mask, ids_rows


def _rows_table(v: torch.Tensor, idx: torch.Tensor, tail: torch.Tensor, counted: torch.Tensor,
                mask: torch.Tensor | None, ids_rows: list, meta: dict) -> pa.Table:
    """The signal rows of one batch in the metadata's layout: positions' top-k `(n, k)` and tails `(n,)`, rows'
    positions back to back (`counted`: (B, T - 1), kd_positions' causal mask of the right-padded rows)."""
    k = meta["k"]
    per_row = counted.sum(-1).to(torch.int64)
    offsets = np.concatenate([[0], per_row.cumsum(0).numpy()]).astype(np.int32)
    table = {}
    if meta["layout"] == "compact":
        spec = _spec(meta)
        counts = None
        if spec.count_bits:  # adaptive k: each position's count, and the mass of every id past it as its tail
            counts, tail = adaptive_counts(v, tail, meta["epsilon"])
        codes = encode_rows(v, idx, per_row.tolist(), spec, counts)
        sizes = np.concatenate([[0], np.cumsum([len(c) for c in codes])]).astype(np.int32)
        table[SIGNAL_CODES] = pa.ListArray.from_arrays(pa.array(sizes), pa.array(
            np.concatenate(codes) if codes else np.zeros(0, np.uint8)))
        table[SIGNAL_SPEC] = pa.array([spec.row] * len(ids_rows), pa.list_(pa.float64()))
        tail16 = tail.numpy().astype(np.float16)
    else:
        topk, values16 = pack(v, idx, meta["layout"])
        table[SIGNAL_TOPK] = pa.ListArray.from_arrays(pa.array(offsets * k), pa.array(topk.reshape(-1)))
        if values16 is not None:
            table[SIGNAL_VALUES] = pa.ListArray.from_arrays(pa.array(offsets * k), pa.array(values16.reshape(-1)))
        tail16 = tail.numpy().astype(np.float32)
    table[SIGNAL_TAIL] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(tail16))
    table[SIGNAL_ROW] = pa.array([row_hash(r) for r in ids_rows], pa.int64())
    table[SIGNAL_POSITIONS] = pa.array(positions_hashes(counted, mask), pa.int64())
    return pa.table(table)


def _spec(meta: dict) -> CompactSpec:
    return CompactSpec(meta["k"], meta["id_bits"], meta["value_bits"], meta["value_step"], meta.get("count_bits", 0))


def pack(log_probs: torch.Tensor, ids: torch.Tensor, layout: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Top-k log-probabilities (<= 0) and ids -> the stored uint32 column and, in the "split" layout, the float16
    values. "packed": `id << 15 | float16 bits of -log_prob` (its sign bit is always 0), ids below 2**17."""
    magnitude = log_probs.neg().abs().to(torch.float16)  # |log p|; abs() also turns -0.0 into 0.0
    if layout == "split":
        return ids.numpy().astype(np.uint32), (-magnitude.float()).to(torch.float16).numpy()
    if ids.numel() and int(ids.max()) >= 2**_ID_BITS:
        raise ValueError(f"The packed layout holds ids below 2**{_ID_BITS}, got {int(ids.max())}.")
    bits = magnitude.view(torch.int16).to(torch.int64) & (2**_VALUE_BITS - 1)
    return ((ids.to(torch.int64) << _VALUE_BITS) | bits).numpy().astype(np.uint32), None


def unpack(topk: torch.Tensor, values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored column(s) -> (float32 log-probabilities, int64 ids); `values` given: the "split" layout."""
    topk = topk.to(torch.int64)
    if values is not None:
        return values.float(), topk
    bits = (topk & (2**_VALUE_BITS - 1)).to(torch.int16)
    return -bits.view(torch.float16).float(), topk >> _VALUE_BITS


def _features(layout: str) -> datasets.Features:
    if layout == "compact":
        features = {SIGNAL_CODES: datasets.List(datasets.Value("uint8")),
                    SIGNAL_SPEC: datasets.List(datasets.Value("float64")),
                    SIGNAL_TAIL: datasets.List(datasets.Value("float16"))}
    else:
        features = {SIGNAL_TOPK: datasets.List(datasets.Value("uint32"))}
        if layout == "split":
            features[SIGNAL_VALUES] = datasets.List(datasets.Value("float16"))
        features[SIGNAL_TAIL] = datasets.List(datasets.Value("float32"))
    features[SIGNAL_ROW] = datasets.Value("int64")
    features[SIGNAL_POSITIONS] = datasets.Value("int64")
    return datasets.Features(features)


def _shard_path(folder: Path, i: int) -> Path:
    return folder / f"shard-{i:05d}.arrow"


def _write_shard(path: Path, tables: list[pa.Table], meta: dict) -> None:
    """Written beside, then renamed: a shard file exists only when complete."""
    table = pa.concat_tables(tables)
    features = _features(meta["layout"])
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = ArrowWriter(features=features, path=str(tmp))
    try:
        writer.write_table(table.select(list(features)).cast(features.arrow_schema))
        writer.finalize()
    finally:
        writer.close()
    os.replace(tmp, path)


def _shard_ok(path: Path, rows: int) -> bool:
    if not path.is_file():
        return False
    try:
        return len(datasets.Dataset.from_file(str(path))) == rows
    except Exception:  # a broken file is rewritten, never trusted
        return False


def _positions(path: Path) -> int:
    tails = datasets.Dataset.from_file(str(path)).data.column(SIGNAL_TAIL)
    return sum(len(chunk.flatten()) for chunk in tails.chunks)


def _check_resumable(folder: Path, meta: dict) -> None:
    """A folder holding (part of) another signal is refused, not overwritten or mixed with this one (one holding
    other files: check_signal_settings). Resuming keeps the command that started it (its card says how it was made)."""
    path = folder / _META_FILE
    if not path.is_file():
        return
    old = json.loads(path.read_text())
    keys = [k for k in meta if k not in ("hf_distill", "command")]
    changed = [k for k in keys if old.get(k) != meta[k]]
    if changed:
        values = "; ".join(f"{k}: {old.get(k)} there, {meta[k]} now" for k in changed)
        raise ValueError(f"{folder} holds a teacher signal made with other settings ({', '.join(changed)} differ: "
                         f"{values}), so it cannot be resumed: choose another output_dir, or delete that folder.")
    meta["command"] = old.get("command") or meta["command"]


# ---------------------------------------------------------------------- reading it


def load_teacher_signal(
    path: str | os.PathLike, streaming: bool = False, *, revision: str | None = None, token: str | None = None
) -> datasets.Dataset | datasets.IterableDataset:
    """The signal written by `create_teacher_signal` (complete only), as a Dataset or, with `streaming`, an
    IterableDataset (one shard per file) that reads the files as it goes. `path` is its folder or, when no such
    folder exists, a Hub dataset repo id ("user/name", at `revision`) pushed by `signal_hub.push_teacher_signal`:
    downloaded once into the Hub cache, then read from there (offline too)."""
    folder = Path(path)
    if not folder.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)):
        from .signal_download import download_teacher_signal

        folder = download_teacher_signal(str(path), revision=revision, token=token)
    meta_path = folder / _META_FILE
    if not meta_path.is_file():
        raise ValueError(f"{folder} holds no teacher signal ({_META_FILE} is missing).")
    meta = json.loads(meta_path.read_text())
    _format_checked(meta, f"The teacher signal in {folder}")
    if not meta.pop("complete", False):
        raise ValueError(f"The teacher signal in {folder} is incomplete: run create_teacher_signal again to finish it.")
    shards = sorted(folder.glob("shard-*.arrow"))
    info = datasets.DatasetInfo(description=_MARKER + json.dumps(meta, sort_keys=True),
                                features=_features(meta["layout"]))
    parts = []
    for shard in shards:
        try:
            parts.append(datasets.Dataset.from_file(str(shard), info=info))
        except (OSError, pa.ArrowException) as err:  # a truncated or overwritten Arrow stream
            raise ValueError(f"The teacher signal in {folder}: {shard.name} cannot be read ({err}), a truncated or "
                             "damaged file: download the signal again, or run the command that made it again, which "
                             f"rewrites the shards it cannot read ({meta.get('command')}).") from None
    signal = datasets.concatenate_datasets(parts, info=info)
    if len(signal) != meta["rows"]:
        raise ValueError(f"The teacher signal in {folder} has {len(signal)} rows in {len(shards)} shard files, its "
                         f"metadata says {meta['rows']}: {DAMAGED}.")
    return streamed(signal, num_shards=len(shards)) if streaming else signal


def streamed(dataset: datasets.Dataset, num_shards: int = 1) -> datasets.IterableDataset:
    """`dataset.to_iterable_dataset(num_shards)` (streamed from its files) with the signal's metadata kept, which
    `to_iterable_dataset` drops: stream a signal, or rows joined with one, to the trainer this way."""
    stream = dataset.with_format(None).to_iterable_dataset(num_shards=num_shards)  # rows as Python lists
    stream.info.description = dataset.info.description
    return stream


# ---------------------------------------------------------------------- the teacher of a batch


def signal_teacher(
    cached: dict[str, Any], inputs: dict[str, Any], label_name: str, kd_token_mask: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's signal as the `(log_probs, indices, log_tail)` teacher of hf_distill.losses, (B, T, k), (B, T, k)
    and (B, T), aligned with the student's unshifted logits (position t predicts token t + 1; the last position and
    the uncounted ones hold zeros, which the KD mask leaves out). `cached` holds the `teacher_signal_*` columns as
    TeacherOutputsCollator pads them: (B, n_max) tails padded with NaN (a stored tail is never NaN), (B, n_max * k)
    top-k entries."""
    ids = inputs["input_ids"]
    counted = kd_positions(inputs.get("attention_mask"), inputs.get(label_name), kd_token_mask, causal=True)
    if counted is None:
        counted = torch.ones(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool, device=ids.device)
    tails = torch.as_tensor(cached[SIGNAL_TAIL]).to(ids.device).float()
    stored = ~tails.isnan()
    for i, (n_stored, n) in enumerate(zip(stored.sum(-1).tolist(), counted.sum(-1).tolist(), strict=True)):
        if n_stored != n:
            raise ValueError(
                f"Row {i} of this batch counts {n} KD positions but its teacher signal holds {n_stored}: the batch's "
                "labels or attention mask differ from the rows' when the signal was made (a collator that changes "
                "labels, truncation or kd_token_mask). Collate the rows as they were when the signal was created.")
    check_batch_positions(cached, counted, inputs.get("attention_mask"))
    n_total = int(stored.sum())
    if SIGNAL_CODES in cached:  # the compact layout: each row's bit stream, its spec on every row
        spec_row = torch.as_tensor(cached[SIGNAL_SPEC])[0].tolist()
        spec = CompactSpec(int(spec_row[0]), int(spec_row[1]), int(spec_row[2]), float(spec_row[3]),
                           int(spec_row[4]) if len(spec_row) > 4 else 0)  # a fifth entry: adaptive k
        k = spec.k
        relative, indices = decode_rows(list(torch.as_tensor(cached[SIGNAL_CODES]).cpu().numpy()),
                                        stored.sum(-1).tolist(), spec)
        tail = tails[stored].view(n_total)
        check_signal_entries(relative, indices, tail.cpu(), stored.nonzero()[:, 0].cpu())
        outcomes = torch.cat([normalised(relative.to(ids.device), tail), tail[:, None]], -1)
        indices = indices.to(ids.device)
    else:
        topk = torch.as_tensor(cached[SIGNAL_TOPK]).to(ids.device)
        k = topk.shape[1] // tails.shape[1] if tails.shape[1] else 1
        entries = stored.repeat_interleave(k, dim=1)  # each stored position's k entries
        split = torch.as_tensor(cached[SIGNAL_VALUES]).to(ids.device)[entries] if SIGNAL_VALUES in cached else None
        values, indices = unpack(topk[entries], split)
        check_signal_entries(values.view(n_total, k), indices.view(n_total, k), tails[stored],
                             stored.nonzero()[:, 0])
        outcomes = torch.cat([values.view(n_total, k), tails[stored].view(n_total, 1)], -1)
        outcomes = outcomes - outcomes.logsumexp(-1, keepdim=True)  # float16 rounding: k + 1 outcomes sum to 1
    b, t = ids.shape
    log_probs = torch.zeros(b, t, k, device=ids.device)
    index = torch.zeros(b, t, k, dtype=torch.long, device=ids.device)
    log_tail = torch.zeros(b, t, device=ids.device)
    log_probs[:, :-1][counted] = outcomes[:, :k]
    index[:, :-1][counted] = indices.view(n_total, k)
    log_tail[:, :-1][counted] = outcomes[:, k]
    return log_probs, index, log_tail
