"""mkdocs_hooks.py: the API reference renders each DistillationArguments field's help (issue #40, item 9)."""

import dataclasses
import html
import re
from pathlib import Path

import pytest
from transformers import HfArgumentParser, TrainingArguments

import mkdocs_hooks
from hf_distill import DistillationArguments

ROOT = Path(__file__).resolve().parents[1]


def _added_fields() -> list[dataclasses.Field]:
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    return [f for f in dataclasses.fields(DistillationArguments) if f.name not in inherited]


def _rendered_rows(markdown_text: str) -> dict[str, list[str]]:
    """The table rows as Python-Markdown (MkDocs' renderer) renders them: {field name: the cells' plain text}."""
    markdown = pytest.importorskip("markdown")
    page = markdown.markdown(markdown_text, extensions=["tables"])
    rows = {}
    for row in re.findall(r"<tr>(.*?)</tr>", page, flags=re.S):
        cells = [html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in re.findall(r"<td>(.*?)</td>", row, re.S)]
        if cells:
            rows[cells[0]] = cells[1:]
    return rows


def test_the_arguments_page_renders_every_field_with_its_help():
    # HfArgumentParser (the recipes' parser) replaces the shared fields' `type` by resolved types: the table must
    # not change with it (and so not with the tests that ran before this one in the process).
    HfArgumentParser(DistillationArguments)
    page = (ROOT / "docs" / "api" / "arguments.md").read_text()
    assert mkdocs_hooks.ARGUMENTS_MARKER in page
    rendered = mkdocs_hooks.on_page_markdown(page, page=None)
    assert mkdocs_hooks.ARGUMENTS_MARKER not in rendered
    rows = _rendered_rows(rendered)
    added = _added_fields()
    assert len(added) >= 20 and set(rows) == {f.name for f in added}  # TrainingArguments' own fields not repeated
    for field in added:
        kind, default, help_text = rows[field.name]
        # the help reads as written: `T**2` is not bold, `a || b` no cell border, backticks only mark code
        assert help_text == " ".join(field.metadata["help"].replace("`", "").split()), field.name
        assert kind == DistillationArguments.__annotations__[field.name], field.name  # as written: "float | None"
        assert default == repr(field.default), field.name


def test_a_field_without_help_is_refused_at_build_time(monkeypatch):
    fields = mkdocs_hooks.distillation_fields()
    bare = dataclasses.field(default=None)
    bare.name, bare.type = "undocumented", "int | None"
    monkeypatch.setattr(mkdocs_hooks, "distillation_fields", lambda: [*fields, bare])
    with pytest.raises(ValueError, match="undocumented has no metadata"):
        mkdocs_hooks.arguments_table()
