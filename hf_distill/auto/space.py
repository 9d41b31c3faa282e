"""The search space of `auto_student`: candidate student shapes and how each is built from the teacher.

A :class:`Candidate` is one student: a pruned teacher (``prune``: :func:`~hf_distill.students.prune_width`, which
also drops blocks by Block Influence, so depth x width), the teacher's evenly spaced layers (``copy``:
:func:`~hf_distill.students.from_teacher`, DistilBERT-style) or a smaller random model (``shrink``:
:func:`~hf_distill.students.shrink`, TinyBERT-style). :func:`candidate_grid` turns fractions of the teacher into
candidates; the default grid is

* ``prune``: depths ``DEFAULT_DEPTHS = (1.0, 0.5, 0.25)`` x widths ``DEFAULT_WIDTHS = (1.0, 0.75, 0.5)`` of the
  teacher's blocks and of its heads, MLP channels and hidden channels (a width is one fraction for all three, or a
  ``(heads, intermediate, hidden)`` triple), less depth 1 x width 1 (the teacher itself): 8 shapes;
* ``copy``: ``DEFAULT_COPY_DEPTHS = (0.5,)``, every other teacher layer;
* ``shrink``: ``DEFAULT_SHRINK = ((0.5, 0.5),)``, half the depth at half the width, randomly initialised.

Counts are rounded to the nearest whole unit (at least one); heads to whole grouped-query groups. In families whose
head size is ``hidden_size / num_attention_heads`` (BERT, RoBERTa, DistilBERT, GPT-2) the hidden size follows the
heads, as in :func:`~hf_distill.students.prune_width`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and transformers load on first use: `hf-distill --help` reads the defaults below
    from transformers import PreTrainedModel

    from ..students.width import WidthImportance

__all__ = ["DEFAULT_COPY_DEPTHS", "DEFAULT_DEPTHS", "DEFAULT_SHRINK", "DEFAULT_WIDTHS", "KINDS", "Candidate",
           "candidate_grid"]

DEFAULT_DEPTHS = (1.0, 0.5, 0.25)
DEFAULT_WIDTHS = (1.0, 0.75, 0.5)
DEFAULT_COPY_DEPTHS = (0.5,)
DEFAULT_SHRINK = ((0.5, 0.5),)
KINDS = ("prune", "copy", "shrink")
Width = float | tuple[float, float, float]


@dataclass(frozen=True)
class Candidate:
    """One student shape: ``kind`` (prune, copy or shrink) and its size. ``copy`` keeps ``num_layers`` evenly
    spaced teacher layers at the teacher's width (its width fields are the teacher's)."""

    kind: str
    num_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_size: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Candidate kind {self.kind!r} is not one of {', '.join(KINDS)}.")
        for name in ("num_layers", "num_attention_heads", "intermediate_size", "hidden_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Candidate {name} must be a positive int, got {value!r}.")

    @property
    def name(self) -> str:
        """A folder-safe name, e.g. ``prune_L3_H6_I768_D192`` or ``copy_L3``."""
        if self.kind == "copy":
            return f"copy_L{self.num_layers}"
        return (f"{self.kind}_L{self.num_layers}_H{self.num_attention_heads}_I{self.intermediate_size}"
                f"_D{self.hidden_size}")

    def shape(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if k != "kind"}

    def build(self, teacher: PreTrainedModel, importance: WidthImportance | None = None,
              seed: int = 42) -> PreTrainedModel:
        """The student, fresh each call (built the same way every time: ``seed`` initialises a shrunk one)."""
        from ..students.build import encoder_layers, from_teacher, shrink
        from ..students.width import _shape, _width_family, prune_width

        if self.kind == "copy":
            total = len(encoder_layers(teacher))
            if self.num_layers > total:
                raise ValueError(f"Candidate {self.name}: the teacher has only {total} layers.")
            return from_teacher(teacher, spaced_layers(total, self.num_layers))
        if self.kind == "shrink":
            return shrink(teacher, self.num_layers, self.hidden_size, self.num_attention_heads,
                          self.intermediate_size, seed=seed)
        if importance is None:
            raise ValueError(f"Candidate {self.name} is pruned: it needs the teacher's width_importance.")
        family = _width_family(teacher)
        explicit = _shape(teacher, family).explicit_head_dim
        student, _ = prune_width(teacher, importance=importance, num_layers=self.num_layers,
                                 num_attention_heads=self.num_attention_heads,
                                 intermediate_size=self.intermediate_size,
                                 hidden_size=self.hidden_size if explicit else None)
        return student


def spaced_layers(total: int, keep: int) -> list[int]:
    """``keep`` evenly spaced layers of ``total``, starting at 0 (6 -> 3: ``[0, 2, 4]``, DistilBERT's rule)."""
    return sorted({round(i * total / keep) for i in range(keep)})


def _fraction(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{name} must hold fractions of the teacher in (0, 1], got {value!r}.")
    return float(value)


def _width(value: Width) -> tuple[float, float, float]:
    if isinstance(value, (tuple, list)):
        if len(value) != 3:
            raise ValueError(f"a width is one fraction or (heads, intermediate, hidden) fractions, got {value!r}.")
        return tuple(_fraction("widths", v) for v in value)  # type: ignore[return-value]
    f = _fraction("widths", value)
    return f, f, f


def candidate_grid(
    teacher: PreTrainedModel,
    depths: Iterable[float] = DEFAULT_DEPTHS,
    widths: Iterable[Width] = DEFAULT_WIDTHS,
    copy_depths: Iterable[float] = DEFAULT_COPY_DEPTHS,
    shrink_shapes: Iterable[Sequence[float]] = DEFAULT_SHRINK,
) -> list[Candidate]:
    """The candidates of a grid of fractions of the teacher (module docstring), duplicates and the teacher's own
    shape left out, in the order given."""
    from ..students.width import _shape, _width_family

    family = _width_family(teacher)
    s = _shape(teacher, family)
    group = s.heads // s.kv_heads

    def count(fraction: float, total: int, unit: int = 1) -> int:
        return max(unit, round(fraction * total / unit) * unit)

    def sized(kind: str, depth: float, width: Width) -> Candidate:
        f_heads, f_inter, f_hidden = _width(width)
        heads = count(f_heads, s.heads, group)
        hidden = count(f_hidden, s.hidden) if s.explicit_head_dim else heads * s.head_dim
        if not s.explicit_head_dim and f_hidden != f_heads:
            raise ValueError(
                f"width {width!r}: in {teacher.config.model_type} the hidden size follows the heads (hidden_size = "
                f"num_attention_heads * {s.head_dim}), so give the same heads and hidden fractions.")
        return Candidate(kind, count(_fraction("depths", depth), s.layers), heads, count(f_inter, s.intermediate),
                         hidden)

    teacher_shape = {"num_layers": s.layers, "num_attention_heads": s.heads, "intermediate_size": s.intermediate,
                     "hidden_size": s.hidden}
    found = [sized("prune", d, w) for d in depths for w in widths]
    found += [Candidate("copy", count(_fraction("copy_depths", d), s.layers), s.heads, s.intermediate, s.hidden)
              for d in copy_depths]
    for pair in shrink_shapes:
        if len(pair) != 2:
            raise ValueError(f"shrink_shapes holds (depth, width) fraction pairs, got {pair!r}.")
        found.append(sized("shrink", pair[0], pair[1]))
    unique = list(dict.fromkeys(c for c in found if c.kind == "shrink" or c.shape() != teacher_shape))
    if not unique:
        raise ValueError("The grid holds no student: every shape is the teacher's own. Add depths or widths below 1.")
    return unique
