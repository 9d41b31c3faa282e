"""Cross-tokenizer KD for causal LMs: a teacher whose tokenizer (vocabulary, positions) is not the student's.

The teacher reads its own tokenization of the text (`teacher_input_ids`, from
`hf_distill.data.cross_tokenizer.CrossTokenizerCollator`); the two models' next-token logits are then paired
position by position (`pairs`) and compared with one of two methods (`DistillationArguments.cross_tokenizer`).

`"uld"`: Universal Logit Distillation (Boizard, El Haddad, Hudelot, Colombo, 2024, "Towards Cross-Tokenizer
Distillation: the Universal Logit Distillation Loss for LLMs", arXiv:2402.12030; the authors' code is
github.com/Nicolas-BZRD/llm-recipes, `models/distillation_model.py`, `DistillationLoss`). Per paired position, the
closed form the paper gives for its Wasserstein distance between the two next-token distributions:
``sum_k |p_(k) - q_(k)|``, where ``p_(k)`` and ``q_(k)`` are the teacher's and the student's probabilities
(softmax at temperature T) sorted in decreasing order, the shorter vocabulary padded with zeros; no T**2 factor, no
1/2, exactly as the authors' code computes it. Positions are paired as the paper pairs the answer tokens: the k-th
distilled position of the student (a position predicting a counted token, `kd_token_mask`) with the k-th of the
teacher, truncated to the shorter of the two; this is the authors' pairing (answer spans aligned at their first
token, cut to the shorter) for contiguous answers, and needs no tokenizer. Two choices differ from the authors'
code: one temperature for both models (theirs has one each, 1 by default), and the reduction is hf_distill's
token-level mean over every paired position of the optimizer step (`losses.normalise`), where the code averages
each sequence's positions and then the sequences; the two agree when every row has as many paired positions.

`"aligned"`: the positions the character offsets of both tokenizations pair (`data.cross_tokenizer.align_positions`:
both prefixes end at the same character, so both models have read the same text), kept where both models' next
token is distilled. At each pair the two next-token distributions are restricted to the vocabulary the tokenizers
share (tokens with identical strings, `shared_vocabulary`) and each renormalised over it (softmax of the gathered
logits at T), then compared with `kd_loss` (KL, reverse KL, JSD, ... at T, with their usual T**2 factors), mean over
the pairs. This is the matched-vocabulary part of GOLD's hybrid ULD (TRL's `GOLDTrainer`, `uld_use_hybrid_loss`:
tokens with identical strings compared one to one), renormalised on both sides so that it is a divergence (0 when
the two agree on the shared tokens); the tokens outside the shared vocabulary are not compared.

Both are means over the pairs of one batch; `count` gives their number, which the Distiller uses for the
optimizer step's normalisation. A batch without a pair gives 0 (connected to the student's graph).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..base.batch_keys import require_tensors
from .divergences import logit_kd_loss
from .normalise import kd_positions

METHODS = ("uld", "aligned")


def validate_cross_tokenizer(args: Any) -> None:
    """Refuse `cross_tokenizer` values, and settings beside it, that would do nothing or could not be honoured
    (the student's head and the teachers are checked by the Distiller)."""
    method = args.cross_tokenizer
    if method is None:
        return
    if method not in METHODS:
        raise ValueError(
            f"DistillationArguments.cross_tokenizer={method!r} is unknown. Known: "
            f"{', '.join(METHODS)}, or leave it unset for one shared tokenizer."
        )
    why = None
    if args.kd_weight == 0:
        why = "kd_weight=0 turns the KD term off, and cross_tokenizer only changes that term. Set kd_weight > 0"
    elif args.distill_terms:
        why = ("distill_terms compare features position by position, but the two tokenizations have different "
               "positions. Remove distill_terms (logit KD only)")
    elif args.kd_chunk_size is not None:
        why = ("the chunked loss head (kd_chunk_size) compares two logits of one vocabulary at the same positions. "
               "Leave kd_chunk_size unset")
    elif method == "uld" and args.kd_loss != "kl":
        why = (f"ULD is its own distance (sorted probabilities), so kd_loss={args.kd_loss!r} would do nothing. "
               "Leave kd_loss unset, or use cross_tokenizer='aligned', which compares with kd_loss")
    elif method == "aligned" and args.kd_loss == "mse":
        why = ("kd_loss='mse' compares raw logits, not the distributions renormalised over the shared "
               "vocabulary. Choose a divergence (kl, reverse_kl, jsd, ...)")
    if why is not None:
        raise ValueError(f"DistillationArguments.cross_tokenizer={method!r} cannot be used here: {why}.")


def _need(batch: dict[str, Any], keys: tuple[str, ...], method: str) -> None:
    require_tensors(batch, keys, f"cross_tokenizer={method!r} needs the teacher's own tokenization",
                    "Use hf_distill.data.cross_tokenizer.CrossTokenizerCollator(student_tokenizer, teacher_tokenizer) "
                    "as the data collator (with remove_unused_columns=False, so that the text column reaches it).")


def teacher_inputs(batch: dict[str, Any], method: str) -> dict[str, torch.Tensor]:
    """The teacher's forward inputs: its own tokenization of the batch's text."""
    _need(batch, ("teacher_input_ids", "teacher_attention_mask"), method)
    return {"input_ids": batch["teacher_input_ids"], "attention_mask": batch["teacher_attention_mask"]}


def teacher_batch(batch: dict[str, Any], method: str, label_names: list[str]) -> dict[str, torch.Tensor]:
    """The batch as the teacher reads it on its own (its evaluation, `evaluate_teacher`): its tokenization, with
    `teacher_labels` under the label name, where the batch has them."""
    own = teacher_inputs(batch, method)
    if len(label_names) == 1 and isinstance(batch.get("teacher_labels"), torch.Tensor):
        own[label_names[0]] = batch["teacher_labels"]
    return own


def distilled_positions(batch: dict[str, Any], label_name: str, mode: str, method: str):
    """The student's and the teacher's distilled logit positions, (B, T_s - 1) and (B, T_t - 1) booleans: each side's
    `kd_token_mask` positions (the next token is counted) of its own tokenization."""
    _need(batch, ("input_ids", "teacher_input_ids", "teacher_attention_mask"), method)
    labels = batch.get(label_name)
    if mode == "labels" and isinstance(labels, torch.Tensor):
        _need(batch, ("teacher_labels",), method)
    s_ids, t_ids = batch["input_ids"], batch["teacher_input_ids"]
    s = kd_positions(batch.get("attention_mask"), labels, mode, causal=True)
    t = kd_positions(batch["teacher_attention_mask"], batch.get("teacher_labels"), mode, causal=True)
    s = torch.ones(s_ids.shape[0], s_ids.shape[1] - 1, dtype=torch.bool, device=s_ids.device) if s is None else s
    t = torch.ones(t_ids.shape[0], t_ids.shape[1] - 1, dtype=torch.bool, device=t_ids.device) if t is None else t
    return s.bool(), t.bool()


def pairs(method: str, batch: dict[str, Any], label_name: str = "labels", mode: str = "labels"):
    """The paired positions as three (N,) index tensors: row, student position, teacher position (logit positions,
    the logits at a position predicting the next token)."""
    if method not in METHODS:
        raise ValueError(f"cross_tokenizer={method!r} is unknown; known: {', '.join(METHODS)}.")
    s_mask, t_mask = distilled_positions(batch, label_name, mode, method)
    if method == "aligned":
        _need(batch, ("teacher_positions",), method)
        if t_mask.shape[1] == 0:  # a one-token teacher sequence predicts nothing
            t_mask = t_mask.new_zeros(t_mask.shape[0], 1)
        aligned = batch["teacher_positions"][:, : s_mask.shape[1]].to(s_mask.device)
        inside = (aligned >= 0) & (aligned < t_mask.shape[1])
        teacher_counted = t_mask.to(s_mask.device).gather(1, aligned.clamp(0, max(t_mask.shape[1] - 1, 0)))
        rows, s_pos = (s_mask & inside & teacher_counted).nonzero(as_tuple=True)
        return rows, s_pos, aligned[rows, s_pos]
    rows, s_pos, t_pos = [], [], []
    for b in range(s_mask.shape[0]):
        s_idx, t_idx = s_mask[b].nonzero().flatten(), t_mask[b].nonzero().flatten().to(s_mask.device)
        n = min(len(s_idx), len(t_idx))
        rows.append(torch.full((n,), b, dtype=torch.long, device=s_mask.device))
        s_pos.append(s_idx[:n])
        t_pos.append(t_idx[:n])
    return torch.cat(rows), torch.cat(s_pos), torch.cat(t_pos)


def count(method: str, batch: dict[str, Any], label_name: str = "labels", mode: str = "labels") -> int:
    """How many positions `method` compares in `batch` (the KD term's count for the step's normalisation)."""
    return len(pairs(method, batch, label_name, mode)[0])


class PairedShare:
    """The share of the student's distilled positions that `method` pairs with a teacher position, over a logging
    window of training micro-batches: logged as `xtok_paired_share` next to `loss` (`log_values`).

    Paired and distilled positions are summed over every micro-batch since the last log (and over processes) before
    dividing, so the share is that of the window's positions whatever the gradient accumulation or the rows' lengths
    (a mean of per-batch shares would weigh a short batch like a long one). A low share means most of what the
    student learns from the labels has no teacher signal: for "aligned", tokenizations that rarely end at the same
    character; for "uld", a teacher with fewer distilled positions than the student."""

    def __init__(self, method: str, label_name: str = "labels", mode: str = "labels") -> None:
        self.method, self.label_name, self.mode = method, label_name, mode
        self.paired, self.distilled = 0, 0

    def add(self, batch: dict[str, Any]) -> None:
        """Count one micro-batch's paired and distilled (student) positions."""
        self.paired += len(pairs(self.method, batch, self.label_name, self.mode)[0])
        self.distilled += int(distilled_positions(batch, self.label_name, self.mode, self.method)[0].sum())

    def reset(self) -> None:
        self.paired, self.distilled = 0, 0

    def log_values(self, accelerator: Any = None) -> dict[str, float]:
        """`xtok_paired_share` since the last call, over every process (0.0 when no position was distilled).
        Resets the counts."""
        values = torch.tensor([float(self.paired), float(self.distilled)], dtype=torch.float64)
        if accelerator is not None and accelerator.num_processes > 1:
            values = accelerator.reduce(values.to(accelerator.device), "sum").cpu()
        paired, distilled = values.tolist()
        self.reset()
        return {"xtok_paired_share": paired / distilled if distilled > 0 else 0.0}


def uld_distance(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """ULD per paired position, (N, V_s) and (N, V_t) logits -> mean over N of ``sum_k |p_(k) - q_(k)|`` (sorted
    softmax probabilities at T, zero-padded to the larger vocabulary); 0 for N = 0."""
    q = F.softmax(student_logits.float() / temperature, dim=-1).sort(dim=-1, descending=True).values
    p = F.softmax(teacher_logits.float().to(q.device) / temperature, dim=-1).sort(dim=-1, descending=True).values
    width = max(q.shape[-1], p.shape[-1])
    q, p = F.pad(q, (0, width - q.shape[-1])), F.pad(p, (0, width - p.shape[-1]))
    return (q - p).abs().sum(-1).sum() / max(q.shape[0], 1)


def shared_vocabulary(tokenizer: Any, teacher_tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids of the tokens both vocabularies hold (identical strings, added and special tokens included): the
    student's and the teacher's id of each, ordered by the student's id. Refused when they share none."""
    student, teacher = tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    both = sorted((sid, teacher[token]) for token, sid in student.items() if token in teacher)
    if not both:
        raise ValueError(
            "cross_tokenizer='aligned' compares the two next-token distributions on the tokens both vocabularies "
            "hold, but the student's and the teacher's tokenizers share no token string. Use cross_tokenizer='uld', "
            "which needs no shared token."
        )
    ids = torch.tensor(both, dtype=torch.long)
    return ids[:, 0].contiguous(), ids[:, 1].contiguous()


def cross_tokenizer_kd(
    method: str,
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    batch: dict[str, Any],
    *,
    kind: str = "kl",
    temperature: float = 1.0,
    label_name: str = "labels",
    mode: str = "labels",
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    beta: float = 0.5,
    alpha: float = 0.1,
) -> torch.Tensor:
    """The cross-tokenizer KD term of one batch: `student_logits` (B, T_s, V_s) on the student's tokens,
    `teacher_logits` (B, T_t, V_t) on the teacher's (`teacher_inputs`), paired by `method` (see the module
    docstring); `shared` is `shared_vocabulary`'s pair of id tensors (needed by "aligned")."""
    rows, s_pos, t_pos = pairs(method, batch, label_name, mode)
    rows, s_pos = rows.to(student_logits.device), s_pos.to(student_logits.device)
    s = student_logits[rows, s_pos]
    t = teacher_logits[rows.to(teacher_logits.device), t_pos.to(teacher_logits.device)].to(s.device)
    if method == "uld":
        return uld_distance(s, t, temperature)
    if shared is None:
        raise ValueError("cross_tokenizer='aligned' needs the shared vocabulary (shared_vocabulary(student, teacher)).")
    s_ids, t_ids = (ids.to(s.device) for ids in shared)
    return logit_kd_loss(kind, s[:, s_ids], t[:, t_ids], temperature, beta=beta, alpha=alpha)


__all__ = ["METHODS", "PairedShare", "count", "cross_tokenizer_kd", "pairs", "shared_vocabulary", "teacher_batch",
           "teacher_inputs", "uld_distance"]
