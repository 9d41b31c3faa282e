"""KD between a teacher and a student with different tokenizers (hf_distill.losses.cross_tokenizer): the teacher
reads its own tokenization of the text, and the two models' whole logits are paired at positions of the two
tokenizations as `cross_tokenizer` says (ULD: sorted probabilities; aligned: the tokens both vocabularies hold)."""

from __future__ import annotations

from typing import Any

import torch

from ..features.heads import head_logits
from ..losses import cross_tokenizer
from .base import KDPath, PathBatch, PathContext, register_path


@register_path
class CrossTokenizer(KDPath):
    """The KD term of a teacher with another tokenizer: its logits on its own tokenization of each row."""

    name = "cross_tokenizer"
    priority = 30

    @classmethod
    def applies(cls, ctx: PathContext, form: str | None, training: bool) -> bool:
        return bool(ctx.args.cross_tokenizer)

    def teacher_inputs(self, inputs: dict[str, Any], cached: dict[str, torch.Tensor]) -> dict[str, Any]:
        return cross_tokenizer.teacher_inputs(cached, self.ctx.args.cross_tokenizer)

    def loss(self, batch: PathBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        task = batch.task() if batch.want_task else None
        kd = None
        if batch.teacher is not None and batch.teacher.views:
            ctx, settings = self.ctx, self.ctx.settings
            kd = cross_tokenizer.cross_tokenizer_kd(
                ctx.args.cross_tokenizer, head_logits(batch.outputs, batch.head)[0], batch.teacher.views[0][0],
                {**batch.inputs, **batch.cached}, kind=settings.kd_loss, temperature=settings.temperature,
                label_name=ctx.label_name, mode=settings.kd_token_mask, shared=ctx.cross_vocab,
                beta=settings.effective_jsd_beta, alpha=settings.resolved_skew_alpha)
        return kd, task


__all__ = ["CrossTokenizer"]
