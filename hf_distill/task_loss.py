"""The student's task loss in a distillation, computed as `Trainer.compute_loss` would: `compute_loss_func`, else the
label smoother, else the model's own loss (cross-entropy / MSE / BCE for a plain module without one).

Apart from the KD paths (hf_distill.kd_paths) because every path shares it: the whole-logits paths compute it from
the student's outputs, the loss head computes the cross-entropy itself and adds the router loss here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .features import heads as heads_mod
from .features.families_audio import check_own_loss
from .features.heads import Head
from .losses.normalise import StepCounts


class TaskLoss:
    """The task term of one Distiller. `settings` is read at each call (task_weight); `given_label_names` is True
    when the user named the label keys (a batch without them is then refused in training)."""

    def __init__(self, settings: Any, label_names: list[str], given_label_names: bool, label_smoother: Any,
                 compute_loss_func: Any, step: StepCounts, processes: Callable[[], int],
                 tokens_across_devices: bool) -> None:
        self.settings, self.label_names, self.given_label_names = settings, label_names, given_label_names
        self.label_smoother, self.compute_loss_func = label_smoother, compute_loss_func
        self.step, self.processes, self.tokens_across_devices = step, processes, tokens_across_devices
        # The label tensor of token-level heads (counted positions, `kd_token_mask="labels"`).
        self.label_name = label_names[0] if len(label_names) == 1 else "labels"

    @property
    def needs_full_logits(self) -> bool:
        """label_smoothing_factor or compute_loss_func read the student's whole logits."""
        return self.label_smoother is not None or self.compute_loss_func is not None

    def wanted(self, model: nn.Module, inputs: dict[str, Any], distill: bool) -> tuple[bool, bool]:
        """Whether the task loss is computed (in training when task_weight > 0, in evaluation always) and whether it
        is computed here from the outputs (label smoothing or compute_loss_func, as in `Trainer.compute_loss`)
        rather than by the student from `labels`."""
        names = self.label_names
        has_labels = bool(names) and all(inputs.get(n) is not None for n in names)
        if model.training and self.settings.task_weight > 0 and self.given_label_names and not has_labels:
            missing = [n for n in names if inputs.get(n) is None]
            raise ValueError(
                f"label_names={names} but the training batch has no {missing} (its keys: {sorted(inputs)}), so the "
                "task term (task_weight > 0) cannot be computed. Name the batch's label keys in label_names, or set "
                "task_weight=0 to train on the teacher alone."
            )
        own_task = self.needs_full_logits and "labels" in inputs
        if has_labels and not own_task and (not distill or self.settings.task_weight > 0):
            check_own_loss(heads_mod.unwrap(model), inputs.get("labels"))  # wav2vec2/HuBERT: single-label loss
        return has_labels and (not distill or self.settings.task_weight > 0), own_task

    def loss(self, out: Any, inputs: dict[str, Any], head: Head, num_items_in_batch, step_mean: bool):
        """The task loss from the student's outputs (whole logits, or its own `loss`)."""
        if self.compute_loss_func is not None and "labels" in inputs:
            value = self.compute_loss_func(out, inputs["labels"], num_items_in_batch=num_items_in_batch).float()
            if step_mean:
                # The Trainer takes this value as normalised over the whole step already (it neither divides it
                # by the accumulation steps nor lets DDP average it); undo both of ours to match.
                tokens_across = self.tokens_across_devices and num_items_in_batch is not None
                value = value * self.step.micro_batches * (self.processes() if tokens_across else 1)
            return value
        if self.label_smoother is not None and "labels" in inputs:
            return self.label_smoother(out, inputs["labels"], shift_labels=head is Head.CAUSAL_LM).float()
        labels = inputs.get(self.label_name)
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

    @staticmethod
    def with_router_loss(inner: nn.Module, s_out: Any, ce: torch.Tensor) -> torch.Tensor:
        """The task loss as the model's own: a mixture-of-experts student with `output_router_logits` adds its
        load-balancing loss (`router_aux_loss_coef * aux_loss`) to the cross-entropy, which the loss head computed
        without it (the student ran without labels)."""
        aux = s_out.get("aux_loss") if isinstance(s_out, dict) else getattr(s_out, "aux_loss", None)
        if aux is None:
            return ce
        coef = getattr(inner, "router_aux_loss_coef", getattr(inner.config, "router_aux_loss_coef", None))
        if coef is None:
            raise ValueError(
                f"The student ({type(inner).__name__}) returns an aux_loss but no router_aux_loss_coef, so hf_distill "
                "cannot add it to the task loss as the model would: set config.output_router_logits=False, or give "
                "the model a router_aux_loss_coef.")
        return ce + float(coef) * aux.float().to(ce.device)


def plain_task_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, MSE (one output, float labels) or BCE (multi-hot float labels) for a model without a loss."""
    logits = logits.float()
    if logits.shape[-1] == 1 and labels.is_floating_point():
        return F.mse_loss(logits.squeeze(-1), labels.float())
    if labels.is_floating_point() and labels.shape == logits.shape:
        return F.binary_cross_entropy_with_logits(logits, labels.float())
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


__all__ = ["TaskLoss", "plain_task_loss"]
