"""Presets fill only what the user did not give: a keyword, a command-line flag or a YAML key always wins,
whatever its value (the field's default included), and `dataclasses.replace` never re-applies a preset."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
from transformers import HfArgumentParser

from hf_distill import DistillationArguments
from hf_distill.presets import PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
from common import parse_args  # noqa: E402  (the recipes' own --config YAML loading)

PLAIN = DistillationArguments(output_dir="x", use_cpu=True, report_to=[])
BASE = {"output_dir": "out", "use_cpu": True, "report_to": []}
# Loss fields a preset sets to something other than the plain default: giving the default must keep it.
CASES = [
    (preset, key)
    for preset in sorted(PRESETS)
    for key, value in PRESETS[preset]().items()
    if key != "distill_terms" and value != getattr(PLAIN, key)
]


def test_cases_cover_every_preset_that_changes_a_scalar_field():
    assert {p for p, _ in CASES} == set(PRESETS)
    assert ("distilbert", "kd_weight") in CASES and ("tinybert_prediction", "temperature") in CASES


@pytest.mark.parametrize(("preset", "key"), CASES)
def test_keyword_equal_to_the_default_wins_over_the_preset(preset, key):
    default = getattr(PLAIN, key)
    a = DistillationArguments(**BASE, distill_preset=preset, **{key: default})
    assert getattr(a, key) == default
    # every other field the preset names still comes from the preset
    for other, value in PRESETS[preset]().items():
        if other not in (key, "distill_terms"):
            assert getattr(a, other) == value, other


@pytest.mark.parametrize(("preset", "key"), CASES)
def test_command_line_flag_equal_to_the_default_wins_over_the_preset(preset, key):
    default = getattr(PLAIN, key)
    (a,) = HfArgumentParser(DistillationArguments).parse_args_into_dataclasses(
        ["--output_dir", "out", "--use_cpu", "true", "--distill_preset", preset, f"--{key}", str(default)]
    )
    assert getattr(a, key) == default


@pytest.mark.parametrize(("preset", "key"), CASES)
def test_yaml_key_equal_to_the_default_wins_over_the_preset(preset, key, tmp_path):
    default = getattr(PLAIN, key)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\ndistill_preset: {preset}\n{key}: {json.dumps(default)}\n")
    a, _ = parse_args([DistillationArguments], "test", ["--config", str(cfg)])
    assert getattr(a, key) == default
    (b,) = HfArgumentParser(DistillationArguments).parse_yaml_file(str(cfg))
    assert getattr(b, key) == default


def test_yaml_value_is_overridden_by_a_flag_and_both_beat_the_preset(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\ndistill_preset: tinybert_prediction\ntemperature: 2.0\n"
                   "task_weight: 0.5\n")
    a, _ = parse_args([DistillationArguments], "test", ["--config", str(cfg), "--kd_weight", "0.5"])
    assert (a.kd_loss, a.temperature, a.kd_weight, a.task_weight) == ("soft_ce", 2.0, 0.5, 0.5)
    b, _ = parse_args([DistillationArguments], "test", ["--config", str(cfg), "--temperature", "1.5"])
    assert (b.temperature, b.kd_weight) == (1.5, 1.0)


def test_without_a_preset_the_fields_hold_their_documented_defaults():
    a = DistillationArguments(**BASE)
    assert (a.temperature, a.kd_loss, a.kd_weight, a.task_weight, a.projection, a.distill_terms) == (
        2.0, "kl", 0.5, 0.5, "shared", None)
    (b,) = HfArgumentParser(DistillationArguments).parse_args_into_dataclasses(["--output_dir", "out"])
    assert (b.temperature, b.kd_loss, b.kd_weight, b.task_weight, b.projection) == (2.0, "kl", 0.5, 0.5, "shared")


def test_explicit_terms_replace_the_preset_terms_and_an_empty_list_removes_them():
    mine = [{"loss": "hidden_mse", "layers": "last"}]
    a = DistillationArguments(**BASE, distill_preset="distilbert", distill_terms=mine)
    assert [t["loss"] for t in a.distill_terms] == ["hidden_mse"]
    b = DistillationArguments(**BASE, distill_preset="distilbert", distill_terms=[])
    assert not b.terms and (b.kd_weight, b.task_weight) == (5.0, 2.0)
    c = DistillationArguments(**BASE, distill_preset="distilbert")
    assert [t.loss for t in c.terms] == ["cosine_loss"]


def test_empty_terms_in_yaml_remove_the_preset_terms(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\ndistill_preset: distilbert\ndistill_terms: []\n")
    a, _ = parse_args([DistillationArguments], "test", ["--config", str(cfg)])
    assert not a.terms


def test_replace_keeps_the_values_of_the_replaced_object():
    a = DistillationArguments(**BASE, distill_preset="distilbert", kd_weight=0.5)
    b = dataclasses.replace(a, learning_rate=1e-4)
    assert (b.kd_weight, b.task_weight, b.temperature, b.learning_rate) == (0.5, 2.0, 2.0, 1e-4)
    # a value changed on the object after it was built survives a replace of an unrelated field
    a.task_weight = 0.5
    assert dataclasses.replace(a, seed=3).task_weight == 0.5
    # replacing a preset-filled field with the plain default keeps that default
    p = DistillationArguments(**BASE, distill_preset="tinybert_prediction")
    q = dataclasses.replace(p, temperature=2.0, kd_loss="kl")
    assert (q.temperature, q.kd_loss, q.kd_weight, q.task_weight) == (2.0, "kl", 1.0, 0.0)


def test_replace_keeps_removed_preset_terms_removed():
    a = DistillationArguments(**BASE, distill_preset="distilbert")
    b = dataclasses.replace(a, distill_terms=[])
    assert not b.terms
    assert not dataclasses.replace(b, seed=1).terms


def test_resolved_arguments_serialise_with_real_values():
    a = DistillationArguments(**BASE, distill_preset="tinybert_prediction", temperature=2.0)
    d = json.loads(a.to_json_string())
    assert (d["kd_loss"], d["temperature"], d["kd_weight"], d["task_weight"]) == ("soft_ce", 2.0, 1.0, 0.0)
    again = DistillationArguments(**{f.name: getattr(a, f.name) for f in dataclasses.fields(a) if f.init})
    assert again.distillation_summary() == a.distillation_summary()


def test_unknown_preset_is_refused_with_the_known_names():
    with pytest.raises(ValueError, match="distill_preset='nope' is unknown. Known: distilbert"):
        DistillationArguments(**BASE, distill_preset="nope")


def test_every_preset_names_only_fields_that_can_tell_given_from_not_given():
    from hf_distill.arguments import PRESET_DEFAULTS

    for name, make in PRESETS.items():
        assert set(make()) <= {*PRESET_DEFAULTS, "distill_terms"}, name
        for key in PRESET_DEFAULTS:
            field = next(f for f in dataclasses.fields(DistillationArguments) if f.name == key)
            assert field.default is None and getattr(PLAIN, key) == PRESET_DEFAULTS[key]


def test_command_line_help_states_the_defaults_and_the_rule():
    text = " ".join(HfArgumentParser(DistillationArguments).format_help().split())
    assert "Default: 0.5, or the value of `distill_preset`; a value you give always wins over the preset." in text
    assert "A value you give as a keyword, flag or YAML key always wins, even one equal to the default." in text
