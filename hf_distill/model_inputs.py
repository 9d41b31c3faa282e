"""What a model's forward takes and the facts the distillation's checks read from a student.

Apart from the Distiller and its teacher side because both read them (the student's and the teachers' forward
arguments), and neither should import the other for it.
"""

from __future__ import annotations

import inspect

from torch import nn
from transformers import PreTrainedModel

from .features import heads as heads_mod
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


def _model_class(model: nn.Module) -> type:
    """The model's own class: FSDP2's `fully_shard` swaps it for a subclass `FSDP<Name>(FSDPModule, <Name>)`."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return type(model)
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


__all__ = ["forward_params", "student_shape"]
