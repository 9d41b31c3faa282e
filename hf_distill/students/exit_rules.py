"""The exit rules of early exit (`hf_distill.students.early_exit`): FastBERT's normalised entropy under `speed`,
PABEE's `patience`, the checks of both, and `branch_metrics`, the same rules computed from an evaluation forward
for a Trainer's `compute_metrics`."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch

HOST_ROWS_MAX = 256  # outputs up to this many logits get their exit rule reduced on the host (row_uncertainties)


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
