"""Train a tiny student for a few steps; run under torchrun (2 processes) or in-process (1).

Saves the student's and projections' parameters, the log history and how the models were wrapped,
so tests/test_distributed.py can compare a 2-process run with a single-process one. `--cases logit,causal` trains
each case in turn in the same launch (into OUT/<case>/), with its own seeded models and trainer: one process group
serves several cases, saving a launch (two interpreters importing torch and transformers) per case.

The cases `served` and `routed` (issue #42) train from a teacher served on 127.0.0.1 by the test (`--teacher_url`),
the second with rows routed per `teacher_id` to a local teacher, the server and an offline signal (`--signal_dir`);
each rank records the rows it trained on and the rows it asked the server to score (OUT/<case>/rank<r>.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from helpers import (  # noqa: E402
    VOCAB,
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
    word_tokenizer,
)

from hf_distill import DistillationTrainer  # noqa: E402
from hf_distill.data.teacher_signal import load_teacher_signal  # noqa: E402

SERVED_K, SERVED_T = VOCAB, 1.0  # k = the vocabulary: the served top-k + tail is the whole distribution
SERVED_CASES = ("served", "routed")


def served_tokenizer():
    return word_tokenizer([f"w{i}" for i in range(VOCAB - 2)])


def routed_ids(n: int) -> list[str]:
    return [("local", "big", "sig", "big")[i % 4] for i in range(n)]


class _Recording(DistillationTrainer):
    """Keeps the real tokens of every row this process trained on."""

    def training_step(self, model, inputs, *rest, **kw):
        mask = inputs["attention_mask"].bool()
        self.seen.extend(ids[m].tolist() for ids, m in zip(inputs["input_ids"], mask, strict=True))
        return super().training_step(model, inputs, *rest, **kw)


def run_served(out: Path, per_device_batch: int, url: str | None, signal_dir: Path | None = None) -> dict:
    """The causal case's SFT rows and loss with a served teacher (`url`; None: the same teacher local, the
    reference), or with rows routed to a local teacher, the server and an offline signal (`signal_dir`)."""
    data = sft_rows(48)
    teacher = url if url is not None else llama(1, layers=3)
    if signal_dir is not None:
        data = data.add_column("teacher_id", routed_ids(len(data)))
        teacher = {"local": llama(2), "big": teacher, "sig": load_teacher_signal(signal_dir)}
    served = dict(teacher_top_k=SERVED_K, teacher_retries=2, teacher_backoff=0.1, teacher_timeout=60.0) if url else {}
    a = args(out, per_device_train_batch_size=per_device_batch, max_steps=3, optim="sgd", learning_rate=0.5,
             kd_loss="jsd", jsd_beta=0.3, kd_weight=0.6, task_weight=0.4, kd_chunk_size=5, temperature=SERVED_T,
             **served)
    trainer = _Recording(model=llama(0), teacher_model=teacher, args=a, train_dataset=data,
                         data_collator=labelled_collate, processing_class=served_tokenizer())
    trainer.seen, asked = [], []
    for source in trainer.distiller.served.values():  # the rows this process asks the server to score
        score = source.client.score
        source.client.score = lambda rows, *rest, _score=score, **kw: asked.extend(rows) or _score(rows, *rest, **kw)
    trainer.train()
    result = {
        "student": flat_params(trainer.model).tolist(),
        "logs": [r for r in trainer.state.log_history if "loss" in r],
        "world_size": trainer.accelerator.num_processes,
        "wrapped_type": type(trainer.model_wrapped).__name__,
        "seen": trainer.seen,
        "asked": [list(map(int, r)) for r in asked],
        "routing": trainer.distiller.router.describe() if trainer.distiller.router is not None else {},
    }
    (out / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps(result))
    return result


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
    p.add_argument("--cases", help="comma-separated cases (logit, intermediate, causal, served, routed), each into "
                   "OUT/<case>")
    p.add_argument("--teacher_url", help="the served teacher of the served and routed cases")
    p.add_argument("--signal_dir", type=Path, help="the offline signal of the routed case")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    if a.cases is None:
        run(a.out, a.per_device_batch, a.intermediate, a.causal)
    for case in a.cases.split(",") if a.cases else []:
        if case not in ("logit", "intermediate", "causal", *SERVED_CASES):
            raise SystemExit(f"--cases: unknown case {case!r} (logit, intermediate, causal, served, routed)")
        (a.out / case).mkdir(exist_ok=True)
        if case in SERVED_CASES:
            run_served(a.out / case, a.per_device_batch, a.teacher_url, a.signal_dir if case == "routed" else None)
        else:
            run(a.out / case, a.per_device_batch, case == "intermediate", case == "causal")
    leave_distributed_run()
