"""What is read from the models: output heads (`heads`), hidden states, attention scores and Q/K/V (`taps`, driven
by the per-architecture registry in `families`), which teacher layer each student layer learns from
(`layer_map`), and the trainable maps between their widths (`projections`)."""

from . import (
    families_audio,  # noqa: F401  (registers wav2vec2, HuBERT and AST with the families registry)
    families_vision,  # noqa: E402,F401  (registers ViT, DeiT, BEiT, Swin, ConvNeXt, ResNet: issue #43)
)
