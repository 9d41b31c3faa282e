"""The `onpolicy` section of benchmarks/causal_lm.py (issue #32, item 3): fully on-policy distillation (lmbda = 1).

hf_distill's `DistillationTrainer` (`lmbda=1`, `PromptCompletionCollator`) and `DistillationSFTTrainer` (`lmbda=1`,
nothing else: it skips SFT's dataset preparation and builds the collator itself) against TRL 1.16's on-policy
`DistillationTrainer`, with matching settings: the student completes every batch's prompts (TRL is on-policy only),
the same divergence (TRL's `beta=0.5` generalized JSD = our `kd_loss="jsd", jsd_beta=0.5`, TRL's convention, with
mixture 0.5 p_student + 0.5 p_teacher), T = 1 for the loss (TRL's `temperature` is both the sampling and the loss
temperature), KD only, the same `max_new_tokens` (TRL's `max_completion_length`) and stop token (the tokenizer's
EOS, kept as the completion's last token on both sides), greedy decoding by default (TRL: `generation_kwargs=
{"do_sample": False}`; ours `generation_temperature=0`) or, with `--onpolicy-sample`, sampling at T = 1 with no
top-k or top-p cut on every side, seed 0, lr 1e-4 constant, fp32, no gradient checkpointing. The student's config
says `use_cache=True`, as a Hub checkpoint does (the recipe's teacher was saved with False, which TRL's `generate`
would follow: no KV cache).

Data: the `sft` section's WikiText-2 rows as text (prompt: a line's first 16 words; completion: up to the next 48;
the completion is never trained on, as generation replaces it), `steps x batch` rows taken in order (no shuffling on
any side: TRL `shuffle_dataset=False`, ours `train_sampling_strategy="sequential"`), so every side sees the same
prompts in the same steps. The prompt is tokenised the same way on every side (the tokenizer adds no special
tokens), left-padded for `generate`.

Measured in each side's own process, the sides rotated each round: s/step as the wall time between consecutive
optimizer steps (generation included: ours generates while the step's batches are fetched, before
`on_step_begin`), median after warm-up; generated tokens/s from a wrapper around the student's `generate` (its
wall time, the completion tokens up to and including the first EOS); peak RSS of the training (ru_maxrss minus the
RSS before `train()`); first-step, final and mean training loss. With greedy decoding identical models give
identical completions: the first step's completions are compared token by token across sides, and where they agree
the first-step losses must agree too (the difference is reported).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SIDES = ("ours", "ours_sft", "trl")
NAMES = {"ours": "hf_distill `DistillationTrainer(lmbda=1)`",
         "ours_sft": "hf_distill `DistillationSFTTrainer(lmbda=1)`", "trl": "TRL `DistillationTrainer`"}


def onpolicy_child(side: str, teacher_path: str, kept: list[int], batch: int, steps: int, warmup: int,
                   max_new_tokens: int, sample: bool) -> dict[str, Any]:
    """Train the pruned student `steps` fully on-policy steps with one side's trainer."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from hf_distill import students

    sys.path.insert(0, str(HERE))
    from causal_lm import peak_mb, rss_mb
    from causal_lm_sft import text_rows
    from sections import cpu_train_args

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(teacher_path)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path)
    student = students.from_teacher(teacher, kept)
    # The recipe saved its teacher with use_cache=False (copied into the student), which TRL's generate honours
    # (no KV cache: 3x slower generation here) and ours overrides; a Hub checkpoint says True: so do both here.
    student.config.use_cache = student.generation_config.use_cache = True
    rows = Dataset.from_list([{"prompt": p, "completion": c} for p, c in text_rows(steps * batch)])
    stops = {tok.eos_token_id}
    calls: list[dict[str, Any]] = []
    generate = student.generate

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        out = generate(*a, **kw)
        seconds = time.perf_counter() - t0
        completions = []
        for row in out[:, kw["input_ids"].shape[1]:].tolist():
            end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            completions.append(row[:end])
        calls.append({"s": seconds, "tokens": sum(map(len, completions)), "completions": completions})
        return out

    student.generate = timed_generate  # every side calls generate on this object (no wrapper on CPU)
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            times.append(now - self.last)
            self.last = now

    common = cpu_train_args(f"onpolicy_{side}", steps, batch, logging_steps=1, bf16=False, gradient_checkpointing=False)
    ours = dict(kd_loss="jsd", jsd_beta=0.5, temperature=1.0, kd_weight=1.0, task_weight=0.0, lmbda=1.0,
                max_new_tokens=max_new_tokens, generation_temperature=1.0 if sample else 0.0,
                train_sampling_strategy="sequential")
    if side == "ours":
        from hf_distill import DistillationArguments, DistillationTrainer
        from hf_distill.data.prompts import PromptCompletionCollator

        trainer = DistillationTrainer(model=student, teacher_model=teacher,
                                      args=DistillationArguments(**ours, **common), train_dataset=rows,
                                      data_collator=PromptCompletionCollator(tok), processing_class=tok,
                                      callbacks=[Clock()])
    elif side == "ours_sft":
        from hf_distill import DistillationSFTConfig, DistillationSFTTrainer

        trainer = DistillationSFTTrainer(model=student, teacher_model=teacher,
                                         args=DistillationSFTConfig(**ours, **common), train_dataset=rows,
                                         processing_class=tok, callbacks=[Clock()])
    else:
        from trl import DistillationConfig, DistillationTrainer

        args = DistillationConfig(beta=0.5, temperature=1.0, max_completion_length=max_new_tokens, top_p=1.0, top_k=0,
                                  shuffle_dataset=False, generation_kwargs=None if sample else {"do_sample": False},
                                  **common)
        trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows,
                                      processing_class=tok, callbacks=[Clock()])
    before = rss_mb()
    out = trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    measured, gen = times[warmup:], calls[warmup:]
    gen_s, gen_tokens = sum(c["s"] for c in gen), sum(c["tokens"] for c in gen)
    return {"side": side, "step_s": statistics.median(measured), "times": times,
            "generated_tokens_per_step": gen_tokens / len(gen), "generated_tokens_per_s": gen_tokens / gen_s,
            "generation_share": gen_s / sum(measured), "generate_calls": len(calls),
            "peak_rss_mb": peak_mb() - before, "rss_before_mb": before, "train_loss": out.training_loss,
            "first_loss": losses[0], "final_loss": losses[-1], "losses": losses,
            "completions": [c["completions"] for c in calls]}


def onpolicy_section(run_child, pairs: int, steps: int, warmup: int, batch: int, teacher: str, kept: list[int],
                     max_new_tokens: int, sample: bool) -> dict:
    """Each side in its own process (`run_child("--onpolicy-child", json)`), the order rotated each round."""
    import importlib.metadata as md
    import os

    runs = []
    for i in range(pairs):
        for side in SIDES[i % 3:] + SIDES[:i % 3]:
            spec = dict(side=side, teacher_path=teacher, kept=kept, batch=batch, steps=steps, warmup=warmup,
                        max_new_tokens=max_new_tokens, sample=sample)
            res = run_child("--onpolicy-child", json.dumps(spec))
            res.update(side=side, pair=i, load=os.getloadavg())
            runs.append(res)
            print("onpolicy", json.dumps({k: v for k, v in res.items() if k not in ("times", "losses", "completions")}),
                  flush=True)
    summary = {}
    keys = ("step_s", "generated_tokens_per_s", "generated_tokens_per_step", "generation_share", "peak_rss_mb",
            "first_loss", "final_loss", "train_loss")
    for side in SIDES:
        ok = [x for x in runs if x["side"] == side and "step_s" in x]
        if ok:
            summary[side] = {key: statistics.median(x[key] for x in ok) for key in keys}
            summary[side]["runs"] = len(ok)
            # greedy decoding is deterministic: every run of a side should generate the same completions
            summary[side]["runs_agree"] = all(x["completions"] == ok[0]["completions"] for x in ok)
    first = {side: next(x for x in runs if x["side"] == side and "step_s" in x) for side in summary}
    against_trl = {}
    if "trl" in first:
        t = first["trl"]
        for side in ("ours", "ours_sft"):
            if side not in first:
                continue
            o = first[side]
            same = [a == b for a, b in zip(o["completions"], t["completions"], strict=False)]
            against_trl[side] = {
                "step_time": summary[side]["step_s"] / summary["trl"]["step_s"],
                "peak_rss": summary[side]["peak_rss_mb"] / summary["trl"]["peak_rss_mb"],
                "generated_tokens_per_s": summary[side]["generated_tokens_per_s"]
                / summary["trl"]["generated_tokens_per_s"],
                "first_step_completions_identical": bool(same and same[0]),
                "identical_steps": sum(same),
                "first_loss_abs_diff": abs(o["first_loss"] - t["first_loss"]),
                "losses": {"ours": o["losses"], "trl": t["losses"]},
            }
    for r in runs:  # kept in the JSON only as whether they matched (above); the token lists are long
        r.pop("completions", None)
    return {"runs": runs, "summary": summary, "against_trl": against_trl, "teacher": teacher, "kept_blocks": kept,
            "batch": batch, "steps": steps, "warmup": warmup, "pairs": pairs, "max_new_tokens": max_new_tokens,
            "decoding": "sampling, T = 1, no top-k / top-p" if sample else "greedy",
            "versions": {p: md.version(p) for p in ("trl", "transformers", "torch")}}


def onpolicy_lines(sec: dict) -> list[str]:
    """The section's table and comparisons (markdown lines)."""
    loads = [r["load"][0] for r in sec["runs"] if "load" in r]
    lines = [f"Same teacher ({sec['teacher']}), student (blocks {sec['kept_blocks']}), {sec['steps'] * sec['batch']} "
             f"WikiText-2 prompts in order, {sec['batch']} per step, `max_steps={sec['steps']}`, lmbda = 1 (the "
             f"student completes every prompt), {sec['decoding']} decoding, max_new_tokens {sec['max_new_tokens']}, "
             f"JSD beta 0.5, T = 1, KD only, lr 1e-4; medians after {sec['warmup']} warm-up steps over "
             f"{sec['pairs']} rounds of one process per side; 1-minute load after each run "
             f"{min(loads, default=0):.1f} to {max(loads, default=0):.1f}. Versions: {sec['versions']}.", "",
             "| side | median s/step | generated tokens / step | generated tokens/s | generation share of step | "
             "peak RSS MiB | first-step loss | final loss | mean loss |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for side, s in sec["summary"].items():
        lines.append(f"| {NAMES[side]} | {s['step_s']:.3f} | {s['generated_tokens_per_step']:.1f} | "
                     f"{s['generated_tokens_per_s']:,.0f} | {s['generation_share']:.2f} | {s['peak_rss_mb']:.0f} | "
                     f"{s['first_loss']:.5f} | {s['final_loss']:.5f} | {s['train_loss']:.5f} |")
    for r in sec["runs"]:
        if "error" in r:
            lines.append(f"\n{r['side']} failed: `{r['error']}`")
    for side, q in sec["against_trl"].items():
        same = ("identical completions at the first step" if q["first_step_completions_identical"]
                else "**different** completions at the first step")
        lines += ["", f"{NAMES[side]} / TRL: step time **{q['step_time']:.3f}**, peak RSS **{q['peak_rss']:.3f}**, "
                  f"generated tokens/s {q['generated_tokens_per_s']:.3f}; {same} ({q['identical_steps']} of "
                  f"{sec['steps']} steps identical), first-step loss |diff| {q['first_loss_abs_diff']:.2e}."]
    agree = {side: s["runs_agree"] for side, s in sec["summary"].items()}
    lines += ["", f"Each side's runs generated the same completions as each other: {agree}.", ""]
    return lines
