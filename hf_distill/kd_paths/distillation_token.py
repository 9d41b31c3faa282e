"""DeiT's distillation token, trained (Touvron et al. 2021, issue #43 item 4).

A DeiT student has two tokens and two heads: `cls_classifier` on the class token and `distillation_classifier` on
the distillation token; at inference it predicts their average (transformers' `DeiTForImageClassificationWithTeacher`,
whose `logits` are that average). In training the class head learns the labels and the distillation head learns the
teacher: its hard decision (`distillation_token="hard"`, cross-entropy against the teacher's argmax, DeiT's best
row) or its softened distribution (`"soft"`, `kd_loss` at `temperature`, as any logit KD). transformers and DeiT's own
repository only run this model for inference; here it trains through the Trainer and saves as the plain
transformers model it is.

The path applies to a training pass of a student with both heads (read from the model, not its class name); in
evaluation the student's `logits` (the average) are what the whole-logits path and metrics read.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..features.heads import Head
from ..task_loss import plain_task_loss
from .base import KDPath, PathBatch, PathContext, register_path
from .whole_logits import WholeLogits

HEAD_MODULES = ("cls_classifier", "distillation_classifier")
"""The two heads of a distillation-token student (transformers' DeiT layout)."""

MODES = ("hard", "soft")


def has_distillation_token(model: Any) -> bool:
    """Whether `model` (unwrapped) has DeiT's two heads: a class head and a distillation head."""
    return all(isinstance(getattr(model, name, None), torch.nn.Module) for name in HEAD_MODULES)


def _output(out: Any, key: str) -> torch.Tensor:
    value = out.get(key) if isinstance(out, dict) else getattr(out, key, None)
    if value is None:
        raise ValueError(f"A distillation-token student must return `{key}` (transformers' DeiT layout).")
    return value


@register_path
class DistillationToken(KDPath):
    """Task loss on `cls_logits`, KD (hard or soft, `distillation_token`) on `distillation_logits`."""

    name = "distillation_token"
    priority = 40

    @classmethod
    def applies(cls, ctx: PathContext, form: str | None, training: bool) -> bool:
        return training

    def bind(self, state: Any, model: Any) -> bool:
        if not has_distillation_token(state.inner):
            return False
        if self.ctx.head not in (Head.SEQUENCE, Head.MULTI_LABEL, None):
            raise ValueError(f"distillation_token: the student's head is {self.ctx.head.value}; DeiT's two heads "
                             "classify images (single- or multi-label).")
        if len(self.ctx.teacher_weights) > 1:
            raise ValueError("distillation_token: DeiT's distillation head learns one teacher; give one teacher_model.")
        return True

    def loss(self, batch: PathBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        labels = batch.inputs.get(self.ctx.label_name)
        task = None
        if batch.want_task and labels is not None:
            task = plain_task_loss(_output(batch.outputs, "cls_logits"), labels)
        kd = None
        if batch.teacher is not None and batch.teacher.views:
            s = _output(batch.outputs, "distillation_logits")
            t = batch.teacher.views[0][0]
            if isinstance(t, tuple) or t is None:
                raise ValueError("distillation_token needs the teacher's dense logits (a teacher model or cached "
                                 "teacher_logits), not a top-k signal.")
            kd = self.token_loss(batch.head, s, t, batch.inputs)
        return kd, task

    def token_loss(self, head: Head, s: torch.Tensor, t: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """Hard: cross-entropy against the teacher's decision (per label for multi-label: its logit > 0); soft: the
        run's `kd_loss` at `temperature` (hf_distill.kd_paths.whole_logits)."""
        mode = self.ctx.args.distillation_token or "hard"
        t = t.detach().to(s.device)
        if mode == "hard":
            if head is Head.MULTI_LABEL:
                return F.binary_cross_entropy_with_logits(s.float(), (t > 0).float())
            return F.cross_entropy(s.float(), t.argmax(-1))
        return WholeLogits(self.ctx).kd_loss(head, [s], [[t]], inputs)


__all__ = ["HEAD_MODULES", "MODES", "DistillationToken", "has_distillation_token"]
