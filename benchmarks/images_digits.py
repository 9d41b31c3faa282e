"""Images through DistillationTrainer (issue #43 item 6), measured on scikit-learn's bundled digits. Not part of CI.

    nice -n 19 python benchmarks/images_digits.py             # teacher (cached) + 4 rows x 3 seeds
    python benchmarks/images_digits.py --quick                # a smoke run (1 seed, 2 epochs) under benchmarks/.cache
    for r in no_kd logit_kd token_hard token_soft; do        # or one process per row, then merge
      nice -n 19 python benchmarks/images_digits.py --rows $r --part & done; wait
    python benchmarks/images_digits.py --collect

Data: the 1,797 real 8x8 digit images of `sklearn.datasets.load_digits`, a fixed stratified 70/30 split (1,257
train, 540 test, `random_state=0`), kept as raw 8-bit grayscale PIL images. Each model has its own image processor
and sees its own input from the same raw image (`hf_distill.data.image_inputs.ImageProcessorsCollator`): the teacher
at 32x32 normalised with the training images' mean and std, the students at 16x16 with (0.5, 0.5). Without
augmentation every epoch shows the same images, so the collator runs once over each split, and the teacher's
logits on its own training inputs are computed once and ride in the rows (`teacher_logits`, as
`hf_distill.data.cache` stores them): the same numbers an online teacher gives, for a fraction of the CPU.

- teacher: a CNN, transformers' `ResNetForImageClassification` (3 stages of one basic block, 32/64/128 channels),
  trained once with cross-entropy (seed 0) and cached under benchmarks/runs/images_digits.
- students: a small ViT (3 blocks, width 48, 3 heads, MLP 96, patch 4: 16 patches), from scratch, the same
  rows, order, epochs, lr and schedule per seed:
  no KD (`DistillationTrainer` with kd_weight 0: cross-entropy); logit KD (0.5 CE + 0.5 T^2 KL, T = 2); DeiT's
  distillation token (the same ViT with a distillation token and head, transformers'
  `DeiTForImageClassificationWithTeacher`: 0.5 CE on the class head + 0.5 KD on the distillation head, hard =
  cross-entropy against the teacher's argmax, soft = T^2 KL at T = 2); prediction = the two heads' average.
- reported: test accuracy (mean and sample standard deviation over seeds 0, 1, 2), parameters, and the batch-1
  CPU speed-up over the teacher (median over 100 test images of interleaved teacher/student forwards, each model
  on its own input, 1 thread).

Writes benchmarks/results/images_digits.{json,md} (`--quick`: benchmarks/.cache/quick/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import sections  # noqa: E402

RESULTS = HERE / "results"
WORK = HERE / "runs" / "images_digits"
ROWS = ("no_kd", "logit_kd", "token_hard", "token_soft")
LABELS = {"no_kd": "ViT student, no KD", "logit_kd": "ViT student, logit KD",
          "token_hard": "DeiT student, distillation token (hard)",
          "token_soft": "DeiT student, distillation token (soft)"}


def digits():
    """(train rows, test rows, pixel mean, pixel std): rows are {"image": PIL 8x8 L, "label": int}."""
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    images = np.clip(data.images * 16, 0, 255).astype(np.uint8)  # 0..16 -> 0..255
    idx_train, idx_test = train_test_split(np.arange(len(images)), test_size=0.3, stratify=data.target,
                                           random_state=0)

    def rows(idx):
        return [{"image": Image.fromarray(images[i], "L"), "label": int(data.target[i])} for i in idx]

    train = images[idx_train] / 255.0
    return rows(idx_train), rows(idx_test), float(train.mean()), float(train.std())


def processors(mean: float, std: float):
    from transformers import ViTImageProcessorPil

    student = ViTImageProcessorPil(size={"height": 16, "width": 16}, image_mean=[0.5], image_std=[0.5])
    teacher = ViTImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[mean], image_std=[std])
    return student, teacher


def student_config(distillation_token: bool):
    from transformers import ViTConfig

    from hf_distill.students.distillation_token import deit_config

    config = ViTConfig(hidden_size=48, num_hidden_layers=3, num_attention_heads=3, intermediate_size=96,
                       image_size=16, patch_size=4, num_channels=1, num_labels=10)
    return deit_config(config) if distillation_token else config


def train_args(out: Path, seed: int, epochs: int, **extra):
    base = dict(output_dir=str(out), num_train_epochs=epochs, per_device_train_batch_size=64, learning_rate=1e-3,
                weight_decay=0.05, warmup_steps=0.1, lr_scheduler_type="cosine", save_strategy="no", report_to="none",
                use_cpu=True, seed=seed, disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False,
                logging_steps=50)
    base.update(extra)
    return base


def accuracy(trainer, test) -> float:
    out = trainer.predict(test)
    logits = out.predictions[0] if isinstance(out.predictions, tuple) else out.predictions  # DeiT: the average
    return float((logits.argmax(-1) == out.label_ids).mean())


def teacher_model(train, test, t_proc, epochs: int, work: Path, log):
    """The CNN teacher, trained on its own inputs (`train`/`test`: rows of `pixel_values` and `labels`)."""
    from transformers import ResNetConfig, ResNetForImageClassification, Trainer, TrainingArguments

    folder = work / "teacher"
    if (folder / "config.json").exists():
        return ResNetForImageClassification.from_pretrained(folder).eval(), json.loads((folder / "acc.json")
                                                                                        .read_text())["accuracy"]
    torch.manual_seed(0)
    config = ResNetConfig(num_channels=1, embedding_size=32, hidden_sizes=[32, 64, 128], depths=[1, 1, 1],
                          layer_type="basic", num_labels=10)
    model = ResNetForImageClassification(config)
    trainer = Trainer(model=model, args=TrainingArguments(**train_args(work / "teacher_run", 0, epochs)),
                      train_dataset=train)
    t0 = time.time()
    trainer.train()
    acc = accuracy(trainer, test)
    log(f"teacher: {acc:.4f} ({time.time() - t0:.0f} s)")
    model.save_pretrained(folder)
    t_proc.save_pretrained(folder)
    (folder / "acc.json").write_text(json.dumps({"accuracy": acc}))
    return model.eval(), acc


def run_row(row: str, seed: int, train, test, epochs: int, work: Path):
    """One student trained on its rows (`train` carries the teacher's logits) and its test accuracy."""
    from transformers import DeiTForImageClassificationWithTeacher, ViTForImageClassification

    from hf_distill import DistillationArguments, DistillationTrainer

    token = row.startswith("token")
    torch.manual_seed(seed)
    cls = DeiTForImageClassificationWithTeacher if token else ViTForImageClassification
    student = cls(student_config(token))
    extra = dict(kd_weight=0.5, task_weight=0.5, temperature=2.0, kd_loss="kl")
    if row == "no_kd":
        extra.update(kd_weight=0.0, task_weight=1.0)
    if token:
        extra["distillation_token"] = row.removeprefix("token_")
    trainer = DistillationTrainer(model=student, args=DistillationArguments(**train_args(work / f"{row}_{seed}", seed,
                                                                                          epochs, **extra)),
                                  train_dataset=train)
    t0 = time.time()
    trainer.train()
    return student.eval(), accuracy(trainer, test), time.time() - t0


def speedup(teacher, student, raw_test, s_proc, t_proc, n: int = 100) -> float:
    """Median over `n` test images of teacher time / student time, batch 1, interleaved, each on its own input."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ratios = []
    try:
        with torch.inference_mode():
            for row in raw_test[:n]:
                t_in = t_proc([row["image"]], return_tensors="pt")["pixel_values"]
                s_in = s_proc([row["image"]], return_tensors="pt")["pixel_values"]
                for _ in range(2):  # warm
                    teacher(pixel_values=t_in), student(pixel_values=s_in)
                t0 = time.perf_counter()
                teacher(pixel_values=t_in)
                t1 = time.perf_counter()
                student(pixel_values=s_in)
                t2 = time.perf_counter()
                ratios.append((t1 - t0) / (t2 - t1))
    finally:
        torch.set_num_threads(threads)
    return statistics.median(ratios)


def summary(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def report(data: dict) -> str:
    sec = data["digits"]
    lines = ["# Images: scikit-learn digits (issue #43 item 6)", "",
             f"Command: `{sec['meta']['command']}`, {sec['meta']['date']}, {sec['meta']['seconds'] / 60:.1f} min, "
             f"load before / after: {sec['meta']['load_before']} / {sec['meta']['load_after']} "
             "(2 CPU cores shared with 7 other jobs: times are contended).", "",
             f"Machine: {sec['machine']}. Epochs: {sec['epochs']}; seeds: {sec['seeds']}; test rows: "
             f"{sec['test_rows']} (train {sec['train_rows']}).", "",
             "| model | test accuracy (mean ± std over seeds) | per seed | parameters | batch-1 speed-up vs teacher |",
             "| --- | --- | --- | --- | --- |",
             f"| teacher: ResNet (CNN), 32x32 | {sec['teacher']['accuracy']:.4f} | - | "
             f"{sec['teacher']['parameters']:,} | 1.00x |"]
    for row in ROWS:
        r = sec["rows"].get(row)
        if r is None:
            continue
        acc = r["accuracy"]
        lines.append(f"| {LABELS[row]}, 16x16 | {acc['mean']:.4f} ± {acc['std']:.4f} | "
                     f"{', '.join(f'{v:.4f}' for v in acc['values'])} | {r['parameters']:,} | "
                     f"{statistics.median(r['speedup']):.2f}x |")
    lines += ["", sec["verdict"], ""]
    return "\n".join(lines)


def verdict(rows: dict) -> str:
    def band(row):
        a = rows[row]["accuracy"]
        return a["mean"] - a["std"], a["mean"] + a["std"]

    best = max(("token_hard", "token_soft"), key=lambda r: rows[r]["accuracy"]["mean"])
    lo = band(best)[0]
    beats = {other: lo > band(other)[1] for other in ("no_kd", "logit_kd")}
    name = LABELS[best]
    if all(beats.values()):
        return (f"The best distillation-token row ({name}) beats logit KD and no KD beyond the seeds' spread "
                "(its mean - std is above their mean + std).")
    lost = ", ".join(LABELS[o] for o, b in beats.items() if not b)
    return (f"The best distillation-token row ({name}) does NOT beat {lost} beyond the seeds' spread (mean - std vs "
            "mean + std): see the numbers above.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--teacher-epochs", type=int, default=10)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--part", action="store_true",
                        help="write only this run's rows under benchmarks/.cache/images_digits_parts (run rows in "
                        "parallel processes), then `--collect`")
    parser.add_argument("--collect", action="store_true", help="merge the parts into the results files")
    a = parser.parse_args()
    parts = HERE / ".cache" / "images_digits_parts"
    if a.collect:
        found = [json.loads(p.read_text()) for p in sorted(parts.glob("*.json"))]
        data = found[0]
        sec = data["digits"]
        sec["rows"] = {row: f["digits"]["rows"][row] for row in ROWS for f in found if row in f["digits"]["rows"]}
        metas = [dict(f["digits"]["meta"]) for f in found]
        sec["meta"] = {**metas[0], "parts": metas, "seconds": max(m["seconds"] for m in metas),
                       "command": f"{len(metas)} parallel processes, e.g. {metas[0]['command']}"}
        sec["verdict"] = verdict(sec["rows"]) if set(ROWS) <= set(sec["rows"]) else ""
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "images_digits.json").write_text(json.dumps(data, indent=1) + "\n")
        (RESULTS / "images_digits.md").write_text(report(data))
        print(report(data))
        return
    seeds = [int(s) for s in a.seeds.split(",")]
    epochs, t_epochs = a.epochs, a.teacher_epochs
    results, work = RESULTS, WORK
    if a.quick:
        seeds, epochs, t_epochs = seeds[:1], 2, 2
        results = work = HERE / ".cache" / "quick"
    results.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(time.strftime("%H:%M:%S"), msg, flush=True)

    from datasets import Dataset

    from hf_distill.data.image_inputs import ImageProcessorsCollator
    from hf_distill.publish.measure import count_parameters

    raw_train, raw_test, mean, std = digits()
    s_proc, t_proc = processors(mean, std)
    collate = ImageProcessorsCollator(s_proc, t_proc)  # each model's own pixel_values from the same raw image
    train_px, test_px = collate(raw_train), collate(raw_test)

    def rows(batch, pixels, **extra):
        return Dataset.from_dict({"pixel_values": batch[pixels].numpy(), "labels": batch["labels"].numpy(),
                                  **extra}).with_format("torch")

    with sections.section_record("benchmarks/images_digits.py") as meta:
        teacher, t_acc = teacher_model(rows(train_px, "teacher_pixel_values"), rows(test_px, "teacher_pixel_values"),
                                       t_proc, t_epochs, work, log)
        with torch.inference_mode():
            t_logits = teacher(pixel_values=train_px["teacher_pixel_values"]).logits
        train, test = rows(train_px, "pixel_values", teacher_logits=t_logits.numpy()), rows(test_px, "pixel_values")
        rows_out = {}
        for row in a.rows.split(","):
            accs, speeds, params = [], [], None
            for seed in seeds:
                student, acc, took = run_row(row, seed, train, test, epochs, work)
                speeds.append(speedup(teacher, student, raw_test, s_proc, t_proc))
                accs.append(acc)
                params = count_parameters(student)
                log(f"{row} seed {seed}: {acc:.4f} ({took:.0f} s), speed-up {speeds[-1]:.2f}x")
            rows_out[row] = {"accuracy": summary(accs), "parameters": params, "speedup": speeds}
    data = {"digits": {"meta": meta, "machine": sections.machine(), "epochs": epochs, "seeds": seeds,
                       "train_rows": len(raw_train), "test_rows": len(raw_test), "pixel_mean": mean, "pixel_std": std,
                       "teacher": {"accuracy": t_acc, "parameters": count_parameters(teacher),
                                   "epochs": t_epochs},
                       "rows": rows_out}}
    data["digits"]["verdict"] = verdict(rows_out) if set(ROWS) <= set(rows_out) else ""
    data = sections.portable_tree(data)
    if a.part:
        parts.mkdir(parents=True, exist_ok=True)
        (parts / f"{a.rows.replace(',', '_')}.json").write_text(json.dumps(data, indent=1) + "\n")
        return
    (results / "images_digits.json").write_text(json.dumps(data, indent=1) + "\n")
    (results / "images_digits.md").write_text(report(data))
    log(report(data))


if __name__ == "__main__":
    main()
