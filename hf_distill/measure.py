"""Size and speed of models, measured the same way everywhere (demo, model cards, benchmarks).

Timings on a shared machine are noisy, so speed is reported as a median, and a teacher/student speed-up
is measured interleaved (teacher pass, student pass, teacher pass, ...) so that load from other processes
slows both alike and cancels in the ratio.
"""

from __future__ import annotations

import inspect
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn

WEIGHT_SUFFIXES = (".safetensors", ".bin")


def count_parameters(model: nn.Module) -> int:
    """All parameters, trainable or not (shared tensors counted once, as `nn.Module.parameters` does)."""
    return sum(p.numel() for p in model.parameters())


def _forward_names(model: nn.Module) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def _one_pass(model: nn.Module, batches: list[dict], names: set[str]) -> float:
    start = time.perf_counter()
    for batch in batches:
        model(**{k: v for k, v in batch.items() if k in names})
    return time.perf_counter() - start


def _timed_passes(models: list[nn.Module], batches: list[dict], repeats: int) -> list[list[float]]:
    """`repeats` rounds of one pass per model (after one warm-up round); times[round][model]."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}.")
    modes = [m.training for m in models]
    names = [_forward_names(m) for m in models]
    try:
        for m in models:
            m.eval()
        with torch.no_grad():
            for m, n in zip(models, names):
                _one_pass(m, batches, n)  # warm-up: allocator, lazy init, caches
            return [[_one_pass(m, batches, n) for m, n in zip(models, names)] for _ in range(repeats)]
    finally:
        for m, mode in zip(models, modes):
            m.train(mode)


def inference_seconds(model: nn.Module, batches: list[dict], repeats: int = 5) -> float:
    """Median wall seconds of one no-grad, eval-mode pass over `batches`; only inputs `forward` names
    are passed (a tokenizer's extra columns, or `labels`, would change the work measured)."""
    return statistics.median(t[0] for t in _timed_passes([model], batches, repeats))


def speedup(teacher: nn.Module, student: nn.Module, batches: list[dict], repeats: int = 5) -> float:
    """Teacher time / student time: median of the per-round ratios of interleaved passes."""
    return statistics.median(t / s for t, s in _timed_passes([teacher, student], batches, repeats))


def size_on_disk(folder: str | os.PathLike) -> int:
    """Bytes of the weight files (`*.safetensors`, `*.bin`) directly in `folder`."""
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
