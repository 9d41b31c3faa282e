"""The `sft` section of benchmarks/causal_lm.py (issue #32, item 3): off-policy distillation inside TRL's SFT stack.

hf_distill's `DistillationSFTTrainer` (kd_loss=jsd, jsd_beta=0.5, T = 1, KD only) against TRL's own
`GKDTrainer(lmbda=0, beta=0.5, temperature=1)` (off-policy: lmbda = 0 never generates; TRL 1.16's
`DistillationTrainer` is on-policy only) on the recipe's teacher and pruned student and the same prompt/completion
rows of WikiText-2 (prompt: a line's first 16 words; completion: up to the next 48, then EOS; labels -100 on the
prompt), tokenised once and given to both as `input_ids` + `labels`, padded by TRL's own collator, in the same order
(seed 0): identical batches, so the first step's loss is the same quantity on both sides. A third side runs ours
with `packing=True` (bfd, padding-free rows of up to 256 tokens, same per-device batch of rows). Each side in its
own process, sides alternated; median s/step after warm-up, real (non-padding) tokens per second, peak RSS of the
training, first-step and mean training loss.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIDES = ("ours", "ours_packed", "trl")
PROMPT_WORDS, COMPLETION_WORDS, PACKED_LENGTH = 16, 48, 256


def text_rows(n: int) -> list[tuple[str, str]]:
    """The first `n` (prompt, completion) pairs of wiki.valid.raw: a line's first 16 words, then up to 48 more."""
    text = (ROOT.parent / "shared" / "data" / "wikitext2" / "wiki.valid.raw").read_text(encoding="utf-8")
    pairs = []
    for line in text.splitlines():
        words = line.split()
        if len(words) < PROMPT_WORDS + 8 or line.lstrip().startswith("="):
            continue
        completion = " " + " ".join(words[PROMPT_WORDS:PROMPT_WORDS + COMPLETION_WORDS])
        pairs.append((" ".join(words[:PROMPT_WORDS]), completion))
        if len(pairs) == n:
            break
    return pairs


def sft_rows(tok, n: int):
    """`n` prompt/completion rows tokenised as SFT does (prompt ids, then completion ids + EOS; prompt labels -100)."""
    from datasets import Dataset

    rows = []
    for prompt, completion in text_rows(n):
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        c = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append({"input_ids": p + c, "labels": [-100] * len(p) + c})
    return Dataset.from_list(rows)


def sft_child(side: str, teacher_path: str, kept: list[int], n_rows: int, batch: int, steps: int,
              warmup: int) -> dict[str, Any]:
    """Train the pruned student `steps` steps with one side's trainer; per-step times and tokens from callbacks."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_distill import students

    sys.path.insert(0, str(HERE))
    from causal_lm import peak_mb, rss_mb
    from sections import cpu_train_args, step_clock

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(teacher_path)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path)
    student = students.from_teacher(teacher, kept)
    rows = sft_rows(tok, n_rows)
    times: list[float] = []
    common = cpu_train_args(f"sft_{side}", steps, batch, logging_steps=1, bf16=False, gradient_checkpointing=False,
                            max_length=PACKED_LENGTH if side == "ours_packed" else 128)
    if side.startswith("ours"):
        from hf_distill import DistillationSFTConfig, DistillationSFTTrainer

        args = DistillationSFTConfig(kd_loss="jsd", jsd_beta=0.5, temperature=1.0, kd_weight=1.0, task_weight=0.0,
                                     packing=side == "ours_packed", **common)
        trainer = DistillationSFTTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows,
                                         processing_class=tok, callbacks=[step_clock(times)])
    else:
        from trl.experimental.gkd import GKDConfig, GKDTrainer
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        args = GKDConfig(lmbda=0.0, beta=0.5, temperature=1.0, seq_kd=False, **common)
        trainer = GKDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows,
                             data_collator=DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id),
                             processing_class=tok, callbacks=[step_clock(times)])
    tokens = [int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel()
              for b, _ in zip(trainer.get_train_dataloader(), range(steps), strict=False)]
    before = rss_mb()
    out = trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    step_s = statistics.median(times[warmup:])
    return {"side": side, "step_s": step_s, "times": times, "tokens_per_step": statistics.mean(tokens),
            "tokens_per_s": statistics.mean(tokens) / step_s, "peak_rss_mb": peak_mb() - before,
            "rss_before_mb": before, "train_loss": out.training_loss, "first_loss": losses[0], "losses": losses,
            "rows": len(trainer.train_dataset)}


def sft_section(run_child, pairs: int, steps: int, warmup: int, batch: int, teacher: str, kept: list[int]) -> dict:
    """Each side in its own process (`run_child("--sft-child", ...)`), the order rotated each round."""
    import importlib.metadata as md
    import json
    import os

    runs = []
    for i in range(pairs):
        order = SIDES[i % 3:] + SIDES[:i % 3]
        for side in order:
            res = run_child("--sft-child", side, teacher, ",".join(map(str, kept)), str(steps * batch), str(batch),
                            str(steps), str(warmup))
            res.update(side=side, pair=i, load=os.getloadavg())
            runs.append(res)
            print("sft", json.dumps({k: v for k, v in res.items() if k not in ("times", "losses")}), flush=True)
    summary = {}
    for side in SIDES:
        ok = [x for x in runs if x["side"] == side and "step_s" in x]
        if ok:
            summary[side] = {key: statistics.median(x[key] for x in ok) for key in
                             ("step_s", "tokens_per_s", "tokens_per_step", "peak_rss_mb", "first_loss", "train_loss")}
    ratios = {}
    if "ours" in summary and "trl" in summary:
        o, t = summary["ours"], summary["trl"]
        ratios = {"step_time": o["step_s"] / t["step_s"], "peak_rss": o["peak_rss_mb"] / t["peak_rss_mb"],
                  "first_loss_abs_diff": abs(o["first_loss"] - t["first_loss"])}
    return {"runs": runs, "summary": summary, "ours_over_trl": ratios, "teacher": teacher, "kept_blocks": kept,
            "batch": batch, "steps": steps, "warmup": warmup, "pairs": pairs, "max_length": 128,
            "packed_length": PACKED_LENGTH, "versions": {p: md.version(p) for p in ("trl", "transformers", "torch")}}


def sft_lines(sec: dict) -> list[str]:
    """The section's table and ratios (markdown lines)."""
    names = {"ours": "hf_distill `DistillationSFTTrainer`", "ours_packed": "hf_distill, `packing=True` (bfd)",
             "trl": "TRL `GKDTrainer(lmbda=0)`"}
    lines = [f"Same teacher ({sec['teacher']}), student (blocks {sec['kept_blocks']}), prompt/completion rows of "
             f"WikiText-2 ({sec['steps'] * sec['batch']}, tokenised once), {sec['batch']} rows per step, "
             f"`max_steps={sec['steps']}`, JSD beta 0.5, T = 1, KD only, lr 1e-4; median after {sec['warmup']} "
             f"warm-up steps over {sec['pairs']} rounds of one process per side. Versions: {sec['versions']}.", "",
             "| side | median s/step | real tokens / step | tokens/s | peak RSS MiB | first-step loss | "
             "training loss |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for side, s in sec["summary"].items():
        lines.append(f"| {names[side]} | {s['step_s']:.3f} | {s['tokens_per_step']:.0f} | {s['tokens_per_s']:,.0f} | "
                     f"{s['peak_rss_mb']:.0f} | {s['first_loss']:.5f} | {s['train_loss']:.5f} |")
    for r in sec["runs"]:
        if "error" in r:
            lines.append(f"\n{r['side']} failed: `{r['error']}`")
    if sec["ours_over_trl"]:
        q = sec["ours_over_trl"]
        lines += ["", f"ours / TRL (same batches): step time **{q['step_time']:.3f}**, peak RSS "
                  f"**{q['peak_rss']:.3f}**, first-step loss |diff| {q['first_loss_abs_diff']:.2e}."]
    lines.append("")
    return lines
