"""Teacher-output cache: run the teacher over a dataset once, keep its outputs on disk, reuse them.

A frozen teacher gives the same outputs for the same inputs every epoch, so its forward pass (often the
larger half of a distillation step) can be paid once. `cache_teacher_outputs` runs it batched over a
tokenised `datasets.Dataset` and returns that dataset with `teacher_*` columns added, row for row; the
`DistillationTrainer` then takes the teacher's logits and hidden states from the batch instead of
running it (`teacher_model=None` is allowed when everything the losses need is cached).

Columns (per row; token-level outputs keep only the row's real tokens, in order, and
`TeacherOutputsCollator` pads them back to the batch's length on the tokenizer's padding side):

- `teacher_logits`: `(C,)` for sequence-level heads, `(n_tokens, V)` for token-level ones (dense);
- `teacher_topk_values`, `teacher_topk_indices` (with `top_k=k`): the `k` largest logits and their class
  ids (int32), `(k,)` or `(n_tokens, k)`; the KD loss renormalises the teacher over those k classes;
- `teacher_hidden_<i>`: `(n_tokens, hidden)` for `hidden_states[i]` (0 = embedding output).

Size on disk (float32; float16 halves it): logits take `4 * C` bytes per row, top-k `8 * k` bytes per token,
hidden states `4 * hidden` bytes per token and layer. For the MiniLM-L6 teacher (hidden 384) on SST-2
(about 13 tokens per row): 1,536 B per token and layer, so all 7 hidden states (0..6) take about 140 KB per
row, 9.4 GB for the 67,349 training rows; the 4 layers of a uniform map onto a 3-layer student (0, 2, 4, 6)
take 5.4 GB (2.7 GB in float16); the logits alone take 0.5 MB.

The cache is keyed by a fingerprint of the teacher's weights (every state_dict tensor's bytes) and class
and config, of the values of the dataset columns the teacher reads (those its forward takes: a changed label or
an added id column reuses the cache, a changed `input_ids` does not), of the settings (which outputs, k, layers,
dtype, the collator's settings, whatever form it takes, and any `key` you add), of the autocast the teacher runs
under and of the transformers and torch versions, so a changed teacher, input or setting never reuses stale
outputs. The teacher's hash is memoised per process (see `teacher_fingerprint`) and, under torchrun, computed by
rank 0 alone (the key is made in `hf_distill.data.cache_key`). The collator must be deterministic: outputs of
randomly masked or augmented batches (MLM collators) cannot be cached.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import torch
from datasets.arrow_writer import ArrowWriter
from torch import nn
from tqdm.auto import tqdm

from ..features.taps import FeatureTaps, ModelInfo, TapRequest, forward, model_info, unwrap
from .cache_key import _autocast_state, _dataset_digest, _describe, _fingerprint, _teacher_inputs, teacher_fingerprint
from .collators import TEACHER_PREFIX, changes_inputs

__all__ = [
    "HIDDEN_PREFIX",
    "LOGITS_COLUMN",
    "TOPK_INDICES_COLUMN",
    "TOPK_VALUES_COLUMN",
    "cache_teacher_outputs",
    "cached_hidden_layers",
    "cached_teacher_info",
    "hidden_column",
    "teacher_fingerprint",
]

LOGITS_COLUMN = f"{TEACHER_PREFIX}logits"
TOPK_VALUES_COLUMN = f"{TEACHER_PREFIX}topk_values"
TOPK_INDICES_COLUMN = f"{TEACHER_PREFIX}topk_indices"
HIDDEN_PREFIX = f"{TEACHER_PREFIX}hidden_"
CACHE_FORMAT = 1  # bump when the stored layout changes, so old caches are not misread
_META_MARKER = "hf_distill.data.cache teacher="
_SETTINGS_FILE = "hf_distill_cache.json"
_STORE_DTYPES = {torch.float32: "float32", torch.float16: "float16"}


def hidden_column(layer: int) -> str:
    return f"{HIDDEN_PREFIX}{layer}"


def cached_hidden_layers(column_names: Iterable[str]) -> set[int]:
    """The `hidden_states` indices whose `teacher_hidden_<i>` column is present."""
    out = set()
    for name in column_names:
        suffix = name[len(HIDDEN_PREFIX) :] if name.startswith(HIDDEN_PREFIX) else ""
        if suffix.isdigit():
            out.add(int(suffix))
    return out


# ---------------------------------------------------------------------- the cache


def cache_teacher_outputs(
    teacher: nn.Module,
    dataset: datasets.Dataset,
    *,
    cache_dir: str | os.PathLike,
    batch_size: int = 64,
    collator: Callable[[list[dict]], dict] | None = None,
    logits: bool = True,
    top_k: int | None = None,
    hidden_layers: Iterable[int] = (),
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    key: Any = None,
    progress: bool = True,
    teacher_index: int = 0,
) -> datasets.Dataset:
    """`dataset` with the teacher's outputs added as `teacher_*` columns, computed once and cached.

    Args:
        teacher: the (frozen) teacher; run in eval mode under `no_grad`, on `device` (default: where it is).
        dataset: tokenised rows (`input_ids`, `attention_mask`, ...); other columns are passed through.
        cache_dir: folder holding one sub-folder per fingerprint (`teacher-outputs-<fingerprint>`).
        batch_size: rows per teacher forward (the outputs do not depend on it).
        collator: the training collator, so the teacher sees the inputs exactly as in training (padding
            side, truncation). Default: right padding of the list columns the teacher's forward takes.
        logits: store the logits (`teacher_logits`, or top-k columns when `top_k` is set).
        top_k: keep only the k largest logits per item (for vocabulary-sized, token-level logits).
        hidden_layers: `hidden_states` indices to store (0 = embeddings), for hidden_mse/cosine/pkd terms.
        dtype: float32 (default) or float16 (half the disk; the losses upcast to float32).
        key: anything else the outputs depend on that the dataset fingerprint misses (JSON-able).
        progress: show a progress bar while computing.
        teacher_index: with several teachers (`teacher_model=[...]`), which one this is: teacher i >= 1 writes
            `teacher_logits_<i>`, the column the trainer reads for it (dense logits only).

    Under `torchrun` (an initialised process group), rank 0 computes while the other ranks wait, then
    they load its files (put `cache_dir` on a shared filesystem across machines).
    """
    if dtype not in _STORE_DTYPES:
        raise ValueError(f"dtype must be torch.float32 or torch.float16, got {dtype}.")
    layers = sorted({int(i) for i in hidden_layers})
    if teacher_index < 0 or (teacher_index > 0 and (not logits or top_k is not None or layers)):
        raise ValueError(f"teacher_index={teacher_index}: teachers after the first can cache dense logits only "
                         "(logits=True, no top_k, no hidden_layers); the trainer takes features from teacher 0.")
    logits_column = LOGITS_COLUMN if teacher_index == 0 else f"{LOGITS_COLUMN}_{teacher_index}"
    if not logits and not layers:
        raise ValueError("Nothing to cache: set logits=True and/or hidden_layers.")
    if top_k is not None and (not logits or int(top_k) < 1):
        raise ValueError(f"top_k={top_k!r} needs logits=True and k >= 1.")
    info = model_info(teacher)
    if layers and info.num_layers is not None and not all(0 <= i <= info.num_layers for i in layers):
        raise ValueError(
            f"hidden_layers {layers} out of range: the teacher has {info.num_layers} layers, so hidden_states "
            f"indices are 0 (embeddings) to {info.num_layers}."
        )
    if len(dataset) == 0:
        raise ValueError("The dataset is empty: there is nothing to cache.")
    if changes_inputs(collator):  # MLMDistillationCollator, DataCollatorForLanguageModeling(mlm=True): new masks
        raise ValueError(f"{type(collator).__name__} changes the inputs of every batch, so teacher outputs cannot "
                         "be computed once and reused: let the teacher run online instead.")
    accepted, inputs = _teacher_inputs(teacher, dataset)
    run_on = torch.device(device) if device is not None else next(teacher.parameters()).device
    settings = {"format": CACHE_FORMAT, "logits": bool(logits), "top_k": None if top_k is None else int(top_k),
                "hidden_layers": layers, "dtype": _STORE_DTYPES[dtype], "collator": _describe(collator),
                "autocast": _autocast_state(run_on.type), "inputs": inputs,
                "key": _describe(key), **({"column": logits_column} if teacher_index else {})}
    dist = torch.distributed
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    fingerprint = [None]
    if not multi or dist.get_rank() == 0:  # the teacher is hashed once, by the rank that computes the outputs
        fingerprint[0] = _fingerprint(teacher_fingerprint(teacher), _dataset_digest(dataset, inputs), len(dataset),
                                      settings)
    if multi:
        dist.broadcast_object_list(fingerprint, src=0)
    folder = Path(cache_dir) / f"teacher-outputs-{fingerprint[0]}"
    meta = {"model_type": info.model_type, "num_layers": info.num_layers, "hidden_size": info.hidden_size,
            "num_heads": info.num_heads}

    if multi and dist.get_rank() != 0:
        dist.barrier()  # rank 0 computes first
    try:
        cached = _load(folder, len(dataset))
        if cached is None:
            cached = _compute(teacher, dataset, folder, batch_size, collator, logits, top_k, layers, dtype,
                              run_on, progress, meta, settings, logits_column, accepted, inputs)
    finally:
        if multi and dist.get_rank() == 0:
            dist.barrier()
    return _attach(dataset, cached)


def cached_teacher_info(dataset: Any) -> ModelInfo | None:
    """The teacher's shape facts (layers, hidden size, heads) recorded by `cache_teacher_outputs`, if any.

    They let the trainer validate layer maps for cached hidden states without the teacher itself.
    """
    info = getattr(dataset, "info", None)
    for line in (getattr(info, "description", None) or "").splitlines():
        if line.startswith(_META_MARKER):
            meta = json.loads(line[len(_META_MARKER) :])
            return ModelInfo(num_layers=meta["num_layers"], hidden_size=meta["hidden_size"],
                             num_heads=meta["num_heads"], family=None, model_type=meta["model_type"])
    return None


def _load(folder: Path, rows: int) -> datasets.Dataset | None:
    if not (folder / _SETTINGS_FILE).is_file():
        return None
    try:
        cached = datasets.load_from_disk(str(folder))
    except Exception:  # a broken or foreign folder is recomputed, never trusted
        return None
    return cached if len(cached) == rows else None


def _attach(dataset: datasets.Dataset, cached: datasets.Dataset) -> datasets.Dataset:
    """Columns side by side (same row order); cached columns come out as tensors (fast to collate)."""
    new = cached.column_names
    base = dataset.remove_columns([c for c in new if c in dataset.column_names])
    fmt = base.format
    out = datasets.concatenate_datasets([base.with_format(None), cached.with_format(None)], axis=1)
    if fmt["type"] is None:
        out.set_format("torch", columns=new, output_all_columns=True)
    else:
        out.set_format(fmt["type"], columns=list(fmt["columns"]) + new,
                       output_all_columns=fmt["output_all_columns"], **fmt["format_kwargs"])
    return out


def _pad_collate(pad_id: int) -> Callable[[list[dict]], dict]:
    def collate(features: list[dict]) -> dict:
        """Right-pad every list column; build `attention_mask` from the lengths when it is missing."""
        length = max(len(f["input_ids"]) for f in features)
        batch: dict[str, torch.Tensor] = {}
        for name in features[0]:
            fill = pad_id if name == "input_ids" else 0
            out = torch.full((len(features), length), fill, dtype=torch.long)
            for i, f in enumerate(features):
                out[i, : len(f[name])] = torch.as_tensor(f[name])
            batch[name] = out
        if "attention_mask" not in batch:
            batch["attention_mask"] = torch.zeros(len(features), length, dtype=torch.long)
            for i, f in enumerate(features):
                batch["attention_mask"][i, : len(f["input_ids"])] = 1
        return batch

    return collate


def _logits_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    value = out.get("logits") if isinstance(out, dict) else getattr(out, "logits", None)
    if value is None:
        fields = ", ".join(k for k in (out.keys() if isinstance(out, dict) else []) if k != "loss")
        raise ValueError(
            f"The teacher's output has no `logits` (it has {fields or 'other fields'}): only heads with one logits "
            "tensor can be cached (question-answering teachers, with start and end logits, must run online). Use "
            "logits=False to cache hidden_layers only."
        )
    return value


def _per_row(x: torch.Tensor, real: torch.Tensor | None, store: str) -> pa.Array:
    """(B, X) -> one list of X per row; (B, T, X) -> one (n_real, X) list of lists per row."""
    width = x.shape[-1]
    if x.dim() == 2:
        flat = x.to(torch.float32 if x.is_floating_point() else torch.int32).numpy()
        return pa.FixedSizeListArray.from_arrays(pa.array(_cast(flat, store).reshape(-1)), width)
    keep = torch.ones(x.shape[:2], dtype=torch.bool) if real is None else real
    rows = x[keep]  # (n_real_total, X), rows in order, positions ascending
    offsets = np.concatenate([[0], keep.sum(1).cumsum(0).numpy()]).astype(np.int32)
    inner = pa.FixedSizeListArray.from_arrays(pa.array(_cast(rows.numpy(), store).reshape(-1)), width)
    return pa.ListArray.from_arrays(pa.array(offsets), inner)


def _cast(array: np.ndarray, store: str) -> np.ndarray:
    return array.astype(np.int32) if store == "int32" else array.astype(store)


def _compute(teacher, dataset, folder, batch_size, collator, logits, top_k, layers, dtype, device, progress,
             meta, settings, logits_column, accepted, inputs) -> datasets.Dataset:
    inner = unwrap(teacher)
    # The training collator sees whole rows, as in training (it may read labels or ids); the default one pads
    # only the columns the teacher reads. Either way only those columns are hashed into the cache key.
    columns = [c for c in dataset.column_names if not c.startswith(TEACHER_PREFIX)] if collator else inputs
    if collator is None:
        collator = _pad_collate(getattr(getattr(inner, "config", None), "pad_token_id", None) or 0)
    taps = FeatureTaps(teacher, TapRequest(hidden=set(layers)), "teacher") if layers else None
    store = _STORE_DTYPES[dtype]
    source = dataset.select_columns(columns)

    folder.parent.mkdir(parents=True, exist_ok=True)
    if folder.exists():  # unreadable or incomplete (checked by the caller): replace it
        shutil.rmtree(folder, ignore_errors=True)
    work = folder.parent / f".tmp-{folder.name}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    was_training = teacher.training
    teacher.eval()
    writer: ArrowWriter | None = None
    try:
        bar = tqdm(total=len(dataset), desc="Caching teacher outputs", unit="rows", disable=not progress)
        for start in range(0, len(dataset), batch_size):
            chunk = source[start : start + batch_size]
            rows = [dict(zip(chunk, values, strict=True)) for values in zip(*chunk.values(), strict=True)]
            batch = collator(rows)
            kwargs = {k: v.to(device) for k, v in batch.items() if k in accepted and isinstance(v, torch.Tensor)}
            with torch.no_grad():
                out, feats = forward(teacher, kwargs, taps)
            mask = batch.get("attention_mask")
            real = mask.bool().cpu() if isinstance(mask, torch.Tensor) else None
            columns: dict[str, pa.Array] = {}
            if logits:
                z = _logits_of(out).detach().float().cpu()
                if top_k is not None:
                    k = min(int(top_k), z.shape[-1])
                    values, indices = z.topk(k, dim=-1)
                    columns[TOPK_VALUES_COLUMN] = _per_row(values, real, store)
                    columns[TOPK_INDICES_COLUMN] = _per_row(indices, real, "int32")
                else:
                    columns[logits_column] = _per_row(z, real, store)
            for i in layers:
                columns[hidden_column(i)] = _per_row(feats.hidden[i].detach().float().cpu(), real, store)
            table = pa.table(columns)
            if writer is None:
                features = datasets.Features.from_arrow_schema(table.schema)
                writer = ArrowWriter(features=features, path=str(work / "outputs.arrow"))
            writer.write_table(table)
            bar.update(len(rows))
        bar.close()
        writer.finalize()
        writer.close()
        writer = None
        description = _META_MARKER + json.dumps(meta, sort_keys=True)
        computed = datasets.Dataset.from_file(str(work / "outputs.arrow"),
                                              info=datasets.DatasetInfo(description=description))
        quiet = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # one bar (ours) is enough
        try:
            computed.save_to_disk(str(work / "dataset"))
        finally:
            if quiet:
                datasets.enable_progress_bars()
        (work / "dataset" / _SETTINGS_FILE).write_text(json.dumps({**settings, "teacher": meta}, indent=2) + "\n")
        del computed
        try:
            os.replace(work / "dataset", folder)  # atomic: a reader never sees half a cache
        except OSError:
            if _load(folder, len(dataset)) is None:  # another process won the race with a good cache, else fail
                raise
    finally:
        if writer is not None:
            writer.close()
        teacher.train(was_training)
        shutil.rmtree(work, ignore_errors=True)
    loaded = _load(folder, len(dataset))
    if loaded is None:
        raise RuntimeError(f"The teacher-output cache written to {folder} could not be read back.")
    return loaded
