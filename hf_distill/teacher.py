"""The teacher: loading it, freezing it, and checking that it fits the student.

Placement (replica or shard) is `hf_distill.placement`'s job. A teacher that does not fit the student
(vocabulary, label set) fails here, before training, with the fix in the message.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import transformers
from torch import nn

from .taps import unwrap

# Auto classes tried, most specific first, to load a teacher "like" the student.
_AUTO_CLASSES = (
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "AutoModelForQuestionAnswering",
    "AutoModelForMaskedLM",
    "AutoModelForCausalLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForMultipleChoice",
)


def load_teacher(name_or_path: str, like: nn.Module | None = None, **kwargs) -> nn.Module:
    """Load a teacher with the auto class whose head matches the student's (`like`).

    A folder holding a PEFT adapter (`adapter_config.json`) loads as base + adapter through peft's matching
    `AutoPeftModelFor...` class, unmerged (`merge_and_unload()` it first
    for a faster teacher forward). A checkpoint that lacks weights of the model it loads into (a base or MLM
    checkpoint without the student's classifier) is refused: its head would be random, and so its targets."""
    auto_name = "AutoModel"
    student = unwrap(like) if like is not None else None
    for name in _AUTO_CLASSES:
        if student is not None and type(student) in getattr(transformers, name)._model_mapping.values():
            auto_name = name
            break
    if os.path.isfile(os.path.join(name_or_path, "adapter_config.json")):
        import peft

        peft_cls = getattr(peft, auto_name.replace("AutoModel", "AutoPeftModel"), peft.AutoPeftModel)
        return peft_cls.from_pretrained(name_or_path, **kwargs)
    kwargs.pop("output_loading_info", None)
    teacher, info = getattr(transformers, auto_name).from_pretrained(name_or_path, output_loading_info=True, **kwargs)
    new = sorted(info.get("missing_keys") or []) + sorted(k[0] if isinstance(k, tuple) else k
                                                         for k in info.get("mismatched_keys") or [])
    if new:
        raise ValueError(
            f"The teacher {name_or_path} lacks weights of {type(teacher).__name__}, which were initialised at "
            f"random: {', '.join(new)}. A teacher with a random head teaches noise. Fine-tune the teacher on the "
            "task first (or pass the fine-tuned checkpoint, with its head) and give that as teacher_model."
        )
    return teacher


def shares_parameters(a: nn.Module, b: nn.Module) -> bool:
    """True when two models hold the same parameter tensors: self-distillation on one PEFT base."""
    ids = {id(p) for p in a.parameters()}
    return any(id(p) in ids for p in b.parameters())


@contextlib.contextmanager
def shared_base_teacher(model: nn.Module) -> Iterator[nn.Module]:
    """Run a shared-base teacher: adapters off and every module in eval mode for the forward only.

    Calling `.eval()` on a model the student shares would switch the student's dropout off for the rest of
    training (trl PR #5862); instead each module's mode is restored on exit, and so are the adapters."""
    inner = model
    while hasattr(inner, "module") and isinstance(inner.module, nn.Module):
        inner = inner.module
    modes = [(m, m.training) for m in inner.modules()]
    disable = inner.disable_adapter() if hasattr(inner, "disable_adapter") else contextlib.nullcontext()
    try:
        for m, _ in modes:
            m.training = False
        with disable:
            yield inner
    finally:
        for m, training in modes:
            m.training = training


def _default_id2label(id2label: dict) -> bool:
    return all(str(v) == f"LABEL_{k}" for k, v in id2label.items())


def validate_pair(student: nn.Module, teacher: nn.Module, args, tokenizer=None) -> int | None:
    """Refuse teacher/student pairs whose outputs or inputs cannot be compared.

    Returns the number of leading vocabulary ids the token-level logits are compared on when the two vocabulary
    sizes differ but the tokenizer is shared (sizes of one family padded differently, e.g. 151,936 vs 152,064),
    else None."""
    s_cfg = getattr(unwrap(student), "config", None)
    t_cfg = getattr(unwrap(teacher), "config", None)
    if s_cfg is None or t_cfg is None:
        return None
    from .heads import Head, static_head

    s_kind, t_kind = static_head(student), static_head(teacher)
    if Head.SEQ2SEQ_LM in (s_kind, t_kind):
        check_seq2seq_pair(student, teacher, args)
    if s_kind is Head.CAUSAL_LM and t_kind is not Head.CAUSAL_LM and args.kd_weight > 0:
        raise ValueError(
            f"The student is a causal LM but the teacher is a {type(unwrap(teacher)).__name__}: next-token logits "
            "can only be distilled from a causal-LM teacher. Load the teacher with AutoModelForCausalLM."
        )
    shared = None
    s_vocab, t_vocab = getattr(s_cfg, "vocab_size", None), getattr(t_cfg, "vocab_size", None)
    if s_vocab is not None and t_vocab is not None and s_vocab != t_vocab:
        get_head = getattr(unwrap(student), "get_output_embeddings", None)
        token_level = get_head is not None and get_head() is not None
        if token_level and args.kd_weight > 0:
            shared = _shared_vocabulary(s_cfg, t_cfg, teacher, tokenizer)
        elif s_vocab > t_vocab:
            raise ValueError(
                f"The student's vocabulary ({s_vocab}) is larger than the teacher's ({t_vocab}): the teacher "
                "is fed the student's input ids and would index past its embedding table. Give both models "
                "the same tokenizer."
            )
    s_head, t_head = type(unwrap(student)).__name__, type(unwrap(teacher)).__name__
    for suffix in ("ForSequenceClassification", "ForTokenClassification"):
        if s_head.endswith(suffix) and t_head.endswith(suffix):
            if s_cfg.num_labels != t_cfg.num_labels:
                raise ValueError(
                    f"The teacher has {t_cfg.num_labels} labels and the student {s_cfg.num_labels}: their logits "
                    f"cannot be compared. Build the student with num_labels={t_cfg.num_labels}."
                )
            s_map, t_map = s_cfg.id2label, t_cfg.id2label
            if not _default_id2label(s_map) and not _default_id2label(t_map) and s_map != t_map:
                raise ValueError(
                    f"The teacher's labels {t_map} and the student's {s_map} differ in names or order, so logit "
                    "k would not mean the same class. Give the student the teacher's id2label/label2id."
                )
    return shared


def _shared_vocabulary(s_cfg, t_cfg, teacher: nn.Module, tokenizer) -> int:
    """The ids both models can compare when their vocabulary sizes differ: only with one tokenizer."""
    s_vocab, t_vocab = s_cfg.vocab_size, t_cfg.vocab_size
    sizes = f"Vocabulary sizes differ (student {s_vocab}, teacher {t_vocab})"
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        raise ValueError(
            f"{sizes}, so token-level logits can be compared only if both models use one tokenizer (then on their "
            "shared first ids). Pass the student's tokenizer as processing_class so that this can be checked, or "
            "use the teacher's vocabulary for the student (students.shrink / from_teacher keep it)."
        )
    t_tokenizer = _teacher_tokenizer(teacher)
    if t_tokenizer is not None and t_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"{sizes} and the teacher's tokenizer ({getattr(t_tokenizer, 'name_or_path', '?')}) is not the "
            "student's: the same id means different tokens, so their logits cannot be compared. Distil with one "
            "tokenizer (cross-tokenizer distillation is not supported)."
        )
    shared = min(s_vocab, t_vocab)
    if len(tokenizer) > shared:
        raise ValueError(
            f"{sizes} and the tokenizer has {len(tokenizer)} tokens, more than the smaller model knows: use a "
            "tokenizer that fits both models' vocabularies."
        )
    special = ("bos_token_id", "eos_token_id", "pad_token_id")
    if t_tokenizer is None and any(getattr(s_cfg, k, None) != getattr(t_cfg, k, None) for k in special):
        raise ValueError(
            f"{sizes} and the configs disagree on {', '.join(special)}: the models look tokenized differently. "
            "Distil with one tokenizer (save it with the teacher so that it can be compared)."
        )
    return shared


def _teacher_tokenizer(teacher: nn.Module):
    """The tokenizer saved beside a teacher loaded from a local folder, if any (never a Hub lookup)."""
    path = getattr(getattr(unwrap(teacher), "config", None), "_name_or_path", "") or ""
    if not os.path.isdir(path):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def check_seq2seq_pair(student: nn.Module, teacher: nn.Module, args) -> None:
    """Refuse an encoder-decoder student or teacher whose partner cannot be compared with it: logit KD needs two
    encoder-decoder LMs reading the same decoder inputs (the same decoder start token)."""
    from .heads import Head, static_head

    s_kind, t_kind = static_head(student), static_head(teacher)
    if (s_kind is Head.SEQ2SEQ_LM) == (t_kind is Head.SEQ2SEQ_LM):
        s_start = getattr(unwrap(student).config, "decoder_start_token_id", None)
        t_start = getattr(unwrap(teacher).config, "decoder_start_token_id", None)
        if s_kind is Head.SEQ2SEQ_LM and s_start != t_start:
            raise ValueError(
                f"The student's decoder starts with token {s_start} and the teacher's with {t_start} "
                "(config.decoder_start_token_id): both read the decoder inputs made from the labels by the student, "
                "so the teacher would start from a token it was not trained with. Use one tokenizer and set the "
                "student's decoder_start_token_id to the teacher's."
            )
        return
    if args.kd_weight > 0 or args.terms:
        seq2seq, other = (student, teacher) if s_kind is Head.SEQ2SEQ_LM else (teacher, student)
        raise ValueError(
            f"The {'student' if seq2seq is student else 'teacher'} is an encoder-decoder LM "
            f"({type(unwrap(seq2seq)).__name__}) but the {'teacher' if seq2seq is student else 'student'} is a "
            f"{type(unwrap(other)).__name__}: decoder-token logits and encoder/decoder layers can only be distilled "
            "between two encoder-decoder LMs. Load the teacher with AutoModelForSeq2SeqLM."
        )
