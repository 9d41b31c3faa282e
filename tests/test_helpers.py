"""tests/helpers.run_script: a script run in the test's process reports what a subprocess would."""

import os
import sys

from helpers import run_script


def test_run_script_gives_the_exit_code_output_and_restores_the_process(tmp_path):
    script = tmp_path / "tool.py"
    script.write_text(
        "import sys\n"
        "import sibling\n"  # the script's folder is importable, as under `python tool.py`
        "if __name__ == '__main__':\n"
        "    print('argv', sys.argv[1:], sibling.VALUE)\n"
        "    print('error: bad', file=sys.stderr)\n"
        "    raise SystemExit(int(sys.argv[1]))\n"
    )
    (tmp_path / "sibling.py").write_text("VALUE = 7\n")
    argv, path, cwd = sys.argv[:], sys.path[:], os.getcwd()
    done = run_script(script, 2, "x", cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (2, "argv ['2', 'x'] 7\n", "error: bad\n")
    assert (sys.argv, sys.path, os.getcwd()) == (argv, path, cwd)
    assert run_script(script, 0).returncode == 0


def test_run_script_reports_a_crash_with_its_traceback(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text("raise RuntimeError('boom')\n")
    done = run_script(script)
    assert done.returncode == 1 and "Traceback" in done.stderr and "RuntimeError: boom" in done.stderr
    script.write_text("import sys\nsys.exit('a message')\n")
    assert (run_script(script).returncode, run_script(script).stderr) == (1, "a message\n")
