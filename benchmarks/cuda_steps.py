"""DistillationTrainer vs the hand-written loop on CUDA, in bf16 and fp32: the GPU companion of speed.py. Not in CI.

    python benchmarks/cuda_steps.py [--batch N] [--out DIR]   # needs a CUDA device; about 2 minutes at batch 32

On a GPU a step of these models takes milliseconds, so any per-step Python or synchronisation cost the
Trainer adds shows here far more than on a CPU. Same work and the same hand-written loop as speed.py
(teacher under no_grad, student forward/backward, clip, fused AdamW; logit-only and TinyBERT-style), the loop
under `torch.autocast` where the Trainer has `bf16=True`. Models: the MiniLM-L6 teacher's shape with random
weights (only time is measured, and the offline weights are too large to send to the GPU machine) and its
3-layer student; batch 32, length 128, random token ids. Each step is timed between two
`torch.cuda.synchronize()` calls on both sides. Writes `cuda_steps.{json,md}` to `--out`
(default `benchmarks/results/`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import speed  # noqa: E402  (the shared runners, timing and comparison)

LENGTH, ROUNDS, STEPS, WARMUP = 128, 6, 20, 5


class SyncClock(speed.Clock):
    def start(self) -> None:
        torch.cuda.synchronize()
        super().start()

    def stop(self) -> speed.Sample:
        torch.cuda.synchronize()
        return super().stop()


def on_gpu(batches: list[dict]) -> list[dict]:
    return [{k: v.cuda() for k, v in b.items()} for b in batches]


class CudaTeacherForward(speed.TeacherForwardRunner):
    clock = SyncClock


class CudaLoop(speed.LoopRunner):
    """speed.LoopRunner on the GPU: batches on the device, bf16 autocast when asked, synchronised clock;
    `kind="task"` trains the student alone on its own loss (the control)."""

    clock = SyncClock

    def __init__(self, student, teacher, batches, kind: str, bf16: bool) -> None:
        super().__init__(student.cuda(), teacher.cuda(), on_gpu(batches), kind)
        self.bf16 = bf16

    def _loss(self, batch):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.bf16):
            return self.student(**batch).loss if self.kind == "task" else super()._loss(batch)


def models():
    from transformers import BertConfig, BertForSequenceClassification

    from hf_distill import students

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                        intermediate_size=1536, max_position_embeddings=512, num_labels=2)
    teacher = BertForSequenceClassification(config)
    return students.from_teacher(teacher, speed.STUDENT_LAYERS), teacher


def dataset(rows: int):
    import datasets

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (rows, LENGTH), generator=g)
    ids[:, 0] = 101
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * LENGTH] * rows,
                                       "labels": (torch.arange(rows) % 2).tolist()})


class PlainTrainerRunner(speed.TrainerRunner):
    """The control: `transformers.Trainer` training the student alone (its own task loss), to set the Trainer's
    own per-step cost apart from what DistillationTrainer adds."""

    def __init__(self, student, dataset, workdir: str, **args_kw) -> None:
        from transformers import Trainer

        self.timer = speed.trainer_timer()
        self.trainer = Trainer(model=student, train_dataset=dataset, callbacks=[self.timer],
                               args=speed.distill_args(workdir, 1, **args_kw))


SETTINGS = speed.Settings(rounds=ROUNDS, steps=STEPS, warmup=WARMUP)


def compare_sides(kind: str, bf16: bool, tmp: str) -> dict:
    """Trainer vs loop on `kind` work: logit, tinybert (DistillationTrainer) or task (plain Trainer, no teacher)."""
    data = dataset(speed.BATCH * 8)
    student, teacher = models()
    workdir = f"{tmp}/{kind}-{bf16}"
    if kind == "task":
        trainer = PlainTrainerRunner(student, data, workdir, use_cpu=False, bf16=bf16)
    else:
        trainer = speed.TrainerRunner(student, teacher, data, workdir, use_cpu=False, bf16=bf16,
                                      **speed.trainer_vs_loop_losses(kind))
    trainer.timer.clock = SyncClock()
    student2, teacher2 = models()
    loop = CudaLoop(student2, teacher2, speed.batches_of(data, 8), kind, bf16)
    v = speed.compare("trainer", "loop", speed.interleave({"trainer": trainer, "loop": loop}, SETTINGS))
    speed.show(f"{kind} {'bf16' if bf16 else 'fp32'}", LENGTH, "trainer", "loop", v)
    return v


def cached_vs_online(bf16: bool, tmp: str) -> dict:
    """speed.py's cached_vs_online on the GPU: logit KD from cached teacher logits vs a teacher forward."""
    from hf_distill.data.cache import cache_teacher_outputs

    data = dataset(speed.BATCH * 8)
    student, teacher = models()
    cached = cache_teacher_outputs(teacher.cuda(), data, cache_dir=f"{tmp}/cache", progress=False)
    kw = dict(use_cpu=False, bf16=bf16, kd_loss="kl", temperature=2.0, kd_weight=0.5, task_weight=0.5)
    runners = {"cached": speed.TrainerRunner(student, None, cached, f"{tmp}/cached-{bf16}", **kw),
               "online": speed.TrainerRunner(models()[0], teacher, data, f"{tmp}/online-{bf16}", **kw),
               "teacher_forward": CudaTeacherForward(teacher, on_gpu(speed.batches_of(data, 8)), bf16)}
    for name in ("cached", "online"):
        runners[name].timer.clock = SyncClock()
    rounds = speed.interleave(runners, SETTINGS)
    v = speed.compare("cached", "online", rounds)
    v["teacher_forward_median_s"] = speed.median([w for r in rounds["teacher_forward"] for w, _ in r])
    v["floor"] = v["cached_median_s"] / (v["cached_median_s"] + v["teacher_forward_median_s"])
    speed.show(f"cache {'bf16' if bf16 else 'fp32'}", LENGTH, "cached", "online", v, f"; floor {v['floor']:.3f}")
    return v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(speed.RESULTS))
    p.add_argument("--batch", type=int, default=speed.BATCH,
                   help="rows per step (default 32, speed.py's; a larger one keeps the GPU busy)")
    a = p.parse_args(argv)
    out = Path(a.out)
    speed.BATCH = a.batch  # read by speed.py's runners at call time
    stem = "cuda_steps" if a.batch == 32 else f"cuda_steps_b{a.batch}"
    command = "python benchmarks/cuda_steps.py" + ("" if a.batch == 32 else f" --batch {a.batch}")
    if not torch.cuda.is_available():
        print("cuda_steps.py needs a CUDA device.", file=sys.stderr)
        return 2
    start = time.time()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("logit", "tinybert", "task"):
            for bf16 in (True, False):
                results[f"{kind}_{'bf16' if bf16 else 'fp32'}"] = compare_sides(kind, bf16, tmp)
        cache = {("bf16" if bf16 else "fp32"): cached_vs_online(bf16, tmp) for bf16 in (True, False)}
    device = torch.cuda.get_device_name()
    summary = {"device": device, "torch": torch.__version__, "length": LENGTH, "batch": speed.BATCH,
               "rounds": SETTINGS.rounds, "steps_per_round": SETTINGS.steps, "wall_s": round(time.time() - start, 1),
               "ratios": {k: v["ratio"] for k, v in results.items()} | {f"cached_vs_online_{k}": v["ratio"]
                                                                         for k, v in cache.items()},
               "details": results | {f"cached_vs_online_{k}": v for k, v in cache.items()}}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(summary, indent=2))
    lines = [f"# DistillationTrainer vs hand-written loop on {device}", "",
             f"`{command}`, torch {torch.__version__}, batch {speed.BATCH}, length {LENGTH}, "
             f"{SETTINGS.rounds} interleaved rounds of {SETTINGS.steps} steps (first of each dropped), "
             f"{summary['wall_s']} s.", "",
             "| work | precision | trainer ms/step | loop ms/step | trainer - loop ms | trainer/loop |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for key, v in results.items():
        kind, precision = key.split("_")
        kind = "task (plain Trainer, student alone)" if kind == "task" else kind
        t, lp = 1e3 * v["trainer_median_s"], 1e3 * v["loop_median_s"]
        lines.append(f"| {kind} | {precision} | {t:.2f} | {lp:.2f} | {t - lp:+.2f} | {v['ratio']:.3f} |")
    lines += ["", "Cached teacher logits vs online teacher (DistillationTrainer both; floor = cached / (cached + "
              "teacher forward alone)):", "", "| precision | cached ms/step | online ms/step | cached/online | floor |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for precision, v in cache.items():
        lines.append(f"| {precision} | {1e3 * v['cached_median_s']:.2f} | {1e3 * v['online_median_s']:.2f} | "
                     f"{v['ratio']:.3f} | {v['floor']:.3f} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
