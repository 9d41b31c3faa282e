"""The teacher: loading it, freezing it, and checking that it fits the student.

Placement (replica or shard) is `hf_distill.placement`'s job. A teacher that does not fit the student
(vocabulary, label set) fails here, before training, with the fix in the message.

Vocabularies. The teacher reads the student's input ids and its logit k is compared with the student's logit k,
so id k must mean the same token for both. Tokenizers are compared by their vocabulary (id -> token, added and
special tokens included) whatever the sizes: the student's is the trainer's `processing_class`, the teacher's is
`teacher_processing_class`, else the one saved beside a teacher given as a folder or Hub id, else the one at an
in-memory teacher's `name_or_path` (a local folder, or a Hub id already in the local cache: no download). When
either cannot be known a warning says so; nothing is guessed. Vocabulary sizes may differ only by padding rows
(sizes of one family padded differently, e.g. 151,936 vs 152,064): the tokenizer must fit the smaller model, and
the trainer measures the teacher's probability on its extra ids on the first distilled batch
(`check_padding_mass`), refusing more than `PADDING_MASS_BOUND`. None of this applies with `cross_tokenizer` (causal
LMs, hf_distill.losses.cross_tokenizer): the teacher then reads its own tokenization of the same text.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import transformers
from torch import nn
from transformers.utils import logging

from .base.tokenizer_files import TOKENIZER_FILES, lacks_tokenizer
from .features.taps import unwrap

if TYPE_CHECKING:
    from .features.heads import HeadKind

logger = logging.get_logger(__name__)

PADDING_MASS_BOUND = 1e-4
"""The most probability (temperature 1, mean over the first distilled batch's counted tokens) a teacher may put on
the ids the student lacks for them to count as padding rather than tokens."""

def load_teacher(name_or_path: str, like: nn.Module | None = None, kind: HeadKind | None = None,
                 **kwargs: Any) -> nn.Module:
    """Load a teacher with the auto class whose head matches the student's (`like`), or of head kind `kind` (a
    `hf_distill.features.heads.HeadKind`, for callers without a student yet, such as `hf-distill auto`).

    A folder holding a PEFT adapter (`adapter_config.json`) loads as base + adapter through peft's matching
    `AutoPeftModelFor...` class, unmerged (`merge_and_unload()` it first
    for a faster teacher forward). A checkpoint that lacks weights of the model it loads into (a base, MLM or
    causal-LM checkpoint without the student's classifier) is refused: its head would be random, and so its
    targets."""
    from .features.heads import HeadKind, head_kind

    if not os.path.exists(name_or_path) and re.match(r"^[\w.-]+:\d+(/|$)", name_or_path):  # a Hub id has no ":"
        raise ValueError(f"teacher_model={name_or_path!r} reads as a server address without its scheme: write "
                         f"'http://{name_or_path}' for a teacher behind a URL, or give a folder or Hub id.")
    if kind is None:
        kind = (head_kind(like) if like is not None else None) or HeadKind.BASE
    auto_name = kind.facts.auto_class
    if os.path.isfile(os.path.join(name_or_path, "adapter_config.json")):
        import peft

        peft_cls = getattr(peft, kind.facts.peft_class)
        return peft_cls.from_pretrained(name_or_path, **kwargs)
    kwargs.pop("output_loading_info", None)
    teacher, info = getattr(transformers, auto_name).from_pretrained(name_or_path, output_loading_info=True, **kwargs)
    new = sorted(info.get("missing_keys") or []) + sorted(k[0] if isinstance(k, tuple) else k
                                                         for k in info.get("mismatched_keys") or [])
    if new:
        raise ValueError(
            f"The teacher {name_or_path} lacks weights of {type(teacher).__name__}, which were initialised at "
            f"random: {', '.join(new)}. A teacher with a random head teaches noise. Fine-tune the teacher on the "
            "task first (or pass the fine-tuned checkpoint, with its head) and give that as the teacher."
        )
    return teacher


def loaded_as_another_class(model: nn.Module) -> list[str] | None:
    """The architectures a model's config names when the model's own class is not among them, else None.

    `from_pretrained` keeps the checkpoint's `config.architectures`, so a classifier loaded from a base or causal-LM
    checkpoint still names that class: the head it lacked was initialised at random. Saving the model (which a
    Trainer does at its checkpoints) writes its own class there, so a head fine-tuned in memory and saved since is
    not reported; one fine-tuned in memory and never saved is (a false alarm, hence a warning where this is used)."""
    inner = unwrap(model)
    names = getattr(getattr(inner, "config", None), "architectures", None)
    if not names or type(inner).__name__ in names:
        return None
    return list(names)


def shares_parameters(a: nn.Module, b: nn.Module) -> bool:
    """True when two models hold the same parameter tensors: self-distillation on one PEFT base."""
    ids = {id(p) for p in a.parameters()}
    return any(id(p) in ids for p in b.parameters())


def _adapter_host(model: nn.Module) -> nn.Module:
    """The model inside DDP-style wrappers: the PEFT model itself, whose `disable_adapter` switches its adapters off."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def switches_adapters_off(model: nn.Module) -> bool:
    """Whether `shared_base_teacher` can run `model` as a teacher distinct from the student it shares (a PEFT model)."""
    return callable(getattr(_adapter_host(model), "disable_adapter", None))


@contextlib.contextmanager
def shared_base_teacher(model: nn.Module) -> Iterator[nn.Module]:
    """Run a shared-base teacher: adapters off and every module in eval mode for the forward only.

    Calling `.eval()` on a model the student shares would switch the student's dropout off for the rest of
    training (trl PR #5862); instead each module's mode is restored on exit, and so are the adapters."""
    inner = _adapter_host(model)
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


def validate_pair(
    student: nn.Module, teacher: nn.Module, args, tokenizer=None, teacher_tokenizer=None, source: str | None = None
) -> int | None:
    """Refuse teacher/student pairs whose outputs or inputs cannot be compared.

    `tokenizer` is the student's (the trainer's processing_class), `teacher_tokenizer` the teacher's if the user
    gave it, `source` the folder or Hub id the teacher was loaded from. Returns the number of leading vocabulary
    ids the token-level logits are compared on when the two vocabulary sizes differ but the tokenizer is shared
    (sizes of one family padded differently, e.g. 151,936 vs 152,064), else None."""
    s_cfg = getattr(unwrap(student), "config", None)
    t_cfg = getattr(unwrap(teacher), "config", None)
    t_tokenizer = None
    # With `cross_tokenizer` the teacher reads its own tokenization (hf_distill.losses.cross_tokenizer): ids and
    # vocabulary sizes need not agree.
    cross = getattr(args, "cross_tokenizer", None)
    from .features.heads import head_kind

    # An audio or image student reads no token ids: no tokenizer to compare (their processors are compared by
    # hf_distill.data.audio / hf_distill.data.image_inputs)
    kind = head_kind(student)
    reads_text = (kind is None or kind.facts.processor == "AutoTokenizer") and getattr(
        unwrap(student), "main_input_name", "input_ids") == "input_ids"
    if not shares_parameters(student, teacher) and not cross and reads_text:  # self-distillation: one tokenizer
        t_tokenizer = _compare_tokenizers(tokenizer, teacher, teacher_tokenizer, source)
    if s_cfg is None or t_cfg is None:
        return None
    from .features.heads import Head, head_kind, static_head

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
    if not cross and s_vocab is not None and t_vocab is not None and s_vocab != t_vocab:
        get_head = getattr(unwrap(student), "get_output_embeddings", None)
        token_level = get_head is not None and get_head() is not None
        if token_level and args.kd_weight > 0:
            shared = _shared_vocabulary(s_cfg, t_cfg, t_tokenizer, tokenizer)
        elif s_vocab > t_vocab:
            raise ValueError(
                f"The student's vocabulary ({s_vocab}) is larger than the teacher's ({t_vocab}): the teacher "
                "is fed the student's input ids and would index past its embedding table. Give both models "
                "the same tokenizer."
            )
    s_head = head_kind(student)
    if s_head is not None and s_head.facts.classifier and head_kind(teacher) is s_head:
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


def check_cross_tokenizer(
    method: str | None, student: nn.Module, teachers: list[nn.Module], shared_base: bool, tokenizer: Any,
    teacher_tokenizers: list[Any], sources: list[str | None],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Refuse `cross_tokenizer` where it cannot work (another head than a causal LM, not exactly one teacher model,
    the student's own base as teacher). For "aligned", returns the (student ids, teacher ids) of the tokens both
    tokenizers hold (hf_distill.losses.cross_tokenizer.shared_vocabulary); else None."""
    if method is None:
        return None
    from .features.heads import Head, static_head
    from .losses.cross_tokenizer import shared_vocabulary

    why = None
    if static_head(student) is not Head.CAUSAL_LM:
        why = f"the student ({type(unwrap(student)).__name__}) is not a causal LM"
    elif len(teachers) != 1:
        why = (f"it needs exactly one teacher model, which reads its own tokenization; got {len(teachers)} (cached "
               "teacher outputs cannot be used: they are on the teacher's positions)")
    elif shared_base:
        why = "the teacher is the student's own base (one tokenizer): leave cross_tokenizer unset"
    if why is not None:
        raise ValueError(f"cross_tokenizer={method!r} cannot be used: {why}.")
    if method != "aligned":
        return None
    s_tok = student_tokenizer(tokenizer)
    t_tok, where = teacher_tokenizer(teachers[0], teacher_tokenizers[0], sources[0])
    if s_tok is None or t_tok is None:
        missing = "the student's (processing_class)" if s_tok is None else f"the teacher's ({where})"
        raise ValueError(
            "cross_tokenizer='aligned' compares the tokens both vocabularies hold, so it needs both tokenizers, but "
            f"{missing} is unknown. Pass processing_class=<student tokenizer> and "
            "teacher_processing_class=<teacher tokenizer>."
        )
    shared = shared_vocabulary(s_tok, t_tok)
    n, s_size, t_size = len(shared[0]), len(s_tok.get_vocab()), len(t_tok.get_vocab())
    logger.info(
        f"cross_tokenizer='aligned': the tokenizers share {n} token strings ({n / s_size:.1%} of the student's "
        f"{s_size}, {n / t_size:.1%} of the teacher's {t_size}); the KD term compares the two distributions on "
        "those only. Identical strings can still mean different things (docs/guides/causal-lm.md).")
    return shared


def _shared_vocabulary(s_cfg, t_cfg, t_tokenizer, tokenizer) -> int:
    """The ids both models can compare when their vocabulary sizes differ: only with one tokenizer (compared in
    `_compare_tokenizers` where the teacher's is known), and only padding beyond the smaller size (the trainer
    measures the teacher's mass there on the first batch)."""
    s_vocab, t_vocab = s_cfg.vocab_size, t_cfg.vocab_size
    sizes = f"Vocabulary sizes differ (student {s_vocab}, teacher {t_vocab})"
    tokenizer = student_tokenizer(tokenizer)
    if tokenizer is None:
        raise ValueError(
            f"{sizes}, so token-level logits can be compared only if both models use one tokenizer (then on their "
            "shared first ids). Pass the student's tokenizer as processing_class so that this can be checked, or "
            "use the teacher's vocabulary for the student (students.shrink / from_teacher keep it)."
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


def student_tokenizer(processing_class: Any):
    """The tokenizer in a Trainer's `processing_class` (a tokenizer, or a processor holding one), else None."""
    if processing_class is None:
        return None
    if hasattr(processing_class, "get_vocab"):
        return processing_class
    inner = getattr(processing_class, "tokenizer", None)
    return inner if hasattr(inner, "get_vocab") else None


def teacher_tokenizer(teacher: nn.Module, given: Any = None, source: str | None = None) -> tuple[Any, str]:
    """The teacher's tokenizer and where it came from, or (None, why it cannot be known).

    In order: `given` (`teacher_processing_class`); the tokenizer saved at `source`, the folder or Hub id the
    trainer loaded the teacher from (the user asked for that id, so it may be downloaded like the model); the one at
    the teacher's `name_or_path` when that is a local folder or a Hub id in the local cache (an in-memory teacher:
    never a download)."""
    if given is not None:
        found = student_tokenizer(given)
        if found is None:
            raise TypeError(
                "teacher_processing_class must be a tokenizer (or a processor holding one), got "
                f"{type(given).__name__}."
            )
        return found, "teacher_processing_class"
    if source is not None:
        return _load_tokenizer(str(source), local_only=False, what=f"the teacher's {source}")
    inner = unwrap(teacher)
    path = getattr(inner, "name_or_path", "") or getattr(getattr(inner, "config", None), "name_or_path", "") or ""
    if not path:
        return None, "the teacher was given as a model without a name_or_path (built from a config)"
    return _load_tokenizer(path, local_only=not os.path.isdir(path), what=f"the teacher's name_or_path {path}")


def _load_tokenizer(path: str, local_only: bool, what: str) -> tuple[Any, str]:
    from transformers import AutoTokenizer

    if lacks_tokenizer(path):  # transformers 5 would build an empty tokenizer (hf_distill.base.tokenizer_files)
        return None, f"{what} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)"
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=local_only), path
    except (OSError, ValueError, KeyError, TypeError) as err:  # no tokenizer files there (or not in the cache)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        cached = " in the local cache" if local_only else ""
        return None, f"no tokenizer could be loaded from {what}{cached} ({first[:160]})"


def vocabulary_difference(a, b) -> str | None:
    """None when two tokenizers map every id to the same token (added and special tokens included), else a short
    description of where they differ. Which token plays which role (pad, eos) is not compared: it does not change
    what an id means, and it is often set at run time (`tokenizer.pad_token = tokenizer.eos_token`)."""
    va, vb = a.get_vocab(), b.get_vocab()
    if va == vb:
        return None
    ia, ib = {i: t for t, i in va.items()}, {i: t for t, i in vb.items()}
    differ = sorted(i for i in ia.keys() | ib.keys() if ia.get(i) != ib.get(i))
    shown = ", ".join(f"id {i}: {ia.get(i)!r} vs {ib.get(i)!r}" for i in differ[:3])
    return f"{len(differ)} of {max(len(ia), len(ib))} ids differ ({shown}{', ...' if len(differ) > 3 else ''})"


def _compare_tokenizers(tokenizer, teacher: nn.Module, given, source: str | None):
    """Refuse a teacher whose tokenizer is not the student's; warn when either cannot be known. Returns the
    teacher's tokenizer (None when unknown)."""
    s_tok = student_tokenizer(tokenizer)
    t_tok, where = teacher_tokenizer(teacher, given, source)
    if s_tok is None:
        logger.warning(
            "The student's tokenizer is unknown (processing_class holds none), so the teacher's vocabulary is not "
            "compared with it: make sure both models use one tokenizer, or pass processing_class=<tokenizer>."
        )
        return t_tok
    if t_tok is None:
        logger.warning(
            f"The teacher's tokenizer is unknown: {where}. Its vocabulary is not compared with the student's; if "
            "they differ, the same id means different tokens and distillation is silently wrong. Pass "
            "teacher_processing_class=<the teacher's tokenizer> to DistillationTrainer to have it checked."
        )
        return None
    differ = vocabulary_difference(s_tok, t_tok)
    if differ is not None:
        raise ValueError(
            f"The teacher's tokenizer (from {where}) is not the student's: {differ}. The teacher reads the "
            "student's input ids and logit k is compared with logit k, so the same id would mean different tokens "
            "to the two models. Distil with one tokenizer: build the student from the teacher "
            "(students.from_teacher / students.shrink keep its vocabulary) and pass the teacher's tokenizer as "
            "processing_class; or, for causal LMs, set DistillationArguments.cross_tokenizer ('uld' or 'aligned') "
            "and let hf_distill.data.cross_tokenizer.CrossTokenizerCollator give the teacher its own tokenization."
        )
    return t_tok


def padding_mass(teacher_logits: torch.Tensor, shared: int, mask: torch.Tensor | None = None) -> float | None:
    """The teacher's mean probability (temperature 1) on ids >= `shared`, over the positions `mask` selects
    (every position when None); None when no position is selected. `teacher_logits` is (..., V)."""
    logits = teacher_logits.detach()
    logits = logits[mask.bool()] if mask is not None else logits.reshape(-1, logits.shape[-1])
    if logits.shape[0] == 0:
        return None
    logits = logits.float()
    extra = torch.logsumexp(logits[:, shared:], -1) - torch.logsumexp(logits, -1)
    return float(extra.exp().mean())


def check_padding_mass(mass: float | None, s_vocab: int, t_vocab: int) -> None:
    """Refuse a teacher whose ids beyond the student's vocabulary carry probability: they are tokens, not padding,
    and distilling on the shared ids would teach a renormalised, different distribution."""
    if mass is None or mass <= PADDING_MASS_BOUND:
        return
    raise ValueError(
        f"Vocabulary sizes differ (student {s_vocab}, teacher {t_vocab}) and the teacher puts {mass:.3g} of its "
        f"probability (T = 1, mean over the first batch's distilled tokens) on ids {s_vocab}..{t_vocab - 1}, which "
        f"the student lacks; padding rows would carry less than {PADDING_MASS_BOUND:g}. They are tokens, so the two "
        "vocabularies differ. Give the student the teacher's vocabulary (students.from_teacher / students.shrink "
        f"keep it, or student.resize_token_embeddings({t_vocab}) with the teacher's tokenizer)."
    )


def check_seq2seq_pair(student: nn.Module, teacher: nn.Module, args) -> None:
    """Refuse an encoder-decoder student or teacher whose partner cannot be compared with it: logit KD needs two
    encoder-decoder LMs reading the same decoder inputs (the same decoder start token)."""
    from .features.heads import Head, static_head

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


def teacher_weights(weights: list[float] | None, n: int) -> list[float]:
    """Normalised teacher weights (equal by default)."""
    if weights is None:
        return [1.0 / n] * n if n else []
    if len(weights) != n:
        raise ValueError(f"teacher_weights has {len(weights)} values for {n} teachers; give one weight per teacher.")
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"teacher_weights must sum to a positive number, got {weights}.")
    return [w / total for w in weights]


def per_teacher(value: Any, n: int) -> list[Any]:
    """`teacher_processing_class` as one entry per teacher."""
    if not isinstance(value, list | tuple):
        return [value] * n
    if len(value) != n:
        raise ValueError(
            f"teacher_processing_class has {len(value)} entries for {n} teachers; give one per teacher (None allowed)."
        )
    return list(value)
