"""Loss fields a callback may change while training, and schedules of them over training progress.

Callbacks change the loss through the one object the trainer re-reads at every step, the `DistillationArguments`
they receive as `args`: `temperature`, `kd_loss`, `kd_weight`, `task_weight` and the `weight` of each entry of
`distill_terms` (`term:<name>`). :func:`get_loss_field` / :func:`set_loss_field` read and write them with the
checks `DistillationArguments` makes; :class:`ScheduleCallback` drives them by linear or cosine :class:`Schedule`s
(`global_step / max_steps`, the convention of transformers' learning-rate schedules: the value used by step `k` is
the schedule at `(k - 1) / max_steps`). Multi-stage runs (:class:`hf_distill.callbacks.StageSwitchCallback`) build
on the same pieces; both callbacks are importable from `hf_distill.callbacks`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .arguments import KD_LOSS_KINDS
from .losses.terms import parse_terms

SCALAR_FIELDS = ("temperature", "kd_weight", "task_weight")
TERM_PREFIX = "term:"
SCHEDULE_KINDS = ("linear", "cosine")


# ---------------------------------------------------------------------- reading and writing loss fields


def get_loss_field(args: Any, name: str) -> Any:
    """The current value of `temperature`, `kd_loss`, `kd_weight`, `task_weight` or `term:<name>` (a weight)."""
    if name.startswith(TERM_PREFIX):
        return _term_entry(args, name[len(TERM_PREFIX) :])["weight"]
    if name not in (*SCALAR_FIELDS, "kd_loss"):
        raise ValueError(f"Unknown loss field {name!r}. Known: {', '.join(SCALAR_FIELDS)}, kd_loss, term:<name>.")
    return getattr(args, name)


def set_loss_field(args: Any, name: str, value: Any) -> None:
    """Set one loss field on `args` in place, with the checks `DistillationArguments` makes when built."""
    if name == "kd_loss":
        if value not in KD_LOSS_KINDS:
            raise ValueError(f"kd_loss={value!r} is unknown. Known: {', '.join(KD_LOSS_KINDS)}.")
        args.kd_loss = value
        return
    value = float(value)
    if name == "temperature" and not value > 0:
        raise ValueError(f"temperature must be > 0, got {value}.")
    if name != "temperature" and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}.")
    if name.startswith(TERM_PREFIX):
        _term_entry(args, name[len(TERM_PREFIX) :])["weight"] = value
    elif name in SCALAR_FIELDS:
        setattr(args, name, value)
    else:
        raise ValueError(f"Unknown loss field {name!r}. Known: {', '.join(SCALAR_FIELDS)}, kd_loss, term:<name>.")


def _term_entry(args: Any, term: str) -> dict:
    # DistillationArguments stores terms as plain dicts (normalised in __post_init__); keep them that way.
    specs = args.distill_terms or []
    if not all(isinstance(s, dict) for s in specs):
        specs = args.distill_terms = [t.to_dict() for t in parse_terms(specs)]
    for spec in specs:
        if spec.get("name") == term:
            return spec
    names = [s.get("name") for s in specs]
    raise ValueError(
        f"No distill_terms entry is named {term!r} (have {names}). Terms cannot be added during training: "
        "declare every term the run uses when building the arguments (weight 0 until it is needed)."
    )


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

    def _apply(self, args, state) -> None:
        self.values = self.values_at(state.global_step, state.max_steps)
        for name, value in self.values.items():
            set_loss_field(args, name, value)

    def on_train_begin(self, args, state, control, **kwargs):
        self._apply(args, state)

    def on_step_begin(self, args, state, control, **kwargs):
        self._apply(args, state)

    def distill_log_values(self) -> dict[str, float]:
        return {_log_key(n): v for n, v in self.values.items()}

    def state(self) -> dict:
        return {"args": {"schedules": {n: s.to_dict() for n, s in self.schedules.items()}}, "attributes": {}}
