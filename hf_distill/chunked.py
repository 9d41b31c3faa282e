"""Token-level distillation of causal LMs without a full `(B, T, V)` logits tensor.

With a real vocabulary (32k-256k ids) the logits, not the model, dominate a KD step's memory: one float32
`(B, T, V)` tensor for each model, a softmax of each, and their gradients. Following the chunked losses of
Liger-Kernel and the "compute the LM head per chunk" trick of memory-efficient SFT, the models here return only
their last hidden states (`logits_to_keep` selects no position), and the counted positions go through each LM
head `kd_chunk_size` tokens at a time: the teacher's chunk under `no_grad`, the student's inside a checkpoint, so
its chunk logits are recomputed in backward instead of kept. The student's own cross-entropy is taken in the same
pass, so its full logits never exist either. Values and gradients equal the unchunked computation (tested to
1e-5); the price is one extra LM-head matmul per token for each model in backward.

Logits are rebuilt from the last hidden state by the model's output embedding plus the post-processing some
families apply (`final_logit_softcapping`: Gemma-2/3; `logit_scale`: Cohere; `logits_scaling`: Granite);
`check_logits_fn` verifies the rebuild against the model's own logits once, so an unknown post-processing is
refused rather than distilled wrongly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import losses
from .taps import unwrap

NO_LOGITS = "logits_to_keep"


def supports_hidden_only(model: nn.Module) -> bool:
    """True when the model's forward can skip its LM head (`logits_to_keep`), as transformers' causal LMs do."""
    import inspect

    inner = unwrap(model)
    return NO_LOGITS in inspect.signature(inner.forward).parameters


def logits_fn(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """Hidden states -> logits as the model computes them (LM head, then the family's post-processing)."""
    inner = unwrap(model)
    head = inner.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(inner).__name__} has no output embeddings (LM head) to compute logits in chunks.")
    config = inner.config
    cap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(inner, "logit_scale", None)
    scale = scale if isinstance(scale, int | float) else None
    divide = getattr(config, "logits_scaling", None)

    def fn(hidden: torch.Tensor) -> torch.Tensor:
        z = head(hidden)
        if scale is not None:
            z = z * scale
        if divide is not None:
            z = z / divide
        if cap is not None:
            z = torch.tanh(z / cap) * cap
        return z

    return fn


@torch.no_grad()
def check_logits_fn(model: nn.Module, vocab_size: int, role: str) -> None:
    """Compare `logits_fn` with the model's own logits on two tokens; refuse a model whose logits differ."""
    inner = unwrap(model)
    device = next(inner.parameters()).device
    ids = torch.tensor([[1, min(2, vocab_size - 1)]], device=device)
    was_training = inner.training
    inner.eval()
    try:
        out = inner(input_ids=ids, output_hidden_states=True)
        rebuilt = logits_fn(model)(out.hidden_states[-1])
    finally:
        inner.train(was_training)
    if not torch.allclose(rebuilt.float(), out.logits.float(), atol=1e-4, rtol=1e-4):
        raise ValueError(
            f"The {role} ({type(inner).__name__}) computes its logits in a way hf_distill cannot rebuild from its last "
            "hidden state, so they cannot be computed in chunks. Set kd_chunk_size=None and use a model whose "
            "logits are its LM head's output (with softcapping, logit_scale or logits_scaling)."
        )


def hidden_only_kwargs(kwargs: dict) -> dict:
    """Forward arguments that make a causal LM return its hidden states and no logits."""
    return {**kwargs, NO_LOGITS: torch.empty(0, dtype=torch.long), "output_hidden_states": True}


def last_hidden(out) -> torch.Tensor:
    hidden = out.get("hidden_states") if isinstance(out, dict) else getattr(out, "hidden_states", None)
    if not hidden:
        raise ValueError("The model returned no hidden_states with output_hidden_states=True.")
    return hidden[-1]


def _counted_rows(s_hidden, teacher, t_hidden, kd_mask, labels, kd):
    """The positions either term counts, gathered once: student states, teacher source, which term counts each
    row, the next-token targets, and the two counts."""
    s = s_hidden[:, :-1]
    b, t = s.shape[:2]
    kd_rows = torch.ones(b, t, dtype=torch.bool, device=s.device) if kd_mask is None else kd_mask.bool()
    ce_rows = labels != -100 if labels is not None else torch.zeros_like(kd_rows)
    if kd is None:
        kd_rows = torch.zeros_like(kd_rows)
    rows = kd_rows | ce_rows
    t_source = None
    if kd is not None:
        t_source = t_hidden[:, :-1][rows] if t_hidden is not None else teacher[rows]
    is_kd, is_ce = kd_rows[rows], ce_rows[rows]
    targets = labels[rows] if labels is not None else None
    return s[rows], t_source, is_kd, is_ce, targets, int(is_kd.sum()), int(is_ce.sum())


def _chunks(n: int, size: int, t_source, is_kd, is_ce, targets):
    """Per chunk of `size` rows: its slice, and its teacher source, KD/CE row flags and targets (None stays None)."""
    for start in range(0, n, size):
        part = slice(start, start + size)
        yield part, tuple(None if x is None else x[part] for x in (t_source, is_kd, is_ce, targets))


def _chunk_sums(student_logits, teacher, from_hidden: bool, kd, vocab, h, t_part, kd_part, ce_part, y):
    """`[KD sum, CE sum]` of one chunk of rows (the KD mean of the chunk times its KD rows)."""
    z = student_logits(h).float()
    z = z[:, :vocab] if vocab is not None else z
    kd_sum = z.new_zeros(())
    ce_sum = z.new_zeros(())
    if kd is not None and bool(kd_part.any()):
        with torch.no_grad():
            tz = teacher(t_part) if from_hidden else t_part
            tz = tz.float()[:, :vocab] if vocab is not None else tz.float()
        every = bool(kd_part.all())  # the usual case: no (n, V) copies of both sides
        kd_sum = kd(z if every else z[kd_part], tz if every else tz[kd_part]) * kd_part.sum()
    if y is not None and bool(ce_part.any()):
        every = bool(ce_part.all())
        ce_sum = F.cross_entropy(z if every else z[ce_part], y if every else y[ce_part], reduction="sum")
    return torch.stack([kd_sum, ce_sum])


def chunked_kd_and_ce(
    s_hidden: torch.Tensor,
    student_logits: Callable[[torch.Tensor], torch.Tensor],
    teacher: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None,
    t_hidden: torch.Tensor | None,
    kd_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    kd: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    chunk_size: int,
    vocab: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Next-token KD (mean over `kd_mask` positions) and cross-entropy (mean over `labels != -100`).

    `s_hidden`/`t_hidden` are `(B, T, H)` last hidden states; position t is compared with token t+1, so the
    inputs are the shifted views: `kd_mask` and `labels` are `(B, T-1)`. `teacher` is either the teacher's
    logits function (with `t_hidden`) or cached dense logits `(B, T-1, V)`. `kd(s, t)` returns the mean divergence
    of `(n, V)` rows. `vocab` cuts both models' logits to the ids they share (padded vocabularies of one family).
    Returns `(kd, ce)`, each None when not asked for. Each chunk runs inside a checkpoint (its logits are
    recomputed in backward), so the two values may be used in any way; :func:`fused_kd_and_ce` saves the
    recomputation when their weights are known in advance.
    """
    s_rows, t_source, is_kd, is_ce, targets, n_kd, n_ce = _counted_rows(s_hidden, teacher, t_hidden, kd_mask,
                                                                         labels, kd)
    one_chunk = functools.partial(_chunk_sums, student_logits, teacher, t_hidden is not None, kd, vocab)
    total = s_rows.new_zeros(2, dtype=torch.float32)
    for part, rest in _chunks(s_rows.shape[0], chunk_size, t_source, is_kd, is_ce, targets):
        total = total + checkpoint(one_chunk, s_rows[part], *rest, use_reentrant=False)
    if s_rows.shape[0] == 0:  # keep the graph connected to the student when nothing is counted
        total = total + s_hidden.sum() * 0
    kd_value = total[0] / max(n_kd, 1) if kd is not None else None
    ce_value = total[1] / max(n_ce, 1) if labels is not None else None
    return kd_value, ce_value


class _Precomputed(torch.autograd.Function):
    """A scalar whose gradients with respect to `inputs` were computed in the forward pass already."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, grads: list, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return value.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        # Grad mode is on in backward only under create_graph=True (once_differentiable would hide that: with
        # an upstream gradient that needs no grad it returns the constants silently).
        if torch.is_grad_enabled():
            raise RuntimeError(
                "The fused causal-LM loss (hf_distill.chunked.fused_kd_and_ce) has no second derivative: its "
                "gradient was computed in the forward pass. For a second derivative (create_graph=True) compute "
                "the loss with hf_distill.chunked.chunked_kd_and_ce, whose chunks are recomputed in backward."
            )
        return (None, None, *(None if grad is None else grad * g.to(grad.dtype) for grad in ctx.grads))


def fused_kd_and_ce(
    s_hidden: torch.Tensor,
    student_logits: Callable[[torch.Tensor], torch.Tensor],
    params: list[torch.Tensor],
    teacher: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None,
    t_hidden: torch.Tensor | None,
    kd_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    kd: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    chunk_size: int,
    vocab: int | None = None,
    kd_weight: float = 1.0,
    ce_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`kd_weight * KD + ce_weight * CE` with its gradient taken chunk by chunk during the forward pass.

    The same KD and CE as :func:`chunked_kd_and_ce`, but each chunk's logits are computed once: right after a
    chunk's loss, its gradient with respect to the chunk's hidden states and to `params` (the LM head's trainable
    parameters) is taken and kept (`(n, H)` and the parameters' size), and the logits are dropped. The backward
    pass only scales those gradients, so neither model's LM head runs again (Liger-Kernel's fused linear losses
    do the same). The price is that the gradient is fixed in the forward pass: the result is one scalar with
    the weights given here, plus the detached KD and CE means for logging, and no second derivative (double
    backward raises). Parameters the chunk loss uses must all be in `params` (or be frozen): the LM head's own
    trainable parameters are. Under fp16 mixed precision use :func:`chunked_kd_and_ce`: these gradients are taken
    before the loss scaler multiplies the loss, so small ones would underflow in float16.
    Returns `(loss, kd, ce)`; `kd`/`ce` are None when not asked for.
    """
    s_rows, t_source, is_kd, is_ce, targets, n_kd, n_ce = _counted_rows(s_hidden, teacher, t_hidden, kd_mask,
                                                                         labels, kd)
    one_chunk = functools.partial(_chunk_sums, student_logits, teacher, t_hidden is not None, kd, vocab)
    coef = torch.tensor([kd_weight / max(n_kd, 1), ce_weight / max(n_ce, 1)], device=s_rows.device)
    differentiate = torch.is_grad_enabled()  # under no_grad (a loss logged by a callback) only the values
    states = s_rows.detach()
    grad_states = torch.zeros_like(states) if s_rows.requires_grad and differentiate else None
    grad_params = [torch.zeros_like(p) for p in params] if differentiate else []
    sums = states.new_zeros(2, dtype=torch.float32)
    for part, rest in _chunks(states.shape[0], chunk_size, t_source, is_kd, is_ce, targets):
        h = states[part].detach().requires_grad_(grad_states is not None)
        with torch.set_grad_enabled(differentiate):
            pair = one_chunk(h, *rest)
            wrt = ([h] if grad_states is not None else []) + (list(params) if differentiate else [])
            if wrt and pair.requires_grad:
                grads = list(torch.autograd.grad((pair * coef).sum(), wrt, allow_unused=True))
                if grad_states is not None:
                    grad_states[part] = grads.pop(0)
                for acc, grad in zip(grad_params, grads, strict=True):
                    if grad is not None:
                        acc += grad
        sums += pair.detach()
    value = (sums * coef).sum()
    loss = _Precomputed.apply(value, [grad_states, *grad_params], s_rows, *params) if differentiate else value
    if s_rows.shape[0] == 0:  # keep the graph connected to the student when nothing is counted
        loss = loss + s_hidden.sum() * 0
    kd_value = sums[0] / max(n_kd, 1) if kd is not None else None
    ce_value = sums[1] / max(n_ce, 1) if labels is not None else None
    return loss, kd_value, ce_value


def head_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The trainable parameters of the model's LM head (the ones :func:`fused_kd_and_ce` differentiates)."""
    head = unwrap(model).get_output_embeddings()
    return [p for p in head.parameters() if p.requires_grad]


def dense_kd(kind: str, temperature: float, beta: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The logit KD objective named `kind` on `(n, V)` rows (mean over rows)."""

    def fn(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return losses.logit_kd_loss(kind, s, t, temperature, beta=beta)

    return fn
