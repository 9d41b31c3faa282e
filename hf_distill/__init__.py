"""hf_distill: knowledge distillation native to `transformers.Trainer`.

Swap `Trainer` for `DistillationTrainer` and `TrainingArguments` for `DistillationArguments`.
"""

from . import families, layer_map, losses, presets, students, taps
from .arguments import DistillationArguments
from .collators import TeacherOutputsCollator
from .terms import DistillTerm
from .trainer import DistillationTrainer

__version__ = "0.1.0.dev0"

__all__ = [
    "DistillTerm",
    "DistillationArguments",
    "DistillationTrainer",
    "TeacherOutputsCollator",
    "families",
    "layer_map",
    "losses",
    "presets",
    "students",
    "taps",
]
