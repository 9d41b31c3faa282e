"""Callbacks that change the distillation loss while training: schedules and multi-stage recipes.

Both work through the one object the trainer re-reads at every step, the run's settings
(hf_distill.settings.DistillSettings) that a `DistillationTrainer` passes to every callback event as
`distill_settings`: `temperature`, `kd_loss`, `kd_weight`, `task_weight` and the `weight` of each entry of
`distill_terms` (the trainer passes those to `IntermediateDistiller.set_weights` each step, and a term of weight 0
costs nothing). The `DistillationArguments` (`args`) are validated once and not changed. Callbacks never see
the trainer, and the Trainer may rebuild them from their saved state, so they hold nothing but plain values.

- `ScheduleCallback` (defined in :mod:`hf_distill.schedules`, with the loss-field access both use): linear or
  cosine schedules of those values over training progress (`global_step / max_steps`, the convention of
  transformers' learning-rate schedules: the value used by step `k` is the schedule at `(k - 1) / max_steps`).
- `StageSwitchCallback`: a run made of stages, each with its own loss (a preset and/or explicit values,
  optionally schedules over the stage) and optionally its own learning-rate schedule and a fresh optimizer
  state, e.g. TinyBERT's task distillation (intermediate layers, then the prediction layer) as one command.

Resuming: both are `ExportableState`s, so their state is written into `trainer_state.json` at every
checkpoint. Everything they set is a function of `global_step`, which the Trainer restores, and is
re-applied in `on_train_begin`, so a resumed run continues in the right stage with the right values
whether or not `restore_callback_states_from_checkpoint` is set. The values they set are logged next to
the losses (`distill_stage`, `temperature`, `weight_<term>`, ...).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .compat import set_last_lr
from .losses.terms import parse_terms
from .schedules import (  # noqa: F401 - re-exported: `hf_distill.callbacks.ScheduleCallback` etc.
    SCALAR_FIELDS,
    SCHEDULE_KINDS,
    TERM_PREFIX,
    Schedule,
    ScheduleCallback,
    _log_key,
    _progress,
    _schedule,
    get_loss_field,
    run_settings,
    set_loss_field,
)
from .settings import DistillSettings

# The Trainer's own LR factors and base rates per scheduler, before any stage replaced them. Not stored on the
# scheduler: its state_dict() saves every attribute, and checkpoints are loaded with weights_only=True.
_ORIGINAL_LR: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
LR_SCHEDULES = ("constant", "linear", "cosine")


# ---------------------------------------------------------------------- stages


@dataclass
class Stage:
    """One stage of a multi-stage run.

    Where it ends: `until_step` (global optimizer steps) or `until_epoch` (converted to steps with the
    Trainer's steps per epoch); the last stage may give neither and runs to the end.

    Its loss: the arguments as built (the base), overridden by `preset` (a `hf_distill.presets` name; a preset
    also sets every term it does not list to weight 0), then by the explicit fields. `temperature`,
    `kd_weight`, `task_weight` and the values of `term_weights` (term name -> weight) may be numbers or
    `Schedule`s (dicts) over the stage's own progress.

    Its optimisation: `learning_rate` (peak, for the parameter group built with `args.learning_rate`; other
    groups such as projections keep their ratio to it) with `lr_scheduler_type` (constant, linear or cosine,
    with `warmup_ratio` of the stage's steps) replaces the Trainer's schedule during the stage; without it the
    Trainer's own schedule applies. `reset_optimizer` clears the optimizer state (Adam moments) when the
    stage starts, as when the stage is a separate run.

    Its trainable part: `frozen` names student modules or parameters (dotted names as in
    `model.named_parameters()`, a module name covering everything under it) held fixed during the stage
    (`requires_grad=False`, so the optimizer skips them); everything else keeps the `requires_grad` it had
    when training began. MobileBERT's progressive transfer freezes the blocks below the one it trains.
    """

    until_step: int | None = None
    until_epoch: float | None = None
    preset: str | None = None
    temperature: float | Schedule | dict | None = None
    kd_loss: str | None = None
    kd_weight: float | Schedule | dict | None = None
    task_weight: float | Schedule | dict | None = None
    term_weights: dict[str, float | Schedule | dict] = field(default_factory=dict)
    learning_rate: float | None = None
    lr_scheduler_type: str = "constant"
    warmup_ratio: float = 0.0
    reset_optimizer: bool = False
    frozen: list[str] = field(default_factory=list)
    name: str | None = None

    def __post_init__(self) -> None:
        self.frozen = [str(f) for f in self.frozen]  # a list, as it comes back from a checkpoint's JSON
        if self.until_step is not None and self.until_epoch is not None:
            raise ValueError("A Stage ends at until_step or at until_epoch, not both.")
        if self.preset is not None:
            from .presets import PRESETS

            if self.preset not in PRESETS:
                raise ValueError(f"Stage preset {self.preset!r} is unknown. Known: {', '.join(PRESETS)}.")
        for name in SCALAR_FIELDS:
            value = getattr(self, name)
            if isinstance(value, Mapping):
                setattr(self, name, _schedule(value))
        self.term_weights = {k: _schedule(v) if isinstance(v, Mapping) else v for k, v in self.term_weights.items()}
        if self.lr_scheduler_type not in LR_SCHEDULES:
            raise ValueError(f"Stage lr_scheduler_type {self.lr_scheduler_type!r}: use one of {LR_SCHEDULES}.")
        if self.learning_rate is not None and self.learning_rate <= 0:
            raise ValueError(f"Stage learning_rate must be > 0, got {self.learning_rate}.")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"Stage warmup_ratio must be in [0, 1), got {self.warmup_ratio}.")

    def preset_terms(self) -> list[dict]:
        if self.preset is None:
            return []
        from .presets import PRESETS

        return [t.to_dict() for t in parse_terms(PRESETS[self.preset]().get("distill_terms") or [])]

    def targets(self, base: Mapping[str, Any]) -> dict[str, Any]:
        """Field -> value or Schedule for this stage, over the base (`term:<name>` keys for term weights)."""
        out = dict(base)
        if self.preset is not None:
            from .presets import PRESETS

            values = PRESETS[self.preset]()
            out.update({k: values[k] for k in (*SCALAR_FIELDS, "kd_loss") if k in values})
            out.update({k: 0.0 for k in out if k.startswith(TERM_PREFIX)})
            out.update({TERM_PREFIX + t["name"]: t["weight"] for t in self.preset_terms()})
        out.update({k: getattr(self, k) for k in (*SCALAR_FIELDS, "kd_loss") if getattr(self, k) is not None})
        out.update({TERM_PREFIX + k: v for k, v in self.term_weights.items()})
        return out

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k in SCALAR_FIELDS:
            if isinstance(d[k], Schedule):
                d[k] = d[k].to_dict()
        d["term_weights"] = {k: v.to_dict() if isinstance(v, Schedule) else v for k, v in self.term_weights.items()}
        return d

    def describe(self) -> str:
        what = [self.preset] if self.preset else []
        what += [f"{k}={getattr(self, k)}" for k in (*SCALAR_FIELDS, "kd_loss") if getattr(self, k) is not None]
        what += [f"weight_{k}={v}" for k, v in self.term_weights.items()]
        if self.learning_rate is not None:
            what.append(f"lr {self.learning_rate:g} ({self.lr_scheduler_type}, warmup {self.warmup_ratio:g})")
        if self.reset_optimizer:
            what.append("fresh optimizer state")
        if self.frozen:
            what.append(f"frozen: {', '.join(self.frozen)}")
        end = (f"until step {self.until_step}" if self.until_step is not None else
               f"until epoch {self.until_epoch:g}" if self.until_epoch is not None else "to the end")
        return f"{self.name or 'stage'}: {', '.join(what) or 'base loss'}, {end}"


class _StageLR:
    """A LambdaLR factor for one stage: warmup then constant / linear decay / half-cosine over its steps,
    the formulas of transformers' `get_*_schedule_with_warmup` applied to the stage's own step count."""

    def __init__(self, start: int, end: int, kind: str, warmup: int) -> None:
        self.start, self.end, self.kind, self.warmup = start, end, kind, warmup

    def __call__(self, step: int) -> float:
        s, total, w = step - self.start, max(self.end - self.start, 1), self.warmup
        if s < w:
            return s / max(1, w)
        if self.kind == "constant":
            return 1.0
        progress = (s - w) / max(1, total - w)
        if self.kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


class StageSwitchCallback(TrainerCallback, ExportableState):
    """Run several stages with different losses (and optionally learning rates) as one training command.

    TinyBERT's task distillation (Jiao et al. 2020; huawei-noah `task_distill.py`, run twice: intermediate
    layers on augmented data for 10 epochs at constant lr 5e-5, then `--pred_distill` for 3 epochs at lr 3e-5
    with linear warmup 10%) becomes:

        switch = StageSwitchCallback([
            Stage(preset="tinybert_intermediate", until_epoch=10, name="intermediate"),
            Stage(preset="tinybert_prediction", learning_rate=3e-5, lr_scheduler_type="linear",
                  warmup_ratio=0.1, reset_optimizer=True, name="prediction"),
        ])
        args = DistillationArguments(..., num_train_epochs=13, learning_rate=5e-5,
                                     lr_scheduler_type="constant", **switch.argument_fields())
        DistillationTrainer(..., args=args, callbacks=[switch])

    Every term any stage uses must be declared in `args.distill_terms` when the trainer is built (it builds
    projections and hooks for them); `argument_fields()` gives the first stage's loss with every stage's
    preset terms. Terms of weight 0 in a stage are neither captured nor computed. Differences from running
    the reference twice: one process and one data pipeline; the optimizer state is kept unless
    `reset_optimizer`; stage boundaries count optimizer steps.
    """

    def __init__(self, stages: Sequence[Stage | Mapping[str, Any]]) -> None:
        self.stages = [s if isinstance(s, Stage) else Stage(**s) for s in stages]
        if not self.stages:
            raise ValueError("StageSwitchCallback needs at least one stage.")
        for i, s in enumerate(self.stages[:-1]):
            if s.until_step is None and s.until_epoch is None:
                raise ValueError(f"Stage {i} ({s.name or 'unnamed'}) needs until_step or until_epoch: only the "
                                 "last stage may run to the end.")
        self.boundaries: list[int] | None = None  # stage i covers global steps [boundaries[i-1], boundaries[i])
        self.base: dict[str, Any] | None = None
        self.stage: int | None = None
        self.values: dict[str, float] = {}
        self._trainable: dict[str, bool] | None = None  # requires_grad of each parameter when training began

    # ---------------------------------------------------------------- building the arguments

    def argument_fields(self) -> dict[str, Any]:
        """`DistillationArguments` keywords: the first stage's loss values and the terms of every stage's
        preset (weight 0 where the first stage does not use them)."""
        terms: dict[str, dict] = {}
        for stage in self.stages:
            for t in stage.preset_terms():
                terms.setdefault(t["name"], {**t, "weight": 0.0})
        base = {TERM_PREFIX + n: 0.0 for n in terms}
        out: dict[str, Any] = {}
        for key, value in self.stages[0].targets(base).items():
            value = value.start if isinstance(value, Schedule) else value
            if key.startswith(TERM_PREFIX):
                terms[key[len(TERM_PREFIX) :]]["weight"] = float(value)
            else:
                out[key] = value
        out["distill_terms"] = list(terms.values()) or None
        return out

    def describe(self) -> list[str]:
        """One line per stage, for the model card (`create_model_card(stages=...)`)."""
        return [s.describe() for s in self.stages]

    # ---------------------------------------------------------------- stage bookkeeping

    def _resolve(self, args, state, train_dataloader, settings: DistillSettings | None = None) -> None:
        """Stage boundaries, base values and the declared terms, from `settings` (the run's; without them, as the
        arguments give them)."""
        settings = settings if settings is not None else DistillSettings(args)
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        if self.boundaries is None and isinstance(saved, dict):  # a resumed run, restore flag off
            attrs = saved.get("attributes", {})
            if saved.get("args", {}).get("stages") == [s.to_dict() for s in self.stages]:
                self.boundaries = attrs.get("boundaries")
                self.base = self.base or attrs.get("base")
        if self.boundaries is None:
            per_epoch = None
            if any(s.until_epoch is not None for s in self.stages):
                try:
                    n = len(train_dataloader)
                except TypeError:
                    msg = "Stage until_epoch needs a train dataloader with a length: use until_step."
                    raise ValueError(msg) from None
                ga = args.gradient_accumulation_steps
                per_epoch = max(n // ga + int(n % ga > 0), 1)  # the Trainer's update steps per epoch
            ends = [s.until_step if s.until_step is not None else math.ceil(s.until_epoch * per_epoch)
                    for s in self.stages[:-1]]
            if any(b <= a for a, b in zip([0, *ends], ends)):
                raise ValueError(f"Stage boundaries must increase and be > 0, got steps {ends}.")
            if state.max_steps and state.max_steps > 0 and ends and ends[-1] >= state.max_steps:
                raise ValueError(f"Stage boundaries at steps {ends}, but training stops at step {state.max_steps}: the "
                                 "last stage(s) would never run. Train longer (num_train_epochs / max_steps) or end "
                                 "the stages earlier.")
            self.boundaries = ends
        if self.base is None:
            terms = [t.name for t in parse_terms(settings.distill_terms or [])]
            self.base = {k: get_loss_field(settings, k) for k in (*SCALAR_FIELDS, "kd_loss")}
            self.base.update({TERM_PREFIX + n: get_loss_field(settings, TERM_PREFIX + n) for n in terms})
        declared = {t.name: t.to_dict() for t in parse_terms(settings.distill_terms or [])}
        for i, stage in enumerate(self.stages):
            for t in stage.preset_terms():
                have = declared.get(t["name"])
                if have is None or {**have, "weight": 0} != {**t, "weight": 0}:
                    raise ValueError(
                        f"Stage {i} ({stage.preset}) uses the term {t}, which args.distill_terms does not declare "
                        "as such. Build the arguments with StageSwitchCallback.argument_fields()."
                    )
            for name in stage.term_weights:
                if name not in declared:
                    raise ValueError(f"Stage {i} sets the weight of term {name!r}, which args.distill_terms "
                                     f"does not declare (have {sorted(declared)}).")

    def _check_frozen(self, args, model) -> None:
        if not any(s.frozen for s in self.stages):
            return
        if model is None:
            raise ValueError("Stage frozen needs the model in the callback events (a transformers Trainer gives it).")
        if getattr(args, "world_size", 1) > 1 or getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
            raise ValueError("Stage frozen changes which parameters train between stages; DDP, FSDP and DeepSpeed fix "
                             "that set when they wrap the model. Run multi-stage freezing on one process, without "
                             "an engine.")
        names = [n for n, _ in model.named_parameters()]
        for i, stage in enumerate(self.stages):
            for f in stage.frozen:
                if not any(n == f or n.startswith(f + ".") for n in names):
                    raise ValueError(f"Stage {i} ({stage.name or 'unnamed'}) freezes {f!r}, which names no parameter "
                                     f"of the model (e.g. {names[0]!r}).")
        if self._trainable is None:  # kept until train() ends: a retry of auto_find_batch_size finds its failed
            self._trainable = {n: p.requires_grad for n, p in model.named_parameters()}  # try's freeze in place

    def restore_trainable(self, model) -> None:
        """Every parameter's `requires_grad` as it was when training began (called when `train()` ends, also
        on an exception, so an interrupted run does not leave modules frozen)."""
        if self._trainable is not None and model is not None:
            for n, p in model.named_parameters():
                p.requires_grad_(self._trainable.get(n, p.requires_grad))
            self._trainable = None  # the next train() starts from the model as it is then

    def _apply_frozen(self, stage: Stage, model) -> None:
        if self._trainable is None:
            return
        for n, p in model.named_parameters():
            held = any(n == f or n.startswith(f + ".") for f in stage.frozen)
            p.requires_grad_(self._trainable.get(n, p.requires_grad) and not held)

    def stage_at(self, step: int) -> int:
        return sum(step >= b for b in self.boundaries or [])

    def span(self, index: int, max_steps: int) -> tuple[int, int]:
        bounds = [0, *(self.boundaries or []), max(max_steps, (self.boundaries or [0])[-1])]
        return bounds[index], bounds[index + 1]

    def _apply(self, args, settings, state, optimizer, lr_scheduler, model=None) -> None:
        index = self.stage_at(state.global_step)
        if model is not None:
            self._apply_frozen(self.stages[index], model)
        start, end = self.span(index, state.max_steps)
        progress = _progress(state.global_step, start, end)
        self.values = {}
        for key, value in self.stages[index].targets(self.base).items():
            if isinstance(value, Schedule):
                value = self.values[_log_key(key)] = value.value(progress)
            set_loss_field(settings, key, value)
        if lr_scheduler is not None and optimizer is not None:
            self._apply_lr(index, start, end, args, optimizer, lr_scheduler)
        self.stage = index

    def _apply_lr(self, index, start, end, args, optimizer, lr_scheduler) -> None:
        stage = self.stages[index]
        sched = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate's AcceleratedScheduler
        original = _ORIGINAL_LR.get(sched)
        if stage.learning_rate is None and original is None:
            return  # no stage has touched the Trainer's schedule
        if not hasattr(sched, "lr_lambdas"):
            raise ValueError(
                f"Stage learning rates need a LambdaLR scheduler (every transformers lr_scheduler_type except "
                f"reduce_lr_on_plateau); got {type(sched).__name__}."
            )
        groups = sched.optimizer.param_groups
        if original is None:  # kept per scheduler, so that a callback rebuilt from its state finds it too
            original = _ORIGINAL_LR[sched] = (list(sched.lr_lambdas), [g["initial_lr"] for g in groups])
        lambdas, initial = original
        if stage.learning_rate is None:
            sched.lr_lambdas, sched.base_lrs = list(lambdas), list(initial)
        else:
            scale = stage.learning_rate / args.learning_rate if args.learning_rate else 1.0
            warmup = math.ceil(stage.warmup_ratio * (end - start))
            sched.lr_lambdas = [_StageLR(start, end, stage.lr_scheduler_type, warmup) for _ in groups]
            sched.base_lrs = [lr * scale if args.learning_rate else stage.learning_rate for lr in initial]
        # The scheduler stepped with the previous stage's factors: set this step's rate now.
        lrs = [base * f(sched.last_epoch) for base, f in zip(sched.base_lrs, sched.lr_lambdas)]
        for group, lr in zip(groups, lrs):
            group["lr"] = lr
        set_last_lr(sched, lrs)  # what get_last_lr() (the logged learning_rate) returns until the next step

    # ---------------------------------------------------------------- events

    def on_train_begin(self, args, state, control, train_dataloader=None, optimizer=None, lr_scheduler=None,
                       model=None, **kwargs):
        settings = run_settings(kwargs, type(self).__name__)
        self._resolve(args, state, train_dataloader, settings)
        self._check_frozen(args, model)
        self._apply(args, settings, state, optimizer, lr_scheduler, model)

    def on_step_begin(self, args, state, control, optimizer=None, lr_scheduler=None, model=None, **kwargs):
        index = self.stage_at(state.global_step)
        stage = self.stages[index]
        scheduled = any(isinstance(v, Schedule) for v in stage.targets(self.base).values())
        if index != self.stage or scheduled:
            self._apply(args, run_settings(kwargs, type(self).__name__), state, optimizer, lr_scheduler, model)
        # Step-based, not memory-based, so a run resumed exactly at the boundary resets too.
        if stage.reset_optimizer and index > 0 and state.global_step == self.boundaries[index - 1]:
            inner = getattr(optimizer, "optimizer", optimizer)
            if inner is not None:
                inner.state.clear()

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.restore_trainable(model)  # hand the model back as it came (DistillationTrainer.train also does)

    def distill_log_values(self) -> dict[str, float]:
        return {"distill_stage": self.stage or 0, **self.values}

    def state(self) -> dict:
        return {
            "args": {"stages": [s.to_dict() for s in self.stages]},
            "attributes": {"boundaries": self.boundaries, "base": self.base, "stage": self.stage},
        }
