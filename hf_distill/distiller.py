"""`Distiller`: the distillation of a student by its teacher(s), apart from any training loop.

It owns the teachers (loaded, validated against the student, frozen and placed), the intermediate-layer terms,
the heads and the loss. It keeps nothing of the student but what the arguments were validated against: the model
it computes a loss for is the one it is given at each call (`compute_loss(model, inputs)`), because the Trainer swaps
(`model_init`), wraps (DDP, DeepSpeed, FSDP) and compiles (`torch_compile`) the student after it was built.

It is composed of: the teacher side (hf_distill.teacher_sources: cached columns or the teacher models, one typed
result per batch), the KD paths (hf_distill.kd_paths: whole logits, the causal-LM loss head, the sparse signal head,
cross-tokenizer; one chosen per model), the task loss (hf_distill.task_loss) and the intermediate terms
(hf_distill.losses.intermediate).

`DistillationTrainer` (or any Trainer class with `DistillationMixin`) builds one and calls it from its own
`compute_loss`; a plain PyTorch or accelerate loop builds one itself:

    distiller = Distiller(student, args, teacher_model=teacher)
    optimizer = torch.optim.AdamW([*student.parameters(), *distiller.parameters()], lr=args.learning_rate)
    for batch in loader:
        distiller.compute_loss(student, batch).backward()
        optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from transformers.utils import find_labels, logging

from . import routed_signal, routing
from .arguments import DistillationArguments
from .data.cache import cached_teacher_info
from .data.collators import TEACHER_PREFIX
from .data.image_inputs import TeacherImages
from .data.teacher_columns import check_teacher_columns
from .data.teacher_signal import check_teacher_signal
from .features import heads as heads_mod
from .features.families_audio import frame_mask
from .features.heads import (
    TOKEN_LEVEL,
    Head,
    check_kd_loss,
    runtime_head,
    static_head,
    with_decoder_inputs,
)
from .features.taps import forward, unwrap
from .kd_paths import KDPath, KDPaths, PathBatch, PathContext
from .kd_paths.distillation_token import has_distillation_token
from .losses import cross_tokenizer
from .losses.intermediate import IntermediateDistiller
from .losses.normalise import COUNT_KINDS, StepCounts, batch_counts, decoder_positions
from .model_inputs import StudentState, check_same_kind, forward_params, student_shape
from .on_policy import PROMPT_KEYS, OnPolicy, check_on_policy, check_step
from .placement import place_teacher, teacher_input_device
from .serving.client import is_teacher_url
from .serving.source import served_teachers
from .settings import DistillSettings
from .task_loss import TaskLoss
from .teacher import (
    check_cross_tokenizer,
    load_teacher,
    per_teacher,
    shares_parameters,
    switches_adapters_off,
    teacher_weights,
    validate_pair,
)
from .teacher_sources import CachedColumns, LocalTeachers, TeacherSide
from .tracking import ComponentTracker

logger = logging.get_logger(__name__)


class Distiller:
    """Teachers, terms, heads and the loss of one distillation.

    Args:
        student: the student as it is when the run is set up (validated against the teachers and arguments; the
            loss itself runs on the model each call is given).
        args: `DistillationArguments`, validated once; the loss reads the run's `settings` built from them
            (hf_distill.settings: what schedules and stages change while training).
        teacher_model: as `DistillationTrainer`'s: a model, a folder or Hub id, a list of them, the student itself
            (a PEFT model: self-distillation with adapters off), a URL (hf_distill.serving), a dict of named teachers
            (models, folders, URLs or offline signals from `load_teacher_signal`; each row distilled from the one its
            `teacher_id` column names, hf_distill.routing and hf_distill.routed_signal), or None when the rows carry
            cached teacher outputs.
        processing_class: the student's tokenizer, to compare vocabularies.
        teacher_processing_class: the teacher's tokenizer (or one per teacher).
        train_dataset: checked for cached teacher columns (and read for the cached teacher's shape when no
            teacher is given).
        label_names: the batch keys holding labels (default: the Trainer's rule, the student's forward signature).
        accelerator: the Trainer's accelerate `Accelerator` (autocast, processes, teacher placement); None in a
            plain loop: the teacher goes to the student's device and no autocast is added.
        label_smoother: the Trainer's, which changes how the task loss is computed.
        compute_loss_func: the Trainer's, likewise.
        route: how the causal-LM loss head calls the LM heads: "module" under DeepSpeed/FSDP, else "auto".
    """

    def __init__(
        self,
        student: nn.Module,
        args: DistillationArguments,
        teacher_model: nn.Module | str | list[nn.Module | str] | dict[str, nn.Module | str] | None = None,
        *,
        processing_class: Any = None,
        teacher_processing_class: Any = None,
        train_dataset: Any = None,
        label_names: list[str] | None = None,
        accelerator: Any = None,
        label_smoother: Any = None,
        compute_loss_func: Any = None,
        route: str = "auto",
    ) -> None:
        if not isinstance(args, DistillationArguments):
            raise TypeError(f"Distiller needs DistillationArguments, got {type(args).__name__}.")
        self.args, self.accelerator = args, accelerator
        self.label_smoother, self.compute_loss_func = label_smoother, compute_loss_func
        self.processing_class = processing_class  # the student's tokenizer (a teacher signal's vocabulary check)
        if label_names is None:
            label_names = args.label_names if args.label_names is not None else find_labels(type(unwrap(student)))
        self.label_names = list(label_names)
        # Named teachers (a dict): each row goes to the one its `teacher_id` column names (hf_distill.routing)
        named = routing.named_teachers(teacher_model)
        routing.check_routing(list(named) if named is not None else None, args, train_dataset)
        signal_at = routed_signal.signal_teachers(named)  # offline signals named in it, by place
        teacher_model = list(named.values()) if named is not None else teacher_model
        routed = named is not None and len(named) > 1  # each teacher is a single-teacher run on its own rows
        if routed and route == "module":
            raise ValueError("teacher_model names several teachers routed per row, under FSDP/DeepSpeed: each "
                             "process's student would run once per teacher in its batch, so processes would make "
                             "different numbers of sharded forwards (a hang). Train under DDP, or with one teacher.")
        teachers = teacher_model if isinstance(teacher_model, list | tuple) else [teacher_model]
        teachers = [t for t in teachers if t is not None]
        if named is None and any(routed_signal.is_signal(t) for t in teachers):
            raise ValueError("teacher_model holds an offline teacher signal outside a dict: join it with its rows "
                             "(train_dataset=attach_teacher_signal(rows, signal), teacher_model=None), or name it "
                             "in a dict routed by a teacher_id column (teacher_model={name: signal, ...}).")
        # Teachers behind a URL (hf_distill.serving), by their place among all teachers; the rest are local models
        served_at = {i: t for i, t in enumerate(teachers) if is_teacher_url(t)}
        teachers = [t for i, t in enumerate(teachers) if i not in served_at and i not in signal_at]
        # a dict of one signal is the plain signal path: no teacher model
        n_teachers = len(teachers) + len(served_at) + (len(signal_at) if routed else 0)
        sources = [str(t) if isinstance(t, str | os.PathLike) else None for t in teachers]  # their tokenizers too
        # What the loss reads at each call and what callbacks change while training (hf_distill.settings)
        self.settings = DistillSettings.for_student(args, static_head(student), 1 if routed else n_teachers)
        for signal in signal_at.values():  # the plain signal path's refusals, and every routed row found in it
            signal.check_run(temperature=self.settings.temperature, kd_token_mask=self.settings.kd_token_mask,
                             tokenizer=processing_class, causal=static_head(student) is Head.CAUSAL_LM,
                             kd_loss=self.settings.kd_loss, kd_weight=self.settings.kd_weight)
            signal.check_rows(train_dataset, "train")
        # Each server checked (reachable, vocabulary, k, temperature) before any local teacher loads
        self.served = served_teachers(served_at, args, self.settings, causal=static_head(student) is Head.CAUSAL_LM,
                                      n_teachers=1 if routed else n_teachers, tokenizer=processing_class,
                                      train_dataset=train_dataset,
                                      vocab_size=getattr(getattr(unwrap(student), "config", None), "vocab_size", None))
        teachers = [load_teacher(str(t), like=student) if isinstance(t, str | os.PathLike) else t for t in teachers]
        t_tokenizers = per_teacher(teacher_processing_class, len(teachers))
        check_on_policy(args, causal=static_head(student) is Head.CAUSAL_LM, n_teachers=n_teachers,
                        accelerator=accelerator, train_dataset=train_dataset)
        # lmbda / seq_kd: who completes each micro-batch's prompts, and the generation (hf_distill.on_policy)
        self.on_policy = OnPolicy(args, unwrap(student), processing_class) if args.generates else None
        self.teacher_weights = teacher_weights(args.teacher_weights, 1 if routed else n_teachers)
        # Self-distillation on one PEFT base: the "teacher" is the student with its adapters off. It must not
        # be frozen or put in eval mode for good (that would freeze or un-dropout the student too).
        self.shared_base = bool(teachers) and shares_parameters(teachers[0], student)
        if any(shares_parameters(t, student) for t in teachers[1:]):
            raise ValueError("Only the first teacher may share its parameters with the student (self-distillation).")
        if self.shared_base and not switches_adapters_off(teachers[0]):
            raise ValueError(  # no adapters to switch off: the teacher would be the student being trained
                f"teacher_model ({type(unwrap(teachers[0])).__name__}) shares parameters with the student but is not a "
                "PEFT model whose adapters can be switched off, so the teacher would be (part of) the student being "
                "trained and KD would compare it with itself. Pass a separate teacher (e.g. copy.deepcopy of it, made "
                "before get_peft_model changes a base in place), or a PEFT student as its own teacher."
            )
        # Frozen, eval mode, and replicated or sharded as the accelerator's mode requires (hf_distill.placement).
        self.teachers = [
            t if (i == 0 and self.shared_base) else self._place(t, student) for i, t in enumerate(teachers)
        ]
        self.teacher = self.teachers[0] if self.teachers else None
        if args.distillation_token is not None and not has_distillation_token(unwrap(student)):
            raise ValueError(f"distillation_token={args.distillation_token!r} applies to a student with DeiT's class "
                             "and distillation heads (students.from_teacher(..., distillation_token=True)); this "
                             f"student ({type(unwrap(student)).__name__}) has none: leave distillation_token unset.")
        # An image student: the pixel_values its teacher reads (issue #43, hf_distill.data.image_inputs)
        self.images = TeacherImages.for_run(unwrap(student), processing_class,
                                            t_tokenizers[0] if t_tokenizers else None,
                                            sources[0] if sources else None, n_teachers=len(teachers))
        self.intermediate: IntermediateDistiller | None = None
        if self.settings.terms:
            # Without a teacher, its shape (layers, width) comes from the hidden states cached in the dataset.
            source = self.teacher if self.teacher is not None else cached_teacher_info(train_dataset)
            if source is None:
                raise ValueError(
                    "distill_terms need teacher features, so teacher_model must be given "
                    "(or a train dataset with cached teacher hidden states from hf_distill.cache)."
                )
            self.intermediate = IntermediateDistiller(self.settings.terms, student, source, args.projection,
                                                      seed=args.seed)
            if self.intermediate.projections is not None:
                self.intermediate.projections.to(_device(student, accelerator))
        if args.projection_lr is not None and self.projections is None:
            raise ValueError(
                f"projection_lr={args.projection_lr} does nothing: this run trains no projection (no "
                "distill_terms, or the terms compare features of equal width). Remove projection_lr."
            )
        shared_vocab = [
            validate_pair(student, t, args, tokenizer=processing_class, teacher_tokenizer=tok, source=src)
            for t, tok, src in zip(self.teachers, t_tokenizers, sources, strict=True)
        ]
        vocabs, shared_vocab = shared_vocab, min((v for v in shared_vocab if v is not None), default=None)
        # cross_tokenizer="aligned": the (student ids, teacher ids) of the tokens both vocabularies hold
        cross_vocab = check_cross_tokenizer(args.cross_tokenizer, student, self.teachers, self.shared_base,
                                            processing_class, t_tokenizers, sources)
        if n_teachers > 1 and not routed and args.kd_weight > 0 and args.kd_loss == "mse" and \
                args.multi_teacher != "losses":
            raise ValueError(
                "multi_teacher='probs' averages probability distributions, which kd_loss='mse' does not use. "
                "Use multi_teacher='losses' (a weighted sum of one MSE per teacher) or kd_loss='kl'/'soft_ce'."
            )
        # What the arguments were validated against; the loss resolves the model it is given (`_student_state`).
        self._head = static_head(student)
        self._causal = self._head is Head.CAUSAL_LM
        self._student_shape = student_shape(student)
        self._student_cache: StudentState | None = None
        self._step = StepCounts()
        if args.kd_weight > 0:
            check_kd_loss(self._head, args.kd_loss)
            for t in self.teachers:
                check_kd_loss(static_head(t), args.kd_loss, "the teacher")
        # The parts: the task loss, the teacher side (cached columns first, else the teacher models), the KD paths.
        self.task = TaskLoss(self.settings, self.label_names, args.label_names is not None, label_smoother,
                             compute_loss_func, self._step, self._processes, args.average_tokens_across_devices)
        self._token_labels = self.task.label_name
        self.teacher_side = TeacherSide(
            CachedColumns(self.settings, self._token_labels, self.intermediate),
            LocalTeachers(self.teachers, self.shared_base, self.label_names, self._head, accelerator),
            self.settings, self.intermediate, self.served)
        for source in self.served.values():
            source.label_name = self._token_labels
        self.router: routing.Router | None = None
        self.last_kd: torch.Tensor | None = None  # the last batch's KD term before its step share (routing logs it)
        if routed:  # per teacher, the teacher side and KD paths a single-teacher Distiller of it would build
            sides, paths, local = [], [], 0
            for place in range(len(named)):
                own = place in self.served or place in signal_at  # no model of its own
                models = [] if own else [self.teachers[local]]
                side = TeacherSide(CachedColumns(self.settings, self._token_labels, None),
                                   LocalTeachers(models, False, self.label_names, self._head, accelerator),
                                   self.settings, None, {0: self.served[place]} if place in self.served else {})
                sides.append(side)
                paths.append(KDPaths(PathContext(args, self.settings, self._head, side, self.teacher_weights,
                                                 self.task, None if own else vocabs[local],
                                                 None, accelerator, route), student))
                local += not own
            self.router = routing.Router(self, list(named), sides, paths, signal_at)
            self.teacher_side, self.paths = sides[0], paths[0]
        else:
            self.paths = KDPaths(PathContext(args, self.settings, self._head, self.teacher_side,
                                             self.teacher_weights, self.task, shared_vocab, cross_vocab, accelerator,
                                             route), student)
            if named is not None:  # a dict of one: the single-teacher path; the column is only checked and counted
                self.router = routing.Router(self, list(named), [self.teacher_side], [self.paths], signal_at)
        self.tracker = ComponentTracker()
        # cross_tokenizer: the share of the student's distilled positions paired with the teacher's, per log window
        self.pairing = (cross_tokenizer.PairedShare(args.cross_tokenizer, self._token_labels,
                                                    self.settings.kd_token_mask) if args.cross_tokenizer else None)
        # Called after each loss with (model, student outputs, inputs, from_hidden): the outputs hold the last hidden
        # states instead of logits when the causal-LM loss head ran (hf_distill.trl logs SFT's token metrics from it).
        self.student_hook: Callable[[nn.Module, Any, dict[str, Any], bool], None] | None = None
        self.check_dataset(train_dataset)

    @property
    def route(self) -> str:
        """How the causal-LM loss head calls the LM heads: "module" under DeepSpeed/FSDP (the trainer sets it), else
        "auto"."""
        return self.paths.context.route

    @route.setter
    def route(self, value: str) -> None:
        for paths in self.router.paths if self.router is not None else [self.paths]:
            paths.context.route = value

    @property
    def teacher_params(self) -> set[str]:
        """The inputs the (first) teacher's forward names."""
        return self.teacher_side.models.params

    def run_teacher(self, teacher: nn.Module, inputs: dict[str, Any], taps=None, labels: bool = False,
                    hidden_only: bool = False):
        """One teacher forward on the student's batch: only the inputs its forward names, without gradients, under
        the student's autocast, on the teacher's devices; returns (outputs, features)."""
        return self.teacher_side.models.run(teacher, inputs, taps, labels=labels, hidden_only=hidden_only)

    # ------------------------------------------------------------------ set-up

    def _place(self, teacher: nn.Module, student: nn.Module) -> nn.Module:
        if self.accelerator is not None:
            return place_teacher(teacher, self.accelerator)
        teacher.requires_grad_(False).eval()
        return teacher if teacher_input_device(teacher) is not None else teacher.to(_device(student, None))

    def check_dataset(self, dataset: Any, which: str = "train") -> None:
        """Refuse cached teacher columns the run cannot use (hf_distill.data.teacher_columns), and a `teacher_id`
        column that does not fit the named teachers (hf_distill.routing)."""
        routing.check_routing(self.router.names if self.router is not None else None, self.args, dataset, which)
        teacher = self.teacher if self.teacher is not None else next(iter(self.served.values()), None)
        if self.router is not None and self.router.signals:  # named signals: rows get their columns per batch
            self.router.check_signals(dataset, which)
            teacher = teacher if teacher is not None else next(iter(self.router.signals.values()))
        check_teacher_columns(dataset, which, head=self._head, teacher=teacher, kd_weight=self.settings.kd_weight,
                              kd_loss=self.settings.kd_loss, num_labels=self._student_shape[2],
                              intermediate=self.intermediate)
        check_teacher_signal(dataset, which, temperature=self.settings.temperature,
                             kd_token_mask=self.settings.kd_token_mask,
                             tokenizer=self.processing_class, causal=self._causal)

    @property
    def projections(self) -> nn.Module | None:
        """The trainable maps from the student's width to the teacher's (None when no term needs one)."""
        return self.intermediate.projections if self.intermediate is not None else None

    def parameters(self) -> Iterator[nn.Parameter]:
        """What the distillation trains besides the student (the projections): give them to the optimizer."""
        return iter(self.projections.parameters()) if self.projections is not None else iter(())

    # ------------------------------------------------------------------ the model it is given

    def _student_state(self, model: nn.Module) -> StudentState:
        """What the loss needs from the student it is given (head, forward arguments, LM head), resolved once per
        model. A model of another kind or shape than the one the arguments were validated against is refused."""
        inner = unwrap(model)
        if self._student_cache is not None and self._student_cache.inner is inner:
            return self._student_cache
        check_same_kind(inner, self._student_shape)
        if self.teachers and shares_parameters(self.teachers[0], inner) != self.shared_base:
            raise ValueError(
                "The model to train shares its parameters with the teacher differently from the model the trainer "
                "was built with (self-distillation on one PEFT base). With model_init, give a teacher that is not "
                "the student's own base, or pass model= instead of model_init."
            )
        if self.intermediate is not None:
            self.intermediate.bind_student(inner)
        self._student_cache = StudentState(inner, forward_params(inner))
        return self._student_cache

    # ------------------------------------------------------------------ the loss

    def start_step(self, batches: list[dict[str, Any]], model: nn.Module | None = None,
                   step: int | None = None) -> None:
        """Count one optimizer step's micro-batches, so token-level terms are means over the whole step, across
        processes (hf_distill.losses.normalise). Loops that accumulate gradients call it before the step's first
        micro-batch; without it each call is a mean over its own batch. With `lmbda` / `seq_kd` (then the student
        `model` is required), it first replaces the completions of the micro-batches the coin picks by generated
        ones (in place, hf_distill.on_policy), so that the counts are the generated rows'. `step`: the optimizer
        step's number (the coin's input; the Trainer passes `global_step`, so a resumed run draws the same)."""
        if self.on_policy is not None or self.args.generates:
            check_step(self.on_policy, self.args, model)
            self.on_policy.prepare(batches, model, step, teachers=self.teachers, shared_base=self.shared_base,
                                   accelerator=self.accelerator, label_name=self._token_labels,
                                   served=self.served.get(0))
        for place, source in self.served.items():  # every row of the step scored before any of it trains
            source.wait(self._routed(place, batches), step)
        counts = sum((self._counts(b) for b in batches), torch.zeros(len(COUNT_KINDS), dtype=torch.float64))
        processes = self._processes() if self.args.average_tokens_across_devices else 1
        if processes > 1:
            counts = self.accelerator.reduce(counts.to(self.args.device), "sum").cpu()
        self._step.start(counts, len(batches), processes)

    def prefetch(self, batches: list[dict[str, Any]], step: int | None = None) -> None:
        """Send the served teachers the rows of optimizer step `step` ahead of it (`teacher_prefetch`), except the
        micro-batches whose completions will be generated at that step (sent once generated, by `start_step`)."""
        if not self.served or not self.args.teacher_prefetch:
            return
        if self.on_policy is not None and step is not None:
            batches = [b for i, b in enumerate(batches) if self.on_policy.source(step, i) is None]
        for place, source in self.served.items():
            source.prefetch(self._routed(place, batches))

    def _routed(self, place: int, batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The rows of these micro-batches that teacher `place` is asked for: all of them, or its routed rows."""
        return self.router.batches_for(place, batches) if self.router is not None else batches

    def compute_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None,
    ):
        """The weighted sum of the task loss, logit KD and the intermediate terms for `model` on one batch, and with
        `return_outputs` the student's outputs (as `Trainer.compute_loss`). In training mode, or in evaluation with
        `eval_with_teacher`, the teacher runs; otherwise it is the student's task loss alone.

        Top to bottom: the batch, its KD path, the teacher's outputs, the student's forward, the path's loss, the
        intermediate terms, the weights."""
        if self.router is not None and not self.router.active:  # rows routed to named teachers (hf_distill.routing)
            return self.router.compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # The batch: cached teacher columns apart, the model as the Trainer prepared it (not the one it was built with)
        cached = {k: inputs.pop(k) for k in list(inputs) if k.startswith(TEACHER_PREFIX)}
        for key in PROMPT_KEYS:  # the prompts generation reads (hf_distill.data.prompts): never a model input
            inputs.pop(key, None)
        student = self._student_state(model)
        if self._head is Head.SEQ2SEQ_LM:  # teacher and student read the same decoder inputs
            inputs = with_decoder_inputs(model, inputs, self._token_labels)
        if isinstance(inputs.get("position_ids"), torch.Tensor) and "use_cache" not in inputs:
            # Packed (padding-free) rows: transformers keeps their sequences apart only without a KV cache.
            inputs = {**inputs, "use_cache": False}
        distill = model.training or self.args.eval_with_teacher
        if model.training:  # a loss field a user's code set on the arguments mid-run: taken over, with the checks
            self.settings.follow(self.args, running=True)
        step_mean = model.training and self._step.take()  # token-level means rescaled to the optimizer step's
        if model.training and not step_mean and self.on_policy is not None and self.args.generates:
            check_step(self.on_policy, self.args, None)  # no start_step: nothing generated this batch's completions
        local = self._counts({**inputs, **cached}) if step_mean else None
        if self.intermediate is not None:  # re-read every step, like kd_weight, so callbacks can change them
            self.intermediate.set_weights(self.settings.distill_terms)
        want_task, own_task = self.task.wanted(model, inputs, distill)
        # Its KD path, chosen once per model, form of the teacher's logits and pass (hf_distill.kd_paths)
        path = self.paths.choose(student, model, self.teacher_side.form(cached), model.training and distill)
        # Teacher first (its forward would evict the student's activations from the CPU caches, benchmarks/speed.py)
        teacher = None
        if distill:
            t_inputs = path.teacher_inputs(inputs, cached)
            if self.images is not None:  # its own pixel_values, or the student's re-normalised its way
                t_inputs = self.images.teacher_inputs(t_inputs, cached)
            teacher = self.teacher_side.outputs(t_inputs, cached, path.request)
        s_out, s_feats, head = self._student_forward(model, student, inputs, distill, path,
                                                     want_task and not own_task and path.whole_logits)
        kd, task = path.loss(PathBatch(model, student.inner, s_out, head, teacher, inputs, cached, want_task,
                                       lambda: self.task.loss(s_out, inputs, head, num_items_in_batch, step_mean),
                                       self._mean_scales(head, local)))
        self.last_kd = kd.detach() if kd is not None else None
        components: dict[str, torch.Tensor] = {}
        weights: dict[str, float] = {}
        if task is not None:
            components["task"], weights["task"] = self._scaled(task, "labels", head, local, s_out), (
                self.settings.task_weight if distill else 1.0)
        if kd is not None:
            components["kd"], weights["kd"] = self._scaled(kd, "kd", head, local, s_out), self.settings.kd_weight
        if distill and self.intermediate is not None:
            components.update(self._intermediate_terms(s_feats, teacher.features, inputs, local))
            weights.update(self.intermediate.weights())
        if distill:  # a student that distils into itself (hf_distill.students.early_exit) returns its own terms
            own = s_out.get("distill_losses") if isinstance(s_out, dict) else getattr(s_out, "distill_losses", None)
            for name, value in (own or {}).items():
                components[name], weights[name] = value, 1.0
        if not components:
            if distill:  # every weight is 0 now: a schedule or callback set them so (the arguments refuse it)
                terms = {f"term:{t.name}": t.weight for t in self.settings.terms}
                raise ValueError(
                    f"Every loss weight is 0 at this step (kd_weight={self.settings.kd_weight}, task_weight="
                    f"{self.settings.task_weight}{''.join(f', {k}={v}' for k, v in terms.items())}), so there is "
                    "nothing to train: a schedule or callback set them through the run's settings. Keep one weight "
                    "> 0 at every step (a warm-up can start from a small value instead of 0)."
                )
            raise ValueError(
                "Nothing to compute a loss from: the batch has no labels and distillation is off for it. "
                "Set eval_with_teacher=True to evaluate the distillation loss on unlabeled data."
            )
        loss = sum(weights[k] * v for k, v in components.items())
        if model.training:
            self.tracker.add(components)
            if self.pairing is not None and "kd" in components:
                self.pairing.add({**inputs, **cached})
        if self.student_hook is not None:
            self.student_hook(model, s_out, inputs, not path.whole_logits)
        return (loss, self._predictions(s_out, distill, student.inner)) if return_outputs else loss

    def _counts(self, inputs: dict[str, Any]) -> torch.Tensor:
        counts = batch_counts(inputs, self._token_labels, self.settings.kd_token_mask, self._causal,
                              self._head is Head.SEQ2SEQ_LM)
        if self.args.cross_tokenizer:  # the KD term counts the paired positions of the two tokenizations
            counts[COUNT_KINDS.index("kd")] = cross_tokenizer.count(
                self.args.cross_tokenizer, inputs, self._token_labels, self.settings.kd_token_mask)
        return counts

    def _student_forward(self, model, student: StudentState, inputs, distill: bool, path: KDPath,
                         with_labels: bool):
        kwargs = {k: v for k, v in inputs.items() if student.accepts(k) and (k not in self.label_names or with_labels)}
        kwargs = path.student_kwargs(kwargs)
        taps = self.intermediate.student_taps if (distill and self.intermediate) else None
        s_out, s_feats = forward(model, kwargs, taps)
        head = Head.CAUSAL_LM if not path.whole_logits else runtime_head(
            model, heads_mod._logits(s_out) if student.head is None else None, inputs.get(self._token_labels)
        )
        if distill and self.settings.kd_weight > 0:
            check_kd_loss(head, self.settings.kd_loss)
        return s_out, s_feats, head

    def _scaled(self, value: torch.Tensor, kind: str, head: Head, local, s_out) -> torch.Tensor:
        """A token-level term as its share of the optimizer step's mean (hf_distill.losses.normalise)."""
        if local is None or head not in TOKEN_LEVEL or (kind == "labels" and self.task.compute_loss_func):
            return value
        count = float(local[COUNT_KINDS.index(kind)])
        if kind == "labels" and count == 0:  # no counted label: adds nothing (a model's own mean over none is NaN)
            return _zero_like_graph(s_out)
        return value * self._step.scale(kind, count)

    def _mean_scales(self, head: Head, local) -> dict[str, float]:
        """The factors `_scaled` puts on the KD and task means (kd_head_mode="fused" forms its gradients for them)."""
        if local is None or head not in TOKEN_LEVEL:
            return {}
        return {kind: self._step.scale(kind, float(local[COUNT_KINDS.index(kind)])) for kind in ("kd", "labels")}

    def _intermediate_terms(self, s_feats, t_feats, inputs, local) -> dict[str, torch.Tensor]:
        decoder_mask = decoder_positions(inputs, self._token_labels) if self._head is Head.SEQ2SEQ_LM else None
        student = self._student_cache.inner if self._student_cache is not None else None
        mask = frame_mask(student, inputs.get("attention_mask"))  # a waveform's samples -> its frames
        terms = self.intermediate.losses(s_feats, t_feats, mask, decoder_mask)
        if local is not None:
            for name, kind in self.intermediate.count_kinds().items():
                if kind is not None and name in terms:
                    terms[name] = terms[name] * self._step.scale(kind, float(local[COUNT_KINDS.index(kind)]))
        return terms

    def _predictions(self, s_out, distill: bool, inner: nn.Module) -> dict[str, Any]:
        """The student's outputs for predictions and compute_metrics: never what was asked for the loss only (hidden
        states its config asks for itself are the user's, as without the teacher)."""
        outputs = s_out if isinstance(s_out, dict) else {"logits": heads_mod._logits(s_out)}
        loss_only = {"distill_losses"}  # a self-distilling student's terms are not predictions
        taps = self.intermediate.student_taps if (distill and self.intermediate) else None
        own = getattr(getattr(inner, "config", None), "output_hidden_states", False) is True
        if taps is not None and "output_hidden_states" in taps.forward_kwargs() and not own:
            loss_only.add("hidden_states")
        return {k: v for k, v in outputs.items() if k not in loss_only}

    def _processes(self) -> int:
        return self.accelerator.num_processes if self.accelerator is not None else 1


def _device(student: nn.Module, accelerator: Any) -> torch.device:
    if accelerator is not None:
        return accelerator.device
    return next((p.device for p in student.parameters()), torch.device("cpu"))


def _zero_like_graph(out: Any) -> torch.Tensor:
    """A zero that keeps the loss connected to the student's graph."""
    value = heads_mod._logits(out) if not isinstance(out, dict) or "logits" in out else None
    return value.float().sum() * 0 if value is not None else torch.zeros(())


__all__ = ["Distiller"]
