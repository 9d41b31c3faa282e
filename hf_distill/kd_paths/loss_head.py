"""KD and the student's cross-entropy of a causal LM from last hidden states, through the loss head
(hf_distill.losses.chunked: no `(B, T, V)` logits): against a dense teacher (its LM head on its hidden states, or
cached whole logits) in :class:`LossHead`, against an offline top-k + tail signal in :class:`SparseHead`
(hf_distill.losses.sparse_head).

Where the loss head can run is decided once, before training (:func:`chunk_size`: the refusals that need no model);
whether a model's logits are rebuilt exactly from its hidden states is checked once per model, at its first training
step (`LossHead.bind`), because the Trainer may swap (`model_init`), wrap or compile the student after set-up.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from transformers.utils import logging

# the module, not its names (tests/engine_heads_run.py counts the calls by replacing them there); absolute, as
# `from . import` would import the package kd_paths, which imports this module
import hf_distill.kd_paths.engine_heads as engine_heads

from ..features.heads import Head
from ..features.taps import unwrap
from ..losses import chunked, sparse_head
from ..losses.normalise import kd_positions
from ..placement import ZERO3_SHARDED, teacher_mode
from ..teacher_sources import DENSE, MODEL, SIGNAL, TeacherRequest, autocast
from .base import KDPath, PathBatch, PathContext, register_path, shift

logger = logging.get_logger(__name__)


def chunk_size(ctx: PathContext, student: nn.Module) -> int | None:
    """Tokens per chunk for the causal-LM loss head, or None for whole logits.

    `kd_chunk_size=None` (the default) chunks wherever the result is provably the same: a causal-LM student and
    teacher whose logits hf_distill can rebuild from their last hidden states, one teacher (or cached dense
    logits), no label smoothing or compute_loss_func (they need the full logits). A value set by the user
    where chunking cannot be honoured is refused. No model runs here: whether the logits can be rebuilt from the
    hidden states is checked on the model being trained, at its first training step (`LossHead.bind`)."""
    asked = ctx.args.kd_chunk_size
    why = _refusal(ctx, student)
    _check_head_mode(ctx, student, why)
    if why is not None:
        if asked is not None:
            raise ValueError(f"kd_chunk_size={asked} cannot be honoured: {why}. Leave kd_chunk_size unset.")
        if ctx.head is Head.CAUSAL_LM:
            logger.warning("Causal-LM logits are computed whole (not in chunks): %s.", why)
        return None
    vocab = unwrap(student).config.vocab_size
    return asked if asked is not None else chunked.default_chunk(vocab, getattr(ctx.args, "kd_head_mode", "recompute"))


def _check_head_mode(ctx: PathContext, student: nn.Module, why: str | None) -> None:
    """`kd_head_mode='fused'` is honoured by the loss head's direct route only: refused before training where the
    loss head does not run or calls the LM heads as modules (engines; an LM head that is not a plain nn.Linear, here
    for the models given, and by hf_distill.losses.fused_grads at the first step for one a `model_init` returns)."""
    mode = getattr(ctx.args, "kd_head_mode", "recompute")
    if mode != "fused":
        return
    dist_type = str(getattr(ctx.accelerator, "distributed_type", ""))
    if why is None and (dist_type.endswith("DEEPSPEED") or dist_type.endswith("FSDP")):
        why = "under DeepSpeed or FSDP the LM heads are called as modules, whose gradients autograd forms"
    for role, model in (("student", student), *(("teacher", t) for t in ctx.teachers)):
        head = unwrap(model).get_output_embeddings() if why is None else None
        if head is not None and not chunked.LogitsHead(head).direct:
            why = (f"the {role}'s LM head ({type(head).__name__}) is not a plain nn.Linear (e.g. LoRA-wrapped), so it "
                   "is called as a module, whose gradients autograd forms")
    if why is not None:
        raise ValueError(f"kd_head_mode='fused' cannot be honoured: {why}. Use kd_head_mode='recompute'.")


def _refusal(ctx: PathContext, student: nn.Module) -> str | None:
    """Why the loss head cannot run for this run, or None."""
    teachers, settings = ctx.teachers, ctx.settings
    if ctx.head is not Head.CAUSAL_LM:
        return "the student is not a causal LM"
    if len(teachers) > 1 or ctx.teacher_side.count > 1:
        return "several teachers are combined"
    if ctx.teacher_side.models.shared_base:
        return "the teacher is the student's own base (adapters off)"
    if ctx.args.cross_tokenizer:
        return "cross_tokenizer compares the two models' logits at paired positions of two tokenizations"
    if ctx.task.needs_full_logits:
        return "label_smoothing_factor or compute_loss_func needs the student's full logits"
    if settings.kd_loss == "mse" and settings.kd_weight > 0:
        return "kd_loss='mse' compares raw logits, which the chunked loss head does not keep"
    engine_why = _engine_refusal(ctx, student, teachers)
    if engine_why is not None:
        return engine_why
    teacher = teachers[0] if teachers else None
    if not chunked.supports_hidden_only(student) or (teacher is not None and not chunked.supports_hidden_only(teacher)):
        return "the model's forward has no `logits_to_keep` argument"
    return None


def _engine_refusal(ctx: PathContext, student: nn.Module, teachers: list) -> str | None:
    """Why the loss head cannot run under this run's engine (FSDP1; a wrapped LM head under FSDP2 or multi-process
    ZeRO-3), or None. FSDP2 and ZeRO-3 hand the head whole weights, gathered once per step (engine_heads)."""
    if str(getattr(ctx.accelerator, "distributed_type", "")).endswith("FSDP") and engine_heads.engine(
            ctx.accelerator) is None:
        # FSDP1 keeps the LM head as a piece of the root unit's flat-parameter shard outside the model's forward
        # (a 1-D slice, possibly split across ranks): no per-parameter way to gather it with its gradient.
        return ("under FSDP1 the LM head is a piece of a flat-parameter shard outside the model's forward, which "
                "the loss head cannot gather with its gradient; use FSDP2 (fsdp_config={'version': 2}) or DDP for "
                "the loss head")
    kind = engine_heads.engine(ctx.accelerator)
    if kind is None or (kind == engine_heads.ZERO3 and _zero3_processes(ctx.accelerator) <= 1):
        return None  # one ZeRO-3 process: a wrapped head is called as a module (no one to wait for)
    models = [("student", student)] + [("teacher", t) for t in teachers[:1] if isinstance(t, nn.Module)]
    for role, model in models:
        with contextlib.suppress(ValueError, AttributeError):
            if not chunked.logits_fn(model).direct:
                return (f"under {'FSDP2' if kind == engine_heads.FSDP2 else 'DeepSpeed ZeRO-3 with several processes'} "
                        f"the loss head reads the LM head's weight, gathered once per step, and the {role}'s LM head "
                        f"({type(chunked.logits_fn(model).module).__name__}) is not a plain nn.Linear; merge or "
                        "drop the adapter on the LM head")
    return None


@register_path
class LossHead(KDPath):
    """The loss head against a dense teacher: the teacher model's LM head on its last hidden state (asked of the
    teacher instead of its logits), or cached whole logits. Under DeepSpeed or FSDP the LM heads are called as
    modules (`route`: the engines gather their parameters inside that call)."""

    name = "loss_head"
    priority = 20
    whole_logits = False
    request = TeacherRequest(hidden=True)
    forms = (None, DENSE, MODEL)

    @classmethod
    def applies(cls, ctx: PathContext, form: str | None, training: bool) -> bool:
        return training and ctx.chunk is not None and form in cls.forms

    def bind(self, state: Any, model: nn.Module) -> bool:
        """The student's logits (and the teacher's) are shown rebuilt exactly from the last hidden states: one
        two-token forward of each, no gradient, once per model. A model whose logits cannot be rebuilt is refused
        when kd_chunk_size was given, else trained on whole logits (False) with a warning."""
        ctx = self.ctx
        teacher = ctx.teacher_side.teacher
        if state.rebuilds is None:
            try:  # under the forward's autocast (mixed precision): the LM head multiplies in its dtype there too
                kind = engine_heads.engine(ctx.accelerator)
                with _unsharded(model), autocast(ctx.accelerator):
                    chunked.check_logits_fn(state.inner, state.inner.config.vocab_size, "student",
                                            engine_heads.check_head(kind, chunked.logits_fn(state.inner)))
                if teacher is not None and not ctx.teacher_rebuilds:
                    with _unsharded(teacher), autocast(ctx.accelerator):
                        chunked.check_logits_fn(teacher, unwrap(teacher).config.vocab_size, "teacher",
                                                engine_heads.check_head(kind, chunked.logits_fn(teacher)))
                    ctx.teacher_rebuilds = True
                state.rebuilds = True
            except ValueError as err:
                if ctx.args.kd_chunk_size is not None:
                    raise
                logger.warning("Causal-LM logits are computed whole (not in chunks): %s.", err)
                state.rebuilds = False
        if not state.rebuilds:
            return False
        self.s_head = chunked.logits_fn(state.inner)  # hidden states -> logits of the student and of the teacher
        self.t_head = chunked.logits_fn(teacher) if teacher is not None else None
        return True

    def student_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return chunked.hidden_only_kwargs(kwargs)

    def loss(self, batch: PathBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        ctx, settings, inputs = self.ctx, self.ctx.settings, batch.inputs
        labels = inputs.get(ctx.label_name)
        kd_fn = None
        if settings.kd_weight > 0:
            kd_fn = chunked.dense_kd(settings.kd_loss, settings.temperature, settings.effective_jsd_beta,
                                     settings.resolved_skew_alpha)
        kd_mask = kd_positions(inputs.get("attention_mask"), labels, settings.kd_token_mask, causal=True,
                               position_ids=inputs.get("position_ids"))  # packed rows: not across sequences
        teacher = batch.teacher
        t_logits, t_hidden = teacher.views[0][0] if teacher.views else None, teacher.hidden
        kind = engine_heads.engine(ctx.accelerator)
        gathered = kind is not None and self.s_head.direct and (self.t_head is None or self.t_head.direct)
        # under FSDP2 / ZeRO-3 the teacher's head whole, gathered once per step (every process: a collective)
        t_head = engine_heads.teacher_head(kind, self.t_head, t_hidden.dtype) if gathered and t_hidden is not None and (
            kd_fn is not None or ctx.shared_vocab is not None) else self.t_head
        if ctx.shared_vocab is not None and t_hidden is not None and 0 not in ctx.padding.checked:
            with torch.no_grad():  # the teacher's logits on the first batch's distilled tokens, a few rows at a time
                rows = t_hidden[:, :-1][kd_mask] if kd_mask is not None else t_hidden[:, :-1].flatten(0, 1)
                ctx.padding(0, (t_head(part) for part in rows.split(256)))
        ce_labels = labels[:, 1:] if batch.want_task and labels is not None else None
        s_hidden = chunked.last_hidden(batch.outputs)
        # Mixed precision: accelerate's autocast covers the models' forwards, not this code; the LM heads multiply in
        # the dtype they would inside the forward (bf16/fp16 operands, float32 outputs), not in the weights' float32.
        with autocast(ctx.accelerator):
            if not gathered:
                kd, ce = self._head(self.s_head, t_head, ctx.route, s_hidden, t_logits, t_hidden, kd_mask,
                                    ce_labels, kd_fn, self._fused(batch))
            else:  # the student's head whole for this one call (engine_heads), the direct route inside it
                def terms(s_head: chunked.LogitsHead, hidden: torch.Tensor) -> torch.Tensor:
                    # (kd_head_mode='fused' is refused under FSDP / DeepSpeed when the trainer is built)
                    kd, ce = self._head(s_head, t_head, "direct", hidden, t_logits, t_hidden, kd_mask, ce_labels,
                                        kd_fn, None)
                    zero = hidden.new_zeros((), dtype=torch.float32)
                    return torch.stack([zero if kd is None else kd.float(), zero if ce is None else ce.float()])

                empty = not _counts_a_token(s_hidden, kd_mask, ce_labels, kd_fn is not None)
                own = batch.outputs.get("logits") if isinstance(batch.outputs, dict) else getattr(
                    batch.outputs, "logits", None)  # the forward's own (empty) call of the head: engine_heads
                both = engine_heads.run_student(kind, self.s_head, s_hidden, empty, terms, anchor=own)
                kd, ce = (both[0] if kd_fn is not None else None), (both[1] if ce_labels is not None else None)
        return kd, (ctx.task.with_router_loss(batch.inner, batch.outputs, ce) if ce is not None else None)

    def _head(self, s_head, t_head, route, s_hidden, t_logits, t_hidden, kd_mask, ce_labels, kd_fn, fused):
        teacher = t_head if t_hidden is not None else (shift(t_logits) if t_logits is not None else None)
        return chunked.chunked_kd_and_ce(s_hidden, s_head, teacher, t_hidden, kd_mask, ce_labels, kd_fn,
                                         self.ctx.chunk, self.ctx.shared_vocab, route=route, fused=fused)

    def _fused(self, batch: PathBatch) -> tuple[float, float] | None:
        """kd_head_mode='fused': the weights the loss puts on the KD and CE means, each term's weight times its
        step-mean share (the loss head forms the gradients for them in its forward; a loss weighted otherwise is
        recomputed exactly, hf_distill.losses.fused_grads)."""
        if getattr(self.ctx.args, "kd_head_mode", "recompute") != "fused":
            return None
        settings = self.ctx.settings
        return (float(settings.kd_weight) * batch.scales.get("kd", 1.0),
                float(settings.task_weight) * batch.scales.get("labels", 1.0))


def _counts_a_token(s_hidden: torch.Tensor, kd_mask, ce_labels, kd: bool) -> bool:
    """Whether the head counts any position of this batch (the KD's, all without a mask, or the CE's)."""
    if s_hidden.shape[1] < 2:
        return False
    if kd and (kd_mask is None or bool(kd_mask.any())):
        return True
    return ce_labels is not None and bool((ce_labels != -100).any())


@register_path
class SparseHead(LossHead):
    """The loss head against an offline teacher signal's `(log_probs, indices, log_tail)` (a top-k + tail)."""

    name = "sparse_head"
    priority = 21
    forms = (SIGNAL,)

    def _head(self, s_head, t_head, route, s_hidden, t_logits, t_hidden, kd_mask, ce_labels, kd_fn, fused):
        return sparse_head.sparse_kd_and_ce(s_hidden, s_head, shift(t_logits), kd_mask, ce_labels, kd_fn,
                                            self.ctx.chunk, self.ctx.shared_vocab, route, fused)


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


__all__ = ["LossHead", "SparseHead", "chunk_size"]
