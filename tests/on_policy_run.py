"""On-policy (`lmbda=1`: the student generates) then sequence-level (`seq_kd`: the teacher generates) distillation of
a tiny Llama through DistillationTrainer.train(), under DeepSpeed ZeRO-3 or in one process.

Run under `accelerate launch` (2 processes, `--deepspeed_config`) or directly (1 process). Each phase is a fresh
trainer: prompt + completion rows through PromptCompletionCollator, greedy decoding of at most 6 tokens, SGD, and
in the `lmbda` phase an evaluation every 2 steps (evaluation stays on the dataset's completions). The stop ids are
tokens the models emit early on some prompts only, so the processes' completions end at different lengths: under
ZeRO-3 a process whose rows have all stopped must keep stepping with the others (`synced_gpus`). Rank 0 writes
`result.json`: per phase, every generate call's rows ([prompt tokens, completion up to and including its first
stop id]) in the order of the global batch, each process's longest completion per call, the logged losses and
the student's full parameters (gathered from the shards), so that tests/test_engines.py can compare a ZeRO-3 run
with a single-process one on the same global batch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import datasets
import torch
from accelerate.utils import gather_object

sys.path.insert(0, str(Path(__file__).parent))
from helpers import VOCAB, args, leave_distributed_run, llama, word_tokenizer  # noqa: E402

from hf_distill import DistillationTrainer  # noqa: E402
from hf_distill.data.prompts import PromptCompletionCollator  # noqa: E402

MAX_NEW_TOKENS = 6
STOP_IDS = [16, 29, 119]  # tokens the student (seed 0) and the teacher (seed 1) emit early on some of these prompts
PHASES = {"lmbda": {"lmbda": 1.0}, "seq_kd": {"lmbda": 0.0, "seq_kd": True}}


def tokenizer():
    """A WordLevel tokenizer of the tiny Llama's ids: <unk> <pad> <s> </s> user assistant w0 w1 ..."""
    tok = word_tokenizer(["<s>", "</s>", "user", "assistant", *[f"w{i}" for i in range(VOCAB - 6)]])
    tok.add_special_tokens({"eos_token": "</s>", "bos_token": "<s>"})
    return tok


def rows(n: int, seed: int = 0) -> datasets.Dataset:
    """Prompt + completion text rows of 2 to 5 words each."""
    g = torch.Generator().manual_seed(seed)

    def words() -> str:
        count = int(torch.randint(2, 6, (1,), generator=g))
        return " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 6, (count,), generator=g))

    return datasets.Dataset.from_list([{"prompt": words(), "completion": words()} for _ in range(n)])


def record_generations(model: torch.nn.Module, calls: list) -> torch.nn.Module:
    """Record, for every generate call on this instance, each row's [prompt tokens, completion up to and including
    its first stop id], and the longest completion (so that processes finishing at different lengths show)."""
    original = model.generate

    def generate(*a, **kw):
        out = original(*a, **kw)
        ids, mask = kw["input_ids"], kw["attention_mask"]
        rows, longest = [], 0
        for i in range(ids.shape[0]):
            completion = out[i, ids.shape[1]:].tolist()
            stops = [j for j, t in enumerate(completion) if t in STOP_IDS]
            completion = completion[: stops[0] + 1] if stops else completion
            rows.append([ids[i][mask[i] != 0].tolist(), completion])
            longest = max(longest, len(completion))
        calls.append({"rows": rows, "longest": longest})
        return out

    model.generate = generate
    return model


def flat_state(state: dict) -> list[float]:
    return torch.cat([v.detach().reshape(-1).float().cpu() for _, v in sorted(state.items())]).tolist()


def run_phase(out: Path, phase: str, per_device_batch: int, steps: int, deepspeed_config: str | None) -> dict:
    calls: list = []
    student, teacher = llama(0), llama(1)
    record_generations(student if phase == "lmbda" else teacher, calls)
    # the Trainer's eval_loss is a mean over micro-batches: the same micro-batches of 2 rows in every run
    evaluate = {"eval_strategy": "steps", "eval_steps": 2, "per_device_eval_batch_size": 2}
    tok = tokenizer()
    a = args(out / phase, per_device_train_batch_size=per_device_batch, max_steps=steps, optim="sgd",
             learning_rate=0.5, kd_loss="jsd", kd_weight=0.7, task_weight=0.3, generation_temperature=0.0,
             max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=STOP_IDS, **PHASES[phase],
             **(evaluate if phase == "lmbda" else {}), **({"deepspeed": deepspeed_config} if deepspeed_config else {}))
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=a, train_dataset=rows(8 * steps),
                                  eval_dataset=rows(4, seed=1) if phase == "lmbda" else None,
                                  data_collator=PromptCompletionCollator(tok), processing_class=tok)
    trainer.train()
    acc = trainer.accelerator
    state = acc.get_state_dict(trainer.model_wrapped)  # gathers the ZeRO-3 shards (on rank 0)
    per_rank = gather_object([calls])  # [rank 0's calls, rank 1's calls, ...]
    # the global batch of step k is rank 0's micro-batch k, then rank 1's (accelerate deals the sampler's batches)
    generated = [[row for rank in per_rank for row in rank[k]["rows"]] for k in range(len(calls))]
    return {
        "generated": generated,
        "longest": [[rank[k]["longest"] for rank in per_rank] for k in range(len(calls))],
        "logs": [r for r in trainer.state.log_history if "loss" in r],
        "eval_logs": [r for r in trainer.state.log_history if "eval_loss" in r],
        "student": flat_state(state) if acc.is_main_process else [],
        "distributed_type": acc.distributed_type.value,
        "world_size": acc.num_processes,
        "steps": trainer.state.global_step,
    }


def run(out: Path, per_device_batch: int, steps: int, deepspeed_config: str | None = None) -> dict:
    result = {phase: run_phase(out, phase, per_device_batch, steps, deepspeed_config) for phase in PHASES}
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return result
    (out / "result.json").write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--per_device_batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--deepspeed_config", default=None)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    run(a.out, a.per_device_batch, a.steps, a.deepspeed_config)
    leave_distributed_run()
