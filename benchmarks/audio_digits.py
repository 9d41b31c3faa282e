"""Audio classification distillation on spoken digit words (issue #43 item 6), measured on 2 contended CPU cores.

    nice -n 19 python benchmarks/audio_digits.py              # teacher + 3 student rows x 3 seeds
    python benchmarks/audio_digits.py --quick                 # a smoke run (1 seed, few epochs)

Data: the ten digit words spoken by espeak-ng (`hf_distill.data.speech.spoken_digits`) in 54 speaker settings
(6 voices x 3 speeds x 3 pitches), split by speaker: 36 settings train, 18 held out (those voice/speed/pitch
combinations are never heard in training; each base voice is, at other speeds or pitches). Waveforms are padded or
cut to 14,000 samples (0.875 s at 16 kHz; the longest clip has 13,162) by one `Wav2Vec2FeatureExtractor` (zero mean,
unit variance per clip; attention mask).

Teacher: a 4-layer wav2vec2 classifier (hidden 64, conv feature encoder 4 x 16 channels, 20 ms frames) trained
here from random weights (plain `Trainer`, seed 0). Student: `students.shrink` of it to 2 layers, hidden 32, conv
encoder 4 x 8 channels, trained three ways from the same initialisation and data order per seed: no KD
(cross-entropy only, plain `Trainer`), logit KD (`DistillationTrainer`: 0.5 CE + 0.5 T^2 KL, T = 2) and logit KD +
hidden-state MSE (uniform layer map, one shared projection 32 -> 64). Accuracy on the held-out speakers,
parameters, and the batch-1 speed-up of the student over the teacher (`publish.measure.speedup`, median of
interleaved passes, one thread). Writes `benchmarks/results/audio_digits.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
WORK = HERE / "runs" / "audio_digits"
MAX_SAMPLES = 14_000  # the longest clip is 13,162 samples
# A 4-layer conv feature encoder with a 320-sample hop (20 ms frames, as wav2vec2-base), sized for 2 CPU cores.
CONV = {"conv_kernel": (10, 8, 4, 4), "conv_stride": (5, 4, 4, 4)}
TEACHER = {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
           "conv_dim": (16,) * 4}
STUDENT = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
           "conv_dim": (8,) * 4}
ROWS = ("no KD", "logit KD", "logit KD + hidden MSE")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def data(extractor):
    """Train and held-out splits of the spoken digits, disjoint in speakers, as model inputs."""
    from hf_distill.data.speech import spoken_digits

    rows = spoken_digits(speakers=54, seed=0)
    speakers = sorted(set(rows["speaker"]))
    held = set(np.random.default_rng(0).permutation(speakers)[:18].tolist())

    def encode(batch):
        out = extractor([a["array"] for a in batch["audio"]], sampling_rate=16_000, padding="max_length",
                        max_length=MAX_SAMPLES, truncation=True, return_attention_mask=True)
        return {"input_values": out["input_values"], "attention_mask": out["attention_mask"]}

    rows = rows.map(encode, batched=True, remove_columns=["audio", "text"])
    train = rows.filter(lambda r: r["speaker"] not in held).remove_columns("speaker")
    test = rows.filter(lambda r: r["speaker"] in held).remove_columns("speaker")
    return train.with_format("torch"), test.with_format("torch")


def accuracy(pred) -> dict[str, float]:
    return {"accuracy": float((pred.predictions.argmax(-1) == pred.label_ids).mean())}


def train(model, train_set, test_set, out: Path, epochs: int, seed: int, lr: float, teacher=None, **kd):
    from transformers import Trainer, TrainingArguments

    from hf_distill import DistillationArguments, DistillationTrainer

    common = dict(output_dir=str(out), per_device_train_batch_size=16, per_device_eval_batch_size=32,
                  num_train_epochs=epochs, learning_rate=lr, warmup_steps=20, lr_scheduler_type="linear", seed=seed,
                  data_seed=seed, save_strategy="no", eval_strategy="no", report_to=[], logging_steps=10,
                  dataloader_num_workers=0, use_cpu=True, disable_tqdm=True)
    if teacher is None:
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=train_set,
                          eval_dataset=test_set, compute_metrics=accuracy)
    else:
        trainer = DistillationTrainer(model=model, teacher_model=teacher, args=DistillationArguments(**common, **kd),
                                      train_dataset=train_set, eval_dataset=test_set, compute_metrics=accuracy)
    trainer.train()
    return trainer.evaluate()["eval_accuracy"]


def render(record: dict) -> str:
    """The results table (markdown) of a results record."""
    student, teacher, data = record["student"], record["teacher"], record["data"]
    lines = ["| Model | Parameters | Held-out accuracy (mean ± std over seeds) | Speed-up (batch 1) |",
             "| --- | ---: | ---: | ---: |",
             f"| teacher (wav2vec2, 4 x 64) | {teacher['params']:,} | {teacher['accuracy']:.3f} (seed 0) | 1.00x |"]
    for row, r in record["rows"].items():
        lines.append(f"| student 2 x 32, {row} | {student['params']:,} | {r['mean']:.3f} ± {r['std']:.3f} "
                     f"({', '.join(f'{a:.3f}' for a in r['accuracy'])}) | {record['speedup_batch1']:.2f}x |")
    lines += ["", f"`{record['command']}`: teacher {teacher['epochs']} epochs, students {student['epochs']} epochs, "
                  f"{data['train_clips']} training clips (36 speakers), {data['held_out_clips']} held-out clips (18 "
                  f"other speakers). Machine: {record['contention']}. Wall time {record['wall_seconds'] / 60:.1f} min."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--teacher-epochs", type=int, default=15)
    parser.add_argument("--student-epochs", type=int, default=10)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the .json, without running")
    args = parser.parse_args()
    if args.render:
        (RESULTS / "audio_digits.md").write_text(render(json.loads((RESULTS / "audio_digits.json").read_text())))
        return
    if args.quick:
        args.seeds, args.teacher_epochs, args.student_epochs = "0", 2, 2
    torch.set_num_threads(1)  # one thread: on contended cores a second one mostly waits at barriers
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2ForSequenceClassification

    from hf_distill import students
    from hf_distill.publish.measure import count_parameters, speedup

    started = time.time()
    extractor = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16_000, padding_value=0.0, do_normalize=True,
                                         return_attention_mask=True)
    train_set, test_set = data(extractor)
    log(f"data: {len(train_set)} train clips, {len(test_set)} held-out clips")
    config = Wav2Vec2Config(**TEACHER, **CONV, feat_extract_norm="layer", num_conv_pos_embeddings=16,
                            num_conv_pos_embedding_groups=4, classifier_proj_size=64, num_labels=10,
                            id2label={i: w for i, w in enumerate(
                                ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"))},
                            hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                            final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.05)
    torch.manual_seed(0)
    teacher = Wav2Vec2ForSequenceClassification(config)
    t0 = time.time()
    teacher_acc = train(teacher, train_set, test_set, WORK / "teacher", args.teacher_epochs, 0, 2e-3)
    log(f"teacher: accuracy {teacher_acc:.3f} ({time.time() - t0:.0f} s)")
    teacher.eval()
    results: dict[str, list[float]] = {row: [] for row in ROWS}
    student_params = None
    for seed in [int(s) for s in args.seeds.split(",")]:
        for row in ROWS:
            student = students.shrink(teacher, seed=seed, **STUDENT)
            student_params = count_parameters(student)
            kd = {} if row == "no KD" else {"kd_weight": 0.5, "task_weight": 0.5, "temperature": 2.0}
            if row.endswith("hidden MSE"):
                kd.update(distill_terms=[{"loss": "hidden_mse", "layers": "uniform", "weight": 1.0}],
                          projection="shared")
            t0 = time.time()
            acc = train(student, train_set, test_set, WORK / f"{row}-{seed}", args.student_epochs, seed, 2e-3,
                        teacher=teacher if kd else None, **kd)
            results[row].append(acc)
            log(f"seed {seed} {row}: accuracy {acc:.3f} ({time.time() - t0:.0f} s)")
    torch.set_num_threads(1)
    batches = [{k: test_set[i][k][None] for k in ("input_values", "attention_mask")} for i in range(20)]
    fast = speedup(teacher, student.eval(), batches, repeats=5)
    record = {
        "data": {"train_clips": len(train_set), "held_out_clips": len(test_set), "train_speakers": 36,
                 "held_out_speakers": 18, "max_samples": MAX_SAMPLES},
        "teacher": {"accuracy": teacher_acc, "params": count_parameters(teacher), "epochs": args.teacher_epochs},
        "student": {"params": student_params, "epochs": args.student_epochs,
                    "shape": {**STUDENT, "conv_dim": list(STUDENT["conv_dim"])}},
        "rows": {row: {"accuracy": accs, "mean": statistics.mean(accs),
                       "std": statistics.stdev(accs) if len(accs) > 1 else 0.0} for row, accs in results.items()},
        "speedup_batch1": fast,
        "seeds": args.seeds,
        "contention": f"2 CPU cores shared with 7 other helpers' jobs (1-min load average {os.getloadavg()[0]:.0f} "
                      "at the end); run under nice -n 19 with one torch thread",
        "wall_seconds": time.time() - started,
        "command": " ".join(["python benchmarks/audio_digits.py", *sys.argv[1:]]),
    }
    out = (HERE / ".cache" / "quick") if args.quick else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    (out / "audio_digits.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "audio_digits.md").write_text(render(record))
    log(render(record))


if __name__ == "__main__":
    main()
