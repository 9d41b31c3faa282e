"""The generation checks: on-policy (`lmbda`) and sequence-level (`seq_kd`) settings that are out of range or would
do nothing, refused when `DistillationArguments` is built.

On the ground floor because the argument checks (hf_distill.argument_checks) run them and the generation code
(hf_distill.on_policy) owns what they guard; neither imports the other."""

from __future__ import annotations

from typing import Any

__all__ = ["GENERATION_FIELDS", "validate_generation_arguments"]

GENERATION_FIELDS = ("max_new_tokens", "generation_temperature", "top_p", "stop_token_ids")


def validate_generation_arguments(args: Any) -> None:
    """Refuse on-policy settings that are out of range or that would do nothing (DistillationArguments)."""
    lmbda = args.lmbda
    if isinstance(lmbda, bool) or not isinstance(lmbda, int | float) or not 0.0 <= lmbda <= 1.0:
        raise ValueError(
            f"DistillationArguments.lmbda must be in [0, 1] (the probability that the student generates a "
            f"micro-batch's completions), got {lmbda!r}."
        )
    if not args.generates:
        given = [name for name in GENERATION_FIELDS if getattr(args, name) is not None]
        if given:
            raise ValueError(
                f"DistillationArguments.{', '.join(given)} set, but nothing is generated (lmbda=0 and seq_kd=False): "
                "the run trains on the dataset's completions. Set lmbda > 0 (on-policy) or seq_kd=True, or remove "
                f"{', '.join(given)}."
            )
        return
    if args.max_new_tokens is not None and (isinstance(args.max_new_tokens, bool) or args.max_new_tokens <= 0):
        raise ValueError(f"DistillationArguments.max_new_tokens must be > 0, got {args.max_new_tokens!r}.")
    temperature = args.generation_temperature
    if temperature is not None and not temperature >= 0:
        raise ValueError(
            f"DistillationArguments.generation_temperature must be >= 0 (0 = greedy), got {temperature!r}."
        )
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        raise ValueError(f"DistillationArguments.top_p must be in (0, 1], got {args.top_p!r}.")
    if args.top_p is not None and temperature == 0:
        raise ValueError(
            f"DistillationArguments.top_p={args.top_p} does nothing with generation_temperature=0 (greedy decoding "
            "samples nothing). Remove top_p, or set generation_temperature > 0."
        )
    if args.stop_token_ids is not None and (
        not args.stop_token_ids or not all(isinstance(i, int) and i >= 0 for i in args.stop_token_ids)
    ):
        raise ValueError(
            f"DistillationArguments.stop_token_ids must be a non-empty list of token ids, got {args.stop_token_ids!r}."
        )
    why = None
    if args.cross_tokenizer:
        why = ("cross_tokenizer needs the teacher's own tokenization of each row, made from the text by its collator "
               "before generation")
    elif args.kd_weight == 0:
        why = "kd_weight=0: there would be no KD term on the generated completions. Set kd_weight > 0"
    if why is not None:
        raise ValueError(f"DistillationArguments.lmbda / seq_kd (generated completions) cannot be used here: {why}.")
