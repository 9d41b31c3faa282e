"""Seed repeats of the distil-whisper recipe's students (issue #44 item 4): KD and CE-only, same teacher and labels.

    python recipes/distil_whisper.py --config recipes/configs/distil_whisper_espeak.yaml \
        --output_dir benchmarks/runs/distil_whisper                  # every stage, seed 42
    nice -n 19 python benchmarks/distil_whisper_seeds.py --base benchmarks/runs/distil_whisper --seeds 1 2

Each extra seed gets its own folder `<base>_seed<S>` holding a copy of the base run's pseudo-labels, filter and
initial student, and runs the recipe's `distil baseline evaluate` stages with `--seed S --teacher <the base run's
teacher>`: the row order and dropout change; the teacher, the initial student and the kept rows do not (the seed is
part of a trained teacher's cache key, so the teacher is named, not looked up). The seeds run side by side
(`--parallel`, one thread each) or one after the other; a seed whose folder holds a finished run is read, not run
again. The table (mean and sample standard deviation of each WER over the base run
and the seeds) goes to stdout and `benchmarks/results/distil_whisper_seeds.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from sections import portable_tree

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RECIPE = ROOT / "recipes" / "distil_whisper.py"
WERS = ("teacher", "student", "baseline")


def seed_dir(base: Path, seed: int) -> Path:
    """`<base>_seed<S>` with the base run's pseudo-labels and initial student copied in (once)."""
    out = base.parent / f"{base.name}_seed{seed}"
    for part in ("pseudo_labels", "student_init"):
        if not (out / part).exists():
            shutil.copytree(base / part, out / part)
    return out


def _spread(vals: list[float]) -> dict:
    return {"mean": statistics.mean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0, "runs": vals}


def summary(runs: dict[str, dict]) -> dict:
    """Each WER's mean and sample standard deviation over the runs, KD's gain over CE-only seed by seed (the
    baseline's WER minus the KD student's), and the decode speed-ups."""
    splits = sorted({k.split("_wer_", 1)[1] for r in runs.values() for k in r if "_wer_" in k})
    table: dict = {}
    for split in splits:
        for model in WERS:
            table[f"{model}_wer_{split}"] = _spread([r[f"{model}_wer_{split}"] for r in runs.values()
                                                     if f"{model}_wer_{split}" in r])
        table[f"kd_gain_{split}"] = _spread([r[f"baseline_wer_{split}"] - r[f"student_wer_{split}"]
                                             for r in runs.values()])
    speed = [r["decode_speedup"] for r in runs.values()]
    table["decode_speedup"] = {"mean": statistics.mean(speed), "runs": speed}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="Output folder of a whole recipe run.")
    parser.add_argument("--config", default=str(ROOT / "recipes" / "configs" / "distil_whisper_espeak.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--parallel", action="store_true", help="Run the seeds side by side, one thread each.")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "distil_whisper_seeds.json")
    opts, extra = parser.parse_known_args()
    base_results = opts.base / "results.json"
    if not base_results.is_file() or not (opts.base / "student_init").is_dir():
        sys.exit(f"error: --base {opts.base} holds no finished recipe run (results.json, student_init/): run the "
                 "recipe there first")
    teacher = json.loads(base_results.read_text()).get("teacher")
    if not teacher or not (ROOT / teacher / "config.json").is_file() and not (Path(teacher) / "config.json").is_file():
        sys.exit(f"error: the base run's teacher {teacher!r} is gone: run the recipe's teacher stage again")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    for seed in opts.seeds:
        out = seed_dir(opts.base, seed)
        done = out / "results.json"
        if done.is_file() and any(k.startswith("baseline_wer_") for k in json.loads(done.read_text())):
            print(f"seed {seed}: reusing {done}")  # a finished seed is not trained again
            procs.append((seed, out, None, None))
            continue
        cmd = [sys.executable, str(RECIPE), "--config", opts.config, "--output_dir", str(out), "--seed", str(seed),
               "--teacher", teacher, "--stages", "distil", "baseline", "evaluate", "--disable_tqdm", "true", *extra]
        log = open(out / "run.log", "w")  # noqa: SIM115 - closed when the process is waited for
        procs.append((seed, out, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        if not opts.parallel:
            procs[-1][2].wait()
    runs = {"42": json.loads(base_results.read_text())}
    for seed, out, proc, log in procs:
        if proc is not None and proc.wait() != 0:
            sys.exit(f"error: seed {seed} failed (exit {proc.returncode}); its log: {out / 'run.log'}")
        if log is not None:
            log.close()
        runs[str(seed)] = json.loads((out / "results.json").read_text())
    result = {"base": str(opts.base), "seeds": list(runs), "summary": summary(runs),
              "per_seed": {s: {k: v for k, v in r.items() if "_wer_" in k or k in ("decode_speedup", "train_steps")}
                           for s, r in runs.items()}}
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(portable_tree(result), indent=2) + "\n")
    for key, row in result["summary"].items():
        spread = f" ± {row['std']:.3f}" if "std" in row else ""
        print(f"{key:32s} {row['mean']:.3f}{spread}  {[round(v, 3) for v in row['runs']]}")


if __name__ == "__main__":
    main()
