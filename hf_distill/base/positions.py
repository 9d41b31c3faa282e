"""The counted positions: which tokens of a batch a token-level KD term, a task loss or a decoder term averages
over (padding, -100 labels, the causal shift, packed rows).

On the ground floor because both sides count them: the losses and the step normalisation
(hf_distill.losses.normalise), and the offline teacher signal (hf_distill.data.teacher_signal), which stores the
teacher's outputs at exactly the positions training will count."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["decoder_positions", "kd_positions", "label_positions", "same_sequence", "seq2seq_kd_positions"]


def kd_positions(
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    mode: str,
    causal: bool,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The positions a token-level KD term averages over, aligned with the (shifted, for causal LMs) logits.

    `mode="labels"`: positions whose label is not -100 (for a causal LM, whose *next* label is not -100: the
    logits at t predict token t+1). `mode="attention"`: real tokens (for a causal LM, positions t with both t
    and t+1 real). A causal LM's packed (padding-free) rows also drop the last token of each sequence, whose next
    token starts another one (`same_sequence`). None means every position counts."""
    within = same_sequence(position_ids) if causal else None
    if mode == "labels" and isinstance(labels, torch.Tensor) and labels.dim() == 2:
        counted = (labels[:, 1:] if causal else labels) != -100
    elif attention_mask is None:
        counted = None
    else:
        real = attention_mask != 0
        counted = real[:, :-1] & real[:, 1:] if causal else real
    if within is None:
        return counted
    return within if counted is None else counted & within.to(counted.device)


def same_sequence(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """(B, T - 1): whether tokens t and t + 1 of a row belong to one sequence, for rows that pack several sequences
    (TRL's padding-free batches, transformers' DataCollatorWithFlattening): position t + 1 follows position t, the
    rule transformers' masks use to keep packed sequences apart (`find_packed_sequence_indices`). None without
    2-D position_ids."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[1] < 2:
        return None
    return position_ids[:, 1:] - position_ids[:, :-1] == 1


def decoder_positions(batch: dict[str, Any], label_name: str = "labels") -> torch.Tensor | None:
    """The real positions of an encoder-decoder's decoder, aligned with its logits (no shift: the decoder's input
    is its labels shifted right, so position t predicts label t): the batch's `decoder_attention_mask` when it has
    one, else the labels that are not -100 (DataCollatorForSeq2Seq pads labels with -100, and the decoder's inputs
    are made from them). None (every position) when the batch has neither."""
    dec_mask = batch.get("decoder_attention_mask")
    if isinstance(dec_mask, torch.Tensor) and dec_mask.dim() == 2:
        return dec_mask != 0
    labels = batch.get(label_name)
    if isinstance(labels, torch.Tensor) and labels.dim() == 2:
        return labels != -100
    return None


def seq2seq_kd_positions(batch: dict[str, Any], label_name: str, mode: str) -> torch.Tensor | None:
    """The decoder positions a seq2seq KD term averages over: labels that are not -100 (`mode="labels"`), or the
    decoder's real tokens (`"attention"`, `decoder_positions`); the same unless a decoder_attention_mask differs."""
    labels = batch.get(label_name)
    if mode == "labels" and isinstance(labels, torch.Tensor) and labels.dim() == 2:
        return labels != -100
    return decoder_positions(batch, label_name)


def label_positions(labels: torch.Tensor | None, causal: bool) -> torch.Tensor | None:
    """The positions a token-level task loss counts (transformers' losses ignore -100, causal LMs shift)."""
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        return None
    return (labels[:, 1:] if causal else labels) != -100
