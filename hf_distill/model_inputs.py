"""What a model's forward takes and the facts the distillation's checks read from a student.

Apart from the Distiller and its teacher side because both read them (the student's and the teachers' forward
arguments), and neither should import the other for it.
"""

from __future__ import annotations

import dataclasses
import inspect

from torch import nn
from transformers import PreTrainedModel

from .features import heads as heads_mod
from .features.heads import Head, static_head
from .features.taps import unwrap


def forward_params(model: nn.Module | None) -> set[str]:
    """The inputs a forward names. transformers forwards also take **kwargs (attention backend options),
    so they only get what they name; a plain module whose forward takes **kwargs gets everything."""
    if model is None:
        return set()
    inner = unwrap(model)
    params = inspect.signature(inner.forward).parameters
    names = set(params)
    if not isinstance(inner, PreTrainedModel) and any(p.kind == p.VAR_KEYWORD for p in params.values()):
        names.add("**")
    return names


def student_shape(model: nn.Module) -> tuple[str, int | None, int | None]:
    """The facts the trainer's checks read from the student: its class (hence head), vocabulary and label count."""
    inner = unwrap(model)
    vocab = getattr(getattr(inner, "config", None), "vocab_size", None)
    return _model_class(inner).__name__, vocab, heads_mod.num_labels(inner)


@dataclasses.dataclass
class StudentState:
    """What the Distiller's loss reads from one student model, resolved once per model (the Trainer may swap, wrap
    or compile the student after set-up)."""

    inner: nn.Module  # unwrapped: no compile, DDP/engine or PEFT wrapper
    params: set[str]  # the inputs its forward names
    head: Head | None = None
    rebuilds: bool | None = None  # its logits are rebuilt exactly from its hidden states (checked on first use)
    paths: dict = dataclasses.field(default_factory=dict)  # its KD path per (teacher form, training pass)

    def __post_init__(self) -> None:
        self.head = static_head(self.inner)

    def accepts(self, name: str) -> bool:
        return name in self.params or "**" in self.params


def check_same_kind(model: nn.Module, validated: tuple[str, int | None, int | None]) -> None:
    """Refuse a model of another kind or shape (class, vocabulary, labels) than the one the run was validated
    against (`student_shape`)."""
    shape = student_shape(model)
    if shape != validated:
        raise ValueError(
            f"The model to train ({type(unwrap(model)).__name__}: {_describe(shape)}) is not the kind of model this "
            f"trainer was built with and validated against ({_describe(validated)}). model_init must "
            "return students with one head, vocabulary and label set; build one trainer per kind of student."
        )


def _describe(shape: tuple[str, int | None, int | None]) -> str:
    name, vocab, labels = shape
    return f"{name}, vocabulary {vocab}, {labels} labels"


def _model_class(model: nn.Module) -> type:
    """The model's own class: FSDP2's `fully_shard` swaps it for a subclass `FSDP<Name>(FSDPModule, <Name>)`."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return type(model)
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


__all__ = ["StudentState", "check_same_kind", "forward_params", "student_shape"]
