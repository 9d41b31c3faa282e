"""Early exit (FastBERT): a small classifier ("branch") after every block of a fine-tuned classifier.

FastBERT (Liu et al., ACL 2020, https://arxiv.org/abs/2004.02178; code: github.com/autoliuweijie/FastBERT):

- A branch is Linear(H->128) + tanh, 2-head self-attention at width 128 under the padding mask, first-token
  pooling, Linear(128->128) + tanh, Linear(128->num_labels) (the reference's `FastBERTClassifier`). There is one
  per block except the last, where the fine-tuned head stays: it is the teacher of the branches.
- Self-distillation: backbone and final head frozen, loss = sum_i KL(final || branch_i) (batchmean, no
  temperature, as in the reference), labels not needed; about 10x the fine-tuning learning rate.
- Inference: a sample leaves at the first branch whose uncertainty H(p) / log(num_labels) (in [0, 1]) is below
  `speed`. The paper reports speed 0.5 on Book review 86.88 -> 86.64 at 4.2x fewer FLOPs.
- `patience` is PABEE's rule (Zhou et al., NeurIPS 2020): leave once the argmax stayed the same for `patience`
  consecutive branches.
- `branch="deebert"` swaps FastBERT's branch for DeeBERT's off-ramp (Xin et al., ACL 2020,
  https://arxiv.org/abs/2004.12993): a BERT pooler (Linear(H->H) + tanh on the first token) and Linear(H->labels).
  It reads one token instead of all of them, so it costs a fraction of FastBERT's branch; it is trained here by
  the same self-distillation (DeeBERT trains its off-ramps with labels). DeeBERT's raw-entropy threshold S is
  `speed * log(num_labels)`.

Training goes through `DistillationTrainer` with no teacher model: `EarlyExitModel.forward` runs the backbone
once, takes the final head's logits as the teacher and returns one term per branch in `distill_losses`
(`exit_1`, ...), which the trainer logs as `loss_exit_1`, ... . Adaptive inference wraps (or hooks) every block: the
rows that left are sliced out of the hidden states (and of every per-row tensor the block receives), so later blocks
really run on fewer rows; the forward stops once every row has left.
"""

from __future__ import annotations

import json
import math
import numbers
import operator
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _global_hooks  # register_module_forward_hook's registries
from transformers.utils import ModelOutput

from ..features.families import REGISTER_HINT
from ..features.heads import HeadKind, head_kind
from ..features.taps import FeatureTaps, TapRequest, model_info, unwrap

BRANCH_FILE = "early_exit.safetensors"
BRANCH_CONFIG_FILE = "early_exit_config.json"
PLOT_FILE = "early_exit.png"
# Persisted in saved folders (the module's path before 0.2): never renamed. FORMATS below has each branch's.
FORMAT = "hf_distill.early_exit/fastbert-v1"  # a FastBERT-branch folder's
HOST_ROWS_MAX = 256  # outputs up to this many logits get their exit rule reduced on the host (row_uncertainties)


class ExitBranch(nn.Module):
    """FastBERT's student classifier: narrow projection, 2-head self-attention, first-token pooling, 2 linears.

    Only the first token's attention output is pooled, so only its query is computed (same result as full
    self-attention followed by `[:, 0]`, at a fraction of the cost). The attention's parameters are an
    `nn.MultiheadAttention`'s (same state-dict keys), but the forward is written out: at batch 1 a branch is
    a dozen small ops, and `nn.MultiheadAttention.forward`'s own checks cost more than its arithmetic.

    Inference (eval mode, no grad) computes the same function in a folded form (`infer`): with one query,
    everything between the tanh of the projection and the tanh of the pooler is linear, so the query, key,
    value, output and pooler matrices collapse into two products per head, cached until a weight changes.
    That halves a branch's own time at batch 1 (timed alone), where early exit must win back every branch it
    evaluates.
    Weights edited or replaced through `.data` bypass the versions and identities the cache checks: call
    `train()` or `eval()` after such an edit (either drops the folded weights).
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
        self._fold: tuple[Any, ...] | None = None

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.training or torch.is_grad_enabled():
            return self._reference(hidden, attention_mask)
        return self.infer(self.inference_weights(), hidden, attention_mask)

    def train(self, mode: bool = True) -> ExitBranch:
        self._fold = None  # a documented way to drop the folded weights (see the class docstring)
        return super().train(mode)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> ExitBranch:
        self._fold = None  # a conversion may swap `param.data` in place: same objects, same versions
        return super()._apply(fn, *args, **kwargs)

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
        the four middle ones folded and cached. The cache is reused while every parameter is the object it held
        when folded, at the version it had (an optimizer step or `load_state_dict` bumps a version, a replaced
        parameter is another object; `.data` edits bypass both: see the class docstring). `.to()`, `.half()`,
        ... drop it (`_apply`). Adaptive inference calls this once per branch per batch, right after the previous
        row's forward has pushed everything out of the CPU caches, where a Python line costs up to ten times its
        warm price (SST-2 MiniLM-L6 benchmark, 2 CPU cores: the checks of five branches took ~115 us there, ~16
        warm; reading the 50 `_version`s alone ~45 us), so the parameters are read from the modules' own dicts
        (`nn.Module.__getattr__` costs more) and compared by identity and version only."""
        mods = self._modules
        down, pool, out = (mods[k]._parameters for k in ("down", "pool", "out"))
        attn = mods["attention"]
        inner, out_proj = attn._parameters, attn._modules["out_proj"]._parameters
        params = (down["weight"], down["bias"], inner["in_proj_weight"], inner["in_proj_bias"], out_proj["weight"],
                  out_proj["bias"], pool["weight"], pool["bias"], out["weight"], out["bias"])
        try:
            key = [p._version for p in params]
        except RuntimeError:  # inference-mode tensors have no version counter: fold on every call
            key = None
        fold = self._fold
        if key is not None and fold is not None and fold[1] == key and all(map(operator.is_, params, fold[0])):
            return fold[2]
        w, h = attn.embed_dim, attn.num_heads
        d = w // h
        wide = torch.float32 if params[2].device.type == "mps" else torch.float64  # MPS has no float64
        in_w, in_b, out_w, out_b, pool_w, pool_b = (p.detach().to(wide) for p in params[2:8])
        wq, wk, wv = (in_w[i * w : (i + 1) * w].view(h, d, w) for i in range(3))  # (head, head dim, width)
        # query[q, (h, k)]: x0 @ query gives, per head, the vector whose dot with x_j is x0' Wq_h' Wk_h x_j
        query = torch.einsum("hdk,hdq->qhk", wk, wq).reshape(w, h * w) * d**-0.5
        query_bias = torch.einsum("hdk,hd->hk", wk, in_b[:w].view(h, d)).reshape(h * w) * d**-0.5
        # pool[(h, k), p]: the attention-weighted tokens of head h, through Wv_h, the out-projection and the pooler
        pool = torch.einsum("po,ohd,hdk->hkp", pool_w, out_w.view(w, h, d), wv).reshape(h * w, w)
        pool_bias = pool_w @ (out_w @ in_b[2 * w :] + out_b) + pool_b
        folded = tuple(t.to(params[2].dtype).contiguous() for t in (query, query_bias, pool, pool_bias))
        weights = tuple(p.detach() for p in params[:2]) + folded + tuple(p.detach() for p in params[8:])
        if key is not None:
            self._fold = (params, key, weights)
        return weights

    def flops(self, tokens: int) -> int:
        """Forward FLOPs for one row of `tokens` tokens as adaptive inference runs it (`infer`)."""
        hidden, width, heads = self.down.in_features, self.down.out_features, self.attention.num_heads
        return 2 * (tokens * hidden * width + 2 * heads * width * width + 2 * heads * tokens * width
                    + width * self.out.out_features)


class PoolerBranch(nn.Module):
    """DeeBERT's off-ramp: a BERT pooler on the first token (Linear(H->H) + tanh), then Linear(H->labels)."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, num_labels)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.out(torch.tanh(self.dense(hidden[:, 0])))  # the first token is never padding

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


BRANCHES = {"fastbert": "FastBERT's branch, attention over every token",
            "deebert": "DeeBERT's off-ramp, a pooler on the first token"}
FORMATS = {"fastbert": FORMAT, "deebert": "hf_distill.early_exit/deebert-v1"}


def check_branch(kind: str) -> None:
    if kind not in BRANCHES:
        choices = "; ".join(f"{k!r}: {v}" for k, v in BRANCHES.items())
        raise ValueError(f"branch must be one of {choices}. Got {kind!r}.")


@dataclass
class EarlyExitOutput(ModelOutput):
    """`logits`: the final head's; `exit_logits`: one tensor per branch; `distill_losses`: KL per branch."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    exit_logits: tuple[torch.Tensor, ...] | None = None
    distill_losses: dict[str, torch.Tensor] | None = None


@dataclass
class ExitResult:
    """Adaptive inference: final logits of each row (from the branch it left at) and its exit layer (1-based)."""

    logits: torch.Tensor
    exit_layer: torch.Tensor
    branch_calls: int = 0  # branches evaluated, summed over rows (for FLOPs accounting)


class _AllExited(Exception):
    pass


_RUNNING: set[int] = set()  # id() of the block lists exit_forward is running on (one call at a time each)


def uncertainty(logits: torch.Tensor) -> torch.Tensor:
    """FastBERT's normalised entropy H(p) / log(num_labels), in [0, 1]."""
    return torch.special.entr(logits.float().softmax(-1)).sum(-1) / math.log(logits.shape[-1])


def row_uncertainties(logits: torch.Tensor) -> list[float]:
    """`uncertainty` of each row as Python floats, what the exit rule compares with `speed`. A small output
    (batch 1) is reduced on the host from one copy: right after a block, each small tensor op cost ~10-15 us on
    2 CPU cores (timed right after a MiniLM block), and the five of `uncertainty` more than the
    arithmetic."""
    if logits.numel() > HOST_ROWS_MAX:
        return uncertainty(logits).tolist()
    rows = logits.tolist()  # Python floats from any floating dtype
    if not math.isfinite(sum(map(sum, rows))):  # a NaN or inf somewhere (or finite values summing past fp64)
        return uncertainty(logits).tolist()  # NaN stays NaN (the row never leaves), as on the device
    out = []
    for row in rows:
        top = max(row)
        weights = [math.exp(z - top) for z in row]
        total = sum(weights)
        # H = -sum p log p with log p = (z - top) - log(total): no log of a probability that rounds to 0
        entropy = math.log(total) - sum(w * (z - top) for w, z in zip(weights, row)) / total
        out.append(max(entropy, 0.0) / math.log(len(row)))
    return out


def check_first_token(attention_mask: torch.Tensor | None) -> None:
    """Both branch kinds read the first token of every row (FastBERT's query, DeeBERT's pooler)."""
    if attention_mask is not None and not bool(attention_mask[:, 0].all()):
        raise ValueError("attention_mask masks the first token of some rows (left padding?): early-exit branches "
                         "pool the first token. Pad on the right (tokenizer.padding_side = 'right').")


def check_rule(speed: float | None, patience: int | None) -> None:
    if speed is not None and patience is not None:
        raise ValueError("Give either speed (FastBERT) or patience (PABEE), not both.")
    if speed is not None and (type(speed) is not float or not 0.0 <= speed <= 1.0):  # a float in range: 2 checks
        _check_speed(speed)
    if patience is not None and (isinstance(patience, bool) or not isinstance(patience, int) or patience < 1):
        raise ValueError(f"patience must be an integer >= 1 (branches with an unchanged argmax), got {patience}.")


def _check_speed(speed: Any) -> None:
    """`speed` is a real number in [0, 1]; anything else is refused with the fix. A bool is an int to Python
    (True would mean 1.0, every row leaving at the first branch); a string compares with nothing."""
    rule = "speed must be in [0, 1] (normalised entropy threshold; 0 = never exit early)"
    if isinstance(speed, bool):
        raise ValueError(f"{rule}, a real number, got the bool {speed}: pass a float such as speed=0.5.")
    if isinstance(speed, str):
        raise ValueError(f"{rule}, a real number, got the string {speed!r}: convert it first, "
                         f"speed=float({speed!r}).")
    if isinstance(speed, Mapping):
        raise ValueError(f"{rule}, a real number, got a {type(speed).__name__} (the batch?): pass the inputs as "
                         "keywords, exit_forward(speed=0.5, **batch).")
    if torch.is_tensor(speed) or not isinstance(speed, numbers.Real):
        raise ValueError(f"{rule}, a real number, got {type(speed).__name__} {speed!r}"
                         + (": pass speed.item()." if torch.is_tensor(speed) else "."))
    if not 0.0 <= speed <= 1.0:  # NaN fails both comparisons
        raise ValueError(f"{rule}, got {speed!r}.")


def _input_tensor(inputs: dict[str, Any], where: str) -> torch.Tensor:
    """The `input_ids` (or `inputs_embeds`) tensor of a call, or a ValueError naming what is missing."""
    ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
    if ids is None:
        given = ", ".join(sorted(k for k, v in inputs.items() if v is not None)) or "none"
        raise ValueError(f"{where} needs input_ids (or inputs_embeds); the inputs given were: {given}. Pass the "
                         "tokenizer's output, e.g. **tokenizer(texts, padding=True, return_tensors='pt').")
    if not torch.is_tensor(ids):
        name = "input_ids" if "input_ids" in inputs else "inputs_embeds"
        raise ValueError(f"{where}: {name} must be a tensor, got {type(ids).__name__} (tokenize with "
                         "return_tensors='pt', or collate the rows).")
    return ids


def _runner(branch: nn.Module) -> Any:
    """What adaptive inference calls on (hidden states, attention mask) for `branch`. An `ExitBranch` or
    `PoolerBranch` in eval mode with no hooks of its own gets its weights read (and its fold checked) here, once
    per batch, and the step after each block calls `infer` on those weights (`ExitBranch.inference_weights` says
    what the check costs). Any other module (a subclass, a branch with hooks or in train mode, any branch while
    global module hooks are set, weights made under inference_mode, which cannot be cached and are folded only
    if a row reaches them) is called as the module it is."""
    if (type(branch) not in (ExitBranch, PoolerBranch) or branch.training or branch._forward_hooks
            or branch._forward_pre_hooks or _global_hooks._global_forward_hooks
            or _global_hooks._global_forward_pre_hooks or branch._modules["out"]._parameters["weight"].is_inference()):
        return branch
    return partial(branch.infer, branch.inference_weights())


class EarlyExitModel(nn.Module):
    """A fine-tuned sequence classifier of a registered encoder family with one exit branch per block."""

    def __init__(self, model: nn.Module, branch_width: int = 128, branch_heads: int = 2,
                 branch: str = "fastbert") -> None:
        super().__init__()
        check_branch(branch)
        if branch == "deebert" and (branch_width, branch_heads) != (128, 2):
            raise ValueError("branch_width and branch_heads shape FastBERT's branch; DeeBERT's off-ramp is as wide as "
                             "the model: leave them at their defaults with branch='deebert'.")
        inner = unwrap(model)
        info = model_info(inner)
        config = getattr(inner, "config", None)
        if info.family is None:
            raise ValueError(
                f"EarlyExitModel: model_type {info.model_type!r} is not a registered family, so its blocks "
                f"cannot be found. {REGISTER_HINT}"
            )
        if info.causal:
            raise ValueError(
                f"EarlyExitModel: {info.model_type!r} is a causal decoder; FastBERT branches pool the first token, "
                "which sees no other token under a causal mask. Use a bidirectional encoder classifier."
            )
        is_seq = head_kind(inner) is HeadKind.SEQUENCE_CLASSIFICATION
        num_labels = getattr(config, "num_labels", 0)
        if not is_seq or getattr(config, "problem_type", None) in ("regression", "multi_label_classification"):
            raise ValueError(
                f"EarlyExitModel needs a single-label sequence classifier (AutoModelForSequenceClassification), "
                f"got {type(inner).__name__} (problem_type={getattr(config, 'problem_type', None)!r}): the exit "
                "rule compares class distributions."
            )
        if num_labels < 2:
            raise ValueError(f"EarlyExitModel needs num_labels >= 2 (entropy over classes), got {num_labels}.")
        if info.num_layers < 2:
            raise ValueError(f"EarlyExitModel needs at least 2 blocks (a branch after every block but the last), "
                             f"the model has {info.num_layers}.")
        self.model = inner
        self.config = config
        self.num_exits = info.num_layers
        self.branch, self.branch_width, self.branch_heads = branch, branch_width, branch_heads
        self.branches = nn.ModuleList(
            ExitBranch(info.hidden_size, num_labels, branch_width, branch_heads) if branch == "fastbert"
            else PoolerBranch(info.hidden_size, num_labels) for _ in range(self.num_exits - 1)
        )
        self._blocks = inner.base_model.get_submodule(info.family.layers)
        if len({id(b) for b in self._blocks}) != len(self._blocks):
            raise ValueError("EarlyExitModel: the same module appears more than once among the model's blocks "
                             "(shared layers); early exit needs one module per block, each with its own branch.")
        self._taps = FeatureTaps(inner, TapRequest(hidden=set(range(1, self.num_exits))))
        self.freeze_backbone()

    # ------------------------------------------------------------------ training

    def freeze_backbone(self) -> None:
        """Backbone and final head are the frozen teacher; only the branches train (FastBERT stage 2)."""
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.model.eval()

    def train(self, mode: bool = True) -> EarlyExitModel:
        super().train(mode)
        self.model.eval()  # the frozen teacher never drops out: its distribution is the target
        return self

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> EarlyExitOutput:
        """One backbone forward; every branch is distilled from the final head. `labels` are not part of the
        loss: the parameter is there so that the Trainer keeps an evaluation set's labels for `compute_metrics`
        (`branch_metrics`). In training they are refused: the Trainer passes them for its task term, which
        would count this same loss a second time."""
        if labels is not None and self.training and torch.is_grad_enabled():
            raise ValueError(
                "EarlyExitModel trains its branches by self-distillation from the final head: labels are not used, "
                "and the Trainer passed the training rows' labels for a task term that would add this same loss "
                "again. Train on unlabeled rows: drop the label column (dataset.remove_columns('label')); an "
                "eval_dataset keeps its labels, for compute_metrics=branch_metrics(...)."
            )
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids,
                  **kwargs}
        kwargs = {k: v for k, v in kwargs.items() if v is not None and k != "labels"}
        _input_tensor(kwargs, "EarlyExitModel.forward")
        check_first_token(attention_mask)
        with torch.no_grad():
            out, feats = self._taps.run(self.model, kwargs)
        teacher = F.log_softmax(out.logits.float(), dim=-1)
        exit_logits, losses = [], {}
        for i, branch in enumerate(self.branches, start=1):
            logits = branch(feats.hidden[i], attention_mask)
            exit_logits.append(logits)
            losses[f"exit_{i}"] = F.kl_div(
                F.log_softmax(logits.float(), dim=-1), teacher, log_target=True, reduction="batchmean"
            )
        loss = sum(losses.values()) if losses else None
        return EarlyExitOutput(loss=loss, logits=out.logits, exit_logits=tuple(exit_logits), distill_losses=losses)

    # ------------------------------------------------------------------ adaptive inference

    @torch.no_grad()
    def exit_forward(
        self, speed: float | None = None, patience: int | None = None, **inputs: torch.Tensor
    ) -> ExitResult:
        """Batched adaptive inference: rows leave at the first branch the rule accepts and are dropped from the
        batch there. `speed=0` (or neither rule) runs every row to the final head, reproducing the model.
        Not thread-safe: one call at a time per backbone (a call from inside another, e.g. from a branch, is
        refused), and the backbone's own forward, called meanwhile from another thread, would run the exit step."""
        check_rule(speed, patience)
        inputs = {k: v for k, v in inputs.items() if k != "labels"}
        ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
        if not torch.is_tensor(ids):
            _input_tensor(inputs, "exit_forward")  # raises, naming what is missing
        n = ids.shape[0]
        if not (speed is not None and speed > 0 or patience is not None):  # no row can leave: no branch runs
            final = self.model(**inputs).logits
            return ExitResult(final, torch.full((n,), self.num_exits, dtype=torch.long, device=ids.device), 0)
        mask = inputs.get("attention_mask")
        if mask is not None and bool(mask.all()):
            mask = None  # no padding (always so at batch 1): the branches skip their masking ops
        check_first_token(mask)
        device = ids.device
        # active: the rows still running (None: all of them, until the first rows leave)
        state = {"active": None, "prev": None, "same": None, "calls": 0}
        branches = [_runner(b) for b in self.branches]
        result_logits: torch.Tensor | None = None
        exit_layer = torch.full((n,), self.num_exits, dtype=torch.long, device=device)

        def slice_rows(x: Any) -> Any:
            if torch.is_tensor(x) and x.dim() > 0 and x.shape[0] == n:
                return x.index_select(0, state["active"])
            return x

        def after(i: int, output: Any) -> Any:
            """Block i's output: branch i runs on the rows still active, the rows it lets leave are dropped."""
            nonlocal result_logits
            hidden = output[0] if isinstance(output, tuple) else output
            active = state["active"]
            rows_mask = mask if mask is None or active is None else mask.index_select(0, active)
            logits = branches[i](hidden, rows_mask)
            state["calls"] += hidden.shape[0]
            if patience is not None:
                pred = logits.argmax(-1)
                if state["prev"] is None:
                    same = torch.zeros_like(pred)
                else:
                    same = torch.where(pred == state["prev"], state["same"] + 1, torch.zeros_like(pred))
                leave = same >= patience  # PABEE: the argmax stayed the same for `patience` branches
                state["prev"], state["same"] = pred, same
                if not leave.any():
                    return output
            else:
                flags = [u < speed for u in row_uncertainties(logits)]
                if not any(flags):
                    return output
                if result_logits is None and all(flags):  # all rows leave at once (always so at batch 1)
                    result_logits = logits
                    exit_layer.fill_(i + 1)
                    raise _AllExited
                leave = torch.tensor(flags, device=device)
            if result_logits is None:
                result_logits = torch.zeros(n, logits.shape[-1], dtype=logits.dtype, device=device)
            if active is None:
                active = torch.arange(n, device=device)
            result_logits[active[leave]] = logits[leave]
            exit_layer[active[leave]] = i + 1
            keep = ~leave
            state["active"] = active[keep]
            if patience is not None:
                state["prev"], state["same"] = state["prev"][keep], state["same"][keep]
            if not keep.any():
                raise _AllExited
            if isinstance(output, tuple):
                return tuple(o[keep] if torch.is_tensor(o) and o.shape[0] == len(active) else o for o in output)
            return output[keep]

        def slice_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return tuple(slice_rows(a) for a in args), {k: slice_rows(v) for k, v in kwargs.items()}

        def wrap(i: int, forward: Any) -> Any:
            last = i >= len(branches)  # the last block has the final head after it, not a branch

            def run(*args: Any, **kwargs: Any) -> Any:
                if state["active"] is not None:  # rows have left: drop them from this block's per-row inputs too
                    args, kwargs = slice_inputs(args, kwargs)
                output = forward(*args, **kwargs)
                return output if last else after(i, output)

            return run

        def pre_hook(_m: nn.Module, args: tuple, kwargs: dict) -> Any:
            return None if state["active"] is None else slice_inputs(args, kwargs)

        def post_hook(i: int) -> Any:
            return lambda _m, _args, output: after(i, output)

        # Blocks without forward hooks get their forward wrapped for this call (an instance attribute, as
        # accelerate's hooks do): registering, calling and removing hooks cost ~190 us per row against ~50 for the
        # wrappers (batch 1, SST-2 MiniLM-L6 benchmark, 2 CPU cores), about what one branch costs. Where a block
        # has forward hooks (its own, transformers' output capture, global ones), the exit step is a forward hook
        # registered after them, so the branch sees their output, as in training, and they see every row.
        blocks = list(self._blocks)
        hooked = bool(_global_hooks._global_forward_hooks) or any(b._forward_hooks for b in blocks)
        key = id(self._blocks)
        if key in _RUNNING:
            raise RuntimeError("exit_forward is already running on this model's blocks (called again from a branch "
                               "or a hook, or from another thread): one call at a time per backbone.")
        _RUNNING.add(key)
        wrapped: list[tuple[nn.Module, Any]] = []  # (block, the instance-level forward it had, or None)
        handles = []
        try:
            for i, block in enumerate(blocks):
                if hooked:
                    handles.append(block.register_forward_pre_hook(pre_hook, with_kwargs=True))
                    if i < len(branches):
                        handles.append(block.register_forward_hook(post_hook(i)))
                else:
                    wrapped.append((block, block.__dict__.get("forward")))
                    block.forward = wrap(i, block.forward)
            try:
                final = self.model(**inputs).logits
                if result_logits is None:
                    return ExitResult(final, exit_layer, state["calls"])
                result_logits[state["active"]] = final.to(result_logits.dtype)
            except _AllExited:
                pass
        finally:
            for block, own in reversed(wrapped):
                if own is None:
                    block.__dict__.pop("forward", None)
                else:
                    block.forward = own
            for h in handles:
                h.remove()
            _RUNNING.discard(key)
        return ExitResult(result_logits, exit_layer, state["calls"])

    def predict(
        self,
        texts: str | Sequence[str],
        tokenizer: Any,
        speed: float | None = None,
        patience: int | None = None,
        batch_size: int = 32,
        max_length: int | None = None,
    ) -> list[dict[str, Any]]:
        """Pipeline-style output: per text {"label", "score", "exit_layer"}."""
        check_rule(speed, patience)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        texts = [texts] if isinstance(texts, str) else list(texts)
        device = next(self.model.parameters()).device
        id2label = getattr(self.config, "id2label", None) or {}
        out: list[dict[str, Any]] = []
        if self.training:
            self.eval()
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(texts[start : start + batch_size], padding=True, truncation=max_length is not None,
                            max_length=max_length, return_tensors="pt")
            res = self.exit_forward(speed=speed, patience=patience, **{k: v.to(device) for k, v in enc.items()})
            probs = res.logits.float().softmax(-1)
            score, label = probs.max(-1)
            for s, lab, layer in zip(score.tolist(), label.tolist(), res.exit_layer.tolist()):
                out.append({"label": id2label.get(lab, f"LABEL_{lab}"), "score": s, "exit_layer": layer})
        return out

    # ------------------------------------------------------------------ saving and publishing

    def save_pretrained(self, folder: str | os.PathLike, **kwargs: Any) -> None:
        """The backbone's own files (loadable alone with AutoModel...) plus the branches in their own file."""
        from safetensors.torch import save_file

        folder = Path(folder)
        self.model.save_pretrained(folder, **kwargs)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.branches.state_dict().items()},
                  folder / BRANCH_FILE, metadata={"format": FORMATS[self.branch]})
        spec: dict[str, Any] = {"format": FORMATS[self.branch], "num_exits": self.num_exits, "branch": self.branch,
                                "branch_width": self.branch_width, "branch_heads": self.branch_heads,
                                "num_labels": self.config.num_labels, "paper": "FastBERT (Liu et al., ACL 2020)"}
        if self.branch == "deebert":  # its off-ramp has no width or heads of its own
            spec.update(branch_width=None, branch_heads=None,
                        paper="DeeBERT off-ramps (Xin et al., ACL 2020) self-distilled as in FastBERT (Liu et al.)")
        (folder / BRANCH_CONFIG_FILE).write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, **kwargs: Any) -> EarlyExitModel:
        """Load a folder written by `save_pretrained` (local, or a Hub repo id)."""
        from safetensors.torch import load_file
        from transformers import AutoModelForSequenceClassification

        shaped = sorted({"branch", "branch_width", "branch_heads"} & set(kwargs))
        if shaped:
            raise ValueError(f"from_pretrained reads {', '.join(shaped)} from {BRANCH_CONFIG_FILE}; do not pass them.")
        folder = str(folder)
        if Path(folder).is_dir():
            cfg_path, weights_path = Path(folder) / BRANCH_CONFIG_FILE, Path(folder) / BRANCH_FILE
            if not cfg_path.is_file() or not weights_path.is_file():
                raise ValueError(
                    f"{folder} holds no {BRANCH_CONFIG_FILE}/{BRANCH_FILE}: it is not an early-exit model "
                    "(save one with EarlyExitModel.save_pretrained)."
                )
        else:
            cfg_path, weights_path = _download(folder, {k: kwargs[k] for k in ("revision", "token") if k in kwargs})
        spec = json.loads(cfg_path.read_text(encoding="utf-8"))
        branch = spec.get("branch", "fastbert")  # files written before `branch` existed: FastBERT's
        if spec.get("format") != FORMATS.get(branch):
            raise ValueError(f"{folder}: {BRANCH_CONFIG_FILE} has format {spec.get('format')!r} and branch "
                             f"{branch!r}; this version of hf_distill reads {FORMATS} (was the folder written by "
                             "another version? load it there and save it again)")
        model = AutoModelForSequenceClassification.from_pretrained(folder, **kwargs)
        shape = {}
        if branch == "fastbert":
            shape = {"branch_width": spec["branch_width"], "branch_heads": spec["branch_heads"]}
        wrapper = cls(model, branch=branch, **shape)
        if wrapper.num_exits != spec["num_exits"]:
            raise ValueError(f"{folder}: {BRANCH_CONFIG_FILE} says {spec['num_exits']} exits, the model has "
                             f"{wrapper.num_exits} blocks.")
        wrapper.branches.load_state_dict(load_file(str(weights_path)), strict=True)
        return wrapper

    def push_to_hub(
        self,
        repo_id: str,
        folder: str | os.PathLike,
        *,
        sweep: list[dict[str, Any]] | None = None,
        plot: str | os.PathLike | None = None,
        tokenizer: Any = None,
        **hub_kwargs: Any,
    ) -> Any:
        """Save into `folder`, write the model card (with the speed-accuracy table of `sweep` and `plot`), and
        publish through `hf_distill.publish.hub.push_student` (which uploads the branch files too)."""
        import shutil

        from ..publish.card import write_model_card
        from ..publish.hub import push_student

        folder = Path(folder)
        self.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        if plot is not None and Path(plot).resolve() != (folder / PLOT_FILE).resolve():
            shutil.copyfile(plot, folder / PLOT_FILE)
        early_exit = {"num_exits": self.num_exits, "branch": self.branch, "sweep": sweep or [],
                      "plot": PLOT_FILE if (folder / PLOT_FILE).is_file() else None}
        write_model_card(folder, model_name=repo_id, method=self.branch, early_exit=early_exit,
                         pipeline_tag="text-classification", architecture=type(self.model).__name__)
        return push_student(folder, repo_id, **hub_kwargs)


def _download(repo_id: str, hub: dict[str, Any]) -> tuple[Path, Path]:
    """The branch files of a Hub repo, or one clear error for a path that is no folder: a missing local folder,
    a file, or a Hub id that cannot be read (huggingface_hub's own errors never say the folder is missing)."""
    from huggingface_hub import hf_hub_download

    if Path(repo_id).exists():
        raise NotADirectoryError(f"{repo_id} is a file: give the folder EarlyExitModel.save_pretrained wrote.")
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", repo_id):
        raise FileNotFoundError(f"{repo_id}: no such folder (and not a Hub repo id, which reads `name` or "
                                "`org/name`): give the folder EarlyExitModel.save_pretrained wrote.")
    try:
        return tuple(Path(hf_hub_download(repo_id, name, **hub)) for name in (BRANCH_CONFIG_FILE, BRANCH_FILE))
    except (OSError, ValueError) as err:  # not found, offline, gated, invalid id: all OSError or ValueError
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise FileNotFoundError(f"{repo_id} is not a local folder, and as a Hub repo id its {BRANCH_CONFIG_FILE} "
                                f"could not be read: {first}") from err


def block_flops(tokens: int, hidden: int, intermediate: int) -> int:
    """Analytic forward FLOPs of one encoder block on one row (2 per multiply-add): Q/K/V/O, FFN, attention."""
    return tokens * (2 * 4 * hidden * hidden + 2 * 2 * hidden * intermediate) + 2 * 2 * tokens * tokens * hidden


def flops_per_row(num_layers_run: int, branches_run: int, tokens: int, hidden: int, intermediate: int,
                  branch: nn.Module) -> int:
    """Forward FLOPs of one row that ran `num_layers_run` blocks and `branches_run` branches like `branch`."""
    return num_layers_run * block_flops(tokens, hidden, intermediate) + branches_run * branch.flops(tokens)


def branch_metrics(speed: float | None = None, patience: int | None = None) -> Callable[[Any], dict[str, float]]:
    """`compute_metrics` for a Trainer that evaluates an `EarlyExitModel` on labelled rows (`eval_dataset`).

    Why: the final head is the frozen teacher, so the Trainer's own metrics say nothing about the branches. Per
    branch i: `exit_{i}_accuracy` (its argmax against the labels) and `exit_{i}_agreement` (against the final
    head's, what self-distillation trains); `final_accuracy` for the final head. With `speed` (or `patience`),
    also `accuracy` and `mean_exit_layer` of adaptive inference under that rule: each row leaves at the first
    branch whose normalised entropy is below `speed`, as `exit_forward` decides, computed here from the
    evaluation forward, which runs every branch on every row. The Trainer prefixes the keys with `eval_`."""
    check_rule(speed, patience)

    def compute(eval_pred: Any) -> dict[str, float]:
        import numpy as np

        predictions, labels = eval_pred.predictions, eval_pred.label_ids
        if not (isinstance(predictions, tuple | list) and len(predictions) == 2
                and isinstance(predictions[1], tuple | list) and len(predictions[1]) > 0):
            raise ValueError("branch_metrics reads an EarlyExitModel's predictions (logits, exit_logits); got "
                             f"{type(predictions).__name__}: evaluate an EarlyExitModel, with no "
                             "preprocess_logits_for_metrics.")
        final = np.asarray(predictions[0], dtype=np.float64)
        exits = [np.asarray(e, dtype=np.float64) for e in predictions[1]]
        labels = np.asarray(labels).reshape(-1)
        if final.ndim != 2 or len(labels) != len(final):
            raise ValueError(f"branch_metrics needs one class label per row: {len(labels)} labels for logits of "
                             f"shape {final.shape}.")
        final_pred = final.argmax(-1)
        out = {"final_accuracy": float((final_pred == labels).mean())}
        for i, logits in enumerate(exits, start=1):
            pred = logits.argmax(-1)
            out[f"exit_{i}_accuracy"] = float((pred == labels).mean())
            out[f"exit_{i}_agreement"] = float((pred == final_pred).mean())
        if speed is None and patience is None:
            return out
        stack = np.stack([*exits, final])  # (exits + final head, rows, classes)
        n_rows = final.shape[0]
        exit_at = np.full(n_rows, len(exits))  # index into stack: the final head unless a branch lets the row go
        left = np.zeros(n_rows, dtype=bool)
        same = np.zeros(n_rows, dtype=np.int64)
        for i, logits in enumerate(exits):
            if patience is not None:  # PABEE: the argmax stayed the same for `patience` branches
                pred = logits.argmax(-1)
                if i > 0:
                    same = np.where(pred == exits[i - 1].argmax(-1), same + 1, 0)
                leave = same >= patience
            else:
                z = logits - logits.max(-1, keepdims=True)
                p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
                entropy = -(p * np.log(np.where(p > 0, p, 1.0))).sum(-1) / math.log(logits.shape[-1])
                leave = entropy < speed  # NaN never leaves, as in exit_forward
            new = leave & ~left
            exit_at[new] = i
            left |= leave
        chosen = stack[exit_at, np.arange(n_rows)]
        out["accuracy"] = float((chosen.argmax(-1) == labels).mean())
        out["mean_exit_layer"] = float((exit_at + 1).mean())
        return out

    return compute
