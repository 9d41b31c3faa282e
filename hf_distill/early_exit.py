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

Training goes through `DistillationTrainer` with no teacher model: `EarlyExitModel.forward` runs the backbone
once, takes the final head's logits as the teacher and returns one term per branch in `distill_losses`
(`exit_1`, ...), which the trainer logs as `loss_exit_1`, ... . Adaptive inference hooks every block: the rows
that left are sliced out of the hidden states (and of every per-row tensor the block receives), so later blocks
really run on fewer rows; the forward stops once every row has left.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from .families import REGISTER_HINT
from .taps import FeatureTaps, TapRequest, model_info, unwrap

BRANCH_FILE = "early_exit.safetensors"
BRANCH_CONFIG_FILE = "early_exit_config.json"
PLOT_FILE = "early_exit.png"
FORMAT = "hf_distill.early_exit/fastbert-v1"


class ExitBranch(nn.Module):
    """FastBERT's student classifier: narrow projection, 2-head self-attention, first-token pooling, 2 linears.

    Only the first token's attention output is pooled, so only its query is computed (same result as full
    self-attention followed by `[:, 0]`, at a fraction of the cost). The attention's parameters are an
    `nn.MultiheadAttention`'s (same state-dict keys), but the forward is written out: at batch 1 a branch is
    a dozen small ops, and `nn.MultiheadAttention.forward`'s own checks cost more than its arithmetic.
    """

    def __init__(self, hidden_size: int, num_labels: int, width: int = 128, heads: int = 2) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"branch_width ({width}) must be divisible by branch_heads ({heads}).")
        self.down = nn.Linear(hidden_size, width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.pool = nn.Linear(width, width)
        self.out = nn.Linear(width, num_labels)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
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


def uncertainty(logits: torch.Tensor) -> torch.Tensor:
    """FastBERT's normalised entropy H(p) / log(num_labels), in [0, 1]."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1) / math.log(logits.shape[-1])


def check_rule(speed: float | None, patience: int | None) -> None:
    if speed is not None and patience is not None:
        raise ValueError("Give either speed (FastBERT) or patience (PABEE), not both.")
    if speed is not None and not (isinstance(speed, int | float) and 0.0 <= speed <= 1.0):
        raise ValueError(f"speed must be in [0, 1] (normalised entropy threshold; 0 = never exit early), got {speed}.")
    if patience is not None and (isinstance(patience, bool) or not isinstance(patience, int) or patience < 1):
        raise ValueError(f"patience must be an integer >= 1 (branches with an unchanged argmax), got {patience}.")


class EarlyExitModel(nn.Module):
    """A fine-tuned sequence classifier of a registered encoder family with one exit branch per block."""

    def __init__(self, model: nn.Module, branch_width: int = 128, branch_heads: int = 2) -> None:
        super().__init__()
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
        is_seq = type(inner).__name__.endswith("ForSequenceClassification")
        num_labels = getattr(config, "num_labels", 0)
        if not is_seq or getattr(config, "problem_type", None) in ("regression", "multi_label_classification"):
            raise ValueError(
                f"EarlyExitModel needs a single-label sequence classifier (AutoModelForSequenceClassification), "
                f"got {type(inner).__name__} (problem_type={getattr(config, 'problem_type', None)!r}): the exit "
                "rule compares class distributions."
            )
        if num_labels < 2:
            raise ValueError(f"EarlyExitModel needs num_labels >= 2 (entropy over classes), got {num_labels}.")
        self.model = inner
        self.config = config
        self.num_exits = info.num_layers
        self.branch_width, self.branch_heads = branch_width, branch_heads
        self.branches = nn.ModuleList(
            ExitBranch(info.hidden_size, num_labels, branch_width, branch_heads) for _ in range(self.num_exits - 1)
        )
        self._blocks = inner.base_model.get_submodule(info.family.layers)
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
        **kwargs: Any,
    ) -> EarlyExitOutput:
        """One backbone forward; every branch is distilled from the final head (labels are not used)."""
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids,
                  **kwargs}
        kwargs = {k: v for k, v in kwargs.items() if v is not None and k != "labels"}
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
        batch there. `speed=0` (or neither rule) runs every row to the final head, reproducing the model."""
        check_rule(speed, patience)
        inputs = {k: v for k, v in inputs.items() if k != "labels"}
        ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
        n = ids.shape[0]
        mask = inputs.get("attention_mask")
        device = ids.device
        state = {"active": torch.arange(n, device=device), "prev": None, "same": None, "calls": 0}
        result_logits: torch.Tensor | None = None
        exit_layer = torch.full((n,), self.num_exits, dtype=torch.long, device=device)

        def slice_rows(x: Any) -> Any:
            if torch.is_tensor(x) and x.dim() > 0 and x.shape[0] == n:
                return x.index_select(0, state["active"])
            return x

        def pre_hook(_m, args, kwargs):
            if len(state["active"]) == n:
                return None
            return tuple(slice_rows(a) for a in args), {k: slice_rows(v) for k, v in kwargs.items()}

        def post_hook(i: int):
            def hook(_m, _args, _kwargs, output):
                nonlocal result_logits
                hidden = output[0] if isinstance(output, tuple) else output
                active = state["active"]
                rows_mask = mask if mask is None or len(active) == n else mask.index_select(0, active)
                logits = self.branches[i](hidden, rows_mask)
                state["calls"] += len(active)
                if result_logits is None:
                    result_logits = torch.zeros(n, logits.shape[-1], dtype=logits.dtype, device=device)
                if patience is not None:
                    pred = logits.argmax(-1)
                    if state["prev"] is None:
                        same = torch.zeros_like(pred)
                    else:
                        same = torch.where(pred == state["prev"], state["same"] + 1, torch.zeros_like(pred))
                    leave = same >= patience  # PABEE: the argmax stayed the same for `patience` branches
                    state["prev"], state["same"] = pred, same
                else:
                    leave = uncertainty(logits) < (speed or 0.0)
                if not leave.any():
                    return None
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

            return hook

        rule = speed is not None and speed > 0 or patience is not None
        handles = []
        try:
            if rule:
                for i, block in enumerate(self._blocks):
                    handles.append(block.register_forward_pre_hook(pre_hook, with_kwargs=True))
                    if i < len(self.branches):
                        handles.append(block.register_forward_hook(post_hook(i), with_kwargs=True))
            try:
                final = self.model(**inputs).logits
                if result_logits is None:
                    return ExitResult(final, exit_layer, state["calls"])
                result_logits[state["active"]] = final.to(result_logits.dtype)
            except _AllExited:
                pass
        finally:
            for h in handles:
                h.remove()
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
                  folder / BRANCH_FILE, metadata={"format": FORMAT})
        spec = {"format": FORMAT, "num_exits": self.num_exits, "branch_width": self.branch_width,
                "branch_heads": self.branch_heads, "num_labels": self.config.num_labels,
                "paper": "FastBERT (Liu et al., ACL 2020)"}
        (folder / BRANCH_CONFIG_FILE).write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, **kwargs: Any) -> EarlyExitModel:
        """Load a folder written by `save_pretrained` (local, or a Hub repo id)."""
        from safetensors.torch import load_file
        from transformers import AutoModelForSequenceClassification

        folder = str(folder)
        if Path(folder).is_dir():
            cfg_path, weights_path = Path(folder) / BRANCH_CONFIG_FILE, Path(folder) / BRANCH_FILE
            if not cfg_path.is_file() or not weights_path.is_file():
                raise ValueError(
                    f"{folder} holds no {BRANCH_CONFIG_FILE}/{BRANCH_FILE}: it is not an early-exit model "
                    "(save one with EarlyExitModel.save_pretrained)."
                )
        else:
            from huggingface_hub import hf_hub_download

            hub = {k: kwargs[k] for k in ("revision", "token") if k in kwargs}
            cfg_path = Path(hf_hub_download(folder, BRANCH_CONFIG_FILE, **hub))
            weights_path = Path(hf_hub_download(folder, BRANCH_FILE, **hub))
        spec = json.loads(cfg_path.read_text(encoding="utf-8"))
        model = AutoModelForSequenceClassification.from_pretrained(folder, **kwargs)
        wrapper = cls(model, branch_width=spec["branch_width"], branch_heads=spec["branch_heads"])
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
        publish through `hf_distill.hub.push_student` (which uploads the branch files too)."""
        import shutil

        from .card import write_model_card
        from .hub import push_student

        folder = Path(folder)
        self.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        if plot is not None and Path(plot).resolve() != (folder / PLOT_FILE).resolve():
            shutil.copyfile(plot, folder / PLOT_FILE)
        early_exit = {"num_exits": self.num_exits, "sweep": sweep or [],
                      "plot": PLOT_FILE if (folder / PLOT_FILE).is_file() else None}
        write_model_card(folder, model_name=repo_id, method="fastbert", early_exit=early_exit,
                         pipeline_tag="text-classification", architecture=type(self.model).__name__)
        return push_student(folder, repo_id, **hub_kwargs)


def flops_per_row(num_layers_run: int, branches_run: int, tokens: int, hidden: int, intermediate: int,
                  width: int = 128) -> float:
    """Analytic forward FLOPs of one row (2 per multiply-add): blocks (Q/K/V/O, FFN, attention) + branches."""
    block = tokens * (2 * 4 * hidden * hidden + 2 * 2 * hidden * intermediate) + 2 * 2 * tokens * tokens * hidden
    branch = tokens * 2 * (hidden * width + 2 * width * width) + 2 * (2 * width * width + 2 * tokens * width)
    return num_layers_run * block + branches_run * branch
