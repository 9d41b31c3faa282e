"""Students of a SentenceTransformer teacher: the teacher's modules (tokenizer, Pooling, Dense, Normalize, prompts,
similarity function) around a student transformer built from the teacher's (`from_teacher`, `shrink`), so that the
student embeds exactly as the teacher does, with fewer or narrower blocks. No sentence-transformers import: the
teacher is recognised by its class name and the transformer is built by the function `build.py` hands in."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from torch import nn


def is_sentence_transformer(model: Any) -> bool:
    """A sentence-transformers model (SentenceTransformer or a subclass), whose first module wraps a transformer."""
    return any(cls.__name__ == "SentenceTransformer" for cls in type(model).__mro__)


def rebuild(teacher: nn.Module, build: Callable[[nn.Module], nn.Module], width: int | None = None) -> nn.Module:
    """A copy of `teacher` whose transformer is `build(teacher's transformer)` (of hidden size `width`, None: the
    teacher's): every other module is copied as it is (the teacher's transformer is not copied first), Pooling
    follows a new width; a module that holds weights of the old width (Dense) with a new width is refused, before
    anything is built."""
    first = teacher[0]
    auto = getattr(first, "auto_model", None)
    if auto is None:
        raise ValueError(f"The teacher's first module ({type(first).__name__}) wraps no transformers model, so "
                         "hf_distill.students cannot build its transformer: build the student yourself.")
    old = auto.config.hidden_size
    _check_width(teacher, old, old if width is None else width)
    student_auto = build(auto)
    new = student_auto.config.hidden_size
    _check_width(teacher, old, new)  # a builder whose width differs from `width`: still refused, before the copy
    student = copy.deepcopy(teacher, memo={id(auto): student_auto})
    student_auto.to(next(auto.parameters()).device)
    if old != new:
        for module in student:
            if type(module).__name__ == "Pooling":
                module.pooling_output_dimension = module.pooling_output_dimension // module.embedding_dimension * new
                module.embedding_dimension = new
    student.train(teacher.training)
    return student


def _check_width(teacher: nn.Module, old: int, new: int) -> None:
    fixed = [type(m).__name__ for m in list(teacher)[1:] if type(m).__name__ not in ("Pooling", "Normalize")]
    if old != new and fixed:
        raise ValueError(f"The teacher has {', '.join(fixed)} after its transformer, whose weights expect width "
                         f"{old}; the student is {new} wide. Keep hidden_size={old}, or build the student "
                         "without those modules.")
