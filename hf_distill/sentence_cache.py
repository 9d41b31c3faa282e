"""Cached teacher sentence embeddings: `cache_teacher_embeddings` writes them once (a column named by the space:
`cached_column`), and the checks `DistillationSentenceTransformerTrainer` runs before training make sure a column is
read in the space, from the teacher and on the Router route it was written with (the vectors alone do not say it).
Needs no sentence-transformers import itself: the models passed in are SentenceTransformers."""

from __future__ import annotations

from typing import Any

import torch
from datasets import IterableDataset
from torch import nn

from .sentence_loss import SPACES, _run, pooling_module, routes_by_task

LABEL_COLUMNS = ("label", "labels", "score", "scores")


def named_datasets(data: Any) -> list[tuple[str, Any]]:
    if data is None:
        return []
    return list(data.items()) if isinstance(data, dict) else [("", data)]


def first_row(dataset: Any) -> dict[str, Any]:
    """The first row of a `Dataset` or of a streamed `IterableDataset` (which has no `[0]`)."""
    return next(iter(dataset)) if isinstance(dataset, IterableDataset) else dataset[0]


def column_names(dataset: Any) -> list[str]:
    """A dataset's column names (a streamed one without features has none: sentence-transformers refuses it)."""
    return list(getattr(dataset, "column_names", None) or [])


def text_columns(dataset: Any, cached: str) -> list[str]:
    """The columns sentence-transformers' collator tokenizes (all but labels, dataset_name and the cache)."""
    names = dataset if isinstance(dataset, list) else column_names(dataset)
    return [c for c in names if c not in (*LABEL_COLUMNS, "dataset_name", cached)]


def cached_column(space: str) -> str:
    """The column `cache_teacher_embeddings` writes embeddings of `space` to, and the trainer reads by default: the
    space is in the name, because the vectors alone do not say it (pooled and output embeddings have one width)."""
    return "teacher_embedding" if space == "output" else f"teacher_embedding_{space}"


def refuse_other_spaces(train_dataset: Any, eval_dataset: Any, column: str, space: str) -> None:
    """A dataset that holds another space's cached column but not the one this run reads: compared as this space's,
    it would train toward the wrong embeddings (same width), so it is refused."""
    for name, data in named_datasets(train_dataset) + named_datasets(eval_dataset):
        names = column_names(data)
        other = [cached_column(o) for o in SPACES if o != space and cached_column(o) in names]
        if other and column not in names:
            raise ValueError(
                f"Dataset {name or 'train_dataset'!r} has {other[0]!r} (teacher embeddings cached in another space) "
                f"but embedding_space={space!r} reads {column!r}: cache_teacher_embeddings(..., space={space!r}), or "
                f"set embedding_space to the space the column was cached in, or drop the column.")


def _column_task(router_mapping: Any, dataset_name: str | None, column: str) -> str | None:
    """The task (Router route) sentence-transformers' collator gives `column`: `router_mapping` maps columns, or
    dataset names to such maps."""
    mapping = router_mapping or {}
    if mapping and isinstance(next(iter(mapping.values())), dict):
        mapping = mapping.get(dataset_name, {})
    return mapping.get(column)


def check_cache_against_teacher(train_dataset: Any, eval_dataset: Any, column: str, teacher: nn.Module,
                                 space: str, router_mapping: Any = None) -> None:
    """The first cached row of each dataset against the given teacher's embedding of its text in `space` (on the
    route its column takes): a column cached from another teacher, space or route is refused, not trained toward."""
    for name, data in named_datasets(train_dataset) + named_datasets(eval_dataset):
        if column not in column_names(data):
            continue
        row = first_row(data)
        text = text_columns(data, column)[0]
        now = _teacher_embeddings(teacher, [row[text]], space, _column_task(router_mapping, name, text))[0]
        cached = torch.tensor(row[column], dtype=torch.float32)
        gap = float((now - cached).norm() / now.norm().clamp_min(1e-12))
        if gap > CACHE_TOLERANCE:
            raise ValueError(
                f"{column!r} of dataset {name or 'train_dataset'!r} does not hold this teacher's {space} embeddings "
                f"(its first row differs from the teacher's by {gap:.1%}): it was cached from another teacher, space "
                f"or route. Recompute it with cache_teacher_embeddings(..., space={space!r}) (and task= for a "
                "Router teacher), or give the teacher it came from.")


CACHE_TOLERANCE = 0.02  # relative L2 gap of a recomputed embedding: another device or precision stays far below


def cache_teacher_embeddings(dataset: Any, teacher: nn.Module, column: str, *, space: str = "output",
                             out_column: str | None = None, batch_size: int = 64, task: str | None = None) -> Any:
    """`dataset` with `out_column` (default :func:`cached_column`: the space in its name): the teacher's embedding
    of each row's `column` in `space`, computed once so that training runs no teacher forward. Refuses a column
    that is already there (nothing is overwritten). `task`: the route a Router teacher takes for this column (the
    one `router_mapping` gives it in training); a Router teacher without it is refused, not cached on its default."""
    if space not in SPACES:
        raise ValueError(f"space={space!r} is not one of {', '.join(SPACES)}.")
    out_column = out_column or cached_column(space)
    if out_column in dataset.column_names:
        raise ValueError(f"{out_column!r} is already a column of the dataset; remove it or pick out_column=.")
    if column not in dataset.column_names:
        raise ValueError(f"column={column!r} is not a column of the dataset ({dataset.column_names}).")
    if space == "pooled" and pooling_module(teacher) is None:
        raise ValueError("space='pooled' but the teacher has no Pooling module. Use 'output'.")
    if task is None and routes_by_task(teacher):
        raise ValueError(f"The teacher routes by task (a Router): pass task= (the route router_mapping gives "
                         f"{column!r} in training, e.g. 'query' or 'document').")
    teacher.eval()
    rows = []
    for start in range(0, len(dataset), batch_size):
        texts = dataset[start:start + batch_size][column]
        rows.extend(_teacher_embeddings(teacher, texts, space, task).tolist())
    return dataset.add_column(out_column, rows)


def _teacher_embeddings(teacher: nn.Module, texts: list[str], space: str, task: str | None = None) -> torch.Tensor:
    """The teacher's float32 embeddings of `texts` in `space` (on `task`'s route), on the CPU: what a cached column
    holds (no prompt)."""
    with torch.no_grad():
        features = {k: v.to(teacher.device) if isinstance(v, torch.Tensor) else v
                    for k, v in teacher.preprocess(texts, task=task).items()}
        return _run(teacher, features, space, None)[1].float().cpu()
