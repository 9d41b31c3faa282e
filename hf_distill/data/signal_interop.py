"""Teacher signals other tools publish, read into an hf_distill signal, and the column format written on request.

Two formats are read (docs/guides/teacher_signal.md states each one's fields and the schema source followed):

- the `(topk_ids, topk_logprobs)` column format (axolotl, verl, VeOmni): per row `input_ids` and, per next-token
  position, the teacher's top-k ids and their log-probabilities (`import_topk_columns`);
- DistillKit's compressed parquet files (`sample_logits_vllm`): per row `input_ids`, `compressed_logprobs` and
  `bytepacked_indices` (one byte string per position), with the `compression_config.yaml` written beside them
  (`import_distillkit`, decoded by hf_distill.data.signal_distillkit).

Both hold, for a row of n tokens, n - 1 positions (position t: the distribution of token t + 1; vLLM's prompt
log-probabilities without the first, empty one); the signal keeps those its kd_token_mask counts. Neither records
the tail mass: it is `1 - sum of the stored top-k` (computed in float64). What a signal needs and these formats
may lack is refused in one line before anything is written: the temperature the log-probabilities were taken at (pass
`temperature=` when the data does not record it), the vocabulary (`tokenizer`: the teacher's; ids past it, or a
DistillKit `d` smaller than it, are another vocabulary), and rows whose tokens are not the training rows' or whose
positions do not match their counted tokens. The result is a signal folder of this package (format 2, or 3 with
`layout="compact"`), checked and trained from like one it made: `attach_teacher_signal(rows, signal)`, then
`DistillationTrainer(teacher_model=None, ...)`.

`export_topk_columns(signal)` writes the column format: one list per next-token position, empty where the signal's
kd_token_mask counts no token, the temperature and vocabulary hash in the Dataset's info.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import torch

from .cache_key import _dataset_digest
from .signal_checks import META_FILE, check_signal_settings
from .signal_compact import layout_spec
from .signal_format import (
    COMPACT_FORMAT,
    SIGNAL_FORMAT,
    counted_positions,
    padded_rows,
    row_hash,
    signal_metadata,
    vocabulary_hash,
)
from .teacher_signal import _rows_table, _shard_path, _write_shard, load_teacher_signal, signal_teacher

__all__ = ["EXPORT_MARKER", "export_topk_columns", "import_distillkit", "import_topk_columns"]

EXPORT_MARKER = "hf_distill.topk_columns "


def import_topk_columns(data: datasets.Dataset, rows: datasets.Dataset, output_dir: str | os.PathLike, *,
                        tokenizer: Any, temperature: float | None = None, k: int | None = None,
                        kd_token_mask: str = "labels", layout: str | None = None, value_bits: int | None = None,
                        value_step: float | None = None, ids_column: str = "topk_ids",
                        logprobs_column: str = "topk_logprobs", source: str = "topk columns") -> datasets.Dataset:
    """A signal of `rows` (the training rows: `input_ids`, `labels`...) from `data` in the column format, written to
    `output_dir`. `temperature`: the one the log-probabilities were taken at, needed unless `data` records it (an
    export of this package does); `k`: ids kept per position (default: the first position's count; a position with
    fewer is refused, one with more keeps its k most likely)."""
    missing = [c for c in ("input_ids", ids_column, logprobs_column) if c not in data.column_names]
    if missing:
        raise ValueError(f"The {source} data lacks {missing} (columns: {data.column_names}): the format needs "
                         f"input_ids, {ids_column} and {logprobs_column} per row.")
    recorded = _recorded(data)
    columns = data.select_columns(["input_ids", ids_column, logprobs_column]).with_format(None)

    def positions(i: int, row: dict) -> tuple[np.ndarray, np.ndarray]:
        ids, lps = row[ids_column], row[logprobs_column]
        if len(ids) != len(lps) or any(len(a) != len(b) for a, b in zip(ids, lps, strict=True)):
            raise ValueError(f"Row {i} of the {source} data has {ids_column} and {logprobs_column} of different "
                             "shapes: each position needs as many log-probabilities as ids.")
        return ids, lps

    return _import(columns, rows, output_dir, positions, tokenizer=tokenizer, temperature=temperature,
                   recorded=recorded, k=k, kd_token_mask=kd_token_mask, layout=layout, value_bits=value_bits,
                   value_step=value_step, source=source, vocab=None)


def import_distillkit(path: str | os.PathLike, rows: datasets.Dataset, output_dir: str | os.PathLike, *,
                      tokenizer: Any, temperature: float | None = None, config: dict | None = None,
                      kd_token_mask: str = "labels", layout: str | None = None, value_bits: int | None = None,
                      value_step: float | None = None) -> datasets.Dataset:
    """A signal of `rows` from DistillKit's compressed parquet files in `path` (a folder, with the
    `compression_config.yaml` DistillKit writes beside them unless `config` gives its fields). DistillKit records
    no temperature in the files: pass the one its logits were sampled at (its `preapplied_temperature`)."""
    from .signal_distillkit import DistillKitConfig, decode_position

    folder = Path(path)
    files = sorted(folder.glob("*.parquet")) if folder.is_dir() else [folder]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"{path}: no DistillKit parquet files there (give the folder sample_logits_vllm wrote).")
    if config is None:
        import yaml

        found = [p for p in (folder / "compression_config.yaml", folder.parent / "compression_config.yaml")
                 if p.is_file()]
        if not found:
            raise ValueError(f"{path}: no compression_config.yaml beside the parquet files: pass config= with "
                             "DistillKit's DistributionQuantizationConfig fields (d, k, exact_k, ...).")
        config = yaml.safe_load(found[0].read_text())
        config = config.get("logprob_compressor", config)
    cfg = DistillKitConfig.from_dict(config)
    data = datasets.Dataset.from_parquet([str(f) for f in files])
    need = [c for c in ("input_ids", "compressed_logprobs", "bytepacked_indices") if c not in data.column_names]
    if need:
        raise ValueError(f"{path}: the DistillKit data lacks {need} (columns: {data.column_names}).")
    data = data.select_columns(["input_ids", "compressed_logprobs", "bytepacked_indices"]).with_format(None)

    def positions(i: int, row: dict) -> tuple[np.ndarray, np.ndarray]:
        decoded = [decode_position(lp, ix, cfg) for lp, ix in zip(row["compressed_logprobs"],
                                                                    row["bytepacked_indices"], strict=True)]
        ids = np.stack([d[0] for d in decoded]) if decoded else np.zeros((0, cfg.k), np.int64)
        lps = np.stack([d[1] for d in decoded]) if decoded else np.zeros((0, cfg.k))
        return ids, lps

    return _import(data, rows, output_dir, positions, tokenizer=tokenizer, temperature=temperature, recorded={},
                   k=cfg.k, kd_token_mask=kd_token_mask, layout=layout, value_bits=value_bits,
                   value_step=value_step, source="DistillKit", vocab=cfg.d)


def _recorded(data: Any) -> dict:
    for line in (getattr(getattr(data, "info", None), "description", None) or "").splitlines():
        if line.startswith(EXPORT_MARKER):
            return json.loads(line[len(EXPORT_MARKER):])
    return {}


def _import(data, rows, output_dir, positions, *, tokenizer, temperature, recorded, k, kd_token_mask, layout,
            value_bits, value_step, source, vocab) -> datasets.Dataset:
    """Check everything first (one line naming the field and the fix), then write the signal's shards."""
    temperature = temperature if temperature is not None else recorded.get("temperature")
    if temperature is None:
        raise ValueError(f"The {source} data records no temperature: pass temperature= (the one its "
                         "log-probabilities were taken at; DistillKit's preapplied_temperature, 1.0 for plain vLLM "
                         "prompt_logprobs).")
    size = len(tokenizer) if tokenizer is not None and hasattr(tokenizer, "__len__") else None
    if size is None:
        raise ValueError(f"tokenizer: the teacher's tokenizer is needed (the {source} ids refer to its vocabulary).")
    vocab_hash = vocabulary_hash(tokenizer)
    if recorded.get("vocab_hash") not in (None, vocab_hash):
        raise ValueError(f"The {source} data was made with another vocabulary (hash {recorded['vocab_hash']}) than "
                         f"tokenizer's ({vocab_hash}): give the tokenizer of the teacher that made it.")
    if vocab is not None and vocab < size:
        raise ValueError(f"The {source} data's vocabulary has {vocab} ids (d), fewer than tokenizer's {size}: it "
                         "was made with another vocabulary; give the tokenizer of the teacher that made it.")
    vocab = max(vocab or size, size)
    if len(data) != len(rows):
        raise ValueError(f"The {source} data has {len(data)} rows, the training rows {len(rows)}: give the rows it "
                         "was made from, in its order.")
    k = k or recorded.get("k")
    if k is None:
        first = next((len(p) for i, r in enumerate(data) for p in positions(i, r)[0] if len(p)), None)
        k = first or 1
    check_signal_settings(rows, output_dir, k=k, temperature=temperature, kd_token_mask=kd_token_mask,
                          vocab_size=vocab, rows_per_shard=1024)
    if (Path(output_dir) / META_FILE).is_file():  # an import is not resumed: never write over a signal
        raise ValueError(f"{output_dir} already holds a teacher signal: choose a new output_dir for the import.")
    spec = layout_spec(layout, k, vocab, value_bits, value_step)
    columns = [c for c in ("input_ids", "attention_mask", "labels") if c in rows.column_names]
    train = rows.select_columns(columns).with_format(None)
    tables, total = [], 0
    meta = {"format": COMPACT_FORMAT if spec else SIGNAL_FORMAT, "teacher": recorded.get("teacher") or source,
            "teacher_fingerprint": recorded.get("teacher_fingerprint"), "vocab_hash": vocab_hash,
            "vocab_size": vocab, "k": k, "temperature": float(temperature), "kd_token_mask": kd_token_mask,
            "layout": "compact" if spec else "packed" if vocab <= 2**17 else "split",
            **({"id_bits": spec.id_bits, "value_bits": spec.value_bits, "value_step": spec.value_step}
               if spec else {}),
            "dtype": None, "rows": len(rows), "rows_per_shard": len(rows),
            "dataset": _dataset_digest(rows, columns), "imported_from": source,
            "tail": "1 - the sum of the stored top-k probabilities (the source stores no tail)"}
    for i, (mine, theirs) in enumerate(zip(train, data, strict=True)):
        if row_hash(mine["input_ids"]) != row_hash(theirs["input_ids"]):
            raise ValueError(f"Row {i} of the training rows is not the {source} data's row {i} (their input_ids "
                             "differ): give the rows the data was made from, in its order.")
        ids, mask, labels = padded_rows({c: [mine[c]] for c in columns})
        counted = counted_positions(mask, labels, kd_token_mask)
        n = len(mine["input_ids"])
        top, lps = positions(i, theirs)
        if len(top) != max(n - 1, 0):
            raise ValueError(f"Row {i} of the {source} data holds {len(top)} positions, but its {n} tokens have "
                             f"{max(n - 1, 0)} next-token positions (one per token but the first, whose "
                             "distribution no tool stores): the positions do not match the rows' tokens.")
        at = np.flatnonzero(counted[0].numpy())
        short = [len(top[t]) for t in at if len(top[t]) < k]
        if short:
            raise ValueError(f"Row {i} of the {source} data keeps {short[0]} ids at a counted position, fewer than "
                             f"k={k}: pass a smaller k.")
        v, idx = _top(lps, top, at, k)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= vocab):
            raise ValueError(f"Row {i} of the {source} data holds id {int(idx.max())}, outside the tokenizer's "
                             f"vocabulary of {vocab} ids: it was made with another vocabulary.")
        kept = v.exp().sum(-1).clamp(max=1.0)
        tail = torch.log1p(-kept)  # -inf where the stored entries hold all the mass (to rounding)
        tables.append(_rows_table(v.float(), idx, tail.float(), counted, mask, [mine["input_ids"]], meta))
        total += len(at)
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    meta["command"] = f"import from {source}"
    _write_shard(_shard_path(folder, 0), tables, meta)
    meta["positions"] = total
    size_bytes = _shard_path(folder, 0).stat().st_size
    meta["bytes_per_token"] = round(size_bytes / max(total, 1), 2)
    meta["payload_bytes_per_token"] = round(datasets.Dataset.from_file(str(_shard_path(folder, 0))).data.nbytes
                                            / max(total, 1), 2)
    (folder / META_FILE).write_text(json.dumps({**meta, "complete": True}, indent=2) + "\n")
    return load_teacher_signal(folder)


def _top(lps: Any, top: Any, at: np.ndarray, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions `at`: their k most likely entries sorted by decreasing log-probability, (len(at), k) float64
    log-probabilities and int64 ids (positions may hold more than k, and differently many)."""
    if not len(at):
        return torch.zeros(0, k, dtype=torch.float64), torch.zeros(0, k, dtype=torch.long)
    values, ids = [], []
    for t in at:
        lp = torch.as_tensor(np.asarray(lps[t], dtype=np.float64))
        order = lp.argsort(descending=True)[:k]
        values.append(lp[order])
        ids.append(torch.as_tensor(np.asarray(top[t], dtype=np.int64))[order])
    return torch.stack(values), torch.stack(ids)


def export_topk_columns(signal: datasets.Dataset, rows: datasets.Dataset) -> datasets.Dataset:
    """The signal joined with its `rows` in the `(topk_ids, topk_logprobs)` column format: per row `input_ids` and,
    per next-token position (n - 1 for n tokens), the k ids and log-probabilities at the signal's temperature
    (empty lists where its kd_token_mask counts no token); the temperature, vocabulary hash and teacher in the
    Dataset's info, so `import_topk_columns` reads it back without being told them."""
    from .signal_format import attach_teacher_signal

    meta = signal_metadata(signal)
    if meta is not None and "epsilon" in meta:
        raise ValueError("export_topk_columns writes k entries per position, but this adaptive-k signal (format 4, "
                         f"epsilon={meta['epsilon']}) holds fewer at some positions: export a fixed-k signal.")
    joined = attach_teacher_signal(rows, signal)  # checks every row's ids and counted positions
    signal_columns = [c for c in joined.column_names if c.startswith("teacher_signal")]
    data = joined.with_format(None)
    out_ids, out_lps = [], []
    for i in range(len(joined)):
        row = data[i]
        batch = {c: torch.as_tensor(row[c])[None] for c in signal_columns}
        batch = {c: (v.float() if v.is_floating_point() else v) for c, v in batch.items()}
        ids, mask, labels = padded_rows({c: [row[c]] for c in ("input_ids", "attention_mask", "labels") if c in row})
        inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        log_probs, index, _ = signal_teacher(batch, inputs, "labels", meta["kd_token_mask"])
        counted = counted_positions(mask, labels, meta["kd_token_mask"])[0]
        n = max(len(row["input_ids"]) - 1, 0)
        out_ids.append([index[0, t].tolist() if counted[t] else [] for t in range(n)])
        out_lps.append([log_probs[0, t].tolist() if counted[t] else [] for t in range(n)])
    record = {"temperature": meta["temperature"], "vocab_hash": meta["vocab_hash"], "teacher": meta["teacher"],
              "k": meta["k"],
              "teacher_fingerprint": meta["teacher_fingerprint"], "kd_token_mask": meta["kd_token_mask"]}
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int64")),
                                  "topk_ids": datasets.List(datasets.List(datasets.Value("int32"))),
                                  "topk_logprobs": datasets.List(datasets.List(datasets.Value("float32")))})
    info = datasets.DatasetInfo(description=EXPORT_MARKER + json.dumps(record, sort_keys=True), features=features)
    table = pa.table({"input_ids": [list(r) for r in rows.with_format(None)["input_ids"]], "topk_ids": out_ids,
                      "topk_logprobs": out_lps})
    return datasets.Dataset(table.cast(features.arrow_schema), info=info)

