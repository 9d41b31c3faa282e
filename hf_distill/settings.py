"""The loss settings of a running distillation: what the loss reads at every step, and the one way to change it.

`DistillationArguments` are validated once, when built, and hf_distill never changes them. A run's loss settings
start from them, with the defaults that depend on the student's head filled in (`HEAD_DEFAULTS`: a causal LM distils
at T = 1 on the tokens its own loss counts), and change while training only through :meth:`DistillSettings.set`,
which applies the checks the arguments apply when built: schedules and stages (hf_distill.schedules,
hf_distill.callbacks) receive this object as the `distill_settings` keyword of every callback event of a
`DistillationTrainer`. Fields set on the arguments since the settings were built or last looked (a
hyperparameter-search trial's before training, a user's callback or loop during it) are taken over, with the same
checks, when training starts and at every training step (:meth:`DistillSettings.follow`): a value set on the
arguments is never silently ignored.

What the run used is recorded from here: the trainer's model card and the `training_args.bin` it saves hold these
values (:meth:`DistillSettings.record`), as they did when the arguments themselves were changed.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from transformers.utils import logging

from .arguments import DEFAULT_SKEW_ALPHA, HEAD_DEFAULTS, JSD_BETA_DEFAULT, KD_LOSS_KINDS, SETTINGS_FIELDS
from .features.heads import Head
from .losses.terms import DistillTerm, parse_terms

logger = logging.get_logger(__name__)

SCALAR_FIELDS = ("temperature", "kd_weight", "task_weight")
TERM_PREFIX = "term:"
FIELDS = (*SCALAR_FIELDS, "kd_loss")
"""What may change while training: these, and `term:<name>` (the weight of the `distill_terms` entry `<name>`)."""
RECORDED = ("temperature", "kd_loss", "kd_weight", "task_weight", "kd_token_mask", "distill_terms")
"""The argument fields whose value for the run is the settings' (:meth:`DistillSettings.record`)."""


class DistillSettings:
    """A run's loss settings, built once from validated `args` for a student whose head is (`causal`) a causal LM and
    (`token_level`) has token-level logits. `filled` holds the head defaults filled in (for a log line)."""

    def __init__(self, args: Any, *, causal: bool = False, token_level: bool = True) -> None:
        self.filled: dict[str, Any] = {}
        self._values: dict[str, Any] = {}  # what the loss reads: temperature, kd_token_mask, kd_loss, the weights
        self._source = {name: copy.deepcopy(getattr(args, name)) for name in SETTINGS_FIELDS}
        for name, (other, causal_default) in HEAD_DEFAULTS.items():
            value = getattr(args, name)
            if value is None and (name != "kd_token_mask" or token_level):
                value = self.filled[name] = causal_default if causal else other
            self._values[name] = value
        self._values.update(kd_loss=args.kd_loss, kd_weight=args.kd_weight, task_weight=args.task_weight)
        self.jsd_beta, self.skew_alpha = args.jsd_beta, args.skew_alpha
        # The terms, parsed once (as dicts: IntermediateDistiller.set_weights compares them each step).
        self.distill_terms: list[dict] | None = copy.deepcopy(args.distill_terms)
        self._terms = parse_terms(self.distill_terms or [])

    @classmethod
    def for_student(cls, args: Any, head: Head | None, n_teachers: int) -> DistillSettings:
        """The settings of a run of this student (its head) and these teachers: the head defaults filled (logged),
        and arguments given that would do nothing for them refused."""
        sequence_level = head in (Head.SEQUENCE, Head.MULTI_LABEL, Head.REGRESSION, Head.QUESTION_ANSWERING)
        if sequence_level and args.given("kd_token_mask"):
            raise ValueError(
                f"kd_token_mask={args.kd_token_mask!r} does nothing for this student ({head.value}): it selects "
                "the positions of token-level logits (token classification, masked or causal LM). Leave it unset."
            )
        if n_teachers < 2:
            for name in ("teacher_weights", "multi_teacher"):
                if getattr(args, name) is not None:
                    raise ValueError(
                        f"{name}={getattr(args, name)!r} does nothing with {n_teachers or 'no'} teacher model: it "
                        "weighs or combines several teachers (teacher_model=[...]). Remove it."
                    )
        settings = cls(args, causal=head is Head.CAUSAL_LM, token_level=not sequence_level)
        if settings.filled:
            logger.info(
                "Not given, so set for a %s student: %s (see DistillationArguments).",
                "causal-LM" if head is Head.CAUSAL_LM else "non-causal",
                ", ".join(f"{k}={v!r}" for k, v in settings.filled.items()),
            )
        return settings

    temperature = property(lambda self: self._values["temperature"])
    kd_token_mask = property(lambda self: self._values["kd_token_mask"])
    kd_loss = property(lambda self: self._values["kd_loss"])
    kd_weight = property(lambda self: self._values["kd_weight"])
    task_weight = property(lambda self: self._values["task_weight"])

    @property
    def terms(self) -> list[DistillTerm]:
        """The intermediate-layer terms as objects (parsed once; weights follow `set`)."""
        return self._terms

    @property
    def effective_jsd_beta(self) -> float:
        """`jsd_beta`, or its default when unset (a stage may switch `kd_loss` to `jsd` during training)."""
        return JSD_BETA_DEFAULT if self.jsd_beta is None else self.jsd_beta

    @property
    def resolved_skew_alpha(self) -> float:
        """`skew_alpha`, or DistiLLM's 0.1 when unset."""
        return DEFAULT_SKEW_ALPHA if self.skew_alpha is None else float(self.skew_alpha)

    def get(self, name: str) -> Any:
        """The current value of `temperature`, `kd_loss`, `kd_weight`, `task_weight` or `term:<name>` (a weight)."""
        if name.startswith(TERM_PREFIX):
            return self._term_entry(name[len(TERM_PREFIX):])["weight"]
        if name not in FIELDS:
            raise ValueError(f"Unknown loss field {name!r}. Known: {', '.join(SCALAR_FIELDS)}, kd_loss, term:<name>.")
        return getattr(self, name)

    def set(self, name: str, value: Any) -> None:
        """Set one loss field, with the checks `DistillationArguments` makes when built."""
        if name == "kd_loss":
            if value not in KD_LOSS_KINDS:
                raise ValueError(f"kd_loss={value!r} is unknown. Known: {', '.join(KD_LOSS_KINDS)}.")
            self._values["kd_loss"] = value
            return
        if not name.startswith(TERM_PREFIX) and name not in SCALAR_FIELDS:
            raise ValueError(f"Unknown loss field {name!r}. Known: {', '.join(SCALAR_FIELDS)}, kd_loss, term:<name>.")
        value = float(value)
        if name == "temperature" and not value > 0:
            raise ValueError(f"temperature must be > 0, got {value}.")
        if name != "temperature" and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}.")
        if name.startswith(TERM_PREFIX):
            term = name[len(TERM_PREFIX):]
            self._term_entry(term)["weight"] = value
            self._terms = [dataclasses.replace(t, weight=value) if t.name == term else t for t in self._terms]
        else:
            self._values[name] = value

    def follow(self, args: Any, running: bool = False) -> list[str]:
        """Take over the fields set on `args` since these settings were built from them or last followed them (a
        hyperparameter-search trial before training, a user's callback during it), with the same checks; returns
        their names. Cheap when nothing changed: one comparison per field. `running` (a training step): the fields
        that cannot change while training (`jsd_beta`, `skew_alpha`, `kd_token_mask`) are refused instead."""
        changed = [n for n in SETTINGS_FIELDS if getattr(args, n) != self._source[n]]
        fixed = [n for n in changed if n not in FIELDS and n != "distill_terms"]
        if running and fixed:  # checked against the student when the trainer was built: not re-checked mid-run
            raise ValueError(
                f"DistillationArguments.{', '.join(fixed)} changed during training: only "
                f"{', '.join(FIELDS)} and the weights of distill_terms can change while a run trains (through "
                "trainer.settings.set or a callback's distill_settings). Set it before training starts."
            )
        for name in changed:
            value = copy.deepcopy(getattr(args, name))
            self._source[name] = copy.deepcopy(value)
            if name in FIELDS:
                self.set(name, value)
            elif name == "distill_terms":
                self.distill_terms = [t.to_dict() for t in parse_terms(value or [])] if value is not None else None
                self._terms = parse_terms(self.distill_terms or [])
            elif name in ("jsd_beta", "skew_alpha"):
                setattr(self, name, value)
            elif value is not None:  # kd_token_mask given now
                self._values["kd_token_mask"] = value
        return changed

    def _term_entry(self, term: str) -> dict:
        for spec in self.distill_terms or []:
            if spec.get("name") == term:
                return spec
        names = [s.get("name") for s in self.distill_terms or []]
        raise ValueError(
            f"No distill_terms entry is named {term!r} (have {names}). Terms cannot be added during training: "
            "declare every term the run uses when building the arguments (weight 0 until it is needed)."
        )

    def record(self, args: Any) -> Any:
        """A copy of `args` holding the values this run uses now (what a card or `training_args.bin` records)."""
        out = copy.copy(args)
        for name in RECORDED:
            object.__setattr__(out, name, copy.deepcopy(getattr(self, name)))
        return out


__all__ = ["FIELDS", "SCALAR_FIELDS", "TERM_PREFIX", "DistillSettings"]
