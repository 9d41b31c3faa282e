"""Causal-LM recipe: a half-depth pruned student distilled with the generalized JSD (GKD, off-policy) + its CE.

    python recipes/causal_lm.py --config recipes/configs/causal_lm_wikitext.yaml --output_dir runs/causal_lm
    python recipes/causal_lm.py --config recipes/configs/causal_lm_wikitext.yaml --teacher PATH_OR_HUB_ID

Steps:
1. the teacher: `--teacher` (tokenizer and `AutoModelForCausalLM` loaded from it), or, when none is given,
   one trained here: a small Llama-architecture model and a byte-level BPE tokenizer trained on the corpus
   (no decoder weights can be downloaded on the machines this was written on). It is cached in
   `teacher_cache_dir/<hash of its settings and corpus>`, so a second run reuses it;
2. the student: the teacher's most important `student_num_layers` blocks (default: half the depth), chosen by
   `students.prune_depth` on `calibration_batches` training blocks, copied bit-exactly;
3. distillation: `kd_weight * JSD_beta(teacher || student) + task_weight * CE` on the training blocks, or on
   the first `student_train_blocks` of them (labels = input_ids; position t is compared where token t+1 is
   predicted);
4. the baseline: the same pruned student trained with CE only (`kd_weight 0`), same steps, data and seed;
5. perplexity of the teacher and both students on the held-out file, written to `results.json`.

Why a byte-level BPE and not the offline MiniLM WordPiece vocabulary: the WordPiece one is uncased and
drops spacing, so it cannot write text back, and its 30,522 entries would make the LM head the largest
part of a 4-layer CPU student; a 4,096-entry BPE trained on the corpus round-trips the raw text exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import (
    command_line,
    fail,
    load_model,
    load_tokenizer,
    parse_args,
    run_length,
    run_main,
    set_offline_defaults,
    write_results,
)

from hf_distill import DistillationArguments, DistillationTrainer
from hf_distill.publish.report import distillation_facts

EOS = "<|endoftext|>"


@dataclass
class CausalLMArguments:
    """The teacher (given or trained here), the data, and the pruned student."""

    teacher: str | None = field(default=None, metadata={"help": "Teacher folder or Hub id (tokenizer + causal "
                                                        "LM). Unset: train a small Llama teacher on train_file."})
    train_file: str = field(default="../shared/data/wikitext2/wiki.valid.raw",
                            metadata={"help": "Plain-text training corpus (teacher training and distillation)."})
    eval_file: str = field(default="../shared/data/wikitext2/wiki.test.raw",
                           metadata={"help": "Held-out plain text for perplexity."})
    block_size: int = field(default=128, metadata={"help": "Tokens per training / evaluation block."})
    max_train_blocks: int | None = field(default=None, metadata={"help": "Use only the first N training blocks."})
    max_eval_blocks: int | None = field(default=None, metadata={"help": "Evaluate on the first N held-out blocks."})
    student_train_blocks: int | None = field(
        default=None, metadata={"help": "Distil (and train the CE-only baseline) on the first N training blocks only; "
                                "the teacher trained here still sees all of them, as a real teacher has seen more "
                                "text than the distillation set. Default: all."})
    student_num_layers: int | None = field(default=None, metadata={"help": "Student depth; default: half the "
                                                                   "teacher's (rounded up)."})
    calibration_batches: int = field(default=4, metadata={"help": "Training batches scoring the teacher's blocks."})
    run_baseline: bool = field(default=True, metadata={"help": "Also train the pruned student with CE only."})
    # The teacher trained here when `teacher` is unset.
    teacher_cache_dir: str = field(default=".cache/hf_distill/causal_teachers",
                                   metadata={"help": "Where trained teachers are kept, one folder per settings."})
    vocab_size: int = field(default=4096, metadata={"help": "Byte-level BPE vocabulary size."})
    teacher_layers: int = field(default=6, metadata={"help": "Teacher depth."})
    teacher_hidden_size: int = field(default=256, metadata={"help": "Teacher hidden size."})
    teacher_heads: int = field(default=4, metadata={"help": "Teacher attention heads."})
    teacher_kv_heads: int = field(default=2, metadata={"help": "Teacher key/value heads (GQA)."})
    teacher_intermediate_size: int = field(default=512, metadata={"help": "Teacher MLP size."})
    teacher_epochs: float = field(default=2.0, metadata={"help": "Epochs of teacher training."})
    teacher_learning_rate: float = field(default=2e-3, metadata={"help": "Teacher peak learning rate."})
    teacher_batch_size: int = field(default=16, metadata={"help": "Teacher batch size (blocks)."})


def read_text(path: str) -> str:
    if not Path(path).is_file():
        fail(f"text file {path} does not exist (train_file / eval_file)")
    return Path(path).read_text(encoding="utf-8")


def blocks(text: str, tokenizer, size: int, limit: int | None):
    """The text tokenised as one stream and cut into `size`-token blocks (the remainder dropped); labels =
    input_ids, as causal LMs shift them themselves."""
    import datasets

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    rows = [ids[i : i + size] for i in range(0, len(ids) - size + 1, size)][:limit]
    if not rows:
        fail(f"fewer than block_size={size} tokens of text: lower block_size or give a longer file")
    return datasets.Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * size] * len(rows),
                                       "labels": rows})


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE (GPT-2 style) trained on `text`, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.splitlines(keepends=True), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS)


def teacher_key(recipe: CausalLMArguments, text: str, seed: int, bf16: bool) -> dict:
    """Everything the trained teacher depends on; its hash names the cache folder."""
    names = ["vocab_size", "teacher_layers", "teacher_hidden_size", "teacher_heads", "teacher_kv_heads",
             "teacher_intermediate_size", "teacher_epochs", "teacher_learning_rate", "teacher_batch_size",
             "block_size", "max_train_blocks"]
    key = {n: getattr(recipe, n) for n in names}
    key.update(corpus_sha256=hashlib.sha256(text.encode()).hexdigest(), seed=seed, bf16=bf16)
    return key


def train_teacher(recipe: CausalLMArguments, text: str, args: DistillationArguments) -> tuple[str, dict]:
    """The folder of a teacher trained on `text` (trained now, or found in the cache) and how it was made."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, default_data_collator

    key = teacher_key(recipe, text, args.seed, args.bf16)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(recipe.teacher_cache_dir) / digest
    info_path = folder / "teacher_info.json"
    if info_path.is_file():
        print(f"teacher: reusing {folder}")
        return str(folder), json.loads(info_path.read_text())
    t0 = time.time()
    tokenizer = train_tokenizer(text, recipe.vocab_size)
    train = blocks(text, tokenizer, recipe.block_size, recipe.max_train_blocks)
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=recipe.teacher_hidden_size,
                         intermediate_size=recipe.teacher_intermediate_size, num_hidden_layers=recipe.teacher_layers,
                         num_attention_heads=recipe.teacher_heads, num_key_value_heads=recipe.teacher_kv_heads,
                         max_position_embeddings=max(recipe.block_size, 128), tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    targs = TrainingArguments(
        output_dir=str(folder / "trainer"), num_train_epochs=recipe.teacher_epochs,
        learning_rate=recipe.teacher_learning_rate, per_device_train_batch_size=recipe.teacher_batch_size,
        lr_scheduler_type="cosine", warmup_steps=0.05, weight_decay=0.01, bf16=args.bf16, use_cpu=args.use_cpu,
        seed=args.seed, logging_steps=args.logging_steps, save_strategy="no", report_to="none",
        disable_tqdm=args.disable_tqdm, dataloader_num_workers=0,
    )
    out = Trainer(model=model, args=targs, train_dataset=train, data_collator=default_data_collator).train()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    info = {"settings": key, "train_blocks": len(train), "train_loss": out.training_loss, "train_s": time.time() - t0}
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    return str(folder), info


def perplexity(model, dataset, batch_size: int = 16) -> float:
    """exp(mean next-token NLL) over every predicted token of the blocks (each block is its own context)."""
    import torch

    model.eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(dataset), batch_size):
            ids = torch.tensor(dataset[i : i + batch_size]["input_ids"], device=model.device)
            logits = model(input_ids=ids).logits[:, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1),
                                                     reduction="sum").item()
            count += ids[:, 1:].numel()
    return math.exp(nll / count)


def main() -> None:
    set_offline_defaults()
    recipe, args, config = parse_args([CausalLMArguments, DistillationArguments], __doc__.split("\n\n")[0])
    start = time.time()
    import torch
    from transformers import AutoModelForCausalLM, default_data_collator, set_seed

    from hf_distill import students
    from hf_distill.publish import measure

    if args.kd_loss not in ("jsd", "kl", "reverse_kl", "soft_ce"):
        fail(f"kd_loss must be a softmax loss (jsd, kl, reverse_kl, soft_ce) for a causal LM, got {args.kd_loss!r}")
    if recipe.student_train_blocks is not None and recipe.student_train_blocks < 1:
        fail(f"student_train_blocks must be >= 1 (or unset for every block), got {recipe.student_train_blocks}")
    text, held_out = read_text(recipe.train_file), read_text(recipe.eval_file)
    results = {"recipe": "causal_lm", "command": command_line(), "config": config,
               "train_file": recipe.train_file, "eval_file": recipe.eval_file}

    # 1. The teacher: given, or trained on the corpus (cached by its settings).
    teacher_path = recipe.teacher
    if teacher_path is None:
        teacher_path, results["teacher_training"] = train_teacher(recipe, text, args)
    tokenizer = load_tokenizer(teacher_path, "teacher")
    teacher = load_model(AutoModelForCausalLM, teacher_path, "teacher")
    results["teacher"] = teacher_path
    set_seed(args.seed)
    train = blocks(text, tokenizer, recipe.block_size, recipe.max_train_blocks)
    if recipe.student_train_blocks is not None:
        train = train.select(range(min(recipe.student_train_blocks, len(train))))
    valid = blocks(held_out, tokenizer, recipe.block_size, recipe.max_eval_blocks)

    # 2. The student: the teacher's most important blocks, scored on a few training batches.
    depth = teacher.config.num_hidden_layers
    keep = recipe.student_num_layers or math.ceil(depth / 2)
    bs = args.per_device_train_batch_size
    calibration = [default_data_collator([train[j] for j in range(i, min(i + bs, len(train)))])
                   for i in range(0, min(recipe.calibration_batches * bs, len(train)), bs)]
    student, pruning = students.prune_depth(teacher, keep, calibration)
    print(f"student: teacher blocks {pruning.kept} of {depth} (removed {pruning.removed})")
    baseline_student = copy.deepcopy(student)
    results.update(teacher_layers=depth, student_layers=keep, kept_blocks=pruning.kept,
                   block_importance=pruning.scores, params=measure.count_parameters(student),
                   teacher_params=measure.count_parameters(teacher), train_blocks=len(train), eval_blocks=len(valid),
                   block_size=recipe.block_size)

    # 3. Distillation: kd_weight * JSD + task_weight * CE.
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=train,
                                  data_collator=default_data_collator, processing_class=tokenizer)
    out = trainer.train()
    trainer.save_model()
    trainer.save_state()  # trainer_state.json: `hf-distill report` plots the run
    results.update(distillation=distillation_facts(args), train_runtime_s=out.metrics.get("train_runtime"),
                   **run_length(args, trainer.state), bf16=args.bf16)

    # 4. The baseline: the same pruned student, CE only, same steps and data.
    if recipe.run_baseline:
        bargs = dataclasses.replace(args, output_dir=f"{args.output_dir}/baseline", kd_weight=0.0, task_weight=1.0,
                                    distill_preset=None, distill_terms=None)
        set_seed(args.seed)
        btrainer = DistillationTrainer(model=baseline_student, args=bargs, train_dataset=train,
                                       data_collator=default_data_collator, processing_class=tokenizer)
        bout = btrainer.train()
        btrainer.save_model()
        btrainer.save_state()
        results.update(baseline_train_runtime_s=bout.metrics.get("train_runtime"), baseline_steps=bout.global_step)

    # 5. Held-out perplexity.
    with torch.autocast("cpu", torch.bfloat16, enabled=args.bf16 and teacher.device.type == "cpu"):
        results["teacher_perplexity"] = perplexity(teacher, valid)
        results["perplexity"] = perplexity(student, valid)
        if recipe.run_baseline:
            results["baseline_perplexity"] = perplexity(baseline_student, valid)
            results["kd_over_baseline_perplexity"] = results["perplexity"] / results["baseline_perplexity"]
    results["wall_s"] = time.time() - start
    write_results(args.output_dir, results)


if __name__ == "__main__":
    run_main(main)
