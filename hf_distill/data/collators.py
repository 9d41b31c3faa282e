"""Data collators for distillation batches.

`TeacherOutputsCollator` lets precomputed teacher outputs ride along with the inputs: columns whose
name starts with `teacher_` are taken out before the usual collator pads the text, then stacked (and,
for token-level outputs, padded to the batch's sequence length) so rows and teacher outputs stay
aligned whatever the shuffling and padding.

`MLMDistillationCollator` pads tokenised rows and masks them for task-agnostic (general) distillation of
masked-LM students, as DistilBERT does; `token_counts` gives the corpus counts its smoothing needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from transformers import DataCollatorForLanguageModeling
from transformers.trainer_utils import RemoveColumnsCollator
from transformers.utils import logging

from ..base.batch_keys import ROUTE_COLUMN, SIGNAL_PREFIX, TEACHER_PREFIX, require_tensors  # noqa: F401 - importable from here

_logger = logging.get_logger(__name__)


def _to_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


def pad_stack(values: list[torch.Tensor], length: int | None, side: str = "right", fill: float = 0.0) -> torch.Tensor:
    """Stack per-example tensors; those with a sequence dimension are padded along it to `length`."""
    if all(v.shape == values[0].shape for v in values) and (values[0].dim() < 2 or length is None):
        return torch.stack(values)
    length = length or max(v.shape[0] for v in values)
    out = values[0].new_full((len(values), length, *values[0].shape[1:]), fill)
    for i, v in enumerate(values):
        n = min(v.shape[0], length)
        if side == "right":
            out[i, :n] = v[:n]
        else:
            out[i, length - n :] = v[v.shape[0] - n :]
    return out


def stack_signal(values: list[Any]) -> torch.Tensor:
    """One `teacher_signal_*` column of a batch's rows (hf_distill.data.teacher_signal: counted positions only),
    right-padded with NaN (floats) or 0: how the collator batches it, and how a signal named as a teacher
    (hf_distill.routed_signal) batches the rows it finds."""
    values = [_to_tensor(v) for v in values]
    dtype = next((v.dtype for v in values if v.numel()), values[0].dtype)  # an empty list reads as float32
    values = [v.to(dtype) for v in values]
    return pad_stack(values, None, "right", math.nan if dtype.is_floating_point else 0)


def changes_inputs(collator: Any) -> bool:
    """Whether `collator` draws new inputs for every batch (random MLM masks), so that teacher outputs computed once
    on the rows cannot match what the student reads: `MLMDistillationCollator` (and any collator marked
    `changes_inputs = True`) and transformers' `DataCollatorForLanguageModeling(mlm=True)`."""
    if getattr(collator, "changes_inputs", False):
        return True
    return isinstance(collator, DataCollatorForLanguageModeling) and bool(collator.mlm)


class TeacherOutputsCollator:
    """Wrap a collator so that `teacher_*` columns are stacked and padded next to the inputs."""

    def __init__(self, base: Callable[[list[dict]], dict], padding_side: str | None = None) -> None:
        self.base = base
        tok = getattr(base, "tokenizer", None)
        self.padding_side = padding_side or getattr(tok, "padding_side", "right")

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        keys = [k for k in features[0] if k.startswith(TEACHER_PREFIX)]
        if not keys:
            return self.base(features)
        if changes_inputs(self.base):
            raise ValueError(
                f"The rows carry cached teacher outputs ({', '.join(keys)}), but {type(self.base).__name__} "
                "changes the inputs of every batch (MLM masking), so outputs computed on the unmasked rows "
                "do not match them. Drop the teacher_* columns and let the teacher run."
            )
        names = {k: [f[k] for f in features] for k in keys if k == ROUTE_COLUMN}  # teacher names (hf_distill.routing)
        keys = [k for k in keys if k not in names]
        teacher = {k: [_to_tensor(f[k]) for f in features] for k in keys}
        batch = self.base([{k: v for k, v in f.items() if not k.startswith(TEACHER_PREFIX)} for f in features])
        batch.update(names)
        ids = batch.get("input_ids")
        length = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
        mask = batch.get("attention_mask")
        for k, vals in teacher.items():
            if k.startswith(SIGNAL_PREFIX):  # counted positions only: right-padded (NaN for floats), placed by the loss
                batch[k] = stack_signal(vals)
                continue
            placed = _place_on_real_tokens(vals, mask) if length is not None else None
            batch[k] = placed if placed is not None else pad_stack(vals, length, self.padding_side)
        return batch


def _place_on_real_tokens(values: list[torch.Tensor], mask: Any) -> torch.Tensor | None:
    """Token-level cached outputs (one row per real token) put back where the batch's attention mask has its real
    tokens, so left, right or any other padding lines up; None when the values are not per-real-token rows."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or values[0].dim() < 2:
        return None
    real = mask != 0
    counts = real.sum(-1).tolist()
    if any(v.shape[0] != n for v, n in zip(values, counts, strict=True)):
        return None
    out = values[0].new_zeros((len(values), mask.shape[1], *values[0].shape[1:]))
    for i, v in enumerate(values):
        out[i, real[i]] = v
    return out


class KeepTeacherColumnsCollator(RemoveColumnsCollator):
    """The Trainer's column remover for datasets that are not a `datasets.Dataset` (torch datasets, lists of
    dicts, iterable datasets): it drops what the model's forward does not take, except `teacher_*` columns,
    which carry cached teacher outputs (hf_distill.data.cache) and whose names cannot be known before the rows."""

    def __init__(self, data_collator: Callable, signature_columns: list[str], logger: Any = None,
                 model_name: str | None = None, description: str | None = None) -> None:
        super().__init__(data_collator, signature_columns, logger=logger or _logger, model_name=model_name,
                         description=description)

    def _remove_columns(self, feature: dict) -> dict:
        if not isinstance(feature, dict):
            return feature
        kept = {k: v for k, v in feature.items() if k in self.signature_columns or k.startswith(TEACHER_PREFIX)}
        ignored = sorted(set(feature) - set(kept))
        if ignored and not self.message_logged and self.logger and self.model_name:
            where = "" if self.description is None else f" in the {self.description} set"
            self.logger.info(f"The columns{where} {', '.join(ignored)} are not arguments of "
                             f"`{self.model_name}.forward` nor teacher_* columns: they are ignored.")
            self.message_logged = True
        return kept


# ---------------------------------------------------------------------- MLM masking (general distillation)


def token_counts(dataset: Any, vocab_size: int, column: str = "input_ids") -> torch.Tensor:
    """How often each token id occurs in `dataset[column]`, as a `(vocab_size,)` int64 tensor.

    Computed once over the corpus, as DistilBERT's `scripts/token_counts.py` does, and given to
    `MLMDistillationCollator(token_counts=...)` to favour rare tokens when choosing what to mask.
    Arrow-backed `datasets.Dataset`s are counted without a Python loop; any other iterable of rows works.
    """
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    if hasattr(dataset, "with_format") and hasattr(dataset, "iter"):
        import pyarrow.compute as pc

        for table in dataset.with_format("arrow").iter(batch_size=10_000):
            ids = torch.tensor(pc.list_flatten(table.column(column)).to_numpy(zero_copy_only=False), dtype=torch.int64)
            counts += _bincount(ids, vocab_size, column)
        return counts
    for row in dataset:
        counts += _bincount(torch.as_tensor(row[column], dtype=torch.int64).reshape(-1), vocab_size, column)
    return counts


def _bincount(ids: torch.Tensor, vocab_size: int, column: str) -> torch.Tensor:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"token_counts: column {column!r} has ids outside [0, {vocab_size}).")
    return torch.bincount(ids, minlength=vocab_size)


class MLMDistillationCollator:
    """Pad tokenised rows and mask them as DistilBERT's general distillation does.

    Follows `Distiller.prepare_batch_mlm` of HF `research_projects/distillation` (Sanh et al. 2019):
    `ceil(mlm_probability * n_real)` positions, `n_real` being the non-pad tokens of the whole batch
    ([CLS]/[SEP] included, as the reference's `lengths`), are drawn without replacement over the flattened
    batch with `torch.multinomial`, each position weighted by its token's `max(count, 1) ** -smoothing`
    (uniform when no counts are given); pads and special tokens weigh 0 and are never chosen. A chosen
    position becomes [MASK] with probability `mask_prob`, a token drawn uniformly from the whole
    vocabulary with `random_prob`, and stays itself otherwise; `labels` hold the original id there and
    -100 elsewhere. Pair it with `DistillationArguments(kd_token_mask="labels")` to restrict the logit
    loss to the masked positions (the reference's `--restrict_ce_to_mask`); by default it covers every
    real token.

    Randomness comes from the collator's own `torch.Generator` seeded with `seed`, so the same seed gives
    the same masks whatever else uses the global RNG. In DataLoader workers the generator is re-seeded from
    `(seed, worker seed)`, so workers and epochs do not repeat each other's masks.

    Differences from the reference: the fp16 rounding of the number of masked tokens to a multiple of 8 is
    not done (use `pad_to_multiple_of` for the sequence length); the number of targets is capped at the
    number of maskable positions instead of failing; rows are padded here rather than pre-binarised.
    Columns other than input_ids / attention_mask / token_type_ids are dropped.
    """

    # The teacher must see the masked inputs: cached teacher outputs cannot be used with this collator.
    changes_inputs = True

    def __init__(
        self,
        tokenizer: Any,
        mlm_probability: float = 0.15,
        token_counts: torch.Tensor | None = None,
        smoothing: float = 0.7,
        mask_prob: float = 0.8,
        random_prob: float = 0.1,
        seed: int = 0,
        pad_to_multiple_of: int | None = None,
    ) -> None:
        if tokenizer.mask_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError("MLMDistillationCollator needs a tokenizer with a mask token and a pad token.")
        if not 0 < mlm_probability <= 1:
            raise ValueError(f"mlm_probability must be in (0, 1], got {mlm_probability}.")
        if mask_prob < 0 or random_prob < 0 or mask_prob + random_prob > 1:
            raise ValueError(f"mask_prob ({mask_prob}) and random_prob ({random_prob}) must be >= 0 and sum to <= 1.")
        self.tokenizer = tokenizer
        self.padding_side = getattr(tokenizer, "padding_side", "right")
        self.vocab_size = len(tokenizer)
        self.mlm_probability = mlm_probability
        self.pred_probs = torch.tensor([mask_prob, 1.0 - mask_prob - random_prob, random_prob])
        self.pad_to_multiple_of = pad_to_multiple_of
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self._worker_seed: int | None = None

        if token_counts is None:
            weights = torch.ones(self.vocab_size)
        else:
            counts = torch.as_tensor(token_counts, dtype=torch.float64)
            if counts.shape[0] < self.vocab_size:
                counts = torch.cat([counts, counts.new_zeros(self.vocab_size - counts.shape[0])])
            weights = counts.clamp_min(1.0).pow(-smoothing).float()
        special = [i for i in tokenizer.all_special_ids if i is not None and i < weights.shape[0]]
        weights[special] = 0.0
        self.token_weights = weights

    def _rng(self) -> torch.Generator:
        info = torch.utils.data.get_worker_info()
        if info is not None and self._worker_seed != info.seed:
            self._worker_seed = info.seed
            self.generator = torch.Generator().manual_seed((self.seed * 0x9E3779B1 + info.seed) % 2**63)
        return self.generator

    def _pad(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [torch.as_tensor(f["input_ids"], dtype=torch.long).reshape(-1) for f in features]
        length = max(r.numel() for r in rows)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {"input_ids": self._stack(rows, length, self.tokenizer.pad_token_id)}
        masks = [
            torch.as_tensor(f["attention_mask"], dtype=torch.long) if "attention_mask" in f else torch.ones_like(r)
            for f, r in zip(features, rows)
        ]
        batch["attention_mask"] = self._stack(masks, length, 0)
        if "token_type_ids" in features[0]:
            types = [torch.as_tensor(f["token_type_ids"], dtype=torch.long) for f in features]
            batch["token_type_ids"] = self._stack(types, length, 0)
        return batch

    def _stack(self, rows: list[torch.Tensor], length: int, fill: int) -> torch.Tensor:
        out = torch.full((len(rows), length), fill, dtype=torch.long)
        for i, r in enumerate(rows):
            r = r.reshape(-1)
            if self.padding_side == "left":
                out[i, length - r.numel() :] = r
            else:
                out[i, : r.numel()] = r
        return out

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self._pad(features)
        ids, real = batch["input_ids"], batch["attention_mask"].bool()
        g = self._rng()
        weights = self.token_weights[ids.clamp(0, self.token_weights.shape[0] - 1)] * real
        flat = weights.reshape(-1)
        n_target = min(math.ceil(self.mlm_probability * int(real.sum())), int((flat > 0).sum()))
        selected = torch.zeros_like(flat, dtype=torch.bool)
        if n_target > 0:
            selected[torch.multinomial(flat / flat.sum(), n_target, replacement=False, generator=g)] = True
        selected = selected.view_as(ids)

        labels = torch.full_like(ids, -100)
        labels[selected] = ids[selected]
        originals = ids[selected]
        if originals.numel() == 0:  # nothing maskable in this batch (only special tokens): labels stay -100
            batch["labels"] = labels
            return batch
        action = torch.multinomial(self.pred_probs, originals.numel(), replacement=True, generator=g)
        random_ids = torch.randint(self.vocab_size, originals.shape, generator=g)
        new = torch.where(action == 0, torch.full_like(originals, self.tokenizer.mask_token_id), originals)
        new = torch.where(action == 2, random_ids, new)
        ids = ids.clone()
        ids[selected] = new
        batch["input_ids"] = ids
        batch["labels"] = labels
        return batch
