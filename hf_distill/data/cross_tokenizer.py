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

Chat rows (`messages`, or `prompt` and `completion` as lists of messages, as TRL's SFT reads them) are rendered by
each side's own chat template, so the two texts differ where the templates do (role markers, turn ends) and agree
on the messages' contents. The alignment then compares positions in conversation coordinates (`chat_text`): a
token ending inside message k's content, m characters in, is at (k, m) on either side, and two such positions are
paired as above; a token ending in template text pairs with nothing (its prefix does not end with text both sides
read), except the last token of the template text before a message's content (the turn's header: both sides have
read the conversation up to that content and predict its first token), paired with the other side's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import torch

TEACHER_KEYS = ("teacher_input_ids", "teacher_attention_mask", "teacher_labels", "teacher_positions")

Segments = list[tuple[int, int, int, int]]
"""Where a rendered text holds the messages' contents: (start, end, coordinate of `start`, message index), in
text order."""

_MARK = re.compile("\ue000(\\d+)\ue001")


def _ends(offsets: Sequence[Sequence[int]], segments: Segments | None) -> dict[Any, int]:
    """Each boundary (a character, or a conversation coordinate with `segments`) -> the last token ending there."""
    ends: dict[Any, int] = {}
    for i, (start, end) in enumerate(offsets):
        if end <= start:
            continue
        if segments is None:
            ends[end] = i
            continue
        for seg_start, seg_end, coordinate, message in segments:
            if seg_start < end <= seg_end:  # the prefix ends with content both sides read
                ends[coordinate + end - seg_start] = i
                break
            if end <= seg_start:  # template text before message `message`: its last token reads up to the content
                ends[("before", message)] = i
                break
    return ends


def align_positions(student_offsets: Sequence[Sequence[int]], teacher_offsets: Sequence[Sequence[int]],
                    student_segments: Segments | None = None, teacher_segments: Segments | None = None) -> list[int]:
    """For each student token i, the teacher token j whose prefix ends at the same character as the student's
    prefix 0..i (see the module docstring), else -1. Offsets are (start, end) character spans, as fast tokenizers'
    `return_offsets_mapping` gives them, in token order. With `*_segments` (two renderings of one conversation,
    `chat_text`) the ends are compared in conversation coordinates: ends inside a message's content, and the last
    template token before each content."""
    teacher_end = _ends(teacher_offsets, teacher_segments)
    out = [-1] * len(student_offsets)
    for end, i in _ends(student_offsets, student_segments).items():
        out[i] = teacher_end.get(end, -1)
    return out


def _render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, extra: dict[str, Any]):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **extra)


def chat_text(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
              side: str = "tokenizer", **extra: Any) -> tuple[str, Segments]:
    """`messages` rendered by `tokenizer`'s chat template, and where each message's content lies in it.

    The template is rendered twice: on the messages, and on copies whose contents are numbered markers; putting the
    contents back in place of the markers must give the same text (else the template changes the contents, and a
    position in them could not be told: refused). A template that trims the contents is accepted (the trimmed
    content is looked for). A message's coordinate is its place in the conversation: message k's content starts at
    the sum of the earlier contents' lengths plus k, so each character has one coordinate on every side."""
    contents = [m.get("content") for m in messages]
    if not all(isinstance(c, str) for c in contents):
        kinds = sorted({type(c).__name__ for c in contents if not isinstance(c, str)})
        raise ValueError(f"CrossTokenizerCollator renders chat rows whose message contents are text; a row has "
                         f"{', '.join(kinds)} contents (multimodal parts are not supported): give text contents.")
    text = _render(tokenizer, messages, add_generation_prompt, extra)
    marked = _render(tokenizer, [{**m, "content": f"\ue000{k}\ue001"} for k, m in enumerate(messages)],
                     add_generation_prompt, extra)
    starts, total = [], 0
    for c in contents:
        starts.append(total)
        total += len(c) + 1
    for trim in (False, True):
        pieces, segments, at, last = [], [], 0, 0
        for found in _MARK.finditer(marked):
            k = int(found.group(1))
            content = contents[k].strip() if trim else contents[k]
            lead = contents[k].find(content) if trim else 0
            pieces.append(marked[last:found.start()])
            at += found.start() - last
            segments.append((at, at + len(content), starts[k] + lead, k))
            pieces.append(content)
            at += len(content)
            last = found.end()
        pieces.append(marked[last:])
        if "".join(pieces) == text:
            return text, segments
    raise ValueError(
        f"CrossTokenizerCollator: the {side}'s chat template changes the messages' contents (not only trimming "
        "them), so the positions of the two renderings cannot be matched. Use a chat template that inserts each "
        "message's content as it is, or render the rows to text yourself (text rows).")


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

    Chat rows, as TRL's SFT reads them: `messages_column` (a list of {role, content} messages: every token is
    learnt, SFT's default), or `prompt_column` and `completion_column` holding lists of messages (the completion is
    learnt: the tokens after the longest common token prefix of the prompt rendered with the generation prompt and
    of the whole conversation, SFT's rule). Each side renders them with its own tokenizer's chat template (`tools`
    and `chat_template_kwargs` columns passed on, as SFT passes them) and tokenizes the result without adding
    special tokens (the template writes them, as `apply_chat_template` does); the positions are aligned in
    conversation coordinates (module docstring). Both tokenizers need a chat template then: `check_rows` refuses
    rows it cannot render before training. With `assistant_only_loss=True` (chat rows only) each side learns only
    the tokens its template's `{% generation %}` blocks cover (and, for prompt/completion rows, in the completion),
    as SFT's `assistant_only_loss`.

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
        messages_column: str = "messages",
        assistant_only_loss: bool = False,
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
        self.messages_column, self.assistant_only_loss = messages_column, assistant_only_loss
        self.max_length, self.add_special_tokens = max_length, add_special_tokens

    @property
    def dataset_columns(self) -> tuple[str, ...]:
        """The columns this collator reads: DistillationMixin keeps them through column removal."""
        return (self.text_column, self.prompt_column, self.completion_column, self.messages_column, "tools",
                "chat_template_kwargs")

    def _kind(self, row: dict[str, Any]) -> str:
        """"text", "pair" (prompt + completion strings), "messages" or "chat pair" (lists of messages)."""
        if row.get(self.text_column) is not None:
            kind = "text"
        elif row.get(self.messages_column) is not None:
            kind = "messages"
        elif row.get(self.prompt_column) is not None and row.get(self.completion_column) is not None:
            kind = "chat pair" if isinstance(row[self.prompt_column], list) else "pair"
        else:
            raise ValueError(
                f"CrossTokenizerCollator: a row has neither {self.text_column!r}, {self.messages_column!r} nor "
                f"{self.prompt_column!r} + {self.completion_column!r} (its keys: {sorted(row)}). Give rows with text "
                "or messages, or name the columns (text_column=...); if the dataset has them, the Trainer removed "
                "them as columns the model does not take: set remove_unused_columns=False in the arguments."
            )
        values = [row[self.text_column]] if kind == "text" else [row[self.messages_column]] if kind == "messages" \
            else [row[self.prompt_column], row[self.completion_column]]
        want = str if kind in ("text", "pair") else list
        if not all(isinstance(v, want) for v in values):
            got = ", ".join(sorted({type(v).__name__ for v in values}))
            raise ValueError(f"CrossTokenizerCollator: a {kind} row needs {want.__name__} values, got {got} (a "
                             "prompt and a completion are both text, or both lists of messages).")
        return kind

    def check_rows(self, rows: Any) -> None:
        """Refuse, before training, rows the collator could not render: chat rows with a tokenizer that has no chat
        template, or whose template changes the contents (`chat_text`). Reads the rows given (a few first rows)."""
        for row in rows:
            if self._kind(row) in ("messages", "chat pair"):
                self._side(self.tokenizer, row, "student's tokenizer")
                self._side(self.teacher_tokenizer, row, "teacher's tokenizer")

    def _chat_extra(self, row: dict[str, Any]) -> dict[str, Any]:
        tools = row.get("tools")
        tools = json.loads(tools) if isinstance(tools, str) else tools
        return {**({"tools": tools} if tools else {}), **(row.get("chat_template_kwargs") or {})}

    def _tokens(self, tokenizer: Any, text: str, special: bool) -> tuple[list[int], list[tuple[int, int]]]:
        enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=special,
                        truncation=self.max_length is not None, max_length=self.max_length)
        return list(enc["input_ids"]), [tuple(span) for span in enc["offset_mapping"]]

    def _side(self, tokenizer: Any, row: dict[str, Any], side: str):
        """One row as one side reads it: ids, offsets, the index of the first learnt token, and the conversation
        segments (None for text rows)."""
        kind = self._kind(row)
        if self.assistant_only_loss and kind in ("text", "pair"):
            raise ValueError("CrossTokenizerCollator: assistant_only_loss=True learns the assistant turns of chat "
                             f"rows, but a row is a {'text' if kind == 'text' else 'prompt/completion text'} row. "
                             "Give messages rows, or set assistant_only_loss=False.")
        if kind in ("text", "pair"):
            prompt = "" if kind == "text" else row[self.prompt_column]
            text = row[self.text_column] if kind == "text" else prompt + row[self.completion_column]
            ids, spans = self._tokens(tokenizer, text, self.add_special_tokens)
            first = next((k for k, (a, b) in enumerate(spans) if b > a and b > len(prompt)), len(ids))
            return ids, spans, first, None
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"CrossTokenizerCollator: chat rows ({self.messages_column!r}, or prompt/completion messages) are "
                f"rendered by each side's own chat template, and the {side} has none. Set its chat_template (e.g. the "
                "one of the model's chat or instruct version), or render the rows to text yourself (text rows).")
        extra = self._chat_extra(row)
        messages = row[self.messages_column] if kind == "messages" else \
            row[self.prompt_column] + row[self.completion_column]
        text, segments = chat_text(tokenizer, messages, side=side, **extra)
        ids, spans = self._tokens(tokenizer, text, False)
        first = 0
        if kind == "chat pair":
            prompt, _ = chat_text(tokenizer, row[self.prompt_column], add_generation_prompt=True, side=side, **extra)
            prompt_ids, _ = self._tokens(tokenizer, prompt, False)
            first = next((k for k, (a, b) in enumerate(zip(ids, prompt_ids, strict=False)) if a != b),
                         min(len(ids), len(prompt_ids)))
        if self.assistant_only_loss:
            return ids, spans, (first, self._assistant_mask(tokenizer, messages, ids, extra, side)), segments
        return ids, spans, first, segments

    def _assistant_mask(self, tokenizer: Any, messages: list[dict[str, Any]], ids: list[int], extra: dict[str, Any],
                        side: str) -> list[int]:
        """SFT's `assistant_only_loss` mask on one side: the tokens its chat template's `{% generation %}` blocks
        cover (`apply_chat_template(..., return_assistant_tokens_mask=True)`), cut to the truncated ids."""
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **extra)
        if list(out["input_ids"][: len(ids)]) != ids:
            raise ValueError(f"CrossTokenizerCollator: the {side}'s chat template tokenizes differently through "
                             "apply_chat_template than its rendered text does, so its assistant mask cannot be "
                             "placed; use assistant_only_loss=False.")
        mask = list(out["assistant_masks"][: len(ids)])
        if 1 not in mask:
            raise ValueError(
                f"CrossTokenizerCollator: assistant_only_loss=True, but the {side}'s chat template marks no assistant "
                "token in a row (no {% generation %} ... {% endgeneration %} blocks around the assistant turns, or no "
                "assistant turn). Give it a template with generation markers (e.g. trl.chat_template_utils."
                "get_training_chat_template(tokenizer)), or set assistant_only_loss=False.")
        return mask

    def _pad(self, tokenizer: Any, rows: list[list[int]], firsts: list[int]):
        pad = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
        length = max((len(r) for r in rows), default=0)
        ids = torch.full((len(rows), length), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        lab = torch.full((len(rows), length), -100, dtype=torch.long)
        for b, (row, first) in enumerate(zip(rows, firsts, strict=True)):
            ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[b, : len(row)] = 1
            if isinstance(first, tuple):  # (first learnt token, assistant mask): both must hold, as in SFT
                first, learnt = first[0], torch.tensor(first[1], dtype=torch.bool)
                learnt[:first] = False
                lab[b, : len(row)] = torch.where(learnt, ids[b, : len(row)], -100)
                continue
            lab[b, first : len(row)] = ids[b, first : len(row)]
        return ids, mask, lab

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        student = [self._side(self.tokenizer, row, "student's tokenizer") for row in features]
        teacher = [self._side(self.teacher_tokenizer, row, "teacher's tokenizer") for row in features]
        ids, mask, labels = self._pad(self.tokenizer, [r[0] for r in student], [r[2] for r in student])
        t_ids, t_mask, t_labels = self._pad(self.teacher_tokenizer, [r[0] for r in teacher], [r[2] for r in teacher])
        positions = torch.full(ids.shape, -1, dtype=torch.long)
        for b, (s_row, t_row) in enumerate(zip(student, teacher, strict=True)):
            aligned = align_positions(s_row[1], t_row[1], s_row[3], t_row[3])
            positions[b, : len(aligned)] = torch.tensor(aligned, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels, "teacher_input_ids": t_ids,
                "teacher_attention_mask": t_mask, "teacher_labels": t_labels, "teacher_positions": positions}


def check_first_rows(collator: Any, *datasets: Any, n: int = 8) -> None:
    """A trainer's check at construction: a `CrossTokenizerCollator` (possibly wrapped, `.base`) reads the first `n`
    rows of each `datasets.Dataset` (or dict of them) given, so rows it could not render (a chat row and a tokenizer
    without a chat template) fail before training. Streams are not read (their rows are checked when collated)."""
    import datasets as hf_datasets

    base = getattr(collator, "base", collator)
    if not isinstance(base, CrossTokenizerCollator):
        return
    for data in datasets:
        for part in (data.values() if isinstance(data, dict) else [data]):
            if isinstance(part, hf_datasets.Dataset) and len(part):
                base.check_rows(part.select(range(min(n, len(part)))))


__all__ = ["TEACHER_KEYS", "CrossTokenizerCollator", "align_positions", "chat_text", "check_first_rows"]
