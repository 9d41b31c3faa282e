"""The `hf-distill` command line: every command, offline, with the exit codes a shell user expects."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants as hub_constants
import pytest
import yaml
from hub_server import FakeHub, tiny_run

from hf_distill.cli import main
from hf_distill.publish.hub import upload_files


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> Path:
    """A saved student (weights, config, tokenizer, training_args.bin, checkpoints) of a real short run."""
    trainer = tiny_run(tmp_path_factory.mktemp("cli"), hidden_term=False, max_steps=4)
    trainer.save_model()
    return Path(trainer.args.output_dir)


@pytest.fixture()
def fresh(student, tmp_path) -> Path:
    """A copy of the student folder, without a card, that a test may change."""
    folder = tmp_path / "student"
    shutil.copytree(student, folder)
    return folder


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def front_matter(readme: Path) -> dict:
    return yaml.safe_load(readme.read_text().split("---\n", 2)[1])


# ---------------------------------------------------------------------- help and usage errors


@pytest.mark.slow
def test_console_script_help_in_a_subprocess():
    script = Path(sys.executable).with_name("hf-distill")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "hf_distill.cli"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in ("demo", "run", "card", "push", "report"):
        assert name in done.stdout


@pytest.mark.parametrize("command", [[], ["card"], ["push"], ["report"], ["run"]])
def test_help_at_every_level(command, capsys):
    assert main([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hf-distill")


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2  # no command: the help, as a usage error
    assert "usage: hf-distill" in capsys.readouterr().out
    assert main(["card"]) == 2  # missing folder
    assert "the following arguments are required: student_dir" in capsys.readouterr().err
    assert main(["push", "folder-only"]) == 2
    assert main(["report", "a", "b"]) == 2
    assert "unrecognized arguments" in capsys.readouterr().err
    assert main(["no-such-command"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'no-such-command'" in err and "Traceback" not in err


def test_version(capsys):
    import hf_distill

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hf-distill {hf_distill.__version__}"


@pytest.mark.slow
def test_help_and_version_do_not_import_torch():
    """The package loads its classes on first use, so asking the CLI for help costs no torch import (seconds)."""
    code = ("import sys; from hf_distill.cli import main; import hf_distill; "
            "codes = [main(['--help']), main(['--version'])]; "
            "print(codes, sorted(m for m in ('torch', 'transformers') if m in sys.modules)); "
            "hf_distill.DistillationTrainer; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-2:] == ["[0, 0] []", "True"]


# ---------------------------------------------------------------------- demo and run


def test_demo_gets_its_own_arguments(capsys):
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hf-distill demo") and "--quick" in out
    assert main(["demo", "--no-such-option"]) == 2


@pytest.fixture()
def recipes(tmp_path, monkeypatch) -> Path:
    """A project folder with recipes/echo.py (records how it was run) and recipes/fail.py."""
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "helper_mod.py").write_text("VALUE = 7\n")
    (tmp_path / "recipes" / "echo.py").write_text(
        "import json, sys\nimport helper_mod\n"
        "if __name__ == '__main__':\n"
        "    out = sys.argv[sys.argv.index('--record') + 1]\n"
        "    json.dump({'argv': sys.argv, 'helper': helper_mod.VALUE}, open(out, 'w'))\n"
    )
    (tmp_path / "recipes" / "fail.py").write_text(
        "import sys\nif __name__ == '__main__':\n    sys.exit(sys.argv[1] if len(sys.argv) > 1 else 3)\n"
    )
    monkeypatch.chdir(tmp_path)
    return tmp_path / "recipes"


def test_run_executes_the_recipe_as_a_script(recipes, tmp_path):
    argv_before, path_before = sys.argv[:], sys.path[:]
    record = tmp_path / "record.json"
    code = main(["run", "echo", "--config", "c.yaml", "--output_dir", "out", "--record", str(record)])
    assert code == 0
    ran = json.loads(record.read_text())
    assert ran["argv"] == [
        str(recipes / "echo.py"),
        "--config",
        "c.yaml",
        "--output_dir",
        "out",
        "--record",
        str(record),
    ]
    assert ran["helper"] == 7  # the recipe's folder is importable, as with `python recipes/echo.py`
    assert sys.argv == argv_before and sys.path == path_before
    assert main(["run", str(recipes / "echo.py"), "--record", str(record)]) == 0  # an explicit path
    assert json.loads(record.read_text())["argv"][0] == str(recipes / "echo.py")


def test_run_exit_codes(recipes, capsys):
    assert main(["run", "fail"]) == 3
    assert main(["run", "fail", "broken config"]) == 1  # sys.exit("message"): message on stderr, status 1
    assert capsys.readouterr().err.strip() == "error: broken config"
    assert main(["run", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("error: unknown recipe 'nope'. Available recipes: ")
        and "echo" in err
        and "fail" in err
        and "helper_mod" not in err  # a module the recipes import is not a recipe (no __main__ block)
    )
    assert main(["run", "helper_mod"]) == 2  # it would have run, done nothing and exited 0
    assert main(["run", "missing/script.py"]) == 2


# ---------------------------------------------------------------------- card, push, report


@pytest.mark.slow
def test_card_writes_the_readme(fresh, capsys):
    code = main(
        [
            "card",
            str(fresh),
            "--teacher",
            "org/teacher",
            "--dataset",
            "nyu-mll/glue",
            "--license",
            "mit",
            "--repo_id",
            "me/tiny",
        ]
    )
    assert code == 0 and capsys.readouterr().out.strip() == f"Wrote {fresh / 'README.md'}"
    meta = front_matter(fresh / "README.md")
    assert (
        meta["base_model"] == "org/teacher"
        and meta["license"] == "mit"
        and meta["datasets"] == ["nyu-mll/glue"]
    )
    assert meta["model-index"][0]["name"] == "me/tiny" and "logit-kd" in meta["tags"]
    assert 'from_pretrained("me/tiny")' in (fresh / "README.md").read_text()
    # Refreshing keeps what was given before.
    assert main(["card", str(fresh)]) == 0
    assert front_matter(fresh / "README.md")["base_model"] == "org/teacher"


def test_card_of_a_missing_folder_fails_cleanly(tmp_path, capsys):
    assert main(["card", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    (tmp_path / "empty").mkdir()  # a folder without a saved model: no card written into it
    assert main(["card", str(tmp_path / "empty")]) == 1
    assert "not a saved student" in capsys.readouterr().err and not any((tmp_path / "empty").iterdir())


@pytest.mark.slow
def test_push_publishes_the_student(fresh, capsys, monkeypatch):
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    with FakeHub() as hub:
        code = main(
            [
                "push",
                str(fresh),
                "fake-org/cli-student",
                "--private",
                "--revision",
                "dev",
                "--token",
                "tok",
                "--endpoint",
                hub.endpoint,
            ]
        )
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("Writing a model card first: ")  # the folder had no README.md
    commit = hub.repos["fake-org/cli-student"]["commits"][-1]
    assert out.strip().endswith(f"{hub.endpoint}/fake-org/cli-student/commit/{commit['oid']}")
    files = hub.files("fake-org/cli-student", "dev")
    assert set(files) == set(upload_files(fresh)) and "README.md" in files and "config.json" in files
    assert not any(name.endswith((".bin", ".pt")) or "checkpoint" in name for name in files)
    assert hub.repos["fake-org/cli-student"]["private"] is True
    assert 'from_pretrained("fake-org/cli-student")' in files["README.md"].decode()


def test_push_failure_is_one_line_and_leaves_the_folder(fresh, capsys, monkeypatch):
    assert main(["card", str(fresh)]) == 0
    capsys.readouterr()
    before = snapshot(fresh)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_constants, "HF_HUB_DISABLE_XET", True)  # fail at once, no commit retries
    with FakeHub(fail={"commit": 500}) as hub:
        assert main(["push", str(fresh), "fake-user/x", "--endpoint", hub.endpoint]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: Could not push {fresh} to fake-user/x at {hub.endpoint}: ")
    assert err.count("\n") == 1 and "Traceback" not in err and "500" in err
    assert snapshot(fresh) == before


def test_push_offline_or_not_a_student_fails_cleanly(tmp_path, fresh, capsys):
    assert main(["push", str(fresh), "fake-user/x"]) == 1  # HF_HUB_OFFLINE=1 in the tests
    assert "offline mode is enabled" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["push", str(tmp_path / "empty"), "fake-user/x"]) == 1
    assert "no config.json" in capsys.readouterr().err
    assert list((tmp_path / "empty").iterdir()) == []  # nothing written into a folder that is not a student


def test_report_writes_the_loss_plot(fresh, capsys, tmp_path):
    assert main(["report", str(fresh)]) == 0
    assert capsys.readouterr().out.strip() == f"Wrote {fresh / 'loss_components.png'}"
    assert (fresh / "loss_components.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["report", str(tmp_path / "nothing-here")]) == 1
    assert capsys.readouterr().err.startswith("error: ")


def test_run_gives_yaml_keys_and_flags_priority_over_the_preset(tmp_path, monkeypatch):
    """`hf-distill run` with a recipe parsing as the real ones do (recipes/common.py): values equal to the
    defaults, from the YAML config or a flag, are kept although the preset names other values."""
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "dump.py").write_text(
        "import json, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent.parent / 'recipes')!r})\n"
        "from common import parse_args\n"
        "from hf_distill import DistillationArguments\n"
        "if __name__ == '__main__':\n"
        "    args, _ = parse_args([DistillationArguments], 'dump')\n"
        "    json.dump(args.distillation_summary(), open(args.output_dir + '.json', 'w'))\n"
    )
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text("distill_preset: tinybert_prediction\ntemperature: 2.0\nuse_cpu: true\n")
    assert main(["run", "dump", "--config", str(config), "--output_dir", "a", "--task_weight", "0.5"]) == 0
    a = json.loads((tmp_path / "a.json").read_text())
    assert (a["kd_loss"], a["temperature"], a["kd_weight"], a["task_weight"]) == ("soft_ce", 2.0, 1.0, 0.5)
    config.write_text("distill_preset: distilbert\nkd_weight: 0.5\ndistill_terms: []\nuse_cpu: true\n")
    assert main(["run", "dump", "--config", str(config), "--output_dir", "b", "--task_weight", "0.5"]) == 0
    b = json.loads((tmp_path / "b.json").read_text())
    assert (b["kd_weight"], b["task_weight"], b["distill_terms"]) == (0.5, 0.5, [])
    assert main(["run", "dump", "--distill_preset", "minilm", "--output_dir", "c", "--kd_weight", "0.5"]) == 0
    c = json.loads((tmp_path / "c.json").read_text())
    assert (c["kd_weight"], c["task_weight"], [t["loss"] for t in c["distill_terms"]]) == (0.5, 0.0, ["relation_kl"])
