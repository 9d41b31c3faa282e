"""Token-level terms normalised over the whole optimizer step, not per micro-batch.

A token-level term (token-level KD, the MLM or causal-LM task loss, hidden-state and attention-score
MSE) is a mean over counted tokens. Averaging per-micro-batch means under gradient accumulation or DDP
weights a token of a short micro-batch more than one of a long micro-batch, so the update differs from
the big batch's. The step's update must be the big batch's (docs/guides/trainer.md, "Notes on correctness"),
so the mean is the big batch's: the sum over the step's counted tokens divided by their number, as
transformers does with `num_items_in_batch`. The trainer counts each kind of position over the step's
micro-batches and processes (`batch_counts`, summed in `get_batch_samples`) and rescales each micro-batch's
mean by `local count * micro-batches * processes / step count`; the Trainer's division by the accumulation
steps and DDP's gradient average then leave exactly `sum / count`. Sequence-level terms (one value per row)
keep their per-row means.
"""

from __future__ import annotations

from typing import Any

import torch

COUNT_KINDS = ("tokens", "pairs", "labels", "kd", "causal_pairs", "decoder_tokens", "decoder_causal_pairs")
"""tokens: real tokens (hidden states, cosine); pairs: real (query, key) pairs (attention scores); labels: the
positions the task loss counts; kd: the positions the token-level KD term counts; causal_pairs: real (query,
key) pairs with the key not after the query (attention scores of decoders); decoder_tokens and
decoder_causal_pairs: the same for the decoder stack of an encoder-decoder model (its positions are
`decoder_positions`)."""


def _positions_shape(batch: dict[str, Any]) -> tuple[int, int] | None:
    for name in ("attention_mask", "input_ids", "labels"):
        value = batch.get(name)
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            return value.shape[0], value.shape[1]
    return None


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


def batch_counts(
    batch: dict[str, Any], label_name: str, kd_mode: str, causal: bool, seq2seq: bool = False
) -> torch.Tensor:
    """Counts of each kind in `COUNT_KINDS` for one micro-batch, as a float64 vector (zeros if unknown).
    `seq2seq`: an encoder-decoder student, whose KD term counts the decoder's positions."""
    shape = _positions_shape(batch)
    if shape is None:
        return torch.zeros(len(COUNT_KINDS), dtype=torch.float64)
    b, t = shape
    mask = batch.get("attention_mask")
    mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    labels = batch.get(label_name)
    if mask is not None:
        per_row = (mask != 0).sum(-1).double()
        tokens, pairs = per_row.sum(), per_row.square().sum()
        causal_pairs = (per_row * (per_row + 1) / 2).sum()
    else:
        tokens, pairs = torch.tensor(float(b * t)), torch.tensor(float(b * t * t))
        causal_pairs = torch.tensor(float(b * t * (t + 1) // 2))
    lab = label_positions(labels, causal)
    n_labels = lab.sum() if lab is not None else torch.tensor(0.0)
    kd = kd_positions(mask, labels, kd_mode, causal, batch.get("position_ids"))
    n_kd = kd.sum() if kd is not None else torch.tensor(float(b * (t - 1 if causal else t)))
    dec_tokens = dec_pairs = torch.tensor(0.0)
    if seq2seq:
        # Without labels or a decoder mask every decoder position counts (the decoder_input_ids' shape).
        ids = batch.get("decoder_input_ids")
        every = torch.ones(ids.shape[:2], dtype=torch.bool) if isinstance(ids, torch.Tensor) else None
        dec = decoder_positions(batch, label_name)
        dec = dec if dec is not None else every
        if dec is not None:
            per_row = dec.sum(-1).double()
            dec_tokens, dec_pairs = per_row.sum(), (per_row * (per_row + 1) / 2).sum()
        kd = seq2seq_kd_positions(batch, label_name, kd_mode)
        kd = kd if kd is not None else every
        n_kd = kd.sum() if kd is not None else torch.tensor(0.0)
    counts = (tokens, pairs, n_labels, n_kd, causal_pairs, dec_tokens, dec_pairs)
    return torch.stack([torch.as_tensor(x, dtype=torch.float64).cpu() for x in counts])


class StepCounts:
    """The current optimizer step's counts, consumed one micro-batch at a time by `compute_loss`."""

    def __init__(self) -> None:
        self.totals: dict[str, float] | None = None
        self.micro_batches = 0
        self.processes = 1
        self._left = 0

    def start(self, totals: torch.Tensor, micro_batches: int, processes: int) -> None:
        self.totals = dict(zip(COUNT_KINDS, totals.tolist(), strict=True))
        self.micro_batches, self.processes, self._left = micro_batches, processes, micro_batches

    def take(self) -> bool:
        """True while the step's micro-batches last (a compute_loss outside the training loop gets False)."""
        if self._left <= 0:
            return False
        self._left -= 1
        return True

    def scale(self, kind: str, local: float) -> float:
        """Factor turning a micro-batch mean over `local` positions into its share of the step mean."""
        total = self.totals[kind] if self.totals else 0.0
        if total <= 0:
            return 0.0
        return local * self.micro_batches * self.processes / total
