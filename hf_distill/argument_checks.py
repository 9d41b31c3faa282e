"""The checks of `DistillationArguments`' distillation fields, run by its `__post_init__`.

Why a module of its own: the fields and their help (hf_distill.arguments) are what a user reads; these are the
refusals, each naming the field and the fix, so a bad value fails when the arguments are built, long before the
first training step. The generation fields (`lmbda`, `seq_kd`, ...) are checked by
`hf_distill.base.generation_checks.validate_generation_arguments` (re-exported by hf_distill.on_policy); the
student's head and the teachers, which the arguments do not know, by the Distiller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base.generation_checks import validate_generation_arguments
from .losses.cross_tokenizer import METHODS as CROSS_TOKENIZER_METHODS
from .losses.cross_tokenizer import validate_cross_tokenizer
from .losses.registry import KindNames
from .losses.terms import parse_terms

__all__ = [
    "CHECKS", "CROSS_TOKENIZER_METHODS", "check_fp16_device", "check_length_grouping", "check_liger_kernel",
    "check_loss_fields", "check_model_fields", "check_served_fields", "check_weights", "validate_cross_tokenizer",
    "validate_distillation",
]

# The accepted values of the fields (hf_distill.arguments re-exports them): here, with the checks that use them, so
# the arguments import their checks and the checks import nothing of the arguments.
# The `kd_loss` values and the kinds each mixture field applies to: live views of hf_distill.losses.registry.
KD_LOSS_KINDS = KindNames()
JSD_KINDS = KindNames(mixture="jsd_beta")
SKEW_KINDS = KindNames(mixture="skew_alpha")
PROJECTION_KINDS = ("shared", "per_layer", "none")
KD_TOKEN_MASKS = ("attention", "labels")
MULTI_TEACHER_MODES = ("probs", "losses")


def check_fp16_device(args: Any) -> None:
    """fp16 on the CPU is refused: accelerate runs fp16 autocast only on GPUs and other accelerators, so on a CPU
    the run would train in float32 while its arguments say fp16 (every distillation trainer calls this)."""
    # the device is read last: reading it sets the processes up, which only an fp16 request needs here
    if (args.fp16 or getattr(args, "mixed_precision", "no") == "fp16") and args.device.type == "cpu":
        raise ValueError(
            "fp16=True (or ACCELERATE_MIXED_PRECISION=fp16) needs a CUDA GPU (or another fp16 accelerator), but "
            "this run is on the CPU (use_cpu=True or no GPU found), where it would silently train in float32. "
            "On a CPU set bf16=True instead (bf16 autocast), or fp16=False."
        )


def check_liger_kernel(args: Any) -> None:
    """`use_liger_kernel=True` is refused while liger-kernel's fused linear cross-entropy is on (its default): it
    replaces a causal LM's forward with one that, in training with labels, returns the hard-label loss and no logits,
    so the distillation loss would be bypassed or fail. Its layer kernels alone keep the model's outputs."""
    config = getattr(args, "liger_kernel_config", None) or {}
    if getattr(args, "use_liger_kernel", False) and config.get("fused_linear_cross_entropy", True) is not False:
        raise ValueError(
            "use_liger_kernel=True turns on liger-kernel's fused linear cross-entropy, which replaces a causal LM's "
            "forward so that training with labels returns no logits: the distillation loss cannot read them. Set "
            "liger_kernel_config={'fused_linear_cross_entropy': False} to keep its layer kernels (RMSNorm, RoPE, "
            "SwiGLU), or use_liger_kernel=False (the distillation loss head already never forms whole logits)."
        )


def check_length_grouping(args: Any, dataset: Any, processing_class: Any = None) -> None:
    """`train_sampling_strategy='group_by_length'` / `'batch_rebalance'` read each training row's length from its
    `length_column_name` column or its tokens (the processor's first input name): rows of text that a collator
    tokenizes (`CrossTokenizerCollator`, prompt rows) have neither. Refused when the trainer is built, before any
    teacher loads (transformers would fail at `train()`, without naming the fix)."""
    import datasets as hf_datasets

    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in ("group_by_length", "batch_rebalance") or not isinstance(dataset, hf_datasets.Dataset):
        return
    names = getattr(processing_class, "model_input_names", None) or ["input_ids"]
    length = getattr(args, "length_column_name", "length")
    if length not in dataset.column_names and names[0] not in dataset.column_names:
        raise ValueError(
            f"train_sampling_strategy={strategy!r} groups rows by length, read from the {length!r} column "
            f"(length_column_name) or the {names[0]!r} column, but the training rows have neither (columns: "
            f"{', '.join(dataset.column_names)}): they are tokenized by the collator. Add a {length!r} column with "
            "each row's token count (e.g. dataset.map(lambda r: {'length': len(tokenizer(r['text']).input_ids)})), "
            "or use train_sampling_strategy='random'."
        )


def check_loss_fields(args: Any) -> None:
    """The KD loss: temperature, divergence (`kd_loss`, from the registry), its mixture parameters, chunking."""
    if args.temperature is not None and not args.temperature > 0:
        raise ValueError(
            f"DistillationArguments.temperature must be > 0, got {args.temperature}. "
            "Use 1.0 for plain softmax; 2-8 is usual for distillation."
        )
    if args.kd_loss not in KD_LOSS_KINDS:
        raise ValueError(
            f"DistillationArguments.kd_loss={args.kd_loss!r} is unknown. Known: {', '.join(KD_LOSS_KINDS)}."
        )
    if args.jsd_beta is not None and not (
        isinstance(args.jsd_beta, int | float) and not isinstance(args.jsd_beta, bool) and 0.0 <= args.jsd_beta <= 1
    ):
        raise ValueError(
            f"DistillationArguments.jsd_beta must be in [0, 1] (0 = forward KL, 1 = reverse KL), got "
            f"{args.jsd_beta!r}."
        )
    if args.jsd_beta is not None and args.kd_loss not in JSD_KINDS:
        raise ValueError(
            f"DistillationArguments.jsd_beta={args.jsd_beta} does nothing with kd_loss={args.kd_loss!r}: beta is "
            "the mixture weight of kd_loss='jsd' only. Set kd_loss='jsd' (beta 0 = 'kl', 1 = 'reverse_kl'), or "
            "leave jsd_beta unset."
        )
    if args.skew_alpha is not None:
        if args.kd_loss not in SKEW_KINDS:
            raise ValueError(
                f"DistillationArguments.skew_alpha={args.skew_alpha!r} is used by kd_loss="
                f"{' or '.join(repr(k) for k in SKEW_KINDS)} only, but kd_loss={args.kd_loss!r}. Unset skew_alpha, or "
                "choose a skew kd_loss."
            )
        if isinstance(args.skew_alpha, bool) or not (
            isinstance(args.skew_alpha, int | float) and 0.0 <= args.skew_alpha < 1.0
        ):
            raise ValueError(f"DistillationArguments.skew_alpha must be in [0, 1), got {args.skew_alpha!r}.")
    if args.kd_chunk_size is not None and (isinstance(args.kd_chunk_size, bool) or args.kd_chunk_size <= 0):
        raise ValueError(
            f"DistillationArguments.kd_chunk_size must be a positive number of tokens, got {args.kd_chunk_size!r}. "
            "Leave it unset for the default."
        )
    if args.kd_head_mode not in ("recompute", "fused"):
        raise ValueError(
            f"DistillationArguments.kd_head_mode must be 'recompute' (the default) or 'fused', got "
            f"{args.kd_head_mode!r}."
        )


def check_model_fields(args: Any) -> None:
    """How the models are compared: projections, counted token positions, how several teachers combine."""
    if args.projection not in PROJECTION_KINDS:
        raise ValueError(
            f"DistillationArguments.projection={args.projection!r} is unknown. "
            f"Known: {', '.join(PROJECTION_KINDS)}."
        )
    if args.kd_token_mask is not None and args.kd_token_mask not in KD_TOKEN_MASKS:
        raise ValueError(
            f"DistillationArguments.kd_token_mask={args.kd_token_mask!r} is unknown. "
            f"Known: {', '.join(KD_TOKEN_MASKS)}."
        )
    if args.multi_teacher is not None and args.multi_teacher not in MULTI_TEACHER_MODES:
        raise ValueError(
            f"DistillationArguments.multi_teacher={args.multi_teacher!r} is unknown. "
            f"Known: {', '.join(MULTI_TEACHER_MODES)}."
        )


def check_weights(args: Any) -> None:
    """The weights of teachers, terms and projections (and `distill_terms` normalised to plain dicts, once)."""
    if args.teacher_weights is not None and any(w < 0 for w in args.teacher_weights):
        raise ValueError(f"DistillationArguments.teacher_weights must be >= 0, got {args.teacher_weights}.")
    for name in ("kd_weight", "task_weight"):
        if getattr(args, name) < 0:
            raise ValueError(
                f"DistillationArguments.{name} must be >= 0, got {getattr(args, name)}. "
                "Set it to 0 to disable that term."
            )
    if args.projection_lr is not None and args.projection_lr <= 0:
        raise ValueError(f"DistillationArguments.projection_lr must be > 0, got {args.projection_lr}.")
    # Normalise the terms once: strings from the command line become plain dicts, so the arguments
    # stay JSON-serialisable (TensorBoard hparams, model cards) and parsing errors surface here.
    # None (no terms given or from the preset) stays None; an explicit empty list stays [] so that
    # dataclasses.replace does not read it as "not given" and bring a preset's terms back.
    terms = parse_terms(args.distill_terms or [])
    args.distill_terms = None if args.distill_terms is None else [t.to_dict() for t in terms]
    if args.kd_weight == 0 and args.task_weight == 0 and not any(t.weight > 0 for t in terms):
        raise ValueError(
            "All loss weights are zero (kd_weight, task_weight and every distill_terms weight): "
            "nothing would be trained. Set kd_weight > 0 for logit distillation."
        )


def check_served_fields(args: Any) -> None:
    """A teacher behind a URL (issue #42): k, protocol and the request limits."""
    for name, low in (("teacher_top_k", 1), ("teacher_retries", 0), ("teacher_requests", 1)):
        value = getattr(args, name, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
    for name in ("teacher_timeout", "teacher_backoff"):
        value = getattr(args, name, None)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or (
                name == "teacher_timeout" and value == 0):
            bound = "> 0" if name == "teacher_timeout" else ">= 0"
            raise ValueError(f"{name} must be a number {bound}, got {value!r}.")
    if args.teacher_protocol not in (None, "vllm", "sglang", "hf_distill"):
        raise ValueError(f"teacher_protocol={args.teacher_protocol!r}: use 'vllm', 'sglang' or 'hf_distill', or "
                         "leave it unset to detect it from the server.")
def check_distillation_token(args: Any) -> None:
    """DeiT's distillation head (hf_distill.kd_paths.distillation_token): hard or soft."""
    if args.distillation_token not in (None, "hard", "soft"):
        raise ValueError(f"DistillationArguments.distillation_token must be 'hard' or 'soft', got "
                         f"{args.distillation_token!r}.")


CHECKS: tuple[Callable[[Any], None], ...] = (
    check_loss_fields,
    check_model_fields,
    validate_cross_tokenizer,  # hf_distill.losses.cross_tokenizer
    validate_generation_arguments,  # hf_distill.base.generation_checks
    check_weights,
    check_served_fields,  # a teacher behind a URL (hf_distill.serving)
    check_distillation_token,  # issue #43
)
"""Every check of the distillation fields, in the order they run: each feature's checks live in its own module and
are listed here once; a new feature adds its check to this list."""


def validate_distillation(args: Any) -> None:
    """Refuse bad distillation fields, each with the field and the fix (`DistillationArguments.__post_init__`)."""
    for check in CHECKS:
        check(args)
