"""How a `Distiller` gets its teachers' outputs for one batch: the batch's cached columns (whole or top-k logits,
an offline teacher signal, hidden states) where they hold what the losses need, else a teacher forward on the
student's batch, without gradients, under the student's autocast, on the teacher's own devices.

Apart from hf_distill.distiller because this is the one place that runs a teacher during training; the Distiller
decides what the loss needs, this reads or computes it (as `LogitTerms` turns it into the logit terms).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from torch import nn

from .data.cache import LOGITS_COLUMN, TOPK_INDICES_COLUMN, TOPK_VALUES_COLUMN
from .data.teacher_signal import SIGNAL_TOPK, signal_teacher
from .features.heads import Head, head_logits
from .features.taps import forward
from .losses import chunked, cross_tokenizer
from .placement import send_teacher_outputs, teacher_input_device
from .teacher import shared_base_teacher


class TeacherRuns:
    """The `Distiller`'s teacher side (a mixin: it reads the Distiller's arguments, teachers, intermediate terms,
    head and label names)."""

    def _teacher_outputs(
        self, inputs: dict[str, Any], cached: dict[str, torch.Tensor], hidden_only: bool = False
    ) -> _TeacherOutputs:
        """Every teacher's logits (one view per compared output, hf_distill.features.heads) and the first one's
        features, from the batch's cached columns when possible, else a forward; with `hidden_only` (chunked causal
        LMs) the first teacher's last hidden state instead of its logits."""
        first, feats, hidden = self._first_teacher(inputs, cached, hidden_only)
        if self.args.kd_weight <= 0:
            return _TeacherOutputs([], feats, hidden)
        extra = [self._extra_teacher_views(i, inputs, cached) for i in range(1, len(self.teachers))]
        return _TeacherOutputs([first, *extra], feats, hidden)

    def _first_teacher(self, inputs: dict[str, Any], cached: dict[str, torch.Tensor], hidden_only: bool):
        if self.args.cross_tokenizer:  # the teacher reads its own tokenization of the text
            inputs = cross_tokenizer.teacher_inputs(cached, self.args.cross_tokenizer)
        t_logits = cached.get(LOGITS_COLUMN)
        if t_logits is None and self.args.kd_loss != "mse" and TOPK_VALUES_COLUMN in cached:
            t_logits = (cached[TOPK_VALUES_COLUMN], cached[TOPK_INDICES_COLUMN])  # sparse: kl/soft_ce take it
        if t_logits is None and self.args.kd_loss != "mse" and SIGNAL_TOPK in cached:  # top-k + tail (teacher_signal)
            t_logits = signal_teacher(cached, inputs, self._token_labels, self.args.kd_token_mask)
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
        t_out, t_feats = self.run_teacher(self.teacher, inputs, taps, hidden_only=hidden_only)
        if hidden_only:
            return [None], t_feats, chunked.last_hidden(t_out)
        if t_logits is not None:
            return [t_logits], t_feats, None
        views = head_logits(t_out, self._head or Head.SEQUENCE) if self.args.kd_weight > 0 else [None]
        return views, t_feats, None

    def run_teacher(
        self, teacher: nn.Module, inputs: dict[str, Any], taps=None, labels: bool = False, hidden_only: bool = False
    ):
        """One teacher forward on the student's batch: only the inputs its forward names, without gradients, under
        the student's autocast, on the teacher's devices; returns (outputs, features)."""
        label_names = set(self.label_names) | {"labels"}
        t_kwargs = {k: v for k, v in inputs.items() if (labels or k not in label_names) and k in self.teacher_params}
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
        with torch.no_grad(), self._autocast(), contextlib.ExitStack() as stack:
            if shared:
                teacher = stack.enter_context(shared_base_teacher(teacher))
            outputs = forward(teacher, t_kwargs, taps)
        return outputs if device is None else send_teacher_outputs(outputs, student_device)

    def _autocast(self):
        """The autocast accelerate runs the student's forward in (mixed precision), for what hf_distill computes
        outside that forward from the same tensors: the teacher, the LM heads of the loss head. None without one."""
        return self.accelerator.autocast() if self.accelerator is not None else contextlib.nullcontext()

    def _extra_teacher_views(self, i: int, inputs: dict[str, Any], cached: dict[str, torch.Tensor]):
        """Logits of teacher i >= 1: its cached column `teacher_logits_<i>` if present, else a forward."""
        if f"{LOGITS_COLUMN}_{i}" in cached:
            return [cached[f"{LOGITS_COLUMN}_{i}"]]
        return head_logits(self.run_teacher(self.teachers[i], inputs)[0], self._head or Head.SEQUENCE)


@dataclasses.dataclass
class _TeacherOutputs:
    """What the teachers give one batch: logit views per teacher (none when kd_weight is 0), the first teacher's
    features for the intermediate terms, and its last hidden state for the chunked causal-LM loss head."""

    views: list[list]
    features: Any
    hidden: torch.Tensor | None


__all__ = ["TeacherRuns"]
