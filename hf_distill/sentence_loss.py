"""`EmbeddingDistillationLoss`: a sentence-transformers loss module that distils a teacher's sentence embeddings.

It wraps the user's sentence-transformers loss (or none) so that `SentenceTransformerTrainer` keeps doing what it
does with a loss: call it on each batch's features, sum and log the components it returns, list it (and the loss it
wraps) with its parameters and citation in the model card. `hf_distill.sentence.DistillationSentenceTransformerTrainer`
builds it; it needs no sentence-transformers import itself.

The student runs once per text column: the wrapped loss's own calls of the model on the same features reuse those
outputs (`shared_forward`), so the task loss and the distillation see one forward (one dropout mask), as
`DistillationTrainer` computes both from one forward.

The embedding term (Reimers & Gurevych 2020): MSE (mean over every element, as sentence-transformers' `MSELoss`)
and/or mean cosine distance `1 - cos` between the student's and the teacher's embedding of each text column, in the
space the user picks: `output` (what `encode` returns, after every module: Dense, Normalize), `pooled` (the Pooling
module's output, before any Dense or Normalize: the raw embedding) or `normalized` (the output L2-normalised). A
student narrower than the teacher is mapped to the teacher's width by a trained Linear first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .features.taps import Features, unwrap

SPACES = ("output", "pooled", "normalized")
EMBEDDING_LOSSES = ("mse", "cosine", "mse+cosine")
TEACHER_INPUTS = "teacher_inputs"  # batch key: the teacher's own tokenization of each text column
CACHED_EMBEDDING = "teacher_sentence_embedding"  # batch key: the cached teacher embeddings (one text column)

CITATION = """@inproceedings{reimers-2020-multilingual-sentence-bert,
    title = "Making Monolingual Sentence Embeddings Multilingual using Knowledge Distillation",
    author = "Reimers, Nils and Gurevych, Iryna",
    booktitle = "Proceedings of the 2020 Conference on Empirical Methods in Natural Language Processing",
    month = "11",
    year = "2020",
    publisher = "Association for Computational Linguistics",
    url = "https://arxiv.org/abs/2004.09813",
}"""


def embedding_kd(student: torch.Tensor, teacher: torch.Tensor, loss: str) -> torch.Tensor:
    """The embedding term between (B, D) student and teacher embeddings, in float32: `mse` (mean over all
    elements), `cosine` (mean of 1 - cosine similarity over rows) or their sum."""
    s, t = student.float(), teacher.float()
    value = s.new_zeros(())
    if loss in ("mse", "mse+cosine"):
        value = value + F.mse_loss(s, t)
    if loss in ("cosine", "mse+cosine"):
        value = value + (1 - F.cosine_similarity(s, t, dim=-1)).mean()
    return value


def pooling_module(model: nn.Module) -> nn.Module | None:
    """The (first) Pooling module of a SentenceTransformer, where the `pooled` space is read."""
    return next((m for m in unwrap(model).children() if type(m).__name__ == "Pooling"), None)


def routes_by_task(model: nn.Module) -> bool:
    """Whether a SentenceTransformer's first module is a Router (each task, e.g. query or document, on its own
    modules) rather than one transformer: what it embeds depends on the route, and it has no `auto_model` to tap."""
    return not hasattr(unwrap(model)[0], "auto_model")


@contextlib.contextmanager
def shared_forward(model: nn.Module) -> Iterator[dict[int, Any]]:
    """While inside, calling `model` on a features dict whose id is in the yielded memo returns the stored outputs
    instead of running the model again (the wrapped loss re-runs the student on the features we already ran)."""
    memo: dict[int, Any] = {}
    own = "forward" in vars(model)
    original = model.forward

    def forward(features: Any, *args: Any, **kwargs: Any) -> Any:
        hit = memo.get(id(features)) if not args and not kwargs else None
        return hit if hit is not None else original(features, *args, **kwargs)

    model.forward = forward
    try:
        yield memo
    finally:
        if own:
            model.forward = original
        else:
            del model.forward


def _run(model: nn.Module, features: dict[str, Any], space: str, taps: Any) -> tuple[Any, torch.Tensor, Features]:
    """One SentenceTransformer forward (hooks of `taps` attached when given): its outputs, the embedding in `space`
    and the captured intermediate features."""
    pooled: dict[str, torch.Tensor] = {}
    handle = None
    if space == "pooled":
        def keep(_m, _inp, out):
            pooled["x"] = out["sentence_embedding"]

        handle = pooling_module(model).register_forward_hook(keep)
    try:
        with taps.capture() if taps is not None else contextlib.nullcontext(Features()) as feats:
            out = model(dict(features))
    finally:
        if handle is not None:
            handle.remove()
    emb = pooled["x"] if space == "pooled" else out["sentence_embedding"]
    if space == "normalized":
        emb = F.normalize(emb.float(), dim=-1)
    return out, emb, feats


class EmbeddingDistillationLoss(nn.Module):
    """`kd_weight` x the embedding term + `task_weight` x the wrapped sentence-transformers `loss` (when given) +
    each intermediate term's weight x the term, returned as a dict so the trainer sums and logs them (`kd`, `task`,
    one per term).

    Args:
        model: the student SentenceTransformer (the trainer swaps in the wrapped one, as for its own losses).
        teacher: the teacher SentenceTransformer (frozen, on the student's device), or None with cached embeddings.
        loss: the sentence-transformers loss trained alongside, or None (distillation alone).
        projection: Linear(student width -> teacher width), or None when the widths match.
        intermediate: the intermediate terms on the underlying transformers (IntermediateDistiller), or None.
        config: what the model card lists as this loss's parameters (teacher, losses, weights, terms).
    """

    def __init__(self, model: nn.Module, teacher: nn.Module | None, loss: nn.Module | None, *, embedding_loss: str,
                 embedding_space: str, kd_weight: float, task_weight: float, projection: nn.Module | None,
                 intermediate: Any, config: dict[str, Any]) -> None:
        super().__init__()
        self.model = model
        if loss is not None:  # (an attribute `loss` = None would be listed in the model card as a loss)
            self.loss = loss
        object.__setattr__(self, "teacher", teacher)  # not a submodule: never trained, moved or swapped for the student
        self.projection = projection
        object.__setattr__(self, "intermediate", intermediate)
        self.embedding_loss, self.embedding_space = embedding_loss, embedding_space
        self.kd_weight, self.task_weight = kd_weight, task_weight
        self._config = config
        self.pending: dict[str, Any] = {}  # this batch's cached embeddings / teacher inputs (the trainer sets them)
        # the autocast the student's forward runs in (the trainer sets accelerate's): the teacher runs in it too
        self.teacher_autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    @property
    def citation(self) -> str:
        return CITATION

    def get_config_dict(self) -> dict[str, Any]:
        """The distillation settings, which sentence-transformers' model card prints with the loss."""
        return dict(self._config)

    def forward(self, sentence_features: list[dict[str, Any]], labels: torch.Tensor | None) -> dict[str, torch.Tensor]:
        extra, self.pending = self.pending, {}
        cached, t_inputs = extra.get(CACHED_EMBEDDING), extra.get(TEACHER_INPUTS)
        terms = self.intermediate is not None and bool(self.intermediate.active)
        out: dict[str, torch.Tensor] = {}
        with shared_forward(self.model) as memo:
            if self.kd_weight > 0 or terms:
                if self.intermediate is not None:
                    self.intermediate.bind_student(unwrap(self.model)[0].auto_model)
                kd, inter = [], []
                for i, features in enumerate(sentence_features):
                    s_taps = self.intermediate.student_taps if terms else None
                    memo[id(features)], s_emb, s_feats = _run(self.model, features, self.embedding_space, s_taps)
                    t_emb, t_feats = self._teacher(cached, t_inputs[i] if t_inputs is not None else features, terms)
                    if self.projection is not None:
                        s_emb = self.projection(s_emb.float())
                        if self.embedding_space == "normalized":
                            s_emb = F.normalize(s_emb, dim=-1)
                    kd.append(embedding_kd(s_emb, t_emb, self.embedding_loss))
                    if terms:
                        inter.append(self.intermediate.losses(s_feats, t_feats, features.get("attention_mask")))
                if self.kd_weight > 0:
                    out["kd"] = self.kd_weight * torch.stack(kd).mean()
                if terms:
                    weights = self.intermediate.weights()
                    for name in inter[0]:
                        out[name] = weights[name] * torch.stack([d[name] for d in inter]).mean()
            inner = getattr(self, "loss", None)
            if inner is not None and self.task_weight > 0:
                task = inner(sentence_features, labels)
                task = torch.stack(list(task.values())).sum() if isinstance(task, dict) else task
                out["task"] = self.task_weight * task
        return out

    @torch.no_grad()
    def _teacher(self, cached: torch.Tensor | None, features: dict[str, Any], terms: bool):
        """The teacher's embedding of one text column in the chosen space (the cached one when the batch has it),
        and its intermediate features when terms are active."""
        if cached is not None:
            emb = cached.float()
            return (F.normalize(emb, dim=-1) if self.embedding_space == "normalized" else emb), None
        taps = self.intermediate.teacher_taps if terms else None
        with self.teacher_autocast():
            _, emb, feats = _run(self.teacher, features, self.embedding_space, taps)
        return emb.float(), feats
