"""Train a tiny student for a few steps; run under torchrun (2 processes) or in-process (1).

Saves the student's and projections' parameters, the log history and how the models were wrapped,
so tests/test_distributed.py can compare a 2-process run with a single-process one. `--cases logit,causal` trains
each case in turn in the same launch (into OUT/<case>/), with its own seeded models and trainer: one process group
serves several cases, saving a launch (two interpreters importing torch and transformers) per case.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from helpers import (  # noqa: E402
    args,
    bert,
    collate,
    flat_params,
    labelled_collate,
    leave_distributed_run,
    llama,
    sft_rows,
    teacher,
    token_dataset,
)

from hf_distill import DistillationTrainer  # noqa: E402


def run(out: Path, per_device_batch: int, intermediate: bool, causal: bool = False) -> dict:
    extra = {}
    student, make_teacher, collator = bert(2), teacher, collate
    # Rows of 3-12 tokens: token-averaged terms are normalised over the whole step's tokens on every rank
    # (hf_distill.losses.normalise), so the 2 x 4 and 1 x 8 splits must agree although their micro-batches differ.
    data = token_dataset(48)
    if causal:  # SFT rows with masked prompts: jsd + CE on completion tokens, the LM head in fused chunks
        student, data, collator = llama(0), sft_rows(48), labelled_collate
        make_teacher = lambda: llama(1, layers=3)  # noqa: E731
        extra = dict(kd_loss="jsd", jsd_beta=0.3, kd_weight=0.6, task_weight=0.4, kd_chunk_size=5)
    if intermediate:
        student = bert(2, hidden=16)  # narrower: a projection is trained and must stay in sync across ranks
        extra = dict(
            distill_terms=["loss=hidden_mse,layers=uniform", "loss=attention_score_mse,layers=uniform"],
            kd_weight=0.5,
            task_weight=0.5,
        )
    a = args(
        out,
        per_device_train_batch_size=per_device_batch,
        max_steps=3,
        optim="sgd",
        learning_rate=0.5,
        **extra,
    )
    trainer = DistillationTrainer(
        model=student, teacher_model=make_teacher(), args=a, train_dataset=data, data_collator=collator
    )
    trainer.train()
    proj = trainer.intermediate.projections if trainer.intermediate else None
    result = {
        "student": flat_params(trainer.model).tolist(),
        "projections": flat_params(proj).tolist() if proj is not None else [],
        "logs": [r for r in trainer.state.log_history if "loss" in r],
        "world_size": trainer.accelerator.num_processes,
        "teacher_type": type(trainer.teacher).__name__,
        "wrapped_type": type(trainer.model_wrapped).__name__,
    }
    if trainer.accelerator.is_main_process:
        (out / "result.json").write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--per_device_batch", type=int, default=4)
    p.add_argument("--intermediate", action="store_true")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--cases", help="comma-separated cases (logit, intermediate, causal), each into OUT/<case>")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    if a.cases is None:
        run(a.out, a.per_device_batch, a.intermediate, a.causal)
    for case in a.cases.split(",") if a.cases else []:
        if case not in ("logit", "intermediate", "causal"):
            raise SystemExit(f"--cases: unknown case {case!r} (logit, intermediate, causal)")
        (a.out / case).mkdir(exist_ok=True)
        run(a.out / case, a.per_device_batch, case == "intermediate", case == "causal")
    leave_distributed_run()
