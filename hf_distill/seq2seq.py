"""Encoder-decoder students (T5, BART, Marian, ...): `Seq2SeqTrainer` with a teacher.

transformers' `run_summarization.py` and `run_translation.py` train with `Seq2SeqTrainer` and
`Seq2SeqTrainingArguments` (`predict_with_generate=True` evaluates generated text). The same one-line swaps as
for `Trainer` work here:

    from hf_distill import DistillationSeq2SeqArguments, DistillationSeq2SeqTrainer

    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, DistillationSeq2SeqArguments))
    trainer = DistillationSeq2SeqTrainer(model=model, args=training_args, teacher_model=teacher, ...)

What distillation means for these models:

* Logit KD compares the decoder's logits position by position (position t predicts label t: the decoder's input
  is the labels shifted right, so nothing is shifted here), over the label positions that are not -100
  (`kd_token_mask="labels"`) or the decoder's real tokens (`"attention"`: a `decoder_attention_mask` when the
  batch has one, else the same label positions). Teacher and student read the same decoder inputs: the batch's
  `decoder_input_ids`, or the student's shift of the labels (`prepare_decoder_input_ids_from_labels`, what
  `DataCollatorForSeq2Seq(model=student)` does), so their decoder start tokens must agree.
* Intermediate terms name the stack they compare (`stack=encoder` or `stack=decoder`, hf_distill.losses.terms).
* Generation is the student's own: `predict_with_generate` evaluation runs `student.generate` exactly as
  `Seq2SeqTrainer` does, and its `eval_loss` is the student's cross-entropy, unless `eval_with_teacher=True`,
  which makes it the distillation loss (the teacher then runs on every evaluation batch), also for rows without
  labels that carry `decoder_input_ids`, as without generation. Rows with neither get generated tokens and no loss,
  as `Seq2SeqTrainer` means them to (no target sequence to compare the decoders on; without generation a BART-like
  student decodes its shifted `input_ids` and that loss is reported), also from `DataCollatorForSeq2Seq`, whose
  `labels=None` made `Seq2SeqTrainer` run a forward that fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

from . import trainer_runs as runs
from .arguments import DistillationArguments, as_distillation_arguments
from .compat import prepare_inputs
from .trainer import DistillationMixin

__all__ = ["DistillationSeq2SeqArguments", "DistillationSeq2SeqTrainer"]


@dataclass
class DistillationSeq2SeqArguments(DistillationArguments, Seq2SeqTrainingArguments):
    """`Seq2SeqTrainingArguments` (`predict_with_generate`, `generation_max_length`, `generation_num_beams`,
    `generation_config`) plus the distillation fields of `DistillationArguments`: the arguments of
    `DistillationSeq2SeqTrainer`, and what `HfArgumentParser` parses in place of `Seq2SeqTrainingArguments`."""


class DistillationSeq2SeqTrainer(DistillationMixin, Seq2SeqTrainer):
    """`Seq2SeqTrainer` + a frozen teacher: `DistillationTrainer`'s loss, checkpoints and card, `Seq2SeqTrainer`'s
    generation in `evaluate`/`predict` (`predict_with_generate`, `max_length`, `num_beams`, gen kwargs).

    Takes `DistillationSeq2SeqArguments`; `Seq2SeqTrainingArguments`, `DistillationArguments` or plain
    `TrainingArguments` are upgraded to them (every field kept, a warning logged). Other arguments as
    `DistillationTrainer` (`teacher_model=`) and `Seq2SeqTrainer`.
    """

    def _distillation_arguments(self, args: Any) -> DistillationSeq2SeqArguments:
        return as_distillation_arguments(args, "DistillationSeq2SeqTrainer", DistillationSeq2SeqArguments,
                                         "Seq2SeqTrainingArguments", noted=("predict_with_generate",))

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
        **gen_kwargs: Any,
    ):
        """`Seq2SeqTrainer.prediction_step` (the student generates); with `eval_with_teacher=True` the loss it
        reports is the distillation loss, as in evaluation without generation, not the student's cross-entropy:
        also for rows without labels that carry `decoder_input_ids` (the decoder sequence the loss compares on).
        Rows with neither have no loss, as in `Seq2SeqTrainer`: no target sequence to compare the decoders on."""
        generate = self.args.predict_with_generate and not prediction_loss_only
        if self._evaluating_teacher or not generate:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)
        inputs = _without_empty_labels(inputs, self.label_names)
        if not self.args.eval_with_teacher:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)
        loss, tokens, labels = super().prediction_step(
            model, dict(inputs), prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs
        )
        # rows without labels: the loss they get without generation (distils_unlabeled as for a loss-only step)
        decoded = any(inputs.get(k) is not None for k in ("decoder_input_ids", "decoder_inputs_embeds"))
        if loss is not None or (decoded and runs.distils_unlabeled(self, inputs, prediction_loss_only=True)):
            with torch.no_grad(), self.compute_loss_context_manager():
                loss = self.compute_loss(model, prepare_inputs(self, dict(inputs))).detach().mean()
        return loss, tokens, labels


def _without_empty_labels(inputs: dict[str, Any], label_names: list[str]) -> dict[str, Any]:
    """The batch without label keys set to None (`DataCollatorForSeq2Seq` on rows without targets): Seq2SeqTrainer's
    generation reads the key's presence as labels and runs the model's forward for a loss, which fails without
    decoder inputs (transformers#19714: rows without targets should give generated tokens and no loss)."""
    return {k: v for k, v in inputs.items() if not (k in (*label_names, "labels") and v is None)}
