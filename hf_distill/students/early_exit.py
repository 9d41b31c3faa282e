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
(`exit_1`, ...), which the trainer logs as `loss_exit_1`, ... . Adaptive inference runs the backbone's own forward
with forward hooks of its own on the blocks, for that call only: after each block the branch decides, the rows that
left are sliced out of the hidden states (and of every per-row tensor later blocks receive), so later blocks really
run on fewer rows; the forward stops once every row has left. The branches are in `exit_branches`, the exit rules
and `branch_metrics` in `exit_rules` (both re-exported here).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from ..features.families import REGISTER_HINT
from ..features.heads import HeadKind, head_kind
from ..features.taps import FeatureTaps, TapRequest, model_info, unwrap
from .exit_branches import BRANCHES, ExitBranch, PoolerBranch, block_flops, check_branch, flops_per_row
from .exit_rules import HOST_ROWS_MAX, branch_metrics, check_first_token, check_rule, row_uncertainties, uncertainty

__all__ = [
    "BRANCHES", "BRANCH_CONFIG_FILE", "BRANCH_FILE", "FORMAT", "FORMATS", "HOST_ROWS_MAX", "PLOT_FILE",
    "EarlyExitModel", "EarlyExitOutput", "ExitBranch", "ExitResult", "PoolerBranch", "block_flops",
    "branch_metrics", "check_branch", "check_first_token", "check_rule", "flops_per_row", "row_uncertainties",
    "uncertainty",
]

BRANCH_FILE = "early_exit.safetensors"
BRANCH_CONFIG_FILE = "early_exit_config.json"
PLOT_FILE = "early_exit.png"
# Persisted in saved folders (the module's path before 0.2): never renamed, one per branch kind.
FORMAT = "hf_distill.early_exit/fastbert-v1"  # a FastBERT-branch folder's
FORMATS = {"fastbert": FORMAT, "deebert": "hf_distill.early_exit/deebert-v1"}


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
        # a tuple, not a submodule of this wrapper (the blocks are self.model's): registered twice, every block's
        # weight was in the state dict under two names, which the Trainer's checkpoints (safetensors) refuse
        self._blocks = tuple(inner.base_model.get_submodule(info.family.layers))
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
        branches = list(self.branches)
        blocks = list(self._blocks)
        handles: list[Any] = []  # the hooks this call registers, removed when it ends
        result_logits: torch.Tensor | None = None
        exit_layer = torch.full((n,), self.num_exits, dtype=torch.long, device=device)

        def slice_rows(x: Any) -> Any:
            if torch.is_tensor(x) and x.dim() > 0 and x.shape[0] == n:
                return x.index_select(0, state["active"])
            return x

        def slice_inputs(_block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            """Forward pre-hook of the blocks after the first rows left: their per-row inputs lose those rows."""
            return tuple(slice_rows(a) for a in args), {k: slice_rows(v) for k, v in kwargs.items()}

        def exit_step(i: int, _block: nn.Module, _args: tuple, output: Any) -> Any:
            """Forward hook of block i: branch i decides on its output. The next block's hook is registered here,
            so a batch that leaves early registers (and removes) only the hooks of the blocks it ran."""
            output = after(i, output)
            if i + 1 < len(branches):
                handles.append(blocks[i + 1].register_forward_hook(partial(exit_step, i + 1)))
            return output

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
                handles.extend(b.register_forward_pre_hook(slice_inputs, with_kwargs=True) for b in blocks[i + 1 :])
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

        # The exit step is a forward hook registered after the block's own hooks (and runs after the global
        # ones), so the branch sees their output, as in training, and they see every row the block runs on. The
        # slicing is a pre-hook registered after the block's own, so those see the rows given to the model.
        key = id(self.model)  # the backbone, which two wrappers of it share
        if key in _RUNNING:
            raise RuntimeError("exit_forward is already running on this model's blocks (called again from a branch "
                               "or a hook, or from another thread): one call at a time per backbone.")
        _RUNNING.add(key)
        try:
            handles.append(blocks[0].register_forward_hook(partial(exit_step, 0)))
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

    def save_pretrained(self, folder: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None,
                        **kwargs: Any) -> None:
        """The backbone's own files (loadable alone with AutoModel...) plus the branches in their own file.
        `state_dict` is this wrapper's (`model.*`, `branches.*`), as the Trainer hands it (gathered under DeepSpeed);
        `is_main_process=False` writes nothing."""
        from safetensors.torch import save_file

        backbone, branches = None, self.branches.state_dict()
        if state_dict is not None:
            other = [k for k in state_dict if not k.startswith(("model.", "branches."))]
            if other:
                raise ValueError(f"EarlyExitModel.save_pretrained: state_dict keys {other[:3]} are neither the "
                                 "backbone's (model.*) nor the branches' (branches.*).")
            backbone = {k[len("model."):]: v for k, v in state_dict.items() if k.startswith("model.")}
            branches = {k[len("branches."):]: v for k, v in state_dict.items() if k.startswith("branches.")}
        folder = Path(folder)
        self.model.save_pretrained(folder, state_dict=backbone, **kwargs)
        if not kwargs.get("is_main_process", True):
            return
        save_file({k: v.detach().contiguous().cpu() for k, v in branches.items()},
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
        plot_name = PLOT_FILE if (folder / PLOT_FILE).is_file() else None
        write_model_card(folder, model_name=repo_id, **self.card_fields(sweep, plot_name))
        return push_student(folder, repo_id, **hub_kwargs)

    def card_fields(self, sweep: list[dict[str, Any]] | None = None, plot: str | None = None) -> dict[str, Any]:
        """The model card's fields for this student, shared by `push_to_hub` and the Trainer's `push_to_hub`
        (trainer_runs.early_exit_card) so that both publish the same card."""
        return {"method": self.branch, "architecture": type(self.model).__name__, "pipeline_tag": "text-classification",
                "early_exit": {"num_exits": self.num_exits, "branch": self.branch, "sweep": sweep or [], "plot": plot}}


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
