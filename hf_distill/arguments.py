"""`DistillationArguments`: the `TrainingArguments` of a distillation run.

Every field is a plain dataclass field so that `HfArgumentParser` exposes it as a command-line flag and
`parse_yaml_file` / `parse_json_file` accept it. Validation happens in `__post_init__`, so a bad value
fails when the arguments are built, long before the first training step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from .terms import DistillTerm, parse_terms

KD_LOSS_KINDS = ("kl", "soft_ce", "mse")
PROJECTION_KINDS = ("shared", "per_layer", "none")
KD_TOKEN_MASKS = ("attention", "labels")
MULTI_TEACHER_MODES = ("probs", "losses")


@dataclass
class DistillationArguments(TrainingArguments):
    """`TrainingArguments` plus the knobs of knowledge distillation.

    The total loss is `task_weight * task_loss + kd_weight * kd_loss + sum(term.weight * term_loss)`,
    where `task_loss` is the student's own loss on the labels, `kd_loss` compares student and teacher
    logits, and the terms compare intermediate features (see `distill_terms`).
    """

    temperature: float = field(
        default=2.0,
        metadata={
            "help": "Softmax temperature T of the logit-distillation loss (Hinton et al. 2015). `kl` is "
            "multiplied by T**2 so that its gradient scale does not depend on T; `soft_ce` is not "
            "(TinyBERT's prediction loss); `mse` ignores T. Must be > 0."
        },
    )
    kd_loss: str = field(
        default="kl",
        metadata={
            "help": "Logit-distillation loss: `kl` (T**2 * KL(teacher || student), DistilBERT), `soft_ce` "
            "(soft cross-entropy without T**2, TinyBERT) or `mse` (squared error of logits, Tang et al. "
            "2019 BiLSTM students)."
        },
    )
    kd_weight: float = field(
        default=0.5,
        metadata={"help": "Weight of the logit-distillation term. 0 disables it (no teacher logits needed)."},
    )
    task_weight: float = field(
        default=0.5,
        metadata={
            "help": "Weight of the student's own task loss on the labels (the hard-label loss). 0 disables "
            "it, which is what task-agnostic distillation and TinyBERT's prediction stage do."
        },
    )
    kd_token_mask: str = field(
        default="attention",
        metadata={
            "help": "For token-level logits (B, T, C): which positions the logit loss averages over. "
            "`attention`: every real token (attention_mask == 1); `labels`: only positions whose label "
            "is not -100, e.g. the masked tokens of MLM (DistilBERT's --restrict_ce_to_mask)."
        },
    )
    distill_terms: list[str] | None = field(
        default=None,
        metadata={
            "help": "Intermediate-layer terms. Each is `key=value` pairs separated by commas on the "
            "command line, or a mapping in YAML/JSON. Keys: loss (hidden_mse, cosine_loss, "
            "attention_score_mse, relation_kl, pkd_loss), layers (uniform, last, or student:teacher "
            "pairs separated by `;`, layer 0 being the embeddings), weight, name, and for relation_kl: "
            "relations (qq, kk, vv, qk separated by `;`) and relation_heads. Example: "
            "`loss=hidden_mse,layers=uniform,weight=1`."
        },
    )
    distill_preset: str | None = field(
        default=None,
        metadata={
            "help": "Fill the loss fields as a published recipe does: distilbert, tinybert_intermediate, "
            "tinybert_prediction, minilm, minilmv2 (see hf_distill.presets). Fields you set explicitly "
            "on top are kept only for `distill_terms`; the preset sets temperature, kd_loss and the "
            "weights."
        },
    )
    projection: str = field(
        default="shared",
        metadata={
            "help": "How student features are mapped to the teacher's width when hidden sizes differ: "
            "`shared` (one Linear for all layers, TinyBERT's fit_dense), `per_layer` (one Linear per "
            "student layer) or `none` (refuse: sizes must match)."
        },
    )
    projection_lr: float | None = field(
        default=None,
        metadata={"help": "Learning rate of the projections. Defaults to `learning_rate`."},
    )
    teacher_weights: list[float] | None = field(
        default=None,
        metadata={"help": "With several teachers: one weight per teacher (normalised to sum to 1). Default: equal."},
    )
    multi_teacher: str = field(
        default="probs",
        metadata={
            "help": "With several teachers: `probs` distils the weighted average of their softened distributions; "
            "`losses` sums one logit-distillation loss per teacher, weighted."
        },
    )
    eval_with_teacher: bool = field(
        default=False,
        metadata={
            "help": "Also run the teacher on evaluation batches, so that `eval_loss` is the full "
            "distillation loss. By default evaluation runs the student alone and `eval_loss` is its "
            "task loss, as with a plain Trainer."
        },
    )

    def __post_init__(self) -> None:
        if self.distill_preset is not None:
            from .presets import apply_preset

            apply_preset(self, self.distill_preset)
        super().__post_init__()
        self._validate_distillation()

    def _validate_distillation(self) -> None:
        if not self.temperature > 0:
            raise ValueError(
                f"DistillationArguments.temperature must be > 0, got {self.temperature}. "
                "Use 1.0 for plain softmax; 2-8 is usual for distillation."
            )
        if self.kd_loss not in KD_LOSS_KINDS:
            raise ValueError(
                f"DistillationArguments.kd_loss={self.kd_loss!r} is unknown. Known: {', '.join(KD_LOSS_KINDS)}."
            )
        if self.projection not in PROJECTION_KINDS:
            raise ValueError(
                f"DistillationArguments.projection={self.projection!r} is unknown. "
                f"Known: {', '.join(PROJECTION_KINDS)}."
            )
        if self.kd_token_mask not in KD_TOKEN_MASKS:
            raise ValueError(
                f"DistillationArguments.kd_token_mask={self.kd_token_mask!r} is unknown. "
                f"Known: {', '.join(KD_TOKEN_MASKS)}."
            )
        if self.multi_teacher not in MULTI_TEACHER_MODES:
            raise ValueError(
                f"DistillationArguments.multi_teacher={self.multi_teacher!r} is unknown. "
                f"Known: {', '.join(MULTI_TEACHER_MODES)}."
            )
        if self.teacher_weights is not None and any(w < 0 for w in self.teacher_weights):
            raise ValueError(f"DistillationArguments.teacher_weights must be >= 0, got {self.teacher_weights}.")
        for name in ("kd_weight", "task_weight"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"DistillationArguments.{name} must be >= 0, got {getattr(self, name)}. "
                    "Set it to 0 to disable that term."
                )
        if self.projection_lr is not None and self.projection_lr <= 0:
            raise ValueError(f"DistillationArguments.projection_lr must be > 0, got {self.projection_lr}.")
        # Normalise the terms once: strings from the command line become plain dicts, so the arguments
        # stay JSON-serialisable (TensorBoard hparams, model cards) and parsing errors surface here.
        terms = parse_terms(self.distill_terms or [])
        self.distill_terms = [t.to_dict() for t in terms] or None
        if self.kd_weight == 0 and self.task_weight == 0 and not any(t.weight > 0 for t in terms):
            raise ValueError(
                "All loss weights are zero (kd_weight, task_weight and every distill_terms weight): "
                "nothing would be trained. Set kd_weight > 0 for logit distillation."
            )

    @property
    def terms(self) -> list[DistillTerm]:
        """The intermediate-layer terms as objects (parsed from `distill_terms`)."""
        return parse_terms(self.distill_terms or [])

    def distillation_summary(self) -> dict[str, Any]:
        """The distillation settings a model card or a results file should record."""
        return {
            "temperature": self.temperature,
            "kd_loss": self.kd_loss,
            "kd_weight": self.kd_weight,
            "task_weight": self.task_weight,
            "distill_preset": self.distill_preset,
            "distill_terms": self.distill_terms or [],
            "projection": self.projection,
            "teacher_weights": self.teacher_weights,
            "multi_teacher": self.multi_teacher,
        }
