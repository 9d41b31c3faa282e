"""TinyBERT recipe (Jiao et al. 2020, "TinyBERT: Distilling BERT for Natural Language Understanding").

    python recipes/tinybert.py --config recipes/configs/tinybert_sst2.yaml --output_dir out

What the paper and the reference code (huawei-noah `Pretrained-Language-Model/TinyBERT`) do:
- a randomly initialised small student (TinyBERT4: 4 layers, hidden 312, 12 heads, FFN 1200);
- general distillation (`general_distill.py`): pre-trained BERT-base teacher, large corpus, loss =
  hidden-state MSE (embeddings included, one shared projection `fit_dense`) + pre-softmax attention-score
  MSE, uniform layer map m <- m * L_T / L_S, no prediction loss;
- data augmentation (`data_augmentation.py`): N copies of each task sentence (SST-2: N = 20, p = 0.4,
  M = 15) with words replaced by masked-LM predictions or GloVe neighbours;
- task distillation in two runs of `task_distill.py` from a fine-tuned teacher on the augmented data:
  step 1 the intermediate terms (10 epochs, constant lr 5e-5), step 2 the prediction layer, soft
  cross-entropy at T = 1 without labels (3 epochs, lr 3e-5, linear schedule with 10% warm-up).

What this recipe does (one command):
1. general distillation on `corpus_files` when `general_epochs > 0`: the same intermediate terms between
   the general teacher and a `students.shrink` student; with `incremental_epochs > 0` a second general phase
   follows in the same Trainer (`StageSwitchCallback`, so a checkpoint resumes in the right phase):
   hidden + attention + `incremental_weight` x `incremental_mse` (incremental feature distillation: each
   student layer also learns the difference between its teacher layer and the next mapped one, the top layer
   the teacher feature itself; same hidden map and projection), with its own linear schedule and warm-up and a
   fresh optimizer state, as if it were a second run started from the first phase's student;
2. augmentation when `augment_n > 0` (`hf_distill.data.augment`), of the first `augment_rows` training rows;
3. task distillation with `StageSwitchCallback`: stage 1 (hidden + attention terms) for
   `intermediate_epochs`, then stage 2 (the DistillationArguments' logit loss: soft_ce, T = 1, no labels in
   the configs) with its own learning rate, linear decay, 10% warm-up and a fresh optimizer state; the
   teacher's logits on the (augmented) rows are computed once (`cache_teacher`), so stage 2 runs the student
   only, while stage 1 runs the teacher online (its attention scores need Q/K, which are never cached).
Deliberate differences (and why):
- layer maps are fields (`hidden_layer_map`, `attention_layer_map`): `uniform` needs L_T / L_S to be an
  integer; the SST-2 config maps a 4-layer student onto the 6-layer teacher explicitly (0,2,3,5,6);
- the augmentation MLM: the offline teacher has no MLM head, so when the masked LM lacks one the recipe
  first fits it on the corpus with the encoder frozen (`mlm_head_steps`), and the "GloVe" neighbours come
  from the MLM's own word embeddings (hf_distill.data.augment says why);
- N and the number of augmented rows are chosen to fit a CPU budget (the configs say which);
- the stage-1 projection starts fresh (the reference carries `fit_dense` over from general distillation);
- both stages run in one Trainer; the augmented rows are shuffled once (seeded), then consumed in order.
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
    check_model_path,
    command_line,
    compute_metrics,
    fail,
    fit_mlm_head,
    load_corpus,
    load_model,
    load_task,
    load_tokenizer,
    order_seed,
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
class TinyBertArguments:
    """General distillation, augmentation and the two task stages (stage 2's loss: the DistillationArguments)."""

    hidden_layer_map: str = field(
        default="uniform", metadata={"help": "Hidden-state map: uniform, or student:teacher pairs with 0 = "
                                     "embeddings, e.g. '0:0;1:2;2:3;3:5;4:6'."}
    )
    attention_layer_map: str = field(
        default="uniform", metadata={"help": "Attention-score map (blocks 1..L), e.g. '1:2;2:3;3:5;4:6'."}
    )
    general_epochs: float = field(default=0.0, metadata={"help": "Epochs of general distillation (0: skip)."})
    general_learning_rate: float = field(default=5e-5, metadata={"help": "General step lr (reference: 5e-5)."})
    general_warmup_ratio: float = field(default=0.1, metadata={"help": "General step warm-up share (ref.: 0.1)."})
    incremental_epochs: float = field(
        default=0.0, metadata={"help": "Epochs of a second general phase after the first (0: none): hidden + "
                               "attention + incremental_weight x incremental_mse (incremental feature distillation)."}
    )
    incremental_weight: float | None = field(
        default=None, metadata={"help": "lambda, the weight of incremental_mse in the second general phase (>= 0; "
                                "default 1.0 when incremental_epochs > 0)."}
    )
    incremental_learning_rate: float | None = field(
        default=None, metadata={"help": "Peak lr of the second general phase; default: general_learning_rate."}
    )
    augment_n: int = field(default=0, metadata={"help": "Augmented copies per sentence (paper: 20; 0: none)."})
    augment_p: float = field(default=0.4, metadata={"help": "Replacement probability per word (paper: 0.4)."})
    augment_m: int = field(default=15, metadata={"help": "Candidates per word (paper: 15)."})
    augment_rows: int | None = field(default=None, metadata={"help": "Augment only the first N training rows."})
    augment_mlm: str | None = field(
        default=None, metadata={"help": "Masked LM giving the candidates; default: the general teacher."}
    )
    mlm_head_steps: int = field(
        default=200, metadata={"help": "If the augmentation MLM has no trained head, fit one for this many steps "
                               "on the corpus (encoder frozen)."}
    )
    intermediate_epochs: float = field(
        default=1.0, metadata={"help": "Task stage 1 (intermediate terms) epochs; the rest of num_train_epochs "
                               "is stage 2 (prediction layer). 0: one stage with the DistillationArguments' loss."}
    )
    prediction_learning_rate: float | None = field(
        default=None, metadata={"help": "Stage 2 peak lr (reference: 3e-5); default: learning_rate."}
    )
    cache_teacher: bool = field(
        default=True, metadata={"help": "Stage 2: compute the teacher's logits on the (augmented) rows once "
                                "(hf_distill.data.cache), so the prediction stage runs the student only."}
    )
    cache_dir: str = field(default=".cache/hf_distill", metadata={"help": "Where cached datasets go."})
    evaluate_teacher: bool = field(default=True, metadata={"help": "Also report the teacher's accuracy."})


def intermediate_terms(recipe: TinyBertArguments, weight: float = 1.0) -> list[dict]:
    """TinyBERT's intermediate loss: hidden-state MSE (embeddings included) + attention-score MSE."""
    return [{"loss": "hidden_mse", "layers": recipe.hidden_layer_map, "weight": weight, "name": "hidden"},
            {"loss": "attention_score_mse", "layers": recipe.attention_layer_map, "weight": weight,
             "name": "attention"}]


def incremental_term(recipe: TinyBertArguments, weight: float = 0.0) -> dict:
    """The second general phase's extra term, on the hidden-state map (so through the same projection)."""
    return {"loss": "incremental_mse", "layers": recipe.hidden_layer_map, "weight": weight, "name": "incremental"}


def check_general(recipe: TinyBertArguments, data: DataArguments) -> None:
    """Refuse general phases that cannot run, before anything is loaded."""
    from hf_distill.losses.terms import parse_term

    if not 0 <= recipe.general_warmup_ratio < 1:
        fail(f"general_warmup_ratio is a share of the general steps, in [0, 1): got {recipe.general_warmup_ratio:g}")
    if recipe.incremental_epochs < 0:
        fail(f"incremental_epochs must be >= 0, got {recipe.incremental_epochs:g}")
    if recipe.incremental_weight is not None and recipe.incremental_weight < 0:
        fail(f"incremental_weight (lambda) must be >= 0, got {recipe.incremental_weight:g}")
    if recipe.incremental_epochs == 0:
        if recipe.incremental_weight is not None or recipe.incremental_learning_rate is not None:
            fail("incremental_weight / incremental_learning_rate are set but incremental_epochs is 0: set "
                 "incremental_epochs > 0 to run the incremental phase, or drop them")
        return
    if not data.corpus_files or recipe.general_epochs <= 0:
        fail("incremental_epochs > 0 runs a second general-distillation phase after the first: it needs "
             "corpus_files and general_epochs > 0")
    if recipe.incremental_learning_rate is not None and recipe.incremental_learning_rate <= 0:
        fail(f"incremental_learning_rate must be > 0, got {recipe.incremental_learning_rate:g}")
    try:
        parse_term(incremental_term(recipe))
    except ValueError as e:
        fail(f"hidden_layer_map {recipe.hidden_layer_map!r} cannot drive incremental_mse: {e}")


def general_stages(recipe: TinyBertArguments) -> list:
    """The general phase, and with `incremental_epochs` the incremental phase after it, as `Stage`s: each with
    its own linear schedule and warm-up (the phases' lengths differ), the second with a fresh optimizer state."""
    from hf_distill.callbacks import Stage

    names = [t["name"] for t in intermediate_terms(recipe)]
    incremental = recipe.incremental_epochs > 0
    # The last stage's end is the run's (until_epoch only labels it in the card's stage list).
    first = Stage(until_epoch=recipe.general_epochs, name="general",
                  term_weights={**dict.fromkeys(names, 1.0), **({"incremental": 0.0} if incremental else {})},
                  learning_rate=recipe.general_learning_rate, lr_scheduler_type="linear",
                  warmup_ratio=recipe.general_warmup_ratio)
    if not incremental:
        return [first]
    weight = 1.0 if recipe.incremental_weight is None else recipe.incremental_weight
    end = recipe.general_epochs + recipe.incremental_epochs
    return [first, Stage(until_epoch=end, name="general_incremental",
                         term_weights={**dict.fromkeys(names, 1.0), "incremental": weight},
                         learning_rate=recipe.incremental_learning_rate or recipe.general_learning_rate,
                         lr_scheduler_type="linear", warmup_ratio=recipe.general_warmup_ratio, reset_optimizer=True)]


def general_distillation(margs, data, recipe, args, tokenizer, corpus) -> tuple[str, list[str]]:
    """Intermediate-layer distillation of a random student from the pre-trained teacher on the corpus, then
    (`incremental_epochs`) the incremental phase in the same run. Returns the student folder and the phases."""
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

    from hf_distill.callbacks import StageSwitchCallback

    # Sequence-classification wrappers give both models `logits`; the head is never trained or used here.
    teacher = load_model(AutoModelForSequenceClassification, margs.general_teacher or margs.teacher, "teacher")
    student = build_student(margs, teacher, AutoModelForSequenceClassification, args.seed)
    stages = general_stages(recipe)
    terms, callbacks = intermediate_terms(recipe), []
    if len(stages) > 1:  # the stage switch sets each phase's weights and lr schedule
        terms.append(incremental_term(recipe))
        callbacks.append(StageSwitchCallback(stages))
    gargs = dataclasses.replace(
        args, output_dir=f"{args.output_dir}/general",
        num_train_epochs=recipe.general_epochs + recipe.incremental_epochs,
        learning_rate=recipe.general_learning_rate, warmup_steps=recipe.general_warmup_ratio,
        lr_scheduler_type="linear", distill_preset=None, kd_weight=0.0, task_weight=0.0,
        distill_terms=terms, eval_strategy="no", train_sampling_strategy="random",
        load_best_model_at_end=False,
    )
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=gargs, train_dataset=corpus,
                                  data_collator=DataCollatorWithPadding(tokenizer), processing_class=tokenizer,
                                  callbacks=callbacks)
    trainer.train()
    trainer.save_model()
    trainer.save_state()  # trainer_state.json: `hf-distill report` plots the stage
    return gargs.output_dir, [s.describe() for s in stages]


def augment(train, data, recipe, margs, args, tokenizer, corpus):
    """TinyBERT augmentation of the first `augment_rows` rows (each followed by its copies), then the rest;
    shuffled once with the run's seed so that batches do not hold one sentence's copies."""
    import datasets
    from transformers import AutoModelForMaskedLM

    from hf_distill.data.augment import augment_dataset

    source = recipe.augment_mlm or margs.general_teacher or margs.teacher
    mlm, info = AutoModelForMaskedLM.from_pretrained(source, output_loading_info=True)
    if info["missing_keys"]:
        if corpus is None or recipe.mlm_head_steps <= 0:
            print(f"warning: {source} has no trained MLM head and no corpus/mlm_head_steps to fit one: "
                  "augmentation candidates of single-piece words will be random words.")
        else:
            print(f"{source} has no trained MLM head: fitting one for {recipe.mlm_head_steps} steps on the corpus "
                  "(encoder frozen).")
            fit_mlm_head(mlm, info["missing_keys"], corpus, tokenizer, recipe.mlm_head_steps, args.seed, args.bf16)
    k = min(recipe.augment_rows or len(train), len(train))
    columns = [data.text_column] + ([data.text_pair_column] if data.text_pair_column else [])
    import torch

    with torch.autocast("cpu", torch.bfloat16, enabled=bool(args.bf16) and args.device.type == "cpu"):
        augmented = augment_dataset(train.select(range(k)), mlm, tokenizer, text_columns=columns,
                                    n=recipe.augment_n, p=recipe.augment_p, m=recipe.augment_m, seed=args.seed)
    if k < len(train):
        augmented = datasets.concatenate_datasets([augmented, train.select(range(k, len(train)))])
    return augmented.shuffle(seed=order_seed(args)).flatten_indices()


def main() -> None:
    set_offline_defaults()
    margs, data, recipe, args, config = parse_args(
        [ModelArguments, DataArguments, TinyBertArguments, DistillationArguments], __doc__.split("\n\n")[0])
    start = time.time()
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, set_seed

    from hf_distill.callbacks import Stage, StageSwitchCallback

    if not margs.teacher:
        fail("set teacher (the fine-tuned task teacher; general_teacher is the pre-trained one)")
    check_general(recipe, data)
    if recipe.augment_n > 0:
        check_model_path("augment_mlm", recipe.augment_mlm)
    set_seed(args.seed)
    tokenizer = load_tokenizer(margs.general_teacher or margs.teacher, "teacher")
    results = {"recipe": "tinybert", "command": command_line(), "config": config}
    corpus = load_corpus(data, tokenizer) if data.corpus_files else None

    # 0. Task data and teacher first: a label the teacher does not know is refused before anything trains.
    train, valid = load_task(data)
    if train is not None:
        teacher = load_model(AutoModelForSequenceClassification, margs.teacher, "teacher")
        labels = task_labels(train, valid, data, teacher)
        labels.apply(teacher, "teacher")
        results["id2label"] = labels.id2label

    # 1. General distillation: a random student learns the pre-trained teacher's intermediate layers.
    if corpus is not None and recipe.general_epochs > 0:
        t0 = time.time()
        general_dir, phases = general_distillation(margs, data, recipe, args, tokenizer, corpus)
        margs = dataclasses.replace(margs, student=general_dir, student_layers=None)
        results.update(general_epochs=recipe.general_epochs, general_student=general_dir,
                       general_s=time.time() - t0, corpus_blocks=len(corpus), general_stages=phases,
                       stages=list(phases))  # the card's stage list: general phase(s), then the task stages
        if recipe.incremental_epochs > 0:
            results.update(incremental_epochs=recipe.incremental_epochs,
                           incremental_weight=1.0 if recipe.incremental_weight is None else recipe.incremental_weight)

    # 2. Task data, augmented.
    if train is None:
        results["wall_s"] = time.time() - start
        write_results(args.output_dir, results)
        return
    if recipe.augment_n > 0:
        t0 = time.time()
        rows = len(train)
        train = augment(train, data, recipe, margs, args, tokenizer, corpus)
        results.update(augment={"n": recipe.augment_n, "p": recipe.augment_p, "m": recipe.augment_m,
                                "rows_augmented": min(recipe.augment_rows or rows, rows), "rows_in": rows},
                       augmented_rows=len(train), augment_s=time.time() - t0)
    student = build_student(margs, teacher, AutoModelForSequenceClassification, args.seed, **labels.config_kwargs(),
                            ignore_mismatched_sizes=True)
    labels.apply(student, "student")  # the student's class k is the teacher's class k
    train, valid = tokenize_task(train, tokenizer, data, labels), tokenize_task(valid, tokenizer, data, labels)

    # 3. Task distillation: stage 1 intermediate layers, stage 2 prediction layer, one Trainer run.
    callbacks = []
    if recipe.intermediate_epochs > 0:
        if recipe.intermediate_epochs >= args.num_train_epochs:
            fail(f"intermediate_epochs ({recipe.intermediate_epochs:g}) must be < num_train_epochs "
                 f"({args.num_train_epochs:g}): stage 2 trains the classifier")
        names = [t["name"] for t in intermediate_terms(recipe)]
        switch = StageSwitchCallback([
            Stage(until_epoch=recipe.intermediate_epochs, kd_weight=0.0, task_weight=0.0,
                  term_weights=dict.fromkeys(names, 1.0), learning_rate=args.learning_rate,
                  lr_scheduler_type="constant", name="intermediate"),
            Stage(kd_loss=args.kd_loss, temperature=args.temperature, kd_weight=args.kd_weight,
                  task_weight=args.task_weight, term_weights=dict.fromkeys(names, 0.0),
                  learning_rate=recipe.prediction_learning_rate or args.learning_rate, lr_scheduler_type="linear",
                  warmup_ratio=0.1, reset_optimizer=True, name="prediction"),
        ])
        args = dataclasses.replace(args, distill_preset=None, distill_terms=intermediate_terms(recipe))
        callbacks.append(switch)
        results["stages"] = results.get("stages", []) + switch.describe()
    needs_teacher = args.kd_weight > 0 or bool(args.terms)
    collator = DataCollatorWithPadding(tokenizer)
    if args.kd_weight > 0 and recipe.cache_teacher:
        # Stage 1 still runs the teacher (attention scores need its Q/K); stage 2 reads these logits instead.
        train = cache_task_logits(teacher, train, collator, recipe.cache_dir, progress=not args.disable_tqdm,
                                  bf16=bool(args.bf16) and args.device.type == "cpu")
        results["cached_teacher_logits"] = len(train)
    trainer = DistillationTrainer(model=student, teacher_model=teacher if needs_teacher else None, args=args,
                                  train_dataset=train, eval_dataset=valid, data_collator=collator,
                                  processing_class=tokenizer, compute_metrics=compute_metrics, callbacks=callbacks)

    # 4. Train, evaluate and write results.json.
    results["intermediate_epochs"] = recipe.intermediate_epochs
    train_and_report(trainer, results, start, student=student, teacher=teacher, train=train, valid=valid,
                     collator=collator, evaluate_teacher=recipe.evaluate_teacher)

if __name__ == "__main__":
    run_main(main)
