"""What a model's head outputs, and which of its outputs the logit-distillation term compares.

`DistillationTrainer` distils any head a `Trainer` trains, but the right comparison depends on the head:
a softmax over classes (sequence or token classification, masked LM), a softmax over the *next* token
(causal LM: position t is compared where token t+1 is counted), independent sigmoids (multi-label), a
real number (regression: only `mse` makes sense), two softmaxes over positions (extractive QA:
the mean of the start and end terms, as DistilBERT and TextBrewer distil SQuAD), or a softmax over the
vocabulary at each decoder position of an encoder-decoder LM (T5, BART, Marian: position t predicts label t, no
shift). Heads are recognised by
class name and config, the same facts transformers' own loss functions use; anything else is refused with
an error rather than distilled with the wrong loss.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch import nn

from .taps import unwrap

SOFTMAX_LOSSES = ("kl", "soft_ce", "reverse_kl", "jsd", "skew_kl", "skew_reverse_kl", "tvd")


class Head(enum.Enum):
    SEQUENCE = "single-label classification"
    TOKEN = "token-level logits (token classification, masked LM)"
    CAUSAL_LM = "causal LM (next-token logits)"
    MULTI_LABEL = "multi-label classification"
    REGRESSION = "regression"
    QUESTION_ANSWERING = "extractive question answering"
    SEQ2SEQ_LM = "encoder-decoder LM (decoder-token logits)"


TOKEN_LEVEL = (Head.TOKEN, Head.CAUSAL_LM, Head.SEQ2SEQ_LM)
"""Heads whose logits are (batch, positions, classes) and whose terms are means over counted positions."""


LOGIT_KEYS = {Head.QUESTION_ANSWERING: ("start_logits", "end_logits")}
"""Output fields holding the logits of heads that have more than `logits`."""


def is_causal_lm(model: nn.Module) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    inner = unwrap(model)
    config = getattr(inner, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return False
    return type(inner).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() or type(inner).__name__.endswith(
        "ForCausalLM"
    )


def is_seq2seq_lm(model: nn.Module) -> bool:
    """An encoder-decoder with a language-model head over the decoder (`AutoModelForSeq2SeqLM`'s classes)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    inner = unwrap(model)
    if not getattr(getattr(inner, "config", None), "is_encoder_decoder", False):
        return False
    return type(inner).__name__ in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.values()


def static_head(model: nn.Module) -> Head | None:
    """The head as far as the class and config tell it; None for a plain module (decided from its logits)."""
    inner = unwrap(model)
    name = type(inner).__name__
    config = getattr(inner, "config", None)
    if is_seq2seq_lm(inner):
        return Head.SEQ2SEQ_LM
    if name.endswith("ForQuestionAnswering"):
        return Head.QUESTION_ANSWERING
    if is_causal_lm(inner):
        return Head.CAUSAL_LM
    if name.endswith("ForSequenceClassification"):
        problem = getattr(config, "problem_type", None)
        if problem == "multi_label_classification":
            return Head.MULTI_LABEL
        if problem == "regression" or getattr(config, "num_labels", 2) == 1:
            return Head.REGRESSION
        return Head.SEQUENCE
    if name.endswith("ForTokenClassification") or name.endswith("ForMaskedLM"):
        return Head.TOKEN
    return None


def runtime_head(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor | None) -> Head:
    """The head of this batch. A sequence classifier without `problem_type` decides it from its labels at its
    first forward (transformers' rule: float labels with one column per class are multi-label); a plain module
    is judged by the shape of its logits."""
    head = static_head(model)
    if head is Head.SEQUENCE and getattr(getattr(unwrap(model), "config", None), "problem_type", None) is None:
        if labels is not None and labels.is_floating_point() and labels.dim() == 2 and labels.shape[-1] > 1:
            return Head.MULTI_LABEL
    if head is not None:
        return head
    if logits.dim() == 3:
        return Head.TOKEN
    return Head.REGRESSION if logits.shape[-1] == 1 else Head.SEQUENCE


def check_kd_loss(head: Head | None, kd_loss: str, where: str = "the student") -> None:
    """Refuse a logit loss that is not defined for the head (before training, and again per batch)."""
    if head is Head.REGRESSION and kd_loss in SOFTMAX_LOSSES:
        raise ValueError(
            f"kd_loss={kd_loss!r} compares softmax distributions, but {where} has a regression head (one output, "
            "so its softmax is always 1 and the loss is 0 forever). Use kd_loss='mse' (the logit regression of "
            "Tang et al. 2019, Distilled BiLSTM)."
        )
    if head is Head.MULTI_LABEL and kd_loss in ("reverse_kl", "jsd", "skew_kl", "skew_reverse_kl", "tvd"):
        raise ValueError(
            f"kd_loss={kd_loss!r} is not defined for multi-label heads. Use 'kl' (per-label binary KL against the "
            "teacher's sigmoid), 'soft_ce' (binary cross-entropy against it) or 'mse'."
        )
    if head is Head.QUESTION_ANSWERING and kd_loss == "mse":
        raise ValueError(
            "kd_loss='mse' is not supported for question-answering heads: span logits are compared as "
            "distributions over positions. Use kd_loss='kl' or 'soft_ce'."
        )


def head_logits(out: Any, head: Head) -> list[torch.Tensor]:
    """The output tensors the KD term compares: `[logits]`, or `[start_logits, end_logits]` for QA."""
    keys = LOGIT_KEYS.get(head)
    if keys is None:
        return [_logits(out)]
    values = [out.get(k) if isinstance(out, dict) else getattr(out, k, None) for k in keys]
    if any(v is None for v in values):
        raise ValueError(f"A {head.value} model must return {', '.join(keys)}.")
    return values


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        if "logits" not in out:
            raise ValueError(f"The model output has no `logits` (it has {', '.join(out)}).")
        return out["logits"]
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, tuple | list):
        return out[0]
    raise TypeError(f"Cannot find logits in the model output of type {type(out).__name__}.")


def with_decoder_inputs(model: nn.Module, inputs: dict[str, Any], label_name: str = "labels") -> dict[str, Any]:
    """`inputs` with the decoder's input ids made from the labels when the batch has none, as the model itself (and
    `DataCollatorForSeq2Seq(model=...)`) makes them: teacher and student then read the same decoder inputs, also
    when the student is not given the labels (`task_weight=0`)."""
    labels = inputs.get(label_name)
    if "decoder_input_ids" in inputs or "decoder_inputs_embeds" in inputs or not isinstance(labels, torch.Tensor):
        return inputs
    prepare = getattr(unwrap(model), "prepare_decoder_input_ids_from_labels", None)
    if prepare is None:
        raise ValueError(
            f"The batch has no decoder_input_ids and {type(unwrap(model)).__name__} cannot make them from the labels "
            "(no prepare_decoder_input_ids_from_labels): give DataCollatorForSeq2Seq the model (model=student) or "
            "add decoder_input_ids to the batch."
        )
    return {**inputs, "decoder_input_ids": prepare(labels=labels)}
