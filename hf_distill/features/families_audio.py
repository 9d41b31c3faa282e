"""Audio encoders in the architecture registry: wav2vec2, HuBERT and the Audio Spectrogram Transformer (AST).

wav2vec2 and HuBERT read a waveform: a convolutional feature encoder turns samples into frames (20 ms each at 16 kHz
with the base kernels and strides), a projection and a grouped positional convolution feed a BERT-sized stack of
blocks. Their `hidden_states[0]` is the first block's input (the encoder adds the positional convolution, normalises
and drops out inside its own forward), so it is read there. Two facts of these models reach the rest of the package:

* the batch's `attention_mask` is over samples while hidden states are over frames: `frame_mask` makes the frame
  mask from the conv kernels and strides (the formula of `torch.nn.Conv1d`), for the terms and the pruning scores;
* LayerDrop (`config.layerdrop`, 0.1 by default) skips whole blocks in training, leaving no output to distil, so a
  student whose blocks are tapped must set it to 0 (`check_layerdrop`, refused otherwise).

Width pruning keeps their hidden size: the positional convolution is grouped (`num_conv_pos_embedding_groups`), so
its channels cannot be chosen one by one, and the feature projection's norm is over the conv channels. Heads and MLP
channels prune as in BERT. The conv feature encoder is not a block: depth and width pruning leave it whole (a
narrower one is a `students.shrink(..., conv_dim=(...))`, trained from scratch or distilled).

With `do_stable_layer_norm=True` (the large "lv60" layout) `output_hidden_states` ends with the encoder's final
LayerNorm; the taps' last hidden state is the last block's output before it (the family has no final norm to read:
in the default layout the same module normalises *before* the blocks).

AST reads a log-mel spectrogram cut into 16 x 16 patches (a ViT with a class and a distillation token); its layout is
ViT's, and every width prunes (the patch projection and the token and position embeddings follow the hidden
channels).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .families import get_family, register_family

_WAVEFORM = {
    "embeddings": (),
    "embeddings_from_block_input": True,
    "query": "attention.q_proj",
    "key": "attention.k_proj",
    "value": "attention.v_proj",
    "attention_output": "attention.out_proj",
    "mlp_input": ("feed_forward.intermediate_dense",),
    "mlp_output": "feed_forward.output_dense",
    "norms": ("layer_norm", "final_layer_norm"),
    "fixed_hidden": "its positional convolution is grouped (num_conv_pos_embedding_groups), so hidden channels "
                    "cannot be chosen one by one",
    "layerdrop_field": "layerdrop",
    "frames_from_samples": ("conv_kernel", "conv_stride"),
}
for _model_type in ("wav2vec2", "hubert"):
    register_family(_model_type, "encoder.layers", **_WAVEFORM)

# transformers 5's AST: `layers` of blocks with q/k/v/o projections and an `mlp` of fc1/fc2.
register_family(
    "audio-spectrogram-transformer",
    "layers",
    query="attention.q_proj",
    key="attention.k_proj",
    value="attention.v_proj",
    attention_output="attention.o_proj",
    mlp_input=("mlp.fc1",),
    mlp_output="mlp.fc2",
    norms=("layernorm_before", "layernorm_after"),
)


def _conv_lengths(lengths: torch.Tensor, kernels, strides) -> torch.Tensor:
    for kernel, stride in zip(kernels, strides, strict=True):
        lengths = torch.div(lengths - kernel, stride, rounding_mode="floor") + 1
    return lengths


def frame_mask(model: nn.Module | None, mask: torch.Tensor | None, frames: int | None = None) -> torch.Tensor | None:
    """The attention mask at the positions of the hidden states: a waveform model's (B, samples) mask becomes
    (B, frames) (real frames are those the conv encoder computes from real samples only); any other mask, or one
    already that long, is returned as it is. `frames`: the hidden states' length (else computed from the mask's)."""
    config = getattr(model, "config", None)
    family = get_family(getattr(config, "model_type", None))
    if mask is None or family is None or family.frames_from_samples is None or mask.dim() != 2:
        return mask
    kernels, strides = (getattr(config, name) for name in family.frames_from_samples)
    total = frames if frames is not None else int(_conv_lengths(torch.tensor(mask.shape[1]), kernels, strides))
    if mask.shape[1] == total:
        return mask
    lengths = _conv_lengths(mask.long().sum(-1), kernels, strides).clamp_min(0)
    return torch.arange(total, device=mask.device)[None, :] < lengths[:, None]


def check_layerdrop(model: nn.Module, role: str) -> None:
    """Refuse a model whose blocks are tapped while LayerDrop may skip them in training (a skipped block has no
    output, so its term would be missing at random steps)."""
    config = getattr(model, "config", None)
    family = get_family(getattr(config, "model_type", None))
    field = family.layerdrop_field if family is not None else None
    if field and (getattr(config, field, 0.0) or 0.0) > 0 and model.training:
        raise ValueError(
            f"The {role} ({config.model_type}) has {field}={getattr(config, field)}: LayerDrop skips whole blocks in "
            f"training, so a distill term on its layers would miss them at random steps. Set {role}.config.{field} = "
            "0.0 (or build it with layerdrop=0.0)."
        )


SINGLE_LABEL_LOSS = ("wav2vec2", "hubert")
"""Audio classifiers whose own loss is single-label cross-entropy whatever `problem_type` says."""


def check_own_loss(model: nn.Module, labels: Any) -> None:
    """Refuse multi-hot labels for a wav2vec2 / HuBERT classifier computing its own task loss: it would flatten them
    into class indices (torch's batch-size error). BCE through `compute_loss_func`, or `task_weight=0`, is the way."""
    config = getattr(model, "config", None)
    multi = isinstance(labels, torch.Tensor) and labels.is_floating_point() and labels.dim() == 2
    if multi and getattr(config, "model_type", None) in SINGLE_LABEL_LOSS:
        raise ValueError(
            f"{type(model).__name__}'s own loss is single-label cross-entropy, but the labels are multi-hot "
            f"{tuple(labels.shape)}: pass compute_loss_func=lambda out, labels, num_items_in_batch=None: "
            "F.binary_cross_entropy_with_logits(out.logits, labels) to the trainer, or set task_weight=0."
        )


__all__ = ["SINGLE_LABEL_LOSS", "check_layerdrop", "check_own_loss", "frame_mask"]
