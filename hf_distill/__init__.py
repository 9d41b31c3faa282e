"""hf_distill: knowledge distillation native to `transformers.Trainer`.

Swap `Trainer` for `DistillationTrainer` and `TrainingArguments` for `DistillationArguments` (`Seq2SeqTrainer` for
`DistillationSeq2SeqTrainer` and `Seq2SeqTrainingArguments` for `DistillationSeq2SeqArguments`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0.dev0"

# Loaded on first use, so `hf-distill --help` and other light imports of the package do not pay the
# seconds torch and transformers take to import.
_CLASSES = {
    "DistillationArguments": "arguments",
    "DistillationSeq2SeqArguments": "seq2seq",
    "DistillationSeq2SeqTrainer": "seq2seq",
    "DistillationTrainer": "trainer",
    "DistillTerm": "terms",
    "TeacherOutputsCollator": "collators",
}
_MODULES = ("families", "layer_map", "losses", "presets", "students", "taps")

__all__ = [
    "DistillTerm",
    "DistillationArguments",
    "DistillationSeq2SeqArguments",
    "DistillationSeq2SeqTrainer",
    "DistillationTrainer",
    "TeacherOutputsCollator",
    "families",
    "layer_map",
    "losses",
    "presets",
    "students",
    "taps",
]


def __getattr__(name: str) -> Any:
    if name in _CLASSES:
        value = getattr(importlib.import_module(f".{_CLASSES[name]}", __name__), name)
    elif name in _MODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from . import families, layer_map, losses, presets, students, taps
    from .arguments import DistillationArguments
    from .collators import TeacherOutputsCollator
    from .seq2seq import DistillationSeq2SeqArguments, DistillationSeq2SeqTrainer
    from .terms import DistillTerm
    from .trainer import DistillationTrainer
