"""The end of a recipe run: metrics (computed here, offline: `evaluate.load("accuracy")` needs the Hub), evaluation
of a model no Trainer holds, the teacher-logit cache, and results.json. Imported through `common`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

# ----------------------------------------------------------------------------------------------- metrics


def compute_metrics(eval_pred) -> dict[str, float]:
    """Accuracy and F1 (binary for 2 classes, macro otherwise), offline."""
    logits, labels = eval_pred.predictions, eval_pred.label_ids
    if isinstance(logits, tuple):
        logits = logits[0]
    preds = np.asarray(logits).argmax(-1)
    labels = np.asarray(labels)
    classes = sorted(set(labels.tolist()) | set(preds.tolist()))
    f1s = []
    for c in classes if len(classes) > 2 else [1]:
        tp = int(((preds == c) & (labels == c)).sum())
        fp = int(((preds == c) & (labels != c)).sum())
        fn = int(((preds != c) & (labels == c)).sum())
        f1s.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return {"accuracy": float((preds == labels).mean()), "f1": float(np.mean(f1s))}


def evaluate_model(model, dataset, collator, batch_size: int = 64, bf16: bool = False) -> dict[str, float]:
    """Metrics of any classifier on a tokenised dataset (used for the teacher, which no Trainer holds)."""
    import torch
    from transformers import EvalPrediction

    model.eval()
    logits, labels = [], []
    names = set(__import__("inspect").signature(model.forward).parameters)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16 and model.device.type == "cpu"):
        for i in range(0, len(dataset), batch_size):
            batch = collator([dataset[j] for j in range(i, min(i + batch_size, len(dataset)))])
            inputs = {k: v.to(model.device) for k, v in batch.items() if k in names and k != "labels"}
            logits.append(model(**inputs).logits.float().cpu().numpy())
            labels.append(batch["labels"].numpy())
    return compute_metrics(EvalPrediction(np.concatenate(logits), np.concatenate(labels)))


# ----------------------------------------------------------------------------------------------- results


def write_results(output_dir: str, results: dict[str, Any]) -> Path:
    """`results.json` next to the saved student."""
    path = Path(output_dir) / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in results.items() if not isinstance(v, dict | list)}, indent=2))
    return path


def cache_task_logits(teacher, train, collator, cache_dir: str, progress: bool, bf16: bool = False):
    """`train` with the teacher's logits computed once (hf_distill.data.cache), under bf16 autocast when asked, so
    the cached logits equal those an online bf16 teacher would give."""
    import torch

    from hf_distill.data.cache import cache_teacher_outputs

    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        return cache_teacher_outputs(teacher, train, cache_dir=cache_dir, collator=collator, progress=progress,
                                     key={"bf16": True} if bf16 else None)


def run_length(args, state) -> dict[str, Any]:
    """How long a run really trained, from the trainer state (`train_steps`, `epochs_trained`), and the limit
    that ended it: `max_steps` when set (the Trainer then ignores `num_train_epochs`), else `epochs`."""
    limit = {"max_steps": args.max_steps} if args.max_steps and args.max_steps > 0 else {
        "epochs": args.num_train_epochs}
    return {**limit, "train_steps": state.global_step, "epochs_trained": round(float(state.epoch or 0.0), 4)}


def train_and_report(trainer, results: dict[str, Any], start: float, *, student, teacher, train, valid, collator,
                     evaluate_teacher: bool) -> None:
    """The end every recipe shares: train, save the student, evaluate it (and the teacher), write results.json
    (every metric of the evaluation in `student_metrics` / `teacher_metrics`, which the model card reads)."""
    args = trainer.args
    train_out = trainer.train()
    trainer.save_model()
    from hf_distill.publish import measure
    from hf_distill.publish.report import distillation_facts, latest_eval_metrics

    results.update(params=measure.count_parameters(student), train_rows=len(train), **run_length(args, trainer.state),
                   bf16=args.bf16, bf16_available=bf16_available(), distillation=distillation_facts(args),
                   train_runtime_s=train_out.metrics.get("train_runtime"))
    if teacher is not None:
        results["teacher_params"] = measure.count_parameters(teacher)
    if valid is not None:
        metrics = trainer.evaluate()
        results.update(accuracy=metrics["eval_accuracy"], f1=metrics["eval_f1"], eval_rows=len(valid),
                       student_metrics=latest_eval_metrics([metrics])[0])
        if evaluate_teacher and teacher is not None:
            t = evaluate_model(teacher, valid, collator, bf16=args.bf16)
            results.update(teacher_accuracy=t["accuracy"], teacher_f1=t["f1"], teacher_metrics=t)
    results["wall_s"] = time.time() - start
    write_results(args.output_dir, results)
    trainer.save_state()  # trainer_state.json (train and eval logs): `hf-distill report` plots the run


def bf16_available() -> bool:
    """bf16 autocast pays off on CPUs with native bf16 arithmetic (AVX-512 BF16 / AMX), else it is emulated."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check and check())
