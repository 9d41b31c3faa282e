"""What a model's head is for, what it outputs, and which of its outputs the logit-distillation term compares.

`DistillationTrainer` distils any head a `Trainer` trains, but the right comparison depends on the head:
a softmax over classes (sequence or token classification, masked LM), a softmax over the *next* token
(causal LM: position t is compared where token t+1 is counted), independent sigmoids (multi-label), a
real number (regression: only `mse` makes sense), two softmaxes over positions (extractive QA:
the mean of the start and end terms, as DistilBERT and TextBrewer distil SQuAD), or a softmax over the
vocabulary at each decoder position of an encoder-decoder LM (T5, BART, Marian: position t predicts label t, no
shift). Anything else is refused with an error rather than distilled with the wrong loss.

One function, `head_kind`, says what a model's head is for, and one table, `HEADS`, says what each kind means to the
rest of the package (the loss head, the Auto and PEFT classes that load it, its Hub pipeline tag, whether its logits
are over `config.num_labels`). A kind is read from the config, as transformers' Auto classes read it: the task
mappings (`MODEL_FOR_*_MAPPING_NAMES`, keyed by `config.model_type`, plus classes registered with an Auto class and
a remote-code config's `auto_map`), `is_encoder_decoder`, `problem_type` and `num_labels`; a model they do not name
is judged by its structure (an LM head on a registered causal or encoder-decoder family) or, at its first forward,
by the shape of its logits. Class names are never parsed: a subclass or a custom class named anything is
recognised by what it is.
"""

from __future__ import annotations

import enum
import functools
import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..losses.registry import KindMap, KindNames
from .families import get_family
from .taps import unwrap

SOFTMAX_LOSSES = KindNames(softmax=True)  # the kd_loss kinds that compare softmax distributions (losses.registry)
MULTI_LABEL_LOSSES = KindMap("multi_label")  # kd_loss -> its per-label (sigmoid) form, where it has one


class Head(enum.Enum):
    """What the logit-distillation term compares (the loss side of a head kind)."""

    SEQUENCE = "single-label classification"
    TOKEN = "token-level logits (token classification, masked LM)"
    CAUSAL_LM = "causal LM (next-token logits)"
    MULTI_LABEL = "multi-label classification"
    REGRESSION = "regression"
    QUESTION_ANSWERING = "extractive question answering"
    SEQ2SEQ_LM = "encoder-decoder LM (decoder-token logits)"


TOKEN_LEVEL = (Head.TOKEN, Head.CAUSAL_LM, Head.SEQ2SEQ_LM)
"""Heads whose logits are (batch, positions, classes) and whose terms are means over counted positions."""


LOGIT_KEYS = {Head.QUESTION_ANSWERING: ("start_logits", "end_logits")}
"""Output fields holding the logits of heads that have more than `logits`."""


class HeadKind(enum.Enum):
    """What a model's head is for: the task an Auto class loads it for (`HEADS` holds what each means)."""

    SEQ2SEQ_LM = "seq2seq-lm"
    QUESTION_ANSWERING = "question-answering"
    CAUSAL_LM = "causal-lm"
    SEQUENCE_CLASSIFICATION = "sequence-classification"
    TOKEN_CLASSIFICATION = "token-classification"
    MASKED_LM = "masked-lm"
    MULTIPLE_CHOICE = "multiple-choice"
    AUDIO_CLASSIFICATION = "audio-classification"  # wav2vec2, HuBERT, AST heads (hf_distill.features.families_audio)
    IMAGE_CLASSIFICATION = "image-classification"  # issue #43 (vision): ViT, DeiT, BEiT, Swin, ConvNeXt, ResNet
    BASE = "base"  # no head: hidden states (feature extraction)

    @property
    def facts(self) -> HeadFacts:
        return HEADS[self]


@dataclass(frozen=True)
class HeadFacts:
    """What the package needs to know about one head kind."""

    mapping: str  # transformers' MODEL_FOR_*_MAPPING_NAMES that lists its classes per model_type
    auto_class: str  # the transformers Auto class that loads it (a teacher like the student; the card's usage)
    peft_class: str  # the peft class that loads base + adapter
    tasks: tuple[str, ...]  # Hub pipeline tags; the first is the tag of a student of this kind
    head: Head | None  # what logit KD compares (a sequence classifier's is refined by its config); None: its logits
    classifier: bool  # its logits are over config.num_labels (teacher and student must share the label set)
    encoder_decoder: bool | None = None  # the config.is_encoder_decoder it needs; None: either
    processor: str = "AutoTokenizer"  # the transformers class that loads its inputs' processor (the card's usage)

    @property
    def pipeline_tag(self) -> str:
        return self.tasks[0]

    @property
    def token_level(self) -> bool:
        return self.head in TOKEN_LEVEL


HEADS: dict[HeadKind, HeadFacts] = {  # in the order kinds are tried: a class in two mappings is the first one's
    HeadKind.SEQ2SEQ_LM: HeadFacts(
        "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM", "AutoPeftModelForSeq2SeqLM",
        # Tagged text2text-generation, as the Hub tags these classes when a card names no task: translation or
        # summarization follow from the data, not the class (a card can still say so with `tasks=`).
        ("text2text-generation", "translation", "summarization"), Head.SEQ2SEQ_LM, False, encoder_decoder=True),
    HeadKind.QUESTION_ANSWERING: HeadFacts(
        "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "AutoModelForQuestionAnswering",
        "AutoPeftModelForQuestionAnswering", ("question-answering",), Head.QUESTION_ANSWERING, False),
    HeadKind.CAUSAL_LM: HeadFacts(
        "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM", "AutoPeftModelForCausalLM",
        ("text-generation",), Head.CAUSAL_LM, False, encoder_decoder=False),
    HeadKind.SEQUENCE_CLASSIFICATION: HeadFacts(
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForSequenceClassification",
        "AutoPeftModelForSequenceClassification", ("text-classification",), Head.SEQUENCE, True),
    HeadKind.TOKEN_CLASSIFICATION: HeadFacts(
        "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "AutoModelForTokenClassification",
        "AutoPeftModelForTokenClassification", ("token-classification",), Head.TOKEN, True),
    HeadKind.MASKED_LM: HeadFacts(
        "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM", "AutoPeftModel", ("fill-mask",), Head.TOKEN,
        False),
    HeadKind.MULTIPLE_CHOICE: HeadFacts(
        "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES", "AutoModelForMultipleChoice", "AutoPeftModel",
        ("multiple-choice",), None, False),
    # Audio: a sequence head over the clip (single-label, or multi-label by problem_type / float labels); its input is
    # a waveform or a spectrogram (input_values) made by a feature extractor. peft has no audio Auto class.
    HeadKind.AUDIO_CLASSIFICATION: HeadFacts(
        "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "AutoModelForAudioClassification", "AutoPeftModel",
        ("audio-classification",), Head.SEQUENCE, True, processor="AutoFeatureExtractor"),
    # Images (issue #43): logits over config.num_labels, single- or multi-label by problem_type as text classifiers
    HeadKind.IMAGE_CLASSIFICATION: HeadFacts(
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification", "AutoPeftModel",
        ("image-classification",), Head.SEQUENCE, True, processor="AutoImageProcessor"),
    HeadKind.BASE: HeadFacts(
        "MODEL_MAPPING_NAMES", "AutoModel", "AutoPeftModel", ("feature-extraction",), None, False),
}

# hf_distill's own models, (model_type, architecture) -> the module that registers them with the Auto classes when
# imported, which a saved student's config.json alone does not do (a fresh process: "does not recognize this
# architecture"). Read here for a config's model_type, and by the model card's usage code for the architecture.
_OWN_MODELS = {("hf_distill_bilstm", "BiLSTMForSequenceClassification"): "hf_distill.students.bilstm"}


def registering_module(model_type: str | None = None, architecture: str | None = None) -> str | None:
    """The hf_distill module to import before the Auto classes know `model_type` or `architecture`; None for
    transformers' own."""
    return next((m for (t, a), m in _OWN_MODELS.items() if model_type == t or architecture == a), None)


def head_kind(model: nn.Module, logits: torch.Tensor | None = None) -> HeadKind | None:
    """What `model`'s head is for, read from its config (see the module's docstring); where the config does not
    tell (a plain module, a custom class no mapping names), from its structure and, given its `logits`, their shape
    ((batch, positions, classes): token-level; else a sequence head). None when nothing tells."""
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    kind = None
    if config is not None:
        kind = _kind_of(type(inner).__mro__, config)
        if kind is None:
            kind = _kind_from_structure(inner, config)
    if kind is None and logits is not None:
        kind = _shape_kind(logits)
    return kind


def class_kind(architecture: str | None, config: Any = None) -> HeadKind | None:
    """The head kind of a class known by name only (a saved config's `architectures`, a report's `architecture`),
    from the task mappings; `config` (a config or its `config.json` dict) adds its model_type, registered classes
    and `auto_map`."""
    if not architecture:
        return None
    return _kind_of((architecture,), config)


def kind_for_task(task: str | None) -> HeadKind | None:
    """The head kind whose Hub pipeline tags include `task` (a card's `pipeline_tag`)."""
    return next((kind for kind, facts in HEADS.items() if task in facts.tasks), None)


def static_head(model: nn.Module) -> Head | None:
    """What logit KD compares for `model`, as far as its config tells (no forward needed); None when its logits
    decide (`runtime_head`)."""
    inner = unwrap(model)
    return _loss_head(head_kind(inner), getattr(inner, "config", None))


def runtime_head(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor | None) -> Head:
    """The head of this batch. A sequence classifier without `problem_type` decides it from its labels at its
    first forward (transformers' rule: float labels with one column per class are multi-label); a plain module
    is judged by the shape of its logits."""
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    head = static_head(inner)
    if head is Head.SEQUENCE and getattr(config, "problem_type", None) is None:
        if labels is not None and labels.is_floating_point() and labels.dim() == 2 and labels.shape[-1] > 1:
            return Head.MULTI_LABEL
    if head is not None:
        return head
    if logits.dim() != 3 and logits.shape[-1] == 1:
        return Head.REGRESSION
    return _loss_head(_shape_kind(logits), None)  # also a multiple-choice or base model: its logits' shape


def is_causal_lm(model: nn.Module) -> bool:
    """A decoder-only LM over the next token (`AutoModelForCausalLM`'s classes)."""
    return head_kind(model) is HeadKind.CAUSAL_LM


def is_seq2seq_lm(model: nn.Module) -> bool:
    """An encoder-decoder with a language-model head over the decoder (`AutoModelForSeq2SeqLM`'s classes)."""
    return head_kind(model) is HeadKind.SEQ2SEQ_LM


def num_labels(model: nn.Module) -> int | None:
    """The classes a classifier's logits are over (`config.num_labels` of a sequence or token classifier; a plain
    module's own `num_labels`), else None: the width its logits must have, e.g. cached teacher logits."""
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    if config is None:
        return getattr(inner, "num_labels", None)
    kind = head_kind(inner)
    return config.num_labels if kind is not None and kind.facts.classifier and hasattr(config, "num_labels") else None


def _shape_kind(logits: torch.Tensor) -> HeadKind:
    """A head no config names, by its logits: (batch, positions, classes) are token-level, else one row per input."""
    return HeadKind.TOKEN_CLASSIFICATION if logits.dim() == 3 else HeadKind.SEQUENCE_CLASSIFICATION


def _loss_head(kind: HeadKind | None, config: Any) -> Head | None:
    if kind is None:
        return None
    head = kind.facts.head
    if head is Head.SEQUENCE:
        problem = getattr(config, "problem_type", None)
        if problem == "multi_label_classification":
            return Head.MULTI_LABEL
        if problem == "regression" or getattr(config, "num_labels", 2) == 1:
            return Head.REGRESSION
    return head


def _field(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def _names(value: Any) -> set[str]:
    """The class names of a task mapping entry (one name, or a tuple of them)."""
    if value is None:
        return set()
    return {value} if isinstance(value, str) else set(value)


def _kind_of(classes: Iterable[type | str], config: Any) -> HeadKind | None:
    """The first kind (in `HEADS` order) one of `classes` (an instance's MRO, or class names) is a class of."""
    from transformers.models.auto import modeling_auto

    classes = tuple(classes)
    names = {c if isinstance(c, str) else c.__name__ for c in classes}
    library = {c if isinstance(c, str) else c.__name__ for c in classes
               if isinstance(c, str) or c.__module__.startswith("transformers.")}
    model_type = _field(config, "model_type")
    encoder_decoder = _field(config, "is_encoder_decoder") if config is not None else None
    auto_map = _field(config, "auto_map") or {}
    config_class = _config_class(config, model_type)
    possible = [(kind, facts) for kind, facts in HEADS.items()
                if encoder_decoder is None or facts.encoder_decoder in (None, bool(encoder_decoder))]
    for kind, facts in possible:  # the task mappings, by model_type: transformers' own classes and their subclasses
        if names & _names(getattr(modeling_auto, facts.mapping).get(model_type)):
            return kind
    for kind, facts in possible:  # a class registered with the Auto class, or named by a remote-code config
        remote = auto_map.get(facts.auto_class) if isinstance(auto_map, dict) else None
        if isinstance(remote, str) and remote.rpartition(".")[2] in names:
            return kind
        if config_class is not None and names & _registered(facts, config_class):
            return kind
    for kind, _ in possible:  # a transformers class under a config of another model_type (a config subclass)
        if library & _mapped_names()[kind]:
            return kind
    return None


@functools.cache
def _mapped_names() -> dict[HeadKind, frozenset[str]]:
    """Every class name each kind's task mapping lists, whatever the model_type (the mappings are constants)."""
    from transformers.models.auto import modeling_auto

    return {kind: frozenset(name for value in getattr(modeling_auto, facts.mapping).values() for name in _names(value))
            for kind, facts in HEADS.items()}


def _config_class(config: Any, model_type: str | None) -> type | None:
    if config is not None and not isinstance(config, dict):
        return type(config)
    if not model_type:
        return None
    if (module := registering_module(model_type=model_type)) is not None:
        importlib.import_module(module)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except KeyError:
        return None


def _registered(facts: HeadFacts, config_class: type) -> set[str]:
    """The names of the classes the Auto class of `facts` loads for `config_class` beyond its built-in mapping
    (`AutoModelFor....register(config_class, model_class)`, remote code once loaded)."""
    from transformers.models.auto import modeling_auto

    if config_class.model_type in getattr(modeling_auto, facts.mapping):
        return set()  # a built-in entry (found by model_type): registering over it is refused by transformers
    try:
        found = getattr(modeling_auto, facts.mapping.removesuffix("_NAMES"))[config_class]
    except (KeyError, ImportError, AttributeError):  # not registered (or a built-in class that cannot load)
        return set()
    return {c.__name__ for c in (found if isinstance(found, tuple | list) else (found,))}


def _kind_from_structure(inner: nn.Module, config: Any) -> HeadKind | None:
    """A class no mapping names: an LM head (`get_output_embeddings`) on a family hf_distill knows as causal
    (or a config that says `is_decoder`) is a causal LM, on a registered encoder-decoder family a seq2seq LM.
    A bidirectional LM head needs no rule: its (batch, positions, vocab) logits are token-level by their shape."""
    get_head = getattr(inner, "get_output_embeddings", None)
    try:
        lm_head = get_head() if callable(get_head) else None
    except (AttributeError, NotImplementedError):
        lm_head = None
    if lm_head is None:
        return None
    family = get_family(getattr(config, "model_type", None))
    if getattr(config, "is_encoder_decoder", False):
        return HeadKind.SEQ2SEQ_LM if family is not None and family.stack("decoder") is not None else None
    if getattr(config, "is_decoder", False) or (family is not None and family.causal):
        return HeadKind.CAUSAL_LM
    return None


def check_kd_loss(head: Head | None, kd_loss: str, where: str = "the student") -> None:
    """Refuse a logit loss that is not defined for the head (before training, and again per batch)."""
    if head is Head.REGRESSION and kd_loss in SOFTMAX_LOSSES:
        raise ValueError(
            f"kd_loss={kd_loss!r} compares softmax distributions, but {where} has a regression head (one output, "
            "so its softmax is always 1 and the loss is 0 forever). Use kd_loss='mse' (the logit regression of "
            "Tang et al. 2019, Distilled BiLSTM)."
        )
    if head is Head.MULTI_LABEL and kd_loss in SOFTMAX_LOSSES and kd_loss not in MULTI_LABEL_LOSSES:
        raise ValueError(
            f"kd_loss={kd_loss!r} is not defined for multi-label heads. Use 'kl' (per-label binary KL against the "
            "teacher's sigmoid), 'soft_ce' (binary cross-entropy against it) or 'mse'."
        )
    if head is Head.QUESTION_ANSWERING and kd_loss == "mse":
        raise ValueError(
            "kd_loss='mse' is not supported for question-answering heads: span logits are compared as "
            "distributions over positions. Use kd_loss='kl' or 'soft_ce'."
        )


def head_logits(out: Any, head: Head) -> list[torch.Tensor]:
    """The output tensors the KD term compares: `[logits]`, or `[start_logits, end_logits]` for QA."""
    keys = LOGIT_KEYS.get(head)
    if keys is None:
        return [_logits(out)]
    values = [out.get(k) if isinstance(out, dict) else getattr(out, k, None) for k in keys]
    if any(v is None for v in values):
        raise ValueError(f"A {head.value} model must return {', '.join(keys)}.")
    return values


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        if "logits" not in out:
            raise ValueError(f"The model output has no `logits` (it has {', '.join(out)}).")
        return out["logits"]
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, tuple | list):
        return out[0]
    raise TypeError(f"Cannot find logits in the model output of type {type(out).__name__}.")


def with_decoder_inputs(model: nn.Module, inputs: dict[str, Any], label_name: str = "labels") -> dict[str, Any]:
    """`inputs` with the decoder's input ids made from the labels when the batch has none, as the model itself (and
    `DataCollatorForSeq2Seq(model=...)`) makes them: teacher and student then read the same decoder inputs, also
    when the student is not given the labels (`task_weight=0`)."""
    labels = inputs.get(label_name)
    if "decoder_input_ids" in inputs or "decoder_inputs_embeds" in inputs or not isinstance(labels, torch.Tensor):
        return inputs
    prepare = getattr(unwrap(model), "prepare_decoder_input_ids_from_labels", None)
    if prepare is None:
        raise ValueError(
            f"The batch has no decoder_input_ids and {type(unwrap(model)).__name__} cannot make them from the labels "
            "(no prepare_decoder_input_ids_from_labels): give DataCollatorForSeq2Seq the model (model=student) or "
            "add decoder_input_ids to the batch."
        )
    return {**inputs, "decoder_input_ids": prepare(labels=labels)}
