"""`DistillationTrainer`: a `transformers.Trainer` whose loss also learns from a teacher.

Only what distillation needs is overridden: the loss (`compute_loss`), the logging of its components
(`log`), the optimizer (projections join it), checkpoints (projections are saved and restored with
them) and column filtering (teacher columns survive it). Everything else is the Trainer's own, so
gradient accumulation, DDP, mixed precision, callbacks, checkpointing and `push_to_hub` behave as usual.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from . import losses
from .arguments import DistillationArguments
from .collators import TEACHER_PREFIX, TeacherOutputsCollator
from .intermediate import IntermediateDistiller
from .taps import unwrap
from .teacher import load_teacher, prepare_teacher, validate_pair
from .tracking import ComponentTracker

PROJECTIONS_FILE = "distill_projections.pt"


class DistillationTrainer(Trainer):
    """`Trainer` + a frozen teacher. Swap the class, keep everything else.

    Args:
        model: the student (any `nn.Module` whose forward returns logits, or a transformers model).
        args: a `DistillationArguments`.
        teacher_model: the teacher, or a local path / Hub id to load with the student's auto class.
            May be `None` when every training row carries precomputed `teacher_logits` and no
            intermediate term is configured.
        All other arguments are `Trainer`'s.
    """

    # compute_loss returns a per-micro-batch mean: let the Trainer divide it by the accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        model: PreTrainedModel | nn.Module | None = None,
        args: DistillationArguments | None = None,
        *trainer_args: Any,
        teacher_model: nn.Module | str | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        if args is None:
            args = DistillationArguments(output_dir="trainer_output")
        if not isinstance(args, DistillationArguments):
            raise TypeError(
                f"DistillationTrainer needs DistillationArguments, got {type(args).__name__}. "
                "Build DistillationArguments(...) with the same fields (it is a TrainingArguments subclass)."
            )
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        # transformers 5 would otherwise pass num_items_in_batch to BERT-like models and rescale the loss
        # by the number of processes; our loss is a plain per-batch mean (see ENVIRONMENT.md pitfall 1).
        self.model_accepts_loss_kwargs = False

        if isinstance(teacher_model, str | os.PathLike):
            teacher_model = load_teacher(str(teacher_model), like=self.model)
        self.teacher = prepare_teacher(teacher_model, self.args.device) if teacher_model is not None else None

        terms = self.args.terms
        self.intermediate: IntermediateDistiller | None = None
        if terms:
            if self.teacher is None:
                raise ValueError(
                    "distill_terms need teacher features, so teacher_model must be given "
                    "(cached teacher logits alone only serve kd_weight)."
                )
            self.intermediate = IntermediateDistiller(terms, self.model, self.teacher, self.args.projection)
            if self.intermediate.projections is not None:
                self.intermediate.projections.to(self.args.device)
                self.add_callback(_ProjectionGradients(self.intermediate.projections, self.accelerator))
        if self.teacher is not None:
            validate_pair(self.model, self.teacher, self.args)

        self._student_params = _forward_params(self.model)
        self._teacher_params = _forward_params(self.teacher) if self.teacher is not None else set()
        self.data_collator = TeacherOutputsCollator(self.data_collator)
        self.tracker = ComponentTracker()
        self._check_teacher_columns(self.train_dataset)

    def _student_accepts(self, name: str) -> bool:
        return name in self._student_params or "**" in self._student_params

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

    def _check_teacher_columns(self, dataset) -> None:
        names = getattr(dataset, "column_names", None) or []
        if f"{TEACHER_PREFIX}logits" in names and len(dataset) > 0:
            width = torch.as_tensor(dataset[0][f"{TEACHER_PREFIX}logits"]).shape[-1]
            num_labels = _num_labels(self.model)
            if num_labels is not None and width != num_labels:
                raise ValueError(
                    f"The train dataset's teacher_logits have width {width} but the student has {num_labels} "
                    "labels. Recompute the cached logits with a teacher of the same label set, or drop the column."
                )
        elif self.teacher is None and self.args.kd_weight > 0 and dataset is not None:
            raise ValueError(
                "kd_weight > 0 needs teacher logits: pass teacher_model, or add a `teacher_logits` column "
                "to the train dataset (see hf_distill.cache)."
            )

    # ------------------------------------------------------------------ loss

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        cached = {k: inputs.pop(k) for k in list(inputs) if k.startswith(TEACHER_PREFIX)}
        labels = inputs.get("labels")
        distill = model.training or self.args.eval_with_teacher
        mask = inputs.get("attention_mask")

        # The task loss is the student's own: in training when task_weight > 0, in evaluation always.
        want_task = labels is not None and (not distill or self.args.task_weight > 0)
        s_kwargs = {k: v for k, v in inputs.items() if self._student_accepts(k) and (k != "labels" or want_task)}
        taps = self.intermediate.student_taps if (distill and self.intermediate) else None
        if taps is not None:
            s_kwargs.update(taps.forward_kwargs())
            with taps.capture() as s_feats:
                s_out = model(**s_kwargs)
            taps.collect(s_feats, s_out)
        else:
            s_out = model(**s_kwargs)
        s_logits = _logits(s_out)

        components: dict[str, torch.Tensor] = {}
        weights: dict[str, float] = {}
        if want_task:
            components["task"] = _task_loss(s_out, s_logits, labels)
            weights["task"] = self.args.task_weight if distill else 1.0
        if distill:
            t_logits, t_feats = self._teacher_outputs(inputs, cached)
            if self.args.kd_weight > 0:
                kd_mask = self._kd_mask(s_logits, mask, labels)
                components["kd"] = losses.logit_kd_loss(
                    self.args.kd_loss, s_logits, t_logits, self.args.temperature, mask=kd_mask
                )
                weights["kd"] = self.args.kd_weight
            if self.intermediate is not None:
                components.update(self.intermediate.losses(s_feats, t_feats, mask))
                weights.update(self.intermediate.weights())
        if not components:
            raise ValueError(
                "Nothing to compute a loss from: the batch has no labels and distillation is off for it. "
                "Set eval_with_teacher=True to evaluate the distillation loss on unlabeled data."
            )
        loss = sum(weights[k] * v for k, v in components.items())
        if model.training:
            self.tracker.add(components)
        if return_outputs:
            outputs = s_out if isinstance(s_out, dict) else {"logits": s_logits}
            return loss, outputs
        return loss

    def _teacher_outputs(self, inputs: dict[str, Any], cached: dict[str, torch.Tensor]):
        """Teacher logits and features: from the batch's cached columns when possible, else a forward."""
        need_features = self.intermediate is not None
        t_logits = cached.get(f"{TEACHER_PREFIX}logits")
        if t_logits is not None and not need_features:
            return t_logits, None
        if self.teacher is None:
            raise ValueError("This batch has no teacher_logits and no teacher_model was given.")
        t_kwargs = {k: v for k, v in inputs.items() if k != "labels" and k in self._teacher_params}
        taps = self.intermediate.teacher_taps if need_features else None
        # Same autocast as the student (accelerate only wraps the model it prepared), no autograd: plain
        # no_grad, not inference_mode, so the losses may save teacher tensors for backward.
        with torch.no_grad(), self.accelerator.autocast():
            if taps is not None:
                t_kwargs.update(taps.forward_kwargs())
                with taps.capture() as t_feats:
                    t_out = self.teacher(**t_kwargs)
                taps.collect(t_feats, t_out)
            else:
                t_feats = None
                t_out = self.teacher(**t_kwargs)
        return (t_logits if t_logits is not None else _logits(t_out)), t_feats

    def _kd_mask(self, s_logits: torch.Tensor, mask, labels):
        if s_logits.dim() != 3:
            return None
        if self.args.kd_token_mask == "labels" and labels is not None:
            return labels != -100
        return mask

    # ------------------------------------------------------------------ logging

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.tracker:
            for name, value in self.tracker.pop_means(self.accelerator).items():
                logs[f"loss_{name}"] = value
        super().log(logs, start_time)

    # ------------------------------------------------------------------ optimizer and checkpoints

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        proj = self.intermediate.projections if self.intermediate else None
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if proj is not None and not any(id(p) in in_optimizer for p in proj.parameters()):
            optimizer.add_param_group(
                {
                    "params": list(proj.parameters()),
                    "lr": self.args.projection_lr or self.args.learning_rate,
                    "weight_decay": self.args.weight_decay,
                }
            )
        return optimizer

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        proj = self.intermediate.projections if self.intermediate else None
        if proj is not None and self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            torch.save(proj.state_dict(), os.path.join(folder, PROJECTIONS_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        proj = self.intermediate.projections if self.intermediate else None
        path = os.path.join(resume_from_checkpoint, PROJECTIONS_FILE)
        if proj is not None:
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{resume_from_checkpoint} has no {PROJECTIONS_FILE}: it was not written by a run with the "
                    "same projections, so resuming would restart them from scratch."
                )
            proj.load_state_dict(torch.load(path, map_location=self.args.device, weights_only=True))

    # ------------------------------------------------------------------ publishing (hf_distill.hub)

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
        """Write the distillation card (teacher, method, losses, size, speed-up, metrics kept) into
        `output_dir`, so every Trainer flow that writes a card writes this one. Extra keywords are
        `DistillationReport` fields (e.g. `stages`, `augmentation`) or `measure_speed`/`evaluate_teacher`."""
        if not self.is_world_process_zero():
            return
        from .hub import write_trainer_card

        write_trainer_card(self, language=language, license=license, tags=tags, model_name=model_name,
                           finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags,
                           dataset=dataset, dataset_args=dataset_args, **report_fields)

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
        from .hub import push_trainer

        return push_trainer(self, commit_message=commit_message, blocking=blocking, token=token,
                            revision=revision, private=private, **kwargs)


class _ProjectionGradients(TrainerCallback):
    """Projections live outside the DDP-wrapped student: average their gradients across processes
    before each optimizer step and clear them after it (the Trainer only zeroes the model's)."""

    def __init__(self, projections: nn.Module, accelerator) -> None:
        self.projections = projections
        self.accelerator = accelerator

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        n = self.accelerator.num_processes
        if n > 1:
            for p in self.projections.parameters():
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad)
                    p.grad /= n

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.projections.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------- helpers


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


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return out["logits"]
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, tuple | list):
        return out[0]
    raise TypeError(f"Cannot find logits in the model output of type {type(out).__name__}.")


def _task_loss(out: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The student's own loss when it computed one (transformers heads), else cross-entropy/MSE."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is not None:
        return loss.float()
    if logits.shape[-1] == 1 and labels.is_floating_point():
        return F.mse_loss(logits.float().squeeze(-1), labels.float())
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def _num_labels(model: nn.Module) -> int | None:
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    if config is not None and hasattr(config, "num_labels") and _is_classifier(inner):
        return config.num_labels
    return getattr(inner, "num_labels", None) if config is None else None


def _is_classifier(model: nn.Module) -> bool:
    name = type(model).__name__
    return name.endswith("ForSequenceClassification") or name.endswith("ForTokenClassification")

