"""Early exit (FastBERT) on SST-2: accuracy, exit layer, FLOPs and measured wall-clock speed-up per `speed`.

    python benchmarks/early_exit.py            # runs recipes/fastbert.py first when its output is missing

1. `recipes/fastbert.py --config recipes/configs/fastbert_sst2.yaml` (teacher: the demo's MiniLM-L6, cached;
   branches self-distilled on 8,000 unlabeled rows; sweep of speed 0.0-0.9 on the 872 validation rows:
   accuracy, mean exit layer, analytic FLOPs ratio, whether speed 0 gives the teacher's predictions).
2. Here: wall-clock time of the full teacher and of adaptive inference at every speed, batch 1 and batch 32,
   fp32, interleaved (each round times the teacher and then every speed, in that order); the speed-up of a
   round is the teacher's time over the speed's time in that round; reported: the median over rounds.
3. The tinybert and distilbert students of benchmarks/quality_sst2.py are shown with their *recorded*
   accuracy and speed-up (benchmarks/results/quality_sst2.json; their weights are not kept, so they are not
   re-measured; their teacher is that benchmark's MiniLM-L6, fine-tuned on 20,000 rows, and their speed-up
   is at batch 32).
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


def run_recipe(work: Path) -> None:
    cmd = [sys.executable, str(ROOT / "recipes" / "fastbert.py"), "--config", str(CONFIG), "--output_dir", str(work)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)


def batches_of(tokenizer, sentences: list[str], size: int, max_length: int) -> list[dict]:
    from transformers import DataCollatorWithPadding

    collate = DataCollatorWithPadding(tokenizer)
    enc = [tokenizer(s, truncation=True, max_length=max_length) for s in sentences]
    return [collate(enc[i : i + size]) for i in range(0, len(enc), size)]


def timed(fn, batches: list[dict]) -> float:
    import torch

    with torch.no_grad():
        start = time.perf_counter()
        for b in batches:
            fn(b)
        return time.perf_counter() - start


def measure(model, batches: list[dict], speeds: list[float], rounds: int) -> dict[float, float]:
    """Median over rounds of (teacher time / adaptive time at `speed`), both timed in the same round."""
    full = lambda b: model.model(**b).logits  # noqa: E731
    timed(full, batches[:4])  # warm-up
    ratios: dict[float, list[float]] = {s: [] for s in speeds}
    for r in range(rounds):
        t_full = timed(full, batches)
        for s in speeds:
            ratios[s].append(t_full / timed(lambda b, s=s: model.exit_forward(speed=s, **b), batches))
        print(f"  round {r + 1}/{rounds}: teacher {t_full:.2f}s; " + ", ".join(
            f"{s:g}: {ratios[s][-1]:.2f}x" for s in speeds), flush=True)
    return {s: statistics.median(v) for s, v in ratios.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default=str(ROOT / "benchmarks" / "runs" / "fastbert"), help="the recipe's output_dir")
    p.add_argument("--force", action="store_true", help="run the recipe again even if its output exists")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median)")
    p.add_argument("--b1_rows", type=int, default=100, help="validation rows timed at batch 1 (first N)")
    p.add_argument("--b32_rows", type=int, default=320, help="validation rows timed at batch 32 (first N)")
    args = p.parse_args(argv)
    work = Path(args.work)
    start = time.time()
    if args.force or not (work / "results.json").is_file():
        run_recipe(work)
    recipe = json.loads((work / "results.json").read_text())

    import csv

    import torch
    from transformers import AutoTokenizer

    from hf_distill.early_exit import EarlyExitModel

    model = EarlyExitModel.from_pretrained(work).eval()
    tokenizer = AutoTokenizer.from_pretrained(work)
    with open(ROOT.parent / "shared" / "data" / "sst2" / "validation.tsv", encoding="utf-8", newline="") as f:
        sentences = [r["sentence"] for r in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]
    speeds = [r["speed"] for r in recipe["sweep"]]
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    print(f"batch 32, first {args.b32_rows} rows", flush=True)
    b32 = measure(model, batches_of(tokenizer, sentences[: args.b32_rows], 32, 64), speeds, args.rounds)
    print(f"batch 1, first {args.b1_rows} rows", flush=True)
    b1 = measure(model, batches_of(tokenizer, sentences[: args.b1_rows], 1, 64), speeds, args.rounds)
    load_after = Path("/proc/loadavg").read_text().split()[:3]

    teacher_acc = recipe["teacher_accuracy"]
    rows = []
    for r in recipe["sweep"]:
        rows.append({**r, "speedup_b1": b1[r["speed"]], "speedup_b32": b32[r["speed"]],
                     "points_vs_teacher": 100 * (r["accuracy"] - teacher_acc)})
    quality = json.loads((RESULTS / "quality_sst2.json").read_text())
    recorded = {name: {"accuracy": quality["runs"][name]["accuracy"], "speedup_b32": quality["runs"][name]["speedup"],
                       "teacher_accuracy": quality["teacher"]["accuracy"], "command": quality["runs"][name]["command"]}
                for name in ("tinybert", "distilbert") if name in quality.get("runs", {})}
    hits = [r for r in rows if r["speedup_b1"] >= 2.0 and r["points_vs_teacher"] >= -1.0]
    b1_curve = [r["speedup_b1"] for r in rows]
    targets = {
        "b1_2x_within_1pt": {"met": bool(hits), "speeds": [r["speed"] for r in hits]},
        "monotone_speedup_b1": all(a <= b for a, b in zip(b1_curve, b1_curve[1:])),
        "monotone_speedup_b32": all(a <= b for a, b in zip([r["speedup_b32"] for r in rows],
                                                           [r["speedup_b32"] for r in rows][1:])),
        "speed0_equals_teacher": bool(rows[0]["speed"] == 0.0 and rows[0]["matches_teacher"]),
    }
    out = {
        "teacher": {"accuracy": teacher_acc, "source": recipe.get("teacher"), "num_exits": recipe["num_exits"],
                    "reused_from_cache": recipe.get("teacher_reused_from_cache")},
        "sweep": rows, "recorded_students": recorded, "targets": targets,
        "protocol": {"eval_rows": recipe["eval_rows"], "b1_rows": args.b1_rows, "rounds": args.rounds,
                     "b32_rows": args.b32_rows, "precision": "fp32", "max_length": 64,
                     "distill_rows": recipe["distill_rows"],
                     "distill_s": recipe["distill_s"], "recipe_wall_s": recipe["wall_s"],
                     "flops": "analytic (hf_distill.early_exit.flops_per_row), branches included"},
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
                    "loadavg_before": load_before, "loadavg_after": load_after},
        "invocation": {"command": "python benchmarks/early_exit.py " + " ".join(argv or sys.argv[1:]),
                       "recipe_command": recipe["command"],
                       "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       "wall_s": time.time() - start},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "early_exit.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / "early_exit.md").write_text(markdown(out))
    plot(out, RESULTS / "early_exit.png")
    print((RESULTS / "early_exit.md").read_text())
    return 0


def markdown(out: dict) -> str:
    t, p, m, inv = out["teacher"], out["protocol"], out["machine"], out["invocation"]
    lines = [
        "# Early exit (FastBERT) on SST-2", "",
        f"Teacher: MiniLM-L6 fine-tuned as in `hf-distill demo` ({t['num_exits']} layers), validation accuracy "
        f"**{t['accuracy']:.2%}** ({p['eval_rows']} rows). Branches self-distilled on {p['distill_rows']} unlabeled "
        f"SST-2 training rows ({p['distill_s'] / 60:.1f} min). Accuracy, exit layers and FLOPs: all "
        f"{p['eval_rows']} rows. Speed-up: teacher time / adaptive time, {p['precision']}, measured (interleaved, "
        f"median of {p['rounds']} rounds) at batch 32 on the first {p['b32_rows']} rows and at batch 1 on the "
        f"first {p['b1_rows']} rows. FLOPs ratio: {p['flops']}.", "",
        "| speed | accuracy | vs teacher (pts) | mean exit layer | speed-up b1 | speed-up b32 | FLOPs ratio | "
        "exits per layer |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in out["sweep"]:
        lines.append(f"| {r['speed']:.1f} | {r['accuracy']:.2%} | {r['points_vs_teacher']:+.2f} | "
                     f"{r['mean_exit_layer']:.2f} | {r['speedup_b1']:.2f}x | {r['speedup_b32']:.2f}x | "
                     f"{r['flops_ratio']:.3f} | {' / '.join(map(str, r['exit_histogram']))} |")
    for name, r in out["recorded_students"].items():
        lines.append(f"| {name} student (recorded, not re-measured) | {r['accuracy']:.2%} | "
                     f"{100 * (r['accuracy'] - r['teacher_accuracy']):+.2f} vs its teacher | 3 layers | - | "
                     f"{r['speedup_b32']:.2f}x | - | - |")
    tg = out["targets"]
    lines += [
        "", "The tinybert/distilbert rows are copied from benchmarks/results/quality_sst2.json: their weights are "
        "not on this machine, their teacher (MiniLM-L6 fine-tuned on 20,000 rows, "
        f"{next(iter(out['recorded_students'].values()))['teacher_accuracy']:.2%}) is not this one, and their "
        "speed-up was measured at batch 32 in that benchmark's session." if out["recorded_students"] else "",
        "", "## Targets", "",
        "- >= 2.0x at batch 1 within 1.0 point of the teacher: "
        f"**{'met' if tg['b1_2x_within_1pt']['met'] else 'NOT met'}**"
        + (f" (speed {', '.join(f'{s:g}' for s in tg['b1_2x_within_1pt']['speeds'])})"
           if tg["b1_2x_within_1pt"]["met"] else ""),
        f"- speed-up monotone in speed: batch 1 **{'yes' if tg['monotone_speedup_b1'] else 'no'}**, batch 32 "
        f"**{'yes' if tg['monotone_speedup_b32'] else 'no'}**",
        f"- speed 0 reproduces the teacher's predictions exactly: **{'yes' if tg['speed0_equals_teacher'] else 'no'}**",
        "", "![accuracy vs speed-up](early_exit.png)", "",
        f"Command: `{inv['command'].strip()}` (recipe: `{inv['recipe_command']}`), {inv['date']}, "
        f"{inv['wall_s'] / 60:.1f} min; {m['cpus']} CPUs, torch threads {m['torch_threads']}, load average "
        f"{' '.join(m['loadavg_before'])} before timing, {' '.join(m['loadavg_after'])} after (shared machine).", "",
    ]
    return "\n".join(lines)


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = out["sweep"]
    for key, label, style in (("speedup_b1", "FastBERT, batch 1", "o-"), ("speedup_b32", "FastBERT, batch 32", "s--")):
        ax.plot([r[key] for r in rows], [100 * r["accuracy"] for r in rows], style, label=label)
    for r in rows:
        ax.annotate(f"{r['speed']:g}", (r["speedup_b1"], 100 * r["accuracy"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
    ax.scatter([1.0], [100 * out["teacher"]["accuracy"]], marker="*", s=200, color="black", label="teacher", zorder=3)
    for name, r in out["recorded_students"].items():
        ax.scatter([r["speedup_b32"]], [100 * r["accuracy"]], marker="^", s=70,
                   label=f"{name} student (recorded, b32, other teacher)")
    ax.axhline(100 * out["teacher"]["accuracy"] - 1.0, color="grey", lw=0.8, ls=":", label="teacher - 1 pt")
    ax.set_xlabel("wall-clock speed-up over the 6-layer teacher")
    ax.set_ylabel("SST-2 validation accuracy (%)")
    ax.set_title("Early exit (FastBERT): accuracy vs speed-up (labels: speed)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
