"""`DistillationArguments`: the `TrainingArguments` of a distillation run.

Every field is a plain dataclass field so that `HfArgumentParser` exposes it as a command-line flag and
`parse_yaml_file` / `parse_json_file` accept it. Validation happens in `__post_init__`, so a bad value
fails when the arguments are built, long before the first training step.

The loss fields a preset may fill (`PRESET_DEFAULTS`, `temperature` and `distill_terms`) default to None, meaning
"not given": `__post_init__` replaces None by the preset's value, or else by the plain default. So a value the
user gave wins even when it equals the default, and after `__post_init__` those fields hold real values, which is
why `dataclasses.replace` (it passes every field again) keeps them instead of applying the preset again. A run
that generates its completions (`lmbda` > 0 or `seq_kd`) has GKD's plain defaults for the loss weights
(`GENERATION_DEFAULTS`: `kd_weight=1`, `task_weight=0`), since a cross-entropy on the student's own samples only
teaches it to imitate them; a value you (or the preset) give still wins.

Two fields have defaults that depend on the student (`HEAD_DEFAULTS`): `temperature` and `kd_token_mask` stay
None when neither you nor the preset gave them, and the run's loss settings fill them once the student's head is known
(hf_distill.settings.DistillSettings): a causal LM distils at T = 1 on the tokens its own loss counts (the completion
when the labels mask the prompt), as TRL's GKD does; every other head keeps T = 2 on every real token.

The arguments are validated once and hf_distill never changes them: what a run changes while training (schedules,
stages) goes through the Distiller's settings (`trainer.settings.set(...)`, with the same checks), which
start from these values when training starts (`SETTINGS_FIELDS`; a hyperparameter-search trial's values included).

Fields that do nothing in the configuration you chose are refused when you give them (`jsd_beta` without
`kd_loss="jsd"`; the trainer refuses `kd_token_mask` for a sequence-level head, `teacher_weights` and
`multi_teacher` with fewer than two teachers, `projection_lr` when no projection is trained). Such fields
default to None and are never filled in, so `dataclasses.replace` does not turn a default into a given value.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments
from transformers.utils import logging

from .argument_checks import (  # noqa: F401 - the accepted values, importable from here
    CROSS_TOKENIZER_METHODS,
    JSD_KINDS,
    KD_LOSS_KINDS,
    KD_TOKEN_MASKS,
    MULTI_TEACHER_MODES,
    PROJECTION_KINDS,
    SKEW_KINDS,
)
from .losses.registry import get_divergence, kinds
from .losses.terms import DistillTerm, parse_terms

logger = logging.get_logger(__name__)

DEFAULT_SKEW_ALPHA = 0.1  # DistiLLM (Ko et al., 2024)
# The plain defaults of the fields a preset may set; the fields themselves default to None ("not given").
PRESET_DEFAULTS: dict[str, Any] = {"kd_loss": "kl", "kd_weight": 0.5, "task_weight": 0.5, "projection": "shared"}
# The plain defaults of a run that generates its completions (lmbda > 0 or seq_kd): GKD's (and TRL's) loss, KD alone.
# A cross-entropy on the student's own samples would teach it to imitate them (issue #39, case 6).
GENERATION_DEFAULTS: dict[str, Any] = {"kd_weight": 1.0, "task_weight": 0.0}
# Defaults that depend on the student's head, as (any other head, causal LM): filled by the run's settings
# (DistillationTrainer) where neither the user nor the preset gave a value. A preset may set `temperature`.
HEAD_DEFAULTS: dict[str, tuple[Any, Any]] = {"temperature": (2.0, 1.0), "kd_token_mask": ("attention", "labels")}
JSD_BETA_DEFAULT = 0.5  # `jsd_beta` when not given (TRL's GKD default)
# The loss fields the run's settings take from the arguments (hf_distill.settings); training changes them there.
SETTINGS_FIELDS = ("temperature", "kd_loss", "kd_weight", "task_weight", "kd_token_mask", "distill_terms", "jsd_beta",
                   "skew_alpha")
_GIVEN_WINS = " Default: {}, or the value of `distill_preset`; a value you give always wins over the preset."
_GENERATING = (" When the run generates its completions (lmbda > 0 or seq_kd) and neither you nor the preset gave it, "
               "the default is {} instead (GKD's loss: KD alone, no cross-entropy on the student's own samples).")


def _kd_loss_help() -> str:
    """`kd_loss`'s help: each registered kind with its entry's description (hf_distill.losses.registry)."""
    parts = [f"`{name}` ({get_divergence(name).help})" for name in kinds()]
    return "Logit-distillation loss: " + ", ".join(parts[:-1]) + " or " + parts[-1] + "."


@dataclass
class DistillationArguments(TrainingArguments):
    """`TrainingArguments` plus the knobs of knowledge distillation.

    The total loss is `task_weight * task_loss + kd_weight * kd_loss + sum(term.weight * term_loss)`,
    where `task_loss` is the student's own loss on the labels, `kd_loss` compares student and teacher
    logits, and the terms compare intermediate features (see `distill_terms`).
    """

    temperature: float | None = field(
        default=None,
        metadata={
            "help": "Softmax temperature T of the logit-distillation loss (Hinton et al. 2015). `kl` is "
            "multiplied by T**2 so that its gradient scale does not depend on T; `soft_ce` is not "
            "(TinyBERT's prediction loss); `mse` ignores T. Must be > 0. Default: 1.0 for a causal-LM student "
            "(next-token distillation as in TRL's GKD and MiniLLM), 2.0 for every other head (DistilBERT), filled in "
            "by DistillationTrainer once it knows the student (None until then), or the value of `distill_preset`; "
            "a value you give always wins."
        },
    )
    kd_loss: str | None = field(
        default=None,
        metadata={
            "help": _kd_loss_help() + _GIVEN_WINS.format("kl")
        },
    )
    kd_chunk_size: int | None = field(
        default=None,
        metadata={
            "help": "Causal LMs: tokens per chunk when the KD term and the student's cross-entropy are computed from "
            "the last hidden states through each LM head a chunk at a time, so no full (batch, length, vocabulary) "
            "logits tensor exists (hf_distill.losses.chunked, the loss head; same loss, gradients "
            "faithful to float64). "
            "Unset: about 2**25 logits per chunk (`chunked.default_chunk(V)`: 256 tokens at V = 128,256) wherever "
            "that is possible for a causal-LM student (otherwise whole logits, with a log line: e.g. kd_loss='mse', "
            "label smoothing, several teachers); set: refused where it cannot be honoured. Must be > 0."
        },
    )
    kd_head_mode: str = field(
        default="recompute",
        metadata={
            "help": "Causal LMs, the loss head's speed/memory trade (issue #41 item 6). 'recompute' (default): the "
            "backward recomputes both models' logits a vocabulary block at a time: six LM-head GEMMs, no buffer of "
            "the head's size. 'fused': the gradients are formed in the forward, a token chunk at a time: four GEMMs, "
            "at the cost of a float32 copy of the student LM head's weight gradient (V x H x 4 bytes: 2 GiB at "
            "128,256 x 4,096) held from the forward to the backward, and a default kd_chunk_size 4x longer (1,024 "
            "tokens at V = 128,256: its float32 logits take 0.5 GiB per model). Gradients as exact as the default. "
            "Refused where the loss head does not run (whole logits), under DeepSpeed or FSDP, and with an LM head "
            "that is not a plain nn.Linear (a LoRA-wrapped head): the heads are called as modules there."
        },
    )
    jsd_beta: float | None = field(
        default=None,
        metadata={
            "help": "`kd_loss=jsd` only: the mixture weight beta of the generalized JSD (TRL's GKD convention): 0 is "
            "the forward KL (`kl`), 1 the reverse KL (`reverse_kl`), 0.5 the symmetric JSD. Must be in [0, 1]. "
            "Default (unset): 0.5. Refused with any other kd_loss, where it would do nothing."
        },
    )
    skew_alpha: float | None = field(
        default=None,
        metadata={
            "help": "`kd_loss=skew_kl` / `skew_reverse_kl` only: the share alpha of the other distribution mixed into "
            "the second argument of the KL (DistiLLM). Must be in [0, 1); 0 is the plain KL. Unset: 0.1, the "
            "paper's value; set with another kd_loss: refused."
        },
    )
    kd_weight: float | None = field(
        default=None,
        metadata={
            "help": "Weight of the logit-distillation term. 0 disables it (no teacher logits needed)."
            + _GIVEN_WINS.format(0.5) + _GENERATING.format(1.0)
        },
    )
    task_weight: float | None = field(
        default=None,
        metadata={
            "help": "Weight of the student's own task loss on the labels (the hard-label loss). 0 disables "
            "it, which is what task-agnostic distillation and TinyBERT's prediction stage do."
            + _GIVEN_WINS.format(0.5) + _GENERATING.format(0.0)
        },
    )
    kd_token_mask: str | None = field(
        default=None,
        metadata={
            "help": "For token-level logits (B, T, C): which positions the logit loss averages over. "
            "`attention`: every real token (attention_mask == 1); `labels`: only positions whose label "
            "is not -100, e.g. the masked tokens of MLM (DistilBERT's --restrict_ce_to_mask) or the completion "
            "of a prompt-masked SFT row. Default: `labels` for a causal-LM student (the tokens its own loss counts: "
            "the completion where the labels mask the prompt with -100, every real token where they mask only "
            "padding; every real token for a batch without labels), `attention` for other token-level heads, filled "
            "in by DistillationTrainer. Refused for heads without token-level logits (sequence classification, "
            "regression, question answering), where it does nothing. Encoder-decoder "
            "LMs count decoder positions: `labels` as above, `attention` the decoder_attention_mask when the batch "
            "has one, else the same label positions."
        },
    )
    distill_terms: list[str] | None = field(
        default=None,
        metadata={
            "help": "Intermediate-layer terms. Each is `key=value` pairs separated by commas on the "
            "command line, or a mapping in YAML/JSON. Keys: loss (hidden_mse, cosine_loss, "
            "attention_score_mse, relation_kl, pkd_loss, incremental_mse), layers (uniform, last, or "
            "student:teacher pairs separated by `;`, layer 0 being the embeddings), weight, name, and for "
            "relation_kl: "
            "relations (qq, kk, vv, qk separated by `;`) and relation_heads; for encoder-decoder models, stack "
            "(encoder or decoder: the stack whose layers the term compares). Example: "
            "`loss=hidden_mse,layers=uniform,weight=1`. Default: none, or the preset's terms; an empty list "
            "(`[]` in YAML or Python) removes the preset's terms."
        },
    )
    distill_preset: str | None = field(
        default=None,
        metadata={
            "help": "Fill the loss fields you do not give (temperature, kd_loss, kd_weight, task_weight, "
            "projection, distill_terms) as a published recipe does: distilbert, tinybert_intermediate, "
            "tinybert_prediction, minilm, minilmv2 (see hf_distill.presets). A value you give as a keyword, "
            "flag or YAML key always wins, even one equal to the default. dataclasses.replace keeps the "
            "values of the replaced arguments (the preset is not applied again)."
        },
    )
    projection: str | None = field(
        default=None,
        metadata={
            "help": "How student features are mapped to the teacher's width when hidden sizes differ: "
            "`shared` (one Linear for all layers, TinyBERT's fit_dense), `per_layer` (one Linear per "
            "student layer) or `none` (refuse: sizes must match)." + _GIVEN_WINS.format("shared")
        },
    )
    projection_lr: float | None = field(
        default=None,
        metadata={
            "help": "Learning rate of the projections. Defaults to `learning_rate`. Refused when the run trains no "
            "projection (no intermediate terms, or widths that already match)."
        },
    )
    teacher_weights: list[float] | None = field(
        default=None,
        metadata={
            "help": "With several teachers: one weight per teacher (normalised to sum to 1). Default: equal. "
            "Refused with a single teacher."
        },
    )
    multi_teacher: str | None = field(
        default=None,
        metadata={
            "help": "With several teachers: `probs` distils the weighted average of their softened distributions; "
            "`losses` sums one logit-distillation loss per teacher, weighted. Default (unset): `probs`. Refused "
            "with a single teacher."
        },
    )
    cross_tokenizer: str | None = field(
        default=None,
        metadata={
            "help": "Causal LMs whose teacher has another tokenizer than the student: how the KD term compares them "
            "(hf_distill.losses.cross_tokenizer). `uld`: Universal Logit Distillation (Boizard et al. 2024), the L1 "
            "distance between the two next-token distributions sorted in decreasing order (the shorter vocabulary "
            "zero-padded), the k-th distilled position of the student paired with the teacher's k-th, truncated to "
            "the shorter; `kd_loss` does not apply (leave it at `kl`). `aligned`: positions where both "
            "tokenizations end at the same character are paired, and `kd_loss` compares the two distributions "
            "restricted to the tokens both vocabularies hold (identical strings), each renormalised there; it needs "
            "both tokenizers (processing_class, teacher_processing_class). Either needs the teacher's own "
            "tokenization in every batch: use `hf_distill.data.cross_tokenizer.CrossTokenizerCollator` (with "
            "remove_unused_columns=False, so that the text column reaches it). Default: unset, and a teacher whose "
            "tokenizer differs from the student's is refused. Refused for other heads than causal LMs, with several "
            "teachers, distill_terms, kd_chunk_size or kd_weight=0."
        },
    )
    lmbda: float = field(
        default=0.0,
        metadata={
            "help": "Causal LMs: the probability that a micro-batch's completions are generated by the student itself "
            "(on-policy distillation, GKD, Agarwal et al. 2024). Its prompts are completed with `generate` once per "
            "optimizer step, before the step's tokens are counted, and KD covers the generated tokens only. 0: "
            "off-policy, the dataset's completions (default); 1: always the student's. Must be in [0, 1]. Needs "
            "prompt rows (`hf_distill.data.prompts.PromptCompletionCollator`) and a teacher model. With lmbda > 0 (or "
            "seq_kd), kd_weight and task_weight default to 1 and 0 (GKD's loss) where not given."
        },
    )
    seq_kd: bool = field(
        default=False,
        metadata={
            "help": "Sequence-level KD (Kim & Rush 2016): the micro-batches the student does not complete (probability "
            "1 - lmbda) are completed by the (first) teacher instead of keeping the dataset's completions, as in "
            "TRL's GKD. Causal LMs only; needs what `lmbda` needs."
        },
    )
    max_new_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Generation (lmbda > 0 or seq_kd): the most tokens generated per completion. Unset: 128 (TRL's "
            "GKD). Must be > 0; refused when nothing is generated, and where a prompt plus max_new_tokens would not "
            "fit the positions (max_position_embeddings) of the student or a teacher (checked on the first rows "
            "when the trainer is built, then on each generated batch)."
        },
    )
    generation_temperature: float | None = field(
        default=None,
        metadata={
            "help": "Generation: the sampling temperature of the completions (not the KD `temperature`). 0 decodes "
            "greedily. Unset: 1.0, the model's own distribution. Must be >= 0; refused when nothing is generated."
        },
    )
    top_p: float | None = field(
        default=None,
        metadata={
            "help": "Generation: nucleus sampling, the smallest set of tokens holding this much probability. Unset: "
            "1.0 (every token). Must be in (0, 1]; refused when nothing is generated or with greedy decoding."
        },
    )
    stop_token_ids: list[int] | None = field(
        default=None,
        metadata={
            "help": "Generation: the token ids that end a completion (generate's `eos_token_id`); a completion keeps "
            "its first stop token and nothing after it. Unset: the tokenizer's `eos_token_id` and every id of the "
            "student's `generation_config.eos_token_id` (where its own generate stops). Refused when nothing is "
            "generated."
        },
    )
    # -- a teacher behind a URL (teacher_model="http://host:port/v1"; hf_distill.serving, issue #42)
    teacher_top_k: int = field(
        default=64,
        metadata={"help": "Served teacher: the log-probabilities asked per position (k of the top-k + tail signal)."},
    )
    teacher_protocol: str | None = field(
        default=None,
        metadata={"help": "Served teacher: `vllm` (OpenAI completions with prompt_logprobs), `sglang` (native "
                  "/generate) or `hf_distill` (hf-distill teacher serve). Unset: detected from the server."},
    )
    teacher_api_key_env: str | None = field(
        default=None,
        metadata={"help": "Served teacher: the NAME of the environment variable holding the API key (sent as a "
                  "bearer token; the key itself is never stored or logged)."},
    )
    teacher_retries: int = field(
        default=3, metadata={"help": "Served teacher: retries of a request after a connection error, a time-out or "
                             "a 5xx answer (exponential backoff), before training stops."})
    teacher_timeout: float = field(
        default=60.0, metadata={"help": "Served teacher: seconds one request may take."})
    teacher_backoff: float = field(
        default=0.5, metadata={"help": "Served teacher: seconds before the first retry, doubled at each retry."})
    teacher_requests: int = field(
        default=4, metadata={"help": "Served teacher: requests in flight at once (one per micro-batch)."})
    teacher_prefetch: bool = field(
        default=True, metadata={"help": "Served teacher: send the next optimizer step's requests while the current "
                                "step computes (its completions generated on-policy are sent once generated)."})
    distillation_token: str | None = field(
        default=None,
        metadata={
            "help": "A student with DeiT's class and distillation tokens (`cls_classifier` + "
            "`distillation_classifier`, transformers' DeiTForImageClassificationWithTeacher): the task loss trains "
            "the class head and the KD term the distillation head, against the teacher's argmax (`hard`, DeiT's "
            "best) or its softened distribution (`soft`: kd_loss at temperature). Unset: `hard`. Refused for a "
            "student without both heads (it would do nothing)."
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
        self._resolve_preset()
        super().__post_init__()
        self._validate_distillation()

    def _resolve_preset(self) -> None:
        """Replace every field left at None ("not given") by the preset's value, else by its plain default (for
        `kd_weight` and `task_weight` of a run that generates, `GENERATION_DEFAULTS`). Done once, here: the values
        are then validated and stay what they are for the whole run (a callback changing `lmbda` changes none)."""
        from .presets import preset_values

        preset = preset_values(self.distill_preset) if self.distill_preset is not None else {}
        lmbda = self.lmbda  # validated later (validate_generation_arguments); here only read if it is a number
        generates = bool(self.seq_kd) or (isinstance(lmbda, int | float) and not isinstance(lmbda, bool) and lmbda > 0)
        defaults = {**PRESET_DEFAULTS, **GENERATION_DEFAULTS} if generates else PRESET_DEFAULTS
        for name, default in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, preset.get(name, default))
        for name in HEAD_DEFAULTS:  # else left to the run's settings, once the student is known
            if getattr(self, name) is None and name in preset:
                setattr(self, name, preset[name])
        if self.distill_terms is None and "distill_terms" in preset:
            self.distill_terms = copy.deepcopy(preset["distill_terms"])

    @classmethod
    def from_training_arguments(cls, args: TrainingArguments, **distillation: Any) -> DistillationArguments:
        """`args` as DistillationArguments: every TrainingArguments field keeps its value (including ones set on
        the object after it was built), the distillation fields come from `distillation` or their defaults.

        Why: a script written for `Trainer` should only have to swap the trainer class. Fields that a
        TrainingArguments subclass adds cannot be kept, so they are refused rather than dropped."""
        if isinstance(args, cls):
            return dataclasses.replace(args, **distillation) if distillation else args
        if not isinstance(args, TrainingArguments):
            raise TypeError(f"DistillationArguments are built from TrainingArguments, got {type(args).__name__}.")
        ours = {f.name for f in dataclasses.fields(cls) if f.init}
        theirs = [f.name for f in dataclasses.fields(args) if f.init]
        lost = [name for name in theirs if name not in ours]
        if lost:
            raise TypeError(
                f"{type(args).__name__} has fields that DistillationArguments does not: {', '.join(lost)}. "
                f"Define `@dataclass class Args(DistillationArguments, {type(args).__name__})` and build that instead."
            )
        unknown = sorted(set(distillation) - ours)
        if unknown:
            raise TypeError(f"DistillationArguments has no field(s) {', '.join(unknown)}.")
        # Values already normalised by TrainingArguments.__post_init__ (enums, lists, dicts, AcceleratorConfig)
        # are accepted as they are by the same __post_init__, so the result's to_dict() equals the original's.
        values = {name: copy.deepcopy(getattr(args, name)) for name in theirs}
        return cls(**values, **distillation)

    def _validate_distillation(self) -> None:
        from .argument_checks import validate_distillation

        validate_distillation(self)

    def given(self, name: str) -> bool:
        """True when the field holds a value the user (or the preset) gave; the head defaults are filled in the run's
        settings (hf_distill.settings), never here."""
        return getattr(self, name) is not None

    @property
    def generates(self) -> bool:
        """Whether the run generates completions (on-policy `lmbda` > 0 or `seq_kd`), hf_distill.on_policy."""
        return self.lmbda > 0 or bool(self.seq_kd)

    @property
    def effective_jsd_beta(self) -> float:
        """`jsd_beta`, or its default when unset (a callback may switch `kd_loss` to `jsd` during training)."""
        return JSD_BETA_DEFAULT if self.jsd_beta is None else self.jsd_beta

    @property
    def terms(self) -> list[DistillTerm]:
        """The intermediate-layer terms as objects (parsed from `distill_terms`)."""
        return parse_terms(self.distill_terms or [])

    @property
    def resolved_skew_alpha(self) -> float:
        """`skew_alpha`, or DistiLLM's 0.1 when unset."""
        return DEFAULT_SKEW_ALPHA if self.skew_alpha is None else float(self.skew_alpha)

    def distillation_summary(self) -> dict[str, Any]:
        """The distillation settings a model card or a results file should record."""
        return {
            "temperature": self.temperature,
            "kd_loss": self.kd_loss,
            **({"jsd_beta": self.effective_jsd_beta} if self.kd_loss in JSD_KINDS else {}),
            **({"skew_alpha": self.resolved_skew_alpha} if self.kd_loss in SKEW_KINDS else {}),
            "kd_weight": self.kd_weight,
            "task_weight": self.task_weight,
            "distill_preset": self.distill_preset,
            "distill_terms": self.distill_terms or [],
            "projection": self.projection,
            "teacher_weights": self.teacher_weights,
            "multi_teacher": self.multi_teacher or "probs",
            **({"cross_tokenizer": self.cross_tokenizer} if self.cross_tokenizer else {}),
            **({"lmbda": self.lmbda, "seq_kd": self.seq_kd} if self.generates else {}),
        }


def as_distillation_arguments(
    args: TrainingArguments | None,
    who: str = "DistillationTrainer",
    cls: type[DistillationArguments] | None = None,
    accepts: str = "TrainingArguments",
    noted: tuple[str, ...] = (),
) -> DistillationArguments:
    """`args` as `cls` (DistillationArguments or a trainer's subclass of it): unchanged if they already are, its
    defaults for None, and other TrainingArguments upgraded (every field kept, distillation defaults) with a warning
    that says which loss the run will use, so that swapping the trainer class is all a script has to change.

    `accepts` names the plain arguments `who` takes (for the error), `noted` fields of theirs the warning repeats
    (e.g. `packing`) so the log shows they survived the upgrade."""
    cls = DistillationArguments if cls is None else cls
    if args is None:
        return cls(output_dir="trainer_output")
    if isinstance(args, cls):
        return args
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"{who} needs {cls.__name__} (or {accepts}), got {type(args).__name__}.")
    upgraded = cls.from_training_arguments(args)
    settings = ", ".join(f"{name}={getattr(upgraded, name)!r}" for name in PRESET_DEFAULTS)
    kept = f" ({', '.join(f'{name}={getattr(upgraded, name)!r}' for name in noted)})" if noted else ""
    logger.warning(
        f"{who} got {type(args).__name__}; upgraded them to {cls.__name__} with every field kept{kept} and the "
        f"distillation defaults ({settings}; temperature and kd_token_mask by the student's head, see "
        f"DistillationArguments). Pass {cls.__name__} to choose the loss."
    )
    return upgraded
