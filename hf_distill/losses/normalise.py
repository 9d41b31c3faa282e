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

from ..base.positions import (  # noqa: F401 - same_sequence: importable from here
    decoder_positions,
    kd_positions,
    label_positions,
    same_sequence,
    seq2seq_kd_positions,
)

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
    # images, and audio without a mask (a wav2vec2 extractor with return_attention_mask=False; AST's spectrograms;
    # issue #43): every row has the same positions, so a row counts one (else every term was scaled by 0)
    for name, dims in (("pixel_values", (4,)), ("input_values", (2, 3)), ("input_features", (3,))):
        value = batch.get(name)
        if isinstance(value, torch.Tensor) and value.dim() in dims:
            return value.shape[0], 1
    return None


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
