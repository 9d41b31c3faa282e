"""hf_distill: knowledge distillation native to `transformers.Trainer`.

Swap `Trainer` for `DistillationTrainer` and `TrainingArguments` for `DistillationArguments` (`Seq2SeqTrainer` for
`DistillationSeq2SeqTrainer` and `Seq2SeqTrainingArguments` for `DistillationSeq2SeqArguments`; TRL's `SFTTrainer`
for `DistillationSFTTrainer` and `SFTConfig` for `DistillationSFTConfig`, with the `trl` extra; sentence-transformers'
`SentenceTransformerTrainer` for `DistillationSentenceTransformerTrainer`, with the `sentence` extra).
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
    "DistillationSFTConfig": "trl",  # needs the `trl` extra (ImportError naming it otherwise)
    "DistillationSFTTrainer": "trl",
    "DistillationSentenceTransformerArguments": "sentence",  # needs the `sentence` extra (#44)
    "DistillationSentenceTransformerTrainer": "sentence",
    "DistillationMixin": "trainer",
    "DistillationTrainer": "trainer",
    "Distiller": "distiller",
    "DistillTerm": "losses.terms",
    "TeacherOutputsCollator": "data.collators",
    "CrossTokenizerCollator": "data.cross_tokenizer",
    "PromptCompletionCollator": "data.prompts",
}
# Public modules reachable as attributes (`hf_distill.taps.unwrap`); each is imported by its own path
# (`hf_distill.features.taps`): the package installs no import hook.
_MODULES = {
    "families": "features.families",
    "layer_map": "features.layer_map",
    "losses": "losses",
    "presets": "presets",
    "students": "students",
    "taps": "features.taps",
}

__all__ = [
    "CrossTokenizerCollator",
    "DistillTerm",
    "DistillationArguments",
    "DistillationSeq2SeqArguments",
    "DistillationSeq2SeqTrainer",
    "DistillationSFTConfig",
    "DistillationSFTTrainer",
    "DistillationSentenceTransformerArguments",
    "DistillationSentenceTransformerTrainer",
    "DistillationMixin",
    "PromptCompletionCollator",
    "DistillationTrainer",
    "Distiller",
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
        value = importlib.import_module(f".{_MODULES[name]}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from . import losses, presets, students
    from .arguments import DistillationArguments
    from .data.collators import TeacherOutputsCollator
    from .data.cross_tokenizer import CrossTokenizerCollator
    from .data.prompts import PromptCompletionCollator
    from .distiller import Distiller
    from .features import families, layer_map, taps
    from .losses.terms import DistillTerm
    from .sentence import DistillationSentenceTransformerArguments, DistillationSentenceTransformerTrainer
    from .seq2seq import DistillationSeq2SeqArguments, DistillationSeq2SeqTrainer
    from .trainer import DistillationMixin, DistillationTrainer
    from .trl import DistillationSFTConfig, DistillationSFTTrainer
