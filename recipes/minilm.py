"""MiniLM recipe (Wang et al. 2020 "MiniLM"; Wang et al. 2021 "MiniLMv2"): relation distillation, then fine-tuning.

    python recipes/minilm.py --config recipes/configs/minilm_sst2.yaml --general_teacher PRETRAINED \
        --teacher FINE_TUNED --output_dir out

What the papers (and the MiniLMv2 reference `bloomberg/minilmv2.bb`; Microsoft never released theirs) do:
- task-agnostic distillation only: a pre-trained teacher, a large corpus (160 GB for v2), a student trained
  from scratch; v1 matches the last layer's attention distributions softmax(QKᵀ/√d) and value relations
  softmax(VVᵀ/√d) per head (head counts must match); v2 matches Q-Q, K-K and V-V relations with heads
  re-split into relation heads (48 for base-size teachers) and lets the teacher layer be chosen
  (upper-middle layers for large teachers);
- the student is then fine-tuned on each task like any pre-trained model (no distillation).

What this recipe does:
- general step (`--corpus_files ... --general_epochs N`): `minilm` (v1) or `minilmv2` preset loss between the
  teacher layer `--teacher_layer` (default: last) and the student's last layer, on corpus blocks;
- teacher assistant (MiniLM: for a large teacher-student gap, teacher -> assistant -> student):
  `--assistant_layers 0 2 4 5` first distils an assistant copied from those teacher layers, then the student
  (`student_layers`, a subset) is copied from the assistant's layers and distilled from the assistant; both
  steps use the general-step settings, and results.json records the assistant. The paper's assistant is as deep
  as the teacher and narrower; here it is shallower, because students are copied from teacher layers;
- task step: plain fine-tuning (`kd_weight: 0, task_weight: 1` in the configs), or with logit KD from a
  fine-tuned teacher (`--kd_weight 0.5 --task_weight 0.5`).
Deliberate difference: with a corpus of ~0.5M tokens (WikiText-2 here) a student trained from scratch
learns little, so the configs initialise the student from teacher layers (`student_layers: [0, 2, 4]`,
DistilBERT-style) and the relation loss then aligns its last layer with the teacher's. A random student
(`student_num_layers` ...) follows the paper when a large corpus is at hand.
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
class MiniLMArguments:
    """The relation-distillation step; the fine-tuning step is configured by the DistillationArguments fields."""

    minilm_version: str = field(default="v2", metadata={"help": "v1 (attention + value relation, model heads) "
                                                        "or v2 (Q-Q, K-K, V-V relations, relation heads)."})
    teacher_layer: int | None = field(
        default=None, metadata={"help": "Teacher block (1-based) whose relations are distilled; default: last."}
    )
    relation_heads: int = field(default=48, metadata={"help": "v2: relation heads (reference: 48 for base)."})
    general_epochs: float = field(default=0.0, metadata={"help": "Epochs of relation distillation (0: skip)."})
    general_learning_rate: float = field(default=6e-4, metadata={"help": "Relation-distillation lr (reference "
                                                                 "run.sh: 6e-4, from scratch)."})
    general_warmup_ratio: float = field(default=0.0, metadata={"help": "Warm-up share of the general step."})
    assistant_layers: list[int] | None = field(
        default=None, metadata={"help": "Teacher assistant (MiniLM, for a large teacher-student gap): teacher layers "
                                "(0-based) copied into an assistant that is distilled from the teacher first; the "
                                "student (student_layers, a subset) is then copied from the assistant and distilled "
                                "from it. Unset: direct."})
    cache_teacher: bool = field(default=True, metadata={"help": "Fine-tuning with KD: cache teacher logits."})
    cache_dir: str = field(default=".cache/hf_distill", metadata={"help": "Where cached teacher outputs go."})
    evaluate_teacher: bool = field(default=True, metadata={"help": "Also report the teacher's accuracy."})


def general_distillation(margs, data, recipe, args, tokenizer, name: str = "general",
                         teacher_layer: int | None = None) -> str:
    """Relation distillation of the student's last layer from the teacher's chosen layer, on the corpus;
    the student is saved in `output_dir/name`."""
    from transformers import AutoModelForSequenceClassification

    # A sequence-classification wrapper gives both models `logits`; its head is never trained or used here.
    teacher = load_model(AutoModelForSequenceClassification, margs.general_teacher or margs.teacher, "teacher")
    student = build_student(margs, teacher, AutoModelForSequenceClassification, args.seed)
    t_layer = teacher_layer or teacher.config.num_hidden_layers
    pairs = f"{student.config.num_hidden_layers}:{t_layer}"
    if recipe.minilm_version == "v1":
        term = {"loss": "relation_kl", "layers": pairs, "relations": ["qk", "vv"], "weight": 1.0}
    elif recipe.minilm_version == "v2":
        term = {"loss": "relation_kl", "layers": pairs, "relations": ["qq", "kk", "vv"],
                "relation_heads": recipe.relation_heads, "weight": 1.0}
    else:
        fail(f"minilm_version must be v1 or v2, got {recipe.minilm_version!r}")
    corpus = load_corpus(data, tokenizer)
    gargs = dataclasses.replace(
        args, output_dir=f"{args.output_dir}/{name}", num_train_epochs=recipe.general_epochs,
        learning_rate=recipe.general_learning_rate, warmup_steps=recipe.general_warmup_ratio,
        distill_preset=None, kd_weight=0.0, task_weight=0.0, distill_terms=[term], eval_strategy="no",
        train_sampling_strategy="random", load_best_model_at_end=False,
    )
    from transformers import DataCollatorWithPadding

    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=gargs, train_dataset=corpus,
                                  data_collator=DataCollatorWithPadding(tokenizer), processing_class=tokenizer)
    trainer.train()
    trainer.save_model()
    trainer.save_state()  # trainer_state.json: `hf-distill report` plots the stage
    return gargs.output_dir


def check_assistant(margs, data, recipe) -> None:
    """The chain teacher -> assistant -> student needs a student made of (a subset of) the assistant's layers."""
    layers = recipe.assistant_layers
    if not (data.corpus_files and recipe.general_epochs > 0):
        fail("assistant_layers chains general distillation: set corpus_files and general_epochs > 0")
    if margs.student or not margs.student_layers:
        fail("assistant_layers needs student_layers (teacher layers, a subset of assistant_layers) and no student "
             "folder: the student is copied from the distilled assistant")
    if sorted(set(layers)) != list(layers):
        fail(f"assistant_layers must be increasing without repeats, got {layers}")
    missing = [layer for layer in margs.student_layers if layer not in layers]
    if missing or len(layers) <= len(margs.student_layers):
        fail(f"assistant_layers {layers} must hold every student layer {margs.student_layers} and more "
             f"(missing: {missing or 'none'}): the assistant sits between teacher and student in size")


def main() -> None:
    set_offline_defaults()
    margs, data, recipe, args, config = parse_args(
        [ModelArguments, DataArguments, MiniLMArguments, DistillationArguments], __doc__.split("\n\n")[0])
    start = time.time()
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, set_seed

    if not (margs.teacher or margs.general_teacher):
        fail("set teacher (fine-tuned, for the task step) and/or general_teacher (pre-trained, for the general step)")
    if recipe.assistant_layers:
        check_assistant(margs, data, recipe)
    set_seed(args.seed)
    tokenizer = load_tokenizer(margs.general_teacher or margs.teacher, "teacher")
    results = {"recipe": "minilm", "command": command_line(), "config": config}

    # 0. Task data and teacher first: a label the teacher does not know is refused before anything trains.
    train, valid = load_task(data)
    if train is not None:
        if not margs.teacher and args.kd_weight > 0:
            fail("kd_weight > 0 needs a fine-tuned teacher: set teacher, or kd_weight 0 for plain fine-tuning")
        teacher = load_model(AutoModelForSequenceClassification, margs.teacher, "teacher") if margs.teacher else None
        # Without a teacher (plain fine-tuning) the student's classes are class_names or the sorted label names.
        labels = task_labels(train, valid, data, teacher)
        if teacher is not None:
            labels.apply(teacher, "teacher")
        results["id2label"] = labels.id2label

    # 1. Task-agnostic relation distillation on the corpus (through the assistant when there is one).
    general_s = 0.0
    if data.corpus_files and recipe.general_epochs > 0:
        t0 = time.time()
        if recipe.assistant_layers:
            assistant_dir = general_distillation(dataclasses.replace(margs, student_layers=recipe.assistant_layers),
                                                 data, recipe, args, tokenizer, "assistant", recipe.teacher_layer)
            results["assistant"] = {"layers": recipe.assistant_layers, "folder": assistant_dir,
                                    "general_s": time.time() - t0}
            # The student: the assistant's copies of the teacher layers in student_layers, taught by the assistant.
            margs = dataclasses.replace(margs, general_teacher=assistant_dir, student=assistant_dir, student_layers=[
                recipe.assistant_layers.index(layer) for layer in margs.student_layers])
            general_dir = general_distillation(margs, data, recipe, args, tokenizer)
        else:
            general_dir = general_distillation(margs, data, recipe, args, tokenizer, teacher_layer=recipe.teacher_layer)
        general_s = time.time() - t0
        margs = dataclasses.replace(margs, student=general_dir, student_layers=None)
        results.update(general_epochs=recipe.general_epochs, general_student=general_dir, general_s=general_s,
                       minilm_version=recipe.minilm_version, teacher_layer=recipe.teacher_layer)

    # 2. Fine-tuning on the task (plain, or with logit KD when kd_weight > 0).
    if train is None:
        results["wall_s"] = time.time() - start
        write_results(args.output_dir, results)
        return
    student = build_student(margs, teacher, AutoModelForSequenceClassification, args.seed, **labels.config_kwargs(),
                            ignore_mismatched_sizes=True)
    labels.apply(student, "student")  # the student's class k is the teacher's class k
    train, valid = tokenize_task(train, tokenizer, data, labels), tokenize_task(valid, tokenizer, data, labels)
    collator = DataCollatorWithPadding(tokenizer)
    needs_teacher = args.kd_weight > 0 or bool(args.terms)
    if needs_teacher and recipe.cache_teacher and not args.terms:
        train = cache_task_logits(teacher, train, collator, recipe.cache_dir, progress=not args.disable_tqdm)
    trainer = DistillationTrainer(model=student, teacher_model=teacher if needs_teacher else None, args=args,
                                  train_dataset=train, eval_dataset=valid, data_collator=collator,
                                  processing_class=tokenizer, compute_metrics=compute_metrics)

    # 3. Train, evaluate and write results.json.
    train_and_report(trainer, results, start, student=student, teacher=teacher, train=train, valid=valid,
                     collator=collator, evaluate_teacher=recipe.evaluate_teacher)


if __name__ == "__main__":
    run_main(main)
