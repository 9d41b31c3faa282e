"""Train a tiny causal-LM student from a teacher signal (no teacher) for a few steps, under torchrun (2 processes)
or in-process (1), from the signal as a Dataset ("map") and streamed ("stream"), recording the rows each rank
trained on. tests/test_signal_distributed.py compares a 2-process run with one process on the same global batches.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import datasets
import torch

sys.path.insert(0, str(Path(__file__).parent))
from helpers import VOCAB, args, flat_params, labelled_collate, leave_distributed_run, llama, sft_rows, word_tokenizer  # noqa: E402

from hf_distill import DistillationTrainer  # noqa: E402
from hf_distill.data.teacher_signal import attach_teacher_signal, load_teacher_signal, streamed  # noqa: E402

ROWS, K, T = 48, 8, 2.0
ROWS_PER_SHARD = 12  # 4 files: each of 2 ranks streams 2 of them


def tokenizer():
    return word_tokenizer([f"w{i}" for i in range(VOCAB - 2)])


def rows() -> datasets.Dataset:
    return sft_rows(ROWS, seed=5)


class Recording(DistillationTrainer):
    """Keeps the real tokens of every row this process trained on, per step."""

    def training_step(self, model, inputs, *rest, **kw):
        mask = inputs["attention_mask"].bool()
        self.seen.append([ids[m].tolist() for ids, m in zip(inputs["input_ids"], mask, strict=True)])
        return super().training_step(model, inputs, *rest, **kw)


def train(out: Path, signal_dir: Path, mode: str, per_device_batch: int, order: list[int] | None = None) -> dict:
    """`mode` "map": the rows joined with the signal (the sampler shards them); "stream": the joined rows streamed
    from one shard per signal file, which accelerate splits between the processes by file. `order` reorders the
    rows first (the single-process run that sees the 2-process run's global batches). "compact": "stream" from a
    signal in the compact layout (format 3); "adaptive": the same from adaptive k (format 4, padded positions)."""
    data, signal = rows(), load_teacher_signal(signal_dir)
    if order is not None:
        data, signal = data.select(order), signal.select(order)
    joined = attach_teacher_signal(data, signal)
    extra = {}
    if mode in ("stream", "compact", "adaptive"):
        n_files = len(list(signal_dir.glob("shard-*.arrow")))
        joined = streamed(joined, num_shards=n_files if order is None else 1)
        extra = dict(accelerator_config={"dispatch_batches": False})  # rows of different lengths: no dispatch
    run = args(out / mode, per_device_train_batch_size=per_device_batch, max_steps=3, optim="sgd", learning_rate=0.5,
               temperature=T, kd_loss="jsd", jsd_beta=0.3, kd_weight=0.6, task_weight=0.4, **extra)
    trainer = Recording(model=llama(0), teacher_model=None, args=run, train_dataset=joined,
                        data_collator=labelled_collate, processing_class=tokenizer())
    trainer.seen = []
    trainer.train()
    return {
        "student": flat_params(trainer.model).tolist(),
        "logs": [r for r in trainer.state.log_history if "loss" in r],
        "seen": trainer.seen,
        "world_size": trainer.accelerator.num_processes,
        "rank": trainer.accelerator.process_index,
        "wrapped_type": type(trainer.model_wrapped).__name__,
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("signal_dir", type=Path)
    p.add_argument("compact_dir", type=Path)
    p.add_argument("adaptive_dir", type=Path)
    a = p.parse_args()
    torch.set_num_threads(1)
    result = {mode: train(a.out, a.signal_dir, mode, per_device_batch=4) for mode in ("map", "stream")}
    result["compact"] = train(a.out, a.compact_dir, "compact", per_device_batch=4)
    result["adaptive"] = train(a.out, a.adaptive_dir, "adaptive", per_device_batch=4)
    (a.out / f"rank{result['map']['rank']}.json").write_text(json.dumps(result))
    leave_distributed_run()
