"""Tiny random audio classifiers (wav2vec2, HuBERT, AST) and waveform batches, shared by the audio tests."""

from __future__ import annotations

import torch
from transformers import (
    ASTConfig,
    ASTForAudioClassification,
    HubertConfig,
    HubertForSequenceClassification,
    Wav2Vec2Config,
    Wav2Vec2ForSequenceClassification,
)

# 3 conv layers: kernels 10, 3, 3 and strides 5, 2, 2 -> one frame per 20 samples (1,600 samples: 79 frames)
_WAVEFORM = dict(conv_dim=(8, 8, 8), conv_kernel=(10, 3, 3), conv_stride=(5, 2, 2), num_conv_pos_embeddings=4,
                 num_conv_pos_embedding_groups=2, feat_extract_norm="layer", classifier_proj_size=8, layerdrop=0.0,
                 mask_time_prob=0.0, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                 feat_proj_dropout=0.0, final_dropout=0.0)


def wav2vec2(layers: int = 4, hidden: int = 16, heads: int = 4, labels: int = 3, seed: int = 0, **kw):
    torch.manual_seed(seed)
    config = Wav2Vec2Config(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            intermediate_size=2 * hidden, num_labels=labels, **{**_WAVEFORM, **kw})
    return Wav2Vec2ForSequenceClassification(config).eval()


def hubert(layers: int = 4, hidden: int = 16, heads: int = 4, labels: int = 3, seed: int = 0, **kw):
    torch.manual_seed(seed)
    config = HubertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                          intermediate_size=2 * hidden, num_labels=labels, **{**_WAVEFORM, **kw})
    return HubertForSequenceClassification(config).eval()


def ast(layers: int = 4, hidden: int = 16, heads: int = 4, labels: int = 3, seed: int = 0, **kw):
    """A 32-frame x 16-mel AST: patches 16 x 16 with stride 8 in time (3 patches) and 16 in frequency (1)."""
    torch.manual_seed(seed)
    config = ASTConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                       intermediate_size=2 * hidden, num_labels=labels, max_length=32, num_mel_bins=16,
                       time_stride=8, frequency_stride=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       **kw)
    return ASTForAudioClassification(config).eval()


BUILDERS = {"wav2vec2": wav2vec2, "hubert": hubert, "audio-spectrogram-transformer": ast}


def inputs(model, batch: int = 3, seed: int = 0, samples: int = 1600) -> dict[str, torch.Tensor]:
    """Model inputs of the right kind: padded waveforms with a sample-level mask, or an AST's spectrograms."""
    g = torch.Generator().manual_seed(seed)
    if model.config.model_type == "audio-spectrogram-transformer":
        return {"input_values": torch.randn(batch, model.config.max_length, model.config.num_mel_bins, generator=g)}
    values = torch.randn(batch, samples, generator=g)
    mask = torch.ones(batch, samples, dtype=torch.long)
    mask[-1, samples * 2 // 3:] = 0  # the last row is shorter: padding
    values[mask == 0] = 0.0
    return {"input_values": values, "attention_mask": mask}
