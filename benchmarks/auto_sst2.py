"""`hf-distill auto` on SST-2 at two latency budgets, next to the quality benchmark's distilbert and tinybert rows
(issue #33, item 3). One command, offline:

    python benchmarks/auto_sst2.py                       # budgets 1/2 and 1/4 of the teacher's batch-1 latency

Setup: the quality benchmark's teacher (`benchmarks/runs/teacher`, written by `quality_sst2.py --runs teacher`;
this script stops if it is missing: fine-tuning it takes 20+ minutes), its SST-2 rows (the first 20,000 of
`random.Random(42).shuffle(range(67349))`, in that order, and all 872 validation rows, max length 64). First the
teacher and the two reference shapes (distilbert: teacher layers 0, 2, 4; tinybert: 4 layers x 192 hidden x 768
MLP, 12 heads) are timed interleaved at batch 1 on one fixed input of `--seq_len` real validation tokens
(`publish.measure.latencies`, median of `--repeats` rounds, `--threads` torch threads); the budgets are fractions
of that teacher latency. Then `auto_student` runs once per budget over a small fixed candidate grid (CANDIDATES)
with `--proxy_steps` proxy steps and `--max_steps` full steps, and `benchmarks/results/auto_sst2.{md,json}` are
written. The reference rows' accuracy is the quality benchmark's as recorded (their full recipes: 3 epochs);
their shapes' latency is re-measured here so that every latency in the table comes from the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality_sst2 as q  # noqa: E402  (the protocol's constants and row readers)

RESULTS = ROOT / "benchmarks" / "results"
# (kind, layers, heads, MLP, hidden) in the 6 x 12 x 1536 x 384 teacher: pruned depth x width, plus the two
# reference shapes so that auto can pick them too (copy_L3 is the distilbert row's student, shrink_L4 the tinybert
# row's, here without its general distillation).
CANDIDATES = [("prune", 3, 6, 768, 192), ("prune", 2, 12, 1536, 384), ("prune", 2, 6, 768, 192),
              ("prune", 1, 12, 1536, 384), ("copy", 3, 12, 1536, 384), ("shrink", 4, 12, 768, 192)]
REFERENCES = {"distilbert": ("copy", 3, 12, 1536, 384), "tinybert": ("shrink", 4, 12, 768, 192)}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def datasets_of(tokenizer, train_rows: int):
    import datasets

    def encode(rows):
        ds = datasets.Dataset.from_dict({"sentence": [r["sentence"] for r in rows],
                                         "labels": [int(r["label"]) for r in rows]})
        return ds.map(lambda b: tokenizer(b["sentence"], truncation=True, max_length=q.MAX_LENGTH), batched=True,
                      remove_columns=["sentence"])

    train = q.read_tsv(q.DATA / "train.tsv")
    return (encode([train[i] for i in q.subset_indices(len(train), train_rows)]),
            encode(q.read_tsv(q.DATA / "validation.tsv")))


def run(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hf_distill import DistillationArguments
    from hf_distill.auto import Candidate, auto_student
    from hf_distill.auto.search import fixed_input
    from hf_distill.publish import measure

    teacher_dir = Path(args.teacher)
    torch.manual_seed(q.SEED)
    teacher = AutoModelForSequenceClassification.from_pretrained(teacher_dir)
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    train, validation = datasets_of(tokenizer, q.TRAIN_ROWS)

    refs = {name: Candidate(*shape).build(teacher, None, q.SEED) for name, shape in REFERENCES.items()}
    batch = fixed_input(validation, 1, args.seq_len)
    seconds = measure.latencies([teacher, *refs.values()], [batch], args.repeats)
    teacher_ms = 1000 * seconds[0]
    ref_ms = {name: 1000 * s for name, s in zip(refs, seconds[1:])}
    del refs
    log(f"teacher {teacher_ms:.2f} ms at batch 1 x {args.seq_len}; "
        + ", ".join(f"{k} shape {v:.2f} ms" for k, v in ref_ms.items()))
    quality = json.loads((RESULTS / "quality_sst2.json").read_text())
    references = {name: {"shape": dict(zip(("kind", "num_layers", "num_attention_heads", "intermediate_size",
                                                  "hidden_size"), REFERENCES[name])),
                         "accuracy_recorded": quality["runs"][name]["accuracy"],
                         "params": quality["runs"][name]["params"],
                         "speedup_b32_recorded": quality["runs"][name]["speedup"],
                         "latency_ms_remeasured": ref_ms[name],
                         "speedup_b1_remeasured": teacher_ms / ref_ms[name],
                         "command": quality["runs"][name]["command"]} for name in REFERENCES}

    budgets, picks = [], []
    for fraction in args.fractions:
        budget = fraction * teacher_ms
        log(f"auto at budget {fraction:g} x teacher = {budget:.2f} ms")
        folder = Path(args.work) / f"budget_{fraction:g}"
        train_args = DistillationArguments(
            output_dir=str(folder), max_steps=args.max_steps, learning_rate=args.learning_rate, weight_decay=0.0,
            lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=1.0, per_device_train_batch_size=q.BATCH,
            per_device_eval_batch_size=64, bf16=args.bf16, use_cpu=True, seed=q.SEED,
            train_sampling_strategy="sequential", kd_loss="kl", temperature=2.0, kd_weight=0.5, task_weight=0.5,
            save_strategy="no", eval_strategy="no", logging_steps=50, report_to=[], disable_tqdm=True)
        start = time.time()
        try:
            result = auto_student(teacher, train, validation, budget_ms=budget, args=train_args,
                                  processing_class=tokenizer, device="cpu", batch_size=1, seq_len=args.seq_len,
                                  proxy_steps=args.proxy_steps, candidates=[Candidate(*c) for c in CANDIDATES],
                                  repeats=args.repeats, output_dir=folder, overwrite_output_dir=True,
                                  teacher_name=str(teacher_dir), progress=False)
        except ValueError as err:  # no candidate within the budget: recorded, the other budgets still run
            log(f"budget {fraction:g}: {err}")
            budgets.append({"fraction": fraction, "budget_ms": budget, "error": str(err)})
            continue
        pareto = json.loads((folder / "pareto.json").read_text())
        picked = next(r for r in result.rows if r["picked"])
        picks.append((len(budgets), result.student_dir))
        budgets.append({"fraction": fraction, "budget_ms": budget, "wall_s": time.time() - start,
                        "picked": picked, "setup": {k: v for k, v in pareto.items() if k != "candidates"},
                        "rows": result.rows,
                        "pareto_md": (folder / "pareto.md").read_text()})
        log(f"picked {picked['name']}: {picked['final_metric']:.2%} at {picked['latency_ms']:.2f} ms "
            f"({(time.time() - start) / 60:.1f} min)")
    # One last interleaved measurement of the teacher, the reference shapes and the saved picks, so that the
    # table's latencies come from the same rounds (load on this shared machine shifts between measurements).
    refs = {name: Candidate(*shape).build(teacher, None, q.SEED) for name, shape in REFERENCES.items()}
    saved = [AutoModelForSequenceClassification.from_pretrained(folder) for _, folder in picks]  # as shipped
    seconds = measure.latencies([teacher, *refs.values(), *saved], [batch], args.repeats)
    final = {"teacher_ms": 1000 * seconds[0],
             **{f"{name}_ms": 1000 * s for name, s in zip(refs, seconds[1:])}}
    for (i, _), s in zip(picks, seconds[1 + len(refs):]):
        budgets[i]["picked_latency_ms_final"] = 1000 * s
    for name in refs:
        references[name]["latency_ms_final"] = final[f"{name}_ms"]
    log("final measurement: " + ", ".join(f"{k} {v:.2f}" for k, v in final.items()))
    return {"teacher": {"path": str(teacher_dir), "latency_ms": teacher_ms, "latency_ms_final": final["teacher_ms"],
                        "accuracy": json.loads((teacher_dir / "results.json").read_text())["accuracy"],
                        "accuracy_recorded_in_quality_sst2": quality["teacher"]["accuracy"]},
            "references": references, "budgets": budgets}


def shape_text(r: dict) -> str:
    if r["kind"] == "copy":
        return f"copy {r['num_layers']} layers"
    return f"{r['kind']} L{r['num_layers']} H{r['num_attention_heads']} I{r['intermediate_size']} D{r['hidden_size']}"


def markdown(out: dict) -> str:
    s, t = out["settings"], out["teacher"]
    lines = [
        "# `hf-distill auto` on SST-2 at 1/2 and 1/4 of the teacher's batch-1 latency", "",
        f"Written by `{s['command']}` on {s['date']} ({s['threads']} torch thread(s), 2-core shared CPU, 1-minute "
        f"load average {s['load_before']:.1f} before and {s['load_after']:.1f} after; whole script "
        f"{s['wall_s'] / 60:.1f} min).", "",
        f"Latency: batch 1 x {s['seq_len']} real validation tokens (one fixed input), fp32, no gradients, median of "
        f"{s['repeats']} interleaved rounds, all in this process. Teacher (`{t['path']}`): **{t['latency_ms']:.2f} "
        f"ms**, accuracy {t['accuracy']:.2%}. auto: {len(CANDIDATES)} candidates (below), proxy "
        f"{s['proxy_steps']} steps, full distillation {s['max_steps']} steps (batch 32, lr {s['learning_rate']:g}, "
        f"KL T=2, kd/task 0.5/0.5, bf16 {s['bf16']}), the first {s['max_steps'] * 32:,} of the protocol's "
        "20,000 training rows, all 872 validation rows.", "",
        f"Final measurement (teacher, both reference shapes and both trained picks interleaved in the same "
        f"rounds at the end): teacher **{t['latency_ms_final']:.2f} ms**. The budgets were set from the first "
        "measurement; auto re-times its candidates in its own rounds (the Pareto tables below).", "",
        "| budget | student | shape | params | latency, final (ms) | speed-up b1, final | latency in auto's "
        "rounds (ms) | recorded speed-up b32 | accuracy | training |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    refs = out["references"]
    for b in out["budgets"]:
        if "error" in b:
            lines.append(f"| {b['fraction']:g} x teacher = {b['budget_ms']:.2f} ms | none: {b['error']} |"
                         " | | | | | | | |")
            continue
        p = b["picked"]
        lines.append(f"| {b['fraction']:g} x teacher = {b['budget_ms']:.2f} ms | **auto pick** | {shape_text(p)} | "
                     f"{p['params'] / 1e6:.2f} M | {b['picked_latency_ms_final']:.2f} | "
                     f"{t['latency_ms_final'] / b['picked_latency_ms_final']:.2f}x | {p['latency_ms']:.2f} | - | "
                     f"**{p['final_metric']:.2%}** | {s['max_steps']} steps KD |")
    for name, r in refs.items():
        lines.append(f"| - | {name} (quality_sst2) | {shape_text(r['shape'])} | {r['params'] / 1e6:.2f} M | "
                     f"{r['latency_ms_final']:.2f} | {t['latency_ms_final'] / r['latency_ms_final']:.2f}x | - | "
                     f"{r['speedup_b32_recorded']:.2f}x | {r['accuracy_recorded']:.2%} | its recipe (3 epochs) |")
    lines += ["", "The distilbert and tinybert accuracies are the quality benchmark's as recorded "
              "(`benchmarks/results/quality_sst2.json`: full recipes, 3 epochs of 20,000 rows, tinybert also general "
              "distillation and augmentation; their own teacher run). Their latency here is their SHAPE re-measured "
              "in this process next to the teacher and the candidates; the recorded speed-up is batch 32 with "
              "dynamic padding at 2 threads, a different measurement.", ""]
    for b in out["budgets"]:
        if "error" in b:
            continue
        lines += [f"## Budget {b['fraction']:g} x teacher ({b['budget_ms']:.2f} ms): Pareto table "
                  f"({b['wall_s'] / 60:.1f} min)", "",
                  "##" + b["pareto_md"].strip(), ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", default=str(ROOT / "benchmarks" / "runs" / "teacher"))
    p.add_argument("--work", default=str(ROOT / "benchmarks" / "runs" / "auto_sst2"), help="auto's output folders")
    p.add_argument("--fractions", type=lambda t: [float(x) for x in t.split(",")], default=[0.5, 0.25],
                   help="budgets as fractions of the teacher's batch-1 latency")
    p.add_argument("--proxy_steps", type=int, default=50)
    p.add_argument("--max_steps", type=int, default=400)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--seq_len", type=int, default=q.MAX_LENGTH)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-bf16", dest="bf16", action="store_false")
    args = p.parse_args(argv)
    if not (Path(args.teacher) / "results.json").is_file():
        print(f"No fine-tuned teacher in {args.teacher}: run `python benchmarks/quality_sst2.py --runs teacher` "
              "first (20+ minutes), or pass --teacher.", file=sys.stderr)
        return 2
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    start, load_before = time.time(), os.getloadavg()[0]
    out = run(args)
    command = "python benchmarks/auto_sst2.py" + ("" if argv is None and len(sys.argv) == 1 else
                                                  " " + " ".join(sys.argv[1:] if argv is None else argv))
    out["settings"] = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "threads": args.threads, "seq_len": args.seq_len, "repeats": args.repeats,
                       "proxy_steps": args.proxy_steps, "max_steps": args.max_steps,
                       "learning_rate": args.learning_rate, "bf16": args.bf16, "wall_s": time.time() - start,
                       "load_before": load_before, "load_after": os.getloadavg()[0],
                       "candidates": [dict(zip(("kind", "num_layers", "num_attention_heads", "intermediate_size",
                                                "hidden_size"), c)) for c in CANDIDATES]}
    from sections import portable_tree  # no machine's absolute path (the teacher's folder) in a results file

    out = portable_tree(out)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "auto_sst2.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    (RESULTS / "auto_sst2.md").write_text(markdown(out))
    log(f"wrote {RESULTS / 'auto_sst2.md'} in {(time.time() - start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
