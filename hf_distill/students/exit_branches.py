"""The exit branches of early exit (`hf_distill.students.early_exit`): FastBERT's classifier and DeeBERT's off-ramp,
with their analytic FLOPs.

Both read the hidden states a block returns and give class logits. In eval mode with gradients off (adaptive
inference, evaluation) each computes the same function as its training form with fewer ops (`infer` on
`inference_weights()`): at batch 1 a branch is a dozen small ops, and early exit must win back every branch it
evaluates. Only public torch APIs are used: the folded weights of FastBERT's branch are cached until a parameter
is replaced or converted (its memory moves), loaded (`load_state_dict`), stepped by any optimizer (a
process-wide optimizer step hook, registered only while a fold is cached: `hf_distill.base.optimizer_steps`), or the
branch changes mode; see `ExitBranch`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..base.optimizer_steps import StepWatch

BRANCHES = {"fastbert": "FastBERT's branch, attention over every token",
            "deebert": "DeeBERT's off-ramp, a pooler on the first token"}


def check_branch(kind: str) -> None:
    if kind not in BRANCHES:
        choices = "; ".join(f"{k!r}: {v}" for k, v in BRANCHES.items())
        raise ValueError(f"branch must be one of {choices}. Got {kind!r}.")


def _drop_fold(module: ExitBranch, _incompatible_keys: Any) -> None:
    """`load_state_dict` copies into the parameters in place: the fold of the old values is stale."""
    module.drop_fold()


class ExitBranch(nn.Module):
    """FastBERT's student classifier: narrow projection, 2-head self-attention, first-token pooling, 2 linears.

    Only the first token's attention output is pooled, so only its query is computed (same result as full
    self-attention followed by `[:, 0]`, at a fraction of the cost). The attention's parameters are an
    `nn.MultiheadAttention`'s (same state-dict keys), but the forward is written out: at batch 1 a branch is
    a dozen small ops, and `nn.MultiheadAttention.forward`'s own checks cost more than its arithmetic.

    Inference (eval mode, no grad) computes the same function in a folded form (`infer`): with one query,
    everything between the tanh of the projection and the tanh of the pooler is linear, so the query, key,
    value, output and pooler matrices collapse into two products per head. That halves a branch's own time at
    batch 1 (timed alone), where early exit must win back every branch it evaluates.
    The folded weights are cached and refolded when a parameter is replaced or converted (`.to()`, `.half()`,
    `load_state_dict(assign=True)`, a new `nn.Parameter`), after `load_state_dict`, after any optimizer's step,
    and on `train()` / `eval()`. An in-place edit by hand (`p.data.copy_(...)`, `p.add_(...)` under no_grad)
    is not seen: call `drop_fold()`, `train()` or `eval()` after one.
    """

    def __init__(self, hidden_size: int, num_labels: int, width: int = 128, heads: int = 2) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"branch_width ({width}) must be divisible by branch_heads ({heads}).")
        self.down = nn.Linear(hidden_size, width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.pool = nn.Linear(width, width)
        self.out = nn.Linear(width, num_labels)
        self.heads = heads  # a plain attribute: read on every inference call
        # (views of `parameters()` when folded, their addresses, optimizer steps then, the weights `infer` takes)
        self._folded: tuple[tuple[torch.Tensor, ...], list[int], StepWatch, tuple[torch.Tensor, ...]] | None = None
        self.register_load_state_dict_post_hook(_drop_fold)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.training or torch.is_grad_enabled():
            return self._reference(hidden, attention_mask)
        return self.infer(self.inference_weights(), hidden, attention_mask)

    def train(self, mode: bool = True) -> ExitBranch:
        self._folded = None  # a documented way to drop the folded weights (see the class docstring)
        return super().train(mode)

    def drop_fold(self) -> None:
        """Forget the folded weights (after editing a parameter in place by hand): the next call folds again."""
        self._folded = None

    @property
    def _fold(self) -> tuple[Any, ...] | None:
        """The cached fold if it still matches the parameters (what `inference_weights` would reuse), else None."""
        fold = self._folded
        return fold if fold is not None and _current(fold, self) else None

    def _params(self) -> tuple[torch.Tensor, ...]:
        attn = self.attention
        return (self.down.weight, self.down.bias, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight,
                attn.out_proj.bias, self.pool.weight, self.pool.bias, self.out.weight, self.out.bias)

    def _reference(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """FastBERT's parameterisation, differentiable: what self-distillation trains."""
        x = torch.tanh(self.down(hidden))
        attn = self.attention
        b, t, w = x.shape
        h = attn.num_heads
        weight, bias = attn.in_proj_weight, attn.in_proj_bias
        q = F.linear(x[:, :1], weight[:w], bias[:w]).view(b, 1, h, w // h).transpose(1, 2)
        k, v = F.linear(x, weight[w:], bias[w:]).view(b, t, 2, h, w // h).permute(2, 0, 3, 1, 4)
        keep = None if attention_mask is None else (attention_mask != 0)[:, None, None, :]
        dropout = attn.dropout if self.training else 0.0
        pooled = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout).reshape(b, w)
        return self.out(torch.tanh(self.pool(attn.out_proj(pooled))))

    def infer(self, weights: tuple[torch.Tensor, ...], hidden: torch.Tensor,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`_reference` rewritten for one query, on `inference_weights()`. With x the projected tokens and x0 the
        first one, per head h: score_j = x0' (Wq_h' Wk_h) x_j / sqrt(d) + terms constant in j (softmax drops
        them), and the pooled pre-activation = Wp Wo concat_h(Wv_h sum_j a_hj x_j + bv_h) + Wp bo + bp, since the
        a_hj sum to 1.
        A call is a dozen small ops, and right after a block each costs about twice what it costs warm (a
        branch of the SST-2 MiniLM-L6 benchmark: ~150 us there, ~75 us run again at once; 2 CPU cores), so
        batch 1 without padding, adaptive inference's latency case, gets 2-D products and no masking ops."""
        down_w, down_b, query, query_bias, pool, pool_bias, out_w, out_b = weights
        h = self.heads
        if hidden.shape[0] == 1 and attention_mask is None:  # one row, no padding: 2-D matrix products
            x = F.linear(hidden[0], down_w, down_b).tanh_()
            scores = F.linear(torch.addmm(query_bias, x[:1], query).view(h, -1), x)  # q_h . x_j, no transpose op
            context = torch.mm(scores.softmax(-1), x).view(1, -1)
        else:
            x = F.linear(hidden, down_w, down_b).tanh_()
            b, _, w = x.shape
            scores = torch.bmm(torch.addmm(query_bias, x[:, 0], query).view(b, h, w), x.transpose(1, 2))
            if attention_mask is not None:
                scores = scores.masked_fill(attention_mask[:, None, :] == 0, torch.finfo(scores.dtype).min)
            context = torch.bmm(scores.softmax(-1), x).view(b, h * w)
        return F.linear(torch.addmm(pool_bias, context, pool).tanh_(), out_w, out_b)

    def inference_weights(self) -> tuple[torch.Tensor, ...]:
        """What `infer` takes: (down weight, down bias, query, query bias, pool, pool bias, out weight, out bias),
        the four middle ones folded and cached (the class docstring says when the cache is dropped). The check
        is the parameters' addresses (`data_ptr`: a replaced or converted parameter has new memory, and the fold
        keeps views of the old, so its address cannot be reused meanwhile) and one comparison of optimizer step
        counts: adaptive inference runs it once per branch reached per batch, right after a block, where every
        Python line costs several times its warm price. Weights made under inference_mode are folded on every
        call and not kept, as before."""
        fold = self._folded
        if fold is not None and _current(fold, self):
            return fold[3]
        params = self._params()
        attn = self.attention
        w, h = attn.embed_dim, attn.num_heads
        d = w // h
        wide = torch.float32 if params[2].device.type == "mps" else torch.float64  # MPS has no float64
        views = tuple(p.detach() for p in params)
        in_w, in_b, out_w, out_b, pool_w, pool_b = (p.to(wide) for p in views[2:8])
        wq, wk, wv = (in_w[i * w : (i + 1) * w].view(h, d, w) for i in range(3))  # (head, head dim, width)
        # query[q, (h, k)]: x0 @ query gives, per head, the vector whose dot with x_j is x0' Wq_h' Wk_h x_j
        query = torch.einsum("hdk,hdq->qhk", wk, wq).reshape(w, h * w) * d**-0.5
        query_bias = torch.einsum("hdk,hd->hk", wk, in_b[:w].view(h, d)).reshape(h * w) * d**-0.5
        # pool[(h, k), p]: the attention-weighted tokens of head h, through Wv_h, the out-projection and the pooler
        pool = torch.einsum("po,ohd,hdk->hkp", pool_w, out_w.view(w, h, d), wv).reshape(h * w, w)
        pool_bias = pool_w @ (out_w @ in_b[2 * w :] + out_b) + pool_b
        folded = tuple(t.to(params[2].dtype).contiguous() for t in (query, query_bias, pool, pool_bias))
        weights = views[:2] + folded + views[8:]
        if not params[8].is_inference():
            held = tuple(p.detach() for p in self.parameters())
            self._folded = (held, [p.data_ptr() for p in held], StepWatch(), weights)
        return weights

    def flops(self, tokens: int) -> int:
        """Forward FLOPs for one row of `tokens` tokens as adaptive inference runs it (`infer`)."""
        hidden, width, heads = self.down.in_features, self.down.out_features, self.attention.num_heads
        return 2 * (tokens * hidden * width + 2 * heads * width * width + 2 * heads * tokens * width
                    + width * self.out.out_features)


def _current(fold: tuple[Any, ...], branch: nn.Module) -> bool:
    """Whether a fold still stands for `branch`'s parameters: no optimizer step since, and every parameter still
    at the address it was folded from (the fold holds views of that memory, so no other tensor can get it
    meanwhile; `parameters()` costs less than reading the ten by name, ~11 us against ~16)."""
    return not fold[2].stepped() and [p.data_ptr() for p in branch.parameters()] == fold[1]


class PoolerBranch(nn.Module):
    """DeeBERT's off-ramp: a BERT pooler on the first token (Linear(H->H) + tanh), then Linear(H->labels)."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, num_labels)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.training or torch.is_grad_enabled():
            return self.out(torch.tanh(self.dense(hidden[:, 0])))  # the first token is never padding
        return self.infer(self.inference_weights(), hidden)  # the same ops, without two module calls

    def inference_weights(self) -> tuple[torch.Tensor, ...]:
        return (self.dense.weight.detach(), self.dense.bias.detach(), self.out.weight.detach(),
                self.out.bias.detach())

    def infer(self, weights: tuple[torch.Tensor, ...], hidden: torch.Tensor,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` without module calls, on `inference_weights()` (see `ExitBranch.infer`)."""
        dense_w, dense_b, out_w, out_b = weights
        return F.linear(F.linear(hidden[:, 0], dense_w, dense_b).tanh_(), out_w, out_b)

    def flops(self, tokens: int) -> int:
        return 2 * (self.dense.in_features * self.dense.out_features + self.out.in_features * self.out.out_features)


def block_flops(tokens: int, hidden: int, intermediate: int) -> int:
    """Analytic forward FLOPs of one encoder block on one row (2 per multiply-add): Q/K/V/O, FFN, attention."""
    return tokens * (2 * 4 * hidden * hidden + 2 * 2 * hidden * intermediate) + 2 * 2 * tokens * tokens * hidden


def flops_per_row(num_layers_run: int, branches_run: int, tokens: int, hidden: int, intermediate: int,
                  branch: nn.Module) -> int:
    """Forward FLOPs of one row that ran `num_layers_run` blocks and `branches_run` branches like `branch`."""
    return num_layers_run * block_flops(tokens, hidden, intermediate) + branches_run * branch.flops(tokens)
