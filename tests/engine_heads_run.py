"""The causal-LM loss head under FSDP2 and DeepSpeed ZeRO-3 on 2 CPU processes: several scenarios in one launch.

Each scenario trains a tiny Llama (JSD + CE on completion tokens, SGD) through DistillationTrainer.train() with a
fresh trainer, so one process group runs them in sequence (tests/test_engines.py: `--head_scenarios` of
tests/engine_run.py under torchrun for FSDP2, this script under `accelerate launch` for ZeRO-3). The rows are laid out
so that process 0 gets short rows and process 1 long ones: their sequence lengths differ, and so do their numbers of
token chunks. Rank 0 writes `<name>.json` per scenario: the logged losses, the student's full parameters, whether
the loss head ran, the package's warnings, and per process and per micro-batch the sequence length, the counted
tokens, the token chunks and how many times the student's and the teacher's heads were gathered (once per
micro-batch, whatever the chunk count: hf_distill.kd_paths.engine_heads).

`--signal_dir DIR` runs the sparse head instead (an offline teacher signal; by hand, not in the test suite: how the
engines guide's sparse-head cells under FSDP2 and ZeRO-3 were checked, against `run_scenario(..., "ddp", 8,
"signal", signal_dir=DIR)` in one process).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
from pathlib import Path

import datasets
import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_run import _Warnings, engine_kwargs, flat_state, full_state  # noqa: E402
from helpers import VOCAB, args, leave_distributed_run, llama  # noqa: E402
from on_policy_run import tokenizer  # noqa: E402

from hf_distill import DistillationTrainer  # noqa: E402
from hf_distill.data.prompts import PromptCompletionCollator  # noqa: E402
from hf_distill.kd_paths import engine_heads  # noqa: E402
from hf_distill.losses import chunked  # noqa: E402

# name: (tied embeddings, gradient accumulation steps, kd_chunk_size)
SCENARIOS = {"untied_accumulation_chunks": (False, 2, 2), "tied_resharded_head": (True, 1, None)}
# FSDP2 only (ZeRO-3 runs the first; its tied head ran too when this was written, 7e-9 of one process): the unit of
# the final norm and the (tied) LM head resharded after the forward (accelerate keeps it whole), so the student's
# head weight is a DTensor shard when the loss head runs: gathered by full_tensor(), its gradient reduce-scattered
FSDP2_ONLY = {"tied_resharded_head"}
STEPS = 2


def uneven_rows(n: int) -> datasets.Dataset:
    """Rows whose groups of 4 alternate short (1-word prompt and completion) and long (7 and 6 words): accelerate
    gives a 2-process run's consecutive batches of 4 to the processes in turn, so process 0 holds short rows and
    process 1 long ones, while one process with batches of 8 sees the same global batches."""
    g = torch.Generator().manual_seed(3)

    def words(count: int) -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 6, (count,), generator=g))

    return datasets.Dataset.from_list([{"prompt": words(1 if (i // 4) % 2 == 0 else 7),
                                        "completion": words(1 if (i // 4) % 2 == 0 else 6)} for i in range(n)])


def scenario_trainer(out: Path, engine: str, per_device_batch: int, name: str, use_cpu: bool = True,
                     deepspeed_config: str | None = None) -> DistillationTrainer:
    tied, accumulation, chunk = SCENARIOS[name]
    a = args(out, per_device_train_batch_size=per_device_batch, gradient_accumulation_steps=accumulation,
             max_steps=STEPS, optim="sgd", learning_rate=0.5, use_cpu=use_cpu, kd_loss="jsd", kd_weight=0.7,
             task_weight=0.3, kd_token_mask="labels", kd_chunk_size=chunk, train_sampling_strategy="sequential",
             **engine_kwargs(engine, deepspeed_config, "LlamaDecoderLayer", use_cpu))
    tok = tokenizer()
    return DistillationTrainer(model=llama(0, tie_word_embeddings=tied),
                               teacher_model=llama(1, tie_word_embeddings=tied),
                               args=a, train_dataset=uneven_rows(8 * accumulation * STEPS),
                               data_collator=PromptCompletionCollator(tok), processing_class=tok)


class _Record:
    """Per micro-batch on this process: length, counted tokens, chunks, and the heads' gathers (wrapping the loss
    head's calls of hf_distill.kd_paths.engine_heads and hf_distill.losses.chunked)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.saved = (chunked.chunked_kd_and_ce, engine_heads.run_student, engine_heads.teacher_head,
                      engine_heads._full)

    def __enter__(self) -> _Record:
        real_head, real_student, real_teacher, real_full = self.saved

        def head(s_hidden, s_head, teacher, t_hidden, kd_mask, labels, kd, chunk, *a, **k):
            rows = (kd_mask if kd_mask is not None else torch.ones_like(labels, dtype=torch.bool)) | (labels != -100)
            n = int(rows.sum())
            if not self.calls or "length" in self.calls[-1]:  # no engine: the head is not gathered
                self.calls.append({"student_calls": 0, "teacher_gathers": 0, "dtensor_gathers": 0,
                                   "teacher_dtensor": 0})
            self.calls[-1].update(length=int(s_hidden.shape[1]), tokens=n, chunks=math.ceil(n / chunk))
            return real_head(s_hidden, s_head, teacher, t_hidden, kd_mask, labels, kd, chunk, *a, **k)

        def student(*a, **k):
            self.calls.append({"student_calls": 1, "teacher_gathers": self.pending, "dtensor_gathers": 0,
                               "teacher_dtensor": self.teacher_dtensor})
            self.pending = self.teacher_dtensor = 0
            return real_student(*a, **k)

        def teacher(*a, **k):
            self.pending += 1
            return real_teacher(*a, **k)

        def full(t, grad, *a):
            if t is not None and engine_heads._is_dtensor(t) and grad:
                self.calls[-1]["dtensor_gathers"] += 1
            elif t is not None and engine_heads._is_dtensor(t):
                self.teacher_dtensor += 1
            return real_full(t, grad, *a)

        self.pending = self.teacher_dtensor = 0
        chunked.chunked_kd_and_ce, engine_heads.run_student = head, student
        engine_heads.teacher_head, engine_heads._full = teacher, full
        return self

    def __exit__(self, *exc) -> None:
        chunked.chunked_kd_and_ce, engine_heads.run_student, engine_heads.teacher_head, engine_heads._full = self.saved


def signal_trainer(out: Path, engine: str, per_device_batch: int, signal_dir: Path,
                   deepspeed_config: str | None = None) -> DistillationTrainer:
    """The sparse head: a tiny Llama trained from an offline teacher signal (tests/signal_distributed_run.py's rows
    and signal, made by `create_teacher_signal` into `signal_dir`), `kd_chunk_size=3`, rows in order."""
    import signal_distributed_run as sig
    from helpers import labelled_collate

    from hf_distill.data.teacher_signal import attach_teacher_signal, load_teacher_signal

    joined = attach_teacher_signal(sig.rows(), load_teacher_signal(signal_dir))
    a = args(out, per_device_train_batch_size=per_device_batch, max_steps=3, optim="sgd", learning_rate=0.5,
             temperature=sig.T, kd_loss="jsd", jsd_beta=0.3, kd_weight=0.6, task_weight=0.4, kd_chunk_size=3,
             train_sampling_strategy="sequential", **engine_kwargs(engine, deepspeed_config, "LlamaDecoderLayer", True))
    return DistillationTrainer(model=llama(0), teacher_model=None, args=a, train_dataset=joined,
                               data_collator=labelled_collate, processing_class=sig.tokenizer())


def run_scenario(out: Path, engine: str, per_device_batch: int, name: str, use_cpu: bool = True,
                 deepspeed_config: str | None = None, signal_dir: Path | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    warnings = _Warnings()
    logging.getLogger("hf_distill").addHandler(warnings)
    try:
        trainer = (signal_trainer(out, engine, per_device_batch, signal_dir, deepspeed_config) if name == "signal"
                   else scenario_trainer(out, engine, per_device_batch, name, use_cpu, deepspeed_config))
        with _Record() as record, _resharded_tail(name in FSDP2_ONLY):
            trainer.train()
    finally:
        logging.getLogger("hf_distill").removeHandler(warnings)
    acc = trainer.accelerator
    state = full_state(acc, trainer.model_wrapped)
    calls = acc.gather_for_metrics([record.calls], use_gather_object=True)
    result = {
        "scenario": name, "distributed_type": acc.distributed_type.value, "world_size": acc.num_processes,
        "steps": trainer.state.global_step,
        "loss_head": trainer.distiller._student_state(trainer.model_wrapped).rebuilds,
        "warnings": warnings.messages,
        "student": flat_state(state) if acc.is_main_process else [],
        "logs": [r for r in trainer.state.log_history if "loss" in r],
        "calls": calls,  # per process, per micro-batch
    }
    if acc.is_main_process:
        (out / f"{name}.json").write_text(json.dumps(result))
    acc.wait_for_everyone()
    return result


@contextlib.contextmanager
def _resharded_tail(on: bool):
    """accelerate's FSDP2 preparation with its tail unit (final norm + LM head) resharded after the forward."""
    if not on:
        yield
        return
    import torch.distributed.fsdp as fsdp

    real = fsdp.fully_shard

    def fully_shard(module, **kw):
        if isinstance(module, list):  # the tail: accelerate passes reshard_after_forward=False
            kw["reshard_after_forward"] = True
        return real(module, **kw)

    fsdp.fully_shard = fully_shard
    try:
        yield
    finally:
        fsdp.fully_shard = real


def scenarios(engine: str) -> list[str]:
    return [n for n in SCENARIOS if engine == "fsdp2" or n not in FSDP2_ONLY]


def run_all(out: Path, engine: str, per_device_batch: int, use_cpu: bool = True,
            deepspeed_config: str | None = None, signal_dir: Path | None = None) -> None:
    """The scenarios; with `signal_dir` only the sparse head's (`signal`: a run by hand, not in the test suite)."""
    for name in ["signal"] if signal_dir is not None else scenarios(engine):
        run_scenario(out / name, engine, per_device_batch, name, use_cpu, deepspeed_config, signal_dir)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--engine", choices=["ddp", "fsdp2", "zero3"], default="zero3")
    p.add_argument("--per_device_batch", type=int, default=4)
    p.add_argument("--deepspeed_config", default=None)
    p.add_argument("--signal_dir", type=Path, default=None,
                   help="the sparse head from this teacher signal instead (tests/signal_distributed_run.py's)")
    p.add_argument("--fsdp_on_cpu", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.fsdp_on_cpu:
        from engine_run import fsdp_on_cpu

        fsdp_on_cpu()
    run_all(a.out, a.engine, a.per_device_batch, deepspeed_config=a.deepspeed_config, signal_dir=a.signal_dir)
    leave_distributed_run()
