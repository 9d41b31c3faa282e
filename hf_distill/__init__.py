"""hf_distill: knowledge distillation native to `transformers.Trainer`.

Swap `Trainer` for `DistillationTrainer` and `TrainingArguments` for `DistillationArguments` (`Seq2SeqTrainer` for
`DistillationSeq2SeqTrainer` and `Seq2SeqTrainingArguments` for `DistillationSeq2SeqArguments`; TRL's `SFTTrainer`
for `DistillationSFTTrainer` and `SFTConfig` for `DistillationSFTConfig`, with the `trl` extra).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
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
    "DistillationMixin": "trainer",
    "DistillationTrainer": "trainer",
    "Distiller": "distiller",
    "DistillTerm": "losses.terms",
    "TeacherOutputsCollator": "data.collators",
    "CrossTokenizerCollator": "data.cross_tokenizer",
    "PromptCompletionCollator": "data.prompts",
}
_MODULES = ("families", "layer_map", "losses", "presets", "students", "taps")
# Modules that moved into the concern packages (docs/design.md, "Where things are"): their old import paths keep
# working (`import hf_distill.cache`, `from hf_distill.chunked import ...`) and name the same module object.
MOVED = {
    "augment": "data.augment",
    "bilstm": "students.bilstm",
    "cache": "data.cache",
    "card": "publish.card",
    "chunked": "losses.chunked",
    "collators": "data.collators",
    "early_exit": "students.early_exit",
    "families": "features.families",
    "heads": "features.heads",
    "hub": "publish.hub",
    "intermediate": "losses.intermediate",
    "layer_map": "features.layer_map",
    "measure": "publish.measure",
    "normalise": "losses.normalise",
    "plots": "publish.plots",
    "progressive": "students.progressive",
    "projections": "features.projections",
    "report": "publish.report",
    "tang_augment": "data.tang_augment",
    "taps": "features.taps",
    "terms": "losses.terms",
    "triton_head": "losses.triton_head",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old module path to the moved module itself (one module object under both names)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        prefix, _, name = fullname.partition(".")
        if prefix == __name__ and name in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        # The import system returns whatever sys.modules holds for the name once this returns.
        sys.modules[module.__name__] = importlib.import_module(f"{__name__}.{MOVED[module.__name__.partition('.')[2]]}")


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())

__all__ = [
    "CrossTokenizerCollator",
    "DistillTerm",
    "DistillationArguments",
    "DistillationSeq2SeqArguments",
    "DistillationSeq2SeqTrainer",
    "DistillationSFTConfig",
    "DistillationSFTTrainer",
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
    elif name in _MODULES or name in MOVED:
        value = importlib.import_module(f".{name}", __name__)
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
    from .seq2seq import DistillationSeq2SeqArguments, DistillationSeq2SeqTrainer
    from .trainer import DistillationMixin, DistillationTrainer
    from .trl import DistillationSFTConfig, DistillationSFTTrainer
