"""mkdocs_hooks.py: the API reference renders each DistillationArguments field's help (issue #40, item 9)."""

import dataclasses
from pathlib import Path

import pytest
from transformers import TrainingArguments

import mkdocs_hooks
from hf_distill import DistillationArguments

ROOT = Path(__file__).resolve().parents[1]


def test_the_arguments_page_renders_every_field_with_its_help():
    page = (ROOT / "docs" / "api" / "arguments.md").read_text()
    assert mkdocs_hooks.ARGUMENTS_MARKER in page
    rendered = mkdocs_hooks.on_page_markdown(page, page=None)
    assert mkdocs_hooks.ARGUMENTS_MARKER not in rendered
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    added = [f for f in dataclasses.fields(DistillationArguments) if f.name not in inherited]
    assert len(added) >= 20  # temperature, kd_loss, ..., eval_with_teacher
    for field in added:
        row = next(line for line in rendered.splitlines() if line.startswith(f"| `{field.name}` |"))
        assert mkdocs_hooks._cell(field.metadata["help"]) in row
    assert "output_dir" not in mkdocs_hooks.arguments_table()  # TrainingArguments' own fields are not repeated


def test_a_field_without_help_is_refused_at_build_time(monkeypatch):
    fields = mkdocs_hooks.distillation_fields()
    bare = dataclasses.field(default=None)
    bare.name, bare.type = "undocumented", "int | None"
    monkeypatch.setattr(mkdocs_hooks, "distillation_fields", lambda: [*fields, bare])
    with pytest.raises(ValueError, match="undocumented has no metadata"):
        mkdocs_hooks.arguments_table()


def test_a_pipe_in_a_help_stays_inside_its_cell():
    assert mkdocs_hooks._cell("a | b\n  c") == "a \\| b c"
