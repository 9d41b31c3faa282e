"""The logit-level terms of a `Distiller`: logit KD for every head (several compared outputs for QA, shifted
positions for causal LMs, a mixture or a sum over several teachers, the ids two padded vocabularies share), the
student's task loss computed as `Trainer.compute_loss` would, and the causal-LM loss head from hidden states."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import logging

from . import losses
from .features import heads as heads_mod
from .features.heads import Head
from .features.taps import unwrap
from .losses import chunked, cross_tokenizer
from .losses.normalise import kd_positions, seq2seq_kd_positions
from .placement import ZERO3_SHARDED, teacher_mode
from .teacher import check_padding_mass, padding_mass

logger = logging.get_logger(__name__)
# Span logits at padded positions: far below any real logit, finite so no inf - inf appears in the losses.
_NO_POSITION = -1e9


class LogitTerms:
    """Logit KD, the task loss and the causal-LM loss head, for `Distiller` (whose state they read: `args`,
    `teachers`, `teacher_weights`, `_shared_vocab`, `_cross_vocab`, `_token_labels`, `_step`, `route`)."""

    def _chunk_size(self, student: nn.Module) -> int | None:
        """Tokens per chunk for the causal-LM loss (hf_distill.losses.chunked), or None for whole logits.

        `kd_chunk_size=None` (the default) chunks wherever the result is provably the same: a causal-LM student and
        teacher whose logits hf_distill can rebuild from their last hidden states, one teacher (or cached dense
        logits), no label smoothing or compute_loss_func (they need the full logits). A value set by the user
        where chunking cannot be honoured is refused. No model runs here: whether the logits can be rebuilt from the
        hidden states is checked on the model being trained, at its first training step (`_chunk_for`)."""
        asked = self.args.kd_chunk_size
        why = None
        if self._head is not Head.CAUSAL_LM:
            why = "the student is not a causal LM"
        elif len(self.teachers) > 1:
            why = "several teachers are combined"
        elif self.shared_base:
            why = "the teacher is the student's own base (adapters off)"
        elif self.args.cross_tokenizer:
            why = "cross_tokenizer compares the two models' logits at paired positions of two tokenizations"
        elif self.label_smoother is not None or self.compute_loss_func is not None:
            why = "label_smoothing_factor or compute_loss_func needs the student's full logits"
        elif self.args.kd_loss == "mse" and self.args.kd_weight > 0:
            why = "kd_loss='mse' compares raw logits, which the chunked loss head does not keep"
        elif str(getattr(getattr(self, "accelerator", None), "distributed_type", "")).endswith("FSDP"):
            # FSDP1 keeps the root unit's parameters (the LM head among them) sharded outside the model's forward;
            # accelerate's FSDP2 shards the final norm and the LM head as one unit, which the head's own call after
            # the forward reshards before the norm's backward (tests/engine_run.py --causal_lm: a segfault).
            why = "under FSDP the LM head is sharded outside the model's forward (use DDP for it)"
        elif _zero3_processes(getattr(self, "accelerator", None)) > 1:
            # Each call of a ZeRO-3 LM head gathers it across processes; the head calls it once per token chunk, and
            # processes whose batches give different numbers of chunks wait for each other (a hang, 2 CPU processes
            # at kd_chunk_size=2). One process (world size 1) has no one to wait for.
            why = ("under DeepSpeed ZeRO-3 with several processes each call of the LM head is a collective gather, and "
                   "processes with different numbers of token chunks would wait for each other forever")
        elif not chunked.supports_hidden_only(student) or (
            self.teacher is not None and not chunked.supports_hidden_only(self.teacher)
        ):
            why = "the model's forward has no `logits_to_keep` argument"
        if why is not None:
            if asked is not None:
                raise ValueError(f"kd_chunk_size={asked} cannot be honoured: {why}. Leave kd_chunk_size unset.")
            if self._head is Head.CAUSAL_LM:
                logger.warning("Causal-LM logits are computed whole (not in chunks): %s.", why)
            return None
        return asked if asked is not None else chunked.default_chunk(unwrap(student).config.vocab_size)

    def _chunk_for(self, model: nn.Module) -> int | None:
        """`self._chunk` for this model once its logits (and the teacher's) are shown to be rebuilt exactly from the
        last hidden states: one two-token forward of each, no gradient, at the first training step of each model.
        A model whose logits cannot be rebuilt is refused when kd_chunk_size was given, else trained on whole
        logits with a warning."""
        if self._chunk is None:
            return None
        state = self._student_state(model)
        if state.rebuilds is None:
            try:  # under the forward's autocast (mixed precision): the LM head multiplies in its dtype there too
                with _unsharded(model), self._autocast():
                    chunked.check_logits_fn(state.inner, state.inner.config.vocab_size, "student")
                if self.teacher is not None and not self._teacher_rebuilds:
                    with _unsharded(self.teacher), self._autocast():
                        chunked.check_logits_fn(self.teacher, unwrap(self.teacher).config.vocab_size, "teacher")
                    self._teacher_rebuilds = True
                state.rebuilds = True
            except ValueError as err:
                if self.args.kd_chunk_size is not None:
                    raise
                logger.warning("Causal-LM logits are computed whole (not in chunks): %s.", err)
                state.rebuilds = False
        return self._chunk if state.rebuilds else None

    def _kd_loss(self, head: Head, s_views: list, t_views: list[list], inputs: dict[str, Any]) -> torch.Tensor:
        """Logit distillation of each compared output (the mean of start and end for QA), from one or several
        teachers; token-level logits are shifted for causal LMs and averaged over `kd_token_mask` positions."""
        values = []
        for i, s in enumerate(s_views):
            teachers = [views[i] for views in t_views]
            mask = None
            if s.dim() == 3:
                if head is Head.CAUSAL_LM:
                    s, teachers = s[:, :-1], [shift(t) for t in teachers]
                labels = inputs.get(self._token_labels)
                causal = head is Head.CAUSAL_LM
                if head is Head.SEQ2SEQ_LM:  # the decoder's positions, not the encoder's attention mask
                    mask = seq2seq_kd_positions(inputs, self._token_labels, self.args.kd_token_mask)
                else:
                    mask = kd_positions(inputs.get("attention_mask"), labels, self.args.kd_token_mask, causal,
                                        inputs.get("position_ids"))  # packed rows: not across sequences
            elif head is Head.QUESTION_ANSWERING and inputs.get("attention_mask") is not None:
                # Span logits are distributions over positions: padding is no candidate answer, for either model.
                real = inputs["attention_mask"] != 0
                s = s.float().masked_fill(~real, _NO_POSITION)
                teachers = [t.float().masked_fill(~real, _NO_POSITION) for t in teachers]
            if s.dim() == 3 and self._shared_vocab is not None:  # padded vocabularies: the ids both models know
                v = self._shared_vocab
                for j, t in enumerate(teachers):
                    if not isinstance(t, tuple):
                        self._check_padding(j, [t[mask.bool()] if mask is not None else t.flatten(0, -2)])
                s, teachers = s[..., :v], [t if isinstance(t, tuple) else t[..., :v] for t in teachers]
            values.append(self._combine_teachers(head, s, teachers, mask))
        return sum(values) / len(values)

    def _cross_tokenizer_kd(self, s_logits: torch.Tensor, t_logits: torch.Tensor, batch: dict[str, Any]):
        """The KD term of a teacher with another tokenizer (hf_distill.losses.cross_tokenizer): its logits on its own
        tokenization, paired with the student's as `cross_tokenizer` says."""
        args = self.args
        return cross_tokenizer.cross_tokenizer_kd(
            args.cross_tokenizer, s_logits, t_logits, batch, kind=args.kd_loss, temperature=args.temperature,
            label_name=self._token_labels, mode=args.kd_token_mask, shared=self._cross_vocab,
            beta=args.effective_jsd_beta, alpha=args.resolved_skew_alpha)

    def _combine_teachers(self, head: Head, s: torch.Tensor, t_logits: list, mask) -> torch.Tensor:
        """Several teachers are combined as `multi_teacher` says: `probs` distils the weighted average of their
        softened distributions (one KD term against a mixture, as TextBrewer's multi-teacher averages);
        `losses` sums one KD term per teacher, weighted."""
        args, T = self.args, self.args.temperature
        if len(t_logits) == 1:
            return self._logit_loss(head, s, t_logits[0], mask)
        if args.multi_teacher == "losses":
            return sum(
                w * self._logit_loss(head, s, t, mask) for w, t in zip(self.teacher_weights, t_logits, strict=True)
            )
        if any(isinstance(t, tuple) for t in t_logits):
            raise ValueError("multi_teacher='probs' needs dense teacher logits; cached top-k logits cannot be mixed.")
        if head is Head.MULTI_LABEL:  # a mixture of per-label Bernoullis, as logits at temperature T
            p = sum(w * (t.float() / T).sigmoid() for w, t in zip(self.teacher_weights, t_logits, strict=True))
            p = p.clamp(1e-7, 1 - 1e-7)
            return self._logit_loss(head, s, T * (p.log() - (-p).log1p()), mask)
        mixture = sum(w * (t.float() / T).softmax(-1) for w, t in zip(self.teacher_weights, t_logits, strict=True))
        # T * log(p) has softmax(. / T) == p, so the mixture goes through the usual loss unchanged.
        return self._logit_loss(head, s, T * mixture.clamp_min(1e-30).log(), mask)

    def _logit_loss(self, head: Head, s: torch.Tensor, t, mask) -> torch.Tensor:
        kind, T = self.args.kd_loss, self.args.temperature
        if head is Head.MULTI_LABEL and kind != "mse":
            fn = losses.binary_kl_div if kind == "kl" else losses.binary_soft_cross_entropy
            return fn(s, t, T)
        return losses.logit_kd_loss(kind, s, t, T, mask=mask, beta=self.args.effective_jsd_beta,
                                    alpha=self.args.resolved_skew_alpha)

    def _task_loss(self, out: Any, inputs: dict[str, Any], head: Head, num_items_in_batch, step_mean: bool):
        """The student's task loss, computed as `Trainer.compute_loss` would: `compute_loss_func`, else the
        label smoother, else the model's own loss (cross-entropy/MSE/BCE for a plain module)."""
        if self.compute_loss_func is not None and "labels" in inputs:
            value = self.compute_loss_func(out, inputs["labels"], num_items_in_batch=num_items_in_batch).float()
            if step_mean:
                # The Trainer takes this value as normalised over the whole step already (it neither divides it
                # by the accumulation steps nor lets DDP average it); undo both of ours to match.
                tokens_across = self.args.average_tokens_across_devices and num_items_in_batch is not None
                value = value * self._step.micro_batches * (self._processes() if tokens_across else 1)
            return value
        if self.label_smoother is not None and "labels" in inputs:
            return self.label_smoother(out, inputs["labels"], shift_labels=head is Head.CAUSAL_LM).float()
        labels = inputs.get(self._token_labels)
        loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
        if loss is not None:
            return loss.float()
        if labels is None:
            raise ValueError(
                f"The student returned no loss and the batch has no `labels` (label_names={self.label_names}): "
                "give a model that computes its loss from those labels, or set task_weight=0."
            )
        logits = heads_mod._logits(out).float()
        if head is Head.REGRESSION:
            return F.mse_loss(logits.squeeze(-1), labels.float())
        if head is Head.MULTI_LABEL:
            return F.binary_cross_entropy_with_logits(logits, labels.float())
        if head is Head.CAUSAL_LM:
            logits, labels = logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)

    def _chunked_terms(self, model: nn.Module, s_out, teacher, inputs: dict[str, Any], want_task: bool, chunk: int):
        """KD and the student's cross-entropy of a causal LM from hidden states, through the loss head
        (hf_distill.losses.chunked): local means, differentiable like any other term. Under DeepSpeed or FSDP the LM
        heads are called as modules (`route`: the engines gather their parameters inside that call)."""
        labels = inputs.get(self._token_labels)
        kd_fn = None
        if self.args.kd_weight > 0:
            kd_fn = chunked.dense_kd(self.args.kd_loss, self.args.temperature, self.args.effective_jsd_beta,
                                     self.args.resolved_skew_alpha)
        kd_mask = kd_positions(inputs.get("attention_mask"), labels, self.args.kd_token_mask, causal=True,
                               position_ids=inputs.get("position_ids"))  # packed rows: not across sequences
        t_logits, t_hidden = teacher.views[0][0] if teacher.views else None, teacher.hidden
        s_logits_fn, t_logits_fn = self._logits_fns(model)
        if self._shared_vocab is not None and t_hidden is not None and 0 not in self._padding_checked:
            with torch.no_grad():  # the teacher's logits on the first batch's distilled tokens, a few rows at a time
                rows = t_hidden[:, :-1][kd_mask] if kd_mask is not None else t_hidden[:, :-1].flatten(0, 1)
                self._check_padding(0, (t_logits_fn(part) for part in rows.split(256)))
        # dense logits, or a teacher signal's (log_probs, indices, log_tail) (hf_distill.losses.sparse_head)
        teacher = t_logits_fn if t_hidden is not None else (shift(t_logits) if t_logits is not None else None)
        ce_labels = labels[:, 1:] if want_task and labels is not None else None
        # Mixed precision: accelerate's autocast covers the models' forwards, not this code; the LM heads multiply in
        # the dtype they would inside the forward (bf16/fp16 operands, float32 outputs), not in the weights' float32.
        with self._autocast():
            kd, ce = chunked.chunked_kd_and_ce(chunked.last_hidden(s_out), s_logits_fn, teacher, t_hidden, kd_mask,
                                               ce_labels, kd_fn, chunk, self._shared_vocab, route=self.route)
        return kd, (self._with_router_loss(model, s_out, ce) if ce is not None else None)

    def _with_router_loss(self, model: nn.Module, s_out, ce: torch.Tensor) -> torch.Tensor:
        """The task loss as the model's own: a mixture-of-experts student with `output_router_logits` adds its
        load-balancing loss (`router_aux_loss_coef * aux_loss`) to the cross-entropy, which the loss head computed
        without it (the student ran without labels)."""
        aux = s_out.get("aux_loss") if isinstance(s_out, dict) else getattr(s_out, "aux_loss", None)
        if aux is None:
            return ce
        inner = self._student_state(model).inner
        coef = getattr(inner, "router_aux_loss_coef", getattr(inner.config, "router_aux_loss_coef", None))
        if coef is None:
            raise ValueError(
                f"The student ({type(inner).__name__}) returns an aux_loss but no router_aux_loss_coef, so hf_distill "
                "cannot add it to the task loss as the model would: set config.output_router_logits=False, or give "
                "the model a router_aux_loss_coef.")
        return ce + float(coef) * aux.float().to(ce.device)

    def _logits_fns(self, model: nn.Module):
        """Hidden states -> logits of the student `model` and of the teacher (hf_distill.losses.chunked)."""
        state = self._student_state(model)
        if state.logits_fns is None:
            teacher = chunked.logits_fn(self.teacher) if self.teacher is not None else None
            state.logits_fns = (chunked.logits_fn(state.inner), teacher)
        return state.logits_fns

    def _check_padding(self, i: int, parts) -> None:
        """Once per teacher with more vocabulary ids than the student: its mean probability on the extra ids over the
        first distilled batch's counted positions, refused above the bound (teacher.check_padding_mass). `parts`
        yields that batch's (n, V) teacher logits at those positions."""
        if i in self._padding_checked:
            return
        total, count, vocab = 0.0, 0, None
        for rows in parts:
            vocab = rows.shape[-1]
            if vocab <= self._shared_vocab:  # this teacher has no ids the student lacks
                self._padding_checked.add(i)
                return
            if len(rows):
                total, count = total + padding_mass(rows, self._shared_vocab) * len(rows), count + len(rows)
        if count:  # (a batch without a distilled position leaves the check to the next one)
            check_padding_mass(total / count, self._shared_vocab, vocab)
            self._padding_checked.add(i)


def forward_params(model: nn.Module | None) -> set[str]:
    """The inputs a forward names. transformers forwards also take **kwargs (attention backend options),
    so they only get what they name; a plain module whose forward takes **kwargs gets everything."""
    if model is None:
        return set()
    inner = unwrap(model)
    params = inspect.signature(inner.forward).parameters
    names = set(params)
    if not isinstance(inner, PreTrainedModel) and any(p.kind == p.VAR_KEYWORD for p in params.values()):
        names.add("**")
    return names


def student_shape(model: nn.Module) -> tuple[str, int | None, int | None]:
    """The facts the trainer's checks read from the student: its class (hence head), vocabulary and label count."""
    inner = unwrap(model)
    vocab = getattr(getattr(inner, "config", None), "vocab_size", None)
    return _model_class(inner).__name__, vocab, heads_mod.num_labels(inner)


def _model_class(model: nn.Module) -> type:
    """The model's own class: FSDP2's `fully_shard` swaps it for a subclass `FSDP<Name>(FSDPModule, <Name>)`."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return type(model)
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def plain_task_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, MSE (one output, float labels) or BCE (multi-hot float labels) for a model without a loss."""
    logits = logits.float()
    if logits.shape[-1] == 1 and labels.is_floating_point():
        return F.mse_loss(logits.squeeze(-1), labels.float())
    if labels.is_floating_point() and labels.shape == logits.shape:
        return F.binary_cross_entropy_with_logits(logits, labels.float())
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def shift(t):
    """Causal-LM teacher logits (dense or top-k) without their last position, aligned with the student's."""
    return tuple(x[:, :-1] for x in t) if isinstance(t, tuple) else t[:, :-1]


def _unsharded(model: nn.Module):
    """FSDP1 keeps a wrapped model's parameters sharded outside its own forward: gather them for a forward of the
    inner module (the logits check). DeepSpeed ZeRO-3 and FSDP2 gather in hooks on the modules themselves."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return contextlib.nullcontext()
    if isinstance(model, FullyShardedDataParallel):
        return FullyShardedDataParallel.summon_full_params(model, writeback=False)
    return contextlib.nullcontext()


def _zero3_processes(accelerator: Any) -> int:
    """The number of processes of a DeepSpeed ZeRO-3 run (placement's rule, as the teacher's), else 0."""
    processes = int(getattr(accelerator, "num_processes", 1)) if accelerator is not None else 1
    return processes if processes > 1 and teacher_mode(accelerator) == ZERO3_SHARDED else 0
