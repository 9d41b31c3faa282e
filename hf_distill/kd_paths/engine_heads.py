"""The LM heads' weights for the causal-LM loss head under FSDP2 and multi-process DeepSpeed ZeRO-3.

The loss head (:mod:`hf_distill.losses.chunked`, direct route) reads each LM head's weight and walks the tokens in
chunks without calling the head as a module. Under a sharding engine the weight is a shard outside the engine's own
calls, so this module hands the head a full weight, gathered ONCE per step whatever the number of token chunks, and
returns the weight's gradient to its shards:

- FSDP2 (`fully_shard`): a weight still unsharded after the model's forward (accelerate's tail unit of final norm and
  LM head, `reshard_after_forward=False`) is read as it is, and FSDP2 reduce-scatters its gradient with the unit's;
  a weight already resharded (a `DTensor`) is gathered by `full_tensor()`, its gradient reduce-scattered back
  (averaged over the ranks, as FSDP2 averages).
- DeepSpeed ZeRO-3: the student's head module is called once, its forward replaced for that call by the whole loss
  head, so ZeRO-3's own hooks gather the weight before it (and again before its backward) and partition its
  gradient after it.
- a sharded teacher's head (FSDP2 or ZeRO-3): gathered once under no_grad and kept for the backward's recomputation.

Every process therefore runs the same collectives in the same order however many tokens it holds (a process with no
counted token still touches the weight, so that its gradient exists and is reduced with the others'). Before this,
the head was called as a module once per token chunk, and processes with different chunk counts waited for each
other forever (ZeRO-3), or the head's unit was resharded under the norm's backward (FSDP2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..losses.chunked import LogitsHead

FSDP2, ZERO3 = "fsdp2", "zero3"


def engine(accelerator: Any) -> str | None:
    """`"fsdp2"` or `"zero3"` where the LM heads' weights are sharded (and this module gathers them), else None."""
    if accelerator is None:
        return None
    kind = str(getattr(getattr(accelerator, "distributed_type", None), "value", ""))
    if kind == "FSDP" and getattr(accelerator, "is_fsdp2", False):
        return FSDP2
    if kind == "DEEPSPEED":
        plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
        config = getattr(plugin, "deepspeed_config", None) or {}
        if config.get("zero_optimization", {}).get("stage") == 3:
            return ZERO3
    return None


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def _as_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An `nn.Linear` (for the loss head's direct route) whose weight and bias are the given tensors, which may be
    non-leaf (a gathered weight whose gradient flows back to its shards): plain attributes, not parameters."""
    lin = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(lin)
    lin.in_features, lin.out_features = int(weight.shape[1]), int(weight.shape[0])
    lin.weight, lin.bias = weight, bias
    return lin


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` (FSDP2's mean over the ranks of a reduce-scattered sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _full(t: torch.Tensor | None, grad: bool, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """The whole of an FSDP2 parameter: a `DTensor` shard gathered (its gradient reduce-scattered back and averaged
    over the ranks when `grad`), a tensor that is already whole as it is. `dtype`: the dtype the module computes in
    (FSDP2's mixed precision gathers its parameters in `param_dtype`, the dtype of the hidden states it gets): the
    shard is cast before the gather, as FSDP2 casts it."""
    if t is None or not _is_dtensor(t):
        return t
    if dtype is not None and t.is_floating_point() and dtype != t.dtype:
        t = t.to(dtype)
    if not grad:
        return t.detach().full_tensor()
    from torch.distributed.tensor import Partial

    full = t.full_tensor(grad_placements=[Partial()] * len(t.placements))
    return _ScaleGrad.apply(full, 1.0 / t.device_mesh.size())


def fsdp2_head(head: LogitsHead, grad: bool, dtype: torch.dtype | None = None) -> LogitsHead:
    """The head with its weight (and bias) whole, in `dtype` where given (see :func:`_full`): the module docstring."""
    module = head.module
    if not (_is_dtensor(module.weight) or _is_dtensor(module.bias)):
        return head
    return dataclasses.replace(head, module=_as_linear(_full(module.weight, grad, dtype),
                                                       _full(module.bias, grad, dtype)))


class _InputDtypeLinear(nn.Module):
    """`F.linear` with the weight (and bias) cast to the input's dtype: a head whole for the one-time logits check,
    multiplying in the dtype FSDP2's mixed precision would gather it in (that of the hidden states it gets)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.w, self.b = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w.to(x.dtype), None if self.b is None else self.b.to(x.dtype))


def zero3_teacher_head(head: LogitsHead) -> LogitsHead:
    """A ZeRO-3 teacher's head with its weight gathered once (a collective: every process calls it) and copied,
    so the backward's recomputation of the teacher's logits reads it after ZeRO-3 partitions the original again."""
    import deepspeed

    module = head.module
    params = [p for p in (module.weight, module.bias) if p is not None]
    with torch.no_grad(), deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        weight = module.weight.detach().clone()
        bias = module.bias.detach().clone() if module.bias is not None else None
    return dataclasses.replace(head, module=_as_linear(weight, bias))


def check_head(kind: str | None, head: LogitsHead) -> LogitsHead:
    """The head for the one-time check that the logits are rebuilt from the hidden states (no gradient): under
    FSDP2 its weight whole and read, not called as a module (a call would run its unit's hooks out of turn)."""
    if kind != FSDP2:
        return head
    module = head.module
    bias = module.bias
    return dataclasses.replace(head, module=_InputDtypeLinear(_full(module.weight, False).detach(),
                                                              None if bias is None else _full(bias, False).detach()))


def teacher_head(kind: str | None, head: LogitsHead | None, dtype: torch.dtype | None = None) -> LogitsHead | None:
    """The teacher's head as the loss head reads it: gathered once per step under a sharding engine (FSDP2: in
    `dtype`, that of the teacher's hidden states)."""
    if head is None or kind is None:
        return head
    if kind == FSDP2:
        return fsdp2_head(head, grad=False, dtype=dtype)
    if hasattr(head.module.weight, "ds_id"):  # a ZeRO-3 parameter (a teacher under ZeRO-0/1/2 is a replica)
        return zero3_teacher_head(head)
    return head


def _touch(out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`out` with a zero term read from `weight`: a process with no counted token still gives the weight a
    (zero) gradient, so every process reduces the same gradients."""
    return out + weight.reshape(-1)[:1].sum() * 0


def run_student(kind: str | None, head: LogitsHead, s_hidden: torch.Tensor, empty: bool,
                fn: Callable[[LogitsHead, torch.Tensor], torch.Tensor],
                anchor: torch.Tensor | None = None) -> torch.Tensor:
    """`fn(head, s_hidden)` (the loss head, returning its terms stacked in one tensor) with the student's head whole.

    FSDP2: the weight gathered once (or read where FSDP2 keeps it whole); ZeRO-3: `fn` runs as the head module's
    forward, once, so ZeRO-3's hooks gather the weight around it and around its backward. `empty`: this process
    counts no token (its terms do not read the weight). `anchor`: the model's own (empty) logits, the output of the
    forward's call of the head: under FSDP2 FSDP registers the head unit's pre-backward gather on it, so the result
    reads it (times 0): the unit is gathered again before the final norm's backward, as after a whole-logits forward
    (without it, a unit resharded after the forward left the norm's backward reading freed storage: a segfault)."""
    if kind == ZERO3 and hasattr(head.module.weight, "ds_id"):
        return _call_as_module(head, s_hidden, empty, fn)
    if kind == FSDP2:
        head = fsdp2_head(head, grad=True, dtype=s_hidden.dtype)
    out = fn(head, s_hidden)
    if kind == FSDP2 and anchor is not None and anchor.requires_grad:
        out = out + anchor.sum() * 0
    return _touch(out, head.module.weight) if empty and kind is not None and torch.is_grad_enabled() else out


def _call_as_module(head: LogitsHead, s_hidden: torch.Tensor, empty: bool,
                    fn: Callable[[LogitsHead, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One call of the ZeRO-3 head module whose forward is `fn` for that call: inside it the module's parameters
    are whole (ZeRO-3's pre-forward gather), and its output's backward gathers them again and reduces their
    gradients (ZeRO-3's backward hooks), as for any module ZeRO-3 partitions."""
    module = head.module

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        out = fn(head, hidden)
        return _touch(out, module.weight) if empty and torch.is_grad_enabled() else out

    module.forward = forward  # an instance attribute: nn.Module.__call__ runs the hooks, then this
    try:
        return module(s_hidden)
    finally:
        del module.forward


__all__ = ["FSDP2", "ZERO3", "check_head", "engine", "fsdp2_head", "run_student", "teacher_head", "zero3_teacher_head"]
