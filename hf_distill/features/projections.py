"""Trainable maps from the student's hidden width to the teacher's.

TinyBERT learns one `fit_dense` Linear shared by every layer it distils; per-layer maps are the other
common choice (DistillKit). Projections belong to the training run, not to the student: they are
optimised and checkpointed with it, and never saved into the student's folder.
"""

from __future__ import annotations

import torch
from torch import nn


class Projections(nn.Module):
    """A shared Linear, or one Linear per student layer, mapping student width to teacher width."""

    def __init__(self, student_dim: int, teacher_dim: int, kind: str, layers: list[int]) -> None:
        super().__init__()
        if kind not in ("shared", "per_layer"):
            raise ValueError(f"projection kind must be 'shared' or 'per_layer', got {kind!r}")
        self.kind = kind
        keys = ["shared"] if kind == "shared" else [f"layer_{i}" for i in sorted(set(layers))]
        self.maps = nn.ModuleDict({k: nn.Linear(student_dim, teacher_dim) for k in keys})
        for lin in self.maps.values():
            # BERT's initialiser, which TinyBERT's fit_dense also gets.
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        key = "shared" if self.kind == "shared" else f"layer_{layer}"
        return self.maps[key](x)
