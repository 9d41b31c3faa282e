"""Whether a generated row fits the positions of the models that generate and read it (issue #39, case 4).

On-policy and sequence-level KD (hf_distill.on_policy) generate up to `max_new_tokens` after each prompt, and the
student and teachers then run on the whole row. A row longer than a model's positions makes `generate` fail
part-way (an IndexError for learned position embeddings such as GPT-2's) or run past the context the model was
trained on (rotary ones). The check needs only the models' configs and a prompt length, so it runs before any
model does: at set-up on the first rows (hf_distill.data.prompts.check_generation_data), and before each
generation on the batch's prompts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from accelerate.utils import extract_model_from_parallel

DEFAULT_MAX_NEW_TOKENS = 128  # TRL's GKD
POSITION_FIELDS = ("max_position_embeddings", "n_positions")  # most configs alias the first (GPT-2: n_positions)


def model_positions(model: Any) -> int | None:
    """The most positions `model` runs on (its text config's `max_position_embeddings` or `n_positions`); a folder
    or Hub id is read through its config alone. None where nothing is declared (a model without position limit, a
    plain module) or the config cannot be read (loading the teacher then reports why)."""
    if isinstance(model, str | os.PathLike):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(str(model))
        except (OSError, ValueError):
            return None
    else:
        config = getattr(extract_model_from_parallel(model, keep_torch_compile=False), "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in POSITION_FIELDS:
        value = getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def position_limit(models: Sequence[tuple[str, Any]]) -> tuple[int, str] | None:
    """(positions, who) of the model with the fewest positions among (who, model) pairs: every model that generates
    or reads a generated row. None when none declares a limit."""
    limits = [(n, who) for who, m in models if (n := model_positions(m)) is not None]
    return min(limits) if limits else None


def check_room(new_tokens: int, prompt_tokens: int, limit: tuple[int, str] | None, where: str) -> None:
    """Refuse rows of a prompt of `prompt_tokens` plus up to `new_tokens` generated ones that would not fit `limit`
    (from :func:`position_limit`; None: nothing to check), in one line that names the fix."""
    if limit is None or prompt_tokens + new_tokens <= limit[0]:
        return
    positions, who = limit
    fits = positions - new_tokens  # the longest prompt that leaves room for max_new_tokens
    fixes = [f"set max_new_tokens <= {positions - prompt_tokens}"] if prompt_tokens < positions else []
    fixes += [f"drop (or shorten) the prompts longer than {fits} tokens"] if fits > 0 else []
    fix = ", or ".join(fixes) or f"shorten the prompts below {positions} tokens and lower max_new_tokens"
    prompt = f"{prompt_tokens} token{'s' if prompt_tokens != 1 else ''}"
    raise ValueError(
        f"{where}: a prompt of {prompt} plus max_new_tokens={new_tokens} makes generated rows of up to "
        f"{prompt_tokens + new_tokens} tokens, but the {who} has {positions} positions (max_position_embeddings), so "
        f"generation would fail part-way: {fix}."
    )


__all__ = [
    "DEFAULT_MAX_NEW_TOKENS", "POSITION_FIELDS", "check_room", "model_positions", "new_tokens", "position_limit",
    "teacher_roles",
]


def new_tokens(args: Any) -> int:
    """The most tokens generated per completion: `max_new_tokens`, else TRL's default."""
    return args.max_new_tokens or DEFAULT_MAX_NEW_TOKENS


def teacher_roles(teachers: list[Any]) -> list[tuple[str, Any]]:
    """(name in messages, teacher) pairs: "teacher", or "teacher i" among several."""
    return [(f"teacher {i}" if len(teachers) > 1 else "teacher", t) for i, t in enumerate(teachers)]
