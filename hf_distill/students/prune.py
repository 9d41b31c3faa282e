"""Depth pruning: a student made of the teacher's most important blocks (ShortGPT's Block Influence, Men et al.
2024; Minitron's depth pruning, Muralidharan et al. 2024), copied bit-exactly by `build.from_teacher`.
Importable as `hf_distill.students.prune_depth` / `block_importance` / `DepthPruning`, as before."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from ..features.families_audio import frame_mask
from .build import encoder_layers, from_teacher

__all__ = ["DepthPruning", "block_importance", "prune_depth"]

@dataclass(frozen=True)
class DepthPruning:
    """What :func:`prune_depth` measured and decided.

    `scores[i]` is block i's importance, ``1 - mean cos(input, output)`` over the real tokens of the
    calibration data (0: the block leaves its input's direction unchanged, a candidate for removal); `kept`
    and `removed` are teacher block indices in order; `num_tokens` is how many tokens the mean ran over.
    """

    scores: list[float]
    kept: list[int]
    removed: list[int]
    num_tokens: int


def block_importance(model: PreTrainedModel, calibration_batches: Iterable[Mapping[str, Any]]) -> list[float]:
    """Per block, ``1 - mean cosine similarity`` between its input and output hidden states over real tokens.

    ShortGPT's Block Influence (Men et al. 2024), the depth criterion of Minitron (Muralidharan et al. 2024).
    Hooks read each block's own input and output, so a final norm (which transformers puts into the last
    entry of ``output_hidden_states`` on decoders) never enters the score. Real tokens are those with
    ``attention_mask != 0`` (every token without a mask). The model runs in eval mode without gradients (its
    mode is restored); sums are float64, so equal data give equal scores.
    """
    scores, _ = _block_importance(model, calibration_batches)
    return scores


def _block_importance(
    model: PreTrainedModel, calibration_batches: Iterable[Mapping[str, Any]]
) -> tuple[list[float], int]:
    blocks = encoder_layers(model)
    if isinstance(calibration_batches, Mapping):
        raise TypeError("calibration_batches must be an iterable of batches (dicts), not a single batch.")
    device = next(model.parameters()).device
    sums = torch.zeros(len(blocks), dtype=torch.float64)
    counts = torch.zeros(len(blocks), dtype=torch.int64)
    inputs: dict[int, torch.Tensor] = {}
    current: dict[str, torch.Tensor | None] = {"real": None}
    num_batches = 0

    def pre_hook(index):
        def hook(_module, args, kwargs):
            inputs[index] = args[0] if args else kwargs["hidden_states"]

        return hook

    def post_hook(index):
        def hook(_module, _args, output):
            out = output[0] if isinstance(output, tuple) else output
            cos = torch.nn.functional.cosine_similarity(inputs.pop(index).float(), out.float(), dim=-1)
            real = frame_mask(model, current["real"], cos.shape[1])  # a waveform's samples -> its frames
            cos = cos.flatten() if real is None else cos[real]
            sums[index] += cos.double().sum().cpu()
            counts[index] += cos.numel()

        return hook

    handles = []
    was_training = model.training
    try:
        for i, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
            handles.append(block.register_forward_hook(post_hook(i)))
        model.eval()
        with torch.no_grad():
            for n, batch in enumerate(calibration_batches):
                if not isinstance(batch, Mapping):
                    raise TypeError(
                        f"calibration batch {n} must be a dict of model inputs (input_ids, attention_mask, ...), "
                        f"got {type(batch).__name__}."
                    )
                batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                mask = batch.get("attention_mask")
                current["real"] = mask.bool() if isinstance(mask, torch.Tensor) else None
                num_batches += 1
                model(**batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if num_batches == 0:
        raise ValueError("calibration_batches is empty; give at least one batch of real text to score the blocks.")
    num_tokens = int(counts[0])
    if num_tokens == 0:
        raise ValueError(
            "The calibration batches have no real tokens (attention_mask is 0 everywhere); block importance is a "
            "mean over real tokens."
        )
    return (1.0 - sums / num_tokens).tolist(), num_tokens


def prune_depth(
    teacher: PreTrainedModel, num_layers: int, calibration_batches: Iterable[Mapping[str, Any]]
) -> tuple[PreTrainedModel, DepthPruning]:
    """A student of ``num_layers`` blocks: the teacher's most important ones (:func:`block_importance`), in
    their original order, copied bit-exactly by :func:`from_teacher`.

    Ties keep the earlier block. Returns the student and a :class:`DepthPruning` with the scores and the
    kept / removed blocks; the scores are also recorded in ``student.config.distillation``
    (``block_importance``) so the model card can cite them.
    """
    if not isinstance(teacher, PreTrainedModel):
        raise TypeError(f"teacher must be a transformers PreTrainedModel, got {type(teacher).__name__}.")
    total = len(encoder_layers(teacher))
    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise TypeError(f"num_layers must be an int, got {num_layers!r}.")
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be between 1 and {total} (the teacher's block count), got {num_layers}.")
    scores, num_tokens = _block_importance(teacher, calibration_batches)
    ranked = sorted(range(total), key=lambda i: (-scores[i], i))
    kept = sorted(ranked[:num_layers])
    student = from_teacher(teacher, kept)
    student.config.distillation.update(
        {"init": "prune_depth", "block_importance": scores, "calibration_tokens": num_tokens}
    )
    report = DepthPruning(scores=scores, kept=kept, removed=sorted(ranked[num_layers:]), num_tokens=num_tokens)
    return student, report
