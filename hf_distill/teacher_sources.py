"""The teacher side of a `Distiller`: one typed result per batch (:class:`TeacherOutputs`), whatever produced it.

Sources, asked in order, the first that holds what the KD path asks for answering:

- :class:`CachedColumns`: the batch's `teacher_*` columns (whole or top-k logits cached by hf_distill.data.cache,
  an offline top-k + tail signal from hf_distill.data.teacher_signal, cached hidden states for the intermediate
  terms);
- :class:`LocalTeachers`: teacher models run on the student's batch, without gradients, under the student's
  autocast, on the teachers' own devices.

:class:`TeacherSide` composes them. A KD path (hf_distill.kd_paths) says what it asks (:class:`TeacherRequest`: the
logits, or the last hidden state when the teacher must run) and reads the result's `form` rather than the shape of a
tensor or tuple. A new source (a teacher behind a URL, a file of embeddings) is one more class with `logits` (and,
where it has them, `features`), put into the `TeacherSide`'s list.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from torch import nn

from .data.cache import LOGITS_COLUMN, TOPK_INDICES_COLUMN, TOPK_VALUES_COLUMN
from .data.teacher_signal import SIGNAL_CODES, SIGNAL_TOPK, signal_teacher
from .features.heads import Head, head_logits
from .features.taps import forward
from .losses import chunked
from .losses.teacher_forms import DenseLogits, TopK, TopKTail
from .model_inputs import forward_params
from .placement import send_teacher_outputs, teacher_input_device
from .teacher import shared_base_teacher

DENSE, TOPK, SIGNAL, MODEL = DenseLogits.form, TopK.form, TopKTail.form, "model"
"""The forms of a teacher's logits, tagged as the losses tag them (hf_distill.losses.teacher_forms): whole logits, a
cached top-k `(values, indices)` pair, an offline signal's `(log_probs, indices, log_tail)` triple; `model`: none
cached, the teacher model runs (its logits, or its last hidden state for the loss head)."""


@dataclasses.dataclass
class TeacherLogits:
    """One teacher's logits for one batch: `views` holds one entry per compared output (QA: start and end), each a
    tensor (`dense`) or the tuple its `form` names."""

    form: str
    views: list


@dataclasses.dataclass
class TeacherOutputs:
    """What the teachers give one batch: logits per teacher (none when kd_weight is 0), the first one's features for
    the intermediate terms, and its last hidden state when the KD path asked for it (the causal-LM loss head)."""

    logits: list[TeacherLogits]
    features: Any
    hidden: torch.Tensor | None

    @property
    def views(self) -> list[list]:
        """Every teacher's logit views (entries: a tensor, or a tuple of the teacher's form)."""
        return [t.views for t in self.logits]


@dataclasses.dataclass(frozen=True)
class TeacherRequest:
    """What a KD path asks of the teacher: with `hidden`, the first teacher's last hidden state instead of its logits
    when the teacher model runs (cached logits are still given as they are)."""

    hidden: bool = False


def autocast(accelerator: Any):
    """The autocast accelerate runs the student's forward in (mixed precision), for what hf_distill computes
    outside that forward from the same tensors: the teacher, the LM heads of the loss head. None without one."""
    return accelerator.autocast() if accelerator is not None else contextlib.nullcontext()


class CachedColumns:
    """Teacher outputs the batch carries as `teacher_*` columns. `settings` is read at each call (kd_loss,
    kd_token_mask), `label_name` is the token labels' key, `intermediate` reads its cached hidden states."""

    def __init__(self, settings: Any, label_name: str, intermediate: Any = None) -> None:
        self.settings, self.label_name, self.intermediate = settings, label_name, intermediate

    def logits(self, cached: dict[str, torch.Tensor], inputs: dict[str, Any], i: int = 0) -> TeacherLogits | None:
        """Teacher i's logits from the columns, or None where they do not hold them (or not in a form kd_loss
        takes: `mse` compares whole logits only)."""
        if i > 0:
            column = f"{LOGITS_COLUMN}_{i}"
            return TeacherLogits(DENSE, [cached[column]]) if column in cached else None
        if LOGITS_COLUMN in cached:
            return TeacherLogits(DENSE, [cached[LOGITS_COLUMN]])
        if self.settings.kd_loss != "mse" and TOPK_VALUES_COLUMN in cached:
            return TeacherLogits(TOPK, [(cached[TOPK_VALUES_COLUMN], cached[TOPK_INDICES_COLUMN])])
        if self.settings.kd_loss != "mse" and (SIGNAL_TOPK in cached or SIGNAL_CODES in cached):  # teacher_signal
            triple = signal_teacher(cached, inputs, self.label_name, self.settings.kd_token_mask)
            return TeacherLogits(SIGNAL, [triple])
        return None

    def features(self, cached: dict[str, torch.Tensor]) -> Any:
        return self.intermediate.cached_features(cached) if self.intermediate is not None else None


class LocalTeachers:
    """Teacher models, frozen and placed (hf_distill.placement), run on the student's batch. With `shared_base` the
    first teacher is the student's own PEFT base, run with its adapters off."""

    def __init__(self, teachers: list[nn.Module], shared_base: bool, label_names: list[str], head: Head | None,
                 accelerator: Any) -> None:
        self.teachers, self.shared_base, self.accelerator = teachers, shared_base, accelerator
        self.label_names, self.head = label_names, head
        self.params = forward_params(teachers[0]) if teachers else set()

    def run(self, teacher: nn.Module, inputs: dict[str, Any], taps=None, labels: bool = False,
            hidden_only: bool = False):
        """One teacher forward on the student's batch: only the inputs its forward names, without gradients, under
        the student's autocast, on the teacher's devices; returns (outputs, features)."""
        label_names = set(self.label_names) | {"labels"}
        t_kwargs = {k: v for k, v in inputs.items() if (labels or k not in label_names) and k in self.params}
        if hidden_only:
            t_kwargs = chunked.hidden_only_kwargs(t_kwargs)
        shared = self.shared_base and teacher is self.teachers[0]
        # A teacher loaded with device_map or quantised stays where its loader put it (hf_distill.placement):
        # its inputs go to its first device, its outputs come back to the student's.
        device = teacher_input_device(teacher)
        if device is not None:
            student_device = next((v.device for v in t_kwargs.values() if isinstance(v, torch.Tensor)), device)
            t_kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in t_kwargs.items()}
        # Same autocast as the student (accelerate only wraps the model it prepared), no autograd: plain
        # no_grad, not inference_mode, so the losses may save teacher tensors for backward.
        with torch.no_grad(), autocast(self.accelerator), contextlib.ExitStack() as stack:
            if shared:
                teacher = stack.enter_context(shared_base_teacher(teacher))
            outputs = forward(teacher, t_kwargs, taps)
        return outputs if device is None else send_teacher_outputs(outputs, student_device)

    def views(self, outputs: Any) -> list:
        """A teacher's logit views (one per compared output, hf_distill.features.heads)."""
        return head_logits(outputs, self.head or Head.SEQUENCE)


class TeacherSide:
    """The Distiller's teachers as one object: cached columns first, else the teacher models. `settings` is read at
    each call (kd_weight, kd_loss)."""

    def __init__(self, columns: CachedColumns, models: LocalTeachers, settings: Any, intermediate: Any = None,
                 served: dict[int, Any] | None = None) -> None:
        self.columns, self.models, self.settings, self.intermediate = columns, models, settings, intermediate
        # Teachers behind a URL by their place among all teachers (hf_distill.serving.source.ServedTeacher: its
        # `logits(inputs)` is a top-k + tail triple); the local models fill the other places, in order.
        self.served = dict(served or {})

    @property
    def count(self) -> int:
        """Every teacher: local models and served ones."""
        return len(self.models.teachers) + len(self.served)

    @property
    def teacher(self) -> nn.Module | None:
        return self.models.teachers[0] if self.models.teachers else None

    def form(self, cached: dict[str, torch.Tensor]) -> str | None:
        """The form the first teacher's logits come in for a batch with these columns (None when no logits are
        distilled); a cached top-k pair is `topk` whatever else the batch holds (whole logits are compared)."""
        if TOPK_VALUES_COLUMN in cached:
            return TOPK
        if self.settings.kd_weight <= 0:
            return None
        if 0 in self.served:  # a served first teacher gives the offline signal's form
            return SIGNAL
        if LOGITS_COLUMN in cached:
            return DENSE
        if self.settings.kd_loss != "mse" and (SIGNAL_TOPK in cached or SIGNAL_CODES in cached):
            return SIGNAL
        return MODEL

    def outputs(self, inputs: dict[str, Any], cached: dict[str, torch.Tensor],
                request: TeacherRequest = TeacherRequest()) -> TeacherOutputs:
        """Every teacher's logits and the first one's features, from the batch's columns when they hold them, else
        a forward; with `request.hidden` the first teacher's last hidden state instead of its logits when it runs."""
        if self.served:
            return self._with_served(inputs, cached, request)
        first, feats, hidden = self._first(inputs, cached, request.hidden)
        if self.settings.kd_weight <= 0:
            return TeacherOutputs([], feats, hidden)
        extra = [self._extra(i, inputs, cached) for i in range(1, len(self.models.teachers))]
        return TeacherOutputs([first, *extra], feats, hidden)

    def _with_served(self, inputs: dict[str, Any], cached: dict[str, torch.Tensor],
                     request: TeacherRequest) -> TeacherOutputs:
        """Every teacher in its place: a served one's top-k + tail, the local models' logits (the first local model
        gives the features and, when asked, its last hidden state)."""
        logits, feats, hidden, local = [], None, None, 0
        want = self.settings.kd_weight > 0
        for place in range(self.count):
            if place in self.served:
                if want:
                    logits.append(TeacherLogits(SIGNAL, [self.served[place].logits(inputs)]))
                continue
            if local == 0:
                first, feats, hidden = self._first(inputs, cached, request.hidden)
                logits.append(first)
            elif want:
                logits.append(self._extra(local, inputs, cached))
            local += 1
        return TeacherOutputs(logits if want else [], feats, hidden)

    def _first(self, inputs: dict[str, Any], cached: dict[str, torch.Tensor], hidden_only: bool):
        t_logits = self.columns.logits(cached, inputs, 0)
        t_feats = self.columns.features(cached)
        need_logits = self.settings.kd_weight > 0 and t_logits is None
        need_features = self.intermediate is not None and t_feats is None
        if not (need_logits or need_features):  # everything cached (or nothing needed): no teacher forward
            return t_logits if t_logits is not None else TeacherLogits(DENSE, [None]), t_feats, None
        if self.teacher is None:
            raise ValueError(
                "This batch lacks cached teacher outputs the losses need (teacher_logits or top-k columns, "
                "teacher_hidden_<i>) and no teacher_model was given."
            )
        taps = self.intermediate.teacher_taps if need_features else None
        hidden_only = hidden_only and need_logits
        t_out, t_feats = self.models.run(self.teacher, inputs, taps, hidden_only=hidden_only)
        if hidden_only:
            return TeacherLogits(MODEL, [None]), t_feats, chunked.last_hidden(t_out)
        if t_logits is not None:
            return t_logits, t_feats, None
        views = self.models.views(t_out) if self.settings.kd_weight > 0 else [None]
        return TeacherLogits(DENSE, views), t_feats, None

    def _extra(self, i: int, inputs: dict[str, Any], cached: dict[str, torch.Tensor]) -> TeacherLogits:
        """Logits of teacher i >= 1: its cached column `teacher_logits_<i>` if present, else a forward."""
        given = self.columns.logits(cached, inputs, i)
        if given is not None:
            return given
        return TeacherLogits(DENSE, self.models.views(self.models.run(self.models.teachers[i], inputs)[0]))


__all__ = ["CachedColumns", "LocalTeachers", "TeacherLogits", "TeacherOutputs", "TeacherRequest", "TeacherSide",
           "autocast"]
