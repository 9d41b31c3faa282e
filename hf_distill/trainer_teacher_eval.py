"""The teacher's own evaluation inside a distillation trainer: `evaluate_teacher()` runs the Trainer's evaluation
loop with the teacher in the student's place (same data, `compute_metrics`, gathering across processes), so the
model card can put the teacher's metrics next to the student's, measured the same way."""

from __future__ import annotations

import math
import time
from typing import Any

from . import trainer_runs as runs
from .base.batch_keys import TEACHER_PREFIX
from .compat import prepare_inputs
from .data.audio import teacher_own_inputs
from .features import heads as heads_mod
from .features.taps import unwrap
from .task_loss import plain_task_loss


class TeacherEvaluation:
    """Mixed into the distillation trainers (before the Trainer class): `prediction_step` hands a batch to
    `_teacher_prediction_step` while `_evaluating_teacher` is set."""

    _evaluating_teacher = False

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
        router = self.distiller.router
        if router is not None and len(router.names) > 1:  # the first teacher would be scored on every teacher's rows
            raise ValueError(
                "evaluate_teacher scores one teacher on every row, but this run routes its rows to "
                f"{len(router.names)} named teachers ({', '.join(router.names)}): its metrics would not be those of "
                "the teachers the student learnt from. Evaluate each teacher on its own rows with a trainer of its own."
            )
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
        """One evaluation loop whose prediction steps run the teacher instead of the student."""
        from transformers.trainer_utils import speed_metrics

        dataloader = self.get_eval_dataloader(dataset)
        start = time.time()
        self._evaluating_teacher = True
        try:
            output = self.evaluation_loop(
                dataloader,
                description="Teacher evaluation",
                prediction_loss_only=True if self.compute_metrics is None else None,
                ignore_keys=ignore_keys,
                metric_key_prefix=prefix,
            )
        finally:
            self._evaluating_teacher = False
        steps = math.ceil(output.num_samples / (self.args.eval_batch_size * self.args.world_size))
        output.metrics.update(speed_metrics(prefix, start, num_samples=output.num_samples, num_steps=steps))
        return output.metrics

    def _teacher_prediction_step(self, inputs, prediction_loss_only, ignore_keys=None):
        """`prediction_step` with the teacher as the model (the student is not run)."""
        from transformers.trainer_pt_utils import nested_detach

        names = self.label_names
        if self.args.cross_tokenizer:  # the teacher reads its own tokenization (hf_distill.losses.cross_tokenizer)
            from .losses.cross_tokenizer import teacher_batch

            inputs = teacher_batch(inputs, self.args.cross_tokenizer, names)
        own = {k: v for k, v in inputs.items() if k.startswith(TEACHER_PREFIX)}  # its own input_values (data.audio)
        inputs = teacher_own_inputs({k: v for k, v in inputs.items() if k not in own}, own)
        if self.distiller.images is not None:  # an image teacher reads its own pixel_values (issue #43)
            inputs = self.distiller.images.teacher_inputs(inputs, own)
        inputs = prepare_inputs(self, inputs)
        has_labels = bool(names) and all(inputs.get(k) is not None for k in names)
        labels = nested_detach(tuple(inputs[k] for k in names)) if has_labels else None
        labels = labels[0] if labels is not None and len(labels) == 1 else labels
        out, _ = self.distiller.run_teacher(self.teacher, inputs, labels=has_labels)  # its own loss, as the student's
        logits = heads_mod._logits(out)
        loss = None
        if has_labels:  # the teacher's own loss where its head computed one, as the student's is
            found = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
            if found is None and len(names) == 1:
                found = plain_task_loss(logits, labels)
            loss = found.detach().mean() if found is not None else None
        if prediction_loss_only:
            return loss, None, None
        if isinstance(out, dict):
            ignore_keys = runs.ignored_keys(unwrap(self.teacher), ignore_keys)
            kept = tuple(v for k, v in out.items() if k not in [*ignore_keys, "loss"])
            logits = kept[0] if len(kept) == 1 else kept
        return loss, nested_detach(logits), labels
