"""Intermediate-layer distillation bound to a concrete student and teacher.

`IntermediateDistiller` turns the declarative terms of `DistillationArguments` into: validated layer
pairs, the exact set of features each model must expose (so nothing else is captured), the projections
needed when widths differ, and, per step, one loss value per logged component. Every shape problem is
raised here, when the trainer is built, not at the first step.
"""

from __future__ import annotations

import torch
from torch import nn

from . import layer_map, losses
from .projections import Projections
from .taps import Features, FeatureTaps, ModelInfo, TapRequest, attention_scores, model_info
from .terms import DistillTerm


class IntermediateDistiller:
    """Validated terms with their layer pairs, the taps of both models and the projections."""

    def __init__(self, terms: list[DistillTerm], student: nn.Module, teacher: nn.Module, projection: str) -> None:
        s, t = model_info(student), model_info(teacher)
        self.student_info, self.teacher_info = s, t
        self.bound: list[tuple[DistillTerm, list[tuple[int, int]], int | None]] = []
        s_req, t_req = TapRequest(), TapRequest()
        projected_layers: list[int] = []
        for term in terms:
            what = f"distill_terms[{term.name}] ({term.loss})"
            for info, role in ((s, "student"), (t, "teacher")):
                if info.num_layers is None or info.hidden_size is None:
                    raise ValueError(
                        f"{what}: the {role} has no transformers config with num_hidden_layers/hidden_size, "
                        "so intermediate layers cannot be matched. Use logit distillation only (kd_weight)."
                    )
            feature = term.feature
            pairs = layer_map.resolve(term.layers, s.num_layers, t.num_layers, feature == "hidden", what)
            heads = None
            if feature in ("hidden", "cls"):
                if s.hidden_size != t.hidden_size:
                    if projection == "none":
                        raise ValueError(
                            f"{what}: hidden sizes differ (student {s.hidden_size}, teacher {t.hidden_size}) "
                            "and projection='none'. Set projection='shared' or 'per_layer' to learn a map "
                            "from the student's width to the teacher's."
                        )
                    projected_layers += [p[0] for p in pairs]
                for ls, lt in pairs:
                    s_req.hidden.add(ls)
                    t_req.hidden.add(lt)
            elif feature == "attention":
                _need_heads(s, t, what)
                if s.num_heads != t.num_heads:
                    raise ValueError(
                        f"{what}: attention_score_mse compares scores head by head, but the student has "
                        f"{s.num_heads} heads and the teacher {t.num_heads}. Give the student "
                        f"{t.num_heads} heads, or use relation_kl with relation_heads (MiniLMv2), which "
                        "works across head counts."
                    )
                for ls, lt in pairs:
                    s_req.q.add(ls), s_req.k.add(ls)
                    t_req.q.add(lt), t_req.k.add(lt)
            else:  # qkv relations
                heads = _relation_heads(term, s, t, what)
                for ls, lt in pairs:
                    for rel in term.relations:
                        for kind in set(rel):
                            getattr(s_req, kind).add(ls)
                            getattr(t_req, kind).add(lt)
            self.bound.append((term, pairs, heads))
        self.student_taps = FeatureTaps(student, s_req, "student")
        self.teacher_taps = FeatureTaps(teacher, t_req, "teacher")
        self.projections: Projections | None = None
        if projected_layers:
            self.projections = Projections(s.hidden_size, t.hidden_size, projection, projected_layers)

    def component_names(self) -> list[str]:
        return [n for term, _, _ in self.bound for n in term.component_names()]

    def weights(self) -> dict[str, float]:
        return {n: term.weight for term, _, _ in self.bound for n in term.component_names()}

    def _project(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        if self.projections is None:
            return x
        # Features may be bf16 (autocast); projections and losses run in float32.
        return self.projections(x.float(), layer)

    def losses(self, s: Features, t: Features, mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """One value per component, each summed over the term's layer pairs (as TinyBERT sums layers)."""
        out: dict[str, torch.Tensor] = {}
        sh, th = self.student_info.num_heads, self.teacher_info.num_heads
        for term, pairs, heads in self.bound:
            if term.loss in ("hidden_mse", "cosine_loss"):
                fn = losses.FEATURE_LOSSES[term.loss]
                out[term.name] = sum(fn(self._project(s.hidden[a], a), t.hidden[b], mask) for a, b in pairs)
            elif term.loss == "pkd_loss":
                out[term.name] = sum(
                    losses.pkd_loss(self._project(s.hidden[a][:, 0], a), t.hidden[b][:, 0]) for a, b in pairs
                )
            elif term.loss == "attention_score_mse":
                out[term.name] = sum(
                    losses.attention_score_mse(
                        attention_scores(s.q[a], s.k[a], sh), attention_scores(t.q[b], t.k[b], th), mask
                    )
                    for a, b in pairs
                )
            else:
                for rel in term.relations:
                    x, y = rel[0], rel[1]
                    out[f"{term.name}_{rel}"] = sum(
                        losses.relation_kl(
                            getattr(s, x)[a], getattr(s, y)[a], getattr(t, x)[b], getattr(t, y)[b], heads, mask
                        )
                        for a, b in pairs
                    )
        return out


def _need_heads(s: ModelInfo, t: ModelInfo, what: str) -> None:
    if s.num_heads is None or t.num_heads is None:
        raise ValueError(f"{what}: both configs must define num_attention_heads.")


def _relation_heads(term: DistillTerm, s: ModelInfo, t: ModelInfo, what: str) -> int:
    _need_heads(s, t, what)
    heads = term.relation_heads
    if heads is None:
        if s.num_heads != t.num_heads:
            raise ValueError(
                f"{what}: the student has {s.num_heads} attention heads and the teacher {t.num_heads}; "
                "relations over each model's own heads need equal counts. Set relation_heads (MiniLMv2) "
                "to a number that divides both hidden sizes."
            )
        heads = s.num_heads
    for info, role in ((s, "student"), (t, "teacher")):
        if info.hidden_size % heads:
            raise ValueError(
                f"{what}: relation_heads={heads} does not divide the {role}'s hidden size {info.hidden_size}. "
                "Choose a number of relation heads that divides both hidden sizes."
            )
    return heads
