"""Presets fill only what the user did not give: a keyword, a command-line flag or a YAML key always wins,
whatever its value (the field's default included), and `dataclasses.replace` never re-applies a preset. What
neither gives and depends on the student (temperature, kd_token_mask) is filled by the trainer for its head."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import helpers
import pytest
from transformers import BertConfig, BertForMaskedLM, HfArgumentParser

from hf_distill import DistillationArguments, DistillationTrainer
from hf_distill.arguments import HEAD_DEFAULTS, PRESET_DEFAULTS
from hf_distill.presets import PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
from common import parse_args  # noqa: E402  (the recipes' own --config YAML loading)

PLAIN = DistillationArguments(output_dir="x", use_cpu=True, report_to=[])
BASE = {"output_dir": "out", "use_cpu": True, "report_to": []}


def plain_default(key):
    """The value a field takes when neither the user nor a preset gives it (for a head-dependent field: an
    encoder's, the one a plain `Trainer` script distilling a classifier gets)."""
    return PRESET_DEFAULTS[key] if key in PRESET_DEFAULTS else HEAD_DEFAULTS[key][0]


# Loss fields a preset sets to something other than the plain default: giving the default must keep it.
CASES = [
    (preset, key)
    for preset in sorted(PRESETS)
    for key, value in PRESETS[preset]().items()
    if key != "distill_terms" and value != plain_default(key)
]


def test_cases_cover_every_preset_that_changes_a_scalar_field():
    assert {p for p, _ in CASES} == set(PRESETS)
    assert ("distilbert", "kd_weight") in CASES and ("tinybert_prediction", "temperature") in CASES


@pytest.mark.parametrize(("preset", "key"), CASES)
def test_keyword_equal_to_the_default_wins_over_the_preset(preset, key):
    default = plain_default(key)
    a = DistillationArguments(**BASE, distill_preset=preset, **{key: default})
    assert getattr(a, key) == default
    # every other field the preset names still comes from the preset
    for other, value in PRESETS[preset]().items():
        if other not in (key, "distill_terms"):
            assert getattr(a, other) == value, other


@pytest.mark.parametrize(("preset", "key"), CASES)
def test_command_line_flag_equal_to_the_default_wins_over_the_preset(preset, key):
    default = plain_default(key)
    (a,) = HfArgumentParser(DistillationArguments).parse_args_into_dataclasses(
        ["--output_dir", "out", "--use_cpu", "true", "--distill_preset", preset, f"--{key}", str(default)]
    )
    assert getattr(a, key) == default


@pytest.mark.parametrize(("preset", "key"), CASES)
def test_yaml_key_equal_to_the_default_wins_over_the_preset(preset, key, tmp_path):
    default = plain_default(key)
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
    assert (a.kd_loss, a.kd_weight, a.task_weight, a.projection, a.distill_terms) == ("kl", 0.5, 0.5, "shared", None)
    (b,) = HfArgumentParser(DistillationArguments).parse_args_into_dataclasses(["--output_dir", "out"])
    assert (b.kd_loss, b.kd_weight, b.task_weight, b.projection) == ("kl", 0.5, 0.5, "shared")
    # the head-dependent ones wait for the student (DistillationTrainer fills them: tests below)
    assert (a.temperature, a.kd_token_mask, b.temperature, b.kd_token_mask) == (None, None, None, None)
    assert (a.jsd_beta, a.multi_teacher, a.teacher_weights) == (None, None, None)  # never filled: see test_arguments


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
    for name, make in PRESETS.items():
        assert set(make()) <= {*PRESET_DEFAULTS, *HEAD_DEFAULTS, "distill_terms"}, name
        for key in PRESET_DEFAULTS:
            field = next(f for f in dataclasses.fields(DistillationArguments) if f.name == key)
            assert field.default is None and getattr(PLAIN, key) == PRESET_DEFAULTS[key]
        for key in HEAD_DEFAULTS:
            field = next(f for f in dataclasses.fields(DistillationArguments) if f.name == key)
            assert field.default is None and getattr(PLAIN, key) is None


def test_command_line_help_states_the_defaults_and_the_rule():
    text = " ".join(HfArgumentParser(DistillationArguments).format_help().split())
    assert "Default: 0.5, or the value of `distill_preset`; a value you give always wins over the preset." in text
    assert "A value you give as a keyword, flag or YAML key always wins, even one equal to the default." in text


# ------------------------------------------ defaults that depend on the student's head (issue 28, case 9)


def _trainer(tmp_path, student, teacher, a=None, **kw):
    causal = student.config.model_type == "llama"
    return DistillationTrainer(model=student, teacher_model=teacher, args=a or helpers.args(tmp_path, **kw),
                               train_dataset=helpers.sft_rows(8) if causal else helpers.token_dataset(8),
                               data_collator=helpers.labelled_collate if causal else helpers.collate)


def test_a_causal_lm_student_gets_temperature_1_and_the_completion_tokens(tmp_path):
    """What a TRL/SFT user expects (GKD: T = 1, loss on the completion): filled for a causal LM when not given."""
    trainer = _trainer(tmp_path, helpers.llama(0), helpers.llama(1))
    assert (trainer.settings.temperature, trainer.settings.kd_token_mask) == (1.0, "labels")
    # encoders keep today's defaults: T = 2, every real token for token-level heads
    assert _trainer(tmp_path, helpers.bert(2), helpers.teacher()).settings.temperature == 2.0
    mlm = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=120)
    trainer = _trainer(tmp_path, BertForMaskedLM(BertConfig(**mlm)), BertForMaskedLM(BertConfig(**mlm)))
    assert (trainer.settings.temperature, trainer.settings.kd_token_mask) == (2.0, "attention")


def test_a_value_given_or_from_a_preset_wins_over_the_head_default(tmp_path):
    llama = helpers.llama
    assert _trainer(tmp_path, llama(0), llama(1)).settings.temperature == 1.0  # not given
    assert _trainer(tmp_path, llama(0), llama(1), temperature=2.0).settings.temperature == 2.0  # given: the default's
    assert _trainer(tmp_path, llama(0), llama(1), kd_token_mask="attention").settings.kd_token_mask == "attention"
    assert _trainer(tmp_path, llama(0), llama(1), distill_preset="distilbert").settings.temperature == 2.0
    tiny = _trainer(tmp_path, helpers.bert(2), helpers.teacher(), distill_preset="tinybert_prediction")
    assert tiny.settings.temperature == 1.0
    (flag,) = HfArgumentParser(DistillationArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "true", "--report_to", "none", "--temperature", "2"])
    assert _trainer(tmp_path, llama(0), llama(1), a=flag).settings.temperature == 2.0


def test_head_defaults_follow_the_student_the_arguments_are_given_to(tmp_path):
    a = helpers.args(tmp_path)
    b = dataclasses.replace(a, learning_rate=1e-4)  # before any trainer: still "not given"
    assert _trainer(tmp_path, helpers.llama(0), helpers.llama(1), a=a).settings.temperature == 1.0
    again = _trainer(tmp_path, helpers.bert(2), helpers.teacher(), a=a)  # same object, another head: filled again
    assert (again.settings.temperature, again.settings.kd_token_mask) == (2.0, None)
    assert _trainer(tmp_path, helpers.llama(0), helpers.llama(1), a=b).settings.temperature == 1.0
