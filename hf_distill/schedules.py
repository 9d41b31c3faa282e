"""Loss fields a callback may change while training, and schedules of them over training progress.

Callbacks change the loss through the run's settings (hf_distill.settings.DistillSettings), which a
`DistillationTrainer` passes to every callback event as the keyword `distill_settings`: `temperature`, `kd_loss`,
`kd_weight`, `task_weight` and the `weight` of each entry of `distill_terms` (`term:<name>`). The arguments
themselves are validated once and not changed. :func:`get_loss_field` / :func:`set_loss_field` read and write them
with the checks `DistillationArguments` makes; :class:`ScheduleCallback` drives them by linear or cosine
:class:`Schedule`s (`global_step / max_steps`, the convention of transformers' learning-rate schedules: the value
used by step `k` is the schedule at `(k - 1) / max_steps`). Multi-stage runs
(:class:`hf_distill.callbacks.StageSwitchCallback`) build on the same pieces; both callbacks are importable from
`hf_distill.callbacks`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .settings import SCALAR_FIELDS, TERM_PREFIX, DistillSettings

SCHEDULE_KINDS = ("linear", "cosine")


# ---------------------------------------------------------------------- reading and writing loss fields


def get_loss_field(settings: DistillSettings, name: str) -> Any:
    """The current value of `temperature`, `kd_loss`, `kd_weight`, `task_weight` or `term:<name>` (a weight)."""
    return _checked(settings).get(name)


def set_loss_field(settings: DistillSettings, name: str, value: Any) -> None:
    """Set one loss field of the run's settings, with the checks `DistillationArguments` makes when built."""
    _checked(settings).set(name, value)


def run_settings(kwargs: Mapping[str, Any], who: str) -> DistillSettings:
    """The `distill_settings` a DistillationTrainer passes to callback events; refused without one."""
    settings = kwargs.get("distill_settings")
    if settings is None:
        raise ValueError(f"{who} changes the distillation loss, so it needs a DistillationTrainer (or a trainer with "
                         "DistillationMixin), which passes the run's distill_settings to its callbacks.")
    return settings


def _checked(settings: Any) -> DistillSettings:
    if not isinstance(settings, DistillSettings):
        raise TypeError(f"Loss fields are read and set on the run's settings (trainer.settings, a "
                        f"DistillSettings), not on {type(settings).__name__}: the arguments are not changed.")
    return settings


def _log_key(name: str) -> str:
    return f"weight_{name[len(TERM_PREFIX):]}" if name.startswith(TERM_PREFIX) else name


# ---------------------------------------------------------------------- schedules


@dataclass
class Schedule:
    """A value going from `start` to `end` as progress goes from 0 to 1: linearly, or along a half cosine
    (`end + (start - end) * (1 + cos(pi * progress)) / 2`, the shape of SGDR / transformers' cosine LR)."""

    start: float
    end: float
    kind: str = "linear"

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULE_KINDS:
            raise ValueError(f"Schedule kind {self.kind!r} is unknown. Known: {', '.join(SCHEDULE_KINDS)}.")
        self.start, self.end = float(self.start), float(self.end)

    def value(self, progress: float) -> float:
        progress = min(max(progress, 0.0), 1.0)
        if self.kind == "linear":
            return self.start + (self.end - self.start) * progress
        return self.end + (self.start - self.end) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _schedule(value: Any) -> Schedule:
    return value if isinstance(value, Schedule) else Schedule(**value)


def _progress(step: int, start: int, end: int) -> float:
    return (step - start) / max(end - start, 1)


class ScheduleCallback(TrainerCallback, ExportableState):
    """Drive loss fields by schedules over the whole run.

    `schedules` maps a field (`temperature`, `kd_weight`, `task_weight`, or `term:<name>` for the weight of
    the `distill_terms` entry called `<name>`) to a `Schedule` or its dict, e.g.
    `ScheduleCallback({"temperature": Schedule(4.0, 1.0, "cosine"), "term:hidden": {"start": 1, "end": 0}})`.
    The value for the coming step is set in `on_step_begin` from `state.global_step / state.max_steps`.
    Annealing the temperature follows e.g. Jafari et al. 2021 (Annealing KD); the schedule shapes are the
    usual linear and cosine ones. Drive each field from one callback only.
    """

    def __init__(self, schedules: Mapping[str, Schedule | Mapping[str, Any]]) -> None:
        self.schedules = {name: _schedule(s) for name, s in schedules.items()}
        for name in self.schedules:
            if name not in SCALAR_FIELDS and not name.startswith(TERM_PREFIX):
                raise ValueError(f"Cannot schedule {name!r}: use {', '.join(SCALAR_FIELDS)} or term:<name>.")
        self.values: dict[str, float] = {}

    def values_at(self, step: int, max_steps: int) -> dict[str, float]:
        return {name: s.value(_progress(step, 0, max_steps)) for name, s in self.schedules.items()}

    def _apply(self, state, kwargs) -> None:
        settings = run_settings(kwargs, type(self).__name__)
        self.values = self.values_at(state.global_step, state.max_steps)
        for name, value in self.values.items():
            set_loss_field(settings, name, value)

    def on_train_begin(self, args, state, control, **kwargs):
        self._apply(state, kwargs)

    def on_step_begin(self, args, state, control, **kwargs):
        self._apply(state, kwargs)

    def distill_log_values(self) -> dict[str, float]:
        return {_log_key(n): v for n, v in self.values.items()}

    def state(self) -> dict:
        return {"args": {"schedules": {n: s.to_dict() for n, s in self.schedules.items()}}, "attributes": {}}
