"""Layer maps: which teacher layer each student layer learns from.

Numbering is that of `hidden_states`: 0 is the embedding output, `i` the output of block `i`. Hidden
states may use layer 0; attention scores, Q/K/V and [CLS] vectors exist for blocks 1..L only.
"""

from __future__ import annotations

LayerPairs = list[tuple[int, int]]


def uniform(student_layers: int, teacher_layers: int, include_embeddings: bool) -> LayerPairs:
    """TinyBERT's map: student layer m learns from teacher layer m * k, k = teacher_layers / student_layers."""
    if student_layers <= 0 or teacher_layers % student_layers:
        raise ValueError(
            f"layers=uniform needs the teacher's layer count ({teacher_layers}) to be a multiple of the "
            f"student's ({student_layers}). Give explicit student:teacher pairs instead."
        )
    k = teacher_layers // student_layers
    start = 0 if include_embeddings else 1
    return [(m, m * k) for m in range(start, student_layers + 1)]


def last(student_layers: int, teacher_layers: int) -> LayerPairs:
    """MiniLM's map: the student's last block learns from the teacher's last block."""
    return [(student_layers, teacher_layers)]


def resolve(
    spec: str | LayerPairs, student_layers: int, teacher_layers: int, include_embeddings: bool, what: str = ""
) -> LayerPairs:
    """Turn a term's `layers` into validated (student, teacher) pairs for models of the given depths."""
    if spec == "uniform":
        pairs = uniform(student_layers, teacher_layers, include_embeddings)
    elif spec == "last":
        pairs = last(student_layers, teacher_layers)
    else:
        pairs = [(int(s), int(t)) for s, t in spec]
    lo = 0 if include_embeddings else 1
    label = f"{what}: " if what else ""
    for s, t in pairs:
        if not lo <= s <= student_layers:
            raise ValueError(
                f"{label}student layer {s} is out of range: the student has {student_layers} layers, valid "
                f"indices are {lo}..{student_layers}" + (" (0 = embeddings)." if lo == 0 else ".")
            )
        if not lo <= t <= teacher_layers:
            raise ValueError(
                f"{label}teacher layer {t} is out of range: the teacher has {teacher_layers} layers, valid "
                f"indices are {lo}..{teacher_layers}" + (" (0 = embeddings)." if lo == 0 else ".")
            )
    if not pairs:
        raise ValueError(f"{label}the layer map is empty.")
    return pairs
