"""Distillation inside sentence-transformers' trainer: `DistillationSentenceTransformerTrainer`.

Sentence-embedding users train with `SentenceTransformerTrainer` (its data collator, batch samplers, losses,
evaluators, model card). This trainer is that one with a teacher: a teacher `SentenceTransformer` (or a column of
cached teacher embeddings) whose sentence embeddings the student regresses (Reimers & Gurevych 2020, the recipe
all-MiniLM-L6-v2's family was distilled with), alongside any sentence-transformers loss or alone, plus intermediate
terms (`distill_terms`, as `DistillationArguments`') on the underlying transformers:

    from hf_distill.sentence import DistillationSentenceTransformerArguments, DistillationSentenceTransformerTrainer
    from hf_distill.students import from_teacher

    teacher = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
    student = from_teacher(teacher, layers=[0, 2, 4])          # keeps the teacher's Pooling and Normalize
    args = DistillationSentenceTransformerArguments(output_dir="out", embedding_loss="mse")
    DistillationSentenceTransformerTrainer(model=student, teacher_model=teacher, args=args,
                                           train_dataset=sentences).train()

The loss is `hf_distill.sentence_loss.EmbeddingDistillationLoss` wrapped around the given loss, so evaluators,
logging of loss components and model-card generation stay sentence-transformers' own; the card lists the
distillation loss with its settings (teacher, embedding loss and space, weights, terms) and its citation.

Each text column of a batch is distilled (all of them: anchor, positive, ...). Cached teacher embeddings: a column
(`teacher_embedding_column`, default `cached_column(embedding_space)`: `teacher_embedding` for the output space) of
vectors for a dataset with one text column (`cache_teacher_embeddings` writes it); rows that carry it use it, the
teacher (if given) runs for the others; a column of another space, or one that disagrees with the given teacher on
its first row, is refused. When
the teacher tokenizes differently from the student (another vocabulary or `max_seq_length`), the collator also
tokenizes each text column with the teacher's tokenizer (with the column's prompt, as the student's). This module
needs sentence-transformers (`pip install 'hf-distill[sentence]'`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers.utils import logging

from . import trainer_runs as runs
from .argument_checks import check_fp16_device
from .features.taps import unwrap
from .losses.intermediate import IntermediateDistiller
from .losses.terms import parse_terms
from .sentence_cache import (
    cache_teacher_embeddings,
    cached_column,
    check_cache_against_teacher,
    column_names,
    first_row,
    named_datasets,
    refuse_other_spaces,
    text_columns,
)
from .sentence_loss import (
    CACHED_EMBEDDING,
    EMBEDDING_LOSSES,
    SPACES,
    TEACHER_INPUTS,
    EmbeddingDistillationLoss,
    pooling_module,
    routes_by_task,
)
from .trainer_projections import PROJECTIONS_FILE, ProjectionTraining, _ClearProjectionGradients

try:
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers import SentenceTransformerTrainingArguments as _STArgs
except ImportError as err:  # the optional extra is missing (tests/test_sentence.py hides it to check this)
    raise ImportError(
        "hf_distill.sentence (DistillationSentenceTransformerTrainer) needs sentence-transformers, which is not "
        "installed: pip install 'hf-distill[sentence]' (sentence-transformers>=5.0)."
    ) from err

logger = logging.get_logger(__name__)

__all__ = ["DistillationSentenceTransformerArguments", "DistillationSentenceTransformerTrainer",
           "cache_teacher_embeddings", "cached_column"]

@dataclass
class DistillationSentenceTransformerArguments(_STArgs):
    """`SentenceTransformerTrainingArguments` plus the embedding distillation's fields."""

    kd_weight: float = field(default=1.0, metadata={"help": "Weight of the embedding term (0: intermediate terms "
                                                             "and the sentence-transformers loss only)."})
    task_weight: float = field(default=1.0, metadata={"help": "Weight of the sentence-transformers loss given as "
                                                               "`loss=` (none given: distillation alone)."})
    embedding_loss: str = field(default="mse", metadata={"help": "mse (Reimers & Gurevych), cosine (1 - cos), or "
                                                                  "mse+cosine (their sum)."})
    embedding_space: str = field(default="output", metadata={
        "help": "Where embeddings are compared: output (what encode returns, after Dense/Normalize), pooled (the "
                "Pooling module's output: raw, before Dense and Normalize) or normalized (the output L2-normalised)."})
    distill_terms: list[str] | None = field(default=None, metadata={
        "help": "Intermediate terms on the underlying transformers, as DistillationArguments.distill_terms "
                "(e.g. `loss=hidden_mse,layers=uniform`); they need a teacher model with the student's tokenizer."})
    projection: str = field(default="shared", metadata={
        "help": "When widths differ: shared or per_layer (intermediate terms; the embedding gets one Linear), or "
                "none (refuse)."})
    teacher_embedding_column: str | None = field(default=None, metadata={
        "help": "The dataset column of cached teacher embeddings. Default: the name cache_teacher_embeddings gives "
                "embeddings of `embedding_space` (teacher_embedding for output, teacher_embedding_<space> else), "
                "so a column cached in another space is refused, not compared with the wrong embeddings."})

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, value, allowed in (("embedding_loss", self.embedding_loss, EMBEDDING_LOSSES),
                                     ("embedding_space", self.embedding_space, SPACES),
                                     ("projection", self.projection, ("shared", "per_layer", "none"))):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}.")
        for name in ("kd_weight", "task_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0.")
        parse_terms(self.distill_terms or [])  # a malformed term is refused here, before any model loads

    @property
    def terms(self):
        return parse_terms(self.distill_terms or [])


def _upgrade(args: Any) -> DistillationSentenceTransformerArguments:
    if args is None:
        return DistillationSentenceTransformerArguments(output_dir="tmp_trainer")
    if isinstance(args, DistillationSentenceTransformerArguments):
        return args
    if not isinstance(args, _STArgs):
        raise TypeError("args must be DistillationSentenceTransformerArguments (or SentenceTransformerTraining"
                        f"Arguments, upgraded), got {type(args).__name__}.")
    logger.warning("DistillationSentenceTransformerTrainer: SentenceTransformerTrainingArguments upgraded to "
                   "DistillationSentenceTransformerArguments (every field kept, distillation defaults).")
    kept = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return DistillationSentenceTransformerArguments(**kept)


def _width(model: nn.Module, space: str) -> int:
    if space == "pooled":
        return int(pooling_module(model).pooling_output_dimension)
    return int(model.get_embedding_dimension())


def _same_tokens(student: nn.Module, teacher: nn.Module) -> bool:
    """Whether the teacher reads the student's features as they are (same vocabulary and max_seq_length)."""
    s, t = getattr(student, "tokenizer", None), getattr(teacher, "tokenizer", None)
    return (s is not None and t is not None and type(s) is type(t) and s.get_vocab() == t.get_vocab()
            and student.max_seq_length == teacher.max_seq_length)


class TeacherColumnsCollator:
    """sentence-transformers' collator, with the cached teacher embeddings taken out of the rows (it would tokenize
    them as text) into `teacher_sentence_embedding`, and, when the teacher tokenizes differently, each text column
    tokenized by the teacher too (`teacher_inputs`), with the prompt the student's tokenization of it gets."""

    def __init__(self, base: Any, cached_column: str, teacher_preprocess: Any = None) -> None:
        self.base, self.cached_column, self.teacher_preprocess = base, cached_column, teacher_preprocess

    def __getattr__(self, name: str) -> Any:  # valid_label_columns, prompts, ... of the collator wrapped
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        cached = None
        if rows and self.cached_column in rows[0]:
            cached = torch.tensor([r[self.cached_column] for r in rows], dtype=torch.float32)
            rows = [{k: v for k, v in r.items() if k != self.cached_column} for r in rows]
        if cached is not None or self.teacher_preprocess is None or not rows:
            batch = self.base(rows)
            if cached is not None:
                batch[CACHED_EMBEDDING] = cached
            return batch
        # the teacher tokenizes each text column the collator tokenizes, in its order and with its prompt
        teacher_inputs: list[dict[str, Any]] = []
        student_fn = self.base.preprocess_fn

        def both(inputs: list[Any], prompt: str | None = None, **kwargs: Any) -> dict[str, Any]:
            # the column's task (router_mapping) too: a Router teacher takes the route the student's column takes
            teacher_inputs.append(self.teacher_preprocess(inputs, prompt=prompt, task=kwargs.get("task")))
            return student_fn(inputs, prompt=prompt, **kwargs)

        self.base.preprocess_fn = both
        try:
            batch = self.base(rows)
        finally:
            self.base.preprocess_fn = student_fn
        batch[TEACHER_INPUTS] = teacher_inputs
        return batch


class SentenceDistillationMixin(ProjectionTraining):
    """Distillation for sentence-transformers' trainer classes (module docstring). Arguments as
    `SentenceTransformerTrainer`'s (keywords), plus `teacher_model`: a SentenceTransformer, a folder or Hub id, or
    None when every training row carries cached embeddings."""

    training_args_class = DistillationSentenceTransformerArguments

    def __init__(self, model: nn.Module | None = None, args: Any = None, *, teacher_model: Any = None,
                 loss: Any = None, train_dataset: Any = None, eval_dataset: Any = None, **kwargs: Any) -> None:
        args = _upgrade(args)
        check_fp16_device(args)  # fp16 on a CPU would train in float32, as for DistillationTrainer
        if kwargs.get("model_init") is not None or model is None:
            raise ValueError("DistillationSentenceTransformerTrainer needs model= (the student SentenceTransformer); "
                             "model_init is not supported: build the student first and pass it as model=.")
        if not isinstance(model, SentenceTransformer):
            raise TypeError(f"model must be a SentenceTransformer (the student), got {type(model).__name__}.")
        space = args.embedding_space
        column = args.teacher_embedding_column or cached_column(space)
        refuse_other_spaces(train_dataset, eval_dataset, column, space)
        cached = [n for n, d in named_datasets(train_dataset) if column in column_names(d)]
        for name, data in named_datasets(train_dataset) + named_datasets(eval_dataset):
            if column in column_names(data) and len(text_columns(data, column)) != 1:
                raise ValueError(
                    f"{column!r} (cached teacher embeddings) covers one text column, but dataset {name!r} has "
                    f"{text_columns(data, column)}. Give teacher_model= and drop {column!r}, or keep one text column.")
        all_cached = bool(train_dataset is not None) and len(cached) == len(named_datasets(train_dataset))
        if teacher_model is None and not all_cached:
            raise ValueError(f"teacher_model is None and the training rows have no {column!r} column of cached "
                             "teacher embeddings: give teacher_model=, or cache_teacher_embeddings(...) first.")
        uncached_eval = [n or "eval_dataset" for n, d in named_datasets(eval_dataset) if column not in column_names(d)]
        if teacher_model is None and uncached_eval and args.kd_weight > 0:
            raise ValueError(f"teacher_model is None and {', '.join(map(repr, uncached_eval))} (evaluation) has no "
                             f"{column!r} column: cache_teacher_embeddings(...) on it too, or give teacher_model=.")
        if args.kd_weight == 0 and loss is None and not args.distill_terms:
            raise ValueError("kd_weight=0 with no loss= and no distill_terms: nothing to train. Set kd_weight > 0 or "
                             "give a sentence-transformers loss.")
        if args.terms and (teacher_model is None or all_cached):
            raise ValueError("distill_terms need the teacher's intermediate features, which cached embeddings do not "
                             "hold: give teacher_model= and no cached embedding column, or remove distill_terms.")
        if isinstance(teacher_model, str | os.PathLike):
            teacher_model = SentenceTransformer(str(teacher_model), device=str(args.device))
        if teacher_model is not None and not isinstance(teacher_model, SentenceTransformer):
            raise TypeError(f"teacher_model must be a SentenceTransformer (or its folder / Hub id), got "
                            f"{type(teacher_model).__name__}.")
        for role, m in (("student", model), ("teacher", teacher_model)):
            if m is not None and space == "pooled" and pooling_module(m) is None:
                raise ValueError(f"embedding_space='pooled' but the {role} has no Pooling module. Use 'output'.")
        if teacher_model is not None:  # where the Trainer will put the student (args.device), frozen
            teacher_model.to(args.device).eval().requires_grad_(False)
            t_width = _width(teacher_model, space)
        else:
            first = next(d for _, d in named_datasets(train_dataset))
            t_width = len(first_row(first)[column])
        for name, data in named_datasets(train_dataset) + named_datasets(eval_dataset):
            width = len(first_row(data)[column]) if column in column_names(data) else t_width
            if width != t_width:
                raise ValueError(f"{column!r} of dataset {name!r} holds {width}-wide vectors, but the "
                                 f"teacher's {space} embeddings are {t_width} wide. Recompute the cache.")
        if teacher_model is not None:
            check_cache_against_teacher(train_dataset, eval_dataset, column, teacher_model, space,
                                         args.router_mapping)
        s_width = _width(model, space)
        same = teacher_model is None or _same_tokens(model, teacher_model)
        routed = [role for role, m in (("student", model), ("teacher", teacher_model))
                  if m is not None and routes_by_task(m)]
        if args.terms and routed:
            raise ValueError(f"distill_terms tap one transformer, but the {' and the '.join(routed)} routes each "
                             "column to its own modules (a Router): remove distill_terms.")
        if args.terms and not same:
            raise ValueError("distill_terms compare token features, but the teacher tokenizes differently from the "
                             "student (vocabulary or max_seq_length). Remove distill_terms or use the same tokenizer.")
        projection = None
        if s_width != t_width:
            if args.projection == "none":
                raise ValueError(f"The student's {space} embeddings are {s_width} wide and the teacher's {t_width}, "
                                 "with projection='none'. Set projection='shared' to learn a Linear between them.")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(args.seed)
                projection = nn.Linear(s_width, t_width).to(args.device)
        intermediate = None
        if args.terms:
            intermediate = IntermediateDistiller(args.terms, model[0].auto_model, teacher_model[0].auto_model,
                                                 args.projection, seed=args.seed)
        parts = {"embedding": projection,
                 "intermediate": intermediate.projections if intermediate is not None else None}
        parts = {k: v.to(args.device) for k, v in parts.items() if v is not None}
        self._distill_projections = nn.ModuleDict(parts) if parts else None
        self.teacher = teacher_model
        config = {"teacher": _name(teacher_model) if teacher_model is not None else f"cached column {column!r}",
                  "embedding_loss": args.embedding_loss, "embedding_space": space, "kd_weight": args.kd_weight,
                  "task_weight": args.task_weight if loss is not None else 0.0,
                  "distill_terms": args.distill_terms or [], "projection": (
                      f"Linear({s_width} -> {t_width})" if projection is not None else "none")}

        def wrap(inner: Any) -> EmbeddingDistillationLoss:
            if inner is not None and not isinstance(inner, nn.Module):
                inner = inner(model)  # a loss factory, as sentence-transformers calls it
            return EmbeddingDistillationLoss(
                model, teacher_model, inner, embedding_loss=args.embedding_loss, embedding_space=space,
                kd_weight=args.kd_weight, task_weight=args.task_weight, projection=projection,
                intermediate=intermediate, config={**config, "loss": type(inner).__name__ if inner else None})

        wrapped = {k: wrap(v) for k, v in loss.items()} if isinstance(loss, dict) else wrap(loss)
        super().__init__(model, args, loss=wrapped, train_dataset=train_dataset, eval_dataset=eval_dataset, **kwargs)
        preprocess = None if same else teacher_model.preprocess
        self.data_collator = TeacherColumnsCollator(self.data_collator, column, preprocess)
        for distill_loss in self._distill_losses():  # the teacher runs in the student's mixed precision (bf16)
            distill_loss.teacher_autocast = self.accelerator.autocast
        if self._distill_projections is not None:
            self.add_callback(_ClearProjectionGradients(self._distill_projections))
        self.model.model_card_data.add_tags(["hf-distill", "knowledge-distillation"])

    def _projections(self) -> nn.Module | None:
        return getattr(self, "_distill_projections", None)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """sentence-transformers' own (it takes no model), then the projections, which the checkpoint must hold."""
        super(ProjectionTraining, self)._load_from_checkpoint(resume_from_checkpoint)
        if self._projections() is not None:
            self._load_projections(resume_from_checkpoint, f"{resume_from_checkpoint} has no {PROJECTIONS_FILE}: it "
                                   "was not written by a run with the same projection, so resuming would restart it "
                                   "from scratch.")

    def train(self, *args: Any, **kwargs: Any):
        """The Trainer's, refusing a checkpoint written with `save_only_model=True` as `DistillationTrainer` does
        (hf_distill.trainer_runs): it holds no optimizer state, so the run would go on with a new optimizer and its
        learning-rate schedule restarted from step 0."""
        runs.check_resumable(self, args[0] if args else kwargs.get("resume_from_checkpoint"))
        return super().train(*args, **kwargs)

    def hyperparameter_search(self, *args: Any, **kwargs: Any):
        """Refused with the fix: the Trainer's search builds each trial's student with `model_init`, which this
        trainer does not take (its teacher, projection and loss are built around the student given)."""
        raise ValueError(
            "hyperparameter_search needs model_init (a new student per trial), which "
            "DistillationSentenceTransformerTrainer does not take. Search in your own loop instead: for each trial "
            "build the student and the trainer, train, and rank the trials by an evaluator's metric (eval_loss is the "
            "distillation loss at each trial's kd_weight and task_weight, not comparable across trials)."
        )

    def _distill_losses(self) -> list[EmbeddingDistillationLoss]:
        return list(self.loss.values()) if isinstance(self.loss, dict) else [self.loss]

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None):
        """sentence-transformers' own, with this batch's cached teacher embeddings or teacher tokenization handed
        to the distillation loss (they are not model features)."""
        extra = {k: inputs.pop(k) for k in (CACHED_EMBEDDING, TEACHER_INPUTS) if k in inputs}
        for distill_loss in self._distill_losses():
            distill_loss.pending = extra
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)


class DistillationSentenceTransformerTrainer(SentenceDistillationMixin, SentenceTransformerTrainer):
    """`SentenceTransformerTrainer` + a frozen teacher SentenceTransformer (or cached embeddings): swap the class
    and the arguments (`DistillationSentenceTransformerArguments`), add `teacher_model=`."""


def _name(model: nn.Module) -> str:
    data = getattr(model, "model_card_data", None)
    name = getattr(data, "model_id", None) or getattr(data, "base_model", None)
    auto = getattr(unwrap(model)[0], "auto_model", None) if len(unwrap(model)) else None  # none in a Router
    return str(name or getattr(getattr(auto, "config", None), "name_or_path", None) or type(model).__name__)
