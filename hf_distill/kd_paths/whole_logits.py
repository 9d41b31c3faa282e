"""KD from whole logits, for every head: several compared outputs for QA, shifted positions for causal LMs, a mixture
or a sum over several teachers, the ids two padded vocabularies share. The path every other one falls back to."""

from __future__ import annotations

import torch

from .. import losses
from ..features.heads import Head, head_logits
from ..losses.normalise import kd_positions, seq2seq_kd_positions
from .base import KDPath, PathBatch, PathContext, register_path, shift

# Span logits at padded positions: far below any real logit, finite so no inf - inf appears in the losses.
_NO_POSITION = -1e9


@register_path
class WholeLogits(KDPath):
    """The student's and the teachers' whole logits, compared by `kd_loss` (hf_distill.losses)."""

    name = "whole_logits"
    priority = 0

    @classmethod
    def applies(cls, ctx: PathContext, form: str | None, training: bool) -> bool:
        return True

    def loss(self, batch: PathBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        task = batch.task() if batch.want_task else None
        kd = None
        if batch.teacher is not None and batch.teacher.views:
            kd = self.kd_loss(batch.head, head_logits(batch.outputs, batch.head), batch.teacher.views, batch.inputs)
        return kd, task

    def kd_loss(self, head: Head, s_views: list, t_views: list[list], inputs: dict) -> torch.Tensor:
        """Logit distillation of each compared output (the mean of start and end for QA), from one or several
        teachers; token-level logits are shifted for causal LMs and averaged over `kd_token_mask` positions."""
        ctx, settings = self.ctx, self.ctx.settings
        values = []
        for i, s in enumerate(s_views):
            teachers = [views[i] for views in t_views]
            mask = None
            if s.dim() == 3:
                if head is Head.CAUSAL_LM:
                    s, teachers = s[:, :-1], [shift(t) for t in teachers]
                labels = inputs.get(ctx.label_name)
                causal = head is Head.CAUSAL_LM
                if head is Head.SEQ2SEQ_LM:  # the decoder's positions, not the encoder's attention mask
                    mask = seq2seq_kd_positions(inputs, ctx.label_name, settings.kd_token_mask)
                else:
                    mask = kd_positions(inputs.get("attention_mask"), labels, settings.kd_token_mask, causal,
                                        inputs.get("position_ids"))  # packed rows: not across sequences
            elif head is Head.QUESTION_ANSWERING and inputs.get("attention_mask") is not None:
                # Span logits are distributions over positions: padding is no candidate answer, for either model.
                real = inputs["attention_mask"] != 0
                s = s.float().masked_fill(~real, _NO_POSITION)
                teachers = [t.float().masked_fill(~real, _NO_POSITION) for t in teachers]
            if s.dim() == 3 and ctx.shared_vocab is not None:  # padded vocabularies: the ids both models know
                v = ctx.shared_vocab
                for j, t in enumerate(teachers):
                    if not isinstance(t, tuple):
                        ctx.padding(j, [t[mask.bool()] if mask is not None else t.flatten(0, -2)])
                s, teachers = s[..., :v], [t if isinstance(t, tuple) else t[..., :v] for t in teachers]
            values.append(self._combine_teachers(head, s, teachers, mask))
        return sum(values) / len(values)

    def _combine_teachers(self, head: Head, s: torch.Tensor, t_logits: list, mask) -> torch.Tensor:
        """Several teachers are combined as `multi_teacher` says: `probs` distils the weighted average of their
        softened distributions (one KD term against a mixture, as TextBrewer's multi-teacher averages);
        `losses` sums one KD term per teacher, weighted."""
        ctx, T = self.ctx, self.ctx.settings.temperature
        weights = ctx.teacher_weights
        if len(t_logits) == 1:
            return self._logit_loss(head, s, t_logits[0], mask)
        if ctx.args.multi_teacher == "losses":
            return sum(w * self._logit_loss(head, s, t, mask) for w, t in zip(weights, t_logits, strict=True))
        if any(isinstance(t, tuple) for t in t_logits):
            raise ValueError("multi_teacher='probs' needs dense teacher logits; cached top-k logits cannot be mixed.")
        if head is Head.MULTI_LABEL:  # a mixture of per-label Bernoullis, as logits at temperature T
            p = sum(w * (t.float() / T).sigmoid() for w, t in zip(weights, t_logits, strict=True))
            p = p.clamp(1e-7, 1 - 1e-7)
            return self._logit_loss(head, s, T * (p.log() - (-p).log1p()), mask)
        mixture = sum(w * (t.float() / T).softmax(-1) for w, t in zip(weights, t_logits, strict=True))
        # T * log(p) has softmax(. / T) == p, so the mixture goes through the usual loss unchanged.
        return self._logit_loss(head, s, T * mixture.clamp_min(1e-30).log(), mask)

    def _logit_loss(self, head: Head, s: torch.Tensor, t, mask) -> torch.Tensor:
        settings = self.ctx.settings
        kind, T = settings.kd_loss, settings.temperature
        if head is Head.MULTI_LABEL and kind != "mse":
            fn = losses.binary_kl_div if kind == "kl" else losses.binary_soft_cross_entropy
            return fn(s, t, T)
        return losses.logit_kd_loss(kind, s, t, T, mask=mask, beta=settings.effective_jsd_beta,
                                    alpha=settings.resolved_skew_alpha)


__all__ = ["WholeLogits"]
