"""What every KD path shares: the context it reads (:class:`PathContext`), the batch it gets (:class:`PathBatch`),
the interface it implements (:class:`KDPath`) and the registry the Distiller chooses from (:func:`register_path`)."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from ..data.audio import teacher_own_inputs
from ..features.heads import Head
from ..task_loss import TaskLoss
from ..teacher import check_padding_mass, padding_mass
from ..teacher_sources import TeacherOutputs, TeacherRequest, TeacherSide


class PaddingCheck:
    """Once per teacher with more vocabulary ids than the student: its mean probability on the extra ids over the
    first distilled batch's counted positions, refused above the bound (teacher.check_padding_mass)."""

    def __init__(self, shared_vocab: int | None) -> None:
        self.shared_vocab = shared_vocab
        self.checked: set[int] = set()  # teachers whose extra vocabulary ids were measured

    def __call__(self, i: int, parts) -> None:
        """`parts` yields that batch's (n, V) teacher logits at the counted positions."""
        if i in self.checked:
            return
        total, count, vocab = 0.0, 0, None
        for rows in parts:
            vocab = rows.shape[-1]
            if vocab <= self.shared_vocab:  # this teacher has no ids the student lacks
                self.checked.add(i)
                return
            if len(rows):
                total, count = total + padding_mass(rows, self.shared_vocab) * len(rows), count + len(rows)
        if count:  # (a batch without a distilled position leaves the check to the next one)
            check_padding_mass(total / count, self.shared_vocab, vocab)
            self.checked.add(i)


@dataclasses.dataclass
class PathContext:
    """What the KD paths read of one distillation, set once by the Distiller (`settings` is read at each call:
    callbacks change kd_loss, temperature and the weights while training). `route` is how the loss head calls the
    LM heads (the trainer sets it per call); `accelerator` gives autocast, processes and the engine."""

    args: Any
    settings: Any
    head: Head | None
    teacher_side: TeacherSide
    teacher_weights: list[float]
    task: TaskLoss
    shared_vocab: int | None
    cross_vocab: Any
    accelerator: Any
    route: str = "auto"
    chunk: int | None = None  # the loss head's tokens per chunk (None: whole logits), set once before training
    padding: PaddingCheck = dataclasses.field(init=False)
    teacher_rebuilds: bool = False  # the teacher's logits were shown rebuilt from its hidden states (checked once)

    def __post_init__(self) -> None:
        self.padding = PaddingCheck(self.shared_vocab)

    @property
    def teachers(self) -> list[nn.Module]:
        return self.teacher_side.models.teachers

    @property
    def label_name(self) -> str:
        return self.task.label_name


@dataclasses.dataclass
class PathBatch:
    """One batch as a KD path sees it, after the teacher and the student ran: `model` as the Trainer prepared it,
    `inner` unwrapped, `head` the student's head at run time, `task` computes the task loss from `outputs` (whole-
    logit paths), `want_task` whether a task term is asked for."""

    model: nn.Module
    inner: nn.Module
    outputs: Any
    head: Head
    teacher: TeacherOutputs | None
    inputs: dict[str, Any]
    cached: dict[str, torch.Tensor]
    want_task: bool
    task: Callable[[], torch.Tensor]
    # the factor the loss puts on each token-level term's mean ("kd", "labels"; a step-mean share), where known
    scales: dict[str, float] = dataclasses.field(default_factory=dict)


class KDPath(abc.ABC):
    """One way the KD loss is computed. Subclasses set `name` and `priority` (the registry tries higher first),
    say when they apply (`applies`: from the context, the teacher's logits form, whether this is a training pass
    with the teacher), check the model once (`bind`: False hands the batch to the next path), say what they ask of
    the teacher (`request`, `teacher_inputs`) and of the student (`whole_logits`), and compute `(kd, task)`."""

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0
    whole_logits: ClassVar[bool] = True  # the student's forward computes its logits (else its hidden states)
    request: ClassVar[TeacherRequest] = TeacherRequest()

    def __init__(self, ctx: PathContext) -> None:
        self.ctx = ctx

    @classmethod
    @abc.abstractmethod
    def applies(cls, ctx: PathContext, form: str | None, training: bool) -> bool:
        """Whether this path computes the KD loss for this context, teacher form and pass."""

    def bind(self, state: Any, model: nn.Module) -> bool:
        """Check the model this path will run on (`model` as the Trainer prepared it, `state` the Distiller's view
        of it: `inner`, `rebuilds`), once per model."""
        return True

    def teacher_inputs(self, inputs: dict[str, Any], cached: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The batch the teacher reads (its own tokenization, for a cross-tokenizer path; its own input_values or
        pixel_values where the collator made them, hf_distill.data.audio)."""
        return teacher_own_inputs(inputs, cached)

    def student_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return kwargs

    @abc.abstractmethod
    def loss(self, batch: PathBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`(kd, task)` of one batch (either may be None: not computed here)."""


PATHS: list[type[KDPath]] = []
"""The registered paths, highest priority first (:func:`register_path`)."""


def register_path(cls: type[KDPath]) -> type[KDPath]:
    """Add a KD path to the registry (a class decorator); a name is registered once."""
    if not cls.name or any(p.name == cls.name for p in PATHS):
        raise ValueError(f"A KD path needs a name of its own: {cls.name!r} is empty or registered already.")
    PATHS.append(cls)
    PATHS.sort(key=lambda p: -p.priority)
    return cls


def shift(t):
    """Causal-LM teacher logits (dense or a tuple form) without their last position, aligned with the student's."""
    return tuple(x[:, :-1] for x in t) if isinstance(t, tuple) else t[:, :-1]


__all__ = ["PATHS", "KDPath", "PaddingCheck", "PathBatch", "PathContext", "register_path", "shift"]
