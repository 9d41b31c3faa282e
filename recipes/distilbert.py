"""DistilBERT recipe (Sanh et al. 2019, "DistilBERT, a distilled version of BERT").

    python recipes/distilbert.py --config recipes/configs/distilbert_sst2.yaml --teacher TEACHER --output_dir out

What the paper and the reference code (huggingface `research_projects/distillation`) do:
- the student is initialised from every other teacher layer (`scripts/extract_distilbert.py`: BERT-base
  layers [0, 2, 4, 7, 9, 11]) -- "crucial" per its README;
- general distillation on a large corpus (Toronto books + Wikipedia) with
  `5 * T**2 KL(logits) + 2 * MLM + 1 * cosine(last hidden)`, T = 2, dynamic masking of 15% of tokens
  (80/10/10) sampled with token-frequency smoothing 0.7, lr 5e-4, 3 epochs, batches of ~4k examples;
- task fine-tuning of the student, with logit distillation from a fine-tuned teacher for SQuAD
  (`run_squad_w_distillation.py`: 0.5 * T**2 KL + 0.5 * CE, T = 2).

What this recipe does:
- general step (optional, `--corpus_files ... --general_epochs N`): the `distilbert` preset loss on an MLM
  student copied from the general teacher's layers, with the library's MLM collator (15%, 80/10/10,
  smoothed token sampling). Deliberate difference: if the general teacher has no trained MLM head (the
  offline MiniLM teacher here is a sentence encoder without one), KL on its (random) MLM logits is
  meaningless, so the recipe drops the KL term and keeps MLM + cosine, and says so;
- task step: student copied from `student_layers` of `--student` (e.g. the pre-trained teacher, as the
  benchmark does) or of the teacher, trained with `task_weight * CE + kd_weight * T**2 KL` from the
  fine-tuned teacher (defaults 0.5 / 0.5, T = 2); add DistilBERT's cosine term with
  `--distill_terms loss=cosine_loss,layers=last`. Teacher logits are cached once when only logits are
  needed. Differences: no length-grouped batches (dynamic padding instead), AdamW with the Trainer's
  defaults unless the config says otherwise.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from common import (
    DataArguments,
    ModelArguments,
    build_student,
    cache_task_logits,
    command_line,
    compute_metrics,
    fail,
    load_corpus,
    load_model,
    load_task,
    load_tokenizer,
    parse_args,
    run_main,
    set_offline_defaults,
    task_labels,
    tokenize_task,
    train_and_report,
    write_results,
)

from hf_distill import DistillationArguments, DistillationTrainer


@dataclass
class DistilBertArguments:
    """The general (MLM) step; the task step is configured by the DistillationArguments fields."""

    general_epochs: float = field(default=0.0, metadata={"help": "Epochs of general distillation (0: skip)."})
    general_learning_rate: float = field(default=5e-4, metadata={"help": "General step lr (paper: 5e-4)."})
    general_kd_weight: float = field(default=5.0, metadata={"help": "alpha_ce: T**2 KL on MLM logits."})
    general_mlm_weight: float = field(default=2.0, metadata={"help": "alpha_mlm: the student's MLM loss."})
    general_cosine_weight: float = field(default=1.0, metadata={"help": "alpha_cos: cosine of last hidden."})
    mlm_probability: float = field(default=0.15, metadata={"help": "Share of tokens masked (paper: 0.15)."})
    mlm_smoothing: float = field(
        default=0.7, metadata={"help": "Masked tokens are sampled with p(w) ~ count(w)**-smoothing (paper: 0.7)."}
    )
    cache_teacher: bool = field(
        default=True, metadata={"help": "Task step: compute the teacher's logits once (hf_distill.data.cache)."}
    )
    cache_dir: str = field(default=".cache/hf_distill", metadata={"help": "Where cached teacher outputs go."})
    evaluate_teacher: bool = field(default=True, metadata={"help": "Also report the teacher's accuracy."})


def general_distillation(margs, data, recipe, args, tokenizer) -> str:
    """MLM student distilled from the pre-trained teacher on the corpus; returns the saved folder."""
    from transformers import AutoModelForMaskedLM

    from hf_distill.data.collators import MLMDistillationCollator, token_counts

    teacher, info = AutoModelForMaskedLM.from_pretrained(margs.general_teacher or margs.teacher,
                                                         output_loading_info=True)
    head_is_random = any(k.startswith("cls.") or "lm_head" in k or "vocab_" in k for k in info["missing_keys"])
    kd_weight = recipe.general_kd_weight
    if head_is_random and kd_weight > 0:
        print("note: the general teacher has no trained MLM head (its weights lack it), so KL on its MLM "
              "logits would distil noise: the KL term is dropped, MLM + cosine remain.")
        kd_weight = 0.0
    student = build_student(margs, teacher, AutoModelForMaskedLM, args.seed)
    corpus = load_corpus(data, tokenizer)
    # Rare tokens are masked more often: p(w) ~ count(w)**-0.7 over the corpus (scripts/token_counts.py).
    collator = MLMDistillationCollator(tokenizer, mlm_probability=recipe.mlm_probability,
                                       token_counts=token_counts(corpus, len(tokenizer)),
                                       smoothing=recipe.mlm_smoothing, seed=args.seed)
    gargs = dataclasses.replace(
        args, output_dir=f"{args.output_dir}/general", num_train_epochs=recipe.general_epochs,
        learning_rate=recipe.general_learning_rate, distill_preset=None, kd_loss="kl", temperature=2.0,
        kd_weight=kd_weight, task_weight=recipe.general_mlm_weight, kd_token_mask="attention",
        distill_terms=[{"loss": "cosine_loss", "layers": "last", "weight": recipe.general_cosine_weight}],
        eval_strategy="no", train_sampling_strategy="random", load_best_model_at_end=False,
    )
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=gargs, train_dataset=corpus,
                                  data_collator=collator, processing_class=tokenizer)
    trainer.train()
    trainer.save_model()
    trainer.save_state()  # trainer_state.json: `hf-distill report` plots the stage
    return gargs.output_dir


def main() -> None:
    set_offline_defaults()
    margs, data, recipe, args, config = parse_args(
        [ModelArguments, DataArguments, DistilBertArguments, DistillationArguments], __doc__.split("\n\n")[0])
    start = time.time()
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, set_seed

    if not margs.teacher:
        fail("set teacher (a fine-tuned teacher folder for the task, or the pre-trained one for general distillation)")
    set_seed(args.seed)
    tokenizer = load_tokenizer(margs.teacher, "teacher")
    results = {"recipe": "distilbert", "command": command_line(), "config": config}

    # 0. Task data and teacher first: a label the teacher does not know is refused before anything trains.
    train, valid = load_task(data)
    if train is not None:
        teacher = load_model(AutoModelForSequenceClassification, margs.teacher, "teacher")
        labels = task_labels(train, valid, data, teacher)
        labels.apply(teacher, "teacher")
        results["id2label"] = labels.id2label

    # 1. General distillation (optional): an MLM student on the corpus.
    if data.corpus_files and recipe.general_epochs > 0:
        general_dir = general_distillation(margs, data, recipe, args, tokenizer)
        margs = dataclasses.replace(margs, student=general_dir, student_layers=None)
        results["general_epochs"] = recipe.general_epochs
        results["general_student"] = general_dir

    # 2. Task distillation: the student learns the labels and the fine-tuned teacher's logits.
    if train is None:
        results["wall_s"] = time.time() - start
        write_results(args.output_dir, results)
        return
    student = build_student(margs, teacher, AutoModelForSequenceClassification, args.seed, **labels.config_kwargs())
    labels.apply(student, "student")  # the student's class k is the teacher's class k
    train, valid = tokenize_task(train, tokenizer, data, labels), tokenize_task(valid, tokenizer, data, labels)
    collator = DataCollatorWithPadding(tokenizer)
    needs_teacher = args.kd_weight > 0 or bool(args.terms)
    if needs_teacher and recipe.cache_teacher and not args.terms:
        train = cache_task_logits(teacher, train, collator, recipe.cache_dir, progress=not args.disable_tqdm)
    trainer = DistillationTrainer(model=student, teacher_model=teacher if needs_teacher else None, args=args,
                                  train_dataset=train, eval_dataset=valid, data_collator=collator,
                                  processing_class=tokenizer, compute_metrics=compute_metrics)

    # 3. Train, evaluate student (and teacher) and write results.json next to the student.
    train_and_report(trainer, results, start, student=student, teacher=teacher, train=train, valid=valid,
                     collator=collator, evaluate_teacher=recipe.evaluate_teacher)


if __name__ == "__main__":
    run_main(main)
