"""MkDocs hooks (mkdocs.yml `hooks:`): pages that show what the code says, generated at build time, offline.

mkdocstrings renders docstrings, but a dataclass field's help lives in `field(metadata={"help": ...})`, where
`HfArgumentParser` reads it for `--help`. `ARGUMENTS_MARKER` in a page is replaced by a table of every
`DistillationArguments` field (those it adds to `TrainingArguments`) with its type, default and that help, so the
API reference and the command line never disagree.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

ARGUMENTS_MARKER = "<!-- distillation-arguments-table -->"


def _cell(text: str) -> str:
    """Plain text (a help string: `code` in backticks, `T**2` meant literally) as one Markdown table cell: outside
    code spans, the characters Markdown would read as emphasis, HTML, links or a cell border are escaped."""
    parts = " ".join(str(text).split()).split("`")
    for i in range(0, len(parts), 2):  # even parts lie outside code spans (a code span may hold a pipe)
        part = parts[i].replace("\\", "\\\\")
        for char in "*_[]|":
            part = part.replace(char, "\\" + char)
        parts[i] = part.replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return f"`{field.default!r}`"
    if field.default_factory is not dataclasses.MISSING:
        return f"`{field.default_factory()!r}`"
    return "required"


def annotation(cls: type, name: str) -> str:
    """A field's type as written in its class. Not `Field.type`: `HfArgumentParser` replaces that with the resolved
    type object (`typing.Optional[float]` for `float | None`) on the shared dataclass fields."""
    for klass in cls.__mro__:
        written = vars(klass).get("__annotations__", {}).get(name)
        if written is not None:
            return written if isinstance(written, str) else inspect.formatannotation(written)
    raise KeyError(f"{cls.__name__}.{name} has no annotation")


def distillation_fields() -> list[dataclasses.Field]:
    """The fields `DistillationArguments` adds to `TrainingArguments`, in their declaration order."""
    from transformers import TrainingArguments

    from hf_distill.arguments import DistillationArguments

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    return [f for f in dataclasses.fields(DistillationArguments) if f.name not in inherited]


def arguments_table() -> str:
    """A Markdown table: field, type, default and the field's help (its `metadata["help"]`)."""
    from hf_distill.arguments import DistillationArguments

    rows = ["| field | type | default | help |", "| --- | --- | --- | --- |"]
    for field in distillation_fields():
        help_text = field.metadata.get("help")
        if not help_text:
            raise ValueError(f"DistillationArguments.{field.name} has no metadata['help']: give the field its help.")
        kind = annotation(DistillationArguments, field.name)
        rows.append(f"| `{field.name}` | `{kind}` | {_cell(_default(field))} | {_cell(help_text)} |")
    return "\n".join(rows) + "\n"


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """MkDocs event: fill the arguments table into the page that holds the marker."""
    if ARGUMENTS_MARKER in markdown:
        markdown = markdown.replace(ARGUMENTS_MARKER, arguments_table())
    return markdown
