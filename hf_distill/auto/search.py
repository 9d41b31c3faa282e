"""`auto_student`: the most accurate student that answers within a latency budget, picked and distilled.

1. **Candidates**: the shapes of :mod:`hf_distill.auto.space` (pruned depth x width, layer copies, shrunk models),
   built from the teacher (one width-importance pass over calibration rows of the training set ranks the units).
2. **Latency**: every candidate and the teacher on one fixed input (``batch_size`` rows of ``seq_len`` tokens of
   the data) on ``device``, no gradients: the median of ``repeats`` interleaved rounds
   (:func:`hf_distill.publish.measure.latencies`). A candidate is within the budget when its latency is at most
   ``budget_ms``; when none is, one error names the fastest one's latency, before anything trains or is written.
3. **Proxy**: each candidate within the budget is distilled for ``proxy_steps`` optimizer steps (the run's
   arguments, ``max_steps=proxy_steps``, nothing saved) and scored by ``metric`` on the evaluation set. The best
   score ranks first; equal scores rank the faster candidate first.
4. **Full distillation** of the ``top_n`` best with the run's arguments; the best final score is the pick, saved
   in ``output_dir/student`` with a model card saying the budget, its latency and how it was chosen; the others
   stay in ``output_dir/<candidate name>``.
5. **Pareto table**: ``pareto.md``, ``pareto.json`` and ``pareto.png`` (accuracy against latency, the budget
   marked; needs matplotlib, ``pip install 'hf-distill[plots]'``) in ``output_dir``.

AutoTinyBERT (Yin et al., 2021) searched student shapes for a latency constraint through a one-shot super-model;
here each candidate is measured for real and ranked by a short distillation of its own, Minitron's
prune-then-distil (Muralidharan et al., 2024) supplying the pruned shapes.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import itertools
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.utils import logging

from ..arguments import DistillationArguments
from ..features.taps import unwrap
from ..publish import measure
from ..students.width import width_importance
from ..teacher import loaded_as_another_class
from ..trainer import DistillationTrainer
from . import table
from .space import (
    DEFAULT_COPY_DEPTHS,
    DEFAULT_DEPTHS,
    DEFAULT_SHRINK,
    DEFAULT_WIDTHS,
    Candidate,
    Width,
    candidate_grid,
)

__all__ = ["AutoResult", "auto_student", "rank"]

logger = logging.get_logger(__name__)

STUDENT_DIR = "student"


@dataclass
class AutoResult:
    """What :func:`auto_student` did: the picked student (trained, in ``student_dir``), every candidate's row of
    the Pareto table (``rows``) and the files written."""

    student: PreTrainedModel
    picked: str
    student_dir: Path
    rows: list[dict[str, Any]]
    files: dict[str, Path] = field(default_factory=dict)


def _accuracy(eval_pred: Any) -> dict[str, float]:
    """Share of argmax predictions equal to the labels (labels of -100 are left out)."""
    logits = eval_pred.predictions[0] if isinstance(eval_pred.predictions, tuple) else eval_pred.predictions
    labels = torch.as_tensor(eval_pred.label_ids)
    predictions = torch.as_tensor(logits).argmax(-1)
    kept = labels != -100
    return {"accuracy": (predictions[kept] == labels[kept]).double().mean().item()}


def check_output_dir(folder: Path, overwrite: bool) -> None:
    """Refuse to write into a folder that holds files, unless asked to (as the demo and Trainer users expect)."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"output_dir {folder} exists and is not a folder.")
    if folder.is_dir() and any(folder.iterdir()) and not overwrite:
        raise ValueError(f"output_dir {folder} is not empty. Choose another folder, or pass "
                         "overwrite_output_dir=True (--overwrite_output_dir) to write into it.")


def _forward_names(model: PreTrainedModel) -> set[str]:
    return set(inspect.signature(unwrap(model).forward).parameters)


def fixed_input(dataset: Any, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """One input of ``batch_size`` rows of ``seq_len`` real tokens, taken in order from the rows' ``input_ids``
    (cycled when the data is shorter): every candidate is timed on exactly these tokens."""
    if "input_ids" not in (getattr(dataset, "column_names", None) or []):
        raise ValueError("auto_student times the candidates on the evaluation rows' `input_ids`: give a tokenised "
                         "eval_dataset (a datasets.Dataset with an input_ids column).")
    need, stream = batch_size * seq_len, []
    for row in dataset.select_columns(["input_ids"]):
        stream.extend(row["input_ids"])
        if len(stream) >= need:
            break
    if not stream:
        raise ValueError("The evaluation rows hold no tokens: auto_student needs real input_ids to time the models.")
    stream = (stream * (need // len(stream) + 1))[:need]
    ids = torch.tensor(stream, dtype=torch.long).view(batch_size, seq_len)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def calibration_batches(teacher: PreTrainedModel, dataset: Any, collator: Callable, rows: int,
                        batch_size: int) -> list[dict[str, Any]]:
    """The first ``rows`` training rows (of a Dataset, or read from a stream) as model inputs (no labels) for width
    importance."""
    import datasets

    names = _forward_names(teacher) - {"labels"}
    if isinstance(dataset, datasets.Dataset):
        first = dataset.select(range(min(rows, len(dataset)))).to_list()
    else:  # an IterableDataset (or any iterable of row dicts): its first rows, as the Dataset's
        first = [dict(row) for row in itertools.islice(iter(dataset), rows)]
    columns = [c for c in (first[0] if first else {}) if c in names]
    if "input_ids" not in columns:
        raise ValueError("auto_student ranks the teacher's units on training rows: train_dataset needs an "
                         "input_ids column (tokenised text).")
    subset = [{c: row[c] for c in columns} for row in first]
    batches = []
    for start in range(0, len(subset), batch_size):
        batch = collator(subset[start : start + batch_size])
        batches.append({k: v for k, v in batch.items() if k in names})
    return batches


def check_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device, refused (one ValueError naming it) when it is not one this machine has: checked
    before the teacher is loaded or measured, not when the first model is moved there."""
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a device name: use e.g. 'cpu', 'cuda' or 'cuda:1'.") from None
    if found.type == "cpu":
        return found
    accelerator = getattr(torch, found.type, None)
    available = accelerator is not None and hasattr(accelerator, "is_available") and accelerator.is_available()
    count = accelerator.device_count() if available and hasattr(accelerator, "device_count") else None
    if not available or (found.index is not None and count is not None and found.index >= count):
        raise ValueError(f"device={device!r}: this machine has no such device (torch {torch.__version__}); use "
                         "'cpu', or run where that device is.")
    return found


def _check_data(train_dataset: Any, eval_dataset: Any, args: DistillationArguments) -> None:
    """Refuse data the search cannot use before anything is measured: a DatasetDict (which split?) and a training
    stream without max_steps (the full run could not count its epochs, after every proxy run had trained)."""
    import datasets

    for name, data in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
        if isinstance(data, datasets.DatasetDict | datasets.IterableDatasetDict):
            raise ValueError(f"{name} is a DatasetDict (splits: {', '.join(data)}): give one split, e.g. "
                             f"{name}=rows[{next(iter(data), 'train')!r}].")
    if isinstance(train_dataset, datasets.IterableDataset) and args.max_steps <= 0:
        raise ValueError("train_dataset is an IterableDataset (no length), so the full run cannot count epochs: set "
                         "max_steps in args (the proxy runs take proxy_steps), or give a datasets.Dataset.")


def rank(rows: list[dict[str, Any]], greater_is_better: bool = True) -> list[dict[str, Any]]:
    """The rows with a proxy metric, best first; equal metrics put the faster candidate first."""
    scored = [r for r in rows if r.get("proxy_metric") is not None]
    sign = -1.0 if greater_is_better else 1.0
    return sorted(scored, key=lambda r: (sign * r["proxy_metric"], r["latency_ms"]))


def _metric(metrics: dict[str, float], name: str) -> float:
    key = f"eval_{name}"
    if key not in metrics:
        found = sorted(k[5:] for k in metrics if k.startswith("eval_"))
        raise ValueError(f"metric {name!r} is not among the evaluation's metrics ({', '.join(found)}); pass "
                         "metric= one of them, or compute_metrics= a function that returns it.")
    return float(metrics[key])


def auto_student(
    teacher: PreTrainedModel,
    train_dataset: Any,
    eval_dataset: Any,
    *,
    budget_ms: float,
    args: DistillationArguments,
    data_collator: Callable | None = None,
    processing_class: Any = None,
    device: str | torch.device = "cpu",
    batch_size: int = 1,
    seq_len: int = 128,
    proxy_steps: int = 50,
    top_n: int = 1,
    depths: Iterable[float] = DEFAULT_DEPTHS,
    widths: Iterable[Width] = DEFAULT_WIDTHS,
    copy_depths: Iterable[float] = DEFAULT_COPY_DEPTHS,
    shrink_shapes: Iterable[Sequence[float]] = DEFAULT_SHRINK,
    candidates: Sequence[Candidate] | None = None,
    metric: str = "accuracy",
    greater_is_better: bool | None = None,
    compute_metrics: Callable | None = None,
    calibration_rows: int = 256,
    repeats: int = 30,
    output_dir: str | os.PathLike | None = None,
    overwrite_output_dir: bool = False,
    teacher_name: str | None = None,
    progress: bool = True,
) -> AutoResult:
    """Pick and distil the best student of ``teacher`` that answers within ``budget_ms`` milliseconds on
    ``device`` for a batch of ``batch_size`` x ``seq_len`` tokens (the module docstring says how).

    ``args`` are the full run's settings (the proxy runs use them with ``max_steps=proxy_steps``); ``output_dir``
    defaults to ``args.output_dir`` and must be empty unless ``overwrite_output_dir``. The candidates are the grid
    of ``depths`` x ``widths`` (pruned), ``copy_depths`` and ``shrink_shapes`` (fractions of the teacher, see
    :func:`hf_distill.auto.space.candidate_grid`), or ``candidates`` when given. ``metric`` is read from the
    evaluation (``eval_<metric>``); with neither ``compute_metrics`` nor another ``metric`` it is the accuracy of
    the argmax (classification); ``greater_is_better`` defaults to False for losses and perplexities.
    """
    if not isinstance(teacher, PreTrainedModel):
        peft = " (a PEFT model: merge_and_unload() it first)" if hasattr(teacher, "peft_config") else ""
        raise TypeError(f"teacher must be a transformers PreTrainedModel, got {type(teacher).__name__}{peft}.")
    other = loaded_as_another_class(teacher)
    if other is not None:  # a path is checked when loaded (hf-distill auto: load_teacher); in memory, warn
        logger.warning(
            f"The teacher is a {type(teacher).__name__} whose config names the checkpoint it was loaded from as "
            f"{', '.join(other)}: the head that checkpoint lacks was initialised at random, so unless it was "
            "fine-tuned since, every candidate will be distilled towards noise. Fine-tune the teacher on the task "
            "first (or load the fine-tuned checkpoint, with its head).")
    if isinstance(budget_ms, bool) or not isinstance(budget_ms, (int, float)) or not 0 < budget_ms < math.inf:
        raise ValueError(f"budget_ms must be a positive, finite number of milliseconds, got {budget_ms!r}.")
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("proxy_steps", proxy_steps),
                        ("top_n", top_n), ("calibration_rows", calibration_rows), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    device = check_device(device)
    _check_data(train_dataset, eval_dataset, args)
    timed = fixed_input(eval_dataset, batch_size, seq_len)  # refused here, not after the candidates are built
    if data_collator is None:
        if processing_class is None:
            raise ValueError("auto_student needs data_collator= (or processing_class= a tokenizer, padded with "
                             "DataCollatorWithPadding) to batch the rows.")
        from transformers import DataCollatorWithPadding

        data_collator = DataCollatorWithPadding(processing_class)
    if compute_metrics is None:
        if metric != "accuracy":
            raise ValueError(f"metric={metric!r} needs compute_metrics= a function that returns it (the built-in "
                             "one returns accuracy).")
        compute_metrics = _accuracy
    greater = greater_is_better if greater_is_better is not None else not (
        metric.endswith("loss") or metric.endswith("perplexity"))
    folder = Path(output_dir if output_dir is not None else args.output_dir)
    check_output_dir(folder, overwrite_output_dir)
    teacher_name = teacher_name or teacher.config.name_or_path or "teacher"
    pool = list(candidates) if candidates is not None else candidate_grid(teacher, depths, widths, copy_depths,
                                                                          shrink_shapes)
    if not pool or not all(isinstance(c, Candidate) for c in pool):
        raise ValueError("candidates must be a non-empty list of hf_distill.auto.Candidate.")
    pool = list(dict.fromkeys(pool))
    seed = args.seed

    # 1-2. build every candidate, time them all interleaved with the teacher
    importance = None
    if any(c.kind == "prune" for c in pool):
        importance = width_importance(teacher, calibration_batches(
            teacher, train_dataset, data_collator, calibration_rows, args.per_device_eval_batch_size))
    built = [c.build(teacher, importance, seed) for c in tqdm(pool, desc="Building candidates", disable=not progress)]
    params = [measure.count_parameters(m) for m in built]
    home = next(teacher.parameters()).device
    batch = {k: v.to(device) for k, v in timed.items()}
    models = [teacher.to(device), *(m.to(device) for m in built)]
    with tqdm(total=repeats, desc="Measuring latency", unit="round", disable=not progress) as bar:
        seconds = measure.latencies(models, [batch], repeats, on_round=bar.update)
    teacher.to(home)
    del built, models
    gc.collect()
    rows = [{"name": c.name, "kind": c.kind, **c.shape(), "params": p, "latency_ms": 1000 * s,
             "within_budget": 1000 * s <= budget_ms, "proxy_metric": None, "proxy_rank": None, "final_metric": None,
             "picked": False} for c, p, s in zip(pool, params, seconds[1:])]
    setup = {"budget_ms": float(budget_ms), "device": str(device), "batch_size": batch_size, "seq_len": seq_len,
             "threads": torch.get_num_threads() if device.type == "cpu" else None, "repeats": repeats,
             "metric": metric, "greater_is_better": greater, "proxy_steps": proxy_steps, "top_n": top_n,
             "teacher": {"name": teacher_name, "latency_ms": 1000 * seconds[0],
                         "params": measure.count_parameters(teacher), "metric": None}}
    if not any(r["within_budget"] for r in rows):
        fastest = min(rows, key=lambda r: r["latency_ms"])
        raise ValueError(
            f"No candidate meets the budget of {budget_ms:g} ms on {device} (batch {batch_size} x {seq_len} "
            f"tokens): the fastest, {fastest['name']}, takes {fastest['latency_ms']:.3f} ms (the teacher "
            f"{setup['teacher']['latency_ms']:.3f} ms). Raise the budget to at least that, or add smaller shapes "
            "(lower depths/widths).")

    by_name = {c.name: c for c in pool}
    fit = dict(train_dataset=train_dataset, eval_dataset=eval_dataset, data_collator=data_collator,
               processing_class=processing_class, compute_metrics=compute_metrics,
               teacher_processing_class=processing_class)  # every candidate reads the teacher's tokens
    # 3. the proxy: a short distillation of each candidate within the budget, nothing saved
    within = [r for r in rows if r["within_budget"]]
    with tempfile.TemporaryDirectory(prefix="hf-distill-auto-") as scratch:
        for row in tqdm(within, desc=f"Proxy distillation ({proxy_steps} steps)", disable=not progress):
            proxy_args = dataclasses.replace(
                args, output_dir=str(Path(scratch) / row["name"]), max_steps=proxy_steps, save_strategy="no",
                eval_strategy="no", load_best_model_at_end=False, push_to_hub=False, report_to=[],
                disable_tqdm=True)
            student = by_name[row["name"]].build(teacher, importance, seed)
            trainer = DistillationTrainer(model=student, teacher_model=teacher, args=proxy_args, **fit)
            trainer.train()
            row["proxy_metric"] = _metric(trainer.evaluate(), metric)
            del trainer, student
            gc.collect()
    ranked = rank(rows, greater)
    for i, row in enumerate(ranked, 1):
        row["proxy_rank"] = i

    # 4. full distillation of the top n; the best final metric is the pick
    folder.mkdir(parents=True, exist_ok=True)
    finals: list[tuple[dict[str, Any], Any]] = []
    for row in tqdm(ranked[:top_n], desc="Full distillation", disable=not progress):
        where = folder / (STUDENT_DIR if top_n == 1 else row["name"])
        if where.exists():
            shutil.rmtree(where)  # only reached with overwrite_output_dir: the folder was checked empty otherwise
        student = by_name[row["name"]].build(teacher, importance, seed)
        trainer = DistillationTrainer(model=student, teacher_model=teacher,
                                      args=dataclasses.replace(args, output_dir=str(where)), **fit)
        trainer.train()
        trainer.save_model()
        row["final_metric"] = _metric(trainer.evaluate(), metric)
        if setup["teacher"]["metric"] is None:
            trainer.evaluate_teacher()
            setup["teacher"]["metric"] = trainer.teacher_metrics.get(metric)
        finals.append((row, trainer))
    best = min(finals, key=lambda f: ((-1.0 if greater else 1.0) * f[0]["final_metric"], f[0]["latency_ms"]))
    best[0]["picked"] = True
    student_dir = folder / STUDENT_DIR
    if top_n > 1:
        if student_dir.exists():
            shutil.rmtree(student_dir)
        os.replace(Path(best[1].args.output_dir), student_dir)

    # 5. the Pareto table, plot and cards
    files = table.write_pareto(folder, rows, setup, student_dir=STUDENT_DIR)
    for row, trainer in finals:
        where = student_dir if row["picked"] else Path(trainer.args.output_dir)
        files[f"card:{row['name']}"] = table.write_card(trainer, where, row, rows, setup)
    return AutoResult(student=unwrap(best[1].model), picked=best[0]["name"], student_dir=student_dir, rows=rows,
                      files=files)
