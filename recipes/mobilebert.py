"""MobileBERT recipe (Sun et al. 2020, "MobileBERT: a Compact Task-Agnostic BERT for Resource-Limited Devices").

    python recipes/mobilebert.py --config recipes/configs/mobilebert_sst2.yaml --output_dir out

What the paper and the official code (google-research `mobilebert`) do:
- teacher: IB-BERT_LARGE, a BERT-large with bottlenecks so that its inter-block width (512) equals the
  student's; student: MobileBERT, as deep as the teacher (24 blocks), inter-block width 512, a 128-wide
  bottleneck inside each block where attention and 4 stacked feed-forward networks run, 4 heads, NoNorm,
  128-d trigram embeddings;
- progressive knowledge transfer (§3.5): one stage per block; stage k trains block k on feature-map transfer
  (MSE of the block outputs) plus attention transfer (KL of the per-head attention distributions), the blocks
  below frozen (optional in the official TF2 code); then pre-training distillation (MLM + NSP + logit KD),
  then fine-tuning per task.

What this recipe does (one command):
1. a random MobileBERT-architecture student (transformers' `MobileBertConfig`): as deep as the teacher, its
   inter-block width the teacher's hidden size (so the feature maps compare without a projection), the
   teacher's head count (so attention maps compare head to head), a smaller bottleneck and FFN stack;
2. progressive transfer from the pre-trained teacher on `corpus_files` (`hf_distill.students.progressive`:
   `progressive_epochs` per block, `freeze_lower`) unless `progressive_epochs` is 0 (the baseline);
3. fine-tuning on the task with the DistillationArguments' loss (logit KD from the fine-tuned teacher in
   the config), teacher logits cached.
What differs from the paper (and why): there is no IB-BERT here, so the teacher is the offline MiniLM-L6
(6 blocks, hidden 384, 12 heads) and the student follows its shape, not MobileBERT's 24 x 512 / 4 heads;
the corpus is WikiText-2, not BooksCorpus + Wikipedia; the pre-training distillation step (MLM + NSP +
logit KD on the corpus) is left out: the offline teacher has no trained MLM head to distil from.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from common import (
    STUDENT_FIELDS,
    DataArguments,
    ModelArguments,
    cache_task_logits,
    command_line,
    compute_metrics,
    fail,
    load_corpus,
    load_model,
    load_task,
    load_tokenizer,
    parse_args,
    refuse_unused,
    run_main,
    set_offline_defaults,
    task_labels,
    tokenize_task,
    train_and_report,
)

from hf_distill import DistillationArguments, DistillationTrainer


@dataclass
class MobileBertArguments:
    """The student's bottleneck shape and the progressive stage; the task step: the DistillationArguments."""

    bottleneck_size: int = field(default=128, metadata={"help": "Intra-block bottleneck width (paper: 128), where "
                                                        "attention and the FFNs run; divisible by the heads."})
    ffn_size: int = field(default=512, metadata={"help": "Width of each stacked FFN (paper: 512)."})
    num_ffn: int = field(default=4, metadata={"help": "Stacked FFNs per block (paper: 4)."})
    embedding_size: int = field(default=128, metadata={"help": "Trigram embedding width (paper: 128)."})
    progressive_epochs: float = field(default=1.0, metadata={"help": "Epochs of the corpus per block in the "
                                                             "progressive stage (0: no progressive stage)."})
    progressive_learning_rate: float = field(default=1e-3, metadata={"help": "Peak lr of each progressive stage "
                                                                     "(warm-up then linear decay)."})
    freeze_lower: bool = field(default=True, metadata={"help": "Freeze the blocks below the one being trained "
                                                       "(and the embeddings after stage 1), as in the paper."})
    cache_teacher: bool = field(default=True, metadata={"help": "Task step: cache the teacher's logits."})
    cache_dir: str = field(default=".cache/hf_distill", metadata={"help": "Where cached teacher outputs go."})
    evaluate_teacher: bool = field(default=True, metadata={"help": "Also report the teacher's accuracy."})


def student_config(teacher_config, recipe: MobileBertArguments, **labels):
    """A MobileBERT config shaped by the teacher: same depth, heads, vocabulary and inter-block width."""
    from transformers import MobileBertConfig

    heads = teacher_config.num_attention_heads
    if recipe.bottleneck_size % heads:
        fail(f"bottleneck_size ({recipe.bottleneck_size}) must be divisible by the teacher's {heads} heads: the "
             "attention maps are compared head to head")
    return MobileBertConfig(
        vocab_size=teacher_config.vocab_size, hidden_size=teacher_config.hidden_size,
        num_hidden_layers=teacher_config.num_hidden_layers, num_attention_heads=heads,
        intra_bottleneck_size=recipe.bottleneck_size, intermediate_size=recipe.ffn_size,
        num_feedforward_networks=recipe.num_ffn, embedding_size=recipe.embedding_size,
        max_position_embeddings=teacher_config.max_position_embeddings,
        type_vocab_size=teacher_config.type_vocab_size, pad_token_id=teacher_config.pad_token_id, **labels)


def progressive_transfer(margs, data, recipe, args, tokenizer, config) -> tuple[str, list[str]]:
    """The random student, block by block, from the pre-trained teacher on the corpus; returns its folder."""
    import torch
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

    from hf_distill.students.progressive import progressive_stages

    # Sequence-classification wrappers give both models `logits`; their heads are never trained or used here.
    teacher = load_model(AutoModelForSequenceClassification, margs.general_teacher or margs.teacher, "teacher")
    torch.manual_seed(args.seed if margs.model_seed is None else margs.model_seed)
    student = AutoModelForSequenceClassification.from_config(config)
    try:
        terms, switch = progressive_stages(student, teacher, epochs_per_stage=recipe.progressive_epochs,
                                           learning_rate=recipe.progressive_learning_rate,
                                           freeze_lower=recipe.freeze_lower)
    except ValueError as err:
        fail(str(err))
    corpus = load_corpus(data, tokenizer)
    pargs = dataclasses.replace(
        args, output_dir=f"{args.output_dir}/progressive", num_train_epochs=recipe.progressive_epochs * len(
            switch.stages), learning_rate=recipe.progressive_learning_rate, distill_preset=None, kd_weight=0.0,
        task_weight=0.0, distill_terms=terms, eval_strategy="no", train_sampling_strategy="random", max_steps=-1,
        load_best_model_at_end=False, projection="none")
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=pargs, train_dataset=corpus,
                                  data_collator=DataCollatorWithPadding(tokenizer), processing_class=tokenizer,
                                  callbacks=[switch])
    trainer.train()
    trainer.save_model()
    trainer.save_state()  # trainer_state.json: `hf-distill report` plots the stage
    return pargs.output_dir, switch.describe()


def main() -> None:
    set_offline_defaults()
    margs, data, recipe, args, config = parse_args(
        [ModelArguments, DataArguments, MobileBertArguments, DistillationArguments], __doc__.split("\n\n")[0])
    start = time.time()
    import torch
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, set_seed

    if not margs.teacher:
        fail("set teacher (the fine-tuned task teacher; general_teacher is the pre-trained one)")
    refuse_unused("MobileBERT", "the student is shaped by the teacher and bottleneck_size, ffn_size, num_ffn, "
                  "embedding_size", STUDENT_FIELDS, margs)
    if recipe.progressive_epochs < 0:
        fail(f"progressive_epochs must be >= 0, got {recipe.progressive_epochs:g}")
    if recipe.progressive_epochs > 0 and not data.corpus_files:
        fail("progressive_epochs > 0 needs corpus_files (the progressive stage distils on plain text)")
    if args.terms:
        fail("distill_terms: the task step of this recipe is logit KD; the progressive stage sets its own terms")
    set_seed(args.seed)
    tokenizer = load_tokenizer(margs.general_teacher or margs.teacher, "teacher")
    results = {"recipe": "mobilebert", "command": command_line(), "config": config}

    # 0. Task data and teacher first: a label the teacher does not know is refused before anything trains.
    train, valid = load_task(data)
    if train is None:
        fail("set train_file (or dataset_name): the recipe ends with task fine-tuning")
    teacher = load_model(AutoModelForSequenceClassification, margs.teacher, "teacher")
    labels = task_labels(train, valid, data, teacher)
    labels.apply(teacher, "teacher")
    results["id2label"] = labels.id2label
    config_ = student_config(teacher.config, recipe, **labels.config_kwargs())

    # 1. Progressive transfer (or none: the baseline starts the task step from random weights).
    if recipe.progressive_epochs > 0:
        t0 = time.time()
        folder, stages = progressive_transfer(margs, data, recipe, args, tokenizer, config_)
        results.update(progressive_epochs=recipe.progressive_epochs, freeze_lower=recipe.freeze_lower,
                       progressive_student=folder, progressive_s=time.time() - t0, stages=stages)
        student = AutoModelForSequenceClassification.from_pretrained(folder, **labels.config_kwargs(),
                                                                     ignore_mismatched_sizes=True)
    else:
        torch.manual_seed(args.seed if margs.model_seed is None else margs.model_seed)
        student = AutoModelForSequenceClassification.from_config(config_)
    labels.apply(student, "student")
    results["student_shape"] = {k: getattr(student.config, k) for k in (
        "num_hidden_layers", "hidden_size", "intra_bottleneck_size", "true_hidden_size", "num_attention_heads",
        "intermediate_size", "num_feedforward_networks", "embedding_size")}

    # 2. Task fine-tuning with the DistillationArguments' loss.
    train, valid = tokenize_task(train, tokenizer, data, labels), tokenize_task(valid, tokenizer, data, labels)
    collator = DataCollatorWithPadding(tokenizer)
    if args.kd_weight > 0 and recipe.cache_teacher:
        train = cache_task_logits(teacher, train, collator, recipe.cache_dir, progress=not args.disable_tqdm,
                                  bf16=bool(args.bf16) and args.device.type == "cpu")
    args = dataclasses.replace(args, distill_preset=None)
    trainer = DistillationTrainer(model=student, teacher_model=teacher if args.kd_weight > 0 else None, args=args,
                                  train_dataset=train, eval_dataset=valid, data_collator=collator,
                                  processing_class=tokenizer, compute_metrics=compute_metrics)
    train_and_report(trainer, results, start, student=student, teacher=teacher, train=train, valid=valid,
                     collator=collator, evaluate_teacher=recipe.evaluate_teacher)


if __name__ == "__main__":
    run_main(main)
