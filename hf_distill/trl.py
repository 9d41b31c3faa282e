"""Distillation inside TRL's `SFTTrainer`: `DistillationSFTTrainer` and `DistillationSFTConfig`.

LLM practitioners train with TRL's `SFTTrainer` (chat templates, `messages` data, packing, assistant-only loss).
`DistillationSFTTrainer` is that trainer with a teacher: SFT prepares the data exactly as it would (tokenization,
the chat template, completion or assistant masks folded into `labels`, packing) and hf_distill's `Distiller` computes
the loss on its batches, as `DistillationTrainer` does on any other batch:

    from hf_distill.trl import DistillationSFTConfig, DistillationSFTTrainer

    args = DistillationSFTConfig(output_dir="out", kd_loss="jsd", kd_weight=1.0, task_weight=1.0,
                                 assistant_only_loss=True, packing=True)
    DistillationSFTTrainer(model=student, teacher_model=teacher, args=args, train_dataset=messages_rows,
                           processing_class=tokenizer).train()

What the distillation means for SFT's data paths:

* The KD term counts the positions whose next-token label is not -100 (`kd_token_mask="labels"`, the default for
  a causal LM): exactly the tokens SFT's own loss counts, so the completion with `completion_only_loss`, the
  assistant turns with `assistant_only_loss=True`, every token of plain-text or `messages` rows otherwise.
* Packing (`packing=True` with `packing_strategy="bfd"` or `"bfd_split"`, or `padding_free=True`) puts several
  sequences in one row without padding: SFT's collator gives `position_ids` that restart at 0 for each sequence
  and no attention mask. Student and teacher both run on that row with those `position_ids` and without a KV
  cache, so transformers keeps each sequence's attention inside it, and the KD term never counts the last token
  of a sequence (its next token starts another one: `hf_distill.losses.normalise.same_sequence`), on whole
  logits and in the chunked loss head alike. A packed batch's KD loss equals the mean over the same sequences
  run unpacked (tested).
* The task term is the student's own cross-entropy on `labels`, as SFT's `loss_type="nll"`.
* On-policy and sequence-level KD (`lmbda` > 0, `seq_kd`) generate each micro-batch's completions from its prompts,
  so SFT must not tokenise the rows first: without a `data_collator` (or with
  `hf_distill.data.prompts.PromptCompletionCollator`) the trainer sets `dataset_kwargs["skip_prepare_dataset"]`
  and collates the raw prompt/completion or `messages` rows with `PromptCompletionCollator` (the processing class,
  `max_length`), whose labels are the completion. Refused there: packing and `padding_free` (generated rows replace
  the dataset's), `formatting_func`, `completion_only_loss=False`, `assistant_only_loss=True` and
  `skip_prepare_dataset=False` (SFT's preparation, which those act on, does not run). Another collator gets SFT's
  prepared rows as configured and must add the left-padded prompts (`prompt_input_ids`) itself.

* `cross_tokenizer` with `hf_distill.data.cross_tokenizer.CrossTokenizerCollator` (given, or built from
  `processing_class`, `teacher_processing_class`, `max_length` and `dataset_text_field` when no `data_collator` is
  given): the collator tokenizes each row's raw text with both tokenizers (`messages` and conversational
  prompt/completion rows rendered by each tokenizer's own chat template, counted as SFT counts them: every token,
  or the completion, and with `assistant_only_loss=True` the tokens of each side's `{% generation %}` blocks; both
  tokenizers need a chat template, checked on the first rows), so the trainer sets
  `dataset_kwargs["skip_prepare_dataset"]` (SFT would append the student's EOS string to the text the teacher
  reads). Refused there: packing, `eval_packing`, `formatting_func`, `completion_only_loss=False`,
  `skip_prepare_dataset=False`, and a given collator whose `max_length`, `text_column` or `assistant_only_loss` is
  not the config's `max_length`, `dataset_text_field` or `assistant_only_loss`.

Refused, each with the fix: `packing_strategy="wrapped"` (it keeps no sequence boundaries), `loss_type="dft"`,
packing without a teacher model (packing keeps only `input_ids` and `labels`, so cached teacher columns are lost),
and with padding-free rows: `cross_tokenizer`, intermediate terms other than `hidden_mse`, `cosine_loss` and
`incremental_mse` (the others compare attention or whole rows, which a packed row mixes), and a packed evaluation
set evaluated with the teacher when training is not padding-free (SFT's collator would pad each packed row as one
sequence).

Logged as SFTTrainer logs them (same definitions, tokens and averaging): `num_tokens`, and `entropy` and
`mean_token_accuracy` over the positions SFT's loss counts, from the student's logits, or where the causal-LM loss
head ran (training: no logits) from one more no-grad pass over its last hidden states through the LM head, in token
chunks, under the forward's autocast (`DistillationSFTTrainer._token_metrics`; `benchmarks/sft_metrics_cost.py`).

This module needs TRL (`pip install 'hf-distill[trl]'`); `hf_distill.DistillationSFTTrainer` imports it on first use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from . import trainer_runs as runs
from .arguments import DistillationArguments, as_distillation_arguments
from .compat import count_sft_train_tokens, sft_metrics, sft_train_tokens
from .data.collators import TeacherOutputsCollator
from .data.cross_tokenizer import CrossTokenizerCollator, check_first_rows
from .data.prompts import PromptCompletionCollator
from .features import heads as heads_mod
from .features.taps import unwrap
from .losses import chunked
from .trainer import DistillationMixin

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as err:  # the optional extra is missing (tests/test_trl_sft.py hides trl to check this)
    raise ImportError(
        "hf_distill.trl (DistillationSFTTrainer, DistillationSFTConfig) needs TRL, which is not installed: "
        "pip install 'hf-distill[trl]' (trl>=1.16)."
    ) from err

__all__ = ["DistillationSFTConfig", "DistillationSFTTrainer"]

# Intermediate terms that are means over single tokens, so a packed row changes nothing for them.
TOKEN_TERMS = ("hidden_mse", "cosine_loss", "incremental_mse")


_SFT_FIELDS = {f.name: f for f in dataclasses.fields(SFTConfig)}


def _sft_default(name: str) -> Any:
    """SFTConfig's own default of a TrainingArguments field (with its help), which DistillationArguments' copy of
    the field would otherwise replace with TrainingArguments' default."""
    return field(default=_SFT_FIELDS[name].default, metadata=_SFT_FIELDS[name].metadata)


@dataclass
class DistillationSFTConfig(DistillationArguments, SFTConfig):
    """`SFTConfig` (chat template, `packing`, `padding_free`, `completion_only_loss`, `assistant_only_loss`,
    `max_length`, ...) plus the distillation fields of `DistillationArguments`: the arguments of
    `DistillationSFTTrainer`, and what `HfArgumentParser` parses in place of `SFTConfig`. SFTConfig's defaults
    hold, also where they differ from TrainingArguments' (`gradient_checkpointing=True`, `bf16=True` unless `fp16`,
    `learning_rate=2e-5`, `logging_steps=10`), so swapping `SFTConfig` for it changes nothing but the loss."""

    learning_rate: float = _sft_default("learning_rate")
    logging_steps: float = _sft_default("logging_steps")
    gradient_checkpointing: bool = _sft_default("gradient_checkpointing")
    bf16: bool | None = _sft_default("bf16")


def padding_free(args: SFTConfig) -> bool:
    """Whether SFT's collator flattens each batch into one row with `position_ids` (SFTTrainer's own rule)."""
    return bool(args.padding_free or (args.packing and args.packing_strategy in ("bfd", "bfd_split")))


def check_sft_arguments(args: DistillationSFTConfig, teacher_model: Any) -> None:
    """Refuse the SFT settings under which the distillation would not be what it says (module docstring)."""
    eval_packing = args.packing if args.eval_packing is None else args.eval_packing
    if args.packing_strategy == "wrapped" and (args.packing or eval_packing):
        raise ValueError(
            "packing_strategy='wrapped' joins rows and cuts them at max_length without keeping where each one starts "
            "(no seq_lengths, no position_ids), so student and teacher would attend across rows and KD would distil "
            "each row's last token towards the next row's first. Use packing_strategy='bfd' (or 'bfd_split'), which "
            "keeps the boundaries, or packing=False."
        )
    if args.loss_type != "nll":
        raise ValueError(
            f"loss_type={args.loss_type!r}: DistillationSFTTrainer's task term is the student's own cross-entropy on "
            "the labels (loss_type='nll'). Use loss_type='nll'."
        )
    flat = padding_free(args)
    if args.packing and teacher_model is None:
        raise ValueError(
            "packing=True needs teacher_model: SFTTrainer packs only input_ids and labels, so cached teacher "
            "columns (hf_distill.data.cache, teacher signals) do not survive packing. Give teacher_model, or set "
            "packing=False."
        )
    if flat and args.cross_tokenizer:
        raise ValueError(
            f"cross_tokenizer={args.cross_tokenizer!r} with packed (padding-free) rows: the teacher reads its own "
            "tokenization of each row, which SFT does not pack. Set packing=False and padding_free=False."
        )
    if flat:
        mixing = sorted({t.loss for t in args.terms if t.loss not in TOKEN_TERMS})
        if mixing:
            raise ValueError(
                f"distill_terms with loss {', '.join(mixing)} on packed (padding-free) rows: they compare attention "
                f"or whole rows, and a packed row holds several sequences. Use only {', '.join(TOKEN_TERMS)}, or "
                "packing=False and padding_free=False."
            )
    if args.eval_with_teacher and eval_packing and not flat:
        raise ValueError(
            "eval_packing with eval_with_teacher=True while training is not padding-free: SFTTrainer's collator pads "
            "each packed evaluation row as one sequence (no position_ids), so its sequences would attend to each "
            "other and KD would cross them. Set eval_packing=False, or train with packing=True "
            "(packing_strategy='bfd') so both use padding-free rows."
        )


def _skip_preparation(args: DistillationSFTConfig, formatting_func: Any, what: str, fix: str, other: str,
                      covers: str, rows: str, assistant: bool = False) -> None:
    """Refuse the SFT settings that act through SFT's dataset preparation, then have SFT skip it: the raw rows go to
    the collator (`fix` says which and why, `other` the alternative to skip_prepare_dataset=False, `covers` what the
    loss then covers, `rows` the rows the collator reads; `assistant`: the collator honours assistant_only_loss)."""
    kwargs = dict(args.dataset_kwargs or {})
    if kwargs.get("skip_prepare_dataset", True) is False:
        raise ValueError(
            f"dataset_kwargs={{'skip_prepare_dataset': False}} with {what}: {fix}. Remove skip_prepare_dataset from "
            f"dataset_kwargs (it is set for you), or {other}."
        )
    given = [name for name, bad in (("formatting_func", formatting_func is not None),
                                     ("completion_only_loss=False", args.completion_only_loss is False),
                                     ("assistant_only_loss=True", args.assistant_only_loss and not assistant))
             if bad]
    if given:
        raise ValueError(
            f"{', '.join(given)} with {what}: {fix}, and the loss covers {covers}. Remove {', '.join(given)}; give "
            f"{rows} rows."
        )
    args.dataset_kwargs = {**kwargs, "skip_prepare_dataset": True}


def prepare_generation(args: DistillationSFTConfig, data_collator: Any, formatting_func: Any) -> bool:
    """With `lmbda` > 0 or `seq_kd`: refuse the SFT settings generation cannot honour, and have SFT hand the raw rows
    to `PromptCompletionCollator` (module docstring). Returns whether the trainer must build that collator."""
    if not args.generates:
        return False
    what = f"lmbda={args.lmbda}" if args.lmbda > 0 else "seq_kd=True"
    if args.packing or args.padding_free or args.eval_packing:
        raise ValueError(
            f"{what} generates each micro-batch's completions from its prompts, so the rows are rebuilt every step "
            "and there are no dataset sequences to pack. Set packing=False, padding_free=False and eval_packing=False "
            "(or lmbda=0 and seq_kd=False to pack the dataset's completions)."
        )
    if data_collator is not None and not isinstance(data_collator, PromptCompletionCollator):
        return False  # SFT prepares the rows as configured; the collator must add the prompts (checked per batch)
    _skip_preparation(
        args, formatting_func, what,
        "the raw rows go to PromptCompletionCollator (its labels: the completion, or the last assistant message), so "
        "SFT's dataset preparation does not run",
        "give a data_collator that adds prompt_input_ids to SFT's rows", "the (generated) completion only",
        "prompt/completion or messages")
    return data_collator is None


def prepare_cross_tokenizer(args: DistillationSFTConfig, data_collator: Any, formatting_func: Any,
                            teacher_processing_class: Any) -> bool:
    """With `cross_tokenizer` and `CrossTokenizerCollator` (given, or built when no collator is): SFT's preparation
    (the student's EOS appended to the text, its tokenization, labels and truncation) is not what the collator
    reads, which tokenizes each row's raw text with both tokenizers. Refuse the SFT settings that act only there, or
    that the collator would not honour, and skip it. Returns whether the trainer must build the collator."""
    if not args.cross_tokenizer or (data_collator is not None
                                    and not isinstance(data_collator, CrossTokenizerCollator)):
        return False  # another collator reads SFT's prepared rows and must add the teacher's tokens itself
    what = f"cross_tokenizer={args.cross_tokenizer!r}"
    if args.eval_packing:
        raise ValueError(f"eval_packing with {what}: the teacher reads its own tokenization of each row, which SFT "
                         "does not pack. Set eval_packing=False.")
    if data_collator is None and teacher_processing_class is None:
        raise ValueError(
            f"{what} with DistillationSFTTrainer and no data_collator: the trainer builds CrossTokenizerCollator from "
            "both tokenizers, so give teacher_processing_class=<the teacher's tokenizer> (or data_collator="
            "CrossTokenizerCollator(student_tokenizer, teacher_tokenizer, max_length=...))."
        )
    collator = data_collator
    for name, ours, sft in (("max_length", "max_length", args.max_length),
                            ("dataset_text_field", "text_column", args.dataset_text_field),
                            ("assistant_only_loss", "assistant_only_loss", bool(args.assistant_only_loss))):
        if collator is not None and getattr(collator, ours) != sft:
            raise ValueError(
                f"{name}={sft!r} in the config, but the CrossTokenizerCollator's {ours} is "
                f"{getattr(collator, ours)!r}: with {what} the collator tokenizes the rows, not SFT, so the config's "
                f"{name} would be ignored. Give CrossTokenizerCollator(..., {ours}={sft!r}), or set "
                f"{name}={getattr(collator, ours)!r} in the config."
            )
    _skip_preparation(
        args, formatting_func, what,
        "the raw rows go to CrossTokenizerCollator, which tokenizes each row's text with both tokenizers, so SFT's "
        "dataset preparation does not run",
        "give a data_collator that adds the teacher's tokenization (teacher_input_ids, ...) to SFT's rows",
        "every token of a text or messages row (the assistant turns with assistant_only_loss=True), the completion "
        "of a prompt/completion row", "text, messages or prompt/completion", assistant=True)
    return data_collator is None


def _float(logits: torch.Tensor) -> torch.Tensor:
    return logits.float()


class DistillationSFTTrainer(DistillationMixin, SFTTrainer):
    """TRL's `SFTTrainer` + a frozen teacher: SFT's data handling (chat templates, `messages` and prompt/completion
    rows, completion- and assistant-only labels, packing) and `DistillationTrainer`'s loss, checkpoints and card.

    Takes `DistillationSFTConfig`; `SFTConfig`, `DistillationArguments` or plain `TrainingArguments` are upgraded
    to it (every field kept, a warning logged). Other arguments as `DistillationTrainer` (`teacher_model=`,
    `teacher_processing_class=`) and `SFTTrainer` (`processing_class`, `peft_config`, `formatting_func`, ...).
    """

    def __init__(
        self,
        model: nn.Module | str | None = None,
        args: TrainingArguments | None = None,
        *trainer_args: Any,
        teacher_model: nn.Module | str | list[nn.Module | str] | None = None,
        teacher_processing_class: Any = None,
        **trainer_kwargs: Any,
    ) -> None:
        args = self._distillation_arguments(args)
        check_sft_arguments(args, teacher_model)  # before SFTTrainer tokenizes and packs the datasets
        collator = trainer_args[0] if trainer_args else trainer_kwargs.get("data_collator")
        build = prepare_generation(args, collator, trainer_kwargs.get("formatting_func"))
        build_cross = prepare_cross_tokenizer(args, collator, trainer_kwargs.get("formatting_func"),
                                              teacher_processing_class)
        self._builds_prompt_collator = build  # read by _prompt_collator, inside super().__init__
        super().__init__(model, args, *trainer_args, teacher_model=teacher_model,
                         teacher_processing_class=teacher_processing_class, **trainer_kwargs)
        # after SFTTrainer, which may load the processing class from the model's name
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        if build:
            self.data_collator = TeacherOutputsCollator(PromptCompletionCollator(tokenizer, self.args.max_length))
        if build_cross:
            t_tokenizer = teacher_processing_class
            t_tokenizer = t_tokenizer[0] if isinstance(t_tokenizer, list | tuple) else t_tokenizer
            self.data_collator = TeacherOutputsCollator(CrossTokenizerCollator(
                tokenizer, getattr(t_tokenizer, "tokenizer", t_tokenizer), text_column=self.args.dataset_text_field,
                max_length=self.args.max_length, assistant_only_loss=bool(self.args.assistant_only_loss)))
            check_first_rows(self.data_collator, self.train_dataset, self.eval_dataset)  # chat rows: both templates
        self.distiller.student_hook = self._token_metrics

    def _prompt_collator(self) -> Any:
        """The PromptCompletionCollator this trainer builds once SFTTrainer is set up (the set-up checks of generation
        read the first rows with it before the teacher loads), else the collator given."""
        if getattr(self, "_builds_prompt_collator", False):
            return PromptCompletionCollator(getattr(self.processing_class, "tokenizer", self.processing_class),
                                            self.args.max_length)
        return super()._prompt_collator()

    def _distillation_arguments(self, args: Any) -> DistillationSFTConfig:
        return as_distillation_arguments(args, "DistillationSFTTrainer", DistillationSFTConfig, "SFTConfig",
                                         noted=("packing",))

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        """The distillation loss (Distiller), with the metrics SFTTrainer's own `compute_loss` adds: `num_tokens` here,
        counted as SFTTrainer counts it, and `entropy`, `mean_token_accuracy` (and a MoE student's `aux_loss`) from
        the student's outputs (`_token_metrics`, which the Distiller calls)."""
        mode = "train" if self.model.training else "eval"
        if mode == "train":
            if "attention_mask" in inputs:
                local = inputs["attention_mask"].sum()
            elif "position_ids" in inputs:  # padding-free rows: SFTTrainer counts the (one) row's length
                local = torch.tensor(inputs["position_ids"].size(1))
            else:
                local = torch.tensor(inputs["input_ids"].numel())
            tokens = self.accelerator.gather_for_metrics(local.to(self.accelerator.device)).sum().item()
            count_sft_train_tokens(self, tokens)
        sft_metrics(self, mode)["num_tokens"] = [sft_train_tokens(self)]
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    @torch.no_grad()
    def _token_metrics(self, model: nn.Module, outputs: Any, inputs: dict[str, Any], from_hidden: bool) -> None:
        """SFTTrainer's `entropy` and `mean_token_accuracy`: the mean entropy of the student's next-token
        distribution and the share of positions whose label is its most likely token (the first of tied ones), over
        the positions whose next-token label is not -100 (SFT's completion, assistant or packed labels), summed
        across processes before dividing, 0.0 without such a position. From the logits, or, where the causal-LM loss
        head ran (`from_hidden`), from the last hidden states through the LM head in token chunks of float32 logits
        under the forward's autocast. Rows are taken `kd_chunk_size` (else the loss head's default) at a time: no
        second `(N, V)` tensor."""
        labels = inputs.get("labels")
        if labels is None:  # nothing to count (SFT's batches always have labels)
            return
        mode = "train" if self.model.training else "eval"
        labels = labels[:, 1:]
        mask = labels != -100
        if from_hidden:
            rows, head = chunked.last_hidden(outputs), chunked.logits_fn(model)
            project, context = head.float32, self.accelerator.autocast()
        else:
            rows, project, context = heads_mod._logits(outputs), _float, contextlib.nullcontext()
        where = mask.nonzero()
        entropy = torch.zeros((), device=labels.device)
        correct = torch.zeros((), dtype=torch.long, device=labels.device)
        step = self.args.kd_chunk_size or chunked.default_chunk(unwrap(model).config.vocab_size)
        with context:
            for part in where.split(step):  # (a model split across devices has its rows on its last device)
                z = project(rows[tuple(part.to(rows.device).T)])
                entropy += torch.special.entr(z.softmax(-1)).sum().to(entropy.device)
                correct += (z.argmax(-1).to(labels.device) == labels[tuple(part.T)]).sum()
        gather = self.accelerator.gather_for_metrics
        num_valid = gather(mask.sum()).sum()
        entropy, correct = gather(entropy).sum(), gather(correct).sum()
        sft_metrics(self, mode)["entropy"].append((entropy / num_valid).item() if num_valid > 0 else 0.0)
        sft_metrics(self, mode)["mean_token_accuracy"].append((correct / num_valid).item() if num_valid > 0 else 0.0)
        aux = outputs.get("aux_loss") if isinstance(outputs, dict) else getattr(outputs, "aux_loss", None)
        if self.aux_loss_enabled and aux is not None:  # a MoE student's load-balancing loss, as SFTTrainer logs it
            sft_metrics(self, mode)["aux_loss"].append(gather(aux.detach()).mean().item())

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
        **kwargs: Any,
    ):
        """`Trainer.prediction_step` on the distillation loss (SFTTrainer's own reads `.logits` from the outputs of
        its fused loss head, which the Distiller does not return); inside `evaluate_teacher` the teacher predicts. As
        `DistillationTrainer`'s (hf_distill.trainer_runs): a batch without labels (a `data_collator` that gives none)
        gets its distillation loss under `eval_with_teacher`, and one the student runs alone loses the teacher-only
        keys (cached `teacher_*` columns, prompts)."""
        if self._evaluating_teacher:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs)
        return runs.student_prediction_step(self, functools.partial(Trainer.prediction_step, self), model, inputs,
                                            prediction_loss_only, ignore_keys)
