"""What SFT's token metrics cost `DistillationSFTTrainer` per step on the CPU (entropy and mean_token_accuracy).

In training the causal-LM loss head never builds the logits, so the metrics take one more no-grad pass over the
student's last hidden states through its LM head, in token chunks (`DistillationSFTTrainer._token_metrics`). This
times that pass inside real training steps (the Distiller's `student_hook`, wrapped with a clock) against the whole
step, on the `sft` section's setup of benchmarks/causal_lm.py (its teacher, student blocks and WikiText-2 rows, 8 rows
per step, unpacked and packed) and on a random teacher of the same shape with a wider vocabulary (same rows):

    python benchmarks/sft_metrics_cost.py --teacher <causal teacher folder> --kept 0,1,5 --vocab 32768
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(teacher, student, tok, rows, packed: bool, steps: int, warmup: int) -> dict[str, float]:
    from transformers import TrainerCallback

    from hf_distill import DistillationSFTConfig, DistillationSFTTrainer

    step_times, hook_times = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            step_times.append(time.perf_counter() - self.t0)

    args = DistillationSFTConfig(
        output_dir="/tmp/hf_distill_sft_metrics_cost", max_steps=steps, per_device_train_batch_size=8,
        learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0, bf16=False, gradient_checkpointing=False, kd_loss="jsd",
        jsd_beta=0.5, kd_weight=1.0, task_weight=0.0, packing=packed, max_length=256 if packed else 128)
    trainer = DistillationSFTTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows,
                                     processing_class=tok, callbacks=[Clock()])
    hook = trainer.distiller.student_hook

    def timed(model, outputs, inputs, from_hidden):
        t0 = time.perf_counter()
        hook(model, outputs, inputs, from_hidden)
        if model.training:
            assert from_hidden, "the loss head did not run"
            hook_times.append(time.perf_counter() - t0)

    trainer.distiller.student_hook = timed
    trainer.train()
    step, metrics = statistics.median(step_times[warmup:]), statistics.median(hook_times[warmup:])
    return {"step_s": step, "metrics_s": metrics, "share": metrics / step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", required=True, help="a causal-LM teacher folder (benchmarks/causal_lm.py's sft one)")
    p.add_argument("--kept", default="0,1,5", help="teacher blocks the student keeps")
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary of the random pair (0: skip it)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from hf_distill import students

    sys.path.insert(0, str(HERE))
    from causal_lm_sft import sft_rows

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(a.teacher)
    teacher = AutoModelForCausalLM.from_pretrained(a.teacher)
    kept = [int(k) for k in a.kept.split(",")]
    rows = sft_rows(tok, a.steps * 8)
    cases = [("trained pair", teacher, lambda: students.from_teacher(teacher, kept), rows)]
    if a.vocab:
        config = teacher.config.to_dict()
        config.update(vocab_size=a.vocab, tie_word_embeddings=False)
        torch.manual_seed(0)
        big = LlamaForCausalLM(LlamaConfig(**config))
        cases.append((f"random pair, V = {a.vocab}", big, lambda: students.from_teacher(big, kept), rows))
    print("| models | V | packing | median s/step | metrics pass s/step | share of the step |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for name, t, make, data in cases:
        for packed in (False, True):
            r = run(t, make(), tok, data, packed, a.steps, a.warmup)
            print(f"| {name} | {t.config.vocab_size} | {packed} | {r['step_s']:.3f} | {r['metrics_s']:.4f} | "
                  f"{100 * r['share']:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
