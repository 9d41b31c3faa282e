"""The results files in benchmarks/results are published with the repository: they name paths relative to it (or
under `~`), never a machine's absolute path, and the benchmarks record them so (benchmarks/sections.py `portable`;
issue #39 case 16)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
# An absolute path of two or more parts, where a path may start (not "tokens/s", not a URL's "//host/...").
ABSOLUTE = re.compile(r"(?:^|[\s\"'`(=\[])((?:/[\w.+-]+){2,})", re.M)


@pytest.fixture()
def sections(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import sections

    yield sections
    sys.modules.pop("sections", None)


def test_no_results_file_names_a_machines_absolute_path():
    files = sorted(p for p in (BENCHMARKS / "results").iterdir() if p.suffix in (".json", ".md"))
    assert files
    found = {p.name: ABSOLUTE.findall(p.read_text()) for p in files}
    assert {name: paths for name, paths in found.items() if paths} == {}


def test_benchmarks_record_paths_relative_to_the_repository_or_home(sections):
    root, home = str(sections.ROOT), os.path.expanduser("~")
    command = f"python benchmarks/causal_lm.py --sft-teacher {root}/.cache/hf_distill/causal_teachers/f8 --o {root}"
    assert sections.portable(command) == "python benchmarks/causal_lm.py --sft-teacher " \
                                         ".cache/hf_distill/causal_teachers/f8 --o ."
    assert sections.portable(f"{root}2/x") == f"{root}2/x"  # another folder that starts like it: not the repo
    assert sections.portable(f"--out {home}/out") == "--out ~/out"
    data = {"teacher": Path(root) / "benchmarks" / "runs" / "teacher", "runs": [{"command": f"{root}/recipes/x.py"}],
            "ratio": 1.5, "kept": (0, 1)}
    assert sections.portable_tree(data) == {"teacher": "benchmarks/runs/teacher",
                                            "runs": [{"command": "recipes/x.py"}], "ratio": 1.5, "kept": (0, 1)}
    assert not ABSOLUTE.findall(str(sections.portable_tree(data)))
