"""The data side of cross-tokenizer distillation: one text, two tokenizations, and where they line up.

With `DistillationArguments.cross_tokenizer` the teacher does not read the student's input ids: it reads its own
tokenization of the same text. `CrossTokenizerCollator` tokenizes each row's text with both tokenizers (fast
tokenizers: their character offsets are needed) and emits, next to the student's `input_ids`, `attention_mask` and
`labels`, the teacher's `teacher_input_ids`, `teacher_attention_mask` and `teacher_labels`, and the alignment
`teacher_positions` (`align_positions`). The KD term (hf_distill.losses.cross_tokenizer) reads them.

The alignment rule (what `cross_tokenizer="aligned"` distils on): student position i and teacher position j are
paired when the student's tokens 0..i and the teacher's tokens 0..j end at the same character of the text, so both
models have read exactly the same text and predict what follows it. Tokens with an empty span (special tokens such
as BOS/EOS, whose offsets are (0, 0)) end nothing and are never paired; where several tokens of one side end at the
same character (byte-level pieces of one character), the last of them is the one whose prefix covers that
character. This is the boundary rule of GOLD's span alignment (TRL's `GOLDTrainer`, `_align_by_byte_offsets`: a
group closes where both tokenizations reach the same boundary), with no span merging: each pair compares two
next-token distributions conditioned on the same text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

TEACHER_KEYS = ("teacher_input_ids", "teacher_attention_mask", "teacher_labels", "teacher_positions")


def align_positions(student_offsets: Sequence[Sequence[int]], teacher_offsets: Sequence[Sequence[int]]) -> list[int]:
    """For each student token i, the teacher token j whose prefix ends at the same character as the student's
    prefix 0..i (see the module docstring), else -1. Offsets are (start, end) character spans, as fast tokenizers'
    `return_offsets_mapping` gives them, in token order."""
    teacher_end: dict[int, int] = {}
    for j, (start, end) in enumerate(teacher_offsets):
        if end > start:
            teacher_end[end] = j  # the last teacher token ending there
    student_end: dict[int, int] = {}
    for i, (start, end) in enumerate(student_offsets):
        if end > start:
            student_end[end] = i
    out = [-1] * len(student_offsets)
    for end, i in student_end.items():
        out[i] = teacher_end.get(end, -1)
    return out


class CrossTokenizerCollator:
    """Tokenize each row's text with the student's and the teacher's tokenizer, pad both, and align them.

    Rows hold `text_column` (a causal-LM row: every token is learnt and distilled), or `prompt_column` and
    `completion_column` (an SFT row: their concatenation is tokenized, and the tokens before the first one that ends
    inside the completion get label -100 on both sides, so only the completion is learnt and distilled, as
    `kd_token_mask="labels"` counts it). Each tokenizer adds its own special tokens (`add_special_tokens`) and is
    truncated on its own to `max_length` tokens (so long texts may cover less text on one side). Both sides are
    right-padded (padding ids: the tokenizer's pad token, else its EOS, else 0; padded positions are masked and
    carry label -100). The distillation trainers keep the columns it reads (`dataset_columns`) through the
    Trainer's column removal.

    Output: `input_ids`, `attention_mask`, `labels` (the student's), `teacher_input_ids`, `teacher_attention_mask`,
    `teacher_labels`, and `teacher_positions` (B, student length): the teacher position aligned with each student
    position (`align_positions`), -1 where none is.
    """

    def __init__(
        self,
        tokenizer: Any,
        teacher_tokenizer: Any,
        text_column: str = "text",
        prompt_column: str = "prompt",
        completion_column: str = "completion",
        max_length: int | None = None,
        add_special_tokens: bool = True,
    ) -> None:
        for name, tok in (("tokenizer", tokenizer), ("teacher_tokenizer", teacher_tokenizer)):
            if not getattr(tok, "is_fast", False):
                raise ValueError(
                    f"CrossTokenizerCollator's {name} must be a fast tokenizer (PreTrainedTokenizerFast: "
                    "AutoTokenizer.from_pretrained(..., use_fast=True)): the alignment needs its character offsets "
                    f"(return_offsets_mapping), which {type(tok).__name__} does not give."
                )
        if max_length is not None and (isinstance(max_length, bool) or max_length <= 0):
            raise ValueError(f"CrossTokenizerCollator.max_length must be a positive token count, got {max_length!r}.")
        self.tokenizer, self.teacher_tokenizer = tokenizer, teacher_tokenizer
        self.text_column, self.prompt_column, self.completion_column = text_column, prompt_column, completion_column
        self.max_length, self.add_special_tokens = max_length, add_special_tokens

    @property
    def dataset_columns(self) -> tuple[str, ...]:
        """The text columns this collator reads: DistillationMixin keeps them through column removal."""
        return (self.text_column, self.prompt_column, self.completion_column)

    def _texts(self, features: list[dict[str, Any]]) -> tuple[list[str], list[int]]:
        """Each row's text and the character where its learnt part starts (0 for a plain text row)."""
        texts, starts = [], []
        for row in features:
            if row.get(self.text_column) is not None:
                texts.append(row[self.text_column])
                starts.append(0)
            elif row.get(self.prompt_column) is not None and row.get(self.completion_column) is not None:
                prompt = row[self.prompt_column]
                texts.append(prompt + row[self.completion_column])
                starts.append(len(prompt))
            else:
                raise ValueError(
                    f"CrossTokenizerCollator: a row has neither {self.text_column!r} nor {self.prompt_column!r} + "
                    f"{self.completion_column!r} (its keys: {sorted(row)}). Give rows with text, or name the columns "
                    "(text_column=...); if the dataset has them, the Trainer removed them as columns the model does "
                    "not take: set remove_unused_columns=False in the arguments."
                )
            if not isinstance(texts[-1], str):
                raise ValueError(f"CrossTokenizerCollator needs text, got {type(texts[-1]).__name__} in a row.")
        return texts, starts

    def _encode(self, tokenizer: Any, texts: list[str], starts: list[int]):
        enc = tokenizer(texts, return_offsets_mapping=True, add_special_tokens=self.add_special_tokens,
                        truncation=self.max_length is not None, max_length=self.max_length)
        rows = [list(ids) for ids in enc["input_ids"]]
        offsets = [[tuple(span) for span in row] for row in enc["offset_mapping"]]
        labels = []
        for ids, spans, start in zip(rows, offsets, starts, strict=True):
            first = next((k for k, (a, b) in enumerate(spans) if b > a and b > start), len(ids))
            labels.append([-100] * first + ids[first:])
        pad = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
        length = max((len(r) for r in rows), default=0)
        ids = torch.full((len(rows), length), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        lab = torch.full((len(rows), length), -100, dtype=torch.long)
        for b, (row, row_labels) in enumerate(zip(rows, labels, strict=True)):
            ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[b, : len(row)] = 1
            lab[b, : len(row)] = torch.tensor(row_labels, dtype=torch.long)
        return ids, mask, lab, offsets

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        texts, starts = self._texts(features)
        ids, mask, labels, s_offsets = self._encode(self.tokenizer, texts, starts)
        t_ids, t_mask, t_labels, t_offsets = self._encode(self.teacher_tokenizer, texts, starts)
        positions = torch.full(ids.shape, -1, dtype=torch.long)
        for b, (s_row, t_row) in enumerate(zip(s_offsets, t_offsets, strict=True)):
            positions[b, : len(s_row)] = torch.tensor(align_positions(s_row, t_row), dtype=torch.long)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels, "teacher_input_ids": t_ids,
                "teacher_attention_mask": t_mask, "teacher_labels": t_labels, "teacher_positions": positions}


__all__ = ["TEACHER_KEYS", "CrossTokenizerCollator", "align_positions"]
