"""What a distillation run's evaluation and resumption need beyond the Trainer's own, where the Trainer's would be
silently wrong.

* With `eval_with_teacher=True` a batch without labels still has a loss (the teacher's terms), but
  `Trainer.prediction_step` runs the model alone on it and reports none, so `eval_loss` went missing; without the
  teacher it hands the model the cached teacher columns the distillation keeps.
* A checkpoint written with `save_only_model=True` holds no optimizer, scheduler or RNG state; the Trainer resumes
  it anyway, with a new optimizer and its learning-rate schedule restarted from step 0 at the checkpoint's step.
* With `eval_with_teacher=True`, `eval_loss` is the distillation loss at the step's settings: a callback that
  changes them (a schedule, stages) makes evaluations incomparable, so it cannot choose the best checkpoint, nor
  (as `hyperparameter_search`'s default objective) rank trials that set other weights or temperatures.
* A batch split by teacher (hf_distill.routing) cannot put back in row order an output that is one per sub-batch (a
  KV cache): the Router leaves it out and names it, and the prediction step refuses it where it keeps it.
* An `EarlyExitModel` is no `PreTrainedModel`: the Trainer saved its bare state dict, which its `from_pretrained`
  refused; `save_model` and the checkpoints now write its own layout, and resuming reads it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .base.batch_keys import PROMPT_KEYS, TEACHER_PREFIX
from .compat import prepare_inputs


def runs_model_alone(trainer: Any, inputs: dict[str, Any]) -> bool:
    """Whether `Trainer.prediction_step` hands this batch to the model itself, not to `compute_loss`: it lacks the
    label keys, and the Trainer asks no loss of the model (`can_return_loss` without label names)."""
    names = trainer.label_names
    if names and all(inputs.get(k) is not None for k in names):
        return False
    return_loss = inputs.get("return_loss")
    return_loss = trainer.can_return_loss if return_loss is None else return_loss
    return bool(names) or not return_loss


def distils_unlabeled(trainer: Any, inputs: dict[str, Any], prediction_loss_only: bool) -> bool:
    """True for an evaluation batch the Trainer would run without a loss although `eval_with_teacher` gives it
    one. Generation (`predict_with_generate`) is left to the Seq2Seq trainer."""
    if not trainer.args.eval_with_teacher:
        return False
    if getattr(trainer.args, "predict_with_generate", False) and not prediction_loss_only:
        return False
    settings = trainer.distiller.settings
    if settings.kd_weight == 0 and not any(t.weight > 0 for t in settings.terms):
        return False  # the teacher adds nothing now (a stage of the task loss alone): no loss, as the Trainer's
    return runs_model_alone(trainer, inputs)


def student_batch(trainer: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """The batch without the keys only the loss reads (cached `teacher_*` columns, generation prompts) where the
    Trainer hands it to the student itself: a forward without `**kwargs` refuses them (a plain Trainer never had
    them, since only the distillation keeps those columns)."""
    if not runs_model_alone(trainer, inputs):
        return inputs
    return {k: v for k, v in inputs.items() if not k.startswith(TEACHER_PREFIX) and k not in PROMPT_KEYS}


def student_prediction_step(trainer: Any, step: Callable[..., Any], model: nn.Module, inputs: dict[str, Any],
                            prediction_loss_only: bool, ignore_keys: list[str] | None = None, **kwargs: Any):
    """The student's prediction step of a distillation trainer around its Trainer class's `step`: a batch without
    labels gets its distillation loss under `eval_with_teacher`, one the student runs alone loses the teacher-only
    keys, and a routed batch's outputs that are one per sub-batch are refused where kept."""
    router = trainer.distiller.router
    if router is not None:
        router.unmerged = {}  # none left from a compute_loss called outside this step
    if distils_unlabeled(trainer, inputs, prediction_loss_only):
        out = unlabeled_prediction_step(trainer, model, inputs, prediction_loss_only, ignore_keys)
    else:
        out = step(model, student_batch(trainer, inputs), prediction_loss_only, ignore_keys=ignore_keys, **kwargs)
    if router is not None and not prediction_loss_only:  # outputs the routed batch left out, kept here: refused
        router.refuse_unmerged(ignored_keys(trainer.model, ignore_keys))
    return out


def unlabeled_prediction_step(trainer: Any, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                              ignore_keys: list[str] | None = None):
    """`Trainer.prediction_step` for such a batch: the distillation loss of `compute_loss`, the student's outputs as
    predictions (read as the Trainer reads them), no labels."""
    from transformers.trainer_pt_utils import nested_detach

    inputs = prepare_inputs(trainer, inputs)
    with torch.no_grad(), trainer.compute_loss_context_manager():
        loss, outputs = trainer.compute_loss(model, inputs, return_outputs=True)
    loss = loss.detach().mean()
    if prediction_loss_only:
        return loss, None, None
    ignore_keys = ignored_keys(trainer.model, ignore_keys)
    if isinstance(outputs, dict):
        logits = tuple(v for k, v in outputs.items() if k not in [*ignore_keys, "loss"])
    else:
        logits = outputs[1:]
    logits = nested_detach(logits)
    return loss, logits[0] if len(logits) == 1 else logits, None


def ignored_keys(model: Any, ignore_keys: list[str] | None) -> list[str]:
    """The output keys `Trainer.prediction_step` leaves out of `model`'s predictions: those given, else its config's
    `keys_to_ignore_at_inference` (the Trainer's default, ["cache"], where the config names none)."""
    if ignore_keys is not None:
        return ignore_keys
    config = getattr(model, "config", None)
    return getattr(config, "keys_to_ignore_at_inference", ["cache"]) if config is not None else []


def check_resumable(trainer: Any, resume_from_checkpoint: str | bool | None) -> None:
    """Refuse to resume a checkpoint written with `save_only_model=True` (no optimizer state in it), before the
    Trainer loads it: it would continue at the checkpoint's step with a fresh optimizer and its schedule from 0."""
    from transformers.trainer_utils import get_last_checkpoint

    folder = resume_from_checkpoint
    if folder is True:
        folder = get_last_checkpoint(trainer.args.output_dir) if os.path.isdir(trainer.args.output_dir) else None
    if not isinstance(folder, str | os.PathLike) or not os.path.isdir(folder):
        return  # none given, or one the Trainer reports itself
    names = os.listdir(folder)
    # optimizer.pt / .bin, FSDP's optimizer_* folders, SageMaker's and XLA's per-rank files, DeepSpeed's global_step*
    if any("optimizer" in n or n.startswith("global_step") for n in names):
        return
    raise ValueError(
        f"resume_from_checkpoint={str(folder)!r} holds no optimizer state (it was written with save_only_model=True): "
        "the Trainer would resume it at its step with a new optimizer and the learning-rate schedule restarted from "
        "step 0. Resume from a checkpoint written without save_only_model, or start a new run from its weights (load "
        "the student from that folder and train without resume_from_checkpoint)."
    )


def check_best_metric(trainer: Any) -> None:
    """Refuse `metric_for_best_model` on an evaluation loss (set by `load_best_model_at_end` when not given) while
    that loss is the distillation loss (`eval_with_teacher`) and a callback changes its weights, temperature or terms
    during the run: each evaluation would weigh another loss, and the best checkpoint, early stopping and
    ReduceLROnPlateau would follow the schedule rather than the student."""
    args = trainer.args
    metric = args.metric_for_best_model
    if not args.eval_with_teacher or metric is None:
        return
    metric = metric if metric.startswith("eval_") else f"eval_{metric}"
    sets = trainer.eval_dataset if isinstance(trainer.eval_dataset, dict) else {}
    if metric != "eval_loss" and metric not in {f"eval_{name}_loss" for name in sets}:
        return
    changing = [type(c).__name__ for c in trainer.callback_handler.callbacks
                if callable(getattr(c, "distill_log_values", None))]  # ScheduleCallback, StageSwitchCallback
    if changing:
        raise ValueError(
            f"metric_for_best_model={args.metric_for_best_model!r} compares evaluation losses, but with "
            f"eval_with_teacher=True each is the distillation loss at that step's settings, which {changing[0]} "
            "changes during the run: the best checkpoint would follow the schedule, not the student. Set "
            "eval_with_teacher=False (eval_loss is then the student's task loss), or set metric_for_best_model to a "
            "metric of compute_metrics."
        )


def check_search_objective(trainer: Any, compute_objective: Any) -> None:
    """Refuse `hyperparameter_search`'s default objective when it is the distillation `eval_loss`: without
    `compute_metrics` it is `eval_loss`, which under `eval_with_teacher` each trial weighs by its own `kd_weight`,
    `task_weight` and `temperature`, so the search would favour the trial whose loss is scaled down."""
    if compute_objective is None and trainer.compute_metrics is None and trainer.args.eval_with_teacher:
        raise ValueError(
            "hyperparameter_search's default objective is eval_loss, which with eval_with_teacher=True is the "
            "distillation loss at each trial's kd_weight, task_weight and temperature: trials that set them "
            "differently are not compared on one scale. Pass compute_objective= (e.g. a compute_metrics metric), or "
            "set eval_with_teacher=False (eval_loss is then the student's task loss)."
        )


def early_exit_student(trainer: Any, model: Any = None) -> Any:
    """The trained `EarlyExitModel` (hf_distill.students.early_exit), or None for any other student. It is no
    `PreTrainedModel`: the Trainer alone would save its bare state dict, which `EarlyExitModel.from_pretrained`
    cannot read and `push_to_hub` cannot publish (no config.json)."""
    from .students.early_exit import EarlyExitModel

    model = trainer.accelerator.unwrap_model(model if model is not None else trainer.model, keep_torch_compile=False)
    return model if isinstance(model, EarlyExitModel) else None


def early_exit_card(trainer: Any, tasks: Any) -> dict[str, Any]:
    """The card fields `EarlyExitModel.push_to_hub` writes (`EarlyExitModel.card_fields`, less the task where
    `tasks` names one), for the card of an early-exit student pushed by the Trainer; {} for any other student."""
    model = early_exit_student(trainer)
    if model is None:
        return {}
    fields = model.card_fields()
    if tasks:  # the caller's tasks name the pipeline tag
        del fields["pipeline_tag"]
    return fields


def save_early_exit(trainer: Any, output_dir: str | None, state_dict: dict | None) -> bool:
    """`save_model` and the checkpoints of an early-exit student write `EarlyExitModel.save_pretrained`'s layout
    (the backbone's own files plus the branch files) and the tokenizer, as the Trainer does for a PreTrainedModel;
    False (nothing written) for any other student."""
    model = early_exit_student(trainer)
    if model is None:
        return False
    if not trainer.args.should_save:
        return True
    output_dir = output_dir if output_dir is not None else trainer.args.output_dir
    os.makedirs(output_dir, exist_ok=True)
    model.save_pretrained(output_dir, state_dict=state_dict)
    tokenizer = trainer.processing_class or getattr(trainer.data_collator, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.save_pretrained(output_dir)
    return True


def load_early_exit(trainer: Any, folder: str, model: Any, load_backbone: Callable[[str, nn.Module], None]) -> bool:
    """Resume (or load the best checkpoint of) an early-exit student from the layout `save_early_exit` writes:
    `load_backbone(folder, backbone)` reads the backbone's files (the Trainer's own load, shards included), the
    branch file is loaded strictly. False for another student, or a checkpoint in the Trainer's layout (the wrapper's
    state dict, written by an earlier hf_distill), which the Trainer's own load reads."""
    from safetensors.torch import load_file

    from .students.early_exit import BRANCH_CONFIG_FILE, BRANCH_FILE

    student = early_exit_student(trainer, model)
    if student is None or not os.path.isfile(os.path.join(folder, BRANCH_CONFIG_FILE)):
        return False
    load_backbone(folder, student.model)
    student.branches.load_state_dict(load_file(os.path.join(folder, BRANCH_FILE), device="cpu"), strict=True)
    return True


__all__ = ["check_best_metric", "check_resumable", "check_search_objective", "distils_unlabeled", "early_exit_card",
           "early_exit_student", "ignored_keys", "load_early_exit", "runs_model_alone", "save_early_exit",
           "student_batch", "student_prediction_step", "unlabeled_prediction_step"]
