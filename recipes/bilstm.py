"""Distilled BiLSTM recipe (Tang et al. 2019, "Distilling Task-Specific Knowledge from BERT into Simple Neural
Networks").

    python recipes/bilstm.py --config recipes/configs/bilstm_sst2.yaml --teacher TEACHER --output_dir out

What the paper does (§3-§4, SST-2):
- student: one BiLSTM layer (150 units per direction) over 300-d word2vec embeddings, the two final states
  concatenated, a 200-unit ReLU layer, a linear classifier (`hf_distill.students.bilstm`);
- loss: `alpha * CE + (1 - alpha) * ||z_teacher - z_student||^2` (squared error of the logits, summed over
  classes); the augmented copies, which have no gold label, take the teacher's predicted class for CE;
- transfer set: the training data plus `n_iter = 20` copies per sentence made by masking (p = 0.1),
  POS-guided replacement (p = 0.1) and n-gram sampling (p = 0.25, n in [1, 5]) (`hf_distill.data.tang_augment`);
- Adadelta (lr 1.0, rho 0.95), batch 50;
- baseline: the same BiLSTM trained with CE on the original data (here: `--kd_weight 0 --task_weight 1
  --n_iter 0`).

What this recipe does differently (and why):
- embeddings: the teacher's own 384-d WordPiece embeddings (word2vec is not available offline); the student
  reads the teacher's token ids, so one tokenizer serves both (`embedding_init: random` for a cold start);
- POS-guided replacement is off in the config (`p_pos: 0`): it needs a POS tagger, and none is available
  offline here. `--pos_tagger nltk` turns it on where NLTK and its `averaged_perceptron_tagger_eng` data are
  installed; the recipe refuses `p_pos > 0` without a tagger instead of skipping the rule;
- `alpha` is not stated as one number in the paper; the config uses 0.5, written as the library's weights:
  `task_weight = alpha`, `kd_weight = (1 - alpha) * num_labels` (the library's `mse` averages over classes);
- budget: the copies are made of the first `augment_rows` training rows (the config says how many).
Save and load: the student is a `transformers` model; `trainer.save_model()` writes it, and
`import hf_distill.students.bilstm` registers it so `AutoModelForSequenceClassification.from_pretrained(out)` loads it.
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
    load_model,
    load_task,
    load_tokenizer,
    order_seed,
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
class BiLSTMArguments:
    """The student's sizes, the augmentation rules and the optimizer (the loss: the DistillationArguments)."""

    lstm_hidden_size: int = field(default=150, metadata={"help": "LSTM units per direction (paper, SST-2: 150)."})
    classifier_size: int = field(default=200, metadata={"help": "ReLU layer before the classifier (paper: 200)."})
    dropout: float = field(default=0.0, metadata={"help": "Dropout on the BiLSTM features and the ReLU layer."})
    embedding_init: str = field(default="teacher", metadata={"help": "teacher (copy the teacher's word "
                                                             "embeddings) or random."})
    n_iter: int = field(default=20, metadata={"help": "Augmentation draws per sentence (paper: 20; 0: none)."})
    p_mask: float = field(default=0.1, metadata={"help": "Masking probability per word (paper: 0.1)."})
    p_pos: float = field(default=0.1, metadata={"help": "POS-guided replacement probability per word (paper: "
                                                "0.1); needs pos_tagger."})
    p_ng: float = field(default=0.25, metadata={"help": "n-gram sampling probability per copy (paper: 0.25)."})
    ngram_max: int = field(default=5, metadata={"help": "n-gram sampling draws n from 1..ngram_max (paper: 5)."})
    augment_rows: int | None = field(default=None, metadata={"help": "Augment only the first N training rows."})
    pos_tagger: str | None = field(default=None, metadata={"help": "nltk: NLTK's perceptron tagger (its data "
                                                           "must be installed). Needed when p_pos > 0."})
    adadelta: bool = field(default=True, metadata={"help": "Adadelta (rho 0.95, no weight decay) at learning_rate, "
                                                   "as the paper (optim and adam_* do not apply); false: the "
                                                   "Trainer's optimizer (optim)."})
    cache_teacher: bool = field(default=True, metadata={"help": "Compute the teacher's logits once "
                                                        "(hf_distill.data.cache); they also label the copies."})
    cache_dir: str = field(default=".cache/hf_distill", metadata={"help": "Where cached datasets go."})
    evaluate_teacher: bool = field(default=True, metadata={"help": "Also report the teacher's accuracy."})


def nltk_tagger():
    """NLTK's averaged-perceptron tagger as `words -> tags`, or a clear failure naming what is missing."""
    try:
        import nltk

        nltk.pos_tag(["a", "test"])
    except (ImportError, LookupError) as err:
        fail(f"pos_tagger nltk: {type(err).__name__}: {str(err).strip().splitlines()[0]} -- install nltk and its "
             "tagger data (nltk.download('averaged_perceptron_tagger_eng')), or set p_pos 0")
    return lambda words: [tag for _, tag in nltk.pos_tag(words)]


def check(margs: ModelArguments, recipe: BiLSTMArguments, data: DataArguments, args: DistillationArguments) -> None:
    """Everything that can be refused before a model loads."""
    refuse_unused("BiLSTM", "its student is built by hf_distill.students.bilstm from lstm_hidden_size, "
                  "classifier_size and "
                  "the teacher's embeddings; no general distillation",
                  ("general_teacher", *STUDENT_FIELDS, "corpus_files"), margs, data)
    if data.text_pair_column:
        fail("the BiLSTM student reads one sentence: sentence pairs need the paper's siamese model (not built)")
    if recipe.embedding_init not in ("teacher", "random"):
        fail(f"embedding_init must be teacher or random, got {recipe.embedding_init!r}")
    if recipe.p_pos > 0 and recipe.pos_tagger is None and recipe.n_iter > 0:
        fail("p_pos > 0 needs a POS tagger: set pos_tagger nltk (with NLTK's tagger data installed) or p_pos 0")
    if recipe.pos_tagger not in (None, "nltk"):
        fail(f"pos_tagger must be nltk (or unset), got {recipe.pos_tagger!r}")
    if args.terms:
        fail("the BiLSTM student has no transformer layers: distill_terms cannot apply (logits only)")
    if args.kd_weight > 0 and args.kd_loss != "mse":
        print(f"note: kd_loss {args.kd_loss} (the paper's is mse)")
    for name in ("p_mask", "p_pos", "p_ng"):
        if not 0 <= getattr(recipe, name) <= 1:
            fail(f"{name} must be in [0, 1], got {getattr(recipe, name):g}")
    if recipe.p_mask + recipe.p_pos > 1:
        fail(f"p_mask + p_pos must be <= 1 (one draw per word decides between them), got {recipe.p_mask:g} + "
             f"{recipe.p_pos:g}")
    if recipe.ngram_max < 1 or recipe.n_iter < 0:
        fail(f"need ngram_max >= 1 and n_iter >= 0, got ngram_max {recipe.ngram_max}, n_iter {recipe.n_iter}")
    if recipe.augment_rows is not None and recipe.augment_rows < 1:
        fail(f"augment_rows must be >= 1 (unset: every row), got {recipe.augment_rows}")
    if recipe.adadelta and args.weight_decay:
        fail(f"weight_decay {args.weight_decay:g} with adadelta: the recipe's Adadelta has no weight decay (the "
             "paper's had none); set weight_decay 0, or adadelta false for the Trainer's optimizer")
    if recipe.n_iter > 0 and not recipe.cache_teacher:
        fail("augmentation needs cache_teacher true: the copies have no gold label and take the teacher's class "
             "from its cached logits")


def relabel_copies(train, flags: list[int]):
    """The paper's rule: a copy's CE target is the teacher's predicted class; original rows keep theirs."""
    import numpy as np

    from hf_distill.data.cache import LOGITS_COLUMN

    predicted = np.asarray(train[LOGITS_COLUMN], dtype=np.float32).argmax(-1)
    gold = np.asarray(train["labels"])
    labels = np.where(np.asarray(flags) == 1, predicted.astype(gold.dtype), gold)
    return train.remove_columns("labels").add_column("labels", labels.tolist())


def main() -> None:
    set_offline_defaults()
    margs, data, recipe, args, config = parse_args(
        [ModelArguments, DataArguments, BiLSTMArguments, DistillationArguments], __doc__.split("\n\n")[0])
    start = time.time()
    import torch
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, set_seed

    from hf_distill.data.tang_augment import AUGMENTED_COLUMN, tang_augment_dataset
    from hf_distill.students import bilstm

    if not margs.teacher:
        fail("set teacher (the fine-tuned task teacher: its logits are the target, its tokenizer the student's)")
    check(margs, recipe, data, args)
    tagger = nltk_tagger() if recipe.pos_tagger == "nltk" and recipe.p_pos > 0 and recipe.n_iter > 0 else None
    set_seed(args.seed)
    tokenizer = load_tokenizer(margs.teacher, "teacher")
    tokenizer.padding_side = "right"  # the packed LSTM reads each row from its first token
    results = {"recipe": "bilstm", "command": command_line(), "config": config}

    # 1. Task data, teacher, student.
    train, valid = load_task(data)
    if train is None:
        fail("set train_file (or dataset_name): the Distilled BiLSTM is task distillation")
    teacher = load_model(AutoModelForSequenceClassification, margs.teacher, "teacher")
    labels = task_labels(train, valid, data, teacher)
    labels.apply(teacher, "teacher")
    if teacher.config.num_labels < 2:
        fail("the BiLSTM recipe distils classifiers (copies take the teacher's class); this teacher has one output")
    student = bilstm.from_teacher(teacher, hidden_size=recipe.lstm_hidden_size,
                                  classifier_size=recipe.classifier_size, dropout=recipe.dropout,
                                  embedding_init=recipe.embedding_init,
                                  seed=args.seed if margs.model_seed is None else margs.model_seed)
    labels.apply(student, "student")
    results.update(id2label=labels.id2label, embedding_init=recipe.embedding_init)

    # 2. Transfer set: the rows plus Tang et al.'s copies of the first augment_rows of them.
    rows = len(train)
    if recipe.n_iter > 0:
        import datasets

        t0 = time.time()
        k = min(recipe.augment_rows or rows, rows)
        augmented = tang_augment_dataset(train.select(range(k)), tokenizer, text_column=data.text_column,
                                         n_iter=recipe.n_iter, p_mask=recipe.p_mask, p_pos=recipe.p_pos,
                                         p_ng=recipe.p_ng, ngram_range=(1, recipe.ngram_max), tagger=tagger,
                                         seed=args.seed)
        if k < rows:  # the rows not augmented (none when augment_rows covers the file: select(range(n, n)) fails)
            rest = train.select(range(k, rows)).add_column(AUGMENTED_COLUMN, [0] * (rows - k))
            augmented = datasets.concatenate_datasets([augmented, rest])
        train = augmented.shuffle(seed=order_seed(args)).flatten_indices()
        results["augment"] = {"n_iter": recipe.n_iter, "p_mask": recipe.p_mask, "p_pos": recipe.p_pos,
                              "p_ng": recipe.p_ng, "ngram_max": recipe.ngram_max, "rows_augmented": k,
                              "rows_in": rows, "rows_out": len(train), "pos_tagger": recipe.pos_tagger}
        results["augment_s"] = time.time() - t0
    flags = train[AUGMENTED_COLUMN] if AUGMENTED_COLUMN in train.column_names else [0] * len(train)
    train, valid = tokenize_task(train, tokenizer, data, labels), tokenize_task(valid, tokenizer, data, labels)

    # 3. Teacher logits once: the KD target, and the class of each copy.
    collator = DataCollatorWithPadding(tokenizer)
    needs_teacher = args.kd_weight > 0 or any(flags)
    if needs_teacher and recipe.cache_teacher:
        train = cache_task_logits(teacher, train, collator, recipe.cache_dir, progress=not args.disable_tqdm)
        if any(flags):
            train = relabel_copies(train, flags)
        if args.kd_weight == 0:  # the logits only labelled the copies
            train = train.remove_columns([c for c in train.column_names if c.startswith("teacher_")])
    optimizers = (None, None)
    if recipe.adadelta:
        optimizers = (torch.optim.Adadelta(student.parameters(), lr=args.learning_rate, rho=0.95), None)
    args = dataclasses.replace(args, distill_preset=None)
    trainer = DistillationTrainer(model=student, teacher_model=teacher if args.kd_weight > 0 else None, args=args,
                                  train_dataset=train, eval_dataset=valid, data_collator=collator,
                                  processing_class=tokenizer, compute_metrics=compute_metrics, optimizers=optimizers)

    # 4. Train, evaluate and write results.json.
    results.update(train_rows_original=rows, copies_relabelled_by_teacher=int(sum(flags)),
                   optimizer="adadelta (rho 0.95)" if recipe.adadelta else args.optim)
    train_and_report(trainer, results, start, student=student, teacher=teacher, train=train, valid=valid,
                     collator=collator, evaluate_teacher=recipe.evaluate_teacher)


if __name__ == "__main__":
    run_main(main)
