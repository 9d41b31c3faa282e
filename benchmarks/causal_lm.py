"""Causal-LM distillation: quality, memory of chunked logits, speed against TRL's GKD (issue #14). Not part of CI.

    python benchmarks/causal_lm.py                          # all sections
    python benchmarks/causal_lm.py --only memory,trl        # some of them (quality, memory, trl, signal, sft,
                                                            # onpolicy, methods)

- quality: teacher, KD student and CE-only student perplexities on held-out text, from `recipes/causal_lm.py`
  with `recipes/configs/causal_lm_wikitext.yaml` (run unless `benchmarks/runs/causal_lm/results.json` exists, or
  with `--force`);
- memory: peak memory of ONE KD step (teacher forward + student forward/backward, `kd_loss=jsd`) with and without
  `kd_chunk_size` (naive = whole logits, the trainer's path where chunking is impossible), at V = 32,000 and
  128,256, tiny Llama models (hidden 64, 2 layers), 4 x 1,024 tokens; each case in a fresh process, peak RSS
  (ru_maxrss) minus the RSS just before the step;
- trl: `DistillationTrainer(kd_loss=jsd, jsd_beta=0.5)` vs TRL's `GKDTrainer(lmbda=0, beta=0.5)` (off-policy, same
  loss, T = 1) on the recipe's teacher and pruned student and the same batches: median s/step after warm-up and
  peak RSS of the training, each side in its own process, alternated in pairs;
- signal (issue #31): the offline teacher signal (`hf_distill.data.teacher_signal`) of the recipe's teacher over the
  recipe's 480 training blocks at k = 8, 64 and 256 (teacher tokens/s while creating it, bytes per token), then the
  recipe's pruned student trained `--signal-steps` steps (batch 8, JSD beta 0.5 + CE, T = 1, seed 0) five ways:
  from each signal (no teacher), with the online teacher on the same top-k + tail objective (each step's teacher
  logits -> float32 top-k + exact tail, not stored: the signal run's per-step KD loss and perplexity are compared
  with it), and with the online teacher on the dense JSD (the ordinary run: perplexity "dense", step time). Step
  times as in `trl`; the floor is 1 - the teacher forward's share of the dense online step (hooks on the teacher).
- sft (issue #32): `DistillationSFTTrainer` (unpacked and packed) vs TRL's `GKDTrainer(lmbda=0)` on the same
  prompt/completion rows and batches (benchmarks/causal_lm_sft.py says how).
- onpolicy (issue #32): fully on-policy (lmbda = 1) `DistillationTrainer` and `DistillationSFTTrainer` vs TRL 1.16's
  `DistillationTrainer` on the same prompts, greedy by default (benchmarks/causal_lm_onpolicy.py says how).
- methods (issue #32): the recipe's pruned student trained from its teacher with CE only, forward KL, reverse KL,
  JSD 0.5, skew KL 0.1, on-policy (lmbda 0.5), seq-KD and, with a tokenizer of its own, CE only, ULD and aligned
  KD; `--methods-seeds` seeds each, interleaved; held-out bits per character (comparable across tokenizers) and
  token perplexity, and train time relative to CE only (`benchmarks/causal_lm_methods.py` says how).

Writes `benchmarks/results/causal_lm.{json,md}`; sections not run keep their previous results.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import sections  # noqa: E402  (how a section ran, the report's section headings)

ROOT = HERE.parent
RESULTS = HERE / "results"
RUN_DIR = HERE / "runs" / "causal_lm"
CONFIG = ROOT / "recipes" / "configs" / "causal_lm_wikitext.yaml"
SECTIONS = ("quality", "memory", "trl", "signal", "sft", "onpolicy", "methods")
VOCABS = (32_000, 128_256)
DEFAULT = -1  # a memory case run with kd_chunk_size unset: the library default for its vocabulary
TARGETS = {"chunked_over_naive_peak_128k": 0.35, "ours_over_trl_step_time": 1.0, "ours_over_trl_peak_rss": 1.0,
           "signal_kd_loss_abs": 1e-3, "signal_perplexity_rel": 5e-3, "signal_over_online_step_above_floor": 0.02,
           "signal_bytes_per_token_k64": 300}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child_env() -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_child(*args: str, timeout: int = 1200) -> dict:
    try:
        proc = subprocess.run([sys.executable, __file__, *args], cwd=ROOT, env=child_env(), capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped at the {timeout} s time limit", "returncode": None}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1], "returncode": proc.returncode}
    return json.loads(lines[-1][len("RESULT "):])


# ---------------------------------------------------------------------------------------------- quality


def quality(force: bool) -> dict:
    results = RUN_DIR / "results.json"
    command = [sys.executable, "recipes/causal_lm.py", "--config", str(CONFIG.relative_to(ROOT)),
               "--output_dir", str(RUN_DIR.relative_to(ROOT)), "--disable_tqdm", "true"]
    if force or not results.is_file():
        subprocess.run(command, cwd=ROOT, env=child_env(), check=True)
    r = json.loads(results.read_text())
    return {
        "command": r["command"], "teacher_perplexity": r["teacher_perplexity"], "kd_perplexity": r["perplexity"],
        "ce_only_perplexity": r["baseline_perplexity"], "kd_over_ce_only": r["kd_over_baseline_perplexity"],
        "teacher_params": r["teacher_params"], "student_params": r["params"], "kept_blocks": r["kept_blocks"],
        "train_blocks": r["train_blocks"], "eval_blocks": r["eval_blocks"], "block_size": r["block_size"],
        "steps": r["train_steps"], "kd_train_s": r["train_runtime_s"], "ce_train_s": r.get("baseline_train_runtime_s"),
        "wall_s": r["wall_s"], "teacher_training": r.get("teacher_training"), "eval_file": r["eval_file"],
        "train_file": r["train_file"],
    }


# ----------------------------------------------------------------------------------------------- memory


def tiny_llama(vocab: int, seed: int, layers: int = 2, hidden: int = 64):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=1024, tie_word_embeddings=True))


def memory_child(vocab: int, chunk: int | None, batch: int, seq: int) -> dict:
    """One KD step (Trainer.training_step: teacher forward, student forward, loss, backward) in this process."""
    import torch

    from hf_distill import DistillationArguments, DistillationTrainer

    torch.set_num_threads(2)
    teacher, student = tiny_llama(vocab, 0), tiny_llama(vocab, 1)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    args = DistillationArguments(output_dir="/tmp/hf_distill_causal_mem", kd_loss="jsd", jsd_beta=0.5,
                                 temperature=1.0, kd_weight=1.0, task_weight=1.0, use_cpu=True, report_to="none",
                                 per_device_train_batch_size=batch,
                                 kd_chunk_size=None if chunk in (None, DEFAULT) else chunk)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args)
    trainer.current_gradient_accumulation_steps = 1  # set by train(); training_step divides by it
    if chunk is None:
        # kd_chunk_size unset means "chunk where possible"; the naive path is the trainer with whole logits, which
        # it takes wherever chunking is impossible: forced here through its private switch.
        trainer.distiller._chunk = None
    elif chunk == DEFAULT:
        from hf_distill.losses import chunked

        chunk = chunked.default_chunk(vocab)
    assert trainer.distiller._chunk == chunk, (trainer.distiller._chunk, chunk)
    before = rss_mb()
    peak_before = peak_mb()
    t0 = time.perf_counter()
    loss = trainer.training_step(student, inputs)
    seconds = time.perf_counter() - t0
    peak = peak_mb()
    return {"vocab": vocab, "kd_chunk_size": chunk, "tokens": batch * seq, "rss_before_mb": before,
            "peak_mb": peak, "peak_before_step_mb": peak_before, "step_peak_mb": peak - before,
            "loss": float(loss), "step_s": seconds}


def memory(batch: int, seq: int, cases: list[tuple[int, int | None]], previous: dict | None) -> dict:
    """Each (V, chunk) case in a fresh process; rows of earlier runs at the same tokens are kept for other cases."""
    tokens = batch * seq
    def case(r):
        return r["vocab"], DEFAULT if r.get("default_chunk") else r["kd_chunk_size"]

    # rows of the current loss head only (they record `default_chunk`), at the same tokens, of other cases
    rows = [r for r in (previous or {}).get("rows", []) if r.get("tokens", tokens) == tokens and case(r) not in cases
            and "default_chunk" in r]
    for vocab, chunk in cases:
        r = run_child("--memory-child", str(vocab), str(chunk or 0), str(batch), str(seq))
        r.update(vocab=vocab, tokens=tokens, load=os.getloadavg(), default_chunk=chunk == DEFAULT,
                 date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        rows.append(r)
        print("memory", json.dumps(r), flush=True)
    rows.sort(key=lambda r: (r["vocab"], r["kd_chunk_size"] or 0))
    ratios = {}
    for vocab in VOCABS:
        found = {case(r)[1]: r for r in rows if r["vocab"] == vocab and "step_peak_mb" in r}
        if None in found and DEFAULT in found:
            ratios[str(vocab)] = found[DEFAULT]["step_peak_mb"] / found[None]["step_peak_mb"]
    return {"rows": rows, "chunked_over_naive": ratios, "batch": batch, "seq": seq, "hidden": 64, "layers": 2}


# -------------------------------------------------------------------------------------------------- trl


def trl_child(side: str, teacher_path: str, kept: list[int], blocks: int, batch: int, steps: int, warmup: int) -> dict:
    """Train the pruned student `steps` steps with one side's trainer; per-step times from a callback."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator

    sys.path.insert(0, str(ROOT / "recipes"))
    from causal_lm import blocks as make_blocks

    from hf_distill import students

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(teacher_path)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path)
    student = students.from_teacher(teacher, kept)
    text = (ROOT.parent / "shared" / "data" / "wikitext2" / "wiki.valid.raw").read_text(encoding="utf-8")
    train = make_blocks(text, tok, 128, blocks)
    times: list[float] = []
    common = sections.cpu_train_args(f"trl_{side}", steps, batch, logging_steps=10_000)
    if side == "ours":
        from hf_distill import DistillationArguments, DistillationTrainer

        args = DistillationArguments(kd_loss="jsd", jsd_beta=0.5, temperature=1.0, kd_weight=1.0, task_weight=0.0,
                                     **common)
        trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=train,
                                      data_collator=default_data_collator, processing_class=tok,
                                      callbacks=[sections.step_clock(times)])
    else:
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        args = GKDConfig(lmbda=0.0, beta=0.5, temperature=1.0, seq_kd=False, max_length=128, **common)
        trainer = GKDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=train,
                             data_collator=default_data_collator, processing_class=tok,
                             callbacks=[sections.step_clock(times)])
    before = rss_mb()
    out = trainer.train()
    return {"side": side, "step_s": statistics.median(times[warmup:]), "times": times,
            "peak_rss_mb": peak_mb() - before, "rss_before_mb": before, "train_loss": out.training_loss}


def trl_section(pairs: int, steps: int, warmup: int, batch: int, teacher: str | None, kept: list[int] | None) -> dict:
    import importlib.metadata as md

    if teacher is None:
        r = json.loads((RUN_DIR / "results.json").read_text())
        teacher, kept = r["teacher"], r["kept_blocks"]
    runs = []
    for i in range(pairs):
        order = ("ours", "trl") if i % 2 == 0 else ("trl", "ours")
        for side in order:
            res = run_child("--trl-child", side, teacher, ",".join(map(str, kept)), str(steps * batch), str(batch),
                            str(steps), str(warmup))
            res.update(side=side, pair=i, load=os.getloadavg())
            runs.append(res)
            print("trl", json.dumps({k: v for k, v in res.items() if k != "times"}), flush=True)
    summary = {}
    for side in ("ours", "trl"):
        ok = [x for x in runs if x["side"] == side and "step_s" in x]
        if ok:
            summary[side] = {"median_step_s": statistics.median(x["step_s"] for x in ok),
                             "median_peak_rss_mb": statistics.median(x["peak_rss_mb"] for x in ok)}
    ratios = {}
    if len(summary) == 2:
        ratios = {"step_time": summary["ours"]["median_step_s"] / summary["trl"]["median_step_s"],
                  "peak_rss": summary["ours"]["median_peak_rss_mb"] / summary["trl"]["median_peak_rss_mb"]}
    return {"runs": runs, "summary": summary, "ours_over_trl": ratios, "teacher": teacher, "kept_blocks": kept,
            "batch": batch, "seq": 128, "steps": steps, "warmup": warmup, "pairs": pairs,
            "versions": {p: md.version(p) for p in ("trl", "transformers", "torch")}}


# ----------------------------------------------------------------------------------------------- signal


def _online_topk(distiller, k: int) -> None:
    """Make `distiller` (a DistillationTrainer's) compare the student with the online teacher's top-k + tail at each
    step, the objective a signal run trains on, in float32 and with the tail's exact logsumexp (nothing stored)."""
    import torch

    class OnlineTopK(type(distiller)):
        def _first_teacher(self, inputs, cached, hidden_only):
            out, _ = self.run_teacher(self.teacher, inputs)
            log_p = torch.log_softmax(out.logits.float() / self.args.temperature, -1)
            values, ids = log_p.topk(k, dim=-1)
            return [(values, ids, log_p.scatter(-1, ids, float("-inf")).logsumexp(-1))], None, None

    distiller.__class__ = OnlineTopK


def signal_section(teacher_path: str | None, kept: list[int] | None, steps: int, batch: int, ks: list[int],
                   k_main: int, warmup: int) -> dict:
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, default_data_collator

    sys.path.insert(0, str(ROOT / "recipes"))
    from causal_lm import blocks as make_blocks
    from causal_lm import perplexity

    from hf_distill import DistillationArguments, DistillationTrainer, students
    from hf_distill.data.teacher_signal import attach_teacher_signal, create_teacher_signal, signal_metadata

    if teacher_path is None:
        r = json.loads((RUN_DIR / "results.json").read_text())
        teacher_path, kept = r["teacher"], r["kept_blocks"]
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(teacher_path)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path).eval()
    data = ROOT.parent / "shared" / "data" / "wikitext2"
    train = make_blocks((data / "wiki.valid.raw").read_text(encoding="utf-8"), tok, 128, steps * batch)
    valid = make_blocks((data / "wiki.test.raw").read_text(encoding="utf-8"), tok, 128, 256)
    work = HERE / ".cache" / "signal"
    signals, runs = {}, {}
    shutil.rmtree(work / "warmup", ignore_errors=True)  # first-call costs (the first forwards, Arrow writers): untimed
    create_teacher_signal(teacher, train.select(range(batch)), work / "warmup", tokenizer=tok, k=min(ks),
                          batch_size=batch, progress=False)
    for k in ks:
        shutil.rmtree(work / f"k{k}", ignore_errors=True)
        t0 = time.perf_counter()
        signal = create_teacher_signal(teacher, train, work / f"k{k}", tokenizer=tok, k=k, temperature=1.0,
                                       batch_size=batch, progress=False)
        seconds = time.perf_counter() - t0
        meta = signal_metadata(signal)
        signals[k] = {"create_s": seconds, "teacher_tokens_per_s": len(train) * 128 / seconds,
                      "positions": meta["positions"], "bytes_per_token": meta["bytes_per_token"],
                      "payload_bytes_per_token": meta["payload_bytes_per_token"]}
        print("signal", k, json.dumps(signals[k]), flush=True)
        signals[k]["rows"] = attach_teacher_signal(train, signal)

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.teacher_s = [], []

        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.fwd = time.perf_counter(), 0.0

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)
            self.teacher_s.append(self.fwd)

    def run(name: str, k: int | None, online: bool) -> None:
        clock = Clock()
        hooks = []
        if online:  # the teacher forward's time in each step
            hooks = [teacher.register_forward_pre_hook(lambda *_: setattr(clock, "f0", time.perf_counter())),
                     teacher.register_forward_hook(lambda *_: setattr(clock, "fwd", clock.fwd + time.perf_counter()
                                                                      - clock.f0))]
        args = DistillationArguments(
            output_dir=str(work / "out" / name), max_steps=steps, per_device_train_batch_size=batch,
            learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=0.05, logging_steps=1, save_strategy="no",
            report_to="none", use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0, kd_loss="jsd",
            jsd_beta=0.5, temperature=1.0, kd_weight=1.0, task_weight=1.0)
        rows = signals[k]["rows"] if not online else train
        trainer = DistillationTrainer(model=students.from_teacher(teacher, kept), teacher_model=teacher if online
                                      else None, args=args, train_dataset=rows, data_collator=default_data_collator,
                                      processing_class=tok, callbacks=[clock])
        if online and k is not None:
            _online_topk(trainer.distiller, k)
        trainer.train()
        for h in hooks:
            h.remove()
        runs[name] = {"k": k, "online": online, "step_s": statistics.median(clock.times[warmup:]),
                      "teacher_forward_s": statistics.median(clock.teacher_s[warmup:]), "times": clock.times,
                      "kd_loss": [r["loss_kd"] for r in trainer.state.log_history if "loss_kd" in r],
                      "perplexity": perplexity(trainer.model, valid)}
        print("signal run", name, json.dumps({x: v for x, v in runs[name].items() if x not in ("times", "kd_loss")}),
              flush=True)

    run("online_dense", None, True)
    run(f"online_topk{k_main}", k_main, True)
    for k in ks:
        run(f"signal_k{k}", k, False)
    sig, ref, dense = runs[f"signal_k{k_main}"], runs[f"online_topk{k_main}"], runs["online_dense"]
    diffs = [abs(a - b) for a, b in zip(sig["kd_loss"], ref["kd_loss"], strict=True)]
    summary = {
        "kd_loss_max_abs_diff": max(diffs), "kd_loss_first_step_abs_diff": diffs[0],
        "perplexity_rel_diff": sig["perplexity"] / ref["perplexity"] - 1,
        "signal_over_online_dense_step": sig["step_s"] / dense["step_s"],
        "signal_over_online_topk_step": sig["step_s"] / ref["step_s"],
        "floor": 1 - dense["teacher_forward_s"] / dense["step_s"],
        "perplexity_over_dense": {str(k): runs[f"signal_k{k}"]["perplexity"] / dense["perplexity"] for k in ks},
    }
    for k in ks:
        del signals[k]["rows"]
    return {"signals": {str(k): v for k, v in signals.items()}, "runs": runs, "summary": summary,
            "teacher": teacher_path, "kept_blocks": kept, "steps": steps, "batch": batch, "seq": 128,
            "train_blocks": len(train), "eval_blocks": len(valid), "k": k_main, "ks": ks, "warmup": warmup}


# ----------------------------------------------------------------------------------------------- report


def signal_lines(sec: dict) -> list[str]:
    """The signal section's tables and verdicts (markdown lines)."""
    sm, t = sec["summary"], TARGETS
    km = str(sec["k"])

    def verdict(ok):
        return "met" if ok else "not met"

    ok_loss = verdict(sm["kd_loss_max_abs_diff"] <= t["signal_kd_loss_abs"])
    ok_ppl = verdict(abs(sm["perplexity_rel_diff"]) <= t["signal_perplexity_rel"])
    above = sm["signal_over_online_dense_step"] - sm["floor"]
    ok_step = verdict(above <= t["signal_over_online_step_above_floor"])

    lines = [f"Recipe teacher ({sec['teacher']}), student = its blocks {sec['kept_blocks']}; "
             f"{sec['steps']} steps of {sec['batch']} x {sec['seq']} tokens over the first "
             f"{sec['train_blocks']} blocks of wiki.valid.raw (one epoch), JSD beta 0.5 + CE, T = 1, cosine "
             f"LR 1e-3, seed 0; perplexity on the first {sec['eval_blocks']} blocks of wiki.test.raw; median "
             f"s/step after {sec['warmup']} warm-up steps.", "",
             "| signal k | bytes / token (files) | payload bytes / token | teacher tokens/s creating | "
             "create s |", "| ---: | ---: | ---: | ---: | ---: |"]
    for k, v in sec["signals"].items():
        lines.append(f"| {k} | {v['bytes_per_token']:.1f} | {v['payload_bytes_per_token']:.1f} | "
                     f"{v['teacher_tokens_per_s']:,.0f} | {v['create_s']:.1f} |")
    lines += ["", "| run | teacher | held-out perplexity | median s/step |", "| --- | --- | ---: | ---: |"]
    for n, r in sec["runs"].items():
        source = ("online, dense JSD" if r["k"] is None else f"online, top-{r['k']} + tail") if r["online"] \
            else f"signal, k = {r['k']}"
        lines.append(f"| {n} | {source} | {r['perplexity']:.2f} | {r['step_s']:.3f} |")
    lines += ["", f"Signal (k = {km}) vs online top-{km} + tail, same objective: per-step KD loss max |diff| "
              f"**{sm['kd_loss_max_abs_diff']:.2e}** (first step {sm['kd_loss_first_step_abs_diff']:.2e}; "
              f"target <= {t['signal_kd_loss_abs']}: {ok_loss}), "
              f"perplexity {sm['perplexity_rel_diff']:+.3%} (target within 0.5%: "
              f"{ok_ppl}).", "",
              f"Step time signal / online dense **{sm['signal_over_online_dense_step']:.3f}** (floor "
              f"{sm['floor']:.3f} = 1 - the teacher forward's share; target <= floor + 0.02: "
              f"{ok_step}); "
              f"signal / online top-k **{sm['signal_over_online_topk_step']:.3f}**. Bytes per token at k = 64: "
              f"{sec['signals'].get('64', {}).get('bytes_per_token', float('nan')):.1f} (target <= 300).", "",
              "Perplexity / dense online run: " + ", ".join(
                  f"k = {k}: **{v:.4f}**" for k, v in sm["perplexity_over_dense"].items()) + ".", ""]
    return lines


def write_report(data: dict) -> None:
    data = sections.portable_tree(data)  # no machine's absolute path in a results file
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "causal_lm.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    lines = ["# Causal-LM distillation (issue #14)", "",
             f"Written by `benchmarks/causal_lm.py`; see its docstring for the method. Machine: {data['machine']}.", ""]
    for name, sec, heading in sections.sections_with_headings(data, SECTIONS):
        lines += heading
        if name == "quality":
            lines += ["| model | params | held-out perplexity |", "| --- | ---: | ---: |",
                      f"| teacher | {sec['teacher_params']:,} | {sec['teacher_perplexity']:.2f} |",
                      f"| KD student (JSD beta 0.5 + CE) | {sec['student_params']:,} | {sec['kd_perplexity']:.2f} |",
                      f"| CE-only student | {sec['student_params']:,} | {sec['ce_only_perplexity']:.2f} |", "",
                      f"KD / CE-only perplexity: **{sec['kd_over_ce_only']:.3f}**. Student = teacher blocks "
                      f"{sec['kept_blocks']}; {sec['steps']} steps each on {sec['train_blocks']} blocks of "
                      f"{sec['block_size']} tokens of `{sec['train_file']}`; perplexity on the first "
                      f"{sec['eval_blocks']} blocks of `{sec['eval_file']}`. Recipe: `{sec['command']}`.", ""]
        elif name == "memory":
            lines += [f"One KD step (jsd + CE), tiny Llama (hidden 64, 2 layers), {sec['batch']} x {sec['seq']} "
                      "tokens, fp32; step peak = ru_maxrss after the step minus RSS before it, fresh process each.",
                      "", "| V | kd_chunk_size | step peak MiB | step s |", "| ---: | ---: | ---: | ---: |"]
            for r in sec["rows"]:
                peak = f"{r['step_peak_mb']:.0f}" if "step_peak_mb" in r else f"failed: {r.get('error')}"
                step = f"{r['step_s']:.2f}" if "step_s" in r else ""
                lines.append(f"| {r['vocab']:,} | {r['kd_chunk_size'] or 'off'} | {peak} | {step} |")
            for v, ratio in sec["chunked_over_naive"].items():
                target = f" (target <= {TARGETS['chunked_over_naive_peak_128k']}: " \
                         f"{'met' if ratio <= TARGETS['chunked_over_naive_peak_128k'] else 'not met'})" \
                    if v == "128256" else ""
                lines.append(f"\nchunked / naive step peak at V = {int(v):,}: **{ratio:.3f}**{target}")
            lines.append("")
        elif name == "trl":
            lines += [f"Same teacher ({sec['teacher']}), student (blocks {sec['kept_blocks']}), batches "
                      f"({sec['batch']} x {sec['seq']} tokens), `max_steps={sec['steps']}`, median s/step after "
                      f"{sec['warmup']} warm-up steps; {sec['pairs']} alternated process pairs. Versions: "
                      f"{sec['versions']}.", "", "| side | median s/step | median peak RSS MiB |",
                      "| --- | ---: | ---: |"]
            for side, s in sec["summary"].items():
                lines.append(f"| {side} | {s['median_step_s']:.3f} | {s['median_peak_rss_mb']:.0f} |")
            for r in sec["runs"]:
                if "error" in r:
                    lines.append(f"\n{r['side']} failed: `{r['error']}`")
            if sec["ours_over_trl"]:
                st, pm = sec["ours_over_trl"]["step_time"], sec["ours_over_trl"]["peak_rss"]
                lines += ["", f"ours / TRL: step time **{st:.3f}** (target <= 1: {'met' if st <= 1 else 'not met'}), "
                          f"peak RSS **{pm:.3f}** (target < 1: {'met' if pm < 1 else 'not met'})."]
            lines.append("")
        elif name == "signal":
            lines += signal_lines(sec)
        elif name == "sft":
            from causal_lm_sft import sft_lines

            lines += sft_lines(sec)
        elif name == "onpolicy":
            from causal_lm_onpolicy import onpolicy_lines

            lines += onpolicy_lines(sec)
        elif name == "methods":
            from causal_lm_methods import methods_lines

            lines += methods_lines(sec)
    (RESULTS / "causal_lm.md").write_text("\n".join(lines) + "\n")


def run_section(name: str, a: argparse.Namespace, p: argparse.ArgumentParser, data: dict) -> dict:
    """The results of one section, run as the command line `a` says (`data`: the results file so far)."""
    if name == "quality":
        return quality(a.force)
    if name == "memory":
        cases = [(int(v), int(c) or None) for v, c in (x.split(":") for x in a.cases.split(","))]
        return memory(a.batch, a.seq, cases, data.get("memory"))
    if name == "signal":
        kept = [int(k) for k in a.signal_kept.split(",")] if a.signal_kept else None
        ks = [int(k) for k in a.signal_ks.split(",")]
        if a.signal_k not in ks:
            p.error(f"--signal-k {a.signal_k} must be one of --signal-ks {a.signal_ks}")
        return signal_section(a.signal_teacher, kept, a.signal_steps, 8, ks, a.signal_k, a.warmup)
    if name == "sft":
        from causal_lm_sft import sft_section

        teacher, kept = a.sft_teacher, [int(k) for k in a.sft_kept.split(",")] if a.sft_kept else None
        if teacher is None:
            r = json.loads((RUN_DIR / "results.json").read_text())
            teacher, kept = r["teacher"], kept or r["kept_blocks"]
        return sft_section(run_child, a.pairs, a.steps, a.warmup, 8, teacher, kept)
    if name == "onpolicy":
        from causal_lm_onpolicy import onpolicy_section

        teacher = a.onpolicy_teacher
        kept = [int(k) for k in a.onpolicy_kept.split(",")] if a.onpolicy_kept else None
        if teacher is None:
            r = json.loads((RUN_DIR / "results.json").read_text())
            teacher, kept = r["teacher"], kept or r["kept_blocks"]
        return onpolicy_section(run_child, a.pairs, a.steps, a.warmup, 8, teacher, kept, a.max_new_tokens,
                                a.onpolicy_sample)
    if name == "methods":
        from causal_lm_methods import DEFAULT_VARIANTS, PROGRESS, methods_section, section_from

        if a.methods_from_progress:  # a section stopped before its end: report the runs it finished
            return section_from(json.loads((HERE / ".cache" / "methods" / PROGRESS).read_text()))

        if a.methods_teacher is None:
            r = json.loads((RUN_DIR / "results.json").read_text())
        else:  # a given teacher (e.g. the recipe's cached one) and the recipe's files, without the recipe's run
            import yaml

            r = {**yaml.safe_load(CONFIG.read_text()), "teacher": a.methods_teacher}
        kept = [int(k) for k in a.methods_kept.split(",")] if a.methods_kept else r.get("kept_blocks")
        if kept is None:
            p.error("--methods-teacher needs --methods-kept (the teacher blocks the student keeps, e.g. 0,1,5)")
        return methods_section(r["teacher"], kept, r["train_file"], r["eval_file"],
                               seeds=a.methods_seeds, steps=a.methods_steps, batch=a.methods_batch,
                               half=a.methods_half, eval_tokens=a.methods_eval_tokens,
                               variants=a.methods_variants.split(",") if a.methods_variants else DEFAULT_VARIANTS,
                               work=HERE / ".cache" / "methods", threads=a.methods_threads, lr=a.methods_lr,
                               warmup=a.methods_warmup)
    kept = [int(k) for k in a.trl_kept.split(",")] if a.trl_kept else None  # trl
    return trl_section(a.pairs, a.steps, a.warmup, 8, a.trl_teacher, kept)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(SECTIONS),
                   help="comma-separated sections: quality, memory, trl, signal, sft, onpolicy, methods")
    p.add_argument("--force", action="store_true", help="quality: rerun the recipe even if results exist")
    p.add_argument("--batch", type=int, default=4, help="memory: sequences per step")
    p.add_argument("--seq", type=int, default=1024, help="memory: tokens per sequence")
    p.add_argument("--pairs", type=int, default=3,
                   help="trl: alternated process pairs; sft, onpolicy: rounds of one process per side")
    p.add_argument("--steps", type=int, default=8, help="trl, sft, onpolicy: steps per process")
    p.add_argument("--warmup", type=int, default=2, help="trl, sft, signal, onpolicy: steps left out of the median")
    p.add_argument("--cases", default=",".join(f"{v}:{c}" for v in VOCABS for c in (0, DEFAULT)),
                   help="memory: V:chunk cases to run (chunk 0 = whole logits, -1 = the library's default for V); "
                        "other cases keep earlier rows")
    p.add_argument("--trl-teacher", default=None, help="trl: teacher folder (default: the recipe run's teacher)")
    p.add_argument("--trl-kept", default=None, help="trl: teacher blocks the student keeps, e.g. 0,2,4")
    p.add_argument("--signal-teacher", default=None, help="signal: teacher folder (default: the recipe run's)")
    p.add_argument("--signal-kept", default=None, help="signal: teacher blocks the student keeps, e.g. 0,1,5")
    p.add_argument("--signal-steps", type=int, default=60, help="signal: steps per run (batch 8: 8 x steps blocks)")
    p.add_argument("--signal-ks", default="8,64,256", help="signal: the k of each signal")
    p.add_argument("--signal-k", type=int, default=64, help="signal: the k compared with the online top-k run")
    p.add_argument("--sft-teacher", default=None, help="sft: teacher folder (default: the recipe run's teacher)")
    p.add_argument("--sft-kept", default=None, help="sft: teacher blocks the student keeps, e.g. 0,1,5")
    p.add_argument("--onpolicy-teacher", default=None, help="onpolicy: teacher folder (default: the recipe run's)")
    p.add_argument("--onpolicy-kept", default=None, help="onpolicy: teacher blocks the student keeps, e.g. 0,1,5")
    p.add_argument("--max-new-tokens", type=int, default=32, help="onpolicy: tokens generated per completion")
    p.add_argument("--onpolicy-sample", action="store_true",
                   help="onpolicy: sample at T = 1 (no top-k / top-p) instead of greedy decoding")
    p.add_argument("--methods-teacher", default=None, help="methods: teacher folder (default: the recipe run's)")
    p.add_argument("--methods-kept", default=None, help="methods: teacher blocks the student keeps, e.g. 0,1,5")
    p.add_argument("--methods-from-progress", action="store_true",
                   help="methods: write the section from the runs a stopped invocation finished (marked partial)")
    p.add_argument("--methods-seeds", type=int, default=3, help="methods: seeds per variant")
    p.add_argument("--methods-steps", type=int, default=40, help="methods: steps per run")
    p.add_argument("--methods-batch", type=int, default=8, help="methods: rows per step")
    p.add_argument("--methods-half", type=int, default=64,
                   help="methods: prompt tokens per row (completion: one fewer, then EOS; max_new_tokens)")
    p.add_argument("--methods-eval-tokens", type=int, default=16_384, help="methods: held-out teacher tokens")
    p.add_argument("--methods-variants", default=None, help="methods: a subset of the variants, e.g. ce,jsd")
    p.add_argument("--methods-lr", type=float, default=1e-4,
                   help="methods: peak learning rate (cosine); the CE-only baseline must beat the untrained student")
    p.add_argument("--methods-warmup", type=float, default=0.1, help="methods: warm-up share of the steps")
    p.add_argument("--methods-threads", type=int, default=2,
                   help="methods: torch threads (1 is faster where other jobs share the cores)")
    p.add_argument("--memory-child", nargs=4, help=argparse.SUPPRESS)
    p.add_argument("--onpolicy-child", help=argparse.SUPPRESS)
    p.add_argument("--sft-child", nargs=7, help=argparse.SUPPRESS)
    p.add_argument("--trl-child", nargs=7, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.memory_child:
        v, c, b, s = map(int, a.memory_child)
        print("RESULT " + json.dumps(memory_child(v, c or None, b, s)))
        return
    if a.trl_child:
        side, teacher, kept, blocks, batch, steps, warmup = a.trl_child
        res = trl_child(side, teacher, [int(k) for k in kept.split(",")], int(blocks), int(batch), int(steps),
                        int(warmup))
        print("RESULT " + json.dumps(res))
        return
    if a.sft_child:
        from causal_lm_sft import sft_child

        side, teacher, kept, rows, batch, steps, warmup = a.sft_child
        res = sft_child(side, teacher, [int(k) for k in kept.split(",")], int(rows), int(batch), int(steps),
                        int(warmup))
        print("RESULT " + json.dumps(res))
        return
    if a.onpolicy_child:
        from causal_lm_onpolicy import onpolicy_child

        print("RESULT " + json.dumps(onpolicy_child(**json.loads(a.onpolicy_child))))
        return
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        p.error(f"--only: unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    path = RESULTS / "causal_lm.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data["machine"] = sections.machine()
    for name in only:
        with sections.section_record("benchmarks/causal_lm.py") as meta:
            sec = run_section(name, a, p, data)
        sec["meta"] = meta
        # Re-read: another invocation (another section) may have written the file meanwhile.
        data = {**(json.loads(path.read_text()) if path.is_file() else {}), "machine": data["machine"], name: sec}
        write_report(data)
    print((RESULTS / "causal_lm.md").read_text())


if __name__ == "__main__":
    main()
