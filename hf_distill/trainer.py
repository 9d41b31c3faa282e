"""`DistillationTrainer`: a `transformers.Trainer` whose loss also learns from a teacher.

Only what distillation needs is overridden: the loss (`compute_loss`), the logging of its components
(`log`), the optimizer (projections join it), checkpoints (projections are saved and restored with
them) and column filtering (teacher columns survive it). Everything else is the Trainer's own, so
gradient accumulation, DDP, mixed precision, callbacks, checkpointing and `push_to_hub` behave as usual.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from .arguments import DistillationArguments, as_distillation_arguments
from .data.cache import (
    LOGITS_COLUMN,
    TOPK_INDICES_COLUMN,
    TOPK_VALUES_COLUMN,
    cached_hidden_layers,
    cached_teacher_info,
)
from .data.collators import TEACHER_PREFIX, KeepTeacherColumnsCollator, TeacherOutputsCollator
from .features import heads as heads_mod
from .features.heads import (
    TOKEN_LEVEL,
    Head,
    check_kd_loss,
    head_logits,
    runtime_head,
    static_head,
    with_decoder_inputs,
)
from .features.taps import forward, unwrap
from .losses import chunked
from .losses import divergences as losses
from .losses.intermediate import IntermediateDistiller
from .losses.normalise import (
    COUNT_KINDS,
    StepCounts,
    batch_counts,
    decoder_positions,
    kd_positions,
    seq2seq_kd_positions,
)
from .placement import check_engine, check_fsdp2_wrap, place_teacher, send_teacher_outputs, teacher_input_device
from .teacher import (
    check_padding_mass,
    load_teacher,
    padding_mass,
    shared_base_teacher,
    shares_parameters,
    validate_pair,
)
from .tracking import ComponentTracker

PROJECTIONS_FILE = "distill_projections.pt"
# Under DeepSpeed the projections ride inside the engine as this submodule of the student while train() runs.
PROJECTIONS_ATTR = "hf_distill_projections"
logger = logging.get_logger(__name__)
# Span logits at padded positions: far below any real logit, finite so no inf - inf appears in the losses.
_NO_POSITION = -1e9


class DistillationTrainer(Trainer):
    """`Trainer` + a frozen teacher. Swap the class, keep everything else.

    Args:
        model: the student (any `nn.Module` whose forward returns logits, or a transformers model).
        args: a `DistillationArguments`.
        teacher_model: the teacher, or a local path / Hub id to load with the student's auto class, or a
            list of them (multi-teacher logit distillation, see `teacher_weights` and `multi_teacher`;
            intermediate terms use the first). It may be the student itself when the student is a PEFT
            model: the teacher is then the shared base with adapters off (self-distillation). May be `None`
            when every training row carries cached teacher outputs (hf_distill.data.cache).
        teacher_processing_class: the teacher's tokenizer (or a list, one per teacher; None entries allowed), so that
            its vocabulary can be compared with the student's (`processing_class`). Not needed for a teacher given
            as a folder or Hub id (its saved tokenizer is read) or one whose `name_or_path` holds a tokenizer; where
            the teacher's tokenizer cannot be found a warning says that the vocabularies were not compared.
        All other arguments are `Trainer`'s.
    """

    # compute_loss returns a per-micro-batch value whose token-level terms are already shares of the step mean
    # (hf_distill.losses.normalise) scaled up by the micro-batch count: let the Trainer divide by the accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        model: PreTrainedModel | nn.Module | None = None,
        args: DistillationArguments | None = None,
        *trainer_args: Any,
        teacher_model: nn.Module | str | list[nn.Module | str] | None = None,
        teacher_processing_class: Any | list[Any] | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        if args is None:
            args = DistillationArguments(output_dir="trainer_output")
        args = as_distillation_arguments(args)  # plain TrainingArguments: every field kept, logged as a warning
        if args.device.type == "cpu" and (args.fp16 or getattr(args, "mixed_precision", "no") == "fp16"):
            # accelerate runs fp16 autocast only on GPUs and other accelerators: on a CPU it trains in float32.
            raise ValueError(
                "fp16=True (or ACCELERATE_MIXED_PRECISION=fp16) needs a CUDA GPU (or another fp16 accelerator), but "
                "this run is on the CPU (use_cpu=True or no GPU found), where it would silently train in float32. "
                "On a CPU set bf16=True instead (bf16 autocast), or fp16=False."
            )
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        # transformers 5 would otherwise pass num_items_in_batch to BERT-like models and rescale the loss
        # by the number of processes; our loss is a plain per-batch mean (see ENVIRONMENT.md pitfall 1).
        self.model_accepts_loss_kwargs = False

        teachers = teacher_model if isinstance(teacher_model, list | tuple) else [teacher_model]
        teachers = [t for t in teachers if t is not None]
        sources = [str(t) if isinstance(t, str | os.PathLike) else None for t in teachers]  # their tokenizers too
        teachers = [load_teacher(str(t), like=self.model) if isinstance(t, str | os.PathLike) else t for t in teachers]
        t_tokenizers = _per_teacher(teacher_processing_class, len(teachers))
        self._check_arguments(len(teachers))
        self.teacher_weights = _teacher_weights(self.args.teacher_weights, len(teachers))
        # Self-distillation on one PEFT base: the "teacher" is the student with its adapters off. It must not
        # be frozen or put in eval mode for good (that would freeze or un-dropout the student too).
        self.shared_base = bool(teachers) and shares_parameters(teachers[0], self.model)
        if any(shares_parameters(t, self.model) for t in teachers[1:]):
            raise ValueError("Only the first teacher may share its parameters with the student (self-distillation).")
        check_engine(self.args, self.accelerator)  # an FSDP/DeepSpeed request accelerate ignored (CPU): refused
        check_fsdp2_wrap(self.model, self.accelerator)  # an FSDP2 wrap accelerate would crash on: refused
        # Frozen, eval mode, and replicated or sharded as the accelerator's mode requires (hf_distill.placement).
        self.teachers = [
            t if (i == 0 and self.shared_base) else place_teacher(t, self.accelerator) for i, t in enumerate(teachers)
        ]
        self.teacher = self.teachers[0] if self.teachers else None
        self.teacher_metrics: dict[str, float] = {}  # set by evaluate_teacher(), reported by the model card
        self._pending_projections: dict | None = None  # gathered in _save_checkpoint for the save and its push
        terms = self.args.terms
        self.intermediate: IntermediateDistiller | None = None
        if terms:
            # Without a teacher, its shape (layers, width) comes from the hidden states cached in the dataset.
            source = self.teacher if self.teacher is not None else cached_teacher_info(self.train_dataset)
            if source is None:
                raise ValueError(
                    "distill_terms need teacher features, so teacher_model must be given "
                    "(or a train dataset with cached teacher hidden states from hf_distill.data.cache)."
                )
            self.intermediate = IntermediateDistiller(terms, self.model, source, self.args.projection,
                                                      seed=self.args.seed)
            if self.intermediate.projections is not None:
                self.intermediate.projections.to(self.args.device)
                if not self._projections_in_engine():
                    self.add_callback(_ClearProjectionGradients(self.intermediate.projections))
        if self.args.projection_lr is not None and (self.intermediate is None or self.intermediate.projections is None):
            raise ValueError(
                f"projection_lr={self.args.projection_lr} does nothing: this run trains no projection (no "
                "distill_terms, or the terms compare features of equal width). Remove projection_lr."
            )
        shared_vocab = [
            validate_pair(self.model, t, self.args, tokenizer=self.processing_class, teacher_tokenizer=tok, source=src)
            for t, tok, src in zip(self.teachers, t_tokenizers, sources, strict=True)
        ]
        self._shared_vocab = min((v for v in shared_vocab if v is not None), default=None)
        self._padding_checked: set[int] = set()  # teachers whose extra vocabulary ids were measured (padding)
        if len(self.teachers) > 1 and self.args.kd_weight > 0 and self.args.kd_loss == "mse":
            if self.args.multi_teacher != "losses":
                raise ValueError(
                    "multi_teacher='probs' averages probability distributions, which kd_loss='mse' does not use. "
                    "Use multi_teacher='losses' (a weighted sum of one MSE per teacher) or kd_loss='kl'/'soft_ce'."
                )

        # What the arguments were validated against. Nothing else is kept from this model: the Trainer may swap
        # (model_init), wrap (DDP, engines) or compile (torch_compile) it later, so compute_loss resolves the model
        # it is given (`_student_state`).
        self._head = static_head(self.model)
        self._causal = self._head is Head.CAUSAL_LM
        self._student_shape = _shape(self.model)
        self._student_cache: _StudentState | None = None
        self._teacher_rebuilds = False  # the teacher's logits were rebuilt from its hidden states (checked once)
        # The label tensor of token-level heads (counted positions, `kd_token_mask="labels"`).
        self._token_labels = self.label_names[0] if len(self.label_names or []) == 1 else "labels"
        self._step = StepCounts()
        if self.args.kd_weight > 0:
            check_kd_loss(self._head, self.args.kd_loss)
            for t in self.teachers:
                check_kd_loss(static_head(t), self.args.kd_loss, "the teacher")
        self._check_projection_optimizer()
        self._chunk = self._chunk_size()
        self._teacher_params = _forward_params(self.teacher) if self.teacher is not None else set()
        self.data_collator = TeacherOutputsCollator(self.data_collator)
        self.tracker = ComponentTracker()
        self._check_teacher_columns(self.train_dataset)
        if self.args.eval_with_teacher and self.eval_dataset is not None:
            evals = self.eval_dataset if isinstance(self.eval_dataset, dict) else {"eval": self.eval_dataset}
            for name, data in evals.items():
                self._check_teacher_columns(data, f"evaluation ({name})")

    def _check_arguments(self, n_teachers: int) -> None:
        """Fill the arguments whose default depends on the student's head (`resolve_head_defaults`: T = 1 and the
        completion tokens for a causal LM) and refuse the ones given that would do nothing for this student and
        these teachers."""
        head = static_head(self.model)
        sequence_level = head in (Head.SEQUENCE, Head.MULTI_LABEL, Head.REGRESSION, Head.QUESTION_ANSWERING)
        if sequence_level and self.args.given("kd_token_mask"):
            raise ValueError(
                f"kd_token_mask={self.args.kd_token_mask!r} does nothing for this student ({head.value}): it selects "
                "the positions of token-level logits (token classification, masked or causal LM). Leave it unset."
            )
        if n_teachers < 2:
            for name in ("teacher_weights", "multi_teacher"):
                if getattr(self.args, name) is not None:
                    raise ValueError(
                        f"{name}={getattr(self.args, name)!r} does nothing with {n_teachers or 'no'} teacher model: it "
                        "weighs or combines several teachers (teacher_model=[...]). Remove it."
                    )
        filled = self.args.resolve_head_defaults(causal=head is Head.CAUSAL_LM, token_level=not sequence_level)
        if filled:
            logger.info(
                "Not given, so set for a %s student: %s (see DistillationArguments).",
                "causal-LM" if head is Head.CAUSAL_LM else "non-causal",
                ", ".join(f"{k}={v!r}" for k, v in filled.items()),
            )

    def _check_padding(self, i: int, parts) -> None:
        """Once per teacher with more vocabulary ids than the student: its mean probability on the extra ids over the
        first distilled batch's counted positions, refused above the bound (teacher.check_padding_mass). `parts`
        yields that batch's (n, V) teacher logits at those positions."""
        if i in self._padding_checked:
            return
        total, count, vocab = 0.0, 0, None
        for rows in parts:
            vocab = rows.shape[-1]
            if vocab <= self._shared_vocab:  # this teacher has no ids the student lacks
                self._padding_checked.add(i)
                return
            if len(rows):
                total, count = total + padding_mass(rows, self._shared_vocab) * len(rows), count + len(rows)
        if count:  # (a batch without a distilled position leaves the check to the next one)
            check_padding_mass(total / count, self._shared_vocab, vocab)
            self._padding_checked.add(i)

    def _chunk_size(self) -> int | None:
        """Tokens per chunk for the causal-LM loss (hf_distill.losses.chunked), or None for whole logits.

        `kd_chunk_size=None` (the default) chunks wherever the result is provably the same: a causal-LM student and
        teacher whose logits hf_distill can rebuild from their last hidden states, one teacher (or cached dense
        logits), no label smoothing or compute_loss_func (they need the full logits). A value set by the user
        where chunking cannot be honoured is refused. No model runs here: whether the logits can be rebuilt from the
        hidden states is checked on the model being trained, at its first training step (`_chunk_for`)."""
        asked = self.args.kd_chunk_size
        why = None
        if self._head is not Head.CAUSAL_LM:
            why = "the student is not a causal LM"
        elif len(self.teachers) > 1:
            why = "several teachers are combined"
        elif self.shared_base:
            why = "the teacher is the student's own base (adapters off)"
        elif self.label_smoother is not None or self.compute_loss_func is not None:
            why = "label_smoothing_factor or compute_loss_func needs the student's full logits"
        elif self.args.kd_loss == "mse" and self.args.kd_weight > 0:
            why = "kd_loss='mse' compares raw logits, which the chunked loss head does not keep"
        elif not chunked.supports_hidden_only(self.model) or (
            self.teacher is not None and not chunked.supports_hidden_only(self.teacher)
        ):
            why = "the model's forward has no `logits_to_keep` argument"
        if why is not None:
            if asked is not None:
                raise ValueError(f"kd_chunk_size={asked} cannot be honoured: {why}. Leave kd_chunk_size unset.")
            if self._head is Head.CAUSAL_LM:
                logger.warning("Causal-LM logits are computed whole (not in chunks): %s.", why)
            return None
        return asked if asked is not None else chunked.default_chunk(unwrap(self.model).config.vocab_size)

    def _chunk_for(self, model: nn.Module) -> int | None:
        """`self._chunk` for this model once its logits (and the teacher's) are shown to be rebuilt exactly from the
        last hidden states: one two-token forward of each, no gradient, at the first training step of each model
        (so no model runs when the trainer is built). A model whose logits cannot be rebuilt is refused when
        kd_chunk_size was given, else trained on whole logits with a warning."""
        if self._chunk is None:
            return None
        state = self._student_state(model)
        if state.rebuilds is None:
            try:
                with _unsharded(model):
                    chunked.check_logits_fn(state.inner, state.inner.config.vocab_size, "student")
                if self.teacher is not None and not self._teacher_rebuilds:
                    with _unsharded(self.teacher):
                        chunked.check_logits_fn(self.teacher, unwrap(self.teacher).config.vocab_size, "teacher")
                    self._teacher_rebuilds = True
                state.rebuilds = True
            except ValueError as err:
                if self.args.kd_chunk_size is not None:
                    raise
                logger.warning("Causal-LM logits are computed whole (not in chunks): %s.", err)
                state.rebuilds = False
        return self._chunk if state.rebuilds else None

    def _student_state(self, model: nn.Module) -> _StudentState:
        """What the loss needs from the student it is given (head, forward arguments, LM head), resolved once per
        model: the Trainer swaps the model under `model_init` (each hyperparameter-search trial), wraps it (DDP,
        DeepSpeed) and compiles it (`torch_compile`, whose `_orig_mod` is the model) after the trainer is built.
        A model of another kind or shape than the one the arguments were validated against is refused."""
        inner = unwrap(model)
        if self._student_cache is not None and self._student_cache.inner is inner:
            return self._student_cache
        shape = _shape(inner)
        if shape != self._student_shape:
            raise ValueError(
                f"The model to train ({type(inner).__name__}: {_describe(shape)}) is not the kind of model this "
                f"trainer was built with and validated against ({_describe(self._student_shape)}). model_init must "
                "return students with one head, vocabulary and label set; build one trainer per kind of student."
            )
        if self.teachers and shares_parameters(self.teachers[0], inner) != self.shared_base:
            raise ValueError(
                "The model to train shares its parameters with the teacher differently from the model the trainer "
                "was built with (self-distillation on one PEFT base). With model_init, give a teacher that is not "
                "the student's own base, or pass model= instead of model_init."
            )
        if self.intermediate is not None:
            self.intermediate.bind_student(inner)
        self._student_cache = _StudentState(inner, _forward_params(inner))
        return self._student_cache

    def call_model_init(self, trial=None) -> nn.Module:
        """The Trainer's `model_init` call (in `__init__`, and in `train()` for every run and hyperparameter-search
        trial). A new student starts a new run: the projections restart from `seed` too, and under DeepSpeed they
        ride in the new student (`_projections_attached`)."""
        model = super().call_model_init(trial)
        proj = self._projections() if getattr(self, "intermediate", None) is not None else None
        if proj is not None:
            self.intermediate.reset_projections()
            if self._attached():
                self.model._modules.pop(PROJECTIONS_ATTR)
                model.add_module(PROJECTIONS_ATTR, proj)
        return model

    def _logits_fns(self, model: nn.Module):
        """Hidden states -> logits of the student `model` and of the teacher (hf_distill.losses.chunked), per model."""
        state = self._student_state(model)
        if state.logits_fns is None:
            teacher = chunked.logits_fn(self.teacher) if self.teacher is not None else None
            state.logits_fns = (chunked.logits_fn(state.inner), teacher)
        return state.logits_fns

    # ------------------------------------------------------------------ data

    def _set_signature_columns_if_needed(self) -> None:
        if self._signature_columns is None:
            super()._set_signature_columns_if_needed()
            # The teacher may need inputs the student ignores (a BERT teacher's token_type_ids for a
            # DistilBERT student); cached teacher outputs are columns too.
            extra = {p for p in self._teacher_params if p not in ("labels", "kwargs", "args")}
            extra.add(f"{TEACHER_PREFIX}logits")
            self._signature_columns += sorted(extra - set(self._signature_columns))

    def _remove_unused_columns(self, dataset, description: str | None = None):
        self._set_signature_columns_if_needed()
        cached = [c for c in getattr(dataset, "column_names", None) or [] if c.startswith(TEACHER_PREFIX)]
        self._signature_columns += [c for c in cached if c not in self._signature_columns]
        return super()._remove_unused_columns(dataset, description)

    def _get_collator_with_removed_columns(self, data_collator, description: str | None = None):
        """Datasets other than `datasets.Dataset` are filtered row by row in the collator: keep `teacher_*`."""
        if not self.args.remove_unused_columns:
            return data_collator
        self._set_signature_columns_if_needed()
        return KeepTeacherColumnsCollator(data_collator, self._signature_columns, description=description,
                                          model_name=type(self.model).__name__)

    def _check_teacher_columns(self, dataset, which: str = "train") -> None:
        if dataset is None:
            return
        names, first = self._first_row(dataset, needed=self.teacher is None)
        cached_logits = [c for c in names if c.startswith(LOGITS_COLUMN) or c.startswith(TOPK_VALUES_COLUMN)]
        cached = [c for c in names if c.startswith(TEACHER_PREFIX)]
        if cached and self._head is Head.SEQ2SEQ_LM:
            raise ValueError(
                f"The {which} dataset carries cached teacher outputs ({', '.join(cached)}), but hf_distill.data.cache does "
                "not cache encoder-decoder teachers (their outputs depend on the decoder inputs): drop those columns "
                "and let the teacher run."
            )
        if cached_logits and self._head is Head.QUESTION_ANSWERING:
            raise ValueError(
                f"The {which} dataset carries cached teacher logits ({', '.join(cached_logits)}), but a question-"
                "answering student compares start and end logits, which hf_distill.data.cache does not store: drop those "
                "columns and let the teacher run."
            )
        for name in [c for c in names if c == LOGITS_COLUMN or c.startswith(f"{LOGITS_COLUMN}_")]:
            width = torch.as_tensor(first[name]).shape[-1]
            num_labels = _num_labels(self.model)
            if num_labels is not None and width != num_labels:
                raise ValueError(
                    f"The {which} dataset's {name} have width {width} but the student has {num_labels} "
                    "labels. Recompute the cached logits with a teacher of the same label set, or drop the column."
                )
        if LOGITS_COLUMN not in names and self.teacher is None and self.args.kd_weight > 0:
            topk = TOPK_VALUES_COLUMN in names and TOPK_INDICES_COLUMN in names
            if not topk or self.args.kd_loss == "mse":
                raise ValueError(
                    "kd_weight > 0 needs teacher logits: pass teacher_model, or add a `teacher_logits` column "
                    f"to the {which} dataset (see hf_distill.data.cache; cached top-k logits serve kd_loss kl/soft_ce)."
                )
        if self.teacher is None and self.intermediate is not None:
            missing = sorted(self.intermediate.teacher_request.hidden - cached_hidden_layers(names))
            if missing:
                raise ValueError(
                    f"distill_terms need teacher hidden states {missing}, which the {which} dataset does not carry "
                    "(teacher_hidden_<i> columns): pass teacher_model, or cache them with "
                    f"hf_distill.data.cache.cache_teacher_outputs(..., hidden_layers={missing})."
                )

    @staticmethod
    def _first_row(dataset: Any, needed: bool) -> tuple[list[str], dict[str, Any]]:
        """Column names and first row of any train dataset the Trainer takes, without consuming it.

        A `datasets.Dataset` has its column names; other datasets (torch map-style or iterable, lists of dicts,
        `datasets.IterableDataset`) are read at their first row: index 0, or a fresh iterator's first item. A dataset
        that is its own iterator would lose that row, so it is only read when the checks cannot do without it
        (`needed`: no teacher to fall back on) and is then refused with what to do instead.
        """
        import datasets

        if isinstance(dataset, datasets.Dataset):
            names = list(dataset.column_names)
            return names, (dataset[0] if any(n.startswith(TEACHER_PREFIX) for n in names) and len(dataset) else {})
        if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
            row = dataset[0] if len(dataset) else {}
        elif hasattr(dataset, "__iter__"):
            rows = iter(dataset)
            if rows is dataset:
                if not needed:
                    return [], {}
                raise ValueError(
                    f"The train dataset ({type(dataset).__name__}) is its own iterator (iter(dataset) is dataset), so "
                    "its first row cannot be read to check the cached teacher_* columns without losing it. Give an "
                    "IterableDataset whose __iter__ starts a new pass over the rows (e.g. a generator: `yield from "
                    "rows`), a map-style Dataset, or pass teacher_model."
                )
            row = next(rows, {})
        else:
            return [], {}
        return (list(row) if isinstance(row, dict) else []), (row if isinstance(row, dict) else {})

    # ------------------------------------------------------------------ loss

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The Trainer's prefetch of one optimizer step's micro-batches, plus the counts that normalise the
        token-level terms over the whole step (hf_distill.losses.normalise)."""
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        counts = sum(
            (batch_counts(b, self._token_labels, self.args.kd_token_mask, self._causal, self._head is Head.SEQ2SEQ_LM)
             for b in batch_samples),
            torch.zeros(len(COUNT_KINDS), dtype=torch.float64),
        )
        processes = self.accelerator.num_processes if self.args.average_tokens_across_devices else 1
        if processes > 1:
            counts = self.accelerator.reduce(counts.to(self.args.device), "sum").cpu()
        self._step.start(counts, len(batch_samples), processes)
        return batch_samples, num_items_in_batch

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        cached = {k: inputs.pop(k) for k in list(inputs) if k.startswith(TEACHER_PREFIX)}
        student = self._student_state(model)  # the model as the Trainer prepared it, not the one it was built with
        seq2seq = self._head is Head.SEQ2SEQ_LM
        if seq2seq:  # teacher and student read the same decoder inputs, made from the labels if the batch has none
            inputs = with_decoder_inputs(model, inputs, self._token_labels)
        distill = model.training or self.args.eval_with_teacher
        mask = inputs.get("attention_mask")
        # In the training loop, token-level means are rescaled to the whole optimizer step's mean.
        step_mean = model.training and self._step.take()
        local = (batch_counts(inputs, self._token_labels, self.args.kd_token_mask, self._causal, seq2seq)
                 if step_mean else None)
        if self.intermediate is not None:
            # Term weights are re-read every step, like kd_weight and temperature, so callbacks
            # (hf_distill.callbacks) can change them; a term of weight 0 is neither captured nor computed.
            self.intermediate.set_weights(self.args.distill_terms)

        # The task loss: in training when task_weight > 0, in evaluation always. As in Trainer.compute_loss,
        # with label smoothing or a compute_loss_func the loss is computed here from the outputs, so the
        # student is not given `labels`; otherwise it is the student's own loss on `label_names`.
        names = self.label_names or []
        has_labels = bool(names) and all(inputs.get(n) is not None for n in names)
        want_task = has_labels and (not distill or self.args.task_weight > 0)
        own_task = (self.label_smoother is not None or self.compute_loss_func is not None) and "labels" in inputs
        if model.training and self.args.task_weight > 0 and self.args.label_names is not None and not has_labels:
            missing = [n for n in names if inputs.get(n) is None]
            raise ValueError(
                f"label_names={names} but the training batch has no {missing} (its keys: {sorted(inputs)}), so the "
                "task term (task_weight > 0) cannot be computed. Name the batch's label keys in label_names, or set "
                "task_weight=0 to train on the teacher alone."
            )
        # Teacher first: the student's backward then follows its own forward while its activations are still
        # in the CPU caches; run after the student, the teacher's forward evicts them (3-5% of a logit-KD step
        # on the benchmark CPU, benchmarks/speed.py).
        # Causal LMs in training: logits a chunk of tokens at a time from the last hidden states (hf_distill.losses.chunked).
        chunks = self._chunk_for(model) if (model.training and distill and TOPK_VALUES_COLUMN not in cached) else None
        if distill:
            t_views, t_feats, t_hidden = self._teacher_outputs(inputs, cached, hidden_only=chunks is not None)
            if self.args.kd_weight > 0:  # every teacher's logits, the first one's included
                extra = [self._extra_teacher_views(i, inputs, cached) for i in range(1, len(self.teachers))]
                all_t_views = [t_views, *extra]
        student_labels = want_task and not own_task and chunks is None
        s_kwargs = {
            k: v for k, v in inputs.items() if student.accepts(k) and (k not in names or student_labels)
        }
        if chunks is not None:
            s_kwargs = chunked.hidden_only_kwargs(s_kwargs)
        taps = self.intermediate.student_taps if (distill and self.intermediate) else None
        s_out, s_feats = forward(model, s_kwargs, taps)
        head = Head.CAUSAL_LM if chunks is not None else runtime_head(
            model, heads_mod._logits(s_out) if student.head is None else None, inputs.get(self._token_labels)
        )
        token_level = head in TOKEN_LEVEL
        if distill and self.args.kd_weight > 0:
            check_kd_loss(head, self.args.kd_loss)

        task = kd = None
        if chunks is not None:
            kd, task = self._chunked_terms(s_out, t_views[0], t_hidden, inputs, want_task, chunks)
        else:
            if want_task:
                task = self._task_loss(s_out, inputs, head, num_items_in_batch, step_mean)
            if distill and self.args.kd_weight > 0:
                kd = self._kd_loss(head, head_logits(s_out, head), all_t_views, inputs)

        components: dict[str, torch.Tensor] = {}
        weights: dict[str, float] = {}
        if task is not None:
            if step_mean and token_level and not self.compute_loss_func:
                count = float(local[COUNT_KINDS.index("labels")])
                # A micro-batch without a counted label adds nothing (a model's own mean over no tokens is NaN).
                task = task * self._step.scale("labels", count) if count > 0 else _zero_like_graph(s_out)
            components["task"] = task
            weights["task"] = self.args.task_weight if distill else 1.0
        if kd is not None:
            if step_mean and token_level:
                kd = kd * self._step.scale("kd", float(local[COUNT_KINDS.index("kd")]))
            components["kd"] = kd
            weights["kd"] = self.args.kd_weight
        if distill:
            if self.intermediate is not None:
                decoder_mask = decoder_positions(inputs, self._token_labels) if seq2seq else None
                terms = self.intermediate.losses(s_feats, t_feats, mask, decoder_mask)
                if step_mean:
                    kinds = self.intermediate.count_kinds()
                    for name, value in terms.items():
                        if kinds.get(name) is not None:
                            count = float(local[COUNT_KINDS.index(kinds[name])])
                            terms[name] = value * self._step.scale(kinds[name], count)
                components.update(terms)
                weights.update(self.intermediate.weights())
        if distill:  # a student that distils into itself (hf_distill.students.early_exit) returns its own terms
            own = s_out.get("distill_losses") if isinstance(s_out, dict) else getattr(s_out, "distill_losses", None)
            for name, value in (own or {}).items():
                components[name], weights[name] = value, 1.0
        if not components:
            raise ValueError(
                "Nothing to compute a loss from: the batch has no labels and distillation is off for it. "
                "Set eval_with_teacher=True to evaluate the distillation loss on unlabeled data."
            )
        loss = sum(weights[k] * v for k, v in components.items())
        if model.training:
            self.tracker.add(components)
        if return_outputs:
            outputs = s_out if isinstance(s_out, dict) else {"logits": heads_mod._logits(s_out)}
            loss_only = {"distill_losses"}  # a self-distilling student's terms are not predictions
            if taps is not None and "output_hidden_states" in taps.forward_kwargs():
                loss_only.add("hidden_states")  # asked for the loss only: never for predictions or compute_metrics
            outputs = {k: v for k, v in outputs.items() if k not in loss_only}
            return loss, outputs
        return loss

    def _task_loss(self, out: Any, inputs: dict[str, Any], head: Head, num_items_in_batch, step_mean: bool):
        """The student's task loss, computed as `Trainer.compute_loss` would: `compute_loss_func`, else the
        label smoother, else the model's own loss (cross-entropy/MSE/BCE for a plain module)."""
        if self.compute_loss_func is not None and "labels" in inputs:
            value = self.compute_loss_func(out, inputs["labels"], num_items_in_batch=num_items_in_batch).float()
            if step_mean:
                # The Trainer takes this value as normalised over the whole step already (it neither divides it
                # by the accumulation steps nor lets DDP average it); undo both of ours to match.
                tokens_across = self.args.average_tokens_across_devices and num_items_in_batch is not None
                value = value * self._step.micro_batches * (self.accelerator.num_processes if tokens_across else 1)
            return value
        if self.label_smoother is not None and "labels" in inputs:
            return self.label_smoother(out, inputs["labels"], shift_labels=head is Head.CAUSAL_LM).float()
        labels = inputs.get(self._token_labels)
        loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
        if loss is not None:
            return loss.float()
        if labels is None:
            raise ValueError(
                f"The student returned no loss and the batch has no `labels` (label_names={self.label_names}): "
                "give a model that computes its loss from those labels, or set task_weight=0."
            )
        logits = heads_mod._logits(out).float()
        if head is Head.REGRESSION:
            return F.mse_loss(logits.squeeze(-1), labels.float())
        if head is Head.MULTI_LABEL:
            return F.binary_cross_entropy_with_logits(logits, labels.float())
        if head is Head.CAUSAL_LM:
            logits, labels = logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)

    def _chunked_terms(self, s_out, t_logits, t_hidden, inputs: dict[str, Any], want_task: bool, chunk: int):
        """KD and the student's cross-entropy of a causal LM from hidden states, through the loss head
        (hf_distill.losses.chunked): local means, differentiable like any other term. Under DeepSpeed or FSDP the LM heads
        are called as modules (the engines gather their parameters inside that call)."""
        labels = inputs.get(self._token_labels)
        kd_fn = None
        if self.args.kd_weight > 0:
            kd_fn = chunked.dense_kd(self.args.kd_loss, self.args.temperature, self.args.effective_jsd_beta,
                                     self.args.resolved_skew_alpha)
        kd_mask = kd_positions(inputs.get("attention_mask"), labels, self.args.kd_token_mask, causal=True)
        s_logits_fn, t_logits_fn = self._logits_fns(self.model)
        if self._shared_vocab is not None and t_hidden is not None and 0 not in self._padding_checked:
            with torch.no_grad():  # the teacher's logits on the first batch's distilled tokens, a few rows at a time
                rows = t_hidden[:, :-1][kd_mask] if kd_mask is not None else t_hidden[:, :-1].flatten(0, 1)
                self._check_padding(0, (t_logits_fn(part) for part in rows.split(256)))
        teacher = t_logits_fn if t_hidden is not None else (t_logits[:, :-1] if t_logits is not None else None)
        ce_labels = labels[:, 1:] if want_task and labels is not None else None
        return chunked.chunked_kd_and_ce(chunked.last_hidden(s_out), s_logits_fn, teacher, t_hidden, kd_mask,
                                         ce_labels, kd_fn, chunk, self._shared_vocab, route=self._loss_head_route())

    def _loss_head_route(self) -> str:
        """DeepSpeed and FSDP gather the LM heads' parameters inside the heads' own calls: call them as modules."""
        return "module" if (self.is_deepspeed_enabled or self.is_fsdp_enabled) else "auto"

    def _teacher_outputs(self, inputs: dict[str, Any], cached: dict[str, torch.Tensor], hidden_only: bool = False):
        """Teacher logits (one per compared output, see hf_distill.features.heads), features and, with `hidden_only`
        (chunked causal LMs), the last hidden state instead of logits: from the batch's cached columns when
        possible, else a forward."""
        t_logits = cached.get(LOGITS_COLUMN)
        if t_logits is None and self.args.kd_loss != "mse" and TOPK_VALUES_COLUMN in cached:
            t_logits = (cached[TOPK_VALUES_COLUMN], cached[TOPK_INDICES_COLUMN])  # sparse: kl/soft_ce take it
        t_feats = self.intermediate.cached_features(cached) if self.intermediate is not None else None
        need_logits = self.args.kd_weight > 0 and t_logits is None
        need_features = self.intermediate is not None and t_feats is None
        if not (need_logits or need_features):  # everything cached (or nothing needed): no teacher forward
            return [t_logits], t_feats, None
        if self.teacher is None:
            raise ValueError(
                "This batch lacks cached teacher outputs the losses need (teacher_logits or top-k columns, "
                "teacher_hidden_<i>) and no teacher_model was given."
            )
        taps = self.intermediate.teacher_taps if need_features else None
        hidden_only = hidden_only and need_logits
        t_out, t_feats = self._run_teacher(self.teacher, inputs, taps, hidden_only=hidden_only)
        if hidden_only:
            return [None], t_feats, chunked.last_hidden(t_out)
        if t_logits is not None:
            return [t_logits], t_feats, None
        return (head_logits(t_out, self._head or Head.SEQUENCE) if self.args.kd_weight > 0 else [None]), t_feats, None

    def _run_teacher(
        self, teacher: nn.Module, inputs: dict[str, Any], taps=None, labels: bool = False, hidden_only: bool = False
    ):
        label_names = set(self.label_names or []) | {"labels"}
        t_kwargs = {k: v for k, v in inputs.items() if (labels or k not in label_names) and k in self._teacher_params}
        if hidden_only:
            t_kwargs = chunked.hidden_only_kwargs(t_kwargs)
        shared = self.shared_base and teacher is self.teacher
        # A teacher loaded with device_map or quantised stays where its loader put it (hf_distill.placement):
        # its inputs go to its first device, its outputs come back to the student's.
        device = teacher_input_device(teacher)
        if device is not None:
            student_device = next((v.device for v in t_kwargs.values() if isinstance(v, torch.Tensor)), device)
            t_kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in t_kwargs.items()}
        # Same autocast as the student (accelerate only wraps the model it prepared), no autograd: plain
        # no_grad, not inference_mode, so the losses may save teacher tensors for backward.
        with torch.no_grad(), self.accelerator.autocast(), contextlib.ExitStack() as stack:
            if shared:
                teacher = stack.enter_context(shared_base_teacher(teacher))
            outputs = forward(teacher, t_kwargs, taps)
        return outputs if device is None else send_teacher_outputs(outputs, student_device)

    def _extra_teacher_views(self, i: int, inputs: dict[str, Any], cached: dict[str, torch.Tensor]):
        """Logits of teacher i >= 1: its cached column `teacher_logits_<i>` if present, else a forward."""
        if f"{LOGITS_COLUMN}_{i}" in cached:
            return [cached[f"{LOGITS_COLUMN}_{i}"]]
        return head_logits(self._run_teacher(self.teachers[i], inputs)[0], self._head or Head.SEQUENCE)

    def _kd_loss(self, head: Head, s_views: list, t_views: list[list], inputs: dict[str, Any]) -> torch.Tensor:
        """Logit distillation of each compared output (the mean of start and end for QA), from one or several
        teachers; token-level logits are shifted for causal LMs and averaged over `kd_token_mask` positions."""
        values = []
        for i, s in enumerate(s_views):
            teachers = [views[i] for views in t_views]
            mask = None
            if s.dim() == 3:
                if head is Head.CAUSAL_LM:
                    s, teachers = s[:, :-1], [_shift(t) for t in teachers]
                labels = inputs.get(self._token_labels)
                causal = head is Head.CAUSAL_LM
                if head is Head.SEQ2SEQ_LM:  # the decoder's positions, not the encoder's attention mask
                    mask = seq2seq_kd_positions(inputs, self._token_labels, self.args.kd_token_mask)
                else:
                    mask = kd_positions(inputs.get("attention_mask"), labels, self.args.kd_token_mask, causal)
            elif head is Head.QUESTION_ANSWERING and inputs.get("attention_mask") is not None:
                # Span logits are distributions over positions: padding is no candidate answer, for either model.
                real = inputs["attention_mask"] != 0
                s = s.float().masked_fill(~real, _NO_POSITION)
                teachers = [t.float().masked_fill(~real, _NO_POSITION) for t in teachers]
            if s.dim() == 3 and self._shared_vocab is not None:  # padded vocabularies: the ids both models know
                v = self._shared_vocab
                for j, t in enumerate(teachers):
                    if not isinstance(t, tuple):
                        self._check_padding(j, [t[mask.bool()] if mask is not None else t.flatten(0, -2)])
                s, teachers = s[..., :v], [t if isinstance(t, tuple) else t[..., :v] for t in teachers]
            values.append(self._combine_teachers(head, s, teachers, mask))
        return sum(values) / len(values)

    def _combine_teachers(self, head: Head, s: torch.Tensor, t_logits: list, mask) -> torch.Tensor:
        """Several teachers are combined as `multi_teacher` says: `probs` distils the weighted average of their
        softened distributions (one KD term against a mixture, as TextBrewer's multi-teacher averages);
        `losses` sums one KD term per teacher, weighted."""
        args, T = self.args, self.args.temperature
        if len(t_logits) == 1:
            return self._logit_loss(head, s, t_logits[0], mask)
        if args.multi_teacher == "losses":
            return sum(
                w * self._logit_loss(head, s, t, mask) for w, t in zip(self.teacher_weights, t_logits, strict=True)
            )
        if any(isinstance(t, tuple) for t in t_logits):
            raise ValueError("multi_teacher='probs' needs dense teacher logits; cached top-k logits cannot be mixed.")
        if head is Head.MULTI_LABEL:  # a mixture of per-label Bernoullis, as logits at temperature T
            p = sum(w * (t.float() / T).sigmoid() for w, t in zip(self.teacher_weights, t_logits, strict=True))
            p = p.clamp(1e-7, 1 - 1e-7)
            return self._logit_loss(head, s, T * (p.log() - (-p).log1p()), mask)
        mixture = sum(w * (t.float() / T).softmax(-1) for w, t in zip(self.teacher_weights, t_logits, strict=True))
        # T * log(p) has softmax(. / T) == p, so the mixture goes through the usual loss unchanged.
        return self._logit_loss(head, s, T * mixture.clamp_min(1e-30).log(), mask)

    def _logit_loss(self, head: Head, s: torch.Tensor, t, mask) -> torch.Tensor:
        kind, T = self.args.kd_loss, self.args.temperature
        if head is Head.MULTI_LABEL and kind != "mse":
            fn = losses.binary_kl_div if kind == "kl" else losses.binary_soft_cross_entropy
            return fn(s, t, T)
        return losses.logit_kd_loss(kind, s, t, T, mask=mask, beta=self.args.effective_jsd_beta,
                                    alpha=self.args.resolved_skew_alpha)

    # ------------------------------------------------------------------ logging

    def train(self, *args: Any, **kwargs: Any):
        # Components of compute_loss calls made before training (by hand, in train mode) are not the run's.
        self.tracker.reset()
        try:
            with self._projections_attached():
                return super().train(*args, **kwargs)
        finally:  # a stage that froze modules hands them back even when training stops on an exception
            for callback in self.callback_handler.callbacks:
                if callable(getattr(callback, "restore_trainable", None)):
                    callback.restore_trainable(self.model)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.tracker:
            for name, value in self.tracker.pop_means(self.accelerator).items():
                logs[f"loss_{name}"] = value
        if "loss" in logs:
            # Callbacks cannot add to the history themselves (on_log gets a copy): schedules and stages
            # (hf_distill.callbacks) report the values they set through `distill_log_values()`.
            for callback in self.callback_handler.callbacks:
                if callable(getattr(callback, "distill_log_values", None)):
                    logs.update(callback.distill_log_values())
        super().log(logs, start_time)

    # ------------------------------------------------------------------ optimizer and checkpoints

    def _projections(self) -> nn.Module | None:
        return self.intermediate.projections if self.intermediate is not None else None

    def _projections_in_engine(self) -> bool:
        """DeepSpeed owns the gradients, clipping and optimizer state of what it prepares (partitioned under
        ZeRO), so the projections are prepared with the student as one of its submodules. DDP keeps them
        beside the model and averages their gradients itself: a DDP module must give every parameter a
        gradient in each backward (or find unused ones from its forward outputs), which projections used only
        by the loss, or idle in a stage without hidden terms, would break."""
        from accelerate.utils import DistributedType

        return self._projections() is not None and self.accelerator.distributed_type == DistributedType.DEEPSPEED

    @contextlib.contextmanager
    def _projections_attached(self):
        """While train() runs under DeepSpeed, the projections are a submodule of the student, so the engine
        prepares, partitions, reduces, clips and checkpoints them with it; afterwards the student is bare again
        (`trainer.model.save_pretrained` writes the student only)."""
        if not self._projections_in_engine() or PROJECTIONS_ATTR in self.model._modules:
            yield
            return
        proj, engine = self._projections(), getattr(self, "deepspeed", None)
        if engine is not None and not all(p in getattr(engine, "param_names", {}) for p in proj.parameters()):
            raise RuntimeError(
                "A DeepSpeed engine was built for this trainer before train() (by evaluate() or predict()), without "
                "the projections, and the Trainer would train with that engine: the projections would be neither "
                "partitioned nor optimised. Call train() before evaluating, or evaluate with a separate trainer."
            )
        student = self.model  # detach from this one even if the Trainer swaps self.model meanwhile
        student.add_module(PROJECTIONS_ATTR, proj)
        try:
            yield
        finally:
            student._modules.pop(PROJECTIONS_ATTR, None)
            self.model._modules.pop(PROJECTIONS_ATTR, None)  # the student model_init built (call_model_init)

    def _attached(self) -> bool:
        return PROJECTIONS_ATTR in getattr(self.model, "_modules", {})

    def _check_projection_optimizer(self) -> None:
        """Projections are created with the trainer, so an optimizer and scheduler built by the user before it
        cannot know them: the optimizer gets them as a new group, but a scheduler built earlier would leave that
        group's learning rate unscheduled, so that case is refused. Engines that own the gradients of the model
        they prepared: DeepSpeed gets them inside the student (`_projections_attached`); FSDP is refused, since
        sharded projections used outside the student's forward have not been run under it anywhere."""
        proj = self._projections()
        if proj is None:
            return
        from accelerate.utils import DistributedType

        widths = (
            f"Projections (student width {self.intermediate.student_info.hidden_size} -> teacher width "
            f"{self.intermediate.teacher_info.hidden_size})"
        )
        if self.accelerator.distributed_type == DistributedType.FSDP:
            raise ValueError(
                f"{widths} are not supported under FSDP yet: they are used by the loss, outside the student's "
                "forward, where FSDP has resharded its parameters. Use DeepSpeed or DDP, or give the student the "
                "teacher's hidden size so that no projection is needed."
            )
        if self._projections_in_engine():
            ds_config = self.accelerator.state.deepspeed_plugin.deepspeed_config
            if "optimizer" in ds_config and self.args.projection_lr is not None:
                raise ValueError(
                    f"projection_lr={self.args.projection_lr} cannot be honoured: the DeepSpeed config builds its "
                    "own optimizer (its 'optimizer' section), with one learning rate for the student and the "
                    f"{widths.lower()}. Remove projection_lr, or remove the config's 'optimizer' section so that "
                    "the Trainer builds the optimizer (then projection_lr applies)."
                )
        if self.optimizer is not None and self.lr_scheduler is not None:
            in_optimizer = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
            if not all(id(p) in in_optimizer for p in proj.parameters()):
                raise ValueError(
                    "optimizers=(optimizer, scheduler) was given, but the trainer also trains projections from the "
                    "student's width to the teacher's, which that scheduler cannot schedule. Pass "
                    "optimizers=(optimizer, None) (the trainer adds the projections to your optimizer and builds "
                    "the scheduler over every group), or use optimizer_cls_and_kwargs."
                )

    def create_optimizer(self, model=None):
        """The Trainer's optimizer, plus the projections in their own groups: learning rate `projection_lr`,
        weight decay on their weights only (never on biases, as the Trainer does for the model)."""
        optimizer = super().create_optimizer(model)
        proj = self._projections()
        if proj is not None and self._attached():
            # Under DeepSpeed the Trainer saw them as the student's: take them out of its groups, add ours below.
            ids = {id(p) for p in proj.parameters()}
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in ids]
            optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
        in_optimizer = {id(p) for g in getattr(optimizer, "param_groups", ()) for p in g["params"]}  # DummyOptim: none
        if proj is not None and not any(id(p) in in_optimizer for p in proj.parameters()):
            decay = set(self.get_decay_parameter_names(proj))
            lr = self.args.projection_lr or self.args.learning_rate
            for names, wd in ((decay, self.args.weight_decay), (None, 0.0)):
                params = [p for n, p in proj.named_parameters() if (n in decay) == (names is not None)]
                if params:
                    optimizer.add_param_group({"params": params, "lr": lr, "weight_decay": wd})
        return optimizer

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        proj = self._projections()
        n = self.accelerator.num_processes
        if proj is not None and not self._attached() and n > 1 and self.accelerator.sync_gradients:
            # DDP averages the student's gradients in the last micro-batch's backward; the projections live
            # outside the wrapped model, so they are averaged here, before clipping and the optimizer step.
            for p in proj.parameters():
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad)
                    p.grad /= n
        return loss

    def _clip_grad_norm(self, model):
        """Clip the student and the projections together (TinyBERT clips `fit_dense` with the model)."""
        proj = self._projections()
        if proj is None or self._attached():  # attached: already among the model's parameters
            return super()._clip_grad_norm(model)
        params = [*model.parameters(), *proj.parameters()]
        return self.accelerator.clip_grad_norm_(params, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        """The logged `grad_norm` counts the projections too."""
        proj = self._projections()
        if grad_norm is None and proj is not None and not self._attached():
            grad_norm = self.accelerator.clip_grad_norm_([*model.parameters(), *proj.parameters()], float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The student's files never hold the projections, also when DeepSpeed gathered them with it."""
        if self._attached() and (state_dict is not None or self.args.should_save):
            if state_dict is None:
                state_dict = self.model.state_dict()
            state_dict = {k: v for k, v in state_dict.items() if not k.startswith(PROJECTIONS_ATTR + ".")}
        super()._save(output_dir, state_dict=state_dict)

    def _projection_file_state(self) -> dict | None:
        """What `distill_projections.pt` gets, gathered from ZeRO-3 partitions (a collective: every rank calls
        it); None when no file is written. Attached to the student (DeepSpeed), the engine's own checkpoint
        holds them, unless `save_only_model` keeps the Trainer from writing that checkpoint."""
        proj = self._projections()
        if proj is None or (self._attached() and not self.args.save_only_model):
            return None
        params = list(proj.parameters())
        gather = contextlib.nullcontext()
        if any(hasattr(p, "ds_id") for p in params):
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(params)
        with gather:
            return {k: v.detach().clone().cpu() for k, v in proj.state_dict().items()}

    def _save_checkpoint(self, model, trial) -> None:
        # Gathered before the Trainer's save, which may push the folder (see _push_from_checkpoint).
        self._pending_projections = self._projection_file_state()
        try:
            super()._save_checkpoint(model, trial)
            if self._pending_projections is not None and self.args.should_save:
                folder = os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
                torch.save(self._pending_projections, os.path.join(folder, PROJECTIONS_FILE))
        finally:
            self._pending_projections = None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        proj = self.intermediate.projections if self.intermediate else None
        path = os.path.join(resume_from_checkpoint, PROJECTIONS_FILE)
        if proj is not None:
            engine_files = any(n.startswith("global_step") for n in os.listdir(resume_from_checkpoint))
            if not os.path.isfile(path) and engine_files:
                raise FileNotFoundError(
                    f"{resume_from_checkpoint} was written under DeepSpeed: its projections are in the engine's "
                    "global_step*/ files, which only DeepSpeed reads. Resume it with the same DeepSpeed config."
                )
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{resume_from_checkpoint} has no {PROJECTIONS_FILE}: it was not written by a run with the "
                    "same projections, so resuming would restart them from scratch."
                )
            proj.load_state_dict(torch.load(path, map_location=self.args.device, weights_only=True))

    # ------------------------------------------------------------------ the teacher's own evaluation

    def evaluate_teacher(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "teacher",
    ) -> dict[str, float]:
        """The first teacher's metrics, computed by the Trainer's evaluation loop exactly as `evaluate()` computes
        the student's (same data, `compute_metrics`, gathering across processes): call it on every process.

        A shared PEFT base is evaluated with its adapters off. The metrics (without the prefix) are kept in
        `self.teacher_metrics`, which the model card reports next to the student's; they are logged too."""
        if self.teacher is None:
            raise ValueError("evaluate_teacher needs a teacher: this trainer was given no teacher_model.")
        if metric_key_prefix == "eval":
            raise ValueError(
                "metric_key_prefix='eval' would log the teacher's metrics as the student's (eval_*). Keep the "
                "default 'teacher' or choose another prefix."
            )
        override = eval_dataset is not None
        dataset = eval_dataset if override else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate_teacher needs an evaluation set: pass eval_dataset= or give the trainer one.")
        parts = dataset.items() if isinstance(dataset, dict) else [(None, dataset)]
        metrics: dict[str, float] = {}
        for name, data in parts:
            prefix = metric_key_prefix if name is None else f"{metric_key_prefix}_{name}"
            metrics.update(self._evaluate_teacher_on(data if override or name is None else name, ignore_keys, prefix))
        self.log(metrics)
        start = len(metric_key_prefix) + 1
        found = {
            k[start:]: float(v)
            for k, v in metrics.items()
            if k.startswith(f"{metric_key_prefix}_") and isinstance(v, int | float)
        }
        self.teacher_metrics.update(found)
        return metrics

    def _evaluate_teacher_on(self, dataset: Any, ignore_keys: list[str] | None, prefix: str) -> dict[str, float]:
        """One evaluation loop whose prediction step runs the teacher instead of the student."""
        import math
        import time

        from transformers.trainer_utils import speed_metrics

        dataloader = self.get_eval_dataloader(dataset)
        start = time.time()
        self.prediction_step = self._teacher_prediction_step  # the loop calls self.prediction_step
        try:
            output = self.evaluation_loop(
                dataloader,
                description="Teacher evaluation",
                prediction_loss_only=True if self.compute_metrics is None else None,
                ignore_keys=ignore_keys,
                metric_key_prefix=prefix,
            )
        finally:
            del self.prediction_step
        steps = math.ceil(output.num_samples / (self.args.eval_batch_size * self.args.world_size))
        output.metrics.update(speed_metrics(prefix, start, num_samples=output.num_samples, num_steps=steps))
        return output.metrics

    def _teacher_prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """`prediction_step` with the teacher as the model (`model`, the student, is not run)."""
        from transformers.trainer_pt_utils import nested_detach

        inputs = self._prepare_inputs({k: v for k, v in inputs.items() if not k.startswith(TEACHER_PREFIX)})
        names = self.label_names
        has_labels = bool(names) and all(inputs.get(k) is not None for k in names)
        labels = nested_detach(tuple(inputs[k] for k in names)) if has_labels else None
        labels = labels[0] if labels is not None and len(labels) == 1 else labels
        out, _ = self._run_teacher(self.teacher, inputs, labels=has_labels)  # its own loss, as for the student
        logits = heads_mod._logits(out)
        loss = None
        if has_labels:
            own = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
            if own is None and len(names) == 1:
                own = _plain_task_loss(logits, labels)
            loss = own.detach().mean() if own is not None else None
        if prediction_loss_only:
            return loss, None, None
        if ignore_keys is None:
            config = getattr(unwrap(self.teacher), "config", None)
            ignore_keys = getattr(config, "keys_to_ignore_at_inference", ["cache"]) if config is not None else []
        if isinstance(out, dict):
            kept = tuple(v for k, v in out.items() if k not in [*ignore_keys, "loss"])
            logits = kept[0] if len(kept) == 1 else kept
        return loss, nested_detach(logits), labels

    # ------------------------------------------------------------------ publishing (hf_distill.publish.card, hf_distill.publish.hub)

    def create_model_card(
        self,
        language: str | None = None,
        license: str | None = None,
        tags: str | list[str] | None = None,
        model_name: str | None = None,
        finetuned_from: str | None = None,
        tasks: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None,
        dataset: str | list[str] | None = None,
        dataset_args: str | list[str] | None = None,
        **report_fields: Any,
    ) -> None:
        """Write the distillation card (teacher, method, losses, size, metrics kept) into `output_dir`, so every
        Trainer flow that writes a card writes this one. It runs no model: the teacher's metrics are those of
        the last `evaluate_teacher()`, and the speed-up is measured only with `measure_speed=True`. The teacher is
        this trainer's; `finetuned_from` (transformers' example scripts pass `model_name_or_path`) is the student's
        starting checkpoint, shown as such. Extra keywords are `DistillationReport` fields (e.g. `stages`,
        `augmentation`, `teacher` to name a folder-loaded teacher by its Hub id) or `measure_speed`."""
        if not self.is_world_process_zero():
            return
        from .publish.card import write_trainer_card

        write_trainer_card(self, language=language, license=license, tags=tags, model_name=model_name,
                           finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags,
                           dataset=dataset, dataset_args=dataset_args, **report_fields)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Save-time pushes (`push_to_hub=True`) send the student files, not all of `output_dir`.

        The Trainer pushes from inside `_save_checkpoint`, before ours adds the projections: they are written
        here first, or the pushed checkpoint (`hub_strategy` checkpoint/all_checkpoints) could not be resumed."""
        from .publish.hub import push_checkpoint

        state = getattr(self, "_pending_projections", None)
        if state is not None and self.args.should_save:
            torch.save(state, os.path.join(checkpoint_folder, PROJECTIONS_FILE))
        push_checkpoint(self, checkpoint_folder)

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs: Any,
    ):
        """Publish the student alone: its weights, config, tokenizer and card (never the teacher,
        projections, optimizer state, checkpoints or training_args.bin). Returns the commit URL, or a
        Future when `blocking=False`; `kwargs` go to `create_model_card`. Raises `hub.HubPushError`."""
        from .publish.hub import push_trainer

        return push_trainer(self, commit_message=commit_message, blocking=blocking, token=token,
                            revision=revision, private=private, **kwargs)


@dataclasses.dataclass
class _StudentState:
    """What compute_loss reads from one student model (`DistillationTrainer._student_state`)."""

    inner: nn.Module  # unwrapped: no compile, DDP/engine or PEFT wrapper
    params: set[str]  # the inputs its forward names
    head: Head | None = None
    rebuilds: bool | None = None  # its logits are rebuilt exactly from its hidden states (checked on first use)
    logits_fns: tuple | None = None  # hidden -> logits of it and of the teacher (chunked causal-LM loss)

    def __post_init__(self) -> None:
        self.head = static_head(self.inner)

    def accepts(self, name: str) -> bool:
        return name in self.params or "**" in self.params


class _ClearProjectionGradients(TrainerCallback):
    """The Trainer zeroes only the model's gradients after a step; the projections' are cleared here."""

    def __init__(self, projections: nn.Module) -> None:
        self.projections = projections

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.projections.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------- helpers


def _unsharded(model: nn.Module):
    """FSDP1 keeps a wrapped model's parameters sharded outside its own forward: gather them for a forward of the
    inner module (the logits check). DeepSpeed ZeRO-3 and FSDP2 gather in hooks on the modules themselves."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return contextlib.nullcontext()
    if isinstance(model, FullyShardedDataParallel):
        return FullyShardedDataParallel.summon_full_params(model, writeback=False)
    return contextlib.nullcontext()


def _teacher_weights(weights: list[float] | None, n: int) -> list[float]:
    """Normalised teacher weights (equal by default)."""
    if weights is None:
        return [1.0 / n] * n if n else []
    if len(weights) != n:
        raise ValueError(f"teacher_weights has {len(weights)} values for {n} teachers; give one weight per teacher.")
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"teacher_weights must sum to a positive number, got {weights}.")
    return [w / total for w in weights]


def _per_teacher(value: Any, n: int) -> list[Any]:
    """`teacher_processing_class` as one entry per teacher."""
    if not isinstance(value, list | tuple):
        return [value] * n
    if len(value) != n:
        raise ValueError(
            f"teacher_processing_class has {len(value)} entries for {n} teachers; give one per teacher (None allowed)."
        )
    return list(value)


def _forward_params(model: nn.Module | None) -> set[str]:
    """The inputs a forward names. transformers forwards also take **kwargs (attention backend options),
    so they only get what they name; a plain module whose forward takes **kwargs gets everything."""
    if model is None:
        return set()
    inner = unwrap(model)
    params = inspect.signature(inner.forward).parameters
    names = set(params)
    if not isinstance(inner, PreTrainedModel) and any(p.kind == p.VAR_KEYWORD for p in params.values()):
        names.add("**")
    return names


def _shape(model: nn.Module) -> tuple[str, int | None, int | None]:
    """The facts the trainer's checks read from the student: its class (hence head), vocabulary and label count."""
    inner = unwrap(model)
    return type(inner).__name__, getattr(getattr(inner, "config", None), "vocab_size", None), _num_labels(inner)


def _describe(shape: tuple[str, int | None, int | None]) -> str:
    name, vocab, labels = shape
    return f"{name}, vocabulary {vocab}, {labels} labels"


def _zero_like_graph(out: Any) -> torch.Tensor:
    """A zero that keeps the loss connected to the student's graph."""
    value = heads_mod._logits(out) if not isinstance(out, dict) or "logits" in out else None
    return value.float().sum() * 0 if value is not None else torch.zeros(())


def _plain_task_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, MSE (one output, float labels) or BCE (multi-hot float labels) for a model without a loss."""
    logits = logits.float()
    if logits.shape[-1] == 1 and labels.is_floating_point():
        return F.mse_loss(logits.squeeze(-1), labels.float())
    if labels.is_floating_point() and labels.shape == logits.shape:
        return F.binary_cross_entropy_with_logits(logits, labels.float())
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def _shift(t):
    """Causal-LM teacher logits (dense or top-k) without their last position, aligned with the student's."""
    return tuple(x[:, :-1] for x in t) if isinstance(t, tuple) else t[:, :-1]


def _num_labels(model: nn.Module) -> int | None:
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    if config is not None and hasattr(config, "num_labels") and _is_classifier(inner):
        return config.num_labels
    return getattr(inner, "num_labels", None) if config is None else None


def _is_classifier(model: nn.Module) -> bool:
    name = type(model).__name__
    return name.endswith("ForSequenceClassification") or name.endswith("ForTokenClassification")

