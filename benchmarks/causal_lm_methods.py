"""The `methods` section of benchmarks/causal_lm.py (issue #32 item 4): every causal-LM KD method at CPU scale.

The recipe's teacher (recipes/causal_lm.py) and its pruned student (the teacher's blocks the recipe kept, copied)
train `steps` steps of `batch` prompt + completion rows, once per variant and seed:

- CE only; forward KL; reverse KL; JSD (beta 0.5); skew KL (alpha 0.1): off-policy, on the dataset's completions;
- on-policy, `lmbda=0.5` (GKD: each micro-batch completed by the student with probability 0.5) and seq-KD
  (`seq_kd=True`, `lmbda=0`: the teacher completes every micro-batch), both with JSD beta 0.5, sampled at
  temperature 1 (no top-k, no top-p), at most `half` new tokens;
- JSD beta 0.5 without the CE term, off-policy and on-policy (GKD's own loss): on a generated completion the CE is
  the student's NLL of its own sample, whose expected gradient is zero, so it only adds noise there;
- a student with its own tokenizer (a byte-level BPE of the same size trained on the same text, digits split one
  by one as Llama 3 and Qwen do), its embeddings initialised from the teacher's (a token both vocabularies hold
  takes the teacher's row, any other the mean of the rows of its teacher tokenization): CE only, and
  `cross_tokenizer="aligned"` (JSD beta 0.5 over the shared vocabulary); `"uld"` with `--methods-variants`.

Every KD run is 1.0 * KD + 1.0 * CE (the recipe's weights) unless said, T = 1, AdamW at `lr` (default 1e-4),
cosine, `warmup` (default 10%) warm-up. The learning rate is the CE-only baseline's: at the recipe's 1e-3 CE alone
made the student worse than it started (311 vs 294 token perplexity, issue #39 case 14), so every ratio to it
overstated KD; the report states CE only / the untrained student, which must be below 1 for the ratios to mean
anything.
The rows are the same for every variant and seed (seeds change their order, and the coin and samples of
generation; every run starts from the same student): the training text (the recipe's `train_file`) cut into blocks
of 2 * `half` - 1 teacher tokens, the first `half` the prompt and the rest the completion (as text, cut at the
teacher's token boundaries); the loss covers the completion (`PromptCompletionCollator`, which appends EOS;
`CrossTokenizerCollator` for the other tokenizer, which appends none). On-policy / seq-KD micro-batches replace the
completion by a generated one.

Held-out quality, comparable across tokenizers: the first `eval_tokens` teacher tokens of `eval_file` as text; each
model reads its own tokenization of it in windows of 128 tokens at stride 64 (every token after the first is
predicted once, from 64 to 127 tokens of context, or fewer in the first window). Bits per character = the summed
next-token NLL (in bits) / the characters those tokens cover; word perplexity = 2 ** (bits / whitespace words).
Token perplexity = exp(mean NLL per token): comparable only between models that share a tokenizer.
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {  # name -> (label, DistillationArguments overrides); "xtok_*": the student with its own tokenizer
    "ce": ("CE only", {"kd_weight": 0.0}),
    "kl": ("forward KL", {"kd_loss": "kl"}),
    "reverse_kl": ("reverse KL", {"kd_loss": "reverse_kl"}),
    "jsd": ("JSD beta 0.5", {"kd_loss": "jsd", "jsd_beta": 0.5}),
    "skew_kl": ("skew KL alpha 0.1", {"kd_loss": "skew_kl", "skew_alpha": 0.1}),
    "jsd_kd_only": ("JSD beta 0.5, no CE", {"kd_loss": "jsd", "jsd_beta": 0.5, "task_weight": 0.0}),
    "on_policy": ("on-policy lmbda 0.5 (JSD 0.5)", {"kd_loss": "jsd", "jsd_beta": 0.5, "lmbda": 0.5}),
    "on_policy_kd_only": ("on-policy lmbda 0.5, JSD 0.5, no CE (GKD's loss)", {"kd_loss": "jsd", "jsd_beta": 0.5,
                                                                             "lmbda": 0.5, "task_weight": 0.0}),
    "seq_kd": ("seq-KD (JSD 0.5)", {"kd_loss": "jsd", "jsd_beta": 0.5, "seq_kd": True}),
    "xtok_ce": ("other tokenizer: CE only", {"kd_weight": 0.0}),
    "xtok_uld": ("other tokenizer: ULD", {"cross_tokenizer": "uld"}),
    "xtok_aligned": ("other tokenizer: aligned JSD 0.5", {"cross_tokenizer": "aligned", "kd_loss": "jsd",
                                                          "jsd_beta": 0.5}),
}
DEFAULT_VARIANTS = [v for v in VARIANTS if v != "xtok_uld"]  # ULD: the slowest term here; --methods-variants adds it
WINDOW, STRIDE = 128, 64
PROGRESS = "progress.json"  # in the section's work folder: its runs so far


def student_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE like the recipe's (same size, same text) whose pre-tokenizer splits digits one by one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    eos = "<|endoftext|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text.splitlines(keepends=True), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[eos], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eos, eos_token=eos, pad_token=eos)


def retokenized_student(student, teacher_tok, tok):
    """`student` (a copy) with input embeddings (tied to the LM head) for `tok`'s vocabulary: a token string the
    teacher's vocabulary holds keeps its row, any other gets the mean of the rows of its teacher tokenization."""
    import copy

    import torch

    model = copy.deepcopy(student)
    old = model.get_input_embeddings().weight.detach()
    t_vocab = teacher_tok.get_vocab()
    rows = torch.empty(len(tok), old.shape[1])
    copied = 0
    for token, i in tok.get_vocab().items():
        if token in t_vocab:
            rows[i] = old[t_vocab[token]]
            copied += 1
        else:
            pieces = teacher_tok(tok.convert_tokens_to_string([token]), add_special_tokens=False)["input_ids"]
            rows[i] = old[pieces].mean(0)
    model.resize_token_embeddings(len(tok))
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(rows)
    model.tie_weights()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, key, getattr(tok, key))
        setattr(model.generation_config, key, getattr(tok, key))
    return model, copied


def prompt_rows(text: str, tok, half: int, limit: int) -> list[dict]:
    """`limit` prompt + completion rows: consecutive blocks of 2 * half - 1 tokens of `text`, the first `half` the
    prompt and the rest the completion (so that with its EOS a row is 2 * half tokens), as text."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spans, size = enc["offset_mapping"], 2 * half - 1
    rows = []
    for s in range(0, len(spans) - size + 1, size):
        a, m, b = spans[s][0], spans[s + half][0], spans[s + size - 1][1]
        rows.append({"prompt": text[a:m], "completion": text[m:b]})
        if len(rows) == limit:
            break
    return rows


def held_out(text: str, tok, tokens: int) -> str:
    """The text of the first `tokens` tokens of `text` (the same characters for every model)."""
    spans = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return text[: spans[min(tokens, len(spans)) - 1][1]]


def evaluate(model, tok, text: str, batch: int = 16) -> dict:
    """Summed next-token NLL of `text` in `tok`'s tokens (windows of WINDOW at stride STRIDE), the tokens and
    characters scored: bits per character, word perplexity and token perplexity."""
    import torch

    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, spans = enc["input_ids"], enc["offset_mapping"]
    windows = []  # (start, first scored index within the window)
    for start in range(0, max(len(ids) - STRIDE, 1), STRIDE):
        windows.append((start, 1 if start == 0 else WINDOW - STRIDE))
    model.eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            group = windows[i: i + batch]
            by_len: dict[int, list] = {}
            for start, first in group:
                by_len.setdefault(len(ids[start: start + WINDOW]), []).append((start, first))
            for length, items in by_len.items():
                x = torch.tensor([ids[s: s + length] for s, _ in items])
                logp = torch.log_softmax(model(input_ids=x).logits[:, :-1].float(), -1)
                got = logp.gather(-1, x[:, 1:, None])[..., 0]
                for row, (_, first) in enumerate(items):
                    nll -= got[row, first - 1:].sum().item()
                    count += length - first
    assert count == len(ids) - 1, (count, len(ids))
    chars = spans[-1][1] - spans[0][1]
    bits = nll / math.log(2)
    return {"bits_per_char": bits / chars, "word_perplexity": 2 ** (bits / len(text.split())),
            "token_perplexity": math.exp(nll / count), "tokens": count, "chars": chars}


def run_one(name: str, seed: int, setup: dict, steps: int, batch: int, max_new_tokens: int, out: Path,
            lr: float = 1e-4, warmup: float = 0.1) -> dict:
    """Train one variant for one seed from the same initial student; its held-out metrics and train time."""
    import copy

    import torch
    from transformers import set_seed

    from hf_distill import (
        CrossTokenizerCollator,
        DistillationArguments,
        DistillationTrainer,
        PromptCompletionCollator,
    )

    label, overrides = VARIANTS[name]
    xtok = name.startswith("xtok")
    kd = overrides.get("kd_weight", 1.0) > 0
    generates = overrides.get("lmbda", 0) > 0 or overrides.get("seq_kd", False)
    settings = {"kd_weight": 1.0, "task_weight": 1.0, "temperature": 1.0, **overrides}
    if generates:
        settings.update(max_new_tokens=max_new_tokens, generation_temperature=1.0)
    args = DistillationArguments(
        output_dir=str(out / f"{name}_{seed}"), max_steps=steps, per_device_train_batch_size=batch,
        learning_rate=lr, lr_scheduler_type="cosine", warmup_steps=warmup, logging_steps=steps, save_strategy="no",
        report_to="none", use_cpu=True, seed=seed, disable_tqdm=True, dataloader_num_workers=0,
        remove_unused_columns=not xtok, **settings)
    teacher_tok, tok = setup["teacher_tok"], setup["student_tok"] if xtok else setup["teacher_tok"]
    if xtok:
        pair = CrossTokenizerCollator(tok, teacher_tok)
        collate = pair if kd else (lambda rows: {k: v for k, v in pair(rows).items() if not k.startswith("teacher_")})
    else:
        collate = PromptCompletionCollator(tok, max_length=2 * setup["half"])
    set_seed(seed)
    trainer = DistillationTrainer(
        model=copy.deepcopy(setup["xtok_student"] if xtok else setup["student"]),
        teacher_model=setup["teacher"] if kd else None, args=args, train_dataset=setup["rows"],
        data_collator=collate, processing_class=tok, teacher_processing_class=teacher_tok if xtok and kd else None)
    t0 = time.perf_counter()
    result = trainer.train()
    train_s = time.perf_counter() - t0
    logs = [r for r in trainer.state.log_history if "generated_tokens_per_second" in r]
    kd_logs = [r["loss_kd"] for r in trainer.state.log_history if "loss_kd" in r]  # the run's mean KD term
    with torch.no_grad():
        metrics = evaluate(trainer.model, tok, setup["eval_text"])
    return {"variant": name, "label": label, "seed": seed, "train_s": train_s, "train_loss": result.training_loss,
            **metrics, **({"kd_loss": kd_logs[-1]} if kd_logs else {}),
            **({"generated_tokens_per_second": logs[-1]["generated_tokens_per_second"]} if logs else {})}


def methods_section(teacher_path: str, kept: list[int], train_file: str, eval_file: str, *, seeds: int, steps: int,
                    batch: int, half: int, eval_tokens: int, variants: list[str], work: Path,
                    threads: int = 2, lr: float = 1e-4, warmup: float = 0.1) -> dict:
    """Every variant, seed 0 of each, then seed 1 of each, ... (so that load drift on a shared machine falls on
    every variant alike); per-variant mean and std of the held-out metrics and of the train time."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_distill import students

    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "ce" not in variants:
        raise ValueError(f"--methods-variants: unknown {unknown} (known: {list(VARIANTS)}); 'ce' is required, the "
                         "reference of the time ratios")
    torch.set_num_threads(threads)
    t_start = time.time()
    teacher_tok = AutoTokenizer.from_pretrained(teacher_path)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path).eval()
    text = (ROOT / train_file).read_text(encoding="utf-8")
    test = (ROOT / eval_file).read_text(encoding="utf-8")
    student = students.from_teacher(teacher, kept)
    setup = {"teacher": teacher, "teacher_tok": teacher_tok, "student": student, "half": half,
             "rows": datasets.Dataset.from_list(prompt_rows(text, teacher_tok, half, steps * batch)),
             "eval_text": held_out(test, teacher_tok, eval_tokens)}
    made = Path(teacher_path) / "teacher_info.json"  # written by recipes/causal_lm.py for a teacher it trained
    info = {"teacher": teacher_path, "teacher_params": sum(p.numel() for p in teacher.parameters()),
            **({"teacher_settings": json.loads(made.read_text())["settings"]} if made.is_file() else {}),
            "kept_blocks": kept, "train_file": train_file, "eval_file": eval_file,
            "rows": len(setup["rows"]), "half": half, "steps": steps, "batch": batch, "seeds": seeds,
            "max_new_tokens": half, "threads": threads, "learning_rate": lr, "warmup": warmup,
            "eval_chars": len(setup["eval_text"]), "eval_tokens": eval_tokens,
            "eval_words": len(setup["eval_text"].split()), "window": WINDOW,
            "stride": STRIDE}
    if len(setup["rows"]) < steps * batch:
        print(f"methods: only {len(setup['rows'])} rows for {steps} x {batch}: the rows repeat", flush=True)
    refs = {"teacher": evaluate(teacher, teacher_tok, setup["eval_text"]),
            "student_before_training": evaluate(student, teacher_tok, setup["eval_text"])}
    if any(v.startswith("xtok") for v in variants):
        tok = student_tokenizer(text, len(teacher_tok))
        setup["student_tok"] = tok
        setup["xtok_student"], copied = retokenized_student(student, teacher_tok, tok)
        refs["xtok_student_before_training"] = evaluate(setup["xtok_student"], tok, setup["eval_text"])
        info["student_tokenizer"] = {"vocab": len(tok), "shared_with_teacher": copied,
                                     "tokens_per_teacher_token": refs["xtok_student_before_training"]["tokens"]
                                     / refs["teacher"]["tokens"]}
    print("methods setup", info, {k: round(v["bits_per_char"], 4) for k, v in refs.items()}, flush=True)
    command = " ".join(shlex.quote(x) for x in ["python", "benchmarks/causal_lm.py", *sys.argv[1:]])
    progress = {**info, "references": refs, "variants": variants, "runs": [], "started": t_start, "command": command}
    work.mkdir(parents=True, exist_ok=True)
    for seed in range(seeds):
        for name in variants:
            r = run_one(name, seed, setup, steps, batch, half, work, lr, warmup)
            progress["runs"].append(r)
            (work / PROGRESS).write_text(json.dumps(progress, indent=1))  # a stopped section can still be reported
            print("methods run", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    return section_from(progress)


def section_from(progress: dict) -> dict:
    """The section (summary, baseline check, wall time) from the runs done so far (`progress`, as the section
    writes it after each run): complete, or marked partial with the runs it planned (`--methods-from-progress`)."""
    runs, planned = progress["runs"], progress["seeds"] * len(progress["variants"])
    variants = [v for v in progress["variants"] if any(r["variant"] == v for r in runs)]
    summary = summarise(runs, variants)
    sec = {k: v for k, v in progress.items() if k not in ("variants", "started")}
    return {**sec, "summary": summary, "baseline_over_untrained": baseline_over_untrained(summary,
                                                                                           progress["references"]),
            "section_s": time.time() - progress["started"],
            **({} if len(runs) == planned else {"partial": {"runs_done": len(runs), "runs_planned": planned}})}


def baseline_over_untrained(summary: dict, refs: dict) -> dict:
    """Each CE-only baseline's mean token perplexity / its untrained student's: below 1 where the baseline learnt,
    the condition for its "/ its CE-only" ratios to say what KD adds rather than what CE alone destroys."""
    pairs = {"ce": "student_before_training", "xtok_ce": "xtok_student_before_training"}
    return {name: summary[name]["token_perplexity"][0] / refs[ref]["token_perplexity"]
            for name, ref in pairs.items() if name in summary and ref in refs}


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(runs: list[dict], variants: list[str]) -> dict:
    ce_s = statistics.mean(r["train_s"] for r in runs if r["variant"] == "ce")
    out = {}
    for name in variants:
        rs = [r for r in runs if r["variant"] == name]
        row = {"label": VARIANTS[name][0], "seeds": len(rs), "time_over_ce": statistics.mean(r["train_s"] for r in rs)
               / ce_s}
        for key in ("token_perplexity", "bits_per_char", "word_perplexity", "train_s"):
            row[key] = _mean_std([r[key] for r in rs])
        out[name] = row
    for name, row in out.items():  # token perplexities compare within one tokenizer only
        ref = out.get("xtok_ce" if name.startswith("xtok") else "ce")
        if ref is not None:
            row["perplexity_over_ce"] = row["token_perplexity"][0] / ref["token_perplexity"][0]
    return out


def teacher_line(sec: dict) -> str:
    """Which teacher ran (its size, and the recipe settings it was trained with): the recipe's default teacher or
    a smaller one (the config's busy-machine settings) give different tables."""
    if "teacher_params" not in sec:
        return ""  # (older results)
    st = sec.get("teacher_settings")
    made = "" if st is None else (
        f": {st['teacher_layers']} blocks, hidden {st['teacher_hidden_size']}, MLP {st['teacher_intermediate_size']}"
        f", trained by the recipe {st['teacher_epochs']:g} epochs on "
        + (f"the first {st['max_train_blocks']:,}" if st.get("max_train_blocks") else "all the")
        + f" {st['block_size']}-token blocks")
    return f" ({sec['teacher_params']:,} parameters{made})"


def methods_lines(sec: dict) -> list[str]:
    """The section's table and protocol (markdown lines)."""
    sm, refs = sec["summary"], sec["references"]
    lines = [f"Teacher {sec['teacher']}{teacher_line(sec)}, student = its blocks {sec['kept_blocks']} (copied); "
             f"{sec['steps']} steps x "
             f"{sec['batch']} rows of `{sec['train_file']}` ({sec['rows']} rows: {sec['half']} prompt tokens + "
             f"{sec['half'] - 1} completion tokens + EOS), 1.0 KD + 1.0 CE, T = 1, "
             f"LR {sec.get('learning_rate', 1e-3):g} cosine, {sec.get('warmup', 0.05):.0%} warm-up; generation: at "
             f"most {sec['max_new_tokens']} new tokens, temperature 1. {sec['seeds']} seeds, run interleaved (seed 0 "
             "of every variant, then seed 1, ...). Held-out: the first "
             f"{sec['eval_tokens']:,} teacher tokens of `{sec['eval_file']}` ({sec['eval_chars']:,} characters, "
             f"{sec['eval_words']:,} words), windows of {sec['window']} tokens at stride {sec['stride']}.", ""]
    if "student_tokenizer" in sec:
        st = sec["student_tokenizer"]
        lines += [f"Other tokenizer: byte-level BPE, {st['vocab']:,} tokens, digits split "
                  f"({st['shared_with_teacher']:,} token strings shared with the teacher's), "
                  f"{st['tokens_per_teacher_token']:.3f} tokens per teacher token on the held-out text.", ""]
    if "partial" in sec:
        part = sec["partial"]
        lines += [f"**Partial**: {part['runs_done']} of the {part['runs_planned']} runs planned by "
                  f"`{sec['command']}` (stopped; written from its progress file by `--methods-from-progress`): each "
                  "row's seeds are those it ran (seeds column).", ""]
    lines += ["| model | seeds | token perplexity | / its CE-only | bits / char | word perplexity | train s | "
              "time / CE-only |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in refs.items():
        ppl = f"{r['token_perplexity']:.2f}" if not name.startswith("xtok") else \
            f"({r['token_perplexity']:.2f}, own tokens)"
        lines.append(f"| {name.replace('_', ' ')} | | {ppl} | | {r['bits_per_char']:.4f} | "
                     f"{r['word_perplexity']:.1f} | | |")
    for name, r in sm.items():
        (p, ps), (b, bs) = r["token_perplexity"], r["bits_per_char"]
        (w, ws), (t, ts) = r["word_perplexity"], r["train_s"]
        ppl = f"{p:.2f} ± {ps:.2f}" if not name.startswith("xtok") else f"({p:.2f} ± {ps:.2f}, own tokens)"
        ratio = f"{r['perplexity_over_ce']:.3f}" if "perplexity_over_ce" in r else ""
        lines.append(f"| {r['label']} | {r['seeds']} | {ppl} | {ratio} | {b:.4f} ± {bs:.4f} | {w:.1f} ± {ws:.1f} | "
                     f"{t:.1f} ± {ts:.1f} | {r['time_over_ce']:.2f} |")
    checks = sec.get("baseline_over_untrained") or baseline_over_untrained(sm, refs)  # (older results: computed)
    if checks:
        lines += ["", "Baselines: " + "; ".join(
            f"{'other tokenizer: ' if name.startswith('xtok') else ''}CE only / the student before training "
            f"**{v:.3f}** ({'learnt' if v < 1 else 'WORSE than untrained: the ratios to it overstate KD'})"
            for name, v in checks.items()) + "."]
    gen = [r for r in sec["runs"] if "generated_tokens_per_second" in r]
    if gen:
        lines += ["", "Generated tokens/s (last log of each run): " + ", ".join(
            f"{r['variant']} seed {r['seed']}: {r['generated_tokens_per_second']:.0f}" for r in gen) + "."]
    lines += ["", f"Section wall time {sec['section_s'] / 60:.1f} min.", ""]
    return lines
