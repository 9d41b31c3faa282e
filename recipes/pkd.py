"""BERT-PKD recipe (Sun et al. 2019, "Patient Knowledge Distillation for BERT Model Compression", EMNLP).

    python recipes/pkd.py --config recipes/configs/pkd_sst2.yaml --strategy skip --output_dir out
    python recipes/pkd.py --config recipes/configs/pkd_sst2.yaml --strategy last --output_dir out

What the paper and its reference code (github.com/intersun/PKD-for-BERT-Model-Compression) do:
- task distillation only: the student is the first k layers of the pre-trained BERT (k = 3 or 6), fine-tuned on
  the task from a fine-tuned 12-layer teacher;
- loss `(1 - alpha) CE + alpha T**2 KL(teacher || student) + beta L_PT`. L_PT ("patient" loss) is the squared
  distance between the L2-normalised [CLS] states of each intermediate student layer (the last one is left to the
  logits) and one teacher layer: PKD-Skip takes every (teacher/student)-th teacher layer, PKD-Last the teacher's
  last layers below its top. The paper reports Skip slightly ahead of Last;
- the reference code averages both terms over everything: `KLDivLoss(reduction="mean")` over rows and classes,
  `F.mse_loss` over rows, layers and features;
- grid (scripts/run_student_patience.py): T in {5, 10, 20}, alpha in {0.2, 0.5, 0.7}, beta in {10, 100, 500,
  1000}, lr in {1e-5, 2e-5, 5e-5}; 4 epochs, batch 32. Its best SST-2 3-layer run
  (result/glue/result_summary/pkd_3layer_mean.csv): lr 5e-5, T 20, alpha 0.2, beta 1, normalised [CLS]: the
  defaults below.

What this recipe does:
- the same loss with the library's terms: `kd_loss=kl` (T**2 KL averaged over rows), `task_weight = 1 - alpha`,
  `kd_weight = alpha / num_labels` (the reference's mean over classes), and a `pkd_loss` term (summed over
  features, averaged over rows, summed over layer pairs) of weight `beta / (pairs x hidden size)`: the
  reference's mean over every element;
- the layer map from `--strategy` and the two depths (`hidden_states` indices, 0 = embeddings): student layers
  1 .. k-1 onto teacher layers j * (teacher/student) (skip) or the k-1 teacher layers below the top (last);
- differences: a 6-layer MiniLM teacher instead of BERT-base; the benchmark runs 3 epochs like its other rows.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from common import (
    DataArguments,
    ModelArguments,
    build_student,
    command_line,
    compute_metrics,
    fail,
    load_model,
    load_task,
    load_tokenizer,
    parse_args,
    run_main,
    set_offline_defaults,
    task_labels,
    tokenize_task,
    train_and_report,
)

from hf_distill import DistillationArguments, DistillationTrainer


@dataclass
class PkdArguments:
    """PKD's own knobs; the rest (temperature, learning rate, epochs) are DistillationArguments fields."""

    strategy: str = field(default="skip", metadata={"help": "skip (every k-th teacher layer) or last (the last "
                                                            "teacher layers below the top)."})
    pkd_alpha: float = field(default=0.2, metadata={"help": "alpha: share of the KD term, 1 - alpha goes to CE "
                                                            "(reference best for SST-2, 3 layers: 0.2)."})
    pkd_beta: float = field(default=1.0, metadata={"help": "beta: weight of the patient loss, as the reference "
                                                           "code scales it (mean over rows, layers, features)."})
    evaluate_teacher: bool = field(default=True, metadata={"help": "Also report the teacher's accuracy."})


def layer_map(strategy: str, student_layers: int, teacher_layers: int) -> list[tuple[int, int]]:
    """(student, teacher) `hidden_states` indices of PKD's intermediate layers (the top layers are not mapped)."""
    if student_layers < 2:
        fail(f"PKD maps the student's intermediate layers: a {student_layers}-layer student has none")
    if teacher_layers <= student_layers:
        fail(f"the teacher ({teacher_layers} layers) must be deeper than the student ({student_layers})")
    if strategy == "last":  # main() has refused any strategy but skip and last
        first = teacher_layers - student_layers + 1
        return [(j, first + j - 1) for j in range(1, student_layers)]
    if teacher_layers % student_layers:
        fail(f"strategy skip needs the teacher's depth ({teacher_layers}) to be a multiple of the student's "
             f"({student_layers}); use --strategy last or a student whose depth divides it")
    step = teacher_layers // student_layers
    return [(j, j * step) for j in range(1, student_layers)]


def main() -> None:
    set_offline_defaults()
    margs, data, recipe, args, config = parse_args(
        [ModelArguments, DataArguments, PkdArguments, DistillationArguments], __doc__.split("\n\n")[0])
    start = time.time()
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, set_seed

    if not margs.teacher:
        fail("set teacher (the fine-tuned task teacher)")
    if recipe.strategy not in ("skip", "last"):
        fail(f"strategy must be skip or last, got {recipe.strategy!r}")
    if not 0.0 <= recipe.pkd_alpha <= 1.0:
        fail(f"pkd_alpha must be in [0, 1] (the KD share; CE gets 1 - alpha), got {recipe.pkd_alpha:g}")
    if recipe.pkd_beta < 0:
        fail(f"pkd_beta must be >= 0, got {recipe.pkd_beta:g}")
    set_seed(args.seed)
    tokenizer = load_tokenizer(margs.teacher, "teacher")
    results = {"recipe": "pkd", "command": command_line(), "config": config}

    # 1. Task data, teacher and student (the first k layers of the pre-trained model, as in the paper).
    train, valid = load_task(data)
    if train is None:
        fail("set train_file (or dataset_name): PKD is task distillation")
    teacher = load_model(AutoModelForSequenceClassification, margs.teacher, "teacher")
    labels = task_labels(train, valid, data, teacher)
    labels.apply(teacher, "teacher")
    student = build_student(margs, teacher, AutoModelForSequenceClassification, args.seed, **labels.config_kwargs())
    labels.apply(student, "student")
    pairs = layer_map(recipe.strategy, student.config.num_hidden_layers, teacher.config.num_hidden_layers)

    # 2. PKD's loss in the library's terms (see the docstring for the scaling).
    hidden = student.config.hidden_size
    term = {"loss": "pkd_loss", "layers": pairs, "weight": recipe.pkd_beta / (len(pairs) * hidden), "name": "pkd"}
    args = dataclasses.replace(args, distill_preset=None, kd_loss="kl", task_weight=1.0 - recipe.pkd_alpha,
                               kd_weight=recipe.pkd_alpha / teacher.config.num_labels, distill_terms=[term])
    results.update(id2label=labels.id2label, strategy=recipe.strategy, layer_map=pairs, pkd_alpha=recipe.pkd_alpha,
                   pkd_beta=recipe.pkd_beta, temperature=args.temperature)

    # 3. Train with the teacher online (the patient loss needs its hidden states), evaluate, write results.json.
    train, valid = tokenize_task(train, tokenizer, data, labels), tokenize_task(valid, tokenizer, data, labels)
    collator = DataCollatorWithPadding(tokenizer)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=train,
                                  eval_dataset=valid, data_collator=collator, processing_class=tokenizer,
                                  compute_metrics=compute_metrics)
    train_and_report(trainer, results, start, student=student, teacher=teacher, train=train, valid=valid,
                     collator=collator, evaluate_teacher=recipe.evaluate_teacher)


if __name__ == "__main__":
    run_main(main)
