"""Pruning + distillation recovery curves (issue #33 items 3 and 4), measured on 2 CPU cores. Not part of CI.

    python benchmarks/prune_recover.py                      # both sections
    python benchmarks/prune_recover.py --only encoder       # one of them (encoder, decoder)
    python benchmarks/prune_recover.py --only decoder --decoder-points 0,15,30 --quick   # a smoke run

- encoder (SST-2): the quality benchmark's teacher (`benchmarks/runs/teacher`, fine-tuned by
  `quality_sst2.fine_tune_teacher` when missing: the offline MiniLM-L6, 1 epoch on the 20,000-row subset) is
  pruned in width and depth by `students.prune_width` (Minitron's activation importance on calibration batches of
  the first training rows). Several shapes are timed against the teacher at batch 1 on the CPU
  (`publish.measure.speedup`, first 200 validation rows, median of interleaved passes) and `--encoder-shape` is
  trained twice from the same pruned weights: KD (`DistillationTrainer`, 0.5 CE + 0.5 T^2 KL, T = 2, the teacher
  online) and plain fine-tuning (CE only, no teacher), same rows in the same order, lr, schedule and seed.
  Validation accuracy (872 rows, fp32) of the teacher, the pruned student before training, and both runs at each
  of `--encoder-points` steps (one run per side, evaluated along the way: constant lr after warm-up, so a point
  is "N steps of training", not the end of a schedule decayed to N).
- decoder (WikiText-2): the causal-LM recipe's teacher (`recipes/causal_lm.py` with
  `recipes/configs/causal_lm_wikitext.yaml`: found in its cache, else trained by the recipe's own function, ~20
  min) pruned in width AND depth by `prune_width(..., num_layers=...)`, then trained on the recipe's 480
  distillation blocks with the recipe's objective (1.0 * JSD beta 0.5 + 1.0 * CE, T = 1, through the chunked
  loss head, `kd_chunk_size`) vs CE only, same blocks, order, lr and seed; held-out perplexity (the recipe's: the
  first 256 blocks of wiki.test.raw) of the teacher, the pruned student before training, and both runs at each of
  `--decoder-points` steps.

Writes `benchmarks/results/prune_recover.{json,md,png}` (`--quick`: `benchmarks/.cache/quick/`); a section not run
keeps its previous results.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import sections  # noqa: E402  (how a section ran, the report's section headings)

ROOT = HERE.parent
RESULTS = HERE / "results"
WORK = HERE / "runs" / "prune_recover"
SECTIONS = ("encoder", "decoder")
CAUSAL_CONFIG = ROOT / "recipes" / "configs" / "causal_lm_wikitext.yaml"
# Encoder shapes timed at batch 1 (layers, heads, MLP channels). BERT's head size is hidden / heads, so keeping
# whole 32-channel heads ties the hidden size to the heads: 6 heads = hidden 192.
ENCODER_SHAPES = {"6L-12H-768": (6, 12, 768), "6L-8H-768": (6, 8, 768), "6L-6H-768": (6, 6, 768),
                  "4L-12H-768": (4, 12, 768), "4L-8H-768": (4, 8, 768), "3L-12H-1536": (3, 12, 1536)}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_module(name: str, path: Path):
    """A benchmark or recipe script as a module (recipes import `common` from their folder)."""
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def points_of(text: str) -> list[int]:
    points = sorted({int(x) for x in text.split(",") if x.strip()})
    if not points or points[0] < 0:
        raise ValueError(f"steps must be a comma-separated list of numbers >= 0, got {text!r}")
    return points if points[0] == 0 else [0, *points]


def train_curve(student, teacher, train, collator, tokenizer, points, evaluate, kd: bool, **settings) -> dict:
    """One run of max(points) steps (KD with the teacher, or the task loss alone); the metric at every point."""
    import torch
    from transformers import TrainerCallback

    from hf_distill import DistillationArguments, DistillationTrainer

    class Checkpoints(TrainerCallback):
        """Evaluates at the given global steps (the model in eval mode, then back in train mode); the time spent
        evaluating is left out of `train_s`."""

        def __init__(self):
            self.start, self.eval_s, self.rows = time.time(), 0.0, []

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step in points:
                t0 = time.time()
                train_s = t0 - self.start - self.eval_s
                value = evaluate(model)
                model.train()
                self.eval_s += time.time() - t0
                self.rows.append({"step": state.global_step, "value": value, "train_s": train_s})
                log(f"  step {state.global_step}: {value:.4f}")

    weights = settings.pop("weights")
    args = DistillationArguments(
        max_steps=max(points), lr_scheduler_type="constant_with_warmup", weight_decay=0.0, max_grad_norm=1.0,
        save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
        dataloader_num_workers=0, train_sampling_strategy="sequential", logging_steps=25,
        kd_weight=weights[0] if kd else 0.0, task_weight=weights[1] if kd else 1.0, **settings)
    callback = Checkpoints()
    trainer = DistillationTrainer(model=student, teacher_model=teacher if kd else None, args=args,
                                  train_dataset=train, data_collator=collator, processing_class=tokenizer,
                                  callbacks=[callback])
    out = trainer.train()
    losses = [(r["step"], r["loss"]) for r in trainer.state.log_history if "loss" in r and "step" in r]
    return {"points": callback.rows, "train_runtime_s": out.metrics.get("train_runtime"), "losses": losses,
            "args": {k: getattr(args, k) for k in ("learning_rate", "lr_scheduler_type", "warmup_steps", "bf16",
                                                  "per_device_train_batch_size", "seed", "kd_loss", "temperature",
                                                  "kd_weight", "task_weight", "kd_chunk_size", "jsd_beta")}}


# ---------------------------------------------------------------------------------------------- encoder


def encoder_section(a) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    from hf_distill import students
    from hf_distill.publish import measure

    q = load_module("quality_sst2", HERE / "quality_sst2.py")
    common = load_module("common", ROOT / "recipes" / "common.py")  # the recipes' evaluate_model
    work = HERE / "runs"
    folder = Path(a.encoder_teacher) if a.encoder_teacher else work / "teacher"
    if not a.encoder_teacher and not (folder / "results.json").is_file():
        log("fine-tuning the quality benchmark's teacher (benchmarks/runs/teacher: 8-20 min on 2 cores)")
        q.fine_tune_teacher(work, q.TRAIN_ROWS, True)
    info_path = folder / "results.json"
    teacher_info = json.loads(info_path.read_text()) if info_path.is_file() else None
    tok = AutoTokenizer.from_pretrained(folder)
    teacher = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2).eval()
    rows = q.read_tsv(q.DATA / "train.tsv")
    picked = [rows[i] for i in q.subset_indices(len(rows), q.TRAIN_ROWS)]
    if a.quick:
        picked = picked[:2000]

    def encode(rows_):
        ds = datasets.Dataset.from_dict({"sentence": [r["sentence"] for r in rows_],
                                         "labels": [int(r["label"]) for r in rows_]})
        return ds.map(lambda b: tok(b["sentence"], truncation=True, max_length=q.MAX_LENGTH), batched=True,
                      remove_columns=["sentence"])

    train, valid = encode(picked), encode(q.read_tsv(q.DATA / "validation.tsv"))
    collate = DataCollatorWithPadding(tok)

    def accuracy(model) -> float:
        return common.evaluate_model(model, valid, collate)["accuracy"]

    teacher_acc = accuracy(teacher)
    log(f"teacher: {teacher_acc:.2%}")

    # Calibration: the first training rows in the protocol's order, padding masked.
    n_cal = a.calibration_batches * q.BATCH
    calibration = [{k: v for k, v in collate([train[j] for j in range(i, min(i + q.BATCH, n_cal))]).items()
                    if k != "labels"} for i in range(0, n_cal, q.BATCH)]
    t0 = time.time()
    importance = students.width_importance(teacher, calibration)
    importance_s = time.time() - t0
    shapes = dict(ENCODER_SHAPES)
    if a.encoder_shape != "auto":
        shape = tuple(int(x) for x in a.encoder_shape.split(","))
        shapes.setdefault(f"{shape[0]}L-{shape[1]}H-{shape[2]}", shape)

    def prune(s):
        return students.prune_width(teacher, num_layers=s[0], num_attention_heads=s[1], intermediate_size=s[2],
                                    importance=importance)

    # Batch-1 latency against the teacher (speedup: median of per-round ratios of interleaved passes).
    b1 = q.validation_batches(tok, 1)[: 40 if a.quick else q.B1_ROWS]
    teacher_ms = 1000 * measure.inference_seconds(teacher, b1, a.repeats) / len(b1)
    latency = {}
    for name, s in shapes.items():
        model, pruning = prune(s)
        sp = measure.speedup(teacher, model, b1, a.repeats)
        latency[name] = {"layers": s[0], "heads": s[1], "intermediate": s[2], "hidden": model.config.hidden_size,
                         "kept_layers": pruning.layers, "params": measure.count_parameters(model), "speedup_b1": sp,
                         "latency_ratio_b1": 1 / sp}
        log(f"{name}: {latency[name]['params'] / 1e6:.2f} M params, batch-1 speed-up {sp:.2f}x")
    if a.encoder_shape == "auto":  # the shape whose measured latency ratio is nearest the target
        chosen = min(latency, key=lambda n: abs(latency[n]["latency_ratio_b1"] - a.latency_target))
        shape = shapes[chosen]
    else:
        chosen = next(name for name, s in shapes.items() if s == shape)
    student, pruning = prune(shape)
    pruned_acc = accuracy(student)
    log(f"pruned {chosen} (teacher blocks {pruning.layers}), no training: {pruned_acc:.2%}")

    points = points_of(a.encoder_points)
    settings = dict(learning_rate=a.encoder_lr, warmup_steps=a.encoder_warmup, per_device_train_batch_size=q.BATCH,
                    per_device_eval_batch_size=64, bf16=not a.fp32, seed=q.SEED, kd_loss="kl", temperature=2.0,
                    weights=(0.5, 0.5))
    runs = {}
    for side in ("kd", "fine_tune"):
        log(f"encoder {side}: {max(points)} steps")
        model = students.prune_width(teacher, num_layers=shape[0], num_attention_heads=shape[1],
                                     intermediate_size=shape[2], importance=importance)[0]
        torch.manual_seed(q.SEED)
        runs[side] = train_curve(model, teacher, train, collate, tok, [p for p in points if p], accuracy,
                                 kd=side == "kd", output_dir=str(WORK / "encoder" / side), **settings)
        runs[side]["points"].insert(0, {"step": 0, "value": pruned_acc, "train_s": 0.0})
    return {"teacher": {"accuracy": teacher_acc, "params": measure.count_parameters(teacher), "path":
                        os.path.relpath(folder, ROOT), "batch1_ms": teacher_ms, "fine_tune": teacher_info},
            "shape": chosen, "shape_choice": a.encoder_shape, "latency_target": a.latency_target,
            "kept_layers": pruning.layers, "params": measure.count_parameters(student),
            "hidden": student.config.hidden_size, "pruned_accuracy": pruned_acc, "latency": latency, "runs": runs,
            "calibration_rows": n_cal, "calibration_tokens": importance.num_tokens, "importance_s": importance_s,
            "train_rows": len(train), "eval_rows": len(valid), "points": points, "quick": a.quick,
            "threads": torch.get_num_threads()}


# ---------------------------------------------------------------------------------------------- decoder


def decoder_teacher(recipe_mod, path: str | None) -> tuple[str, dict | None]:
    """The recipe's teacher: `path`, else its cache folder for the config's settings (trained there if missing)."""
    if path:
        return path, None
    # The recipe's own parsing (YAML values typed by its dataclasses: the cache key hashes them).
    recipe, args, _ = recipe_mod.parse_args(
        [recipe_mod.CausalLMArguments, recipe_mod.DistillationArguments], "teacher",
        ["--config", str(CAUSAL_CONFIG), "--output_dir", str(WORK / "decoder" / "teacher_trainer"),
         "--disable_tqdm", "true"])
    recipe.teacher_cache_dir = str(ROOT / recipe.teacher_cache_dir)
    text = recipe_mod.read_text(str(ROOT / recipe.train_file))
    return recipe_mod.train_teacher(recipe, text, args)


def decoder_section(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator

    from hf_distill import students
    from hf_distill.publish import measure

    recipe = load_module("recipe_causal_lm", ROOT / "recipes" / "causal_lm.py")
    teacher_path, teacher_training = decoder_teacher(recipe, a.decoder_teacher)
    log(f"decoder teacher: {teacher_path}")
    tok = AutoTokenizer.from_pretrained(teacher_path)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path).eval()
    data = ROOT.parent / "shared" / "data" / "wikitext2"
    train = recipe.blocks(recipe.read_text(str(data / "wiki.valid.raw")), tok, 128, None)
    train = train.select(range(min(a.decoder_train_blocks, len(train))))
    valid = recipe.blocks(recipe.read_text(str(data / "wiki.test.raw")), tok, 128, 64 if a.quick else 256)

    def ppl(model) -> float:
        return recipe.perplexity(model, valid)

    teacher_ppl = ppl(teacher)
    log(f"teacher perplexity {teacher_ppl:.2f}")
    bs = 16
    calibration = [default_data_collator([train[j] for j in range(i, i + bs)]) for i in range(0, 4 * bs, bs)]
    layers, heads, inter, hidden = (int(x) for x in a.decoder_shape.split(","))
    importance = students.width_importance(teacher, calibration)

    def prune():
        return students.prune_width(teacher, num_layers=layers, num_attention_heads=heads, intermediate_size=inter,
                                    hidden_size=hidden, importance=importance)

    student, pruning = prune()
    pruned_ppl = ppl(student)
    log(f"pruned {a.decoder_shape} (teacher blocks {pruning.layers}): perplexity {pruned_ppl:.2f}")
    points = points_of(a.decoder_points)
    settings = dict(learning_rate=a.decoder_lr, warmup_steps=a.decoder_warmup, per_device_train_batch_size=bs,
                    bf16=False, seed=42, kd_loss="jsd", jsd_beta=0.5, temperature=1.0, weights=(1.0, 1.0),
                    kd_chunk_size=a.kd_chunk_size)
    runs = {}
    for side in ("kd", "ce_only"):
        log(f"decoder {side}: {max(points)} steps")
        torch.manual_seed(42)
        runs[side] = train_curve(prune()[0], teacher, train, default_data_collator, tok, [p for p in points if p],
                                 ppl, kd=side == "kd", output_dir=str(WORK / "decoder" / side), **settings)
        runs[side]["points"].insert(0, {"step": 0, "value": pruned_ppl, "train_s": 0.0})
    tc = teacher.config
    return {"teacher": {"path": os.path.relpath(teacher_path, ROOT), "perplexity": teacher_ppl,
                        "params": measure.count_parameters(teacher), "training": teacher_training,
                        "shape": [tc.num_hidden_layers, tc.num_attention_heads, tc.num_key_value_heads,
                                  tc.intermediate_size, tc.hidden_size]},
            "shape": {"layers": layers, "heads": heads, "kv_heads": student.config.num_key_value_heads,
                      "intermediate": inter, "hidden": hidden}, "kept_layers": pruning.layers,
            "params": measure.count_parameters(student), "pruned_perplexity": pruned_ppl, "runs": runs,
            "train_blocks": len(train), "eval_blocks": len(valid), "block_size": 128, "batch": bs,
            "points": points, "quick": a.quick, "threads": torch.get_num_threads()}


# ----------------------------------------------------------------------------------------------- report


def value_at(run: dict, step: int) -> float:
    return next((p["value"] for p in run["points"] if p["step"] == step), float("nan"))


def curve_rows(sec: dict, kd: dict, other: dict, cells) -> list[str]:
    """One table row per step point: its label, then `cells(KD value, other run's value)` (the point's columns)."""
    rows = []
    for step in sec["points"]:
        label = f"{step} (pruned, no training)" if step == 0 else str(step)
        rows.append(f"| {label} | {cells(value_at(kd, step), value_at(other, step))} |")
    return rows


def baseline_check(sec: dict, run: dict, name: str, higher_is_better: bool, fmt) -> str:
    """Whether the run without the teacher beats its untrained start (step 0) at every point: where it does not, a
    KD / baseline comparison there says what the baseline lost, not what KD added (issue #39 case 14)."""
    start = value_at(run, 0)
    worse = [(s, value_at(run, s)) for s in sec["points"] if s and (
        value_at(run, s) < start if higher_is_better else value_at(run, s) > start)]
    if not worse:
        return f"Baseline check: {name} beats its untrained start ({fmt(start)}) at every point."
    return (f"Baseline check: {name} is WORSE than its untrained start ({fmt(start)}) at step(s) "
            + ", ".join(f"{s} ({fmt(v)})" for s, v in worse) + ": the KD comparison there overstates KD.")


def train_time(sec: dict, *sides: tuple[str, dict]) -> str:
    """Training seconds of each run (evaluations left out), the thread count and the section's wall time."""
    times = ", ".join(f"{name} {run['points'][-1]['train_s']:.0f} s" for name, run in sides)
    meta = sec.get("meta") or {}
    return (f"Training time ({max(sec['points'])} steps each, evaluations left out): {times}; "
            f"{sec['threads']} torch thread(s); the whole section {meta.get('seconds', 0) / 60:.1f} min.")


def encoder_lines(sec: dict) -> list[str]:
    t, kd, ft = sec["teacher"], sec["runs"]["kd"], sec["runs"]["fine_tune"]
    s = kd["args"]
    origin = " (the quality benchmark's: MiniLM-L6 fine-tuned 1 epoch)" if t.get("fine_tune") else ""
    how = (f"the timed shape nearest {sec['latency_target']:g} of the teacher's batch-1 latency"
           if sec.get("shape_choice") == "auto" else "given")
    lines = [f"Teacher: `{t['path']}`{origin}, "
             f"{t['params'] / 1e6:.2f} M parameters, {t['batch1_ms']:.1f} ms per row at batch 1. Student: "
             f"`prune_width` to **{sec['shape']}** ({how}; hidden {sec['hidden']}, teacher blocks "
             f"{sec['kept_layers']}), "
             f"{sec['params'] / 1e6:.2f} M parameters; importance from {sec['calibration_rows']} training rows "
             f"({sec['calibration_tokens']:,} tokens). {sec['train_rows']:,} training rows in the protocol's order, "
             f"batch {s['per_device_train_batch_size']}, lr {s['learning_rate']:g} constant after "
             f"{s['warmup_steps']} warm-up steps, bf16 {s['bf16']}, seed {s['seed']}; KD = "
             f"{s['kd_weight']:g} T^2 KL (T = {s['temperature']:g}) + {s['task_weight']:g} CE with the teacher online; "
             f"fine-tuning = CE alone. Accuracy on {sec['eval_rows']} validation rows, fp32.", "",
             "Batch-1 CPU latency of the pruned shapes (first 200 validation rows one at a time, median of "
             "interleaved passes against the teacher):", "",
             "| shape | hidden | params | teacher blocks kept | latency / teacher | speed-up |",
             "| --- | ---: | ---: | --- | ---: | ---: |"]
    for name, r in sec["latency"].items():
        mark = " (trained)" if name == sec["shape"] else ""
        lines.append(f"| {name}{mark} | {r['hidden']} | {r['params'] / 1e6:.2f} M | {r['kept_layers']} | "
                     f"{r['latency_ratio_b1']:.2f} | {r['speedup_b1']:.2f}x |")
    lines += ["", "| steps | KD accuracy | fine-tuning accuracy | KD - fine-tuning | KD % of teacher |",
              "| ---: | ---: | ---: | ---: | ---: |",
              f"| teacher | {t['accuracy']:.2%} | | | 100.0 |"]
    lines += curve_rows(sec, kd, ft, lambda k, f: f"{k:.2%} | {f:.2%} | {100 * (k - f):+.2f} pt | "
                        f"{100 * k / t['accuracy']:.1f}")
    lines += ["", baseline_check(sec, ft, "fine-tuning", True, lambda v: f"{v:.2%}"), "",
              train_time(sec, ("KD", kd), ("fine-tuning", ft)), ""]
    return lines


def decoder_lines(sec: dict) -> list[str]:
    t, kd, ce, sh = sec["teacher"], sec["runs"]["kd"], sec["runs"]["ce_only"], sec["shape"]
    s = kd["args"]
    layers, heads, kv, inter, hidden = t["shape"]
    lines = [f"Teacher: the causal-LM recipe's (`{t['path']}`, Llama {layers} layers, {heads} heads / {kv} KV heads, "
             f"MLP {inter}, hidden {hidden}), {t['params'] / 1e6:.2f} M parameters. Student: `prune_width` in width "
             f"and depth to {sh['layers']} layers (teacher blocks {sec['kept_layers']}), {sh['heads']} heads / "
             f"{sh['kv_heads']} KV heads, MLP {sh['intermediate']}, hidden {sh['hidden']}: "
             f"{sec['params'] / 1e6:.2f} M parameters. Trained on the recipe's first {sec['train_blocks']} blocks "
             f"of {sec['block_size']} tokens of wiki.valid.raw (batch {s['per_device_train_batch_size']}: "
             f"{sec['train_blocks'] // s['per_device_train_batch_size']} steps an epoch), lr {s['learning_rate']:g} "
             f"constant after {s['warmup_steps']} warm-up steps, fp32, seed {s['seed']}; KD = {s['kd_weight']:g} "
             f"JSD (beta {s['jsd_beta']:g}, T = {s['temperature']:g}) + {s['task_weight']:g} CE through the loss head "
             f"(kd_chunk_size {s['kd_chunk_size']}); CE only = the same without the teacher. Perplexity on the first "
             f"{sec['eval_blocks']} blocks of wiki.test.raw.", "",
             "| steps | KD perplexity | CE-only perplexity | KD / CE-only | KD / teacher |",
             "| ---: | ---: | ---: | ---: | ---: |", f"| teacher | {t['perplexity']:.2f} | | | 1.000 |"]
    lines += curve_rows(sec, kd, ce, lambda k, c: f"{k:.2f} | {c:.2f} | {k / c:.3f} | {k / t['perplexity']:.3f}")
    lines += ["", baseline_check(sec, ce, "CE only", False, lambda v: f"{v:.2f}"), "",
              train_time(sec, ("KD", kd), ("CE only", ce)), ""]
    return lines


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [n for n in SECTIONS if data.get(n)]
    if not present:
        return
    fig, axes = plt.subplots(1, len(present), figsize=(6.0 * len(present), 4.2), squeeze=False)
    for ax, name in zip(axes[0], present):
        sec = data[name]
        if name == "encoder":
            sides, scale, ref = (("kd", "KD (0.5 CE + 0.5 KL)"), ("fine_tune", "fine-tuning (CE)")), 100, \
                100 * sec["teacher"]["accuracy"]
            ax.set_ylabel("SST-2 validation accuracy (%)")
            ax.set_title(f"SST-2: MiniLM-L6 pruned to {sec['shape']}")
        else:
            sides, scale, ref = (("kd", "KD (JSD + CE)"), ("ce_only", "CE only")), 1, sec["teacher"]["perplexity"]
            ax.set_ylabel("held-out perplexity (log scale)")
            ax.set_yscale("log")
            sh = sec["shape"]
            ax.set_title(f"WikiText-2: Llama teacher pruned to {sh['layers']}L, hidden {sh['hidden']}")
        for side, label in sides:
            pts = sec["runs"][side]["points"]
            ax.plot([p["step"] for p in pts], [scale * p["value"] for p in pts], marker="o", label=label)
        ax.axhline(ref, color="black", linestyle="--", label="teacher")
        linthresh = max(1, min(p for p in sec["points"] if p))
        ax.set_xscale("symlog", linthresh=linthresh)
        ax.set_xlim(-0.3 * linthresh, 1.1 * max(sec["points"]))
        ax.set_xticks(sec["points"], [str(p) for p in sec["points"]])
        ax.set_xlabel("training steps (0 = right after pruning)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(data: dict, folder: Path, stem: str) -> None:
    data = sections.portable_tree(data)  # no machine's absolute path in a results file
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    lines = ["# Pruning + distillation recovery (issue #33 items 3 and 4)", "",
             f"Written by `benchmarks/prune_recover.py`; see its docstring for the method. Machine: {data['machine']}.",
             ""]
    for name, sec, heading in sections.sections_with_headings(data, SECTIONS, minutes=True):
        lines += heading + (encoder_lines(sec) if name == "encoder" else decoder_lines(sec))
    (folder / f"{stem}.md").write_text("\n".join(lines) + "\n")
    plot(data, folder / f"{stem}.png")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections: encoder, decoder")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--report-only", action="store_true", help="only rewrite the .md and .png from the .json")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: fewer rows/blocks; results go to benchmarks/.cache/quick/ instead")
    p.add_argument("--repeats", type=int, default=5, help="encoder: interleaved passes of the latency timing")
    p.add_argument("--calibration-batches", type=int, default=16, help="encoder: batches of 32 training rows")
    p.add_argument("--encoder-teacher", default=None,
                   help="encoder: a fine-tuned SST-2 teacher folder (default: the quality benchmark's)")
    p.add_argument("--encoder-shape", default="auto",
                   help="encoder: layers,heads,MLP channels to train, or auto: the timed shape whose batch-1 latency / "
                   "the teacher's is nearest --latency-target")
    p.add_argument("--latency-target", type=float, default=0.5,
                   help="encoder: latency / teacher's for --encoder-shape auto")
    p.add_argument("--encoder-points", default="0,50,100,200,400,800", help="encoder: steps evaluated")
    p.add_argument("--encoder-lr", type=float, default=1e-4)
    p.add_argument("--encoder-warmup", type=int, default=25)
    p.add_argument("--fp32", action="store_true", help="encoder: train in fp32 (default: bf16 autocast)")
    p.add_argument("--decoder-teacher", default=None, help="decoder: teacher folder (default: the recipe's)")
    p.add_argument("--decoder-shape", default="4,2,384,192", help="decoder: layers,heads,MLP channels,hidden")
    p.add_argument("--decoder-points", default="0,15,30,60,120,240,480", help="decoder: steps evaluated")
    p.add_argument("--decoder-train-blocks", type=int, default=480, help="decoder: the recipe's distillation set")
    p.add_argument("--decoder-lr", type=float, default=1e-3)
    p.add_argument("--decoder-warmup", type=int, default=10)
    p.add_argument("--kd-chunk-size", type=int, default=512, help="decoder: tokens per chunk of the loss head")
    a = p.parse_args()
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        p.error(f"--only: unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(a.threads)
    folder, stem = (HERE / ".cache" / "quick", "prune_recover") if a.quick else (RESULTS, "prune_recover")
    path = folder / f"{stem}.json"
    machine = sections.machine()
    if a.report_only:
        write_report(json.loads(path.read_text()), folder, stem)
        print((folder / f"{stem}.md").read_text())
        return
    for name in only:
        with sections.section_record("benchmarks/prune_recover.py") as meta:
            sec = encoder_section(a) if name == "encoder" else decoder_section(a)
        sec["meta"] = meta
        data = {**(json.loads(path.read_text()) if path.is_file() else {}), "machine": machine, name: sec}
        write_report(data, folder, stem)
    print((folder / f"{stem}.md").read_text())
    if any(math.isnan(value_at(r, s)) for n in only for r in data[n]["runs"].values() for s in data[n]["points"]):
        raise SystemExit("some points were not evaluated (see the table)")


if __name__ == "__main__":
    main()
