"""Size and speed of models, measured the same way everywhere (demo, model cards, benchmarks). Speed is a median,
and a speed-up is timed interleaved (teacher, student, teacher, ...): load from other processes cancels in the ratio.
"""

from __future__ import annotations

import inspect
import math
import os
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..compat import prepare_inputs, remove_unused_columns
from ..features.taps import unwrap

# What `from_pretrained` loads and the Hub stores: not `training_args.bin`, optimizer or scheduler state.
WEIGHT_FILES = re.compile(r"(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)")


def count_parameters(model: nn.Module) -> int:
    """All parameters, trainable or not (shared tensors counted once, as `nn.Module.parameters` does)."""
    return sum(p.numel() for p in model.parameters())


def _timed_passes(models: list[nn.Module], batches: list[dict], repeats: int,
                  on_round: Callable[[], object] | None = None) -> list[list[float]]:
    """times[round][model] of `repeats` rounds after a warm-up; each model gets the inputs its (unwrapped) forward
    names. `on_round` is called after each round (a progress bar)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}.")
    modes = [m.training for m in models]
    names = [set(inspect.signature(unwrap(m).forward).parameters) for m in models]
    # CUDA kernels run asynchronously: wait for them, or a pass would time only their launch.
    cuda = any(isinstance(v, torch.Tensor) and v.is_cuda for b in batches for v in b.values())

    def one_pass(model: nn.Module, names: set[str]) -> float:
        start = time.perf_counter()
        for batch in batches:
            model(**{k: v for k, v in batch.items() if k in names})
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def rounds() -> list[list[float]]:
        times = []
        for _ in range(repeats):
            times.append([one_pass(m, n) for m, n in zip(models, names)])
            if on_round is not None:
                on_round()
        return times

    try:
        for m in models:
            m.eval()
        with torch.no_grad():
            for m, n in zip(models, names):
                one_pass(m, n)  # warm-up: allocator, lazy init, caches
            return rounds()
    finally:
        for m, mode in zip(models, modes):
            m.train(mode)


def inference_seconds(model: nn.Module, batches: list[dict], repeats: int = 5) -> float:
    """Median wall seconds of one no-grad, eval-mode pass over `batches`. Only the inputs `forward` names
    are passed, so extra columns do no harm; leave `labels` out to time inference without a loss."""
    return statistics.median(t[0] for t in _timed_passes([model], batches, repeats))


def latencies(models: list[nn.Module], batches: list[dict], repeats: int = 5,
              on_round: Callable[[], object] | None = None) -> list[float]:
    """Median wall seconds of each model's no-grad pass over `batches`, the models timed interleaved (round after
    round, every model once per round), so that load from other processes falls on all of them alike."""
    times = _timed_passes(models, batches, repeats, on_round)
    return [statistics.median(t[i] for t in times) for i in range(len(models))]


def speedup(teacher: nn.Module, student: nn.Module, batches: list[dict], repeats: int = 5) -> float:
    """Teacher time / student time: median of the per-round ratios of interleaved passes."""
    return statistics.median(t / s for t, s in _timed_passes([teacher, student], batches, repeats))


def size_on_disk(folder: str | os.PathLike) -> int:
    """Bytes of the weight files directly in `folder` (`WEIGHT_FILES`: not training_args.bin or optimizer state)."""
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file() and WEIGHT_FILES.fullmatch(p.name))


def stored_parameters(folder: str | os.PathLike) -> int | None:
    """Parameters in the folder's `model*.safetensors` headers (no model load); None when it holds none."""
    files = sorted(Path(folder).glob("model*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                total += math.prod(f.get_slice(key).get_shape())
    return total


def trainer_speedup(trainer: Any, student: nn.Module, teacher: nn.Module, limit: int) -> dict[str, Any]:
    """`speedup` and how it was measured, on up to `limit` of the trainer's evaluation (else training) batches, in
    this process: `DistillationReport.from_trainer(measure_speed=True)`."""
    from torch.utils.data import DataLoader

    from ..placement import REPLICA, teacher_mode

    if getattr(trainer, "shared_base", False):
        raise ValueError("measure_speed=True has nothing to compare in self-distillation: the teacher is the "
                         "student's own base with its adapters off. Leave measure_speed off.")
    mode = teacher_mode(trainer.accelerator)
    if mode != REPLICA:
        raise ValueError(
            f"measure_speed=True times the teacher in one process, but this teacher is {mode} across processes, "
            "so its forward needs all of them. Measure the speed-up of the saved student and teacher in a single "
            "process (hf_distill.publish.measure.speedup) and pass speedup= instead.")
    evaluation = trainer.eval_dataset is not None
    dataset = trainer.eval_dataset if evaluation else trainer.train_dataset
    if dataset is None or isinstance(dataset, dict) or not hasattr(dataset, "__len__"):
        return {}
    if trainer.args.remove_unused_columns and hasattr(dataset, "column_names"):
        dataset = remove_unused_columns(trainer, dataset, description="model card")
    loader = DataLoader(dataset, batch_size=trainer.args.per_device_eval_batch_size,
                        collate_fn=trainer.data_collator, shuffle=False)
    batches = []
    for batch in loader:  # labels and cached teacher outputs would make the forward compute a loss: inference only
        batches.append({k: v for k, v in prepare_inputs(trainer, batch).items()
                        if k != "labels" and not k.startswith("teacher_")})
        if len(batches) >= limit:
            break
    if not batches:
        return {}
    size, device = len(next(iter(batches[0].values()))), next(student.parameters()).device
    return {"speedup": speedup(teacher, student, batches, repeats=3),
            "speedup_setup": f"teacher time / student time over {len(batches)} batches of {size} "
                             f"{'evaluation' if evaluation else 'training'} examples, no gradients, {device.type}, "
                             "fp32, median of 3 interleaved passes"}
