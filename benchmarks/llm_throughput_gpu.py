"""Off-policy causal-LM KD throughput on a GPU: a ~1B student from a ~1B teacher through DistillationTrainer, beside
student-only SFT (plain `Trainer`) on the same batches (issue #32 item 5; TRL PR #6942 reports 26.8k tokens/s on an
H100). Not in CI.

    python benchmarks/llm_throughput_gpu.py --out DIR        # Llama-3.2-1B shape, seq 1,024, batch 32, bf16
    python benchmarks/llm_throughput_gpu.py --tiny --out DIR # a few-layer config: checks the script on a CPU
    python benchmarks/llm_throughput_gpu.py --kd_head_mode both --out DIR  # + a KD run with kd_head_mode="fused"

Both models have Llama-3.2-1B's shape (hidden 2,048, 16 layers, 32 heads / 8 KV heads, MLP 8,192, V = 128,256,
tied embeddings; 1.24B parameters) with random weights: only time and memory are measured. Random token rows,
every token learnt (`labels = input_ids`). Both runs: bf16 autocast, AdamW (fused), gradient checkpointing (so
batch 32 x 1,024 fits), the same seed and rows; KD is JSD (beta 0.5) + CE through the loss head
(`kd_chunk_size` left to the library). Each optimizer step is timed between two `torch.cuda.synchronize()` calls;
the first `--warmup` steps are not counted. Tokens/s = batch x seq / median step time. Peak = the CUDA allocator's
maximum during the run. Writes llm_throughput_gpu.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=128_256, tie_word_embeddings=True, max_position_embeddings=4096,
                rope_theta=500_000.0)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=1000, tie_word_embeddings=True, max_position_embeddings=256)


def _model(shape: dict, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**shape, use_cache=False))


def _rows(n: int, seq: int, vocab: int, seed: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


class _StepClock:
    """A TrainerCallback timing each optimizer step between two device synchronisations."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.times, self._t0 = cuda, [], 0.0

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kw):
        self._sync()
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self._sync()
        self.times.append(time.perf_counter() - self._t0)

    def __getattr__(self, name):  # every other TrainerCallback event: nothing to do
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)


def run(kind: str, shape: dict, rows, a, out_dir: Path) -> dict:
    from transformers import Trainer, TrainingArguments, default_data_collator

    from hf_distill import DistillationArguments, DistillationTrainer

    cuda = torch.cuda.is_available()
    common = dict(output_dir=str(out_dir / kind), per_device_train_batch_size=a.batch, max_steps=a.steps + a.warmup,
                  learning_rate=1e-5, bf16=cuda, gradient_checkpointing=a.checkpointing,
                  optim="adamw_torch_fused" if cuda else "adamw_torch", logging_steps=1, save_strategy="no",
                  report_to="none", seed=0, dataloader_num_workers=2, use_cpu=not cuda)
    student = _model(shape, 1)
    clock = _StepClock(cuda)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if kind.startswith("kd"):
        teacher = _model(shape, 2).to(torch.bfloat16 if cuda else torch.float32)
        args = DistillationArguments(**common, kd_loss="jsd", jsd_beta=0.5, kd_weight=1.0, task_weight=1.0,
                                     kd_token_mask="labels",
                                     kd_head_mode="fused" if kind == "kd_fused" else "recompute")
        trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows,
                                      data_collator=default_data_collator, callbacks=[clock])
    else:
        args = TrainingArguments(**common)
        trainer = Trainer(model=student, args=args, train_dataset=rows, data_collator=default_data_collator,
                          callbacks=[clock])
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    timed = clock.times[a.warmup:]
    step = statistics.median(timed)
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    row = {"run": kind, "median_step_s": step, "step_s": [round(t, 4) for t in timed],
           "tokens_per_s": a.batch * a.seq / step, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda
           else None, "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
           "wall_s": wall, "params": sum(p.numel() for p in student.parameters())}
    print(json.dumps(row), flush=True)
    del trainer, student
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no_checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--tiny", action="store_true", help="a few-layer config, for checking the script on a CPU")
    p.add_argument("--kd_head_mode", choices=["recompute", "fused", "both"], default="recompute",
                   help="the loss head's mode of the KD run (kd_head_mode; 'both': one KD run of each, issue #41)")
    p.add_argument("--out", default=str(HERE / "results"))
    a = p.parse_args()
    if not torch.cuda.is_available() and not a.tiny:
        raise SystemExit("error: no CUDA device; this benchmark measures GPU throughput (--tiny checks it on a CPU)")
    shape = TINY if a.tiny else LLAMA_1B
    if a.tiny:
        a.seq, a.batch = min(a.seq, 64), min(a.batch, 4)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = _rows(a.batch * (a.steps + a.warmup), a.seq, shape["vocab_size"], 0)
    kds = {"recompute": ("kd",), "fused": ("kd_fused",), "both": ("kd", "kd_fused")}[a.kd_head_mode]
    results = [run(kind, shape, rows, a, out / "runs") for kind in ("sft", *kds)]
    params = results[0]["params"]
    by = {r["run"]: r for r in results}
    data = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
            "shape": shape, "params": params, "seq": a.seq, "batch": a.batch, "steps": a.steps,
            "warmup": a.warmup, "checkpointing": a.checkpointing, "rows": results,
            **{f"{k}_over_sft_time": by[k]["median_step_s"] / by["sft"]["median_step_s"] for k in kds},
            "trl_pr_6942_tokens_per_s_h100": 26_800,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv)}
    from sections import portable_tree  # no machine's absolute path (e.g. --out) in a results file

    data = portable_tree(data)
    (out / "llm_throughput_gpu.json").write_text(json.dumps(data, indent=2) + "\n")
    md = [f"# Off-policy causal-LM KD throughput on {data['device']}", "",
          f"`{data['command']}`, {data['date']}, torch {torch.__version__}: Llama shape {shape['hidden_size']} x "
          f"{shape['num_hidden_layers']} layers, V = {shape['vocab_size']:,} ({params / 1e9:.2f}B parameters) for "
          f"student and teacher, seq {a.seq}, batch {a.batch}, bf16, gradient checkpointing {a.checkpointing}; "
          f"median of {a.steps} steps after {a.warmup}.", "",
          "| run | s/step | tokens/s | peak GiB | first loss | last loss |",
          "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        peak = "" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        md.append(f"| {r['run']} | {r['median_step_s']:.3f} | {r['tokens_per_s']:,.0f} | {peak} | "
                  f"{r['first_loss']:.4f} | {r['last_loss']:.4f} |")
    ratios = ", ".join(f"{k} {data[k + '_over_sft_time']:.2f}" for k in kds)
    md += ["", f"KD step / SFT step ({'kd_fused: kd_head_mode=fused; ' if 'kd_fused' in kds else ''}issue #41 target "
           f"<= 1.30): {ratios}. TRL PR #6942: 26.8k tokens/s on an H100 (its own setup; compare on the same card)."]
    (out / "llm_throughput_gpu.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
