"""The causal-LM loss head: token-level KD and the student's cross-entropy from last hidden states, without a full
`(B, T, V)` logits tensor, with gradients faithful to float64 in bf16/fp16.

With a real vocabulary (32k-256k ids) the logits, not the model, dominate a KD step's memory, so the models return
only their last hidden states (`logits_to_keep` selects no position) and this module takes both LM heads itself.

Precision. Near agreement (student ~ teacher, where every KD run ends up) the divergence gradient, a difference of
two near-equal distributions, is as small as the rounding of a bf16 logit: logits that come out of a bf16 GEMM
rounded to bf16 give gradients 8-40% off a float64 computation on the same inputs (issue #29; TRL 1.16's kernel
comment says the same of its own: rounding "biases training"). Every logit here comes out of its GEMM in float32
(:func:`.head_common.mm_f32`: bf16/fp16 operands, float32 accumulation and output), so the only roundings left are the
gradients' own casts to the parameters' dtype, ~0.2% in bf16 (`benchmarks/kd_precision.py`).

One path, two ways to reach the LM heads:

- **direct** (one process, DDP, fp16 and bf16, any mixed precision): :class:`.kd_head._KDHead`, an autograd function
  that reads each head's weight. Its forward walks the counted tokens in chunks of `chunk_size` rows (every vocabulary
  column of a row at once) and keeps, per row, the two log-normalisers, the CE normaliser and one statistic of the
  divergence: ~5 floats. Its backward walks the *vocabulary* in blocks (every row at once), recomputes both models'
  logits for the block, forms the block's logit gradient in closed form from those row statistics, and writes
  `dL/dW[block] = G^T H` with a single rounding (no bf16 accumulation over token chunks, which alone costs ~0.5%
  at 32 chunks), accumulating `dL/dH` in float32. Cost: six LM-head GEMMs (two in the forward, four in the
  backward) against the three of a bare student head; no `(N, V)` tensor; the gradient is taken in the backward,
  so the loss may be weighted, scaled (fp16's GradScaler) or combined after the call like any other tensor.
- **module** (DeepSpeed ZeRO-0/1/2, and heads that are not a plain `nn.Linear`, e.g. a LoRA-wrapped head; under
  FSDP2 and ZeRO-3 the trainer hands the direct route the heads' weights whole, gathered once per step,
  hf_distill.kd_paths.engine_heads; docs/guides/engines.md): the engines gather parameters and reduce
  gradients inside the head module's own call, so the head is called as a
  module, a chunk of tokens at a time inside a checkpoint, with its linear layers and matrix products (a custom
  or quantised head's `h @ W.T`) computed by :func:`mm_f32` (a `TorchFunctionMode` for the duration of the call;
  a head whose logits come out rounded anyway is named in a warning). The loss math is the dense one of
  :mod:`hf_distill.losses`. Weight gradients then accumulate over token chunks in the engine's gradient dtype.

Both give the same loss and gradients (tested: 1e-6 in float32, and both within the float64 bound in bf16).

Where the pieces live (a one-way import graph: chunked -> sparse_head -> kd_head -> head_common): this module is the
public entry point and re-exports :class:`LogitsHead`, :class:`KDSpec` and :func:`dense_kd`;
:mod:`.head_common` holds what both heads share (float32-output GEMMs, those objects, the counted rows, the module
route's chunks, the route's choice and the means); :mod:`.kd_head` the dense head's autograd function and the token
and vocabulary walks both autograd functions run; :mod:`.sparse_head` what a top-k + tail teacher changes.

Logits are rebuilt from the last hidden state by the model's output embedding plus the post-processing some
families apply (`final_logit_softcapping`: Gemma-2/3; `logit_scale`: Cohere; `logits_scaling`: Granite);
:func:`check_logits_fn` verifies the rebuild against the model's own logits, so an unknown post-processing is
refused rather than distilled wrongly.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from ..features.taps import unwrap
from . import sparse_head
from .fused_grads import sum_coefficients
from .head_common import (  # noqa: F401 - LogitsHead, KDSpec, dense_kd, ...: re-exported (the public module)
    DIVERGENCES,
    KDSpec,
    LogitsHead,
    addmm_f32,
    counted_rows,
    dense_kd,
    float32_logits,
    head_means,
    mm_f32,
    module_sums,
    vocab_size,
)
from .kd_head import (  # noqa: F401 - re-exported: `chunked.row_gradient`, `chunked._fused`, ... (tests, benchmarks)
    _fused,
    _KDHead,
    _LinearF32,
    _row_stats,
    row_gradient,
)

NO_LOGITS = "logits_to_keep"

# The public names: the loss head's objects (defined in head_common, below both heads) are this module's API too.
__all__ = ["KDSpec", "LogitsHead", "check_logits_fn", "chunked_kd_and_ce", "default_chunk", "dense_kd",
           "hidden_only_kwargs", "last_hidden", "logits_fn", "supports_hidden_only"]


# ---------------------------------------------------------------------------------------------- the LM heads


def supports_hidden_only(model: nn.Module) -> bool:
    """True when the model's forward can skip its LM head (`logits_to_keep`), as transformers' causal LMs do."""
    inner = unwrap(model)
    return NO_LOGITS in inspect.signature(inner.forward).parameters


def logits_fn(model: nn.Module) -> LogitsHead:
    """The model's LM head and post-processing, as a :class:`LogitsHead` (callable: hidden states -> logits)."""
    inner = unwrap(model)
    head = inner.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(inner).__name__} has no output embeddings (LM head) to compute logits in chunks.")
    config = inner.config
    scale = getattr(inner, "logit_scale", None)
    scale = float(scale) if isinstance(scale, int | float) else 1.0
    divide = getattr(config, "logits_scaling", None)
    if divide is not None:
        scale = scale / float(divide)
    cap = getattr(config, "final_logit_softcapping", None)
    return LogitsHead(head, scale, float(cap) if cap is not None else None)


@torch.no_grad()
def check_logits_fn(model: nn.Module, vocab_size: int, role: str, head: LogitsHead | None = None) -> None:
    """Compare `logits_fn` (or `head`: the same head with its weight gathered, under a sharding engine) with the
    model's own logits on two tokens; refuse a model whose logits differ."""
    inner = unwrap(model)
    device = next(inner.parameters()).device
    ids = torch.tensor([[1, min(2, vocab_size - 1)]], device=device)
    was_training = inner.training
    inner.eval()
    try:
        out = inner(input_ids=ids, output_hidden_states=True)
        rebuilt = (head or logits_fn(model))(out.hidden_states[-1])
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


# ---------------------------------------------------------------------------------------------- the module route


def _dense_kd_sum(teacher, from_hidden: bool, kd: KDSpec, vocab: int | None, z: torch.Tensor, kd_part,
                  t_part) -> torch.Tensor:
    """The KD sum of one module-route chunk (:func:`.head_common.module_sums`) against a dense teacher: its head's
    float32 logits (from its hidden states, by its module call) or its cached logits."""
    with torch.no_grad():
        tz = teacher.float32(t_part) if from_hidden else t_part.float()
        tz = tz[:, :vocab] if vocab is not None else tz
    zk = z[:, :vocab] if vocab is not None else z
    every = bool(kd_part.all())  # the usual case: no (n, V) copies of both sides
    return kd(zk if every else zk[kd_part], tz if every else tz[kd_part]) * kd_part.sum()


# ---------------------------------------------------------------------------------------------- entry point


#: `kd_head_mode="fused"`'s default chunk as a multiple of the default mode's (:func:`default_chunk`): 4 is 1,024
#: tokens at V = 128,256. Each fused chunk reads and writes the float32 `(V, H)` weight-gradient accumulator once, so
#: longer chunks move less memory, and hold more logits (V x 10 bytes per token: float32 student and teacher logits,
#: the bf16 gradient; docs/guides/causal-lm.md gives the memory per chunk). 8 (2,048 tokens at V = 128,256,
#: 1.2 GiB more) is the candidate `benchmarks/head_modes_gpu.py --fused-chunks` measures (issue #41 item 6): the
#: default changes only after a GPU run shows it faster (gpu_checks.sh, step `head_fused_sweep`).
FUSED_CHUNK_FACTOR = 4


def default_chunk(vocab: int, mode: str = "recompute") -> int:
    """Tokens per chunk when `kd_chunk_size` is unset: about 2^25 logits (128 MiB of float32) per chunk, between
    64 and 4,096 tokens, a multiple of 64 (256 at V = 128,256: Liger-Kernel's chunk at that shape is the same).
    `mode="fused"` (`kd_head_mode`): :data:`FUSED_CHUNK_FACTOR` times that (1,024 tokens at V = 128,256, at most
    16,384): each chunk reads and writes the float32 weight-gradient buffer once (:mod:`.fused_grads`), so fewer
    chunks move less memory."""
    factor = FUSED_CHUNK_FACTOR if mode == "fused" else 1
    return int(min(4096 * factor, max(64, factor * (1 << 25) // max(vocab, 1) // 64 * 64)))


def chunked_kd_and_ce(
    s_hidden: torch.Tensor,
    student_head: LogitsHead,
    teacher: torch.Tensor | LogitsHead | None,
    t_hidden: torch.Tensor | None,
    kd_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    kd: KDSpec | None,
    chunk_size: int,
    vocab: int | None = None,
    route: str = "auto",
    fused: tuple[float, float] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Next-token KD (mean over `kd_mask` positions) and the student's cross-entropy (mean over `labels != -100`).

    `s_hidden`/`t_hidden` are `(B, T, H)` last hidden states; position t is compared with token t+1, so `kd_mask`
    and `labels` are the shifted `(B, T-1)` views. `teacher` is the teacher's :class:`LogitsHead` (with
    `t_hidden`) or cached dense logits `(B, T-1, V)`. `kd` is a :func:`dense_kd` objective. `vocab` cuts the KD
    to the ids both models share (padded vocabularies of one family); the CE is always over the student's whole
    vocabulary, as the model's own loss. `route`: `"direct"`, `"module"` (engines: see the module docstring) or
    `"auto"` (direct where both heads are plain linears). `fused`: the weights the caller will put on the two means,
    `(kd weight, ce weight)`: the gradients are then formed in the forward (four LM-head GEMMs instead of six; a float32
    copy of the student head's weight gradient: :mod:`.fused_grads`), direct route only. Returns `(kd, ce)`, each None
    when not asked for; both are ordinary differentiable tensors (any weights: others than `fused` are exact too).
    """
    if kd is not None and not isinstance(kd, KDSpec):
        raise TypeError("kd must be an hf_distill.losses.chunked.dense_kd(...) objective")
    if kd is not None and kd.kind == "mse":
        raise ValueError("kd_loss='mse' compares raw logits, which the chunked loss head does not keep: compute it "
                         "from whole logits (DistillationTrainer does, for kd_loss='mse', unless kd_chunk_size is set)")
    if isinstance(teacher, tuple | list):  # a (log_probs, indices, log_tail) signal: losses.sparse_head
        return sparse_head.sparse_kd_and_ce(s_hidden, student_head, teacher, kd_mask, labels, kd, chunk_size, vocab,
                                            route, fused)
    counted = counted_rows(s_hidden, kd_mask, labels, kd)
    from_hidden = t_hidden is not None
    t_head = teacher if from_hidden else None
    t_source = None
    if kd is not None:
        t_source = counted.take(t_hidden[:, :-1] if from_hidden else teacher)
    if kd is not None and vocab is None:
        sizes = {vocab_size(student_head), vocab_size(t_head) if from_hidden else teacher.shape[-1]}
        if len(sizes) > 1:
            raise ValueError(f"The student's and teacher's vocabularies differ in size ({sorted(sizes)}): pass "
                             "vocab=<the number of ids they share> (padded vocabularies of one tokenizer).")

    direct_ok = student_head.direct and (t_head is None or t_head.direct)
    coeffs = sum_coefficients(fused, counted.n_kd, counted.n_ce, route, direct_ok)

    def direct():
        v = vocab if vocab is not None else student_head.module.weight.shape[0]
        w_t = t_head.module.weight if t_head is not None else None
        b_t = t_head.module.bias if t_head is not None else None
        return _KDHead.apply(
            counted.hidden, student_head.module.weight, student_head.module.bias, t_source if from_hidden else None,
            w_t, b_t, None if (from_hidden or kd is None) else t_source, counted.targets, counted.is_kd,
            counted.is_ce, student_head, t_head, kd, v, chunk_size, coeffs)

    def module():
        kd_sum = functools.partial(_dense_kd_sum, teacher, from_hidden, kd, vocab) if kd is not None else None
        return module_sums(student_head, kd_sum, counted, (t_source,), chunk_size)

    return head_means(s_hidden, counted, kd, labels, route, direct_ok, "plain nn.Linear LM heads", direct, module)
