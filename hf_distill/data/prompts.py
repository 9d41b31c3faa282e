"""Prompt + completion rows in TRL's formats, collated for causal-LM distillation with or without generation.

The rows (TRL's dataset formats): standard `{"prompt": str, "completion": str}`; conversational `{"prompt":
[messages], "completion": [messages]}`; or `{"messages": [...]}`, whose last assistant message is the completion
and everything before it the prompt. Conversational rows are rendered with the tokenizer's chat template.

A batch holds the right-padded training rows (`input_ids`, `attention_mask`, `labels` = the completion, -100 on
the prompt and padding: KD and the task loss cover the completion only) and the left-padded prompts
(`prompt_input_ids`, `prompt_attention_mask`) from which on-policy and sequence-level KD generate new completions
(hf_distill.on_policy). The prompts never reach a model's forward.

`check_generation_data` reads the train set's first rows as this collator will, when the trainer is built and
before the teacher loads, so that a row it cannot read and a prompt that leaves no room for `max_new_tokens`
(hf_distill.base.position_limits) are refused before any model runs, not at the first step.
"""

from __future__ import annotations

from typing import Any

import torch

from ..base.batch_keys import PROMPT_IDS, PROMPT_MASK
from ..base.position_limits import check_room, new_tokens, position_limit, teacher_roles

TEXT_COLUMNS = ("prompt", "completion", "messages")
PEEK_ROWS = 64  # the first rows read at set-up: each is tokenised once, which costs milliseconds


class PromptCompletionCollator:
    """Tokenise and pad prompt + completion (or `messages`) rows.

    Args:
        tokenizer: the student's tokenizer (a chat template for conversational rows, a pad token).
        max_length: the longest dataset row; longer completions are cut (the prompt is kept whole; a prompt that
            does not fit is refused). None: no limit. A generated row (lmbda / seq_kd) is its prompt plus up to
            `max_new_tokens`, which this does not bound.

    Give it as `data_collator`; the trainer keeps the text columns it reads (`dataset_columns`).
    """

    dataset_columns = TEXT_COLUMNS

    def __init__(self, tokenizer: Any, max_length: int | None = None) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError(
                "PromptCompletionCollator pads rows of unequal length, but the tokenizer has no pad token. Set "
                "tokenizer.pad_token (e.g. tokenizer.pad_token = tokenizer.eos_token)."
            )
        if max_length is not None and max_length <= 0:
            raise ValueError(f"PromptCompletionCollator: max_length must be > 0, got {max_length}.")
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        pairs = [self.tokenize(f, i) for i, f in enumerate(features)]
        pad = self.tokenizer.pad_token_id
        b = len(pairs)
        width = max(len(p) + len(c) for p, c in pairs)
        p_width = max(len(p) for p, _ in pairs)
        batch = {
            "input_ids": torch.full((b, width), pad, dtype=torch.long),
            "attention_mask": torch.zeros((b, width), dtype=torch.long),
            "labels": torch.full((b, width), -100, dtype=torch.long),
            PROMPT_IDS: torch.full((b, p_width), pad, dtype=torch.long),
            PROMPT_MASK: torch.zeros((b, p_width), dtype=torch.long),
        }
        for i, (p, c) in enumerate(pairs):
            n = len(p) + len(c)
            batch["input_ids"][i, :n] = torch.tensor(p + c)
            batch["attention_mask"][i, :n] = 1
            batch["labels"][i, len(p): n] = torch.tensor(c, dtype=torch.long)
            batch[PROMPT_IDS][i, p_width - len(p):] = torch.tensor(p)
            batch[PROMPT_MASK][i, p_width - len(p):] = 1
        return batch

    def tokenize(self, row: dict[str, Any], index: int = 0) -> tuple[list[int], list[int]]:
        """(prompt ids, completion ids) of one row."""
        prompt, completion = _split(row, index)
        tok = self.tokenizer
        if isinstance(prompt, str) and isinstance(completion, str):
            p = tok(prompt)["input_ids"]  # with the tokenizer's special tokens (a BOS), as TRL's SFT
            c = tok(completion, add_special_tokens=False)["input_ids"]
            if tok.eos_token_id is not None and (not c or c[-1] != tok.eos_token_id):
                c = c + [tok.eos_token_id]  # the student learns where a completion ends
        elif isinstance(prompt, list) and isinstance(completion, list):
            if getattr(tok, "chat_template", None) is None:
                raise ValueError(
                    f"Row {index} is conversational (lists of messages), but the tokenizer has no chat template. "
                    "Set tokenizer.chat_template, or give plain-text prompt and completion columns."
                )
            p_text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            full_text = tok.apply_chat_template(prompt + completion, tokenize=False)
            p = tok(p_text, add_special_tokens=False)["input_ids"]
            full = tok(full_text, add_special_tokens=False)["input_ids"]
            if full[: len(p)] != p:
                raise ValueError(
                    f"Row {index}: the chat template renders the prompt (with add_generation_prompt=True) differently "
                    "at the start of the whole conversation, so the completion cannot be cut from it. Use a template "
                    "whose generation prompt is a prefix of the rendered conversation."
                )
            c = full[len(p):]
        else:
            raise ValueError(
                f"Row {index}: prompt and completion must both be strings or both be lists of messages, got "
                f"{type(prompt).__name__} and {type(completion).__name__}."
            )
        if self.max_length is not None:
            if len(p) >= self.max_length:
                raise ValueError(
                    f"Row {index}: its prompt has {len(p)} tokens, which leaves no room for a completion within "
                    f"max_length={self.max_length}. Raise max_length or shorten the prompt."
                )
            c = c[: self.max_length - len(p)]
        if not c:
            raise ValueError(f"Row {index} has an empty completion: there is nothing to learn from it.")
        return p, c


def _split(row: dict[str, Any], index: int) -> tuple[Any, Any]:
    """(prompt, completion) of a row in one of TRL's formats."""
    if "prompt" in row and "completion" in row:
        return row["prompt"], row["completion"]
    messages = row.get("messages")
    if isinstance(messages, list) and messages:
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if last is None or last == 0:
            raise ValueError(
                f"Row {index}: `messages` needs an assistant message after at least one other message (the last "
                "assistant message is the completion, what precedes it the prompt)."
            )
        return messages[:last], [messages[last]]
    raise ValueError(
        f"Row {index} has columns {sorted(row)}: PromptCompletionCollator reads `prompt` + `completion` (strings or "
        "lists of messages) or `messages`. With a datasets.Dataset, keep them through the trainer (it does so for "
        "this collator), or set remove_unused_columns=False."
    )


def peek_rows(dataset: Any, n: int = PEEK_ROWS) -> list[Any] | None:
    """The first `n` rows of `dataset`, leaving it as it was: indexed from a map-style dataset (`datasets.Dataset`,
    a torch Dataset with a length), taken from a `datasets.IterableDataset` (each iteration restarts it). None for
    any other iterable, which may be one-shot (a generator): its rows are checked as they come."""
    import datasets
    from torch.utils.data import IterableDataset

    if isinstance(dataset, datasets.IterableDataset):
        return list(dataset.take(n))
    if dataset is None or isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        return None
    return [dataset[i] for i in range(min(n, len(dataset)))]


def check_generation_data(args: Any, collator: Any, dataset: Any, student: Any, teachers: list[Any]) -> None:
    """Before any model runs (the trainer calls it before the teacher loads; issue #39, cases 4 and 10): read the
    first rows of `dataset` as `collator` will, if it is a PromptCompletionCollator, so a row without a prompt, a
    `messages` row without an assistant turn or a prompt that leaves no room within the collator's `max_length` is
    refused now; and refuse a prompt (the longest of those rows, else one token) plus `max_new_tokens` that does
    not fit the positions of the student or a teacher (a module, or a folder / Hub id read through its config).
    Rows past the first are checked at each step, before generation."""
    rows = peek_rows(dataset) if isinstance(collator, PromptCompletionCollator) else None
    longest = 1
    for i, row in enumerate(rows or []):
        try:
            prompt, _ = collator.tokenize(row, i)
        except ValueError as err:
            raise ValueError(f"train_dataset (its first {len(rows)} rows, read before any model runs): {err}") from None
        longest = max(longest, len(prompt))
    where = f"train_dataset (the longest prompt of its first {len(rows)} rows)" if rows else "max_new_tokens"
    check_room(new_tokens(args), longest, position_limit([("student", student), *teacher_roles(teachers)]), where)


__all__ = ["PEEK_ROWS", "TEXT_COLUMNS", "PromptCompletionCollator", "check_generation_data", "peek_rows"]
