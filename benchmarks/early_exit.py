"""Early exit (FastBERT) on SST-2: accuracy, exit layer, FLOPs and measured wall-clock speed-up per `speed`,
for FastBERT's branches and DeeBERT's cheaper off-ramps, beside students distilled from the same teacher (exit
early, or distil a smaller model?).

    python benchmarks/early_exit.py            # runs what is missing first (teacher, then recipes/fastbert.py)

1. The teacher is the quality benchmark's (benchmarks/quality_sst2.py: MiniLM-L6 fine-tuned on 20,000 SST-2 rows,
   `benchmarks/runs/teacher`; made with `quality_sst2.py --runs teacher` when missing), as issue #15 asks.
2. `recipes/fastbert.py --config recipes/configs/fastbert_sst2.yaml --teacher <it> --branch <b>` for each of
   `--branches` (output `benchmarks/runs/<b>`): branches self-distilled on 20,000 unlabeled rows; sweep of speed
   0.0-0.9 on the 872 validation rows (accuracy, mean exit layer, analytic FLOPs ratio, whether speed 0 gives the
   teacher's predictions). A finished run is reused only if it was made for this teacher with the config's
   training arguments (`--force` trains it again).
3. Here: wall-clock time of the full teacher, of adaptive inference at every speed of every branch kind and of
   every student of that teacher found in `benchmarks/runs` (`--students`), batch 1 and batch 32, fp32. The
   rows are cut into turns of 32 (32 batches of 1, or one of 32); each turn is run by every one of them back to
   back, in an order rotated from turn to turn, so a drift of the machine's speed hits all of them alike while
   each still runs warm (batch by batch interleaving ran every model with cold caches, which slowed the small
   ones most); a round is one pass over the rows, its speed-up the teacher's total time over the other's;
   reported: the median over rounds. Students are evaluated here too (fp32, all 872
   rows, the same tokenisation), so every row of the tables is measured in one run. A student not in
   `benchmarks/runs` is left out and named.
Writes benchmarks/results/early_exit.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = ROOT / "recipes" / "configs" / "fastbert_sst2.yaml"
RUNS = ROOT / "benchmarks" / "runs"
STUDENTS = "distilbert,tinybert,minilm,pkd_skip"  # the quality benchmark's runs that are encoder classifiers


def run(cmd: list[str], threads: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": str(threads)}
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)


def ensure_teacher(teacher: Path, threads: int) -> None:
    """The quality benchmark's teacher, fine-tuned by that benchmark when its default folder is empty."""
    if (teacher / "config.json").is_file():
        return
    if teacher.resolve() != (RUNS / "teacher").resolve():
        raise SystemExit(f"--teacher {teacher}: no config.json there; give a fine-tuned sequence classifier folder "
                         "(or leave --teacher out to use the quality benchmark's teacher)")
    run([sys.executable, str(ROOT / "benchmarks" / "quality_sst2.py"), "--runs", "teacher", "--threads", str(threads)],
        threads)


def made_for(work: Path) -> str | None:
    """The teacher a finished recipe run in `work` added its exits to."""
    return json.loads((work / "results.json").read_text()).get("teacher")


def stale_training(recipe: dict) -> str | None:
    """Why branches in a finished run were not trained as CONFIG says (None if they were): a run made before a
    config change (1 epoch, say) would otherwise be timed as if it were today's."""
    import yaml

    recorded = recipe.get("distill_args")  # the fields are the recipe's DISTILL_ARGS
    if recorded is None:
        return "it does not record its training arguments (made by an older recipe)"
    config = yaml.safe_load(CONFIG.read_text())
    diff = [f"{k} {v!r} (config: {config[k]!r})" for k, v in recorded.items() if k in config and config[k] != v]
    return "trained with " + ", ".join(diff) if diff else None


def batches_of(tokenizer, sentences: list[str], size: int, max_length: int) -> list[dict]:
    from transformers import DataCollatorWithPadding

    collate = DataCollatorWithPadding(tokenizer)
    enc = [tokenizer(s, truncation=True, max_length=max_length) for s in sentences]
    return [collate(enc[i : i + size]) for i in range(0, len(enc), size)]


TEACHER = "teacher"


def measure(teacher, others: dict, batches: list[dict], rounds: int, rows_per_turn: int = 32) -> dict:
    """Per round, teacher time / time of each of `others` (the tables give the median). The batches are cut into
    turns of `rows_per_turn` rows; each turn is run by all of them back to back, in an order rotated from turn to
    turn, so slow spells of the machine fall on all alike while each model still runs warm, as when it serves
    alone."""
    import torch

    fns = {TEACHER: teacher, **others}
    names = list(fns)
    size = max(1, rows_per_turn // len(next(iter(batches[0].values()))))
    turns = [batches[i : i + size] for i in range(0, len(batches), size)]
    ratios: dict = {k: [] for k in others}
    with torch.no_grad():
        for fn in fns.values():
            for b in batches[:4]:  # warm-up
                fn(b)
        for r in range(rounds):
            total = dict.fromkeys(names, 0.0)
            for i, turn in enumerate(turns):
                # who goes first moves evenly through the list over a round's turns, and by one more each round
                first = (i * len(names) // len(turns) + r) % len(names)
                for k in names[first:] + names[:first]:
                    start = time.perf_counter()
                    for b in turn:
                        fns[k](b)
                    total[k] += time.perf_counter() - start
            for k in others:
                ratios[k].append(total[TEACHER] / total[k])
            print(f"  round {r + 1}/{rounds}: teacher {total[TEACHER]:.2f}s; " + ", ".join(
                f"{k if isinstance(k, str) else f'{k[0]} {k[1]:g}'}: {ratios[k][-1]:.2f}x" for k in others), flush=True)
    return ratios


def load_students(names: list[str]) -> tuple[dict, list[str]]:
    """The students of `benchmarks/runs` that finished (results.json and weights), and the names not found."""
    from transformers import AutoModelForSequenceClassification

    found, missing = {}, []
    for name in names:
        folder = RUNS / name
        if (folder / "results.json").is_file() and (folder / "config.json").is_file():
            found[name] = AutoModelForSequenceClassification.from_pretrained(folder).eval()
        else:
            missing.append(name)
    return found, missing


def accuracy(model, batches: list[dict], labels: list[int]) -> float:
    import torch

    with torch.no_grad():
        preds = [p for b in batches for p in model(**b).logits.argmax(-1).tolist()]
    return sum(int(p == y) for p, y in zip(preds, labels)) / len(labels)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--branches", default="fastbert,deebert",
                   help="branch kinds to add and compare (comma-separated); each is run into benchmarks/runs/<kind>")
    p.add_argument("--teacher", default=str(RUNS / "teacher"),
                   help="fine-tuned classifier to add exits to (default: the quality benchmark's teacher)")
    p.add_argument("--students", default=STUDENTS,
                   help="runs of benchmarks/runs to measure beside the exits (comma-separated; '' for none)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (timing and the runs started from here)")
    p.add_argument("--force", action="store_true", help="run the recipes again even if their output exists")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (median)")
    p.add_argument("--b1_rows", type=int, default=200,
                   help="validation rows timed at batch 1 (first N; more rows, less noise per round)")
    p.add_argument("--b32_rows", type=int, default=320, help="validation rows timed at batch 32 (first N)")
    args = p.parse_args(argv)
    teacher_dir = Path(args.teacher).resolve()
    from hf_distill.students.early_exit import BRANCHES

    kinds = [k for k in args.branches.split(",") if k]
    if not kinds or any(k not in BRANCHES for k in kinds):
        raise SystemExit(f"--branches: give one or more of {', '.join(BRANCHES)}, got {args.branches!r}")
    start = time.time()
    ensure_teacher(teacher_dir, args.threads)
    recipes = {}
    for kind in kinds:
        work = RUNS / kind
        if not args.force and (work / "results.json").is_file():
            made_by = made_for(work)
            if made_by is None or Path(made_by).resolve() != teacher_dir:
                raise SystemExit(f"{work} holds branches made for teacher {made_by}, not {teacher_dir}: pass --force "
                                 "to replace them")
        if args.force or not (work / "results.json").is_file():
            run([sys.executable, str(ROOT / "recipes" / "fastbert.py"), "--config", str(CONFIG), "--teacher",
                 str(teacher_dir), "--branch", kind, "--output_dir", str(work)], args.threads)
        recipes[kind] = json.loads((work / "results.json").read_text())
        why = stale_training(recipes[kind])
        if why:
            raise SystemExit(f"{work}: {why}, not as {CONFIG.name} says: pass --force to train them again")
        if recipes[kind].get("branch", "fastbert") != kind:
            raise SystemExit(f"{work} holds {recipes[kind].get('branch')} branches, not {kind}: pass --force")
    first = recipes[kinds[0]]
    teacher_acc = first["teacher_accuracy"]
    for kind in kinds:  # checked before the timing, which takes minutes
        if recipes[kind]["teacher_accuracy"] != teacher_acc:
            raise SystemExit(f"runs/{kind} evaluated its teacher at {recipes[kind]['teacher_accuracy']}, "
                             f"runs/{kinds[0]} at {teacher_acc}: not the same teacher")

    import csv

    import torch
    from transformers import AutoTokenizer

    from hf_distill.publish.measure import count_parameters
    from hf_distill.students.early_exit import EarlyExitModel

    torch.set_num_threads(args.threads)
    models = {kind: EarlyExitModel.from_pretrained(RUNS / kind).eval() for kind in kinds}
    teacher = next(iter(models.values())).model  # the same teacher weights under every kind of branch
    tokenizer = AutoTokenizer.from_pretrained(RUNS / kinds[0])
    names = [n for n in args.students.split(",") if n]
    students, missing = load_students(names)
    with open(ROOT.parent / "shared" / "data" / "sst2" / "validation.tsv", encoding="utf-8", newline="") as f:
        rows_tsv = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    sentences, labels = [r["sentence"] for r in rows_tsv], [int(r["label"]) for r in rows_tsv]
    eval_batches = batches_of(tokenizer, sentences, 32, 64)
    student_rows = {}
    for name, student in students.items():
        made = json.loads((RUNS / name / "results.json").read_text())
        student_rows[name] = {"accuracy": accuracy(student, eval_batches, labels),
                              "layers": student.config.num_hidden_layers,
                              "hidden_size": student.config.hidden_size,
                              "params": count_parameters(student),
                              "recorded_accuracy": made.get("accuracy"), "command": made.get("command")}
    full = lambda b: teacher(**b).logits  # noqa: E731
    timers = {}
    for kind, model in models.items():
        for r in recipes[kind]["sweep"]:
            timers[(kind, r["speed"])] = lambda b, m=model, s=r["speed"]: m.exit_forward(speed=s, **b)
    timers.update({name: (lambda b, m=m: m(**b).logits) for name, m in students.items()})
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    print(f"batch 32, first {args.b32_rows} rows", flush=True)
    b32 = measure(full, timers, batches_of(tokenizer, sentences[: args.b32_rows], 32, 64), args.rounds)
    print(f"batch 1, first {args.b1_rows} rows", flush=True)
    b1 = measure(full, timers, batches_of(tokenizer, sentences[: args.b1_rows], 1, 64), args.rounds)
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    med = statistics.median
    for name, r in student_rows.items():
        r.update(speedup_b1=med(b1[name]), speedup_b32=med(b32[name]), rounds_b1=b1[name], rounds_b32=b32[name])

    sweeps, targets = {}, {}
    for kind in kinds:
        rows = [{**r, "speedup_b1": med(b1[(kind, r["speed"])]), "speedup_b32": med(b32[(kind, r["speed"])]),
                 "rounds_b1": b1[(kind, r["speed"])], "rounds_b32": b32[(kind, r["speed"])],
                 "points_vs_teacher": 100 * (r["accuracy"] - teacher_acc)} for r in recipes[kind]["sweep"]]
        sweeps[kind] = rows
        hits = [r for r in rows if r["speedup_b1"] >= 2.0 and r["points_vs_teacher"] >= -1.0]
        targets[kind] = {
            "b1_2x_within_1pt": {"met": bool(hits), "speeds": [r["speed"] for r in hits]},
            "monotone_speedup_b1": monotone([r["speedup_b1"] for r in rows]),
            "monotone_speedup_b32": monotone([r["speedup_b32"] for r in rows]),
            "speed0_equals_teacher": bool(rows[0]["speed"] == 0.0 and rows[0]["matches_teacher"]),
        }
    out = {
        "teacher": {"accuracy": teacher_acc, "source": first.get("teacher"), "num_exits": first["num_exits"],
                    "recorded_accuracy": teacher_record(teacher_dir),
                    "quality_benchmark_teacher": teacher_dir == (RUNS / "teacher").resolve()},
        "sweeps": sweeps, "targets": targets, "students": student_rows, "students_not_found": missing,
        "branches": {kind: {"params": recipes[kind].get("branch_params"), "distill_rows": recipes[kind]["distill_rows"],
                            "distill_s": recipes[kind]["distill_s"], "recipe_wall_s": recipes[kind]["wall_s"],
                            "recipe_command": recipes[kind]["command"]} for kind in kinds},
        "protocol": {"eval_rows": first["eval_rows"], "b1_rows": args.b1_rows, "rounds": args.rounds,
                     "b32_rows": args.b32_rows, "precision": "fp32", "max_length": 64,
                     "timing": "turns of 32 rows, every model back to back in an order rotated per turn; median "
                               "over rounds of teacher total / other total",
                     "flops": "analytic (hf_distill.students.early_exit.flops_per_row), branches included"},
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
                    "loadavg_before": load_before, "loadavg_after": load_after},
        "invocation": {"command": "python benchmarks/early_exit.py " + " ".join(argv or sys.argv[1:]),
                       "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       "wall_s": time.time() - start},
    }
    from sections import portable_tree  # no machine's absolute path (teacher, recipe commands) in a results file

    out = portable_tree(out)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "early_exit.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / "early_exit.md").write_text(markdown(out))
    plot(out, RESULTS / "early_exit.png")
    print((RESULTS / "early_exit.md").read_text())
    return 0


def monotone(curve: list[float]) -> bool:
    return all(a <= b for a, b in zip(curve, curve[1:]))


def steps_down(rows: list[dict]) -> str:
    """Where a median goes down, with how many rounds agree, and the spread of speed 0: it runs the teacher's
    own forward (no branch), so its rounds show how far apart two runs of the same work land."""
    notes = []
    for batch in ("b1", "b32"):
        down = [(a, b) for a, b in zip(rows, rows[1:]) if a[f"speedup_{batch}"] > b[f"speedup_{batch}"]]
        for a, b in down:
            wins = sum(y >= x for x, y in zip(a[f"rounds_{batch}"], b[f"rounds_{batch}"]))
            notes.append(f"batch {batch[1:]} speed {a['speed']:g} -> {b['speed']:g}: {a[f'speedup_{batch}']:.3f}x -> "
                         f"{b[f'speedup_{batch}']:.3f}x (not slower in {wins} of {len(a[f'rounds_{batch}'])} rounds)")
        if down and rows[0]["speed"] == 0.0:
            zero = rows[0][f"rounds_{batch}"]
            notes.append(f"speed 0, the teacher's own forward, measured {min(zero):.3f}x-{max(zero):.3f}x over the "
                         f"batch-{batch[1:]} rounds")
    return f". Down: {'; '.join(notes)}" if notes else ""


def teacher_record(teacher: Path) -> float | None:
    """The accuracy the quality benchmark recorded for its teacher (bf16 evaluation), when it did."""
    f = teacher / "results.json"
    return json.loads(f.read_text()).get("accuracy") if f.is_file() else None


NAMES = {"fastbert": "FastBERT", "deebert": "DeeBERT"}
LABELS = {"fastbert": "FastBERT branches (attention over every token)",
          "deebert": "DeeBERT off-ramps (pooler on the first token)"}


def markdown(out: dict) -> str:
    t, p, m, inv = out["teacher"], out["protocol"], out["machine"], out["invocation"]
    recorded = f", {t['recorded_accuracy']:.2%} as recorded by that benchmark" if t.get("recorded_accuracy") else ""
    lines = [
        "# Early exit (FastBERT) on SST-2", "",
        f"Teacher: `{os.path.relpath(t['source'], ROOT)}` ({t['num_exits']} layers"
        f"{'; the quality benchmark MiniLM-L6 fine-tuned on 20,000 rows' if t['quality_benchmark_teacher'] else ''}"
        f"), validation accuracy **{t['accuracy']:.2%}** here in fp32{recorded}. Exits self-distilled from its "
        f"final head on unlabeled SST-2 training rows (`recipes/fastbert.py`). Accuracy, exit layers and FLOPs: all "
        f"{p['eval_rows']} rows. Speed-up: teacher time / other time, {p['precision']}, at batch 32 on the first "
        f"{p['b32_rows']} rows and at batch 1 on the first {p['b1_rows']} rows; turns of 32 rows run by every model "
        f"back to back in a rotated order, median of {p['rounds']} rounds. FLOPs ratio: {p['flops']}.",
    ]
    for kind, rows in out["sweeps"].items():
        br = out["branches"][kind]
        params = f"{br['params'] / 1e6:.2f} M parameters, " if br.get("params") else ""
        lines += ["", f"## {LABELS[kind]}", "",
                  f"{params}self-distilled on {br['distill_rows']} rows in {br['distill_s'] / 60:.1f} min "
                  f"(`{br['recipe_command']}`).", "",
                  "| speed | accuracy | vs teacher (pts) | mean exit layer | speed-up b1 | speed-up b32 | "
                  "FLOPs ratio | exits per layer |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            lines.append(f"| {r['speed']:.1f} | {r['accuracy']:.2%} | {r['points_vs_teacher']:+.2f} | "
                         f"{r['mean_exit_layer']:.2f} | {r['speedup_b1']:.2f}x | {r['speedup_b32']:.2f}x | "
                         f"{r['flops_ratio']:.3f} | {' / '.join(map(str, r['exit_histogram']))} |")
        tg = out["targets"][kind]
        hit = tg["b1_2x_within_1pt"]
        lines += [
            "", "- >= 2.0x at batch 1 within 1.0 point of the teacher: "
            f"**{'met' if hit['met'] else 'NOT met'}**"
            + (f" (speed {', '.join(f'{s:g}' for s in hit['speeds'])})" if hit["met"] else ""),
            f"- speed-up monotone in speed: batch 1 **{'yes' if tg['monotone_speedup_b1'] else 'no'}**, batch 32 "
            f"**{'yes' if tg['monotone_speedup_b32'] else 'no'}**" + steps_down(rows),
            f"- speed 0 reproduces the teacher's predictions exactly: "
            f"**{'yes' if tg['speed0_equals_teacher'] else 'no'}**",
        ]
    if out["students"]:
        lines += ["", "## Students of the same teacher", "",
                  "Distilled by `benchmarks/quality_sst2.py`, evaluated and timed in this run, in the same rounds as "
                  "the exits:", "",
                  "| student | layers x width | params | accuracy | vs teacher (pts) | speed-up b1 | speed-up b32 |",
                  "| --- | --- | ---: | --- | --- | --- | --- |"]
        for name, r in out["students"].items():
            lines.append(f"| {name} | {r['layers']} x {r['hidden_size']} | {r['params'] / 1e6:.1f} M | "
                         f"{r['accuracy']:.2%} | {100 * (r['accuracy'] - t['accuracy']):+.2f} | "
                         f"{r['speedup_b1']:.2f}x | {r['speedup_b32']:.2f}x |")
    if out["students_not_found"]:
        lines += ["", f"Not in benchmarks/runs, so not measured: {', '.join(out['students_not_found'])} (run "
                  f"`python benchmarks/quality_sst2.py --runs {','.join(out['students_not_found'])}` first)."]
    lines += [
        "", "![accuracy vs speed-up](early_exit.png)", "",
        f"Command: `{inv['command'].strip()}`, {inv['date']}, {inv['wall_s'] / 60:.1f} min; {m['cpus']} CPUs, torch "
        f"threads {m['torch_threads']}, load average {' '.join(m['loadavg_before'])} before timing, "
        f"{' '.join(m['loadavg_after'])} after.", "",
    ]
    return "\n".join(lines)


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    teacher = 100 * out["teacher"]["accuracy"]
    for ax, key, batch in ((axes[0], "speedup_b1", 1), (axes[1], "speedup_b32", 32)):
        for kind, rows in out["sweeps"].items():
            ax.plot([r[key] for r in rows], [100 * r["accuracy"] for r in rows], "o-" if kind == "fastbert" else
                    "s--", label=f"{NAMES[kind]} exits")
            for r in rows:
                ax.annotate(f"{r['speed']:g}", (r[key], 100 * r["accuracy"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=7)
        for k, (name, r) in enumerate(out["students"].items(), start=2):
            ax.scatter([r[key]], [100 * r["accuracy"]], marker="^", s=70, color=f"C{k}",
                       label=f"{name} ({r['layers']} layers)")
        ax.scatter([1.0], [teacher], marker="*", s=200, color="black", label="teacher", zorder=3)
        ax.axhline(teacher - 1.0, color="grey", lw=0.8, ls=":", label="teacher - 1 pt")
        ax.set_xlabel(f"wall-clock speed-up over the teacher, batch {batch}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("SST-2 validation accuracy (%)")
    axes[1].legend(fontsize=8)
    fig.suptitle("Exit early (labels: speed) or distil a smaller model? Same teacher, same run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
