"""What the two causal-LM loss heads share, in the one module below them: the dense head
(:mod:`hf_distill.losses.kd_head`), the sparse head (:mod:`hf_distill.losses.sparse_head`) and their public entry point
(:mod:`hf_distill.losses.chunked`, which re-exports the public names) all import it, and it imports none of them, so
no loss-head module reaches back into another.

- float32-output GEMMs (:func:`mm_f32`, :func:`addmm_f32`, :class:`_LinearF32` and the :class:`float32_logits` mode
  the module route uses): every logit comes out of its GEMM in float32, never rounded to bf16/fp16 on the way out.
- what both heads take: :class:`LogitsHead` (a model's LM head and post-processing) and :class:`KDSpec` (the KD
  objective, :func:`dense_kd`).
- the entry points' common frame: the counted rows (:func:`counted_rows`), the module route's checkpointed token
  chunks (:func:`module_sums`), and the route's choice and the two sums' means (:func:`head_means`). Each head adds
  only its teacher: its rows, its KD sum per chunk and its autograd function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint
from transformers.utils import logging

from . import divergences as losses
from .registry import get_divergence

logger = logging.get_logger(__name__)

#: The divergences with a closed-form logit gradient here (`kd_loss` values): the registry's kinds with row math
#: (:mod:`hf_distill.losses.registry`, a live view).
DIVERGENCES = losses.DIVERGENCE_KINDS


# ---------------------------------------------------------------------------------------------- float32-output GEMMs


@functools.cache
def _cuda_out_dtype() -> bool:
    """Whether this torch has `torch.mm(..., out_dtype=float32)` for bf16/fp16 CUDA operands (torch >= 2.8)."""
    try:
        a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` with float32 output: low-precision operands are multiplied exactly and summed in float32, never
    rounded to their own dtype on the way out. CUDA: one low-precision GEMM with a float32 output; elsewhere the
    operands are upcast (a bf16 or fp16 product is exact in float32, so the result is the same). Not
    differentiable on CUDA (`out_dtype` has no derivative): :class:`_LinearF32` is the differentiable form."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and a.dtype == b.dtype and _cuda_out_dtype():
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


@functools.cache
def _cuda_addmm_out_dtype() -> bool:
    """Whether this torch adds a bf16/fp16 CUDA product into a float32 accumulator in place,
    `torch.addmm(c32, a, b, out_dtype=float32, out=c32)` (the GEMM's epilogue reads and writes `c32`: no copy of it)."""
    try:
        a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
        c = torch.ones(16, 16, device="cuda")
        out = torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
        return out.data_ptr() == c.data_ptr() and bool((c == 17).all())
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def addmm_f32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`acc += a @ b` into a float32 accumulator, the product as in :func:`mm_f32` (on CUDA the addition happens in
    the GEMM's epilogue, in place). Not differentiable: used where gradients are formed by hand."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and a.dtype == b.dtype and _cuda_addmm_out_dtype():
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return acc.add_(mm_f32(a, b))


@functools.cache
def _cuda_mm_out_dtype_into() -> bool:
    """Whether this torch writes a bf16/fp16 CUDA product into a given float32 tensor,
    `torch.mm(a, b, out_dtype=float32, out=c32)` (no temporary, and `c32`'s old contents neither read nor kept)."""
    try:
        a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
        c = torch.full((16, 16), float("nan"), device="cuda")
        out = torch.mm(a, a, out_dtype=torch.float32, out=c)
        return out.data_ptr() == c.data_ptr() and bool((c == 16).all())
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def mm_f32_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`out = a @ b` written into the float32 tensor `out` (contiguous), the product as in :func:`mm_f32`: no
    temporary and no copy (a first write of an accumulator needs no zero-fill, a row block of a gradient no copy).
    Not differentiable: used where gradients are formed by hand."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and a.dtype == b.dtype:
        if _cuda_mm_out_dtype_into():
            return torch.mm(a, b, out_dtype=torch.float32, out=out)
        if _cuda_addmm_out_dtype():  # a torch with addmm's form only: zeros, then the in-place product
            return addmm_f32(out.zero_(), a, b)
    return torch.mm(a.float(), b.float(), out=out)


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the model's own `F.linear(x, weight)` would multiply in: autocast's, else the weight's."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class _LinearF32(torch.autograd.Function):
    """`F.linear` with float32 output and float32-accumulated gradients, operands in the linear's compute dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        dtype = _compute_dtype(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            flat = x.reshape(-1, x.shape[-1]).to(dtype)
            out = mm_f32(flat, weight.to(dtype).t())
            if bias is not None:
                out += bias.float()
        ctx.save_for_backward(x, weight)
        ctx.dtype, ctx.has_bias = dtype, bias is not None
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            raise RuntimeError("hf_distill's float32-output linear has no second derivative.")
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(ctx.dtype)
        flat = x.reshape(-1, x.shape[-1]).to(ctx.dtype)
        w = weight.to(ctx.dtype)
        gx = mm_f32(g, w).to(x.dtype).reshape(x.shape) if ctx.needs_input_grad[0] else None
        gw = mm_f32(g.t(), flat).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = grad.reshape(-1, grad.shape[-1]).float().sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


#: The matrix products a custom LM head may compute its logits with instead of `F.linear` (`h @ W.T`,
#: `torch.matmul(h, W.t())`, `h.mm(...)`): :class:`float32_logits` gives them a float32 output too.
_MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm})
_LOW = (torch.bfloat16, torch.float16)


def _matmul_f32(func, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`func(a, b)` (a matrix product) with float32 output where it would round to bf16/fp16 (low-precision
    operands, or autocast to a low-precision dtype), from operands in the dtype the product would have used: by a
    matrix `b` (an LM head's weight, transposed) the linear's own :class:`_LinearF32` on `b.t()`; any other shape
    with its operands upcast (their products are exact in float32). Elsewhere `func` itself, unchanged."""
    device = a.device.type
    auto = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in _LOW
    if not (auto or a.dtype in _LOW or b.dtype in _LOW) or not (a.is_floating_point() and b.is_floating_point()):
        return func(a, b)
    if b.dim() == 2 and a.dim() >= 1:
        return _LinearF32.apply(a, b.t(), None)
    dtype = torch.get_autocast_dtype(device) if auto else torch.promote_types(a.dtype, b.dtype)
    with torch.autocast(device, enabled=False):
        return torch.matmul(a.to(dtype).float(), b.to(dtype).float())


class float32_logits(TorchFunctionMode):  # noqa: N801 (used as a context manager, like torch.no_grad)
    """Within it, every `F.linear` computes its output in float32 from operands in its usual dtype (:func:`mm_f32`),
    and so does every low-precision matrix product (`@`, `torch.matmul`, `torch.mm`: a custom head's own GEMM).
    Used around an LM head's module call, so an engine's parameter hooks still run."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return _LinearF32.apply(x, weight, bias)
        if func in _MATMULS and len(args) == 2 and not kwargs and all(isinstance(t, torch.Tensor) for t in args):
            return _matmul_f32(func, *args)
        return func(*args, **kwargs)


@functools.cache
def _warn_rounded_logits(head: str, dtype: torch.dtype) -> None:
    """Once per head type and dtype: its logits came out rounded (an op :class:`float32_logits` cannot widen)."""
    logger.warning(
        "The LM head %s returns %s logits from an operation hf_distill cannot compute in float32 (it widens "
        "nn.Linear, F.linear and matmul): they are upcast after that rounding, so KD gradients near agreement can be "
        "10-40%% off float64 instead of ~0.2%% (issue #29); use an nn.Linear head, or train the head in float32.",
        head, str(dtype).removeprefix("torch."))

# ---------------------------------------------------------------------------------------------- what the heads take


@dataclass
class LogitsHead:
    """A model's hidden states -> logits: its output embedding, then the family's post-processing
    (`z = scale * (h W^T + b)`, then `cap * tanh(z / cap)` when the family soft-caps). Calling it computes the
    logits as the model does (its own dtype); the loss head reads `weight`/`bias` (direct) or calls `module`."""

    module: nn.Module
    scale: float = 1.0
    cap: float | None = None

    @property
    def direct(self) -> bool:
        """A plain `nn.Linear` (no adapter or wrapper of its own): its weight can be read directly."""
        return type(self.module).forward is nn.Linear.forward and isinstance(self.module, nn.Linear)

    def post(self, z: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            z = z * self.scale
        if self.cap is not None:
            z = torch.tanh(z / self.cap) * self.cap
        return z

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.post(self.module(hidden))

    def float32(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits in float32, through the module call (engines' hooks run) with float32-output linears."""
        with float32_logits():
            z = self.module(hidden)
        if z.dtype in _LOW:
            _warn_rounded_logits(type(self.module).__name__, z.dtype)
        return self.post(z.float())



@dataclass(frozen=True)
class KDSpec:
    """A logit KD objective on `(n, V)` rows: `kind` (a registered kind: one of :data:`DIVERGENCES`, or `mse`), its
    temperature and its mixture weight (`beta` for `jsd`, `alpha` for the skew divergences). Called on dense rows it
    returns their mean divergence through :func:`hf_distill.losses.logit_kd_loss` (the module path's loss math)."""

    kind: str
    temperature: float = 1.0
    beta: float = 0.5
    alpha: float = 0.1

    def __call__(self, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return losses.logit_kd_loss(self.kind, s, t, self.temperature, beta=self.beta, alpha=self.alpha)

    @property
    def factor(self) -> float:
        """The constant in front of the divergence, its registry entry's: `T**2` (Hinton et al.), none for soft CE
        (TinyBERT)."""
        return get_divergence(self.kind).factor(self.temperature)


def dense_kd(kind: str, temperature: float, beta: float = 0.5, alpha: float = 0.1) -> KDSpec:
    """The logit KD objective named `kind` on `(n, V)` rows (mean over rows). `jsd` at beta 0 is the forward KL and
    at beta 1 the reverse KL (GKD's convention, as :func:`hf_distill.losses.generalized_jsd`); the mixture formula
    itself is identically 0 there, so those two are named by the KL they are."""
    get_divergence(kind)  # an unknown kind: refused here, before any loss head sees it
    if kind == "jsd" and float(beta) in (0.0, 1.0):
        kind = "kl" if float(beta) == 0.0 else "reverse_kl"
    return KDSpec(kind, float(temperature), float(beta), float(alpha))


def vocab_size(head: LogitsHead) -> int:
    """The number of ids an LM head scores (its weight's rows; `out_features` for a head without one). A ZeRO-3
    weight is empty outside its module's call: its full shape is `ds_shape`."""
    weight = getattr(head.module, "weight", None)
    return int(getattr(weight, "ds_shape", weight.shape)[0]) if weight is not None else int(head.module.out_features)


# ---------------------------------------------------------------------------------------------- the entry points' frame


class Counted(NamedTuple):
    """The positions either term counts, gathered once (:func:`counted_rows`)."""

    rows: torch.Tensor  # (B, T-1) bool: which positions are counted (a teacher's own parts are gathered by it)
    hidden: torch.Tensor  # (N, H): the student's states of the counted positions
    is_kd: torch.Tensor  # (N,) bool: the rows the KD counts
    is_ce: torch.Tensor  # (N,) bool: the rows the CE counts
    targets: torch.Tensor | None  # (N,): next-token ids (0 on rows counted for KD only); None without labels
    n_kd: int
    n_ce: int
    every: bool = False  # every position counted: the rows are `(B, T-1)` flattened, views where the layout allows

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """`x[rows]` of a per-position tensor `(B, T-1, ...)` (a teacher's states, logits or signal): where every
        position counts, the same rows flattened (a view where `x`'s layout allows: no gather, no `(N, V)` copy)."""
        return _take_rows(x, self.rows, self.every)


def _take_rows(x: torch.Tensor, rows: torch.Tensor, every: bool) -> torch.Tensor:
    return x.reshape(-1, *x.shape[2:]) if every else x[rows]


def counted_rows(s_hidden: torch.Tensor, kd_mask: torch.Tensor | None, labels: torch.Tensor | None,
                 kd: KDSpec | None) -> Counted:
    """The rows both heads walk: every shifted position the KD (`kd_mask`, all without one; none without `kd`) or
    the CE (`labels != -100`) counts, so a position counted by neither costs no logits."""
    s = s_hidden[:, :-1]
    b, t = s.shape[:2]
    kd_rows = torch.ones(b, t, dtype=torch.bool, device=s.device) if kd_mask is None else kd_mask.bool()
    ce_rows = labels != -100 if labels is not None else torch.zeros_like(kd_rows)
    if kd is None:
        kd_rows = torch.zeros_like(kd_rows)
    rows = kd_rows | ce_rows
    every = bool(rows.all())  # the usual pretraining / packed case: flattened views instead of boolean gathers
    take = functools.partial(_take_rows, rows=rows, every=every)
    is_kd, is_ce = take(kd_rows), take(ce_rows)
    targets = take(labels) if labels is not None else None
    if targets is not None:
        targets = torch.where(is_ce, targets, 0)  # rows counted for KD only: any valid id, weighted 0
    return Counted(rows, take(s), is_kd, is_ce, targets, int(is_kd.sum()), int(is_ce.sum()), every)


KDSum = Callable[..., torch.Tensor]
"""A head's KD sum of one module-route chunk: `(float32 logits, kd_part, *teacher parts) -> sum over kd_part`."""


def _module_chunk(s_head: LogitsHead, kd_sum: KDSum | None, h, kd_part, ce_part, y, *teacher):
    """`[KD sum, CE sum]` of one chunk of rows through the head's module call (float32 logits)."""
    z = s_head.float32(h)
    kd_value = kd_sum(z, kd_part, *teacher) if kd_sum is not None and bool(kd_part.any()) else z.new_zeros(())
    ce_value = z.new_zeros(())
    if y is not None and bool(ce_part.any()):
        every = bool(ce_part.all())  # the usual case: no (n, V) copy
        ce_value = F.cross_entropy(z if every else z[ce_part], y if every else y[ce_part], reduction="sum")
    return torch.stack([kd_value, ce_value])


def module_sums(s_head: LogitsHead, kd_sum: KDSum | None, counted: Counted, teacher: tuple,
                chunk: int) -> torch.Tensor:
    """The module route (engines, wrapped heads): `[KD sum, CE sum]` over the counted rows, each chunk of `chunk`
    tokens through the head's module call inside a checkpoint, so the engines' parameter hooks run and only one
    chunk's logits are alive. `teacher`: the head's per-row teacher parts (Nones without a KD), sliced with the rows."""
    one_chunk = functools.partial(_module_chunk, s_head, kd_sum)
    s_rows = counted.hidden
    rest = (counted.is_kd, counted.is_ce, counted.targets, *teacher)
    total = s_rows.new_zeros(2, dtype=torch.float32)
    for start in range(0, s_rows.shape[0], chunk):
        part = slice(start, start + chunk)
        total = total + checkpoint(one_chunk, s_rows[part], *(None if x is None else x[part] for x in rest),
                                   use_reentrant=False)
    return total


def head_means(s_hidden: torch.Tensor, counted: Counted, kd: KDSpec | None, labels: torch.Tensor | None, route: str,
               direct_ok: bool, needs: str, direct: Callable[[], torch.Tensor],
               module: Callable[[], torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The entry points' ending: the route (`"auto"`: direct where `direct_ok`), the two sums from `direct()` or
    `module()` (zeros still attached to `s_hidden`'s graph where no row counts), and their means over the rows each
    term counts: `(kd, ce)`, each None when not asked for."""
    if route == "auto":
        route = "direct" if direct_ok else "module"
    if counted.hidden.shape[0] == 0:
        total = s_hidden.sum().float() * 0 + s_hidden.new_zeros(2, dtype=torch.float32)
    elif route == "direct":
        if not direct_ok:
            raise ValueError(f"route='direct' needs {needs}")
        total = direct()
    elif route == "module":
        total = module()
    else:
        raise ValueError(f"route must be 'auto', 'direct' or 'module', got {route!r}")
    kd_value = total[0] / max(counted.n_kd, 1) if kd is not None else None
    ce_value = total[1] / max(counted.n_ce, 1) if labels is not None else None
    return kd_value, ce_value
