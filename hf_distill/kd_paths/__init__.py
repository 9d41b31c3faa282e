"""KD paths: one object per way the KD loss is computed from what the teacher gives.

| path | class | when |
| --- | --- | --- |
| whole logits | :class:`WholeLogits` | every head; what the others fall back to |
| loss head | :class:`LossHead` | causal LMs in training: KD and CE from hidden states, no `(B, T, V)` logits |
| sparse head | :class:`SparseHead` | the loss head against an offline top-k + tail teacher signal |
| cross-tokenizer | :class:`CrossTokenizer` | `cross_tokenizer`: a teacher with another tokenizer |
| distillation token | :class:`DistillationToken` | a DeiT student's two heads (class and distillation token) |

Each path owns what it asks of the teacher (`request`, `teacher_inputs`) and of the student (`whole_logits`,
`student_kwargs`), its refusals (`applies`, `bind`; the loss head's that need no model: :func:`chunk_size`, before
training) and its loss. :class:`KDPaths` chooses one per model, form of the teacher's logits and pass (training with
the teacher or not), once, at the first batch of each: after the Trainer built (`model_init`), wrapped or compiled
the student. A new path is one subclass of :class:`KDPath` with `@register_path` (its `priority` orders the tries).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .base import PATHS, KDPath, PaddingCheck, PathBatch, PathContext, register_path, shift
from .cross_tokenizer import CrossTokenizer
from .distillation_token import DistillationToken
from .loss_head import LossHead, SparseHead, chunk_size
from .whole_logits import WholeLogits


class KDPaths:
    """The registered paths of one Distiller. The loss head's chunk size is decided here, before training (its
    refusals need no model); the path of each batch is chosen by `choose`, once per model, form and pass."""

    def __init__(self, ctx: PathContext, student: nn.Module) -> None:
        self.context = ctx
        ctx.chunk = chunk_size(ctx, student)

    @property
    def chunk(self) -> int | None:
        """The loss head's tokens per chunk, None where causal-LM logits are computed whole."""
        return self.context.chunk

    @chunk.setter
    def chunk(self, value: int | None) -> None:
        self.context.chunk = value

    def chunk_size(self, student: nn.Module) -> int | None:
        """The loss head's chunk size as the refusals decide it now (the context as it is, e.g. its accelerator)."""
        return chunk_size(self.context, student)

    def choose(self, state: Any, model: nn.Module, form: str | None, training: bool) -> KDPath:
        """The path for batches of this model (`state`: the Distiller's view of it, which keeps the choices), form of
        the teacher's logits (hf_distill.teacher_sources) and pass (`training`: a training pass with the teacher)."""
        key = (form, training)
        path = state.paths.get(key)
        if path is None:
            path = state.paths[key] = next(p for p in self._candidates(form, training) if p.bind(state, model))
        return path

    def _candidates(self, form: str | None, training: bool):
        for cls in PATHS:
            if cls.applies(self.context, form, training):
                yield cls(self.context)


__all__ = ["PATHS", "CrossTokenizer", "DistillationToken",
           "KDPath", "KDPaths", "LossHead", "PaddingCheck", "PathBatch", "PathContext",
           "SparseHead", "WholeLogits", "chunk_size", "register_path", "shift"]
