"""How a model's location is recorded in published files (hf_distill.base.recorded_names): never a machine's absolute
path (issue #39 case 17)."""

from __future__ import annotations

from pathlib import Path

from hf_distill.base.recorded_names import recorded_command, recorded_name, recorded_path
from hf_distill.publish.report import DistillationReport


def test_hub_ids_and_names_are_kept_and_local_folders_are_named(tmp_path, monkeypatch):
    assert recorded_name("org/teacher-base") == "org/teacher-base"
    assert recorded_name("bert-base-uncased") == "bert-base-uncased"
    assert recorded_name(None) == recorded_name("") == ""
    (tmp_path / "my-teacher").mkdir()
    assert recorded_name(str(tmp_path / "my-teacher")) == "my-teacher"
    assert recorded_name(tmp_path / "my-teacher") == "my-teacher"  # a PathLike
    assert recorded_name(str(tmp_path / "gone" / "teacher")) == "teacher"  # absolute, even when not here
    assert recorded_name(str(tmp_path / "my-teacher") + "/") == "my-teacher"
    monkeypatch.chdir(tmp_path)
    assert recorded_name("./my-teacher") == "my-teacher"  # a relative folder: its name, not ./
    snapshot = tmp_path / "hub" / "models--fake-org--tiny-llama" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    assert recorded_name(str(snapshot)) == "fake-org/tiny-llama"  # a Hub download: the id it came from


def test_a_report_never_holds_an_absolute_path(tmp_path):
    report = DistillationReport(teacher=str(tmp_path / "teacher"), initialised_from=str(tmp_path / "start"),
                                adapter={"peft_type": "LORA", "base_model": str(tmp_path / "base")})
    assert (report.teacher, report.initialised_from, report.adapter["base_model"]) == ("teacher", "start", "base")
    assert report.updated(teacher=str(Path("/abs") / "other")).teacher == "other"
    assert str(tmp_path) not in str(DistillationReport.from_dict(report.to_dict()).to_dict())


def test_a_recorded_command_line_holds_no_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "work" / "rows").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    argv = ["hf-distill", "signal", "create", str(tmp_path / "models" / "teacher"), str(tmp_path / "work" / "rows"),
            "out dir", f"--tokenizer={tmp_path / 'tok'}", "--k", "8", "org/teacher"]
    assert recorded_command(argv) == "hf-distill signal create teacher rows 'out dir' --tokenizer=tok --k 8 org/teacher"
    assert recorded_path(tmp_path / "work" / "a" / "b") == "a/b" and recorded_path("rel/x") == "rel/x"
