"""Intermediate-layer (feature) distillation losses: pure functions of student and teacher tensors.

Every function returns a float32 scalar that is differentiable w.r.t. the student arguments; inputs of any
floating dtype are upcast with ``.float()`` first. Shapes: hidden states ``(B, T, D)``; attention scores
``(B, H, T, T)``; ``mask`` ``(B, T)``, padding handled as in :mod:`hf_distill.losses.masking`.

References for the definitions:

- Sanh et al., 2019, DistilBERT: a cosine loss between hidden states.
- Jiao et al., 2020, TinyBERT: MSE on hidden states and on pre-softmax attention scores.
- Wang et al., 2020/2021, MiniLM and MiniLMv2: KL between self-attention (relation) distributions.
- Sun et al., 2019, BERT-PKD: distance between L2-normalised [CLS] states.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .masking import _check_same_shape, _mean_over_positions, _real_positions, _squared_error_mean, _zero_padding

__all__ = [
    "FEATURE_LOSSES",
    "attention_score_mse",
    "cosine_loss",
    "hidden_mse",
    "pkd_loss",
    "relation_kl",
]


def hidden_mse(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Squared error of hidden states, one global mean over real positions and features.

    TinyBERT's hidden-state loss (after any projection of the student). Equals ``F.mse_loss`` when
    ``mask`` is None; with a mask, padding neither contributes nor dilutes the mean.
    """
    return _squared_error_mean("hidden_mse", student, teacher, mask)


def cosine_loss(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``1 - cos(s, t)`` per token, averaged over real positions (DistilBERT's cosine-embedding term)."""
    _check_same_shape("cosine_loss", student, teacher)
    s = student.float()
    real = _real_positions(mask, s.shape[:-1], s.device, "cosine_loss")
    cos = F.cosine_similarity(_zero_padding(s, real), _zero_padding(teacher.float(), real), dim=-1)
    return _mean_over_positions(1.0 - cos, real)


def attention_score_mse(
    student_scores: torch.Tensor,
    teacher_scores: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
) -> torch.Tensor:
    """Squared error of pre-softmax attention scores ``(B, H, T, T)``, averaged over real pairs.

    TinyBERT's attention loss, but the mean runs only over (batch, head, query, key) entries whose query
    and key are both real, so the value does not depend on how much padding the batch has (TinyBERT
    instead zeroes scores below -100 and averages over every entry). Entries at real pairs must be
    finite. ``causal=True`` (decoders) also leaves out every key later than its query: the mean runs over
    real pairs with key <= query.
    """
    _check_same_shape("attention_score_mse", student_scores, teacher_scores)
    s = student_scores.float()
    t = teacher_scores.float()
    if causal:
        if s.dim() != 4 or s.shape[-1] != s.shape[-2]:
            raise ValueError(f"attention_score_mse: causal scores must be (B, H, T, T), got {tuple(s.shape)}")
        if mask is None:
            mask = torch.ones(s.shape[0], s.shape[-1], dtype=torch.bool, device=s.device)
    if mask is None:
        sq = (s - t).square()
        return sq.sum() / max(sq.numel(), 1)
    if s.dim() != 4 or s.shape[-1] != s.shape[-2]:
        raise ValueError(
            f"attention_score_mse: scores must be (B, H, T, T) when a mask is given, got {tuple(s.shape)}"
        )
    real = _real_positions(mask, torch.Size((s.shape[0], s.shape[-1])), s.device, "attention_score_mse")
    pair = real[:, :, None] & real[:, None, :]
    if causal:
        pair = pair & _causal_keys(s.shape[-1], s.device)
    pair = pair.unsqueeze(1).expand_as(s)
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    diff = torch.where(pair, s, zero) - torch.where(pair, t, zero)
    return diff.square().sum() / pair.sum().clamp_min(1)


def _causal_keys(length: int, device: torch.device) -> torch.Tensor:
    """``(T, T)`` with True where the key (column) is not later than the query (row)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def _relation_log_probs(
    a: torch.Tensor, b: torch.Tensor, num_heads: int, keys: torch.Tensor | None, causal: bool = False
):
    """``log_softmax(a_h b_h^T / sqrt(d_h))`` per head, ``(B, H, T, T)``, with padded (and, causal, future)
    keys at -inf."""
    batch, length, dim = a.shape
    head_dim = dim // num_heads
    a_h = a.reshape(batch, length, num_heads, head_dim).transpose(1, 2)
    b_h = b.reshape(batch, length, num_heads, head_dim).transpose(1, 2)
    scores = a_h @ b_h.transpose(-1, -2) / math.sqrt(head_dim)
    allowed = None if keys is None else keys[:, None, None, :]
    if causal:
        future_ok = _causal_keys(length, a.device)
        # the diagonal stays allowed so a padded query's (ignored) row is never all -inf
        allowed = future_ok if allowed is None else (allowed & future_ok) | torch.eye(
            length, dtype=torch.bool, device=a.device
        )
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return F.log_softmax(scores, dim=-1)


def relation_kl(
    student_a: torch.Tensor,
    student_b: torch.Tensor,
    teacher_a: torch.Tensor,
    teacher_b: torch.Tensor,
    num_heads: int,
    mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
) -> torch.Tensor:
    """KL between teacher and student self-relation distributions (MiniLM / MiniLMv2).

    Each ``(B, T, D)`` input is split into ``num_heads`` contiguous heads; per head
    ``R = softmax(a_h b_h^T / sqrt(d_h))`` over the real keys, with ``d_h`` each model's own head dim, so
    student and teacher hidden sizes may differ. ``KL(R_teacher || R_student)`` is summed over keys,
    averaged over heads and the real queries of each example, then over the examples that have at least
    one real token. MiniLM: attention = ``(Q, K)`` with the model's heads and value relation = ``(V, V)``;
    MiniLMv2: ``(Q, Q) + (K, K) + (V, V)`` with a chosen number of relation heads. ``causal=True``
    (decoders): a query's relation runs only over keys not later than itself.
    """
    for name, x in (
        ("student_a", student_a),
        ("student_b", student_b),
        ("teacher_a", teacher_a),
        ("teacher_b", teacher_b),
    ):
        if x.dim() != 3:
            raise ValueError(f"relation_kl: {name} must be (B, T, D), got shape {tuple(x.shape)}")
    if student_a.shape != student_b.shape:
        raise ValueError(
            f"relation_kl: student_a {tuple(student_a.shape)} and student_b {tuple(student_b.shape)} differ"
        )
    if teacher_a.shape != teacher_b.shape:
        raise ValueError(
            f"relation_kl: teacher_a {tuple(teacher_a.shape)} and teacher_b {tuple(teacher_b.shape)} differ"
        )
    if student_a.shape[:2] != teacher_a.shape[:2]:
        raise ValueError(
            f"relation_kl: student {tuple(student_a.shape)} and teacher {tuple(teacher_a.shape)} need the "
            "same (B, T)"
        )
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"relation_kl: num_heads must be a positive int, got {num_heads!r}")
    for who, x in (("student", student_a), ("teacher", teacher_a)):
        if x.shape[-1] % num_heads:
            raise ValueError(
                f"relation_kl: num_heads={num_heads} does not divide the {who} hidden size {x.shape[-1]}"
            )

    real = _real_positions(mask, student_a.shape[:2], student_a.device, "relation_kl")
    # an example without real tokens keeps all keys so its (ignored) rows stay finite
    keys = None if real is None else real | ~real.any(-1, keepdim=True)
    log_q = _relation_log_probs(
        _zero_padding(student_a.float(), real), _zero_padding(student_b.float(), real), num_heads, keys, causal
    )
    log_p = _relation_log_probs(
        _zero_padding(teacher_a.float(), real), _zero_padding(teacher_b.float(), real), num_heads, keys, causal
    )
    p = log_p.exp()
    per_query = torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)  # (B, H, T)
    if real is None:
        return per_query.mean(dim=(1, 2)).sum() / max(per_query.shape[0], 1)
    n_real = real.sum(-1)
    per_example = torch.where(real[:, None, :], per_query, 0.0).sum(dim=(1, 2))
    per_example = per_example / (num_heads * n_real.clamp_min(1))
    return per_example.sum() / (n_real > 0).sum().clamp_min(1)


def pkd_loss(student_cls: torch.Tensor, teacher_cls: torch.Tensor) -> torch.Tensor:
    """``||s/||s|| - t/||t|| ||^2`` summed over features, averaged over the batch (BERT-PKD).

    Normalising first makes the loss independent of the two models' activation scales.
    """
    _check_same_shape("pkd_loss", student_cls, teacher_cls)
    s = F.normalize(student_cls.float(), dim=-1)
    t = F.normalize(teacher_cls.float(), dim=-1)
    per_item = (s - t).square().sum(-1)
    return per_item.sum() / max(per_item.numel(), 1)


FEATURE_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "hidden_mse": hidden_mse,
    "cosine_loss": cosine_loss,
    "attention_score_mse": attention_score_mse,
    "relation_kl": relation_kl,
    "pkd_loss": pkd_loss,
}
"""Intermediate-layer objectives by name (their signatures differ; see each function)."""
