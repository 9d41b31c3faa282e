"""`DistillationTrainer`: a `transformers.Trainer` whose loss also learns from a teacher.

The distillation itself (teachers, terms, heads, the loss) is a `Distiller` (hf_distill.distiller). What is here
is Trainer glue, as `DistillationMixin`, so that any Trainer class can distil: `DistillationTrainer` is
`DistillationMixin + Trainer`, `DistillationSeq2SeqTrainer` is `DistillationMixin + Seq2SeqTrainer`, and
`class MySFT(DistillationMixin, SFTTrainer)` works the same way. The glue: build the Distiller once the Trainer
has its model, accelerator and datasets; delegate `compute_loss`; count each optimizer step's tokens
(`get_batch_samples`); log the loss components; keep teacher columns through column filtering; train the
projections (hf_distill.trainer_projections); evaluate the teacher; write the distillation card and push only the
student. Everything else is the Trainer's own. Each private Trainer method overridden here is listed, with why, in
docs/design.md, and `tests/test_trainer_overrides.py` fails when transformers renames one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, Trainer
from transformers.trainer_callback import CallbackHandler
from transformers.utils import logging

from . import trainer_runs as runs
from .argument_checks import check_fp16_device, check_length_grouping, check_liger_kernel
from .arguments import DistillationArguments, as_distillation_arguments
from .base.log_level import follow_log_level
from .compat import add_signature_columns, children_dict, signature_columns
from .compat import num_items_in_batch as count_items
from .data.audio import check_audio_inputs
from .data.collators import TEACHER_PREFIX, KeepTeacherColumnsCollator, TeacherOutputsCollator
from .data.cross_tokenizer import check_first_rows
from .data.image_inputs import TeacherImages
from .data.prompts import check_generation_data
from .distiller import Distiller
from .features import heads as heads_mod
from .features.checkpointing import check_planned_checkpointing
from .features.taps import unwrap
from .kd_paths.distillation_token import has_distillation_token
from .placement import check_engine, check_fsdp2_wrap
from .routed_signal import is_signal
from .serving.client import is_teacher_url
from .trainer_projections import PROJECTIONS_ATTR, PROJECTIONS_FILE, ProjectionTraining, _ClearProjectionGradients
from .trainer_teacher_eval import TeacherEvaluation

logger = logging.get_logger(__name__)

__all__ = ["PROJECTIONS_ATTR", "PROJECTIONS_FILE", "DistillationMixin", "DistillationTrainer"]

# The private Trainer methods the mixin overrides (docs/design.md says why; a test checks each still exists).
PRIVATE_OVERRIDES = (
    "_set_signature_columns_if_needed",
    "_remove_unused_columns",
    "_get_collator_with_removed_columns",
    "_clip_grad_norm",
    "_get_grad_norm",
    "_save",
    "_save_checkpoint",
    "_load_from_checkpoint",
    "_load_best_model",
    "_push_from_checkpoint",
)
# The private Trainer methods hf_distill calls (not overrides) are called from hf_distill.compat only (PRIVATE_CALLS).


class DistillationMixin(TeacherEvaluation, ProjectionTraining):
    """Distillation for a `Trainer` class: `class DistillationTrainer(DistillationMixin, Trainer)`.

    Args:
        model: the student (any `nn.Module` whose forward returns logits, or a transformers model).
        args: `DistillationArguments` (for another Trainer class, a dataclass deriving from both, e.g.
            `@dataclass class Args(DistillationArguments, SFTConfig)`).
        teacher_model: the teacher, or a local path / Hub id to load with the student's auto class, or a
            list of them (multi-teacher logit distillation, see `teacher_weights` and `multi_teacher`;
            intermediate terms use the first). It may be the student itself when the student is a PEFT
            model: the teacher is then the shared base with adapters off (self-distillation). May be `None`
            when every training row carries cached teacher outputs (hf_distill.data.cache). A dict names several
            teachers (models, paths, URLs, offline signals from `load_teacher_signal`), each row distilled from the
            one its `teacher_id` column names (hf_distill.routing, hf_distill.routed_signal).
        teacher_processing_class: the teacher's tokenizer (or a list, one per teacher; None entries allowed), so that
            its vocabulary can be compared with the student's (`processing_class`). Not needed for a teacher given
            as a folder or Hub id (its saved tokenizer is read) or one whose `name_or_path` holds a tokenizer; where
            the teacher's tokenizer cannot be found a warning says that the vocabularies were not compared.

    All other arguments are the Trainer class's.
    """

    # compute_loss returns a per-micro-batch value whose token-level terms are already shares of the step mean
    # (hf_distill.losses.normalise) scaled up by the micro-batch count: let the Trainer divide by the GA steps.
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        model: PreTrainedModel | nn.Module | None = None,
        args: DistillationArguments | None = None,
        *trainer_args: Any,
        teacher_model: nn.Module | str | list[nn.Module | str] | dict[str, nn.Module | str] | None = None,
        teacher_processing_class: Any | list[Any] | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        args = self._distillation_arguments(args)
        check_fp16_device(args)  # fp16 on a CPU would train in float32
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        check_liger_kernel(self.args)  # after the Trainer class's own __init__ (TRL's SFTTrainer turns it off there)
        # hf_distill's loggers at the process log level the Trainer just gave transformers' (log_level="info")
        follow_log_level(args.log_level if args.should_log else args.log_level_replica, args.get_process_log_level())
        # The Distiller normalises its terms itself (token-level ones over the whole step, from the counts taken
        # in get_batch_samples: hf_distill.losses.normalise), so the Trainer must scale the loss as it scales a plain
        # micro-batch mean: divide it by the accumulation steps and let DDP average (docs/guides/trainer.md, "Notes
        # on correctness"). With loss kwargs transformers 5 would pass num_items_in_batch to BERT-like models, skip
        # that division and rescale the loss by the number of processes.
        self.model_accepts_loss_kwargs = False
        self.teacher_metrics: dict[str, float] = {}  # set by evaluate_teacher(), reported by the model card
        self._pending_projections: dict | None = None  # gathered in _save_checkpoint for the save and its push
        check_engine(self.args, self.accelerator)  # an FSDP/DeepSpeed request accelerate ignored (CPU): refused
        check_fsdp2_wrap(self.model, self.accelerator)  # an FSDP2 wrap accelerate would crash on: refused
        # lmbda / seq_kd: the first rows and the models' positions, before the teacher loads (issue #39); another
        # head is refused by the Distiller, with the message that says so
        if self.args.generates and heads_mod.static_head(self.model) is heads_mod.Head.CAUSAL_LM:
            teachers = teacher_model if isinstance(teacher_model, list | tuple) else [teacher_model]
            teachers = list(teacher_model.values()) if isinstance(teacher_model, dict) else teachers  # named
            check_generation_data(self.args, self._prompt_collator(), self.train_dataset, self.model,
                                  [t for t in teachers if t is not None and not is_teacher_url(t) and not is_signal(t)])
        if self.args.label_names is None and not self.label_names and has_distillation_token(unwrap(self.model)):
            self.label_names = ["labels"]  # DeiT's two heads take no labels: the class head's task loss reads them
        # an image teacher that needs its own processing of the raw images: refused before it loads (issue #43)
        many = isinstance(teacher_model, list | tuple)
        t_proc = teacher_processing_class
        TeacherImages.for_run(unwrap(self.model), self.processing_class,
                              t_proc[0] if isinstance(t_proc, list | tuple) and t_proc else t_proc,
                              teacher_model[0] if many and teacher_model else teacher_model, self.data_collator,
                              len(teacher_model) if many else 1)
        # cross_tokenizer's chat rows: read before the Distiller loads a teacher given by path
        check_first_rows(self.data_collator, self.train_dataset, self.eval_dataset)
        check_length_grouping(self.args, self.train_dataset, self.processing_class)  # text rows have no length
        # audio: the teacher's own input_values need the raw clips at the student's rate (hf_distill.data.audio)
        check_audio_inputs(self.data_collator, self.processing_class, teacher_processing_class, self.train_dataset,
                           self.eval_dataset, teacher_model=teacher_model)
        self.distiller = Distiller(
            self.model, self.args, teacher_model, processing_class=self.processing_class,
            teacher_processing_class=teacher_processing_class, train_dataset=self.train_dataset,
            label_names=self.label_names or [], accelerator=self.accelerator, label_smoother=self.label_smoother,
            compute_loss_func=self.compute_loss_func, route=self._loss_head_route(),
        )
        if self.distiller.intermediate is not None:  # taps inside reentrant-checkpointed blocks: no gradient
            taps = self.distiller.intermediate.student_taps
            check_planned_checkpointing(self.args, unwrap(self.model), taps.modules())
        # Every callback event gets the run's loss settings (schedules and stages change the loss through them)
        self.callback_handler = _SettingsCallbackHandler(self.callback_handler, self.distiller.settings,
                                                         self._start_run)
        if self._projections() is not None and not self._projections_in_engine():
            self.add_callback(_ClearProjectionGradients(self._projections()))
        self._check_projection_optimizer()
        self.data_collator = TeacherOutputsCollator(self.data_collator)
        if self.args.eval_with_teacher and self.eval_dataset is not None:
            evals = self.eval_dataset if isinstance(self.eval_dataset, dict) else {"eval": self.eval_dataset}
            for name, data in evals.items():
                self.distiller.check_dataset(data, f"evaluation ({name})")

    def _distillation_arguments(self, args: Any) -> DistillationArguments:
        """The arguments as DistillationArguments (plain TrainingArguments are upgraded, every field kept)."""
        return as_distillation_arguments(args, type(self).__name__)

    def _prompt_collator(self) -> Any:
        """The collator the training rows will go through, as the set-up checks of generation read it."""
        return getattr(self.data_collator, "base", self.data_collator)

    # What the distiller owns, readable from the trainer as before.
    teacher = property(lambda self: self.distiller.teacher, doc="The first teacher (None with cached outputs only).")
    teachers = property(lambda self: self.distiller.teachers, doc="Every teacher, frozen and placed.")
    teacher_weights = property(lambda self: self.distiller.teacher_weights, doc="Normalised teacher weights.")
    shared_base = property(lambda self: self.distiller.shared_base, doc="The teacher is the student's PEFT base.")
    intermediate = property(lambda self: self.distiller.intermediate, doc="The intermediate-layer terms, or None.")
    tracker = property(lambda self: self.distiller.tracker, doc="The loss components since the last log.")
    settings = property(lambda self: self.distiller.settings,
                        doc="The run's loss settings (hf_distill.settings): what schedules and stages change.")

    # ------------------------------------------------------------------ the loss

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        """The distillation loss of `model` (the student as the Trainer prepared it) on one batch (Distiller)."""
        self.distiller.route = self._loss_head_route()
        return self.distiller.compute_loss(model, inputs, return_outputs=return_outputs,
                                           num_items_in_batch=num_items_in_batch)

    def _loss_head_route(self) -> str:
        """DeepSpeed gathers the LM heads' parameters inside the heads' own calls: call them as modules. (Under FSDP2
        and ZeRO-3 the loss head takes the heads' weights whole once per step and reads them directly,
        hf_distill.kd_paths.engine_heads; under FSDP1 the causal-LM logits are computed whole; "module" keeps any
        other use safe.)"""
        return "module" if (self.is_deepspeed_enabled or self.is_fsdp_enabled) else "auto"

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The Trainer's prefetch of one optimizer step's micro-batches: the distiller counts their tokens, so that
        token-level terms are means over the whole step (hf_distill.losses.normalise)."""
        ahead = self.distiller.served and self.args.teacher_prefetch
        kept = getattr(self, "_served_ahead", None)  # the step read ahead for a served teacher (teacher_prefetch)
        self._served_ahead = None
        if ahead and kept is not None and kept[0] is epoch_iterator:
            batch_samples = kept[1]
            num_items_in_batch = count_items(self, batch_samples, device)
        else:
            batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        # lmbda / seq_kd: generated first (on_policy); the step number draws the coin, so a resumed run draws the same
        self.distiller.start_step(batch_samples, model=self.model, step=self.state.global_step)
        if self.distiller.on_policy is not None and num_items_in_batch is not None:  # counted on the new labels
            num_items_in_batch = count_items(self, batch_samples, device)
        if ahead:  # the next step's rows go to the server while this step computes
            following, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
            if following:
                self._served_ahead = (epoch_iterator, following)
                self.distiller.prefetch(following, step=self.state.global_step + 1)
        return batch_samples, num_items_in_batch

    def call_model_init(self, trial=None) -> nn.Module:
        """The Trainer's `model_init` call (in `__init__`, and in `train()` for every run and hyperparameter-search
        trial). A new student starts a new run: the projections restart from `seed` too, and under DeepSpeed they
        ride in the new student (`_projections_attached`)."""
        model = super().call_model_init(trial)
        proj = self._projections()
        if proj is not None:
            self.distiller.intermediate.reset_projections()
            if self._attached():
                children_dict(self.model).pop(PROJECTIONS_ATTR)
                model.add_module(PROJECTIONS_ATTR, proj)
        return model

    def _start_run(self) -> None:
        """At each start of the training loop (`on_train_begin`: every `train()`, and every retry of
        `auto_find_batch_size` after an out-of-memory error), forget the components, paired shares and routed rows of
        compute_loss calls that are not this run's (made by hand, or by the failed try)."""
        self.distiller.tracker.reset()
        if self.distiller.pairing is not None:
            self.distiller.pairing.reset()
        if self.distiller.router is not None:  # rows routed per teacher: this training's
            self.distiller.router.reset()

    def train(self, *args: Any, **kwargs: Any):
        # a checkpoint written with save_only_model would resume with a new optimizer and its schedule from step 0
        runs.check_resumable(self, args[0] if args else kwargs.get("resume_from_checkpoint"))
        runs.check_best_metric(self)  # an eval_loss whose weights a schedule changes cannot pick the best checkpoint
        try:
            with self._projections_attached():
                return super().train(*args, **kwargs)
        finally:  # a stage that froze modules hands them back even when training stops on an exception
            self._served_ahead = None  # requests of a step read ahead are not waited for (issue #42)
            for source in self.distiller.served.values():
                source.cancel()
            for callback in self.callback_handler.callbacks:
                if callable(getattr(callback, "restore_trainable", None)):
                    callback.restore_trainable(self.model)

    def hyperparameter_search(self, hp_space: Any = None, compute_objective: Any = None, *args: Any, **kwargs: Any):
        """The Trainer's, refusing its default objective where that is the distillation loss (trainer_runs)."""
        runs.check_search_objective(self, compute_objective)
        return super().hyperparameter_search(hp_space, compute_objective, *args, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.distiller.tracker:
            for name, value in self.distiller.tracker.pop_means(self.accelerator).items():
                logs[f"loss_{name}"] = value
        if "loss" in logs and self.distiller.router is not None:  # teachers routed per row: loss_kd/<name>
            logs.update(self.distiller.router.log_values(self.accelerator))
        if "loss" in logs and self.distiller.pairing is not None:  # cross_tokenizer: xtok_paired_share
            logs.update(self.distiller.pairing.log_values(self.accelerator))
        if "loss" in logs and self.distiller.on_policy is not None:  # generated_tokens(_per_second)
            logs.update(self.distiller.on_policy.log_values(self.accelerator))
        if "loss" in logs:
            # Callbacks cannot add to the history themselves (on_log gets a copy): schedules and stages
            # (hf_distill.callbacks) report the values they set through `distill_log_values()`.
            for callback in self.callback_handler.callbacks:
                if callable(getattr(callback, "distill_log_values", None)):
                    logs.update(callback.distill_log_values())
        super().log(logs, start_time)

    # ------------------------------------------------------------------ data: teacher columns survive filtering

    def _set_signature_columns_if_needed(self) -> None:
        if signature_columns(self) is None:
            super()._set_signature_columns_if_needed()
            # The teacher may need inputs the student ignores (a BERT teacher's token_type_ids for a
            # DistilBERT student); cached teacher outputs are columns too.
            extra = {p for p in self.distiller.teacher_params if p not in ("labels", "kwargs", "args")}
            extra.add(f"{TEACHER_PREFIX}logits")
            # the text columns a collator tokenises itself (hf_distill.data.prompts.PromptCompletionCollator)
            extra.update(getattr(getattr(self.data_collator, "base", self.data_collator), "dataset_columns", ()))
            if self.args.train_sampling_strategy in ("group_by_length", "batch_rebalance"):  # rows of text: their
                extra.add(self.args.length_column_name)  # lengths come from this column (check_length_grouping)
            add_signature_columns(self, sorted(extra))

    def _remove_unused_columns(self, dataset, description: str | None = None):
        self._set_signature_columns_if_needed()
        cached = [c for c in getattr(dataset, "column_names", None) or [] if c.startswith(TEACHER_PREFIX)]
        add_signature_columns(self, cached)
        return super()._remove_unused_columns(dataset, description)

    def _get_collator_with_removed_columns(self, data_collator, description: str | None = None):
        """Datasets other than `datasets.Dataset` are filtered row by row in the collator: keep `teacher_*`."""
        if not self.args.remove_unused_columns:
            return data_collator
        self._set_signature_columns_if_needed()
        return KeepTeacherColumnsCollator(data_collator, signature_columns(self), description=description,
                                          model_name=type(self.model).__name__)

    # ------------------------------------------------------------------ the teacher's own evaluation

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None, **kwargs: Any):
        """The Trainer class's own, except inside `evaluate_teacher`, where the teacher predicts, and for a batch
        without labels under `eval_with_teacher`, whose distillation loss the Trainer's would not compute."""
        if self._evaluating_teacher:
            return self._teacher_prediction_step(inputs, prediction_loss_only, ignore_keys)
        return runs.student_prediction_step(self, super().prediction_step, model, inputs, prediction_loss_only,
                                            ignore_keys, **kwargs)

    # ------------------------------------------------------------------ publishing (hf_distill.publish)

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
                           finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags, dataset=dataset,
                           dataset_args=dataset_args, **{**runs.early_exit_card(self, tasks), **report_fields})

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


class DistillationTrainer(DistillationMixin, Trainer):
    """`Trainer` + a frozen teacher. Swap the class, keep everything else (arguments: `DistillationMixin`)."""


class _SettingsCallbackHandler(CallbackHandler):
    """The Trainer's callback handler, passing the run's loss settings to every event as `distill_settings` (as it
    passes `model` and `optimizer`): callbacks hold nothing of the trainer and may be rebuilt from saved state."""

    def __init__(self, handler: CallbackHandler, settings: Any, start_run: Callable[[], None]) -> None:
        self.__dict__.update(handler.__dict__)
        self.distill_settings = settings
        self.start_run = start_run

    def call_event(self, event, args, state, control, **kwargs):
        if event == "on_train_begin":  # arguments set since the trainer was built (a hyperparameter-search trial)
            self.distill_settings.follow(args)
            self.start_run()  # every start of the training loop, auto_find_batch_size's retries included
        return super().call_event(event, args, state, control, distill_settings=self.distill_settings, **kwargs)
